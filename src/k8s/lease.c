/* src/k8s/lease.c: see lease.h. */
#include "k8s/lease.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "base/clock.h"
#include "k8s/kube.h"
#include "base/log.h"

struct lease {
    struct lease_config cfg;
    char *namespace, *name, *identity;
    char path[512], collection[512];
    pthread_t thread;
    atomic_bool stop, abandon, leader;
    atomic_uint_fast64_t transitions;
    /* What this candidate last saw, and when (its own clock). */
    char *seen_holder, *seen_renew;
    uint64_t seen_at;
};

static void now_rfc3339(char *buf, size_t n)
{
    struct timespec ts;
    struct tm tm;
    char base[32];

    clock_gettime(CLOCK_REALTIME, &ts);
    gmtime_r(&ts.tv_sec, &tm);
    strftime(base, sizeof(base), "%Y-%m-%dT%H:%M:%S", &tm);
    snprintf(buf, n, "%.19s.%06uZ", base, (unsigned)(ts.tv_nsec / 1000) % 1000000u);
}

static const char *spec_str(const cJSON *lease, const char *field)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(
        cJSON_GetObjectItemCaseSensitive(lease, "spec"), field);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

static double transitions_of(const cJSON *lease)
{
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(lease, "spec"),
                                                      "leaseTransitions");
    return cJSON_IsNumber(t) ? t->valuedouble : 0;
}

static bool same(const char *a, const char *b)
{
    return (!a && !b) || (a && b && strcmp(a, b) == 0);
}

/* Notes the record we just read; a change restarts the expiry clock. */
static void observe(struct lease *l, const char *holder, const char *renew, uint64_t now)
{
    if (same(holder, l->seen_holder) && same(renew, l->seen_renew) && l->seen_at)
        return;
    free(l->seen_holder);
    free(l->seen_renew);
    l->seen_holder = holder ? strdup(holder) : NULL;
    l->seen_renew = renew ? strdup(renew) : NULL;
    l->seen_at = now;
}

static cJSON *lease_object(const struct lease *l, const char *holder, uint32_t duration_s,
                           const char *acquire, const char *renew, double transitions,
                           const char *rv)
{
    cJSON *o = cJSON_CreateObject(), *meta, *spec;

    cJSON_AddStringToObject(o, "apiVersion", "coordination.k8s.io/v1");
    cJSON_AddStringToObject(o, "kind", "Lease");
    meta = cJSON_AddObjectToObject(o, "metadata");
    cJSON_AddStringToObject(meta, "name", l->name);
    cJSON_AddStringToObject(meta, "namespace", l->namespace);
    if (rv)
        cJSON_AddStringToObject(meta, "resourceVersion", rv);
    spec = cJSON_AddObjectToObject(o, "spec");
    cJSON_AddStringToObject(spec, "holderIdentity", holder);
    cJSON_AddNumberToObject(spec, "leaseDurationSeconds", duration_s);
    cJSON_AddStringToObject(spec, "acquireTime", acquire);
    cJSON_AddStringToObject(spec, "renewTime", renew);
    cJSON_AddNumberToObject(spec, "leaseTransitions", transitions);
    return o;
}

/* One attempt to take or keep the Lease. Returns 0 when we hold it. */
static int try_acquire_or_renew(struct lease *l, uint64_t now)
{
    uint32_t dur_s = (l->cfg.lease_duration_ms + 999) / 1000;
    char stamp[48];
    cJSON *cur = NULL, *next = NULL;
    const char *holder, *renew, *acquire;
    double transitions = 0;
    int rc;

    now_rfc3339(stamp, sizeof(stamp));
    rc = kube_get(l->cfg.kube, l->path, &cur);
    if (rc == -ENOENT) {
        next = lease_object(l, l->identity, dur_s, stamp, stamp, 0, NULL);
        rc = next ? kube_create_object(l->cfg.kube, l->collection, next, NULL) : -ENOMEM;
        cJSON_Delete(next);
        if (rc == 0)
            observe(l, l->identity, stamp, now);
        return rc;
    }
    if (rc < 0)
        return rc;
    holder = spec_str(cur, "holderIdentity");
    renew = spec_str(cur, "renewTime");
    acquire = spec_str(cur, "acquireTime");
    observe(l, holder, renew, now);
    if (holder && *holder && strcmp(holder, l->identity) != 0 &&
        now < l->seen_at + l->cfg.lease_duration_ms) {
        cJSON_Delete(cur);
        return -EBUSY;          /* held by someone who is still renewing */
    }
    transitions = transitions_of(cur);
    bool ours = holder && strcmp(holder, l->identity) == 0;
    next = lease_object(l, l->identity, dur_s, ours && acquire ? acquire : stamp, stamp,
                        ours ? transitions : transitions + 1, kube_meta(cur, "resourceVersion"));
    rc = next ? kube_replace(l->cfg.kube, l->path, next, NULL) : -ENOMEM;
    if (rc == 0)
        observe(l, l->identity, stamp, now);
    cJSON_Delete(next);
    cJSON_Delete(cur);
    return rc;      /* -ESTALE: someone else wrote first */
}

static void release(struct lease *l)
{
    char stamp[48];
    cJSON *cur = NULL, *next;
    const char *holder;

    if (kube_get(l->cfg.kube, l->path, &cur) < 0)
        return;
    holder = spec_str(cur, "holderIdentity");
    if (holder && strcmp(holder, l->identity) == 0) {
        now_rfc3339(stamp, sizeof(stamp));
        /* An empty holder with a one-second duration: free at once. */
        next = lease_object(l, "", 1, stamp, stamp, transitions_of(cur),
                            kube_meta(cur, "resourceVersion"));
        if (next && kube_replace(l->cfg.kube, l->path, next, NULL) == 0)
            log_info("lease", "Released the leadership lease.", LF_S("lease", l->name),
                     LF_S("identity", l->identity));
        cJSON_Delete(next);
    }
    cJSON_Delete(cur);
}

static void set_leader(struct lease *l, bool leading)
{
    if (atomic_exchange(&l->leader, leading) == leading)
        return;
    atomic_fetch_add(&l->transitions, 1);
    log_info("lease", leading ? "Started leading." : "Stopped leading.", LF_S("lease", l->name),
             LF_S("identity", l->identity));
    if (l->cfg.on_change)
        l->cfg.on_change(l->cfg.arg, leading);
}

/* Sleeps `ms` plus up to 20% jitter, so candidates do not move in step. */
static void wait_period(struct lease *l, uint32_t ms)
{
    uint32_t r = 0;
    uint64_t end;

    if (getrandom(&r, sizeof(r), 0) != sizeof(r))
        r = 0;
    end = clock_now_ms() + ms + (ms / 5 ? r % (ms / 5) : 0);
    while (!atomic_load(&l->stop) && clock_now_ms() < end)
        clock_sleep_ms(20);
}

static void *lease_main(void *arg)
{
    struct lease *l = arg;
    uint64_t last_ok = 0;

    while (!atomic_load(&l->stop)) {
        uint64_t now = clock_now_ms();
        int rc = try_acquire_or_renew(l, now);

        if (rc == 0) {
            last_ok = now;
            set_leader(l, true);
        } else if (atomic_load(&l->leader) && now - last_ok >= l->cfg.renew_deadline_ms) {
            /* Stop before the Lease can expire for the others. */
            log_warn("lease", "Could not renew the leadership lease in time.", LF_S("lease", l->name),
                     LF_S("error", kube_strerror(rc)));
            set_leader(l, false);
        } else if (!atomic_load(&l->leader) && rc != -EBUSY && rc != -ESTALE) {
            log_warn("lease", "A leadership lease attempt failed.", LF_S("lease", l->name), LF_S("error", kube_strerror(rc)));
        }
        wait_period(l, l->cfg.retry_period_ms);
    }
    if (atomic_load(&l->leader) && !atomic_load(&l->abandon))
        release(l);
    set_leader(l, false);
    return NULL;
}

int lease_start(const struct lease_config *cfg, struct lease **out)
{
    struct lease *l;
    int w1, w2;

    if (!cfg || !cfg->kube || !cfg->namespace || !cfg->name || !cfg->identity || !*cfg->identity)
        return -EINVAL;
    l = calloc(1, sizeof(*l));
    if (!l)
        return -ENOMEM;
    l->cfg = *cfg;
    if (!l->cfg.lease_duration_ms)
        l->cfg.lease_duration_ms = 15000;
    if (!l->cfg.renew_deadline_ms)
        l->cfg.renew_deadline_ms = 10000;
    if (!l->cfg.retry_period_ms)
        l->cfg.retry_period_ms = 2000;
    if (!(l->cfg.retry_period_ms < l->cfg.renew_deadline_ms &&
          l->cfg.renew_deadline_ms < l->cfg.lease_duration_ms)) {
        free(l);
        return -EINVAL;
    }
    l->namespace = strdup(cfg->namespace);
    l->name = strdup(cfg->name);
    l->identity = strdup(cfg->identity);
    w1 = snprintf(l->collection, sizeof(l->collection),
                  "/apis/coordination.k8s.io/v1/namespaces/%s/leases", cfg->namespace);
    w2 = snprintf(l->path, sizeof(l->path), "%s/%s", l->collection, cfg->name);
    if (!l->namespace || !l->name || !l->identity || w1 < 0 || (size_t)w1 >= sizeof(l->collection) ||
        w2 < 0 || (size_t)w2 >= sizeof(l->path))
        goto err;
    if (pthread_create(&l->thread, NULL, lease_main, l) != 0)
        goto err;
    *out = l;
    return 0;
err:
    free(l->namespace);
    free(l->name);
    free(l->identity);
    free(l);
    return -ENOMEM;
}

static void stop(struct lease *l, bool abandon)
{
    atomic_store(&l->abandon, abandon);
    atomic_store(&l->stop, true);
    pthread_join(l->thread, NULL);
    free(l->seen_holder);
    free(l->seen_renew);
    free(l->namespace);
    free(l->name);
    free(l->identity);
    free(l);
}

void lease_destroy(struct lease *l)
{
    if (l)
        stop(l, false);
}

void lease_abandon(struct lease *l)
{
    if (l)
        stop(l, true);
}

bool lease_is_leader(struct lease *l)
{
    return atomic_load(&l->leader);
}

uint64_t lease_transitions(struct lease *l)
{
    return atomic_load(&l->transitions);
}

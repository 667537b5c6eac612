/* src/k8s/controller.c: see controller.h.
 *
 * Threads: three reflectors (cohorts, pods, Secrets), `workers` reconcilers pulling
 * keys from one work queue, and a ticker that compares the broker's
 * membership with what was last seen and requeues the cohorts whose
 * membership moved. The work queue never hands one key to two workers,
 * so a cohort's state below is touched by one reconcile at a time; the
 * state table itself is under `lock`. */
#include "k8s/controller.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "membership/broker.h"
#include "membership/brokerd.h"
#include "base/clock.h"
#include "base/ident.h"
#include "base/secret.h"
#include "k8s/drain.h"
#include "k8s/evrec.h"
#include "k8s/keys.h"
#include "k8s/kube.h"
#include "base/limits.h"
#include "base/log.h"
#include "k8s/reflector.h"
#include "k8s/workq.h"

#define PATH_MAX_ 768
#define WORKERS_MAX 16
#define POLL_AGAIN_MS 250           /* while pods start or drains run */
#define HANDLED_MAX 256             /* failed pod uids remembered per cohort */
#define RESTART_TIMES 1024          /* replacement times kept for the budget's window */
#define SKIPS_TOLD 16               /* skipped checkpoint versions told in an Event */

/* One ordinal's crash loop and its last failure. */
struct ostate {
    uint32_t ordinal;
    struct reconcile_backoff backoff;
    char uid[64];                   /* the failed pod whose failure was counted */
    bool has_failure;
    struct reconcile_failure failure;
    char at[32];                    /* when it was seen, RFC 3339 */
    char waiting[RECONCILE_REASON_MAX];     /* a waiting reason already told in an Event */
};

/* What one cohort's reconciles remember. */
struct cstate {
    char key[LIMIT_KUBE_KEY_MAX];
    bool restarts_known;
    uint32_t restarts;
    uint64_t restart_at[RESTART_TIMES];     /* ring: when replacements were made */
    size_t n_restart_at, next_restart_at;
    struct ostate *ords;
    size_t n_ords;
    bool has_refused;               /* the API refused a create or delete in the last pass */
    struct reconcile_why refused;
    char *handled[HANDLED_MAX];     /* uids of failed pods already replaced */
    size_t n_handled, next_handled;
    struct drain_set drains;        /* members being drained before their pods go */
    cJSON *written;                 /* the status last written */
    uint64_t written_at;
    uint32_t declared_hb, declared_to;
    bool invalid_reported, failed_reported, complete_reported;
    uint64_t sig, vsig;             /* broker membership and versions last compared */
    bool seen;                      /* present in the last broker poll */
    bool has_key;                   /* the broker has the key of the Secret */
    uint64_t skips_told[SKIPS_TOLD];        /* ring: checkpoint versions told skipped */
    size_t n_skips_told, next_skip_told;
    bool skips_seeded;              /* status's lastSkipped counted as told */
    char key_id[KEYS_ID_CHARS + 1]; /* keys_id() of that key and the CA */
    uint64_t gpu_sig;               /* FNV-1a of the GPU claim template last made sure of, 0: none */
};

struct controller {
    struct controller_config cfg;
    char *namespace, *identity, *broker_address, *sidecar_image, *sidecar_command;
    char *broker_ca_pem, *broker_server_name;
    char cohorts_path[PATH_MAX_], pods_path[PATH_MAX_], secrets_path[PATH_MAX_];
    struct reflector *cohorts, *pods, *secrets;
    struct workq *q;
    struct evrec *events;
    pthread_t workers[WORKERS_MAX], ticker;
    uint32_t n_workers;
    bool ticker_started;
    atomic_bool stop;
    pthread_mutex_t lock;           /* guards states */
    struct cstate **states;
    size_t n_states, cap_states;
    struct {
        atomic_uint_fast64_t reconciles, errors, created, deleted, replaced, drains,
            drain_timeouts, status_writes, events, keys_created, rolled;
    } n;
};

/* ---- small helpers ------------------------------------------------------ */

static const cJSON *get(const cJSON *o, const char *k)
{
    return cJSON_GetObjectItemCaseSensitive(o, k);
}

static const char *str(const cJSON *o, const char *k)
{
    const cJSON *v = get(o, k);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

/* metav1.Time: seconds, UTC. */
static void now_rfc3339(char *buf, size_t n)
{
    time_t t = time(NULL);
    struct tm tm;

    gmtime_r(&t, &tm);
    strftime(buf, n, "%Y-%m-%dT%H:%M:%SZ", &tm);
}

static int split_key(const char *key, char *ns, size_t nn, const char **name)
{
    const char *slash = strchr(key, '/');

    if (!slash || (size_t)(slash - key) >= nn)
        return -EINVAL;
    memcpy(ns, key, (size_t)(slash - key));
    ns[slash - key] = '\0';
    *name = slash + 1;
    return 0;
}

static struct cstate *state_of(struct controller *c, const char *key, bool create)
{
    struct cstate *s = NULL;

    pthread_mutex_lock(&c->lock);
    for (size_t i = 0; i < c->n_states; i++)
        if (strcmp(c->states[i]->key, key) == 0) {
            s = c->states[i];
            goto out;
        }
    if (!create || strlen(key) >= LIMIT_KUBE_KEY_MAX)
        goto out;
    if (c->n_states == c->cap_states) {
        size_t cap = c->cap_states ? c->cap_states * 2 : 64;
        struct cstate **ns = realloc(c->states, cap * sizeof(*ns));
        if (!ns)
            goto out;
        c->states = ns;
        c->cap_states = cap;
    }
    s = calloc(1, sizeof(*s));
    if (!s)
        goto out;
    snprintf(s->key, sizeof(s->key), "%s", key);
    c->states[c->n_states++] = s;
out:
    pthread_mutex_unlock(&c->lock);
    return s;
}

static void state_free(struct cstate *s)
{
    for (size_t i = 0; i < s->n_handled; i++)
        free(s->handled[i]);
    drain_set_cleanup(&s->drains);
    free(s->ords);
    cJSON_Delete(s->written);
    free(s);
}

static void state_drop(struct controller *c, const char *key)
{
    struct cstate *s = NULL;

    pthread_mutex_lock(&c->lock);
    for (size_t i = 0; i < c->n_states; i++)
        if (strcmp(c->states[i]->key, key) == 0) {
            s = c->states[i];
            c->states[i] = c->states[--c->n_states];
            break;
        }
    pthread_mutex_unlock(&c->lock);
    if (s)
        state_free(s);
}

static bool handled(const struct cstate *s, const char *uid)
{
    for (size_t i = 0; uid && i < s->n_handled; i++)
        if (strcmp(s->handled[i], uid) == 0)
            return true;
    return false;
}

/* Remembers a uid in a ring: old entries are for pods long gone. */
static void remember(struct cstate *s, const char *uid)
{
    char *d = uid ? strdup(uid) : NULL;

    if (!d)
        return;
    if (s->n_handled < HANDLED_MAX) {
        s->handled[s->n_handled++] = d;
        return;
    }
    free(s->handled[s->next_handled]);
    s->handled[s->next_handled] = d;
    s->next_handled = (s->next_handled + 1) % HANDLED_MAX;
}

/* ---- Events ------------------------------------------------------------- */

/* Records an Event on the cohort. Best effort: an Event that cannot be
 * written is logged and dropped, never retried (it must not hold up the
 * reconcile that caused it). */
static void event(struct controller *c, const cJSON *tc, bool warning, const char *reason,
                  const char *fmt, ...) __attribute__((format(printf, 5, 6)));

static void event(struct controller *c, const cJSON *tc, bool warning, const char *reason,
                  const char *fmt, ...)
{
    const cJSON *meta = get(tc, "metadata");
    const char *ns = str(meta, "namespace"), *name = str(meta, "name");
    char msg[1024], ename[EVREC_NAME_MAX], path[PATH_MAX_], stamp[32];
    char okey[LIMIT_KUBE_KEY_MAX];
    cJSON *ev, *m, *io, *src;
    uint32_t count = 0;
    uint64_t r = 0;
    va_list ap;
    int rc;

    if (!ns || !name)
        return;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    snprintf(okey, sizeof(okey), "%s/%s", ns, name);
    now_rfc3339(stamp, sizeof(stamp));
    switch (evrec_decide(c->events, okey, warning, reason, msg, clock_now_ms(), ename, &count)) {
    case EVREC_DROP:
        log_emit(warning ? LOG_WARN : LOG_INFO, "controller", msg, LF_S("cohort", name),
                 LF_S("namespace", ns), LF_S("reason", reason), LF_B("event_dropped", true),
                 LOG_END);
        return;
    case EVREC_PATCH:
        /* client-go's recorder: the same Event again raises its count. */
        snprintf(path, sizeof(path), "/api/v1/namespaces/%s/events/%s", ns, ename);
        ev = cJSON_CreateObject();
        if (!ev)
            return;
        cJSON_AddNumberToObject(ev, "count", count);
        cJSON_AddStringToObject(ev, "lastTimestamp", stamp);
        rc = kube_merge_patch(c->cfg.kube, path, ev, NULL);
        cJSON_Delete(ev);
        if (rc == 0) {
            atomic_fetch_add(&c->n.events, 1);
            log_emit(warning ? LOG_WARN : LOG_INFO, "controller", msg, LF_S("cohort", name),
                     LF_S("namespace", ns), LF_S("reason", reason), LF_U("count", count),
                     LOG_END);
            return;
        }
        /* Gone (Events expire) or refused: make a new one. */
        evrec_forget_event(c->events, ename);
        break;
    default:
        break;
    }
    if (getrandom(&r, sizeof(r), 0) != sizeof(r))
        r = clock_now_us();
    snprintf(ename, sizeof(ename), "%s.%016" PRIx64, name, r);
    snprintf(path, sizeof(path), "/api/v1/namespaces/%s/events", ns);
    ev = cJSON_CreateObject();
    if (!ev)
        return;
    cJSON_AddStringToObject(ev, "apiVersion", "v1");
    cJSON_AddStringToObject(ev, "kind", "Event");
    m = cJSON_AddObjectToObject(ev, "metadata");
    cJSON_AddStringToObject(m, "name", ename);
    cJSON_AddStringToObject(m, "namespace", ns);
    io = cJSON_AddObjectToObject(ev, "involvedObject");
    cJSON_AddStringToObject(io, "apiVersion", RECONCILE_API_VERSION);
    cJSON_AddStringToObject(io, "kind", RECONCILE_KIND);
    cJSON_AddStringToObject(io, "name", name);
    cJSON_AddStringToObject(io, "namespace", ns);
    if (str(meta, "uid"))
        cJSON_AddStringToObject(io, "uid", str(meta, "uid"));
    cJSON_AddStringToObject(ev, "reason", reason);
    cJSON_AddStringToObject(ev, "message", msg);
    cJSON_AddStringToObject(ev, "type", warning ? "Warning" : "Normal");
    src = cJSON_AddObjectToObject(ev, "source");
    cJSON_AddStringToObject(src, "component", "cohort-operator");
    cJSON_AddStringToObject(ev, "firstTimestamp", stamp);
    cJSON_AddStringToObject(ev, "lastTimestamp", stamp);
    cJSON_AddNumberToObject(ev, "count", 1);
    cJSON_AddStringToObject(ev, "reportingComponent", "cohort-operator");
    cJSON_AddStringToObject(ev, "reportingInstance", c->identity);
    rc = kube_create_object(c->cfg.kube, path, ev, NULL);
    cJSON_Delete(ev);
    if (rc == 0)
        evrec_note(c->events, okey, warning, reason, msg, ename, clock_now_ms());
    atomic_fetch_add(&c->n.events, 1);
    log_emit(warning ? LOG_WARN : LOG_INFO, "controller", msg, LF_S("cohort", name),
             LF_S("namespace", ns), LF_S("reason", reason), LOG_END);
    if (rc < 0)
        log_warn("controller", "An Event could not be recorded.", LF_S("reason", reason),
                 LF_S("error", kube_strerror(rc)));
}

/* ---- reconcile ---------------------------------------------------------- */

/* The exit code of the first terminated trainer container, or -1. */
static int exit_code(const cJSON *pod)
{
    const cJSON *cs;

    cJSON_ArrayForEach(cs, get(get(pod, "status"), "containerStatuses")) {
        const cJSON *t = get(get(cs, "state"), "terminated"), *code = get(t, "exitCode");
        if (cJSON_IsNumber(code))
            return code->valueint;
    }
    return -1;
}

static int pod_path(char *buf, size_t n, const char *ns, const char *name)
{
    int w = name ? snprintf(buf, n, "/api/v1/namespaces/%s/pods/%s", ns, name)
                 : snprintf(buf, n, "/api/v1/namespaces/%s/pods", ns);
    return w < 0 || (size_t)w >= n ? -ENAMETOOLONG : 0;
}

/* Deletes a pod, but only the one with `uid`: a pod made since under the
 * same name is left alone. 0 when deleted or already gone. */
static int delete_pod(struct controller *c, const char *ns, const char *name, const char *uid)
{
    char path[PATH_MAX_];
    cJSON *opts = cJSON_CreateObject(), *pre;
    int rc;

    if (!opts)
        return -ENOMEM;
    cJSON_AddStringToObject(opts, "kind", "DeleteOptions");
    cJSON_AddStringToObject(opts, "apiVersion", "v1");
    cJSON_AddStringToObject(opts, "propagationPolicy", "Background");
    if (uid) {
        pre = cJSON_AddObjectToObject(opts, "preconditions");
        cJSON_AddStringToObject(pre, "uid", uid);
    }
    rc = pod_path(path, sizeof(path), ns, name);
    if (rc == 0)
        rc = kube_request(c->cfg.kube, "DELETE", path, NULL, opts, NULL);
    cJSON_Delete(opts);
    if (rc == 0)
        atomic_fetch_add(&c->n.deleted, 1);
    /* Gone already, or replaced under the same name (uid precondition). */
    return rc == -ENOENT || rc == -ESTALE ? 0 : rc;
}

/* The cohort's member table from the broker, flattened for reconcile. */
struct bview {
    struct broker_status *st;
    const struct broker_cohort_status *cs;
    struct reconcile_member *members;
    size_t n;
};

static int broker_view(struct controller *c, const char *key, struct bview *b)
{
    int rc;

    memset(b, 0, sizeof(*b));
    rc = brokerd_status(c->cfg.broker, key, &b->st);
    if (rc < 0)
        return rc;
    if (b->st->n_cohorts == 0)
        return -ENOENT;
    b->cs = &b->st->cohorts[0];
    b->members = calloc(b->cs->n_members ? b->cs->n_members : 1, sizeof(*b->members));
    if (!b->members)
        return -ENOMEM;
    for (size_t i = 0; i < b->cs->n_members; i++) {
        b->members[i].id = b->cs->members[i].id;
        b->members[i].address = b->cs->members[i].address;
        b->members[i].model_version = b->cs->members[i].model_version;
        b->members[i].draining = b->cs->draining && b->cs->draining[i];
    }
    b->n = b->cs->n_members;
    return 0;
}

static void bview_cleanup(struct bview *b)
{
    free(b->members);
    broker_status_free(b->st);
    memset(b, 0, sizeof(*b));
}

static bool is_member(const struct bview *b, const char *id)
{
    for (size_t i = 0; i < b->n; i++)
        if (strcmp(b->members[i].id, id) == 0)
            return true;
    return false;
}

/* Drains excess pod `v` and deletes it once drained or past the deadline
 * (drain.h decides). Returns 1 while the drain goes on, 0 when the pod was
 * deleted, -errno. */
static int drain_step(struct controller *c, const cJSON *tc, struct cstate *s, const char *key,
                      const char *ns, const struct reconcile_pod_view *v, const struct bview *b,
                      uint32_t deadline_ms, uint64_t now)
{
    struct drain_entry *d = drain_set_find(&s->drains, v->name);
    uint64_t started;
    int rc, done;

    switch (drain_decide(d, is_member(b, v->name), 0, now, deadline_ms)) {
    case DRAIN_DELETE_STRANGER:
        rc = delete_pod(c, ns, v->name, v->uid);
        if (rc == 0)
            log_info("controller", "Deleted a pod that was not a member.", LF_S("cohort", key),
                     LF_S("pod", v->name));
        return rc;
    case DRAIN_START:
        d = drain_set_add(&s->drains, v->name, now);
        if (!d)
            return -ENOMEM;
        atomic_fetch_add(&c->n.drains, 1);
        event(c, tc, false, "Draining", "Draining member %s before deleting its pod.", v->name);
        break;
    default:
        break;
    }
    /* The mark does not survive an eviction and rejoin: set it on every
     * pass until the broker reports the member drained. */
    rc = brokerd_drain(c->cfg.broker, key, v->name, true);
    done = brokerd_drained(c->cfg.broker, key, v->name);
    if (rc < 0 && rc != -ENOENT)
        return rc;
    started = d->started;
    switch (drain_decide(d, true, done, now, deadline_ms)) {
    case DRAIN_DELETE_DRAINED:
        rc = delete_pod(c, ns, v->name, v->uid);
        if (rc < 0)
            return rc;
        event(c, tc, false, "Drained", "Member %s left the cohort at a round boundary; its pod "
              "was deleted after %" PRIu64 " ms.", v->name, now - started);
        drain_set_forget(&s->drains, v->name);
        return 0;
    case DRAIN_DELETE_TIMEOUT:
        rc = delete_pod(c, ns, v->name, v->uid);
        if (rc < 0)
            return rc;
        atomic_fetch_add(&c->n.drain_timeouts, 1);
        event(c, tc, true, "DrainTimeout", "Member %s did not drain within %u ms; its pod was "
              "deleted anyway, and the round under way may be retried.", v->name, deadline_ms);
        drain_set_forget(&s->drains, v->name);
        return 0;
    default:
        return 1;
    }
}


/* Writes status when it changed; versions alone at most once per period.
 * Returns 0, 1 when a version-only change waits for the period, -errno. */
static int write_status(struct controller *c, struct cstate *s, const cJSON *tc, const char *ns,
                        const char *name, cJSON *want, uint64_t now)
{
    const cJSON *cur = get(tc, "status");
    const cJSON *base = s->written ? s->written : cur;
    char path[PATH_MAX_];
    cJSON *patch, *out = NULL;
    int rc;

    /* Equal to what the server has, or to what we last wrote (the cache
     * may not have caught up yet): nothing to do. */
    if (!reconcile_status_differs(want, cur, false) ||
        (s->written && !reconcile_status_differs(want, s->written, false)))
        return 0;
    if (!reconcile_status_differs(want, base, true) && now - s->written_at < c->cfg.status_period_ms)
        return 1;
    patch = reconcile_status_patch(cur, want);
    if (!patch)
        return -ENOMEM;
    snprintf(path, sizeof(path), "/apis/" RECONCILE_GROUP "/v1alpha1/namespaces/%s/trainingcohorts/%s/status",
             ns, name);
    rc = kube_merge_patch(c->cfg.kube, path, patch, &out);
    cJSON_Delete(patch);
    if (rc == -ENOENT) {
        /* Deleted since the cache showed it (its delete event forgets
         * it), or a /status the server does not serve: only the first is
         * no failure. The object itself tells them apart. */
        cJSON *obj = NULL;

        path[strlen(path) - strlen("/status")] = '\0';
        if (kube_get(c->cfg.kube, path, &obj) == -ENOENT)
            return 0;
        cJSON_Delete(obj);
    }
    if (rc < 0)
        return rc;
    atomic_fetch_add(&c->n.status_writes, 1);
    cJSON_Delete(s->written);
    s->written = cJSON_Duplicate(get(out, "status"), 1);
    s->written_at = now;
    cJSON_Delete(out);
    return 0;
}

/* ---- checkpoints -------------------------------------------------------- */

static bool skip_told(const struct cstate *s, uint64_t version)
{
    for (size_t i = 0; i < s->n_skips_told; i++)
        if (s->skips_told[i] == version)
            return true;
    return false;
}

static void tell_skip(struct cstate *s, uint64_t version)
{
    if (s->n_skips_told < SKIPS_TOLD) {
        s->skips_told[s->n_skips_told++] = version;
        return;
    }
    s->skips_told[s->next_skip_told] = version;
    s->next_skip_told = (s->next_skip_told + 1) % SKIPS_TOLD;
}

/* Folds what the members report of checkpoints into *seen, and tells
 * each checkpoint a member set aside in one Warning Event: a member
 * reports its skip in every heartbeat for as long as it lives, and
 * several members may find the same file, so the versions told are
 * remembered (and, across an operator restart, status's lastSkipped
 * counts as told). */
static void note_checkpoints(struct controller *c, const cJSON *tc, struct cstate *s,
                             const struct bview *b, struct reconcile_ckpt_seen *seen)
{
    memset(seen, 0, sizeof(*seen));
    if (!s->skips_seeded) {
        const cJSON *v = get(get(get(get(tc, "status"), "checkpoint"), "lastSkipped"), "version");
        if (cJSON_IsNumber(v) && v->valuedouble > 0)
            tell_skip(s, (uint64_t)v->valuedouble);
        s->skips_seeded = true;
    }
    for (size_t i = 0; b->cs && b->cs->checkpoints && i < b->cs->n_members; i++) {
        const struct broker_checkpoint *ck = &b->cs->checkpoints[i];
        if (ck->version > seen->version)
            seen->version = ck->version;
        if (!ck->skipped_version)
            continue;
        if (ck->skipped_version > seen->skipped_version) {
            seen->skipped_version = ck->skipped_version;
            seen->skipped_reason = ck->skipped_reason;
        }
        if (skip_told(s, ck->skipped_version))
            continue;
        tell_skip(s, ck->skipped_version);
        event(c, tc, true, "CheckpointSkipped", "Member %s found the checkpoint of model version "
              "%" PRIu64 " invalid (%s) and renamed its file with the suffix .skipped; it is not "
              "used.", b->cs->members[i].id, ck->skipped_version,
              reconcile_ckpt_reason(ck->skipped_reason));
    }
}

/* ---- the cohort's key -------------------------------------------------- */

static int secret_path(char *buf, size_t n, const char *ns, const char *name)
{
    int w = name ? snprintf(buf, n, "/api/v1/namespaces/%s/secrets/%s", ns, name)
                 : snprintf(buf, n, "/api/v1/namespaces/%s/secrets", ns);
    return w < 0 || (size_t)w >= n ? -ENAMETOOLONG : 0;
}

/* Gives the broker the key of Secret `sec` for cohort `key` unless it has
 * it already (same key and CA), and remembers its id. Returns 1 when the
 * key changed from one the broker had, 0 when it is new or the same,
 * -errno. */
static int use_key(struct controller *c, struct cstate *s, const char *key,
                   const struct secret *k)
{
    char id[KEYS_ID_CHARS + 1];
    bool had = s->has_key;
    int rc = keys_id(k, c->broker_ca_pem, id);

    if (rc < 0)
        return rc;
    if (had && strcmp(id, s->key_id) == 0)
        return 0;
    rc = brokerd_set_key(c->cfg.broker, key, k);
    if (rc < 0)
        return rc;
    memcpy(s->key_id, id, sizeof(id));
    s->has_key = true;
    /* The id, never the key: it names the key without revealing it. */
    log_info("controller", "The broker has the cohort's key.", LF_S("cohort", key),
             LF_S("key_id", id), LF_B("tls", c->broker_ca_pem != NULL));
    return had ? 1 : 0;
}

/* Makes sure cohort `tc` has its Secret and the broker its key, before
 * any pod of it is made: from the cache, else created (a random key),
 * else, when the create finds the name taken, read from the API server.
 * A Secret that is not the cohort's, or holds no key, is left alone.
 * Returns 0, -EINVAL with *why filled (that Secret cannot be used), or
 * another -errno to retry. */
static int cohort_key(struct controller *c, const cJSON *tc, struct cstate *s, const char *key,
                      const char *ns, const char *name, struct reconcile_why *why)
{
    char sname[IDENT_NAME_MAX + 1], skey[LIMIT_KUBE_KEY_MAX + 16], path[PATH_MAX_];
    cJSON *sec = NULL, *made = NULL, *patch = NULL;
    struct secret k = { 0 };
    bool created = false;
    int rc;

    rc = reconcile_secret_name(name, sname, sizeof(sname));
    if (rc == 0)
        rc = secret_path(path, sizeof(path), ns, NULL);
    if (rc < 0)
        return rc;
    snprintf(skey, sizeof(skey), "%s/%s", ns, sname);
    sec = reflector_get(c->secrets, skey);
    if (!sec) {
        rc = secret_generate(&k);
        if (rc == 0)
            rc = keys_secret(tc, &k, c->broker_ca_pem, &made);
        if (rc < 0)
            goto out;
        rc = kube_create_object(c->cfg.kube, path, made, &sec);
        if (rc == 0) {
            created = true;
            atomic_fetch_add(&c->n.keys_created, 1);
        } else if (rc == -EEXIST) {
            /* Ours, made a moment ago (the cache is behind), or someone
             * else's: only the object can say. */
            rc = secret_path(path, sizeof(path), ns, sname);
            if (rc == 0)
                rc = kube_get(c->cfg.kube, path, &sec);
        }
        if (rc < 0)
            goto out;
    }
    /* What the Secret holds is the key, also the one just made. */
    rc = keys_adopt(tc, sec, &k, why);
    if (rc < 0)
        goto out;
    rc = keys_ca_patch(sec, c->broker_ca_pem, &patch);
    if (rc == 0 && patch) {
        rc = secret_path(path, sizeof(path), ns, sname);
        if (rc == 0)
            rc = kube_merge_patch(c->cfg.kube, path, patch, NULL);
        if (rc == 0)
            log_info("controller", "The broker's CA in the cohort's Secret was brought up to date.",
                     LF_S("cohort", key), LF_S("secret", sname));
    }
    if (rc < 0)
        goto out;
    rc = use_key(c, s, key, &k);
    if (rc < 0)
        goto out;
    if (rc == 1 && created)
        event(c, tc, false, "KeyChanged", "Made Secret %s again with a new key; pods made with "
              "the old one are replaced.", sname);
    else if (rc == 1)
        event(c, tc, false, "KeyChanged", "The key or CA in Secret %s changed; pods made with the "
              "old ones are replaced.", sname);
    else if (created)
        event(c, tc, false, "KeyCreated", "Created Secret %s with the cohort's key.", sname);
    rc = 0;
out:
    secret_wipe(&k);
    cJSON_Delete(patch);
    cJSON_Delete(made);
    cJSON_Delete(sec);
    return rc;
}

/* ---- the cohort's GPU claims (spec.gpu mode dra) ------------------------ */

static uint64_t fnv1a(const char *text)
{
    uint64_t h = 0xcbf29ce484222325ull;

    for (const unsigned char *p = (const unsigned char *)text; *p; p++)
        h = (h ^ *p) * 0x100000001b3ull;
    return h | 1;                   /* never 0, which means none */
}

/* Makes sure cohort `tc` with spec.gpu mode dra has its
 * ResourceClaimTemplate as reconcile_gpu_template() makes it, before any
 * pod that names it is made. A template's spec cannot be changed, so one
 * that differs (spec.gpu changed) is deleted and made again; the claims
 * Kubernetes made from the old one stay with their pods, which the
 * template hash rolls (and go with them). Asked of the API server only when the template
 * wanted changes (or the last try failed), not at every reconcile.
 * Returns 0, -EINVAL with *why filled (the API server does not serve
 * resource.k8s.io/v1beta1, or the name is another object's), or another
 * -errno to retry. */
static int gpu_template(struct controller *c, const cJSON *tc, const struct reconcile_spec *spec,
                        struct cstate *s, const char *key, const char *ns, const char *name,
                        struct reconcile_why *why)
{
    char tname[IDENT_NAME_MAX + 1] = "", path[PATH_MAX_];
    cJSON *want = NULL, *have = NULL;
    const char *owner, *uid;
    uint64_t sig;
    char *text;
    int rc, w;

    rc = reconcile_gpu_template(tc, &want);
    if (rc < 0)
        return rc;
    text = cJSON_PrintUnformatted(want);
    if (!text) {
        rc = -ENOMEM;
        goto out;
    }
    sig = fnv1a(text);
    free(text);
    if (sig == s->gpu_sig)
        goto out;
    rc = reconcile_gpu_template_name(name, tname, sizeof(tname));
    if (rc < 0)
        goto out;
    w = snprintf(path, sizeof(path), "/apis/resource.k8s.io/v1beta1/namespaces/%s/"
                 "resourceclaimtemplates", ns);
    if (w < 0 || (size_t)w >= sizeof(path) - sizeof(tname) - 1) {
        rc = -ENAMETOOLONG;
        goto out;
    }
    rc = kube_create_object(c->cfg.kube, path, want, NULL);
    if (rc == -EEXIST) {
        snprintf(path + w, sizeof(path) - (size_t)w, "/%s", tname);
        rc = kube_get(c->cfg.kube, path, &have);
        if (rc < 0)
            goto out;
        owner = cJSON_GetStringValue(cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(
            cJSON_GetObjectItem(have, "metadata"), "ownerReferences"), 0), "uid"));
        uid = kube_meta(tc, "uid");
        if (!owner || !uid || strcmp(owner, uid) != 0) {
            snprintf(why->reason, sizeof(why->reason), "GPUClaimTemplateTaken");
            snprintf(why->message, sizeof(why->message), "the ResourceClaimTemplate %s exists "
                     "and is not this cohort's; delete or rename it", tname);
            rc = -EINVAL;
            goto out;
        }
        /* The claim's spec alone: the server writes the template's own
         * metadata back as {"creationTimestamp": null}. */
        if (cJSON_Compare(cJSON_GetObjectItem(cJSON_GetObjectItem(have, "spec"), "spec"),
                          cJSON_GetObjectItem(cJSON_GetObjectItem(want, "spec"), "spec"), true))
            goto made;
        /* Templates have no finalizers: once deleted the name is free. */
        rc = kube_delete(c->cfg.kube, path);
        if (rc == 0 || rc == -ENOENT) {
            path[w] = '\0';
            rc = kube_create_object(c->cfg.kube, path, want, NULL);
        }
        if (rc == 0)
            event(c, tc, false, "GPUClaimTemplateReplaced", "spec.gpu changed; made "
                  "ResourceClaimTemplate %s again for %u GPUs of class %s per pod.", tname,
                  spec->gpu_count, spec->gpu_class);
    } else if (rc == 0) {
        event(c, tc, false, "GPUClaimTemplateCreated", "Created ResourceClaimTemplate %s for %u "
              "GPUs of class %s per pod.", tname, spec->gpu_count, spec->gpu_class);
    }
    if (rc == -ENOENT) {
        snprintf(why->reason, sizeof(why->reason), "DRAUnavailable");
        snprintf(why->message, sizeof(why->message), "spec.gpu.mode dra needs the API "
                 "resource.k8s.io/v1beta1 (dynamic resource allocation), which this cluster "
                 "does not serve; use mode devicePlugin or enable it");
        rc = -EINVAL;
    }
made:
    if (rc == 0)
        s->gpu_sig = sig;
    else if (rc != -EINVAL)
        log_warn("controller", "The cohort's ResourceClaimTemplate could not be made; trying "
                 "again.", LF_S("cohort", key), LF_S("template", tname), LF_S("error",
                 kube_strerror(rc)));
out:
    cJSON_Delete(have);
    cJSON_Delete(want);
    return rc;
}

/* A new leader's first look: the key of each cached cohort's Secret goes
 * to the broker before any worker runs, so that members rejoining find
 * their cohort's key. A cohort whose Secret is missing or unusable is left
 * to its reconcile. */
static void restore_key(struct controller *c, const cJSON *tc, const char *key)
{
    const char *ns = kube_meta(tc, "namespace"), *name = kube_meta(tc, "name");
    char sname[IDENT_NAME_MAX + 1], skey[LIMIT_KUBE_KEY_MAX + 16];
    struct reconcile_why why;
    struct secret k = { 0 };
    struct cstate *s;
    cJSON *sec;

    if (!ns || !name || reconcile_secret_name(name, sname, sizeof(sname)) < 0)
        return;
    snprintf(skey, sizeof(skey), "%s/%s", ns, sname);
    sec = reflector_get(c->secrets, skey);
    if (sec && keys_adopt(tc, sec, &k, &why) == 0 && (s = state_of(c, key, true)))
        use_key(c, s, key, &k);
    secret_wipe(&k);
    cJSON_Delete(sec);
}

/* ---- failures and back-off ------------------------------------------- */

static struct ostate *ostate_of(struct cstate *s, uint32_t ordinal)
{
    struct ostate *o;

    for (size_t i = 0; i < s->n_ords; i++)
        if (s->ords[i].ordinal == ordinal)
            return &s->ords[i];
    o = realloc(s->ords, (s->n_ords + 1) * sizeof(*o));
    if (!o)
        return NULL;
    s->ords = o;
    o = &s->ords[s->n_ords++];
    memset(o, 0, sizeof(*o));
    o->ordinal = ordinal;
    return o;
}

/* metav1.Time to seconds since the epoch; false when it is none. */
static bool parse_time(const char *t, time_t *out)
{
    struct tm tm = { 0 };
    const char *end = t ? strptime(t, "%Y-%m-%dT%H:%M:%S", &tm) : NULL;

    if (!end)
        return false;
    *out = timegm(&tm);
    return true;
}

/* How long the container that failed in `pod` ran, ms; 0 when its
 * status does not say (the streak then goes on: the cautious side). */
static uint64_t ran_ms(const cJSON *pod, const char *container)
{
    static const char *const lists[] = { "containerStatuses", "initContainerStatuses" };
    const cJSON *cs;

    for (size_t i = 0; i < 2; i++)
        cJSON_ArrayForEach(cs, get(get(pod, "status"), lists[i])) {
            const cJSON *t = get(get(cs, "state"), "terminated");
            time_t a, b;
            if (!str(cs, "name") || strcmp(str(cs, "name"), container) != 0)
                continue;
            if (parse_time(str(t, "startedAt"), &a) && parse_time(str(t, "finishedAt"), &b) &&
                b > a)
                return (uint64_t)(b - a) * 1000;
            return 0;
        }
    return 0;
}

/* Notes what failed among the cohort's pods: a Failed pod seen for the
 * first time gets an Event (PodFailed, with its exit code, signal or
 * reason) and its ordinal's back-off is advanced (Event BackOff when the
 * replacement waits); a pod that cannot start (ErrImagePull, ...) gets
 * an Event once per reason. Each view's backoff_ms is set for the plan.
 * Events repeat word for word across a crash loop, so that the recorder
 * counts them (evrec.h) instead of making new ones. */
static void note_failures(struct controller *c, const cJSON *tc, struct cstate *s,
                          struct reconcile_pod_view *views, const cJSON **objs, size_t n,
                          uint64_t now, const char *stamp)
{
    for (size_t i = 0; i < n; i++) {
        struct reconcile_pod_view *v = &views[i];
        struct reconcile_failure f;
        struct ostate *o;
        bool bad;

        if (v->ordinal < 0 || v->phase == RECONCILE_POD_TERMINATING)
            continue;
        bad = reconcile_pod_failure(objs[i], &f);
        if (v->phase == RECONCILE_POD_FAILED) {
            o = ostate_of(s, (uint32_t)v->ordinal);
            if (!o)
                continue;
            if (!v->uid || strcmp(o->uid, v->uid) != 0) {
                uint32_t wait = reconcile_backoff_fail(&o->backoff, now,
                                                       bad ? ran_ms(objs[i], f.container) : 0);
                snprintf(o->uid, sizeof(o->uid), "%s", v->uid ? v->uid : "");
                o->has_failure = true;
                o->failure = f;
                if (!bad)
                    snprintf(o->failure.reason, sizeof(o->failure.reason), "Failed");
                snprintf(o->at, sizeof(o->at), "%s", stamp);
                event(c, tc, true, "PodFailed", "Pod %s failed: %s.", v->name,
                      bad ? f.message : "its status gives no reason");
                if (wait)
                    event(c, tc, true, "BackOff", "Back-off restarting failed pod %s.", v->name);
            }
            v->backoff_ms = o->backoff.until_ms > now ? (uint32_t)(o->backoff.until_ms - now) : 0;
        } else if (!(bad && f.exit_code < 0 && !f.signal)) {
            /* Started after all: a later ErrImagePull is told again. */
            for (size_t j = 0; j < s->n_ords; j++)
                if (s->ords[j].ordinal == (uint32_t)v->ordinal)
                    s->ords[j].waiting[0] = '\0';
        } else {
            o = ostate_of(s, (uint32_t)v->ordinal);
            if (!o)
                continue;
            o->has_failure = true;
            o->failure = f;
            if (strcmp(o->waiting, f.reason) != 0) {
                snprintf(o->at, sizeof(o->at), "%s", stamp);
                snprintf(o->waiting, sizeof(o->waiting), "%s", f.reason);
                event(c, tc, true, f.reason, "Pod %s cannot start: %s.", v->name, f.message);
            }
        }
    }
}

/* True when rc is an answer of the API server (a refusal), not a
 * transport error or one of ours. */
static bool api_refused(int rc)
{
    const struct kube_error *e = kube_last_error();

    return rc < 0 && e && e->rc == rc && e->status >= 400;
}

/* The API refused to create or delete pod `pod`: kept for the
 * ReplicaFailure condition and told in a Warning Event (reason
 * FailedCreate or FailedDelete, as a ReplicaSet's), with the API's status,
 * reason and message. */
static void refused(struct controller *c, const cJSON *tc, struct cstate *s, const char *reason,
                    const char *verb, const char *pod, int rc)
{
    char what[RECONCILE_MESSAGE_MAX];

    snprintf(what, sizeof(what), "%s", kube_strerror(rc));
    s->has_refused = true;
    snprintf(s->refused.reason, sizeof(s->refused.reason), "%s", reason);
    /* A long API message keeps its start; the Event has it whole. */
    if (snprintf(s->refused.message, sizeof(s->refused.message), "error %s pod %s: %s", verb, pod,
                 what) < 0)
        s->refused.message[0] = '\0';
    event(c, tc, true, reason, "Error %s pod %s: %s", verb, pod, what);
}

/* Drains and deletes the pods views[idx[0..n)] one drain_step each,
 * counting the drains still going on in *draining and the pods deleted off
 * *live. An outdated pod (a template change) gets a RollingUpdate event
 * when it is deleted. A delete the API refused stops the walk and becomes
 * the cohort's FailedDelete condition and event. Returns 0 or -errno. */
static int drain_pods(struct controller *c, const cJSON *tc, struct cstate *s, const char *key,
                      const char *ns, const struct reconcile_pod_view *views, const size_t *idx,
                      size_t n, bool outdated, const struct bview *b, uint32_t deadline_ms,
                      uint64_t now, uint32_t *draining, uint32_t *live)
{
    for (size_t i = 0; i < n; i++) {
        const struct reconcile_pod_view *v = &views[idx[i]];
        int rc = drain_step(c, tc, s, key, ns, v, b, deadline_ms, now);

        if (rc < 0) {
            if (api_refused(rc))
                refused(c, tc, s, "FailedDelete", "deleting", v->name, rc);
            return rc;
        }
        if (rc == 1) {
            (*draining)++;
            continue;
        }
        (*live)--;
        if (outdated)
            event(c, tc, false, "RollingUpdate", "Deleted pod %s, made from an earlier "
                  "template; it is made again from the current one.", v->name);
    }
    return 0;
}

/* Returns 0 done, >0 requeue after that many ms, -errno retry with backoff.
 * A refused create or delete also fills err (the API's words: later calls
 * of this pass, its Event and status write, replace the thread's last
 * error). */
static int reconcile(struct controller *c, const char *key, char *err, size_t err_n)
{
    char ns[LIMIT_KUBE_LABEL_MAX + 1], sel[128], prefix[LIMIT_KUBE_KEY_MAX + 2];
    char path[PATH_MAX_], stamp[32], hash[RECONCILE_HASH_CHARS + 1];
    const char *name;
    struct reconcile_pod_failure *fails = NULL;
    char (*fail_names)[LIMIT_KUBE_KEY_MAX] = NULL;
    bool *updating = NULL;
    size_t n_fails = 0;
    int fail_rc = 0;
    cJSON *tc = NULL, *pods = NULL, *want = NULL, *it;
    struct reconcile_spec spec;
    struct reconcile_why why;
    struct reconcile_pod_view *views = NULL;
    const cJSON **objs = NULL;
    struct reconcile_plan plan = { 0 };
    struct reconcile_observed obs = { 0 };
    struct bview b = { 0 };
    struct cstate *s;
    uint64_t now = clock_now_ms();
    size_t n = 0;
    uint32_t live = 0, draining = 0, rolled = 0;
    int rc = 0, again = 0, invalid;

    if (split_key(key, ns, sizeof(ns), &name) < 0)
        return 0;
    tc = reflector_get(c->cohorts, key);
    if (!tc) {
        /* Deleted: its pods and its Secret go with it (owner
         * references); the broker forgets its key and its members. */
        brokerd_set_key(c->cfg.broker, key, NULL);
        rc = brokerd_remove(c->cfg.broker, key);
        if (rc == 0)
            log_info("controller", "The cohort is gone; removed it from the broker.",
                     LF_S("cohort", key));
        state_drop(c, key);
        evrec_forget(c->events, key);
        return 0;
    }
    if (get(get(tc, "metadata"), "deletionTimestamp"))
        goto out;
    s = state_of(c, key, true);
    if (!s) {
        rc = -ENOMEM;
        goto out;
    }
    invalid = reconcile_parse(tc, &spec, &why);
    if (invalid == 0) {
        rc = cohort_key(c, tc, s, key, ns, name, &why);
        if (rc == 0 && spec.gpu_mode == RECONCILE_GPU_DRA)
            rc = gpu_template(c, tc, &spec, s, key, ns, name, &why);
        else if (rc == 0)
            s->gpu_sig = 0;
        if (rc == -EINVAL)
            invalid = rc;
        else if (rc < 0)
            goto out;
        rc = 0;
    }
    if (!s->restarts_known) {
        const cJSON *r = get(get(tc, "status"), "restarts");
        s->restarts = cJSON_IsNumber(r) && r->valuedouble > 0 ? (uint32_t)r->valuedouble : 0;
        s->restarts_known = true;
    }
    now_rfc3339(stamp, sizeof(stamp));
    reconcile_selector(name, sel, sizeof(sel));
    if (invalid < 0) {
        obs.generation = (int64_t)cJSON_GetNumberValue(get(get(tc, "metadata"), "generation"));
        obs.restarts = s->restarts;
        obs.invalid = &why;
        if (strlen(name) <= LIMIT_KUBE_LABEL_MAX)
            obs.selector = sel;
        want = reconcile_status(&spec, &obs, get(tc, "status"), stamp);
        if (!s->invalid_reported) {
            event(c, tc, true, why.reason, "The cohort cannot run: %s.", why.message);
            s->invalid_reported = true;
        }
        rc = want ? write_status(c, s, tc, ns, name, want, now) : -ENOMEM;
        goto out;
    }
    s->invalid_reported = false;
    if (s->declared_hb != spec.heartbeat_ms || s->declared_to != spec.timeout_ms) {
        rc = brokerd_declare(c->cfg.broker, key, spec.heartbeat_ms, spec.timeout_ms);
        if (rc < 0)
            goto out;
        s->declared_hb = spec.heartbeat_ms;
        s->declared_to = spec.timeout_ms;
    }

    /* This cohort's pods: by name prefix from the cache, then by label
     * (another cohort's name may start with this one's). */
    snprintf(prefix, sizeof(prefix), "%s-", key);
    pods = reflector_list(c->pods, prefix);
    if (!pods) {
        rc = -ENOMEM;
        goto out;
    }
    views = calloc((size_t)cJSON_GetArraySize(pods) + 1, sizeof(*views));
    objs = calloc((size_t)cJSON_GetArraySize(pods) + 1, sizeof(*objs));
    updating = calloc((size_t)cJSON_GetArraySize(pods) + 1, sizeof(*updating));
    if (!views || !objs || !updating) {
        rc = -ENOMEM;
        goto out;
    }
    cJSON_ArrayForEach(it, pods) {
        const char *owner = str(get(get(it, "metadata"), "labels"), RECONCILE_LABEL_COHORT);
        if (!owner || strcmp(owner, name) != 0 || reconcile_view(name, it, &views[n]) < 0)
            continue;
        views[n].stale = !views[n].key_id || strcmp(views[n].key_id, s->key_id) != 0;
        if (views[n].phase != RECONCILE_POD_TERMINATING)
            live++;
        objs[n++] = it;
    }
    rc = reconcile_template_hash(tc, hash);
    if (rc < 0)
        goto out;
    for (size_t i = 0; i < n; i++) {
        views[i].outdated = !views[i].template_hash || strcmp(views[i].template_hash, hash) != 0;
        views[i].draining = drain_set_find(&s->drains, views[i].name) != NULL;
    }
    note_failures(c, tc, s, views, objs, n, now, stamp);
    s->has_refused = false;
    rc = reconcile_plan(&spec, reconcile_restarts_within(s->restart_at, s->n_restart_at, now,
                                                         RECONCILE_RESTART_WINDOW_MS),
                        views, n, &plan);
    if (rc < 0)
        goto out;
    for (size_t i = 0; i < plan.n_update; i++)
        updating[plan.update[i]] = true;
    if (broker_view(c, key, &b) < 0)
        bview_cleanup(&b);
    note_checkpoints(c, tc, s, &b, &obs.ckpt);

    /* Failed pods: delete, count once per pod (by uid), make again below
     * once the name is free. */
    for (size_t i = 0; i < plan.n_replace; i++) {
        const struct reconcile_pod_view *v = &views[plan.replace[i]];
        if (handled(s, v->uid))
            continue;
        rc = delete_pod(c, ns, v->name, v->uid);
        if (rc < 0 && api_refused(rc)) {
            refused(c, tc, s, "FailedDelete", "deleting", v->name, rc);
            fail_rc = rc;
            goto status;
        }
        if (rc < 0)
            goto out;
        remember(s, v->uid);
        s->restarts++;
        s->restart_at[s->next_restart_at] = now;
        s->next_restart_at = (s->next_restart_at + 1) % RESTART_TIMES;
        if (s->n_restart_at < RESTART_TIMES)
            s->n_restart_at++;
        atomic_fetch_add(&c->n.replaced, 1);
        /* Word for word the same each time, so that the recorder counts
         * a crash loop's replacements in one Event. */
        event(c, tc, true, "Replacing", "Replacing failed pod %s (exit code %d).", v->name,
              exit_code(objs[plan.replace[i]]));
        again = POLL_AGAIN_MS;
    }
    /* Pods made with another key or CA cannot prove themselves: made
     * again (below, once their names are free) with the cohort's. */
    for (size_t i = 0; i < plan.n_roll; i++) {
        const struct reconcile_pod_view *v = &views[plan.roll[i]];
        rc = delete_pod(c, ns, v->name, v->uid);
        if (rc < 0 && api_refused(rc)) {
            refused(c, tc, s, "FailedDelete", "deleting", v->name, rc);
            fail_rc = rc;
            goto status;
        }
        if (rc < 0)
            goto out;
        atomic_fetch_add(&c->n.rolled, 1);
        rolled++;
        again = POLL_AGAIN_MS;
    }
    if (rolled)
        event(c, tc, false, "RollingKey", "Replacing %u pod(s) made with an earlier key or CA.",
              rolled);
    if (plan.failed && !s->failed_reported) {
        event(c, tc, true, "TooManyRestarts", "A trainer pod failed after spec.maxRestarts (%u) "
              "replacements within the last hour; failed pods are no longer replaced.",
              spec.max_restarts);
        s->failed_reported = true;
    } else if (!plan.failed) {
        s->failed_reported = false;
    }
    if (plan.complete && !s->complete_reported) {
        event(c, tc, false, "Completed", "Every trainer finished.");
        s->complete_reported = true;
    }
    /* A pod of a name being drained that is wanted again (scaled back up)
     * stays: take it back into the epochs. */
    for (size_t i = 0; i < n; i++) {
        const struct reconcile_pod_view *v = &views[i];
        if (v->ordinal >= 0 && (uint32_t)v->ordinal < plan.want && !updating[i] &&
            drain_set_find(&s->drains, v->name)) {
            brokerd_drain(c->cfg.broker, key, v->name, false);
            drain_set_forget(&s->drains, v->name);
            event(c, tc, false, "DrainCancelled", "Member %s is wanted again; its drain was "
                  "cancelled.", v->name);
        }
    }
    if (plan.n_create) {
        rc = pod_path(path, sizeof(path), ns, NULL);
        if (rc < 0)
            goto out;
        /* New pods name the claim template: make sure it is still there
         * (someone may have deleted it since it was made), or they would
         * wait for a claim nothing can make. A refusal is told by the
         * next pass, which asks again. */
        if (spec.gpu_mode == RECONCILE_GPU_DRA) {
            s->gpu_sig = 0;
            rc = gpu_template(c, tc, &spec, s, key, ns, name, &why);
            if (rc < 0)
                goto out;
        }
    }
    for (size_t i = 0; i < plan.n_create; i++) {
        cJSON *pod = NULL;
        rc = reconcile_pod(tc, &c->cfg.env, s->key_id, plan.create[i], &pod);
        if (rc < 0)
            goto out;
        rc = kube_create_object(c->cfg.kube, path, pod, NULL);
        if (rc == 0) {
            atomic_fetch_add(&c->n.created, 1);
            event(c, tc, false, "Created", "Created pod %s.", kube_meta(pod, "name"));
            live++;
        } else if (rc != -EEXIST && api_refused(rc)) {
            /* The same refusal would meet every other pod: one try per
             * pass, status says why, and the queue backs off. */
            refused(c, tc, s, "FailedCreate", "creating", kube_meta(pod, "name"), rc);
            fail_rc = rc;
            cJSON_Delete(pod);
            goto status;
        }
        cJSON_Delete(pod);
        /* AlreadyExists: the cache is behind our own create, or another
         * operator's: the pod is there, which is all we wanted. */
        if (rc < 0 && rc != -EEXIST)
            goto out;
        rc = 0;
    }
    /* Scale-down and suspend: drain, then delete. */
    {
        uint32_t deadline = c->cfg.drain_timeout_ms ? c->cfg.drain_timeout_ms
                                                    : 2 * spec.timeout_ms;
        rc = drain_pods(c, tc, s, key, ns, views, plan.excess, plan.n_excess, false, &b,
                        deadline, now, &draining, &live);
        /* A template change: outdated pods go through the same drain, a
         * few at a time (the plan picks them), and come back from the
         * current template under their names. */
        if (rc == 0)
            rc = drain_pods(c, tc, s, key, ns, views, plan.update, plan.n_update, true, &b,
                            deadline, now, &draining, &live);
        if (rc < 0 && api_refused(rc)) {
            fail_rc = rc;
            goto status;
        }
        if (rc < 0)
            goto out;
        if (draining)
            again = POLL_AGAIN_MS;
    }
    if (plan.blocked || plan.terminating || plan.n_create || plan.outdated)
        again = POLL_AGAIN_MS;
    /* A replacement waiting out its back-off: look again when it ends. */
    if (plan.requeue_ms && (!again || plan.requeue_ms + 20 < (uint32_t)again))
        again = (int)(plan.requeue_ms + 20);

status:
    rc = 0;
    /* Each wanted ordinal's last failure, for its entry in status. */
    fails = calloc(s->n_ords + 1, sizeof(*fails));
    fail_names = calloc(s->n_ords + 1, sizeof(*fail_names));
    if (!fails || !fail_names) {
        rc = -ENOMEM;
        goto out;
    }
    for (size_t i = 0; i < s->n_ords; i++) {
        const struct ostate *o = &s->ords[i];
        if (!o->has_failure || o->ordinal >= plan.want)
            continue;
        snprintf(fail_names[n_fails], sizeof(fail_names[n_fails]), "%s-%u", name, o->ordinal);
        fails[n_fails].pod = fail_names[n_fails];
        fails[n_fails].f = &o->failure;
        fails[n_fails].at = o->at;
        /* The wait decided, not what is left of it: status stays the
         * same from pass to pass, and time + backoffSeconds says when. */
        fails[n_fails].backoff_ms = o->backoff.until_ms > now ? reconcile_backoff_ms(o->backoff.streak)
                                                              : 0;
        /* Only while its failed pod still waits: a new pod is past it. */
        if (fails[n_fails].backoff_ms) {
            bool still = false;
            for (size_t j = 0; j < n; j++)
                still = still || (views[j].uid && strcmp(views[j].uid, o->uid) == 0 &&
                                  views[j].phase == RECONCILE_POD_FAILED);
            if (!still)
                fails[n_fails].backoff_ms = 0;
        }
        n_fails++;
    }
    obs.failures = fails;
    obs.n_failures = n_fails;
    obs.replica_failure = s->has_refused ? &s->refused : NULL;

    obs.generation = (int64_t)cJSON_GetNumberValue(get(get(tc, "metadata"), "generation"));
    obs.selector = sel;
    obs.pods = live;
    obs.restarts = s->restarts;
    obs.draining = draining;
    obs.broker_known = b.cs != NULL;
    obs.epoch = b.cs ? b.cs->epoch : 0;
    obs.leader = b.cs ? b.cs->leader : NULL;
    obs.members = b.members;
    obs.n_members = b.n;
    obs.plan = &plan;
    want = reconcile_status(&spec, &obs, get(tc, "status"), stamp);
    if (!want) {
        rc = -ENOMEM;
        goto out;
    }
    rc = write_status(c, s, tc, ns, name, want, now);
    if (rc == 1) {
        uint32_t wait = c->cfg.status_period_ms - (uint32_t)(now - s->written_at);
        again = again && (uint32_t)again < wait ? again : (int)wait;
        rc = 0;
    }
    if (rc == 0 && fail_rc < 0) {
        rc = fail_rc;
        snprintf(err, err_n, "%s", s->refused.message);
    }
out:
    bview_cleanup(&b);
    reconcile_plan_cleanup(&plan);
    free(fails);
    free(fail_names);
    free(updating);
    free(views);
    free(objs);
    cJSON_Delete(want);
    cJSON_Delete(pods);
    cJSON_Delete(tc);
    return rc < 0 ? rc : again;
}

/* ---- threads ------------------------------------------------------------ */

static void *worker_main(void *arg)
{
    struct controller *c = arg;
    char key[LIMIT_KUBE_KEY_MAX], why[RECONCILE_MESSAGE_MAX];

    while (!atomic_load(&c->stop)) {
        int rc = workq_wait(c->q, key, sizeof(key), 500);
        uint64_t now;

        if (rc == -ESHUTDOWN)
            break;
        if (rc < 0)
            continue;
        why[0] = '\0';
        rc = reconcile(c, key, why, sizeof(why));
        now = clock_now_ms();
        atomic_fetch_add(&c->n.reconciles, 1);
        if (rc < 0) {
            atomic_fetch_add(&c->n.errors, 1);
            log_warn("controller", "A reconcile failed; it will be retried with backoff.",
                     LF_S("cohort", key), LF_S("error", why[0] ? why : kube_strerror(rc)),
                     LF_U("failures", workq_failures(c->q, key) + 1));
            workq_add_rate_limited(c->q, key, now);
        } else {
            workq_forget(c->q, key);
            if (rc > 0)
                workq_add_after(c->q, key, now, (uint32_t)rc);
        }
        workq_done(c->q, key, now);
    }
    return NULL;
}

static uint64_t fnv(uint64_t h, const void *p, size_t n)
{
    const unsigned char *b = p;

    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

/* Compares each cohort's broker membership with the last look, and queues
 * the cohorts whose membership moved; version-only moves are queued at
 * most once per status period. Also resyncs every cohort now and then. */
static void *ticker_main(void *arg)
{
    struct controller *c = arg;
    uint64_t next_resync = clock_now_ms() + c->cfg.resync_ms;

    while (!atomic_load(&c->stop)) {
        struct broker_status *st = NULL;
        uint64_t now = clock_now_ms();

        if (brokerd_status(c->cfg.broker, NULL, &st) == 0) {
            for (size_t i = 0; i < st->n_cohorts; i++) {
                const struct broker_cohort_status *cs = &st->cohorts[i];
                uint64_t sig = fnv(0xcbf29ce484222325ull, &cs->epoch, sizeof(cs->epoch));
                uint64_t vsig = 0xcbf29ce484222325ull;
                struct cstate *s;
                bool queue = false;

                if (cs->leader)
                    sig = fnv(sig, cs->leader, strlen(cs->leader));
                for (size_t j = 0; j < cs->n_members; j++) {
                    bool dr = cs->draining && cs->draining[j];
                    sig = fnv(sig, cs->members[j].id, strlen(cs->members[j].id) + 1);
                    if (cs->members[j].address)
                        sig = fnv(sig, cs->members[j].address, strlen(cs->members[j].address));
                    sig = fnv(sig, &dr, sizeof(dr));
                    vsig = fnv(vsig, &cs->members[j].model_version, sizeof(uint64_t));
                    /* A new checkpoint or a skip is told at once (a
                     * skip's Event, status.checkpoint): they are rare. */
                    if (cs->checkpoints) {
                        sig = fnv(sig, &cs->checkpoints[j].version, sizeof(uint64_t));
                        sig = fnv(sig, &cs->checkpoints[j].skipped_version, sizeof(uint64_t));
                    }
                }
                s = state_of(c, cs->name, false);
                if (!s)
                    continue;
                pthread_mutex_lock(&c->lock);
                if (s->sig != sig) {
                    s->sig = sig;
                    s->vsig = vsig;
                    queue = true;
                } else if (s->vsig != vsig && now - s->written_at >= c->cfg.status_period_ms) {
                    s->vsig = vsig;
                    queue = true;
                }
                pthread_mutex_unlock(&c->lock);
                if (queue)
                    workq_add(c->q, cs->name, now);
            }
            broker_status_free(st);
        }
        if (now >= next_resync) {
            cJSON *all = reflector_list(c->cohorts, NULL), *it;
            cJSON_ArrayForEach(it, all)
                if (it->string)
                    workq_add(c->q, it->string, now);
            cJSON_Delete(all);
            next_resync = now + c->cfg.resync_ms;
        }
        for (uint32_t slept = 0; slept < c->cfg.broker_poll_ms && !atomic_load(&c->stop);
             slept += 50)
            clock_sleep_ms(50);
    }
    return NULL;
}

/* ---- reflector handlers ------------------------------------------------- */

static void on_cohort(void *arg, const char *key, const cJSON *obj)
{
    struct controller *c = arg;

    workq_add(c->q, key, clock_now_ms());
}

static void on_pod(void *arg, const char *key, const cJSON *obj)
{
    struct controller *c = arg;
    const char *ns = kube_meta(obj, "namespace");
    const char *owner = str(get(get(obj, "metadata"), "labels"), RECONCILE_LABEL_COHORT);
    char ck[LIMIT_KUBE_KEY_MAX];
    int w;

    if (!ns || !owner)
        return;
    w = snprintf(ck, sizeof(ck), "%s/%s", ns, owner);
    if (w > 0 && (size_t)w < sizeof(ck))
        workq_add(c->q, ck, clock_now_ms());
}

/* A cohort's Secret changed or went: its cohort looks again (a deleted
 * Secret is made anew, with a new key). */
static void on_secret(void *arg, const char *key, const cJSON *obj)
{
    on_pod(arg, key, obj);
}

/* ---- lifecycle ---------------------------------------------------------- */

/* What controller_start allocated before its threads, and the struct. */
static void controller_free(struct controller *c)
{
    for (size_t i = 0; i < c->n_states; i++)
        state_free(c->states[i]);
    free(c->states);
    evrec_destroy(c->events);
    free(c->namespace);
    free(c->identity);
    free(c->broker_address);
    free(c->sidecar_image);
    free(c->sidecar_command);
    free(c->broker_ca_pem);
    free(c->broker_server_name);
    pthread_mutex_destroy(&c->lock);
    free(c);
}

/* Waits for the three caches in slices, so that cfg.cancelled is heard
 * within 100 ms. Returns 0, -ETIMEDOUT or -ECANCELED. */
static int wait_synced(struct controller *c, uint32_t timeout_ms)
{
    uint64_t end = clock_now_ms() + timeout_ms;

    for (;;) {
        if (reflector_wait_synced(c->cohorts, 0) && reflector_wait_synced(c->pods, 0) &&
            reflector_wait_synced(c->secrets, 0))
            return 0;
        if (c->cfg.cancelled && c->cfg.cancelled(c->cfg.cancel_arg))
            return -ECANCELED;
        if (clock_now_ms() >= end)
            return -ETIMEDOUT;
        reflector_wait_synced(c->cohorts, 100);
    }
}

int controller_crd_served(struct kube *kube)
{
    cJSON *list = NULL, *r;
    int rc = kube_get(kube, "/apis/" RECONCILE_GROUP "/v1alpha1", &list);

    if (rc < 0)
        return rc;
    rc = -ENOENT;
    cJSON_ArrayForEach(r, get(list, "resources")) {
        const char *name = str(r, "name");
        if (name && strcmp(name, "trainingcohorts") == 0)
            rc = 0;
    }
    cJSON_Delete(list);
    return rc;
}

int controller_start(const struct controller_config *cfg, uint32_t sync_timeout_ms,
                     struct controller **out)
{
    struct reflector_config rc_cohorts = { 0 }, rc_pods = { 0 }, rc_secrets = { 0 };
    struct controller *c;
    cJSON *all, *it;
    int rc = -ENOMEM;

    if (!cfg || !cfg->kube || !cfg->broker || !cfg->env.broker_address ||
        !cfg->env.sidecar_image || !cfg->env.sidecar_command)
        return -EINVAL;
    c = calloc(1, sizeof(*c));
    if (!c)
        return -ENOMEM;
    c->cfg = *cfg;
    if (!c->cfg.workers)
        c->cfg.workers = 2;
    if (c->cfg.workers > WORKERS_MAX)
        c->cfg.workers = WORKERS_MAX;
    if (!c->cfg.status_period_ms)
        c->cfg.status_period_ms = 5000;
    if (!c->cfg.resync_ms)
        c->cfg.resync_ms = 30000;
    if (!c->cfg.broker_poll_ms)
        c->cfg.broker_poll_ms = 250;
    pthread_mutex_init(&c->lock, NULL);
    c->namespace = strdup(cfg->namespace ? cfg->namespace : "");
    c->identity = strdup(cfg->identity ? cfg->identity : "cohort-operator");
    c->broker_address = strdup(cfg->env.broker_address);
    c->sidecar_image = strdup(cfg->env.sidecar_image);
    c->sidecar_command = strdup(cfg->env.sidecar_command);
    c->broker_ca_pem = cfg->broker_ca_pem ? strdup(cfg->broker_ca_pem) : NULL;
    c->broker_server_name = cfg->env.broker_server_name ? strdup(cfg->env.broker_server_name)
                                                        : NULL;
    if (!c->namespace || !c->identity || !c->broker_address || !c->sidecar_image ||
        !c->sidecar_command || (cfg->broker_ca_pem && !c->broker_ca_pem) ||
        (cfg->env.broker_server_name && !c->broker_server_name))
        goto err_free;
    c->cfg.broker_ca_pem = c->broker_ca_pem;
    c->cfg.env.broker_server_name = c->broker_server_name;
    c->cfg.namespace = c->namespace;
    c->cfg.identity = c->identity;
    c->cfg.env.broker_address = c->broker_address;
    c->cfg.env.sidecar_image = c->sidecar_image;
    c->cfg.env.sidecar_command = c->sidecar_command;
    if (*c->namespace) {
        snprintf(c->cohorts_path, sizeof(c->cohorts_path),
                 "/apis/" RECONCILE_GROUP "/v1alpha1/namespaces/%s/trainingcohorts", c->namespace);
        snprintf(c->pods_path, sizeof(c->pods_path), "/api/v1/namespaces/%s/pods", c->namespace);
        snprintf(c->secrets_path, sizeof(c->secrets_path), "/api/v1/namespaces/%s/secrets",
                 c->namespace);
    } else {
        snprintf(c->cohorts_path, sizeof(c->cohorts_path),
                 "/apis/" RECONCILE_GROUP "/v1alpha1/trainingcohorts");
        snprintf(c->pods_path, sizeof(c->pods_path), "/api/v1/pods");
        snprintf(c->secrets_path, sizeof(c->secrets_path), "/api/v1/secrets");
    }
    if (evrec_create(NULL, &c->events) < 0)
        goto err_free;
    if (workq_create(NULL, &c->q) < 0)
        goto err_free;
    rc_cohorts = (struct reflector_config){ .kube = cfg->kube, .path = c->cohorts_path,
                                            .watch_timeout_s = cfg->watch_timeout_s,
                                            .on_upsert = on_cohort, .on_delete = on_cohort,
                                            .arg = c };
    rc_pods = (struct reflector_config){ .kube = cfg->kube, .path = c->pods_path,
                                         .selector = RECONCILE_LABEL_COHORT,
                                         .watch_timeout_s = cfg->watch_timeout_s,
                                         .on_upsert = on_pod, .on_delete = on_pod, .arg = c };
    /* The cohorts' Secrets only, by their label: no other Secret is
     * cached. One that holds a cohort's Secret name without the label is
     * read only when making the cohort's finds the name taken. */
    rc_secrets = (struct reflector_config){ .kube = cfg->kube, .path = c->secrets_path,
                                            .selector = RECONCILE_LABEL_COHORT,
                                            .watch_timeout_s = cfg->watch_timeout_s,
                                            .on_upsert = on_secret, .on_delete = on_secret,
                                            .arg = c };
    rc = reflector_start(&rc_cohorts, &c->cohorts);
    if (rc < 0)
        goto err_queue;
    rc = reflector_start(&rc_pods, &c->pods);
    if (rc < 0)
        goto err_cohorts;
    rc = reflector_start(&rc_secrets, &c->secrets);
    if (rc < 0)
        goto err_pods;
    rc = wait_synced(c, sync_timeout_ms);
    if (rc < 0)
        goto err_secrets;
    /* Declared before any worker runs, so that sidecars rejoining a new
     * leader's broker find their cohorts. */
    all = reflector_list(c->cohorts, NULL);
    cJSON_ArrayForEach(it, all) {
        struct reconcile_spec spec;
        struct reconcile_why why;
        struct cstate *s;
        if (!it->string || reconcile_parse(it, &spec, &why) < 0)
            continue;
        restore_key(c, it, it->string);
        if (brokerd_declare(cfg->broker, it->string, spec.heartbeat_ms, spec.timeout_ms) == 0 &&
            (s = state_of(c, it->string, true))) {
            s->declared_hb = spec.heartbeat_ms;
            s->declared_to = spec.timeout_ms;
        }
    }
    cJSON_Delete(all);
    rc = -EAGAIN;
    for (c->n_workers = 0; c->n_workers < c->cfg.workers; c->n_workers++)
        if (pthread_create(&c->workers[c->n_workers], NULL, worker_main, c) != 0)
            goto err_threads;
    if (pthread_create(&c->ticker, NULL, ticker_main, c) != 0)
        goto err_threads;
    c->ticker_started = true;
    log_info("controller", "Caches are synced; reconciling.", LF_S("namespace",
             *c->namespace ? c->namespace : "(all)"), LF_U("workers", c->n_workers));
    *out = c;
    return 0;
err_threads:
    atomic_store(&c->stop, true);
    workq_shutdown(c->q);
    for (uint32_t i = 0; i < c->n_workers; i++)
        pthread_join(c->workers[i], NULL);
err_secrets:
    reflector_destroy(c->secrets);
err_pods:
    reflector_destroy(c->pods);
err_cohorts:
    reflector_destroy(c->cohorts);
err_queue:
    workq_destroy(c->q);
err_free:
    controller_free(c);
    return rc;
}

void controller_stop(struct controller *c)
{
    if (!c)
        return;
    atomic_store(&c->stop, true);
    workq_shutdown(c->q);
    for (uint32_t i = 0; i < c->n_workers; i++)
        pthread_join(c->workers[i], NULL);
    if (c->ticker_started)
        pthread_join(c->ticker, NULL);
    reflector_destroy(c->secrets);
    reflector_destroy(c->pods);
    reflector_destroy(c->cohorts);
    workq_destroy(c->q);
    controller_free(c);
}

void controller_stats(struct controller *c, struct controller_stats *out)
{
    struct reflector_stats a, b, d;

    memset(out, 0, sizeof(*out));
    out->reconciles = atomic_load(&c->n.reconciles);
    out->reconcile_errors = atomic_load(&c->n.errors);
    out->pods_created = atomic_load(&c->n.created);
    out->pods_deleted = atomic_load(&c->n.deleted);
    out->pods_replaced = atomic_load(&c->n.replaced);
    out->drains_started = atomic_load(&c->n.drains);
    out->drain_timeouts = atomic_load(&c->n.drain_timeouts);
    out->status_writes = atomic_load(&c->n.status_writes);
    out->events = atomic_load(&c->n.events);
    out->keys_created = atomic_load(&c->n.keys_created);
    out->pods_rolled = atomic_load(&c->n.rolled);
    reflector_stats(c->cohorts, &a);
    reflector_stats(c->pods, &b);
    reflector_stats(c->secrets, &d);
    out->watch_errors = a.errors + b.errors + d.errors;
    out->relists = a.relists_gone + b.relists_gone + d.relists_gone;
    out->queue_depth = workq_len(c->q);
    out->synced = reflector_synced(c->cohorts) && reflector_synced(c->pods) &&
                  reflector_synced(c->secrets);
    out->cohorts = (uint32_t)reflector_len(c->cohorts);
    out->pods = (uint32_t)reflector_len(c->pods);
}

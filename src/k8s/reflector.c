/* src/k8s/reflector.c: see reflector.h.
 *
 * The cache is a cJSON object keyed by "namespace/name". Lookups are
 * linear, which is cheap at the scale one operator watches (hundreds of
 * cohorts, a few thousand pods) and keeps the copies handed out simple. */
#include "k8s/reflector.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/clock.h"
#include "k8s/kube.h"
#include "base/limits.h"
#include "base/log.h"

#define BACKOFF_MIN_MS 500u
#define BACKOFF_MAX_MS 30000u

struct reflector {
    struct reflector_config cfg;
    char *path, *selector;
    pthread_t thread;
    pthread_mutex_t lock;       /* guards cache, synced, stats */
    pthread_cond_t cond;
    cJSON *cache;
    bool synced;
    volatile bool stop;
    struct reflector_stats stats;
};

static int object_key(const cJSON *obj, char *key, size_t n)
{
    const char *ns = kube_meta(obj, "namespace"), *name = kube_meta(obj, "name");
    int w;

    if (!name)
        return -EINVAL;
    w = ns && *ns ? snprintf(key, n, "%s/%s", ns, name) : snprintf(key, n, "%s", name);
    return w < 0 || (size_t)w >= n ? -ENAMETOOLONG : 0;
}

/* Sleeps up to ms, waking early when asked to stop. */
static void nap(struct reflector *r, uint32_t ms)
{
    uint64_t end = clock_now_ms() + ms;

    while (!r->stop && clock_now_ms() < end)
        clock_sleep_ms(50);
}

static void upsert(struct reflector *r, const char *key, const cJSON *obj)
{
    cJSON *copy = cJSON_Duplicate(obj, 1);

    if (!copy)
        return;
    pthread_mutex_lock(&r->lock);
    if (cJSON_GetObjectItemCaseSensitive(r->cache, key))
        cJSON_ReplaceItemInObjectCaseSensitive(r->cache, key, copy);
    else
        cJSON_AddItemToObject(r->cache, key, copy);
    pthread_mutex_unlock(&r->lock);
    if (r->cfg.on_upsert)
        r->cfg.on_upsert(r->cfg.arg, key, obj);
}

static void forget(struct reflector *r, const char *key, const cJSON *last)
{
    cJSON *gone;

    pthread_mutex_lock(&r->lock);
    gone = cJSON_DetachItemFromObjectCaseSensitive(r->cache, key);
    pthread_mutex_unlock(&r->lock);
    if (r->cfg.on_delete)
        r->cfg.on_delete(r->cfg.arg, key, last ? last : gone);
    cJSON_Delete(gone);
}

/* Replaces the cache with a fresh list: objects missing from it were
 * deleted while we were not watching. */
static int relist(struct reflector *r, char **rv)
{
    cJSON *items = NULL, *it, *stale = NULL;
    char key[LIMIT_KUBE_KEY_MAX];
    int rc;

    rc = kube_list(r->cfg.kube, r->path, r->selector, &items, rv);
    if (rc < 0)
        return rc;
    /* Collect the keys that disappeared before announcing anything. */
    pthread_mutex_lock(&r->lock);
    r->stats.lists++;
    stale = cJSON_CreateArray();
    cJSON_ArrayForEach(it, r->cache) {
        bool present = false;
        const cJSON *n;
        cJSON_ArrayForEach(n, items) {
            if (object_key(n, key, sizeof(key)) == 0 && strcmp(key, it->string) == 0) {
                present = true;
                break;
            }
        }
        if (!present)
            cJSON_AddItemToArray(stale, cJSON_CreateString(it->string));
    }
    pthread_mutex_unlock(&r->lock);
    cJSON_ArrayForEach(it, stale)
        forget(r, it->valuestring, NULL);
    cJSON_ArrayForEach(it, items) {
        if (object_key(it, key, sizeof(key)) == 0)
            upsert(r, key, it);
    }
    cJSON_Delete(stale);
    cJSON_Delete(items);
    pthread_mutex_lock(&r->lock);
    r->synced = true;
    pthread_cond_broadcast(&r->cond);
    pthread_mutex_unlock(&r->lock);
    return 0;
}

static int on_event(void *arg, const char *type, const cJSON *obj)
{
    struct reflector *r = arg;
    char key[LIMIT_KUBE_KEY_MAX];

    if (strcmp(type, "BOOKMARK") == 0)
        return 0;               /* kube_watch already moved the version on */
    if (object_key(obj, key, sizeof(key)) < 0) {
        log_warn("reflector", "A watch event named no object; it was ignored.", LF_S("path", r->path),
                 LF_S("type", type));
        return 0;
    }
    pthread_mutex_lock(&r->lock);
    r->stats.events++;
    pthread_mutex_unlock(&r->lock);
    if (strcmp(type, "DELETED") == 0)
        forget(r, key, obj);
    else
        upsert(r, key, obj);
    return 0;
}

static void *reflector_main(void *arg)
{
    struct reflector *r = arg;
    uint32_t backoff = BACKOFF_MIN_MS;
    char *rv = NULL;
    bool listed = false;

    while (!r->stop) {
        int rc;

        if (!listed) {
            free(rv);
            rv = NULL;
            rc = relist(r, &rv);
            if (rc < 0)
                goto failed;
            listed = true;
        }
        pthread_mutex_lock(&r->lock);
        r->stats.watches++;
        pthread_mutex_unlock(&r->lock);
        rc = kube_watch(r->cfg.kube, r->path, r->selector, &rv, r->cfg.watch_timeout_s, on_event, r,
                        &r->stop);
        if (rc == 0) {
            backoff = BACKOFF_MIN_MS;
            continue;           /* the server ended the watch: resume */
        }
        if (rc == -EREMCHG) {
            pthread_mutex_lock(&r->lock);
            r->stats.relists_gone++;
            pthread_mutex_unlock(&r->lock);
            log_info("reflector", "The watch fell behind the server's history; listing again.",
                     LF_S("path", r->path));
            listed = false;
            continue;
        }
failed:
        pthread_mutex_lock(&r->lock);
        r->stats.errors++;
        pthread_mutex_unlock(&r->lock);
        log_warn("reflector", "Listing or watching failed; retrying after a pause.",
                 LF_S("path", r->path), LF_S("error", kube_strerror(rc)), LF_U("pause_ms", backoff));
        nap(r, backoff);
        backoff = backoff * 2 > BACKOFF_MAX_MS ? BACKOFF_MAX_MS : backoff * 2;
        /* A watch that failed for a reason other than 410 may resume; a
         * list that failed starts over. */
    }
    free(rv);
    return NULL;
}

int reflector_start(const struct reflector_config *cfg, struct reflector **out)
{
    struct reflector *r;
    int rc = -ENOMEM;

    if (!cfg || !cfg->kube || !cfg->path)
        return -EINVAL;
    r = calloc(1, sizeof(*r));
    if (!r)
        return -ENOMEM;
    r->cfg = *cfg;
    if (!r->cfg.watch_timeout_s)
        r->cfg.watch_timeout_s = 300;
    r->path = strdup(cfg->path);
    r->selector = cfg->selector ? strdup(cfg->selector) : NULL;
    r->cache = cJSON_CreateObject();
    if (!r->path || (cfg->selector && !r->selector) || !r->cache)
        goto err_free;
    pthread_mutex_init(&r->lock, NULL);
    clock_cond_init(&r->cond);
    if (pthread_create(&r->thread, NULL, reflector_main, r) != 0) {
        rc = -EAGAIN;
        goto err_sync;
    }
    *out = r;
    return 0;
err_sync:
    pthread_cond_destroy(&r->cond);
    pthread_mutex_destroy(&r->lock);
err_free:
    cJSON_Delete(r->cache);
    free(r->path);
    free(r->selector);
    free(r);
    return rc;
}

void reflector_destroy(struct reflector *r)
{
    if (!r)
        return;
    r->stop = true;
    pthread_join(r->thread, NULL);
    cJSON_Delete(r->cache);
    pthread_cond_destroy(&r->cond);
    pthread_mutex_destroy(&r->lock);
    free(r->path);
    free(r->selector);
    free(r);
}

bool reflector_synced(struct reflector *r)
{
    bool s;

    pthread_mutex_lock(&r->lock);
    s = r->synced;
    pthread_mutex_unlock(&r->lock);
    return s;
}

bool reflector_wait_synced(struct reflector *r, uint32_t timeout_ms)
{
    struct timespec ts = clock_deadline(timeout_ms);
    bool s;

    pthread_mutex_lock(&r->lock);
    while (!r->synced && pthread_cond_timedwait(&r->cond, &r->lock, &ts) == 0)
        ;
    s = r->synced;
    pthread_mutex_unlock(&r->lock);
    return s;
}

cJSON *reflector_get(struct reflector *r, const char *key)
{
    cJSON *c;

    pthread_mutex_lock(&r->lock);
    c = cJSON_Duplicate(cJSON_GetObjectItemCaseSensitive(r->cache, key), 1);
    pthread_mutex_unlock(&r->lock);
    return c;
}

cJSON *reflector_list(struct reflector *r, const char *prefix)
{
    cJSON *out = cJSON_CreateArray(), *it;
    size_t pl = prefix ? strlen(prefix) : 0;

    if (!out)
        return NULL;
    pthread_mutex_lock(&r->lock);
    cJSON_ArrayForEach(it, r->cache)
        if (!prefix || strncmp(it->string, prefix, pl) == 0)
            cJSON_AddItemToArray(out, cJSON_Duplicate(it, 1));
    pthread_mutex_unlock(&r->lock);
    return out;
}

size_t reflector_len(struct reflector *r)
{
    size_t n;

    pthread_mutex_lock(&r->lock);
    n = (size_t)cJSON_GetArraySize(r->cache);
    pthread_mutex_unlock(&r->lock);
    return n;
}

void reflector_stats(struct reflector *r, struct reflector_stats *out)
{
    pthread_mutex_lock(&r->lock);
    *out = r->stats;
    pthread_mutex_unlock(&r->lock);
}

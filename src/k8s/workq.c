/* src/k8s/workq.c: see workq.h.
 *
 * Keys live in a chained hash table; the ones waiting sit in a binary
 * min-heap ordered by (due time, arrival), each entry remembering its heap
 * slot so an earlier re-add can move it up in place. An entry exists while
 * its key is queued, processing, or has failures to remember.
 */
#include "k8s/workq.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/clock.h"

#define NOT_QUEUED ((size_t)-1)

struct entry {
    struct entry *next;         /* hash chain */
    char *key;
    uint64_t due, seq;          /* heap order */
    size_t slot;                /* heap index, or NOT_QUEUED */
    bool processing;
    bool dirty;                 /* added while processing */
    uint64_t dirty_due;
    uint32_t failures;
};

struct workq {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    struct workq_config cfg;
    struct entry **buckets;
    size_t n_buckets, n_entries;
    struct entry **heap;
    size_t n_heap, cap_heap;
    uint64_t seq;
    uint32_t processing;
    bool shutdown;
};

static uint64_t hash(const char *s)
{
    uint64_t h = 1469598103934665603ull;        /* FNV-1a */

    for (; *s; s++)
        h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return h;
}

static struct entry **chain(const struct workq *q, const char *key)
{
    return &q->buckets[hash(key) & (q->n_buckets - 1)];
}

static struct entry *find(const struct workq *q, const char *key)
{
    for (struct entry *e = *chain(q, key); e; e = e->next)
        if (strcmp(e->key, key) == 0)
            return e;
    return NULL;
}

/* Doubles the table when it is as full as it has buckets. */
static void maybe_grow(struct workq *q)
{
    size_t n = q->n_buckets * 2;
    struct entry **b;

    if (q->n_entries < q->n_buckets)
        return;
    b = calloc(n, sizeof(*b));
    if (!b)
        return;         /* chains just get longer */
    for (size_t i = 0; i < q->n_buckets; i++) {
        for (struct entry *e = q->buckets[i], *next; e; e = next) {
            next = e->next;
            e->next = b[hash(e->key) & (n - 1)];
            b[hash(e->key) & (n - 1)] = e;
        }
    }
    free(q->buckets);
    q->buckets = b;
    q->n_buckets = n;
}

static int get_entry(struct workq *q, const char *key, struct entry **out)
{
    struct entry *e = find(q, key);

    if (e) {
        *out = e;
        return 0;
    }
    if (q->n_entries >= q->cfg.max_keys)
        return -ENOSPC;
    e = calloc(1, sizeof(*e));
    if (!e || !(e->key = strdup(key))) {
        free(e);
        return -ENOMEM;
    }
    e->slot = NOT_QUEUED;
    e->next = *chain(q, key);
    *chain(q, key) = e;
    q->n_entries++;
    maybe_grow(q);
    *out = e;
    return 0;
}

/* Frees `e` once nothing about it is worth remembering. */
static void maybe_drop(struct workq *q, struct entry *e)
{
    struct entry **p;

    if (e->slot != NOT_QUEUED || e->processing || e->failures > 0)
        return;
    for (p = chain(q, e->key); *p != e; p = &(*p)->next)
        ;
    *p = e->next;
    q->n_entries--;
    free(e->key);
    free(e);
}

/* ---- heap ---- */

static bool before(const struct entry *a, const struct entry *b)
{
    return a->due < b->due || (a->due == b->due && a->seq < b->seq);
}

static void place(struct workq *q, size_t i, struct entry *e)
{
    q->heap[i] = e;
    e->slot = i;
}

static void sift_up(struct workq *q, size_t i)
{
    struct entry *e = q->heap[i];

    while (i > 0 && before(e, q->heap[(i - 1) / 2])) {
        place(q, i, q->heap[(i - 1) / 2]);
        i = (i - 1) / 2;
    }
    place(q, i, e);
}

static void sift_down(struct workq *q, size_t i)
{
    struct entry *e = q->heap[i];

    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= q->n_heap)
            break;
        if (c + 1 < q->n_heap && before(q->heap[c + 1], q->heap[c]))
            c++;
        if (!before(q->heap[c], e))
            break;
        place(q, i, q->heap[c]);
        i = c;
    }
    place(q, i, e);
}

static int heap_push(struct workq *q, struct entry *e)
{
    if (q->n_heap == q->cap_heap) {
        size_t cap = q->cap_heap ? q->cap_heap * 2 : 64;
        struct entry **h = realloc(q->heap, cap * sizeof(*h));
        if (!h)
            return -ENOMEM;
        q->heap = h;
        q->cap_heap = cap;
    }
    e->seq = q->seq++;
    place(q, q->n_heap++, e);
    sift_up(q, e->slot);
    return 0;
}

static struct entry *heap_pop(struct workq *q)
{
    struct entry *top = q->heap[0];

    top->slot = NOT_QUEUED;
    if (--q->n_heap > 0) {
        place(q, 0, q->heap[q->n_heap]);
        sift_down(q, 0);
    }
    return top;
}

/* ---- API ---- */

int workq_create(const struct workq_config *cfg, struct workq **out)
{
    struct workq *q = calloc(1, sizeof(*q));

    if (!q)
        return -ENOMEM;
    q->cfg.base_delay_ms = cfg && cfg->base_delay_ms ? cfg->base_delay_ms : 5;
    q->cfg.max_delay_ms = cfg && cfg->max_delay_ms ? cfg->max_delay_ms : 300000;
    q->cfg.max_keys = cfg && cfg->max_keys ? cfg->max_keys : 65536;
    q->n_buckets = 64;
    q->buckets = calloc(q->n_buckets, sizeof(*q->buckets));
    if (!q->buckets) {
        free(q);
        return -ENOMEM;
    }
    pthread_mutex_init(&q->lock, NULL);
    clock_cond_init(&q->cond);
    *out = q;
    return 0;
}

void workq_destroy(struct workq *q)
{
    if (!q)
        return;
    for (size_t i = 0; i < q->n_buckets; i++) {
        for (struct entry *e = q->buckets[i], *next; e; e = next) {
            next = e->next;
            free(e->key);
            free(e);
        }
    }
    free(q->buckets);
    free(q->heap);
    pthread_cond_destroy(&q->cond);
    pthread_mutex_destroy(&q->lock);
    free(q);
}

int workq_add_after(struct workq *q, const char *key, uint64_t now, uint32_t delay_ms)
{
    uint64_t due = now + delay_ms;
    struct entry *e;
    int rc;

    pthread_mutex_lock(&q->lock);
    if (q->shutdown) {
        rc = -ESHUTDOWN;
        goto out;
    }
    rc = get_entry(q, key, &e);
    if (rc < 0)
        goto out;
    if (e->processing) {
        /* Handed out already: run it again once this pass is done. */
        e->dirty_due = e->dirty && e->dirty_due < due ? e->dirty_due : due;
        e->dirty = true;
    } else if (e->slot != NOT_QUEUED) {
        if (due < e->due) {
            e->due = due;
            sift_up(q, e->slot);
        }
    } else {
        e->due = due;
        rc = heap_push(q, e);
        if (rc < 0)
            maybe_drop(q, e);
    }
    pthread_cond_broadcast(&q->cond);
out:
    pthread_mutex_unlock(&q->lock);
    return rc;
}

int workq_add(struct workq *q, const char *key, uint64_t now)
{
    return workq_add_after(q, key, now, 0);
}

int workq_add_rate_limited(struct workq *q, const char *key, uint64_t now)
{
    uint64_t delay = 0;
    struct entry *e;
    int rc;

    pthread_mutex_lock(&q->lock);
    rc = q->shutdown ? -ESHUTDOWN : get_entry(q, key, &e);
    if (rc == 0) {
        /* base * 2^failures, computed without overflow. */
        delay = q->cfg.base_delay_ms;
        for (uint32_t i = 0; i < e->failures && delay < q->cfg.max_delay_ms; i++)
            delay *= 2;
        if (delay > q->cfg.max_delay_ms)
            delay = q->cfg.max_delay_ms;
        e->failures++;
    }
    pthread_mutex_unlock(&q->lock);
    return rc < 0 ? rc : workq_add_after(q, key, now, (uint32_t)delay);
}

void workq_forget(struct workq *q, const char *key)
{
    struct entry *e;

    pthread_mutex_lock(&q->lock);
    e = find(q, key);
    if (e) {
        e->failures = 0;
        maybe_drop(q, e);
    }
    pthread_mutex_unlock(&q->lock);
}

uint32_t workq_failures(struct workq *q, const char *key)
{
    struct entry *e;
    uint32_t n;

    pthread_mutex_lock(&q->lock);
    e = find(q, key);
    n = e ? e->failures : 0;
    pthread_mutex_unlock(&q->lock);
    return n;
}

static int get_locked(struct workq *q, uint64_t now, char *buf, size_t n, uint32_t *wait_ms)
{
    struct entry *e;
    uint64_t d;

    if (q->shutdown)
        return -ESHUTDOWN;
    if (q->n_heap == 0) {
        *wait_ms = UINT32_MAX;
        return -EAGAIN;
    }
    e = q->heap[0];
    if (e->due > now) {
        d = e->due - now;
        *wait_ms = d > UINT32_MAX - 1 ? UINT32_MAX - 1 : (uint32_t)d;
        return -EAGAIN;
    }
    if (strlen(e->key) >= n)
        return -ENAMETOOLONG;
    heap_pop(q);
    memcpy(buf, e->key, strlen(e->key) + 1);
    e->processing = true;
    q->processing++;
    return 0;
}

int workq_get(struct workq *q, uint64_t now, char *buf, size_t n, uint32_t *wait_ms)
{
    int rc;

    pthread_mutex_lock(&q->lock);
    rc = get_locked(q, now, buf, n, wait_ms);
    pthread_mutex_unlock(&q->lock);
    return rc;
}

int workq_wait(struct workq *q, char *buf, size_t n, uint32_t timeout_ms)
{
    uint64_t end = clock_now_ms() + timeout_ms;
    int rc;

    pthread_mutex_lock(&q->lock);
    for (;;) {
        uint64_t now = clock_now_ms();
        uint32_t wait = 0;
        struct timespec ts;

        rc = get_locked(q, now, buf, n, &wait);
        if (rc != -EAGAIN)
            break;
        if (now >= end) {
            rc = -ETIMEDOUT;
            break;
        }
        if ((uint64_t)wait > end - now)
            wait = (uint32_t)(end - now);
        ts = clock_deadline(wait);
        pthread_cond_timedwait(&q->cond, &q->lock, &ts);
    }
    pthread_mutex_unlock(&q->lock);
    return rc;
}

void workq_done(struct workq *q, const char *key, uint64_t now)
{
    struct entry *e;

    pthread_mutex_lock(&q->lock);
    e = find(q, key);
    if (e && e->processing) {
        e->processing = false;
        q->processing--;
        if (e->dirty && !q->shutdown) {
            e->dirty = false;
            e->due = e->dirty_due > now ? e->dirty_due : now;
            if (heap_push(q, e) == 0)
                pthread_cond_broadcast(&q->cond);
        }
        maybe_drop(q, e);
    }
    pthread_mutex_unlock(&q->lock);
}

uint32_t workq_len(struct workq *q)
{
    uint32_t n;

    pthread_mutex_lock(&q->lock);
    n = (uint32_t)q->n_heap + q->processing;
    pthread_mutex_unlock(&q->lock);
    return n;
}

void workq_shutdown(struct workq *q)
{
    pthread_mutex_lock(&q->lock);
    q->shutdown = true;
    pthread_cond_broadcast(&q->cond);
    pthread_mutex_unlock(&q->lock);
}

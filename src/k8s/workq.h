/* src/k8s/workq.h: the operator's work queue, keyed by object (for cohort:
 * "namespace/name"), with the semantics controllers rely on:
 *
 * - A key is queued at most once: adding it again while it waits does
 *   nothing, so a burst of events costs one reconcile.
 * - A key is never handed out twice at once: added while it is being
 *   processed, it is queued again when workq_done() is called.
 * - Retries are rate-limited per key: the n-th consecutive retry of a key
 *   waits base * 2^(n-1), capped; workq_forget() resets the count after a
 *   success. Delayed adds (requeue after a time) keep the earliest time.
 *
 * The queue's decisions take `now` (monotonic ms) so tests inject time;
 * workq_wait() is the blocking form the operator's workers use.
 */
#ifndef COHORT_WORKQ_H
#define COHORT_WORKQ_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct workq;

struct workq_config {
    uint32_t base_delay_ms;     /* first retry (default 5) */
    uint32_t max_delay_ms;      /* cap (default 300000: five minutes) */
    uint32_t max_keys;          /* distinct keys tracked; adds past it fail (default 65536) */
};

/* Returns 0, -ENOMEM. `cfg` may be NULL for the defaults. The caller frees
 * with workq_destroy(). Thread-safe. */
int workq_create(const struct workq_config *cfg, struct workq **out);
void workq_destroy(struct workq *q);        /* NULL is fine */

/* Queues `key` (copied) now. Returns 0, -ENOSPC, -ENOMEM, -ESHUTDOWN. */
int workq_add(struct workq *q, const char *key, uint64_t now);
/* Queues `key` at now + delay_ms (an earlier pending time wins). */
int workq_add_after(struct workq *q, const char *key, uint64_t now, uint32_t delay_ms);
/* Queues `key` after its per-key backoff, and counts one more failure. */
int workq_add_rate_limited(struct workq *q, const char *key, uint64_t now);
/* Clears the failure count of `key` (call after a successful reconcile). */
void workq_forget(struct workq *q, const char *key);
/* Consecutive failures recorded for `key`. */
uint32_t workq_failures(struct workq *q, const char *key);

/* Hands out a key that is due at `now`, copied into buf (of size n), and
 * marks it processing. Returns 0, -EAGAIN (nothing due; *wait_ms says how
 * long until something is, or UINT32_MAX), -ENAMETOOLONG (buf too small;
 * the key stays queued), -ESHUTDOWN. */
int workq_get(struct workq *q, uint64_t now, char *buf, size_t n, uint32_t *wait_ms);
/* Blocks until a key is due (or up to timeout_ms), with the real clock.
 * Returns as workq_get, with -ETIMEDOUT instead of -EAGAIN. */
int workq_wait(struct workq *q, char *buf, size_t n, uint32_t timeout_ms);
/* Processing of `key` is over; if it was added meanwhile, it is queued. */
void workq_done(struct workq *q, const char *key, uint64_t now);

/* Keys queued or processing. */
uint32_t workq_len(struct workq *q);
/* Wakes every waiter; later calls return -ESHUTDOWN. */
void workq_shutdown(struct workq *q);

#endif

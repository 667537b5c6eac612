/* src/k8s/evrec.h: the decisions of an Event recorder, as client-go's
 * record package makes them, so that a crash loop does not flood the
 * cluster with Events:
 *
 * - Deduplication: an Event equal to one recorded for the same object
 *   within the last 10 minutes (same type, reason and message) is not made
 *   again; the existing one's count and lastTimestamp are patched.
 * - A spam filter per object: a token bucket of 25 that refills one token
 *   every 5 minutes (client-go's EventSourceObjectSpamFilter); an Event,
 *   new or patched, that finds it empty is dropped.
 *
 * Pure bookkeeping under a lock: no I/O; the caller makes or patches the
 * Event and reports back with evrec_note(). `now` is monotonic ms.
 */
#ifndef COHORT_EVREC_H
#define COHORT_EVREC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define EVREC_NAME_MAX 320

struct evrec;

struct evrec_config {
    uint32_t burst;             /* spam filter tokens per object (default 25) */
    uint32_t refill_ms;         /* one token back per this long (default 300000) */
    uint32_t dedupe_ms;         /* an equal Event within this is patched (default 600000) */
    uint32_t max_entries;       /* Events remembered in all; the oldest go (default 4096) */
};

/* Returns 0 or -ENOMEM; `cfg` may be NULL for the defaults. The caller
 * frees *out with evrec_destroy(). */
int evrec_create(const struct evrec_config *cfg, struct evrec **out);
void evrec_destroy(struct evrec *r);    /* NULL is fine */

enum evrec_action {
    EVREC_CREATE,               /* make a new Event, then evrec_note() its name */
    EVREC_PATCH,                /* patch Event *name to count *count */
    EVREC_DROP,                 /* the spam filter says no */
};

/* What to do with an Event about `object` (a key such as "ns/name").
 * Strings are borrowed. For EVREC_PATCH, fills name (the Event to patch)
 * and *count (its new count) and remembers the new count; a patch that
 * fails should be followed by evrec_forget_event() and a create. */
enum evrec_action evrec_decide(struct evrec *r, const char *object, bool warning,
                               const char *reason, const char *message, uint64_t now,
                               char name[EVREC_NAME_MAX], uint32_t *count);

/* Remembers that Event `name` (copied) was made for these fields, count 1. */
void evrec_note(struct evrec *r, const char *object, bool warning, const char *reason,
                const char *message, const char *name, uint64_t now);

/* Forgets Event `name` (it is gone: a patch got 404). */
void evrec_forget_event(struct evrec *r, const char *name);

/* Forgets everything about `object` (it was deleted). */
void evrec_forget(struct evrec *r, const char *object);
#endif

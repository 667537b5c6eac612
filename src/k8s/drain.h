/* src/k8s/drain.h: scale-down without a lost round. The operator drains a
 * leaving member through the broker (broker_drain in membership/broker.c
 * leaves it out of the next epoch while it stays connected) and deletes its
 * pod once the broker says every other member has moved on, or once the
 * drain deadline passes. This module keeps the drains under way for one
 * cohort and decides each pass's step; the controller carries it out.
 * Pure: no I/O, no clock of its own. */
#ifndef COHORT_DRAIN_H
#define COHORT_DRAIN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* The drains under way in one cohort, by member id. Caller-owned:
 * zero-initialise, free with drain_set_cleanup(). */
struct drain_set {
    struct drain_entry {
        char *id;                   /* owned */
        uint64_t started;           /* when the drain began */
    } *items;
    size_t n;
};

void drain_set_cleanup(struct drain_set *s);
/* The drain of `id`, or NULL (borrowed: valid until the set changes). */
struct drain_entry *drain_set_find(struct drain_set *s, const char *id);
/* Starts tracking `id` (copied) from `now`. Returns the entry or NULL
 * (out of memory; the set is unchanged). */
struct drain_entry *drain_set_add(struct drain_set *s, const char *id, uint64_t now);
/* Stops tracking `id`; a name not tracked is fine. */
void drain_set_forget(struct drain_set *s, const char *id);

enum drain_action {
    DRAIN_DELETE_STRANGER,          /* not a member, no drain: delete the pod now */
    DRAIN_START,                    /* a member: start draining it */
    DRAIN_WAIT,                     /* drain under way: mark it again, look next pass */
    DRAIN_DELETE_DRAINED,           /* out of the epoch everyone adopted: delete */
    DRAIN_DELETE_TIMEOUT,           /* past the deadline: delete anyway */
};

/* One pass over a leaving pod. `d` is its drain (NULL if none), `member`
 * whether the broker knows it, `drained` what brokerd_drained said (1
 * drained, 0 not yet, -ENOENT no such member or cohort), `now` and the
 * drain deadline in ms. */
enum drain_action drain_decide(const struct drain_entry *d, bool member, int drained,
                               uint64_t now, uint32_t deadline_ms);

#endif

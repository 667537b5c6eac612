/* tests/unit/engines.h: several all-reduce engines on loopback in one
 * process, one thread per member for a call, for the suites of the layers
 * that run on the engine (top-k, PowerSGD, the gather). Members are
 * "m-0", "m-1", ... and epochs list them in that order. The helpers fail
 * the running test with cr_assert, so they belong on the test's thread;
 * the per-member functions engines_each() runs must not assert (they
 * record what they saw for the test to check after the join). */
#ifndef COHORT_TEST_ENGINES_H
#define COHORT_TEST_ENGINES_H

#include <stddef.h>
#include <stdint.h>

#include "engine/allreduce.h"

#define ENGINES_MAX 8

struct engines {
    size_t n;
    struct engines_peer {
        struct allreduce *ar;
        int fd;
        char addr[64];
        char id[24];
    } p[ENGINES_MAX];
};

/* n engines (log quiet), all in epoch 1 of all n. */
void engines_start(struct engines *c, size_t n, uint32_t timeout_ms);
/* Every engine adopts epoch `number` of the first `members` engines
 * (engines outside it adopt it too, and are then not members). */
void engines_adopt(struct engines *c, uint64_t number, size_t members);
void engines_stop(struct engines *c);
/* Runs fn(i, arg) for every i < n on a thread each and joins them all. */
void engines_each(struct engines *c, size_t n, void (*fn)(size_t i, void *arg), void *arg);

#endif

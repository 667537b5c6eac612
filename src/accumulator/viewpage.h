/* src/accumulator/viewpage.h: the view page, in the last 4 KiB of a
 * trainer's tensors memfd. The node's side (a sidecar, or a node in the
 * trainer's own process) publishes there what cohort_update() reads, so a
 * trainer's questions cost no call, and cohort_wait() sleeps on it. */
#ifndef COHORT_VIEWPAGE_H
#define COHORT_VIEWPAGE_H

#include <stdint.h>

#include "accumulator/tlink.h"

/* The sidecar publishes the trainer's view in the shared memory whenever
 * it may have changed, so cohort_update() reads it with no call. `seq` is
 * a seqlock, odd while the sidecar writes; 0 means nothing published yet.
 * `gen` counts publications and is the futex a waiting trainer sleeps on;
 * `waiters` says whether one does. All are read and written with atomics:
 * the two sides are processes. */
#define VIEWPAGE_BYTES 4096
struct viewpage {
    uint64_t seq;
    uint32_t gen;
    uint32_t waiters;
    struct tlink_view view;
};

/* Writer side: publishes `w` (one writer at a time) and wakes a waiter. */
void viewpage_publish(struct viewpage *s, const struct tlink_view *w);
/* Reader side: copies the latest view into *out. Returns 0, or -EAGAIN
 * when nothing was published yet or the writer kept it busy. */
int viewpage_read(const struct viewpage *s, struct tlink_view *out);
/* The publication count: read it before the view, wait on it after. */
uint32_t viewpage_gen(const struct viewpage *s);
/* Sleeps until a publication after `seen` (a value of viewpage_gen),
 * at most timeout_ms. Returns 0 (something was published: read again) or
 * -ETIMEDOUT. */
int viewpage_wait(struct viewpage *s, uint32_t seen, int timeout_ms);

#endif

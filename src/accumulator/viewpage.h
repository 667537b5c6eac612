/* src/accumulator/viewpage.h: the view page, in the last 4 KiB of a
 * trainer's tensors memfd. The node's side (a sidecar, or a node in the
 * trainer's own process) publishes there what cohort_update() reads, so a
 * trainer's questions cost no call, and cohort_wait() sleeps on it. */
#ifndef COHORT_VIEWPAGE_H
#define COHORT_VIEWPAGE_H

#include <stdbool.h>
#include <stdint.h>

#include "accumulator/tlink.h"

/* The sidecar publishes the trainer's view in the shared memory whenever
 * it may have changed, so cohort_update() reads it with no call. `seq` is
 * a seqlock, odd while the sidecar writes; 0 means nothing published yet.
 * `gen` counts publications and is the futex a waiting trainer sleeps on;
 * `waiters` says whether one does. All are read and written with atomics:
 * the two sides are processes. */
#define VIEWPAGE_BYTES 4096

/* The doorbell: a trainer's CONTRIBUTE or CONSUME handed to the node's
 * thread through the page, with no message and no wake of the sidecar's
 * link thread, while that thread spins for the trainer's next move (node.c,
 * NODE_SPIN_US). Whoever serves a request claims it first, by moving
 * `state` from POSTED to TAKEN, and the trainer withdraws one nobody took
 * by moving it from POSTED back to EMPTY: a request is served once, by
 * the node's thread or, withdrawn, on the socket. `state` is also the futex
 * a trainer sleeps on for DONE, `waiters` says whether it does.
 *
 * `listening` and `state` form a Dekker pair: the trainer posts, then reads
 * `listening`; the server clears `listening`, then tries one last take. So
 * a trainer that saw the server listening after it posted is sure of a take
 * without waiting out a timeout, and one that did not withdraws at once.
 *
 * An old trainer never posts; an old sidecar never listens, and a trainer
 * then uses the socket: the bell needs no protocol version. The trainer may
 * write anything here; the server reads a request once, after its claim. */
enum viewbell_state { VB_EMPTY, VB_POSTED, VB_TAKEN, VB_DONE };
struct viewbell {
    uint32_t state;             /* enum viewbell_state */
    uint32_t listening;         /* the server takes posts now */
    uint32_t waiters;           /* a trainer sleeps on state */
    uint32_t type;              /* TL_CONTRIBUTE or TL_CONSUME */
    uint64_t value;             /* its tlink_u64 */
    int64_t status;             /* the answer: 0 or -errno */
};

struct viewpage {
    uint64_t seq;
    uint32_t gen;
    uint32_t waiters;
    struct tlink_view view;
    /* On a line of its own: the trainer writes it while the server
     * publishes views. */
    struct viewbell bell __attribute__((aligned(64)));
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

/* Trainer side of the doorbell; one request at a time. Posts `type` and
 * `value` if the server listens, and waits up to TLINK_SPIN_US for its
 * take. Returns 1 once the server took it (wait for the answer with
 * viewpage_bell_wait), or 0 when nothing is posted any more: nobody
 * listened, the take did not come (the request was withdrawn), or a
 * request is still outstanding; send it another way. */
int viewpage_ring(struct viewpage *s, uint32_t type, uint64_t value);
/* Waits up to timeout_ms for the answer to a taken request. Returns 0 and
 * its status in *status (the bell is free again), -ETIMEDOUT (still the
 * server's: call again), or -EPROTO when the page holds no taken request
 * (a server that broke the protocol). */
int viewpage_bell_wait(struct viewpage *s, int timeout_ms, int64_t *status);

/* Server side of the doorbell, one thread. Starts or stops listening;
 * after stopping, take once more (see struct viewbell). */
void viewpage_listen(struct viewpage *s, bool on);
/* Claims a posted request: true with its type and value, copied once;
 * false when none is posted. Answer every claimed request. */
bool viewpage_take(struct viewpage *s, uint32_t *type, uint64_t *value);
/* Answers the claimed request and wakes its trainer. */
void viewpage_answer(struct viewpage *s, int64_t status);

#endif

/* tests/unit/fake_nccl.h: NCCL for the unit tests, among members that are
 * threads of one process, with real sums.
 *
 * Each simulated member (a "process") has its own operations table
 * (struct ncomm_ops) and call log; all share a world. Communicators made
 * from the same unique id form one group: a creation stays in progress
 * until every rank of the group has called ncclCommInitRankConfig, as
 * NCCL's does. Collectives are matched across the group by their order:
 * the last rank to queue the k-th one computes it for all (the sum of
 * every rank's input, each multiplied by its scale, in rank order, into
 * every rank's output), and each rank's stream then reports it finished.
 * Device addresses are host addresses. A rank that never queues its part
 * leaves the others in progress, as a dead peer does on a GPU, until they
 * abort.
 *
 * Where a member's table has ncclCommShrink (fake_nccl_with_shrink), a
 * shrink behaves as NCCL 2.27's: only the ranks that remain call it, all
 * with the same list of excluded ranks; their child stays in progress
 * until every one of them has called it, and its ranks are the parent's
 * renumbered contiguously, in the parent's order. With NCCL_SHRINK_ABORT
 * (`cancel`) the parent's collective in flight is terminated first and
 * never finishes; without it, a parent with a collective in flight on
 * this rank gives a child that never becomes ready (NCCL asks for no
 * outstanding work then). The parent stays allocated until aborted.
 */
#ifndef COHORT_TEST_FAKE_NCCL_H
#define COHORT_TEST_FAKE_NCCL_H

#include <pthread.h>
#include <stdbool.h>

#include "gpu/ncomm.h"

#define FAKE_NCCL_COMMS 32
#define FAKE_NCCL_RANKS 8

struct fake_nccl_group;

struct fake_nccl_comm {
    struct fake_nccl_group *g;
    int rank;
    bool live;
    uint64_t queued;            /* collectives queued so far */
};

/* A stream: what was last queued on it, in which group. */
struct fake_nccl_stream {
    struct fake_nccl_group *g;
    uint64_t seq;               /* 1-based: done when the group has done this many */
};

struct fake_nccl_world {
    pthread_mutex_t mu;
    struct fake_nccl_group *groups;     /* a list, freed with the world */
    struct fake_nccl_comm comms[FAKE_NCCL_COMMS];
    int ncomms;
    uint8_t next_id;
};

struct fake_nccl {
    struct ncomm_ops ops;
    struct fake_nccl_world *w;
    char log[2048];
    /* Knobs, set before the calls they shape. */
    int fail_all_reduce;        /* the call returns this */
    int fail_init;              /* ncclCommInitRankConfig returns this */
    int fail_shrink;            /* ncclCommShrink returns this */
    bool hold;                  /* this rank never takes part in an all-reduce
                                 * (broadcasts go on) */
};

void fake_nccl_world_init(struct fake_nccl_world *w);
void fake_nccl_world_free(struct fake_nccl_world *w);
/* Communicators of the world not yet aborted. */
int fake_nccl_live(struct fake_nccl_world *w);
/* A library without ncclCommShrink (older than 2.27): ncomm rebuilds. */
void fake_nccl_init(struct fake_nccl *f, struct fake_nccl_world *w);
/* Gives f's table ncclCommShrink (NCCL 2.27 and later). */
void fake_nccl_with_shrink(struct fake_nccl *f);
#endif

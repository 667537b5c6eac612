/* src/accumulator/gpuchan.h: the engine as the channel an epoch's NCCL
 * agreement travels on (gpu/ncomm.h, ncomm_agree): each sum is an
 * in-place SUM all-reduce of 64-bit integers among the epoch's members
 * over the engine's connections, whose greetings prove the cohort's key
 * (and, with integrity_mac, whose every frame is tagged under it). So the
 * NCCL unique id reaches only members that hold the key, with no second
 * protocol or port: the way state transfer travels.
 */
#ifndef COHORT_GPUCHAN_H
#define COHORT_GPUCHAN_H

#include <stdint.h>

#include "gpu/ncomm.h"

struct allreduce;

/* Caller-owned, and registered with the engine by address: it must not
 * move between gpuchan_init and gpuchan_cleanup. */
struct gpuchan {
    uint64_t words[NCOMM_XCHG_WORDS];
    struct allreduce *ar;       /* borrowed */
    int handle;
    uint64_t round;             /* the engine round of the next sum */
};

/* Registers g->words with `ar` (borrowed; it must outlive g). The sums
 * use engine rounds first_round, first_round + 1, ...: the caller keeps
 * them apart from its own rounds in the epoch. Returns 0 or the engine's
 * -errno (-ENOSPC: no registration left). */
int gpuchan_init(struct gpuchan *g, struct allreduce *ar, uint64_t first_round);
void gpuchan_cleanup(struct gpuchan *g);

/* The channel for ncomm_agree; g is borrowed by it. */
struct ncomm_channel gpuchan_channel(struct gpuchan *g);
#endif

/* src/collective/group_powersgd.h: PowerSGD with error feedback as a
 * group's collective (mlbench's PowerAggregation), applied whole or not
 * at all across membership changes.
 *
 *   struct group_powersgd_matrix w[2] = { { 6, 8 }, { 4, 6 } };
 *   group_powersgd_create(g, w, 2, 10, rank, seed, true, &p);  // + 10 bias floats
 *   group_powersgd_reduce(p, grads, DTYPE_AVG, 0);  // every member, in order
 *   group_powersgd_destroy(p);
 *
 * The algorithm is the engine's (engine/powersgd.h, whose comments give
 * the why of the error's definition), for each matrix: for M' = M + E,
 * P = sum of M'Q, P^ = P's columns orthonormalised, Q = sum (or mean) of
 * M'^T P^, the result is P^ Q^T on every member, and E = M' - P^ Q_own^T
 * keeps what this member's own share left out. Every matrix's P goes in
 * one all-reduce and every Q in a second, the vectors appended to the Qs
 * and so reduced exactly, with the same op.
 *
 * Why not the engine's powersgd_reduce: it commits E and the warm start
 * inside its two engine runs, while a group counts a run that a newer
 * epoch touched as failed even when it completed, and hands a member that
 * was mid-call the others' result instead of a new one. So one reduce is
 * one group call of two steps (group_steps): both all-reduces run in one
 * epoch, or the call is retried whole in the next, and the state is
 * committed only after the call returns. The call's result is P^, the
 * reduced Q and the number of the epoch that completed it, the same bytes
 * on every member; from those the result P^ Q^T is computed here by the
 * same code on every member, so a member that was mid-call and got the
 * others' copy ends with the same bytes. Its error depends on whether its
 * own M' was in the call: it was exactly when it ran an attempt in the
 * epoch that completed it (a member listed in that epoch must have sent
 * its share for the others to finish; the sync runs before any attempt in
 * a later epoch). If it was, E = M' - P^ Q_own^T as usual; if not, E = M',
 * nothing of it having been sent. Either way the warm start becomes the
 * cohort's Q.
 *
 * Membership: a joiner starts with E = 0 and the seeded Q (every member
 * passes the same seed); a leaving member's E leaves with it. A round
 * whose Q is not finite delivers its result but keeps E and the warm
 * start, as the engine's does. Without reuse_query, every call starts
 * from the seeded Q (the same on every member, whatever its history);
 * with it, from the cohort's last Q (warm start). */
#ifndef COHORT_GROUP_POWERSGD_H
#define COHORT_GROUP_POWERSGD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "collective/group.h"
#include "engine/dtype.h"

struct group_powersgd;

struct group_powersgd_matrix {
    size_t rows, cols;          /* a tensor viewed as shape[0] x the rest */
};

/* A reducer of n_mats float32 matrices followed by `vectors` floats sent
 * uncompressed (biases: the reference's rank-1 tensors), all in one call:
 * a member that joins lines up with the others' calls, so an aggregation
 * made of one call cannot be cut in two by a join. Each matrix has rank
 * min(rank, rows, cols). The caller's buffer holds the matrices
 * row-major one after the other, then the vectors. On group g (borrowed:
 * it must outlive the reducer; its calls belong to the group's caller
 * thread); mats is copied. Registers P and Q with the group's engine.
 * Returns 0, -EINVAL (g NULL, no matrix and no vector, a rank of 0 or
 * over POWERSGD_MAX_RANK, a row or column count of 0, sizes over the
 * group's default largest call), -ENOMEM or -ENOSPC. The caller frees
 * *out with group_powersgd_destroy(), before the group. */
int group_powersgd_create(struct group *g, const struct group_powersgd_matrix *mats,
                          size_t n_mats, size_t vectors, size_t rank, uint64_t seed,
                          bool reuse_query, struct group_powersgd **out);
void group_powersgd_destroy(struct group_powersgd *p);  /* NULL is fine */

/* One call: replaces m (the floats the reducer was made for, borrowed for
 * the call) with each matrix's rank-r approximation of the members' sum
 * (DTYPE_SUM) or mean (DTYPE_AVG) of their error-corrected matrices, and
 * the vectors with their exact sum or mean: the same bytes on every
 * member. Returns 0 with E and the warm start updated; or, with m, E and
 * the warm start untouched: group_allreduce's codes (-EPROTO also when
 * the members' shapes, ranks or ops differ), or -EINVAL (m NULL, another
 * op). */
int group_powersgd_reduce(struct group_powersgd *p, float *m, enum dtype_op op,
                          uint32_t timeout_ms);

/* The floats the reducer takes: every matrix, then the vectors. */
size_t group_powersgd_size(const struct group_powersgd *p);

/* This member's error E over those floats (zero for the vectors unless a
 * call completed without this member), read-only, valid until the next
 * reduce or destroy. */
const float *group_powersgd_error(const struct group_powersgd *p);

#endif

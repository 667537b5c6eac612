/* src/collective/group_topk.h: top-k sparsification with error feedback as
 * a group's collective (mlbench's SparsifiedAggregation), applied whole or
 * not at all across membership changes.
 *
 *   group_topk_create(g, n, k, &t);            // one per gradient buffer
 *   group_topk_reduce(t, grads, DTYPE_AVG, 0); // every member, in order
 *   group_topk_destroy(t);
 *
 * Each member sends the k entries of largest |grad + residual| (the
 * engine's selection, topk_select: ties to the lower index, NaN largest)
 * and keeps the rest as its residual; every member ends with the dense sum
 * (or mean) of all members' entries, added member by member in the
 * epoch's order, so every member gets the same bytes.
 *
 * Why not the engine's topk_reduce: it commits its residual inside one
 * engine run, while a group counts a run that a newer epoch touched as
 * failed even when it completed, and hands a member that was mid-call the
 * others' result instead of a new one. So a reduce here is one group
 * gather (group_allgather) of each member's block, and the residual is
 * committed only once that gather returns: a failed call leaves the
 * residual and the caller's gradient as they were. The gather names every
 * record by member id, which settles the delivered case exactly: a member
 * that was mid-call when the others completed it finds its own record in
 * their result (its entries were sent: the residual drops them) or not
 * (the call completed without it: the residual keeps its whole gradient).
 * Either way, over completed calls, sum(sent) + residual = sum(gradients).
 *
 * Membership: a joiner starts with a zero residual. A leaving member's
 * residual leaves with it: what it had not sent is lost to the cohort (at
 * most the unsent mass it carried). A member that rejoins with the same
 * reducer keeps its residual, which stays its own unsent gradient.
 *
 * Wire: a block is a header (u32 n, u32 k) and k pairs (u32 index, f32
 * value), little-endian, indices ascending. Every member checks every
 * record: a different n or k (the members' models differ), an index out
 * of range or out of order fails the call with -EPROTO at every member
 * alike, and changes nothing. */
#ifndef COHORT_GROUP_TOPK_H
#define COHORT_GROUP_TOPK_H

#include <stddef.h>
#include <stdint.h>

#include "collective/group.h"
#include "engine/dtype.h"

struct group_topk;

/* A reducer of n float32 gradients keeping k per call, on group g
 * (borrowed: it must outlive the reducer; its calls belong to the group's
 * caller thread). Allocates the residual (n floats, zero), the selection's
 * counters and a block of 8 + 8k bytes. Returns 0, -EINVAL (g NULL, k of 0,
 * k > n, n > UINT32_MAX) or -ENOMEM (a block over the group's max_bytes
 * fails each reduce with -E2BIG). The caller frees *out with
 * group_topk_destroy(). */
int group_topk_create(struct group *g, size_t n, size_t k, struct group_topk **out);
void group_topk_destroy(struct group_topk *t);  /* NULL is fine */

/* One call: sends the top k of grad + residual, and replaces grad (n
 * floats, borrowed for the call) with the sum over the members of the
 * epoch that completed it of what they sent, divided by their count for
 * DTYPE_AVG. Returns 0 with the residual updated; or, with grad and the
 * residual untouched: group_allgather's codes (a membership change is
 * retried inside), -EINVAL (grad NULL, an op
 * other than DTYPE_SUM or DTYPE_AVG), or -EPROTO (a member's n or k
 * differs, or its block is malformed). */
int group_topk_reduce(struct group_topk *t, float *grad, enum dtype_op op, uint32_t timeout_ms);

/* The residual: n floats, read-only, valid until the next reduce or
 * destroy. */
const float *group_topk_residual(const struct group_topk *t);

/* Members whose records the last completed call summed (0: none yet). */
size_t group_topk_members(const struct group_topk *t);

#endif

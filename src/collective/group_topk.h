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
 * Segments (group_topk_create_segments): the n values may be cut into
 * segments that follow one another (a model's layers), each with its own
 * k_s: a member sends each segment's own top k_s, so a layer of small
 * gradients still sends its share (mlbench's by-layer semantics), and the
 * whole model is still one call that a joiner cannot cut in two. k is the
 * sum of the k_s; one residual spans all segments.
 *
 * Wire: a block is a header (u32 n, u32 k, u64 a hash of the segments'
 * sizes and k_s) and k pairs (u32 index, f32 value), little-endian,
 * indices ascending, segment after segment. Every member checks every
 * record: a different n or k (the members' models differ), a different
 * segment hash (their segments differ), an index out of range or out of
 * order, or a segment whose k_s pairs fall outside it fails the call with
 * -EPROTO at every member alike, and changes nothing. */
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
 * counters and a block of 16 + 8k bytes. Returns 0, -EINVAL (g NULL, k of 0,
 * k > n, n > UINT32_MAX) or -ENOMEM (a block over the group's max_bytes
 * fails each reduce with -E2BIG). The caller frees *out with
 * group_topk_destroy(). */
int group_topk_create(struct group *g, size_t n, size_t k, struct group_topk **out);

/* A reducer of the segments sizes[0..n_segments) laid one after the
 * other (n = their sum), keeping ks[s] of segment s per call. sizes and
 * ks are copied. Returns 0, -EINVAL (g, sizes or ks NULL, no segment, a
 * ks[s] of 0 or over sizes[s], so no empty segment either, n over
 * UINT32_MAX) or -ENOMEM. group_topk_create(g, n, k) is the one segment
 * (n, k). The caller frees *out with group_topk_destroy(). */
int group_topk_create_segments(struct group *g, const size_t *sizes, const size_t *ks,
                               size_t n_segments, struct group_topk **out);
void group_topk_destroy(struct group_topk *t);  /* NULL is fine */

/* One call: sends the top k of grad + residual, and replaces grad (n
 * floats, borrowed for the call) with the sum over the members of the
 * epoch that completed it of what they sent, divided by their count for
 * DTYPE_AVG. Returns 0 with the residual updated; or, with grad and the
 * residual untouched: group_allgather's codes (a membership change is
 * retried inside), -EINVAL (grad NULL, an op
 * other than DTYPE_SUM or DTYPE_AVG), or -EPROTO (a member's n, k or
 * segments differ, or its block is malformed). */
int group_topk_reduce(struct group_topk *t, float *grad, enum dtype_op op, uint32_t timeout_ms);

/* The residual: n floats, read-only, valid until the next reduce or
 * destroy. */
const float *group_topk_residual(const struct group_topk *t);

/* Members whose records the last completed call summed (0: none yet). */
size_t group_topk_members(const struct group_topk *t);

#endif

/* src/engine/topk.h: top-k sparsification with error feedback. Each
 * member sends only the k entries of largest magnitude of its gradient
 * plus what it did not send before (its residual), and every member ends
 * with the same dense sum of all members' entries.
 *
 *   struct topk *t;
 *   topk_create(ar, n, k, &t);                 // one per gradient buffer
 *   for (round = 1;; round++)
 *       rc = topk_reduce(t, grads, DTYPE_AVG, round);   // retry on -ESTALE
 *   topk_destroy(t);
 *
 * Selection, for acc = gradient + residual: the k entries of largest |acc|,
 * ties broken by the lower index, NaN above every number (so a NaN is
 * always sent and shows in the result). The order is total, so every
 * member's choice is reproducible. On the wire each member's block is k
 * pairs (u32 index, f32 value, little-endian), indices ascending; the
 * blocks are all-gathered (allreduce_gather) and every member adds every
 * member's pairs into a zeroed result in the epoch's member order, so all
 * members add the same floats in the same order and get the same bytes.
 *
 * The residual is this member's alone: acc with the sent entries zeroed.
 * It changes only when a round completes; a failed round (an epoch change,
 * a peer lost) leaves it and the caller's gradient as they were, so the
 * retry sends the same thing. A member that joins starts with a zero
 * residual; a member that leaves takes its residual with it: what it had
 * not yet sent is lost to the cohort, at most its last round's unsent
 * gradient mass. Error feedback keeps, over any run of completed rounds,
 * sum(sent) + residual = sum(gradients), exactly when the values are
 * integers small enough for float32 (tests/unit/test_topk.c). */
#ifndef COHORT_TOPK_H
#define COHORT_TOPK_H

#include <stddef.h>
#include <stdint.h>

#include "engine/allreduce.h"
#include "engine/dtype.h"

/* Bytes one member sends per pair. */
#define TOPK_PAIR_BYTES 8u

struct topk;

/* The k entries of largest |x[i]| of n (ties: lower index first; NaN
 * largest), their indices into idx[] in ascending order. Needs
 * 1 <= k <= n <= UINT32_MAX. Returns 0, -EINVAL or -ENOMEM (256 KiB of
 * counters for the call). Reads x, writes idx. */
int topk_select(const float *x, size_t n, size_t k, uint32_t *idx);

/* A reducer of n float32 gradients keeping k of them per round, on engine
 * `ar` (borrowed; it must outlive the reducer, and its runs belong to the
 * thread that calls topk_reduce). Allocates the residual (n floats, zero),
 * the selection's 256 KiB of counters, the pair block and the gather
 * buffer (one block per member of the current epoch; topk_reduce grows it
 * with the epoch), and registers the latter two with ar. Returns 0, -EINVAL (k of 0, k > n, n > UINT32_MAX), -ENOMEM, or
 * -ENOSPC (the engine's registrations are full). The caller frees *out
 * with topk_destroy(). */
int topk_create(struct allreduce *ar, size_t n, size_t k, struct topk **out);
void topk_destroy(struct topk *t);      /* NULL is fine */

/* One round: sends the top k of grad + residual and replaces grad (n
 * floats, borrowed for the call) with the sum over the members of what
 * they sent, divided by the member count for DTYPE_AVG. Every member
 * calls with the same round and op. Returns 0 with the residual updated;
 * or, with grad and the residual untouched, allreduce_gather's codes
 * (-ESTALE when the epoch changed: retry), -EINVAL for an op other than
 * DTYPE_SUM or DTYPE_AVG, -ENOMEM (the gather buffer could not grow to
 * the epoch's member count), or -EPROTO when a member's block names an
 * index outside the gradient (a lying peer changes nothing here). */
int topk_reduce(struct topk *t, float *grad, enum dtype_op op, uint64_t round);

/* topk_reduce in two halves, for a caller whose round can still fail
 * after the exchange (the node: a later step of its round, then its
 * commit). topk_reduce_into writes the sum (or mean) into `out` (n floats,
 * not `in`) and leaves `in` and the residual untouched; topk_commit(t, in)
 * then folds the round into the residual, given the very `in` of the last
 * successful topk_reduce_into. A reduce that is never committed is
 * forgotten by the next topk_reduce_into, so the retry sends the same
 * thing. topk_commit after anything but a successful topk_reduce_into
 * does nothing. Same returns as topk_reduce, and -EINVAL for in == out. */
int topk_reduce_into(struct topk *t, const float *in, float *out, enum dtype_op op, uint64_t round);
void topk_commit(struct topk *t, const float *in);

/* Zeroes the residual and forgets an uncommitted round: what this member
 * had not sent is dropped (its model was replaced, so it belongs to
 * gradients of parameters that are gone). */
void topk_reset(struct topk *t);

/* This member's residual: n floats, read-only, valid until the next
 * topk_reduce or topk_destroy. */
const float *topk_residual(const struct topk *t);

/* k for a ratio of n: ceil(ratio x n), at least 1 and at most n. Returns
 * 0, or -EINVAL for n of 0 or a ratio not in (0, 1]. */
int topk_k_for_ratio(size_t n, double ratio, size_t *k);

#endif

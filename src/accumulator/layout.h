/* src/accumulator/layout.h: the layout of a trainer's gradient buffer as
 * tensors, and PowerSGD over it tensor by tensor.
 *
 * The trainer names its gradients' tensors (cohort_set_tensor_shapes,
 * the Python Accumulator from its model's parameters): each an offset and
 * a count of elements into the float32 gradient buffer, viewed as a rows
 * x cols matrix (a tensor's shape[0] x the rest, as mlbench's
 * PowerAggregation does). A matrix with rows and cols both above 1 is
 * reduced as a rank-r product (engine/powersgd.h); a tensor with one
 * row or one column (a bias, a norm's scale), and any element no tensor
 * covers, is reduced uncompressed.
 *
 *   struct layout *l;
 *   layout_make(shapes, k, grad_count, &l);                   // checked
 *   layout_psgd_create(ar, l, rank, seed, &p);                 // on the node thread
 *   layout_psgd_reduce_into(p, grads, results, DTYPE_SUM, round); // rounds round, round + 1
 *   layout_psgd_commit(p);                                     // with the node's round
 *
 * One call is two all-reduces, whatever the number of tensors: every
 * matrix's P is laid end to end in one registered buffer, and every Q
 * in another, followed by the uncompressed elements, which ride with the
 * Qs under the same op (the same batching as collective/group_powersgd.c).
 * Per matrix the round is powersgd.h's: M' = M + E, P = M'Q, P summed,
 * orthonormalised, Q = M'^T P^, Q summed, result P^ Q^T, and at the
 * commit E = M' - P^ Q_own^T and the summed Q as the next warm start.
 * The matrices are one engine/powersgd.h block (struct powersgd_block,
 * as in collective/group_powersgd.c), whose kernels give every member
 * the same bytes.
 *
 * Members must run the same layout: the node votes on layout_hash in its
 * count step (node.c, "Compression") and runs uncompressed when they
 * differ. */
#ifndef COHORT_LAYOUT_H
#define COHORT_LAYOUT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/allreduce.h"
#include "engine/dtype.h"

/* The most tensors a layout may name (a large transformer has a few
 * thousand parameter tensors). */
#define LAYOUT_SHAPES_MAX 65536u

/* One tensor, in elements of the gradient buffer; the wire form too
 * (the trainer link sends these, four u64 each, in a memfd). */
struct layout_shape {
    uint64_t offset, count;
    uint64_t rows, cols;        /* rows x cols == count */
};

struct layout;

/* Checks `k` shapes (borrowed; any order) against a gradient buffer of
 * `grad_count` elements and builds the layout they give. k = 0 gives
 * NULL in *out: no layout, the whole-buffer view. Returns 0, -EINVAL
 * (k above LAYOUT_SHAPES_MAX, a count of 0, rows x cols not the count,
 * a tensor beyond the buffer, two that overlap), or -ENOMEM; *out is
 * written only on success. The caller frees *out with layout_free(). */
int layout_make(const struct layout_shape *s, size_t k, size_t grad_count, struct layout **out);
void layout_free(struct layout *l);     /* NULL is fine */

/* What members must agree on: the buffer's size and every matrix's
 * offset and shape (the uncompressed elements are the rest), hashed
 * (FNV-1a, 64 bits). 0 only for NULL (no layout). */
uint64_t layout_hash(const struct layout *l);

/* Matrices compressed, and elements sent uncompressed. */
size_t layout_matrices(const struct layout *l);
size_t layout_plain(const struct layout *l);

struct layout_psgd;

/* A reducer for layout `l` (copied: the layout may be freed after) at
 * rank `rank` (each matrix at min(rank, rows, cols)), on engine `ar`
 * (borrowed; outlives the reducer; its runs belong to the calling
 * thread), registering two buffers with it. `seed` picks the first Qs:
 * every member must give the same. Returns 0, -EINVAL (rank 0 or above
 * POWERSGD_MAX_RANK, sizes that overflow), -ENOMEM, or -ENOSPC (the
 * engine's registrations are full). Free *out with layout_psgd_destroy(). */
int layout_psgd_create(struct allreduce *ar, const struct layout *l, size_t rank, uint64_t seed,
                       struct layout_psgd **out);
void layout_psgd_destroy(struct layout_psgd *p);  /* NULL is fine */

/* One call, rounds `round` and `round + 1`: writes into `out` (the
 * buffer's grad_count floats; must not overlap `in`) every matrix's
 * rank-r approximation of the members' sum (DTYPE_SUM) or mean
 * (DTYPE_AVG) of their error-corrected gradients, and the uncompressed
 * elements' exact reduction; the same bytes on every member. The error
 * and the warm start are kept only by layout_psgd_commit. Returns 0,
 * allreduce_run's codes (-ESTALE: retry; nothing kept), or -EINVAL (an
 * op other than SUM or AVG). */
int layout_psgd_reduce_into(struct layout_psgd *p, const float *in, float *out, enum dtype_op op,
                            uint64_t round);
/* Keeps the error and the warm start of the last successful
 * reduce_into; nothing after anything else. A round whose summed Qs hold
 * a NaN or Inf keeps neither (powersgd.h: the step is dropped). */
void layout_psgd_commit(struct layout_psgd *p);
/* Zero error, the seeded Qs, no pending round: as a new member. */
void layout_psgd_reset(struct layout_psgd *p);
/* This member's error over the whole buffer (0 for the uncompressed
 * elements), read-only, valid until the next call. */
const float *layout_psgd_error(const struct layout_psgd *p);

#endif

/* src/engine/powersgd.h: PowerSGD (Vogels et al., 2019) with error
 * feedback: a float32 matrix gradient is reduced as a rank-r product,
 * through two small all-reduces instead of one of the whole matrix.
 *
 *   struct powersgd *p;
 *   powersgd_create(ar, rows, cols, rank, seed, &p);   // one per matrix
 *   for (round = 1;; round += POWERSGD_ROUNDS)
 *       rc = powersgd_reduce(p, grad, DTYPE_AVG, round); // retry on -ESTALE
 *   powersgd_destroy(p);
 *
 * One round, for this member's gradient M (rows x cols, row-major: a
 * tensor viewed as shape[0] x the rest) and its error E:
 *   M' = M + E
 *   P  = M' Q            Q: the previous round's (warm start), or on the
 *                        first round a seeded pseudo-random one
 *   P  = sum of P        all-reduce, round `round`
 *   P^ = P's columns orthonormalised (Gram-Schmidt, column by column)
 *   Q  = M'^T P^
 *   Q_own = Q            this member's share, before the next step
 *   Q  = sum (or mean) of Q   all-reduce, round `round + 1`
 *   M  = P^ Q^T          the result, on every member
 *   E  = M' - P^ Q_own^T what this member's share left out, kept for
 *                        the next round
 * So a member sends (rows + cols) x r floats, twice over the ring, rather
 * than rows x cols. The result is P^ P^T applied to the sum (or mean) of
 * the members' M': exact when that has rank <= r and the random start
 * spans it. One-dimensional tensors (biases) are not for this: reduce
 * them uncompressed.
 *
 * Every member ends with the same bytes: P^ and the result are computed
 * from the all-reduced P and Q by the same code in the same order of
 * operations (powersgd.c, "KERNELS"). E, the reduced Q (the next warm
 * start) and the caller's matrix change only when both all-reduces
 * completed: a failed round leaves them as they were, so the retry sends
 * the same thing. A joining member starts with E = 0 and the seeded Q;
 * its first round still ends with the cohort's Q, since Q is all-reduced.
 * A leaving member's E leaves with it.
 *
 * A NaN or Inf in any member's M' reaches every member's reduced Q. Such
 * a round still delivers its result, non-finite values and all (so an AMP
 * grad scaler sees them and skips the step), but keeps every member's E
 * and the warm start as they were: the step is dropped, not folded into
 * the error, which would otherwise stay NaN for good. */
#ifndef COHORT_POWERSGD_H
#define COHORT_POWERSGD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/allreduce.h"
#include "engine/dtype.h"

/* The all-reduce rounds one powersgd_reduce uses: round, round + 1. */
#define POWERSGD_ROUNDS 2u
/* Largest rank accepted (the paper's experiments use 1 to 4; 32 x 64 Ki
 * columns is already 8 MiB of Q). */
#define POWERSGD_MAX_RANK 1024u

struct powersgd;

/* A reducer of a rows x cols float32 matrix with rank min(rank, rows,
 * cols), on engine `ar` (borrowed; it must outlive the reducer, and its
 * runs belong to the thread that calls powersgd_reduce). `seed` picks the
 * first Q: every member must give the same one. Allocates 2 x rows x cols
 * floats (E and M') and the factors, and registers P and Q with ar.
 * Returns 0, -EINVAL (a rank of 0 or above POWERSGD_MAX_RANK, rows or
 * cols of 0, a size that overflows), -ENOMEM, or -ENOSPC (the engine's
 * registrations are full). The caller frees *out with powersgd_destroy(). */
int powersgd_create(struct allreduce *ar, size_t rows, size_t cols, size_t rank, uint64_t seed,
                    struct powersgd **out);
void powersgd_destroy(struct powersgd *p);      /* NULL is fine */

/* One round: replaces m (rows x cols floats, borrowed for the call) with
 * the rank-r approximation of the members' sum (DTYPE_SUM) or mean
 * (DTYPE_AVG) of their error-corrected gradients, identical on every
 * member, and keeps this member's new error. Every member calls with the
 * same round and op; the call uses rounds `round` and `round + 1`.
 * Returns 0; or, with m, the error and the warm start untouched,
 * allreduce_run's codes (-ESTALE when the epoch changed: retry), or
 * -EINVAL for another op. */
int powersgd_reduce(struct powersgd *p, float *m, enum dtype_op op, uint64_t round);

/* powersgd_reduce in two halves, for a caller whose round can still fail
 * after the reduction (the node: a later step of its round, then its
 * commit). powersgd_reduce_into writes the result into `out` (rows x cols;
 * may be `in`) and leaves the error and the warm start as they were;
 * powersgd_commit then keeps this member's new error and the reduced Q as
 * the next warm start, from what the last successful reduce_into left
 * (the reducer keeps M' and the factors until the next reduce). A reduce
 * that is never committed is forgotten by the next one, so the retry sends
 * the same thing; powersgd_commit after anything else does nothing. Same
 * returns as powersgd_reduce. */
int powersgd_reduce_into(struct powersgd *p, const float *in, float *out, enum dtype_op op,
                         uint64_t round);
void powersgd_commit(struct powersgd *p);

/* Zeroes the error, puts back the seeded Q and forgets an uncommitted
 * round: as a member that just joined (its model was replaced). */
void powersgd_reset(struct powersgd *p);

/* The effective rank: min(rank, rows, cols). */
size_t powersgd_rank(const struct powersgd *p);

/* This member's error E, rows x cols, read-only, valid until the next
 * powersgd_reduce or powersgd_destroy. */
const float *powersgd_error(const struct powersgd *p);

/* A block: several matrices in one float32 buffer, each with its P, Q,
 * warm start and error, for a caller that batches every matrix's P into
 * one all-reduce and every Q into a second (accumulator/layout.c by
 * tensor shape, collective/group_powersgd.c over a group; the reducer
 * above is a block of one). The block holds the state and runs the
 * kernels in the one order that gives every member the same bytes; the
 * caller registers b->p and b->q with its engine, runs the all-reduces
 * and decides when a round is kept. Per matrix, a round is:
 *
 *   powersgd_block_load(b, in)          M' = M + E
 *   powersgd_block_mul_p(b, qs)         P = M'Q, Q the warm (or seeded) start
 *   (P summed over the members)
 *   powersgd_block_mul_qt(b)            P^ = orthonormalised P; Q = M'^T P^
 *   (Q summed, or averaged)
 *   powersgd_block_out(b, out, p, q)    out = P^ Q^T
 *   powersgd_block_error(b, p, q_own)   kept: E = M' - P^ Q_own^T
 *   powersgd_block_warm(b, q)           kept: the next warm start
 *
 * Q_own (b->q_own) is this member's Q before the sum: a copy of b->q
 * taken by the caller before its all-reduce, or powersgd_block_own_q()
 * from P^ afterwards. The caller reads the fields, and writes only
 * b->p and b->q through its all-reduces (and their one float when the
 * block has no matrix), b->q's floats after the Qs, b->q_own as above,
 * and E and M' outside the matrices' cells; the rest changes only
 * through these functions. */
struct powersgd_shape {
    size_t at, rows, cols;      /* first float in the block's buffer; rows x cols */
};

struct powersgd_block {
    struct powersgd_block_mat {
        size_t at, rows, cols, r;   /* r = min(rank, rows, cols) */
        size_t p_at, q_at;          /* first float in P and in Q */
    } *mats;
    size_t n_mats;
    size_t cells;               /* the buffer's floats: matrices, and anything between */
    size_t np, nq;              /* P: every matrix's rows x r; Q: its r x cols */
    size_t q_extra;             /* floats b->q has after the Qs, for the caller */
    size_t p_len, q_len;        /* the floats of b->p and b->q: max(np, 1), max(nq + q_extra, 1) */
    float *err, *mp;            /* cells each: E and M' (only the matrices' cells used) */
    float *q_seed, *q_warm, *q_own;     /* nq each: every matrix's Q transposed */
    float *p, *q;               /* p_len and q_len floats, 64-byte aligned */
};

/* Sets up *b for n matrices (shapes copied) at rank min(rank, rows,
 * cols) each, in a buffer of `cells` floats, with q_extra floats after
 * the Qs in b->q (a caller's uncompressed elements, reduced with the
 * Qs). The matrices must lie in the buffer in ascending order without
 * overlapping, so that P and Q are each at most `cells` floats. `seed`
 * picks the first Qs, the same on every member that passes it. Returns
 * 0, -EINVAL (a rank of 0 or above POWERSGD_MAX_RANK, a row or column
 * count of 0, a matrix outside the buffer or before the previous one,
 * sizes that overflow), or -ENOMEM; on failure *b holds nothing. The
 * caller owns *b and frees what it holds with powersgd_block_cleanup(). */
int powersgd_block_init(struct powersgd_block *b, const struct powersgd_shape *shapes, size_t n,
                        size_t rank, size_t cells, size_t q_extra, uint64_t seed);
void powersgd_block_cleanup(struct powersgd_block *b);     /* a zeroed *b is fine */

/* Registers all of b->p and b->q with engine `ar` (borrowed), their
 * handles in *hp and *hq, or neither: returns 0 or allreduce_register's
 * codes. powersgd_block_unregister() undoes it, skipping a handle below
 * 0, and sets both to -1. */
int powersgd_block_register(struct powersgd_block *b, struct allreduce *ar, int *hp, int *hq);
void powersgd_block_unregister(struct allreduce *ar, int *hp, int *hq);

/* M' = in + E over every matrix's cells (in: cells floats, borrowed). */
void powersgd_block_load(struct powersgd_block *b, const float *in);
/* b->p = M' qs^T per matrix, qs (nq floats) b->q_warm or b->q_seed. */
void powersgd_block_mul_p(struct powersgd_block *b, const float *qs);
/* Orthonormalises each matrix's columns of b->p (summed) in place, then
 * b->q = (M'^T P^)^T per matrix. */
void powersgd_block_mul_qt(struct powersgd_block *b);
/* out = p q per matrix (out: cells floats; p and q laid out as b->p and
 * b->q, the reduced ones, any copy of them); out's other floats are left
 * as they are. */
void powersgd_block_out(const struct powersgd_block *b, float *out, const float *p,
                        const float *q);
/* b->q_own = (M'^T p)^T per matrix, p laid out as b->p (orthonormalised). */
void powersgd_block_own_q(struct powersgd_block *b, const float *p);
/* E = M' - p q_own per matrix: this member's error for the next round. */
void powersgd_block_error(struct powersgd_block *b, const float *p, const float *q_own);
/* The warm start becomes q's nq floats (the reduced Qs). */
void powersgd_block_warm(struct powersgd_block *b, const float *q);
/* E = 0 and the seeded Qs: as a member that just joined. */
void powersgd_block_reset(struct powersgd_block *b);

/* The kernels, each with its order of operations written in powersgd.c,
 * so that every caller computes the same bytes from the same inputs
 * (the block above runs them).
 * Matrices are row-major float32; qt is Q transposed (r x cols). None
 * allocates; outputs must not overlap inputs. */
/* p (rows x r) = a (rows x cols) qt^T. */
void powersgd_mul_p(float *restrict p, const float *restrict a, const float *restrict qt,
                    size_t rows, size_t cols, size_t r);
/* qt (r x cols) = (a^T p)^T, p rows x r. */
void powersgd_mul_qt(float *restrict qt, const float *restrict a, const float *restrict p,
                     size_t rows, size_t cols, size_t r);
/* out (rows x cols) = p qt, or from - p qt when `from` is not NULL. */
void powersgd_mul_out(float *restrict out, const float *restrict p, const float *restrict qt,
                      const float *restrict from, size_t rows, size_t cols, size_t r);
/* Gram-Schmidt on the r columns of p (rows x r), in place. */
void powersgd_orthonormalise(float *p, size_t rows, size_t r);
/* False when any of x[0..n) is NaN or Inf. */
bool powersgd_all_finite(const float *x, size_t n);
/* The seeded Q: n values uniform in [-1, 1) from splitmix64(seed), the
 * same on every member that passes the same seed. */
void powersgd_seed_q(float *q, size_t n, uint64_t seed);

#endif

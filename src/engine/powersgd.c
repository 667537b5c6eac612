/* src/engine/powersgd.c: see powersgd.h.
 *
 * KERNELS
 *
 * The matrix products and the Gram-Schmidt are plain loops here, not a
 * BLAS call. What decides it is agreement: P^ and the result must
 * be the same bytes on every member, whatever its CPU, and a BLAS picks
 * its blocking and its instructions (FMA or not) per CPU at run time, so
 * two members could round differently. Here every output element is a
 * sum in one order written in the source (noted at each kernel) of
 * products rounded on their own (-ffp-contract=off for the whole build),
 * which every x86-64 and arm64 CPU computes alike, vectorised or not: the
 * compiler may only vectorise across independent outputs or the explicit
 * lanes of dot(). Q is kept transposed (r x cols), so every inner loop
 * runs along a row of M', of Q^T or of the output, contiguous, and each
 * product streams the matrix once; the error is finished row by row while
 * the row is in cache. Measured on the shared 2-core development VM
 * (`cohortctl bench allreduce --peers 1 --bytes 64M --codec powersgd`, a
 * 4096 x 4096 view, rank 4, gcc 12 -O2, medians of 5 back to back): 555 ms
 * a round with Q untransposed (inner loops over the rank, 4 long) and a
 * separate error pass, 350 ms with these.
 *
 * Against OpenBLAS 0.3.21 (Debian's libopenblas-dev, one thread, cblas_sgemm
 * on the same operands, the thread's CPU time, best of 5, AVX2 and FMA on
 * the VM): M'Q 19-20 ms here against 13, M'^T P^ 11-16 against 7.5, P^ Q^T
 * 40-52 against 16, and never the same bytes (it fuses multiplies and adds
 * and blocks the sums its own way, per CPU). Only P^ Q^T must be the same
 * bytes on every member; M'Q and M'^T P^ are this member's own and are
 * summed by the all-reduce, so a BLAS could take those two. That would
 * save about 15 ms of a 350 ms round (the rest is passes over memory: M',
 * the result, the error), not worth a library in every image; P^ Q^T
 * stays here in any case.
 *
 * Orthonormalisation is the mlbench / paper reference's: each column in
 * turn is divided by its norm plus 1e-8 (a zero column stays zero rather
 * than dividing by zero), then its projection is taken off every later
 * column. The reference's eps (1e-8) is kept so results compare.
 *
 * ERROR FEEDBACK
 *
 * Each member keeps what its own contribution lost: E = M' - P^ Q_own^T,
 * with Q_own = M'^T P^ before the all-reduce. The compression is linear
 * once P^ is shared, so the members' shares P^ Q_own^T add up to the
 * result (sum), and sum(results) + sum(E) = sum(gradients) over any run
 * of rounds, for the sum and, times the member count, for the mean: the
 * same bookkeeping as top-k, and the paper's "memorize local errors"
 * (Vogels et al., Algorithm 2). The mlbench and epfml code instead keep
 * M' - (the mean's approximation), which holds each member's deviation
 * from the mean as error too and does not balance for a sum; the cost
 * here is one more rows x cols x r product per round and a cols x r copy. */
#include "engine/powersgd.h"

#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#define ORTHO_EPS 1e-8f

struct powersgd {
    struct allreduce *ar;       /* borrowed */
    struct powersgd_block b;    /* one matrix; b.p and b.q registered */
    int hp, hq;
    bool pending;               /* powersgd_reduce_into succeeded, not committed */
};

/* splitmix64: the first Q from the seed alone, the same on every member. */
static uint64_t splitmix(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);

    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Uniform in [-1, 1), exactly representable: 24 random bits. */
static float uniform(uint64_t *s)
{
    return (float)(splitmix(s) >> 40) * (1.0f / 8388608.0f) - 1.0f;
}

void powersgd_seed_q(float *q, size_t n, uint64_t seed)
{
    for (size_t i = 0; i < n; i++)
        q[i] = uniform(&seed);
}

/* The lanes of a dot product: lane l sums the products j = l (mod LANES)
 * in ascending j, and the lanes are added in a fixed tree. The order is
 * written out, so it is the same whether the compiler vectorises the
 * lanes or not; summing in plain j order would forbid vectorising. */
#define LANES 16

static float dot(const float *restrict a, const float *restrict b, size_t n)
{
    float acc[LANES] = { 0 };
    size_t j = 0;

    for (; j + LANES <= n; j += LANES)
        for (size_t l = 0; l < LANES; l++)
            acc[l] += a[j + l] * b[j + l];
    for (size_t l = 0; j + l < n; l++)
        acc[l] += a[j + l] * b[j + l];
    for (size_t w = LANES / 2; w > 0; w /= 2)
        for (size_t l = 0; l < w; l++)
            acc[l] += acc[l + w];
    return acc[0];
}

/* p (rows x r) = a (rows x cols) qt^T, qt being Q transposed (r x cols):
 * each element a dot() of a row of a with a row of qt. */
void powersgd_mul_p(float *restrict p, const float *restrict a, const float *restrict qt,
                  size_t rows, size_t cols, size_t r)
{
    for (size_t i = 0; i < rows; i++)
        for (size_t c = 0; c < r; c++)
            p[i * r + c] = dot(a + i * cols, qt + c * cols, cols);
}

/* qt (r x cols) = (a^T p)^T, a rows x cols, p rows x r: each element a
 * sum over i ascending, the loop along a's rows (vectorised across j). */
void powersgd_mul_qt(float *restrict qt, const float *restrict a, const float *restrict p,
                   size_t rows, size_t cols, size_t r)
{
    memset(qt, 0, r * cols * sizeof(float));
    for (size_t i = 0; i < rows; i++) {
        const float *ai = a + i * cols;

        for (size_t c = 0; c < r; c++) {
            float x = p[i * r + c];
            float *o = qt + c * cols;

            for (size_t j = 0; j < cols; j++)
                o[j] += ai[j] * x;
        }
    }
}

/* out (rows x cols) = p qt (p rows x r, qt r x cols): each element a sum
 * over c ascending, vectorised across j. With `from`, out = from - p qt,
 * each row finished while it is in cache. */
void powersgd_mul_out(float *restrict out, const float *restrict p, const float *restrict qt,
                    const float *restrict from, size_t rows, size_t cols, size_t r)
{
    for (size_t i = 0; i < rows; i++) {
        float *o = out + i * cols;

        memset(o, 0, cols * sizeof(float));
        for (size_t c = 0; c < r; c++) {
            float x = p[i * r + c];
            const float *q = qt + c * cols;

            for (size_t j = 0; j < cols; j++)
                o[j] += x * q[j];
        }
        for (size_t j = 0; from && j < cols; j++)
            o[j] = from[i * cols + j] - o[j];
    }
}

/* Gram-Schmidt on the r columns of p (rows x r), in place; sums over rows ascending. */
void powersgd_orthonormalise(float *p, size_t rows, size_t r)
{
    for (size_t c = 0; c < r; c++) {
        float ss = 0, norm;

        for (size_t i = 0; i < rows; i++)
            ss += p[i * r + c] * p[i * r + c];
        norm = sqrtf(ss) + ORTHO_EPS;
        for (size_t i = 0; i < rows; i++)
            p[i * r + c] = p[i * r + c] / norm;
        for (size_t d = c + 1; d < r; d++) {
            float dot = 0;

            for (size_t i = 0; i < rows; i++)
                dot += p[i * r + c] * p[i * r + d];
            for (size_t i = 0; i < rows; i++)
                p[i * r + d] -= dot * p[i * r + c];
        }
    }
}

/* A NaN or Inf anywhere in a member's M' spreads through the reduced P
 * into every member's Q, so this is the same answer on every member. */
bool powersgd_all_finite(const float *x, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (!isfinite(x[i]))
            return false;
    return true;
}

/* ---- a block of matrices ---- */

int powersgd_block_init(struct powersgd_block *b, const struct powersgd_shape *shapes, size_t n,
                        size_t rank, size_t cells, size_t q_extra, uint64_t seed)
{
    size_t end = 0, nq_all, nq1;

    memset(b, 0, sizeof(*b));
    /* E and M' share one allocation, and so do the three kept Qs. */
    if ((n && !shapes) || rank == 0 || rank > POWERSGD_MAX_RANK ||
        cells > SIZE_MAX / (3 * sizeof(float)) || n > SIZE_MAX / sizeof(*b->mats))
        return -EINVAL;
    for (size_t k = 0; k < n; k++) {
        const struct powersgd_shape *s = &shapes[k];

        if (s->rows == 0 || s->cols == 0 || s->rows > cells / s->cols || s->at < end ||
            s->at > cells - s->rows * s->cols)
            return -EINVAL;
        end = s->at + s->rows * s->cols;
    }
    if (q_extra > SIZE_MAX / sizeof(float) - cells)
        return -EINVAL;
    b->mats = calloc(n ? n : 1, sizeof(*b->mats));
    if (!b->mats)
        return -ENOMEM;
    b->n_mats = n;
    b->cells = cells;
    b->q_extra = q_extra;
    for (size_t k = 0; k < n; k++) {
        struct powersgd_block_mat *x = &b->mats[k];

        x->at = shapes[k].at;
        x->rows = shapes[k].rows;
        x->cols = shapes[k].cols;
        x->r = rank < x->rows ? rank : x->rows;
        x->r = x->r < x->cols ? x->r : x->cols;
        /* Ascending and disjoint: each sum stays within cells. */
        x->p_at = b->np;
        x->q_at = b->nq;
        b->np += x->rows * x->r;
        b->nq += x->cols * x->r;
    }
    nq_all = b->nq + q_extra;
    nq1 = b->nq ? b->nq : 1;
    b->p_len = b->np ? b->np : 1;
    b->q_len = nq_all ? nq_all : 1;
    b->err = calloc(2 * (cells ? cells : 1), sizeof(float));
    b->q_seed = malloc(3 * nq1 * sizeof(float));
    if (!b->err || !b->q_seed ||
        posix_memalign((void **)&b->p, 64, b->p_len * sizeof(float)) ||
        posix_memalign((void **)&b->q, 64, b->q_len * sizeof(float))) {
        powersgd_block_cleanup(b);
        return -ENOMEM;
    }
    b->mp = b->err + (cells ? cells : 1);
    b->q_warm = b->q_seed + nq1;
    b->q_own = b->q_warm + nq1;
    powersgd_seed_q(b->q_seed, b->nq, seed);
    memcpy(b->q_warm, b->q_seed, b->nq * sizeof(float));
    return 0;
}

void powersgd_block_cleanup(struct powersgd_block *b)
{
    free(b->q);
    free(b->p);
    free(b->q_seed);            /* with q_warm and q_own */
    free(b->err);               /* with mp */
    free(b->mats);
    memset(b, 0, sizeof(*b));
}

int powersgd_block_register(struct powersgd_block *b, struct allreduce *ar, int *hp, int *hq)
{
    int rc = allreduce_register(ar, b->p, b->p_len * sizeof(float));

    *hp = *hq = -1;
    if (rc < 0)
        return rc;
    *hp = rc;
    rc = allreduce_register(ar, b->q, b->q_len * sizeof(float));
    if (rc < 0) {
        powersgd_block_unregister(ar, hp, hq);
        return rc;
    }
    *hq = rc;
    return 0;
}

void powersgd_block_unregister(struct allreduce *ar, int *hp, int *hq)
{
    if (*hq >= 0)
        allreduce_unregister(ar, *hq);
    if (*hp >= 0)
        allreduce_unregister(ar, *hp);
    *hp = *hq = -1;
}

void powersgd_block_load(struct powersgd_block *b, const float *in)
{
    for (size_t k = 0; k < b->n_mats; k++) {
        const struct powersgd_block_mat *x = &b->mats[k];
        float *mp = b->mp + x->at;
        const float *m = in + x->at, *e = b->err + x->at;

        for (size_t i = 0; i < x->rows * x->cols; i++)
            mp[i] = m[i] + e[i];
    }
}

void powersgd_block_mul_p(struct powersgd_block *b, const float *qs)
{
    for (size_t k = 0; k < b->n_mats; k++) {
        const struct powersgd_block_mat *x = &b->mats[k];

        powersgd_mul_p(b->p + x->p_at, b->mp + x->at, qs + x->q_at, x->rows, x->cols, x->r);
    }
}

void powersgd_block_mul_qt(struct powersgd_block *b)
{
    for (size_t k = 0; k < b->n_mats; k++) {
        const struct powersgd_block_mat *x = &b->mats[k];

        powersgd_orthonormalise(b->p + x->p_at, x->rows, x->r);
        powersgd_mul_qt(b->q + x->q_at, b->mp + x->at, b->p + x->p_at, x->rows, x->cols, x->r);
    }
}

void powersgd_block_out(const struct powersgd_block *b, float *out, const float *p,
                        const float *q)
{
    for (size_t k = 0; k < b->n_mats; k++) {
        const struct powersgd_block_mat *x = &b->mats[k];

        powersgd_mul_out(out + x->at, p + x->p_at, q + x->q_at, NULL, x->rows, x->cols, x->r);
    }
}

void powersgd_block_own_q(struct powersgd_block *b, const float *p)
{
    for (size_t k = 0; k < b->n_mats; k++) {
        const struct powersgd_block_mat *x = &b->mats[k];

        powersgd_mul_qt(b->q_own + x->q_at, b->mp + x->at, p + x->p_at, x->rows, x->cols, x->r);
    }
}

void powersgd_block_error(struct powersgd_block *b, const float *p, const float *q_own)
{
    for (size_t k = 0; k < b->n_mats; k++) {
        const struct powersgd_block_mat *x = &b->mats[k];

        powersgd_mul_out(b->err + x->at, p + x->p_at, q_own + x->q_at, b->mp + x->at, x->rows,
                         x->cols, x->r);
    }
}

void powersgd_block_warm(struct powersgd_block *b, const float *q)
{
    memcpy(b->q_warm, q, b->nq * sizeof(float));
}

void powersgd_block_reset(struct powersgd_block *b)
{
    memset(b->err, 0, b->cells * sizeof(float));
    memcpy(b->q_warm, b->q_seed, b->nq * sizeof(float));
}

/* ---- one matrix on an engine: a block of one ---- */

int powersgd_create(struct allreduce *ar, size_t rows, size_t cols, size_t rank, uint64_t seed,
                    struct powersgd **out)
{
    struct powersgd_shape one = { 0, rows, cols };
    struct powersgd *p;
    int rc;

    if (!ar || !out || rows == 0 || cols == 0 || rows > SIZE_MAX / sizeof(float) / cols)
        return -EINVAL;
    p = calloc(1, sizeof(*p));
    if (!p)
        return -ENOMEM;
    p->ar = ar;
    p->hp = p->hq = -1;
    rc = powersgd_block_init(&p->b, &one, 1, rank, rows * cols, 0, seed);
    if (rc < 0)
        goto fail;
    rc = powersgd_block_register(&p->b, ar, &p->hp, &p->hq);
    if (rc < 0)
        goto fail;
    *out = p;
    return 0;
fail:
    powersgd_destroy(p);
    return rc;
}

void powersgd_destroy(struct powersgd *p)
{
    if (!p)
        return;
    powersgd_block_unregister(p->ar, &p->hp, &p->hq);
    powersgd_block_cleanup(&p->b);
    free(p);
}

size_t powersgd_rank(const struct powersgd *p)
{
    return p->b.mats[0].r;
}

const float *powersgd_error(const struct powersgd *p)
{
    return p->b.err;
}

int powersgd_reduce_into(struct powersgd *p, const float *in, float *out, enum dtype_op op,
                         uint64_t round)
{
    struct powersgd_block *b = &p->b;
    int rc;

    if (!in || !out || (op != DTYPE_SUM && op != DTYPE_AVG))
        return -EINVAL;
    p->pending = false;
    powersgd_block_load(b, in);
    powersgd_block_mul_p(b, b->q_warm);
    /* P is only a basis: its scale goes in the orthonormalisation, so a
     * sum does (mlbench never divides it either). */
    rc = allreduce_run(p->ar, p->hp, b->np, DTYPE_F32, DTYPE_SUM, 0, round);
    if (rc < 0)
        return rc;
    powersgd_block_mul_qt(b);
    memcpy(b->q_own, b->q, b->nq * sizeof(float));
    rc = allreduce_run(p->ar, p->hq, b->nq, DTYPE_F32, op, 0, round + 1);
    if (rc < 0)
        return rc;
    /* The result, the same bytes on every member. M', P^, Q_own and the
     * reduced Q stay as they are until the next reduce, which is all the
     * commit needs. */
    powersgd_block_out(b, out, b->p, b->q);
    p->pending = true;
    return 0;
}

void powersgd_commit(struct powersgd *p)
{
    if (!p->pending)
        return;
    p->pending = false;
    /* This member's error (what its own share P^ Q_own^T left out) and
     * the warm start; a non-finite round keeps both (powersgd.h). */
    if (!powersgd_all_finite(p->b.q, p->b.nq))
        return;
    powersgd_block_error(&p->b, p->b.p, p->b.q_own);
    powersgd_block_warm(&p->b, p->b.q);
}

void powersgd_reset(struct powersgd *p)
{
    powersgd_block_reset(&p->b);
    p->pending = false;
}

int powersgd_reduce(struct powersgd *p, float *m, enum dtype_op op, uint64_t round)
{
    int rc = powersgd_reduce_into(p, m, m, op, round);

    if (rc == 0)
        powersgd_commit(p);
    return rc;
}

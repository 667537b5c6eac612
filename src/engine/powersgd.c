/* src/engine/powersgd.c: see powersgd.h.
 *
 * KERNELS
 *
 * The three matrix products and the Gram-Schmidt are plain loops here,
 * not a BLAS call. What decides it is agreement: P^ and the result must
 * be the same bytes on every member, whatever its CPU, and a BLAS picks
 * its blocking and its instructions (FMA or not) per CPU at run time, so
 * two members could round differently. Here every output element is a
 * sum in one fixed order (the index noted at each kernel, ascending) of
 * products rounded on their own (-ffp-contract=off for the whole build),
 * which every x86-64 and arm64 CPU computes alike, vectorised or not: the
 * compiler may only vectorise across independent outputs. The loops run
 * along rows of M' (row-major), so the products stream the matrix once
 * each. Only the first product, M'^T P^ and the result depend on the
 * matrix size; the factors are rows x r and cols x r.
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
#include <stdlib.h>
#include <string.h>

#define ORTHO_EPS 1e-8f

struct powersgd {
    struct allreduce *ar;       /* borrowed */
    size_t rows, cols, r;
    float *err;                 /* rows x cols: E */
    float *mp;                  /* rows x cols: M' of the round in flight */
    float *p;                   /* rows x r, registered */
    float *q;                   /* cols x r, registered */
    float *q_warm;              /* cols x r: the last completed round's Q */
    float *q_own;               /* cols x r: this member's Q before the all-reduce */
    int hp, hq;
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

/* out (rows x r) = a (rows x cols) b (cols x r); each sum over j ascending. */
static void mul_ab(float *restrict out, const float *restrict a, const float *restrict b,
                   size_t rows, size_t cols, size_t r)
{
    for (size_t i = 0; i < rows; i++) {
        float *o = out + i * r;
        const float *ai = a + i * cols;

        memset(o, 0, r * sizeof(float));
        for (size_t j = 0; j < cols; j++) {
            float x = ai[j];
            const float *bj = b + j * r;

            for (size_t c = 0; c < r; c++)
                o[c] += x * bj[c];
        }
    }
}

/* out (cols x r) = a^T (a: rows x cols) p (rows x r); each sum over i ascending. */
static void mul_atb(float *restrict out, const float *restrict a, const float *restrict p,
                    size_t rows, size_t cols, size_t r)
{
    memset(out, 0, cols * r * sizeof(float));
    for (size_t i = 0; i < rows; i++) {
        const float *ai = a + i * cols;
        const float *pi = p + i * r;

        for (size_t j = 0; j < cols; j++) {
            float x = ai[j];
            float *o = out + j * r;

            for (size_t c = 0; c < r; c++)
                o[c] += x * pi[c];
        }
    }
}

/* out (rows x cols) = p (rows x r) q^T (q: cols x r); each sum over c ascending. */
static void mul_abt(float *restrict out, const float *restrict p, const float *restrict q,
                    size_t rows, size_t cols, size_t r)
{
    for (size_t i = 0; i < rows; i++) {
        const float *pi = p + i * r;
        float *o = out + i * cols;

        for (size_t j = 0; j < cols; j++) {
            const float *qj = q + j * r;
            float s = 0;

            for (size_t c = 0; c < r; c++)
                s += pi[c] * qj[c];
            o[j] = s;
        }
    }
}

/* Gram-Schmidt on the r columns of p (rows x r), in place; sums over rows ascending. */
static void orthonormalise(float *p, size_t rows, size_t r)
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

int powersgd_create(struct allreduce *ar, size_t rows, size_t cols, size_t rank, uint64_t seed,
                    struct powersgd **out)
{
    struct powersgd *p;
    size_t r, cells;
    int rc = -ENOMEM;

    if (!ar || !out || rank == 0 || rank > POWERSGD_MAX_RANK || rows == 0 || cols == 0 ||
        rows > SIZE_MAX / sizeof(float) / cols)
        return -EINVAL;
    r = rank < rows ? rank : rows;
    r = r < cols ? r : cols;
    cells = rows * cols;
    p = calloc(1, sizeof(*p));
    if (!p)
        return -ENOMEM;
    p->ar = ar;
    p->rows = rows;
    p->cols = cols;
    p->r = r;
    p->hp = p->hq = -1;
    p->err = calloc(cells, sizeof(float));
    p->mp = malloc(cells * sizeof(float));
    p->q_warm = malloc(cols * r * sizeof(float));
    p->q_own = malloc(cols * r * sizeof(float));
    if (!p->err || !p->mp || !p->q_warm || !p->q_own || posix_memalign((void **)&p->p, 64, rows * r * 4) ||
        posix_memalign((void **)&p->q, 64, cols * r * 4))
        goto fail;
    rc = allreduce_register(ar, p->p, rows * r * sizeof(float));
    if (rc < 0)
        goto fail;
    p->hp = rc;
    rc = allreduce_register(ar, p->q, cols * r * sizeof(float));
    if (rc < 0)
        goto fail;
    p->hq = rc;
    for (size_t i = 0; i < cols * r; i++)
        p->q_warm[i] = uniform(&seed);
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
    if (p->hq >= 0)
        allreduce_unregister(p->ar, p->hq);
    if (p->hp >= 0)
        allreduce_unregister(p->ar, p->hp);
    free(p->q);
    free(p->p);
    free(p->q_warm);
    free(p->q_own);
    free(p->mp);
    free(p->err);
    free(p);
}

size_t powersgd_rank(const struct powersgd *p)
{
    return p->r;
}

const float *powersgd_error(const struct powersgd *p)
{
    return p->err;
}

int powersgd_reduce(struct powersgd *p, float *m, enum dtype_op op, uint64_t round)
{
    size_t cells = p->rows * p->cols;
    int rc;

    if (!m || (op != DTYPE_SUM && op != DTYPE_AVG))
        return -EINVAL;
    for (size_t i = 0; i < cells; i++)
        p->mp[i] = m[i] + p->err[i];
    mul_ab(p->p, p->mp, p->q_warm, p->rows, p->cols, p->r);
    /* P is only a basis: its scale goes in the orthonormalisation, so a
     * sum does (mlbench never divides it either). */
    rc = allreduce_run(p->ar, p->hp, p->rows * p->r, DTYPE_F32, DTYPE_SUM, 0, round);
    if (rc < 0)
        return rc;
    orthonormalise(p->p, p->rows, p->r);
    mul_atb(p->q, p->mp, p->p, p->rows, p->cols, p->r);
    memcpy(p->q_own, p->q, p->cols * p->r * sizeof(float));
    rc = allreduce_run(p->ar, p->hq, p->cols * p->r, DTYPE_F32, op, 0, round + 1);
    if (rc < 0)
        return rc;

    /* Committed: the result (the same bytes on every member), this
     * member's error (what its own share P^ Q_own^T left out), and the
     * warm start. */
    mul_abt(m, p->p, p->q, p->rows, p->cols, p->r);
    mul_abt(p->err, p->p, p->q_own, p->rows, p->cols, p->r);
    for (size_t i = 0; i < cells; i++)
        p->err[i] = p->mp[i] - p->err[i];
    memcpy(p->q_warm, p->q, p->cols * p->r * sizeof(float));
    return 0;
}

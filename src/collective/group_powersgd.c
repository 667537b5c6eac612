/* src/collective/group_powersgd.c: see group_powersgd.h.
 *
 * The kernels are the engine's (engine/powersgd.c, "KERNELS"), in their
 * plain loops: what must be the same bytes on every member is P^ Q^T,
 * computed here from shared inputs by one code path with
 * -ffp-contract=off; M'Q and M'^T P^ are this member's own. */
#include "collective/group_powersgd.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine/powersgd.h"

#define ORTHO_EPS 1e-8f

struct group_powersgd {
    struct group *g;
    size_t rows, cols, r;
    bool reuse;
    enum dtype_op op;           /* of the call in progress */
    float *err, *mp;            /* rows x cols */
    float *q_seed, *q_warm, *q_own;     /* r x cols (Q transposed) */
    float *p, *q;               /* registered: rows x r, r x cols */
    int hp, hq;
    bool attempted;             /* an attempt ran in this call, in attempt_epoch */
    uint64_t attempt_epoch;
};

/* ---- kernels (engine/powersgd.c's order of operations) ---- */

static float dot(const float *a, const float *b, size_t n)
{
    float acc = 0;

    for (size_t j = 0; j < n; j++)
        acc += a[j] * b[j];
    return acc;
}

/* p (rows x r) = a qt^T */
static void mul_p(float *p, const float *a, const float *qt, size_t rows, size_t cols, size_t r)
{
    for (size_t i = 0; i < rows; i++)
        for (size_t c = 0; c < r; c++)
            p[i * r + c] = dot(a + i * cols, qt + c * cols, cols);
}

/* qt (r x cols) = (a^T p)^T */
static void mul_qt(float *qt, const float *a, const float *p, size_t rows, size_t cols, size_t r)
{
    memset(qt, 0, r * cols * sizeof(float));
    for (size_t i = 0; i < rows; i++)
        for (size_t c = 0; c < r; c++) {
            float x = p[i * r + c];

            for (size_t j = 0; j < cols; j++)
                qt[c * cols + j] += a[i * cols + j] * x;
        }
}

/* out = p qt, or from - p qt */
static void mul_out(float *out, const float *p, const float *qt, const float *from, size_t rows,
                    size_t cols, size_t r)
{
    for (size_t i = 0; i < rows; i++) {
        float *o = out + i * cols;

        memset(o, 0, cols * sizeof(float));
        for (size_t c = 0; c < r; c++) {
            float x = p[i * r + c];

            for (size_t j = 0; j < cols; j++)
                o[j] += x * qt[c * cols + j];
        }
        for (size_t j = 0; from && j < cols; j++)
            o[j] = from[i * cols + j] - o[j];
    }
}

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
            float s = 0;

            for (size_t i = 0; i < rows; i++)
                s += p[i * r + c] * p[i * r + d];
            for (size_t i = 0; i < rows; i++)
                p[i * r + d] -= s * p[i * r + c];
        }
    }
}

static bool all_finite(const float *x, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (!isfinite(x[i]))
            return false;
    return true;
}

/* The seeded Q: uniform in [-1, 1) from splitmix64, the same on every
 * member that passes the same seed. */
static float uniform(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);

    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return (float)((double)(z >> 40) / (double)(1ull << 23) - 1.0);
}

/* ---- the call ---- */

static size_t result_bytes(const struct group_powersgd *p)
{
    return (p->rows + p->cols) * p->r * sizeof(float) + sizeof(uint64_t);
}

static int attempt(void *arg, struct group *g, uint64_t epoch, void *out)
{
    struct group_powersgd *p = arg;
    size_t np = p->rows * p->r, nq = p->cols * p->r;
    int rc;

    p->attempted = true;
    p->attempt_epoch = epoch;
    mul_p(p->p, p->mp, p->reuse ? p->q_warm : p->q_seed, p->rows, p->cols, p->r);
    /* P is only a basis: its scale goes in the orthonormalisation. */
    rc = group_step_allreduce(g, p->hp, np, DTYPE_F32, DTYPE_SUM);
    if (rc < 0)
        return rc;
    orthonormalise(p->p, p->rows, p->r);
    mul_qt(p->q, p->mp, p->p, p->rows, p->cols, p->r);
    rc = group_step_allreduce(g, p->hq, nq, DTYPE_F32, p->op);
    if (rc < 0)
        return rc;
    memcpy(out, p->p, np * sizeof(float));
    memcpy((char *)out + np * sizeof(float), p->q, nq * sizeof(float));
    memcpy((char *)out + (np + nq) * sizeof(float), &epoch, sizeof(epoch));
    return 0;
}

/* What members must agree on, hashed (FNV-1a): shape, rank, op. */
static uint64_t tag_of(const struct group_powersgd *p, enum dtype_op op)
{
    uint64_t v[5] = { 0x70736764u, p->rows, p->cols, p->r, (uint64_t)op };
    uint64_t h = 14695981039346656037ull;

    for (size_t i = 0; i < 5; i++)
        for (int b = 0; b < 8; b++) {
            h ^= (v[i] >> (8 * b)) & 0xff;
            h *= 1099511628211ull;
        }
    return h;
}

int group_powersgd_reduce(struct group_powersgd *p, float *m, enum dtype_op op,
                          uint32_t timeout_ms)
{
    struct group_steps s = { .attempt = attempt, .arg = p };
    size_t cells, np, nq;
    const void *out;
    const float *pp, *qq;
    uint64_t epoch;
    int rc;

    if (!p || !m || (op != DTYPE_SUM && op != DTYPE_AVG))
        return -EINVAL;
    cells = p->rows * p->cols;
    np = p->rows * p->r;
    nq = p->cols * p->r;
    for (size_t i = 0; i < cells; i++)
        p->mp[i] = m[i] + p->err[i];
    p->op = op;
    p->attempted = false;
    s.tag = tag_of(p, op);
    s.out_bytes = result_bytes(p);
    rc = group_steps(p->g, &s, &out, timeout_ms);
    if (rc < 0)
        return rc;

    /* Committed. pp and qq are the group's copy, the same bytes on every
     * member; so is the result computed from them. */
    pp = out;
    qq = (const float *)((const char *)out + np * sizeof(float));
    memcpy(&epoch, (const char *)out + (np + nq) * sizeof(float), sizeof(epoch));
    mul_out(m, pp, qq, NULL, p->rows, p->cols, p->r);
    if (!all_finite(qq, nq))
        return 0;
    if (p->attempted && p->attempt_epoch == epoch) {
        mul_qt(p->q_own, p->mp, pp, p->rows, p->cols, p->r);
        mul_out(p->err, pp, p->q_own, p->mp, p->rows, p->cols, p->r);
    } else {
        memcpy(p->err, p->mp, cells * sizeof(float));
    }
    memcpy(p->q_warm, qq, nq * sizeof(float));
    return 0;
}

int group_powersgd_create(struct group *g, size_t rows, size_t cols, size_t rank, uint64_t seed,
                          bool reuse_query, struct group_powersgd **out)
{
    struct group_powersgd *p;
    size_t r, cells;
    int rc = -ENOMEM;

    if (!g || !out || rank == 0 || rank > POWERSGD_MAX_RANK || rows == 0 || cols == 0 ||
        rows > SIZE_MAX / sizeof(float) / cols || rows > SIZE_MAX / 4 / POWERSGD_MAX_RANK ||
        cols > SIZE_MAX / 4 / POWERSGD_MAX_RANK)
        return -EINVAL;
    r = rank < rows ? rank : rows;
    r = r < cols ? r : cols;
    cells = rows * cols;
    p = calloc(1, sizeof(*p));
    if (!p)
        return -ENOMEM;
    p->g = g;
    p->rows = rows;
    p->cols = cols;
    p->r = r;
    p->reuse = reuse_query;
    p->hp = p->hq = -1;
    p->err = calloc(cells, sizeof(float));
    p->mp = malloc(cells * sizeof(float));
    p->q_seed = malloc(cols * r * sizeof(float));
    p->q_warm = malloc(cols * r * sizeof(float));
    p->q_own = malloc(cols * r * sizeof(float));
    if (!p->err || !p->mp || !p->q_seed || !p->q_warm || !p->q_own ||
        posix_memalign((void **)&p->p, 64, rows * r * sizeof(float)) ||
        posix_memalign((void **)&p->q, 64, cols * r * sizeof(float)))
        goto fail;
    rc = group_register(g, p->p, rows * r * sizeof(float));
    if (rc < 0)
        goto fail;
    p->hp = rc;
    rc = group_register(g, p->q, cols * r * sizeof(float));
    if (rc < 0)
        goto fail;
    p->hq = rc;
    for (size_t i = 0; i < cols * r; i++)
        p->q_seed[i] = uniform(&seed);
    memcpy(p->q_warm, p->q_seed, cols * r * sizeof(float));
    *out = p;
    return 0;
fail:
    group_powersgd_destroy(p);
    return rc;
}

void group_powersgd_destroy(struct group_powersgd *p)
{
    if (!p)
        return;
    group_unregister(p->g, p->hq);
    group_unregister(p->g, p->hp);
    free(p->q);
    free(p->p);
    free(p->q_own);
    free(p->q_warm);
    free(p->q_seed);
    free(p->mp);
    free(p->err);
    free(p);
}

size_t group_powersgd_rank(const struct group_powersgd *p)
{
    return p->r;
}

const float *group_powersgd_error(const struct group_powersgd *p)
{
    return p->err;
}

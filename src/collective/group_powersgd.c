/* src/collective/group_powersgd.c: see group_powersgd.h.
 *
 * The kernels are the engine's (engine/powersgd.h): what must be the same
 * bytes on every member is P^ Q^T, computed from shared inputs by one
 * code path with -ffp-contract=off; M'Q and M'^T P^ are this member's
 * own. */
#include "collective/group_powersgd.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "engine/powersgd.h"

struct mat {
    size_t rows, cols, r;
    size_t at;                  /* offset in the caller's buffer (floats) */
    size_t p_at, q_at;          /* offsets in P and Q (floats) */
};

struct group_powersgd {
    struct group *g;
    struct mat *mats;
    size_t n_mats, vectors;     /* vectors: floats after the matrices */
    size_t cells;               /* the caller's buffer: matrices, then vectors */
    size_t np, nq;              /* P: sum of rows x r; Q: sum of r x cols, then the vectors */
    bool reuse;
    enum dtype_op op;           /* of the call in progress */
    float *err, *mp;            /* cells */
    float *q_seed, *q_warm, *q_own;     /* nq: each matrix's Q transposed (r x cols) */
    float *p, *q;               /* registered: np, nq */
    int hp, hq;
    bool attempted;             /* an attempt ran in this call, in attempt_epoch */
    uint64_t attempt_epoch;
};

/* ---- the call ---- */

static size_t result_bytes(const struct group_powersgd *p)
{
    return (p->np + p->nq) * sizeof(float) + sizeof(uint64_t);
}

static int attempt(void *arg, struct group *g, uint64_t epoch, void *out)
{
    struct group_powersgd *p = arg;
    const float *qs = p->reuse ? p->q_warm : p->q_seed;
    int rc;

    p->attempted = true;
    p->attempt_epoch = epoch;
    for (size_t k = 0; k < p->n_mats; k++) {
        const struct mat *m = &p->mats[k];

        powersgd_mul_p(p->p + m->p_at, p->mp + m->at, qs + m->q_at, m->rows, m->cols, m->r);
    }
    /* P is only a basis: its scale goes in the orthonormalisation. */
    if (p->np) {
        rc = group_step_allreduce(g, p->hp, p->np, DTYPE_F32, DTYPE_SUM);
        if (rc < 0)
            return rc;
    }
    for (size_t k = 0; k < p->n_mats; k++) {
        const struct mat *m = &p->mats[k];

        powersgd_orthonormalise(p->p + m->p_at, m->rows, m->r);
        powersgd_mul_qt(p->q + m->q_at, p->mp + m->at, p->p + m->p_at, m->rows, m->cols, m->r);
    }
    /* The vectors ride uncompressed with the Qs, under the same op. */
    memcpy(p->q + (p->nq - p->vectors), p->mp + (p->cells - p->vectors),
           p->vectors * sizeof(float));
    rc = group_step_allreduce(g, p->hq, p->nq, DTYPE_F32, p->op);
    if (rc < 0)
        return rc;
    memcpy(out, p->p, p->np * sizeof(float));
    memcpy((char *)out + p->np * sizeof(float), p->q, p->nq * sizeof(float));
    memcpy((char *)out + (p->np + p->nq) * sizeof(float), &epoch, sizeof(epoch));
    return 0;
}

/* What members must agree on, hashed (FNV-1a): every shape and rank, the
 * vectors, the op. */
static uint64_t tag_of(const struct group_powersgd *p, enum dtype_op op)
{
    uint64_t h = 14695981039346656037ull;
    uint64_t head[3] = { 0x70736764u, p->vectors, (uint64_t)op };

    for (size_t i = 0; i < 3 + 3 * p->n_mats; i++) {
        uint64_t v = i < 3 ? head[i] : (i - 3) % 3 == 0 ? p->mats[(i - 3) / 3].rows
                                     : (i - 3) % 3 == 1 ? p->mats[(i - 3) / 3].cols
                                                        : p->mats[(i - 3) / 3].r;

        for (int b = 0; b < 8; b++) {
            h ^= (v >> (8 * b)) & 0xff;
            h *= 1099511628211ull;
        }
    }
    return h;
}

int group_powersgd_reduce(struct group_powersgd *p, float *m, enum dtype_op op,
                          uint32_t timeout_ms)
{
    struct group_steps s = { .attempt = attempt, .arg = p };
    const void *out;
    const float *pp, *qq;
    size_t vec_at;
    uint64_t epoch;
    bool mine;
    int rc;

    if (!p || !m || (op != DTYPE_SUM && op != DTYPE_AVG))
        return -EINVAL;
    for (size_t i = 0; i < p->cells; i++)
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
    qq = (const float *)((const char *)out + p->np * sizeof(float));
    memcpy(&epoch, (const char *)out + (p->np + p->nq) * sizeof(float), sizeof(epoch));
    vec_at = p->cells - p->vectors;
    for (size_t k = 0; k < p->n_mats; k++) {
        const struct mat *x = &p->mats[k];

        powersgd_mul_out(m + x->at, pp + x->p_at, qq + x->q_at, NULL, x->rows, x->cols, x->r);
    }
    memcpy(m + vec_at, qq + (p->nq - p->vectors), p->vectors * sizeof(float));
    if (!powersgd_all_finite(qq, p->nq))
        return 0;
    mine = p->attempted && p->attempt_epoch == epoch;
    for (size_t k = 0; k < p->n_mats && mine; k++) {
        const struct mat *x = &p->mats[k];

        powersgd_mul_qt(p->q_own + x->q_at, p->mp + x->at, pp + x->p_at, x->rows, x->cols, x->r);
        powersgd_mul_out(p->err + x->at, pp + x->p_at, p->q_own + x->q_at, p->mp + x->at, x->rows,
                x->cols, x->r);
    }
    /* Vectors were sent whole: nothing left over. */
    if (mine)
        memset(p->err + vec_at, 0, p->vectors * sizeof(float));
    else
        memcpy(p->err, p->mp, p->cells * sizeof(float));
    memcpy(p->q_warm, qq, (p->nq - p->vectors) * sizeof(float));
    return 0;
}

int group_powersgd_create(struct group *g, const struct group_powersgd_matrix *mats,
                          size_t n_mats, size_t vectors, size_t rank, uint64_t seed,
                          bool reuse_query, struct group_powersgd **out)
{
    const size_t cap = GROUP_DEFAULT_MAX_BYTES / sizeof(float);
    struct group_powersgd *p;
    size_t cells = 0, np = 0, nq = 0;
    int rc = -ENOMEM;

    if (!g || !out || (n_mats && !mats) || (n_mats == 0 && vectors == 0) || rank == 0 ||
        rank > POWERSGD_MAX_RANK || n_mats > cap || vectors > cap)
        return -EINVAL;
    /* Sizes from the caller: every sum is checked against a cap that no
     * product of two of them can overflow past. */
    for (size_t k = 0; k < n_mats; k++) {
        size_t rows = mats[k].rows, cols = mats[k].cols, r;

        if (rows == 0 || cols == 0 || rows > cap || cols > cap || rows > cap / cols)
            return -EINVAL;
        r = rank < rows ? rank : rows;
        r = r < cols ? r : cols;
        cells += rows * cols;
        np += rows * r;
        nq += cols * r;
        if (cells > cap || np > cap || nq > cap)
            return -EINVAL;
    }
    if (cells + vectors > cap || nq + vectors > cap)
        return -EINVAL;
    p = calloc(1, sizeof(*p));
    if (!p)
        return -ENOMEM;
    p->g = g;
    p->reuse = reuse_query;
    p->hp = p->hq = -1;
    p->n_mats = n_mats;
    p->vectors = vectors;
    p->cells = cells + vectors;
    p->np = np;
    p->nq = nq + vectors;
    p->mats = calloc(n_mats ? n_mats : 1, sizeof(*p->mats));
    p->err = calloc(p->cells, sizeof(float));
    p->mp = malloc(p->cells * sizeof(float));
    p->q_seed = malloc(p->nq * sizeof(float));
    p->q_warm = malloc(p->nq * sizeof(float));
    p->q_own = malloc(p->nq * sizeof(float));
    if (!p->mats || !p->err || !p->mp || !p->q_seed || !p->q_warm || !p->q_own ||
        posix_memalign((void **)&p->p, 64, (np ? np : 1) * sizeof(float)) ||
        posix_memalign((void **)&p->q, 64, p->nq * sizeof(float)))
        goto fail;
    cells = np = nq = 0;
    for (size_t k = 0; k < n_mats; k++) {
        struct mat *x = &p->mats[k];

        x->rows = mats[k].rows;
        x->cols = mats[k].cols;
        x->r = rank < x->rows ? rank : x->rows;
        x->r = x->r < x->cols ? x->r : x->cols;
        x->at = cells;
        x->p_at = np;
        x->q_at = nq;
        cells += x->rows * x->cols;
        np += x->rows * x->r;
        nq += x->cols * x->r;
    }
    rc = group_register(g, p->p, (np ? np : 1) * sizeof(float));
    if (rc < 0)
        goto fail;
    p->hp = rc;
    rc = group_register(g, p->q, p->nq * sizeof(float));
    if (rc < 0)
        goto fail;
    p->hq = rc;
    powersgd_seed_q(p->q_seed, p->nq, seed);
    memcpy(p->q_warm, p->q_seed, p->nq * sizeof(float));
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
    free(p->mats);
    free(p);
}

size_t group_powersgd_size(const struct group_powersgd *p)
{
    return p->cells;
}

const float *group_powersgd_error(const struct group_powersgd *p)
{
    return p->err;
}

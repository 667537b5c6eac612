/* src/collective/group_powersgd.c: see group_powersgd.h.
 *
 * The matrices are one engine/powersgd.h block (struct powersgd_block),
 * so the kernels and their order are the engine's: what must be the same
 * bytes on every member is P^ Q^T, computed from shared inputs by one
 * code path with -ffp-contract=off; M'Q and M'^T P^ are this member's
 * own. */
#include "collective/group_powersgd.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "engine/powersgd.h"

struct group_powersgd {
    struct group *g;
    struct powersgd_block b;    /* the matrices, then the vectors; b.q carries them after the Qs */
    size_t vectors;             /* floats after the matrices */
    bool reuse;
    enum dtype_op op;           /* of the call in progress */
    int hp, hq;
    bool attempted;             /* an attempt ran in this call, in attempt_epoch */
    uint64_t attempt_epoch;
};

/* ---- the call ---- */

/* P, then Q with the vectors, then the epoch that completed the call. */
static size_t result_bytes(const struct group_powersgd *p)
{
    return (p->b.np + p->b.nq + p->vectors) * sizeof(float) + sizeof(uint64_t);
}

static int attempt(void *arg, struct group *g, uint64_t epoch, void *out)
{
    struct group_powersgd *p = arg;
    struct powersgd_block *b = &p->b;
    size_t nq = b->nq + p->vectors;
    int rc;

    p->attempted = true;
    p->attempt_epoch = epoch;
    powersgd_block_mul_p(b, p->reuse ? b->q_warm : b->q_seed);
    /* P is only a basis: its scale goes in the orthonormalisation. */
    if (b->np) {
        rc = group_step_allreduce(g, p->hp, b->np, DTYPE_F32, DTYPE_SUM);
        if (rc < 0)
            return rc;
    }
    powersgd_block_mul_qt(b);
    /* The vectors ride uncompressed with the Qs, under the same op. */
    memcpy(b->q + b->nq, b->mp + (b->cells - p->vectors), p->vectors * sizeof(float));
    rc = group_step_allreduce(g, p->hq, nq, DTYPE_F32, p->op);
    if (rc < 0)
        return rc;
    memcpy(out, b->p, b->np * sizeof(float));
    memcpy((char *)out + b->np * sizeof(float), b->q, nq * sizeof(float));
    memcpy((char *)out + (b->np + nq) * sizeof(float), &epoch, sizeof(epoch));
    return 0;
}

/* What members must agree on, hashed (FNV-1a): every shape and rank, the
 * vectors, the op. */
static uint64_t tag_of(const struct group_powersgd *p, enum dtype_op op)
{
    uint64_t h = 14695981039346656037ull;
    uint64_t head[3] = { 0x70736764u, p->vectors, (uint64_t)op };
    const struct powersgd_block_mat *m = p->b.mats;

    for (size_t i = 0; i < 3 + 3 * p->b.n_mats; i++) {
        uint64_t v = i < 3 ? head[i] : (i - 3) % 3 == 0 ? m[(i - 3) / 3].rows
                                     : (i - 3) % 3 == 1 ? m[(i - 3) / 3].cols
                                                        : m[(i - 3) / 3].r;

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
    struct powersgd_block *b;
    const void *out;
    const float *pp, *qq;
    size_t vec_at, nq;
    uint64_t epoch;
    bool mine;
    int rc;

    if (!p || !m || (op != DTYPE_SUM && op != DTYPE_AVG))
        return -EINVAL;
    b = &p->b;
    nq = b->nq + p->vectors;
    vec_at = b->cells - p->vectors;
    powersgd_block_load(b, m);
    for (size_t i = vec_at; i < b->cells; i++)
        b->mp[i] = m[i] + b->err[i];
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
    qq = (const float *)((const char *)out + b->np * sizeof(float));
    memcpy(&epoch, (const char *)out + (b->np + nq) * sizeof(float), sizeof(epoch));
    powersgd_block_out(b, m, pp, qq);
    memcpy(m + vec_at, qq + b->nq, p->vectors * sizeof(float));
    if (!powersgd_all_finite(qq, nq))
        return 0;
    mine = p->attempted && p->attempt_epoch == epoch;
    if (mine) {
        powersgd_block_own_q(b, pp);
        powersgd_block_error(b, pp, b->q_own);
        /* Vectors were sent whole: nothing left over. */
        memset(b->err + vec_at, 0, p->vectors * sizeof(float));
    } else {
        memcpy(b->err, b->mp, b->cells * sizeof(float));
    }
    powersgd_block_warm(b, qq);
    return 0;
}

int group_powersgd_create(struct group *g, const struct group_powersgd_matrix *mats,
                          size_t n_mats, size_t vectors, size_t rank, uint64_t seed,
                          bool reuse_query, struct group_powersgd **out)
{
    const size_t cap = GROUP_DEFAULT_MAX_BYTES / sizeof(float);
    struct powersgd_shape *shapes = NULL;
    struct group_powersgd *p = NULL;
    size_t cells = 0;
    int rc;

    if (!g || !out || (n_mats && !mats) || (n_mats == 0 && vectors == 0) || rank == 0 ||
        rank > POWERSGD_MAX_RANK || n_mats > cap || vectors > cap)
        return -EINVAL;
    /* Sizes from the caller, checked before anything is allocated
     * against a cap that no product of two of them can overflow past. P
     * and Q are at most the cells (r <= rows, cols), so the cap bounds
     * them too. */
    for (size_t k = 0; k < n_mats; k++) {
        size_t rows = mats[k].rows, cols = mats[k].cols;

        if (rows == 0 || cols == 0 || rows > cap || cols > cap || rows > cap / cols ||
            rows * cols > cap - cells)
            return -EINVAL;
        cells += rows * cols;
    }
    if (vectors > cap - cells)
        return -EINVAL;
    p = calloc(1, sizeof(*p));
    if (!p)
        return -ENOMEM;
    p->g = g;
    p->reuse = reuse_query;
    p->hp = p->hq = -1;
    p->vectors = vectors;
    rc = -ENOMEM;
    shapes = calloc(n_mats ? n_mats : 1, sizeof(*shapes));
    if (!shapes)
        goto out;
    cells = 0;
    for (size_t k = 0; k < n_mats; k++) {
        shapes[k] = (struct powersgd_shape){ cells, mats[k].rows, mats[k].cols };
        cells += mats[k].rows * mats[k].cols;
    }
    rc = powersgd_block_init(&p->b, shapes, n_mats, rank, cells + vectors, vectors, seed);
    if (rc < 0)
        goto out;
    rc = group_register(g, p->b.p, p->b.p_len * sizeof(float));
    if (rc < 0)
        goto out;
    p->hp = rc;
    rc = group_register(g, p->b.q, p->b.q_len * sizeof(float));
    if (rc < 0)
        goto out;
    p->hq = rc;
    *out = p;
    p = NULL;
    rc = 0;
out:
    group_powersgd_destroy(p);
    free(shapes);
    return rc;
}

void group_powersgd_destroy(struct group_powersgd *p)
{
    if (!p)
        return;
    group_unregister(p->g, p->hq);
    group_unregister(p->g, p->hp);
    powersgd_block_cleanup(&p->b);
    free(p);
}

size_t group_powersgd_size(const struct group_powersgd *p)
{
    return p->b.cells;
}

const float *group_powersgd_error(const struct group_powersgd *p)
{
    return p->b.err;
}

/* src/accumulator/layout.c: see layout.h.
 *
 * Sizes: every matrix lies inside the buffer and no two overlap, so the
 * cells, the Ps (rows x r <= rows x cols) and the Qs (cols x r) each sum
 * to at most grad_count floats: nothing a trainer names can overflow. */
#include "accumulator/layout.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "engine/powersgd.h"

struct range {
    size_t at, n;
};

struct layout {
    size_t count;               /* the gradient buffer's elements */
    struct powersgd_shape *mats;        /* by offset */
    size_t n_mats;
    struct range *plain;        /* the rest, by offset */
    size_t n_plain, plain_elems;
    uint64_t hash;
};

static int by_offset(const void *a, const void *b)
{
    const struct layout_shape *x = a, *y = b;

    return x->offset < y->offset ? -1 : x->offset > y->offset;
}

static uint64_t fnv(uint64_t h, uint64_t v)
{
    for (int b = 0; b < 8; b++) {
        h ^= (v >> (8 * b)) & 0xff;
        h *= 1099511628211ull;
    }
    return h;
}

int layout_make(const struct layout_shape *s, size_t k, size_t grad_count, struct layout **out)
{
    struct layout_shape *v = NULL;
    struct layout *l = NULL;
    size_t end = 0;
    int rc = -EINVAL;

    if (!out || (k && !s) || k > LAYOUT_SHAPES_MAX)
        return -EINVAL;
    if (k == 0) {
        *out = NULL;
        return 0;
    }
    if (!(v = malloc(k * sizeof(*v))))
        return -ENOMEM;
    memcpy(v, s, k * sizeof(*v));
    qsort(v, k, sizeof(*v), by_offset);
    for (size_t i = 0; i < k; i++) {
        if (v[i].count == 0 || v[i].rows == 0 || v[i].cols == 0 ||
            v[i].rows > UINT64_MAX / v[i].cols || v[i].rows * v[i].cols != v[i].count ||
            v[i].offset > grad_count || v[i].count > grad_count - v[i].offset ||
            v[i].offset < end)
            goto out;
        end = (size_t)(v[i].offset + v[i].count);
    }
    rc = -ENOMEM;
    if (!(l = calloc(1, sizeof(*l))) || !(l->mats = calloc(k, sizeof(*l->mats))) ||
        !(l->plain = calloc(k + 1, sizeof(*l->plain))))
        goto out;
    l->count = grad_count;
    l->hash = fnv(fnv(14695981039346656037ull, 0x6c61796fu), grad_count);
    end = 0;
    for (size_t i = 0; i < k; i++) {
        if (v[i].rows < 2 || v[i].cols < 2)
            continue;       /* a vector: with the rest, uncompressed */
        if (v[i].offset > end)
            l->plain[l->n_plain++] = (struct range){ end, (size_t)v[i].offset - end };
        l->mats[l->n_mats++] = (struct powersgd_shape){ (size_t)v[i].offset, (size_t)v[i].rows,
                                                        (size_t)v[i].cols };
        l->hash = fnv(fnv(fnv(l->hash, v[i].offset), v[i].rows), v[i].cols);
        end = (size_t)(v[i].offset + v[i].count);
    }
    if (end < grad_count)
        l->plain[l->n_plain++] = (struct range){ end, grad_count - end };
    for (size_t i = 0; i < l->n_plain; i++)
        l->plain_elems += l->plain[i].n;
    if (l->hash == 0)
        l->hash = 1;    /* 0 means no layout */
    *out = l;
    l = NULL;
    rc = 0;
out:
    layout_free(l);
    free(v);
    return rc;
}

void layout_free(struct layout *l)
{
    if (!l)
        return;
    free(l->mats);
    free(l->plain);
    free(l);
}

uint64_t layout_hash(const struct layout *l)
{
    return l ? l->hash : 0;
}

size_t layout_matrices(const struct layout *l)
{
    return l ? l->n_mats : 0;
}

size_t layout_plain(const struct layout *l)
{
    return l ? l->plain_elems : 0;
}

/* ---- PowerSGD over the layout ---- */

struct layout_psgd {
    struct allreduce *ar;
    struct powersgd_block b;    /* the matrices; b.q carries the plain elements after the Qs */
    struct range *plain;
    size_t n_plain;
    int hp, hq;
    bool pending, finite;       /* an uncommitted reduce_into, and its Qs were finite */
};

int layout_psgd_create(struct allreduce *ar, const struct layout *l, size_t rank, uint64_t seed,
                       struct layout_psgd **out)
{
    struct layout_psgd *p;
    int rc = -ENOMEM;

    if (!ar || !l || !out || rank == 0 || rank > POWERSGD_MAX_RANK)
        return -EINVAL;
    if (!(p = calloc(1, sizeof(*p))))
        return -ENOMEM;
    p->ar = ar;
    p->hp = p->hq = -1;
    p->n_plain = l->n_plain;
    if (!(p->plain = calloc(l->n_plain ? l->n_plain : 1, sizeof(*p->plain))))
        goto fail;
    memcpy(p->plain, l->plain, l->n_plain * sizeof(*p->plain));
    if ((rc = powersgd_block_init(&p->b, l->mats, l->n_mats, rank, l->count, l->plain_elems,
                                  seed)) < 0)
        goto fail;
    if ((rc = powersgd_block_register(&p->b, ar, &p->hp, &p->hq)) < 0)
        goto fail;
    *out = p;
    return 0;
fail:
    layout_psgd_destroy(p);
    return rc;
}

void layout_psgd_destroy(struct layout_psgd *p)
{
    if (!p)
        return;
    powersgd_block_unregister(p->ar, &p->hp, &p->hq);
    powersgd_block_cleanup(&p->b);
    free(p->plain);
    free(p);
}

int layout_psgd_reduce_into(struct layout_psgd *p, const float *in, float *out, enum dtype_op op,
                            uint64_t round)
{
    struct powersgd_block *b = &p->b;
    size_t at = b->nq;
    int rc;

    if (op != DTYPE_SUM && op != DTYPE_AVG)
        return -EINVAL;
    p->pending = false;
    powersgd_block_load(b, in);
    powersgd_block_mul_p(b, b->q_warm);
    /* P is only a basis (its scale goes in the orthonormalisation): SUM.
     * Always run, with no matrices too, so that every member's rounds
     * stay in step whatever it has. */
    if (b->np == 0)
        b->p[0] = 0;
    rc = allreduce_run(p->ar, p->hp, b->p_len, DTYPE_F32, DTYPE_SUM, 0, round);
    if (rc < 0)
        return rc;
    powersgd_block_mul_qt(b);
    memcpy(b->q_own, b->q, b->nq * sizeof(float));
    for (size_t i = 0; i < p->n_plain; i++) {
        memcpy(b->q + at, in + p->plain[i].at, p->plain[i].n * sizeof(float));
        at += p->plain[i].n;
    }
    if (b->nq + b->q_extra == 0)
        b->q[0] = 0;
    rc = allreduce_run(p->ar, p->hq, b->q_len, DTYPE_F32, op, 0, round + 1);
    if (rc < 0)
        return rc;
    /* From the summed P^ and Q alone: the same bytes on every member. */
    powersgd_block_out(b, out, b->p, b->q);
    at = b->nq;
    for (size_t i = 0; i < p->n_plain; i++) {
        memcpy(out + p->plain[i].at, b->q + at, p->plain[i].n * sizeof(float));
        at += p->plain[i].n;
    }
    p->finite = powersgd_all_finite(b->q, b->nq);
    p->pending = true;
    return 0;
}

void layout_psgd_commit(struct layout_psgd *p)
{
    if (!p || !p->pending)
        return;
    p->pending = false;
    if (!p->finite)
        return;
    powersgd_block_error(&p->b, p->b.p, p->b.q_own);
    powersgd_block_warm(&p->b, p->b.q);
}

void layout_psgd_reset(struct layout_psgd *p)
{
    if (!p)
        return;
    powersgd_block_reset(&p->b);
    p->pending = false;
}

const float *layout_psgd_error(const struct layout_psgd *p)
{
    return p->b.err;
}

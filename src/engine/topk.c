/* src/engine/topk.c: see topk.h.
 *
 * SELECTION
 *
 * A radix select on the magnitude's bits: for float32, |x| ordered as a
 * number and (bits & 0x7fffffff) ordered as an unsigned integer agree, NaN
 * patterns lying above Inf, so the key needs no float comparison and the
 * order is total once ties go to the lower index. Two histogram passes
 * (the key's top 16 bits, then its low 15 among the entries that share
 * the chosen top; 256 KiB of counters, allocated with the reducer) find
 * the key T of the k-th entry and how many entries equal to T are still
 * wanted; a last pass takes every entry above T and the first of those
 * equal to T, in index order, so the indices come out ascending with no
 * sort. Three passes over n, and no dependence on a library sort's tie
 * rule.
 * The selection reads gradient + residual on the fly rather than keeping
 * the sum, so a reducer holds n floats (the residual), not 2n. Measured
 * on the shared 2-core development VM (gcc 12 -O2, uniform values, the
 * thread's CPU time, best of 5 in each of 3 interleaved runs), selecting
 * 1% of 16 Mi entries took 85 to 96 ms with three histograms of 11, 10
 * and 10 bits (16 KiB of counters, four passes) and 58 to 71 ms with
 * these two; it, not the exchange, is most of a 64 MiB round on loopback
 * (README, "Top-k and PowerSGD").
 *
 * EXCHANGE
 *
 * Index sets differ between members, so the pairs are all-gathered, not
 * all-reduced (allreduce_gather; its top comment has the cost: twice the
 * bytes of a ring all-gather). With m members a member sends about
 * 2(m-1) x 8k bytes per round against 2(m-1)/m x 4n dense: at k = n/100
 * and m = 4, 8% of the dense bytes. Every member then adds the m blocks
 * into a zeroed result in member order (float addition is not
 * associative, so the order is what makes the bytes agree), having first
 * checked every index, so a lying peer's block fails the round before
 * anything is written. */
#include "engine/topk.h"

#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "engine/peerwire.h"

struct topk {
    struct allreduce *ar;           /* borrowed */
    size_t n, k;
    float *residual;                /* n */
    uint32_t *idx;                  /* k: this round's selection */
    uint32_t *hist;                 /* HIST_BINS: the selection's scratch */
    uint8_t *block;                 /* k pairs: what this member sends */
    int hblock;
    uint8_t *gather;                /* gather_members blocks */
    size_t gather_members;
    int hgather;
    bool pending;                   /* topk_reduce_into succeeded, not committed */
};

static uint32_t key_of(float v)
{
    uint32_t b;

    memcpy(&b, &v, sizeof(b));
    return b & 0x7fffffffu;
}

static float entry(const float *g, const float *r, size_t i)
{
    return r ? g[i] + r[i] : g[i];
}

/* Counters of the first histogram: the key's top 16 bits. */
#define HIST_BINS (1u << 16)

/* The top k of g + r (r may be NULL) into idx, ascending, with `hist`
 * (HIST_BINS counters) as scratch. */
static void select_sum(const float *g, const float *r, size_t n, size_t k, uint32_t *idx,
                       uint32_t *hist)
{
    static const unsigned shift[2] = { 15, 0 };
    static const unsigned width[2] = { 16, 15 };
    uint32_t prefix = 0;            /* the key's bits chosen so far */
    size_t need = k;                /* entries still wanted among those matching prefix */
    size_t got = 0;

    for (int lv = 0; lv < 2; lv++) {
        size_t bins = (size_t)1 << width[lv];
        unsigned above = shift[lv] + width[lv];     /* bits above this level */

        memset(hist, 0, bins * sizeof(hist[0]));
        for (size_t i = 0; i < n; i++) {
            uint32_t key = key_of(entry(g, r, i));

            if (above >= 31 || key >> above == prefix >> above)
                hist[(key >> shift[lv]) & (bins - 1)]++;
        }
        size_t b = bins;
        while (b-- > 0) {
            if (hist[b] >= need)
                break;
            need -= hist[b];
        }
        prefix |= (uint32_t)b << shift[lv];
    }
    /* prefix is now T, the k-th key; `need` entries equal to it are taken. */
    for (size_t i = 0; i < n && got < k; i++) {
        uint32_t key = key_of(entry(g, r, i));

        if (key > prefix || (key == prefix && need > 0)) {
            if (key == prefix)
                need--;
            idx[got++] = (uint32_t)i;
        }
    }
}

int topk_select(const float *x, size_t n, size_t k, uint32_t *idx)
{
    uint32_t *hist;

    if (!x || !idx || k == 0 || k > n || n > UINT32_MAX)
        return -EINVAL;
    hist = malloc(HIST_BINS * sizeof(*hist));
    if (!hist)
        return -ENOMEM;
    select_sum(x, NULL, n, k, idx, hist);
    free(hist);
    return 0;
}

int topk_k_for_ratio(size_t n, double ratio, size_t *k)
{
    double want;

    if (n == 0 || !(ratio > 0 && ratio <= 1) || !k)
        return -EINVAL;
    want = ceil(ratio * (double)n);
    *k = want < 1 ? 1 : want >= (double)n ? n : (size_t)want;
    return 0;
}

/* Makes the gather buffer hold `members` blocks, registered with the
 * engine. The old registration goes only once the new one exists. */
static int gather_reserve(struct topk *t, size_t members)
{
    size_t bytes;
    uint8_t *buf;
    int h;

    if (members <= t->gather_members)
        return 0;
    if (members > SIZE_MAX / (t->k * TOPK_PAIR_BYTES))
        return -ENOMEM;
    bytes = members * t->k * TOPK_PAIR_BYTES;
    if (posix_memalign((void **)&buf, 64, bytes) != 0)
        return -ENOMEM;
    h = allreduce_register(t->ar, buf, bytes);
    if (h < 0) {
        free(buf);
        return h;
    }
    if (t->hgather >= 0)
        allreduce_unregister(t->ar, t->hgather);
    free(t->gather);
    t->gather = buf;
    t->hgather = h;
    t->gather_members = members;
    return 0;
}

int topk_create(struct allreduce *ar, size_t n, size_t k, struct topk **out)
{
    struct topk *t;
    size_t members;
    int rc = -ENOMEM;

    if (!ar || !out || k == 0 || k > n || n > UINT32_MAX)
        return -EINVAL;
    t = calloc(1, sizeof(*t));
    if (!t)
        return -ENOMEM;
    t->ar = ar;
    t->n = n;
    t->k = k;
    t->hblock = t->hgather = -1;
    t->residual = calloc(n, sizeof(float));
    t->idx = calloc(k, sizeof(uint32_t));
    t->hist = malloc(HIST_BINS * sizeof(uint32_t));
    if (!t->residual || !t->idx || !t->hist || posix_memalign((void **)&t->block, 64, k * TOPK_PAIR_BYTES))
        goto fail;
    rc = allreduce_register(ar, t->block, k * TOPK_PAIR_BYTES);
    if (rc < 0)
        goto fail;
    t->hblock = rc;
    members = allreduce_members(ar);
    rc = gather_reserve(t, members ? members : 1);
    if (rc < 0)
        goto fail;
    *out = t;
    return 0;
fail:
    topk_destroy(t);
    return rc;
}

void topk_destroy(struct topk *t)
{
    if (!t)
        return;
    if (t->hgather >= 0)
        allreduce_unregister(t->ar, t->hgather);
    if (t->hblock >= 0)
        allreduce_unregister(t->ar, t->hblock);
    free(t->gather);
    free(t->block);
    free(t->idx);
    free(t->hist);
    free(t->residual);
    free(t);
}

const float *topk_residual(const struct topk *t)
{
    return t->residual;
}


/* Selects, fills and all-gathers this member's block; checks every
 * member's indices. Sets *members. Touches neither grad nor the residual. */
static int exchange(struct topk *t, const float *grad, uint64_t round, size_t *members)
{
    size_t me, block_bytes = t->k * TOPK_PAIR_BYTES;
    int rc;

    *members = allreduce_members(t->ar);
    if (*members == 0)
        return -ESTALE;
    rc = gather_reserve(t, *members);
    if (rc < 0)
        return rc;

    select_sum(grad, t->residual, t->n, t->k, t->idx, t->hist);
    for (size_t j = 0; j < t->k; j++) {
        float v = grad[t->idx[j]] + t->residual[t->idx[j]];
        uint32_t bits;

        memcpy(&bits, &v, sizeof(bits));
        peerwire_put32(t->block + j * TOPK_PAIR_BYTES, t->idx[j]);
        peerwire_put32(t->block + j * TOPK_PAIR_BYTES + 4, bits);
    }
    rc = allreduce_gather(t->ar, t->hblock, t->hgather, block_bytes, round, members, &me);
    if (rc == -ENOSPC) {
        /* The epoch grew between the count and the call: the round is lost
         * at every member anyway; be ready for the retry. */
        rc = gather_reserve(t, *members);
        return rc < 0 ? rc : -ESTALE;
    }
    if (rc < 0)
        return rc;
    for (size_t j = 0; j < *members * t->k; j++)
        if (peerwire_get32(t->gather + j * TOPK_PAIR_BYTES) >= t->n)
            return -EPROTO;
    return 0;
}

/* The residual keeps what `grad` plus it had and the round did not send. */
static void fold_residual(struct topk *t, const float *grad)
{
    for (size_t i = 0; i < t->n; i++)
        t->residual[i] += grad[i];
    for (size_t j = 0; j < t->k; j++)
        t->residual[t->idx[j]] = 0;
}

/* out = the sum of the gathered pairs, member by member in epoch order. */
static void sum_pairs(const struct topk *t, float *out, size_t members, enum dtype_op op)
{
    size_t pairs = members * t->k;

    memset(out, 0, t->n * sizeof(float));
    for (size_t j = 0; j < pairs; j++) {
        const uint8_t *p = t->gather + j * TOPK_PAIR_BYTES;
        uint32_t bits = peerwire_get32(p + 4);
        float v;

        memcpy(&v, &bits, sizeof(v));
        out[peerwire_get32(p)] += v;
    }
    if (op == DTYPE_AVG && members > 1)
        for (size_t i = 0; i < t->n; i++)
            out[i] = out[i] / (float)members;
}

int topk_reduce(struct topk *t, float *grad, enum dtype_op op, uint64_t round)
{
    size_t members;
    int rc;

    if (!grad || (op != DTYPE_SUM && op != DTYPE_AVG))
        return -EINVAL;
    t->pending = false;
    rc = exchange(t, grad, round, &members);
    if (rc < 0)
        return rc;
    /* Committed: the residual first, while grad still holds the input. */
    fold_residual(t, grad);
    sum_pairs(t, grad, members, op);
    return 0;
}

int topk_reduce_into(struct topk *t, const float *in, float *out, enum dtype_op op, uint64_t round)
{
    size_t members;
    int rc;

    if (!in || !out || in == out || (op != DTYPE_SUM && op != DTYPE_AVG))
        return -EINVAL;
    t->pending = false;
    rc = exchange(t, in, round, &members);
    if (rc < 0)
        return rc;
    sum_pairs(t, out, members, op);
    t->pending = true;
    return 0;
}

void topk_commit(struct topk *t, const float *in)
{
    if (!t->pending)
        return;
    fold_residual(t, in);
    t->pending = false;
}

void topk_reset(struct topk *t)
{
    memset(t->residual, 0, t->n * sizeof(float));
    t->pending = false;
}

/* src/collective/group_topk.c: see group_topk.h. */
#include "collective/group_topk.h"

#include <errno.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "engine/topk.h"
#include "engine/peerwire.h"

#define HEADER_BYTES 16u       /* u32 n, u32 k, u64 layout */

/* Segments up to this size are selected here by sorting their keys:
 * topk_select clears and scans a 64 Ki-bin histogram whatever n is, which
 * a model's many small layers (biases) would pay once each per call. */
#define SMALL_SEGMENT 1024u

struct group_topk {
    struct group *g;
    size_t n, k;                /* n = sum of sizes, k = sum of ks */
    size_t n_segments;
    size_t *starts, *sizes, *ks;  /* n_segments each */
    uint64_t layout;            /* a hash of the segments, in each header */
    uint32_t *keys;             /* the largest small segment's size */
    float *residual;            /* n */
    float *acc;                 /* n: grad + residual, then the next residual */
    uint32_t *idx;              /* k */
    uint8_t *block;             /* HEADER_BYTES + k pairs */
    size_t members;             /* in the last completed call */
};

/* FNV-1a over the segments' (size, k) as little-endian u32s: members
 * whose segments differ fail every one of them alike (each record's
 * pairs checked against our own segments could pass at one member and
 * fail at another). */
static uint64_t layout_of(const size_t *sizes, const size_t *ks, size_t n_segments)
{
    uint64_t h = 14695981039346656037ull;
    uint8_t b[8];

    for (size_t s = 0; s < n_segments; s++) {
        peerwire_put32(b, (uint32_t)sizes[s]);
        peerwire_put32(b + 4, (uint32_t)ks[s]);
        for (size_t i = 0; i < sizeof(b); i++)
            h = (h ^ b[i]) * 1099511628211ull;
    }
    return h;
}

/* The key topk_select orders by: |v|'s bits (NaN above infinity). */
static uint32_t key_of(float v)
{
    uint32_t b;

    memcpy(&b, &v, sizeof(b));
    return b & 0x7fffffffu;
}

static int key_desc(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;

    return x < y ? 1 : x > y ? -1 : 0;
}

/* topk_select's selection, exactly, for n <= SMALL_SEGMENT: the k-th
 * largest key T from sorted keys, then topk_select's own last pass (every
 * key above T, and the first entries equal to T, lowest index first). */
static void select_small(const float *x, size_t n, size_t k, uint32_t *keys, uint32_t *idx)
{
    size_t need = 0, got = 0;
    uint32_t kth;

    for (size_t i = 0; i < n; i++)
        keys[i] = key_of(x[i]);
    qsort(keys, n, sizeof(*keys), key_desc);
    kth = keys[k - 1];
    for (size_t i = 0; i < k; i++)
        need += keys[i] == kth;
    for (size_t i = 0; i < n && got < k; i++) {
        uint32_t key = key_of(x[i]);

        if (key > kth || (key == kth && need > 0)) {
            if (key == kth)
                need--;
            idx[got++] = (uint32_t)i;
        }
    }
}

static size_t block_bytes(const struct group_topk *t)
{
    return HEADER_BYTES + t->k * TOPK_PAIR_BYTES;
}

int group_topk_create(struct group *g, size_t n, size_t k, struct group_topk **out)
{
    return group_topk_create_segments(g, &n, &k, 1, out);
}

int group_topk_create_segments(struct group *g, const size_t *sizes, const size_t *ks,
                               size_t n_segments, struct group_topk **out)
{
    struct group_topk *t;
    size_t n = 0, k = 0, small = 0;

    if (!g || !out || !sizes || !ks || n_segments == 0)
        return -EINVAL;
    for (size_t s = 0; s < n_segments; s++) {
        if (ks[s] == 0 || ks[s] > sizes[s] || sizes[s] > UINT32_MAX - n)
            return -EINVAL;
        n += sizes[s];
        k += ks[s];
        if (sizes[s] <= SMALL_SEGMENT && sizes[s] > small)
            small = sizes[s];
    }
    t = calloc(1, sizeof(*t));
    if (!t)
        return -ENOMEM;
    t->g = g;
    t->n = n;
    t->k = k;
    t->n_segments = n_segments;
    t->starts = calloc(n_segments, sizeof(size_t));
    t->sizes = calloc(n_segments, sizeof(size_t));
    t->ks = calloc(n_segments, sizeof(size_t));
    t->residual = calloc(n, sizeof(float));
    t->acc = calloc(n, sizeof(float));
    t->idx = calloc(k, sizeof(uint32_t));
    t->block = calloc(1, block_bytes(t));
    t->keys = calloc(small ? small : 1, sizeof(uint32_t));
    if (!t->starts || !t->sizes || !t->ks || !t->residual || !t->acc || !t->idx ||
        !t->block || !t->keys) {
        group_topk_destroy(t);
        return -ENOMEM;
    }
    for (size_t s = 0, start = 0; s < n_segments; start += sizes[s], s++) {
        t->starts[s] = start;
        t->sizes[s] = sizes[s];
        t->ks[s] = ks[s];
    }
    t->layout = layout_of(sizes, ks, n_segments);
    *out = t;
    return 0;
}

void group_topk_destroy(struct group_topk *t)
{
    if (!t)
        return;
    free(t->starts);
    free(t->keys);
    free(t->sizes);
    free(t->ks);
    free(t->residual);
    free(t->acc);
    free(t->idx);
    free(t->block);
    free(t);
}

const float *group_topk_residual(const struct group_topk *t)
{
    return t->residual;
}

size_t group_topk_members(const struct group_topk *t)
{
    return t->members;
}

/* Checks every record of a gather (any member may lie): the same n, k
 * and layout as ours, indices ascending, and each segment's k_s pairs
 * inside that segment (the pairs of segment s are the k_s after those of
 * the segments before it, so one pass over the pairs checks it: a record
 * that moves mass from one layer to another is refused). Sets *mine to
 * our record, or NULL when the epoch that completed the call did not
 * list us. */
static int check(const struct group_topk *t, const uint8_t *recs, size_t len, const char *id,
                 size_t *members, const uint8_t **mine)
{
    size_t rec = group_record_bytes(block_bytes(t));

    if (len == 0 || len % rec != 0)
        return -EPROTO;
    *members = len / rec;
    *mine = NULL;
    for (size_t m = 0; m < *members; m++) {
        const uint8_t *r = recs + m * rec, *b = r + GROUP_ID_BYTES;

        if (peerwire_get32(b) != t->n || peerwire_get32(b + 4) != t->k ||
            peerwire_get64(b + 8) != t->layout)
            return -EPROTO;
        for (size_t s = 0, j = 0; s < t->n_segments; s++) {
            for (size_t e = j + t->ks[s]; j < e; j++) {
                uint32_t i = peerwire_get32(b + HEADER_BYTES + j * TOPK_PAIR_BYTES);

                if (i < t->starts[s] || i - t->starts[s] >= t->sizes[s] ||
                    (j > 0 && i <= peerwire_get32(b + HEADER_BYTES + (j - 1) * TOPK_PAIR_BYTES)))
                    return -EPROTO;
            }
        }
        if (strncmp((const char *)r, id, GROUP_ID_BYTES) == 0)
            *mine = b;
    }
    return 0;
}

int group_topk_reduce(struct group_topk *t, float *grad, enum dtype_op op, uint32_t timeout_ms)
{
    const void *out;
    const uint8_t *recs, *mine;
    size_t len, members, rec;
    int rc;

    if (!t || !grad || (op != DTYPE_SUM && op != DTYPE_AVG))
        return -EINVAL;
    for (size_t i = 0; i < t->n; i++)
        t->acc[i] = grad[i] + t->residual[i];
    /* Each segment's own top k_s, its indices offset by the segment's
     * start: segments follow one another, so the block stays ascending. */
    for (size_t s = 0, j = 0; s < t->n_segments; j += t->ks[s], s++) {
        if (t->sizes[s] <= SMALL_SEGMENT) {
            select_small(t->acc + t->starts[s], t->sizes[s], t->ks[s], t->keys, t->idx + j);
        } else {
            rc = topk_select(t->acc + t->starts[s], t->sizes[s], t->ks[s], t->idx + j);
            if (rc < 0)
                return rc;
        }
        for (size_t e = 0; e < t->ks[s]; e++)
            t->idx[j + e] += (uint32_t)t->starts[s];
    }
    peerwire_put32(t->block, (uint32_t)t->n);
    peerwire_put32(t->block + 4, (uint32_t)t->k);
    peerwire_put64(t->block + 8, t->layout);
    for (size_t j = 0; j < t->k; j++) {
        uint32_t bits;

        memcpy(&bits, &t->acc[t->idx[j]], sizeof(bits));
        peerwire_put32(t->block + HEADER_BYTES + j * TOPK_PAIR_BYTES, t->idx[j]);
        peerwire_put32(t->block + HEADER_BYTES + j * TOPK_PAIR_BYTES + 4, bits);
    }
    rc = group_allgather(t->g, t->block, block_bytes(t), &out, &len, timeout_ms);
    if (rc < 0)
        return rc;
    recs = out;
    rc = check(t, recs, len, group_id(t->g), &members, &mine);
    if (rc < 0)
        return rc;
    /* Our record is the block we hold: a retried call's input is the
     * same. One that differs was forged, or our id is used twice. */
    if (mine && memcmp(mine, t->block, block_bytes(t)) != 0)
        return -EPROTO;

    /* Committed. The residual keeps what was not sent: everything, when
     * the call completed without us (it was delivered to us). What we
     * sent was acc's own value, so acc - sent is exactly 0. */
    if (mine)
        for (size_t j = 0; j < t->k; j++)
            t->acc[t->idx[j]] = 0;
    memcpy(t->residual, t->acc, t->n * sizeof(float));
    memset(grad, 0, t->n * sizeof(float));
    rec = group_record_bytes(block_bytes(t));
    for (size_t m = 0; m < members; m++) {
        const uint8_t *b = recs + m * rec + GROUP_ID_BYTES + HEADER_BYTES;

        for (size_t j = 0; j < t->k; j++) {
            uint32_t bits = peerwire_get32(b + j * TOPK_PAIR_BYTES + 4);
            float v;

            memcpy(&v, &bits, sizeof(v));
            grad[peerwire_get32(b + j * TOPK_PAIR_BYTES)] += v;
        }
    }
    if (op == DTYPE_AVG && members > 1)
        for (size_t i = 0; i < t->n; i++)
            grad[i] = grad[i] / (float)members;
    t->members = members;
    return 0;
}

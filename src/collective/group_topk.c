/* src/collective/group_topk.c: see group_topk.h. */
#include "collective/group_topk.h"

#include <errno.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "engine/topk.h"

#define HEADER_BYTES 8u

struct group_topk {
    struct group *g;
    size_t n, k;
    float *residual;            /* n */
    float *acc;                 /* n: grad + residual, then the next residual */
    uint32_t *idx;              /* k */
    uint8_t *block;             /* HEADER_BYTES + k pairs */
    size_t members;             /* in the last completed call */
};

static void put_le32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    p[2] = (uint8_t)(v >> 16);
    p[3] = (uint8_t)(v >> 24);
}

static uint32_t get_le32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static size_t block_bytes(const struct group_topk *t)
{
    return HEADER_BYTES + t->k * TOPK_PAIR_BYTES;
}

int group_topk_create(struct group *g, size_t n, size_t k, struct group_topk **out)
{
    struct group_topk *t;

    if (!g || !out || k == 0 || k > n || n > UINT32_MAX)
        return -EINVAL;
    t = calloc(1, sizeof(*t));
    if (!t)
        return -ENOMEM;
    t->g = g;
    t->n = n;
    t->k = k;
    t->residual = calloc(n, sizeof(float));
    t->acc = calloc(n, sizeof(float));
    t->idx = calloc(k, sizeof(uint32_t));
    t->block = calloc(1, block_bytes(t));
    if (!t->residual || !t->acc || !t->idx || !t->block) {
        group_topk_destroy(t);
        return -ENOMEM;
    }
    *out = t;
    return 0;
}

void group_topk_destroy(struct group_topk *t)
{
    if (!t)
        return;
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

/* Checks every record of a gather (any member may lie): the same n and k
 * as ours, indices in range and ascending. Sets *mine to our record, or
 * NULL when the epoch that completed the call did not list us. */
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

        if (get_le32(b) != t->n || get_le32(b + 4) != t->k)
            return -EPROTO;
        for (size_t j = 0; j < t->k; j++) {
            uint32_t i = get_le32(b + HEADER_BYTES + j * TOPK_PAIR_BYTES);

            if (i >= t->n ||
                (j > 0 && i <= get_le32(b + HEADER_BYTES + (j - 1) * TOPK_PAIR_BYTES)))
                return -EPROTO;
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
    rc = topk_select(t->acc, t->n, t->k, t->idx);
    if (rc < 0)
        return rc;
    put_le32(t->block, (uint32_t)t->n);
    put_le32(t->block + 4, (uint32_t)t->k);
    for (size_t j = 0; j < t->k; j++) {
        uint32_t bits;

        memcpy(&bits, &t->acc[t->idx[j]], sizeof(bits));
        put_le32(t->block + HEADER_BYTES + j * TOPK_PAIR_BYTES, t->idx[j]);
        put_le32(t->block + HEADER_BYTES + j * TOPK_PAIR_BYTES + 4, bits);
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
            uint32_t bits = get_le32(b + j * TOPK_PAIR_BYTES + 4);
            float v;

            memcpy(&v, &bits, sizeof(v));
            grad[get_le32(b + j * TOPK_PAIR_BYTES)] += v;
        }
    }
    if (op == DTYPE_AVG && members > 1)
        for (size_t i = 0; i < t->n; i++)
            grad[i] = grad[i] / (float)members;
    t->members = members;
    return 0;
}

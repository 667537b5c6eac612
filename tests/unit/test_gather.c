/* tests/unit/test_gather.c: allreduce_gather, the all-gather of equal
 * blocks that top-k exchanges its pairs with. Blocks hold every byte
 * value (NaN and subnormal patterns among them, were they floats), so a
 * gather that interpreted them would show. */
#include <criterion/criterion.h>

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "engines.h"

#define TIMEOUT_MS 20000u
/* Bytes per member: small blocks go by recursive doubling, large ones
 * (over the engine's 256 KiB default in all) by the ring. */
#define SMALL_BLOCK 1024
#define LARGE_BLOCK (160 * 1024 + 4)

struct gather {
    struct engines *c;
    uint8_t *in[ENGINES_MAX], *out[ENGINES_MAX];
    size_t block, out_bytes;
    bool in_place;
    size_t members[ENGINES_MAX], index[ENGINES_MAX];
    int rc[ENGINES_MAX];
};

static void fill(uint8_t *b, size_t block, size_t member)
{
    for (size_t j = 0; j < block; j++)
        b[j] = (uint8_t)(j * 7 + member * 131 + (j >> 8));
}

static void gather_one(size_t i, void *arg)
{
    struct gather *g = arg;
    struct allreduce *ar = g->c->p[i].ar;
    int hout = allreduce_register(ar, g->out[i], g->out_bytes);
    int hin = g->in_place ? hout : allreduce_register(ar, g->in[i], g->block);

    g->rc[i] = allreduce_gather(ar, hin, hout, g->block, 1, &g->members[i], &g->index[i]);
    if (hin != hout)
        allreduce_unregister(ar, hin);
    allreduce_unregister(ar, hout);
}

static void gather_run(size_t n, size_t block, bool in_place, size_t out_blocks)
{
    struct engines c;
    struct gather g = { .c = &c, .in_place = in_place, .block = block,
                        .out_bytes = out_blocks * block };
    uint8_t *want = malloc(block);

    engines_start(&c, n, TIMEOUT_MS);
    for (size_t i = 0; i < n; i++) {
        cr_assert_eq(posix_memalign((void **)&g.in[i], 64, block), 0);
        cr_assert_eq(posix_memalign((void **)&g.out[i], 64, g.out_bytes), 0);
        memset(g.out[i], 0xee, g.out_bytes);
        fill(in_place ? g.out[i] : g.in[i], block, i);
    }
    engines_each(&c, n, gather_one, &g);
    for (size_t i = 0; i < n; i++) {
        cr_assert_eq(g.rc[i], 0, "member %zu: %d", i, g.rc[i]);
        cr_assert_eq(g.members[i], n);
        cr_assert_eq(g.index[i], i);
        for (size_t m = 0; m < n; m++) {
            fill(want, block, m);
            cr_assert_arr_eq(g.out[i] + m * block, want, block, "member %zu, block %zu", i, m);
        }
        free(g.in[i]);
        free(g.out[i]);
    }
    free(want);
    engines_stop(&c);
}

Test(allreduce, gather_places_every_block_bit_for_bit, .timeout = 120)
{
    for (size_t n = 1; n <= 4; n++)
        gather_run(n, SMALL_BLOCK, false, n + 1);
}

Test(allreduce, gather_by_the_ring, .timeout = 120)
{
    for (size_t n = 2; n <= 4; n++)
        gather_run(n, LARGE_BLOCK, false, n);
}

Test(allreduce, gather_in_place, .timeout = 120)
{
    gather_run(3, SMALL_BLOCK, true, 3);
    gather_run(3, LARGE_BLOCK, true, 3);
}

Test(allreduce, gather_refuses_bad_calls)
{
    struct engines c;
    _Alignas(8) uint8_t in[16];
    _Alignas(8) uint8_t out[16];
    size_t members = 0, index = 99;
    int hin, hout;

    engines_start(&c, 2, TIMEOUT_MS);
    hin = allreduce_register(c.p[0].ar, in, sizeof(in));
    hout = allreduce_register(c.p[0].ar, out, sizeof(out));
    cr_assert_eq(allreduce_gather(c.p[0].ar, hin, hout, 6, 1, NULL, NULL), -EINVAL);
    cr_assert_eq(allreduce_gather(c.p[0].ar, hin, hout, 32, 1, NULL, NULL), -EINVAL);
    cr_assert_eq(allreduce_gather(c.p[0].ar, hin, 77, 8, 1, NULL, NULL), -EINVAL);
    cr_assert_eq(allreduce_gather(NULL, hin, hout, 8, 1, NULL, NULL), -EINVAL);
    /* Two blocks of 12 do not fit in 16: found before anything is sent. */
    cr_assert_eq(allreduce_gather(c.p[0].ar, hin, hout, 12, 1, &members, &index), -ENOSPC);
    cr_assert_eq(members, 2);
    cr_assert_eq(index, 0);
    cr_assert_eq(allreduce_members(c.p[0].ar), 2);
    /* Not a member of the current epoch. */
    engines_adopt(&c, 2, 1);
    cr_assert_eq(allreduce_members(c.p[1].ar), 0);
    cr_assert_eq(allreduce_members(c.p[0].ar), 1);
    hin = allreduce_register(c.p[1].ar, in, sizeof(in));
    hout = allreduce_register(c.p[1].ar, out, sizeof(out));
    cr_assert_eq(allreduce_gather(c.p[1].ar, hin, hout, 8, 1, NULL, NULL), -ESTALE);
    engines_stop(&c);
}

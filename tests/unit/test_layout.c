/* tests/unit/test_layout.c: gradient layouts (accumulator/layout.h) and
 * PowerSGD by tensor shape over them. Members are engines on loopback,
 * one thread each. A buffer of per-layer matrices, each of rank <= r
 * summed over the members, comes back to float tolerance by shape, where
 * the whole-buffer view does not; the uncompressed elements come back
 * exactly; every member gets the same bytes; with integer gradients what
 * was delivered plus the errors balances the gradients; bad layouts are
 * refused. */
#include <criterion/criterion.h>

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "accumulator/layout.h"
#include "engine/powersgd.h"
#include "engines.h"
#include "fixture.h"

#define TIMEOUT_MS 20000u
#define SEED 42u
/* A 40 x 30 matrix, a bias of 40, a 25 x 64 matrix, then 77 elements no
 * tensor names. */
#define COUNT (40 * 30 + 40 + 25 * 64 + 77)

static const struct layout_shape shapes[] = {
    { .offset = 1240, .count = 1600, .rows = 25, .cols = 64 },  /* out of order on purpose */
    { .offset = 0, .count = 1200, .rows = 40, .cols = 30 },
    { .offset = 1200, .count = 40, .rows = 40, .cols = 1 },
};

Test(layout, bad_layouts_are_refused_and_nothing_is_written)
{
    struct layout *l = (struct layout *)&l, *mark = l;
    static struct layout_shape big[LAYOUT_SHAPES_MAX + 1];
    const struct layout_shape bad[][2] = {
        { { 0, 1200, 40, 30 }, { 1199, 40, 40, 1 } },   /* overlap */
        { { 0, 1200, 40, 30 }, { COUNT - 10, 11, 11, 1 } }, /* past the end */
        { { 0, 1200, 40, 31 }, { 1200, 40, 40, 1 } },   /* rows x cols is not the count */
        { { 0, 0, 0, 0 }, { 1200, 40, 40, 1 } },         /* empty */
        { { 0, 1200, 40, 30 }, { UINT64_MAX - 5, 10, 10, 1 } },     /* offset + count wraps */
        { { 0, 1200, 40, 30 }, { 1200, 0x100000000ull, 0x10000ull, 0x10000ull } },
        { { 0, 4, 1ull << 32, 1ull << 32 }, { 1200, 40, 40, 1 } },  /* rows x cols wraps */
    };

    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        cr_assert_eq(layout_make(bad[i], 2, COUNT, &l), -EINVAL, "case %zu", i);
        cr_assert_eq(l, mark, "case %zu wrote its output", i);
    }
    for (size_t i = 0; i < LAYOUT_SHAPES_MAX + 1; i++)
        big[i] = (struct layout_shape){ i, 1, 1, 1 };
    cr_assert_eq(layout_make(big, LAYOUT_SHAPES_MAX + 1, LAYOUT_SHAPES_MAX + 1, &l), -EINVAL);
    cr_assert_eq(layout_make(NULL, 1, COUNT, &l), -EINVAL);
    cr_assert_eq(l, mark);
    /* The most tensors allowed is fine; none is the whole-buffer view. */
    cr_assert_eq(layout_make(big, LAYOUT_SHAPES_MAX, LAYOUT_SHAPES_MAX, &l), 0);
    cr_assert_eq(layout_matrices(l), 0);
    cr_assert_eq(layout_plain(l), LAYOUT_SHAPES_MAX);
    layout_free(l);
    cr_assert_eq(layout_make(NULL, 0, COUNT, &l), 0);
    cr_assert_null(l);
    cr_assert_eq(layout_hash(NULL), 0);
}

Test(layout, the_hash_follows_the_matrices_only)
{
    struct layout *a, *b, *c, *d;
    struct layout_shape other[3];

    cr_assert_eq(layout_make(shapes, 3, COUNT, &a), 0);
    cr_assert_eq(layout_matrices(a), 2);
    cr_assert_eq(layout_plain(a), 40 + 77);
    /* Without the bias named, the same reduction: the same hash. */
    cr_assert_eq(layout_make(shapes, 2, COUNT, &b), 0);
    cr_assert_eq(layout_hash(a), layout_hash(b));
    memcpy(other, shapes, sizeof(other));
    other[1].rows = 30;
    other[1].cols = 40;
    cr_assert_eq(layout_make(other, 3, COUNT, &c), 0);
    cr_assert_neq(layout_hash(a), layout_hash(c));
    cr_assert_eq(layout_make(shapes, 3, COUNT + 1, &d), 0);
    cr_assert_neq(layout_hash(a), layout_hash(d));
    cr_assert_neq(layout_hash(a), 0);
    layout_free(a);
    layout_free(b);
    layout_free(c);
    layout_free(d);
}

struct run {
    struct layout_psgd *lp[ENGINES_MAX];
    struct powersgd *whole[ENGINES_MAX];
    uint64_t round;
    float in[ENGINES_MAX][COUNT], out[ENGINES_MAX][COUNT];
    int rc[ENGINES_MAX];
};

static void reduce_one(size_t i, void *arg)
{
    struct run *r = arg;

    r->rc[i] = layout_psgd_reduce_into(r->lp[i], r->in[i], r->out[i], DTYPE_SUM, r->round);
    if (r->rc[i] == 0)
        layout_psgd_commit(r->lp[i]);
}

static void reduce_whole(size_t i, void *arg)
{
    struct run *r = arg;

    r->rc[i] = powersgd_reduce_into(r->whole[i], r->in[i], r->out[i], DTYPE_SUM, r->round);
}

/* m (rows x cols, at `at`) += k u v^T, small integers from the seed. */
static void add_rank1(float *m, size_t rows, size_t cols, int k, unsigned *seed)
{
    int u[64], v[64];

    for (size_t i = 0; i < rows; i++)
        u[i] = rand_r(seed) % 7 - 3;
    for (size_t j = 0; j < cols; j++)
        v[j] = rand_r(seed) % 5 - 2;
    for (size_t i = 0; i < rows; i++)
        for (size_t j = 0; j < cols; j++)
            m[i * cols + j] += (float)(k * u[i] * v[j]);
}

/* Member m's gradient: in each matrix, m + 1 times the round's rank-1
 * integer matrix of that layer (so the members' sum has rank 1 per
 * layer, but different layers in different directions); integers
 * elsewhere. */
static void fill(float *g, size_t m, uint64_t round)
{
    unsigned s1 = (unsigned)(round * 101 + 1), s2 = (unsigned)(round * 101 + 2);

    memset(g, 0, COUNT * sizeof(float));
    add_rank1(g, 40, 30, (int)m + 1, &s1);
    add_rank1(g + 1240, 25, 64, (int)m + 1, &s2);
    for (size_t i = 1200; i < 1240; i++)
        g[i] = (float)((int)((i * 3 + m * 5 + round) % 11) - 5);
    for (size_t i = 2840; i < COUNT; i++)
        g[i] = (float)((int)((i * 7 + m * 3 + round) % 13) - 6);
}

static bool in_matrix(size_t i)
{
    return i < 1200 || (i >= 1240 && i < 2840);
}

Test(layout, per_layer_rank_one_comes_back_by_shape_and_not_whole, .timeout = 120)
{
    static struct run r;
    static float want[COUNT];
    const size_t members = 3;
    struct engines c;
    struct layout *l;
    float worst_whole = 0;

    memset(&r, 0, sizeof(r));
    engines_start(&c, members, TIMEOUT_MS);
    cr_assert_eq(layout_make(shapes, 3, COUNT, &l), 0);
    for (size_t m = 0; m < members; m++) {
        cr_assert_eq(layout_psgd_create(c.p[m].ar, l, 1, SEED, &r.lp[m]), 0);
        /* The whole-buffer view the node uses without a layout. */
        cr_assert_eq(powersgd_create(c.p[m].ar, 54, COUNT / 54, 1, SEED, &r.whole[m]), 0);
    }
    layout_free(l);     /* the reducers copied it */
    for (uint64_t k = 0; k < 3; k++) {
        memset(want, 0, sizeof(want));
        for (size_t m = 0; m < members; m++) {
            fill(r.in[m], m, k);
            for (size_t i = 0; i < COUNT; i++)
                want[i] += r.in[m][i];
        }
        r.round = 1 + 4 * k;
        engines_each(&c, members, reduce_one, &r);
        for (size_t m = 0; m < members; m++) {
            cr_assert_eq(r.rc[m], 0, "member %zu: %d", m, r.rc[m]);
            cr_assert_arr_eq(r.out[m], r.out[0], sizeof(r.out[0]), "member %zu differs", m);
        }
        for (size_t i = 0; i < COUNT; i++) {
            if (in_matrix(i))
                cr_assert_leq(fabsf(r.out[0][i] - want[i]), 1e-3f * (1 + fabsf(want[i])),
                              "round %d entry %zu: %g against %g", (int)k, i, r.out[0][i], want[i]);
            else
                cr_assert_eq(r.out[0][i], want[i], "round %d entry %zu is not exact", (int)k, i);
        }
        r.round = 1 + 4 * k + 2;
        engines_each(&c, members, reduce_whole, &r);
        for (size_t m = 0; m < members; m++)
            cr_assert_eq(r.rc[m], 0);
        for (size_t i = 0; i < 54 * (COUNT / 54); i++)
            worst_whole = fmaxf(worst_whole, fabsf(r.out[0][i] - want[i]));
    }
    cr_assert_gt(worst_whole, 1.0f, "the whole-buffer view reproduced it too (%g)", worst_whole);
    for (size_t m = 0; m < members; m++) {
        layout_psgd_destroy(r.lp[m]);
        powersgd_destroy(r.whole[m]);
    }
    engines_stop(&c);
}

/* Integer gradients of full rank over several rounds at rank 2: in every
 * round the result plus the members' new errors is the members' M + E,
 * and the uncompressed elements leave no error; so over all rounds what
 * was delivered plus the errors left is the sum of the gradients. */
Test(layout, error_feedback_balances_integer_gradients, .timeout = 120)
{
    static struct run r;
    static float prev[ENGINES_MAX][COUNT], delivered[COUNT], truth[COUNT];
    const size_t members = 2;
    unsigned seed = 7;
    struct engines c;
    struct layout *l;

    memset(&r, 0, sizeof(r));
    memset(prev, 0, sizeof(prev));
    memset(delivered, 0, sizeof(delivered));
    memset(truth, 0, sizeof(truth));
    engines_start(&c, members, TIMEOUT_MS);
    cr_assert_eq(layout_make(shapes, 3, COUNT, &l), 0);
    for (size_t m = 0; m < members; m++)
        cr_assert_eq(layout_psgd_create(c.p[m].ar, l, 2, SEED, &r.lp[m]), 0);
    layout_free(l);
    for (uint64_t k = 0; k < 6; k++) {
        for (size_t m = 0; m < members; m++)
            for (size_t i = 0; i < COUNT; i++) {
                r.in[m][i] = (float)(rand_r(&seed) % 9 - 4);
                truth[i] += r.in[m][i];
            }
        r.round = 1 + 2 * k;
        engines_each(&c, members, reduce_one, &r);
        for (size_t m = 0; m < members; m++) {
            cr_assert_eq(r.rc[m], 0);
            cr_assert_arr_eq(r.out[m], r.out[0], sizeof(r.out[0]), "member %zu differs", m);
        }
        for (size_t i = 0; i < COUNT; i++) {
            float before = 0, after = r.out[0][i];

            for (size_t m = 0; m < members; m++) {
                before += r.in[m][i] + prev[m][i];
                after += layout_psgd_error(r.lp[m])[i];
                if (!in_matrix(i))
                    cr_assert_eq(layout_psgd_error(r.lp[m])[i], 0.0f);
            }
            cr_assert_leq(fabsf(after - before), 1e-3f, "round %d entry %zu", (int)k, i);
        }
        for (size_t m = 0; m < members; m++)
            memcpy(prev[m], layout_psgd_error(r.lp[m]), sizeof(prev[m]));
        for (size_t i = 0; i < COUNT; i++)
            delivered[i] += r.out[0][i];
    }
    for (size_t i = 0; i < COUNT; i++) {
        float left = 0;

        for (size_t m = 0; m < members; m++)
            left += prev[m][i];
        cr_assert_leq(fabsf(delivered[i] + left - truth[i]), 1e-2f, "entry %zu", i);
    }
    for (size_t m = 0; m < members; m++)
        layout_psgd_destroy(r.lp[m]);
    engines_stop(&c);
}

Test(layout, bad_reducer_arguments_are_refused)
{
    struct engines c;
    struct layout *l;
    struct layout_psgd *p = NULL;
    static float in[COUNT], out[COUNT];

    engines_start(&c, 1, TIMEOUT_MS);
    cr_assert_eq(layout_make(shapes, 3, COUNT, &l), 0);
    cr_assert_eq(layout_psgd_create(c.p[0].ar, l, 0, SEED, &p), -EINVAL);
    cr_assert_eq(layout_psgd_create(c.p[0].ar, l, POWERSGD_MAX_RANK + 1, SEED, &p), -EINVAL);
    cr_assert_eq(layout_psgd_create(c.p[0].ar, NULL, 1, SEED, &p), -EINVAL);
    cr_assert_null(p);
    cr_assert_eq(layout_psgd_create(c.p[0].ar, l, 1, SEED, &p), 0);
    cr_assert_eq(layout_psgd_reduce_into(p, in, out, DTYPE_MAX, 1), -EINVAL);
    layout_psgd_destroy(p);
    layout_free(l);
    engines_stop(&c);
}

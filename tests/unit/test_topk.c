/* tests/unit/test_topk.c: top-k sparsification with error feedback. The
 * selection against a sort; then members as engines on loopback, one
 * thread each, with integer-valued gradients so that every sum is exact
 * and the expected result can be computed here in any order. */
#include <criterion/criterion.h>

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "engine/topk.h"
#include "engines.h"
#include "fixture.h"

#define TIMEOUT_MS 20000u

/* ---- selection ---- */

Test(topk, select_ties_go_to_the_lower_index)
{
    const float x[] = { 1, -5, 3, 5, 0, -3 };
    uint32_t idx[3];

    cr_assert_eq(topk_select(x, 6, 3, idx), 0);
    cr_assert_eq(idx[0], 1);
    cr_assert_eq(idx[1], 2);
    cr_assert_eq(idx[2], 3);
}

Test(topk, select_puts_nan_and_inf_first)
{
    const float x[] = { 1e30f, INFINITY, 2, NAN, -1e30f };
    uint32_t idx[2];

    cr_assert_eq(topk_select(x, 5, 2, idx), 0);
    cr_assert_eq(idx[0], 1);
    cr_assert_eq(idx[1], 3);
}

static int by_magnitude_then_index(const void *a, const void *b, void *arg)
{
    const float *x = arg;
    uint32_t i = *(const uint32_t *)a, j = *(const uint32_t *)b;
    float fi = fabsf(x[i]), fj = fabsf(x[j]);

    if (fi != fj)
        return fi > fj ? -1 : 1;
    return i < j ? -1 : 1;
}

static int cmp_u32(const void *a, const void *b)
{
    uint32_t i = *(const uint32_t *)a, j = *(const uint32_t *)b;

    return i < j ? -1 : i > j;
}

/* Against a full sort by (|x| descending, index ascending), for many k on
 * inputs full of ties, denormals and signed zeros. */
Test(topk, select_agrees_with_a_sort)
{
    enum { N = 3000 };
    static float x[N];
    static uint32_t order[N], idx[N];
    unsigned seed = 7;

    for (int trial = 0; trial < 4; trial++) {
        for (size_t i = 0; i < N; i++) {
            int v = (int)(rand_r(&seed) % 41) - 20;
            x[i] = trial == 0 ? (float)v
                 : trial == 1 ? (float)v * 1e-40f                   /* subnormal */
                 : trial == 2 ? (v == 0 ? -0.0f : (float)v * 1e3f)
                              : (float)rand_r(&seed) / 7.0f - 1e8f;
            order[i] = (uint32_t)i;
        }
        qsort_r(order, N, sizeof(order[0]), by_magnitude_then_index, x);
        for (size_t k = 1; k <= N; k += 1 + k / 3) {
            cr_assert_eq(topk_select(x, N, k, idx), 0);
            qsort(order, k, sizeof(order[0]), cmp_u32);
            cr_assert_arr_eq(idx, order, k * sizeof(idx[0]), "trial %d, k %zu", trial, k);
            qsort_r(order, N, sizeof(order[0]), by_magnitude_then_index, x);
        }
    }
}

Test(topk, bad_arguments_are_refused)
{
    float x[4] = { 1, 2, 3, 4 };
    uint32_t idx[4];
    size_t k = 99;
    struct engines c;
    struct topk *t = NULL;

    cr_assert_eq(topk_select(x, 4, 0, idx), -EINVAL);
    cr_assert_eq(topk_select(x, 4, 5, idx), -EINVAL);
    cr_assert_eq(topk_select(NULL, 4, 1, idx), -EINVAL);
    cr_assert_eq(topk_select(x, 0, 0, idx), -EINVAL);
    cr_assert_eq(topk_k_for_ratio(100, 0, &k), -EINVAL);
    cr_assert_eq(topk_k_for_ratio(100, -0.5, &k), -EINVAL);
    cr_assert_eq(topk_k_for_ratio(100, 1.5, &k), -EINVAL);
    cr_assert_eq(topk_k_for_ratio(100, NAN, &k), -EINVAL);
    cr_assert_eq(topk_k_for_ratio(0, 0.5, &k), -EINVAL);
    cr_assert_eq(k, 99);
    cr_assert_eq(topk_k_for_ratio(1000, 0.01, &k), 0);
    cr_assert_eq(k, 10);
    cr_assert_eq(topk_k_for_ratio(10, 1e-9, &k), 0);
    cr_assert_eq(k, 1);
    cr_assert_eq(topk_k_for_ratio(10, 1, &k), 0);
    cr_assert_eq(k, 10);

    engines_start(&c, 1, TIMEOUT_MS);
    cr_assert_eq(topk_create(c.p[0].ar, 4, 0, &t), -EINVAL);
    cr_assert_eq(topk_create(c.p[0].ar, 4, 5, &t), -EINVAL);
    cr_assert_eq(topk_create(NULL, 4, 1, &t), -EINVAL);
    cr_assert_null(t);
    cr_assert_eq(topk_create(c.p[0].ar, 4, 2, &t), 0);
    cr_assert_eq(topk_reduce(t, x, DTYPE_MIN, 1), -EINVAL);
    cr_assert_eq(topk_reduce(t, x, DTYPE_AVG_BY, 1), -EINVAL);
    cr_assert_eq(topk_reduce(t, NULL, DTYPE_SUM, 1), -EINVAL);
    /* Alone, k of n entries come back as they were. */
    cr_assert_eq(topk_reduce(t, x, DTYPE_SUM, 1), 0);
    cr_assert_eq(x[0], 0);
    cr_assert_eq(x[1], 0);
    cr_assert_eq(x[2], 3);
    cr_assert_eq(x[3], 4);
    cr_assert_eq(topk_residual(t)[0], 1);
    cr_assert_eq(topk_residual(t)[1], 2);
    topk_destroy(t);
    engines_stop(&c);
}

/* ---- members on loopback ---- */

#define N 257
#define K 9
#define ROUNDS 8

struct run {
    struct engines *c;
    struct topk *t[ENGINES_MAX];
    enum dtype_op op;
    uint64_t round;
    float grad[ENGINES_MAX][N];
    int rc[ENGINES_MAX];
};

static void reduce_one(size_t i, void *arg)
{
    struct run *r = arg;

    r->rc[i] = topk_reduce(r->t[i], r->grad[i], r->op, r->round);
}

static void integer_grads(float g[][N], size_t members, unsigned *seed)
{
    for (size_t m = 0; m < members; m++)
        for (size_t i = 0; i < N; i++)
            g[m][i] = (float)((int)(rand_r(seed) % 201) - 100);
}

/* Over several rounds, with integer gradients: the result is exactly the
 * sum of every member's top k of gradient + residual (computed here with
 * topk_select), the same bytes on every member, and what was sent plus
 * the residuals equals the sum of the true gradients. */
Test(topk, error_feedback_is_exact, .timeout = 120)
{
    static struct run r;
    static float truth[N], sent[N], resid[ENGINES_MAX][N], expect[N];
    const size_t members = 3;
    unsigned seed = 11;
    struct engines c;

    memset(&r, 0, sizeof(r));
    memset(truth, 0, sizeof(truth));
    memset(sent, 0, sizeof(sent));
    memset(resid, 0, sizeof(resid));
    engines_start(&c, members, TIMEOUT_MS);
    r.c = &c;
    r.op = DTYPE_SUM;
    for (size_t m = 0; m < members; m++)
        cr_assert_eq(topk_create(c.p[m].ar, N, K, &r.t[m]), 0);
    for (uint64_t round = 1; round <= ROUNDS; round++) {
        integer_grads(r.grad, members, &seed);
        memset(expect, 0, sizeof(expect));
        for (size_t m = 0; m < members; m++) {
            float acc[N];
            uint32_t idx[K];

            for (size_t i = 0; i < N; i++) {
                acc[i] = r.grad[m][i] + resid[m][i];
                truth[i] += r.grad[m][i];
            }
            cr_assert_eq(topk_select(acc, N, K, idx), 0);
            for (size_t j = 0; j < K; j++) {
                expect[idx[j]] += acc[idx[j]];
                acc[idx[j]] = 0;
            }
            memcpy(resid[m], acc, sizeof(acc));
        }
        r.round = round;
        engines_each(&c, members, reduce_one, &r);
        for (size_t m = 0; m < members; m++) {
            cr_assert_eq(r.rc[m], 0, "member %zu round %d: %d", m, (int)round, r.rc[m]);
            cr_assert_arr_eq(r.grad[m], expect, sizeof(expect), "member %zu", m);
            cr_assert_arr_eq(topk_residual(r.t[m]), resid[m], sizeof(resid[m]));
        }
        for (size_t i = 0; i < N; i++)
            sent[i] += r.grad[0][i];
    }
    for (size_t i = 0; i < N; i++) {
        float left = 0;

        for (size_t m = 0; m < members; m++)
            left += topk_residual(r.t[m])[i];
        cr_assert_eq(sent[i] + left, truth[i], "entry %zu", i);
    }
    for (size_t m = 0; m < members; m++)
        topk_destroy(r.t[m]);
    engines_stop(&c);
}

/* Non-integer values, averaged, four members: every member the same bytes. */
Test(topk, every_member_gets_the_same_bytes, .timeout = 120)
{
    static struct run r;
    const size_t members = 4;
    unsigned seed = 5;
    struct engines c;

    memset(&r, 0, sizeof(r));
    engines_start(&c, members, TIMEOUT_MS);
    r.op = DTYPE_AVG;
    for (size_t m = 0; m < members; m++)
        cr_assert_eq(topk_create(c.p[m].ar, N, K, &r.t[m]), 0);
    for (uint64_t round = 1; round <= 3; round++) {
        for (size_t m = 0; m < members; m++)
            for (size_t i = 0; i < N; i++)
                r.grad[m][i] = (float)rand_r(&seed) / (float)RAND_MAX * 3.7f - 1.9f;
        r.round = round;
        engines_each(&c, members, reduce_one, &r);
        for (size_t m = 0; m < members; m++) {
            cr_assert_eq(r.rc[m], 0);
            cr_assert_arr_eq(r.grad[m], r.grad[0], sizeof(r.grad[0]), "member %zu", m);
        }
    }
    for (size_t m = 0; m < members; m++)
        topk_destroy(r.t[m]);
    engines_stop(&c);
}

static void *reduce_first(void *arg)
{
    struct run *r = arg;

    r->rc[0] = topk_reduce(r->t[0], r->grad[0], r->op, r->round);
    return NULL;
}

/* A round that an epoch change aborts leaves the gradient and the
 * residual as they were; the retry in the new epoch gives what the round
 * would have given. Then a third member joins with a zero residual and
 * the gather grows to hold it. */
Test(topk, an_aborted_round_changes_nothing, .timeout = 120)
{
    static struct run r;
    static float grad0[N], resid0[N], resid[3][N], expect[N];
    struct engines c;
    pthread_t th;
    unsigned seed = 3;

    memset(&r, 0, sizeof(r));
    engines_start(&c, 3, TIMEOUT_MS);
    engines_adopt(&c, 2, 2);
    r.op = DTYPE_SUM;
    for (size_t m = 0; m < 3; m++)
        cr_assert_eq(topk_create(c.p[m].ar, N, K, &r.t[m]), 0);
    integer_grads(r.grad, 2, &seed);
    r.round = 1;
    engines_each(&c, 2, reduce_one, &r);
    cr_assert_eq(r.rc[0], 0);
    cr_assert_eq(r.rc[1], 0);

    /* Member 0 alone starts round 2; the epoch changes under it. */
    integer_grads(r.grad, 2, &seed);
    memcpy(grad0, r.grad[0], sizeof(grad0));
    memcpy(resid0, topk_residual(r.t[0]), sizeof(resid0));
    r.round = 2;
    r.rc[0] = 1;
    cr_assert_eq(pthread_create(&th, NULL, reduce_first, &r), 0);
    FIXTURE_WAIT_FOR(allreduce_busy(c.p[0].ar), "member 0's round never started");
    engines_adopt(&c, 3, 2);
    pthread_join(th, NULL);
    cr_assert_eq(r.rc[0], -ESTALE);
    cr_assert_arr_eq(r.grad[0], grad0, sizeof(grad0));
    cr_assert_arr_eq(topk_residual(r.t[0]), resid0, sizeof(resid0));

    /* The retry, by both, gives the round's result. */
    memset(expect, 0, sizeof(expect));
    for (size_t m = 0; m < 2; m++) {
        float acc[N];
        uint32_t idx[K];

        for (size_t i = 0; i < N; i++)
            acc[i] = r.grad[m][i] + topk_residual(r.t[m])[i];
        cr_assert_eq(topk_select(acc, N, K, idx), 0);
        for (size_t j = 0; j < K; j++) {
            expect[idx[j]] += acc[idx[j]];
            acc[idx[j]] = 0;
        }
        memcpy(resid[m], acc, sizeof(acc));
    }
    engines_each(&c, 2, reduce_one, &r);
    for (size_t m = 0; m < 2; m++) {
        cr_assert_eq(r.rc[m], 0);
        cr_assert_arr_eq(r.grad[m], expect, sizeof(expect));
        cr_assert_arr_eq(topk_residual(r.t[m]), resid[m], sizeof(resid[m]));
    }

    /* A third member joins: its residual is zero, the others keep theirs. */
    engines_adopt(&c, 4, 3);
    for (size_t i = 0; i < N; i++)
        cr_assert_eq(topk_residual(r.t[2])[i], 0);
    integer_grads(r.grad, 3, &seed);
    r.round = 3;
    engines_each(&c, 3, reduce_one, &r);
    for (size_t m = 0; m < 3; m++) {
        cr_assert_eq(r.rc[m], 0, "member %zu: %d", m, r.rc[m]);
        cr_assert_arr_eq(r.grad[m], r.grad[0], sizeof(r.grad[0]));
    }
    for (size_t m = 0; m < 3; m++)
        topk_destroy(r.t[m]);
    engines_stop(&c);
}

struct liar {
    struct run *r;
    struct allreduce *ar;
    uint8_t block[K * TOPK_PAIR_BYTES];
    uint8_t out[2 * K * TOPK_PAIR_BYTES];
    int rc;
};

static void liar_or_honest(size_t i, void *arg)
{
    struct liar *l = arg;

    if (i == 0) {
        l->r->rc[0] = topk_reduce(l->r->t[0], l->r->grad[0], DTYPE_SUM, 1);
        return;
    }
    int hin = allreduce_register(l->ar, l->block, sizeof(l->block));
    int hout = allreduce_register(l->ar, l->out, sizeof(l->out));

    l->rc = allreduce_gather(l->ar, hin, hout, sizeof(l->block), 1, NULL, NULL);
    allreduce_unregister(l->ar, hin);
    allreduce_unregister(l->ar, hout);
}

/* A member whose block names an index past the gradient fails the round
 * at the honest member, which changes nothing. */
Test(topk, a_lying_peer_changes_nothing, .timeout = 120)
{
    static struct run r;
    static struct liar l;
    static float grad0[N];
    struct engines c;
    unsigned seed = 9;

    memset(&r, 0, sizeof(r));
    memset(&l, 0, sizeof(l));
    engines_start(&c, 2, TIMEOUT_MS);
    cr_assert_eq(topk_create(c.p[0].ar, N, K, &r.t[0]), 0);
    integer_grads(r.grad, 1, &seed);
    memcpy(grad0, r.grad[0], sizeof(grad0));
    for (size_t j = 0; j < K; j++) {
        uint32_t index = j == K - 1 ? N : (uint32_t)j;
        float one = 1;

        memcpy(l.block + j * TOPK_PAIR_BYTES, &index, 4);
        memcpy(l.block + j * TOPK_PAIR_BYTES + 4, &one, 4);
    }
    l.r = &r;
    l.ar = c.p[1].ar;
    engines_each(&c, 2, liar_or_honest, &l);
    cr_assert_eq(l.rc, 0);
    cr_assert_eq(r.rc[0], -EPROTO);
    cr_assert_arr_eq(r.grad[0], grad0, sizeof(grad0));
    for (size_t i = 0; i < N; i++)
        cr_assert_eq(topk_residual(r.t[0])[i], 0);
    topk_destroy(r.t[0]);
    engines_stop(&c);
}

struct big {
    struct topk *t[ENGINES_MAX];
    float *grad[ENGINES_MAX];
    size_t n;
    int rc[ENGINES_MAX];
};

static void reduce_big(size_t i, void *arg)
{
    struct big *b = arg;

    b->rc[i] = topk_reduce(b->t[i], b->grad[i], DTYPE_SUM, 1);
}

/* Pairs over the engine's 256 KiB in all travel by the ring, not by
 * recursive doubling: the same exact result. */
Test(topk, large_exchanges_go_by_the_ring, .timeout = 120)
{
    enum { BIG_N = 60001, BIG_K = 15000, MEMBERS = 3 };
    struct big b = { .n = BIG_N };
    float *expect = calloc(BIG_N, sizeof(float));
    uint32_t *idx = calloc(BIG_K, sizeof(uint32_t));
    unsigned seed = 13;
    struct engines c;

    cr_assert(expect && idx);
    engines_start(&c, MEMBERS, TIMEOUT_MS);
    for (size_t m = 0; m < MEMBERS; m++) {
        b.grad[m] = malloc(BIG_N * sizeof(float));
        cr_assert(b.grad[m]);
        for (size_t i = 0; i < BIG_N; i++)
            b.grad[m][i] = (float)((int)(rand_r(&seed) % 2001) - 1000);
        cr_assert_eq(topk_select(b.grad[m], BIG_N, BIG_K, idx), 0);
        for (size_t j = 0; j < BIG_K; j++)
            expect[idx[j]] += b.grad[m][idx[j]];
        cr_assert_eq(topk_create(c.p[m].ar, BIG_N, BIG_K, &b.t[m]), 0);
    }
    engines_each(&c, MEMBERS, reduce_big, &b);
    for (size_t m = 0; m < MEMBERS; m++) {
        cr_assert_eq(b.rc[m], 0, "member %zu: %d", m, b.rc[m]);
        cr_assert_arr_eq(b.grad[m], expect, BIG_N * sizeof(float), "member %zu", m);
        topk_destroy(b.t[m]);
        free(b.grad[m]);
    }
    engines_stop(&c);
    free(expect);
    free(idx);
}

/* Members that disagree on k send blocks of different sizes: the round
 * fails at both, and neither's gradient or residual changes. */
Test(topk, members_that_disagree_on_k_change_nothing, .timeout = 120)
{
    static struct run r;
    static float g[2][N];
    struct engines c;
    unsigned seed = 19;

    memset(&r, 0, sizeof(r));
    engines_start(&c, 2, 2000);
    r.op = DTYPE_SUM;
    cr_assert_eq(topk_create(c.p[0].ar, N, K, &r.t[0]), 0);
    cr_assert_eq(topk_create(c.p[1].ar, N, K + 1, &r.t[1]), 0);
    integer_grads(r.grad, 2, &seed);
    memcpy(g, r.grad, sizeof(g));
    r.round = 1;
    engines_each(&c, 2, reduce_one, &r);
    for (size_t m = 0; m < 2; m++) {
        cr_assert_lt(r.rc[m], 0, "member %zu", m);
        cr_assert_arr_eq(r.grad[m], g[m], sizeof(g[m]));
        for (size_t i = 0; i < N; i++)
            cr_assert_eq(topk_residual(r.t[m])[i], 0);
        topk_destroy(r.t[m]);
    }
    engines_stop(&c);
}

/* ---- reduce and commit apart (the node's rounds) ---- */

struct split {
    struct topk *t[ENGINES_MAX];
    uint64_t round;
    float grad[ENGINES_MAX][N], out[ENGINES_MAX][N];
    bool commit;
    int rc[ENGINES_MAX];
};

static void reduce_split(size_t i, void *arg)
{
    struct split *s = arg;

    s->rc[i] = topk_reduce_into(s->t[i], s->grad[i], s->out[i], DTYPE_SUM, s->round);
    if (s->rc[i] == 0 && s->commit)
        topk_commit(s->t[i], s->grad[i]);
}

/* A round reduced but never committed (the node's round failed after its
 * gradient step) leaves the residual and the input as they were; reduced
 * again and committed, it gives the bytes and the residual one
 * topk_reduce gives, round after round, against a twin cohort that never
 * had the failure. A second commit changes nothing. */
Test(topk, an_uncommitted_round_leaves_the_residual, .timeout = 120)
{
    static struct split s;
    static struct run twin;
    static float before[ENGINES_MAX][N], in_copy[ENGINES_MAX][N];
    const size_t members = 2;
    unsigned seed = 5;
    struct engines c, d;

    memset(&s, 0, sizeof(s));
    memset(&twin, 0, sizeof(twin));
    engines_start(&c, members, TIMEOUT_MS);
    engines_start(&d, members, TIMEOUT_MS);
    twin.c = &d;
    twin.op = DTYPE_SUM;
    for (size_t m = 0; m < members; m++) {
        cr_assert_eq(topk_create(c.p[m].ar, N, K, &s.t[m]), 0);
        cr_assert_eq(topk_create(d.p[m].ar, N, K, &twin.t[m]), 0);
    }
    cr_assert_eq(topk_reduce_into(s.t[0], s.grad[0], s.grad[0], DTYPE_SUM, 1), -EINVAL, "in == out");
    for (uint64_t round = 1; round <= 6; round++) {
        integer_grads(s.grad, members, &seed);
        memcpy(twin.grad, s.grad, sizeof(s.grad));
        memcpy(in_copy, s.grad, sizeof(s.grad));
        for (size_t m = 0; m < members; m++)
            memcpy(before[m], topk_residual(s.t[m]), sizeof(before[m]));
        s.commit = false;
        s.round = round * 2;
        engines_each(&c, members, reduce_split, &s);
        for (size_t m = 0; m < members; m++) {
            cr_assert_eq(s.rc[m], 0);
            cr_assert_arr_eq(topk_residual(s.t[m]), before[m], sizeof(before[m]));
            cr_assert_arr_eq(s.grad[m], in_copy[m], sizeof(in_copy[m]));
        }
        s.commit = true;
        s.round = round * 2 + 1;
        engines_each(&c, members, reduce_split, &s);
        twin.round = round;
        engines_each(&d, members, reduce_one, &twin);
        for (size_t m = 0; m < members; m++) {
            cr_assert_eq(s.rc[m], 0);
            cr_assert_eq(twin.rc[m], 0);
            cr_assert_arr_eq(s.out[m], twin.grad[m], sizeof(s.out[m]), "member %zu round %d", m, (int)round);
            cr_assert_arr_eq(topk_residual(s.t[m]), topk_residual(twin.t[m]), N * sizeof(float));
            memcpy(before[m], topk_residual(s.t[m]), sizeof(before[m]));
            topk_commit(s.t[m], s.grad[m]);
            cr_assert_arr_eq(topk_residual(s.t[m]), before[m], sizeof(before[m]), "committed twice");
        }
    }
    /* A reset forgets the residual. */
    topk_reset(s.t[0]);
    for (size_t i = 0; i < N; i++)
        cr_assert_eq(topk_residual(s.t[0])[i], 0.0f);
    for (size_t m = 0; m < members; m++) {
        topk_destroy(s.t[m]);
        topk_destroy(twin.t[m]);
    }
    engines_stop(&c);
    engines_stop(&d);
}

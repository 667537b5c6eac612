/* tests/unit/test_powersgd.c: PowerSGD with error feedback. Members are
 * engines on loopback, one thread each. A gradient of rank <= r comes
 * back to float tolerance; every member's result is the same bytes; what
 * the rounds delivered plus the errors balances the gradients; an aborted
 * round changes nothing. */
#include <criterion/criterion.h>

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "engine/powersgd.h"
#include "engines.h"
#include "fixture.h"

#define TIMEOUT_MS 20000u
#define ROWS 48
#define COLS 37
#define SEED 42u

struct run {
    struct powersgd *p[ENGINES_MAX];
    enum dtype_op op;
    uint64_t round;
    float m[ENGINES_MAX][ROWS * COLS];
    int rc[ENGINES_MAX];
};

static void reduce_one(size_t i, void *arg)
{
    struct run *r = arg;

    r->rc[i] = powersgd_reduce(r->p[i], r->m[i], r->op, r->round);
}

static float uniform(unsigned *seed)
{
    return (float)rand_r(seed) / (float)RAND_MAX * 2.0f - 1.0f;
}

/* m += u v^T for random u, v. */
static void add_rank1(float *m, unsigned *seed)
{
    float u[ROWS], v[COLS];

    for (size_t i = 0; i < ROWS; i++)
        u[i] = uniform(seed);
    for (size_t j = 0; j < COLS; j++)
        v[j] = uniform(seed);
    for (size_t i = 0; i < ROWS; i++)
        for (size_t j = 0; j < COLS; j++)
            m[i * COLS + j] += u[i] * v[j];
}

static float max_abs(const float *a, size_t n)
{
    float x = 0;

    for (size_t i = 0; i < n; i++)
        x = fmaxf(x, fabsf(a[i]));
    return x;
}

/* |a - b| at most tol x max|b| everywhere. */
static void assert_close(const float *a, const float *b, size_t n, float tol)
{
    float scale = max_abs(b, n);

    for (size_t i = 0; i < n; i++)
        cr_assert_leq(fabsf(a[i] - b[i]), tol * scale, "entry %zu: %g against %g", i, a[i], b[i]);
}

Test(powersgd, bad_arguments_are_refused)
{
    struct engines c;
    struct powersgd *p = NULL;
    float m[4 * 3] = { 0 };

    engines_start(&c, 1, TIMEOUT_MS);
    cr_assert_eq(powersgd_create(c.p[0].ar, 4, 3, 0, SEED, &p), -EINVAL);
    cr_assert_eq(powersgd_create(c.p[0].ar, 4, 3, POWERSGD_MAX_RANK + 1, SEED, &p), -EINVAL);
    cr_assert_eq(powersgd_create(c.p[0].ar, 0, 3, 1, SEED, &p), -EINVAL);
    cr_assert_eq(powersgd_create(c.p[0].ar, 4, 0, 1, SEED, &p), -EINVAL);
    cr_assert_eq(powersgd_create(c.p[0].ar, SIZE_MAX / 2, 3, 1, SEED, &p), -EINVAL);
    cr_assert_eq(powersgd_create(NULL, 4, 3, 1, SEED, &p), -EINVAL);
    cr_assert_null(p);
    /* A rank above the matrix's is cut to min(rows, cols). */
    cr_assert_eq(powersgd_create(c.p[0].ar, 4, 3, 8, SEED, &p), 0);
    cr_assert_eq(powersgd_rank(p), 3);
    cr_assert_eq(powersgd_reduce(p, m, DTYPE_MAX, 1), -EINVAL);
    cr_assert_eq(powersgd_reduce(p, m, DTYPE_AVG_BY, 1), -EINVAL);
    cr_assert_eq(powersgd_reduce(p, NULL, DTYPE_AVG, 1), -EINVAL);
    powersgd_destroy(p);
    engines_stop(&c);
}

/* A block refuses matrices outside its buffer, overlapping or out of
 * order, and sizes that overflow, holding nothing after; a good one lays
 * P and Q out matrix after matrix, each at min(rank, rows, cols). */
Test(powersgd, a_block_refuses_bad_shapes_and_lays_out_good_ones)
{
    const struct powersgd_shape good[] = { { 2, 4, 3 }, { 14, 5, 6 } };
    const struct powersgd_shape overlap[] = { { 0, 4, 3 }, { 11, 2, 2 } };
    const struct powersgd_shape backwards[] = { { 20, 2, 2 }, { 0, 2, 2 } };
    const struct powersgd_shape outside[] = { { 40, 2, 2 } };
    const struct powersgd_shape empty[] = { { 0, 0, 3 } };
    const struct powersgd_shape huge[] = { { 0, SIZE_MAX / 2, 3 } };
    struct powersgd_block b;

    cr_assert_eq(powersgd_block_init(&b, overlap, 2, 2, 64, 0, SEED), -EINVAL);
    cr_assert_null(b.mats);
    cr_assert_eq(powersgd_block_init(&b, backwards, 2, 2, 64, 0, SEED), -EINVAL);
    cr_assert_eq(powersgd_block_init(&b, outside, 1, 2, 43, 0, SEED), -EINVAL);
    cr_assert_eq(powersgd_block_init(&b, empty, 1, 2, 64, 0, SEED), -EINVAL);
    cr_assert_eq(powersgd_block_init(&b, huge, 1, 2, SIZE_MAX, 0, SEED), -EINVAL);
    cr_assert_eq(powersgd_block_init(&b, good, 2, 0, 64, 0, SEED), -EINVAL);
    cr_assert_eq(powersgd_block_init(&b, good, 2, POWERSGD_MAX_RANK + 1, 64, 0, SEED), -EINVAL);
    cr_assert_eq(powersgd_block_init(&b, good, 2, 2, 64, SIZE_MAX, SEED), -EINVAL);
    cr_assert_null(b.mats);
    cr_assert_null(b.err);

    cr_assert_eq(powersgd_block_init(&b, good, 2, 4, 44, 7, SEED), 0);
    cr_assert_eq(b.mats[0].r, 3);
    cr_assert_eq(b.mats[1].r, 4);
    cr_assert_eq(b.mats[1].p_at, 4 * 3);
    cr_assert_eq(b.mats[1].q_at, 3 * 3);
    cr_assert_eq(b.np, 4 * 3 + 5 * 4);
    cr_assert_eq(b.nq, 3 * 3 + 6 * 4);
    cr_assert_eq(b.q_extra, 7);
    cr_assert_eq(b.p_len, b.np);
    cr_assert_eq(b.q_len, b.nq + 7);
    /* The seeded Qs are the single reducer's stream, end to end. */
    {
        float want[3 * 3 + 6 * 4];

        powersgd_seed_q(want, b.nq, SEED);
        cr_assert_arr_eq(b.q_seed, want, sizeof(want));
        cr_assert_arr_eq(b.q_warm, want, sizeof(want));
    }
    powersgd_block_cleanup(&b);
    cr_assert_null(b.mats);
    powersgd_block_cleanup(&b);         /* twice is fine */
    /* No matrix: P and Q still one float each, for a caller whose
     * all-reduces run all the same. */
    cr_assert_eq(powersgd_block_init(&b, NULL, 0, 1, 10, 0, SEED), 0);
    cr_assert_eq(b.np + b.nq, 0);
    cr_assert_eq(b.p_len, 1);
    cr_assert_eq(b.q_len, 1);
    powersgd_block_cleanup(&b);
}

/* Full rank: a square matrix at rank = its size comes back whole. */
Test(powersgd, full_rank_alone_is_the_identity)
{
    struct engines c;
    struct powersgd *p;
    float m[5 * 5], orig[5 * 5];
    unsigned seed = 1;

    engines_start(&c, 1, TIMEOUT_MS);
    for (size_t i = 0; i < 25; i++)
        orig[i] = m[i] = uniform(&seed);
    cr_assert_eq(powersgd_create(c.p[0].ar, 5, 5, 5, SEED, &p), 0);
    cr_assert_eq(powersgd_reduce(p, m, DTYPE_AVG, 1), 0);
    assert_close(m, orig, 25, 1e-4f);
    powersgd_destroy(p);
    engines_stop(&c);
}

/* Three members with different rank-1 gradients: their mean has rank
 * <= 3, and rank 3 reproduces it; every member has the same bytes, and
 * each one's gradient lies in the shared subspace, so its error is ~0.
 * A rank below the mean's does not reproduce it (the check can fail). */
Test(powersgd, reproduces_a_gradient_of_rank_at_most_r, .timeout = 120)
{
    static struct run r;
    static float mean[ROWS * COLS], mine[ENGINES_MAX][ROWS * COLS];
    const size_t members = 3;
    unsigned seed = 17;
    struct engines c;

    for (size_t rank = 3; rank >= 2; rank--) {
        memset(&r, 0, sizeof(r));
        memset(mean, 0, sizeof(mean));
        engines_start(&c, members, TIMEOUT_MS);
        r.op = DTYPE_AVG;
        r.round = 1;
        for (size_t m = 0; m < members; m++) {
            cr_assert_eq(powersgd_create(c.p[m].ar, ROWS, COLS, rank, SEED, &r.p[m]), 0);
            add_rank1(r.m[m], &seed);
            memcpy(mine[m], r.m[m], sizeof(mine[m]));
            for (size_t i = 0; i < ROWS * COLS; i++)
                mean[i] += r.m[m][i] / (float)members;
        }
        engines_each(&c, members, reduce_one, &r);
        for (size_t m = 0; m < members; m++) {
            cr_assert_eq(r.rc[m], 0);
            cr_assert_arr_eq(r.m[m], r.m[0], sizeof(r.m[0]), "member %zu", m);
        }
        if (rank == 3) {
            assert_close(r.m[0], mean, ROWS * COLS, 1e-4f);
            for (size_t m = 0; m < members; m++)
                for (size_t i = 0; i < ROWS * COLS; i++)
                    cr_assert_leq(fabsf(powersgd_error(r.p[m])[i]),
                                  1e-4f * max_abs(mine[m], ROWS * COLS));
        } else {
            float worst = 0;

            for (size_t i = 0; i < ROWS * COLS; i++)
                worst = fmaxf(worst, fabsf(r.m[0][i] - mean[i]));
            cr_assert_gt(worst, 1e-2f * max_abs(mean, ROWS * COLS));
        }
        for (size_t m = 0; m < members; m++)
            powersgd_destroy(r.p[m]);
        engines_stop(&c);
    }
}

/* Full-rank noise over several rounds (warm start, error fed back), four
 * members: the same bytes everywhere every round, and in every round the
 * result plus the members' new errors is the members' M + E (to float
 * tolerance), so over all rounds what was delivered plus the errors left
 * is the sum of the gradients. */
Test(powersgd, every_member_gets_the_same_bytes, .timeout = 120)
{
    static struct run r;
    static float prev_err[ENGINES_MAX][ROWS * COLS], input[ENGINES_MAX][ROWS * COLS];
    static float delivered[ROWS * COLS], truth[ROWS * COLS];
    const size_t members = 4;
    unsigned seed = 23;
    struct engines c;

    memset(&r, 0, sizeof(r));
    memset(prev_err, 0, sizeof(prev_err));
    memset(delivered, 0, sizeof(delivered));
    memset(truth, 0, sizeof(truth));
    engines_start(&c, members, TIMEOUT_MS);
    r.op = DTYPE_SUM;
    for (size_t m = 0; m < members; m++)
        cr_assert_eq(powersgd_create(c.p[m].ar, ROWS, COLS, 2, SEED, &r.p[m]), 0);
    for (uint64_t round = 1; round <= 6 * POWERSGD_ROUNDS; round += POWERSGD_ROUNDS) {
        for (size_t m = 0; m < members; m++)
            for (size_t i = 0; i < ROWS * COLS; i++) {
                input[m][i] = r.m[m][i] = uniform(&seed);
                truth[i] += input[m][i];
            }
        r.round = round;
        engines_each(&c, members, reduce_one, &r);
        for (size_t m = 0; m < members; m++) {
            cr_assert_eq(r.rc[m], 0);
            cr_assert_arr_eq(r.m[m], r.m[0], sizeof(r.m[0]), "member %zu", m);
        }
        for (size_t i = 0; i < ROWS * COLS; i++) {
            float before = 0, after = r.m[0][i];

            for (size_t m = 0; m < members; m++) {
                before += input[m][i] + prev_err[m][i];
                after += powersgd_error(r.p[m])[i];
            }
            cr_assert_leq(fabsf(after - before), 1e-4f, "entry %zu", i);
        }
        for (size_t m = 0; m < members; m++)
            memcpy(prev_err[m], powersgd_error(r.p[m]), sizeof(prev_err[m]));
        for (size_t i = 0; i < ROWS * COLS; i++)
            delivered[i] += r.m[0][i];
    }
    for (size_t i = 0; i < ROWS * COLS; i++) {
        float left = 0;

        for (size_t m = 0; m < members; m++)
            left += prev_err[m][i];
        cr_assert_leq(fabsf(delivered[i] + left - truth[i]), 1e-3f, "entry %zu", i);
    }
    for (size_t m = 0; m < members; m++)
        powersgd_destroy(r.p[m]);
    engines_stop(&c);
}

struct twin {
    struct powersgd *p;
    float *m;
    uint64_t round;
    int rc;
};

static void *reduce_twin(void *arg)
{
    struct twin *t = arg;

    t->rc = powersgd_reduce(t->p, t->m, DTYPE_AVG, t->round);
    return NULL;
}

/* Each member has two reducers with the same seed and history; one of
 * member 0's has a round aborted by an epoch change, which leaves its
 * input and error as they were, and its retry then gives the same bytes
 * as the twin that never failed (so the warm start did not move either). */
Test(powersgd, an_aborted_round_changes_nothing, .timeout = 120)
{
    static struct run a, b;
    static float m0[ROWS * COLS], e0[ROWS * COLS];
    struct engines c;
    struct twin t;
    pthread_t th;
    unsigned seed = 31;

    memset(&a, 0, sizeof(a));
    memset(&b, 0, sizeof(b));
    engines_start(&c, 2, TIMEOUT_MS);
    a.op = b.op = DTYPE_AVG;
    for (size_t m = 0; m < 2; m++) {
        cr_assert_eq(powersgd_create(c.p[m].ar, ROWS, COLS, 2, SEED, &a.p[m]), 0);
        cr_assert_eq(powersgd_create(c.p[m].ar, ROWS, COLS, 2, SEED, &b.p[m]), 0);
    }
    /* One completed round each, so error and warm start are not trivial. */
    for (size_t m = 0; m < 2; m++)
        for (size_t i = 0; i < ROWS * COLS; i++)
            a.m[m][i] = b.m[m][i] = uniform(&seed);
    a.round = 1;
    engines_each(&c, 2, reduce_one, &a);
    b.round = 3;
    engines_each(&c, 2, reduce_one, &b);
    cr_assert_eq(a.rc[0] | a.rc[1] | b.rc[0] | b.rc[1], 0);
    cr_assert_arr_eq(a.m[0], b.m[0], sizeof(a.m[0]));

    for (size_t m = 0; m < 2; m++)
        for (size_t i = 0; i < ROWS * COLS; i++)
            a.m[m][i] = b.m[m][i] = uniform(&seed);
    memcpy(m0, a.m[0], sizeof(m0));
    memcpy(e0, powersgd_error(a.p[0]), sizeof(e0));
    t = (struct twin){ .p = a.p[0], .m = a.m[0], .round = 5, .rc = 1 };
    cr_assert_eq(pthread_create(&th, NULL, reduce_twin, &t), 0);
    FIXTURE_WAIT_FOR(allreduce_busy(c.p[0].ar), "member 0's round never started");
    engines_adopt(&c, 2, 2);
    pthread_join(th, NULL);
    cr_assert_eq(t.rc, -ESTALE);
    cr_assert_arr_eq(a.m[0], m0, sizeof(m0));
    cr_assert_arr_eq(powersgd_error(a.p[0]), e0, sizeof(e0));

    a.round = 7;
    engines_each(&c, 2, reduce_one, &a);
    b.round = 9;
    engines_each(&c, 2, reduce_one, &b);
    for (size_t m = 0; m < 2; m++) {
        cr_assert_eq(a.rc[m], 0);
        cr_assert_eq(b.rc[m], 0);
        cr_assert_arr_eq(a.m[m], b.m[m], sizeof(a.m[m]));
        cr_assert_arr_eq(powersgd_error(a.p[m]), powersgd_error(b.p[m]), sizeof(e0));
    }
    for (size_t m = 0; m < 2; m++) {
        powersgd_destroy(a.p[m]);
        powersgd_destroy(b.p[m]);
    }
    engines_stop(&c);
}

/* A NaN in one member's gradient shows in every member's result, and
 * leaves every member's error as it was (not NaN for good); the next
 * finite round is as if the NaN round had not happened. */
Test(powersgd, a_nan_step_is_dropped_not_remembered, .timeout = 120)
{
    static struct run r;
    static float e[2][ROWS * COLS];
    struct engines c;
    unsigned seed = 41;

    memset(&r, 0, sizeof(r));
    engines_start(&c, 2, TIMEOUT_MS);
    r.op = DTYPE_AVG;
    for (size_t m = 0; m < 2; m++) {
        cr_assert_eq(powersgd_create(c.p[m].ar, ROWS, COLS, 2, SEED, &r.p[m]), 0);
        for (size_t i = 0; i < ROWS * COLS; i++)
            r.m[m][i] = uniform(&seed);
    }
    r.round = 1;
    engines_each(&c, 2, reduce_one, &r);
    for (size_t m = 0; m < 2; m++)
        memcpy(e[m], powersgd_error(r.p[m]), sizeof(e[m]));

    for (size_t m = 0; m < 2; m++)
        for (size_t i = 0; i < ROWS * COLS; i++)
            r.m[m][i] = uniform(&seed);
    r.m[1][7] = NAN;
    r.round = 3;
    engines_each(&c, 2, reduce_one, &r);
    for (size_t m = 0; m < 2; m++) {
        cr_assert_eq(r.rc[m], 0);
        cr_assert(isnan(r.m[m][0]), "member %zu", m);
        cr_assert_arr_eq(powersgd_error(r.p[m]), e[m], sizeof(e[m]), "member %zu", m);
    }
    for (size_t m = 0; m < 2; m++)
        for (size_t i = 0; i < ROWS * COLS; i++)
            r.m[m][i] = uniform(&seed);
    r.round = 5;
    engines_each(&c, 2, reduce_one, &r);
    for (size_t m = 0; m < 2; m++) {
        cr_assert_eq(r.rc[m], 0);
        for (size_t i = 0; i < ROWS * COLS; i++)
            cr_assert(isfinite(r.m[m][i]) && isfinite(powersgd_error(r.p[m])[i]));
    }
    for (size_t m = 0; m < 2; m++)
        powersgd_destroy(r.p[m]);
    engines_stop(&c);
}

/* Members that view their gradients with different shapes reduce factors
 * of different sizes: the round fails at both and changes nothing. */
Test(powersgd, members_that_disagree_on_the_shape_change_nothing, .timeout = 120)
{
    static struct run r;
    static float m0[2][ROWS * COLS];
    struct engines c;
    unsigned seed = 43;

    memset(&r, 0, sizeof(r));
    engines_start(&c, 2, 2000);
    r.op = DTYPE_AVG;
    cr_assert_eq(powersgd_create(c.p[0].ar, ROWS, COLS, 2, SEED, &r.p[0]), 0);
    cr_assert_eq(powersgd_create(c.p[1].ar, COLS, ROWS, 2, SEED, &r.p[1]), 0);
    for (size_t m = 0; m < 2; m++)
        for (size_t i = 0; i < ROWS * COLS; i++)
            m0[m][i] = r.m[m][i] = uniform(&seed);
    r.round = 1;
    engines_each(&c, 2, reduce_one, &r);
    for (size_t m = 0; m < 2; m++) {
        cr_assert_lt(r.rc[m], 0, "member %zu", m);
        cr_assert_arr_eq(r.m[m], m0[m], sizeof(m0[m]));
        for (size_t i = 0; i < ROWS * COLS; i++)
            cr_assert_eq(powersgd_error(r.p[m])[i], 0);
        powersgd_destroy(r.p[m]);
    }
    engines_stop(&c);
}

/* ---- reduce and commit apart (the node's rounds) ---- */

struct split {
    struct powersgd *p[ENGINES_MAX];
    uint64_t round;
    float in[ENGINES_MAX][ROWS * COLS], out[ENGINES_MAX][ROWS * COLS];
    bool commit;
    int rc[ENGINES_MAX];
};

static void reduce_split(size_t i, void *arg)
{
    struct split *s = arg;

    s->rc[i] = powersgd_reduce_into(s->p[i], s->in[i], s->out[i], DTYPE_SUM, s->round);
    if (s->rc[i] == 0 && s->commit)
        powersgd_commit(s->p[i]);
}

/* A round reduced but never committed (the node's round failed after its
 * gradient step) leaves the error and the warm start as they were: the
 * retry, committed, gives the bytes and the error one powersgd_reduce
 * gives, round after round, against a twin cohort that never had the
 * failure. A second commit changes nothing; a reset is a fresh reducer. */
Test(powersgd, an_uncommitted_round_leaves_the_error, .timeout = 120)
{
    static struct split s;
    static struct run twin;
    static float before[ENGINES_MAX][ROWS * COLS], in_copy[ENGINES_MAX][ROWS * COLS];
    const size_t members = 2;
    unsigned seed = 31;
    struct engines c, d;

    memset(&s, 0, sizeof(s));
    memset(&twin, 0, sizeof(twin));
    engines_start(&c, members, TIMEOUT_MS);
    engines_start(&d, members, TIMEOUT_MS);
    twin.op = DTYPE_SUM;
    for (size_t m = 0; m < members; m++) {
        cr_assert_eq(powersgd_create(c.p[m].ar, ROWS, COLS, 2, SEED, &s.p[m]), 0);
        cr_assert_eq(powersgd_create(d.p[m].ar, ROWS, COLS, 2, SEED, &twin.p[m]), 0);
    }
    for (uint64_t round = 1; round <= 5; round++) {
        for (size_t m = 0; m < members; m++)
            for (size_t i = 0; i < ROWS * COLS; i++)
                s.in[m][i] = twin.m[m][i] = uniform(&seed);
        memcpy(in_copy, s.in, sizeof(s.in));
        for (size_t m = 0; m < members; m++)
            memcpy(before[m], powersgd_error(s.p[m]), sizeof(before[m]));
        s.commit = false;
        s.round = round * 4;
        engines_each(&c, members, reduce_split, &s);
        for (size_t m = 0; m < members; m++) {
            cr_assert_eq(s.rc[m], 0);
            cr_assert_arr_eq(powersgd_error(s.p[m]), before[m], sizeof(before[m]));
            cr_assert_arr_eq(s.in[m], in_copy[m], sizeof(in_copy[m]));
        }
        s.commit = true;
        s.round = round * 4 + POWERSGD_ROUNDS;
        engines_each(&c, members, reduce_split, &s);
        twin.round = round * POWERSGD_ROUNDS;
        engines_each(&d, members, reduce_one, &twin);
        for (size_t m = 0; m < members; m++) {
            cr_assert_eq(s.rc[m], 0);
            cr_assert_eq(twin.rc[m], 0);
            cr_assert_arr_eq(s.out[m], twin.m[m], sizeof(s.out[m]), "member %zu round %d", m, (int)round);
            cr_assert_arr_eq(powersgd_error(s.p[m]), powersgd_error(twin.p[m]), sizeof(before[m]));
            memcpy(before[m], powersgd_error(s.p[m]), sizeof(before[m]));
            powersgd_commit(s.p[m]);
            cr_assert_arr_eq(powersgd_error(s.p[m]), before[m], sizeof(before[m]), "committed twice");
        }
    }
    /* Reset: the error is zero and the next round is a fresh reducer's. */
    for (size_t m = 0; m < members; m++) {
        powersgd_reset(s.p[m]);
        powersgd_destroy(twin.p[m]);
        cr_assert_eq(powersgd_create(d.p[m].ar, ROWS, COLS, 2, SEED, &twin.p[m]), 0);
        for (size_t i = 0; i < ROWS * COLS; i++) {
            cr_assert_eq(powersgd_error(s.p[m])[i], 0.0f);
            s.in[m][i] = twin.m[m][i] = uniform(&seed);
        }
    }
    s.round = 100;
    engines_each(&c, members, reduce_split, &s);
    twin.round = 100;
    engines_each(&d, members, reduce_one, &twin);
    for (size_t m = 0; m < members; m++) {
        cr_assert_eq(s.rc[m], 0);
        cr_assert_eq(twin.rc[m], 0);
        cr_assert_arr_eq(s.out[m], twin.m[m], sizeof(s.out[m]));
        powersgd_destroy(s.p[m]);
        powersgd_destroy(twin.p[m]);
    }
    engines_stop(&c);
    engines_stop(&d);
}

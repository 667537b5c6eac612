/* tests/unit/test_group_powersgd.c: PowerSGD with error feedback as a
 * group's collective, among groups in one process over a real broker and
 * real TCP on loopback. Every member's matrices are a function of its
 * index and the call, so the test knows every input; results must be the
 * same bytes on every member, reproduce a sum of rank <= r, and balance:
 * sum of results + every member's error = every matrix given. */
#include <criterion/criterion.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/clock.h"
#include "collective/group.h"
#include "collective/group_powersgd.h"
#include "fixture.h"
#include "groups.h"

#define ROWS 24
#define COLS 16
#define CELLS (ROWS * COLS)
#define MEMBERS 3
#define CALLS 8
#define SEED 42

static void start(void)
{
    groups_start("power");
}

TestSuite(group_powersgd, .init = start, .fini = groups_stop, .timeout = 180);

/* low: a sum of two outer products (rank 2 for every member and for any
 * sum of members); otherwise a full-rank integer matrix. */
static float matrix_of(int m, int c, size_t i, size_t j, bool low)
{
    if (low)
        return (float)((m + 1) * (int)((i % 5) + 1) * (int)((j % 3) + 1) +
                       (c + 2) * (int)((i * 7) % 4) * (int)((j * 5) % 7));
    return (float)((int)((i * 13 + j * 7 + (size_t)m * 5 + (size_t)c * 3) % 17) - 8);
}

static const struct group_powersgd_matrix one = { ROWS, COLS };

struct member {
    int index;
    struct group *g;
    struct group_powersgd *p;
    pthread_t thread;
    int from, to;
    bool low;
    enum dtype_op op;
    float result[CALLS][CELLS];
    int rc, failed_at;
};

static void *member_main(void *arg)
{
    struct member *m = arg;

    m->rc = 0;
    for (int c = m->from; c < m->to; c++) {
        float x[CELLS];

        for (size_t i = 0; i < ROWS; i++)
            for (size_t j = 0; j < COLS; j++)
                x[i * COLS + j] = matrix_of(m->index, c, i, j, m->low);
        m->rc = group_powersgd_reduce(m->p, x, m->op, 60000);
        if (m->rc < 0) {
            m->failed_at = c;
            break;
        }
        memcpy(m->result[c], x, sizeof(x));
    }
    return NULL;
}

static void member_start(struct member *m, int index, size_t rank, bool reuse)
{
    char id[16];

    snprintf(id, sizeof(id), "p-%d", index);
    memset(m, 0, sizeof(*m));
    m->index = index;
    m->op = DTYPE_SUM;
    m->g = groups_make(id);
    cr_assert_eq(group_powersgd_create(m->g, &one, 1, 0, rank, SEED, reuse, &m->p), 0);
}

static void run_calls(struct member *m, const int *who, int n, int from, int to)
{
    for (int i = 0; i < n; i++) {
        m[who[i]].from = from;
        m[who[i]].to = to;
        cr_assert_eq(pthread_create(&m[who[i]].thread, NULL, member_main, &m[who[i]]), 0);
    }
    for (int i = 0; i < n; i++) {
        pthread_join(m[who[i]].thread, NULL);
        cr_assert_eq(m[who[i]].rc, 0, "member %d, call %d: %s", who[i], m[who[i]].failed_at,
                     strerror(-m[who[i]].rc));
    }
}

static void expect_same_bytes(const struct member *a, const struct member *b, int from, int to)
{
    for (int c = from; c < to; c++)
        cr_expect_eq(memcmp(a->result[c], b->result[c], sizeof(a->result[c])), 0,
                     "call %d: members %d and %d differ", c, a->index, b->index);
}

/* sum(results) + sum(E) = sum(matrices given), up to float rounding. */
static void expect_balanced(const struct member *m, const float *const *errors, int n_err,
                            const unsigned *mask, int calls, bool low)
{
    double worst = 0, scale = 0;

    for (size_t i = 0; i < ROWS; i++)
        for (size_t j = 0; j < COLS; j++) {
            double given = 0, accounted = 0;

            for (int c = 0; c < calls; c++) {
                accounted += m->result[c][i * COLS + j];
                for (int k = 0; k < MEMBERS; k++)
                    if (mask[c] & (1u << k))
                        given += matrix_of(k, c, i, j, low);
            }
            for (int k = 0; k < n_err; k++)
                accounted += errors[k][i * COLS + j];
            worst = fmax(worst, fabs(given - accounted));
            scale = fmax(scale, fabs(given));
        }
    cr_expect_lt(worst, 1e-4 * scale + 1e-3, "error feedback: off by %g (largest entry %g)",
                 worst, scale);
}

static void finish(struct member *m, int n)
{
    for (int i = n - 1; i >= 0; i--) {
        group_powersgd_destroy(m[i].p);
        group_destroy(m[i].g);
    }
}

Test(group_powersgd, a_sum_of_rank_two_is_reproduced_the_same_on_every_member)
{
    static struct member m[MEMBERS];
    struct group *g[MEMBERS];
    const int all[MEMBERS] = { 0, 1, 2 };

    for (int i = 0; i < MEMBERS; i++) {
        member_start(&m[i], i, 2, false);
        m[i].low = true;
        m[i].op = DTYPE_AVG;
        g[i] = m[i].g;
    }
    FIXTURE_WAIT_FOR(groups_all_see(g, MEMBERS), "the members never shared an epoch");
    run_calls(m, all, MEMBERS, 0, 1);
    expect_same_bytes(&m[0], &m[1], 0, 1);
    expect_same_bytes(&m[0], &m[2], 0, 1);
    for (size_t i = 0; i < ROWS; i++)
        for (size_t j = 0; j < COLS; j++) {
            double mean = 0;

            for (int k = 0; k < MEMBERS; k++)
                mean += matrix_of(k, 0, i, j, true);
            mean /= MEMBERS;
            cr_expect(fabs(m[0].result[0][i * COLS + j] - mean) < 1e-3 * (1 + fabs(mean)),
                      "(%zu, %zu): %g, want %g", i, j, m[0].result[0][i * COLS + j], mean);
        }
    finish(m, MEMBERS);
}

Test(group_powersgd, rank_one_of_full_rank_matrices_balances_with_error_feedback)
{
    static struct member m[MEMBERS];
    struct group *g[MEMBERS];
    const int all[MEMBERS] = { 0, 1, 2 };
    unsigned mask[CALLS];
    const float *errors[MEMBERS];

    for (int i = 0; i < MEMBERS; i++) {
        member_start(&m[i], i, 1, true);
        g[i] = m[i].g;
    }
    FIXTURE_WAIT_FOR(groups_all_see(g, MEMBERS), "the members never shared an epoch");
    run_calls(m, all, MEMBERS, 0, CALLS);
    expect_same_bytes(&m[0], &m[1], 0, CALLS);
    expect_same_bytes(&m[0], &m[2], 0, CALLS);
    for (int c = 0; c < CALLS; c++)
        mask[c] = 7;
    for (int i = 0; i < MEMBERS; i++)
        errors[i] = group_powersgd_error(m[i].p);
    expect_balanced(&m[0], errors, MEMBERS, mask, CALLS, false);
    /* Rank 1 of full-rank inputs is lossy: the error holds something. */
    cr_expect_neq(errors[0][0] + errors[0][1] + errors[0][COLS], 0);
    finish(m, MEMBERS);
}

/* A third member joins with E = 0, then leaves in the middle of a call;
 * the survivors retry it on their own, with E as the failed attempt left
 * it (untouched), and the books still balance, the leaver's E included. */
Test(group_powersgd, a_join_and_a_leave_mid_call_keep_every_member_in_step)
{
    static struct member m[MEMBERS];
    static float left_err[CELLS];
    struct group *g[MEMBERS];
    const int two[2] = { 0, 1 }, all[MEMBERS] = { 0, 1, 2 };
    unsigned mask[CALLS];
    const float *errors[MEMBERS];

    member_start(&m[0], 0, 1, true);
    member_start(&m[1], 1, 1, true);
    g[0] = m[0].g;
    g[1] = m[1].g;
    FIXTURE_WAIT_FOR(groups_all_see(g, 2), "the two members never shared an epoch");
    run_calls(m, two, 2, 0, 3);
    member_start(&m[2], 2, 1, true);
    g[2] = m[2].g;
    for (size_t i = 0; i < CELLS; i++)
        cr_assert_eq(group_powersgd_error(m[2].p)[i], 0, "a joiner starts with E = 0");
    FIXTURE_WAIT_FOR(groups_all_see(g, MEMBERS), "the joiner never shared an epoch");
    run_calls(m, all, MEMBERS, 3, 5);
    expect_same_bytes(&m[0], &m[2], 3, 5);
    memcpy(left_err, group_powersgd_error(m[2].p), sizeof(left_err));
    for (int i = 0; i < 2; i++) {
        m[i].from = 5;
        m[i].to = CALLS;
        cr_assert_eq(pthread_create(&m[i].thread, NULL, member_main, &m[i]), 0);
    }
    group_powersgd_destroy(m[2].p);
    group_destroy(m[2].g);
    for (int i = 0; i < 2; i++) {
        pthread_join(m[i].thread, NULL);
        cr_assert_eq(m[i].rc, 0, "member %d, call %d: %s", i, m[i].failed_at,
                     strerror(-m[i].rc));
    }
    expect_same_bytes(&m[0], &m[1], 0, CALLS);
    for (int c = 0; c < CALLS; c++)
        mask[c] = c < 3 ? 3 : c < 5 ? 7 : 3;
    errors[0] = group_powersgd_error(m[0].p);
    errors[1] = group_powersgd_error(m[1].p);
    errors[2] = left_err;
    expect_balanced(&m[0], errors, MEMBERS, mask, CALLS, false);
    finish(m, 2);
}

/* ---- errors ---- */

Test(group_powersgd, bad_arguments_are_refused_and_alone_full_rank_is_exact)
{
    struct group *g = groups_make("bad");
    struct group_powersgd *p = NULL;
    struct group_powersgd_matrix m23 = { 2, 3 }, zero_rows = { 0, 3 }, zero_cols = { 2, 0 },
                                 huge = { SIZE_MAX / 2, 3 };
    /* A 2 x 3 matrix, then 2 floats of vectors. */
    float x[8] = { 1, 2, 3, 4, 5, 7, -2, 9 }, e;

    cr_expect_eq(group_powersgd_create(NULL, &m23, 1, 0, 1, SEED, false, &p), -EINVAL);
    cr_expect_eq(group_powersgd_create(g, &m23, 1, 0, 0, SEED, false, &p), -EINVAL);
    cr_expect_eq(group_powersgd_create(g, &zero_rows, 1, 0, 1, SEED, false, &p), -EINVAL);
    cr_expect_eq(group_powersgd_create(g, &zero_cols, 1, 0, 1, SEED, false, &p), -EINVAL);
    cr_expect_eq(group_powersgd_create(g, &m23, 1, 0, 100000, SEED, false, &p), -EINVAL);
    cr_expect_eq(group_powersgd_create(g, &huge, 1, 0, 1, SEED, false, &p), -EINVAL);
    cr_expect_eq(group_powersgd_create(g, NULL, 0, 0, 1, SEED, false, &p), -EINVAL);
    cr_expect_eq(group_powersgd_create(g, NULL, 1, 0, 1, SEED, false, &p), -EINVAL);
    cr_expect_null(p);
    cr_assert_eq(group_powersgd_create(g, &m23, 1, 2, 5, SEED, false, &p), 0);
    cr_expect_eq(group_powersgd_size(p), 8);
    cr_expect_eq(group_powersgd_reduce(p, NULL, DTYPE_SUM, 1000), -EINVAL);
    cr_expect_eq(group_powersgd_reduce(p, x, DTYPE_MAX, 1000), -EINVAL);
    cr_expect(x[0] == 1 && x[7] == 9, "the buffer is untouched");
    cr_assert_eq(group_wait(g, FIXTURE_WAIT_MS), 0);
    /* Alone, with the rank capped at min(2, 3): the matrix comes back
     * (up to rounding), the vectors exactly. */
    cr_assert_eq(group_powersgd_reduce(p, x, DTYPE_AVG, 20000), 0);
    for (int i = 0; i < 8; i++) {
        float want = (const float[]){ 1, 2, 3, 4, 5, 7, -2, 9 }[i];

        cr_expect(fabsf(x[i] - want) < 1e-4f, "entry %d: %g", i, x[i]);
        e = group_powersgd_error(p)[i];
        cr_expect(fabsf(e + x[i] - want) < 1e-5f, "entry %d: result + error %g", i, e + x[i]);
    }
    cr_expect(x[6] == -2 && x[7] == 9 && group_powersgd_error(p)[7] == 0, "vectors: exact");
    group_powersgd_destroy(p);
    group_destroy(g);
}

struct mismatch {
    struct group *g;
    struct group_powersgd *p;
    size_t cols;
    float x[64];
    int rc;
};

static void *mismatch_main(void *arg)
{
    struct mismatch *a = arg;

    for (size_t i = 0; i < 64; i++)
        a->x[i] = (float)i;
    a->rc = group_powersgd_reduce(a->p, a->x, DTYPE_AVG, 60000);
    return NULL;
}

Test(group_powersgd, matrices_of_different_shapes_get_eproto_and_change_nothing)
{
    struct mismatch a[2] = { { .cols = 8 }, { .cols = 6 } };
    struct group *g[2];
    pthread_t th[2];

    a[0].g = g[0] = groups_make("x-0");
    a[1].g = g[1] = groups_make("x-1");
    for (int i = 0; i < 2; i++)
        cr_assert_eq(group_powersgd_create(a[i].g,
                                           &(struct group_powersgd_matrix){ 4, a[i].cols }, 1,
                                           0, 1, SEED, true, &a[i].p), 0);
    FIXTURE_WAIT_FOR(groups_all_see(g, 2), "the two members never shared an epoch");
    for (int i = 0; i < 2; i++)
        cr_assert_eq(pthread_create(&th[i], NULL, mismatch_main, &a[i]), 0);
    for (int i = 0; i < 2; i++)
        pthread_join(th[i], NULL);
    for (int i = 0; i < 2; i++) {
        cr_expect_eq(a[i].rc, -EPROTO, "member %d: %s", i, strerror(-a[i].rc));
        for (size_t j = 0; j < 4 * a[i].cols; j++) {
            cr_expect_eq(a[i].x[j], (float)j, "member %d's matrix, entry %zu", i, j);
            cr_expect_eq(group_powersgd_error(a[i].p)[j], 0, "member %d's error", i);
        }
        group_powersgd_destroy(a[i].p);
    }
    group_destroy(g[1]);
    group_destroy(g[0]);
}

/* ---- churn: joins and leaves while the others make calls ----
 *
 * One 24 x 16 matrix and 6 vector floats, which travel exactly: vector 0..3
 * carry member j's marker 2^j, 4 the caller's call number, 5 a first
 * call. A result's markers tell whose inputs it holds; every call number
 * must have one result, the same bytes on every member that has it. A
 * call that completed without this member (delivered) must leave its
 * whole input in its error. */
#define CHURN_CALLS 400
#define VEC 6

static const struct group_powersgd_matrix churn_mat = { ROWS, COLS };

struct churner {
    int index;
    struct group *g;
    struct group_powersgd *p;
    pthread_t thread;
    _Atomic long long stop_at, last;
    atomic_int made;
    uint32_t crc[CHURN_CALLS];
    long long callno[CHURN_CALLS];
    int failures;
    char why[200];
};

static uint32_t crc_of(const float *x, size_t n)
{
    uint32_t h = 2166136261u;
    const unsigned char *b = (const unsigned char *)x;

    for (size_t i = 0; i < n * sizeof(float); i++)
        h = (h ^ b[i]) * 16777619u;
    return h | 1;
}

static void churn_fail(struct churner *m, const char *why, long long k)
{
    if (m->failures++ == 0)
        snprintf(m->why, sizeof(m->why), "call %lld: %s", k, why);
}

static void *churner_main(void *arg)
{
    struct churner *m = arg;
    float x[CELLS + VEC], acc[CELLS + VEC];
    long long k = 0;
    bool first = true;

    for (int c = 0;; c++) {
        float *v = x + CELLS;
        int pop = 0, fresh, known;
        unsigned mask = 0;
        long long sum;
        int rc;

        for (size_t i = 0; i < ROWS; i++)
            for (size_t j = 0; j < COLS; j++)
                x[i * COLS + j] = matrix_of(m->index, c % CALLS, i, j, false);
        memset(v, 0, VEC * sizeof(float));
        v[m->index] = (float)(1 << m->index);
        v[4] = (float)k;
        v[5] = first;
        for (size_t i = 0; i < CELLS + VEC; i++)
            acc[i] = x[i] + group_powersgd_error(m->p)[i];
        rc = group_powersgd_reduce(m->p, x, DTYPE_SUM, 60000);
        if (rc < 0) {
            churn_fail(m, strerror(-rc), k);
            break;
        }
        for (int j = 0; j < 4; j++)
            if (v[j] == (float)(1 << j)) {
                mask |= 1u << j;
                pop++;
            } else if (v[j] != 0) {
                churn_fail(m, "a marker is wrong", k);
            }
        fresh = (int)v[5];
        known = pop - fresh;
        sum = (long long)v[4];
        if (first) {
            k = known ? sum / known : 1;
            first = false;
        } else if (sum != k * known) {
            churn_fail(m, "the contributors made different calls", k);
        }
        if (!(mask & (1u << m->index)) &&
            memcmp(acc, group_powersgd_error(m->p), sizeof(acc)) != 0)
            churn_fail(m, "completed without it, yet its error is not its whole input", k);
        if ((mask & (1u << m->index)) && group_powersgd_error(m->p)[CELLS] != 0)
            churn_fail(m, "its vectors were sent, yet its error holds them", k);
        m->crc[k % CHURN_CALLS] = crc_of(x, CELLS + VEC);
        m->callno[k % CHURN_CALLS] = k;
        atomic_store(&m->last, k);
        atomic_fetch_add(&m->made, 1);
        if (k >= atomic_load(&m->stop_at))
            break;
        k++;
        clock_sleep_ms(1);
    }
    return NULL;
}

static void churner_start(struct churner *m, int index)
{
    char id[16];

    snprintf(id, sizeof(id), "ch-%d", index);
    memset(m, 0, sizeof(*m));
    m->index = index;
    atomic_store(&m->stop_at, LLONG_MAX);
    m->g = groups_make(id);
    cr_assert_eq(group_powersgd_create(m->g, &churn_mat, 1, VEC, 2, SEED, true, &m->p), 0);
    cr_assert_eq(pthread_create(&m->thread, NULL, churner_main, m), 0);
}

static void expect_one_result_per_call(const struct churner *a, const struct churner *b)
{
    int shared = 0;

    for (int i = 0; i < CHURN_CALLS; i++)
        if (a->callno[i] && a->callno[i] == b->callno[i]) {
            shared++;
            cr_expect_eq(a->crc[i], b->crc[i], "call %lld: members %d and %d differ",
                         a->callno[i], a->index, b->index);
        }
    cr_expect_gt(shared, 0, "members %d and %d shared no call", a->index, b->index);
}

Test(group_powersgd, joins_and_leaves_mid_call_keep_one_result_per_call)
{
    static struct churner m[3];

    churner_start(&m[0], 0);
    churner_start(&m[1], 1);
    FIXTURE_WAIT_FOR(atomic_load(&m[0].made) >= 5, "the first calls");
    for (int cycle = 0; cycle < 3; cycle++) {
        churner_start(&m[2], 2);
        FIXTURE_WAIT_FOR(atomic_load(&m[2].made) >= 5, "cycle %d: the joiner's calls", cycle);
        atomic_store(&m[2].stop_at, atomic_load(&m[2].last) + 2);
        pthread_join(m[2].thread, NULL);
        cr_expect_eq(m[2].failures, 0, "cycle %d: %s", cycle, m[2].why);
        expect_one_result_per_call(&m[0], &m[2]);
        group_powersgd_destroy(m[2].p);
        group_destroy(m[2].g);
        FIXTURE_WAIT_FOR(atomic_load(&m[0].last) >= atomic_load(&m[2].last) + 3,
                         "cycle %d: the survivors' calls", cycle);
    }
    for (int i = 0; i < 2; i++)
        atomic_store(&m[i].stop_at, atomic_load(&m[0].last) + 3);
    for (int i = 0; i < 2; i++) {
        pthread_join(m[i].thread, NULL);
        cr_expect_eq(m[i].failures, 0, "member %d: %s", i, m[i].why);
    }
    expect_one_result_per_call(&m[0], &m[1]);
    for (int i = 1; i >= 0; i--) {
        group_powersgd_destroy(m[i].p);
        group_destroy(m[i].g);
    }
}

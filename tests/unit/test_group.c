/* tests/unit/test_group.c: collectives among groups in one process, over a
 * real broker and real TCP on loopback. Inputs are small integers, so every
 * result is checked exactly against a reference computed here; the sum of
 * one-hot member bits tells exactly whose inputs a result holds. */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/clock.h"
#include "cohort.h"
#include "collective/group.h"
#include "fixture.h"
#include "groups.h"

#define MAXN 4
#define CALLS_MAX 400

static void start(void)
{
    groups_start("coll");
}

TestSuite(group, .init = start, .fini = groups_stop, .timeout = 180);

/* ---- every type and operator, against a reference ---- */

#define ELEMS 1031              /* a prime, not a multiple of anything */

struct ops_member {
    int index, n;
    struct group *g;
    pthread_t t;
    int failures;
    char why[160];
};

static double input_of(int member, size_t i, int salt)
{
    /* Small signed integers, distinct per member, exact in every type. */
    return (double)((int)((member * 7 + (int)i * 3 + salt) % 23) - 11);
}

static void fail(struct ops_member *m, const char *fmt, const char *what, size_t i, double got,
                 double want)
{
    if (m->failures++ == 0)
        snprintf(m->why, sizeof(m->why), fmt, what, i, got, want);
}

/* The reference result, computed in the type's own arithmetic: the sum
 * of small integers is exact in all of them, the division is not. */
static double reference(int n, enum dtype_op op, size_t i, int salt, double denom, enum dtype ty)
{
    bool integer = dtype_is_int(ty);
    double acc = input_of(0, i, salt);

    for (int k = 1; k < n; k++) {
        double v = input_of(k, i, salt);
        if (op == DTYPE_MIN)
            acc = v < acc ? v : acc;
        else if (op == DTYPE_MAX)
            acc = v > acc ? v : acc;
        else
            acc += v;
    }
    if (op == DTYPE_AVG || op == DTYPE_AVG_BY) {
        double dv = op == DTYPE_AVG ? n : denom;
        acc = integer ? trunc(acc / dv) : ty == DTYPE_F32 ? (double)((float)acc / (float)dv)
                                                          : acc / dv;
    }
    return acc;
}

static void *ops_main(void *arg)
{
    static const enum dtype types[] = { DTYPE_F32, DTYPE_F64, DTYPE_I32, DTYPE_I64 };
    static const enum dtype_op ops[] = { DTYPE_SUM, DTYPE_AVG, DTYPE_MIN, DTYPE_MAX, DTYPE_AVG_BY };
    struct ops_member *m = arg;
    union { float f[ELEMS]; double d[ELEMS]; int32_t i[ELEMS]; int64_t l[ELEMS]; } buf;
    int salt = 0;

    for (size_t t = 0; t < sizeof(types) / sizeof(types[0]); t++) {
        for (size_t o = 0; o < sizeof(ops) / sizeof(ops[0]); o++) {
            for (unsigned flags = 0; flags <= GROUP_DIVIDE_BEFORE; flags++) {
                enum dtype ty = types[t];
                bool integer = dtype_is_int(ty);
                double denom = 4;
                int rc;

                if (flags && (integer || (ops[o] != DTYPE_AVG && ops[o] != DTYPE_AVG_BY)))
                    continue;
                salt++;
                for (size_t i = 0; i < ELEMS; i++) {
                    double v = input_of(m->index, i, salt);
                    switch (ty) {
                    case DTYPE_F32: buf.f[i] = (float)v; break;
                    case DTYPE_F64: buf.d[i] = v; break;
                    case DTYPE_I32: buf.i[i] = (int32_t)v; break;
                    default: buf.l[i] = (int64_t)v; break;
                    }
                }
                rc = group_allreduce(m->g, &buf, ELEMS, ty, ops[o], denom, flags, 60000);
                if (rc != 0) {
                    if (m->failures++ == 0)
                        snprintf(m->why, sizeof(m->why), "%s %s: the call failed: %s",
                                 dtype_name(ty), dtype_op_name(ops[o]), strerror(-rc));
                    return NULL;
                }
                for (size_t i = 0; i < ELEMS; i++) {
                    double want = reference(m->n, ops[o], i, salt, denom, ty);
                    double got = ty == DTYPE_F32   ? buf.f[i]
                                 : ty == DTYPE_F64 ? buf.d[i]
                                 : ty == DTYPE_I32 ? buf.i[i]
                                                   : (double)buf.l[i];
                    /* Dividing first rounds each share: a float's last bits. */
                    double tol = flags ? 1e-5 * (fabs(want) + 1) : 0;
                    if (fabs(got - want) > tol) {
                        fail(m, "%s: element %zu is %g, not %g", dtype_name(ty), i, got, want);
                        break;
                    }
                }
            }
        }
    }
    return NULL;
}

Test(group, every_type_and_op_matches_the_reference)
{
    struct ops_member m[3];
    char id[16];

    for (int i = 0; i < 3; i++) {
        snprintf(id, sizeof(id), "m-%d", i);
        m[i] = (struct ops_member){ .index = i, .n = 3, .g = groups_make(id) };
    }
    for (int i = 0; i < 3; i++)
        cr_assert_eq(group_wait(m[i].g, FIXTURE_WAIT_MS), 0);
    FIXTURE_WAIT_FOR(({
                         uint32_t r, s0 = 0, s1 = 0, s2 = 0;
                         group_position(m[0].g, &r, &s0, NULL);
                         group_position(m[1].g, &r, &s1, NULL);
                         group_position(m[2].g, &r, &s2, NULL);
                         s0 == 3 && s1 == 3 && s2 == 3;
                     }),
                     "the three members never shared an epoch");
    for (int i = 0; i < 3; i++)
        cr_assert_eq(pthread_create(&m[i].t, NULL, ops_main, &m[i]), 0);
    for (int i = 0; i < 3; i++)
        pthread_join(m[i].t, NULL);
    for (int i = 0; i < 3; i++)
        cr_expect_eq(m[i].failures, 0, "member %d: %s", i, m[i].why);
    for (int i = 0; i < 3; i++)
        group_destroy(m[i].g);
}

struct gather_arg {
    struct group *g;
    const char *in;
    size_t bytes;
    const void *out;
    size_t len;
    int rc;
};

static void *gather_main(void *arg)
{
    struct gather_arg *a = arg;

    a->rc = group_allgather(a->g, a->in, a->bytes, &a->out, &a->len, 60000);
    return NULL;
}

Test(group, gather_returns_every_members_record_in_member_order)
{
    struct group *g[2] = { groups_make("g-0"), groups_make("g-1") };
    struct gather_arg a[2] = { { .g = g[0], .in = "bytes of g-0!", .bytes = 13 },
                               { .g = g[1], .in = "bytes of g-1!", .bytes = 13 } };
    size_t rec = group_record_bytes(13);
    pthread_t t;

    FIXTURE_WAIT_FOR(groups_all_see(g, 2), "the two members never shared an epoch");
    cr_assert_eq(pthread_create(&t, NULL, gather_main, &a[1]), 0);
    gather_main(&a[0]);
    pthread_join(t, NULL);
    cr_assert_eq(rec, GROUP_ID_BYTES + 16);
    for (int i = 0; i < 2; i++) {
        const char *o = a[i].out;
        cr_assert_eq(a[i].rc, 0, "member %d: %s", i, strerror(-a[i].rc));
        cr_assert_eq(a[i].len, 2 * rec);
        cr_expect_str_eq(o, "g-0");
        cr_expect_str_eq(o + rec, "g-1");
        cr_expect_eq(memcmp(o + GROUP_ID_BYTES, "bytes of g-0!\0\0\0", 16), 0);
        cr_expect_eq(memcmp(o + rec + GROUP_ID_BYTES, "bytes of g-1!\0\0\0", 16), 0);
    }
    cr_expect_eq(memcmp(a[0].out, a[1].out, 2 * rec), 0, "the same bytes on both members");
    group_destroy(g[0]);
    group_destroy(g[1]);
}

/* ---- membership changes ---- */

/* Each call all-reduces (SUM, int64) [1 << index, k, k * k] where k is the
 * member's own number for the call: the first word tells exactly whose
 * inputs the result holds, and the others that they all made the same
 * call (the sum of k squared times the contributors equals the square of
 * the sum only when every k is the same). A late member learns the
 * others' number from its first result, so the check proves that its
 * calls line up with theirs. Results are kept by call number. */
#define STOP_NEVER INT64_MAX

struct churn_member {
    int index;
    struct group *g;
    pthread_t t;
    _Atomic int64_t stop_at;    /* the last call number it makes */
    atomic_int made;
    atomic_llong last;          /* the number of its last completed call */
    int64_t mask[CALLS_MAX], agreed[CALLS_MAX];
    int failures;
    char why[200];
};

static void *churn_main(void *arg)
{
    struct churn_member *m = arg;
    int64_t k = 0;

    for (int c = 0;; c++) {
        /* The fourth word counts members making their first call, whose
         * number is still a guess. */
        int64_t b[4] = { (int64_t)1 << m->index, k, k * k, c == 0 };
        int64_t pop, known;
        int rc;

        rc = group_allreduce(m->g, b, 4, DTYPE_I64, DTYPE_SUM, 0, 0, 60000);
        if (rc != 0) {
            if (m->failures++ == 0)
                snprintf(m->why, sizeof(m->why), "call %d failed: %s", c, strerror(-rc));
            break;
        }
        pop = __builtin_popcountll((unsigned long long)b[0]);
        known = pop - b[3];
        if (c == 0) {
            /* Its first number was a guess (0): the others' is the sum
             * over the others. */
            k = known > 0 ? b[1] / known : 1;
            if (known > 0 && (b[1] != k * known || b[2] != k * k * known) && m->failures++ == 0)
                snprintf(m->why, sizeof(m->why), "first call: the others disagree");
        } else if (b[1] * b[1] != known * b[2] || b[1] != known * k) {
            if (m->failures++ == 0)
                snprintf(m->why, sizeof(m->why),
                         "call %d (number %lld): the contributors made different calls (%lld, "
                         "%lld over %lld)", c, (long long)k, (long long)b[1], (long long)b[2],
                         (long long)pop);
        }
        if (!(b[0] & ((int64_t)1 << m->index)) && m->failures++ == 0)
            snprintf(m->why, sizeof(m->why), "call %d: its own input is missing", c);
        m->mask[k % CALLS_MAX] = b[0];
        m->agreed[k % CALLS_MAX] = k;
        atomic_store(&m->last, k);
        atomic_fetch_add(&m->made, 1);
        if (k >= atomic_load(&m->stop_at))
            break;
        k++;
        clock_sleep_ms(1);      /* a pace that leaves the test time to act */
    }
    return NULL;
}

static void churn_start(struct churn_member *m, int index, int64_t stop_at)
{
    char id[16];

    snprintf(id, sizeof(id), "c-%d", index);
    memset(m, 0, sizeof(*m));
    m->index = index;
    atomic_store(&m->stop_at, stop_at);
    m->g = groups_make(id);
}

/* Every call number two members both completed has one result. */
static void expect_same_results(struct churn_member *a, struct churn_member *b)
{
    int shared = 0;

    for (int i = 0; i < CALLS_MAX; i++)
        if (a->agreed[i] && a->agreed[i] == b->agreed[i]) {
            shared++;
            cr_expect_eq(a->mask[i], b->mask[i], "call %lld: members %d and %d differ",
                         (long long)a->agreed[i], a->index, b->index);
        }
    cr_expect_gt(shared, 0, "members %d and %d shared no call", a->index, b->index);
}

/* Makes every member in m[0..n) stop a few calls after the furthest. */
static void stop_all(struct churn_member *m, int n)
{
    int64_t top = 0;

    for (int i = 0; i < n; i++)
        if (atomic_load(&m[i].last) > top)
            top = atomic_load(&m[i].last);
    for (int i = 0; i < n; i++)
        atomic_store(&m[i].stop_at, top + 5);
}

Test(group, a_member_joining_lines_up_with_the_others)
{
    struct churn_member m[3];
    struct group *g[3];

    churn_start(&m[0], 0, STOP_NEVER);
    churn_start(&m[1], 1, STOP_NEVER);
    g[0] = m[0].g;
    g[1] = m[1].g;
    FIXTURE_WAIT_FOR(groups_all_see(g, 2), "the two members never shared an epoch");
    for (int i = 0; i < 2; i++)
        cr_assert_eq(pthread_create(&m[i].t, NULL, churn_main, &m[i]), 0);
    FIXTURE_WAIT_FOR(atomic_load(&m[0].made) >= 20, "no calls before the join");
    churn_start(&m[2], 2, STOP_NEVER);
    g[2] = m[2].g;
    cr_assert_eq(pthread_create(&m[2].t, NULL, churn_main, &m[2]), 0);
    FIXTURE_WAIT_FOR(atomic_load(&m[2].made) >= 20, "the late member's calls never completed");
    stop_all(m, 3);
    for (int i = 0; i < 3; i++)
        pthread_join(m[i].t, NULL);
    for (int i = 0; i < 3; i++)
        cr_expect_eq(m[i].failures, 0, "member %d: %s", i, m[i].why);
    cr_expect_eq(atomic_load(&m[0].last), atomic_load(&m[2].last), "all stop at one call");
    cr_expect_eq(m[2].mask[atomic_load(&m[2].last) % CALLS_MAX], 7,
                 "the late member's calls hold every member's input");
    cr_expect_gt(atomic_load(&m[2].last), 20, "the late member took the others' numbering");
    expect_same_results(&m[0], &m[1]);
    expect_same_results(&m[0], &m[2]);
    expect_same_results(&m[1], &m[2]);
    for (int i = 2; i >= 0; i--)
        group_destroy(m[i].g);
}

Test(group, a_member_leaving_mid_call_lets_the_others_finish_on_the_survivors)
{
    struct churn_member m[3];
    struct group *g[3];
    struct group_stats st;

    for (int i = 0; i < 3; i++) {
        churn_start(&m[i], i, i == 2 ? 30 : STOP_NEVER);
        g[i] = m[i].g;
    }
    FIXTURE_WAIT_FOR(groups_all_see(g, 3), "the three members never shared an epoch");
    for (int i = 0; i < 3; i++)
        cr_assert_eq(pthread_create(&m[i].t, NULL, churn_main, &m[i]), 0);
    /* Member 2 stops after call 30: the others' call 31 waits for it, in
     * flight, until it leaves. */
    pthread_join(m[2].t, NULL);
    cr_expect_eq(atomic_load(&m[2].last), 30);
    group_destroy(m[2].g);
    FIXTURE_WAIT_FOR(atomic_load(&m[0].last) >= 50 && atomic_load(&m[1].last) >= 50,
                     "the survivors' calls never completed");
    stop_all(m, 2);
    for (int i = 0; i < 2; i++)
        pthread_join(m[i].t, NULL);
    for (int i = 0; i < 3; i++)
        cr_expect_eq(m[i].failures, 0, "member %d: %s", i, m[i].why);
    cr_expect_eq(m[0].mask[30], 7, "call 30 holds all three");
    cr_expect_eq(m[0].mask[31], 3, "call 31 was retried on the survivors");
    expect_same_results(&m[0], &m[1]);
    expect_same_results(&m[0], &m[2]);
    group_stats(m[0].g, &st);
    cr_expect_eq(st.members, 2);
    cr_expect_geq(st.epochs, 2);
    for (int i = 0; i < 2; i++)
        group_destroy(m[i].g);
}

Test(group, repeated_joins_and_leaves_keep_one_result_per_call)
{
    struct churn_member m[3];
    struct group *g[2];
    struct group_stats st;
    uint64_t delivered = 0;

    for (int i = 0; i < 2; i++) {
        churn_start(&m[i], i, STOP_NEVER);
        g[i] = m[i].g;
    }
    FIXTURE_WAIT_FOR(groups_all_see(g, 2), "the two members never shared an epoch");
    for (int i = 0; i < 2; i++)
        cr_assert_eq(pthread_create(&m[i].t, NULL, churn_main, &m[i]), 0);
    for (int cycle = 0; cycle < 4; cycle++) {
        int64_t from = atomic_load(&m[0].last);

        /* A third member comes, makes calls with the others, and leaves
         * after a call of its own, while they are in their next one. */
        churn_start(&m[2], 2, STOP_NEVER);
        cr_assert_eq(pthread_create(&m[2].t, NULL, churn_main, &m[2]), 0);
        FIXTURE_WAIT_FOR(atomic_load(&m[2].made) >= 5, "cycle %d: the third member's calls", cycle);
        atomic_store(&m[2].stop_at, atomic_load(&m[2].last) + 3);
        pthread_join(m[2].t, NULL);
        group_stats(m[2].g, &st);
        delivered += st.delivered;
        group_destroy(m[2].g);
        cr_expect_eq(m[2].failures, 0, "cycle %d: %s", cycle, m[2].why);
        expect_same_results(&m[0], &m[2]);
        FIXTURE_WAIT_FOR(atomic_load(&m[0].last) >= atomic_load(&m[2].last) + 5,
                         "cycle %d: the survivors' calls", cycle);
        cr_expect_gt(m[2].agreed[atomic_load(&m[2].last) % CALLS_MAX], from);
    }
    stop_all(m, 2);
    for (int i = 0; i < 2; i++) {
        pthread_join(m[i].t, NULL);
        group_stats(m[i].g, &st);
        delivered += st.delivered;
        cr_expect_eq(m[i].failures, 0, "member %d: %s", i, m[i].why);
    }
    expect_same_results(&m[0], &m[1]);
    cr_expect_eq(atomic_load(&m[0].last), atomic_load(&m[1].last));
    cr_log_info("results delivered by the others after an interrupted call: %llu",
                (unsigned long long)delivered);
    for (int i = 0; i < 2; i++)
        group_destroy(m[i].g);
}

/* ---- errors ---- */

Test(group, bad_arguments_are_refused_and_change_nothing)
{
    struct group *g = groups_make("bad");
    float x[4] = { 1, 2, 3, 4 };
    int32_t n[2] = { 5, 6 };

    cr_assert_eq(group_wait(g, FIXTURE_WAIT_MS), 0);
    cr_expect_eq(group_allreduce(g, x, 4, (enum dtype)42, DTYPE_SUM, 0, 0, 1000), -EINVAL);
    cr_expect_eq(group_allreduce(g, x, 4, DTYPE_F32, (enum dtype_op)42, 0, 0, 1000), -EINVAL);
    cr_expect_eq(group_allreduce(g, x, 4, DTYPE_F32, DTYPE_AVG_BY, 0, 0, 1000), -EINVAL);
    cr_expect_eq(group_allreduce(g, x, 4, DTYPE_F32, DTYPE_AVG_BY, NAN, 0, 1000), -EINVAL);
    cr_expect_eq(group_allreduce(g, x, 4, DTYPE_F32, DTYPE_SUM, 0, 8, 1000), -EINVAL);
    cr_expect_eq(group_allreduce(g, x, 4, DTYPE_F32, DTYPE_MAX, 0, GROUP_DIVIDE_BEFORE, 1000),
                 -EINVAL);
    cr_expect_eq(group_allreduce(g, n, 2, DTYPE_I32, DTYPE_AVG, 0, GROUP_DIVIDE_BEFORE, 1000),
                 -EINVAL);
    cr_expect_eq(group_allreduce(g, NULL, 4, DTYPE_F32, DTYPE_SUM, 0, 0, 1000), -EINVAL);
    cr_expect_eq(group_allreduce(g, x, (GROUP_DEFAULT_MAX_BYTES / 4) + 1, DTYPE_F32, DTYPE_SUM, 0,
                                 0, 1000), -E2BIG);
    cr_expect(x[0] == 1 && x[1] == 2 && x[2] == 3 && x[3] == 4, "the buffer is untouched");
    /* Alone in the cohort, a call is the member's own input. */
    cr_expect_eq(group_allreduce(g, x, 4, DTYPE_F32, DTYPE_AVG_BY, 2, 0, 10000), 0);
    cr_expect(x[0] == 0.5f && x[3] == 2, "avg by 2 alone halves");
    group_destroy(g);
}

struct mismatch_arg {
    struct group *g;
    size_t count;
    float buf[64];
    int rc;
};

static void *mismatch_main(void *arg)
{
    struct mismatch_arg *a = arg;

    for (size_t i = 0; i < 64; i++)
        a->buf[i] = 7;
    a->rc = group_allreduce(a->g, a->buf, a->count, DTYPE_F32, DTYPE_SUM, 0, 0, 60000);
    return NULL;
}

Test(group, members_whose_calls_differ_get_eproto_with_buffers_untouched)
{
    struct group *g[2] = { groups_make("x-0"), groups_make("x-1") };
    struct mismatch_arg a[2] = { { .g = g[0], .count = 64 }, { .g = g[1], .count = 48 } };
    pthread_t t[2];

    FIXTURE_WAIT_FOR(groups_all_see(g, 2), "the two members never shared an epoch");
    for (int i = 0; i < 2; i++)
        cr_assert_eq(pthread_create(&t[i], NULL, mismatch_main, &a[i]), 0);
    for (int i = 0; i < 2; i++)
        pthread_join(t[i], NULL);
    for (int i = 0; i < 2; i++) {
        cr_expect_eq(a[i].rc, -EPROTO, "member %d: %s", i, strerror(-a[i].rc));
        cr_expect(a[i].buf[0] == 7 && a[i].buf[a[i].count - 1] == 7, "member %d's buffer", i);
    }
    group_destroy(g[0]);
    group_destroy(g[1]);
}

Test(group, a_call_with_no_usable_epoch_times_out_untouched)
{
    struct group_config c = { .broker = "127.0.0.1:1", .cohort = "coll", .id = "nobroker",
                              .host = "127.0.0.1" };
    struct group *g = NULL;
    double x[2] = { 3, 4 };
    uint32_t r, s;
    uint64_t t0;

    cr_assert_eq(group_create(&c, &g), 0);
    cr_expect_eq(group_wait(g, 200), -ETIMEDOUT);
    cr_expect_eq(group_position(g, &r, &s, NULL), -ENOTCONN);
    t0 = clock_now_ms();
    cr_expect_eq(group_allreduce(g, x, 2, DTYPE_F64, DTYPE_SUM, 0, 0, 300), -ETIMEDOUT);
    cr_expect_geq(clock_now_ms() - t0, 300);
    cr_expect(x[0] == 3 && x[1] == 4);
    group_destroy(g);
    c.id = "not a valid id!";
    cr_expect_eq(group_create(&c, &g), -EINVAL);
}

/* ---- the public face (include/cohort.h) ---- */

Test(group, public_api_reads_the_environment_and_checks_its_enums)
{
    struct cohort_group *cg = NULL;
    double x[3] = { 1, 2, 3 };
    uint32_t rank = 9, size = 9;
    char id[COHORT_GROUP_ID_BYTES];
    struct cohort_group_stats st;
    const void *out;
    size_t len;

    unsetenv("COHORT_BROKER");
    cr_expect_eq(cohort_group_create(NULL, "coll", "pub", &cg), -EINVAL, "no broker anywhere");
    setenv("COHORT_BROKER", groups_broker(), 1);
    setenv("COHORT_COHORT", "coll", 1);
    setenv("COHORT_ID", "pub", 1);
    cr_assert_eq(cohort_group_create(NULL, NULL, NULL, &cg), 0);
    unsetenv("COHORT_BROKER");
    unsetenv("COHORT_COHORT");
    unsetenv("COHORT_ID");
    cr_assert_eq(cohort_group_wait(cg, FIXTURE_WAIT_MS), 0);
    cr_expect_eq(cohort_group_position(cg, &rank, &size), 0);
    cr_expect(rank == 0 && size == 1);
    cr_expect_eq(cohort_group_member_id(cg, 0, id, sizeof(id)), 0);
    cr_expect_str_eq(id, "pub");
    cr_expect_eq(cohort_group_member_id(cg, 1, id, sizeof(id)), -ERANGE);
    cr_expect_eq(cohort_group_allreduce(cg, x, 3, (enum cohort_group_dtype)77, COHORT_GROUP_SUM,
                                        0, 0, 1000), -EINVAL);
    cr_expect_eq(cohort_group_allreduce(cg, x, 3, COHORT_GROUP_F64, (enum cohort_group_op)77, 0,
                                        0, 1000), -EINVAL);
    cr_expect_eq(cohort_group_allreduce(cg, x, 3, COHORT_GROUP_F64, COHORT_GROUP_AVG_BY, 4, 0,
                                        10000), 0);
    cr_expect(x[0] == 0.25 && x[2] == 0.75);
    cr_expect_eq(cohort_group_allgather(cg, "ab", 2, &out, &len, 10000), 0);
    cr_expect_eq(len, COHORT_GROUP_ID_BYTES + 8);
    cr_expect_str_eq((const char *)out, "pub");
    cohort_group_stats(cg, &st);
    cr_expect_eq(st.calls, 2);
    cr_expect_eq(st.members, 1);
    cr_expect_str_eq(cohort_group_strerror(-EPROTO),
                     "the members' calls differ (count, type or operator, or a reducer's "
                     "shape, k or rank: their models differ): every member must "
                     "make the same collectives in the same order");
    cohort_group_destroy(cg);
}

/* The reducers' public face: a ratio and a rank checked, op enums mapped
 * one by one, results through to the caller's buffer. */
Test(group, public_reducers_check_ratio_rank_and_op)
{
    struct cohort_group *cg = NULL;
    struct cohort_group_topk *t = NULL;
    struct cohort_group_powersgd *p = NULL;
    struct cohort_group_matrix m = { 2, 2 };
    const float given[10] = { 1, -9, 3, 4, 5, 6, 7, 8, 2, 10 };
    float x[10], y[6] = { 1, 2, 2, 4, 3, -1 };

    cr_assert_eq(cohort_group_create(groups_broker(), "coll", "pubr", &cg), 0);
    cr_assert_eq(cohort_group_wait(cg, FIXTURE_WAIT_MS), 0);
    memcpy(x, given, sizeof(x));
    cr_expect_eq(cohort_group_topk_create(cg, 10, 0, &t), -EINVAL);
    cr_expect_eq(cohort_group_topk_create(cg, 10, 1.01, &t), -EINVAL);
    cr_expect_eq(cohort_group_topk_create(cg, 10, NAN, &t), -EINVAL);
    cr_expect_eq(cohort_group_topk_create(cg, 0, 0.5, &t), -EINVAL);
    cr_expect_eq(cohort_group_topk_create(NULL, 10, 0.5, &t), -EINVAL);
    cr_expect_null(t);
    cr_assert_eq(cohort_group_topk_create(cg, 10, 0.25, &t), 0);
    cr_expect_eq(cohort_group_topk_k(t), 3, "ceil(0.25 x 10)");
    cr_expect_eq(cohort_group_topk_n(t), 10);
    cr_expect_eq(cohort_group_topk_reduce(t, x, COHORT_GROUP_MAX, 1000), -EINVAL);
    cr_expect_eq(cohort_group_topk_reduce(t, x, (enum cohort_group_op)77, 1000), -EINVAL);
    cr_expect(x[1] == -9, "refused: untouched");
    cr_assert_eq(cohort_group_topk_reduce(t, x, COHORT_GROUP_SUM, 10000), 0);
    for (int i = 0; i < 10; i++) {
        bool sent = i == 1 || i == 7 || i == 9;

        cr_expect_eq(x[i], sent ? given[i] : 0, "entry %d", i);
        cr_expect_eq(cohort_group_topk_residual(t)[i] == 0, sent, "residual %d", i);
    }
    cr_expect_eq(cohort_group_powersgd_create(cg, &m, 1, 2, 0, 1, false, &p), -EINVAL);
    cr_expect_eq(cohort_group_powersgd_create(cg, &m, 1, 2, 1025, 1, false, &p), -EINVAL);
    cr_expect_eq(cohort_group_powersgd_create(cg, NULL, 1, 2, 1, 1, false, &p), -EINVAL);
    cr_expect_eq(cohort_group_powersgd_create(cg, NULL, 0, 0, 1, 1, false, &p), -EINVAL);
    cr_expect_null(p);
    cr_assert_eq(cohort_group_powersgd_create(cg, &m, 1, 2, 1, 1, true, &p), 0);
    cr_expect_eq(cohort_group_powersgd_size(p), 6);
    cr_expect_eq(cohort_group_powersgd_reduce(p, y, COHORT_GROUP_MIN, 1000), -EINVAL);
    /* [[1, 2], [2, 4]] has rank 1: rank 1 gives it back; the vector is exact. */
    cr_assert_eq(cohort_group_powersgd_reduce(p, y, COHORT_GROUP_AVG, 10000), 0);
    cr_expect(fabsf(y[0] - 1) < 1e-5f && fabsf(y[3] - 4) < 1e-5f, "%g %g", y[0], y[3]);
    cr_expect(y[4] == 3 && y[5] == -1 && cohort_group_powersgd_error(p)[4] == 0);
    cohort_group_powersgd_destroy(p);
    cohort_group_topk_destroy(t);
    cohort_group_destroy(cg);
}

/* tests/unit/test_group_topk.c: top-k with error feedback as a group's
 * collective, among groups in one process over a real broker and real TCP
 * on loopback. Gradients are small integers, so floats add exactly and
 * every result and residual is checked bit for bit against a reference
 * computed here, call by call, from the members each call ran among. */
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
#include "collective/group_topk.h"
#include "engine/topk.h"
#include "fixture.h"
#include "groups.h"

#define N 203                   /* a prime */
#define K 17
#define MEMBERS 3
#define CALLS 12

static void start(void)
{
    groups_start("sparse");
}

TestSuite(group_topk, .init = start, .fini = groups_stop, .timeout = 180);

/* Member m's gradient at call c: integers in [-40, 40], many ties. */
static float grad_of(int m, int c, size_t i)
{
    return (float)((int)((i * 37u + (unsigned)c * 101u + (unsigned)m * 7919u) % 81u) - 40);
}

/* ---- the reference: the selection written the slow, obvious way ---- */

struct ref {
    float residual[MEMBERS][N];
    float result[CALLS][N];
};

static void ref_select(const float *acc, bool *pick)
{
    memset(pick, 0, N * sizeof(bool));
    for (int j = 0; j < K; j++) {
        long best = -1;

        for (size_t i = 0; i < N; i++)
            if (!pick[i] && (best < 0 || fabsf(acc[i]) > fabsf(acc[best])))
                best = (long)i;
        pick[best] = true;
    }
}

/* Call c among the members whose bit is in `mask`. */
static void ref_call(struct ref *r, int c, unsigned mask)
{
    memset(r->result[c], 0, sizeof(r->result[c]));
    for (int m = 0; m < MEMBERS; m++) {
        float acc[N];
        bool pick[N];

        if (!(mask & (1u << m)))
            continue;
        for (size_t i = 0; i < N; i++)
            acc[i] = grad_of(m, c, i) + r->residual[m][i];
        ref_select(acc, pick);
        for (size_t i = 0; i < N; i++) {
            r->result[c][i] += pick[i] ? acc[i] : 0;
            r->residual[m][i] = pick[i] ? 0 : acc[i];
        }
    }
}

/* ---- members ---- */

struct member {
    int index;
    struct group *g;
    struct group_topk *t;
    pthread_t thread;
    int from, to;               /* the calls it makes: [from, to) */
    float result[CALLS][N];
    size_t members[CALLS];
    int rc, failed_at;
};

static void *member_main(void *arg)
{
    struct member *m = arg;

    m->rc = 0;
    for (int c = m->from; c < m->to; c++) {
        float grad[N];

        for (size_t i = 0; i < N; i++)
            grad[i] = grad_of(m->index, c, i);
        m->rc = group_topk_reduce(m->t, grad, DTYPE_SUM, 60000);
        if (m->rc < 0) {
            m->failed_at = c;
            break;
        }
        memcpy(m->result[c], grad, sizeof(grad));
        m->members[c] = group_topk_members(m->t);
    }
    return NULL;
}

static void member_start(struct member *m, int index)
{
    char id[16];

    snprintf(id, sizeof(id), "t-%d", index);
    memset(m, 0, sizeof(*m));
    m->index = index;
    m->g = groups_make(id);
    cr_assert_eq(group_topk_create(m->g, N, K, &m->t), 0);
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

/* Every member's result of calls [from, to) is the reference's, bit for
 * bit, and every residual is. */
static void expect_reference(const struct member *m, const struct ref *r, const int *who, int n,
                             int from, int to)
{
    for (int i = 0; i < n; i++) {
        const struct member *x = &m[who[i]];

        for (int c = from; c < to; c++) {
            cr_expect_eq(x->members[c], (size_t)n, "member %d, call %d: %zu members", who[i], c,
                         x->members[c]);
            cr_expect_eq(memcmp(x->result[c], r->result[c], sizeof(r->result[c])), 0,
                         "member %d, call %d: the result differs from the reference", who[i], c);
        }
        cr_expect_eq(memcmp(group_topk_residual(x->t), r->residual[who[i]], N * sizeof(float)), 0,
                     "member %d: the residual differs from the reference", who[i]);
    }
}

/* Error feedback, over the whole run: what the cohort summed plus what
 * every member still holds (and what a leaver took) is every gradient
 * given, exactly. */
static void expect_conserved(const struct ref *r, const float *results_of_all, int calls,
                             const unsigned *mask_of_call)
{
    for (size_t i = 0; i < N; i++) {
        double given = 0, accounted = 0;

        for (int c = 0; c < calls; c++) {
            accounted += results_of_all[(size_t)c * N + i];
            for (int m = 0; m < MEMBERS; m++)
                if (mask_of_call[c] & (1u << m))
                    given += grad_of(m, c, i);
        }
        for (int m = 0; m < MEMBERS; m++)
            accounted += r->residual[m][i];
        cr_expect_eq(given, accounted, "entry %zu: %g given, %g sent and kept", i, given,
                     accounted);
    }
}

static void finish(struct member *m, int n)
{
    for (int i = n - 1; i >= 0; i--) {
        group_topk_destroy(m[i].t);
        group_destroy(m[i].g);
    }
}

Test(group_topk, three_members_match_the_reference_and_conserve_every_gradient)
{
    static struct member m[MEMBERS];
    static struct ref r;
    struct group *g[MEMBERS];
    const int all[MEMBERS] = { 0, 1, 2 };
    unsigned mask[CALLS];

    memset(&r, 0, sizeof(r));
    for (int i = 0; i < MEMBERS; i++) {
        member_start(&m[i], i);
        g[i] = m[i].g;
    }
    FIXTURE_WAIT_FOR(groups_all_see(g, MEMBERS), "the members never shared an epoch");
    run_calls(m, all, MEMBERS, 0, CALLS);
    for (int c = 0; c < CALLS; c++) {
        ref_call(&r, c, 7);
        mask[c] = 7;
    }
    expect_reference(m, &r, all, MEMBERS, 0, CALLS);
    expect_conserved(&r, &m[0].result[0][0], CALLS, mask);
    finish(m, MEMBERS);
}

/* Two members make calls; a third joins with a zero residual and lines up
 * with their numbering; then one leaves in the middle of a call, which the
 * survivors complete among themselves with their residuals as the
 * reference says: the failed attempt changed nothing. */
Test(group_topk, a_join_and_a_leave_mid_call_keep_the_state_exact)
{
    static struct member m[MEMBERS];
    static struct ref r;
    struct group *g[MEMBERS];
    const int two[2] = { 0, 1 }, all[MEMBERS] = { 0, 1, 2 };
    unsigned mask[CALLS];
    memset(&r, 0, sizeof(r));
    member_start(&m[0], 0);
    member_start(&m[1], 1);
    g[0] = m[0].g;
    g[1] = m[1].g;
    FIXTURE_WAIT_FOR(groups_all_see(g, 2), "the two members never shared an epoch");
    run_calls(m, two, 2, 0, 4);
    member_start(&m[2], 2);
    g[2] = m[2].g;
    FIXTURE_WAIT_FOR(groups_all_see(g, MEMBERS), "the joiner never shared an epoch");
    run_calls(m, all, MEMBERS, 4, 8);
    /* Member 2 stops; the others' call 8 waits for it until it leaves. */
    for (int i = 0; i < 2; i++) {
        m[i].from = 8;
        m[i].to = CALLS;
        cr_assert_eq(pthread_create(&m[i].thread, NULL, member_main, &m[i]), 0);
    }
    group_topk_destroy(m[2].t);
    m[2].t = NULL;
    group_destroy(m[2].g);
    m[2].g = NULL;
    for (int i = 0; i < 2; i++) {
        pthread_join(m[i].thread, NULL);
        cr_assert_eq(m[i].rc, 0, "member %d, call %d: %s", i, m[i].failed_at,
                     strerror(-m[i].rc));
    }
    for (int c = 0; c < CALLS; c++) {
        mask[c] = c < 4 ? 3 : c < 8 ? 7 : 3;
        ref_call(&r, c, mask[c]);
    }
    expect_reference(m, &r, two, 2, 8, CALLS);
    for (int c = 0; c < 4; c++)
        cr_expect_eq(memcmp(m[0].result[c], r.result[c], sizeof(r.result[c])), 0, "call %d", c);
    for (int c = 4; c < 8; c++) {
        cr_expect_eq(m[0].members[c], 3u, "call %d", c);
        cr_expect_eq(memcmp(m[0].result[c], r.result[c], sizeof(r.result[c])), 0, "call %d", c);
        cr_expect_eq(memcmp(m[2].result[c], r.result[c], sizeof(r.result[c])), 0,
                     "the joiner's call %d", c);
    }
    /* The leaver took r.residual[2] with it: still part of the account. */
    expect_conserved(&r, &m[0].result[0][0], CALLS, mask);
    finish(m, 2);
}

/* ---- errors ---- */

Test(group_topk, bad_arguments_are_refused)
{
    struct group *g = groups_make("bad");
    struct group_topk *t = NULL;
    float x[8] = { 1, 2, 3, 4, 5, 6, 7, 8 };

    cr_expect_eq(group_topk_create(NULL, 8, 2, &t), -EINVAL);
    cr_expect_eq(group_topk_create(g, 8, 0, &t), -EINVAL);
    cr_expect_eq(group_topk_create(g, 8, 9, &t), -EINVAL);
    cr_expect_eq(group_topk_create(g, 0, 0, &t), -EINVAL);
    cr_expect_null(t);
    cr_assert_eq(group_topk_create(g, 8, 2, &t), 0);
    cr_expect_eq(group_topk_reduce(t, NULL, DTYPE_SUM, 1000), -EINVAL);
    cr_expect_eq(group_topk_reduce(t, x, DTYPE_MAX, 1000), -EINVAL);
    cr_expect(x[0] == 1 && x[7] == 8, "the gradient is untouched");
    for (int i = 0; i < 8; i++)
        cr_expect_eq(group_topk_residual(t)[i], 0);
    /* Alone: the top 2 are kept, the rest waits in the residual. */
    cr_assert_eq(group_wait(g, FIXTURE_WAIT_MS), 0);
    cr_assert_eq(group_topk_reduce(t, x, DTYPE_AVG, 20000), 0);
    for (int i = 0; i < 8; i++) {
        cr_expect_eq(x[i], i >= 6 ? (float)(i + 1) : 0, "entry %d", i);
        cr_expect_eq(group_topk_residual(t)[i], i >= 6 ? 0 : (float)(i + 1), "residual %d", i);
    }
    group_topk_destroy(t);
    group_destroy(g);
}

struct mismatch {
    struct group *g;
    struct group_topk *t;
    size_t n, k;
    float x[64];
    int rc;
};

static void *mismatch_main(void *arg)
{
    struct mismatch *a = arg;

    for (size_t i = 0; i < 64; i++)
        a->x[i] = (float)i;
    a->rc = group_topk_reduce(a->t, a->x, DTYPE_SUM, 60000);
    return NULL;
}

/* Models that differ in size (same k: the same bytes on the wire) or in k
 * fail at every member with -EPROTO, gradients and residuals untouched. */
static void mismatch_case(size_t n1, size_t k1)
{
    struct mismatch a[2] = { { .n = 64, .k = 8 }, { .n = n1, .k = k1 } };
    struct group *g[2];
    pthread_t th[2];

    a[0].g = g[0] = groups_make("x-0");
    a[1].g = g[1] = groups_make("x-1");
    for (int i = 0; i < 2; i++)
        cr_assert_eq(group_topk_create(a[i].g, a[i].n, a[i].k, &a[i].t), 0);
    FIXTURE_WAIT_FOR(groups_all_see(g, 2), "the two members never shared an epoch");
    for (int i = 0; i < 2; i++)
        cr_assert_eq(pthread_create(&th[i], NULL, mismatch_main, &a[i]), 0);
    for (int i = 0; i < 2; i++)
        pthread_join(th[i], NULL);
    for (int i = 0; i < 2; i++) {
        cr_expect_eq(a[i].rc, -EPROTO, "member %d: %s", i, strerror(-a[i].rc));
        for (size_t j = 0; j < a[i].n; j++) {
            cr_expect_eq(a[i].x[j], (float)j, "member %d's gradient, entry %zu", i, j);
            cr_expect_eq(group_topk_residual(a[i].t)[j], 0, "member %d's residual", i);
        }
        group_topk_destroy(a[i].t);
    }
    group_destroy(g[1]);
    group_destroy(g[0]);
}

Test(group_topk, models_of_different_sizes_get_eproto_and_change_nothing)
{
    mismatch_case(60, 8);
}

Test(group_topk, different_k_gets_eproto_and_changes_nothing)
{
    mismatch_case(64, 4);
}

/* ---- churn: joins and leaves while the others make calls ----
 *
 * Entries 0..3 carry member j's marker 2^(10 + j), entry 4 the caller's
 * call number plus 100000, entry 5 50000 on a member's first call: far
 * above the rest, so always among the top k. A result's markers tell
 * exactly whose entries it holds; its counter that all of them made the
 * same call. After each call a member checks its residual against its
 * own reference: its top k dropped when its marker is in the result, its
 * whole gradient kept when the call completed without it (a result the
 * others delivered). */
#define CHURN_CALLS 400

struct churner {
    int index;
    struct group *g;
    struct group_topk *t;
    pthread_t thread;
    _Atomic long long stop_at, last;
    atomic_int made;
    float residual[N];
    uint32_t crc[CHURN_CALLS];          /* by call number, modulo */
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
    long long k = 0;
    bool first = true;

    for (int c = 0;; c++) {
        float grad[N], acc[N];
        bool pick[N];
        int pop = 0, fresh, known;
        long long sum;
        unsigned mask = 0;
        int rc;

        for (size_t i = 0; i < N; i++)
            grad[i] = i < 6 ? 0 : grad_of(m->index, c % CALLS, i);
        grad[m->index] = (float)(1 << (10 + m->index));
        grad[4] = (float)(100000 + k);
        grad[5] = first ? 50000 : 0;
        for (size_t i = 0; i < N; i++)
            acc[i] = grad[i] + m->residual[i];
        rc = group_topk_reduce(m->t, grad, DTYPE_SUM, 60000);
        if (rc < 0) {
            churn_fail(m, strerror(-rc), k);
            break;
        }
        for (int j = 0; j < 4; j++)
            if (grad[j] == (float)(1 << (10 + j))) {
                mask |= 1u << j;
                pop++;
            } else if (grad[j] != 0) {
                churn_fail(m, "a marker is wrong", k);
            }
        fresh = (int)(grad[5] / 50000);
        known = pop - fresh;
        sum = (long long)grad[4] - 100000LL * pop;
        if (first) {
            k = known ? sum / known : 1;
            first = false;
        } else if (sum != k * known) {
            churn_fail(m, "the contributors made different calls", k);
        }
        if (mask & (1u << m->index)) {
            ref_select(acc, pick);
            for (size_t i = 0; i < N; i++)
                m->residual[i] = pick[i] ? 0 : acc[i];
        } else {
            memcpy(m->residual, acc, sizeof(acc));
        }
        if (memcmp(m->residual, group_topk_residual(m->t), sizeof(acc)) != 0)
            churn_fail(m, "the residual is not this member's own unsent gradient", k);
        m->crc[k % CHURN_CALLS] = crc_of(grad, N) ^ mask;
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
    cr_assert_eq(group_topk_create(m->g, N, K, &m->t), 0);
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

Test(group_topk, joins_and_leaves_mid_call_keep_one_result_and_every_residual_exact)
{
    static struct churner m[3];
    struct group_stats st;
    uint64_t delivered = 0;

    churner_start(&m[0], 0);
    churner_start(&m[1], 1);
    FIXTURE_WAIT_FOR(atomic_load(&m[0].made) >= 5, "the first calls");
    for (int cycle = 0; cycle < 3; cycle++) {
        churner_start(&m[2], 2);
        FIXTURE_WAIT_FOR(atomic_load(&m[2].made) >= 5, "cycle %d: the joiner's calls", cycle);
        /* It stops after a call of its own and leaves while the others
         * are in their next. */
        atomic_store(&m[2].stop_at, atomic_load(&m[2].last) + 2);
        pthread_join(m[2].thread, NULL);
        group_stats(m[2].g, &st);
        delivered += st.delivered;
        cr_expect_eq(m[2].failures, 0, "cycle %d: %s", cycle, m[2].why);
        expect_one_result_per_call(&m[0], &m[2]);
        group_topk_destroy(m[2].t);
        group_destroy(m[2].g);
        FIXTURE_WAIT_FOR(atomic_load(&m[0].last) >= atomic_load(&m[2].last) + 3,
                         "cycle %d: the survivors' calls", cycle);
    }
    for (int i = 0; i < 2; i++)
        atomic_store(&m[i].stop_at, atomic_load(&m[0].last) + 3);
    for (int i = 0; i < 2; i++) {
        pthread_join(m[i].thread, NULL);
        group_stats(m[i].g, &st);
        delivered += st.delivered;
        cr_expect_eq(m[i].failures, 0, "member %d: %s", i, m[i].why);
    }
    expect_one_result_per_call(&m[0], &m[1]);
    cr_log_info("results delivered by the others after an interrupted call: %llu",
                (unsigned long long)delivered);
    for (int i = 1; i >= 0; i--) {
        group_topk_destroy(m[i].t);
        group_destroy(m[i].g);
    }
}

/* ---- segments: a model's layers in one call ----
 *
 * Four layers of N entries in all, the second scaled far above the rest:
 * a top-k over the whole model would send only its entries, while each
 * layer's own top k_s sends from every layer. Checked bit for bit against
 * a reference that selects layer by layer. */
#define SEGS 4
static const size_t seg_size[SEGS] = { 5, 90, 1, 107 };        /* N = 203 */
static const size_t seg_k[SEGS] = { 2, 9, 1, 5 };              /* K = 17 */

static float seg_grad_of(int m, int c, size_t i)
{
    return grad_of(m, c, i) * (i >= 5 && i < 95 ? 1000.0f : 1.0f);
}

static void ref_seg_call(struct ref *r, int c, unsigned mask)
{
    memset(r->result[c], 0, sizeof(r->result[c]));
    for (int m = 0; m < MEMBERS; m++) {
        float acc[N];
        bool pick[N];

        if (!(mask & (1u << m)))
            continue;
        for (size_t i = 0; i < N; i++)
            acc[i] = seg_grad_of(m, c, i) + r->residual[m][i];
        memset(pick, 0, sizeof(pick));
        for (size_t s = 0, start = 0; s < SEGS; start += seg_size[s], s++)
            for (size_t j = 0; j < seg_k[s]; j++) {
                size_t best = SIZE_MAX;

                for (size_t i = start; i < start + seg_size[s]; i++)
                    if (!pick[i] && (best == SIZE_MAX || fabsf(acc[i]) > fabsf(acc[best])))
                        best = i;
                pick[best] = true;
            }
        for (size_t i = 0; i < N; i++) {
            r->result[c][i] += pick[i] ? acc[i] : 0;
            r->residual[m][i] = pick[i] ? 0 : acc[i];
        }
    }
}

struct seg_member {
    struct group *g;
    struct group_topk *t;
    pthread_t thread;
    int index, rc, failed_at;
    float result[CALLS][N];
};

static void *seg_member_main(void *arg)
{
    struct seg_member *m = arg;

    for (int c = 0; c < CALLS; c++) {
        for (size_t i = 0; i < N; i++)
            m->result[c][i] = seg_grad_of(m->index, c, i);
        m->rc = group_topk_reduce(m->t, m->result[c], DTYPE_SUM, 60000);
        if (m->rc < 0) {
            m->failed_at = c;
            break;
        }
    }
    return NULL;
}

Test(group_topk, segments_select_per_layer_in_one_call_and_match_the_reference)
{
    static struct seg_member m[MEMBERS];
    static struct ref r;
    struct group *g[MEMBERS];
    unsigned mask[CALLS];
    char id[16];

    memset(&r, 0, sizeof(r));
    memset(m, 0, sizeof(m));
    for (int i = 0; i < MEMBERS; i++) {
        snprintf(id, sizeof(id), "s-%d", i);
        m[i].index = i;
        m[i].g = g[i] = groups_make(id);
        cr_assert_eq(group_topk_create_segments(m[i].g, seg_size, seg_k, SEGS, &m[i].t), 0);
    }
    FIXTURE_WAIT_FOR(groups_all_see(g, MEMBERS), "the members never shared an epoch");
    for (int i = 0; i < MEMBERS; i++)
        cr_assert_eq(pthread_create(&m[i].thread, NULL, seg_member_main, &m[i]), 0);
    for (int i = 0; i < MEMBERS; i++) {
        pthread_join(m[i].thread, NULL);
        cr_assert_eq(m[i].rc, 0, "member %d, call %d: %s", i, m[i].failed_at,
                     strerror(-m[i].rc));
    }
    for (int c = 0; c < CALLS; c++) {
        ref_seg_call(&r, c, 7);
        mask[c] = 7;
    }
    for (int i = 0; i < MEMBERS; i++) {
        for (int c = 0; c < CALLS; c++)
            cr_expect_eq(memcmp(m[i].result[c], r.result[c], sizeof(r.result[c])), 0,
                         "member %d, call %d: the result differs from the reference", i, c);
        cr_expect_eq(memcmp(group_topk_residual(m[i].t), r.residual[i], N * sizeof(float)), 0,
                     "member %d: the residual differs from the reference", i);
    }
    /* Every layer sent its share: the small layers too. */
    for (size_t s = 0, start = 0; s < SEGS; start += seg_size[s], s++) {
        size_t sent = 0;

        for (int c = 0; c < CALLS; c++)
            for (size_t i = start; i < start + seg_size[s]; i++)
                sent += m[0].result[c][i] != 0;
        cr_expect(sent > 0, "layer %zu sent nothing", s);
    }
    /* Error feedback, exactly: what was summed plus what is kept is what
     * was given (as expect_conserved, with the scaled gradients). */
    for (size_t i = 0; i < N; i++) {
        double given = 0, accounted = 0;

        for (int c = 0; c < CALLS; c++) {
            accounted += m[0].result[c][i];
            for (int k = 0; k < MEMBERS; k++)
                if (mask[c] & (1u << k))
                    given += seg_grad_of(k, c, i);
        }
        for (int k = 0; k < MEMBERS; k++)
            accounted += r.residual[k][i];
        cr_expect_eq(given, accounted, "entry %zu: %g given, %g sent and kept", i, given,
                     accounted);
    }
    for (int i = MEMBERS - 1; i >= 0; i--) {
        group_topk_destroy(m[i].t);
        group_destroy(m[i].g);
    }
}

Test(group_topk, bad_segments_are_refused)
{
    struct group *g = groups_make("bad-seg");
    struct group_topk *t = NULL;
    const size_t sizes[3] = { 4, 0, 4 }, ks[3] = { 1, 0, 1 };
    const size_t big[2] = { UINT32_MAX, 2 }, bigk[2] = { 1, 1 };
    const size_t ok[2] = { 4, 4 }, zero_k[2] = { 1, 0 }, over_k[2] = { 5, 1 };

    cr_expect_eq(group_topk_create_segments(NULL, ok, ks, 2, &t), -EINVAL);
    cr_expect_eq(group_topk_create_segments(g, NULL, ks, 2, &t), -EINVAL);
    cr_expect_eq(group_topk_create_segments(g, ok, NULL, 2, &t), -EINVAL);
    cr_expect_eq(group_topk_create_segments(g, ok, ks, 0, &t), -EINVAL, "no segment");
    cr_expect_eq(group_topk_create_segments(g, sizes, ks, 3, &t), -EINVAL, "an empty segment");
    cr_expect_eq(group_topk_create_segments(g, ok, zero_k, 2, &t), -EINVAL, "a k_s of 0");
    cr_expect_eq(group_topk_create_segments(g, ok, over_k, 2, &t), -EINVAL, "k_s > size");
    cr_expect_eq(group_topk_create_segments(g, big, bigk, 2, &t), -EINVAL, "n over 2^32 - 1");
    cr_expect_null(t);
    group_destroy(g);
}

struct seg_mismatch {
    struct group *g;
    struct group_topk *t;
    const size_t *sizes, *ks;
    float x[64];
    int rc;
};

static void *seg_mismatch_main(void *arg)
{
    struct seg_mismatch *a = arg;

    for (size_t i = 0; i < 64; i++)
        a->x[i] = (float)i;
    a->rc = group_topk_reduce(a->t, a->x, DTYPE_SUM, 60000);
    return NULL;
}

/* The same n, k and bytes on the wire, but layers cut elsewhere: one
 * member's pairs would pass the other's range checks and not the other
 * way round, so the segments' hash fails both alike. */
Test(group_topk, different_segments_get_eproto_at_every_member_and_change_nothing)
{
    static const size_t s0[2] = { 32, 32 }, s1[2] = { 16, 48 }, ks[2] = { 4, 4 };
    struct seg_mismatch a[2] = { { .sizes = s0, .ks = ks }, { .sizes = s1, .ks = ks } };
    struct group *g[2];
    pthread_t th[2];

    a[0].g = g[0] = groups_make("y-0");
    a[1].g = g[1] = groups_make("y-1");
    for (int i = 0; i < 2; i++)
        cr_assert_eq(group_topk_create_segments(a[i].g, a[i].sizes, a[i].ks, 2, &a[i].t), 0);
    FIXTURE_WAIT_FOR(groups_all_see(g, 2), "the two members never shared an epoch");
    for (int i = 0; i < 2; i++)
        cr_assert_eq(pthread_create(&th[i], NULL, seg_mismatch_main, &a[i]), 0);
    for (int i = 0; i < 2; i++)
        pthread_join(th[i], NULL);
    for (int i = 0; i < 2; i++) {
        cr_expect_eq(a[i].rc, -EPROTO, "member %d: %s", i, strerror(-a[i].rc));
        for (size_t j = 0; j < 64; j++) {
            cr_expect_eq(a[i].x[j], (float)j, "member %d's gradient, entry %zu", i, j);
            cr_expect_eq(group_topk_residual(a[i].t)[j], 0, "member %d's residual", i);
        }
        group_topk_destroy(a[i].t);
    }
    group_destroy(g[1]);
    group_destroy(g[0]);
}

/* Small segments are selected by sorting, large ones by the engine's
 * topk_select: both must pick exactly what topk_select picks, ties to the
 * lower index and NaN largest, on values full of ties, zeros of both
 * signs, infinities, NaNs and subnormals. Alone, a call's result is what
 * the member sent, and its residual what it kept. */
Test(group_topk, segments_select_exactly_as_topk_select_small_and_large)
{
    static const size_t sizes[] = { 1, 2, 7, 100, 1024, 1025, 3000, 5 };
    static const size_t ks[] = { 1, 1, 7, 13, 300, 2, 1000, 3 };
    enum { S = sizeof(sizes) / sizeof(sizes[0]) };
    const float vals[] = { 0.0f, -0.0f, 1.0f, -1.0f, 2.0f, -2.0f, NAN, -NAN, INFINITY,
                           -INFINITY, 1e-40f, 3.5f, -3.5f };
    struct group *g = groups_make("small");
    struct group_topk *t = NULL;
    size_t n = 0;
    float *x, *acc, *want, *kept;
    uint32_t *idx, seed = 12345;

    for (size_t s = 0; s < S; s++)
        n += sizes[s];
    x = calloc(n, sizeof(float));
    acc = calloc(n, sizeof(float));
    want = calloc(n, sizeof(float));
    kept = calloc(n, sizeof(float));
    idx = calloc(n, sizeof(uint32_t));
    cr_assert(x && acc && want && kept && idx);
    for (size_t i = 0; i < n; i++) {
        seed = seed * 1103515245u + 12345u;
        x[i] = vals[(seed >> 16) % (sizeof(vals) / sizeof(vals[0]))];
        acc[i] = x[i] + 0.0f;   /* as the reducer adds its zero residual */
        kept[i] = acc[i];
    }
    for (size_t s = 0, start = 0; s < S; start += sizes[s], s++) {
        cr_assert_eq(topk_select(acc + start, sizes[s], ks[s], idx), 0);
        for (size_t j = 0; j < ks[s]; j++) {
            want[start + idx[j]] = 0.0f + acc[start + idx[j]];
            kept[start + idx[j]] = 0;
        }
    }
    cr_assert_eq(group_topk_create_segments(g, sizes, ks, S, &t), 0);
    cr_assert_eq(group_wait(g, FIXTURE_WAIT_MS), 0);
    cr_assert_eq(group_topk_reduce(t, x, DTYPE_SUM, 20000), 0);
    for (size_t s = 0, start = 0; s < S; start += sizes[s], s++) {
        cr_expect_eq(memcmp(x + start, want + start, sizes[s] * sizeof(float)), 0,
                     "segment %zu (%zu entries): sent differs from topk_select's", s, sizes[s]);
        cr_expect_eq(memcmp(group_topk_residual(t) + start, kept + start,
                            sizes[s] * sizeof(float)), 0,
                     "segment %zu (%zu entries): kept differs from topk_select's", s, sizes[s]);
    }
    group_topk_destroy(t);
    group_destroy(g);
    free(x);
    free(acc);
    free(want);
    free(kept);
    free(idx);
}

/* tests/unit/test_matchmaker.c: the broker's matchmaking state machine
 * (membership/matchmaker.h) with an injected clock: grouping by prefix
 * and bits, the target and the minimum, timeouts, caps and bad input. */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "membership/matchmaker.h"

#define MAX_REC 64

/* What the callbacks saw. ctx values are small integers cast to pointers. */
static struct {
    size_t groups;
    uint64_t group_id[MAX_REC];
    size_t group_n[MAX_REC];
    char group_ids[MAX_REC][8][32];
    double group_bw[MAX_REC][8];
    bool group_client[MAX_REC][8];
    char group_schema[MAX_REC][MATCHMAKER_SCHEMA_MAX + 1];
    size_t fails;
    long fail_ctx[MAX_REC];
    int fail_err[MAX_REC];
    char fail_why[MAX_REC][320];
} rec;

static struct matchmaker *mm;
static long dead_ctx;           /* the ctx whose member has left; 0: none */

static void formed(void *arg, const struct matchmaker_group *g)
{
    size_t k = rec.groups++;

    cr_assert_lt(k, MAX_REC);
    rec.group_id[k] = g->id;
    rec.group_n[k] = g->n;
    memcpy(rec.group_schema[k], g->schema, g->schema_len);
    rec.group_schema[k][g->schema_len] = '\0';
    for (size_t i = 0; i < g->n && i < 8; i++) {
        snprintf(rec.group_ids[k][i], sizeof(rec.group_ids[k][i]), "%s", g->members[i].id);
        rec.group_bw[k][i] = g->members[i].bandwidth;
        rec.group_client[k][i] = g->members[i].client;
    }
}

static void failed(void *arg, void *ctx, int err, const char *why)
{
    size_t k = rec.fails++;

    if (k >= MAX_REC)           /* destroying a full matchmaker: counted only */
        return;
    rec.fail_ctx[k] = (long)(intptr_t)ctx;
    rec.fail_err[k] = err;
    snprintf(rec.fail_why[k], sizeof(rec.fail_why[k]), "%s", why);
}

static bool alive(void *arg, void *ctx)
{
    return (long)(intptr_t)ctx != dead_ctx;
}

static void start(void)
{
    struct matchmaker_ops ops = { .formed = formed, .failed = failed, .alive = alive };

    memset(&rec, 0, sizeof(rec));
    dead_ctx = 0;
    cr_assert_eq(matchmaker_create(&ops, 100, &mm), 0);
}

static void stop(void)
{
    matchmaker_destroy(mm);
}

TestSuite(matchmaker, .init = start, .fini = stop);

static struct matchmaker_request req(const char *id, const char *bits, long ctx)
{
    return (struct matchmaker_request){
        .cohort = "demo", .id = id, .address = "127.0.0.1:7000", .prefix = "run/avg",
        .bits = bits, .target = 4, .min = 2, .min_wait_ms = 1000, .timeout_ms = 5000,
        .schema = "f32x8", .schema_len = 5, .ctx = (void *)(intptr_t)ctx,
    };
}

static int submit(uint64_t now, const struct matchmaker_request *r)
{
    char why[256] = "";

    return matchmaker_submit(mm, now, r, why, sizeof(why));
}

Test(matchmaker, target_forms_at_once_in_id_order)
{
    const char *ids[] = { "w-10", "w-2", "w-1", "w-3" };

    for (int i = 0; i < 4; i++) {
        struct matchmaker_request r = req(ids[i], "01", i + 1);
        cr_assert_eq(submit(10, &r), 0);
    }
    cr_assert_eq(rec.groups, 1);
    cr_assert_eq(rec.group_n[0], 4);
    cr_assert_eq(rec.group_id[0], 100);
    /* natural order: w-1 < w-2 < w-3 < w-10 */
    cr_assert_str_eq(rec.group_ids[0][0], "w-1");
    cr_assert_str_eq(rec.group_ids[0][1], "w-2");
    cr_assert_str_eq(rec.group_ids[0][2], "w-3");
    cr_assert_str_eq(rec.group_ids[0][3], "w-10");
    cr_assert_eq(matchmaker_pending(mm, NULL), 0);
}

Test(matchmaker, min_group_forms_after_the_wait_not_before)
{
    struct matchmaker_request a = req("a", "", 1), b = req("b", "", 2);

    cr_assert_eq(submit(0, &a), 0);
    cr_assert_eq(submit(10, &b), 0);
    cr_assert_eq(rec.groups, 0);
    cr_assert_eq(matchmaker_tick(mm, 500), 500);  /* due at 1000 */
    cr_assert_eq(rec.groups, 0);
    matchmaker_tick(mm, 1000);
    cr_assert_eq(rec.groups, 1);
    cr_assert_eq(rec.group_n[0], 2);
}

Test(matchmaker, bits_and_prefix_keep_groups_apart)
{
    struct matchmaker_request r;

    r = req("a", "0", 1);
    cr_assert_eq(submit(0, &r), 0);
    r = req("b", "1", 2);
    cr_assert_eq(submit(0, &r), 0);
    r = req("c", "0", 3);
    r.prefix = "other";
    cr_assert_eq(submit(0, &r), 0);
    matchmaker_tick(mm, 2000);
    cr_assert_eq(rec.groups, 0, "no bucket holds two");
    r = req("d", "1", 4);
    cr_assert_eq(submit(2000, &r), 0);      /* past b's wait: forms at once */
    cr_assert_eq(rec.groups, 1);
    cr_assert_str_eq(rec.group_ids[0][0], "b");
    cr_assert_str_eq(rec.group_ids[0][1], "d");
}

Test(matchmaker, too_few_fail_at_the_timeout_with_a_count)
{
    struct matchmaker_request a = req("a", "1", 7);

    cr_assert_eq(submit(0, &a), 0);
    matchmaker_tick(mm, 4999);
    cr_assert_eq(rec.fails, 0);
    matchmaker_tick(mm, 5000);
    cr_assert_eq(rec.fails, 1);
    cr_assert_eq(rec.fail_ctx[0], 7);
    cr_assert_eq(rec.fail_err[0], -ETIMEDOUT);
    cr_assert(strstr(rec.fail_why[0], "1 of at least 2"), "%s", rec.fail_why[0]);
    cr_assert_eq(matchmaker_pending(mm, NULL), 0);
}

Test(matchmaker, disagreeing_sizes_or_schema_are_refused_and_change_nothing)
{
    struct matchmaker_request a = req("a", "", 1), b = req("b", "", 2);
    char why[256];

    cr_assert_eq(submit(0, &a), 0);
    b.target = 8;
    cr_assert_eq(matchmaker_submit(mm, 0, &b, why, sizeof(why)), -EPROTO);
    cr_assert(strstr(why, "group size"), "%s", why);
    b = req("b", "", 2);
    b.schema = "f32x9";
    cr_assert_eq(matchmaker_submit(mm, 0, &b, why, sizeof(why)), -EPROTO);
    cr_assert(strstr(why, "schema"), "%s", why);
    cr_assert_eq(matchmaker_pending(mm, "demo"), 1);
    cr_assert_eq(rec.fails, 0);
}

Test(matchmaker, asking_again_replaces_the_earlier_request)
{
    struct matchmaker_request a = req("a", "0", 1), a2 = req("a", "1", 2);

    cr_assert_eq(submit(0, &a), 0);
    cr_assert_eq(submit(1, &a2), 0);
    cr_assert_eq(rec.fails, 1);
    cr_assert_eq(rec.fail_ctx[0], 1);
    cr_assert_eq(rec.fail_err[0], -ECANCELED);
    cr_assert_eq(matchmaker_pending(mm, NULL), 1);
}

Test(matchmaker, cancel_forgets_without_a_callback)
{
    struct matchmaker_request a = req("a", "", 1);

    cr_assert_eq(submit(0, &a), 0);
    matchmaker_cancel(mm, (void *)(intptr_t)1);
    matchmaker_cancel(mm, (void *)(intptr_t)99);        /* none: nothing */
    cr_assert_eq(matchmaker_pending(mm, NULL), 0);
    matchmaker_tick(mm, 10000);
    cr_assert_eq(rec.fails, 0);
}

Test(matchmaker, bad_input_is_refused_with_a_reason)
{
    struct matchmaker_request r;
    char why[256], longp[MATCHMAKER_PREFIX_MAX + 2], longb[MATCHMAKER_BITS_MAX + 2];

    memset(longp, 'p', sizeof(longp) - 1);
    longp[sizeof(longp) - 1] = '\0';
    memset(longb, '0', sizeof(longb) - 1);
    longb[sizeof(longb) - 1] = '\0';
    r = req("a", "012", 1);
    cr_assert_eq(matchmaker_submit(mm, 0, &r, why, sizeof(why)), -EINVAL);
    cr_assert(strstr(why, "bits"), "%s", why);
    r = req("a", longb, 1);
    cr_assert_eq(matchmaker_submit(mm, 0, &r, why, sizeof(why)), -EINVAL);
    r = req("a", "", 1);
    r.prefix = longp;
    cr_assert_eq(matchmaker_submit(mm, 0, &r, why, sizeof(why)), -EINVAL);
    cr_assert(strstr(why, "prefix"), "%s", why);
    r.prefix = "bad prefix";
    cr_assert_eq(matchmaker_submit(mm, 0, &r, why, sizeof(why)), -EINVAL);
    r = req("a", "", 1);
    r.target = MATCHMAKER_GROUP_MAX + 1;
    cr_assert_eq(matchmaker_submit(mm, 0, &r, why, sizeof(why)), -EINVAL);
    r = req("a", "", 1);
    r.min = 5;
    cr_assert_eq(matchmaker_submit(mm, 0, &r, why, sizeof(why)), -EINVAL);
    r = req("a", "", 1);
    r.min_wait_ms = 6000;
    cr_assert_eq(matchmaker_submit(mm, 0, &r, why, sizeof(why)), -EINVAL);
    r = req("a", "", 1);
    r.timeout_ms = MATCHMAKER_TIMEOUT_MAX_MS + 1;
    cr_assert_eq(matchmaker_submit(mm, 0, &r, why, sizeof(why)), -EINVAL);
    r = req("a", "", 1);
    r.schema_len = MATCHMAKER_SCHEMA_MAX + 1;
    cr_assert_eq(matchmaker_submit(mm, 0, &r, why, sizeof(why)), -EINVAL);
    r = req("a", "", 1);
    r.address = "nope";
    cr_assert_eq(matchmaker_submit(mm, 0, &r, why, sizeof(why)), -EINVAL);
    cr_assert_eq(matchmaker_pending(mm, NULL), 0);
}

Test(matchmaker, waiting_requests_per_cohort_are_capped)
{
    char id[32], why[256];
    struct matchmaker_request r;

    /* Each in a bucket of its own, so that none forms. */
    for (unsigned i = 0; i < MATCHMAKER_PENDING_MAX; i++) {
        snprintf(id, sizeof(id), "w-%u", i);
        r = req(id, "", i + 1);
        r.prefix = id;
        cr_assert_eq(submit(0, &r), 0);
    }
    r = req("late", "", 99999);
    cr_assert_eq(matchmaker_submit(mm, 0, &r, why, sizeof(why)), -ENOSPC);
    cr_assert(strstr(why, "too many"), "%s", why);
    cr_assert_eq(rec.fails, 0, "the refusal changed nothing");
    r = req("w-0", "", 100000);             /* asking again takes no more room */
    r.prefix = "w-0";
    cr_assert_eq(matchmaker_submit(mm, 0, &r, why, sizeof(why)), 0, "%s", why);
    cr_assert_eq(rec.fails, 1);
    cr_assert_eq(rec.fail_err[0], -ECANCELED);
    r = req("late", "", 99999);
    r.cohort = "other";
    cr_assert_eq(matchmaker_submit(mm, 0, &r, why, sizeof(why)), 0, "another cohort has room");
    cr_assert_eq(matchmaker_pending(mm, "demo"), MATCHMAKER_PENDING_MAX);
}

Test(matchmaker, destroy_fails_the_waiting)
{
    struct matchmaker_request a = req("a", "", 5);

    cr_assert_eq(submit(0, &a), 0);
    matchmaker_destroy(mm);
    mm = NULL;
    cr_assert_eq(rec.fails, 1);
    cr_assert_eq(rec.fail_err[0], -ESHUTDOWN);
}

Test(matchmaker, group_ids_grow)
{
    for (int g = 0; g < 3; g++) {
        struct matchmaker_request r;
        char id[16];

        for (int i = 0; i < 4; i++) {
            snprintf(id, sizeof(id), "w-%d", i);
            r = req(id, "", g * 4 + i + 1);
            cr_assert_eq(submit(g, &r), 0);
        }
    }
    cr_assert_eq(rec.groups, 3);
    cr_assert_eq(rec.group_id[0], 100);
    cr_assert_eq(rec.group_id[1], 101);
    cr_assert_eq(rec.group_id[2], 102);
}

Test(matchmaker, a_member_that_left_while_waiting_is_dropped_not_grouped)
{
    struct matchmaker_request a = req("a", "", 1), b = req("b", "", 2), c = req("c", "", 3);

    cr_assert_eq(submit(0, &a), 0);
    cr_assert_eq(submit(0, &b), 0);
    dead_ctx = 1;                       /* "a" left the cohort */
    matchmaker_tick(mm, 1000);          /* due, but only "b" is alive: not enough */
    cr_assert_eq(rec.groups, 0);
    cr_assert_eq(rec.fails, 1);
    cr_assert_eq(rec.fail_ctx[0], 1);
    cr_assert_eq(rec.fail_err[0], -ENOENT);
    cr_assert_eq(matchmaker_pending(mm, NULL), 1);
    cr_assert_eq(submit(1001, &c), 0);  /* past the wait: forms at once */
    cr_assert_eq(rec.groups, 1);
    cr_assert_str_eq(rec.group_ids[0][0], "b");
    cr_assert_str_eq(rec.group_ids[0][1], "c");
}

/* Each member's bandwidth and client flag reach the group as it asked,
 * with its id; a bandwidth not given arrives negative. */
Test(matchmaker, bandwidth_and_client_mode_travel_with_each_member)
{
    struct matchmaker_request a = req("m-2", "", 1), b = req("m-10", "", 2), c = req("m-1", "", 3),
                              d = req("m-3", "", 4);

    a.has_bandwidth = true;
    a.bandwidth = 2.5;
    b.client = true;
    d.has_bandwidth = true;
    d.bandwidth = 0;
    cr_assert_eq(submit(0, &a), 0);
    cr_assert_eq(submit(0, &b), 0);
    cr_assert_eq(submit(0, &c), 0);
    cr_assert_eq(submit(0, &d), 0);
    cr_assert_eq(rec.groups, 1);
    /* Natural order: m-1, m-2, m-3, m-10. */
    cr_assert_str_eq(rec.group_ids[0][0], "m-1");
    cr_assert_lt(rec.group_bw[0][0], 0, "not given");
    cr_assert(!rec.group_client[0][0]);
    cr_assert_eq(rec.group_bw[0][1], 2.5);
    cr_assert_eq(rec.group_bw[0][2], 0.0);
    cr_assert_str_eq(rec.group_ids[0][3], "m-10");
    cr_assert(rec.group_client[0][3]);
}

Test(matchmaker, a_bandwidth_out_of_range_is_refused)
{
    double bad[] = { -1, NAN, INFINITY, 2e15 };
    char why[256];

    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        struct matchmaker_request r = req("m-1", "", 1);

        r.has_bandwidth = true;
        r.bandwidth = bad[i];
        cr_assert_eq(matchmaker_submit(mm, 0, &r, why, sizeof(why)), -EINVAL, "%g", bad[i]);
        cr_assert(strstr(why, "bandwidth"), "%s", why);
    }
    cr_assert_eq(matchmaker_pending(mm, NULL), 0, "nothing changed");
}

/* Requests for any schema (auxiliary averagers without tensors) wait
 * until one with a schema comes, whatever the wait or their number; the
 * group carries that schema; they leave it a place; one that gives a
 * schema too is refused. */
Test(matchmaker, requests_for_any_schema_wait_for_one_that_gives_it)
{
    struct matchmaker_request w1 = req("w-1", "", 1), w2 = req("w-2", "", 2), w3 = req("w-3", "", 3),
                              s1 = req("s-1", "", 4), bad = req("w-4", "", 5);
    char why[256];

    w1.any_schema = w2.any_schema = w3.any_schema = bad.any_schema = true;
    w1.schema_len = w2.schema_len = w3.schema_len = 0;
    cr_assert_eq(submit(0, &w1), 0);
    cr_assert_eq(submit(0, &w2), 0);
    cr_assert_eq(matchmaker_tick(mm, 2000) > 0, true);
    cr_assert_eq(rec.groups, 0, "two of min 2 waited past the wait, but neither has a schema");
    cr_assert_eq(submit(2000, &w3), 0);
    /* Three of target 4 give no schema: a fourth would fill the bucket. */
    bad.schema_len = 0;
    bad.id = "w-5";
    cr_assert_eq(matchmaker_submit(mm, 2000, &bad, why, sizeof(why)), -ENOSPC);
    cr_assert(strstr(why, "wait for one with tensors"), "%s", why);
    cr_assert_eq(submit(2100, &s1), 0);
    cr_assert_eq(rec.groups, 1, "the target arrived with a schema");
    cr_assert_eq(rec.group_n[0], 4);
    cr_assert_str_eq(rec.group_schema[0], "f32x8");
    cr_assert_eq(matchmaker_pending(mm, NULL), 0);
    bad = req("w-6", "", 6);
    bad.any_schema = true;
    cr_assert_eq(matchmaker_submit(mm, 3000, &bad, why, sizeof(why)), -EINVAL);
    cr_assert(strstr(why, "any schema"), "%s", why);
}

/* A request for any schema joins a bucket whose schema is set, and a
 * request with another schema is still refused there. */
Test(matchmaker, any_schema_joins_a_set_schema_that_still_refuses_others)
{
    struct matchmaker_request s1 = req("s-1", "", 1), w1 = req("w-1", "", 2),
                              other = req("s-2", "", 3);
    char why[256];

    w1.any_schema = true;
    w1.schema_len = 0;
    other.schema = "f32x9";
    cr_assert_eq(submit(0, &s1), 0);
    cr_assert_eq(submit(0, &w1), 0);
    cr_assert_eq(matchmaker_submit(mm, 0, &other, why, sizeof(why)), -EPROTO);
    matchmaker_tick(mm, 1000);
    cr_assert_eq(rec.groups, 1);
    cr_assert_eq(rec.group_n[0], 2);
    cr_assert_str_eq(rec.group_schema[0], "f32x8");
}

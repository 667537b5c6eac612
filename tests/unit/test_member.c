/* tests/unit/test_member.c: the member's side of unreachability reports
 * (member_report_unreachable) against the broker service over real gRPC
 * on loopback: a member that finds more peers unreachable at once than
 * one heartbeat carries (WIRE_LOST_PEERS_MAX) queues the rest and sends
 * them in the following heartbeats, at a pace the broker's stream allows,
 * and the broker counts every one; reports the member cannot make are
 * refused and queue nothing. */
#include <criterion/criterion.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "base/clock.h"
#include "fixture.h"
#include "membership/brokerd.h"
#include "membership/epoch.h"
#include "membership/member.h"
#include "membership/wire.h"

/* A partition of an epoch of SIDE_A + SIDE_B: each member of side A finds
 * all of side B unreachable at once, more than two heartbeats carry. A
 * member of side B is evicted only with every report of side A: more
 * than half of the epoch is all of side A. */
#define SIDE_A 41u
#define SIDE_B 40u
#define ALL (SIDE_A + SIDE_B)
#define TIMEOUT_MS 1500u        /* the fixture broker's member timeout */

static struct brokerd *d;
static char addr[64];
static struct member *ms[ALL];
static char ids[ALL][16];
static atomic_bool stop_polling;
static pthread_t poller;

static void *poll_all(void *arg)
{
    (void)arg;
    while (!atomic_load(&stop_polling)) {
        for (size_t i = 0; i < ALL; i++)
            member_poll(ms[i], clock_now_ms());
        clock_sleep_ms(5);
    }
    return NULL;
}

/* The fixture's broker (200 ms heartbeats, a 1.5 s member timeout) with
 * room for the whole epoch, and ALL members of "demo" polled by a thread
 * of their own, as a node polls its member. */
static void start(void)
{
    struct brokerd_config cfg;

    fixture_broker_config(&cfg);
    cfg.broker.max_members = ALL;
    d = fixture_broker_start_with(&cfg, "demo", addr, sizeof(addr));
    for (size_t i = 0; i < ALL; i++) {
        struct member_config mc = { .broker = addr, .cohort = "demo", .id = ids[i],
                                    .address = "127.0.0.1:4000", .quiet = true };

        snprintf(ids[i], sizeof(ids[i]), "m-%zu", i);
        cr_assert_eq(member_create(&mc, &ms[i]), 0);
    }
    atomic_store(&stop_polling, false);
    cr_assert_eq(pthread_create(&poller, NULL, poll_all, NULL), 0);
}

static void stop(void)
{
    atomic_store(&stop_polling, true);
    pthread_join(poller, NULL);
    for (size_t i = 0; i < ALL; i++)
        member_destroy(ms[i]);
    fixture_broker_stop(d);
}

TestSuite(member, .init = start, .fini = stop, .timeout = 120);

/* The number of member i's latest epoch when it holds exactly members
 * [0, n), else 0. */
static uint64_t epoch_of_first(size_t i, size_t n)
{
    struct epoch *e = member_epoch(ms[i]);
    uint64_t number = 0;

    if (e && e->n_members == n) {
        number = e->number;
        for (size_t k = 0; k < n; k++)
            if (epoch_find(e, ids[k]) < 0)
                number = 0;
    }
    epoch_unref(e);
    return number;
}

/* Whether members [0, upto) all hold the same epoch of members [0, n). */
static bool agree_on_first(size_t upto, size_t n)
{
    uint64_t number = epoch_of_first(0, n);

    for (size_t i = 1; number && i < upto; i++)
        if (epoch_of_first(i, n) != number)
            return false;
    return number != 0;
}

/* Whether members [from, to) have each joined more than once. */
static bool all_rejoined(size_t from, size_t to)
{
    for (size_t i = from; i < to; i++)
        if (member_joins(ms[i]) < 2)
            return false;
    return true;
}

/* What an engine of side A does every member timeout while the cut
 * lasts: reports each member of side B in its latest epoch again. */
static void report_side_b_again(void)
{
    for (size_t i = 0; i < SIDE_A; i++) {
        struct epoch *e = member_epoch(ms[i]);

        for (size_t k = SIDE_A; e && k < ALL; k++) {
            int rc;

            if (epoch_find(e, ids[k]) < 0)
                continue;
            rc = member_report_unreachable(ms[i], ids[k], e->number);
            /* -ESTALE: a newer epoch arrived meanwhile. */
            cr_assert(rc == 0 || rc == -ESTALE, "m-%zu about %s: %d", i, ids[k], rc);
        }
        epoch_unref(e);
    }
}

Test(member, a_side_of_a_partition_is_reported_in_full_over_the_following_heartbeats)
{
    uint64_t e;

    FIXTURE_WAIT_FOR(agree_on_first(ALL, ALL), "the %u members never agreed on one epoch", ALL);
    e = epoch_of_first(0, ALL);

    /* Reports the member cannot make queue nothing. */
    cr_assert_eq(member_report_unreachable(ms[0], ids[0], e), -EINVAL, "itself");
    cr_assert_eq(member_report_unreachable(ms[0], "m-9999", e), -ENOENT, "not in the epoch");
    cr_assert_eq(member_report_unreachable(ms[0], ids[SIDE_A], e - 1), -ESTALE);
    cr_assert_eq(member_report_unreachable(ms[0], ids[SIDE_A], e + 1), -ESTALE);

    /* Side A finds all of side B at once, as after a cut, each member
     * in its own order (an engine probes from where its last round
     * ended), and reports each one again (the engine repeats a report
     * every timeout): queued once. Only the first WIRE_LOST_PEERS_MAX fit
     * a heartbeat, so every member of side B is in some member's third
     * heartbeat, and none is evicted before those arrive: no epoch forms
     * while the queues drain. */
    cr_assert_gt(SIDE_B, 2 * WIRE_LOST_PEERS_MAX);
    for (size_t i = 0; i < SIDE_A; i++)
        for (size_t j = 0; j < SIDE_B; j++) {
            size_t k = SIDE_A + (i + j) % SIDE_B;

            cr_assert_eq(member_report_unreachable(ms[i], ids[k], e), 0, "m-%zu about %s", i,
                         ids[k]);
            cr_assert_eq(member_report_unreachable(ms[i], ids[k], e), 0);
        }

    /* Every member of side B needs every report of side A: each is
     * evicted (and, once its bench of a timeout is over, joins again)
     * only if each member of side A sent all 40 within the broker's
     * report window. Evictions form a new epoch, which drops what is
     * still queued; the engine reports again every member timeout while
     * the cut lasts, and so does side A here. */
    for (uint64_t end = fixture_deadline(FIXTURE_WAIT_MS), again = clock_now_ms() + TIMEOUT_MS;
         !all_rejoined(SIDE_A, ALL) && fixture_before(end); clock_sleep_ms(FIXTURE_POLL_MS)) {
        if (clock_now_ms() >= again) {
            report_side_b_again();
            again = clock_now_ms() + TIMEOUT_MS;
        }
    }
    cr_assert(all_rejoined(SIDE_A, ALL),
              "not every member of side B was evicted: some reports were never sent");
    /* The reports went out at a pace the broker took: no stream of side
     * A was ended for flooding, so none had to join again. */
    for (size_t i = 0; i < SIDE_A; i++)
        cr_assert_eq(member_joins(ms[i]), 1, "m-%zu joined %llu times", i,
                     (unsigned long long)member_joins(ms[i]));
}

/* Reports are made for the epoch the member runs in: once the next one
 * arrives, those of the older one are refused, and so are those about a
 * member that left with it. */
Test(member, reports_follow_the_latest_epoch)
{
    uint64_t e, e2;

    FIXTURE_WAIT_FOR(agree_on_first(ALL, ALL), "the %u members never agreed on one epoch", ALL);
    e = epoch_of_first(0, ALL);
    for (size_t k = SIDE_A; k < ALL; k++)
        cr_assert_eq(member_report_unreachable(ms[0], ids[k], e), 0);
    cr_assert_eq(member_leave(ms[ALL - 1], 2000), 0);
    FIXTURE_WAIT_FOR(agree_on_first(ALL - 1, ALL - 1), "the leave formed no epoch");
    e2 = epoch_of_first(0, ALL - 1);
    cr_assert_gt(e2, e);
    cr_assert_eq(member_report_unreachable(ms[0], ids[SIDE_A], e), -ESTALE);
    cr_assert_eq(member_report_unreachable(ms[0], ids[ALL - 1], e2), -ENOENT);
    cr_assert_eq(member_report_unreachable(ms[0], ids[SIDE_A], e2), 0);
}

/* tests/unit/test_heartbeat.c: the thread that polls a node's, a group's
 * or an averager's member (heartbeat.h), against the broker service on
 * loopback: it joins the member and keeps it joined, asks its owner
 * before each poll and polls nothing until the owner is ready, passes the
 * member's refusals of a report through, and stops for good. */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdatomic.h>
#include <stddef.h>

#include "fixture.h"
#include "membership/brokerd.h"
#include "membership/heartbeat.h"
#include "membership/member.h"

static struct brokerd *d;
static char addr[64];
static struct member *m;

/* The member timeout: fifteen of the fixture's 200 ms heartbeat
 * intervals, so that only a thread that stopped sending, not a loaded
 * machine, gets the member evicted. */
#define TIMEOUT_MS 3000u

static void start(void)
{
    struct member_config mc = { .cohort = "demo", .id = "m-0", .address = "127.0.0.1:4000",
                                .quiet = true };
    struct brokerd_config cfg;

    fixture_broker_config(&cfg);
    cfg.broker.timeout_ms = TIMEOUT_MS;
    d = fixture_broker_start_with(&cfg, "demo", addr, sizeof(addr));
    mc.broker = addr;
    cr_assert_eq(member_create(&mc, &m), 0);
}

static void stop(void)
{
    member_destroy(m);
    m = NULL;
    fixture_broker_stop(d);
}

TestSuite(heartbeat, .init = start, .fini = stop, .timeout = 120);

struct owner {
    atomic_bool ready;
    atomic_uint asked;
};

static bool owner_ready(void *arg)
{
    struct owner *o = arg;

    atomic_fetch_add(&o->asked, 1);
    return atomic_load(&o->ready);
}

Test(heartbeat, create_refuses_no_member)
{
    struct heartbeat *h = NULL;

    cr_assert_eq(heartbeat_create(NULL, NULL, NULL, &h), -EINVAL);
    cr_assert_null(h);
    cr_assert_eq(heartbeat_create(m, NULL, NULL, NULL), -EINVAL);
    heartbeat_destroy(NULL);
}

Test(heartbeat, joins_the_member_and_keeps_it_in_the_cohort)
{
    struct heartbeat *h;

    cr_assert_eq(heartbeat_create(m, NULL, NULL, &h), 0);
    FIXTURE_WAIT_FOR(member_in_cohort(m), "the member never joined");
    /* Watched through two member timeouts: only heartbeats sent all along
     * keep it from being evicted and joining again. A window, not a wait:
     * nothing ends it sooner. */
    for (uint64_t end = fixture_deadline(2 * TIMEOUT_MS); fixture_before(end);) {
        cr_assert(member_in_cohort(m), "the member fell out of the cohort");
        clock_sleep_ms(FIXTURE_POLL_MS);
    }
    cr_assert_eq(member_joins(m), 1, "joined %llu times", (unsigned long long)member_joins(m));
    heartbeat_stop(h);
    cr_assert_eq(member_leave(m, 5000), 0);
    heartbeat_destroy(h);
}

Test(heartbeat, polls_nothing_until_its_owner_is_ready)
{
    struct owner o = { .ready = false, .asked = 0 };
    struct heartbeat *h;

    cr_assert_eq(heartbeat_create(m, owner_ready, &o, &h), 0);
    FIXTURE_WAIT_FOR(atomic_load(&o.asked) >= 5, "the owner was asked %u times",
                     atomic_load(&o.asked));
    /* Asked five times and never polled: nothing went to the broker. */
    cr_assert_eq(member_joins(m), 0);
    cr_assert_not(member_in_cohort(m));
    atomic_store(&o.ready, true);
    heartbeat_wake(h);
    FIXTURE_WAIT_FOR(member_in_cohort(m), "the member never joined once its owner was ready");
    heartbeat_destroy(h);
}

Test(heartbeat, passes_the_members_refusals_of_a_report_through)
{
    struct owner o = { .ready = false, .asked = 0 };
    struct heartbeat *h;

    cr_assert_eq(heartbeat_create(m, owner_ready, &o, &h), 0);
    cr_assert_eq(heartbeat_report_lost(h, "m-0"), -EINVAL, "its own id");
    cr_assert_eq(heartbeat_report_lost(h, "no spaces allowed"), -EINVAL);
    cr_assert_eq(heartbeat_report_unreachable(h, "m-1", 1), -EOPNOTSUPP, "not joined");
    cr_assert_eq(heartbeat_report_lost(h, "m-1"), 0);
    heartbeat_destroy(h);
}

Test(heartbeat, stops_for_good_and_still_takes_reports)
{
    struct heartbeat *h;
    uint64_t joins;

    cr_assert_eq(heartbeat_create(m, NULL, NULL, &h), 0);
    FIXTURE_WAIT_FOR(member_in_cohort(m), "the member never joined");
    heartbeat_stop(h);
    heartbeat_stop(h);
    /* A run in flight may fail after its owner stopped polling: the
     * report is queued, and wakes a thread that is gone. */
    cr_assert_eq(heartbeat_report_lost(h, "m-1"), 0);
    heartbeat_wake(h);
    joins = member_joins(m);
    cr_assert_eq(member_leave(m, 5000), 0);
    cr_assert_eq(member_joins(m), joins);
    heartbeat_destroy(h);
}

/* tests/unit/test_broker_timeouts.c: how members leave the broker state
 * machine: eviction after the member timeout (the cohort's or the
 * member's own), heartbeats that keep them, graceful leaves, and the tick's
 * report of its next deadline; under the fake host of fixture.h, on an
 * injected clock. */
#include <criterion/criterion.h>

#include <errno.h>

#include "fixture.h"
#include "membership/broker.h"

/* A distinct address that stands in for the host's watcher handle. */
static int wb;

/* ---- eviction and heartbeats ---- */

Test(broker, tick_evicts_after_timeout_not_before)
{
    fixture_sm_start_ab();
    cr_assert_eq(broker_watch(fixture_sm, "demo", "b", 12, &wb), 0);
    cr_assert_eq(fixture_sm_beat(FIXTURE_T0 + 4000, "demo", "a", 11, 1, false, NULL), 0);

    cr_assert_eq(fixture_sm_tick_members(FIXTURE_T0 + 5000), 2);
    fixture_sm_assert_detached(-ETIMEDOUT, 0, NULL);        /* not before its timeout */
    cr_assert_eq(fixture_sm_tick_members(FIXTURE_T0 + 5001), 1);
    fixture_sm_assert_detached(-ETIMEDOUT, 1, (void *[]){ &wb });

    broker_tick(fixture_sm, FIXTURE_T0 + 5051);
    cr_assert_eq(fixture_sm_last_pub()->number, 2);
    fixture_sm_assert_members(fixture_sm_last_pub(), 1, (const char *[]){ "a" });
    cr_assert_eq(fixture_sm_beat(FIXTURE_T0 + 5051, "demo", "b", 12, 1, false, NULL), -ENOENT);
}

Test(broker, heartbeat_keeps_member_alive)
{
    fixture_sm_start_ab();
    for (uint64_t t = FIXTURE_T0 + 1000; t <= FIXTURE_T0 + 20000; t += 1000) {
        cr_assert_eq(fixture_sm_beat(t, "demo", "a", 11, 1, false, NULL), 0);
        cr_assert_eq(fixture_sm_beat(t, "demo", "b", 12, 1, false, NULL), 0);
        broker_tick(fixture_sm, t + 500);
    }
    cr_assert_eq(fixture_host.n_pubs, 1);
    cr_assert_eq(fixture_sm_members("demo"), 2);
}

Test(broker, heartbeat_rejects_wrong_session)
{
    static const struct {
        const char *cohort, *id;
        uint64_t session;
    } bad[] = {
        { "demo", "a", 12 }, { "demo", "a", 0 }, { "demo", "zz", 11 }, { "demo", NULL, 11 },
        { NULL, "a", 11 },
    };

    fixture_sm_start_ab();
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        cr_assert_eq(fixture_sm_beat(FIXTURE_HOLD, bad[i].cohort, bad[i].id, bad[i].session, 1,
                                     false, NULL), -ENOENT, "heartbeat %zu", i);

    /* A wrong session is not a heartbeat: a is still evicted on time. */
    cr_assert_eq(fixture_sm_beat(FIXTURE_T0 + 4000, "demo", "a", 99, 1, false, NULL), -ENOENT);
    cr_assert_eq(fixture_sm_tick_members(FIXTURE_T0 + 5001), 0);
}

Test(broker, heartbeat_reports_latest_epoch)
{
    uint64_t epoch = 99;

    fixture_sm_start(NULL);
    cr_assert_eq(fixture_sm_join("a", 0, 1, FIXTURE_T0), 0);
    cr_assert_eq(fixture_sm_beat(FIXTURE_T0 + 1000, "demo", "a", 1, 0, false, &epoch), 0);
    cr_assert_eq(epoch, 0);
    broker_tick(fixture_sm, FIXTURE_HOLD);
    cr_assert_eq(fixture_sm_beat(FIXTURE_HOLD + 1, "demo", "a", 1, 0, false, &epoch), 0);
    cr_assert_eq(epoch, 1);
}

/* ---- a member's own timings ---- */

/* Member a asking for a 100 ms heartbeat and a 300 ms timeout. */
static const struct broker_join fast_a = {
    .cohort = "demo", .id = "a", .address = FIXTURE_ADDR, .session = 1,
    .heartbeat_ms = 100, .timeout_ms = 300,
};

Test(broker, join_timeout_override_applies_to_member)
{
    fixture_sm_start(NULL);
    fixture_sm_join_timed(&fast_a, FIXTURE_T0, 100, 300);
    cr_assert_eq(fixture_sm_tick_members(FIXTURE_T0 + 300), 1);
    cr_assert_eq(fixture_sm_tick_members(FIXTURE_T0 + 301), 0);
}

Test(broker, rejoin_with_shorter_timeout_is_evicted_on_time)
{
    fixture_sm_start(NULL);
    cr_assert_eq(fixture_sm_join("a", 0, 1, FIXTURE_T0), 0);
    broker_tick(fixture_sm, FIXTURE_T0 + 10);
    fixture_sm_join_timed(&fast_a, FIXTURE_T0 + 100, 100, 300);
    cr_assert_eq(broker_tick(fixture_sm, FIXTURE_T0 + 110), 291);
    cr_assert_eq(fixture_sm_tick_members(FIXTURE_T0 + 401), 0);
}

Test(broker, join_rejects_timeout_not_above_heartbeat)
{
    static const struct {
        uint32_t heartbeat_ms, timeout_ms;
    } bad[] = {
        { 500, 500 },
        { 6000, 0 },            /* above the cohort's 5000 ms timeout */
        { 0, 1000 },            /* not above the cohort's 1000 ms heartbeat */
    };
    struct broker_join j = { .cohort = "demo", .id = "a", .address = FIXTURE_ADDR, .session = 1 };
    struct broker_join_result res;

    fixture_sm_start(NULL);
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        j.heartbeat_ms = bad[i].heartbeat_ms;
        j.timeout_ms = bad[i].timeout_ms;
        cr_assert_eq(broker_join(fixture_sm, FIXTURE_T0, &j, &res), -EINVAL, "join %zu", i);
    }
    cr_assert_eq(fixture_sm_members("demo"), 0);
}

/* A join may not make its member's silence cost the cohort more than the
 * cap: 2^32-1 ms asked, 10 min granted, and the member is evicted then. */
Test(broker, join_timeout_is_capped)
{
    struct broker_join j = { .cohort = "demo", .id = "evil", .address = FIXTURE_ADDR,
                             .session = 7, .timeout_ms = UINT32_MAX };

    fixture_sm_start(NULL);
    fixture_sm_join_timed(&j, FIXTURE_T0, 1000, BROKER_MEMBER_TIMEOUT_CAP_MS);
    cr_assert_eq(fixture_sm_tick_members(FIXTURE_T0 + BROKER_MEMBER_TIMEOUT_CAP_MS), 1);
    cr_assert_eq(fixture_sm_tick_members(FIXTURE_T0 + BROKER_MEMBER_TIMEOUT_CAP_MS + 1), 0);
    /* A heartbeat as long as the capped timeout is refused, as any
     * timeout not above its heartbeat is. */
    j.heartbeat_ms = BROKER_MEMBER_TIMEOUT_CAP_MS;
    j.session = 8;
    cr_assert_eq(broker_join(fixture_sm, FIXTURE_T0 + 700000, &j, NULL), -EINVAL);
}

/* ---- leaving ---- */

Test(broker, leave_takes_effect_at_next_tick)
{
    fixture_sm_start_ab();
    cr_assert_eq(broker_watch(fixture_sm, "demo", "b", 12, &wb), 0);
    cr_assert_eq(broker_leave(fixture_sm, FIXTURE_HOLD + 100, "demo", "b", 12), 0);
    fixture_sm_assert_detached(-ENOENT, 1, (void *[]){ &wb });
    cr_assert_eq(fixture_sm_members("demo"), 1);

    broker_tick(fixture_sm, FIXTURE_HOLD + 150);
    cr_assert_eq(fixture_sm_last_pub()->number, 2);
    fixture_sm_assert_members(fixture_sm_last_pub(), 1, (const char *[]){ "a" });
}

Test(broker, leave_rejects_unknown_member_or_session)
{
    static const struct {
        const char *cohort, *id;
        uint64_t session;
    } bad[] = {
        { "demo", "b", 99 }, { "demo", "zz", 12 }, { "nope", "b", 12 }, { "demo", "b", 0 },
    };

    fixture_sm_start_ab();
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        cr_assert_eq(broker_leave(fixture_sm, FIXTURE_HOLD, bad[i].cohort, bad[i].id,
                                  bad[i].session), -ENOENT, "leave %zu", i);
    cr_assert_eq(fixture_sm_members("demo"), 2);
    cr_assert_eq(broker_leave(fixture_sm, FIXTURE_HOLD, "demo", "b", 12), 0);
    cr_assert_eq(broker_leave(fixture_sm, FIXTURE_HOLD, "demo", "b", 12), -ENOENT);
}

Test(broker, last_member_leaving_forms_empty_epoch)
{
    fixture_sm_start_ab();
    cr_assert_eq(broker_leave(fixture_sm, FIXTURE_HOLD + 10, "demo", "a", 11), 0);
    cr_assert_eq(broker_leave(fixture_sm, FIXTURE_HOLD + 10, "demo", "b", 12), 0);
    cr_assert_eq(broker_tick(fixture_sm, FIXTURE_HOLD + 10), 50);
    broker_tick(fixture_sm, FIXTURE_HOLD + 60);
    cr_assert_eq(fixture_sm_last_pub()->number, 2);
    cr_assert_eq(fixture_sm_last_pub()->n_members, 0);
    cr_assert_eq(fixture_sm_last_pub()->leader, 0);
    cr_assert_eq(broker_tick(fixture_sm, FIXTURE_HOLD + 60), 1000);
}

/* ---- the tick's next deadline ---- */

Test(broker, tick_reports_time_until_next_deadline)
{
    cr_assert_eq(broker_create(&(struct broker_config){ 0 }, &fixture_host_ops, FIXTURE_T0,
                               &fixture_sm), -EINVAL);
    fixture_sm_start(NULL);
    cr_assert_eq(broker_tick(fixture_sm, FIXTURE_T0), 1000, "nothing to do");
    cr_assert_eq(fixture_sm_join("a", 0, 1, FIXTURE_T0), 0);
    cr_assert_eq(broker_tick(fixture_sm, FIXTURE_T0 + 1500), 500, "the end of the hold");
    cr_assert_eq(broker_tick(fixture_sm, FIXTURE_HOLD), 1000, "capped");
    cr_assert_eq(broker_tick(fixture_sm, FIXTURE_T0 + 4500), 501, "a's eviction");
    cr_assert_eq(fixture_sm_beat(FIXTURE_T0 + 4600, "demo", "a", 1, 0, false, NULL), 0);
    cr_assert_eq(fixture_sm_join("b", 0, 2, FIXTURE_T0 + 4700), 0);
    cr_assert_eq(broker_tick(fixture_sm, FIXTURE_T0 + 4710), 40, "the coalescing window");
    cr_assert_eq(broker_tick(fixture_sm, FIXTURE_T0 + 4750), 251,
                 "a stale bound wakes the host early");
    cr_assert_eq(broker_tick(fixture_sm, FIXTURE_T0 + 5001), 1000);
    cr_assert_eq(fixture_host.n_pubs, 2);
    cr_assert_eq(fixture_sm_members("demo"), 2);
}

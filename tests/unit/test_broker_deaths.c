/* tests/unit/test_broker_deaths.c: how the broker state machine tells a
 * dead member from a silent one: a watch stream cut without a Leave evicts
 * after the stream grace, a sign of life within the grace keeps the
 * member, silence alone still takes the member timeout, and peers'
 * reports of a reset data connection only shorten the wait for a member
 * whose own stream is gone; under the fake host of fixture.h, on an
 * injected clock. */
#include <criterion/criterion.h>

#include <errno.h>

#include "fixture.h"
#include "membership/broker.h"

/* Distinct addresses that stand in for the host's watcher handles. */
static int wa, wb, wb2;

/* a and b in epoch 1, both watched, at FIXTURE_HOLD. */
static void start_watched(void)
{
    fixture_sm_start_ab();
    cr_assert_eq(broker_watch(fixture_sm, "demo", "a", 11, &wa), 0);
    cr_assert_eq(broker_watch(fixture_sm, "demo", "b", 12, &wb), 0);
}

Test(broker, lost_stream_evicts_after_the_grace_not_before)
{
    uint64_t cut = FIXTURE_HOLD + 100;

    start_watched();
    cr_assert_eq(broker_stream_lost(fixture_sm, cut, "demo", "b", &wb), 0);
    cr_assert_eq(fixture_sm_tick_members(cut + BROKER_STREAM_GRACE_MS - 1), 2);
    cr_assert_eq(fixture_sm_tick_members(cut + BROKER_STREAM_GRACE_MS), 1);
    /* The stream is gone already: no detach is asked for. */
    fixture_sm_assert_detached(-ETIMEDOUT, 0, NULL);
    broker_tick(fixture_sm, cut + BROKER_STREAM_GRACE_MS + 50);
    cr_assert_eq(fixture_sm_last_pub()->number, 2);
    fixture_sm_assert_members(fixture_sm_last_pub(), 1, (const char *[]){ "a" });
    /* Out as if evicted: its session must rejoin. */
    cr_assert_eq(fixture_sm_beat(cut + 400, "demo", "b", 12, 1, false, NULL), -ENOENT);
}

Test(broker, tick_wakes_for_the_grace)
{
    uint64_t cut = FIXTURE_HOLD + 100;

    start_watched();
    broker_tick(fixture_sm, cut);
    cr_assert_eq(broker_stream_lost(fixture_sm, cut, "demo", "b", &wb), 0);
    cr_assert_leq(broker_tick(fixture_sm, cut), BROKER_STREAM_GRACE_MS);
}

Test(broker, grace_is_configurable)
{
    struct broker_config cfg;
    uint64_t cut = FIXTURE_HOLD + 100;

    broker_config_default(&cfg);
    cr_assert_eq(cfg.stream_grace_ms, BROKER_STREAM_GRACE_MS);
    cfg.stream_grace_ms = 2000;
    fixture_sm_start(&cfg);
    cr_assert_eq(fixture_sm_join("a", 1, 11, FIXTURE_T0), 0);
    cr_assert_eq(fixture_sm_join("b", 1, 12, FIXTURE_T0), 0);
    cr_assert_eq(fixture_sm_beat(cut, "demo", "b", 12, 1, false, NULL), 0);
    cr_assert_eq(broker_watch(fixture_sm, "demo", "b", 12, &wb), 0);
    cr_assert_eq(broker_stream_lost(fixture_sm, cut, "demo", "b", &wb), 0);
    cr_assert_eq(fixture_sm_tick_members(cut + 1999), 2);
    cr_assert_eq(fixture_sm_tick_members(cut + 2000), 1);
}

Test(broker, reconnect_within_the_grace_stays)
{
    uint64_t cut = FIXTURE_HOLD + 100;

    size_t pubs;

    start_watched();
    cr_assert_eq(broker_stream_lost(fixture_sm, cut, "demo", "b", &wb), 0);
    /* The same session watches again: no membership change. */
    pubs = fixture_host.n_pubs;
    cr_assert_eq(broker_watch(fixture_sm, "demo", "b", 12, &wb2), 0);
    cr_assert_eq(fixture_sm_tick_members(cut + 2 * BROKER_STREAM_GRACE_MS), 2);
    cr_assert_eq(fixture_host.n_pubs, pubs + 1, "the current epoch went to the new watch only");
    fixture_sm_assert_published_to(1, (void *[]){ &wb2 });
    cr_assert_eq(fixture_sm_last_pub()->number, 1);
}

Test(broker, heartbeat_within_the_grace_stays)
{
    uint64_t cut = FIXTURE_HOLD + 100;

    start_watched();
    cr_assert_eq(broker_stream_lost(fixture_sm, cut, "demo", "b", &wb), 0);
    cr_assert_eq(fixture_sm_beat(cut + 100, "demo", "b", 12, 1, false, NULL), 0);
    cr_assert_eq(fixture_sm_beat(cut + 100, "demo", "a", 11, 1, false, NULL), 0);
    cr_assert_eq(fixture_sm_tick_members(cut + 2 * BROKER_STREAM_GRACE_MS), 2);
    /* Back to the timeout: silent from its heartbeat on. */
    cr_assert_eq(fixture_sm_beat(cut + 4000, "demo", "a", 11, 1, false, NULL), 0);
    cr_assert_eq(fixture_sm_tick_members(cut + 100 + 5000), 2);
    cr_assert_eq(fixture_sm_tick_members(cut + 100 + 5001), 1);
}

Test(broker, rejoin_of_the_same_session_within_the_grace_stays)
{
    uint64_t cut = FIXTURE_HOLD + 100;

    start_watched();
    cr_assert_eq(broker_stream_lost(fixture_sm, cut, "demo", "b", &wb), 0);
    cr_assert_eq(fixture_sm_join("b", 1, 12, cut + 50), 0);
    cr_assert_eq(fixture_sm_tick_members(cut + 2 * BROKER_STREAM_GRACE_MS), 2);
    cr_assert_eq(fixture_sm_last_pub()->number, 1);
}

Test(broker, new_session_takes_a_dead_members_id_after_the_grace)
{
    uint64_t cut = FIXTURE_HOLD + 100;

    start_watched();
    cr_assert_eq(broker_stream_lost(fixture_sm, cut, "demo", "b", &wb), 0);
    cr_assert_eq(fixture_sm_join("b", 1, 99, cut + 10), -EEXIST);
    cr_assert_eq(fixture_sm_join("b", 1, 99, cut + BROKER_STREAM_GRACE_MS), 0);
}

Test(broker, silence_alone_takes_the_timeout)
{
    start_watched();
    /* b stops (SIGSTOP, a partition): its stream stays open, no beats. */
    for (uint64_t t = FIXTURE_HOLD; t <= FIXTURE_T0 + 5000; t += 500) {
        cr_assert_eq(fixture_sm_beat(t, "demo", "a", 11, 1, false, NULL), 0);
        cr_assert_eq(fixture_sm_tick_members(t), 2, "b evicted at %llu", (unsigned long long)t);
    }
    cr_assert_eq(fixture_sm_tick_members(FIXTURE_T0 + 5001), 1);
}

Test(broker, lost_stream_of_a_replaced_watcher_changes_nothing)
{
    uint64_t cut = FIXTURE_HOLD + 100;

    start_watched();
    cr_assert_eq(broker_watch(fixture_sm, "demo", "b", 12, &wb2), 0);
    cr_assert_eq(broker_stream_lost(fixture_sm, cut, "demo", "b", &wb), -ENOENT);
    cr_assert_eq(broker_stream_lost(fixture_sm, cut, "demo", "zz", &wb), -ENOENT);
    cr_assert_eq(broker_stream_lost(fixture_sm, cut, "nope", "b", &wb), -ENOENT);
    cr_assert_eq(broker_stream_lost(fixture_sm, cut, "demo", "b", NULL), -ENOENT);
    cr_assert_eq(fixture_sm_tick_members(cut + 2 * BROKER_STREAM_GRACE_MS), 2);
}

/* ---- peers' reports ---- */

Test(broker, report_and_lost_stream_evict_at_once)
{
    uint64_t cut = FIXTURE_HOLD + 100;

    start_watched();
    cr_assert_eq(broker_report_lost(fixture_sm, cut, "demo", "a", 11, "b"), 0);
    cr_assert_eq(fixture_sm_tick_members(cut + 1), 2, "a report alone evicts nobody");
    cr_assert_eq(broker_stream_lost(fixture_sm, cut + 5, "demo", "b", &wb), 0);
    cr_assert_eq(fixture_sm_tick_members(cut + 5), 1);
}

Test(broker, lost_stream_then_report_evicts_at_once)
{
    uint64_t cut = FIXTURE_HOLD + 100;

    start_watched();
    cr_assert_eq(broker_stream_lost(fixture_sm, cut, "demo", "b", &wb), 0);
    cr_assert_eq(broker_report_lost(fixture_sm, cut + 20, "demo", "a", 11, "b"), 0);
    cr_assert_leq(broker_tick(fixture_sm, cut + 19), 1);
    cr_assert_eq(fixture_sm_tick_members(cut + 20), 1);
}

Test(broker, lying_report_does_not_evict_a_live_member)
{
    size_t pubs;

    start_watched();
    pubs = fixture_host.n_pubs;
    /* a accuses b every half second; b keeps beating and keeps its
     * stream: it stays for ten timeouts. */
    for (uint64_t t = FIXTURE_HOLD; t <= FIXTURE_HOLD + 50000; t += 500) {
        cr_assert_eq(broker_report_lost(fixture_sm, t, "demo", "a", 11, "b"), 0);
        cr_assert_eq(fixture_sm_beat(t, "demo", "a", 11, 1, false, NULL), 0);
        if (t % 1000 == 0)
            cr_assert_eq(fixture_sm_beat(t, "demo", "b", 12, 1, false, NULL), 0);
        cr_assert_eq(fixture_sm_tick_members(t + 1), 2);
    }
    cr_assert_eq(fixture_host.n_pubs, pubs, "no epoch formed");
}

Test(broker, report_against_a_silent_member_waits_its_timeout)
{
    start_watched();
    /* b is silent but its stream is up (a partition): a report does not
     * make a partition a death. */
    for (uint64_t t = FIXTURE_HOLD; t <= FIXTURE_T0 + 5000; t += 500) {
        cr_assert_eq(broker_report_lost(fixture_sm, t, "demo", "a", 11, "b"), 0);
        cr_assert_eq(fixture_sm_beat(t, "demo", "a", 11, 1, false, NULL), 0);
        cr_assert_eq(fixture_sm_tick_members(t), 2);
    }
    cr_assert_eq(fixture_sm_tick_members(FIXTURE_T0 + 5001), 1);
}

Test(broker, sign_of_life_clears_a_report)
{
    uint64_t t = FIXTURE_HOLD + 100;

    start_watched();
    cr_assert_eq(broker_report_lost(fixture_sm, t, "demo", "a", 11, "b"), 0);
    cr_assert_eq(fixture_sm_beat(t + 10, "demo", "b", 12, 1, false, NULL), 0);
    /* A later cut of b's stream gets the grace, not an instant eviction. */
    cr_assert_eq(broker_stream_lost(fixture_sm, t + 20, "demo", "b", &wb), 0);
    cr_assert_eq(fixture_sm_tick_members(t + 21), 2);
    cr_assert_eq(fixture_sm_tick_members(t + 20 + BROKER_STREAM_GRACE_MS), 1);
}

Test(broker, report_refuses_strangers_and_self)
{
    uint64_t t = FIXTURE_HOLD + 100;

    start_watched();
    cr_assert_eq(broker_report_lost(fixture_sm, t, "demo", "a", 99, "b"), -ENOENT);
    cr_assert_eq(broker_report_lost(fixture_sm, t, "demo", "a", 0, "b"), -ENOENT);
    cr_assert_eq(broker_report_lost(fixture_sm, t, "demo", "zz", 11, "b"), -ENOENT);
    cr_assert_eq(broker_report_lost(fixture_sm, t, "nope", "a", 11, "b"), -ENOENT);
    cr_assert_eq(broker_report_lost(fixture_sm, t, "demo", "a", 11, "zz"), -ENOENT);
    cr_assert_eq(broker_report_lost(fixture_sm, t, "demo", "a", 11, "a"), -EINVAL);
    cr_assert_eq(broker_report_lost(fixture_sm, t, "demo", "a", 11, NULL), -EINVAL);
    /* None of them counted: b's cut gets the whole grace. */
    cr_assert_eq(broker_stream_lost(fixture_sm, t, "demo", "b", &wb), 0);
    cr_assert_eq(fixture_sm_tick_members(t + 1), 2);
}

/* tests/unit/test_broker_restarts.c: members that come back to the broker
 * state machine: rejoins with the same or a new session or address, ids
 * held by another session, rejoins after an eviction, and the epoch
 * numbers that members carry across a broker restart; under the fake host
 * of fixture.h, on an injected clock. */
#include <criterion/criterion.h>

#include <errno.h>
#include <stdio.h>

#include "fixture.h"
#include "base/limits.h"
#include "membership/broker.h"
#include "rpc/rpc.h"

/* Distinct addresses that stand in for the host's watcher handles. */
static int wa, wb;

/* ---- rejoins and duplicates ---- */

Test(broker, rejoin_same_session_is_idempotent)
{
    struct broker_join j = { .cohort = "demo", .id = "a", .address = FIXTURE_ADDR, .session = 11 };

    fixture_sm_start_ab();
    cr_assert_eq(fixture_sm_join_timed(&j, FIXTURE_HOLD + 10, 1000, 5000), 1);
    cr_assert_eq(fixture_sm_tick_members(FIXTURE_HOLD + 1000), 2);
    cr_assert_eq(fixture_host.n_pubs, 1);

    /* The rejoin counts as a heartbeat. */
    cr_assert_eq(fixture_sm_tick_members(FIXTURE_T0 + 5001), 1);
}

Test(broker, rejoin_with_new_address_forms_epoch)
{
    fixture_sm_start_ab();
    cr_assert_eq(fixture_sm_join_full("demo", "a", FIXTURE_ADDR2, 1, 11, 0, FIXTURE_HOLD + 10), 0);
    broker_tick(fixture_sm, FIXTURE_HOLD + 60);
    cr_assert_eq(fixture_host.n_pubs, 2);
    cr_assert_eq(fixture_sm_last_pub()->number, 2);
    cr_assert_str_eq(fixture_sm_last_pub()->members[0].address, FIXTURE_ADDR2);
    cr_assert_str_eq(fixture_sm_last_pub()->members[1].address, FIXTURE_ADDR);
}

Test(broker, join_rejects_duplicate_id)
{
    fixture_sm_start(NULL);
    cr_assert_eq(fixture_sm_join("a", 0, 1, FIXTURE_T0), 0);
    cr_assert_eq(fixture_sm_join("a", 0, 2, FIXTURE_T0 + 100), -EEXIST);
    cr_assert_eq(fixture_sm_join("a", 0, 2, FIXTURE_T0 + 5000), -EEXIST);
    cr_assert_eq(fixture_sm_tick_members(FIXTURE_T0 + 5001), 0);
    cr_assert_eq(fixture_sm_join("a", 0, 2, FIXTURE_T0 + 5001), 0);
    cr_assert_eq(fixture_sm_beat(FIXTURE_T0 + 5002, "demo", "a", 2, 0, false, NULL), 0);
    cr_assert_eq(fixture_sm_beat(FIXTURE_T0 + 5002, "demo", "a", 1, 0, false, NULL), -ENOENT);
}

Test(broker, join_takes_over_silent_member_before_tick)
{
    fixture_sm_start(NULL);
    cr_assert_eq(fixture_sm_join("a", 0, 1, FIXTURE_T0), 0);
    broker_tick(fixture_sm, FIXTURE_HOLD);
    cr_assert_eq(broker_watch(fixture_sm, "demo", "a", 1, &wa), 0);
    /* Silent past its timeout, but no tick has evicted it yet. */
    cr_assert_eq(fixture_sm_join("a", 0, 2, FIXTURE_T0 + 5001), 0);
    fixture_sm_assert_detached(-ETIMEDOUT, 1, (void *[]){ &wa });
    cr_assert_eq(broker_watch(fixture_sm, "demo", "a", 1, &wb), -ENOENT);

    /* Same id and address, new session: a membership change. */
    broker_tick(fixture_sm, FIXTURE_T0 + 5051);
    cr_assert_eq(fixture_sm_last_pub()->number, 2);
    fixture_sm_assert_members(fixture_sm_last_pub(), 1, (const char *[]){ "a" });
}

Test(broker, rejoin_after_eviction_forms_epoch_with_member)
{
    fixture_sm_start_ab();
    cr_assert_eq(fixture_sm_beat(FIXTURE_T0 + 4000, "demo", "a", 11, 1, false, NULL), 0);
    broker_tick(fixture_sm, FIXTURE_T0 + 5001);
    broker_tick(fixture_sm, FIXTURE_T0 + 5051);
    fixture_sm_assert_members(fixture_sm_last_pub(), 1, (const char *[]){ "a" });
    cr_assert_eq(fixture_sm_join("b", 1, 22, FIXTURE_T0 + 6000), 0);
    broker_tick(fixture_sm, FIXTURE_T0 + 6050);
    cr_assert_eq(fixture_sm_last_pub()->number, 3);
    fixture_sm_assert_members(fixture_sm_last_pub(), 2, (const char *[]){ "a", "b" });
}

/* ---- epoch numbers ---- */

/* `id` joins at `now` saying the highest epoch it saw was last_epoch; the
 * tick after the coalescing window publishes an epoch, whose number this
 * returns. */
static uint64_t join_having_seen(const char *id, uint64_t session, uint64_t last_epoch,
                                 uint64_t now)
{
    cr_assert_eq(fixture_sm_join_full("demo", id, FIXTURE_ADDR, 0, session, last_epoch, now), 0);
    broker_tick(fixture_sm, now + 50);
    return fixture_sm_last_pub()->number;
}

Test(broker, epochs_continue_from_reported_last_epoch)
{
    struct broker_join j = {
        .cohort = "demo", .id = "a", .address = FIXTURE_ADDR, .session = 1, .last_epoch = 41,
    };

    fixture_sm_start(NULL);
    cr_assert_eq(fixture_sm_join_timed(&j, FIXTURE_T0, 1000, 5000), 0);
    cr_assert_eq(fixture_sm_join_full("demo", "b", FIXTURE_ADDR, 0, 2, 17, FIXTURE_T0), 0);
    broker_tick(fixture_sm, FIXTURE_HOLD);
    cr_assert_eq(fixture_sm_last_pub()->number, 42);

    /* A lower report never lowers the count. */
    cr_assert_eq(join_having_seen("c", 3, 5, FIXTURE_HOLD + 10), 43);
    /* A higher one, from a member that saw more, lifts it. */
    cr_assert_eq(join_having_seen("d", 4, 99, FIXTURE_HOLD + 100), 100);
}

Test(broker, epochs_only_grow)
{
    uint64_t prev = 0;

    fixture_sm_start(NULL);
    broker_tick(fixture_sm, FIXTURE_HOLD);
    for (int i = 0; i < 20; i++) {
        char id[16];
        uint64_t t = FIXTURE_HOLD + 1000 * (uint64_t)(i + 1);

        snprintf(id, sizeof id, "m-%d", i);
        cr_assert_eq(fixture_sm_join(id, (uint64_t)i, (uint64_t)i + 1, t), 0);
        if (i % 3 == 2)
            cr_assert_eq(broker_leave(fixture_sm, t, "demo", id, (uint64_t)i + 1), 0);
        broker_tick(fixture_sm, t + 50);
    }
    cr_assert_gt(fixture_host.n_pubs, 0);
    for (size_t i = 0; i < fixture_host.n_pubs; i++) {
        cr_assert_gt(fixture_host.pubs[i].e->number, prev);
        prev = fixture_host.pubs[i].e->number;
    }
}

Test(broker, join_rejects_last_epoch_that_would_wrap)
{
    fixture_sm_start(NULL);
    cr_assert_eq(fixture_sm_join_full("demo", "a", FIXTURE_ADDR, 0, 1, UINT64_MAX, FIXTURE_T0),
                 -EINVAL);
    cr_assert_eq(fixture_sm_members("demo"), 0);
}

/* ---- the startup hold of a restarted broker ---- */

/* docs/chaos.md's finding: the broker restarts with no memory; member m0,
 * a new trainer at version 0 behind an old sidecar, is back at once, and
 * the three members that carry the cohort's state come back as late as
 * their reconnect backoff allows. The default hold for the cohort's
 * heartbeat (as cohort-operator derives it) must not publish m0 alone in
 * between: it would lead and train a second history. */
Test(broker, restart_hold_waits_for_members_in_reconnect_backoff)
{
    const uint32_t hb = 200;        /* the chaos trials' heartbeat */
    const uint64_t late = FIXTURE_T0 + RPC_RECONNECT_MAX_MS +
                          (hb > LIMIT_BACKOFF_MAX_MS ? hb : LIMIT_BACKOFF_MAX_MS);
    const char *ids[] = { "m0", "m1", "m2", "m3" };
    struct broker_config cfg;
    uint64_t t;

    broker_config_default(&cfg);
    cfg.heartbeat_ms = hb;
    cfg.timeout_ms = 5 * hb;
    cfg.startup_hold_ms = broker_startup_hold_ms(hb);
    cr_assert(fixture_sm == NULL);
    cr_assert_eq(broker_create(&cfg, &fixture_host_ops, FIXTURE_T0, &fixture_sm), 0);
    cr_assert_eq(broker_cohort_declare(fixture_sm, "demo", 0, 0), 0);

    cr_assert_eq(fixture_sm_join_full("demo", "m0", FIXTURE_ADDR, 0, 10, 30, FIXTURE_T0 + 1), 0);
    for (t = FIXTURE_T0 + 10; t < late; t += 10) {
        /* m0 keeps beating while the others are still in backoff. */
        if (t % hb == 0)
            cr_assert_eq(fixture_sm_beat(t, "demo", "m0", 10, 0, false, NULL), 0);
        broker_tick(fixture_sm, t);
        cr_assert_eq(fixture_host.n_pubs, 0, "an epoch formed at +%llu ms with m0 alone",
                     (unsigned long long)(t - FIXTURE_T0));
    }
    for (size_t i = 1; i < 4; i++)
        cr_assert_eq(fixture_sm_join_full("demo", ids[i], FIXTURE_ADDR, 5, 10 + i, 30, late), 0);
    broker_tick(fixture_sm, FIXTURE_T0 + cfg.startup_hold_ms + cfg.coalesce_ms);
    cr_assert_eq(fixture_host.n_pubs, 1);
    cr_assert_eq(fixture_sm_last_pub()->number, 31);
    fixture_sm_assert_members(fixture_sm_last_pub(), 4, ids);
    /* The leader carries the state: the highest version, not m0. */
    cr_assert_str_eq(epoch_leader_id(fixture_sm_last_pub()), "m1");
}

Test(broker, startup_hold_is_derived_from_the_heartbeat)
{
    cr_assert_eq(broker_startup_hold_ms(1000), RPC_RECONNECT_MAX_MS + 1000 + 1000);
    cr_assert_eq(broker_startup_hold_ms(200), RPC_RECONNECT_MAX_MS + LIMIT_BACKOFF_MAX_MS + 200);
    cr_assert_eq(broker_startup_hold_ms(5000), RPC_RECONNECT_MAX_MS + 5000 + 5000);
    cr_assert_eq(broker_startup_hold_ms(UINT32_MAX), UINT32_MAX);
    /* Covers the gRPC reconnect and the member's next try, with a
     * heartbeat to spare, at any heartbeat. */
    for (uint32_t hb = 50; hb <= 10000; hb += 50)
        cr_assert_geq(broker_startup_hold_ms(hb), RPC_RECONNECT_MAX_MS +
                      (hb > LIMIT_BACKOFF_MAX_MS ? hb : LIMIT_BACKOFF_MAX_MS) + hb);
}

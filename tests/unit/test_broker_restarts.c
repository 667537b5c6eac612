/* tests/unit/test_broker_restarts.c: members that come back to the broker
 * state machine: rejoins with the same or a new session or address, ids
 * held by another session, rejoins after an eviction, and the epoch
 * numbers that members carry across a broker restart; under the fake host
 * of fixture.h, on an injected clock. */
#include <criterion/criterion.h>

#include <errno.h>
#include <stdio.h>

#include "fixture.h"
#include "membership/broker.h"

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

/* tests/unit/test_broker_drain.c: draining in the broker state machine: a
 * drained member stays joined but out of the epochs, until it is taken
 * back or goes; under the fake host of fixture.h, on an injected clock. */
#include <criterion/criterion.h>

#include <errno.h>

#include "fixture.h"
#include "membership/broker.h"

static const char *const ab[] = { "a", "b" };
static const char *const b_only[] = { "b" };

Test(broker, drain_leaves_member_out_of_next_epoch)
{
    static int wa;

    fixture_sm_start_ab();
    cr_assert_eq(broker_watch(fixture_sm, "demo", "a", 11, &wa), 0);
    cr_assert_eq(broker_drain(fixture_sm, FIXTURE_HOLD + 10, "demo", "a", true), 0);
    cr_assert_eq(broker_drained(fixture_sm, "demo", "a"), 0, "no epoch without it yet");
    broker_tick(fixture_sm, FIXTURE_HOLD + 10 + 50);
    cr_assert_eq(fixture_sm_last_pub()->number, 2);
    fixture_sm_assert_members(fixture_sm_last_pub(), 1, b_only);
    /* The drained member still hears the epoch: that is how it stops. */
    fixture_sm_assert_published_to(1, (void *[]){ &wa });
    /* It stays a member (heartbeats work) and is told it is drained. */
    cr_assert(fixture_sm_beat_adopted("a", 11, FIXTURE_HOLD + 100, 2));
    cr_assert_eq(fixture_sm_members("demo"), 2);
    /* Drained only once b runs in epoch 2. */
    cr_assert_eq(broker_drained(fixture_sm, "demo", "a"), 0);
    cr_assert_not(fixture_sm_beat_adopted("b", 12, FIXTURE_HOLD + 100, 1));
    cr_assert_eq(broker_drained(fixture_sm, "demo", "a"), 0);
    cr_assert_not(fixture_sm_beat_adopted("b", 12, FIXTURE_HOLD + 200, 2));
    cr_assert_eq(broker_drained(fixture_sm, "demo", "a"), 1);
    /* Taking it back in forms an epoch with both. */
    cr_assert_eq(broker_drain(fixture_sm, FIXTURE_HOLD + 300, "demo", "a", false), 0);
    cr_assert_eq(broker_drained(fixture_sm, "demo", "a"), 0);
    broker_tick(fixture_sm, FIXTURE_HOLD + 400);
    cr_assert_eq(fixture_sm_last_pub()->number, 3);
    fixture_sm_assert_members(fixture_sm_last_pub(), 2, ab);
    cr_assert_not(fixture_sm_beat_adopted("a", 11, FIXTURE_HOLD + 400, 3));
}

Test(broker, drain_moves_leadership_and_leave_is_quiet)
{
    fixture_sm_start(NULL);
    cr_assert_eq(fixture_sm_join("a", 9, 11, FIXTURE_T0), 0);
    cr_assert_eq(fixture_sm_join("b", 1, 12, FIXTURE_T0), 0);
    broker_tick(fixture_sm, FIXTURE_HOLD);
    cr_assert_str_eq(fixture_sm_leader(fixture_sm_last_pub()), "a");
    cr_assert_eq(broker_drain(fixture_sm, FIXTURE_HOLD, "demo", "a", true), 0);
    broker_tick(fixture_sm, FIXTURE_HOLD + 50);
    fixture_sm_assert_members(fixture_sm_last_pub(), 1, b_only);
    cr_assert_str_eq(fixture_sm_leader(fixture_sm_last_pub()), "b");
    /* A declared higher version of a draining member moves nothing. */
    cr_assert_eq(fixture_sm_beat(FIXTURE_HOLD + 60, "demo", "a", 11, 50, true, NULL), 0);
    cr_assert_gt(broker_tick(fixture_sm, FIXTURE_HOLD + 200), 0);
    cr_assert_eq(fixture_sm_last_pub()->number, 2);
    /* Its pod goes: the leave forms no epoch, since it was not in one. */
    cr_assert_eq(broker_leave(fixture_sm, FIXTURE_HOLD + 300, "demo", "a", 11), 0);
    broker_tick(fixture_sm, FIXTURE_HOLD + 400);
    cr_assert_eq(fixture_sm_last_pub()->number, 2);
    cr_assert_eq(broker_drained(fixture_sm, "demo", "a"), 1, "gone counts as drained");
}

Test(broker, drain_every_member_and_bad_names)
{
    fixture_sm_start_ab();
    cr_assert_eq(broker_drain(fixture_sm, FIXTURE_HOLD, "demo", "a", true), 0);
    cr_assert_eq(broker_drain(fixture_sm, FIXTURE_HOLD, "demo", "b", true), 0);
    broker_tick(fixture_sm, FIXTURE_HOLD + 50);
    cr_assert_eq(fixture_sm_last_pub()->n_members, 0);
    cr_assert_eq(broker_drained(fixture_sm, "demo", "a"), 1, "no one left to wait for");
    cr_assert_eq(broker_drain(fixture_sm, FIXTURE_HOLD, "demo", "zz", true), -ENOENT);
    cr_assert_eq(broker_drain(fixture_sm, FIXTURE_HOLD, "nope", "a", true), -ENOENT);
    cr_assert_eq(broker_drain(fixture_sm, FIXTURE_HOLD, NULL, "a", true), -ENOENT);
    cr_assert_eq(broker_drained(fixture_sm, "nope", "a"), -ENOENT);
    cr_assert_eq(broker_drained(fixture_sm, "demo", "zz"), 1);
}

Test(broker, drain_mark_survives_nothing_after_eviction)
{
    fixture_sm_start_ab();
    cr_assert_eq(broker_drain(fixture_sm, FIXTURE_HOLD, "demo", "a", true), 0);
    broker_tick(fixture_sm, FIXTURE_HOLD + 50);
    /* a goes silent and is evicted; it comes back as a new member. */
    for (uint64_t t = FIXTURE_HOLD + 1000; t < FIXTURE_T0 + 12000; t += 1000)
        cr_assert_eq(fixture_sm_beat(t, "demo", "b", 12, 1, false, NULL), 0);
    cr_assert_eq(fixture_sm_tick_members(FIXTURE_T0 + 12000), 1);
    cr_assert_eq(fixture_sm_join("a", 1, 21, FIXTURE_T0 + 12000), 0);
    broker_tick(fixture_sm, FIXTURE_T0 + 12100);
    fixture_sm_assert_members(fixture_sm_last_pub(), 2, ab);
}

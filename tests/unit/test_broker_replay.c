/* tests/unit/test_broker_replay.c: the replay rules of membership/wire.h in
 * the broker state machine (each proof seq of a member session accepted
 * once, sessions that left or were evicted remembered, for a time and up
 * to a cap), and the clamps on what a join or a heartbeat asks for; under
 * the fake host of fixture.h, on an injected clock. The proofs' MACs are
 * brokerd's to check (test_brokerd.c); here seq is what the host passes. */
#include <criterion/criterion.h>

#include <errno.h>
#include <stdio.h>

#include "fixture.h"
#include "membership/broker.h"

/* A join of `id` in "demo" at FIXTURE_ADDR with a proof numbered `seq`
 * (0: no proof). Returns broker_join()'s result. */
static int join_seq(const char *id, uint64_t session, uint64_t seq, uint64_t now)
{
    struct broker_join j = { .cohort = "demo", .id = id, .address = FIXTURE_ADDR,
                             .session = session, .seq = seq };

    return broker_join(fixture_sm, now, &j, NULL);
}

/* ---- sequence numbers of a live session ---- */

Test(broker, each_seq_of_a_session_is_accepted_once)
{
    fixture_sm_start(NULL);
    cr_assert_eq(join_seq("a", 7, 10, FIXTURE_T0), 0);
    /* Nothing made before the join counts, nor the join's own. */
    cr_assert_eq(broker_accept_seq(fixture_sm, "demo", "a", 7, 10), -EALREADY);
    cr_assert_eq(broker_accept_seq(fixture_sm, "demo", "a", 7, 9), -EALREADY);
    cr_assert_eq(broker_accept_seq(fixture_sm, "demo", "a", 7, 11), 0);
    cr_assert_eq(broker_accept_seq(fixture_sm, "demo", "a", 7, 11), -EALREADY);
    /* Calls overtake each other: 13 before 12 is fine, each once. */
    cr_assert_eq(broker_accept_seq(fixture_sm, "demo", "a", 7, 13), 0);
    cr_assert_eq(broker_accept_seq(fixture_sm, "demo", "a", 7, 12), 0);
    cr_assert_eq(broker_accept_seq(fixture_sm, "demo", "a", 7, 12), -EALREADY);
    cr_assert_eq(broker_accept_seq(fixture_sm, "demo", "a", 7, 13), -EALREADY);
    /* A jump leaves a window of 64 behind it. */
    cr_assert_eq(broker_accept_seq(fixture_sm, "demo", "a", 7, 200), 0);
    cr_assert_eq(broker_accept_seq(fixture_sm, "demo", "a", 7, 200 - 64), 0);
    cr_assert_eq(broker_accept_seq(fixture_sm, "demo", "a", 7, 200 - 65), -EALREADY, "too old");
    cr_assert_eq(broker_accept_seq(fixture_sm, "demo", "a", 7, 199), 0);
    cr_assert_eq(broker_accept_seq(fixture_sm, "demo", "a", 7, 0), -EALREADY);
    /* Far past the window, the bitmap starts over. */
    cr_assert_eq(broker_accept_seq(fixture_sm, "demo", "a", 7, 1000), 0);
    cr_assert_eq(broker_accept_seq(fixture_sm, "demo", "a", 7, 999), 0);
    cr_assert_eq(broker_accept_seq(fixture_sm, "demo", "a", 7, 200), -EALREADY);
    /* Other sessions and strangers are not members. */
    cr_assert_eq(broker_accept_seq(fixture_sm, "demo", "a", 8, 2000), -ENOENT);
    cr_assert_eq(broker_accept_seq(fixture_sm, "demo", "zz", 7, 2000), -ENOENT);
    cr_assert_eq(broker_accept_seq(fixture_sm, "nope", "a", 7, 2000), -ENOENT);
    cr_assert_eq(broker_accept_seq(fixture_sm, "demo", "a", 0, 2000), -ENOENT);
}

Test(broker, a_rejoin_needs_a_new_seq_and_changes_nothing_otherwise)
{
    struct broker_join j = { .cohort = "demo", .id = "a", .address = FIXTURE_ADDR2,
                             .session = 7, .seq = 5, .timeout_ms = 1500 };
    struct broker_cohort_status *c;
    struct broker_status *st;

    fixture_sm_start(NULL);
    cr_assert_eq(join_seq("a", 7, 5, FIXTURE_T0), 0);
    cr_assert_eq(broker_accept_seq(fixture_sm, "demo", "a", 7, 6), 0);
    /* The first join again, now with another address and a short
     * timeout: refused, and nothing of it is taken. */
    cr_assert_eq(broker_join(fixture_sm, FIXTURE_T0 + 10, &j, NULL), -EALREADY);
    j.seq = 6;
    cr_assert_eq(broker_join(fixture_sm, FIXTURE_T0 + 10, &j, NULL), -EALREADY);
    cr_assert_eq(broker_status(fixture_sm, "demo", &st), 0);
    c = &st->cohorts[0];
    cr_assert_eq(c->n_members, 1);
    cr_assert_str_eq(c->members[0].address, FIXTURE_ADDR);
    broker_status_free(st);
    cr_assert_eq(fixture_sm_tick_members(FIXTURE_T0 + 1600), 1, "its timeout is unchanged");
    /* A fresh one is a rejoin as before. */
    j.seq = 7;
    cr_assert_eq(broker_join(fixture_sm, FIXTURE_T0 + 1600, &j, NULL), 0);
    cr_assert_eq(broker_accept_seq(fixture_sm, "demo", "a", 7, 7), -EALREADY);
}

/* ---- retired sessions ---- */

Test(broker, a_session_that_left_cannot_join_again)
{
    fixture_sm_start(NULL);
    cr_assert_eq(join_seq("a", 7, 1, FIXTURE_T0), 0);
    cr_assert_eq(broker_accept_seq(fixture_sm, "demo", "a", 7, 2), 0);
    cr_assert_eq(broker_leave(fixture_sm, FIXTURE_T0 + 10, "demo", "a", 7), 0);
    /* Its captured join, or any later seq of it: it left. */
    cr_assert_eq(join_seq("a", 7, 1, FIXTURE_T0 + 20), -EALREADY);
    cr_assert_eq(join_seq("a", 7, 99, FIXTURE_T0 + 20), -EALREADY);
    cr_assert_eq(fixture_sm_members("demo"), 0);
    /* The same id with a new session (a new process) is welcome. */
    cr_assert_eq(join_seq("a", 8, 3, FIXTURE_T0 + 30), 0);
    cr_assert_eq(fixture_sm_members("demo"), 1);
}

Test(broker, an_evicted_session_rejoins_only_with_a_newer_seq)
{
    fixture_sm_start(NULL);
    cr_assert_eq(join_seq("a", 7, 1, FIXTURE_T0), 0);
    cr_assert_eq(broker_accept_seq(fixture_sm, "demo", "a", 7, 4), 0);
    cr_assert_eq(fixture_sm_tick_members(FIXTURE_T0 + 5001), 0, "evicted");
    cr_assert_eq(join_seq("a", 7, 1, FIXTURE_T0 + 5002), -EALREADY);
    cr_assert_eq(join_seq("a", 7, 4, FIXTURE_T0 + 5002), -EALREADY);
    /* The member itself, back from a partition, goes on counting. */
    cr_assert_eq(join_seq("a", 7, 5, FIXTURE_T0 + 5002), 0);
    cr_assert_eq(broker_accept_seq(fixture_sm, "demo", "a", 7, 4), -EALREADY);
    /* Live again, it is no longer retired: a second eviction keeps its
     * newer seq. */
    cr_assert_eq(fixture_sm_tick_members(FIXTURE_T0 + 10003), 0);
    cr_assert_eq(join_seq("a", 7, 5, FIXTURE_T0 + 10004), -EALREADY);
    cr_assert_eq(join_seq("a", 7, 6, FIXTURE_T0 + 10004), 0);
}

Test(broker, a_session_replaced_after_its_timeout_is_retired_too)
{
    fixture_sm_start(NULL);
    cr_assert_eq(join_seq("a", 7, 3, FIXTURE_T0), 0);
    /* Silent past its timeout but not yet evicted by a tick: a new
     * process takes the id over. */
    cr_assert_eq(join_seq("a", 8, 1, FIXTURE_T0 + 5001), 0);
    cr_assert_eq(join_seq("a", 7, 3, FIXTURE_T0 + 5002), -EALREADY, "session 7 retired");
    cr_assert_eq(join_seq("a", 7, 4, FIXTURE_T0 + 5002), -EEXIST, "a is held by session 8");
    cr_assert_eq(broker_leave(fixture_sm, FIXTURE_T0 + 5003, "demo", "a", 8), 0);
    cr_assert_eq(join_seq("a", 7, 3, FIXTURE_T0 + 5004), -EALREADY);
    cr_assert_eq(join_seq("a", 8, 2, FIXTURE_T0 + 5004), -EALREADY);
}

Test(broker, retired_sessions_are_forgotten_after_their_time)
{
    fixture_sm_start(NULL);
    cr_assert_eq(join_seq("a", 7, 1, FIXTURE_T0), 0);
    cr_assert_eq(broker_leave(fixture_sm, FIXTURE_T0, "demo", "a", 7), 0);
    cr_assert_eq(join_seq("a", 7, 1, FIXTURE_T0 + BROKER_RETIRED_KEEP_MS - 1), -EALREADY);
    /* By now every Join it made is outside brokerd's time window. */
    broker_tick(fixture_sm, FIXTURE_T0 + BROKER_RETIRED_KEEP_MS);
    cr_assert_eq(join_seq("a", 7, 1, FIXTURE_T0 + BROKER_RETIRED_KEEP_MS), 0);
}

Test(broker, joins_without_a_proof_leave_no_record)
{
    fixture_sm_start(NULL);
    cr_assert_eq(join_seq("a", 7, 0, FIXTURE_T0), 0);
    cr_assert_eq(broker_leave(fixture_sm, FIXTURE_T0, "demo", "a", 7), 0);
    cr_assert_eq(join_seq("a", 7, 0, FIXTURE_T0 + 1), 0, "an open cohort is as before");
}

/* More retirements than the cap: the oldest is forgotten first, and the
 * ring never holds more. */
Test(broker, retired_sessions_are_capped, .timeout = 120)
{
    struct broker_config cfg;
    char id[32];

    broker_config_default(&cfg);
    cfg.max_members = 8;
    fixture_sm_start(&cfg);
    for (uint64_t i = 0; i <= BROKER_RETIRED_MAX; i++) {
        snprintf(id, sizeof(id), "m-%llu", (unsigned long long)i);
        cr_assert_eq(join_seq(id, 1000 + i, 1, FIXTURE_T0), 0);
        cr_assert_eq(broker_leave(fixture_sm, FIXTURE_T0, "demo", id, 1000 + i), 0);
    }
    cr_assert_eq(join_seq("m-0", 1000, 1, FIXTURE_T0 + 1), 0, "the oldest was forgotten");
    cr_assert_eq(join_seq("m-1", 1001, 1, FIXTURE_T0 + 1), -EALREADY);
    snprintf(id, sizeof(id), "m-%u", BROKER_RETIRED_MAX);
    cr_assert_eq(join_seq(id, 1000 + BROKER_RETIRED_MAX, 1, FIXTURE_T0 + 1), -EALREADY);
}

/* ---- clamps ---- */

Test(broker, a_joins_heartbeat_is_floored)
{
    struct broker_join j = { .cohort = "demo", .id = "a", .address = FIXTURE_ADDR,
                             .session = 1, .heartbeat_ms = 1 };

    fixture_sm_start(NULL);
    fixture_sm_join_timed(&j, FIXTURE_T0, BROKER_HEARTBEAT_FLOOR_MS, 5000);
    /* A cohort whose own heartbeat is faster grants that. */
    cr_assert_eq(broker_cohort_declare(fixture_sm, "fast", 20, 200), 0);
    j.cohort = "fast";
    fixture_sm_join_timed(&j, FIXTURE_T0, 20, 200);
    /* Slower than the floor is the member's business. */
    j.cohort = "demo";
    j.id = "b";
    j.heartbeat_ms = 2000;
    fixture_sm_join_timed(&j, FIXTURE_T0, 2000, 5000);
}

Test(broker, the_timeout_cap_is_the_configs)
{
    struct broker_config cfg;
    struct broker_join j = { .cohort = "demo", .id = "evil", .address = FIXTURE_ADDR,
                             .session = 7, .timeout_ms = UINT32_MAX };

    broker_config_default(&cfg);
    cfg.max_timeout_ms = 8000;
    fixture_sm_start(&cfg);
    fixture_sm_join_timed(&j, FIXTURE_T0, 1000, 8000);
    cr_assert_eq(fixture_sm_tick_members(FIXTURE_T0 + 8000), 1);
    cr_assert_eq(fixture_sm_tick_members(FIXTURE_T0 + 8001), 0);
    /* Below the cohort's own timeout the cohort's holds. */
    cfg.max_timeout_ms = 1;
    fixture_sm_stop();
    fixture_sm_start(&cfg);
    fixture_sm_join_timed(&j, FIXTURE_T0, 1000, 5000);
}

/* A heartbeat that claims an epoch not yet published cannot make a drain
 * look finished before the others run in the epoch without the drained
 * member. */
Test(broker, a_heartbeat_cannot_adopt_an_unpublished_epoch)
{
    fixture_sm_start_ab();
    cr_assert_eq(broker_drain(fixture_sm, FIXTURE_HOLD + 10, "demo", "a", true), 0);
    cr_assert_not(fixture_sm_beat_adopted("b", 12, FIXTURE_HOLD + 20, 99));
    broker_tick(fixture_sm, FIXTURE_HOLD + 100);
    cr_assert_eq(fixture_sm_last_pub()->number, 2);
    cr_assert_eq(broker_drained(fixture_sm, "demo", "a"), 0, "b never ran in epoch 2");
    cr_assert_not(fixture_sm_beat_adopted("b", 12, FIXTURE_HOLD + 200, 2));
    cr_assert_eq(broker_drained(fixture_sm, "demo", "a"), 1);
}

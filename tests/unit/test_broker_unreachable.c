/* tests/unit/test_broker_unreachable.c: the broker's rule for members
 * reported unreachable (broker_report_unreachable): more than half of the
 * current epoch must agree, within one member timeout, each from a
 * heartbeat in that epoch; one member alone, a member about itself, a
 * report about an older epoch, and the two halves of an even epoch evict
 * no one; the evicted member is benched, and its bench doubles while it
 * keeps being cut off. Under the fake host of fixture.h, on an injected
 * clock. */
#include <criterion/criterion.h>

#include <errno.h>

#include "fixture.h"
#include "membership/broker.h"

#define TIMEOUT WIRE_DEFAULT_TIMEOUT_MS

/* Watcher handles: addresses only. */
static int wa, wb, wc, wd;

/* Members named ids[i] with sessions 11, 12, ... joined at FIXTURE_T0,
 * watched, in one epoch formed at FIXTURE_HOLD. Returns its number. */
static uint64_t start_n(size_t n, const char *const *ids, void *const *w)
{
    fixture_sm_start(NULL);
    for (size_t i = 0; i < n; i++)
        cr_assert_eq(fixture_sm_join(ids[i], 1, 11 + i, FIXTURE_T0), 0);
    cr_assert_eq(fixture_sm_tick_members(FIXTURE_HOLD), n);
    for (size_t i = 0; i < n; i++)
        cr_assert_eq(broker_watch(fixture_sm, "demo", ids[i], 11 + i, w[i]), 0);
    fixture_sm_assert_members(fixture_sm_last_pub(), n, ids);
    return fixture_sm_last_pub()->number;
}

static uint64_t start_abc(void)
{
    return start_n(3, (const char *[]){ "a", "b", "c" }, (void *[]){ &wa, &wb, &wc });
}

/* Heartbeats of the members that still hold sessions 11.. (a, b, c, d),
 * so that none times out while a test's clock runs on; `c_session` is
 * c's (it changes when c rejoins). */
static void beats(uint64_t now, uint64_t c_session)
{
    const char *ids[] = { "a", "b", "c", "d" };

    for (size_t i = 0; i < 4; i++)
        (void)fixture_sm_beat(now, "demo", ids[i], i == 2 ? c_session : 11 + i, 1, false, NULL);
}

static int report(uint64_t now, const char *id, uint64_t session, uint64_t epoch,
                  const char *peer)
{
    return broker_report_unreachable(fixture_sm, now, "demo", id, session, epoch, peer);
}

Test(broker, unreachable_by_a_majority_is_evicted_and_benched)
{
    uint64_t e = start_abc(), t = FIXTURE_HOLD + 500;
    struct broker_join_result res = { 0 };
    struct broker_join j = { .cohort = "demo", .id = "c", .address = FIXTURE_ADDR,
                             .model_version = 1, .session = 99 };

    cr_assert_eq(report(t, "a", 11, e, "c"), 0);
    cr_assert_eq(fixture_sm_tick_members(t), 3, "one report is not a verdict");
    cr_assert_eq(report(t + 10, "b", 12, e, "c"), 0);
    cr_assert_eq(fixture_sm_tick_members(t + 10), 2, "two of three agree: out at once");
    fixture_sm_assert_detached(-EHOSTUNREACH, 1, (void *[]){ &wc });
    broker_tick(fixture_sm, t + 100);
    cr_assert_eq(fixture_sm_last_pub()->number, e + 1);
    fixture_sm_assert_members(fixture_sm_last_pub(), 2, (const char *[]){ "a", "b" });

    /* Benched for one timeout, whatever the session. */
    cr_assert_eq(broker_join(fixture_sm, t + 20, &j, &res), -EAGAIN);
    cr_assert_eq(res.benched_ms, TIMEOUT - 10);
    beats(t + 4000, 13);
    cr_assert_eq(fixture_sm_join("c", 1, 13, t + 10 + TIMEOUT - 1), -EAGAIN);
    cr_assert_eq(fixture_sm_tick_members(t + 10 + TIMEOUT - 1), 2);
    cr_assert_eq(fixture_sm_join("c", 1, 13, t + 10 + TIMEOUT), 0);
    cr_assert_eq(fixture_sm_tick_members(t + 10 + TIMEOUT + 100), 3);
}

Test(broker, one_lying_member_evicts_no_one)
{
    uint64_t e = start_abc(), t = FIXTURE_HOLD + 500;

    /* However often it says so: a reporter counts once. */
    for (int i = 0; i < 20; i++)
        cr_assert_eq(report(t + (uint64_t)i * 100, "a", 11, e, "c"), 0);
    cr_assert_eq(report(t + 2000, "a", 11, e, "b"), 0);
    cr_assert_eq(fixture_sm_tick_members(t + 2100), 3);
    cr_assert_eq(fixture_host.n_dets, 0);
    cr_assert_eq(fixture_sm_last_pub()->number, e);
}

Test(broker, a_member_cannot_report_itself)
{
    uint64_t e = start_abc(), t = FIXTURE_HOLD + 500;

    cr_assert_eq(report(t, "c", 13, e, "c"), -EINVAL);
    cr_assert_eq(report(t, "c", 13, e, NULL), -EINVAL);
    cr_assert_eq(report(t, "a", 11, e, "c"), 0);
    /* Its own report would have been the second. */
    cr_assert_eq(fixture_sm_tick_members(t + 10), 3);
}

Test(broker, unknown_reporters_and_peers_change_nothing)
{
    uint64_t e = start_abc(), t = FIXTURE_HOLD + 500;

    cr_assert_eq(report(t, "a", 99, e, "c"), -ENOENT, "another session of a");
    cr_assert_eq(report(t, "a", 0, e, "c"), -ENOENT);
    cr_assert_eq(report(t, "zz", 11, e, "c"), -ENOENT);
    cr_assert_eq(report(t, "a", 11, e, "zz"), -ENOENT);
    cr_assert_eq(broker_report_unreachable(fixture_sm, t, "nope", "a", 11, e, "c"), -ENOENT);
    cr_assert_eq(report(t, "b", 12, e, "c"), 0);
    cr_assert_eq(fixture_sm_tick_members(t + 10), 3);
}

Test(broker, reports_about_another_epoch_do_not_count)
{
    uint64_t e = start_abc(), t = FIXTURE_HOLD + 500;

    cr_assert_eq(report(t, "a", 11, e - 1, "c"), -ESTALE, "an older epoch");
    cr_assert_eq(report(t, "a", 11, e + 1, "c"), -ESTALE, "one not published");
    cr_assert_eq(report(t, "b", 12, e, "c"), 0);
    cr_assert_eq(fixture_sm_tick_members(t + 10), 3);

    /* A new epoch (d joins): b's report was about the old membership. */
    cr_assert_eq(fixture_sm_join("d", 1, 14, t + 20), 0);
    cr_assert_eq(fixture_sm_tick_members(t + 100), 4);
    cr_assert_eq(fixture_sm_last_pub()->number, e + 1);
    cr_assert_eq(report(t + 200, "a", 11, e, "c"), -ESTALE);
    cr_assert_eq(report(t + 200, "a", 11, e + 1, "c"), 0);
    cr_assert_eq(report(t + 210, "d", 14, e + 1, "c"), 0);
    cr_assert_eq(fixture_sm_tick_members(t + 220), 4, "two of four are not more than half");
    cr_assert_eq(report(t + 230, "b", 12, e + 1, "c"), 0);
    cr_assert_eq(fixture_sm_tick_members(t + 240), 3);
}

Test(broker, a_member_not_in_the_epoch_neither_reports_nor_is_reported)
{
    uint64_t e = start_abc(), t = FIXTURE_HOLD + 500;

    /* d joined after the epoch formed: it is in no epoch yet. */
    cr_assert_eq(fixture_sm_join("d", 1, 14, t), 0);
    cr_assert_eq(report(t, "d", 14, e, "c"), -ESTALE);
    cr_assert_eq(report(t, "a", 11, e, "d"), -ESTALE);
    cr_assert_eq(report(t, "b", 12, e, "d"), -ESTALE);
    cr_assert_eq(fixture_sm_tick_members(t + 10), 4);
}

Test(broker, reports_further_apart_than_a_timeout_do_not_add_up)
{
    uint64_t e = start_abc(), t = FIXTURE_HOLD + 500;

    cr_assert_eq(report(t, "a", 11, e, "c"), 0);
    /* c's heartbeats go on meanwhile (a member cut from its peers only):
     * they do not undo a report, and keep it from timing out. */
    for (uint64_t k = 1; k <= 5; k++)
        cr_assert_eq(fixture_sm_beat(t + k * 1000, "demo", "c", 13, 1, false, NULL), 0);
    for (uint64_t k = 1; k <= 5; k++) {
        cr_assert_eq(fixture_sm_beat(t + k * 1000, "demo", "a", 11, 1, false, NULL), 0);
        cr_assert_eq(fixture_sm_beat(t + k * 1000, "demo", "b", 12, 1, false, NULL), 0);
    }
    cr_assert_eq(report(t + TIMEOUT, "b", 12, e, "c"), 0);
    cr_assert_eq(fixture_sm_tick_members(t + TIMEOUT + 10), 3, "a's report is too old");
    cr_assert_eq(report(t + TIMEOUT + 20, "a", 11, e, "c"), 0);
    cr_assert_eq(fixture_sm_tick_members(t + TIMEOUT + 30), 2);
}

Test(broker, heartbeats_of_the_accused_do_not_undo_the_reports)
{
    uint64_t e = start_abc(), t = FIXTURE_HOLD + 500;

    cr_assert_eq(report(t, "a", 11, e, "c"), 0);
    cr_assert_eq(fixture_sm_beat(t + 100, "demo", "c", 13, 1, false, NULL), 0);
    cr_assert_eq(broker_watch(fixture_sm, "demo", "c", 13, &wd), 0);
    cr_assert_eq(report(t + 200, "b", 12, e, "c"), 0);
    cr_assert_eq(fixture_sm_beat(t + 210, "demo", "c", 13, 1, false, NULL), 0);
    cr_assert_eq(fixture_sm_tick_members(t + 220), 2);
}

Test(broker, two_members_cannot_evict_each_other)
{
    uint64_t e, t = FIXTURE_HOLD + 500;

    fixture_sm_start_ab();
    e = fixture_sm_last_pub()->number;
    cr_assert_eq(report(t, "a", 11, e, "b"), 0);
    cr_assert_eq(report(t, "b", 12, e, "a"), 0);
    cr_assert_eq(fixture_sm_tick_members(t + 10), 2);
}

Test(broker, equal_halves_of_an_even_epoch_evict_no_one)
{
    const char *ids[] = { "a", "b", "c", "d" };
    uint64_t e = start_n(4, ids, (void *[]){ &wa, &wb, &wc, &wd }), t = FIXTURE_HOLD + 500;

    /* {a, b} | {c, d}: each side reports the other. */
    for (size_t i = 0; i < 2; i++)
        for (size_t k = 2; k < 4; k++) {
            cr_assert_eq(report(t, ids[i], 11 + i, e, ids[k]), 0);
            cr_assert_eq(report(t, ids[k], 11 + k, e, ids[i]), 0);
        }
    cr_assert_eq(fixture_sm_tick_members(t + 10), 4);
    /* {a, b, c} | {d}: d alone is the minority. */
    cr_assert_eq(report(t + 20, "c", 13, e, "d"), 0);
    cr_assert_eq(fixture_sm_tick_members(t + 30), 3);
    fixture_sm_assert_detached(-EHOSTUNREACH, 1, (void *[]){ &wd });
}

Test(broker, the_bench_doubles_while_a_member_stays_cut_off)
{
    uint64_t e = start_abc(), t = FIXTURE_HOLD + 500, back;

    cr_assert_eq(report(t, "a", 11, e, "c"), 0);
    cr_assert_eq(report(t, "b", 12, e, "c"), 0);
    cr_assert_eq(fixture_sm_tick_members(t), 2);
    back = t + TIMEOUT;
    cr_assert_eq(fixture_sm_join("c", 1, 20, back), 0);
    beats(back, 20);
    cr_assert_eq(fixture_sm_tick_members(back + 100), 3);
    e = fixture_sm_last_pub()->number;
    beats(back + 2900, 20);
    /* Still cut off: the next verdict within a bench of its return. */
    cr_assert_eq(report(back + 3000, "a", 11, e, "c"), 0);
    cr_assert_eq(report(back + 3000, "b", 12, e, "c"), 0);
    cr_assert_eq(fixture_sm_tick_members(back + 3000), 2);
    for (uint64_t k = 1; k <= 3; k++)
        beats(back + 3000 + k * 3000, 20);
    cr_assert_eq(fixture_sm_join("c", 1, 21, back + 3000 + 2 * TIMEOUT - 1), -EAGAIN);
    cr_assert_eq(fixture_sm_join("c", 1, 21, back + 3000 + 2 * TIMEOUT), 0);
    cr_assert_eq(fixture_sm_tick_members(back + 3000 + 2 * TIMEOUT + 100), 3);
}

Test(broker, the_bench_is_capped_and_forgotten)
{
    uint64_t e = start_abc(), t = FIXTURE_HOLD + 500, bench = TIMEOUT;
    struct broker_join_result res = { 0 };
    struct broker_join j = { .cohort = "demo", .id = "c", .address = FIXTURE_ADDR,
                             .model_version = 1 };

    for (int round = 0; round < 8; round++) {
        beats(t, j.session);
        cr_assert_eq(report(t, "a", 11, e, "c"), 0);
        cr_assert_eq(report(t, "b", 12, e, "c"), 0);
        cr_assert_eq(fixture_sm_tick_members(t), 2);
        j.session = 100 + (uint64_t)round;
        cr_assert_eq(broker_join(fixture_sm, t, &j, &res), -EAGAIN);
        cr_assert_eq(res.benched_ms, bench, "verdict %d", round);
        for (uint64_t k = 1000; k < bench; k += 1000)
            beats(t + k, j.session);
        t += bench;
        cr_assert_eq(broker_join(fixture_sm, t, &j, &res), 0);
        cr_assert_eq(fixture_sm_tick_members(t + 100), 3);
        e = fixture_sm_last_pub()->number;
        t += 200;
        if (bench < (uint64_t)BROKER_BENCH_MAX_FACTOR * TIMEOUT)
            bench *= 2;
    }
    /* A whole bench back in without a verdict: the next one is short again. */
    for (uint64_t k = 1000; k <= bench; k += 1000)
        beats(t + k, j.session);
    t += bench;
    beats(t, j.session);
    cr_assert_eq(report(t, "a", 11, e, "c"), 0);
    cr_assert_eq(report(t, "b", 12, e, "c"), 0);
    cr_assert_eq(fixture_sm_tick_members(t), 2);
    cr_assert_eq(broker_join(fixture_sm, t, &j, &res), -EAGAIN);
    cr_assert_eq(res.benched_ms, TIMEOUT);
}

Test(broker, the_first_join_after_evictions_empty_a_cohort_holds_the_next_epoch)
{
    uint64_t e = start_abc(), out = FIXTURE_T0 + TIMEOUT + 1, back;
    uint64_t hold = FIXTURE_HOLD - FIXTURE_T0;      /* the fixture's startup hold */

    /* A broker cut off from everyone: all three fall silent and go. */
    cr_assert_eq(fixture_sm_tick_members(out), 0);
    broker_tick(fixture_sm, out + 100);
    cr_assert_eq(fixture_sm_last_pub()->number, e + 1);
    cr_assert_eq(fixture_sm_last_pub()->n_members, 0);
    /* Long after, they come back one at a time: no epoch of the first
     * alone, one of all three once the hold from its join has passed. */
    back = out + 10 * hold;
    cr_assert_eq(fixture_sm_join("c", 1, 23, back), 0);
    broker_tick(fixture_sm, back + 100);
    cr_assert_eq(fixture_sm_last_pub()->number, e + 1, "no epoch of c alone");
    cr_assert_eq(fixture_sm_join("a", 1, 21, back + hold / 4), 0);
    cr_assert_eq(fixture_sm_join("b", 1, 22, back + hold / 2), 0);
    broker_tick(fixture_sm, back + hold - 1);
    cr_assert_eq(fixture_sm_last_pub()->number, e + 1);
    broker_tick(fixture_sm, back + hold);
    cr_assert_eq(fixture_sm_last_pub()->number, e + 2);
    fixture_sm_assert_members(fixture_sm_last_pub(), 3, (const char *[]){ "a", "b", "c" });
    /* Only after everyone was evicted: a join to a cohort that lost one
     * member forms its epoch at once. */
    cr_assert_eq(fixture_sm_join("d", 1, 24, back + hold + 100), 0);
    broker_tick(fixture_sm, back + hold + 200);
    cr_assert_eq(fixture_sm_last_pub()->number, e + 3);
}

/* tests/unit/test_broker_epochs.c: how the broker state machine forms
 * epochs: the startup hold, coalescing, member order, the leader, declared
 * and undeclared versions, changes that cancel out, and the references it
 * holds on what it published; under the fake host of fixture.h, on an
 * injected clock. */
#include <criterion/criterion.h>

#include <errno.h>

#include "fixture.h"
#include "membership/broker.h"

/* ---- joining and epochs ---- */

/* The tick just before `t` publishes nothing; the tick at t publishes
 * epoch `number` of exactly these n members. */
static void check_formed_at(uint64_t t, uint64_t number, size_t n, const char *const *ids)
{
    size_t before = fixture_host.n_pubs;

    broker_tick(fixture_sm, t - 1);
    cr_assert_eq(fixture_host.n_pubs, before, "an epoch formed before %llu", (unsigned long long)t);
    broker_tick(fixture_sm, t);
    cr_assert_eq(fixture_host.n_pubs, before + 1);
    cr_assert_eq(fixture_sm_last_pub()->number, number);
    fixture_sm_assert_members(fixture_sm_last_pub(), n, ids);
}

Test(broker, join_happy_path_first_epoch_after_startup_hold)
{
    struct broker_join j = { .cohort = "demo", .id = "a", .address = FIXTURE_ADDR, .session = 11 };
    struct epoch *e;

    fixture_sm_start(NULL);
    cr_assert_eq(fixture_sm_join_timed(&j, FIXTURE_T0, 1000, 5000), 0, "no epoch yet");
    cr_assert_eq(fixture_sm_join_full("demo", "b", FIXTURE_ADDR2, 3, 12, 0, FIXTURE_T0 + 10), 0);

    broker_tick(fixture_sm, FIXTURE_T0 + 100);
    cr_assert_eq(fixture_host.n_pubs, 0, "an epoch formed during the startup hold");
    check_formed_at(FIXTURE_HOLD, 1, 2, (const char *[]){ "a", "b" });
    e = fixture_sm_last_pub();
    cr_assert_str_eq(e->cohort, "demo");
    cr_assert_str_eq(e->members[0].address, FIXTURE_ADDR);
    cr_assert_str_eq(e->members[1].address, FIXTURE_ADDR2);
    cr_assert_eq(e->members[1].model_version, 3);
    cr_assert_str_eq(fixture_sm_leader(e), "b");
    fixture_sm_assert_published_to(0, NULL);        /* nobody watches yet */

    cr_assert_eq(fixture_sm_join_timed(&j, FIXTURE_HOLD, 1000, 5000), 1);
}

Test(broker, join_coalesces_changes_within_window)
{
    fixture_sm_start(NULL);
    broker_tick(fixture_sm, FIXTURE_HOLD);
    cr_assert_eq(fixture_sm_join("a", 0, 1, FIXTURE_HOLD + 100), 0);
    cr_assert_eq(fixture_sm_join("b", 0, 2, FIXTURE_HOLD + 120), 0);
    broker_tick(fixture_sm, FIXTURE_HOLD + 130);
    cr_assert_eq(fixture_sm_join("c", 0, 3, FIXTURE_HOLD + 140), 0);
    check_formed_at(FIXTURE_HOLD + 150, 1, 3, (const char *[]){ "a", "b", "c" });

    /* After the window: a second epoch. */
    cr_assert_eq(fixture_sm_join("d", 0, 4, FIXTURE_HOLD + 200), 0);
    check_formed_at(FIXTURE_HOLD + 250, 2, 4, (const char *[]){ "a", "b", "c", "d" });
    broker_tick(fixture_sm, FIXTURE_HOLD + 1000);
    cr_assert_eq(fixture_host.n_pubs, 2);
}

/* ---- member order and leader ---- */

struct first_epoch {
    size_t n;
    const char *ids[4];             /* joined in this order, sessions 1 .. n */
    uint64_t versions[4];
    const char *order[4];           /* the epoch's member order */
    size_t leader;                  /* the leader's index in it */
};

/* The members of `f` join during the startup hold; the epoch formed at
 * its end must list them in f->order, led by f->leader. */
static void check_first_epoch(const struct first_epoch *f)
{
    fixture_sm_start(NULL);
    for (size_t i = 0; i < f->n; i++)
        cr_assert_eq(fixture_sm_join(f->ids[i], f->versions[i], i + 1, FIXTURE_T0), 0);
    broker_tick(fixture_sm, FIXTURE_HOLD);
    fixture_sm_assert_members(fixture_sm_last_pub(), f->n, f->order);
    cr_assert_eq(fixture_sm_last_pub()->leader, f->leader);
    cr_assert_str_eq(fixture_sm_leader(fixture_sm_last_pub()), f->order[f->leader]);
}

Test(broker, members_are_in_natural_order)
{
    check_first_epoch(&(struct first_epoch){
        .n = 4, .ids = { "c-10", "c-2", "c-1", "b-100" }, .versions = { 0, 0, 0, 0 },
        .order = { "b-100", "c-1", "c-2", "c-10" }, .leader = 0 });
}

Test(broker, leader_is_highest_version)
{
    check_first_epoch(&(struct first_epoch){
        .n = 4, .ids = { "a-0", "a-1", "a-2", "a-3" }, .versions = { 5, 9, 9, 2 },
        .order = { "a-0", "a-1", "a-2", "a-3" }, .leader = 1 });
}

Test(broker, leader_tie_goes_to_first_in_natural_order)
{
    check_first_epoch(&(struct first_epoch){
        .n = 2, .ids = { "c-10", "c-2" }, .versions = { 7, 7 },
        .order = { "c-2", "c-10" }, .leader = 0 });
}

/* ---- declared and undeclared versions ---- */

Test(broker, undeclared_version_forms_no_epoch_but_counts_at_next_election)
{
    struct broker_status *s;

    fixture_sm_start_ab();
    cr_assert_str_eq(fixture_sm_leader(fixture_sm_last_pub()), "a");
    cr_assert_eq(fixture_sm_beat(FIXTURE_HOLD + 10, "demo", "b", 12, 5, false, NULL), 0);
    broker_tick(fixture_sm, FIXTURE_HOLD + 1000);
    cr_assert_eq(fixture_host.n_pubs, 1, "an undeclared version forced an epoch");

    cr_assert_eq(broker_status(fixture_sm, "demo", &s), 0);
    cr_assert_eq(s->cohorts[0].members[1].model_version, 5);
    cr_assert_str_eq(s->cohorts[0].leader, "a");
    broker_status_free(s);

    cr_assert_eq(fixture_sm_join("c", 0, 13, FIXTURE_HOLD + 1000), 0);
    broker_tick(fixture_sm, FIXTURE_HOLD + 1050);
    cr_assert_eq(fixture_sm_last_pub()->number, 2);
    cr_assert_str_eq(fixture_sm_leader(fixture_sm_last_pub()), "b");
    cr_assert_eq(fixture_sm_last_pub()->members[1].model_version, 5);
}

Test(broker, undeclared_version_does_not_break_cancel_out)
{
    fixture_sm_start_ab();
    cr_assert_eq(fixture_sm_beat(FIXTURE_HOLD + 10, "demo", "b", 12, 5, false, NULL), 0);
    cr_assert_eq(fixture_sm_join("c", 0, 13, FIXTURE_HOLD + 20), 0);
    cr_assert_eq(broker_leave(fixture_sm, FIXTURE_HOLD + 30, "demo", "c", 13), 0);
    broker_tick(fixture_sm, FIXTURE_HOLD + 100);
    cr_assert_eq(fixture_host.n_pubs, 1);
}

Test(broker, declared_version_changing_leader_forms_epoch)
{
    uint64_t epoch = 0;

    fixture_sm_start_ab();
    cr_assert_eq(fixture_sm_beat(FIXTURE_HOLD + 10, "demo", "b", 12, 5, true, &epoch), 0);
    cr_assert_eq(epoch, 1);
    check_formed_at(FIXTURE_HOLD + 60, 2, 2, (const char *[]){ "a", "b" });
    cr_assert_str_eq(fixture_sm_leader(fixture_sm_last_pub()), "b");
    cr_assert_eq(fixture_sm_beat(FIXTURE_HOLD + 60, "demo", "a", 11, 1, false, &epoch), 0);
    cr_assert_eq(epoch, 2);
}

/* Declared versions of a and b at FIXTURE_HOLD + 10 and + 20 (in that
 * order) that must leave epoch 1 the only one. */
static void declared_versions_form_no_epoch(const char *id10, uint64_t session10,
                                            uint64_t version10, const char *id20,
                                            uint64_t session20, uint64_t version20)
{
    fixture_sm_start_ab();
    cr_assert_eq(fixture_sm_beat(FIXTURE_HOLD + 10, "demo", id10, session10, version10, true,
                                 NULL), 0);
    cr_assert_eq(fixture_sm_beat(FIXTURE_HOLD + 20, "demo", id20, session20, version20, true,
                                 NULL), 0);
    broker_tick(fixture_sm, FIXTURE_HOLD + 1000);
    cr_assert_eq(fixture_host.n_pubs, 1);
}

Test(broker, declared_version_keeping_leader_forms_no_epoch)
{
    /* A tie keeps a, the first in member order; then the leader itself
     * moving ahead keeps it leader. */
    declared_versions_form_no_epoch("b", 12, 1, "a", 11, 3);
}

Test(broker, declared_version_reverted_in_window_forms_no_epoch)
{
    declared_versions_form_no_epoch("b", 12, 5, "b", 12, 1);
}

/* ---- cancelling changes ---- */

Test(broker, join_then_leave_within_window_publishes_nothing)
{
    fixture_sm_start_ab();
    cr_assert_eq(fixture_sm_join("c", 0, 13, FIXTURE_HOLD + 10), 0);
    cr_assert_eq(broker_leave(fixture_sm, FIXTURE_HOLD + 20, "demo", "c", 13), 0);
    broker_tick(fixture_sm, FIXTURE_HOLD + 60);
    broker_tick(fixture_sm, FIXTURE_HOLD + 1000);
    cr_assert_eq(fixture_host.n_pubs, 1);
    cr_assert_eq(fixture_sm_epoch("demo"), 1);
}

/* b (session 12) leaves and comes back with `session` within one window;
 * returns the number of publishes after the window. */
static size_t leave_and_rejoin_b(uint64_t session)
{
    fixture_sm_start_ab();
    cr_assert_eq(broker_leave(fixture_sm, FIXTURE_HOLD + 10, "demo", "b", 12), 0);
    cr_assert_eq(fixture_sm_join("b", 1, session, FIXTURE_HOLD + 20), 0);
    broker_tick(fixture_sm, FIXTURE_HOLD + 60);
    return fixture_host.n_pubs;
}

Test(broker, leave_then_rejoin_same_session_publishes_nothing)
{
    cr_assert_eq(leave_and_rejoin_b(12), 1);
}

Test(broker, leave_then_rejoin_new_session_forms_epoch)
{
    cr_assert_eq(leave_and_rejoin_b(22), 2);
    fixture_sm_assert_members(fixture_sm_last_pub(), 2, (const char *[]){ "a", "b" });
}

Test(broker, join_and_leave_during_hold_publishes_nothing)
{
    fixture_sm_start(NULL);
    cr_assert_eq(fixture_sm_join("a", 0, 1, FIXTURE_T0), 0);
    cr_assert_eq(broker_leave(fixture_sm, FIXTURE_T0 + 10, "demo", "a", 1), 0);
    broker_tick(fixture_sm, FIXTURE_HOLD);
    cr_assert_eq(fixture_host.n_pubs, 0);
    cr_assert_eq(fixture_sm_epoch("demo"), 0);
}

/* ---- no hold, no window; references ---- */

Test(broker, tick_never_returns_zero)
{
    struct broker_config cfg;

    broker_config_default(&cfg);
    cfg.coalesce_ms = 0;
    cfg.startup_hold_ms = 0;
    fixture_sm_start(&cfg);
    cr_assert_eq(fixture_sm_join("a", 0, 1, FIXTURE_T0), 0);
    cr_assert_geq(broker_tick(fixture_sm, FIXTURE_T0), 1);
    cr_assert_eq(fixture_host.n_pubs, 1, "no coalescing, no hold: formed at once");
}

/* The broker holds its own reference on the epoch it published: the host
 * dropping every one of its references must not free it, and a newer epoch
 * must not free the older one under a holder. ASan checks both. */
Test(broker, published_epoch_is_held_by_broker_and_holders)
{
    static int wa;
    struct epoch *first;

    fixture_sm_start_ab();
    epoch_unref(fixture_host.pubs[0].e);
    fixture_host.n_pubs = 0;
    cr_assert_eq(broker_watch(fixture_sm, "demo", "a", 11, &wa), 0);
    first = fixture_sm_last_pub();
    cr_assert_eq(first->number, 1);
    fixture_sm_assert_members(first, 2, (const char *[]){ "a", "b" });

    fixture_sm_add_c();
    cr_assert_str_eq(first->cohort, "demo");
    fixture_sm_assert_members(first, 2, (const char *[]){ "a", "b" });
}

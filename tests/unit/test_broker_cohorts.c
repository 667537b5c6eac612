/* tests/unit/test_broker_cohorts.c: the broker state machine's
 * configuration, cohorts, caps, refusals and status, and its load: the
 * broker under the fake host of fixture.h, on an injected clock. */
#include <criterion/criterion.h>

#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "fixture.h"
#include "membership/broker.h"

/* Distinct addresses that stand in for the host's watcher handles. */
static int wa, wb, wc;

/* ---- configuration and cohorts ---- */

Test(broker, config_default_values)
{
    struct broker_config cfg;

    broker_config_default(&cfg);
    cr_assert_eq(cfg.heartbeat_ms, 1000);
    cr_assert_eq(cfg.timeout_ms, 5000);
    cr_assert_eq(cfg.coalesce_ms, 50);
    cr_assert_eq(cfg.startup_hold_ms, broker_startup_hold_ms(cfg.heartbeat_ms));
    cr_assert_eq(cfg.startup_hold_ms, 3200);
    cr_assert_eq(cfg.max_members, 4096);
    cr_assert_eq(cfg.max_cohorts, 1024);
    cr_assert_not(cfg.allow_any_cohort);
}

Test(broker, create_rejects_config_that_cannot_work)
{
    struct broker_config def, bad[5], cfg;

    broker_config_default(&def);
    for (size_t i = 0; i < 5; i++)
        bad[i] = def;
    bad[0].heartbeat_ms = 0;
    bad[1].timeout_ms = def.heartbeat_ms;
    bad[2].timeout_ms = def.heartbeat_ms - 1;
    bad[3].max_members = 0;
    bad[4].max_cohorts = 0;
    for (size_t i = 0; i < 5; i++)
        cr_assert_eq(broker_create(&bad[i], &fixture_host_ops, FIXTURE_T0, &fixture_sm), -EINVAL,
                     "config %zu", i);
    cr_assert_null(fixture_sm);

    /* No coalescing and no hold are unusual but work. */
    cfg = def;
    cfg.coalesce_ms = 0;
    cfg.startup_hold_ms = 0;
    cr_assert_eq(broker_create(&cfg, &fixture_host_ops, FIXTURE_T0, &fixture_sm), 0);
}

Test(broker, destroy_accepts_null)
{
    broker_destroy(NULL);
    broker_status_free(NULL);
}

Test(broker, cohort_declare_and_remove)
{
    struct broker_status *s;

    fixture_sm_start(NULL);
    cr_assert_eq(broker_cohort_declare(fixture_sm, "ns/train", 500, 3000), 0);
    cr_assert_eq(broker_status(fixture_sm, "ns/train", &s), 0);
    cr_assert_str_eq(s->cohorts[0].name, "ns/train");
    cr_assert_eq(s->cohorts[0].heartbeat_ms, 500);
    cr_assert_eq(s->cohorts[0].timeout_ms, 3000);
    cr_assert_eq(s->cohorts[0].epoch, 0);
    cr_assert_null(s->cohorts[0].leader);
    broker_status_free(s);

    /* Declaring again updates the settings. */
    cr_assert_eq(broker_cohort_declare(fixture_sm, "ns/train", 0, 0), 0);
    cr_assert_eq(broker_status(fixture_sm, "ns/train", &s), 0);
    cr_assert_eq(s->cohorts[0].heartbeat_ms, 1000);
    cr_assert_eq(s->cohorts[0].timeout_ms, 5000);
    broker_status_free(s);

    cr_assert_eq(broker_cohort_remove(fixture_sm, "ns/train"), 0);
    cr_assert_eq(broker_status(fixture_sm, "ns/train", &s), -ENOENT);
    cr_assert_eq(broker_cohort_remove(fixture_sm, "ns/train"), -ENOENT);
    cr_assert_eq(broker_cohort_remove(fixture_sm, "never"), -ENOENT);
}

Test(broker, cohort_declare_rejects_bad_input)
{
    static const struct {
        const char *name;
        uint32_t heartbeat_ms, timeout_ms;
    } bad[] = {
        { "", 0, 0 }, { NULL, 0, 0 }, { "a/b/c", 0, 0 }, { "-x", 0, 0 },
        { "x", 1000, 1000 }, { "x", 6000, 0 },
    };

    fixture_sm_start(NULL);
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        cr_assert_eq(broker_cohort_declare(fixture_sm, bad[i].name, bad[i].heartbeat_ms,
                                           bad[i].timeout_ms), -EINVAL, "declaration %zu", i);
    cr_assert_eq(broker_status(fixture_sm, "x", &(struct broker_status *){ NULL }), -ENOENT);
}

Test(broker, cohort_settings_apply_to_later_joins_only)
{
    struct broker_join j = { .cohort = "demo", .id = "a", .address = FIXTURE_ADDR, .session = 1 };

    fixture_sm_start(NULL);
    fixture_sm_join_timed(&j, FIXTURE_T0, 1000, 5000);
    cr_assert_eq(broker_cohort_declare(fixture_sm, "demo", 200, 1000), 0);
    j.id = "b";
    j.session = 2;
    fixture_sm_join_timed(&j, FIXTURE_T0, 200, 1000);

    /* b goes with its 1 s timeout, a keeps the 5 s it joined with. */
    cr_assert_eq(fixture_sm_tick_members(FIXTURE_T0 + 1001), 1);
    cr_assert_eq(fixture_sm_tick_members(FIXTURE_T0 + 5001), 0);
}

Test(broker, cohort_remove_detaches_watchers_with_eshutdown)
{
    fixture_sm_start_ab();
    fixture_sm_watch_a_b_and_other_c(&wa, &wb, &wc);
    cr_assert_eq(broker_cohort_remove(fixture_sm, "demo"), 0);
    fixture_sm_assert_detached(-ESHUTDOWN, 2, (void *[]){ &wa, &wb });
    cr_assert_eq(fixture_sm_beat(FIXTURE_HOLD, "demo", "a", 11, 1, false, NULL), -ENOENT);
    cr_assert_eq(fixture_sm_beat(FIXTURE_HOLD, "other", "c", 13, 0, false, NULL), 0);
}

/* ---- unknown cohorts, caps, bad input ---- */

Test(broker, join_unknown_cohort_is_enoent)
{
    struct broker_status *s;

    fixture_sm_start(NULL);
    cr_assert_eq(fixture_sm_join_full("nope", "a", FIXTURE_ADDR, 0, 1, 0, FIXTURE_T0), -ENOENT);
    cr_assert_eq(broker_status(fixture_sm, "nope", &s), -ENOENT);
    cr_assert_eq(fixture_sm_beat(FIXTURE_T0, "nope", "a", 1, 0, false, NULL), -ENOENT);
    cr_assert_eq(broker_watch(fixture_sm, "nope", "a", 1, &wa), -ENOENT);
}

/* fixture_sm_start() with allow_any_cohort, and max_cohorts when not 0. */
static void start_open(uint32_t max_cohorts)
{
    struct broker_config cfg;

    broker_config_default(&cfg);
    cfg.startup_hold_ms = FIXTURE_HOLD - FIXTURE_T0;
    cfg.allow_any_cohort = true;
    if (max_cohorts)
        cfg.max_cohorts = max_cohorts;
    fixture_sm_start(&cfg);
}

Test(broker, allow_any_cohort_creates_cohort)
{
    struct broker_status *s;

    start_open(0);
    cr_assert_eq(fixture_sm_join_full("ns/fresh", "a", FIXTURE_ADDR, 0, 1, 0, FIXTURE_T0), 0);
    cr_assert_eq(broker_status(fixture_sm, "ns/fresh", &s), 0);
    cr_assert_eq(s->cohorts[0].n_members, 1);
    cr_assert_eq(s->cohorts[0].heartbeat_ms, 1000);
    cr_assert_eq(s->cohorts[0].timeout_ms, 5000);
    broker_status_free(s);
    broker_tick(fixture_sm, FIXTURE_HOLD);
    cr_assert_str_eq(fixture_sm_last_pub()->cohort, "ns/fresh");
}

Test(broker, allow_any_cohort_creates_nothing_on_failure)
{
    struct broker_status *s;

    start_open(0);
    cr_assert_eq(fixture_sm_join_full("fresh", "a", "bad", 0, 1, 0, FIXTURE_T0), -EINVAL);
    cr_assert_eq(fixture_sm_join_full("fresh", "a", FIXTURE_ADDR, 0, 0, 0, FIXTURE_T0), -EINVAL);
    cr_assert_eq(broker_status(fixture_sm, "fresh", &s), -ENOENT);
}

Test(broker, join_rejects_past_max_members)
{
    struct broker_config cfg;

    broker_config_default(&cfg);
    cfg.max_members = 2;
    fixture_sm_start(&cfg);
    cr_assert_eq(fixture_sm_join("a", 0, 1, FIXTURE_T0), 0);
    cr_assert_eq(fixture_sm_join("b", 0, 2, FIXTURE_T0), 0);
    cr_assert_eq(fixture_sm_join("c", 0, 3, FIXTURE_T0), -ENOSPC);
    cr_assert_eq(fixture_sm_members("demo"), 2);
    /* A rejoin at the cap is not a new member. */
    cr_assert_eq(fixture_sm_join("a", 0, 1, FIXTURE_T0 + 10), 0);
    cr_assert_eq(broker_leave(fixture_sm, FIXTURE_T0 + 10, "demo", "b", 2), 0);
    cr_assert_eq(fixture_sm_join("c", 0, 3, FIXTURE_T0 + 10), 0);
}

Test(broker, cohorts_past_max_cohorts_are_enospc)
{
    struct broker_status *s;

    start_open(2);
    cr_assert_eq(broker_cohort_declare(fixture_sm, "two", 0, 0), 0);
    cr_assert_eq(broker_cohort_declare(fixture_sm, "three", 0, 0), -ENOSPC);
    cr_assert_eq(fixture_sm_join_full("three", "a", FIXTURE_ADDR, 0, 1, 0, FIXTURE_T0), -ENOSPC);
    cr_assert_eq(broker_cohort_declare(fixture_sm, "two", 500, 0), 0);
    cr_assert_eq(broker_status(fixture_sm, NULL, &s), 0);
    cr_assert_eq(s->n_cohorts, 2);
    broker_status_free(s);
    cr_assert_eq(broker_cohort_remove(fixture_sm, "two"), 0);
    cr_assert_eq(fixture_sm_join_full("three", "a", FIXTURE_ADDR, 0, 1, 0, FIXTURE_T0), 0);
}

Test(broker, join_rejects_invalid_input_and_changes_nothing)
{
    static char long_id[300];
    /* Each join is wrong in one field; the cohort and a and b are fine. */
    const struct {
        const char *cohort, *id, *address;
        uint64_t session;
    } bad[] = {
        { "demo", "", FIXTURE_ADDR, 5 }, { "demo", "-a", FIXTURE_ADDR, 5 },
        { "demo", ".a", FIXTURE_ADDR, 5 }, { "demo", "a b", FIXTURE_ADDR, 5 },
        { "demo", "a/b", FIXTURE_ADDR, 5 }, { "demo", "a:b", FIXTURE_ADDR, 5 },
        { "demo", "é", FIXTURE_ADDR, 5 }, { "demo", long_id, FIXTURE_ADDR, 5 },
        { "demo", NULL, FIXTURE_ADDR, 5 },
        { "demo", "c", "", 5 }, { "demo", "c", "host", 5 }, { "demo", "c", "host:", 5 },
        { "demo", "c", ":80", 5 }, { "demo", "c", "host:0", 5 },
        { "demo", "c", "host:65536", 5 }, { "demo", "c", "host:80x", 5 },
        { "demo", "c", "ho st:80", 5 }, { "demo", "c", "[::1]", 5 },
        { "demo", "c", "[]:80", 5 }, { "demo", "c", "[::g]:80", 5 }, { "demo", "c", NULL, 5 },
        { "demo", "c", FIXTURE_ADDR, 0 },
        { "de mo", "c", FIXTURE_ADDR, 5 }, { "a/b/c", "c", FIXTURE_ADDR, 5 },
        { NULL, "c", FIXTURE_ADDR, 5 },
        /* A bad address on a rejoin leaves the member as it was. */
        { "demo", "a", "bad", 11 },
    };
    struct broker_join_result res;

    memset(long_id, 'x', sizeof long_id - 1);
    fixture_sm_start_ab();
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        cr_assert_eq(fixture_sm_join_full(bad[i].cohort, bad[i].id, bad[i].address, 0,
                                          bad[i].session, 0, FIXTURE_HOLD), -EINVAL,
                     "join %zu: cohort %s id %.20s address %s session %llu", i, bad[i].cohort,
                     bad[i].id, bad[i].address, (unsigned long long)bad[i].session);
    cr_assert_eq(broker_join(fixture_sm, FIXTURE_HOLD, NULL, &res), -EINVAL);

    broker_tick(fixture_sm, FIXTURE_HOLD + 1000);
    cr_assert_eq(fixture_host.n_pubs, 1);
    cr_assert_eq(fixture_sm_members("demo"), 2);
    cr_assert_str_eq(fixture_sm_last_pub()->members[0].address, FIXTURE_ADDR);
}

/* ---- status ---- */

Test(broker, status_snapshot_contents)
{
    struct broker_status *s;
    struct broker_cohort_status *cs;

    fixture_sm_start(NULL);
    cr_assert_eq(broker_cohort_declare(fixture_sm, "job-10", 0, 0), 0);
    cr_assert_eq(broker_cohort_declare(fixture_sm, "job-2", 250, 1000), 0);
    cr_assert_eq(fixture_sm_join_full("job-10", "m-10", FIXTURE_ADDR, 3, 1, 0, FIXTURE_T0), 0);
    cr_assert_eq(fixture_sm_join_full("job-10", "m-2", FIXTURE_ADDR2, 8, 2, 0, FIXTURE_T0), 0);
    broker_tick(fixture_sm, FIXTURE_HOLD);
    cr_assert_eq(fixture_sm_beat(FIXTURE_HOLD + 1, "job-10", "m-10", 1, 9, false, NULL), 0);

    cr_assert_eq(broker_status(fixture_sm, NULL, &s), 0);
    cr_assert_eq(s->n_cohorts, 3);
    cr_assert_str_eq(s->cohorts[0].name, "demo");
    cr_assert_str_eq(s->cohorts[1].name, "job-2");
    cr_assert_str_eq(s->cohorts[2].name, "job-10");
    cr_assert_eq(s->cohorts[1].heartbeat_ms, 250);
    cr_assert_eq(s->cohorts[1].timeout_ms, 1000);
    cr_assert_eq(s->cohorts[1].n_members, 0);
    cr_assert_null(s->cohorts[1].leader);

    cs = &s->cohorts[2];
    cr_assert_eq(cs->epoch, 1);
    cr_assert_str_eq(cs->leader, "m-2", "the leader of the published epoch");
    cr_assert_eq(cs->heartbeat_ms, 1000);
    cr_assert_eq(cs->timeout_ms, 5000);
    cr_assert_eq(cs->n_members, 2);
    cr_assert_str_eq(cs->members[0].id, "m-2");
    cr_assert_str_eq(cs->members[0].address, FIXTURE_ADDR2);
    cr_assert_eq(cs->members[0].model_version, 8);
    cr_assert_str_eq(cs->members[1].id, "m-10");
    cr_assert_eq(cs->members[1].model_version, 9, "the latest version");
    broker_status_free(s);

    cr_assert_eq(broker_status(fixture_sm, "job-10", &s), 0);
    cr_assert_eq(s->n_cohorts, 1);
    cr_assert_str_eq(s->cohorts[0].name, "job-10");
    broker_status_free(s);
    cr_assert_eq(broker_status(fixture_sm, "job-3", &s), -ENOENT);
}

Test(broker, status_of_empty_broker)
{
    struct broker_config cfg;
    struct broker_status *s;

    broker_config_default(&cfg);
    cr_assert_eq(broker_create(&cfg, &fixture_host_ops, FIXTURE_T0, &fixture_sm), 0);
    cr_assert_eq(broker_status(fixture_sm, NULL, &s), 0);
    cr_assert_eq(s->n_cohorts, 0);
    broker_status_free(s);
}

/* ---- isolation and load ---- */

Test(broker, churn_in_one_cohort_leaves_other_alone)
{
    fixture_sm_start(NULL);
    cr_assert_eq(broker_cohort_declare(fixture_sm, "quiet", 0, 0), 0);
    cr_assert_eq(fixture_sm_join("a", 0, 1, FIXTURE_T0), 0);
    cr_assert_eq(fixture_sm_join_full("quiet", "q-0", FIXTURE_ADDR, 0, 100, 0, FIXTURE_T0), 0);
    cr_assert_eq(fixture_sm_join_full("quiet", "q-1", FIXTURE_ADDR, 0, 101, 0, FIXTURE_T0), 0);
    broker_tick(fixture_sm, FIXTURE_HOLD);
    cr_assert_eq(fixture_host.n_pubs, 2);

    for (uint64_t t = FIXTURE_HOLD + 100; t < FIXTURE_HOLD + 3000; t += 100) {
        char id[16];

        snprintf(id, sizeof id, "x-%llu", (unsigned long long)t);
        cr_assert_eq(fixture_sm_join(id, t, t, t), 0);
        cr_assert_eq(fixture_sm_beat(t, "quiet", "q-0", 100, t, true, NULL), 0);
        cr_assert_eq(fixture_sm_beat(t, "quiet", "q-1", 101, t, true, NULL), 0);
        broker_tick(fixture_sm, t + 60);
    }
    for (size_t i = 2; i < fixture_host.n_pubs; i++)
        cr_assert_str_eq(fixture_host.pubs[i].e->cohort, "demo");
    cr_assert_gt(fixture_sm_epoch("demo"), 10);
    cr_assert_eq(fixture_sm_epoch("quiet"), 1);
}

/* The scale test's members: cohorts job-0 .. job-99 of 100 members and
 * job-100 of 1000, ids w-* in a scrambled order, member m with session
 * m + 1. Joins every one at FIXTURE_T0 (join) or heartbeats every one at
 * `now`. */
static void scale_every_member(bool join, uint64_t now)
{
    for (int c = 0; c < 101; c++) {
        char cohort[16], id[16];
        int n = c == 100 ? 1000 : 100;

        snprintf(cohort, sizeof cohort, "job-%d", c);
        for (int m = 0; m < n; m++) {
            uint64_t session = (uint64_t)m + 1;

            snprintf(id, sizeof id, "w-%d", (m * 7919) % n);
            if (join)
                cr_assert_eq(fixture_sm_join_full(cohort, id, FIXTURE_ADDR, 0, session, 0,
                                                  FIXTURE_T0), 0);
            else
                cr_assert_eq(fixture_sm_beat(now, cohort, id, session, 0, false, NULL), 0);
        }
    }
}

/* The loads the broker is sized for: 100 cohorts of 100 members plus one
 * of 1000, every member heartbeating at 1 Hz and the host ticking at
 * 20 Hz, for 20 simulated seconds. Nothing changes, so no epoch forms. */
Test(broker, scale_heartbeats_stay_quiet, .timeout = 60)
{
    struct broker_config cfg;

    broker_config_default(&cfg);
    cfg.startup_hold_ms = FIXTURE_HOLD - FIXTURE_T0;
    cfg.allow_any_cohort = true;
    cr_assert_eq(broker_create(&cfg, &fixture_host_ops, FIXTURE_T0, &fixture_sm), 0);
    scale_every_member(true, FIXTURE_T0);
    broker_tick(fixture_sm, FIXTURE_HOLD);
    cr_assert_eq(fixture_host.n_pubs, 101);
    for (uint64_t t = FIXTURE_T0 + 1000; t <= FIXTURE_T0 + 20000; t += 50) {
        if (t % 1000 == 0)
            scale_every_member(false, t);
        broker_tick(fixture_sm, t);
    }
    cr_assert_eq(fixture_host.n_pubs, 101);
    cr_assert_eq(fixture_sm_members("job-100"), 1000);
}

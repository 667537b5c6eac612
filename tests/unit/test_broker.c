/* tests/unit/test_broker.c: the broker state machine, driven by an injected
 * clock (every call takes `now`) and a fake host that records what the
 * broker publishes and detaches. The recorder holds a reference on every
 * epoch it saw and drops them after the broker is gone, so ASan/LSan check
 * the reference counting as well. */
#include <criterion/criterion.h>

#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "membership/broker.h"

#define T0 100000u                  /* the broker's start */
#define HOLD (T0 + 2000u)           /* end of the default startup hold */
#define ADDR "10.0.0.1:7000"
#define ADDR2 "10.0.0.2:7000"
#define MAX_REC 256
#define MAX_W 16

struct pub_rec {
    struct epoch *e;         /* one reference, dropped in teardown */
    size_t n;
    void *w[MAX_W];
};

struct det_rec {
    void *w;
    int err;
};

static struct {
    struct pub_rec pubs[MAX_REC];
    size_t n_pubs;
    struct det_rec dets[MAX_REC];
    size_t n_dets;
} rec;

static struct broker *B;

/* Distinct addresses that stand in for the host's watcher handles. */
static int wa, wb, wc;

static void fake_publish(void *arg, struct epoch *e, void *const *w, size_t n)
{
    struct pub_rec *p;

    cr_assert_eq(arg, &rec);
    cr_assert_lt(rec.n_pubs, MAX_REC);
    p = &rec.pubs[rec.n_pubs++];
    p->e = epoch_ref(e);
    p->n = n;
    for (size_t i = 0; i < n && i < MAX_W; i++)
        p->w[i] = w[i];
}

static void fake_detach(void *arg, void *watcher, int err)
{
    cr_assert_eq(arg, &rec);
    cr_assert_lt(rec.n_dets, MAX_REC);
    rec.dets[rec.n_dets++] = (struct det_rec){ .w = watcher, .err = err };
}

static const struct broker_watch_ops fake_ops = {
    .publish = fake_publish,
    .detach = fake_detach,
    .arg = &rec,
};

static void teardown(void)
{
    broker_destroy(B);
    B = NULL;
    for (size_t i = 0; i < rec.n_pubs; i++)
        epoch_unref(rec.pubs[i].e);
    rec.n_pubs = 0;
}

TestSuite(broker, .fini = teardown);

static struct broker_config config(void)
{
    struct broker_config cfg;

    broker_config_default(&cfg);
    return cfg;
}

/* A broker started at T0 with `cfg` (defaults when NULL) and cohort "demo". */
static void start(const struct broker_config *cfg)
{
    struct broker_config def = config();

    cr_assert_eq(broker_create(cfg ? cfg : &def, &fake_ops, T0, &B), 0);
    cr_assert_eq(broker_cohort_declare(B, "demo", 0, 0), 0);
}

static int join_full(const char *cohort, const char *id, const char *address, uint64_t version,
                     uint64_t session, uint64_t last_epoch, uint64_t now)
{
    struct broker_join j = {
        .cohort = cohort,
        .id = id,
        .address = address,
        .model_version = version,
        .session = session,
        .last_epoch = last_epoch,
    };
    struct broker_join_result res;

    return broker_join(B, now, &j, &res);
}

static int join(const char *id, uint64_t version, uint64_t session, uint64_t now)
{
    return join_full("demo", id, ADDR, version, session, 0, now);
}

/* A heartbeat with no adopted epoch; *epoch gets the latest published. */
static int beat(struct broker *b, uint64_t now, const char *cohort, const char *id,
                uint64_t session, uint64_t version, bool declare, uint64_t *epoch)
{
    struct broker_beat hb = { .model_version = version, .declare = declare };
    struct broker_beat_result res;
    int rc = broker_heartbeat(b, now, cohort, id, session, &hb, &res);

    if (rc == 0 && epoch)
        *epoch = res.epoch;
    return rc;
}

/* A heartbeat that reports `adopted`; returns the drained flag. */
static bool beat_adopted(const char *id, uint64_t session, uint64_t now, uint64_t adopted)
{
    struct broker_beat hb = { .model_version = 1, .adopted = adopted };
    struct broker_beat_result res;

    cr_assert_eq(broker_heartbeat(B, now, "demo", id, session, &hb, &res), 0);
    return res.drained;
}

/* The latest epoch published by a tick or a watch. */
static struct epoch *last_pub(void)
{
    cr_assert_gt(rec.n_pubs, 0);
    return rec.pubs[rec.n_pubs - 1].e;
}

static void assert_members(const struct epoch *e, size_t n, const char *const *ids)
{
    cr_assert_eq(e->n_members, n, "epoch %llu has %zu members, want %zu",
                 (unsigned long long)e->number, e->n_members, n);
    for (size_t i = 0; i < n; i++)
        cr_assert_str_eq(e->members[i].id, ids[i]);
}

static const char *leader_of(const struct epoch *e)
{
    cr_assert_gt(e->n_members, 0);
    return e->members[e->leader].id;
}

static uint64_t status_epoch(const char *cohort)
{
    struct broker_status *s;
    uint64_t epoch;

    cr_assert_eq(broker_status(B, cohort, &s), 0);
    cr_assert_eq(s->n_cohorts, 1);
    epoch = s->cohorts[0].epoch;
    broker_status_free(s);
    return epoch;
}

static size_t status_members(const char *cohort)
{
    struct broker_status *s;
    size_t n;

    cr_assert_eq(broker_status(B, cohort, &s), 0);
    n = s->cohorts[0].n_members;
    broker_status_free(s);
    return n;
}

/* Members a and b in epoch 1, formed at the end of the hold. */
static void start_with_ab(void)
{
    start(NULL);
    cr_assert_eq(join("a", 1, 11, T0), 0);
    cr_assert_eq(join("b", 1, 12, T0), 0);
    broker_tick(B, HOLD);
    cr_assert_eq(rec.n_pubs, 1);
    cr_assert_eq(last_pub()->number, 1);
}

/* ---- configuration and cohorts ---- */

Test(broker, config_default_values)
{
    struct broker_config cfg = config();

    cr_assert_eq(cfg.heartbeat_ms, 1000);
    cr_assert_eq(cfg.timeout_ms, 5000);
    cr_assert_eq(cfg.coalesce_ms, 50);
    cr_assert_eq(cfg.startup_hold_ms, 2 * cfg.heartbeat_ms);
    cr_assert_eq(cfg.max_members, 4096);
    cr_assert_eq(cfg.max_cohorts, 1024);
    cr_assert_not(cfg.allow_any_cohort);
}

Test(broker, create_rejects_config_that_cannot_work)
{
    struct broker_config cfg;

    cfg = config();
    cfg.heartbeat_ms = 0;
    cr_assert_eq(broker_create(&cfg, &fake_ops, T0, &B), -EINVAL);
    cfg = config();
    cfg.timeout_ms = cfg.heartbeat_ms;
    cr_assert_eq(broker_create(&cfg, &fake_ops, T0, &B), -EINVAL);
    cfg = config();
    cfg.timeout_ms = cfg.heartbeat_ms - 1;
    cr_assert_eq(broker_create(&cfg, &fake_ops, T0, &B), -EINVAL);
    cfg = config();
    cfg.max_members = 0;
    cr_assert_eq(broker_create(&cfg, &fake_ops, T0, &B), -EINVAL);
    cfg = config();
    cfg.max_cohorts = 0;
    cr_assert_eq(broker_create(&cfg, &fake_ops, T0, &B), -EINVAL);
    cr_assert_null(B);

    /* No coalescing and no hold are unusual but work. */
    cfg = config();
    cfg.coalesce_ms = 0;
    cfg.startup_hold_ms = 0;
    cr_assert_eq(broker_create(&cfg, &fake_ops, T0, &B), 0);
}

Test(broker, destroy_accepts_null)
{
    broker_destroy(NULL);
    broker_status_free(NULL);
}

Test(broker, cohort_declare_and_remove)
{
    struct broker_status *s;

    start(NULL);
    cr_assert_eq(broker_cohort_declare(B, "ns/train", 500, 3000), 0);
    cr_assert_eq(broker_status(B, "ns/train", &s), 0);
    cr_assert_str_eq(s->cohorts[0].name, "ns/train");
    cr_assert_eq(s->cohorts[0].heartbeat_ms, 500);
    cr_assert_eq(s->cohorts[0].timeout_ms, 3000);
    cr_assert_eq(s->cohorts[0].epoch, 0);
    cr_assert_null(s->cohorts[0].leader);
    broker_status_free(s);

    /* Declaring again updates the settings. */
    cr_assert_eq(broker_cohort_declare(B, "ns/train", 0, 0), 0);
    cr_assert_eq(broker_status(B, "ns/train", &s), 0);
    cr_assert_eq(s->cohorts[0].heartbeat_ms, 1000);
    cr_assert_eq(s->cohorts[0].timeout_ms, 5000);
    broker_status_free(s);

    cr_assert_eq(broker_cohort_remove(B, "ns/train"), 0);
    cr_assert_eq(broker_status(B, "ns/train", &s), -ENOENT);
    cr_assert_eq(broker_cohort_remove(B, "ns/train"), -ENOENT);
    cr_assert_eq(broker_cohort_remove(B, "never"), -ENOENT);
}

Test(broker, cohort_declare_rejects_bad_input)
{
    start(NULL);
    cr_assert_eq(broker_cohort_declare(B, "", 0, 0), -EINVAL);
    cr_assert_eq(broker_cohort_declare(B, NULL, 0, 0), -EINVAL);
    cr_assert_eq(broker_cohort_declare(B, "a/b/c", 0, 0), -EINVAL);
    cr_assert_eq(broker_cohort_declare(B, "-x", 0, 0), -EINVAL);
    cr_assert_eq(broker_cohort_declare(B, "x", 1000, 1000), -EINVAL);
    cr_assert_eq(broker_cohort_declare(B, "x", 6000, 0), -EINVAL);
    cr_assert_eq(broker_status(B, "x", &(struct broker_status *){ NULL }), -ENOENT);
}

Test(broker, cohort_settings_apply_to_later_joins_only)
{
    struct broker_join j = { .cohort = "demo", .id = "a", .address = ADDR, .session = 1 };
    struct broker_join_result res;

    start(NULL);
    cr_assert_eq(broker_join(B, T0, &j, &res), 0);
    cr_assert_eq(res.heartbeat_ms, 1000);
    cr_assert_eq(res.timeout_ms, 5000);
    cr_assert_eq(broker_cohort_declare(B, "demo", 200, 1000), 0);
    j.id = "b";
    j.session = 2;
    cr_assert_eq(broker_join(B, T0, &j, &res), 0);
    cr_assert_eq(res.heartbeat_ms, 200);
    cr_assert_eq(res.timeout_ms, 1000);

    /* b goes with its 1 s timeout, a keeps the 5 s it joined with. */
    broker_tick(B, T0 + 1001);
    cr_assert_eq(status_members("demo"), 1);
    broker_tick(B, T0 + 5001);
    cr_assert_eq(status_members("demo"), 0);
}

Test(broker, cohort_remove_detaches_watchers_with_eshutdown)
{
    start_with_ab();
    cr_assert_eq(broker_cohort_declare(B, "other", 0, 0), 0);
    cr_assert_eq(join_full("other", "c", ADDR, 0, 13, 0, T0), 0);
    cr_assert_eq(broker_watch(B, "demo", "a", 11, &wa), 0);
    cr_assert_eq(broker_watch(B, "demo", "b", 12, &wb), 0);
    cr_assert_eq(broker_watch(B, "other", "c", 13, &wc), 0);
    cr_assert_eq(broker_cohort_remove(B, "demo"), 0);
    cr_assert_eq(rec.n_dets, 2);
    cr_assert_eq(rec.dets[0].w, &wa);
    cr_assert_eq(rec.dets[0].err, -ESHUTDOWN);
    cr_assert_eq(rec.dets[1].w, &wb);
    cr_assert_eq(rec.dets[1].err, -ESHUTDOWN);
    cr_assert_eq(beat(B, HOLD, "demo", "a", 11, 1, false, NULL), -ENOENT);
    cr_assert_eq(beat(B, HOLD, "other", "c", 13, 0, false, NULL), 0);
}

/* ---- joining and epochs ---- */

Test(broker, join_happy_path_first_epoch_after_startup_hold)
{
    struct broker_join j = { .cohort = "demo", .id = "a", .address = ADDR, .session = 11 };
    struct broker_join_result res;
    struct epoch *e;

    start(NULL);
    cr_assert_eq(broker_join(B, T0, &j, &res), 0);
    cr_assert_eq(res.heartbeat_ms, 1000);
    cr_assert_eq(res.timeout_ms, 5000);
    cr_assert_eq(res.epoch, 0);
    cr_assert_eq(join_full("demo", "b", ADDR2, 3, 12, 0, T0 + 10), 0);

    broker_tick(B, T0 + 100);
    broker_tick(B, HOLD - 1);
    cr_assert_eq(rec.n_pubs, 0, "an epoch formed during the startup hold");
    broker_tick(B, HOLD);
    cr_assert_eq(rec.n_pubs, 1);
    e = last_pub();
    cr_assert_str_eq(e->cohort, "demo");
    cr_assert_eq(e->number, 1);
    assert_members(e, 2, (const char *[]){ "a", "b" });
    cr_assert_str_eq(e->members[0].address, ADDR);
    cr_assert_str_eq(e->members[1].address, ADDR2);
    cr_assert_eq(e->members[1].model_version, 3);
    cr_assert_str_eq(leader_of(e), "b");
    cr_assert_eq(rec.pubs[0].n, 0, "nobody watches yet");

    cr_assert_eq(broker_join(B, HOLD, &j, &res), 0);
    cr_assert_eq(res.epoch, 1);
}

Test(broker, join_coalesces_changes_within_window)
{
    start(NULL);
    broker_tick(B, HOLD);
    cr_assert_eq(join("a", 0, 1, HOLD + 100), 0);
    cr_assert_eq(join("b", 0, 2, HOLD + 120), 0);
    broker_tick(B, HOLD + 130);
    cr_assert_eq(join("c", 0, 3, HOLD + 140), 0);
    broker_tick(B, HOLD + 149);
    cr_assert_eq(rec.n_pubs, 0);
    broker_tick(B, HOLD + 150);
    cr_assert_eq(rec.n_pubs, 1);
    cr_assert_eq(last_pub()->number, 1);
    assert_members(last_pub(), 3, (const char *[]){ "a", "b", "c" });

    /* After the window: a second epoch. */
    cr_assert_eq(join("d", 0, 4, HOLD + 200), 0);
    broker_tick(B, HOLD + 249);
    cr_assert_eq(rec.n_pubs, 1);
    broker_tick(B, HOLD + 250);
    cr_assert_eq(rec.n_pubs, 2);
    cr_assert_eq(last_pub()->number, 2);
    assert_members(last_pub(), 4, (const char *[]){ "a", "b", "c", "d" });
    broker_tick(B, HOLD + 1000);
    cr_assert_eq(rec.n_pubs, 2);
}

Test(broker, members_are_in_natural_order)
{
    start(NULL);
    cr_assert_eq(join("c-10", 0, 1, T0), 0);
    cr_assert_eq(join("c-2", 0, 2, T0), 0);
    cr_assert_eq(join("c-1", 0, 3, T0), 0);
    cr_assert_eq(join("b-100", 0, 4, T0), 0);
    broker_tick(B, HOLD);
    assert_members(last_pub(), 4, (const char *[]){ "b-100", "c-1", "c-2", "c-10" });
}

Test(broker, tick_evicts_after_timeout_not_before)
{
    start_with_ab();
    cr_assert_eq(broker_watch(B, "demo", "b", 12, &wb), 0);
    cr_assert_eq(beat(B, T0 + 4000, "demo", "a", 11, 1, false, NULL), 0);

    broker_tick(B, T0 + 5000);
    cr_assert_eq(rec.n_dets, 0, "evicted before its timeout");
    cr_assert_eq(status_members("demo"), 2);
    broker_tick(B, T0 + 5001);
    cr_assert_eq(rec.n_dets, 1);
    cr_assert_eq(rec.dets[0].w, &wb);
    cr_assert_eq(rec.dets[0].err, -ETIMEDOUT);
    cr_assert_eq(status_members("demo"), 1);

    broker_tick(B, T0 + 5051);
    cr_assert_eq(last_pub()->number, 2);
    assert_members(last_pub(), 1, (const char *[]){ "a" });
    cr_assert_eq(beat(B, T0 + 5051, "demo", "b", 12, 1, false, NULL), -ENOENT);
}

Test(broker, heartbeat_keeps_member_alive)
{
    start_with_ab();
    for (uint64_t t = T0 + 1000; t <= T0 + 20000; t += 1000) {
        cr_assert_eq(beat(B, t, "demo", "a", 11, 1, false, NULL), 0);
        cr_assert_eq(beat(B, t, "demo", "b", 12, 1, false, NULL), 0);
        broker_tick(B, t + 500);
    }
    cr_assert_eq(rec.n_pubs, 1);
    cr_assert_eq(status_members("demo"), 2);
}

Test(broker, join_timeout_override_applies_to_member)
{
    struct broker_join j = {
        .cohort = "demo", .id = "a", .address = ADDR, .session = 1,
        .heartbeat_ms = 100, .timeout_ms = 300,
    };
    struct broker_join_result res;

    start(NULL);
    cr_assert_eq(broker_join(B, T0, &j, &res), 0);
    cr_assert_eq(res.heartbeat_ms, 100);
    cr_assert_eq(res.timeout_ms, 300);
    broker_tick(B, T0 + 300);
    cr_assert_eq(status_members("demo"), 1);
    broker_tick(B, T0 + 301);
    cr_assert_eq(status_members("demo"), 0);
}

Test(broker, rejoin_with_shorter_timeout_is_evicted_on_time)
{
    struct broker_join j = {
        .cohort = "demo", .id = "a", .address = ADDR, .session = 1,
        .heartbeat_ms = 100, .timeout_ms = 300,
    };
    struct broker_join_result res;

    start(NULL);
    cr_assert_eq(join("a", 0, 1, T0), 0);
    broker_tick(B, T0 + 10);
    cr_assert_eq(broker_join(B, T0 + 100, &j, &res), 0);
    cr_assert_eq(res.timeout_ms, 300);
    cr_assert_eq(broker_tick(B, T0 + 110), 291);
    broker_tick(B, T0 + 401);
    cr_assert_eq(status_members("demo"), 0);
}

Test(broker, join_rejects_timeout_not_above_heartbeat)
{
    struct broker_join j = { .cohort = "demo", .id = "a", .address = ADDR, .session = 1 };
    struct broker_join_result res;

    start(NULL);
    j.heartbeat_ms = 500;
    j.timeout_ms = 500;
    cr_assert_eq(broker_join(B, T0, &j, &res), -EINVAL);
    j.heartbeat_ms = 6000;      /* above the cohort's 5000 ms timeout */
    j.timeout_ms = 0;
    cr_assert_eq(broker_join(B, T0, &j, &res), -EINVAL);
    j.heartbeat_ms = 0;
    j.timeout_ms = 1000;        /* not above the cohort's 1000 ms heartbeat */
    cr_assert_eq(broker_join(B, T0, &j, &res), -EINVAL);
    cr_assert_eq(status_members("demo"), 0);
}

Test(broker, leave_takes_effect_at_next_tick)
{
    start_with_ab();
    cr_assert_eq(broker_watch(B, "demo", "b", 12, &wb), 0);
    cr_assert_eq(broker_leave(B, HOLD + 100, "demo", "b", 12), 0);
    cr_assert_eq(rec.n_dets, 1);
    cr_assert_eq(rec.dets[0].w, &wb);
    cr_assert_eq(rec.dets[0].err, -ENOENT);
    cr_assert_eq(status_members("demo"), 1);

    broker_tick(B, HOLD + 150);
    cr_assert_eq(last_pub()->number, 2);
    assert_members(last_pub(), 1, (const char *[]){ "a" });
}

Test(broker, leave_rejects_unknown_member_or_session)
{
    start_with_ab();
    cr_assert_eq(broker_leave(B, HOLD, "demo", "b", 99), -ENOENT);
    cr_assert_eq(broker_leave(B, HOLD, "demo", "zz", 12), -ENOENT);
    cr_assert_eq(broker_leave(B, HOLD, "nope", "b", 12), -ENOENT);
    cr_assert_eq(broker_leave(B, HOLD, "demo", "b", 0), -ENOENT);
    cr_assert_eq(status_members("demo"), 2);
    cr_assert_eq(broker_leave(B, HOLD, "demo", "b", 12), 0);
    cr_assert_eq(broker_leave(B, HOLD, "demo", "b", 12), -ENOENT);
}

Test(broker, last_member_leaving_forms_empty_epoch)
{
    start_with_ab();
    cr_assert_eq(broker_leave(B, HOLD + 10, "demo", "a", 11), 0);
    cr_assert_eq(broker_leave(B, HOLD + 10, "demo", "b", 12), 0);
    cr_assert_eq(broker_tick(B, HOLD + 10), 50);
    broker_tick(B, HOLD + 60);
    cr_assert_eq(last_pub()->number, 2);
    cr_assert_eq(last_pub()->n_members, 0);
    cr_assert_eq(last_pub()->leader, 0);
    cr_assert_eq(broker_tick(B, HOLD + 60), 1000);
}

/* ---- leader ---- */

Test(broker, leader_is_highest_version)
{
    start(NULL);
    cr_assert_eq(join("a-0", 5, 1, T0), 0);
    cr_assert_eq(join("a-1", 9, 2, T0), 0);
    cr_assert_eq(join("a-2", 9, 3, T0), 0);
    cr_assert_eq(join("a-3", 2, 4, T0), 0);
    broker_tick(B, HOLD);
    cr_assert_eq(last_pub()->leader, 1);
    cr_assert_str_eq(leader_of(last_pub()), "a-1");
}

Test(broker, leader_tie_goes_to_first_in_natural_order)
{
    start(NULL);
    cr_assert_eq(join("c-10", 7, 1, T0), 0);
    cr_assert_eq(join("c-2", 7, 2, T0), 0);
    broker_tick(B, HOLD);
    assert_members(last_pub(), 2, (const char *[]){ "c-2", "c-10" });
    cr_assert_eq(last_pub()->leader, 0);
    cr_assert_str_eq(leader_of(last_pub()), "c-2");
}

Test(broker, undeclared_version_forms_no_epoch_but_counts_at_next_election)
{
    struct broker_status *s;

    start_with_ab();
    cr_assert_str_eq(leader_of(last_pub()), "a");
    cr_assert_eq(beat(B, HOLD + 10, "demo", "b", 12, 5, false, NULL), 0);
    broker_tick(B, HOLD + 1000);
    cr_assert_eq(rec.n_pubs, 1, "an undeclared version forced an epoch");

    cr_assert_eq(broker_status(B, "demo", &s), 0);
    cr_assert_eq(s->cohorts[0].members[1].model_version, 5);
    cr_assert_str_eq(s->cohorts[0].leader, "a");
    broker_status_free(s);

    cr_assert_eq(join("c", 0, 13, HOLD + 1000), 0);
    broker_tick(B, HOLD + 1050);
    cr_assert_eq(last_pub()->number, 2);
    cr_assert_str_eq(leader_of(last_pub()), "b");
    cr_assert_eq(last_pub()->members[1].model_version, 5);
}

Test(broker, undeclared_version_does_not_break_cancel_out)
{
    start_with_ab();
    cr_assert_eq(beat(B, HOLD + 10, "demo", "b", 12, 5, false, NULL), 0);
    cr_assert_eq(join("c", 0, 13, HOLD + 20), 0);
    cr_assert_eq(broker_leave(B, HOLD + 30, "demo", "c", 13), 0);
    broker_tick(B, HOLD + 100);
    cr_assert_eq(rec.n_pubs, 1);
}

Test(broker, declared_version_changing_leader_forms_epoch)
{
    uint64_t epoch = 0;

    start_with_ab();
    cr_assert_eq(beat(B, HOLD + 10, "demo", "b", 12, 5, true, &epoch), 0);
    cr_assert_eq(epoch, 1);
    broker_tick(B, HOLD + 59);
    cr_assert_eq(rec.n_pubs, 1);
    broker_tick(B, HOLD + 60);
    cr_assert_eq(rec.n_pubs, 2);
    cr_assert_eq(last_pub()->number, 2);
    assert_members(last_pub(), 2, (const char *[]){ "a", "b" });
    cr_assert_str_eq(leader_of(last_pub()), "b");
    cr_assert_eq(beat(B, HOLD + 60, "demo", "a", 11, 1, false, &epoch), 0);
    cr_assert_eq(epoch, 2);
}

Test(broker, declared_version_keeping_leader_forms_no_epoch)
{
    start_with_ab();
    /* A tie keeps a, the first in member order. */
    cr_assert_eq(beat(B, HOLD + 10, "demo", "b", 12, 1, true, NULL), 0);
    /* The leader itself moving ahead keeps it leader. */
    cr_assert_eq(beat(B, HOLD + 20, "demo", "a", 11, 3, true, NULL), 0);
    broker_tick(B, HOLD + 1000);
    cr_assert_eq(rec.n_pubs, 1);
}

Test(broker, declared_version_reverted_in_window_forms_no_epoch)
{
    start_with_ab();
    cr_assert_eq(beat(B, HOLD + 10, "demo", "b", 12, 5, true, NULL), 0);
    cr_assert_eq(beat(B, HOLD + 20, "demo", "b", 12, 1, true, NULL), 0);
    broker_tick(B, HOLD + 1000);
    cr_assert_eq(rec.n_pubs, 1);
}

/* ---- rejoins and duplicates ---- */

Test(broker, rejoin_same_session_is_idempotent)
{
    struct broker_join j = { .cohort = "demo", .id = "a", .address = ADDR, .session = 11 };
    struct broker_join_result res;

    start_with_ab();
    cr_assert_eq(broker_join(B, HOLD + 10, &j, &res), 0);
    cr_assert_eq(res.epoch, 1);
    broker_tick(B, HOLD + 1000);
    cr_assert_eq(rec.n_pubs, 1);
    cr_assert_eq(status_members("demo"), 2);

    /* The rejoin counts as a heartbeat. */
    broker_tick(B, T0 + 5001);
    cr_assert_eq(status_members("demo"), 1);
}

Test(broker, rejoin_with_new_address_forms_epoch)
{
    start_with_ab();
    cr_assert_eq(join_full("demo", "a", ADDR2, 1, 11, 0, HOLD + 10), 0);
    broker_tick(B, HOLD + 60);
    cr_assert_eq(rec.n_pubs, 2);
    cr_assert_eq(last_pub()->number, 2);
    cr_assert_str_eq(last_pub()->members[0].address, ADDR2);
    cr_assert_str_eq(last_pub()->members[1].address, ADDR);
}

Test(broker, join_rejects_duplicate_id)
{
    start(NULL);
    cr_assert_eq(join("a", 0, 1, T0), 0);
    cr_assert_eq(join("a", 0, 2, T0 + 100), -EEXIST);
    cr_assert_eq(join("a", 0, 2, T0 + 5000), -EEXIST);
    broker_tick(B, T0 + 5001);
    cr_assert_eq(status_members("demo"), 0);
    cr_assert_eq(join("a", 0, 2, T0 + 5001), 0);
    cr_assert_eq(beat(B, T0 + 5002, "demo", "a", 2, 0, false, NULL), 0);
    cr_assert_eq(beat(B, T0 + 5002, "demo", "a", 1, 0, false, NULL), -ENOENT);
}

Test(broker, join_takes_over_silent_member_before_tick)
{
    start(NULL);
    cr_assert_eq(join("a", 0, 1, T0), 0);
    broker_tick(B, HOLD);
    cr_assert_eq(broker_watch(B, "demo", "a", 1, &wa), 0);
    /* Silent past its timeout, but no tick has evicted it yet. */
    cr_assert_eq(join("a", 0, 2, T0 + 5001), 0);
    cr_assert_eq(rec.n_dets, 1);
    cr_assert_eq(rec.dets[0].w, &wa);
    cr_assert_eq(rec.dets[0].err, -ETIMEDOUT);
    cr_assert_eq(broker_watch(B, "demo", "a", 1, &wb), -ENOENT);

    /* Same id and address, new session: a membership change. */
    broker_tick(B, T0 + 5051);
    cr_assert_eq(last_pub()->number, 2);
    assert_members(last_pub(), 1, (const char *[]){ "a" });
}

Test(broker, rejoin_after_eviction_forms_epoch_with_member)
{
    start_with_ab();
    cr_assert_eq(beat(B, T0 + 4000, "demo", "a", 11, 1, false, NULL), 0);
    broker_tick(B, T0 + 5001);
    broker_tick(B, T0 + 5051);
    assert_members(last_pub(), 1, (const char *[]){ "a" });
    cr_assert_eq(join("b", 1, 22, T0 + 6000), 0);
    broker_tick(B, T0 + 6050);
    cr_assert_eq(last_pub()->number, 3);
    assert_members(last_pub(), 2, (const char *[]){ "a", "b" });
}

/* ---- epoch numbers ---- */

Test(broker, epochs_continue_from_reported_last_epoch)
{
    struct broker_join j = {
        .cohort = "demo", .id = "a", .address = ADDR, .session = 1, .last_epoch = 41,
    };
    struct broker_join_result res;

    start(NULL);
    cr_assert_eq(broker_join(B, T0, &j, &res), 0);
    cr_assert_eq(res.epoch, 0);
    cr_assert_eq(join_full("demo", "b", ADDR, 0, 2, 17, T0), 0);
    broker_tick(B, HOLD);
    cr_assert_eq(last_pub()->number, 42);

    /* A lower report never lowers the count. */
    cr_assert_eq(join_full("demo", "c", ADDR, 0, 3, 5, HOLD + 10), 0);
    broker_tick(B, HOLD + 60);
    cr_assert_eq(last_pub()->number, 43);
    /* A higher one, from a member that saw more, lifts it. */
    cr_assert_eq(join_full("demo", "d", ADDR, 0, 4, 99, HOLD + 100), 0);
    broker_tick(B, HOLD + 150);
    cr_assert_eq(last_pub()->number, 100);
}

Test(broker, epochs_only_grow)
{
    uint64_t prev = 0;

    start(NULL);
    broker_tick(B, HOLD);
    for (int i = 0; i < 20; i++) {
        char id[16];
        uint64_t t = HOLD + 1000 * (uint64_t)(i + 1);

        snprintf(id, sizeof id, "m-%d", i);
        cr_assert_eq(join(id, (uint64_t)i, (uint64_t)i + 1, t), 0);
        if (i % 3 == 2)
            cr_assert_eq(broker_leave(B, t, "demo", id, (uint64_t)i + 1), 0);
        broker_tick(B, t + 50);
    }
    cr_assert_gt(rec.n_pubs, 0);
    for (size_t i = 0; i < rec.n_pubs; i++) {
        cr_assert_gt(rec.pubs[i].e->number, prev);
        prev = rec.pubs[i].e->number;
    }
}

Test(broker, join_rejects_last_epoch_that_would_wrap)
{
    start(NULL);
    cr_assert_eq(join_full("demo", "a", ADDR, 0, 1, UINT64_MAX, T0), -EINVAL);
    cr_assert_eq(status_members("demo"), 0);
}

/* ---- unknown cohorts, caps, bad input ---- */

Test(broker, join_unknown_cohort_is_enoent)
{
    struct broker_status *s;

    start(NULL);
    cr_assert_eq(join_full("nope", "a", ADDR, 0, 1, 0, T0), -ENOENT);
    cr_assert_eq(broker_status(B, "nope", &s), -ENOENT);
    cr_assert_eq(beat(B, T0, "nope", "a", 1, 0, false, NULL), -ENOENT);
    cr_assert_eq(broker_watch(B, "nope", "a", 1, &wa), -ENOENT);
}

Test(broker, allow_any_cohort_creates_cohort)
{
    struct broker_config cfg = config();
    struct broker_status *s;

    cfg.allow_any_cohort = true;
    start(&cfg);
    cr_assert_eq(join_full("ns/fresh", "a", ADDR, 0, 1, 0, T0), 0);
    cr_assert_eq(broker_status(B, "ns/fresh", &s), 0);
    cr_assert_eq(s->cohorts[0].n_members, 1);
    cr_assert_eq(s->cohorts[0].heartbeat_ms, 1000);
    cr_assert_eq(s->cohorts[0].timeout_ms, 5000);
    broker_status_free(s);
    broker_tick(B, HOLD);
    cr_assert_str_eq(last_pub()->cohort, "ns/fresh");
}

Test(broker, allow_any_cohort_creates_nothing_on_failure)
{
    struct broker_config cfg = config();
    struct broker_status *s;

    cfg.allow_any_cohort = true;
    start(&cfg);
    cr_assert_eq(join_full("fresh", "a", "bad", 0, 1, 0, T0), -EINVAL);
    cr_assert_eq(join_full("fresh", "a", ADDR, 0, 0, 0, T0), -EINVAL);
    cr_assert_eq(broker_status(B, "fresh", &s), -ENOENT);
}

Test(broker, join_rejects_past_max_members)
{
    struct broker_config cfg = config();

    cfg.max_members = 2;
    start(&cfg);
    cr_assert_eq(join("a", 0, 1, T0), 0);
    cr_assert_eq(join("b", 0, 2, T0), 0);
    cr_assert_eq(join("c", 0, 3, T0), -ENOSPC);
    cr_assert_eq(status_members("demo"), 2);
    /* A rejoin at the cap is not a new member. */
    cr_assert_eq(join("a", 0, 1, T0 + 10), 0);
    cr_assert_eq(broker_leave(B, T0 + 10, "demo", "b", 2), 0);
    cr_assert_eq(join("c", 0, 3, T0 + 10), 0);
}

Test(broker, cohorts_past_max_cohorts_are_enospc)
{
    struct broker_config cfg = config();
    struct broker_status *s;

    cfg.max_cohorts = 2;
    cfg.allow_any_cohort = true;
    start(&cfg);
    cr_assert_eq(broker_cohort_declare(B, "two", 0, 0), 0);
    cr_assert_eq(broker_cohort_declare(B, "three", 0, 0), -ENOSPC);
    cr_assert_eq(join_full("three", "a", ADDR, 0, 1, 0, T0), -ENOSPC);
    cr_assert_eq(broker_cohort_declare(B, "two", 500, 0), 0);
    cr_assert_eq(broker_status(B, NULL, &s), 0);
    cr_assert_eq(s->n_cohorts, 2);
    broker_status_free(s);
    cr_assert_eq(broker_cohort_remove(B, "two"), 0);
    cr_assert_eq(join_full("three", "a", ADDR, 0, 1, 0, T0), 0);
}

Test(broker, join_rejects_invalid_input_and_changes_nothing)
{
    static const char *const bad_ids[] = { "", "-a", ".a", "a b", "a/b", "a:b", "é" };
    static const char *const bad_addrs[] = {
        "", "host", "host:", ":80", "host:0", "host:65536", "host:80x", "ho st:80",
        "[::1]", "[]:80", "[::g]:80",
    };
    struct broker_join j = { .cohort = "demo", .id = "a", .address = ADDR, .session = 1 };
    struct broker_join_result res;
    char long_id[300];

    start_with_ab();
    for (size_t i = 0; i < sizeof bad_ids / sizeof bad_ids[0]; i++)
        cr_assert_eq(join_full("demo", bad_ids[i], ADDR, 0, 5, 0, HOLD), -EINVAL, "id %s",
                     bad_ids[i]);
    for (size_t i = 0; i < sizeof bad_addrs / sizeof bad_addrs[0]; i++)
        cr_assert_eq(join_full("demo", "c", bad_addrs[i], 0, 5, 0, HOLD), -EINVAL, "addr %s",
                     bad_addrs[i]);
    memset(long_id, 'x', sizeof long_id - 1);
    long_id[sizeof long_id - 1] = '\0';
    cr_assert_eq(join_full("demo", long_id, ADDR, 0, 5, 0, HOLD), -EINVAL);
    cr_assert_eq(join_full("demo", "c", ADDR, 0, 0, 0, HOLD), -EINVAL);
    cr_assert_eq(join_full("de mo", "c", ADDR, 0, 5, 0, HOLD), -EINVAL);
    cr_assert_eq(join_full("a/b/c", "c", ADDR, 0, 5, 0, HOLD), -EINVAL);
    cr_assert_eq(join_full("demo", NULL, ADDR, 0, 5, 0, HOLD), -EINVAL);
    cr_assert_eq(join_full("demo", "c", NULL, 0, 5, 0, HOLD), -EINVAL);
    cr_assert_eq(join_full(NULL, "c", ADDR, 0, 5, 0, HOLD), -EINVAL);
    cr_assert_eq(broker_join(B, HOLD, NULL, &res), -EINVAL);
    /* A bad address on a rejoin leaves the member as it was. */
    j.session = 11;
    j.address = "bad";
    cr_assert_eq(broker_join(B, HOLD, &j, &res), -EINVAL);

    broker_tick(B, HOLD + 1000);
    cr_assert_eq(rec.n_pubs, 1);
    cr_assert_eq(status_members("demo"), 2);
    cr_assert_str_eq(last_pub()->members[0].address, ADDR);
}

/* ---- heartbeats ---- */

Test(broker, heartbeat_rejects_wrong_session)
{
    start_with_ab();
    cr_assert_eq(beat(B, HOLD, "demo", "a", 12, 1, false, NULL), -ENOENT);
    cr_assert_eq(beat(B, HOLD, "demo", "a", 0, 1, false, NULL), -ENOENT);
    cr_assert_eq(beat(B, HOLD, "demo", "zz", 11, 1, false, NULL), -ENOENT);
    cr_assert_eq(beat(B, HOLD, "demo", NULL, 11, 1, false, NULL), -ENOENT);
    cr_assert_eq(beat(B, HOLD, NULL, "a", 11, 1, false, NULL), -ENOENT);

    /* A wrong session is not a heartbeat: a is still evicted on time. */
    cr_assert_eq(beat(B, T0 + 4000, "demo", "a", 99, 1, false, NULL), -ENOENT);
    broker_tick(B, T0 + 5001);
    cr_assert_eq(status_members("demo"), 0);
}

Test(broker, heartbeat_reports_latest_epoch)
{
    uint64_t epoch = 99;

    start(NULL);
    cr_assert_eq(join("a", 0, 1, T0), 0);
    cr_assert_eq(beat(B, T0 + 1000, "demo", "a", 1, 0, false, &epoch), 0);
    cr_assert_eq(epoch, 0);
    broker_tick(B, HOLD);
    cr_assert_eq(beat(B, HOLD + 1, "demo", "a", 1, 0, false, &epoch), 0);
    cr_assert_eq(epoch, 1);
}

/* ---- watchers ---- */

Test(broker, watch_delivers_current_epoch_at_once)
{
    start_with_ab();
    cr_assert_eq(broker_watch(B, "demo", "a", 11, &wa), 0);
    cr_assert_eq(rec.n_pubs, 2);
    cr_assert_eq(last_pub(), rec.pubs[0].e, "the published epoch itself");
    cr_assert_eq(rec.pubs[1].n, 1);
    cr_assert_eq(rec.pubs[1].w[0], &wa);
}

Test(broker, watch_before_first_epoch_waits_for_it)
{
    start(NULL);
    cr_assert_eq(join("a", 0, 1, T0), 0);
    cr_assert_eq(join("b", 0, 2, T0), 0);
    cr_assert_eq(broker_watch(B, "demo", "a", 1, &wa), 0);
    cr_assert_eq(broker_watch(B, "demo", "b", 2, &wb), 0);
    cr_assert_eq(rec.n_pubs, 0);
    broker_tick(B, HOLD);
    cr_assert_eq(rec.n_pubs, 1);
    cr_assert_eq(rec.pubs[0].n, 2);
    cr_assert_eq(rec.pubs[0].w[0], &wa);
    cr_assert_eq(rec.pubs[0].w[1], &wb);
}

Test(broker, watch_replacing_detaches_old_with_eexist)
{
    start_with_ab();
    cr_assert_eq(broker_watch(B, "demo", "a", 11, &wa), 0);
    cr_assert_eq(broker_watch(B, "demo", "a", 11, &wb), 0);
    cr_assert_eq(rec.n_dets, 1);
    cr_assert_eq(rec.dets[0].w, &wa);
    cr_assert_eq(rec.dets[0].err, -EEXIST);

    cr_assert_eq(join("c", 0, 13, HOLD + 10), 0);
    broker_tick(B, HOLD + 60);
    cr_assert_eq(last_pub()->number, 2);
    cr_assert_eq(rec.pubs[rec.n_pubs - 1].n, 1);
    cr_assert_eq(rec.pubs[rec.n_pubs - 1].w[0], &wb);
}

Test(broker, watch_again_with_same_watcher_detaches_nothing)
{
    start_with_ab();
    cr_assert_eq(broker_watch(B, "demo", "a", 11, &wa), 0);
    cr_assert_eq(broker_watch(B, "demo", "a", 11, &wa), 0);
    cr_assert_eq(rec.n_dets, 0);
}

Test(broker, unwatch_forgets_silently)
{
    start_with_ab();
    cr_assert_eq(broker_watch(B, "demo", "a", 11, &wa), 0);
    broker_unwatch(B, "demo", "a", &wb);        /* not a's watcher: ignored */
    broker_unwatch(B, "demo", "zz", &wa);
    broker_unwatch(B, "nope", "a", &wa);
    broker_unwatch(B, "demo", "a", &wa);
    cr_assert_eq(rec.n_dets, 0);

    cr_assert_eq(join("c", 0, 13, HOLD + 10), 0);
    broker_tick(B, HOLD + 60);
    cr_assert_eq(last_pub()->number, 2);
    cr_assert_eq(rec.pubs[rec.n_pubs - 1].n, 0);
    /* Nor is it detached when a leaves. */
    cr_assert_eq(broker_leave(B, HOLD + 100, "demo", "a", 11), 0);
    cr_assert_eq(rec.n_dets, 0);
}

Test(broker, watch_unknown_member_is_enoent)
{
    start_with_ab();
    cr_assert_eq(broker_watch(B, "demo", "a", 12, &wa), -ENOENT);
    cr_assert_eq(broker_watch(B, "demo", "zz", 11, &wa), -ENOENT);
    cr_assert_eq(broker_watch(B, "demo", "a", 0, &wa), -ENOENT);
    cr_assert_eq(rec.n_pubs, 1);
}

Test(broker, destroy_detaches_all_watchers_with_eshutdown)
{
    start_with_ab();
    cr_assert_eq(broker_cohort_declare(B, "other", 0, 0), 0);
    cr_assert_eq(join_full("other", "c", ADDR, 0, 13, 0, T0), 0);
    cr_assert_eq(broker_watch(B, "demo", "a", 11, &wa), 0);
    cr_assert_eq(broker_watch(B, "demo", "b", 12, &wb), 0);
    cr_assert_eq(broker_watch(B, "other", "c", 13, &wc), 0);
    broker_destroy(B);
    B = NULL;
    cr_assert_eq(rec.n_dets, 3);
    for (size_t i = 0; i < 3; i++)
        cr_assert_eq(rec.dets[i].err, -ESHUTDOWN);
    cr_assert_eq(rec.dets[0].w, &wa);
    cr_assert_eq(rec.dets[1].w, &wb);
    cr_assert_eq(rec.dets[2].w, &wc);
    /* Published epochs outlive the broker while someone holds them. */
    cr_assert_str_eq(rec.pubs[0].e->cohort, "demo");
}

/* ---- cancelling changes ---- */

Test(broker, join_then_leave_within_window_publishes_nothing)
{
    start_with_ab();
    cr_assert_eq(join("c", 0, 13, HOLD + 10), 0);
    cr_assert_eq(broker_leave(B, HOLD + 20, "demo", "c", 13), 0);
    broker_tick(B, HOLD + 60);
    broker_tick(B, HOLD + 1000);
    cr_assert_eq(rec.n_pubs, 1);
    cr_assert_eq(status_epoch("demo"), 1);
}

Test(broker, leave_then_rejoin_same_session_publishes_nothing)
{
    start_with_ab();
    cr_assert_eq(broker_leave(B, HOLD + 10, "demo", "b", 12), 0);
    cr_assert_eq(join("b", 1, 12, HOLD + 20), 0);
    broker_tick(B, HOLD + 60);
    cr_assert_eq(rec.n_pubs, 1);
}

Test(broker, leave_then_rejoin_new_session_forms_epoch)
{
    start_with_ab();
    cr_assert_eq(broker_leave(B, HOLD + 10, "demo", "b", 12), 0);
    cr_assert_eq(join("b", 1, 22, HOLD + 20), 0);
    broker_tick(B, HOLD + 60);
    cr_assert_eq(rec.n_pubs, 2);
    assert_members(last_pub(), 2, (const char *[]){ "a", "b" });
}

Test(broker, join_and_leave_during_hold_publishes_nothing)
{
    start(NULL);
    cr_assert_eq(join("a", 0, 1, T0), 0);
    cr_assert_eq(broker_leave(B, T0 + 10, "demo", "a", 1), 0);
    broker_tick(B, HOLD);
    cr_assert_eq(rec.n_pubs, 0);
    cr_assert_eq(status_epoch("demo"), 0);
}

/* ---- status ---- */

Test(broker, status_snapshot_contents)
{
    struct broker_status *s;
    struct broker_cohort_status *cs;

    start(NULL);
    cr_assert_eq(broker_cohort_declare(B, "job-10", 0, 0), 0);
    cr_assert_eq(broker_cohort_declare(B, "job-2", 250, 1000), 0);
    cr_assert_eq(join_full("job-10", "m-10", ADDR, 3, 1, 0, T0), 0);
    cr_assert_eq(join_full("job-10", "m-2", ADDR2, 8, 2, 0, T0), 0);
    broker_tick(B, HOLD);
    cr_assert_eq(beat(B, HOLD + 1, "job-10", "m-10", 1, 9, false, NULL), 0);

    cr_assert_eq(broker_status(B, NULL, &s), 0);
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
    cr_assert_str_eq(cs->members[0].address, ADDR2);
    cr_assert_eq(cs->members[0].model_version, 8);
    cr_assert_str_eq(cs->members[1].id, "m-10");
    cr_assert_eq(cs->members[1].model_version, 9, "the latest version");
    broker_status_free(s);

    cr_assert_eq(broker_status(B, "job-10", &s), 0);
    cr_assert_eq(s->n_cohorts, 1);
    cr_assert_str_eq(s->cohorts[0].name, "job-10");
    broker_status_free(s);
    cr_assert_eq(broker_status(B, "job-3", &s), -ENOENT);
}

Test(broker, status_of_empty_broker)
{
    struct broker_config cfg = config();
    struct broker_status *s;

    cr_assert_eq(broker_create(&cfg, &fake_ops, T0, &B), 0);
    cr_assert_eq(broker_status(B, NULL, &s), 0);
    cr_assert_eq(s->n_cohorts, 0);
    broker_status_free(s);
}

/* ---- isolation, ticks, references ---- */

Test(broker, churn_in_one_cohort_leaves_other_alone)
{
    start(NULL);
    cr_assert_eq(broker_cohort_declare(B, "quiet", 0, 0), 0);
    cr_assert_eq(join("a", 0, 1, T0), 0);
    cr_assert_eq(join_full("quiet", "q-0", ADDR, 0, 100, 0, T0), 0);
    cr_assert_eq(join_full("quiet", "q-1", ADDR, 0, 101, 0, T0), 0);
    broker_tick(B, HOLD);
    cr_assert_eq(rec.n_pubs, 2);

    for (uint64_t t = HOLD + 100; t < HOLD + 3000; t += 100) {
        char id[16];

        snprintf(id, sizeof id, "x-%llu", (unsigned long long)t);
        cr_assert_eq(join(id, t, t, t), 0);
        cr_assert_eq(beat(B, t, "quiet", "q-0", 100, t, true, NULL), 0);
        cr_assert_eq(beat(B, t, "quiet", "q-1", 101, t, true, NULL), 0);
        broker_tick(B, t + 60);
    }
    for (size_t i = 2; i < rec.n_pubs; i++)
        cr_assert_str_eq(rec.pubs[i].e->cohort, "demo");
    cr_assert_gt(status_epoch("demo"), 10);
    cr_assert_eq(status_epoch("quiet"), 1);
}

Test(broker, tick_reports_time_until_next_deadline)
{
    cr_assert_eq(broker_create(&(struct broker_config){ 0 }, &fake_ops, T0, &B), -EINVAL);
    start(NULL);
    cr_assert_eq(broker_tick(B, T0), 1000, "nothing to do");
    cr_assert_eq(join("a", 0, 1, T0), 0);
    cr_assert_eq(broker_tick(B, T0 + 1500), 500, "the end of the hold");
    cr_assert_eq(broker_tick(B, HOLD), 1000, "capped");
    cr_assert_eq(broker_tick(B, T0 + 4500), 501, "a's eviction");
    cr_assert_eq(beat(B, T0 + 4600, "demo", "a", 1, 0, false, NULL), 0);
    cr_assert_eq(join("b", 0, 2, T0 + 4700), 0);
    cr_assert_eq(broker_tick(B, T0 + 4710), 40, "the coalescing window");
    cr_assert_eq(broker_tick(B, T0 + 4750), 251, "a stale bound wakes the host early");
    cr_assert_eq(broker_tick(B, T0 + 5001), 1000);
    cr_assert_eq(rec.n_pubs, 2);
    cr_assert_eq(status_members("demo"), 2);
}

Test(broker, tick_never_returns_zero)
{
    struct broker_config cfg = config();

    cfg.coalesce_ms = 0;
    cfg.startup_hold_ms = 0;
    cr_assert_eq(broker_create(&cfg, &fake_ops, T0, &B), 0);
    cr_assert_eq(broker_cohort_declare(B, "demo", 0, 0), 0);
    cr_assert_eq(join("a", 0, 1, T0), 0);
    cr_assert_geq(broker_tick(B, T0), 1);
    cr_assert_eq(rec.n_pubs, 1, "no coalescing, no hold: formed at once");
}

/* The broker holds its own reference on the epoch it published: the host
 * dropping every one of its references must not free it, and a newer epoch
 * must not free the older one under a holder. ASan checks both. */
Test(broker, published_epoch_is_held_by_broker_and_holders)
{
    struct epoch *first;

    start_with_ab();
    epoch_unref(rec.pubs[0].e);
    rec.n_pubs = 0;
    cr_assert_eq(broker_watch(B, "demo", "a", 11, &wa), 0);
    first = last_pub();
    cr_assert_eq(first->number, 1);
    assert_members(first, 2, (const char *[]){ "a", "b" });

    cr_assert_eq(join("c", 0, 13, HOLD + 10), 0);
    broker_tick(B, HOLD + 60);
    cr_assert_eq(last_pub()->number, 2);
    cr_assert_str_eq(first->cohort, "demo");
    assert_members(first, 2, (const char *[]){ "a", "b" });
}

/* The loads the broker is sized for: 100 cohorts of 100 members plus one
 * of 1000, every member heartbeating at 1 Hz and the host ticking at
 * 20 Hz, for 20 simulated seconds. Nothing changes, so no epoch forms. */
Test(broker, scale_heartbeats_stay_quiet, .timeout = 60)
{
    struct broker_config cfg = config();

    cfg.allow_any_cohort = true;
    cr_assert_eq(broker_create(&cfg, &fake_ops, T0, &B), 0);
    for (int c = 0; c < 101; c++) {
        char cohort[16], id[16];
        int n = c == 100 ? 1000 : 100;

        snprintf(cohort, sizeof cohort, "job-%d", c);
        for (int m = 0; m < n; m++) {
            snprintf(id, sizeof id, "w-%d", (m * 7919) % n);
            cr_assert_eq(join_full(cohort, id, ADDR, 0, (uint64_t)m + 1, 0, T0), 0);
        }
    }
    broker_tick(B, HOLD);
    cr_assert_eq(rec.n_pubs, 101);
    for (uint64_t t = T0 + 1000; t <= T0 + 20000; t += 50) {
        if (t % 1000 == 0) {
            for (int c = 0; c < 101; c++) {
                char cohort[16], id[16];
                int n = c == 100 ? 1000 : 100;

                snprintf(cohort, sizeof cohort, "job-%d", c);
                for (int m = 0; m < n; m++) {
                    snprintf(id, sizeof id, "w-%d", (m * 7919) % n);
                    cr_assert_eq(beat(B, t, cohort, id, (uint64_t)m + 1, 0, false,
                                                  NULL), 0);
                }
            }
        }
        broker_tick(B, t);
    }
    cr_assert_eq(rec.n_pubs, 101);
    cr_assert_eq(status_members("job-100"), 1000);
}

/* ---- draining ---- */

Test(broker, drain_leaves_member_out_of_next_epoch)
{
    static const char *const ab[] = { "a", "b" };
    static const char *const b_only[] = { "b" };

    start_with_ab();
    cr_assert_eq(broker_watch(B, "demo", "a", 11, &wa), 0);
    cr_assert_eq(broker_drain(B, HOLD + 10, "demo", "a", true), 0);
    cr_assert_eq(broker_drained(B, "demo", "a"), 0, "no epoch without it yet");
    broker_tick(B, HOLD + 10 + 50);
    cr_assert_eq(last_pub()->number, 2);
    assert_members(last_pub(), 1, b_only);
    /* The drained member still hears the epoch: that is how it stops. */
    cr_assert_eq(rec.pubs[rec.n_pubs - 1].n, 1);
    cr_assert_eq(rec.pubs[rec.n_pubs - 1].w[0], &wa);
    /* It stays a member (heartbeats work) and is told it is drained. */
    cr_assert(beat_adopted("a", 11, HOLD + 100, 2));
    cr_assert_eq(status_members("demo"), 2);
    /* Drained only once b runs in epoch 2. */
    cr_assert_eq(broker_drained(B, "demo", "a"), 0);
    cr_assert_not(beat_adopted("b", 12, HOLD + 100, 1));
    cr_assert_eq(broker_drained(B, "demo", "a"), 0);
    cr_assert_not(beat_adopted("b", 12, HOLD + 200, 2));
    cr_assert_eq(broker_drained(B, "demo", "a"), 1);
    /* Taking it back in forms an epoch with both. */
    cr_assert_eq(broker_drain(B, HOLD + 300, "demo", "a", false), 0);
    cr_assert_eq(broker_drained(B, "demo", "a"), 0);
    broker_tick(B, HOLD + 400);
    cr_assert_eq(last_pub()->number, 3);
    assert_members(last_pub(), 2, ab);
    cr_assert_not(beat_adopted("a", 11, HOLD + 400, 3));
}

Test(broker, drain_moves_leadership_and_leave_is_quiet)
{
    static const char *const b_only[] = { "b" };

    start(NULL);
    cr_assert_eq(join("a", 9, 11, T0), 0);
    cr_assert_eq(join("b", 1, 12, T0), 0);
    broker_tick(B, HOLD);
    cr_assert_str_eq(leader_of(last_pub()), "a");
    cr_assert_eq(broker_drain(B, HOLD, "demo", "a", true), 0);
    broker_tick(B, HOLD + 50);
    assert_members(last_pub(), 1, b_only);
    cr_assert_str_eq(leader_of(last_pub()), "b");
    /* A declared higher version of a draining member moves nothing. */
    cr_assert_eq(beat(B, HOLD + 60, "demo", "a", 11, 50, true, NULL), 0);
    cr_assert_eq(broker_tick(B, HOLD + 200) > 0, true);
    cr_assert_eq(last_pub()->number, 2);
    /* Its pod goes: the leave forms no epoch, since it was not in one. */
    cr_assert_eq(broker_leave(B, HOLD + 300, "demo", "a", 11), 0);
    broker_tick(B, HOLD + 400);
    cr_assert_eq(last_pub()->number, 2);
    cr_assert_eq(broker_drained(B, "demo", "a"), 1, "gone counts as drained");
}

Test(broker, drain_every_member_and_bad_names)
{
    start_with_ab();
    cr_assert_eq(broker_drain(B, HOLD, "demo", "a", true), 0);
    cr_assert_eq(broker_drain(B, HOLD, "demo", "b", true), 0);
    broker_tick(B, HOLD + 50);
    cr_assert_eq(last_pub()->n_members, 0);
    cr_assert_eq(broker_drained(B, "demo", "a"), 1, "no one left to wait for");
    cr_assert_eq(broker_drain(B, HOLD, "demo", "zz", true), -ENOENT);
    cr_assert_eq(broker_drain(B, HOLD, "nope", "a", true), -ENOENT);
    cr_assert_eq(broker_drain(B, HOLD, NULL, "a", true), -ENOENT);
    cr_assert_eq(broker_drained(B, "nope", "a"), -ENOENT);
    cr_assert_eq(broker_drained(B, "demo", "zz"), 1);
}

Test(broker, drain_mark_survives_nothing_after_eviction)
{
    static const char *const ab[] = { "a", "b" };

    start_with_ab();
    cr_assert_eq(broker_drain(B, HOLD, "demo", "a", true), 0);
    broker_tick(B, HOLD + 50);
    /* a goes silent and is evicted; it comes back as a new member. */
    for (uint64_t t = HOLD + 1000; t < T0 + 12000; t += 1000)
        cr_assert_eq(beat(B, t, "demo", "b", 12, 1, false, NULL), 0);
    broker_tick(B, T0 + 12000);
    cr_assert_eq(status_members("demo"), 1);
    cr_assert_eq(join("a", 1, 21, T0 + 12000), 0);
    broker_tick(B, T0 + 12100);
    assert_members(last_pub(), 2, ab);
}

/* tests/unit/test_member.c: the member's side of unreachability reports
 * (member_report_unreachable) over real gRPC on loopback. Against the
 * broker service: a side of a partition is reported in full, at a pace
 * the broker's stream allows, and the broker counts every one; reports
 * the member cannot make are refused and queue nothing. Against a
 * stand-in for the broker's wire side with an epoch of 2,001: a member
 * that finds more peers unreachable at once than one heartbeat carries
 * (the JoinReply's unreachable_max, 16 from a broker that names none)
 * queues the rest and sends them in the following heartbeats. */
#include <criterion/criterion.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/clock.h"
#include "base/limits.h"
#include "cohort.pb-c.h"
#include "fixture.h"
#include "membership/brokerd.h"
#include "membership/epoch.h"
#include "membership/member.h"
#include "membership/wire.h"
#include "rpc/rpc.h"

/* A partition of an epoch of SIDE_A + SIDE_B: each member of side A finds
 * all of side B unreachable at once, more than two heartbeats carry. A
 * member of side B is evicted only with every report of side A: more
 * than half of the epoch is all of side A. */
#define SIDE_A 41u
#define SIDE_B 40u
#define ALL (SIDE_A + SIDE_B)
#define TIMEOUT_MS 1500u        /* the fixture broker's member timeout */

static struct brokerd *d;
static char addr[64];
static struct member *ms[ALL];
static char ids[ALL][16];
static atomic_bool stop_polling;
static pthread_t poller;

static void *poll_all(void *arg)
{
    (void)arg;
    while (!atomic_load(&stop_polling)) {
        for (size_t i = 0; i < ALL; i++)
            member_poll(ms[i], clock_now_ms());
        clock_sleep_ms(5);
    }
    return NULL;
}

/* The fixture's broker (200 ms heartbeats, a 1.5 s member timeout) with
 * room for the whole epoch, and ALL members of "demo" polled by a thread
 * of their own, as a node polls its member. */
static void start(void)
{
    struct brokerd_config cfg;

    fixture_broker_config(&cfg);
    cfg.broker.max_members = ALL;
    d = fixture_broker_start_with(&cfg, "demo", addr, sizeof(addr));
    for (size_t i = 0; i < ALL; i++) {
        struct member_config mc = { .broker = addr, .cohort = "demo", .id = ids[i],
                                    .address = "127.0.0.1:4000", .quiet = true };

        snprintf(ids[i], sizeof(ids[i]), "m-%zu", i);
        cr_assert_eq(member_create(&mc, &ms[i]), 0);
    }
    atomic_store(&stop_polling, false);
    cr_assert_eq(pthread_create(&poller, NULL, poll_all, NULL), 0);
}

static void stop(void)
{
    atomic_store(&stop_polling, true);
    pthread_join(poller, NULL);
    for (size_t i = 0; i < ALL; i++)
        member_destroy(ms[i]);
    fixture_broker_stop(d);
}

TestSuite(member, .init = start, .fini = stop, .timeout = 120);

/* The number of member i's latest epoch when it holds exactly members
 * [0, n), else 0. */
static uint64_t epoch_of_first(size_t i, size_t n)
{
    struct epoch *e = member_epoch(ms[i]);
    uint64_t number = 0;

    if (e && e->n_members == n) {
        number = e->number;
        for (size_t k = 0; k < n; k++)
            if (epoch_find(e, ids[k]) < 0)
                number = 0;
    }
    epoch_unref(e);
    return number;
}

/* Whether members [0, upto) all hold the same epoch of members [0, n). */
static bool agree_on_first(size_t upto, size_t n)
{
    uint64_t number = epoch_of_first(0, n);

    for (size_t i = 1; number && i < upto; i++)
        if (epoch_of_first(i, n) != number)
            return false;
    return number != 0;
}

/* Whether members [from, to) have each joined more than once. */
static bool all_rejoined(size_t from, size_t to)
{
    for (size_t i = from; i < to; i++)
        if (member_joins(ms[i]) < 2)
            return false;
    return true;
}

/* What an engine of side A does every member timeout while the cut
 * lasts: reports each member of side B in its latest epoch again. */
static void report_side_b_again(void)
{
    for (size_t i = 0; i < SIDE_A; i++) {
        struct epoch *e = member_epoch(ms[i]);

        for (size_t k = SIDE_A; e && k < ALL; k++) {
            int rc;

            if (epoch_find(e, ids[k]) < 0)
                continue;
            rc = member_report_unreachable(ms[i], ids[k], e->number);
            /* -ESTALE: a newer epoch arrived meanwhile. */
            cr_assert(rc == 0 || rc == -ESTALE, "m-%zu about %s: %d", i, ids[k], rc);
        }
        epoch_unref(e);
    }
}

Test(member, a_side_of_a_partition_is_reported_in_full_over_the_following_heartbeats)
{
    uint64_t e;

    FIXTURE_WAIT_FOR(agree_on_first(ALL, ALL), "the %u members never agreed on one epoch", ALL);
    e = epoch_of_first(0, ALL);

    /* Reports the member cannot make queue nothing. */
    cr_assert_eq(member_report_unreachable(ms[0], ids[0], e), -EINVAL, "itself");
    cr_assert_eq(member_report_unreachable(ms[0], "m-9999", e), -ENOENT, "not in the epoch");
    cr_assert_eq(member_report_unreachable(ms[0], ids[SIDE_A], e - 1), -ESTALE);
    cr_assert_eq(member_report_unreachable(ms[0], ids[SIDE_A], e + 1), -ESTALE);

    /* Side A finds all of side B at once, as after a cut, each member
     * in its own order (an engine probes from where its last round
     * ended), and reports each one again (the engine repeats a report
     * every timeout): queued once. This broker takes them all in one
     * heartbeat (unreachable_max); an older one would take 16, and
     * member_reports below covers the queue over several heartbeats. No
     * member of side B is evicted before every report of side A arrives:
     * no epoch forms while they come. */
    cr_assert_gt(SIDE_B, 2 * WIRE_LOST_PEERS_MAX);
    for (size_t i = 0; i < SIDE_A; i++)
        for (size_t j = 0; j < SIDE_B; j++) {
            size_t k = SIDE_A + (i + j) % SIDE_B;

            cr_assert_eq(member_report_unreachable(ms[i], ids[k], e), 0, "m-%zu about %s", i,
                         ids[k]);
            cr_assert_eq(member_report_unreachable(ms[i], ids[k], e), 0);
        }

    /* Every member of side B needs every report of side A: each is
     * evicted (and, once its bench of a timeout is over, joins again)
     * only if each member of side A sent all 40 within the broker's
     * report window. Evictions form a new epoch, which drops what is
     * still queued; the engine reports again every member timeout while
     * the cut lasts, and so does side A here. */
    for (uint64_t end = fixture_deadline(FIXTURE_WAIT_MS), again = clock_now_ms() + TIMEOUT_MS;
         !all_rejoined(SIDE_A, ALL) && fixture_before(end); clock_sleep_ms(FIXTURE_POLL_MS)) {
        if (clock_now_ms() >= again) {
            report_side_b_again();
            again = clock_now_ms() + TIMEOUT_MS;
        }
    }
    cr_assert(all_rejoined(SIDE_A, ALL),
              "not every member of side B was evicted: some reports were never sent");
    /* The reports went out at a pace the broker took: no stream of side
     * A was ended for flooding, so none had to join again. */
    for (size_t i = 0; i < SIDE_A; i++)
        cr_assert_eq(member_joins(ms[i]), 1, "m-%zu joined %llu times", i,
                     (unsigned long long)member_joins(ms[i]));
}

/* Reports are made for the epoch the member runs in: once the next one
 * arrives, those of the older one are refused, and so are those about a
 * member that left with it. */
Test(member, reports_follow_the_latest_epoch)
{
    uint64_t e, e2;

    FIXTURE_WAIT_FOR(agree_on_first(ALL, ALL), "the %u members never agreed on one epoch", ALL);
    e = epoch_of_first(0, ALL);
    for (size_t k = SIDE_A; k < ALL; k++)
        cr_assert_eq(member_report_unreachable(ms[0], ids[k], e), 0);
    cr_assert_eq(member_leave(ms[ALL - 1], 2000), 0);
    FIXTURE_WAIT_FOR(agree_on_first(ALL - 1, ALL - 1), "the leave formed no epoch");
    e2 = epoch_of_first(0, ALL - 1);
    cr_assert_gt(e2, e);
    cr_assert_eq(member_report_unreachable(ms[0], ids[SIDE_A], e), -ESTALE);
    cr_assert_eq(member_report_unreachable(ms[0], ids[ALL - 1], e2), -ENOENT);
    cr_assert_eq(member_report_unreachable(ms[0], ids[SIDE_A], e2), 0);
}

/* ---- a side of a large epoch, against the broker's wire side ----
 *
 * A member of an epoch of BIG that finds the other BIG - 1 unreachable
 * at once, against a stand-in for the broker that speaks its wire
 * protocol (Join, then a Session stream down which it sends the epoch)
 * and records what each heartbeat reports: as a broker of this release
 * (unreachable_max 1,024), as one before the field (none: 16), and as
 * one that names more than a proof can cover. The broker's own checks of
 * such heartbeats are in test_brokerd.c; a real broker would need 2,000
 * real members in the epoch. Default timings: 1 s heartbeats, 5 s
 * timeout. */

#define BIG 2001u

struct fake {
    struct rpc_server *srv;
    uint32_t unreachable_max;   /* what its JoinReply names; 0: nothing */
    size_t id_pad;              /* the epoch's ids: "m-", this many 'x', then i */
    pthread_mutex_t lock;
    bool seen[BIG];             /* epoch positions reported */
    size_t distinct, beats, beats_with, most, fewest;
    size_t most_bytes;          /* the largest unreachable_peers, as encoded */
    uint64_t all_at;            /* when the last new one came */
};

static struct fake fk;

static void big_id(size_t i, char *out, size_t len)
{
    char pad[256];

    cr_assert_lt(fk.id_pad, sizeof(pad));
    memset(pad, 'x', fk.id_pad);
    pad[fk.id_pad] = '\0';
    snprintf(out, len, "m-%s%zu", pad, i);
}

/* The position of an id of the epoch, or -1. */
static long big_pos(const char *id)
{
    size_t pre = 2 + fk.id_pad;
    char *end;
    unsigned long v;

    if (strlen(id) <= pre || strncmp(id, "m-", 2) != 0)
        return -1;
    v = strtoul(id + pre, &end, 10);
    return *end == '\0' && v < BIG ? (long)v : -1;
}

static void fake_beat(const Cohort__V1__HeartbeatRequest *q)
{
    size_t bytes = 0;

    pthread_mutex_lock(&fk.lock);
    fk.beats++;
    if (q->n_unreachable_peers) {
        fk.beats_with++;
        if (q->n_unreachable_peers > fk.most)
            fk.most = q->n_unreachable_peers;
        if (!fk.fewest || q->n_unreachable_peers < fk.fewest)
            fk.fewest = q->n_unreachable_peers;
    }
    for (size_t i = 0; i < q->n_unreachable_peers; i++) {
        long p = big_pos(q->unreachable_peers[i]);
        size_t n = strlen(q->unreachable_peers[i]);

        bytes += 1 + (n < 128 ? 1 : 2) + n;
        if (p >= 0 && !fk.seen[p]) {
            fk.seen[p] = true;
            fk.distinct++;
            fk.all_at = clock_now_ms();
        }
    }
    if (bytes > fk.most_bytes)
        fk.most_bytes = bytes;
    pthread_mutex_unlock(&fk.lock);
}

static void fake_join(void *arg, const ProtobufCMessage *req, struct rpc_reply *r)
{
    Cohort__V1__JoinReply rep = COHORT__V1__JOIN_REPLY__INIT;

    (void)arg;
    (void)req;
    rep.heartbeat_ms = WIRE_DEFAULT_HEARTBEAT_MS;
    rep.timeout_ms = WIRE_DEFAULT_TIMEOUT_MS;
    rep.epoch = 1;
    rep.weighs_unreachable = true;
    rep.unreachable_max = fk.unreachable_max;
    rpc_reply_ok(r, &rep.base);
}

static void fake_msg(void *arg, struct rpc_stream *s, const ProtobufCMessage *msg)
{
    (void)arg;
    if (!msg) {
        rpc_stream_finish(s, RPC_OK, "closed");
        return;
    }
    fake_beat((const Cohort__V1__HeartbeatRequest *)msg);
}

static void fake_closed(void *arg, struct rpc_stream *s)
{
    (void)arg;
    rpc_stream_unref(s);
}

/* Opens the session: epoch 1 of BIG members m-0.., in member order. */
static void fake_session(void *arg, const ProtobufCMessage *req, struct rpc_stream *s)
{
    static char eids[BIG][300];
    static Cohort__V1__Member storage[BIG], *ptrs[BIG];
    Cohort__V1__SessionReply rep = COHORT__V1__SESSION_REPLY__INIT;
    Cohort__V1__Epoch e = COHORT__V1__EPOCH__INIT;
    struct rpc_buf *buf = NULL;

    (void)arg;
    fake_beat((const Cohort__V1__HeartbeatRequest *)req);
    for (size_t i = 0; i < BIG; i++) {
        big_id(i, eids[i], sizeof(eids[i]));
        cohort__v1__member__init(&storage[i]);
        storage[i].id = eids[i];
        storage[i].address = "127.0.0.1:4000";
        ptrs[i] = &storage[i];
    }
    e.cohort = "demo";
    e.epoch = 1;
    e.leader = eids[0];
    e.members = ptrs;
    e.n_members = BIG;
    rep.epoch = &e;
    cr_assert_eq(rpc_buf_pack(&rep.base, &buf), 0);
    cr_assert_eq(rpc_stream_send(s, buf), 0);
    rpc_buf_unref(buf);
    rpc_stream_on_message(s, fake_msg, NULL);
    rpc_stream_on_close(s, fake_closed, NULL);
}

static struct member *fake_start(uint32_t unreachable_max, size_t id_pad, char *at, size_t len)
{
    struct rpc_method methods[] = {
        { WIRE_BROKER_JOIN, &cohort__v1__join_request__descriptor, fake_join, NULL, NULL },
        { WIRE_BROKER_SESSION, &cohort__v1__heartbeat_request__descriptor, NULL, fake_session,
          NULL },
    };
    char me[300];
    struct member_config mc = { .cohort = "demo", .id = me, .address = "127.0.0.1:4000",
                                .quiet = true };
    struct member *m;

    memset(&fk, 0, sizeof(fk));
    pthread_mutex_init(&fk.lock, NULL);
    fk.unreachable_max = unreachable_max;
    fk.id_pad = id_pad;
    cr_assert_eq(rpc_init(), 0);
    cr_assert_eq(rpc_server_create("127.0.0.1:0", methods, 2, NULL, &fk.srv), 0);
    snprintf(at, len, "127.0.0.1:%d", rpc_server_port(fk.srv));
    big_id(0, me, sizeof(me));
    mc.broker = at;
    cr_assert_eq(member_create(&mc, &m), 0);
    return m;
}

static void fake_stop(struct member *m)
{
    member_destroy(m);
    rpc_server_destroy(fk.srv);
    rpc_shutdown();
    pthread_mutex_destroy(&fk.lock);
}

struct poll_one {
    struct member *m;
    atomic_bool stop;
    atomic_bool hold;           /* the test's: poll nothing meanwhile */
    atomic_bool held;           /* the poller's: it sees hold and polls nothing */
};

static void *poll_one_main(void *arg)
{
    struct poll_one *p = arg;

    while (!atomic_load(&p->stop)) {
        bool hold = atomic_load(&p->hold);

        atomic_store(&p->held, hold);
        if (hold)
            clock_sleep_ms(1);
        else
            clock_sleep_ms(member_poll(p->m, clock_now_ms()) < 5 ? 1 : 5);
    }
    return NULL;
}

static bool holds_big_epoch(struct member *m)
{
    struct epoch *e = member_epoch(m);
    bool ok = e && e->n_members == BIG;

    epoch_unref(e);
    return ok;
}

static size_t fake_distinct(void)
{
    size_t n;

    pthread_mutex_lock(&fk.lock);
    n = fk.distinct;
    pthread_mutex_unlock(&fk.lock);
    return n;
}

/* Joins a member m-0 to the stand-in, waits for the epoch, reports every
 * other member unreachable at once, and waits until `want` distinct
 * reports arrived (or FIXTURE_WAIT_MS). Returns ms from the reports to
 * the last new one. */
static uint64_t report_all(uint32_t unreachable_max, size_t id_pad, size_t want,
                           struct member **out, pthread_t *th, struct poll_one *p)
{
    static char fake_addr[64];
    struct epoch *e;
    uint64_t t0;

    p->m = fake_start(unreachable_max, id_pad, fake_addr, sizeof(fake_addr));
    atomic_store(&p->stop, false);
    atomic_store(&p->hold, false);
    atomic_store(&p->held, false);
    cr_assert_eq(pthread_create(th, NULL, poll_one_main, p), 0);
    FIXTURE_WAIT_FOR(holds_big_epoch(p->m), "the member never received the epoch of %u", BIG);
    e = member_epoch(p->m);
    /* Every report is queued before the next poll, as when a run finds
     * them all at once: on a loaded machine a heartbeat sent in the middle
     * of the loop would carry part of them and count one more. */
    atomic_store(&p->hold, true);
    FIXTURE_WAIT_FOR(atomic_load(&p->held), "the poller never paused");
    t0 = clock_now_ms();
    for (size_t i = 1; i < BIG; i++)
        cr_assert_eq(member_report_unreachable(p->m, e->members[i].id, e->number), 0);
    epoch_unref(e);
    atomic_store(&p->hold, false);
    FIXTURE_WAIT_FOR(fake_distinct() >= want, "%zu of %zu reports arrived", fake_distinct(), want);
    *out = p->m;
    return fk.all_at - t0;
}

static void report_all_stop(pthread_t th, struct poll_one *p)
{
    atomic_store(&p->stop, true);
    pthread_join(th, NULL);
    fake_stop(p->m);
}

TestSuite(member_reports, .timeout = 120);

/* A broker of this release takes 1,024 a heartbeat: 2,000 peers found at
 * once go out in two heartbeats, half an interval apart, far inside the
 * report window (limit_reach_rounds: 8 timeouts, 40 s) and the engine's
 * 60 s. At 16 a heartbeat they would take 125 heartbeats, 63 s. */
Test(member_reports, two_thousand_found_at_once_are_reported_in_two_heartbeats)
{
    struct poll_one p;
    struct member *m;
    pthread_t th;
    uint64_t took = report_all(WIRE_UNREACHABLE_MAX, 0, BIG - 1, &m, &th, &p);

    cr_assert_eq(fk.beats_with, 2, "%zu heartbeats carried reports", fk.beats_with);
    cr_assert_eq(fk.most, WIRE_UNREACHABLE_MAX);
    cr_assert_lt(took, (uint64_t)limit_reach_rounds(BIG) * WIRE_DEFAULT_TIMEOUT_MS,
                 "took %llu ms", (unsigned long long)took);
    report_all_stop(th, &p);
}

/* A broker before unreachable_max names none: 16 a heartbeat, which is
 * all it takes (it refuses more), two heartbeats an interval. */
Test(member_reports, an_older_broker_gets_sixteen_a_heartbeat)
{
    struct poll_one p;
    struct member *m;
    pthread_t th;

    report_all(0, 0, 4 * WIRE_LOST_PEERS_MAX, &m, &th, &p);
    pthread_mutex_lock(&fk.lock);
    cr_assert_eq(fk.most, WIRE_LOST_PEERS_MAX, "a heartbeat carried %zu", fk.most);
    cr_assert_eq(fk.fewest, WIRE_LOST_PEERS_MAX, "the queue is long: every one is full");
    cr_assert_geq(fk.beats_with, 4);
    pthread_mutex_unlock(&fk.lock);
    report_all_stop(th, &p);
}

/* A broker that names more than a proof covers gets WIRE_UNREACHABLE_MAX
 * a heartbeat; and ids of the longest kind go WIRE_UNREACHABLE_BYTES at
 * a time, so that a heartbeat stays under the broker's request cap. */
Test(member_reports, a_heartbeat_carries_no_more_than_a_proof_and_the_request_cap_allow)
{
    struct poll_one p;
    struct member *m;
    pthread_t th;

    report_all(10 * WIRE_UNREACHABLE_MAX, 0, BIG - 1, &m, &th, &p);
    cr_assert_eq(fk.most, WIRE_UNREACHABLE_MAX, "a heartbeat carried %zu", fk.most);
    report_all_stop(th, &p);

    /* "m-", 240 'x', up to 4 digits: up to 246 bytes, 249 encoded. */
    report_all(WIRE_UNREACHABLE_MAX, 240, BIG - 1, &m, &th, &p);
    cr_assert_leq(fk.most_bytes, WIRE_UNREACHABLE_BYTES);
    cr_assert_gt(fk.most_bytes, WIRE_UNREACHABLE_BYTES - 250, "heartbeats are filled");
    cr_assert_lt(fk.most, WIRE_UNREACHABLE_MAX);
    cr_assert_gt(fk.most, WIRE_LOST_PEERS_MAX);
    report_all_stop(th, &p);
}

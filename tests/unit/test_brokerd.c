/* tests/unit/test_brokerd.c: the broker service over real gRPC on
 * loopback, driven by raw requests (to reach every refusal) and by
 * libcohort members in this process: open (no keys), and with keys, where
 * every request must prove its cohort's key (membership/wire.h). */
#include <criterion/criterion.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "base/clock.h"
#include "cohort.pb-c.h"
#include "fixture.h"
#include "base/secret.h"
#include "membership/brokerd.h"
#include "membership/member.h"
#include "membership/proof.h"
#include "membership/wire.h"
#include "rpc/rpc.h"

static struct brokerd *d;
static struct rpc_channel *ch;
static char addr[64];

/* Every raw call waits for the channel's connection (RPC_WAIT_FOR_READY)
 * with the tests' generous deadline. The first call of each test is also
 * its channel's first: without waiting, a connect that a loaded machine
 * makes slow fails the call with UNAVAILABLE (or a 5 s deadline passes),
 * and a test that expects a refusal sees that code instead. */
#define CALL_MS FIXTURE_WAIT_MS

/* The fixture's broker with a 1 s member timeout and room for four
 * members per cohort, cohorts "demo" and "other", and a channel to it. */
static void start(void)
{
    struct brokerd_config cfg;

    fixture_broker_config(&cfg);
    cfg.broker.timeout_ms = 1000;
    cfg.broker.max_members = 4;
    d = fixture_broker_start_with(&cfg, "demo", addr, sizeof(addr));
    cr_assert_eq(brokerd_declare(d, "other", 0, 0), 0);
    cr_assert_eq(rpc_channel_create(addr, NULL, &ch), 0);
}

static void stop(void)
{
    rpc_channel_destroy(ch);
    fixture_broker_stop(d);
}

TestSuite(brokerd, .init = start, .fini = stop, .timeout = 120);

/* ---- heartbeats on Session streams (protocol 2) ---- */

/* One Session stream as a test sees it: its first message down (the
 * broker took the opening heartbeat) and how it ended. */
struct one_stream {
    pthread_mutex_t lock;
    Cohort__V1__SessionReply *first;
    unsigned msgs;
    bool ended;
    struct rpc_status st;
};

static void one_msg(void *arg, ProtobufCMessage *msg)
{
    struct one_stream *o = arg;

    pthread_mutex_lock(&o->lock);
    o->msgs++;
    if (!o->first)
        o->first = (Cohort__V1__SessionReply *)msg;
    else
        protobuf_c_message_free_unpacked(msg, NULL);
    pthread_mutex_unlock(&o->lock);
}

static void one_end(void *arg, const struct rpc_status *st)
{
    struct one_stream *o = arg;

    pthread_mutex_lock(&o->lock);
    o->ended = true;
    o->st = *st;
    pthread_mutex_unlock(&o->lock);
}

static bool one_has(struct one_stream *o, bool ended, unsigned msgs)
{
    bool ok;

    pthread_mutex_lock(&o->lock);
    ok = (ended ? o->ended : true) && o->msgs >= msgs;
    pthread_mutex_unlock(&o->lock);
    return ok;
}

static bool one_answered(struct one_stream *o)
{
    return one_has(o, true, 0) || one_has(o, false, 1);
}

/* Opens a Session stream with heartbeat `h` (borrowed). */
static struct rpc_watch *session_open(const ProtobufCMessage *h, struct one_stream *o)
{
    struct rpc_watch *w = NULL;

    cr_assert_eq(rpc_watch_open(ch, WIRE_BROKER_SESSION, h, &cohort__v1__session_reply__descriptor,
                                RPC_DUPLEX | RPC_WAIT_FOR_READY, one_msg, one_end, o, &w), 0);
    return w;
}

/* Sends `m` up the stream once the message before it is out. */
static void session_send(struct rpc_watch *w, const ProtobufCMessage *m)
{
    int rc = -EBUSY;

    FIXTURE_WAIT_FOR((rc = rc == -EBUSY ? rpc_watch_send(w, m) : rc) != -EBUSY,
                     "the previous message never went out");
    cr_assert_eq(rc, 0, "send: %d", rc);
}

/* Closes our side cleanly and waits for the broker to end the stream, so
 * that it does not take the close for a death; then frees it. */
static void session_close(struct rpc_watch *w, struct one_stream *o)
{
    int rc = -EBUSY;

    FIXTURE_WAIT_FOR(one_has(o, true, 0) ||
                         (rc = rc == -EBUSY ? rpc_watch_done_sending(w) : rc) != -EBUSY,
                     "the stream never finished sending");
    FIXTURE_WAIT_FOR(one_has(o, true, 0), "the broker never ended a stream closed cleanly");
    rpc_watch_close(w);
    if (o->first)
        protobuf_c_message_free_unpacked(&o->first->base, NULL);
}

/* A heartbeat as a call: a Session stream of its own that opens with `h`.
 * 0 when the broker answered it (anything down the stream), otherwise the
 * -errno of the code the stream ended with (*st says). */
static int beat_call(const ProtobufCMessage *h, struct rpc_status *st)
{
    struct one_stream o = { .lock = PTHREAD_MUTEX_INITIALIZER };
    struct rpc_watch *w = session_open(h, &o);
    int rc;

    FIXTURE_WAIT_FOR(one_answered(&o), "the broker never answered a session's heartbeat");
    session_close(w, &o);
    rc = o.first ? 0 : rpc_code_to_errno(o.st.code);
    *st = o.st;
    if (o.first)
        st->code = RPC_OK;
    return rc;
}

/* A raw Join asking for member timeout `timeout_ms` (0: the cohort's). */
static int join_to(const char *cohort, const char *id, uint64_t session, uint32_t version,
                   uint32_t timeout_ms, struct rpc_status *st)
{
    Cohort__V1__JoinRequest q = COHORT__V1__JOIN_REQUEST__INIT;
    ProtobufCMessage *out = NULL;
    int rc;

    q.timeout_ms = timeout_ms;
    q.protocol_version = version;
    q.cohort = (char *)cohort;
    q.id = (char *)id;
    q.address = "127.0.0.1:4000";
    q.session = session;
    rc = rpc_call(ch, WIRE_BROKER_JOIN, &q.base, &cohort__v1__join_reply__descriptor, CALL_MS,
                  RPC_WAIT_FOR_READY, &out, st);
    if (out)
        protobuf_c_message_free_unpacked(out, NULL);
    return rc;
}

static int join(const char *cohort, const char *id, uint64_t session, uint32_t version,
                struct rpc_status *st)
{
    return join_to(cohort, id, session, version, 0, st);
}

static size_t status_members(const char *cohort)
{
    Cohort__V1__StatusRequest q = COHORT__V1__STATUS_REQUEST__INIT;
    ProtobufCMessage *out = NULL;
    size_t n;

    q.protocol_version = WIRE_PROTOCOL_VERSION;
    q.cohort = (char *)cohort;
    cr_assert_eq(rpc_call(ch, WIRE_BROKER_STATUS, &q.base, &cohort__v1__status_reply__descriptor,
                          CALL_MS, RPC_WAIT_FOR_READY, &out, NULL), 0);
    n = ((Cohort__V1__StatusReply *)out)->cohorts[0]->n_members;
    protobuf_c_message_free_unpacked(out, NULL);
    return n;
}

Test(brokerd, wrong_protocol_version_is_failed_precondition_and_changes_nothing)
{
    struct rpc_status st;

    cr_assert_eq(join("demo", "a", 7, WIRE_PROTOCOL_VERSION + 1, &st), -EPROTO, "%s: %s",
                 rpc_code_name(st.code), st.message);
    cr_assert_eq(st.code, RPC_FAILED_PRECONDITION);
    cr_assert(strstr(st.message, "protocol version 3 is not supported; this broker speaks 2"), "%s",
              st.message);
    cr_assert_eq(status_members("demo"), 0);
}

/* A member of protocol 1 is refused at every call it makes, with a
 * message that says why, and nothing changes. */
Test(brokerd, protocol_1_members_are_refused_clearly)
{
    Cohort__V1__HeartbeatRequest h = COHORT__V1__HEARTBEAT_REQUEST__INIT;
    Cohort__V1__WatchRequest wq = COHORT__V1__WATCH_REQUEST__INIT;
    struct one_stream o = { .lock = PTHREAD_MUTEX_INITIALIZER };
    ProtobufCMessage *out = NULL;
    struct rpc_watch *w = NULL;
    struct rpc_status st;

    cr_assert_eq(join("demo", "old", 7, 1, &st), -EPROTO, "%s", st.message);
    cr_assert(strstr(st.message, "protocol version 1 is not supported"), "%s", st.message);
    h.protocol_version = 1;
    h.cohort = "demo";
    h.id = "old";
    h.session = 7;
    cr_assert_eq(rpc_call(ch, WIRE_BROKER_HEARTBEAT, &h.base,
                          &cohort__v1__heartbeat_reply__descriptor, CALL_MS, RPC_WAIT_FOR_READY,
                          &out, &st), -EPROTO, "%s", st.message);
    cr_assert(strstr(st.message, "protocol version 1 is not supported"), "%s", st.message);
    /* Even one that names version 2 learns where heartbeats went. */
    h.protocol_version = WIRE_PROTOCOL_VERSION;
    cr_assert_eq(rpc_call(ch, WIRE_BROKER_HEARTBEAT, &h.base,
                          &cohort__v1__heartbeat_reply__descriptor, CALL_MS, RPC_WAIT_FOR_READY,
                          &out, &st), -EPROTO, "%s", st.message);
    cr_assert(strstr(st.message, "ride the Session stream"), "%s", st.message);
    wq.protocol_version = 1;
    wq.cohort = "demo";
    wq.id = "old";
    wq.session = 7;
    cr_assert_eq(rpc_watch_open(ch, WIRE_BROKER_WATCH, &wq.base, &cohort__v1__epoch__descriptor,
                                RPC_WAIT_FOR_READY, one_msg, one_end, &o, &w), 0);
    FIXTURE_WAIT_FOR(one_has(&o, true, 0), "the broker never ended a protocol 1 watch");
    rpc_watch_close(w);
    cr_assert_eq(o.st.code, RPC_FAILED_PRECONDITION, "%s", o.st.message);
    cr_assert_eq(o.msgs, 0);
    /* A Session stream opened with a heartbeat of version 1. */
    h.protocol_version = 1;
    cr_assert_eq(beat_call(&h.base, &st), -EPROTO, "%s", st.message);
    cr_assert(strstr(st.message, "protocol version 1 is not supported"), "%s", st.message);
    cr_assert_eq(status_members("demo"), 0);
}

Test(brokerd, unknown_cohort_is_not_found)
{
    struct rpc_status st;

    cr_assert_eq(join("nosuch", "a", 7, WIRE_PROTOCOL_VERSION, &st), -ENOENT);
    cr_assert_eq(st.code, RPC_NOT_FOUND);
    cr_assert(strstr(st.message, "unknown cohort \"nosuch\""), "%s", st.message);
}

Test(brokerd, duplicate_id_is_already_exists_and_rejoin_is_fine)
{
    struct rpc_status st;

    cr_assert_eq(join("demo", "a", 7, WIRE_PROTOCOL_VERSION, &st), 0);
    cr_assert_eq(join("demo", "a", 8, WIRE_PROTOCOL_VERSION, &st), -EEXIST);
    cr_assert_eq(st.code, RPC_ALREADY_EXISTS);
    cr_assert(strstr(st.message, "another session"), "%s", st.message);
    /* The same session again is a rejoin, not a duplicate. */
    cr_assert_eq(join("demo", "a", 7, WIRE_PROTOCOL_VERSION, &st), 0);
    cr_assert_eq(status_members("demo"), 1);
}

Test(brokerd, invalid_fields_are_invalid_argument)
{
    Cohort__V1__JoinRequest q = COHORT__V1__JOIN_REQUEST__INIT;
    ProtobufCMessage *out = NULL;
    struct rpc_status st;

    cr_assert_eq(join("demo", "bad id", 7, WIRE_PROTOCOL_VERSION, &st), -EINVAL, "%s: %s",
                 rpc_code_name(st.code), st.message);
    cr_assert(strstr(st.message, "invalid member id"), "%s", st.message);
    cr_assert_eq(join("demo", "a", 0, WIRE_PROTOCOL_VERSION, &st), -EINVAL, "%s: %s",
                 rpc_code_name(st.code), st.message);
    cr_assert(strstr(st.message, "session"), "%s", st.message);
    q.protocol_version = WIRE_PROTOCOL_VERSION;
    q.cohort = "demo";
    q.id = "a";
    q.address = "127.0.0.1:0";
    q.session = 3;
    cr_assert_eq(rpc_call(ch, WIRE_BROKER_JOIN, &q.base, &cohort__v1__join_reply__descriptor,
                          CALL_MS, RPC_WAIT_FOR_READY, &out, &st), -EINVAL, "%s: %s",
                 rpc_code_name(st.code), st.message);
    cr_assert(strstr(st.message, "address"), "%s", st.message);
    cr_assert_eq(status_members("demo"), 0);
}

/* A JoinReply says the broker weighs unreachable_peers, so that members
 * send them (an older broker, which leaves it false, gets none), and how
 * many one heartbeat may carry (an older one names none: 16). */
Test(brokerd, a_join_reply_says_unreachable_reports_are_weighed)
{
    Cohort__V1__JoinRequest q = COHORT__V1__JOIN_REQUEST__INIT;
    ProtobufCMessage *out = NULL;
    struct rpc_status st;

    q.protocol_version = WIRE_PROTOCOL_VERSION;
    q.cohort = "demo";
    q.id = "a";
    q.address = "127.0.0.1:4000";
    q.session = 3;
    cr_assert_eq(rpc_call(ch, WIRE_BROKER_JOIN, &q.base, &cohort__v1__join_reply__descriptor,
                          CALL_MS, RPC_WAIT_FOR_READY, &out, &st), 0, "%s", st.message);
    cr_assert(((Cohort__V1__JoinReply *)out)->weighs_unreachable);
    cr_assert_eq(((Cohort__V1__JoinReply *)out)->unreachable_max, WIRE_UNREACHABLE_MAX);
    protobuf_c_message_free_unpacked(out, NULL);
}

Test(brokerd, malformed_and_oversized_requests_are_refused_and_serving_goes_on)
{
    static char big[100 * 1024];
    Cohort__V1__Epoch wrong = COHORT__V1__EPOCH__INIT;
    struct rpc_status st;
    ProtobufCMessage *out = NULL;

    /* An Epoch's field 1 is a string; a JoinRequest's is a varint. */
    wrong.cohort = "not a join";
    cr_assert_eq(rpc_call(ch, WIRE_BROKER_JOIN, &wrong.base, &cohort__v1__join_reply__descriptor,
                          CALL_MS, RPC_WAIT_FOR_READY, &out, &st), -EINVAL);
    cr_assert_eq(st.code, RPC_INVALID_ARGUMENT);
    memset(big, 'a', sizeof(big) - 1);
    cr_assert_eq(join("demo", big, 7, WIRE_PROTOCOL_VERSION, &st), -ENOSPC);
    cr_assert_eq(st.code, RPC_RESOURCE_EXHAUSTED);
    cr_assert_eq(join("demo", "a", 7, WIRE_PROTOCOL_VERSION, &st), 0);
}

Test(brokerd, full_cohort_is_resource_exhausted)
{
    struct rpc_status st;
    char id[16];

    for (int i = 0; i < 4; i++) {
        snprintf(id, sizeof(id), "m-%d", i);
        cr_assert_eq(join("demo", id, 10 + (uint64_t)i, WIRE_PROTOCOL_VERSION, &st), 0);
    }
    cr_assert_eq(join("demo", "m-4", 99, WIRE_PROTOCOL_VERSION, &st), -ENOSPC);
    cr_assert_eq(st.code, RPC_RESOURCE_EXHAUSTED);
    /* Another cohort is not full. */
    cr_assert_eq(join("other", "m-4", 99, WIRE_PROTOCOL_VERSION, &st), 0);
}

Test(brokerd, heartbeat_and_leave_of_strangers_are_not_found)
{
    Cohort__V1__HeartbeatRequest h = COHORT__V1__HEARTBEAT_REQUEST__INIT;
    Cohort__V1__LeaveRequest l = COHORT__V1__LEAVE_REQUEST__INIT;
    ProtobufCMessage *out = NULL;
    struct rpc_status st;

    h.protocol_version = WIRE_PROTOCOL_VERSION;
    h.cohort = "demo";
    h.id = "ghost";
    h.session = 5;
    cr_assert_eq(beat_call(&h.base, &st), -ENOENT, "%s: %s",
                 rpc_code_name(st.code), st.message);
    l.protocol_version = WIRE_PROTOCOL_VERSION;
    l.cohort = "demo";
    l.id = "ghost";
    l.session = 5;
    cr_assert_eq(rpc_call(ch, WIRE_BROKER_LEAVE, &l.base, &cohort__v1__leave_reply__descriptor,
                          CALL_MS, RPC_WAIT_FOR_READY, &out, &st), -ENOENT, "%s: %s",
                 rpc_code_name(st.code), st.message);
}

/* An unsigned heartbeat of member `id`, session `session`, of "demo". */
static void beat_req(Cohort__V1__HeartbeatRequest *h, const char *id, uint64_t session)
{
    *h = (Cohort__V1__HeartbeatRequest)COHORT__V1__HEARTBEAT_REQUEST__INIT;
    h->protocol_version = WIRE_PROTOCOL_VERSION;
    h->cohort = "demo";
    h->id = (char *)id;
    h->session = session;
}

static bool one_has_epoch(struct one_stream *o)
{
    bool got;

    pthread_mutex_lock(&o->lock);
    got = o->msgs > 1 || (o->first && o->first->epoch);
    pthread_mutex_unlock(&o->lock);
    return got;
}

/* Heartbeats ride the stream: a member that keeps sending on it stays
 * for several timeouts without another call, hears acknowledgements
 * often enough to know it is alive, and gets its epochs on it. Once it
 * stops sending it is evicted after its timeout, not before, and its
 * stream ends with NOT_FOUND. */
Test(brokerd, heartbeats_ride_the_session_stream_and_silence_evicts)
{
    Cohort__V1__HeartbeatRequest h;
    struct one_stream o = { .lock = PTHREAD_MUTEX_INITIALIZER };
    struct rpc_watch *w;
    struct rpc_status st;
    uint64_t start, last_sent = 0;
    unsigned msgs, sent = 0;

    cr_assert_eq(join("demo", "a", 7, WIRE_PROTOCOL_VERSION, &st), 0, "%s", st.message);
    beat_req(&h, "a", 7);
    w = session_open(&h.base, &o);
    FIXTURE_WAIT_FOR(one_has(&o, false, 1), "the opening heartbeat got no answer");
    FIXTURE_WAIT_FOR(one_has_epoch(&o), "no epoch came down the stream");
    /* Three timeouts of heartbeats at the cohort's pace (a fifth of the
     * timeout), on the stream only. */
    start = clock_now_ms();
    while (clock_now_ms() - start < 3000) {
        int rc = rpc_watch_send(w, &h.base);
        cr_assert(rc == 0 || rc == -EBUSY, "send: %d", rc);
        if (rc == 0) {
            last_sent = clock_now_ms();
            sent++;
        }
        clock_sleep_ms(200);
    }
    cr_assert(one_has(&o, false, 0) && !o.ended, "the stream ended: %s", o.st.message);
    cr_assert_eq(status_members("demo"), 1);
    pthread_mutex_lock(&o.lock);
    msgs = o.msgs;
    pthread_mutex_unlock(&o.lock);
    /* Besides the first answer and the epoch: an acknowledgement at least
     * every half timeout (every second or third heartbeat at this pace),
     * and not one for each. */
    cr_assert_geq(msgs, 2 + sent / 3, "%u messages down for %u heartbeats", msgs, sent);
    cr_assert_lt(msgs, 2 + sent, "%u messages down for %u heartbeats", msgs, sent);
    /* Silent now. */
    FIXTURE_WAIT_FOR(one_has(&o, true, 0), "a silent stream was never ended");
    cr_assert_geq(clock_now_ms() - last_sent, 900, "evicted before its timeout");
    cr_assert_eq(o.st.code, RPC_NOT_FOUND, "%s", o.st.message);
    cr_assert(strstr(o.st.message, "evicted"), "%s", o.st.message);
    cr_assert_eq(status_members("demo"), 0);
    rpc_watch_close(w);
    protobuf_c_message_free_unpacked(&o.first->base, NULL);
}

/* A stream reset by the member's side (its process died) takes the member
 * out within the grace, long before its own timeout (20 s here). */
Test(brokerd, a_reset_session_stream_leaves_within_the_grace)
{
    Cohort__V1__HeartbeatRequest h;
    struct one_stream o = { .lock = PTHREAD_MUTEX_INITIALIZER };
    struct rpc_watch *w;
    struct rpc_status st;
    uint64_t t0;

    cr_assert_eq(join_to("demo", "a", 7, WIRE_PROTOCOL_VERSION, 20000, &st), 0, "%s",
                 st.message);
    beat_req(&h, "a", 7);
    w = session_open(&h.base, &o);
    FIXTURE_WAIT_FOR(one_has(&o, false, 1), "the opening heartbeat got no answer");
    cr_assert_eq(status_members("demo"), 1);
    t0 = clock_now_ms();
    rpc_watch_close(w);         /* cancels: what the kernel's reset looks like */
    FIXTURE_WAIT_FOR(status_members("demo") == 0, "the member stayed after its stream reset");
    cr_assert_lt(clock_now_ms() - t0, 10000, "it waited for a timeout, not the grace");
    protobuf_c_message_free_unpacked(&o.first->base, NULL);
}

/* What comes up a stream after its first heartbeat is checked as the first
 * was: a message that does not parse, or a heartbeat of another member,
 * ends the stream with INVALID_ARGUMENT and changes nothing (the member
 * stays, and a new stream carries on). A stream the member closes cleanly
 * ends with OK, and the member stays too. */
Test(brokerd, bad_stream_messages_end_the_stream_and_change_nothing)
{
    Cohort__V1__HeartbeatRequest h, other;
    Cohort__V1__Epoch wrong = COHORT__V1__EPOCH__INIT;
    struct one_stream o1 = { .lock = PTHREAD_MUTEX_INITIALIZER };
    struct one_stream o2 = { .lock = PTHREAD_MUTEX_INITIALIZER };
    struct one_stream o3 = { .lock = PTHREAD_MUTEX_INITIALIZER };
    struct rpc_watch *w;
    struct rpc_status st;

    cr_assert_eq(join("demo", "a", 7, WIRE_PROTOCOL_VERSION, &st), 0, "%s", st.message);
    cr_assert_eq(join("demo", "b", 8, WIRE_PROTOCOL_VERSION, &st), 0, "%s", st.message);
    beat_req(&h, "a", 7);
    beat_req(&other, "b", 8);
    /* An Epoch's field 1 is a string; a HeartbeatRequest's is a varint. */
    wrong.cohort = "not a heartbeat";
    w = session_open(&h.base, &o1);
    FIXTURE_WAIT_FOR(one_has(&o1, false, 1), "the opening heartbeat got no answer");
    session_send(w, &wrong.base);
    FIXTURE_WAIT_FOR(one_has(&o1, true, 0), "a malformed message did not end the stream");
    cr_assert_eq(o1.st.code, RPC_INVALID_ARGUMENT, "%s", o1.st.message);
    cr_assert(strstr(o1.st.message, "malformed"), "%s", o1.st.message);
    rpc_watch_close(w);
    protobuf_c_message_free_unpacked(&o1.first->base, NULL);

    w = session_open(&h.base, &o2);
    FIXTURE_WAIT_FOR(one_has(&o2, false, 1), "the opening heartbeat got no answer");
    session_send(w, &other.base);
    FIXTURE_WAIT_FOR(one_has(&o2, true, 0), "another member's heartbeat did not end the stream");
    cr_assert_eq(o2.st.code, RPC_INVALID_ARGUMENT, "%s", o2.st.message);
    cr_assert(strstr(o2.st.message, "member session that opened it"), "%s", o2.st.message);
    rpc_watch_close(w);
    protobuf_c_message_free_unpacked(&o2.first->base, NULL);
    cr_assert_eq(status_members("demo"), 2, "a refused stream message changed nothing");

    w = session_open(&h.base, &o3);
    FIXTURE_WAIT_FOR(one_has(&o3, false, 1), "a new stream got no answer");
    session_close(w, &o3);
    cr_assert_eq(o3.st.code, RPC_OK, "%s", o3.st.message);
    cr_assert_eq(status_members("demo"), 2);
}

/* A stream may run ahead of its member's heartbeat interval by a burst
 * (16 heartbeats at once), not more: one that floods is ended with
 * RESOURCE_EXHAUSTED, and the member stays. */
Test(brokerd, a_stream_that_floods_heartbeats_is_ended)
{
    Cohort__V1__HeartbeatRequest h;
    struct one_stream o = { .lock = PTHREAD_MUTEX_INITIALIZER };
    struct rpc_watch *w;
    struct rpc_status st;
    int sent = 0;

    cr_assert_eq(join("demo", "a", 7, WIRE_PROTOCOL_VERSION, &st), 0, "%s", st.message);
    beat_req(&h, "a", 7);
    w = session_open(&h.base, &o);
    FIXTURE_WAIT_FOR(one_has(&o, false, 1), "the opening heartbeat got no answer");
    /* 16 at once are fine; the cohort's interval is 200 ms, and these
     * go out far faster than 20 a second. */
    while (sent < 200 && !one_has(&o, true, 0)) {
        int rc = rpc_watch_send(w, &h.base);
        cr_assert(rc == 0 || rc == -EBUSY || rc == -EPIPE, "send: %d", rc);
        sent += rc == 0;
        if (rc == -EBUSY)
            clock_sleep_ms(1);
    }
    FIXTURE_WAIT_FOR(one_has(&o, true, 0), "a flood of %d heartbeats did not end the stream",
                     sent);
    cr_assert_gt(sent, 16, "ended after %d", sent);
    cr_assert_eq(o.st.code, RPC_RESOURCE_EXHAUSTED, "%s", o.st.message);
    cr_assert(strstr(o.st.message, "heartbeats faster than"), "%s", o.st.message);
    cr_assert_eq(status_members("demo"), 1, "the member stays");
    rpc_watch_close(w);
    protobuf_c_message_free_unpacked(&o.first->base, NULL);
}

/* ---- libcohort members in this process ---- */

#define N 4

/* The key driven_start() gives its members; NULL: none. */
static const struct secret *driven_key;

/* Members of "demo" polled by a thread of their own, as a node polls its
 * member. */
struct driven {
    struct member *m[N + 1];
    size_t n;
    atomic_bool stop;
    pthread_t t;
};

static void *drive(void *arg)
{
    struct driven *dv = arg;

    while (!atomic_load(&dv->stop)) {
        for (size_t i = 0; i < dv->n; i++)
            member_poll(dv->m[i], clock_now_ms());
        clock_sleep_ms(5);
    }
    return NULL;
}

/* Creates members ids[0 .. n) of "demo", the first at model version
 * `first_version` and the others at `version`, and starts polling them.
 * driven_stop() stops the polling and destroys them. */
static void driven_start(struct driven *dv, size_t n, const char *const *ids,
                         uint64_t first_version, uint64_t version)
{
    for (size_t i = 0; i < n; i++) {
        struct member_config mc = { .broker = addr, .cohort = "demo", .id = ids[i],
                                    .address = "127.0.0.1:4000",
                                    .model_version = i ? version : first_version, .quiet = true,
                                    .key = driven_key };

        cr_assert_eq(member_create(&mc, &dv->m[i]), 0);
    }
    dv->n = n;
    cr_assert_eq(pthread_create(&dv->t, NULL, drive, dv), 0);
}

static void driven_stop(struct driven *dv)
{
    atomic_store(&dv->stop, true);
    pthread_join(dv->t, NULL);
    for (size_t i = 0; i < dv->n; i++)
        member_destroy(dv->m[i]);
}

/* True when every member's latest epoch has n members and leader `leader`. */
static bool all_agree(struct driven *dv, size_t n, const char *leader)
{
    for (size_t i = 0; i < dv->n; i++) {
        struct epoch *e = member_epoch(dv->m[i]);
        bool ok = e && e->n_members == n && strcmp(epoch_leader_id(e), leader) == 0;
        epoch_unref(e);
        if (!ok)
            return false;
    }
    return true;
}

static void wait_agree(struct driven *dv, size_t n, const char *leader)
{
    FIXTURE_WAIT_FOR(all_agree(dv, n, leader), "members did not agree on %zu members led by %s",
                     n, leader);
}

/* True when the broker holds model version `version` for member i of
 * "demo" (members are listed in id order). */
static bool broker_holds_version(size_t i, uint64_t version)
{
    struct broker_status *st;
    bool ok;

    cr_assert_eq(brokerd_status(d, "demo", &st), 0);
    ok = i < st->cohorts[0].n_members && st->cohorts[0].members[i].model_version == version;
    broker_status_free(st);
    return ok;
}

static const char *const m4[] = { "m-0", "m-1", "m-2", "m-3" };

/* Members heartbeating on their streams stay for several timeouts (1 s
 * here) without joining again, and each keeps hearing from the broker
 * often enough (an acknowledgement at least every half timeout) that it
 * never believes itself out. */
Test(brokerd, members_on_streams_stay_and_know_they_are_in)
{
    struct driven dv = { .n = 0 };
    uint64_t start;

    driven_start(&dv, 3, m4, 0, 0);
    wait_agree(&dv, 3, "m-0");
    start = clock_now_ms();
    while (clock_now_ms() - start < 4000) {
        for (size_t i = 0; i < dv.n; i++)
            cr_assert(member_in_cohort(dv.m[i]), "m-%zu thought itself out after %llu ms", i,
                      (unsigned long long)(clock_now_ms() - start));
        clock_sleep_ms(50);
    }
    for (size_t i = 0; i < dv.n; i++)
        cr_assert_eq(member_joins(dv.m[i]), 1, "m-%zu joined again", i);
    cr_assert_eq(status_members("demo"), 3);
    driven_stop(&dv);
}

Test(brokerd, declared_version_moves_leadership_everywhere)
{
    struct driven dv = { .n = 0 };

    driven_start(&dv, N, m4, 3, 3);
    wait_agree(&dv, N, "m-0");
    for (size_t i = 0; i < dv.n; i++)
        cr_assert(member_in_cohort(dv.m[i]));

    /* Committed rounds advance versions without moving the leader: once
     * the broker has m-2's new version, everyone still follows m-0... */
    member_set_model_version(dv.m[2], 4, false);
    FIXTURE_WAIT_FOR(broker_holds_version(2, 4), "the broker never heard of m-2's version 4");
    cr_assert(all_agree(&dv, N, "m-0"));
    /* ...a declared version does. */
    member_set_model_version(dv.m[3], 100, true);
    wait_agree(&dv, N, "m-3");
    driven_stop(&dv);
}

Test(brokerd, evicted_member_rejoins_and_removed_cohort_ends_watches)
{
    struct driven dv = { .n = 0 };

    driven_start(&dv, 2, m4, 0, 0);
    wait_agree(&dv, 2, "m-0");
    cr_assert_eq(member_joins(dv.m[0]), 1);
    /* Remove the cohort under the members: their watches end, heartbeats
     * fail, and they retry until it is declared again. */
    cr_assert_eq(brokerd_remove(d, "demo"), 0);
    FIXTURE_WAIT_FOR(!member_in_cohort(dv.m[0]), "m-0 never noticed its cohort was removed");
    cr_assert_eq(brokerd_declare(d, "demo", 0, 0), 0);
    FIXTURE_WAIT_FOR(member_joins(dv.m[0]) >= 2 && member_joins(dv.m[1]) >= 2,
                     "the members never joined the declared cohort again");
    wait_agree(&dv, 2, "m-0");
    driven_stop(&dv);
}

Test(brokerd, drained_member_stays_joined_out_of_the_epoch)
{
    struct driven dv = { .n = 0 };
    struct broker_status *st;

    driven_start(&dv, 3, m4, 5, 0);
    wait_agree(&dv, 3, "m-0");
    cr_assert_eq(brokerd_drained(d, "demo", "m-0"), 0, "not asked to drain");
    cr_assert_eq(brokerd_drain(d, "demo", "m-0", true), 0);
    FIXTURE_WAIT_FOR(brokerd_drained(d, "demo", "m-0") != 0, "m-0 never drained");
    cr_assert_eq(brokerd_drained(d, "demo", "m-0"), 1);
    /* Everyone, the drained member too, runs in the epoch without it,
     * led by the next member; the drained one is still joined. */
    wait_agree(&dv, 2, "m-1");
    cr_assert_not(member_in_cohort(dv.m[0]));
    cr_assert(member_in_cohort(dv.m[1]));
    cr_assert_eq(brokerd_status(d, "demo", &st), 0);
    cr_assert_eq(st->cohorts[0].n_members, 3);
    cr_assert(st->cohorts[0].draining[0]);
    cr_assert_not(st->cohorts[0].draining[1]);
    broker_status_free(st);
    FIXTURE_WAIT_FOR(member_drained(dv.m[0]), "m-0 was never told it is drained");
    cr_assert_not(member_drained(dv.m[1]));
    /* Undrained, it is back in; unknown names are refused. */
    cr_assert_eq(brokerd_drain(d, "demo", "m-0", false), 0);
    wait_agree(&dv, 3, "m-0");
    cr_assert_eq(brokerd_drain(d, "demo", "zz", true), -ENOENT);
    cr_assert_eq(brokerd_drain(d, "nope", "m-0", true), -ENOENT);
    cr_assert_eq(brokerd_drained(d, "nope", "m-0"), -ENOENT);
    driven_stop(&dv);
}

/* An open broker serves a cohort without a key as before, but not one
 * with a key, nor every cohort's status once any key exists. */
Test(brokerd, an_open_broker_serves_keyless_cohorts_only)
{
    Cohort__V1__StatusRequest q = COHORT__V1__STATUS_REQUEST__INIT;
    ProtobufCMessage *out = NULL;
    struct rpc_status st;
    struct secret k;

    memset(k.key, 0xb0, sizeof(k.key));
    cr_assert_eq(brokerd_set_key(d, "other", &k), 0);
    cr_assert_eq(join("demo", "a", 7, WIRE_PROTOCOL_VERSION, &st), 0);
    cr_assert_eq(join("other", "a", 7, WIRE_PROTOCOL_VERSION, &st), -EPERM);
    cr_assert_eq(st.code, RPC_UNAUTHENTICATED);
    cr_assert_eq(status_members("demo"), 1);
    q.protocol_version = WIRE_PROTOCOL_VERSION;
    q.cohort = "";
    cr_assert_eq(rpc_call(ch, WIRE_BROKER_STATUS, &q.base, &cohort__v1__status_reply__descriptor,
                          CALL_MS, RPC_WAIT_FOR_READY, &out, &st), -EPERM);
    cr_assert(strstr(st.message, "admin key"), "%s", st.message);
}

/* ---- with keys ---- */

/* Keys by their fill byte: the config's (every cohort's), another
 * cohort's, the admin's, and one nobody set. */
static struct secret key_a, key_b, key_admin, key_x;

static void fill(struct secret *k, uint8_t b)
{
    memset(k->key, b, sizeof(k->key));
}

/* The fixture's broker with key_a for every cohort, key_admin, no open
 * cohorts, and a 3 s member timeout cap; cohorts "demo" and "other". */
static void start_keyed(void)
{
    struct brokerd_config cfg;

    fill(&key_a, 0xa0);
    fill(&key_b, 0xb0);
    fill(&key_admin, 0xad);
    fill(&key_x, 0x99);
    fixture_broker_config(&cfg);
    cfg.open = false;
    cfg.key = &key_a;
    cfg.admin_key = &key_admin;
    cfg.broker.max_timeout_ms = 3000;
    d = fixture_broker_start_with(&cfg, "demo", addr, sizeof(addr));
    cr_assert_eq(brokerd_declare(d, "other", 0, 0), 0);
    cr_assert_eq(rpc_channel_create(addr, NULL, &ch), 0);
}

static void stop_keyed(void)
{
    driven_key = NULL;
    stop();
}

TestSuite(brokerd_keys, .init = start_keyed, .fini = stop_keyed, .timeout = 120);

/* Signs req under k (NULL: no proof) with seq and time t (0: now), then
 * calls `path`. The reply, if any, goes to *out when out is not NULL. */
static int signed_call(const char *path, ProtobufCMessage *req, Cohort__V1__Proof **slot,
                       const ProtobufCMessageDescriptor *reply_desc, const struct secret *k,
                       uint64_t seq, uint64_t t, struct rpc_status *st, ProtobufCMessage **out)
{
    Cohort__V1__Proof pf;
    uint8_t mac[SECRET_MAC_BYTES];
    ProtobufCMessage *reply = NULL;
    int rc;

    if (k) {
        cr_assert_eq(proof_sign(k, req, seq, t ? t : proof_now_ms(), &pf, mac), 0);
        *slot = &pf;
    }
    rc = rpc_call(ch, path, req, reply_desc, CALL_MS, RPC_WAIT_FOR_READY, &reply, st);
    *slot = NULL;
    if (out)
        *out = reply;
    else if (reply)
        protobuf_c_message_free_unpacked(reply, NULL);
    return rc;
}

static void join_req(Cohort__V1__JoinRequest *q, const char *cohort, const char *id,
                     uint64_t session)
{
    *q = (Cohort__V1__JoinRequest)COHORT__V1__JOIN_REQUEST__INIT;
    q->protocol_version = WIRE_PROTOCOL_VERSION;
    q->cohort = (char *)cohort;
    q->id = (char *)id;
    q->address = "127.0.0.1:4000";
    q->session = session;
}

static int kjoin(const struct secret *k, const char *cohort, const char *id, uint64_t session,
                 uint64_t seq, uint64_t t, struct rpc_status *st)
{
    Cohort__V1__JoinRequest q;

    join_req(&q, cohort, id, session);
    return signed_call(WIRE_BROKER_JOIN, &q.base, &q.proof, &cohort__v1__join_reply__descriptor,
                       k, seq, t, st, NULL);
}

static int kbeat(const struct secret *k, const char *id, uint64_t session, uint64_t seq,
                 struct rpc_status *st)
{
    Cohort__V1__HeartbeatRequest q = COHORT__V1__HEARTBEAT_REQUEST__INIT;
    Cohort__V1__Proof pf;
    uint8_t mac[SECRET_MAC_BYTES];

    q.protocol_version = WIRE_PROTOCOL_VERSION;
    q.cohort = "demo";
    q.id = (char *)id;
    q.session = session;
    if (k) {
        cr_assert_eq(proof_sign(k, &q.base, seq, proof_now_ms(), &pf, mac), 0);
        q.proof = &pf;
    }
    return beat_call(&q.base, st);
}

static int kleave(const struct secret *k, const char *id, uint64_t session, uint64_t seq,
                  struct rpc_status *st)
{
    Cohort__V1__LeaveRequest q = COHORT__V1__LEAVE_REQUEST__INIT;

    q.protocol_version = WIRE_PROTOCOL_VERSION;
    q.cohort = "demo";
    q.id = (char *)id;
    q.session = session;
    return signed_call(WIRE_BROKER_LEAVE, &q.base, &q.proof, &cohort__v1__leave_reply__descriptor,
                       k, seq, 0, st, NULL);
}

/* A Status of `cohort` ("" for every one) proving k at time t (0: now);
 * on success *n (when not NULL) gets the number of cohorts shown. */
static int kstatus(const struct secret *k, const char *cohort, uint64_t t, struct rpc_status *st,
                   size_t *n)
{
    Cohort__V1__StatusRequest q = COHORT__V1__STATUS_REQUEST__INIT;
    ProtobufCMessage *out = NULL;
    int rc;

    q.protocol_version = WIRE_PROTOCOL_VERSION;
    q.cohort = (char *)cohort;
    rc = signed_call(WIRE_BROKER_STATUS, &q.base, &q.proof, &cohort__v1__status_reply__descriptor,
                     k, 1, t, st, &out);
    if (rc == 0 && n)
        *n = ((Cohort__V1__StatusReply *)out)->n_cohorts;
    if (out)
        protobuf_c_message_free_unpacked(out, NULL);
    return rc;
}

/* Members the broker holds in `cohort`, asked directly (no proof needed). */
static size_t held(const char *cohort)
{
    struct broker_status *bs;
    size_t n;

    cr_assert_eq(brokerd_status(d, cohort, &bs), 0);
    n = bs->cohorts[0].n_members;
    broker_status_free(bs);
    return n;
}

static void assert_refused(int rc, const struct rpc_status *st, const char *why)
{
    cr_assert_eq(rc, -EPERM, "rc %d: %s", rc, st->message);
    cr_assert_eq(st->code, RPC_UNAUTHENTICATED);
    cr_assert(strstr(st->message, why), "\"%s\" does not say \"%s\"", st->message, why);
}

Test(brokerd_keys, a_join_without_a_proof_is_refused_and_changes_nothing)
{
    struct rpc_status st;

    assert_refused(kjoin(NULL, "demo", "a", 7, 0, 0, &st), &st,
                   "the request proves no key for cohort \"demo\"");
    cr_assert_eq(held("demo"), 0);
    assert_refused(kbeat(NULL, "a", 7, 0, &st), &st, "proves no key");
    assert_refused(kleave(NULL, "a", 7, 0, &st), &st, "proves no key");
}

Test(brokerd_keys, a_wrong_key_is_refused)
{
    struct rpc_status st;

    assert_refused(kjoin(&key_x, "demo", "a", 7, 1, 0, &st), &st,
                   "the request proves a wrong key for cohort \"demo\"");
    assert_refused(kjoin(&key_admin, "demo", "a", 7, 1, 0, &st), &st, "wrong key");
    cr_assert_eq(held("demo"), 0);
    cr_assert_eq(kjoin(&key_a, "demo", "a", 7, 1, 0, &st), 0, "%s", st.message);
    cr_assert_eq(held("demo"), 1);
}

/* A proof is bound to its method, cohort, member, session and the fields
 * that say what the request does: changing any of them after signing
 * makes it a wrong key. */
Test(brokerd_keys, a_proof_holds_for_its_own_request_only)
{
    Cohort__V1__JoinRequest q;
    Cohort__V1__HeartbeatRequest h = COHORT__V1__HEARTBEAT_REQUEST__INIT;
    Cohort__V1__LeaveRequest l = COHORT__V1__LEAVE_REQUEST__INIT;
    Cohort__V1__Proof pf;
    uint8_t mac[SECRET_MAC_BYTES];
    ProtobufCMessage *out = NULL;
    struct rpc_status st;

    for (int change = 0; change < 6; change++) {
        join_req(&q, "demo", "a", 7);
        cr_assert_eq(proof_sign(&key_a, &q.base, 1, proof_now_ms(), &pf, mac), 0);
        q.proof = &pf;
        switch (change) {
        case 0: q.cohort = "other"; break;
        case 1: q.id = "b"; break;
        case 2: q.session = 8; break;
        case 3: q.timeout_ms = 600000; break;
        case 4: q.address = "10.9.9.9:4000"; break;
        case 5: pf.seq = 2; break;
        }
        assert_refused(rpc_call(ch, WIRE_BROKER_JOIN, &q.base, &cohort__v1__join_reply__descriptor,
                                CALL_MS, RPC_WAIT_FOR_READY, &out, &st), &st, "wrong key");
    }
    cr_assert_eq(held("demo") + held("other"), 0);

    /* A heartbeat's proof on a leave of the same member. */
    cr_assert_eq(kjoin(&key_a, "demo", "a", 7, 1, 0, &st), 0);
    h.protocol_version = l.protocol_version = WIRE_PROTOCOL_VERSION;
    h.cohort = l.cohort = "demo";
    h.id = l.id = "a";
    h.session = l.session = 7;
    cr_assert_eq(proof_sign(&key_a, &h.base, 2, proof_now_ms(), &pf, mac), 0);
    l.proof = &pf;
    assert_refused(rpc_call(ch, WIRE_BROKER_LEAVE, &l.base, &cohort__v1__leave_reply__descriptor,
                            CALL_MS, RPC_WAIT_FOR_READY, &out, &st), &st, "wrong key");
    cr_assert_eq(held("demo"), 1);
    /* On its own request it is good. */
    h.proof = &pf;
    cr_assert_eq(beat_call(&h.base, &st), 0);
}

/* A heartbeat's lost_peers are bound into its proof (changing, adding or
 * dropping one after signing is a wrong key), and more than
 * WIRE_LOST_PEERS_MAX, or an invalid id among them, is INVALID_ARGUMENT;
 * a heartbeat that reports none is signed as before the field existed. */
Test(brokerd_keys, a_heartbeats_lost_peers_are_bound_and_checked)
{
    Cohort__V1__HeartbeatRequest h = COHORT__V1__HEARTBEAT_REQUEST__INIT;
    Cohort__V1__Proof pf;
    uint8_t mac[SECRET_MAC_BYTES];
    struct rpc_status st;
    char *peers[WIRE_LOST_PEERS_MAX + 1], *other[] = { "c" }, *bad[] = { "NOT VALID" };
    uint64_t seq = 2;

    for (size_t i = 0; i <= WIRE_LOST_PEERS_MAX; i++)
        peers[i] = "b";
    cr_assert_eq(kjoin(&key_a, "demo", "a", 7, 1, 0, &st), 0);
    cr_assert_eq(kjoin(&key_a, "demo", "b", 8, 1, 0, &st), 0);
    h.protocol_version = WIRE_PROTOCOL_VERSION;
    h.cohort = "demo";
    h.id = "a";
    h.session = 7;
    for (int change = 0; change < 3; change++) {
        h.lost_peers = peers;
        h.n_lost_peers = 1;
        cr_assert_eq(proof_sign(&key_a, &h.base, seq++, proof_now_ms(), &pf, mac), 0);
        h.proof = &pf;
        switch (change) {
        case 0: h.lost_peers = other; break;
        case 1: h.n_lost_peers = 2; break;
        case 2: h.n_lost_peers = 0; break;
        }
        assert_refused(beat_call(&h.base, &st),
                       &st, "wrong key");
    }
    /* Signed as sent: accepted, and b, whose stream is up, stays. */
    h.lost_peers = peers;
    h.n_lost_peers = 1;
    cr_assert_eq(proof_sign(&key_a, &h.base, seq++, proof_now_ms(), &pf, mac), 0);
    cr_assert_eq(beat_call(&h.base, &st), 0, "%s", st.message);
    cr_assert_eq(held("demo"), 2);

    h.n_lost_peers = WIRE_LOST_PEERS_MAX + 1;
    cr_assert_eq(proof_sign(&key_a, &h.base, seq++, proof_now_ms(), &pf, mac), -EINVAL,
                 "nothing too long is signed");
    cr_assert_eq(beat_call(&h.base, &st), -EINVAL);
    cr_assert_eq(st.code, RPC_INVALID_ARGUMENT, "%s", st.message);
    cr_assert(strstr(st.message, "at most 16 lost peers"), "%s", st.message);
    h.lost_peers = bad;
    h.n_lost_peers = 1;
    cr_assert_eq(proof_sign(&key_a, &h.base, seq++, proof_now_ms(), &pf, mac), 0);
    cr_assert_eq(beat_call(&h.base, &st), -EINVAL);
    cr_assert(strstr(st.message, "among the lost peers"), "%s", st.message);
    cr_assert_eq(held("demo"), 2);
}

/* Likewise for unreachable_peers: bound into the proof, apart from the
 * lost peers (the same id moved from one list to the other is a wrong
 * key), capped and checked; a report about an epoch that is not the
 * current one changes nothing. */
Test(brokerd_keys, a_heartbeats_unreachable_peers_are_bound_and_checked)
{
    Cohort__V1__HeartbeatRequest h = COHORT__V1__HEARTBEAT_REQUEST__INIT;
    Cohort__V1__Proof pf;
    uint8_t mac[SECRET_MAC_BYTES];
    struct rpc_status st;
    static char *peers[WIRE_UNREACHABLE_MAX + 1];
    char *other[] = { "c" }, *bad[] = { "NOT VALID" };
    uint64_t seq = 2;

    for (size_t i = 0; i <= WIRE_UNREACHABLE_MAX; i++)
        peers[i] = "b";
    cr_assert_eq(kjoin(&key_a, "demo", "a", 7, 1, 0, &st), 0);
    cr_assert_eq(kjoin(&key_a, "demo", "b", 8, 1, 0, &st), 0);
    h.protocol_version = WIRE_PROTOCOL_VERSION;
    h.cohort = "demo";
    h.id = "a";
    h.session = 7;
    for (int change = 0; change < 4; change++) {
        h.unreachable_peers = peers;
        h.n_unreachable_peers = 1;
        h.n_lost_peers = 0;
        cr_assert_eq(proof_sign(&key_a, &h.base, seq++, proof_now_ms(), &pf, mac), 0);
        h.proof = &pf;
        switch (change) {
        case 0: h.unreachable_peers = other; break;
        case 1: h.n_unreachable_peers = 2; break;
        case 2: h.n_unreachable_peers = 0; break;
        case 3:
            h.n_unreachable_peers = 0;
            h.lost_peers = peers;
            h.n_lost_peers = 1;
            break;
        }
        assert_refused(beat_call(&h.base, &st), &st, "wrong key");
    }
    h.n_lost_peers = 0;
    h.unreachable_peers = peers;
    h.n_unreachable_peers = 1;
    h.epoch = 999;
    cr_assert_eq(proof_sign(&key_a, &h.base, seq++, proof_now_ms(), &pf, mac), 0);
    cr_assert_eq(beat_call(&h.base, &st), 0, "%s", st.message);
    cr_assert_eq(held("demo"), 2);

    /* More than the 16 of a broker before unreachable_max, up to the
     * WIRE_UNREACHABLE_MAX its JoinReply names, are signed and taken. */
    h.n_unreachable_peers = WIRE_LOST_PEERS_MAX + 1;
    cr_assert_eq(proof_sign(&key_a, &h.base, seq++, proof_now_ms(), &pf, mac), 0);
    cr_assert_eq(beat_call(&h.base, &st), 0, "%s", st.message);
    h.n_unreachable_peers = WIRE_UNREACHABLE_MAX;
    cr_assert_eq(proof_sign(&key_a, &h.base, seq++, proof_now_ms(), &pf, mac), 0);
    cr_assert_eq(beat_call(&h.base, &st), 0, "%s", st.message);
    cr_assert_eq(held("demo"), 2);

    h.n_unreachable_peers = WIRE_UNREACHABLE_MAX + 1;
    cr_assert_eq(proof_sign(&key_a, &h.base, seq++, proof_now_ms(), &pf, mac), -EINVAL,
                 "nothing too long is signed");
    cr_assert_eq(beat_call(&h.base, &st), -EINVAL);
    cr_assert_eq(st.code, RPC_INVALID_ARGUMENT, "%s", st.message);
    cr_assert(strstr(st.message, "at most 1024 unreachable peers"), "%s", st.message);
    h.unreachable_peers = bad;
    h.n_unreachable_peers = 1;
    cr_assert_eq(proof_sign(&key_a, &h.base, seq++, proof_now_ms(), &pf, mac), 0);
    cr_assert_eq(beat_call(&h.base, &st), -EINVAL);
    cr_assert(strstr(st.message, "among the unreachable peers"), "%s", st.message);
    cr_assert_eq(held("demo"), 2);
}

Test(brokerd_keys, a_replayed_heartbeat_or_leave_is_refused)
{
    struct rpc_status st;

    cr_assert_eq(kjoin(&key_a, "demo", "a", 7, 1, 0, &st), 0);
    cr_assert_eq(kbeat(&key_a, "a", 7, 2, &st), 0);
    assert_refused(kbeat(&key_a, "a", 7, 2, &st), &st, "already used");
    assert_refused(kbeat(&key_a, "a", 7, 1, &st), &st, "already used");
    cr_assert_eq(kbeat(&key_a, "a", 7, 4, &st), 0);
    cr_assert_eq(kbeat(&key_a, "a", 7, 3, &st), 0, "overtaken calls are fine");
    assert_refused(kleave(&key_a, "a", 7, 3, &st), &st, "already used");
    cr_assert_eq(held("demo"), 1);
    cr_assert_eq(kleave(&key_a, "a", 7, 5, &st), 0);
    cr_assert_eq(held("demo"), 0);
}

Test(brokerd_keys, a_replayed_join_cannot_bring_back_a_member_that_left)
{
    uint64_t t = proof_now_ms();
    struct rpc_status st;

    cr_assert_eq(kjoin(&key_a, "demo", "a", 7, 1, t, &st), 0);
    assert_refused(kjoin(&key_a, "demo", "a", 7, 1, t, &st), &st, "already used");
    cr_assert_eq(kleave(&key_a, "a", 7, 2, &st), 0);
    assert_refused(kjoin(&key_a, "demo", "a", 7, 1, t, &st), &st, "has left the cohort");
    cr_assert_eq(held("demo"), 0);
    /* The pod's next process comes with a new session. */
    cr_assert_eq(kjoin(&key_a, "demo", "a", 8, 1, 0, &st), 0);
}

Test(brokerd_keys, a_join_outside_the_clock_window_is_refused)
{
    uint64_t now = proof_now_ms();
    struct rpc_status st;

    assert_refused(kjoin(&key_a, "demo", "a", 7, 1, now - WIRE_PROOF_SKEW_MS - 5000, &st), &st,
                   "behind the broker's clock");
    assert_refused(kjoin(&key_a, "demo", "a", 7, 1, now + WIRE_PROOF_SKEW_MS + 5000, &st), &st,
                   "ahead of the broker's clock");
    cr_assert_eq(held("demo"), 0);
    /* Inside the window by half of it from the clock read now: the calls
     * above may take seconds on a loaded machine. */
    now = proof_now_ms();
    cr_assert_eq(kjoin(&key_a, "demo", "a", 7, 1, now - WIRE_PROOF_SKEW_MS / 2, &st), 0, "%s",
                 st.message);
    /* Heartbeats carry no clock rule: their seq bounds them. */
    cr_assert_eq(kbeat(&key_a, "a", 7, 2, &st), 0);
}

Test(brokerd_keys, status_takes_the_cohorts_key_or_the_admin_key)
{
    struct rpc_status st;
    size_t n = 0;

    cr_assert_eq(brokerd_set_key(d, "other", &key_b), 0);
    cr_assert_eq(kstatus(&key_a, "demo", 0, &st, &n), 0);
    cr_assert_eq(n, 1);
    cr_assert_eq(kstatus(&key_admin, "demo", 0, &st, &n), 0);
    cr_assert_eq(kstatus(&key_b, "other", 0, &st, &n), 0);
    assert_refused(kstatus(NULL, "demo", 0, &st, NULL), &st, "proves no key for cohort \"demo\"");
    assert_refused(kstatus(&key_x, "demo", 0, &st, NULL), &st, "wrong key");
    assert_refused(kstatus(&key_a, "other", 0, &st, NULL), &st, "wrong key for cohort \"other\"");
    assert_refused(kstatus(&key_b, "demo", 0, &st, NULL), &st, "wrong key");
    /* Every cohort at once: the admin key only. */
    cr_assert_eq(kstatus(&key_admin, "", 0, &st, &n), 0);
    cr_assert_eq(n, 2);
    assert_refused(kstatus(&key_a, "", 0, &st, NULL), &st, "needs the admin key");
    assert_refused(kstatus(NULL, "", 0, &st, NULL), &st, "needs the admin key");
    /* A status proof has a clock rule too. */
    assert_refused(kstatus(&key_admin, "", proof_now_ms() - 10 * WIRE_PROOF_SKEW_MS, &st, NULL),
                   &st, "behind the broker's clock");
}

Test(brokerd_keys, a_cohorts_own_key_overrides_the_configs_until_removed)
{
    struct rpc_status st;

    cr_assert_eq(brokerd_set_key(d, "other", &key_b), 0);
    assert_refused(kjoin(&key_a, "other", "a", 7, 1, 0, &st), &st, "wrong key for cohort \"other\"");
    cr_assert_eq(kjoin(&key_b, "other", "a", 7, 1, 0, &st), 0);
    cr_assert_eq(kjoin(&key_a, "demo", "a", 7, 1, 0, &st), 0, "demo keeps the config's key");
    cr_assert_eq(brokerd_set_key(d, "other", NULL), 0);
    assert_refused(kjoin(&key_b, "other", "b", 8, 1, 0, &st), &st, "wrong key");
    cr_assert_eq(kjoin(&key_a, "other", "b", 8, 1, 0, &st), 0);
    cr_assert_eq(brokerd_set_key(d, "bad name", &key_b), -EINVAL);
}

Test(brokerd_keys, the_join_reply_says_what_was_granted)
{
    Cohort__V1__JoinRequest q;
    ProtobufCMessage *out = NULL;
    const Cohort__V1__JoinReply *r;
    struct rpc_status st;

    join_req(&q, "demo", "evil", 7);
    q.heartbeat_ms = 1;
    q.timeout_ms = UINT32_MAX;
    cr_assert_eq(signed_call(WIRE_BROKER_JOIN, &q.base, &q.proof,
                             &cohort__v1__join_reply__descriptor, &key_a, 1, 0, &st, &out), 0);
    r = (const Cohort__V1__JoinReply *)out;
    cr_assert_eq(r->heartbeat_ms, BROKER_HEARTBEAT_FLOOR_MS, "the cohort's 200 ms is slower");
    cr_assert_eq(r->timeout_ms, 3000, "the configured cap");
    protobuf_c_message_free_unpacked(out, NULL);
}

/* A Session stream opened with a replayed heartbeat (the same proof) is
 * refused, and the member's own stream goes on. A stream whose later
 * heartbeat proves nothing, or a wrong key, or replays, is ended as
 * UNAUTHENTICATED, and the member stays. */
Test(brokerd_keys, replayed_or_unproved_stream_heartbeats_are_refused)
{
    Cohort__V1__HeartbeatRequest q = COHORT__V1__HEARTBEAT_REQUEST__INIT;
    struct one_stream first = { .lock = PTHREAD_MUTEX_INITIALIZER };
    struct one_stream again = { .lock = PTHREAD_MUTEX_INITIALIZER };
    struct one_stream later = { .lock = PTHREAD_MUTEX_INITIALIZER };
    struct rpc_watch *w1, *w2;
    Cohort__V1__Proof pf, pf2;
    uint8_t mac[SECRET_MAC_BYTES], mac2[SECRET_MAC_BYTES];
    struct rpc_status st;
    const char *why[] = { "proves no key", "wrong key", "already used" };

    cr_assert_eq(kjoin(&key_a, "demo", "a", 7, 1, 0, &st), 0);
    q.protocol_version = WIRE_PROTOCOL_VERSION;
    q.cohort = "demo";
    q.id = "a";
    q.session = 7;
    cr_assert_eq(proof_sign(&key_a, &q.base, 2, proof_now_ms(), &pf, mac), 0);
    q.proof = &pf;
    w1 = session_open(&q.base, &first);
    FIXTURE_WAIT_FOR(one_has(&first, false, 1), "the stream got no answer");
    /* The same heartbeat again: it would take the member's stream over. */
    w2 = session_open(&q.base, &again);
    FIXTURE_WAIT_FOR(one_has(&again, true, 0), "the replayed stream was not ended");
    cr_assert_eq(again.st.code, RPC_UNAUTHENTICATED);
    cr_assert(strstr(again.st.message, "already used"), "%s", again.st.message);
    cr_assert_eq(again.msgs, 0);
    cr_assert(one_has(&first, false, 1) && !first.ended, "the member's own stream goes on");
    rpc_watch_close(w2);
    session_close(w1, &first);

    /* Later heartbeats on a good stream: unproved, a wrong key, a replay. */
    for (int i = 0; i < 3; i++) {
        struct one_stream *o = i == 0 ? &later : &first;
        uint64_t seq = 10 + 2 * (uint64_t)i;

        *o = (struct one_stream){ .lock = PTHREAD_MUTEX_INITIALIZER };
        cr_assert_eq(proof_sign(&key_a, &q.base, seq, proof_now_ms(), &pf, mac), 0);
        q.proof = &pf;
        w1 = session_open(&q.base, o);
        FIXTURE_WAIT_FOR(one_has(o, false, 1), "the stream got no answer");
        if (i == 0)
            q.proof = NULL;
        else
            cr_assert_eq(proof_sign(i == 1 ? &key_x : &key_a, &q.base, i == 1 ? seq + 1 : seq,
                                    proof_now_ms(), &pf2, mac2), 0);
        if (i > 0)
            q.proof = &pf2;
        session_send(w1, &q.base);
        FIXTURE_WAIT_FOR(one_has(o, true, 0), "a bad heartbeat did not end the stream");
        cr_assert_eq(o->st.code, RPC_UNAUTHENTICATED, "%s", o->st.message);
        cr_assert(strstr(o->st.message, why[i]), "%s: %s", why[i], o->st.message);
        rpc_watch_close(w1);
        protobuf_c_message_free_unpacked(&o->first->base, NULL);
        cr_assert_eq(held("demo"), 1, "a refused heartbeat changed nothing");
    }
}

Test(brokerd_keys, members_with_the_key_join_and_follow_epochs)
{
    struct driven dv = { .n = 0 };

    driven_key = &key_a;
    driven_start(&dv, 3, m4, 5, 0);
    wait_agree(&dv, 3, "m-0");
    member_set_model_version(dv.m[2], 50, true);
    wait_agree(&dv, 3, "m-2");
    for (size_t i = 0; i < dv.n; i++)
        cr_assert_eq(member_refusals(dv.m[i]), 0);
    driven_stop(&dv);
}

/* A member with the wrong key is refused, says so, and backs off instead
 * of retrying every 100 ms as it does after other failures. */
Test(brokerd_keys, a_member_with_a_wrong_key_backs_off)
{
    struct driven dv = { .n = 0 };
    uint64_t t0;

    driven_key = &key_x;
    driven_start(&dv, 1, m4, 0, 0);
    FIXTURE_WAIT_FOR(member_refusals(dv.m[0]) >= 1, "the member was never refused");
    t0 = clock_now_ms();
    clock_sleep_ms(3000);
    /* Retries 0.5-1 s, then 1-2 s, then 2-4 s after the first refusal. */
    cr_assert_leq(member_refusals(dv.m[0]), 3, "%llu refusals in %llu ms",
                  (unsigned long long)member_refusals(dv.m[0]),
                  (unsigned long long)(clock_now_ms() - t0));
    cr_assert_not(member_in_cohort(dv.m[0]));
    cr_assert_eq(member_joins(dv.m[0]), 0);
    cr_assert_eq(held("demo"), 0);
    driven_stop(&dv);
}

/* A broker that is not open refuses a cohort it has no key for. */
static void start_closed(void)
{
    struct brokerd_config cfg;

    fixture_broker_config(&cfg);
    cfg.open = false;
    d = fixture_broker_start_with(&cfg, "demo", addr, sizeof(addr));
    cr_assert_eq(rpc_channel_create(addr, NULL, &ch), 0);
}

TestSuite(brokerd_closed, .init = start_closed, .fini = stop, .timeout = 60);

Test(brokerd_closed, a_cohort_without_a_key_is_refused)
{
    struct rpc_status st;

    fill(&key_b, 0xb0);
    assert_refused(kjoin(NULL, "demo", "a", 7, 0, 0, &st), &st,
                   "has no key for cohort \"demo\"");
    assert_refused(kjoin(&key_b, "demo", "a", 7, 1, 0, &st), &st, "has no key");
    assert_refused(kstatus(NULL, "demo", 0, &st, NULL), &st, "only the admin key");
    assert_refused(kstatus(NULL, "", 0, &st, NULL), &st, "this broker has none");
    cr_assert_eq(held("demo"), 0);
    /* Given a key, it serves the cohort. */
    cr_assert_eq(brokerd_set_key(d, "demo", &key_b), 0);
    cr_assert_eq(kjoin(&key_b, "demo", "a", 7, 1, 0, &st), 0);
    cr_assert_eq(kstatus(&key_b, "demo", 0, &st, NULL), 0);
}

/* ---- over TLS ---- */

static struct fixture_tls tls;

/* start_keyed()'s broker, serving TLS with the fixture's certificate. */
static void start_tls(void)
{
    struct brokerd_config cfg;

    fixture_tls_make(&tls);
    fill(&key_a, 0xa0);
    fixture_broker_config(&cfg);
    cfg.open = false;
    cfg.key = &key_a;
    cfg.tls_cert_pem = tls.cert;
    cfg.tls_key_pem = tls.key;
    d = fixture_broker_start_with(&cfg, "demo", addr, sizeof(addr));
    ch = NULL;
}

static void stop_tls(void)
{
    fixture_broker_stop(d);
    fixture_tls_cleanup(&tls);
}

TestSuite(brokerd_tls, .init = start_tls, .fini = stop_tls, .timeout = 120);

/* A member of "demo" with key_a and these TLS settings. */
static struct member *tls_member(const char *id, const char *ca, const char *name)
{
    struct member_config mc = { .broker = addr, .cohort = "demo", .id = id,
                                .address = "127.0.0.1:4000", .quiet = true, .key = &key_a,
                                .tls_ca_pem = ca, .tls_server_name = name };
    struct member *m;

    cr_assert_eq(member_create(&mc, &m), 0);
    return m;
}

/* Polls all n members for within_ms, or until m[0] has joined when
 * `first` is set. Returns whether m[0] has joined. */
static bool poll_members(struct member **m, size_t n, uint32_t within_ms, bool first)
{
    uint64_t end = fixture_deadline(within_ms);

    while (fixture_before(end) && !(first && member_joins(m[0]) > 0)) {
        for (size_t i = 0; i < n; i++)
            member_poll(m[i], clock_now_ms());
        clock_sleep_ms(5);
    }
    return member_joins(m[0]) > 0;
}

Test(brokerd_tls, a_member_with_the_ca_joins_and_one_without_cannot)
{
    struct member *m[3] = {
        tls_member("m-0", tls.ca, FIXTURE_TLS_NAME),
        tls_member("m-1", NULL, NULL),                          /* plaintext */
        tls_member("m-2", tls.other_ca, FIXTURE_TLS_NAME),      /* another CA */
    };

    cr_assert(poll_members(m, 3, FIXTURE_WAIT_MS, true), "the member with the CA never joined");
    /* The others get a few seconds of tries: none reaches the broker. */
    poll_members(m, 3, 3000, false);
    cr_assert_eq(member_joins(m[1]) + member_joins(m[2]), 0);
    cr_assert_eq(member_refusals(m[1]) + member_refusals(m[2]), 0, "not even refused");
    cr_assert_eq(held("demo"), 1);
    for (size_t i = 0; i < 3; i++)
        member_destroy(m[i]);
}

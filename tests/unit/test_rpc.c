/* tests/unit/test_rpc.c: the gRPC wrapper between real servers and clients
 * on loopback, with free ports, in plaintext and over TLS with a CA and a
 * certificate made for the test (fixture.h). */
#include <criterion/criterion.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "base/clock.h"
#include "cohort.pb-c.h"
#include "fixture.h"
#include "rpc/rpc.h"

#define P_STATUS "/cohort.v1.Broker/Status"
#define P_HEART "/cohort.v1.Broker/Heartbeat"
#define P_WATCH "/cohort.v1.Broker/Watch"
#define P_JOIN "/cohort.v1.Broker/Join"
#define P_DUPLEX "/cohort.v1.Broker/Session"

/* ---- a tiny service ---- */

struct fixture {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    struct rpc_stream *stream;  /* the open Watch, kept by the "service" */
    int closes;                 /* on_close calls seen */
    int nested_rc;              /* what rpc_call returned inside a handler */
    struct rpc_channel *self;   /* for the nested call */
    int duplex_msgs;            /* messages after the first on duplex streams */
    bool duplex_in_callback;    /* a duplex message callback is running */
    /* Checks that failed on a handler's thread, where an assertion cannot
     * fail the test: stop() asserts there were none. */
    atomic_int handler_errors;
};

static struct fixture fx = { PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, NULL, 0, 0, NULL,
                             0, false, 0 };

/* Status echoes the cohort it was asked about; "fail" asks for an error. */
static void on_status(void *arg, const ProtobufCMessage *req, struct rpc_reply *r)
{
    const Cohort__V1__StatusRequest *q = (const Cohort__V1__StatusRequest *)req;
    Cohort__V1__StatusReply rep = COHORT__V1__STATUS_REPLY__INIT;
    Cohort__V1__CohortStatus cs = COHORT__V1__COHORT_STATUS__INIT;
    Cohort__V1__CohortStatus *list[1] = { &cs };

    if (strcmp(q->cohort, "fail") == 0) {
        rpc_reply_error(r, RPC_NOT_FOUND, "unknown cohort \"%s\"", q->cohort);
        return;
    }
    if (strcmp(q->cohort, "nested") == 0) {
        ProtobufCMessage *out = NULL;
        fx.nested_rc = rpc_call(fx.self, P_STATUS, req, &cohort__v1__status_reply__descriptor, 1000,
                                0, &out, NULL);
    }
    if (strcmp(q->cohort, "silent") == 0)
        return;         /* no answer: the module must send INTERNAL */
    cs.name = q->cohort;
    cs.epoch = q->protocol_version;
    rep.n_cohorts = 1;
    rep.cohorts = list;
    rpc_reply_ok(r, &rep.base);
}

static void on_stream_close(void *arg, struct rpc_stream *s)
{
    pthread_mutex_lock(&fx.lock);
    fx.closes++;
    if (fx.stream == s) {
        fx.stream = NULL;
        rpc_stream_unref(s);
    }
    pthread_cond_broadcast(&fx.cond);
    pthread_mutex_unlock(&fx.lock);
}

/* Sends epoch n down `s`. Returns 0 or -errno: the handlers run on the
 * server's threads, where cr_assert cannot fail the test. */
static int try_send_epoch(struct rpc_stream *s, uint64_t n)
{
    Cohort__V1__Epoch e = COHORT__V1__EPOCH__INIT;
    struct rpc_buf *b;
    int rc;

    e.cohort = "c";
    e.epoch = n;
    rc = rpc_buf_pack(&e.base, &b);
    if (rc < 0)
        return rc;
    rc = rpc_stream_send(s, b);
    rpc_buf_unref(b);
    return rc;
}

/* A check on a handler's thread: a failure is said and counted for
 * end_test(). Takes no lock, so it may run under fx.lock. */
static void handler_check(bool ok, const char *what)
{
    if (!ok) {
        fprintf(stderr, "test_rpc: a handler's check failed: %s\n", what);
        atomic_fetch_add(&fx.handler_errors, 1);
    }
}

/* A send may fail only on a stream whose client has already left it
 * (-EPIPE): a server must expect that on any stream, and a handler may
 * run after its client closed the call (duplex_messages_... closes its
 * plain watch at once). */
static void handler_send_epoch(struct rpc_stream *s, uint64_t n)
{
    int rc = try_send_epoch(s, n);

    if (rc == 0 || (rc == -EPIPE && rpc_stream_cancelled(s)))
        return;
    fprintf(stderr, "test_rpc: epoch %llu: %s, the stream %s\n", (unsigned long long)n,
            strerror(-rc), rpc_stream_cancelled(s) ? "cancelled by its client" : "not cancelled");
    handler_check(false, "an epoch could not be sent on a stream its client had not left");
}

/* try_send_epoch on the test's thread. */
static void send_epoch(struct rpc_stream *s, uint64_t n)
{
    cr_assert_eq(try_send_epoch(s, n), 0);
}

/* Watch: "three" sends epochs 1..3 and finishes; "keep" keeps the stream
 * open; "refuse" fails at once. */
static void on_watch(void *arg, const ProtobufCMessage *req, struct rpc_stream *s)
{
    const Cohort__V1__WatchRequest *q = (const Cohort__V1__WatchRequest *)req;

    if (strcmp(q->cohort, "refuse") == 0) {
        rpc_stream_finish(s, RPC_NOT_FOUND, "no such member");
        rpc_stream_unref(s);
        return;
    }
    if (strcmp(q->cohort, "three") == 0) {
        for (uint64_t i = 1; i <= 3; i++)
            handler_send_epoch(s, i);
        rpc_stream_finish(s, RPC_OK, "");
        rpc_stream_unref(s);
        return;
    }
    rpc_stream_on_close(s, on_stream_close, NULL);
    /* Sent before the stream is shared, so the test's later sends follow. */
    handler_send_epoch(s, 7);
    pthread_mutex_lock(&fx.lock);
    fx.stream = s;
    pthread_cond_broadcast(&fx.cond);
    pthread_mutex_unlock(&fx.lock);
}

/* Duplex: counts the client's later messages (each must name cohort
 * "more"), answers each with an epoch numbered by the count, and ends the
 * stream when the client half-closes, saying how many it got. */
static void on_duplex_msg(void *arg, struct rpc_stream *s, const ProtobufCMessage *msg)
{
    char done[64];
    int n;

    pthread_mutex_lock(&fx.lock);
    handler_check(!fx.duplex_in_callback, "two message callbacks of one stream at once");
    fx.duplex_in_callback = true;
    n = msg ? ++fx.duplex_msgs : fx.duplex_msgs;
    pthread_mutex_unlock(&fx.lock);
    if (msg) {
        Cohort__V1__Epoch e = COHORT__V1__EPOCH__INIT;
        struct rpc_buf *b;

        handler_check(strcmp(((const Cohort__V1__WatchRequest *)msg)->cohort, "more") == 0,
                      "a later message names cohort \"more\"");
        e.epoch = (uint64_t)n;
        if (rpc_buf_pack(&e.base, &b) == 0) {
            rpc_stream_send(s, b);      /* -EPIPE once the client hung up */
            rpc_buf_unref(b);
        } else {
            handler_check(false, "an epoch could not be packed");
        }
    } else {
        snprintf(done, sizeof(done), "%d messages", n);
        rpc_stream_finish(s, RPC_OK, done);
    }
    pthread_mutex_lock(&fx.lock);
    fx.duplex_in_callback = false;
    pthread_cond_broadcast(&fx.cond);
    pthread_mutex_unlock(&fx.lock);
}

static void on_duplex_close(void *arg, struct rpc_stream *s)
{
    pthread_mutex_lock(&fx.lock);
    handler_check(!fx.duplex_in_callback, "on_close ran while a message callback ran");
    fx.closes++;
    pthread_cond_broadcast(&fx.cond);
    pthread_mutex_unlock(&fx.lock);
    rpc_stream_unref(s);
}

static void on_duplex(void *arg, const ProtobufCMessage *req, struct rpc_stream *s)
{
    rpc_stream_on_message(s, on_duplex_msg, NULL);
    rpc_stream_on_close(s, on_duplex_close, NULL);
}

static const struct rpc_method methods[] = {
    { P_STATUS, &cohort__v1__status_request__descriptor, on_status, NULL, NULL },
    { P_WATCH, &cohort__v1__watch_request__descriptor, NULL, on_watch, NULL },
    { P_DUPLEX, &cohort__v1__watch_request__descriptor, NULL, on_duplex, NULL },
};

static struct rpc_server *srv;
static struct rpc_channel *ch;
static char target[64];

/* Fails the test if a handler_check failed during it. */
static void check_handlers(void)
{
    int errors = atomic_exchange(&fx.handler_errors, 0);

    cr_assert_eq(errors, 0, "%d checks failed on the handlers' threads (stderr says which)",
                 errors);
}

static void stop(void)
{
    rpc_channel_destroy(ch);
    rpc_server_destroy(srv);
    rpc_shutdown();
}

/* Criterion reports a failed assertion in a suite's .fini and still
 * counts the test passed (its issues 211 and 242): the handlers' checks,
 * and the teardown that ends every handler first, run at the end of each
 * test's body instead. RPC_TEST defines a test that way; the suites'
 * .fini tears down only what a test that failed before its end left. */
static void (*teardown)(void);     /* the suite's; set by its .init */

static void fini_left(void)
{
    if (teardown)
        teardown();
    teardown = NULL;
}

static void end_test(void)
{
    fini_left();
    check_handlers();
}

#define RPC_TEST(suite, name)                                                      \
    static void suite##__##name(void);                                             \
    Test(suite, name)                                                              \
    {                                                                              \
        suite##__##name();                                                         \
        end_test();                                                                \
    }                                                                              \
    static void suite##__##name(void)

static void start(void)
{
    cr_assert_eq(rpc_init(), 0);
    cr_assert_eq(rpc_server_create("127.0.0.1:0", methods, 3, NULL, &srv), 0);
    cr_assert_gt(rpc_server_port(srv), 0);
    snprintf(target, sizeof(target), "127.0.0.1:%d", rpc_server_port(srv));
    cr_assert_eq(rpc_channel_create(target, NULL, &ch), 0);
    fx.self = ch;
    teardown = stop;
}

static int status_call(const char *cohort, uint32_t version, ProtobufCMessage **out, struct rpc_status *st)
{
    Cohort__V1__StatusRequest q = COHORT__V1__STATUS_REQUEST__INIT;

    q.cohort = (char *)cohort;
    q.protocol_version = version;
    return rpc_call(ch, P_STATUS, &q.base, &cohort__v1__status_reply__descriptor, 5000, 0, out, st);
}

TestSuite(rpc, .init = start, .fini = fini_left, .timeout = 60);

RPC_TEST(rpc, unary_round_trip)
{
    ProtobufCMessage *out = NULL;
    struct rpc_status st;

    cr_assert_eq(status_call("alpha", 42, &out, &st), 0);
    Cohort__V1__StatusReply *rep = (Cohort__V1__StatusReply *)out;
    cr_assert_eq(rep->n_cohorts, 1);
    cr_assert_str_eq(rep->cohorts[0]->name, "alpha");
    cr_assert_eq(rep->cohorts[0]->epoch, 42);
    protobuf_c_message_free_unpacked(out, NULL);
}

RPC_TEST(rpc, handler_error_maps_to_errno_with_message)
{
    ProtobufCMessage *out = NULL;
    struct rpc_status st;

    cr_assert_eq(status_call("fail", 1, &out, &st), -ENOENT);
    cr_assert_eq(st.code, RPC_NOT_FOUND);
    cr_assert_str_eq(st.message, "unknown cohort \"fail\"");
    cr_assert_null(out);
}

RPC_TEST(rpc, handler_without_answer_is_internal)
{
    ProtobufCMessage *out = NULL;
    struct rpc_status st;

    cr_assert_eq(status_call("silent", 1, &out, &st), -EIO);
    cr_assert_eq(st.code, RPC_INTERNAL);
}

RPC_TEST(rpc, unknown_method_is_unimplemented)
{
    Cohort__V1__StatusRequest q = COHORT__V1__STATUS_REQUEST__INIT;
    ProtobufCMessage *out = NULL;
    struct rpc_status st;

    cr_assert_eq(rpc_call(ch, "/cohort.v1.Broker/Nope", &q.base, &cohort__v1__status_reply__descriptor,
                          5000, 0, &out, &st), -ENOSYS);
    cr_assert_eq(st.code, RPC_UNIMPLEMENTED);
    /* The server keeps serving. */
    cr_assert_eq(status_call("after", 1, &out, &st), 0);
    protobuf_c_message_free_unpacked(out, NULL);
}

RPC_TEST(rpc, malformed_request_is_invalid_argument)
{
    /* A Member has a string where StatusRequest has a varint: field 1 with
     * the wrong wire type does not parse. */
    Cohort__V1__Member m = COHORT__V1__MEMBER__INIT;
    ProtobufCMessage *out = NULL;
    struct rpc_status st;

    m.id = "not a status request";
    cr_assert_eq(rpc_call(ch, P_STATUS, &m.base, &cohort__v1__status_reply__descriptor, 5000, 0, &out,
                          &st), -EINVAL);
    cr_assert_eq(st.code, RPC_INVALID_ARGUMENT);
    cr_assert_eq(status_call("after", 1, &out, &st), 0);
    protobuf_c_message_free_unpacked(out, NULL);
}

RPC_TEST(rpc, oversized_request_is_resource_exhausted)
{
    static char big[128 * 1024];
    ProtobufCMessage *out = NULL;
    struct rpc_status st;

    memset(big, 'x', sizeof(big) - 1);
    cr_assert_eq(status_call(big, 1, &out, &st), -ENOSPC);
    cr_assert_eq(st.code, RPC_RESOURCE_EXHAUSTED);
    cr_assert_eq(status_call("after", 1, &out, &st), 0);
    protobuf_c_message_free_unpacked(out, NULL);
}

RPC_TEST(rpc, blocking_call_on_completion_thread_is_refused)
{
    ProtobufCMessage *out = NULL;

    cr_assert_eq(status_call("nested", 1, &out, NULL), 0);
    protobuf_c_message_free_unpacked(out, NULL);
    cr_assert_eq(fx.nested_rc, -EDEADLK);
}

RPC_TEST(rpc, dead_port_fails_fast_or_waits_until_deadline)
{
    Cohort__V1__StatusRequest q = COHORT__V1__STATUS_REQUEST__INIT;
    struct rpc_channel *dead;
    ProtobufCMessage *out = NULL;
    struct rpc_status st;
    struct rpc_server *tmp;
    char addr[64];
    uint64_t t0;

    /* A port that was free a moment ago and has no listener now. */
    cr_assert_eq(rpc_server_create("127.0.0.1:0", methods, 1, NULL, &tmp), 0);
    snprintf(addr, sizeof(addr), "127.0.0.1:%d", rpc_server_port(tmp));
    rpc_server_destroy(tmp);
    cr_assert_eq(rpc_channel_create(addr, NULL, &dead), 0);
    cr_assert_eq(rpc_call(dead, P_STATUS, &q.base, &cohort__v1__status_reply__descriptor, 5000, 0,
                          &out, &st), -ECONNREFUSED);
    cr_assert_eq(st.code, RPC_UNAVAILABLE);
    t0 = clock_now_ms();
    cr_assert_eq(rpc_call(dead, P_STATUS, &q.base, &cohort__v1__status_reply__descriptor, 300,
                          RPC_WAIT_FOR_READY, &out, &st), -ETIMEDOUT);
    cr_assert_geq(clock_now_ms() - t0, 250);
    rpc_channel_destroy(dead);
}

RPC_TEST(rpc, second_server_on_same_port_fails)
{
    struct rpc_server *dup = NULL;
    char addr[64];

    snprintf(addr, sizeof(addr), "127.0.0.1:%d", rpc_server_port(srv));
    cr_assert_eq(rpc_server_create(addr, methods, 2, NULL, &dup), -EADDRINUSE);
    cr_assert_null(dup);
}

/* ---- streams ---- */

struct seen {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    uint64_t epochs[16];
    int n;
    bool ended;
    struct rpc_status st;
};

static void seen_msg(void *arg, ProtobufCMessage *m)
{
    struct seen *s = arg;

    pthread_mutex_lock(&s->lock);
    cr_assert(!s->ended, "a message came after the end");
    if (s->n < 16)
        s->epochs[s->n++] = ((Cohort__V1__Epoch *)m)->epoch;
    pthread_cond_broadcast(&s->cond);
    pthread_mutex_unlock(&s->lock);
    protobuf_c_message_free_unpacked(m, NULL);
}

static void seen_end(void *arg, const struct rpc_status *st)
{
    struct seen *s = arg;

    pthread_mutex_lock(&s->lock);
    cr_assert(!s->ended, "on_end ran twice");
    s->ended = true;
    s->st = *st;
    pthread_cond_broadcast(&s->cond);
    pthread_mutex_unlock(&s->lock);
}

/* Waits up to 10 s for `cond` to hold under s->lock. */
#define WAIT_UNTIL(lk, cv, cond)                                                   \
    do {                                                                           \
        uint64_t dl_ = clock_now_ms() + 10000;                                     \
        pthread_mutex_lock(lk);                                                    \
        while (!(cond) && clock_now_ms() < dl_) {                                  \
            struct timespec ts_;                                                   \
            clock_gettime(CLOCK_REALTIME, &ts_);                                   \
            ts_.tv_nsec += 50 * 1000000;                                           \
            if (ts_.tv_nsec >= 1000000000) {                                       \
                ts_.tv_sec++;                                                      \
                ts_.tv_nsec -= 1000000000;                                         \
            }                                                                      \
            pthread_cond_timedwait(cv, lk, &ts_);                                  \
        }                                                                          \
        bool ok_ = (cond);                                                         \
        pthread_mutex_unlock(lk);                                                  \
        cr_assert(ok_, "timed out waiting for " #cond);                            \
    } while (0)

static struct rpc_watch *open_watch(const char *cohort, struct seen *s)
{
    Cohort__V1__WatchRequest q = COHORT__V1__WATCH_REQUEST__INIT;
    struct rpc_watch *w;

    pthread_mutex_init(&s->lock, NULL);
    pthread_cond_init(&s->cond, NULL);
    q.cohort = (char *)cohort;
    cr_assert_eq(rpc_watch_open(ch, P_WATCH, &q.base, &cohort__v1__epoch__descriptor, 0, seen_msg,
                                seen_end, s, &w), 0);
    return w;
}

RPC_TEST(rpc, stream_delivers_latest_in_order_then_ends)
{
    struct seen s = { .n = 0, .ended = false };
    struct rpc_watch *w = open_watch("three", &s);

    WAIT_UNTIL(&s.lock, &s.cond, s.ended);
    cr_assert_eq(s.st.code, RPC_OK);
    /* Latest wins: a message may be replaced by a newer one before it is
     * sent, but the first goes out, order holds and the last arrives. */
    cr_assert_geq(s.n, 2);
    cr_assert_eq(s.epochs[0], 1);
    for (int i = 1; i < s.n; i++)
        cr_assert_gt(s.epochs[i], s.epochs[i - 1]);
    cr_assert_eq(s.epochs[s.n - 1], 3);
    cr_assert_eq(rpc_watch_close(w), 0);
}

RPC_TEST(rpc, stream_refused_carries_status)
{
    struct seen s = { .n = 0, .ended = false };
    struct rpc_watch *w = open_watch("refuse", &s);

    WAIT_UNTIL(&s.lock, &s.cond, s.ended);
    cr_assert_eq(s.st.code, RPC_NOT_FOUND);
    cr_assert_str_eq(s.st.message, "no such member");
    cr_assert_eq(s.n, 0);
    rpc_watch_close(w);
}

RPC_TEST(rpc, client_hangup_reaches_server_on_close)
{
    struct seen s = { .n = 0, .ended = false };
    struct rpc_watch *w = open_watch("keep", &s);

    WAIT_UNTIL(&s.lock, &s.cond, s.n == 1);
    cr_assert_eq(s.epochs[0], 7);
    cr_assert_eq(rpc_watch_close(w), 0);
    WAIT_UNTIL(&fx.lock, &fx.cond, fx.closes == 1 && fx.stream == NULL);
}

RPC_TEST(rpc, server_pushes_later_and_finish_ends_client)
{
    struct seen s = { .n = 0, .ended = false };
    struct rpc_watch *w = open_watch("keep", &s);
    struct rpc_stream *st;

    WAIT_UNTIL(&fx.lock, &fx.cond, fx.stream != NULL);
    pthread_mutex_lock(&fx.lock);
    st = rpc_stream_ref(fx.stream);
    pthread_mutex_unlock(&fx.lock);
    send_epoch(st, 8);
    WAIT_UNTIL(&s.lock, &s.cond, s.n >= 2 && s.epochs[s.n - 1] == 8);
    rpc_stream_finish(st, RPC_NOT_FOUND, "evicted");
    WAIT_UNTIL(&s.lock, &s.cond, s.ended);
    cr_assert_eq(s.st.code, RPC_NOT_FOUND);
    cr_assert_str_eq(s.st.message, "evicted");
    /* Finished streams refuse more. */
    struct rpc_buf *b;
    Cohort__V1__Epoch e = COHORT__V1__EPOCH__INIT;
    cr_assert_eq(rpc_buf_pack(&e.base, &b), 0);
    cr_assert_eq(rpc_stream_send(st, b), -EPIPE);
    rpc_buf_unref(b);
    rpc_stream_unref(st);
    rpc_watch_close(w);
    WAIT_UNTIL(&fx.lock, &fx.cond, fx.closes == 1);
}

RPC_TEST(rpc, server_destroy_ends_open_streams)
{
    struct seen s = { .n = 0, .ended = false };
    struct rpc_watch *w = open_watch("keep", &s);

    WAIT_UNTIL(&s.lock, &s.cond, s.n == 1);
    rpc_server_destroy(srv);
    srv = NULL;
    WAIT_UNTIL(&s.lock, &s.cond, s.ended);
    cr_assert_neq(s.st.code, RPC_OK);
    cr_assert_eq(fx.closes, 1);
    rpc_watch_close(w);
}

static struct rpc_watch *open_duplex(struct seen *s)
{
    Cohort__V1__WatchRequest q = COHORT__V1__WATCH_REQUEST__INIT;
    struct rpc_watch *w;

    pthread_mutex_init(&s->lock, NULL);
    pthread_cond_init(&s->cond, NULL);
    q.cohort = "first";
    cr_assert_eq(rpc_watch_open(ch, P_DUPLEX, &q.base, &cohort__v1__epoch__descriptor,
                                RPC_DUPLEX | RPC_WAIT_FOR_READY, seen_msg, seen_end, s, &w), 0);
    return w;
}

/* Sends `m` once the message before it is out. */
static int duplex_send(struct rpc_watch *w, const ProtobufCMessage *m)
{
    uint64_t dl = clock_now_ms() + 10000;
    int rc;

    while ((rc = m ? rpc_watch_send(w, m) : rpc_watch_done_sending(w)) == -EBUSY &&
           clock_now_ms() < dl)
        clock_sleep_ms(1);
    return rc;
}

RPC_TEST(rpc, duplex_messages_arrive_in_order_and_a_half_close_ends_cleanly)
{
    Cohort__V1__WatchRequest more = COHORT__V1__WATCH_REQUEST__INIT;
    struct seen s = { .n = 0, .ended = false }, plain = { .n = 0, .ended = false };
    struct rpc_watch *w = open_duplex(&s), *pw;

    more.cohort = "more";
    for (int i = 1; i <= 5; i++) {
        cr_assert_eq(duplex_send(w, &more.base), 0);
        /* One at a time, each answered before the next goes. */
        WAIT_UNTIL(&s.lock, &s.cond, s.n == i);
        cr_assert_eq(s.epochs[i - 1], (uint64_t)i);
    }
    cr_assert_eq(duplex_send(w, NULL), 0);
    WAIT_UNTIL(&s.lock, &s.cond, s.ended);
    cr_assert_eq(s.st.code, RPC_OK, "%s", s.st.message);
    cr_assert_str_eq(s.st.message, "5 messages");
    cr_assert_eq(rpc_watch_send(w, &more.base), -EPIPE, "an ended stream takes nothing");
    cr_assert_eq(rpc_watch_done_sending(w), -EPIPE);
    WAIT_UNTIL(&fx.lock, &fx.cond, fx.closes == 1);
    cr_assert_eq(rpc_watch_close(w), 0);
    /* A watch that is not duplex sends nothing more. Closed at once, it
     * may be gone before its handler sends. */
    pw = open_watch("keep", &plain);
    cr_assert_eq(rpc_watch_send(pw, &more.base), -EINVAL);
    cr_assert_eq(rpc_watch_done_sending(pw), -EINVAL);
    rpc_watch_close(pw);
}

RPC_TEST(rpc, a_malformed_duplex_message_ends_the_stream_unseen)
{
    Cohort__V1__Epoch wrong = COHORT__V1__EPOCH__INIT;
    struct seen s = { .n = 0, .ended = false };
    struct rpc_watch *w = open_duplex(&s);

    /* An Epoch's field 1 is a string; a WatchRequest's is a varint. */
    wrong.cohort = "not a watch request";
    cr_assert_eq(duplex_send(w, &wrong.base), 0);
    WAIT_UNTIL(&s.lock, &s.cond, s.ended);
    cr_assert_eq(s.st.code, RPC_INVALID_ARGUMENT);
    cr_assert(strstr(s.st.message, "malformed"), "%s", s.st.message);
    cr_assert_eq(s.n, 0);
    WAIT_UNTIL(&fx.lock, &fx.cond, fx.closes == 1);
    cr_assert_eq(fx.duplex_msgs, 0, "the handler never saw it");
    rpc_watch_close(w);
}

RPC_TEST(rpc, a_duplex_client_hangup_reaches_on_close_after_its_messages)
{
    Cohort__V1__WatchRequest more = COHORT__V1__WATCH_REQUEST__INIT;
    struct seen s = { .n = 0, .ended = false };
    struct rpc_watch *w = open_duplex(&s);

    more.cohort = "more";
    cr_assert_eq(duplex_send(w, &more.base), 0);
    cr_assert_eq(duplex_send(w, &more.base), 0);
    cr_assert_eq(rpc_watch_close(w), 0);
    WAIT_UNTIL(&fx.lock, &fx.cond, fx.closes == 1 && !fx.duplex_in_callback);
}

static int released;

static void on_released(void *arg)
{
    pthread_mutex_lock(&fx.lock);
    released++;
    handler_check(arg == &released, "a release callback got its own argument");
    pthread_cond_broadcast(&fx.cond);
    pthread_mutex_unlock(&fx.lock);
}

/* A buffer shared by a stream runs its release callback once, after the
 * stream has sent it and its owner let go, never before. */
RPC_TEST(rpc, a_shared_buffer_is_released_once_after_its_send)
{
    Cohort__V1__Epoch e = COHORT__V1__EPOCH__INIT;
    struct seen s = { .n = 0, .ended = false };
    struct rpc_watch *w = open_watch("keep", &s);
    struct rpc_stream *st;
    struct rpc_buf *b;

    WAIT_UNTIL(&fx.lock, &fx.cond, fx.stream != NULL);
    pthread_mutex_lock(&fx.lock);
    st = rpc_stream_ref(fx.stream);
    pthread_mutex_unlock(&fx.lock);
    e.cohort = "c";
    e.epoch = 9;
    cr_assert_eq(rpc_buf_pack(&e.base, &b), 0);
    rpc_buf_on_release(b, on_released, &released);
    cr_assert_eq(rpc_stream_send(st, b), 0);
    WAIT_UNTIL(&s.lock, &s.cond, s.n >= 2 && s.epochs[s.n - 1] == 9);
    pthread_mutex_lock(&fx.lock);
    cr_assert_eq(released, 0, "released while its owner still holds it");
    pthread_mutex_unlock(&fx.lock);
    rpc_buf_unref(b);
    WAIT_UNTIL(&fx.lock, &fx.cond, released == 1);
    rpc_stream_unref(st);
    rpc_watch_close(w);
    WAIT_UNTIL(&fx.lock, &fx.cond, fx.closes == 1);
    cr_assert_eq(released, 1);
}

RPC_TEST(rpc, code_mapping_round_trips)
{
    for (int c = RPC_CANCELLED; c <= RPC_UNAUTHENTICATED; c++) {
        int e = rpc_code_to_errno((enum rpc_code)c);
        cr_assert_lt(e, 0);
        if (c != RPC_UNKNOWN && c != RPC_INTERNAL && c != RPC_DATA_LOSS)
            cr_assert_eq(rpc_code_from_errno(e), (enum rpc_code)c, "code %d", c);
    }
    cr_assert_eq(rpc_code_to_errno(RPC_OK), 0);
    cr_assert_str_eq(rpc_code_name(RPC_NOT_FOUND), "NOT_FOUND");
}

/* ---- TLS ---- */

/* A server on TLS with the fixture's certificate for FIXTURE_TLS_NAME,
 * and one in plaintext, both serving the tiny service. */
static struct fixture_tls tls;
static struct rpc_server *tls_srv, *plain_srv;
static char tls_target[64], plain_target[64];

static void stop_tls(void)
{
    rpc_server_destroy(tls_srv);
    rpc_server_destroy(plain_srv);
    rpc_shutdown();
    fixture_tls_cleanup(&tls);
}

static void start_tls(void)
{
    struct rpc_server_opts so;

    fixture_tls_make(&tls);
    so = (struct rpc_server_opts){ .tls_cert_pem = tls.cert, .tls_key_pem = tls.key };
    cr_assert_eq(rpc_init(), 0);
    cr_assert_eq(rpc_server_create("127.0.0.1:0", methods, 2, &so, &tls_srv), 0);
    cr_assert_eq(rpc_server_create("127.0.0.1:0", methods, 2, NULL, &plain_srv), 0);
    snprintf(tls_target, sizeof(tls_target), "127.0.0.1:%d", rpc_server_port(tls_srv));
    snprintf(plain_target, sizeof(plain_target), "127.0.0.1:%d", rpc_server_port(plain_srv));
    teardown = stop_tls;
}

TestSuite(rpc_tls, .init = start_tls, .fini = fini_left, .timeout = 60);

/* A Status call through a new channel to `to` with these options;
 * returns the call's result and how long it took in *ms. */
static int tls_call(const char *to, const char *ca, const char *name, struct rpc_status *st,
                    uint64_t *ms)
{
    struct rpc_channel_opts o = { .tls_ca_pem = ca, .tls_server_name = name };
    Cohort__V1__StatusRequest q = COHORT__V1__STATUS_REQUEST__INIT;
    struct rpc_channel *c;
    ProtobufCMessage *out = NULL;
    uint64_t t0 = clock_now_ms();
    int rc;

    q.cohort = "tls";
    q.protocol_version = 7;
    cr_assert_eq(rpc_channel_create(to, &o, &c), 0);
    rc = rpc_call(c, P_STATUS, &q.base, &cohort__v1__status_reply__descriptor, 10000, 0, &out, st);
    if (ms)
        *ms = clock_now_ms() - t0;
    if (rc == 0) {
        Cohort__V1__StatusReply *rep = (Cohort__V1__StatusReply *)out;
        cr_assert_str_eq(rep->cohorts[0]->name, "tls");
        protobuf_c_message_free_unpacked(out, NULL);
    }
    rpc_channel_destroy(c);
    return rc;
}

RPC_TEST(rpc_tls, the_right_ca_and_the_certificates_name_work)
{
    struct rpc_status st;

    /* Dialled by address, the certificate's name is given: a broker
     * reached by pod IP whose certificate names its Service. */
    cr_assert_eq(tls_call(tls_target, tls.ca, FIXTURE_TLS_NAME, &st, NULL), 0, "%s", st.message);
}

RPC_TEST(rpc_tls, a_name_the_certificate_does_not_carry_fails)
{
    struct rpc_status st;
    uint64_t ms;

    cr_assert_eq(tls_call(tls_target, tls.ca, NULL, &st, &ms), -ECONNREFUSED);
    cr_assert_eq(st.code, RPC_UNAVAILABLE);
    cr_assert_eq(tls_call(tls_target, tls.ca, "other.ns.svc", &st, &ms), -ECONNREFUSED);
    cr_assert_eq(st.code, RPC_UNAVAILABLE);
    cr_assert_lt(ms, 5000, "the refusal took %llu ms", (unsigned long long)ms);
}

RPC_TEST(rpc_tls, a_wrong_ca_fails_unavailable_without_hanging)
{
    struct rpc_status st;
    uint64_t ms;

    cr_assert_eq(tls_call(tls_target, tls.other_ca, FIXTURE_TLS_NAME, &st, &ms), -ECONNREFUSED);
    cr_assert_eq(st.code, RPC_UNAVAILABLE, "%s", rpc_code_name(st.code));
    cr_assert_lt(ms, 5000, "the refusal took %llu ms", (unsigned long long)ms);
}

RPC_TEST(rpc_tls, plaintext_and_tls_do_not_mix)
{
    struct rpc_status st;
    uint64_t ms;

    cr_assert_eq(tls_call(tls_target, NULL, NULL, &st, &ms), -ECONNREFUSED);
    cr_assert_eq(st.code, RPC_UNAVAILABLE);
    cr_assert_lt(ms, 5000, "the refusal took %llu ms", (unsigned long long)ms);
    cr_assert_eq(tls_call(plain_target, tls.ca, FIXTURE_TLS_NAME, &st, &ms), -ECONNREFUSED);
    cr_assert_eq(st.code, RPC_UNAVAILABLE);
    cr_assert_lt(ms, 5000, "the refusal took %llu ms", (unsigned long long)ms);
    /* Both still serve their own kind. */
    cr_assert_eq(tls_call(plain_target, NULL, NULL, &st, NULL), 0);
    cr_assert_eq(tls_call(tls_target, tls.ca, FIXTURE_TLS_NAME, &st, NULL), 0);
}

RPC_TEST(rpc_tls, a_server_needs_both_halves_of_its_pair)
{
    struct rpc_server_opts half = { .tls_cert_pem = tls.cert };
    struct rpc_server_opts junk = { .tls_cert_pem = tls.cert, .tls_key_pem = "not a key" };
    struct rpc_server_opts other = { .tls_cert_pem = tls.cert };
    struct rpc_server *s = NULL;
    char path[128], *other_key;

    /* Another key that parses: the other CA's. */
    snprintf(path, sizeof(path), "%s/other.key", tls.dir);
    cr_assert_eq(rpc_pem_load(path, &other_key), 0);
    other.tls_key_pem = other_key;
    cr_assert_eq(rpc_server_create("127.0.0.1:0", methods, 2, &half, &s), -EINVAL);
    cr_assert_eq(rpc_server_create("127.0.0.1:0", methods, 2, &junk, &s), -EINVAL);
    cr_assert_eq(rpc_server_create("127.0.0.1:0", methods, 2, &other, &s), -EINVAL);
    rpc_pem_free(other_key);
}

RPC_TEST(rpc_tls, pem_files_are_read_with_a_cap)
{
    char path[128], *pem = (char *)1;
    FILE *f;

    snprintf(path, sizeof(path), "%s/ca.pem", tls.dir);
    cr_assert_eq(rpc_pem_load(path, &pem), 0);
    cr_assert(strstr(pem, "-----BEGIN CERTIFICATE-----"));
    rpc_pem_free(pem);
    snprintf(path, sizeof(path), "%s/none.pem", tls.dir);
    cr_assert_eq(rpc_pem_load(path, &pem), -ENOENT);
    snprintf(path, sizeof(path), "%s/ca.srl", tls.dir);     /* a serial number, no PEM */
    cr_assert_eq(rpc_pem_load(path, &pem), -EINVAL);
    snprintf(path, sizeof(path), "%s/server.csr", tls.dir);
    f = fopen(path, "a");
    cr_assert_not_null(f);
    for (size_t i = 0; i < RPC_PEM_MAX / 16 + 1; i++)
        fputs("0123456789abcde\n", f);
    fclose(f);
    cr_assert_eq(rpc_pem_load(path, &pem), -EFBIG);
}

/* One completion thread (rpc_init_threads, the broker's): a client and a
 * server in one process, whose completions all run on that thread, still
 * answer calls and carry a duplex stream to its end. */
static void start_one_thread(void)
{
    cr_assert_eq(rpc_init_threads(1), 0);
    cr_assert_eq(rpc_server_create("127.0.0.1:0", methods, 3, NULL, &srv), 0);
    snprintf(target, sizeof(target), "127.0.0.1:%d", rpc_server_port(srv));
    cr_assert_eq(rpc_channel_create(target, NULL, &ch), 0);
    fx.self = ch;
    teardown = stop;
}

TestSuite(rpc_one_thread, .init = start_one_thread, .fini = fini_left, .timeout = 60);

RPC_TEST(rpc_one_thread, calls_and_a_duplex_stream_complete)
{
    Cohort__V1__WatchRequest more = COHORT__V1__WATCH_REQUEST__INIT;
    struct seen s = { .n = 0, .ended = false };
    ProtobufCMessage *out = NULL;
    struct rpc_status st;
    struct rpc_watch *w;

    for (uint32_t v = 1; v <= 3; v++) {
        cr_assert_eq(status_call("alpha", v, &out, &st), 0, "%s", st.message);
        cr_assert_eq(((Cohort__V1__StatusReply *)out)->cohorts[0]->epoch, v);
        protobuf_c_message_free_unpacked(out, NULL);
    }
    w = open_duplex(&s);
    more.cohort = "more";
    for (int i = 1; i <= 3; i++) {
        cr_assert_eq(duplex_send(w, &more.base), 0);
        WAIT_UNTIL(&s.lock, &s.cond, s.n == i);
    }
    cr_assert_eq(duplex_send(w, NULL), 0);
    WAIT_UNTIL(&s.lock, &s.cond, s.ended);
    cr_assert_eq(s.st.code, RPC_OK, "%s", s.st.message);
    cr_assert_eq(rpc_watch_close(w), 0);
}

Test(rpc_threads, counts_other_than_one_or_two_are_refused_and_a_started_runtime_is_shared)
{
    cr_assert_eq(rpc_init_threads(0), -EINVAL);
    cr_assert_eq(rpc_init_threads(3), -EINVAL);
    cr_assert_eq(rpc_init(), 0);
    /* The runtime runs already: this user shares its two threads. */
    cr_assert_eq(rpc_init_threads(1), 0);
    rpc_shutdown();
    rpc_shutdown();
    /* Stopped for good: a new start may take one thread. */
    cr_assert_eq(rpc_init_threads(1), 0);
    rpc_shutdown();
}

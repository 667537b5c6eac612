/* tests/tools/broker_call.c: one raw call to a broker, with every field of
 * the request and of its proof under the caller's control, for the attack
 * tests of tests/proc (test_attack_broker.py). A stranger's tool: it sends
 * what it is told, a proof only when given a key, and the same proof
 * again when given the same --seq and --time-ms (a replay).
 *
 * `heartbeat` opens a Session stream (protocol 2) and sends the heartbeat
 * up it --repeat times; the outcome is the first message down (OK) or how
 * the stream ended. It then closes its side cleanly, so the broker does
 * not take the tool's exit for the member's death. `heartbeat-v1` and
 * `watch` call protocol 1's methods, which the broker refuses.
 *
 *   broker-call join --broker 127.0.0.1:7070 --cohort demo --id evil \
 *       --address 10.0.0.9:1 --timeout-ms 4294967295
 *
 * Prints one JSON line: {"code":"OK"|"UNAUTHENTICATED"|..., "message":...,
 * and the reply's fields}. Exit status 0 when the call succeeded, 1 when
 * the broker refused it, 2 for a usage error. */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/clock.h"
#include "base/opt.h"
#include "base/secret.h"
#include "cohort.pb-c.h"
#include "membership/proof.h"
#include "membership/wire.h"
#include "rpc/rpc.h"

#define PROG "broker-call"

static const char usage[] =
    "Usage: broker-call join|heartbeat|heartbeat-v1|leave|watch|status --broker ADDR\n"
    "           --cohort NAME [--protocol-version N]\n"
    "           [--id ID] [--session N] [--address HOST:PORT] [--model-version N]\n"
    "           [--heartbeat-ms N] [--timeout-ms N] [--last-epoch N] [--epoch N]\n"
    "           [--secret-file PATH [--seq N] [--time-ms N | --time-offset-ms N]]\n"
    "           [--broker-ca PATH [--broker-server-name NAME]] [--watch-for DUR]\n"
    "           [--repeat N] [--lost-peer ID]...\n"
    "One raw call to a broker (or N of the same, one after the other, on one\n"
    "connection); prints the outcome of the last as one JSON line, with the\n"
    "count of calls that failed.\n";

struct args {
    const char *method, *broker, *cohort, *id, *address, *secret_file, *ca_file, *server_name;
    uint64_t session, model_version, heartbeat_ms, timeout_ms, last_epoch, epoch, seq, time_ms;
    uint64_t version;           /* --protocol-version; the requests' */
    int64_t time_offset_ms;
    uint64_t watch_ms;
    uint64_t repeat;
    char *lost[32];             /* --lost-peer, for heartbeat (more than the broker takes) */
    size_t n_lost;
};

/* A watch: the epochs it got and how it ended. */
struct watched {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    unsigned msgs, epochs;
    uint64_t last;
    bool ended;
    struct rpc_status st;
};

static void on_msg(void *arg, ProtobufCMessage *msg)
{
    struct watched *w = arg;
    const Cohort__V1__Epoch *e = (const Cohort__V1__Epoch *)msg;

    if (msg->descriptor == &cohort__v1__session_reply__descriptor)
        e = ((const Cohort__V1__SessionReply *)msg)->epoch;
    pthread_mutex_lock(&w->lock);
    w->msgs++;
    w->epochs += e != NULL;
    if (e)
        w->last = e->epoch;
    pthread_cond_broadcast(&w->cond);
    pthread_mutex_unlock(&w->lock);
    protobuf_c_message_free_unpacked(msg, NULL);
}

static void on_end(void *arg, const struct rpc_status *st)
{
    struct watched *w = arg;

    pthread_mutex_lock(&w->lock);
    w->ended = true;
    w->st = *st;
    pthread_cond_broadcast(&w->cond);
    pthread_mutex_unlock(&w->lock);
}

/* A JSON string of s (printable ASCII; anything else as '?'). */
static void put_str(const char *s)
{
    putchar('"');
    for (; *s; s++) {
        if (*s == '"' || *s == '\\')
            printf("\\%c", *s);
        else
            putchar(*s >= 32 && *s < 127 ? *s : '?');
    }
    putchar('"');
}

static int outcome(const struct rpc_status *st, const char *extra)
{
    printf("{\"code\":\"%s\",\"message\":", rpc_code_name(st->code));
    put_str(st->message);
    printf("%s}\n", extra ? extra : "");
    return st->code == RPC_OK ? 0 : 1;
}

static int parse(int argc, char **argv, struct args *a)
{
    enum { O_BROKER = 256, O_COHORT, O_ID, O_SESSION, O_ADDRESS, O_MV, O_HB, O_TO, O_LAST,
           O_EPOCH, O_SECRET, O_SEQ, O_TIME, O_OFFSET, O_CA, O_SNAME, O_WATCH, O_REPEAT,
           O_LOST, O_VERSION };
    static const struct option longopts[] = {
        { "broker", required_argument, NULL, O_BROKER },
        { "cohort", required_argument, NULL, O_COHORT },
        { "id", required_argument, NULL, O_ID },
        { "session", required_argument, NULL, O_SESSION },
        { "address", required_argument, NULL, O_ADDRESS },
        { "model-version", required_argument, NULL, O_MV },
        { "heartbeat-ms", required_argument, NULL, O_HB },
        { "timeout-ms", required_argument, NULL, O_TO },
        { "last-epoch", required_argument, NULL, O_LAST },
        { "epoch", required_argument, NULL, O_EPOCH },
        { "secret-file", required_argument, NULL, O_SECRET },
        { "seq", required_argument, NULL, O_SEQ },
        { "time-ms", required_argument, NULL, O_TIME },
        { "time-offset-ms", required_argument, NULL, O_OFFSET },
        { "broker-ca", required_argument, NULL, O_CA },
        { "broker-server-name", required_argument, NULL, O_SNAME },
        { "watch-for", required_argument, NULL, O_WATCH },
        { "repeat", required_argument, NULL, O_REPEAT },
        { "lost-peer", required_argument, NULL, O_LOST },
        { "protocol-version", required_argument, NULL, O_VERSION },
        { "help", no_argument, NULL, 'h' },
        { NULL, 0, NULL, 0 },
    };
    uint64_t *u = NULL;
    int opt;

    *a = (struct args){ .id = "", .address = "127.0.0.1:9", .session = 1, .seq = 1,
                        .watch_ms = 2000, .repeat = 1, .version = WIRE_PROTOCOL_VERSION };
    if (argc < 2)
        return opt_usage(PROG, "want a method: join, heartbeat, heartbeat-v1, leave, watch or "
                         "status");
    a->method = argv[1];
    optind = 2;
    while ((opt = opt_next(PROG, argc, argv, "h", longopts)) != -1) {
        u = NULL;
        switch (opt) {
        case O_BROKER: a->broker = optarg; break;
        case O_COHORT: a->cohort = optarg; break;
        case O_ID: a->id = optarg; break;
        case O_ADDRESS: a->address = optarg; break;
        case O_SECRET: a->secret_file = optarg; break;
        case O_CA: a->ca_file = optarg; break;
        case O_SNAME: a->server_name = optarg; break;
        case O_SESSION: u = &a->session; break;
        case O_MV: u = &a->model_version; break;
        case O_HB: u = &a->heartbeat_ms; break;
        case O_TO: u = &a->timeout_ms; break;
        case O_LAST: u = &a->last_epoch; break;
        case O_EPOCH: u = &a->epoch; break;
        case O_SEQ: u = &a->seq; break;
        case O_TIME: u = &a->time_ms; break;
        case O_REPEAT: u = &a->repeat; break;
        case O_VERSION: u = &a->version; break;
        case O_LOST:
            if (a->n_lost == sizeof(a->lost) / sizeof(a->lost[0]))
                return opt_usage(PROG, "at most 32 --lost-peer");
            a->lost[a->n_lost++] = optarg;
            break;
        case O_OFFSET: {
            char *end;
            errno = 0;
            a->time_offset_ms = strtoll(optarg, &end, 10);
            if (errno || *end || end == optarg)
                return opt_usage(PROG, "bad --time-offset-ms \"%s\"", optarg);
            break;
        }
        case O_WATCH:
            if (opt_duration_ms(optarg, 600000, &a->watch_ms) < 0)
                return opt_usage(PROG, "bad --watch-for \"%s\"", optarg);
            break;
        case 'h':
            fputs(usage, stdout);
            exit(0);
        default:
            return OPT_EXIT_USAGE;
        }
        if (u && opt_uint(optarg, 0, UINT64_MAX, u) < 0)
            return opt_usage(PROG, "bad number \"%s\"", optarg);
    }
    if (!a->broker || !a->cohort)
        return opt_usage(PROG, "--broker and --cohort are required");
    if (a->repeat < 1 || a->repeat > 100000)
        return opt_usage(PROG, "--repeat takes 1 to 100000");
    if (a->version > UINT32_MAX)
        return opt_usage(PROG, "--protocol-version takes a 32-bit number");
    return 0;
}

/* Fills the request for a->method into the caller's storage. */
static ProtobufCMessage *build(struct args *a, Cohort__V1__JoinRequest *j,
                               Cohort__V1__HeartbeatRequest *h, Cohort__V1__LeaveRequest *l,
                               Cohort__V1__WatchRequest *w, Cohort__V1__StatusRequest *s,
                               Cohort__V1__Proof ***proof)
{
    if (strcmp(a->method, "join") == 0) {
        *j = (Cohort__V1__JoinRequest)COHORT__V1__JOIN_REQUEST__INIT;
        j->protocol_version = (uint32_t)a->version;
        j->cohort = (char *)a->cohort;
        j->id = (char *)a->id;
        j->address = (char *)a->address;
        j->model_version = a->model_version;
        j->session = a->session;
        j->heartbeat_ms = (uint32_t)a->heartbeat_ms;
        j->timeout_ms = (uint32_t)a->timeout_ms;
        j->last_epoch = a->last_epoch;
        *proof = &j->proof;
        return &j->base;
    }
    if (strcmp(a->method, "heartbeat") == 0 || strcmp(a->method, "heartbeat-v1") == 0) {
        *h = (Cohort__V1__HeartbeatRequest)COHORT__V1__HEARTBEAT_REQUEST__INIT;
        h->protocol_version = (uint32_t)a->version;
        h->cohort = (char *)a->cohort;
        h->id = (char *)a->id;
        h->session = a->session;
        h->model_version = a->model_version;
        h->epoch = a->epoch;
        h->n_lost_peers = a->n_lost;
        h->lost_peers = a->lost;
        *proof = &h->proof;
        return &h->base;
    }
    if (strcmp(a->method, "leave") == 0) {
        *l = (Cohort__V1__LeaveRequest)COHORT__V1__LEAVE_REQUEST__INIT;
        l->protocol_version = (uint32_t)a->version;
        l->cohort = (char *)a->cohort;
        l->id = (char *)a->id;
        l->session = a->session;
        *proof = &l->proof;
        return &l->base;
    }
    if (strcmp(a->method, "watch") == 0) {
        *w = (Cohort__V1__WatchRequest)COHORT__V1__WATCH_REQUEST__INIT;
        w->protocol_version = (uint32_t)a->version;
        w->cohort = (char *)a->cohort;
        w->id = (char *)a->id;
        w->session = a->session;
        *proof = &w->proof;
        return &w->base;
    }
    if (strcmp(a->method, "status") == 0) {
        *s = (Cohort__V1__StatusRequest)COHORT__V1__STATUS_REQUEST__INIT;
        s->protocol_version = (uint32_t)a->version;
        s->cohort = (char *)a->cohort;
        *proof = &s->proof;
        return &s->base;
    }
    return NULL;
}

/* Waits until the watch got a message or ended, or `ms` passed. */
static void wait_first(struct watched *w, uint64_t ms)
{
    struct timespec until = clock_deadline((uint32_t)ms);

    pthread_mutex_lock(&w->lock);
    while (!w->ended && w->msgs == 0 && pthread_cond_timedwait(&w->cond, &w->lock, &until) == 0)
        ;
    pthread_mutex_unlock(&w->lock);
}

/* Protocol 1's Watch, or a Session stream carrying `repeat` copies of
 * heartbeat `req`. */
static int watch(struct rpc_channel *ch, const ProtobufCMessage *req, bool session,
                 uint64_t repeat, uint64_t watch_ms)
{
    struct watched w = { .lock = PTHREAD_MUTEX_INITIALIZER };
    struct rpc_watch *rw;
    struct rpc_status st = { .code = RPC_OK };
    struct timespec until;
    uint64_t sent = 1, give_up = clock_now_ms() + 30000;
    char extra[128];
    int rc;

    clock_cond_init(&w.cond);
    rc = session ? rpc_watch_open(ch, WIRE_BROKER_SESSION, req,
                                  &cohort__v1__session_reply__descriptor, RPC_DUPLEX, on_msg, on_end,
                                  &w, &rw)
                 : rpc_watch_open(ch, WIRE_BROKER_WATCH, req, &cohort__v1__epoch__descriptor, 0,
                                  on_msg, on_end, &w, &rw);
    if (rc < 0) {
        st.code = rpc_code_from_errno(rc);
        return outcome(&st, NULL);
    }
    /* Each copy, and then the clean close, waits for the message before
     * it to go out. */
    while (session && sent <= repeat) {
        rc = sent < repeat ? rpc_watch_send(rw, req) : rpc_watch_done_sending(rw);
        if (rc == -EBUSY && clock_now_ms() < give_up) {
            struct timespec ms = { 0, 1000000 };
            nanosleep(&ms, NULL);
            continue;
        }
        if (rc < 0)
            break;
        sent++;
    }
    wait_first(&w, session ? 30000 : watch_ms);
    if (session && sent > repeat) {
        /* The broker ends a stream closed cleanly; wait for that, so the
         * outcome is the broker's last word on every copy. */
        pthread_mutex_lock(&w.lock);
        until = clock_deadline(30000);
        while (!w.ended && pthread_cond_timedwait(&w.cond, &w.lock, &until) == 0)
            ;
        pthread_mutex_unlock(&w.lock);
    }
    pthread_mutex_lock(&w.lock);
    if (w.ended)
        st = w.st;
    snprintf(extra, sizeof(extra), ",\"epochs\":%u,\"epoch\":%" PRIu64 ",\"sent\":%" PRIu64,
             w.epochs, w.last, sent > repeat ? repeat : sent);
    pthread_mutex_unlock(&w.lock);
    rpc_watch_close(rw);
    return outcome(&st, extra);
}

int main(int argc, char **argv)
{
    struct args a;
    Cohort__V1__JoinRequest j;
    Cohort__V1__HeartbeatRequest h;
    Cohort__V1__LeaveRequest l;
    Cohort__V1__WatchRequest w;
    Cohort__V1__StatusRequest s;
    Cohort__V1__Proof pf, **slot = NULL;
    const ProtobufCMessageDescriptor *reply_desc;
    ProtobufCMessage *req, *reply = NULL;
    struct rpc_channel_opts co = { 0 };
    struct rpc_channel *ch = NULL;
    struct rpc_status st;
    uint8_t mac[SECRET_MAC_BYTES];
    char extra[256] = "", *ca = NULL;
    const char *path;
    uint64_t failed = 0;
    int rc, status;

    rc = parse(argc, argv, &a);
    if (rc)
        return rc;
    req = build(&a, &j, &h, &l, &w, &s, &slot);
    if (!req)
        return opt_usage(PROG, "unknown method \"%s\"", a.method);
    if (a.secret_file) {
        struct secret k;
        uint64_t t = a.time_ms ? a.time_ms : proof_now_ms() + (uint64_t)a.time_offset_ms;

        if ((rc = secret_load(a.secret_file, &k)) < 0)
            return opt_usage(PROG, "cannot read --secret-file: %s", strerror(-rc));
        if (proof_sign(&k, req, a.seq, t, &pf, mac) < 0)
            return 1;
        *slot = &pf;
        secret_wipe(&k);
    }
    if (a.ca_file && (rc = rpc_pem_load(a.ca_file, &ca)) < 0)
        return opt_usage(PROG, "cannot read --broker-ca: %s", strerror(-rc));
    co.tls_ca_pem = ca;
    co.tls_server_name = a.server_name;
    if (rpc_init() < 0 || rpc_channel_create(a.broker, &co, &ch) < 0)
        return 1;
    if (strcmp(a.method, "watch") == 0 || strcmp(a.method, "heartbeat") == 0) {
        status = watch(ch, req, strcmp(a.method, "heartbeat") == 0, a.repeat, a.watch_ms);
        goto out;
    }
    path = strcmp(a.method, "join") == 0        ? WIRE_BROKER_JOIN
           : strcmp(a.method, "heartbeat-v1") == 0 ? WIRE_BROKER_HEARTBEAT
           : strcmp(a.method, "leave") == 0     ? WIRE_BROKER_LEAVE
                                                : WIRE_BROKER_STATUS;
    reply_desc = strcmp(a.method, "join") == 0        ? &cohort__v1__join_reply__descriptor
                 : strcmp(a.method, "heartbeat-v1") == 0 ? &cohort__v1__heartbeat_reply__descriptor
                 : strcmp(a.method, "leave") == 0     ? &cohort__v1__leave_reply__descriptor
                                                      : &cohort__v1__status_reply__descriptor;
    for (uint64_t i = 0; i < a.repeat; i++) {
        if (reply)
            protobuf_c_message_free_unpacked(reply, NULL);
        reply = NULL;
        rc = rpc_call(ch, path, req, reply_desc, 30000, 0, &reply, &st);
        failed += rc < 0;
    }
    if (rc == 0) {
        st.code = RPC_OK;
        st.message[0] = '\0';
        if (reply_desc == &cohort__v1__join_reply__descriptor) {
            const Cohort__V1__JoinReply *r = (const Cohort__V1__JoinReply *)reply;
            snprintf(extra, sizeof(extra), ",\"heartbeat_ms\":%u,\"timeout_ms\":%u,\"epoch\":%" PRIu64,
                     r->heartbeat_ms, r->timeout_ms, r->epoch);
        } else if (reply_desc == &cohort__v1__status_reply__descriptor) {
            const Cohort__V1__StatusReply *r = (const Cohort__V1__StatusReply *)reply;
            snprintf(extra, sizeof(extra), ",\"cohorts\":%zu", r->n_cohorts);
        } else if (reply_desc == &cohort__v1__heartbeat_reply__descriptor) {
            const Cohort__V1__HeartbeatReply *r = (const Cohort__V1__HeartbeatReply *)reply;
            snprintf(extra, sizeof(extra), ",\"epoch\":%" PRIu64, r->epoch);
        }
        protobuf_c_message_free_unpacked(reply, NULL);
    }
    snprintf(extra + strlen(extra), sizeof(extra) - strlen(extra), ",\"failed\":%" PRIu64, failed);
    status = outcome(&st, extra);
out:
    rpc_channel_destroy(ch);
    rpc_shutdown();
    rpc_pem_free(ca);
    return status;
}

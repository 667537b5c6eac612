/* src/membership/brokerd.c: see brokerd.h.
 *
 * Who may do what. Every request names a cohort, and the cohort's key is
 * the one set with brokerd_set_key, else the config's `key`. When there is
 * one, the request must carry a proof of it (wire.h: an HMAC-SHA256 over
 * the method, the cohort, the member's id and session, the proof's seq and
 * time and the request's fields), checked here before the broker's lock
 * is taken for anything but reading the key: a request that proves
 * nothing changes nothing. Without a key the cohort is refused, unless
 * the broker runs `open`, which serves such cohorts as before keys
 * existed. Status of one cohort takes its key or the admin key; Status of
 * every cohort takes the admin key (or, on an open broker with no keys at
 * all, nothing).
 *
 * Replay is bounded by wire.h's rules: a verified proof's seq is accepted
 * once per member session (broker_accept_seq for every heartbeat up a
 * Session stream and for Leave, and inside broker_join for a rejoin); a Join's or a Status's time
 * must be within WIRE_PROOF_SKEW_MS of this host's wall clock, which is
 * the clock-skew assumption; and the state machine remembers the sessions
 * that left or were evicted (broker.h, BROKER_RETIRED_MAX and
 * BROKER_RETIRED_KEEP_MS), so a captured Join cannot bring back a member
 * that left. Every refusal is UNAUTHENTICATED with a message saying why,
 * and a warn line. Refusal lines, of proofs or anything else, go out at
 * most LOG_PER_S a second, so that a stranger's flood does not flood the
 * log; the next line that goes out counts the ones held back.
 */
#include "membership/brokerd.h"

#include "base/secret.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "base/clock.h"
#include "cohort.pb-c.h"
#include "membership/dgram.h"
#include "membership/epoch.h"
#include "base/ident.h"
#include "base/log.h"
#include "membership/matchmaker.h"
#include "membership/proof.h"
#include "rpc/rpc.h"
#include "membership/wire.h"

#define LOG_PER_S 10
/* How far a Session stream's heartbeats may run ahead of their granted
 * pace: a heartbeat "costs" a quarter of the member's interval, and a
 * stream may owe at most this many. A member sends one per interval, and
 * one more at once for a declared version or a lost or unreachable peer
 * report; a stream that sends far faster is ended, so a member cannot
 * make the broker check proofs at any rate it likes. */
#define SESSION_BEAT_BURST 16u

/* One cohort's own key (brokerd_set_key). */
struct cohort_key {
    char cohort[IDENT_NAME_MAX + 1];
    struct secret key;
};

struct brokerd {
    pthread_mutex_t lock;           /* guards b, keys and every watcher's attached */
    pthread_cond_t wake;
    struct broker *b;
    struct rpc_server *srv;
    pthread_t ticker;
    bool stopping;
    struct cohort_key *keys;        /* n_keys of them, unordered */
    size_t n_keys, max_keys;        /* at most one per cohort the broker may hold */
    struct secret key, admin_key;   /* the config's, when has_key / has_admin */
    bool has_key, has_admin, open;  /* set at start, read-only after */
    pthread_mutex_t log_lock;       /* guards the refusal log's rate */
    uint64_t log_second;            /* the second the count is for */
    unsigned log_count;             /* lines logged in it */
    uint64_t log_held;              /* lines held back since the last one */
    /* Matchmaking (matchmaker.h), under its own lock and thread so that
     * groups never wait on the membership's. */
    pthread_mutex_t mm_lock;        /* guards mm and every mm_call's answered */
    pthread_cond_t mm_wake;
    struct matchmaker *mm;
    pthread_t mm_thread;
    bool mm_stopping;
    /* Datagram heartbeats (wire.h): the UDP sockets on the broker's port,
     * none when they are off, and the thread that reads them, which an
     * eventfd stops. Set at start, read-only after. */
    int dg_fds[DGRAM_LISTEN_MAX];
    int n_dg;
    int dg_stop_fd;
    bool dg_deaf;
    pthread_t dg_thread;
    /* What became of the datagrams (brokerd_datagrams). */
    _Atomic uint64_t dg_count[BROKERD_DG_KINDS];
};

/* One Matchmake call while it waits for its group. Freed when the stream
 * closes. */
struct mm_call {
    struct brokerd *d;
    struct rpc_stream *s;
    bool answered;                  /* the matchmaker no longer holds it */
    char cohort[IDENT_NAME_MAX + 1];
    char id[IDENT_NAME_MAX + 1];
    uint64_t session;
};

/* One member's Session stream (protocol 2: heartbeats up, epochs and
 * acknowledgements down), as the broker knows it. Freed when the stream
 * closes; `attached` says whether the broker still holds it. */
struct watcher {
    struct brokerd *d;
    struct rpc_stream *s;
    bool attached;
    char cohort[IDENT_NAME_MAX + 1];
    char id[IDENT_NAME_MAX + 1];
    uint64_t session;
    /* Under the brokerd's lock: when the last acknowledgement went out,
     * and what it said; whether a datagram was acknowledged, and what the
     * last such said (dg_one). */
    uint64_t acked_at;
    bool told_drained, dg_told_drained, dg_acked;
    /* Written once, under the lock, when the stream attaches. */
    uint64_t beat_cost_ms;      /* a quarter of the granted heartbeat */
    /* The pace's clocks: when the heartbeats sent would be paid. The
     * stream's is read and written only by its heartbeats, which come one
     * at a time; the datagrams' only under the lock. */
    uint64_t beat_due, dg_due;
};

/* ---- refusals ---------------------------------------------------------- */

/* Whether a refusal's log line may go out: at most LOG_PER_S a second,
 * since strangers choose how many requests they send. A line held back is
 * counted in *held of the next one that goes out. */
static bool log_allowed(struct brokerd *d, uint64_t *held)
{
    uint64_t now = clock_now_ms() / 1000;
    bool ok = false;

    pthread_mutex_lock(&d->log_lock);
    if (now != d->log_second) {
        d->log_second = now;
        d->log_count = 0;
    }
    if (d->log_count < LOG_PER_S) {
        d->log_count++;
        *held = d->log_held;
        d->log_held = 0;
        ok = true;
    } else {
        d->log_held++;
    }
    pthread_mutex_unlock(&d->log_lock);
    return ok;
}

/* One warn line for a refused request (rate-limited, log_allowed). */
static void log_refusal(struct brokerd *d, const char *method, const char *cohort,
                        const char *id, enum rpc_code code, const char *why)
{
    uint64_t held = 0;

    if (log_allowed(d, &held))
        log_warn("broker", "A request was refused.", LF_S("method", method),
                 LF_S("cohort", cohort), LF_S("id", id), LF_S("code", rpc_code_name(code)),
                 LF_S("reason", why), LF_U("held_back", held));
}

static void refuse(struct brokerd *d, struct rpc_reply *r, const char *method,
                   const char *cohort, const char *id, enum rpc_code code, const char *why)
{
    log_refusal(d, method, cohort, id, code, why);
    rpc_reply_error(r, code, "%s", why);
}

/* The one check of the protocol version, for every method and every
 * message of a stream: true when `version` is the one this broker speaks
 * (wire.h); otherwise fills `why` for a FAILED_PRECONDITION. */
static bool version_ok(uint32_t version, char *why, size_t len)
{
    if (version == WIRE_PROTOCOL_VERSION)
        return true;
    snprintf(why, len, "protocol version %u is not supported; this broker speaks %u (upgrade "
             "every member with the broker: suspend, upgrade, resume)",
             version, WIRE_PROTOCOL_VERSION);
    return false;
}

/* Checks what every request shares. Returns false after refusing. */
static bool check_common(struct brokerd *d, struct rpc_reply *r, const char *method,
                         uint32_t version, const char *cohort, const char *id, bool need_id)
{
    char why[RPC_MESSAGE_MAX];

    if (!version_ok(version, why, sizeof(why))) {
        refuse(d, r, method, cohort, id, RPC_FAILED_PRECONDITION, why);
        return false;
    }
    if (!ident_valid_cohort(cohort)) {
        snprintf(why, sizeof(why), "invalid cohort name \"%.64s\"", cohort);
        refuse(d, r, method, cohort, id, RPC_INVALID_ARGUMENT, why);
        return false;
    }
    if (need_id && !ident_valid_member_id(id)) {
        snprintf(why, sizeof(why), "invalid member id \"%.64s\"", id);
        refuse(d, r, method, cohort, id, RPC_INVALID_ARGUMENT, why);
        return false;
    }
    return true;
}

static void refuse_errno(struct brokerd *d, struct rpc_reply *r, const char *method,
                         const char *cohort, const char *id, int err)
{
    char why[RPC_MESSAGE_MAX];

    switch (err) {
    case -ENOENT:
        if (id)
            snprintf(why, sizeof(why),
                     "no member \"%.64s\" with this session in cohort \"%.64s\" "
                     "(unknown cohort, evicted, or never joined)", id, cohort);
        else
            snprintf(why, sizeof(why), "unknown cohort \"%.64s\"", cohort);
        break;
    case -EEXIST:
        snprintf(why, sizeof(why),
                 "member id \"%.64s\" is held by a live member of cohort \"%.64s\" with another session",
                 id, cohort);
        break;
    case -ENOSPC:
        snprintf(why, sizeof(why), "cohort \"%.64s\" or the broker is full", cohort);
        break;
    case -EINVAL:
        snprintf(why, sizeof(why), "invalid request: check the address, session and timeouts");
        break;
    default:
        snprintf(why, sizeof(why), "%s", log_strerror(err));
        break;
    }
    refuse(d, r, method, cohort, id, rpc_code_from_errno(err), why);
}

static void refuse_auth(struct brokerd *d, struct rpc_reply *r, const char *method,
                        const char *cohort, const char *id, const char *why)
{
    refuse(d, r, method, cohort, id, RPC_UNAUTHENTICATED, why);
}

/* ---- proofs ------------------------------------------------------------ */

/* Copies the key cohort `cohort`'s requests must prove into *out: its
 * own (brokerd_set_key), else the config's. Returns false when there is
 * none. */
static bool key_for(struct brokerd *d, const char *cohort, struct secret *out)
{
    bool found = false;

    pthread_mutex_lock(&d->lock);
    for (size_t i = 0; i < d->n_keys && !found; i++) {
        if (strcmp(d->keys[i].cohort, cohort) == 0) {
            *out = d->keys[i].key;
            found = true;
        }
    }
    if (!found && d->has_key) {
        *out = d->key;
        found = true;
    }
    pthread_mutex_unlock(&d->lock);
    return found;
}

/* Whether the broker holds no key at all, so that an open broker may
 * show every cohort to anyone. */
static bool keyless(struct brokerd *d)
{
    bool none;

    pthread_mutex_lock(&d->lock);
    none = d->n_keys == 0 && !d->has_key && !d->has_admin;
    pthread_mutex_unlock(&d->lock);
    return none;
}

/* Whether a proof's time is within WIRE_PROOF_SKEW_MS of this host's
 * clock; otherwise says how far off it is. */
static bool in_time(const Cohort__V1__Proof *p, char *why, size_t len)
{
    uint64_t now = proof_now_ms();
    uint64_t off = now > p->time_ms ? now - p->time_ms : p->time_ms - now;

    if (off <= WIRE_PROOF_SKEW_MS)
        return true;
    snprintf(why, len,
             "the proof's time is %llu s %s the broker's clock; clocks must agree within %u s",
             (unsigned long long)(off / 1000), now > p->time_ms ? "behind" : "ahead of",
             WIRE_PROOF_SKEW_MS / 1000);
    return false;
}

/* Checks the proof of a member's request for `cohort`. Returns 1 when it
 * proves the cohort's key (its seq is then the caller's to accept), 0
 * when the cohort needs no proof (open, and no key for it), or -EPERM
 * with `why` filled. With `timed`, the proof's time is judged too. */
static int authenticate(struct brokerd *d, const ProtobufCMessage *req,
                        const Cohort__V1__Proof *p, const char *cohort, bool timed, char *why,
                        size_t len)
{
    struct secret k;
    int rc = -EPERM;

    if (!key_for(d, cohort, &k)) {
        if (d->open)
            return 0;
        snprintf(why, len, "this broker has no key for cohort \"%.64s\" and serves no cohort "
                 "without one", cohort);
        return -EPERM;
    }
    if (!p || p->mac.len == 0)
        snprintf(why, len, "the request proves no key for cohort \"%.64s\"", cohort);
    else if (!proof_valid(&k, req, p))
        snprintf(why, len, "the request proves a wrong key for cohort \"%.64s\"", cohort);
    else if (p->seq == 0)
        snprintf(why, len, "the proof's seq must be nonzero");
    else if (!timed || in_time(p, why, len))
        rc = 1;
    secret_wipe(&k);
    return rc;
}

static const char replayed[] =
    "the proof was already used, or its session has left the cohort (a replayed request)";

/* ---- handlers ---------------------------------------------------------- */

static void on_join(void *arg, const ProtobufCMessage *req, struct rpc_reply *r)
{
    const Cohort__V1__JoinRequest *q = (const Cohort__V1__JoinRequest *)req;
    Cohort__V1__JoinReply rep = COHORT__V1__JOIN_REPLY__INIT;
    struct brokerd *d = arg;
    struct broker_join_result res;
    struct broker_join j = {
        .cohort = q->cohort, .id = q->id, .address = q->address,
        .model_version = q->model_version, .session = q->session, .last_epoch = q->last_epoch,
        .heartbeat_ms = q->heartbeat_ms, .timeout_ms = q->timeout_ms,
    };
    char why[RPC_MESSAGE_MAX];
    int rc;

    if (!check_common(d, r, "Join", q->protocol_version, q->cohort, q->id, true))
        return;
    if (!ident_valid_address(q->address)) {
        refuse(d, r, "Join", q->cohort, q->id, RPC_INVALID_ARGUMENT,
               "invalid data address: want host:port with a port from 1 to 65535");
        return;
    }
    if (q->session == 0) {
        refuse(d, r, "Join", q->cohort, q->id, RPC_INVALID_ARGUMENT, "session must be nonzero");
        return;
    }
    rc = authenticate(d, req, q->proof, q->cohort, true, why, sizeof(why));
    if (rc < 0) {
        refuse_auth(d, r, "Join", q->cohort, q->id, why);
        return;
    }
    j.seq = rc == 1 ? q->proof->seq : 0;
    pthread_mutex_lock(&d->lock);
    rc = broker_join(d->b, clock_now_ms(), &j, &res);
    pthread_mutex_unlock(&d->lock);
    if (rc == -EALREADY) {
        refuse_auth(d, r, "Join", q->cohort, q->id, replayed);
        return;
    }
    if (rc == -EAGAIN) {
        snprintf(why, sizeof(why),
                 "member \"%.64s\" was evicted as unreachable by most of its epoch; it may "
                 "rejoin in %llu ms", q->id, (unsigned long long)res.benched_ms);
        refuse(d, r, "Join", q->cohort, q->id, RPC_UNAVAILABLE, why);
        return;
    }
    if (rc < 0) {
        refuse_errno(d, r, "Join", q->cohort, rc == -ENOENT ? NULL : q->id, rc);
        return;
    }
    /* The new member may make an epoch due sooner than the ticker sleeps. */
    pthread_cond_signal(&d->wake);
    log_debug("broker", "Member joined.", LF_S("cohort", q->cohort), LF_S("id", q->id),
              LF_S("address", q->address), LF_U("model_version", q->model_version),
              LF_U("heartbeat_ms", res.heartbeat_ms), LF_U("timeout_ms", res.timeout_ms),
              LF_B("proved", j.seq != 0));
    rep.heartbeat_ms = res.heartbeat_ms;
    rep.timeout_ms = res.timeout_ms;
    rep.epoch = res.epoch;
    rep.weighs_unreachable = true;
    rep.unreachable_max = WIRE_UNREACHABLE_MAX;
    rep.takes_datagrams = d->n_dg > 0 && j.seq != 0;
    rpc_reply_ok(r, &rep.base);
}

/* A list of peers a heartbeat reports: at most `max` valid member ids.
 * Otherwise fills `why`. */
static bool peers_valid(const char *what, char *const *peers, size_t n, size_t max, char *why,
                        size_t len)
{
    if (n > max) {
        snprintf(why, len, "a heartbeat reports at most %zu %s peers, not %zu", max, what, n);
        return false;
    }
    for (size_t i = 0; i < n; i++) {
        if (!ident_valid_member_id(peers[i])) {
            snprintf(why, len, "invalid member id \"%.64s\" among the %s peers",
                     peers[i] ? peers[i] : "", what);
            return false;
        }
    }
    return true;
}

/* A heartbeat's lost_peers and unreachable_peers: at most
 * WIRE_LOST_PEERS_MAX and the WIRE_UNREACHABLE_MAX this broker's
 * JoinReply announces. */
static bool lost_peers_valid(const Cohort__V1__HeartbeatRequest *q, char *why, size_t len)
{
    return peers_valid("lost", q->lost_peers, q->n_lost_peers, WIRE_LOST_PEERS_MAX, why, len) &&
           peers_valid("unreachable", q->unreachable_peers, q->n_unreachable_peers,
                       WIRE_UNREACHABLE_MAX, why, len);
}

/* Protocol 1's unary Heartbeat and its Watch: heartbeats ride the Session
 * stream now, so an older member is told so, whatever version it names. */
static void v1_refusal(const char *method, uint32_t version, char *why, size_t len)
{
    if (version_ok(version, why, len))
        snprintf(why, len, "%s is protocol 1's; in protocol %u heartbeats and epochs ride "
                 "the Session stream", method, WIRE_PROTOCOL_VERSION);
}

static void on_heartbeat_v1(void *arg, const ProtobufCMessage *req, struct rpc_reply *r)
{
    const Cohort__V1__HeartbeatRequest *q = (const Cohort__V1__HeartbeatRequest *)req;
    char why[RPC_MESSAGE_MAX];

    v1_refusal("Heartbeat", q->protocol_version, why, sizeof(why));
    refuse(arg, r, "Heartbeat", q->cohort, q->id, RPC_FAILED_PRECONDITION, why);
}

static void on_watch_v1(void *arg, const ProtobufCMessage *req, struct rpc_stream *s)
{
    const Cohort__V1__WatchRequest *q = (const Cohort__V1__WatchRequest *)req;
    char why[RPC_MESSAGE_MAX];

    v1_refusal("Watch", q->protocol_version, why, sizeof(why));
    log_refusal(arg, "Watch", q->cohort, q->id, RPC_FAILED_PRECONDITION, why);
    rpc_stream_finish(s, RPC_FAILED_PRECONDITION, why);
    rpc_stream_unref(s);
}

static void on_leave(void *arg, const ProtobufCMessage *req, struct rpc_reply *r)
{
    const Cohort__V1__LeaveRequest *q = (const Cohort__V1__LeaveRequest *)req;
    Cohort__V1__LeaveReply rep = COHORT__V1__LEAVE_REPLY__INIT;
    struct brokerd *d = arg;
    char why[RPC_MESSAGE_MAX];
    int rc, proved;

    if (!check_common(d, r, "Leave", q->protocol_version, q->cohort, q->id, true))
        return;
    proved = authenticate(d, req, q->proof, q->cohort, false, why, sizeof(why));
    if (proved < 0) {
        refuse_auth(d, r, "Leave", q->cohort, q->id, why);
        return;
    }
    pthread_mutex_lock(&d->lock);
    rc = proved ? broker_accept_seq(d->b, q->cohort, q->id, q->session, q->proof->seq) : 0;
    if (rc == 0)
        rc = broker_leave(d->b, clock_now_ms(), q->cohort, q->id, q->session);
    pthread_mutex_unlock(&d->lock);
    if (rc == -EALREADY) {
        refuse_auth(d, r, "Leave", q->cohort, q->id, replayed);
        return;
    }
    if (rc < 0) {
        refuse_errno(d, r, "Leave", q->cohort, q->id, rc);
        return;
    }
    pthread_cond_signal(&d->wake);
    log_info("broker", "Member left.", LF_S("cohort", q->cohort), LF_S("id", q->id));
    rpc_reply_ok(r, &rep.base);
}

static void watcher_closed(void *arg, struct rpc_stream *s)
{
    struct watcher *w = arg;
    struct brokerd *d = w->d;
    uint64_t held = 0;
    bool lost = false;

    pthread_mutex_lock(&d->lock);
    /* Attached and not finished by us: the member's end went away without
     * a Leave. Most often its process died (the kernel reset or closed its
     * connection); the state machine gives it a short grace to reconnect. */
    if (w->attached && rpc_stream_cancelled(s) && !d->stopping)
        lost = broker_stream_lost(d->b, clock_now_ms(), w->cohort, w->id, w) == 0;
    else if (w->attached)
        broker_unwatch(d->b, w->cohort, w->id, w);
    w->attached = false;
    if (lost)
        pthread_cond_signal(&d->wake);     /* an earlier deadline */
    pthread_mutex_unlock(&d->lock);
    /* Rate-limited: a member can open and drop proved watches at will. */
    if (lost && log_allowed(d, &held))
        log_info("broker", "A member's stream was cut without a Leave; it is out unless it "
                 "comes back within the grace.", LF_S("cohort", w->cohort), LF_S("id", w->id),
                 LF_U("held_back", held));
    rpc_stream_unref(w->s);
    free(w);
}

/* What a heartbeat, up a stream or as a datagram, reports of checkpoints. */
static struct broker_checkpoint checkpoint_of(uint64_t version,
                                              const Cohort__V1__CheckpointSkipped *skipped)
{
    return (struct broker_checkpoint){ .version = version,
                                       .skipped_version = skipped ? skipped->version : 0,
                                       .skipped_reason = skipped ? skipped->reason : 0 };
}

/* Ends a session stream with a refusal: the refused heartbeat changed
 * nothing, and the member's membership is untouched (a stream the broker
 * ends is not a death; the member reopens or times out). */
static void session_refuse(struct brokerd *d, struct rpc_stream *s, const char *cohort,
                           const char *id, enum rpc_code code, const char *why)
{
    log_refusal(d, "Session", cohort, id, code, why);
    rpc_stream_finish(s, code, why);
}

/* Queues a SessionReply with a HeartbeatReply. It never replaces an epoch
 * waiting to go out (that epoch is a sign of life too). Returns 0, -EBUSY
 * (an epoch waits), -EPIPE (the stream is over) or -ENOMEM. */
static int session_ack(struct rpc_stream *s, const struct broker_beat_result *res)
{
    Cohort__V1__SessionReply rep = COHORT__V1__SESSION_REPLY__INIT;
    Cohort__V1__HeartbeatReply beat = COHORT__V1__HEARTBEAT_REPLY__INIT;
    struct rpc_buf *buf = NULL;
    int rc;

    beat.epoch = res->epoch;
    beat.drained = res->drained;
    rep.beat = &beat;
    rc = rpc_buf_pack(&rep.base, &buf);
    if (rc < 0)
        return rc;
    rc = rpc_stream_offer(s, buf, false);
    rpc_buf_unref(buf);
    return rc;
}

/* One heartbeat up a session stream, the first (which attaches the
 * stream to its member session) or a later one: checked, then applied.
 * Runs on a completion thread, one message of a stream at a time, so the
 * watcher's own fields need no lock. Returns 0, or -EPIPE once it has
 * ended the stream (a refusal: the code says why). */
static int session_beat(struct watcher *w, const Cohort__V1__HeartbeatRequest *q, bool first)
{
    struct brokerd *d = w->d;
    struct broker_beat beat = {
        .model_version = q->model_version, .declare = q->declare_version, .adopted = q->epoch,
        .ckpt = checkpoint_of(q->checkpoint_version, q->checkpoint_skipped),
    };
    struct broker_beat_result res = { 0 };
    char why[RPC_MESSAGE_MAX];
    uint64_t held = 0, now;
    size_t reported = 0, unreachable = 0;
    bool attached, ack;
    int rc, proved;

    if (!version_ok(q->protocol_version, why, sizeof(why))) {
        session_refuse(d, w->s, q->cohort, q->id, RPC_FAILED_PRECONDITION, why);
        return -EPIPE;
    }
    if (first && (!ident_valid_cohort(q->cohort) || !ident_valid_member_id(q->id))) {
        snprintf(why, sizeof(why), "invalid cohort name \"%.64s\" or member id \"%.64s\"",
                 q->cohort, q->id);
        session_refuse(d, w->s, q->cohort, q->id, RPC_INVALID_ARGUMENT, why);
        return -EPIPE;
    }
    if (!first && (strcmp(q->cohort, w->cohort) != 0 || strcmp(q->id, w->id) != 0 ||
                   q->session != w->session)) {
        session_refuse(d, w->s, q->cohort, q->id, RPC_INVALID_ARGUMENT,
                       "a session stream carries the heartbeats of the member session that "
                       "opened it only");
        return -EPIPE;
    }
    if (!lost_peers_valid(q, why, sizeof(why))) {
        session_refuse(d, w->s, q->cohort, q->id, RPC_INVALID_ARGUMENT, why);
        return -EPIPE;
    }
    /* Paced before the proof is checked, which is the costly part. */
    if (!first) {
        uint64_t t = clock_now_ms(), due = (w->beat_due > t ? w->beat_due : t) + w->beat_cost_ms;

        if (due > t + SESSION_BEAT_BURST * w->beat_cost_ms) {
            snprintf(why, sizeof(why), "heartbeats faster than 4 per heartbeat interval of %llu ms",
                     (unsigned long long)(w->beat_cost_ms * 4));
            session_refuse(d, w->s, q->cohort, q->id, RPC_RESOURCE_EXHAUSTED, why);
            return -EPIPE;
        }
        w->beat_due = due;
    }
    proved = authenticate(d, &q->base, q->proof, q->cohort, false, why, sizeof(why));
    if (proved < 0) {
        session_refuse(d, w->s, q->cohort, q->id, RPC_UNAUTHENTICATED, why);
        return -EPIPE;
    }
    pthread_mutex_lock(&d->lock);
    now = clock_now_ms();
    attached = w->attached;
    rc = proved ? broker_accept_seq(d->b, q->cohort, q->id, q->session, q->proof->seq) : 0;
    if (rc == 0 && (first || attached))
        rc = broker_heartbeat(d->b, now, q->cohort, q->id, q->session, &beat, &res);
    /* Attached after the heartbeat: the current epoch it sends at once
     * is then the one the reply names. */
    if (rc == 0 && first)
        rc = broker_watch(d->b, q->cohort, q->id, q->session, w);
    if (rc == 0 && first) {
        w->attached = attached = true;
        w->beat_cost_ms = res.heartbeat_ms / 4 ? res.heartbeat_ms / 4 : 1;
        w->beat_due = now;
    }
    /* Evidence only: broker.h says what a report can and cannot do. */
    for (size_t i = 0; rc == 0 && attached && i < q->n_lost_peers; i++)
        reported += broker_report_lost(d->b, now, q->cohort, q->id, q->session,
                                       q->lost_peers[i]) == 0;
    /* Counted only in the epoch the member says it runs in, which must
     * be the current one (broker.h). */
    for (size_t i = 0; rc == 0 && attached && i < q->n_unreachable_peers; i++)
        unreachable += broker_report_unreachable(d->b, now, q->cohort, q->id, q->session,
                                                 q->epoch, q->unreachable_peers[i]) == 0;
    /* A wakeup only when the heartbeat can change an epoch. */
    if (reported || unreachable || (rc == 0 && attached && q->declare_version))
        pthread_cond_signal(&d->wake);
    /* An acknowledgement costs a send, so most heartbeats get none: the
     * member needs one when something changed for it, and often enough to
     * know that its heartbeats arrive (at least every half timeout, since
     * the next heartbeat may come a whole interval later). */
    ack = rc == 0 && attached &&
          (first || q->declare_version || q->n_lost_peers || q->n_unreachable_peers ||
           res.drained != w->told_drained ||
           now + res.heartbeat_ms >= w->acked_at + res.timeout_ms / 2);
    if (ack && session_ack(w->s, &res) == 0) {
        w->acked_at = now;
        w->told_drained = res.drained;
    }
    pthread_mutex_unlock(&d->lock);
    if (reported && log_allowed(d, &held))
        log_info("broker", "A member reported peers' data connections reset.",
                 LF_S("cohort", q->cohort), LF_S("id", q->id), LF_S("first", q->lost_peers[0]),
                 LF_U("peers", q->n_lost_peers), LF_U("held_back", held));
    if (q->n_unreachable_peers && rc == 0 && attached && log_allowed(d, &held))
        log_info("broker", "A member reported peers unreachable.", LF_S("cohort", q->cohort),
                 LF_S("id", q->id), LF_U("epoch", q->epoch),
                 LF_S("first", q->unreachable_peers[0]), LF_U("peers", q->n_unreachable_peers),
                 LF_U("counted", unreachable), LF_U("held_back", held));
    if (rc == -EALREADY) {
        session_refuse(d, w->s, q->cohort, q->id, RPC_UNAUTHENTICATED, replayed);
        return -EPIPE;
    }
    if (rc < 0) {
        /* Routine after an eviction or a restart: the member rejoins. */
        snprintf(why, sizeof(why),
                 "no member \"%.64s\" with this session in cohort \"%.64s\" "
                 "(unknown cohort, evicted, or never joined)", q->id, q->cohort);
        if (log_allowed(d, &held))
            log_info("broker", "A session stream named no member; it must rejoin.",
                     LF_S("cohort", q->cohort), LF_S("id", q->id), LF_U("held_back", held));
        rpc_stream_finish(w->s, rpc_code_from_errno(rc), why);
        return -EPIPE;
    }
    return 0;
}

static void session_msg(void *arg, struct rpc_stream *s, const ProtobufCMessage *msg)
{
    /* The member closed its side: a clean end, not a death. The stream
     * is finished by the broker, so watcher_closed only detaches it, and
     * the member stays until it leaves or falls silent past its timeout. */
    if (!msg) {
        rpc_stream_finish(s, RPC_OK, "the member closed its side of the session stream");
        return;
    }
    session_beat(arg, (const Cohort__V1__HeartbeatRequest *)msg, false);
}

static void on_session(void *arg, const ProtobufCMessage *req, struct rpc_stream *s)
{
    const Cohort__V1__HeartbeatRequest *q = (const Cohort__V1__HeartbeatRequest *)req;
    struct brokerd *d = arg;
    struct watcher *w = calloc(1, sizeof(*w));

    if (!w) {
        rpc_stream_finish(s, RPC_RESOURCE_EXHAUSTED, "out of memory");
        rpc_stream_unref(s);
        return;
    }
    w->d = d;
    w->s = s;           /* the handler's reference, dropped in watcher_closed */
    snprintf(w->cohort, sizeof(w->cohort), "%s", q->cohort);
    snprintf(w->id, sizeof(w->id), "%s", q->id);
    w->session = q->session;
    if (session_beat(w, q, true) == 0)
        rpc_stream_on_message(s, session_msg, w);
    /* Registered last: if the stream is already over this runs at once
     * and frees the watcher (rpc runs it only after any message callback
     * has returned). It takes the lock itself. */
    rpc_stream_on_close(s, watcher_closed, w);
}

/* ---- datagram heartbeats (wire.h) -------------------------------------- */

static void dg_count(struct brokerd *d, enum brokerd_dg_kind k)
{
    atomic_fetch_add_explicit(&d->dg_count[k], 1, memory_order_relaxed);
}

/* Sends the acknowledgement of datagram `seq` to where it came from. */
static void dg_ack(struct brokerd *d, const Cohort__V1__HeartbeatDatagram *q,
                   const struct broker_beat_result *res, int fd,
                   const struct sockaddr_storage *to, socklen_t to_len)
{
    Cohort__V1__HeartbeatDatagramAck a = COHORT__V1__HEARTBEAT_DATAGRAM_ACK__INIT;
    uint8_t mac[SECRET_MAC_BYTES], buf[WIRE_DATAGRAM_MAX];
    struct secret k;
    ssize_t n;

    if (!key_for(d, q->cohort, &k))
        return;                 /* its key was removed meanwhile */
    a.session = q->session;
    a.seq = q->proof->seq;
    a.epoch = res->epoch;
    a.drained = res->drained;
    n = proof_sign_ack(&k, q->cohort, q->id, &a, mac) == 0 ? dgram_pack_ack(&a, buf) : -EIO;
    secret_wipe(&k);
    if (n > 0 && dgram_send_to(fd, to, to_len, buf, (size_t)n) == 0)
        dg_count(d, BROKERD_DG_ACKED);
}

/* One datagram: judged as a stream's plain heartbeat is, except that a
 * refusal only drops it, counted and unlogged. Its sender is nobody until
 * the proof checks, a stranger chooses how many it sends, and nothing
 * goes back to an address that has not proved the key. Only proved
 * datagrams count (a source address proves nothing), and only for a
 * member session whose stream is attached: a stream cut without a Leave
 * is a death that datagrams must not hide. */
static void dg_one(struct brokerd *d, int fd, const struct dgram_batch *b, size_t i)
{
    Cohort__V1__HeartbeatDatagram *q = NULL;
    struct broker_beat_result res = { 0 };
    struct watcher *w;
    char why[RPC_MESSAGE_MAX];
    uint64_t now, due;
    bool ack = false;
    int rc;

    if (dgram_unpack(b->buf[i], b->len[i], &q) < 0 ||
        q->protocol_version != WIRE_PROTOCOL_VERSION || q->session == 0 ||
        !ident_valid_cohort(q->cohort) || !ident_valid_member_id(q->id)) {
        dg_count(d, BROKERD_DG_MALFORMED);
        goto out;
    }
    if (authenticate(d, &q->base, q->proof, q->cohort, false, why, sizeof(why)) != 1) {
        dg_count(d, BROKERD_DG_UNPROVED);
        goto out;
    }
    struct broker_beat beat = {
        .model_version = q->model_version, .adopted = q->epoch,
        .ckpt = checkpoint_of(q->checkpoint_version, q->checkpoint_skipped),
    };
    pthread_mutex_lock(&d->lock);
    now = clock_now_ms();
    w = broker_watcher(d->b, q->cohort, q->id, q->session);
    if (!w || !w->attached) {
        pthread_mutex_unlock(&d->lock);
        dg_count(d, BROKERD_DG_UNATTACHED);
        goto out;
    }
    /* The stream's pace, on a clock of their own; too fast is dropped. */
    due = (w->dg_due > now ? w->dg_due : now) + w->beat_cost_ms;
    if (due > now + SESSION_BEAT_BURST * w->beat_cost_ms) {
        pthread_mutex_unlock(&d->lock);
        dg_count(d, BROKERD_DG_PACED);
        goto out;
    }
    rc = broker_accept_seq(d->b, q->cohort, q->id, q->session, q->proof->seq);
    if (rc == 0)
        rc = broker_heartbeat(d->b, now, q->cohort, q->id, q->session, &beat, &res);
    if (rc == 0) {
        w->dg_due = due;
        /* The first datagram of a stream at once, then those that ask
         * (the member's dg_fresh keeps it within half its timeout of the
         * last, and asks every one while none arrives), and a change of
         * the drained flag. The pace above bounds how many. */
        ack = !w->dg_acked || q->want_ack || res.drained != w->dg_told_drained;
        if (ack) {
            w->dg_acked = true;
            w->dg_told_drained = res.drained;
        }
    }
    pthread_mutex_unlock(&d->lock);
    dg_count(d, rc == 0 ? BROKERD_DG_ACCEPTED
                : rc == -EALREADY ? BROKERD_DG_REPLAYED : BROKERD_DG_UNATTACHED);
    if (ack)
        dg_ack(d, q, &res, fd, &b->from[i], b->from_len[i]);
out:
    if (q)
        protobuf_c_message_free_unpacked(&q->base, NULL);
}

/* Reads the datagram sockets until brokerd_stop writes the eventfd. A
 * socket gets at most DG_ROUNDS batches before the others get theirs. */
#define DG_ROUNDS 8
static void *dg_main(void *arg)
{
    struct brokerd *d = arg;
    struct pollfd pfd[DGRAM_LISTEN_MAX + 1];
    struct dgram_batch *b = malloc(sizeof(*b));
    int n = d->n_dg;

    if (!b) {
        log_emit(LOG_ERROR, "broker", "Datagram heartbeats are read by nobody: out of memory; "
                 "members send their heartbeats up their streams as well.", LOG_END);
        return NULL;
    }
    for (int i = 0; i < n; i++)
        pfd[i] = (struct pollfd){ .fd = d->dg_fds[i], .events = POLLIN };
    pfd[n] = (struct pollfd){ .fd = d->dg_stop_fd, .events = POLLIN };
    for (;;) {
        if (poll(pfd, (nfds_t)n + 1, -1) < 0 && errno != EINTR)
            break;
        if (pfd[n].revents)
            break;
        for (int i = 0; i < n; i++) {
            int k = DGRAM_BATCH;

            for (int r = 0; r < DG_ROUNDS && k == (int)DGRAM_BATCH; r++) {
                k = dgram_recv(pfd[i].fd, b);
                for (int j = 0; j < k; j++) {
                    if (d->dg_deaf)
                        dg_count(d, BROKERD_DG_DROPPED);
                    else
                        dg_one(d, pfd[i].fd, b, (size_t)j);
                }
            }
        }
    }
    free(b);
    return NULL;
}

/* Binds the datagram sockets and starts their thread; where either
 * fails, datagrams are off (members keep heartbeats on their streams)
 * and a warning says why. */
static void dg_start(struct brokerd *d, const struct brokerd_config *cfg)
{
    int rc;

    d->n_dg = 0;
    d->dg_stop_fd = -1;
    if (cfg->no_datagrams)
        return;
    rc = dgram_listen(cfg->listen, rpc_server_port(d->srv), d->dg_fds);
    if (rc < 0)
        goto off;
    d->n_dg = rc;
    d->dg_deaf = cfg->deaf_datagrams;
    d->dg_stop_fd = eventfd(0, EFD_CLOEXEC);
    if (d->dg_stop_fd < 0) {
        rc = -errno;
        goto off_close;
    }
    if (pthread_create(&d->dg_thread, NULL, dg_main, d) != 0) {
        rc = -EAGAIN;
        close(d->dg_stop_fd);
        d->dg_stop_fd = -1;
        goto off_close;
    }
    return;

off_close:
    for (int i = 0; i < d->n_dg; i++)
        close(d->dg_fds[i]);
    d->n_dg = 0;
off:
    log_warn("broker", "Datagram heartbeats are off: members keep their heartbeats on their "
             "streams.", LF_U("port", rpc_server_port(d->srv)), LF_ERR(rc));
}

static void dg_stop(struct brokerd *d)
{
    uint64_t one = 1;

    if (d->n_dg == 0)
        return;
    if (write(d->dg_stop_fd, &one, sizeof(one)) != sizeof(one))
        log_error("broker", "Could not stop the datagram thread.", LF_ERR(-errno));
    pthread_join(d->dg_thread, NULL);
    close(d->dg_stop_fd);
    for (int i = 0; i < d->n_dg; i++)
        close(d->dg_fds[i]);
    d->n_dg = 0;
}

bool brokerd_datagrams(const struct brokerd *d, uint64_t counts[BROKERD_DG_KINDS])
{
    for (int k = 0; counts && k < BROKERD_DG_KINDS; k++)
        counts[k] = atomic_load_explicit(&d->dg_count[k], memory_order_relaxed);
    return d->n_dg > 0;
}

/* ---- matchmaking ----------------------------------------------------- */

static enum rpc_code mm_code(int err)
{
    switch (err) {
    case -ETIMEDOUT: return RPC_DEADLINE_EXCEEDED;
    case -ECANCELED: return RPC_ABORTED;
    case -ESHUTDOWN: return RPC_UNAVAILABLE;
    case -EPROTO: return RPC_FAILED_PRECONDITION;
    case -ENOSPC: return RPC_RESOURCE_EXHAUSTED;
    case -ENOENT: return RPC_NOT_FOUND;
    case -EINVAL: return RPC_INVALID_ARGUMENT;
    default: return rpc_code_from_errno(err);
    }
}

/* The matchmaker's callbacks, called with d->mm_lock held. */
static void mm_formed(void *arg, const struct matchmaker_group *g)
{
    Cohort__V1__MatchmakeReply rep = COHORT__V1__MATCHMAKE_REPLY__INIT;
    Cohort__V1__Member storage[MATCHMAKER_GROUP_MAX], *ptrs[MATCHMAKER_GROUP_MAX];
    double bandwidths[MATCHMAKER_GROUP_MAX];
    protobuf_c_boolean clients[MATCHMAKER_GROUP_MAX];
    struct rpc_buf *buf = NULL;
    int rc;

    (void)arg;
    for (size_t i = 0; i < g->n; i++) {
        cohort__v1__member__init(&storage[i]);
        storage[i].id = (char *)g->members[i].id;
        storage[i].address = (char *)g->members[i].address;
        ptrs[i] = &storage[i];
        bandwidths[i] = g->members[i].bandwidth;
        clients[i] = g->members[i].client;
    }
    rep.group_id = g->id;
    rep.n_members = g->n;
    rep.members = ptrs;
    rep.n_bandwidths = g->n;
    rep.bandwidths = bandwidths;
    rep.n_client_mode = g->n;
    rep.client_mode = clients;
    rep.schema.data = (uint8_t *)(uintptr_t)g->schema;
    rep.schema.len = g->schema_len;
    rc = rpc_buf_pack(&rep.base, &buf);
    for (size_t i = 0; i < g->n; i++) {
        struct mm_call *c = g->members[i].ctx;

        c->answered = true;
        if (rc == 0) {
            rpc_stream_send(c->s, buf);
            rpc_stream_finish(c->s, RPC_OK, "");
        } else {
            rpc_stream_finish(c->s, RPC_RESOURCE_EXHAUSTED, "out of memory");
        }
    }
    rpc_buf_unref(buf);
    log_debug("broker", "A group of averagers formed.", LF_S("cohort", g->cohort),
              LF_S("prefix", g->prefix), LF_S("group_bits", g->bits), LF_U("group", g->id),
              LF_U("size", g->n));
}

static void mm_failed(void *arg, void *ctx, int err, const char *why)
{
    struct mm_call *c = ctx;

    (void)arg;
    c->answered = true;
    rpc_stream_finish(c->s, mm_code(err), why);
}

/* Called with d->mm_lock held; takes d->lock, which is never held while
 * mm_lock is taken. */
static bool mm_alive(void *arg, void *ctx)
{
    struct brokerd *d = arg;
    struct mm_call *c = ctx;
    char address[IDENT_ADDRESS_MAX + 1];
    int rc;

    pthread_mutex_lock(&d->lock);
    rc = broker_member_address(d->b, c->cohort, c->id, c->session, address, sizeof(address));
    pthread_mutex_unlock(&d->lock);
    return rc == 0;
}

static void mm_closed(void *arg, struct rpc_stream *s)
{
    struct mm_call *c = arg;

    pthread_mutex_lock(&c->d->mm_lock);
    if (!c->answered)
        matchmaker_cancel(c->d->mm, c);
    pthread_mutex_unlock(&c->d->mm_lock);
    rpc_stream_unref(s);
    free(c);
}

static void mm_refuse(struct brokerd *d, struct rpc_stream *s, const char *cohort, const char *id,
                      enum rpc_code code, const char *why)
{
    log_refusal(d, "Matchmake", cohort, id, code, why);
    rpc_stream_finish(s, code, why);
    rpc_stream_unref(s);
}

/* Matchmake: a proved request of a live member session (its seq is
 * accepted once, as for Heartbeat), which waits in the matchmaker with
 * the address the member joined with. */
static void on_matchmake(void *arg, const ProtobufCMessage *req, struct rpc_stream *s)
{
    const Cohort__V1__MatchmakeRequest *q = (const Cohort__V1__MatchmakeRequest *)req;
    struct brokerd *d = arg;
    struct matchmaker_request r = {
        .cohort = q->cohort, .id = q->id, .prefix = q->prefix, .bits = q->group_bits,
        .target = q->target_group_size, .min = q->min_group_size,
        .min_wait_ms = q->min_matchmaking_ms, .timeout_ms = q->timeout_ms,
        .schema = q->schema.data, .schema_len = q->schema.len,
        .has_bandwidth = q->has_bandwidth, .bandwidth = q->bandwidth, .client = q->client_mode,
        .any_schema = q->any_schema,
    };
    char why[RPC_MESSAGE_MAX], address[IDENT_ADDRESS_MAX + 1];
    struct mm_call *c;
    int rc, proved;

    if (!version_ok(q->protocol_version, why, sizeof(why))) {
        mm_refuse(d, s, q->cohort, q->id, RPC_FAILED_PRECONDITION, why);
        return;
    }
    if (!ident_valid_cohort(q->cohort) || !ident_valid_member_id(q->id)) {
        mm_refuse(d, s, q->cohort, q->id, RPC_INVALID_ARGUMENT,
                  "invalid cohort name or member id");
        return;
    }
    proved = authenticate(d, req, q->proof, q->cohort, false, why, sizeof(why));
    if (proved < 0) {
        mm_refuse(d, s, q->cohort, q->id, RPC_UNAUTHENTICATED, why);
        return;
    }
    pthread_mutex_lock(&d->lock);
    rc = proved ? broker_accept_seq(d->b, q->cohort, q->id, q->session, q->proof->seq) : 0;
    if (rc == 0)
        rc = broker_member_address(d->b, q->cohort, q->id, q->session, address,
                                   sizeof(address));
    pthread_mutex_unlock(&d->lock);
    if (rc == -EALREADY) {
        mm_refuse(d, s, q->cohort, q->id, RPC_UNAUTHENTICATED, replayed);
        return;
    }
    if (rc < 0) {
        mm_refuse(d, s, q->cohort, q->id, RPC_NOT_FOUND,
                  "no member with this session in the cohort: an averager must join it first");
        return;
    }
    c = calloc(1, sizeof(*c));
    if (!c) {
        mm_refuse(d, s, q->cohort, q->id, RPC_RESOURCE_EXHAUSTED, "out of memory");
        return;
    }
    c->d = d;
    c->s = s;           /* the handler's reference, dropped in mm_closed */
    snprintf(c->cohort, sizeof(c->cohort), "%s", q->cohort);
    snprintf(c->id, sizeof(c->id), "%s", q->id);
    c->session = q->session;
    r.address = address;
    r.ctx = c;
    pthread_mutex_lock(&d->mm_lock);
    rc = matchmaker_submit(d->mm, clock_now_ms(), &r, why, sizeof(why));
    if (rc < 0)
        c->answered = true;
    pthread_cond_signal(&d->mm_wake);     /* a nearer deadline */
    pthread_mutex_unlock(&d->mm_lock);
    if (rc < 0) {
        log_refusal(d, "Matchmake", q->cohort, q->id, mm_code(rc), why);
        rpc_stream_finish(s, mm_code(rc), why);
    } else {
        log_debug("broker", "An averager asks for a group.", LF_S("cohort", q->cohort),
                  LF_S("id", q->id), LF_S("prefix", q->prefix), LF_S("group_bits", q->group_bits));
    }
    /* Last and outside the lock: if the client is already gone this runs
     * at once, and it takes the lock itself. */
    rpc_stream_on_close(s, mm_closed, c);
}

static void *mm_main(void *arg)
{
    struct brokerd *d = arg;

    pthread_mutex_lock(&d->mm_lock);
    while (!d->mm_stopping) {
        struct timespec ts = clock_deadline(matchmaker_tick(d->mm, clock_now_ms()));

        pthread_cond_timedwait(&d->mm_wake, &d->mm_lock, &ts);
    }
    pthread_mutex_unlock(&d->mm_lock);
    return NULL;
}

/* ---- state donors ---------------------------------------------------- */

/* StateDonors: a proved request of a live member session (its seq is
 * accepted once), which declares or withdraws the member as a donor of
 * its prefix's state when it asks to, and reads the prefix's donors.
 * The table lives in the matchmaker, under mm_lock. */
static void on_state_donors(void *arg, const ProtobufCMessage *req, struct rpc_reply *r)
{
    const Cohort__V1__StateDonorsRequest *q = (const Cohort__V1__StateDonorsRequest *)req;
    Cohort__V1__StateDonorsReply rep = COHORT__V1__STATE_DONORS_REPLY__INIT;
    Cohort__V1__StateDonor storage[MATCHMAKER_DONORS_REPLY_MAX];
    Cohort__V1__StateDonor *ptrs[MATCHMAKER_DONORS_REPLY_MAX];
    struct matchmaker_donor_row *rows = NULL;
    struct brokerd *d = arg;
    char why[RPC_MESSAGE_MAX], address[IDENT_ADDRESS_MAX + 1];
    enum rpc_code code = RPC_OK;
    size_t n = 0;
    int rc, proved;

    if (!version_ok(q->protocol_version, why, sizeof(why))) {
        code = RPC_FAILED_PRECONDITION;
        goto refuse;
    }
    if (!ident_valid_cohort(q->cohort) || !ident_valid_member_id(q->id)) {
        code = RPC_INVALID_ARGUMENT;
        snprintf(why, sizeof(why), "invalid cohort name or member id");
        goto refuse;
    }
    if (!matchmaker_prefix_valid(q->prefix)) {
        code = RPC_INVALID_ARGUMENT;
        snprintf(why, sizeof(why), "the prefix must be 1 to 128 characters of letters, digits "
                 "and . _ : / -");
        goto refuse;
    }
    proved = authenticate(d, req, q->proof, q->cohort, false, why, sizeof(why));
    if (proved < 0) {
        code = RPC_UNAUTHENTICATED;
        goto refuse;
    }
    pthread_mutex_lock(&d->lock);
    rc = proved ? broker_accept_seq(d->b, q->cohort, q->id, q->session, q->proof->seq) : 0;
    if (rc == 0)
        rc = broker_member_address(d->b, q->cohort, q->id, q->session, address,
                                   sizeof(address));
    pthread_mutex_unlock(&d->lock);
    if (rc == -EALREADY) {
        code = RPC_UNAUTHENTICATED;
        snprintf(why, sizeof(why), "%s", replayed);
        goto refuse;
    }
    if (rc < 0) {
        code = RPC_NOT_FOUND;
        snprintf(why, sizeof(why), "no member with this session in the cohort: an averager "
                 "must join it first");
        goto refuse;
    }
    rows = calloc(MATCHMAKER_DONORS_REPLY_MAX, sizeof(*rows));
    if (!rows) {
        code = RPC_RESOURCE_EXHAUSTED;
        snprintf(why, sizeof(why), "out of memory");
        goto refuse;
    }
    pthread_mutex_lock(&d->mm_lock);
    rc = 0;
    if (q->declare && q->allow) {
        struct matchmaker_donor dn = {
            .cohort = q->cohort, .id = q->id, .prefix = q->prefix,
            .address = q->state_address, .session = q->session, .priority = q->priority,
            .expiry_ms = q->expiry_ms,
        };
        rc = matchmaker_declare(d->mm, clock_now_ms(), &dn, why, sizeof(why));
    } else if (q->declare) {
        (void)matchmaker_withdraw(d->mm, clock_now_ms(), q->cohort, q->prefix, q->id);
    }
    if (rc == 0)
        n = matchmaker_donors(d->mm, clock_now_ms(), q->cohort, q->prefix, q->id, rows,
                              MATCHMAKER_DONORS_REPLY_MAX);
    pthread_mutex_unlock(&d->mm_lock);
    if (rc < 0) {
        code = mm_code(rc);
        goto refuse;
    }
    /* Only donors whose session is still in the cohort: one that died or
     * was evicted is not offered until its declaration would expire.
     * (Taken once mm_lock is released; mm_alive takes the two in the
     * order mm_lock, lock, and nothing takes them the other way.) */
    pthread_mutex_lock(&d->lock);
    for (size_t i = 0; i < n; i++) {
        char addr[IDENT_ADDRESS_MAX + 1];

        if (broker_member_address(d->b, q->cohort, rows[i].id, rows[i].session, addr,
                                  sizeof(addr)) < 0)
            continue;
        cohort__v1__state_donor__init(&storage[rep.n_donors]);
        storage[rep.n_donors].id = rows[i].id;
        storage[rep.n_donors].address = rows[i].address;
        storage[rep.n_donors].priority = rows[i].priority;
        ptrs[rep.n_donors] = &storage[rep.n_donors];
        rep.n_donors++;
    }
    pthread_mutex_unlock(&d->lock);
    rep.donors = ptrs;
    rpc_reply_ok(r, &rep.base);
    free(rows);
    return;
refuse:
    free(rows);
    log_refusal(d, "StateDonors", q->cohort, q->id, code, why);
    rpc_reply_error(r, code, "%s", why);
}

static void fill_members(Cohort__V1__Member **ptrs, Cohort__V1__Member *storage,
                         const struct epoch_member *m, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        cohort__v1__member__init(&storage[i]);
        storage[i].id = m[i].id;
        storage[i].address = m[i].address;
        storage[i].model_version = m[i].model_version;
        ptrs[i] = &storage[i];
    }
}

/* Whether a Status request may be answered: one cohort's with its key or
 * the admin key, every cohort's with the admin key; without a proof, only
 * what an open broker serves without keys. Otherwise fills `why`. */
static bool may_read_status(struct brokerd *d, const Cohort__V1__StatusRequest *q, char *why,
                            size_t len)
{
    const Cohort__V1__Proof *p = q->proof;
    bool proves = p && p->mac.len > 0;
    struct secret k;
    bool have, ok = false;

    if (!q->cohort[0]) {
        if (d->has_admin && proves && proof_valid(&d->admin_key, &q->base, p))
            return in_time(p, why, len);
        if (!d->has_admin && d->open && keyless(d))
            return true;
        snprintf(why, len, "%s", !d->has_admin ? "the status of every cohort needs the admin "
                                                 "key, and this broker has none"
                                 : proves ? "the request proves a wrong key: the status of every "
                                            "cohort needs the admin key"
                                          : "the request proves no key: the status of every "
                                            "cohort needs the admin key");
        return false;
    }
    have = key_for(d, q->cohort, &k);
    if (proves && ((have && proof_valid(&k, &q->base, p)) ||
                   (d->has_admin && proof_valid(&d->admin_key, &q->base, p))))
        ok = in_time(p, why, len);
    else if (!have && d->open)
        ok = true;
    else if (!have && !proves)
        snprintf(why, len, "this broker has no key for cohort \"%.64s\": only the admin key "
                 "reads its status", q->cohort);
    else
        snprintf(why, len, "the request proves %s key for cohort \"%.64s\" (its key or the "
                 "admin key)", proves ? "a wrong" : "no", q->cohort);
    if (have)
        secret_wipe(&k);
    return ok;
}

static void on_status(void *arg, const ProtobufCMessage *req, struct rpc_reply *r)
{
    const Cohort__V1__StatusRequest *q = (const Cohort__V1__StatusRequest *)req;
    Cohort__V1__StatusReply rep = COHORT__V1__STATUS_REPLY__INIT;
    struct brokerd *d = arg;
    struct broker_status *st = NULL;
    Cohort__V1__CohortStatus *cs = NULL, **csp = NULL;
    Cohort__V1__Member *ms = NULL, **msp = NULL;
    size_t total = 0, off = 0;
    char why[RPC_MESSAGE_MAX];
    int rc;

    if (q->protocol_version != WIRE_PROTOCOL_VERSION) {
        check_common(d, r, "Status", q->protocol_version, q->cohort, NULL, false);
        return;
    }
    if (q->cohort[0] && !check_common(d, r, "Status", q->protocol_version, q->cohort, NULL, false))
        return;
    if (!may_read_status(d, q, why, sizeof(why))) {
        refuse_auth(d, r, "Status", q->cohort, NULL, why);
        return;
    }
    pthread_mutex_lock(&d->lock);
    rc = broker_status(d->b, q->cohort[0] ? q->cohort : NULL, &st);
    pthread_mutex_unlock(&d->lock);
    if (rc < 0) {
        refuse_errno(d, r, "Status", q->cohort, NULL, rc);
        return;
    }
    for (size_t i = 0; i < st->n_cohorts; i++)
        total += st->cohorts[i].n_members;
    cs = calloc(st->n_cohorts + 1, sizeof(*cs));
    csp = calloc(st->n_cohorts + 1, sizeof(*csp));
    ms = calloc(total + 1, sizeof(*ms));
    msp = calloc(total + 1, sizeof(*msp));
    if (!cs || !csp || !ms || !msp) {
        rpc_reply_error(r, RPC_RESOURCE_EXHAUSTED, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < st->n_cohorts; i++) {
        const struct broker_cohort_status *c = &st->cohorts[i];
        cohort__v1__cohort_status__init(&cs[i]);
        cs[i].name = c->name;
        cs[i].epoch = c->epoch;
        cs[i].leader = c->leader ? c->leader : (char *)"";
        cs[i].heartbeat_ms = c->heartbeat_ms;
        cs[i].timeout_ms = c->timeout_ms;
        fill_members(msp + off, ms + off, c->members, c->n_members);
        for (size_t k = 0; k < c->n_members; k++)
            ms[off + k].draining = c->draining[k];
        cs[i].n_members = c->n_members;
        cs[i].members = msp + off;
        off += c->n_members;
        csp[i] = &cs[i];
    }
    rep.n_cohorts = st->n_cohorts;
    rep.cohorts = csp;
    rpc_reply_ok(r, &rep.base);
out:
    free(cs);
    free(csp);
    free(ms);
    free(msp);
    broker_status_free(st);
}

/* ---- the broker's callbacks (called with d->lock held) ----------------- */

/* One epoch on its way to the streams of its cohort's members. */
struct delivery {
    char cohort[IDENT_NAME_MAX + 1];
    uint64_t epoch;
    size_t streams;
    uint64_t formed_us;
};

/* The epoch's buffer is released: every stream it was queued on has sent
 * it (gRPC took it for the connection) or moved past it. The log line is
 * the broker's own measure of how long an epoch takes to reach every
 * member, apart from the network and the members' processing
 * (bench/broker.sh reads it). */
static void delivered(void *arg)
{
    struct delivery *dv = arg;

    log_info("broker", "An epoch went out to every member's stream.", LF_S("cohort", dv->cohort),
             LF_U("epoch", dv->epoch), LF_U("streams", dv->streams),
             LF_U("send_us", clock_now_us() - dv->formed_us));
    free(dv);
}

static void publish(void *arg, struct epoch *e, void *const *watchers, size_t n)
{
    uint64_t t0 = clock_now_us();      /* packing is the broker's work too */
    struct delivery *dv = NULL;
    Cohort__V1__SessionReply rep = COHORT__V1__SESSION_REPLY__INIT;
    Cohort__V1__Epoch p;
    Cohort__V1__Member *storage, **ptrs;
    struct rpc_buf *buf = NULL;

    if (n == 0)
        return;
    storage = calloc(e->n_members + 1, sizeof(*storage));
    ptrs = calloc(e->n_members + 1, sizeof(*ptrs));
    if (storage && ptrs)
        epoch_to_proto(e, &p, ptrs, storage);
    rep.epoch = &p;
    if (!storage || !ptrs || rpc_buf_pack(&rep.base, &buf) < 0) {
        /* Members notice through the acknowledgements of their
         * heartbeats, which name the latest epoch, and reopen. */
        log_error("broker", "An epoch could not be packed; members will catch up by heartbeat.",
                  LF_S("cohort", e->cohort), LF_U("epoch", e->number));
        goto out;
    }
    /* Timed when it goes to more than one stream: a membership change,
     * not one member's catch-up as its stream attaches. */
    if (n > 1 && (dv = calloc(1, sizeof(*dv)))) {
        snprintf(dv->cohort, sizeof(dv->cohort), "%s", e->cohort);
        dv->epoch = e->number;
        dv->streams = n;
        dv->formed_us = t0;
        rpc_buf_on_release(buf, delivered, dv);
    }
    /* Packed once, shared by every stream. An epoch replaces an
     * acknowledgement still waiting (the newest state wins). */
    for (size_t i = 0; i < n; i++) {
        struct watcher *w = watchers[i];
        rpc_stream_send(w->s, buf);
    }
    rpc_buf_unref(buf);
out:
    free(storage);
    free(ptrs);
}

static void detach(void *arg, void *watcher, int err)
{
    struct watcher *w = watcher;
    const char *why = err == -ETIMEDOUT  ? "evicted: silent past the member timeout"
                      : err == -EHOSTUNREACH
                          ? "evicted: most of its epoch reported it unreachable; it may rejoin "
                            "when its bench ends"
                      : err == -ENOENT   ? "left the cohort"
                      : err == -EEXIST   ? "replaced by a newer session stream of the same member"
                                         : "the cohort or the broker is going away";

    w->attached = false;
    /* NOT_FOUND tells the member to rejoin; UNAVAILABLE to come back later. */
    rpc_stream_finish(w->s, err == -ESHUTDOWN ? RPC_UNAVAILABLE : RPC_NOT_FOUND, why);
}

static void *tick_main(void *arg)
{
    struct brokerd *d = arg;

    pthread_mutex_lock(&d->lock);
    while (!d->stopping) {
        struct timespec ts = clock_deadline(broker_tick(d->b, clock_now_ms()));

        pthread_cond_timedwait(&d->wake, &d->lock, &ts);
    }
    pthread_mutex_unlock(&d->lock);
    return NULL;
}

int brokerd_start(const struct brokerd_config *cfg, struct brokerd **out)
{
    struct broker_watch_ops ops = { .publish = publish, .detach = detach, .arg = NULL };
    struct brokerd *d = calloc(1, sizeof(*d));
    int rc;

    if (!d)
        return -ENOMEM;
    struct rpc_method methods[] = {
        { WIRE_BROKER_JOIN, &cohort__v1__join_request__descriptor, on_join, NULL, d },
        { WIRE_BROKER_SESSION, &cohort__v1__heartbeat_request__descriptor, NULL, on_session, d },
        { WIRE_BROKER_LEAVE, &cohort__v1__leave_request__descriptor, on_leave, NULL, d },
        { WIRE_BROKER_STATUS, &cohort__v1__status_request__descriptor, on_status, NULL, d },
        { WIRE_BROKER_MATCHMAKE, &cohort__v1__matchmake_request__descriptor, NULL, on_matchmake,
          d },
        { WIRE_BROKER_HEARTBEAT, &cohort__v1__heartbeat_request__descriptor, on_heartbeat_v1, NULL,
          d },
        { WIRE_BROKER_WATCH, &cohort__v1__watch_request__descriptor, NULL, on_watch_v1, d },
        { WIRE_BROKER_STATE_DONORS, &cohort__v1__state_donors_request__descriptor,
          on_state_donors, NULL, d },
    };
    struct matchmaker_ops mops = { .formed = mm_formed, .failed = mm_failed, .alive = mm_alive,
                                   .arg = NULL };

    pthread_mutex_init(&d->lock, NULL);
    pthread_mutex_init(&d->log_lock, NULL);
    clock_cond_init(&d->wake);
    ops.arg = d;
    rc = broker_create(&cfg->broker, &ops, clock_now_ms(), &d->b);
    if (rc < 0)
        goto err_free;
    if (cfg->key) {
        d->key = *cfg->key;
        d->has_key = true;
    }
    if (cfg->admin_key) {
        d->admin_key = *cfg->admin_key;
        d->has_admin = true;
    }
    d->open = cfg->open;
    d->max_keys = cfg->broker.max_cohorts;
    pthread_mutex_init(&d->mm_lock, NULL);
    clock_cond_init(&d->mm_wake);
    mops.arg = d;
    /* Group numbers grow across restarts: a member's engine adopts each
     * group as an epoch, which must be newer than the last. */
    rc = matchmaker_create(&mops, proof_now_ms() << 10, &d->mm);
    if (rc < 0)
        goto err_locks;
    {
        struct rpc_server_opts so = { .tls_cert_pem = cfg->tls_cert_pem,
                                      .tls_key_pem = cfg->tls_key_pem };
        rc = rpc_server_create(cfg->listen, methods, sizeof(methods) / sizeof(methods[0]), &so,
                               &d->srv);
    }
    if (rc < 0)
        goto err_matchmaker;
    dg_start(d, cfg);
    if (pthread_create(&d->ticker, NULL, tick_main, d) != 0) {
        rc = -EAGAIN;
        goto err_server;
    }
    if (pthread_create(&d->mm_thread, NULL, mm_main, d) != 0) {
        rc = -EAGAIN;
        goto err_ticker;
    }
    *out = d;
    return 0;

err_ticker:
    pthread_mutex_lock(&d->lock);
    d->stopping = true;
    pthread_cond_signal(&d->wake);
    pthread_mutex_unlock(&d->lock);
    pthread_join(d->ticker, NULL);
err_server:
    dg_stop(d);
    rpc_server_destroy(d->srv);
err_matchmaker:
    matchmaker_destroy(d->mm);
err_locks:
    pthread_cond_destroy(&d->mm_wake);
    pthread_mutex_destroy(&d->mm_lock);
    broker_destroy(d->b);
err_free:
    pthread_cond_destroy(&d->wake);
    pthread_mutex_destroy(&d->log_lock);
    pthread_mutex_destroy(&d->lock);
    secret_wipe(&d->key);
    secret_wipe(&d->admin_key);
    free(d);
    return rc;
}

int brokerd_set_key(struct brokerd *d, const char *cohort, const struct secret *key)
{
    size_t i;

    if (!ident_valid_cohort(cohort))
        return -EINVAL;
    pthread_mutex_lock(&d->lock);
    for (i = 0; i < d->n_keys; i++)
        if (strcmp(d->keys[i].cohort, cohort) == 0)
            break;
    if (!key) {
        if (i < d->n_keys) {
            secret_wipe(&d->keys[i].key);
            d->keys[i] = d->keys[--d->n_keys];
        }
    } else if (i < d->n_keys) {
        d->keys[i].key = *key;
    } else if (d->n_keys >= d->max_keys) {
        pthread_mutex_unlock(&d->lock);
        return -ENOSPC;
    } else {
        struct cohort_key *grown = realloc(d->keys, (d->n_keys + 1) * sizeof(*grown));
        if (!grown) {
            pthread_mutex_unlock(&d->lock);
            return -ENOMEM;
        }
        d->keys = grown;
        snprintf(d->keys[d->n_keys].cohort, sizeof(d->keys[d->n_keys].cohort), "%s", cohort);
        d->keys[d->n_keys++].key = *key;
    }
    pthread_mutex_unlock(&d->lock);
    return 0;
}

int brokerd_port(const struct brokerd *d)
{
    return rpc_server_port(d->srv);
}

int brokerd_declare(struct brokerd *d, const char *cohort, uint32_t heartbeat_ms, uint32_t timeout_ms)
{
    int rc;

    pthread_mutex_lock(&d->lock);
    rc = broker_cohort_declare(d->b, cohort, heartbeat_ms, timeout_ms);
    pthread_mutex_unlock(&d->lock);
    return rc;
}

int brokerd_status(struct brokerd *d, const char *cohort, struct broker_status **out)
{
    int rc;

    pthread_mutex_lock(&d->lock);
    rc = broker_status(d->b, cohort, out);
    pthread_mutex_unlock(&d->lock);
    return rc;
}

int brokerd_drain(struct brokerd *d, const char *cohort, const char *id, bool drain)
{
    int rc;

    pthread_mutex_lock(&d->lock);
    rc = broker_drain(d->b, clock_now_ms(), cohort, id, drain);
    /* The tick thread forms the epoch once the coalescing window ends. */
    pthread_cond_signal(&d->wake);
    pthread_mutex_unlock(&d->lock);
    if (rc == 0)
        log_info("broker", drain ? "Draining a member." : "A member is no longer draining.",
                 LF_S("cohort", cohort), LF_S("id", id));
    return rc;
}

int brokerd_drained(struct brokerd *d, const char *cohort, const char *id)
{
    int rc;

    pthread_mutex_lock(&d->lock);
    rc = broker_drained(d->b, cohort, id);
    pthread_mutex_unlock(&d->lock);
    return rc;
}

int brokerd_remove(struct brokerd *d, const char *cohort)
{
    int rc;

    pthread_mutex_lock(&d->lock);
    rc = broker_cohort_remove(d->b, cohort);
    pthread_mutex_unlock(&d->lock);
    return rc;
}

void brokerd_stop(struct brokerd *d)
{
    if (!d)
        return;
    pthread_mutex_lock(&d->lock);
    d->stopping = true;
    pthread_cond_signal(&d->wake);
    pthread_mutex_unlock(&d->lock);
    pthread_join(d->ticker, NULL);
    pthread_mutex_lock(&d->mm_lock);
    d->mm_stopping = true;
    pthread_cond_signal(&d->mm_wake);
    pthread_mutex_unlock(&d->mm_lock);
    pthread_join(d->mm_thread, NULL);
    dg_stop(d);
    /* Streams close first (their on_close takes the lock and unwatches),
     * then the broker detaches whatever is left. */
    rpc_server_destroy(d->srv);
    matchmaker_destroy(d->mm);
    pthread_cond_destroy(&d->mm_wake);
    pthread_mutex_destroy(&d->mm_lock);
    pthread_mutex_lock(&d->lock);
    broker_destroy(d->b);
    pthread_mutex_unlock(&d->lock);
    pthread_cond_destroy(&d->wake);
    pthread_mutex_destroy(&d->log_lock);
    pthread_mutex_destroy(&d->lock);
    for (size_t i = 0; i < d->n_keys; i++)
        secret_wipe(&d->keys[i].key);
    free(d->keys);
    secret_wipe(&d->key);
    secret_wipe(&d->admin_key);
    free(d);
}

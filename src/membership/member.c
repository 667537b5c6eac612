/* src/membership/member.c: see member.h. */
#include "membership/member.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include "base/clock.h"
#include "cohort.pb-c.h"
#include "base/ident.h"
#include "base/limits.h"
#include "base/log.h"
#include "base/secret.h"
#include "membership/dgram.h"
#include "membership/proof.h"
#include "rpc/rpc.h"
#include "membership/wire.h"

#define BACKOFF_MIN_MS 100u
/* After an UNAUTHENTICATED refusal: a key or a clock has to change first,
 * so retries start at 1 s and double to 30 s. */
#define AUTH_BACKOFF_MIN_MS 1000u
#define AUTH_BACKOFF_MAX_MS 30000u
#define POLL_MAX_MS 100u
#define JOIN_TIMEOUT_MS 2000u
#define FAIL_LOG_EVERY 10u     /* repeated identical failures are logged this rarely */
/* Heartbeats sent early for queued unreachable peers, per heartbeat
 * interval at most. Each carries as many as the broker takes (its
 * JoinReply's unreachable_max: WIRE_UNREACHABLE_MAX, or
 * WIRE_LOST_PEERS_MAX from a broker that names none), so a member that
 * finds many at once (a side of a partition) reports 2,048 an interval,
 * or 32 to an older broker; with the regular heartbeats they replace,
 * that stays within the pace the broker allows a stream (brokerd.c,
 * SESSION_BEAT_BURST: 4 an interval, sustained), with room for declares
 * and lost peers. */
#define UNREACH_PACE 2u

enum state { ST_JOINING, ST_JOINED, ST_LEFT };

struct member {
    pthread_mutex_t lock;
    pthread_cond_t idle;        /* signalled when inflight drops to 0 */
    char *broker, *cohort, *id, *address;
    uint64_t session;
    uint64_t model_version;
    bool declare_pending;
    /* Peers whose data connection reset, for the next heartbeat, which
     * goes out at the next poll (member_report_lost). */
    char *lost[WIRE_LOST_PEERS_MAX];
    size_t n_lost;
    /* Peers of the latest epoch this member's host cannot reach
     * (member_report_unreachable), by their position in it: a queue,
     * oldest first, of which each heartbeat carries the first
     * unreach_max (and WIRE_UNREACHABLE_BYTES of ids), and a bitmap of
     * the positions queued, so that a peer is queued once. Both have room for the whole epoch, which
     * bounds them; cleared when another epoch arrives, since the broker
     * counts reports for the epoch they name only. */
    uint32_t *unreach;          /* unreach_cap entries; [unreach_head, n_unreach) queued */
    uint64_t *unreach_bits;     /* (unreach_cap + 63) / 64 words */
    size_t unreach_cap, unreach_head, n_unreach;
    uint64_t unreach_epoch;     /* the epoch the positions are of; 0: none */
    /* The earliest a heartbeat goes out for queued unreachable peers
     * alone: UNREACH_PACE per heartbeat interval at most (above). */
    uint64_t next_unreach_at;
    bool weighs_unreachable;    /* the broker's JoinReply said so */
    /* Unreachable peers per heartbeat: the JoinReply's unreachable_max,
     * at most WIRE_UNREACHABLE_MAX (no more can be signed);
     * WIRE_LOST_PEERS_MAX where it names none. */
    uint32_t unreach_max;
    uint64_t ckpt_version, ckpt_skipped_version;    /* reported in heartbeats */
    uint32_t ckpt_skipped_reason;
    uint32_t want_hb_ms, want_to_ms;    /* asked for; 0: the cohort's */
    uint32_t hb_ms, to_ms;              /* granted by the broker */
    uint32_t backoff_max_ms, backoff_ms;
    bool quiet;
    member_epoch_fn on_epoch;
    void *arg;
    struct rpc_channel *ch;
    bool own_ch;
    uint64_t rng;
    struct secret key;
    bool has_key;
    uint64_t seq;               /* the last proof's; proofs never repeat one */

    enum state state;
    int inflight;               /* async calls whose callbacks name us */
    bool join_inflight;
    bool rejoin_wanted;
    uint64_t next_join_at, next_hb_at, last_ok_at;

    /* The session stream (protocol 2): heartbeats up, epochs and
     * acknowledgements down. */
    struct rpc_watch *watch;
    bool watch_ended, watch_reopen;
    uint64_t next_watch_at;
    uint64_t behind_since;      /* heartbeat saw a newer epoch than the watch */
    bool drained;               /* the last acknowledgement said so */
    bool watch_heard;           /* the current stream has brought a message */

    /* Datagram heartbeats (wire.h): offered by the broker's JoinReply, and
     * only sent with a key. For the current stream: a UDP socket
     * connected to where the stream goes (-1: none yet), whether it
     * failed, when the last acknowledgement came (0: none yet), and the
     * seqs an acknowledgement may name: above the last one acknowledged
     * and from the stream's first datagram on. */
    bool dg_offered;
    int dg_fd;
    bool dg_failed;
    unsigned dg_n;              /* datagrams sent on this stream */
    uint64_t dg_heard_at;
    uint64_t dg_first_seq, dg_acked_seq;
    bool dg_told;               /* the warning that none arrive went out once */

    struct epoch *epoch;
    uint64_t last_epoch;
    uint64_t joins;
    enum rpc_code last_fail;
    unsigned fails;
    uint64_t join_gen;          /* joins started */
    bool refused;               /* refused as UNAUTHENTICATED since the last join */
    uint32_t auth_backoff_ms;
    uint64_t refusals;
};

static enum log_level info_level(const struct member *m)
{
    return m->quiet ? LOG_DEBUG : LOG_INFO;
}

static uint64_t rand_next(struct member *m)
{
    /* xorshift64: jitter only, not security. */
    m->rng ^= m->rng << 13;
    m->rng ^= m->rng >> 7;
    m->rng ^= m->rng << 17;
    return m->rng;
}

/* Schedules a retry: backoff doubles to its cap, and a random half of it
 * is jitter so that members that failed together do not retry together. */
static uint64_t backoff_next(struct member *m, uint64_t now)
{
    uint32_t b = m->backoff_ms;
    uint64_t at = now + b / 2 + rand_next(m) % (b / 2 + 1);

    m->backoff_ms = b * 2 > m->backoff_max_ms ? m->backoff_max_ms : b * 2;
    return at;
}

/* Logs a failure the first time, when its kind changes, and every tenth
 * repeat, so a long outage does not flood the log. */
static void log_failure(struct member *m, const char *what, const struct rpc_status *st)
{
    bool same = st->code == m->last_fail;

    m->fails = same ? m->fails + 1 : 1;
    m->last_fail = st->code;
    if (same && m->fails % FAIL_LOG_EVERY != 1)
        return;
    log_emit(m->quiet ? LOG_DEBUG : LOG_WARN, "member", what, LF_S("cohort", m->cohort),
             LF_S("id", m->id), LF_S("code", rpc_code_name(st->code)), LF_S("detail", st->message),
             LF_U("attempt", m->fails), LOG_END);
}

/* Signs `req` with the next seq when the member has a key; leaves it
 * without a proof otherwise (or if signing fails, which the broker then
 * refuses and the member logs). `pf` and `mac` must outlive the call's
 * start. */
static void sign_locked(struct member *m, ProtobufCMessage *req, Cohort__V1__Proof **slot,
                        Cohort__V1__Proof *pf, uint8_t mac[SECRET_MAC_BYTES])
{
    if (!m->has_key)
        return;
    if (proof_sign(&m->key, req, ++m->seq, proof_now_ms(), pf, mac) == 0)
        *slot = pf;
}

/* The broker refused this member's proof. Retrying at once cannot help,
 * so it says so once, at error level, and backs off until a join goes
 * through. */
static void refused_locked(struct member *m, const char *call, const struct rpc_status *st,
                           uint64_t now)
{
    uint32_t b;

    m->refusals++;
    if (!m->refused)
        log_emit(m->quiet ? LOG_DEBUG : LOG_ERROR, "member",
                 "The broker refused this member's proof of its cohort's key; retrying with "
                 "backoff.", LF_S("cohort", m->cohort), LF_S("id", m->id), LF_S("call", call),
                 LF_S("code", rpc_code_name(st->code)), LF_S("detail", st->message),
                 LF_S("hint", m->has_key ? "check the key file (--secret-file) and the clock"
                                         : "this member has no key: give it --secret-file"),
                 LOG_END);
    m->refused = true;
    b = m->auth_backoff_ms ? m->auth_backoff_ms * 2 : AUTH_BACKOFF_MIN_MS;
    m->auth_backoff_ms = b > AUTH_BACKOFF_MAX_MS ? AUTH_BACKOFF_MAX_MS : b;
    m->state = ST_JOINING;
    m->next_join_at = now + m->auth_backoff_ms / 2 + rand_next(m) % (m->auth_backoff_ms / 2 + 1);
}

static void call_done_locked(struct member *m)
{
    if (--m->inflight == 0)
        pthread_cond_broadcast(&m->idle);
}

static void join_done(void *arg, const struct rpc_status *st, ProtobufCMessage *reply)
{
    struct member *m = arg;
    uint64_t now = clock_now_ms();

    pthread_mutex_lock(&m->lock);
    m->join_inflight = false;
    if (m->state == ST_LEFT) {
        /* Left while joining: the broker forgets us at the timeout. */
    } else if (st->code == RPC_OK) {
        const Cohort__V1__JoinReply *r = (const Cohort__V1__JoinReply *)reply;
        m->state = ST_JOINED;
        m->hb_ms = r->heartbeat_ms ? r->heartbeat_ms : WIRE_DEFAULT_HEARTBEAT_MS;
        m->weighs_unreachable = r->weighs_unreachable;
        m->unreach_max = r->unreachable_max == 0 ? WIRE_LOST_PEERS_MAX
                         : r->unreachable_max > WIRE_UNREACHABLE_MAX ? WIRE_UNREACHABLE_MAX
                                                                     : r->unreachable_max;
        m->to_ms = r->timeout_ms ? r->timeout_ms : WIRE_DEFAULT_TIMEOUT_MS;
        m->dg_offered = r->takes_datagrams && m->has_key;
        if (m->joins == 0 && ((m->want_hb_ms && m->want_hb_ms != m->hb_ms) ||
                              (m->want_to_ms && m->want_to_ms != m->to_ms)))
            log_emit(m->quiet ? LOG_DEBUG : LOG_WARN, "member",
                     "The broker granted other timings than this member asked for.",
                     LF_S("cohort", m->cohort), LF_S("id", m->id),
                     LF_U("asked_heartbeat_ms", m->want_hb_ms), LF_U("heartbeat_ms", m->hb_ms),
                     LF_U("asked_timeout_ms", m->want_to_ms), LF_U("timeout_ms", m->to_ms),
                     LOG_END);
        m->next_hb_at = now + m->hb_ms;
        m->last_ok_at = now;
        m->backoff_ms = BACKOFF_MIN_MS;
        m->joins++;
        m->fails = 0;
        m->last_fail = RPC_OK;
        m->refused = false;
        m->auth_backoff_ms = 0;
        m->watch_reopen = true;     /* a watch from before the join names a dead session */
        m->next_watch_at = now;
        log_emit(info_level(m), "member", "Joined the cohort.", LF_S("cohort", m->cohort),
                 LF_S("id", m->id), LF_S("address", m->address), LF_U("heartbeat_ms", m->hb_ms),
                 LF_U("timeout_ms", m->to_ms), LF_B("proved", m->has_key), LOG_END);
    } else if (st->code == RPC_UNAUTHENTICATED) {
        refused_locked(m, "Join", st, now);
    } else {
        log_failure(m, "Could not join the cohort; retrying.", st);
        m->next_join_at = backoff_next(m, now);
    }
    call_done_locked(m);
    pthread_mutex_unlock(&m->lock);
    if (reply)
        protobuf_c_message_free_unpacked(reply, NULL);
}

/* The broker answered: it holds this member's session and its heartbeats
 * arrive, down the stream or as a datagram's acknowledgement. Lock held. */
static void heard_locked(struct member *m, uint64_t now)
{
    m->last_ok_at = now;
    m->fails = 0;
    m->last_fail = RPC_OK;
}

/* An acknowledgement of this member's heartbeats. Lock held. */
static void beat_locked(struct member *m, const Cohort__V1__HeartbeatReply *r, uint64_t now)
{
    uint64_t have = m->epoch ? m->epoch->number : 0;

    if (r->drained && !m->drained)
        log_info("member", "Drained: the cohort goes on without this member.",
                 LF_S("cohort", m->cohort), LF_S("id", m->id), LF_U("epoch", r->epoch));
    m->drained = r->drained;
    if (r->epoch > have) {
        /* The push may simply be on its way; give it one interval. */
        if (!m->behind_since)
            m->behind_since = now;
        else if (now - m->behind_since >= m->hb_ms)
            m->watch_reopen = true;
    } else {
        m->behind_since = 0;
    }
}

static void log_epoch(const struct member *m, const struct epoch *e)
{
    char ids[1024];
    size_t off = 0;

    if (!log_enabled(info_level(m)))
        return;
    ids[0] = '\0';
    for (size_t i = 0; i < e->n_members && off < sizeof(ids); i++) {
        int n = snprintf(ids + off, sizeof(ids) - off, "%s%s", i ? "," : "", e->members[i].id);
        if (n < 0 || (size_t)n >= sizeof(ids) - off) {
            /* Cut at a whole id; the count says how many there are. */
            ids[off] = '\0';
            break;
        }
        off += (size_t)n;
    }
    log_emit(info_level(m), "member", "Adopted a new epoch.", LF_S("cohort", e->cohort),
             LF_S("id", m->id), LF_U("epoch", e->number), LF_S("leader", epoch_leader_id(e)),
             LF_U("n_members", e->n_members), LF_S("members", ids), LOG_END);
}

/* Forgets the queued unreachable peers and their epoch. */
static void unreach_clear_locked(struct member *m)
{
    free(m->unreach);
    free(m->unreach_bits);
    m->unreach = NULL;
    m->unreach_bits = NULL;
    m->unreach_cap = m->unreach_head = m->n_unreach = 0;
    m->unreach_epoch = 0;
}

static bool unreach_pending(const struct member *m)
{
    return m->unreach_head < m->n_unreach;
}

/* Queues position `pos` of the latest epoch, once. Lock held. */
static int unreach_push_locked(struct member *m, size_t pos)
{
    const struct epoch *e = m->epoch;

    if (m->unreach_epoch != e->number) {
        unreach_clear_locked(m);
        m->unreach = calloc(e->n_members, sizeof(*m->unreach));
        m->unreach_bits = calloc((e->n_members + 63) / 64, sizeof(*m->unreach_bits));
        if (!m->unreach || !m->unreach_bits) {
            unreach_clear_locked(m);
            return -ENOMEM;
        }
        m->unreach_cap = e->n_members;
        m->unreach_epoch = e->number;
    }
    if (m->unreach_bits[pos / 64] >> (pos % 64) & 1u)
        return 0;
    if (m->n_unreach == m->unreach_cap) {
        /* Never full: a position is queued once and the cap is the
         * epoch's size, so the sent ones at the head make room. */
        memmove(m->unreach, m->unreach + m->unreach_head,
                (m->n_unreach - m->unreach_head) * sizeof(*m->unreach));
        m->n_unreach -= m->unreach_head;
        m->unreach_head = 0;
    }
    m->unreach[m->n_unreach++] = (uint32_t)pos;
    m->unreach_bits[pos / 64] |= 1ull << (pos % 64);
    return 0;
}

/* The bytes `id` adds to a heartbeat's unreachable_peers: its tag, its
 * length as a varint (two bytes up to 16,383) and itself. */
static size_t id_wire_bytes(const char *id)
{
    size_t n = strlen(id);

    return 1 + (n < 128 ? 1 : 2) + n;
}

/* Points `ids` at the ids of the oldest queued peers, at most
 * unreach_max of them and WIRE_UNREACHABLE_BYTES as encoded, and returns
 * how many. Lock held. */
static size_t unreach_batch_locked(const struct member *m, char *ids[WIRE_UNREACHABLE_MAX])
{
    size_t k = 0, bytes = 0;

    if (!m->epoch || m->epoch->number != m->unreach_epoch)
        return 0;
    for (size_t i = m->unreach_head; i < m->n_unreach && k < m->unreach_max; i++) {
        char *id = m->epoch->members[m->unreach[i]].id;

        bytes += id_wire_bytes(id);
        if (bytes > WIRE_UNREACHABLE_BYTES)
            break;
        ids[k++] = id;
    }
    return k;
}

/* The oldest `k` queued peers went out. Lock held. */
static void unreach_sent_locked(struct member *m, size_t k, uint64_t now)
{
    for (size_t i = 0; i < k; i++) {
        uint32_t pos = m->unreach[m->unreach_head++];

        m->unreach_bits[pos / 64] &= ~(1ull << (pos % 64));
    }
    if (m->unreach_head == m->n_unreach)
        m->unreach_head = m->n_unreach = 0;
    if (k)
        m->next_unreach_at = now + m->hb_ms / UNREACH_PACE;
}

static void session_msg(void *arg, ProtobufCMessage *msg)
{
    const Cohort__V1__SessionReply *r = (const Cohort__V1__SessionReply *)msg;
    struct member *m = arg;
    struct epoch *e = NULL;
    const char *why = NULL;
    uint64_t now = clock_now_ms();
    int rc;

    /* Anything the broker sends down the stream says it holds this
     * member's session and its heartbeats arrive. */
    pthread_mutex_lock(&m->lock);
    if (m->state == ST_JOINED) {
        heard_locked(m, now);
        m->watch_heard = true;
        if (r->beat)
            beat_locked(m, r->beat, now);
    }
    pthread_mutex_unlock(&m->lock);
    if (!r->epoch) {
        protobuf_c_message_free_unpacked(msg, NULL);
        return;
    }
    rc = epoch_from_proto(r->epoch, &e, &why);
    protobuf_c_message_free_unpacked(msg, NULL);
    if (rc < 0) {
        log_warn("member", "The broker sent an epoch that does not check; it was ignored.",
                 LF_S("cohort", m->cohort), LF_S("id", m->id),
                 LF_S("reason", why ? why : log_strerror(rc)));
        return;
    }
    pthread_mutex_lock(&m->lock);
    if ((m->epoch && e->number <= m->epoch->number) || strcmp(e->cohort, m->cohort) != 0) {
        pthread_mutex_unlock(&m->lock);
        epoch_unref(e);
        return;
    }
    epoch_unref(m->epoch);
    m->epoch = epoch_ref(e);
    unreach_clear_locked(m);
    if (e->number > m->last_epoch)
        m->last_epoch = e->number;
    m->behind_since = 0;
    pthread_mutex_unlock(&m->lock);
    /* Stream messages arrive one at a time, so callbacks keep epoch order. */
    log_epoch(m, e);
    if (m->on_epoch)
        m->on_epoch(m->arg, e);
    epoch_unref(e);
}

static void watch_end(void *arg, const struct rpc_status *st)
{
    struct member *m = arg;

    pthread_mutex_lock(&m->lock);
    m->watch_ended = true;
    if (m->state == ST_JOINED) {
        if (st->code == RPC_NOT_FOUND) {
            log_emit(info_level(m), "member", "The broker ended this member's session stream; "
                     "rejoining.",
                     LF_S("cohort", m->cohort), LF_S("id", m->id), LF_S("detail", st->message),
                     LOG_END);
            m->state = ST_JOINING;
            m->next_join_at = clock_now_ms();
        } else if (st->code == RPC_UNAUTHENTICATED) {
            refused_locked(m, "Session", st, clock_now_ms());
        } else if (st->code != RPC_CANCELLED) {
            log_failure(m, "The session stream broke; reopening.", st);
        }
    }
    pthread_mutex_unlock(&m->lock);
}

static void start_join_locked(struct member *m)
{
    Cohort__V1__JoinRequest q = COHORT__V1__JOIN_REQUEST__INIT;
    Cohort__V1__Proof pf;
    uint8_t mac[SECRET_MAC_BYTES];

    q.protocol_version = WIRE_PROTOCOL_VERSION;
    q.cohort = m->cohort;
    q.id = m->id;
    q.address = m->address;
    q.model_version = m->model_version;
    q.session = m->session;
    q.heartbeat_ms = m->want_hb_ms;
    q.timeout_ms = m->want_to_ms;
    q.last_epoch = m->last_epoch;
    sign_locked(m, &q.base, &q.proof, &pf, mac);
    m->join_gen++;
    m->declare_pending = false;     /* the join carries the version */
    if (rpc_call_async(m->ch, WIRE_BROKER_JOIN, &q.base, &cohort__v1__join_reply__descriptor,
                       JOIN_TIMEOUT_MS, 0, join_done, m) == 0) {
        m->join_inflight = true;
        m->inflight++;
    } else {
        m->next_join_at = backoff_next(m, clock_now_ms());
    }
}

static void lost_clear_locked(struct member *m)
{
    for (size_t i = 0; i < m->n_lost; i++)
        free(m->lost[i]);
    m->n_lost = 0;
}

/* What the member reports of a checkpoint it skipped, in `skip`; NULL for
 * none. */
static Cohort__V1__CheckpointSkipped *skipped_locked(const struct member *m,
                                                     Cohort__V1__CheckpointSkipped *skip)
{
    if (!m->ckpt_skipped_version)
        return NULL;
    skip->version = m->ckpt_skipped_version;
    skip->reason = m->ckpt_skipped_reason;
    return skip;
}

/* Fills heartbeat `q` with what the member reports now, signed with the
 * next seq: the oldest queued unreachable peers, whose ids it points
 * `ids` at. `skip`, `pf`, `mac` and `ids` must outlive the send. */
static void fill_beat_locked(struct member *m, Cohort__V1__HeartbeatRequest *q,
                             Cohort__V1__CheckpointSkipped *skip, Cohort__V1__Proof *pf,
                             uint8_t mac[SECRET_MAC_BYTES], char *ids[WIRE_UNREACHABLE_MAX])
{
    q->protocol_version = WIRE_PROTOCOL_VERSION;
    q->cohort = m->cohort;
    q->id = m->id;
    q->session = m->session;
    q->model_version = m->model_version;
    q->declare_version = m->declare_pending;
    /* Epochs reach the user from the stream's callback, so the latest one
     * received is the one the user runs in: the broker counts on it to
     * know when a drained member may go. */
    q->epoch = m->epoch ? m->epoch->number : 0;
    q->n_lost_peers = m->n_lost;
    q->lost_peers = m->lost;
    q->n_unreachable_peers = unreach_batch_locked(m, ids);
    q->unreachable_peers = q->n_unreachable_peers ? ids : NULL;
    q->checkpoint_version = m->ckpt_version;
    q->checkpoint_skipped = skipped_locked(m, skip);
    sign_locked(m, &q->base, &q->proof, pf, mac);
}

/* What a heartbeat reported went out, `n_unreach` unreachable peers
 * among it: declares and lost peers are sent once (a report is evidence
 * of a moment, and a lost heartbeat's is not worth a retry: the timeout
 * still works), and the unreachable peers still queued go in the next. */
static void beat_sent_locked(struct member *m, size_t n_unreach, uint64_t now)
{
    m->declare_pending = false;
    lost_clear_locked(m);
    unreach_sent_locked(m, n_unreach, now);
    m->next_hb_at = now + m->hb_ms;
}

/* Closes the datagram socket of a stream that is over or given up. */
static void dg_close_locked(struct member *m)
{
    if (m->dg_fd >= 0)
        close(m->dg_fd);
    m->dg_fd = -1;
    m->dg_heard_at = 0;
    m->dg_n = 0;
}

/* Once at warn, then at debug: a network that drops UDP to the broker
 * does so for every stream, and saying it each time tells nothing new. */
static void dg_say_locked(struct member *m, const char *why, int err)
{
    log_emit(!m->dg_told && !m->quiet ? LOG_WARN : LOG_DEBUG, "member",
             "The broker's datagram port does not answer; heartbeats go up the session stream.",
             LF_S("cohort", m->cohort), LF_S("id", m->id), LF_S("reason", why), LF_ERR(err),
             LOG_END);
    m->dg_told = true;
}

/* The socket cannot be used: datagrams stop for the rest of this stream. */
static void dg_fail_locked(struct member *m, const char *why, int err)
{
    dg_say_locked(m, why, err);
    m->dg_failed = true;
    dg_close_locked(m);
}

/* Whether the broker acknowledged a datagram recently enough that a plain
 * heartbeat may go as a datagram alone: within half the timeout. Past
 * that, one lost acknowledgement or a network that stopped carrying UDP
 * would leave the member silent to the broker for more than half its
 * timeout, so the stream carries each heartbeat too until an
 * acknowledgement comes. An interval shorter than half the timeout
 * (dg_ready_locked) keeps a heartbeat up the stream in time. */
static bool dg_fresh(const struct member *m, uint64_t now)
{
    return m->dg_heard_at && now - m->dg_heard_at <= m->to_ms / 2;
}

/* Whether this heartbeat may go as a datagram: offered, the socket
 * sound, the stream connected (the socket goes where it goes), and a
 * timeout of more than two intervals (dg_fresh). */
static bool dg_ready_locked(struct member *m)
{
    struct sockaddr_storage sa;
    socklen_t len = sizeof(sa);
    int rc;

    if (!m->dg_offered || m->dg_failed || !m->watch || !m->watch_heard ||
        m->to_ms <= 2 * m->hb_ms)
        return false;
    if (m->dg_fd >= 0)
        return true;
    rc = rpc_watch_peer(m->watch, &sa, &len);
    if (rc == -ENOTCONN)
        return false;
    if (rc == 0)
        rc = dgram_connect((struct sockaddr *)&sa, len);
    if (rc < 0) {
        dg_fail_locked(m, "no address to send datagrams to", rc);
        return false;
    }
    m->dg_fd = rc;
    return true;
}

/* Sends a plain heartbeat as one datagram, signed with the next seq,
 * asking for an acknowledgement when `want_ack`. Returns 0 (sent, or
 * dropped by a full socket buffer as a network may drop it), or -errno:
 * the socket cannot send. */
static int dg_send_locked(struct member *m, bool want_ack)
{
    Cohort__V1__HeartbeatDatagram q = COHORT__V1__HEARTBEAT_DATAGRAM__INIT;
    Cohort__V1__CheckpointSkipped skip = COHORT__V1__CHECKPOINT_SKIPPED__INIT;
    Cohort__V1__Proof pf;
    uint8_t mac[SECRET_MAC_BYTES], buf[WIRE_DATAGRAM_MAX];
    ssize_t n;
    int rc;

    q.protocol_version = WIRE_PROTOCOL_VERSION;
    q.cohort = m->cohort;
    q.id = m->id;
    q.session = m->session;
    q.model_version = m->model_version;
    q.epoch = m->epoch ? m->epoch->number : 0;
    q.checkpoint_version = m->ckpt_version;
    q.checkpoint_skipped = skipped_locked(m, &skip);
    q.want_ack = want_ack;
    rc = proof_sign(&m->key, &q.base, ++m->seq, proof_now_ms(), &pf, mac);
    if (rc < 0)
        return rc;
    q.proof = &pf;
    n = dgram_pack(&q, buf);
    if (n < 0)
        return (int)n;
    if (send(m->dg_fd, buf, (size_t)n, MSG_DONTWAIT | MSG_NOSIGNAL) < 0 && errno != EAGAIN &&
        errno != EWOULDBLOCK && errno != ENOBUFS)
        return -errno;
    if (m->dg_n++ == 0) {
        m->dg_first_seq = m->seq;
        m->dg_acked_seq = m->seq - 1;
    }
    return 0;
}

/* Reads the broker's acknowledgements waiting on the datagram socket. One
 * that proves the key and names a datagram of this stream not yet
 * acknowledged counts as the stream's acknowledgements do (session_msg);
 * anything else is dropped. Returns 0, or -errno when the socket cannot
 * receive (ECONNREFUSED: nothing listens on the broker's UDP port). */
static int dg_read_locked(struct member *m, uint64_t now)
{
    uint8_t buf[WIRE_DATAGRAM_MAX + 1];

    for (int i = 0; i < 8; i++) {
        Cohort__V1__HeartbeatDatagramAck *a = NULL;
        ssize_t n = recv(m->dg_fd, buf, sizeof(buf), MSG_DONTWAIT | MSG_TRUNC);

        if (n < 0)
            return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? 0 : -errno;
        if (dgram_unpack_ack(buf, (size_t)n, &a) < 0)
            continue;
        if (a->session == m->session && a->seq > m->dg_acked_seq && a->seq >= m->dg_first_seq &&
            a->seq <= m->seq && proof_ack_valid(&m->key, m->cohort, m->id, a)) {
            Cohort__V1__HeartbeatReply r = COHORT__V1__HEARTBEAT_REPLY__INIT;

            m->dg_acked_seq = a->seq;
            m->dg_heard_at = now;
            heard_locked(m, now);
            r.epoch = a->epoch;
            r.drained = a->drained;
            beat_locked(m, &r, now);
        }
        protobuf_c_message_free_unpacked(&a->base, NULL);
    }
    return 0;
}

static void start_heartbeat_locked(struct member *m, uint64_t now)
{
    Cohort__V1__HeartbeatRequest q = COHORT__V1__HEARTBEAT_REQUEST__INIT;
    Cohort__V1__CheckpointSkipped skip = COHORT__V1__CHECKPOINT_SKIPPED__INIT;
    Cohort__V1__Proof pf;
    uint8_t mac[SECRET_MAC_BYTES];
    char *ids[WIRE_UNREACHABLE_MAX];
    int rc;

    /* Plain heartbeats go as datagrams where they can; a declare or a
     * report goes up the stream, which delivers it or says it did not.
     * The broker acknowledges a datagram that asks: one does every
     * quarter timeout, and every one while none is fresh. */
    if (!m->declare_pending && m->n_lost == 0 && !unreach_pending(m) && dg_ready_locked(m)) {
        bool fresh = dg_fresh(m, now);

        rc = dg_send_locked(m, !fresh || now - m->dg_heard_at >= m->to_ms / 4);
        if (rc < 0) {
            dg_fail_locked(m, "a datagram could not be sent", rc);
        } else if (fresh) {
            beat_sent_locked(m, 0, now);
            return;
        } else if (m->dg_heard_at == 0 && m->dg_n >= 3 && !m->dg_told) {
            dg_say_locked(m, "three datagrams of this stream, none acknowledged", -ETIMEDOUT);
        }
        /* Not fresh: the stream carries this heartbeat too. */
    }
    fill_beat_locked(m, &q, &skip, &pf, mac, ids);
    rc = rpc_watch_send(m->watch, &q.base);
    if (rc == 0)
        beat_sent_locked(m, q.n_unreachable_peers, now);
    else if (rc == -EBUSY)
        m->next_hb_at = now + POLL_MAX_MS / 4;    /* the previous one is still going out */
    else
        m->next_hb_at = now + m->hb_ms;     /* the stream is ending; it is reopened */
}

/* Opens the session stream; its first message is a heartbeat, which
 * attaches it to this member's session. */
static void open_watch_locked(struct member *m, uint64_t now)
{
    Cohort__V1__HeartbeatRequest q = COHORT__V1__HEARTBEAT_REQUEST__INIT;
    Cohort__V1__CheckpointSkipped skip = COHORT__V1__CHECKPOINT_SKIPPED__INIT;
    Cohort__V1__Proof pf;
    uint8_t mac[SECRET_MAC_BYTES];
    char *ids[WIRE_UNREACHABLE_MAX];

    fill_beat_locked(m, &q, &skip, &pf, mac, ids);
    m->watch_ended = false;
    m->watch_reopen = false;
    m->watch_heard = false;
    m->dg_failed = false;
    dg_close_locked(m);
    if (rpc_watch_open(m->ch, WIRE_BROKER_SESSION, &q.base, &cohort__v1__session_reply__descriptor,
                       RPC_DUPLEX, session_msg, watch_end, m, &m->watch) < 0) {
        m->watch = NULL;
        m->next_watch_at = backoff_next(m, now);
        return;
    }
    beat_sent_locked(m, q.n_unreachable_peers, now);
}

static uint32_t until(uint64_t at, uint64_t now, uint32_t cur)
{
    uint64_t d = at > now ? at - now : 0;
    return d < cur ? (uint32_t)d : cur;
}

/* Called without the member's lock, which it takes to sign. */
static int leave_call(struct member *m, uint32_t timeout_ms, struct rpc_status *st)
{
    Cohort__V1__LeaveRequest q = COHORT__V1__LEAVE_REQUEST__INIT;
    ProtobufCMessage *reply = NULL;
    Cohort__V1__Proof pf;
    uint8_t mac[SECRET_MAC_BYTES];
    int rc;

    q.protocol_version = WIRE_PROTOCOL_VERSION;
    q.cohort = m->cohort;
    q.id = m->id;
    pthread_mutex_lock(&m->lock);
    q.session = m->session;
    sign_locked(m, &q.base, &q.proof, &pf, mac);
    pthread_mutex_unlock(&m->lock);
    rc = rpc_call(m->ch, WIRE_BROKER_LEAVE, &q.base, &cohort__v1__leave_reply__descriptor, timeout_ms,
                  0, &reply, st);
    if (reply)
        protobuf_c_message_free_unpacked(reply, NULL);
    return rc;
}

uint32_t member_poll(struct member *m, uint64_t now)
{
    uint32_t wait = POLL_MAX_MS;
    int rc;

    pthread_mutex_lock(&m->lock);
    if (m->rejoin_wanted && m->state == ST_JOINED) {
        struct rpc_watch *w = m->watch;
        struct rpc_status st;
        m->rejoin_wanted = false;
        m->watch = NULL;
        m->state = ST_JOINING;
        pthread_mutex_unlock(&m->lock);
        rpc_watch_close(w);
        leave_call(m, 1000, &st);
        pthread_mutex_lock(&m->lock);
        /* A new session: the broker must see a new member, not a rejoin. */
        if (getrandom(&m->session, sizeof(m->session), 0) != sizeof(m->session))
            m->session ^= clock_now_us();
        if (m->session == 0)
            m->session = 1;
        m->next_join_at = now;
        log_emit(info_level(m), "member", "Rejoining with a new session to resync the cohort.",
                 LF_S("cohort", m->cohort), LF_S("id", m->id), LOG_END);
    }
    /* The session stream is replaced when it ended, was found behind, or
     * belongs to a session state we left. Closing blocks until its callbacks are done,
     * so it happens without our lock. */
    if (m->watch && (m->watch_ended || m->watch_reopen || m->state != ST_JOINED)) {
        struct rpc_watch *w = m->watch;
        bool failed = m->watch_ended && !m->watch_reopen;
        m->watch = NULL;
        pthread_mutex_unlock(&m->lock);
        rpc_watch_close(w);
        pthread_mutex_lock(&m->lock);
        m->next_watch_at = failed ? backoff_next(m, now) : now;
    }
    switch (m->state) {
    case ST_LEFT:
        break;
    case ST_JOINING:
        if (!m->join_inflight && now >= m->next_join_at)
            start_join_locked(m);
        if (!m->join_inflight)
            wait = until(m->next_join_at, now, wait);
        break;
    case ST_JOINED:
        if (m->dg_fd >= 0 && !m->dg_failed && (rc = dg_read_locked(m, now)) < 0)
            dg_fail_locked(m, "the datagram socket could not receive", rc);
        if (!m->watch && now >= m->next_watch_at)
            open_watch_locked(m, now);
        if (!m->watch)
            wait = until(m->next_watch_at, now, wait);
        if (m->watch && !m->watch_ended &&
            (now >= m->next_hb_at || m->declare_pending || m->n_lost ||
             (unreach_pending(m) && now >= m->next_unreach_at)))
            start_heartbeat_locked(m, now);
        wait = until(m->next_hb_at, now, wait);
        if (unreach_pending(m) && m->next_unreach_at > now)
            wait = until(m->next_unreach_at, now, wait);
        break;
    }
    pthread_mutex_unlock(&m->lock);
    return wait;
}

int member_create(const struct member_config *cfg, struct member **out)
{
    struct member *m;
    int rc = -ENOMEM;

    if (!cfg->broker || !ident_valid_cohort(cfg->cohort) || !ident_valid_member_id(cfg->id) ||
        !ident_valid_address(cfg->address))
        return -EINVAL;
    m = calloc(1, sizeof(*m));
    if (!m)
        return -ENOMEM;
    pthread_mutex_init(&m->lock, NULL);
    pthread_cond_init(&m->idle, NULL);
    m->broker = strdup(cfg->broker);
    m->cohort = strdup(cfg->cohort);
    m->id = strdup(cfg->id);
    m->address = strdup(cfg->address);
    if (!m->broker || !m->cohort || !m->id || !m->address)
        goto err;
    /* Sessions tell a rejoin from a duplicate; they must not repeat. */
    if (getrandom(&m->session, sizeof(m->session), 0) != sizeof(m->session))
        m->session = clock_wall_ms() ^ ((uint64_t)getpid() << 32);
    if (m->session == 0)
        m->session = 1;
    m->rng = m->session | 1;
    m->dg_fd = -1;
    m->model_version = cfg->model_version;
    m->want_hb_ms = cfg->heartbeat_ms;
    m->want_to_ms = cfg->timeout_ms;
    m->backoff_max_ms = cfg->backoff_max_ms ? cfg->backoff_max_ms : LIMIT_BACKOFF_MAX_MS;
    if (m->backoff_max_ms < BACKOFF_MIN_MS)
        m->backoff_max_ms = BACKOFF_MIN_MS;
    m->backoff_ms = BACKOFF_MIN_MS;
    m->quiet = cfg->quiet;
    m->on_epoch = cfg->on_epoch;
    m->arg = cfg->arg;
    m->state = ST_JOINING;
    if (cfg->key) {
        m->key = *cfg->key;
        m->has_key = true;
    }
    if (cfg->channel) {
        m->ch = cfg->channel;
    } else {
        struct rpc_channel_opts o = { .max_backoff_ms = m->backoff_max_ms,
                                      .tls_ca_pem = cfg->tls_ca_pem,
                                      .tls_server_name = cfg->tls_server_name };
        rc = rpc_channel_create(m->broker, &o, &m->ch);
        if (rc < 0)
            goto err;
        m->own_ch = true;
    }
    *out = m;
    return 0;
err:
    secret_wipe(&m->key);
    free(m->broker);
    free(m->cohort);
    free(m->id);
    free(m->address);
    pthread_cond_destroy(&m->idle);
    pthread_mutex_destroy(&m->lock);
    free(m);
    return rc;
}

void member_set_model_version(struct member *m, uint64_t version, bool declare)
{
    pthread_mutex_lock(&m->lock);
    m->model_version = version;
    if (declare)
        m->declare_pending = true;
    pthread_mutex_unlock(&m->lock);
}

/* Queues `peer` on the lost peers (`list`, `n`), once. Lock held. */
static int report_locked(char **list, size_t *n, const char *peer)
{
    char *dup;

    for (size_t i = 0; i < *n; i++)
        if (strcmp(list[i], peer) == 0)
            return 0;
    if (*n == WIRE_LOST_PEERS_MAX)
        return -ENOSPC;
    dup = strdup(peer);
    if (!dup)
        return -ENOMEM;
    list[(*n)++] = dup;
    return 0;
}

int member_report_lost(struct member *m, const char *peer)
{
    int rc;

    if (!ident_valid_member_id(peer) || strcmp(peer, m->id) == 0)
        return -EINVAL;
    pthread_mutex_lock(&m->lock);
    rc = report_locked(m->lost, &m->n_lost, peer);
    pthread_mutex_unlock(&m->lock);
    return rc;
}

int member_report_unreachable(struct member *m, const char *peer, uint64_t epoch)
{
    long pos;
    int rc;

    if (!ident_valid_member_id(peer) || strcmp(peer, m->id) == 0)
        return -EINVAL;
    pthread_mutex_lock(&m->lock);
    if (m->state != ST_JOINED || !m->weighs_unreachable)
        rc = -EOPNOTSUPP;
    else if (!m->epoch || m->epoch->number != epoch)
        rc = -ESTALE;
    else if ((pos = epoch_find(m->epoch, peer)) < 0)
        rc = -ENOENT;
    else
        rc = unreach_push_locked(m, (size_t)pos);
    pthread_mutex_unlock(&m->lock);
    return rc;
}

void member_set_checkpoint(struct member *m, uint64_t version, uint64_t skipped_version,
                           unsigned skipped_reason)
{
    pthread_mutex_lock(&m->lock);
    m->ckpt_version = version;
    m->ckpt_skipped_version = skipped_version;
    m->ckpt_skipped_reason = skipped_version ? skipped_reason : 0;
    pthread_mutex_unlock(&m->lock);
}

bool member_datagrams(struct member *m)
{
    bool on;

    pthread_mutex_lock(&m->lock);
    on = m->dg_fd >= 0 && !m->dg_failed && dg_fresh(m, clock_now_ms());
    pthread_mutex_unlock(&m->lock);
    return on;
}

struct epoch *member_epoch(struct member *m)
{
    struct epoch *e;

    pthread_mutex_lock(&m->lock);
    e = m->epoch ? epoch_ref(m->epoch) : NULL;
    pthread_mutex_unlock(&m->lock);
    return e;
}

bool member_in_cohort(struct member *m)
{
    bool in;

    pthread_mutex_lock(&m->lock);
    /* Silent past the timeout means the broker has evicted us by now. */
    in = m->state == ST_JOINED && m->epoch && epoch_find(m->epoch, m->id) >= 0 &&
         clock_now_ms() - m->last_ok_at < m->to_ms;
    pthread_mutex_unlock(&m->lock);
    return in;
}

bool member_drained(struct member *m)
{
    bool drained;

    pthread_mutex_lock(&m->lock);
    drained = m->state == ST_JOINED && m->drained;
    pthread_mutex_unlock(&m->lock);
    return drained;
}

uint32_t member_timeout_ms(struct member *m)
{
    uint32_t t;

    pthread_mutex_lock(&m->lock);
    t = m->to_ms ? m->to_ms : WIRE_DEFAULT_TIMEOUT_MS;
    pthread_mutex_unlock(&m->lock);
    return t;
}

uint64_t member_joins(struct member *m)
{
    uint64_t n;

    pthread_mutex_lock(&m->lock);
    n = m->joins;
    pthread_mutex_unlock(&m->lock);
    return n;
}

uint64_t member_refusals(struct member *m)
{
    uint64_t n;

    pthread_mutex_lock(&m->lock);
    n = m->refusals;
    pthread_mutex_unlock(&m->lock);
    return n;
}

void member_rejoin(struct member *m)
{
    pthread_mutex_lock(&m->lock);
    m->rejoin_wanted = true;
    pthread_mutex_unlock(&m->lock);
}

int member_leave(struct member *m, uint32_t timeout_ms)
{
    struct rpc_watch *w;
    struct rpc_status st;
    bool joined;
    int rc;

    pthread_mutex_lock(&m->lock);
    joined = m->state == ST_JOINED;
    m->state = ST_LEFT;
    w = m->watch;
    m->watch = NULL;
    pthread_mutex_unlock(&m->lock);
    if (!joined) {
        rpc_watch_close(w);
        return 0;
    }
    /* The Leave first: the broker ends the watch itself then, where a
     * watch closed first would look to it like a death for a moment. */
    rc = leave_call(m, timeout_ms, &st);
    rpc_watch_close(w);
    if (rc == 0) {
        log_emit(info_level(m), "member", "Left the cohort.", LF_S("cohort", m->cohort),
                 LF_S("id", m->id), LOG_END);
    } else {
        log_warn("member", "The leave did not reach the broker; it will evict this member once "
                 "it sees the stream gone, or at the timeout.",
                 LF_S("cohort", m->cohort), LF_S("id", m->id), LF_S("code", rpc_code_name(st.code)));
    }
    return rc;
}

void member_destroy(struct member *m)
{
    if (!m)
        return;
    pthread_mutex_lock(&m->lock);
    m->state = ST_LEFT;
    pthread_mutex_unlock(&m->lock);
    if (m->watch)
        rpc_watch_close(m->watch);
    /* Callbacks of calls in flight name us; let them finish first. */
    pthread_mutex_lock(&m->lock);
    while (m->inflight > 0)
        pthread_cond_wait(&m->idle, &m->lock);
    pthread_mutex_unlock(&m->lock);
    if (m->own_ch)
        rpc_channel_destroy(m->ch);
    epoch_unref(m->epoch);
    dg_close_locked(m);
    secret_wipe(&m->key);
    free(m->broker);
    free(m->cohort);
    free(m->id);
    free(m->address);
    lost_clear_locked(m);
    unreach_clear_locked(m);
    pthread_cond_destroy(&m->idle);
    pthread_mutex_destroy(&m->lock);
    free(m);
}

int member_matchmake(struct member *m, Cohort__V1__MatchmakeRequest *q, rpc_msg_fn on_msg,
                     rpc_end_fn on_end, void *arg, struct rpc_watch **out)
{
    Cohort__V1__Proof pf;
    uint8_t mac[SECRET_MAC_BYTES];
    int rc;

    pthread_mutex_lock(&m->lock);
    if (m->state != ST_JOINED) {
        pthread_mutex_unlock(&m->lock);
        return -ENOTCONN;
    }
    q->protocol_version = WIRE_PROTOCOL_VERSION;
    q->cohort = m->cohort;
    q->id = m->id;
    q->session = m->session;
    q->proof = NULL;
    sign_locked(m, &q->base, &q->proof, &pf, mac);
    /* Opened under the lock, so that the seq goes out in the order signed
     * with respect to this member's own calls. */
    rc = rpc_watch_open(m->ch, WIRE_BROKER_MATCHMAKE, &q->base,
                        &cohort__v1__matchmake_reply__descriptor, 0, on_msg, on_end, arg, out);
    pthread_mutex_unlock(&m->lock);
    q->proof = NULL;
    return rc;
}

int member_state_donors(struct member *m, Cohort__V1__StateDonorsRequest *q,
                        uint32_t timeout_ms, Cohort__V1__StateDonorsReply **reply,
                        struct rpc_status *st)
{
    struct rpc_pending *p = NULL;
    ProtobufCMessage *got = NULL;
    Cohort__V1__Proof pf;
    uint8_t mac[SECRET_MAC_BYTES];
    int rc;

    pthread_mutex_lock(&m->lock);
    if (m->state != ST_JOINED) {
        pthread_mutex_unlock(&m->lock);
        return -ENOTCONN;
    }
    q->protocol_version = WIRE_PROTOCOL_VERSION;
    q->cohort = m->cohort;
    q->id = m->id;
    q->session = m->session;
    q->proof = NULL;
    sign_locked(m, &q->base, &q->proof, &pf, mac);
    /* Started under the lock, so that the seq goes out in the order
     * signed with respect to this member's own calls; waited on outside
     * it. The call's own deadline bounds the wait. */
    rc = rpc_call_start(m->ch, WIRE_BROKER_STATE_DONORS, &q->base,
                        &cohort__v1__state_donors_reply__descriptor, timeout_ms, 0, &p);
    pthread_mutex_unlock(&m->lock);
    q->proof = NULL;
    if (rc < 0)
        return rc;
    rc = rpc_call_finish(p, &got, st);
    if (rc == 0 && !got)
        rc = -EPROTO;
    if (rc == 0)
        *reply = (Cohort__V1__StateDonorsReply *)got;
    return rc;
}

/* src/membership/proof.c: see proof.h. */
#include "membership/proof.h"

#include <errno.h>
#include <string.h>
#include <time.h>

#include "membership/wire.h"

/* Join's 12; Heartbeat's 10, 3 for checkpoints, and two counts with
 * their ids: up to WIRE_LOST_PEERS_MAX lost peers and up to
 * WIRE_UNREACHABLE_MAX unreachable ones (about 17 KiB of parts on the
 * stack at most). */
#define MAX_PARTS (15 + WIRE_LOST_PEERS_MAX + WIRE_UNREACHABLE_MAX)

uint64_t proof_now_ms(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* The integers of one MAC input, kept apart so that each part can point
 * at its own 8 bytes. */
struct ints {
    uint64_t version, session, seq, time_ms, a, b, c, d, e, f, g, n_lost, n_unreachable;
    bool more;                  /* a Heartbeat's optional checkpoint parts */
};

static const char *str(const char *s)
{
    return s ? s : "";
}

/* A heartbeat's checkpoint parts (wire.h), either kind. */
static void checkpoint_ints(struct ints *v, uint64_t version,
                            const Cohort__V1__CheckpointSkipped *skipped)
{
    v->e = version;
    v->f = skipped ? skipped->version : 0;
    v->g = skipped ? skipped->reason : 0;
}

/* Fills parts[] with wire.h's MAC input for `req`. Returns the count, or
 * 0 for a message that carries no proof. */
static size_t mac_input(const ProtobufCMessage *req, uint64_t seq, uint64_t time_ms,
                        struct ints *v, struct secret_part *parts)
{
    const ProtobufCMessageDescriptor *d = req->descriptor;
    const char *method, *cohort, *id = "";
    size_t n = 0;

    memset(v, 0, sizeof(*v));
    v->seq = seq;
    v->time_ms = time_ms;
    if (d == &cohort__v1__join_request__descriptor) {
        const Cohort__V1__JoinRequest *q = (const Cohort__V1__JoinRequest *)req;
        method = "Join";
        v->version = q->protocol_version;
        cohort = q->cohort;
        id = q->id;
        v->session = q->session;
        v->a = q->model_version;
        v->b = q->heartbeat_ms;
        v->c = q->timeout_ms;
        v->d = q->last_epoch;
    } else if (d == &cohort__v1__heartbeat_request__descriptor) {
        const Cohort__V1__HeartbeatRequest *q = (const Cohort__V1__HeartbeatRequest *)req;
        method = "Heartbeat";
        v->version = q->protocol_version;
        cohort = q->cohort;
        id = q->id;
        v->session = q->session;
        v->a = q->model_version;
        v->b = q->declare_version ? 1 : 0;
        v->c = q->epoch;
        v->more = q->checkpoint_version != 0 || q->checkpoint_skipped != NULL;
        checkpoint_ints(v, q->checkpoint_version, q->checkpoint_skipped);
    } else if (d == &cohort__v1__heartbeat_datagram__descriptor) {
        const Cohort__V1__HeartbeatDatagram *q = (const Cohort__V1__HeartbeatDatagram *)req;
        method = "HeartbeatDatagram";
        v->version = q->protocol_version;
        cohort = q->cohort;
        id = q->id;
        v->session = q->session;
        v->a = q->model_version;
        v->b = q->want_ack ? 1 : 0;
        v->c = q->epoch;
        v->more = true;
        checkpoint_ints(v, q->checkpoint_version, q->checkpoint_skipped);
    } else if (d == &cohort__v1__leave_request__descriptor) {
        const Cohort__V1__LeaveRequest *q = (const Cohort__V1__LeaveRequest *)req;
        method = "Leave";
        v->version = q->protocol_version;
        cohort = q->cohort;
        id = q->id;
        v->session = q->session;
    } else if (d == &cohort__v1__watch_request__descriptor) {
        const Cohort__V1__WatchRequest *q = (const Cohort__V1__WatchRequest *)req;
        method = "Watch";
        v->version = q->protocol_version;
        cohort = q->cohort;
        id = q->id;
        v->session = q->session;
    } else if (d == &cohort__v1__status_request__descriptor) {
        const Cohort__V1__StatusRequest *q = (const Cohort__V1__StatusRequest *)req;
        method = "Status";
        v->version = q->protocol_version;
        cohort = q->cohort;
    } else if (d == &cohort__v1__matchmake_request__descriptor) {
        const Cohort__V1__MatchmakeRequest *q = (const Cohort__V1__MatchmakeRequest *)req;
        method = "Matchmake";
        v->version = q->protocol_version;
        cohort = q->cohort;
        id = q->id;
        v->session = q->session;
        v->a = q->target_group_size;
        v->b = q->min_group_size;
        v->c = q->min_matchmaking_ms;
        v->d = q->timeout_ms;
    } else if (d == &cohort__v1__state_donors_request__descriptor) {
        const Cohort__V1__StateDonorsRequest *q = (const Cohort__V1__StateDonorsRequest *)req;
        method = "StateDonors";
        v->version = q->protocol_version;
        cohort = q->cohort;
        id = q->id;
        v->session = q->session;
        v->a = q->declare ? 1 : 0;
        v->b = q->allow ? 1 : 0;
        memcpy(&v->c, &q->priority, sizeof(v->c));
        v->d = q->expiry_ms;
    } else {
        return 0;
    }
    parts[n++] = SECRET_STR(method);
    parts[n++] = SECRET_U64(v->version);
    parts[n++] = SECRET_STR(str(cohort));
    parts[n++] = SECRET_STR(str(id));
    parts[n++] = SECRET_U64(v->session);
    parts[n++] = SECRET_U64(v->seq);
    parts[n++] = SECRET_U64(v->time_ms);
    if (d == &cohort__v1__join_request__descriptor) {
        parts[n++] = SECRET_STR(str(((const Cohort__V1__JoinRequest *)req)->address));
        parts[n++] = SECRET_U64(v->a);
        parts[n++] = SECRET_U64(v->b);
        parts[n++] = SECRET_U64(v->c);
        parts[n++] = SECRET_U64(v->d);
    } else if (d == &cohort__v1__heartbeat_request__descriptor) {
        const Cohort__V1__HeartbeatRequest *q = (const Cohort__V1__HeartbeatRequest *)req;

        parts[n++] = SECRET_U64(v->a);
        parts[n++] = SECRET_U64(v->b);
        parts[n++] = SECRET_U64(v->c);
        if (v->more) {
            parts[n++] = SECRET_U64(v->e);
            parts[n++] = SECRET_U64(v->f);
            parts[n++] = SECRET_U64(v->g);
        }
        if (q->n_lost_peers > WIRE_LOST_PEERS_MAX ||
            q->n_unreachable_peers > WIRE_UNREACHABLE_MAX)
            return 0;           /* nothing this long is signed or accepted */
        /* The lost peers' count goes in, even 0, when unreachable ones
         * follow, so that the two lists can never be read as one. */
        if (q->n_lost_peers > 0 || q->n_unreachable_peers > 0) {
            v->n_lost = q->n_lost_peers;
            parts[n++] = SECRET_U64(v->n_lost);
            for (size_t i = 0; i < q->n_lost_peers; i++)
                parts[n++] = SECRET_STR(str(q->lost_peers[i]));
        }
        if (q->n_unreachable_peers > 0) {
            v->n_unreachable = q->n_unreachable_peers;
            parts[n++] = SECRET_U64(v->n_unreachable);
            for (size_t i = 0; i < q->n_unreachable_peers; i++)
                parts[n++] = SECRET_STR(str(q->unreachable_peers[i]));
        }
    } else if (d == &cohort__v1__heartbeat_datagram__descriptor) {
        parts[n++] = SECRET_U64(v->a);
        parts[n++] = SECRET_U64(v->b);
        parts[n++] = SECRET_U64(v->c);
        parts[n++] = SECRET_U64(v->e);
        parts[n++] = SECRET_U64(v->f);
        parts[n++] = SECRET_U64(v->g);
    } else if (d == &cohort__v1__matchmake_request__descriptor) {
        const Cohort__V1__MatchmakeRequest *q = (const Cohort__V1__MatchmakeRequest *)req;

        parts[n++] = SECRET_STR(str(q->prefix));
        parts[n++] = SECRET_STR(str(q->group_bits));
        parts[n++] = SECRET_U64(v->a);
        parts[n++] = SECRET_U64(v->b);
        parts[n++] = SECRET_U64(v->c);
        parts[n++] = SECRET_U64(v->d);
        parts[n++] = (struct secret_part){ q->schema.data, q->schema.len };
    } else if (d == &cohort__v1__state_donors_request__descriptor) {
        const Cohort__V1__StateDonorsRequest *q = (const Cohort__V1__StateDonorsRequest *)req;

        parts[n++] = SECRET_STR(str(q->prefix));
        parts[n++] = SECRET_U64(v->a);
        parts[n++] = SECRET_U64(v->b);
        parts[n++] = SECRET_U64(v->c);
        parts[n++] = SECRET_U64(v->d);
        parts[n++] = SECRET_STR(str(q->state_address));
    }
    return n;
}

static int compute(const struct secret *k, const ProtobufCMessage *req, uint64_t seq,
                   uint64_t time_ms, uint8_t mac[SECRET_MAC_BYTES])
{
    struct secret_part parts[MAX_PARTS];
    struct ints v;
    size_t n = mac_input(req, seq, time_ms, &v, parts);

    if (n == 0)
        return -EINVAL;
    return secret_mac(k, WIRE_PROOF_LABEL, parts, n, mac);
}

int proof_sign(const struct secret *k, const ProtobufCMessage *req, uint64_t seq,
               uint64_t time_ms, Cohort__V1__Proof *p, uint8_t mac[SECRET_MAC_BYTES])
{
    int rc = compute(k, req, seq, time_ms, mac);

    if (rc < 0)
        return rc;
    cohort__v1__proof__init(p);
    p->seq = seq;
    p->time_ms = time_ms;
    p->mac.data = mac;
    p->mac.len = SECRET_MAC_BYTES;
    return 0;
}

bool proof_valid(const struct secret *k, const ProtobufCMessage *req, const Cohort__V1__Proof *p)
{
    uint8_t want[SECRET_MAC_BYTES];
    bool ok;

    if (!p || p->mac.len != SECRET_MAC_BYTES || !p->mac.data)
        return false;
    if (compute(k, req, p->seq, p->time_ms, want) < 0)
        return false;
    ok = secret_mac_equal(want, p->mac.data);
    memset(want, 0, sizeof(want));
    return ok;
}

/* wire.h's input for an acknowledgement's MAC. */
static int ack_mac(const struct secret *k, const char *cohort, const char *id,
                   const Cohort__V1__HeartbeatDatagramAck *a, uint8_t mac[SECRET_MAC_BYTES])
{
    uint64_t session = a->session, seq = a->seq, epoch = a->epoch, drained = a->drained ? 1 : 0;
    struct secret_part parts[] = {
        SECRET_STR("HeartbeatDatagramAck"), SECRET_STR(str(cohort)), SECRET_STR(str(id)),
        SECRET_U64(session), SECRET_U64(seq), SECRET_U64(epoch), SECRET_U64(drained),
    };

    return secret_mac(k, WIRE_PROOF_LABEL, parts, sizeof(parts) / sizeof(parts[0]), mac);
}

int proof_sign_ack(const struct secret *k, const char *cohort, const char *id,
                   Cohort__V1__HeartbeatDatagramAck *a, uint8_t mac[SECRET_MAC_BYTES])
{
    int rc = ack_mac(k, cohort, id, a, mac);

    if (rc < 0)
        return rc;
    a->mac.data = mac;
    a->mac.len = SECRET_MAC_BYTES;
    return 0;
}

bool proof_ack_valid(const struct secret *k, const char *cohort, const char *id,
                     const Cohort__V1__HeartbeatDatagramAck *a)
{
    uint8_t want[SECRET_MAC_BYTES];
    bool ok;

    if (a->mac.len != SECRET_MAC_BYTES || !a->mac.data)
        return false;
    if (ack_mac(k, cohort, id, a, want) < 0)
        return false;
    ok = secret_mac_equal(want, a->mac.data);
    memset(want, 0, sizeof(want));
    return ok;
}

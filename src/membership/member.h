/* src/membership/member.h: one member's side of the broker protocol: join, heartbeat,
 * receive epochs, rejoin after an eviction or a broker restart, leave.
 *
 * Driven, not threaded: the owner calls member_poll() from one thread of
 * its own (the sidecar's main loop, or a simulator driving thousands of
 * members); calls to the broker complete on rpc's completion threads. So
 * one process can run one member or ten thousand with the same code.
 *
 * Protocol 2: after its Join the member keeps one session stream open
 * to the broker (wire.h, WIRE_BROKER_SESSION). Its heartbeats go up that
 * stream, each signed; epochs and the broker's acknowledgements come down
 * it. The stream opens with a heartbeat, so opening it is a sign of life.
 *
 * Recovery rules:
 * - A failed join is retried with capped exponential backoff and jitter.
 * - A session stream that ends with NOT_FOUND means the broker forgot this
 *   member (evicted, or restarted): rejoin at once.
 * - A stream that breaks otherwise is reopened after backoff. An
 *   acknowledgement naming a newer epoch than the stream delivered also
 *   reopens it, so a lost push costs one heartbeat interval, not a
 *   timeout.
 * - The session id is fixed for the life of the member: after a transient
 *   outage the broker recognises the rejoin as the same member.
 * - With a key, every call carries a proof of it (wire.h), numbered from 1
 *   for the life of the member. A call the broker refuses as
 *   UNAUTHENTICATED (a wrong or missing key, a clock too far off) cannot
 *   succeed by retrying at once: the member logs it once at error level
 *   and tries to join again with a backoff that grows to 30 s, until the
 *   broker takes its key (a broker may learn a cohort's key after the
 *   cohort's pods start). The member reads its key once: a new key needs
 *   a new member.
 */
#ifndef COHORT_MEMBER_H
#define COHORT_MEMBER_H

#include <stdbool.h>
#include <stdint.h>

#include "membership/epoch.h"
#include "rpc/rpc.h"

struct secret;

struct member;
struct rpc_channel;

/* Runs on a completion thread for every new epoch (numbers only grow).
 * `e` is borrowed: take epoch_ref() to keep it. Keep it short. */
typedef void (*member_epoch_fn)(void *arg, struct epoch *e);

struct member_config {
    const char *broker;         /* broker address; copied */
    const char *cohort;         /* copied */
    const char *id;             /* copied */
    const char *address;        /* advertised data address; copied */
    uint64_t model_version;
    uint32_t heartbeat_ms;      /* 0: the cohort's */
    uint32_t timeout_ms;        /* 0: the cohort's */
    uint32_t backoff_max_ms;    /* 0: LIMIT_BACKOFF_MAX_MS (base/limits.h) */
    bool quiet;                 /* log at debug instead of info (simulators) */
    member_epoch_fn on_epoch;   /* may be NULL */
    void *arg;                  /* borrowed */
    struct rpc_channel *channel;  /* optional shared channel, borrowed; NULL: own one */
    const struct secret *key;   /* the cohort's key, copied; NULL: calls carry no
                                 * proof (a broker without keys only) */
    /* TLS to the broker, for the member's own channel (ignored with
     * `channel`): the CA certificates, PEM, copied; NULL: plaintext. The
     * name the broker's certificate must carry when it is not the
     * broker address's host; NULL: that host. */
    const char *tls_ca_pem;
    const char *tls_server_name;
};

/* Creates a member; nothing is sent until the first member_poll(). Needs
 * rpc_init(). Returns 0, -EINVAL (invalid names or address), -ENOMEM. The
 * caller frees *out with member_destroy(). */
int member_create(const struct member_config *cfg, struct member **out);

/* Does what is due at `now` (start a join, send a heartbeat, reopen the
 * session stream)
 * and returns the milliseconds until the next thing falls due (at most
 * 100). Call it from one thread only. */
uint32_t member_poll(struct member *m, uint64_t now);

/* Records a new model version; with `declare`, it was set by the trainer
 * (a checkpoint load) and is sent at the next poll so it can move the
 * leadership; otherwise it rides the next regular heartbeat. */
void member_set_model_version(struct member *m, uint64_t version, bool declare);

/* Reports that this member's data connection to member `peer` was reset
 * (copied): evidence that peer died, which the broker weighs
 * (broker_report_lost). Sent in a heartbeat at the next member_poll(),
 * once. Returns 0 (queued, or already queued), -EINVAL (an invalid id, or
 * this member's own), -ENOSPC (WIRE_LOST_PEERS_MAX are queued already),
 * -ENOMEM. */
int member_report_lost(struct member *m, const char *peer);

/* Reports that this member's host has heard nothing from member `peer`'s
 * host (copied) for the member timeout while it had a connection to it
 * open or being dialled, in epoch `epoch`: evidence that peer is cut off,
 * which the broker weighs (broker_report_unreachable). Queued, oldest
 * first, once while it waits: the next member_poll() sends a heartbeat
 * with the first queued, as many as the broker takes (its JoinReply's
 * unreachable_max, up to WIRE_UNREACHABLE_MAX and WIRE_UNREACHABLE_BYTES
 * of ids; WIRE_LOST_PEERS_MAX from a broker that names none), and the
 * rest follow, as many in each later heartbeat, two an interval at most
 * (brokerd.c bounds a stream's pace). The queue holds each member of the epoch once at most;
 * another epoch's arrival drops it, since the broker counts a report for
 * the epoch it names only. Returns 0 (queued, or already queued),
 * -EINVAL (an invalid id, or this member's own), -EOPNOTSUPP (not
 * joined, or the broker does not weigh such reports), -ESTALE (`epoch`
 * is not the latest this member received), -ENOENT (`peer` is not a
 * member of it), -ENOMEM. */
int member_report_unreachable(struct member *m, const char *peer, uint64_t epoch);

/* Records what the member's heartbeats report of checkpoints (the
 * newest written or resumed from; the newest skipped as invalid and why;
 * 0 for none): they ride the next heartbeat. */
void member_set_checkpoint(struct member *m, uint64_t version, uint64_t skipped_version,
                           unsigned skipped_reason);

/* True while this member's plain heartbeats go as datagrams alone
 * (wire.h, "datagram heartbeats"): the broker offered them and
 * acknowledged one within half the member's timeout. Otherwise they go up
 * the session stream (as well, while datagrams are tried). */
bool member_datagrams(struct member *m);
/* The latest epoch received, with a reference for the caller, or NULL. */
struct epoch *member_epoch(struct member *m);
/* True while the member has joined and its latest epoch lists it. */
bool member_in_cohort(struct member *m);
/* True while the broker drains this member (a scale-down): it stays
 * joined but the cohort's epochs leave it out. */
bool member_drained(struct member *m);
/* The member timeout the broker granted (its default until joined). */
uint32_t member_timeout_ms(struct member *m);
/* Counters for tests and benchmarks: joins that succeeded, and calls the
 * broker refused as UNAUTHENTICATED. */
uint64_t member_joins(struct member *m);
uint64_t member_refusals(struct member *m);

/* Leaves and joins again with a new session, at the next member_poll():
 * the broker sees a membership change and publishes a new epoch to every
 * member. For a data-plane failure that no membership change explains
 * (a peer timing out, members out of step): moolib's "resync". */
void member_rejoin(struct member *m);

/* Leaves gracefully: a Leave call bounded by timeout_ms, after which the
 * member stays out until destroyed. Returns 0 or the call's -errno. */
int member_leave(struct member *m, uint32_t timeout_ms);

/* Closes the session stream and frees the member; no Leave is sent (a crash looks
 * the same to the broker). Must not be called on a completion thread.
 * NULL is fine. */
void member_destroy(struct member *m);

/* Opens a Matchmake call (membership/matchmaker.h) as this member: fills
 * q's protocol_version, cohort, id and session (the caller fills what it
 * asks for), signs it with the member's next seq when it has a key, and
 * opens the stream on the member's channel with rpc_watch_open's
 * callbacks and contract (`q` is borrowed for the call). Returns 0,
 * -ENOTCONN while the member has not joined, or rpc_watch_open's -errno.
 * The caller closes *out with rpc_watch_close(). */
int member_matchmake(struct member *m, Cohort__V1__MatchmakeRequest *q, rpc_msg_fn on_msg,
                     rpc_end_fn on_end, void *arg, struct rpc_watch **out);

/* A StateDonors call as this member, waiting at most timeout_ms: fills q's
 * protocol_version, cohort, id and session, signs it like
 * member_matchmake (q is borrowed for the call). Returns 0 and sets
 * *reply (the caller frees it with protobuf_c_message_free_unpacked), or
 * -ENOTCONN while the member has not joined, or the call's -errno with
 * st filled. */
int member_state_donors(struct member *m, Cohort__V1__StateDonorsRequest *q,
                        uint32_t timeout_ms, Cohort__V1__StateDonorsReply **reply,
                        struct rpc_status *st);

#endif

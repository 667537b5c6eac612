/* src/membership/broker.h: the broker's state machine: cohorts, members, epochs.
 *
 * Pure logic, no I/O and no clock of its own: every entry point takes `now`
 * (monotonic milliseconds), so tests drive it with an injected clock. Not
 * thread-safe: the host (brokerd) serialises calls with one mutex.
 *
 * Soft state only. After a restart the broker rebuilds every cohort from
 * the members that rejoin; a joiner reports the highest epoch it saw, so
 * epoch numbers keep growing across restarts.
 *
 * Rules (docs/architecture.md repeats them for users):
 * - Member order: natural order of ids (ident_natural_cmp), so "c-2" comes
 *   before "c-10" and every member computes the same schedule.
 * - Leader: the member with the highest model version; ties go to the first
 *   member in member order.
 * - A new epoch forms when membership changes (a new member, a leave, an
 *   eviction, a rejoin with a new session or address) or when a declared
 *   model version would change the leader. Changes within coalesce_ms of
 *   the first pending change share one epoch. A set of changes that cancels
 *   out (a join and a leave of the same session) forms none.
 * - No epoch forms before start + startup_hold_ms, so that the members
 *   rejoining a restarted broker land in one epoch, not one each. The
 *   same hold starts at the first join after evictions left a cohort
 *   empty (a broker cut off from every member evicts them all, and they
 *   come back one at a time after the heal, as after a restart): an
 *   epoch of the first one back alone would let it train a history of
 *   its own while the others still run theirs.
 * - A member leaves its epochs by a Leave, by silence past its timeout,
 *   or, when its watch stream is cut without a Leave (its process died),
 *   after stream_grace_ms; at once when a peer also reported it lost
 *   (broker_report_lost). A report alone evicts nobody: any member may lie.
 * - Members report peers they cannot reach (broker_report_unreachable),
 *   each in a heartbeat that runs in the current epoch; the reports about
 *   one member count together within its report window: one member
 *   timeout per round a member needs to probe all its peers
 *   (limit_reach_rounds, base/limits.h: at most 8 up to 16,385 members),
 *   since that is how long it takes every peer to have probed it. A member is
 *   evicted at once and benched (its joins refused for a while,
 *   BROKER_BENCH_* below, so that a member cut from its peers but not
 *   from the broker does not rejoin, stall the next epoch's rounds and be
 *   evicted again, over and over) when
 *   - more than half of the epoch report it, the accused counted in the
 *     epoch but never accusing itself: one lying member never suffices;
 *   - exactly half of an even epoch of four or more report it, the
 *     epoch's leader among them: of two equal halves the leader's goes
 *     on; the leader's report only breaks the tie;
 *   - it and one peer report each other, without a lapse of a window,
 *     for a whole window, at least one of the two reported by its partner
 *     alone (a cut between two members only), and it is the one of the
 *     two more of the epoch report; else the one that is not the leader;
 *     else the later joiner. A report of one member about another that
 *     still reaches it is never mutual and never evicts
 *   (docs/architecture.md, "Eviction", has the reasoning).
 * - Versions advanced by committed rounds (declare == false) are recorded,
 *   shown in status and used at the next election, but never force one:
 *   members report them at different moments, and electing on that skew
 *   would abort rounds for nothing.
 */
#ifndef COHORT_BROKER_H
#define COHORT_BROKER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "membership/epoch.h"
#include "membership/wire.h"

struct broker;                          /* opaque */

struct broker_config {
    uint32_t heartbeat_ms;      /* default heartbeat interval (WIRE_DEFAULT_HEARTBEAT_MS) */
    uint32_t timeout_ms;        /* default member timeout (WIRE_DEFAULT_TIMEOUT_MS) */
    uint32_t coalesce_ms;       /* epoch coalescing window (50) */
    /* No epoch before start + this: broker_startup_hold_ms(heartbeat_ms),
     * so that every member of a restarted broker is back before the first
     * epoch forms. */
    uint32_t startup_hold_ms;
    uint32_t max_members;       /* per cohort (4096) */
    uint32_t max_cohorts;       /* (1024) */
    /* The longest member timeout a join may ask for beyond its cohort's
     * own (BROKER_MEMBER_TIMEOUT_CAP_MS; 0 means that too). */
    uint32_t max_timeout_ms;
    /* How long a member whose watch stream ended without a Leave (its
     * connection reset or closed: its process died) stays in, so that a
     * reconnect of the same session can win (BROKER_STREAM_GRACE_MS).
     * Silence alone still takes the member timeout. */
    uint32_t stream_grace_ms;
    bool allow_any_cohort;      /* a join to an unknown cohort creates it */
};

/* Fills *cfg with the defaults above. */
void broker_config_default(struct broker_config *cfg);

/* The startup hold that covers the longest a member takes to reach a
 * restarted broker again, for heartbeat interval `heartbeat_ms`:
 * - its channel's reconnect backoff at its cap: LIMIT_BACKOFF_MAX_MS plus
 *   gRPC's 20 % jitter (RPC_RECONNECT_MAX_MS);
 * - then its next try of the call that failed: a heartbeat interval (a
 *   protocol 1 member's next Heartbeat) or the member's own backoff, also
 *   capped at LIMIT_BACKOFF_MAX_MS (a protocol 2 member's stream reopen);
 * - then one heartbeat interval for its Join's round trip.
 * A member at version 0 that is back first (a new trainer behind an old
 * sidecar) must not form an epoch alone while members that carry the
 * cohort's state are still in their backoff: it would lead, and train a
 * second history (docs/chaos.md). Saturates at UINT32_MAX. */
uint32_t broker_startup_hold_ms(uint32_t heartbeat_ms);

/* Epochs are the shared type of epoch.h: published with one reference per
 * holder, immutable, and dropped with epoch_unref() on any thread. */

/* How the broker talks to the host about watchers. A watcher is the host's
 * handle for one member's membership stream; the broker stores it borrowed
 * and never dereferences it. */
struct broker_watch_ops {
    /* Deliver `e` to each of the `n` watchers. Called from inside
     * broker_tick() (new epochs) and broker_watch() (the current epoch for
     * a new watcher). The callee takes its own reference if it keeps e. */
    void (*publish)(void *arg, struct epoch *e, void *const *watchers, size_t n);
    /* The broker forgets `watcher` and will not name it again. err says
     * why: -ETIMEDOUT evicted, -EHOSTUNREACH evicted as unreachable by
     * most of its epoch (broker_report_unreachable), -ENOENT left,
     * -EEXIST replaced by a newer watch of the same member, -ESHUTDOWN
     * cohort removed or broker destroyed. */
    void (*detach)(void *arg, void *watcher, int err);
    void *arg;
};

/* Creates a broker that started at `now`. `cfg` and `ops` are copied;
 * ops->arg is borrowed. Returns 0, -EINVAL for a config that cannot work
 * (a zero interval, timeout <= heartbeat, zero caps), -ENOMEM. The caller
 * frees *out with broker_destroy(). */
int broker_create(const struct broker_config *cfg, const struct broker_watch_ops *ops,
                  uint64_t now, struct broker **out);
/* Detaches every watcher (-ESHUTDOWN) and frees everything. NULL is fine. */
void broker_destroy(struct broker *b);

/* Declares a cohort, or updates the settings of an existing one (members
 * keep the settings they joined with). 0 for heartbeat_ms/timeout_ms means
 * the broker's defaults. Returns 0, -EINVAL (bad name, timeout <= heartbeat),
 * -ENOSPC (max_cohorts), -ENOMEM. `name` is copied. */
int broker_cohort_declare(struct broker *b, const char *name, uint32_t heartbeat_ms,
                          uint32_t timeout_ms);
/* Removes a cohort and its members, detaching their watchers (-ESHUTDOWN).
 * Returns 0 or -ENOENT. */
int broker_cohort_remove(struct broker *b, const char *name);

struct broker_join {
    const char *cohort;         /* all strings borrowed, copied if kept */
    const char *id;
    const char *address;
    uint64_t model_version;
    uint64_t session;           /* nonzero */
    uint64_t last_epoch;
    uint32_t heartbeat_ms;      /* 0: the cohort's */
    uint32_t timeout_ms;        /* 0: the cohort's */
    /* The sequence number of the join's proof (membership/wire.h), whose
     * MAC the host has checked; 0: the join proved nothing (an open
     * cohort), and no replay rule applies to its session. */
    uint64_t seq;
};

/* The default longest member timeout a join may ask for beyond its
 * cohort's own (10 min): a join that asked for days would otherwise hold
 * a cohort's rounds that long once it stops answering. */
#define BROKER_MEMBER_TIMEOUT_CAP_MS 600000u
/* The shortest heartbeat interval a join may ask for, unless its cohort's
 * own is shorter: a member that asked for 1 ms would make the broker
 * answer a thousand heartbeats a second. */
#define BROKER_HEARTBEAT_FLOOR_MS 100u
/* The default stream grace: longer than a member takes to reopen a
 * watch it closed itself (a reopen after a missed push is one call on a
 * live channel), far shorter than a member timeout. */
#define BROKER_STREAM_GRACE_MS 300u
/* Retired sessions the broker remembers (wire.h's replay rules): a member
 * that left, or was evicted, after a proved join. The oldest is forgotten
 * first when more retire within the time they are kept. */
#define BROKER_RETIRED_MAX 16384u
/* How long a retired session is remembered: twice the clock skew a Join's
 * time may have, after which every Join it ever made is out of the time
 * window. */
#define BROKER_RETIRED_KEEP_MS (2u * WIRE_PROOF_SKEW_MS + 1000u)

struct broker_join_result {
    uint32_t heartbeat_ms;      /* effective */
    uint32_t timeout_ms;        /* effective */
    uint64_t epoch;             /* latest published, 0 if none */
    uint64_t benched_ms;        /* -EAGAIN: how long its bench lasts yet */
};

/* Adds a member, or refreshes it when the same id comes back with the same
 * session (a rejoin: heartbeat time, address and version are updated; a new
 * address is a membership change). What the member asked for is clamped:
 * the heartbeat to at least the smaller of the cohort's and
 * BROKER_HEARTBEAT_FLOOR_MS, the timeout to at most the larger of the
 * cohort's and max_timeout_ms; *res says what was granted. With a
 * nonzero j->seq the replay rules of wire.h apply: a rejoin's seq must be
 * new, a session that left may not come back, and one that was evicted
 * only with a seq above its last. Nothing changes when it fails. Returns
 * 0, -EINVAL (bad id, address, zero session, timeout <= heartbeat once
 * clamped), -ENOENT (unknown cohort and !allow_any_cohort), -EEXIST (the
 * id is held by a live member with another session), -EAGAIN (the id is
 * benched: evicted as unreachable; res->benched_ms says for how much
 * longer), -EALREADY (a
 * replayed or retired session's join), -ENOSPC (max_members or
 * max_cohorts), -ENOMEM. */
int broker_join(struct broker *b, uint64_t now, const struct broker_join *j,
                struct broker_join_result *res);

/* What a member reports of checkpoints (HeartbeatRequest): kept as it
 * said, for the operator; the broker decides nothing from it. */
struct broker_checkpoint {
    uint64_t version;           /* newest written or resumed from; 0: none */
    uint64_t skipped_version;   /* newest found invalid; 0: none */
    uint32_t skipped_reason;    /* ckpt.h's enum ckpt_reason, as reported */
};

struct broker_beat {
    uint64_t model_version;
    bool declare;               /* the trainer set this version (see the rules) */
    uint64_t adopted;           /* the epoch the member runs in; 0 if none */
    struct broker_checkpoint ckpt;  /* what it reports of checkpoints */
};

struct broker_beat_result {
    uint64_t epoch;             /* latest published: lets a member see a missed push */
    bool drained;               /* draining, and the latest epoch leaves it out */
    uint32_t heartbeat_ms;      /* the member's, as granted at its join */
    uint32_t timeout_ms;
};

/* Accepts `seq`, the sequence number of a proved request of member `id`
 * with `session`, at most once (wire.h): above the highest accepted, or
 * one of the WIRE_PROOF_SEQ_WINDOW below it not yet seen. The host calls
 * it, under the same lock, before the Heartbeat, Leave or Watch the proof
 * came with. Returns 0 (recorded), -ENOENT (no such member session), or
 * -EALREADY (a replay, or too old). */
int broker_accept_seq(struct broker *b, const char *cohort, const char *id, uint64_t session,
                      uint64_t seq);

/* Records liveness, the model version and the epoch the member adopted
 * (an epoch not yet published counts as the latest published).
 * Fills *res when not NULL. Returns 0 or -ENOENT (unknown cohort, unknown
 * member, or a session that is not the member's). */
int broker_heartbeat(struct broker *b, uint64_t now, const char *cohort, const char *id,
                     uint64_t session, const struct broker_beat *beat,
                     struct broker_beat_result *res);

/* Removes the member at once (a graceful leave) and detaches its watcher
 * (-ENOENT). Returns 0 or -ENOENT. */
int broker_leave(struct broker *b, uint64_t now, const char *cohort, const char *id,
                 uint64_t session);

/* Attaches `watcher` (borrowed) to the member; a previous watcher of the
 * member is detached (-EEXIST). If an epoch was published, it is delivered
 * to the new watcher at once through ops->publish. Returns 0 or -ENOENT. */
int broker_watch(struct broker *b, const char *cohort, const char *id, uint64_t session,
                 void *watcher);
/* The watcher attached to member `id` with `session`, or NULL (no such
 * member session, or none attached). Borrowed: valid while the host
 * holds the lock it calls the broker under. */
void *broker_watcher(const struct broker *b, const char *cohort, const char *id,
                     uint64_t session);
/* The host's side of a watcher went away (the client hung up). Forgets it
 * if it is still the member's watcher; no detach callback. */
void broker_unwatch(struct broker *b, const char *cohort, const char *id, void *watcher);

/* The host's side of `watcher` ended without the broker's doing: the
 * client's connection was reset or closed, or it cancelled the call. The
 * broker forgets the watcher (no detach callback) and evicts the member
 * once stream_grace_ms passes without a sign of life from it (a
 * heartbeat, a rejoin or a new watch of the same session). Returns 0, or
 * -ENOENT when `watcher` is not the member's (replaced, or the member is
 * gone): then nothing changes. */
int broker_stream_lost(struct broker *b, uint64_t now, const char *cohort, const char *id,
                       void *watcher);
/* Member `id` (with `session`, a live member of `cohort`) reports that its
 * data connection to member `peer` was reset. Evidence, not a verdict,
 * since any member may lie: a peer reported lost whose own stream is also
 * gone (broker_stream_lost) is evicted at once instead of after the
 * grace; a report against a member whose stream is up changes nothing
 * that member's next sign of life does not undo. Returns 0, -ENOENT (no
 * such reporter session, or no member `peer`), -EINVAL (peer is the
 * reporter itself, or NULL). */
int broker_report_lost(struct broker *b, uint64_t now, const char *cohort, const char *id,
                       uint64_t session, const char *peer);

/* Member `id` (with `session`, a live member of `cohort`), running in
 * epoch `epoch`, reports that its host has heard nothing from member
 * `peer`'s host for a member timeout. Counted only when `epoch` is the
 * latest published and both are in it with the sessions it names (a
 * report about an older membership says nothing of this one); a
 * reporter counts once per accused, and the reports about one accused
 * count together only within its report window of the first (the
 * accused's timeout times limit_reach_rounds(n) for an epoch of n).
 * When the rules above (more than half; exactly half with
 * the leader; a mutual pair that lasted a window) name a member, `peer`
 * or the reporter itself, it is evicted at the next tick and benched.
 * Returns 0 (counted), -ESTALE (another epoch, or not both in it:
 * nothing changes), -ENOENT (no such reporter session, or no member
 * `peer`), -EINVAL (peer is the reporter itself, or NULL), -ENOMEM. */
int broker_report_unreachable(struct broker *b, uint64_t now, const char *cohort, const char *id,
                              uint64_t session, uint64_t epoch, const char *peer);

/* After a member is evicted as unreachable, how long the next epoch
 * waits when other members of the epoch are still reported by members
 * that stay: the reports about the rest of a cut-off side arrive within
 * about this (the engines look every 250 ms), and an epoch formed before
 * them would make them stale, stalling its rounds for another timeout
 * until that side is reported again. */
#define BROKER_VERDICT_SETTLE_MS 1000u
/* How long a member evicted as unreachable is refused a rejoin: its
 * timeout the first time, doubled each time it is evicted so again
 * before a whole bench has passed since its last one ended, up to
 * BROKER_BENCH_MAX_FACTOR timeouts. A member cut from its peers comes
 * back at the end of its bench; if it is still cut, its epoch stalls
 * for one timeout until the others report it again. */
#define BROKER_BENCH_MAX_FACTOR 16u
/* Benched ids one cohort remembers; the oldest is forgotten first. */
#define BROKER_BENCH_MAX 64u

/* Draining takes a member out of the cohort's epochs while it stays
 * connected, so that the others move on without it, at a round boundary,
 * before its pod is deleted (a scale-down). A draining member keeps its
 * heartbeats and its watch; the next epoch leaves it out (a membership
 * change, coalesced like any other) and its heartbeats' results say it
 * is drained. drain == false takes it back in. The mark survives a rejoin
 * of the same session, not an eviction: call again until broker_drained.
 * Returns 0 or -ENOENT (unknown cohort or member). */
int broker_drain(struct broker *b, uint64_t now, const char *cohort, const char *id, bool drain);
/* 1 when `id` can go without disturbing a round: it is not a member at
 * all, or it is draining, the latest epoch leaves it out, and every other
 * member has reported in a heartbeat that it adopted an epoch at least
 * that new. 0 while a drain is under way, or for a member never asked to
 * drain. -ENOENT for an unknown cohort. */
int broker_drained(const struct broker *b, const char *cohort, const char *id);

/* Evicts the members that are due (silent past their timeout, or their
 * stream lost past the grace or with a peer's report: see
 * broker_stream_lost), forms and publishes the epochs that are due. Returns the milliseconds until the next thing
 * that can fall due (an eviction or a coalescing deadline), capped at 1000,
 * so the host knows how long it may sleep. */
uint32_t broker_tick(struct broker *b, uint64_t now);

struct broker_cohort_status {
    char *name;
    uint64_t epoch;             /* latest published, 0 if none */
    char *leader;               /* of that epoch; NULL if none */
    uint32_t heartbeat_ms;
    uint32_t timeout_ms;
    size_t n_members;
    struct epoch_member *members;   /* current members in member order, latest versions */
    bool *draining;                 /* n_members flags: asked to drain */
    struct broker_checkpoint *checkpoints;  /* n_members: as last reported */
};

struct broker_status {
    size_t n_cohorts;
    struct broker_cohort_status *cohorts;   /* sorted by name */
};

/* Snapshots one cohort (name) or all (NULL). Returns 0, -ENOENT (unknown
 * cohort), -ENOMEM. The caller frees *out with broker_status_free(). */
int broker_status(const struct broker *b, const char *cohort, struct broker_status **out);
void broker_status_free(struct broker_status *s);     /* NULL is fine */

/* Copies the data address member `id` of `cohort` joined with, when
 * `session` is its session, into `address` (len bytes). A matchmade group
 * (matchmaker.h) names its members by these, never by addresses the
 * requests carry. Returns 0, -ENOENT (no such member session), or -ENOSPC
 * (too short). */
int broker_member_address(const struct broker *b, const char *cohort, const char *id,
                          uint64_t session, char *address, size_t len);

#endif

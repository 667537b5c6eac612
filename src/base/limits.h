/* src/base/limits.h: the limits that more than one module enforces, each
 * defined once with the reason for its value, so that what one side of a
 * link accepts the other side accepts too. A limit that one file alone
 * enforces stays in that file. Names and addresses are bounded in ident.h
 * (IDENT_NAME_MAX, IDENT_ADDRESS_MAX), beside the rules they belong to. */
#ifndef COHORT_LIMITS_H
#define COHORT_LIMITS_H

#include <stddef.h>

#include "base/ident.h"

/* ---- trainer state ----------------------------------------------------- */

/* A trainer's opaque state (cohort_set_state), in bytes. The trainer
 * library checks it before sending, the sidecar before reading the memfd
 * that carries it, and the node before it broadcasts what it received; a
 * state one of them took and another refused would stall a join. The
 * opaque state is optimizer state and counters, the tensors travel apart,
 * so 1 GiB is ample, and it bounds what a corrupt length read from a
 * socket or a reduction can make a process allocate. */
#define LIMIT_STATE_BYTES (1ull << 30)

/* ---- gRPC -------------------------------------------------------------- */

/* The largest request a server accepts unless told otherwise
 * (rpc_server_opts), in bytes. The broker's requests carry a few names
 * and one address, under 1 KiB; 64 KiB leaves room for the protocol to
 * grow while no client makes the broker buffer more per call. */
#define LIMIT_RPC_REQUEST_BYTES (64u * 1024u)

/* The largest reply a channel accepts unless told otherwise
 * (rpc_channel_opts), in bytes. The broker's largest replies are an epoch
 * of up to 4096 members (its default max_members), each a name and an
 * address, about 2 MiB, and a status listing of its cohorts; 64 MiB holds
 * those with room and still bounds what a broken server can make a client
 * hold. */
#define LIMIT_RPC_REPLY_BYTES (64u * 1024u * 1024u)

/* The longest wait between reconnect attempts (rpc_channel_opts) and
 * between a member's rejoin attempts (member_config), in ms. A member whose
 * broker comes back is in again within a second, well inside the default
 * member timeout, so a broker restart evicts nobody. */
#define LIMIT_BACKOFF_MAX_MS 1000u

/* ---- membership -------------------------------------------------------- */

/* How long a departing member waits for the broker to acknowledge its
 * Leave, in ms: a sidecar shutting down, a node being destroyed, the broker
 * benchmark's leaver. Past it the member goes anyway and the broker evicts
 * it after its member timeout, so the wait only makes the departure quick;
 * 2 s covers a busy broker without holding a shutdown up. */
#define LIMIT_LEAVE_TIMEOUT_MS 2000u

/* The longest heartbeat interval or member timeout the server binaries'
 * flags take (cohort-sidecar, cohort-operator --standalone and its
 * --cohort specs), in ms. Both travel as 32-bit milliseconds (about 49
 * days); a day is far past any useful value and keeps a slip of unit
 * (10h for 10s) from looking like a setting. */
#define LIMIT_MEMBERSHIP_FLAG_MS (24ull * 3600 * 1000)

/* How a waiting all-reduce probes the members of its epoch for
 * reachability (engine/conn.c, "REACHABILITY"), and so how long the broker
 * counts reports about one member together (broker.c, report_window):
 * both sides compute limit_reach_probes() from the epoch's size, so that
 * they agree without a word on the wire.
 *
 * A round probes limit_reach_probes(n) of the n - 1 others and lasts one
 * member timeout, so a member probes everyone in limit_reach_rounds(n)
 * rounds. The node gives up on a silent peer after its reduce timeout
 * (60 s by default) and resyncs into a new epoch, which makes every
 * report made so far stale; a cut-off member must therefore be reported
 * by a majority before then. LIMIT_REACH_ROUNDS rounds of the default 5 s
 * member timeout, plus one to judge the last probe, make 45 s: 15 s
 * before the reduce timeout, for the broker's verdict settle (1 s), the
 * new epoch's delivery and a reporter's queued heartbeats.
 *
 * So an epoch of up to LIMIT_REACH_ROUNDS * LIMIT_REACH_PROBES + 1
 * (513) members is probed LIMIT_REACH_PROBES at a time, and a larger one
 * wider, up to LIMIT_REACH_PROBES_MAX at a time: 1,250 at 10,000
 * members. The cap bounds the sockets a waiting member holds at once
 * (each closed at the next check, a quarter second, once its host
 * answers) and the SYNs a host receives from one member per round; it
 * covers 16,385 members in LIMIT_REACH_ROUNDS rounds, past the 10,000 the
 * broker is sized for, and a larger epoch takes more rounds, each counted by
 * the broker's window, so its reports only come later. */
#define LIMIT_REACH_PROBES 64u
#define LIMIT_REACH_ROUNDS 8u
#define LIMIT_REACH_PROBES_MAX 2048u

/* The members a waiting member of an epoch of n probes per round. */
static inline size_t limit_reach_probes(size_t n)
{
    size_t want = n > 1 ? (n - 2) / LIMIT_REACH_ROUNDS + 1 : 1;

    if (want < LIMIT_REACH_PROBES)
        return LIMIT_REACH_PROBES;
    return want > LIMIT_REACH_PROBES_MAX ? LIMIT_REACH_PROBES_MAX : want;
}

/* The rounds it takes to probe the n - 1 others of an epoch of n: at
 * most LIMIT_REACH_ROUNDS up to 16,385 members. At least one. */
static inline size_t limit_reach_rounds(size_t n)
{
    return n > 1 ? (n - 2) / limit_reach_probes(n) + 1 : 1;
}

/* ---- Kubernetes -------------------------------------------------------- */

/* A namespace name (an RFC 1123 label) and a label value: at most 63 bytes
 * in Kubernetes. A cohort's name is the cohort.dev/cohort label of its
 * pods, so a longer one cannot run. */
#define LIMIT_KUBE_LABEL_MAX 63

/* An object's key in the operator's caches and work queue,
 * "namespace/name", with its NUL: the longest namespace, '/', and the
 * longest object name. */
#define LIMIT_KUBE_KEY_MAX (LIMIT_KUBE_LABEL_MAX + 1 + IDENT_NAME_MAX + 1)

#endif

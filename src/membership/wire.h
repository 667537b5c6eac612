/* src/membership/wire.h: the names both ends of the broker protocol must agree on. */
#ifndef COHORT_WIRE_H
#define COHORT_WIRE_H

/* Bumped on any change that an older peer would misread. (Proofs did not
 * need it: an older member sends none, which a broker with a key refuses
 * as it refuses any request without one.) 2: heartbeats ride the member's
 * Session stream instead of one unary call each. A broker speaks one
 * version and refuses every other with FAILED_PRECONDITION (brokerd.c
 * checks it in one place); cohort upgrades by suspend, upgrade, resume. */
#define WIRE_PROTOCOL_VERSION 2u

/* A cohort's heartbeat interval and member timeout when nobody chose them,
 * in ms: the broker's defaults, and what a member assumes until the
 * broker's Join reply says otherwise (a reply that leaves them 0 means
 * these). Five heartbeats fit in a timeout, so one lost or late heartbeat
 * evicts nobody. */
#define WIRE_DEFAULT_HEARTBEAT_MS 1000u
#define WIRE_DEFAULT_TIMEOUT_MS 5000u

#define WIRE_BROKER_JOIN "/cohort.v1.Broker/Join"
#define WIRE_BROKER_SESSION "/cohort.v1.Broker/Session"
#define WIRE_BROKER_LEAVE "/cohort.v1.Broker/Leave"
#define WIRE_BROKER_STATUS "/cohort.v1.Broker/Status"
#define WIRE_BROKER_MATCHMAKE "/cohort.v1.Broker/Matchmake"
#define WIRE_BROKER_STATE_DONORS "/cohort.v1.Broker/StateDonors"
/* Protocol 1's: a broker of protocol 2 answers them only to refuse. */
#define WIRE_BROKER_HEARTBEAT "/cohort.v1.Broker/Heartbeat"
#define WIRE_BROKER_WATCH "/cohort.v1.Broker/Watch"

/* ---- proofs ------------------------------------------------------------
 *
 * Every request carries a Proof { seq, time_ms, mac } (proto/cohort.proto)
 * that its sender holds the cohort's key (base/secret.h), or for Status
 * the cohort's key or the broker's admin key. proof.c makes and checks it:
 *
 *   mac = HMAC-SHA256(key, WIRE_PROOF_LABEL, parts)
 *
 * where each part is preceded by its length as 8 bytes (secret_mac), and
 * the parts are, in order:
 *
 *   method        "Join", "Heartbeat" (each message up a Session stream),
 *                 "Leave", "Status", "Matchmake" or "StateDonors"
 *                 ("Watch": protocol 1's)
 *   protocol_version, as 8 bytes
 *   cohort        the request's, "" for a Status of every cohort
 *   id            the member's, "" for Status
 *   session       8 bytes, 0 for Status
 *   seq, time_ms  8 bytes each, the proof's own
 *   and then the fields that say what the request does:
 *   Join          address, model_version, heartbeat_ms, timeout_ms,
 *                 last_epoch (integers as 8 bytes)
 *   Heartbeat     model_version, declare_version (8 bytes, 0 or 1), epoch,
 *                 and, only when checkpoint_version is not 0 or
 *                 checkpoint_skipped is present: checkpoint_version,
 *                 checkpoint_skipped's version and reason (0 when absent).
 *                 A member that reports no checkpoint signs what a member
 *                 before checkpoints signed;
 *                 stripping the fields breaks the proof, as any change does;
 *                 and, only when it reports any lost or unreachable peers
 *               (at most WIRE_LOST_PEERS_MAX and WIRE_UNREACHABLE_MAX),
 *                 the number of lost_peers (8 bytes) and each of them;
 *                 then, only when it reports any unreachable_peers, their
 *                 number (8 bytes) and each of them (so a heartbeat that
 *                 reports none is signed as before the fields existed)
 *   HeartbeatDatagram  model_version, want_ack (8 bytes, 0 or 1), epoch,
 *                 checkpoint_version, checkpoint_skipped's version and
 *                 reason (0 when absent), always all six
 * The broker's HeartbeatDatagramAck has a MAC of its own, under the same
 * label and key: "HeartbeatDatagramAck", the cohort, the member's id,
 * then session, seq, epoch and drained (8 bytes each).
 *   Matchmake     prefix, group_bits, target_group_size, min_group_size,
 *                 min_matchmaking_ms, timeout_ms, schema (its bytes)
 *   StateDonors   prefix, declare, allow (8 bytes, 0 or 1 each),
 *                 priority (its IEEE 754 bits as 8 bytes), expiry_ms,
 *                 state_address
 *   Leave, Watch, Status: nothing more.
 *
 * Integers are little-endian. So a proof names one method of one member
 * session of one cohort, and a captured proof cannot carry other values
 * (a longer timeout, another address).
 *
 * Replay is bounded so (brokerd.c and broker.c carry it out):
 * - seq: a member numbers its proofs 1, 2, 3... for as long as it lives.
 *   The broker accepts each seq of a live member session at most once:
 *   above the highest it accepted, or one of the WIRE_PROOF_SEQ_WINDOW
 *   just below it not yet seen (calls on one channel may overtake each
 *   other). A session's first Join marks everything below its seq seen.
 *   This covers every heartbeat on a Session stream (a replayed one
 *   ends the stream as UNAUTHENTICATED), Leave, Matchmake, StateDonors and a rejoin of a live
 *   session.
 * - time_ms: a Join and a Status are refused when their time is more than
 *   WIRE_PROOF_SKEW_MS from the broker's wall clock. This is the clock
 *   assumption: members' and the broker's clocks agree within 2 minutes
 *   (NTP keeps them within a second or so).
 * - A session that left may not join again; one that was evicted may
 *   rejoin only with a seq above the highest accepted from it. The broker
 *   remembers retired sessions for 2 x WIRE_PROOF_SKEW_MS (then their
 *   captured Joins are out of the time window anyway), and at most
 *   BROKER_RETIRED_MAX of them (broker.h).
 * What is not covered: after a broker restart, which forgets everything,
 * a Join captured in the last 2 minutes can be replayed once; and a
 * Status proof can be replayed within its window (a read). TLS keeps
 * proofs from being captured at all.
 */
/* The most peers one heartbeat may report lost; a heartbeat with more is
 * INVALID_ARGUMENT. Also the most unreachable peers a member sends a
 * broker whose JoinReply names no `unreachable_max` (a release before
 * the field, which refuses more), so mixed releases keep working. A
 * reset comes from a ring's two neighbours or a group's few peers, so 16
 * is plenty for lost peers. */
#define WIRE_LOST_PEERS_MAX 16u

/* The most unreachable peers one heartbeat may report to this broker,
 * which its JoinReply announces as `unreachable_max`; a heartbeat with
 * more is INVALID_ARGUMENT. A member on the larger side of a partition
 * must report every member of the other side, up to about 5,000 in the
 * 10,000-member epoch the broker is sized for, within the report window
 * and again every member timeout while the cut lasts (broker.c,
 * report_window; docs/architecture.md, "Eviction"). At two heartbeats
 * an interval, 1,024 a heartbeat is 2,048 a second: a side of 5,000
 * found at once is reported in full within 3 s, and the repeats take
 * under half the rate. What bounds it:
 * - size: WIRE_UNREACHABLE_BYTES below keeps the message under the
 *   broker's request cap (LIMIT_RPC_REQUEST_BYTES, 64 KiB) whatever the
 *   ids' length;
 * - the proof: each id is one more part of the HMAC, about 18 bytes of
 *   SHA-256 input for a 10-byte id, some 20 KiB at 1,024;
 * - the broker's work: a report costs two lookups in a hash index of
 *   the epoch's ids and a bit (broker_report_unreachable), about 0.2 us
 *   under its lock, so 1,024 take about 0.2 ms (bench/broker_reports.c).
 * A member never sends more than its epoch has members: its queue holds
 * each of them once. */
#define WIRE_UNREACHABLE_MAX 1024u

/* The most bytes of unreachable_peers a member puts in one heartbeat, as
 * encoded (each id with its tag and length): 48 KiB, so that the rest of
 * a heartbeat at its largest (a cohort name and an id of IDENT_NAME_MAX,
 * 16 lost peers of as much, the proof and the integers: under 5 KiB)
 * stays under the broker's 64 KiB request cap. 1,024 ids of up to 44
 * bytes fit (pod names are usually shorter); of the longest, 253 bytes,
 * 192 do, and the member sends more heartbeats. */
#define WIRE_UNREACHABLE_BYTES (48u * 1024u)

/* ---- datagram heartbeats ------------------------------------------------
 *
 * A member whose JoinReply says takes_datagrams sends its plain heartbeats
 * (nothing to declare, no peers to report) as UDP datagrams to the
 * address its Session stream is connected to: the broker's port number,
 * over UDP. One datagram is WIRE_DATAGRAM_MAGIC and then a packed
 * HeartbeatDatagram, WIRE_DATAGRAM_MAX bytes at most (an IPv6 packet of
 * the minimum MTU, 1,280 bytes, less its 40-byte header and UDP's 8): a
 * cohort name and an id of IDENT_NAME_MAX take about 520 of them. Why: a
 * heartbeat up a gRPC stream costs the broker a read, a window update
 * written back and gRPC's per-message work (README, "Broker"); a datagram
 * costs one batched read and the proof. Its proof and seq are the same as
 * any request's (above): the session's seq window makes a datagram that
 * overtakes another, or one replayed, count at most once. The broker
 * acknowledges some (the first of each session stream, those that ask
 * with want_ack, and one when the drained flag changes) with a
 * HeartbeatDatagramAck datagram back to the sender:
 * WIRE_DATAGRAM_ACK_MAGIC and the packed message, smaller than the
 * datagram it answers and sent only for a proved one seen for the first
 * time, so nothing is amplified or reflected. An acknowledgement is how
 * the member learns that its datagrams arrive and that the broker holds
 * its session: it asks for one every quarter timeout, and without one for
 * half its timeout it sends each heartbeat up its stream as well until
 * one comes (a send or receive that fails stops datagrams for that
 * stream). A UDP acknowledgement costs the broker a send; one down the
 * stream would cost a gRPC write and a window update to read. */
#define WIRE_DATAGRAM_MAGIC "cHB2"
#define WIRE_DATAGRAM_ACK_MAGIC "cHA2"
#define WIRE_DATAGRAM_MAGIC_LEN 4u
#define WIRE_DATAGRAM_MAX 1232u

#define WIRE_PROOF_LABEL "cohort/broker/v1"
#define WIRE_PROOF_SKEW_MS 120000u
#define WIRE_PROOF_SEQ_WINDOW 64u

#endif

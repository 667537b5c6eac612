/* src/collective/group.h: collectives of any buffer, with any operator, among
 * the members of a cohort, that survive membership changes.
 *
 * A group is one member of a cohort (membership/member.h) with its own
 * engine (engine/allreduce.h), driven by the caller's own calls: every
 * member calls the same collectives in the same program order (SPMD), as
 * with torch.distributed. Calls are numbered from 1 on every member.
 *
 *   group_create(&cfg, &g);
 *   group_wait(g, 60000);                            // in an epoch
 *   group_allreduce(g, grads, n, DTYPE_F32, DTYPE_AVG, 0, 0, 0);
 *
 * What a call promises (the why is in group.c's top comment):
 *   - It returns 0 only with the whole result in the caller's buffer: the
 *     reduction of the inputs of the members of one epoch, bytewise the
 *     same on every member that returns it. On any error the caller's
 *     buffer is untouched: a call is applied whole or not at all.
 *   - An epoch change in the middle of a call, or a peer that dies (its
 *     failure surfaces within the engine's member timeout), makes it retry
 *     on the next epoch from a copy of the input kept for that purpose.
 *   - A member that was in the middle of call k when the others finished
 *     it gets their result of call k, not a new reduction.
 *   - A member that joins late (or comes back after missing calls) lines
 *     up with the others: its next call is numbered as theirs.
 *
 * Threads: the collectives, group_wait and group_destroy belong to one
 * caller thread; group_position and group_stats may be called from any.
 */
#ifndef COHORT_GROUP_H
#define COHORT_GROUP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/ident.h"
#include "engine/dtype.h"

struct secret;
struct group;

/* The largest call by default (its input, or a gather's whole result). */
#define GROUP_DEFAULT_MAX_BYTES ((size_t)1 << 30)
/* How long a call waits by default, retries included. */
#define GROUP_DEFAULT_CALL_TIMEOUT_MS 300000u
/* A gather's record per member: the member id, NUL-padded, then its bytes
 * padded to a multiple of 8. */
#define GROUP_ID_BYTES 256u
/* Divide the input before the sum (mlbench's divide_before): with
 * DTYPE_AVG by the members of the epoch that runs the attempt, with
 * DTYPE_AVG_BY by the denominator. float32 and float64 only. */
#define GROUP_DIVIDE_BEFORE 1u

struct group_config {
    const char *broker;         /* broker address; copied */
    const char *cohort;         /* copied */
    const char *id;             /* this member's id; copied */
    const char *host;           /* numeric address to listen on and advertise */
    uint32_t heartbeat_ms;      /* 0: the cohort's */
    uint32_t timeout_ms;        /* member timeout asked of the broker; 0: the cohort's */
    uint32_t reduce_timeout_ms; /* engine: silence tolerated from a peer; 0: 60 s */
    size_t max_bytes;           /* the largest call; 0: GROUP_DEFAULT_MAX_BYTES */
    const struct secret *key;   /* the cohort's key, copied; NULL: none */
    bool integrity_mac;         /* authenticate every data-plane frame (needs key) */
    const char *tls_ca_pem;     /* TLS to the broker: CA certificates, PEM; NULL: plaintext */
    const char *tls_server_name;/* the name the broker's certificate carries; NULL: its host */
};

/* Starts the member's threads (membership heartbeats); it joins the cohort
 * at once. Needs rpc_init(). Returns 0, -EINVAL (bad names, host, sizes),
 * -ENOMEM, or a socket or thread -errno. The caller frees *out with
 * group_destroy(). */
int group_create(const struct group_config *cfg, struct group **out);

/* Leaves the cohort (the others get a new epoch) and frees the group. No
 * call may be in flight. NULL is fine. */
void group_destroy(struct group *g);

/* Waits until the latest epoch lists this member. Returns 0 or -ETIMEDOUT. */
int group_wait(struct group *g, uint32_t timeout_ms);

/* This member's rank (index in member order) and the number of members
 * in the latest epoch, and that epoch's number. Returns 0, or -ENOTCONN
 * while the latest epoch does not list this member (the outputs are then
 * left alone). */
int group_position(struct group *g, uint32_t *rank, uint32_t *size, uint64_t *epoch);

/* The id of the member at `rank` in the latest epoch, copied into id
 * (IDENT_NAME_MAX + 1 bytes). Returns 0, -ENOTCONN (no epoch yet), -ERANGE. */
int group_member_id(struct group *g, uint32_t rank, char *id, size_t len);

/* All-reduces `count` elements of `type` at buf in place (buf is
 * borrowed for the call; any alignment). op and denominator as the
 * engine's (DTYPE_AVG_BY divides by denominator); flags: 0 or
 * GROUP_DIVIDE_BEFORE. timeout_ms bounds the waits for a usable epoch, all
 * retries together (0: GROUP_DEFAULT_CALL_TIMEOUT_MS); an attempt in
 * progress is bounded by the engine's member timeout on top.
 * Returns 0 with the result in buf, or, with buf untouched:
 *   -EINVAL     bad arguments (type, op, denominator, flags);
 *   -E2BIG      count x size over the group's max_bytes;
 *   -EPROTO     members disagree on the call (count, type or op: their
 *               programs differ), or the result of this call that the
 *               others delivered does not fit it;
 *   -EACCES     the members' keys or integrity settings differ;
 *   -ETIMEDOUT  no epoch completed the call within timeout_ms;
 *   -ENOMEM. */
int group_allreduce(struct group *g, void *buf, size_t count, enum dtype type, enum dtype_op op,
                    double denominator, unsigned flags, uint32_t timeout_ms);

/* Gathers `bytes` at `in` (borrowed for the call) from every member of
 * the epoch that completes the call, which every member calls alike with
 * the same number of bytes. On 0, *out points at the result (owned by
 * the group, valid until its next call or destroy) and *out_len is its
 * length: one record per member in member order, each GROUP_ID_BYTES of
 * the member's id (NUL-padded) and then its bytes padded with zeros to a
 * multiple of 8 (group_record_bytes). Same errors as group_allreduce;
 * -E2BIG also when the whole result would exceed max_bytes. */
int group_allgather(struct group *g, const void *in, size_t bytes, const void **out,
                    size_t *out_len, uint32_t timeout_ms);

/* This member's id: owned by the group, valid until group_destroy. */
const char *group_id(const struct group *g);

/* The size of one member's record in a gather of `bytes` each. */
size_t group_record_bytes(size_t bytes);

/* ---- Calls of several steps, for reducers built on the group
 * (group_powersgd.c). Not for trainers: include/cohort.h has the
 * reducers themselves. */

/* One call whose attempt the caller writes: a few all-reduces with local
 * work between them, applied whole or not at all like any call. */
struct group_steps {
    uint64_t tag;               /* what the call is (shape, kind): compared
                                 * among the members like a call's count */
    size_t out_bytes;           /* the result's length, kept for the sync */
    /* One attempt in `epoch`: runs group_step_allreduce on buffers the
     * caller registered, and on 0 has written out_bytes at out (the
     * group's scratch). The result must be the same bytes on every member
     * that completes it, since a member that was mid-call gets another's
     * copy instead of its own. Returns 0 or a step's error. */
    int (*attempt)(void *arg, struct group *g, uint64_t epoch, void *out);
    void *arg;
};

/* Runs the call to completion, retries and sync included. On 0, *out
 * points at the result (owned by the group, valid until its next call),
 * out_bytes long: this member's, or, when it was mid-call as the others
 * completed it, theirs. Returns group_allreduce's codes; -EINVAL for a
 * missing attempt or an out_bytes of 0. */
int group_steps(struct group *g, const struct group_steps *s, const void **out,
                uint32_t timeout_ms);

/* Within an attempt only: all-reduces count elements of the registered
 * buffer `handle` in place. Returns 0 or the engine's error, which the
 * attempt returns as its own. */
int group_step_allreduce(struct group *g, int handle, size_t count, enum dtype type,
                         enum dtype_op op);

/* Registers bytes at p (borrowed until group_unregister) with the group's
 * engine. Returns a handle, or -ENOSPC when its registrations are full. */
int group_register(struct group *g, void *p, size_t bytes);
void group_unregister(struct group *g, int handle);      /* -1 is fine */

struct group_stats {
    uint64_t calls;             /* completed */
    uint64_t retries;           /* attempts that failed and were tried again */
    uint64_t delivered;         /* calls whose result came from the others */
    uint64_t lined_up;          /* times this member took the others' numbering */
    uint64_t epochs;            /* epochs adopted */
    uint64_t epoch;             /* the epoch that completed the last call */
    uint32_t members;           /* its members */
};
void group_stats(struct group *g, struct group_stats *out);

#endif

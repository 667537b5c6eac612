/* src/averager/averager.h: hivemind's DecentralizedAverager on cohort: one
 * step finds a group through the broker (membership/matchmaker.h) and
 * averages a float32 vector among it, weighted, exactly alike on every
 * member, and gathers each member's small bytes.
 *
 *   averager_create(&cfg, &a);             // joins the cohort
 *   averager_wait(a, 60000);
 *   struct averager_step s = { .data = x, .weight = 1, .alpha = 1,
 *                              .timeout_ms = 30000 };
 *   averager_step(a, &s, &res);           // x is now the group's average
 *   ... res->n peers, res->ids[i], res->gathered ...
 *   averager_result_free(res);
 *
 * What a step promises:
 *   - On 0, every member of the group that the result names holds the same
 *     average bytes: sum(w_i * x_i) / sum(w_i) over exactly the members
 *     res names as contributors (weight > 0), and x moved toward it by
 *     alpha (x += alpha * (avg - x)). With integer-valued data and weights
 *     whose sums float32 represents exactly, the average is exact (without
 *     a codec).
 *   - A peer that stalls or dies past allreduce_timeout_ms fails the
 *     attempt at every member (the engine's member timeout); with retries
 *     allowed, the others ask for a group again, the stalled peer is not
 *     among those asking, and the step completes with the rest. The
 *     result names who was averaged; nothing partial is ever applied: on
 *     any error x is untouched.
 *   - Too few averagers within the step's timeout: -ETIMEDOUT, with the
 *     broker's sentence in averager_last_error().
 *   - With a codec (cfg.codec, engine/codec.h) only the averaged values
 *     travel encoded: weights, gather lengths and gathered bytes stay
 *     exact. Every member contributes (w_i / sum w) x_i, so the sum is the
 *     average itself and stays within the range of the inputs; the result
 *     is the codec's all-reduce of those (allreduce_run_codec: each
 *     partial sum encoded at every hop, the result a value of the codec),
 *     the same bytes on every member. For fp16 its error is at most about
 *     (n + 1) x 2^-11 x max|x| among n members (codec.h gives each
 *     codec's bound per encoding). Averagers of different codecs never
 *     group: the codec is part of the schema the broker compares.
 *   - With a codec plan (cfg.plan: a codec per range of the vector, as
 *     hivemind picks one per tensor) each range travels in its codec:
 *     the plan and the weights go first in an exact call, then the
 *     CODEC_NONE ranges exactly and each other codec's ranges in a call
 *     of their own, with that codec's bound. The step is one: nothing is
 *     written unless every call succeeded, and every member ends with the
 *     same bytes. Averagers of different plans never group; an averager
 *     without tensors joins any plan's group, learns the plan in the
 *     first call (checked against the schema's digest) and reduces its
 *     share of every call, contributing nothing.
 *   - Load balancing: in a group where a member declared a bandwidth or
 *     is a client, member i reduces a part of the round's buffer in
 *     proportion to its bandwidth (a client, none; not given, the mean
 *     of those given), by the engine's butterfly (allreduce_run_parts;
 *     with a codec allreduce_run_parts_codec: each contribution encoded,
 *     each part's float32 sum encoded once by its reducer and decoded
 *     alike by every member, the reducer too: two encodings' error).
 *     Clients come first in the round's member order, so that every
 *     connection they take part in is theirs to dial: a client accepts
 *     none.
 *   - After a step the group bits move (hivemind's key manager): the
 *     member's index in its group, in log2(target) bits, is shifted in at
 *     the right and as many bits drop off at the left, so that with bits
 *     set per peer the next round's groups mix (averager_set_bits).
 *
 * Threads: step, set_bits and destroy belong to one caller thread; the
 * member's heartbeats run on a thread of the averager's own, and so do
 * its declarations as a state donor (see state sharing below).
 */
#ifndef COHORT_AVERAGER_H
#define COHORT_AVERAGER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/ident.h"
#include "engine/codec.h"

struct secret;
struct averager;

#define AVERAGER_GATHER_MAX 65536u      /* bytes one member may gather */
#define AVERAGER_DEFAULT_TIMEOUT_MS 30000u
/* The broker compares a schema of MATCHMAKER_SCHEMA_MAX (64) bytes: the
 * averager's codec takes one (with AVERAGER_SCHEMA_MAC set in it under
 * integrity_mac, so that averagers of different integrity never group), its count eight and its min_vector_size
 * eight (so that groups agree on them, and an averager without tensors
 * learns them from its group), the caller's schema the rest. */
#define AVERAGER_SCHEMA_MAX 47u
#define AVERAGER_SCHEMA_MAC 0x80u
/* With a codec plan (below) the codec's byte is this marker and the
 * plan's digest takes eight more, so the caller's schema is shorter. */
#define AVERAGER_SCHEMA_PLAN 0x7fu
#define AVERAGER_SCHEMA_PLAN_MAX 39u
/* The most ranges of a codec plan. */
#define AVERAGER_PLAN_MAX 256u
/* With a plan the step's exact call begins with the plan, so that an
 * averager without tensors, which has only the digest from the schema,
 * learns it: this many floats, summed over the group: the number of
 * members that wrote it (each member with tensors writes 1), the number
 * of ranges, then for each range its count's low 16 bits, its count's
 * high bits and its codec, every member with tensors writing its own
 * plan (so the sum is k times one plan, exact), zeros after the last. A
 * member with tensors that finds another plan than its own, and an
 * averager without tensors that finds one whose digest is not the
 * schema's, fails the step (-EPROTO) before any later call. */
#define AVERAGER_PLAN_FLOATS (2u + 3u * AVERAGER_PLAN_MAX)

/* One range of a codec plan: the next `count` values travel in `codec`. */
struct averager_range {
    size_t count;                   /* > 0 */
    enum codec codec;
};
/* The most elements an averager without tensors takes from a group,
 * unless configured. */
#define AVERAGER_AUX_COUNT_DEFAULT ((size_t)1 << 26)

struct averager_config {
    const char *broker;             /* broker address; copied */
    const char *cohort;             /* copied */
    const char *id;                 /* this averager's member id; copied */
    const char *host;               /* numeric address to listen on and advertise */
    const struct secret *key;       /* the cohort's key, copied; NULL: none */
    bool integrity_mac;             /* authenticate every data-plane frame (needs key),
                                     * as the node's --integrity mac. Part of what the
                                     * broker compares: averagers group only with those
                                     * of the same setting */
    const char *tls_ca_pem;         /* TLS to the broker (member.h): CA PEM, copied;
                                     * NULL: plaintext */
    const char *tls_server_name;    /* the broker certificate's name; NULL: the
                                     * broker address's host */
    const char *prefix;             /* matchmaking prefix; copied */
    const char *initial_bits;       /* group bits; copied; NULL: "" */
    uint32_t target_group_size;     /* 1..256 */
    uint32_t min_group_size;        /* 1..target */
    uint32_t min_matchmaking_ms;    /* wait this long for others before forming */
    uint32_t allreduce_timeout_ms;  /* silence tolerated from a peer; 0: 30 s */
    uint32_t request_timeout_ms;    /* how long past a matchmaking wait the broker's
                                     * answer may take; 0: 5 s */
    size_t segment_bytes;           /* the engine's pipelining unit (hivemind's
                                     * part_size_bytes), a multiple of 8; 0: the
                                     * engine's default */
    uint32_t leave_timeout_ms;      /* averager_destroy's Leave; 0: the default */
    size_t count;                   /* float32 elements averaged; 0: an auxiliary
                                     * averager without tensors of its own, which
                                     * steps with weight 0 (data unused), joins its
                                     * bucket whatever the others' schema, and
                                     * averages what its group does (count and codec
                                     * from the group's schema, a codec plan from
                                     * the step's first call) */
    size_t max_count;               /* without tensors: the largest count it takes
                                     * from a group (its buffer is sized by it);
                                     * 0: AVERAGER_AUX_COUNT_DEFAULT */
    const void *schema;             /* what is averaged (shapes, dtypes), copied; at
                                     * most AVERAGER_SCHEMA_MAX bytes; averagers
                                     * group only with those that give the same */
    size_t schema_len;
    size_t gather_max;              /* bytes a step may gather; 0: 4096; at most
                                     * AVERAGER_GATHER_MAX. Every round carries
                                     * target x gather_max / 2 floats for it */
    enum codec codec;               /* how the averaged values travel (engine/codec.h);
                                     * CODEC_NONE (0): float32, exact. Part of what
                                     * the broker compares: averagers group only
                                     * with those that give the same codec */
    /* A codec per tensor (hivemind's adaptive compression): plan_len
     * ranges, in order, covering the count values exactly, each sent in
     * its codec; codec is then CODEC_NONE. Copied. Adjacent ranges of one
     * codec are one range, and a plan of one codec is that codec. A step
     * runs the CODEC_NONE values with the weights and gathered bytes in
     * the exact call, then one call per other codec (see averager.c).
     * Part of what the broker compares, by a digest: averagers group only
     * with those of the same plan. An averager without tensors learns a
     * group's plan from its first call (AVERAGER_PLAN_FLOATS). 0: codec
     * for every value. */
    const struct averager_range *plan;
    size_t plan_len;                /* at most AVERAGER_PLAN_MAX */
    /* Load balancing (hivemind's). In a group where any member gives a
     * bandwidth or is a client, the round is a butterfly whose parts
     * follow the bandwidths (allreduce_split); otherwise the ring's equal
     * shares. With a codec too: the butterfly then encodes each
     * contribution and each part's result once (allreduce_run_parts_codec). */
    bool has_bandwidth;             /* false: not given (hivemind's None) */
    double bandwidth;               /* this member's share of the reduction, finite,
                                     * >= 0; 0 reduces nothing */
    bool client_mode;               /* contribute, reduce nothing, and never be
                                     * dialled: every connection is dialled out */
    size_t min_vector_size;         /* hivemind's: in a butterfly round, a member
                                     * whose share is worth fewer elements reduces
                                     * nothing (allreduce_split's min_part). Part
                                     * of the schema: a group agrees on it */
    /* State sharing (averager/avstate.h; see averager_load_state). */
    bool share_state;               /* declare this averager a donor from the start */
    double state_priority;          /* finite; donors of the highest are asked first */
    uint32_t declare_period_ms;     /* re-declare this often; 0: 30 s */
    size_t max_state_bytes;         /* the largest state served or loaded; 0: 1 GiB */
};

/* Checks a codec plan for `count` values and a caller's schema of
 * schema_len bytes, as averager_create does: 0, or -EINVAL with the
 * sentence in why (too many ranges, an empty range, ranges that do not
 * cover the count exactly, a value that is not a codec, a codec given
 * beside the plan, or a schema too long to share with the plan's
 * digest). n of 0 is no plan, and fine. */
int averager_plan_check(const struct averager_range *plan, size_t n, size_t count,
                        enum codec codec, size_t schema_len, char *why, size_t why_len);

/* Joins the cohort (heartbeats start at once). Needs rpc_init(). Returns
 * 0, -EINVAL (bad names, host, sizes, prefix, bits, schema, codec or plan, or
 * integrity_mac without a key), -ENOMEM, or a socket or thread -errno. The caller frees *out with averager_destroy(). */
int averager_create(const struct averager_config *cfg, struct averager **out);
/* Leaves the cohort and frees. No step may be in flight. NULL is fine. */
void averager_destroy(struct averager *a);

/* Waits until the member has joined. Returns 0 or -ETIMEDOUT. */
int averager_wait(struct averager *a, uint32_t timeout_ms);

struct averager_step {
    float *data;                    /* count floats, averaged in place; unused (may
                                     * be NULL) without tensors */
    double weight;                  /* >= 0; 0: auxiliary, contributes nothing; 0
                                     * without tensors */
    double alpha;                   /* (0, 1]: how far x moves toward the average */
    const void *gather;             /* borrowed; gather_len <= gather_max */
    size_t gather_len;
    uint32_t timeout_ms;            /* the whole step, retries included; 0: 30 s */
    bool no_retries;                /* fail at the first failed attempt */
    uint64_t begin_at_ms;           /* hivemind's scheduled_time, in ms since the Unix
                                     * epoch (CLOCK_REALTIME): a group formed earlier
                                     * waits until then (at most until the step's
                                     * timeout) before its all-reduce; 0: at once.
                                     * Groupmates should schedule alike: one that
                                     * waits longer than the others' allreduce
                                     * timeout fails them */
};

struct averager_result {
    uint64_t group;                 /* the broker's group id of the round */
    size_t n;                       /* the group's members */
    char (*ids)[IDENT_NAME_MAX + 1];    /* n ids, in the group's order */
    double *weights;                /* n weights: 0 for auxiliary members */
    const uint8_t **gathered;       /* n pointers into the result */
    size_t *gathered_len;           /* n lengths */
    uint32_t attempts;              /* 1 + retries */
    uint32_t matchmaking_ms;        /* from the successful attempt's request to
                                     * its group: how long matchmaking took */
};

/* One round (see the top). On 0 sets *out (the caller frees it with
 * averager_result_free) and has written data. Otherwise data is
 * untouched and:
 *   -EINVAL     a negative or non-finite weight, or one past FLT_MAX (it
 *               travels as a float32), alpha outside (0, 1], a gather over
 *               gather_max, a weight other than 0 without tensors;
 *   -EMSGSIZE   without tensors: the group averages more than max_count
 *               elements, or a codec or plan with metadata beyond the exact
 *               call's recursive doubling;
 *   -ETIMEDOUT  no group completed the round within timeout_ms (too few
 *               averagers, or every attempt stalled);
 *   -EPROTO     the broker refused the request as disagreeing with the
 *               others waiting (group sizes, schema or codec), or the group's
 *               members disagree on the call, or one sent a codec plan
 *               other than the group's (see AVERAGER_PLAN_FLOATS);
 *   -ENODATA    every member of the group was auxiliary, or none of them
 *               can reduce (all clients or of bandwidth 0);
 *   -EACCES     the members' keys (or integrity settings) differ;
 *   -ECANCELED  averager_abort() was called; -ENOMEM.
 * averager_last_error() says more. */
int averager_step(struct averager *a, const struct averager_step *s,
                  struct averager_result **out);
void averager_result_free(struct averager_result *r);     /* NULL is fine */

/* Makes the step in flight, if any, and every later one fail with
 * -ECANCELED within about 100 ms: a matchmaking wait stops at its next
 * slice, an all-reduce at once (its connections close, so that the
 * groupmates retry without this member as they do for a killed one). A
 * state download in flight (averager_load_state), and every later one,
 * ends with -ECANCELED within about a second. For a host whose caller is
 * gone (avserve: a trainer that died mid-step or mid-download); what is
 * left to do is averager_destroy. Safe from any thread, more than once. */
void averager_abort(struct averager *a);

/* The broker's or the engine's sentence about the last failure (owned by
 * the averager, valid until the next step). */
const char *averager_last_error(const struct averager *a);

/* The current group bits (owned by the averager, valid until the next
 * step or set_bits). */
const char *averager_bits(const struct averager *a);
/* Sets the group bits (copied). Returns 0 or -EINVAL (not 0/1 or too long). */
int averager_set_bits(struct averager *a, const char *bits);

/* This averager's member id and data address (owned by it). */
const char *averager_id(const struct averager *a);

/* ---- state sharing (hivemind's load_state_from_peers) --------------------
 *
 * Every averager runs a state server (avstate.h) on its host. While it
 * shares, a thread of its own declares it to the broker as a donor of its
 * prefix (the StateDonors call: address, priority, an expiry of 1.5
 * declare periods), every declare period and at once when sharing or the
 * priority changes; when it stops sharing it withdraws, and its server
 * refuses. A snapshot of the state is the host's opaque bytes: the server
 * asks for one when a download begins (averager_state_wanted) and the
 * host answers with averager_provide_state, from any thread. */

/* Turns sharing on or off and sets the priority (finite). Returns 0 or
 * -EINVAL. Takes effect at the broker within a request timeout. */
int averager_set_state_sharing(struct averager *a, bool share, double priority);
/* The current setting. */
void averager_state_sharing(struct averager *a, bool *share, double *priority);

/* Waits at most timeout_ms for a downloader to need a snapshot: true
 * then, false at the timeout or once the averager is being destroyed. */
bool averager_state_wanted(struct averager *a, uint32_t timeout_ms);
/* Serves len bytes at blob (copied) from now on. Returns 0, -EFBIG (over
 * max_state_bytes) or -ENOMEM. */
int averager_provide_state(struct averager *a, const void *blob, size_t len);

/* Downloads a state of this prefix from the donors the broker lists
 * (avstate_load: the highest priority first, in parallel parts from
 * equal donors, every part checked), within timeout_ms (0: 30 s); each
 * answer of a donor within the request timeout. On 0 *blob (the
 * caller frees it) holds *len bytes. Otherwise -ENODATA (no donor, or
 * none served a whole state), -ETIMEDOUT, -ECANCELED (averager_abort),
 * -ENOTCONN (not joined), or the broker call's -errno; averager_load_error() says which donors failed
 * how. May run while a step runs on another thread; not two at once. */
int averager_load_state(struct averager *a, uint32_t timeout_ms, void **blob, size_t *len);
/* The last load's failure as a sentence (owned by the averager, valid
 * until the next load). */
const char *averager_load_error(const struct averager *a);

/* Parts of its state this averager has served (for tests and status). */
uint64_t averager_state_parts_served(struct averager *a);

#endif

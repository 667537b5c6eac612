/* src/averager/averager.c: see averager.h.
 *
 * One attempt is one all-reduce (SUM, float32) among the group, which the
 * engine runs as an epoch: the broker's group id is its number (group ids
 * only grow, as epochs must) and the group's members, in the broker's
 * order, are its members. Its buffer holds w * x, then one slot per member
 * for its weight, one for its gather length, and a block per member for
 * its gathered bytes (two bytes per float, as an integer below 65536):
 * each member writes only its own slots, so the sum delivers every
 * member's values exactly (x + 0 is x) along with sum(w * x). It is one
 * call and not three (gather, sum, gather) because the engine matches
 * every frame to the call it expects: a member that finished one call
 * and began the next could reach a peer still finishing the first. Every
 * member then divides by the same total weight in the same order, so
 * the result is the same bytes everywhere; a weight that is negative or
 * not finite, a length over the cap or a gathered value that is not a
 * byte pair is a lying peer and fails the attempt (-EPROTO). Only when
 * the call succeeds is anything written to the caller's data, so a failed
 * attempt changes nothing and the next one starts from the same input.
 * The cost is target x (2 + gather_max / 2) floats more per round, which
 * is why gather_max is small.
 *
 * With a codec. A codec is lossy and the engine applies it to a whole
 * call, so the weights, lengths and gathered bytes cannot share the
 * values' call: they go first, in an exact call of their own over the
 * metadata part of the buffer, and the values follow in a coded call
 * (allreduce_run_codec) over the first part. Two calls in a row are safe
 * here only because the first is recursive doubling: a member that
 * finished it has received everything its partners send in it, and no
 * member in doubling reads a connection it is not exchanging on, so the
 * second call's first frames wait in order behind the first's. (After a
 * ring the next call's frames can reach a ring neighbour that watches
 * that connection for control frames only, and fail the call.) The
 * engine picks doubling by size, so the averager raises its threshold to
 * cover the metadata of a full group. A balanced round (below) makes
 * both calls butterflies, the metadata's exact and the values' coded
 * (allreduce_run_parts_codec), each split by the bandwidths on its own;
 * that is safe for the same reason: a butterfly member that finished has
 * received every frame due to it, and it reads a connection only while
 * it is due a frame there, so the next call's frames wait in order. Knowing the total weight before
 * the values travel, each member contributes (w / total) x, so the sum
 * is the average itself, as large as the inputs and no larger (what fits
 * fp16 stays in range), and no division follows. A zero total is known
 * to every member after the first call, so all of them stop there alike.
 * The codec is also the first byte of the schema the broker compares, so
 * only averagers of one codec group (the engine would refuse the frames
 * of another anyway, but only after the group had formed).
 *
 * A codec per tensor (a plan: ranges of the caller's vector, each in a
 * codec, as hivemind's adaptive compression picks one per tensor). The
 * engine applies one codec to a call, so the attempt's buffer is laid
 * out by codec: first the plan's area (AVERAGER_PLAN_FLOATS) and the
 * metadata, the exact call; then one group per codec, CODEC_NONE
 * included, in the order of its first range, each holding its ranges
 * in order on 8 bytes of its own. After the exact call every group
 * follows in a call of its own, round 2, 3, ...: the CODEC_NONE group
 * contributes w x, summed and divided by the total (integers stay
 * exact), each coded one (w / total) x as above. The plan rides in the
 * exact call because an averager without tensors has only the plan's
 * digest from the schema and cannot size any later call without the
 * plan: every member with tensors adds its plan there (so the sum is k
 * copies of one plan, exact in float32), each of them checks that the
 * sum is its own plan and the averager without tensors that its digest
 * is the schema's, then lays it out in a buffer take_schema sized for
 * any plan of the count and runs the same calls with zeros. Every member
 * reads the same sum, so a member that lies about the plan fails the
 * step at every honest member before any later call; one that sends
 * members different sums fails some of them there and the rest in the
 * next call, which those never join. A plan group thus runs one call
 * more than a single codec's when it has CODEC_NONE ranges, in exchange
 * for the exact call's size not depending on the plan. Calls in a row
 * are safe as above only when each but the last is recursive doubling
 * or a butterfly, so a call that another follows runs as a butterfly
 * (equal shares when no member gave a bandwidth) unless it holds no
 * values (the metadata, and the plan); the last keeps the engine's
 * choice. The caller's data is written only after every call
 * succeeded, range by range from its place, so a step whose later call
 * fails changes nothing, and the result is the same bytes everywhere
 * since each call's is. A coded group's runs span its tensors as the
 * engine's segments fall, as a single codec's do: each segment is one
 * run of its codec. With a plan the schema's first byte is
 * AVERAGER_SCHEMA_PLAN and eight bytes after min_part carry the plan's
 * digest (plan_digest: SHA-256, so that a liar cannot find another plan
 * with the digest), so that only averagers of one plan group. A plan of
 * one codec is that codec, and groups with averagers given it.
 *
 * Load balancing. The broker hands every member of a group each member's
 * bandwidth and client flag, as they asked. When any is given the round
 * is the engine's butterfly (allreduce_run_parts) with parts from
 * allreduce_split over the whole buffer (values and metadata; with a
 * codec, over each of the two calls' buffers), a client
 * counting as bandwidth 0; every member computes the same parts from the
 * same reply. The round's member order puts clients first (each half in
 * the natural order of ids), because the member lower in the order dials
 * (engine/conn.c) and a member without a part talks only to members with
 * one: so a client dials every connection it has and is dialled by
 * nobody, and may sit behind NAT. The epoch the engine runs is that
 * order; the result's ids follow it. Without any bandwidth or client the
 * round stays on the ring: the same equal shares, and its pipelining.
 *
 * Without tensors. The schema the broker compares is the codec's byte,
 * the count's eight, min_vector_size's eight (a plan's digest's eight)
 * and the caller's bytes, so an auxiliary averager without tensors asks
 * for any schema (matchmaker.h) and learns them from the group's reply
 * (take_schema), sizing its buffer then, and a plan from the exact call
 * (plan_take): it reduces its share like any member and contributes
 * weight 0. The count comes from another member, so it is capped
 * (max_count), and so is a plan (AVERAGER_PLAN_MAX ranges, covering the
 * count).
 *
 * Exclusion. The engine fails a call at every member within its member
 * timeout when a peer stalls or dies. The members that are still alive
 * then ask the broker again and form a group without the stalled one,
 * because it does not ask. The result therefore names its contributors
 * exactly: the members of the group whose attempt succeeded.
 */
#include "averager/averager.h"
#include "averager/avstate.h"

#include <errno.h>
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <openssl/evp.h>

#include "base/clock.h"
#include "base/limits.h"
#include "base/log.h"
#include "base/secret.h"
#include "cohort.pb-c.h"
#include "engine/allreduce.h"
#include "membership/epoch.h"
#include "membership/heartbeat.h"
#include "membership/matchmaker.h"
#include "membership/member.h"
#include "rpc/rpc.h"

#define DEFAULT_GATHER_MAX 4096u
/* The engine's threshold for recursive doubling unless the metadata of a
 * full group needs more (allreduce.c's default, set explicitly here
 * because the two-call round depends on it: see the top). */
#define CODED_SMALL_BYTES ((size_t)256 << 10)
/* Beyond the step's own timeout, how long the broker's answer may take to
 * arrive before the call is abandoned, unless configured. */
#define DEFAULT_REQUEST_TIMEOUT_MS 5000u
/* How soon a matchmaking wait sees averager_abort. */
#define ABORT_SLICE_MS 100u

/* A run of the caller's values in one codec, and where the attempt's
 * buffer holds it. */
struct av_range {
    size_t count;
    enum codec codec;
    size_t src;                     /* its first element in the caller's data */
    size_t dst;                     /* ... in the attempt's buffer */
};

/* The values of one codec other than CODEC_NONE (with a plan, of any
 * codec), contiguous in the attempt's buffer, averaged by one engine call
 * of their own. */
struct av_group {
    enum codec codec;
    size_t count, off;              /* elements, and the first one's place */
    int h;                          /* registered over them */
};

struct averager {
    char *cohort, *id, *prefix;
    char bits[MATCHMAKER_BITS_MAX + 1];
    uint32_t target, min, min_wait_ms, request_timeout_ms, leave_timeout_ms;
    size_t count, gather_max;
    uint8_t schema[MATCHMAKER_SCHEMA_MAX];     /* the codec's byte, the count's eight,
                                                 * min_part's eight, then the
                                                 * caller's */
    size_t schema_len;
    enum codec codec;
    char address[IDENT_ADDRESS_MAX + 1];
    int data_fd;
    struct allreduce *ar;
    struct member *member;
    struct heartbeat *beat;
    pthread_mutex_t lock;
    bool stop;

    bool no_tensors;                /* count, codec and min_part come from each group */
    bool integrity;                 /* frames carry a MAC (integrity_mac) */
    atomic_bool aborted;            /* averager_abort: every step and download fails */
    size_t min_part;                /* min_vector_size */
    size_t max_count;               /* without tensors: the most it takes */
    bool has_bandwidth, client;     /* what this member asks with */
    double bandwidth;
    /* The group matchmake() returned, in the round's member order. */
    bool balanced;                  /* some member gave a bandwidth or is a client */
    double grp_bw[MATCHMAKER_GROUP_MAX];    /* -1: not given; 0 for clients */
    size_t grp_parts[MATCHMAKER_GROUP_MAX];

    /* The codec plan (averager_config.plan; one range without one) and
     * where the attempt's buffer holds each range (see the top). */
    struct av_range *ranges;
    size_t n_ranges;
    bool plan;                      /* more than one codec: the schema holds its digest */
    struct av_group groups[CODEC_END];  /* the coded groups, in order of first range */
    size_t n_groups;
    size_t n_exact;                 /* CODEC_NONE values, at the buffer's start */
    size_t sum_floats;              /* the buffer's laid-out size */
    size_t sum_cap;                 /* its allocated size (more without tensors, whose
                                     * plan arrives in the exact call) */
    float *sum;                     /* the attempt's buffer */
    uint64_t digest;                /* with a plan: its digest, the schema's */
    int h_exact;                    /* its exact part: CODEC_NONE values and metadata */
    char err[RPC_MESSAGE_MAX + 192];

    /* State sharing: the server, and the declaring thread's wishes
     * (under lock, with donor_cond to wake it). */
    struct avstate_server *srv;
    struct secret key;
    bool keyed;
    size_t max_state_bytes;
    pthread_t donor_thread;
    pthread_cond_t donor_cond;
    bool share, declared, declare_now;
    double priority;
    uint32_t declare_period_ms;
    char load_err[RPC_MESSAGE_MAX + 1280];
};

/* ---- membership ---------------------------------------------------------- */

static void on_peer_lost(void *arg, const char *peer)
{
    struct averager *a = arg;

    (void)heartbeat_report_lost(a->beat, peer);
}

int averager_wait(struct averager *a, uint32_t timeout_ms)
{
    uint64_t end = clock_now_ms() + timeout_ms;

    while (member_joins(a->member) == 0) {
        if (clock_now_ms() >= end)
            return -ETIMEDOUT;
        usleep(10000);
    }
    return 0;
}

/* ---- matchmaking ------------------------------------------------------------ */

struct mm_wait {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    bool ended;
    struct rpc_status st;
    Cohort__V1__MatchmakeReply *rep;
};

static void mm_msg(void *arg, ProtobufCMessage *msg)
{
    struct mm_wait *w = arg;

    pthread_mutex_lock(&w->lock);
    if (w->rep)
        protobuf_c_message_free_unpacked(&w->rep->base, NULL);
    w->rep = (Cohort__V1__MatchmakeReply *)msg;
    pthread_mutex_unlock(&w->lock);
}

static void mm_end(void *arg, const struct rpc_status *st)
{
    struct mm_wait *w = arg;

    pthread_mutex_lock(&w->lock);
    w->st = *st;
    w->ended = true;
    pthread_cond_signal(&w->cond);
    pthread_mutex_unlock(&w->lock);
}

/* Gathered bytes travel two to a float32, as an integer from 0 to 65535,
 * which float32 holds exactly and a sum with zeros leaves exact. */
static size_t gather_words(size_t bytes)
{
    return (bytes + 1) / 2;
}

static size_t even(size_t floats)
{
    return (floats + 1) & ~(size_t)1;
}

/* Where the metadata starts: after the CODEC_NONE values, on 8 bytes;
 * with a plan, after the plan's area (AVERAGER_PLAN_FLOATS, even). */
static size_t meta_offset(const struct averager *a)
{
    return a->plan ? AVERAGER_PLAN_FLOATS : even(a->n_exact);
}

/* Floats of the metadata part for a group of n. */
static size_t meta_floats(const struct averager *a, size_t n)
{
    return n * (2 + gather_words(a->gather_max));
}

/* Floats of the exact call for a group of n: CODEC_NONE values and
 * metadata. */
static size_t exact_floats(const struct averager *a, size_t n)
{
    return meta_offset(a) + meta_floats(a, n);
}

/* Places a->ranges in the attempt's buffer (see the top): the CODEC_NONE
 * ranges first, in order, then the metadata of a full group, then one
 * group per other codec, in the order of its first range, each holding
 * its ranges in order and starting on 8 bytes (the engine registers it).
 * With a plan the plan's area and the metadata come first, and the
 * CODEC_NONE ranges are a group too. */
static void layout(struct averager *a)
{
    size_t at = 0;

    a->n_groups = 0;
    for (size_t r = 0; r < a->n_ranges; r++) {
        struct av_range *x = &a->ranges[r];
        size_t g = 0;

        if (x->codec == CODEC_NONE && !a->plan) {
            x->dst = at;
            at += x->count;
            continue;
        }
        while (g < a->n_groups && a->groups[g].codec != x->codec)
            g++;
        if (g == a->n_groups)
            a->groups[a->n_groups++] = (struct av_group){ .codec = x->codec, .h = -1 };
        a->groups[g].count += x->count;
    }
    a->n_exact = at;
    at = even(exact_floats(a, a->target));
    for (size_t g = 0; g < a->n_groups; g++) {
        a->groups[g].off = at;
        at += even(a->groups[g].count);
    }
    a->sum_floats = at;
    for (size_t g = 0; g < a->n_groups; g++) {
        size_t put = a->groups[g].off;

        for (size_t r = 0; r < a->n_ranges; r++) {
            if (a->ranges[r].codec != a->groups[g].codec)
                continue;
            a->ranges[r].dst = put;
            put += a->ranges[r].count;
        }
    }
}

static int reg(struct averager *a, void *p, size_t bytes, int *h);
static void groups_unregister(struct averager *a);

static void buffer_free(struct averager *a)
{
    if (a->h_exact >= 0)
        allreduce_unregister(a->ar, a->h_exact);
    a->h_exact = -1;
    groups_unregister(a);
    free(a->sum);
    a->sum = NULL;
}

/* Registers each group laid out (unregistered before). Returns 0 or
 * the engine's -ENOSPC (out of handles; not with the averager's few). */
static int groups_register(struct averager *a)
{
    int rc = 0;

    for (size_t g = 0; g < a->n_groups && rc == 0; g++)
        rc = reg(a, a->sum + a->groups[g].off, a->groups[g].count * sizeof(float),
                 &a->groups[g].h);
    return rc;
}

static void groups_unregister(struct averager *a)
{
    for (size_t g = 0; g < a->n_groups; g++) {
        if (a->groups[g].h >= 0)
            allreduce_unregister(a->ar, a->groups[g].h);
        a->groups[g].h = -1;
    }
}

/* Lays out a->ranges and allocates (at least `cap` floats) and registers
 * the attempt's buffer: its exact part and each coded group. Returns 0,
 * -ENOMEM or the engine's -ENOSPC. */
static int buffer_alloc(struct averager *a, size_t cap)
{
    int rc;

    buffer_free(a);
    layout(a);
    a->sum_cap = cap > a->sum_floats ? cap : a->sum_floats;
    a->sum = calloc(a->sum_cap, sizeof(float));
    if (!a->sum)
        return -ENOMEM;
    rc = reg(a, a->sum, exact_floats(a, a->target) * sizeof(float), &a->h_exact);
    if (rc == 0)
        rc = groups_register(a);
    if (rc < 0)
        buffer_free(a);
    return rc;
}

/* Without tensors: takes the group's count, codec and min_part from its
 * schema (see averager_create), or with a codec plan its count and the
 * plan's digest (the plan itself arrives in the exact call: plan_take),
 * and sizes the buffer for them. Returns 0, -EPROTO (a schema that is
 * not an averager's, with *why), -EMSGSIZE (more than max_count, or
 * metadata a coded round cannot carry here, with *why) or -ENOMEM. */
static int take_schema(struct averager *a, const ProtobufCBinaryData *schema, const char **why)
{
    uint64_t count = 0, min_part = 0, digest = 0;
    enum codec codec = CODEC_NONE;
    bool plan;
    size_t meta;
    int rc;

    plan = schema->len >= 1 && (schema->data[0] & ~AVERAGER_SCHEMA_MAC) == AVERAGER_SCHEMA_PLAN;
    if (schema->len < (plan ? 25u : 17u) ||
        (!plan && !codec_valid(schema->data[0] & ~AVERAGER_SCHEMA_MAC))) {
        *why = "a group schema that is not an averager's";
        return -EPROTO;
    }
    /* An averager without tensors joins any schema: the frame integrity
     * it cannot speak is refused here, not by the engine mid-round. */
    if (((schema->data[0] & AVERAGER_SCHEMA_MAC) != 0) != a->integrity) {
        *why = a->integrity ? "a group without frame integrity (--integrity none); this "
                              "averager's is mac"
                            : "a group with frame integrity (--integrity mac); this averager "
                              "has none";
        return -EPROTO;
    }
    for (int i = 8; i >= 1; i--) {
        count = count << 8 | schema->data[i];
        min_part = min_part << 8 | schema->data[i + 8];
        if (plan)
            digest = digest << 8 | schema->data[i + 16];
    }
    a->min_part = min_part > SIZE_MAX ? SIZE_MAX : (size_t)min_part;
    if (!plan)
        codec = (enum codec)(schema->data[0] & ~AVERAGER_SCHEMA_MAC);
    if (count == 0) {
        *why = "a group schema of no elements";
        return -EPROTO;
    }
    if (count > a->max_count) {
        *why = "the group averages more elements than this averager without tensors takes "
               "(max_count)";
        return -EMSGSIZE;
    }
    /* A coded round's metadata call must be recursive doubling at every
     * member (see the top); this engine has the default threshold. */
    meta = (meta_floats(a, a->target) + (plan ? AVERAGER_PLAN_FLOATS : 0)) * sizeof(float);
    if ((plan || codec != CODEC_NONE) && meta > CODED_SMALL_BYTES) {
        *why = "an averager without tensors cannot join a compressed group this large "
               "(its metadata exceeds the engine's recursive doubling)";
        return -EMSGSIZE;
    }
    if (a->sum && count == a->count && codec == a->codec && plan == a->plan &&
        digest == a->digest)
        return 0;
    a->count = (size_t)count;
    a->codec = codec;
    a->plan = plan;
    a->digest = digest;
    a->ranges[0] = (struct av_range){ .count = a->count, .codec = codec };
    /* With a plan nothing is laid out past the exact part until the plan
     * arrives; the buffer has room for any plan of the count: each group
     * rounds up to 8 bytes. */
    a->n_ranges = plan ? 0 : 1;
    rc = buffer_alloc(a, plan ? even(exact_floats(a, a->target)) + a->count + CODEC_END : 0);
    if (rc < 0) {
        /* Cannot fail but for memory; the next group starts over. */
        a->count = 0;
        return rc;
    }
    return 0;
}

/* Reorders group *e (checked, in the natural order of ids) with its
 * clients first, each half in its order, and notes every member's
 * bandwidth in that order (see the top). Replaces *e on 0. Returns 0,
 * -EPROTO (a reply whose bandwidths or client flags do not fit its
 * members, with *why set) or -ENOMEM. */
static int clients_first(struct averager *a, const Cohort__V1__MatchmakeReply *rep,
                         struct epoch **e, const char **why)
{
    size_t n = (*e)->n_members, k = 0;
    struct epoch_member m[MATCHMAKER_GROUP_MAX];
    struct epoch *re;
    int rc;

    /* An older broker sends neither list: nobody gave anything. */
    if ((rep->n_bandwidths != n && rep->n_bandwidths != 0) ||
        rep->n_client_mode != rep->n_bandwidths) {
        *why = "bandwidths or client flags that do not match its members";
        return -EPROTO;
    }
    a->balanced = false;
    for (size_t i = 0; i < rep->n_bandwidths; i++) {
        double bw = rep->bandwidths[i];

        if (!isfinite(bw) || bw > MATCHMAKER_BANDWIDTH_MAX) {
            *why = "a bandwidth that is not a number in range";
            return -EPROTO;
        }
        a->balanced |= bw >= 0 || rep->client_mode[i];
    }
    if (!a->balanced)
        return 0;
    for (int pass = 0; pass < 2; pass++)
        for (size_t i = 0; i < n; i++) {
            bool client = rep->client_mode[i];

            if (client != (pass == 0))
                continue;
            m[k] = (*e)->members[i];
            a->grp_bw[k++] = client ? 0 : rep->bandwidths[i] < 0 ? -1 : rep->bandwidths[i];
        }
    rc = epoch_create((*e)->cohort, (*e)->number, 0, m, n, &re);
    if (rc < 0)
        return rc;
    epoch_unref(*e);
    *e = re;
    return 0;
}

/* Asks the broker for a group, waiting at most timeout_ms for it. On 0
 * *out is the group as an epoch (checked: valid, unique, ordered ids),
 * which the caller unrefs. */
static int matchmake(struct averager *a, uint32_t timeout_ms, struct epoch **out)
{
    Cohort__V1__MatchmakeRequest q = COHORT__V1__MATCHMAKE_REQUEST__INIT;
    struct mm_wait w = { .ended = false };
    struct rpc_watch *watch = NULL;
    struct timespec ts;
    const char *why = NULL;
    int rc;

    q.prefix = a->prefix;
    q.group_bits = a->bits;
    q.target_group_size = a->target;
    q.min_group_size = a->min;
    q.min_matchmaking_ms = a->min_wait_ms < timeout_ms ? a->min_wait_ms : timeout_ms;
    q.timeout_ms = timeout_ms;
    q.schema.data = a->schema;
    q.schema.len = a->schema_len;
    q.has_bandwidth = a->has_bandwidth;
    q.bandwidth = a->bandwidth;
    q.client_mode = a->client;
    q.any_schema = a->no_tensors;
    pthread_mutex_init(&w.lock, NULL);
    clock_cond_init(&w.cond);
    rc = member_matchmake(a->member, &q, mm_msg, mm_end, &w, &watch);
    if (rc < 0) {
        snprintf(a->err, sizeof(a->err), "could not ask the broker for a group: %s",
                 log_strerror(rc));
        goto out;
    }
    {
        /* In slices, so that averager_abort is seen within one. */
        uint64_t end = clock_now_ms() + timeout_ms + a->request_timeout_ms;

        pthread_mutex_lock(&w.lock);
        while (!w.ended && !atomic_load(&a->aborted)) {
            uint64_t now = clock_now_ms();

            if (now >= end)
                break;
            ts = clock_deadline((uint32_t)(end - now < ABORT_SLICE_MS ? end - now
                                                                      : ABORT_SLICE_MS));
            pthread_cond_timedwait(&w.cond, &w.lock, &ts);
        }
        pthread_mutex_unlock(&w.lock);
    }
    rpc_watch_close(watch);         /* waits for mm_end */
    if (w.st.code != RPC_OK || !w.rep) {
        bool schema;

        rc = w.st.code == RPC_DEADLINE_EXCEEDED || w.st.code == RPC_CANCELLED
                 ? -ETIMEDOUT
             : w.st.code == RPC_FAILED_PRECONDITION ? -EPROTO
             : w.st.code == RPC_OK ? -EPROTO
                                   : rpc_code_to_errno(w.st.code);
        /* The broker sees the codec and the integrity only as a schema
         * byte: name them here, so that a refusal for either reads as one. */
        schema = rc == -EPROTO && strstr(w.st.message, "schema");
        snprintf(a->err, sizeof(a->err), "matchmaking failed (%s): %s%s%s%s%s",
                 rpc_code_name(w.st.code), w.st.code == RPC_OK ? "no group in the reply"
                                                                : w.st.message,
                 schema ? " (the schema includes the compression and the frame integrity, "
                          "which must match: this averager's are "
                        : "",
                 schema ? (a->plan ? "a codec plan" : codec_name(a->codec)) : "",
                 schema ? (a->integrity ? " and --integrity mac" : " and --integrity none") : "",
                 schema ? ")" : "");
        goto out;
    }
    {
        Cohort__V1__Epoch p = COHORT__V1__EPOCH__INIT;

        p.cohort = a->cohort;
        p.epoch = w.rep->group_id;
        p.n_members = w.rep->n_members;
        p.members = w.rep->members;
        p.leader = w.rep->n_members ? w.rep->members[0]->id : (char *)"";
        if (w.rep->n_members == 0 || w.rep->n_members > a->target) {
            rc = -EPROTO;
            why = "a group of no members, or more than the target";
        } else {
            rc = epoch_from_proto(&p, out, &why);
            if (rc == 0 && epoch_find(*out, a->id) < 0) {
                epoch_unref(*out);
                rc = -EPROTO;
                why = "a group that does not list this averager";
            } else if (rc == 0) {
                if (a->no_tensors)
                    rc = take_schema(a, &w.rep->schema, &why);
                if (rc == 0)
                    rc = clients_first(a, w.rep, out, &why);
                if (rc < 0)
                    epoch_unref(*out);
            }
        }
        if (rc == -EMSGSIZE)
            snprintf(a->err, sizeof(a->err), "%s", why);
        else if (rc < 0)
            snprintf(a->err, sizeof(a->err), "the broker sent a bad group: %s",
                     why ? why : log_strerror(rc));
    }
out:
    if (w.rep)
        protobuf_c_message_free_unpacked(&w.rep->base, NULL);
    pthread_cond_destroy(&w.cond);
    pthread_mutex_destroy(&w.lock);
    return rc;
}

/* ---- the plan's digest and its area of the exact call --------------------- */

/* SHA-256 over each range's count (eight bytes, little-endian) and codec
 * (one byte), its first eight bytes little-endian: the digest the schema
 * carries. Honest averagers of different plans never group by it, and a
 * member that sends an averager without tensors another plan cannot
 * make it match (plan_take). */
static uint64_t plan_digest(const struct av_range *r, size_t n)
{
    uint8_t bytes[9 * AVERAGER_PLAN_MAX], md[EVP_MAX_MD_SIZE];
    unsigned int len = 0;
    uint64_t h = 0;

    for (size_t k = 0; k < n && k < AVERAGER_PLAN_MAX; k++) {
        for (int i = 0; i < 8; i++)
            bytes[9 * k + (size_t)i] = (uint8_t)((uint64_t)r[k].count >> (8 * i));
        bytes[9 * k + 8] = (uint8_t)r[k].codec;
    }
    /* libcrypto does not fail to hash memory; if it did, 0 matches no
     * plan's digest but by chance, and such a group fails its step. */
    if (EVP_Digest(bytes, 9 * (n < AVERAGER_PLAN_MAX ? n : AVERAGER_PLAN_MAX), md, &len,
                   EVP_sha256(), NULL) != 1 || len < 8)
        return 0;
    for (int i = 7; i >= 0; i--)
        h = h << 8 | md[i];
    return h;
}

/* Writes this averager's plan into the plan's area p (see the top and
 * averager.h): one writer, the number of ranges, then each range's count
 * in two 16-bit halves and its codec. */
static void plan_put(const struct averager *a, float *p)
{
    p[0] = 1;
    p[1] = (float)a->n_ranges;
    for (size_t k = 0; k < a->n_ranges; k++) {
        p[2 + 3 * k] = (float)(a->ranges[k].count & 0xffff);
        p[3 + 3 * k] = (float)(a->ranges[k].count >> 16);
        p[4 + 3 * k] = (float)a->ranges[k].codec;
    }
}

/* Whether v is exactly k times an integer from 0 to max, which *out gets.
 * Every member with tensors adds the same plan, so each word of the sum
 * is k times the plan's (exact: k <= 256 and words below 2^16, so every
 * partial sum is an integer below 2^24). */
static bool plan_word(float v, size_t k, size_t max, size_t *out)
{
    double q = (double)v / (double)k;

    if (!(q >= 0 && q <= (double)max) || q != floor(q) || q * (double)k != (double)v)
        return false;
    *out = (size_t)q;
    return true;
}

/* Reads the summed plan's area p of a group of n: into r (room for
 * AVERAGER_PLAN_MAX) and *len on 0; -EPROTO with *why when the sum is
 * not k copies of one plan of a->count values. */
static int plan_read(const struct averager *a, const float *p, size_t n, struct av_range *r,
                     size_t *len, const char **why)
{
    size_t k, nr, at = 0;

    if (!plan_word(p[0], 1, n, &k) || k == 0 || !plan_word(p[1], k, AVERAGER_PLAN_MAX, &nr) ||
        nr == 0) {
        *why = "its count of writers or of ranges is not a whole plan's";
        return -EPROTO;
    }
    for (size_t i = 0; i < AVERAGER_PLAN_MAX; i++) {
        const float *w = p + 2 + 3 * i;
        size_t lo, hi, codec;

        if (i >= nr) {
            if (w[0] != 0 || w[1] != 0 || w[2] != 0) {
                *why = "it holds words past its last range";
                return -EPROTO;
            }
            continue;
        }
        if (!plan_word(w[0], k, 0xffff, &lo) || !plan_word(w[1], k, 0x3fff, &hi) ||
            !plan_word(w[2], k, CODEC_END, &codec) || !codec_valid((int)codec)) {
            *why = "a range's count or codec is not one";
            return -EPROTO;
        }
        r[i] = (struct av_range){ .count = hi << 16 | lo, .codec = (enum codec)codec,
                                  .src = at };
        if (r[i].count == 0 || r[i].count > a->count - at) {
            *why = "a range is empty or runs past the averaged elements";
            return -EPROTO;
        }
        at += r[i].count;
    }
    if (at != a->count) {
        *why = "its ranges do not cover the averaged elements";
        return -EPROTO;
    }
    *len = nr;
    return 0;
}

/* After the exact call of a group of n with a plan: checks the plan the
 * members sent. A member with tensors must find its own; an averager
 * without tensors one whose digest is the schema's, which it then lays
 * out and registers, its groups zero (it contributes nothing). Returns
 * 0, -EPROTO (with a->err) or the engine's -ENOSPC. */
static int plan_take(struct averager *a, size_t n)
{
    struct av_range got[AVERAGER_PLAN_MAX];
    const char *why = NULL;
    size_t len = 0;
    int rc = plan_read(a, a->sum, n, got, &len, &why);

    if (rc == 0 && !a->no_tensors) {
        bool same = len == a->n_ranges;

        for (size_t k = 0; k < len && same; k++)
            same = got[k].count == a->ranges[k].count && got[k].codec == a->ranges[k].codec;
        if (!same) {
            why = "it is not this averager's";
            rc = -EPROTO;
        }
    } else if (rc == 0 && plan_digest(got, len) != a->digest) {
        why = "its digest is not the one the group formed under";
        rc = -EPROTO;
    }
    if (rc < 0) {
        snprintf(a->err, sizeof(a->err), "a member of the group sent a bad codec plan: %s",
                 why);
        return rc;
    }
    if (!a->no_tensors)
        return 0;
    groups_unregister(a);
    memcpy(a->ranges, got, len * sizeof(*got));
    a->n_ranges = len;
    /* Within sum_cap: the ranges cover a->count (take_schema). */
    layout(a);
    return groups_register(a);
}

/* ---- one attempt ------------------------------------------------------------ */

static bool retryable(int rc)
{
    return rc == -ESTALE || rc == -ETIMEDOUT || rc == -ECONNRESET || rc == -EPIPE ||
           rc == -ECONNREFUSED;
}

/* The parts of `floats` elements among the group's n members by their
 * bandwidths (bw: -1 each for equal shares), into a->grp_parts (every
 * member computes the same). */
static int split_parts(struct averager *a, const double *bw, size_t floats, size_t n)
{
    int rc = allreduce_split(floats, bw, n, a->min_part, a->grp_parts);

    if (rc == -ENODATA)
        snprintf(a->err, sizeof(a->err), "no member of the group can reduce: every one is "
                 "a client or has bandwidth 0");
    return rc;
}

/* One call of the attempt over `floats` elements of registered buffer h
 * in `codec` (see the top): a butterfly when the round is balanced, and
 * when another call follows a large one (a ring must be the last call);
 * otherwise the engine's choice (the ring, or recursive doubling when
 * small). `small` says the call is within the doubling threshold. */
static int one_call(struct averager *a, int h, size_t floats, size_t n, enum codec codec,
                    bool last, bool small, uint64_t round)
{
    double equal[MATCHMAKER_GROUP_MAX];
    const double *bw = a->grp_bw;
    int rc;

    if (!a->balanced && (last || small))
        return codec == CODEC_NONE
                   ? allreduce_run(a->ar, h, floats, DTYPE_F32, DTYPE_SUM, 0, round)
                   : allreduce_run_codec(a->ar, h, h, floats, DTYPE_F32, DTYPE_SUM, 0, codec,
                                         round);
    if (!a->balanced) {
        for (size_t i = 0; i < n; i++)
            equal[i] = -1;
        bw = equal;
    }
    rc = split_parts(a, bw, floats, n);
    if (rc < 0)
        return rc;
    return allreduce_run_parts_codec(a->ar, h, h, floats, DTYPE_F32, DTYPE_SUM, 0,
                                     a->grp_parts, n, codec, round);
}

/* Runs the attempt in group e (see the top). On 0 fills *res and leaves
 * in a->sum the weighted sum of each CODEC_NONE range and the average of
 * each coded one, and the total weight in *total. */
static int attempt(struct averager *a, struct epoch *e, const struct averager_step *s,
                   double *total, struct averager_result **res)
{
    size_t n = e->n_members, gw = gather_words(a->gather_max);
    long me = epoch_find(e, a->id);
    float *weights = a->sum + meta_offset(a), *lens = weights + n, *words = lens + n;
    struct averager_result *r = NULL;
    uint8_t *copy = NULL;
    double w = 0;
    int rc;

    rc = allreduce_set_epoch(a->ar, e);
    if (rc < 0)
        return rc;
    memset(a->sum, 0, a->sum_cap * sizeof(float));
    if (a->plan && !a->no_tensors)
        plan_put(a, a->sum);
    for (size_t k = 0; k < a->n_ranges && s->weight > 0; k++) {
        const struct av_range *x = &a->ranges[k];

        for (size_t i = 0; i < x->count && x->codec == CODEC_NONE; i++)
            a->sum[x->dst + i] = (float)s->weight * s->data[x->src + i];
    }
    weights[me] = (float)s->weight;
    lens[me] = (float)s->gather_len;
    for (size_t b = 0; b < s->gather_len; b++) {
        const uint8_t *g = s->gather;

        words[(size_t)me * gw + b / 2] += (float)(b % 2 ? g[b] : g[b] << 8);
    }
    /* The exact call: the CODEC_NONE values and the metadata, or with a
     * plan the plan and the metadata. Followed by more calls, it is small
     * when it holds no values (the engine's threshold covers a full
     * group's: see averager_create). */
    rc = one_call(a, a->h_exact, exact_floats(a, n), n, CODEC_NONE,
                  !a->plan && a->n_groups == 0, a->n_exact == 0, 1);
    if (rc < 0)
        return rc;
    /* What the others wrote is checked: a peer may lie, and the caller
     * gets nothing from a sum that makes no sense. */
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(weights[i]) || weights[i] < 0 || !(lens[i] >= 0) ||
            lens[i] > (float)a->gather_max || lens[i] != (float)(size_t)lens[i]) {
            snprintf(a->err, sizeof(a->err), "member %s of the group sent a bad weight or "
                     "gather length", e->members[i].id);
            return -EPROTO;
        }
        w += weights[i];
    }
    for (size_t k = 0; k < n * gw; k++) {
        if (!(words[k] >= 0 && words[k] <= 65535.0f) || words[k] != (float)(uint32_t)words[k]) {
            snprintf(a->err, sizeof(a->err), "a member of the group sent bad gathered bytes");
            return -EPROTO;
        }
    }
    if (w == 0) {
        snprintf(a->err, sizeof(a->err), "every member of the group was auxiliary");
        return -ENODATA;
    }
    /* Every member reads the same sum: each one that fails here fails
     * before any later call, and the others' calls then fail with it. */
    if (a->plan && (rc = plan_take(a, n)) < 0)
        return rc;
    if (a->n_groups) {
        /* Every member summed the same weights in the same order, so
         * each scales by the same total. */
        float share = (float)((double)weights[me] / w);

        for (size_t k = 0; k < a->n_ranges && s->weight > 0; k++) {
            const struct av_range *x = &a->ranges[k];

            /* CODEC_NONE values were written before the exact call. */
            for (size_t i = 0; i < x->count && x->codec != CODEC_NONE; i++)
                a->sum[x->dst + i] = share * s->data[x->src + i];
        }
        /* One call per codec, in the plan's order, numbered on from the
         * exact call's: nothing reaches the caller unless every one
         * succeeds. */
        for (size_t g = 0; g < a->n_groups; g++) {
            rc = one_call(a, a->groups[g].h, a->groups[g].count, n, a->groups[g].codec,
                          g + 1 == a->n_groups, false, 2 + g);
            if (rc < 0)
                return rc;
        }
    }
    r = calloc(1, sizeof(*r));
    copy = malloc(n * a->gather_max + 1);
    if (!r || !copy)
        goto nomem;
    r->n = n;
    r->group = e->number;
    r->ids = calloc(n, sizeof(*r->ids));
    r->weights = calloc(n, sizeof(*r->weights));
    r->gathered = calloc(n, sizeof(*r->gathered));
    r->gathered_len = calloc(n, sizeof(*r->gathered_len));
    if (!r->ids || !r->weights || !r->gathered || !r->gathered_len)
        goto nomem;
    for (size_t i = 0; i < n; i++) {
        uint8_t *dst = copy + i * a->gather_max;

        snprintf(r->ids[i], sizeof(r->ids[i]), "%s", e->members[i].id);
        r->weights[i] = weights[i];
        r->gathered_len[i] = (size_t)lens[i];
        for (size_t b = 0; b < r->gathered_len[i]; b++) {
            uint32_t v = (uint32_t)words[i * gw + b / 2];

            dst[b] = (uint8_t)(b % 2 ? v & 0xff : v >> 8);
        }
        r->gathered[i] = dst;
    }
    /* gathered[0] owns the block (averager_result_free). */
    *total = w;
    *res = r;
    return 0;
nomem:
    if (r && !r->gathered)
        free(copy);
    else if (r && r->gathered)
        r->gathered[0] = copy;
    else
        free(copy);
    averager_result_free(r);
    return -ENOMEM;
}

/* The bits after a round at `index` of a group of target (key manager). */
static void move_bits(struct averager *a, size_t index)
{
    size_t len = strlen(a->bits), nb = 0;
    char idx[MATCHMAKER_BITS_MAX + 1], joined[2 * MATCHMAKER_BITS_MAX + 2];

    while (((size_t)1 << nb) < a->target && nb < MATCHMAKER_BITS_MAX)
        nb++;
    if (len == 0 || nb == 0)
        return;
    for (size_t i = 0; i < nb; i++)
        idx[i] = (index >> (nb - 1 - i)) & 1 ? '1' : '0';
    idx[nb] = '\0';
    snprintf(joined, sizeof(joined), "%s%s", a->bits, idx);
    memmove(a->bits, joined + strlen(joined) - len, len + 1);
}

/* Sleeps until wall-clock time begin_at_ms (0: not at all), or until the
 * monotonic `end`, whichever comes first, or until aborted. */
static void wait_for_schedule(const atomic_bool *aborted, uint64_t begin_at_ms, uint64_t end)
{
    for (;;) {
        struct timespec ts;
        uint64_t wall, now = clock_now_ms(), nap;

        clock_gettime(CLOCK_REALTIME, &ts);
        wall = (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
        if (!begin_at_ms || wall >= begin_at_ms || now >= end || atomic_load(aborted))
            return;
        nap = begin_at_ms - wall < end - now ? begin_at_ms - wall : end - now;
        /* In naps, so that a wall clock stepped meanwhile is seen. */
        usleep((useconds_t)(nap > 50 ? 50 : nap) * 1000);
    }
}

static int step_aborted(struct averager *a)
{
    snprintf(a->err, sizeof(a->err), "the step was aborted: the averager is leaving");
    return -ECANCELED;
}

int averager_step(struct averager *a, const struct averager_step *s,
                  struct averager_result **out)
{
    uint32_t timeout = s->timeout_ms ? s->timeout_ms : AVERAGER_DEFAULT_TIMEOUT_MS;
    uint64_t end = clock_now_ms() + timeout;
    uint32_t attempts = 0, mm_ms = 0;
    int rc = -ETIMEDOUT;

    a->err[0] = '\0';
    if (a->no_tensors && s->weight != 0) {
        snprintf(a->err, sizeof(a->err), "an averager without tensors contributes nothing: "
                 "its weight must be 0");
        return -EINVAL;
    }
    /* The weight travels as a float32 (attempt): one past FLT_MAX would
     * arrive as +Inf, which every groupmate takes for a lie. */
    if ((!s->data && !a->no_tensors) || !isfinite(s->weight) || s->weight < 0 ||
        s->weight > FLT_MAX || !(s->alpha > 0 && s->alpha <= 1) ||
        s->gather_len > a->gather_max || (s->gather_len && !s->gather)) {
        snprintf(a->err, sizeof(a->err), "bad step: the weight must be finite (within float32's "
                 "range) and at least 0, alpha in (0, 1], and the gather at most %zu bytes",
                 a->gather_max);
        return -EINVAL;
    }
    for (;;) {
        uint64_t now = clock_now_ms();
        struct averager_result *r = NULL;
        struct epoch *e = NULL;
        double total = 0;

        if (atomic_load(&a->aborted))
            return step_aborted(a);
        if (now >= end)
            break;
        rc = matchmake(a, (uint32_t)(end - now), &e);
        mm_ms = (uint32_t)(clock_now_ms() - now);
        if (atomic_load(&a->aborted)) {
            if (rc == 0)
                epoch_unref(e);
            return step_aborted(a);
        }
        if (rc == -ENOTCONN) {          /* not joined yet (or rejoining) */
            snprintf(a->err, sizeof(a->err), "the averager has not joined the cohort (is the "
                     "broker up, and does it take this cohort's key?)");
            usleep(20000);
            continue;
        }
        if (rc < 0)
            return rc;
        if (attempts == 0)
            wait_for_schedule(&a->aborted, s->begin_at_ms, end);
        attempts++;
        rc = attempt(a, e, s, &total, &r);
        if (rc < 0 && atomic_load(&a->aborted)) {
            epoch_unref(e);
            return step_aborted(a);
        }
        if (rc == 0) {
            long me = epoch_find(e, a->id);

            for (size_t k = 0; k < a->n_ranges && s->weight > 0; k++) {
                const struct av_range *x = &a->ranges[k];
                /* A coded range holds the average already. */
                double div = x->codec == CODEC_NONE ? total : 1;

                for (size_t i = 0; i < x->count; i++) {
                    float avg = (float)((double)a->sum[x->dst + i] / div);
                    float *d = &s->data[x->src + i];

                    *d = s->alpha == 1 ? avg : *d + (float)s->alpha * (avg - *d);
                }
            }
            move_bits(a, (size_t)me);
            r->attempts = attempts;
            r->matchmaking_ms = mm_ms;
            epoch_unref(e);
            *out = r;
            return 0;
        }
        if (rc == -EACCES)
            snprintf(a->err, sizeof(a->err), "averaging in group %llu of %zu failed: a "
                     "groupmate refused this averager's data connection or could not prove "
                     "the cohort's key (the members' keys or --integrity settings differ)",
                     (unsigned long long)e->number, e->n_members);
        else if (!a->err[0] || retryable(rc))
            snprintf(a->err, sizeof(a->err), "averaging in group %llu of %zu failed: %s",
                     (unsigned long long)e->number, e->n_members, log_strerror(rc));
        log_info("averager", "An averaging attempt failed.", LF_S("id", a->id),
                 LF_U("group", e->number), LF_U("members", e->n_members),
                 LF_S("error", log_strerror(rc)), LF_B("retry", !s->no_retries && retryable(rc)));
        epoch_unref(e);
        if (s->no_retries || !retryable(rc))
            return rc == -ESTALE ? -ETIMEDOUT : rc;
    }
    if (!a->err[0])
        snprintf(a->err, sizeof(a->err), "no group completed the round within %u ms", timeout);
    return -ETIMEDOUT;
}

void averager_result_free(struct averager_result *r)
{
    if (!r)
        return;
    if (r->gathered)
        free((void *)r->gathered[0]);
    free(r->ids);
    free(r->weights);
    free(r->gathered);
    free(r->gathered_len);
    free(r);
}

void averager_abort(struct averager *a)
{
    struct epoch_member self = { .id = a->id, .address = a->address };
    struct epoch *e = NULL;

    if (atomic_exchange(&a->aborted, true))
        return;
    /* An epoch past every group's: the run in flight stops with -ESTALE
     * and its connections close, so the groupmates see this member gone
     * at once (as a killed one) and retry without it; no later group can
     * be adopted. Without memory for it the run ends at its member
     * timeout instead. */
    if (epoch_create(a->cohort, UINT64_MAX, 0, &self, 1, &e) == 0) {
        allreduce_set_epoch(a->ar, e);
        epoch_unref(e);
    }
}

const char *averager_last_error(const struct averager *a)
{
    return a->err;
}

const char *averager_bits(const struct averager *a)
{
    return a->bits;
}

static bool bits_ok(const char *b)
{
    size_t n = 0;

    for (; b[n]; n++)
        if ((b[n] != '0' && b[n] != '1') || n >= MATCHMAKER_BITS_MAX)
            return false;
    return true;
}

int averager_set_bits(struct averager *a, const char *bits)
{
    if (!bits || !bits_ok(bits))
        return -EINVAL;
    snprintf(a->bits, sizeof(a->bits), "%s", bits);
    return 0;
}

const char *averager_id(const struct averager *a)
{
    return a->id;
}

/* ---- state sharing ------------------------------------------------------------ */

#define DEFAULT_DECLARE_PERIOD_MS 30000u

/* One StateDonors call: declares (or withdraws) when `declare`, and reads
 * the prefix's donors into *rep when rep is not NULL. */
static int donors_call(struct averager *a, bool declare, bool share, double priority,
                       Cohort__V1__StateDonorsReply **rep, char *why, size_t len)
{
    Cohort__V1__StateDonorsRequest q = COHORT__V1__STATE_DONORS_REQUEST__INIT;
    Cohort__V1__StateDonorsReply *r = NULL;
    struct rpc_status st = { 0 };
    int rc;

    q.prefix = a->prefix;
    q.declare = declare;
    q.allow = share;
    q.priority = priority;
    /* One and a half periods: a single late declaration drops nobody. */
    q.expiry_ms = a->declare_period_ms + a->declare_period_ms / 2;
    q.state_address = (char *)avstate_server_address(a->srv);
    rc = member_state_donors(a->member, &q, a->request_timeout_ms, &r, &st);
    if (rc < 0) {
        snprintf(why, len, "the broker's StateDonors failed (%s): %s",
                 rc == -ENOTCONN ? "not joined" : rpc_code_name(st.code),
                 rc == -ENOTCONN ? "the averager has not joined the cohort" : st.message);
        return rc;
    }
    if (rep)
        *rep = r;
    else
        protobuf_c_message_free_unpacked(&r->base, NULL);
    return 0;
}

/* Declares this averager every period while it shares, at once when the
 * setting changes, and withdraws it once when sharing stops. */
static void *donor_main(void *arg)
{
    struct averager *a = arg;
    uint64_t next = 0;

    pthread_mutex_lock(&a->lock);
    while (!a->stop) {
        uint64_t now = clock_now_ms();
        bool share = a->share, due = a->declare_now || (share && now >= next) ||
                                     (!share && a->declared);
        double priority = a->priority;
        struct timespec ts;
        char why[RPC_MESSAGE_MAX + 64];
        int rc;

        if (!due) {
            ts = clock_deadline(share ? (uint32_t)(next - now) : 60000u);
            pthread_cond_timedwait(&a->donor_cond, &a->lock, &ts);
            continue;
        }
        a->declare_now = false;
        pthread_mutex_unlock(&a->lock);
        rc = donors_call(a, true, share, priority, NULL, why, sizeof(why));
        pthread_mutex_lock(&a->lock);
        if (rc < 0) {
            /* Not joined yet, or the broker is away: again shortly. */
            if (rc != -ENOTCONN)
                log_info("averager", "Could not declare the state donor.", LF_S("id", a->id),
                         LF_S("error", why));
            a->declare_now = a->declare_now || a->share != a->declared || share;
            ts = clock_deadline(rc == -ENOTCONN ? 50u : 1000u);
            pthread_cond_timedwait(&a->donor_cond, &a->lock, &ts);
            continue;
        }
        a->declared = share;
        next = clock_now_ms() + a->declare_period_ms;
    }
    pthread_mutex_unlock(&a->lock);
    return NULL;
}

int averager_set_state_sharing(struct averager *a, bool share, double priority)
{
    if (!isfinite(priority))
        return -EINVAL;
    /* The server refuses at once; the broker hears within a call. */
    avstate_server_allow(a->srv, share);
    pthread_mutex_lock(&a->lock);
    if (a->share != share || a->priority != priority)
        a->declare_now = true;
    a->share = share;
    a->priority = priority;
    pthread_cond_signal(&a->donor_cond);
    pthread_mutex_unlock(&a->lock);
    return 0;
}

void averager_state_sharing(struct averager *a, bool *share, double *priority)
{
    pthread_mutex_lock(&a->lock);
    *share = a->share;
    *priority = a->priority;
    pthread_mutex_unlock(&a->lock);
}

bool averager_state_wanted(struct averager *a, uint32_t timeout_ms)
{
    return avstate_server_wanted(a->srv, timeout_ms);
}

int averager_provide_state(struct averager *a, const void *blob, size_t len)
{
    return avstate_server_provide(a->srv, blob, len);
}

uint64_t averager_state_parts_served(struct averager *a)
{
    return avstate_server_parts_served(a->srv);
}

const char *averager_load_error(const struct averager *a)
{
    return a->load_err;
}

int averager_load_state(struct averager *a, uint32_t timeout_ms, void **blob, size_t *len)
{
    Cohort__V1__StateDonorsReply *r = NULL;
    struct avstate_donor donors[MATCHMAKER_DONORS_REPLY_MAX];
    struct avstate_load_config lc = {
        .cohort = a->cohort, .id = a->id, .key = a->keyed ? &a->key : NULL,
        .io_timeout_ms = a->request_timeout_ms,
        .max_bytes = a->max_state_bytes, .cancel = &a->aborted,
    };
    char why[1024];
    size_t n = 0;
    int rc;

    a->load_err[0] = '\0';
    if (atomic_load(&a->aborted)) {
        snprintf(a->load_err, sizeof(a->load_err), "the download was cancelled: the averager "
                 "is leaving");
        return -ECANCELED;
    }
    lc.timeout_ms = timeout_ms ? timeout_ms : AVERAGER_DEFAULT_TIMEOUT_MS;
    rc = donors_call(a, false, false, 0, &r, a->load_err, sizeof(a->load_err));
    if (rc < 0)
        return rc;
    /* The broker lists live members' declarations; each is checked again
     * here, since what the broker relays a member wrote. */
    for (size_t i = 0; i < r->n_donors && n < MATCHMAKER_DONORS_REPLY_MAX; i++) {
        const Cohort__V1__StateDonor *d = r->donors[i];

        if (!ident_valid_member_id(d->id) || !ident_valid_address(d->address) ||
            !isfinite(d->priority) || strcmp(d->id, a->id) == 0 ||
            (n > 0 && d->priority > donors[n - 1].priority))
            continue;
        donors[n++] = (struct avstate_donor){ d->id, d->address, d->priority };
    }
    rc = avstate_load(&lc, donors, n, blob, len, why, sizeof(why));
    protobuf_c_message_free_unpacked(&r->base, NULL);
    if (rc < 0)
        snprintf(a->load_err, sizeof(a->load_err), "no state loaded from %zu donor%s: %s", n,
                 n == 1 ? "" : "s", why);
    return rc;
}

/* ---- life ------------------------------------------------------------------ */

static int reg(struct averager *a, void *p, size_t bytes, int *h)
{
    *h = allreduce_register(a->ar, p, bytes);
    return *h < 0 ? *h : 0;
}

int averager_plan_check(const struct averager_range *plan, size_t n, size_t count,
                        enum codec codec, size_t schema_len, char *why, size_t why_len)
{
    size_t total = 0;

    if (!n)
        return 0;
    if (!plan || n > AVERAGER_PLAN_MAX) {
        snprintf(why, why_len, "a codec plan of %zu ranges: at most %u", n, AVERAGER_PLAN_MAX);
        return -EINVAL;
    }
    if (codec != CODEC_NONE) {
        snprintf(why, why_len, "a codec plan with a codec for the whole vector too: give one "
                 "or the other");
        return -EINVAL;
    }
    for (size_t k = 0; k < n; k++) {
        if (!codec_valid((int)plan[k].codec)) {
            snprintf(why, why_len, "range %zu of the codec plan names %d, which is not a codec",
                     k, (int)plan[k].codec);
            return -EINVAL;
        }
        if (plan[k].count == 0 || plan[k].count > count - total) {
            snprintf(why, why_len, "range %zu of the codec plan is empty or runs past the "
                     "%zu averaged elements", k, count);
            return -EINVAL;
        }
        total += plan[k].count;
    }
    if (total != count) {
        snprintf(why, why_len, "the codec plan covers %zu of the %zu averaged elements", total,
                 count);
        return -EINVAL;
    }
    if (schema_len > AVERAGER_SCHEMA_PLAN_MAX) {
        snprintf(why, why_len, "a schema of %zu bytes with a codec plan: at most %u", schema_len,
                 AVERAGER_SCHEMA_PLAN_MAX);
        return -EINVAL;
    }
    return 0;
}

/* Takes cfg's plan (checked), adjacent ranges of one codec merged, or its
 * codec over the whole vector, into a->ranges. A plan of one codec is
 * that codec (an averager given it groups with those given the codec). */
static int take_plan(struct averager *a, const struct averager_config *cfg)
{
    /* Without tensors, room for any group's plan (plan_take). */
    a->ranges = calloc(cfg->count == 0 ? AVERAGER_PLAN_MAX : cfg->plan_len ? cfg->plan_len : 1,
                       sizeof(*a->ranges));
    if (!a->ranges)
        return -ENOMEM;
    a->ranges[0] = (struct av_range){ .count = cfg->count, .codec = cfg->codec };
    a->n_ranges = 1;
    for (size_t k = 0; k < cfg->plan_len; k++) {
        struct av_range *last = &a->ranges[a->n_ranges - 1];

        if (k == 0)
            *last = (struct av_range){ .count = cfg->plan[0].count, .codec = cfg->plan[0].codec };
        else if (cfg->plan[k].codec == last->codec)
            last->count += cfg->plan[k].count;
        else
            a->ranges[a->n_ranges++] = (struct av_range){
                .count = cfg->plan[k].count, .codec = cfg->plan[k].codec,
                .src = last->src + last->count };
    }
    a->plan = a->n_ranges > 1;
    a->codec = a->plan ? CODEC_NONE : a->ranges[0].codec;
    return 0;
}

int averager_create(const struct averager_config *cfg, struct averager **out)
{
    struct member_config mc = { 0 };
    struct allreduce_config ac = { 0 };
    struct matchmaker_request check = { 0 };
    char why[128];
    struct averager *a;
    int rc;

    uint8_t schema[MATCHMAKER_SCHEMA_MAX];

    if (!cfg || !cfg->broker || !cfg->host || cfg->count > ((size_t)1 << 30) ||
        cfg->max_count > ((size_t)1 << 30) || (cfg->count == 0 && cfg->codec != CODEC_NONE) ||
        cfg->gather_max > AVERAGER_GATHER_MAX ||
        !isfinite(cfg->state_priority) || cfg->declare_period_ms > MATCHMAKER_EXPIRY_MAX_MS / 2 ||
        !codec_valid((int)cfg->codec) || cfg->schema_len > AVERAGER_SCHEMA_MAX ||
        (cfg->schema_len && !cfg->schema) || (cfg->integrity_mac && !cfg->key) ||
        averager_plan_check(cfg->plan, cfg->plan_len, cfg->count, cfg->codec, cfg->schema_len,
                            why, sizeof(why)) < 0)
        return -EINVAL;
    a = calloc(1, sizeof(*a));
    if (!a)
        return -ENOMEM;
    a->data_fd = -1;
    a->h_exact = -1;
    pthread_mutex_init(&a->lock, NULL);
    clock_cond_init(&a->donor_cond);
    rc = take_plan(a, cfg);
    if (rc < 0)
        goto err;
    /* The codec and the count are part of what the broker compares (see
     * the top); with a plan, the plan's marker and digest; an averager
     * without tensors gives no schema and takes both from its group
     * (take_schema). */
    schema[0] = (uint8_t)((a->plan ? AVERAGER_SCHEMA_PLAN : (unsigned)a->codec) |
                          (cfg->integrity_mac ? AVERAGER_SCHEMA_MAC : 0));
    for (int i = 0; i < 8; i++) {
        schema[1 + i] = (uint8_t)((uint64_t)cfg->count >> (8 * i));
        schema[9 + i] = (uint8_t)((uint64_t)cfg->min_vector_size >> (8 * i));
        schema[17 + i] = (uint8_t)(plan_digest(a->ranges, a->n_ranges) >> (8 * i));
    }
    if (cfg->schema_len)
        memcpy(schema + (a->plan ? 25 : 17), cfg->schema, cfg->schema_len);
    /* The broker would refuse what the matchmaker refuses: say so now. */
    check = (struct matchmaker_request){
        .cohort = cfg->cohort, .id = cfg->id, .address = "127.0.0.1:1", .prefix = cfg->prefix,
        .bits = cfg->initial_bits ? cfg->initial_bits : "", .target = cfg->target_group_size,
        .min = cfg->min_group_size, .min_wait_ms = 0, .timeout_ms = 1,
        .schema = schema, .schema_len = cfg->count ? cfg->schema_len + (a->plan ? 25 : 17) : 0,
        .has_bandwidth = cfg->has_bandwidth, .bandwidth = cfg->bandwidth,
        .client = cfg->client_mode, .any_schema = cfg->count == 0,
    };
    if (matchmaker_check(&check, why, sizeof(why)) < 0) {
        rc = -EINVAL;
        goto err;
    }
    a->cohort = strdup(cfg->cohort);
    a->id = strdup(cfg->id);
    a->prefix = strdup(cfg->prefix);
    snprintf(a->bits, sizeof(a->bits), "%s", check.bits);
    a->target = cfg->target_group_size;
    a->min = cfg->min_group_size;
    a->min_wait_ms = cfg->min_matchmaking_ms;
    a->request_timeout_ms = cfg->request_timeout_ms ? cfg->request_timeout_ms
                                                    : DEFAULT_REQUEST_TIMEOUT_MS;
    a->leave_timeout_ms = cfg->leave_timeout_ms ? cfg->leave_timeout_ms
                                                : LIMIT_LEAVE_TIMEOUT_MS;
    a->count = cfg->count;
    a->gather_max = cfg->gather_max ? cfg->gather_max : DEFAULT_GATHER_MAX;
    a->schema_len = check.schema_len;
    memcpy(a->schema, schema, a->schema_len);
    a->no_tensors = cfg->count == 0;
    a->min_part = cfg->min_vector_size;
    a->max_count = cfg->max_count ? cfg->max_count : AVERAGER_AUX_COUNT_DEFAULT;
    a->has_bandwidth = cfg->has_bandwidth;
    a->bandwidth = cfg->bandwidth;
    a->client = cfg->client_mode;
    if (!a->cohort || !a->id || !a->prefix) {
        rc = -ENOMEM;
        goto err;
    }
    rc = allreduce_listen(cfg->host, &a->data_fd, a->address, sizeof(a->address));
    if (rc < 0)
        goto err;
    ac.cohort = a->cohort;
    ac.member_id = a->id;
    ac.listen_fd = a->data_fd;
    ac.member_timeout_ms = cfg->allreduce_timeout_ms ? cfg->allreduce_timeout_ms
                                                     : AVERAGER_DEFAULT_TIMEOUT_MS;
    ac.segment_bytes = cfg->segment_bytes;
    if (a->plan || a->codec != CODEC_NONE) {
        size_t meta = exact_floats(a, a->target) * sizeof(float);

        ac.small_bytes = meta > CODED_SMALL_BYTES ? meta : CODED_SMALL_BYTES;
    }
    ac.key = cfg->key;
    ac.integrity_mac = cfg->integrity_mac;
    a->integrity = cfg->integrity_mac;
    ac.on_peer_lost = on_peer_lost;
    ac.peer_lost_arg = a;
    rc = allreduce_create(&ac, &a->ar);
    if (rc < 0)
        goto err;
    /* Without tensors the buffer waits for the first group's count. */
    if (!a->no_tensors && (rc = buffer_alloc(a, 0)) < 0)
        goto err;
    mc.broker = cfg->broker;
    mc.cohort = cfg->cohort;
    mc.id = cfg->id;
    mc.address = a->address;
    mc.key = cfg->key;
    mc.tls_ca_pem = cfg->tls_ca_pem;
    mc.tls_server_name = cfg->tls_server_name;
    mc.quiet = true;
    rc = member_create(&mc, &a->member);
    if (rc < 0)
        goto err;
    {
        struct avstate_server_config sc = {
            .cohort = a->cohort, .id = a->id, .host = cfg->host, .key = cfg->key,
            .io_timeout_ms = a->request_timeout_ms,
            /* Within the downloader's wait for the manifest (its request
             * timeout, the same setting): half for the host's snapshot. */
            .provide_timeout_ms = a->request_timeout_ms / 2 ? a->request_timeout_ms / 2 : 1,
            .max_bytes = cfg->max_state_bytes,
        };

        rc = avstate_server_start(&sc, &a->srv);
        if (rc < 0)
            goto err;
    }
    if (cfg->key) {
        a->key = *cfg->key;
        a->keyed = true;
    }
    a->max_state_bytes = cfg->max_state_bytes;
    a->declare_period_ms = cfg->declare_period_ms ? cfg->declare_period_ms
                                                  : DEFAULT_DECLARE_PERIOD_MS;
    a->share = cfg->share_state;
    a->priority = cfg->state_priority;
    a->declare_now = cfg->share_state;
    avstate_server_allow(a->srv, a->share);
    rc = heartbeat_create(a->member, NULL, NULL, &a->beat);
    if (rc < 0)
        goto err;
    if (pthread_create(&a->donor_thread, NULL, donor_main, a) != 0) {
        rc = -EAGAIN;
        goto err;
    }
    *out = a;
    return 0;
err:
    heartbeat_destroy(a->beat);
    avstate_server_stop(a->srv);
    secret_wipe(&a->key);
    member_destroy(a->member);
    if (a->ar)
        buffer_free(a);
    allreduce_destroy(a->ar);
    if (a->data_fd >= 0)
        close(a->data_fd);
    free(a->sum);
    free(a->ranges);
    free(a->cohort);
    free(a->id);
    free(a->prefix);
    pthread_cond_destroy(&a->donor_cond);
    pthread_mutex_destroy(&a->lock);
    free(a);
    return rc;
}

void averager_destroy(struct averager *a)
{
    if (!a)
        return;
    pthread_mutex_lock(&a->lock);
    a->stop = true;
    pthread_cond_broadcast(&a->donor_cond);
    pthread_mutex_unlock(&a->lock);
    heartbeat_destroy(a->beat);
    pthread_join(a->donor_thread, NULL);
    /* Withdrawn first, so that no newcomer is sent to a server that is
     * about to close; its refusals cover the moment in between. */
    avstate_server_allow(a->srv, false);
    if (a->declared) {
        char why[RPC_MESSAGE_MAX + 64];

        (void)donors_call(a, true, false, 0, NULL, why, sizeof(why));
    }
    member_leave(a->member, a->leave_timeout_ms);
    member_destroy(a->member);
    allreduce_destroy(a->ar);
    close(a->data_fd);
    avstate_server_stop(a->srv);
    secret_wipe(&a->key);
    free(a->sum);
    free(a->ranges);
    free(a->cohort);
    free(a->id);
    free(a->prefix);
    pthread_cond_destroy(&a->donor_cond);
    pthread_mutex_destroy(&a->lock);
    free(a);
}

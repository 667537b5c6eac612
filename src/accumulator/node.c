/* src/accumulator/node.c: see node.h.
 *
 * One thread drives the steps; the trainer's calls only change fields
 * under the lock and wake it, and only when it has something to do: on a
 * machine with as many busy threads as cores, a needless wakeup preempts
 * the very thread a round is waiting for (the member's heartbeat thread,
 * heartbeat.h, has its own lock and condition for the same reason).
 *
 * Every member performs the same sequence of all-reduces in an epoch
 * (sync steps, then count and gradient steps), so the engine's round
 * numbers are agreed without talking: epoch << 32 | step.
 *
 * Sync at the start of each epoch:
 *   1. MAX of (version << 20 | (2^20 - 1 - index)) finds the leader: the
 *      highest version, ties to the first in member order.
 *   2. MAX of "I need state" (a version other than the leader's, or never
 *      had state).
 *   3. If anyone needs state: the leader waits for its trainer's
 *      set_state (or sends the state it was given, if its trainer has not
 *      taken it yet); then MAX of the state's length; then the parameters, the
 *      buffers and the opaque state are broadcast as a SUM over 64-bit
 *      integers in which only the leader contributes non-zero words (x + 0
 *      is x exactly, whatever the bits). The leader's own buffers are never
 *      anything but its own bytes, even if the step is cut short.
 *
 * Steps in an epoch, once the trainer contributed:
 *   count:    SUM of (batch, contributions, skips) since the last commit;
 *   gradient: when the batch reaches the virtual batch size, the gradients
 *             are all-reduced out of place into the results region (AVG_BY
 *             the number of contributions). The engine never writes the
 *             gradients, so an aborted step leaves the trainer's
 *             accumulation intact for the retry, and no byte is copied.
 *
 * Fused step: for gradients of at most FUSE_MAX bytes, a round costs one
 * all-reduce, not two. The counters ride behind a copy of the gradients
 * (as exact digits, tally.h) in one SUM; if the batch is complete, the sum
 * is divided by the number of contributions here, with the engine's own
 * kernel, so the bytes are those AVG_BY would give. If it is not, the sum
 * is thrown away, as the count step's would be: the contributions are
 * untouched and the next step reduces them again. A wasted reduction of a
 * small buffer costs about what the count step saves, but a cohort whose
 * rounds need several count steps would pay it every time; so a step is
 * fused only while the previous round of the epoch committed at its first
 * step. Every member sees the same counts, so all decide alike.
 *
 * Counters in the spare bytes: when the trainer's memory has room after
 * the gradients and after the results (node_tensors.grads_spare and
 * results_spare; cohort.c leaves TLINK_SPARE_BYTES), a round can cost one
 * all-reduce beyond FUSE_MAX too, with no copy. The counters go into the spare
 * bytes behind the gradients (or behind the round's slot, which the node
 * allocates with room), as tally digits for m x m members multiplied by
 * m, and the step is the gradient step itself, out of place into the
 * results and their spare bytes, AVG_BY m: each digit comes back as the
 * exact sum of the members' digits (the sum of m x d stays inside the
 * type's exact range, and dividing a multiple of m by m is exact). When
 * every member contributed once (contributions = m) the results are the
 * bytes a gradient step AVG_BY the contributions gives, and the round
 * commits; when the batch is short the result is thrown away, as a count
 * step's would be; otherwise the counts are known and the gradient step
 * runs as after a count step. Such a step is taken only when the
 * previous round of the epoch committed at its first step with one
 * contribution from each member, every member said it has the room
 * (the ninth counter) and the members agreed on no compression, so it
 * is rarely wasted; the first round of an epoch counts. A compression
 * the members start to agree on applies from the round in which they
 * do, as it would after a count step: when the spare step's votes agree
 * on one for gradients that are compressed (float32, over FUSE_MAX), its
 * sum is thrown away and the compressed gradient step runs. Only float32 and
 * float64 gradients carry them, and only while m <= SPARE_MEMBERS_MAX
 * (tally.h gives the digits), and only where the digits add no exchange
 * to the all-reduce (allreduce_same_exchanges). They go as the call's
 * rider (allreduce_run_rider), so they never move gradients of up to
 * recursive doubling's crossover onto the ring. A buffer whose ring
 * chunks are whole segments, such as 1 MiB on 2 members, would gain a
 * short segment at every step, which costs more than the count step
 * saves; the ring folds a tail of up to 1/64 of a segment (4 KiB by
 * default, more than the digits of any member count that carries them)
 * into the segments before it instead, so such buffers take this step
 * too. Every member sees the same counts, so all decide alike.
 *
 * Compression: a gradient step may carry its payload encoded (a codec,
 * engine/codec.h: fp16, bf16 or int8 on the wire, float32 accumulation).
 * Every member must make the same call, so the codec is agreed, not
 * taken on trust: each count step also sums each member's codec and its
 * square, and a step is compressed with codec c only when the sums say
 * every member asked for c (m x sum of squares = square of the sum holds
 * only when all are equal); otherwise, when members disagree, it runs
 * uncompressed, which is always correct, and each member logs that once.
 * The fused step carries exact counters, so it is never compressed, and
 * gradients that fit one (FUSE_MAX) are not compressed in unfused rounds
 * either, so that a setting gives the same results whichever rounds
 * fuse; they gain nothing from it anyway. Only float32 gradients are
 * compressed.
 *
 * Top-k and PowerSGD: the same vote, with two more counters (the
 * parameter and its square), so members agree on the ratio or the rank as
 * well as the method. The reducers (engine/topk.h, engine/powersgd.h)
 * are made on this thread for the parameter agreed, and remade from zero
 * when it changes. Their gradient step reads the round's gradients (the
 * trainer's or the round's slot, untouched until the result is consumed)
 * and sums into the results region, divided here as AVG_BY would; the
 * residual, the error and the warm start are kept only at the commit
 * (reducers_commit), since the buffer sync after the step can still fail.
 * PowerSGD's round is three all-reduces: P, Q, and the elements beyond
 * rows x cols, uncompressed.
 *
 * PowerSGD by tensor shape: a trainer that gave its gradients' layout
 * (node_set_tensor_shapes; accumulator/layout.h) has each matrix reduced
 * on its own, every matrix's P in one all-reduce and every Q, with the
 * uncompressed elements, in another (layout_psgd). The layout is voted
 * like the parameter: 40 bits of layout_hash as two 20-bit counters and
 * their squares (0: no layout, the whole-buffer view above). Members
 * that agree on PowerSGD and its rank but not on the layout run
 * uncompressed, and each logs that once. A new layout takes effect at
 * the next count step, and its reducer starts from zero.
 *
 * Parallel gradients (n > 1): a contribution is copied into one of n
 * private slots and the trainer's gradients are zeroed, so the trainer
 * computes its next batch while rounds go on. Slots queue in order; each
 * count step takes the next one, and the slots a round takes are summed
 * into its first, which the gradient step reduces. Results are applied in
 * order, one at a time, as with n = 1. n is this member's own business:
 * every member still brings one contribution to each count step.
 */
#include "accumulator/node.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "engine/allreduce.h"
#include "engine/powersgd.h"
#include "engine/topk.h"
#include "base/clock.h"
#include "membership/epoch.h"
#include "base/ident.h"
#include "base/limits.h"
#include "base/log.h"
#include "membership/heartbeat.h"
#include "membership/member.h"
#include "accumulator/ckpt.h"
#include "accumulator/compress.h"
#include "accumulator/gpuchan.h"
#include "accumulator/layout.h"
#include "accumulator/lineage.h"
#include "accumulator/tally.h"

/* How long the node thread spins for its trainer's next move (a consume, a
 * contribution) after a step or another move, before it sleeps: a trainer
 * in its loop answers within microseconds, and a condition variable's
 * wakeup costs 10 to 30 us on a busy host, on every round's path. It
 * yields while it spins, so the trainer it waits for can run on its core;
 * a trainer gone to compute its next gradients costs it one spin. */
#define NODE_SPIN_US 200
#define INDEX_BITS 20                   /* members per cohort < 2^20 */
#define SYNC_RETRY_MS 50
#define DEFAULT_REDUCE_TIMEOUT_MS 60000u
#define PARALLEL_MAX NODE_PARALLEL_MAX
#define ADD_CHUNK 4096                  /* elements widened at a time */
#define FUSE_MAX (256u << 10)           /* gradient bytes a fused step carries */
#define COUNTERS 13                     /* batch, contributions, skips, vbs,
                                         * method, method squared, parameter,
                                         * parameter squared, able to carry them
                                         * in the spare bytes (1 or 0), the
                                         * layout's two 20-bit halves, each
                                         * followed by its square */
#define LAYOUT_VOTE_MASK 0xfffffu
#define SPARE_NEED (COUNTERS * TALLY_DIGITS_MAX * sizeof(uint64_t))  /* at most */
#define SPARE_MEMBERS_MAX 4095u         /* m * m must fit the tally's uint32_t */

enum phase { PH_WAIT_EPOCH, PH_SYNC, PH_RUN };

/* A contribution kept aside (parallel gradients). */
struct slot {
    void *buf;                  /* gradient-sized, allocated on first use */
    int h;                      /* engine handle, registered by the node thread; -1 */
    uint64_t batch;             /* 0: a skip, buf unused */
    bool busy;                  /* being filled, queued, or the round's */
};

struct node {
    pthread_mutex_t lock;
    pthread_cond_t cond;        /* the node thread's: a state change */
    struct node_config cfg;
    char *cohort, *id;
    char address[IDENT_ADDRESS_MAX + 1];
    int data_fd;
    bool own_fd;
    struct member *member;
    struct heartbeat *beat;     /* polls the member from once registered */
    struct allreduce *ar;
    pthread_t thread;
    bool stop;
    atomic_uint changes;        /* bumped by changed_locked: what the node thread
                                 * watches while it spins (node_spin) */

    /* Epochs: `latest` from the watch, `cur` the one being worked in. */
    struct epoch *latest, *cur;
    uint64_t cur_id;            /* lineage_epoch_id(cur) */
    uint32_t step;              /* all-reduces done in cur */
    uint64_t epoch_commits;     /* commits in cur */
    enum phase phase;
    long my_index;

    /* Tensors. */
    bool registered;
    struct node_tensors t;
    int h_grads, h_results, h_params, h_buffers, h_small;
    void *buf_scratch;          /* the leader's buffers, received at a sync round */
    int h_buf_scratch;
    int64_t small[COUNTERS];    /* counters and sync words */

    /* Accumulator state. */
    uint64_t version;
    bool has_state;             /* parameters are the cohort's (or we lead them) */
    bool leader;
    char leader_id[IDENT_NAME_MAX + 1];
    uint64_t vbs;               /* virtual batch size */
    uint32_t buffer_sync_rounds;
    uint64_t acc_batch, acc_grads, acc_skips;   /* since the last commit */
    uint64_t acc_epoch;         /* the epoch (lineage id) whose step last reduced
                                 * them; 0: none has */
    uint64_t acc_epoch_no;      /* that epoch's number, for the logs */
    struct lineage lineage;     /* the epochs that committed the recent versions */
    bool contributed;           /* a contribution awaits its count step */
    unsigned parallel;          /* contributions outstanding at most */
    struct slot slots[PARALLEL_MAX];
    int queue[PARALLEL_MAX];    /* slots waiting for a count step, in order */
    size_t q_head, q_len;
    int round_slot;             /* the slot the current round sums into; -1 */
    float *add_scratch;         /* ADD_CHUNK floats: 16-bit sums */
    void *fuse_in, *fuse_out;   /* [gradients | counter digits]; NULL: never fused */
    int h_fuse_in, h_fuse_out;
    bool fuse_next;             /* node thread: the next step is fused */
    bool spare_next;            /* node thread: the next step carries the counters in
                                 * the spare bytes (see "Counters in the spare bytes") */
    struct compress compression;    /* under lock: what this member asks for */
    bool codec_split_logged;    /* node thread: members disagree, said once */
    /* Node thread: the error-feedback reducers (see "Top-k and PowerSGD"),
     * made for the parameter they run with; which one reduced the open
     * round, from which input, for its commit. */
    struct topk *topk;
    uint32_t topk_param;
    struct powersgd *psgd;
    uint32_t psgd_param;
    size_t psgd_rows, psgd_cols;
    float *tail;                /* the gradient's elements beyond rows x cols */
    int h_tail;
    /* PowerSGD by tensor shape: the layout the trainer gave last (under
     * lock, taken at the next count step), the one this member votes
     * with (node thread), and its reducer, made for lpsgd_param and
     * lpsgd_hash. */
    struct layout *layout_next;
    bool layout_next_set;
    struct layout *layout;
    struct layout_psgd *lpsgd;
    uint32_t lpsgd_param;
    uint64_t lpsgd_hash;
    bool round_layered;         /* the open round ran lpsgd */
    float *zeros;               /* grad_count zeros: a member whose round was all skips */
    enum compress_method round_reducer;
    const float *round_in;
    uint32_t round_counts;      /* node thread: count steps in the open round, this epoch */
    bool on_device;             /* node thread: the epoch reduces on the devices */
    bool has_gradients;
    bool wants_state;           /* leader: waiting for set_state */
    void *state_out;            /* leader: from set_state */
    size_t state_out_len;
    bool state_out_ready;
    void *state_in;             /* received */
    size_t state_in_len;
    uint64_t state_in_version;  /* the model version that came with it */
    bool has_new_state;
    bool drop_grads;            /* zero the gradients at the trainer's next call */
    bool sync_refused;          /* a contribution was refused with -EAGAIN during a
                                 * transfer: its gradients are in the trainer's buffer */
    uint64_t failed_at;         /* a step failed with no new epoch yet; 0: none */
    struct node_view stats;     /* counters kept in the view's shape */
    /* Checkpoints: the writer (NULL without a directory), whether one is
     * due and waits for the trainer's set_state, whether set_state is
     * copying the parameters (a sync must not write them meanwhile), and
     * when the last was taken. */
    struct ckpt_writer *ckpt;
    bool ckpt_wanted, ckpt_copying;
    uint64_t ckpt_last_version, ckpt_last_ms;
    struct node_checkpoints ckpt_info;
    struct node_view last_view; /* as last published */
    bool published;
    /* The round being traced (cfg.trace): when its contribution arrived
     * (0: taken by a step), when its result was published and consumed,
     * the node thread's last lap, and the stages so far. */
    struct {
        uint64_t contributed, published, consumed, lap;
        uint64_t ns[NODE_STAGES];
    } tr;
};

static void view_locked(const struct node *n, struct node_view *v);
static void publish_locked(struct node *n);
static void checkpoint_due_locked(struct node *n);
static void reducers_reset(struct node *n);

const char *node_stage_name(enum node_stage s)
{
    static const char *const names[NODE_STAGES] = {
        [NODE_STAGE_WAKE] = "wake",         [NODE_STAGE_COUNT] = "count",
        [NODE_STAGE_COPY_IN] = "copy-in",   [NODE_STAGE_ENGINE] = "engine",
        [NODE_STAGE_COPY_OUT] = "copy-out", [NODE_STAGE_COMMIT] = "commit",
        [NODE_STAGE_APPLY] = "apply",       [NODE_STAGE_NEXT] = "next",
    };
    return (unsigned)s < NODE_STAGES ? names[s] : "?";
}

/* Nanoseconds for the trace; read only when one is kept. */
static uint64_t trace_ns(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Node thread: the time since the last lap goes to stage s. */
static void trace_lap(struct node *n, enum node_stage s)
{
    uint64_t now;

    if (!n->cfg.trace)
        return;
    now = trace_ns();
    n->tr.ns[s] += now - n->tr.lap;
    n->tr.lap = now;
}

/* Wakes the node's threads and republishes the view: the state changed. */
static void changed_locked(struct node *n)
{
    atomic_fetch_add(&n->changes, 1);
    pthread_cond_broadcast(&n->cond);
    publish_locked(n);
}

/* A contribution waits for a step: the round's own, or queued in a slot.
 * The node thread steps on it once no result is held. Lock held. */
static bool holds_contribution_locked(const struct node *n)
{
    return n->contributed || n->q_len > 0;
}

/* Bytes of the gradient buffer, the results region and every slot. */
static size_t grad_bytes(const struct node *n)
{
    return n->t.grad_count * dtype_size(n->t.grad_type);
}

static uint64_t round_of(struct node *n)
{
    return (n->cur->number << 32) | n->step++;
}

/* ---- membership callbacks ---------------------------------------------- */

static void on_epoch(void *arg, struct epoch *e)
{
    struct node *n = arg;

    /* Thread-safe in the engine: aborts a step in flight at once. The
     * member timeout is the broker's grant, known once joined: a peer's
     * host unheard for that long is reported unreachable. */
    if (n->ar) {
        allreduce_set_unreachable_ms(n->ar, member_timeout_ms(n->member));
        allreduce_set_epoch(n->ar, e);
    }
    pthread_mutex_lock(&n->lock);
    epoch_unref(n->latest);
    n->latest = epoch_ref(e);
    changed_locked(n);
    pthread_mutex_unlock(&n->lock);
}

/* The checkpoint this member last wrote or resumed from, and the newest
 * it found invalid, ride its heartbeats: the operator shows the one and
 * reports the other. Lock held. */
static void report_checkpoints_locked(struct node *n)
{
    struct ckpt_writer_stats ws;
    struct node_checkpoints *c = &n->ckpt_info;

    if (!n->ckpt)
        return;
    ckpt_writer_stats(n->ckpt, &ws);
    c->written_version = ws.last_version;
    c->written = ws.written;
    c->failed = ws.failed;
    c->last_bytes = ws.last_bytes;
    c->last_us = ws.last_us;
    c->total_bytes = ws.total_bytes;
    c->total_us = ws.total_us;
    member_set_checkpoint(n->member,
                          c->written_version > c->loaded_version ? c->written_version
                                                                 : c->loaded_version,
                          c->skipped_version, c->skipped_reason);
}

/* Membership runs on a thread of its own (heartbeat.h): heartbeats must
 * go on while the node thread waits in an all-reduce, or a slow step
 * would get this member evicted. It joins only once tensors are
 * registered: a member in the epoch that cannot take part would stall
 * everyone's steps. */
static bool member_ready(void *arg)
{
    struct node *n = arg;
    bool ready;

    pthread_mutex_lock(&n->lock);
    ready = n->registered;
    if (ready)
        report_checkpoints_locked(n);
    pthread_mutex_unlock(&n->lock);
    return ready;
}

/* The engine saw a peer's connection reset with no BYE (its process
 * died): the broker hears it in a heartbeat sent at once. Runs on the
 * node thread, inside a failed run, without n->lock: the heartbeat's
 * own lock is all a wake takes. */
static void on_peer_lost(void *arg, const char *peer)
{
    struct node *n = arg;

    (void)heartbeat_report_lost(n->beat, peer);
}

/* The engine has heard nothing from a peer's host for the member
 * timeout while a step waits (it goes on waiting): the broker hears it
 * in a heartbeat sent at once, and evicts the peer if most of the epoch
 * agrees. As on_peer_lost, on the node thread. */
static void on_peer_unreachable(void *arg, const char *peer, uint64_t epoch)
{
    struct node *n = arg;

    (void)heartbeat_report_unreachable(n->beat, peer, epoch);
}

/* ---- helpers run on the node thread ------------------------------------- */

/* True when a newer epoch than the one in use has arrived. Lock held. */
static bool epoch_moved_locked(const struct node *n)
{
    return n->latest && (!n->cur || n->latest->number > n->cur->number);
}

/* Runs one small all-reduce of `k` int64 words in n->small. */
static int small_reduce(struct node *n, size_t k, enum dtype_op op)
{
    return allreduce_run(n->ar, n->h_small, k, DTYPE_I64, op, 0, round_of(n));
}

/* The slot is free again; its buffer and registration are kept for reuse. */
static void slot_release_locked(struct node *n, int s)
{
    n->slots[s].batch = 0;
    n->slots[s].busy = false;
}

/* Contributions outstanding: the open round (if any) and those queued. */
static size_t outstanding_locked(const struct node *n)
{
    bool open = n->contributed || n->acc_grads + n->acc_skips > 0;

    return n->q_len + (open ? 1 : 0);
}

static void set_leader_locked(struct node *n, size_t index)
{
    const char *id = n->cur->members[index].id;

    snprintf(n->leader_id, sizeof(n->leader_id), "%s", id);
    n->leader = (long)index == n->my_index;
    if (!n->leader)
        n->ckpt_wanted = false;     /* only a leader checkpoints */
}

/* Broadcasts `bytes` from the leader's `buf`. Receivers get them in their
 * own `buf` (registered as `h`); a member that needs nothing contributes
 * zeros from a scratch buffer, so its tensors are never touched. */
static int broadcast(struct node *n, bool receive, int h, void *buf, size_t bytes)
{
    size_t words = (bytes + 7) / 8;
    void *scratch = NULL;
    int hs = -1, rc;

    if (words == 0)
        return 0;
    if (!n->leader && !receive) {
        scratch = calloc(words, 8);
        if (!scratch)
            return -ENOMEM;
        hs = allreduce_register(n->ar, scratch, words * 8);
        if (hs < 0) {
            free(scratch);
            return hs;
        }
        h = hs;
    } else if (!n->leader) {
        memset(buf, 0, words * 8);
    }
    rc = allreduce_run(n->ar, h, words, DTYPE_I64, DTYPE_SUM, 0, round_of(n));
    if (hs >= 0)
        allreduce_unregister(n->ar, hs);
    free(scratch);
    return rc;
}

/* A member behind the leader, about to take its state: whether the round
 * it holds contributions for (version + 1) is among the leader's rounds
 * with them in it. Only if this member's last step on them was in the
 * epoch that committed that round: the others finished it and this member
 * missed the result. A round committed in any other epoch was reduced by
 * members this one was not among, so its contributions are in none of the
 * leader's rounds and are kept for the next one; contributions no step
 * ever reduced likewise. When the leader's lineage does not reach that
 * far back (a version declared or loaded from a checkpoint, or more than
 * LINEAGE_RUNS committing epochs since), nobody can tell: they are dropped,
 * since counting a gradient twice corrupts a committed result while
 * losing one only loses that batch, and the drop is logged. Lock held. */
static bool behind_holds_pending_locked(struct node *n, const struct lineage *leader, uint64_t vmax)
{
    uint64_t pending = n->acc_grads + n->acc_skips;
    enum lineage_answer a;

    if (pending == 0 && !n->contributed)
        return false;
    if (n->acc_epoch == 0) {
        log_info("node", "Behind the leader with contributions no step has reduced yet; they are "
                         "kept for the next round.", LF_S("cohort", n->cohort), LF_S("id", n->id),
                 LF_U("version", n->version), LF_U("leader_version", vmax), LF_U("pending", pending));
        return false;
    }
    a = lineage_holds(leader, n->version + 1, n->acc_epoch);
    if (a == LINEAGE_NO)
        log_info("node", "Behind the leader, whose rounds were committed without this member's "
                         "pending contributions; they are kept for the next round.",
                 LF_S("cohort", n->cohort), LF_S("id", n->id), LF_U("version", n->version),
                 LF_U("leader_version", vmax), LF_U("pending", pending),
                 LF_U("reduced_in_epoch", n->acc_epoch_no));
    else if (a == LINEAGE_YES)
        log_info("node", "Behind the leader, whose next round holds this member's pending "
                         "contributions; they are dropped, not counted twice.",
                 LF_S("cohort", n->cohort), LF_S("id", n->id), LF_U("version", n->version),
                 LF_U("leader_version", vmax), LF_U("pending", pending),
                 LF_U("reduced_in_epoch", n->acc_epoch_no), LF_U("epoch_id", n->acc_epoch),
                 LF_U("lineage_base", leader->base), LF_U("lineage_runs", leader->n));
    else
        log_warn("node", "Behind the leader, whose record does not reach this member's round; its "
                         "pending contributions may be in it and are dropped rather than risk "
                         "counting them twice.", LF_S("cohort", n->cohort), LF_S("id", n->id),
                 LF_U("version", n->version), LF_U("leader_version", vmax),
                 LF_U("pending", pending));
    return a != LINEAGE_NO;
}

/* Drops the contributions of the open round: the leader's state holds
 * them (behind_holds_pending_locked). Lock held. */
static void drop_pending_locked(struct node *n)
{
    n->stats.contributions_dropped += n->acc_grads + n->acc_skips;
    n->acc_batch = n->acc_grads = n->acc_skips = 0;
    n->acc_epoch = 0;
    n->contributed = false;
    n->has_gradients = false;
    if (n->round_slot >= 0) {
        slot_release_locked(n, n->round_slot);
        n->round_slot = -1;
    }
    /* With one round in flight the contribution is the trainer's own
     * buffer, which it may be writing right now: it is zeroed on its own
     * next call instead (node_view). Queued slots of parallel gradients
     * were never in a count step, so nobody counted them: they stay. */
    if (n->parallel == 1)
        n->drop_grads = true;
}

/* Polled by a collective on the devices: a newer epoch, or a stop. */
static bool dev_stale(void *arg)
{
    struct node *n = arg;
    bool moved;

    pthread_mutex_lock(&n->lock);
    moved = n->stop || epoch_moved_locked(n);
    pthread_mutex_unlock(&n->lock);
    return moved;
}

/* The agreement's channel (node.h, node_device.epoch): gpuchan's sums
 * over the engine, with the engine's error kept, for it is the node's. */
struct dev_chan {
    struct ncomm_channel inner;
    int rc;
};

static int dev_sum(void *arg, uint64_t *words, size_t k)
{
    struct dev_chan *c = arg;
    int rc = c->inner.sum_u64(c->inner.arg, words, k);

    if (rc < 0)
        c->rc = rc;
    return rc;
}

/* Every member voted to reduce on its device: each makes the epoch's
 * communicator, and the epoch is on the devices only when all of them
 * are ready (one more sum), else host-staged everywhere alike. */
static int device_epoch(struct node *n)
{
    const struct node_device *d = n->cfg.device;
    struct gpuchan g;
    struct dev_chan c = { .rc = 0 };
    struct ncomm_channel ch = { .sum_u64 = dev_sum, .arg = &c };
    const char **ids;
    size_t m = n->cur->n_members;
    int rc;

    ids = calloc(m, sizeof(*ids));
    if (!ids)
        return -ENOMEM;
    for (size_t i = 0; i < m; i++)
        ids[i] = n->cur->members[i].id;
    /* The agreement takes up to NCOMM_SETUP_SUMS sums: that many rounds
     * are kept for it on every member alike, so the epoch's next rounds
     * stay in step. */
    rc = gpuchan_init(&g, n->ar, round_of(n));
    n->step += NCOMM_SETUP_SUMS - 1;
    if (rc < 0) {
        free(ids);
        return rc;
    }
    c.inner = gpuchan_channel(&g);
    rc = d->epoch(d->arg, n->cur->number, ids, m, n->id, &ch,
                  &(struct ncomm_cancel){ .stale = dev_stale, .arg = n });
    gpuchan_cleanup(&g);
    free(ids);
    if (c.rc < 0)
        return c.rc;
    /* Whether all are ready, and whether all hold tensors of the same
     * sizes: NCCL trusts every rank to pass the same counts, and a
     * member that does not (a trainer that registered other sizes) must
     * not make another's collective run past its buffers or hang. The
     * maxima of each size and of its negation are equal only when every
     * member gave the same. */
    n->small[0] = rc < 0;
    n->small[1] = (int64_t)n->t.grad_count;
    n->small[2] = -(int64_t)n->t.grad_count;
    n->small[3] = (int64_t)n->t.params_bytes;
    n->small[4] = -(int64_t)n->t.params_bytes;
    n->small[5] = (int64_t)n->t.buffers_bytes;
    n->small[6] = -(int64_t)n->t.buffers_bytes;
    n->small[7] = (int64_t)n->t.grad_type;
    n->small[8] = -(int64_t)n->t.grad_type;
    if ((rc = small_reduce(n, 9, DTYPE_MAX)) < 0)
        return rc;
    bool ready = n->small[0] == 0, same = true;

    for (int i = 1; i < 9; i += 2)
        same = same && n->small[i] == -n->small[i + 1];
    n->on_device = ready && same;
    if (!ready)
        log_warn("node", "A member's NCCL communicator is not ready; this epoch reduces host-staged.",
                 LF_S("cohort", n->cohort), LF_S("id", n->id), LF_U("epoch", n->cur->number));
    else if (!same)
        log_warn("node", "Members hold tensors of different sizes; this epoch reduces host-staged.",
                 LF_S("cohort", n->cohort), LF_S("id", n->id), LF_U("epoch", n->cur->number));
    if (!n->on_device)
        d->host(d->arg);
    return 0;
}

/* A tensor of the state transfer: through the devices when the epoch is
 * on them (node_device.broadcast), else over the engine. */
static int broadcast_tensor(struct node *n, bool receive, int h, void *buf, size_t bytes,
                            size_t leader)
{
    struct ncomm_cancel cancel = { .stale = dev_stale, .arg = n };

    if (!n->on_device || bytes == 0)
        return broadcast(n, receive, h, buf, bytes);
    return n->cfg.device->broadcast(n->cfg.device->arg, buf, bytes, (int)leader, receive, &cancel);
}

/* The leader's wait for its trainer's state (node_set_state, after the
 * view said wants_state), until it comes, the node stops or the epoch
 * moves on. Lock held. Every other member waits in this sync meanwhile,
 * and gives up after the engine's silence timeout, to try again in a new
 * epoch: a trainer away from its loop (an evaluation, a stall) would
 * stall the cohort with nothing in any log naming why. So at half that
 * timeout the leader says so, once per sync. */
static void wait_for_state_locked(struct node *n)
{
    uint32_t warn_ms = (n->cfg.reduce_timeout_ms ? n->cfg.reduce_timeout_ms
                                                 : DEFAULT_REDUCE_TIMEOUT_MS) / 2;
    uint64_t from = clock_now_ms();
    bool warned = false;

    while (!n->state_out_ready && !n->stop && !epoch_moved_locked(n)) {
        uint64_t waited = clock_now_ms() - from;
        struct timespec ts;

        if (warned) {
            pthread_cond_wait(&n->cond, &n->lock);
            continue;
        }
        if (waited >= warn_ms) {
            log_warn("node", "This member leads and its trainer has not sent the state the "
                             "others wait for; they go on once it calls update() and answers "
                             "wants_state.",
                     LF_S("cohort", n->cohort), LF_S("id", n->id), LF_U("waited_ms", waited));
            warned = true;
            continue;
        }
        ts = clock_deadline((uint32_t)(warn_ms - waited));
        pthread_cond_timedwait(&n->cond, &n->lock, &ts);
    }
}

/* The sync steps of a new epoch, and whether every member voted to
 * reduce on its device. Returns 0, or the engine's error. */
static int sync_state(struct node *n, bool *all_device)
{
    const uint64_t mask = (1ull << INDEX_BITS) - 1;
    size_t leader;
    bool need, any_need, was_behind;
    uint64_t vmax, state_len;
    size_t state_pad, lineage_bytes = LINEAGE_WORDS * sizeof(int64_t);
    struct lineage got;
    bool got_lineage;
    void *state = NULL;
    int h_state = -1, rc;

    /* A member without valid parameters (a joiner, or one whose last
     * transfer was cut short) ranks below every member with them, at any
     * version: it must never hand out what it does not have. */
    pthread_mutex_lock(&n->lock);
    n->small[0] = (int64_t)(((n->has_state ? n->version + 1 : 0) << INDEX_BITS) |
                            (mask - (uint64_t)n->my_index));
    pthread_mutex_unlock(&n->lock);
    if ((rc = small_reduce(n, 1, DTYPE_MAX)) < 0)
        return rc;
    vmax = (uint64_t)n->small[0] >> INDEX_BITS;
    leader = (size_t)(mask - ((uint64_t)n->small[0] & mask));
    if (leader >= n->cur->n_members)
        return -EPROTO;
    /* With no state anywhere (a new cohort) every other member needs the
     * leader's; its exact version comes with the state below. */
    vmax = vmax ? vmax - 1 : 0;

    pthread_mutex_lock(&n->lock);
    set_leader_locked(n, leader);
    if (n->leader) {
        n->has_state = true;    /* the leader's parameters are the cohort's */
        vmax = n->version;
    }
    need = !n->leader && (n->version != vmax || !n->has_state);
    n->small[0] = need;
    /* The device vote rides along: the maximum of "cannot" is 0 only
     * when every member can reduce on its device. An epoch longer than
     * an NCCL agreement takes is refused by all alike, before any sum. */
    n->small[1] = !(n->cfg.device && n->cur->n_members <= NCOMM_MEMBERS_MAX &&
                    n->cfg.device->can(n->cfg.device->arg));
    publish_locked(n);
    pthread_mutex_unlock(&n->lock);
    if ((rc = small_reduce(n, 2, DTYPE_MAX)) < 0)
        return rc;
    any_need = n->small[0] != 0;
    *all_device = n->small[1] == 0;
    /* The communicator first, so that the transfer below can use it. */
    if (*all_device && (rc = device_epoch(n)) < 0)
        return rc;
    if (!any_need)
        return 0;

    /* Parameters are sent or overwritten only once the trainer has applied
     * any committed result; no new one can commit during the sync. Then the
     * leader asks its trainer for the opaque state and waits for it; the
     * others wait in the next all-reduce meanwhile. */
    pthread_mutex_lock(&n->lock);
    while (n->has_gradients && (n->leader || need) && !n->stop && !epoch_moved_locked(n))
        pthread_cond_wait(&n->cond, &n->lock);
    if (n->has_gradients && (n->leader || need)) {
        pthread_mutex_unlock(&n->lock);
        return -ESTALE;
    }
    if (n->leader && n->has_new_state && n->state_in_version == n->version) {
        /* Its trainer has not taken the state this member was given (the
         * leader's or a checkpoint's), and no round has committed since:
         * that state is this member's, and it is what the others get. The
         * trainer is not asked, because what it would send is the state it
         * had before: moolib's loop answers wants_state before it looks at
         * has_new_state. */
        void *copy = malloc(n->state_in_len ? n->state_in_len : 1);

        if (!copy) {
            pthread_mutex_unlock(&n->lock);
            return -ENOMEM;
        }
        if (n->state_in_len)
            memcpy(copy, n->state_in, n->state_in_len);
        free(n->state_out);
        n->state_out = copy;
        n->state_out_len = n->state_in_len;
        n->state_out_ready = true;
    }
    if (n->leader) {
        if (!n->state_out_ready) {
            n->wants_state = true;
            publish_locked(n);
        }
        wait_for_state_locked(n);
        if (!n->state_out_ready) {
            pthread_mutex_unlock(&n->lock);
            return -ESTALE;
        }
        n->small[0] = (int64_t)n->state_out_len;
        n->small[1] = (int64_t)n->version;
    } else {
        n->small[0] = 0;
        n->small[1] = 0;
        /* A cut-short transfer leaves no valid parameters behind. The
         * parameters are overwritten only once a checkpoint taken while
         * this member led has copied them. */
        if (need)
            n->has_state = false;
        while (need && n->ckpt_copying)
            pthread_cond_wait(&n->cond, &n->lock);
    }
    publish_locked(n);
    pthread_mutex_unlock(&n->lock);
    if ((rc = small_reduce(n, 2, DTYPE_MAX)) < 0)
        return rc;
    state_len = (uint64_t)n->small[0];
    vmax = (uint64_t)n->small[1];
    was_behind = n->version != vmax;
    if (state_len > LIMIT_STATE_BYTES)
        return -EPROTO;
    /* The leader's lineage rides behind the opaque state: which epochs
     * committed the versions it holds (lineage.h). */
    state_pad = (state_len + 7) / 8 * 8;
    state = calloc(1, state_pad + lineage_bytes + 8);
    if (!state)
        return -ENOMEM;
    if (n->leader) {
        memcpy(state, n->state_out, state_len);
        pthread_mutex_lock(&n->lock);
        lineage_encode(&n->lineage, (int64_t *)((char *)state + state_pad));
        pthread_mutex_unlock(&n->lock);
    }
    h_state = allreduce_register(n->ar, state, state_pad + lineage_bytes);
    if (h_state < 0) {
        rc = h_state;
        goto out;
    }
    if ((rc = broadcast_tensor(n, need, n->h_params, n->t.params, n->t.params_bytes, leader)) < 0 ||
        (rc = broadcast_tensor(n, need, n->h_buffers, n->t.buffers, n->t.buffers_bytes,
                               leader)) < 0 ||
        (rc = broadcast(n, true, h_state, state, state_pad + lineage_bytes)) < 0)
        goto out;
    got_lineage = lineage_decode((int64_t *)((char *)state + state_pad), &got) == 0;
    if (!got_lineage && need) {
        log_warn("node", "The leader's lineage is malformed; the versions it holds count as "
                         "unknown.", LF_S("cohort", n->cohort), LF_S("id", n->id),
                 LF_S("leader", n->leader_id));
        lineage_reset(&got, vmax);
    }

    pthread_mutex_lock(&n->lock);
    if (n->leader) {
        n->wants_state = false;
        n->state_out_ready = false;
        free(n->state_out);
        n->state_out = NULL;
    } else if (need) {
        /* Decided on the version this member had. */
        bool drop = was_behind && behind_holds_pending_locked(n, &got, vmax);

        n->version = vmax;
        n->has_state = true;
        free(n->state_in);
        n->state_in = state;
        n->state_in_len = state_len;
        n->state_in_version = vmax;
        state = NULL;
        n->has_new_state = true;
        n->stats.states_received++;

        /* A reduce refused during the transfer (-EAGAIN) left its gradients
         * in the trainer's buffer, which it was told to compute again: the
         * buffer is zeroed, and with one round in flight the kept round's
         * gradients are in that same buffer and go with it (counted). */
        if (!drop && n->sync_refused && n->parallel == 1 && n->acc_grads + n->acc_skips > 0) {
            log_warn("node", "A contribution refused during the state transfer shares the "
                             "gradient buffer with the pending ones; all are dropped.",
                     LF_S("cohort", n->cohort), LF_S("id", n->id),
                     LF_U("pending", n->acc_grads + n->acc_skips));
            drop = true;
        }
        if (drop)
            drop_pending_locked(n);
        if (n->sync_refused)
            n->drop_grads = true;
        n->sync_refused = false;
    }
    /* A member that took the leader's state takes its account of the
     * versions in it; one that kept its own keeps its own. */
    if (!n->leader && need)
        n->lineage = got;
    publish_locked(n);
    pthread_mutex_unlock(&n->lock);
    if (!n->leader && need)
        reducers_reset(n);
    log_info("node", "State synced from the leader.", LF_S("cohort", n->cohort), LF_S("id", n->id),
             LF_S("leader", n->leader_id), LF_U("version", vmax), LF_U("state_bytes", state_len),
             LF_B("received", need));
out:
    if (h_state >= 0)
        allreduce_unregister(n->ar, h_state);
    free(state);
    return rc;
}

static int sync_epoch(struct node *n)
{
    bool all_device = false;
    int rc;

    n->on_device = false;
    rc = sync_state(n, &all_device);
    if (rc < 0)
        return rc;
    if (n->cfg.device && !all_device)
        n->cfg.device->host(n->cfg.device->arg);
    return 0;
}

/* dst += src over `count` elements of type t; 16-bit floats are summed in
 * float32 through a small scratch and rounded once. */
static void add_into(struct node *n, void *dst, const void *src)
{
    enum dtype t = n->t.grad_type;

    if (!dtype_is_16bit_float(t)) {
        dtype_combine(t, DTYPE_SUM, dst, src, n->t.grad_count);
        return;
    }
    for (size_t i = 0; i < n->t.grad_count; i += ADD_CHUNK) {
        size_t len = n->t.grad_count - i < ADD_CHUNK ? n->t.grad_count - i : ADD_CHUNK;
        uint16_t *d = (uint16_t *)dst + i;

        dtype_widen(t, n->add_scratch, d, len);
        dtype_combine_widen(t, DTYPE_SUM, n->add_scratch, (const uint16_t *)src + i, len);
        dtype_narrow(t, d, n->add_scratch, len);
    }
}

/* Parallel gradients: takes the next queued contribution into the round
 * (its counters, and its gradients summed into the round's slot). The
 * sum runs unlocked: the slots involved belong to this thread now.
 * Returns false when nothing is queued. */
static bool take_queued(struct node *n)
{
    int s, into;
    bool add;

    pthread_mutex_lock(&n->lock);
    if (n->q_len == 0) {
        pthread_mutex_unlock(&n->lock);
        return false;
    }
    s = n->queue[n->q_head];
    n->q_head = (n->q_head + 1) % PARALLEL_MAX;
    n->q_len--;
    if (n->slots[s].batch > 0) {
        n->acc_batch += n->slots[s].batch;
        n->acc_grads++;
    } else {
        n->acc_skips++;
    }
    add = n->slots[s].batch > 0 && n->round_slot >= 0;
    if (n->slots[s].batch > 0 && n->round_slot < 0) {
        n->round_slot = s;
        s = -1;
    }
    into = n->round_slot;
    n->contributed = true;
    pthread_mutex_unlock(&n->lock);
    if (add)
        add_into(n, n->slots[into].buf, n->slots[s].buf);
    if (s >= 0) {
        pthread_mutex_lock(&n->lock);
        slot_release_locked(n, s);
        /* A slot is free again: the trainer may contribute. */
        changed_locked(n);
        pthread_mutex_unlock(&n->lock);
    }
    return true;
}

/* The round's own gradients: the trainer's (n = 1) or the round's slot;
 * NULL when every contribution of this member to the round was a skip
 * under parallel gradients, where the trainer's gradients hold its next
 * batch, not this round's: the member then contributes zeros. */
static void *round_grads(const struct node *n, bool slots)
{
    if (n->round_slot >= 0)
        return n->slots[n->round_slot].buf;
    return slots ? NULL : n->t.grads;
}

/* PowerSGD's view of the gradient buffer (see "Top-k and PowerSGD" at
 * the top of the file): rows = floor(sqrt(count)), cols = count / rows;
 * the count - rows x cols elements left over (fewer than rows) reduce
 * uncompressed. */
static void psgd_shape(size_t count, size_t *rows, size_t *cols)
{
    size_t r = 1;

    while ((r + 1) <= count / (r + 1))
        r++;
    *rows = r;
    *cols = count / r;
}

/* Destroys the reducers (node thread; before the engine goes). */
static void reducers_free(struct node *n)
{
    topk_destroy(n->topk);
    n->topk = NULL;
    powersgd_destroy(n->psgd);
    n->psgd = NULL;
    layout_psgd_destroy(n->lpsgd);
    n->lpsgd = NULL;
    if (n->h_tail >= 0)
        allreduce_unregister(n->ar, n->h_tail);
    n->h_tail = -1;
    free(n->tail);
    n->tail = NULL;
    free(n->zeros);
    n->zeros = NULL;
    n->round_reducer = COMPRESS_NONE;
}

/* This member's parameters were replaced by the leader's: what it had
 * not sent belongs to gradients of a model that is gone, so it starts
 * again from zero, as a joiner does. */
static void reducers_reset(struct node *n)
{
    if (n->topk)
        topk_reset(n->topk);
    if (n->psgd)
        powersgd_reset(n->psgd);
    layout_psgd_reset(n->lpsgd);
    n->round_reducer = COMPRESS_NONE;
}

/* The reducer for `c` (top-k or PowerSGD), made or remade for its
 * parameter. A remade reducer starts from zero (the old residual was
 * for another parameter; every member remakes it in the same round,
 * since they all agreed on the new one). */
static int reducer_ready(struct node *n, const struct compress *c)
{
    size_t count = n->t.grad_count;
    int rc;

    if (c->method == COMPRESS_TOPK) {
        size_t k;

        if (n->topk && n->topk_param == c->param)
            return 0;
        topk_destroy(n->topk);
        n->topk = NULL;
        if ((rc = topk_k_for_ratio(count, (double)c->param / COMPRESS_TOPK_ONE, &k)) < 0 ||
            (rc = topk_create(n->ar, count, k, &n->topk)) < 0)
            return rc;
        n->topk_param = c->param;
        return 0;
    }
    if (n->layout) {
        uint64_t h = layout_hash(n->layout);

        if (n->lpsgd && n->lpsgd_param == c->param && n->lpsgd_hash == h)
            return 0;
        layout_psgd_destroy(n->lpsgd);
        n->lpsgd = NULL;
        /* The same seed as the whole-buffer view: every member's. */
        if ((rc = layout_psgd_create(n->ar, n->layout, c->param, 0x636f686f7274ull, &n->lpsgd)) < 0)
            return rc;
        n->lpsgd_param = c->param;
        n->lpsgd_hash = h;
        return 0;
    }
    if (n->psgd && n->psgd_param == c->param)
        return 0;
    powersgd_destroy(n->psgd);
    n->psgd = NULL;
    psgd_shape(count, &n->psgd_rows, &n->psgd_cols);
    if (!n->tail) {
        /* At most rows - 1 elements; at least one float so it registers. */
        if (!(n->tail = calloc(n->psgd_rows, sizeof(float))))
            return -ENOMEM;
        if ((rc = allreduce_register(n->ar, n->tail, n->psgd_rows * sizeof(float))) < 0)
            return rc;
        n->h_tail = rc;
    }
    /* The seed is fixed: every member must start from the same Q. */
    if ((rc = powersgd_create(n->ar, n->psgd_rows, n->psgd_cols, c->param, 0x636f686f7274ull,
                              &n->psgd)) < 0)
        return rc;
    n->psgd_param = c->param;
    return 0;
}

/* The gradient step through top-k or PowerSGD: the sum into the results
 * region, then divided by the contributions as AVG_BY would. The
 * reducers' state is not touched here: run_step commits it with the
 * round (reducers_commit), so a round that fails after this step (an
 * epoch change during the buffer sync) is sent again unchanged. */
static int reducer_step(struct node *n, const float *in, uint64_t grads, const struct compress *c)
{
    float *out = n->t.results;
    size_t count = n->t.grad_count;
    int rc;

    if ((rc = reducer_ready(n, c)) < 0)
        return rc;
    if (!in && !n->zeros && !(n->zeros = calloc(count, sizeof(float))))
        return -ENOMEM;
    if (!in)
        in = n->zeros;
    n->round_reducer = COMPRESS_NONE;
    n->round_layered = false;
    if (c->method == COMPRESS_TOPK) {
        rc = topk_reduce_into(n->topk, in, out, DTYPE_SUM, round_of(n));
    } else if (n->layout) {
        uint64_t round = round_of(n);

        n->step++;      /* rounds round and round + 1, as below */
        rc = layout_psgd_reduce_into(n->lpsgd, in, out, DTYPE_SUM, round);
        n->round_layered = true;
    } else {
        size_t cells = n->psgd_rows * n->psgd_cols, rest = count - cells;
        uint64_t round = round_of(n);

        n->step++;      /* PowerSGD uses round and round + 1 */
        rc = powersgd_reduce_into(n->psgd, in, out, DTYPE_SUM, round);
        if (rc == 0 && rest > 0) {
            memcpy(n->tail, in + cells, rest * sizeof(float));
            rc = allreduce_run(n->ar, n->h_tail, rest, DTYPE_F32, DTYPE_SUM, 0, round_of(n));
            if (rc == 0)
                memcpy(out + cells, n->tail, rest * sizeof(float));
        }
    }
    if (rc < 0)
        return rc;
    dtype_scale(DTYPE_F32, out, count, (double)grads);
    n->round_reducer = c->method;
    n->round_in = in;
    return 0;
}

/* With the round's commit: the reducer that ran keeps its new residual
 * (error, warm start), from the same input it reduced. */
static void reducers_commit(struct node *n)
{
    if (n->round_reducer == COMPRESS_TOPK)
        topk_commit(n->topk, n->round_in);
    else if (n->round_reducer == COMPRESS_POWERSGD && n->round_layered)
        layout_psgd_commit(n->lpsgd);
    else if (n->round_reducer == COMPRESS_POWERSGD)
        powersgd_commit(n->psgd);
    n->round_reducer = COMPRESS_NONE;
}

/* The gradient step, out of place into the results region (AVG_BY the
 * `grads` contributions). The round's slot is registered on first use,
 * on this thread, as the engine wants. */
static int gradient_step(struct node *n, bool slots, uint64_t grads, const struct compress *c)
{
    size_t bytes = grad_bytes(n);
    int src = n->h_grads;
    bool big = n->t.grad_type == DTYPE_F32 && bytes > FUSE_MAX;

    if (big && (c->method == COMPRESS_TOPK || c->method == COMPRESS_POWERSGD))
        return reducer_step(n, round_grads(n, slots), grads, c);
    if (!round_grads(n, slots)) {
        /* In place over zeros: the results region is free until commit. */
        memset(n->t.results, 0, bytes);
        src = n->h_results;
    } else if (n->round_slot >= 0) {
        struct slot *sl = &n->slots[n->round_slot];

        if (sl->h < 0)
            sl->h = allreduce_register(n->ar, sl->buf, bytes + SPARE_NEED);
        if (sl->h < 0)
            return sl->h;
        src = sl->h;
    }
    return allreduce_run_codec(n->ar, src, n->h_results, n->t.grad_count, n->t.grad_type,
                               DTYPE_AVG_BY, (double)grads,
                               c->method < COMPRESS_TOPK &&
                                       codec_supports((enum codec)c->method, n->t.grad_type) && big
                                   ? (enum codec)c->method
                                   : CODEC_NONE,
                               round_of(n));
}

/* Whether every member gave the same value v, from the sums of v and of
 * v squared over the m members (m x sum of squares = square of the sum
 * holds only when all are equal); sets *common. */
static bool all_equal(uint64_t m, uint64_t sum, uint64_t sum_sq, uint64_t *common)
{
    if (sum_sq * m != sum * sum || sum % m != 0)
        return false;
    *common = sum / m;
    return true;
}

/* The compression the count step's sums agree on (see the top of the
 * file): the members' common choice, method and parameter, or none when
 * they differ in either. c[] is the count step's counters. */
static struct compress agreed_compress(struct node *n, const uint64_t *c, const struct compress *mine)
{
    uint64_t m = n->cur->n_members, method, param, lo, hi, h = layout_hash(n->layout);
    struct compress agreed;
    char text[COMPRESS_TEXT_MAX];
    bool same = false;

    /* The common value must also be this member's own: sums a peer
     * forged to wrap around can never make it use what it did not ask for. */
    if (all_equal(m, c[4], c[5], &method) && all_equal(m, c[6], c[7], &param) &&
        method == (uint64_t)mine->method && param == mine->param) {
        agreed = *mine;
        same = compress_valid(&agreed);
        /* PowerSGD only: the others reduce the buffer whole, whatever its
         * tensors. */
        if (same && agreed.method != COMPRESS_POWERSGD) {
            n->codec_split_logged = false;
            return agreed;
        }
        if (same && all_equal(m, c[9], c[10], &lo) && all_equal(m, c[11], c[12], &hi) &&
            lo == (h & LAYOUT_VOTE_MASK) && hi == ((h >> 20) & LAYOUT_VOTE_MASK)) {
            n->codec_split_logged = false;
            return agreed;
        }
    }
    if (!n->codec_split_logged && same)
        log_warn("node", "Members give different tensor layouts for PowerSGD; gradient steps run uncompressed until they agree.",
                 LF_S("cohort", n->cohort), LF_S("id", n->id),
                 LF_U("matrices", layout_matrices(n->layout)));
    else if (!n->codec_split_logged)
        log_warn("node", "Members ask for different compression; gradient steps run uncompressed until they agree.",
                 LF_S("cohort", n->cohort), LF_S("id", n->id),
                 LF_S("mine", compress_format(mine, text, sizeof(text))));
    n->codec_split_logged = true;
    return compress_default(COMPRESS_NONE);
}

/* The count step and the gradient step in one SUM (see the top of the
 * file): c[] in, this member's counters; out, the cohort's. The sum of
 * the gradients stays in fuse_out until run_step commits it. */
static int fused_step(struct node *n, bool slots, uint64_t *c)
{
    size_t bytes = grad_bytes(n);
    uint32_t m = (uint32_t)n->cur->n_members;
    const void *g = round_grads(n, slots);
    int rc;

    if (g)
        memcpy(n->fuse_in, g, bytes);
    else
        memset(n->fuse_in, 0, bytes);
    tally_encode(n->t.grad_type, m, c, COUNTERS, (char *)n->fuse_in + bytes);
    trace_lap(n, NODE_STAGE_COPY_IN);
    rc = allreduce_run_into(n->ar, n->h_fuse_in, n->h_fuse_out,
                            n->t.grad_count + COUNTERS * tally_digits(n->t.grad_type, m),
                            n->t.grad_type, DTYPE_SUM, 0, round_of(n));
    trace_lap(n, NODE_STAGE_ENGINE);
    if (rc < 0)
        return rc;
    tally_decode(n->t.grad_type, m, (char *)n->fuse_out + bytes, c, COUNTERS);
    return 0;
}

/* Digits per counter in the spare bytes with m members; 0 when this
 * member has no room for them (see "Counters in the spare bytes"). */
static size_t spare_digits(const struct node *n, uint32_t m)
{
    enum dtype t = n->t.grad_type;
    size_t per;

    if ((t != DTYPE_F32 && t != DTYPE_F64) || m == 0 || m > SPARE_MEMBERS_MAX)
        return 0;
    per = tally_digits(t, m * m);
    if (per == 0 || COUNTERS * per * dtype_size(t) > n->t.grads_spare ||
        COUNTERS * per * dtype_size(t) > n->t.results_spare)
        return 0;
    /* Where the digits would add a short ring segment to every step (a
     * tail too long for the ring to fold, engine/ring.c), the count step
     * costs less. */
    if (!allreduce_same_exchanges(n->ar, m, n->t.grad_count, COUNTERS * per, t, true))
        return 0;
    return per;
}

/* The count step and the gradient step in one AVG_BY m, the counters in
 * the spare bytes (see "Counters in the spare bytes"): c[] in, this
 * member's counters; out, the cohort's. The results region holds the
 * gradients' sum divided by m. */
static int spare_step(struct node *n, bool slots, uint64_t *c, uint32_t m, size_t per)
{
    size_t bytes = grad_bytes(n), k = COUNTERS * per;
    void *g = round_grads(n, slots);
    char *tail;
    int src, rc;

    if (!g) {
        /* In place over zeros: the results region is free until commit. */
        memset(n->t.results, 0, bytes);
        src = n->h_results;
        tail = (char *)n->t.results + bytes;
    } else if (n->round_slot >= 0) {
        struct slot *sl = &n->slots[n->round_slot];

        if (sl->h < 0)
            sl->h = allreduce_register(n->ar, sl->buf, bytes + SPARE_NEED);
        if (sl->h < 0)
            return sl->h;
        src = sl->h;
        tail = (char *)sl->buf + bytes;
    } else {
        src = n->h_grads;
        tail = (char *)n->t.grads + bytes;
    }
    tally_encode(n->t.grad_type, m * m, c, COUNTERS, tail);
    /* Digits below 2^(E - bits(m * m)) times m: still exact integers. */
    for (size_t i = 0; i < k; i++) {
        if (n->t.grad_type == DTYPE_F32)
            ((float *)(void *)tail)[i] *= (float)m;
        else
            ((double *)(void *)tail)[i] *= (double)m;
    }
    trace_lap(n, NODE_STAGE_COPY_IN);
    /* The digits are a rider: the gradients alone choose the algorithm,
     * as for the gradient step they replace. */
    rc = allreduce_run_rider(n->ar, src, n->h_results, n->t.grad_count + k, k, n->t.grad_type,
                             DTYPE_AVG_BY, (double)m, round_of(n));
    trace_lap(n, NODE_STAGE_ENGINE);
    if (rc < 0)
        return rc;
    tally_decode(n->t.grad_type, m * m, (char *)n->t.results + bytes, c, COUNTERS);
    return 0;
}

/* Count step, then the gradient step if the batch is complete; or both at
 * once (fused_step, spare_step). */
static int run_step(struct node *n)
{
    uint64_t c[COUNTERS], batch, grads, skips, vbs, method;
    struct compress mine, agreed;
    size_t bytes = grad_bytes(n), per;
    uint32_t m;
    int rc;
    bool take, slots, fused, spare, done;

    pthread_mutex_lock(&n->lock);
    take = !n->contributed;
    pthread_mutex_unlock(&n->lock);
    if (take && !take_queued(n))
        return 0;
    /* Host-staged: the device's gradients are read from the node's buffer. */
    if (n->cfg.device && !n->on_device && (rc = n->cfg.device->gather(n->cfg.device->arg)) < 0)
        return rc;
    /* Only this count step's gradient step may be committed: a reducer
     * that ran in a round that then failed is not this round's. */
    n->round_reducer = COMPRESS_NONE;
    pthread_mutex_lock(&n->lock);
    if (n->cfg.trace) {
        n->tr.lap = trace_ns();
        if (n->tr.contributed)
            n->tr.ns[NODE_STAGE_WAKE] += n->tr.lap - n->tr.contributed;
        n->tr.contributed = 0;
    }
    c[0] = n->acc_batch;
    c[1] = n->acc_grads;
    c[2] = n->acc_skips;
    c[3] = n->vbs;
    if (n->layout_next_set) {
        /* The new layout is this round's vote; the reducer of the old
         * one is remade when it differs (reducer_ready). */
        layout_free(n->layout);
        n->layout = n->layout_next;
        n->layout_next = NULL;
        n->layout_next_set = false;
    }
    c[9] = layout_hash(n->layout) & LAYOUT_VOTE_MASK;
    c[10] = c[9] * c[9];
    c[11] = (layout_hash(n->layout) >> 20) & LAYOUT_VOTE_MASK;
    c[12] = c[11] * c[11];
    mine = n->compression;
    c[4] = (uint64_t)mine.method;
    c[5] = c[4] * c[4];
    c[6] = mine.param;
    c[7] = c[6] * c[6];
    m = (uint32_t)n->cur->n_members;
    per = spare_digits(n, m);
    c[8] = per > 0;
    /* From here the others may finish this round without us (we miss its
     * result): if they do, these contributions are in it (sync_epoch). */
    n->acc_epoch = n->cur_id;
    n->acc_epoch_no = n->cur->number;
    /* Stable for the round: it changes only with nothing outstanding. */
    slots = n->parallel > 1;
    pthread_mutex_unlock(&n->lock);
    spare = !n->on_device && n->spare_next && per > 0;
    fused = !n->on_device && !spare && n->fuse_next && n->fuse_in &&
            tally_digits(n->t.grad_type, (uint32_t)n->cur->n_members);
    if (spare) {
        rc = spare_step(n, slots, c, m, per);
    } else if (fused) {
        rc = fused_step(n, slots, c);
    } else {
        for (int i = 0; i < COUNTERS; i++)
            n->small[i] = (int64_t)c[i];
        rc = small_reduce(n, COUNTERS, DTYPE_SUM);
        for (int i = 0; i < COUNTERS; i++)
            c[i] = (uint64_t)n->small[i];
        trace_lap(n, NODE_STAGE_COUNT);
    }
    if (rc < 0)
        return rc;
    batch = c[0];
    grads = c[1];
    skips = c[2];
    /* Members may have been told different virtual batch sizes; the mean
     * of what they were told is the same number on every member, so they
     * all decide alike. */
    vbs = (c[3] + n->cur->n_members - 1) / n->cur->n_members;
    n->round_counts++;

    pthread_mutex_lock(&n->lock);
    if (batch < vbs) {
        /* Not enough yet: everyone contributes again. */
        n->contributed = false;
        n->fuse_next = false;
        n->spare_next = false;
        pthread_mutex_unlock(&n->lock);
        return 0;
    }
    pthread_mutex_unlock(&n->lock);
    /* The trainer writes no gradient and reads no result meanwhile: it has
     * contributed (or its contribution is in a slot), and the last result
     * was consumed. */
    /* A spare step divided by m: the round's result when m contributions
     * made it, as AVG_BY the contributions would give; unless the votes
     * it carried agree on a compression for gradients that take one:
     * that applies from this round, as after a count step, so the sum is
     * thrown away for the compressed gradient step. */
    done = false;
    if (spare && grads == m) {
        agreed = agreed_compress(n, c, &mine);
        done = agreed.method == COMPRESS_NONE || n->t.grad_type != DTYPE_F32 || bytes <= FUSE_MAX;
    }
    if (n->on_device) {
        struct ncomm_cancel cancel = { .stale = dev_stale, .arg = n };

        /* Uncompressed: NCCL's links need no help from a codec. */
        rc = n->cfg.device->reduce(n->cfg.device->arg, grads, &cancel);
        trace_lap(n, NODE_STAGE_ENGINE);
        if (rc < 0)
            return rc;
    } else if (fused && grads > 0) {
        memcpy(n->t.results, n->fuse_out, bytes);
        dtype_scale(n->t.grad_type, n->t.results, n->t.grad_count, (double)grads);
        trace_lap(n, NODE_STAGE_COPY_OUT);
    } else if (grads > 0 && !done) {
        agreed = agreed_compress(n, c, &mine);
        rc = gradient_step(n, slots, grads, &agreed);
        trace_lap(n, NODE_STAGE_ENGINE);
        if (rc < 0)
            return rc;
    }
    /* Every buffer_sync_rounds commits of this epoch, the leader's buffers
     * too. Counted per epoch because only that count is the same on every
     * member by construction (a joiner has seen fewer commits, and a
     * declared version can move mid-epoch). */
    bool sync_buffers = n->t.buffers_bytes > 0 &&
                        (n->epoch_commits + 1) % n->buffer_sync_rounds == 0;
    if (sync_buffers) {
        if (n->leader)
            memcpy(n->buf_scratch, n->t.buffers, n->t.buffers_bytes);
        else
            memset(n->buf_scratch, 0, n->t.buffers_bytes);
        rc = allreduce_run(n->ar, n->h_buf_scratch, n->t.buffers_bytes / 8, DTYPE_I64, DTYPE_SUM, 0,
                           round_of(n));
        if (rc < 0)
            return rc;
    }
    /* Nothing can fail from here: the round commits, and so do the
     * reducers (outside the lock: a pass over the gradients). */
    reducers_commit(n);
    pthread_mutex_lock(&n->lock);
    while (sync_buffers && !n->leader && n->ckpt_copying)
        pthread_cond_wait(&n->cond, &n->lock);
    if (sync_buffers && !n->leader)
        memcpy(n->t.buffers, n->buf_scratch, n->t.buffers_bytes);
    if (grads == 0)     /* everyone skipped: a zero step */
        memset(n->t.results, 0, bytes);
    n->version++;
    /* A newer epoch may have reached the engine during the step, which
     * then ran among its members (the engine has no other): which epoch
     * committed this round is not known for sure. */
    lineage_commit(&n->lineage, epoch_moved_locked(n) ? LINEAGE_UNSURE : n->cur_id, n->version);
    n->epoch_commits++;
    n->fuse_next = n->round_counts == 1;
    /* Members that all have room, agreed on no compression, and a round
     * of one contribution each, committed at its first step: the next
     * is likely the same. */
    n->spare_next = n->round_counts == 1 && grads == m && c[8] == m &&
                    all_equal(m, c[4], c[5], &method) && method == COMPRESS_NONE;
    n->round_counts = 0;
    n->has_gradients = true;
    n->contributed = false;
    if (n->round_slot >= 0) {
        slot_release_locked(n, n->round_slot);
        n->round_slot = -1;
    }
    n->acc_batch = n->acc_grads = n->acc_skips = 0;
    n->acc_epoch = 0;
    n->stats.batch_size = batch;
    n->stats.num_gradients = grads;
    n->stats.num_skipped = skips;
    n->stats.rounds_committed++;
    checkpoint_due_locked(n);
    /* Stamped before the view goes out: the trainer it wakes may take
     * this thread's core at once, and that time is the trainer's. */
    if (n->cfg.trace) {
        trace_lap(n, NODE_STAGE_COMMIT);
        n->tr.published = n->tr.lap;
    }
    changed_locked(n);
    pthread_mutex_unlock(&n->lock);
    return 0;
}

/* After a commit: the leader asks its trainer for its state (the view's
 * wants_state, once the result is applied) when a checkpoint is due and
 * the writer is free. A write still in progress postpones the next one to
 * a later commit: one copy of the state at most is ever held. */
static void checkpoint_due_locked(struct node *n)
{
    uint64_t every = n->cfg.checkpoint_every_versions, secs = n->cfg.checkpoint_every_s;

    if (!n->ckpt || !n->leader || n->ckpt_wanted || ckpt_writer_busy(n->ckpt))
        return;
    if ((every && n->version >= n->ckpt_last_version + every) ||
        (secs && clock_now_ms() - n->ckpt_last_ms >= secs * 1000))
        n->ckpt_wanted = true;
}

/* A step failed and no new epoch explains it (a peer timed out, members
 * fell out of step). Waiting would wait forever: the membership has not
 * changed. Rejoining with a new session makes the broker publish a new
 * epoch, in which every member syncs again. */
static void resync_locked(struct node *n, const char *why, int rc)
{
    log_warn("node", why, LF_S("cohort", n->cohort), LF_S("id", n->id), LF_ERR(rc));
    member_rejoin(n->member);
}

/* After a failed step: a peer that died is evicted by the broker within
 * the member timeout, and that new epoch is the cure; resyncing at once
 * would only add epochs. A timeout or a mismatch has no such cure coming.
 */
static void step_failed_locked(struct node *n, int rc)
{
    n->phase = PH_WAIT_EPOCH;
    if (rc == -ESTALE)
        return;
    if (rc == -ECONNRESET || rc == -EPIPE) {
        n->failed_at = clock_now_ms();
        return;
    }
    resync_locked(n, "A step failed and no membership change explains it; resyncing the cohort.", rc);
}

static void adopt_epoch_locked(struct node *n)
{
    epoch_unref(n->cur);
    n->cur = epoch_ref(n->latest);
    n->cur_id = lineage_epoch_id(n->cur);
    n->step = 0;
    n->epoch_commits = 0;
    n->fuse_next = true;
    n->spare_next = false;
    n->round_counts = 0;
    n->on_device = false;
    n->my_index = epoch_find(n->cur, n->id);
    n->phase = n->my_index >= 0 ? PH_SYNC : PH_WAIT_EPOCH;
    n->stats.epochs_seen++;
}

/* Spins up to NODE_SPIN_US, lock released, for a change (changed_locked).
 * Lock held on entry and return; true when one came. The spin hook
 * (node_config.on_spin) may bring it itself: a sidecar's node thread takes
 * its trainer's next move from the doorbell rather than wait for the link
 * thread to wake and pass it on. */
static bool node_spin(struct node *n)
{
    void (*hook)(void *, struct node *, enum node_spin) = n->cfg.on_spin;
    unsigned seen = atomic_load(&n->changes);
    uint64_t from = clock_now_us();

    pthread_mutex_unlock(&n->lock);
    if (hook)
        hook(n->cfg.view_arg, n, NODE_SPIN_BEGIN);
    for (;;) {
        if (hook)
            hook(n->cfg.view_arg, n, NODE_SPIN_POLL);
        if (atomic_load(&n->changes) != seen || clock_now_us() - from >= NODE_SPIN_US)
            break;
        sched_yield();
    }
    if (hook)
        hook(n->cfg.view_arg, n, NODE_SPIN_END);
    pthread_mutex_lock(&n->lock);
    return atomic_load(&n->changes) != seen;
}

static void *node_main(void *arg)
{
    struct node *n = arg;
    bool hot = false;           /* a step or a trainer's move just happened */

    pthread_mutex_lock(&n->lock);
    while (!n->stop) {
        int rc;

        /* Every turn follows a change: a step, a phase, an epoch. */
        publish_locked(n);
        if (epoch_moved_locked(n)) {
            n->failed_at = 0;
            adopt_epoch_locked(n);
        } else if (n->failed_at &&
                   clock_now_ms() - n->failed_at > member_timeout_ms(n->member) + 2000u) {
            n->failed_at = 0;
            resync_locked(n, "A peer's connection broke and no new epoch followed; resyncing the "
                             "cohort.", -ECONNRESET);
        }
        if (n->phase == PH_SYNC) {
            pthread_mutex_unlock(&n->lock);
            rc = sync_epoch(n);
            pthread_mutex_lock(&n->lock);
            if (rc == 0) {
                n->phase = PH_RUN;
                member_set_model_version(n->member, n->version, false);
            } else {
                step_failed_locked(n, rc);
            }
            continue;
        }
        if (n->phase == PH_RUN && holds_contribution_locked(n) && !n->has_gradients) {
            pthread_mutex_unlock(&n->lock);
            rc = run_step(n);
            pthread_mutex_lock(&n->lock);
            if (rc < 0) {
                /* Keep the contribution: the next epoch reduces it again. */
                n->stats.rounds_retried++;
                step_failed_locked(n, rc);
            } else {
                member_set_model_version(n->member, n->version, false);
                hot = true;
            }
            continue;
        }
        /* Right after a step or a move of the trainer, its next move is
         * likely microseconds away (see NODE_SPIN_US); otherwise sleep. */
        if (hot && n->phase == PH_RUN) {
            hot = node_spin(n);
            if (hot)
                continue;
        }
        {
            struct timespec ts = clock_deadline(20);
            pthread_cond_timedwait(&n->cond, &n->lock, &ts);
        }
    }
    pthread_mutex_unlock(&n->lock);
    return NULL;
}

/* ---- API ---------------------------------------------------------------- */

int node_start(const struct node_config *cfg, struct node **out)
{
    struct member_config mc = { 0 };
    struct allreduce_config ac = { 0 };
    struct node *n;
    int rc;

    if (!cfg || !cfg->broker || !ident_valid_cohort(cfg->cohort) ||
        !ident_valid_member_id(cfg->id) || !cfg->host || cfg->parallel_gradients > PARALLEL_MAX ||
        cfg->algorithm > NODE_ALGORITHM_DOUBLING ||
        (cfg->device && cfg->parallel_gradients > 1) ||
        (cfg->checkpoint_dir && (!*cfg->checkpoint_dir || cfg->checkpoint_keep > CKPT_KEEP_MAX ||
                                 (!cfg->checkpoint_every_versions && !cfg->checkpoint_every_s))))
        return -EINVAL;
    n = calloc(1, sizeof(*n));
    if (!n)
        return -ENOMEM;
    n->cfg = *cfg;
    n->cohort = strdup(cfg->cohort);
    n->id = strdup(cfg->id);
    n->version = cfg->model_version;
    lineage_reset(&n->lineage, n->version);
    n->vbs = cfg->virtual_batch_size ? cfg->virtual_batch_size : 1;
    n->compression = compress_valid(&cfg->compression) ? cfg->compression
                                                       : compress_default(COMPRESS_NONE);
    n->parallel = cfg->parallel_gradients ? cfg->parallel_gradients : 1;
    n->round_slot = -1;
    for (int i = 0; i < PARALLEL_MAX; i++)
        n->slots[i].h = -1;
    n->buffer_sync_rounds = cfg->buffer_sync_rounds ? cfg->buffer_sync_rounds : 100;
    n->h_grads = n->h_results = n->h_params = n->h_buffers = n->h_small = n->h_buf_scratch = -1;
    n->h_fuse_in = n->h_fuse_out = n->h_tail = -1;
    n->phase = PH_WAIT_EPOCH;
    pthread_mutex_init(&n->lock, NULL);
    clock_cond_init(&n->cond);
    if (!n->cohort || !n->id) {
        rc = -ENOMEM;
        goto err;
    }
    rc = allreduce_listen(cfg->host, &n->data_fd, n->address, sizeof(n->address));
    if (rc < 0)
        goto err;
    n->own_fd = true;
    ac.cohort = n->cohort;
    ac.member_id = n->id;
    ac.listen_fd = n->data_fd;
    ac.member_timeout_ms = cfg->reduce_timeout_ms ? cfg->reduce_timeout_ms : DEFAULT_REDUCE_TIMEOUT_MS;
    ac.key = cfg->key;
    ac.integrity_mac = cfg->integrity_mac;
    ac.on_peer_lost = on_peer_lost;
    ac.peer_lost_arg = n;
    ac.on_peer_unreachable = on_peer_unreachable;
    ac.peer_unreachable_arg = n;
    ac.small_bytes = cfg->algorithm == NODE_ALGORITHM_RING       ? ALLREDUCE_SMALL_NONE
                     : cfg->algorithm == NODE_ALGORITHM_DOUBLING ? ALLREDUCE_SMALL_MAX
                                                                 : 0;
    rc = allreduce_create(&ac, &n->ar);
    if (rc < 0)
        goto err;
    n->h_small = allreduce_register(n->ar, n->small, sizeof(n->small));
    mc.broker = cfg->broker;
    mc.cohort = cfg->cohort;
    mc.id = cfg->id;
    mc.address = n->address;
    mc.model_version = cfg->model_version;
    mc.heartbeat_ms = cfg->heartbeat_ms;
    mc.timeout_ms = cfg->timeout_ms;
    mc.key = cfg->key;
    mc.tls_ca_pem = cfg->tls_ca_pem;
    mc.tls_server_name = cfg->tls_server_name;
    mc.on_epoch = on_epoch;
    mc.arg = n;
    rc = member_create(&mc, &n->member);
    if (rc < 0)
        goto err;
    rc = heartbeat_create(n->member, member_ready, n, &n->beat);
    if (rc < 0)
        goto err;
    if (pthread_create(&n->thread, NULL, node_main, n) != 0) {
        rc = -EAGAIN;
        goto err;
    }
    *out = n;
    return 0;
err:
    heartbeat_destroy(n->beat);
    member_destroy(n->member);
    allreduce_destroy(n->ar);
    if (n->own_fd)
        close(n->data_fd);
    free(n->cohort);
    free(n->id);
    pthread_cond_destroy(&n->cond);
    pthread_mutex_destroy(&n->lock);
    free(n);
    return rc;
}

void node_stop(struct node *n)
{
    if (!n)
        return;
    pthread_mutex_lock(&n->lock);
    n->stop = true;
    changed_locked(n);
    pthread_mutex_unlock(&n->lock);
    heartbeat_stop(n->beat);
    /* Leaving publishes a new epoch to the others. Our own step in flight
     * is aborted with an empty epoch newer than any we adopted: nobody is
     * left to reduce with. */
    member_leave(n->member, LIMIT_LEAVE_TIMEOUT_MS);
    pthread_mutex_lock(&n->lock);
    {
        uint64_t past = n->latest ? n->latest->number : 0;
        struct epoch *none = NULL;
        if (epoch_create(n->cohort, past + 1, 0, NULL, 0, &none) == 0) {
            allreduce_set_epoch(n->ar, none);
            epoch_unref(none);
        }
    }
    pthread_mutex_unlock(&n->lock);
    pthread_join(n->thread, NULL);
    ckpt_writer_destroy(n->ckpt);   /* a checkpoint being written is finished */
    heartbeat_destroy(n->beat);
    member_destroy(n->member);
    reducers_free(n);
    layout_free(n->layout);
    layout_free(n->layout_next);
    allreduce_destroy(n->ar);
    if (n->own_fd)
        close(n->data_fd);
    epoch_unref(n->latest);
    epoch_unref(n->cur);
    free(n->buf_scratch);
    free(n->add_scratch);
    free(n->fuse_in);
    free(n->fuse_out);
    for (int i = 0; i < PARALLEL_MAX; i++)
        free(n->slots[i].buf);
    free(n->state_out);
    free(n->state_in);
    free(n->cohort);
    free(n->id);
    pthread_cond_destroy(&n->cond);
    pthread_mutex_destroy(&n->lock);
    free(n);
}

/* At registration, before the member joins: resume from the newest
 * valid checkpoint ahead of this node's version, and start the writer.
 * Loading in every member that starts costs each a read of the state, but
 * no member has to know whether the cohort has a live member: the
 * election takes the highest version, so a checkpoint older than the
 * cohort's state is only replaced by the leader's, and one ahead of it
 * (a cohort with no live member) leads. Lock held. */
static int open_checkpoints_locked(struct node *n)
{
    const struct node_config *c = &n->cfg;
    struct ckpt_layout l = { .cohort = n->cohort, .params_bytes = n->t.params_bytes,
                             .buffers_bytes = n->t.buffers_bytes };
    struct ckpt_loaded got;
    int rc;

    rc = ckpt_load(c->checkpoint_dir, &l, n->version, n->t.params, n->t.buffers, &got);
    if (got.n_skipped > 0) {
        n->ckpt_info.skipped_version = got.skipped[0].version;
        n->ckpt_info.skipped_reason = got.skipped[0].reason;
    }
    if (rc == 0) {
        log_info("node", "Resumed from a checkpoint.", LF_S("cohort", n->cohort), LF_S("id", n->id),
                 LF_S("dir", c->checkpoint_dir), LF_U("version", got.version),
                 LF_U("bytes", got.bytes), LF_U("skipped", got.n_skipped));
        n->version = got.version;
        lineage_reset(&n->lineage, got.version);
        n->has_state = true;
        free(n->state_in);
        n->state_in = got.state;
        n->state_in_len = got.state_len;
        n->state_in_version = got.version;
        n->has_new_state = true;
        n->ckpt_info.loaded_version = got.version;
        member_set_model_version(n->member, got.version, true);
    } else if (rc != -ENOENT) {
        log_error("node", "Could not read the checkpoints.", LF_S("cohort", n->cohort),
                  LF_S("id", n->id), LF_S("dir", c->checkpoint_dir), LF_ERR(rc));
        return rc;
    }
    rc = ckpt_writer_create(c->checkpoint_dir, &l, c->checkpoint_keep ? c->checkpoint_keep : 3,
                            &n->ckpt);
    if (rc < 0) {
        log_error("node", "Could not open the checkpoint directory.", LF_S("cohort", n->cohort),
                  LF_S("id", n->id), LF_S("dir", c->checkpoint_dir), LF_ERR(rc));
        return rc;
    }
    n->ckpt_last_version = ckpt_newest_version(c->checkpoint_dir);
    if (n->ckpt_last_version < n->version)
        n->ckpt_last_version = n->version;
    n->ckpt_last_ms = clock_now_ms();
    return 0;
}

int node_register(struct node *n, const struct node_tensors *t)
{
    size_t gbytes;
    int rc = 0;

    if (!t || !t->grads || !t->results || t->grad_count == 0 || !dtype_valid((int)t->grad_type) ||
        (t->params_bytes && !t->params) || (t->buffers_bytes && !t->buffers) ||
        ((uintptr_t)t->params | (uintptr_t)t->grads | (uintptr_t)t->results |
         (uintptr_t)t->buffers) % 8 != 0 ||
        t->params_bytes % 8 != 0 || t->buffers_bytes % 8 != 0)
        return -EINVAL;
    gbytes = t->grad_count * dtype_size(t->grad_type);
    pthread_mutex_lock(&n->lock);
    if (n->registered) {
        rc = -EBUSY;
        goto out;
    }
    n->buf_scratch = calloc(1, t->buffers_bytes + 8);
    n->add_scratch = malloc(ADD_CHUNK * sizeof(float));
    if (!n->buf_scratch || !n->add_scratch) {
        rc = -ENOMEM;
        goto out;
    }
    n->t = *t;
    memset(t->grads, 0, gbytes);
    n->h_grads = allreduce_register(n->ar, t->grads, gbytes + t->grads_spare);
    n->h_results = allreduce_register(n->ar, t->results, gbytes + t->results_spare);
    n->h_params = allreduce_register(n->ar, t->params, t->params_bytes);
    n->h_buffers = allreduce_register(n->ar, t->buffers, t->buffers_bytes);
    n->h_buf_scratch = allreduce_register(n->ar, n->buf_scratch, t->buffers_bytes);
    if (n->h_grads < 0 || n->h_results < 0 || n->h_params < 0 || n->h_buffers < 0 ||
        n->h_buf_scratch < 0) {
        rc = -ENOMEM;
        goto out;
    }
    if (gbytes <= FUSE_MAX && tally_digits(t->grad_type, 1) > 0) {
        size_t fbytes = gbytes + COUNTERS * TALLY_DIGITS_MAX * sizeof(uint64_t);

        n->fuse_in = malloc(fbytes);
        n->fuse_out = malloc(fbytes);
        if (!n->fuse_in || !n->fuse_out ||
            (n->h_fuse_in = allreduce_register(n->ar, n->fuse_in, fbytes)) < 0 ||
            (n->h_fuse_out = allreduce_register(n->ar, n->fuse_out, fbytes)) < 0) {
            rc = -ENOMEM;
            goto out;
        }
    }
    if (n->cfg.checkpoint_dir && (rc = open_checkpoints_locked(n)) < 0)
        goto out;
    n->registered = true;
    heartbeat_wake(n->beat);    /* it joins now */
    changed_locked(n);
out:
    pthread_mutex_unlock(&n->lock);
    return rc;
}

void node_view(struct node *n, struct node_view *v)
{
    pthread_mutex_lock(&n->lock);
    if (n->drop_grads) {
        memset(n->t.grads, 0, grad_bytes(n));
        n->drop_grads = false;
        publish_locked(n);
    }
    view_locked(n, v);
    pthread_mutex_unlock(&n->lock);
}

static void view_locked(const struct node *n, struct node_view *v)
{
    *v = n->stats;
    /* moolib's meaning: this member's parameters are the cohort's (it
     * leads, or received them). Not tied to the phase: during a sync the
     * trainer must still apply a committed result and, as leader, answer
     * wants_state, or the sync would wait on it forever. */
    v->connected = n->has_state;
    v->wants_state = n->leader && ((n->wants_state && !n->state_out_ready) ||
                                   (n->ckpt_wanted && !n->has_gradients));
    v->has_new_state = n->has_new_state;
    if (n->parallel == 1)
        v->wants_after_consume = n->phase == PH_RUN && !n->contributed;
    else
        v->wants_after_consume = n->phase == PH_RUN && outstanding_locked(n) < n->parallel;
    v->wants_gradients = v->wants_after_consume && !n->has_gradients;
    v->has_gradients = n->has_gradients;
    v->is_leader = n->leader && n->phase != PH_WAIT_EPOCH;
    v->model_version = n->version;
    v->epoch = n->cur ? n->cur->number : 0;
    v->rank = n->my_index >= 0 ? (uint32_t)n->my_index : 0;
    v->size = n->cur ? (uint32_t)n->cur->n_members : 0;
    v->drop_pending = n->drop_grads;
    snprintf(v->leader, sizeof(v->leader), "%s", n->leader_id);
}

/* Only a view that differs from the last one is published: each one
 * wakes a waiting trainer. */
static void publish_locked(struct node *n)
{
    struct node_view v;

    if (!n->cfg.on_view)
        return;
    memset(&v, 0, sizeof(v));   /* padding too: views are compared bytewise */
    view_locked(n, &v);
    if (n->published && memcmp(&v, &n->last_view, sizeof(v)) == 0)
        return;
    n->last_view = v;
    n->published = true;
    n->cfg.on_view(n->cfg.view_arg, &v);
}

/* Parallel gradients: the contribution goes to a free slot and the
 * trainer's gradients are zeroed for its next batch. The copy runs
 * unlocked (the slot is reserved; the trainer is the caller). */
static int contribute_to_slot(struct node *n, uint64_t batch_size)
{
    size_t bytes = grad_bytes(n);
    int s = -1, rc = 0;

    for (int i = 0; i < PARALLEL_MAX && s < 0; i++)
        if (!n->slots[i].busy)
            s = i;
    if (s < 0)
        return -EPERM;          /* cannot happen: outstanding < parallel <= PARALLEL_MAX */
    n->slots[s].busy = true;
    pthread_mutex_unlock(&n->lock);
    if (batch_size > 0) {
        if (!n->slots[s].buf)
            /* With room for the counters (spare_step). */
            n->slots[s].buf = aligned_alloc(64, (bytes + SPARE_NEED + 63) / 64 * 64);
        if (n->slots[s].buf) {
            memcpy(n->slots[s].buf, n->t.grads, bytes);
            memset(n->t.grads, 0, bytes);
        } else {
            rc = -ENOMEM;
        }
    }
    pthread_mutex_lock(&n->lock);
    if (rc < 0) {
        n->slots[s].busy = false;
        return rc;
    }
    n->slots[s].batch = batch_size;
    n->queue[(n->q_head + n->q_len) % PARALLEL_MAX] = s;
    n->q_len++;
    changed_locked(n);
    return 0;
}

/* A contribution arrived: the traced round before it is complete (its
 * result was consumed) and becomes a row. Lock held. */
static void trace_contributed_locked(struct node *n)
{
    struct node_trace *t = n->cfg.trace;
    uint64_t now = trace_ns();

    if (n->tr.published && n->tr.consumed) {
        n->tr.ns[NODE_STAGE_NEXT] = now - n->tr.consumed;
        if (t->rounds < t->cap)
            memcpy(t->ns[t->rounds++], n->tr.ns, sizeof(n->tr.ns));
        memset(n->tr.ns, 0, sizeof(n->tr.ns));
        n->tr.published = n->tr.consumed = 0;
    }
    n->tr.contributed = now;
}

int node_contribute(struct node *n, uint64_t batch_size)
{
    int rc = 0;

    pthread_mutex_lock(&n->lock);
    /* A state transfer under way has made the parameters invalid: the
     * gradients were computed on what is being replaced. */
    if (n->registered && !n->has_state && n->phase == PH_SYNC) {
        n->sync_refused = true;
        pthread_mutex_unlock(&n->lock);
        return -EAGAIN;
    }
    if (n->registered && n->parallel > 1) {
        /* A result may have committed since the trainer's last view said
         * wants_gradients; the slot does not touch it, so that is fine. */
        if (!n->has_state || outstanding_locked(n) >= n->parallel)
            rc = -EPERM;
        else
            rc = contribute_to_slot(n, batch_size);
        pthread_mutex_unlock(&n->lock);
        return rc;
    }
    /* A contribution made just as an epoch began is kept for after the
     * sync; one that would mix with gradients being dropped is not. */
    if (!n->registered)
        rc = -ENODEV;
    else if (n->drop_grads)
        rc = -EAGAIN;
    else if (!n->has_state || n->contributed || n->has_gradients)
        rc = -EPERM;
    if (rc == 0 && n->cfg.trace)
        trace_contributed_locked(n);
    if (rc == 0) {
        if (batch_size > 0) {
            n->acc_batch += batch_size;
            n->acc_grads++;
        } else {
            n->acc_skips++;
        }
        n->contributed = true;
        changed_locked(n);
    }
    pthread_mutex_unlock(&n->lock);
    return rc;
}

int node_consume(struct node *n, uint64_t round)
{
    int rc = 0;

    pthread_mutex_lock(&n->lock);
    if (!n->has_gradients) {
        rc = -EPERM;
    } else if (round != n->stats.rounds_committed) {
        rc = -ESTALE;
    } else {
        if (n->cfg.trace && n->tr.published) {
            n->tr.consumed = trace_ns();
            n->tr.ns[NODE_STAGE_APPLY] = n->tr.consumed - n->tr.published;
        }
        n->has_gradients = false;
        /* The node thread waits for a consume only to sync, or to reduce
         * a contribution it holds; in a plain round it has nothing to do. */
        if (n->phase != PH_RUN || holds_contribution_locked(n))
            changed_locked(n);
        else
            publish_locked(n);
    }
    pthread_mutex_unlock(&n->lock);
    return rc;
}

/* The checkpoint's copy is taken here, on the trainer's call, because
 * only now are the parameters known to be those of the model version: the
 * trainer applied the last result (no result is held) and waits for this
 * call to return before it changes them again. */
static void take_checkpoint(struct node *n, const void *state, size_t len)
{
    struct ckpt_parts p = { .params = n->t.params, .buffers = n->t.buffers,
                            .state = state, .state_len = len };
    int rc;

    pthread_mutex_lock(&n->lock);
    if (!n->leader || !n->ckpt_wanted || n->has_gradients || n->ckpt_copying) {
        pthread_mutex_unlock(&n->lock);
        return;
    }
    n->ckpt_wanted = false;
    n->ckpt_copying = true;
    p.version = n->version;
    pthread_mutex_unlock(&n->lock);

    rc = ckpt_writer_submit(n->ckpt, &p);

    pthread_mutex_lock(&n->lock);
    n->ckpt_copying = false;
    if (rc == 0) {
        n->ckpt_last_version = p.version;
        n->ckpt_last_ms = clock_now_ms();
    } else {
        log_warn("node", "A checkpoint could not be taken; the next commit tries again.",
                 LF_S("cohort", n->cohort), LF_S("id", n->id), LF_U("version", p.version),
                 LF_ERR(rc));
    }
    changed_locked(n);
    pthread_mutex_unlock(&n->lock);
}

int node_set_state(struct node *n, const void *state, size_t len)
{
    bool for_sync, for_ckpt;
    void *copy;
    int rc = 0;

    if (len > LIMIT_STATE_BYTES)
        return -E2BIG;
    copy = malloc(len ? len : 1);
    if (!copy)
        return -ENOMEM;
    memcpy(copy, state, len);
    pthread_mutex_lock(&n->lock);
    for_sync = n->leader && n->wants_state && !n->state_out_ready;
    for_ckpt = n->leader && n->ckpt_wanted && !n->has_gradients;
    if (for_sync) {
        free(n->state_out);
        n->state_out = copy;
        n->state_out_len = len;
        n->state_out_ready = true;
        changed_locked(n);
    } else {
        free(copy);
        rc = for_ckpt ? 0 : -EPERM;
    }
    pthread_mutex_unlock(&n->lock);
    if (for_ckpt)
        take_checkpoint(n, state, len);
    return rc;
}

void node_checkpoints(struct node *n, struct node_checkpoints *out)
{
    pthread_mutex_lock(&n->lock);
    report_checkpoints_locked(n);
    *out = n->ckpt_info;
    pthread_mutex_unlock(&n->lock);
}

int node_take_state(struct node *n, void **state, size_t *len)
{
    int rc = 0;

    pthread_mutex_lock(&n->lock);
    if (!n->has_new_state) {
        rc = -ENOENT;
    } else {
        *state = n->state_in;
        *len = n->state_in_len;
        n->state_in = NULL;
        n->has_new_state = false;
        publish_locked(n);
    }
    pthread_mutex_unlock(&n->lock);
    return rc;
}

int node_set_model_version(struct node *n, uint64_t version)
{
    pthread_mutex_lock(&n->lock);
    n->version = version;
    lineage_reset(&n->lineage, version);
    publish_locked(n);
    pthread_mutex_unlock(&n->lock);
    member_set_model_version(n->member, version, true);
    return 0;
}

int node_set_parallel_gradients(struct node *n, unsigned count)
{
    int rc = 0;

    if (count == 0 || count > PARALLEL_MAX)
        return -EINVAL;
    /* One copy of the gradients lives on the device: nothing to slot. */
    if (n->cfg.device && count > 1)
        return -EOPNOTSUPP;
    if (n->cfg.parallel_gradients && count != n->cfg.parallel_gradients) {
        log_warn("node", "Refused the trainer's parallel gradients: the cohort sets them.",
                 LF_S("cohort", n->cohort), LF_S("id", n->id), LF_U("asked", count),
                 LF_U("cohort_setting", n->cfg.parallel_gradients));
        return -EACCES;
    }
    pthread_mutex_lock(&n->lock);
    if (count != n->parallel && outstanding_locked(n) > 0)
        rc = -EBUSY;
    else
        n->parallel = count;
    publish_locked(n);
    pthread_mutex_unlock(&n->lock);
    return rc;
}

int node_set_virtual_batch_size(struct node *n, uint64_t size)
{
    if (size == 0)
        return -EINVAL;
    if (n->cfg.virtual_batch_size && size != n->cfg.virtual_batch_size) {
        log_warn("node", "Refused the trainer's virtual batch size: the cohort sets it.",
                 LF_S("cohort", n->cohort), LF_S("id", n->id), LF_U("asked", size),
                 LF_U("cohort_setting", n->cfg.virtual_batch_size));
        return -EACCES;
    }
    pthread_mutex_lock(&n->lock);
    n->vbs = size;
    pthread_mutex_unlock(&n->lock);
    return 0;
}

int node_set_compression(struct node *n, const struct compress *c)
{
    if (!c || !compress_valid(c))
        return -EINVAL;
    pthread_mutex_lock(&n->lock);
    n->compression = *c;
    pthread_mutex_unlock(&n->lock);
    return 0;
}

int node_set_tensor_shapes(struct node *n, const struct layout_shape *shapes, size_t k)
{
    struct layout *l;
    size_t count;
    int rc;

    pthread_mutex_lock(&n->lock);
    count = n->registered ? n->t.grad_count : 0;
    pthread_mutex_unlock(&n->lock);
    if (count == 0)
        return -EINVAL;
    if ((rc = layout_make(shapes, k, count, &l)) < 0)
        return rc;
    pthread_mutex_lock(&n->lock);
    layout_free(n->layout_next);
    n->layout_next = l;
    n->layout_next_set = true;
    pthread_mutex_unlock(&n->lock);
    return 0;
}

const char *node_address(const struct node *n)
{
    return n->address;
}

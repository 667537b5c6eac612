/* src/accumulator/node.h: one member of a cohort, everything but the trainer: its
 * membership (member.h), its reduction engine (allreduce.h), the rounds of
 * the Accumulator, and state transfer between members. The sidecar hosts
 * one node per trainer; a trainer may also embed one (connect to a broker
 * with no sidecar).
 *
 * Rounds. The trainer accumulates gradients into the registered gradient
 * buffer (a backward pass adds into .grad) and contributes its batch size,
 * or skips. Each contribution starts a count step: a small all-reduce of
 * every member's counters since the last commit (batch size, number of
 * contributions, number of skips). When the summed batch size reaches the
 * virtual batch size, a gradient step all-reduces the gradient buffers
 * and divides the sum by the number of contributions (moolib's rule: the
 * mean over reduce_gradients calls, not over samples). Small gradients,
 * and any gradients with spare bytes after them while each member
 * contributes once a round, take both steps in one all-reduce (node.c). Every member that
 * completes the gradient step commits: the result is in its gradient
 * buffer, has_gradients is true, and its model version is one higher.
 *
 * Epochs. A new epoch aborts any step in flight (the engine returns
 * -ESTALE); nothing is committed, and each survivor keeps its own
 * contribution, which the next epoch reduces again. At the start of every
 * epoch the members exchange model versions: the leader is the member with
 * the highest version (ties: the first in member order). A member whose
 * version differs from the leader's, or that never had state, fetches the
 * leader's state (parameters, buffers and the trainer's opaque state)
 * before anyone contributes again. A member behind the leader may hold
 * contributions for the round after its own version. They are in the
 * leader's state only if that round was committed in the epoch in which
 * this member last reduced them (it took part in the round's last step
 * and missed the result): then they are dropped (contributions_dropped).
 * Otherwise that round was reduced by others without them, and they are
 * kept and counted into the next round. The leader's state carries which
 * epoch committed each of its recent versions (lineage.h) to tell; where
 * that record does not reach (versions declared or loaded from a
 * checkpoint, or over LINEAGE_RUNS committing epochs back) or does not
 * know for sure (a round committed after a newer epoch reached the
 * engine), they are dropped, and logged: a gradient counted twice would
 * corrupt a result.
 * So a committed result is the reduction of one epoch's members'
 * contributions, each counted once, and every member applies the same
 * bytes.
 *
 * Top-k and PowerSGD (compress.h) keep this member's error between
 * rounds. It changes only at the commit (a round that fails after its
 * gradient step, in an epoch change before the commit, leaves it, and the
 * retry sends the same thing); it starts at zero on a joiner, leaves with
 * a member that leaves, and is zeroed when this member receives the
 * leader's state (it belonged to parameters it no longer holds). The
 * members vote on the method and its parameter (the ratio, the rank) in
 * the count step: any difference runs the round uncompressed, logged
 * once, rather than refusing, so a cohort that changes setting member by
 * member keeps training. PowerSGD views the whole float32 gradient buffer
 * of n elements as floor(sqrt(n)) rows of n / rows columns (the node
 * knows no tensor shapes); the elements left over reduce uncompressed.
 * See node.c, "Compression", and docs/architecture.md, "Top-k and
 * PowerSGD, with error feedback".
 *
 * Buffers (statistics that are not reduced, such as BatchNorm's) drift
 * between members; every buffer_sync_rounds commits the leader's are
 * broadcast with the gradient step and installed with the commit, while
 * the trainer waits for the result and is not running a forward pass.
 */
#ifndef COHORT_NODE_H
#define COHORT_NODE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/ident.h"
#include "accumulator/compress.h"
#include "engine/dtype.h"
#include "gpu/ncomm.h"

struct secret;
struct layout_shape;

struct node;

struct node_view;

/* The stages of a committed round, for a trace (node_config.trace): where
 * the time between two contributions goes. Nanoseconds on CLOCK_MONOTONIC.
 * The trainer's own share shows as APPLY and NEXT, measured from the
 * node's side: with a sidecar, APPLY is the trainer's wakeup, its zeroing
 * and its one-way consume reaching the sidecar; NEXT its loop and the
 * contribution's call. */
enum node_stage {
    NODE_STAGE_WAKE,            /* contribution taken to the node thread's step */
    NODE_STAGE_COUNT,           /* count steps (all-reduces of the counters) */
    NODE_STAGE_COPY_IN,         /* fused: gradients and counters into its buffer;
                                 * spare bytes: the counters into them */
    NODE_STAGE_ENGINE,          /* the gradient (or fused) all-reduce */
    NODE_STAGE_COPY_OUT,        /* fused: the sum into the results, divided */
    NODE_STAGE_COMMIT,          /* buffers' sync and commit, up to the publication */
    NODE_STAGE_APPLY,           /* the view's publication to the trainer's consume */
    NODE_STAGE_NEXT,            /* consume to the next contribution */
    NODE_STAGES
};

/* A trace's rows, one per committed round in order, kept when the next
 * contribution arrives (so the last round has none); rounds beyond `cap`
 * are not kept. Only rounds with one contribution outstanding (parallel
 * gradients 1) are traced. Written under the node's lock and on its
 * thread: read it after node_stop(). */
struct node_trace {
    uint64_t (*ns)[NODE_STAGES];    /* cap rows, the caller's */
    size_t cap;
    size_t rounds;                  /* rows filled */
};
/* The stage's name as the benchmark prints it ("wake", "count", ...):
 * static, never freed; "?" for a value out of range. */
const char *node_stage_name(enum node_stage s);

/* The engine's all-reduce algorithm (spec.reduction.algorithm). AUTO:
 * recursive doubling up to the engine's measured threshold (256 KiB on the
 * wire), the ring beyond; RING: the ring for every all-reduce; DOUBLING:
 * recursive doubling for every all-reduce up to ALLREDUCE_SMALL_MAX
 * (64 MiB on the wire: its scratch holds no more), the ring beyond. */
enum node_algorithm { NODE_ALGORITHM_AUTO, NODE_ALGORITHM_RING, NODE_ALGORITHM_DOUBLING };

#define NODE_PARALLEL_MAX 8

/* A reducer of gradients that live on a GPU (docs/gpu.md, "NCCL
 * reduction"): the sidecar's devred for a GPU registration. The node
 * calls it on its own thread. At every epoch's sync the members vote
 * whether each has one that can() run; when all do, the node calls
 * epoch() on each, and only if every member's communicator is then
 * ready does the epoch reduce on the devices: the count step stays on
 * the engine, and the gradient step is reduce(). Otherwise the epoch is
 * host-staged: host() lets any communicator go, and gather() copies the
 * device's gradients into the node's gradient buffer before each step
 * reads them. The node never runs a compression or the fused and spare
 * steps on the devices. The communicator is made before the epoch's state
 * transfer, which then moves the parameters and buffers with broadcast()
 * (the opaque state and the lineage, small, stay on the engine). */
struct node_device {
    bool (*can)(void *arg);
    /* The epoch's communicator among `members` (the epoch's order; self
     * among them), agreed over `ch`, the engine's keyed connections.
     * Returns 0 when it is ready here, or -errno (-ESTALE: `cancel` said a
     * newer epoch arrived); a channel error is the node's too (it sees it
     * and fails the sync). */
    int (*epoch)(void *arg, uint64_t epoch, const char *const *members, size_t n,
                 const char *self, const struct ncomm_channel *ch,
                 const struct ncomm_cancel *cancel);
    /* The gradient step on the devices: the gradients averaged over
     * `grads` contributions (zeros when grads is 0), the same bytes on
     * every member, kept aside until publish. `cancel` says a newer epoch
     * arrived. Returns 0, -ESTALE or -errno. */
    int (*reduce)(void *arg, uint64_t grads, const struct ncomm_cancel *cancel);
    int (*gather)(void *arg);
    void (*host)(void *arg);
    /* `bytes` of host memory at `buf` from the member of rank `root` to
     * every member, in pieces through the device; `receive`: this member
     * takes them into `buf`, else `buf` is left untouched. Returns 0,
     * -ESTALE or -errno. */
    int (*broadcast)(void *arg, void *buf, size_t bytes, int root, bool receive,
                     const struct ncomm_cancel *cancel);
    void *arg;
};

/* Where the node's thread is in a spin (node_config.on_spin). */
enum node_spin { NODE_SPIN_BEGIN, NODE_SPIN_POLL, NODE_SPIN_END };

struct node_config {
    const char *broker;         /* broker address */
    const char *cohort;
    const char *id;
    const char *host;           /* numeric address to listen on and advertise (127.0.0.1) */
    uint64_t model_version;     /* to join with */
    uint32_t heartbeat_ms;      /* 0: the cohort's */
    uint32_t timeout_ms;        /* 0: the cohort's */
    uint32_t reduce_timeout_ms; /* engine: silence tolerated from a peer; 0: 60 s */
    uint32_t buffer_sync_rounds;/* buffers follow the leader's every this many
                                 * commits; 0: 100 */
    const struct secret *key;   /* the cohort's key, copied, for the broker and the
                                 * data plane; NULL: neither is authenticated */
    bool integrity_mac;         /* authenticate every data-plane frame (needs key) */
    const char *tls_ca_pem;     /* TLS to the broker: CA certificates, PEM; NULL: plaintext */
    const char *tls_server_name;/* the name the broker's certificate carries; NULL: its host */
    /* Settings the cohort pins (a TrainingCohort's spec.accumulator): the
     * node starts with them, and a trainer's call that asks for another
     * value is refused with -EACCES; 0: the trainer's own call decides
     * (moolib's default, 1, until it makes one). */
    uint64_t virtual_batch_size;
    unsigned parallel_gradients;    /* 0, or 1 to NODE_PARALLEL_MAX */
    enum node_algorithm algorithm;  /* the engine's all-reduce algorithm */
    /* How gradient steps compress their payloads until the trainer asks
     * for another (node_set_compression; a TrainingCohort's
     * spec.reduction.compression through cohort-sidecar --compression).
     * A default, not a pin: see node.c, "Compression". Zero: none. */
    struct compress compression;
    /* Checkpoints (ckpt.h; a TrainingCohort's spec.checkpoint). With a
     * directory, the node loads the newest valid checkpoint there when the
     * trainer registers (if it is ahead of the version the node starts
     * with), and while it leads it writes one every checkpoint_every_versions
     * commits or checkpoint_every_s seconds (0: not by that measure; at
     * least one must be set), keeping checkpoint_keep (0: 3). NULL: none. */
    const char *checkpoint_dir;
    uint64_t checkpoint_every_versions;
    uint32_t checkpoint_every_s;
    unsigned checkpoint_keep;
    /* Called with the node's lock held whenever the view may have
     * changed, from any of its threads: copy it and return; never call
     * into the node. May be NULL. */
    void (*on_view)(void *arg, const struct node_view *v);
    void *view_arg;             /* borrowed; also on_spin's */
    /* Called from the node's thread while it spins for the trainer's next
     * move (node.c, NODE_SPIN_US), with the lock released: NODE_SPIN_BEGIN
     * once, NODE_SPIN_POLL on each turn, NODE_SPIN_END once as the spin
     * ends. It may call node_contribute() and node_consume() on `n`, and
     * nothing else of the node; a contribution ends the spin. The sidecar
     * serves its trainer's doorbell there (viewpage.h). May be NULL. */
    void (*on_spin)(void *arg, struct node *n, enum node_spin phase);
    /* Per-stage times of each round (see node_stage), borrowed until
     * node_stop(); NULL: none taken, and no clock is read for it. */
    struct node_trace *trace;
    /* Gradients on a GPU: borrowed until node_stop(); NULL: the
     * gradients are the host buffer's. Only with parallel gradients 1. */
    const struct node_device *device;
};

/* Tensors the trainer registers once. Memory is borrowed and must stay
 * mapped until node_stop(); with a sidecar it is shared memory that both
 * processes map. The gradient buffer holds `grad_count` elements of
 * `grad_type`; parameters and buffers are opaque bytes to the node (it
 * copies them whole in state transfer). */
struct node_tensors {
    void *params;
    size_t params_bytes;
    void *grads;                /* contributions accumulate here */
    size_t grad_count;
    enum dtype grad_type;
    void *results;              /* grad_count elements: committed results land here */
    void *buffers;
    size_t buffers_bytes;
    /* Bytes right after the gradients, and right after the results, that
     * belong to no other tensor: the node may write there. With room for
     * a round's counters in both (float32 or float64 gradients), a round
     * in which each member contributes once costs one all-reduce with no
     * copy wherever the counters add no exchange to it (node.c, "Counters
     * in the spare bytes"). 0: none. */
    size_t grads_spare, results_spare;
};

/* Starts the node's thread; it joins the cohort and follows its epochs
 * once tensors are registered.
 * Needs rpc_init(). Returns 0, -EINVAL, -ENOMEM, or a socket -errno. The
 * caller stops it with node_stop(). */
int node_start(const struct node_config *cfg, struct node **out);
/* Leaves the cohort and frees the node. NULL is fine. */
void node_stop(struct node *n);

/* Registers the tensors (once; -EBUSY after). The gradient buffer is
 * zeroed. With a checkpoint directory, the newest valid checkpoint above
 * the node's model version is loaded into the parameters and buffers, its
 * version becomes the node's and its opaque state is the trainer's to take
 * (has_new_state), before the member joins. Returns 0, -EINVAL
 * (alignment, sizes), -ENOMEM, -EIO (a checkpoint changed while it was
 * read: the parameters hold no valid model). */
int node_register(struct node *n, const struct node_tensors *t);

/* What the trainer sees; a snapshot taken under the node's lock. */
struct node_view {
    bool connected;             /* in an epoch, with state, not syncing */
    bool wants_state;           /* leader: a member needs state; call set_state */
    bool has_new_state;         /* state arrived: read it with node_take_state */
    bool wants_gradients;       /* a contribution (or skip) is expected */
    bool has_gradients;         /* a committed result is in the gradient buffer */
    bool is_leader;
    bool drop_pending;          /* node_view() has gradients to zero: call it */
    bool wants_after_consume;   /* wants_gradients once the held result is consumed */
    uint64_t model_version;
    uint64_t epoch;
    uint32_t rank, size;        /* position in the epoch's member order, members */
    char leader[IDENT_NAME_MAX + 1];
    /* Last committed round, and totals. */
    uint64_t batch_size, num_gradients, num_skipped;
    uint64_t rounds_committed, rounds_retried, epochs_seen, states_received;
    uint64_t contributions_dropped;  /* in a round the leader committed (or possibly:
                                      * node.h's top comment) */
};
void node_view(struct node *n, struct node_view *v);

/* Contributes the gradient buffer's contents with `batch_size` samples
 * (0 = skip). A contribution made as a new epoch begins is kept for after
 * its sync. With parallel gradients the contents are copied aside and the
 * buffer is zeroed. Returns 0, -EPERM (no state yet, a result is pending,
 * or as many contributions as allowed are), -EAGAIN (a state transfer is
 * replacing the parameters these gradients were computed on, or dropped
 * the buffer's contents: the next node_view zeroes it, compute again;
 * with one round in flight, kept contributions in that same buffer go
 * with it, counted in contributions_dropped), -ENODEV (nothing registered), -ENOMEM. */
int node_contribute(struct node *n, uint64_t batch_size);
/* The trainer has applied the result of round `round` (the view's
 * rounds_committed) and zeroed the gradient buffer itself: clears
 * has_gradients. -EPERM if no result is held; -ESTALE if the one held is
 * not that round's (a state transfer dropped it and a later one
 * committed), which changes nothing. */
int node_consume(struct node *n, uint64_t round);

/* Leader: the trainer's opaque state, copied, sent with the parameters
 * and buffers to every member waiting for it, and written with them into
 * a checkpoint when one is due (the view asks for the state then too; the
 * parameters are copied during this call, while the trainer waits, so
 * they are those of the view's model version). Returns 0, -EPERM (not
 * leader or not wanted), -E2BIG (over 1 GiB), -ENOMEM. */
int node_set_state(struct node *n, const void *state, size_t len);
/* Takes the received opaque state (the caller frees *state); clears
 * has_new_state. -ENOENT if none. */
int node_take_state(struct node *n, void **state, size_t *len);

/* moolib's knobs. A version set here is declared to the broker and counts
 * at the next election. */
int node_set_model_version(struct node *n, uint64_t version);
/* Returns 0, -EINVAL (0), or -EACCES when the config pins another size
 * (logged with both values); the pinned size is asked again harmlessly. */
int node_set_virtual_batch_size(struct node *n, uint64_t size);
/* Contributions in flight at once, 1 to NODE_PARALLEL_MAX (see node.c).
 * Returns 0, -EINVAL, -EACCES (the config pins another count, as for the
 * virtual batch size), or -EBUSY while contributions are outstanding:
 * change it between rounds. */
int node_set_parallel_gradients(struct node *n, unsigned count);

/* What this member asks its gradient steps to compress with (a codec,
 * top-k with its ratio, PowerSGD with its rank: compress.h; copied). A
 * step is compressed only when every member of its round asks for the
 * same method and parameter, and only for float32 gradients of more than
 * 256 KiB (see node.c, "Compression"). Returns 0 or -EINVAL (not
 * compress_valid). */
int node_set_compression(struct node *n, const struct compress *c);

/* The layout of the gradient buffer as tensors, for PowerSGD by tensor
 * shape (accumulator/layout.h; `shapes` borrowed for the call); k = 0
 * goes back to the whole-buffer view. Used from the next count step,
 * only when every member gives the same layout (see node.c,
 * "Compression"). Returns 0, -EINVAL (no tensors registered yet, or
 * layout_make's refusals: nothing changes), or -ENOMEM. */
int node_set_tensor_shapes(struct node *n, const struct layout_shape *shapes, size_t k);

/* What this node knows of checkpoints, for its member's reports. */
struct node_checkpoints {
    uint64_t loaded_version;    /* the checkpoint it resumed from (0: none) */
    uint64_t written_version;   /* the newest it wrote (0: none) */
    uint64_t written, failed;   /* writes */
    uint64_t last_bytes, last_us;
    uint64_t total_bytes, total_us; /* every write, fsync and rename included */
    uint64_t skipped_version;   /* the newest checkpoint it found invalid (0: none) */
    unsigned skipped_reason;    /* enum ckpt_reason */
};
void node_checkpoints(struct node *n, struct node_checkpoints *out);

/* The data-plane address this node advertises. */
const char *node_address(const struct node *n);

#endif

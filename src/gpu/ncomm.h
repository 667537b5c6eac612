/* src/gpu/ncomm.h: one NCCL communicator per epoch, as a state machine.
 *
 * Every NCCL call goes through a table of operations (struct ncomm_ops):
 * nccllib.c fills it from the real library, the unit tests with a fake
 * that records each call and can make any of them fail or stay in
 * progress, so which call happens when is tested without a GPU.
 *
 * An epoch's communicator is made in three steps, each member alike:
 *   1. ncomm_agree: the members agree, over an authenticated channel, on
 *      shrink or rebuild, and on a rebuild the epoch's first member (in
 *      member order) makes the unique id and the others receive it;
 *   2. ncomm_start: shrink the previous communicator (where the library
 *      has ncclCommShrink and only members left), or abort it and create
 *      the new one with ncclCommInitRankConfig, non-blocking;
 *   3. ncomm_wait: poll ncclCommGetAsyncError until ready, failed, the
 *      deadline or a newer epoch; any but ready aborts it.
 * ncomm_setup runs the three as every member does, and rebuilds in the
 * same epoch when a shrink fails on any member.
 * Collectives (ncomm_all_reduce, ncomm_broadcast) run on a ready
 * communicator and are waited for by polling, so that an epoch change
 * (ncomm_cancel) or a deadline ends one in flight within a bounded time:
 * where the library can shrink, an epoch change keeps the communicator
 * with the collective in flight for the next epoch's NCCL_SHRINK_ABORT.
 * Otherwise an epoch change during a collective calls ncomm_abort, which is
 * bounded: an ncclCommAbort that does not return by the deadline is left
 * to finish on a thread of its own with the communicator it owns, counted
 * in ncomm_leaked(), and the machine is empty and usable at once.
 *
 * Not thread-safe: one thread drives a machine, the one that also polls
 * the collectives in flight and so is the one to see an epoch change.
 */
#ifndef COHORT_NCOMM_H
#define COHORT_NCOMM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define NCOMM_ID_BYTES 128      /* NCCL_UNIQUE_ID_BYTES */
#define NCOMM_ID_WORDS (NCOMM_ID_BYTES / 8)
/* Words of the id exchange: the count of members that gave an id, then the id. */
#define NCOMM_XCHG_WORDS (1 + NCOMM_ID_WORDS)
#define NCOMM_MEMBERS_MAX 4096  /* a longer member list is refused */
/* Sums ncomm_setup takes at most: the vote, a shrink's two checks, the
 * id, and whether every rank's start went through. */
#define NCOMM_SETUP_SUMS 5
/* How long an abort inside ncomm_start, ncomm_wait and ncomm_destroy may
 * take before it is left to its thread (ncomm_leaked). */
#define NCOMM_ABORT_MS 10000

struct ncomm_id {
    uint8_t b[NCOMM_ID_BYTES];
};

/* The element types a collective reduces (NCCL's ncclFloat32, ...). */
enum ncomm_type { NCOMM_F32, NCOMM_F64, NCOMM_F16, NCOMM_BF16 };

/* NCCL's calls, with NCCL's results already mapped: 0, -EINPROGRESS
 * (ncclInProgress) or another -errno. `arg` is ncomm_ops.arg. */
struct ncomm_ops {
    int (*get_unique_id)(void *arg, struct ncomm_id *id);
    /* ncclCommInitRankConfig with blocking = 0; sets *comm on 0 and on
     * -EINPROGRESS. */
    int (*init_rank)(void *arg, void **comm, int nranks, const struct ncomm_id *id, int rank);
    /* ncclCommGetAsyncError: 0 ready, -EINPROGRESS, or the error. */
    int (*async_error)(void *arg, void *comm);
    /* ncclCommAbort: frees the communicator, cancelling what is in flight. */
    int (*abort)(void *arg, void *comm);
    /* ncclCommShrink, or NULL where the library predates it (2.27). With
     * `cancel`, NCCL_SHRINK_ABORT: the parent's work in flight is
     * cancelled first. Sets *newcomm on 0 and on -EINPROGRESS. */
    int (*shrink)(void *arg, void *comm, const int *exclude, int nexclude, void **newcomm,
                  bool cancel);
    /* ncclAllReduce of `count` elements from `send` to `recv` (device
     * addresses, which may be equal), each multiplied by `scale` before
     * the sum (ncclPreMulSum; 1.0: ncclSum), queued on `stream`. */
    int (*all_reduce)(void *arg, void *comm, uint64_t send, uint64_t recv, size_t count,
                      enum ncomm_type type, double scale, void *stream);
    /* ncclBroadcast of `bytes` from rank `root`'s `send` to every rank's
     * `recv`, queued on `stream`. */
    int (*broadcast)(void *arg, void *comm, uint64_t send, uint64_t recv, size_t bytes,
                     int root, void *stream);
    /* The driver's cuStreamQuery: 0 when everything queued on `stream`
     * has finished, -EINPROGRESS, or the error. */
    int (*stream_query)(void *arg, void *stream);
    void *arg;
};

/* The authenticated channel the agreement travels on: an in-place SUM
 * all-reduce of `n` 64-bit words among the epoch's members (the engine's
 * keyed connections). Returns 0 or -errno. */
struct ncomm_channel {
    int (*sum_u64)(void *arg, uint64_t *words, size_t n);
    void *arg;
};

enum ncomm_state {
    NCOMM_NONE,         /* no communicator */
    NCOMM_STARTING,     /* created or shrunk, not yet ready */
    NCOMM_READY,
};

/* What makes a wait for a communicator, or a collective in flight,
 * give up: stale(arg) is polled
 * between NCCL's polls and returns true once a newer epoch has arrived. */
struct ncomm_cancel {
    bool (*stale)(void *arg);
    void *arg;
};

struct ncomm_plan {
    bool shrink;                /* shrink the previous communicator */
    struct ncomm_id id;         /* otherwise: the new one's unique id */
};

struct ncomm;

/* `ops` is borrowed and must outlive the machine and any abort it leaves
 * running (ncomm_leaked). Returns 0 and sets *out (caller frees with
 * ncomm_destroy), -ENOMEM. */
int ncomm_create(const struct ncomm_ops *ops, struct ncomm **out);
/* Aborts any communicator (bounded, as ncomm_abort), then frees. NULL is fine. */
void ncomm_destroy(struct ncomm *c);

/* This member's vote for epoch `members` (n ids, borrowed, in member
 * order; `self` among them): true when its communicator is ready, the
 * library can shrink, and the new members are some of the old ones in
 * the same order, one or more fewer. */
bool ncomm_can_shrink(const struct ncomm *c, const char *const *members, size_t n);

/* Step 1. Sums every member's vote over `ch`; when all voted to shrink,
 * plan->shrink. Otherwise a second sum carries the unique id: the first
 * member in `members` makes it (ops->get_unique_id) and contributes it,
 * the others contribute zeros, and a result whose giver count is not
 * exactly 1 is refused. Returns 0, -EINVAL (self not a member, bad
 * count), -EPROTO (a sum no honest set of members gives), or the
 * channel's or NCCL's error. Nothing of the machine changes. */
int ncomm_agree(struct ncomm *c, const char *const *members, size_t n, const char *self,
                const struct ncomm_channel *ch, struct ncomm_plan *plan);

/* Step 2: moves to `epoch` as `plan` says. A shrink that fails leaves
 * nothing: ncomm_setup then rebuilds with every member.
 * Returns 0 (state STARTING or READY), -EINVAL, or NCCL's error with the
 * machine left in NCOMM_NONE. `members` and `self` are copied. */
int ncomm_start(struct ncomm *c, uint64_t epoch, const char *const *members, size_t n,
                const char *self, const struct ncomm_plan *plan);

/* Step 3: polls until the communicator is ready, deadline_ms passes or
 * `cancel` (may be NULL) says a newer epoch arrived. Returns 0 (READY),
 * -ETIMEDOUT, -ESTALE or NCCL's error, after which the communicator has
 * been aborted and the state is NONE. */
int ncomm_wait(struct ncomm *c, uint32_t deadline_ms, const struct ncomm_cancel *cancel);

/* Steps 1 to 3 for one epoch, as every member runs them: agree; on a
 * shrink, start it, then one sum over `ch` says whether every member
 * started one, and after the wait another whether every child is ready;
 * if any is not, every member aborts what it has and rebuilds (the id's
 * sum, start), in the same epoch. After a rebuild's start one more sum
 * says whether every rank started, and only then does each wait (a rank
 * that could not start never joins). *shrunk says which. At most
 * NCOMM_SETUP_SUMS sums, the same number on every member. Returns 0
 * (READY), -ECONNABORTED when another member's start failed, or as
 * ncomm_agree and ncomm_wait; on failure the state is NONE, or, for
 * -ESTALE, whatever a newer epoch's setup will undo. */
int ncomm_setup(struct ncomm *c, uint64_t epoch, const char *const *members, size_t n,
                const char *self, const struct ncomm_channel *ch, uint32_t deadline_ms,
                const struct ncomm_cancel *cancel, bool *shrunk);

/* An all-reduce on the ready communicator (ops->all_reduce), waited for
 * until it has finished on `stream`: polls ncclCommGetAsyncError and the
 * stream. The deadline or NCCL's error aborts the communicator (bounded,
 * as ncomm_abort): what was in flight is cancelled, `recv` holds no
 * result, and the state is NONE. A newer epoch (cancel, may be NULL)
 * does the same where the library has no ncclCommShrink; where it has,
 * the communicator stays READY with the collective in flight, for the
 * next epoch to shrink with NCCL_SHRINK_ABORT or abort.
 * Returns 0, -ENOTCONN (not ready), -EINVAL, -ESTALE (cancelled),
 * -ETIMEDOUT, -ELIBACC (the table lacks the calls), or NCCL's error. */
int ncomm_all_reduce(struct ncomm *c, uint64_t send, uint64_t recv, size_t count,
                     enum ncomm_type type, double scale, void *stream, uint32_t deadline_ms,
                     const struct ncomm_cancel *cancel);

/* A broadcast of `bytes` from rank `root` in pieces of at most `chunk`
 * bytes, each waited for as ncomm_all_reduce waits, so a newer epoch is
 * seen between pieces and within one; the deadline is each piece's.
 * Returns as ncomm_all_reduce; on a failure the receivers' `recv` holds
 * part of the bytes. */
int ncomm_broadcast(struct ncomm *c, uint64_t send, uint64_t recv, size_t bytes, int root,
                    size_t chunk, void *stream, uint32_t deadline_ms,
                    const struct ncomm_cancel *cancel);

/* A positive scale (an all-reduce's 1/contributions) as the bits of
 * NCCL's 16-bit type `type` (NCOMM_F16: IEEE half; NCOMM_BF16), rounded
 * to nearest even, for ncclRedOpCreatePreMulSum's scalar. Below half's
 * normal range it gives half's subnormals, then zero. */
uint16_t ncomm_scalar16(enum ncomm_type type, double v);

/* Marks a collective in flight (true) or done (false): a shrink during
 * one cancels it (NCCL_SHRINK_ABORT). */
void ncomm_set_busy(struct ncomm *c, bool busy);

/* Aborts the communicator, if any, waiting at most deadline_ms for
 * ncclCommAbort. Returns 0, or -ETIMEDOUT when it was left running
 * (counted by ncomm_leaked). Either way the state is NONE afterwards. */
int ncomm_abort(struct ncomm *c, uint32_t deadline_ms);

enum ncomm_state ncomm_state(const struct ncomm *c);
uint64_t ncomm_epoch(const struct ncomm *c);       /* of the communicator, if any */
int ncomm_rank(const struct ncomm *c);             /* -1 without a communicator */
void *ncomm_handle(const struct ncomm *c);         /* the ncclComm_t, borrowed */
unsigned ncomm_leaked(const struct ncomm *c);      /* aborts that overran */
#endif

/* include/cohort.h: cohort's API for trainer processes: moolib's
 * Accumulator in C.
 *
 * A trainer describes its parameters and buffers once; cohort lays them
 * out, with one gradient per parameter element, in shared memory that the
 * sidecar maps too, so tensor bytes never cross a socket. The trainer
 * computes in place in that memory (cohort_params, cohort_grads,
 * cohort_results, cohort_buffers) and drives the loop below; every call
 * returns at once.
 *
 *   struct cohort *c;
 *   cohort_create(&cfg, &c);             // parameters: cohort_params(c)
 *   cohort_connect(c, NULL);             // $COHORT_SOCKET, or $COHORT_BROKER
 *   for (;;) {
 *       cohort_update(c);
 *       if (!cohort_connected(c)) { sleep a little; continue; }
 *       if (cohort_wants_state(c))   cohort_set_state(c, bytes, len);
 *       if (cohort_has_new_state(c)) cohort_state(c, &bytes, &len);
 *       if (cohort_has_gradients(c)) { apply cohort_results(c); cohort_zero_gradients(c); }
 *       else if (cohort_wants_gradients(c)) {
 *           if (have data) { add gradients into cohort_grads(c); cohort_reduce_gradients(c, batch); }
 *           else cohort_skip_gradients(c);
 *       }
 *   }
 *
 * Semantics, where moolib's documentation and cohort differ or are silent:
 * - Gradients and results live apart, so a round moves no gradient byte
 *   in memory: the engine reads cohort_grads() and writes the reduced
 *   gradients into cohort_results(), which hold them while has_gradients
 *   is true (moolib puts them back into each parameter's .grad instead; a
 *   binding that wants that points .grad at the results meanwhile).
 * - Gradients accumulate in cohort_grads() until a round commits: add each
 *   new backward pass into it (as .grad += does) and call reduce_gradients
 *   with its batch size; cohort does not zero it between contributions.
 * - A round commits when the batch sizes contributed by all members since
 *   the last commit reach the virtual batch size (a lower bound; overshoot
 *   is possible). The result is the sum of every contribution divided by
 *   the number of reduce_gradients calls in it (not by the number of
 *   samples): pass a per-batch mean loss. If every member skipped, the
 *   result is zero.
 * - model_version counts committed rounds: it is one higher as soon as
 *   has_gradients becomes true, on every member alike.
 * - The leader is the member with the highest model version (ties: the
 *   first in the cohort's member order). A member whose version differs
 *   from the leader's, or that never had state, receives the leader's
 *   parameters, buffers and opaque state before it contributes again; the
 *   leader is asked for the opaque state (wants_state) only then.
 * - A membership change does not throw pending work away: an interrupted
 *   round is reduced again in the next epoch with the survivors'
 *   contributions. Nothing committed is lost or counted twice.
 * - Misuse is an error return, never an abort: reduce or skip while a
 *   contribution or a result is pending is -EPERM; zero_gradients with no
 *   result is -EPERM; a sidecar that is gone is -ENOTCONN.
 * - A contribution that races the start of a new epoch is kept for after
 *   it. A member behind the leader receives its state (has_new_state
 *   becomes true) and keeps its pending contributions, counted into the
 *   next round, unless the round after its own version is one the leader
 *   committed with them in it (this member took part in its last step in
 *   that epoch and missed the result): then they are dropped, not counted
 *   twice, and the next update() zeroes the gradients. When the leader's
 *   record of which epoch committed its versions does not reach that
 *   round (its version was declared or loaded from a checkpoint, or more
 *   than 32 committing epochs passed) or is unsure of it (the round was
 *   committed just as a newer epoch began), they are dropped too, and logged:
 *   counting twice would corrupt a committed result. Every drop is in
 *   contributions_dropped. A reduce made while the state is being
 *   transferred returns -EAGAIN: the next update() zeroes the gradients
 *   (with them any kept contributions, counted as dropped): compute
 *   again.
 *
 * All functions return 0 or a negative errno unless they answer a
 * question. A struct cohort is used from one thread at a time.
 */
#ifndef COHORT_H
#define COHORT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Everything declared here is the trainer library's public API; cohort's
 * own modules are compiled with hidden visibility, and libcohort.a makes
 * every other name local. */
#if defined(__GNUC__)
#pragma GCC visibility push(default)
#endif

#define COHORT_API_VERSION 1

/* Element types of parameters (gradients have the parameters' type). */
enum cohort_dtype {
    COHORT_F32 = 0,
    COHORT_F64 = 1,
    COHORT_F16 = 2,
    COHORT_BF16 = 3,
};

struct cohort_tensor {
    const char *name;           /* for messages; may be NULL */
    enum cohort_dtype dtype;    /* all parameters share one dtype */
    size_t numel;
};

struct cohort_config {
    const char *name;                       /* accumulator name, like moolib's */
    const struct cohort_tensor *parameters; /* copied */
    size_t n_parameters;
    const struct cohort_tensor *buffers;    /* not reduced; synced from the leader */
    size_t n_buffers;
};

struct cohort;

/* Lays out parameters, gradients and buffers in new shared memory, all
 * zero. Returns 0, -EINVAL (no parameters, mixed dtypes, sizes), -ENOMEM.
 * The caller frees with cohort_destroy(). */
int cohort_create(const struct cohort_config *cfg, struct cohort **out);
/* Disconnects (the member leaves its cohort) and unmaps. NULL is fine. */
void cohort_destroy(struct cohort *c);

/* Where each tensor lives: valid until cohort_destroy(). Index i follows
 * the order of cfg->parameters / cfg->buffers; NULL if out of range. */
void *cohort_param(struct cohort *c, size_t i);
void *cohort_grad(struct cohort *c, size_t i);
void *cohort_result(struct cohort *c, size_t i);
void *cohort_buffer(struct cohort *c, size_t i);
/* All parameters (all gradients, all results) as one flat array, in
 * order. Results are valid while cohort_has_gradients() is true. */
void *cohort_params(struct cohort *c);
void *cohort_grads(struct cohort *c);
void *cohort_results(struct cohort *c);
size_t cohort_numel(const struct cohort *c);

/* GPU tensors (docs/gpu.md). Before cohort_connect: the gradient buffer,
 * and the parameters and buffers with it (cohort_gpu_param below),
 * move to the GPU whose UUID is `device_uuid` (nvidia-smi -L's
 * "GPU-..." form, never an index: CUDA_VISIBLE_DEVICES numbers devices
 * differently in each container), in memory allocated with the driver's
 * virtual-memory API and handed to the sidecar as a file descriptor;
 * results land in place, in the same device memory, while
 * cohort_has_gradients() is true. The sidecar reduces it host-staged
 * (device to host, the TCP engine, host to device). cohort_reduce_gradients
 * waits for this process's queued work on the device (cuCtxSynchronize)
 * before the sidecar reads the gradients, and cohort_zero_gradients zeroes
 * them on the device; between cohort calls the trainer writes them on
 * any stream. cohort_grads() and cohort_results() are then the sidecar's
 * host staging, not the trainer's. Only through a sidecar ("unix:"); an
 * in-process node is refused at connect (-EOPNOTSUPP). The device memory
 * is the cohort's, freed by cohort_destroy. With a GPU,
 * cohort_reduce_gradients may also fail with the driver's error (-EIO)
 * or, rarely, -EBUSY (the sidecar could not read its node's view: call it
 * again). Returns 0,
 * -EINVAL (not a UUID), -EALREADY (connected, or called twice),
 * -EOPNOTSUPP (no GPU support in this build), -ELIBACC (no CUDA driver),
 * -ENXIO (no such device), -ENOMEM, -EIO. */
int cohort_use_gpu(struct cohort *c, const char *device_uuid);
/* The gradients' device address (a CUdeviceptr) after cohort_use_gpu:
 * cohort_numel() elements of the parameters' dtype, results in place;
 * 0 without. */
uint64_t cohort_gpu_grads(const struct cohort *c);
/* Parameter i's and buffer i's device addresses after cohort_use_gpu (0
 * without, or for an index out of range): the region holds them too,
 * zeroed, and they are then the trainer's model, which it writes before
 * connecting. cohort_params() and cohort_buffer() become their host
 * copies, which state transfer moves: cohort_set_state copies the
 * device's values there first (after this process's queued work on the
 * device, so it may fail with -EIO), and cohort_update copies a state
 * that arrived onto the device, visible to every stream, before the view
 * says cohort_has_new_state() (a failed copy there returns -EIO and is
 * tried again at the next call). */
uint64_t cohort_gpu_param(const struct cohort *c, size_t i);
uint64_t cohort_gpu_buffer(const struct cohort *c, size_t i);

/* Connects to a sidecar ("unix:/path/to/socket") or to a broker
 * ("host:port": the node then runs inside this process, with no sidecar).
 * NULL means $COHORT_SOCKET, else $COHORT_BROKER (with $COHORT_COHORT and
 * $COHORT_ID naming the cohort and this member, $COHORT_SECRET_FILE,
 * when set, holding the cohort's key: see docs/security.md, and
 * $COHORT_BROKER_CA, when set, a PEM file of the CA that signed the
 * broker's TLS certificate, with $COHORT_BROKER_SERVER_NAME the name it
 * carries if not the broker's host, and $COHORT_INTEGRITY the frame
 * integrity: "none" (the default) or "mac", every data-plane frame
 * authenticated with the key, as the sidecar's --integrity mac; every
 * member must agree). Returns 0, -EINVAL (also: a key file
 * that is not 64 hex digits, a CA file with no PEM in it, a
 * $COHORT_INTEGRITY other than none or mac, or mac without a key), -EFBIG (a CA
 * file over 256 KiB), -ECONNREFUSED/-ENOENT (no sidecar there, or no key
 * or CA file), -EPROTO (a sidecar of another API version), -EALREADY. */
int cohort_connect(struct cohort *c, const char *address);
/* Joining a broker directly: the cohort and member id to use. */
int cohort_set_identity(struct cohort *c, const char *cohort_name, const char *member_id);

/* Refreshes what the questions below answer. Call once per loop. Returns
 * 0, or -ENOTCONN when the sidecar is gone. */
int cohort_update(struct cohort *c);

/* Sleeps until the answers below may have changed since the last
 * cohort_update() (a result committed, state is wanted, the epoch moved),
 * or timeout_ms passes; call cohort_update() then. Returns 0, -ETIMEDOUT,
 * or -ENOTCONN (not connected, or the sidecar is gone). Not in moolib: for
 * a trainer with nothing to do meanwhile, waiting here instead of polling
 * leaves the cores to the reduction and wakes within microseconds. */
int cohort_wait(struct cohort *c, int timeout_ms);

bool cohort_connected(const struct cohort *c);
bool cohort_wants_state(const struct cohort *c);
bool cohort_has_new_state(const struct cohort *c);
bool cohort_wants_gradients(const struct cohort *c);
bool cohort_has_gradients(const struct cohort *c);
bool cohort_is_leader(const struct cohort *c);
/* The leader's member id, or "" when none is known; valid until the next
 * cohort_update(). */
const char *cohort_get_leader(const struct cohort *c);
uint64_t cohort_model_version(const struct cohort *c);
/* This member's position in the current epoch's member order, and the
 * number of members: for sharding data. Both change with membership. */
uint32_t cohort_rank(const struct cohort *c);
uint32_t cohort_size(const struct cohort *c);

/* Leader, when wants_state: the opaque state (model-independent bytes such
 * as optimizer state and counters) to send with the parameters. Copied. */
int cohort_set_state(struct cohort *c, const void *state, size_t len);
/* When has_new_state: the received opaque state; *state stays valid until
 * the next cohort_state() or cohort_destroy(). Clears has_new_state. */
int cohort_state(struct cohort *c, const void **state, size_t *len);

int cohort_reduce_gradients(struct cohort *c, uint64_t batch_size);
int cohort_skip_gradients(struct cohort *c);
/* After applying a result: zeroes the gradients, clears has_gradients.
 * It does not wait for the sidecar: the trainer zeroes its own gradients
 * and tells the sidecar in a message that needs no answer, so the next
 * batch starts at once. -EPERM if the last update() showed no result. */
int cohort_zero_gradients(struct cohort *c);

/* Declares a model version (after loading a checkpoint): it counts at the
 * next election. */
int cohort_set_model_version(struct cohort *c, uint64_t version);
/* Returns 0, -EINVAL (0), or -EACCES when the cohort pins another size
 * (a sidecar started with --virtual-batch-size, which the operator passes
 * from a TrainingCohort's spec.accumulator.virtualBatchSize): the cohort's
 * size stays in force; asking for the pinned size succeeds. */
int cohort_set_virtual_batch_size(struct cohort *c, uint64_t size);
/* Contributions in flight at once, 1 (the default) to 8. With n > 1 each
 * reduce_gradients copies the gradients aside and zeroes them, and
 * wants_gradients stays true until n are outstanding, so the trainer
 * computes its next batch while earlier rounds reduce; results still come
 * one at a time, in order, the same on every member, and may be up to n
 * versions old. A round that needs more samples than one contribution per
 * member sums the next queued ones. Returns 0, -EINVAL, or -EBUSY while
 * contributions are outstanding (change it between rounds), or -EACCES
 * when the cohort pins another count (--parallel-gradients,
 * spec.accumulator.parallelGradients), as for the virtual batch size. */
int cohort_set_parallel_gradients(struct cohort *c, unsigned n);

/* How gradient steps travel between members (the engine's codecs: see
 * docs/architecture.md, "Compression"). Members accumulate in float32
 * and every member gets the same bytes; only what crosses the network is
 * encoded. Values are fixed: they travel in the trainer link. */
enum cohort_compression {
    COHORT_COMPRESSION_NONE = 0,    /* float32 as it is (the default) */
    COHORT_COMPRESSION_FP16 = 1,    /* IEEE half precision, nearest even: half the bytes,
                                     * relative error 2^-11 per encoding */
    COHORT_COMPRESSION_BF16 = 2,    /* bfloat16: half the bytes, float32's range,
                                     * relative error 2^-8 per encoding */
    COHORT_COMPRESSION_INT8 = 3,    /* 8 bits per value and a float32 scale per block
                                     * of 256: about a quarter of the bytes, error at
                                     * most half of max|block| / 127 per encoding */
    COHORT_COMPRESSION_TOPK = 4,    /* each member sends the share `ratio` of its
                                     * entries of largest magnitude (index, value);
                                     * what it did not send waits in its residual
                                     * (error feedback) */
    COHORT_COMPRESSION_POWERSGD = 5,/* the gradient buffer as a matrix, or each of its
                                     * tensors (cohort_set_tensor_shapes), reduced as a
                                     * rank-`rank` product, with error feedback */
    COHORT_COMPRESSION_MEANSTD16 = 6,/* hivemind's ScaledFloat16Compression: each run
                                     * as float16 of (x - mean) / deviation, with the
                                     * two as float32; error at most 2^-11 |x - mean|
                                     * per encoding. The averager's only (struct
                                     * cohort_averager_config); the Accumulator's
                                     * rounds refuse it */
    COHORT_COMPRESSION_UNIFORM8 = 7,/* hivemind's Uniform8BitQuantization: each run as
                                     * one byte per value, its bin of width 6 sigma /
                                     * 256 around the mean, and a codebook of the
                                     * bins' means (1 KiB per run); the averager's
                                     * only, as MEANSTD16 */
    COHORT_COMPRESSION_QUANTILE8 = 8,/* hivemind's Quantile8BitQuantization: each run
                                     * as one byte per value, its bucket among 256 cut
                                     * at the run's quantiles, and a codebook of the
                                     * buckets' means (1 KiB per run); the averager's
                                     * only, as MEANSTD16 */
};

/* Compresses this member's gradient steps with `codec` from the next
 * round on. A round is compressed only when every member of it asks for
 * the same codec; when they differ it runs uncompressed (always correct)
 * and each member logs it once, so a cohort changes codec by changing
 * every member. Applies to float32 parameters whose gradients exceed
 * 256 KiB; smaller ones reduce in one exact step with the round's
 * counters, and other dtypes are not compressed. A partial sum is
 * encoded at each hop, so with n members a result carries up to n
 * encodings' error; the result is itself a value of the codec. A sidecar
 * may set a default (--compression, from a TrainingCohort's
 * spec.reduction.compression); this call replaces it for this member.
 * Returns 0, -EINVAL (unknown codec), -ENOTCONN, or -EPROTO from a
 * sidecar that predates compression. */
int cohort_set_compression(struct cohort *c, enum cohort_compression codec);

/* cohort_set_compression with the method's parameter: for TOPK the ratio
 * of entries each member sends, in (0, 1], kept to six decimals (rounded
 * to the nearest millionth, at least one); for POWERSGD the rank, a whole
 * number from 1 to 1024; 0: the default (0.01; 4), which is what
 * cohort_set_compression asks for; the codecs take 0 only. Members
 * compress only when they agree on the method and the parameter;
 * otherwise the round runs uncompressed and each logs it once. Top-k and
 * PowerSGD keep this member's error (what it has not sent yet) and add
 * it to its next round: it changes only when a round commits, starts at
 * zero on a member that joins or receives the leader's state, and is
 * lost with a member that leaves. PowerSGD reduces each matrix of the
 * layout cohort_set_tensor_shapes gave; without one it views the whole
 * gradient buffer (every parameter, in order) as floor(sqrt(n)) rows of
 * n / rows columns, and the elements left over are reduced uncompressed. See
 * docs/architecture.md, "Top-k and PowerSGD, with error feedback".
 * Returns 0, -EINVAL (unknown method, parameter out of range), -ENOTCONN,
 * or -EPROTO / -EINVAL from a sidecar that predates it. */
int cohort_set_compression_with(struct cohort *c, enum cohort_compression method, double param);

/* One tensor of the gradient buffer, for PowerSGD by tensor shape. */
struct cohort_tensor_shape {
    size_t offset;      /* its first element in the gradient buffer: parameter i's is
                         * the sum of the numels of the parameters before it */
    size_t count;       /* its elements */
    size_t rows, cols;  /* its 2-D view, rows x cols == count: a tensor's shape[0] x
                         * the rest; with rows or cols of 1 (a bias) it is reduced
                         * uncompressed */
};

/* At most this many tensors. */
#define COHORT_TENSOR_SHAPES_MAX 65536

/* Tells the cohort how the gradient buffer is made of tensors, so that
 * PowerSGD (COHORT_COMPRESSION_POWERSGD) reduces each matrix on its own
 * at the agreed rank, as the PowerSGD paper and mlbench's
 * PowerAggregation do, instead of viewing the whole buffer as one
 * matrix; tensors with one row or one column, and elements no tensor
 * names, are reduced uncompressed. One round is still two all-reduces
 * (every P together, every Q with the uncompressed elements). `shapes`
 * is borrowed for the call, in any order; n = 0 goes back to the
 * whole-buffer view. Used from the next round, and only when every
 * member gives the same matrices (offsets and shapes): when they differ
 * the rounds run uncompressed and each member logs it once. Changing it
 * starts the error and the warm start from zero. Returns 0; -EINVAL
 * (more than COHORT_TENSOR_SHAPES_MAX, a count of 0 or not rows x cols,
 * a tensor beyond the gradients, two that overlap: nothing changes);
 * -ENOTCONN; -ENOMEM. (A sidecar that predates it speaks an older trainer
 * link, which cohort_connect refuses with -EPROTO.) */
int cohort_set_tensor_shapes(struct cohort *c, const struct cohort_tensor_shape *shapes, size_t n);

struct cohort_gradient_stats {
    uint64_t batch_size;        /* of the last committed round */
    uint64_t num_gradients;     /* reduce_gradients calls in it, all members */
    uint64_t num_skipped;       /* skip_gradients calls in it */
    uint64_t rounds_committed;  /* since connect */
    uint64_t rounds_retried;    /* interrupted by a membership change */
    uint64_t epochs_seen;
    uint64_t states_received;
    uint64_t contributions_dropped;  /* in a round the leader committed before
                                      * this member caught up, or possibly so
                                      * (see the top of this file) */
    uint64_t epoch;             /* current */
};
int cohort_get_gradient_stats(const struct cohort *c, struct cohort_gradient_stats *out);

/* A whole sentence for an error code returned by this API. */
const char *cohort_strerror(int err);

/* ---- Collectives: a group ------------------------------------------------
 *
 * A group is this process as a member of a cohort, for collectives the
 * trainer calls itself (mlbench's Aggregation, torch.distributed's
 * all_reduce) rather than the Accumulator's rounds. Every member calls
 * the same collectives in the same order. A call interrupted by a
 * membership change is retried on the new membership from a copy of its
 * input: it returns 0 only with the whole result, bytewise the same on
 * every member of the epoch that completed it, and on an error the
 * caller's buffer is untouched. A member in the middle of a call that the
 * others completed gets their result; one that joins late lines up with
 * the others' calls. docs/architecture.md, "Collectives and mlbench's
 * Aggregation", says why. A group is used from one thread at a time. */

enum cohort_group_dtype {
    COHORT_GROUP_F32 = 0,
    COHORT_GROUP_F64 = 1,
    COHORT_GROUP_F16 = 2,
    COHORT_GROUP_BF16 = 3,
    COHORT_GROUP_I32 = 4,
    COHORT_GROUP_I64 = 5,
};

enum cohort_group_op {
    COHORT_GROUP_SUM = 0,
    COHORT_GROUP_AVG = 1,       /* sum / members of the epoch that completes the call */
    COHORT_GROUP_MIN = 2,
    COHORT_GROUP_MAX = 3,
    COHORT_GROUP_AVG_BY = 4,    /* sum / the caller's denominator (mlbench's custom_avg) */
};

/* Divide each member's input before the sum (mlbench's divide_before):
 * AVG and AVG_BY, float32 and float64 only. */
#define COHORT_GROUP_DIVIDE_BEFORE 1u

struct cohort_group;

/* Joins the cohort as a member of a group. `broker` is "host:port"; NULL
 * means $COHORT_BROKER. `cohort` and `id` NULL mean $COHORT_COHORT and
 * $COHORT_ID; the listen address is $COHORT_HOST (127.0.0.1), the key
 * $COHORT_SECRET_FILE, TLS to the broker $COHORT_BROKER_CA and
 * $COHORT_BROKER_SERVER_NAME, and the frame integrity $COHORT_INTEGRITY,
 * as for cohort_connect(). Does not wait for
 * an epoch (cohort_group_wait). Returns 0, -EINVAL (a missing or invalid
 * address, cohort or id, a bad $COHORT_INTEGRITY or mac without a key),
 * -ENOMEM, or the key's, CA's or socket's
 * -errno. The caller frees *out with cohort_group_destroy(). */
int cohort_group_create(const char *broker, const char *cohort, const char *id,
                        struct cohort_group **out);
/* Leaves the cohort and frees the group. NULL is fine. */
void cohort_group_destroy(struct cohort_group *g);

/* Waits until the cohort's latest epoch lists this member. 0 or -ETIMEDOUT. */
int cohort_group_wait(struct cohort_group *g, int timeout_ms);

/* This member's rank and the number of members, in the latest epoch.
 * Returns 0 or -ENOTCONN (not a member of it). */
int cohort_group_position(struct cohort_group *g, uint32_t *rank, uint32_t *size);

/* The id of the member at `rank` in the latest epoch, into id (len bytes;
 * 254 hold any). Returns 0, -ENOTCONN, -ERANGE. */
int cohort_group_member_id(struct cohort_group *g, uint32_t rank, char *id, size_t len);

/* All-reduces `count` elements at buf (borrowed for the call) in place.
 * `denominator` is read by COHORT_GROUP_AVG_BY only; flags are 0 or
 * COHORT_GROUP_DIVIDE_BEFORE; timeout_ms bounds the call's waits, retries
 * included (0: 300 s). Returns 0, or with buf untouched: -EINVAL (bad
 * type, op, flags, or a zero denominator), -E2BIG (over 1 GiB), -EPROTO
 * (the members' calls differ: count, type or op), -EACCES (keys
 * differ), -ETIMEDOUT, -ENOMEM. */
int cohort_group_allreduce(struct cohort_group *g, void *buf, size_t count,
                           enum cohort_group_dtype dtype, enum cohort_group_op op,
                           double denominator, unsigned flags, int timeout_ms);

/* Gathers `bytes` at `in` from every member of the epoch that completes
 * the call. On 0, *out (owned by the group, valid until its next call)
 * holds one record per member in member order, each
 * COHORT_GROUP_ID_BYTES of the member's id, NUL-padded, then its bytes
 * padded with zeros to a multiple of 8; *out_len is the whole length.
 * Same errors as cohort_group_allreduce. */
#define COHORT_GROUP_ID_BYTES 256u
int cohort_group_allgather(struct cohort_group *g, const void *in, size_t bytes,
                           const void **out, size_t *out_len, int timeout_ms);

struct cohort_group_stats {
    uint64_t calls;             /* completed */
    uint64_t retries;           /* attempts retried after a failure */
    uint64_t delivered;         /* calls whose result came from the others */
    uint64_t lined_up;          /* times this member took the others' numbering */
    uint64_t epochs;            /* epochs its calls ran in */
    uint64_t epoch;             /* the epoch that completed the last call */
    uint32_t members;           /* its members */
};
void cohort_group_stats(struct cohort_group *g, struct cohort_group_stats *out);

/* Top-k sparsification with error feedback (mlbench's
 * SparsifiedAggregation) as the group's collective. A reducer of n
 * float32 values sends, per call, the k = ceil(ratio x n) entries of
 * largest magnitude of its input plus its residual (what it did not send
 * before), and every member gets the same dense sum or mean of what the
 * members sent. The residual changes only when a call completes; a member
 * that joins starts with a zero one, and a member that leaves takes its
 * own with it. Every member creates its reducers alike and calls them in
 * the same order, interleaved with its other collectives as it likes.
 * Returns 0, -EINVAL (g NULL, n of 0 or over 2^32 - 1, a ratio outside
 * (0, 1]), -ENOMEM. The caller frees *out with
 * cohort_group_topk_destroy(), before the group. */
struct cohort_group_topk;
int cohort_group_topk_create(struct cohort_group *g, size_t n, double ratio,
                             struct cohort_group_topk **out);
/* By layer: a reducer of n_segments segments laid one after the other
 * (a model's layers; n = the sum of sizes, copied), sending per call each
 * segment's own k_s = ceil(ratio x sizes[s]) entries, all in one call:
 * mlbench's top-k of each layer, which a member joining between two
 * layers cannot cut in two. One residual spans the segments. Returns 0,
 * -EINVAL (as above, or no segment, a segment of size 0), -ENOMEM; the
 * members' segments must be alike (else their calls fail with -EPROTO). */
int cohort_group_topk_create_segments(struct cohort_group *g, const size_t *sizes,
                                      size_t n_segments, double ratio,
                                      struct cohort_group_topk **out);
void cohort_group_topk_destroy(struct cohort_group_topk *t);   /* NULL is fine */
/* k, as computed from the ratio (the sum over the segments), and n. */
size_t cohort_group_topk_k(const struct cohort_group_topk *t);
size_t cohort_group_topk_n(const struct cohort_group_topk *t);
/* One call: replaces buf (n floats, borrowed for the call) with the sum
 * (COHORT_GROUP_SUM) or mean over the members (COHORT_GROUP_AVG) of what
 * they sent. Returns 0; or, with buf and the residual untouched, -EINVAL
 * (another op), -EPROTO (the members' n, k or segments differ: their
 * models do), or cohort_group_allreduce's errors. */
int cohort_group_topk_reduce(struct cohort_group_topk *t, float *buf, enum cohort_group_op op,
                             int timeout_ms);
/* The residual: n floats, owned by the reducer, valid until its next call. */
const float *cohort_group_topk_residual(const struct cohort_group_topk *t);

/* PowerSGD with error feedback (mlbench's PowerAggregation) as the
 * group's collective: each of n_mats float32 matrices is reduced as a
 * product of rank min(rank, rows, cols), all of them and `vectors` floats
 * sent uncompressed (biases) in one call of two small all-reduces. The
 * buffer holds the matrices row-major one after the other, then the
 * vectors. Every member gets the same bytes: each matrix's rank-r
 * approximation of the members' sum or mean of their matrices plus their
 * errors (what their earlier shares left out), and the vectors' exact sum
 * or mean. `seed` picks the first Q and must be the same on every member;
 * with reuse_query each call starts from the cohort's last Q (warm
 * start), without it from the seeded one. The error and the warm start
 * change only when a call completes; a member that joins starts with a
 * zero error, and one that leaves takes its own with it. mats is copied.
 * Returns 0, -EINVAL (g NULL, nothing to reduce, a rank of 0 or over
 * 1024, a zero dimension, over 1 GiB), -ENOMEM, -ENOSPC (the group's
 * buffers are all registered). The caller frees *out with
 * cohort_group_powersgd_destroy(), before the group. */
struct cohort_group_matrix {
    size_t rows, cols;
};
struct cohort_group_powersgd;
int cohort_group_powersgd_create(struct cohort_group *g, const struct cohort_group_matrix *mats,
                                 size_t n_mats, size_t vectors, size_t rank, uint64_t seed,
                                 bool reuse_query, struct cohort_group_powersgd **out);
void cohort_group_powersgd_destroy(struct cohort_group_powersgd *p);    /* NULL is fine */
/* The floats a call takes: every matrix, then the vectors. */
size_t cohort_group_powersgd_size(const struct cohort_group_powersgd *p);
/* One call: replaces buf (cohort_group_powersgd_size floats, borrowed for
 * the call) with the result. op: COHORT_GROUP_SUM or COHORT_GROUP_AVG.
 * Returns 0; or, with buf, the error and the warm start untouched,
 * -EINVAL (another op), -EPROTO (the members' shapes, ranks or ops
 * differ), or cohort_group_allreduce's errors. */
int cohort_group_powersgd_reduce(struct cohort_group_powersgd *p, float *buf,
                                 enum cohort_group_op op, int timeout_ms);
/* This member's error, cohort_group_powersgd_size floats, owned by the
 * reducer, valid until its next call. */
const float *cohort_group_powersgd_error(const struct cohort_group_powersgd *p);

/* A whole sentence for an error code returned by a cohort_group call. */
const char *cohort_group_strerror(int err);

/* ---- hivemind's DecentralizedAverager (src/averager/) -------------------
 *
 * An averager is a member of a cohort that, at each step, asks the broker
 * for a group of averagers with the same prefix and group bits and
 * averages a float32 vector among it, weighted, with every member of the
 * group ending with the same bytes; it gathers each member's small bytes
 * too. A peer that stalls past the timeout is excluded and the step
 * completes with the rest; the result names exactly who was averaged.
 * With compression only the averaged values travel encoded (weights and
 * gathered bytes stay exact), and only averagers of one compression
 * group. docs/architecture.md, "hivemind's DecentralizedAverager", says
 * how. An averager is used from one thread at a time.
 *
 * Through the sidecar. In a Kubernetes cohort the trainer holds no key;
 * the pod's cohort-sidecar does. An averager created with broker NULL in
 * an environment with $COHORT_SOCKET and without $COHORT_SECRET_FILE, or
 * with broker "unix:PATH", lives in the sidecar at that socket: it joins
 * the cohort with the sidecar's key under an id the sidecar gives it
 * ("<sidecar id>_av<N>", cohort_averager_id; cfg->id is not used), and
 * every call below reaches it there and behaves as in process. The
 * averaged vector, the gathered bytes and states travel in shared memory,
 * not through the socket. It leaves when cohort_averager_destroy closes
 * the link, or the trainer dies. A sidecar that goes away fails the call
 * in flight at once (-ENOTCONN, "The sidecar went away.") and every call
 * after it. A sidecar hosts at most 8 averagers (-EBUSY beyond).
 *
 * Frame integrity. In process, $COHORT_INTEGRITY=mac (it needs the key)
 * authenticates every data-plane frame of the averager's rounds, as the
 * sidecar's --integrity mac does for the averagers it hosts; "none" or
 * unset, the default, does not. Averagers group only with those of the
 * same setting: the broker refuses the one that asks beside the others
 * (-EPROTO, with a sentence naming both). Through a sidecar the variable
 * is not read: the sidecar's --integrity decides, as its key does. */

struct cohort_averager;
struct cohort_averager_result;

/* One range of an averager's codec plan (cohort_averager_config). */
struct cohort_codec_range {
    size_t count;                           /* values, > 0 */
    enum cohort_compression compression;    /* one of the codecs compression takes */
};
#define COHORT_CODEC_PLAN_MAX 256

struct cohort_averager_config {
    const char *broker;             /* "host:port"; NULL: $COHORT_BROKER, or the
                                     * sidecar (above); "unix:PATH": the sidecar at
                                     * PATH */
    const char *cohort;             /* NULL: $COHORT_COHORT */
    const char *id;                 /* NULL: $COHORT_ID; through a sidecar, unused */
    const char *prefix;             /* matchmaking prefix: 1 to 128 of [A-Za-z0-9._:/-] */
    const char *initial_bits;       /* group bits, up to 64 of 0 and 1; NULL: "" */
    uint32_t target_group_size;     /* 1..256 */
    uint32_t min_group_size;        /* 1..target_group_size */
    uint32_t min_matchmaking_ms;    /* wait this long for others before a group forms */
    uint32_t request_timeout_ms;    /* patience for the broker's answer past that; 0: 5 s */
    uint32_t allreduce_timeout_ms;  /* silence tolerated from a peer; 0: 30 s */
    size_t count;                   /* float32 elements averaged; 0: an auxiliary
                                     * averager without tensors, which steps with
                                     * weight 0 (data unused), joins groups of any
                                     * schema and averages what its group does */
    size_t max_count;               /* without tensors: the most elements it takes
                                     * from a group; 0: 2^26 */
    size_t segment_bytes;           /* pipelining unit, a multiple of 8; 0: default */
    const void *schema;             /* up to 47 bytes naming what is averaged
                                     * (copied): only equal schemas group */
    size_t schema_len;
    size_t gather_max;              /* bytes a step may gather; 0: 4096; at most 65536 */
    uint32_t leave_timeout_ms;      /* the Leave at destroy; 0: the default */
    enum cohort_compression compression;   /* how the averaged values travel: NONE
                                     * (exact), FP16, BF16, INT8, MEANSTD16, UNIFORM8
                                     * or QUANTILE8 (float32 sums, weights and
                                     * gathered bytes exact); only averagers of one
                                     * compression group */
    /* A codec per tensor, as hivemind's adaptive compression chooses one:
     * codec_plan_len ranges (at most COHORT_CODEC_PLAN_MAX), in order,
     * covering the count values exactly, each travelling in its
     * compression; compression stays NONE. Copied. The NONE ranges are
     * averaged exactly, each other codec's in a call of its own, all in
     * one step that succeeds or changes nothing. Only averagers of the
     * same plan group; with a plan the schema is at most 39 bytes. An
     * averager without tensors joins such a group too: it learns the plan
     * in the step's first call, checked against the plan's digest in the
     * schema. NULL/0: compression for every value. */
    const struct cohort_codec_range *codec_plan;
    size_t codec_plan_len;
    /* Load balancing (hivemind's bandwidth and client_mode). In a group
     * where any member gives a bandwidth or is a client, each member
     * reduces a share of the round by a butterfly all-reduce, the shares
     * those of hivemind's load-balancing program for the bandwidths (not
     * given: the mean of those given); otherwise
     * every member reduces an equal share. With compression each
     * contribution travels encoded and each share's result is encoded once
     * by its reducer, which decodes it as every member does. */
    bool has_bandwidth;             /* false: bandwidth not given */
    double bandwidth;               /* finite, 0 to 1e15; 0: reduce nothing */
    bool client_mode;               /* contribute but reduce nothing, and accept no
                                     * connection (every one is dialled out) */
    size_t min_vector_size;         /* a member whose share is worth fewer elements
                                     * reduces nothing (hivemind's); a group agrees
                                     * on it as on the schema */
    /* State sharing (cohort_averager_load_state). */
    bool allow_state_sharing;       /* a donor from the start */
    double state_sharing_priority;  /* finite; the highest donors are asked first */
    int declare_state_period_ms;    /* re-declare this often; 0: 30 s; at most 30 min */
    size_t max_state_bytes;         /* the largest state served or loaded; 0: 1 GiB */
};

/* Joins the cohort as an averager; the key, the listen address, TLS to
 * the broker and the frame integrity come from the environment as for
 * cohort_group_create(). Returns 0, -EINVAL (a missing or invalid field,
 * a $COHORT_INTEGRITY other than none or mac, or mac without a key),
 * -ENOMEM, or the key's, CA's or socket's -errno. The caller frees *out
 * with cohort_averager_destroy(). */
int cohort_averager_create(const struct cohort_averager_config *cfg,
                           struct cohort_averager **out);
/* cohort_averager_create, and on failure a sentence in why[why_len],
 * NUL-terminated and borrowed from the caller: through a sidecar the
 * sidecar's (why it refused: a vector or state larger than it hosts, its
 * cap of averagers, a bad field), in process why the environment
 * ($COHORT_INTEGRITY) or the codec plan was refused; "" where there is
 * none (where the -errno says it). why may be NULL. */
int cohort_averager_create_why(const struct cohort_averager_config *cfg,
                               struct cohort_averager **out, char *why, size_t why_len);
/* Leaves the cohort and frees. NULL is fine. */
void cohort_averager_destroy(struct cohort_averager *a);
/* Waits until the averager has joined the cohort. 0 or -ETIMEDOUT. */
int cohort_averager_wait(struct cohort_averager *a, int timeout_ms);

struct cohort_averager_step {
    float *data;                    /* count floats, averaged in place (borrowed) */
    double weight;                  /* >= 0; 0: auxiliary (helps, contributes nothing) */
    double alpha;                   /* (0, 1]: data moves this far toward the average */
    const void *gather;             /* borrowed for the call */
    size_t gather_len;
    int timeout_ms;                 /* the whole step; 0: 30 s */
    bool allow_retries;             /* after a failed attempt, find a new group */
    uint64_t scheduled_ms;          /* hivemind's scheduled_time, in ms since the Unix
                                     * epoch: a group that formed earlier waits until
                                     * then (within timeout_ms) before averaging;
                                     * 0: at once */
};

/* One round. On 0 *out holds the result (the caller frees it with
 * cohort_averager_result_free) and data the average. Otherwise data is
 * untouched and: -EINVAL (a bad weight, alpha or gather), -ETIMEDOUT (no
 * group completed the round in time: too few averagers, or stalls),
 * -EPROTO (the broker refused the request as disagreeing with the others
 * waiting: group sizes, schema or compression; or the group's members
 * disagree), -ENODATA (every member was auxiliary), -EACCES (keys
 * differ), -ENOMEM. cohort_averager_error() says more. */
int cohort_averager_step(struct cohort_averager *a, const struct cohort_averager_step *s,
                         struct cohort_averager_result **out);
/* The last failure as a sentence, owned by the averager. */
const char *cohort_averager_error(const struct cohort_averager *a);
/* This averager's member id, owned by it: the configured one, or the one
 * its sidecar gave it. */
const char *cohort_averager_id(const struct cohort_averager *a);
/* The group bits, owned by the averager (valid until its next step). */
const char *cohort_averager_bits(const struct cohort_averager *a);
/* Sets the group bits (copied). 0 or -EINVAL. */
int cohort_averager_set_bits(struct cohort_averager *a, const char *bits);

/* A result: the members of the group in its order, each with its weight
 * (0: auxiliary, not averaged) and its gathered bytes. Everything is owned
 * by the result. */
size_t cohort_averager_result_size(const struct cohort_averager_result *r);
const char *cohort_averager_result_id(const struct cohort_averager_result *r, size_t i);
double cohort_averager_result_weight(const struct cohort_averager_result *r, size_t i);
const void *cohort_averager_result_gathered(const struct cohort_averager_result *r, size_t i,
                                            size_t *len);
uint64_t cohort_averager_result_group(const struct cohort_averager_result *r);
uint32_t cohort_averager_result_attempts(const struct cohort_averager_result *r);
/* Milliseconds from the successful attempt's request to the broker until
 * its group formed. */
uint32_t cohort_averager_result_matchmaking_ms(const struct cohort_averager_result *r);
void cohort_averager_result_free(struct cohort_averager_result *r);     /* NULL is fine */

/* State sharing (hivemind's load_state_from_peers). A state is opaque
 * bytes of the trainer's making. While an averager shares, the broker
 * lists it as a donor of its prefix with its priority; a newcomer
 * downloads from the donors of the highest priority, in parallel parts
 * when several are equal, every part checked against a manifest the
 * donors MAC with the cohort's key, so it never gets a mix of two states.
 * The averager asks its trainer for a snapshot when a download begins:
 * some thread of the trainer loops on cohort_averager_state_wanted and
 * answers with cohort_averager_provide_state (which it may also call at
 * any time). These calls may run on other threads than the step's. */

/* Turns sharing on or off with a priority (finite). 0 or -EINVAL. */
int cohort_averager_set_state_sharing(struct cohort_averager *a, bool allow, double priority);
void cohort_averager_state_sharing(struct cohort_averager *a, bool *allow, double *priority);
/* Waits at most timeout_ms for a downloader to need a snapshot; true then. */
bool cohort_averager_state_wanted(struct cohort_averager *a, int timeout_ms);
/* Serves len bytes at blob (copied) from now on. 0, -EFBIG (over
 * max_state_bytes) or -ENOMEM. */
int cohort_averager_provide_state(struct cohort_averager *a, const void *blob, size_t len);
/* Downloads a state within timeout_ms. On 0 *blob holds *len bytes, which
 * the caller frees with cohort_averager_state_free. Otherwise -ENODATA (no
 * donor, or none served a whole state), -ETIMEDOUT, -ENOTCONN (not
 * joined yet), or the broker call's -errno; cohort_averager_load_error()
 * says which donors failed how. */
int cohort_averager_load_state(struct cohort_averager *a, int timeout_ms, void **blob,
                               size_t *len);
void cohort_averager_state_free(void *blob);        /* NULL is fine */
/* The last load's failure as a sentence, owned by the averager. */
const char *cohort_averager_load_error(const struct cohort_averager *a);
/* Parts of its state this averager has served to others. */
uint64_t cohort_averager_state_parts_served(struct cohort_averager *a);

#if defined(__GNUC__)
#pragma GCC visibility pop
#endif

#ifdef __cplusplus
}
#endif
#endif

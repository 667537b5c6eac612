/* src/accumulator/devred.h: the node's device reducer (node.h, struct
 * node_device) for one GPU session: the epoch's NCCL communicator
 * (gpu/ncomm.h) and the gradient step on the device, with the
 * host-staged path as its fallback (docs/gpu.md, "NCCL reduction").
 *
 * It knows the device only through addresses and two calls (struct
 * devred_mem): the sidecar gives it gpusess's, the unit tests host memory
 * and the fake NCCL of tests/unit/fake_nccl.h, which really sums.
 *
 * Per epoch: can() votes yes when the table has NCCL's collectives and
 * the last DEVRED_TRIES_MAX setups did not all fail (a cluster without
 * NCCL connectivity stops trying, and says so once); epoch() makes the
 * communicator (ncomm_setup over the node's channel: a shrink of the
 * previous one where members only left and NCCL has ncclCommShrink, a
 * rebuild otherwise or when the shrink fails), waiting at most
 * DEVRED_READY_MS; host() aborts it. The gradient step
 * reduces the trainer's gradients into a scratch area of the device, the
 * mean over the round's contributions (ncclPreMulSum by 1/contributions),
 * never in place: an epoch change aborts it part way, and the
 * contribution must still be whole for the next epoch. The committed
 * result goes from the scratch to the trainer's results when its view is
 * published (devred_take_result).
 *
 * The state transfer of an epoch on the devices moves the parameters and
 * buffers (host memory: the trainer copies them to and from its device)
 * through the same scratch, a piece of at most its size at a time: the
 * leader copies a piece in, ncclBroadcast carries it to every member's
 * scratch, and each member that needs the state copies it out. A failure
 * counts as a failed setup, as above.
 */
#ifndef COHORT_DEVRED_H
#define COHORT_DEVRED_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "accumulator/node.h"
#include "gpu/ncomm.h"

/* How long an epoch's communicator may take to become ready, and a
 * gradient step on the device to finish. */
#define DEVRED_READY_MS 20000
#define DEVRED_REDUCE_MS 60000
/* Setups in a row that failed before this member stops voting for NCCL. */
#define DEVRED_TRIES_MAX 3

struct devred_mem {
    uint64_t grads;             /* the trainer's gradients, a device address */
    uint64_t scratch;           /* room for one result, the same size */
    size_t count;               /* elements */
    enum ncomm_type type;
    void *stream;               /* the stream collectives are queued on */
    /* The device's gradients into the node's gradient buffer (host-staged). */
    int (*gather)(void *arg);
    /* Makes the device current on the calling thread (NCCL's calls need it). */
    int (*enter)(void *arg);
    /* Zeroes the scratch, done when it returns (a round of skips only). */
    int (*zero_scratch)(void *arg);
    /* Host memory into the scratch's first `len` bytes and back, done
     * when they return: the state transfer's pieces (devred_device's
     * broadcast). */
    int (*to_scratch)(void *arg, const void *src, size_t len);
    int (*from_scratch)(void *arg, void *dst, size_t len);
    size_t scratch_bytes;
    void *arg;
};

struct devred;

/* `ops` (NCCL's table; NULL: none loadable, so never on the device) and
 * `mem` are borrowed and must outlive the reducer. Returns 0 and sets
 * *out (caller frees with devred_destroy after the node has stopped),
 * -EINVAL or -ENOMEM. */
int devred_create(const struct ncomm_ops *ops, const struct devred_mem *mem,
                  struct devred **out);
void devred_destroy(struct devred *d);     /* NULL is fine */

/* The node's view of it; d is borrowed by the node. */
struct node_device devred_device(struct devred *d);

/* True once per round reduced on the device: the result to publish is in
 * the scratch, not in the node's results. Cleared by the next step's
 * start. Safe from any thread. */
bool devred_take_result(struct devred *d);

/* Collectives that overran their abort deadline (ncomm_leaked), epochs
 * reduced on the device so far, and how many of them got their
 * communicator by shrinking the previous one. */
unsigned devred_leaked(const struct devred *d);
uint64_t devred_epochs(const struct devred *d);
uint64_t devred_shrinks(const struct devred *d);
#endif

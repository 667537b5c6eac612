/* src/accumulator/gpusess.h: the sidecar's half of a GPU registration
 * (TL_MEM_CUDA_VMM), the host-staged path (docs/gpu.md, "Host-staged
 * reduction").
 *
 * The trainer's gradients and results live in one device region it
 * allocated with cuMemCreate and exported as a file descriptor; the
 * descriptor came with REGISTER (SCM_RIGHTS), beside the memfd of the
 * host path. The sidecar finds the device by UUID, imports and maps the
 * region, and moves bytes between it and the memfd's gradient and result
 * areas, which the node reduces exactly as on the host path:
 *
 *   CONTRIBUTE   device gradients -> memfd gradients (gpusess_gather),
 *                then the node's round as always;
 *   commit       memfd results -> device results (gpusess_scatter),
 *                before the view that says has_gradients is published.
 *
 * Ordering across the two processes is by the trainer link itself, not by
 * interprocess events (which need the legacy CUDA IPC path and a shared
 * PID namespace): the trainer synchronises the stream that wrote its
 * gradients before it sends CONTRIBUTE, and gpusess_scatter returns only
 * once its copies are done on the device, before has_gradients is
 * published; the trainer's next work is queued after it reads that view.
 */
#ifndef COHORT_GPUSESS_H
#define COHORT_GPUSESS_H

#include <stdbool.h>

struct tlink_register;
struct gpusess;
struct devred_mem;

/* The device half of a TL_MEM_CUDA_VMM layout, against its own size:
 * device_bytes nonzero, the gradients and the results (grad_count
 * elements of grad_dtype each) 64-byte aligned inside it without
 * wrapping, and either the same area (results replace the gradients, as
 * moolib's do) or apart. Returns 0 or -EINVAL. Pure (tests, fuzz). */
int gpusess_check_layout(const struct tlink_register *r);

/* Imports the trainer's region behind `devfd` (borrowed; the caller
 * closes it) on the device r->cuda_uuid names, checked with
 * gpusess_check_layout, and opens a stage for it. host_grads and
 * host_results are the memfd's areas (borrowed; they outlive the
 * session). Returns 0 and sets *out (caller frees with gpusess_close),
 * -EINVAL, -EOPNOTSUPP, -ELIBACC, -ENXIO, -ENOMEM, -EIO. */
int gpusess_open(const struct tlink_register *r, int devfd, void *host_grads,
                 void *host_results, struct gpusess **out);
/* The device's gradients into the memfd's gradient area. Returns 0 or
 * -errno (the driver failed). Safe against a concurrent gpusess_scatter. */
int gpusess_gather(struct gpusess *g);
/* The memfd's results onto the device; done there when it returns.
 * Returns 0 or -errno. */
int gpusess_scatter(struct gpusess *g);
/* Zeroes the device's gradients, as the node zeroed the memfd's when a
 * state transfer dropped them. Returns 0 or -errno. */
int gpusess_zero_grads(struct gpusess *g);
/* The device as an NCCL step sees it (devred.h): the gradients' device
 * address, a scratch area of the gradients' size allocated on the same
 * device (once; freed by gpusess_close), the stage's stream, and the
 * calls that gather, enter the device and zero the scratch. `mem` is the
 * caller's and must outlive its users. Without `with_scratch` (a session
 * that is always host-staged) no scratch is made. Returns 0; or
 * -EOPNOTSUPP (a type NCCL does not reduce), -ENOMEM, -EIO with no
 * scratch, the calls filled in all the same, for a host-staged reducer. */
int gpusess_device_mem(struct gpusess *g, bool with_scratch, struct devred_mem *mem);
/* The scratch's result onto the device's results area; done there when
 * it returns. Returns 0 or -errno. */
int gpusess_publish_scratch(struct gpusess *g);
/* Unmaps the region and lets the driver go. NULL is fine. */
void gpusess_close(struct gpusess *g);
#endif

/* src/accumulator/gputrainer.h: the trainer's half of a GPU registration
 * (include/cohort.h, cohort_use_gpu; the sidecar's half is gpusess.h).
 *
 * One device region, allocated with cuMemCreate and a POSIX
 * file-descriptor handle (vmm.h) on the device named by UUID, holds the
 * gradients (at 0; results land in place, as moolib's do), then the
 * parameters, then the buffers, each part 256-byte aligned. The region's
 * descriptor goes to the sidecar with REGISTER (SCM_RIGHTS), beside the
 * memfd; the sidecar reads and writes only the gradients. The parameters
 * and buffers are the trainer's model (the Python Accumulator's views);
 * state transfer moves their host copies in the memfd, which the trainer
 * refreshes from the device before it hands the sidecar its state
 * (gputrainer_state_out) and copies to the device when a state arrived
 * (gputrainer_state_in): include/cohort.h, cohort_gpu_param.
 *
 * Ordering: the trainer waits for its context's queued work
 * (gputrainer_sync, cuCtxSynchronize) before it tells the sidecar to read
 * the gradients; the sidecar puts a result on the device before the view
 * says has_gradients. No interprocess event is used: those need the
 * legacy CUDA IPC path, which fails across a pod's PID namespaces.
 */
#ifndef COHORT_GPUTRAINER_H
#define COHORT_GPUTRAINER_H

#include <stddef.h>
#include <stdint.h>

struct tlink_register;
struct gputrainer;

/* Allocates `bytes` of gradients, `params_bytes` of parameters and
 * `buffers_bytes` of buffers, all zero, on the device whose UUID is
 * `uuid` (nvidia-smi's form) and exports them. Returns 0 and sets *out
 * (caller frees with gputrainer_close), -EINVAL (not a UUID, or no
 * gradient bytes), -EOPNOTSUPP (no GPU support in this build), -ELIBACC
 * (no driver), -ENXIO (no such device), -ENOMEM, -EIO. */
int gputrainer_open(const char *uuid, size_t bytes, size_t params_bytes, size_t buffers_bytes,
                    struct gputrainer **out);
void gputrainer_close(struct gputrainer *g);   /* NULL is fine */

/* Names the device region in a layout: mem, UUID, device_bytes and the
 * offsets (gradients and results both at 0). */
void gputrainer_describe(const struct gputrainer *g, struct tlink_register *r);
/* The exported region's descriptor (borrowed: closed by gputrainer_close). */
int gputrainer_fd(const struct gputrainer *g);
/* The gradients' device address in this process (a CUdeviceptr). */
uint64_t gputrainer_addr(const struct gputrainer *g);
/* The parameters' and the buffers' device addresses in this process. */
uint64_t gputrainer_params_addr(const struct gputrainer *g);
uint64_t gputrainer_buffers_addr(const struct gputrainer *g);
/* Copies the device's parameters and buffers to `params` and `buffers`
 * (host memory of params_bytes and buffers_bytes), after this process's
 * queued work on the device. Returns 0 or -errno (-EIO). */
int gputrainer_state_out(struct gputrainer *g, void *params, void *buffers);
/* Copies `params` and `buffers` onto the device, visible to every stream
 * when it returns. Returns 0 or -errno (-EIO). */
int gputrainer_state_in(struct gputrainer *g, const void *params, const void *buffers);
/* Waits for this process's queued work on the device. Returns 0 or -errno. */
int gputrainer_sync(struct gputrainer *g);
/* Zeroes the gradients. Returns 0 or -errno. */
int gputrainer_zero(struct gputrainer *g);
#endif

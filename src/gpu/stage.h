/* src/gpu/stage.h: copies between a device region (vmm.h) and ordinary
 * host memory, through two pinned bounce buffers, segment by segment, so
 * that the copy engine moves one segment while the CPU moves the other:
 * the host-staged path's device-to-host before a round and host-to-device
 * after it (docs/gpu.md, "Host-staged reduction").
 *
 * Why bounce buffers and not the destination pinned in place: the host
 * side is the trainer's shared memfd, which the sidecar did not allocate
 * and may not lock in full (RLIMIT_MEMLOCK in a container is small); two
 * segments are the only memory pinned.
 *
 * Ordering is by events on one stream of the region's device: a bounce
 * buffer is read by the CPU only after the event recorded behind its
 * device-to-host copy has completed, and refilled only after the event
 * behind its host-to-device copy has; stage_up returns only once the
 * stream has drained, so the bytes are on the device when it returns.
 *
 * One stage is used by one thread at a time. Built without COHORT_GPU,
 * stage_open answers -EOPNOTSUPP.
 */
#ifndef COHORT_STAGE_H
#define COHORT_STAGE_H

#include <stddef.h>

struct cudrv;
struct vmm_region;
struct stage;

/* The segment a stage uses when asked for 0: large enough that a copy's
 * fixed cost (microseconds) is small beside its transfer, small enough
 * that two of them are little pinned memory. */
#define STAGE_SEGMENT_DEFAULT (4u << 20)
/* The largest segment accepted: two of them are pinned. */
#define STAGE_SEGMENT_MAX (64u << 20)

/* A stage for region `r` (borrowed: it must outlive the stage) of the
 * driver `d` (borrowed), with segments of `segment` bytes (0: the
 * default). Allocates a stream, two events and two pinned buffers.
 * Returns 0 and sets *out (caller frees with stage_close), -EINVAL
 * (segment over STAGE_SEGMENT_MAX), -EOPNOTSUPP, -ENOMEM, -EIO. */
int stage_open(struct cudrv *d, struct vmm_region *r, size_t segment, struct stage **out);
/* Frees everything stage_open took, waiting for its stream first. NULL is
 * fine. */
void stage_close(struct stage *s);

/* Device bytes [dev_off, dev_off + len) of the region to host memory
 * `dst` (len bytes). Returns 0, -EINVAL (outside the region), -EIO (the
 * driver failed; dst then holds some segments and not others). */
int stage_down(struct stage *s, size_t dev_off, void *dst, size_t len);
/* Host memory `src` (len bytes) to the region at dev_off; done on the
 * device when it returns. Returns 0, -EINVAL, -EIO. */
int stage_up(struct stage *s, size_t dev_off, const void *src, size_t len);

/* The stage's stream (a CUstream), borrowed: NCCL's collectives on the
 * region are queued on it, after the stage's copies. NULL in a build
 * without GPU support. */
void *stage_stream(const struct stage *s);

/* Segments moved since stage_open, both ways (for tests and logs). */
size_t stage_segments(const struct stage *s);
#endif

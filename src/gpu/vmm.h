/* src/gpu/vmm.h: device memory one process allocates and another maps,
 * through the driver's virtual-memory API (NVIDIA's cuda-samples,
 * memMapIPCDrv): cuMemCreate with a POSIX file-descriptor handle type,
 * cuMemExportToShareableHandle to get the fd, and in the other process
 * cuMemImportFromShareableHandle, cuMemAddressReserve, cuMemMap and
 * cuMemSetAccess. The fd travels with fdpass.h. Unlike a legacy CUDA IPC
 * handle it needs no shared PID namespace.
 *
 * Built without COHORT_GPU, vmm_export and vmm_import answer -EOPNOTSUPP.
 */
#ifndef COHORT_VMM_H
#define COHORT_VMM_H

#include <stddef.h>
#include <stdint.h>

struct cudrv;
struct vmm_region;

/* `bytes` rounded up to a multiple of `granularity` (a power of two or
 * not). Returns 0 for 0, or when the result would not fit a size_t or
 * the granularity is 0: no region can be made of it. */
size_t vmm_round(size_t bytes, size_t granularity);

/* Allocates at least `bytes` on the device with driver ordinal `ordinal`,
 * maps it read-write in this process and exports it. Returns 0, sets
 * *out (caller frees with vmm_destroy) and *fd (caller closes; closing it
 * does not free the memory), -EOPNOTSUPP, -EINVAL, -ENOMEM, -EIO. */
int vmm_export(struct cudrv *d, int ordinal, size_t bytes, struct vmm_region **out, int *fd);

/* Maps the region behind `fd` (borrowed: the caller closes it, mapped or
 * not), `bytes` long as its exporter said, on device `ordinal`.
 * Returns 0 and sets *out (caller frees with vmm_destroy), -EOPNOTSUPP,
 * -EINVAL (bytes not a whole number of granules), -ENOMEM, -EIO. */
int vmm_import(struct cudrv *d, int ordinal, int fd, size_t bytes, struct vmm_region **out);

/* The region's device address in this process, and its mapped size. */
uint64_t vmm_addr(const struct vmm_region *r);
size_t vmm_bytes(const struct vmm_region *r);

/* Copies between host memory and the region (offset and length checked
 * against its size). Return 0, -EINVAL, -EIO. The host-staged path and
 * make test-gpu use them. */
int vmm_write(struct vmm_region *r, size_t off, const void *src, size_t len);
int vmm_read(struct vmm_region *r, size_t off, void *dst, size_t len);
/* Copies `len` bytes from device address `src` (on the same device) into
 * the region at `off`, done when it returns. Returns 0, -EINVAL, -EIO,
 * -EOPNOTSUPP. An NCCL step's result reaches the trainer's region so. */
int vmm_copy_in(struct vmm_region *r, size_t off, uint64_t src, size_t len);

/* Zeroes [off, off + len) of the region, done when it returns (the
 * driver's own memset, then a synchronisation of the context). Returns 0,
 * -EINVAL, -EIO, -EOPNOTSUPP. */
int vmm_zero(struct vmm_region *r, size_t off, size_t len);
/* Waits for all work queued in the region's device context by this
 * process (cuCtxSynchronize: every stream of the primary context, which
 * PyTorch's allocations share). Returns 0, -EIO, -EOPNOTSUPP. */
int vmm_sync(struct vmm_region *r);

/* Makes the region's device context current on the calling thread, as
 * every driver call on the region needs (stage.h). Returns 0, -EIO,
 * -EOPNOTSUPP. */
int vmm_enter(struct vmm_region *r);

/* Unmaps, frees the address range and releases the allocation: the memory
 * itself goes once every process that mapped it has let go. NULL is fine. */
void vmm_destroy(struct vmm_region *r);
#endif

/* src/gpu/vmm.c: see vmm.h. */
#include "gpu/vmm.h"

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>

#include "gpu/cudrv.h"
#include "gpu/cudrv_fns.h"

size_t vmm_round(size_t bytes, size_t granularity)
{
    size_t r;

    if (granularity == 0 || bytes == 0)
        return 0;
    r = bytes % granularity;
    if (r == 0)
        return bytes;
    if (bytes > SIZE_MAX - (granularity - r))
        return 0;
    return bytes + (granularity - r);
}

#ifdef COHORT_GPU

struct vmm_region {
    struct cudrv *d;            /* borrowed */
    CUdevice dev;
    CUcontext ctx;              /* the device's primary context, retained */
    CUmemGenericAllocationHandle handle;
    bool have_handle;
    CUdeviceptr addr;
    size_t bytes;
    bool reserved, mapped;
};

static CUmemAllocationProp prop_for(int ordinal)
{
    CUmemAllocationProp p = { 0 };

    p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = ordinal;
    p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    return p;
}

/* A region with its device's primary context current on this thread:
 * the driver's memory calls act on the current context. */
static int region_new(struct cudrv *d, int ordinal, struct vmm_region **out)
{
    struct vmm_region *r;
    CUresult e;
    int rc;

    r = calloc(1, sizeof(*r));
    if (!r)
        return -ENOMEM;
    r->d = d;
    e = d->cuDeviceGet(&r->dev, ordinal);
    if (e != CUDA_SUCCESS) {
        rc = cudrv_fail(d, e, "The device to map GPU memory on could not be found.");
        goto free_r;
    }
    e = d->cuDevicePrimaryCtxRetain(&r->ctx, r->dev);
    if (e != CUDA_SUCCESS) {
        rc = cudrv_fail(d, e, "The device's primary context could not be retained.");
        goto free_r;
    }
    e = d->cuCtxSetCurrent(r->ctx);
    if (e != CUDA_SUCCESS) {
        rc = cudrv_fail(d, e, "The device's primary context could not be made current.");
        goto release_ctx;
    }
    *out = r;
    return 0;
release_ctx:
    d->cuDevicePrimaryCtxRelease(r->dev);
free_r:
    free(r);
    return rc;
}

/* Reserves an address range for the region's handle, maps it and opens it
 * read-write to the region's device. */
static int map_here(struct vmm_region *r, int ordinal, size_t granularity)
{
    struct cudrv *d = r->d;
    CUmemAccessDesc access = { 0 };
    CUresult e;

    e = d->cuMemAddressReserve(&r->addr, r->bytes, granularity, 0, 0);
    if (e != CUDA_SUCCESS)
        return cudrv_fail(d, e, "No device address range could be reserved for GPU memory.");
    r->reserved = true;
    e = d->cuMemMap(r->addr, r->bytes, 0, r->handle, 0);
    if (e != CUDA_SUCCESS)
        return cudrv_fail(d, e, "GPU memory could not be mapped.");
    r->mapped = true;
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = ordinal;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    e = d->cuMemSetAccess(r->addr, r->bytes, &access, 1);
    if (e != CUDA_SUCCESS)
        return cudrv_fail(d, e, "GPU memory could not be opened for reading and writing.");
    return 0;
}

static int granularity_of(struct cudrv *d, int ordinal, size_t *out)
{
    CUmemAllocationProp p = prop_for(ordinal);
    CUresult e;

    e = d->cuMemGetAllocationGranularity(out, &p, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    if (e != CUDA_SUCCESS)
        return cudrv_fail(d, e, "The device's allocation granularity could not be read.");
    return *out ? 0 : -EIO;
}

int vmm_export(struct cudrv *d, int ordinal, size_t bytes, struct vmm_region **out, int *fd)
{
    CUmemAllocationProp p = prop_for(ordinal);
    struct vmm_region *r = NULL;
    size_t gran;
    int rc, exported = -1;
    CUresult e;

    rc = region_new(d, ordinal, &r);
    if (rc < 0)
        return rc;
    rc = granularity_of(d, ordinal, &gran);
    if (rc < 0)
        goto destroy;
    r->bytes = vmm_round(bytes, gran);
    if (r->bytes == 0) {
        rc = -EINVAL;
        goto destroy;
    }
    e = d->cuMemCreate(&r->handle, r->bytes, &p, 0);
    if (e != CUDA_SUCCESS) {
        rc = cudrv_fail(d, e, "GPU memory could not be allocated.");
        goto destroy;
    }
    r->have_handle = true;
    rc = map_here(r, ordinal, gran);
    if (rc < 0)
        goto destroy;
    e = d->cuMemExportToShareableHandle(&exported, r->handle,
                                        CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    if (e != CUDA_SUCCESS) {
        rc = cudrv_fail(d, e, "GPU memory could not be exported as a file descriptor.");
        goto destroy;
    }
    *out = r;
    *fd = exported;
    return 0;
destroy:
    vmm_destroy(r);
    return rc;
}

int vmm_import(struct cudrv *d, int ordinal, int fd, size_t bytes, struct vmm_region **out)
{
    struct vmm_region *r = NULL;
    size_t gran;
    CUresult e;
    int rc;

    rc = region_new(d, ordinal, &r);
    if (rc < 0)
        return rc;
    rc = granularity_of(d, ordinal, &gran);
    if (rc < 0)
        goto destroy;
    /* The exporter rounded its size to the same granularity; a size that
     * is not a whole number of granules was not made by cohort. */
    if (bytes == 0 || vmm_round(bytes, gran) != bytes) {
        rc = -EINVAL;
        goto destroy;
    }
    r->bytes = bytes;
    e = d->cuMemImportFromShareableHandle(&r->handle, (void *)(uintptr_t)fd,
                                          CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    if (e != CUDA_SUCCESS) {
        rc = cudrv_fail(d, e, "GPU memory could not be imported from its file descriptor.");
        goto destroy;
    }
    r->have_handle = true;
    rc = map_here(r, ordinal, gran);
    if (rc < 0)
        goto destroy;
    *out = r;
    return 0;
destroy:
    vmm_destroy(r);
    return rc;
}

uint64_t vmm_addr(const struct vmm_region *r)
{
    return (uint64_t)r->addr;
}

size_t vmm_bytes(const struct vmm_region *r)
{
    return r->bytes;
}

static bool in_range(const struct vmm_region *r, size_t off, size_t len)
{
    return off <= r->bytes && len <= r->bytes - off;
}

int vmm_write(struct vmm_region *r, size_t off, const void *src, size_t len)
{
    CUresult e;

    if (!in_range(r, off, len))
        return -EINVAL;
    e = r->d->cuCtxSetCurrent(r->ctx);
    if (e == CUDA_SUCCESS)
        e = r->d->cuMemcpyHtoD(r->addr + off, src, len);
    return e == CUDA_SUCCESS ? 0 : cudrv_fail(r->d, e, "Host memory could not be copied to the GPU.");
}

int vmm_read(struct vmm_region *r, size_t off, void *dst, size_t len)
{
    CUresult e;

    if (!in_range(r, off, len))
        return -EINVAL;
    e = r->d->cuCtxSetCurrent(r->ctx);
    if (e == CUDA_SUCCESS)
        e = r->d->cuMemcpyDtoH(dst, r->addr + off, len);
    return e == CUDA_SUCCESS ? 0 : cudrv_fail(r->d, e, "GPU memory could not be copied to the host.");
}

int vmm_copy_in(struct vmm_region *r, size_t off, uint64_t src, size_t len)
{
    CUresult e;

    if (!in_range(r, off, len))
        return -EINVAL;
    e = r->d->cuCtxSetCurrent(r->ctx);
    if (e == CUDA_SUCCESS)
        e = r->d->cuMemcpyDtoD(r->addr + off, (CUdeviceptr)src, len);
    /* cuMemcpyDtoD may return before the copy is done on the device. */
    if (e == CUDA_SUCCESS)
        e = r->d->cuCtxSynchronize();
    return e == CUDA_SUCCESS ? 0 : cudrv_fail(r->d, e, "GPU memory could not be copied on the GPU.");
}

int vmm_zero(struct vmm_region *r, size_t off, size_t len)
{
    CUresult e;

    if (!in_range(r, off, len))
        return -EINVAL;
    e = r->d->cuCtxSetCurrent(r->ctx);
    if (e == CUDA_SUCCESS)
        e = r->d->cuMemsetD8(r->addr + off, 0, len);
    if (e == CUDA_SUCCESS)
        e = r->d->cuCtxSynchronize();
    return e == CUDA_SUCCESS ? 0 : cudrv_fail(r->d, e, "GPU memory could not be zeroed.");
}

int vmm_sync(struct vmm_region *r)
{
    CUresult e = r->d->cuCtxSetCurrent(r->ctx);

    if (e == CUDA_SUCCESS)
        e = r->d->cuCtxSynchronize();
    return e == CUDA_SUCCESS ? 0 : cudrv_fail(r->d, e, "The GPU's queued work could not be waited for.");
}

int vmm_enter(struct vmm_region *r)
{
    CUresult e = r->d->cuCtxSetCurrent(r->ctx);

    return e == CUDA_SUCCESS ? 0 : cudrv_fail(r->d, e, "The device's primary context could not be made current.");
}

void vmm_destroy(struct vmm_region *r)
{
    if (!r)
        return;
    /* In reverse order of making; each step only if it was taken. */
    if (r->mapped)
        r->d->cuMemUnmap(r->addr, r->bytes);
    if (r->reserved)
        r->d->cuMemAddressFree(r->addr, r->bytes);
    if (r->have_handle)
        r->d->cuMemRelease(r->handle);
    r->d->cuDevicePrimaryCtxRelease(r->dev);
    free(r);
}

#else /* no GPU support in this build */

struct vmm_region {
    size_t bytes;
};

int vmm_export(struct cudrv *d, int ordinal, size_t bytes, struct vmm_region **out, int *fd)
{
    return -EOPNOTSUPP;
}

int vmm_import(struct cudrv *d, int ordinal, int fd, size_t bytes, struct vmm_region **out)
{
    return -EOPNOTSUPP;
}

uint64_t vmm_addr(const struct vmm_region *r)
{
    return 0;
}

size_t vmm_bytes(const struct vmm_region *r)
{
    return r ? r->bytes : 0;
}

int vmm_write(struct vmm_region *r, size_t off, const void *src, size_t len)
{
    return -EOPNOTSUPP;
}

int vmm_read(struct vmm_region *r, size_t off, void *dst, size_t len)
{
    return -EOPNOTSUPP;
}

int vmm_copy_in(struct vmm_region *r, size_t off, uint64_t src, size_t len)
{
    return -EOPNOTSUPP;
}

int vmm_enter(struct vmm_region *r)
{
    return -EOPNOTSUPP;
}

int vmm_zero(struct vmm_region *r, size_t off, size_t len)
{
    return -EOPNOTSUPP;
}

int vmm_sync(struct vmm_region *r)
{
    return -EOPNOTSUPP;
}

void vmm_destroy(struct vmm_region *r)
{
    free(r);
}
#endif

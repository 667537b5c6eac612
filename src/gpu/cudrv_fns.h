/* src/gpu/cudrv_fns.h: private to src/gpu/, and only in a build with GPU
 * support: the driver's entry points as cudrv.c resolved them, for the
 * modules of this folder that call the driver (vmm.c, stage.c). */
#ifndef COHORT_CUDRV_FNS_H
#define COHORT_CUDRV_FNS_H
#ifdef COHORT_GPU

#include <cuda.h>

/* X(name): every driver call cohort makes. cuda.h maps some names to a
 * versioned symbol (cuDeviceGetUuid -> cuDeviceGetUuid_v2); dlsym is
 * given the mapped name, so each call binds to the ABI the header
 * describes. */
#define CUDRV_CALLS(X) \
    X(cuInit) X(cuGetErrorName) X(cuDeviceGetCount) X(cuDeviceGet) X(cuDeviceGetUuid) \
    X(cuDevicePrimaryCtxRetain) X(cuDevicePrimaryCtxRelease) X(cuCtxSetCurrent) \
    X(cuMemGetAllocationGranularity) X(cuMemCreate) X(cuMemRelease) \
    X(cuMemExportToShareableHandle) X(cuMemImportFromShareableHandle) \
    X(cuMemAddressReserve) X(cuMemAddressFree) X(cuMemMap) X(cuMemUnmap) X(cuMemSetAccess) \
    X(cuMemcpyHtoD) X(cuMemcpyDtoH) X(cuMemcpyDtoD) \
    X(cuCtxSynchronize) X(cuStreamCreate) X(cuStreamDestroy) X(cuStreamSynchronize) \
    X(cuEventCreate) X(cuEventDestroy) X(cuEventRecord) X(cuEventSynchronize) \
    X(cuMemAllocHost) X(cuMemFreeHost) X(cuMemcpyHtoDAsync) X(cuMemcpyDtoHAsync) X(cuMemsetD8)

struct cudrv {
    void *lib;
#define CUDRV_FIELD(name) __typeof__(&name) name;
    CUDRV_CALLS(CUDRV_FIELD)
#undef CUDRV_FIELD
};

/* Maps a driver result to -errno, logging the driver's name for it once
 * per call site with `what` (a whole sentence). */
int cudrv_fail(const struct cudrv *d, CUresult r, const char *what);
#endif
#endif

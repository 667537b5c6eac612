/* tests/gpu/fake_cuda.c: a stand-in for the CUDA driver, libcuda.so.1,
 * for machines without one: the entry points src/gpu/ resolves, with
 * device memory played by memfds, so that tests/proc/test_gpu_driver.py
 * can run the driver paths of src/gpu/ (devices by UUID, "no device",
 * the toolkit's stub, VMM export and import, every call failing in turn)
 * where no GPU exists. Built only where cuda.h is found, against it, so
 * every signature is the header's.
 *
 * Told what to be by the environment, read at each call:
 *   COHORT_FAKE_CUDA_DEVICES  comma-separated UUIDs (nvidia-smi's form)
 *   COHORT_FAKE_CUDA_INIT     "nodev" or "stub": what cuInit fails with
 *   COHORT_FAKE_CUDA_FAIL     the name of one call that fails
 *                             (CUDA_ERROR_OUT_OF_MEMORY) before it acts
 * and asked, through dlsym, for fake_cuda_log() (the calls made, by name)
 * and fake_cuda_live() (contexts, allocations, reservations, mappings,
 * streams, events and pinned buffers not yet released).
 *
 * Asynchronous copies are played as a device plays them at its slowest:
 * queued on their stream and carried out only when a synchronisation
 * covers them (cuEventSynchronize on an event recorded behind them,
 * cuStreamSynchronize, cuCtxSynchronize). A caller that reads a
 * destination, or refills a source, before waiting for its copy sees the
 * old bytes, or sends the new ones, as it could on a real device.
 *
 * It has no cuStreamQuery, the call NCCL's collectives are seen to finish
 * by (src/gpu/nccllib.c): against it a sidecar never votes for NCCL and
 * reduces host-staged, whatever NCCL the machine has. Built with
 * FAKE_CUDA_STREAM_QUERY it has one, and goes beside the stand-in NCCL
 * (fake_nccl.c) in a directory of their own.
 */
#include <cuda.h>

#include <fcntl.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))
#define HANDLES 64
#define DEVICES 8

const char *fake_cuda_log(void);
int fake_cuda_live(void);

static char call_log[8192];
static int live;
static int handle_fd[HANDLES];          /* handle h is slot h - 1; fd + 1, 0 free */

EXPORT const char *fake_cuda_log(void)
{
    return call_log;
}

EXPORT int fake_cuda_live(void)
{
    return live;
}

/* Logs the call; true when it is the one told to fail. */
static bool called(const char *name)
{
    const char *fail = getenv("COHORT_FAKE_CUDA_FAIL");
    size_t len = strlen(call_log);

    snprintf(call_log + len, sizeof(call_log) - len, "%s ", name);
    return fail && strcmp(fail, name) == 0;
}

#define ENTER(name)                             \
    do {                                        \
        if (called(name))                       \
            return CUDA_ERROR_OUT_OF_MEMORY;    \
    } while (0)

static int hexval(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

/* The UUIDs of COHORT_FAKE_CUDA_DEVICES: 32 hex digits each, dashes and
 * the "GPU-" prefix skipped. */
static int devices(CUuuid *out)
{
    const char *s = getenv("COHORT_FAKE_CUDA_DEVICES");
    int n = 0, digit = 0;

    if (!s || !*s)
        return 0;
    if (strncmp(s, "GPU-", 4) == 0)
        s += 4;
    for (; *s && n < DEVICES; s++) {
        int v = hexval(*s);
        if (*s == ',') {
            digit = 0;
            if (strncmp(s + 1, "GPU-", 4) == 0)
                s += 4;
            continue;
        }
        if (v < 0 || digit >= 32)
            continue;
        if (digit % 2 == 0)
            out[n].bytes[digit / 2] = (char)(v << 4);
        else
            out[n].bytes[digit / 2] = (char)(out[n].bytes[digit / 2] | v);
        if (++digit == 32)
            n++;
    }
    return n;
}

EXPORT CUresult CUDAAPI cuInit(unsigned int flags)
{
    const char *mode = getenv("COHORT_FAKE_CUDA_INIT");

    ENTER("cuInit");
    if (mode && strcmp(mode, "nodev") == 0)
        return CUDA_ERROR_NO_DEVICE;
    if (mode && strcmp(mode, "stub") == 0)
        return CUDA_ERROR_STUB_LIBRARY;
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuGetErrorName(CUresult error, const char **pStr)
{
    switch (error) {
    case CUDA_ERROR_OUT_OF_MEMORY: *pStr = "CUDA_ERROR_OUT_OF_MEMORY"; return CUDA_SUCCESS;
    case CUDA_ERROR_NO_DEVICE: *pStr = "CUDA_ERROR_NO_DEVICE"; return CUDA_SUCCESS;
    case CUDA_ERROR_STUB_LIBRARY: *pStr = "CUDA_ERROR_STUB_LIBRARY"; return CUDA_SUCCESS;
    case CUDA_ERROR_INVALID_VALUE: *pStr = "CUDA_ERROR_INVALID_VALUE"; return CUDA_SUCCESS;
    default: return CUDA_ERROR_INVALID_VALUE;
    }
}

EXPORT CUresult CUDAAPI cuDeviceGetCount(int *count)
{
    CUuuid u[DEVICES];

    ENTER("cuDeviceGetCount");
    *count = devices(u);
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuDeviceGet(CUdevice *device, int ordinal)
{
    CUuuid u[DEVICES];

    ENTER("cuDeviceGet");
    if (ordinal < 0 || ordinal >= devices(u))
        return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuDeviceGetUuid(CUuuid *uuid, CUdevice dev)
{
    CUuuid u[DEVICES];

    ENTER("cuDeviceGetUuid");
    if (dev < 0 || dev >= devices(u))
        return CUDA_ERROR_INVALID_DEVICE;
    *uuid = u[dev];
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    ENTER("cuDevicePrimaryCtxRetain");
    *pctx = (CUcontext)(uintptr_t)(0x1000 + dev);
    live++;
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuDevicePrimaryCtxRelease(CUdevice dev)
{
    ENTER("cuDevicePrimaryCtxRelease");
    live--;
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuCtxSetCurrent(CUcontext ctx)
{
    ENTER("cuCtxSetCurrent");
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuMemGetAllocationGranularity(size_t *granularity,
                                                       const CUmemAllocationProp *prop,
                                                       CUmemAllocationGranularity_flags option)
{
    ENTER("cuMemGetAllocationGranularity");
    *granularity = 2u << 20;
    return CUDA_SUCCESS;
}

static CUresult new_handle(int fd, CUmemGenericAllocationHandle *handle)
{
    for (int i = 0; i < HANDLES; i++) {
        if (handle_fd[i] == 0) {
            handle_fd[i] = fd + 1;
            *handle = (CUmemGenericAllocationHandle)(i + 1);
            live++;
            return CUDA_SUCCESS;
        }
    }
    close(fd);
    return CUDA_ERROR_OUT_OF_MEMORY;
}

static int fd_of(CUmemGenericAllocationHandle h)
{
    return h >= 1 && h <= HANDLES ? handle_fd[h - 1] - 1 : -1;
}

EXPORT CUresult CUDAAPI cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                                    const CUmemAllocationProp *prop, unsigned long long flags)
{
    int fd;

    ENTER("cuMemCreate");
    if (size == 0 || size % (2u << 20) != 0 || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED ||
        prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE ||
        !(prop->requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
        return CUDA_ERROR_INVALID_VALUE;
    fd = memfd_create("fake-cuda", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)size) < 0) {
        if (fd >= 0)
            close(fd);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return new_handle(fd, handle);
}

EXPORT CUresult CUDAAPI cuMemRelease(CUmemGenericAllocationHandle handle)
{
    int fd = fd_of(handle);

    ENTER("cuMemRelease");
    if (fd < 0)
        return CUDA_ERROR_INVALID_VALUE;
    close(fd);
    handle_fd[handle - 1] = 0;
    live--;
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuMemExportToShareableHandle(void *shareableHandle,
                                                     CUmemGenericAllocationHandle handle,
                                                     CUmemAllocationHandleType handleType,
                                                     unsigned long long flags)
{
    int fd = fd_of(handle);

    ENTER("cuMemExportToShareableHandle");
    if (fd < 0 || handleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return CUDA_ERROR_INVALID_VALUE;
    *(int *)shareableHandle = dup(fd);
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle,
                                                       void *osHandle,
                                                       CUmemAllocationHandleType shHandleType)
{
    int fd = (int)(uintptr_t)osHandle;

    ENTER("cuMemImportFromShareableHandle");
    if (shHandleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || fcntl(fd, F_GETFD) < 0)
        return CUDA_ERROR_INVALID_VALUE;
    return new_handle(dup(fd), handle);
}

EXPORT CUresult CUDAAPI cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment,
                                            CUdeviceptr addr, unsigned long long flags)
{
    void *p;

    ENTER("cuMemAddressReserve");
    p = mmap(NULL, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *ptr = (CUdeviceptr)(uintptr_t)p;
    live++;
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuMemAddressFree(CUdeviceptr ptr, size_t size)
{
    ENTER("cuMemAddressFree");
    munmap((void *)(uintptr_t)ptr, size);
    live--;
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
                                 CUmemGenericAllocationHandle handle, unsigned long long flags)
{
    struct stat st;
    int fd = fd_of(handle);

    ENTER("cuMemMap");
    if (fd < 0 || fstat(fd, &st) < 0 || (size_t)st.st_size < offset + size)
        return CUDA_ERROR_INVALID_VALUE;
    if (mmap((void *)(uintptr_t)ptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd,
             (off_t)offset) == MAP_FAILED)
        return CUDA_ERROR_OUT_OF_MEMORY;
    live++;
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    ENTER("cuMemUnmap");
    /* Back to a reservation, as the driver leaves it. */
    mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
    live--;
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc,
                                       size_t count)
{
    ENTER("cuMemSetAccess");
    if (count != 1 || desc->flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
        return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuMemcpyHtoD(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount)
{
    ENTER("cuMemcpyHtoD");
    memcpy((void *)(uintptr_t)dstDevice, srcHost, ByteCount);
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuMemcpyDtoH(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount)
{
    ENTER("cuMemcpyDtoH");
    memcpy(dstHost, (const void *)(uintptr_t)srcDevice, ByteCount);
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuMemcpyDtoD(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount)
{
    ENTER("cuMemcpyDtoD");
    memmove((void *)(uintptr_t)dstDevice, (const void *)(uintptr_t)srcDevice, ByteCount);
    return CUDA_SUCCESS;
}

/* ---- streams, events, asynchronous copies and pinned host memory ---- */

#define STREAMS 8
#define QUEUE 256

struct fake_copy {
    void *dst;
    const void *src;
    size_t n;
};

struct fake_stream {
    bool used;
    struct fake_copy q[QUEUE];
    size_t queued, done;        /* copies q[done..queued) are pending */
};

struct fake_event {
    struct fake_stream *s;      /* NULL: never recorded */
    size_t mark;                /* copies before it on s */
};

static pthread_mutex_t stream_lock = PTHREAD_MUTEX_INITIALIZER;
static struct fake_stream streams[STREAMS];

/* Carries out the copies on s before position `upto`. Under stream_lock. */
static void run_until(struct fake_stream *s, size_t upto)
{
    while (s->done < upto) {
        struct fake_copy *c = &s->q[s->done % QUEUE];
        memcpy(c->dst, c->src, c->n);
        s->done++;
    }
}

EXPORT CUresult CUDAAPI cuStreamCreate(CUstream *phStream, unsigned int Flags)
{
    ENTER("cuStreamCreate");
    pthread_mutex_lock(&stream_lock);
    for (int i = 0; i < STREAMS; i++) {
        if (!streams[i].used) {
            memset(&streams[i], 0, sizeof(streams[i]));
            streams[i].used = true;
            *phStream = (CUstream)&streams[i];
            live++;
            pthread_mutex_unlock(&stream_lock);
            return CUDA_SUCCESS;
        }
    }
    pthread_mutex_unlock(&stream_lock);
    return CUDA_ERROR_OUT_OF_MEMORY;
}

EXPORT CUresult CUDAAPI cuStreamSynchronize(CUstream hStream)
{
    struct fake_stream *s = (struct fake_stream *)hStream;

    ENTER("cuStreamSynchronize");
    if (!s)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&stream_lock);
    run_until(s, s->queued);
    pthread_mutex_unlock(&stream_lock);
    return CUDA_SUCCESS;
}

#ifdef FAKE_CUDA_STREAM_QUERY
/* Built so only beside the stand-in NCCL (fake_nccl.c), whose collectives
 * are done once NCCL says so: the stream has nothing of them to wait for,
 * and its copies are carried out as a synchronisation would. */
EXPORT CUresult CUDAAPI cuStreamQuery(CUstream hStream)
{
    struct fake_stream *s = (struct fake_stream *)hStream;

    ENTER("cuStreamQuery");
    if (!s)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&stream_lock);
    run_until(s, s->queued);
    pthread_mutex_unlock(&stream_lock);
    return CUDA_SUCCESS;
}
#endif

EXPORT CUresult CUDAAPI cuStreamDestroy(CUstream hStream)
{
    struct fake_stream *s = (struct fake_stream *)hStream;

    ENTER("cuStreamDestroy");
    if (!s)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&stream_lock);
    /* The driver lets queued work finish after a destroy. */
    run_until(s, s->queued);
    s->used = false;
    live--;
    pthread_mutex_unlock(&stream_lock);
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuCtxSynchronize(void)
{
    ENTER("cuCtxSynchronize");
    pthread_mutex_lock(&stream_lock);
    for (int i = 0; i < STREAMS; i++)
        if (streams[i].used)
            run_until(&streams[i], streams[i].queued);
    pthread_mutex_unlock(&stream_lock);
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuEventCreate(CUevent *phEvent, unsigned int Flags)
{
    struct fake_event *e;

    ENTER("cuEventCreate");
    e = calloc(1, sizeof(*e));
    if (!e)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *phEvent = (CUevent)e;
    live++;
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuEventDestroy(CUevent hEvent)
{
    ENTER("cuEventDestroy");
    if (!hEvent)
        return CUDA_ERROR_INVALID_VALUE;
    free(hEvent);
    live--;
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuEventRecord(CUevent hEvent, CUstream hStream)
{
    struct fake_event *e = (struct fake_event *)hEvent;
    struct fake_stream *s = (struct fake_stream *)hStream;

    ENTER("cuEventRecord");
    if (!e || !s)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&stream_lock);
    e->s = s;
    e->mark = s->queued;
    pthread_mutex_unlock(&stream_lock);
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuEventSynchronize(CUevent hEvent)
{
    struct fake_event *e = (struct fake_event *)hEvent;

    ENTER("cuEventSynchronize");
    if (!e)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&stream_lock);
    if (e->s)
        run_until(e->s, e->mark);
    pthread_mutex_unlock(&stream_lock);
    return CUDA_SUCCESS;
}

static CUresult enqueue(CUstream hStream, void *dst, const void *src, size_t n)
{
    struct fake_stream *s = (struct fake_stream *)hStream;
    CUresult r = CUDA_SUCCESS;

    if (!s)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&stream_lock);
    /* A full queue drains its oldest copy first, as a device's would. */
    if (s->queued - s->done == QUEUE)
        run_until(s, s->done + 1);
    s->q[s->queued % QUEUE] = (struct fake_copy){ dst, src, n };
    s->queued++;
    pthread_mutex_unlock(&stream_lock);
    return r;
}

EXPORT CUresult CUDAAPI cuMemcpyHtoDAsync(CUdeviceptr dstDevice, const void *srcHost,
                                          size_t ByteCount, CUstream hStream)
{
    ENTER("cuMemcpyHtoDAsync");
    return enqueue(hStream, (void *)(uintptr_t)dstDevice, srcHost, ByteCount);
}

EXPORT CUresult CUDAAPI cuMemcpyDtoHAsync(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount,
                                          CUstream hStream)
{
    ENTER("cuMemcpyDtoHAsync");
    return enqueue(hStream, dstHost, (const void *)(uintptr_t)srcDevice, ByteCount);
}

EXPORT CUresult CUDAAPI cuMemAllocHost(void **pp, size_t bytesize)
{
    ENTER("cuMemAllocHost");
    *pp = malloc(bytesize ? bytesize : 1);
    if (!*pp)
        return CUDA_ERROR_OUT_OF_MEMORY;
    /* Filled, so that a read before its copy shows. */
    memset(*pp, 0xa5, bytesize);
    live++;
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuMemFreeHost(void *p)
{
    ENTER("cuMemFreeHost");
    free(p);
    live--;
    return CUDA_SUCCESS;
}

EXPORT CUresult CUDAAPI cuMemsetD8(CUdeviceptr dstDevice, unsigned char uc, size_t N)
{
    ENTER("cuMemsetD8");
    memset((void *)(uintptr_t)dstDevice, uc, N);
    return CUDA_SUCCESS;
}

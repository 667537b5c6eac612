/* src/gpu/nccllib.c: see nccllib.h. */
#include "gpu/nccllib.h"

#include <errno.h>

#include "gpu/ncomm.h"

#ifdef COHORT_GPU
#include <dlfcn.h>
/* nccl.h declares ncclGroupStart() and two others without (void): the
 * one warning of ours it fails, silenced for it alone. */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wstrict-prototypes"
#include <nccl.h>
#pragma GCC diagnostic pop
#include <cuda.h>
#include <pthread.h>
#include <string.h>

#include "base/log.h"

#define STRINGIFY_(x) #x
#define STRINGIFY(x) STRINGIFY_(x)

_Static_assert(NCOMM_ID_BYTES == NCCL_UNIQUE_ID_BYTES, "the exchanged id is NCCL's");

/* Every call but ncclCommShrink must be present. */
#define NCCL_CALLS(X) \
    X(ncclGetVersion) X(ncclGetUniqueId) X(ncclCommInitRankConfig) X(ncclCommGetAsyncError) \
    X(ncclCommAbort) X(ncclGetErrorString) X(ncclAllReduce) X(ncclBroadcast) \
    X(ncclRedOpCreatePreMulSum) X(ncclRedOpDestroy)

static struct {
#define NCCL_FIELD(name) __typeof__(&name) name;
    NCCL_CALLS(NCCL_FIELD)
#undef NCCL_FIELD
    __typeof__(&ncclCommShrink) ncclCommShrink;    /* NULL before 2.27 */
    /* The driver's, to see a collective finish on its stream; NULL
     * without a driver (then no collective runs). */
    CUresult (*cuStreamQuery)(CUstream);
    int version;
    int rc;
} lib;
static pthread_once_t once = PTHREAD_ONCE_INIT;

/* NCCL's result as -errno, the library's own words logged once here. */
static int map(ncclResult_t r, const char *what)
{
    switch (r) {
    case ncclSuccess:
        return 0;
    case ncclInProgress:
        return -EINPROGRESS;
    default:
        break;
    }
    log_warn("gpu", what, LF_S("nccl", lib.ncclGetErrorString(r)), LF_I("code", (int)r));
    switch (r) {
    case ncclInvalidArgument:
    case ncclInvalidUsage:
        return -EINVAL;
    case ncclRemoteError:
        return -ECONNRESET;
    default:
        return -EIO;
    }
}

static int get_unique_id(void *arg, struct ncomm_id *id)
{
    ncclUniqueId u;
    int rc = map(lib.ncclGetUniqueId(&u), "NCCL could not make a unique id.");

    if (rc == 0)
        memcpy(id->b, u.internal, NCOMM_ID_BYTES);
    return rc;
}

static int init_rank(void *arg, void **comm, int nranks, const struct ncomm_id *id, int rank)
{
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    ncclUniqueId u;
    ncclComm_t c = NULL;
    int rc;

    /* Non-blocking: calls return ncclInProgress, and an abort can then
     * interrupt a collective in flight. */
    cfg.blocking = 0;
    memcpy(u.internal, id->b, NCOMM_ID_BYTES);
    rc = map(lib.ncclCommInitRankConfig(&c, nranks, u, rank, &cfg),
             "NCCL could not start creating a communicator.");
    *comm = c;
    return rc;
}

static int async_error(void *arg, void *comm)
{
    ncclResult_t state = ncclSuccess;
    int rc = map(lib.ncclCommGetAsyncError((ncclComm_t)comm, &state),
                 "NCCL could not report a communicator's state.");

    return rc < 0 ? rc : map(state, "An NCCL communicator failed.");
}

static int do_abort(void *arg, void *comm)
{
    return map(lib.ncclCommAbort((ncclComm_t)comm), "ncclCommAbort failed.");
}

static int shrink(void *arg, void *comm, const int *exclude, int nexclude, void **newcomm,
                  bool cancel)
{
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    ncclComm_t c = NULL;
    int rc;

    cfg.blocking = 0;
    rc = map(lib.ncclCommShrink((ncclComm_t)comm, (int *)exclude, nexclude, &c, &cfg,
                                cancel ? NCCL_SHRINK_ABORT : NCCL_SHRINK_DEFAULT),
             "NCCL could not shrink a communicator.");
    *newcomm = c;
    return rc;
}

static const ncclDataType_t nccl_type[] = {
    [NCOMM_F32] = ncclFloat32, [NCOMM_F64] = ncclFloat64,
    [NCOMM_F16] = ncclFloat16, [NCOMM_BF16] = ncclBfloat16,
};

static int all_reduce(void *arg, void *comm, uint64_t send, uint64_t recv, size_t count,
                      enum ncomm_type type, double scale, void *stream)
{
    ncclComm_t c = (ncclComm_t)comm;
    ncclDataType_t t = nccl_type[type];
    ncclRedOp_t op = ncclSum;
    union { float f; double d; uint16_t h; } s;
    int rc;

    if (scale != 1.0) {
        /* The scalar in the reduction's own type, read at the call. */
        if (type == NCOMM_F64)
            s.d = scale;
        else if (type == NCOMM_F32)
            s.f = (float)scale;
        else
            s.h = ncomm_scalar16(type, scale);
        rc = map(lib.ncclRedOpCreatePreMulSum(&op, &s, t, ncclScalarHostImmediate, c),
                 "NCCL could not make the averaging operation.");
        if (rc < 0)
            return rc;
    }
    rc = map(lib.ncclAllReduce((const void *)(uintptr_t)send, (void *)(uintptr_t)recv, count, t,
                               op, c, (cudaStream_t)stream),
             "NCCL could not queue an all-reduce.");
    /* NCCL: an operation may be destroyed once the last call given it
     * has returned. */
    if (op != ncclSum)
        lib.ncclRedOpDestroy(op, c);
    return rc;
}

static int broadcast(void *arg, void *comm, uint64_t send, uint64_t recv, size_t bytes, int root,
                     void *stream)
{
    return map(lib.ncclBroadcast((const void *)(uintptr_t)send, (void *)(uintptr_t)recv, bytes,
                                 ncclUint8, root, (ncclComm_t)comm, (cudaStream_t)stream),
               "NCCL could not queue a broadcast.");
}

static int stream_query(void *arg, void *stream)
{
    CUresult r = lib.cuStreamQuery((CUstream)stream);

    if (r == CUDA_SUCCESS)
        return 0;
    if (r == CUDA_ERROR_NOT_READY)
        return -EINPROGRESS;
    log_warn("gpu", "The driver reported an error on a collective's stream.", LF_I("code", (int)r));
    return -EIO;
}

static struct ncomm_ops ops = {
    .get_unique_id = get_unique_id, .init_rank = init_rank, .async_error = async_error,
    .abort = do_abort, .all_reduce = all_reduce, .broadcast = broadcast,
};

static void load(void)
{
    void *h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);

    if (!h) {
        log_info("gpu", "NCCL could not be loaded.", LF_S("dlerror", dlerror()));
        lib.rc = -ELIBACC;
        return;
    }
#define NCCL_LOAD(name)                                                                  \
    *(void **)&lib.name = dlsym(h, #name);                                               \
    if (!lib.name) {                                                                     \
        log_warn("gpu", "NCCL lacks an entry point cohort needs; it is too old.",       \
                 LF_S("symbol", #name));                                                 \
        lib.rc = -ELIBACC;                                                               \
        dlclose(h);                                                                      \
        return;                                                                          \
    }
    NCCL_CALLS(NCCL_LOAD)
#undef NCCL_LOAD
    *(void **)&lib.ncclCommShrink = dlsym(h, "ncclCommShrink");
    if (lib.ncclGetVersion(&lib.version) != ncclSuccess || lib.version < 21400) {
        log_warn("gpu", "NCCL is older than 2.14, which has no non-blocking communicators.",
                 LF_I("version", lib.version));
        lib.version = 0;
        lib.rc = -ELIBACC;
        dlclose(h);
        return;
    }
    if (lib.ncclCommShrink)
        ops.shrink = shrink;
    /* NCCL itself loads the driver; the same library answers whether a
     * stream has drained. cuda.h maps the name to its versioned symbol. */
    void *cu = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);

    if (cu)
        *(void **)&lib.cuStreamQuery = dlsym(cu, STRINGIFY(cuStreamQuery));
    if (lib.cuStreamQuery)
        ops.stream_query = stream_query;
    else
        log_info("gpu", "No CUDA driver beside NCCL: no NCCL collective can run here.");
    /* The library stays loaded for the process's life: the table points
     * into it, and aborts left running (ncomm_leaked) may still call it. */
    log_info("gpu", "NCCL is loaded.", LF_I("version", lib.version),
             LF_B("shrink", lib.ncclCommShrink != NULL));
}

int nccllib_load(const struct ncomm_ops **out)
{
    pthread_once(&once, load);
    if (lib.rc < 0)
        return lib.rc;
    *out = &ops;
    return 0;
}

int nccllib_version(void)
{
    return lib.version;
}

#else /* no GPU support in this build */

int nccllib_load(const struct ncomm_ops **out)
{
    return -EOPNOTSUPP;
}

int nccllib_version(void)
{
    return 0;
}
#endif

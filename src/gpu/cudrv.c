/* src/gpu/cudrv.c: see cudrv.h. */
#include "gpu/cudrv.h"

#include <errno.h>
#include <stdlib.h>

#include "base/log.h"
#include "gpu/cudrv_fns.h"

#ifdef COHORT_GPU
#include <dlfcn.h>

#define XSTR(x) STR(x)
#define STR(x) #x

bool cudrv_built(void)
{
    return true;
}

int cudrv_fail(const struct cudrv *d, CUresult r, const char *what)
{
    const char *name = NULL;

    if (d->cuGetErrorName(r, &name) != CUDA_SUCCESS || !name)
        name = "an unknown CUDA error";
    log_warn("gpu", what, LF_S("cuda", name), LF_I("code", (int)r));
    switch (r) {
    case CUDA_ERROR_NO_DEVICE:
    case CUDA_ERROR_INVALID_DEVICE:
        return -ENXIO;
    case CUDA_ERROR_OUT_OF_MEMORY:
        return -ENOMEM;
    case CUDA_ERROR_NOT_SUPPORTED:
        return -EOPNOTSUPP;
    case CUDA_ERROR_INVALID_VALUE:
        return -EINVAL;
    default:
        return -EIO;
    }
}

int cudrv_open(struct cudrv **out)
{
    struct cudrv *d;
    CUresult r;
    int rc;

    d = calloc(1, sizeof(*d));
    if (!d)
        return -ENOMEM;
    /* Never unloaded: a driver initialised once keeps threads and state
     * that do not survive dlclose. */
    d->lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE);
    if (!d->lib) {
        log_info("gpu", "The CUDA driver library could not be loaded.", LF_S("dlerror", dlerror()));
        rc = -ELIBACC;
        goto free_d;
    }
    /* A driver older than the headers lacks some entry point: that is
     * "no usable driver", not a crash at the first call. */
#define CUDRV_LOAD(name)                                                          \
    *(void **)&d->name = dlsym(d->lib, XSTR(name));                               \
    if (!d->name) {                                                               \
        log_warn("gpu", "The CUDA driver lacks an entry point cohort needs; it is too old.", \
                 LF_S("symbol", XSTR(name)));                                     \
        rc = -ELIBACC;                                                            \
        goto close_lib;                                                           \
    }
    CUDRV_CALLS(CUDRV_LOAD)
#undef CUDRV_LOAD
    r = d->cuInit(0);
    if (r != CUDA_SUCCESS) {
        rc = cudrv_fail(d, r, "The CUDA driver could not be initialised.");
        /* The toolkit's stub library, or a kernel module that does not
         * match the library: there is no working driver. */
        if (r == CUDA_ERROR_STUB_LIBRARY ||
            r == CUDA_ERROR_SYSTEM_DRIVER_MISMATCH || r == CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE)
            rc = -ELIBACC;
        else if (rc != -ENXIO)
            rc = -EIO;
        goto close_lib;
    }
    *out = d;
    return 0;
close_lib:
    dlclose(d->lib);
free_d:
    free(d);
    return rc;
}

void cudrv_close(struct cudrv *d)
{
    if (!d)
        return;
    dlclose(d->lib);
    free(d);
}

int cudrv_list(struct cudrv *d, struct gpuid *ids, size_t max)
{
    int count = 0;
    CUresult r;

    r = d->cuDeviceGetCount(&count);
    if (r != CUDA_SUCCESS)
        return cudrv_fail(d, r, "The CUDA driver could not count its devices.");
    if (count < 0)
        return -EIO;
    if ((size_t)count > max)
        count = (int)max;
    for (int i = 0; i < count; i++) {
        CUdevice dev;
        CUuuid u;
        r = d->cuDeviceGet(&dev, i);
        if (r == CUDA_SUCCESS)
            r = d->cuDeviceGetUuid(&u, dev);
        if (r != CUDA_SUCCESS)
            return cudrv_fail(d, r, "The CUDA driver could not name one of its devices.");
        _Static_assert(sizeof(u.bytes) == GPUID_BYTES, "a CUuuid is 16 bytes");
        for (int k = 0; k < GPUID_BYTES; k++)
            ids[i].b[k] = (uint8_t)u.bytes[k];
    }
    return count;
}

#else /* no GPU support in this build */

bool cudrv_built(void)
{
    return false;
}

int cudrv_open(struct cudrv **out)
{
    (void)out;
    return -EOPNOTSUPP;
}

void cudrv_close(struct cudrv *d)
{
    (void)d;
}

int cudrv_list(struct cudrv *d, struct gpuid *ids, size_t max)
{
    return -EOPNOTSUPP;
}
#endif

int cudrv_find(struct cudrv *d, const struct gpuid *id, int *ordinal)
{
    struct gpuid ids[CUDRV_DEVICES_MAX];
    int n = cudrv_list(d, ids, CUDRV_DEVICES_MAX), i;

    if (n < 0)
        return n;
    i = gpuid_find(ids, (size_t)n, id);
    if (i == -ENODEV)
        return -ENXIO;
    if (i < 0)
        return -EIO;            /* one UUID listed twice: trust neither */
    *ordinal = i;
    return 0;
}

int cudrv_check(const struct gpuid *id, const char **why)
{
    struct cudrv *d = NULL;
    int ordinal, rc;

    rc = cudrv_open(&d);
    if (rc == -ENXIO) {
        *why = "The CUDA driver sees no device at all.";
        return rc;
    }
    if (rc == 0) {
        rc = cudrv_find(d, id, &ordinal);
        cudrv_close(d);
    }
    switch (rc) {
    case 0:
        *why = "The device is present and the driver can reach it.";
        break;
    case -EOPNOTSUPP:
        *why = "This build has no GPU support: it was compiled without CUDA's and NCCL's headers.";
        break;
    case -ELIBACC:
        *why = "No usable CUDA driver: libcuda.so.1 could not be loaded, or lacks what cohort needs.";
        break;
    case -ENXIO:
        *why = "No device with this UUID is visible to this process.";
        break;
    default:
        *why = "The CUDA driver failed; its own message is logged above.";
        break;
    }
    return rc;
}

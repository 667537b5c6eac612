/* src/accumulator/gpusess.c: see gpusess.h. */
#include "accumulator/gpusess.h"

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "accumulator/devred.h"
#include "accumulator/tlink.h"
#include "engine/dtype.h"
#include "gpu/cudrv.h"
#include "gpu/gpuid.h"
#include "gpu/stage.h"
#include "gpu/vmm.h"

struct gpusess {
    struct cudrv *d;
    struct vmm_region *region;
    struct vmm_region *scratch;         /* an NCCL step's result, or NULL */
    int ordinal;
    enum ncomm_type type;
    bool nccl_type;                     /* the gradients' type is one NCCL reduces */
    struct stage *stage;
    pthread_mutex_t lock;       /* one copy at a time through the stage */
    size_t bytes;               /* of the gradients, and of the results */
    size_t count;               /* elements of the gradients */
    uint64_t grads_off, results_off;    /* in the region */
    void *host_grads, *host_results;    /* in the memfd */
};

/* True when [off, off + len) lies inside [0, size) without wrapping. */
static bool inside(uint64_t off, uint64_t len, uint64_t size)
{
    return off <= size && len <= size - off;
}

int gpusess_check_layout(const struct tlink_register *r)
{
    uint64_t gbytes;

    if (r->mem != TL_MEM_CUDA_VMM || !dtype_valid((int)r->grad_dtype) || r->grad_count == 0 ||
        r->device_bytes == 0)
        return -EINVAL;
    if (r->grad_count > UINT64_MAX / 8)
        return -EINVAL;
    gbytes = r->grad_count * dtype_size((enum dtype)r->grad_dtype);
    if ((r->device_grads_off | r->device_results_off) % 64 != 0)
        return -EINVAL;
    if (!inside(r->device_grads_off, gbytes, r->device_bytes) ||
        !inside(r->device_results_off, gbytes, r->device_bytes))
        return -EINVAL;
    /* The same area, or apart: a partial overlap is no layout cohort makes. */
    if (r->device_results_off != r->device_grads_off &&
        r->device_results_off < r->device_grads_off + gbytes &&
        r->device_grads_off < r->device_results_off + gbytes)
        return -EINVAL;
    return 0;
}

int gpusess_open(const struct tlink_register *r, int devfd, void *host_grads,
                 void *host_results, struct gpusess **out)
{
    struct gpusess *g;
    struct gpuid id;
    int ordinal, rc;

    rc = gpusess_check_layout(r);
    if (rc < 0)
        return rc;
    g = calloc(1, sizeof(*g));
    if (!g)
        return -ENOMEM;
    pthread_mutex_init(&g->lock, NULL);
    g->bytes = (size_t)(r->grad_count * dtype_size((enum dtype)r->grad_dtype));
    g->count = (size_t)r->grad_count;
    /* NCCL reduces the floating-point types cohort's gradients come in;
     * any other leaves the session host-staged (gpusess_device_mem). */
    g->nccl_type = true;
    switch ((enum dtype)r->grad_dtype) {
    case DTYPE_F32: g->type = NCOMM_F32; break;
    case DTYPE_F64: g->type = NCOMM_F64; break;
    case DTYPE_F16: g->type = NCOMM_F16; break;
    case DTYPE_BF16: g->type = NCOMM_BF16; break;
    default: g->nccl_type = false; break;
    }
    g->grads_off = r->device_grads_off;
    g->results_off = r->device_results_off;
    g->host_grads = host_grads;
    g->host_results = host_results;
    rc = cudrv_open(&g->d);
    if (rc < 0)
        goto fail;
    memcpy(id.b, r->cuda_uuid, GPUID_BYTES);
    rc = cudrv_find(g->d, &id, &ordinal);
    if (rc < 0)
        goto fail;
    g->ordinal = ordinal;
    /* The size is the exporter's, whole granules of this device; import
     * refuses any other, so a trainer cannot make us map past its
     * allocation. */
    if (r->device_bytes > SIZE_MAX) {
        rc = -EINVAL;
        goto fail;
    }
    rc = vmm_import(g->d, ordinal, devfd, (size_t)r->device_bytes, &g->region);
    if (rc < 0)
        goto fail;
    rc = stage_open(g->d, g->region, 0, &g->stage);
    if (rc < 0)
        goto fail;
    *out = g;
    return 0;
fail:
    gpusess_close(g);
    return rc;
}

int gpusess_gather(struct gpusess *g)
{
    int rc;

    pthread_mutex_lock(&g->lock);
    rc = stage_down(g->stage, g->grads_off, g->host_grads, g->bytes);
    pthread_mutex_unlock(&g->lock);
    return rc;
}

int gpusess_scatter(struct gpusess *g)
{
    int rc;

    pthread_mutex_lock(&g->lock);
    rc = stage_up(g->stage, g->results_off, g->host_results, g->bytes);
    pthread_mutex_unlock(&g->lock);
    return rc;
}

int gpusess_zero_grads(struct gpusess *g)
{
    int rc;

    pthread_mutex_lock(&g->lock);
    rc = vmm_zero(g->region, (size_t)g->grads_off, g->bytes);
    pthread_mutex_unlock(&g->lock);
    return rc;
}

static int mem_gather(void *arg)
{
    return gpusess_gather(arg);
}

static int mem_enter(void *arg)
{
    struct gpusess *g = arg;

    return vmm_enter(g->region);
}

static int mem_zero_scratch(void *arg)
{
    struct gpusess *g = arg;

    return g->scratch ? vmm_zero(g->scratch, 0, g->bytes) : -EINVAL;
}

static int mem_to_scratch(void *arg, const void *src, size_t len)
{
    struct gpusess *g = arg;

    int rc = g->scratch ? vmm_write(g->scratch, 0, src, len) : -EINVAL;

    /* From pageable memory cuMemcpyHtoD may return before its DMA is
     * done, and NCCL reads on a stream that does not wait for it. */
    return rc < 0 ? rc : vmm_sync(g->scratch);
}

static int mem_from_scratch(void *arg, void *dst, size_t len)
{
    struct gpusess *g = arg;

    return g->scratch ? vmm_read(g->scratch, 0, dst, len) : -EINVAL;
}

int gpusess_device_mem(struct gpusess *g, bool with_scratch, struct devred_mem *mem)
{
    int fd = -1, rc;

    /* The calls first: a host-staged session needs them too. */
    *mem = (struct devred_mem){
        .grads = vmm_addr(g->region) + g->grads_off, .count = g->count, .type = g->type,
        .stream = stage_stream(g->stage), .gather = mem_gather, .enter = mem_enter,
        .zero_scratch = mem_zero_scratch, .to_scratch = mem_to_scratch,
        .from_scratch = mem_from_scratch, .arg = g,
    };
    if (!g->nccl_type)
        return -EOPNOTSUPP;
    if (!with_scratch)
        return 0;
    if (!g->scratch) {
        /* A region of our own; its descriptor is never sent anywhere. */
        rc = vmm_export(g->d, g->ordinal, g->bytes, &g->scratch, &fd);
        if (rc < 0)
            return rc;
        close(fd);
    }
    mem->scratch = vmm_addr(g->scratch);
    mem->scratch_bytes = g->bytes;
    return 0;
}

int gpusess_publish_scratch(struct gpusess *g)
{
    int rc;

    pthread_mutex_lock(&g->lock);
    rc = g->scratch ? vmm_copy_in(g->region, (size_t)g->results_off, vmm_addr(g->scratch), g->bytes)
                    : -EINVAL;
    pthread_mutex_unlock(&g->lock);
    return rc;
}

void gpusess_close(struct gpusess *g)
{
    if (!g)
        return;
    /* The stage first: it drains its stream, which reads the region. */
    stage_close(g->stage);
    vmm_destroy(g->scratch);
    vmm_destroy(g->region);
    cudrv_close(g->d);
    pthread_mutex_destroy(&g->lock);
    free(g);
}

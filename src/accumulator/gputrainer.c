/* src/accumulator/gputrainer.c: see gputrainer.h. */
#include "accumulator/gputrainer.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "accumulator/tlink.h"
#include "gpu/cudrv.h"
#include "gpu/gpuid.h"
#include "gpu/vmm.h"

/* Where each part starts in the region: the alignment cudaMalloc gives,
 * which every kernel on a tensor of any dtype may assume. */
#define PART_ALIGN 256u

struct gputrainer {
    struct cudrv *d;
    struct vmm_region *region;
    int fd;
    size_t bytes;               /* of the gradients, at 0; the region may be larger */
    size_t params_off, params_bytes;
    size_t buffers_off, buffers_bytes;
    struct gpuid id;
};

static size_t part_end(size_t off, size_t len)
{
    return (off + len + PART_ALIGN - 1) / PART_ALIGN * PART_ALIGN;
}

int gputrainer_open(const char *uuid, size_t bytes, size_t params_bytes, size_t buffers_bytes,
                    struct gputrainer **out)
{
    struct gputrainer *g;
    int ordinal, rc;

    /* The callers' sizes are far below SIZE_MAX (cohort.c's REGION_MAX),
     * so the sums below cannot wrap. */
    if (!uuid || bytes == 0)
        return -EINVAL;
    g = calloc(1, sizeof(*g));
    if (!g)
        return -ENOMEM;
    g->fd = -1;
    g->bytes = bytes;
    g->params_off = part_end(0, bytes);
    g->params_bytes = params_bytes;
    g->buffers_off = part_end(g->params_off, params_bytes);
    g->buffers_bytes = buffers_bytes;
    rc = gpuid_parse(uuid, &g->id);
    if (rc < 0) {
        rc = -EINVAL;
        goto fail;
    }
    rc = cudrv_open(&g->d);
    if (rc < 0)
        goto fail;
    rc = cudrv_find(g->d, &g->id, &ordinal);
    if (rc < 0)
        goto fail;
    rc = vmm_export(g->d, ordinal, g->buffers_off + buffers_bytes, &g->region, &g->fd);
    if (rc < 0)
        goto fail;
    /* cuMemCreate's memory holds whatever was there before. */
    rc = vmm_zero(g->region, 0, g->buffers_off + buffers_bytes);
    if (rc < 0)
        goto fail;
    *out = g;
    return 0;
fail:
    gputrainer_close(g);
    return rc;
}

void gputrainer_close(struct gputrainer *g)
{
    if (!g)
        return;
    if (g->fd >= 0)
        close(g->fd);
    vmm_destroy(g->region);
    cudrv_close(g->d);
    free(g);
}

void gputrainer_describe(const struct gputrainer *g, struct tlink_register *r)
{
    r->mem = TL_MEM_CUDA_VMM;
    memset(r->cuda_handle, 0, sizeof(r->cuda_handle));
    memcpy(r->cuda_uuid, g->id.b, GPUID_BYTES);
    r->device_bytes = vmm_bytes(g->region);
    r->device_grads_off = 0;
    r->device_results_off = 0;
}

int gputrainer_fd(const struct gputrainer *g)
{
    return g->fd;
}

uint64_t gputrainer_addr(const struct gputrainer *g)
{
    return vmm_addr(g->region);
}

uint64_t gputrainer_params_addr(const struct gputrainer *g)
{
    return vmm_addr(g->region) + g->params_off;
}

uint64_t gputrainer_buffers_addr(const struct gputrainer *g)
{
    return vmm_addr(g->region) + g->buffers_off;
}

/* The trainer's queued work on them first: it may still be writing the
 * parameters on a stream of its own (an optimizer step), which the
 * synchronous copy would not wait for. */
int gputrainer_state_out(struct gputrainer *g, void *params, void *buffers)
{
    int rc = vmm_sync(g->region);

    if (rc == 0 && g->params_bytes)
        rc = vmm_read(g->region, g->params_off, params, g->params_bytes);
    if (rc == 0 && g->buffers_bytes)
        rc = vmm_read(g->region, g->buffers_off, buffers, g->buffers_bytes);
    return rc;
}

/* A copy from pageable memory may return before it reaches the device;
 * the synchronisation after makes it visible to every stream. */
int gputrainer_state_in(struct gputrainer *g, const void *params, const void *buffers)
{
    int rc = 0;

    if (g->params_bytes)
        rc = vmm_write(g->region, g->params_off, params, g->params_bytes);
    if (rc == 0 && g->buffers_bytes)
        rc = vmm_write(g->region, g->buffers_off, buffers, g->buffers_bytes);
    return rc == 0 ? vmm_sync(g->region) : rc;
}

int gputrainer_sync(struct gputrainer *g)
{
    return vmm_sync(g->region);
}

int gputrainer_zero(struct gputrainer *g)
{
    return vmm_zero(g->region, 0, g->bytes);
}

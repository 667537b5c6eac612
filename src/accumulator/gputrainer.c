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

struct gputrainer {
    struct cudrv *d;
    struct vmm_region *region;
    int fd;
    size_t bytes;               /* of the gradients; the region may be larger */
    struct gpuid id;
};

int gputrainer_open(const char *uuid, size_t bytes, struct gputrainer **out)
{
    struct gputrainer *g;
    int ordinal, rc;

    if (!uuid || bytes == 0)
        return -EINVAL;
    g = calloc(1, sizeof(*g));
    if (!g)
        return -ENOMEM;
    g->fd = -1;
    g->bytes = bytes;
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
    rc = vmm_export(g->d, ordinal, bytes, &g->region, &g->fd);
    if (rc < 0)
        goto fail;
    /* cuMemCreate's memory holds whatever was there before. */
    rc = vmm_zero(g->region, 0, bytes);
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

int gputrainer_sync(struct gputrainer *g)
{
    return vmm_sync(g->region);
}

int gputrainer_zero(struct gputrainer *g)
{
    return vmm_zero(g->region, 0, g->bytes);
}

/* src/gpu/stage.c: see stage.h. */
#include "gpu/stage.h"

#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/cudrv.h"
#include "gpu/cudrv_fns.h"
#include "gpu/vmm.h"

#ifdef COHORT_GPU

struct stage {
    struct cudrv *d;            /* borrowed */
    struct vmm_region *r;       /* borrowed */
    size_t segment;
    CUstream stream;
    CUevent ev[2];              /* behind the last copy through bounce[i] */
    void *bounce[2];            /* pinned host memory, `segment` bytes each */
    size_t segments;
};

int stage_open(struct cudrv *d, struct vmm_region *r, size_t segment, struct stage **out)
{
    struct stage *s;
    CUresult e = CUDA_SUCCESS;
    int rc;

    if (segment == 0)
        segment = STAGE_SEGMENT_DEFAULT;
    if (segment > STAGE_SEGMENT_MAX)
        return -EINVAL;
    s = calloc(1, sizeof(*s));
    if (!s)
        return -ENOMEM;
    s->d = d;
    s->r = r;
    s->segment = segment;
    rc = vmm_enter(r);
    if (rc < 0)
        goto fail;
    /* Non-blocking: the trainer's work on the legacy default stream of
     * its own process is not ordered with ours anyway, and this stream
     * must not wait for anything else in the sidecar's context. */
    e = d->cuStreamCreate(&s->stream, CU_STREAM_NON_BLOCKING);
    if (e != CUDA_SUCCESS)
        goto driver;
    for (int i = 0; i < 2; i++) {
        e = d->cuEventCreate(&s->ev[i], CU_EVENT_DISABLE_TIMING);
        if (e != CUDA_SUCCESS)
            goto driver;
        e = d->cuMemAllocHost(&s->bounce[i], segment);
        if (e != CUDA_SUCCESS)
            goto driver;
    }
    *out = s;
    return 0;
driver:
    rc = cudrv_fail(d, e, "The staging stream, events or pinned buffers could not be made.");
fail:
    stage_close(s);
    return rc;
}

void stage_close(struct stage *s)
{
    if (!s)
        return;
    if (vmm_enter(s->r) == 0 && s->stream)
        s->d->cuStreamSynchronize(s->stream);
    for (int i = 0; i < 2; i++) {
        if (s->bounce[i])
            s->d->cuMemFreeHost(s->bounce[i]);
        if (s->ev[i])
            s->d->cuEventDestroy(s->ev[i]);
    }
    if (s->stream)
        s->d->cuStreamDestroy(s->stream);
    free(s);
}

static bool in_region(const struct stage *s, size_t off, size_t len)
{
    size_t n = vmm_bytes(s->r);

    return off <= n && len <= n - off;
}

/* Segment k of a copy of len bytes: its offset and length. */
static size_t seg_len(const struct stage *s, size_t len, size_t k)
{
    size_t off = k * s->segment;

    return len - off < s->segment ? len - off : s->segment;
}

int stage_down(struct stage *s, size_t dev_off, void *dst, size_t len)
{
    CUdeviceptr base = (CUdeviceptr)vmm_addr(s->r) + dev_off;
    size_t n, k;
    CUresult e;
    int rc;

    if (!in_region(s, dev_off, len))
        return -EINVAL;
    if (len == 0)
        return 0;
    rc = vmm_enter(s->r);
    if (rc < 0)
        return rc;
    n = (len + s->segment - 1) / s->segment;
    /* Segment k goes to the device's copy engine; meanwhile the CPU moves
     * segment k - 1 out of the other bounce buffer, once its event says
     * the engine wrote it. */
    for (k = 0; k <= n; k++) {
        if (k < n) {
            size_t b = k % 2;
            e = s->d->cuMemcpyDtoHAsync(s->bounce[b], base + k * s->segment, seg_len(s, len, k),
                                        s->stream);
            if (e == CUDA_SUCCESS)
                e = s->d->cuEventRecord(s->ev[b], s->stream);
            if (e != CUDA_SUCCESS)
                goto driver;
        }
        if (k > 0) {
            size_t p = (k - 1) % 2;
            e = s->d->cuEventSynchronize(s->ev[p]);
            if (e != CUDA_SUCCESS)
                goto driver;
            memcpy((char *)dst + (k - 1) * s->segment, s->bounce[p], seg_len(s, len, k - 1));
            s->segments++;
        }
    }
    return 0;
driver:
    rc = cudrv_fail(s->d, e, "GPU memory could not be staged to the host.");
    /* Nothing of ours may still be writing a bounce buffer when the next
     * call reuses it. */
    s->d->cuStreamSynchronize(s->stream);
    return rc;
}

int stage_up(struct stage *s, size_t dev_off, const void *src, size_t len)
{
    CUdeviceptr base = (CUdeviceptr)vmm_addr(s->r) + dev_off;
    size_t n, k;
    CUresult e;
    int rc;

    if (!in_region(s, dev_off, len))
        return -EINVAL;
    if (len == 0)
        return 0;
    rc = vmm_enter(s->r);
    if (rc < 0)
        return rc;
    n = (len + s->segment - 1) / s->segment;
    /* The CPU fills one bounce buffer while the engine drains the other;
     * a buffer is refilled only once the copy that read it has finished. */
    for (k = 0; k < n; k++) {
        size_t b = k % 2, m = seg_len(s, len, k);
        if (k >= 2) {
            e = s->d->cuEventSynchronize(s->ev[b]);
            if (e != CUDA_SUCCESS)
                goto driver;
        }
        memcpy(s->bounce[b], (const char *)src + k * s->segment, m);
        e = s->d->cuMemcpyHtoDAsync(base + k * s->segment, s->bounce[b], m, s->stream);
        if (e == CUDA_SUCCESS)
            e = s->d->cuEventRecord(s->ev[b], s->stream);
        if (e != CUDA_SUCCESS)
            goto driver;
        s->segments++;
    }
    e = s->d->cuStreamSynchronize(s->stream);
    if (e != CUDA_SUCCESS)
        goto driver;
    return 0;
driver:
    rc = cudrv_fail(s->d, e, "Host memory could not be staged to the GPU.");
    s->d->cuStreamSynchronize(s->stream);
    return rc;
}

void *stage_stream(const struct stage *s)
{
    return s->stream;
}

size_t stage_segments(const struct stage *s)
{
    return s->segments;
}

#else /* no GPU support in this build */

struct stage {
    size_t segments;
};

int stage_open(struct cudrv *d, struct vmm_region *r, size_t segment, struct stage **out)
{
    return -EOPNOTSUPP;
}

void stage_close(struct stage *s)
{
    free(s);
}

int stage_down(struct stage *s, size_t dev_off, void *dst, size_t len)
{
    return -EOPNOTSUPP;
}

int stage_up(struct stage *s, size_t dev_off, const void *src, size_t len)
{
    return -EOPNOTSUPP;
}

void *stage_stream(const struct stage *s)
{
    return NULL;
}

size_t stage_segments(const struct stage *s)
{
    return s ? s->segments : 0;
}
#endif

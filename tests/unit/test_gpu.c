/* tests/unit/test_gpu.c: what src/gpu/ does without a GPU, in whichever
 * build this is: the refusals and their causes, NCCL loaded or refused,
 * and the granularity arithmetic of device regions. With GPU support
 * compiled in, the driver is loaded for real; on a machine without one
 * that is the "no CUDA driver" path. */
#include <criterion/criterion.h>

#include <errno.h>
#include <stdint.h>
#include <string.h>

#include "accumulator/tlink.h"
#include "accumulator/gpusess.h"
#include "cohort.h"
#include "accumulator/trainerd.h"
#include "accumulator/viewpage.h"
#include "base/clock.h"
#include "fixture.h"
#include "gpu/cudrv.h"
#include "gpu/gpuid.h"
#include "gpu/nccllib.h"
#include "gpu/ncomm.h"
#include "gpu/stage.h"
#include "gpu/vmm.h"

static bool a_refusal(int rc)
{
    return rc == -EOPNOTSUPP || rc == -ELIBACC || rc == -ENXIO;
}

Test(gpu, the_driver_opens_or_says_why_not)
{
    struct cudrv *d = NULL;
    int rc = cudrv_open(&d);

    if (!cudrv_built())
        cr_assert_eq(rc, -EOPNOTSUPP, "no GPU support in this build");
    else
        cr_assert(rc == 0 || rc == -ELIBACC || rc == -ENXIO, "%d", rc);
    cudrv_close(d);
}

Test(gpu, every_cause_has_its_sentence)
{
    struct gpuid id;
    const char *why = NULL;
    int rc;

    cr_assert_eq(gpuid_parse("GPU-00000000-0000-0000-0000-000000000000", &id), 0);
    rc = cudrv_check(&id, &why);
    cr_assert_not_null(why);
    if (!cudrv_built()) {
        cr_assert_eq(rc, -EOPNOTSUPP);
        cr_assert(strstr(why, "no GPU support"), "%s", why);
    } else if (rc == -ELIBACC) {
        cr_assert(strstr(why, "No usable CUDA driver"), "%s", why);
    } else {
        /* A driver, but no device has the all-zero UUID, or none at all. */
        cr_assert_eq(rc, -ENXIO);
        cr_assert(strstr(why, "No device with this UUID") || strstr(why, "no device at all"), "%s", why);
    }
}

Test(gpu, a_gpu_registration_is_refused_with_its_cause)
{
    struct tlink_register r;
    const char *why = NULL, *direct = NULL;
    struct gpuid id;
    int rc;

    memset(&r, 0, sizeof(r));
    r.mem = TL_MEM_CUDA_IPC;
    cr_assert_eq(trainerd_check_gpu(&r, &why), -EOPNOTSUPP, "a legacy handle, in any build");
    cr_assert(strstr(why, "Legacy CUDA IPC"), "%s", why);
    r.mem = 77;
    cr_assert_eq(trainerd_check_gpu(&r, &why), -EOPNOTSUPP, "an unknown kind");
    r.mem = TL_MEM_CUDA_VMM;
    cr_assert_eq(gpuid_parse("GPU-1f3a5c7e-0b2d-4e6f-8091-a2b3c4d5e6f7", &id), 0);
    memcpy(r.cuda_uuid, id.b, GPUID_BYTES);
    rc = trainerd_check_gpu(&r, &why);
    cr_assert(a_refusal(rc), "%d", rc);
    cr_assert_eq(rc, cudrv_check(&id, &direct), "the driver's own answer, as the trainer's code");
    cr_assert_str_eq(why, direct);
    /* The layout check, pure, takes a GPU registration's memfd as host
     * memory's and refuses any other kind whatever the device. */
    cr_assert_eq(trainerd_check_layout(&r, 0), -EINVAL);
    r.mem = TL_MEM_CUDA_IPC;
    cr_assert_eq(trainerd_check_layout(&r, 0), -EOPNOTSUPP);
}

Test(gpu, nccl_loads_with_or_without_shrink_or_says_why_not)
{
    const struct ncomm_ops *ops = NULL;
    int rc = nccllib_load(&ops);

    if (!cudrv_built()) {
        cr_assert_eq(rc, -EOPNOTSUPP);
        cr_assert_eq(nccllib_version(), 0);
        return;
    }
    if (rc == -ELIBACC) {
        cr_assert_eq(nccllib_version(), 0);
        return;
    }
    cr_assert_eq(rc, 0);
    cr_assert_geq(nccllib_version(), 21400);
    cr_assert_not_null(ops->get_unique_id);
    cr_assert_not_null(ops->init_rank);
    cr_assert_not_null(ops->async_error);
    cr_assert_not_null(ops->abort);
    cr_assert_eq(ops->shrink != NULL, nccllib_version() >= 22700,
                 "ncclCommShrink exactly where NCCL has it (2.27)");
    cr_assert_eq(nccllib_load(&ops), 0, "loaded once, the same answer after");
}

Test(gpu, regions_are_whole_granules)
{
    const size_t g = 2u << 20;

    cr_assert_eq(vmm_round(1, g), g);
    cr_assert_eq(vmm_round(g, g), g);
    cr_assert_eq(vmm_round(g + 1, g), 2 * g);
    cr_assert_eq(vmm_round(3000, 1000), 3000, "not only powers of two");
    cr_assert_eq(vmm_round(0, g), 0);
    cr_assert_eq(vmm_round(5, 0), 0);
    cr_assert_eq(vmm_round(SIZE_MAX - 5, g), 0, "would wrap");
}

Test(gpu, regions_are_refused_without_gpu_support)
{
    struct vmm_region *r = NULL;
    int fd = -1;

    if (cudrv_built())
        return;     /* the real calls need a device: make test-gpu */
    cr_assert_eq(vmm_export(NULL, 0, 4096, &r, &fd), -EOPNOTSUPP);
    cr_assert_eq(vmm_import(NULL, 0, 0, 4096, &r), -EOPNOTSUPP);
    cr_assert_null(r);
    cr_assert_eq(fd, -1);
}

/* ---- the driver paths, against tests/gpu/fake_cuda.c ----
 *
 * tests/proc/test_gpu_driver.py runs this suite with the stand-in driver
 * first on the library path and COHORT_FAKE_CUDA=1; elsewhere it skips. */

#include <dlfcn.h>
#include <stdlib.h>
#include <unistd.h>

#define DEV_A "GPU-1f3a5c7e-0b2d-4e6f-8091-a2b3c4d5e6f7"
#define DEV_B "GPU-00000000-0000-0000-0000-0000000000b2"

static const char *(*fake_log)(void);
static int (*fake_live)(void);

/* Opens the driver (the stand-in) with devices A and B. */
static struct cudrv *fake_driver(void)
{
    struct cudrv *d = NULL;
    void *h;

    if (!getenv("COHORT_FAKE_CUDA"))
        cr_skip_test("run by tests/proc/test_gpu_driver.py against the stand-in driver");
    cr_assert(cudrv_built(), "the stand-in is only built with GPU support");
    setenv("COHORT_FAKE_CUDA_DEVICES", DEV_A "," DEV_B, 1);
    cr_assert_eq(cudrv_open(&d), 0);
    h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    cr_assert_not_null(h, "the driver cohort loaded is the stand-in");
    *(void **)&fake_log = dlsym(h, "fake_cuda_log");
    *(void **)&fake_live = dlsym(h, "fake_cuda_live");
    cr_assert(fake_log && fake_live, "the stand-in's own calls");
    dlclose(h);
    return d;
}

Test(gpu_driver, devices_are_found_by_uuid)
{
    struct cudrv *d = fake_driver();
    struct gpuid ids[CUDRV_DEVICES_MAX], a, b, c;
    char text[GPUID_TEXT_MAX];
    int ordinal = -1;

    cr_assert_eq(gpuid_parse(DEV_A, &a), 0);
    cr_assert_eq(gpuid_parse(DEV_B, &b), 0);
    cr_assert_eq(gpuid_parse("GPU-00000000-0000-0000-0000-00000000000c", &c), 0);
    cr_assert_eq(cudrv_list(d, ids, CUDRV_DEVICES_MAX), 2);
    cr_assert_str_eq(gpuid_format(&ids[1], text, sizeof(text)), DEV_B);
    cr_assert_eq(cudrv_list(d, ids, 1), 1, "no more than asked for");
    cr_assert_eq(cudrv_find(d, &b, &ordinal), 0);
    cr_assert_eq(ordinal, 1);
    cr_assert_eq(cudrv_find(d, &c, &ordinal), -ENXIO);
    /* The other container sees B alone, as its device 0. */
    setenv("COHORT_FAKE_CUDA_DEVICES", DEV_B, 1);
    cr_assert_eq(cudrv_find(d, &b, &ordinal), 0);
    cr_assert_eq(ordinal, 0);
    cr_assert_eq(cudrv_find(d, &a, &ordinal), -ENXIO);
    cudrv_close(d);
}

Test(gpu_driver, each_refusal_has_its_cause)
{
    struct cudrv *d = fake_driver();
    struct tlink_register r;
    struct gpuid a, c;
    const char *why;

    cudrv_close(d);
    cr_assert_eq(gpuid_parse(DEV_A, &a), 0);
    cr_assert_eq(gpuid_parse("GPU-00000000-0000-0000-0000-00000000000c", &c), 0);
    memset(&r, 0, sizeof(r));
    r.mem = TL_MEM_CUDA_VMM;
    memcpy(r.cuda_uuid, c.b, GPUID_BYTES);
    cr_assert_eq(trainerd_check_gpu(&r, &why), -ENXIO, "no device with that UUID");
    cr_assert(strstr(why, "No device with this UUID"), "%s", why);
    memcpy(r.cuda_uuid, a.b, GPUID_BYTES);
    cr_assert_eq(trainerd_check_gpu(&r, &why), 0, "present: served host-staged");
    cr_assert(strstr(why, "served host-staged"), "%s", why);
    setenv("COHORT_FAKE_CUDA_INIT", "nodev", 1);
    cr_assert_eq(cudrv_open(&d), -ENXIO, "a driver without devices");
    cr_assert_eq(trainerd_check_gpu(&r, &why), -ENXIO);
    cr_assert(strstr(why, "no device at all"), "%s", why);
    setenv("COHORT_FAKE_CUDA_INIT", "stub", 1);
    cr_assert_eq(cudrv_open(&d), -ELIBACC, "the toolkit's stub is no driver");
    cr_assert_eq(trainerd_check_gpu(&r, &why), -ELIBACC);
    cr_assert(strstr(why, "No usable CUDA driver"), "%s", why);
    unsetenv("COHORT_FAKE_CUDA_INIT");
    setenv("COHORT_FAKE_CUDA_FAIL", "cuInit", 1);
    cr_assert_eq(cudrv_open(&d), -EIO, "any other failure");
    cr_assert_eq(trainerd_check_gpu(&r, &why), -EIO);
}

Test(gpu_driver, a_region_is_exported_and_imported_in_the_samples_order)
{
    struct cudrv *d = fake_driver();
    struct vmm_region *out = NULL, *in = NULL;
    uint8_t w[64], rd[64];
    int fd = -1;
    const char *start;

    start = fake_log() + strlen(fake_log());
    cr_assert_eq(vmm_export(d, 1, 3u << 20, &out, &fd), 0);
    cr_assert_str_eq(start,
                     "cuDeviceGet cuDevicePrimaryCtxRetain cuCtxSetCurrent "
                     "cuMemGetAllocationGranularity cuMemCreate cuMemAddressReserve cuMemMap "
                     "cuMemSetAccess cuMemExportToShareableHandle ");
    cr_assert_eq(vmm_bytes(out), 4u << 20, "rounded up to whole granules");
    cr_assert_eq(vmm_import(d, 1, fd, (3u << 20) + 1, &in), -EINVAL, "not whole granules");
    start = fake_log() + strlen(fake_log());
    cr_assert_eq(vmm_import(d, 1, fd, vmm_bytes(out), &in), 0);
    cr_assert_str_eq(start,
                     "cuDeviceGet cuDevicePrimaryCtxRetain cuCtxSetCurrent "
                     "cuMemGetAllocationGranularity cuMemImportFromShareableHandle "
                     "cuMemAddressReserve cuMemMap cuMemSetAccess ");
    close(fd);                          /* the mapping does not need it */
    cr_assert_neq(vmm_addr(in), vmm_addr(out));
    for (size_t i = 0; i < sizeof(w); i++)
        w[i] = (uint8_t)(i * 7 + 1);
    cr_assert_eq(vmm_write(out, vmm_bytes(out) - sizeof(w), w, sizeof(w)), 0);
    cr_assert_eq(vmm_read(in, vmm_bytes(in) - sizeof(rd), rd, sizeof(rd)), 0);
    cr_assert_arr_eq(rd, w, sizeof(w), "one memory, two mappings");
    cr_assert_eq(vmm_write(in, vmm_bytes(in) - 8, w, 9), -EINVAL, "past the end");
    cr_assert_eq(vmm_read(in, SIZE_MAX, rd, 1), -EINVAL);
    start = fake_log() + strlen(fake_log());
    vmm_destroy(in);
    cr_assert_str_eq(start, "cuMemUnmap cuMemAddressFree cuMemRelease cuDevicePrimaryCtxRelease ");
    vmm_destroy(out);
    cr_assert_eq(fake_live(), 0, "nothing left of either");
    cudrv_close(d);
}

/* Whichever call fails, what was taken is given back, and only that. */
Test(gpu_driver, every_failing_call_unwinds_what_was_taken)
{
    static const char *const export_calls[] = {
        "cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuCtxSetCurrent",
        "cuMemGetAllocationGranularity", "cuMemCreate", "cuMemAddressReserve", "cuMemMap",
        "cuMemSetAccess", "cuMemExportToShareableHandle",
    };
    static const char *const import_calls[] = {
        "cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuCtxSetCurrent",
        "cuMemGetAllocationGranularity", "cuMemImportFromShareableHandle",
        "cuMemAddressReserve", "cuMemMap", "cuMemSetAccess",
    };
    struct cudrv *d = fake_driver();
    struct vmm_region *src = NULL, *r;
    int fd = -1, f2;

    for (size_t i = 0; i < sizeof(export_calls) / sizeof(export_calls[0]); i++) {
        r = NULL;
        f2 = -1;
        setenv("COHORT_FAKE_CUDA_FAIL", export_calls[i], 1);
        cr_assert_lt(vmm_export(d, 0, 1, &r, &f2), 0, "%s", export_calls[i]);
        cr_assert_null(r);
        cr_assert_eq(f2, -1);
        cr_assert_eq(fake_live(), 0, "after %s failed", export_calls[i]);
    }
    unsetenv("COHORT_FAKE_CUDA_FAIL");
    cr_assert_eq(vmm_export(d, 0, 1, &src, &fd), 0);
    for (size_t i = 0; i < sizeof(import_calls) / sizeof(import_calls[0]); i++) {
        int before = fake_live();
        r = NULL;
        setenv("COHORT_FAKE_CUDA_FAIL", import_calls[i], 1);
        cr_assert_lt(vmm_import(d, 0, fd, vmm_bytes(src), &r), 0, "%s", import_calls[i]);
        cr_assert_null(r);
        cr_assert_eq(fake_live(), before, "after %s failed", import_calls[i]);
    }
    unsetenv("COHORT_FAKE_CUDA_FAIL");
    close(fd);
    vmm_destroy(src);
    cr_assert_eq(fake_live(), 0);
    cudrv_close(d);
}

/* ---- the host-staged path's copies (stage.h), against the stand-in ----
 *
 * The stand-in carries out an asynchronous copy only when a
 * synchronisation covers it, so a staging loop that read a bounce buffer
 * before its event, or refilled one before the copy that reads it had
 * run, would move wrong bytes here and fail these tests. */

/* Bytes that differ between any two segments (a pseudo-random stream). */
static void pattern(uint8_t *p, size_t n, unsigned seed)
{
    uint64_t x = 0x9e3779b97f4a7c15ull * (seed + 1);

    for (size_t i = 0; i < n; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        p[i] = (uint8_t)x;
    }
}

Test(gpu_driver, staging_moves_every_segment_in_order_both_ways)
{
    struct cudrv *d = fake_driver();
    struct vmm_region *r = NULL;
    struct stage *s = NULL;
    const size_t seg = 1u << 20, len = 5 * seg + 4093, off = 4096;
    uint8_t *src = malloc(len), *back = malloc(len), *direct = malloc(len);
    const char *start, *want;
    int fd = -1;

    cr_assert(src && back && direct);
    pattern(src, len, 3);
    cr_assert_eq(vmm_export(d, 0, len + off, &r, &fd), 0);
    close(fd);
    cr_assert_eq(stage_open(d, r, seg, &s), 0);
    cr_assert_eq(stage_up(s, off, src, len), 0);
    cr_assert_eq(stage_segments(s), 6, "five whole segments and a partial one");
    cr_assert_eq(vmm_read(r, off, direct, len), 0);
    cr_assert_arr_eq(direct, src, len, "on the device when stage_up returned");
    memset(back, 0, len);
    start = fake_log() + strlen(fake_log());
    cr_assert_eq(stage_down(s, off, back, len), 0);
    cr_assert_arr_eq(back, src, len, "the same bytes back");
    cr_assert_eq(stage_segments(s), 12);
    /* Overlap: the second segment is queued before the first is waited on. */
    want = "cuCtxSetCurrent cuMemcpyDtoHAsync cuEventRecord cuMemcpyDtoHAsync cuEventRecord "
           "cuEventSynchronize ";
    cr_assert(strncmp(start, want, strlen(want)) == 0, "%s", start);
    /* Refilling with other bytes, the last segment first reaching the
     * device, shows no bounce buffer was overwritten under its copy. */
    pattern(src, len, 9);
    cr_assert_eq(stage_up(s, off, src, len), 0);
    cr_assert_eq(vmm_read(r, off, direct, len), 0);
    cr_assert_arr_eq(direct, src, len);
    /* A short copy is one segment; an empty one none. */
    cr_assert_eq(stage_down(s, off + 10, back, 100), 0);
    cr_assert_arr_eq(back, src + 10, 100);
    cr_assert_eq(stage_down(s, 0, back, 0), 0);
    cr_assert_eq(stage_segments(s), 19);
    stage_close(s);
    vmm_destroy(r);
    cr_assert_eq(fake_live(), 0, "stream, events and pinned buffers released");
    free(src);
    free(back);
    free(direct);
    cudrv_close(d);
}

Test(gpu_driver, staging_refuses_ranges_outside_the_region_and_sizes_too_large)
{
    struct cudrv *d = fake_driver();
    struct vmm_region *r = NULL;
    struct stage *s = NULL;
    uint8_t buf[64] = { 0 };
    int fd = -1;

    cr_assert_eq(vmm_export(d, 0, 1, &r, &fd), 0);
    close(fd);
    cr_assert_eq(stage_open(d, r, STAGE_SEGMENT_MAX + 1, &s), -EINVAL);
    cr_assert_null(s);
    cr_assert_eq(stage_open(d, r, 0, &s), 0);
    cr_assert_eq(stage_down(s, vmm_bytes(r) - 8, buf, 9), -EINVAL);
    cr_assert_eq(stage_up(s, vmm_bytes(r) + 1, buf, 0), -EINVAL);
    cr_assert_eq(stage_up(s, SIZE_MAX, buf, 2), -EINVAL);
    cr_assert_eq(stage_segments(s), 0, "nothing moved");
    stage_close(s);
    vmm_destroy(r);
    cr_assert_eq(fake_live(), 0);
    cudrv_close(d);
}

/* Whichever call fails, the stage gives back what it took, and a failed
 * copy is an error, not a silent short copy. */
Test(gpu_driver, staging_unwinds_every_failing_call)
{
    static const char *const open_calls[] = {
        "cuCtxSetCurrent", "cuStreamCreate", "cuEventCreate", "cuMemAllocHost",
    };
    static const char *const copy_calls[] = {
        "cuMemcpyDtoHAsync", "cuMemcpyHtoDAsync", "cuEventRecord", "cuEventSynchronize",
    };
    struct cudrv *d = fake_driver();
    struct vmm_region *r = NULL;
    struct stage *s;
    uint8_t *buf = calloc(1, 3u << 20);
    int fd = -1, live;

    cr_assert_not_null(buf);
    cr_assert_eq(vmm_export(d, 0, 3u << 20, &r, &fd), 0);
    close(fd);
    live = fake_live();
    for (size_t i = 0; i < sizeof(open_calls) / sizeof(open_calls[0]); i++) {
        s = NULL;
        setenv("COHORT_FAKE_CUDA_FAIL", open_calls[i], 1);
        cr_assert_lt(stage_open(d, r, 1u << 20, &s), 0, "%s", open_calls[i]);
        cr_assert_null(s);
        cr_assert_eq(fake_live(), live, "after %s failed", open_calls[i]);
    }
    unsetenv("COHORT_FAKE_CUDA_FAIL");
    cr_assert_eq(stage_open(d, r, 1u << 20, &s), 0);
    for (size_t i = 0; i < sizeof(copy_calls) / sizeof(copy_calls[0]); i++) {
        bool down = strcmp(copy_calls[i], "cuMemcpyHtoDAsync") != 0;
        int rc;
        setenv("COHORT_FAKE_CUDA_FAIL", copy_calls[i], 1);
        rc = down ? stage_down(s, 0, buf, 3u << 20) : stage_up(s, 0, buf, 3u << 20);
        cr_assert_eq(rc, -ENOMEM, "%s: the driver's error, mapped", copy_calls[i]);
        unsetenv("COHORT_FAKE_CUDA_FAIL");
    }
    cr_assert_eq(stage_up(s, 0, buf, 3u << 20), 0, "usable after a failure");
    stage_close(s);
    vmm_destroy(r);
    cr_assert_eq(fake_live(), 0);
    free(buf);
    cudrv_close(d);
}

/* ---- a GPU registration served host-staged, through real sidecars ----
 *
 * Two trainers, each with its gradients in a device region of the
 * stand-in, register with a sidecar of their own (trainerd, a real node,
 * a real broker, the engine on loopback): the region's descriptor crosses
 * the socket beside the memfd, the sidecar imports it by UUID, stages the
 * device's gradients to the memfd, reduces them with the other member and
 * puts the result on the device before the view says so. */

#include <fcntl.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>

#define GN (5u << 19)          /* floats: 10 MiB, three staging segments */

struct gtrainer {
    struct trainerd *sd;
    char path[128];
    int sock, memfd, devfd;
    void *map;
    size_t map_len;
    struct vmm_region *dev;
    struct tlink_register r;
};

static int32_t gcall(int fd, uint16_t type, const void *body, uint32_t len, const int *fds,
                     int nfds)
{
    struct tlink_hdr h;
    char buf[TLINK_BODY_MAX];
    int got[TLINK_FDS_MAX], ngot;

    cr_assert_eq(tlink_send(fd, type, 0, body, len, fds, nfds), 0);
    if (tlink_recv(fd, &h, buf, sizeof(buf), -1, got, &ngot, 30000) < 0)
        return INT32_MIN;
    return h.status;
}

static void gview(struct gtrainer *t, struct tlink_view *v)
{
    viewpage_read((const struct viewpage *)((char *)t->map + t->r.shared_off), v);
}

/* Plays both trainers' loops on this thread until each holds a result:
 * the leader hands over its opaque state when asked, and each contributes
 * one batch once a contribution is wanted in an epoch of all n. */
static void gtrain(struct gtrainer *t, int n)
{
    uint64_t until = clock_now_ms() + 60000;
    struct tlink_u64 one = { 1 }, len = { 2 };
    bool sent[2] = { false, false };
    struct tlink_view v;
    int done = 0;

    while (done < n) {
        done = 0;
        for (int i = 0; i < n; i++) {
            gview(&t[i], &v);
            if (v.wants_state) {
                int fd = tlink_memfd_from("state", "st", 2);
                cr_assert_eq(gcall(t[i].sock, TL_SET_STATE, &len, sizeof(len), &fd, 1), 0);
                close(fd);
            }
            /* Both in one epoch first, so that the round is theirs. */
            if (!sent[i] && v.connected && v.wants_gradients && v.size == (uint32_t)n) {
                cr_assert_eq(gcall(t[i].sock, TL_CONTRIBUTE, &one, sizeof(one), NULL, 0), 0);
                sent[i] = true;
            }
            done += v.has_gradients;
        }
        cr_assert_lt(clock_now_ms(), until, "no result within the deadline");
        usleep(2000);
    }
}

/* Starts member `id`'s sidecar and lays out its trainer's memory: a sealed
 * memfd as for host memory and a device region with the gradients at 0
 * and the results at `results_off` (0: in place, as moolib's). */
static void gtrainer_start(struct gtrainer *t, struct cudrv *d, const char *broker,
                           const char *dir, const char *id, uint64_t results_off)
{
    struct trainerd_config tc = { .node = { .broker = broker, .cohort = "gpu", .id = id,
                                            .host = "127.0.0.1" } };
    struct tlink_hello hello = { .api_version = TLINK_VERSION, .name = "gpu" };
    struct sockaddr_un sa = { .sun_family = AF_UNIX };
    const size_t gbytes = GN * sizeof(float);
    struct gpuid a;

    memset(t, 0, sizeof(*t));
    snprintf(t->path, sizeof(t->path), "%s/%s.sock", dir, id);
    tc.socket_path = t->path;
    cr_assert_eq(trainerd_start(&tc, &t->sd), 0);
    t->r.mem = TL_MEM_CUDA_VMM;
    t->r.grad_dtype = DTYPE_F32;
    t->r.grad_count = GN;
    t->r.params_off = 0;
    t->r.params_bytes = 64;
    t->r.grads_off = 64;
    t->r.results_off = 64 + gbytes;
    t->r.buffers_off = 64 + 2 * gbytes;
    t->r.shared_off = 64 + 2 * gbytes + 4096 - 64;
    t->r.region_bytes = t->map_len = t->r.shared_off + VIEWPAGE_BYTES;
    cr_assert_eq(gpuid_parse(DEV_A, &a), 0);
    memcpy(t->r.cuda_uuid, a.b, GPUID_BYTES);
    t->memfd = memfd_create("t", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    cr_assert_eq(ftruncate(t->memfd, (off_t)t->map_len), 0);
    cr_assert_eq(fcntl(t->memfd, F_ADD_SEALS, TLINK_SEALS), 0);
    t->map = mmap(NULL, t->map_len, PROT_READ | PROT_WRITE, MAP_SHARED, t->memfd, 0);
    cr_assert_neq(t->map, MAP_FAILED);
    cr_assert_eq(vmm_export(d, 0, results_off + gbytes, &t->dev, &t->devfd), 0);
    t->r.device_bytes = vmm_bytes(t->dev);
    t->r.device_grads_off = 0;
    t->r.device_results_off = results_off;
    t->sock = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    memcpy(sa.sun_path, t->path, strlen(t->path) + 1);
    cr_assert_eq(connect(t->sock, (struct sockaddr *)&sa, sizeof(sa)), 0);
    cr_assert_eq(gcall(t->sock, TL_HELLO, &hello, sizeof(hello), NULL, 0), 0);
}

static void gtrainer_stop(struct gtrainer *t)
{
    close(t->sock);
    trainerd_stop(t->sd);
    munmap(t->map, t->map_len);
    close(t->memfd);
    close(t->devfd);
    vmm_destroy(t->dev);
}

Test(gpu_driver, gpu_gradients_are_reduced_host_staged_and_land_on_every_device, .timeout = 120)
{
    struct cudrv *d = fake_driver();
    char broker[64], dir[64] = "/tmp/cohort-gpu-XXXXXX";
    struct brokerd *bd;
    struct gtrainer t[2];
    struct tlink_u64 two = { 2 };
    struct tlink_view v;
    float *g = malloc(GN * sizeof(float)), *res[2];
    int fds[2];

    setenv("COHORT_FAKE_CUDA_DEVICES", DEV_A, 1);
    cr_assert_not_null(mkdtemp(dir));
    bd = fixture_broker_start("gpu", broker, sizeof(broker));
    /* Member 0 gets its result in place of its gradients; member 1 apart. */
    for (int i = 0; i < 2; i++) {
        gtrainer_start(&t[i], d, broker, dir, i ? "g-1" : "g-0", i ? 10u << 20 : 0);
        for (size_t k = 0; k < GN; k++)
            g[k] = (float)(k % 1000) * (float)(i + 1) - 7.0f * (float)i;
        cr_assert_eq(vmm_write(t[i].dev, 0, g, GN * sizeof(float)), 0);
    }
    /* The refusals first: no device descriptor, a device layout past the
     * region's end, a UUID no device has. Each changes nothing. */
    fds[0] = t[0].memfd;
    fds[1] = t[0].devfd;
    cr_assert_eq(gcall(t[0].sock, TL_REGISTER, &t[0].r, sizeof(t[0].r), fds, 1), -EPROTO);
    t[0].r.device_results_off = t[0].r.device_bytes;
    cr_assert_eq(gcall(t[0].sock, TL_REGISTER, &t[0].r, sizeof(t[0].r), fds, 2), -EINVAL);
    t[0].r.device_results_off = 0;
    t[0].r.cuda_uuid[15] ^= 1;
    cr_assert_eq(gcall(t[0].sock, TL_REGISTER, &t[0].r, sizeof(t[0].r), fds, 2), -ENXIO);
    t[0].r.cuda_uuid[15] ^= 1;
    /* A region said to be larger than it is: the import fails, after the
     * memfd was mapped, and the session takes a good registration after. */
    t[0].r.device_bytes += 2u << 20;
    cr_assert_eq(gcall(t[0].sock, TL_REGISTER, &t[0].r, sizeof(t[0].r), fds, 2), -EINVAL);
    t[0].r.device_bytes -= 2u << 20;
    for (int i = 0; i < 2; i++) {
        fds[0] = t[i].memfd;
        fds[1] = t[i].devfd;
        cr_assert_eq(gcall(t[i].sock, TL_REGISTER, &t[i].r, sizeof(t[i].r), fds, 2), 0);
        cr_assert_eq(gcall(t[i].sock, TL_SET_VBS, &two, sizeof(two), NULL, 0), 0);
        cr_assert_eq(gcall(t[i].sock, TL_SET_PARALLEL, &two, sizeof(two), NULL, 0), -EOPNOTSUPP,
                     "parallel gradients are not served host-staged");
    }
    gtrain(t, 2);
    for (int i = 0; i < 2; i++) {
        gview(&t[i], &v);
        cr_assert_eq(v.num_gradients, 2, "both members' gradients");
        res[i] = malloc(GN * sizeof(float));
        cr_assert_eq(vmm_read(t[i].dev, t[i].r.device_results_off, res[i], GN * sizeof(float)), 0);
        /* The memfd holds the staged gradients, exactly the device's. */
        for (size_t k = 0; k < GN; k += 4099) {
            float want = (float)(k % 1000) * (float)(i + 1) - 7.0f * (float)i;
            cr_assert_eq(((float *)((char *)t[i].map + t[i].r.grads_off))[k], want);
        }
    }
    cr_assert_arr_eq(res[0], res[1], GN * sizeof(float), "the same bytes on every device");
    for (size_t k = 0; k < GN; k++) {
        float want = ((float)(k % 1000) + (float)(k % 1000) * 2.0f - 7.0f) / 2.0f;
        if (res[0][k] != want)
            cr_assert_fail("element %zu: %g, not %g", k, (double)res[0][k], (double)want);
    }
    for (int i = 0; i < 2; i++) {
        gtrainer_stop(&t[i]);
        free(res[i]);
    }
    free(g);
    cr_assert_eq(fake_live(), 0, "every sidecar let go of its device memory and stage");
    fixture_broker_stop(bd);
    rmdir(dir);
    cudrv_close(d);
}

/* ---- the trainer's side: include/cohort.h with cohort_use_gpu ----
 *
 * Two trainers through the public API, each with its gradients on the
 * stand-in's device (written there directly: the stand-in's device
 * addresses are this process's memory), through sidecars of their own. */

#define CN 300000               /* floats: one partial staging segment */

static void *dev(uint64_t addr)
{
    return (void *)(uintptr_t)addr;
}

static void *gpu_addr(const struct cohort *c)
{
    return dev(cohort_gpu_grads(c));
}

Test(gpu_driver, a_trainer_registers_gpu_gradients_through_the_public_api, .timeout = 120)
{
    struct cudrv *d = fake_driver();
    char broker[64], dir[64] = "/tmp/cohort-gpu-XXXXXX", path[2][128], addr[160];
    struct cohort_tensor p = { "w", COHORT_F32, CN }, b[2] = { { "n", COHORT_F64, 3 },
                                                              { "s", COHORT_F16, 5 } };
    struct cohort_config cfg = { .name = "m", .parameters = &p, .n_parameters = 1,
                                 .buffers = b, .n_buffers = 2 };
    int leader;
    struct trainerd *sd[2];
    struct cohort *c[2], *x = NULL;
    struct brokerd *bd;
    bool sent[2] = { false, false };
    uint64_t until;
    int done = 0;

    setenv("COHORT_FAKE_CUDA_DEVICES", DEV_B "," DEV_A, 1);
    cr_assert_not_null(mkdtemp(dir));
    bd = fixture_broker_start("gapi", broker, sizeof(broker));
    /* The refusals: not a UUID, no such device, twice, and in-process. */
    cr_assert_eq(cohort_create(&cfg, &x), 0);
    cr_assert_eq(cohort_use_gpu(x, "GPU-nonsense"), -EINVAL);
    cr_assert_eq(cohort_use_gpu(x, "GPU-00000000-0000-0000-0000-00000000000c"), -ENXIO);
    cr_assert_eq(cohort_gpu_grads(x), 0);
    cr_assert_eq(cohort_gpu_param(x, 0), 0, "no device parameters before cohort_use_gpu");
    cr_assert_eq(cohort_use_gpu(x, DEV_A), 0);
    cr_assert_eq(cohort_use_gpu(x, DEV_A), -EALREADY);
    /* One region: gradients, then parameters, then buffers, apart. */
    cr_assert_geq(cohort_gpu_param(x, 0), cohort_gpu_grads(x) + CN * sizeof(float));
    cr_assert_eq(cohort_gpu_param(x, 0) % 256, 0);
    cr_assert_geq(cohort_gpu_buffer(x, 0), cohort_gpu_param(x, 0) + CN * sizeof(float));
    cr_assert_eq(cohort_gpu_buffer(x, 1), cohort_gpu_buffer(x, 0) + 3 * sizeof(double));
    cr_assert_eq(cohort_gpu_param(x, 1), 0, "out of range");
    cr_assert_eq(cohort_gpu_buffer(x, 2), 0, "out of range");
    cr_assert_eq(cohort_connect(x, broker), -EOPNOTSUPP, "an in-process node stages nothing");
    cohort_destroy(x);
    cr_assert_eq(fake_live(), 0, "the device region went with the cohort");
    for (int i = 0; i < 2; i++) {
        struct trainerd_config tc = { .node = { .broker = broker, .cohort = "gapi",
                                                .id = i ? "a-1" : "a-0", .host = "127.0.0.1" } };
        snprintf(path[i], sizeof(path[i]), "%s/%d.sock", dir, i);
        tc.socket_path = path[i];
        cr_assert_eq(trainerd_start(&tc, &sd[i]), 0);
        cr_assert_eq(cohort_create(&cfg, &c[i]), 0);
        cr_assert_eq(cohort_use_gpu(c[i], DEV_A), 0);
        for (size_t k = 0; k < CN; k++)
            ((float *)gpu_addr(c[i]))[k] = (float)(k % 77) + 100.0f * (float)i;
        /* Each member's model on its device; the host copies stay zero. */
        for (size_t k = 0; k < CN; k++)
            ((float *)dev(cohort_gpu_param(c[i], 0)))[k] = (float)k + 0.5f + (float)i;
        for (size_t k = 0; k < 3; k++)
            ((double *)dev(cohort_gpu_buffer(c[i], 0)))[k] = -1.0 - (double)i;
        memset(dev(cohort_gpu_buffer(c[i], 1)), 0x10 + i, 10);
        snprintf(addr, sizeof(addr), "unix:%s", path[i]);
        cr_assert_eq(cohort_connect(c[i], addr), 0);
        cr_assert_eq(cohort_set_virtual_batch_size(c[i], 2), 0);
    }
    until = clock_now_ms() + 60000;
    while (done < 2) {
        done = 0;
        for (int i = 0; i < 2; i++) {
            cr_assert_eq(cohort_update(c[i]), 0);
            if (cohort_wants_state(c[i]))
                cr_assert_eq(cohort_set_state(c[i], "st", 2), 0);
            if (!sent[i] && cohort_wants_gradients(c[i]) && cohort_size(c[i]) == 2) {
                cr_assert_eq(cohort_reduce_gradients(c[i], 1), 0);
                sent[i] = true;
            }
            done += cohort_has_gradients(c[i]);
        }
        cr_assert_lt(clock_now_ms(), until, "no result within the deadline");
        usleep(2000);
    }
    cr_assert_arr_eq(gpu_addr(c[0]), gpu_addr(c[1]), CN * sizeof(float),
                     "the same result on both devices");
    /* The joiner's device holds the leader's device values, taken at its
     * set_state: the host copies were never written by a trainer. */
    leader = cohort_is_leader(c[0]) ? 0 : 1;
    cr_assert(cohort_is_leader(c[leader]) && !cohort_is_leader(c[1 - leader]));
    for (int i = 0; i < 2; i++) {
        const float *w = dev(cohort_gpu_param(c[i], 0));
        const double *n = dev(cohort_gpu_buffer(c[i], 0));
        const unsigned char *h = dev(cohort_gpu_buffer(c[i], 1));

        for (size_t k = 0; k < CN; k++)
            if (w[k] != (float)k + 0.5f + (float)leader)
                cr_assert_fail("member %d parameter %zu: %g, not the leader's", i, k, (double)w[k]);
        for (size_t k = 0; k < 3; k++)
            cr_assert_eq(n[k], -1.0 - (double)leader, "member %d buffer 0", i);
        for (size_t k = 0; k < 10; k++)
            cr_assert_eq(h[k], 0x10 + leader, "member %d buffer 1", i);
        cr_assert_arr_eq(cohort_params(c[i]), w, CN * sizeof(float), "the host copies too");
    }
    for (size_t k = 0; k < CN; k++) {
        float want = ((float)(k % 77) * 2.0f + 100.0f) / 2.0f;
        if (((float *)gpu_addr(c[0]))[k] != want)
            cr_assert_fail("element %zu: %g, not %g", k, (double)((float *)gpu_addr(c[0]))[k],
                           (double)want);
    }
    /* Applying the result zeroes the gradients on the device. */
    cr_assert_eq(cohort_zero_gradients(c[0]), 0);
    for (size_t k = 0; k < CN; k++)
        if (((float *)gpu_addr(c[0]))[k] != 0.0f)
            cr_assert_fail("element %zu not zeroed", k);
    for (int i = 0; i < 2; i++) {
        cohort_destroy(c[i]);
        trainerd_stop(sd[i]);
    }
    cr_assert_eq(fake_live(), 0, "trainers and sidecars let go of everything");
    fixture_broker_stop(bd);
    rmdir(dir);
    cudrv_close(d);
}

/* Waits, answering a leader's call for state, until `done` holds of the
 * n trainers' views. */
static void gpump(struct gtrainer *t, int n, bool (*done)(struct tlink_view *v, int n))
{
    uint64_t until = clock_now_ms() + 60000;
    struct tlink_u64 len = { 2 };
    struct tlink_view v[3];

    for (;;) {
        for (int i = 0; i < n; i++) {
            gview(&t[i], &v[i]);
            if (v[i].wants_state) {
                int fd = tlink_memfd_from("state", "st", 2);
                cr_assert_eq(gcall(t[i].sock, TL_SET_STATE, &len, sizeof(len), &fd, 1), 0);
                close(fd);
            }
        }
        if (done(v, n))
            return;
        cr_assert_lt(clock_now_ms(), until, "the views never got there");
        usleep(2000);
    }
}

static bool pair_wants(struct tlink_view *v, int n)
{
    return v[0].size == 2 && v[1].size == 2 && v[0].connected && v[1].connected &&
           v[0].wants_gradients && v[1].wants_gradients;
}

static bool a_dropped(struct tlink_view *v, int n)
{
    return v[0].size == 3 && v[0].contributions_dropped == 1 && v[0].drop_pending;
}

/* A member behind a leader whose versions were declared (no record of
 * which epoch committed them) drops its pending contribution rather than
 * count it twice (node.h); on a GPU registration the device's gradients
 * are zeroed with the memfd's, within the trainer's next call. */
Test(gpu_driver, dropped_gradients_are_zeroed_on_the_device_too, .timeout = 120)
{
    struct cudrv *d = fake_driver();
    char broker[64], dir[64] = "/tmp/cohort-gpu-XXXXXX";
    struct tlink_u64 many = { 100 }, one = { 1 }, five = { 5 };
    struct tlink_view v;
    struct brokerd *bd;
    struct gtrainer t[3];
    float *g = malloc(GN * sizeof(float));
    int fds[2];

    setenv("COHORT_FAKE_CUDA_DEVICES", DEV_A, 1);
    cr_assert_not_null(mkdtemp(dir));
    bd = fixture_broker_start("gpu", broker, sizeof(broker));
    for (int i = 0; i < 3; i++) {
        gtrainer_start(&t[i], d, broker, dir, i == 0 ? "d-0" : i == 1 ? "d-1" : "d-2", 0);
        for (size_t k = 0; k < GN; k++)
            g[k] = 1.0f + (float)i;
        cr_assert_eq(vmm_write(t[i].dev, 0, g, GN * sizeof(float)), 0);
    }
    /* d-0 and d-1 each contribute once; 100 samples are never reached. */
    for (int i = 0; i < 2; i++) {
        fds[0] = t[i].memfd;
        fds[1] = t[i].devfd;
        cr_assert_eq(gcall(t[i].sock, TL_REGISTER, &t[i].r, sizeof(t[i].r), fds, 2), 0);
        cr_assert_eq(gcall(t[i].sock, TL_SET_VBS, &many, sizeof(many), NULL, 0), 0);
    }
    gpump(t, 2, pair_wants);
    for (int i = 0; i < 2; i++)
        cr_assert_eq(gcall(t[i].sock, TL_CONTRIBUTE, &one, sizeof(one), NULL, 0), 0);
    gpump(t, 2, pair_wants);
    /* d-1 declares version 5; d-2 joins, and at the new epoch d-0, behind
     * an unrecorded history, drops what it holds. */
    cr_assert_eq(gcall(t[1].sock, TL_SET_VERSION, &five, sizeof(five), NULL, 0), 0);
    fds[0] = t[2].memfd;
    fds[1] = t[2].devfd;
    cr_assert_eq(gcall(t[2].sock, TL_REGISTER, &t[2].r, sizeof(t[2].r), fds, 2), 0);
    cr_assert_eq(gcall(t[2].sock, TL_SET_VBS, &many, sizeof(many), NULL, 0), 0);
    gpump(t, 3, a_dropped);
    cr_assert_eq(vmm_read(t[0].dev, 0, g, GN * sizeof(float)), 0);
    cr_assert_eq(g[0], 1.0f, "the device's gradients stand until the trainer's call");
    /* The trainer's link calls VIEW when a drop is pending (link_sidecar.c). */
    cr_assert_eq(gcall(t[0].sock, TL_VIEW, NULL, 0, NULL, 0), 0);
    gview(&t[0], &v);
    cr_assert_not(v.drop_pending);
    cr_assert_eq(vmm_read(t[0].dev, 0, g, GN * sizeof(float)), 0);
    for (size_t k = 0; k < GN; k++)
        if (g[k] != 0.0f || ((float *)((char *)t[0].map + t[0].r.grads_off))[k] != 0.0f)
            cr_assert_fail("element %zu not zeroed on the device and in the memfd", k);
    for (int i = 0; i < 3; i++)
        gtrainer_stop(&t[i]);
    free(g);
    cr_assert_eq(fake_live(), 0);
    fixture_broker_stop(bd);
    rmdir(dir);
    cudrv_close(d);
}

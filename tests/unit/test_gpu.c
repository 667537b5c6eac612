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
#include "accumulator/trainerd.h"
#include "gpu/cudrv.h"
#include "gpu/gpuid.h"
#include "gpu/nccllib.h"
#include "gpu/ncomm.h"
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
        /* A driver, but no device has the all-zero UUID. */
        cr_assert_eq(rc, -ENXIO);
        cr_assert(strstr(why, "No device with this UUID"), "%s", why);
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
    /* The layout check, pure, refuses anything but host memory whatever
     * the device: the fuzz harness relies on it. */
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

/* tests/unit/test_gpuid.c: GPU UUIDs as nvidia-smi prints them, and a
 * device found by UUID whatever its index. */
#include <criterion/criterion.h>

#include <errno.h>
#include <string.h>

#include "gpu/gpuid.h"

static const char *const SMI = "GPU-1f3a5c7e-0b2d-4e6f-8091-a2b3c4d5e6f7";

Test(gpuid, parses_and_formats_the_nvidia_smi_form)
{
    static const uint8_t want[GPUID_BYTES] = { 0x1f, 0x3a, 0x5c, 0x7e, 0x0b, 0x2d, 0x4e, 0x6f,
                                               0x80, 0x91, 0xa2, 0xb3, 0xc4, 0xd5, 0xe6, 0xf7 };
    struct gpuid id;
    char text[GPUID_TEXT_MAX];

    cr_assert_eq(gpuid_parse(SMI, &id), 0);
    cr_assert_arr_eq(id.b, want, GPUID_BYTES);
    cr_assert_str_eq(gpuid_format(&id, text, sizeof(text)), SMI);
    cr_assert_eq(strlen(text), GPUID_TEXT_MAX - 1);
}

Test(gpuid, takes_upper_case_and_no_prefix)
{
    struct gpuid a, b;

    cr_assert_eq(gpuid_parse(SMI, &a), 0);
    cr_assert_eq(gpuid_parse("1F3A5C7E-0B2D-4E6F-8091-A2B3C4D5E6F7", &b), 0,
                 "CUDA_VISIBLE_DEVICES may name a device without GPU-");
    cr_assert_arr_eq(a.b, b.b, GPUID_BYTES);
}

Test(gpuid, refuses_anything_else_and_leaves_the_output_alone)
{
    static const char *const bad[] = {
        "", "GPU-", "GPU-1f3a5c7e-0b2d-4e6f-8091-a2b3c4d5e6f",     /* a digit short */
        "GPU-1f3a5c7e-0b2d-4e6f-8091-a2b3c4d5e6f70",               /* a digit long */
        "GPU-1f3a5c7e0b2d-4e6f-8091-a2b3c4d5e6f7-",                /* dash moved */
        "GPU-1f3a5c7e-0b2d-4e6f-8091-a2b3c4d5e6fg",                /* not hex */
        "GPU-1f3a5c7e-0b2d-4e6f-8091-a2b3c4d5e6f7 ",               /* trailing */
        "MIG-1f3a5c7e-0b2d-4e6f-8091-a2b3c4d5e6f7",                /* another prefix */
        "0", "GPU-0",                                              /* an index */
    };
    struct gpuid id;

    memset(&id, 0xee, sizeof(id));
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        cr_assert_eq(gpuid_parse(bad[i], &id), -EINVAL, "\"%s\"", bad[i]);
    cr_assert_eq(gpuid_parse(NULL, &id), -EINVAL);
    for (size_t i = 0; i < GPUID_BYTES; i++)
        cr_assert_eq(id.b[i], 0xee);
}

/* Two containers see the same two GPUs in another order: each finds the
 * trainer's device at its own index. */
Test(gpuid, finds_by_uuid_never_by_index)
{
    struct gpuid x, y, trainer[2], sidecar[2];

    cr_assert_eq(gpuid_parse(SMI, &x), 0);
    cr_assert_eq(gpuid_parse("GPU-00000000-0000-0000-0000-000000000001", &y), 0);
    trainer[0] = x;
    trainer[1] = y;
    sidecar[0] = y;
    sidecar[1] = x;
    cr_assert_eq(gpuid_find(trainer, 2, &x), 0);
    cr_assert_eq(gpuid_find(sidecar, 2, &x), 1);
    cr_assert_eq(gpuid_find(sidecar, 1, &x), -ENODEV, "the device is not visible there");
    cr_assert_eq(gpuid_find(sidecar, 0, &x), -ENODEV);
}

Test(gpuid, a_uuid_listed_twice_matches_nothing)
{
    struct gpuid x, list[3];

    cr_assert_eq(gpuid_parse(SMI, &x), 0);
    memset(&list[0], 0, sizeof(list[0]));
    list[1] = x;
    list[2] = x;
    cr_assert_eq(gpuid_find(list, 3, &x), -EEXIST);
}

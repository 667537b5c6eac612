/* tests/unit/test_opt.c: flag values: durations and counts, and what is
 * refused. */
#include <criterion/criterion.h>
#include <errno.h>

#include "base/opt.h"

Test(opt, durations_with_units)
{
    uint64_t ms;

    cr_assert_eq(opt_duration_ms("250ms", 10000, &ms), 0);
    cr_assert_eq(ms, 250);
    cr_assert_eq(opt_duration_ms("1.5s", 10000, &ms), 0);
    cr_assert_eq(ms, 1500);
    cr_assert_eq(opt_duration_ms("2m", 1000000, &ms), 0);
    cr_assert_eq(ms, 120000);
    cr_assert_eq(opt_duration_ms("0ms", 10, &ms), 0);
    cr_assert_eq(ms, 0);
}

Test(opt, durations_refused)
{
    uint64_t ms = 7;

    cr_assert_eq(opt_duration_ms("5", 10000, &ms), -EINVAL);       /* no unit */
    cr_assert_eq(opt_duration_ms("-1s", 10000, &ms), -EINVAL);
    cr_assert_eq(opt_duration_ms("1x", 10000, &ms), -EINVAL);
    cr_assert_eq(opt_duration_ms("1.s", 10000, &ms), -EINVAL);
    cr_assert_eq(opt_duration_ms("", 10000, &ms), -EINVAL);
    cr_assert_eq(opt_duration_ms("11s", 10000, &ms), -ERANGE);
    cr_assert_eq(opt_duration_ms("99999999999999999999h", UINT64_MAX, &ms), -ERANGE);
    cr_assert_eq(ms, 7, "a refused value changes nothing");
}

Test(opt, unsigned_counts)
{
    uint64_t v = 9;

    cr_assert_eq(opt_uint("42", 1, 100, &v), 0);
    cr_assert_eq(v, 42);
    cr_assert_eq(opt_uint("0", 1, 100, &v), -ERANGE);
    cr_assert_eq(opt_uint("101", 1, 100, &v), -ERANGE);
    cr_assert_eq(opt_uint("4x", 1, 100, &v), -EINVAL);
    cr_assert_eq(opt_uint("-4", 1, 100, &v), -EINVAL);
    cr_assert_eq(opt_uint("18446744073709551616", 0, UINT64_MAX, &v), -ERANGE);
    cr_assert_eq(v, 42);
}

Test(opt, byte_counts)
{
    uint64_t v = 0;

    cr_assert_eq(opt_bytes("4096", 1ull << 40, &v), 0);
    cr_assert_eq(v, 4096);
    cr_assert_eq(opt_bytes("64K", 1ull << 40, &v), 0);
    cr_assert_eq(v, 64 << 10);
    cr_assert_eq(opt_bytes("1m", 1ull << 40, &v), 0);
    cr_assert_eq(v, 1 << 20);
    cr_assert_eq(opt_bytes("2GiB", 1ull << 40, &v), 0);
    cr_assert_eq(v, 2ull << 30);
    cr_assert_eq(opt_bytes("3KB", 1ull << 40, &v), 0);
    cr_assert_eq(v, 3 << 10);
    cr_assert_eq(opt_bytes("1G", 1ull << 30, &v), 0, "max itself is allowed");
}

Test(opt, byte_counts_refused)
{
    uint64_t v = 7;

    cr_assert_eq(opt_bytes("0", 100, &v), -EINVAL);
    cr_assert_eq(opt_bytes("0K", 100, &v), -EINVAL);
    cr_assert_eq(opt_bytes("", 100, &v), -EINVAL);
    cr_assert_eq(opt_bytes("K", 100, &v), -EINVAL);
    cr_assert_eq(opt_bytes("-1", 100, &v), -EINVAL);
    cr_assert_eq(opt_bytes("4 K", 1 << 20, &v), -EINVAL);
    cr_assert_eq(opt_bytes("4Ki", 1 << 20, &v), -EINVAL);
    cr_assert_eq(opt_bytes("4iB", 1 << 20, &v), -EINVAL, "a suffix needs a unit");
    cr_assert_eq(opt_bytes("4T", UINT64_MAX, &v), -EINVAL);
    cr_assert_eq(opt_bytes("101", 100, &v), -ERANGE);
    cr_assert_eq(opt_bytes("2G", 1ull << 30, &v), -ERANGE);
    cr_assert_eq(opt_bytes("18446744073709551616", UINT64_MAX, &v), -ERANGE);
    cr_assert_eq(opt_bytes("17179869184G", UINT64_MAX, &v), -ERANGE, "overflow in the unit");
    cr_assert_eq(v, 7, "a refused value changes nothing");
}

Test(opt, byte_lists)
{
    uint64_t v[3] = { 0 };
    size_t n = 0;

    cr_assert_eq(opt_bytes_list("4K,64M", 1ull << 30, v, 3, &n), 0);
    cr_assert_eq(n, 2);
    cr_assert_eq(v[0], 4096);
    cr_assert_eq(v[1], 64 << 20);
    cr_assert_eq(opt_bytes_list("1K,2K", 1ull << 30, v, 3, &n), -E2BIG, "appends, up to cap");
    cr_assert_eq(n, 2, "nothing appended on error");
    cr_assert_eq(opt_bytes_list("1K", 1ull << 30, v, 3, &n), 0);
    cr_assert_eq(n, 3);
    cr_assert_eq(v[2], 1024);

    n = 0;
    cr_assert_eq(opt_bytes_list("4K,,8K", 1ull << 30, v, 3, &n), -EINVAL);
    cr_assert_eq(opt_bytes_list("4K,", 1ull << 30, v, 3, &n), -EINVAL);
    cr_assert_eq(opt_bytes_list("4K,2G", 1ull << 30, v, 3, &n), -ERANGE);
    cr_assert_eq(opt_bytes_list("4K,123456789012345678901234567890123", 1ull << 30, v, 3, &n), -EINVAL);
    cr_assert_eq(n, 0);
}

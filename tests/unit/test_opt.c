/* tests/unit/test_opt.c: flag values: durations and counts, and what is
 * refused. */
#include <criterion/criterion.h>
#include <errno.h>

#include "opt.h"

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

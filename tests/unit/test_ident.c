/* tests/unit/test_ident.c: names, addresses and the natural order. */
#include <criterion/criterion.h>

#include <stdlib.h>
#include <string.h>

#include "base/ident.h"

/* A string of `n` copies of `c` followed by `tail`, in a static buffer. */
static const char *repeat(char c, size_t n, const char *tail)
{
    static char buf[1024];

    size_t t = strlen(tail);

    cr_assert_lt(n + t, sizeof buf);
    memset(buf, c, n);
    memcpy(buf + n, tail, t + 1);
    return buf;
}

static int sign(int v)
{
    return (v > 0) - (v < 0);
}

/* valid() must say `want` of each of the n strings in list. */
static void check_each(bool (*valid)(const char *), const char *const *list, size_t n, bool want)
{
    for (size_t i = 0; i < n; i++)
        cr_assert_eq(valid(list[i]), want, "%s", list[i]);
}

#define CHECK_EACH(valid, list, want) check_each(valid, list, sizeof list / sizeof list[0], want)

Test(ident, member_id_accepts_valid)
{
    static const char *const ok[] = { "a", "0", "a-0", "worker-12", "A.b_c-9", "9lives", "x.y.z" };

    CHECK_EACH(ident_valid_member_id, ok, true);
    cr_assert(ident_valid_member_id(repeat('a', IDENT_NAME_MAX, "")));
}

Test(ident, member_id_rejects_invalid)
{
    static const char *const bad[] = {
        "", "-a", ".a", "_a", "a b", "a/b", "ns/a", "a:b", "a\tb", "a\nb", "\xc3\xa9", "a@b", "a*",
    };

    cr_assert_not(ident_valid_member_id(NULL));
    CHECK_EACH(ident_valid_member_id, bad, false);
    cr_assert_not(ident_valid_member_id(repeat('a', IDENT_NAME_MAX + 1, "")));
}

Test(ident, cohort_accepts_one_slash)
{
    static const char *const ok[] = { "demo", "ns/name", "a/b", "team-1/job.2", "0/0" };

    CHECK_EACH(ident_valid_cohort, ok, true);
    cr_assert(ident_valid_cohort(repeat('a', IDENT_NAME_MAX - 2, "/b")));
}

Test(ident, cohort_rejects_invalid)
{
    static const char *const bad[] = {
        "", "/a", "a/", "a//b", "a/b/c", "a/-b", "a/.b", "-a", "a b", "a:b",
    };

    cr_assert_not(ident_valid_cohort(NULL));
    CHECK_EACH(ident_valid_cohort, bad, false);
    cr_assert_not(ident_valid_cohort(repeat('a', IDENT_NAME_MAX - 1, "/b")));
}

Test(ident, address_accepts_valid)
{
    static const char *const ok[] = {
        "host:80", "h:1", "10.0.0.1:7000", "a.b-c.example:65535", "pod-0.svc.cluster.local:29500",
        "[::1]:80", "[fe80::1]:1", "[::ffff:1.2.3.4]:9", "host:00080",
    };

    CHECK_EACH(ident_valid_address, ok, true);
    /* The longest accepted: 255 bytes of host, ':', five digits. */
    cr_assert(ident_valid_address(repeat('h', IDENT_ADDRESS_MAX - 6, ":12345")));
}

Test(ident, address_rejects_invalid)
{
    static const char *const bad[] = {
        "", "host", "host:", ":80", "host:0", "host:00000", "host:65536", "host:123456",
        "host:-1", "host:+80", "host:8 0", "ho_st:80", "ho st:80", "host/x:80", "[::1]", "[]:80",
        "[::1]80", "[zz]:80", "[::1:80", "::1:80", "[::1]:0", "[::1]:", "host:80\n",
    };

    cr_assert_not(ident_valid_address(NULL));
    CHECK_EACH(ident_valid_address, bad, false);
    cr_assert_not(ident_valid_address(repeat('h', IDENT_ADDRESS_MAX - 5, ":12345")));
}

Test(ident, natural_order_compares_digit_runs_by_value)
{
    static const struct {
        const char *a, *b;
        int sign;               /* of ident_natural_cmp(a, b) */
    } cmp[] = {
        { "c-2", "c-10", -1 },
        { "c-10", "c-2", 1 },
        { "c-9", "c-010", -1 },
        { "a1b2", "a1b10", -1 },
        { "w-99999999999999999999999", "w-100000000000000000000000", -1 },
        { "node-2-gpu-10", "node-10-gpu-2", -1 },
        { "a", "b", -1 },
        { "", "a", -1 },
        { "a", "a0", -1 },
        { "a-1", "a-1x", -1 },
        { "c-10", "c-10", 0 },
        { "", "", 0 },
    };

    for (size_t i = 0; i < sizeof cmp / sizeof cmp[0]; i++)
        cr_assert_eq(sign(ident_natural_cmp(cmp[i].a, cmp[i].b)), cmp[i].sign, "%s vs %s",
                     cmp[i].a, cmp[i].b);
}

Test(ident, natural_order_never_ties_distinct_strings)
{
    cr_assert_neq(ident_natural_cmp("c-02", "c-2"), 0);
    cr_assert_eq(sign(ident_natural_cmp("c-02", "c-2")), -sign(ident_natural_cmp("c-2", "c-02")));
    cr_assert_neq(ident_natural_cmp("c-002", "c-02"), 0);
    cr_assert_neq(ident_natural_cmp("x0", "x00"), 0);
}

/* Antisymmetric, transitive and zero only for equal strings, over a set
 * chosen to stress digit runs, leading zeros and prefixes. */
Test(ident, natural_order_is_total)
{
    static const char *const s[] = {
        "", "0", "00", "000", "1", "01", "001", "9", "10", "010", "a", "a0", "a00", "a1", "a01",
        "a2", "a10", "a-1", "a-01", "a-1x", "a-01x", "a-1a", "a-01a", "a-10", "a-9z", "b", "c-02x",
        "c-2a", "c-2", "c-02", "c-002", "c-10", "x", "x.1", "x-1", "x_1", "Z", "z",
    };
    size_t n = sizeof s / sizeof s[0];

    for (size_t i = 0; i < n; i++) {
        for (size_t j = 0; j < n; j++) {
            int ij = sign(ident_natural_cmp(s[i], s[j]));

            cr_assert_eq(ij, -sign(ident_natural_cmp(s[j], s[i])), "%s %s", s[i], s[j]);
            cr_assert_eq(ij == 0, strcmp(s[i], s[j]) == 0, "%s %s", s[i], s[j]);
            for (size_t k = 0; k < n; k++) {
                if (ij <= 0 && ident_natural_cmp(s[j], s[k]) <= 0)
                    cr_assert_leq(ident_natural_cmp(s[i], s[k]), 0, "%s <= %s <= %s", s[i], s[j],
                                  s[k]);
            }
        }
    }
}

static int cmp_ptr(const void *a, const void *b)
{
    return ident_natural_cmp(*(const char *const *)a, *(const char *const *)b);
}

Test(ident, natural_order_sorts_member_lists)
{
    const char *ids[] = { "w-10", "w-2", "w-1", "v-100", "w-02", "w-20", "w-3" };
    static const char *const want[] = { "v-100", "w-1", "w-02", "w-2", "w-3", "w-10", "w-20" };

    qsort(ids, sizeof ids / sizeof ids[0], sizeof ids[0], cmp_ptr);
    for (size_t i = 0; i < sizeof ids / sizeof ids[0]; i++)
        cr_assert_str_eq(ids[i], want[i]);
}

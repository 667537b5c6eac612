/* tests/unit/test_tally.c: counters carried through an element-wise SUM
 * come back exact, at the edges of each type's exact range, whatever the
 * order the sum was taken in. The sum is taken here with the engine's own
 * kernel (dtype_combine), member by member. */
#include <criterion/criterion.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "engine/dtype.h"
#include "accumulator/tally.h"

#define K 4

/* Encodes each member's counters, sums them with the engine's kernel in
 * the order given, and decodes. */
static void carry(enum dtype t, uint32_t members, const uint64_t (*v)[K], const uint32_t *order,
                  uint64_t *out)
{
    size_t per = tally_digits(t, members), bytes = K * per * dtype_size(t);
    char *acc = calloc(1, bytes), *one = malloc(bytes);

    cr_assert(per > 0 && acc && one);
    for (uint32_t i = 0; i < members; i++) {
        tally_encode(t, members, v[order ? order[i] : i], K, one);
        dtype_combine(t, DTYPE_SUM, acc, one, K * per);
    }
    tally_decode(t, members, acc, out, K);
    free(acc);
    free(one);
}

static void expect_sums(enum dtype t, uint32_t members, const uint64_t (*v)[K], const uint32_t *order)
{
    uint64_t want[K] = { 0 }, got[K];

    for (uint32_t i = 0; i < members; i++)
        for (int c = 0; c < K; c++)
            want[c] += v[i][c];
    carry(t, members, v, order, got);
    for (int c = 0; c < K; c++)
        cr_assert_eq(got[c], want[c], "type %d, %u members, counter %d: %llu, want %llu", t,
                     members, c, (unsigned long long)got[c], (unsigned long long)want[c]);
}

Test(tally, digits_fit_the_exact_range_of_each_type)
{
    /* float32: 24 exact bits; 2 members take 2 bits, so 22-bit digits. */
    cr_assert_eq(tally_digits(DTYPE_F32, 1), 3);
    cr_assert_eq(tally_digits(DTYPE_F32, 2), 3);
    cr_assert_eq(tally_digits(DTYPE_F32, (1u << 20) - 1), 16);
    cr_assert_eq(tally_digits(DTYPE_F64, (1u << 20) - 1), 2);
    cr_assert_eq(tally_digits(DTYPE_I64, 1000), 1);
    cr_assert_eq(tally_digits(DTYPE_I32, 3), 3);
    cr_assert_leq(tally_digits(DTYPE_F32, 1u << 22), TALLY_DIGITS_MAX);
    /* Nothing exact to carry them in, or nobody to carry them for. */
    cr_assert_eq(tally_digits(DTYPE_F16, 2), 0);
    cr_assert_eq(tally_digits(DTYPE_BF16, 2), 0);
    cr_assert_eq(tally_digits(DTYPE_F32, 0), 0);
    cr_assert_eq(tally_digits(DTYPE_F32, 1u << 24), 0);
}

Test(tally, full_64_bit_counters_come_back_exact)
{
    static const enum dtype types[] = { DTYPE_F32, DTYPE_F64, DTYPE_I32, DTYPE_I64 };
    uint64_t v[5][K] = {
        { UINT64_MAX, 1, 0, 1ull << 63 },
        { 1ull << 24, (1ull << 24) + 1, 123456789012345ull, 3 },
        { (1ull << 53) + 1, 0, UINT64_MAX - 7, 1ull << 40 },
        { 0x5555555555555555ull, 0xaaaaaaaaaaaaaaaaull, 16777217, 9007199254740993ull },
        { 4, 4, 4, 4 },
    };
    uint32_t reversed[5] = { 4, 3, 2, 1, 0 };

    /* Sums wrap modulo 2^64, as the counters' own would. */
    for (size_t i = 0; i < sizeof(types) / sizeof(types[0]); i++)
        for (uint32_t m = 1; m <= 5; m++) {
            expect_sums(types[i], m, v, NULL);
            if (m == 5)
                expect_sums(types[i], m, v, reversed);
        }
}

Test(tally, the_widest_cohort_with_every_digit_at_its_maximum)
{
    /* Every member at the largest value: each digit sum is as large as it
     * gets, just below 2^24 in float32. */
    uint32_t m = (1u << 20) - 1;
    uint64_t (*v)[K] = malloc(m * sizeof(*v));

    cr_assert(v);
    for (uint32_t i = 0; i < m; i++)
        for (int c = 0; c < K; c++)
            v[i][c] = c == 0 ? UINT64_MAX : (uint64_t)i * 2654435761u;
    expect_sums(DTYPE_F32, m, (const uint64_t(*)[K])v, NULL);
    free(v);
}

Test(tally, garbage_sums_decode_without_undefined_behaviour)
{
    float junk[3] = { -1.0f, __builtin_nanf(""), 1e30f };
    uint64_t out;

    tally_decode(DTYPE_F32, 1, junk, &out, 1);
    cr_assert_eq(out, 0);
}

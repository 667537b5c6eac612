/* src/accumulator/tally.c: see tally.h. */
#include "accumulator/tally.h"

/* Bits per digit; 0 when a digit would be empty. */
static unsigned digit_bits(enum dtype t, uint32_t members)
{
    unsigned exact, m_bits = 0;

    if (members == 0)
        return 0;
    switch (t) {
    case DTYPE_F32: exact = 24; break;
    case DTYPE_F64: exact = 53; break;
    case DTYPE_I32: exact = 32; break;
    case DTYPE_I64: return 64;
    default: return 0;
    }
    for (uint32_t x = members; x; x >>= 1)
        m_bits++;
    /* m members, each digit < 2^d: the sum is below m * 2^d <= 2^(m_bits + d). */
    return exact > m_bits ? exact - m_bits : 0;
}

size_t tally_digits(enum dtype t, uint32_t members)
{
    unsigned d = digit_bits(t, members);

    return d ? (64 + d - 1) / d : 0;
}

void tally_encode(enum dtype t, uint32_t members, const uint64_t *v, size_t k, void *out)
{
    unsigned d = digit_bits(t, members);
    size_t per = tally_digits(t, members);
    uint64_t mask = d == 64 ? UINT64_MAX : (1ull << d) - 1;

    for (size_t c = 0; c < k; c++) {
        for (size_t i = 0; i < per; i++) {
            uint64_t digit = (v[c] >> (d * i)) & mask;
            size_t at = c * per + i;

            switch (t) {
            case DTYPE_F32: ((float *)out)[at] = (float)digit; break;
            case DTYPE_F64: ((double *)out)[at] = (double)digit; break;
            case DTYPE_I32: ((uint32_t *)out)[at] = (uint32_t)digit; break;
            default: ((uint64_t *)out)[at] = digit; break;
            }
        }
    }
}

/* Sums of digits are small non-negative integers; anything else (a peer
 * that sent garbage) reads as 0 rather than as undefined behaviour. */
static uint64_t from_double(double x)
{
    return x >= 0 && x < 0x1p64 ? (uint64_t)x : 0;
}

void tally_decode(enum dtype t, uint32_t members, const void *in, uint64_t *v, size_t k)
{
    unsigned d = digit_bits(t, members);
    size_t per = tally_digits(t, members);

    for (size_t c = 0; c < k; c++) {
        uint64_t sum = 0;

        for (size_t i = 0; i < per; i++) {
            size_t at = c * per + i;
            uint64_t s;

            switch (t) {
            case DTYPE_F32: s = from_double(((const float *)in)[at]); break;
            case DTYPE_F64: s = from_double(((const double *)in)[at]); break;
            case DTYPE_I32: s = ((const uint32_t *)in)[at]; break;
            default: s = ((const uint64_t *)in)[at]; break;
            }
            /* Carries out of a digit land in the next one; past bit 63 they
             * wrap, as the counters' own sums do. */
            sum += s << (d * i);
        }
        v[c] = sum;
    }
}

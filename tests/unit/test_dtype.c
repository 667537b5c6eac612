/* tests/unit/test_dtype.c: names, the 16-bit conversions (against the
 * compiler's own _Float16 and a double-precision reference for bfloat16),
 * and every reduction kernel against a scalar reference, tails included. */
#include <criterion/criterion.h>

#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "engine/dtype.h"

/* The bits of `x` read as type To, of the same size (a union, which C11
 * defines for this). */
#define BITCAST(To, From, x) (((union { From from; To to; }){ .from = (x) }).to)

static uint32_t fbits(float f)
{
    return BITCAST(uint32_t, float, f);
}

static float bitsf(uint32_t u)
{
    return BITCAST(float, uint32_t, u);
}

/* libgcc's _Float16 conversions: correctly rounded, nearest even. */
static uint16_t ref_f16(float f)
{
    return BITCAST(uint16_t, _Float16, (_Float16)f);
}

static float ref_f16_to_f32(uint16_t b)
{
    return (float)BITCAST(_Float16, uint16_t, b);
}

/* bfloat16 by definition: the nearer of the two candidates that keep the
 * top 16 bits, ties to the even one; overflow past the largest finite
 * value rounds to infinity the same way. */
static uint16_t ref_bf16(float f)
{
    uint32_t x = fbits(f);
    uint32_t lo = x & 0xffff0000u, hi = lo + 0x10000u;
    double dl, dh, v = (double)f;

    if (isnan(f))
        return (uint16_t)((x >> 16) | 0x40);
    if ((x & 0xffffu) == 0)
        return (uint16_t)(x >> 16);
    /* Past the largest finite value the next candidate is 2^128 (Inf). */
    dl = fabs(v - (double)bitsf(lo));
    dh = fabs(((hi & 0x7f800000u) == 0x7f800000u ? copysign(ldexp(1.0, 128), v)
                                                  : (double)bitsf(hi)) - v);
    if (dl < dh || (dl == dh && (lo & 0x10000u) == 0))
        return (uint16_t)(lo >> 16);
    return (uint16_t)(hi >> 16);
}

static bool f16_is_nan(uint16_t h)
{
    return (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0;
}

Test(dtype, names_round_trip)
{
    for (int t = 0; t < DTYPE_COUNT; t++) {
        enum dtype back;
        cr_assert_eq(dtype_parse(dtype_name((enum dtype)t), &back), 0);
        cr_assert_eq(back, (enum dtype)t);
    }
    for (int op = 0; op < DTYPE_OP_COUNT; op++) {
        enum dtype_op back;
        cr_assert_eq(dtype_parse_op(dtype_op_name((enum dtype_op)op), &back), 0);
        cr_assert_eq(back, (enum dtype_op)op);
    }
}

Test(dtype, parse_rejects_unknown)
{
    enum dtype t;
    enum dtype_op op;
    static const char *const bad[] = { "", "F32", "float", "f8", "f32 ", "i16", "bf" };

    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        cr_assert_eq(dtype_parse(bad[i], &t), -EINVAL, "%s", bad[i]);
    cr_assert_eq(dtype_parse(NULL, &t), -EINVAL);
    cr_assert_eq(dtype_parse_op("prod", &op), -EINVAL);
    cr_assert_eq(dtype_parse_op("SUM", &op), -EINVAL);
    cr_assert_eq(dtype_parse_op(NULL, &op), -EINVAL);
    cr_assert_not(dtype_valid(-1));
    cr_assert_not(dtype_valid(DTYPE_COUNT));
    cr_assert_not(dtype_op_valid(DTYPE_OP_COUNT));
}

Test(dtype, sizes_and_accumulation)
{
    cr_assert_eq(dtype_size(DTYPE_F32), 4);
    cr_assert_eq(dtype_size(DTYPE_F64), 8);
    cr_assert_eq(dtype_size(DTYPE_F16), 2);
    cr_assert_eq(dtype_size(DTYPE_BF16), 2);
    cr_assert_eq(dtype_size(DTYPE_I32), 4);
    cr_assert_eq(dtype_size(DTYPE_I64), 8);
    cr_assert_eq(dtype_acc(DTYPE_F16), DTYPE_F32);
    cr_assert_eq(dtype_acc(DTYPE_BF16), DTYPE_F32);
    cr_assert_eq(dtype_acc(DTYPE_I64), DTYPE_I64);
    cr_assert(dtype_is_16bit_float(DTYPE_BF16));
    cr_assert_not(dtype_is_16bit_float(DTYPE_F32));
}

/* Every float16 bit pattern widens exactly like the compiler's, and
 * narrows back to itself (NaNs stay NaNs with their sign). */
Test(dtype, f16_widen_exhaustive)
{
    for (uint32_t h = 0; h <= 0xffff; h++) {
        float got = dtype_f16_to_f32((uint16_t)h), want = ref_f16_to_f32((uint16_t)h);
        uint16_t back = dtype_f32_to_f16(got);

        if (f16_is_nan((uint16_t)h)) {
            cr_assert(isnan(got), "%04x", h);
            cr_assert(fbits(got) & 0x400000u, "%04x widens to a quiet NaN", h);
            cr_assert(f16_is_nan(back), "%04x", h);
            cr_assert_eq(back & 0x8000u, h & 0x8000u);
            cr_assert(back & 0x200u, "quiet");
            continue;
        }
        cr_assert_eq(fbits(got), fbits(want), "%04x", h);
        cr_assert_eq(back, h, "%04x -> %08x -> %04x", h, fbits(got), back);
    }
}

/* How one narrowing conversion is checked against its reference: on every
 * float whose top bits are any `hi` below 1 << (32 - shift) and whose low
 * `shift` bits are each of lows[], then on a million pseudo-random floats
 * from `seed`. With any_nan, a NaN need only narrow to some NaN. */
struct narrowing {
    uint16_t (*got)(float);
    uint16_t (*want)(float);
    unsigned shift;
    const uint32_t *lows;
    size_t n_lows;
    uint64_t seed;
    bool any_nan;
};

static void check_narrow_one(const struct narrowing *c, float f)
{
    uint16_t got = c->got(f), want = c->want(f);

    if (c->any_nan && isnan(f))
        cr_assert(f16_is_nan(got), "%08x: %04x is no NaN", fbits(f), got);
    else if (got != want)
        cr_assert_eq(got, want, "%08x: %04x, want %04x", fbits(f), got, want);
}

static void check_narrowing(const struct narrowing *c)
{
    uint64_t seed = c->seed;

    for (uint32_t hi = 0; hi < (1u << (32 - c->shift)); hi++)
        for (size_t k = 0; k < c->n_lows; k++)
            check_narrow_one(c, bitsf(hi << c->shift | c->lows[k]));
    for (int i = 0; i < 1000000; i++) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        check_narrow_one(c, bitsf((uint32_t)(seed >> 32)));
    }
}

/* Narrowing against the compiler's correctly rounded conversion, on every
 * combination of sign, exponent and top mantissa bits with the low bits
 * set to the patterns that decide rounding (exact, just below, at and just
 * above a tie, all ones), which covers normals, subnormals, overflow to
 * infinity and underflow to zero; then a million random patterns. */
Test(dtype, f16_narrow_matches_reference)
{
    static const uint32_t lows[] = { 0x000, 0x001, 0x7ff, 0x800, 0x801, 0xfff };

    check_narrowing(&(struct narrowing){
        .got = dtype_f32_to_f16, .want = ref_f16, .shift = 12, .lows = lows,
        .n_lows = sizeof lows / sizeof lows[0], .seed = 0x9e3779b97f4a7c15ull, .any_nan = true });
}

Test(dtype, bf16_conversions)
{
    static const uint32_t lows[] = { 0x0000, 0x0001, 0x7fff, 0x8000, 0x8001, 0xffff };

    for (uint32_t h = 0; h <= 0xffff; h++) {
        float f = dtype_bf16_to_f32((uint16_t)h);
        cr_assert_eq(fbits(f), h << 16);
        if (!isnan(f))
            cr_assert_eq(dtype_f32_to_bf16(f), h);
        else
            cr_assert(isnan(dtype_bf16_to_f32(dtype_f32_to_bf16(f))));
    }
    check_narrowing(&(struct narrowing){
        .got = dtype_f32_to_bf16, .want = ref_bf16, .shift = 16, .lows = lows,
        .n_lows = sizeof lows / sizeof lows[0], .seed = 7, .any_nan = false });
    cr_assert_eq(dtype_f32_to_bf16(3.4028235e38f), 0x7f80, "FLT_MAX rounds to infinity");
    cr_assert_eq(dtype_f32_to_bf16(-0.0f), 0x8000);
}

/* The bulk conversions (vectorised, or F16C where the CPU has it) agree
 * bytewise with the scalar ones at every length, NaNs, infinities and
 * subnormals included, so the blocks and the scalar tails agree. */
Test(dtype, bulk_conversions_match_scalar)
{
    static const uint32_t odd[] = { 0x7f800001, 0xff812345, 0x7fc00001, 0x7f800000, 0x00000001,
                                    0x33000001, 0x38800000, 0x477ff000, 0x80000000, 0x387fe000 };
    float f[97], back[97];
    uint16_t h[97], b[97];

    for (size_t i = 0; i < 97; i++)
        f[i] = i % 7 == 3 ? bitsf(odd[(i / 7) % 10])
                          : (float)i * 0.37f - 11.0f + (i % 5 == 0 ? 1e-6f : 0);
    for (size_t n = 0; n <= 97; n++) {
        memset(h, 0xaa, sizeof h);
        dtype_narrow(DTYPE_F16, h, f, n);
        dtype_narrow(DTYPE_BF16, b, f, n);
        for (size_t i = 0; i < n; i++) {
            cr_assert_eq(h[i], dtype_f32_to_f16(f[i]));
            cr_assert_eq(b[i], dtype_f32_to_bf16(f[i]));
        }
        if (n < 97)
            cr_assert_eq(h[n], 0xaaaa, "no write past n");
        for (size_t i = 0; i < n; i++)
            if (i % 11 == 5)
                h[i] = (uint16_t)(i % 2 ? 0x7c01 + i : 0x0001 + i); /* sNaN, subnormal */
        dtype_widen(DTYPE_F16, back, h, n);
        for (size_t i = 0; i < n; i++)
            cr_assert_eq(fbits(back[i]), fbits(dtype_f16_to_f32(h[i])), "%04x", h[i]);
        dtype_widen(DTYPE_BF16, back, b, n);
        for (size_t i = 0; i < n; i++)
            cr_assert_eq(fbits(back[i]), fbits(dtype_bf16_to_f32(b[i])));
    }
}

static float fmin_ref(float a, float b)
{
    if (isnan(b))
        return b;
    return b < a ? b : a;
}

static float fmax_ref(float a, float b)
{
    if (isnan(b))
        return b;
    return b > a ? b : a;
}

Test(dtype, combine_f32_every_op_and_length)
{
    float d[131], s[131], want[131];

    for (size_t n = 0; n <= 131; n += (n < 40 ? 1 : 13))
        for (int op = 0; op < DTYPE_OP_COUNT; op++) {
            for (size_t i = 0; i < n; i++) {
                d[i] = (float)((int)(i * 7 % 11) - 5);
                s[i] = (float)((int)(i * 5 % 13) - 6);
                if (i % 17 == 3)
                    s[i] = NAN;
                if (i % 19 == 4)
                    d[i] = NAN;
                if (i % 23 == 5) {
                    d[i] = 0.0f;
                    s[i] = -0.0f;
                }
                want[i] = op == DTYPE_MIN ? fmin_ref(d[i], s[i])
                          : op == DTYPE_MAX ? fmax_ref(d[i], s[i])
                                            : d[i] + s[i];
            }
            dtype_combine(DTYPE_F32, (enum dtype_op)op, d, s, n);
            for (size_t i = 0; i < n; i++) {
                if (isnan(want[i]))
                    cr_assert(isnan(d[i]), "op %d i %zu", op, i);
                else
                    cr_assert_eq(fbits(d[i]), fbits(want[i]), "op %d i %zu: %g want %g", op, i,
                                 (double)d[i], (double)want[i]);
            }
        }
}

Test(dtype, combine_f64_and_ints)
{
    enum { N = 53 };
    double d[N], s[N];
    int32_t a[N], b[N];
    int64_t x[N], y[N];

    for (int op = 0; op < DTYPE_OP_COUNT; op++) {
        for (int i = 0; i < N; i++) {
            d[i] = i * 0.5 - 7;
            s[i] = i % 3 ? -d[i] * 2 : NAN;
            a[i] = i == 0 ? INT32_MAX : i - 20;
            b[i] = i == 0 ? 1 : 30 - i;
            x[i] = i == 0 ? INT64_MAX : (int64_t)i << 40;
            y[i] = i == 0 ? 1 : -((int64_t)i << 39);
        }
        dtype_combine(DTYPE_F64, (enum dtype_op)op, d, s, N);
        dtype_combine(DTYPE_I32, (enum dtype_op)op, a, b, N);
        dtype_combine(DTYPE_I64, (enum dtype_op)op, x, y, N);
        for (int i = 0; i < N; i++) {
            double d0 = i * 0.5 - 7, s0 = i % 3 ? -d0 * 2 : NAN;
            int64_t a0 = i == 0 ? INT32_MAX : i - 20, b0 = i == 0 ? 1 : 30 - i;
            int64_t x0 = i == 0 ? INT64_MAX : (int64_t)i << 40;
            int64_t y0 = i == 0 ? 1 : -((int64_t)i << 39);

            if (op == DTYPE_MIN) {
                cr_assert(isnan(s0) ? isnan(d[i]) : d[i] == (s0 < d0 ? s0 : d0));
                cr_assert_eq(a[i], b0 < a0 ? b0 : a0);
                cr_assert_eq(x[i], y0 < x0 ? y0 : x0);
            } else if (op == DTYPE_MAX) {
                cr_assert(isnan(s0) ? isnan(d[i]) : d[i] == (s0 > d0 ? s0 : d0));
                cr_assert_eq(a[i], b0 > a0 ? b0 : a0);
                cr_assert_eq(x[i], y0 > x0 ? y0 : x0);
            } else {
                cr_assert(isnan(s0) ? isnan(d[i]) : d[i] == d0 + s0);
                /* sums wrap */
                cr_assert_eq(a[i], i == 0 ? INT32_MIN : (int32_t)(a0 + b0));
                cr_assert_eq(x[i], i == 0 ? INT64_MIN : x0 + y0);
            }
        }
    }
}

Test(dtype, combine_widen_matches_widen_then_combine)
{
    enum { N = 77 };
    uint16_t src[N];
    float d1[N], d2[N], w[N];

    for (int t = DTYPE_F16; t <= DTYPE_BF16; t++)
        for (int op = 0; op < DTYPE_OP_COUNT; op++) {
            for (int i = 0; i < N; i++) {
                float v = (float)(i % 9) - 4.5f;
                src[i] = t == DTYPE_F16 ? dtype_f32_to_f16(v * 3) : dtype_f32_to_bf16(v * 3);
                if (i % 10 == 7)
                    src[i] = t == DTYPE_F16 ? 0x7e01 : 0x7fc1;        /* NaN */
                d1[i] = d2[i] = i % 13 == 2 ? NAN : i % 13 == 3 ? -0.0f : v;
                if (i % 13 == 3)
                    src[i] = 0;                                     /* +0 against -0 */
            }
            dtype_combine_widen((enum dtype)t, (enum dtype_op)op, d1, src, N);
            dtype_widen((enum dtype)t, w, src, N);
            dtype_combine(DTYPE_F32, (enum dtype_op)op, d2, w, N);
            /* The same bits, but for a sum of two NaNs (i = 67), which may
             * carry either operand's payload: which one is the compiler's
             * choice of operand order, not the kernel's. */
            for (int i = 0; i < N; i++)
                cr_assert(fbits(d1[i]) == fbits(d2[i]) ||
                              (op != DTYPE_MIN && op != DTYPE_MAX && i % 13 == 2 && isnan(w[i]) &&
                               isnan(d1[i]) && isnan(d2[i])),
                          "type %d op %d element %d", t, op, i);
        }
}

Test(dtype, divisor_rules)
{
    double d;

    cr_assert_eq(dtype_divisor(DTYPE_F32, DTYPE_SUM, 4, 0, &d), 0);
    cr_assert_eq(d, 1);
    cr_assert_eq(dtype_divisor(DTYPE_F32, DTYPE_MAX, 4, 0, &d), 0);
    cr_assert_eq(d, 1);
    cr_assert_eq(dtype_divisor(DTYPE_F32, DTYPE_AVG, 4, 123, &d), 0);
    cr_assert_eq(d, 4);
    cr_assert_eq(dtype_divisor(DTYPE_F32, DTYPE_AVG_BY, 4, 2.5, &d), 0);
    cr_assert_eq(d, 2.5);
    cr_assert_eq(dtype_divisor(DTYPE_F32, DTYPE_AVG_BY, 4, 0, &d), -EINVAL);
    cr_assert_eq(dtype_divisor(DTYPE_F32, DTYPE_AVG_BY, 4, NAN, &d), -EINVAL);
    cr_assert_eq(dtype_divisor(DTYPE_F64, DTYPE_AVG_BY, 4, INFINITY, &d), -EINVAL);
    cr_assert_eq(dtype_divisor(DTYPE_I32, DTYPE_AVG_BY, 4, 2.5, &d), -EINVAL);
    cr_assert_eq(dtype_divisor(DTYPE_I64, DTYPE_AVG_BY, 4, 1e17, &d), -EINVAL);
    cr_assert_eq(dtype_divisor(DTYPE_I64, DTYPE_AVG_BY, 4, -3, &d), 0);
    cr_assert_eq(d, -3);
}

Test(dtype, scale_floats_and_truncating_ints)
{
    float f[19];
    double g[19];
    int32_t a[5] = { 7, -7, 8, INT32_MIN, INT32_MAX };
    int64_t x[4] = { 7, -7, INT64_MIN, INT64_MAX };

    for (int i = 0; i < 19; i++) {
        f[i] = (float)i;
        g[i] = i;
    }
    dtype_scale(DTYPE_F32, f, 19, 3);
    dtype_scale(DTYPE_F64, g, 19, 3);
    for (int i = 0; i < 19; i++) {
        cr_assert_eq(fbits(f[i]), fbits((float)i / 3.0f));
        cr_assert_eq(g[i], i / 3.0);
    }
    dtype_scale(DTYPE_I32, a, 5, 2);
    cr_assert_eq(a[0], 3);
    cr_assert_eq(a[1], -3, "truncation toward zero");
    cr_assert_eq(a[2], 4);
    cr_assert_eq(a[3], INT32_MIN / 2);
    cr_assert_eq(a[4], INT32_MAX / 2);
    a[0] = INT32_MIN;
    dtype_scale(DTYPE_I32, a, 1, -1);
    cr_assert_eq(a[0], INT32_MIN, "wraps like a sum");
    dtype_scale(DTYPE_I64, x, 4, -1);
    cr_assert_eq(x[0], -7);
    cr_assert_eq(x[1], 7);
    cr_assert_eq(x[2], INT64_MIN, "wraps like a sum");
    cr_assert_eq(x[3], -INT64_MAX);
    x[0] = -9;
    dtype_scale(DTYPE_I64, x, 1, 4);
    cr_assert_eq(x[0], -2);
    dtype_scale(DTYPE_F32, f, 19, 1);   /* divisor 1: untouched */
    cr_assert_eq(fbits(f[3]), fbits(1.0f));
}

/* --- kernel variants ------------------------------------------------------ *
 *
 * Every variant the CPU supports against the baseline, byte for byte. The
 * sanitized build that runs these compiles each variant for its own
 * instruction set but does not vectorise (sanitizers stop gcc's
 * vectoriser); bench/dtype_kernels.c makes the same comparison on the
 * release build's vectorised code. */

static uint64_t rng_next(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

/* n bytes of awkward values for type t: random bit patterns (every
 * exponent, so subnormals and NaN payloads too) mixed with the special
 * values, in runs, so that whole vectors of them occur. */
static void awkward(uint8_t *p, size_t n, enum dtype t, uint64_t *s)
{
    static const uint32_t f32s[] = { 0x7fc00000u, 0xffc00001u, 0x7f800001u, 0x7f800000u,
                                     0xff800000u, 0x00000000u, 0x80000000u, 0x00000001u,
                                     0x807fffffu, 0x7f7fffffu, 0x00800000u, 0x3f800000u };
    static const uint64_t f64s[] = { 0x7ff8000000000000u, 0xfff0000000000001u,
                                     0x7ff0000000000000u, 0xfff0000000000000u, 0,
                                     0x8000000000000000u, 1, 0x800fffffffffffffu,
                                     0x7fefffffffffffffu, 0x3ff0000000000000u };
    size_t es = dtype_size(t);

    for (size_t i = 0; i + es <= n; i += es) {
        uint64_t r = rng_next(s), v = rng_next(s);

        if (r % 3 == 0 && t == DTYPE_F32) {
            uint32_t u = f32s[v % (sizeof(f32s) / sizeof(f32s[0]))];
            memcpy(p + i, &u, 4);
        } else if (r % 3 == 0 && t == DTYPE_F64) {
            memcpy(p + i, &f64s[v % (sizeof(f64s) / sizeof(f64s[0]))], 8);
        } else if (r % 3 == 0 && es == 2) {
            /* 16-bit: Inf, NaN, zero, subnormal of either sign */
            static const uint16_t h[] = { 0x7c00, 0x7e01, 0xfc00, 0x0000, 0x8000, 0x0001,
                                          0x7f80, 0x7fc1, 0x0080, 0x8001 };
            memcpy(p + i, &h[v % 10], 2);
        } else if (r % 3 == 1 && t == DTYPE_F32) {
            float f = (float)((int64_t)(v % 2001) - 1000) * 0.375f;   /* exact sums */
            memcpy(p + i, &f, 4);
        } else {
            memcpy(p + i, &v, es);
        }
    }
}

static bool is_nan(enum dtype t, const uint8_t *p)
{
    float f;
    double d;

    if (t == DTYPE_F32) {
        memcpy(&f, p, 4);
        return f != f;
    }
    if (t == DTYPE_F64) {
        memcpy(&d, p, 8);
        return d != d;
    }
    return false;
}

/* One element of two results: the same bytes, or, for a sum of two NaNs,
 * NaNs both. */
static bool same_or_nan_sum(enum dtype t, enum dtype_op op, const uint8_t *x, const uint8_t *y,
                            const uint8_t *a, const uint8_t *b)
{
    if (memcmp(x, y, dtype_size(t)) == 0)
        return true;
    return op != DTYPE_MIN && op != DTYPE_MAX && is_nan(t, a) && is_nan(t, b) && is_nan(t, x) &&
           is_nan(t, y);
}

/* Runs `call` (which writes `out`) with every supported variant and
 * compares its bytes with the baseline's. */
#define FOR_EVERY_VARIANT(out, bytes, setup, call, what, ...)                        \
    do {                                                                            \
        static uint8_t want_[4096 + 64];                                            \
        for (size_t v_ = 0; v_ < dtype_kernels_count(); v_++) {                      \
            if (!dtype_kernels_supported(v_))                                       \
                continue;                                                           \
            cr_assert_eq(dtype_kernels_use(v_), 0);                                 \
            setup;                                                                  \
            call;                                                                   \
            if (v_ == 0)                                                            \
                memcpy(want_, out, bytes);                                          \
            else                                                                    \
                cr_assert(memcmp(want_, out, bytes) == 0, "%s differs from baseline: " what, \
                          dtype_kernels_name(v_), __VA_ARGS__);                     \
        }                                                                           \
    } while (0)

Test(dtype, variants_write_the_same_bytes)
{
    static const enum dtype accs[] = { DTYPE_F32, DTYPE_F64, DTYPE_I32, DTYPE_I64 };
    /* Odd element counts around every vector width, and offsets that
     * misalign the arrays. */
    static const size_t lens[] = { 0, 1, 3, 7, 15, 16, 17, 31, 33, 63, 65, 127, 129, 255, 257, 511 };
    static uint8_t a[4096 + 64], b[4096 + 64], d[4096 + 64];
    uint64_t seed = 0x9e3779b97f4a7c15u;
    size_t tried = 0;

    for (size_t ti = 0; ti < 4; ti++)
        for (size_t li = 0; li < sizeof(lens) / sizeof(lens[0]); li++)
            for (size_t off = 0; off < 3; off += 2)
                for (int op = 0; op < DTYPE_OP_COUNT; op++) {
                    enum dtype t = accs[ti];
                    size_t es = dtype_size(t), n = lens[li], bytes = n * es + off * es;
                    uint8_t *pa = a + off * es, *pb = b + off * es, *pd = d + off * es;

                    if (n * es + off * es > 4096)
                        continue;
                    awkward(a, sizeof(a), t, &seed);
                    awkward(b, sizeof(b), t, &seed);
                    FOR_EVERY_VARIANT(d, bytes, memcpy(d, a, sizeof(d)),
                                      dtype_combine(t, (enum dtype_op)op, pd, pb, n),
                                      "combine %s op %d n %zu off %zu", dtype_name(t), op, n,
                                      off);
                    FOR_EVERY_VARIANT(d, bytes, memset(d, 0xa5, sizeof(d)),
                                      dtype_combine_into(t, (enum dtype_op)op, pd, pa, pb, n),
                                      "combine_into %s op %d n %zu off %zu", dtype_name(t), op,
                                      n, off);
                    /* Onto: dst plays b's part; every variant writes the
                     * bytes of the baseline's into, but for a sum of two
                     * NaNs, whose payload follows the order the compiler
                     * gives a commutative add. */
                    {
                        static uint8_t into[4096 + 64];

                        cr_assert_eq(dtype_kernels_use(0), 0);
                        memset(into, 0xa5, sizeof(into));
                        dtype_combine_into(t, (enum dtype_op)op, into + off * es, pa, pb, n);
                        for (size_t v = 0; v < dtype_kernels_count(); v++) {
                            if (!dtype_kernels_supported(v))
                                continue;
                            cr_assert_eq(dtype_kernels_use(v), 0);
                            memset(d, 0xa5, sizeof(d));
                            memcpy(pd, pb, n * es);
                            dtype_combine_onto(t, (enum dtype_op)op, pd, pa, n);
                            for (size_t i = 0; i < n; i++)
                                cr_assert(same_or_nan_sum(t, (enum dtype_op)op, pd + i * es,
                                                          into + (off + i) * es, pa + i * es,
                                                          pb + i * es),
                                          "%s: combine_onto differs from combine_into: %s op %d "
                                          "n %zu off %zu at %zu", dtype_kernels_name(v),
                                          dtype_name(t), op, n, off, i);
                        }
                    }
                    tried++;
                }
    cr_assert_gt(tried, 500);
}

Test(dtype, variants_scale_the_same_bytes)
{
    static const double divs[] = { 3, 7, 4, -5, 0.1, 1e-30, 1e30, 4.9e-324, 1.0 / 3.0 };
    static uint8_t a[4096 + 64], d[4096 + 64];
    uint64_t seed = 12345;

    for (size_t ti = 0; ti < 2; ti++)
        for (size_t n = 0; n < 300; n += n < 40 ? 1 : 37)
            for (size_t di = 0; di < sizeof(divs) / sizeof(divs[0]); di++) {
                enum dtype t = ti ? DTYPE_F64 : DTYPE_F32;
                size_t es = dtype_size(t), bytes = (n + 1) * es;

                awkward(a, sizeof(a), t, &seed);
                FOR_EVERY_VARIANT(d, bytes, memcpy(d, a, sizeof(d)),
                                  dtype_scale(t, d + es, n, divs[di]),
                                  "scale %s n %zu by %g", dtype_name(t), n, divs[di]);
            }
}

Test(dtype, variants_convert_the_same_bytes)
{
    static uint8_t h[4096 + 64], f[8192 + 64], out[8192 + 64];
    uint64_t seed = 777;

    for (int ti = 0; ti < 2; ti++)
        for (size_t n = 0; n < 600; n += n < 70 ? 1 : 53)
            for (int op = 0; op < DTYPE_OP_COUNT; op++) {
                enum dtype t = ti ? DTYPE_BF16 : DTYPE_F16;

                awkward(h, sizeof(h), t, &seed);
                awkward(f, sizeof(f), DTYPE_F32, &seed);
                FOR_EVERY_VARIANT(out, (n + 1) * 4, memcpy(out, f, sizeof(out)),
                                  dtype_combine_widen(t, (enum dtype_op)op, (float *)out + 1,
                                                      (const uint16_t *)h + 1, n),
                                  "combine_widen %s op %d n %zu", dtype_name(t), op, n);
                if (op)
                    continue;
                FOR_EVERY_VARIANT(out, (n + 1) * 4, memset(out, 0, sizeof(out)),
                                  dtype_widen(t, (float *)out + 1, (const uint16_t *)h + 1, n),
                                  "widen %s n %zu", dtype_name(t), n);
                FOR_EVERY_VARIANT(out, (n + 1) * 2, memset(out, 0, sizeof(out)),
                                  dtype_narrow(t, (uint16_t *)out + 1, (const float *)f + 1, n),
                                  "narrow %s n %zu", dtype_name(t), n);
            }
}

Test(dtype, variants_are_chosen_and_named)
{
    size_t n = dtype_kernels_count(), best = 0;

    cr_assert_geq(n, 1);
    cr_assert_str_eq(dtype_kernels_name(0), "baseline");
    cr_assert(dtype_kernels_supported(0));
    cr_assert_null(dtype_kernels_name(n));
    cr_assert_not(dtype_kernels_supported(n));
    for (size_t i = 0; i < n; i++)
        if (dtype_kernels_supported(i))
            best = i;
    cr_assert_eq(dtype_kernels_current(), best, "the best the CPU supports is the default");
    cr_assert_eq(dtype_kernels_use(n), -EINVAL);
    cr_assert_eq(dtype_kernels_current(), best, "a refused choice changes nothing");
    for (size_t i = 0; i < n; i++)
        if (!dtype_kernels_supported(i))
            cr_assert_eq(dtype_kernels_use(i), -ENOTSUP);
    cr_assert_eq(dtype_kernels_use(0), 0);
    cr_assert_eq(dtype_kernels_current(), 0);
}

/* The streaming copy writes exactly the source's bytes at every alignment
 * of either end and every length around the 16-byte stores, and nothing
 * beside them. */
Test(dtype, streaming_copy_is_exact_at_every_alignment)
{
    static uint8_t src[1024 + 64], dst[1024 + 64];
    uint64_t seed = 0x243f6a8885a308d3u;
    size_t tried = 0;

    awkward(src, sizeof(src), DTYPE_I64, &seed);
    for (size_t so = 0; so < 17; so++)
        for (size_t dof = 0; dof < 17; dof++)
            for (size_t len = 0; len < 70; len += (len < 40 ? 1 : 7)) {
                memset(dst, 0x5a, sizeof(dst));
                dtype_copy_streaming(dst + dof, src + so, len);
                cr_assert(memcmp(dst + dof, src + so, len) == 0, "so %zu do %zu len %zu", so, dof,
                          len);
                for (size_t i = 0; i < sizeof(dst); i++)
                    if (i < dof || i >= dof + len)
                        cr_assert_eq(dst[i], 0x5a, "byte %zu written: so %zu do %zu len %zu", i,
                                     so, dof, len);
                tried++;
            }
    memset(dst, 0, sizeof(dst));
    dtype_copy_streaming(dst + 3, src + 5, 1024);
    cr_assert(memcmp(dst + 3, src + 5, 1024) == 0);
    cr_assert_gt(tried, 10000);
}

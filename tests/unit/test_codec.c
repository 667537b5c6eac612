/* tests/unit/test_codec.c: the wire codecs against references computed
 * here: the compiler's _Float16 for fp16, a double-precision nearest-even
 * rounding for bf16, and a double-precision error bound and exact cases
 * for int8, a double-precision mean and deviation and the compiler's
 * _Float16 for meanstd16, rint() and per-bin means for uniform8, a sorted
 * sample's interpolated quantiles, a linear count of the borders below
 * each value and per-bucket means for quantile8; halfway
 * cases, NaN, Inf, subnormals, zero blocks, block extremes and short
 * tails; and every kernel variant against the baseline, byte for byte. */
#include <criterion/criterion.h>

#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "engine/codec.h"
#include "engine/dtype.h"

#define BITCAST(To, From, x) (((union { From from; To to; }){ .from = (x) }).to)

static uint32_t fbits(float f)
{
    return BITCAST(uint32_t, float, f);
}

static float bitsf(uint32_t u)
{
    return BITCAST(float, uint32_t, u);
}

/* xorshift: the same inputs every run. */
static uint32_t rnd(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return (uint32_t)(*s >> 11);
}

/* Finite floats of every magnitude float16 and bfloat16 care about, and
 * the special ones. */
static void make_inputs(float *x, size_t n, uint64_t seed)
{
    static const uint32_t special[] = {
        0x00000000, 0x80000000, 0x7f800000, 0xff800000, 0x7fc00000, 0xffc12345, 0x7f800001,
        0x00000001, 0x807fffff, 0x33000000, 0x33000001, 0x387fc000, 0x38800000, 0x477fe000,
        0x477ff000, 0x477fefff, 0x7f7fffff, 0xff7f8000, 0x7f7f8000, 0x3f808000, 0x3f818000,
    };

    for (size_t i = 0; i < n; i++) {
        uint32_t r = rnd(&seed);

        if (i % 13 == 0)
            x[i] = bitsf(special[(i / 13) % (sizeof special / sizeof special[0])]);
        else if (i % 3 == 0)    /* anywhere from subnormal to huge */
            x[i] = bitsf(r & 0xffffffffu);
        else                    /* around float16's range */
            x[i] = bitsf((r & 0x807fffffu) | ((uint32_t)(100 + r % 60) << 23));
        if (isnan(x[i]) && i % 13 != 0)
            x[i] = 1.0f;
    }
}

/* bfloat16 by definition: the nearer of the two candidates that keep the
 * top 16 bits, ties to the even one, past the largest finite to Inf. */
static float ref_bf16(float f)
{
    uint32_t x = fbits(f), lo = x & 0xffff0000u, hi = lo + 0x10000u;
    double v = f, dl, dh;

    if (isnan(f))
        return bitsf(((x >> 16) | 0x40) << 16);
    if ((x & 0xffffu) == 0)
        return f;
    dl = fabs(v - (double)bitsf(lo));
    dh = fabs(((hi & 0x7f800000u) == 0x7f800000u ? copysign(ldexp(1.0, 128), v)
                                                  : (double)bitsf(hi)) - v);
    if (dl < dh || (dl == dh && (lo & 0x10000u) == 0))
        return bitsf(lo);
    return bitsf(hi);
}

static void assert_same_float(float got, float want, const char *what, size_t i, float in)
{
    if (isnan(want)) {
        cr_assert(isnan(got), "%s: element %zu (%a): want NaN, got %a", what, i, in, got);
        return;
    }
    cr_assert_eq(fbits(got), fbits(want), "%s: element %zu (%a): want %a, got %a", what, i,
                 in, want, got);
}

Test(codec, names_sizes_and_support)
{
    enum codec c;

    int valid = 0;

    for (int k = 0; k < CODEC_END; k++) {
        if (!codec_valid(k))
            continue;
        valid++;
        cr_assert_eq(codec_parse(codec_name((enum codec)k), &c), 0);
        cr_assert_eq(c, (enum codec)k);
    }
    cr_assert_eq(valid, 7);
    cr_assert_eq(codec_bytes(CODEC_UNIFORM8, 10), 1034);
    cr_assert_eq(codec_bytes(CODEC_QUANTILE8, 10), 1034);
    cr_assert_eq(codec_parse("quantile8", &c), 0);
    cr_assert_eq(c, CODEC_QUANTILE8);
    cr_assert(!codec_supports(CODEC_QUANTILE8, DTYPE_F64));
    cr_assert_eq(codec_parse("meanstd16", &c), 0);
    cr_assert_eq(c, CODEC_MEANSTD16);
    cr_assert_eq(codec_parse("int4", &c), -EINVAL);
    cr_assert_eq(codec_parse(NULL, &c), -EINVAL);
    /* 4 and 5 are the Accumulator's top-k and PowerSGD, not codecs. */
    cr_assert(!codec_valid(4));
    cr_assert(!codec_valid(5));
    cr_assert_str_eq(codec_name((enum codec)4), "unknown");
    cr_assert(!codec_valid(CODEC_END));
    cr_assert(!codec_valid(-1));
    cr_assert_eq(codec_bytes(CODEC_MEANSTD16, 0), 8);
    cr_assert_eq(codec_bytes(CODEC_MEANSTD16, 1000), 2008);
    cr_assert(codec_supports(CODEC_MEANSTD16, DTYPE_F32));
    cr_assert(!codec_supports(CODEC_MEANSTD16, DTYPE_F16));
    cr_assert_eq(codec_bytes(CODEC_NONE, 1000), 4000);
    cr_assert_eq(codec_bytes(CODEC_FP16, 1000), 2000);
    cr_assert_eq(codec_bytes(CODEC_BF16, 7), 14);
    cr_assert_eq(codec_bytes(CODEC_INT8, 0), 0);
    cr_assert_eq(codec_bytes(CODEC_INT8, 1), 5);
    cr_assert_eq(codec_bytes(CODEC_INT8, 256), 260);
    cr_assert_eq(codec_bytes(CODEC_INT8, 257), 265);
    cr_assert_eq(codec_bytes(CODEC_INT8, 65536), 65536 + 1024);
    cr_assert(codec_supports(CODEC_NONE, DTYPE_I64));
    cr_assert(codec_supports(CODEC_INT8, DTYPE_F32));
    cr_assert(!codec_supports(CODEC_FP16, DTYPE_F64));
    cr_assert(!codec_supports(CODEC_BF16, DTYPE_BF16));
}

#define N 20011

Test(codec, fp16_matches_the_compilers_float16)
{
    float *x = malloc(N * 4), *back = malloc(N * 4);
    uint16_t *w = malloc(N * 2);

    make_inputs(x, N, 7);
    codec_encode(CODEC_FP16, w, x, N);
    codec_decode(CODEC_FP16, back, w, N);
    for (size_t i = 0; i < N; i++)
        assert_same_float(back[i], (float)(_Float16)x[i], "fp16", i, x[i]);
    free(x);
    free(back);
    free(w);
}

/* Every value halfway between two neighbouring float16 values (exact in
 * float32) rounds to the even one, in the normal and subnormal ranges,
 * with either sign; and the overflow threshold 65520 goes to Inf. */
Test(codec, fp16_halfway_cases_round_to_even)
{
    static float x[2 * 0x7bff], back[2 * 0x7bff];
    static uint16_t w[2 * 0x7bff];
    size_t n = 0;

    for (uint32_t h = 0; h < 0x7bff; h++) {
        float a = (float)BITCAST(_Float16, uint16_t, (uint16_t)h);
        float b = (float)BITCAST(_Float16, uint16_t, (uint16_t)(h + 1));
        float mid = a + (b - a) / 2;

        x[n++] = mid;
        x[n++] = -mid;
    }
    codec_encode(CODEC_FP16, w, x, n);
    codec_decode(CODEC_FP16, back, w, n);
    for (size_t i = 0; i < n; i++) {
        uint16_t h = (uint16_t)(i / 2);
        uint16_t want = (h & 1) ? (uint16_t)(h + 1) : h;

        cr_assert_eq(w[i] & 0x7fffu, want, "midpoint above %04x went to %04x", h, w[i]);
        assert_same_float(back[i], (float)(_Float16)x[i], "fp16 halfway", i, x[i]);
    }
    x[0] = 65520.0f;
    x[1] = 65519.99609375f;
    x[2] = -INFINITY;
    x[3] = bitsf(0x7f800001);   /* signalling NaN: kept NaN, made quiet */
    codec_encode(CODEC_FP16, w, x, 4);
    cr_assert_eq(w[0], 0x7c00);
    cr_assert_eq(w[1], 0x7bff);
    cr_assert_eq(w[2], 0xfc00);
    cr_assert_eq(w[3] & 0x7e00u, 0x7e00u);
}

Test(codec, bf16_matches_a_double_reference)
{
    float *x = malloc(N * 4), *back = malloc(N * 4);
    uint16_t *w = malloc(N * 2);

    make_inputs(x, N, 11);
    codec_encode(CODEC_BF16, w, x, N);
    codec_decode(CODEC_BF16, back, w, N);
    for (size_t i = 0; i < N; i++)
        assert_same_float(back[i], ref_bf16(x[i]), "bf16", i, x[i]);
    /* Halfway cases: both neighbours' midpoint, even and odd below. */
    for (size_t i = 0; i < N; i++)
        x[i] = bitsf(((rnd(&(uint64_t){ i + 1 }) & 0xff7f0000u) | 0x8000u) + (i % 2) * 0x10000u);
    codec_encode(CODEC_BF16, w, x, N);
    codec_decode(CODEC_BF16, back, w, N);
    for (size_t i = 0; i < N; i++) {
        uint32_t lo = fbits(x[i]) & 0xffff0000u;

        assert_same_float(back[i], ref_bf16(x[i]), "bf16 halfway", i, x[i]);
        if (!isnan(x[i]) && !isinf(back[i]))
            cr_assert_eq(fbits(back[i]), (lo & 0x10000u) ? lo + 0x10000u : lo);
    }
    free(x);
    free(back);
    free(w);
}

/* Every block's error within half a step of its scale (and float32's
 * rounding of the quotient and the product), the block's extreme exact
 * (+-127 steps), other blocks untouched by a non-finite value. */
Test(codec, int8_within_half_a_step_per_block)
{
    size_t n = 10 * CODEC_INT8_BLOCK + 37;
    float *x = malloc(n * 4), *back = malloc(n * 4);
    uint8_t *w = malloc(codec_bytes(CODEC_INT8, n));
    uint64_t seed = 3;

    for (size_t i = 0; i < n; i++) {
        size_t blk = i / CODEC_INT8_BLOCK;
        /* Each block its own magnitude: 1e-40 (subnormal) up to 1e37. */
        static const float mag[] = { 1, 1e-3f, 1e-40f, 1e37f, 3e5f, 0.5f, 1e-20f, 7, 1e10f,
                                     2e-38f, 1 };
        x[i] = mag[blk] * (((float)(rnd(&seed) % 20001) - 10000.0f) / 10000.0f);
    }
    codec_encode(CODEC_INT8, w, x, n);
    codec_decode(CODEC_INT8, back, w, n);
    for (size_t b = 0; b * CODEC_INT8_BLOCK < n; b++) {
        size_t lo = b * CODEC_INT8_BLOCK, hi = lo + CODEC_INT8_BLOCK < n ? lo + CODEC_INT8_BLOCK : n;
        double amax = 0, s, bound;
        float scale;

        for (size_t i = lo; i < hi; i++)
            amax = fabs(x[i]) > amax ? fabs(x[i]) : amax;
        memcpy(&scale, w + 4 * b, 4);
        s = (double)(float)((float)amax / 127.0f);
        cr_assert_eq(fbits(scale), fbits((float)s), "block %zu scale", b);
        bound = s / 2 * (1 + 1e-6) + 128 * s * 0x1p-23 + 0x1p-149;
        for (size_t i = lo; i < hi; i++) {
            double err = fabs((double)back[i] - (double)x[i]);

            cr_assert_leq(err, bound, "block %zu element %zu: %a -> %a", b, i, x[i], back[i]);
            if (fabs(x[i]) == amax && s > 0)
                cr_assert_eq(fabs((double)back[i]), (double)(float)(127.0f * (float)s),
                             "the extreme maps to 127 steps");
        }
    }
    free(x);
    free(back);
    free(w);
}

Test(codec, int8_exact_cases_zero_blocks_and_non_finite)
{
    size_t n = 3 * CODEC_INT8_BLOCK + 5;
    float x[3 * CODEC_INT8_BLOCK + 5], back[3 * CODEC_INT8_BLOCK + 5];
    uint8_t w[4 * 4 + 3 * CODEC_INT8_BLOCK + 5];
    float s;

    /* Block 0: scale exactly 1, so halfway values show the rounding. */
    memset(x, 0, sizeof x);
    x[0] = 127;
    x[1] = 2.5f;
    x[2] = 3.5f;
    x[3] = -2.5f;
    x[4] = -127;
    x[5] = 0.5f;
    x[6] = 1.5f;
    x[7] = -0.0f;
    /* Block 1: all zero. Block 2: holds Inf (and NaN). Tail: 5 values. */
    x[2 * CODEC_INT8_BLOCK + 9] = INFINITY;
    x[2 * CODEC_INT8_BLOCK + 10] = NAN;
    x[2 * CODEC_INT8_BLOCK + 11] = 4;
    for (size_t i = 3 * CODEC_INT8_BLOCK; i < n; i++)
        x[i] = -(float)(i - 3 * CODEC_INT8_BLOCK);      /* 0, -1 .. -4 */
    cr_assert_eq(codec_bytes(CODEC_INT8, n), sizeof w);
    codec_encode(CODEC_INT8, w, x, n);
    codec_decode(CODEC_INT8, back, w, n);
    memcpy(&s, w, 4);
    cr_assert_eq(s, 1.0f);
    cr_assert_eq(back[0], 127);
    cr_assert_eq(back[1], 2);
    cr_assert_eq(back[2], 4);
    cr_assert_eq(back[3], -2);
    cr_assert_eq(back[4], -127);
    cr_assert_eq(back[5], 0);
    cr_assert_eq(back[6], 2);
    cr_assert_eq(fbits(back[7]), 0, "-0 decodes as +0");
    memcpy(&s, w + 4, 4);
    cr_assert_eq(fbits(s), 0, "a zero block has scale 0");
    for (size_t i = CODEC_INT8_BLOCK; i < 2 * CODEC_INT8_BLOCK; i++)
        cr_assert_eq(fbits(back[i]), 0);
    memcpy(&s, w + 8, 4);
    cr_assert(isnan(s));
    for (size_t i = 2 * CODEC_INT8_BLOCK; i < 3 * CODEC_INT8_BLOCK; i++)
        cr_assert(isnan(back[i]), "a non-finite block decodes as NaN");
    memcpy(&s, w + 12, 4);
    cr_assert_eq(s, 4.0f / 127.0f);
    for (size_t i = 3 * CODEC_INT8_BLOCK; i < n; i++)
        cr_assert_leq(fabsf(back[i] - x[i]), s / 2 * 1.000001f);
    cr_assert_eq(back[n - 1], -127.0f * s, "the tail's extreme is 127 steps: %a", back[n - 1]);

    /* Extremes of the float range: no overflow in x / s. */
    x[0] = FLT_MAX;
    x[1] = -FLT_MAX;
    x[2] = FLT_MAX / 3;
    x[3] = bitsf(1);            /* the smallest subnormal: its own scale underflows */
    codec_encode(CODEC_INT8, w, x, 3);
    codec_decode(CODEC_INT8, back, w, 3);
    cr_assert(isfinite(back[0]) && isfinite(back[1]));
    cr_assert_eq(back[0], -back[1]);
    cr_assert_leq(fabs((double)back[2] - (double)x[2]), (double)FLT_MAX / 254 * 1.000001);
    codec_encode(CODEC_INT8, w, x + 3, 1);
    codec_decode(CODEC_INT8, back, w, 1);
    cr_assert_eq(fbits(back[0]), 0);
}

/* What a ring owner relies on: fp16 and bf16 give the same bytes when a
 * decoded value is encoded again. */
Test(codec, sixteen_bit_codecs_are_idempotent_on_their_output)
{
    float *x = malloc(N * 4), *back = malloc(N * 4);
    uint16_t *w = malloc(N * 2), *w2 = malloc(N * 2);

    make_inputs(x, N, 5);
    for (enum codec c = CODEC_FP16; c <= CODEC_BF16; c++) {
        codec_encode(c, w, x, N);
        codec_decode(c, back, w, N);
        codec_encode(c, w2, back, N);
        cr_assert_eq(memcmp(w, w2, N * 2), 0, "%s", codec_name(c));
    }
    free(x);
    free(back);
    free(w);
    free(w2);
}

/* meanstd16 against a reference built here: the mean and deviation in
 * double (two passes, as hivemind's torch code does in float32), the
 * element through float32 and the compiler's _Float16, decoded in double.
 * Byte for byte, and within the stated bound of the input. */
static void meanstd16_check(const float *x, size_t n)
{
    uint8_t *w = malloc(codec_bytes(CODEC_MEANSTD16, n));
    float *back = malloc((n ? n : 1) * 4), m, s, got;
    double sum = 0, sq = 0, sd;

    for (size_t i = 0; i < n; i++)
        sum += x[i];
    m = n ? (float)(sum / (double)n) : 0;
    for (size_t i = 0; i < n; i++)
        sq += ((double)x[i] - m) * ((double)x[i] - m);
    sd = n ? sqrt(sq / (double)n) : 0;
    s = sd > FLT_MAX ? FLT_MAX : (float)sd;
    s = s < FLT_EPSILON ? FLT_EPSILON : s;

    codec_encode(CODEC_MEANSTD16, w, x, n);
    codec_decode(CODEC_MEANSTD16, back, w, n);
    memcpy(&got, w, 4);
    cr_assert_eq(fbits(got), fbits(m), "mean %a, want %a", got, m);
    memcpy(&got, w + 4, 4);
    cr_assert_eq(fbits(got), fbits(s), "deviation %a, want %a", got, s);
    for (size_t i = 0; i < n; i++) {
        _Float16 y = (_Float16)(float)(((double)x[i] - m) / s);
        uint16_t yb;
        float want = (float)((double)(float)y * s + m);
        double err = fabs((double)back[i] - x[i]);
        double bound = 0x1p-11 * fabs((double)x[i] - m) + 0x1p-25 * s +
                       0x1p-24 * fabs((double)back[i]) + 0x1p-40 * fabs((double)m);

        memcpy(&yb, w + 8 + 2 * i, 2);
        cr_assert_eq(yb, BITCAST(uint16_t, _Float16, y), "element %zu: %a", i, x[i]);
        cr_assert_eq(fbits(back[i]), fbits(want), "element %zu: %a -> %a, want %a", i, x[i],
                     back[i], want);
        cr_assert_leq(err, bound, "element %zu: %a -> %a", i, x[i], back[i]);
    }
    free(w);
    free(back);
}

Test(codec, meanstd16_matches_a_reference_within_its_bound)
{
    size_t n = 5000;
    float *x = malloc(n * 4);
    uint64_t seed = 11;
    /* Unit scale; a large mean with small spread (plain fp16 keeps it to
     * 2^-11 of the mean, this to 2^-11 of the spread); values far past
     * fp16's range; tiny ones. */
    static const float mean[] = { 0, 1000, 3e8f, 0, -2e-30f };
    static const float spread[] = { 1, 0.01f, 1e6f, 1e30f, 1e-31f };

    for (size_t k = 0; k < sizeof mean / sizeof mean[0]; k++) {
        for (size_t i = 0; i < n; i++)
            x[i] = mean[k] + spread[k] * (((float)(rnd(&seed) % 20001) - 10000.0f) / 10000.0f);
        meanstd16_check(x, n);
        meanstd16_check(x, 1);
        meanstd16_check(x, 3);
    }
    meanstd16_check(x, 0);
    free(x);
}

Test(codec, meanstd16_constant_runs_extremes_and_non_finite)
{
    float x[64], back[64];
    uint8_t w[8 + 2 * 64];

    /* A run of one value: deviation floored at FLT_EPSILON, y = 0, the
     * value back exactly. */
    for (size_t i = 0; i < 64; i++)
        x[i] = 3.25f;
    codec_encode(CODEC_MEANSTD16, w, x, 64);
    codec_decode(CODEC_MEANSTD16, back, w, 64);
    for (size_t i = 0; i < 64; i++)
        cr_assert_eq(back[i], 3.25f);

    /* +-FLT_MAX: the mean is 0, the deviation FLT_MAX, no Inf anywhere. */
    for (size_t i = 0; i < 64; i++)
        x[i] = i % 2 ? FLT_MAX : -FLT_MAX;
    meanstd16_check(x, 64);
    codec_encode(CODEC_MEANSTD16, w, x, 64);
    codec_decode(CODEC_MEANSTD16, back, w, 64);
    for (size_t i = 0; i < 64; i++)
        cr_assert(isfinite(back[i]) && fabsf(back[i]) >= 0.999f * FLT_MAX, "%a", back[i]);

    /* One NaN or Inf: the whole run decodes as NaN. */
    for (int bad = 0; bad < 2; bad++) {
        for (size_t i = 0; i < 64; i++)
            x[i] = (float)i;
        x[17] = bad ? INFINITY : NAN;
        codec_encode(CODEC_MEANSTD16, w, x, 64);
        codec_decode(CODEC_MEANSTD16, back, w, 64);
        for (size_t i = 0; i < 64; i++)
            cr_assert(isnan(back[i]), "%s: element %zu is %a", bad ? "inf" : "nan", i, back[i]);
    }
}

/* uniform8 against a reference built here: the mean and unbiased
 * deviation in double, the bin by rint() (nearest even), the codebook the
 * per-bin mean. Byte for byte; each value within a bin's width of its
 * decoding, or, clamped into an end bin, between that bin's extremes. */
static void uniform8_check(const float *x, size_t n)
{
    enum { B = CODEC_UNIFORM8_BINS };
    uint8_t *w = malloc(codec_bytes(CODEC_UNIFORM8, n));
    float *back = malloc((n ? n : 1) * 4), cb[B];
    uint8_t *q = malloc(n ? n : 1);
    double sum = 0, sq = 0, m = 0, h = 0, bsum[B] = { 0 }, lo[B], hi[B];
    size_t cnt[B] = { 0 };

    for (size_t k = 0; k < B; k++) {
        lo[k] = INFINITY;
        hi[k] = -INFINITY;
    }
    for (size_t i = 0; i < n; i++)
        sum += x[i];
    m = n ? sum / (double)n : 0;
    for (size_t i = 0; i < n; i++)
        sq += ((double)x[i] - m) * ((double)x[i] - m);
    h = n > 1 ? 6 * sqrt(sq / (double)(n - 1)) / B : 0;
    for (size_t i = 0; i < n; i++) {
        double v = h > 0 ? rint(((double)x[i] - m) / h) + 128 : 128;

        q[i] = (uint8_t)(v < 0 ? 0 : v > 255 ? 255 : v);
        bsum[q[i]] += x[i];
        cnt[q[i]]++;
        lo[q[i]] = x[i] < lo[q[i]] ? x[i] : lo[q[i]];
        hi[q[i]] = x[i] > hi[q[i]] ? x[i] : hi[q[i]];
    }
    for (size_t k = 0; k < B; k++)
        cb[k] = cnt[k] ? (float)(bsum[k] / (double)cnt[k]) : 0.0f;

    codec_encode(CODEC_UNIFORM8, w, x, n);
    codec_decode(CODEC_UNIFORM8, back, w, n);
    cr_assert_eq(memcmp(w, cb, sizeof cb), 0, "codebook");
    cr_assert_eq(memcmp(w + sizeof cb, q, n), 0, "bins");
    for (size_t i = 0; i < n; i++) {
        double err = fabs((double)back[i] - x[i]), ulp = 0x1p-24 * fabs((double)back[i]);

        cr_assert_eq(fbits(back[i]), fbits(cb[q[i]]), "element %zu", i);
        if (q[i] > 0 && q[i] < 255)
            cr_assert_leq(err, h * (1 + 1e-9) + ulp, "element %zu: %a -> %a, step %a", i, x[i],
                          back[i], h);
        else
            cr_assert(back[i] >= lo[q[i]] - ulp && back[i] <= hi[q[i]] + ulp,
                      "end bin %u: %a not in [%a, %a]", q[i], back[i], lo[q[i]], hi[q[i]]);
    }
    free(w);
    free(back);
    free(q);
}

Test(codec, uniform8_matches_a_reference_within_its_bound)
{
    size_t n = 5000;
    float *x = malloc(n * 4);
    uint64_t seed = 13;
    static const float mean[] = { 0, 1000, 3e8f, 0, -2e-30f };
    static const float spread[] = { 1, 0.01f, 1e6f, 1e30f, 1e-31f };

    for (size_t k = 0; k < sizeof mean / sizeof mean[0]; k++) {
        for (size_t i = 0; i < n; i++) {
            /* A sum of uniforms, roughly normal, and a few outliers that
             * end up clamped into the end bins. */
            float u = 0;

            for (int j = 0; j < 4; j++)
                u += ((float)(rnd(&seed) % 20001) - 10000.0f) / 10000.0f;
            x[i] = mean[k] + spread[k] * (i % 251 == 0 ? 8 * u : u);
        }
        uniform8_check(x, n);
        uniform8_check(x, 1);
        uniform8_check(x, 2);
        uniform8_check(x, 300);
    }
    uniform8_check(x, 0);
    free(x);
}

/* The two codebook codecs (uniform8, quantile8) on one wire form: a run
 * of one value comes back exact; a run holding NaN, -Inf or +Inf comes
 * back all NaN; any bytes decode to codebook entries, garbage in, no
 * fault. */
static void codebook_edges(enum codec c)
{
    float x[64], back[64];
    uint8_t w[4 * CODEC_UNIFORM8_BINS + 64];

    cr_assert_eq(codec_bytes(c, 64), sizeof w);
    for (size_t i = 0; i < 64; i++)
        x[i] = -7.125f;
    codec_encode(c, w, x, 64);
    codec_decode(c, back, w, 64);
    for (size_t i = 0; i < 64; i++)
        cr_assert_eq(back[i], -7.125f);
    for (int bad = 0; bad < 3; bad++) {
        for (size_t i = 0; i < 64; i++)
            x[i] = (float)i;
        x[40] = bad == 0 ? NAN : bad == 1 ? -INFINITY : INFINITY;
        codec_encode(c, w, x, 64);
        codec_decode(c, back, w, 64);
        for (size_t i = 0; i < 64; i++)
            cr_assert(isnan(back[i]), "%s case %d: element %zu is %a", codec_name(c), bad, i,
                      back[i]);
    }
    for (size_t i = 0; i < sizeof w; i++)
        w[i] = (uint8_t)(i * 37 + 11);
    codec_decode(c, back, w, 64);
    for (size_t i = 0; i < 64; i++)
        cr_assert_eq(memcmp(&back[i], w + 4 * (size_t)w[1024 + i], 4), 0);
}

Test(codec, uniform8_constant_runs_and_non_finite)
{
    codebook_edges(CODEC_UNIFORM8);
}

/* quantile8 against a reference built here from codec.h's definition:
 * the sample, sorted; each border at position k (m - 1) / 256 split into
 * its integer and fractional parts by floor(); a value's bucket the
 * count of borders below it, by a linear scan; the codebook the
 * per-bucket mean. Byte for byte; each value within its bucket's span
 * of its decoding; with distinct values, no bucket holds much more than
 * its share. Returns
 * the largest error over values within `near` of 0. */
static int ascending(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;

    return x < y ? -1 : x > y;
}

static double quantile8_check(const float *x, size_t n, double near, bool distinct)
{
    enum { B = CODEC_UNIFORM8_BINS, S = CODEC_QUANTILE8_SAMPLE };
    uint8_t *w = malloc(codec_bytes(CODEC_QUANTILE8, n));
    float *back = malloc((n ? n : 1) * 4), *smp = malloc(S * 4), cb[B];
    uint8_t *q = malloc(n ? n : 1);
    double border[B - 1], bsum[B] = { 0 }, lo[B], hi[B], worst = 0;
    size_t cnt[B] = { 0 }, m = n < S ? n : S;

    for (size_t k = 0; k < B; k++) {
        lo[k] = INFINITY;
        hi[k] = -INFINITY;
    }
    for (size_t j = 0; j < m; j++)
        smp[j] = x[(size_t)floor((double)j * (double)n / (double)m)];
    qsort(smp, m, 4, ascending);
    for (size_t k = 1; k < B && m > 0; k++) {
        double pos = (double)k * (double)(m - 1) / B, l = floor(pos), t = pos - l;
        double b = t > 0 ? smp[(size_t)l] + ((double)smp[(size_t)l + 1] - smp[(size_t)l]) * t
                         : smp[(size_t)l];

        border[k - 1] = k > 1 && b < border[k - 2] ? border[k - 2] : b;
    }
    for (size_t i = 0; i < n; i++) {
        size_t k = 0;

        while (k < B - 1 && border[k] < x[i])
            k++;
        q[i] = (uint8_t)k;
        bsum[k] += x[i];
        cnt[k]++;
        lo[k] = x[i] < lo[k] ? x[i] : lo[k];
        hi[k] = x[i] > hi[k] ? x[i] : hi[k];
    }
    for (size_t k = 0; k < B; k++)
        cb[k] = cnt[k] ? (float)(bsum[k] / (double)cnt[k]) : 0.0f;

    codec_encode(CODEC_QUANTILE8, w, x, n);
    codec_decode(CODEC_QUANTILE8, back, w, n);
    cr_assert_eq(memcmp(w, cb, sizeof cb), 0, "codebook, n %zu", n);
    cr_assert_eq(memcmp(w + sizeof cb, q, n), 0, "buckets, n %zu", n);
    for (size_t i = 0; i < n; i++) {
        double ulp = 0x1p-24 * fabs((double)back[i]);

        cr_assert_eq(fbits(back[i]), fbits(cb[q[i]]), "element %zu", i);
        cr_assert(back[i] >= lo[q[i]] - ulp && back[i] <= hi[q[i]] + ulp,
                  "bucket %u: %a not in [%a, %a]", q[i], back[i], lo[q[i]], hi[q[i]]);
        if (fabs((double)x[i]) <= near && fabs((double)back[i] - x[i]) > worst)
            worst = fabs((double)back[i] - x[i]);
    }
    /* Distinct values fill the buckets evenly: borders (m - 1) / 256
     * ranks apart, so each holds at most that and two more; sampled, the
     * share is n / 256 give or take the sample's noise. */
    for (size_t k = 0; k < B && n > 0 && distinct; k++)
        cr_assert_leq((double)cnt[k],
                      m == n ? (double)(m - 1) / B + 2 : 2 * (double)n / B + 2,
                      "bucket %zu holds %zu of %zu", k, cnt[k], n);
    free(w);
    free(back);
    free(smp);
    free(q);
    return worst;
}

Test(codec, quantile8_matches_a_reference_within_its_bound)
{
    size_t n = 3 * CODEC_QUANTILE8_SAMPLE + 77;     /* prime to 7919 */
    float *x = malloc(n * 4);
    static const float mean[] = { 0, 1000, 3e8f, 0, -2e-30f };
    static const float spread[] = { 1, 0.01f, 1e6f, 1e30f, 1e-31f };

    for (size_t k = 0; k < sizeof mean / sizeof mean[0]; k++) {
        for (size_t i = 0; i < n; i++) {
            /* A permutation of n steps across [-1, 1): distinct values
             * wherever float32 resolves them (about 0). */
            float u = 2.0f * (float)((i * 7919 + k * 131) % n) / (float)n - 1.0f;

            x[i] = mean[k] + spread[k] * u;
        }
        quantile8_check(x, n, INFINITY, mean[k] == 0);
        quantile8_check(x, CODEC_QUANTILE8_SAMPLE, INFINITY, mean[k] == 0);
        quantile8_check(x, 5000, INFINITY, mean[k] == 0);
        quantile8_check(x, 1, INFINITY, mean[k] == 0);
        quantile8_check(x, 2, INFINITY, mean[k] == 0);
        quantile8_check(x, 300, INFINITY, mean[k] == 0);
    }
    quantile8_check(x, 0, INFINITY, true);
    free(x);
}

/* What the quantiles buy: a few huge outliers share the top bucket with
 * the run's largest n / 256 values (whose mean they pull far off), and
 * the rest keep a fine step; uniform8's bins, 6 sigma / 256 wide, grow
 * with the outliers for every value. */
Test(codec, quantile8_keeps_the_bulk_fine_beside_outliers)
{
    size_t n = 5000;
    float *x = malloc(n * 4), *back = malloc(n * 4);
    uint8_t *w = malloc(codec_bytes(CODEC_UNIFORM8, n));
    uint64_t seed = 31;
    double q8, u8 = 0;

    for (size_t i = 0; i < n; i++)
        x[i] = ((float)(rnd(&seed) % 2000001) - 1000000.0f) / 1000000.0f;
    for (size_t i = 0; i < n; i += 1000)
        x[i] = 1e6f * (float)(i / 1000 + 1);
    q8 = quantile8_check(x, n, 0.98, true);   /* the top bucket: above about 0.994 */
    codec_encode(CODEC_UNIFORM8, w, x, n);
    codec_decode(CODEC_UNIFORM8, back, w, n);
    for (size_t i = 0; i < n; i++)
        if (fabs((double)x[i]) <= 0.98 && fabs((double)back[i] - x[i]) > u8)
            u8 = fabs((double)back[i] - x[i]);
    /* 254 inner buckets over [-1, 1]: about 2 / 256 wide each. */
    cr_assert_leq(q8, 0.02, "quantile8's error near 0: %g", q8);
    cr_assert_gt(u8, 0.5, "uniform8's error near 0: %g", u8);
    free(x);
    free(back);
    free(w);
}

Test(codec, quantile8_constant_runs_and_non_finite)
{
    codebook_edges(CODEC_QUANTILE8);
}

/* The sanitized build does not vectorise; bench/compression.sh runs the
 * release build's variants through the same comparison. */
Test(codec, every_kernel_variant_writes_the_baselines_bytes)
{
    size_t n = 7 * CODEC_INT8_BLOCK + 101, best = dtype_kernels_current();
    float *x = malloc(n * 4), *ref_back = malloc(n * 4), *back = malloc(n * 4);
    uint8_t *ref = malloc(codec_bytes(CODEC_NONE, n)), *w = malloc(codec_bytes(CODEC_NONE, n));

    make_inputs(x, n, 9);
    for (size_t i = 0; i < n; i += 97)
        x[i] = NAN;             /* some blocks non-finite, most not */
    for (int c = 1; c < CODEC_END; c++) {
        size_t bytes = codec_bytes((enum codec)c, n);

        if (!codec_valid(c))
            continue;
        cr_assert_eq(dtype_kernels_use(0), 0);
        codec_encode((enum codec)c, ref, x, n);
        codec_decode((enum codec)c, ref_back, ref, n);
        for (size_t v = 1; v < dtype_kernels_count(); v++) {
            if (!dtype_kernels_supported(v))
                continue;
            cr_assert_eq(dtype_kernels_use(v), 0);
            codec_encode((enum codec)c, w, x, n);
            codec_decode((enum codec)c, back, ref, n);
            cr_assert_eq(memcmp(w, ref, bytes), 0, "%s %s encode", codec_name((enum codec)c),
                         dtype_kernels_name(v));
            cr_assert_eq(memcmp(back, ref_back, n * 4), 0, "%s %s decode",
                         codec_name((enum codec)c), dtype_kernels_name(v));
        }
    }
    dtype_kernels_use(best);
    free(x);
    free(ref_back);
    free(back);
    free(ref);
    free(w);
}

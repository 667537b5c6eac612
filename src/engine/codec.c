/* src/engine/codec.c: see codec.h.
 *
 * FP16 and BF16 are dtype.c's conversions (dtype_narrow, dtype_widen),
 * which are already dispatched per instruction set and tested against
 * references. INT8 is here: a block's loops have a fixed trip count of
 * CODEC_INT8_BLOCK when the block is whole, which gcc -O2 vectorises (see
 * dtype.c), and a variable one for the last block. Every operation is one
 * IEEE 754 rounds exactly or an integer one: the absolute maximum is an
 * integer maximum of the bits with the sign cleared (for non-negative
 * floats the orders agree, and Inf and NaN sort above every finite
 * value), the quotient x / s a true division, the rounding to an integer
 * the add-and-subtract of 1.5 x 2^23 (exact, nearest even, for |v| <=
 * 2^22), and the decoding one product. So every variant writes the bytes
 * of the portable code.
 *
 * MEANSTD16 is plain scalar code: its sums are in double, in index order
 * (gcc does not reorder them without -ffast-math), and its per-element
 * work is one double division and dtype.c's float16 conversion, so every
 * build writes the same bytes without variants of its own. UNIFORM8
 * likewise: double sums in index order, one double division and the
 * add-and-subtract rounding per element. QUANTILE8 too: a sort of a
 * sample (which orders floats alike everywhere, -0 and +0 aside, and they
 * compare equal to every value), borders in double, a binary search per
 * element and double sums in index order. */
#include "engine/codec.h"

#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Indexed by id; NULL where an id is no codec. */
static const char *const names[CODEC_END] = {
    [CODEC_NONE] = "none", [CODEC_FP16] = "fp16", [CODEC_BF16] = "bf16",
    [CODEC_INT8] = "int8", [CODEC_MEANSTD16] = "meanstd16", [CODEC_UNIFORM8] = "uniform8",
    [CODEC_QUANTILE8] = "quantile8",
};

#define MAGIC 12582912.0f       /* 1.5 x 2^23: v + MAGIC - MAGIC rounds v to an integer */
#define QMAX 127.0f

bool codec_valid(int c)
{
    return c >= 0 && c < CODEC_END && names[c] != NULL;
}

const char *codec_name(enum codec c)
{
    return codec_valid((int)c) ? names[c] : "unknown";
}

int codec_parse(const char *s, enum codec *out)
{
    for (int c = 0; c < CODEC_END; c++)
        if (s && names[c] && strcmp(s, names[c]) == 0) {
            *out = (enum codec)c;
            return 0;
        }
    return -EINVAL;
}

bool codec_supports(enum codec c, enum dtype t)
{
    return c == CODEC_NONE || t == DTYPE_F32;
}

static size_t int8_blocks(size_t n)
{
    return (n + CODEC_INT8_BLOCK - 1) / CODEC_INT8_BLOCK;
}

size_t codec_bytes(enum codec c, size_t n)
{
    switch (c) {
    case CODEC_FP16:
    case CODEC_BF16:
        return 2 * n;
    case CODEC_INT8:
        return 4 * int8_blocks(n) + n;
    case CODEC_MEANSTD16:
        return 8 + 2 * n;
    case CODEC_UNIFORM8:
    case CODEC_QUANTILE8:
        return 4 * CODEC_UNIFORM8_BINS + n;
    default:
        return 4 * n;
    }
}

/* --- int8 kernels ----------------------------------------------------- */

union bits32 {
    float f;
    uint32_t u;
};

#define INLINE static inline __attribute__((always_inline))

/* One block of len elements: its scale, and q. */
INLINE float int8_encode_block(int8_t *restrict q, const float *restrict x, size_t len)
{
    uint32_t m = 0;
    union bits32 b;
    float s;

    for (size_t i = 0; i < len; i++) {
        union bits32 v = { .f = x[i] };
        uint32_t a = v.u & 0x7fffffffu;
        m = a > m ? a : m;
    }
    if (m >= 0x7f800000u) {
        /* NaN or Inf: not representable; the whole block decodes as NaN. */
        memset(q, 0, len);
        b.u = 0x7fc00000u;
        return b.f;
    }
    b.u = m;
    s = b.f / QMAX;
    if (s == 0) {
        /* Zeros, or values so small that their scale underflows. */
        memset(q, 0, len);
        return 0;
    }
    if (s * QMAX > 3.4028234663852886e38f) {
        /* Near FLT_MAX the rounded scale times 127 overflows: one ulp less
         * decodes the extreme as a finite value (clamped below). */
        b.f = s;
        b.u--;
        s = b.f;
    }
    /* Two passes, and the clamp on integers: gcc vectorises them for
     * SSE2 and AVX2 only so (float selects stay branches there). |x| <=
     * max|x| keeps |x / s| within a rounding of 127, so the rounding trick
     * and the conversion are exact; rounding first and clamping after is
     * the same as the other way round. */
    int32_t t[CODEC_INT8_BLOCK];
    for (size_t i = 0; i < len; i++)
        t[i] = (int32_t)((x[i] / s + MAGIC) - MAGIC);
    for (size_t i = 0; i < len; i++) {
        int32_t v = t[i];
        v = v > 127 ? 127 : v;
        v = v < -127 ? -127 : v;
        q[i] = (int8_t)v;
    }
    return s;
}

INLINE void int8_decode_block(float *restrict d, const int8_t *restrict q, float s, size_t len)
{
    for (size_t i = 0; i < len; i++)
        d[i] = (float)q[i] * s;
}

/* Whole blocks get functions of their own: called as block(..., len) in
 * a branch where len == CODEC_INT8_BLOCK, gcc merges the two calls into
 * one with a variable length and vectorises neither. */
INLINE float int8_encode_whole(int8_t *restrict q, const float *restrict x)
{
    return int8_encode_block(q, x, CODEC_INT8_BLOCK);
}

INLINE void int8_decode_whole(float *restrict d, const int8_t *restrict q, float s)
{
    int8_decode_block(d, q, s, CODEC_INT8_BLOCK);
}

INLINE void int8_encode_any(void *restrict dst, const float *restrict src, size_t n)
{
    uint8_t *scales = dst;
    int8_t *q = (int8_t *)dst + 4 * int8_blocks(n);

    for (size_t i = 0, k = 0; i < n; i += CODEC_INT8_BLOCK, k++) {
        size_t len = n - i < CODEC_INT8_BLOCK ? n - i : CODEC_INT8_BLOCK;
        float s = len == CODEC_INT8_BLOCK ? int8_encode_whole(q + i, src + i)
                                          : int8_encode_block(q + i, src + i, len);
        memcpy(scales + 4 * k, &s, 4);
    }
}

INLINE void int8_decode_any(float *restrict dst, const void *restrict src, size_t n)
{
    const uint8_t *scales = src;
    const int8_t *q = (const int8_t *)src + 4 * int8_blocks(n);

    for (size_t i = 0, k = 0; i < n; i += CODEC_INT8_BLOCK, k++) {
        size_t len = n - i < CODEC_INT8_BLOCK ? n - i : CODEC_INT8_BLOCK;
        float s;

        memcpy(&s, scales + 4 * k, 4);
        if (len == CODEC_INT8_BLOCK)
            int8_decode_whole(dst + i, q + i, s);
        else
            int8_decode_block(dst + i, q + i, s, len);
    }
}

/* Variants, as dtype.c's and in the same order, so that dtype's index
 * (dtype_kernels_current) picks the same instruction set here. */
struct kernels {
    void (*encode)(void *restrict, const float *restrict, size_t);
    void (*decode)(float *restrict, const void *restrict, size_t);
};

#define DEFINE_VARIANT(V, TARGET)                                                       \
    TARGET static void encode_##V(void *restrict d, const float *restrict s, size_t n)  \
    {                                                                                   \
        int8_encode_any(d, s, n);                                                       \
    }                                                                                   \
    TARGET static void decode_##V(float *restrict d, const void *restrict s, size_t n)  \
    {                                                                                   \
        int8_decode_any(d, s, n);                                                       \
    }

DEFINE_VARIANT(baseline, )
#if defined(__x86_64__)
DEFINE_VARIANT(avx2, __attribute__((target("avx2"))))
DEFINE_VARIANT(avx512, __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))))
#endif

static const struct kernels variants[] = {
    { encode_baseline, decode_baseline },
#if defined(__x86_64__)
    { encode_avx2, decode_avx2 },
    { encode_avx512, decode_avx512 },
#endif
};
#define N_VARIANTS (sizeof(variants) / sizeof(variants[0]))

static const struct kernels *kernels(void)
{
    size_t i = dtype_kernels_current();

    return &variants[i < N_VARIANTS ? i : 0];
}

/* --- meanstd16 ------------------------------------------------------- */

#define MS_CHUNK 256            /* floats staged on the stack per conversion */
#define FP16_MAX 65504.0

static void meanstd16_encode(void *restrict dst, const float *restrict src, size_t n)
{
    uint8_t *out = dst;
    double sum = 0, sq = 0;
    float m = 0, s = FLT_EPSILON;

    for (size_t i = 0; i < n; i++)
        sum += src[i];
    if (n > 0)
        m = (float)(sum / (double)n);
    if (!isfinite(m)) {
        /* NaN or Inf in the run (a double sum of floats cannot overflow):
         * a NaN mean makes every decoded value NaN. */
        m = NAN;
    } else {
        for (size_t i = 0; i < n; i++) {
            double d = (double)src[i] - m;

            sq += d * d;
        }
        if (n > 0) {
            /* sqrt(sum / n) <= max|x - m|, which can pass FLT_MAX by a
             * factor of two at most: saturate rather than store Inf. */
            double sd = sqrt(sq / (double)n);

            s = sd > FLT_MAX ? FLT_MAX : (float)sd;
            s = s < FLT_EPSILON ? FLT_EPSILON : s;
        }
    }
    memcpy(out, &m, 4);
    memcpy(out + 4, &s, 4);
    for (size_t i = 0; i < n; i += MS_CHUNK) {
        size_t len = n - i < MS_CHUNK ? n - i : MS_CHUNK;
        float y[MS_CHUNK];

        for (size_t j = 0; j < len; j++) {
            double v = ((double)src[i + j] - m) / s;

            v = v > FP16_MAX ? FP16_MAX : v;
            v = v < -FP16_MAX ? -FP16_MAX : v;
            y[j] = (float)v;        /* NaN passes the clamps as NaN */
        }
        dtype_narrow(DTYPE_F16, (uint16_t *)(out + 8) + i, y, len);
    }
}

static void meanstd16_decode(float *restrict dst, const void *restrict src, size_t n)
{
    const uint8_t *in = src;
    float m, s;

    memcpy(&m, in, 4);
    memcpy(&s, in + 4, 4);
    dtype_widen(DTYPE_F16, dst, (const uint16_t *)(in + 8), n);
    for (size_t i = 0; i < n; i++)
        dst[i] = (float)((double)dst[i] * s + m);
}

/* --- uniform8 -------------------------------------------------------- */

#define U8_HALF 128
#define MAGIC_D 6755399441055744.0      /* 1.5 x 2^52: rounds a double to an integer */

/* The 8-bit codebook codecs (uniform8, quantile8) share their wire form:
 * 256 float32 entries, then one index per value. */

/* A run holding NaN or Inf: every entry NaN, so all of it decodes as
 * NaN whatever index a value got. */
static void codebook_nan(uint8_t *cb_out, uint8_t *q, size_t n, uint8_t index)
{
    float nan = NAN;

    for (size_t k = 0; k < CODEC_UNIFORM8_BINS; k++)
        memcpy(cb_out + 4 * k, &nan, 4);
    memset(q, index, n);
}

/* Each entry the mean of the values put in its bin (0 for an empty one). */
static void codebook_means(uint8_t *cb_out, const double *bin_sum, const size_t *bin_n)
{
    for (size_t k = 0; k < CODEC_UNIFORM8_BINS; k++) {
        float c = bin_n[k] ? (float)(bin_sum[k] / (double)bin_n[k]) : 0.0f;

        memcpy(cb_out + 4 * k, &c, 4);
    }
}

static void uniform8_encode(void *restrict dst, const float *restrict src, size_t n)
{
    uint8_t *cb_out = dst, *q = (uint8_t *)dst + 4 * CODEC_UNIFORM8_BINS;
    double sum = 0, sq = 0, m = 0, h = 0;
    double bin_sum[CODEC_UNIFORM8_BINS] = { 0 };
    size_t bin_n[CODEC_UNIFORM8_BINS] = { 0 };

    for (size_t i = 0; i < n; i++)
        sum += src[i];
    if (n > 0)
        m = sum / (double)n;
    if (!isfinite(m)) {
        codebook_nan(cb_out, q, n, U8_HALF);
        return;
    }
    for (size_t i = 0; i < n; i++)
        sq += ((double)src[i] - m) * ((double)src[i] - m);
    if (n > 1)
        h = 6.0 * sqrt(sq / (double)(n - 1)) / CODEC_UNIFORM8_BINS;
    for (size_t i = 0; i < n; i++) {
        int k = U8_HALF;

        if (h > 0) {
            /* Clamped before rounding (the same result as after): the
             * add-and-subtract is exact for |v| <= 2^51. */
            double v = ((double)src[i] - m) / h;

            v = v > 200 ? 200 : v < -200 ? -200 : v;
            k += (int)((v + MAGIC_D) - MAGIC_D);
            k = k < 0 ? 0 : k > CODEC_UNIFORM8_BINS - 1 ? CODEC_UNIFORM8_BINS - 1 : k;
        }
        q[i] = (uint8_t)k;
        bin_sum[k] += src[i];
        bin_n[k]++;
    }
    codebook_means(cb_out, bin_sum, bin_n);
}

static void uniform8_decode(float *restrict dst, const void *restrict src, size_t n)
{
    float cb[CODEC_UNIFORM8_BINS];
    const uint8_t *q = (const uint8_t *)src + 4 * CODEC_UNIFORM8_BINS;

    memcpy(cb, src, sizeof cb);
    for (size_t i = 0; i < n; i++)
        dst[i] = cb[q[i]];
}

/* --- quantile8 ------------------------------------------------------- */

#define Q8_BORDERS (CODEC_UNIFORM8_BINS - 1)

static int float_order(const void *pa, const void *pb)
{
    float a = *(const float *)pa, b = *(const float *)pb;

    return (a > b) - (a < b);
}

/* The number of borders below v: torch.bucketize(v, borders) with
 * right=False, by binary search over the non-decreasing borders. */
static unsigned q8_bucket(const double *border, double v)
{
    unsigned lo = 0, hi = Q8_BORDERS;      /* the answer is in [lo, hi] */

    while (lo < hi) {
        unsigned mid = (lo + hi) / 2;

        if (border[mid] < v)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

static void quantile8_encode(void *restrict dst, const float *restrict src, size_t n)
{
    uint8_t *cb_out = dst, *q = (uint8_t *)dst + 4 * CODEC_UNIFORM8_BINS;
    size_t m = n < CODEC_QUANTILE8_SAMPLE ? n : CODEC_QUANTILE8_SAMPLE;
    float sample[CODEC_QUANTILE8_SAMPLE];
    double border[Q8_BORDERS], bin_sum[CODEC_UNIFORM8_BINS] = { 0 };
    size_t bin_n[CODEC_UNIFORM8_BINS] = { 0 };

    for (size_t i = 0; i < n; i++) {
        if (!isfinite(src[i])) {
            /* NaN has no place in a sort. */
            codebook_nan(cb_out, q, n, 0);
            return;
        }
    }
    if (n == 0) {
        memset(cb_out, 0, 4 * CODEC_UNIFORM8_BINS);
        return;
    }
    /* j n < 2^13 n: no overflow in 64 bits for any run in memory. */
    for (size_t j = 0; j < m; j++)
        sample[j] = src[m == n ? j : (size_t)((uint64_t)j * n / m)];
    qsort(sample, m, sizeof(float), float_order);
    for (size_t k = 0; k < Q8_BORDERS; k++) {
        /* Position (k + 1) (m - 1) / 256 = l + t, exact in double. */
        uint64_t num = (uint64_t)(k + 1) * (m - 1);
        size_t l = (size_t)(num / CODEC_UNIFORM8_BINS);
        double t = (double)(num % CODEC_UNIFORM8_BINS) / CODEC_UNIFORM8_BINS, b = sample[l];

        if (t > 0)
            b += ((double)sample[l + 1] - sample[l]) * t;
        border[k] = k > 0 && b < border[k - 1] ? border[k - 1] : b;
    }
    for (size_t i = 0; i < n; i++) {
        unsigned k = q8_bucket(border, src[i]);

        q[i] = (uint8_t)k;
        bin_sum[k] += src[i];
        bin_n[k]++;
    }
    codebook_means(cb_out, bin_sum, bin_n);
}

/* --- the interface ---------------------------------------------------- */

void codec_encode(enum codec c, void *restrict dst, const float *restrict src, size_t n)
{
    switch (c) {
    case CODEC_FP16:
        dtype_narrow(DTYPE_F16, dst, src, n);
        break;
    case CODEC_BF16:
        dtype_narrow(DTYPE_BF16, dst, src, n);
        break;
    case CODEC_INT8:
        kernels()->encode(dst, src, n);
        break;
    case CODEC_MEANSTD16:
        meanstd16_encode(dst, src, n);
        break;
    case CODEC_UNIFORM8:
        uniform8_encode(dst, src, n);
        break;
    case CODEC_QUANTILE8:
        quantile8_encode(dst, src, n);
        break;
    default:
        memcpy(dst, src, 4 * n);
        break;
    }
}

void codec_decode(enum codec c, float *restrict dst, const void *restrict src, size_t n)
{
    switch (c) {
    case CODEC_FP16:
        dtype_widen(DTYPE_F16, dst, src, n);
        break;
    case CODEC_BF16:
        dtype_widen(DTYPE_BF16, dst, src, n);
        break;
    case CODEC_INT8:
        kernels()->decode(dst, src, n);
        break;
    case CODEC_MEANSTD16:
        meanstd16_decode(dst, src, n);
        break;
    case CODEC_UNIFORM8:
    case CODEC_QUANTILE8:
        /* The same wire form: a codebook and an index per element. */
        uniform8_decode(dst, src, n);
        break;
    default:
        memcpy(dst, src, 4 * n);
        break;
    }
}

void codec_round_trip(enum codec c, float *x, void *scratch, size_t n)
{
    codec_encode(c, scratch, x, n);
    if (c != CODEC_NONE)
        codec_decode(c, x, scratch, n);
}

/* src/engine/dtype.c: see dtype.h.
 *
 * Every kernel walks its arrays in blocks of BLOCK elements with a fixed
 * inner trip count and finishes with a scalar tail. gcc 12 at -O2 only
 * vectorises a loop when the vector code replaces the scalar loop entirely
 * (its "very cheap" cost model), which a loop over an unknown n never
 * does; a fixed 16-iteration inner loop over restrict pointers does. The
 * element functions are branch-free for the same reason: selects vectorise,
 * branches do not. */
#include "engine/dtype.h"

#include <errno.h>
#include <math.h>
#include <stdatomic.h>
#include <string.h>

/* clang knows "f16c" to __builtin_cpu_supports from version 18 on
 * (llvm-project#78384); an older one (Debian 12's clang 14 builds the
 * fuzzers, tests/fuzz) takes the portable path. */
#if defined(__x86_64__) && !(defined(__clang__) && __clang_major__ < 18)
#include <immintrin.h>
#define HAVE_F16C 1
#else
#define HAVE_F16C 0
#endif
/* Kernel variants for wider vector units: see "kernel variants". SSE2
 * (the streaming copy) is every x86-64 CPU's. */
#if defined(__x86_64__)
#include <emmintrin.h>
#define HAVE_X86_VARIANTS 1
#else
#define HAVE_X86_VARIANTS 0
#endif

#define BLOCK 16

/* Float min/max: NaN in either operand wins; ties keep a. */
#define FMIN(a, b) (((b) < (a) || (b) != (b)) ? (b) : (a))
#define FMAX(a, b) (((b) > (a) || (b) != (b)) ? (b) : (a))
#define IMIN(a, b) ((b) < (a) ? (b) : (a))
#define IMAX(a, b) ((b) > (a) ? (b) : (a))

/* Runs `stmt` (which uses i) for every i in [0, n). */
#define FOR_EACH(n, stmt)                                       \
    do {                                                        \
        size_t b_ = 0, n_ = (n);                                \
        for (; b_ + BLOCK <= n_; b_ += BLOCK)                   \
            for (size_t j_ = 0; j_ < BLOCK; j_++) {             \
                size_t i = b_ + j_;                             \
                stmt;                                           \
            }                                                   \
        for (size_t i = b_; i < n_; i++) {                      \
            stmt;                                               \
        }                                                       \
    } while (0)

static const char *const type_names[DTYPE_COUNT] = { "f32", "f64", "f16", "bf16", "i32", "i64" };
static const size_t type_sizes[DTYPE_COUNT] = { 4, 8, 2, 2, 4, 8 };
static const char *const op_names[DTYPE_OP_COUNT] = { "sum", "avg", "min", "max", "avg_by" };

bool dtype_valid(int t)
{
    return t >= 0 && t < DTYPE_COUNT;
}

bool dtype_op_valid(int op)
{
    return op >= 0 && op < DTYPE_OP_COUNT;
}

size_t dtype_size(enum dtype t)
{
    return type_sizes[t];
}

enum dtype dtype_acc(enum dtype t)
{
    return dtype_is_16bit_float(t) ? DTYPE_F32 : t;
}

bool dtype_is_16bit_float(enum dtype t)
{
    return t == DTYPE_F16 || t == DTYPE_BF16;
}

bool dtype_is_int(enum dtype t)
{
    return t == DTYPE_I32 || t == DTYPE_I64;
}

const char *dtype_name(enum dtype t)
{
    return type_names[t];
}

const char *dtype_op_name(enum dtype_op op)
{
    return op_names[op];
}

int dtype_parse(const char *s, enum dtype *out)
{
    for (int t = 0; t < DTYPE_COUNT; t++)
        if (s && strcmp(s, type_names[t]) == 0) {
            *out = (enum dtype)t;
            return 0;
        }
    return -EINVAL;
}

int dtype_parse_op(const char *s, enum dtype_op *out)
{
    for (int op = 0; op < DTYPE_OP_COUNT; op++)
        if (s && strcmp(s, op_names[op]) == 0) {
            *out = (enum dtype_op)op;
            return 0;
        }
    return -EINVAL;
}

int dtype_divisor(enum dtype t, enum dtype_op op, size_t members, double denominator,
                  double *divisor)
{
    double d;

    switch (op) {
    case DTYPE_AVG:
        d = (double)members;
        break;
    case DTYPE_AVG_BY:
        d = denominator;
        break;
    default:
        *divisor = 1;
        return 0;
    }
    if (d == 0 || !isfinite(d))
        return -EINVAL;
    /* Integers divide exactly, so the divisor must be an integer that a
     * double holds exactly. */
    if (dtype_is_int(t) && (d != trunc(d) || fabs(d) > 9007199254740992.0))
        return -EINVAL;
    *divisor = d;
    return 0;
}

/* --- float16 and bfloat16 ---------------------------------------------- */

union bits32 {
    float f;
    uint32_t u;
};

static inline float as_float(uint32_t u)
{
    union bits32 b = { .u = u };
    return b.f;
}

static inline uint32_t as_bits(float f)
{
    union bits32 b = { .f = f };
    return b.u;
}

/* After Fabian Giesen's half_to_float: shift exponent and mantissa into
 * place and rebias; Inf/NaN get the float exponent 255 (a NaN made quiet,
 * as the F16C instruction does, so both paths give the same bytes); zeros
 * and subnormals (mantissa * 2^-24) come out of one exact subtraction. */
static inline float f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t em = h & 0x7fffu;
    uint32_t exp = em & 0x7c00u;
    uint32_t o = em << 13;
    uint32_t normal = o + (112u << 23);
    uint32_t special = (o + (224u << 23)) | (uint32_t)((em & 0x3ffu) != 0) << 22;
    uint32_t sub = as_bits(as_float(o + (113u << 23)) - as_float(113u << 23));
    uint32_t is_sub = 0u - (uint32_t)(exp == 0);
    uint32_t r = exp == 0x7c00u ? special : normal;

    /* A mask, not a ternary: gcc would otherwise move the float
     * subtraction under a branch, and a branch stops the vectoriser. */
    r = (sub & is_sub) | (r & ~is_sub);
    return as_float(r | sign);
}

/* After Giesen's float_to_half_fast3_rtne. Normal results round to nearest
 * even by adding 0xfff plus the lowest kept bit before truncating; the
 * carry also turns 65520 and up into Inf. Results below 2^-14 are made by
 * adding 0.5, whose ulp is the float16 subnormal step, so the FPU's own
 * round-to-nearest-even does the rounding. NaN stays NaN, made quiet. */
static inline uint16_t f32_to_f16(float f)
{
    uint32_t x = as_bits(f);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t a = x & 0x7fffffffu;
    uint32_t odd = (a >> 13) & 1u;
    uint32_t normal = (a + 0xc8000fffu + odd) >> 13;    /* 0xc8000000 = -(112 << 23) */
    uint32_t sub = as_bits(as_float(a) + as_float(126u << 23)) - (126u << 23);
    uint32_t nan = 0x7e00u | ((a >> 13) & 0x1ffu);
    uint32_t is_sub = 0u - (uint32_t)(a < 0x38800000u);
    uint32_t is_inf = 0u - (uint32_t)(a >= 0x47800000u);
    uint32_t is_nan = 0u - (uint32_t)(a > 0x7f800000u);
    /* Masks for every select: see f16_to_f32. */
    uint32_t r = (sub & is_sub) | (normal & ~is_sub);

    r = (0x7c00u & is_inf) | (r & ~is_inf);
    r = (nan & is_nan) | (r & ~is_nan);
    return (uint16_t)(r | sign);
}

static inline float bf16_to_f32(uint16_t h)
{
    return as_float((uint32_t)h << 16);
}

/* Round to nearest even on the dropped 16 bits; the carry out of the
 * largest finite floats makes Inf, as it should. NaN is kept, made quiet. */
static inline uint16_t f32_to_bf16(float f)
{
    uint32_t x = as_bits(f);
    uint32_t r = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
    uint32_t nan = (x >> 16) | 0x40u;

    return (uint16_t)((x & 0x7fffffffu) > 0x7f800000u ? nan : r);
}

float dtype_f16_to_f32(uint16_t h)
{
    return f16_to_f32(h);
}

uint16_t dtype_f32_to_f16(float f)
{
    return f32_to_f16(f);
}

float dtype_bf16_to_f32(uint16_t h)
{
    return bf16_to_f32(h);
}

uint16_t dtype_f32_to_bf16(float f)
{
    return f32_to_bf16(f);
}

/* float16 in plain SSE2 takes a dozen integer operations per element;
 * every x86-64 CPU since 2012 converts 8 at a time in one instruction
 * (F16C), with the same rounding (to nearest even) and the same NaN
 * handling as the portable code above. Chosen at run time, per call. */
#if HAVE_F16C
static bool f16c(void)
{
    return __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");
}

__attribute__((target("avx,f16c"))) static void widen_f16c(float *restrict d,
                                                          const uint16_t *restrict s, size_t n)
{
    size_t i = 0;

    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(d + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i))));
    for (; i < n; i++)
        d[i] = f16_to_f32(s[i]);
}

__attribute__((target("avx,f16c"))) static void narrow_f16c(uint16_t *restrict d,
                                                           const float *restrict s, size_t n)
{
    size_t i = 0;

    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(d + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++)
        d[i] = f32_to_f16(s[i]);
}

/* dst op= widen(src), with FMIN/FMAX's rules: NaN in src wins, and so
 * does NaN already in dst (a comparison with it is false); ties keep dst. */
__attribute__((target("avx,f16c"))) static void combine_widen_f16c(enum dtype_op op,
                                                                  float *restrict d,
                                                                  const uint16_t *restrict s,
                                                                  size_t n)
{
    size_t i = 0;

    for (; i + 8 <= n; i += 8) {
        __m256 b = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i)));
        __m256 a = _mm256_loadu_ps(d + i), r;

        if (op == DTYPE_MIN || op == DTYPE_MAX) {
            __m256 take = _mm256_or_ps(op == DTYPE_MIN ? _mm256_cmp_ps(b, a, _CMP_LT_OQ)
                                                        : _mm256_cmp_ps(b, a, _CMP_GT_OQ),
                                       _mm256_cmp_ps(b, b, _CMP_UNORD_Q));
            r = _mm256_blendv_ps(a, b, take);
        } else {
            r = _mm256_add_ps(a, b);
        }
        _mm256_storeu_ps(d + i, r);
    }
    for (; i < n; i++) {
        float b = f16_to_f32(s[i]);
        d[i] = op == DTYPE_MIN ? FMIN(d[i], b) : op == DTYPE_MAX ? FMAX(d[i], b) : d[i] + b;
    }
}
#endif

/* --- combining ---------------------------------------------------------- */

/* d[i] = a[i] op b[i], generated twice per type: in place (a is d) and
 * out of place (nothing overlaps). Two bodies rather than one with `a`
 * allowed to alias `d`, because only restrict-qualified loops vectorize at
 * -O2. Integer sums go through unsigned arithmetic so that overflow wraps
 * instead of being undefined. Always inlined: each kernel variant below
 * compiles them again for its own instruction set. */
#define COMBINE_BODY(MINF, MAXF, ADD, T, A)                                         \
    switch (op) {                                                                   \
    case DTYPE_MIN:                                                                 \
        FOR_EACH(n, d[i] = MINF(A[i], b[i]));                                       \
        break;                                                                      \
    case DTYPE_MAX:                                                                 \
        FOR_EACH(n, d[i] = MAXF(A[i], b[i]));                                       \
        break;                                                                      \
    default:                                                                        \
        FOR_EACH(n, d[i] = ADD(T, A[i], b[i]));                                     \
        break;                                                                      \
    }
#define INLINE static inline __attribute__((always_inline))
#define DEFINE_COMBINE(name, T, MINF, MAXF, ADD)                                    \
    INLINE void name##_inplace(enum dtype_op op, T *restrict d, const T *restrict b, \
                               size_t n)                                            \
    {                                                                               \
        COMBINE_BODY(MINF, MAXF, ADD, T, d)                                         \
    }                                                                               \
    INLINE void name##_into(enum dtype_op op, T *restrict d, const T *restrict a,   \
                            const T *restrict b, size_t n)                          \
    {                                                                               \
        COMBINE_BODY(MINF, MAXF, ADD, T, a)                                         \
    }                                                                               \
    /* b is d itself (based on it, so restrict holds): element i reads and   */    \
    /* writes only index i, which vectorises as the other two do.            */    \
    INLINE void name##_onto(enum dtype_op op, T *restrict d, const T *restrict a,   \
                            size_t n)                                               \
    {                                                                               \
        const T *b = d;                                                             \
        COMBINE_BODY(MINF, MAXF, ADD, T, a)                                         \
    }
#define FADD(T, x, y) ((x) + (y))
#define IADD32(T, x, y) ((T)((uint32_t)(x) + (uint32_t)(y)))
#define IADD64(T, x, y) ((T)((uint64_t)(x) + (uint64_t)(y)))

DEFINE_COMBINE(combine_f32, float, FMIN, FMAX, FADD)
DEFINE_COMBINE(combine_f64, double, FMIN, FMAX, FADD)
DEFINE_COMBINE(combine_i32, int32_t, IMIN, IMAX, IADD32)
DEFINE_COMBINE(combine_i64, int64_t, IMIN, IMAX, IADD64)

INLINE void combine_any(enum dtype acc, enum dtype_op op, void *restrict dst,
                        const void *restrict src, size_t n)
{
    switch (acc) {
    case DTYPE_F32: combine_f32_inplace(op, dst, src, n); break;
    case DTYPE_F64: combine_f64_inplace(op, dst, src, n); break;
    case DTYPE_I32: combine_i32_inplace(op, dst, src, n); break;
    case DTYPE_I64: combine_i64_inplace(op, dst, src, n); break;
    default: break;             /* 16-bit types are never accumulated as such */
    }
}

INLINE void combine_onto_any(enum dtype acc, enum dtype_op op, void *restrict dst,
                             const void *restrict a, size_t n)
{
    switch (acc) {
    case DTYPE_F32: combine_f32_onto(op, dst, a, n); break;
    case DTYPE_F64: combine_f64_onto(op, dst, a, n); break;
    case DTYPE_I32: combine_i32_onto(op, dst, a, n); break;
    case DTYPE_I64: combine_i64_onto(op, dst, a, n); break;
    default: break;
    }
}

INLINE void combine_into_any(enum dtype acc, enum dtype_op op, void *restrict dst,
                             const void *restrict a, const void *restrict b, size_t n)
{
    switch (acc) {
    case DTYPE_F32: combine_f32_into(op, dst, a, b, n); break;
    case DTYPE_F64: combine_f64_into(op, dst, a, b, n); break;
    case DTYPE_I32: combine_i32_into(op, dst, a, b, n); break;
    case DTYPE_I64: combine_i64_into(op, dst, a, b, n); break;
    default: break;
    }
}

/* The portable float16 paths and both bfloat16 ones (F16C, above, takes
 * float16 first where the CPU has it). */
INLINE void widen_any(enum dtype t, float *restrict dst, const uint16_t *restrict src, size_t n)
{
    if (t == DTYPE_F16)
        FOR_EACH(n, dst[i] = f16_to_f32(src[i]));
    else
        FOR_EACH(n, dst[i] = bf16_to_f32(src[i]));
}

INLINE void narrow_any(enum dtype t, uint16_t *restrict dst, const float *restrict src, size_t n)
{
    if (t == DTYPE_F16)
        FOR_EACH(n, dst[i] = f32_to_f16(src[i]));
    else
        FOR_EACH(n, dst[i] = f32_to_bf16(src[i]));
}

INLINE void combine_widen_any(enum dtype t, enum dtype_op op, float *restrict d,
                              const uint16_t *restrict s, size_t n)
{
    bool half = t == DTYPE_F16;

    switch (op) {
    case DTYPE_MIN:
        if (half)
            FOR_EACH(n, d[i] = FMIN(d[i], f16_to_f32(s[i])));
        else
            FOR_EACH(n, d[i] = FMIN(d[i], bf16_to_f32(s[i])));
        break;
    case DTYPE_MAX:
        if (half)
            FOR_EACH(n, d[i] = FMAX(d[i], f16_to_f32(s[i])));
        else
            FOR_EACH(n, d[i] = FMAX(d[i], bf16_to_f32(s[i])));
        break;
    default:
        if (half)
            FOR_EACH(n, d[i] += f16_to_f32(s[i]));
        else
            FOR_EACH(n, d[i] += bf16_to_f32(s[i]));
        break;
    }
}

/* Floats only: integers divide in scale_i32/scale_i64 (no SIMD divides
 * integers). A true division, not a multiply by the reciprocal: IEEE 754
 * rounds a quotient correctly in every instruction set, so every variant
 * and every member gets the bytes of x / d, and the documented meaning of
 * avg holds exactly. Vectorised, it costs no more than the memory traffic
 * (bench/dtype_kernels.c). */
INLINE void scale_float_any(enum dtype acc, void *restrict buf, size_t n, double divisor)
{
    if (acc == DTYPE_F32) {
        float *restrict d = buf, v = (float)divisor;
        FOR_EACH(n, d[i] = d[i] / v);
    } else {
        double *restrict d = buf;
        FOR_EACH(n, d[i] = d[i] / divisor);
    }
}

/* --- kernel variants ------------------------------------------------------ */

/* One set of the kernels above per instruction set, compiled from the same
 * source with a target attribute. Only operations that IEEE 754 rounds
 * exactly appear (add, divide, compare, select, bit moves), each element
 * on its own, and the build contracts nothing (-ffp-contract=off in the
 * Makefile: an FMA would round once where the scalar code rounds twice),
 * so every variant writes the same bytes; tests/unit/test_dtype.c holds
 * them to it. */
struct kernels {
    const char *name;
    void (*combine)(enum dtype, enum dtype_op, void *restrict, const void *restrict, size_t);
    void (*combine_into)(enum dtype, enum dtype_op, void *restrict, const void *restrict,
                         const void *restrict, size_t);
    void (*combine_onto)(enum dtype, enum dtype_op, void *restrict, const void *restrict, size_t);
    void (*widen)(enum dtype, float *restrict, const uint16_t *restrict, size_t);
    void (*narrow)(enum dtype, uint16_t *restrict, const float *restrict, size_t);
    void (*combine_widen)(enum dtype, enum dtype_op, float *restrict, const uint16_t *restrict,
                          size_t);
    void (*scale_float)(enum dtype, void *restrict, size_t, double);
};

#define DEFINE_VARIANT(V, TARGET)                                                        \
    TARGET static void combine_##V(enum dtype acc, enum dtype_op op, void *restrict d,     \
                                   const void *restrict s, size_t n)                     \
    {                                                                                    \
        combine_any(acc, op, d, s, n);                                                   \
    }                                                                                    \
    TARGET static void combine_into_##V(enum dtype acc, enum dtype_op op, void *restrict d, \
                                        const void *restrict a, const void *restrict b,   \
                                        size_t n)                                        \
    {                                                                                    \
        combine_into_any(acc, op, d, a, b, n);                                           \
    }                                                                                    \
    TARGET static void combine_onto_##V(enum dtype acc, enum dtype_op op, void *restrict d, \
                                        const void *restrict a, size_t n)                 \
    {                                                                                    \
        combine_onto_any(acc, op, d, a, n);                                              \
    }                                                                                    \
    TARGET static void widen_##V(enum dtype t, float *restrict d, const uint16_t *restrict s, \
                                 size_t n)                                               \
    {                                                                                    \
        widen_any(t, d, s, n);                                                           \
    }                                                                                    \
    TARGET static void narrow_##V(enum dtype t, uint16_t *restrict d,                     \
                                  const float *restrict s, size_t n)                     \
    {                                                                                    \
        narrow_any(t, d, s, n);                                                          \
    }                                                                                    \
    TARGET static void combine_widen_##V(enum dtype t, enum dtype_op op, float *restrict d, \
                                         const uint16_t *restrict s, size_t n)           \
    {                                                                                    \
        combine_widen_any(t, op, d, s, n);                                               \
    }                                                                                    \
    TARGET static void scale_float_##V(enum dtype acc, void *restrict d, size_t n,        \
                                       double divisor)                                   \
    {                                                                                    \
        scale_float_any(acc, d, n, divisor);                                             \
    }
#define VARIANT(V) { #V, combine_##V, combine_into_##V, combine_onto_##V, widen_##V, narrow_##V, \
                     combine_widen_##V, scale_float_##V }

DEFINE_VARIANT(baseline, )
#if HAVE_X86_VARIANTS
/* x86-64's SSE2 is the baseline; AVX2 doubles the width, AVX-512 (with
 * BW and VL for the 16-bit lanes and the masks) doubles it again. */
DEFINE_VARIANT(avx2, __attribute__((target("avx2"))))
DEFINE_VARIANT(avx512, __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))))

static bool has_avx2(void)
{
    return __builtin_cpu_supports("avx2");
}

static bool has_avx512(void)
{
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}
#endif

static bool always(void)
{
    return true;
}

/* Worst first: the last one the CPU supports is the default. */
static const struct kernels variants[] = {
    VARIANT(baseline),
#if HAVE_X86_VARIANTS
    VARIANT(avx2),
    VARIANT(avx512),
#endif
};
static bool (*const variant_supported[])(void) = {
    always,
#if HAVE_X86_VARIANTS
    has_avx2,
    has_avx512,
#endif
};
#define N_VARIANTS (sizeof(variants) / sizeof(variants[0]))

/* The variant in use, chosen on first use; a race between two first uses
 * stores the same answer twice. */
static _Atomic(const struct kernels *) active;

static const struct kernels *kernels(void)
{
    const struct kernels *k = atomic_load_explicit(&active, memory_order_relaxed);

    if (!k) {
        size_t best = 0;

        for (size_t i = 1; i < N_VARIANTS; i++)
            if (variant_supported[i]())
                best = i;
        k = &variants[best];
        atomic_store_explicit(&active, k, memory_order_relaxed);
    }
    return k;
}

size_t dtype_kernels_count(void)
{
    return N_VARIANTS;
}

const char *dtype_kernels_name(size_t i)
{
    return i < N_VARIANTS ? variants[i].name : NULL;
}

bool dtype_kernels_supported(size_t i)
{
    return i < N_VARIANTS && variant_supported[i]();
}

int dtype_kernels_use(size_t i)
{
    if (i >= N_VARIANTS)
        return -EINVAL;
    if (!variant_supported[i]())
        return -ENOTSUP;
    atomic_store_explicit(&active, &variants[i], memory_order_relaxed);
    return 0;
}

size_t dtype_kernels_current(void)
{
    return (size_t)(kernels() - variants);
}

void dtype_combine(enum dtype acc, enum dtype_op op, void *restrict dst,
                   const void *restrict src, size_t n)
{
    kernels()->combine(acc, op, dst, src, n);
}

void dtype_combine_into(enum dtype acc, enum dtype_op op, void *restrict dst,
                        const void *restrict a, const void *restrict b, size_t n)
{
    kernels()->combine_into(acc, op, dst, a, b, n);
}

void dtype_combine_onto(enum dtype acc, enum dtype_op op, void *restrict dst,
                        const void *restrict a, size_t n)
{
    kernels()->combine_onto(acc, op, dst, a, n);
}

void dtype_copy_streaming(void *restrict dst, const void *restrict src, size_t bytes)
{
#if HAVE_X86_VARIANTS
    /* SSE2, so every x86-64 CPU: the store unit, not the vector width,
     * bounds a copy to memory. Unaligned ends go through memcpy. */
    uint8_t *d = dst;
    const uint8_t *s = src;
    size_t head = (16 - ((uintptr_t)d & 15)) & 15;

    if (head > bytes)
        head = bytes;
    memcpy(d, s, head);
    d += head;
    s += head;
    bytes -= head;
    for (; bytes >= 16; bytes -= 16, d += 16, s += 16)
        _mm_stream_si128((__m128i *)(void *)d, _mm_loadu_si128((const __m128i *)(const void *)s));
    memcpy(d, s, bytes);
    /* Streaming stores are weakly ordered: whatever publishes dst after
     * this call must not overtake them. */
    _mm_sfence();
#else
    memcpy(dst, src, bytes);
#endif
}

bool dtype_copy_streams(void)
{
    return HAVE_X86_VARIANTS;
}

void dtype_combine_widen(enum dtype t, enum dtype_op op, float *restrict d,
                         const uint16_t *restrict s, size_t n)
{
#if HAVE_F16C
    if (t == DTYPE_F16 && f16c()) {
        combine_widen_f16c(op, d, s, n);
        return;
    }
#endif
    kernels()->combine_widen(t, op, d, s, n);
}

void dtype_widen(enum dtype t, float *restrict dst, const uint16_t *restrict src, size_t n)
{
#if HAVE_F16C
    if (t == DTYPE_F16 && f16c()) {
        widen_f16c(dst, src, n);
        return;
    }
#endif
    kernels()->widen(t, dst, src, n);
}

void dtype_narrow(enum dtype t, uint16_t *restrict dst, const float *restrict src, size_t n)
{
#if HAVE_F16C
    if (t == DTYPE_F16 && f16c()) {
        narrow_f16c(dst, src, n);
        return;
    }
#endif
    kernels()->narrow(t, dst, src, n);
}

/* --- finishing ---------------------------------------------------------- */

static void scale_i32(int32_t *d, size_t n, int64_t div)
{
    /* INT32_MIN / -1 is 2^31, which wraps back to INT32_MIN like a sum. */
    for (size_t i = 0; i < n; i++)
        d[i] = (int32_t)(uint32_t)((int64_t)d[i] / div);
}

static void scale_i64(int64_t *d, size_t n, int64_t div)
{
    if (div == -1) {            /* INT64_MIN / -1 traps; negate with wrap instead */
        for (size_t i = 0; i < n; i++)
            d[i] = (int64_t)(0u - (uint64_t)d[i]);
        return;
    }
    for (size_t i = 0; i < n; i++)
        d[i] /= div;
}

void dtype_scale(enum dtype acc, void *buf, size_t n, double divisor)
{
    if (divisor == 1)
        return;
    switch (acc) {
    case DTYPE_F32:
    case DTYPE_F64:
        kernels()->scale_float(acc, buf, n, divisor);
        break;
    case DTYPE_I32:
        scale_i32(buf, n, (int64_t)divisor);
        break;
    case DTYPE_I64:
        scale_i64(buf, n, (int64_t)divisor);
        break;
    default:
        break;
    }
}

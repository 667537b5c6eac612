/* src/engine/dtype.h: the element types and reduction operators an all-reduce
 * supports (mlbench's set: sum, avg over the members, avg over a caller's
 * denominator, plus min and max), and the kernels that combine them.
 *
 * Partial results are carried in an accumulation type, dtype_acc(): the
 * type itself, except float16 and bfloat16, which accumulate in float32 so
 * that a sum over many members rounds once, at the end, and not at every
 * hop. The kernels are plain loops over restrict pointers in fixed-size
 * blocks, which gcc -O2 (its "very cheap" vectoriser) turns into SIMD,
 * compiled once per instruction set (x86-64: baseline SSE2, AVX2,
 * AVX-512) and chosen at run time for the CPU; float16 conversions use
 * the F16C instructions where the CPU has them. Every variant writes the
 * same bytes as the portable code.
 *
 * Semantics every member must agree on, fixed here:
 *   - integer sums wrap modulo 2^32 or 2^64 (two's complement);
 *   - float min/max propagate NaN, and on equal operands (+0 and -0) keep
 *     the left one (dst);
 *   - avg and avg-by-denominator divide the finished sum once: floats as
 *     x / (T)d in their accumulation type (so f16 and bf16 round twice:
 *     the f32 quotient, then to 16 bits, to nearest even); integers divide
 *     exactly and truncate toward zero, and need an integral denominator;
 *   - float16 <-> float32 and bfloat16 <-> float32 conversions are exact
 *     one way and round to nearest even the other, with Inf, NaN (made
 *     quiet, sign kept) and subnormals handled. */
#ifndef COHORT_DTYPE_H
#define COHORT_DTYPE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum dtype { DTYPE_F32, DTYPE_F64, DTYPE_F16, DTYPE_BF16, DTYPE_I32, DTYPE_I64 };
#define DTYPE_COUNT 6

enum dtype_op {
    DTYPE_SUM,
    DTYPE_AVG,          /* sum / number of members */
    DTYPE_MIN,
    DTYPE_MAX,
    DTYPE_AVG_BY,       /* sum / a denominator the caller gives (mlbench's avg_custom) */
};
#define DTYPE_OP_COUNT 5

/* Questions about values that may come from outside (a flag, the wire). */
bool dtype_valid(int t);
bool dtype_op_valid(int op);

size_t dtype_size(enum dtype t);                /* bytes per element */
enum dtype dtype_acc(enum dtype t);             /* F32 for F16/BF16, else t */
bool dtype_is_16bit_float(enum dtype t);
bool dtype_is_int(enum dtype t);

/* "f32" "f64" "f16" "bf16" "i32" "i64"; "sum" "avg" "min" "max" "avg_by".
 * The returned names are static. Parsers return 0 or -EINVAL. */
const char *dtype_name(enum dtype t);
const char *dtype_op_name(enum dtype_op op);
int dtype_parse(const char *s, enum dtype *out);
int dtype_parse_op(const char *s, enum dtype_op *out);

/* The divisor the finishing step applies: `members` for DTYPE_AVG,
 * `denominator` for DTYPE_AVG_BY, 1 (no scaling) otherwise. Returns 0, or
 * -EINVAL for a zero, NaN or infinite denominator, or, for integer types,
 * one that is not an integer of magnitude at most 2^53. */
int dtype_divisor(enum dtype t, enum dtype_op op, size_t members, double denominator,
                  double *divisor);

/* dst[i] = dst[i] op src[i] for n elements of an accumulation type (F32,
 * F64, I32, I64); avg ops combine as sum. dst and src must not overlap. */
void dtype_combine(enum dtype acc, enum dtype_op op, void *restrict dst,
                   const void *restrict src, size_t n);

/* dst[i] = a[i] op b[i]: dtype_combine out of place, with the same bytes
 * (a plays dst's part). None of the three overlap. */
void dtype_combine_into(enum dtype acc, enum dtype_op op, void *restrict dst,
                        const void *restrict a, const void *restrict b, size_t n);

/* dst[i] = a[i] op dst[i]: dtype_combine_into with b being dst, with its
 * bytes: min and max keep a tie's first operand, a, as into does; only a
 * sum of two NaNs may keep the other one's payload, since the compiler
 * may order a commutative add either way (in either kernel). dst and a
 * do not overlap. */
void dtype_combine_onto(enum dtype acc, enum dtype_op op, void *restrict dst,
                        const void *restrict a, size_t n);

/* memcpy that writes dst with non-temporal stores (x86-64; a plain memcpy
 * elsewhere): a destination that will not be read again soon is neither
 * read from memory first (write-allocate) nor left to push other lines
 * out of the cache. The stores are fenced before it returns. */
void dtype_copy_streaming(void *restrict dst, const void *restrict src, size_t bytes);

/* True where dtype_copy_streaming streams (x86-64), false where it is a
 * memcpy. */
bool dtype_copy_streams(void);

/* The same with src a float16 or bfloat16 (`t`) array widened on the fly:
 * dst[i] = dst[i] op (float)src[i]. */
void dtype_combine_widen(enum dtype t, enum dtype_op op, float *restrict dst,
                         const uint16_t *restrict src, size_t n);

/* Divides n elements of an accumulation type in place by `divisor` (from
 * dtype_divisor); a divisor of 1 leaves them as they are. */
void dtype_scale(enum dtype acc, void *buf, size_t n, double divisor);

/* Kernel variants, by index from 0 (the portable baseline) up to
 * dtype_kernels_count() - 1, worst to best; the best the CPU supports is
 * used unless dtype_kernels_use() picks another (tests and benchmarks do,
 * to compare them; the choice is process-wide). Names are static
 * ("baseline", "avx2", "avx512"), NULL out of range. dtype_kernels_use
 * returns 0, -EINVAL out of range or -ENOTSUP when the CPU lacks it. */
size_t dtype_kernels_count(void);
const char *dtype_kernels_name(size_t i);
bool dtype_kernels_supported(size_t i);
int dtype_kernels_use(size_t i);
size_t dtype_kernels_current(void);

/* Bulk conversions between a 16-bit float type `t` and float32. */
void dtype_widen(enum dtype t, float *restrict dst, const uint16_t *restrict src, size_t n);
void dtype_narrow(enum dtype t, uint16_t *restrict dst, const float *restrict src, size_t n);

/* Scalar conversions (bit patterns in uint16_t). */
float dtype_f16_to_f32(uint16_t h);
uint16_t dtype_f32_to_f16(float f);
float dtype_bf16_to_f32(uint16_t h);
uint16_t dtype_f32_to_bf16(float f);

#endif

/* src/engine/codec.h: what float32 values look like on the wire when a
 * reduction is compressed. The engine accumulates in float32 and only
 * the bytes between members are encoded (allreduce.c, "the codec seam").
 *
 *   CODEC_NONE  the float32 values themselves, 4 bytes each;
 *   CODEC_FP16  IEEE binary16, 2 bytes each: round to nearest even,
 *               overflow past 65504 to Inf, subnormals kept, NaN kept
 *               (made quiet, sign kept); relative error at most 2^-11
 *               for normal values;
 *   CODEC_BF16  bfloat16 (float32's top 16 bits), 2 bytes each: round to
 *               nearest even, the same range as float32, NaN kept
 *               (quiet); relative error at most 2^-8;
 *   CODEC_INT8  blockwise 8-bit: blocks of CODEC_INT8_BLOCK elements
 *               (the last may be shorter), each with a float32 scale
 *               s = max|x| / 127 and one signed byte per element,
 *               q = round-to-nearest-even(x / s) clamped to [-127, 127];
 *               decoded as q * s. Absolute error at most s / 2 (and a
 *               few float32 ulps of the division and the product) per
 *               block. A block of zeros is scale 0. A block holding NaN
 *               or Inf is not representable: its scale is NaN and all
 *               of it decodes as NaN, so the non-finite value still
 *               shows in the result (an AMP grad scaler still skips the
 *               step). -0 decodes as +0;
 *   CODEC_MEANSTD16  hivemind's ScaledFloat16Compression (MEANSTD_16BIT)
 *               over the run as one row: its mean m and deviation
 *               s = max(sqrt(sum (x - m)^2 / n), FLT_EPSILON), both
 *               computed in double and stored as float32, and per element
 *               y = fp16(clamp((x - m) / s, +-65504)) (nearest even, via
 *               float32); decoded as y * s + m in double, rounded once to
 *               float32. Error per element at most 2^-11 |x - m| +
 *               2^-25 s (float16's relative step and its subnormal one,
 *               scaled) plus float32's half ulp of the result: small
 *               values beside a large mean lose what plain fp16 keeps,
 *               a run of one value decodes exactly, and values far past
 *               fp16's range keep their magnitude (|y| <= sqrt(n), so the
 *               clamp never bites below 2^31 elements). A run holding NaN
 *               or Inf has a NaN mean and decodes as NaN throughout;
 *   CODEC_UNIFORM8  hivemind's Uniform8BitQuantization (UNIFORM_8BIT)
 *               over the run: its mean m and unbiased deviation
 *               s = sqrt(sum (x - m)^2 / (n - 1)) in double, the step
 *               h = 6 s / 256 (the bins span m +- 3 s), per element
 *               q = clamp(round-to-nearest-even((x - m) / h) + 128, 0,
 *               255), and a codebook of 256 float32: the mean of the
 *               run's x in each bin (in double; 0 for an empty bin);
 *               decoded as codebook[q]. Error per element at most h
 *               (a bin's width: its mean lies in it) for values in bins
 *               1 to 254, plus float32's half ulp. Bins 0 and 255 also
 *               take the outliers clamped into them (beyond 2.96 s:
 *               under 12 % of the run by Chebyshev), whose pull can move
 *               those bins' means out of the bins, so a value there errs
 *               by at most the span of its bin's values, from the
 *               farthest outlier to the bin's inner edge. A run of one
 *               value (s = 0) decodes exactly; a run holding NaN or Inf
 *               decodes as NaN.
 *   CODEC_QUANTILE8  hivemind's Quantile8BitQuantization (QUANTILE_8BIT)
 *               over the run: 255 borders, the quantiles at k / 256
 *               (k = 1..255) of a sample of m = min(n,
 *               CODEC_QUANTILE8_SAMPLE) elements, element floor(j n / m)
 *               for j < m (all of the run when it is no longer; hivemind's
 *               quantiles are approximate too, "quantiles of chunk
 *               quantiles"), each the sorted sample's s[l] + (s[l + 1] -
 *               s[l]) t at position k (m - 1) / 256 = l + t, in double,
 *               made non-decreasing; per element q = the number of
 *               borders below x (torch.bucketize), and a codebook of 256
 *               float32, the mean of the run's x in each bucket (in
 *               double; 0 for an empty bucket); decoded as codebook[q].
 *               Every bucket is an interval, and its mean lies in it (its
 *               float32 rounding too: the ends are float32), so the error
 *               per element is at most the span (largest less smallest)
 *               of the run's values in its bucket: a 256th of the run's
 *               spread where the values are dense, never more than the
 *               run's range. Each bucket holds about n / 256 values
 *               whatever their distribution, so a few outliers widen only
 *               the end buckets (they share them with the run's n / 256
 *               most extreme values, whose mean they pull), where
 *               uniform8's bins all widen with sigma. A run of one value
 *               decodes exactly; a run holding NaN or Inf decodes as NaN.
 *
 * Ids 4 and 5 are the Accumulator's top-k and PowerSGD (cohort.h's enum
 * cohort_compression counts on these values), which are not codecs.
 *
 * Wire layout of n elements, little-endian like every float the engine
 * sends: FP16/BF16 n x u16; INT8 ceil(n / CODEC_INT8_BLOCK) x f32 scales,
 * then n x i8; MEANSTD16 f32 m, f32 s, then n x u16 (8 + 2n bytes, so a
 * segment of at least 16 bytes holds its encoding: allreduce_run_codec
 * refuses an engine whose segments are shorter); UNIFORM8 256 x f32
 * codebook, then n x u8 (1024 + n bytes: segments of at least 1368
 * bytes); QUANTILE8 the same as UNIFORM8. codec_bytes() says how many
 * bytes that is; every receiver checks a frame's length against it for
 * the element count it expects.
 *
 * Every codec is a fixed-length, stateless map of a run of elements: a
 * segment is encoded alone, so a ring encodes each segment it sends.
 * Encoding is not the identity, so a member that keeps its own copy of
 * values it sends uses codec_decode(codec_encode(x)) to agree with its
 * peers. FP16 and BF16 are idempotent on their own output (encoding a
 * decoded value gives the same bytes); INT8, MEANSTD16, UNIFORM8 and
 * QUANTILE8 need not be (the mean and deviation, or the quantiles, of
 * decoded values differ), so encoded bytes are forwarded as received,
 * never re-encoded.
 *
 * Compression with error feedback lives beside the codecs, not among
 * them: neither is a stateless map of a segment. Top-k (engine/topk.h)
 * keeps a residual per member and all-gathers k (index, value) pairs,
 * since the members' index sets differ and a ring cannot sum them
 * segment by segment; PowerSGD (engine/powersgd.h) keeps an error per
 * member and runs two smaller all-reduces (P and Q) of plain float32.
 *
 * The kernels follow dtype.c: compiled once per instruction set, the one
 * in use chosen with dtype_kernels_use(), every variant writing the same
 * bytes (only operations IEEE 754 rounds exactly, and -ffp-contract=off). */
#ifndef COHORT_CODEC_H
#define COHORT_CODEC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/dtype.h"

/* Values travel in frames and tlink messages: never renumber. */
enum codec {
    CODEC_NONE = 0,
    CODEC_FP16 = 1,
    CODEC_BF16 = 2,
    CODEC_INT8 = 3,
    CODEC_MEANSTD16 = 6,
    CODEC_UNIFORM8 = 7,
    CODEC_QUANTILE8 = 8,
};
/* Ids below CODEC_COUNT are the first codecs, contiguous, whose ids the
 * Accumulator's compression methods share (accumulator/compress.h); its
 * top-k and PowerSGD take 4 and 5, so later codecs follow them, up to
 * CODEC_END (one past the largest id). */
#define CODEC_COUNT 4
#define CODEC_END 9
#define CODEC_UNIFORM8_BINS 256
#define CODEC_INT8_BLOCK 256
/* The most elements QUANTILE8 sorts to find its borders (on the stack). */
#define CODEC_QUANTILE8_SAMPLE 8192

bool codec_valid(int c);
/* "none" "fp16" "bf16" "int8" "meanstd16" "uniform8" "quantile8" (static).
 * codec_parse returns 0 or -EINVAL. */
const char *codec_name(enum codec c);
int codec_parse(const char *s, enum codec *out);

/* True when values of type t can be reduced with codec c: every type
 * with CODEC_NONE, only float32 with the others. */
bool codec_supports(enum codec c, enum dtype t);

/* Bytes on the wire for n float32 elements. */
size_t codec_bytes(enum codec c, size_t n);

/* Encodes n float32 values at src into codec_bytes(c, n) bytes at dst,
 * and back. The buffers must not overlap and are 4-byte aligned (the
 * engine's staging slots are). Decoding never fails: any bytes decode to
 * some floats (a lying peer's garbage is garbage, never a fault). */
void codec_encode(enum codec c, void *restrict dst, const float *restrict src, size_t n);
void codec_decode(enum codec c, float *restrict dst, const void *restrict src, size_t n);

/* x = decode(encode(x)) in place, through `scratch` (codec_bytes(c, n)
 * bytes), which keeps the encoded bytes: what the caller sends. */
void codec_round_trip(enum codec c, float *x, void *scratch, size_t n);

#endif

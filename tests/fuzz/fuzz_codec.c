/* tests/fuzz/fuzz_codec.c: the engine's codecs (src/engine/codec.h), on
 * both sides of the wire. A coded frame's payload is a peer's bytes: the
 * receiver checks its length against codec_bytes() for the element count
 * it expects and then decodes it, so decoding must take any bytes of that
 * length. Encoding takes a member's own values, any floats at all.
 *
 * Input: a codec byte (taken modulo the ids, invalid ones skipped), a mode
 * byte, then
 *   mode even: an element count (16 bits, capped at 4096) and the payload,
 *              decoded when it has exactly the codec's length for that
 *              count (what conn.c lets through), from a buffer of exactly
 *              that size so that any read past it is caught;
 *   mode odd:  float32 values, encoded into a buffer of exactly
 *              codec_bytes() and decoded back.
 *
 * Invariants: codec_bytes grows with the count; decoding the 8-bit
 * quantizations gives codebook entries, bit for bit; encoding fp16 or bf16
 * a decoded value gives its bytes again (they are idempotent); encoding
 * finite values with uniform8 or quantile8 gives every value a codebook
 * entry between the least and the largest value of its bucket, and with
 * quantile8 a larger value never a lower bucket. */
#include "fuzz.h"

#include <math.h>

#include "engine/codec.h"

#define MAX_N 4096

static uint32_t bits(float f)
{
    uint32_t u;

    memcpy(&u, &f, 4);
    return u;
}

static void decode_side(enum codec c, struct fuzz_in *in)
{
    size_t n = fuzz_u16(in) % (MAX_N + 1), len = codec_bytes(c, n);
    uint8_t *wire;
    float *out;

    CHECK(codec_bytes(c, n + 1) > len);
    if (in->n != len)
        return;         /* the receiver refuses the frame before decoding */
    wire = malloc(len ? len : 1);
    out = malloc(n ? n * sizeof(float) : 1);
    CHECK(wire && out);
    memcpy(wire, in->p, len);
    codec_decode(c, out, wire, n);
    for (size_t i = 0; i < n; i++) {
        if (c == CODEC_UNIFORM8 || c == CODEC_QUANTILE8) {
            uint8_t q = wire[4 * CODEC_UNIFORM8_BINS + i];
            float e;

            memcpy(&e, wire + 4 * (size_t)q, 4);
            CHECK(bits(out[i]) == bits(e));
        }
        if ((c == CODEC_FP16 || c == CODEC_BF16) && !isnan(out[i])) {
            uint16_t again;
            float back;

            codec_encode(c, &again, &out[i], 1);
            codec_decode(c, &back, &again, 1);
            CHECK(bits(back) == bits(out[i]));
        }
    }
    free(wire);
    free(out);
}

static void encode_side(enum codec c, struct fuzz_in *in)
{
    size_t n = in->n / 4 > MAX_N ? MAX_N : in->n / 4, len = codec_bytes(c, n);
    float *x = malloc(n ? n * sizeof(float) : 1), *out = malloc(n ? n * sizeof(float) : 1);
    uint8_t *wire = malloc(len ? len : 1);
    bool finite = true;

    CHECK(x && out && wire);
    memcpy(x, in->p, n * sizeof(float));
    for (size_t i = 0; i < n; i++)
        finite &= isfinite(x[i]) != 0;
    codec_encode(c, wire, x, n);
    codec_decode(c, out, wire, n);
    if (finite && (c == CODEC_UNIFORM8 || c == CODEC_QUANTILE8)) {
        const uint8_t *q = wire + 4 * CODEC_UNIFORM8_BINS;
        float lo[CODEC_UNIFORM8_BINS], hi[CODEC_UNIFORM8_BINS];

        for (size_t k = 0; k < CODEC_UNIFORM8_BINS; k++) {
            lo[k] = INFINITY;
            hi[k] = -INFINITY;
        }
        for (size_t i = 0; i < n; i++) {
            lo[q[i]] = x[i] < lo[q[i]] ? x[i] : lo[q[i]];
            hi[q[i]] = x[i] > hi[q[i]] ? x[i] : hi[q[i]];
        }
        for (size_t i = 0; i < n; i++)
            CHECK(out[i] >= lo[q[i]] && out[i] <= hi[q[i]]);
        for (size_t i = 0; c == CODEC_QUANTILE8 && i < n; i++)
            for (size_t j = 0; j < n && j < 64; j++)
                CHECK(!(x[i] < x[j]) || q[i] <= q[j]);
    }
    free(x);
    free(out);
    free(wire);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct fuzz_in in = { data, size };
    int id = fuzz_u8(&in) % CODEC_END;
    uint8_t mode = fuzz_u8(&in);

    if (!codec_valid(id))
        return 0;
    if (mode % 2 == 0)
        decode_side((enum codec)id, &in);
    else
        encode_side((enum codec)id, &in);
    return 0;
}

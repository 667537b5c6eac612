/* src/accumulator/compress.h: what a member asks its gradient steps to
 * compress with: one of the engine's codecs (engine/codec.h), top-k
 * sparsification (engine/topk.h) with its ratio, or PowerSGD
 * (engine/powersgd.h) with its rank; and how that choice is written
 * (flags, the CRD, the trainer link).
 *
 * Text: "none", "fp16", "bf16", "int8", "topk:R" with R in (0, 1] at most
 * six decimals (the share of entries each member sends; "topk" alone is
 * topk:0.01), "powersgd:N" with N in 1 .. POWERSGD_MAX_RANK ("powersgd"
 * alone is powersgd:4). The ratio is kept as an integer count of
 * millionths, so every member holds exactly the same parameter and the
 * count step's vote can compare them as integers (node.c, "Compression").
 *
 * Packed (the trainer link's u64, cohort.h's method and parameter):
 * method in bits 0-7, parameter (millionths, or the rank) in bits 8-39. */
#ifndef COHORT_COMPRESS_H
#define COHORT_COMPRESS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* The codecs keep engine/codec.h's values (and cohort.h's). */
enum compress_method {
    COMPRESS_NONE = 0,
    COMPRESS_FP16 = 1,
    COMPRESS_BF16 = 2,
    COMPRESS_INT8 = 3,
    COMPRESS_TOPK = 4,
    COMPRESS_POWERSGD = 5,
};
#define COMPRESS_METHODS 6

#define COMPRESS_TOPK_ONE 1000000u          /* a top-k ratio of 1, in millionths */
#define COMPRESS_TOPK_DEFAULT 10000u        /* 0.01 */
#define COMPRESS_POWERSGD_DEFAULT 4u
/* The longest compress_format output, NUL included. */
#define COMPRESS_TEXT_MAX 24

struct compress {
    enum compress_method method;
    uint32_t param;     /* top-k: millionths in 1 .. COMPRESS_TOPK_ONE; PowerSGD:
                         * the rank, 1 .. POWERSGD_MAX_RANK; else 0 */
};

/* Whether c names a method with a parameter in range (0 for the codecs). */
bool compress_valid(const struct compress *c);

/* The method with its default parameter (0 for the codecs). */
struct compress compress_default(enum compress_method m);

/* Parses the text above into *out. Returns 0 or -EINVAL (unknown method,
 * a parameter out of range or malformed, a parameter on a codec); *out is
 * written only on success. */
int compress_parse(const char *s, struct compress *out);

/* Writes c as compress_parse reads it ("topk:0.01", "powersgd:4", "int8");
 * needs len >= COMPRESS_TEXT_MAX for a valid c. Returns buf. */
const char *compress_format(const struct compress *c, char *buf, size_t len);

uint64_t compress_pack(const struct compress *c);
/* Returns 0 or -EINVAL (not compress_valid, or stray bits). */
int compress_unpack(uint64_t v, struct compress *out);

#endif

/* src/accumulator/compress.c: see compress.h. */
#include "accumulator/compress.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "engine/codec.h"
#include "engine/powersgd.h"

_Static_assert(COMPRESS_NONE == (int)CODEC_NONE && COMPRESS_FP16 == (int)CODEC_FP16 &&
                   COMPRESS_BF16 == (int)CODEC_BF16 && COMPRESS_INT8 == (int)CODEC_INT8 &&
                   COMPRESS_TOPK == CODEC_COUNT,
               "the codecs keep their values; top-k and PowerSGD follow them");

bool compress_valid(const struct compress *c)
{
    switch (c->method) {
    case COMPRESS_NONE:
    case COMPRESS_FP16:
    case COMPRESS_BF16:
    case COMPRESS_INT8: return c->param == 0;
    case COMPRESS_TOPK: return c->param >= 1 && c->param <= COMPRESS_TOPK_ONE;
    case COMPRESS_POWERSGD: return c->param >= 1 && c->param <= POWERSGD_MAX_RANK;
    }
    return false;
}

struct compress compress_default(enum compress_method m)
{
    struct compress c = { .method = m, .param = 0 };

    if (m == COMPRESS_TOPK)
        c.param = COMPRESS_TOPK_DEFAULT;
    else if (m == COMPRESS_POWERSGD)
        c.param = COMPRESS_POWERSGD_DEFAULT;
    return c;
}

/* Digits only, no sign, no spaces, at most `max`; for the rank. */
static int parse_uint(const char *s, uint32_t max, uint32_t *out)
{
    uint64_t v = 0;

    if (!*s)
        return -EINVAL;
    for (; *s; s++) {
        if (*s < '0' || *s > '9')
            return -EINVAL;
        v = v * 10 + (uint64_t)(*s - '0');
        if (v > max)
            return -EINVAL;
    }
    *out = (uint32_t)v;
    return 0;
}

/* "0.01", "1", "1.0", ".5": a decimal in (0, 1] with at most six
 * fraction digits, read exactly as millionths (no float rounding, so
 * every member reads the same number from the same text). */
static int parse_ratio(const char *s, uint32_t *out)
{
    uint32_t whole = 0, frac = 0, scale = 100000u;
    bool digits = false;

    if (*s == '0' || *s == '1') {
        whole = (uint32_t)(*s - '0');
        digits = true;
        s++;
    }
    if (*s == '.') {
        s++;
        for (; *s >= '0' && *s <= '9'; s++) {
            if (scale == 0)
                return -EINVAL;
            frac += (uint32_t)(*s - '0') * scale;
            scale /= 10;
            digits = true;
        }
    }
    if (*s || !digits)
        return -EINVAL;
    if (whole == 1 && frac != 0)
        return -EINVAL;
    *out = whole * COMPRESS_TOPK_ONE + frac;
    return *out == 0 ? -EINVAL : 0;
}

int compress_parse(const char *s, struct compress *out)
{
    struct compress c;
    enum codec codec;
    const char *colon;
    size_t name_len;

    if (!s)
        return -EINVAL;
    colon = strchr(s, ':');
    name_len = colon ? (size_t)(colon - s) : strlen(s);
    if (name_len == 4 && strncmp(s, "topk", 4) == 0) {
        c = compress_default(COMPRESS_TOPK);
        if (colon && parse_ratio(colon + 1, &c.param) < 0)
            return -EINVAL;
    } else if (name_len == 8 && strncmp(s, "powersgd", 8) == 0) {
        c = compress_default(COMPRESS_POWERSGD);
        if (colon && (parse_uint(colon + 1, POWERSGD_MAX_RANK, &c.param) < 0 || c.param == 0))
            return -EINVAL;
    } else if (!colon && codec_parse(s, &codec) == 0 && codec < CODEC_COUNT) {
        /* The Accumulator's rounds take the first codecs only. */
        c = compress_default((enum compress_method)codec);
    } else {
        return -EINVAL;
    }
    *out = c;
    return 0;
}

const char *compress_format(const struct compress *c, char *buf, size_t len)
{
    if (c->method == COMPRESS_TOPK) {
        char frac[8];
        size_t end;

        if (c->param >= COMPRESS_TOPK_ONE) {
            snprintf(buf, len, "topk:1");
            return buf;
        }
        /* Six digits, trailing zeros dropped: 10000 is "0.01". */
        snprintf(frac, sizeof(frac), "%06u", (unsigned)c->param);
        end = strlen(frac);
        while (end > 1 && frac[end - 1] == '0')
            end--;
        snprintf(buf, len, "topk:0.%.*s", (int)end, frac);
    } else if (c->method == COMPRESS_POWERSGD) {
        snprintf(buf, len, "powersgd:%u", (unsigned)c->param);
    } else {
        snprintf(buf, len, "%s", codec_valid((int)c->method) ? codec_name((enum codec)c->method) : "?");
    }
    return buf;
}

uint64_t compress_pack(const struct compress *c)
{
    return (uint64_t)c->method | (uint64_t)c->param << 8;
}

int compress_unpack(uint64_t v, struct compress *out)
{
    struct compress c;

    if (v >> 40)
        return -EINVAL;
    c.method = (enum compress_method)(v & 0xff);
    c.param = (uint32_t)(v >> 8);
    if ((v & 0xff) >= COMPRESS_METHODS || !compress_valid(&c))
        return -EINVAL;
    *out = c;
    return 0;
}

/* src/gpu/gpuid.c: see gpuid.h. */
#include "gpu/gpuid.h"

#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

static int hexval(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

int gpuid_parse(const char *s, struct gpuid *out)
{
    /* Where the dashes fall, by hex digit: 8-4-4-4-12. */
    static const bool dash_after[32] = { [7] = true, [11] = true, [15] = true, [19] = true };
    struct gpuid id;
    size_t digit = 0;

    if (!s)
        return -EINVAL;
    if (strncmp(s, "GPU-", 4) == 0)
        s += 4;
    for (; digit < 32; digit++) {
        int v = hexval(*s++);
        if (v < 0)
            return -EINVAL;
        if (digit % 2 == 0)
            id.b[digit / 2] = (uint8_t)(v << 4);
        else
            id.b[digit / 2] |= (uint8_t)v;
        if (dash_after[digit] && *s++ != '-')
            return -EINVAL;
    }
    if (*s != '\0')
        return -EINVAL;
    *out = id;
    return 0;
}

char *gpuid_format(const struct gpuid *id, char *buf, size_t len)
{
    const uint8_t *b = id->b;

    snprintf(buf, len,
             "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
             b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12],
             b[13], b[14], b[15]);
    return buf;
}

int gpuid_find(const struct gpuid *ids, size_t n, const struct gpuid *want)
{
    int found = -ENODEV;

    for (size_t i = 0; i < n; i++) {
        if (memcmp(ids[i].b, want->b, GPUID_BYTES) != 0)
            continue;
        if (found >= 0)
            return -EEXIST;
        found = (int)i;
    }
    return found;
}

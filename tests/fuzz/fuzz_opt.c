/* tests/fuzz/fuzz_opt.c: the value parsers behind every flag and every
 * duration a TrainingCohort spells (src/base/opt.h): opt_duration_ms,
 * opt_uint, opt_bytes and opt_bytes_list.
 *
 * Input: one byte choosing the parser and its bounds, then the text.
 *
 * Invariants: each parser is compared with a slow restatement of its
 * grammar in 128-bit arithmetic: it accepts exactly the texts the grammar
 * allows whose value is within bounds, with that value; a text the
 * grammar refuses is -EINVAL (or -ERANGE once its digits alone overflow);
 * a value out of bounds is -ERANGE. */
#include "fuzz.h"

#include <ctype.h>
#include <errno.h>

#include "base/opt.h"

typedef unsigned __int128 u128;

#define BIG ((u128)1 << 100)        /* "more than any bound" */

static const uint64_t bounds[] = { 0, 1, 1000, 3600000, 1ull << 30, 1ull << 40, UINT64_MAX / 2,
                                   UINT64_MAX };

/* Decimal digits at *p into *v, saturating at BIG. Returns how many. */
static size_t digits(const char **p, u128 *v)
{
    size_t n = 0;

    for (*v = 0; isdigit((unsigned char)**p); (*p)++, n++)
        *v = *v >= BIG ? BIG : *v * 10 + (u128)(**p - '0');
    return n;
}

static void duration(const char *s, uint64_t max)
{
    static const struct { const char *unit; uint64_t ms; } units[] = {
        { "ms", 1 }, { "s", 1000 }, { "m", 60000 }, { "h", 3600000 },
    };
    const char *p = s;
    u128 whole, frac = 0, div = 1, v = 0;
    uint64_t ms = 0;
    bool syntax = digits(&p, &whole) > 0, unit = false;
    int rc = opt_duration_ms(s, max, &ms);

    if (syntax && *p == '.') {
        p++;
        syntax = isdigit((unsigned char)*p);
        for (; isdigit((unsigned char)*p); p++)
            if (div < 1000) {
                frac = frac * 10 + (u128)(*p - '0');
                div *= 10;
            }
    }
    for (size_t i = 0; syntax && i < sizeof(units) / sizeof(units[0]) && !unit; i++)
        if (strcmp(p, units[i].unit) == 0) {
            unit = true;
            v = whole * units[i].ms + frac * units[i].ms / div;
        }
    CHECK(rc == 0 || rc == -EINVAL || rc == -ERANGE);
    if (!syntax || !unit) {
        CHECK(rc == -EINVAL || (rc == -ERANGE && whole > UINT64_MAX / 20));
        return;
    }
    if (v > max) {
        CHECK(rc == -ERANGE);
        return;
    }
    CHECK(rc == 0 && ms == v);
}

static void unsigned_int(const char *s, uint64_t min, uint64_t max)
{
    const char *p = s;
    u128 v;
    uint64_t out = 0;
    size_t n = digits(&p, &v);
    int rc = opt_uint(s, min, max, &out);

    CHECK(rc == 0 || rc == -EINVAL || rc == -ERANGE);
    if (n == 0 || *p) {
        CHECK(rc == -EINVAL || (rc == -ERANGE && v > UINT64_MAX));
        return;
    }
    if (v < min || v > max) {
        CHECK(rc == -ERANGE);
        return;
    }
    CHECK(rc == 0 && out == v);
}

/* opt_bytes's grammar: the value, or 0 with *ok false. */
static u128 bytes_value(const char *s, bool *ok, u128 *digits_value)
{
    const char *p = s;
    u128 v, mul = 1;
    size_t n = digits(&p, &v);

    *digits_value = v;
    *ok = false;
    if (n == 0)
        return 0;
    switch (*p) {
    case 'K': case 'k': mul = 1ull << 10; p++; break;
    case 'M': case 'm': mul = 1ull << 20; p++; break;
    case 'G': case 'g': mul = 1ull << 30; p++; break;
    default: break;
    }
    if (mul > 1 && (strcmp(p, "iB") == 0 || strcmp(p, "B") == 0))
        p += strlen(p);
    if (*p || v == 0)
        return 0;
    *ok = true;
    return v >= BIG ? BIG : v * mul;
}

static void bytes(const char *s, uint64_t max)
{
    bool ok;
    u128 d, v = bytes_value(s, &ok, &d);
    uint64_t out = 0;
    int rc = opt_bytes(s, max, &out);

    CHECK(rc == 0 || rc == -EINVAL || rc == -ERANGE);
    if (!ok) {
        CHECK(rc == -EINVAL || (rc == -ERANGE && d > UINT64_MAX));
        return;
    }
    if (v > max) {
        CHECK(rc == -ERANGE);
        return;
    }
    CHECK(rc == 0 && out == v);
}

static void list(const char *s, uint64_t max, size_t cap)
{
    uint64_t out[8] = { 0 }, one;
    size_t n = 1, items = 0;
    int rc = opt_bytes_list(s, max, out, cap, &n);
    bool all = true;

    CHECK(rc == 0 || rc == -EINVAL || rc == -ERANGE || rc == -E2BIG);
    if (rc < 0) {
        CHECK(n == 1);
        return;
    }
    /* Accepted: each comma-separated item is what opt_bytes makes of it. */
    for (const char *p = s;; p++) {
        const char *comma = strchr(p, ',');
        size_t len = comma ? (size_t)(comma - p) : strlen(p);
        char item[32];

        CHECK(len > 0 && len < sizeof(item));
        memcpy(item, p, len);
        item[len] = '\0';
        all = all && opt_bytes(item, max, &one) == 0 && out[1 + items] == one;
        items++;
        if (!comma)
            break;
        p = comma;
    }
    CHECK(all && n == 1 + items && n <= cap);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    uint8_t how;
    char *s;

    if (size < 1 || size > 256)
        return 0;
    how = data[0];
    s = fuzz_strndup(data + 1, size - 1);
    switch (how & 3) {
    case 0: duration(s, bounds[(how >> 2) & 7]); break;
    case 1: unsigned_int(s, bounds[(how >> 2) & 7] / 2, bounds[(how >> 5) & 7]); break;
    case 2: bytes(s, bounds[(how >> 2) & 7]); break;
    default: list(s, bounds[(how >> 2) & 7], 1 + ((how >> 5) & 7)); break;
    }
    free(s);
    return 0;
}

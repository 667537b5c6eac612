/* src/base/opt.c: see opt.h. */
#include "base/opt.h"

#include <ctype.h>
#include <errno.h>
#include <getopt.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "base/log.h"

/* The decimal digits at *p, which must start with one; *p is left at the
 * first other character. Returns 0, -EINVAL (no digit) or -ERANGE. */
static int digits(const char **p, uint64_t *v)
{
    const char *q = *p;

    if (!q || !isdigit((unsigned char)*q))
        return -EINVAL;
    for (*v = 0; isdigit((unsigned char)*q); q++) {
        if (*v > (UINT64_MAX - (uint64_t)(*q - '0')) / 10)
            return -ERANGE;
        *v = *v * 10 + (uint64_t)(*q - '0');
    }
    *p = q;
    return 0;
}

int opt_uint(const char *s, uint64_t min, uint64_t max, uint64_t *out)
{
    uint64_t v;
    int rc = digits(&s, &v);

    if (rc < 0)
        return rc;
    if (*s)
        return -EINVAL;
    if (v < min || v > max)
        return -ERANGE;
    *out = v;
    return 0;
}

int opt_bytes(const char *s, uint64_t max, uint64_t *out)
{
    uint64_t v, mul = 1;
    const char *p = s;
    int rc = digits(&p, &v);

    if (rc < 0)
        return rc;
    switch (*p) {
    case 'K': case 'k': mul = 1ull << 10; p++; break;
    case 'M': case 'm': mul = 1ull << 20; p++; break;
    case 'G': case 'g': mul = 1ull << 30; p++; break;
    default: break;
    }
    if (mul > 1 && (strcmp(p, "iB") == 0 || strcmp(p, "B") == 0))
        p += strlen(p);
    if (*p || v == 0)
        return -EINVAL;
    if (v > max / mul)
        return -ERANGE;
    *out = v * mul;
    return 0;
}

int opt_bytes_list(const char *s, uint64_t max, uint64_t *out, size_t cap, size_t *n)
{
    size_t k = *n;

    if (!s)
        return -EINVAL;
    for (;;) {
        const char *comma = strchr(s, ',');
        size_t len = comma ? (size_t)(comma - s) : strlen(s);
        char one[32];
        int rc;

        if (len == 0 || len >= sizeof(one))
            return -EINVAL;
        if (k == cap)
            return -E2BIG;
        memcpy(one, s, len);
        one[len] = '\0';
        if ((rc = opt_bytes(one, max, &out[k])) < 0)
            return rc;
        k++;
        if (!comma)
            break;
        s = comma + 1;
    }
    *n = k;
    return 0;
}

int opt_duration_ms(const char *s, uint64_t max_ms, uint64_t *ms)
{
    static const struct { const char *unit; uint64_t ms; } units[] = {
        { "ms", 1 }, { "s", 1000 }, { "m", 60000 }, { "h", 3600000 },
    };
    uint64_t whole = 0, frac = 0, frac_div = 1;
    const char *p = s;
    int rc = digits(&p, &whole);

    if (rc < 0)
        return rc;
    if (*p == '.') {
        p++;
        if (!isdigit((unsigned char)*p))
            return -EINVAL;
        /* Three decimals are as fine as milliseconds get. */
        for (; isdigit((unsigned char)*p); p++) {
            if (frac_div < 1000) {
                frac = frac * 10 + (uint64_t)(*p - '0');
                frac_div *= 10;
            }
        }
    }
    for (size_t i = 0; i < sizeof(units) / sizeof(units[0]); i++) {
        if (strcmp(p, units[i].unit) != 0)
            continue;
        if (whole > max_ms / units[i].ms)
            return -ERANGE;
        uint64_t v = whole * units[i].ms + frac * units[i].ms / frac_div;
        if (v > max_ms)
            return -ERANGE;
        *ms = v;
        return 0;
    }
    return -EINVAL;
}

int opt_logging(const char *prog, const char *format, const char *level)
{
    enum log_format f;
    enum log_level l;

    if (format) {
        if (log_parse_format(format, &f) < 0) {
            opt_usage(prog, "--log-format must be text or json, not \"%s\"", format);
            return -EINVAL;
        }
        log_set_format(f);
    }
    if (level) {
        if (log_parse_level(level, &l) < 0) {
            opt_usage(prog, "--log-level must be debug, info, warn or error, not \"%s\"", level);
            return -EINVAL;
        }
        log_set_level(l);
    }
    return 0;
}

static void try_help(const char *prog)
{
    fprintf(stderr, "Try '%s --help'.\n", prog);
}

int opt_usage(const char *prog, const char *fmt, ...)
{
    char line[512];
    va_list ap;

    /* Formatted first: the message reaches stderr in one write, which a
     * log line from another thread cannot split. */
    va_start(ap, fmt);
    vsnprintf(line, sizeof(line), fmt, ap);
    va_end(ap);
    fprintf(stderr, "%s: %s\n", prog, line);
    try_help(prog);
    return OPT_EXIT_USAGE;
}

int opt_next(const char *prog, int argc, char **argv, const char *shortopts,
             const struct option *longopts)
{
    char *argv0 = argv[0];
    int opt;

    /* getopt_long names the program by argv[0] in what it prints; the
     * string itself is only read. */
    argv[0] = (char *)prog;
    opt = getopt_long(argc, argv, shortopts, longopts, NULL);
    argv[0] = argv0;
    if (opt == '?' || opt == ':') {
        try_help(prog);
        return '?';
    }
    return opt;
}

int opt_no_operands(const char *prog, int argc, char *const argv[], int first)
{
    if (first >= argc)
        return 0;
    return opt_usage(prog, "unexpected argument \"%s\"", argv[first]);
}

int opt_output(const char *prog, const char *output, bool *json)
{
    if (strcmp(output, "table") != 0 && strcmp(output, "json") != 0)
        return opt_usage(prog, "-o must be table or json, not \"%s\"", output);
    *json = strcmp(output, "json") == 0;
    return 0;
}

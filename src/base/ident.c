/* src/base/ident.c: see ident.h. */
#include "base/ident.h"

#include <ctype.h>
#include <stdlib.h>
#include <string.h>

static bool name_char(unsigned char c)
{
    return isalnum(c) || c == '.' || c == '_' || c == '-';
}

static bool valid_name(const char *s, bool allow_slash)
{
    size_t n, slashes = 0;

    if (!s || !isalnum((unsigned char)s[0]))
        return false;
    n = strnlen(s, IDENT_NAME_MAX + 1);
    if (n > IDENT_NAME_MAX)
        return false;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '/' && allow_slash && i + 1 < n && isalnum((unsigned char)s[i + 1])) {
            slashes++;
            continue;
        }
        if (!name_char(c))
            return false;
    }
    return slashes <= 1;
}

bool ident_valid_member_id(const char *s)
{
    return valid_name(s, false);
}

bool ident_valid_cohort(const char *s)
{
    return valid_name(s, true);
}

static bool valid_port(const char *p)
{
    unsigned long v = 0;
    size_t n = strlen(p);

    if (n == 0 || n > 5)
        return false;
    for (size_t i = 0; i < n; i++) {
        if (!isdigit((unsigned char)p[i]))
            return false;
        v = v * 10 + (unsigned long)(p[i] - '0');
    }
    return v >= 1 && v <= 65535;
}

bool ident_valid_address(const char *s)
{
    const char *colon;
    size_t n, hostlen;

    if (!s)
        return false;
    n = strnlen(s, IDENT_ADDRESS_MAX + 1);
    if (n == 0 || n > IDENT_ADDRESS_MAX)
        return false;
    if (s[0] == '[') {
        const char *close = strchr(s, ']');
        if (!close || close == s + 1 || close[1] != ':')
            return false;
        for (const char *c = s + 1; c < close; c++)
            if (!isxdigit((unsigned char)*c) && *c != ':' && *c != '.')
                return false;
        return valid_port(close + 2);
    }
    colon = strrchr(s, ':');
    if (!colon || colon == s)
        return false;
    hostlen = (size_t)(colon - s);
    for (size_t i = 0; i < hostlen; i++) {
        unsigned char c = (unsigned char)s[i];
        if (!isalnum(c) && c != '.' && c != '-')
            return false;
    }
    return valid_port(colon + 1);
}

int ident_natural_cmp(const char *a, const char *b)
{
    const unsigned char *p = (const unsigned char *)a, *q = (const unsigned char *)b;

    while (*p && *q) {
        if (isdigit(*p) && isdigit(*q)) {
            const unsigned char *ps, *qs;
            size_t pl, ql;

            while (*p == '0' && isdigit(p[1]))
                p++;
            while (*q == '0' && isdigit(q[1]))
                q++;
            ps = p;
            qs = q;
            while (isdigit(*p))
                p++;
            while (isdigit(*q))
                q++;
            pl = (size_t)(p - ps);
            ql = (size_t)(q - qs);
            if (pl != ql)
                return pl < ql ? -1 : 1;
            int c = memcmp(ps, qs, pl);
            if (c)
                return c < 0 ? -1 : 1;
            continue;
        }
        if (*p != *q)
            return *p < *q ? -1 : 1;
        p++;
        q++;
    }
    if (*p || *q)
        return *p ? 1 : -1;
    /* Equal by value ("c-02" vs "c-2"): keep the order total. */
    int c = strcmp(a, b);
    return c < 0 ? -1 : c > 0;
}

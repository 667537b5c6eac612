/* tests/fuzz/fuzz_ident.c: the names and addresses every request and
 * greeting carries, and the order member lists are kept in
 * (src/base/ident.h).
 *
 * Input: up to three strings separated by NUL bytes.
 *
 * Invariants: a valid member id is 1..IDENT_NAME_MAX bytes of
 * [A-Za-z0-9._-] starting with a letter or digit, and every such string is
 * one; a valid cohort name is that with at most one '/', and every valid
 * member id is a valid cohort name; a valid address ends in ':' and a port
 * from 1 to 65535 and is at most IDENT_ADDRESS_MAX bytes; natural order
 * is a total order: -1, 0 or 1, antisymmetric, 0 only for equal strings,
 * and transitive. */
#include "fuzz.h"

#include <ctype.h>

#include "base/ident.h"

static bool plain_name(const char *s)
{
    size_t n = strlen(s);

    if (n == 0 || n > IDENT_NAME_MAX || !isalnum((unsigned char)s[0]))
        return false;
    for (size_t i = 0; i < n; i++)
        if (!isalnum((unsigned char)s[i]) && !strchr("._-", s[i]))
            return false;
    return true;
}

static void one(const char *s)
{
    bool id = ident_valid_member_id(s), cohort = ident_valid_cohort(s);
    size_t n = strlen(s);

    CHECK(id == plain_name(s));
    CHECK(!id || cohort);
    if (cohort) {
        const char *slash = strchr(s, '/');
        CHECK(n >= 1 && n <= IDENT_NAME_MAX && isalnum((unsigned char)s[0]));
        CHECK(!slash || !strchr(slash + 1, '/'));
        for (size_t i = 0; i < n; i++)
            CHECK(isalnum((unsigned char)s[i]) || strchr("._-/", s[i]));
    }
    if (ident_valid_address(s)) {
        const char *colon = strrchr(s, ':');
        unsigned long port = 0;
        size_t digits = strlen(colon + 1);

        CHECK(n <= IDENT_ADDRESS_MAX && colon && colon > s);
        CHECK(digits >= 1 && digits <= 5);
        for (const char *p = colon + 1; *p; p++) {
            CHECK(isdigit((unsigned char)*p));
            port = port * 10 + (unsigned long)(*p - '0');
        }
        CHECK(port >= 1 && port <= 65535);
    }
    CHECK(ident_natural_cmp(s, s) == 0);
}

static int cmp(const char *a, const char *b)
{
    int r = ident_natural_cmp(a, b);

    CHECK(r == -1 || r == 0 || r == 1);
    CHECK(ident_natural_cmp(b, a) == -r);
    CHECK((r == 0) == (strcmp(a, b) == 0));
    return r;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *buf = fuzz_strndup(data, size), *s[3];
    size_t n = 0, at = 0;

    while (n < 3) {
        s[n++] = buf + at;
        at += strlen(buf + at);
        if (at >= size)
            break;
        at++;
    }
    while (n < 3) {
        s[n] = s[n - 1];
        n++;
    }
    for (int i = 0; i < 3; i++)
        one(s[i]);
    /* Transitive, in every arrangement of the three. */
    {
        int ab = cmp(s[0], s[1]), bc = cmp(s[1], s[2]), ac = cmp(s[0], s[2]);
        if (ab <= 0 && bc <= 0)
            CHECK(ac <= 0);
        if (ab >= 0 && bc >= 0)
            CHECK(ac >= 0);
        if (ab <= 0 && ac >= 0)
            CHECK(bc >= 0);     /* c <= a <= b */
        if (ab >= 0 && ac <= 0)
            CHECK(bc <= 0);     /* b <= a <= c */
        if (bc <= 0 && ac >= 0)
            CHECK(ab >= 0);     /* b <= c <= a */
        if (bc >= 0 && ac <= 0)
            CHECK(ab <= 0);     /* a <= c <= b */
    }
    free(buf);
    return 0;
}

/* tests/fuzz/fuzz_secret.c: a cohort's key file as secret_parse reads it
 * (src/base/secret.h): what a Secret mounted into a pod, or a
 * --secret-file, holds.
 *
 * Invariants: a key is accepted exactly when the text, less surrounding
 * whitespace, is 64 hexadecimal digits, and it formats back to those
 * digits in lower case; the MAC under an accepted key is deterministic and
 * equal to itself. */
#include "fuzz.h"

#include <ctype.h>
#include <errno.h>

#include "base/secret.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const char *text = (const char *)data;
    struct secret k;
    char hex[SECRET_HEX_CHARS + 1];
    uint8_t mac[SECRET_MAC_BYTES], again[SECRET_MAC_BYTES];
    size_t b = 0, e = size;
    bool want = true;
    int rc;

    while (b < e && isspace((unsigned char)text[b]))
        b++;
    while (e > b && isspace((unsigned char)text[e - 1]))
        e--;
    if (e - b != SECRET_HEX_CHARS)
        want = false;
    for (size_t i = b; i < e && want; i++)
        want = isxdigit((unsigned char)text[i]);
    rc = secret_parse(text, size, &k);
    CHECK(rc == 0 || rc == -EINVAL);
    CHECK((rc == 0) == want);
    if (rc < 0)
        return 0;
    secret_format(&k, hex);
    for (size_t i = 0; i < SECRET_HEX_CHARS; i++)
        CHECK(hex[i] == tolower((unsigned char)text[b + i]));
    {
        struct secret_part parts[] = { { data, size / 2 }, { data + size / 2, size - size / 2 } };
        CHECK(secret_mac(&k, "cohort/fuzz/v1", parts, 2, mac) == 0);
        CHECK(secret_mac(&k, "cohort/fuzz/v1", parts, 2, again) == 0);
        CHECK(secret_mac_equal(mac, again));
    }
    secret_wipe(&k);
    return 0;
}

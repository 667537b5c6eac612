/* tests/unit/test_secret.c: key files and the MAC that proves membership. */
#include <criterion/criterion.h>

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <openssl/evp.h>
#include <openssl/hmac.h>

#include "base/secret.h"

#define HEX "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f"

static char dir[] = "/tmp/cohort-secret-XXXXXX";

static void make_dir(void)
{
    cr_assert_not_null(mkdtemp(dir));
}

static void remove_dir(void)
{
    char cmd[128];

    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    /* A .fini cannot fail a test (docs/architecture.md, Tests): say it. */
    if (system(cmd) != 0)
        fprintf(stderr, "%s: could not remove %s\n", __FILE__, dir);
}

static const char *file_with(const char *name, const char *text, size_t len)
{
    static char path[256];
    FILE *f;

    snprintf(path, sizeof(path), "%s/%s", dir, name);
    f = fopen(path, "w");
    cr_assert_not_null(f);
    cr_assert_eq(fwrite(text, 1, len, f), len);
    fclose(f);
    return path;
}

Test(secret, parse_takes_64_hex_digits_and_whitespace)
{
    struct secret s;

    cr_assert_eq(secret_parse(HEX, strlen(HEX), &s), 0);
    for (int i = 0; i < SECRET_KEY_BYTES; i++)
        cr_assert_eq(s.key[i], i);
    cr_assert_eq(secret_parse("  " HEX "\n", strlen(HEX) + 3, &s), 0);
    cr_assert_eq(s.key[31], 31);
}

Test(secret, parse_refuses_anything_else)
{
    struct secret s;
    char bad[] = HEX;

    cr_assert_eq(secret_parse(HEX, strlen(HEX) - 1, &s), -EINVAL);
    cr_assert_eq(secret_parse(HEX "0", strlen(HEX) + 1, &s), -EINVAL);
    cr_assert_eq(secret_parse("", 0, &s), -EINVAL);
    bad[17] = 'g';
    cr_assert_eq(secret_parse(bad, strlen(bad), &s), -EINVAL);
    bad[17] = ' ';
    cr_assert_eq(secret_parse(bad, strlen(bad), &s), -EINVAL);
}

Test(secret, files_round_trip_with_mode_0600_and_are_never_replaced, .init = make_dir,
     .fini = remove_dir)
{
    struct secret a, b;
    char path[256];
    struct stat st;

    snprintf(path, sizeof(path), "%s/key", dir);
    cr_assert_eq(secret_generate(&a), 0);
    cr_assert_eq(secret_write(path, &a), 0);
    cr_assert_eq(stat(path, &st), 0);
    cr_assert_eq(st.st_mode & 0777, 0600);
    cr_assert_eq(secret_load(path, &b), 0);
    cr_assert_eq(memcmp(a.key, b.key, sizeof(a.key)), 0);
    cr_assert_eq(secret_write(path, &b), -EEXIST);
}

Test(secret, load_refuses_missing_long_and_malformed_files, .init = make_dir, .fini = remove_dir)
{
    struct secret s;
    char big[SECRET_FILE_MAX + 10];

    cr_assert_eq(secret_load("/nonexistent/cohort/key", &s), -ENOENT);
    memset(big, ' ', sizeof(big));
    memcpy(big, HEX, strlen(HEX));
    /* Whitespace only, but past the cap: not a key file. */
    cr_assert_eq(secret_load(file_with("long", big, sizeof(big)), &s), -EINVAL);
    cr_assert_eq(secret_load(file_with("short", HEX, 10), &s), -EINVAL);
    cr_assert_eq(secret_load(file_with("ok", HEX "\n", strlen(HEX) + 1), &s), 0);
}

Test(secret, generated_keys_differ)
{
    struct secret a, b;

    cr_assert_eq(secret_generate(&a), 0);
    cr_assert_eq(secret_generate(&b), 0);
    cr_assert_neq(memcmp(a.key, b.key, sizeof(a.key)), 0);
}

/* secret_mac is HMAC-SHA256 of its framed input: a label "L" and one part
 * "abc" become 01 00.. 'L' 03 00.. "abc", checked against OpenSSL's
 * one-shot HMAC. */
Test(secret, mac_is_hmac_sha256_of_length_prefixed_parts)
{
    struct secret s;
    uint8_t got[SECRET_MAC_BYTES], again[SECRET_MAC_BYTES], other[SECRET_MAC_BYTES];
    struct secret_part abc[] = { SECRET_STR("abc") };
    struct secret_part ab_c[] = { SECRET_STR("ab"), SECRET_STR("c") };
    struct secret_part framed[] = { { "\x01\0\0\0\0\0\0\0L\x03\0\0\0\0\0\0\0abc", 20 } };
    uint8_t raw[SECRET_MAC_BYTES];

    cr_assert_eq(secret_parse(HEX, strlen(HEX), &s), 0);
    cr_assert_eq(secret_mac(&s, "L", abc, 1, got), 0);
    cr_assert_eq(secret_mac(&s, "L", abc, 1, again), 0);
    cr_assert(secret_mac_equal(got, again));
    /* The same bytes split differently, or under another label, differ. */
    cr_assert_eq(secret_mac(&s, "L", ab_c, 2, other), 0);
    cr_assert_not(secret_mac_equal(got, other));
    cr_assert_eq(secret_mac(&s, "M", abc, 1, other), 0);
    cr_assert_not(secret_mac_equal(got, other));
    /* Another key differs. */
    s.key[0] ^= 1;
    cr_assert_eq(secret_mac(&s, "L", abc, 1, other), 0);
    cr_assert_not(secret_mac_equal(got, other));
    s.key[0] ^= 1;
    /* The input is exactly the length-prefixed concatenation. */
    {
        unsigned int len = 0;
        cr_assert_not_null(HMAC(EVP_sha256(), s.key, sizeof(s.key), framed[0].p, framed[0].len,
                                raw, &len));
        cr_assert_eq(len, SECRET_MAC_BYTES);
        cr_assert(secret_mac_equal(got, raw));
    }
}

/* Each thread keeps its last key's context (secret.c): a MAC under
 * another key in between, or on another thread, must not change what a
 * key gives, and a changed key must not reuse the old one's context. */
struct mac_job {
    struct secret s;
    uint8_t mac[SECRET_MAC_BYTES];
    int rc;
};

static void *mac_on_thread(void *arg)
{
    struct mac_job *j = arg;
    struct secret_part abc[] = { SECRET_STR("abc") };

    j->rc = secret_mac(&j->s, "L", abc, 1, j->mac);
    return NULL;
}

Test(secret, mac_is_the_same_across_keys_and_threads)
{
    struct secret a, b;
    struct secret_part abc[] = { SECRET_STR("abc") };
    uint8_t first[SECRET_MAC_BYTES], under_b[SECRET_MAC_BYTES], again[SECRET_MAC_BYTES];
    uint8_t raw[SECRET_MAC_BYTES];
    struct mac_job job;
    unsigned int len = 0;
    pthread_t t;

    cr_assert_eq(secret_parse(HEX, strlen(HEX), &a), 0);
    b = a;
    b.key[31] ^= 0x80;
    cr_assert_eq(secret_mac(&a, "L", abc, 1, first), 0);
    cr_assert_eq(secret_mac(&b, "L", abc, 1, under_b), 0);
    cr_assert_not(secret_mac_equal(first, under_b));
    cr_assert_eq(secret_mac(&a, "L", abc, 1, again), 0);
    cr_assert(secret_mac_equal(first, again));
    /* b's MAC is HMAC-SHA256 under b's key, not a's kept context. */
    cr_assert_not_null(HMAC(EVP_sha256(), b.key, sizeof(b.key),
                            (const unsigned char *)"\x01\0\0\0\0\0\0\0L\x03\0\0\0\0\0\0\0abc",
                            20, raw, &len));
    cr_assert(secret_mac_equal(under_b, raw));
    job.s = a;
    cr_assert_eq(pthread_create(&t, NULL, mac_on_thread, &job), 0);
    cr_assert_eq(pthread_join(t, NULL), 0);
    cr_assert_eq(job.rc, 0);
    cr_assert(secret_mac_equal(first, job.mac));
}

Test(secret, wipe_clears_the_key)
{
    struct secret s;
    static const uint8_t zero[SECRET_KEY_BYTES];

    cr_assert_eq(secret_generate(&s), 0);
    secret_wipe(&s);
    cr_assert_eq(memcmp(s.key, zero, sizeof(zero)), 0);
}

Test(secret, integrity_parse_takes_none_and_mac_only)
{
    static const char *const bad[] = { "MAC", "mac ", " none", "hmac", "1", "true", "macx" };
    bool mac = true;

    cr_assert_eq(secret_integrity_parse(NULL, &mac), 0);
    cr_assert_not(mac);
    mac = true;
    cr_assert_eq(secret_integrity_parse("", &mac), 0);
    cr_assert_not(mac);
    mac = true;
    cr_assert_eq(secret_integrity_parse("none", &mac), 0);
    cr_assert_not(mac);
    cr_assert_eq(secret_integrity_parse("mac", &mac), 0);
    cr_assert(mac);
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        cr_assert_eq(secret_integrity_parse(bad[i], &mac), -EINVAL, "\"%s\"", bad[i]);
        cr_assert(mac, "a refused \"%s\" changed the setting", bad[i]);
    }
}

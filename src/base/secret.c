/* src/base/secret.c: see secret.h. */
#include "base/secret.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/random.h>
#include <unistd.h>

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/params.h>

static int hexval(int c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

int secret_parse(const char *text, size_t len, struct secret *out)
{
    size_t b = 0, e = len;

    while (b < e && isspace((unsigned char)text[b]))
        b++;
    while (e > b && isspace((unsigned char)text[e - 1]))
        e--;
    if (e - b != SECRET_HEX_CHARS)
        return -EINVAL;
    for (size_t i = 0; i < SECRET_KEY_BYTES; i++) {
        int hi = hexval((unsigned char)text[b + 2 * i]);
        int lo = hexval((unsigned char)text[b + 2 * i + 1]);
        if (hi < 0 || lo < 0) {
            OPENSSL_cleanse(out, sizeof(*out));
            return -EINVAL;
        }
        out->key[i] = (uint8_t)(hi << 4 | lo);
    }
    return 0;
}

int secret_load(const char *path, struct secret *out)
{
    char buf[SECRET_FILE_MAX + 1];
    size_t got = 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC), rc;

    if (fd < 0)
        return -errno;
    /* One byte past the cap tells an over-long file from a full one. */
    while (got < sizeof(buf)) {
        ssize_t r = read(fd, buf + got, sizeof(buf) - got);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0) {
            rc = -errno;
            goto out;
        }
        if (r == 0)
            break;
        got += (size_t)r;
    }
    rc = got > SECRET_FILE_MAX ? -EINVAL : secret_parse(buf, got, out);
out:
    OPENSSL_cleanse(buf, sizeof(buf));
    close(fd);
    return rc;
}

int secret_random(void *buf, size_t n)
{
    uint8_t *p = buf;

    while (n > 0) {
        ssize_t r = getrandom(p, n, 0);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            return -errno;
        p += r;
        n -= (size_t)r;
    }
    return 0;
}

int secret_generate(struct secret *out)
{
    return secret_random(out->key, sizeof(out->key));
}

void secret_format(const struct secret *s, char out[SECRET_HEX_CHARS + 1])
{
    static const char digits[] = "0123456789abcdef";

    for (size_t i = 0; i < SECRET_KEY_BYTES; i++) {
        out[2 * i] = digits[s->key[i] >> 4];
        out[2 * i + 1] = digits[s->key[i] & 15];
    }
    out[SECRET_HEX_CHARS] = '\0';
}

int secret_write(const char *path, const struct secret *s)
{
    char text[SECRET_HEX_CHARS + 2];
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600), rc = 0;

    if (fd < 0)
        return -errno;
    secret_format(s, text);
    text[SECRET_HEX_CHARS] = '\n';
    text[SECRET_HEX_CHARS + 1] = '\0';
    if (write(fd, text, SECRET_HEX_CHARS + 1) != SECRET_HEX_CHARS + 1)
        rc = -EIO;
    if (close(fd) < 0 && rc == 0)
        rc = -errno;
    OPENSSL_cleanse(text, sizeof(text));
    if (rc < 0)
        unlink(path);
    return rc;
}

/* One EVP_MAC for the process: fetching the algorithm is the expensive
 * part of an HMAC in OpenSSL 3, and EVP_MAC is safe to share read-only
 * between threads. */
static EVP_MAC *hmac_alg(void)
{
    static EVP_MAC *alg;
    EVP_MAC *a = __atomic_load_n(&alg, __ATOMIC_ACQUIRE), *expected = NULL;

    if (a)
        return a;
    a = EVP_MAC_fetch(NULL, "HMAC", NULL);
    if (!a)
        return NULL;
    if (!__atomic_compare_exchange_n(&alg, &expected, a, false, __ATOMIC_ACQ_REL,
                                     __ATOMIC_ACQUIRE)) {
        EVP_MAC_free(a);
        a = expected;
    }
    return a;
}

static int update_part(EVP_MAC_CTX *ctx, const void *p, size_t len)
{
    uint64_t n = len;

    if (!EVP_MAC_update(ctx, (const unsigned char *)&n, sizeof(n)))
        return -EIO;
    if (len > 0 && !EVP_MAC_update(ctx, p, len))
        return -EIO;
    return 0;
}

/* Each thread keeps the context of the last key it used, keyed: keying
 * (fetching SHA-256 and hashing the key into its inner and outer pads)
 * costs more than the MAC of a short request, and a broker checks every
 * heartbeat under one of a few keys, on the same few threads. The copy of
 * the key is wiped, and the context freed, when the thread ends. */
struct mac_cache {
    EVP_MAC_CTX *ctx;
    uint8_t key[SECRET_KEY_BYTES];
};

static pthread_key_t cache_key;
static pthread_once_t cache_once = PTHREAD_ONCE_INIT;
static bool cache_ok;

static void cache_free(void *p)
{
    struct mac_cache *c = p;

    EVP_MAC_CTX_free(c->ctx);
    OPENSSL_cleanse(c, sizeof(*c));
    free(c);
}

static void cache_init(void)
{
    cache_ok = pthread_key_create(&cache_key, cache_free) == 0;
}

/* A context of this thread's ready for a MAC under `s`: keyed afresh
 * when the thread's last key was another (or it has none). NULL when
 * libcrypto fails or memory runs out. */
static EVP_MAC_CTX *mac_ctx(const struct secret *s)
{
    OSSL_PARAM params[] = {
        OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, (char *)"SHA256", 0),
        OSSL_PARAM_construct_end(),
    };
    EVP_MAC *alg = hmac_alg();
    struct mac_cache *c;

    if (!alg || pthread_once(&cache_once, cache_init) != 0 || !cache_ok)
        return NULL;
    c = pthread_getspecific(cache_key);
    if (!c) {
        c = calloc(1, sizeof(*c));
        if (!c)
            return NULL;
        if (pthread_setspecific(cache_key, c) != 0) {
            free(c);
            return NULL;
        }
    }
    /* Same key: a NULL key restarts the MAC from the pads it keeps. */
    if (c->ctx && CRYPTO_memcmp(c->key, s->key, sizeof(c->key)) == 0 &&
        EVP_MAC_init(c->ctx, NULL, 0, NULL))
        return c->ctx;
    EVP_MAC_CTX_free(c->ctx);
    OPENSSL_cleanse(c->key, sizeof(c->key));
    c->ctx = EVP_MAC_CTX_new(alg);
    if (c->ctx && EVP_MAC_init(c->ctx, s->key, sizeof(s->key), params)) {
        memcpy(c->key, s->key, sizeof(c->key));
        return c->ctx;
    }
    EVP_MAC_CTX_free(c->ctx);
    c->ctx = NULL;
    return NULL;
}

int secret_mac(const struct secret *s, const char *label, const struct secret_part *parts,
               size_t n, uint8_t out[SECRET_MAC_BYTES])
{
    EVP_MAC_CTX *ctx = mac_ctx(s);
    size_t outlen = 0;
    int rc = -EIO;

    if (!ctx)
        goto out;
    if (update_part(ctx, label, strlen(label)) < 0)
        goto out;
    for (size_t i = 0; i < n; i++)
        if (update_part(ctx, parts[i].p, parts[i].len) < 0)
            goto out;
    if (!EVP_MAC_final(ctx, out, &outlen, SECRET_MAC_BYTES) || outlen != SECRET_MAC_BYTES)
        goto out;
    rc = 0;
out:
    if (rc < 0)
        OPENSSL_cleanse(out, SECRET_MAC_BYTES);
    return rc;
}

bool secret_mac_equal(const uint8_t a[SECRET_MAC_BYTES], const uint8_t b[SECRET_MAC_BYTES])
{
    return CRYPTO_memcmp(a, b, SECRET_MAC_BYTES) == 0;
}

void secret_wipe(struct secret *s)
{
    OPENSSL_cleanse(s, sizeof(*s));
}

int secret_integrity_parse(const char *text, bool *mac)
{
    if (!text || !*text || strcmp(text, "none") == 0) {
        *mac = false;
        return 0;
    }
    if (strcmp(text, "mac") == 0) {
        *mac = true;
        return 0;
    }
    return -EINVAL;
}

/* src/base/secret.h: a cohort's shared key, and the one MAC everything that
 * proves membership is made of (broker tokens, the data-plane greeting,
 * per-frame integrity).
 *
 * A key is 256 random bits, written as 64 hexadecimal digits (a trailing
 * newline is fine): what `openssl rand -hex 32` prints, what the operator
 * stores in each cohort's Secret, and what `cohortctl run` writes for a
 * run. The MAC is HMAC-SHA256 (OpenSSL's libcrypto) over a label and a list
 * of parts, each part length-prefixed, so that no two different lists of
 * parts, and no two labels, can give the same input.
 *
 *   struct secret k;
 *   secret_load("/etc/cohort/secret/key", &k);
 *   struct secret_part parts[] = { SECRET_STR(cohort), SECRET_U64(epoch) };
 *   uint8_t mac[SECRET_MAC_BYTES];
 *   secret_mac(&k, "cohort/greet/v1", parts, 2, mac);
 *
 * Nothing here logs or keeps a key anywhere but in the caller's struct. */
#ifndef COHORT_SECRET_H
#define COHORT_SECRET_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define SECRET_KEY_BYTES 32
#define SECRET_MAC_BYTES 32
#define SECRET_HEX_CHARS (2 * SECRET_KEY_BYTES)
/* A key file holds the hex key and at most some whitespace; anything
 * longer is not a key file (and is not read whole). */
#define SECRET_FILE_MAX 256

struct secret {
    uint8_t key[SECRET_KEY_BYTES];
};

/* One part of a MAC's input: `len` bytes at `p` (borrowed). */
struct secret_part {
    const void *p;
    size_t len;
};
/* A NUL-terminated string, without its NUL. */
#define SECRET_STR(s) ((struct secret_part){ (s), strlen(s) })
/* A uint64_t lvalue, in host order: both ends of every MAC in cohort are
 * little-endian x86-64 or arm64; secret_mac encodes lengths the same way. */
#define SECRET_U64(v) ((struct secret_part){ &(v), sizeof(uint64_t) })

/* Parses 64 hex digits with optional surrounding whitespace. Returns 0, or
 * -EINVAL (anything else: too short, too long, a non-hex digit). */
int secret_parse(const char *text, size_t len, struct secret *out);

/* Reads a key file (secret_parse's format). Returns 0, -EINVAL (not a key,
 * or longer than SECRET_FILE_MAX), or the open/read -errno (-ENOENT,
 * -EACCES). */
int secret_load(const char *path, struct secret *out);

/* A new random key from the kernel's CSPRNG. Returns 0 or -errno. */
int secret_generate(struct secret *out);

/* Writes the key as 64 hex digits and a newline to a new file at `path`,
 * mode 0600, refusing to replace one (-EEXIST). Returns 0 or -errno. */
int secret_write(const char *path, const struct secret *s);

/* The key as 64 hex digits and a NUL into out. */
void secret_format(const struct secret *s, char out[SECRET_HEX_CHARS + 1]);

/* HMAC-SHA256 under `s` of: the label, then each part, each preceded by its
 * length as 8 bytes. Returns 0, or -EIO if libcrypto fails (it does not
 * for these inputs; the caller still treats it as a refusal). */
int secret_mac(const struct secret *s, const char *label, const struct secret_part *parts,
               size_t n, uint8_t out[SECRET_MAC_BYTES]);

/* Compares two MACs in constant time. */
bool secret_mac_equal(const uint8_t a[SECRET_MAC_BYTES], const uint8_t b[SECRET_MAC_BYTES]);

/* Fills buf with n random bytes (nonces, sessions). Returns 0 or -errno. */
int secret_random(void *buf, size_t n);

/* Overwrites the key so that it does not linger in freed memory. */
void secret_wipe(struct secret *s);

/* Parses a frame integrity setting, the words of the sidecar's
 * --integrity and of $COHORT_INTEGRITY: "mac" (every data-plane frame
 * carries a MAC under the key) sets *mac, "none", "" or NULL (peers prove
 * the key when they connect, frames carry none) clears it. Returns 0, or
 * -EINVAL for anything else, *mac untouched. */
int secret_integrity_parse(const char *text, bool *mac);

#endif

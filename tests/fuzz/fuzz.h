/* tests/fuzz/fuzz.h: what the libFuzzer harnesses share (README.md).
 *
 * Each harness is one fuzz_NAME.c with LLVMFuzzerTestOneInput; libFuzzer
 * supplies main(). A broken invariant is a crash like any other: CHECK
 * says which, and libFuzzer keeps the input that broke it. */
#ifndef COHORT_FUZZ_H
#define COHORT_FUZZ_H

#include <poll.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv);

#define CHECK(cond)                                                                 \
    do {                                                                            \
        if (!(cond)) {                                                              \
            fprintf(stderr, "%s:%d: invariant broken: %s\n", __FILE__, __LINE__,    \
                    #cond);                                                         \
            abort();                                                                \
        }                                                                           \
    } while (0)

/* The input read front to back; past its end every read gives zeros, so
 * that a harness that interprets bytes as operations never runs out. */
struct fuzz_in {
    const uint8_t *p;
    size_t n;
};

static inline bool fuzz_left(const struct fuzz_in *in)
{
    return in->n > 0;
}

static inline uint8_t fuzz_u8(struct fuzz_in *in)
{
    uint8_t v = 0;

    if (in->n) {
        v = *in->p++;
        in->n--;
    }
    return v;
}

static inline uint16_t fuzz_u16(struct fuzz_in *in)
{
    uint16_t lo = fuzz_u8(in);
    return (uint16_t)(lo | fuzz_u8(in) << 8);
}

static inline uint32_t fuzz_u32(struct fuzz_in *in)
{
    uint32_t lo = fuzz_u16(in);
    return lo | (uint32_t)fuzz_u16(in) << 16;
}

static inline uint64_t fuzz_u64(struct fuzz_in *in)
{
    uint64_t lo = fuzz_u32(in);
    return lo | (uint64_t)fuzz_u32(in) << 32;
}

/* Up to `want` bytes, borrowed from the input; *got says how many. */
static inline const uint8_t *fuzz_bytes(struct fuzz_in *in, size_t want, size_t *got)
{
    const uint8_t *p = in->p;

    *got = want < in->n ? want : in->n;
    in->p += *got;
    in->n -= *got;
    return p;
}

/* The descriptors below 32 that are open, as a bit mask. A harness
 * compares it before and after an input to catch a leak: a leaked
 * descriptor takes the lowest free number, and a harness holds fewer than
 * ten. One poll() asks about all of them: a closed one is POLLNVAL. */
static inline uint32_t fuzz_open_fds(void)
{
    struct pollfd p[32];
    uint32_t m = 0;

    for (int fd = 0; fd < 32; fd++)
        p[fd] = (struct pollfd){ .fd = fd };
    if (poll(p, 32, 0) < 0)
        abort();
    for (int fd = 0; fd < 32; fd++)
        if (!(p[fd].revents & POLLNVAL))
            m |= 1u << fd;
    return m;
}

/* A NUL-terminated copy of data[0..n), which libFuzzer does not give. The
 * caller frees it. */
static inline char *fuzz_strndup(const uint8_t *data, size_t n)
{
    char *s = malloc(n + 1);

    if (!s)
        abort();
    memcpy(s, data, n);
    s[n] = '\0';
    return s;
}

#endif

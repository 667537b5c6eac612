/* src/engine/peerwire.h: the bytes all-reduce engines exchange with each
 * other over TCP: the greeting that opens a connection, the header of every
 * data frame, and the BYE that ends one. Pure encoding and decoding, no
 * sockets and no engine state, so that both ends of the protocol can be
 * checked byte by byte (tests/unit/test_peerwire.c); the engine's use of
 * them (who greets whom, what a receiver compares) is in conn.c and
 * acceptor.c.
 *
 * All integers are little-endian. Not to be confused with
 * membership/wire.h, the broker's protocol. */
#ifndef COHORT_PEERWIRE_H
#define COHORT_PEERWIRE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define PEERWIRE_VERSION 1u
#define PEERWIRE_HELLO_MAGIC 0x31484f43u   /* "COH1" */
#define PEERWIRE_HELLO_BYTES 536
#define PEERWIRE_HELLO_NAME 256            /* bytes reserved for each name */
#define PEERWIRE_FRAME_BYTES 56
#define PEERWIRE_FRAME_DATA 0x44484f43u    /* "COHD" */
#define PEERWIRE_FRAME_BYE 0x42484f43u     /* "COHB" */

enum peerwire_hello_kind {
    PEERWIRE_GREET = 1,         /* connector -> acceptor */
    PEERWIRE_ACCEPT = 2,        /* acceptor -> connector: same epoch, welcome */
    PEERWIRE_STALE = 3,         /* acceptor -> connector: yours is older than mine */
};

/* Which part of a schedule a data frame belongs to. */
enum peerwire_phase { PEERWIRE_PHASE_RS = 1, PEERWIRE_PHASE_AG = 2, PEERWIRE_PHASE_RD = 3 };

/* HELLO, PEERWIRE_HELLO_BYTES, first on every connection, both ways:
 *   0  u32 magic "COH1"        16 u8 cohort length
 *   4  u16 version             17 u8 id length
 *   6  u8 kind                 18 6 x 0
 *   7  u8 0                    24 cohort[256]
 *   8  u64 epoch               280 id[256]
 * Names are NUL-padded, 1..IDENT_NAME_MAX bytes, and must be valid
 * (base/ident.h). */
struct peerwire_hello {
    uint8_t kind;               /* enum peerwire_hello_kind */
    uint64_t epoch;
    char cohort[PEERWIRE_HELLO_NAME];   /* NUL-terminated */
    char id[PEERWIRE_HELLO_NAME];
};

/* FRAME header, PEERWIRE_FRAME_BYTES, before every payload:
 *   0  u32 magic (DATA or BYE)   32 u64 offset (first element)
 *   4  u32 payload length        40 u64 count
 *   8  u64 cohort hash           48 u8 dtype, u8 op, u8 phase, u8 0
 *   16 u64 epoch                 52 u32 step (data) or errno (bye)
 *   24 u64 round
 * A BYE has no payload; it says the sender is leaving the call and why. */
struct peerwire_frame {
    uint32_t magic;
    uint32_t length;
    uint64_t cohort, epoch, round, offset, count;
    uint8_t dtype, op, phase;
    uint32_t step;              /* the errno, in a BYE */
};

/* Little-endian integers at p, which must have room. */
void peerwire_put32(uint8_t *p, uint32_t v);
void peerwire_put64(uint8_t *p, uint64_t v);
uint32_t peerwire_get32(const uint8_t *p);
uint64_t peerwire_get64(const uint8_t *p);

/* The cohort as frames name it: FNV-1a (64 bit) of the name's bytes. */
uint64_t peerwire_cohort_hash(const char *cohort);

/* Writes a greeting into b[0..PEERWIRE_HELLO_BYTES). cohort and id are
 * borrowed. Returns 0, or -EINVAL when a name is empty or longer than
 * IDENT_NAME_MAX (b is then untouched). */
int peerwire_hello_encode(uint8_t *b, uint8_t kind, uint64_t epoch, const char *cohort,
                          const char *id);

/* Reads the greeting in b[0..len) into *h. Returns NULL, or a static
 * reason the bytes are not a greeting this version speaks (short, bad
 * magic, version, kind, name length, or names that are not valid
 * idents); *h is then unspecified. */
const char *peerwire_hello_decode(const uint8_t *b, size_t len, struct peerwire_hello *h);

/* True while the first `got` bytes of a connection can still begin a
 * greeting: the magic is checked as soon as it is all there, so garbage
 * is recognised after 4 bytes rather than 536. */
bool peerwire_hello_plausible(const uint8_t *b, size_t got);

/* Writes f's header into b[0..PEERWIRE_FRAME_BYTES); the reserved byte is
 * written 0. */
void peerwire_frame_encode(uint8_t *b, const struct peerwire_frame *f);

/* Reads a header from b[0..len) into *f. Returns 0 for a data frame or a
 * BYE, -EPROTO for any other magic, -EINVAL when len is short of a whole
 * header (*f untouched). On -EPROTO *f is filled all the same, for the
 * log line. The reserved byte is not read. Fields are not judged: which
 * frame is due is the receiver's to know (conn.c). */
int peerwire_frame_decode(const uint8_t *b, size_t len, struct peerwire_frame *f);

#endif

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

#define PEERWIRE_VERSION 2u
#define PEERWIRE_HELLO_MAGIC 0x31484f43u   /* "COH1", in every version */
#define PEERWIRE_HELLO_BYTES 616
#define PEERWIRE_HELLO_NAME 256            /* bytes reserved for each name */
#define PEERWIRE_NONCE_BYTES 32
#define PEERWIRE_MAC_BYTES 32              /* = SECRET_MAC_BYTES */
#define PEERWIRE_FRAME_BYTES 56
#define PEERWIRE_TAG_BYTES 16              /* a frame's MAC, with --integrity mac */
#define PEERWIRE_FRAME_DATA 0x44484f43u    /* "COHD" */
#define PEERWIRE_FRAME_BYE 0x42484f43u     /* "COHB" */

enum peerwire_hello_kind {
    PEERWIRE_GREET = 1,         /* connector -> acceptor: who I am, my nonce */
    PEERWIRE_ACCEPT = 2,        /* acceptor -> connector: same epoch, welcome (keyed:
                                 * its nonce and MAC) */
    PEERWIRE_STALE = 3,         /* acceptor -> connector: yours is older than mine */
    PEERWIRE_CONFIRM = 4,       /* connector -> acceptor, keyed only: its MAC */
    PEERWIRE_REFUSE = 5,        /* either way: why the greeting goes no further */
};

/* HELLO flags: what the sender's engine runs with. Members must agree on
 * both; the MACs cover them, so they cannot be changed on the way. */
#define PEERWIRE_F_KEYED 0x01       /* has the cohort key: MACs follow */
#define PEERWIRE_F_INTEGRITY 0x02   /* every frame carries a tag */
#define PEERWIRE_F_ALL 0x03

/* Why a REFUSE was sent (its `reason`). Informative only: it is not
 * authenticated, and the connection closes either way. */
enum peerwire_refusal {
    PEERWIRE_REFUSE_NEED_KEY = 1,   /* the sender has a key; the greeting had none */
    PEERWIRE_REFUSE_NO_KEY = 2,     /* the sender has no key; the greeting had one */
    PEERWIRE_REFUSE_INTEGRITY = 3,  /* integrity settings differ */
    PEERWIRE_REFUSE_BAD_MAC = 4,    /* the acceptor's MAC did not verify: keys differ */
};

/* Which part of a schedule a data frame belongs to. */
enum peerwire_phase { PEERWIRE_PHASE_RS = 1, PEERWIRE_PHASE_AG = 2, PEERWIRE_PHASE_RD = 3 };

/* HELLO, PEERWIRE_HELLO_BYTES, every message of the greeting (peerwire
 * version 2; version 1 had no flags, reason, incarnation, serial, nonce or
 * MAC, and put the names at 24):
 *   0  u32 magic "COH1"        24 u64 incarnation (GREET)
 *   4  u16 version             32 u64 serial (GREET)
 *   6  u8 kind                 40 nonce[32] (GREET, ACCEPT, STALE)
 *   7  u8 flags                72 mac[32] (keyed ACCEPT, STALE, CONFIRM)
 *   8  u64 epoch               104 cohort[256]
 *   16 u8 cohort length        360 id[256], the sender's
 *   17 u8 id length
 *   18 u8 reason (REFUSE)
 *   19 5 x 0
 * Fields a kind does not use are 0. Names are NUL-padded, 1..IDENT_NAME_MAX
 * bytes, and must be valid (base/ident.h). What the MACs cover is
 * engine/peerauth.h's. */
struct peerwire_hello {
    uint8_t kind;               /* enum peerwire_hello_kind */
    uint8_t flags;              /* PEERWIRE_F_* */
    uint8_t reason;             /* enum peerwire_refusal, in a REFUSE */
    uint64_t epoch;
    uint64_t incarnation;       /* the connector engine's, random per process */
    uint64_t serial;            /* the connector's connection number, rising */
    uint8_t nonce[PEERWIRE_NONCE_BYTES];
    uint8_t mac[PEERWIRE_MAC_BYTES];
    char cohort[PEERWIRE_HELLO_NAME];   /* NUL-terminated */
    char id[PEERWIRE_HELLO_NAME];
};

/* FRAME header, PEERWIRE_FRAME_BYTES, before every payload:
 *   0  u32 magic (DATA or BYE)   32 u64 offset (first element)
 *   4  u32 payload length        40 u64 count
 *   8  u64 cohort hash           48 u8 dtype, u8 op, u8 phase, u8 codec
 *   16 u64 epoch                 52 u32 step (data) or errno (bye)
 *   24 u64 round
 * A BYE has no payload; it says the sender is leaving the call and why.
 * `codec` (engine/codec.h) says how the payload's floats are encoded; 0,
 * none, is what peers before codecs wrote into this then reserved byte,
 * so they and uncompressed calls agree.
 * With --integrity mac a tag of PEERWIRE_TAG_BYTES follows the header, then
 * the payload: the MAC of header and payload (engine/peerauth.h). */
struct peerwire_frame {
    uint32_t magic;
    uint32_t length;
    uint64_t cohort, epoch, round, offset, count;
    uint8_t dtype, op, phase;
    uint8_t codec;              /* enum codec; 0 in a BYE */
    uint32_t step;              /* the errno, in a BYE */
};

/* Little-endian integers at p, which must have room. */
void peerwire_put32(uint8_t *p, uint32_t v);
void peerwire_put64(uint8_t *p, uint64_t v);
uint32_t peerwire_get32(const uint8_t *p);
uint64_t peerwire_get64(const uint8_t *p);

/* The cohort as frames name it: FNV-1a (64 bit) of the name's bytes. */
uint64_t peerwire_cohort_hash(const char *cohort);

/* Writes h as a greeting into b[0..PEERWIRE_HELLO_BYTES). Every field of h
 * is written as it is: fields the kind does not use should be 0. Returns
 * 0, or -EINVAL when a name is empty or longer than IDENT_NAME_MAX, or a
 * flag is unknown (b is then untouched). */
int peerwire_hello_encode(uint8_t *b, const struct peerwire_hello *h);

/* Reads the greeting in b[0..len) into *h. Returns NULL, or a static
 * reason the bytes are not a greeting this version speaks (short, bad
 * magic, version, kind, flags, name length, or names that are not valid
 * idents); *h is then unspecified. */
const char *peerwire_hello_decode(const uint8_t *b, size_t len, struct peerwire_hello *h);

/* Judges the first `got` bytes of a connection as early as they allow:
 * the magic once 4 bytes are there, the version once 6 are, so that
 * garbage or another version is recognised before a whole greeting would
 * be. Returns NULL while they can still begin a greeting, else the reason
 * ("bad magic", "unsupported wire version"). */
const char *peerwire_hello_early(const uint8_t *b, size_t got);

/* Why a REFUSE with `reason` was sent, as its receiver logs it: "it
 * requires the cohort key and this member has none", and so on. A static
 * string, also for reasons this version does not know. */
const char *peerwire_refusal_text(uint8_t reason);

/* Writes f's header into b[0..PEERWIRE_FRAME_BYTES). */
void peerwire_frame_encode(uint8_t *b, const struct peerwire_frame *f);

/* Reads a header from b[0..len) into *f. Returns 0 for a data frame or a
 * BYE, -EPROTO for any other magic, -EINVAL when len is short of a whole
 * header (*f untouched). On -EPROTO *f is filled all the same, for the
 * log line. Fields are not judged: which
 * frame is due is the receiver's to know (conn.c). */
int peerwire_frame_decode(const uint8_t *b, size_t len, struct peerwire_frame *f);

#endif

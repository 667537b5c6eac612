/* tests/unit/test_peerwire.c: the engines' wire encoding, byte by byte,
 * and what authenticates it (engine/peerauth.h). Expected bytes are
 * written out here from the layout peerwire.h documents (offsets,
 * little-endian), not produced by the encoder under test, and the cohort
 * hash is checked against published FNV-1a vectors, so a change of the
 * format fails here before it fails between two engines of different
 * builds. The MACs are checked against HMAC-SHA256 and ChaCha20-Poly1305
 * computed here through libcrypto from the documented inputs. */
#include <criterion/criterion.h>

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <openssl/evp.h>
#include <openssl/hmac.h>

#include "base/ident.h"
#include "base/secret.h"
#include "engine/peerauth.h"
#include "engine/peerwire.h"

/* A name of n bytes that ident accepts: "a" then digits. */
static void long_name(char *s, size_t n)
{
    s[0] = 'a';
    for (size_t i = 1; i < n; i++)
        s[i] = (char)('0' + i % 10);
    s[n] = '\0';
}

static struct peerwire_hello hello_of(uint8_t kind, uint64_t epoch, const char *cohort,
                                      const char *id)
{
    struct peerwire_hello h = { .kind = kind, .epoch = epoch };

    snprintf(h.cohort, sizeof(h.cohort), "%s", cohort);
    snprintf(h.id, sizeof(h.id), "%s", id);
    return h;
}

static void hello_ok(uint8_t *b, const char *cohort, const char *id)
{
    struct peerwire_hello h = hello_of(PEERWIRE_GREET, 7, cohort, id);

    cr_assert_eq(peerwire_hello_encode(b, &h), 0);
}

/* --- integers and the hash ---------------------------------------------- */

Test(peerwire, integers_are_little_endian_and_stay_in_bounds)
{
    uint8_t b[10];
    static const uint8_t le32[] = { 0x04, 0x03, 0x02, 0x01 };
    static const uint8_t le64[] = { 0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01 };

    memset(b, 0xee, sizeof(b));
    peerwire_put32(b + 1, 0x01020304u);
    cr_assert_arr_eq(b + 1, le32, 4);
    cr_assert_eq(b[0], 0xee, "wrote before its field");
    cr_assert_eq(b[5], 0xee, "wrote past its field");
    cr_assert_eq(peerwire_get32(b + 1), 0x01020304u);

    memset(b, 0xee, sizeof(b));
    peerwire_put64(b + 1, 0x0102030405060708ull);
    cr_assert_arr_eq(b + 1, le64, 8);
    cr_assert_eq(b[0], 0xee);
    cr_assert_eq(b[9], 0xee);
    cr_assert_eq(peerwire_get64(b + 1), 0x0102030405060708ull);
}

Test(peerwire, integers_round_trip_at_their_boundaries)
{
    static const uint32_t v32[] = { 0, 1, 0x7fffffffu, 0x80000000u, 0xfffffffeu, UINT32_MAX };
    static const uint64_t v64[] = { 0, 1, 0xffffffffull, 0x100000000ull,
                                    0x7fffffffffffffffull, 0x8000000000000000ull, UINT64_MAX };
    uint8_t b[8];

    for (size_t i = 0; i < sizeof(v32) / sizeof(v32[0]); i++) {
        peerwire_put32(b, v32[i]);
        cr_assert_eq(peerwire_get32(b), v32[i], "u32 %#x", v32[i]);
    }
    for (size_t i = 0; i < sizeof(v64) / sizeof(v64[0]); i++) {
        peerwire_put64(b, v64[i]);
        cr_assert_eq(peerwire_get64(b), v64[i], "u64 %#llx", (unsigned long long)v64[i]);
    }
    /* Every byte counts, the top one included. */
    memset(b, 0, sizeof(b));
    b[7] = 0x80;
    cr_assert_eq(peerwire_get64(b), 0x8000000000000000ull);
    b[3] = 0x80;
    cr_assert_eq(peerwire_get32(b), 0x80000000u);
}

Test(peerwire, cohort_hash_is_fnv1a_64)
{
    /* The published FNV-1a test vectors, and two computed independently. */
    cr_assert_eq(peerwire_cohort_hash(""), 0xcbf29ce484222325ull);
    cr_assert_eq(peerwire_cohort_hash("a"), 0xaf63dc4c8601ec8cull);
    cr_assert_eq(peerwire_cohort_hash("foobar"), 0x85944171f73967e8ull);
    cr_assert_eq(peerwire_cohort_hash("ns/cohort-1"), 0x3abdeacd682d9d08ull);
    /* Bytes are taken unsigned, whatever char is. */
    cr_assert_eq(peerwire_cohort_hash("\xff"), 0xaf64724c8602eb6eull);
    cr_assert_neq(peerwire_cohort_hash("cohort-1"), peerwire_cohort_hash("cohort-2"));
}

/* --- HELLO -------------------------------------------------------------- */

Test(peerwire, hello_has_the_documented_layout)
{
    uint8_t b[PEERWIRE_HELLO_BYTES], want[PEERWIRE_HELLO_BYTES] = { 0 };
    struct peerwire_hello h = hello_of(PEERWIRE_ACCEPT, 0x1122334455667788ull, "ns/c", "w-0");

    cr_assert_eq(PEERWIRE_HELLO_BYTES, 104 + 2 * PEERWIRE_HELLO_NAME);
    h.flags = PEERWIRE_F_KEYED | PEERWIRE_F_INTEGRITY;
    h.reason = 0x5a;
    h.incarnation = 0x0102030405060708ull;
    h.serial = 0xa1a2a3a4a5a6a7a8ull;
    for (int i = 0; i < 32; i++) {
        h.nonce[i] = (uint8_t)(0x40 + i);
        h.mac[i] = (uint8_t)(0x80 + i);
    }
    memset(b, 0xee, sizeof(b));
    cr_assert_eq(peerwire_hello_encode(b, &h), 0);
    memcpy(want, "COH1", 4);
    want[4] = 2;                /* version 2, u16 */
    want[6] = 2;                /* accept */
    want[7] = 3;                /* keyed | integrity */
    for (int i = 0; i < 8; i++) {
        want[8 + i] = (uint8_t)(0x88 - 0x11 * i);
        want[24 + i] = (uint8_t)(8 - i);
        want[32 + i] = (uint8_t)(0xa8 - i);
    }
    want[16] = 4;
    want[17] = 3;
    want[18] = 0x5a;
    for (int i = 0; i < 32; i++) {
        want[40 + i] = (uint8_t)(0x40 + i);
        want[72 + i] = (uint8_t)(0x80 + i);
    }
    memcpy(want + 104, "ns/c", 4);
    memcpy(want + 360, "w-0", 3);
    cr_assert_arr_eq(b, want, sizeof(want), "every other byte, padding included, is 0");
}

Test(peerwire, hello_round_trips_every_field)
{
    static const uint8_t kinds[] = { PEERWIRE_GREET, PEERWIRE_ACCEPT, PEERWIRE_STALE,
                                     PEERWIRE_CONFIRM, PEERWIRE_REFUSE };
    static const uint64_t v64[] = { 0, 1, 0x8000000000000000ull, UINT64_MAX };
    uint8_t b[PEERWIRE_HELLO_BYTES];
    struct peerwire_hello h, g;

    for (size_t k = 0; k < sizeof(kinds); k++)
        for (size_t e = 0; e < 4; e++) {
            h = hello_of(kinds[k], v64[e], "ns/cohort", "w-12");
            h.flags = (uint8_t)(e & PEERWIRE_F_ALL);
            h.reason = (uint8_t)(k * 50 + e);
            h.incarnation = v64[3 - e];
            h.serial = v64[(e + 1) % 4];
            for (int i = 0; i < 32; i++) {
                h.nonce[i] = (uint8_t)(k * 31 + e * 7 + (size_t)i);
                h.mac[i] = (uint8_t)(255 - h.nonce[i]);
            }
            cr_assert_eq(peerwire_hello_encode(b, &h), 0);
            memset(&g, 0xee, sizeof(g));
            cr_assert_null(peerwire_hello_decode(b, sizeof(b), &g));
            cr_assert_eq(g.kind, h.kind);
            cr_assert_eq(g.flags, h.flags);
            cr_assert_eq(g.reason, h.reason);
            cr_assert_eq(g.epoch, h.epoch);
            cr_assert_eq(g.incarnation, h.incarnation);
            cr_assert_eq(g.serial, h.serial);
            cr_assert_arr_eq(g.nonce, h.nonce, 32);
            cr_assert_arr_eq(g.mac, h.mac, 32);
            cr_assert_str_eq(g.cohort, "ns/cohort");
            cr_assert_str_eq(g.id, "w-12");
        }
}

Test(peerwire, hello_carries_names_of_every_allowed_length)
{
    char cohort[IDENT_NAME_MAX + 1], id[IDENT_NAME_MAX + 1];
    uint8_t b[PEERWIRE_HELLO_BYTES];
    struct peerwire_hello h;

    for (size_t n = 1; n <= IDENT_NAME_MAX; n++) {
        long_name(cohort, n);
        long_name(id, IDENT_NAME_MAX + 1 - n);
        h = hello_of(PEERWIRE_GREET, 3, cohort, id);
        cr_assert_eq(peerwire_hello_encode(b, &h), 0, "%zu", n);
        cr_assert_eq(b[16], n);
        cr_assert_null(peerwire_hello_decode(b, sizeof(b), &h), "%zu", n);
        cr_assert_str_eq(h.cohort, cohort);
        cr_assert_str_eq(h.id, id);
    }
}

Test(peerwire, hello_encode_refuses_what_does_not_fit)
{
    char big[IDENT_NAME_MAX + 2];
    uint8_t b[PEERWIRE_HELLO_BYTES], was[PEERWIRE_HELLO_BYTES];
    struct peerwire_hello h;

    long_name(big, IDENT_NAME_MAX + 1);
    memset(b, 0xee, sizeof(b));
    memcpy(was, b, sizeof(b));
    h = hello_of(PEERWIRE_GREET, 1, big, "w-0");
    cr_assert_eq(peerwire_hello_encode(b, &h), -EINVAL);
    h = hello_of(PEERWIRE_GREET, 1, "c", big);
    cr_assert_eq(peerwire_hello_encode(b, &h), -EINVAL);
    h = hello_of(PEERWIRE_GREET, 1, "", "w-0");
    cr_assert_eq(peerwire_hello_encode(b, &h), -EINVAL);
    h = hello_of(PEERWIRE_GREET, 1, "c", "");
    cr_assert_eq(peerwire_hello_encode(b, &h), -EINVAL);
    h = hello_of(PEERWIRE_GREET, 1, "c", "w-0");
    h.flags = 0x04;
    cr_assert_eq(peerwire_hello_encode(b, &h), -EINVAL, "an unknown flag");
    cr_assert_arr_eq(b, was, sizeof(b), "a refused greeting wrote nothing");
}

Test(peerwire, hello_decode_rejects_what_it_does_not_speak)
{
    uint8_t good[PEERWIRE_HELLO_BYTES], b[PEERWIRE_HELLO_BYTES];
    struct peerwire_hello h;

    hello_ok(good, "cohort", "w-0");
    cr_assert_null(peerwire_hello_decode(good, sizeof(good), &h));

    cr_assert_str_eq(peerwire_hello_decode(good, sizeof(good) - 1, &h), "short greeting");
    cr_assert_str_eq(peerwire_hello_decode(good, 0, &h), "short greeting");
    /* A version 1 greeting (536 bytes) is named for its version. */
    memcpy(b, good, sizeof(b));
    b[4] = 1;
    cr_assert_str_eq(peerwire_hello_decode(b, 536, &h), "unsupported wire version");

#define MUTATED(stmt, reason)                                               \
    do {                                                                    \
        const char *why_;                                                   \
        memcpy(b, good, sizeof(b));                                         \
        stmt;                                                               \
        why_ = peerwire_hello_decode(b, sizeof(b), &h);                     \
        cr_assert_not_null(why_, "accepted: %s", #stmt);                    \
        cr_assert_str_eq(why_, reason, "%s", #stmt);                        \
    } while (0)

    MUTATED(b[0] = 'X', "bad magic");
    MUTATED(b[3] = '2', "bad magic");
    MUTATED(b[4] = 1, "unsupported wire version");
    MUTATED(b[4] = 3, "unsupported wire version");
    MUTATED(b[5] = 1, "unsupported wire version");
    MUTATED(b[4] = 0, "unsupported wire version");
    MUTATED(b[6] = 0, "bad greeting kind");
    MUTATED(b[6] = 6, "bad greeting kind");
    MUTATED(b[6] = 0xff, "bad greeting kind");
    MUTATED(b[7] = 0x04, "unknown flags");
    MUTATED(b[7] = 0x80, "unknown flags");
    MUTATED(b[16] = 0, "bad name length");
    MUTATED(b[17] = 0, "bad name length");
    MUTATED(b[16] = IDENT_NAME_MAX + 1, "bad name length");
    MUTATED(b[17] = 0xff, "bad name length");
    MUTATED(b[104] = '-', "invalid cohort or member id");   /* must start alnum */
    MUTATED(b[360 + 1] = ' ', "invalid cohort or member id");
    MUTATED(b[360 + 1] = '/', "invalid cohort or member id"); /* ids hold no '/' */
    /* A length longer than the name reads the padding: NUL bytes end the
     * string early, so "w-0" with length 4 is still "w-0" and valid, but
     * a byte that is no ident character is caught. */
    MUTATED((b[17] = 4, b[360 + 3] = 0x80), "invalid cohort or member id");
#undef MUTATED
}

Test(peerwire, hello_decode_survives_garbage)
{
    uint8_t b[PEERWIRE_HELLO_BYTES];
    struct peerwire_hello h;

    srand(12345);
    for (int round = 0; round < 4000; round++) {
        for (size_t i = 0; i < sizeof(b); i++)
            b[i] = (uint8_t)rand();
        /* Three rounds in four keep the magic and version right, and
         * most of those a kind, flags and lengths that pass, so that the
         * later checks see garbage too. */
        if (round % 4 != 0) {
            memcpy(b, "COH1", 4);
            b[4] = 2;
            b[5] = 0;
            if (round % 2) {
                b[6] = (uint8_t)(1 + round % 5);
                b[7] &= PEERWIRE_F_ALL;
                b[16] = (uint8_t)(1 + b[16] % 20);
                b[17] = (uint8_t)(1 + b[17] % 20);
            }
        }
        if (!peerwire_hello_decode(b, sizeof(b), &h)) {
            /* Whatever got through is a well-formed greeting. */
            cr_assert(h.kind >= PEERWIRE_GREET && h.kind <= PEERWIRE_REFUSE);
            cr_assert((h.flags & ~PEERWIRE_F_ALL) == 0);
            cr_assert(ident_valid_cohort(h.cohort) && ident_valid_member_id(h.id));
        }
    }
}

Test(peerwire, hello_early_judges_magic_and_version_once_they_are_there)
{
    uint8_t good[PEERWIRE_HELLO_BYTES], v1[PEERWIRE_HELLO_BYTES];
    const uint8_t http[] = "GET / HTTP/1.1\r\n";

    hello_ok(good, "cohort", "w-0");
    for (size_t got = 0; got <= sizeof(good); got++)
        cr_assert_null(peerwire_hello_early(good, got), "%zu bytes of a greeting", got);
    for (size_t got = 0; got < 4; got++)
        cr_assert_null(peerwire_hello_early(http, got), "too early to tell at %zu", got);
    cr_assert_str_eq(peerwire_hello_early(http, 4), "bad magic");
    cr_assert_str_eq(peerwire_hello_early((const uint8_t *)"COHD", 4), "bad magic",
                     "a frame is no greeting");
    cr_assert_str_eq(peerwire_hello_early((const uint8_t *)"COH2", 4), "bad magic");
    /* Version 1 is told apart at its sixth byte, long before 616. */
    memcpy(v1, good, sizeof(v1));
    v1[4] = 1;
    cr_assert_null(peerwire_hello_early(v1, 5));
    cr_assert_str_eq(peerwire_hello_early(v1, 6), "unsupported wire version");
}

Test(peerwire, refusal_texts_name_the_cause)
{
    cr_assert_not_null(strstr(peerwire_refusal_text(PEERWIRE_REFUSE_NEED_KEY), "requires"));
    cr_assert_not_null(strstr(peerwire_refusal_text(PEERWIRE_REFUSE_NO_KEY), "no cohort key"));
    cr_assert_not_null(strstr(peerwire_refusal_text(PEERWIRE_REFUSE_INTEGRITY), "integrity"));
    cr_assert_not_null(strstr(peerwire_refusal_text(PEERWIRE_REFUSE_BAD_MAC), "keys differ"));
    cr_assert_not_null(strstr(peerwire_refusal_text(0), "does not know"));
    cr_assert_not_null(strstr(peerwire_refusal_text(0xff), "does not know"));
}

/* --- FRAME -------------------------------------------------------------- */

static struct peerwire_frame sample(void)
{
    return (struct peerwire_frame){ .magic = PEERWIRE_FRAME_DATA, .length = 0x01020304u,
                                    .cohort = 0x1112131415161718ull,
                                    .epoch = 0x2122232425262728ull,
                                    .round = 0x3132333435363738ull,
                                    .offset = 0x4142434445464748ull,
                                    .count = 0x5152535455565758ull, .dtype = 0x61, .op = 0x62,
                                    .phase = 0x63, .codec = 0x64, .step = 0x71727374u };
}

static void assert_frames_eq(const struct peerwire_frame *a, const struct peerwire_frame *b)
{
    cr_assert_eq(a->magic, b->magic);
    cr_assert_eq(a->length, b->length);
    cr_assert_eq(a->cohort, b->cohort);
    cr_assert_eq(a->epoch, b->epoch);
    cr_assert_eq(a->round, b->round);
    cr_assert_eq(a->offset, b->offset);
    cr_assert_eq(a->count, b->count);
    cr_assert_eq(a->dtype, b->dtype);
    cr_assert_eq(a->op, b->op);
    cr_assert_eq(a->phase, b->phase);
    cr_assert_eq(a->codec, b->codec);
    cr_assert_eq(a->step, b->step);
}

Test(peerwire, frame_has_the_documented_layout)
{
    struct peerwire_frame f = sample();
    uint8_t b[PEERWIRE_FRAME_BYTES + 1];
    static const uint8_t want[PEERWIRE_FRAME_BYTES] = {
        'C', 'O', 'H', 'D', 0x04, 0x03, 0x02, 0x01,
        0x18, 0x17, 0x16, 0x15, 0x14, 0x13, 0x12, 0x11,   /* cohort */
        0x28, 0x27, 0x26, 0x25, 0x24, 0x23, 0x22, 0x21,   /* epoch */
        0x38, 0x37, 0x36, 0x35, 0x34, 0x33, 0x32, 0x31,   /* round */
        0x48, 0x47, 0x46, 0x45, 0x44, 0x43, 0x42, 0x41,   /* offset */
        0x58, 0x57, 0x56, 0x55, 0x54, 0x53, 0x52, 0x51,   /* count */
        0x61, 0x62, 0x63, 0x64, 0x74, 0x73, 0x72, 0x71,   /* dtype op phase codec step */
    };

    memset(b, 0xee, sizeof(b));
    peerwire_frame_encode(b, &f);
    cr_assert_arr_eq(b, want, sizeof(want));
    cr_assert_eq(b[PEERWIRE_FRAME_BYTES], 0xee, "wrote past the header");
    f.magic = PEERWIRE_FRAME_BYE;
    peerwire_frame_encode(b, &f);
    cr_assert_arr_eq(b, "COHB", 4);
}

Test(peerwire, frame_round_trips_every_field)
{
    struct peerwire_frame f = sample(), g;
    uint8_t b[PEERWIRE_FRAME_BYTES];

    peerwire_frame_encode(b, &f);
    memset(&g, 0, sizeof(g));
    cr_assert_eq(peerwire_frame_decode(b, sizeof(b), &g), 0);
    assert_frames_eq(&g, &f);

    /* Boundaries: all zero, and every field at its maximum. */
    f = (struct peerwire_frame){ .magic = PEERWIRE_FRAME_BYE };
    peerwire_frame_encode(b, &f);
    memset(&g, 0xee, sizeof(g));
    cr_assert_eq(peerwire_frame_decode(b, sizeof(b), &g), 0);
    assert_frames_eq(&g, &f);
    f = (struct peerwire_frame){ .magic = PEERWIRE_FRAME_DATA, .length = UINT32_MAX,
                                 .cohort = UINT64_MAX, .epoch = UINT64_MAX,
                                 .round = UINT64_MAX, .offset = UINT64_MAX,
                                 .count = UINT64_MAX, .dtype = 0xff, .op = 0xff,
                                 .phase = 0xff, .codec = 0xff, .step = UINT32_MAX };
    peerwire_frame_encode(b, &f);
    cr_assert_eq(peerwire_frame_decode(b, sizeof(b), &g), 0);
    assert_frames_eq(&g, &f);
}

/* Peers from before codecs wrote 0 into byte 51: no codec. */
Test(peerwire, frame_codec_byte_zero_is_none)
{
    struct peerwire_frame f = sample(), g;
    uint8_t b[PEERWIRE_FRAME_BYTES];

    peerwire_frame_encode(b, &f);
    b[51] = 0;
    cr_assert_eq(peerwire_frame_decode(b, sizeof(b), &g), 0);
    cr_assert_eq(g.codec, 0);
}

Test(peerwire, frame_decode_rejects_short_and_foreign_headers)
{
    struct peerwire_frame f = sample(), g, untouched;
    uint8_t b[PEERWIRE_FRAME_BYTES], hello[PEERWIRE_HELLO_BYTES];

    peerwire_frame_encode(b, &f);
    memset(&g, 0xee, sizeof(g));
    memcpy(&untouched, &g, sizeof(g));
    cr_assert_eq(peerwire_frame_decode(b, sizeof(b) - 1, &g), -EINVAL);
    cr_assert_eq(peerwire_frame_decode(b, 0, &g), -EINVAL);
    cr_assert_arr_eq(&g, &untouched, sizeof(g), "a short header fills nothing");

    /* Any other magic, a greeting's included, is no frame; the fields are
     * still read, for the log line. */
    b[3] = 'X';
    cr_assert_eq(peerwire_frame_decode(b, sizeof(b), &g), -EPROTO);
    cr_assert_eq(g.epoch, f.epoch);
    cr_assert_eq(g.length, f.length);
    hello_ok(hello, "cohort", "w-0");
    cr_assert_eq(peerwire_frame_decode(hello, PEERWIRE_FRAME_BYTES, &g), -EPROTO);
    memset(b, 0, sizeof(b));
    cr_assert_eq(peerwire_frame_decode(b, sizeof(b), &g), -EPROTO);
}

/* --- what proves a peer (peerauth.h) ------------------------------------ */

static const struct secret test_key = { {
    0x00, 0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08, 0x09, 0x0a, 0x0b, 0x0c, 0x0d, 0x0e, 0x0f,
    0x10, 0x11, 0x12, 0x13, 0x14, 0x15, 0x16, 0x17, 0x18, 0x19, 0x1a, 0x1b, 0x1c, 0x1d, 0x1e, 0x1f,
} };

static struct peerauth_transcript sample_transcript(void)
{
    struct peerauth_transcript t = { .cohort = "ns/c", .connector = "w-0", .acceptor = "w-1",
                                     .epoch = 7, .reply_epoch = 7,
                                     .incarnation = 0x1122334455667788ull, .serial = 3,
                                     .flags = PEERWIRE_F_KEYED };

    for (int i = 0; i < 32; i++) {
        t.nonce_c[i] = (uint8_t)i;
        t.nonce_a[i] = (uint8_t)(0xf0 - i);
    }
    return t;
}

/* Appends a length-prefixed part (8 bytes little-endian, then the bytes). */
static size_t part(uint8_t *buf, size_t at, const void *p, size_t len)
{
    peerwire_put64(buf + at, len);
    memcpy(buf + at + 8, p, len);
    return at + 8 + len;
}

/* The MAC as peerauth.h documents it, computed here with one-shot HMAC. */
static void documented_mac(const char *label, const struct peerauth_transcript *t, uint8_t *out)
{
    uint8_t in[1024], u[8];
    size_t n = 0;
    unsigned int outlen = 0;
    const uint64_t v[] = { t->epoch, t->reply_epoch, t->incarnation, t->serial, t->flags };

    n = part(in, n, label, strlen(label));
    n = part(in, n, t->cohort, strlen(t->cohort));
    n = part(in, n, t->connector, strlen(t->connector));
    n = part(in, n, t->acceptor, strlen(t->acceptor));
    for (size_t i = 0; i < 5; i++) {
        peerwire_put64(u, v[i]);
        n = part(in, n, u, 8);
    }
    n = part(in, n, t->nonce_c, 32);
    n = part(in, n, t->nonce_a, 32);
    cr_assert_not_null(HMAC(EVP_sha256(), test_key.key, 32, in, n, out, &outlen));
    cr_assert_eq(outlen, 32);
}

Test(peerauth, greeting_macs_are_the_documented_hmac)
{
    static const struct { enum peerauth_label l; const char *name; } cases[] = {
        { PEERAUTH_ACCEPT, "cohort/peerwire/v2/accept" },
        { PEERAUTH_STALE, "cohort/peerwire/v2/stale" },
        { PEERAUTH_CONFIRM, "cohort/peerwire/v2/confirm" },
    };
    struct peerauth_transcript t = sample_transcript();
    uint8_t got[32], want[32], c2a[32], a2c[32];

    for (size_t i = 0; i < 3; i++) {
        cr_assert_eq(peerauth_mac(&test_key, cases[i].l, &t, got), 0);
        documented_mac(cases[i].name, &t, want);
        cr_assert_arr_eq(got, want, 32, "%s", cases[i].name);
        cr_assert(peerauth_verify(&test_key, cases[i].l, &t, want));
    }
    cr_assert_eq(peerauth_frame_keys(&test_key, &t, c2a, a2c), 0);
    documented_mac("cohort/peerwire/v2/frames/c2a", &t, want);
    cr_assert_arr_eq(c2a, want, 32);
    documented_mac("cohort/peerwire/v2/frames/a2c", &t, want);
    cr_assert_arr_eq(a2c, want, 32);
}

Test(peerauth, every_part_of_the_transcript_counts)
{
    struct peerauth_transcript base = sample_transcript(), t;
    struct secret other = test_key;
    uint8_t mac[32];

    cr_assert_eq(peerauth_mac(&test_key, PEERAUTH_ACCEPT, &base, mac), 0);
    cr_assert(peerauth_verify(&test_key, PEERAUTH_ACCEPT, &base, mac));
    /* The other direction's label, and the stale answer's, are no accept. */
    cr_assert_not(peerauth_verify(&test_key, PEERAUTH_CONFIRM, &base, mac));
    cr_assert_not(peerauth_verify(&test_key, PEERAUTH_STALE, &base, mac));
    other.key[31] ^= 1;
    cr_assert_not(peerauth_verify(&other, PEERAUTH_ACCEPT, &base, mac), "another key");

#define CHANGED(stmt)                                                          \
    do {                                                                       \
        t = base;                                                              \
        stmt;                                                                  \
        cr_assert_not(peerauth_verify(&test_key, PEERAUTH_ACCEPT, &t, mac), "%s", #stmt); \
    } while (0)

    CHANGED(t.cohort = "ns/d");
    CHANGED(t.connector = "w-2");
    CHANGED(t.acceptor = "w-0");
    /* Ids swapped: the roles are part of it. */
    CHANGED((t.connector = "w-1", t.acceptor = "w-0"));
    /* Lengths are prefixed, so moving a byte between names changes it. */
    CHANGED((t.cohort = "ns/cw", t.connector = "-0"));
    CHANGED(t.epoch = 8);
    CHANGED(t.reply_epoch = 8);
    CHANGED(t.incarnation ^= 1);
    CHANGED(t.serial = 4);
    CHANGED(t.flags |= PEERWIRE_F_INTEGRITY);
    CHANGED(t.nonce_c[31] ^= 0x80);
    CHANGED(t.nonce_a[0] ^= 1);
    /* Nonces swapped between the sides. */
    CHANGED((memcpy(t.nonce_c, base.nonce_a, 32), memcpy(t.nonce_a, base.nonce_c, 32)));
#undef CHANGED
}

/* ChaCha20-Poly1305 of nothing, with as associated data the header of
 * the frame in wire (56 bytes), 8 zero bytes and its payload: the tag
 * peerauth.h documents, from libcrypto directly. */
static void documented_tag(const uint8_t *key, uint64_t seq, const uint8_t *wire, size_t payload,
                           uint8_t *tag)
{
    EVP_CIPHER_CTX *c = EVP_CIPHER_CTX_new();
    uint8_t iv[12] = { 0 }, *aad = calloc(1, 64 + payload);
    int out;

    cr_assert_not_null(aad);
    memcpy(aad, wire, PEERWIRE_FRAME_BYTES);
    memcpy(aad + 64, wire + PEERWIRE_FRAME_BYTES, payload);
    peerwire_put64(iv, seq);
    cr_assert_not_null(c);
    cr_assert(EVP_EncryptInit_ex(c, EVP_chacha20_poly1305(), NULL, key, iv));
    cr_assert(EVP_EncryptUpdate(c, NULL, &out, aad, (int)(64 + payload)));
    free(aad);
    cr_assert(EVP_EncryptFinal_ex(c, tag, &out));
    cr_assert(EVP_CIPHER_CTX_ctrl(c, EVP_CTRL_AEAD_GET_TAG, 16, tag));
    EVP_CIPHER_CTX_free(c);
}

/* A sample frame: header then payload, contiguous, so that the documented
 * tag can be computed over both at once. */
static void sample_wire(uint8_t *wire, size_t payload, uint32_t step)
{
    struct peerwire_frame f = sample();

    f.length = (uint32_t)payload;
    f.step = step;
    peerwire_frame_encode(wire, &f);
    for (size_t i = 0; i < payload; i++)
        wire[PEERWIRE_FRAME_BYTES + i] = (uint8_t)(i * 7 + step);
}

/* Checks a received frame through begin/update/end, the payload given in
 * pieces of `piece` bytes. Returns end()'s answer. */
static int receive(struct peerauth_stream *rx, const uint8_t *wire, size_t payload,
                   const uint8_t *tag, size_t piece)
{
    cr_assert_eq(peerauth_stream_begin(rx, wire), 0);
    for (size_t at = 0; at < payload; at += piece)
        cr_assert_eq(peerauth_stream_update(rx, wire + PEERWIRE_FRAME_BYTES + at,
                                            payload - at < piece ? payload - at : piece), 0);
    return peerauth_stream_end(rx, tag);
}

Test(peerauth, frame_tags_are_chacha20_poly1305_of_header_and_payload)
{
    static const size_t sizes[] = { 0, 1, 15, 16, 17, 4096, 262147 };
    struct peerauth_transcript t = sample_transcript();
    uint8_t c2a[32], a2c[32], tag[16], want[16];
    uint8_t *wire = malloc(PEERWIRE_FRAME_BYTES + 262147);
    struct peerauth_stream tx, rx;

    cr_assert_not_null(wire);
    cr_assert_eq(peerauth_frame_keys(&test_key, &t, c2a, a2c), 0);
    cr_assert_eq(peerauth_stream_init(&tx, c2a), 0);
    cr_assert_eq(peerauth_stream_init(&rx, c2a), 0);
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
        size_t n = sizes[i];

        sample_wire(wire, n, (uint32_t)i);
        cr_assert_eq(tx.seq, i);
        cr_assert_eq(peerauth_stream_seal(&tx, wire, wire + PEERWIRE_FRAME_BYTES, n, tag), 0);
        documented_tag(c2a, i, wire, n, want);
        cr_assert_arr_eq(tag, want, 16, "%zu bytes", n);
        /* Received in pieces of any size, it checks out. */
        cr_assert_eq(receive(&rx, wire, n, tag, i % 2 ? 1000 : 7), 0, "%zu bytes", n);
    }
    peerauth_stream_cleanup(&tx);
    peerauth_stream_cleanup(&rx);
    peerauth_stream_cleanup(&rx);   /* twice is fine */
    free(wire);
}

Test(peerauth, frames_tampered_replayed_reordered_or_moved_fail)
{
    struct peerauth_transcript t = sample_transcript();
    uint8_t c2a[32], a2c[32], w1[PEERWIRE_FRAME_BYTES + 100], w2[sizeof(w1)];
    uint8_t tag1[16], tag2[16], bad[16];
    struct peerauth_stream tx, rx, other;

    cr_assert_eq(peerauth_frame_keys(&test_key, &t, c2a, a2c), 0);
    cr_assert_neq(memcmp(c2a, a2c, 32), 0, "each direction has its own key");
    cr_assert_eq(peerauth_stream_init(&tx, c2a), 0);
    cr_assert_eq(peerauth_stream_init(&other, a2c), 0);
    sample_wire(w1, 100, 1);
    sample_wire(w2, 100, 2);
    cr_assert_eq(peerauth_stream_seal(&tx, w1, w1 + PEERWIRE_FRAME_BYTES, 100, tag1), 0);
    cr_assert_eq(peerauth_stream_seal(&tx, w2, w2 + PEERWIRE_FRAME_BYTES, 100, tag2), 0);

    /* Any flipped bit, in the header, the payload or the tag. */
    for (size_t i = 0; i < sizeof(w1) * 8 + 128; i += 13) {
        uint8_t w[sizeof(w1)];

        memcpy(w, w1, sizeof(w));
        memcpy(bad, tag1, 16);
        if (i < sizeof(w) * 8)
            w[i / 8] ^= (uint8_t)(1u << (i % 8));
        else
            bad[(i - sizeof(w) * 8) / 8] ^= (uint8_t)(1u << (i % 8));
        cr_assert_eq(peerauth_stream_init(&rx, c2a), 0);
        cr_assert_eq(receive(&rx, w, 100, bad, 64), -EPROTO, "bit %zu", i);
        peerauth_stream_cleanup(&rx);
    }
    /* In order, both pass; a replay of the first after them fails. */
    cr_assert_eq(peerauth_stream_init(&rx, c2a), 0);
    cr_assert_eq(receive(&rx, w1, 100, tag1, 100), 0);
    cr_assert_eq(receive(&rx, w2, 100, tag2, 100), 0);
    cr_assert_eq(receive(&rx, w1, 100, tag1, 100), -EPROTO, "replayed");
    peerauth_stream_cleanup(&rx);
    /* Reordered: the second first. */
    cr_assert_eq(peerauth_stream_init(&rx, c2a), 0);
    cr_assert_eq(receive(&rx, w2, 100, tag2, 100), -EPROTO, "reordered");
    peerauth_stream_cleanup(&rx);
    /* The other direction's key, or another connection's, at the same
     * counter. */
    cr_assert_eq(receive(&other, w1, 100, tag1, 100), -EPROTO, "other direction");
    t.nonce_a[5] ^= 1;
    cr_assert_eq(peerauth_frame_keys(&test_key, &t, c2a, a2c), 0);
    cr_assert_eq(peerauth_stream_init(&rx, c2a), 0);
    cr_assert_eq(receive(&rx, w1, 100, tag1, 100), -EPROTO, "another connection");
    peerauth_stream_cleanup(&rx);
    peerauth_stream_cleanup(&tx);
    peerauth_stream_cleanup(&other);
}

Test(peerauth, peek_checks_a_bye_without_taking_its_number)
{
    struct peerauth_transcript t = sample_transcript();
    uint8_t c2a[32], a2c[32], bye[PEERWIRE_FRAME_BYTES], tag[16];
    struct peerwire_frame f = { .magic = PEERWIRE_FRAME_BYE, .step = 110 };
    struct peerauth_stream tx, rx;

    cr_assert_eq(peerauth_frame_keys(&test_key, &t, c2a, a2c), 0);
    cr_assert_eq(peerauth_stream_init(&tx, a2c), 0);
    cr_assert_eq(peerauth_stream_init(&rx, a2c), 0);
    peerwire_frame_encode(bye, &f);
    cr_assert_eq(peerauth_stream_seal(&tx, bye, NULL, 0, tag), 0);
    cr_assert(peerauth_stream_peek(&rx, bye, tag));
    cr_assert(peerauth_stream_peek(&rx, bye, tag), "a peek leaves the counter");
    cr_assert_eq(rx.seq, 0);
    tag[0] ^= 1;
    cr_assert_not(peerauth_stream_peek(&rx, bye, tag));
    tag[0] ^= 1;
    cr_assert_eq(peerauth_stream_begin(&rx, bye), 0);
    cr_assert_eq(peerauth_stream_end(&rx, tag), 0);
    cr_assert_eq(rx.seq, 1);
    cr_assert_not(peerauth_stream_peek(&rx, bye, tag), "the same BYE is no longer next");
    peerauth_stream_cleanup(&tx);
    peerauth_stream_cleanup(&rx);
}

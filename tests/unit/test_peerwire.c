/* tests/unit/test_peerwire.c: the engines' wire encoding, byte by byte.
 * Expected bytes are written out here from the layout peerwire.h
 * documents (offsets, little-endian), not produced by the encoder under
 * test, and the cohort hash is checked against published FNV-1a vectors,
 * so a change of the format fails here before it fails between two
 * engines of different builds. */
#include <criterion/criterion.h>

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "base/ident.h"
#include "engine/peerwire.h"

/* A name of n bytes that ident accepts: "a" then digits. */
static void long_name(char *s, size_t n)
{
    s[0] = 'a';
    for (size_t i = 1; i < n; i++)
        s[i] = (char)('0' + i % 10);
    s[n] = '\0';
}

static void hello_ok(uint8_t *b, const char *cohort, const char *id)
{
    cr_assert_eq(peerwire_hello_encode(b, PEERWIRE_GREET, 7, cohort, id), 0);
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

    cr_assert_eq(PEERWIRE_HELLO_BYTES, 24 + 2 * PEERWIRE_HELLO_NAME);
    memset(b, 0xee, sizeof(b));
    cr_assert_eq(peerwire_hello_encode(b, PEERWIRE_STALE, 0x1122334455667788ull, "ns/c", "w-0"),
                 0);
    memcpy(want, "COH1", 4);
    want[4] = 1;                /* version 1, u16 */
    want[6] = 3;                /* stale */
    for (int i = 0; i < 8; i++)
        want[8 + i] = (uint8_t)(0x88 - 0x11 * i);
    want[16] = 4;
    want[17] = 3;
    memcpy(want + 24, "ns/c", 4);
    memcpy(want + 280, "w-0", 3);
    cr_assert_arr_eq(b, want, sizeof(want), "every other byte, padding included, is 0");
}

Test(peerwire, hello_round_trips_every_field)
{
    static const uint8_t kinds[] = { PEERWIRE_GREET, PEERWIRE_ACCEPT, PEERWIRE_STALE };
    static const uint64_t epochs[] = { 0, 1, 0x8000000000000000ull, UINT64_MAX };
    uint8_t b[PEERWIRE_HELLO_BYTES];
    struct peerwire_hello h;

    for (size_t k = 0; k < 3; k++)
        for (size_t e = 0; e < 4; e++) {
            cr_assert_eq(peerwire_hello_encode(b, kinds[k], epochs[e], "ns/cohort", "w-12"), 0);
            memset(&h, 0xee, sizeof(h));
            cr_assert_null(peerwire_hello_decode(b, sizeof(b), &h));
            cr_assert_eq(h.kind, kinds[k]);
            cr_assert_eq(h.epoch, epochs[e]);
            cr_assert_str_eq(h.cohort, "ns/cohort");
            cr_assert_str_eq(h.id, "w-12");
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
        cr_assert_eq(peerwire_hello_encode(b, PEERWIRE_GREET, 3, cohort, id), 0, "%zu", n);
        cr_assert_eq(b[16], n);
        cr_assert_null(peerwire_hello_decode(b, sizeof(b), &h), "%zu", n);
        cr_assert_str_eq(h.cohort, cohort);
        cr_assert_str_eq(h.id, id);
    }
}

Test(peerwire, hello_encode_refuses_names_that_do_not_fit)
{
    char big[IDENT_NAME_MAX + 2];
    uint8_t b[PEERWIRE_HELLO_BYTES], was[PEERWIRE_HELLO_BYTES];

    long_name(big, IDENT_NAME_MAX + 1);
    memset(b, 0xee, sizeof(b));
    memcpy(was, b, sizeof(b));
    cr_assert_eq(peerwire_hello_encode(b, PEERWIRE_GREET, 1, big, "w-0"), -EINVAL);
    cr_assert_eq(peerwire_hello_encode(b, PEERWIRE_GREET, 1, "c", big), -EINVAL);
    cr_assert_eq(peerwire_hello_encode(b, PEERWIRE_GREET, 1, "", "w-0"), -EINVAL);
    cr_assert_eq(peerwire_hello_encode(b, PEERWIRE_GREET, 1, "c", ""), -EINVAL);
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
    MUTATED(b[4] = 2, "unsupported wire version");
    MUTATED(b[5] = 1, "unsupported wire version");
    MUTATED(b[4] = 0, "unsupported wire version");
    MUTATED(b[6] = 0, "bad greeting kind");
    MUTATED(b[6] = 4, "bad greeting kind");
    MUTATED(b[6] = 0xff, "bad greeting kind");
    MUTATED(b[16] = 0, "bad name length");
    MUTATED(b[17] = 0, "bad name length");
    MUTATED(b[16] = IDENT_NAME_MAX + 1, "bad name length");
    MUTATED(b[17] = 0xff, "bad name length");
    MUTATED(b[24] = '-', "invalid cohort or member id");   /* must start alnum */
    MUTATED(b[280 + 1] = ' ', "invalid cohort or member id");
    MUTATED(b[280 + 1] = '/', "invalid cohort or member id"); /* ids hold no '/' */
    /* A length longer than the name reads the padding: NUL bytes end the
     * string early, so "w-0" with length 4 is still "w-0" and valid, but
     * a byte that is no ident character is caught. */
    MUTATED((b[17] = 4, b[280 + 3] = 0x80), "invalid cohort or member id");
#undef MUTATED
}

Test(peerwire, hello_decode_survives_garbage)
{
    uint8_t b[PEERWIRE_HELLO_BYTES];
    struct peerwire_hello h;

    srand(12345);
    for (int round = 0; round < 2000; round++) {
        for (size_t i = 0; i < sizeof(b); i++)
            b[i] = (uint8_t)rand();
        /* Three rounds in four keep the magic and version right, so
         * that the later checks see garbage too. */
        if (round % 4 != 0) {
            memcpy(b, "COH1", 4);
            b[4] = 1;
            b[5] = 0;
        }
        if (!peerwire_hello_decode(b, sizeof(b), &h)) {
            /* Whatever got through is a well-formed greeting. */
            cr_assert(h.kind >= PEERWIRE_GREET && h.kind <= PEERWIRE_STALE);
            cr_assert(ident_valid_cohort(h.cohort) && ident_valid_member_id(h.id));
        }
    }
}

Test(peerwire, hello_plausible_judges_the_magic_once_it_is_there)
{
    uint8_t good[PEERWIRE_HELLO_BYTES];
    const uint8_t http[] = "GET / HTTP/1.1\r\n";

    hello_ok(good, "cohort", "w-0");
    for (size_t got = 0; got <= sizeof(good); got++)
        cr_assert(peerwire_hello_plausible(good, got), "%zu bytes of a greeting", got);
    for (size_t got = 0; got < 4; got++)
        cr_assert(peerwire_hello_plausible(http, got), "too early to tell at %zu", got);
    cr_assert_not(peerwire_hello_plausible(http, 4));
    cr_assert_not(peerwire_hello_plausible((const uint8_t *)"COHD", 4), "a frame is no greeting");
    cr_assert_not(peerwire_hello_plausible((const uint8_t *)"COH2", 4));
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
                                    .phase = 0x63, .step = 0x71727374u };
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
        0x61, 0x62, 0x63, 0x00, 0x74, 0x73, 0x72, 0x71,   /* dtype op phase 0 step */
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
                                 .phase = 0xff, .step = UINT32_MAX };
    peerwire_frame_encode(b, &f);
    cr_assert_eq(b[51], 0, "the reserved byte stays 0");
    cr_assert_eq(peerwire_frame_decode(b, sizeof(b), &g), 0);
    assert_frames_eq(&g, &f);
}

Test(peerwire, frame_decode_ignores_the_reserved_byte)
{
    struct peerwire_frame f = sample(), g;
    uint8_t b[PEERWIRE_FRAME_BYTES];

    peerwire_frame_encode(b, &f);
    b[51] = 0xff;
    cr_assert_eq(peerwire_frame_decode(b, sizeof(b), &g), 0);
    assert_frames_eq(&g, &f);
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

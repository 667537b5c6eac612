/* tests/fuzz/fuzz_peerwire.c: the first bytes a stranger sends to an
 * engine's data port, read as a greeting and as a frame header
 * (src/engine/peerwire.h).
 *
 * Kept to the decoders and what their contracts promise: a greeting that
 * decodes names a valid cohort and member id, was judged possible at every
 * prefix (the acceptor drops a connection as soon as its first bytes are
 * not), encodes back to a greeting that decodes the same, and carries MACs
 * that do not verify under a key the input never saw; a frame header
 * decodes exactly when it is whole, and what it decodes to encodes to a
 * header that decodes the same; a frame's tag made up by the input does
 * not verify under a stream's key. */
#include "fuzz.h"

#include <errno.h>

#include "base/ident.h"
#include "base/secret.h"
#include "engine/peerauth.h"
#include "engine/peerwire.h"

/* A key the input cannot know: made up once per process. */
static struct secret key;
static struct peerauth_stream stream;

static void setup(void)
{
    static bool done;
    uint8_t k[PEERAUTH_KEY_BYTES];

    if (done)
        return;
    CHECK(secret_generate(&key) == 0);
    CHECK(secret_random(k, sizeof(k)) == 0);
    CHECK(peerauth_stream_init(&stream, k) == 0);
    done = true;
}

static void greeting(const uint8_t *data, size_t size)
{
    struct peerwire_hello h, again;
    struct peerauth_transcript t;
    uint8_t b[PEERWIRE_HELLO_BYTES];
    const char *why = peerwire_hello_decode(data, size, &h);

    /* Whatever comes, the first bytes can be judged. */
    for (size_t k = 0; k <= size && k <= 16; k++)
        (void)peerwire_hello_early(data, k);
    if (why) {
        CHECK(*why != '\0');
        return;
    }
    CHECK(memchr(h.cohort, '\0', sizeof(h.cohort)) && memchr(h.id, '\0', sizeof(h.id)));
    CHECK(ident_valid_cohort(h.cohort) && ident_valid_member_id(h.id));
    (void)peerwire_cohort_hash(h.cohort);
    for (size_t k = 0; k <= size; k++)
        CHECK(peerwire_hello_early(data, k) == NULL);
    (void)peerwire_refusal_text(h.reason);
    /* What was decoded encodes to a greeting that decodes the same. */
    CHECK(peerwire_hello_encode(b, &h) == 0);
    CHECK(peerwire_hello_decode(b, sizeof(b), &again) == NULL);
    CHECK(again.kind == h.kind && again.flags == h.flags && again.reason == h.reason &&
          again.epoch == h.epoch && again.incarnation == h.incarnation &&
          again.serial == h.serial);
    CHECK(memcmp(again.nonce, h.nonce, sizeof(h.nonce)) == 0 &&
          memcmp(again.mac, h.mac, sizeof(h.mac)) == 0);
    CHECK(strcmp(again.cohort, h.cohort) == 0 && strcmp(again.id, h.id) == 0);
    /* Its MAC, read as any of the three messages, proves nothing. */
    memset(&t, 0, sizeof(t));
    t.cohort = h.cohort;
    t.connector = h.id;
    t.acceptor = "acceptor";
    t.epoch = t.reply_epoch = h.epoch;
    t.incarnation = h.incarnation;
    t.serial = h.serial;
    t.flags = h.flags;
    memcpy(t.nonce_c, h.nonce, sizeof(t.nonce_c));
    memcpy(t.nonce_a, h.nonce, sizeof(t.nonce_a));
    CHECK(!peerauth_verify(&key, PEERAUTH_ACCEPT, &t, h.mac));
    CHECK(!peerauth_verify(&key, PEERAUTH_STALE, &t, h.mac));
    CHECK(!peerauth_verify(&key, PEERAUTH_CONFIRM, &t, h.mac));
}

static void frame(const uint8_t *data, size_t size)
{
    struct peerwire_frame f, again;
    uint8_t b[PEERWIRE_FRAME_BYTES];
    int rc = peerwire_frame_decode(data, size, &f);

    if (size < PEERWIRE_FRAME_BYTES) {
        CHECK(rc == -EINVAL);
        return;
    }
    CHECK(rc == 0 || rc == -EPROTO);
    CHECK((rc == 0) == (f.magic == PEERWIRE_FRAME_DATA || f.magic == PEERWIRE_FRAME_BYE));
    /* What was decoded encodes to a header that decodes the same. */
    peerwire_frame_encode(b, &f);
    CHECK(peerwire_frame_decode(b, sizeof(b), &again) == rc);
    CHECK(again.magic == f.magic && again.length == f.length && again.cohort == f.cohort &&
          again.epoch == f.epoch && again.round == f.round && again.offset == f.offset &&
          again.count == f.count && again.dtype == f.dtype && again.op == f.op &&
          again.phase == f.phase && again.codec == f.codec && again.step == f.step);
    /* A sealed frame as --integrity mac reads it: header, tag, payload.
     * A tag the input made up does not verify. */
    if (size >= PEERWIRE_FRAME_BYTES + PEERWIRE_TAG_BYTES) {
        const uint8_t *tag = data + PEERWIRE_FRAME_BYTES;
        const uint8_t *payload = tag + PEERWIRE_TAG_BYTES;
        size_t len = size - PEERWIRE_FRAME_BYTES - PEERWIRE_TAG_BYTES;

        CHECK(peerauth_stream_begin(&stream, data) == 0);
        CHECK(peerauth_stream_update(&stream, payload, len) == 0);
        CHECK(peerauth_stream_end(&stream, tag) == -EPROTO);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    setup();
    greeting(data, size);
    frame(data, size);
    /* A frame header right after a greeting, as a connection carries it. */
    if (size > PEERWIRE_HELLO_BYTES)
        frame(data + PEERWIRE_HELLO_BYTES, size - PEERWIRE_HELLO_BYTES);
    return 0;
}

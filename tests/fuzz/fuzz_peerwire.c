/* tests/fuzz/fuzz_peerwire.c: the first bytes a stranger sends to an
 * engine's data port, read as a greeting and as a frame header
 * (src/engine/peerwire.h).
 *
 * Kept to the decoders and what their contracts promise, so that it
 * survives changes of the greeting's layout: a greeting that decodes names
 * a valid cohort and member id and was plausible at every prefix (the
 * acceptor drops a connection as soon as its first bytes are not); a frame
 * header decodes exactly when it is whole, and what it decodes to encodes
 * to a header that decodes the same. */
#include "fuzz.h"

#include <errno.h>

#include "base/ident.h"
#include "engine/peerwire.h"

static void greeting(const uint8_t *data, size_t size)
{
    struct peerwire_hello h, again;
    const char *why = peerwire_hello_decode(data, size, &h);

    /* Whatever comes, the first bytes can be judged. */
    for (size_t k = 0; k <= size && k <= 16; k++)
        (void)peerwire_hello_plausible(data, k);
    if (why) {
        CHECK(*why != '\0');
        return;
    }
    CHECK(memchr(h.cohort, '\0', sizeof(h.cohort)) && memchr(h.id, '\0', sizeof(h.id)));
    CHECK(ident_valid_cohort(h.cohort) && ident_valid_member_id(h.id));
    (void)peerwire_cohort_hash(h.cohort);
    for (size_t k = 0; k <= size; k++)
        CHECK(peerwire_hello_plausible(data, k));
    /* The same bytes read the same way twice. */
    CHECK(peerwire_hello_decode(data, size, &again) == NULL);
    CHECK(again.kind == h.kind && again.epoch == h.epoch);
    CHECK(strcmp(again.cohort, h.cohort) == 0 && strcmp(again.id, h.id) == 0);
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
          again.phase == f.phase && again.step == f.step);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    greeting(data, size);
    frame(data, size);
    /* A frame header right after a greeting, as a connection carries it. */
    if (size > PEERWIRE_HELLO_BYTES)
        frame(data + PEERWIRE_HELLO_BYTES, size - PEERWIRE_HELLO_BYTES);
    return 0;
}

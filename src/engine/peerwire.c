/* src/engine/peerwire.c: see peerwire.h.
 *
 * Integers are assembled a byte at a time rather than through memcpy and
 * a byte swap: the result is the same on any host, and gcc -O2 turns the
 * loops into single loads and stores on little-endian ones. */
#include "engine/peerwire.h"

#include <errno.h>
#include <string.h>

#include "base/ident.h"

void peerwire_put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

void peerwire_put64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

uint32_t peerwire_get32(const uint8_t *p)
{
    uint32_t v = 0;

    for (int i = 3; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}

uint64_t peerwire_get64(const uint8_t *p)
{
    uint64_t v = 0;

    for (int i = 7; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}

uint64_t peerwire_cohort_hash(const char *cohort)
{
    uint64_t h = 0xcbf29ce484222325ull;

    for (const char *s = cohort; *s; s++)
        h = (h ^ (uint8_t)*s) * 0x100000001b3ull;
    return h;
}

/* Offsets of the greeting's fields: see peerwire.h. */
enum {
    H_VERSION = 4, H_KIND = 6, H_FLAGS = 7, H_EPOCH = 8, H_COHORT_LEN = 16, H_ID_LEN = 17,
    H_REASON = 18, H_INCARNATION = 24, H_SERIAL = 32, H_NONCE = 40, H_MAC = 72, H_COHORT = 104,
    H_ID = H_COHORT + PEERWIRE_HELLO_NAME,
};

int peerwire_hello_encode(uint8_t *b, const struct peerwire_hello *h)
{
    size_t cl = strnlen(h->cohort, sizeof(h->cohort)), il = strnlen(h->id, sizeof(h->id));

    /* The lengths travel as one byte each, and the names in 256. */
    if (cl == 0 || cl > IDENT_NAME_MAX || il == 0 || il > IDENT_NAME_MAX ||
        (h->flags & ~PEERWIRE_F_ALL))
        return -EINVAL;
    memset(b, 0, PEERWIRE_HELLO_BYTES);
    peerwire_put32(b, PEERWIRE_HELLO_MAGIC);
    b[H_VERSION] = (uint8_t)PEERWIRE_VERSION;
    b[H_VERSION + 1] = (uint8_t)(PEERWIRE_VERSION >> 8);
    b[H_KIND] = h->kind;
    b[H_FLAGS] = h->flags;
    peerwire_put64(b + H_EPOCH, h->epoch);
    b[H_COHORT_LEN] = (uint8_t)cl;
    b[H_ID_LEN] = (uint8_t)il;
    b[H_REASON] = h->reason;
    peerwire_put64(b + H_INCARNATION, h->incarnation);
    peerwire_put64(b + H_SERIAL, h->serial);
    memcpy(b + H_NONCE, h->nonce, PEERWIRE_NONCE_BYTES);
    memcpy(b + H_MAC, h->mac, PEERWIRE_MAC_BYTES);
    memcpy(b + H_COHORT, h->cohort, cl);
    memcpy(b + H_ID, h->id, il);
    return 0;
}

const char *peerwire_hello_early(const uint8_t *b, size_t got)
{
    if (got >= 4 && peerwire_get32(b) != PEERWIRE_HELLO_MAGIC)
        return "bad magic";
    if (got >= 6 && (b[H_VERSION] | b[H_VERSION + 1] << 8) != PEERWIRE_VERSION)
        return "unsupported wire version";
    return NULL;
}

const char *peerwire_hello_decode(const uint8_t *b, size_t len, struct peerwire_hello *h)
{
    const char *why;
    size_t cl, il;

    /* A short buffer is judged by what it has, so that a greeting of
     * another version is named as such and not as short. */
    why = peerwire_hello_early(b, len < 6 ? len : 6);
    if (why)
        return why;
    if (len < PEERWIRE_HELLO_BYTES)
        return "short greeting";
    cl = b[H_COHORT_LEN];
    il = b[H_ID_LEN];
    if (b[H_KIND] < PEERWIRE_GREET || b[H_KIND] > PEERWIRE_REFUSE)
        return "bad greeting kind";
    if (b[H_FLAGS] & ~PEERWIRE_F_ALL)
        return "unknown flags";
    if (cl == 0 || cl > IDENT_NAME_MAX || il == 0 || il > IDENT_NAME_MAX)
        return "bad name length";
    h->kind = b[H_KIND];
    h->flags = b[H_FLAGS];
    h->reason = b[H_REASON];
    h->epoch = peerwire_get64(b + H_EPOCH);
    h->incarnation = peerwire_get64(b + H_INCARNATION);
    h->serial = peerwire_get64(b + H_SERIAL);
    memcpy(h->nonce, b + H_NONCE, PEERWIRE_NONCE_BYTES);
    memcpy(h->mac, b + H_MAC, PEERWIRE_MAC_BYTES);
    memcpy(h->cohort, b + H_COHORT, cl);
    h->cohort[cl] = '\0';
    memcpy(h->id, b + H_ID, il);
    h->id[il] = '\0';
    if (!ident_valid_cohort(h->cohort) || !ident_valid_member_id(h->id))
        return "invalid cohort or member id";
    return NULL;
}

const char *peerwire_refusal_text(uint8_t reason)
{
    switch (reason) {
    case PEERWIRE_REFUSE_NEED_KEY: return "it requires the cohort key and this member has none";
    case PEERWIRE_REFUSE_NO_KEY: return "it has no cohort key and this member has one";
    case PEERWIRE_REFUSE_INTEGRITY: return "its --integrity differs from this member's";
    case PEERWIRE_REFUSE_BAD_MAC:
        return "it could not verify this member's MAC: their cohort keys differ";
    default: return "a reason this version does not know";
    }
}

void peerwire_frame_encode(uint8_t *b, const struct peerwire_frame *f)
{
    peerwire_put32(b, f->magic);
    peerwire_put32(b + 4, f->length);
    peerwire_put64(b + 8, f->cohort);
    peerwire_put64(b + 16, f->epoch);
    peerwire_put64(b + 24, f->round);
    peerwire_put64(b + 32, f->offset);
    peerwire_put64(b + 40, f->count);
    b[48] = f->dtype;
    b[49] = f->op;
    b[50] = f->phase;
    b[51] = f->codec;
    peerwire_put32(b + 52, f->step);
}

int peerwire_frame_decode(const uint8_t *b, size_t len, struct peerwire_frame *f)
{
    if (len < PEERWIRE_FRAME_BYTES)
        return -EINVAL;
    f->magic = peerwire_get32(b);
    f->length = peerwire_get32(b + 4);
    f->cohort = peerwire_get64(b + 8);
    f->epoch = peerwire_get64(b + 16);
    f->round = peerwire_get64(b + 24);
    f->offset = peerwire_get64(b + 32);
    f->count = peerwire_get64(b + 40);
    f->dtype = b[48];
    f->op = b[49];
    f->phase = b[50];
    f->codec = b[51];
    f->step = peerwire_get32(b + 52);
    return f->magic == PEERWIRE_FRAME_DATA || f->magic == PEERWIRE_FRAME_BYE ? 0 : -EPROTO;
}

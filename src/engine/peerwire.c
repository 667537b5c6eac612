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

int peerwire_hello_encode(uint8_t *b, uint8_t kind, uint64_t epoch, const char *cohort,
                          const char *id)
{
    size_t cl = strlen(cohort), il = strlen(id);

    /* The lengths travel as one byte each, and the names in 256. */
    if (cl == 0 || cl > IDENT_NAME_MAX || il == 0 || il > IDENT_NAME_MAX)
        return -EINVAL;
    memset(b, 0, PEERWIRE_HELLO_BYTES);
    peerwire_put32(b, PEERWIRE_HELLO_MAGIC);
    b[4] = (uint8_t)PEERWIRE_VERSION;
    b[5] = (uint8_t)(PEERWIRE_VERSION >> 8);
    b[6] = kind;
    peerwire_put64(b + 8, epoch);
    b[16] = (uint8_t)cl;
    b[17] = (uint8_t)il;
    memcpy(b + 24, cohort, cl);
    memcpy(b + 24 + PEERWIRE_HELLO_NAME, id, il);
    return 0;
}

const char *peerwire_hello_decode(const uint8_t *b, size_t len, struct peerwire_hello *h)
{
    size_t cl, il;

    if (len < PEERWIRE_HELLO_BYTES)
        return "short greeting";
    cl = b[16];
    il = b[17];
    if (peerwire_get32(b) != PEERWIRE_HELLO_MAGIC)
        return "bad magic";
    if ((b[4] | b[5] << 8) != PEERWIRE_VERSION)
        return "unsupported wire version";
    if (b[6] < PEERWIRE_GREET || b[6] > PEERWIRE_STALE)
        return "bad greeting kind";
    if (cl == 0 || cl > IDENT_NAME_MAX || il == 0 || il > IDENT_NAME_MAX)
        return "bad name length";
    h->kind = b[6];
    h->epoch = peerwire_get64(b + 8);
    memcpy(h->cohort, b + 24, cl);
    h->cohort[cl] = '\0';
    memcpy(h->id, b + 24 + PEERWIRE_HELLO_NAME, il);
    h->id[il] = '\0';
    if (!ident_valid_cohort(h->cohort) || !ident_valid_member_id(h->id))
        return "invalid cohort or member id";
    return NULL;
}

bool peerwire_hello_plausible(const uint8_t *b, size_t got)
{
    return got < 4 || peerwire_get32(b) == PEERWIRE_HELLO_MAGIC;
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
    b[51] = 0;
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
    f->step = peerwire_get32(b + 52);
    return f->magic == PEERWIRE_FRAME_DATA || f->magic == PEERWIRE_FRAME_BYE ? 0 : -EPROTO;
}

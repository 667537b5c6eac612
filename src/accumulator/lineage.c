/* src/accumulator/lineage.c: see lineage.h. */
#include "accumulator/lineage.h"

#include <errno.h>
#include <string.h>

#include "membership/epoch.h"

#define FNV_OFFSET 0xcbf29ce484222325ull
#define FNV_PRIME 0x100000001b3ull

static uint64_t fnv(uint64_t h, const void *p, size_t len)
{
    const unsigned char *b = p;

    for (size_t i = 0; i < len; i++)
        h = (h ^ b[i]) * FNV_PRIME;
    return h;
}

uint64_t lineage_epoch_id(const struct epoch *e)
{
    uint64_t h = fnv(FNV_OFFSET, &e->number, sizeof(e->number));

    /* The terminating NULs separate the fields. */
    for (size_t i = 0; i < e->n_members; i++) {
        h = fnv(h, e->members[i].id, strlen(e->members[i].id) + 1);
        h = fnv(h, e->members[i].address, strlen(e->members[i].address) + 1);
    }
    return h && h != LINEAGE_UNSURE ? h : 1;
}

void lineage_reset(struct lineage *l, uint64_t version)
{
    memset(l, 0, sizeof(*l));
    l->base = version;
}

static uint64_t top(const struct lineage *l)
{
    return l->n ? l->runs[l->n - 1].last : l->base;
}

void lineage_commit(struct lineage *l, uint64_t epoch_id, uint64_t version)
{
    struct lineage_run *r;

    if (version == 0 || version != top(l) + 1)
        lineage_reset(l, version ? version - 1 : 0);
    if (l->n > 0 && l->runs[l->n - 1].epoch == epoch_id) {
        l->runs[l->n - 1].last = version;
        return;
    }
    if (l->n == LINEAGE_RUNS) {
        /* The oldest run is let go: its versions become unknown. */
        l->base = l->runs[0].last;
        memmove(&l->runs[0], &l->runs[1], (LINEAGE_RUNS - 1) * sizeof(l->runs[0]));
        l->n--;
    }
    r = &l->runs[l->n++];
    r->epoch = epoch_id;
    r->first = r->last = version;
}

enum lineage_answer lineage_holds(const struct lineage *l, uint64_t version, uint64_t epoch_id)
{
    if (version > top(l))
        return LINEAGE_NO;
    if (version <= l->base)
        return LINEAGE_UNKNOWN;
    for (uint32_t i = 0; i < l->n; i++)
        if (version >= l->runs[i].first && version <= l->runs[i].last) {
            if (l->runs[i].epoch == LINEAGE_UNSURE)
                return LINEAGE_UNKNOWN;
            return l->runs[i].epoch == epoch_id ? LINEAGE_YES : LINEAGE_NO;
        }
    return LINEAGE_UNKNOWN;     /* cannot happen: the runs cover (base, top] */
}

void lineage_encode(const struct lineage *l, int64_t *words)
{
    memset(words, 0, LINEAGE_WORDS * sizeof(*words));
    words[0] = (int64_t)l->base;
    words[1] = (int64_t)l->n;
    for (uint32_t i = 0; i < l->n; i++) {
        words[2 + 3 * i] = (int64_t)l->runs[i].epoch;
        words[3 + 3 * i] = (int64_t)l->runs[i].first;
        words[4 + 3 * i] = (int64_t)l->runs[i].last;
    }
}

int lineage_decode(const int64_t *words, struct lineage *l)
{
    struct lineage got;
    uint64_t prev;

    memset(&got, 0, sizeof(got));
    got.base = (uint64_t)words[0];
    if ((uint64_t)words[1] > LINEAGE_RUNS)
        return -EPROTO;
    got.n = (uint32_t)words[1];
    prev = got.base;
    for (uint32_t i = 0; i < got.n; i++) {
        struct lineage_run *r = &got.runs[i];

        r->epoch = (uint64_t)words[2 + 3 * i];
        r->first = (uint64_t)words[3 + 3 * i];
        r->last = (uint64_t)words[4 + 3 * i];
        /* Consecutive, non-empty, ascending: (base, top] with no gap. */
        if (prev == UINT64_MAX || r->first != prev + 1 || r->last < r->first || r->epoch == 0)
            return -EPROTO;
        prev = r->last;
    }
    *l = got;
    return 0;
}

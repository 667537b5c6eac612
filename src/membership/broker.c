/* src/membership/broker.c: see broker.h.
 *
 * Cohorts live in an array sorted by name and each cohort's members in an
 * array sorted in member order; both are searched by bisection. Member
 * order is the order an epoch lists, so forming an epoch is a copy, not a
 * sort, and a heartbeat costs about log2(members) comparisons. A join or a
 * leave shifts pointers, which even at the caps is a few kilobytes of
 * memmove on an event that is rare next to heartbeats.
 *
 * Eviction is lazy: each cohort keeps a lower bound on its earliest
 * eviction deadline, and broker_tick() scans a cohort's members only once
 * that bound has passed. Heartbeats only push deadlines later, so they
 * never have to touch the bound; the scan recomputes it exactly.
 *
 * Replay (wire.h): each member session that joined with a proof keeps the
 * highest sequence number accepted from it and a bitmap of the
 * WIRE_PROOF_SEQ_WINDOW below it. When such a session leaves or is
 * evicted it goes into a ring of retired sessions, kept for
 * BROKER_RETIRED_KEEP_MS and capped at BROKER_RETIRED_MAX, so that a
 * captured Join cannot bring it back. The ring is searched only by joins
 * of sessions the broker does not hold, comparing the 64-bit session
 * first.
 *
 * Unreachability (broker_report_unreachable): each accused member keeps
 * a bitmap over the current epoch's positions of the members that
 * reported it, the epoch it counts for and the time of the first report
 * it counts. A bitmap is allocated at a member's first accusation and
 * cleared, not freed, when the epoch or the window moves on; at most
 * one per member, of the epoch's size. The window the reports count
 * in grows with the epoch (report_window), as the rounds a member needs
 * to probe its peers do (limit_reach_rounds). Pairs of members that report each
 * other are kept, at most PAIRS_MAX, by the one of the two placed first
 * in the epoch, with when they were first and last seen to, so that a
 * cut between two members only is judged once it has lasted a window;
 * each accused also keeps the count of the window before its current
 * one (prev_accusers), so that a count that just started over does not
 * pass for a member reported by one. A report costs two lookups in a
 * hash index of the current epoch's ids (built once per epoch, with the
 * entry each position names, cleared as entries go: entry_forget) and a
 * bit; only a report the index cannot place searches the members.
 * Benched ids (evicted as unreachable) are a small array per cohort,
 * searched only by joins of ids the cohort does not hold.
 */
#include "membership/broker.h"

#include "base/ident.h"
#include "base/limits.h"
#include "rpc/rpc.h"
#include "membership/wire.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

/* A joiner's last_epoch is read from the wire. Refusing absurd values keeps
 * `number + 1` from ever wrapping to 0, which would break "epochs only
 * grow"; no real cohort forms 2^63 epochs. */
#define EPOCH_MAX (UINT64_MAX / 2)

#define TICK_MAX_MS 1000

/* Mutual pairs one member keeps (struct pair). A member that reports, and
 * is reported by, more peers than this is cut from many, which the
 * majority rule, not the pair rule, is for; pairs beyond it are not
 * judged, which keeps the rounds stalled but evicts no one wrongly. */
#define PAIRS_MAX 16u

/* Two members of one epoch that each reported the other unreachable
 * (broker_report_unreachable): `peer` is the epoch position of the one
 * placed later, the entry holding it the one placed earlier. */
struct pair {
    uint64_t epoch;             /* 0: a free slot */
    uint32_t peer;
    uint64_t since;             /* first seen mutual, without a lapse since */
    uint64_t last;              /* last seen mutual */
};

/* One member as the broker holds it ("entry" keeps it apart from
 * member.h, the member's own side of the protocol). */
struct entry {
    char *id;
    char *address;
    uint64_t session;
    uint64_t model_version;
    uint64_t last_seen;
    uint32_t heartbeat_ms;
    uint32_t timeout_ms;
    uint64_t adopted;           /* the epoch it last said it runs in */
    bool draining;              /* left out of epochs (broker_drain) */
    struct broker_checkpoint ckpt;  /* as last reported */
    void *watcher;              /* borrowed from the host; NULL if none */
    /* When its watch stream ended without a Leave (the host saw the
     * connection reset or closed: its process died), 0 while it has one
     * or gave a sign of life since. */
    uint64_t gone_at;
    /* When a peer last reported its data connection reset, 0 if none
     * since its last sign of life. */
    uint64_t accused_at;
    uint64_t seq_top;           /* highest proof seq accepted; 0: joined unproved */
    uint64_t seq_seen;          /* bit i: seq_top - 1 - i was accepted */
    /* Reports that it is unreachable (broker_report_unreachable). Not
     * undone by its own signs of life: a member cut from its peers but
     * not from the broker keeps heartbeating. */
    uint64_t *accusers;         /* bit i: the epoch's member i reported it */
    size_t accusers_words;      /* allocated */
    uint64_t accused_epoch;     /* the epoch the bits count for; 0: none */
    uint64_t accused_first;     /* the first report in the bits */
    uint32_t n_accusers;
    /* n_accusers of the window before this one, when this one began
     * right after it (within a window of its end); else 0. */
    uint32_t prev_accusers;
    uint64_t cut_off_at;        /* its epoch's reports agreed: evict now; 0: not */
    /* When this session joined: of a mutual pair, the later joiner goes. */
    uint64_t joined_at;
    /* Its position in the current epoch when last looked up (epoch_at),
     * checked before use: a hint that spares a report's lookups. */
    size_t epoch_pos;
    struct pair *pairs;         /* PAIRS_MAX, allocated at its first pair */
};

/* An id evicted as unreachable: its joins are refused until `until`. */
struct bench {
    char *id;                   /* NULL: a free slot */
    uint64_t until;
    uint64_t forget_at;         /* a verdict before this doubles the bench */
    uint32_t factor;            /* this bench, in member timeouts */
};

/* A member session that left or was evicted after a proved join. */
struct retired {
    char *cohort, *id;
    uint64_t session;           /* 0: a free slot */
    uint64_t seq_top;
    uint64_t until;             /* forgotten at this time */
    bool left;
};

struct cohort {
    char *name;
    uint32_t heartbeat_ms;      /* for members that join from now on */
    uint32_t timeout_ms;
    struct entry **members;     /* member order */
    size_t n_members, cap_members;
    struct epoch *cur;          /* latest published (one reference), or NULL */
    uint64_t *cur_sessions;     /* parallel to cur->members */
    /* Parallel to cur->members too: the entry each position names, NULL
     * once it is freed (entry_forget), so that a report finds both its
     * parties without a search; and an open-addressing index of the
     * positions by id hash (cur_index_mask + 1 slots of position + 1, 0
     * empty), NULL when it could not be allocated (then reports search). */
    struct entry **cur_entries;
    uint32_t *cur_index;
    size_t cur_index_mask;
    uint64_t floor;             /* highest epoch published or reported by a joiner */
    uint64_t next_evict;        /* no member is due before this; UINT64_MAX if none */
    uint64_t pending_since;     /* first change not yet in an epoch */
    bool pending;
    bool leader_dirty;          /* a declared version moved the leader */
    struct bench *benched;      /* BROKER_BENCH_MAX slots, allocated at the first */
    /* No epoch forms before this: set by the first join after evictions
     * emptied the cohort, as after a restart (broker.h). */
    uint64_t hold_until;
    bool emptied;               /* evictions left it empty; no join since */
};

struct broker {
    struct broker_config cfg;
    uint64_t hash_seed;         /* of the epochs' id indexes, random per broker */
    struct broker_watch_ops ops;
    uint64_t hold_until;        /* no epoch forms before this */
    struct cohort **cohorts;    /* sorted by name, in natural order */
    size_t n_cohorts, cap_cohorts;
    struct retired *retired;    /* a ring of BROKER_RETIRED_MAX, allocated at the first */
    size_t r_head, r_n;         /* oldest slot, slots in use */
};

uint32_t broker_startup_hold_ms(uint32_t heartbeat_ms)
{
    uint64_t retry = heartbeat_ms > LIMIT_BACKOFF_MAX_MS ? heartbeat_ms : LIMIT_BACKOFF_MAX_MS;
    uint64_t hold = (uint64_t)RPC_RECONNECT_MAX_MS + retry + heartbeat_ms;

    return hold > UINT32_MAX ? UINT32_MAX : (uint32_t)hold;
}

void broker_config_default(struct broker_config *cfg)
{
    *cfg = (struct broker_config){
        .heartbeat_ms = WIRE_DEFAULT_HEARTBEAT_MS,
        .timeout_ms = WIRE_DEFAULT_TIMEOUT_MS,
        .coalesce_ms = 50,
        .startup_hold_ms = broker_startup_hold_ms(WIRE_DEFAULT_HEARTBEAT_MS),
        .max_members = 4096,
        .max_cohorts = 1024,
        .max_timeout_ms = BROKER_MEMBER_TIMEOUT_CAP_MS,
        .stream_grace_ms = BROKER_STREAM_GRACE_MS,
        .allow_any_cohort = false,
    };
}

/* ---- small helpers ---- */

static uint64_t min_u64(uint64_t a, uint64_t b)
{
    return a < b ? a : b;
}

static uint32_t min_u32(uint32_t a, uint32_t b)
{
    return a < b ? a : b;
}

static uint32_t max_u32(uint32_t a, uint32_t b)
{
    return a > b ? a : b;
}

static uint64_t max_u64(uint64_t a, uint64_t b)
{
    return a > b ? a : b;
}

/* Makes room for `need` elements of `size` bytes; returns the (possibly
 * moved) array, or NULL with `arr` untouched. */
static void *grow(void *arr, size_t *cap, size_t need, size_t size)
{
    size_t n = *cap ? *cap : 8;
    void *p;

    if (need <= *cap)
        return arr;
    while (n < need)
        n *= 2;
    p = reallocarray(arr, n, size);
    if (p)
        *cap = n;
    return p;
}

/* The first moment at which `m` is due for eviction: silent for longer
 * than its timeout; or its stream gone for longer than the grace; or its
 * stream gone and a peer's data connection to it reset (two independent
 * signs that its process died, so no grace is waited for). */
static uint64_t entry_deadline(const struct broker *b, const struct entry *m)
{
    uint64_t d = m->last_seen + m->timeout_ms + 1;

    if (m->gone_at) {
        d = min_u64(d, m->gone_at + b->cfg.stream_grace_ms);
        if (m->accused_at)
            d = min_u64(d, max_u64(m->gone_at, m->accused_at));
    }
    if (m->cut_off_at)
        d = min_u64(d, m->cut_off_at);
    return d;
}

/* A sign of life from `m` (a heartbeat, a rejoin, a new watch): whatever
 * suggested its death is outweighed. */
static void entry_alive(struct entry *m)
{
    m->gone_at = 0;
    m->accused_at = 0;
}

static void entry_free(struct entry *m)
{
    if (!m)
        return;
    free(m->id);
    free(m->address);
    free(m->accusers);
    free(m->pairs);
    free(m);
}

/* ---- benched ids ---- */

static struct bench *bench_find(const struct cohort *c, const char *id)
{
    for (size_t i = 0; c->benched && i < BROKER_BENCH_MAX; i++)
        if (c->benched[i].id && strcmp(c->benched[i].id, id) == 0)
            return &c->benched[i];
    return NULL;
}

/* Milliseconds left of id's bench at `now`; 0 when it may join. */
static uint64_t bench_left(const struct cohort *c, const char *id, uint64_t now)
{
    const struct bench *k = c ? bench_find(c, id) : NULL;

    return k && now < k->until ? k->until - now : 0;
}

/* Benches member m of c, evicted as unreachable at `now`. Out of memory,
 * it is not benched: it may rejoin at once, and its peers report it
 * again if it is still cut off. */
static void bench_add(struct cohort *c, const struct entry *m, uint64_t now)
{
    struct bench *k = bench_find(c, m->id);
    uint64_t ms;

    if (!c->benched) {
        c->benched = calloc(BROKER_BENCH_MAX, sizeof(*c->benched));
        if (!c->benched)
            return;
    }
    if (k && now < k->forget_at) {
        k->factor = min_u32(k->factor * 2, BROKER_BENCH_MAX_FACTOR);
    } else {
        if (!k) {
            /* A free slot, else the one forgotten soonest. */
            k = &c->benched[0];
            for (size_t i = 0; i < BROKER_BENCH_MAX && k->id; i++)
                if (!c->benched[i].id || c->benched[i].forget_at < k->forget_at)
                    k = &c->benched[i];
            free(k->id);
            k->id = strdup(m->id);
            if (!k->id)
                return;
        }
        k->factor = 1;
    }
    ms = (uint64_t)m->timeout_ms * k->factor;
    k->until = now + ms;
    k->forget_at = k->until + ms;
}

static void bench_free(struct cohort *c)
{
    for (size_t i = 0; c->benched && i < BROKER_BENCH_MAX; i++)
        free(c->benched[i].id);
    free(c->benched);
}

/* ---- replay (wire.h) ---- */

/* Whether proof sequence number `seq` is new for m: above the highest
 * accepted, or within the window below it and not yet seen. */
static bool seq_fresh(const struct entry *m, uint64_t seq)
{
    uint64_t back;

    if (seq > m->seq_top)
        return true;
    back = m->seq_top - seq;
    if (back == 0 || back > WIRE_PROOF_SEQ_WINDOW)
        return false;
    return !((m->seq_seen >> (back - 1)) & 1u);
}

static void seq_record(struct entry *m, uint64_t seq)
{
    if (seq > m->seq_top) {
        uint64_t shift = seq - m->seq_top;

        m->seq_seen = shift >= 64 ? 0 : m->seq_seen << shift;
        if (shift <= 64)
            m->seq_seen |= 1ull << (shift - 1);     /* the old top */
        m->seq_top = seq;
    } else {
        m->seq_seen |= 1ull << (m->seq_top - seq - 1);
    }
}

/* A session's first proved join: everything below its seq counts as
 * seen, so that no older proof of the session is accepted after it. */
static void seq_start(struct entry *m, uint64_t seq)
{
    m->seq_top = seq;
    m->seq_seen = seq ? ~0ull : 0;
}

static void retired_clear(struct retired *r)
{
    free(r->cohort);
    free(r->id);
    memset(r, 0, sizeof(*r));
}

/* Forgets the retired sessions whose time has passed: the ring is in
 * the order they retired, so they are at its head. */
static void retired_expire(struct broker *b, uint64_t now)
{
    while (b->r_n > 0 && b->retired[b->r_head].until <= now) {
        retired_clear(&b->retired[b->r_head]);
        b->r_head = (b->r_head + 1) % BROKER_RETIRED_MAX;
        b->r_n--;
    }
}

static struct retired *retired_find(struct broker *b, const char *cohort, const char *id,
                                    uint64_t session, uint64_t now)
{
    retired_expire(b, now);
    for (size_t k = 0; k < b->r_n; k++) {
        struct retired *r = &b->retired[(b->r_head + k) % BROKER_RETIRED_MAX];

        if (r->session == session && strcmp(r->id, id) == 0 && strcmp(r->cohort, cohort) == 0)
            return r;
    }
    return NULL;
}

/* Remembers m's session of cohort c as retired, if it joined with a
 * proof. Out of memory, it is not remembered: its captured Joins are
 * then refused by their time alone. */
static void retire(struct broker *b, const struct cohort *c, const struct entry *m,
                   uint64_t now, bool left)
{
    struct retired *r;

    if (m->seq_top == 0)
        return;
    retired_expire(b, now);
    if (!b->retired) {
        b->retired = calloc(BROKER_RETIRED_MAX, sizeof(*b->retired));
        if (!b->retired)
            return;
    }
    if (b->r_n == BROKER_RETIRED_MAX) {
        retired_clear(&b->retired[b->r_head]);
        b->r_head = (b->r_head + 1) % BROKER_RETIRED_MAX;
        b->r_n--;
    }
    r = &b->retired[(b->r_head + b->r_n) % BROKER_RETIRED_MAX];
    r->cohort = strdup(c->name);
    r->id = strdup(m->id);
    if (!r->cohort || !r->id) {
        retired_clear(r);
        return;
    }
    r->session = m->session;
    r->seq_top = m->seq_top;
    r->until = now + BROKER_RETIRED_KEEP_MS;
    r->left = left;
    b->r_n++;
}

/* Whether a proved join of a session the cohort does not hold is refused
 * as a replay: the session left, or was evicted and seq is not above the
 * last it proved. A session allowed back is no longer retired. */
static bool retired_refuses(struct broker *b, const struct broker_join *j, uint64_t now)
{
    struct retired *r = retired_find(b, j->cohort, j->id, j->session, now);

    if (!r)
        return false;
    return r->left || j->seq <= r->seq_top;
}

static void retired_forget(struct broker *b, const char *cohort, const char *id,
                           uint64_t session, uint64_t now)
{
    struct retired *r = retired_find(b, cohort, id, session, now);

    /* A hole in the ring (session 0 matches no join), reclaimed when it
     * reaches the head: its time is 0, long past. */
    if (r)
        retired_clear(r);
}

static void detach(const struct broker *b, struct entry *m, int err)
{
    void *w = m->watcher;

    if (!w)
        return;
    m->watcher = NULL;
    if (b->ops.detach)
        b->ops.detach(b->ops.arg, w, err);
}

/* Bisection over n names sorted in natural order, name_at(items, i)
 * giving the i-th: returns the index of `key`, or where it would be
 * inserted, and says which in *found. */
static size_t natural_find(const void *items, size_t n,
                           const char *(*name_at)(const void *, size_t), const char *key,
                           bool *found)
{
    size_t lo = 0, hi = n;

    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int r = ident_natural_cmp(name_at(items, mid), key);

        if (r == 0) {
            *found = true;
            return mid;
        }
        if (r < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    *found = false;
    return lo;
}

static const char *cohort_name_at(const void *items, size_t i)
{
    return ((struct cohort *const *)items)[i]->name;
}

static const char *entry_id_at(const void *items, size_t i)
{
    return ((struct entry *const *)items)[i]->id;
}

static size_t cohort_find(const struct broker *b, const char *name, bool *found)
{
    return natural_find(b->cohorts, b->n_cohorts, cohort_name_at, name, found);
}

static size_t entry_find(const struct cohort *c, const char *id, bool *found)
{
    return natural_find(c->members, c->n_members, entry_id_at, id, found);
}

static struct cohort *cohort_get(const struct broker *b, const char *name)
{
    bool found;
    size_t i;

    if (!name)
        return NULL;
    i = cohort_find(b, name, &found);
    return found ? b->cohorts[i] : NULL;
}

/* The member `id` of `c`, or NULL. A nonzero `session` must also match:
 * requests from a superseded process must not act for its successor. */
static struct entry *entry_get(const struct cohort *c, const char *id, uint64_t session)
{
    bool found;
    size_t i;

    if (!c || !id)
        return NULL;
    i = entry_find(c, id, &found);
    if (!found || (session && c->members[i]->session != session))
        return NULL;
    return c->members[i];
}

static void mark_pending(struct cohort *c, uint64_t now)
{
    if (!c->pending) {
        c->pending = true;
        c->pending_since = now;
    }
}

/* Highest model version among the members that are not draining; ties
 * go to the first in member order. Returns the index into `ms`, or n when
 * every member is draining. */
static size_t elect(struct entry *const *ms, size_t n)
{
    size_t best = n;

    for (size_t i = 0; i < n; i++)
        if (!ms[i]->draining && (best == n || ms[i]->model_version > ms[best]->model_version))
            best = i;
    return best;
}

/* The position `at` (an index into the cohort's members) has among the
 * members that are not draining, i.e. in the epoch being formed. */
static size_t epoch_index(const struct cohort *c, size_t at)
{
    size_t k = 0;

    for (size_t i = 0; i < at; i++)
        k += !c->members[i]->draining;
    return k;
}

/* The hash of an id in the current epoch's index: FNV-1a from a
 * per-broker random basis, then a 64-bit finalizer, so that ids chosen
 * to collide on one broker are unlikely to on another. */
static uint64_t id_hash(uint64_t seed, const char *id)
{
    uint64_t h = 14695981039346656037ull ^ seed;

    for (const unsigned char *p = (const unsigned char *)id; *p; p++)
        h = (h ^ *p) * 1099511628211ull;
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    return h;
}

/* Indexes epoch e's ids (*index, *mask) for cur_find. Returns 0 or
 * -ENOMEM. Twice as many slots as members, at least 16. */
static int index_build(uint64_t seed, const struct epoch *e, uint32_t **index, size_t *mask)
{
    size_t slots = 16;
    uint32_t *t;

    while (slots < 2 * e->n_members)
        slots *= 2;
    t = calloc(slots, sizeof(*t));
    if (!t)
        return -ENOMEM;
    for (size_t k = 0; k < e->n_members; k++) {
        size_t i = (size_t)id_hash(seed, e->members[k].id) & (slots - 1);

        while (t[i])
            i = (i + 1) & (slots - 1);
        t[i] = (uint32_t)k + 1;
    }
    *index = t;
    *mask = slots - 1;
    return 0;
}

/* The position of `id` in c's current epoch, or -1: by the index, else
 * by epoch_find. */
static long cur_find(const struct broker *b, const struct cohort *c, const char *id)
{
    if (!c->cur_index)
        return epoch_find(c->cur, id);
    for (size_t i = (size_t)id_hash(b->hash_seed, id) & c->cur_index_mask; c->cur_index[i];
         i = (i + 1) & c->cur_index_mask) {
        size_t k = c->cur_index[i] - 1;

        if (strcmp(c->cur->members[k].id, id) == 0)
            return (long)k;
    }
    return -1;
}

/* Entry m is about to be freed: the current epoch's position for it no
 * longer names it. */
static void entry_forget(struct cohort *c, const struct entry *m)
{
    if (c->cur_entries && c->cur && m->epoch_pos < c->cur->n_members &&
        c->cur_entries[m->epoch_pos] == m)
        c->cur_entries[m->epoch_pos] = NULL;
}

/* ---- cohorts ---- */

static void cohort_free(const struct broker *b, struct cohort *c, int err)
{
    for (size_t i = 0; i < c->n_members; i++) {
        detach(b, c->members[i], err);
        entry_free(c->members[i]);
    }
    free(c->members);
    bench_free(c);
    epoch_unref(c->cur);
    free(c->cur_sessions);
    free(c->cur_entries);
    free(c->cur_index);
    free(c->name);
    free(c);
}

static int cohort_add(struct broker *b, const char *name, uint32_t heartbeat_ms,
                      uint32_t timeout_ms, struct cohort **out)
{
    struct cohort **arr, *c;
    bool found;
    size_t at;

    if (b->n_cohorts >= b->cfg.max_cohorts)
        return -ENOSPC;
    arr = grow(b->cohorts, &b->cap_cohorts, b->n_cohorts + 1, sizeof *arr);
    if (!arr)
        return -ENOMEM;
    b->cohorts = arr;
    c = calloc(1, sizeof *c);
    if (!c)
        return -ENOMEM;
    c->name = strdup(name);
    if (!c->name)
        goto free_cohort;
    c->heartbeat_ms = heartbeat_ms;
    c->timeout_ms = timeout_ms;
    c->next_evict = UINT64_MAX;

    at = cohort_find(b, name, &found);
    memmove(&arr[at + 1], &arr[at], (b->n_cohorts - at) * sizeof *arr);
    arr[at] = c;
    b->n_cohorts++;
    if (out)
        *out = c;
    return 0;

free_cohort:
    free(c);
    return -ENOMEM;
}

/* Unlinks the cohort at index `at` and frees it. */
static void cohort_drop(struct broker *b, size_t at, int err)
{
    struct cohort *c = b->cohorts[at];

    memmove(&b->cohorts[at], &b->cohorts[at + 1],
            (b->n_cohorts - at - 1) * sizeof *b->cohorts);
    b->n_cohorts--;
    cohort_free(b, c, err);
}

/* Whether the current members that are not draining are exactly those of
 * the published epoch (no epoch counts as an empty one). Sessions count,
 * because a member that restarted keeps its id and address but not its
 * session; versions are left out on purpose, since they alone never make
 * an epoch. */
static bool same_membership(const struct cohort *c)
{
    size_t n = c->cur ? c->cur->n_members : 0, k = 0;

    for (size_t i = 0; i < c->n_members; i++) {
        const struct entry *m = c->members[i];
        const struct epoch_member *p;

        if (m->draining)
            continue;
        if (k == n)
            return false;
        p = &c->cur->members[k];
        if (m->session != c->cur_sessions[k] || strcmp(m->id, p->id) != 0 ||
            strcmp(m->address, p->address) != 0)
            return false;
        k++;
    }
    return k == n;
}

/* Forms the epoch a pending cohort is due, or none when its changes
 * cancelled out. Returns 0 or -ENOMEM (the cohort stays pending and the
 * next tick tries again). */
static int cohort_form(const struct broker *b, struct cohort *c)
{
    size_t n = c->n_members, n_view = 0, n_watchers = 0, leader = elect(c->members, n);
    struct epoch_member *view;
    struct epoch *e;
    uint64_t *sessions;
    struct entry **entries;
    uint32_t *index = NULL;
    size_t mask = 0;
    void **watchers;
    int err = -ENOMEM;

    /* leader_dirty implies a published epoch: declares only compare
     * against one. Without a declare the leader is not compared, so that
     * undeclared versions never force an epoch on their own. */
    leader = leader < n ? epoch_index(c, leader) : 0;
    if (same_membership(c) && (!c->leader_dirty || c->cur->leader == leader)) {
        c->pending = false;
        c->leader_dirty = false;
        return 0;
    }
    /* `view` borrows the entries' strings; epoch_create() copies them. */
    view = calloc(n ? n : 1, sizeof *view);
    if (!view)
        return -ENOMEM;
    sessions = calloc(n ? n : 1, sizeof *sessions);
    if (!sessions)
        goto free_view;
    entries = calloc(n ? n : 1, sizeof *entries);
    if (!entries)
        goto free_sessions;
    watchers = calloc(n ? n : 1, sizeof *watchers);
    if (!watchers)
        goto free_entries;
    /* Draining members are left out of the epoch but still hear it: that
     * is how they learn to stop. */
    for (size_t i = 0; i < n; i++) {
        struct entry *m = c->members[i];

        if (m->watcher)
            watchers[n_watchers++] = m->watcher;
        if (m->draining)
            continue;
        view[n_view] = (struct epoch_member){
            .id = m->id, .address = m->address, .model_version = m->model_version,
        };
        entries[n_view] = m;
        sessions[n_view++] = m->session;
    }
    err = epoch_create(c->name, c->floor + 1, leader, view, n_view, &e);
    if (err)
        goto free_watchers;
    /* Without the index (out of memory) reports search instead. */
    (void)index_build(b->hash_seed, e, &index, &mask);
    for (size_t k = 0; k < n_view; k++)
        entries[k]->epoch_pos = k;

    epoch_unref(c->cur);
    free(c->cur_sessions);
    free(c->cur_entries);
    free(c->cur_index);
    c->cur = e;
    c->cur_sessions = sessions;
    c->cur_entries = entries;
    c->cur_index = index;
    c->cur_index_mask = mask;
    sessions = NULL;
    entries = NULL;
    c->floor = e->number;
    c->pending = false;
    c->leader_dirty = false;
    /* Published even with no watchers, so that the host sees (and logs)
     * every epoch in one place. */
    if (b->ops.publish)
        b->ops.publish(b->ops.arg, e, watchers, n_watchers);

free_watchers:
    free(watchers);
free_entries:
    free(entries);
free_sessions:
    free(sessions);
free_view:
    free(view);
    return err;
}

static bool verdicts_pending(const struct cohort *c, uint64_t now);

/* Evicts the members of `c` that are due at `now` and recomputes the
 * cohort's eviction bound. */
static void cohort_evict(struct broker *b, struct cohort *c, uint64_t now)
{
    uint64_t next = UINT64_MAX;
    size_t keep = 0;
    bool evicted = false, verdict = false;

    for (size_t i = 0; i < c->n_members; i++) {
        struct entry *m = c->members[i];
        uint64_t d = entry_deadline(b, m);

        if (now >= d) {
            if (m->cut_off_at) {
                bench_add(c, m, now);
                verdict = true;
            }
            detach(b, m, m->cut_off_at ? -EHOSTUNREACH : -ETIMEDOUT);
            retire(b, c, m, now, false);
            entry_forget(c, m);
            entry_free(m);
            evicted = true;
            continue;
        }
        next = min_u64(next, d);
        c->members[keep++] = m;
    }
    if (evicted && keep == 0 && c->n_members > 0)
        c->emptied = true;
    c->n_members = keep;
    c->next_evict = next;
    if (evicted)
        mark_pending(c, now);
    /* The reports about the rest of a cut-off side come a moment apart
     * (the engines look every 250 ms, and probe from 500 ms into a
     * call). An epoch formed at once would make them stale, and the
     * rest of that side would stall the next epoch's rounds for another
     * timeout before its members are reported again. */
    if (verdict && verdicts_pending(c, now))
        c->hold_until = max_u64(c->hold_until, now + BROKER_VERDICT_SETTLE_MS);
}

static uint64_t form_due(const struct broker *b, const struct cohort *c)
{
    return max_u64(max_u64(c->pending_since + b->cfg.coalesce_ms, b->hold_until), c->hold_until);
}

/* ---- the API ---- */

int broker_create(const struct broker_config *cfg, const struct broker_watch_ops *ops,
                  uint64_t now, struct broker **out)
{
    struct broker *b;

    if (!cfg || !out)
        return -EINVAL;
    if (cfg->heartbeat_ms == 0 || cfg->timeout_ms <= cfg->heartbeat_ms ||
        cfg->max_members == 0 || cfg->max_cohorts == 0)
        return -EINVAL;
    b = calloc(1, sizeof *b);
    if (!b)
        return -ENOMEM;
    b->cfg = *cfg;
    if (ops)
        b->ops = *ops;
    if (getrandom(&b->hash_seed, sizeof(b->hash_seed), 0) != sizeof(b->hash_seed))
        b->hash_seed = (uint64_t)(uintptr_t)b ^ now;
    b->hold_until = now + cfg->startup_hold_ms;
    *out = b;
    return 0;
}

void broker_destroy(struct broker *b)
{
    if (!b)
        return;
    for (size_t i = 0; i < b->n_cohorts; i++)
        cohort_free(b, b->cohorts[i], -ESHUTDOWN);
    free(b->cohorts);
    for (size_t k = 0; b->retired && k < BROKER_RETIRED_MAX; k++)
        retired_clear(&b->retired[k]);
    free(b->retired);
    free(b);
}

int broker_cohort_declare(struct broker *b, const char *name, uint32_t heartbeat_ms,
                          uint32_t timeout_ms)
{
    struct cohort *c;

    if (!ident_valid_cohort(name))
        return -EINVAL;
    if (!heartbeat_ms)
        heartbeat_ms = b->cfg.heartbeat_ms;
    if (!timeout_ms)
        timeout_ms = b->cfg.timeout_ms;
    if (timeout_ms <= heartbeat_ms)
        return -EINVAL;
    c = cohort_get(b, name);
    if (c) {
        c->heartbeat_ms = heartbeat_ms;
        c->timeout_ms = timeout_ms;
        return 0;
    }
    return cohort_add(b, name, heartbeat_ms, timeout_ms, NULL);
}

int broker_cohort_remove(struct broker *b, const char *name)
{
    bool found;
    size_t at;

    if (!name)
        return -ENOENT;
    at = cohort_find(b, name, &found);
    if (!found)
        return -ENOENT;
    cohort_drop(b, at, -ESHUTDOWN);
    return 0;
}

/* Adds a new member at index `at` of `c`. */
static int join_new(struct broker *b, struct cohort *c, size_t at, uint64_t now,
                    const struct broker_join *j, uint32_t heartbeat_ms, uint32_t timeout_ms)
{
    struct entry **arr, *m;

    if (c->n_members >= b->cfg.max_members)
        return -ENOSPC;
    arr = grow(c->members, &c->cap_members, c->n_members + 1, sizeof *arr);
    if (!arr)
        return -ENOMEM;
    c->members = arr;
    m = calloc(1, sizeof *m);
    if (!m)
        return -ENOMEM;
    m->id = strdup(j->id);
    m->address = strdup(j->address);
    if (!m->id || !m->address)
        goto free_member;
    m->session = j->session;
    m->model_version = j->model_version;
    m->last_seen = now;
    m->joined_at = now;
    m->heartbeat_ms = heartbeat_ms;
    m->timeout_ms = timeout_ms;
    seq_start(m, j->seq);
    if (j->seq)
        retired_forget(b, c->name, j->id, j->session, now);

    memmove(&arr[at + 1], &arr[at], (c->n_members - at) * sizeof *arr);
    arr[at] = m;
    c->n_members++;
    c->next_evict = min_u64(c->next_evict, entry_deadline(b, m));
    /* The first one back after everyone was evicted: the others are on
     * their way back too, however long they were away. */
    if (c->emptied) {
        c->emptied = false;
        c->hold_until = now + b->cfg.startup_hold_ms;
    }
    mark_pending(c, now);
    return 0;

free_member:
    entry_free(m);
    return -ENOMEM;
}

/* Refreshes member `m` (same session) or hands its id to a new session
 * once `m` has fallen silent. */
static int join_existing(struct broker *b, struct cohort *c, struct entry *m,
                         uint64_t now, const struct broker_join *j, uint32_t heartbeat_ms,
                         uint32_t timeout_ms)
{
    bool changed = false;

    if (m->session != j->session) {
        /* Checked against the clock, not against whether a tick has
         * evicted it yet, so that the answer does not depend on how
         * often the host ticks. */
        if (now < entry_deadline(b, m))
            return -EEXIST;
        changed = true;
    }
    if (strcmp(m->address, j->address) != 0) {
        char *address = strdup(j->address);

        if (!address)
            return -ENOMEM;
        free(m->address);
        m->address = address;
        changed = true;
    }
    if (m->session != j->session) {
        /* The old process is gone; its stream ends as an eviction would
         * have ended it, and its session retires as if evicted. */
        detach(b, m, -ETIMEDOUT);
        retire(b, c, m, now, false);
        m->session = j->session;
        m->joined_at = now;
        seq_start(m, j->seq);
        if (j->seq)
            retired_forget(b, c->name, j->id, j->session, now);
    } else if (j->seq) {
        seq_record(m, j->seq);
    }
    m->model_version = j->model_version;
    m->last_seen = max_u64(m->last_seen, now);
    entry_alive(m);
    m->heartbeat_ms = heartbeat_ms;
    m->timeout_ms = timeout_ms;
    /* A shorter timeout may bring the deadline earlier than the bound. */
    c->next_evict = min_u64(c->next_evict, entry_deadline(b, m));
    if (changed)
        mark_pending(c, now);
    return 0;
}

int broker_join(struct broker *b, uint64_t now, const struct broker_join *j,
                struct broker_join_result *res)
{
    struct cohort *c;
    uint32_t heartbeat_ms, timeout_ms, c_heartbeat, c_timeout;
    bool found, created = false;
    size_t at;
    int err;

    if (!j || !ident_valid_cohort(j->cohort) || !ident_valid_member_id(j->id) ||
        !ident_valid_address(j->address) || j->session == 0 || j->last_epoch > EPOCH_MAX)
        return -EINVAL;
    c = cohort_get(b, j->cohort);
    if (!c && !b->cfg.allow_any_cohort)
        return -ENOENT;
    c_heartbeat = c ? c->heartbeat_ms : b->cfg.heartbeat_ms;
    c_timeout = c ? c->timeout_ms : b->cfg.timeout_ms;
    /* A member may ask for timings of its own, within its cohort's
     * limits: a heartbeat no faster than the floor (or the cohort's own,
     * if faster), and however long a timeout it asks for, a member that
     * stops answering holds its cohort's rounds for at most the cohort's
     * timeout or max_timeout_ms, whichever is longer. The reply says
     * what was granted. */
    heartbeat_ms = j->heartbeat_ms ? max_u32(j->heartbeat_ms,
                                             min_u32(c_heartbeat, BROKER_HEARTBEAT_FLOOR_MS))
                                   : c_heartbeat;
    timeout_ms = j->timeout_ms ? j->timeout_ms : c_timeout;
    timeout_ms = min_u32(timeout_ms, max_u32(c_timeout, b->cfg.max_timeout_ms
                                                            ? b->cfg.max_timeout_ms
                                                            : BROKER_MEMBER_TIMEOUT_CAP_MS));
    if (timeout_ms <= heartbeat_ms)
        return -EINVAL;
    /* The replay rules, before anything changes. */
    if (j->seq) {
        struct entry *held = entry_get(c, j->id, 0);

        if (held && held->session == j->session ? !seq_fresh(held, j->seq)
                                                : retired_refuses(b, j, now))
            return -EALREADY;
    }
    /* A benched id comes back when its bench ends, whatever its session:
     * a new process on the same cut-off host is as cut off. */
    if (!entry_get(c, j->id, 0) && bench_left(c, j->id, now)) {
        if (res)
            res->benched_ms = bench_left(c, j->id, now);
        return -EAGAIN;
    }
    if (!c) {
        err = cohort_add(b, j->cohort, b->cfg.heartbeat_ms, b->cfg.timeout_ms, &c);
        if (err)
            return err;
        created = true;
    }

    at = entry_find(c, j->id, &found);
    if (found)
        err = join_existing(b, c, c->members[at], now, j, heartbeat_ms, timeout_ms);
    else
        err = join_new(b, c, at, now, j, heartbeat_ms, timeout_ms);
    if (err)
        goto drop_cohort;

    c->floor = max_u64(c->floor, j->last_epoch);
    if (res) {
        res->heartbeat_ms = heartbeat_ms;
        res->timeout_ms = timeout_ms;
        res->epoch = c->cur ? c->cur->number : 0;
    }
    return 0;

drop_cohort:
    if (created)
        cohort_drop(b, cohort_find(b, j->cohort, &found), -ESHUTDOWN);
    return err;
}

int broker_heartbeat(struct broker *b, uint64_t now, const char *cohort, const char *id,
                     uint64_t session, const struct broker_beat *beat,
                     struct broker_beat_result *res)
{
    struct cohort *c = cohort_get(b, cohort);
    struct entry *m;
    size_t best;

    if (!session || !beat)
        return -ENOENT;
    m = entry_get(c, id, session);
    if (!m)
        return -ENOENT;
    m->last_seen = max_u64(m->last_seen, now);
    entry_alive(m);
    m->model_version = beat->model_version;
    m->ckpt = beat->ckpt;
    /* No member runs in an epoch that was never published. */
    m->adopted = max_u64(m->adopted, min_u64(beat->adopted, c->cur ? c->cur->number : 0));
    /* Only a declare may move the leader. Already pending or already
     * dirty: the election at formation sees this version anyway. The
     * election walks every member, so only a declare pays for it. */
    best = beat->declare && c->cur && !c->leader_dirty ? elect(c->members, c->n_members)
                                                       : c->n_members;
    if (best < c->n_members) {
        const char *want = c->members[best]->id;
        const char *have = c->cur->n_members ? c->cur->members[c->cur->leader].id : NULL;

        if (!have || strcmp(want, have) != 0) {
            c->leader_dirty = true;
            mark_pending(c, now);
        }
    }
    if (res) {
        res->epoch = c->cur ? c->cur->number : 0;
        res->drained = m->draining && c->cur && epoch_find(c->cur, m->id) < 0;
        res->heartbeat_ms = m->heartbeat_ms;
        res->timeout_ms = m->timeout_ms;
    }
    return 0;
}

int broker_drain(struct broker *b, uint64_t now, const char *cohort, const char *id, bool drain)
{
    struct entry *m = entry_get(cohort_get(b, cohort), id, 0);

    if (!m)
        return -ENOENT;
    if (m->draining != drain) {
        m->draining = drain;
        mark_pending(cohort_get(b, cohort), now);
    }
    return 0;
}

int broker_drained(const struct broker *b, const char *cohort, const char *id)
{
    const struct cohort *c = cohort_get(b, cohort);
    const struct entry *m;

    if (!c)
        return -ENOENT;
    m = entry_get(c, id, 0);
    if (!m)
        return 1;
    /* Still pending: the epoch that leaves it out has not formed yet. */
    if (!m->draining || c->pending || !c->cur || epoch_find(c->cur, id) >= 0)
        return 0;
    for (size_t i = 0; i < c->n_members; i++)
        if (!c->members[i]->draining && c->members[i]->adopted < c->cur->number)
            return 0;
    return 1;
}

int broker_leave(struct broker *b, uint64_t now, const char *cohort, const char *id,
                 uint64_t session)
{
    struct cohort *c = cohort_get(b, cohort);
    struct entry *m;
    bool found;
    size_t at;

    if (!c || !id || !session)
        return -ENOENT;
    at = entry_find(c, id, &found);
    if (!found || c->members[at]->session != session)
        return -ENOENT;
    m = c->members[at];
    memmove(&c->members[at], &c->members[at + 1],
            (c->n_members - at - 1) * sizeof *c->members);
    c->n_members--;
    if (c->n_members == 0)
        c->next_evict = UINT64_MAX;
    detach(b, m, -ENOENT);
    retire(b, c, m, now, true);
    entry_forget(c, m);
    entry_free(m);
    mark_pending(c, now);
    return 0;
}

int broker_accept_seq(struct broker *b, const char *cohort, const char *id, uint64_t session,
                      uint64_t seq)
{
    struct entry *m;

    if (!session)
        return -ENOENT;
    m = entry_get(cohort_get(b, cohort), id, session);
    if (!m)
        return -ENOENT;
    if (!seq_fresh(m, seq))
        return -EALREADY;
    seq_record(m, seq);
    return 0;
}

int broker_watch(struct broker *b, const char *cohort, const char *id, uint64_t session,
                 void *watcher)
{
    struct cohort *c = cohort_get(b, cohort);
    struct entry *m;

    if (!session)
        return -ENOENT;
    m = entry_get(c, id, session);
    if (!m)
        return -ENOENT;
    if (!watcher)
        return -EINVAL;
    if (m->watcher != watcher)
        detach(b, m, -EEXIST);
    m->watcher = watcher;
    entry_alive(m);
    if (c->cur && b->ops.publish)
        b->ops.publish(b->ops.arg, c->cur, &watcher, 1);
    return 0;
}

void *broker_watcher(const struct broker *b, const char *cohort, const char *id,
                     uint64_t session)
{
    const struct entry *m;

    if (!session)
        return NULL;
    m = entry_get(cohort_get(b, cohort), id, session);
    return m ? m->watcher : NULL;
}

void broker_unwatch(struct broker *b, const char *cohort, const char *id, void *watcher)
{
    struct entry *m = entry_get(cohort_get(b, cohort), id, 0);

    if (m && watcher && m->watcher == watcher)
        m->watcher = NULL;
}

int broker_stream_lost(struct broker *b, uint64_t now, const char *cohort, const char *id,
                       void *watcher)
{
    struct cohort *c = cohort_get(b, cohort);
    struct entry *m = entry_get(c, id, 0);

    if (!m || !watcher || m->watcher != watcher)
        return -ENOENT;
    m->watcher = NULL;
    m->gone_at = now ? now : 1;
    /* The deadline moved earlier: the bound must follow. */
    c->next_evict = min_u64(c->next_evict, entry_deadline(b, m));
    return 0;
}

/* A report's two parties: the reporter, a member of this session
 * (*reporter, when asked for), and the accused, another member of the
 * cohort. */
static int report_parties(struct cohort *c, const char *id, uint64_t session, const char *peer,
                          struct entry **reporter, struct entry **accused)
{
    struct entry *r = session ? entry_get(c, id, session) : NULL;

    if (!r)
        return -ENOENT;
    if (reporter)
        *reporter = r;
    if (!peer || strcmp(peer, id) == 0)
        return -EINVAL;
    *accused = entry_get(c, peer, 0);
    return *accused ? 0 : -ENOENT;
}

/* Member m's position in c's current epoch, with its session, or -1.
 * Its last position is tried first (a session and a string compare), so
 * that the reports of a heartbeat, each of which names both parties,
 * cost two bisections of the members in all, not four. */
static long epoch_at(const struct cohort *c, struct entry *m)
{
    size_t p = m->epoch_pos;
    long f;

    if (p < c->cur->n_members && c->cur_sessions[p] == m->session &&
        strcmp(c->cur->members[p].id, m->id) == 0)
        return (long)p;
    f = epoch_find(c->cur, m->id);
    if (f < 0 || c->cur_sessions[f] != m->session)
        return -1;
    m->epoch_pos = (size_t)f;
    return f;
}

int broker_report_lost(struct broker *b, uint64_t now, const char *cohort, const char *id,
                       uint64_t session, const char *peer)
{
    struct cohort *c = cohort_get(b, cohort);
    struct entry *m;
    int rc = report_parties(c, id, session, peer, NULL, &m);

    if (rc < 0)
        return rc;
    if (!m->accused_at)
        m->accused_at = now ? now : 1;
    c->next_evict = min_u64(c->next_evict, entry_deadline(b, m));
    return 0;
}

/* How long reports about member m, in an epoch of n members, count
 * together: one member timeout for every round a member needs to probe
 * all the others (limit_reach_rounds, base/limits.h). A waiting member
 * probes limit_reach_probes(n) of the others per round, one round per
 * timeout, so a member that every other one cannot reach is reported by
 * each of them within that many timeouts; a shorter window would never
 * hold a majority of an epoch of more than about 2 x LIMIT_REACH_PROBES.
 * At most LIMIT_REACH_ROUNDS timeouts up to 16,385 members (40 s at the
 * default 5 s), which ends before the engine's silence timeout (60 s)
 * would make the reports stale. */
static uint64_t report_window(const struct entry *m, size_t n)
{
    return (uint64_t)limit_reach_rounds(n) * m->timeout_ms;
}

/* Whether m's count is live: of `epoch`, its window not yet over. */
static bool reports_live(const struct entry *m, uint64_t epoch, size_t n, uint64_t now)
{
    return m->accused_epoch == epoch && now < m->accused_first + report_window(m, n);
}

/* Whether the member at epoch position `pos` is among m's live accusers. */
static bool reported_by(const struct entry *m, uint64_t epoch, size_t n, uint64_t now,
                        size_t pos)
{
    return reports_live(m, epoch, n, now) && (m->accusers[pos / 64] >> (pos % 64) & 1u);
}

/* Records that the members at epoch positions lo < hi (entry `first` is
 * lo's) are seen to report each other at `now`. Returns since when the
 * pair has been mutual without a lapse longer than `window`, or `now`
 * when it is new, or when no slot is free (then it is not judged). Out
 * of memory likewise. */
static uint64_t pair_seen(struct entry *first, uint64_t epoch, size_t hi, uint64_t window,
                          uint64_t now)
{
    struct pair *p = NULL;

    if (!first->pairs) {
        first->pairs = calloc(PAIRS_MAX, sizeof(*first->pairs));
        if (!first->pairs)
            return now;
    }
    for (size_t i = 0; i < PAIRS_MAX; i++) {
        struct pair *q = &first->pairs[i];
        bool stale = q->epoch != epoch || now > q->last + window;

        if (q->epoch == epoch && q->peer == hi) {
            p = q;
            break;
        }
        if (!p && stale)
            p = q;              /* a free or stale slot, in case it is new */
    }
    if (!p)
        return now;
    if (p->epoch != epoch || p->peer != hi || now > p->last + window) {
        /* New, or back after a lapse longer than a window: flapping
         * starts the wait over. */
        *p = (struct pair){ .epoch = epoch, .peer = (uint32_t)hi, .since = now };
    }
    p->last = now;
    return p->since;
}

/* How many of the epoch report m: the larger of its live count and the
 * count of the window just before, so that the moment a window starts
 * over (with one report) does not make a member reported by many look
 * reported by one. */
static uint32_t reported_weight(const struct entry *m, uint64_t epoch, size_t n, uint64_t now)
{
    if (!reports_live(m, epoch, n, now))
        return 0;
    return m->n_accusers > m->prev_accusers ? m->n_accusers : m->prev_accusers;
}

/* Of a mutual pair, the one to evict (see broker.h), given how many of
 * the epoch report each: the one more report (a liar that cuts itself
 * from several peers, or a member cut from several, rather than each of
 * them); else the one that is not the epoch's leader; else the later
 * joiner; else the one placed later. */
static bool pair_loser_is_a(const struct epoch *e, const struct entry *a, size_t ai,
                            uint32_t a_count, const struct entry *b, size_t bi, uint32_t b_count)
{
    if (a_count != b_count)
        return a_count > b_count;
    if (ai == e->leader || bi == e->leader)
        return bi == e->leader;
    if (a->joined_at != b->joined_at)
        return a->joined_at > b->joined_at;
    return ai > bi;
}

/* Whether a member still in c is reported unreachable, in its live
 * window of the current epoch, by a member that is still in c too: the
 * reports of the members just evicted do not count, so that a single
 * cut-off member's verdict holds nothing up. One pass over the epoch for
 * who stays, then a word at a time: a verdict on a large side costs
 * (n / 64) words per member, not a lookup per report. Out of memory it
 * says no, and the epoch forms without waiting. */
static bool verdicts_pending(const struct cohort *c, uint64_t now)
{
    const struct epoch *e = c->cur;
    size_t words = e ? (e->n_members + 63) / 64 : 0;
    uint64_t *stays;
    bool pending = false;

    if (!words)
        return false;
    stays = calloc(words, sizeof(*stays));
    if (!stays)
        return false;
    /* The live entry of each position, with the session the epoch lists
     * (cur_entries: no search). */
    for (size_t k = 0; k < e->n_members; k++)
        if (c->cur_entries[k] && c->cur_entries[k]->session == c->cur_sessions[k])
            stays[k / 64] |= 1ull << (k % 64);
    for (size_t i = 0; i < c->n_members && !pending; i++) {
        const struct entry *m = c->members[i];

        if (m->cut_off_at || !reports_live(m, e->number, e->n_members, now))
            continue;
        for (size_t w = 0; w < words && !pending; w++)
            pending = (m->accusers[w] & stays[w]) != 0;
    }
    free(stays);
    return pending;
}

static void cut_off(const struct broker *b, struct cohort *c, struct entry *m, uint64_t now)
{
    if (m->cut_off_at)
        return;
    m->cut_off_at = now ? now : 1;
    c->next_evict = min_u64(c->next_evict, entry_deadline(b, m));
}

int broker_report_unreachable(struct broker *b, uint64_t now, const char *cohort, const char *id,
                              uint64_t session, uint64_t epoch, const char *peer)
{
    struct cohort *c = cohort_get(b, cohort);
    struct entry *m = NULL, *r = NULL;
    long ri = -1, mi = -1;
    size_t words, n, half;

    /* The common case without a search of the members: both parties
     * found by the epoch's index, each the live entry of its position
     * with the session the epoch lists. */
    if (c && c->cur && c->cur_entries && epoch == c->cur->number && session && id && peer &&
        strcmp(peer, id) != 0) {
        ri = cur_find(b, c, id);
        mi = cur_find(b, c, peer);
        r = ri >= 0 ? c->cur_entries[ri] : NULL;
        m = mi >= 0 ? c->cur_entries[mi] : NULL;
    }
    if (!r || !m || r->session != session || r->session != c->cur_sessions[ri] ||
        m->session != c->cur_sessions[mi]) {
        /* Anything else takes the searches, which say why it is refused. */
        int rc = report_parties(c, id, session, peer, &r, &m);

        if (rc < 0)
            return rc;
        if (!c->cur || epoch != c->cur->number)
            return -ESTALE;
        ri = epoch_at(c, r);
        mi = epoch_at(c, m);
        if (ri < 0 || mi < 0)
            return -ESTALE;
    }
    n = c->cur->n_members;
    half = n / 2;
    words = (n + 63) / 64;
    if (!reports_live(m, epoch, n, now)) {
        /* A new count: reports from another epoch, or older than the
         * window, do not add up with this one. The count of a window
         * that ended just now is kept for reported_weight(). */
        m->prev_accusers = m->accused_epoch == epoch &&
                                   now < m->accused_first + 2 * report_window(m, n)
                               ? m->n_accusers
                               : 0;
        if (m->accusers_words < words) {
            uint64_t *bits = reallocarray(m->accusers, words, sizeof(*bits));

            if (!bits)
                return -ENOMEM;
            m->accusers = bits;
            m->accusers_words = words;
        }
        memset(m->accusers, 0, words * sizeof(*m->accusers));
        m->accused_epoch = epoch;
        m->accused_first = now;
        m->n_accusers = 0;
    }
    if (!(m->accusers[ri / 64] >> (ri % 64) & 1u)) {
        m->accusers[ri / 64] |= 1ull << (ri % 64);
        m->n_accusers++;
    }
    /* More than half of the epoch, the accused counted in it. */
    if (m->n_accusers > half) {
        cut_off(b, c, m, now);
        return 0;
    }
    /* Exactly half of an even epoch of four or more, the leader among
     * them: of two equal halves, the leader's goes on. The leader's own
     * report only breaks a tie, so a lying leader still needs half the
     * epoch less one to agree. */
    if (n % 2 == 0 && n >= 4 && m->n_accusers == half &&
        (m->accusers[c->cur->leader / 64] >> (c->cur->leader % 64) & 1u)) {
        cut_off(b, c, m, now);
        return 0;
    }
    /* A cut between two members: each reports the other. Judged once it
     * has lasted a window, by which time any majority against either
     * would have formed; a report that one member alone makes of another
     * that still reaches it is never mutual, so it never evicts. */
    if (reported_by(r, epoch, n, now, (size_t)mi) && !r->cut_off_at && !m->cut_off_at) {
        size_t hi = (size_t)(ri < mi ? mi : ri);
        struct entry *first = ri < mi ? r : m;
        uint64_t window = max_u64(report_window(r, n), report_window(m, n));
        uint32_t mw = reported_weight(m, epoch, n, now), rw = reported_weight(r, epoch, n, now);

        /* Only a cut between two: at least one of them is reported by
         * its partner alone. Where both are reported by several, the
         * cut is wider (a partition, with reports still gathering) and
         * the rules above decide, or no one. */
        if (now - pair_seen(first, epoch, hi, window, now) >= window && (mw <= 1 || rw <= 1))
            cut_off(b, c, pair_loser_is_a(c->cur, m, (size_t)mi, mw, r, (size_t)ri, rw) ? m : r,
                    now);
    }
    return 0;
}

uint32_t broker_tick(struct broker *b, uint64_t now)
{
    uint64_t next = UINT64_MAX;

    retired_expire(b, now);
    for (size_t i = 0; i < b->n_cohorts; i++) {
        struct cohort *c = b->cohorts[i];

        if (now >= c->next_evict)
            cohort_evict(b, c, now);
        if (c->pending && now >= form_due(b, c))
            (void)cohort_form(b, c);
        if (c->pending)
            next = min_u64(next, form_due(b, c));
        next = min_u64(next, c->next_evict);
    }
    if (next <= now)
        return 1;
    return (uint32_t)min_u64(next - now, TICK_MAX_MS);
}

/* ---- status ---- */

static void cohort_status_cleanup(struct broker_cohort_status *cs)
{
    for (size_t i = 0; i < cs->n_members; i++) {
        free(cs->members[i].id);
        free(cs->members[i].address);
    }
    free(cs->members);
    free(cs->draining);
    free(cs->checkpoints);
    free(cs->leader);
    free(cs->name);
}

/* Fills *cs, which starts zeroed; on failure the caller cleans up. */
static int cohort_status_fill(const struct cohort *c, struct broker_cohort_status *cs)
{
    cs->name = strdup(c->name);
    if (!cs->name)
        return -ENOMEM;
    cs->epoch = c->cur ? c->cur->number : 0;
    if (c->cur && c->cur->n_members) {
        cs->leader = strdup(c->cur->members[c->cur->leader].id);
        if (!cs->leader)
            return -ENOMEM;
    }
    cs->heartbeat_ms = c->heartbeat_ms;
    cs->timeout_ms = c->timeout_ms;
    cs->members = calloc(c->n_members ? c->n_members : 1, sizeof *cs->members);
    cs->draining = calloc(c->n_members ? c->n_members : 1, sizeof *cs->draining);
    cs->checkpoints = calloc(c->n_members ? c->n_members : 1, sizeof *cs->checkpoints);
    if (!cs->members || !cs->draining || !cs->checkpoints)
        return -ENOMEM;
    for (size_t i = 0; i < c->n_members; i++) {
        const struct entry *m = c->members[i];

        cs->n_members++;
        cs->draining[i] = m->draining;
        cs->checkpoints[i] = m->ckpt;
        cs->members[i].model_version = m->model_version;
        cs->members[i].id = strdup(m->id);
        cs->members[i].address = strdup(m->address);
        if (!cs->members[i].id || !cs->members[i].address)
            return -ENOMEM;
    }
    return 0;
}

int broker_status(const struct broker *b, const char *cohort, struct broker_status **out)
{
    struct broker_status *s;
    size_t first = 0, n = b->n_cohorts;
    int err;

    if (cohort) {
        bool found;

        first = cohort_find(b, cohort, &found);
        if (!found)
            return -ENOENT;
        n = 1;
    }
    s = calloc(1, sizeof *s);
    if (!s)
        return -ENOMEM;
    s->cohorts = calloc(n ? n : 1, sizeof *s->cohorts);
    if (!s->cohorts) {
        err = -ENOMEM;
        goto free_status;
    }
    for (size_t i = 0; i < n; i++) {
        s->n_cohorts++;
        err = cohort_status_fill(b->cohorts[first + i], &s->cohorts[i]);
        if (err)
            goto free_status;
    }
    *out = s;
    return 0;

free_status:
    broker_status_free(s);
    return err;
}

void broker_status_free(struct broker_status *s)
{
    if (!s)
        return;
    for (size_t i = 0; i < s->n_cohorts; i++)
        cohort_status_cleanup(&s->cohorts[i]);
    free(s->cohorts);
    free(s);
}

int broker_member_address(const struct broker *b, const char *cohort, const char *id,
                          uint64_t session, char *address, size_t len)
{
    const struct entry *m;

    if (!session)
        return -ENOENT;
    m = entry_get(cohort_get(b, cohort), id, session);
    if (!m)
        return -ENOENT;
    if (strlen(m->address) >= len)
        return -ENOSPC;
    memcpy(address, m->address, strlen(m->address) + 1);
    return 0;
}

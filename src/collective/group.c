/* src/collective/group.c: see group.h.
 *
 * Why the calls are shaped as they are:
 *
 * Every attempt at a call reads a private copy of the caller's input
 * (`in`) and writes the engine's result into a scratch buffer (`out`);
 * only a completed attempt copies into the caller's buffer. The engine
 * runs out of place and never writes `in`, so a retry needs no second
 * copy, and an error leaves the caller's buffer as it was.
 *
 * Rounds. Members agree on the engine's round numbers without talking:
 * epoch << 32 | step, where step counts the all-reduces run in the epoch,
 * and every member runs the same ones (the sync below, then the calls).
 * A member whose attempt failed runs nothing more in that epoch: its
 * step count may no longer match the others'. It waits for a newer
 * epoch: the broker's (a peer died, or someone joined), or, when none
 * comes (a timeout or a mismatch that no membership change explains),
 * one it forces by rejoining, as the node does.
 *
 * Sync, at the first call in each epoch. The engine returns 0 only with
 * the whole result, the same on every member that returns it, but an
 * epoch change can reach members at different moments: some may finish
 * call k while the others' attempts fail. Retrying k on the new epoch at
 * those that failed would make two different results of one call. So the
 * members first agree on where they are:
 *   1. MAX of (calls done << 20 | (2^20 - 1 - rank)): the most calls any
 *      member has done (M) and the first member in order that has done
 *      them (the source). A member that never lined up (it just started,
 *      or joined late) contributes 0.
 *   2. MAX of (needs call M's result, source's length of it, the
 *      signature of the call each member is about to make and its
 *      negation): a member that has done M - 1 is in the middle of call
 *      M; the members about to make call M + 1 learn, all alike, whether
 *      their calls differ (then every one of them fails it with -EPROTO
 *      and they stay in step).
 *   3. If one does: the source's kept copy of call M's result (`last`)
 *      is broadcast as a SUM of 64-bit words in which only the source
 *      contributes non-zero words (x + 0 is x, whatever the bits). Those
 *      that need it return it as their call's result.
 * Members behind by more than one call (they were out of the cohort) and
 * new members take the others' numbering: their pending call becomes
 * call M + 1. That is the only way to line up a member whose program
 * missed calls; it is logged. A result delivered this way is the
 * reduction of the members of the epoch that completed it, exactly as the
 * others applied it.
 *
 * Memory: `in`, `out` and `last` each grow to the largest call, bounded by
 * max_bytes; `last` must survive a failed attempt of the next call (a
 * member may still need it), hence three buffers, not two.
 */
#include "collective/group.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "base/clock.h"
#include "base/limits.h"
#include "base/log.h"
#include "engine/allreduce.h"
#include "membership/epoch.h"
#include "membership/heartbeat.h"
#include "membership/member.h"

#define INDEX_BITS 20                   /* members per cohort < 2^20 */
#define INDEX_MASK ((1u << INDEX_BITS) - 1)
#define DEFAULT_REDUCE_TIMEOUT_MS 60000u
/* A peer's connection broke: the broker evicts a dead peer within the
 * member timeout; past this much more, the member forces a new epoch. */
#define RESYNC_SLACK_MS 2000u
/* Internal codes, which the caller sees as -EPROTO: a result the others
 * delivered does not fit this member's call, or the sync's words make no
 * sense (EMISFIT); the members' next calls differ (EDIFFER). */
#define GROUP_EMISFIT 4096
#define GROUP_EDIFFER 4097

enum kind { K_REDUCE, K_GATHER, K_STEPS };

struct buf {
    void *p;
    size_t cap;                 /* bytes, a multiple of 8 */
    int h;                      /* engine handle; -1 */
};

struct group {
    pthread_mutex_t lock;
    pthread_cond_t cond;        /* a new epoch */
    char *cohort, *id;
    char address[IDENT_ADDRESS_MAX + 1];
    int data_fd;
    size_t max_bytes;
    struct member *member;
    struct heartbeat *beat;
    struct allreduce *ar;
    struct epoch *latest;       /* under lock, from the watch */
    bool running;               /* under lock: a run is in the engine, or about to be */
    bool interrupted;           /* under lock: a newer epoch reached the engine during it */

    /* The caller's thread only. */
    struct epoch *cur;          /* the epoch calls run in */
    uint32_t step;
    long my_index;
    bool synced;                /* the sync ran in cur */
    bool failed;                /* an attempt failed in cur: wait for a newer */
    uint64_t failed_at;
    bool rejoined;              /* forced a new epoch for this failure */
    bool numbered;              /* lined up with the others' call numbers */
    uint64_t done;              /* calls completed */
    struct buf in, out, last;
    size_t last_len;            /* bytes of last's result; 0: none */
    int64_t small[4];
    int h_small;

    struct group_stats stats;   /* under lock */
};

/* ---- membership ---------------------------------------------------------- */

/* The engine follows the caller's thread, not the watch: it adopts an
 * epoch when the caller does (usable_epoch), so that every run happens in
 * the epoch whose member order and step count the caller used. A new
 * epoch reaches the engine here only to abort a run in flight, and that
 * run's outcome, even a success, is then taken as -ESTALE (run()). */
static void on_epoch(void *arg, struct epoch *e)
{
    struct group *g = arg;

    pthread_mutex_lock(&g->lock);
    epoch_unref(g->latest);
    g->latest = epoch_ref(e);
    if (g->running) {
        g->interrupted = true;
        allreduce_set_epoch(g->ar, e);
    }
    pthread_cond_broadcast(&g->cond);
    pthread_mutex_unlock(&g->lock);
}

static void on_peer_lost(void *arg, const char *peer)
{
    struct group *g = arg;

    (void)heartbeat_report_lost(g->beat, peer);
}

/* ---- buffers --------------------------------------------------------------- */

static size_t round8(size_t n)
{
    return (n + 7) & ~(size_t)7;
}

/* Grows b to hold `bytes` (keeping its contents) and registers it. */
static int buf_reserve(struct group *g, struct buf *b, size_t bytes)
{
    size_t cap = round8(bytes ? bytes : 8);
    void *p;
    int h;

    if (b->cap >= cap && b->h >= 0)
        return 0;
    if (b->h >= 0)
        allreduce_unregister(g->ar, b->h);
    b->h = -1;
    if (b->cap < cap) {
        p = realloc(b->p, cap);     /* malloc's alignment is at least 8 */
        if (!p)
            return -ENOMEM;
        memset((char *)p + b->cap, 0, cap - b->cap);
        b->p = p;
        b->cap = cap;
    }
    h = allreduce_register(g->ar, b->p, b->cap);
    if (h < 0)
        return h;
    b->h = h;
    return 0;
}

static void buf_free(struct group *g, struct buf *b)
{
    if (b->h >= 0)
        allreduce_unregister(g->ar, b->h);
    free(b->p);
    b->p = NULL;
    b->cap = 0;
    b->h = -1;
}

/* ---- epochs ------------------------------------------------------------------ */

static uint64_t round_of(struct group *g)
{
    return (g->cur->number << 32) | g->step++;
}

/* One engine run in cur (in == out: in place). A run that a newer epoch
 * may have touched reports -ESTALE even if it completed: whether it ran
 * in cur cannot be told, and a member that completed the call elsewhere
 * hands this one its result at the next sync, so nothing is lost. */
static int run(struct group *g, int in, int out, size_t count, enum dtype type, enum dtype_op op,
               double denominator)
{
    uint64_t round = round_of(g);
    bool interrupted;
    int rc;

    pthread_mutex_lock(&g->lock);
    if (g->latest->number > g->cur->number) {
        pthread_mutex_unlock(&g->lock);
        return -ESTALE;
    }
    g->running = true;
    g->interrupted = false;
    pthread_mutex_unlock(&g->lock);
    rc = allreduce_run_into(g->ar, in, out, count, type, op, denominator, round);
    pthread_mutex_lock(&g->lock);
    g->running = false;
    interrupted = g->interrupted;
    pthread_mutex_unlock(&g->lock);
    return rc == 0 && interrupted ? -ESTALE : rc;
}

/* An attempt failed in cur: wait for a newer epoch. A dead peer's
 * eviction is the broker's, within the member timeout; a timeout, a
 * mismatch or a refused greeting have no such cure coming, so the member
 * rejoins at once and the broker publishes one. */
static void attempt_failed(struct group *g, int rc)
{
    g->failed = true;
    g->failed_at = clock_now_ms();
    g->rejoined = false;
    if (rc == -ESTALE || rc == -ECONNRESET || rc == -EPIPE)
        return;
    log_warn("group", "A collective failed and no membership change explains it; forcing a new "
                      "epoch.", LF_S("cohort", g->cohort), LF_S("id", g->id),
             LF_ERR(rc == -GROUP_EMISFIT ? -EPROTO : rc));
    member_rejoin(g->member);
    g->rejoined = true;
}

/* Waits until there is an epoch to run in: one that lists this member and,
 * after a failure, newer than the one that failed. Adopts it. Returns 0
 * or -ETIMEDOUT at `deadline`. */
static int usable_epoch(struct group *g, uint64_t deadline)
{
    int rc = 0;

    pthread_mutex_lock(&g->lock);
    for (;;) {
        uint64_t now = clock_now_ms();
        struct epoch *e = g->latest;
        bool newer = e && (!g->cur || e->number > g->cur->number);
        struct timespec ts;

        if (e && epoch_find(e, g->id) >= 0 && (newer || (!g->failed && g->cur)))
            break;
        if (now >= deadline) {
            rc = -ETIMEDOUT;
            break;
        }
        if (g->failed && !g->rejoined &&
            now - g->failed_at > member_timeout_ms(g->member) + RESYNC_SLACK_MS) {
            log_warn("group", "A peer's connection broke and no new epoch followed; forcing one.",
                     LF_S("cohort", g->cohort), LF_S("id", g->id));
            member_rejoin(g->member);
            g->rejoined = true;
        }
        ts = clock_deadline(deadline - now < 50 ? (uint32_t)(deadline - now) : 50);
        pthread_cond_timedwait(&g->cond, &g->lock, &ts);
    }
    if (rc == 0 && (!g->cur || g->latest->number > g->cur->number)) {
        epoch_unref(g->cur);
        g->cur = epoch_ref(g->latest);
        g->step = 0;
        g->synced = false;
        g->failed = false;
        g->my_index = epoch_find(g->cur, g->id);
        g->stats.epochs++;
        /* Newer than the engine's, or the one on_epoch gave it already. */
        allreduce_set_epoch(g->ar, g->cur);
    }
    pthread_mutex_unlock(&g->lock);
    return rc;
}

/* ---- the sync (the top comment) ------------------------------------------- */

struct call {
    enum kind kind;
    size_t count;               /* elements (reduce) */
    enum dtype type;
    enum dtype_op op;
    double denominator;
    unsigned flags;
    size_t bytes;               /* of the input; K_STEPS: of the result */
    const struct group_steps *steps;    /* K_STEPS */
};

/* What members must agree on for one call, hashed (FNV-1a) into a
 * positive 62-bit word. */
static int64_t signature(const struct call *c)
{
    uint64_t v[6] = { c->kind, c->count, c->type, c->op, c->flags, c->bytes }, h = 14695981039346656037ull;

    for (size_t i = 0; i < 6; i++)
        for (int b = 0; b < 8; b++) {
            h ^= (v[i] >> (8 * b)) & 0xff;
            h *= 1099511628211ull;
        }
    return (int64_t)((h >> 2) | 1);
}


/* Runs the sync in cur. Sets *delivered when this member's pending call
 * was completed by the others: its result is then in out (out_len bytes).
 * Returns 0, -GROUP_EDIFFER (the members about to make the next call make
 * different ones: all of them see it, and all fail it), -GROUP_EMISFIT,
 * or an engine error. */
static int sync_epoch(struct group *g, const struct call *c, bool *delivered, size_t *out_len)
{
    uint64_t key, m, bytes;
    size_t source;
    bool need, i_need, differ;
    int rc;

    *delivered = false;
    key = g->numbered ? g->done : 0;
    g->small[0] = (int64_t)((key << INDEX_BITS) | (INDEX_MASK - (uint64_t)g->my_index));
    rc = run(g, g->h_small, g->h_small, 1, DTYPE_I64, DTYPE_MAX, 0);
    if (rc < 0)
        return rc;
    m = (uint64_t)g->small[0] >> INDEX_BITS;
    source = INDEX_MASK - ((uint64_t)g->small[0] & INDEX_MASK);
    if (source >= g->cur->n_members)
        return -GROUP_EMISFIT;
    i_need = g->numbered && m > 0 && g->done == m - 1;
    g->small[0] = i_need;
    g->small[1] = (long)source == g->my_index ? (int64_t)g->last_len : 0;
    /* The call's signature and its negation: MAX of both is the largest
     * and minus the smallest, which differ when the calls do. A member
     * that needs call M's result is not making call M + 1: neutral. */
    g->small[2] = i_need ? 0 : signature(c);
    g->small[3] = i_need ? INT64_MIN : -signature(c);
    rc = run(g, g->h_small, g->h_small, 4, DTYPE_I64, DTYPE_MAX, 0);
    if (rc < 0)
        return rc;
    need = g->small[0] != 0;
    bytes = (uint64_t)g->small[1];
    differ = g->small[2] != 0 && g->small[2] != -g->small[3];
    if (need) {
        size_t words;

        /* A length from the wire: checked before anything is sized by it. */
        if (bytes == 0 || bytes > g->max_bytes)
            return -GROUP_EMISFIT;
        words = round8((size_t)bytes) / 8;
        rc = buf_reserve(g, &g->out, (size_t)bytes);
        if (rc < 0)
            return rc;
        if ((long)source == g->my_index) {
            rc = run(g, g->last.h, g->out.h, words, DTYPE_I64, DTYPE_SUM, 0);
        } else {
            memset(g->out.p, 0, words * 8);
            rc = run(g, g->out.h, g->out.h, words, DTYPE_I64, DTYPE_SUM, 0);
        }
        if (rc < 0)
            return rc;
    }
    g->synced = true;
    log_info("group", "Synced the calls in a new epoch.", LF_S("cohort", g->cohort),
             LF_S("id", g->id), LF_U("epoch", g->cur->number), LF_U("members", g->cur->n_members),
             LF_U("calls_done", m), LF_B("delivered", need));
    if (i_need) {
        /* The others completed this call: its result is theirs. */
        if ((c->kind != K_GATHER && bytes != c->bytes) ||
            (c->kind == K_GATHER && (bytes % group_record_bytes(c->bytes)) != 0)) {
            g->done = m;
            g->numbered = true;
            return -GROUP_EMISFIT;
        }
        *delivered = true;
        *out_len = (size_t)bytes;
    } else if (!g->numbered || g->done + 1 < m) {
        if (g->numbered)
            log_warn("group", "This member missed collectives while out of the cohort; its next "
                              "call lines up with the others'.", LF_S("cohort", g->cohort),
                     LF_S("id", g->id), LF_U("done", g->done), LF_U("others_done", m));
        pthread_mutex_lock(&g->lock);
        g->stats.lined_up++;
        pthread_mutex_unlock(&g->lock);
        g->done = m;
    }
    g->numbered = true;
    return differ ? -GROUP_EDIFFER : 0;
}

/* ---- one attempt ------------------------------------------------------------- */

/* One attempt in cur; the result lands in out, *len bytes. */
static int attempt(struct group *g, const struct call *c, size_t *len)
{
    size_t n = g->cur->n_members;
    int rc;

    if (c->kind == K_STEPS) {
        *len = c->bytes;
        return c->steps->attempt(c->steps->arg, g, g->cur->number, g->out.p);
    }
    if (c->kind == K_GATHER) {
        size_t rec = group_record_bytes(c->bytes);
        char *slot;

        if (n > g->max_bytes / rec)
            return -E2BIG;
        rc = buf_reserve(g, &g->out, n * rec);
        if (rc < 0)
            return rc;
        memset(g->out.p, 0, n * rec);
        slot = (char *)g->out.p + (size_t)g->my_index * rec;
        snprintf(slot, GROUP_ID_BYTES, "%s", g->id);
        memcpy(slot + GROUP_ID_BYTES, g->in.p, c->bytes);
        *len = n * rec;
        return run(g, g->out.h, g->out.h, n * rec / 8, DTYPE_I64, DTYPE_SUM, 0);
    }
    *len = c->bytes;
    if (c->flags & GROUP_DIVIDE_BEFORE) {
        double d = c->op == DTYPE_AVG ? (double)n : c->denominator;

        memcpy(g->out.p, g->in.p, c->bytes);
        dtype_scale(c->type, g->out.p, c->count, d);
        return run(g, g->out.h, g->out.h, c->count, c->type, DTYPE_SUM, 0);
    }
    return run(g, g->in.h, g->out.h, c->count, c->type, c->op, c->denominator);
}

/* Runs a call to completion: sync where due, attempts, retries. The input
 * is in `in`; on 0 the result is in `last` (last_len bytes).
 *
 * A frame that does not match the call (-EPROTO from the engine) is not
 * taken as the members' programs differing: an epoch can reach the engine
 * a moment before this thread adopts it, and an attempt started in that
 * moment carries the old epoch's round. It fails the epoch like any
 * other error; the next epoch's sync compares the calls themselves, and
 * every member learns there, alike, whether they differ. */
static int run_attempts(struct group *g, const struct call *c, uint64_t deadline)
{
    int rc;

    rc = buf_reserve(g, &g->out, c->bytes);
    if (rc < 0)
        return rc;
    for (;;) {
        bool delivered = false;
        size_t len = 0;
        struct buf t;

        rc = usable_epoch(g, deadline);
        if (rc < 0)
            return rc;
        if (!g->synced)
            rc = sync_epoch(g, c, &delivered, &len);
        if (rc == 0 && !delivered)
            rc = attempt(g, c, &len);
        if (rc == 0) {
            /* The result becomes `last`, kept for a member that still
             * needs it in the next epoch. */
            t = g->last;
            g->last = g->out;
            g->out = t;
            g->last_len = len;
            g->done++;
            pthread_mutex_lock(&g->lock);
            g->stats.calls++;
            g->stats.delivered += delivered;
            g->stats.epoch = g->cur->number;
            g->stats.members = (uint32_t)g->cur->n_members;
            pthread_mutex_unlock(&g->lock);
            return 0;
        }
        if ((rc == -GROUP_EMISFIT || rc == -GROUP_EDIFFER) && g->synced) {
            /* In step with the others, who fail it too: nothing to mend. */
            if (rc == -GROUP_EDIFFER)
                log_error("group", "Members make different collectives (size, type or "
                                   "operator): their programs differ.", LF_S("cohort", g->cohort),
                          LF_S("id", g->id), LF_U("call", g->done + 1), LF_U("count", c->count),
                          LF_S("type", dtype_name(c->type)), LF_U("bytes", c->bytes));
            return -EPROTO;
        }
        log_debug("group", "A collective's attempt failed.", LF_S("cohort", g->cohort),
                  LF_S("id", g->id), LF_U("epoch", g->cur->number), LF_U("call", g->done + 1),
                  LF_ERR(rc == -GROUP_EMISFIT ? -EPROTO : rc));
        attempt_failed(g, rc);
        if (rc == -GROUP_EMISFIT)
            return -EPROTO;
        if (rc == -EACCES || rc == -EINVAL || rc == -E2BIG || rc == -ENOMEM)
            return rc;
        pthread_mutex_lock(&g->lock);
        g->stats.retries++;
        pthread_mutex_unlock(&g->lock);
    }
}

/* run_attempts under the call's deadline, which bounds every engine wait
 * too: an attempt the engine alone would bound only by the member timeout
 * (60 s by default; a peer that refuses our greeting, say) ends with the
 * call. */
static int run_call(struct group *g, const struct call *c, uint32_t timeout_ms)
{
    uint64_t deadline = clock_now_ms() + (timeout_ms ? timeout_ms : GROUP_DEFAULT_CALL_TIMEOUT_MS);
    int rc;

    allreduce_set_call_deadline(g->ar, deadline);
    rc = run_attempts(g, c, deadline);
    allreduce_set_call_deadline(g->ar, 0);
    return rc;
}

/* ---- API ------------------------------------------------------------------------ */

const char *group_id(const struct group *g)
{
    return g->id;
}

size_t group_record_bytes(size_t bytes)
{
    return GROUP_ID_BYTES + round8(bytes);
}

int group_allreduce(struct group *g, void *buf, size_t count, enum dtype type, enum dtype_op op,
                    double denominator, unsigned flags, uint32_t timeout_ms)
{
    struct call c = { .kind = K_REDUCE, .count = count, .type = type, .op = op,
                      .denominator = denominator, .flags = flags };
    double divisor;
    int rc;

    if (!g || (!buf && count) || !dtype_valid((int)type) || !dtype_op_valid((int)op) ||
        (flags & ~GROUP_DIVIDE_BEFORE) ||
        dtype_divisor(type, op, 1, denominator, &divisor) < 0)
        return -EINVAL;
    /* Dividing first is a float's business: an integer would truncate
     * every member's share. */
    if ((flags & GROUP_DIVIDE_BEFORE) &&
        ((type != DTYPE_F32 && type != DTYPE_F64) || (op != DTYPE_AVG && op != DTYPE_AVG_BY)))
        return -EINVAL;
    if (count > g->max_bytes / dtype_size(type))
        return -E2BIG;
    c.bytes = count * dtype_size(type);
    if (c.bytes == 0)
        return 0;
    rc = buf_reserve(g, &g->in, c.bytes);
    if (rc < 0)
        return rc;
    memcpy(g->in.p, buf, c.bytes);
    rc = run_call(g, &c, timeout_ms);
    if (rc == 0)
        memcpy(buf, g->last.p, c.bytes);
    return rc;
}

int group_allgather(struct group *g, const void *in, size_t bytes, const void **out,
                    size_t *out_len, uint32_t timeout_ms)
{
    struct call c = { .kind = K_GATHER, .bytes = bytes };
    int rc;

    if (!g || (!in && bytes) || !out || !out_len)
        return -EINVAL;
    if (bytes > g->max_bytes - GROUP_ID_BYTES - 8)
        return -E2BIG;
    rc = buf_reserve(g, &g->in, bytes);
    if (rc < 0)
        return rc;
    if (bytes)
        memcpy(g->in.p, in, bytes);
    rc = run_call(g, &c, timeout_ms);
    if (rc == 0) {
        *out = g->last.p;
        *out_len = g->last_len;
    }
    return rc;
}

int group_steps(struct group *g, const struct group_steps *s, const void **out,
                uint32_t timeout_ms)
{
    struct call c = { .kind = K_STEPS, .count = s ? s->tag : 0, .steps = s };
    int rc;

    if (!g || !s || !s->attempt || !out || s->out_bytes == 0)
        return -EINVAL;
    if (s->out_bytes > g->max_bytes)
        return -E2BIG;
    c.bytes = s->out_bytes;
    rc = run_call(g, &c, timeout_ms);
    if (rc == 0)
        *out = g->last.p;
    return rc;
}

int group_step_allreduce(struct group *g, int handle, size_t count, enum dtype type,
                         enum dtype_op op)
{
    return run(g, handle, handle, count, type, op, 0);
}

int group_register(struct group *g, void *p, size_t bytes)
{
    return allreduce_register(g->ar, p, bytes);
}

void group_unregister(struct group *g, int handle)
{
    if (handle >= 0)
        allreduce_unregister(g->ar, handle);
}

int group_wait(struct group *g, uint32_t timeout_ms)
{
    uint64_t deadline = clock_now_ms() + timeout_ms;
    int rc = 0;

    pthread_mutex_lock(&g->lock);
    while (!g->latest || epoch_find(g->latest, g->id) < 0) {
        uint64_t now = clock_now_ms();
        struct timespec ts;

        if (now >= deadline) {
            rc = -ETIMEDOUT;
            break;
        }
        ts = clock_deadline(deadline - now < 50 ? (uint32_t)(deadline - now) : 50);
        pthread_cond_timedwait(&g->cond, &g->lock, &ts);
    }
    pthread_mutex_unlock(&g->lock);
    return rc;
}

int group_position(struct group *g, uint32_t *rank, uint32_t *size, uint64_t *epoch)
{
    long i;
    int rc = -ENOTCONN;

    pthread_mutex_lock(&g->lock);
    i = g->latest ? epoch_find(g->latest, g->id) : -1;
    if (i >= 0) {
        if (rank)
            *rank = (uint32_t)i;
        if (size)
            *size = (uint32_t)g->latest->n_members;
        if (epoch)
            *epoch = g->latest->number;
        rc = 0;
    }
    pthread_mutex_unlock(&g->lock);
    return rc;
}

int group_member_id(struct group *g, uint32_t rank, char *id, size_t len)
{
    int rc = 0;

    pthread_mutex_lock(&g->lock);
    if (!g->latest)
        rc = -ENOTCONN;
    else if (rank >= g->latest->n_members)
        rc = -ERANGE;
    else
        snprintf(id, len, "%s", g->latest->members[rank].id);
    pthread_mutex_unlock(&g->lock);
    return rc;
}

void group_stats(struct group *g, struct group_stats *out)
{
    pthread_mutex_lock(&g->lock);
    *out = g->stats;
    pthread_mutex_unlock(&g->lock);
}

int group_create(const struct group_config *cfg, struct group **out)
{
    struct member_config mc = { 0 };
    struct allreduce_config ac = { 0 };
    struct group *g;
    int rc;

    if (!cfg || !cfg->broker || !ident_valid_cohort(cfg->cohort) ||
        !ident_valid_member_id(cfg->id) || !cfg->host ||
        (cfg->max_bytes && cfg->max_bytes < 4096))
        return -EINVAL;
    g = calloc(1, sizeof(*g));
    if (!g)
        return -ENOMEM;
    g->data_fd = -1;
    g->in.h = g->out.h = g->last.h = g->h_small = -1;
    g->max_bytes = cfg->max_bytes ? cfg->max_bytes : GROUP_DEFAULT_MAX_BYTES;
    pthread_mutex_init(&g->lock, NULL);
    clock_cond_init(&g->cond);
    g->cohort = strdup(cfg->cohort);
    g->id = strdup(cfg->id);
    if (!g->cohort || !g->id) {
        rc = -ENOMEM;
        goto err;
    }
    rc = allreduce_listen(cfg->host, &g->data_fd, g->address, sizeof(g->address));
    if (rc < 0)
        goto err;
    ac.cohort = g->cohort;
    ac.member_id = g->id;
    ac.listen_fd = g->data_fd;
    ac.member_timeout_ms = cfg->reduce_timeout_ms ? cfg->reduce_timeout_ms
                                                  : DEFAULT_REDUCE_TIMEOUT_MS;
    ac.key = cfg->key;
    ac.integrity_mac = cfg->integrity_mac;
    ac.on_peer_lost = on_peer_lost;
    ac.peer_lost_arg = g;
    rc = allreduce_create(&ac, &g->ar);
    if (rc < 0)
        goto err;
    g->h_small = allreduce_register(g->ar, g->small, sizeof(g->small));
    if (g->h_small < 0) {
        rc = g->h_small;
        goto err;
    }
    mc.broker = cfg->broker;
    mc.cohort = cfg->cohort;
    mc.id = cfg->id;
    mc.address = g->address;
    mc.heartbeat_ms = cfg->heartbeat_ms;
    mc.timeout_ms = cfg->timeout_ms;
    mc.key = cfg->key;
    mc.tls_ca_pem = cfg->tls_ca_pem;
    mc.tls_server_name = cfg->tls_server_name;
    mc.on_epoch = on_epoch;
    mc.arg = g;
    rc = member_create(&mc, &g->member);
    if (rc < 0)
        goto err;
    /* Heartbeats go on while the caller's thread waits in a call. */
    rc = heartbeat_create(g->member, NULL, NULL, &g->beat);
    if (rc < 0)
        goto err;
    *out = g;
    return 0;
err:
    member_destroy(g->member);
    allreduce_destroy(g->ar);
    if (g->data_fd >= 0)
        close(g->data_fd);
    free(g->cohort);
    free(g->id);
    pthread_cond_destroy(&g->cond);
    pthread_mutex_destroy(&g->lock);
    free(g);
    return rc;
}

void group_destroy(struct group *g)
{
    if (!g)
        return;
    heartbeat_destroy(g->beat);
    /* Leaving publishes a new epoch to the others at once, rather than
     * after the member timeout. */
    member_leave(g->member, LIMIT_LEAVE_TIMEOUT_MS);
    member_destroy(g->member);
    buf_free(g, &g->in);
    buf_free(g, &g->out);
    buf_free(g, &g->last);
    allreduce_destroy(g->ar);
    close(g->data_fd);
    epoch_unref(g->latest);
    epoch_unref(g->cur);
    free(g->cohort);
    free(g->id);
    pthread_cond_destroy(&g->cond);
    pthread_mutex_destroy(&g->lock);
    free(g);
}

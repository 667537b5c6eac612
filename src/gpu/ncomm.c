/* src/gpu/ncomm.c: see ncomm.h. */
#include "gpu/ncomm.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "base/clock.h"
#include "base/log.h"

/* Between two polls of a starting communicator. */
#define POLL_SLEEP_MS 1

static int bounded_abort(struct ncomm *c, void *comm, uint32_t deadline_ms);

struct ncomm {
    const struct ncomm_ops *ops;        /* borrowed */
    enum ncomm_state state;
    void *comm;                         /* ncclComm_t, when state != NONE */
    void *parent;                       /* what a shrink started from, until ready */
    uint64_t epoch;
    char **members;                     /* the communicator's, copied */
    size_t n;
    int rank;
    bool busy;
    unsigned leaked;
};

int ncomm_create(const struct ncomm_ops *ops, struct ncomm **out)
{
    struct ncomm *c = calloc(1, sizeof(*c));

    if (!c)
        return -ENOMEM;
    c->ops = ops;
    c->rank = -1;
    *out = c;
    return 0;
}

static void forget_members(struct ncomm *c)
{
    for (size_t i = 0; i < c->n; i++)
        free(c->members[i]);
    free(c->members);
    c->members = NULL;
    c->n = 0;
    c->rank = -1;
}

static void clear(struct ncomm *c)
{
    c->state = NCOMM_NONE;
    c->comm = NULL;
    c->parent = NULL;
    c->busy = false;
    forget_members(c);
}

void ncomm_destroy(struct ncomm *c)
{
    if (!c)
        return;
    ncomm_abort(c, NCOMM_ABORT_MS);
    free(c);
}

static int index_of(const char *const *members, size_t n, const char *id)
{
    for (size_t i = 0; i < n; i++)
        if (strcmp(members[i], id) == 0)
            return (int)i;
    return -1;
}

bool ncomm_can_shrink(const struct ncomm *c, const char *const *members, size_t n)
{
    size_t j = 0;

    if (!c->ops->shrink || c->state != NCOMM_READY || n == 0 || n >= c->n)
        return false;
    /* The new list must be the old one with some members taken out, in
     * the same order: NCCL keeps the survivors' relative order. */
    for (size_t i = 0; i < c->n && j < n; i++)
        if (strcmp(c->members[i], members[j]) == 0)
            j++;
    return j == n && index_of(members, n, c->members[c->rank]) >= 0;
}

/* The rebuild's sum: the first member (me == 0) makes the unique id and
 * gives it, the others give zeros. Every member takes part whatever it
 * voted, so the epoch's all-reduces stay in step. */
static int exchange_id(struct ncomm *c, int me, const struct ncomm_channel *ch,
                       struct ncomm_plan *plan)
{
    uint64_t x[NCOMM_XCHG_WORDS] = { 0 };
    struct ncomm_id id;
    int rc;

    if (me == 0) {
        rc = c->ops->get_unique_id(c->ops->arg, &id);
        if (rc < 0) {
            log_warn("gpu", "NCCL could not make a unique id; this epoch gets no communicator.",
                     LF_ERR(rc));
            /* Still take part, contributing nothing: the others see no
             * giver and refuse the result as this member does. */
        } else {
            x[0] = 1;
            memcpy(&x[1], id.b, NCOMM_ID_BYTES);
        }
    }
    rc = ch->sum_u64(ch->arg, x, NCOMM_XCHG_WORDS);
    if (rc < 0)
        return rc;
    if (x[0] != 1)
        return -EPROTO;
    *plan = (struct ncomm_plan){ .shrink = false };
    memcpy(plan->id.b, &x[1], NCOMM_ID_BYTES);
    return 0;
}

int ncomm_agree(struct ncomm *c, const char *const *members, size_t n, const char *self,
                const struct ncomm_channel *ch, struct ncomm_plan *plan)
{
    uint64_t mine, vote;
    int me, rc;

    if (n == 0 || n > NCOMM_MEMBERS_MAX)
        return -EINVAL;
    me = index_of(members, n, self);
    if (me < 0)
        return -EINVAL;
    mine = vote = ncomm_can_shrink(c, members, n) ? 1 : 0;
    rc = ch->sum_u64(ch->arg, &vote, 1);
    if (rc < 0)
        return rc;
    /* More votes than members, or all of them without this one's. */
    if (vote > n || (vote == n && !mine))
        return -EPROTO;
    if (vote == n) {
        *plan = (struct ncomm_plan){ .shrink = true };
        return 0;
    }
    return exchange_id(c, me, ch, plan);
}

static int copy_members(struct ncomm *c, const char *const *members, size_t n, const char *self)
{
    c->members = calloc(n, sizeof(*c->members));
    if (!c->members)
        return -ENOMEM;
    for (size_t i = 0; i < n; i++) {
        c->members[i] = strdup(members[i]);
        if (!c->members[i]) {
            c->n = i;
            forget_members(c);
            return -ENOMEM;
        }
    }
    c->n = n;
    c->rank = index_of(members, n, self);
    return 0;
}

/* The ranks of the old communicator that are not in `members`. */
static int excluded(const struct ncomm *c, const char *const *members, size_t n, int *out)
{
    int k = 0;

    for (size_t i = 0; i < c->n; i++)
        if (index_of(members, n, c->members[i]) < 0)
            out[k++] = (int)i;
    return k;
}

static int do_shrink(struct ncomm *c, const char *const *members, size_t n, const char *self)
{
    void *parent = c->comm, *child = NULL;
    int *ex, nex, rc;

    if (!ncomm_can_shrink(c, members, n))
        return -EINVAL;
    ex = calloc(c->n, sizeof(*ex));
    if (!ex)
        return -ENOMEM;
    nex = excluded(c, members, n, ex);
    rc = c->ops->shrink(c->ops->arg, parent, ex, nex, &child, c->busy);
    free(ex);
    if (rc < 0 && rc != -EINPROGRESS) {
        log_warn("gpu", "NCCL could not shrink the communicator; it is aborted, and the epoch rebuilds one.",
                 LF_ERR(rc));
        ncomm_abort(c, NCOMM_ABORT_MS);
        return rc;
    }
    /* The parent is spent, but a child still starting may use it: it is
     * freed once the child is ready (ncomm_wait) or given up. */
    forget_members(c);
    c->parent = parent;
    c->comm = child;
    c->state = NCOMM_STARTING;
    rc = copy_members(c, members, n, self);
    if (rc < 0) {
        ncomm_abort(c, NCOMM_ABORT_MS);
        return rc;
    }
    return 0;
}

int ncomm_start(struct ncomm *c, uint64_t epoch, const char *const *members, size_t n,
                const char *self, const struct ncomm_plan *plan)
{
    void *comm = NULL;
    int rank, rc;

    if (n == 0 || n > NCOMM_MEMBERS_MAX)
        return -EINVAL;
    rank = index_of(members, n, self);
    if (rank < 0)
        return -EINVAL;
    if (plan->shrink) {
        rc = do_shrink(c, members, n, self);
        if (rc == 0)
            c->epoch = epoch;
        return rc;
    }
    /* A rebuild: the old communicator goes first, so no rank of it waits
     * on this one while the new one is made. */
    ncomm_abort(c, NCOMM_ABORT_MS);
    rc = c->ops->init_rank(c->ops->arg, &comm, (int)n, &plan->id, rank);
    if (rc < 0 && rc != -EINPROGRESS) {
        log_warn("gpu", "NCCL could not create the epoch's communicator.", LF_ERR(rc),
                 LF_U("epoch", epoch));
        /* NCCL may have made the handle before it failed. */
        if (comm)
            bounded_abort(c, comm, NCOMM_ABORT_MS);
        return rc;
    }
    c->comm = comm;
    c->state = rc == 0 ? NCOMM_READY : NCOMM_STARTING;
    c->epoch = epoch;
    rc = copy_members(c, members, n, self);
    if (rc < 0) {
        ncomm_abort(c, NCOMM_ABORT_MS);
        return rc;
    }
    return 0;
}

int ncomm_wait(struct ncomm *c, uint32_t deadline_ms, const struct ncomm_cancel *cancel)
{
    uint64_t until = clock_now_ms() + deadline_ms;
    int rc;

    if (c->state == NCOMM_NONE)
        return -ENOTCONN;
    while (c->state == NCOMM_STARTING) {
        rc = c->ops->async_error(c->ops->arg, c->comm);
        if (rc == 0) {
            c->state = NCOMM_READY;
            if (c->parent) {
                bounded_abort(c, c->parent, NCOMM_ABORT_MS);
                c->parent = NULL;
            }
            break;
        }
        if (rc != -EINPROGRESS) {
            log_warn("gpu", "The epoch's NCCL communicator failed while it was made.", LF_ERR(rc),
                     LF_U("epoch", c->epoch));
            ncomm_abort(c, NCOMM_ABORT_MS);
            return rc;
        }
        if (cancel && cancel->stale(cancel->arg)) {
            log_info("gpu", "A newer epoch arrived while the communicator was made; it is aborted.",
                     LF_U("epoch", c->epoch));
            ncomm_abort(c, NCOMM_ABORT_MS);
            return -ESTALE;
        }
        if (clock_now_ms() >= until) {
            log_warn("gpu", "The epoch's NCCL communicator was not ready by its deadline; it is aborted.",
                     LF_U("epoch", c->epoch), LF_U("deadline_ms", deadline_ms));
            ncomm_abort(c, NCOMM_ABORT_MS);
            return -ETIMEDOUT;
        }
        clock_sleep_ms(POLL_SLEEP_MS);
    }
    return 0;
}

/* One word summed over `ch`: how many members' shrink or start failed.
 * Returns the count, or the channel's -errno, or -EPROTO for a count no
 * honest set of members gives. */
static int64_t failures(const struct ncomm_channel *ch, size_t n, bool failed)
{
    uint64_t w = failed ? 1 : 0;
    int rc = ch->sum_u64(ch->arg, &w, 1);

    if (rc < 0)
        return rc;
    if (w > n || (failed && w == 0))
        return -EPROTO;
    return (int64_t)w;
}

int ncomm_setup(struct ncomm *c, uint64_t epoch, const char *const *members, size_t n,
                const char *self, const struct ncomm_channel *ch, uint32_t deadline_ms,
                const struct ncomm_cancel *cancel, bool *shrunk)
{
    struct ncomm_plan plan;
    int64_t failed;
    bool stale = false;
    int rc;

    *shrunk = false;
    rc = ncomm_agree(c, members, n, self, ch, &plan);
    if (rc < 0)
        return rc;
    if (plan.shrink) {
        /* Every member learns whether every shrink was started, and then
         * whether every child became ready: a shrink is collective among
         * the survivors, so one that failed anywhere holds the others up
         * until their deadline, and the epoch would go without NCCL. */
        rc = ncomm_start(c, epoch, members, n, self, &plan);
        failed = failures(ch, n, rc < 0);
        if (failed == 0) {
            rc = ncomm_wait(c, deadline_ms, cancel);
            stale = rc == -ESTALE;
            failed = failures(ch, n, rc < 0);
            if (failed == 0) {
                *shrunk = true;
                return 0;
            }
        }
        if (failed < 0) {
            ncomm_abort(c, NCOMM_ABORT_MS);
            return (int)failed;
        }
        log_warn("gpu", "Shrinking the NCCL communicator failed; every member rebuilds it.",
                 LF_U("epoch", epoch), LF_U("members_failed", (uint64_t)failed));
        ncomm_abort(c, NCOMM_ABORT_MS);
        /* Every member is without a communicator now, so this is the
         * rebuild's sum on all of them alike. */
        rc = exchange_id(c, index_of(members, n, self), ch, &plan);
        if (rc < 0)
            return rc;
        /* This member's rank never joins: the others' wait ends at the
         * newer epoch, as on any rebuild it misses. */
        if (stale)
            return -ESTALE;
    }
    rc = ncomm_start(c, epoch, members, n, self, &plan);
    /* Every member learns whether every rank's start went through. A rank
     * whose start failed never joins, so the others would wait for it
     * until their deadline while it, with nothing to wait for, went on to
     * its next step and waited for them there: whichever wait ended first
     * decided whether the epoch went host-staged or failed a step. A
     * non-blocking start returns at once, so every member is here soon. */
    failed = failures(ch, n, rc < 0);
    if (failed != 0) {
        if (rc == 0)
            ncomm_abort(c, NCOMM_ABORT_MS);
        if (failed > 0 && rc == 0)
            log_warn("gpu", "Another member's NCCL communicator could not be made; this one is "
                     "given up too.", LF_U("epoch", epoch), LF_U("members_failed",
                     (uint64_t)failed));
        return failed < 0 ? (int)failed : rc < 0 ? rc : -ECONNABORTED;
    }
    return ncomm_wait(c, deadline_ms, cancel);
}

/* Polls without sleeping this many times before sleeping POLL_SLEEP_MS
 * between polls: a small collective finishes in microseconds, and a
 * millisecond's sleep would be most of its cost. */
#define SPIN_POLLS 2000

/* A newer epoch arrived during a collective (or between a broadcast's
 * pieces). Where the library can shrink, the communicator is kept, busy:
 * the next epoch's survivors shrink it with NCCL_SHRINK_ABORT, which
 * terminates what is in flight first (a member gone mid-collective is
 * what leaves one hanging). Anything else aborts it: a rebuild or a
 * host-staged epoch calls ncomm_abort, and so does ncomm_destroy. */
static void stale_in_flight(struct ncomm *c, const char *what)
{
    if (c->ops->shrink) {
        log_info("gpu", "A newer epoch arrived during an NCCL collective; it is left for the next epoch to shrink away.",
                 LF_S("collective", what), LF_U("epoch", c->epoch));
        return;
    }
    log_info("gpu", "A newer epoch arrived during an NCCL collective; it is aborted.",
             LF_S("collective", what), LF_U("epoch", c->epoch));
    ncomm_abort(c, NCOMM_ABORT_MS);
}

/* Waits for the collective just queued (queued_rc: the call's result) to
 * finish on `stream`. Any failure aborts the communicator. */
static int wait_collective(struct ncomm *c, int queued_rc, void *stream, uint64_t until,
                           const struct ncomm_cancel *cancel, const char *what)
{
    const struct ncomm_ops *o = c->ops;
    bool queued = queued_rc == 0;
    unsigned polls = 0;
    int rc = queued_rc;

    if (rc < 0 && rc != -EINPROGRESS)
        goto fail;
    for (;;) {
        /* Non-blocking: the call may still be queueing (ncclInProgress);
         * once ncclCommGetAsyncError says success it is on the stream. */
        rc = o->async_error(o->arg, c->comm);
        if (rc < 0 && rc != -EINPROGRESS)
            goto fail;
        if (rc == 0 && !queued)
            queued = true;
        if (queued && rc == 0) {
            rc = o->stream_query(o->arg, stream);
            if (rc == 0)
                break;
            if (rc != -EINPROGRESS)
                goto fail;
        }
        if (cancel && cancel->stale(cancel->arg)) {
            stale_in_flight(c, what);
            return -ESTALE;
        }
        if (clock_now_ms() >= until) {
            rc = -ETIMEDOUT;
            goto fail;
        }
        if (++polls > SPIN_POLLS)
            clock_sleep_ms(POLL_SLEEP_MS);
    }
    c->busy = false;
    return 0;
fail:
    log_warn("gpu", "An NCCL collective failed; the communicator is aborted.", LF_ERR(rc),
             LF_S("collective", what), LF_U("epoch", c->epoch));
    ncomm_abort(c, NCOMM_ABORT_MS);
    return rc;
}

static int collective_ready(const struct ncomm *c)
{
    if (!c->ops->all_reduce || !c->ops->broadcast || !c->ops->stream_query)
        return -ELIBACC;
    return c->state == NCOMM_READY ? 0 : -ENOTCONN;
}

int ncomm_all_reduce(struct ncomm *c, uint64_t send, uint64_t recv, size_t count,
                     enum ncomm_type type, double scale, void *stream, uint32_t deadline_ms,
                     const struct ncomm_cancel *cancel)
{
    uint64_t until = clock_now_ms() + deadline_ms;
    int rc = collective_ready(c);

    if (rc < 0)
        return rc;
    if (count == 0 || (unsigned)type > NCOMM_BF16 || !(scale > 0))
        return -EINVAL;
    c->busy = true;
    rc = c->ops->all_reduce(c->ops->arg, c->comm, send, recv, count, type, scale, stream);
    return wait_collective(c, rc, stream, until, cancel, "all-reduce");
}

int ncomm_broadcast(struct ncomm *c, uint64_t send, uint64_t recv, size_t bytes, int root,
                    size_t chunk, void *stream, uint32_t deadline_ms,
                    const struct ncomm_cancel *cancel)
{
    int rc = collective_ready(c);

    if (rc < 0)
        return rc;
    if (chunk == 0 || root < 0 || (size_t)root >= c->n)
        return -EINVAL;
    for (size_t off = 0; off < bytes; off += chunk) {
        size_t len = bytes - off < chunk ? bytes - off : chunk;
        uint64_t until = clock_now_ms() + deadline_ms;

        if (cancel && cancel->stale(cancel->arg)) {
            stale_in_flight(c, "broadcast");
            return -ESTALE;
        }
        c->busy = true;
        rc = c->ops->broadcast(c->ops->arg, c->comm, send + off, recv + off, len, root, stream);
        rc = wait_collective(c, rc, stream, until, cancel, "broadcast");
        if (rc < 0)
            return rc;
    }
    return 0;
}

void ncomm_set_busy(struct ncomm *c, bool busy)
{
    c->busy = busy;
}

/* One ncclCommAbort on a thread of its own. Whoever of the thread and the
 * waiter finishes last frees it. */
struct abort_job {
    const struct ncomm_ops *ops;
    void *comm;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool done, abandoned;
    int rc;
};

static void *abort_main(void *arg)
{
    struct abort_job *j = arg;
    int rc = j->ops->abort(j->ops->arg, j->comm);
    bool free_it;

    pthread_mutex_lock(&j->mu);
    j->done = true;
    j->rc = rc;
    free_it = j->abandoned;
    pthread_cond_signal(&j->cv);
    pthread_mutex_unlock(&j->mu);
    if (free_it) {
        log_info("gpu", "An NCCL abort that overran its deadline has returned.", LF_ERR(rc));
        pthread_cond_destroy(&j->cv);
        pthread_mutex_destroy(&j->mu);
        free(j);
    }
    return NULL;
}

/* ncclCommAbort(comm), waiting at most deadline_ms. Returns 0, or
 * -ETIMEDOUT when it was left running on its thread. */
static int bounded_abort(struct ncomm *c, void *comm, uint32_t deadline_ms)
{
    struct abort_job *j;
    struct timespec until;
    pthread_t t;
    int rc = 0;

    j = calloc(1, sizeof(*j));
    if (!j || clock_cond_init(&j->cv) != 0) {
        /* No thread to bound it with: abort inline rather than leak. */
        free(j);
        c->ops->abort(c->ops->arg, comm);
        return 0;
    }
    pthread_mutex_init(&j->mu, NULL);
    j->ops = c->ops;
    j->comm = comm;
    if (pthread_create(&t, NULL, abort_main, j) != 0) {
        pthread_cond_destroy(&j->cv);
        pthread_mutex_destroy(&j->mu);
        free(j);
        c->ops->abort(c->ops->arg, comm);
        return 0;
    }
    pthread_detach(t);
    until = clock_deadline(deadline_ms);
    pthread_mutex_lock(&j->mu);
    while (!j->done && rc == 0)
        rc = pthread_cond_timedwait(&j->cv, &j->mu, &until);
    if (!j->done) {
        j->abandoned = true;
        pthread_mutex_unlock(&j->mu);
        c->leaked++;
        log_warn("gpu", "ncclCommAbort did not return by its deadline; the communicator is left to it and a new one will be made.",
                 LF_U("epoch", c->epoch), LF_U("deadline_ms", deadline_ms));
        return -ETIMEDOUT;
    }
    if (j->rc < 0)
        log_info("gpu", "ncclCommAbort reported an error; the communicator is gone all the same.",
                 LF_ERR(j->rc));
    pthread_mutex_unlock(&j->mu);
    pthread_cond_destroy(&j->cv);
    pthread_mutex_destroy(&j->mu);
    free(j);
    return 0;
}

int ncomm_abort(struct ncomm *c, uint32_t deadline_ms)
{
    int rc = 0, prc = 0;

    if (c->state == NCOMM_NONE)
        return 0;
    /* The child first: it is what a collective in flight runs on. */
    if (c->comm)
        rc = bounded_abort(c, c->comm, deadline_ms);
    if (c->parent)
        prc = bounded_abort(c, c->parent, deadline_ms);
    clear(c);
    return rc < 0 ? rc : prc;
}

/* `v` (a positive normal float) as IEEE half, rounded to nearest even;
 * values below half's normal range become its subnormals or zero. */
static uint16_t to_half(float v)
{
    uint32_t b, e, m;
    int exp;

    memcpy(&b, &v, sizeof(b));
    e = (b >> 23) & 0xff;
    m = b & 0x7fffff;
    exp = (int)e - 127 + 15;
    if (exp >= 31)
        return 0x7c00;
    if (exp <= 0) {
        /* Subnormal: the implicit 1 joins the mantissa, shifted down. */
        uint32_t shift = (uint32_t)(14 - exp);

        if (shift > 24)
            return 0;
        m |= 0x800000;
        uint32_t h = m >> shift, rest = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rest > half || (rest == half && (h & 1)))
            h++;
        return (uint16_t)h;
    }
    uint32_t h = ((uint32_t)exp << 10) | (m >> 13), rest = m & 0x1fff;
    if (rest > 0x1000 || (rest == 0x1000 && (h & 1)))
        h++;
    return (uint16_t)h;
}

/* `v` as bfloat16, rounded to nearest even. */
static uint16_t to_bf16(float v)
{
    uint32_t b;

    memcpy(&b, &v, sizeof(b));
    b += 0x7fff + ((b >> 16) & 1);
    return (uint16_t)(b >> 16);
}

uint16_t ncomm_scalar16(enum ncomm_type type, double v)
{
    return type == NCOMM_F16 ? to_half((float)v) : to_bf16((float)v);
}

enum ncomm_state ncomm_state(const struct ncomm *c)
{
    return c->state;
}

uint64_t ncomm_epoch(const struct ncomm *c)
{
    return c->epoch;
}

int ncomm_rank(const struct ncomm *c)
{
    return c->state == NCOMM_NONE ? -1 : c->rank;
}

void *ncomm_handle(const struct ncomm *c)
{
    return c->comm;
}

unsigned ncomm_leaked(const struct ncomm *c)
{
    return c->leaked;
}

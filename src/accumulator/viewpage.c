/* src/accumulator/viewpage.c: see viewpage.h. A seqlock for the view,
 * a futex on the publication count for the waiter, and the doorbell. */
#include "accumulator/viewpage.h"

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <sched.h>
#include <stdbool.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "base/clock.h"

_Static_assert(sizeof(struct viewpage) <= VIEWPAGE_BYTES, "the page holds the view");

/* The view is copied word by word with relaxed atomics, so that a copy
 * racing the writer is a torn read the sequence check throws away, not a
 * data race. */
static void copy_words(uint64_t *dst, const uint64_t *src, size_t words, bool to_shared)
{
    for (size_t i = 0; i < words; i++) {
        if (to_shared)
            __atomic_store_n(&dst[i], src[i], __ATOMIC_RELAXED);
        else
            dst[i] = __atomic_load_n(&src[i], __ATOMIC_RELAXED);
    }
}

void viewpage_publish(struct viewpage *s, const struct tlink_view *w)
{
    uint64_t seq = __atomic_load_n(&s->seq, __ATOMIC_RELAXED);

    __atomic_store_n(&s->seq, seq + 1, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
    copy_words((uint64_t *)&s->view, (const uint64_t *)w, sizeof(*w) / 8, true);
    __atomic_store_n(&s->seq, seq + 2, __ATOMIC_RELEASE);
    /* Both sides use sequentially consistent operations on gen and
     * waiters, so a waiter either sees the new gen or is seen here. */
    __atomic_fetch_add(&s->gen, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&s->waiters, __ATOMIC_SEQ_CST))
        syscall(SYS_futex, &s->gen, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

uint32_t viewpage_gen(const struct viewpage *s)
{
    return __atomic_load_n(&s->gen, __ATOMIC_ACQUIRE);
}

int viewpage_wait(struct viewpage *s, uint32_t seen, int timeout_ms)
{
    struct timespec ts = { timeout_ms / 1000, (long)(timeout_ms % 1000) * 1000000L };
    uint64_t from = clock_now_us();
    int rc = 0;

    /* A round is often only microseconds away: a futex wakeup would cost
     * more than that. */
    while (clock_now_us() - from < TLINK_SPIN_US) {
        if (__atomic_load_n(&s->gen, __ATOMIC_ACQUIRE) != seen)
            return 0;
        sched_yield();
    }
    __atomic_fetch_add(&s->waiters, 1, __ATOMIC_SEQ_CST);
    /* The kernel compares gen with `seen` itself: a publication between
     * this load and the sleep makes the wait return at once. */
    if (__atomic_load_n(&s->gen, __ATOMIC_SEQ_CST) == seen &&
        syscall(SYS_futex, &s->gen, FUTEX_WAIT, seen, &ts, NULL, 0) < 0 && errno == ETIMEDOUT)
        rc = -ETIMEDOUT;
    __atomic_fetch_sub(&s->waiters, 1, __ATOMIC_SEQ_CST);
    return rc;
}

int viewpage_read(const struct viewpage *s, struct tlink_view *out)
{
    for (int tries = 0; tries < 64; tries++) {
        uint64_t a = __atomic_load_n(&s->seq, __ATOMIC_ACQUIRE), b;

        if (a == 0)
            return -EAGAIN;
        if (a & 1) {
            sched_yield();
            continue;
        }
        copy_words((uint64_t *)out, (const uint64_t *)&s->view, sizeof(*out) / 8, false);
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        b = __atomic_load_n(&s->seq, __ATOMIC_RELAXED);
        if (a == b) {
            out->leader[sizeof(out->leader) - 1] = '\0';
            return 0;
        }
    }
    return -EAGAIN;
}

/* ---- The doorbell ------------------------------------------------------- */

/* Every access to the bell's words is sequentially consistent where the
 * two sides' orders matter (see struct viewbell), and atomic everywhere:
 * the other side is another process. */

static uint32_t bell_state(const struct viewbell *b)
{
    return __atomic_load_n(&b->state, __ATOMIC_SEQ_CST);
}

static bool bell_move(struct viewbell *b, uint32_t from, uint32_t to)
{
    return __atomic_compare_exchange_n(&b->state, &from, to, false, __ATOMIC_SEQ_CST,
                                       __ATOMIC_SEQ_CST);
}

int viewpage_ring(struct viewpage *s, uint32_t type, uint64_t value)
{
    struct viewbell *b = &s->bell;
    uint64_t from;

    if (!__atomic_load_n(&b->listening, __ATOMIC_RELAXED) || bell_state(b) != VB_EMPTY)
        return 0;
    __atomic_store_n(&b->type, type, __ATOMIC_RELAXED);
    __atomic_store_n(&b->value, value, __ATOMIC_RELAXED);
    __atomic_store_n(&b->state, VB_POSTED, __ATOMIC_SEQ_CST);
    /* Not listening any more: its last take may have missed the post. */
    if (!__atomic_load_n(&b->listening, __ATOMIC_SEQ_CST))
        return bell_move(b, VB_POSTED, VB_EMPTY) ? 0 : 1;
    from = clock_now_us();
    while (clock_now_us() - from < TLINK_SPIN_US) {
        if (bell_state(b) != VB_POSTED)
            return 1;
        sched_yield();
    }
    /* A server that listens but has no CPU now: the socket's thread may. */
    return bell_move(b, VB_POSTED, VB_EMPTY) ? 0 : 1;
}

/* The answer is there: take it and free the bell. */
static int bell_done(struct viewbell *b, int64_t *status)
{
    *status = __atomic_load_n(&b->status, __ATOMIC_RELAXED);
    __atomic_store_n(&b->state, VB_EMPTY, __ATOMIC_SEQ_CST);
    return 0;
}

int viewpage_bell_wait(struct viewpage *s, int timeout_ms, int64_t *status)
{
    struct timespec ts = { timeout_ms / 1000, (long)(timeout_ms % 1000) * 1000000L };
    struct viewbell *b = &s->bell;
    uint64_t from = clock_now_us();
    uint32_t st;

    /* The server answers within microseconds of its take: a CONSUME, or a
     * CONTRIBUTE without parallel gradients, only moves the node's
     * counters. */
    while ((st = bell_state(b)) == VB_TAKEN && clock_now_us() - from < TLINK_SPIN_US)
        sched_yield();
    if (st == VB_TAKEN) {
        __atomic_fetch_add(&b->waiters, 1, __ATOMIC_SEQ_CST);
        /* The kernel compares state with TAKEN itself: an answer between
         * this load and the sleep makes the wait return at once. */
        if (bell_state(b) == VB_TAKEN)
            syscall(SYS_futex, &b->state, FUTEX_WAIT, VB_TAKEN, &ts, NULL, 0);
        __atomic_fetch_sub(&b->waiters, 1, __ATOMIC_SEQ_CST);
        st = bell_state(b);
    }
    if (st == VB_DONE)
        return bell_done(b, status);
    return st == VB_TAKEN ? -ETIMEDOUT : -EPROTO;
}

void viewpage_listen(struct viewpage *s, bool on)
{
    __atomic_store_n(&s->bell.listening, on ? 1u : 0u, __ATOMIC_SEQ_CST);
}

bool viewpage_take(struct viewpage *s, uint32_t *type, uint64_t *value)
{
    struct viewbell *b = &s->bell;

    if (__atomic_load_n(&b->state, __ATOMIC_RELAXED) != VB_POSTED ||
        !bell_move(b, VB_POSTED, VB_TAKEN))
        return false;
    *type = __atomic_load_n(&b->type, __ATOMIC_RELAXED);
    *value = __atomic_load_n(&b->value, __ATOMIC_RELAXED);
    return true;
}

void viewpage_answer(struct viewpage *s, int64_t status)
{
    struct viewbell *b = &s->bell;

    __atomic_store_n(&b->status, status, __ATOMIC_RELAXED);
    __atomic_store_n(&b->state, VB_DONE, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&b->waiters, __ATOMIC_SEQ_CST))
        syscall(SYS_futex, &b->state, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

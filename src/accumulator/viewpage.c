/* src/accumulator/viewpage.c: see viewpage.h. A seqlock for the view,
 * and a futex on the publication count for the waiter. */
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

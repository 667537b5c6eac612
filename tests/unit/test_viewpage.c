/* tests/unit/test_viewpage.c: the view page's doorbell (viewpage.h), the
 * protocol alone: a trainer's side and a server's side on two threads of
 * one page. Through a real sidecar it is test_cohort.c's and
 * test_link_sidecar.c's. */
#include <criterion/criterion.h>

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "base/clock.h"
#include "accumulator/viewpage.h"
#include "fixture.h"

static struct viewpage *page(void)
{
    struct viewpage *p = aligned_alloc(64, VIEWPAGE_BYTES);

    cr_assert_not_null(p);
    memset(p, 0, VIEWPAGE_BYTES);
    return p;
}

static uint32_t state_of(struct viewpage *p)
{
    return __atomic_load_n(&p->bell.state, __ATOMIC_SEQ_CST);
}

Test(viewpage, a_ring_that_nobody_listens_to_posts_nothing)
{
    struct viewpage *p = page();
    uint32_t type;
    uint64_t value;
    int64_t st;

    cr_assert_eq(viewpage_ring(p, TL_CONTRIBUTE, 4), 0);
    cr_assert_eq(state_of(p), VB_EMPTY);
    cr_assert(!viewpage_take(p, &type, &value));
    cr_assert_eq(viewpage_bell_wait(p, 0, &st), -EPROTO, "no request is outstanding");
    free(p);
}

/* A server that says it listens but never takes: the trainer withdraws
 * its request, and a take after that finds nothing. */
Test(viewpage, a_request_nobody_takes_is_withdrawn)
{
    struct viewpage *p = page();
    uint32_t type;
    uint64_t value;

    viewpage_listen(p, true);
    cr_assert_eq(viewpage_ring(p, TL_CONTRIBUTE, 4), 0);
    cr_assert_eq(state_of(p), VB_EMPTY);
    cr_assert(!viewpage_take(p, &type, &value));
    free(p);
}

/* The claim, the answer and the bell's release, step by step on one
 * thread: what ring leaves, take finds once. */
Test(viewpage, a_taken_request_is_answered_once_and_frees_the_bell)
{
    struct viewpage *p = page();
    uint32_t type = 0;
    uint64_t value = 0;
    int64_t st = 1;

    /* A post as ring makes it, without its wait for the take. */
    __atomic_store_n(&p->bell.type, TL_CONSUME, __ATOMIC_RELAXED);
    __atomic_store_n(&p->bell.value, 77, __ATOMIC_RELAXED);
    __atomic_store_n(&p->bell.state, VB_POSTED, __ATOMIC_SEQ_CST);
    cr_assert(viewpage_take(p, &type, &value));
    cr_assert_eq(type, TL_CONSUME);
    cr_assert_eq(value, 77);
    cr_assert(!viewpage_take(p, &type, &value), "taken twice");
    cr_assert_eq(viewpage_bell_wait(p, 1, &st), -ETIMEDOUT, "answered before the answer");
    viewpage_answer(p, -EAGAIN);
    cr_assert_eq(viewpage_bell_wait(p, 1000, &st), 0);
    cr_assert_eq(st, -EAGAIN);
    cr_assert_eq(state_of(p), VB_EMPTY);
    /* An outstanding request keeps the next ring off the bell. */
    viewpage_listen(p, true);
    __atomic_store_n(&p->bell.state, VB_TAKEN, __ATOMIC_SEQ_CST);
    cr_assert_eq(viewpage_ring(p, TL_CONTRIBUTE, 1), 0);
    cr_assert_eq(state_of(p), VB_TAKEN);
    free(p);
}

/* A server that answers only once the trainer sleeps on the futex: the
 * answer must wake it, long before its timeout. */
struct late {
    struct viewpage *p;
    int rc;
    pthread_t t;
};

static bool trainer_sleeps(void *arg)
{
    struct late *l = arg;

    return __atomic_load_n(&l->p->bell.waiters, __ATOMIC_SEQ_CST) == 1;
}

static void *answer_late(void *arg)
{
    struct late *l = arg;
    uint32_t type;
    uint64_t value;

    viewpage_listen(l->p, true);
    while (!viewpage_take(l->p, &type, &value))
        sched_yield();
    l->rc = fixture_wait_until(trainer_sleeps, l, 30000) ? 0 : -ETIMEDOUT;
    viewpage_answer(l->p, (int64_t)value);
    return NULL;
}

Test(viewpage, an_answer_wakes_a_sleeping_trainer)
{
    struct late l = { .p = page() };
    int64_t st = 0;
    uint64_t t0;
    bool taken = false;

    cr_assert_eq(pthread_create(&l.t, NULL, answer_late, &l), 0);
    /* A ring before the server listens, or whose take a loaded machine
     * delays past the trainer's spin, leaves nothing posted: ring again. */
    for (uint64_t end = fixture_deadline(FIXTURE_WAIT_MS); !taken && fixture_before(end);)
        taken = viewpage_ring(l.p, TL_CONTRIBUTE, (uint64_t)-ENOSPC) == 1;
    cr_assert(taken, "the server never took the request");
    t0 = clock_now_ms();
    /* One wait, as long as the test may take: only the wake ends it. */
    cr_assert_eq(viewpage_bell_wait(l.p, 100000, &st), 0);
    cr_assert_lt(clock_now_ms() - t0, 90000, "the answer did not wake the trainer");
    pthread_join(l.t, NULL);
    cr_assert_eq(l.rc, 0, "the trainer never slept on the bell");
    cr_assert_eq(st, -ENOSPC);
    free(l.p);
}

/* Exactly once, under every interleaving the scheduler finds: a server
 * that starts and stops listening as a node's thread does between its
 * spins, and a trainer that rings without pause. Each request is served
 * once, by the bell or (withdrawn) by the trainer's other way, and the
 * bell's answer is the one to its own request. The trainer rings until
 * both ways served many, RINGS_MAX at most. */
#define RINGS_MIN 20000
#define RINGS_MAX 400000
#define EACH_WAY 1000

struct server {
    struct viewpage *p;
    atomic_bool stop;
    uint8_t *taken;             /* per value: takes */
    int bad;                    /* values out of range */
    pthread_t t;
};

static void serve(struct server *s)
{
    uint32_t type;
    uint64_t value;

    if (!viewpage_take(s->p, &type, &value))
        return;
    if (value >= RINGS_MAX || type != TL_CONTRIBUTE) {
        s->bad++;
        viewpage_answer(s->p, -EPROTO);
        return;
    }
    s->taken[value]++;
    viewpage_answer(s->p, -(int64_t)(value % 4096));
}

static void *server_main(void *arg)
{
    struct server *s = arg;
    unsigned turn = 0;

    while (!atomic_load(&s->stop)) {
        /* A spin of a varying number of turns, then a pause outside it. */
        viewpage_listen(s->p, true);
        for (unsigned k = 0; k < 1 + turn % 7; k++) {
            serve(s);
            sched_yield();
        }
        viewpage_listen(s->p, false);
        serve(s);
        for (unsigned k = 0; k < turn % 3; k++)
            sched_yield();
        turn++;
    }
    return NULL;
}

Test(viewpage, each_request_is_served_once_however_listening_comes_and_goes, .timeout = 120)
{
    struct server s = { .p = page(), .taken = calloc(RINGS_MAX, 1) };
    uint8_t *by_bell = calloc(RINGS_MAX, 1);
    unsigned rung = 0, other = 0;
    uint64_t v, end = clock_now_ms() + 60000;

    cr_assert(s.taken && by_bell);
    cr_assert_eq(pthread_create(&s.t, NULL, server_main, &s), 0);
    for (v = 0; v < RINGS_MAX && clock_now_ms() < end &&
                (v < RINGS_MIN || rung < EACH_WAY || other < EACH_WAY);
         v++) {
        int64_t st;
        int rc;

        if (viewpage_ring(s.p, TL_CONTRIBUTE, v) == 0) {
            /* The other way costs the trainer a moment too. */
            other++;
            sched_yield();
            continue;
        }
        while ((rc = viewpage_bell_wait(s.p, 1000, &st)) == -ETIMEDOUT)
            ;
        cr_assert_eq(rc, 0, "request %lu: %d", (unsigned long)v, rc);
        cr_assert_eq(st, -(int64_t)(v % 4096), "request %lu got another's answer",
                     (unsigned long)v);
        by_bell[v] = 1;
        rung++;
    }
    atomic_store(&s.stop, true);
    pthread_join(s.t, NULL);
    cr_assert_eq(s.bad, 0);
    for (uint64_t k = 0; k < v; k++)
        cr_assert_eq(s.taken[k], by_bell[k], "request %lu: taken %u times, answered %u",
                     (unsigned long)k, s.taken[k], by_bell[k]);
    cr_assert_eq(rung + other, v);
    /* Both ways served many, or the test proved little about the race. */
    cr_assert_geq(rung, EACH_WAY, "%u of %lu requests through the bell", rung, (unsigned long)v);
    cr_assert_geq(other, EACH_WAY, "%u of %lu requests the other way", other, (unsigned long)v);
    cr_log_info("viewpage: %u rung, %u the other way", rung, other);
    free(by_bell);
    free(s.taken);
    free(s.p);
}

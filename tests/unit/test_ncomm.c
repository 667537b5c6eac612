/* tests/unit/test_ncomm.c: the NCCL communicator's lifecycle across
 * epochs, against a fake NCCL that records every call and can make any of
 * them fail or stay in progress: which call happens when, and what an
 * abort leaves behind. */
#include <criterion/criterion.h>

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "base/clock.h"
#include "fixture.h"
#include "gpu/ncomm.h"

#define COMMS 16

/* One process's NCCL, faked. Handles are slots of comms[]; live[] says
 * which were created and not yet aborted. */
struct fake {
    struct ncomm_ops ops;
    char log[1024];
    pthread_mutex_t mu;
    int comms[COMMS], next;
    bool live[COMMS];
    /* What the next calls do. */
    int fail_id, fail_init, fail_shrink, fail_async;
    bool init_sets_handle_on_failure;
    int polls_in_progress;          /* async_error says EINPROGRESS this often; -1: always */
    bool abort_blocks;              /* abort waits until released */
    atomic_bool released, abort_returned;
    bool double_abort;
    uint8_t id_byte;                /* what get_unique_id fills the id with */
    int id_calls;
};

static void note(struct fake *f, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void note(struct fake *f, const char *fmt, ...)
{
    va_list ap;
    size_t len;

    pthread_mutex_lock(&f->mu);
    len = strlen(f->log);
    va_start(ap, fmt);
    vsnprintf(f->log + len, sizeof(f->log) - len, fmt, ap);
    va_end(ap);
    pthread_mutex_unlock(&f->mu);
}

static int slot(struct fake *f, void *comm)
{
    return (int)((int *)comm - f->comms);
}

static void *new_comm(struct fake *f)
{
    int i = f->next++;

    cr_assert_lt(i, COMMS);
    f->live[i] = true;
    return &f->comms[i];
}

static int f_id(void *arg, struct ncomm_id *id)
{
    struct fake *f = arg;

    note(f, "id ");
    f->id_calls++;
    if (f->fail_id)
        return f->fail_id;
    memset(id->b, f->id_byte, sizeof(id->b));
    return 0;
}

static int f_init(void *arg, void **comm, int nranks, const struct ncomm_id *id, int rank)
{
    struct fake *f = arg;

    note(f, "init(%d,r%d,%02x) ", nranks, rank, id->b[0]);
    if (f->fail_init) {
        *comm = f->init_sets_handle_on_failure ? new_comm(f) : NULL;
        return f->fail_init;
    }
    *comm = new_comm(f);
    return -EINPROGRESS;            /* non-blocking: never ready at once */
}

static int f_async(void *arg, void *comm)
{
    struct fake *f = arg;

    note(f, "poll%d ", slot(f, comm));
    if (f->polls_in_progress < 0)
        return -EINPROGRESS;
    if (f->polls_in_progress > 0) {
        f->polls_in_progress--;
        return -EINPROGRESS;
    }
    return f->fail_async;
}

static int f_abort(void *arg, void *comm)
{
    struct fake *f = arg;
    int i = slot(f, comm);

    note(f, "abort%d ", i);
    if (f->abort_blocks)
        while (!atomic_load(&f->released))
            clock_sleep_ms(1);
    pthread_mutex_lock(&f->mu);
    if (!f->live[i])
        f->double_abort = true;     /* checked on the test's thread, by live() */
    f->live[i] = false;
    pthread_mutex_unlock(&f->mu);
    atomic_store(&f->abort_returned, true);
    return 0;
}

static int f_shrink(void *arg, void *comm, const int *exclude, int nexclude, void **newcomm,
                    bool cancel)
{
    struct fake *f = arg;

    note(f, "shrink%d(", slot(f, comm));
    for (int i = 0; i < nexclude; i++)
        note(f, "%s%d", i ? "," : "", exclude[i]);
    note(f, "%s) ", cancel ? ",cancel" : "");
    if (f->fail_shrink)
        return f->fail_shrink;
    *newcomm = new_comm(f);
    return -EINPROGRESS;
}

static void fake_init(struct fake *f, bool can_shrink)
{
    memset(f, 0, sizeof(*f));
    pthread_mutex_init(&f->mu, NULL);
    f->ops = (struct ncomm_ops){ .get_unique_id = f_id, .init_rank = f_init,
                                 .async_error = f_async, .abort = f_abort,
                                 .shrink = can_shrink ? f_shrink : NULL, .arg = f };
    f->id_byte = 0xab;
}

static int live(struct fake *f)
{
    int n = 0;

    pthread_mutex_lock(&f->mu);
    for (int i = 0; i < COMMS; i++)
        n += f->live[i];
    cr_assert_not(f->double_abort, "an abort of a communicator that was not live");
    pthread_mutex_unlock(&f->mu);
    return n;
}

static void clear_log(struct fake *f)
{
    f->log[0] = '\0';
}

static const char *const ABC[] = { "a", "b", "c" };
static const char *const AB[] = { "a", "b" };
static const char *const BC[] = { "b", "c" };
static const char *const ABCD[] = { "a", "b", "c", "d" };

static struct ncomm_plan rebuild(uint8_t byte)
{
    struct ncomm_plan p = { .shrink = false };

    memset(p.id.b, byte, sizeof(p.id.b));
    return p;
}

/* A machine with a ready communicator of epoch 1 over a, b, c, as b. */
static struct ncomm *ready_abc(struct fake *f)
{
    struct ncomm *c;
    struct ncomm_plan p = rebuild(0x11);

    cr_assert_eq(ncomm_create(&f->ops, &c), 0);
    cr_assert_eq(ncomm_start(c, 1, ABC, 3, "b", &p), 0);
    cr_assert_eq(ncomm_wait(c, FIXTURE_WAIT_MS, NULL), 0);
    cr_assert_eq(ncomm_state(c), NCOMM_READY);
    clear_log(f);
    return c;
}

Test(ncomm, creates_non_blocking_and_polls_until_ready)
{
    struct fake f;
    struct ncomm *c;
    struct ncomm_plan p = rebuild(0x42);

    fake_init(&f, true);
    f.polls_in_progress = 2;
    cr_assert_eq(ncomm_create(&f.ops, &c), 0);
    cr_assert_eq(ncomm_state(c), NCOMM_NONE);
    cr_assert_eq(ncomm_rank(c), -1);
    cr_assert_eq(ncomm_wait(c, 10, NULL), -ENOTCONN, "nothing to wait for");
    cr_assert_eq(ncomm_start(c, 7, ABC, 3, "c", &p), 0);
    cr_assert_eq(ncomm_state(c), NCOMM_STARTING, "init returned ncclInProgress");
    cr_assert_str_eq(f.log, "init(3,r2,42) ");
    cr_assert_eq(ncomm_wait(c, FIXTURE_WAIT_MS, NULL), 0);
    cr_assert_str_eq(f.log, "init(3,r2,42) poll0 poll0 poll0 ");
    cr_assert_eq(ncomm_state(c), NCOMM_READY);
    cr_assert_eq(ncomm_epoch(c), 7);
    cr_assert_eq(ncomm_rank(c), 2);
    cr_assert_eq(ncomm_handle(c), &f.comms[0]);
    cr_assert_eq(ncomm_wait(c, 10, NULL), 0, "a ready one is not polled again");
    cr_assert_str_eq(f.log, "init(3,r2,42) poll0 poll0 poll0 ");
    ncomm_destroy(c);
    cr_assert_str_eq(f.log, "init(3,r2,42) poll0 poll0 poll0 abort0 ");
    cr_assert_eq(live(&f), 0);
}

Test(ncomm, a_failed_init_leaves_nothing)
{
    struct fake f;
    struct ncomm *c;
    struct ncomm_plan p = rebuild(1);

    fake_init(&f, true);
    f.fail_init = -EIO;
    f.init_sets_handle_on_failure = true;
    cr_assert_eq(ncomm_create(&f.ops, &c), 0);
    cr_assert_eq(ncomm_start(c, 1, AB, 2, "a", &p), -EIO);
    cr_assert_str_eq(f.log, "init(2,r0,01) abort0 ", "a handle NCCL made is freed");
    cr_assert_eq(ncomm_state(c), NCOMM_NONE);
    cr_assert_eq(live(&f), 0);
    ncomm_destroy(c);
}

Test(ncomm, a_communicator_not_ready_by_the_deadline_is_aborted)
{
    struct fake f;
    struct ncomm *c;
    struct ncomm_plan p = rebuild(1);
    uint64_t t0;

    fake_init(&f, true);
    f.polls_in_progress = -1;           /* a peer that never comes */
    cr_assert_eq(ncomm_create(&f.ops, &c), 0);
    cr_assert_eq(ncomm_start(c, 1, AB, 2, "a", &p), 0);
    t0 = clock_now_ms();
    cr_assert_eq(ncomm_wait(c, 50, NULL), -ETIMEDOUT);
    cr_assert_geq(clock_now_ms() - t0, 50);
    cr_assert_lt(clock_now_ms() - t0, FIXTURE_WAIT_MS);
    cr_assert(strstr(f.log, "abort0 "), "%s", f.log);
    cr_assert_eq(ncomm_state(c), NCOMM_NONE);
    cr_assert_eq(ncomm_rank(c), -1);
    cr_assert_eq(live(&f), 0);
    ncomm_destroy(c);
}

Test(ncomm, an_asynchronous_error_aborts)
{
    struct fake f;
    struct ncomm *c;
    struct ncomm_plan p = rebuild(1);

    fake_init(&f, true);
    f.polls_in_progress = 1;
    f.fail_async = -ECONNRESET;         /* ncclRemoteError */
    cr_assert_eq(ncomm_create(&f.ops, &c), 0);
    cr_assert_eq(ncomm_start(c, 1, AB, 2, "b", &p), 0);
    cr_assert_eq(ncomm_wait(c, FIXTURE_WAIT_MS, NULL), -ECONNRESET);
    cr_assert_str_eq(f.log, "init(2,r1,01) poll0 poll0 abort0 ");
    cr_assert_eq(ncomm_state(c), NCOMM_NONE);
    cr_assert_eq(live(&f), 0);
    ncomm_destroy(c);
}

Test(ncomm, a_new_epoch_aborts_the_old_communicator_before_creating_its_own)
{
    struct fake f;
    struct ncomm *c;
    struct ncomm_plan p = rebuild(0x22);

    fake_init(&f, true);
    c = ready_abc(&f);
    cr_assert_eq(ncomm_start(c, 2, ABCD, 4, "b", &p), 0, "a joiner: a rebuild");
    cr_assert_str_eq(f.log, "abort0 init(4,r1,22) ");
    cr_assert_eq(ncomm_epoch(c), 2);
    cr_assert_eq(live(&f), 1);
    ncomm_destroy(c);
    cr_assert_eq(live(&f), 0);
}

Test(ncomm, refuses_a_member_list_without_itself)
{
    struct fake f;
    struct ncomm *c;
    struct ncomm_plan p = rebuild(1);

    fake_init(&f, true);
    c = ready_abc(&f);
    cr_assert_eq(ncomm_start(c, 2, AB, 2, "z", &p), -EINVAL);
    cr_assert_eq(ncomm_start(c, 2, AB, 0, "a", &p), -EINVAL);
    cr_assert_str_eq(f.log, "", "nothing was called");
    cr_assert_eq(ncomm_state(c), NCOMM_READY, "and nothing changed");
    cr_assert_eq(ncomm_epoch(c), 1);
    ncomm_destroy(c);
}

/* An epoch change while a collective hangs: the abort itself hangs too
 * (pytorch #102599). The machine is free again within the deadline. */
Test(ncomm, an_abort_that_hangs_is_left_behind_within_its_deadline)
{
    struct fake f;
    struct ncomm *c;
    struct ncomm_plan p = rebuild(0x33);
    uint64_t t0;

    fake_init(&f, true);
    c = ready_abc(&f);
    ncomm_set_busy(c, true);
    f.abort_blocks = true;
    t0 = clock_now_ms();
    cr_assert_eq(ncomm_abort(c, 100), -ETIMEDOUT);
    cr_assert_geq(clock_now_ms() - t0, 99);
    cr_assert_lt(clock_now_ms() - t0, FIXTURE_WAIT_MS);
    cr_assert_eq(ncomm_state(c), NCOMM_NONE);
    cr_assert_eq(ncomm_handle(c), NULL);
    cr_assert_eq(ncomm_leaked(c), 1);
    cr_assert_eq(live(&f), 1, "the old communicator still belongs to its abort");
    /* The next epoch goes on at once. */
    cr_assert_eq(ncomm_start(c, 2, AB, 2, "b", &p), 0);
    cr_assert(strstr(f.log, "init(2,r1,33) "), "%s", f.log);
    cr_assert_eq(live(&f), 2);
    /* The hung abort returns at last, and frees what it owned. */
    atomic_store(&f.released, true);
    FIXTURE_WAIT_FOR(atomic_load(&f.abort_returned), "the abort never returned");
    FIXTURE_WAIT_FOR(live(&f) == 1, "the old communicator was not freed");
    ncomm_destroy(c);
    cr_assert_eq(live(&f), 0);
}

Test(ncomm, members_that_only_leave_shrink)
{
    struct fake f;
    struct ncomm *c;
    struct ncomm_plan p = { .shrink = true };

    fake_init(&f, true);
    c = ready_abc(&f);
    cr_assert(ncomm_can_shrink(c, AB, 2));
    cr_assert(ncomm_can_shrink(c, BC, 2));
    cr_assert_eq(ncomm_start(c, 2, BC, 2, "b", &p), 0);
    cr_assert_str_eq(f.log, "shrink0(0) ", "rank 0 (a) is excluded");
    cr_assert_eq(ncomm_state(c), NCOMM_STARTING);
    cr_assert_eq(ncomm_rank(c), 0, "b is first now");
    cr_assert_eq(live(&f), 2, "the parent lives until the child is ready");
    cr_assert_eq(ncomm_wait(c, FIXTURE_WAIT_MS, NULL), 0);
    cr_assert_str_eq(f.log, "shrink0(0) poll1 abort0 ");
    cr_assert_eq(live(&f), 1);
    cr_assert_eq(ncomm_epoch(c), 2);
    ncomm_destroy(c);
}

Test(ncomm, a_shrink_during_a_collective_cancels_it)
{
    struct fake f;
    struct ncomm *c;
    struct ncomm_plan p = { .shrink = true };

    fake_init(&f, true);
    c = ready_abc(&f);
    ncomm_set_busy(c, true);
    cr_assert_eq(ncomm_start(c, 2, AB, 2, "a", &p), 0);
    cr_assert_str_eq(f.log, "shrink0(2,cancel) ");
    ncomm_destroy(c);
    cr_assert_eq(live(&f), 0, "child and parent both freed");
}

Test(ncomm, no_shrink_for_a_joiner_a_reorder_or_an_older_nccl)
{
    struct fake f, old;
    struct ncomm *c, *o;
    static const char *const BA[] = { "b", "a" };
    static const char *const A[] = { "a" };

    fake_init(&f, true);
    c = ready_abc(&f);
    cr_assert_not(ncomm_can_shrink(c, ABCD, 4), "a joiner");
    cr_assert_not(ncomm_can_shrink(c, ABC, 3), "nobody left");
    cr_assert_not(ncomm_can_shrink(c, BA, 2), "another order");
    cr_assert_not(ncomm_can_shrink(c, A, 1), "this member left");
    fake_init(&old, false);             /* NCCL before 2.27: no ncclCommShrink */
    o = ready_abc(&old);
    cr_assert_not(ncomm_can_shrink(o, AB, 2));
    ncomm_destroy(o);
    ncomm_destroy(c);
}

Test(ncomm, a_failed_shrink_leaves_nothing_for_the_next_agreement)
{
    struct fake f;
    struct ncomm *c;
    struct ncomm_plan p = { .shrink = true };

    fake_init(&f, true);
    c = ready_abc(&f);
    f.fail_shrink = -EIO;
    cr_assert_eq(ncomm_start(c, 2, AB, 2, "a", &p), -EIO);
    cr_assert_str_eq(f.log, "shrink0(2) abort0 ");
    cr_assert_eq(ncomm_state(c), NCOMM_NONE);
    cr_assert_not(ncomm_can_shrink(c, AB, 2), "this member now votes to rebuild");
    cr_assert_eq(live(&f), 0);
    cr_assert_eq(ncomm_start(c, 2, AB, 2, "a", &p), -EINVAL, "nothing to shrink");
    ncomm_destroy(c);
}

/* ---- the agreement, among members on threads of their own ---- */

#define MAX_MEMBERS 4

/* An in-process SUM all-reduce among n threads. `lie` is added to the
 * first word of every result, as a member with the key that lies would. */
struct group {
    pthread_barrier_t bar;
    pthread_mutex_t mu;
    uint64_t acc[NCOMM_XCHG_WORDS];
    int calls;
    uint64_t lie;
    int fail;                           /* the channel's error, if any */
};

static int group_sum(void *arg, uint64_t *w, size_t n)
{
    struct group *g = arg;

    cr_assert_leq(n, NCOMM_XCHG_WORDS);
    pthread_mutex_lock(&g->mu);
    for (size_t i = 0; i < n; i++)
        g->acc[i] += w[i];
    pthread_mutex_unlock(&g->mu);
    pthread_barrier_wait(&g->bar);
    memcpy(w, g->acc, n * sizeof(*w));
    w[0] += g->lie;
    if (pthread_barrier_wait(&g->bar) == PTHREAD_BARRIER_SERIAL_THREAD) {
        memset(g->acc, 0, sizeof(g->acc));
        g->calls++;
    }
    pthread_barrier_wait(&g->bar);
    return g->fail;
}

struct member {
    struct group *g;
    struct fake f;
    struct ncomm *c;
    const char *const *members;
    size_t n;
    const char *self;
    struct ncomm_plan plan;
    int rc;
};

static void *member_main(void *arg)
{
    struct member *m = arg;
    struct ncomm_channel ch = { .sum_u64 = group_sum, .arg = m->g };

    m->rc = ncomm_agree(m->c, m->members, m->n, m->self, &ch, &m->plan);
    return NULL;
}

/* Runs ncomm_agree on every member at once. */
static void agree_all(struct member *ms, size_t n)
{
    pthread_t t[MAX_MEMBERS];

    for (size_t i = 0; i < n; i++)
        cr_assert_eq(pthread_create(&t[i], NULL, member_main, &ms[i]), 0);
    for (size_t i = 0; i < n; i++)
        pthread_join(t[i], NULL);
}

static void members_init(struct group *g, struct member *ms, const char *const *members, size_t n,
                         bool ready)
{
    memset(g, 0, sizeof(*g));
    pthread_barrier_init(&g->bar, NULL, (unsigned)n);
    pthread_mutex_init(&g->mu, NULL);
    for (size_t i = 0; i < n; i++) {
        struct member *m = &ms[i];
        m->g = g;
        fake_init(&m->f, true);
        m->f.id_byte = (uint8_t)(0xa0 + i);     /* each would make another id */
        m->members = members;
        m->n = n;
        m->self = members[i];
        if (ready) {
            /* Each had a ready communicator of the epoch before, a b c d. */
            struct ncomm_plan p = rebuild(0x11);
            cr_assert_eq(ncomm_create(&m->f.ops, &m->c), 0);
            cr_assert_eq(ncomm_start(m->c, 1, ABCD, 4, m->self, &p), 0);
            cr_assert_eq(ncomm_wait(m->c, FIXTURE_WAIT_MS, NULL), 0);
            clear_log(&m->f);
        } else {
            cr_assert_eq(ncomm_create(&m->f.ops, &m->c), 0);
        }
    }
}

static void members_end(struct group *g, struct member *ms, size_t n)
{
    for (size_t i = 0; i < n; i++)
        ncomm_destroy(ms[i].c);
    pthread_barrier_destroy(&g->bar);
}

Test(ncomm_agree, the_first_member_makes_the_id_and_the_others_receive_it)
{
    struct group g;
    struct member ms[3];

    members_init(&g, ms, ABC, 3, false);
    agree_all(ms, 3);
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(ms[i].rc, 0);
        cr_assert_not(ms[i].plan.shrink);
        for (int k = 0; k < NCOMM_ID_BYTES; k++)
            cr_assert_eq(ms[i].plan.id.b[k], 0xa0, "member %d got the first member's id", i);
        cr_assert_eq(ms[i].f.id_calls, i == 0 ? 1 : 0, "only the first member makes one");
    }
    cr_assert_eq(g.calls, 2, "a vote, then the id");
    /* Each then creates its rank of the same communicator. */
    for (int i = 0; i < 3; i++) {
        char want[32];
        cr_assert_eq(ncomm_start(ms[i].c, 5, ABC, 3, ms[i].self, &ms[i].plan), 0);
        snprintf(want, sizeof(want), "id init(3,r%d,a0) ", i);
        cr_assert_str_eq(ms[i].f.log, i == 0 ? want : want + 3);
    }
    members_end(&g, ms, 3);
}

Test(ncomm_agree, all_survivors_ready_shrink_with_one_sum_and_no_id)
{
    struct group g;
    struct member ms[3];

    members_init(&g, ms, ABC, 3, true);     /* d left */
    agree_all(ms, 3);
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(ms[i].rc, 0);
        cr_assert(ms[i].plan.shrink);
        cr_assert_eq(ms[i].f.id_calls, 0);
        cr_assert_eq(ncomm_start(ms[i].c, 2, ABC, 3, ms[i].self, &ms[i].plan), 0);
        cr_assert_str_eq(ms[i].f.log, "shrink0(3) ");
    }
    cr_assert_eq(g.calls, 1);
    members_end(&g, ms, 3);
}

Test(ncomm_agree, one_member_that_cannot_shrink_makes_everyone_rebuild)
{
    struct group g;
    struct member ms[3];

    members_init(&g, ms, ABC, 3, true);
    ncomm_abort(ms[1].c, FIXTURE_WAIT_MS);      /* b's communicator failed */
    agree_all(ms, 3);
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(ms[i].rc, 0);
        cr_assert_not(ms[i].plan.shrink, "member %d", i);
        cr_assert_eq(ms[i].plan.id.b[0], 0xa0);
    }
    cr_assert_eq(g.calls, 2);
    members_end(&g, ms, 3);
}

Test(ncomm_agree, no_id_two_ids_or_false_votes_are_refused_by_everyone)
{
    struct group g;
    struct member ms[3];

    members_init(&g, ms, AB, 2, false);
    ms[0].f.fail_id = -EIO;                 /* the first member could not make one */
    agree_all(ms, 2);
    for (int i = 0; i < 2; i++)
        cr_assert_eq(ms[i].rc, -EPROTO, "member %d", i);
    cr_assert_eq(g.calls, 2, "the failing member still took part in the sum");
    members_end(&g, ms, 2);

    members_init(&g, ms, AB, 2, false);
    g.lie = 1;                              /* a second giver, or a vote too many */
    agree_all(ms, 2);
    for (int i = 0; i < 2; i++)
        cr_assert_eq(ms[i].rc, -EPROTO, "member %d", i);
    members_end(&g, ms, 2);

    members_init(&g, ms, ABC, 3, false);
    g.lie = 3;                              /* 0 + 0 + 0 votes to shrink, said to be 3 */
    agree_all(ms, 3);
    for (int i = 0; i < 3; i++)
        cr_assert_eq(ms[i].rc, -EPROTO, "member %d: all voted, though it did not", i);
    cr_assert_eq(g.calls, 1, "refused at the vote");
    members_end(&g, ms, 3);

    members_init(&g, ms, AB, 2, false);
    g.fail = -ECONNRESET;                   /* the channel broke */
    agree_all(ms, 2);
    for (int i = 0; i < 2; i++)
        cr_assert_eq(ms[i].rc, -ECONNRESET);
    cr_assert_eq(g.calls, 1, "nothing after a broken sum");
    members_end(&g, ms, 2);
}

Test(ncomm_agree, refuses_a_list_without_itself_before_any_sum)
{
    struct fake f;
    struct ncomm *c;
    struct group g = { 0 };
    struct ncomm_channel ch = { .sum_u64 = group_sum, .arg = &g };
    struct ncomm_plan p;

    fake_init(&f, true);
    cr_assert_eq(ncomm_create(&f.ops, &c), 0);
    cr_assert_eq(ncomm_agree(c, AB, 2, "z", &ch, &p), -EINVAL);
    cr_assert_eq(ncomm_agree(c, AB, 0, "a", &ch, &p), -EINVAL);
    cr_assert_eq(g.calls, 0);
    ncomm_destroy(c);
}

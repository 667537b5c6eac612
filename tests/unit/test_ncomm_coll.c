/* tests/unit/test_ncomm_coll.c: NCCL collectives on an epoch's
 * communicator, among members on threads of one process, against the
 * fake NCCL of fake_nccl.h, which really sums: the values every member
 * gets, the calls in order across epochs, and what an epoch change, a
 * deadline or a failed call leaves behind; and, with ncclCommShrink,
 * whole epochs (ncomm_setup over an in-process channel): shrink when
 * members only leave, rebuild otherwise, and the fallbacks. */
#include <criterion/criterion.h>

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "base/clock.h"
#include "fake_nccl.h"
#include "fixture.h"
#include "gpu/ncomm.h"

#define COUNT 1000
#define BCAST_BYTES 10000

static const char *const ABC[] = { "a", "b", "c" };
static const char *const AB[] = { "a", "b" };

struct member {
    struct fake_nccl f;
    struct fake_nccl_stream stream;
    struct ncomm *c;
    const char *const *members;
    size_t n;
    const char *self;
    uint64_t epoch;
    struct ncomm_plan plan;
    float in[COUNT], out[COUNT];
    uint8_t bytes[BCAST_BYTES];
    double scale;
    uint32_t deadline_ms;
    atomic_bool *stale;
    int rc_wait, rc_reduce, rc_bcast;
    bool broadcast;
};

static bool stale(void *arg)
{
    return atomic_load((atomic_bool *)arg);
}

/* One epoch of one member: its communicator made, then an all-reduce and
 * optionally a broadcast from rank 1 in pieces of 4096 bytes. */
static void *member_main(void *arg)
{
    struct member *m = arg;
    struct ncomm_cancel cancel = { .stale = stale, .arg = m->stale };

    if (ncomm_start(m->c, m->epoch, m->members, m->n, m->self, &m->plan) < 0 ||
        (m->rc_wait = ncomm_wait(m->c, FIXTURE_WAIT_MS, NULL)) < 0)
        return NULL;
    m->rc_reduce = ncomm_all_reduce(m->c, (uint64_t)(uintptr_t)m->in, (uint64_t)(uintptr_t)m->out,
                                    COUNT, NCOMM_F32, m->scale, &m->stream, m->deadline_ms,
                                    m->stale ? &cancel : NULL);
    if (m->rc_reduce == 0 && m->broadcast)
        m->rc_bcast = ncomm_broadcast(m->c, (uint64_t)(uintptr_t)m->bytes,
                                      (uint64_t)(uintptr_t)m->bytes, BCAST_BYTES, 1, 4096,
                                      &m->stream, m->deadline_ms, NULL);
    return NULL;
}

static void setup(struct fake_nccl_world *w, struct member *ms, size_t n)
{
    fake_nccl_world_init(w);
    memset(ms, 0, n * sizeof(*ms));
    for (size_t i = 0; i < n; i++) {
        fake_nccl_init(&ms[i].f, w);
        cr_assert_eq(ncomm_create(&ms[i].f.ops, &ms[i].c), 0);
        ms[i].deadline_ms = FIXTURE_WAIT_MS;
        ms[i].scale = 1.0;
    }
}

/* Epoch `epoch` among the first n members, whose names are `names`. */
static void run_epoch(struct member *ms, size_t n, const char *const *names, uint64_t epoch,
                      uint8_t id)
{
    pthread_t t[4];

    for (size_t i = 0; i < n; i++) {
        ms[i].members = names;
        ms[i].n = n;
        ms[i].self = names[i];
        ms[i].epoch = epoch;
        memset(ms[i].plan.id.b, id, sizeof(ms[i].plan.id.b));
        ms[i].rc_wait = ms[i].rc_reduce = ms[i].rc_bcast = 1;
        cr_assert_eq(pthread_create(&t[i], NULL, member_main, &ms[i]), 0);
    }
    for (size_t i = 0; i < n; i++)
        pthread_join(t[i], NULL);
}

static void teardown(struct fake_nccl_world *w, struct member *ms, size_t n)
{
    for (size_t i = 0; i < n; i++)
        ncomm_destroy(ms[i].c);
    cr_assert_eq(fake_nccl_live(w), 0, "every communicator was aborted");
    fake_nccl_world_free(w);
}

Test(ncomm_collective, every_member_gets_the_same_mean_and_the_roots_bytes)
{
    struct fake_nccl_world w;
    struct member ms[3];

    setup(&w, ms, 3);
    for (int i = 0; i < 3; i++) {
        ms[i].scale = 1.0 / 3;
        ms[i].broadcast = true;
        for (int k = 0; k < COUNT; k++)
            ms[i].in[k] = (float)(k * (i + 1));
        memset(ms[i].bytes, 0x10 + i, sizeof(ms[i].bytes));
    }
    run_epoch(ms, 3, ABC, 1, 7);
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(ms[i].rc_wait, 0);
        cr_assert_eq(ms[i].rc_reduce, 0);
        cr_assert_eq(ms[i].rc_bcast, 0);
        cr_assert_eq(ncomm_state(ms[i].c), NCOMM_READY);
        /* k x (1 + 2 + 3) / 3 = 2k, each term scaled before the sum. */
        for (int k = 0; k < COUNT; k += 97)
            cr_assert_float_eq(ms[i].out[k], 2.0f * (float)k, 1e-3f * (float)(k + 1), "%d", k);
        cr_assert_eq(memcmp(ms[i].out, ms[0].out, sizeof(ms[0].out)), 0, "the same bytes");
        for (int k = 0; k < BCAST_BYTES; k++)
            cr_assert_eq(ms[i].bytes[k], 0x11, "rank 1's bytes at %d", k);
    }
    cr_assert_str_eq(ms[0].f.log, "init(3,r0) allreduce(r0,1000) bcast(r0,4096) bcast(r0,4096) "
                                  "bcast(r0,1808) ");
    teardown(&w, ms, 3);
}

/* A member leaves: the next epoch aborts the old communicator before it
 * makes the new one, and the new one sums among those left. */
Test(ncomm_collective, call_order_across_epochs)
{
    struct fake_nccl_world w;
    struct member ms[3];

    setup(&w, ms, 3);
    for (int i = 0; i < 3; i++)
        for (int k = 0; k < COUNT; k++)
            ms[i].in[k] = (float)(i + 1);
    run_epoch(ms, 3, ABC, 1, 7);
    cr_assert_float_eq(ms[0].out[5], 6.0f, 1e-6f);
    run_epoch(ms, 2, AB, 2, 8);
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(ms[i].rc_reduce, 0);
        cr_assert_float_eq(ms[i].out[5], 3.0f, 1e-6f, "a and b only");
        cr_assert_eq(ncomm_epoch(ms[i].c), 2);
    }
    cr_assert_str_eq(ms[1].f.log,
                     "init(3,r1) allreduce(r1,1000) abort(r1) init(2,r1) allreduce(r1,1000) ");
    cr_assert_eq(fake_nccl_live(&w), 3, "c's old one and a's and b's new ones");
    teardown(&w, ms, 3);
}

struct staler {
    struct member *ms;
    atomic_bool *flag;
};

/* Sets the epoch-change flag once a and b have both queued their part. */
static void *staler_main(void *arg)
{
    struct staler *s = arg;
    uint64_t end = fixture_deadline(FIXTURE_WAIT_MS);

    while (fixture_before(end) &&
           !(strstr(s->ms[0].f.log, "allreduce") && strstr(s->ms[1].f.log, "allreduce")))
        clock_sleep_ms(1);
    atomic_store(s->flag, true);
    return NULL;
}

/* c never takes part (a peer gone on a GPU): a and b wait in their
 * all-reduce until the epoch changes, then abort within a bounded time,
 * with their output untouched and nothing of theirs left live. */
Test(ncomm_collective, an_epoch_change_aborts_an_all_reduce_in_flight)
{
    struct fake_nccl_world w;
    struct member ms[3];
    atomic_bool flag = false;
    struct staler st = { .ms = ms, .flag = &flag };
    pthread_t t;
    uint64_t t0;

    setup(&w, ms, 3);
    ms[2].f.hold = true;
    for (int i = 0; i < 3; i++) {
        ms[i].stale = &flag;
        memset(ms[i].out, 0x5a, sizeof(ms[i].out));
    }
    cr_assert_eq(pthread_create(&t, NULL, staler_main, &st), 0);
    t0 = clock_now_ms();
    run_epoch(ms, 3, ABC, 1, 7);
    pthread_join(t, NULL);
    cr_assert_lt(clock_now_ms() - t0, FIXTURE_WAIT_MS, "bounded by the epoch change");
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(ms[i].rc_reduce, -ESTALE, "member %d", i);
        cr_assert_eq(ncomm_state(ms[i].c), NCOMM_NONE);
        cr_assert_eq(((uint8_t *)ms[i].out)[0], 0x5a, "no partial result");
        cr_assert(strstr(ms[i].f.log, "abort("), "%s", ms[i].f.log);
    }
    cr_assert_eq(fake_nccl_live(&w), 0);
    teardown(&w, ms, 3);
}

Test(ncomm_collective, a_deadline_or_a_failed_call_aborts_and_the_next_epoch_starts_afresh)
{
    struct fake_nccl_world w;
    struct member ms[2];
    uint64_t t0;

    setup(&w, ms, 2);
    ms[1].f.hold = true;
    ms[0].deadline_ms = ms[1].deadline_ms = 50;
    t0 = clock_now_ms();
    run_epoch(ms, 2, AB, 1, 7);
    cr_assert_geq(clock_now_ms() - t0, 50);
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(ms[i].rc_reduce, -ETIMEDOUT);
        cr_assert_eq(ncomm_state(ms[i].c), NCOMM_NONE);
    }
    cr_assert_eq(fake_nccl_live(&w), 0);

    /* The next epoch: a's call fails at once (NCCL's error), b times out. */
    ms[1].f.hold = false;
    ms[0].f.fail_all_reduce = -EIO;
    ms[0].f.log[0] = ms[1].f.log[0] = '\0';
    run_epoch(ms, 2, AB, 2, 8);
    cr_assert_eq(ms[0].rc_reduce, -EIO);
    cr_assert_eq(ms[1].rc_reduce, -ETIMEDOUT);
    cr_assert_str_eq(ms[0].f.log, "init(2,r0) allreduce(r0,1000) abort(r0) ");
    cr_assert_eq(fake_nccl_live(&w), 0);
    teardown(&w, ms, 2);
}

Test(ncomm_collective, refusals_call_nothing)
{
    struct fake_nccl_world w;
    struct fake_nccl f;
    struct fake_nccl_stream s = { 0 };
    struct ncomm *c;
    float x[4] = { 0 };
    uint64_t p = (uint64_t)(uintptr_t)x;

    fake_nccl_world_init(&w);
    fake_nccl_init(&f, &w);
    cr_assert_eq(ncomm_create(&f.ops, &c), 0);
    cr_assert_eq(ncomm_all_reduce(c, p, p, 4, NCOMM_F32, 1.0, &s, 50, NULL), -ENOTCONN);
    cr_assert_eq(ncomm_broadcast(c, p, p, 16, 0, 8, &s, 50, NULL), -ENOTCONN);
    f.ops.stream_query = NULL;      /* no driver beside NCCL */
    cr_assert_eq(ncomm_all_reduce(c, p, p, 4, NCOMM_F32, 1.0, &s, 50, NULL), -ELIBACC);
    cr_assert_str_eq(f.log, "");
    ncomm_destroy(c);
    fake_nccl_world_free(&w);
}

Test(ncomm_collective, bad_arguments_on_a_ready_communicator_change_nothing)
{
    struct fake_nccl_world w;
    struct fake_nccl f;
    struct fake_nccl_stream s = { 0 };
    struct ncomm *c;
    struct ncomm_plan plan = { .shrink = false };
    const char *const A[] = { "a" };
    float x[4] = { 1, 2, 3, 4 };
    uint64_t p = (uint64_t)(uintptr_t)x;

    fake_nccl_world_init(&w);
    fake_nccl_init(&f, &w);
    cr_assert_eq(ncomm_create(&f.ops, &c), 0);
    cr_assert_eq(ncomm_start(c, 1, A, 1, "a", &plan), 0);
    cr_assert_eq(ncomm_wait(c, FIXTURE_WAIT_MS, NULL), 0);
    f.log[0] = '\0';
    cr_assert_eq(ncomm_all_reduce(c, p, p, 0, NCOMM_F32, 1.0, &s, 50, NULL), -EINVAL);
    cr_assert_eq(ncomm_all_reduce(c, p, p, 4, NCOMM_F32, 0.0, &s, 50, NULL), -EINVAL);
    cr_assert_eq(ncomm_broadcast(c, p, p, 16, 1, 8, &s, 50, NULL), -EINVAL, "no rank 1");
    cr_assert_eq(ncomm_broadcast(c, p, p, 16, 0, 0, &s, 50, NULL), -EINVAL);
    cr_assert_str_eq(f.log, "");
    cr_assert_eq(ncomm_state(c), NCOMM_READY);
    /* One member: its own values, scaled. */
    cr_assert_eq(ncomm_all_reduce(c, p, p, 4, NCOMM_F32, 0.5, &s, FIXTURE_WAIT_MS, NULL), 0);
    cr_assert_float_eq(x[3], 2.0f, 1e-6f);
    ncomm_destroy(c);
    cr_assert_eq(fake_nccl_live(&w), 0);
    fake_nccl_world_free(&w);
}

/* A rank that never joins: the creation stays in progress until the
 * epoch changes, which aborts it at once rather than at the deadline. */
Test(ncomm_collective, an_epoch_change_ends_the_wait_for_a_communicator)
{
    struct fake_nccl_world w;
    struct fake_nccl f;
    struct ncomm *c;
    struct ncomm_plan plan = { .shrink = false };
    atomic_bool flag = true;
    struct ncomm_cancel cancel = { .stale = stale, .arg = &flag };
    uint64_t t0;

    fake_nccl_world_init(&w);
    fake_nccl_init(&f, &w);
    memset(plan.id.b, 9, sizeof(plan.id.b));
    cr_assert_eq(ncomm_create(&f.ops, &c), 0);
    cr_assert_eq(ncomm_start(c, 1, AB, 2, "a", &plan), 0);
    cr_assert_eq(ncomm_state(c), NCOMM_STARTING, "b never joins");
    t0 = clock_now_ms();
    cr_assert_eq(ncomm_wait(c, FIXTURE_WAIT_MS, &cancel), -ESTALE);
    cr_assert_lt(clock_now_ms() - t0, FIXTURE_WAIT_MS / 2, "not the deadline");
    cr_assert_eq(ncomm_state(c), NCOMM_NONE);
    cr_assert_str_eq(f.log, "init(2,r0) abort(r0) ");
    cr_assert_eq(fake_nccl_live(&w), 0);
    ncomm_destroy(c);
    fake_nccl_world_free(&w);
}

/* The PreMulSum scalar for 16-bit gradients, against IEEE half and
 * bfloat16 as Python's struct and the usual rounding give them. */
Test(ncomm_collective, the_sixteen_bit_scalars_round_to_nearest_even)
{
    static const struct {
        double v;
        uint16_t half, bf16;
    } cases[] = {
        { 1.0, 0x3c00, 0x3f80 },        { 0.5, 0x3800, 0x3f00 },
        { 1.0 / 3, 0x3555, 0x3eab },    { 1.0 / 1000, 0x1419, 0x3a83 },
        { 1.0 / 65536, 0x0100, 0x3780 },/* half: a subnormal */
        { 1e-5, 0x00a8, 0x3728 },
    };

    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        cr_assert_eq(ncomm_scalar16(NCOMM_F16, cases[i].v), cases[i].half, "%g as half", cases[i].v);
        cr_assert_eq(ncomm_scalar16(NCOMM_BF16, cases[i].v), cases[i].bf16, "%g as bf16",
                     cases[i].v);
    }
}

/* ---- whole epochs with ncclCommShrink (ncomm_setup) --------------------- */

#define SETUP_MAX 4

/* An in-process SUM all-reduce among the epoch's member threads. */
struct chan {
    pthread_barrier_t bar;
    pthread_mutex_t mu;
    uint64_t acc[NCOMM_XCHG_WORDS];
    int calls;
    /* Added to the first word of the result of sum number lie_at (0:
     * none), as a member with the key that lies would. */
    int lie_at;
    uint64_t lie;
};

static int chan_sum(void *arg, uint64_t *w, size_t n)
{
    struct chan *g = arg;

    pthread_mutex_lock(&g->mu);
    for (size_t i = 0; i < n; i++)
        g->acc[i] += w[i];
    pthread_mutex_unlock(&g->mu);
    pthread_barrier_wait(&g->bar);
    memcpy(w, g->acc, n * sizeof(*w));
    if (g->calls + 1 == g->lie_at)
        w[0] += g->lie;
    if (pthread_barrier_wait(&g->bar) == PTHREAD_BARRIER_SERIAL_THREAD) {
        memset(g->acc, 0, sizeof(g->acc));
        g->calls++;
    }
    pthread_barrier_wait(&g->bar);
    return 0;
}

struct setup_arg {
    struct member *m;
    struct chan *ch;
    uint32_t setup_ms;
    int rc_setup;
    bool shrunk;
};

static void *setup_main(void *arg)
{
    struct setup_arg *a = arg;
    struct member *m = a->m;
    struct ncomm_channel ch = { .sum_u64 = chan_sum, .arg = a->ch };
    struct ncomm_cancel cancel = { .stale = stale, .arg = m->stale };

    a->rc_setup = ncomm_setup(m->c, m->epoch, m->members, m->n, m->self, &ch, a->setup_ms,
                              m->stale ? &cancel : NULL, &a->shrunk);
    if (a->rc_setup < 0)
        return NULL;
    m->rc_reduce = ncomm_all_reduce(m->c, (uint64_t)(uintptr_t)m->in, (uint64_t)(uintptr_t)m->out,
                                    COUNT, NCOMM_F32, m->scale, &m->stream, m->deadline_ms,
                                    m->stale ? &cancel : NULL);
    return NULL;
}

/* An epoch among ms[idx[0]], ms[idx[1]], ... named `names` in that order:
 * each sets it up over one channel, then all-reduces with scale 1/k.
 * Returns the channel's sums; a[] gets each member's setup result. */
static int run_setup_lying(struct member *ms, const int *idx, size_t k,
                           const char *const *names, uint64_t epoch, uint32_t setup_ms,
                           struct setup_arg *a, int lie_at, uint64_t lie)
{
    struct chan g = { .calls = 0, .lie_at = lie_at, .lie = lie };
    pthread_t t[SETUP_MAX];

    memset(g.acc, 0, sizeof(g.acc));
    pthread_barrier_init(&g.bar, NULL, (unsigned)k);
    pthread_mutex_init(&g.mu, NULL);
    for (size_t i = 0; i < k; i++) {
        struct member *m = &ms[idx[i]];

        m->members = names;
        m->n = k;
        m->self = names[i];
        m->epoch = epoch;
        m->scale = 1.0 / (double)k;
        m->rc_reduce = 1;
        memset(m->out, 0x5a, sizeof(m->out));
        a[i] = (struct setup_arg){ .m = m, .ch = &g, .setup_ms = setup_ms, .rc_setup = 1 };
        cr_assert_eq(pthread_create(&t[i], NULL, setup_main, &a[i]), 0);
    }
    for (size_t i = 0; i < k; i++)
        pthread_join(t[i], NULL);
    pthread_barrier_destroy(&g.bar);
    pthread_mutex_destroy(&g.mu);
    return g.calls;
}

static int run_setup(struct member *ms, const int *idx, size_t k, const char *const *names,
                     uint64_t epoch, uint32_t setup_ms, struct setup_arg *a)
{
    return run_setup_lying(ms, idx, k, names, epoch, setup_ms, a, 0, 0);
}

static void setup_shrinkable(struct fake_nccl_world *w, struct member *ms, size_t n)
{
    setup(w, ms, n);
    for (size_t i = 0; i < n; i++) {
        fake_nccl_with_shrink(&ms[i].f);
        for (int k = 0; k < COUNT; k++)
            ms[i].in[k] = (float)(i + 1);
    }
}

/* Epoch 1 of a, b and c on shrinkable communicators, in which c holds its
 * part of an all-reduce, and a and b, having queued theirs, see a newer
 * epoch (*flag set): what a and b face when c dies mid-collective. */
static void stale_in_flight(struct fake_nccl_world *w, struct member *ms, atomic_bool *flag,
                            struct setup_arg *a)
{
    static const int abc[] = { 0, 1, 2 };
    struct staler st = { .ms = ms, .flag = flag };
    pthread_t t;

    setup_shrinkable(w, ms, 3);
    ms[2].f.hold = true;
    for (int i = 0; i < 3; i++)
        ms[i].stale = flag;
    cr_assert_eq(pthread_create(&t, NULL, staler_main, &st), 0);
    run_setup(ms, abc, 3, ABC, 1, FIXTURE_WAIT_MS, a);
    pthread_join(t, NULL);
}

static void clear_logs(struct member *ms, size_t n)
{
    for (size_t i = 0; i < n; i++)
        ms[i].f.log[0] = '\0';
}

static const char *const AC[] = { "a", "c" };
static const char *const ACD[] = { "a", "c", "d" };

/* b leaves: a and c shrink (no id, no init; c is renumbered from rank 2
 * to 1) and sum among themselves; then d joins: a rebuild. */
Test(ncomm_setup, members_that_only_leave_shrink_and_a_joiner_rebuilds)
{
    static const int abc[] = { 0, 1, 2 }, ac[] = { 0, 2 }, acd[] = { 0, 2, 3 };
    struct fake_nccl_world w;
    struct member ms[4];
    struct setup_arg a[SETUP_MAX];

    setup_shrinkable(&w, ms, 4);
    cr_assert_eq(run_setup(ms, abc, 3, ABC, 1, FIXTURE_WAIT_MS, a), 3,
                 "a vote, the id, then whether every rank started");
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(a[i].rc_setup, 0);
        cr_assert_not(a[i].shrunk);
        cr_assert_eq(ms[i].rc_reduce, 0);
        cr_assert_float_eq(ms[i].out[7], 2.0f, 1e-6f, "(1 + 2 + 3) / 3");
    }
    clear_logs(ms, 4);

    cr_assert_eq(run_setup(ms, ac, 2, AC, 2, FIXTURE_WAIT_MS, a), 3,
                 "a vote, then whether every shrink started and became ready");
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(a[i].rc_setup, 0);
        cr_assert(a[i].shrunk);
        cr_assert_eq(ncomm_epoch(ms[ac[i]].c), 2);
        cr_assert_eq(ms[ac[i]].rc_reduce, 0);
        cr_assert_float_eq(ms[ac[i]].out[7], 2.0f, 1e-6f, "(1 + 3) / 2: b's part is gone");
    }
    cr_assert_eq(memcmp(ms[0].out, ms[2].out, sizeof(ms[0].out)), 0, "the same bytes");
    cr_assert_eq(ncomm_rank(ms[2].c), 1, "c renumbered");
    /* The parent is freed once the child is ready; no id, no init. */
    cr_assert_str_eq(ms[0].f.log, "shrink(r0,-1) abort(r0) allreduce(r0,1000) ");
    cr_assert_str_eq(ms[2].f.log, "shrink(r2,-1) abort(r2) allreduce(r1,1000) ");
    cr_assert_str_eq(ms[1].f.log, "", "b calls nothing");
    clear_logs(ms, 4);

    cr_assert_eq(run_setup(ms, acd, 3, ACD, 3, FIXTURE_WAIT_MS, a), 3);
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(a[i].rc_setup, 0);
        cr_assert_not(a[i].shrunk, "a joiner: rebuilt");
        cr_assert_float_eq(ms[acd[i]].out[7], (1.0f + 3.0f + 4.0f) / 3.0f, 1e-6f);
    }
    cr_assert_str_eq(ms[0].f.log, "id abort(r0) init(3,r0) allreduce(r0,1000) ");
    cr_assert_str_eq(ms[2].f.log, "abort(r1) init(3,r1) allreduce(r1,1000) ");
    cr_assert_str_eq(ms[3].f.log, "init(3,r2) allreduce(r2,1000) ");
    /* b's communicator of epoch 1 was never aborted by b (it is gone);
     * a's, c's and d's of epoch 3 are live. */
    cr_assert_eq(fake_nccl_live(&w), 4);
    teardown(&w, ms, 4);
}

/* A rank whose start fails never joins the communicator. Every member
 * learns it in one sum and gives its own up at once, rather than waiting
 * for that rank until the deadline while the failed one, with nothing to
 * wait for, waits for them in its next step. */
Test(ncomm_setup, a_start_that_fails_on_one_member_ends_every_setup_at_once)
{
    static const int abc[] = { 0, 1, 2 };
    struct fake_nccl_world w;
    struct member ms[3];
    struct setup_arg a[SETUP_MAX];
    uint64_t t0;

    setup_shrinkable(&w, ms, 3);
    ms[1].f.fail_init = -EIO;
    t0 = clock_now_ms();
    cr_assert_eq(run_setup(ms, abc, 3, ABC, 1, FIXTURE_WAIT_MS, a), 3,
                 "a vote, the id, then whether every rank started");
    cr_assert_lt(clock_now_ms() - t0, FIXTURE_WAIT_MS / 2, "no member waited for its deadline");
    cr_assert_eq(a[0].rc_setup, -ECONNABORTED);
    cr_assert_eq(a[1].rc_setup, -EIO);
    cr_assert_eq(a[2].rc_setup, -ECONNABORTED);
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(ncomm_state(ms[i].c), NCOMM_NONE, "member %d", i);
        cr_assert_eq(ms[i].rc_reduce, 1, "member %d ran no collective", i);
    }
    cr_assert_eq(fake_nccl_live(&w), 0, "the started communicators are aborted");
    teardown(&w, ms, 3);
}

/* c dies in the middle of an all-reduce: a and b see the newer epoch,
 * keep the communicator with the collective in flight, and shrink it with
 * NCCL_SHRINK_ABORT; their next all-reduce sums the two of them. */
Test(ncomm_setup, a_collective_in_flight_is_shrunk_away_with_shrink_abort)
{
    static const int ab[] = { 0, 1 };
    struct fake_nccl_world w;
    struct member ms[3];
    struct setup_arg a[SETUP_MAX];
    atomic_bool flag = false;

    stale_in_flight(&w, ms, &flag, a);
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(a[i].rc_setup, 0);
        cr_assert_eq(ms[i].rc_reduce, -ESTALE, "member %d", i);
        cr_assert_eq(ncomm_state(ms[i].c), NCOMM_READY, "kept for the shrink");
        cr_assert_eq(((uint8_t *)ms[i].out)[0], 0x5a, "no partial result");
    }
    cr_assert_eq(fake_nccl_live(&w), 3);
    clear_logs(ms, 3);

    atomic_store(&flag, false);
    ms[2].f.hold = false;
    cr_assert_eq(run_setup(ms, ab, 2, AB, 2, FIXTURE_WAIT_MS, a), 3);
    for (int i = 0; i < 2; i++) {
        char want[96];

        cr_assert_eq(a[i].rc_setup, 0);
        cr_assert(a[i].shrunk);
        cr_assert_eq(ms[i].rc_reduce, 0);
        cr_assert_float_eq(ms[i].out[7], 1.5f, 1e-6f, "(1 + 2) / 2");
        snprintf(want, sizeof(want), "shrink(r%d,-1,abort) abort(r%d) allreduce(r%d,1000) ", i,
                 i, i);
        cr_assert_str_eq(ms[i].f.log, want);
    }
    /* c's epoch-1 communicator (c is gone) and a's and b's children. */
    cr_assert_eq(fake_nccl_live(&w), 3);
    teardown(&w, ms, 3);
}

/* b's ncclCommShrink fails at once: every member learns it in the next
 * sum, aborts what it has, and the epoch rebuilds instead. */
Test(ncomm_setup, a_shrink_that_fails_falls_back_to_a_rebuild)
{
    static const int abc[] = { 0, 1, 2 }, ab[] = { 0, 1 };
    struct fake_nccl_world w;
    struct member ms[3];
    struct setup_arg a[SETUP_MAX];

    setup_shrinkable(&w, ms, 3);
    run_setup(ms, abc, 3, ABC, 1, FIXTURE_WAIT_MS, a);
    clear_logs(ms, 3);
    ms[1].f.fail_shrink = -ENOMEM;
    cr_assert_eq(run_setup(ms, ab, 2, AB, 2, FIXTURE_WAIT_MS, a), 4,
                 "the vote, the failed start, the id, whether every rank started");
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(a[i].rc_setup, 0);
        cr_assert_not(a[i].shrunk);
        cr_assert_eq(ms[i].rc_reduce, 0);
        cr_assert_float_eq(ms[i].out[7], 1.5f, 1e-6f);
    }
    /* a: its child and the parent aborted, then a new id and init. */
    cr_assert_str_eq(ms[0].f.log,
                     "shrink(r0,-1) abort(r0) abort(r0) id init(2,r0) allreduce(r0,1000) ");
    cr_assert_str_eq(ms[1].f.log, "shrink(r1,-1) abort(r1) init(2,r1) allreduce(r1,1000) ");
    cr_assert_eq(fake_nccl_live(&w), 3, "c's old one, a's and b's new ones");
    teardown(&w, ms, 3);
}

/* NCCL_SHRINK_DEFAULT under a collective still in flight (here: the
 * machines told that nothing is): the children never become ready, the
 * deadline ends the wait, and every member rebuilds in the same epoch. */
Test(ncomm_setup, a_default_shrink_under_work_in_flight_times_out_and_rebuilds)
{
    static const int ab[] = { 0, 1 };
    struct fake_nccl_world w;
    struct member ms[3];
    struct setup_arg a[SETUP_MAX];
    atomic_bool flag = false;
    uint64_t t0;

    stale_in_flight(&w, ms, &flag, a);
    atomic_store(&flag, false);
    ncomm_set_busy(ms[0].c, false);
    ncomm_set_busy(ms[1].c, false);
    clear_logs(ms, 3);
    t0 = clock_now_ms();
    cr_assert_eq(run_setup(ms, ab, 2, AB, 2, 1000, a), 5,
                 "the vote, started, ready, the id, whether every rank started");
    cr_assert_geq(clock_now_ms() - t0, 1000, "the shrink's deadline");
    for (int i = 0; i < 2; i++) {
        char want[128];

        cr_assert_eq(a[i].rc_setup, 0);
        cr_assert_not(a[i].shrunk);
        cr_assert_float_eq(ms[i].out[7], 1.5f, 1e-6f);
        snprintf(want, sizeof(want), "shrink(r%d,-1) abort(r%d) abort(r%d) %sinit(2,r%d) "
                 "allreduce(r%d,1000) ", i, i, i, i == 0 ? "id " : "", i, i);
        cr_assert_str_eq(ms[i].f.log, want);
    }
    teardown(&w, ms, 3);
}

/* What NCCL refuses of a shrink, refused by the fake at the call: an
 * excluded rank calling it, a rank out of range or listed twice, none
 * or all excluded. */
Test(ncomm_setup, the_fake_refuses_what_ncclcommshrink_refuses)
{
    struct fake_nccl_world w;
    struct member ms[3];
    void *child = NULL;
    void *comm;

    setup_shrinkable(&w, ms, 3);
    run_epoch(ms, 3, ABC, 1, 7);
    comm = ncomm_handle(ms[0].c);
    const struct ncomm_ops *o = &ms[0].f.ops;
    cr_assert_eq(o->shrink(o->arg, comm, (int[]){ 0 }, 1, &child, false), -EINVAL, "itself");
    cr_assert_eq(o->shrink(o->arg, comm, (int[]){ 3 }, 1, &child, false), -EINVAL);
    cr_assert_eq(o->shrink(o->arg, comm, (int[]){ 1, 1 }, 2, &child, false), -EINVAL);
    cr_assert_eq(o->shrink(o->arg, comm, (int[]){ 1 }, 0, &child, false), -EINVAL);
    cr_assert_eq(o->shrink(o->arg, comm, (int[]){ 1, 2, 0 }, 3, &child, false), -EINVAL);
    cr_assert_null(child);
    /* Survivors that disagree on who left make two children, neither of
     * which ever becomes ready. */
    void *ca = NULL, *cb = NULL;
    const struct ncomm_ops *ob = &ms[1].f.ops;
    cr_assert_eq(o->shrink(o->arg, comm, (int[]){ 2 }, 1, &ca, false), -EINPROGRESS);
    cr_assert_eq(ob->shrink(ob->arg, ncomm_handle(ms[1].c), (int[]){ 0 }, 1, &cb, false),
                 -EINPROGRESS);
    cr_assert_eq(o->async_error(o->arg, ca), -EINPROGRESS, "b never joined a's child");
    cr_assert_eq(ob->async_error(ob->arg, cb), -EINPROGRESS, "nor c b's");
    o->abort(o->arg, ca);
    ob->abort(ob->arg, cb);
    teardown(&w, ms, 3);
}

/* A member with the key that lies in a shrink's check (more failures
 * than members) is refused by every member alike, and nothing of theirs
 * is left live. (A lie that some members can tell and others cannot,
 * such as none failed where one did, parts them: those that can stop, the
 * others wait in the next sum until the engine's epoch moves on.) */
Test(ncomm_setup, a_lying_shrink_check_is_refused_by_every_member)
{
    static const int abc[] = { 0, 1, 2 }, ab[] = { 0, 1 };
    static const struct {
        int at;
        uint64_t lie;
    } cases[] = {
        { 2, 3 },                       /* three failures among two members */
        { 3, 5 },                       /* the same at the readiness check */
    };

    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        struct fake_nccl_world w;
        struct member ms[3];
        struct setup_arg a[SETUP_MAX];

        setup_shrinkable(&w, ms, 3);
        run_setup(ms, abc, 3, ABC, 1, FIXTURE_WAIT_MS, a);
        cr_assert_eq(run_setup_lying(ms, ab, 2, AB, 2, FIXTURE_WAIT_MS, a, cases[i].at,
                                     cases[i].lie), cases[i].at, "case %zu: nothing after it", i);
        for (int k = 0; k < 2; k++) {
            cr_assert_eq(a[k].rc_setup, -EPROTO, "case %zu, member %d", i, k);
            cr_assert_eq(ncomm_state(ms[k].c), NCOMM_NONE);
        }
        cr_assert_eq(fake_nccl_live(&w), 1, "case %zu: only c's, which c never left", i);
        teardown(&w, ms, 3);
    }
}

/* tests/unit/test_ncomm_coll.c: NCCL collectives on an epoch's
 * communicator, among members on threads of one process, against the
 * fake NCCL of fake_nccl.h, which really sums: the values every member
 * gets, the calls in order across epochs, and what an epoch change, a
 * deadline or a failed call leaves behind. */
#include <criterion/criterion.h>

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
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

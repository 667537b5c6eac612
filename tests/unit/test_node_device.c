/* tests/unit/test_node_device.c: rounds on the devices. Nodes in one
 * process, over a real broker and the engine on loopback, each with a
 * device reducer (devred) whose "device" is host memory and whose NCCL
 * is the fake of fake_nccl.h, which really sums among the members: the
 * values every member applies, the fallback to host-staged rounds when a
 * member has no NCCL, and an epoch change that aborts a reduction in
 * flight, after which the survivors rebuild, or, where NCCL can, shrink
 * the communicator, and go on. */
#include <criterion/criterion.h>

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "accumulator/devred.h"
#include "accumulator/node.h"
#include "base/clock.h"
#include "fake_nccl.h"
#include "fixture.h"
#include "membership/brokerd.h"

#define G 1024                  /* gradient elements */
#define ROUNDS 6
#define MEMBERS 3
#define PARAMS 3000             /* 24,000 bytes: six pieces through a 4 KiB scratch */

static struct brokerd *d;
static char broker[64];
/* The member with this index registers 64 bytes fewer of parameters. */
static int short_params = -1;
/* The members' NCCL has ncclCommShrink (2.27 and later). */
static bool with_shrink;
/* The member with this index stops its trainer once it sees the result
 * of round leave_after, without consuming it. */
static int leaver = -1;
static uint64_t leave_after;

static void start(void)
{
    d = fixture_held_broker_start("train", broker, sizeof(broker));
}

static void stop(void)
{
    fixture_broker_stop(d);
}

TestSuite(node_device, .init = start, .fini = stop, .timeout = 180);

struct member {
    int index;
    struct fake_nccl f;
    struct fake_nccl_stream stream;
    struct devred_mem mem;
    struct devred *red;
    struct node_device dev;
    struct node *n;
    /* The "device": the trainer's gradients and results, and the
     * reducer's scratch. */
    _Alignas(64) float dgrads[G], dresults[G], dscratch[G];
    /* The node's (the memfd's on a sidecar). */
    _Alignas(64) float grads[G], results[G];
    uint64_t params[PARAMS];
    atomic_int gathers;
    uint64_t published;         /* the last round whose result went to dresults */
    bool on_device_at[ROUNDS + 1];
    /* What the trainer saw. */
    float seen[ROUNDS + 1][G];
    uint64_t grads_at[ROUNDS + 1];
    uint32_t start_size;
    bool started;
    int rc;
    atomic_bool quit;
    pthread_t t;
};

static int m_gather(void *arg)
{
    struct member *m = arg;

    atomic_fetch_add(&m->gathers, 1);
    memcpy(m->grads, m->dgrads, sizeof(m->grads));
    return 0;
}

static int m_enter(void *arg)
{
    return 0;
}

static int m_to_scratch(void *arg, const void *src, size_t len)
{
    struct member *m = arg;

    memcpy(m->dscratch, src, len);
    return 0;
}

static int m_from_scratch(void *arg, void *dst, size_t len)
{
    struct member *m = arg;

    memcpy(dst, m->dscratch, len);
    return 0;
}

static int m_zero(void *arg)
{
    struct member *m = arg;

    memset(m->dscratch, 0, sizeof(m->dscratch));
    return 0;
}

/* What the sidecar does at a view (trainerd.c): a newly committed
 * round's result goes to the device before the trainer sees it, from
 * the reducer's scratch or from the node's results. */
static void on_view(void *arg, const struct node_view *v)
{
    struct member *m = arg;
    bool dev;

    if (!v->has_gradients || v->rounds_committed == m->published)
        return;
    dev = devred_take_result(m->red);
    memcpy(m->dresults, dev ? m->dscratch : m->results, sizeof(m->dresults));
    if (v->model_version <= ROUNDS)
        m->on_device_at[v->model_version] = dev;
    m->published = v->rounds_committed;
}

/* Small integers per member, element and round: every mean of them over
 * up to 3 members is the same float however it is summed. */
static float value(int member, size_t i, uint64_t round)
{
    return (float)((int)((i * 7 + (size_t)member * 13 + round * 31) % 41) - 20) * 3.0f;
}

static void *member_main(void *arg)
{
    struct member *m = arg;
    uint64_t end = clock_now_ms() + 120000;
    struct node_view v;

    while (clock_now_ms() < end && !atomic_load(&m->quit)) {
        node_view(m->n, &v);
        if (v.model_version >= ROUNDS && !v.has_gradients)
            return NULL;
        if (m->index == leaver && v.has_gradients && v.model_version >= leave_after)
            return NULL;
        if (!v.connected) {
            clock_sleep_ms(1);
            continue;
        }
        fixture_node_trade_state(m->n, &v);
        if (v.has_gradients) {
            if (v.model_version >= 1 && v.model_version <= ROUNDS) {
                memcpy(m->seen[v.model_version], m->dresults, sizeof(m->dresults));
                m->grads_at[v.model_version] = v.num_gradients;
            }
            memset(m->dgrads, 0, sizeof(m->dgrads));
            if (node_consume(m->n, v.rounds_committed) < 0)
                m->rc = -EPROTO;
        } else if (v.wants_gradients && (m->started || v.size == m->start_size)) {
            m->started = true;
            for (size_t i = 0; i < G; i++)
                m->dgrads[i] = value(m->index, i, v.model_version);
            if (node_contribute(m->n, 1) < 0)
                memset(m->dgrads, 0, sizeof(m->dgrads));
        } else {
            clock_sleep_ms(1);
        }
    }
    if (!atomic_load(&m->quit))
        m->rc = -ETIMEDOUT;
    return NULL;
}

static void member_start(struct member *m, int i, const char *cohort,
                         struct fake_nccl_world *w, bool nccl, bool hold, int fail_init,
                         uint32_t start_size)
{
    struct node_config c = { .broker = broker, .cohort = cohort, .host = "127.0.0.1",
                             .reduce_timeout_ms = 20000, .on_view = on_view, .view_arg = m };
    struct node_tensors t;
    char id[16];

    memset(m, 0, sizeof(*m));
    m->index = i;
    m->start_size = start_size;
    /* Each its own parameters: the state transfer must make them one. */
    for (size_t k = 0; k < PARAMS; k++)
        m->params[k] = (uint64_t)i << 32 | k;
    fake_nccl_init(&m->f, w);
    if (with_shrink)
        fake_nccl_with_shrink(&m->f);
    m->f.hold = hold;
    m->f.fail_init = fail_init;
    m->mem = (struct devred_mem){
        .grads = (uint64_t)(uintptr_t)m->dgrads, .scratch = (uint64_t)(uintptr_t)m->dscratch,
        .count = G, .type = NCOMM_F32, .stream = &m->stream,
        .gather = m_gather, .enter = m_enter, .zero_scratch = m_zero,
        .to_scratch = m_to_scratch, .from_scratch = m_from_scratch,
        .scratch_bytes = sizeof(m->dscratch), .arg = m,
    };
    cr_assert_eq(devred_create(nccl ? &m->f.ops : NULL, &m->mem, &m->red), 0);
    m->dev = devred_device(m->red);
    c.device = &m->dev;
    snprintf(id, sizeof(id), "g-%d", i);
    c.id = id;
    cr_assert_eq(node_start(&c, &m->n), 0);
    t = (struct node_tensors){ .params = m->params,
                               .params_bytes = sizeof(m->params) - (i == short_params ? 64 : 0),
                               .grads = m->grads, .grad_count = G, .grad_type = DTYPE_F32,
                               .results = m->results };
    cr_assert_eq(node_register(m->n, &t), 0);
    cr_assert_eq(node_set_virtual_batch_size(m->n, start_size), 0);
    cr_assert_eq(node_set_parallel_gradients(m->n, 2), -EOPNOTSUPP,
                 "one copy of the gradients lives on the device");
    pthread_create(&m->t, NULL, member_main, m);
}

static void member_free(struct member *m)
{
    node_stop(m->n);
    devred_destroy(m->red);
}

/* Every member holds the parameters of one of them, the leader's. */
static void check_params(struct member *ms, int n)
{
    uint64_t from = ms[0].params[0] >> 32;

    for (int k = 0; k < n; k++)
        for (size_t j = 0; j < PARAMS; j += 7)
            cr_assert_eq(ms[k].params[j], from << 32 | j, "member %d, parameter %zu", k, j);
}

/* Each committed round applied by every member is the same bytes, and the
 * mean of the contributions of the members `in` of that round. */
static void check_rounds(struct member *ms, int n, int members)
{
    for (uint64_t r = 1; r <= ROUNDS; r++) {
        for (int k = 0; k < n; k++) {
            cr_assert_eq(ms[k].grads_at[r], (uint64_t)members, "round %llu, member %d",
                         (unsigned long long)r, k);
            cr_assert_eq(memcmp(ms[k].seen[r], ms[0].seen[r], sizeof(ms[0].seen[r])), 0,
                         "round %llu: the same bytes on every member", (unsigned long long)r);
        }
        for (size_t i = 0; i < G; i += 61) {
            float want = 0;

            for (int k = 0; k < members; k++)
                want += value(k, i, r - 1) / (float)members;
            cr_assert_float_eq(ms[0].seen[r][i], want, 1e-4f, "round %llu, element %zu",
                               (unsigned long long)r, i);
        }
    }
}

Test(node_device, members_that_all_have_nccl_reduce_on_the_devices)
{
    static struct member ms[MEMBERS];
    struct fake_nccl_world w;

    fake_nccl_world_init(&w);
    for (int i = 0; i < MEMBERS; i++)
        member_start(&ms[i], i, "train", &w, true, false, 0, MEMBERS);
    for (int i = 0; i < MEMBERS; i++) {
        pthread_join(ms[i].t, NULL);
        cr_assert_eq(ms[i].rc, 0, "member %d", i);
    }
    check_rounds(ms, MEMBERS, MEMBERS);
    check_params(ms, MEMBERS);
    for (int i = 0; i < MEMBERS; i++) {
        /* The first epoch's state transfer went through the devices, in
         * pieces of the scratch's size. */
        cr_assert(strstr(ms[i].f.log, "bcast(r") &&
                      strstr(ms[i].f.log, ",4096) bcast(") && strstr(ms[i].f.log, ",3520) "),
                  "%s", ms[i].f.log);
        cr_assert_eq(atomic_load(&ms[i].gathers), 0, "no gradient left the device");
        cr_assert_geq(devred_epochs(ms[i].red), 1);
        for (int r = 1; r <= ROUNDS; r++)
            cr_assert(ms[i].on_device_at[r], "round %d on the device", r);
        cr_assert(strstr(ms[i].f.log, "allreduce("), "%s", ms[i].f.log);
    }
    for (int i = 0; i < MEMBERS; i++)
        member_free(&ms[i]);
    cr_assert_eq(fake_nccl_live(&w), 0, "every communicator aborted at the stop");
    fake_nccl_world_free(&w);
}

Test(node_device, one_member_without_nccl_makes_every_member_host_staged)
{
    static struct member ms[MEMBERS];
    struct fake_nccl_world w;

    fake_nccl_world_init(&w);
    for (int i = 0; i < MEMBERS; i++)
        member_start(&ms[i], i, "train", &w, i != 1, false, 0, MEMBERS);
    for (int i = 0; i < MEMBERS; i++) {
        pthread_join(ms[i].t, NULL);
        cr_assert_eq(ms[i].rc, 0, "member %d", i);
    }
    check_rounds(ms, MEMBERS, MEMBERS);
    check_params(ms, MEMBERS);
    for (int i = 0; i < MEMBERS; i++) {
        cr_assert_geq(atomic_load(&ms[i].gathers), ROUNDS, "host-staged: gathered each round");
        cr_assert_eq(devred_epochs(ms[i].red), 0);
        for (int r = 1; r <= ROUNDS; r++)
            cr_assert_not(ms[i].on_device_at[r]);
        cr_assert_str_eq(ms[i].f.log, "", "NCCL was never called: %s", ms[i].f.log);
    }
    for (int i = 0; i < MEMBERS; i++)
        member_free(&ms[i]);
    fake_nccl_world_free(&w);
}

/* g-1's communicator cannot be made (NCCL fails at its creation): every
 * member sees that at the epoch's last vote and reduces host-staged, the
 * others having given up their own communicators. */
Test(node_device, a_communicator_that_fails_on_one_member_makes_every_member_host_staged)
{
    static struct member ms[MEMBERS];
    struct fake_nccl_world w;

    fake_nccl_world_init(&w);
    for (int i = 0; i < MEMBERS; i++)
        member_start(&ms[i], i, "train", &w, true, false, i == 1 ? -EIO : 0, MEMBERS);
    for (int i = 0; i < MEMBERS; i++) {
        pthread_join(ms[i].t, NULL);
        cr_assert_eq(ms[i].rc, 0, "member %d", i);
    }
    check_rounds(ms, MEMBERS, MEMBERS);
    for (int i = 0; i < MEMBERS; i++) {
        cr_assert_geq(atomic_load(&ms[i].gathers), ROUNDS, "host-staged: gathered each round");
        cr_assert_eq(devred_epochs(ms[i].red), 0);
        cr_assert(strstr(ms[i].f.log, "init(3,"), "%s", ms[i].f.log);
        cr_assert_null(strstr(ms[i].f.log, "allreduce("), "%s", ms[i].f.log);
    }
    cr_assert_eq(fake_nccl_live(&w), 0, "the communicators that were made are given up");
    for (int i = 0; i < MEMBERS; i++)
        member_free(&ms[i]);
    fake_nccl_world_free(&w);
}

static bool all_aborted(void *arg)
{
    struct member *ms = arg;

    for (int i = 0; i < MEMBERS; i++)
        if (!strstr(ms[i].f.log, "abort("))
            return false;
    return true;
}

/* g-2 registers fewer parameter bytes than the others: NCCL would trust
 * every rank's count, so the members find out before any collective and
 * let their communicators go; nothing is broadcast or reduced on the
 * devices. */
Test(node_device, members_with_tensors_of_different_sizes_run_no_collective)
{
    static struct member ms[MEMBERS];
    struct fake_nccl_world w;

    short_params = 2;
    fake_nccl_world_init(&w);
    for (int i = 0; i < MEMBERS; i++)
        member_start(&ms[i], i, "train", &w, true, false, 0, MEMBERS);
    cr_assert(fixture_wait_until(all_aborted, ms, FIXTURE_WAIT_MS), "%s | %s | %s",
              ms[0].f.log, ms[1].f.log, ms[2].f.log);
    for (int i = 0; i < MEMBERS; i++) {
        atomic_store(&ms[i].quit, true);
        pthread_join(ms[i].t, NULL);
    }
    for (int i = 0; i < MEMBERS; i++) {
        cr_assert(strstr(ms[i].f.log, "init(3,"), "%s", ms[i].f.log);
        cr_assert_null(strstr(ms[i].f.log, "bcast("), "%s", ms[i].f.log);
        cr_assert_null(strstr(ms[i].f.log, "allreduce("), "%s", ms[i].f.log);
        cr_assert_geq(devred_epochs(ms[i].red), 1, "made, then given up");
    }
    for (int i = 0; i < MEMBERS; i++)
        member_free(&ms[i]);
    cr_assert_eq(fake_nccl_live(&w), 0);
    fake_nccl_world_free(&w);
}

static bool both_queued(void *arg)
{
    struct member *ms = arg;

    return strstr(ms[0].f.log, "allreduce(") && strstr(ms[1].f.log, "allreduce(");
}

/* g-2's NCCL never takes part (a peer that hangs on its GPU): g-0 and
 * g-1 wait in their all-reduce until g-2 leaves. The new epoch aborts the
 * reduction in flight; the survivors keep their contributions, build a
 * communicator of two and commit every round with the mean of theirs. */
Test(node_device, an_epoch_change_aborts_a_reduction_in_flight_and_the_survivors_rebuild)
{
    static struct member ms[MEMBERS];
    struct fake_nccl_world w;

    fake_nccl_world_init(&w);
    for (int i = 0; i < MEMBERS; i++)
        member_start(&ms[i], i, "train", &w, true, i == 2, 0, MEMBERS);
    cr_assert(fixture_wait_until(both_queued, ms, FIXTURE_WAIT_MS), "%s | %s", ms[0].f.log,
              ms[1].f.log);
    /* The trainers of g-0 and g-1 go on with a cohort of two from here. */
    for (int i = 0; i < 2; i++)
        node_set_virtual_batch_size(ms[i].n, 2);
    atomic_store(&ms[2].quit, true);
    pthread_join(ms[2].t, NULL);
    member_free(&ms[2]);
    for (int i = 0; i < 2; i++) {
        pthread_join(ms[i].t, NULL);
        cr_assert_eq(ms[i].rc, 0, "member %d", i);
        cr_assert(strstr(ms[i].f.log, "init(3,"), "%s", ms[i].f.log);
        /* The three-member communicator aborted, then one of two made. */
        const char *ab = strstr(ms[i].f.log, "abort(");
        cr_assert(ab && strstr(ab, "init(2,"), "%s", ms[i].f.log);
        cr_assert(strstr(strstr(ab, "init(2,"), "allreduce("), "%s", ms[i].f.log);
    }
    check_rounds(ms, 2, 2);
    for (int i = 0; i < 2; i++)
        member_free(&ms[i]);
    cr_assert_eq(fake_nccl_live(&w), 0);
    fake_nccl_world_free(&w);
}

/* As above, with an NCCL that has ncclCommShrink: the survivors keep the
 * communicator of three with the reduction in flight and shrink it with
 * NCCL_SHRINK_ABORT (no new id, no init), renumbered, and commit every
 * round with the mean of theirs. */
Test(node_device, survivors_of_a_reduction_in_flight_shrink_the_communicator)
{
    static struct member ms[MEMBERS];
    struct fake_nccl_world w;

    with_shrink = true;
    fake_nccl_world_init(&w);
    for (int i = 0; i < MEMBERS; i++)
        member_start(&ms[i], i, "train", &w, true, i == 2, 0, MEMBERS);
    cr_assert(fixture_wait_until(both_queued, ms, FIXTURE_WAIT_MS), "%s | %s", ms[0].f.log,
              ms[1].f.log);
    for (int i = 0; i < 2; i++)
        node_set_virtual_batch_size(ms[i].n, 2);
    atomic_store(&ms[2].quit, true);
    pthread_join(ms[2].t, NULL);
    member_free(&ms[2]);
    for (int i = 0; i < 2; i++) {
        char want[64];

        pthread_join(ms[i].t, NULL);
        cr_assert_eq(ms[i].rc, 0, "member %d", i);
        snprintf(want, sizeof(want), "allreduce(r%d,%d) shrink(r%d,-1,abort) ", i, G, i);
        const char *sh = strstr(ms[i].f.log, want);
        cr_assert(sh, "the reduction in flight, then the shrink: %s", ms[i].f.log);
        cr_assert_null(strstr(ms[i].f.log, "init(2,"), "no rebuild: %s", ms[i].f.log);
        cr_assert(strstr(sh, "allreduce("), "rounds on the shrunk one: %s", ms[i].f.log);
        cr_assert_geq(devred_shrinks(ms[i].red), 1);
    }
    check_rounds(ms, 2, 2);
    for (int i = 0; i < 2; i++)
        member_free(&ms[i]);
    cr_assert_eq(fake_nccl_live(&w), 0);
    fake_nccl_world_free(&w);
    with_shrink = false;
}

/* g-2 leaves after round 2, between rounds: g-0 and g-1 shrink the
 * communicator of three (no new id, no init, no collective to terminate)
 * and commit rounds 3 to 6 with the mean of theirs; rounds 1 and 2 had
 * all three. */
Test(node_device, members_that_leave_between_rounds_are_shrunk_away)
{
    static struct member ms[MEMBERS];
    struct fake_nccl_world w;

    with_shrink = true;
    leaver = 2;
    leave_after = 2;
    fake_nccl_world_init(&w);
    for (int i = 0; i < MEMBERS; i++)
        member_start(&ms[i], i, "train", &w, true, false, 0, MEMBERS);
    pthread_join(ms[2].t, NULL);
    cr_assert_eq(ms[2].rc, 0);
    for (int i = 0; i < 2; i++)
        node_set_virtual_batch_size(ms[i].n, 2);
    member_free(&ms[2]);
    for (int i = 0; i < 2; i++) {
        char want[128];

        pthread_join(ms[i].t, NULL);
        cr_assert_eq(ms[i].rc, 0, "member %d", i);
        /* Round 3 never started among three (g-2 held its result), so no
         * collective was in flight: NCCL_SHRINK_DEFAULT, then the parent
         * aborted once the child is ready. */
        snprintf(want, sizeof(want), "allreduce(r%d,%d) allreduce(r%d,%d) shrink(r%d,-1) abort(r%d) ",
                 i, G, i, G, i, i);
        const char *sh = strstr(ms[i].f.log, want);
        cr_assert(sh, "%s", ms[i].f.log);
        cr_assert_null(strstr(ms[i].f.log, "init(2,"), "no rebuild: %s", ms[i].f.log);
        cr_assert(strstr(sh, "allreduce("), "rounds on the shrunk one: %s", ms[i].f.log);
        cr_assert_geq(devred_shrinks(ms[i].red), 1);
    }
    for (uint64_t r = 1; r <= ROUNDS; r++) {
        int members = r <= leave_after ? 3 : 2;

        for (int k = 0; k < 2; k++) {
            cr_assert_eq(ms[k].grads_at[r], (uint64_t)members, "round %llu, member %d",
                         (unsigned long long)r, k);
            cr_assert(ms[k].on_device_at[r], "round %llu on the device", (unsigned long long)r);
        }
        cr_assert_eq(memcmp(ms[0].seen[r], ms[1].seen[r], sizeof(ms[0].seen[r])), 0,
                     "round %llu: the same bytes", (unsigned long long)r);
        for (size_t i = 0; i < G; i += 61) {
            float want = 0;

            for (int k = 0; k < members; k++)
                want += value(k, i, r - 1) / (float)members;
            cr_assert_float_eq(ms[0].seen[r][i], want, 1e-4f, "round %llu, element %zu",
                               (unsigned long long)r, i);
        }
    }
    for (int i = 0; i < 2; i++)
        member_free(&ms[i]);
    cr_assert_eq(fake_nccl_live(&w), 0);
    fake_nccl_world_free(&w);
    with_shrink = false;
    leaver = -1;
}

/* ---- the reducer alone, as the only member of its epochs ---- */

static int alone_sum(void *arg, uint64_t *words, size_t n)
{
    return 0;               /* the sum over one member is its own words */
}

static int epoch_alone(struct node_device *dev, uint64_t number)
{
    static const char *const self[] = { "g-0" };
    struct ncomm_channel ch = { .sum_u64 = alone_sum };

    return dev->epoch(dev->arg, number, self, 1, self[0], &ch, NULL);
}

/* A member whose communicators keep failing stops voting for NCCL after
 * DEVRED_TRIES_MAX epochs in a row; one that succeeds in between starts
 * counting again; without NCCL's collectives it never votes. */
Test(devred, gives_up_after_setups_that_fail_in_a_row)
{
    static struct member m;
    struct fake_nccl_world w;
    struct node_device dev;

    fake_nccl_world_init(&w);
    fake_nccl_init(&m.f, &w);
    m.mem = (struct devred_mem){
        .grads = (uint64_t)(uintptr_t)m.dgrads, .scratch = (uint64_t)(uintptr_t)m.dscratch,
        .count = G, .type = NCOMM_F32, .stream = &m.stream,
        .gather = m_gather, .enter = m_enter, .zero_scratch = m_zero,
        .to_scratch = m_to_scratch, .from_scratch = m_from_scratch,
        .scratch_bytes = sizeof(m.dscratch), .arg = &m,
    };
    cr_assert_eq(devred_create(&m.f.ops, &m.mem, &m.red), 0);
    dev = devred_device(m.red);
    m.f.fail_init = -EIO;
    for (int i = 1; i < DEVRED_TRIES_MAX; i++) {
        cr_assert(dev.can(dev.arg), "try %d", i);
        cr_assert_eq(epoch_alone(&dev, (uint64_t)i), -EIO);
    }
    m.f.fail_init = 0;
    cr_assert(dev.can(dev.arg));
    cr_assert_eq(epoch_alone(&dev, 10), 0, "a success resets the count");
    cr_assert_eq(devred_epochs(m.red), 1);
    m.f.fail_init = -EIO;
    for (int i = 0; i < DEVRED_TRIES_MAX; i++) {
        cr_assert(dev.can(dev.arg), "try %d after the reset", i);
        cr_assert_eq(epoch_alone(&dev, (uint64_t)(20 + i)), -EIO);
    }
    cr_assert_not(dev.can(dev.arg), "gave up");
    cr_assert_not(dev.can(dev.arg), "and stays so");
    cr_assert_eq(fake_nccl_live(&w), 0, "nothing of the failed setups is left");
    devred_destroy(m.red);

    /* A table without collectives (or none at all) never votes. */
    m.f.ops.all_reduce = NULL;
    cr_assert_eq(devred_create(&m.f.ops, &m.mem, &m.red), 0);
    dev = devred_device(m.red);
    cr_assert_not(dev.can(dev.arg));
    devred_destroy(m.red);
    cr_assert_eq(devred_create(NULL, &m.mem, &m.red), 0);
    dev = devred_device(m.red);
    cr_assert_not(dev.can(dev.arg));
    devred_destroy(m.red);
    /* A memory description without its calls is refused. */
    m.mem.gather = NULL;
    cr_assert_eq(devred_create(&m.f.ops, &m.mem, &m.red), -EINVAL);
    fake_nccl_world_free(&w);
}

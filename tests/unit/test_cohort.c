/* tests/unit/test_cohort.c: the trainer API (include/cohort.h).
 *
 * Every behaviour of the Accumulator runs through both links (link.h): a
 * sidecar's service (trainerd) on real Unix sockets with shared memory
 * (suite cohort_sidecar), and a node in the trainer's process joined to the
 * broker directly (suite cohort_node). A behaviour that holds on one link
 * and not the other fails one of the pair. Misuse and bad input on the
 * trainer link itself, and configs refused before any link, are suite
 * cohort. */
#include <criterion/criterion.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "base/clock.h"
#include "cohort.h"
#include "fixture.h"
#include "accumulator/tlink.h"
#include "accumulator/trainerd.h"
#include "accumulator/viewpage.h"
#include "gpu/cudrv.h"
#include "gpu/gpuid.h"

#define NP 777

static struct brokerd *d;
static char broker[64], dir[64];

static void start(void)
{
    d = fixture_broker_start("api", broker, sizeof(broker));
    snprintf(dir, sizeof(dir), "/tmp/cohort-api-XXXXXX");
    cr_assert_not_null(mkdtemp(dir));
}

static void stop(void)
{
    fixture_broker_stop(d);
    rmdir(dir);
}

TestSuite(cohort, .init = start, .fini = stop, .timeout = 120);
TestSuite(cohort_sidecar, .init = start, .fini = stop, .timeout = 120);
TestSuite(cohort_node, .init = start, .fini = stop, .timeout = 120);

/* How a trainer reaches its node. */
enum via { VIA_SIDECAR, VIA_NODE };

/* Defines test `name` once per link: the body is `name(enum via via)`. */
#define BOTH_LINKS(name)                                        \
    static void name(enum via via);                             \
    Test(cohort_sidecar, name) { name(VIA_SIDECAR); }           \
    Test(cohort_node, name) { name(VIA_NODE); }                 \
    static void name(enum via via)

static struct trainerd *sidecar(const char *id, char *path, size_t n)
{
    struct trainerd_config tc = { .node = { .broker = broker, .cohort = "api", .id = id,
                                            .host = "127.0.0.1" } };
    struct trainerd *t;

    snprintf(path, n, "%s/%s.sock", dir, id);
    tc.socket_path = path;
    cr_assert_eq(trainerd_start(&tc, &t), 0);
    return t;
}

/* Connects trainer `c` as member `id` of cohort "api": through a sidecar of
 * its own, which is returned (the caller stops it after destroying c), or
 * in-process (NULL is returned). */
static struct trainerd *join(enum via via, struct cohort *c, const char *id)
{
    char path[128], addr[160];
    struct trainerd *t;

    if (via == VIA_NODE) {
        cr_assert_eq(cohort_set_identity(c, "api", id), 0);
        cr_assert_eq(cohort_connect(c, broker), 0);
        cr_assert_eq(cohort_connect(c, broker), -EALREADY);
        return NULL;
    }
    t = sidecar(id, path, sizeof(path));
    snprintf(addr, sizeof(addr), "unix:%s", path);
    cr_assert_eq(cohort_connect(c, addr), 0);
    cr_assert_eq(cohort_connect(c, addr), -EALREADY);
    return t;
}

/* Destroys the trainer, then its sidecar (trainerd_stop takes NULL). */
static void leave(struct cohort *c, struct trainerd *t)
{
    cohort_destroy(c);
    if (t)
        trainerd_stop(t);
}

static struct cohort *trainer(void)
{
    struct cohort_tensor p[2] = { { "w", COHORT_F32, NP - 1 }, { "b", COHORT_F32, 1 } };
    struct cohort_tensor b[1] = { { "steps", COHORT_F64, 1 } };
    struct cohort_config cfg = { .name = "model", .parameters = p, .n_parameters = 2,
                                 .buffers = b, .n_buffers = 1 };
    struct cohort *c;

    cr_assert_eq(cohort_create(&cfg, &c), 0);
    cr_assert_eq(cohort_numel(c), NP);
    cr_assert_eq((char *)cohort_param(c, 1) - (char *)cohort_param(c, 0), (NP - 1) * 4);
    cr_assert_null(cohort_param(c, 2));
    return c;
}

struct loop {
    struct cohort *c;
    uint64_t target;
    int index;
    int rc;
    unsigned states;
    atomic_int *finished;           /* shared: trainers at their target */
    int n_trainers;
    pthread_t t;
};

static void nap(void)
{
    clock_sleep_ms(2);
}

/* moolib's loop on the C API. A trainer at its target contributes no
 * more, but goes on answering for its state until every trainer is at
 * its own: an eviction under load can make the leader's state needed
 * again after the leader's trainer has finished. */
static void *run_loop(void *arg)
{
    struct loop *l = arg;
    struct cohort *c = l->c;
    float *w = cohort_params(c), *g = cohort_grads(c), *r = cohort_results(c);
    uint64_t end = clock_now_ms() + 90000;
    bool done = false;

    while (clock_now_ms() < end) {
        if ((l->rc = cohort_update(c)) < 0)
            return NULL;
        if (cohort_wants_state(c))
            cohort_set_state(c, "opaque", 7);
        if (cohort_has_new_state(c)) {
            const void *s;
            size_t len;
            if (cohort_state(c, &s, &len) == 0 && len == 7 && strcmp(s, "opaque") == 0)
                l->states++;
        }
        if (!done && cohort_model_version(c) >= l->target && !cohort_has_gradients(c)) {
            done = true;
            atomic_fetch_add(l->finished, 1);
        }
        if (done && atomic_load(l->finished) == l->n_trainers)
            return NULL;
        /* Training starts once the whole cohort is there, so that every
         * trainer's gradients count. */
        if (!cohort_connected(c) || cohort_size(c) < (uint32_t)l->n_trainers) {
            nap();
            continue;
        }
        if (cohort_has_gradients(c)) {
            for (size_t i = 0; i < NP; i++)
                w[i] -= 0.1f * r[i];
            cr_assert_eq(cohort_zero_gradients(c), 0);
            for (size_t i = 0; i < NP; i++)
                cr_assert_eq(g[i], 0.0f, "zero_gradients zeroes the gradients");
        } else if (cohort_wants_gradients(c) && !done) {
            for (size_t i = 0; i < NP; i++)
                g[i] += (float)(l->index + 1) + w[i] * 0.01f;
            cr_assert_eq(cohort_reduce_gradients(c, 4), 0);
        } else {
            nap();
        }
    }
    l->rc = -ETIMEDOUT;
    return NULL;
}

static bool alone_in_an_epoch(struct cohort *c)
{
    return cohort_update(c) == 0 && cohort_connected(c) && cohort_size(c) == 1;
}

/* Two trainers reach `target` and end bytewise identical; the joiner
 * receives the leader's opaque state. `via[i]` is trainer i's link, so a
 * cohort may mix them. */
static void train_pair(const enum via via[2], uint64_t target)
{
    static const char *ids[2] = { "a-0", "a-1" };
    struct trainerd *sd[2];
    atomic_int finished = 0;
    struct loop l[2] = { { .target = target, .index = 0, .finished = &finished, .n_trainers = 2 },
                         { .target = target, .index = 1, .finished = &finished, .n_trainers = 2 } };
    struct cohort_gradient_stats st;
    /* w as 8 x 97, b; then bad ones. */
    const struct cohort_tensor_shape shapes[] = {
        { 0, NP - 1, 8, 97 }, { NP - 1, 1, 1, 1 }, { 100, 10, 10, 1 },
        { NP - 1, 2, 2, 1 }, { 0, NP - 1, 8, 96 },
    };

    for (int i = 0; i < 2; i++) {
        l[i].c = trainer();
        float *w = cohort_params(l[i].c);
        for (size_t k = 0; k < NP; k++)
            w[k] = (float)(i * 100 + (int)k);           /* different starts */
        if (via[i] == VIA_NODE)
            cr_assert_eq(cohort_connect(l[i].c, broker), -EINVAL, "no identity yet");
        cr_assert_eq(cohort_set_tensor_shapes(l[i].c, shapes, 2), -ENOTCONN);
        sd[i] = join(via[i], l[i].c, ids[i]);
        /* The layout through either link (the sidecar's in a memfd);
         * bad ones are refused before anything travels. */
        cr_assert_eq(cohort_set_tensor_shapes(l[i].c, shapes, 2), 0);
        cr_assert_eq(cohort_set_tensor_shapes(l[i].c, shapes, 3), -EINVAL, "overlap");
        cr_assert_eq(cohort_set_tensor_shapes(l[i].c, &shapes[3], 1), -EINVAL, "past the end");
        cr_assert_eq(cohort_set_tensor_shapes(l[i].c, &shapes[4], 1), -EINVAL, "rows x cols");
        cr_assert_eq(cohort_set_tensor_shapes(l[i].c, shapes, COHORT_TENSOR_SHAPES_MAX + 1), -EINVAL);
        cr_assert_eq(cohort_set_tensor_shapes(l[i].c, NULL, 0), 0, "back to the whole buffer");
        cr_assert_eq(cohort_set_tensor_shapes(l[i].c, shapes, 2), 0);
        cr_assert_eq(cohort_set_virtual_batch_size(l[i].c, 8), 0);
        cr_assert_eq(cohort_set_parallel_gradients(l[i].c, 1), 0);
        cr_assert_eq(cohort_set_parallel_gradients(l[i].c, 0), -EINVAL);
        cr_assert_eq(cohort_set_parallel_gradients(l[i].c, 9), -EINVAL);
        /* Through either link (the sidecar's is a tlink message); these
         * gradients are small, so their rounds stay fused and exact. */
        cr_assert_eq(cohort_set_compression(l[i].c, COHORT_COMPRESSION_INT8), 0);
        cr_assert_eq(cohort_set_compression(l[i].c, (enum cohort_compression)6), -EINVAL);
        cr_assert_eq(cohort_set_compression_with(l[i].c, COHORT_COMPRESSION_TOPK, 1.5), -EINVAL);
        cr_assert_eq(cohort_set_compression_with(l[i].c, COHORT_COMPRESSION_POWERSGD, 2.5), -EINVAL);
        cr_assert_eq(cohort_set_compression_with(l[i].c, COHORT_COMPRESSION_INT8, 1), -EINVAL);
        /* a-0 leads because it is in the epoch first: a-1 joins only
         * then, or on a loaded machine its join could reach the broker
         * before a-0's (the member joins from its own thread). */
        if (i == 0)
            FIXTURE_WAIT_FOR(alone_in_an_epoch(l[0].c), "a-0 never joined an epoch alone");
    }
    for (int i = 0; i < 2; i++)
        pthread_create(&l[i].t, NULL, run_loop, &l[i]);
    for (int i = 0; i < 2; i++) {
        pthread_join(l[i].t, NULL);
        cr_assert_eq(l[i].rc, 0, "trainer %d: %s", i, cohort_strerror(l[i].rc));
    }
    cr_assert_eq(memcmp(cohort_params(l[0].c), cohort_params(l[1].c), NP * 4), 0);
    cr_assert_eq(cohort_model_version(l[1].c), target);
    cr_assert_str_eq(cohort_get_leader(l[0].c), "a-0");
    cr_assert(cohort_is_leader(l[0].c) && !cohort_is_leader(l[1].c));
    cr_assert_eq(cohort_size(l[0].c), 2);
    cr_assert_eq(cohort_rank(l[1].c), 1);
    cr_assert_geq(l[1].states, 1, "the joiner never received the leader's opaque state");
    cohort_get_gradient_stats(l[0].c, &st);
    cr_assert_eq(st.batch_size, 8);
    cr_assert_eq(st.num_gradients, 2);
    cr_assert_eq(st.rounds_committed, target);
    for (int i = 0; i < 2; i++)
        leave(l[i].c, sd[i]);
}

BOTH_LINKS(trainers_stay_identical)
{
    const enum via both[2] = { via, via };

    train_pair(both, 12);
}

/* One trainer through a sidecar, one in-process: the same bytes. */
Test(cohort, trainers_on_different_links_stay_identical)
{
    const enum via mixed[2] = { VIA_NODE, VIA_SIDECAR };

    train_pair(mixed, 12);
}

/* Parallel gradients: each contribution is a distinct integer, so every
 * result names exactly the contributions it holds. */
struct ploop {
    struct cohort *c;
    int index, rc;
    unsigned parallel, per_round;   /* contributions of each member per round */
    uint64_t results;
    unsigned max_ahead;
    pthread_t t;
};

static float pvalue(int member, uint64_t k)
{
    return (float)(member * 1000 + (int)k + 1);
}

static void *run_parallel(void *arg)
{
    struct ploop *l = arg;
    struct cohort *c = l->c;
    float *g = cohort_grads(c), *r = cohort_results(c);
    uint64_t made = 0, end = clock_now_ms() + 60000;

    while (clock_now_ms() < end) {
        if ((l->rc = cohort_update(c)) < 0)
            return NULL;
        if (l->results >= 8 && !cohort_has_gradients(c))
            return NULL;
        if (!cohort_connected(c) || cohort_size(c) < 2) {
            nap();
            continue;
        }
        if (cohort_wants_state(c))
            cohort_set_state(c, "", 0);
        if (cohort_has_new_state(c)) {
            const void *s;
            size_t len;
            cohort_state(c, &s, &len);
        }
        if (cohort_has_gradients(c)) {
            /* Round j holds contributions j*per_round .. of each member. */
            double want = 0;
            for (unsigned k = 0; k < l->per_round; k++)
                want += pvalue(0, l->results * l->per_round + k) +
                        pvalue(1, l->results * l->per_round + k);
            want /= 2.0 * l->per_round;
            for (size_t i = 0; i < NP; i++)
                if (r[i] != (float)want) {
                    l->rc = -EPROTO;
                    return NULL;
                }
            l->results++;
            cr_assert_eq(cohort_zero_gradients(c), 0);
        } else if (cohort_wants_gradients(c)) {
            for (size_t i = 0; i < NP; i++)
                g[i] += pvalue(l->index, made);
            made++;
            cr_assert_eq(cohort_reduce_gradients(c, 1), 0);
            /* Copied aside and zeroed at once: the next batch starts clean. */
            if (l->parallel > 1)
                cr_assert_eq(g[0], 0.0f);
            if (made - l->results * l->per_round > l->max_ahead)
                l->max_ahead = (unsigned)(made - l->results * l->per_round);
        } else {
            nap();
        }
    }
    l->rc = -ETIMEDOUT;
    return NULL;
}

static void parallel_pair(enum via via, unsigned p0, unsigned p1, unsigned per_round)
{
    struct trainerd *sd[2];
    struct ploop l[2] = { { .index = 0, .parallel = p0, .per_round = per_round },
                          { .index = 1, .parallel = p1, .per_round = per_round } };

    for (int i = 0; i < 2; i++) {
        char id[16];
        snprintf(id, sizeof(id), "q-%d", i);
        l[i].c = trainer();
        sd[i] = join(via, l[i].c, id);
        cr_assert_eq(cohort_set_virtual_batch_size(l[i].c, 2 * per_round), 0);
        cr_assert_eq(cohort_set_parallel_gradients(l[i].c, l[i].parallel), 0);
    }
    for (int i = 0; i < 2; i++)
        pthread_create(&l[i].t, NULL, run_parallel, &l[i]);
    for (int i = 0; i < 2; i++) {
        pthread_join(l[i].t, NULL);
        cr_assert_eq(l[i].rc, 0, "member %d: %s", i, cohort_strerror(l[i].rc));
        /* Never more in flight than allowed (the open round counts its
         * contributions as one outstanding). */
        cr_assert_leq(l[i].max_ahead, per_round * l[i].parallel);
    }
    /* Each trainer stopped at its own moment, possibly with a round it
     * had contributed to ahead still in flight; once that settles both
     * have committed the same rounds. */
    uint64_t end = clock_now_ms() + 30000;
    for (;;) {
        cr_assert_eq(cohort_update(l[0].c), 0);
        cr_assert_eq(cohort_update(l[1].c), 0);
        if (cohort_model_version(l[0].c) == cohort_model_version(l[1].c))
            break;
        cr_assert_lt(clock_now_ms(), end, "versions %llu and %llu",
                     (unsigned long long)cohort_model_version(l[0].c),
                     (unsigned long long)cohort_model_version(l[1].c));
        nap();
    }
    for (int i = 0; i < 2; i++)
        leave(l[i].c, sd[i]);
}

BOTH_LINKS(parallel_gradients_apply_every_contribution_once_in_order)
{
    parallel_pair(via, 2, 2, 1);
    parallel_pair(via, 3, 1, 1);
}

BOTH_LINKS(parallel_gradients_sum_queued_contributions_into_one_round)
{
    parallel_pair(via, 2, 2, 2);
}

/* Steps both trainers until pred() holds for each, answering state
 * requests on the way. */
static void step_pair_until(struct cohort **c, bool (*pred)(const struct cohort *))
{
    uint64_t end = clock_now_ms() + 30000;

    for (;;) {
        bool all = true;
        for (int i = 0; i < 2; i++) {
            cr_assert_eq(cohort_update(c[i]), 0);
            if (cohort_wants_state(c[i]))
                cohort_set_state(c[i], "", 0);
            if (cohort_has_new_state(c[i])) {
                const void *st;
                size_t len;
                cohort_state(c[i], &st, &len);
            }
            all = all && pred(c[i]);
        }
        if (all)
            return;
        cr_assert_lt(clock_now_ms(), end, "the pair never got there");
        nap();
    }
}

static bool pair_ready(const struct cohort *c)
{
    return cohort_size(c) == 2 && cohort_wants_gradients(c);
}

static bool pair_has_result(const struct cohort *c)
{
    return cohort_has_gradients(c);
}

/* Two trainers, `<prefix>-0` and `<prefix>-1`, each of `np` float32
 * parameters, connected through `via`, and a virtual batch size each. */
static void pair_start(enum via via, const char *prefix, size_t np, const uint64_t *vbs,
                       struct trainerd **sd, struct cohort **c)
{
    struct cohort_tensor p = { "w", COHORT_F32, np };
    struct cohort_config cfg = { .name = "model", .parameters = &p, .n_parameters = 1 };
    char id[16];

    for (int i = 0; i < 2; i++) {
        snprintf(id, sizeof(id), "%s-%d", prefix, i);
        cr_assert_eq(cohort_create(&cfg, &c[i]), 0);
        sd[i] = join(via, c[i], id);
        cr_assert_eq(cohort_set_virtual_batch_size(c[i], vbs[i]), 0);
    }
}

static void pair_stop(struct trainerd **sd, struct cohort **c)
{
    for (int i = 0; i < 2; i++)
        leave(c[i], sd[i]);
}

/* With parallel gradients a skip leaves the trainer's gradient buffer to
 * its next batch; the round must get zeros from this member, not that. */
static void parallel_skip_round(enum via via, size_t np)
{
    const uint64_t vbs[2] = { 1, 1 };
    struct trainerd *sd[2];
    struct cohort *c[2];

    pair_start(via, "k", np, vbs, sd, c);
    cr_assert_eq(cohort_set_parallel_gradients(c[0], 2), 0);
    step_pair_until(c, pair_ready);
    /* Member 0 has begun its next batch, and skips this round. */
    float *g0 = cohort_grads(c[0]), *g1 = cohort_grads(c[1]);
    for (size_t i = 0; i < np; i++) {
        g0[i] = 1000.0f;
        g1[i] = 1.0f;
    }
    cr_assert_eq(cohort_skip_gradients(c[0]), 0);
    cr_assert_eq(cohort_reduce_gradients(c[1], 1), 0);
    step_pair_until(c, pair_has_result);
    for (int k = 0; k < 2; k++) {
        const float *r = cohort_results(c[k]);
        for (size_t i = 0; i < np; i++)
            cr_assert_eq(r[i], 1.0f, "%zu floats, member %d, element %zu: %g", np, k, i, r[i]);
    }
    pair_stop(sd, c);
}

BOTH_LINKS(a_skip_under_parallel_gradients_contributes_zeros)
{
    parallel_skip_round(via, 777);      /* counters ride with the gradients */
    parallel_skip_round(via, 100000);   /* a count step, then the gradient step */
}

/* Small gradients carry the round's counters in their own all-reduce
 * (float32 here): sample counts far beyond float32's 2^24 come out exact,
 * and a round that needs a second step still commits right. */
BOTH_LINKS(counters_beyond_float_precision_stay_exact)
{
    const uint64_t batch[2] = { (1ull << 40) + 1, (1ull << 33) + 7 };
    /* Their mean, 2^41 + 2^40, is more than one step brings. */
    const uint64_t vbs[2] = { 1ull << 41, 1ull << 42 };
    struct trainerd *sd[2];
    struct cohort *c[2];
    struct cohort_gradient_stats st;

    pair_start(via, "e", 64, vbs, sd, c);
    step_pair_until(c, pair_ready);
    for (int k = 0; k < 3; k++) {
        for (int i = 0; i < 2; i++) {
            float *g = cohort_grads(c[i]);
            for (int j = 0; j < 64; j++)
                g[j] += (float)(i + 1);
            cr_assert_eq(cohort_reduce_gradients(c[i], batch[i]), 0);
        }
        if (k < 2)
            step_pair_until(c, pair_ready);
    }
    step_pair_until(c, pair_has_result);
    for (int i = 0; i < 2; i++) {
        const float *r = cohort_results(c[i]);
        cr_assert_eq(cohort_get_gradient_stats(c[i], &st), 0);
        /* Three contributions each: 2^40 + 2^33 short of 2^41 + 2^40 after
         * two, past it after three. */
        cr_assert_eq(st.batch_size, 3 * (batch[0] + batch[1]), "member %d: %llu", i,
                     (unsigned long long)st.batch_size);
        cr_assert_eq(st.num_gradients, 6);
        cr_assert_eq(st.rounds_committed, 1);
        /* Each member's buffer holds 3 * (i + 1); their sum over six
         * contributions. */
        for (int j = 0; j < 64; j++)
            cr_assert_eq(r[j], 9.0f / 6.0f);
        cr_assert_eq(cohort_zero_gradients(c[i]), 0);
        cr_assert_eq(cohort_set_virtual_batch_size(c[i], 1), 0);
    }
    /* Rounds that commit at once: the second after a round of three steps
     * still counts first, the third rides with the gradients. */
    for (uint64_t round = 2; round <= 3; round++) {
        step_pair_until(c, pair_ready);
        for (int i = 0; i < 2; i++) {
            float *g = cohort_grads(c[i]);
            for (int j = 0; j < 64; j++)
                g[j] = (float)(i + 1);
            cr_assert_eq(cohort_reduce_gradients(c[i], batch[i]), 0);
        }
        step_pair_until(c, pair_has_result);
        for (int i = 0; i < 2; i++) {
            const float *r = cohort_results(c[i]);
            cr_assert_eq(cohort_get_gradient_stats(c[i], &st), 0);
            cr_assert_eq(st.batch_size, batch[0] + batch[1], "round %llu, member %d: %llu",
                         (unsigned long long)round, i, (unsigned long long)st.batch_size);
            cr_assert_eq(st.rounds_committed, round);
            for (int j = 0; j < 64; j++)
                cr_assert_eq(r[j], 1.5f);
            cr_assert_eq(cohort_zero_gradients(c[i]), 0);
        }
    }
    pair_stop(sd, c);
}

/* Steps a lone trainer until it is asked for gradients. */
static void until_wanted(struct cohort *c)
{
    uint64_t end = clock_now_ms() + 30000;

    while (!cohort_wants_gradients(c) && clock_now_ms() < end) {
        nap();
        cr_assert_eq(cohort_update(c), 0);
    }
    cr_assert(cohort_wants_gradients(c));
}

/* Waits, with cohort_wait, until a lone trainer holds a result. */
static void until_result(struct cohort *c)
{
    uint64_t end = clock_now_ms() + 30000;

    while (!cohort_has_gradients(c) && clock_now_ms() < end) {
        int rc = cohort_wait(c, 1000);
        cr_assert(rc == 0 || rc == -ETIMEDOUT, "cohort_wait: %s", cohort_strerror(rc));
        cr_assert_eq(cohort_update(c), 0);
    }
    cr_assert(cohort_has_gradients(c));
}

BOTH_LINKS(misuse_is_refused_and_each_result_is_seen_once)
{
    struct cohort *c = trainer();
    struct trainerd *s;

    cr_assert_eq(cohort_update(c), -ENOTCONN, "nothing to update before connect");
    cr_assert_eq(cohort_wait(c, 10), -ENOTCONN, "nothing to wait for before connect");
    cr_assert_eq(cohort_reduce_gradients(c, 1), -ENOTCONN);
    cr_assert_eq(cohort_zero_gradients(c), -ENOTCONN);
    s = join(via, c, "m-0");
    cr_assert_eq(cohort_update(c), 0);
    /* Alone in the cohort it leads at once; until the epoch is synced it
     * is not asked for gradients. */
    until_wanted(c);
    cr_assert_eq(cohort_zero_gradients(c), -EPERM, "no result to zero");
    cr_assert_eq(cohort_reduce_gradients(c, 0), -EINVAL);
    cr_assert_eq(cohort_set_virtual_batch_size(c, 0), -EINVAL);
    cr_assert_eq(cohort_reduce_gradients(c, 1), 0);
    cr_assert(!cohort_wants_gradients(c), "a contribution shows in the view at once");
    cr_assert_eq(cohort_reduce_gradients(c, 1), -EPERM, "a second reduce before the round ends");
    /* Alone, the round commits at once; cohort_wait wakes for it. */
    until_result(c);
    /* zero_gradients does not wait for the node, yet no view read after
     * it shows the consumed result again, and the next round goes on. */
    for (int round = 0; round < 50; round++) {
        uint64_t v = cohort_model_version(c);
        cr_assert_eq(cohort_zero_gradients(c), 0);
        cr_assert(!cohort_has_gradients(c), "round %d: the consumed result is still shown", round);
        cr_assert_eq(cohort_zero_gradients(c), -EPERM, "one result, one zero");
        cr_assert_eq(cohort_update(c), 0);
        cr_assert(!cohort_has_gradients(c), "round %d: the consumed result came back", round);
        cr_assert(cohort_wants_gradients(c));
        cr_assert_eq(cohort_reduce_gradients(c, 1), 0);
        until_result(c);
        cr_assert_eq(cohort_model_version(c), v + 1);
    }
    /* Nothing changes while the result waits for the trainer. */
    cr_assert_eq(cohort_update(c), 0);
    cr_assert_eq(cohort_wait(c, 300), -ETIMEDOUT);
    cr_assert_eq(cohort_set_state(c, "x", 1), -EPERM, "nobody asked for state");
    cr_assert_eq(cohort_state(c, &(const void *){ NULL }, &(size_t){ 0 }), -ENOENT, "no state came");
    leave(c, s);
}

/* What the trainer declares or sets is in the view as soon as the call
 * returns, with no cohort_update() in between. */
BOTH_LINKS(actions_show_in_the_view_at_once)
{
    struct cohort *c = trainer();
    struct trainerd *s = join(via, c, "v-0");

    cr_assert_eq(cohort_update(c), 0);
    until_wanted(c);
    cr_assert_eq(cohort_set_model_version(c, 41), 0);
    cr_assert_eq(cohort_model_version(c), 41, "a declared version shows at once");
    until_wanted(c);
    cr_assert_eq(cohort_reduce_gradients(c, 1), 0);
    cr_assert(!cohort_wants_gradients(c), "a contribution shows at once");
    leave(c, s);
}

/* The sidecar serves one trainer, and a trainer whose sidecar goes away
 * is told so by every call from then on. */
Test(cohort, a_second_trainer_and_a_gone_sidecar_are_errors)
{
    char p[128], addr[160];
    struct trainerd *s = sidecar("m-0", p, sizeof(p));
    struct cohort *c = trainer(), *other = trainer();

    cr_assert_eq(cohort_connect(c, "unix:/nonexistent/sock"), -ENOENT);
    snprintf(addr, sizeof(addr), "unix:%s", p);
    cr_assert_eq(cohort_connect(c, addr), 0);
    cr_assert_eq(cohort_update(c), 0);
    until_wanted(c);
    /* A second trainer on the same sidecar is turned away. */
    cr_assert_neq(cohort_connect(other, addr), 0);
    /* The sidecar goes away: calls say so, and keep saying so. */
    trainerd_stop(s);
    cr_assert_eq(cohort_wait(c, 5000), -ENOTCONN, "a wait notices the sidecar is gone");
    cr_assert_eq(cohort_update(c), -ENOTCONN);
    cr_assert(!cohort_connected(c) && !cohort_wants_gradients(c), "a lost link shows no view");
    cr_assert_eq(cohort_reduce_gradients(c, 1), -ENOTCONN);
    cr_assert_eq(cohort_set_model_version(c, 3), -ENOTCONN);
    cr_assert_eq(cohort_wait(c, 10), -ENOTCONN);
    cr_assert_str_eq(cohort_strerror(-ENOTCONN), "the sidecar is gone");
    cohort_destroy(c);
    cohort_destroy(other);
}

static int raw_connect(const char *path)
{
    struct sockaddr_un sa = { .sun_family = AF_UNIX };
    int fd = socket(AF_UNIX, SOCK_SEQPACKET, 0);

    memcpy(sa.sun_path, path, strlen(path) + 1);
    cr_assert_eq(connect(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    return fd;
}

static int32_t raw_call(int fd, uint16_t type, const void *body, uint32_t len, const int *fds, int nfds)
{
    struct tlink_hdr h;
    char buf[TLINK_BODY_MAX];
    int got[TLINK_FDS_MAX], ngot;

    cr_assert_eq(tlink_send(fd, type, 0, body, len, fds, nfds), 0);
    if (tlink_recv(fd, &h, buf, sizeof(buf), -1, got, &ngot, 10000) < 0)
        return INT32_MIN;       /* connection closed */
    return h.status;
}

/* A memfd holding `len` bytes of `data`, sealed as a trainer's is. */
static int sealed_memfd(const void *data, size_t len)
{
    int fd = memfd_create("t", MFD_CLOEXEC | MFD_ALLOW_SEALING);

    cr_assert_geq(fd, 0);
    cr_assert_eq(write(fd, data, len), (ssize_t)len);
    cr_assert_eq(fcntl(fd, F_ADD_SEALS, TLINK_SEALS), 0);
    return fd;
}

/* The descriptor of this process's memfd named `name`, or -1. */
static int find_memfd(const char *name)
{
    char want[64], link[128], path[64];

    snprintf(want, sizeof(want), "/memfd:%s (deleted)", name);
    for (int fd = 3; fd < 1024; fd++) {
        ssize_t n;
        snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
        n = readlink(path, link, sizeof(link) - 1);
        if (n < 0)
            continue;
        link[n] = '\0';
        if (strcmp(link, want) == 0)
            return fd;
    }
    return -1;
}

/* The trainer's tensors cannot change size under the sidecar's mapping;
 * the socket is its owner's alone; a client that connects and says
 * nothing is closed and frees the session for the real trainer. */
Test(cohort, the_trainer_link_is_sealed_private_and_bounded_in_time)
{
    char p[128], addr[160];
    struct trainerd *s = sidecar("z-0", p, sizeof(p));
    struct cohort *c = trainer();
    struct stat st;
    struct tlink_hdr h;
    char buf[TLINK_BODY_MAX];
    int fds[TLINK_FDS_MAX], nfds, mfd, idle;

    mfd = find_memfd("cohort-tensors");
    cr_assert_geq(mfd, 0);
    cr_assert_eq(ftruncate(mfd, 0), -1, "a trainer's tensors can shrink");
    cr_assert_eq(errno, EPERM);
    cr_assert_eq(stat(p, &st), 0);
    cr_assert_eq(st.st_mode & 0777, 0600, "socket mode %o", st.st_mode & 0777);
    /* An idle client holds the session until the deadline, then is closed. */
    idle = raw_connect(p);
    uint64_t t0 = clock_now_ms();
    cr_assert_eq(tlink_recv(idle, &h, buf, sizeof(buf), -1, fds, &nfds, 30000), -ECONNRESET);
    cr_assert_geq(clock_now_ms() - t0 + 50, TLINK_HELLO_DEADLINE_MS, "closed too early");
    close(idle);
    snprintf(addr, sizeof(addr), "unix:%s", p);
    cr_assert_eq(cohort_connect(c, addr), 0);
    cohort_destroy(c);
    trainerd_stop(s);
}

/* The view page of this process's only Accumulator: the last
 * VIEWPAGE_BYTES of its tensors memfd, mapped anew (the caller unmaps
 * *len bytes at the page's base less the offset). */
static struct viewpage *own_page(void **map, size_t *len)
{
    int fd = find_memfd("cohort-tensors");
    struct stat st;

    cr_assert_geq(fd, 0);
    cr_assert_eq(fstat(fd, &st), 0);
    *len = (size_t)st.st_size;
    *map = mmap(NULL, *len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    cr_assert_neq(*map, MAP_FAILED);
    return (struct viewpage *)((char *)*map + *len - VIEWPAGE_BYTES);
}

/* Right after a round, the sidecar's node thread takes the trainer's next
 * move from the view page's doorbell. A request of a type it does not
 * serve there is answered -EPROTO, and the rounds go on, each result
 * exact, with the trainer's own requests through the bell. */
Test(cohort, a_doorbell_request_of_another_type_is_refused_and_rounds_go_on)
{
    char p[128], addr[160];
    struct trainerd *s = sidecar("b-0", p, sizeof(p));
    struct cohort *c = trainer();
    float *g = cohort_grads(c), *r = cohort_results(c);
    uint64_t end = clock_now_ms() + 60000, served;
    bool refused = false;
    struct viewpage *page;
    size_t len;
    void *map;

    snprintf(addr, sizeof(addr), "unix:%s", p);
    cr_assert_eq(cohort_connect(c, addr), 0);
    page = own_page(&map, &len);
    FIXTURE_WAIT_FOR(alone_in_an_epoch(c), "b-0 never joined an epoch");
    /* Until the bell has served the trainer too, a few times over. */
    for (uint64_t k = 1; clock_now_ms() < end && (!refused || trainerd_bell_served(s) < 4); k++) {
        until_wanted(c);
        for (size_t i = 0; i < NP; i++)
            g[i] = (float)k;
        cr_assert_eq(cohort_reduce_gradients(c, 1), 0);
        until_result(c);
        /* The node's thread spins for the trainer's next move now. */
        if (!refused && viewpage_ring(page, TL_VIEW, 0) == 1) {
            int64_t st = 0;
            cr_assert_eq(viewpage_bell_wait(page, 30000, &st), 0);
            cr_assert_eq(st, -EPROTO);
            refused = true;
        }
        for (size_t i = 0; i < NP; i++)
            cr_assert_eq(r[i], (float)k, "round %lu, element %zu: %g", (unsigned long)k, i, r[i]);
        cr_assert_eq(cohort_zero_gradients(c), 0);
    }
    cr_assert(refused, "the node's thread never took a request from the bell");
    served = trainerd_bell_served(s);
    cr_assert_geq(served, 4, "the trainer's own requests never came through the bell");
    cr_log_info("cohort: %lu requests through the bell", (unsigned long)served);
    munmap(map, len);
    cohort_destroy(c);
    trainerd_stop(s);
}

Test(cohort, malformed_messages_and_bad_layouts_are_refused)
{
    char p[128];
    struct trainerd *s = sidecar("x-0", p, sizeof(p));
    struct tlink_hello hello = { .api_version = TLINK_VERSION, .name = "raw" };
    struct tlink_register r;
    int fd, mfd;
    char junk[40];

    /* Garbage instead of a header: the connection is closed. */
    fd = raw_connect(p);
    memset(junk, 0x5a, sizeof(junk));
    cr_assert_eq(send(fd, junk, sizeof(junk), 0), (ssize_t)sizeof(junk));
    cr_assert_eq(raw_call(fd, TL_VIEW, NULL, 0, NULL, 0), INT32_MIN);
    close(fd);

    /* A well-framed session with bad requests: refused one by one. */
    fd = raw_connect(p);
    cr_assert_eq(raw_call(fd, TL_VIEW, NULL, 0, NULL, 0), -ENODEV, "nothing registered yet");
    hello.api_version = 99;
    cr_assert_eq(raw_call(fd, TL_HELLO, &hello, sizeof(hello), NULL, 0), -EPROTO);
    hello.api_version = TLINK_VERSION;
    cr_assert_eq(raw_call(fd, TL_HELLO, &hello, sizeof(hello), NULL, 0), 0);
    mfd = tlink_memfd_from("t", junk, sizeof(junk));
    memset(&r, 0, sizeof(r));
    r.mem = TL_MEM_HOST;
    r.region_bytes = sizeof(junk);
    r.grad_count = 2;
    cr_assert_eq(raw_call(fd, TL_REGISTER, &r, sizeof(r), &mfd, 1), -EPERM,
                 "a memfd that could shrink under the sidecar's mapping");
    close(mfd);
    mfd = sealed_memfd(junk, sizeof(junk));
    r.mem = TL_MEM_HOST;
    r.grad_dtype = 0;
    r.region_bytes = sizeof(junk);
    r.grads_off = 0;
    r.grad_count = 1000;                        /* past the end of the memfd */
    cr_assert_eq(raw_call(fd, TL_REGISTER, &r, sizeof(r), &mfd, 1), -EINVAL);
    r.grad_count = 2;
    r.region_bytes = 4096;                      /* not the memfd's size */
    cr_assert_eq(raw_call(fd, TL_REGISTER, &r, sizeof(r), &mfd, 1), -EINVAL);
    r.mem = TL_MEM_CUDA_IPC;
    cr_assert_eq(raw_call(fd, TL_REGISTER, &r, sizeof(r), &mfd, 1), -EOPNOTSUPP);
    /* GPU memory by device UUID: refused with the cause the driver gives
     * (no GPU support in this build, no driver, or no such device). */
    {
        struct gpuid id;
        const char *why;
        cr_assert_eq(gpuid_parse("GPU-1f3a5c7e-0b2d-4e6f-8091-a2b3c4d5e6f7", &id), 0);
        r.mem = TL_MEM_CUDA_VMM;
        memcpy(r.cuda_uuid, id.b, GPUID_BYTES);
        cr_assert_eq(raw_call(fd, TL_REGISTER, &r, sizeof(r), &mfd, 1), cudrv_check(&id, &why));
        if (!cudrv_built())
            cr_assert_eq(raw_call(fd, TL_REGISTER, &r, sizeof(r), &mfd, 1), -EOPNOTSUPP);
        memset(r.cuda_handle, 0, sizeof(r.cuda_handle));
    }
    r.mem = TL_MEM_HOST;
    cr_assert_eq(raw_call(fd, TL_REGISTER, &r, sizeof(r), NULL, 0), -EPROTO, "no descriptor");
    close(mfd);
    /* A body of the wrong size ends the session. */
    cr_assert_eq(raw_call(fd, TL_CONTRIBUTE, junk, 3, NULL, 0), -EPROTO);
    close(fd);
    /* CONSUME is one-way: misused, it gets no reply to misread, only a
     * closed connection. */
    {
        struct tlink_u64 u = { 0 };
        fd = raw_connect(p);
        cr_assert_eq(raw_call(fd, TL_CONSUME, &u, sizeof(u), NULL, 0), INT32_MIN, "nothing registered");
        close(fd);
        fd = raw_connect(p);
        mfd = tlink_memfd_from("t", junk, sizeof(junk));
        cr_assert_eq(raw_call(fd, TL_CONSUME, &u, sizeof(u), &mfd, 1), INT32_MIN, "a descriptor");
        close(mfd);
        close(fd);
        fd = raw_connect(p);
        cr_assert_eq(raw_call(fd, TL_CONSUME, &u, 3, NULL, 0), INT32_MIN, "a short body");
        close(fd);
    }
    /* The service is still there for a proper trainer. */
    struct cohort *c = trainer();
    char addr[160];
    snprintf(addr, sizeof(addr), "unix:%s", p);
    cr_assert_eq(cohort_connect(c, addr), 0);
    cohort_destroy(c);
    trainerd_stop(s);
}

Test(cohort, create_refuses_bad_configs)
{
    struct cohort_tensor mixed[2] = { { "a", COHORT_F32, 3 }, { "b", COHORT_F64, 3 } };
    struct cohort_tensor none[1] = { { "a", COHORT_F32, 0 } };
    struct cohort_config cfg = { .name = "m", .parameters = mixed, .n_parameters = 2 };
    struct cohort *c = NULL;

    cr_assert_eq(cohort_create(&cfg, &c), -EINVAL, "mixed dtypes");
    cfg.parameters = none;
    cfg.n_parameters = 1;
    cr_assert_eq(cohort_create(&cfg, &c), -EINVAL, "no elements");
    cfg.n_parameters = 0;
    cr_assert_eq(cohort_create(&cfg, &c), -EINVAL);
    /* Sizes whose sum would wrap: each alone passes a per-tensor check. */
    struct cohort_tensor huge[2] = { { "a", COHORT_F32, (SIZE_MAX / 4) / 4 - 1 },
                                     { "b", COHORT_F32, (SIZE_MAX / 4) / 4 - 1 } };
    struct cohort_tensor one[1] = { { "a", COHORT_F32, 1 } };
    struct cohort_tensor big_buffer[1] = { { "s", COHORT_F64, SIZE_MAX / 8 } };
    cfg.parameters = huge;
    cfg.n_parameters = 2;
    cr_assert_eq(cohort_create(&cfg, &c), -EINVAL, "parameter sizes that overflow");
    huge[0].numel = 1ull << 61;
    cfg.n_parameters = 1;
    cr_assert_eq(cohort_create(&cfg, &c), -EINVAL, "2^61 elements");
    cfg.parameters = one;
    cfg.buffers = big_buffer;
    cfg.n_buffers = 1;
    cr_assert_eq(cohort_create(&cfg, &c), -EINVAL, "a buffer too large");
    cr_assert_null(c);
    cohort_destroy(NULL);
}

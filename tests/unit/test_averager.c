/* tests/unit/test_averager.c: averagers (averager/averager.h) on a real
 * broker with a key, over loopback, each on its own thread: the weighted
 * average exactly, auxiliary members, gather, groups that mix by their
 * bits, a stalled peer excluded with the result naming who was averaged,
 * too few averagers, and refusals (bad steps, disagreeing schemas, and
 * Matchmake requests that prove nothing or name no member). */
#include <criterion/criterion.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "averager/averager.h"
#include "base/clock.h"
#include "base/secret.h"
#include "cohort.pb-c.h"
#include "engine/allreduce.h"
#include "fixture.h"
#include "membership/brokerd.h"
#include "membership/member.h"
#include "membership/proof.h"
#include "membership/wire.h"
#include "rpc/rpc.h"

#define N_MAX 8
#define COUNT 16

static struct brokerd *d;
static char broker[64];
static struct secret key;

static void start(void)
{
    struct brokerd_config cfg;

    cr_assert_eq(secret_generate(&key), 0);
    fixture_broker_config(&cfg);
    cfg.open = false;
    cfg.key = &key;
    d = fixture_broker_start_with(&cfg, "avg", broker, sizeof(broker));
}

static void stop(void)
{
    fixture_broker_stop(d);
}

TestSuite(averager, .init = start, .fini = stop, .timeout = 240);

static struct averager *make(const char *id, uint32_t target, uint32_t min, const char *bits,
                             const char *schema)
{
    struct averager_config c = {
        .broker = broker, .cohort = "avg", .id = id, .host = "127.0.0.1", .key = &key,
        .prefix = "run/avg", .initial_bits = bits, .target_group_size = target,
        .min_group_size = min, .min_matchmaking_ms = 300, .allreduce_timeout_ms = 3000,
        .count = COUNT, .schema = schema, .schema_len = strlen(schema),
    };
    struct averager *a = NULL;

    cr_assert_eq(averager_create(&c, &a), 0, "averager_create(%s)", id);
    cr_assert_eq(averager_wait(a, FIXTURE_WAIT_MS), 0);
    return a;
}

struct peer {
    struct averager *a;
    float data[COUNT];
    double weight;
    double alpha;               /* 0: 1 */
    char gather[32];
    uint32_t timeout_ms;
    int rc;
    struct averager_result *res;
    pthread_t t;
};

static void *step_main(void *arg)
{
    struct peer *p = arg;
    struct averager_step s = { .data = p->data, .weight = p->weight,
                               .alpha = p->alpha ? p->alpha : 1,
                               .gather = p->gather, .gather_len = strlen(p->gather),
                               .timeout_ms = p->timeout_ms ? p->timeout_ms : FIXTURE_WAIT_MS };

    p->res = NULL;
    p->rc = averager_step(p->a, &s, &p->res);
    return NULL;
}

static void run_all(struct peer *p, int n)
{
    for (int i = 0; i < n; i++)
        cr_assert_eq(pthread_create(&p[i].t, NULL, step_main, &p[i]), 0);
    for (int i = 0; i < n; i++)
        pthread_join(p[i].t, NULL);
}

static void free_all(struct peer *p, int n)
{
    for (int i = 0; i < n; i++) {
        averager_result_free(p[i].res);
        averager_destroy(p[i].a);
    }
}

/* Four contributors weighted 1..4 and one auxiliary member: the average is
 * exactly sum(w x) / 10 at every contributor, the auxiliary member's data
 * is untouched, and every member gathers every member's bytes. */
Test(averager, weighted_average_is_exact_with_an_auxiliary_member)
{
    struct peer p[5] = { 0 };
    char id[16];

    for (int i = 0; i < 5; i++) {
        snprintf(id, sizeof(id), "w-%d", i);
        p[i].a = make(id, 5, 5, "", "f32x16");
        p[i].weight = i < 4 ? i + 1 : 0;
        snprintf(p[i].gather, sizeof(p[i].gather), "batch=%d", 32 * (i + 1));
        for (int j = 0; j < COUNT; j++)
            p[i].data[j] = i < 4 ? (float)(10 * (i + 1) + j) : -7.0f;
    }
    run_all(p, 5);
    for (int i = 0; i < 5; i++) {
        cr_assert_eq(p[i].rc, 0, "w-%d: %s", i, averager_last_error(p[i].a));
        cr_assert_eq(p[i].res->n, 5);
        cr_assert_eq(p[i].res->group, p[0].res->group);
        for (int j = 0; j < COUNT; j++)
            cr_assert_eq(p[i].data[j], i < 4 ? (float)(30 + j) : -7.0f, "w-%d[%d] = %g", i, j,
                         p[i].data[j]);
        for (size_t k = 0; k < 5; k++) {
            char want[32];

            cr_assert_str_eq(p[i].res->ids[k], (snprintf(id, sizeof(id), "w-%zu", k), id));
            cr_assert_eq(p[i].res->weights[k], k < 4 ? (double)(k + 1) : 0.0);
            snprintf(want, sizeof(want), "batch=%zu", 32 * (k + 1));
            cr_assert_eq(p[i].res->gathered_len[k], strlen(want));
            cr_assert_eq(memcmp(p[i].res->gathered[k], want, strlen(want)), 0);
        }
    }
    free_all(p, 5);
}

/* Eight averagers in pairs whose bits move after each round (the key
 * manager's shift): after three rounds every one holds the global mean. */
Test(averager, pairs_that_mix_by_bits_reach_the_global_mean_in_three_rounds)
{
    struct peer p[N_MAX] = { 0 };
    char id[16], bits[3];

    for (int i = 0; i < N_MAX; i++) {
        snprintf(id, sizeof(id), "w-%d", i);
        bits[0] = (i >> 2) & 1 ? '1' : '0';
        bits[1] = (i >> 1) & 1 ? '1' : '0';
        bits[2] = '\0';
        p[i].a = make(id, 2, 2, bits, "f32x16");
        p[i].weight = 1;
        for (int j = 0; j < COUNT; j++)
            p[i].data[j] = (float)(8 * i + j);
    }
    for (int round = 0; round < 3; round++) {
        run_all(p, N_MAX);
        for (int i = 0; i < N_MAX; i++) {
            cr_assert_eq(p[i].rc, 0, "round %d w-%d: %s", round, i,
                         averager_last_error(p[i].a));
            cr_assert_eq(p[i].res->n, 2);
            averager_result_free(p[i].res);
            p[i].res = NULL;
        }
    }
    /* mean of 8 i + j over i = 0..7 is 28 + j */
    for (int i = 0; i < N_MAX; i++)
        for (int j = 0; j < COUNT; j++)
            cr_assert_eq(p[i].data[j], (float)(28 + j), "w-%d[%d] = %g", i, j, p[i].data[j]);
    free_all(p, N_MAX);
}

/* averaging_alpha moves each member's data that far toward the average;
 * a member with no gather bytes gathers an empty entry. */
Test(averager, alpha_moves_toward_the_average_by_that_fraction)
{
    struct peer p[2] = { 0 };

    p[0].a = make("w-0", 2, 2, "", "f32x16");
    p[1].a = make("w-1", 2, 2, "", "f32x16");
    for (int i = 0; i < 2; i++) {
        p[i].weight = 1;
        p[i].alpha = 0.5;
        for (int j = 0; j < COUNT; j++)
            p[i].data[j] = (float)(4 * i + 8 * j);
    }
    snprintf(p[0].gather, sizeof(p[0].gather), "x");
    run_all(p, 2);
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(p[i].rc, 0, "%s", averager_last_error(p[i].a));
        /* average 2 + 8 j; halfway from 8 j is 1 + 8 j, from 4 + 8 j is 3 + 8 j */
        for (int j = 0; j < COUNT; j++)
            cr_assert_eq(p[i].data[j], (float)(1 + 2 * i + 8 * j), "w-%d[%d] = %g", i, j,
                         p[i].data[j]);
        cr_assert_eq(p[i].res->gathered_len[0], 1);
        cr_assert_eq(p[i].res->gathered[0][0], 'x');
        cr_assert_eq(p[i].res->gathered_len[1], 0);
    }
    free_all(p, 2);
}

/* ---- a stalled peer ------------------------------------------------------- */

struct stalled {
    struct member *m;
    int fd;
    bool stop;
    pthread_t t;
};

static void *stalled_poll(void *arg)
{
    struct stalled *s = arg;

    while (!__atomic_load_n(&s->stop, __ATOMIC_ACQUIRE)) {
        member_poll(s->m, clock_now_ms());
        usleep(20000);
    }
    return NULL;
}

static void ignore_msg(void *arg, ProtobufCMessage *msg)
{
    protobuf_c_message_free_unpacked(msg, NULL);
}

static void ignore_end(void *arg, const struct rpc_status *st)
{
}

static bool joined(void *arg)
{
    return member_joins(arg) > 0;
}

/* A member that asks for a group and then never answers on its data
 * address (a listener nobody accepts on): the others' attempt times out,
 * they ask again without it, and their result names only themselves. */
Test(averager, a_stalled_peer_is_excluded_and_the_result_names_who_was_averaged)
{
    Cohort__V1__MatchmakeRequest q = COHORT__V1__MATCHMAKE_REQUEST__INIT;
    struct member_config mc = { 0 };
    struct stalled s = { 0 };
    struct rpc_watch *w = NULL;
    struct peer p[2] = { 0 };
    char addr[64];

    cr_assert_eq(allreduce_listen("127.0.0.1", &s.fd, addr, sizeof(addr)), 0);
    mc.broker = broker;
    mc.cohort = "avg";
    mc.id = "w-stalled";
    mc.address = addr;
    mc.key = &key;
    mc.quiet = true;
    cr_assert_eq(member_create(&mc, &s.m), 0);
    cr_assert_eq(pthread_create(&s.t, NULL, stalled_poll, &s), 0);
    cr_assert(fixture_wait_until(joined, s.m, FIXTURE_WAIT_MS));
    q.prefix = "run/avg";
    q.group_bits = "";
    q.target_group_size = 3;
    q.min_group_size = 2;
    q.min_matchmaking_ms = 300;
    q.timeout_ms = 60000;
    q.schema.data = (uint8_t *)"f32x16";
    q.schema.len = 6;
    cr_assert_eq(member_matchmake(s.m, &q, ignore_msg, ignore_end, NULL, &w), 0);

    p[0].a = make("w-a", 3, 2, "", "f32x16");
    p[1].a = make("w-b", 3, 2, "", "f32x16");
    for (int i = 0; i < 2; i++) {
        p[i].weight = 1;
        for (int j = 0; j < COUNT; j++)
            p[i].data[j] = (float)(2 * i + 2 * j);
    }
    run_all(p, 2);
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(p[i].rc, 0, "%s", averager_last_error(p[i].a));
        cr_assert_eq(p[i].res->attempts, 2, "the first group held the stalled peer");
        cr_assert_eq(p[i].res->n, 2);
        cr_assert_str_eq(p[i].res->ids[0], "w-a");
        cr_assert_str_eq(p[i].res->ids[1], "w-b");
        for (int j = 0; j < COUNT; j++)
            cr_assert_eq(p[i].data[j], (float)(1 + 2 * j));
    }
    free_all(p, 2);
    rpc_watch_close(w);
    __atomic_store_n(&s.stop, true, __ATOMIC_RELEASE);
    pthread_join(s.t, NULL);
    member_destroy(s.m);
    close(s.fd);
}

Test(averager, too_few_fail_within_the_timeout_with_the_brokers_reason)
{
    struct peer p = { 0 };
    uint64_t t0;

    p.a = make("alone", 4, 2, "", "f32x16");
    p.weight = 1;
    p.timeout_ms = 1500;
    for (int j = 0; j < COUNT; j++)
        p.data[j] = (float)j;
    t0 = clock_now_ms();
    step_main(&p);
    cr_assert_eq(p.rc, -ETIMEDOUT);
    cr_assert_lt(clock_now_ms() - t0, 1500 + 10000);
    cr_assert(strstr(averager_last_error(p.a), "too few"), "%s", averager_last_error(p.a));
    for (int j = 0; j < COUNT; j++)
        cr_assert_eq(p.data[j], (float)j, "untouched");
    averager_destroy(p.a);
}

Test(averager, bad_steps_and_disagreeing_schemas_get_clear_errors)
{
    struct peer p[2] = { 0 };
    struct averager_step s = { .weight = -1, .alpha = 1 };
    struct averager_result *r = NULL;

    p[0].a = make("w-x", 2, 2, "", "f32x16");
    p[1].a = make("w-y", 2, 2, "", "f64x16");
    s.data = p[0].data;
    cr_assert_eq(averager_step(p[0].a, &s, &r), -EINVAL);
    cr_assert(strstr(averager_last_error(p[0].a), "weight"));
    s.weight = 1;
    s.alpha = 1.5;
    cr_assert_eq(averager_step(p[0].a, &s, &r), -EINVAL);
    /* w-x waits; w-y asks with another schema and is refused at once. */
    p[0].weight = 1;
    p[0].timeout_ms = 3000;
    cr_assert_eq(pthread_create(&p[0].t, NULL, step_main, &p[0]), 0);
    usleep(300000);
    p[1].weight = 1;
    p[1].timeout_ms = 2000;
    step_main(&p[1]);
    pthread_join(p[0].t, NULL);
    cr_assert_eq(p[1].rc, -EPROTO, "%d: %s", p[1].rc, averager_last_error(p[1].a));
    cr_assert(strstr(averager_last_error(p[1].a), "schema"), "%s",
              averager_last_error(p[1].a));
    cr_assert_eq(p[0].rc, -ETIMEDOUT);
    free_all(p, 2);
}

/* An averager with another key never joins: its step fails within the
 * timeout and says why. */
Test(averager, an_averager_with_another_key_says_it_has_not_joined)
{
    struct secret other;
    struct averager_config c = {
        .broker = broker, .cohort = "avg", .id = "w-wrong", .host = "127.0.0.1", .key = &other,
        .prefix = "run/avg", .target_group_size = 2, .min_group_size = 2, .count = COUNT,
        .schema = "f32x16", .schema_len = 6,
    };
    struct averager *a = NULL;
    struct averager_result *r = NULL;
    float data[COUNT] = { 0 };
    struct averager_step st = { .data = data, .weight = 1, .alpha = 1, .timeout_ms = 1000 };

    cr_assert_eq(secret_generate(&other), 0);
    cr_assert_eq(averager_create(&c, &a), 0);
    cr_assert_eq(averager_wait(a, 500), -ETIMEDOUT);
    cr_assert_eq(averager_step(a, &st, &r), -ETIMEDOUT);
    cr_assert(strstr(averager_last_error(a), "not joined"), "%s", averager_last_error(a));
    averager_destroy(a);
}

/* ---- Matchmake requests the broker refuses -------------------------------- */

struct ended {
    pthread_mutex_t lock;
    bool done;
    struct rpc_status st;
};

static void end_rec(void *arg, const struct rpc_status *st)
{
    struct ended *e = arg;

    pthread_mutex_lock(&e->lock);
    e->st = *st;
    e->done = true;
    pthread_mutex_unlock(&e->lock);
}

static bool ended_done(void *arg)
{
    struct ended *e = arg;
    bool done;

    pthread_mutex_lock(&e->lock);
    done = e->done;
    pthread_mutex_unlock(&e->lock);
    return done;
}

enum proving { NO_PROOF, WRONG_MAC, GOOD_PROOF };

static enum rpc_code raw_matchmake(const char *cohort, const char *id, enum proving how)
{
    Cohort__V1__MatchmakeRequest q = COHORT__V1__MATCHMAKE_REQUEST__INIT;
    Cohort__V1__Proof pf = COHORT__V1__PROOF__INIT;
    struct ended e = { .done = false };
    struct rpc_channel *ch = NULL;
    struct rpc_watch *w = NULL;
    uint8_t mac[32] = { 1 };

    pthread_mutex_init(&e.lock, NULL);
    q.protocol_version = WIRE_PROTOCOL_VERSION;
    q.cohort = (char *)cohort;
    q.id = (char *)id;
    q.session = 42;
    q.prefix = "run/avg";
    q.group_bits = "";
    q.target_group_size = 2;
    q.min_group_size = 2;
    q.timeout_ms = 1000;
    if (how == GOOD_PROOF) {
        cr_assert_eq(proof_sign(&key, &q.base, 1, proof_now_ms(), &pf, mac), 0);
        q.proof = &pf;
    } else if (how == WRONG_MAC) {
        pf.seq = 1;
        pf.time_ms = 1;
        pf.mac.data = mac;
        pf.mac.len = sizeof(mac);
        q.proof = &pf;
    }
    cr_assert_eq(rpc_channel_create(broker, NULL, &ch), 0);
    cr_assert_eq(rpc_watch_open(ch, WIRE_BROKER_MATCHMAKE, &q.base,
                                &cohort__v1__matchmake_reply__descriptor, RPC_WAIT_FOR_READY,
                                ignore_msg, end_rec, &e, &w), 0);
    cr_assert(fixture_wait_until(ended_done, &e, FIXTURE_WAIT_MS));
    rpc_watch_close(w);
    rpc_channel_destroy(ch);
    pthread_mutex_destroy(&e.lock);
    return e.st.code;
}

Test(averager, matchmake_that_proves_nothing_or_names_no_member_is_refused)
{
    cr_assert_eq(raw_matchmake("avg", "w-q", NO_PROOF), RPC_UNAUTHENTICATED);
    cr_assert_eq(raw_matchmake("avg", "w-q", WRONG_MAC), RPC_UNAUTHENTICATED, "a wrong MAC");
    cr_assert_eq(raw_matchmake("avg", "w-q", GOOD_PROOF), RPC_NOT_FOUND, "not a member");
    cr_assert_eq(raw_matchmake("nope", "w-q", GOOD_PROOF), RPC_NOT_FOUND, "unknown cohort");
    cr_assert_eq(raw_matchmake("avg", "bad id!", GOOD_PROOF), RPC_INVALID_ARGUMENT);
}

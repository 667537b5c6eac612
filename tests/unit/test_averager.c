/* tests/unit/test_averager.c: averagers (averager/averager.h) on a real
 * broker with a key, over loopback, each on its own thread: the weighted
 * average exactly, auxiliary members, gather, groups that mix by their
 * bits, a stalled peer excluded with the result naming who was averaged,
 * too few averagers, and refusals (bad steps, disagreeing schemas, and
 * Matchmake requests that prove nothing or name no member); averager_abort
 * mid-all-reduce and the others finishing without an aborted averager;
 * integrity_mac as part of the schema. */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "averager/averager.h"
#include "avpeers.h"
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
#define COUNT AVPEERS_COUNT

static struct brokerd *d;
static char broker[64];
static struct secret key;

static void start(void)
{
    d = fixture_keyed_broker_start("avg", &key, broker, sizeof(broker));
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

/* Four contributors weighted 1..4 and one auxiliary member: the average is
 * exactly sum(w x) / 10 at every contributor, the auxiliary member's data
 * is untouched, and every member gathers every member's bytes. */
Test(averager, weighted_average_is_exact_with_an_auxiliary_member)
{
    struct avpeer p[5] = { 0 };
    char id[16];

    for (int i = 0; i < 5; i++) {
        snprintf(id, sizeof(id), "w-%d", i);
        p[i].a = make(id, 5, 5, "", "f32x16");
        p[i].weight = i < 4 ? i + 1 : 0;
        snprintf(p[i].gather, sizeof(p[i].gather), "batch=%d", 32 * (i + 1));
        for (int j = 0; j < COUNT; j++)
            p[i].data[j] = i < 4 ? (float)(10 * (i + 1) + j) : -7.0f;
    }
    avpeers_run(p, 5);
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
    avpeers_free(p, 5);
}

/* Eight averagers in pairs whose bits move after each round (the key
 * manager's shift): after three rounds every one holds the global mean. */
Test(averager, pairs_that_mix_by_bits_reach_the_global_mean_in_three_rounds)
{
    struct avpeer p[N_MAX] = { 0 };
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
        avpeers_run(p, N_MAX);
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
    avpeers_free(p, N_MAX);
}

/* averaging_alpha moves each member's data that far toward the average;
 * a member with no gather bytes gathers an empty entry. */
Test(averager, alpha_moves_toward_the_average_by_that_fraction)
{
    struct avpeer p[2] = { 0 };

    p[0].a = make("w-0", 2, 2, "", "f32x16");
    p[1].a = make("w-1", 2, 2, "", "f32x16");
    for (int i = 0; i < 2; i++) {
        p[i].weight = 1;
        p[i].alpha = 0.5;
        for (int j = 0; j < COUNT; j++)
            p[i].data[j] = (float)(4 * i + 8 * j);
    }
    snprintf(p[0].gather, sizeof(p[0].gather), "x");
    avpeers_run(p, 2);
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
    avpeers_free(p, 2);
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

/* Starts a member `id` that asks the broker for a group of `target` (at
 * least 2) with prefix `prefix` and the schema of an "f32x16" averager
 * without a codec, then never answers its groupmates: its address is a
 * listener nobody accepts on. */
static void stalled_start(struct stalled *s, const char *id, const char *prefix,
                          uint32_t target, struct rpc_watch **w)
{
    Cohort__V1__MatchmakeRequest q = COHORT__V1__MATCHMAKE_REQUEST__INIT;
    struct member_config mc = { 0 };
    char addr[64];

    cr_assert_eq(allreduce_listen("127.0.0.1", &s->fd, addr, sizeof(addr)), 0);
    mc.broker = broker;
    mc.cohort = "avg";
    mc.id = id;
    mc.address = addr;
    mc.key = &key;
    mc.quiet = true;
    cr_assert_eq(member_create(&mc, &s->m), 0);
    cr_assert_eq(pthread_create(&s->t, NULL, stalled_poll, s), 0);
    cr_assert(fixture_wait_until(joined, s->m, FIXTURE_WAIT_MS));
    q.prefix = (char *)prefix;
    q.group_bits = "";
    q.target_group_size = target;
    q.min_group_size = 2;
    q.min_matchmaking_ms = 300;
    q.timeout_ms = 60000;
    /* What an averager of "f32x16" without a codec sends: the codec's
     * byte (CODEC_NONE), its count (16, eight bytes little-endian), its
     * min_vector_size (0, eight bytes), then its schema. */
    q.schema.data = (uint8_t *)"\0\x10\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0f32x16";
    q.schema.len = 23;
    cr_assert_eq(member_matchmake(s->m, &q, ignore_msg, ignore_end, NULL, w), 0);
}

static void stalled_stop(struct stalled *s, struct rpc_watch *w)
{
    rpc_watch_close(w);
    __atomic_store_n(&s->stop, true, __ATOMIC_RELEASE);
    pthread_join(s->t, NULL);
    member_destroy(s->m);
    close(s->fd);
}

/* A member that asks for a group and then never answers on its data
 * address (a listener nobody accepts on): the others' attempt times out,
 * they ask again without it, and their result names only themselves. */
Test(averager, a_stalled_peer_is_excluded_and_the_result_names_who_was_averaged)
{
    struct stalled s = { 0 };
    struct rpc_watch *w = NULL;
    struct avpeer p[2] = { 0 };

    stalled_start(&s, "w-stalled", "run/avg", 3, &w);

    p[0].a = make("w-a", 3, 2, "", "f32x16");
    p[1].a = make("w-b", 3, 2, "", "f32x16");
    for (int i = 0; i < 2; i++) {
        p[i].weight = 1;
        for (int j = 0; j < COUNT; j++)
            p[i].data[j] = (float)(2 * i + 2 * j);
    }
    avpeers_run(p, 2);
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(p[i].rc, 0, "%s", averager_last_error(p[i].a));
        cr_assert_eq(p[i].res->attempts, 2, "the first group held the stalled peer");
        cr_assert_eq(p[i].res->n, 2);
        cr_assert_str_eq(p[i].res->ids[0], "w-a");
        cr_assert_str_eq(p[i].res->ids[1], "w-b");
        for (int j = 0; j < COUNT; j++)
            cr_assert_eq(p[i].data[j], (float)(1 + 2 * j));
    }
    avpeers_free(p, 2);
    stalled_stop(&s, w);
}

/* averager_abort from another thread while the step is in its all-reduce
 * with a peer that never answers (a listener nobody accepts on; the
 * averager, first in the group's order, dials it): the step ends with
 * -ECANCELED well within the engine's member timeout (30 s), and every
 * later step at once. */
Test(averager, abort_ends_a_step_in_its_all_reduce_promptly)
{
    struct averager_config c = {
        .broker = broker, .cohort = "avg", .id = "ab-0", .host = "127.0.0.1", .key = &key,
        .prefix = "run/abort", .initial_bits = "", .target_group_size = 2,
        .min_group_size = 2, .min_matchmaking_ms = 300, .allreduce_timeout_ms = 30000,
        .count = COUNT, .schema = "f32x16", .schema_len = 6,
    };
    struct stalled s = { 0 };
    struct rpc_watch *w = NULL;
    struct avpeer p = { 0 };
    struct pollfd pfd;
    uint64_t t0;

    stalled_start(&s, "zz-stalled", "run/abort", 2, &w);

    cr_assert_eq(averager_create(&c, &p.a), 0);
    cr_assert_eq(averager_wait(p.a, FIXTURE_WAIT_MS), 0);
    p.weight = 1;
    p.timeout_ms = 120000;
    cr_assert_eq(pthread_create(&p.t, NULL, avpeers_step, &p), 0);
    /* The averager's dial reaching the stalled listener: the group formed
     * and its all-reduce is under way. */
    pfd = (struct pollfd){ .fd = s.fd, .events = POLLIN };
    cr_assert_eq(poll(&pfd, 1, FIXTURE_WAIT_MS), 1, "the averager never dialled its groupmate");
    t0 = clock_now_ms();
    averager_abort(p.a);
    averager_abort(p.a);        /* more than once is fine */
    pthread_join(p.t, NULL);
    cr_assert_eq(p.rc, -ECANCELED, "rc %d: %s", p.rc, averager_last_error(p.a));
    cr_assert_lt(clock_now_ms() - t0, 15000, "the step ran on to the member timeout");
    cr_assert(strstr(averager_last_error(p.a), "aborted"), "%s", averager_last_error(p.a));
    avpeers_step(&p);
    cr_assert_eq(p.rc, -ECANCELED);
    avpeers_free(&p, 1);
    stalled_stop(&s, w);
}

static bool asked(void *arg)
{
    struct avpeer *p = arg;

    /* The step has begun (asking for a group, or about to). */
    return __atomic_load_n(&p->rc, __ATOMIC_ACQUIRE) == 1;
}

static void *step_flagged(void *arg)
{
    struct avpeer *p = arg;

    __atomic_store_n(&p->rc, 1, __ATOMIC_RELEASE);
    return avpeers_step(p);
}

/* An averager aborted once its step has begun, still a member (as a
 * sidecar's is until its step returns): two that ask after it average
 * with each other, not with it, well within the engine's member timeout,
 * and the result names only them. (test_py_hivemind_sidecar.py aborts
 * one seen waiting at the broker; the test above, one in its all-reduce.) */
Test(averager, the_others_finish_without_an_aborted_averager)
{
    struct avpeer p[3] = { 0 };
    uint64_t t0;

    for (int i = 0; i < 3; i++) {
        char id[16];
        struct averager_config c = {
            .broker = broker, .cohort = "avg", .id = id, .host = "127.0.0.1", .key = &key,
            .prefix = "run/gone", .initial_bits = "", .target_group_size = 3,
            .min_group_size = 2, .min_matchmaking_ms = 1000, .allreduce_timeout_ms = 30000,
            .count = COUNT, .schema = "f32x16", .schema_len = 6,
        };

        snprintf(id, sizeof(id), "g-%d", i);
        cr_assert_eq(averager_create(&c, &p[i].a), 0);
        cr_assert_eq(averager_wait(p[i].a, FIXTURE_WAIT_MS), 0);
        p[i].weight = 1;
        p[i].timeout_ms = 120000;
        for (int j = 0; j < COUNT; j++)
            p[i].data[j] = (float)(2 * i + 2 * j);
    }
    cr_assert_eq(pthread_create(&p[0].t, NULL, step_flagged, &p[0]), 0);
    cr_assert(fixture_wait_until(asked, &p[0], FIXTURE_WAIT_MS));
    averager_abort(p[0].a);
    pthread_join(p[0].t, NULL);
    cr_assert_eq(p[0].rc, -ECANCELED, "%s", averager_last_error(p[0].a));
    t0 = clock_now_ms();
    for (int i = 1; i < 3; i++)
        cr_assert_eq(pthread_create(&p[i].t, NULL, avpeers_step, &p[i]), 0);
    for (int i = 1; i < 3; i++)
        pthread_join(p[i].t, NULL);
    for (int i = 1; i < 3; i++) {
        cr_assert_eq(p[i].rc, 0, "%s", averager_last_error(p[i].a));
        cr_assert_eq(p[i].res->n, 2);
        cr_assert_str_eq(p[i].res->ids[0], "g-1");
        cr_assert_str_eq(p[i].res->ids[1], "g-2");
        /* the mean of 2 + 2 j and 4 + 2 j */
        for (int j = 0; j < COUNT; j++)
            cr_assert_eq(p[i].data[j], (float)(3 + 2 * j));
    }
    cr_assert_lt(clock_now_ms() - t0, 15000, "the round waited on the aborted averager");
    avpeers_free(p, 3);
}

/* An averager under integrity_mac without a key is refused at create; two
 * of them average exactly, and one asking beside an averager without
 * integrity is refused by the broker with a sentence naming both
 * settings, since the integrity is part of the schema. */
Test(averager, integrity_mac_is_part_of_the_schema)
{
    struct averager_config c = {
        .broker = broker, .cohort = "avg", .id = "mac-0", .host = "127.0.0.1",
        .integrity_mac = true, .prefix = "run/mac", .initial_bits = "",
        .target_group_size = 2, .min_group_size = 2, .min_matchmaking_ms = 300,
        .allreduce_timeout_ms = 3000, .count = COUNT, .schema = "f32x16", .schema_len = 6,
    };
    struct avpeer p[2] = { 0 };
    struct averager *none = NULL;
    struct avpeer q = { 0 };

    cr_assert_eq(averager_create(&c, &p[0].a), -EINVAL, "integrity_mac without a key");
    c.key = &key;
    for (int i = 0; i < 2; i++) {
        c.id = i ? "mac-1" : "mac-0";
        cr_assert_eq(averager_create(&c, &p[i].a), 0);
        cr_assert_eq(averager_wait(p[i].a, FIXTURE_WAIT_MS), 0);
        p[i].weight = 1;
        for (int j = 0; j < COUNT; j++)
            p[i].data[j] = (float)(2 * i + 2 * j);
    }
    avpeers_run(p, 2);
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(p[i].rc, 0, "%s", averager_last_error(p[i].a));
        for (int j = 0; j < COUNT; j++)
            cr_assert_eq(p[i].data[j], (float)(1 + 2 * j));
        averager_result_free(p[i].res);
        p[i].res = NULL;
    }
    /* mac-0 waits; an averager without integrity asks beside it. */
    p[0].timeout_ms = 8000;
    cr_assert_eq(pthread_create(&p[0].t, NULL, avpeers_step, &p[0]), 0);
    c.integrity_mac = false;
    c.id = "plain-0";
    cr_assert_eq(averager_create(&c, &none), 0);
    cr_assert_eq(averager_wait(none, FIXTURE_WAIT_MS), 0);
    q.a = none;
    q.weight = 1;
    q.timeout_ms = 8000;
    /* Whichever asks second is refused; the other finds no group. */
    avpeers_step(&q);
    pthread_join(p[0].t, NULL);
    cr_assert(q.rc < 0 && p[0].rc < 0, "averagers of different integrity averaged");
    if (q.rc == -EPROTO)
        cr_assert(strstr(averager_last_error(none), "--integrity none"), "%s",
                  averager_last_error(none));
    else
        cr_assert(p[0].rc == -EPROTO && strstr(averager_last_error(p[0].a), "--integrity mac"),
                  "rc %d %d: %s / %s", q.rc, p[0].rc, averager_last_error(p[0].a),
                  averager_last_error(none));
    averager_result_free(q.res);
    averager_destroy(none);
    /* An auxiliary averager joins any schema, and refuses the group's
     * integrity when it is not its own. */
    c.id = "plain-aux";
    c.count = 0;
    c.schema = NULL;
    c.schema_len = 0;
    memset(&q, 0, sizeof(q));
    cr_assert_eq(averager_create(&c, &q.a), 0);
    cr_assert_eq(averager_wait(q.a, FIXTURE_WAIT_MS), 0);
    q.timeout_ms = 8000;
    p[1].timeout_ms = 8000;
    cr_assert_eq(pthread_create(&p[1].t, NULL, avpeers_step, &p[1]), 0);
    avpeers_step(&q);
    pthread_join(p[1].t, NULL);
    cr_assert_eq(q.rc, -EPROTO, "rc %d: %s", q.rc, averager_last_error(q.a));
    cr_assert(strstr(averager_last_error(q.a), "--integrity mac"), "%s",
              averager_last_error(q.a));
    cr_assert(p[1].rc < 0, "mac-1 averaged with an averager of another integrity");
    averager_destroy(q.a);
    avpeers_free(p, 2);
}

Test(averager, too_few_fail_within_the_timeout_with_the_brokers_reason)
{
    struct avpeer p = { 0 };
    uint64_t t0;

    p.a = make("alone", 4, 2, "", "f32x16");
    p.weight = 1;
    p.timeout_ms = 1500;
    for (int j = 0; j < COUNT; j++)
        p.data[j] = (float)j;
    t0 = clock_now_ms();
    avpeers_step(&p);
    cr_assert_eq(p.rc, -ETIMEDOUT);
    cr_assert_lt(clock_now_ms() - t0, 1500 + 10000);
    cr_assert(strstr(averager_last_error(p.a), "too few"), "%s", averager_last_error(p.a));
    for (int j = 0; j < COUNT; j++)
        cr_assert_eq(p.data[j], (float)j, "untouched");
    averager_destroy(p.a);
}

Test(averager, bad_steps_and_disagreeing_schemas_get_clear_errors)
{
    struct avpeer p[2] = { 0 };
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
    cr_assert_eq(pthread_create(&p[0].t, NULL, avpeers_step, &p[0]), 0);
    usleep(300000);
    p[1].weight = 1;
    p[1].timeout_ms = 2000;
    avpeers_step(&p[1]);
    pthread_join(p[0].t, NULL);
    cr_assert_eq(p[1].rc, -EPROTO, "%d: %s", p[1].rc, averager_last_error(p[1].a));
    cr_assert(strstr(averager_last_error(p[1].a), "schema"), "%s",
              averager_last_error(p[1].a));
    cr_assert_eq(p[0].rc, -ETIMEDOUT);
    avpeers_free(p, 2);
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

/* ---- codecs ------------------------------------------------------------------ */

static struct averager *make_coded(const char *id, uint32_t target, enum codec codec)
{
    struct averager_config c = {
        .broker = broker, .cohort = "avg", .id = id, .host = "127.0.0.1", .key = &key,
        .prefix = "run/avg", .target_group_size = target, .min_group_size = target,
        .min_matchmaking_ms = 300, .allreduce_timeout_ms = 3000, .count = COUNT,
        .schema = "f32x16", .schema_len = 6, .codec = codec,
    };
    struct averager *a = NULL;

    cr_assert_eq(averager_create(&c, &a), 0, "averager_create(%s)", id);
    cr_assert_eq(averager_wait(a, FIXTURE_WAIT_MS), 0);
    return a;
}

/* n members (the last one auxiliary when aux) with weights that float32
 * holds but fp16 does not, values that are not integers, and gathers of
 * every length parity: every contributor ends with the same bytes, within
 * `bound` x max|x| of the exact average and not all equal to it (the codec
 * ran), each a value of the codec; the auxiliary member is untouched;
 * weights, lengths and gathered bytes arrive exactly. */
static void coded_round(enum codec codec, int n, bool aux, double bound)
{
    struct avpeer p[N_MAX] = { 0 };
    double exact[COUNT] = { 0 }, total = 0, maxabs = 0;
    bool differs = false;
    char id[16];

    for (int i = 0; i < n; i++) {
        snprintf(id, sizeof(id), "c-%d", i);
        p[i].a = make_coded(id, (uint32_t)n, codec);
        p[i].weight = aux && i == n - 1 ? 0 : 0.3 * (i + 1) + 1e-3;
        snprintf(p[i].gather, sizeof(p[i].gather), "%.*s", 5 + i, "gathered-bytes-");
        for (int j = 0; j < COUNT; j++) {
            p[i].data[j] = (float)((i + 1) * 37.3 * sin(0.7 * j + i) + 0.001 * j);
            if (fabs(p[i].data[j]) > maxabs)
                maxabs = fabs(p[i].data[j]);
        }
    }
    for (int i = 0; i < n; i++) {
        total += (float)p[i].weight;
        for (int j = 0; j < COUNT; j++)
            exact[j] += (float)p[i].weight * (double)p[i].data[j];
    }
    avpeers_run(p, n);
    for (int i = 0; i < n; i++) {
        cr_assert_eq(p[i].rc, 0, "c-%d: %s", i, averager_last_error(p[i].a));
        cr_assert_eq(p[i].res->n, (size_t)n);
        for (size_t k = 0; k < (size_t)n; k++) {
            cr_assert_eq(p[i].res->weights[k], (double)(float)p[k].weight, "weight of c-%zu", k);
            cr_assert_eq(p[i].res->gathered_len[k], strlen(p[k].gather));
            cr_assert_eq(memcmp(p[i].res->gathered[k], p[k].gather, strlen(p[k].gather)), 0);
        }
        if (aux && i == n - 1)
            continue;
        cr_assert_eq(memcmp(p[i].data, p[0].data, sizeof(p[0].data)), 0,
                     "c-%d ends with other bytes than c-0", i);
    }
    for (int j = 0; j < COUNT; j++) {
        double avg = exact[j] / total;
        float one = p[0].data[j];
        uint8_t scratch[16];

        cr_assert(fabs(p[0].data[j] - avg) <= bound * maxabs, "[%d] %.9g vs %.9g (bound %g)",
                  j, p[0].data[j], avg, bound * maxabs);
        differs |= p[0].data[j] != (float)avg;
        if (codec != CODEC_INT8) {      /* int8's values depend on their block */
            codec_round_trip(codec, &one, scratch, 1);
            cr_assert_eq(one, p[0].data[j], "[%d] %.9g is not a value of the codec", j,
                         p[0].data[j]);
        }
    }
    cr_assert(differs, "every value equals the float32 average: was the codec applied?");
    if (aux)
        for (int j = 0; j < COUNT; j++)
            cr_assert_eq(p[n - 1].data[j], (float)(n * 37.3 * sin(0.7 * j + n - 1) + 0.001 * j),
                         "the auxiliary member's data changed");
    avpeers_free(p, n);
}

/* fp16: each of the n - 1 partial sums and the result is encoded once,
 * each within 2^-11 relative (codec.h), so (n + 1) x 2^-11 x max|x|
 * bounds the error with room for float32's own roundings. */
Test(averager, fp16_round_is_within_the_codec_bound_and_alike_everywhere)
{
    coded_round(CODEC_FP16, 4, false, 5.0 / 2048);
}

/* An auxiliary member reduces with fp16 and contributes nothing. */
Test(averager, fp16_round_with_an_auxiliary_member)
{
    coded_round(CODEC_FP16, 3, true, 4.0 / 2048);
}

/* bf16: 2^-8 per encoding. */
Test(averager, bf16_round_is_within_the_codec_bound_and_alike_everywhere)
{
    coded_round(CODEC_BF16, 3, false, 4.0 / 256);
}

/* int8: at most half a step of max|block| / 127 per encoding, and every
 * partial sum of the average is at most max|x|. */
Test(averager, int8_round_is_within_the_codec_bound_and_alike_everywhere)
{
    coded_round(CODEC_INT8, 3, false, 4.0 / 254);
}

/* Averagers of different codecs never form a group: whichever asks second
 * is refused and told that the compression is part of the schema; the
 * other finds no partner. */
Test(averager, averagers_of_different_codecs_are_refused)
{
    struct avpeer p[2] = { 0 };
    int refused = -1;

    p[0].a = make_coded("c-none", 2, CODEC_NONE);
    p[1].a = make_coded("c-fp16", 2, CODEC_FP16);
    for (int i = 0; i < 2; i++) {
        p[i].weight = 1;
        p[i].timeout_ms = 3000;
    }
    avpeers_run(p, 2);
    for (int i = 0; i < 2; i++) {
        cr_assert(p[i].rc == -EPROTO || p[i].rc == -ETIMEDOUT, "%d: %s", p[i].rc,
                  averager_last_error(p[i].a));
        if (p[i].rc == -EPROTO)
            refused = i;
        for (int j = 0; j < COUNT; j++)
            cr_assert_eq(p[i].data[j], 0.0f, "a refused step changed the data");
    }
    cr_assert(refused >= 0 && p[1 - refused].rc == -ETIMEDOUT, "%d %d", p[0].rc, p[1].rc);
    cr_assert(strstr(averager_last_error(p[refused].a), "compression"), "%s",
              averager_last_error(p[refused].a));
    cr_assert(strstr(averager_last_error(p[refused].a), refused ? "fp16" : "none"), "%s",
              averager_last_error(p[refused].a));
    avpeers_free(p, 2);
}

/* An unknown codec, and a schema that leaves no room for the codec's
 * byte, are refused at creation. */
Test(averager, an_unknown_codec_or_a_full_schema_is_refused)
{
    char full[AVERAGER_SCHEMA_MAX + 2];
    struct averager_config c = {
        .broker = broker, .cohort = "avg", .id = "c-bad", .host = "127.0.0.1", .key = &key,
        .prefix = "run/avg", .target_group_size = 2, .min_group_size = 2, .count = COUNT,
        .schema = "f32x16", .schema_len = 6, .codec = (enum codec)CODEC_COUNT,
    };
    struct averager *a = NULL;

    cr_assert_eq(averager_create(&c, &a), -EINVAL);
    memset(full, 'x', sizeof(full));
    c.codec = CODEC_FP16;
    c.schema = full;
    c.schema_len = AVERAGER_SCHEMA_MAX + 1;
    cr_assert_eq(averager_create(&c, &a), -EINVAL);
    c.schema_len = AVERAGER_SCHEMA_MAX;
    cr_assert_eq(averager_create(&c, &a), 0);
    averager_destroy(a);
}

#define BIG (100 * 1000)

struct big_peer {
    struct averager *a;
    float *data;
    int rc;
    pthread_t t;
};

static void *big_main(void *arg)
{
    struct big_peer *p = arg;
    struct averager_step s = { .data = p->data, .weight = 1, .alpha = 1,
                               .timeout_ms = FIXTURE_WAIT_MS };
    struct averager_result *r = NULL;

    p->rc = averager_step(p->a, &s, &r);
    averager_result_free(r);
    return NULL;
}

/* Values large enough that the coded call runs as a ring (400 KB, over
 * the doubling threshold) among n, right after the metadata's exact
 * call, for three rounds: every round completes and every member ends
 * with the same bytes, within the bound of the exact mean. */
static void coded_ring_rounds(int n)
{
    struct big_peer p[4] = { 0 };
    char id[16];

    cr_assert(n <= 4);
    for (int i = 0; i < n; i++) {
        struct averager_config c = {
            .broker = broker, .cohort = "avg", .id = id, .host = "127.0.0.1", .key = &key,
            .prefix = "run/big", .target_group_size = (uint32_t)n,
            .min_group_size = (uint32_t)n,
            .min_matchmaking_ms = 300, .allreduce_timeout_ms = 10000, .count = BIG,
            .schema = "big", .schema_len = 3, .codec = CODEC_FP16,
        };

        snprintf(id, sizeof(id), "b-%d", i);
        cr_assert_eq(averager_create(&c, &p[i].a), 0);
        cr_assert_eq(averager_wait(p[i].a, FIXTURE_WAIT_MS), 0);
        p[i].data = malloc(BIG * sizeof(float));
        cr_assert(p[i].data);
        for (int j = 0; j < BIG; j++)
            p[i].data[j] = (float)((i + 1) * sin(0.001 * j + i));
    }
    for (int round = 0; round < 3; round++) {
        for (int i = 0; i < n; i++)
            cr_assert_eq(pthread_create(&p[i].t, NULL, big_main, &p[i]), 0);
        for (int i = 0; i < n; i++)
            pthread_join(p[i].t, NULL);
        for (int i = 0; i < n; i++) {
            cr_assert_eq(p[i].rc, 0, "round %d b-%d: %s", round, i,
                         averager_last_error(p[i].a));
            cr_assert_eq(memcmp(p[i].data, p[0].data, BIG * sizeof(float)), 0,
                         "round %d: b-%d ends with other bytes", round, i);
        }
    }
    for (int j = 0; j < BIG; j++) {
        double mean = 0;

        for (int i = 0; i < n; i++)
            mean += (i + 1) * sin(0.001 * j + i) / n;
        /* max|x| is n; three rounds of up to n + 1 encodings each */
        cr_assert(fabs(p[0].data[j] - mean) <= 3 * (n + 1) * n / 2048.0, "[%d] %g vs %g", j,
                  p[0].data[j], mean);
    }
    for (int i = 0; i < n; i++) {
        averager_destroy(p[i].a);
        free(p[i].data);
    }
}

Test(averager, a_coded_ring_after_the_exact_call_completes_alike_among_4)
{
    coded_ring_rounds(4);
}

/* Three: doubling with an extra member first, then the ring. */
Test(averager, a_coded_ring_after_the_exact_call_completes_alike_among_3)
{
    coded_ring_rounds(3);
}

/* ---- load balancing ---------------------------------------------------- */

static struct averager *make_balanced_coded(const char *id, uint32_t target, double bandwidth,
                                            bool client, enum codec codec)
{
    struct averager_config c = {
        .broker = broker, .cohort = "avg", .id = id, .host = "127.0.0.1", .key = &key,
        .prefix = "run/bal", .target_group_size = target, .min_group_size = target,
        .min_matchmaking_ms = 300, .allreduce_timeout_ms = 3000, .count = COUNT,
        .schema = "f32x16", .schema_len = 6, .has_bandwidth = bandwidth >= 0,
        .bandwidth = bandwidth, .client_mode = client, .codec = codec,
    };
    struct averager *a = NULL;

    cr_assert_eq(averager_create(&c, &a), 0, "averager_create(%s)", id);
    cr_assert_eq(averager_wait(a, FIXTURE_WAIT_MS), 0);
    return a;
}

static struct averager *make_balanced(const char *id, uint32_t target, double bandwidth,
                                      bool client)
{
    return make_balanced_coded(id, target, bandwidth, client, CODEC_NONE);
}

/* Two clients, members of bandwidth 3, not given and 1 (the last one
 * auxiliary): the average is exact at every contributor, the round's
 * order puts the clients first, and the auxiliary member is untouched. */
Test(averager, clients_and_bandwidths_average_exactly)
{
    struct avpeer p[5] = { 0 };
    const double bw[5] = { 3, -1, 1, -1, -1 };
    const bool client[5] = { false, false, false, true, true };
    const double weight[5] = { 3, 4, 0, 1, 2 };
    const char *order[5] = { "b-3", "b-4", "b-0", "b-1", "b-2" };
    char id[16];

    for (int i = 0; i < 5; i++) {
        snprintf(id, sizeof(id), "b-%d", i);
        p[i].a = make_balanced(id, 5, bw[i], client[i]);
        p[i].weight = weight[i];
        snprintf(p[i].gather, sizeof(p[i].gather), "%s", id);
        for (int j = 0; j < COUNT; j++)
            p[i].data[j] = weight[i] > 0 ? (float)(10 * (i + 1) + j) : -7.0f;
    }
    avpeers_run(p, 5);
    for (int i = 0; i < 5; i++) {
        cr_assert_eq(p[i].rc, 0, "b-%d: %s", i, averager_last_error(p[i].a));
        cr_assert_eq(p[i].res->n, 5);
        for (size_t k = 0; k < 5; k++) {
            cr_assert_str_eq(p[i].res->ids[k], order[k]);
            cr_assert_eq(p[i].res->gathered_len[k], strlen(order[k]));
            cr_assert(memcmp(p[i].res->gathered[k], order[k], strlen(order[k])) == 0);
        }
        for (int j = 0; j < COUNT; j++) {
            /* (3 x (10 + j) + 4 x (20 + j) + 1 x (40 + j) + 2 x (50 + j)) / 10 */
            float want = weight[i] > 0 ? (float)((250 + 10 * j) / 10.0) : -7.0f;

            cr_assert_eq(p[i].data[j], want, "b-%d[%d] = %g, want %g", i, j, p[i].data[j],
                         want);
        }
    }
    avpeers_free(p, 5);
}

/* A group in which nobody can reduce fails at once, alike everywhere,
 * with a sentence that says why; nothing is written. */
Test(averager, a_group_of_clients_and_zero_bandwidth_fails_clearly)
{
    struct avpeer p[2] = { 0 };

    p[0].a = make_balanced("z-0", 2, -1, true);
    p[1].a = make_balanced("z-1", 2, 0, false);
    for (int i = 0; i < 2; i++) {
        p[i].weight = 1;
        p[i].timeout_ms = 20000;
        for (int j = 0; j < COUNT; j++)
            p[i].data[j] = (float)(i + j);
    }
    avpeers_run(p, 2);
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(p[i].rc, -ENODATA, "z-%d: %d", i, p[i].rc);
        cr_assert(strstr(averager_last_error(p[i].a), "no member of the group can reduce"),
                  "%s", averager_last_error(p[i].a));
        for (int j = 0; j < COUNT; j++)
            cr_assert_eq(p[i].data[j], (float)(i + j), "untouched");
    }
    avpeers_free(p, 2);
}

/* With a codec, clients and bandwidths: the exact metadata call and the
 * coded values call are both butterflies. Every contributor ends with
 * the same bytes, within two fp16 encodings (a contribution's and the
 * result's, 2^-11 relative each, of values at most max|x|) of the exact
 * average and not equal to it everywhere; weights and gathered bytes
 * are exact. */
static void coded_balanced_round(enum codec codec, double bound)
{
    struct avpeer p[4] = { 0 };
    const double bw[4] = { 2, -1, 0, -1 };
    const bool client[4] = { false, false, false, true };
    const double weight[4] = { 1.5, 2, 0.25, 1 };
    double exact[COUNT] = { 0 }, total = 0, maxabs = 0;
    bool differs = false;
    char id[16];

    for (int i = 0; i < 4; i++) {
        snprintf(id, sizeof(id), "k-%d", i);
        p[i].a = make_balanced_coded(id, 4, bw[i], client[i], codec);
        p[i].weight = weight[i];
        snprintf(p[i].gather, sizeof(p[i].gather), "%s", id);
        for (int j = 0; j < COUNT; j++) {
            p[i].data[j] = (float)((i + 1) * 37.3 * sin(0.7 * j + i) + 0.001 * j);
            maxabs = fabs(p[i].data[j]) > maxabs ? fabs(p[i].data[j]) : maxabs;
            exact[j] += (float)weight[i] * (double)p[i].data[j];
        }
        total += (float)weight[i];
    }
    avpeers_run(p, 4);
    for (int i = 0; i < 4; i++) {
        cr_assert_eq(p[i].rc, 0, "k-%d: %s", i, averager_last_error(p[i].a));
        cr_assert_eq(p[i].res->n, 4);
        cr_assert_str_eq(p[i].res->ids[0], "k-3", "the client first");
        for (size_t k = 0; k < 4; k++) {
            const char *who = p[i].res->ids[k];
            int w = who[2] - '0';

            cr_assert_eq(p[i].res->weights[k], (double)(float)weight[w], "weight of %s", who);
            cr_assert_eq(p[i].res->gathered_len[k], strlen(who));
            cr_assert(memcmp(p[i].res->gathered[k], who, strlen(who)) == 0);
        }
        cr_assert_eq(memcmp(p[i].data, p[0].data, sizeof(p[0].data)), 0,
                     "k-%d ends with other bytes than k-0", i);
    }
    for (int j = 0; j < COUNT; j++) {
        double avg = exact[j] / total;

        cr_assert(fabs(p[0].data[j] - avg) <= bound * maxabs, "[%d] %.9g vs %.9g (bound %g)",
                  j, p[0].data[j], avg, bound * maxabs);
        differs |= p[0].data[j] != (float)avg;
    }
    cr_assert(differs, "every value equals the float32 average: was the codec applied?");
    avpeers_free(p, 4);
}

Test(averager, clients_and_bandwidths_with_fp16_alike_within_its_bound)
{
    coded_balanced_round(CODEC_FP16, 3.0 / 2048);
}

/* int8: half a step of max|block| / 127 per encoding. */
Test(averager, clients_and_bandwidths_with_int8_alike_within_its_bound)
{
    coded_balanced_round(CODEC_INT8, 3.0 / 254);
}

Test(averager, a_bandwidth_that_is_not_a_number_is_refused)
{
    struct averager_config c = {
        .broker = broker, .cohort = "avg", .id = "q-0", .host = "127.0.0.1", .key = &key,
        .prefix = "run/bal", .target_group_size = 2, .min_group_size = 2, .count = COUNT,
        .codec = CODEC_FP16, .has_bandwidth = true, .bandwidth = NAN,
    };
    struct averager *a = NULL;

    cr_assert_eq(averager_create(&c, &a), -EINVAL, "a bandwidth that is not a number");
    c.bandwidth = INFINITY;
    cr_assert_eq(averager_create(&c, &a), -EINVAL, "an infinite bandwidth");
    cr_assert_null(a);
}

static void *scheduled_main(void *arg)
{
    struct avpeer *p = arg;
    struct timespec ts;
    struct averager_step s = { .data = p->data, .weight = 1, .alpha = 1,
                               .timeout_ms = FIXTURE_WAIT_MS };

    clock_gettime(CLOCK_REALTIME, &ts);
    s.begin_at_ms = (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000 + 1500;
    p->res = NULL;
    p->rc = averager_step(p->a, &s, &p->res);
    return NULL;
}

/* The group forms at once (the target arrived) but the round waits for
 * the scheduled time. */
Test(averager, a_scheduled_round_waits_for_its_time)
{
    struct avpeer p[2] = { 0 };
    uint64_t t0 = clock_now_ms();

    p[0].a = make("s-0", 2, 2, "", "f32x16s");
    p[1].a = make("s-1", 2, 2, "", "f32x16s");
    t0 = clock_now_ms();
    for (int i = 0; i < 2; i++)
        cr_assert_eq(pthread_create(&p[i].t, NULL, scheduled_main, &p[i]), 0);
    for (int i = 0; i < 2; i++)
        pthread_join(p[i].t, NULL);
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(p[i].rc, 0, "s-%d: %s", i, averager_last_error(p[i].a));
        cr_assert_lt(p[i].res->matchmaking_ms, 1400, "the group formed early");
    }
    cr_assert_geq(clock_now_ms() - t0, 1450, "the round waited for its time");
    avpeers_free(p, 2);
}

/* ---- auxiliary averagers without tensors ----------------------------- */

static struct averager *make_bare(const char *id, uint32_t target, double bandwidth,
                                  size_t max_count)
{
    struct averager_config c = {
        .broker = broker, .cohort = "avg", .id = id, .host = "127.0.0.1", .key = &key,
        .prefix = "run/bare", .target_group_size = target, .min_group_size = target,
        .min_matchmaking_ms = 300, .allreduce_timeout_ms = 3000, .count = 0,
        .max_count = max_count, .has_bandwidth = bandwidth >= 0, .bandwidth = bandwidth,
    };
    struct averager *a = NULL;

    cr_assert_eq(averager_create(&c, &a), 0, "averager_create(%s)", id);
    cr_assert_eq(averager_wait(a, FIXTURE_WAIT_MS), 0);
    return a;
}

static struct averager *make_clothed(const char *id, uint32_t target, double bandwidth)
{
    struct averager_config c = {
        .broker = broker, .cohort = "avg", .id = id, .host = "127.0.0.1", .key = &key,
        .prefix = "run/bare", .target_group_size = target, .min_group_size = target,
        .min_matchmaking_ms = 300, .allreduce_timeout_ms = 3000, .count = COUNT,
        .schema = "f32x16", .schema_len = 6, .has_bandwidth = bandwidth >= 0,
        .bandwidth = bandwidth,
    };
    struct averager *a = NULL;

    cr_assert_eq(averager_create(&c, &a), 0, "averager_create(%s)", id);
    cr_assert_eq(averager_wait(a, FIXTURE_WAIT_MS), 0);
    return a;
}

/* An auxiliary averager without tensors asks first, for any schema; the
 * group forms when two with tensors arrive, it learns their count from
 * the group, and reduces the largest part (bandwidth 6 against 1 and 1):
 * the two contributors get the exact average, and it is named with
 * weight 0. Twice, on the ring (no bandwidth) and the butterfly. */
static void bare_round(bool balanced)
{
    struct avpeer p[3] = { 0 };

    p[0].a = make_bare(balanced ? "x-0" : "y-0", 3, balanced ? 6 : -1, 0);
    p[1].a = make_clothed(balanced ? "x-1" : "y-1", 3, balanced ? 1 : -1);
    p[2].a = make_clothed(balanced ? "x-2" : "y-2", 3, balanced ? 1 : -1);
    for (int i = 1; i < 3; i++) {
        p[i].weight = i;
        for (int j = 0; j < COUNT; j++)
            p[i].data[j] = (float)(30 * i + j);
    }
    snprintf(p[0].gather, sizeof(p[0].gather), "helper");
    avpeers_run(p, 3);
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(p[i].rc, 0, "%d: %s", i, averager_last_error(p[i].a));
        cr_assert_eq(p[i].res->n, 3);
        cr_assert_eq(p[i].res->weights[0], 0.0, "the bare averager comes first and gave 0");
        cr_assert_eq(p[i].res->gathered_len[0], 6);
    }
    for (int i = 1; i < 3; i++)
        for (int j = 0; j < COUNT; j++)
            /* (1 x (30 + j) + 2 x (60 + j)) / 3 */
            cr_assert_eq(p[i].data[j], (float)(50 + j), "%d[%d] = %g", i, j, p[i].data[j]);
    avpeers_free(p, 3);
}

Test(averager, an_auxiliary_averager_without_tensors_helps_on_the_ring)
{
    bare_round(false);
}

Test(averager, an_auxiliary_averager_without_tensors_reduces_its_part)
{
    bare_round(true);
}

/* A group that averages more than an averager without tensors takes
 * fails it with -EMSGSIZE, saying so; a weight other than 0 is refused. */
Test(averager, an_averager_without_tensors_refuses_a_group_too_large)
{
    struct avpeer p[2] = { 0 };
    float dummy[1];
    struct averager_step s = { .data = dummy, .weight = 1, .alpha = 1 };
    struct averager_result *r = NULL;

    p[0].a = make_bare("t-0", 2, -1, COUNT - 1);
    p[1].a = make_clothed("t-1", 2, -1);
    cr_assert_eq(averager_step(p[0].a, &s, &r), -EINVAL);
    cr_assert(strstr(averager_last_error(p[0].a), "weight must be 0"));
    p[1].weight = 1;
    p[0].timeout_ms = p[1].timeout_ms = 6000;
    avpeers_run(p, 2);
    cr_assert_eq(p[0].rc, -EMSGSIZE, "%d: %s", p[0].rc, averager_last_error(p[0].a));
    cr_assert(strstr(averager_last_error(p[0].a), "max_count"), "%s",
              averager_last_error(p[0].a));
    cr_assert_neq(p[1].rc, 0, "its partner is left without a group");
    avpeers_free(p, 2);
}

static struct averager *make_minvec(const char *id, uint32_t target, double bandwidth,
                                    size_t min_vector_size)
{
    struct averager_config c = {
        .broker = broker, .cohort = "avg", .id = id, .host = "127.0.0.1", .key = &key,
        .prefix = "run/minvec", .target_group_size = target, .min_group_size = target,
        .min_matchmaking_ms = 300, .allreduce_timeout_ms = 3000, .count = COUNT,
        .schema = "f32x16", .schema_len = 6, .has_bandwidth = true, .bandwidth = bandwidth,
        .min_vector_size = min_vector_size,
    };
    struct averager *a = NULL;

    cr_assert_eq(averager_create(&c, &a), 0, "averager_create(%s)", id);
    cr_assert_eq(averager_wait(a, FIXTURE_WAIT_MS), 0);
    return a;
}

/* Among members of one min_vector_size, the member whose share is too
 * small (bandwidth 1 against 100 and 100) reduces nothing, and the
 * average is still exact. */
Test(averager, min_vector_size_keeps_the_average_exact)
{
    struct avpeer p[3] = { 0 };
    char id[16];

    for (int i = 0; i < 3; i++) {
        snprintf(id, sizeof(id), "v-%d", i);
        p[i].a = make_minvec(id, 3, i < 2 ? 100 : 1, 1000);
        p[i].weight = i + 1;
        for (int j = 0; j < COUNT; j++)
            p[i].data[j] = (float)(6 * i + j);
    }
    avpeers_run(p, 3);
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(p[i].rc, 0, "v-%d: %s", i, averager_last_error(p[i].a));
        for (int j = 0; j < COUNT; j++)
            /* (1 x j + 2 x (6 + j) + 3 x (12 + j)) / 6 */
            cr_assert_eq(p[i].data[j], (float)(8 + j), "v-%d[%d] = %g", i, j, p[i].data[j]);
    }
    avpeers_free(p, 3);
}

/* min_vector_size is part of what a group agrees on: of two averagers
 * with different values asking at once, whichever asks second is
 * refused, and the first finds too few. */
Test(averager, averagers_of_different_min_vector_size_do_not_group)
{
    struct avpeer p[2] = { 0 };

    p[0].a = make_minvec("u-0", 2, 1, 1000);
    p[1].a = make_minvec("u-1", 2, 1, 10);
    for (int i = 0; i < 2; i++) {
        p[i].weight = 1;
        p[i].timeout_ms = 3000;
    }
    avpeers_run(p, 2);
    cr_assert((p[0].rc == -EPROTO && p[1].rc == -ETIMEDOUT) ||
              (p[0].rc == -ETIMEDOUT && p[1].rc == -EPROTO), "%d %d", p[0].rc, p[1].rc);
    avpeers_free(p, 2);
}

/* A weight is a float32 on the wire: one that is finite as a double but
 * beyond float32's range (1e39) is refused at once, like an infinite one,
 * rather than sent as +Inf, which every groupmate reads as a lying peer
 * and fails its own step on. Its partner, left alone, only times out. */
Test(averager, a_weight_beyond_float32_is_refused_before_it_travels)
{
    struct avpeer p[2] = { 0 };
    uint64_t began;

    p[0].a = make("big-w0", 2, 2, "", "f32x16");
    p[1].a = make("big-w1", 2, 2, "", "f32x16");
    p[0].weight = 1e39;
    p[1].weight = 1;
    p[0].timeout_ms = p[1].timeout_ms = 3000;
    began = clock_now_ms();
    avpeers_run(p, 2);
    cr_assert_eq(p[0].rc, -EINVAL, "%d: %s", p[0].rc, averager_last_error(p[0].a));
    cr_assert(strstr(averager_last_error(p[0].a), "weight"), "%s", averager_last_error(p[0].a));
    cr_assert_eq(p[1].rc, -ETIMEDOUT, "the partner is not failed by it: %d: %s", p[1].rc,
                 averager_last_error(p[1].a));
    cr_assert_lt(clock_now_ms() - began, FIXTURE_WAIT_MS);
    for (int j = 0; j < AVPEERS_COUNT; j++)
        cr_assert_eq(p[0].data[j], 0.0f, "data untouched");
    cr_assert_null(p[0].res);
    avpeers_free(p, 2);
}

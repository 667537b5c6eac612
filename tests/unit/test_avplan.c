/* tests/unit/test_avplan.c: averagers with a codec per tensor
 * (averager_config.plan) on a real broker with a key, over loopback, each
 * on its own thread: CODEC_NONE ranges averaged exactly and coded ones
 * within their codec's bound, alike on every member, on the ring and the
 * butterfly (with a client); a step whose last codec's call fails leaves
 * every member's data untouched; averagers of different plans never
 * group, and a plan of one codec groups with that codec; an averager
 * without tensors joins a group with a plan, learns the plan in the
 * step's first call and helps reduce, contributing nothing, and moves
 * between groups of different plans and of none; a member
 * that sends another plan than the group's digest fails the step at
 * every honest member, the averager without tensors included, and
 * changes nothing; bad plans are refused with a sentence that names the
 * fault. */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
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
#include "engine/codec.h"
#include "fixture.h"
#include "membership/brokerd.h"
#include "membership/epoch.h"
#include "membership/member.h"
#include "rpc/rpc.h"

#define N_MAX 4
#define COUNT AVPEERS_COUNT

static struct brokerd *d;
static char broker[64];
static struct secret key;

static void start(void)
{
    d = fixture_keyed_broker_start("avp", &key, broker, sizeof(broker));
}

static void stop(void)
{
    fixture_broker_stop(d);
}

TestSuite(avplan, .init = start, .fini = stop, .timeout = 240);

/* Four tensors: 4 values exact, 6 in fp16, 3 exact, 3 in bf16. Two coded
 * groups and an exact one split in two ranges, so that every value moves
 * through the buffer's layout and back. */
static const struct averager_range PLAN[] = {
    { 4, CODEC_NONE }, { 6, CODEC_FP16 }, { 3, CODEC_NONE }, { 3, CODEC_BF16 },
};
#define PLAN_LEN (sizeof(PLAN) / sizeof(PLAN[0]))

struct spec {
    const char *prefix;
    uint32_t target, min;
    const struct averager_range *plan;
    size_t plan_len;
    enum codec codec;
    size_t count;
    size_t segment_bytes;
    bool has_bandwidth, client;
    double bandwidth;
};

static struct averager *make(const char *id, const struct spec *s)
{
    struct averager_config c = {
        .broker = broker, .cohort = "avp", .id = id, .host = "127.0.0.1", .key = &key,
        .prefix = s->prefix, .target_group_size = s->target,
        .min_group_size = s->min ? s->min : s->target, .min_matchmaking_ms = 300,
        .allreduce_timeout_ms = 3000, .count = s->count, .schema = "f32x16",
        .schema_len = s->count ? 6 : 0, .plan = s->plan, .plan_len = s->plan_len,
        .codec = s->codec, .segment_bytes = s->segment_bytes,
        .has_bandwidth = s->has_bandwidth, .bandwidth = s->bandwidth, .client_mode = s->client,
    };
    struct averager *a = NULL;

    cr_assert_eq(averager_create(&c, &a), 0, "averager_create(%s)", id);
    cr_assert_eq(averager_wait(a, FIXTURE_WAIT_MS), 0);
    return a;
}

static enum codec codec_at(size_t j)
{
    size_t at = 0;

    for (size_t k = 0; k < PLAN_LEN; k++) {
        if (j < at + PLAN[k].count)
            return PLAN[k].codec;
        at += PLAN[k].count;
    }
    cr_assert_fail("element %zu past the plan", j);
    return CODEC_NONE;
}

/* Member i's value j: integers in the exact ranges (so that their
 * weighted average is exact in float32), fractions fp16 and bf16 round
 * in the coded ones. */
static float value(int i, size_t j)
{
    return codec_at(j) == CODEC_NONE ? (float)(3 * i + (int)j - 5)
                                     : (float)((i + 1) * 13.37 * sin(0.9 * (double)j + i));
}

/* n members averaging PLAN (the last one a client when `client`), with
 * weights 1, 3, 4, 8 (sums of powers of two over a total float32 divides
 * exactly for these integers), and with `aux` an averager without
 * tensors beside them ("a-aux", first in the group's order): the exact
 * ranges end with exactly sum(w x) / sum(w), the coded ones within
 * (members + 1) encodings of their codec of the exact average and not
 * all equal to it (the codec ran), each a value of its codec, and every
 * member holds the same bytes; every result names the whole group, the
 * averager without tensors with weight 0. */
static void plan_round(const char *prefix, int n, bool client, bool aux)
{
    static const double weights[N_MAX] = { 1, 3, 4, 8 };
    struct avpeer p[N_MAX + 1] = { 0 };
    int members = n + (aux ? 1 : 0);
    double total = 0, maxabs = 0;
    bool differs[2] = { false, false };
    char id[16];

    for (int i = 0; i < n; i++) {
        struct spec s = { .prefix = prefix, .target = (uint32_t)members, .plan = PLAN,
                          .plan_len = PLAN_LEN, .count = COUNT,
                          .client = client && i == n - 1 };

        snprintf(id, sizeof(id), "p-%d", i);
        p[i].a = make(id, &s);
        p[i].weight = weights[i];
        total += weights[i];
        for (size_t j = 0; j < COUNT; j++) {
            p[i].data[j] = value(i, j);
            if (codec_at(j) != CODEC_NONE && fabs(p[i].data[j]) > maxabs)
                maxabs = fabs(p[i].data[j]);
        }
    }
    if (aux) {
        struct spec s = { .prefix = prefix, .target = (uint32_t)members };

        p[n].a = make("a-aux", &s);
        for (size_t j = 0; j < COUNT; j++)
            p[n].data[j] = 1234.5f;
    }
    avpeers_run(p, members);
    for (int i = 0; i < members; i++) {
        cr_assert_eq(p[i].rc, 0, "%s: %s", averager_id(p[i].a), averager_last_error(p[i].a));
        cr_assert_eq(p[i].res->n, (size_t)members);
        if (aux) {
            cr_assert_str_eq(p[i].res->ids[0], "a-aux", "the group names the auxiliary");
            cr_assert_eq(p[i].res->weights[0], 0.0);
            cr_assert_eq(p[i].res->weights[1], weights[0]);
        }
        if (i < n)
            cr_assert_eq(memcmp(p[i].data, p[0].data, sizeof(p[0].data)), 0,
                         "p-%d ends with other bytes than p-0", i);
    }
    if (aux)
        for (size_t j = 0; j < COUNT; j++)
            cr_assert_eq(p[n].data[j], 1234.5f, "the auxiliary's buffer was written");
    for (size_t j = 0; j < COUNT; j++) {
        enum codec c = codec_at(j);
        double exact = 0;

        for (int i = 0; i < n; i++)
            exact += weights[i] * value(i, j);
        exact /= total;
        if (c == CODEC_NONE) {
            cr_assert_eq(p[0].data[j], (float)exact, "[%zu] %.9g is not the exact %.9g", j,
                         p[0].data[j], exact);
            continue;
        }
        {
            /* fp16 2^-11 and bf16 2^-8 relative per encoding, of values
             * at most max|x|: members + 1 encodings with room for
             * float32's. */
            double bound = (members + 2) * (c == CODEC_FP16 ? 1.0 / 2048 : 1.0 / 256) * maxabs;
            float one = p[0].data[j];
            uint8_t scratch[8];

            cr_assert(fabs(p[0].data[j] - exact) <= bound, "[%zu] %s %.9g vs %.9g (bound %g)",
                      j, codec_name(c), p[0].data[j], exact, bound);
            differs[c == CODEC_FP16 ? 0 : 1] |= p[0].data[j] != (float)exact;
            codec_round_trip(c, &one, scratch, 1);
            cr_assert_eq(one, p[0].data[j], "[%zu] %.9g is not a value of %s", j, p[0].data[j],
                         codec_name(c));
        }
    }
    cr_assert(differs[0] && differs[1], "fp16 %d bf16 %d: was every codec applied?",
              differs[0], differs[1]);
    avpeers_free(p, members);
}

/* Two members: the exact call (values and metadata) is a butterfly, the
 * fp16 group's a butterfly, the bf16 group's, last, the ring. */
Test(avplan, exact_and_coded_tensors_in_one_step_among_2)
{
    plan_round("run/p2", 2, false, false);
}

Test(avplan, exact_and_coded_tensors_in_one_step_among_3)
{
    plan_round("run/p3", 3, false, false);
}

/* A client among 4: every call is a balanced butterfly. */
Test(avplan, exact_and_coded_tensors_with_a_client_among_4)
{
    plan_round("run/p4", 4, true, false);
}

/* uniform8 needs segments of 1368 bytes; with 512 the engine refuses its
 * call, the last of the step, after the exact and the fp16 calls
 * completed at both members: the step fails and neither member's data
 * changed (nothing is applied before every call succeeded). */
Test(avplan, a_step_whose_last_codec_fails_changes_nothing)
{
    static const struct averager_range plan[] = {
        { 4, CODEC_NONE }, { 6, CODEC_FP16 }, { 6, CODEC_UNIFORM8 },
    };
    struct avpeer p[2] = { 0 };

    for (int i = 0; i < 2; i++) {
        struct spec s = { .prefix = "run/fail", .target = 2, .plan = plan, .plan_len = 3,
                          .count = COUNT, .segment_bytes = 512 };
        char id[16];

        snprintf(id, sizeof(id), "f-%d", i);
        p[i].a = make(id, &s);
        p[i].weight = 1;
        for (size_t j = 0; j < COUNT; j++)
            p[i].data[j] = (float)(10 * i + (int)j);
    }
    avpeers_run(p, 2);
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(p[i].rc, -EINVAL, "f-%d: %d %s", i, p[i].rc, averager_last_error(p[i].a));
        cr_assert_null(p[i].res);
        for (size_t j = 0; j < COUNT; j++)
            cr_assert_eq(p[i].data[j], (float)(10 * i + (int)j),
                         "f-%d [%zu] changed by a failed step", i, j);
    }
    avpeers_free(p, 2);
}

/* Two averagers whose plans put the codecs in another order never group:
 * the one that asks second is refused, told that the compression is part
 * of the schema, and neither's data changes. */
Test(avplan, averagers_of_different_plans_never_group)
{
    static const struct averager_range a[] = { { 8, CODEC_NONE }, { 8, CODEC_FP16 } };
    static const struct averager_range b[] = { { 8, CODEC_FP16 }, { 8, CODEC_NONE } };
    struct avpeer p[2] = { 0 };
    int refused = -1;

    for (int i = 0; i < 2; i++) {
        struct spec s = { .prefix = "run/mis", .target = 2, .plan = i ? b : a, .plan_len = 2,
                          .count = COUNT };

        p[i].a = make(i ? "m-b" : "m-a", &s);
        p[i].weight = 1;
        p[i].timeout_ms = 3000;
        for (size_t j = 0; j < COUNT; j++)
            p[i].data[j] = (float)j;
    }
    avpeers_run(p, 2);
    for (int i = 0; i < 2; i++) {
        cr_assert(p[i].rc == -EPROTO || p[i].rc == -ETIMEDOUT, "%d: %s", p[i].rc,
                  averager_last_error(p[i].a));
        if (p[i].rc == -EPROTO)
            refused = i;
        for (size_t j = 0; j < COUNT; j++)
            cr_assert_eq(p[i].data[j], (float)j, "a refused step changed the data");
    }
    cr_assert(refused >= 0 && p[1 - refused].rc == -ETIMEDOUT, "%d %d", p[0].rc, p[1].rc);
    cr_assert(strstr(averager_last_error(p[refused].a), "a codec plan"), "%s",
              averager_last_error(p[refused].a));
    avpeers_free(p, 2);
}

/* A plan whose ranges are all fp16 is fp16: it groups with an averager
 * given the codec, and both end with the same bytes. */
Test(avplan, a_plan_of_one_codec_groups_with_that_codec)
{
    static const struct averager_range all16[] = { { 5, CODEC_FP16 }, { 11, CODEC_FP16 } };
    struct avpeer p[2] = { 0 };

    for (int i = 0; i < 2; i++) {
        struct spec s = { .prefix = "run/one", .target = 2, .count = COUNT,
                          .plan = i ? NULL : all16, .plan_len = i ? 0 : 2,
                          .codec = i ? CODEC_FP16 : CODEC_NONE };

        p[i].a = make(i ? "o-codec" : "o-plan", &s);
        p[i].weight = 1;
        for (size_t j = 0; j < COUNT; j++)
            p[i].data[j] = (float)((i + 1) * 0.123 * (double)j);
    }
    avpeers_run(p, 2);
    for (int i = 0; i < 2; i++)
        cr_assert_eq(p[i].rc, 0, "%d: %s", i, averager_last_error(p[i].a));
    cr_assert_eq(memcmp(p[0].data, p[1].data, sizeof(p[0].data)), 0);
    for (size_t j = 1; j < COUNT; j++)
        cr_assert(fabs(p[0].data[j] - 1.5 * 0.123 * (double)j) <= 3.0 / 2048 * 2 * 0.123 * COUNT,
                  "[%zu] %g", j, p[0].data[j]);
    avpeers_free(p, 2);
}

/* An averager without tensors beside 2 and beside 3 members with a plan:
 * it learns the plan in the step's first call, reduces its share of
 * every call with nothing of its own, and the members' results are
 * those of plan_round, exact where exact, alike everywhere. */
Test(avplan, an_averager_without_tensors_helps_a_plan_group_of_2)
{
    plan_round("run/aux2", 2, false, true);
}

Test(avplan, an_averager_without_tensors_helps_a_plan_group_of_3)
{
    plan_round("run/aux3", 3, false, true);
}

/* One averager without tensors steps with two members of PLAN, then two
 * without a codec, then two of another plan (fp16 first, 8 values of
 * int8 laid out before the exact ones), all on one prefix: it lays its
 * buffer out anew for each group and every step is exact where exact,
 * alike at both members. */
Test(avplan, an_averager_without_tensors_moves_between_plans_and_none)
{
    static const struct averager_range other[] = {
        { 4, CODEC_FP16 }, { 4, CODEC_NONE }, { 8, CODEC_BF16 },
    };
    struct spec as = { .prefix = "run/move", .target = 3 };
    struct averager *aux = make("a-aux", &as);

    for (int round = 0; round < 3; round++) {
        const struct averager_range *plan = round == 0 ? PLAN : round == 2 ? other : NULL;
        size_t plan_len = round == 0 ? PLAN_LEN : round == 2 ? 3 : 0;
        struct avpeer p[3] = { 0 };

        for (int i = 0; i < 2; i++) {
            struct spec s = { .prefix = "run/move", .target = 3, .plan = plan,
                              .plan_len = plan_len, .count = COUNT };
            char id[32];

            snprintf(id, sizeof(id), "m%d-%d", round, i);
            p[i].a = make(id, &s);
            p[i].weight = 1 + 2 * i;
            for (size_t j = 0; j < COUNT; j++)
                p[i].data[j] = (float)(4 * i + (int)j);
        }
        p[2].a = aux;
        avpeers_run(p, 3);
        for (int i = 0; i < 3; i++) {
            cr_assert_eq(p[i].rc, 0, "round %d, %s: %s", round, averager_id(p[i].a),
                         averager_last_error(p[i].a));
            cr_assert_eq(p[i].res->n, 3);
            cr_assert_str_eq(p[i].res->ids[0], "a-aux");
            averager_result_free(p[i].res);
        }
        cr_assert_eq(memcmp(p[0].data, p[1].data, sizeof(p[0].data)), 0, "round %d", round);
        for (size_t j = 0; j < COUNT; j++) {
            /* (1 x j + 3 x (4 + j)) / 4 = 3 + j: exact where exact, and
             * within a few of bf16's steps of it where coded. */
            bool exact = plan == NULL || (round == 0 ? codec_at(j) == CODEC_NONE
                                                     : j >= 4 && j < 8);

            if (exact)
                cr_assert_eq(p[0].data[j], (float)(3 + j), "round %d [%zu] %g", round, j,
                             p[0].data[j]);
            else
                cr_assert(fabs(p[0].data[j] - (3.0 + (double)j)) <= 5.0 / 256 * 20,
                          "round %d [%zu] %g", round, j, p[0].data[j]);
        }
        for (int i = 0; i < 2; i++)
            averager_destroy(p[i].a);
    }
    averager_destroy(aux);
}

/* ---- a member that lies about the plan ------------------------------------ */

struct liar {
    struct member *m;
    struct allreduce *ar;
    int fd, rc;
    bool stop;
    pthread_t poll, t;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    bool ended;
    Cohort__V1__MatchmakeReply *rep;
};

static void *liar_poll(void *arg)
{
    struct liar *l = arg;

    while (!__atomic_load_n(&l->stop, __ATOMIC_ACQUIRE)) {
        member_poll(l->m, clock_now_ms());
        usleep(20000);
    }
    return NULL;
}

static void liar_msg(void *arg, ProtobufCMessage *msg)
{
    struct liar *l = arg;

    pthread_mutex_lock(&l->lock);
    if (l->rep)
        protobuf_c_message_free_unpacked(&l->rep->base, NULL);
    l->rep = (Cohort__V1__MatchmakeReply *)msg;
    pthread_mutex_unlock(&l->lock);
}

static void liar_end(void *arg, const struct rpc_status *st)
{
    struct liar *l = arg;

    pthread_mutex_lock(&l->lock);
    l->ended = true;
    pthread_cond_signal(&l->cond);
    pthread_mutex_unlock(&l->lock);
}

static bool liar_joined(void *arg)
{
    return member_joins(arg) > 0;
}

/* The liar's step: it asks for a group as an averager without tensors
 * does (any schema), then runs the exact call of a plan group of n with
 * a plan of its own in the plan's area: PLAN with its fp16 range's codec
 * word 7 where the others write 1, so that the sum of three writers is
 * 3 x (PLAN with that range in int8), a plan that reads whole but is not
 * the group's. Its call completes; the honest members must refuse what
 * it delivered. */
static void *liar_main(void *arg)
{
    struct liar *l = arg;
    Cohort__V1__MatchmakeRequest q = COHORT__V1__MATCHMAKE_REQUEST__INIT;
    struct rpc_watch *w = NULL;
    struct epoch *e = NULL;
    const char *why = NULL;
    float *buf = NULL;
    size_t floats;
    int h = -1;

    q.prefix = "run/liar";
    q.group_bits = "";
    q.target_group_size = 4;
    q.min_group_size = 4;
    q.min_matchmaking_ms = 300;
    q.timeout_ms = FIXTURE_WAIT_MS;
    q.any_schema = true;
    l->rc = member_matchmake(l->m, &q, liar_msg, liar_end, l, &w);
    if (l->rc < 0)
        return NULL;
    pthread_mutex_lock(&l->lock);
    while (!l->ended)
        pthread_cond_wait(&l->cond, &l->lock);
    pthread_mutex_unlock(&l->lock);
    rpc_watch_close(w);
    l->rc = -EPROTO;
    if (!l->rep)
        return NULL;
    {
        Cohort__V1__Epoch p = COHORT__V1__EPOCH__INIT;

        p.cohort = "avp";
        p.epoch = l->rep->group_id;
        p.n_members = l->rep->n_members;
        p.members = l->rep->members;
        p.leader = l->rep->members[0]->id;
        if (epoch_from_proto(&p, &e, &why) < 0)
            return NULL;
    }
    /* The plan's area, then the metadata of 4 members (weight, length,
     * 2048 words of gathered bytes each: the default gather_max), all 0
     * here but the plan. */
    floats = AVERAGER_PLAN_FLOATS + 4 * (2 + 2048);
    buf = calloc(floats, sizeof(float));
    if (!buf)
        goto out;
    buf[0] = 1;
    buf[1] = (float)PLAN_LEN;
    for (size_t k = 0; k < PLAN_LEN; k++) {
        buf[2 + 3 * k] = (float)(PLAN[k].count & 0xffff);
        buf[3 + 3 * k] = (float)(PLAN[k].count >> 16);
        buf[4 + 3 * k] = PLAN[k].codec == CODEC_FP16 ? 7.0f : (float)PLAN[k].codec;
    }
    h = allreduce_register(l->ar, buf, floats * sizeof(float));
    if (h < 0 || (l->rc = allreduce_set_epoch(l->ar, e)) < 0)
        goto out;
    l->rc = allreduce_run(l->ar, h, floats, DTYPE_F32, DTYPE_SUM, 0, 1);
out:
    if (h >= 0)
        allreduce_unregister(l->ar, h);
    free(buf);
    epoch_unref(e);
    return NULL;
}

/* Two members with PLAN, an averager without tensors, and a liar that
 * sends another plan in the exact call: each member with tensors finds a
 * plan that is not its own, the averager without tensors one whose
 * digest is not the schema's; all three fail the step with -EPROTO and a
 * sentence that says so, and no one's data changes. */
Test(avplan, a_member_that_sends_another_plan_fails_the_step_for_everyone)
{
    struct liar l = { .fd = -1 };
    struct member_config mc = { 0 };
    struct allreduce_config ac = { 0 };
    struct avpeer p[3] = { 0 };
    char addr[64];

    pthread_mutex_init(&l.lock, NULL);
    pthread_cond_init(&l.cond, NULL);
    cr_assert_eq(allreduce_listen("127.0.0.1", &l.fd, addr, sizeof(addr)), 0);
    ac.cohort = "avp";
    ac.member_id = "l-liar";
    ac.listen_fd = l.fd;
    ac.member_timeout_ms = 3000;
    ac.small_bytes = (size_t)256 << 10;
    ac.key = &key;
    cr_assert_eq(allreduce_create(&ac, &l.ar), 0);
    mc.broker = broker;
    mc.cohort = "avp";
    mc.id = "l-liar";
    mc.address = addr;
    mc.key = &key;
    mc.quiet = true;
    cr_assert_eq(member_create(&mc, &l.m), 0);
    cr_assert_eq(pthread_create(&l.poll, NULL, liar_poll, &l), 0);
    cr_assert(fixture_wait_until(liar_joined, l.m, FIXTURE_WAIT_MS));
    for (int i = 0; i < 3; i++) {
        struct spec s = { .prefix = "run/liar", .target = 4, .plan = i < 2 ? PLAN : NULL,
                          .plan_len = i < 2 ? PLAN_LEN : 0, .count = i < 2 ? COUNT : 0 };
        char id[16];

        snprintf(id, sizeof(id), "x-%d", i);
        p[i].a = make(id, &s);
        p[i].weight = i < 2 ? 1 : 0;
        p[i].timeout_ms = 3 * FIXTURE_WAIT_MS;
        for (size_t j = 0; j < COUNT; j++)
            p[i].data[j] = (float)(4 * i + (int)j);
    }
    cr_assert_eq(pthread_create(&l.t, NULL, liar_main, &l), 0);
    avpeers_run(p, 3);
    pthread_join(l.t, NULL);
    cr_assert_eq(l.rc, 0, "the liar's exact call: %d", l.rc);
    for (int i = 0; i < 3; i++) {
        const char *err = averager_last_error(p[i].a);

        cr_assert_eq(p[i].rc, -EPROTO, "x-%d: %d %s", i, p[i].rc, err);
        cr_assert_null(p[i].res);
        cr_assert(strstr(err, "bad codec plan"), "x-%d: %s", i, err);
        cr_assert(strstr(err, i < 2 ? "not this averager's" : "digest"), "x-%d: %s", i, err);
        for (size_t j = 0; j < COUNT; j++)
            cr_assert_eq(p[i].data[j], (float)(4 * i + (int)j), "x-%d [%zu] changed", i, j);
    }
    avpeers_free(p, 3);
    __atomic_store_n(&l.stop, true, __ATOMIC_RELEASE);
    pthread_join(l.poll, NULL);
    if (l.rep)
        protobuf_c_message_free_unpacked(&l.rep->base, NULL);
    member_destroy(l.m);
    allreduce_destroy(l.ar);
    close(l.fd);
    pthread_cond_destroy(&l.cond);
    pthread_mutex_destroy(&l.lock);
}

/* Bad plans: each refused by averager_plan_check with a sentence naming
 * the fault, and by averager_create with -EINVAL. */
Test(avplan, bad_plans_are_refused_with_a_sentence)
{
    static struct averager_range many[AVERAGER_PLAN_MAX + 1];
    struct averager_range short_[] = { { 8, CODEC_NONE }, { 7, CODEC_FP16 } };
    struct averager_range over[] = { { 8, CODEC_NONE }, { 9, CODEC_FP16 } };
    struct averager_range empty[] = { { 16, CODEC_NONE }, { 0, CODEC_FP16 } };
    struct averager_range topk[] = { { 8, CODEC_NONE }, { 8, (enum codec)4 } };
    struct averager_range junk[] = { { 8, CODEC_NONE }, { 8, (enum codec)99 } };
    struct averager_range good[] = { { 8, CODEC_NONE }, { 8, CODEC_FP16 } };
    struct {
        const struct averager_range *plan;
        size_t n;
        enum codec codec;
        size_t schema_len;
        const char *says;
    } bad[] = {
        { many, AVERAGER_PLAN_MAX + 1, CODEC_NONE, 6, "at most 256" },
        { short_, 2, CODEC_NONE, 6, "covers 15 of the 16" },
        { over, 2, CODEC_NONE, 6, "runs past the 16" },
        { empty, 2, CODEC_NONE, 6, "empty" },
        { topk, 2, CODEC_NONE, 6, "not a codec" },
        { junk, 2, CODEC_NONE, 6, "not a codec" },
        { good, 2, CODEC_FP16, 6, "one or the other" },
        { good, 2, CODEC_NONE, AVERAGER_SCHEMA_PLAN_MAX + 1, "schema of 40 bytes" },
    };
    char schema[AVERAGER_SCHEMA_MAX] = { 0 };

    for (size_t k = 0; k < AVERAGER_PLAN_MAX + 1; k++)
        many[k] = (struct averager_range){ 1, k % 2 ? CODEC_FP16 : CODEC_NONE };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        struct averager_config c = {
            .broker = broker, .cohort = "avp", .id = "bad", .host = "127.0.0.1", .key = &key,
            .prefix = "run/bad", .target_group_size = 2, .min_group_size = 2,
            .count = bad[i].n == AVERAGER_PLAN_MAX + 1 ? AVERAGER_PLAN_MAX + 1 : COUNT,
            .schema = schema, .schema_len = bad[i].schema_len, .plan = bad[i].plan,
            .plan_len = bad[i].n, .codec = bad[i].codec,
        };
        struct averager *a = NULL;
        char why[256] = "";

        cr_assert_eq(averager_plan_check(c.plan, c.plan_len, c.count, c.codec, c.schema_len,
                                         why, sizeof(why)), -EINVAL, "case %zu", i);
        cr_assert(strstr(why, bad[i].says), "case %zu: %s", i, why);
        cr_assert_eq(averager_create(&c, &a), -EINVAL, "case %zu", i);
        cr_assert_null(a);
    }
    /* The good plan, with the longest schema a plan leaves room for. */
    {
        char why[256] = "";

        cr_assert_eq(averager_plan_check(good, 2, COUNT, CODEC_NONE, AVERAGER_SCHEMA_PLAN_MAX,
                                         why, sizeof(why)), 0, "%s", why);
        cr_assert_eq(averager_plan_check(NULL, 0, COUNT, CODEC_FP16, AVERAGER_SCHEMA_MAX, why,
                                         sizeof(why)), 0, "no plan is fine");
    }
}

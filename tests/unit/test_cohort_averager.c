/* tests/unit/test_cohort_averager.c: the averager's public face in process
 * (src/averager/cohort_averager.c) and the frame integrity it takes from
 * $COHORT_INTEGRITY, as the sidecar's --integrity: a real broker with a
 * key on loopback, averagers on threads of this process.
 *
 * - Averagers under COHORT_INTEGRITY=mac average exactly; one of them
 *   never groups with an averager without integrity, and the one refused
 *   names both settings.
 * - A value other than none or mac, and mac without the key, are refused
 *   at create with a sentence in why; so are they by cohort_group_create
 *   and an in-process cohort_connect (the Accumulator), which read the
 *   same variable. "none" and unset are the default.
 * - Two groups under mac all-reduce exactly (that a group under mac and
 *   one without never do is the engine's: test_allreduce.c); beside one
 *   without, a group's call ends by its own timeout, buffer untouched.
 *
 * Criterion runs each test in a process of its own, so the variables a
 * test sets end with it. */
#include <criterion/criterion.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/clock.h"
#include "base/secret.h"
#include "cohort.h"
#include "fixture.h"
#include "membership/brokerd.h"

#define COUNT 16

static struct brokerd *d;
static char broker[64], dir[64], key_file[128];
static struct secret key;

static void start(void)
{
    d = fixture_keyed_broker_start("cav", &key, broker, sizeof(broker));
    snprintf(dir, sizeof(dir), "/tmp/cohort-cav-XXXXXX");
    cr_assert_not_null(mkdtemp(dir));
    snprintf(key_file, sizeof(key_file), "%s/key", dir);
    cr_assert_eq(secret_write(key_file, &key), 0);
    cr_assert_eq(setenv("COHORT_SECRET_FILE", key_file, 1), 0);
    unsetenv("COHORT_INTEGRITY");
}

static void stop(void)
{
    fixture_broker_stop(d);
    unlink(key_file);
    rmdir(dir);
}

TestSuite(cohort_averager, .init = start, .fini = stop, .timeout = 240);

static struct cohort_averager_config config(const char *id)
{
    return (struct cohort_averager_config){
        .broker = broker, .cohort = "cav", .id = id, .prefix = "run/cav",
        .target_group_size = 2, .min_group_size = 2, .min_matchmaking_ms = 300,
        .allreduce_timeout_ms = 3000, .count = COUNT, .schema = "f32x16", .schema_len = 6,
    };
}

/* An averager under COHORT_INTEGRITY=integrity (NULL: unset), joined. */
static struct cohort_averager *make(const char *id, const char *integrity)
{
    struct cohort_averager_config c = config(id);
    struct cohort_averager *a = NULL;
    char why[256];
    int rc;

    if (integrity)
        cr_assert_eq(setenv("COHORT_INTEGRITY", integrity, 1), 0);
    else
        unsetenv("COHORT_INTEGRITY");
    rc = cohort_averager_create_why(&c, &a, why, sizeof(why));
    unsetenv("COHORT_INTEGRITY");
    cr_assert_eq(rc, 0, "cohort_averager_create(%s): %d %s", id, rc, why);
    cr_assert_str_empty(why);
    cr_assert_eq(cohort_averager_wait(a, FIXTURE_WAIT_MS), 0);
    return a;
}

struct peer {
    struct cohort_averager *a;
    float data[COUNT];
    int timeout_ms;
    int rc;
    struct cohort_averager_result *res;
    pthread_t t;
};

static void *step_main(void *arg)
{
    struct peer *p = arg;
    struct cohort_averager_step s = { .data = p->data, .weight = 1, .alpha = 1,
                                      .timeout_ms = p->timeout_ms, .allow_retries = true };

    p->res = NULL;
    p->rc = cohort_averager_step(p->a, &s, &p->res);
    return NULL;
}

static void step_both(struct peer *p)
{
    for (int i = 0; i < 2; i++)
        cr_assert_eq(pthread_create(&p[i].t, NULL, step_main, &p[i]), 0);
    for (int i = 0; i < 2; i++)
        pthread_join(p[i].t, NULL);
}

Test(cohort_averager, integrity_mac_from_the_environment_groups_only_with_mac)
{
    struct peer p[2] = { 0 }, q[2] = { 0 };
    struct cohort_averager *plain;
    float before[COUNT];
    const char *err;

    p[0].a = make("mac-0", "mac");
    p[1].a = make("mac-1", "mac");
    for (int i = 0; i < 2; i++) {
        p[i].timeout_ms = (int)FIXTURE_WAIT_MS;
        for (int j = 0; j < COUNT; j++)
            p[i].data[j] = (float)(4 * i + 2 * j);
    }
    step_both(p);
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(p[i].rc, 0, "mac-%d: %s", i, cohort_averager_error(p[i].a));
        cr_assert_eq(cohort_averager_result_size(p[i].res), 2);
        for (int j = 0; j < COUNT; j++)
            cr_assert_eq(p[i].data[j], (float)(2 + 2 * j), "mac-%d [%d] = %g", i, j,
                         p[i].data[j]);
        cohort_averager_result_free(p[i].res);
    }

    /* Beside an averager without integrity (COHORT_INTEGRITY unset), in
     * groups of two: whichever asks second is refused by the broker, the
     * other finds nobody, and neither's data changes. */
    plain = make("plain-0", NULL);
    q[0].a = p[0].a;
    q[1].a = plain;
    for (int i = 0; i < 2; i++) {
        q[i].timeout_ms = 6000;
        for (int j = 0; j < COUNT; j++)
            q[i].data[j] = (float)(100 * i + j);
    }
    memcpy(before, q[1].data, sizeof(before));
    step_both(q);
    cr_assert(q[0].rc < 0 && q[1].rc < 0, "averagers of different integrity averaged: %d %d",
              q[0].rc, q[1].rc);
    cr_assert(q[0].rc == -EPROTO || q[1].rc == -EPROTO, "neither was refused: %d %d", q[0].rc,
              q[1].rc);
    err = cohort_averager_error(q[q[0].rc == -EPROTO ? 0 : 1].a);
    cr_assert(strstr(err, q[0].rc == -EPROTO ? "--integrity mac" : "--integrity none"), "%s",
              err);
    cr_assert_eq(memcmp(before, q[1].data, sizeof(before)), 0, "a failed step changed data");
    for (int j = 0; j < COUNT; j++)
        cr_assert_eq(q[0].data[j], (float)j);
    cohort_averager_destroy(plain);
    cohort_averager_destroy(p[0].a);
    cohort_averager_destroy(p[1].a);
}

Test(cohort_averager, a_bad_integrity_or_mac_without_a_key_is_refused_with_a_sentence)
{
    struct cohort_averager_config c = config("bad-0");
    struct cohort_averager *a = NULL;
    struct cohort_group *g = NULL;
    char why[256];

    cr_assert_eq(setenv("COHORT_INTEGRITY", "MAC", 1), 0);
    cr_assert_eq(cohort_averager_create_why(&c, &a, why, sizeof(why)), -EINVAL);
    cr_assert_null(a);
    cr_assert(strstr(why, "COHORT_INTEGRITY=\"MAC\"") && strstr(why, "none or mac"), "%s", why);
    cr_assert_eq(cohort_group_create(broker, "cav", "g-bad", &g), -EINVAL);
    cr_assert_null(g);

    cr_assert_eq(setenv("COHORT_INTEGRITY", "mac", 1), 0);
    unsetenv("COHORT_SECRET_FILE");
    cr_assert_eq(cohort_averager_create_why(&c, &a, why, sizeof(why)), -EINVAL);
    cr_assert_null(a);
    cr_assert(strstr(why, "COHORT_INTEGRITY=mac") && strstr(why, "COHORT_SECRET_FILE"), "%s",
              why);
    cr_assert_eq(cohort_averager_create(&c, &a), -EINVAL, "without why too");
    cr_assert_eq(cohort_group_create(broker, "cav", "g-bad", &g), -EINVAL);

    /* "none" is the default's word, key or no key. */
    cr_assert_eq(setenv("COHORT_INTEGRITY", "none", 1), 0);
    cr_assert_eq(setenv("COHORT_SECRET_FILE", key_file, 1), 0);
    cr_assert_eq(cohort_averager_create_why(&c, &a, why, sizeof(why)), 0, "%s", why);
    cr_assert_str_empty(why);
    cohort_averager_destroy(a);
}

Test(cohort_averager, the_accumulator_in_process_refuses_a_bad_integrity)
{
    struct cohort_tensor t = { .name = "w", .dtype = COHORT_F32, .numel = 4 };
    struct cohort_config cfg = { .name = "acc", .parameters = &t, .n_parameters = 1 };
    struct cohort *c;

    cr_assert_eq(cohort_create(&cfg, &c), 0);
    cr_assert_eq(cohort_set_identity(c, "cav", "acc-0"), 0);
    cr_assert_eq(setenv("COHORT_INTEGRITY", "hmac", 1), 0);
    cr_assert_eq(cohort_connect(c, broker), -EINVAL);
    cr_assert_not(cohort_connected(c));
    cr_assert_eq(setenv("COHORT_INTEGRITY", "mac", 1), 0);
    unsetenv("COHORT_SECRET_FILE");
    cr_assert_eq(cohort_connect(c, broker), -EINVAL, "mac without a key");
    /* With the key, mac connects: the refusals above changed nothing. */
    cr_assert_eq(setenv("COHORT_SECRET_FILE", key_file, 1), 0);
    cr_assert_eq(cohort_connect(c, broker), 0);
    cohort_destroy(c);
}

struct member {
    struct cohort_group *g;
    float buf[COUNT];
    int timeout_ms;
    int rc;
    uint64_t took_ms;
    pthread_t t;
};

static void *reduce_main(void *arg)
{
    struct member *m = arg;
    uint64_t t0 = clock_now_ms();

    m->rc = cohort_group_allreduce(m->g, m->buf, COUNT, COHORT_GROUP_F32, COHORT_GROUP_SUM, 0,
                                   0, m->timeout_ms);
    m->took_ms = clock_now_ms() - t0;
    return NULL;
}

/* Two groups, the second under `second` (the first under mac): their
 * all-reduce of [10 i + j], after both see each other. */
static void reduce_pair(struct member *m, const char *second, int timeout_ms)
{
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(setenv("COHORT_INTEGRITY", i ? second : "mac", 1), 0);
        cr_assert_eq(cohort_group_create(broker, "cav", i ? "g-1" : "g-0", &m[i].g), 0);
        for (int j = 0; j < COUNT; j++)
            m[i].buf[j] = (float)(10 * i + j);
        m[i].timeout_ms = timeout_ms;
    }
    unsetenv("COHORT_INTEGRITY");
    for (int i = 0; i < 2; i++) {
        uint32_t rank, size;

        FIXTURE_WAIT_FOR(cohort_group_wait(m[i].g, 100) == 0 &&
                             cohort_group_position(m[i].g, &rank, &size) == 0 && size == 2,
                         "g-%d to see both members", i);
    }
    for (int i = 0; i < 2; i++)
        cr_assert_eq(pthread_create(&m[i].t, NULL, reduce_main, &m[i]), 0);
    for (int i = 0; i < 2; i++)
        pthread_join(m[i].t, NULL);
}

Test(cohort_averager, groups_under_mac_all_reduce_exactly)
{
    struct member m[2] = { 0 };

    reduce_pair(m, "mac", (int)FIXTURE_WAIT_MS);
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(m[i].rc, 0, "g-%d: %d", i, m[i].rc);
        for (int j = 0; j < COUNT; j++)
            cr_assert_eq(m[i].buf[j], (float)(10 + 2 * j));
    }
    for (int i = 0; i < 2; i++)
        cohort_group_destroy(m[i].g);
}

/* A group under mac beside one without never reduces, and each call ends
 * by its own timeout (3 s), not by the engine's member timeout (60 s),
 * with its buffer untouched. */
Test(cohort_averager, a_group_call_beside_another_integrity_ends_by_its_own_timeout)
{
    struct member m[2] = { 0 };

    reduce_pair(m, "none", 3000);
    for (int i = 0; i < 2; i++) {
        cr_assert(m[i].rc == -EACCES || m[i].rc == -ETIMEDOUT, "g-%d: %d", i, m[i].rc);
        /* Generous for a loaded host, and far below the engine's 60 s. */
        cr_assert_lt(m[i].took_ms, 20000, "g-%d's 3 s call took %llu ms", i,
                     (unsigned long long)m[i].took_ms);
        for (int j = 0; j < COUNT; j++)
            cr_assert_eq(m[i].buf[j], (float)(10 * i + j), "g-%d's buffer changed", i);
    }
    for (int i = 0; i < 2; i++)
        cohort_group_destroy(m[i].g);
}

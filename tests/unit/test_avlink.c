/* tests/unit/test_avlink.c: hivemind's averager through a sidecar
 * (averager/avlink.h, averager/avserve.h): a real sidecar service
 * (trainerd with avserve adopting the averager links) on a real Unix
 * socket, joined to a real broker with a key, and trainers that have none.
 *
 * - Two averagers through the sidecar and one in process average exactly,
 *   gather, and the sidecar's are the members it named.
 * - Malformed requests end the link; bad and oversized ones are refused
 *   with a sentence and change nothing; requests before CREATE, STEP on
 *   an attached link and a wrong token are refused.
 * - The cap of averagers per sidecar: the next is refused (-EBUSY) and
 *   nothing changes; one that leaves makes room.
 * - A trainer gone mid-step: the step is aborted and its averager leaves,
 *   long before the step's timeout.
 * - A sidecar gone mid-step: the step fails at once with a sentence.
 * - A codec plan travels in the shared region: bad ones are refused with
 *   the averager's sentence; a good one groups with an in-process
 *   averager of the same plan, and the exact part averages exactly.
 * - An auxiliary averager without tensors hosted by the sidecar helps two
 *   in-process averagers with a codec plan: it learns the plan in the
 *   step's first call, and the exact part averages exactly.
 * - The Accumulator's session and averager links share the socket: a
 *   second Accumulator is still refused before it says anything.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "accumulator/tlink.h"
#include "accumulator/trainerd.h"
#include "averager/averager.h"
#include "averager/avlink.h"
#include "averager/avserve.h"
#include "base/clock.h"
#include "base/secret.h"
#include "cohort.h"
#include "fixture.h"
#include "membership/brokerd.h"

#define COUNT 16

static struct brokerd *d;
static char broker[64], dir[64], path[128], addr[160];
static struct secret key;
static struct avserve *av;
static struct trainerd *td;

static void start(void)
{
    struct avserve_config ac = { .cohort = "avl", .id = "sc", .host = "127.0.0.1", .key = &key,
                                 .max_count = 1 << 20, .max_state_bytes = 1 << 20 };
    struct trainerd_config tc = { .node = { .cohort = "avl", .id = "sc", .host = "127.0.0.1",
                                            .key = &key } };

    d = fixture_keyed_broker_start("avl", &key, broker, sizeof(broker));
    snprintf(dir, sizeof(dir), "/tmp/cohort-avl-XXXXXX");
    cr_assert_not_null(mkdtemp(dir));
    snprintf(path, sizeof(path), "%s/sc.sock", dir);
    snprintf(addr, sizeof(addr), "unix:%s", path);
    ac.broker = broker;
    cr_assert_eq(avserve_create(&ac, &av), 0);
    tc.socket_path = path;
    tc.node.broker = broker;
    tc.adopt = avserve_adopt;
    tc.adopt_arg = av;
    tc.adopt_first = AVL_FIRST;
    tc.adopt_last = AVL_ATTACH;
    cr_assert_eq(trainerd_start(&tc, &td), 0);
}

static void stop(void)
{
    trainerd_stop(td);
    avserve_destroy(av);
    fixture_broker_stop(d);
    rmdir(dir);
}

TestSuite(avlink, .init = start, .fini = stop, .timeout = 240);

static struct cohort_averager *make(const char *via, const char *id, uint32_t target)
{
    struct cohort_averager_config c = {
        .broker = via, .cohort = "avl", .id = id, .prefix = "run/avl",
        .target_group_size = target, .min_group_size = target, .min_matchmaking_ms = 300,
        .allreduce_timeout_ms = 3000, .count = COUNT, .schema = "f32x16", .schema_len = 6,
    };
    struct cohort_averager *a = NULL;

    cr_assert_eq(cohort_averager_create(&c, &a), 0, "cohort_averager_create(%s)", id);
    cr_assert_eq(cohort_averager_wait(a, FIXTURE_WAIT_MS), 0);
    return a;
}

struct peer {
    struct cohort_averager *a;
    float data[COUNT];
    double weight;
    char gather[32];
    int timeout_ms;
    int rc;
    struct cohort_averager_result *res;
    pthread_t t;
};

static void *step_main(void *arg)
{
    struct peer *p = arg;
    struct cohort_averager_step s = { .data = p->data, .weight = p->weight, .alpha = 1,
                                      .gather = p->gather, .gather_len = strlen(p->gather),
                                      .timeout_ms = p->timeout_ms ? p->timeout_ms : (int)FIXTURE_WAIT_MS,
                                      .allow_retries = true };

    p->rc = cohort_averager_step(p->a, &s, &p->res);
    return NULL;
}

Test(avlink, sidecar_and_in_process_averagers_average_exactly_and_gather)
{
    struct peer p[3] = { 0 };
    const char *ids[3];
    struct secret saved = key;

    /* Two through the sidecar (its key, not ours), one in process with
     * the key: cohort_averager_create reads it from the environment. */
    p[0].a = make(addr, "ignored-0", 3);
    p[1].a = make(addr, "ignored-1", 3);
    {
        char kf[128];
        FILE *f;
        snprintf(kf, sizeof(kf), "%s/key", dir);
        f = fopen(kf, "w");
        cr_assert_not_null(f);
        for (size_t i = 0; i < sizeof(saved.key); i++)
            fprintf(f, "%02x", saved.key[i]);
        fclose(f);
        cr_assert_eq(setenv("COHORT_SECRET_FILE", kf, 1), 0);
        p[2].a = make(broker, "inproc", 3);
        unsetenv("COHORT_SECRET_FILE");
        unlink(kf);
    }
    cr_assert_eq(avserve_averagers(av), 2);
    for (int i = 0; i < 3; i++) {
        ids[i] = cohort_averager_id(p[i].a);
        p[i].weight = i + 1;
        snprintf(p[i].gather, sizeof(p[i].gather), "g%d", i);
        for (int j = 0; j < COUNT; j++)
            p[i].data[j] = (float)(10 * i + j);
    }
    cr_assert(strncmp(ids[0], "sc_av", 5) == 0 && strncmp(ids[1], "sc_av", 5) == 0,
              "%s %s", ids[0], ids[1]);
    cr_assert_str_neq(ids[0], ids[1]);
    cr_assert_str_eq(ids[2], "inproc");
    for (int i = 0; i < 3; i++)
        cr_assert_eq(pthread_create(&p[i].t, NULL, step_main, &p[i]), 0);
    for (int i = 0; i < 3; i++)
        pthread_join(p[i].t, NULL);
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(p[i].rc, 0, "peer %d: %d %s", i, p[i].rc, cohort_averager_error(p[i].a));
        cr_assert_eq(cohort_averager_result_size(p[i].res), 3);
        for (int j = 0; j < COUNT; j++) {
            /* sum_i (i+1)(10 i + j) / 6, exact in float32 for these. */
            float want = (float)((1.0 * j + 2.0 * (10 + j) + 3.0 * (20 + j)) / 6.0);
            cr_assert_eq(p[i].data[j], want, "peer %d [%d]: %g != %g", i, j, p[i].data[j], want);
        }
        for (size_t k = 0; k < 3; k++) {
            const char *who = cohort_averager_result_id(p[i].res, k);
            size_t len;
            const char *g = cohort_averager_result_gathered(p[i].res, k, &len);
            int m = strcmp(who, ids[0]) == 0 ? 0 : strcmp(who, ids[1]) == 0 ? 1 : 2;
            char want[8];
            snprintf(want, sizeof(want), "g%d", m);
            cr_assert_eq(len, 2);
            cr_assert(memcmp(g, want, 2) == 0);
            cr_assert_eq(cohort_averager_result_weight(p[i].res, k), m + 1.0);
        }
        cohort_averager_result_free(p[i].res);
    }
    for (int i = 0; i < 3; i++)
        cohort_averager_destroy(p[i].a);
    FIXTURE_WAIT_FOR(avserve_averagers(av) == 0, "the sidecar's averagers left");
}

/* ---- raw links ----------------------------------------------------------- */

static int dial(void)
{
    struct sockaddr_un sa = { .sun_family = AF_UNIX };
    int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);

    cr_assert_geq(s, 0);
    memcpy(sa.sun_path, path, strlen(path) + 1);
    cr_assert_eq(connect(s, (struct sockaddr *)&sa, sizeof(sa)), 0);
    return s;
}

/* One request; the reply's status, its sentence in why (may be NULL). */
static int ask(int s, uint16_t type, const void *body, uint32_t len, const int *fds, int nfds,
               void *out, size_t out_len, int *fd_out, char *why, size_t why_len)
{
    struct tlink_hdr h;
    char buf[TLINK_BODY_MAX + 1];
    int got[TLINK_FDS_MAX], ngot = 0, rc;

    rc = tlink_send(s, type, 0, body, len, fds, nfds);
    if (rc < 0)
        return rc;
    rc = tlink_recv(s, &h, buf, TLINK_BODY_MAX, -1, got, &ngot, FIXTURE_WAIT_MS);
    if (rc < 0)
        return rc;
    cr_assert_eq(h.type, TL_REPLY);
    buf[h.len] = '\0';
    if (why)
        snprintf(why, why_len, "%s", buf);
    if (out && h.status == 0) {
        cr_assert_eq(h.len, out_len);
        memcpy(out, buf, out_len);
    }
    if (fd_out)
        *fd_out = ngot ? got[0] : -1;
    else
        for (int i = 0; i < ngot; i++)
            close(got[i]);
    return h.status;
}

static int hello(int s)
{
    struct avlink_hello h = { .version = AVLINK_VERSION };

    return ask(s, AVL_HELLO, &h, sizeof(h), NULL, 0, NULL, 0, NULL, NULL, 0);
}

static void fill_create(struct avlink_create *c, uint64_t count)
{
    uint64_t goff;

    memset(c, 0, sizeof(*c));
    snprintf(c->prefix, sizeof(c->prefix), "run/raw");
    c->target_group_size = 2;
    c->min_group_size = 2;
    c->min_matchmaking_ms = 300;
    c->allreduce_timeout_ms = 3000;
    c->count = count;
    c->gather_max = 4096;
    cr_assert_eq(avlink_region_bytes(count, 4096, &c->region_bytes, &goff), 0);
}

/* CREATE on a fresh link; its status, the reply in *out. */
static int create_raw(int s, struct avlink_create *c, bool sealed, struct avlink_created *out,
                      char *why, size_t why_len)
{
    int fd, rc;

    cr_assert_eq(hello(s), 0);
    if (sealed) {
        fd = avlink_memfd("t", NULL, c->region_bytes, false);
    } else {
        fd = memfd_create("t", MFD_CLOEXEC);
        cr_assert_eq(ftruncate(fd, (off_t)c->region_bytes), 0);
    }
    cr_assert_geq(fd, 0);
    rc = ask(s, AVL_CREATE, c, sizeof(*c), &fd, 1, out, out ? sizeof(*out) : 0, NULL, why,
             why_len);
    close(fd);
    return rc;
}

/* Whether the sidecar closed the link: the next read finds its end. */
static bool closed(int s)
{
    struct tlink_hdr h;
    char buf[TLINK_BODY_MAX];
    int fds[TLINK_FDS_MAX], n;

    return tlink_recv(s, &h, buf, sizeof(buf), -1, fds, &n, FIXTURE_WAIT_MS) == -ECONNRESET;
}

Test(avlink, malformed_requests_end_the_link_and_bad_ones_are_refused_with_a_sentence)
{
    struct avlink_create c;
    struct avlink_created out;
    struct avlink_u32 u = { 100, 0 };
    char why[AVLINK_ERROR_MAX];
    int s;

    /* A request before CREATE or ATTACH. */
    s = dial();
    cr_assert_eq(hello(s), 0);
    cr_assert_eq(ask(s, AVL_WAIT, &u, sizeof(u), NULL, 0, NULL, 0, NULL, why, sizeof(why)),
                 -ENODEV);
    cr_assert(strstr(why, "Create or attach") != NULL, "%s", why);
    /* A body of the wrong size: the link ends. */
    cr_assert_eq(ask(s, AVL_WAIT, &u, 4, NULL, 0, NULL, 0, NULL, why, sizeof(why)), -EPROTO);
    cr_assert(closed(s));
    close(s);

    /* Over the sidecar's max_count (1 << 20 here): refused, nothing made. */
    s = dial();
    fill_create(&c, (1 << 20) + 1);
    cr_assert_eq(create_raw(s, &c, true, NULL, why, sizeof(why)), -EFBIG);
    cr_assert(strstr(why, "larger than this sidecar hosts") != NULL, "%s", why);
    cr_assert_eq(avserve_averagers(av), 0);
    close(s);

    /* An unsealed region, one of another size, a prefix without its NUL. */
    s = dial();
    fill_create(&c, COUNT);
    cr_assert_eq(create_raw(s, &c, false, NULL, why, sizeof(why)), -EINVAL);
    cr_assert(strstr(why, "sealed memfd") != NULL, "%s", why);
    c.region_bytes += 64;
    cr_assert_eq(ask(s, AVL_CREATE, &c, sizeof(c), NULL, 0, NULL, 0, NULL, why, sizeof(why)),
                 -EPROTO, "CREATE without its memfd is malformed");
    cr_assert(closed(s));
    close(s);
    s = dial();
    fill_create(&c, COUNT);
    memset(c.prefix, 'a', sizeof(c.prefix));
    cr_assert_eq(create_raw(s, &c, true, NULL, why, sizeof(why)), -EINVAL);
    cr_assert(strstr(why, "malformed") != NULL, "%s", why);
    /* gather_max over the averager's cap. */
    fill_create(&c, COUNT);
    c.gather_max = AVERAGER_GATHER_MAX + 1;
    {
        int fd = avlink_memfd("t", NULL, 64, false);
        cr_assert_eq(ask(s, AVL_CREATE, &c, sizeof(c), &fd, 1, NULL, 0, NULL, why, sizeof(why)),
                     -EINVAL);
        close(fd);
    }
    cr_assert_eq(avserve_averagers(av), 0);

    /* A good one; then a STEP whose gather exceeds gather_max, and a
     * second CREATE on the same link. */
    fill_create(&c, COUNT);
    {
        int fd = avlink_memfd("t", NULL, c.region_bytes, false);
        struct avlink_step st = { .weight = 1, .alpha = 1, .gather_len = 4097, .timeout_ms = 500 };
        struct avlink_attach at = { .version = AVLINK_VERSION };
        int s2;

        cr_assert_eq(ask(s, AVL_CREATE, &c, sizeof(c), &fd, 1, &out, sizeof(out), NULL, why,
                         sizeof(why)), 0, "%s", why);
        cr_assert_eq(avserve_averagers(av), 1);
        cr_assert_eq(ask(s, AVL_STEP, &st, sizeof(st), NULL, 0, NULL, 0, NULL, why, sizeof(why)),
                     -EINVAL);
        cr_assert(strstr(why, "gather_max") != NULL, "%s", why);
        cr_assert_eq(ask(s, AVL_CREATE, &c, sizeof(c), &fd, 1, NULL, 0, NULL, why, sizeof(why)),
                     -EALREADY);
        close(fd);

        /* A wrong token attaches to nothing; the right one does, and may
         * not step. */
        s2 = dial();
        cr_assert_eq(ask(s2, AVL_ATTACH, &at, sizeof(at), NULL, 0, NULL, 0, NULL, why,
                         sizeof(why)), -ENOENT);
        memcpy(at.token, out.token, sizeof(at.token));
        cr_assert_eq(ask(s2, AVL_ATTACH, &at, sizeof(at), NULL, 0, NULL, 0, NULL, why,
                         sizeof(why)), 0, "%s", why);
        cr_assert_eq(ask(s2, AVL_ATTACH, &at, sizeof(at), NULL, 0, NULL, 0, NULL, why,
                         sizeof(why)), -EALREADY, "one averager per link");
        st.gather_len = 0;
        cr_assert_eq(ask(s2, AVL_STEP, &st, sizeof(st), NULL, 0, NULL, 0, NULL, why, sizeof(why)),
                     -EPERM);
        /* A state over max_state_bytes (1 MiB here) is refused unread. */
        {
            struct avlink_u64 n = { (1 << 20) + 1 };
            int sf = avlink_memfd("s", NULL, 64, true);
            cr_assert_eq(ask(s2, AVL_PROVIDE_STATE, &n, sizeof(n), &sf, 1, NULL, 0, NULL, why,
                             sizeof(why)), -EFBIG);
            n.value = 32;
            cr_assert_eq(ask(s2, AVL_PROVIDE_STATE, &n, sizeof(n), &sf, 1, NULL, 0, NULL, why,
                             sizeof(why)), -EINVAL, "a memfd of another size than stated");
            close(sf);
        }
        /* The owner hangs up: the averager leaves, the attached link is
         * told so and let go. */
        close(s);
        FIXTURE_WAIT_FOR(avserve_averagers(av) == 0, "the averager left");
        cr_assert(closed(s2) || ask(s2, AVL_PARTS_SERVED, NULL, 0, NULL, 0, NULL, 0, NULL, NULL,
                                    0) == -ENOTCONN);
        close(s2);
    }
}

Test(avlink, the_cap_of_averagers_refuses_the_next_and_changes_nothing)
{
    int s[AVSERVE_AVERAGERS_MAX + 1];
    struct avlink_create c;
    char why[AVLINK_ERROR_MAX];

    fill_create(&c, COUNT);
    for (int i = 0; i < AVSERVE_AVERAGERS_MAX; i++) {
        s[i] = dial();
        cr_assert_eq(create_raw(s[i], &c, true, NULL, why, sizeof(why)), 0, "%d: %s", i, why);
    }
    cr_assert_eq(avserve_averagers(av), AVSERVE_AVERAGERS_MAX);
    s[AVSERVE_AVERAGERS_MAX] = dial();
    cr_assert_eq(create_raw(s[AVSERVE_AVERAGERS_MAX], &c, true, NULL, why, sizeof(why)), -EBUSY);
    cr_assert(strstr(why, "as many averagers") != NULL, "%s", why);
    cr_assert_eq(avserve_averagers(av), AVSERVE_AVERAGERS_MAX);
    /* One leaves: room for the refused link's next try. */
    close(s[0]);
    FIXTURE_WAIT_FOR(avserve_averagers(av) == AVSERVE_AVERAGERS_MAX - 1, "one left");
    {
        int fd = avlink_memfd("t", NULL, c.region_bytes, false);
        cr_assert_eq(ask(s[AVSERVE_AVERAGERS_MAX], AVL_CREATE, &c, sizeof(c), &fd, 1, NULL, 0,
                         NULL, why, sizeof(why)), 0, "%s", why);
        close(fd);
    }
    for (int i = 1; i <= AVSERVE_AVERAGERS_MAX; i++)
        close(s[i]);
    FIXTURE_WAIT_FOR(avserve_averagers(av) == 0 && avserve_links(av) == 0, "all left");
}

/* ---- a codec plan through the sidecar ---------------------------------- */

/* A CREATE whose region carries `n` plan ranges after the gathered bytes;
 * its status and sentence. */
static int create_planned(const struct avlink_range *plan, uint32_t n, uint64_t region_plan_len,
                          char *why, size_t why_len)
{
    struct avlink_create c;
    uint64_t goff, poff;
    uint8_t *m;
    int s = dial(), fd, rc;

    fill_create(&c, COUNT);
    c.plan_len = n;
    cr_assert_eq(avlink_region_layout(COUNT, 4096, region_plan_len, &c.region_bytes, &goff,
                                      &poff), 0);
    cr_assert_eq(hello(s), 0);
    fd = memfd_create("t", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    cr_assert_geq(fd, 0);
    cr_assert_eq(ftruncate(fd, (off_t)c.region_bytes), 0);
    m = mmap(NULL, c.region_bytes, PROT_WRITE, MAP_SHARED, fd, 0);
    cr_assert(m != MAP_FAILED);
    memcpy(m + poff, plan, region_plan_len * sizeof(*plan));
    munmap(m, c.region_bytes);
    cr_assert_eq(fcntl(fd, F_ADD_SEALS, TLINK_SEALS), 0);
    rc = ask(s, AVL_CREATE, &c, sizeof(c), &fd, 1, NULL, 0, NULL, why, why_len);
    close(fd);
    close(s);
    return rc;
}

/* Bad plans in the region are refused with the averager's sentence, and
 * nothing is made; a good one is taken. */
Test(avlink, a_bad_codec_plan_is_refused_with_a_sentence)
{
    static struct avlink_range many[AVLINK_PLAN_MAX + 1];
    struct avlink_range plan[2] = { { 8, 0, 0 }, { 8, 1, 0 } };
    char why[AVLINK_ERROR_MAX];

    cr_assert_eq(create_planned(many, AVLINK_PLAN_MAX + 1, AVLINK_PLAN_MAX, why, sizeof(why)),
                 -EINVAL);
    cr_assert(strstr(why, "more ranges") != NULL, "%s", why);
    /* The region without room for the plan it announces. */
    cr_assert_eq(create_planned(plan, 2, 0, why, sizeof(why)), -EINVAL);
    cr_assert(strstr(why, "sealed memfd") != NULL, "%s", why);
    plan[1].count = 7;
    cr_assert_eq(create_planned(plan, 2, 2, why, sizeof(why)), -EINVAL);
    cr_assert(strstr(why, "covers 15 of the 16") != NULL, "%s", why);
    plan[1].count = 8;
    plan[1].codec = 5;          /* PowerSGD: not a codec */
    cr_assert_eq(create_planned(plan, 2, 2, why, sizeof(why)), -EINVAL);
    cr_assert(strstr(why, "not a codec") != NULL, "%s", why);
    plan[1].codec = 1;
    plan[1].zero = 1;
    cr_assert_eq(create_planned(plan, 2, 2, why, sizeof(why)), -EINVAL);
    cr_assert(strstr(why, "not a codec") != NULL, "%s", why);
    cr_assert_eq(avserve_averagers(av), 0);
    plan[1].zero = 0;
    cr_assert_eq(create_planned(plan, 2, 2, why, sizeof(why)), 0, "%s", why);
    FIXTURE_WAIT_FOR(avserve_averagers(av) == 0 && avserve_links(av) == 0, "it left");
}

/* One averager through the sidecar and one in process, both with the
 * plan 8 exact, 8 fp16, through include/cohort.h: they group (the plan
 * reached the sidecar whole: its digest is in the schema), the exact
 * half is the exact average, the fp16 half within its bound, and both
 * hold the same bytes. A plan that does not cover the count is refused
 * with a sentence on either path. */
Test(avlink, a_codec_plan_through_the_sidecar_groups_and_averages)
{
    const struct cohort_codec_range plan[2] = { { 8, COHORT_COMPRESSION_NONE },
                                                { 8, COHORT_COMPRESSION_FP16 } };
    const struct cohort_codec_range short_[1] = { { 15, COHORT_COMPRESSION_NONE } };
    struct cohort_averager_config c = {
        .cohort = "avl", .id = "plan-in", .prefix = "run/plan", .target_group_size = 2,
        .min_group_size = 2, .min_matchmaking_ms = 300, .allreduce_timeout_ms = 3000,
        .count = COUNT, .schema = "f32x16", .schema_len = 6, .codec_plan = short_,
        .codec_plan_len = 1,
    };
    struct peer p[2] = { 0 };
    char why[AVLINK_ERROR_MAX] = "", kf[128];
    struct cohort_averager *bad = NULL;
    FILE *f;

    c.broker = addr;
    cr_assert_eq(cohort_averager_create_why(&c, &bad, why, sizeof(why)), -EINVAL);
    cr_assert(strstr(why, "covers 15 of the 16") != NULL, "sidecar: %s", why);
    c.codec_plan = plan;
    c.codec_plan_len = 2;
    cr_assert_eq(cohort_averager_create_why(&c, &p[0].a, why, sizeof(why)), 0, "%s", why);
    snprintf(kf, sizeof(kf), "%s/key", dir);
    f = fopen(kf, "w");
    cr_assert_not_null(f);
    for (size_t i = 0; i < sizeof(key.key); i++)
        fprintf(f, "%02x", key.key[i]);
    fclose(f);
    cr_assert_eq(setenv("COHORT_SECRET_FILE", kf, 1), 0);
    c.broker = broker;
    c.codec_plan = short_;
    c.codec_plan_len = 1;
    why[0] = '\0';
    cr_assert_eq(cohort_averager_create_why(&c, &bad, why, sizeof(why)), -EINVAL);
    cr_assert(strstr(why, "covers 15 of the 16") != NULL, "in process: %s", why);
    c.codec_plan = plan;
    c.codec_plan_len = 2;
    cr_assert_eq(cohort_averager_create_why(&c, &p[1].a, why, sizeof(why)), 0, "%s", why);
    unsetenv("COHORT_SECRET_FILE");
    unlink(kf);
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(cohort_averager_wait(p[i].a, FIXTURE_WAIT_MS), 0);
        p[i].weight = 1 + 2 * i;
        for (int j = 0; j < COUNT; j++)
            p[i].data[j] = j < 8 ? (float)(4 * i + j) : (float)((i + 1) * 0.377 * j);
    }
    for (int i = 0; i < 2; i++)
        cr_assert_eq(pthread_create(&p[i].t, NULL, step_main, &p[i]), 0);
    for (int i = 0; i < 2; i++)
        pthread_join(p[i].t, NULL);
    for (int i = 0; i < 2; i++)
        cr_assert_eq(p[i].rc, 0, "peer %d: %d %s", i, p[i].rc, cohort_averager_error(p[i].a));
    cr_assert_eq(memcmp(p[0].data, p[1].data, sizeof(p[0].data)), 0);
    for (int j = 0; j < COUNT; j++) {
        /* (1 x a + 3 x b) / 4 */
        double want = j < 8 ? (j + 3.0 * (4 + j)) / 4 : (0.377 * j + 3 * 2 * 0.377 * j) / 4;

        if (j < 8)
            cr_assert_eq(p[0].data[j], (float)want, "[%d] %g != %g", j, p[0].data[j], want);
        else
            cr_assert(fabs(p[0].data[j] - want) <= 4.0 / 2048 * 2 * 0.377 * COUNT,
                      "[%d] %g vs %g", j, p[0].data[j], want);
    }
    for (int i = 0; i < 2; i++) {
        cohort_averager_result_free(p[i].res);
        cohort_averager_destroy(p[i].a);
    }
    FIXTURE_WAIT_FOR(avserve_averagers(av) == 0, "the sidecar's averager left");
}

struct inproc {
    struct averager *a;
    float data[COUNT];
    double weight;
    int rc;
    struct averager_result *res;
    pthread_t t;
};

static void *inproc_main(void *arg)
{
    struct inproc *p = arg;
    struct averager_step s = { .data = p->data, .weight = p->weight, .alpha = 1,
                               .timeout_ms = FIXTURE_WAIT_MS };

    p->rc = averager_step(p->a, &s, &p->res);
    return NULL;
}

/* Two in-process averagers with the plan 8 exact, 8 fp16 and an
 * auxiliary averager without tensors hosted by the sidecar: the group
 * of three averages (the sidecar's averager learned the plan from the
 * first call and reduced its share of each), every result names all
 * three, the sidecar's with weight 0, the exact half is the exact
 * average and both in-process members hold the same bytes. */
Test(avlink, an_auxiliary_in_the_sidecar_helps_a_plan_group)
{
    static const struct averager_range plan[2] = { { 8, CODEC_NONE }, { 8, CODEC_FP16 } };
    struct cohort_averager_config c = {
        .broker = addr, .cohort = "avl", .id = "aux", .prefix = "run/auxplan",
        .target_group_size = 3, .min_group_size = 3, .min_matchmaking_ms = 300,
        .allreduce_timeout_ms = 3000,
    };
    struct peer aux = { 0 };
    struct inproc p[2] = { 0 };
    char why[AVLINK_ERROR_MAX] = "";
    const char *aux_id;

    cr_assert_eq(cohort_averager_create_why(&c, &aux.a, why, sizeof(why)), 0, "%s", why);
    cr_assert_eq(cohort_averager_wait(aux.a, FIXTURE_WAIT_MS), 0);
    for (int i = 0; i < 2; i++) {
        struct averager_config ac = {
            .broker = broker, .cohort = "avl", .id = i ? "plan-b" : "plan-a",
            .host = "127.0.0.1", .key = &key, .prefix = "run/auxplan",
            .target_group_size = 3, .min_group_size = 3, .min_matchmaking_ms = 300,
            .allreduce_timeout_ms = 3000, .count = COUNT, .schema = "f32x16",
            .schema_len = 6, .plan = plan, .plan_len = 2,
        };

        cr_assert_eq(averager_create(&ac, &p[i].a), 0);
        cr_assert_eq(averager_wait(p[i].a, FIXTURE_WAIT_MS), 0);
        p[i].weight = 1 + 2 * i;
        for (int j = 0; j < COUNT; j++)
            p[i].data[j] = j < 8 ? (float)(4 * i + j) : (float)((i + 1) * 0.377 * j);
    }
    cr_assert_eq(pthread_create(&aux.t, NULL, step_main, &aux), 0);
    for (int i = 0; i < 2; i++)
        cr_assert_eq(pthread_create(&p[i].t, NULL, inproc_main, &p[i]), 0);
    pthread_join(aux.t, NULL);
    for (int i = 0; i < 2; i++)
        pthread_join(p[i].t, NULL);
    cr_assert_eq(aux.rc, 0, "sidecar: %d %s", aux.rc, cohort_averager_error(aux.a));
    for (int i = 0; i < 2; i++)
        cr_assert_eq(p[i].rc, 0, "%d: %d %s", i, p[i].rc, averager_last_error(p[i].a));
    cr_assert_eq(cohort_averager_result_size(aux.res), 3);
    aux_id = NULL;
    for (size_t k = 0; k < 3; k++) {
        const char *id = cohort_averager_result_id(aux.res, k);

        if (strcmp(id, "plan-a") != 0 && strcmp(id, "plan-b") != 0) {
            cr_assert_null(aux_id, "two members other than plan-a and plan-b");
            aux_id = id;
            cr_assert_eq(cohort_averager_result_weight(aux.res, k), 0.0);
        }
    }
    cr_assert_not_null(aux_id, "the sidecar's averager is named");
    for (int i = 0; i < 2; i++) {
        bool named = false;

        cr_assert_eq(p[i].res->n, 3);
        for (size_t k = 0; k < 3; k++)
            named |= strcmp(p[i].res->ids[k], aux_id) == 0 && p[i].res->weights[k] == 0;
        cr_assert(named, "%d: the result names the auxiliary with weight 0", i);
    }
    cr_assert_eq(memcmp(p[0].data, p[1].data, sizeof(p[0].data)), 0);
    for (int j = 0; j < COUNT; j++) {
        /* (1 x a + 3 x b) / 4 */
        double want = j < 8 ? (j + 3.0 * (4 + j)) / 4 : (0.377 * j + 3 * 2 * 0.377 * j) / 4;

        if (j < 8)
            cr_assert_eq(p[0].data[j], (float)want, "[%d] %g != %g", j, p[0].data[j], want);
        else
            cr_assert(fabs(p[0].data[j] - want) <= 5.0 / 2048 * 2 * 0.377 * COUNT,
                      "[%d] %g vs %g", j, p[0].data[j], want);
    }
    for (int i = 0; i < 2; i++) {
        averager_result_free(p[i].res);
        averager_destroy(p[i].a);
    }
    cohort_averager_result_free(aux.res);
    cohort_averager_destroy(aux.a);
    FIXTURE_WAIT_FOR(avserve_averagers(av) == 0, "the sidecar's averager left");
}

Test(avlink, a_trainer_gone_mid_step_has_its_averager_leave)
{
    struct avlink_create c;
    /* A step's timeout four times the wait below: the averager leaving
     * within the wait is the step aborted, not the step ending. */
    struct avlink_step st = { .weight = 1, .alpha = 1, .timeout_ms = 4 * FIXTURE_WAIT_MS };
    char why[AVLINK_ERROR_MAX];
    int s = dial();

    fill_create(&c, COUNT);
    cr_assert_eq(create_raw(s, &c, true, NULL, why, sizeof(why)), 0, "%s", why);
    /* Nobody to pair with: the step waits for a group; the trainer dies. */
    cr_assert_eq(tlink_send(s, AVL_STEP, 0, &st, sizeof(st), NULL, 0), 0);
    close(s);
    FIXTURE_WAIT_FOR(avserve_averagers(av) == 0 && avserve_links(av) == 0,
                     "the averager left with its step aborted");
}

/* ---- a sidecar that goes away mid-step ---------------------------------- */

struct fake {
    int lfd;
    pthread_t t;
};

/* Answers HELLO and CREATE as a sidecar would, then dies at the STEP. */
static void *fake_main(void *arg)
{
    struct fake *f = arg;
    int s = accept4(f->lfd, NULL, NULL, SOCK_CLOEXEC);
    struct tlink_hdr h;
    char buf[TLINK_BODY_MAX];
    int fds[TLINK_FDS_MAX], n;
    struct avlink_created out;

    if (s < 0)
        return NULL;
    memset(&out, 0, sizeof(out));
    snprintf(out.id, sizeof(out.id), "fake_av1");
    for (;;) {
        if (tlink_recv(s, &h, buf, sizeof(buf), -1, fds, &n, FIXTURE_WAIT_MS) < 0)
            break;
        for (int i = 0; i < n; i++)
            close(fds[i]);
        if (h.type == AVL_HELLO)
            tlink_send(s, TL_REPLY, 0, NULL, 0, NULL, 0);
        else if (h.type == AVL_CREATE)
            tlink_send(s, TL_REPLY, 0, &out, sizeof(out), NULL, 0);
        else if (h.type == AVL_WAIT)
            tlink_send(s, TL_REPLY, 0, NULL, 0, NULL, 0);
        else
            break;      /* the STEP: gone */
    }
    close(s);
    return NULL;
}

Test(avlink, a_sidecar_gone_mid_step_fails_the_step_at_once_with_a_sentence)
{
    struct sockaddr_un sa = { .sun_family = AF_UNIX };
    struct fake f;
    char fpath[128], faddr[160];
    struct peer p = { 0 };
    uint64_t began;

    snprintf(fpath, sizeof(fpath), "%s/fake.sock", dir);
    snprintf(faddr, sizeof(faddr), "unix:%s", fpath);
    memcpy(sa.sun_path, fpath, strlen(fpath) + 1);
    f.lfd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    cr_assert_eq(bind(f.lfd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    cr_assert_eq(listen(f.lfd, 1), 0);
    cr_assert_eq(pthread_create(&f.t, NULL, fake_main, &f), 0);
    p.a = make(faddr, "x", 2);
    cr_assert_str_eq(cohort_averager_id(p.a), "fake_av1");
    p.weight = 1;
    p.timeout_ms = 60000;
    for (int j = 0; j < COUNT; j++)
        p.data[j] = (float)j;
    began = clock_now_ms();
    step_main(&p);
    cr_assert_eq(p.rc, -ENOTCONN);
    cr_assert_lt(clock_now_ms() - began, 30000, "within the step's timeout, at once");
    cr_assert_str_eq(cohort_averager_error(p.a), "The sidecar went away.");
    for (int j = 0; j < COUNT; j++)
        cr_assert_eq(p.data[j], (float)j, "data untouched");
    /* Every call after it fails the same way. */
    step_main(&p);
    cr_assert_eq(p.rc, -ENOTCONN);
    cohort_averager_destroy(p.a);
    pthread_join(f.t, NULL);
    close(f.lfd);
    unlink(fpath);
}

/* One socket per pod: while an Accumulator's trainer holds the session,
 * an averager link is still adopted, and a second Accumulator is still
 * refused before it says anything. */
Test(avlink, the_accumulators_session_and_averager_links_share_the_socket)
{
    struct tlink_hello th = { .api_version = TLINK_VERSION };
    struct tlink_hdr h;
    char buf[TLINK_BODY_MAX];
    int fds[TLINK_FDS_MAX], n;
    struct cohort_averager *a;
    int acc, other;

    snprintf(th.name, sizeof(th.name), "model");
    acc = dial();
    cr_assert_eq(ask(acc, TL_HELLO, &th, sizeof(th), NULL, 0, NULL, 0, NULL, NULL, 0), 0);
    a = make(addr, "beside", 2);
    cr_assert(strncmp(cohort_averager_id(a), "sc_av", 5) == 0);
    cr_assert_eq(avserve_averagers(av), 1);
    other = dial();
    cr_assert_eq(tlink_recv(other, &h, buf, sizeof(buf), -1, fds, &n, FIXTURE_WAIT_MS), 0);
    cr_assert_eq(h.status, -EBUSY, "told before it says anything");
    close(other);
    /* The session is the Accumulator's still: it answers as before
     * registration (a VIEW needs a node). */
    cr_assert_eq(ask(acc, TL_VIEW, NULL, 0, NULL, 0, NULL, 0, NULL, NULL, 0), -ENODEV);
    close(acc);
    cohort_averager_destroy(a);
    FIXTURE_WAIT_FOR(avserve_averagers(av) == 0, "the averager left");
}

/* The deadline to create or attach holds for a link that keeps talking:
 * one that says HELLO every 100 ms, and makes nothing, is closed once
 * TLINK_HELLO_DEADLINE_MS has passed, as a silent one is, so that no
 * process that can reach the socket holds the sidecar's links by
 * chattering. */
Test(avlink, a_link_that_chatters_without_creating_is_closed_at_its_deadline)
{
    uint64_t began = clock_now_ms(), end = began + TLINK_HELLO_DEADLINE_MS + FIXTURE_WAIT_MS;
    int s = dial(), rc = 0;

    while (clock_now_ms() < end) {
        rc = hello(s);
        if (rc != 0)
            break;
        /* The chatter's pace: well under the sidecar's idle poll. */
        usleep(100000);
    }
    cr_assert(rc == -ECONNRESET || rc == -EPIPE, "the link was still served after %llu ms (%d)",
              (unsigned long long)(clock_now_ms() - began), rc);
    cr_assert_geq(clock_now_ms() - began, TLINK_HELLO_DEADLINE_MS, "not before its deadline");
    close(s);
    FIXTURE_WAIT_FOR(avserve_links(av) == 0, "the sidecar let the link go");
}

/* A trainer that dies in a wait for its averager to join: the wait ends
 * with it, not at the timeout the trainer gave (here ten minutes; up to
 * 49 days fit the field), so the averager leaves, the link is let go and
 * the sidecar can stop. The averager here holds another key than the
 * broker's, so it never joins and only the hang-up can end the wait. */
Test(avlink, a_trainer_gone_mid_wait_ends_the_wait_and_its_averager_leaves)
{
    struct secret other;
    struct avserve_config ac = { .broker = broker, .cohort = "avl", .id = "lone",
                                 .host = "127.0.0.1", .key = &other, .max_count = 1 << 20,
                                 .max_state_bytes = 1 << 20 };
    struct avlink_u32 u = { 600000, 0 };
    struct avlink_create c;
    struct avlink_created out;
    struct avserve *lone;
    char why[AVLINK_ERROR_MAX];
    uint64_t began;
    int sv[2];

    cr_assert_eq(secret_random(other.key, sizeof(other.key)), 0);
    cr_assert_eq(avserve_create(&ac, &lone), 0);
    cr_assert_eq(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv), 0);
    cr_assert_eq(avserve_adopt(lone, sv[1]), 0);
    fill_create(&c, COUNT);
    cr_assert_eq(create_raw(sv[0], &c, true, &out, why, sizeof(why)), 0, "%s", why);
    cr_assert_eq(avserve_averagers(lone), 1);
    cr_assert_eq(tlink_send(sv[0], AVL_WAIT, 0, &u, sizeof(u), NULL, 0), 0);
    /* Whether the sidecar has read the WAIT yet or not, it reads it
     * (queued before the close) and so waits with its trainer gone. */
    began = clock_now_ms();
    close(sv[0]);
    FIXTURE_WAIT_FOR(avserve_links(lone) == 0 && avserve_averagers(lone) == 0,
                     "the wait ended with its trainer and the averager left");
    cr_assert_lt(clock_now_ms() - began, FIXTURE_WAIT_MS);
    avserve_destroy(lone);
}

/* Quantile8 (hivemind's Quantile8BitQuantization) through the sidecar, as
 * include/cohort.h offers it: the link carries every codec an averager
 * takes, so two averagers hosted by the sidecar average with it, alike
 * at both and within the codec's bound (each value's error at most the
 * run's range; with 16 distinct values among 256 buckets, far less). */
Test(avlink, quantile8_travels_through_the_sidecar)
{
    struct cohort_averager_config c = {
        .broker = addr, .cohort = "avl", .id = "q8", .prefix = "run/avl-q8",
        .target_group_size = 2, .min_group_size = 2, .min_matchmaking_ms = 300,
        .allreduce_timeout_ms = 3000, .count = COUNT, .schema = "f32x16", .schema_len = 6,
        .compression = COHORT_COMPRESSION_QUANTILE8,
    };
    struct peer p[2] = { 0 };

    for (int i = 0; i < 2; i++) {
        cr_assert_eq(cohort_averager_create(&c, &p[i].a), 0, "quantile8 in a sidecar");
        cr_assert_eq(cohort_averager_wait(p[i].a, FIXTURE_WAIT_MS), 0);
        p[i].weight = 1;
        for (int j = 0; j < COUNT; j++)
            p[i].data[j] = (float)(16 * i + j);
    }
    for (int i = 0; i < 2; i++)
        cr_assert_eq(pthread_create(&p[i].t, NULL, step_main, &p[i]), 0);
    for (int i = 0; i < 2; i++)
        pthread_join(p[i].t, NULL);
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(p[i].rc, 0, "peer %d: %d %s", i, p[i].rc, cohort_averager_error(p[i].a));
        for (int j = 0; j < COUNT; j++)
            cr_assert(fabsf(p[i].data[j] - (float)(8 + j)) <= 0.5f, "peer %d [%d]: %g", i, j,
                      p[i].data[j]);
        cohort_averager_result_free(p[i].res);
    }
    cr_assert(memcmp(p[0].data, p[1].data, sizeof(p[0].data)) == 0, "alike at both");
    for (int i = 0; i < 2; i++)
        cohort_averager_destroy(p[i].a);
    FIXTURE_WAIT_FOR(avserve_averagers(av) == 0, "the sidecar's averagers left");
}

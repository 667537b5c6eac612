/* tests/unit/test_gpuchan.c: an epoch's NCCL agreement carried by real
 * engines on loopback: the first member's unique id reaches every member
 * that holds the cohort's key, and a member without it gets nothing. NCCL
 * itself is a fake here (tests/unit/test_ncomm.c tests the machine). */
#include <criterion/criterion.h>

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "accumulator/gpuchan.h"
#include "base/log.h"
#include "base/secret.h"
#include "engine/allreduce.h"
#include "gpu/ncomm.h"
#include "membership/epoch.h"

#define N 3
#define COHORT "gpu"

struct member {
    char id[16];
    int fd;
    char addr[64];
    struct allreduce *ar;
    struct ncomm_ops ops;
    struct ncomm *c;
    struct gpuchan ch;
    uint8_t id_byte;
    int id_calls;
    const char *members[N];
    struct ncomm_plan plan;
    int rc;
};

/* Only get_unique_id is reached by an agreement. */
static int f_id(void *arg, struct ncomm_id *id)
{
    struct member *m = arg;

    m->id_calls++;
    memset(id->b, m->id_byte, sizeof(id->b));
    return 0;
}

static void *agree_main(void *arg)
{
    struct member *m = arg;
    struct ncomm_channel ch = gpuchan_channel(&m->ch);

    m->rc = ncomm_agree(m->c, m->members, N, m->id, &ch, &m->plan);
    return NULL;
}

/* N members in one epoch, member i holding keys[i]. */
static void start(struct member *ms, const struct secret *const *keys)
{
    struct epoch_member em[N];
    struct epoch *e;

    log_set_level(LOG_ERROR);
    memset(ms, 0, sizeof(*ms) * N);
    for (int i = 0; i < N; i++) {
        struct member *m = &ms[i];
        struct allreduce_config cfg = { .cohort = COHORT, .member_id = m->id,
                                        .member_timeout_ms = 5000, .key = keys[i] };
        snprintf(m->id, sizeof(m->id), "m-%d", i);
        cr_assert_eq(allreduce_listen("127.0.0.1", &m->fd, m->addr, sizeof(m->addr)), 0);
        cfg.listen_fd = m->fd;
        cr_assert_eq(allreduce_create(&cfg, &m->ar), 0);
        m->ops = (struct ncomm_ops){ .get_unique_id = f_id, .arg = m };
        cr_assert_eq(ncomm_create(&m->ops, &m->c), 0);
        cr_assert_eq(gpuchan_init(&m->ch, m->ar, 100), 0);
        m->id_byte = (uint8_t)(0x50 + i);
        em[i] = (struct epoch_member){ .id = m->id, .address = m->addr };
    }
    for (int i = 0; i < N; i++)
        for (int k = 0; k < N; k++)
            ms[i].members[k] = ms[k].id;
    cr_assert_eq(epoch_create(COHORT, 1, 0, em, N, &e), 0);
    for (int i = 0; i < N; i++)
        cr_assert_eq(allreduce_set_epoch(ms[i].ar, e), 0);
    epoch_unref(e);
}

static void agree_all(struct member *ms)
{
    pthread_t t[N];

    for (int i = 0; i < N; i++)
        cr_assert_eq(pthread_create(&t[i], NULL, agree_main, &ms[i]), 0);
    for (int i = 0; i < N; i++)
        pthread_join(t[i], NULL);
}

static void stop(struct member *ms)
{
    for (int i = 0; i < N; i++) {
        gpuchan_cleanup(&ms[i].ch);
        ncomm_destroy(ms[i].c);
        allreduce_destroy(ms[i].ar);
        close(ms[i].fd);
    }
}

Test(gpuchan, the_first_members_id_reaches_every_keyed_member)
{
    struct secret key;
    const struct secret *keys[N] = { &key, &key, &key };
    struct member ms[N];

    cr_assert_eq(secret_generate(&key), 0);
    start(ms, keys);
    agree_all(ms);
    for (int i = 0; i < N; i++) {
        cr_assert_eq(ms[i].rc, 0, "member %d: %d", i, ms[i].rc);
        cr_assert_not(ms[i].plan.shrink, "no communicator yet: a rebuild");
        for (int k = 0; k < NCOMM_ID_BYTES; k++)
            cr_assert_eq(ms[i].plan.id.b[k], 0x50, "member %d byte %d", i, k);
        cr_assert_eq(ms[i].id_calls, i == 0 ? 1 : 0);
        cr_assert_eq(ms[i].ch.round, 102, "two sums: the vote, then the id");
    }
    stop(ms);
}

Test(gpuchan, a_member_without_the_key_gets_no_id_and_stops_the_agreement)
{
    struct secret key, other;
    const struct secret *keys[N] = { &key, &key, &other };
    struct member ms[N];

    cr_assert_eq(secret_generate(&key), 0);
    cr_assert_eq(secret_generate(&other), 0);
    start(ms, keys);
    agree_all(ms);
    for (int i = 0; i < N; i++)
        cr_assert_lt(ms[i].rc, 0, "member %d agreed with a stranger in the epoch", i);
    for (int k = 0; k < NCOMM_ID_BYTES; k++)
        cr_assert_eq(ms[2].plan.id.b[k], 0, "the stranger learnt nothing");
    stop(ms);
}

Test(gpuchan, refuses_a_sum_longer_than_the_exchange)
{
    struct secret key;
    const struct secret *keys[N] = { &key, &key, &key };
    struct member ms[N];
    uint64_t w[NCOMM_XCHG_WORDS + 1] = { 0 };
    struct ncomm_channel ch;

    cr_assert_eq(secret_generate(&key), 0);
    start(ms, keys);
    ch = gpuchan_channel(&ms[0].ch);
    cr_assert_eq(ch.sum_u64(ch.arg, w, NCOMM_XCHG_WORDS + 1), -EINVAL);
    cr_assert_eq(ch.sum_u64(ch.arg, w, 0), -EINVAL);
    cr_assert_eq(ms[0].ch.round, 100, "no round was used");
    stop(ms);
}

/* tests/unit/engines.c: see engines.h. */
#include "engines.h"

#include <criterion/criterion.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "base/log.h"
#include "membership/epoch.h"

#define COHORT "test"

void engines_start(struct engines *c, size_t n, uint32_t timeout_ms)
{
    cr_assert_leq(n, ENGINES_MAX);
    log_set_level(LOG_ERROR);
    memset(c, 0, sizeof(*c));
    c->n = n;
    for (size_t i = 0; i < n; i++) {
        struct engines_peer *p = &c->p[i];
        struct allreduce_config cfg = { .cohort = COHORT, .member_id = p->id,
                                        .member_timeout_ms = timeout_ms };

        snprintf(p->id, sizeof(p->id), "m-%zu", i);
        cr_assert_eq(allreduce_listen("127.0.0.1", &p->fd, p->addr, sizeof(p->addr)), 0);
        cfg.listen_fd = p->fd;
        cr_assert_eq(allreduce_create(&cfg, &p->ar), 0);
    }
    engines_adopt(c, 1, n);
}

void engines_adopt(struct engines *c, uint64_t number, size_t members)
{
    struct epoch_member m[ENGINES_MAX];
    struct epoch *e;

    for (size_t i = 0; i < members; i++)
        m[i] = (struct epoch_member){ .id = c->p[i].id, .address = c->p[i].addr };
    cr_assert_eq(epoch_create(COHORT, number, 0, m, members, &e), 0);
    for (size_t i = 0; i < c->n; i++)
        cr_assert_eq(allreduce_set_epoch(c->p[i].ar, e), 0);
    epoch_unref(e);
}

void engines_stop(struct engines *c)
{
    for (size_t i = 0; i < c->n; i++) {
        allreduce_destroy(c->p[i].ar);
        close(c->p[i].fd);
    }
}

struct each {
    void (*fn)(size_t i, void *arg);
    void *arg;
    size_t i;
};

static void *each_main(void *arg)
{
    struct each *e = arg;

    e->fn(e->i, e->arg);
    return NULL;
}

void engines_each(struct engines *c, size_t n, void (*fn)(size_t i, void *arg), void *arg)
{
    pthread_t th[ENGINES_MAX];
    struct each e[ENGINES_MAX];

    cr_assert_leq(n, c->n);
    for (size_t i = 0; i < n; i++) {
        e[i] = (struct each){ .fn = fn, .arg = arg, .i = i };
        cr_assert_eq(pthread_create(&th[i], NULL, each_main, &e[i]), 0);
    }
    for (size_t i = 0; i < n; i++)
        pthread_join(th[i], NULL);
}

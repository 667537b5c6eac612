/* tests/unit/test_workq.c: the operator's work queue with an injected
 * clock: dedup, no double hand-out, retries with backoff, ordering, caps. */
#include <criterion/criterion.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "base/clock.h"
#include "k8s/workq.h"

static struct workq *q;

static void setup(void)
{
    struct workq_config c = { .base_delay_ms = 10, .max_delay_ms = 1000, .max_keys = 4 };
    cr_assert_eq(workq_create(&c, &q), 0);
}

static void teardown(void)
{
    workq_destroy(q);
}

TestSuite(workq, .init = setup, .fini = teardown, .timeout = 30);

static int get(uint64_t now, char *buf, uint32_t *wait)
{
    return workq_get(q, now, buf, 64, wait);
}

Test(workq, adds_of_a_waiting_key_collapse)
{
    char k[64];
    uint32_t w;

    cr_assert_eq(workq_add(q, "ns/a", 0), 0);
    cr_assert_eq(workq_add(q, "ns/a", 0), 0);
    cr_assert_eq(workq_add(q, "ns/b", 0), 0);
    cr_assert_eq(workq_len(q), 2);
    cr_assert_eq(get(0, k, &w), 0);
    cr_assert_str_eq(k, "ns/a", "first in, first out");
    cr_assert_eq(get(0, k, &w), 0);
    cr_assert_str_eq(k, "ns/b");
    cr_assert_eq(get(0, k, &w), -EAGAIN);
    cr_assert_eq(w, UINT32_MAX);
}

Test(workq, key_added_while_processing_comes_back_after_done)
{
    char k[64];
    uint32_t w;

    workq_add(q, "ns/a", 0);
    cr_assert_eq(get(0, k, &w), 0);
    cr_assert_eq(workq_add(q, "ns/a", 1), 0);
    cr_assert_eq(get(1, k, &w), -EAGAIN, "never handed out twice at once");
    workq_done(q, "ns/a", 2);
    cr_assert_eq(get(2, k, &w), 0);
    cr_assert_str_eq(k, "ns/a");
    workq_done(q, "ns/a", 3);
    cr_assert_eq(workq_len(q), 0);
}

Test(workq, delayed_adds_keep_the_earliest_time)
{
    char k[64];
    uint32_t w;

    workq_add_after(q, "ns/a", 0, 500);
    workq_add_after(q, "ns/a", 0, 100);
    workq_add_after(q, "ns/a", 0, 300);
    cr_assert_eq(get(50, k, &w), -EAGAIN);
    cr_assert_eq(w, 50);
    cr_assert_eq(get(100, k, &w), 0);
}

Test(workq, retries_back_off_exponentially_and_forget_resets)
{
    char k[64];
    uint32_t w;
    uint64_t now = 0;
    uint32_t expect[] = { 10, 20, 40, 80, 160, 320, 640, 1000, 1000 };

    for (size_t i = 0; i < sizeof(expect) / sizeof(expect[0]); i++) {
        cr_assert_eq(workq_add_rate_limited(q, "ns/a", now), 0);
        cr_assert_eq(get(now, k, &w), -EAGAIN);
        cr_assert_eq(w, expect[i], "retry %zu waits %u, not %u", i, expect[i], w);
        now += w;
        cr_assert_eq(get(now, k, &w), 0);
        workq_done(q, k, now);
    }
    cr_assert_eq(workq_failures(q, "ns/a"), 9);
    workq_forget(q, "ns/a");
    cr_assert_eq(workq_failures(q, "ns/a"), 0);
    workq_add_rate_limited(q, "ns/a", now);
    cr_assert_eq(get(now, k, &w), -EAGAIN);
    cr_assert_eq(w, 10);
}

Test(workq, key_cap_and_small_buffers_are_refused)
{
    char k[4];
    uint32_t w;

    for (int i = 0; i < 4; i++) {
        char key[16];
        snprintf(key, sizeof(key), "ns/k%d", i);
        cr_assert_eq(workq_add(q, key, 0), 0);
    }
    cr_assert_eq(workq_add(q, "ns/k4", 0), -ENOSPC);
    cr_assert_eq(workq_get(q, 0, k, sizeof(k), &w), -ENAMETOOLONG);
    cr_assert_eq(workq_len(q), 4, "the key stays queued");
}

static void *waiter(void *arg)
{
    char k[64];
    return (void *)(intptr_t)workq_wait(q, k, sizeof(k), 20000);
}

Test(workq, wait_wakes_on_add_and_on_shutdown)
{
    pthread_t t;
    void *rc;
    char k[64];

    pthread_create(&t, NULL, waiter, NULL);
    workq_add(q, "ns/a", clock_now_ms());
    pthread_join(t, &rc);
    cr_assert_eq((intptr_t)rc, 0);
    cr_assert_eq(workq_wait(q, k, sizeof(k), 50), -ETIMEDOUT);
    pthread_create(&t, NULL, waiter, NULL);
    workq_shutdown(q);
    pthread_join(t, &rc);
    cr_assert_eq((intptr_t)rc, -ESHUTDOWN);
    cr_assert_eq(workq_add(q, "ns/b", 0), -ESHUTDOWN);
}

Test(workq, many_keys_come_out_in_due_order)
{
    struct workq *big;
    char k[64];
    uint32_t w;
    uint64_t last = 0;

    cr_assert_eq(workq_create(NULL, &big), 0);
    for (int i = 0; i < 5000; i++) {
        char key[32];
        snprintf(key, sizeof(key), "ns/c-%d", i);
        cr_assert_eq(workq_add_after(big, key, 0, (uint32_t)((i * 7919) % 1000)), 0);
    }
    for (int i = 0; i < 5000; i++) {
        uint64_t due;
        cr_assert_eq(workq_get(big, 1000, k, sizeof(k), &w), 0);
        sscanf(k, "ns/c-%lu", &due);
        due = (due * 7919) % 1000;
        cr_assert_geq(due, last, "out of order at %d", i);
        last = due;
        workq_done(big, k, 1000);
    }
    cr_assert_eq(workq_len(big), 0);
    workq_destroy(big);
}

/* tests/unit/avpeers.h: what the averager suites (test_averager.c,
 * test_avplan.c) share: peers that each run one averager_step() on a
 * thread of their own, so that a group forms among them, and their
 * cleanup. The helpers fail the running test with cr_assert, so they
 * belong on the test's thread; avpeers_step() asserts nothing. */
#ifndef COHORT_TEST_AVPEERS_H
#define COHORT_TEST_AVPEERS_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#define AVPEERS_COUNT 16                /* the floats each peer averages */

struct averager;
struct averager_result;

/* One averager and its step: the test fills the inputs, the step sets
 * rc and res. */
struct avpeer {
    struct averager *a;                 /* the peer's; avpeers_free() destroys it */
    float data[AVPEERS_COUNT];
    double weight;
    double alpha;                       /* 0: 1 */
    char gather[32];                    /* the bytes gathered: the string, no NUL */
    uint32_t timeout_ms;                /* 0: FIXTURE_WAIT_MS */
    bool no_retries;
    int rc;
    struct averager_result *res;        /* avpeers_free() frees it */
    pthread_t t;
};

/* Runs the step of the struct avpeer at arg; a thread's body, or called
 * in place. Returns NULL. */
void *avpeers_step(void *arg);

/* The steps of p[0..n), each on its own thread, all joined. */
void avpeers_run(struct avpeer *p, int n);

/* Frees the results and destroys the averagers of p[0..n). */
void avpeers_free(struct avpeer *p, int n);

#endif

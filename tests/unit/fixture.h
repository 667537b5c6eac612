/* tests/unit/fixture.h: a broker on loopback for the tests whose nodes
 * and trainers need one, with the fast timings those tests share. */
#ifndef COHORT_TEST_FIXTURE_H
#define COHORT_TEST_FIXTURE_H

#include <stddef.h>

struct brokerd;

/* rpc_init(), then a broker on a free loopback port with no startup hold,
 * 200 ms heartbeats, a 1.5 s member timeout and 20 ms coalescing, and
 * `cohort` declared. Writes "127.0.0.1:PORT" to addr. Fails the test on
 * any error. Stop it with fixture_broker_stop(). */
struct brokerd *fixture_broker_start(const char *cohort, char *addr, size_t addr_len);
/* brokerd_stop(), then rpc_shutdown(). */
void fixture_broker_stop(struct brokerd *d);

#endif

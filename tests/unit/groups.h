/* tests/unit/groups.h: what the suites of src/collective/ share: one
 * broker per test, with a startup hold so that members started together
 * form one first epoch, and groups made alike on it. The helpers fail the
 * running test with cr_assert, so they belong on the test's thread. */
#ifndef COHORT_TEST_GROUPS_H
#define COHORT_TEST_GROUPS_H

#include <stdbool.h>

struct group;

/* In a suite's .init: starts the broker, serving `cohort` (borrowed for
 * the test). */
void groups_start(const char *cohort);
/* In the suite's .fini. */
void groups_stop(void);
/* The broker's address, valid until groups_stop(). */
const char *groups_broker(void);
/* A member `id` of the cohort on loopback, with a 20 s reduce timeout.
 * The caller frees it with group_destroy(). */
struct group *groups_make(const char *id);
/* True when every group in g[0..n) sees an epoch of n members. */
bool groups_all_see(struct group **g, int n);

#endif

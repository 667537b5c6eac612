/* src/base/clock.h: the monotonic clock every deadline in cohort is measured on.
 * Modules that make decisions from time take `now` as an argument instead of
 * calling this, so tests can drive them with an injected clock. */
#ifndef COHORT_CLOCK_H
#define COHORT_CLOCK_H

#include <pthread.h>
#include <stdint.h>
#include <time.h>

uint64_t clock_now_ms(void);    /* CLOCK_MONOTONIC, milliseconds */
uint64_t clock_now_us(void);    /* CLOCK_MONOTONIC, microseconds */
uint64_t clock_wall_ms(void);   /* CLOCK_REALTIME, for log timestamps only */

/* Sleeps `ms` milliseconds (a signal may cut it short). */
void clock_sleep_ms(uint32_t ms);

/* The CLOCK_MONOTONIC moment `ms` from now, for pthread_cond_timedwait on
 * a condition variable created with that clock (clock_cond_init). */
struct timespec clock_deadline(uint32_t ms);

/* Initialises a condition variable that waits on CLOCK_MONOTONIC, so a
 * change of the wall clock never stretches or cuts a wait short. */
int clock_cond_init(pthread_cond_t *cond);

#endif

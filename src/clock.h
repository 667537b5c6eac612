/* src/clock.h: the monotonic clock every deadline in cohort is measured on.
 * Modules that make decisions from time take `now` as an argument instead of
 * calling this, so tests can drive them with an injected clock. */
#ifndef COHORT_CLOCK_H
#define COHORT_CLOCK_H

#include <stdint.h>

uint64_t clock_now_ms(void);    /* CLOCK_MONOTONIC, milliseconds */
uint64_t clock_now_us(void);    /* CLOCK_MONOTONIC, microseconds */
uint64_t clock_wall_ms(void);   /* CLOCK_REALTIME, for log timestamps only */

#endif

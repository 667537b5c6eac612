/* src/clock.c: see clock.h. */
#include "clock.h"

#include <time.h>

static uint64_t read_us(clockid_t id)
{
    struct timespec ts;

    clock_gettime(id, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

uint64_t clock_now_us(void)
{
    return read_us(CLOCK_MONOTONIC);
}

uint64_t clock_now_ms(void)
{
    return read_us(CLOCK_MONOTONIC) / 1000u;
}

uint64_t clock_wall_ms(void)
{
    return read_us(CLOCK_REALTIME) / 1000u;
}

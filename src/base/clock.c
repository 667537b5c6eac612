/* src/base/clock.c: see clock.h. */
#include "base/clock.h"

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

struct timespec clock_deadline(uint32_t ms)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    ts.tv_sec += ms / 1000;
    ts.tv_nsec += (long)(ms % 1000) * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    return ts;
}

int clock_cond_init(pthread_cond_t *cond)
{
    pthread_condattr_t ca;
    int rc;

    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    rc = -pthread_cond_init(cond, &ca);
    pthread_condattr_destroy(&ca);
    return rc;
}

void clock_sleep_ms(uint32_t ms)
{
    struct timespec ts = { (time_t)(ms / 1000), (long)(ms % 1000) * 1000000L };

    nanosleep(&ts, NULL);
}

/* bench/gpu_trainer.c: one trainer of bench/gpu.sh, through the public API
 * only: N float32 gradients on the GPU named by $COHORT_GPU_UUID
 * (cohort_use_gpu), reduced host-staged by its sidecar with the other
 * trainer's, ROUNDS times after WARMUP. Each round is timed from
 * cohort_reduce_gradients to the result on the device (the view's
 * has_gradients, which the sidecar publishes once its copy to the device
 * is done). Prints one JSON line: the median and the best round.
 *
 *   gpu_trainer N ROUNDS WARMUP     (run under cohortctl run -n 2)
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cohort.h"

static double now_ms(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static int cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;

    return x < y ? -1 : x > y;
}

static int parse(const char *s, unsigned long long max, unsigned long long *out)
{
    char *end;

    errno = 0;
    *out = strtoull(s, &end, 10);
    return errno || end == s || *end || *out > max ? -EINVAL : 0;
}

int main(int argc, char **argv)
{
    const char *uuid = getenv("COHORT_GPU_UUID");
    unsigned long long n, rounds, warmup;
    struct cohort_tensor t = { "g", COHORT_F32, 0 };
    struct cohort_config cfg = { .name = "gpu-bench", .parameters = &t, .n_parameters = 1 };
    struct cohort *c = NULL;
    double *ms, t0 = 0;
    unsigned long long done = 0;
    int rc, pending = 0;

    if (argc != 4 || parse(argv[1], 1ull << 32, &n) || n == 0 || parse(argv[2], 100000, &rounds) ||
        rounds == 0 || parse(argv[3], 100000, &warmup) || !uuid) {
        fprintf(stderr, "usage: COHORT_GPU_UUID=GPU-... gpu_trainer N ROUNDS WARMUP\n");
        return 2;
    }
    ms = calloc(rounds + warmup, sizeof(*ms));
    t.numel = (size_t)n;
    if (!ms || (rc = cohort_create(&cfg, &c)) < 0 || (rc = cohort_use_gpu(c, uuid)) < 0 ||
        (rc = cohort_connect(c, NULL)) < 0 || (rc = cohort_set_virtual_batch_size(c, 2)) < 0) {
        fprintf(stderr, "gpu_trainer: %s\n", ms ? cohort_strerror(rc) : "out of memory");
        return 1;
    }
    while (done < rounds + warmup) {
        if ((rc = cohort_wait(c, 1000)) < 0 && rc != -ETIMEDOUT)
            break;
        if ((rc = cohort_update(c)) < 0)
            break;
        if (cohort_wants_state(c) && (rc = cohort_set_state(c, "s", 1)) < 0)
            break;
        if (pending && cohort_has_gradients(c)) {
            ms[done++] = now_ms() - t0;
            pending = 0;
            if ((rc = cohort_zero_gradients(c)) < 0)
                break;
            continue;
        }
        if (!pending && cohort_wants_gradients(c) && cohort_size(c) == 2) {
            t0 = now_ms();
            if ((rc = cohort_reduce_gradients(c, 1)) < 0)
                break;
            pending = 1;
        }
    }
    if (done < rounds + warmup) {
        fprintf(stderr, "gpu_trainer: %s\n", cohort_strerror(rc));
        return 1;
    }
    qsort(ms + warmup, rounds, sizeof(*ms), cmp);
    printf("{\"impl\":\"cohort-host-staged\",\"bytes\":%llu,\"rounds\":%llu,"
           "\"median_ms\":%.3f,\"best_ms\":%.3f}\n",
           n * 4, rounds, ms[warmup + rounds / 2], ms[warmup]);
    cohort_destroy(c);
    free(ms);
    return 0;
}

/* bench/dtype_kernels.c: the reduction kernels (src/engine/dtype.c), each
 * variant this CPU supports side by side in one run: GB/s of buffer
 * processed (bytes of dst per second, 10^9) for the kernels a ring step
 * runs. Buffers of --bytes (default 32 MiB, past the caches, as in a big
 * all-reduce) and of 256 KiB (one ring segment, in cache). Medians of
 * --reps runs (default 9), each variant run in turn inside a repetition.
 *
 * Two rows more at the large size take a ring's shape: the buffer walked
 * one 256 KiB segment at a time, each combined with the same 256 KiB
 * staging slot (in cache, as a received segment is), in place
 * (ring_inplace: the engine's own buffer) and out of place (ring_into:
 * the Accumulator's gradients into its results). Out of place writes
 * lines it has not read, which a write-allocate cache reads first, so
 * past the caches it moves one more buffer's bytes than in place.
 *
 *   cc -O2 -Isrc -Iinclude bench/dtype_kernels.c build/lib/libcohort-core.a -lm
 *   nice ./a.out [--bytes N] [--reps K]
 *
 * One JSON object per line: kernel, dtype, op, bytes, variant, gbs, ms,
 * and same_bytes: whether the variant's last output equals the baseline's
 * byte for byte (this is the release build's vectorised code, which the
 * sanitized unit test, tests/unit/test_dtype.c, does not vectorise). Exits
 * 1 when any differs. */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/dtype.h"

#define MAX_REPS 99

static double now_s(void)
{
    struct timespec t;

    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;

    return (x > y) - (x < y);
}

enum kernel { K_COMBINE, K_COMBINE_INTO, K_SCALE, K_RING_INPLACE, K_RING_INTO, K_COUNT };
static const char *const kernel_names[K_COUNT] = { "combine", "combine_into", "scale",
                                                   "ring_inplace", "ring_into" };

#define RING_SEG ((size_t)256 << 10)

/* One pass in a ring's shape over n elements of t: segment by segment,
 * each with the one slot b of RING_SEG bytes (see the top). */
static void ring_pass(enum kernel k, enum dtype t, enum dtype_op op, uint8_t *d,
                      const uint8_t *a, const uint8_t *b, size_t n)
{
    size_t seg = RING_SEG / dtype_size(t), esz = dtype_size(t);

    for (size_t o = 0; o < n; o += seg) {
        size_t m = n - o < seg ? n - o : seg;

        if (k == K_RING_INPLACE)
            dtype_combine(t, op, d + o * esz, b, m);
        else
            dtype_combine_into(t, op, d + o * esz, a + o * esz, b, m);
    }
}

/* Seconds for one pass of kernel k over n elements of t. */
static double run_once(enum kernel k, enum dtype t, enum dtype_op op, void *d, void *a,
                       void *b, size_t n, size_t passes)
{
    double t0 = now_s();

    for (size_t p = 0; p < passes; p++) {
        switch (k) {
        case K_COMBINE: dtype_combine(t, op, d, b, n); break;
        case K_COMBINE_INTO: dtype_combine_into(t, op, d, a, b, n); break;
        case K_RING_INPLACE:
        case K_RING_INTO: ring_pass(k, t, op, d, a, b, n); break;
        /* By 3, then by 1/3: the values stay normal (subnormals would
         * time the FPU's slow path, not the kernel). */
        default: dtype_scale(t, d, n, p % 2 ? 1.0 / 3.0 : 3.0); break;
        }
    }
    return (now_s() - t0) / (double)passes;
}

int main(int argc, char **argv)
{
    size_t big = (size_t)32 << 20, reps = 9;
    size_t sizes[2];
    const enum dtype types[] = { DTYPE_F32, DTYPE_F64 };
    bool failed = false;

    for (int i = 1; i + 1 < argc; i += 2) {
        if (strcmp(argv[i], "--bytes") == 0)
            big = strtoull(argv[i + 1], NULL, 10);
        else if (strcmp(argv[i], "--reps") == 0)
            reps = strtoull(argv[i + 1], NULL, 10);
    }
    if (reps < 1 || reps > MAX_REPS || big < 4096) {
        fprintf(stderr, "usage: dtype_kernels [--bytes N>=4096] [--reps 1..%d]\n", MAX_REPS);
        return 2;
    }
    sizes[0] = (size_t)256 << 10;
    sizes[1] = big;
    for (size_t si = 0; si < 2; si++) {
        size_t bytes = sizes[si], passes = ((size_t)256 << 20) / bytes;
        uint8_t *d = malloc(bytes), *a = malloc(bytes), *b = malloc(bytes);

        if (!d || !a || !b)
            return 1;
        for (size_t i = 0; i < bytes / 4; i++) {
            ((float *)a)[i] = (float)(i % 1000) * 0.25f;
            ((float *)b)[i] = (float)(i % 777) * 0.5f;
        }
        memcpy(d, a, bytes);
        for (size_t ti = 0; ti < 2; ti++)
            for (int k = 0; k < K_COUNT; k++) {
                enum dtype t = types[ti];

                if ((k == K_RING_INPLACE || k == K_RING_INTO) && (si == 0 || bytes < RING_SEG))
                    continue;       /* a ring's shape needs more than one segment */
                size_t n = bytes / dtype_size(t);
                double ts[8][MAX_REPS];
                bool same[8];
                uint8_t *want = malloc(bytes);
                size_t nv = dtype_kernels_count();

                for (size_t r = 0; r < reps; r++)
                    for (size_t v = 0; v < nv && v < 8; v++) {
                        if (dtype_kernels_use(v) < 0)
                            continue;
                        memcpy(d, a, bytes);
                        ts[v][r] = run_once((enum kernel)k, t, DTYPE_SUM, d, a, b, n, passes);
                        if (v == 0)
                            memcpy(want, d, bytes);
                        same[v] = memcmp(want, d, bytes) == 0;
                        failed |= !same[v];
                    }
                for (size_t v = 0; v < nv && v < 8; v++) {
                    double m;
                    if (!dtype_kernels_supported(v))
                        continue;
                    qsort(ts[v], reps, sizeof(double), cmp_double);
                    m = ts[v][reps / 2];
                    printf("{\"kernel\":\"%s\",\"dtype\":\"%s\",\"op\":\"sum\",\"bytes\":%zu,"
                           "\"variant\":\"%s\",\"gbs\":%.2f,\"ms\":%.4f,\"same_bytes\":%s}\n",
                           kernel_names[k], dtype_name(t), bytes, dtype_kernels_name(v),
                           (double)bytes / m / 1e9, m * 1e3, same[v] ? "true" : "false");
                }
                free(want);
            }
        free(d);
        free(a);
        free(b);
    }
    return failed ? 1 : 0;
}

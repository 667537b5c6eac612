/* bench/codec_kernels.c: the wire codecs (src/engine/codec.c), each kernel
 * variant this CPU supports side by side in one run: GB/s of float32
 * encoded or decoded (10^9 bytes of float32 per second) on one ring
 * segment (256 KiB of float32, in cache) and on --bytes (default 32 MiB,
 * past the caches). Medians of --reps runs (default 9).
 *
 *   cc -O2 -Isrc -Iinclude bench/codec_kernels.c build/lib/libcohort-core.a -lm
 *   nice ./a.out [--bytes N] [--reps K]
 *
 * One JSON object per line: codec, kernel (encode, decode), bytes,
 * variant, gbs, ms, and same_bytes: whether the variant's output equals
 * the baseline's byte for byte (the release build's vectorised code,
 * which the sanitized unit test, tests/unit/test_codec.c, does not
 * vectorise). The inputs include NaN and Inf. Exits 1 when any differs. */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/codec.h"

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

int main(int argc, char **argv)
{
    size_t big = (size_t)32 << 20, reps = 9, sizes[2];
    bool failed = false;

    for (int i = 1; i + 1 < argc; i += 2) {
        if (strcmp(argv[i], "--bytes") == 0)
            big = strtoull(argv[i + 1], NULL, 10);
        else if (strcmp(argv[i], "--reps") == 0)
            reps = strtoull(argv[i + 1], NULL, 10);
    }
    if (reps < 1 || reps > MAX_REPS || big < 4096) {
        fprintf(stderr, "usage: codec_kernels [--bytes N>=4096] [--reps 1..%d]\n", MAX_REPS);
        return 2;
    }
    sizes[0] = (size_t)256 << 10;
    sizes[1] = big;
    for (size_t si = 0; si < 2; si++) {
        size_t bytes = sizes[si], n = bytes / 4, passes = ((size_t)256 << 20) / bytes;
        float *x = malloc(bytes), *back = malloc(bytes), *want_back = malloc(bytes);
        uint8_t *w = malloc(bytes + 4096), *want = malloc(bytes + 4096);

        if (!x || !back || !want_back || !w || !want)
            return 1;
        for (size_t i = 0; i < n; i++)
            x[i] = sinf((float)i * 0.01f) * (float)(1 + i % 300);
        x[n / 3] = NAN;
        x[n / 2] = INFINITY;
        for (int c = 1; c < CODEC_COUNT; c++) {
            size_t wb = codec_bytes((enum codec)c, n), nv = dtype_kernels_count();
            double ts[2][8][MAX_REPS];
            bool same[2][8];

            for (size_t r = 0; r < reps; r++)
                for (size_t v = 0; v < nv && v < 8; v++) {
                    double t0;

                    if (dtype_kernels_use(v) < 0)
                        continue;
                    t0 = now_s();
                    for (size_t p = 0; p < passes; p++)
                        codec_encode((enum codec)c, w, x, n);
                    ts[0][v][r] = (now_s() - t0) / (double)passes;
                    t0 = now_s();
                    for (size_t p = 0; p < passes; p++)
                        codec_decode((enum codec)c, back, w, n);
                    ts[1][v][r] = (now_s() - t0) / (double)passes;
                    if (v == 0) {
                        memcpy(want, w, wb);
                        memcpy(want_back, back, bytes);
                    }
                    same[0][v] = memcmp(want, w, wb) == 0;
                    same[1][v] = memcmp(want_back, back, bytes) == 0;
                    failed |= !same[0][v] || !same[1][v];
                }
            for (int k = 0; k < 2; k++)
                for (size_t v = 0; v < nv && v < 8; v++) {
                    double m;

                    if (!dtype_kernels_supported(v))
                        continue;
                    qsort(ts[k][v], reps, sizeof(double), cmp_double);
                    m = ts[k][v][reps / 2];
                    printf("{\"codec\":\"%s\",\"kernel\":\"%s\",\"bytes\":%zu,\"variant\":\"%s\","
                           "\"gbs\":%.2f,\"ms\":%.4f,\"same_bytes\":%s}\n",
                           codec_name((enum codec)c), k ? "decode" : "encode", bytes,
                           dtype_kernels_name(v), (double)bytes / m / 1e9, m * 1e3,
                           same[k][v] ? "true" : "false");
                }
        }
        free(x);
        free(back);
        free(want_back);
        free(w);
        free(want);
    }
    return failed ? 1 : 0;
}

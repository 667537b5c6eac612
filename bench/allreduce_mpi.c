/* bench/allreduce_mpi.c: Open MPI's MPI_Allreduce (in place, MPI_SUM) timed
 * the way `cohortctl bench allreduce` times cohort, for bench/allreduce.sh.
 * Prints one JSON object per size, as cohortctl does:
 * {"peers","bytes","time_ms","algbw_gbs","busbw_gbs"}; time_ms is the mean
 * per all-reduce of the slowest rank.
 *
 *   mpicc -O2 -o build/bench/allreduce_mpi bench/allreduce_mpi.c
 *   mpirun -np N build/bench/allreduce_mpi [--dtype f32|f64|i32|i64] [--iters K] BYTES...
 */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static unsigned long long parse_size(const char *s)
{
    char *end;
    unsigned long long v = strtoull(s, &end, 10), mul = 1;

    switch (*end) {
    case 'K': case 'k': mul = 1ull << 10; break;
    case 'M': case 'm': mul = 1ull << 20; break;
    case 'G': case 'g': mul = 1ull << 30; break;
    default: break;
    }
    return v * mul;
}

int main(int argc, char **argv)
{
    MPI_Datatype type = MPI_FLOAT;
    size_t esz = 4;
    unsigned long long iters = 0, sizes[64];
    int n_sizes = 0, rank, peers;

    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &peers);
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--iters") == 0 && i + 1 < argc) {
            iters = strtoull(argv[++i], NULL, 10);
        } else if (strcmp(argv[i], "--dtype") == 0 && i + 1 < argc) {
            const char *t = argv[++i];
            if (strcmp(t, "f64") == 0) { type = MPI_DOUBLE; esz = 8; }
            else if (strcmp(t, "i32") == 0) { type = MPI_INT32_T; esz = 4; }
            else if (strcmp(t, "i64") == 0) { type = MPI_INT64_T; esz = 8; }
            else if (strcmp(t, "f32") != 0) {
                /* MPI has no standard 16-bit float type. */
                if (rank == 0)
                    fprintf(stderr, "allreduce_mpi: no MPI type for %s\n", t);
                MPI_Finalize();
                return 2;
            }
        } else if (n_sizes < 64) {
            sizes[n_sizes++] = parse_size(argv[i]);
        }
    }
    for (int s = 0; s < n_sizes; s++) {
        unsigned long long bytes = sizes[s], count = bytes / esz;
        unsigned long long k = iters ? iters : (1ull << 30) / bytes;
        unsigned long long w;
        char *buf = malloc(bytes);
        double t0, mine, worst;

        if (!iters)
            k = k < 10 ? 10 : k > 1000 ? 1000 : k;
        w = k / 10 < 2 ? 2 : k / 10;
        memset(buf, 0, bytes);
        for (unsigned long long i = 0; i < w; i++)
            MPI_Allreduce(MPI_IN_PLACE, buf, (int)count, type, MPI_SUM, MPI_COMM_WORLD);
        MPI_Barrier(MPI_COMM_WORLD);
        t0 = MPI_Wtime();
        for (unsigned long long i = 0; i < k; i++)
            MPI_Allreduce(MPI_IN_PLACE, buf, (int)count, type, MPI_SUM, MPI_COMM_WORLD);
        mine = (MPI_Wtime() - t0) * 1000.0 / (double)k;
        MPI_Reduce(&mine, &worst, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
        if (rank == 0) {
            double algbw = (double)(count * esz) / (worst / 1000.0) / 1e9;
            printf("{\"peers\":%d,\"bytes\":%llu,\"time_ms\":%.4f,\"algbw_gbs\":%.4f,"
                   "\"busbw_gbs\":%.4f}\n", peers, count * esz, worst, algbw,
                   algbw * 2.0 * (peers - 1) / peers);
            fflush(stdout);
        }
        free(buf);
    }
    MPI_Finalize();
    return 0;
}

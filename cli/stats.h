/* cli/stats.h: the figures the benchmark subcommands (bench_accumulator.c,
 * bench_checkpoint.c) report over their repetitions. */
#ifndef COHORT_CLI_STATS_H
#define COHORT_CLI_STATS_H

/* The median of v[0..n), n > 0: the middle value, or the mean of the two
 * middle ones. Sorts v in place. */
double stats_median(double *v, int n);

#endif

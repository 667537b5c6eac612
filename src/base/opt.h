/* src/base/opt.h: the command line, shared by the binaries so that a
 * duration or a count means the same everywhere and a usage error reads
 * the same everywhere. Every value parser refuses trailing junk, signs and
 * overflow. Usage errors go to stderr as "PROG: what is wrong" and
 * "Try 'PROG --help'.", and the process exits with OPT_EXIT_USAGE. */
#ifndef COHORT_OPT_H
#define COHORT_OPT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* "250ms", "1s", "1.5s", "2m", "1h". Returns 0 and sets *ms, or -EINVAL
 * (no unit, junk, negative) or -ERANGE (above max_ms). */
int opt_duration_ms(const char *s, uint64_t max_ms, uint64_t *ms);

/* A decimal unsigned integer in [min, max]. Returns 0, -EINVAL, -ERANGE. */
int opt_uint(const char *s, uint64_t min, uint64_t max, uint64_t *out);

/* A byte count: "4096", "64K", "1M", "2G" (powers of 1024; k m g too, and
 * "KiB" or "KB" spelled out). Returns 0, -EINVAL (zero, junk, no digits)
 * or -ERANGE (above max). */
int opt_bytes(const char *s, uint64_t max, uint64_t *out);

/* A comma-separated list of opt_bytes values, appended to out[*n..cap).
 * *n grows only on success; on an error (-EINVAL, -ERANGE, or -E2BIG when
 * the list does not fit) the slots past it may have been written. */
int opt_bytes_list(const char *s, uint64_t max, uint64_t *out, size_t cap, size_t *n);

/* Applies --log-format and --log-level values (either may be NULL).
 * Returns 0, or -EINVAL after reporting which value is wrong as a usage
 * error (opt_usage). */
int opt_logging(const char *prog, const char *format, const char *level);

/* ---- usage errors ------------------------------------------------------ */

/* The exit status of a usage error, for every binary and subcommand. */
#define OPT_EXIT_USAGE 2

struct option;

/* Reports a usage error: "PROG: MESSAGE" and "Try 'PROG --help'." on
 * stderr, where `prog` is the command as typed ("cohortctl run").
 * Returns OPT_EXIT_USAGE, so that a parser can `return opt_usage(...)`. */
int opt_usage(const char *prog, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* getopt_long() on behalf of `prog`: its own complaints (an unknown
 * option, a missing or unwanted value) start with `prog` rather than
 * argv[0], which is a path for a binary and a bare name for a subcommand,
 * and are followed by the Try line. Returns what getopt_long returns; '?'
 * means the error has been reported and the caller should return
 * OPT_EXIT_USAGE. `shortopts` may start with '+' but not ':', which would
 * silence getopt's half of the report. argv[0] is restored before it
 * returns. */
int opt_next(const char *prog, int argc, char **argv, const char *shortopts,
             const struct option *longopts);

/* For commands that take no operands: returns 0 when argv[first..argc) is
 * empty, else reports the first one as unexpected and returns
 * OPT_EXIT_USAGE. Call it with getopt's optind. */
int opt_no_operands(const char *prog, int argc, char *const argv[], int first);

/* The value of -o/--output, which every command that prints a report
 * takes: "table" or "json". Returns 0 and sets *json, or reports a usage
 * error and returns OPT_EXIT_USAGE. */
int opt_output(const char *prog, const char *output, bool *json);

#endif

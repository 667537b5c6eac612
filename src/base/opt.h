/* src/base/opt.h: parsing of command-line values, shared by the three binaries
 * so that a duration or a count means the same everywhere. Every parser
 * refuses trailing junk, signs and overflow. */
#ifndef COHORT_OPT_H
#define COHORT_OPT_H

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
 * Returns 0, or -EINVAL after printing which value is wrong to stderr. */
int opt_logging(const char *prog, const char *format, const char *level);

#endif

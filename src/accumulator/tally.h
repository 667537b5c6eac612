/* src/accumulator/tally.h: exact 64-bit counters carried through an all-reduce SUM of
 * gradient-typed elements.
 *
 * The node folds a round's counters (batch, contributions, skips, virtual
 * batch size) into the gradient all-reduce of small buffers, so that a
 * round costs one all-reduce instead of two. Floats add integers exactly
 * only below 2^(mantissa bits + 1), so each counter is split into digits
 * small enough that one digit summed over every member stays below that:
 * with m members, digits of E - bits(m) bits, E being 24 for float32, 53
 * for float64 and 32 for int32 (read back unsigned). int64 sums wrap
 * modulo 2^64 like the counters themselves, so one element per counter.
 * The decoded sums are the counters' exact sums modulo 2^64, the same on
 * every member whatever order the engine adds in. */
#ifndef COHORT_TALLY_H
#define COHORT_TALLY_H

#include <stddef.h>
#include <stdint.h>

#include "engine/dtype.h"

/* Elements needed per counter, at most 64 (one-bit digits). */
#define TALLY_DIGITS_MAX 64

/* Elements of type `t` that carry one counter summed over `members`; 0
 * when `t` cannot carry it exactly (16-bit floats; members == 0; more
 * members than the type's exact range allows). */
size_t tally_digits(enum dtype t, uint32_t members);

/* Writes `k` counters as k * tally_digits(t, members) elements at `out`.
 * `t` and `members` must have tally_digits() > 0. */
void tally_encode(enum dtype t, uint32_t members, const uint64_t *v, size_t k, void *out);

/* Reads `k` counters back from the element-wise sum at `in`. */
void tally_decode(enum dtype t, uint32_t members, const void *in, uint64_t *v, size_t k);

#endif

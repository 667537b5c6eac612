/* src/engine/doubling.h: recursive doubling, the engine's algorithm for
 * small buffers: log2(p) exchanges of the whole buffer, where the ring
 * would take 2(n-1) steps. allreduce.c chooses between it and the ring. */
#ifndef COHORT_DOUBLING_H
#define COHORT_DOUBLING_H

#include <stddef.h>

struct run;

/* Writes into need[] the members that member `me` of `n` (n >= 2)
 * exchanges with. Returns how many: at most 1 + log2(n). */
size_t doubling_needs(size_t n, size_t me, size_t *need);

/* All-reduces x's buffer in place (x->src must be x->buf, and at most
 * small_bytes on the wire) over the connections to doubling_needs' peers,
 * which must be in the table. Returns 0, or the first error of a
 * connection (see conn.h) or -ESTALE. */
int doubling_run(struct run *x);

#endif

/* src/engine/ring.h: the ring all-reduce, for large buffers: reduce-scatter
 * then all-gather around the members in epoch order, pipelined in
 * segments. One of the engine's algorithms; allreduce.c chooses among
 * them. */
#ifndef COHORT_RING_H
#define COHORT_RING_H

#include <stdbool.h>
#include <stddef.h>

struct run;

/* Writes into need[] the members that member `me` of `n` (n >= 2) talks
 * to: its right neighbour, and its left one when that is another member.
 * Returns how many (at most 2). */
size_t ring_needs(size_t n, size_t me, size_t *need);

/* All-reduces x's buffer over the connections to ring_needs' peers, which
 * must be in the table. Returns 0, or the first error of a connection
 * (see conn.h), -ESTALE, or -EIO if the schedule ever stalled. */
int ring_run(struct run *x);

/* Out of place (`into`), a call of plain elements (not 16-bit, not
 * coded) from this many bytes up keeps its sums in the staging slots and
 * streams only final ones into the results (ring.c, "Staged sums"): twice
 * the last-level cache share of a core on the 2-core development VM, so
 * that a member's contribution and results no longer fit in it. */
#define RING_STAGED_MIN_BYTES ((size_t)8 << 20)

/* Whether a call of plain elements of `bytes`, out of place or not, is
 * staged: from RING_STAGED_MIN_BYTES up, where the CPU has streaming
 * stores (dtype_copy_streams). */
bool ring_staged(bool into, size_t bytes);

/* The segments each chunk of a ring all-reduce of `count` elements among
 * n members (n >= 2) is cut into, summed over chunks and windows, with
 * `seg` elements a segment and plain (not 16-bit, not coded) elements,
 * staged (ring_staged: shorter windows) or not, a short tail folded in as
 * ring_run does: what one member sends per step, summed. Equal for two
 * counts, a call makes as many exchanges with either. */
size_t ring_segments(size_t n, size_t count, size_t seg, bool staged);

/* The bytes a staging slot needs for a ring of segment_bytes segments:
 * a segment with a folded tail (ring.c, "Folding a tail") is up to
 * 1/64 longer. A multiple of 8. */
size_t ring_slot_bytes(size_t seg_bytes);

/* How the ring cuts a length (windows, a window's chunks, a chunk's
 * segments, before any tail is folded): ring_parts(len, most) parts, as
 * few as hold len in parts of at most most (> 0), part c of n starting
 * at ring_part_start(len, n, c) (c = n gives len), lengths differing by
 * one at most. */
size_t ring_parts(size_t len, size_t most);
size_t ring_part_start(size_t total, size_t n, size_t c);

#endif

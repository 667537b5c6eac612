/* src/engine/butterfly.h: the butterfly all-reduce (hivemind's): the
 * buffer is cut into one contiguous part per member, of the lengths the
 * call gives (zero for a member that reduces nothing), every member sends
 * part j of its contribution to member j, member j reduces part j and
 * sends the result back to every member. allreduce.c dispatches to it for
 * allreduce_run_parts; it shares the engine's connections, frames, checks,
 * timeouts and aborts (conn.c). */
#ifndef COHORT_BUTTERFLY_H
#define COHORT_BUTTERFLY_H

#include <stddef.h>

struct run;

/* The members that member x->me talks to (into need[], MAX_NEED): every
 * other member when it owns a part, else those that own one. Two members
 * without a part never connect. */
size_t butterfly_needs(const struct run *x, size_t *need);

/* The call x (x->parts set, summing to x->count; not 16-bit; coded or not).
 * Returns 0 or allreduce_run's codes. */
int butterfly_run(struct run *x);

#endif

/* src/engine/acceptor.h: the engine's acceptor thread. It accepts every
 * connection on the engine's listening socket, reads and judges the
 * greeting, answers it, and hands the connections of members of the
 * current epoch to the next run through the inbox (struct allreduce in
 * allreduce_impl.h, under mu; inbox_fd wakes the run). It runs from
 * allreduce_create to allreduce_destroy, whether or not a call is in
 * flight, so a peer that greets first is never kept waiting on us. */
#ifndef COHORT_ACCEPTOR_H
#define COHORT_ACCEPTOR_H

struct allreduce;

/* Starts the thread on a's listening socket; a is borrowed until
 * acceptor_stop. Greetings are held for our own epoch when they come from
 * a newer one: write a->wake_fd after adopting an epoch so that they are
 * judged again. Returns 0 or pthread_create's -errno. */
int acceptor_start(struct allreduce *a);

/* Stops the thread and waits for it; closes the connections still
 * greeting. What it left in the inbox stays there, the caller's. */
void acceptor_stop(struct allreduce *a);

#endif

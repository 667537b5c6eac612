/* src/engine/conn.h: the engine's connections to its peers, as a running
 * call uses them: the non-blocking pumps that move one frame each way,
 * the header checks that keep a call's frames in step, waiting with a
 * silence clock and the abort eventfd, and dialling the peers a call
 * needs. The engine's private structures are in allreduce_impl.h; the
 * other side of connecting, accepting and greeting, is acceptor.c. */
#ifndef COHORT_CONN_H
#define COHORT_CONN_H

#include <poll.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/peerwire.h"

struct allreduce;
struct conn;
struct run;

/* Sets what every data-plane socket wants, accepted or dialled. */
void conn_tune_socket(int fd);

/* The data frame header of the call x for one unit: what a sender puts on
 * the wire and what a receiver expects, field for field. */
struct peerwire_frame conn_frame(const struct run *x, uint8_t phase, uint32_t step,
                                 size_t offset, size_t bytes);

/* Puts frame f with f->length bytes at payload (borrowed until the frame
 * is sent) in flight on c; conn_tx_pump sends it. Sealed, its tag is
 * computed here, once: the payload must not change until it is sent. */
void conn_tx_start(struct conn *c, const struct peerwire_frame *f, const void *payload);

/* Expects frame `want` on c, its payload to land at dst (borrowed until
 * received). A `want` with magic 0 expects control frames only: any data
 * frame is then a protocol error. conn_rx_pump receives it. */
void conn_rx_start(struct conn *c, const struct peerwire_frame *want, void *dst);

/* Sends more of the frame in flight. Returns 1 when bytes moved, 0 when
 * the socket is full, -EPIPE or -ECONNRESET. */
int conn_tx_pump(struct conn *c);

/* Receives more of the frame expected on c: the header, checked against
 * the expected one as soon as it is whole, then the payload straight into
 * its destination, never more than the expected length. Sealed, the frame
 * is done only once its tag verifies. Returns 1 when bytes moved, 0 when
 * none were there, -ECONNRESET, -EPROTO (a frame the schedule did not call
 * for, or whose tag does not verify), or a BYE's error. */
int conn_rx_pump(struct run *x, struct conn *c);

/* After a failed send on c: the peer may have said why before closing.
 * Returns the error its BYE carries, or `err`. */
int conn_refine(struct run *x, struct conn *c, int err);

/* Closes the reachability probes of the call that ends (conn.c,
 * "REACHABILITY"). */
void conn_probes_close(struct allreduce *a);

/* Waits in poll until a descriptor in pfd[1..n) is ready. pfd[0] must be
 * the abort eventfd. Returns 0, -ESTALE or -ETIMEDOUT (at `deadline`). */
int conn_wait(struct run *x, struct pollfd *pfd, nfds_t n, uint64_t deadline);

/* True while the current spell without progress is younger than SPIN_US
 * (having yielded the core once); false when it is time to sleep in
 * conn_wait, and the next spell then starts afresh. *from is 0 when none
 * runs. */
bool conn_spin(uint64_t *from);

/* Restarts c's silence clocks for the directions that moved since the
 * last call. */
void conn_since_update(struct conn *c, uint64_t now);

/* The latest moment the active directions of c may stay silent until;
 * ctl_rx: c's receive side only listens for control frames, which may
 * stay away forever. */
uint64_t conn_silence_deadline(const struct run *x, const struct conn *c, bool ctl_rx);

/* Makes sure the connection table holds a connection to every peer in
 * need[]: dials those after us in the member order, takes the others from
 * the acceptor's inbox as they dial us (a live connection is replaced
 * only by one from a newer incarnation: acceptor.c). Returns 0, -ESTALE,
 * -ETIMEDOUT, -ECONNRESET, -EPROTO (a peer's answer does not fit), -EACCES
 * (a peer refused our greeting or did not prove the key), -EINVAL (an
 * address that cannot be dialled) or -ENOMEM; x->fail_peer names the peer
 * when one is to blame. The connections stay in the table after a
 * failure. */
int conn_connect_peers(struct run *x, const size_t *need, size_t n_need);

/* Closes every connection of a's table, sending each peer a BYE with
 * `err` and `epoch` (the newest this engine knows) after finishing a
 * half-sent frame if that takes no longer than `deadline`. Called with mu
 * held, or by the thread that owns the table (the running call). */
void conn_close_all(struct allreduce *a, int err, uint64_t epoch, uint64_t deadline);

#endif

/* src/accumulator/trainerd.h: the sidecar's service to its trainer. Listens on a Unix
 * socket, serves one trainer at a time over tlink, maps the trainer's
 * shared memory, and runs a node (node.h) for it: the member joins the
 * cohort once the trainer has registered its tensors, and leaves when the
 * trainer goes away. A second trainer is refused (-EBUSY) while one is
 * served.
 */
#ifndef COHORT_TRAINERD_H
#define COHORT_TRAINERD_H

#include "accumulator/node.h"

struct trainerd;

struct trainerd_config {
    const char *socket_path;    /* copied; a stale socket file is replaced */
    struct node_config node;    /* the node to run per trainer; strings copied */
};

/* Binds the socket and starts serving on a thread. Needs rpc_init().
 * Returns 0, -EINVAL, -EADDRINUSE (a live sidecar answers there),
 * -ENAMETOOLONG, -ENOMEM, or a socket -errno. The caller stops it with
 * trainerd_stop(). */
int trainerd_start(const struct trainerd_config *cfg, struct trainerd **out);
/* Stops serving (the current trainer's member leaves) and removes the
 * socket file. NULL is fine. */
void trainerd_stop(struct trainerd *t);

/* Trainers served so far (for tests). */
unsigned trainerd_sessions(struct trainerd *t);

#endif

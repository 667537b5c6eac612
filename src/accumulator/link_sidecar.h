/* src/accumulator/link_sidecar.h: the Accumulator's link to a cohort-sidecar
 * over the trainer link (tlink.h). See link.h. */
#ifndef COHORT_LINK_SIDECAR_H
#define COHORT_LINK_SIDECAR_H

#include "accumulator/link.h"

/* Connects to the sidecar's Unix socket at `path`, says HELLO and hands it
 * the memfd (REGISTER). `m` is borrowed for the link's lifetime. Returns 0
 * and sets *out (freed by its destroy op), -ENAMETOOLONG, the connect's
 * -errno (-ENOENT: no sidecar there), -EPROTO (another protocol version),
 * or the sidecar's refusal (-EBUSY: it serves another trainer). */
int link_sidecar_connect(const char *path, const struct link_memory *m, struct link **out);

#endif

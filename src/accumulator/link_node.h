/* src/accumulator/link_node.h: the Accumulator's link to a node in the
 * trainer's own process (node.h), joined to a broker directly. See link.h. */
#ifndef COHORT_LINK_NODE_H
#define COHORT_LINK_NODE_H

#include "accumulator/link.h"

struct secret;

/* Starts the rpc module and a node that joins cohort `cohort` as `id`
 * through the broker at `broker`, advertising a data address on `host`,
 * proving itself with `key` (NULL: no proof), with a MAC on every
 * data-plane frame under `integrity_mac` (needs key), over TLS when `tls_ca_pem`
 * is given (tls_server_name: the broker certificate's name, NULL: the
 * broker's host) (all copied), and registers the tensors of `m` (borrowed
 * for the link's lifetime). Returns 0 and sets *out (freed by its destroy
 * op), -EINVAL, -ENOMEM, or what node_start/node_register return. */
int link_node_connect(const char *broker, const char *cohort, const char *id, const char *host,
                      const struct secret *key, bool integrity_mac, const char *tls_ca_pem,
                      const char *tls_server_name,
                      const struct link_memory *m, struct link **out);

#endif

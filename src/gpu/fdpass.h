/* src/gpu/fdpass.h: file descriptors over a Unix socket (SCM_RIGHTS), with
 * a small message beside them. A device region's export is a file
 * descriptor; it reaches the sidecar this way, which works across PID
 * namespaces where a legacy CUDA IPC handle does not.
 *
 * The receiving side trusts nothing: at most FDPASS_MAX fds in one
 * message, a truncated message or control message is refused, and every
 * descriptor the kernel installed is closed on every error path, so a
 * peer cannot leak descriptors into the receiver by sending too many.
 */
#ifndef COHORT_FDPASS_H
#define COHORT_FDPASS_H

#include <stddef.h>

#define FDPASS_MAX 8

/* Sends `len` bytes (at least 1) of `msg` and `nfds` descriptors
 * (borrowed; 0..FDPASS_MAX) in one message. Returns 0, -EINVAL, -EPIPE
 * when the peer is gone, or another -errno. */
int fdpass_send(int sock, const void *msg, size_t len, const int *fds, int nfds);

/* Receives one message of exactly `len` bytes with up to `max_fds`
 * descriptors (at most FDPASS_MAX), which land in fds[] with their count
 * in *nfds; the caller owns and closes them. Waits up to timeout_ms (-1:
 * forever). Returns 0; -ETIMEDOUT; -EPIPE when the peer closed; -EPROTO
 * for a message of another size, a truncated message or control message,
 * more than max_fds descriptors, or ancillary data of another kind. On
 * any error no descriptor is left open and *nfds is 0. */
int fdpass_recv(int sock, void *msg, size_t len, int *fds, int max_fds, int *nfds,
                int timeout_ms);
#endif

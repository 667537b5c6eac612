/* src/accumulator/trainerd.h: the sidecar's service to its trainer. Listens on a Unix
 * socket, serves one trainer at a time over tlink, maps the trainer's
 * shared memory, and runs a node (node.h) for it: the member joins the
 * cohort once the trainer has registered its tensors, and leaves when the
 * trainer goes away. A second trainer is refused (-EBUSY) while one is
 * served.
 */
#ifndef COHORT_TRAINERD_H
#define COHORT_TRAINERD_H

#include <stdint.h>

#include "accumulator/node.h"

struct trainerd;

struct trainerd_config {
    const char *socket_path;    /* copied; a stale socket file is replaced */
    struct node_config node;    /* the node to run per trainer; strings copied */
    /* A GPU registration is always reduced host-staged, never with NCCL
     * (docs/gpu.md): for clusters without NCCL connectivity. */
    bool gpu_host_staged;
    /* Connections of another kind on the same socket (one socket per
     * pod): a connection whose first message has a type in [adopt_first,
     * adopt_last] is handed, unread, to adopt(adopt_arg, sock), which
     * owns it from then on (hivemind's averager link, averager/avserve.h).
     * Its first message must come within TLINK_HELLO_DEADLINE_MS. NULL:
     * none. The Accumulator's connections are served as before, byte for
     * byte. */
    int (*adopt)(void *arg, int sock);
    void *adopt_arg;
    uint16_t adopt_first, adopt_last;
};

/* Binds the socket and starts serving on a thread. Needs rpc_init().
 * Returns 0, -EINVAL, -EADDRINUSE (a live sidecar answers there),
 * -ENAMETOOLONG, -ENOMEM, or a socket -errno. The caller stops it with
 * trainerd_stop(). */
int trainerd_start(const struct trainerd_config *cfg, struct trainerd **out);
/* Stops serving (the current trainer's member leaves) and removes the
 * socket file. NULL is fine. */
void trainerd_stop(struct trainerd *t);

struct tlink_register;
/* The sidecar's check of a REGISTER layout against the size of the memfd
 * that came with it (region_size, from fstat once its seals are checked):
 * host memory or a GPU registration's memfd (TL_MEM_CUDA_VMM; its device
 * half is gpusess_check_layout's), a valid gradient type and a nonzero count, region_bytes
 * equal to region_size, every offset 64-byte aligned, every region inside
 * the memfd without wrapping around, the results apart from the gradients
 * and the view page (VIEWPAGE_BYTES) after every tensor. Returns 0,
 * -EOPNOTSUPP (another kind of memory) or -EINVAL. Pure, so that tests/fuzz can
 * call it. */
int trainerd_check_layout(const struct tlink_register *r, uint64_t region_size);

/* Whether GPU memory (r->mem not TL_MEM_HOST) can be served here: 0 when
 * the device r->cuda_uuid is present and the driver reaches it (served
 * host-staged, gpusess.h), else the refusal as the code the trainer gets:
 * -EOPNOTSUPP (no GPU support in this build, a legacy CUDA IPC handle, an
 * unknown kind), -ELIBACC (no CUDA driver), -ENXIO (no device with
 * r->cuda_uuid), -EIO (the driver failed). `why` gets a whole sentence
 * naming the cause (static). Logs a refusal with the device's UUID. */
int trainerd_check_gpu(const struct tlink_register *r, const char **why);

/* Trainers served so far (for tests). */
unsigned trainerd_sessions(struct trainerd *t);

/* Requests its trainers' doorbells brought to the node's thread so far,
 * rather than the socket (viewpage.h; for tests and the benchmark). */
uint64_t trainerd_bell_served(struct trainerd *t);

#endif

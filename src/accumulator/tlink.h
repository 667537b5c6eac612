/* src/accumulator/tlink.h: the wire between a trainer (libcohort, include/cohort.h) and
 * its sidecar: small fixed-size messages over a Unix SOCK_SEQPACKET socket,
 * which keeps message boundaries, with file descriptors passed alongside
 * (SCM_RIGHTS). Tensor bytes never cross it: the trainer's tensors live in
 * one memfd that both processes map, sent once with REGISTER; opaque state
 * travels in a memfd too. Every request gets exactly one REPLY carrying
 * 0 or -errno, except CONSUME, which gets none: the trainer has zeroed its
 * gradients itself and goes on at once, and the view it reads meanwhile
 * is corrected as tlink_view.wants_after_consume says.
 *
 * The registration names the kind of memory of each region, so that GPU
 * tensors can be registered in the same message. A sidecar serves GPU
 * memory host-staged (gpusess.h) where its build, driver and device
 * allow; otherwise the registration is refused with the cause as its code
 * (docs/gpu.md): -EOPNOTSUPP (no GPU support in this build, or a legacy
 * CUDA IPC handle), -ELIBACC (no CUDA driver), -ENXIO (no device with the
 * UUID the trainer named).
 */
#ifndef COHORT_TLINK_H
#define COHORT_TLINK_H

#include <stdbool.h>
#include <stddef.h>
#include <fcntl.h>
#include <stdint.h>

#define TLINK_MAGIC 0x31686f63u         /* "coh1" */
#define TLINK_VERSION 5u                /* 2: a results region; 3: CONSUME is one-way;
                                         * 4: the tensors memfd is sealed; 5: a GPU
                                         * region with REGISTER, SET_SHAPES */
#define TLINK_BODY_MAX 1024             /* no message body is larger */
#define TLINK_FDS_MAX 2
#define TLINK_NAME_MAX 64

enum tlink_type {
    TL_HELLO = 1,
    TL_REGISTER = 2,
    TL_VIEW = 3,
    TL_CONTRIBUTE = 4,
    TL_CONSUME = 5,         /* tlink_u64: the rounds_committed consumed; no reply */
    TL_SET_STATE = 6,       /* + memfd holding the state */
    TL_TAKE_STATE = 7,      /* reply + memfd */
    TL_SET_VERSION = 8,
    TL_SET_VBS = 9,
    TL_SET_PARALLEL = 10,
    TL_SET_COMPRESSION = 11,    /* tlink_u64: a compress_pack'd struct compress (the
                                 * codecs pack as their enum codec); a sidecar from before
                                 * it refuses the type (EPROTO) */
    TL_SET_SHAPES = 12,         /* tlink_u64: k, + memfd holding k struct layout_shape
                                 * (layout.h), k <= LAYOUT_SHAPES_MAX; a sidecar from
                                 * before it refuses the type (EPROTO) */
    TL_REPLY = 100,
};

struct tlink_hdr {
    uint32_t magic;
    uint16_t version;
    uint16_t type;
    uint32_t len;           /* body bytes after the header */
    int32_t status;         /* replies: 0 or -errno */
};

struct tlink_hello {
    uint32_t api_version;
    char name[TLINK_NAME_MAX];      /* accumulator name, NUL-terminated */
};

/* TL_MEM_CUDA_IPC: a legacy cudaIpcMemHandle_t, always refused (it fails
 * across the PID namespaces of a pod's containers). TL_MEM_CUDA_VMM: a
 * region of the driver's virtual-memory API on the device named by
 * cuda_uuid (never by index: CUDA_VISIBLE_DEVICES differs between
 * containers), whose file descriptor comes second with REGISTER, after
 * the memfd; the memfd is laid out as for host memory, and its gradient
 * and result areas are where the sidecar stages the device's bytes. */
enum tlink_mem { TL_MEM_HOST = 0, TL_MEM_CUDA_IPC = 1, TL_MEM_CUDA_VMM = 2 };

struct tlink_register {
    uint32_t mem;               /* enum tlink_mem */
    uint32_t grad_dtype;        /* enum dtype */
    uint64_t region_bytes;      /* size of the memfd */
    uint64_t params_off, params_bytes;
    uint64_t grads_off, grad_count;
    uint64_t results_off;       /* grad_count elements of the gradients' type */
    uint64_t shared_off;        /* VIEWPAGE_BYTES: the view page (viewpage.h) */
    uint64_t buffers_off, buffers_bytes;
    union {
        uint8_t cuda_handle[64];    /* TL_MEM_CUDA_IPC: cudaIpcMemHandle_t */
        struct {                    /* TL_MEM_CUDA_VMM (gpusess.h) */
            uint8_t cuda_uuid[16];          /* the device's UUID */
            uint64_t device_bytes;          /* the exported region's size */
            uint64_t device_grads_off;      /* grad_count elements: the trainer's gradients */
            uint64_t device_results_off;    /* grad_count elements: results land here */
        };
    };
    int32_t cuda_device;
    uint32_t pad;
};

/* What cohort_update() reads: node_view in fixed-width fields. */
struct tlink_view {
    uint8_t connected, wants_state, has_new_state, wants_gradients;
    uint8_t has_gradients, is_leader, drop_pending;
    uint8_t wants_after_consume;    /* wants_gradients once the held result is consumed */
    uint32_t rank, size;
    uint64_t model_version, epoch;
    uint64_t batch_size, num_gradients, num_skipped;
    uint64_t rounds_committed, rounds_retried, epochs_seen, states_received;
    uint64_t contributions_dropped;
    char leader[256];
};

/* The seals the tensors memfd must carry before a sidecar maps it
 * (fcntl F_ADD_SEALS): its size can then never change under the mapping. */
#define TLINK_SEALS (F_SEAL_SHRINK | F_SEAL_GROW)

/* How long a new connection may take to say HELLO and REGISTER before the
 * sidecar closes it: one idle client must not hold the only session. */
#define TLINK_HELLO_DEADLINE_MS 5000

struct tlink_u64 {
    uint64_t value;
};

struct node_view;
/* node_view (node.h) in the wire's fixed-width shape. */
void tlink_view_fill(struct tlink_view *w, const struct node_view *v);

/* The body size each request type must have exactly (replies: by the
 * request they answer). Returns -1 for an unknown type. */
long tlink_body_size(uint16_t type, bool reply);
/* True for a request that gets no reply (CONSUME). */
bool tlink_one_way(uint16_t type);

/* Sends one message with `nfds` descriptors (borrowed). Returns 0 or
 * -errno (-EPIPE when the peer is gone). */
int tlink_send(int sock, uint16_t type, int32_t status, const void *body, uint32_t len,
               const int *fds, int nfds);

/* The bytes cohort_create() leaves free after the gradients and after the
 * results, where the node carries a round's counters (node.h,
 * node_tensors.grads_spare). */
#define TLINK_SPARE_BYTES 4096

/* The bytes after `end` up to the next region of `r` (the view page and
 * the end of the memfd included): 0 when a region spans `end`. Read from
 * a checked layout (trainerd_check_layout), so the bytes belong to no
 * tensor, and a layout without room simply gets none. */
uint64_t tlink_spare_after(const struct tlink_register *r, uint64_t end);

/* How long a side polls for the other's next message before it sleeps. */
#define TLINK_SPIN_US 50

/* Waits until `sock` is readable (or hung up): spins up to TLINK_SPIN_US,
 * then sleeps up to timeout_ms (-1: forever). Returns 0, -ETIMEDOUT or
 * -errno. */
int tlink_wait(int sock, int timeout_ms);

/* Receives one message, waiting up to timeout_ms (-1: forever). Checks
 * magic, version and that the body is exactly `want` bytes (want < 0:
 * anything up to cap). Received descriptors are returned in fds (caller
 * closes), at most TLINK_FDS_MAX; on any error none are left open.
 * Returns 0, -ETIMEDOUT, -ECONNRESET (peer gone), -EPROTO (bad magic,
 * version, size, or too many descriptors). */
int tlink_recv(int sock, struct tlink_hdr *h, void *body, uint32_t cap, long want, int *fds,
               int *nfds, int timeout_ms);

/* A memfd of `len` bytes holding a copy of `data`. Returns the fd or
 * -errno. */
int tlink_memfd_from(const char *name, const void *data, size_t len);
/* Reads up to cap bytes from the start of a memfd whose size is checked
 * first. Returns 0 and a malloc'd copy in *data, -E2BIG, -EIO, -ENOMEM. */
int tlink_memfd_read(int fd, size_t cap, void **data, size_t *len);

#endif

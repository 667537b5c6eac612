/* src/accumulator/trainerd.c: see trainerd.h. */
#include "accumulator/trainerd.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/magic.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/vfs.h>
#include <unistd.h>

#include "base/busguard.h"
#include "base/clock.h"
#include "engine/dtype.h"
#include "base/limits.h"
#include "base/log.h"
#include "accumulator/devred.h"
#include "accumulator/gpusess.h"
#include "accumulator/layout.h"
#include "accumulator/tlink.h"
#include "accumulator/viewpage.h"
#include "gpu/cudrv.h"
#include "gpu/nccllib.h"

#define POLL_MS 200

struct trainerd {
    char *path;
    struct node_config ncfg;
    char *broker, *cohort, *id, *host, *checkpoint_dir;
    int lfd;
    pthread_t thread;
    atomic_bool stop;
    atomic_uint sessions;
    atomic_uint_fast64_t rung;      /* requests served from the doorbell */
    bool gpu_host_staged;
    int (*adopt)(void *arg, int sock);
    void *adopt_arg;
    uint16_t adopt_first, adopt_last;
};

/* Connections whose first message has not come yet: its type says whose
 * they are. A few at a time, each for TLINK_HELLO_DEADLINE_MS at most.
 * While a trainer is served, one that has said nothing after
 * ADOPT_GRACE_MS is a second trainer and is told so, as it always was,
 * before it says anything: an adopted link speaks as it connects (its
 * client retries a refusal, avlink.h), an Accumulator waits for no one. */
#define PENDING_MAX 8
#define ADOPT_GRACE_MS 200
struct pending {
    int sock;
    uint64_t deadline;
    uint64_t busy_at;
};

/* One trainer's session. */
struct session {
    int sock;
    uint64_t deadline;              /* to register by; 0 once registered */
    void *map;
    size_t map_len;
    int guard;                  /* busguard slot watching map, or -1 */
    struct node *node;
    struct viewpage *shared;    /* in map: where the view is published */
    char name[TLINK_NAME_MAX];
    struct gpusess *gpu;        /* a GPU registration's device half, or NULL */
    struct devred_mem gpu_mem;  /* the device as an NCCL step sees it */
    struct devred *red;         /* the node's device reducer (with gpu) */
    struct node_device dev;
    uint64_t gpu_round;         /* the last round whose result went to the device */
    bool gpu_drop;              /* the last view published had drop_pending */
    atomic_bool gpu_failed;     /* a copy to the device failed: the session ends */
    atomic_uint_fast64_t *rung; /* the trainerd's count */
};

/* A GPU session's result is the trainer's only once it is on the device:
 * a newly committed round's results are copied there before the view that
 * shows them is published (gpusess.h, on ordering). Called with the
 * node's lock held; false when the copy failed, which ends the session. */
static bool gpu_result_ready(struct session *s, const struct node_view *v)
{
    int rc;

    /* Only node_view clears drop_pending, having zeroed the memfd's
     * gradients: the device's follow, before the trainer's call returns. */
    if (s->gpu_drop && !v->drop_pending && (rc = gpusess_zero_grads(s->gpu)) < 0) {
        log_error("sidecar", "Dropped gradients could not be zeroed on the trainer's GPU; "
                  "ending its session.", LF_ERR(rc));
        atomic_store(&s->gpu_failed, true);
    }
    s->gpu_drop = v->drop_pending;

    if (!v->has_gradients || v->rounds_committed == s->gpu_round)
        return !atomic_load(&s->gpu_failed);
    /* A round reduced with NCCL left its result in the session's scratch
     * on the device; a host-staged one, in the memfd. */
    rc = devred_take_result(s->red) ? gpusess_publish_scratch(s->gpu) : gpusess_scatter(s->gpu);
    if (rc < 0) {
        log_error("sidecar", "A result could not be copied to the trainer's GPU; ending its "
                  "session.", LF_U("round", v->rounds_committed), LF_ERR(rc));
        atomic_store(&s->gpu_failed, true);
        return false;
    }
    s->gpu_round = v->rounds_committed;
    return true;
}

/* node_config.on_view: the view goes where the trainer reads it. */
static void publish_view(void *arg, const struct node_view *v)
{
    struct session *s = arg;
    struct tlink_view w;

    tlink_view_fill(&w, v);
    if (s->gpu && !gpu_result_ready(s, v))
        w.has_gradients = 0;
    viewpage_publish(s->shared, &w);
}

/* CONTRIBUTE. A GPU session's gradients stay on the device: the node
 * reduces them there with NCCL, or gathers them into the memfd itself at
 * the step of a host-staged epoch (node_device.gather), when the trainer
 * has contributed and writes no gradient. */
static int contribute(struct node *n, uint64_t batch_size)
{
    return node_contribute(n, batch_size);
}

/* node_config.on_spin: while the node's thread spins, it serves the
 * trainer's doorbell itself (viewpage.h), as serve_one would the same
 * request: a CONTRIBUTE's answer is its status, a CONSUME's is 0, whatever
 * node_consume said (on the socket it has no reply at all). Anything else
 * posted there is answered -EPROTO. */
static void serve_bell(void *arg, struct node *n, enum node_spin phase)
{
    struct session *s = arg;
    uint32_t type;
    uint64_t value;

    if (phase != NODE_SPIN_POLL)
        viewpage_listen(s->shared, phase == NODE_SPIN_BEGIN);
    if (phase == NODE_SPIN_BEGIN || !viewpage_take(s->shared, &type, &value))
        return;
    atomic_fetch_add(s->rung, 1);
    if (type == TL_CONTRIBUTE) {
        viewpage_answer(s->shared, contribute(n, value));
    } else if (type == TL_CONSUME) {
        node_consume(n, value);
        viewpage_answer(s->shared, 0);
    } else {
        viewpage_answer(s->shared, -EPROTO);
    }
}

/* Replies name their request's type only through the conversation: one
 * request, one reply. `type` is kept at call sites for the reader. */
static int reply(int sock, uint16_t type, int32_t status, const void *body, uint32_t len,
                 const int *fds, int nfds)
{
    (void)type;
    return tlink_send(sock, TL_REPLY, status, body, len, fds, nfds);
}

int trainerd_check_layout(const struct tlink_register *r, uint64_t region_size)
{
    uint64_t gbytes, end, rend;

    if (r->mem != TL_MEM_HOST && r->mem != TL_MEM_CUDA_VMM)
        return -EOPNOTSUPP;
    if (!dtype_valid((int)r->grad_dtype) || r->grad_count == 0)
        return -EINVAL;
    if (region_size != r->region_bytes || r->region_bytes == 0)
        return -EINVAL;
    if ((r->params_off | r->grads_off | r->results_off | r->buffers_off | r->shared_off) % 64 != 0 ||
        (r->params_bytes | r->buffers_bytes) % 8 != 0)
        return -EINVAL;
    if (r->grad_count > UINT64_MAX / 8)
        return -EINVAL;
    gbytes = r->grad_count * dtype_size((enum dtype)r->grad_dtype);
    end = r->grads_off + gbytes;
    rend = r->results_off + gbytes;
    /* The results must not overlap the gradients: the engine reads one
     * while it writes the other. */
    if (end < r->grads_off || end > r->region_bytes || rend < r->results_off ||
        rend > r->region_bytes || (r->results_off < end && r->grads_off < rend) ||
        /* The view page comes last, after every tensor. */
        r->shared_off < end || r->shared_off < rend ||
        r->shared_off < r->params_off + r->params_bytes ||
        r->shared_off < r->buffers_off + r->buffers_bytes ||
        r->shared_off > r->region_bytes || r->region_bytes - r->shared_off < VIEWPAGE_BYTES ||
        r->params_off + r->params_bytes < r->params_off ||
        r->params_off + r->params_bytes > r->region_bytes ||
        r->buffers_off + r->buffers_bytes < r->buffers_off ||
        r->buffers_off + r->buffers_bytes > r->region_bytes)
        return -EINVAL;
    return 0;
}

int trainerd_check_gpu(const struct tlink_register *r, const char **why)
{
    struct gpuid id;
    char text[GPUID_TEXT_MAX];
    int rc;

    if (r->mem == TL_MEM_CUDA_IPC) {
        *why = "Legacy CUDA IPC handles are refused: they fail across the PID namespaces of a pod's containers.";
        return -EOPNOTSUPP;
    }
    if (r->mem != TL_MEM_CUDA_VMM) {
        *why = "The registration names a kind of memory this sidecar does not know.";
        return -EOPNOTSUPP;
    }
    memcpy(id.b, r->cuda_uuid, GPUID_BYTES);
    rc = cudrv_check(&id, why);
    if (rc == 0) {
        *why = "The device is here; its tensors are served host-staged.";
        return 0;
    }
    if (rc != -EOPNOTSUPP && rc != -ELIBACC && rc != -ENXIO)
        rc = -EIO;
    log_warn("sidecar", "A trainer registered GPU memory, which is refused.",
             LF_S("device", gpuid_format(&id, text, sizeof(text))), LF_S("cause", *why),
             LF_ERR(rc));
    return rc;
}

/* Offsets and sizes from the trainer are checked against the memfd's real
 * size before anything is mapped or touched. */
static int check_layout(const struct tlink_register *r, int fd)
{
    struct stat st;
    struct statfs fs;
    const char *why;
    int rc;

    if (r->mem != TL_MEM_HOST) {
        rc = trainerd_check_gpu(r, &why);
        if (rc < 0)
            return rc;
    }
    /* An ordinary memfd lives on shmem. A hugetlbfs one could fault with
     * SIGBUS whenever the pool of huge pages runs dry. */
    if (fstatfs(fd, &fs) < 0 || fs.f_type != TMPFS_MAGIC)
        return -EPERM;
    /* Sealed first, so the size checked here is the size for good. */
    if ((fcntl(fd, F_GET_SEALS) & TLINK_SEALS) != TLINK_SEALS)
        return -EPERM;
    if (fstat(fd, &st) < 0)
        return -EINVAL;
    return trainerd_check_layout(r, (uint64_t)st.st_size);
}

/* The device half of a GPU registration, before anything is mapped: its
 * descriptor came (host memory has none), its layout holds, and the
 * cohort does not pin parallel gradients, which the host-staged path does
 * not serve: the node would zero the memfd's gradients, not the
 * device's. */
static int gpu_precheck(const struct trainerd *t, const struct tlink_register *r, int devfd)
{
    if (r->mem != TL_MEM_CUDA_VMM)
        return devfd < 0 ? 0 : -EPROTO;
    if (devfd < 0)
        return -EPROTO;
    if (t->ncfg.parallel_gradients > 1)
        return -EOPNOTSUPP;
    return gpusess_check_layout(r);
}

/* The node's device reducer for a GPU session: with NCCL where it loads
 * and the gradients' type is one it reduces; without (every epoch
 * host-staged) otherwise. */
static int gpu_reducer(const struct trainerd *t, struct session *s)
{
    const struct ncomm_ops *ops = NULL;
    /* The calls are filled in even when it fails: host-staged needs them. */
    int rc = gpusess_device_mem(s->gpu, !t->gpu_host_staged, &s->gpu_mem);

    if (t->gpu_host_staged) {
        log_info("sidecar", "This trainer's GPU gradients are reduced host-staged (--gpu-reduce host).",
                 LF_S("accumulator", s->name));
    } else if (rc < 0 || (rc = nccllib_load(&ops)) < 0) {
        ops = NULL;
        log_info("sidecar", "This trainer's GPU gradients are reduced host-staged: NCCL cannot serve them here.",
                 LF_S("accumulator", s->name), LF_ERR(rc));
    }
    rc = devred_create(ops, &s->gpu_mem, &s->red);
    if (rc < 0)
        return rc;
    s->dev = devred_device(s->red);
    return 0;
}

static int do_register(struct trainerd *t, struct session *s, const struct tlink_register *r,
                       int fd, int devfd)
{
    struct node_config nc = t->ncfg;
    struct node_tensors nt;
    uint64_t gbytes;
    int rc;

    if (s->node)
        return -EALREADY;
    rc = check_layout(r, fd);
    if (rc < 0)
        return rc;
    rc = gpu_precheck(t, r, devfd);
    if (rc < 0)
        return rc;
    gbytes = r->grad_count * dtype_size((enum dtype)r->grad_dtype);
    s->map = mmap(NULL, r->region_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (s->map == MAP_FAILED) {
        s->map = NULL;
        return -errno;
    }
    s->map_len = r->region_bytes;
    s->guard = busguard_watch(s->map, s->map_len);
    if (s->guard < 0)
        return s->guard;
    s->shared = (struct viewpage *)((char *)s->map + r->shared_off);
    if (r->mem == TL_MEM_CUDA_VMM) {
        rc = gpusess_open(r, devfd, (char *)s->map + r->grads_off,
                          (char *)s->map + r->results_off, &s->gpu);
        if (rc < 0) {
            /* Nothing was started on the mapping: let it go, so that the
             * trainer may register again. */
            busguard_unwatch(s->guard);
            munmap(s->map, s->map_len);
            s->map = NULL;
            s->guard = -1;
            return rc;
        }
    }
    if (s->gpu) {
        rc = gpu_reducer(t, s);
        if (rc < 0)
            return rc;
        nc.device = &s->dev;
    }
    nc.on_view = publish_view;
    nc.on_spin = serve_bell;
    nc.view_arg = s;
    s->rung = &t->rung;
    rc = node_start(&nc, &s->node);
    if (rc < 0)
        return rc;
    nt = (struct node_tensors){
        .params = (char *)s->map + r->params_off, .params_bytes = r->params_bytes,
        .grads = (char *)s->map + r->grads_off, .grad_count = r->grad_count,
        .results = (char *)s->map + r->results_off, .grad_type = (enum dtype)r->grad_dtype,
        .buffers = (char *)s->map + r->buffers_off, .buffers_bytes = r->buffers_bytes,
        .grads_spare = tlink_spare_after(r, r->grads_off + gbytes),
        .results_spare = tlink_spare_after(r, r->results_off + gbytes),
    };
    rc = node_register(s->node, &nt);
    if (rc == 0)
        log_info("sidecar", "The trainer registered its tensors; joining the cohort.",
                 LF_S("accumulator", s->name), LF_U("grad_count", r->grad_count),
                 LF_S("grad_dtype", dtype_name((enum dtype)r->grad_dtype)),
                 LF_U("shared_bytes", r->region_bytes));
    return rc;
}

/* Refuses a request with `err`; `end`: the session ends too. A one-way
 * request has no reply to carry the error, so it always ends the session:
 * the trainer learns of it from the closed connection. Returns what
 * serve_one returns. */
static int refuse(struct session *s, uint16_t type, int err, bool end)
{
    int rc;

    if (tlink_one_way(type))
        return -EPROTO;
    rc = reply(s->sock, type, err, NULL, 0, NULL, 0);
    if (end)
        return err;
    return rc < 0 ? rc : 0;
}

/* Serves one request. Returns 0 to go on, <0 to end the session. */
static int serve_one(struct trainerd *t, struct session *s)
{
    union {
        struct tlink_hello hello;
        struct tlink_register reg;
        struct tlink_u64 u;
        char raw[TLINK_BODY_MAX];
    } b;
    struct tlink_hdr h;
    int fds[TLINK_FDS_MAX], nfds = 0, rc;
    long want;

    rc = tlink_recv(s->sock, &h, &b, sizeof(b), -1, fds, &nfds, POLL_MS);
    if (rc == -ETIMEDOUT)
        return atomic_load(&t->stop) ? -ESHUTDOWN : 0;
    if (rc < 0)
        return rc;
    want = tlink_body_size(h.type, false);
    if (want < 0 || h.len != (uint32_t)want) {
        log_warn("sidecar", "The trainer sent a malformed request; closing its connection.",
                 LF_U("type", h.type), LF_U("len", h.len));
        for (int i = 0; i < nfds; i++)
            close(fds[i]);
        return refuse(s, h.type, -EPROTO, true);
    }
    /* Only these requests carry a descriptor, and they must; a GPU
     * registration may carry its device region's as a second. */
    if ((h.type == TL_REGISTER || h.type == TL_SET_STATE || h.type == TL_SET_SHAPES) !=
            (nfds >= 1) ||
        (nfds == 2 && h.type != TL_REGISTER)) {
        for (int i = 0; i < nfds; i++)
            close(fds[i]);
        return refuse(s, h.type, -EPROTO, false);
    }
    /* A CONSUME here is a broken trainer: only one shown a result sends it. */
    if (!s->node && h.type != TL_HELLO && h.type != TL_REGISTER)
        return refuse(s, h.type, -ENODEV, false);
    switch (h.type) {
    case TL_HELLO:
        b.hello.name[TLINK_NAME_MAX - 1] = '\0';
        snprintf(s->name, sizeof(s->name), "%s", b.hello.name);
        rc = b.hello.api_version == TLINK_VERSION ? 0 : -EPROTO;
        return reply(s->sock, h.type, rc, NULL, 0, NULL, 0);
    case TL_REGISTER:
        rc = do_register(t, s, &b.reg, fds[0], nfds == 2 ? fds[1] : -1);
        for (int i = 0; i < nfds; i++)
            close(fds[i]);
        if (rc < 0)
            log_warn("sidecar", "A trainer's registration was refused.", LF_ERR(rc));
        return reply(s->sock, h.type, rc, NULL, 0, NULL, 0);
    case TL_VIEW: {
        struct node_view v;
        struct tlink_view w;
        node_view(s->node, &v);
        tlink_view_fill(&w, &v);
        return reply(s->sock, h.type, 0, &w, sizeof(w), NULL, 0);
    }
    case TL_CONTRIBUTE:
        return reply(s->sock, h.type, contribute(s->node, b.u.value), NULL, 0, NULL, 0);
    case TL_CONSUME:
        /* One-way: the trainer does not wait. A consume that finds its
         * result already dropped by a state transfer has nothing to do. */
        node_consume(s->node, b.u.value);
        return 0;
    case TL_SET_STATE: {
        void *data = NULL;
        size_t len = 0;
        rc = tlink_memfd_read(fds[0], LIMIT_STATE_BYTES, &data, &len);
        close(fds[0]);
        if (rc == 0 && len != b.u.value)
            rc = -EPROTO;
        if (rc == 0)
            rc = node_set_state(s->node, data, len);
        free(data);
        return reply(s->sock, h.type, rc, NULL, 0, NULL, 0);
    }
    case TL_SET_SHAPES: {
        /* The count is checked before the read, and the read is capped
         * by it: a trainer cannot make the sidecar hold more. */
        void *data = NULL;
        size_t len = 0;
        rc = b.u.value > LAYOUT_SHAPES_MAX ? -EINVAL : 0;
        if (rc == 0)
            rc = tlink_memfd_read(fds[0], (size_t)b.u.value * sizeof(struct layout_shape), &data,
                                  &len);
        close(fds[0]);
        if (rc == 0 && len != b.u.value * sizeof(struct layout_shape))
            rc = -EPROTO;
        if (rc == 0)
            rc = node_set_tensor_shapes(s->node, data, (size_t)b.u.value);
        free(data);
        return reply(s->sock, h.type, rc, NULL, 0, NULL, 0);
    }
    case TL_TAKE_STATE: {
        struct tlink_u64 len = { 0 };
        void *data;
        size_t n;
        int fd;
        rc = node_take_state(s->node, &data, &n);
        if (rc < 0)
            return reply(s->sock, h.type, rc, &len, sizeof(len), NULL, 0);
        fd = tlink_memfd_from("cohort-state", data, n);
        free(data);
        if (fd < 0)
            return reply(s->sock, h.type, fd, &len, sizeof(len), NULL, 0);
        len.value = n;
        rc = reply(s->sock, h.type, 0, &len, sizeof(len), &fd, 1);
        close(fd);
        return rc;
    }
    case TL_SET_VERSION:
        return reply(s->sock, h.type, node_set_model_version(s->node, b.u.value), NULL, 0, NULL, 0);
    case TL_SET_VBS:
        return reply(s->sock, h.type, node_set_virtual_batch_size(s->node, b.u.value), NULL, 0, NULL, 0);
    case TL_SET_PARALLEL:
        return reply(s->sock, h.type,
                     b.u.value > UINT32_MAX ? -EINVAL
                     : s->gpu && b.u.value > 1 ? -EOPNOTSUPP
                                            : node_set_parallel_gradients(s->node, (unsigned)b.u.value),
                     NULL, 0, NULL, 0);
    case TL_SET_COMPRESSION: {
        struct compress c;

        return reply(s->sock, h.type,
                     compress_unpack(b.u.value, &c) == 0 ? node_set_compression(s->node, &c) : -EINVAL,
                     NULL, 0, NULL, 0);
    }
    default:
        return reply(s->sock, h.type, -EPROTO, NULL, 0, NULL, 0);
    }
}

static void session_end(struct session *s)
{
    /* The member leaves first: the cohort moves on without us at once. */
    node_stop(s->node);
    /* No node thread publishes a view any more: the device may go. */
    devred_destroy(s->red);
    gpusess_close(s->gpu);
    /* Nothing touches the mapping any more: the guard may let go of it. */
    busguard_unwatch(s->guard);
    if (s->map)
        munmap(s->map, s->map_len);
    close(s->sock);
    memset(s, 0, sizeof(*s));
    s->sock = -1;
    s->guard = -1;
}

/* The type of the first message waiting on `sock`, read without taking
 * it: 0 when none is whole yet, -1 when the connection is over or the
 * message is not tlink's. */
static int first_type(int sock)
{
    struct tlink_hdr h;
    ssize_t n = recv(sock, &h, sizeof(h), MSG_PEEK | MSG_DONTWAIT);

    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
        return 0;
    if (n < (ssize_t)sizeof(h) || h.magic != TLINK_MAGIC)
        return -1;
    return h.type;
}

/* A new connection waits for its first message beside the session. */
static void accept_pending(int lfd, struct pending *pend)
{
    int c = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);

    if (c < 0)
        return;
    for (int i = 0; i < PENDING_MAX; i++) {
        if (pend[i].sock < 0) {
            pend[i].sock = c;
            pend[i].deadline = clock_now_ms() + TLINK_HELLO_DEADLINE_MS;
            pend[i].busy_at = clock_now_ms() + ADOPT_GRACE_MS;
            return;
        }
    }
    tlink_send(c, TL_REPLY, -EBUSY, NULL, 0, NULL, 0);
    close(c);
    log_warn("sidecar", "Too many connections wait to introduce themselves; one was refused.");
}

static void *trainerd_main(void *arg)
{
    struct trainerd *t = arg;
    struct session s = { .sock = -1, .guard = -1 };
    struct pending pend[PENDING_MAX];

    for (int i = 0; i < PENDING_MAX; i++)
        pend[i].sock = -1;
    while (!atomic_load(&t->stop)) {
        struct pollfd p[2 + PENDING_MAX] = { { t->lfd, POLLIN, 0 }, { s.sock, POLLIN, 0 } };
        int n;

        for (int i = 0; i < PENDING_MAX; i++)
            p[2 + i] = (struct pollfd){ pend[i].sock, POLLIN, 0 };
        n = poll(p, 2 + PENDING_MAX, POLL_MS);

        if (busguard_tripped(s.guard)) {
            /* The trainer's memory failed under our mapping (it cannot
             * shrink once sealed; this is the last line). Its gradients
             * can no longer be trusted to be its own: leave, and tell it. */
            log_error("sidecar", "The trainer's shared memory failed (SIGBUS); ending its "
                      "session and leaving the cohort.", LF_S("accumulator", s.name));
            tlink_send(s.sock, TL_REPLY, -EFAULT, NULL, 0, NULL, 0);
            session_end(&s);
            continue;
        }

        if (atomic_load(&s.gpu_failed)) {
            tlink_send(s.sock, TL_REPLY, -EIO, NULL, 0, NULL, 0);
            session_end(&s);
            continue;
        }

        if (s.sock >= 0 && !s.node && clock_now_ms() > s.deadline) {
            log_warn("sidecar", "A trainer connected but did not register in time; closing its "
                     "connection.", LF_U("deadline_ms", TLINK_HELLO_DEADLINE_MS));
            session_end(&s);
            continue;
        }
        for (int i = 0; i < PENDING_MAX; i++) {
            int type;

            if (pend[i].sock < 0)
                continue;
            type = first_type(pend[i].sock);
            if (type == 0 && s.sock >= 0 && clock_now_ms() > pend[i].busy_at)
                type = TL_HELLO;        /* a second trainer, silent: refused below */
            else if (type == 0 && clock_now_ms() <= pend[i].deadline)
                continue;
            if (type > 0 && t->adopt && type >= t->adopt_first && type <= t->adopt_last) {
                t->adopt(t->adopt_arg, pend[i].sock);
            } else if (type > 0 && s.sock < 0) {
                /* The Accumulator's trainer: its session begins, HELLO
                 * unread, as it always has. */
                s.sock = pend[i].sock;
                s.deadline = pend[i].deadline;
                atomic_fetch_add(&t->sessions, 1);
                log_info("sidecar", "A trainer connected.");
                p[1] = (struct pollfd){ s.sock, POLLIN, POLLIN };
            } else if (type > 0) {
                tlink_send(pend[i].sock, TL_REPLY, -EBUSY, NULL, 0, NULL, 0);
                close(pend[i].sock);
                log_warn("sidecar", "A second trainer tried to connect; it was refused.");
            } else {
                close(pend[i].sock);
            }
            pend[i].sock = -1;
        }
        if (n <= 0)
            continue;
        if (p[0].revents & POLLIN)
            accept_pending(t->lfd, pend);
        if (s.sock >= 0 && (p[1].revents & (POLLIN | POLLHUP | POLLERR))) {
            int rc = serve_one(t, &s);
            /* A trainer in its loop calls again within microseconds:
             * catch that without a trip through poll's sleep. */
            while (rc == 0 && !atomic_load(&t->stop) && tlink_wait(s.sock, 0) == 0)
                rc = serve_one(t, &s);
            if (rc < 0) {
                log_info("sidecar", "The trainer went away; leaving the cohort.",
                         LF_S("accumulator", s.name), LF_S("reason", log_strerror(rc)));
                session_end(&s);
            }
        }
    }
    for (int i = 0; i < PENDING_MAX; i++)
        if (pend[i].sock >= 0)
            close(pend[i].sock);
    if (s.sock >= 0)
        session_end(&s);
    return NULL;
}

/* Binds `fd` at `path` with mode 0600 and listens, with no moment at which
 * anyone else could connect: the socket is made in a fresh 0700 directory
 * beside `path`, restricted there, then renamed into place, replacing a
 * dead sidecar's file. It listens before the rename, so a trainer that
 * finds the file can connect at once. */
static int bind_private(int fd, const char *path)
{
    struct sockaddr_un sa = { .sun_family = AF_UNIX };
    const char *slash = strrchr(path, '/');
    char dir[sizeof(sa.sun_path)], tmp[sizeof(sa.sun_path)];
    int n, rc = 0;

    n = snprintf(dir, sizeof(dir), "%.*s.cohort-XXXXXX", slash ? (int)(slash - path + 1) : 0,
                 path);
    if (n < 0 || (size_t)n >= sizeof(dir) || !mkdtemp(dir))
        return n < 0 || (size_t)n >= sizeof(dir) ? -ENAMETOOLONG : -errno;
    n = snprintf(tmp, sizeof(tmp), "%s/s", dir);
    if ((size_t)n >= sizeof(tmp)) {
        rc = -ENAMETOOLONG;
        goto out_dir;
    }
    memcpy(sa.sun_path, tmp, (size_t)n + 1);
    if (bind(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0 || chmod(tmp, 0600) < 0 ||
        listen(fd, 16) < 0 || rename(tmp, path) < 0)
        rc = -errno;
    unlink(tmp);
out_dir:
    rmdir(dir);
    return rc;
}

/* Frees what trainerd_start copied, and t itself. */
static void free_trainerd(struct trainerd *t)
{
    free(t->path);
    free(t->broker);
    free(t->cohort);
    free(t->id);
    free(t->host);
    free(t->checkpoint_dir);
    free(t);
}

int trainerd_start(const struct trainerd_config *cfg, struct trainerd **out)
{
    struct sockaddr_un sa = { .sun_family = AF_UNIX };
    struct trainerd *t;
    int rc;

    if (!cfg || !cfg->socket_path || !cfg->node.broker || !cfg->node.cohort || !cfg->node.id ||
        !cfg->node.host)
        return -EINVAL;
    if (strlen(cfg->socket_path) >= sizeof(sa.sun_path))
        return -ENAMETOOLONG;
    t = calloc(1, sizeof(*t));
    if (!t)
        return -ENOMEM;
    t->lfd = -1;
    t->path = strdup(cfg->socket_path);
    t->broker = strdup(cfg->node.broker);
    t->cohort = strdup(cfg->node.cohort);
    t->id = strdup(cfg->node.id);
    t->host = strdup(cfg->node.host);
    t->checkpoint_dir = cfg->node.checkpoint_dir ? strdup(cfg->node.checkpoint_dir) : NULL;
    if (!t->path || !t->broker || !t->cohort || !t->id || !t->host ||
        (cfg->node.checkpoint_dir && !t->checkpoint_dir)) {
        rc = -ENOMEM;
        goto err;
    }
    t->ncfg = cfg->node;
    t->gpu_host_staged = cfg->gpu_host_staged;
    t->adopt = cfg->adopt;
    t->adopt_arg = cfg->adopt_arg;
    t->adopt_first = cfg->adopt_first;
    t->adopt_last = cfg->adopt_last;
    t->ncfg.broker = t->broker;
    t->ncfg.cohort = t->cohort;
    t->ncfg.id = t->id;
    t->ncfg.host = t->host;
    t->ncfg.checkpoint_dir = t->checkpoint_dir;
    memcpy(sa.sun_path, t->path, strlen(t->path) + 1);
    t->lfd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (t->lfd < 0) {
        rc = -errno;
        goto err;
    }
    /* A socket file left by a dead sidecar is replaced; one that answers
     * belongs to a live sidecar and is not. */
    if (connect(t->lfd, (struct sockaddr *)&sa, sizeof(sa)) == 0) {
        rc = -EADDRINUSE;
        goto err;
    }
    close(t->lfd);
    t->lfd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (t->lfd < 0) {
        rc = -errno;
        goto err;
    }
    rc = bind_private(t->lfd, t->path);
    if (rc < 0)
        goto err;
    if (pthread_create(&t->thread, NULL, trainerd_main, t) != 0) {
        rc = -EAGAIN;
        goto err_unlink;
    }
    *out = t;
    return 0;
err_unlink:
    unlink(t->path);
err:
    if (t->lfd >= 0)
        close(t->lfd);
    free_trainerd(t);
    return rc;
}

void trainerd_stop(struct trainerd *t)
{
    if (!t)
        return;
    atomic_store(&t->stop, true);
    pthread_join(t->thread, NULL);
    close(t->lfd);
    unlink(t->path);
    free_trainerd(t);
}

unsigned trainerd_sessions(struct trainerd *t)
{
    return atomic_load(&t->sessions);
}

uint64_t trainerd_bell_served(struct trainerd *t)
{
    return atomic_load(&t->rung);
}

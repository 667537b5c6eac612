/* src/accumulator/cohort.c: include/cohort.h. The trainer's tensors live in one memfd
 * laid out as [parameters | gradients | results | buffers], each region
 * 64-byte aligned. With a sidecar, the memfd goes to it once (tlink REGISTER) and
 * every call afterwards is one small request and reply. Without one, a
 * node runs in this process on the same memory. Either way the questions
 * (connected, wants_gradients, ...) read a view that cohort_update()
 * refreshes, so they cost nothing. */
#include "cohort.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "base/clock.h"
#include "engine/dtype.h"
#include "base/ident.h"
#include "base/limits.h"
#include "base/log.h"
#include "accumulator/node.h"
#include "rpc/rpc.h"
#include "accumulator/tlink.h"

#define ALIGN 64
#define REPLY_TIMEOUT_MS 30000

struct cohort {
    char name[TLINK_NAME_MAX];
    enum dtype dtype;
    size_t n_params, n_buffers;
    size_t *param_off, *buffer_off;     /* byte offsets within their region */
    size_t numel;                       /* parameter elements */
    void *map;
    size_t map_len;
    int memfd;
    struct tlink_register layout;

    int sock;                           /* sidecar, or -1 */
    struct node *node;                  /* in-process node, or NULL */
    bool rpc_started;
    char *ident_cohort, *ident_id;
    struct tlink_view view;
    uint32_t seen_gen;                  /* publications counted at the last update */
    bool consume_posted;                /* the sidecar may not have read it yet */
    uint64_t consumed_round;            /* the rounds_committed it consumes */
    void *state;                        /* last received opaque state */
    size_t state_len;
};

static size_t align_up(size_t v)
{
    return (v + ALIGN - 1) / ALIGN * ALIGN;
}

static int to_dtype(enum cohort_dtype t, enum dtype *out)
{
    switch (t) {
    case COHORT_F32: *out = DTYPE_F32; return 0;
    case COHORT_F64: *out = DTYPE_F64; return 0;
    case COHORT_F16: *out = DTYPE_F16; return 0;
    case COHORT_BF16: *out = DTYPE_BF16; return 0;
    }
    return -EINVAL;
}

int cohort_create(const struct cohort_config *cfg, struct cohort **out)
{
    size_t esize, pbytes = 0, bbytes = 0;
    struct cohort *c;
    enum dtype dt;
    int rc = -ENOMEM;

    if (!cfg || !cfg->parameters || cfg->n_parameters == 0 ||
        to_dtype(cfg->parameters[0].dtype, &dt) < 0 || (cfg->n_buffers && !cfg->buffers))
        return -EINVAL;
    esize = dtype_size(dt);
    c = calloc(1, sizeof(*c));
    if (!c)
        return -ENOMEM;
    c->sock = -1;
    c->memfd = -1;
    c->dtype = dt;
    snprintf(c->name, sizeof(c->name), "%s", cfg->name ? cfg->name : "accumulator");
    c->param_off = calloc(cfg->n_parameters, sizeof(size_t));
    c->buffer_off = calloc(cfg->n_buffers + 1, sizeof(size_t));
    if (!c->param_off || !c->buffer_off)
        goto err;
    for (size_t i = 0; i < cfg->n_parameters; i++) {
        enum dtype t;
        if (to_dtype(cfg->parameters[i].dtype, &t) < 0 || t != dt ||
            cfg->parameters[i].numel > (SIZE_MAX / 4) / esize) {
            rc = -EINVAL;       /* one dtype for all parameters */
            goto err;
        }
        c->param_off[i] = pbytes;
        pbytes += cfg->parameters[i].numel * esize;
        c->numel += cfg->parameters[i].numel;
    }
    if (c->numel == 0) {
        rc = -EINVAL;
        goto err;
    }
    for (size_t i = 0; i < cfg->n_buffers; i++) {
        enum dtype t;
        if (to_dtype(cfg->buffers[i].dtype, &t) < 0) {
            rc = -EINVAL;
            goto err;
        }
        /* Each buffer 8-byte aligned, whatever its type. */
        bbytes = (bbytes + 7) / 8 * 8;
        c->buffer_off[i] = bbytes;
        bbytes += cfg->buffers[i].numel * dtype_size(t);
    }
    c->n_params = cfg->n_parameters;
    c->n_buffers = cfg->n_buffers;
    c->layout.mem = TL_MEM_HOST;
    c->layout.grad_dtype = (uint32_t)dt;
    c->layout.params_off = 0;
    c->layout.params_bytes = align_up(pbytes);
    c->layout.grads_off = c->layout.params_bytes;
    c->layout.grad_count = c->numel;
    c->layout.results_off = c->layout.grads_off + align_up(pbytes);
    c->layout.buffers_off = c->layout.results_off + align_up(pbytes);
    c->layout.buffers_bytes = (bbytes + 7) / 8 * 8;
    c->layout.shared_off = c->layout.buffers_off + align_up(bbytes) + ALIGN;
    c->layout.region_bytes = c->layout.shared_off + TLINK_SHARED_BYTES;
    c->map_len = c->layout.region_bytes;
    c->memfd = memfd_create("cohort-tensors", MFD_CLOEXEC);
    if (c->memfd < 0 || ftruncate(c->memfd, (off_t)c->map_len) < 0) {
        rc = -errno;
        goto err;
    }
    c->map = mmap(NULL, c->map_len, PROT_READ | PROT_WRITE, MAP_SHARED, c->memfd, 0);
    if (c->map == MAP_FAILED) {
        c->map = NULL;
        rc = -errno;
        goto err;
    }
    *out = c;
    return 0;
err:
    if (c->memfd >= 0)
        close(c->memfd);
    free(c->param_off);
    free(c->buffer_off);
    free(c);
    return rc;
}

void cohort_destroy(struct cohort *c)
{
    if (!c)
        return;
    if (c->sock >= 0)
        close(c->sock);         /* the sidecar's member leaves */
    node_stop(c->node);
    if (c->rpc_started)
        rpc_shutdown();
    if (c->map)
        munmap(c->map, c->map_len);
    if (c->memfd >= 0)
        close(c->memfd);
    free(c->state);
    free(c->ident_cohort);
    free(c->ident_id);
    free(c->param_off);
    free(c->buffer_off);
    free(c);
}

void *cohort_params(struct cohort *c)
{
    return (char *)c->map + c->layout.params_off;
}

void *cohort_grads(struct cohort *c)
{
    return (char *)c->map + c->layout.grads_off;
}

void *cohort_results(struct cohort *c)
{
    return (char *)c->map + c->layout.results_off;
}

void *cohort_param(struct cohort *c, size_t i)
{
    return i < c->n_params ? (char *)cohort_params(c) + c->param_off[i] : NULL;
}

void *cohort_grad(struct cohort *c, size_t i)
{
    return i < c->n_params ? (char *)cohort_grads(c) + c->param_off[i] : NULL;
}

void *cohort_result(struct cohort *c, size_t i)
{
    return i < c->n_params ? (char *)cohort_results(c) + c->param_off[i] : NULL;
}

void *cohort_buffer(struct cohort *c, size_t i)
{
    return i < c->n_buffers ? (char *)c->map + c->layout.buffers_off + c->buffer_off[i] : NULL;
}

size_t cohort_numel(const struct cohort *c)
{
    return c->numel;
}

int cohort_set_identity(struct cohort *c, const char *cohort_name, const char *member_id)
{
    if (!ident_valid_cohort(cohort_name) || !ident_valid_member_id(member_id))
        return -EINVAL;
    free(c->ident_cohort);
    free(c->ident_id);
    c->ident_cohort = strdup(cohort_name);
    c->ident_id = strdup(member_id);
    return c->ident_cohort && c->ident_id ? 0 : -ENOMEM;
}

/* The link is broken or the sidecar misbehaved: it is dropped, and the
 * view with it. */
static void link_lost(struct cohort *c)
{
    close(c->sock);
    c->sock = -1;
    c->consume_posted = false;
    memset(&c->view, 0, sizeof(c->view));
}

/* One request and its reply. A dead sidecar is -ENOTCONN from here on. */
static int call(struct cohort *c, uint16_t type, const void *body, uint32_t len, const int *fds,
                int nfds, void *out, long out_len, int *fd_out)
{
    struct tlink_hdr h;
    char buf[TLINK_BODY_MAX];
    int got[TLINK_FDS_MAX], ngot = 0, rc;

    if (c->sock < 0)
        return -ENOTCONN;
    rc = tlink_send(c->sock, type, 0, body, len, fds, nfds);
    if (rc == 0)
        rc = tlink_recv(c->sock, &h, buf, sizeof(buf), -1, got, &ngot, REPLY_TIMEOUT_MS);
    if (rc < 0) {
        link_lost(c);
        return rc == -EPROTO ? -EPROTO : -ENOTCONN;
    }
    /* The sidecar read every request before this one, a one-way consume
     * included, and published their effects before it answered. */
    c->consume_posted = false;
    if (h.type != TL_REPLY || (h.status == 0 && out_len >= 0 && h.len != (uint32_t)out_len)) {
        for (int i = 0; i < ngot; i++)
            close(got[i]);
        return -EPROTO;
    }
    if (out && h.len)
        memcpy(out, buf, h.len);
    if (fd_out)
        *fd_out = ngot ? got[0] : -1;
    for (int i = fd_out ? 1 : 0; i < ngot; i++)
        close(got[i]);
    return h.status;
}

static int connect_sidecar(struct cohort *c, const char *path)
{
    struct sockaddr_un sa = { .sun_family = AF_UNIX };
    struct tlink_hello hello = { .api_version = TLINK_VERSION };
    int rc;

    if (strlen(path) >= sizeof(sa.sun_path))
        return -ENAMETOOLONG;
    memcpy(sa.sun_path, path, strlen(path) + 1);
    c->sock = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (c->sock < 0)
        return -errno;
    if (connect(c->sock, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
        rc = -errno;
        close(c->sock);
        c->sock = -1;
        return rc;
    }
    snprintf(hello.name, sizeof(hello.name), "%s", c->name);
    rc = call(c, TL_HELLO, &hello, sizeof(hello), NULL, 0, NULL, 0, NULL);
    if (rc == 0)
        rc = call(c, TL_REGISTER, &c->layout, sizeof(c->layout), &c->memfd, 1, NULL, 0, NULL);
    if (rc < 0 && c->sock >= 0) {
        close(c->sock);
        c->sock = -1;
    }
    return rc;
}

static struct tlink_shared *shared_page(const struct cohort *c)
{
    return (struct tlink_shared *)((char *)c->map + c->layout.shared_off);
}

/* node_config.on_view of the in-process node: the same page a sidecar
 * would write, so cohort_wait() works alike. */
static void publish_local(void *arg, const struct node_view *v)
{
    struct cohort *c = arg;
    struct tlink_view w;

    tlink_view_fill(&w, v);
    tlink_shared_publish(shared_page(c), &w);
}

static int connect_broker(struct cohort *c, const char *address)
{
    const char *cohort = c->ident_cohort ? c->ident_cohort : getenv("COHORT_COHORT");
    const char *id = c->ident_id ? c->ident_id : getenv("COHORT_ID");
    struct node_config nc = { .broker = address, .cohort = cohort, .id = id, .host = "127.0.0.1",
                              .on_view = publish_local, .view_arg = c };
    struct node_tensors t = {
        .params = cohort_params(c), .params_bytes = c->layout.params_bytes,
        .grads = cohort_grads(c), .grad_count = c->layout.grad_count, .grad_type = c->dtype,
        .results = cohort_results(c),
        .buffers = (char *)c->map + c->layout.buffers_off, .buffers_bytes = c->layout.buffers_bytes,
    };
    int rc;

    if (!cohort || !id)
        return -EINVAL;
    if (getenv("COHORT_HOST"))
        nc.host = getenv("COHORT_HOST");
    rc = rpc_init();
    if (rc < 0)
        return rc;
    c->rpc_started = true;
    rc = node_start(&nc, &c->node);
    if (rc == 0)
        rc = node_register(c->node, &t);
    if (rc < 0) {
        node_stop(c->node);
        c->node = NULL;
    }
    return rc;
}

int cohort_connect(struct cohort *c, const char *address)
{
    if (c->sock >= 0 || c->node)
        return -EALREADY;
    if (!address)
        address = getenv("COHORT_SOCKET") ? getenv("COHORT_SOCKET") : getenv("COHORT_BROKER");
    if (!address || !*address)
        return -EINVAL;
    if (strncmp(address, "unix:", 5) == 0)
        return connect_sidecar(c, address + 5);
    if (address[0] == '/')
        return connect_sidecar(c, address);
    return connect_broker(c, address);
}

/* The sidecar never writes first: anything readable on its socket is the
 * end of it. */
static bool sidecar_gone(const struct cohort *c)
{
    struct pollfd p = { c->sock, POLLIN, 0 };

    return poll(&p, 1, 0) != 0;
}

int cohort_update(struct cohort *c)
{
    struct node_view v;
    struct tlink_view w;

    /* Counted before the view is read: a publication in between makes
     * the next cohort_wait() return at once rather than miss it. */
    c->seen_gen = tlink_shared_gen(shared_page(c));
    if (c->node) {
        node_view(c->node, &v);
        tlink_view_fill(&c->view, &v);
        return 0;
    }
    /* Every call before this one was answered, and the sidecar publishes
     * before it answers, so the shared view is at least as new as what
     * those calls did. A call is still needed when gradients must be
     * dropped (the sidecar zeroes them inside it), before the first
     * publication, and to find out that the sidecar is gone. */
    if (c->sock >= 0 && !sidecar_gone(c) && tlink_shared_read(shared_page(c), &w) == 0 &&
        !w.drop_pending) {
        if (c->consume_posted && w.has_gradients && w.rounds_committed == c->consumed_round) {
            /* Published before the sidecar read our one-way consume. */
            w.has_gradients = false;
            w.wants_gradients = w.wants_after_consume;
        } else {
            c->consume_posted = false;
        }
        c->view = w;
        return 0;
    }
    return call(c, TL_VIEW, NULL, 0, NULL, 0, &c->view, sizeof(c->view), NULL);
}

int cohort_wait(struct cohort *c, int timeout_ms)
{
    uint64_t end = clock_now_ms() + (uint64_t)(timeout_ms > 0 ? timeout_ms : 0);

    if (!c->node && c->sock < 0)
        return -ENOTCONN;
    for (;;) {
        uint64_t now = clock_now_ms();
        /* In slices, so that a sidecar that died (it cannot wake us) is
         * noticed within one. */
        int slice = end > now ? (int)(end - now < 50 ? end - now : 50) : 0;

        if (tlink_shared_wait(shared_page(c), c->seen_gen, slice) == 0)
            return 0;
        if (!c->node && sidecar_gone(c))
            return -ENOTCONN;
        if (clock_now_ms() >= end)
            return -ETIMEDOUT;
    }
}

bool cohort_connected(const struct cohort *c) { return c->view.connected; }
bool cohort_wants_state(const struct cohort *c) { return c->view.wants_state; }
bool cohort_has_new_state(const struct cohort *c) { return c->view.has_new_state; }
bool cohort_wants_gradients(const struct cohort *c) { return c->view.wants_gradients; }
bool cohort_has_gradients(const struct cohort *c) { return c->view.has_gradients; }
bool cohort_is_leader(const struct cohort *c) { return c->view.is_leader; }
const char *cohort_get_leader(const struct cohort *c) { return c->view.leader; }
uint64_t cohort_model_version(const struct cohort *c) { return c->view.model_version; }
uint32_t cohort_rank(const struct cohort *c) { return c->view.rank; }
uint32_t cohort_size(const struct cohort *c) { return c->view.size; }

/* A request whose body is one u64. */
static int call_u64(struct cohort *c, uint16_t type, uint64_t v)
{
    struct tlink_u64 u = { v };
    return call(c, type, &u, sizeof(u), NULL, 0, NULL, 0, NULL);
}

/* Local calls answer at once; the view is refreshed so that a question
 * asked right after an action sees its effect, as with a sidecar. */
static int local_done(struct cohort *c, int rc)
{
    cohort_update(c);
    return rc;
}

int cohort_reduce_gradients(struct cohort *c, uint64_t batch_size)
{
    int rc;

    if (batch_size == 0)
        return -EINVAL;         /* a batch of nothing is a skip: say so */
    if (c->node)
        return local_done(c, node_contribute(c->node, batch_size));
    rc = call_u64(c, TL_CONTRIBUTE, batch_size);
    if (rc == 0)
        c->view.wants_gradients = false;
    return rc;
}

int cohort_skip_gradients(struct cohort *c)
{
    int rc;

    if (c->node)
        return local_done(c, node_contribute(c->node, 0));
    rc = call_u64(c, TL_CONTRIBUTE, 0);
    if (rc == 0)
        c->view.wants_gradients = false;
    return rc;
}

/* The trainer zeroes its own gradients, and the consume is one-way: the
 * next batch can start without waiting for the sidecar, which sees the
 * consume before any later request. If the result was dropped meanwhile
 * (a state transfer), the consume finds nothing to do and the zeroing did
 * no harm: the drop zeroes them too. */
int cohort_zero_gradients(struct cohort *c)
{
    struct tlink_u64 u = { c->view.rounds_committed };
    int rc;

    if (!c->node && c->sock < 0)
        return -ENOTCONN;
    if (!c->view.has_gradients)
        return -EPERM;
    memset(cohort_grads(c), 0, c->layout.grad_count * dtype_size(c->dtype));
    if (c->node) {
        node_consume(c->node, u.value);
        return local_done(c, 0);
    }
    rc = tlink_send(c->sock, TL_CONSUME, 0, &u, sizeof(u), NULL, 0);
    if (rc < 0) {
        link_lost(c);
        return -ENOTCONN;
    }
    c->consume_posted = true;
    c->consumed_round = u.value;
    c->view.has_gradients = false;
    c->view.wants_gradients = c->view.wants_after_consume;
    return 0;
}

int cohort_set_state(struct cohort *c, const void *state, size_t len)
{
    int fd, rc;

    if (len > LIMIT_STATE_BYTES)
        return -E2BIG;
    if (c->node)
        return local_done(c, node_set_state(c->node, state, len));
    if (c->sock < 0)
        return -ENOTCONN;
    fd = tlink_memfd_from("cohort-state", state, len);
    if (fd < 0)
        return fd;
    {
        struct tlink_u64 u = { len };
        rc = call(c, TL_SET_STATE, &u, sizeof(u), &fd, 1, NULL, 0, NULL);
    }
    close(fd);
    if (rc == 0)
        c->view.wants_state = false;
    return rc;
}

int cohort_state(struct cohort *c, const void **state, size_t *len)
{
    void *data = NULL;
    size_t n = 0;
    int rc, fd = -1;

    if (c->node) {
        rc = node_take_state(c->node, &data, &n);
    } else {
        struct tlink_u64 u;
        rc = call(c, TL_TAKE_STATE, NULL, 0, NULL, 0, &u, sizeof(u), &fd);
        if (rc == 0 && fd < 0)
            rc = -EPROTO;
        if (rc == 0) {
            rc = tlink_memfd_read(fd, LIMIT_STATE_BYTES, &data, &n);
            if (rc == 0 && n != u.value)
                rc = -EPROTO;
        }
        if (fd >= 0)
            close(fd);
    }
    if (rc < 0) {
        free(data);
        return rc;
    }
    free(c->state);
    c->state = data;
    c->state_len = n;
    c->view.has_new_state = false;
    *state = c->state;
    *len = n;
    return 0;
}

int cohort_set_model_version(struct cohort *c, uint64_t version)
{
    if (c->node)
        return local_done(c, node_set_model_version(c->node, version));
    return call_u64(c, TL_SET_VERSION, version);
}

int cohort_set_virtual_batch_size(struct cohort *c, uint64_t size)
{
    if (size == 0)
        return -EINVAL;
    if (c->node)
        return node_set_virtual_batch_size(c->node, size);
    return call_u64(c, TL_SET_VBS, size);
}

int cohort_set_parallel_gradients(struct cohort *c, unsigned n)
{
    if (n == 0)
        return -EINVAL;
    if (c->node)
        return node_set_parallel_gradients(c->node, n);
    return call_u64(c, TL_SET_PARALLEL, n);
}

int cohort_get_gradient_stats(const struct cohort *c, struct cohort_gradient_stats *out)
{
    *out = (struct cohort_gradient_stats){
        .batch_size = c->view.batch_size, .num_gradients = c->view.num_gradients,
        .num_skipped = c->view.num_skipped, .rounds_committed = c->view.rounds_committed,
        .rounds_retried = c->view.rounds_retried, .epochs_seen = c->view.epochs_seen,
        .states_received = c->view.states_received, .epoch = c->view.epoch,
        .contributions_dropped = c->view.contributions_dropped,
    };
    return 0;
}

const char *cohort_strerror(int err)
{
    switch (err < 0 ? -err : err) {
    case EPERM: return "not now: the call does not fit the accumulator's state (see wants_gradients, has_gradients, wants_state)";
    case ENOTCONN: return "the sidecar is gone";
    case EPROTO: return "the sidecar speaks another protocol version, or sent something malformed";
    case ENODEV: return "no tensors registered";
    case ENOTSUP: return "not supported by this build";
    default: return log_strerror(err);
    }
}

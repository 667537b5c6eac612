/* src/accumulator/cohort.c: include/cohort.h. The trainer's tensors live
 * in one memfd laid out as [parameters | gradients | results | buffers |
 * view page], each region 64-byte aligned, the gradients and the results
 * each followed by TLINK_SPARE_BYTES for the node's counters.
 * cohort_connect() picks the link
 * to the node that runs the rounds (link.h): a sidecar, to which the memfd
 * goes once, or a node in this process on the same memory. Every public
 * function below is the same for both. The questions (connected,
 * wants_gradients, ...) read a view that cohort_update() and every action
 * refresh, so they cost nothing. */
#include "cohort.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "base/clock.h"
#include "base/secret.h"
#include "engine/codec.h"
#include "accumulator/compress.h"
#include "accumulator/layout.h"
#include "engine/dtype.h"
#include "base/ident.h"
#include "base/limits.h"
#include "base/log.h"
#include "accumulator/gputrainer.h"
#include "accumulator/link_node.h"
#include "accumulator/link_sidecar.h"
#include "rpc/rpc.h"

#define ALIGN 64
/* The most bytes of parameters, and of buffers, one trainer may declare:
 * 64 TiB each, so that three parameter-sized regions, the buffers and the
 * alignment never overflow an off_t. */
#define REGION_MAX (1ull << 46)

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

    struct link_memory mem;             /* what the link borrows of the above */
    struct link *link;                  /* sidecar or in-process; NULL until connect */
    char *ident_cohort, *ident_id;
    struct tlink_view view;
    uint32_t seen_gen;                  /* publications counted at the last update */
    void *state;                        /* last received opaque state */
    size_t state_len;
    struct gputrainer *gpu;             /* cohort_use_gpu's device region, or NULL */
    /* The host copies of the parameters and buffers hold a state that
     * arrived (from the leader, or a checkpoint) and is not on the device
     * yet; what the last view said of the states, to see the next one. */
    bool gpu_pending;
    bool gpu_seen_new;
    uint64_t gpu_states;
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
    c->memfd = -1;
    c->dtype = dt;
    snprintf(c->name, sizeof(c->name), "%s", cfg->name ? cfg->name : "accumulator");
    c->param_off = calloc(cfg->n_parameters, sizeof(size_t));
    c->buffer_off = calloc(cfg->n_buffers + 1, sizeof(size_t));
    if (!c->param_off || !c->buffer_off)
        goto err;
    for (size_t i = 0; i < cfg->n_parameters; i++) {
        enum dtype t;
        /* One dtype for all parameters, and a total that leaves the sum
         * of every region below far from overflowing. */
        if (to_dtype(cfg->parameters[i].dtype, &t) < 0 || t != dt ||
            cfg->parameters[i].numel > (REGION_MAX - pbytes) / esize) {
            rc = -EINVAL;
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
        /* Each buffer 8-byte aligned, whatever its type. */
        bbytes = (bbytes + 7) / 8 * 8;
        if (to_dtype(cfg->buffers[i].dtype, &t) < 0 ||
            cfg->buffers[i].numel > (REGION_MAX - bbytes) / dtype_size(t)) {
            rc = -EINVAL;
            goto err;
        }
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
    /* Room after the gradients and after the results, where the node
     * carries a round's counters (tlink.h, TLINK_SPARE_BYTES). */
    c->layout.results_off = c->layout.grads_off + align_up(pbytes) + TLINK_SPARE_BYTES;
    c->layout.buffers_off = c->layout.results_off + align_up(pbytes) + TLINK_SPARE_BYTES;
    c->layout.buffers_bytes = (bbytes + 7) / 8 * 8;
    c->layout.shared_off = c->layout.buffers_off + align_up(bbytes) + ALIGN;
    c->layout.region_bytes = c->layout.shared_off + VIEWPAGE_BYTES;
    c->map_len = c->layout.region_bytes;
    /* Sealed at its size: a sidecar maps it, and a memfd that could shrink
     * under that mapping could kill the sidecar with SIGBUS. The sidecar
     * refuses one without these seals. */
    c->memfd = memfd_create("cohort-tensors", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (c->memfd < 0 || ftruncate(c->memfd, (off_t)c->map_len) < 0 ||
        fcntl(c->memfd, F_ADD_SEALS, TLINK_SEALS | F_SEAL_SEAL) < 0) {
        rc = -errno;
        goto err;
    }
    c->map = mmap(NULL, c->map_len, PROT_READ | PROT_WRITE, MAP_SHARED, c->memfd, 0);
    if (c->map == MAP_FAILED) {
        c->map = NULL;
        rc = -errno;
        goto err;
    }
    c->mem = (struct link_memory){ .map = c->map, .memfd = c->memfd, .devfd = -1, .layout = &c->layout,
                                   .dtype = c->dtype, .name = c->name };
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
    if (c->link)
        c->link->ops->destroy(c->link);
    gputrainer_close(c->gpu);
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

/* Where the buffers begin, whether or not there are any: cohort_buffer()
 * answers NULL for a model with none, and a GPU copy needs an address. */
static char *host_buffers(struct cohort *c)
{
    return (char *)c->map + c->layout.buffers_off;
}

void *cohort_buffer(struct cohort *c, size_t i)
{
    return i < c->n_buffers ? host_buffers(c) + c->buffer_off[i] : NULL;
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

/* On a GPU, a state that arrived goes onto the device before a view says
 * it is there. The node wrote it into the host copies of the parameters
 * and buffers: a leader's counts in states_received, a checkpoint's only
 * in has_new_state, so a rise of that counts too. A copy that failed
 * says nothing new and is tried again at the next update. */
static int gpu_state_in(struct cohort *c)
{
    int rc;

    if (c->view.states_received != c->gpu_states || (c->view.has_new_state && !c->gpu_seen_new))
        c->gpu_pending = true;
    c->gpu_states = c->view.states_received;
    c->gpu_seen_new = c->view.has_new_state;
    if (!c->gpu_pending)
        return 0;
    rc = gputrainer_state_in(c->gpu, cohort_params(c), host_buffers(c));
    if (rc < 0) {
        c->view.has_new_state = false;
        return rc;
    }
    c->gpu_pending = false;
    return 0;
}

/* Refreshes the view from the link. The publication count is read first:
 * a publication in between makes the next cohort_wait() return at once
 * rather than miss it. */
static int refresh(struct cohort *c)
{
    int rc;

    c->seen_gen = viewpage_gen(link_shared_page(&c->mem));
    rc = c->link->ops->update(c->link, &c->view);
    if (rc == 0 && c->gpu)
        rc = gpu_state_in(c);
    return rc;
}

/* Brings the view up to date: a lost link (found now or earlier) takes
 * the view with it. */
static int sync_view(struct cohort *c)
{
    int rc = c->link->ops->up(c->link) ? refresh(c) : -ENOTCONN;

    if (!c->link->ops->up(c->link))
        memset(&c->view, 0, sizeof(c->view));
    return rc;
}

/* After an action: the view is brought up to date, so that the action's
 * effect (or what refused it) shows at once, whichever link carried it. */
static int settle(struct cohort *c, int rc)
{
    (void)sync_view(c);
    return rc;
}

static bool linked(const struct cohort *c)
{
    return c->link && c->link->ops->up(c->link);
}

int cohort_connect(struct cohort *c, const char *address)
{
    const char *cohort, *id, *host, *key_file = getenv("COHORT_SECRET_FILE");
    const char *ca_file = getenv("COHORT_BROKER_CA");
    struct secret key;
    char *ca = NULL;
    bool mac = false;
    int rc;

    if (c->link)
        return -EALREADY;
    if (!address)
        address = getenv("COHORT_SOCKET") ? getenv("COHORT_SOCKET") : getenv("COHORT_BROKER");
    if (!address || !*address)
        return -EINVAL;
    if (strncmp(address, "unix:", 5) == 0)
        return link_sidecar_connect(address + 5, &c->mem, &c->link);
    if (address[0] == '/')
        return link_sidecar_connect(address, &c->mem, &c->link);
    if (c->gpu)
        return -EOPNOTSUPP;     /* only a sidecar stages device memory */
    cohort = c->ident_cohort ? c->ident_cohort : getenv("COHORT_COHORT");
    id = c->ident_id ? c->ident_id : getenv("COHORT_ID");
    host = getenv("COHORT_HOST") ? getenv("COHORT_HOST") : "127.0.0.1";
    /* The frame integrity, as the sidecar's --integrity (needs the key). */
    if (secret_integrity_parse(getenv("COHORT_INTEGRITY"), &mac) < 0 ||
        (mac && !(key_file && *key_file)))
        return -EINVAL;
    if (key_file && *key_file) {
        rc = secret_load(key_file, &key);
        if (rc < 0)
            return rc;
    }
    /* TLS to the broker, as the sidecar's --broker-ca and
     * --broker-server-name. */
    if (ca_file && *ca_file && (rc = rpc_pem_load(ca_file, &ca)) < 0)
        goto out;
    rc = link_node_connect(address, cohort, id, host, key_file && *key_file ? &key : NULL, mac,
                           ca, getenv("COHORT_BROKER_SERVER_NAME"), &c->mem, &c->link);
out:
    rpc_pem_free(ca);
    if (key_file && *key_file)
        secret_wipe(&key);
    return rc;
}

int cohort_update(struct cohort *c)
{
    if (!c->link)
        return -ENOTCONN;
    return sync_view(c);
}

int cohort_wait(struct cohort *c, int timeout_ms)
{
    uint64_t end = clock_now_ms() + (uint64_t)(timeout_ms > 0 ? timeout_ms : 0);

    if (!linked(c))
        return -ENOTCONN;
    for (;;) {
        uint64_t now = clock_now_ms();
        /* In slices, so that a sidecar that died (it cannot wake us) is
         * noticed within one. */
        int slice = end > now ? (int)(end - now < 50 ? end - now : 50) : 0;

        if (viewpage_wait(link_shared_page(&c->mem), c->seen_gen, slice) == 0)
            return 0;
        if (c->link->ops->gone(c->link))
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

int cohort_reduce_gradients(struct cohort *c, uint64_t batch_size)
{
    if (batch_size == 0)
        return -EINVAL;         /* a batch of nothing is a skip: say so */
    if (!c->link)
        return -ENOTCONN;
    if (c->gpu) {
        int rc = gputrainer_sync(c->gpu);
        if (rc < 0)
            return rc;
    }
    return settle(c, c->link->ops->contribute(c->link, batch_size));
}

int cohort_skip_gradients(struct cohort *c)
{
    if (!c->link)
        return -ENOTCONN;
    return settle(c, c->link->ops->contribute(c->link, 0));
}

/* The trainer zeroes its own gradients, and the consume need not wait for
 * the node: the next batch can start at once. If the result was dropped
 * meanwhile (a state transfer), the consume finds nothing to do and the
 * zeroing did no harm: the drop zeroes them too. */
int cohort_zero_gradients(struct cohort *c)
{
    if (!linked(c))
        return -ENOTCONN;
    if (!c->view.has_gradients)
        return -EPERM;
    if (c->gpu) {
        int rc = gputrainer_zero(c->gpu);
        if (rc < 0)
            return rc;
    } else {
        memset(cohort_grads(c), 0, c->layout.grad_count * dtype_size(c->dtype));
    }
    return settle(c, c->link->ops->consume(c->link, c->view.rounds_committed));
}

/* On a GPU the node sends (and checkpoints) the host copies of the
 * parameters and buffers, refreshed here from the device whether or not
 * the view still says the state is wanted: a view a moment old must not
 * send stale copies. */
int cohort_set_state(struct cohort *c, const void *state, size_t len)
{
    if (len > LIMIT_STATE_BYTES)
        return -E2BIG;
    if (!c->link)
        return -ENOTCONN;
    if (c->gpu) {
        int rc = gputrainer_state_out(c->gpu, cohort_params(c), host_buffers(c));
        if (rc < 0)
            return rc;
    }
    return settle(c, c->link->ops->set_state(c->link, state, len));
}

int cohort_state(struct cohort *c, const void **state, size_t *len)
{
    void *data = NULL;
    size_t n = 0;
    int rc;

    if (!c->link)
        return -ENOTCONN;
    rc = c->link->ops->take_state(c->link, &data, &n);
    if (rc < 0)
        return settle(c, rc);
    /* A state no view showed (a checkpoint's, taken blind) is copied to
     * the device by the settle below all the same. */
    if (c->gpu && !c->gpu_seen_new)
        c->gpu_pending = true;
    free(c->state);
    c->state = data;
    c->state_len = n;
    *state = c->state;
    *len = n;
    return settle(c, 0);
}

int cohort_set_model_version(struct cohort *c, uint64_t version)
{
    if (!c->link)
        return -ENOTCONN;
    return settle(c, c->link->ops->set_model_version(c->link, version));
}

int cohort_set_virtual_batch_size(struct cohort *c, uint64_t size)
{
    if (size == 0)
        return -EINVAL;
    if (!c->link)
        return -ENOTCONN;
    return settle(c, c->link->ops->set_virtual_batch_size(c->link, size));
}

/* The public values are compress.h's (the codecs' are engine/codec.h's),
 * so they pass through unchanged. */
_Static_assert(COHORT_COMPRESSION_NONE == (int)COMPRESS_NONE &&
                   COHORT_COMPRESSION_FP16 == (int)COMPRESS_FP16 &&
                   COHORT_COMPRESSION_BF16 == (int)COMPRESS_BF16 &&
                   COHORT_COMPRESSION_INT8 == (int)COMPRESS_INT8 &&
                   COHORT_COMPRESSION_TOPK == (int)COMPRESS_TOPK &&
                   COHORT_COMPRESSION_POWERSGD == (int)COMPRESS_POWERSGD,
               "cohort.h's compression values are accumulator/compress.h's");

int cohort_set_compression_with(struct cohort *c, enum cohort_compression method, double param)
{
    struct compress cc;

    if ((unsigned)method >= COMPRESS_METHODS || !(param >= 0))
        return -EINVAL;
    cc = compress_default((enum compress_method)method);
    if (param > 0) {
        if (method == COHORT_COMPRESSION_TOPK) {
            /* Millionths, as compress.h keeps it: 1e-6 .. 1. */
            if (param > 1.0)
                return -EINVAL;
            cc.param = (uint32_t)llround(param * COMPRESS_TOPK_ONE);
        } else if (method == COHORT_COMPRESSION_POWERSGD) {
            if (param != floor(param) || param > UINT32_MAX)
                return -EINVAL;
            cc.param = (uint32_t)param;
        } else {
            return -EINVAL;     /* the codecs take none */
        }
    }
    if (!compress_valid(&cc))
        return -EINVAL;
    if (!c->link)
        return -ENOTCONN;
    return settle(c, c->link->ops->set_compression(c->link, compress_pack(&cc)));
}

_Static_assert(COHORT_TENSOR_SHAPES_MAX == LAYOUT_SHAPES_MAX,
               "cohort.h's cap on tensors is accumulator/layout.h's");

int cohort_set_tensor_shapes(struct cohort *c, const struct cohort_tensor_shape *shapes, size_t n)
{
    struct layout_shape *v = NULL;
    struct layout *l = NULL;
    int rc;

    if ((n && !shapes) || n > COHORT_TENSOR_SHAPES_MAX)
        return -EINVAL;
    if (n && !(v = malloc(n * sizeof(*v))))
        return -ENOMEM;
    for (size_t i = 0; i < n; i++)
        v[i] = (struct layout_shape){ shapes[i].offset, shapes[i].count, shapes[i].rows,
                                      shapes[i].cols };
    /* Checked here too, so that a bad layout is refused the same way
     * whichever link carries it, before anything travels. */
    rc = layout_make(v, n, c->layout.grad_count, &l);
    layout_free(l);
    if (rc == 0 && !c->link)
        rc = -ENOTCONN;
    if (rc == 0)
        rc = settle(c, c->link->ops->set_tensor_shapes(c->link, v, n));
    free(v);
    return rc;
}

int cohort_set_compression(struct cohort *c, enum cohort_compression method)
{
    return cohort_set_compression_with(c, method, 0);
}

int cohort_set_parallel_gradients(struct cohort *c, unsigned n)
{
    if (n == 0)
        return -EINVAL;
    if (!c->link)
        return -ENOTCONN;
    return settle(c, c->link->ops->set_parallel_gradients(c->link, n));
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
    case EFAULT: return "the sidecar could not read the trainer's shared memory; it ended the session";
    case EPROTO: return "the sidecar speaks another protocol version, or sent something malformed";
    case ENODEV: return "no tensors registered";
    case ENOTSUP: return "not supported by this build (for GPU memory: no GPU support in this build, or not served yet; the sidecar's log names the cause)";
    case ELIBACC: return "no CUDA driver: the sidecar could not load libcuda.so.1";
    case ENXIO: return "no GPU with the UUID the trainer named is visible to the sidecar";
    case EACCES: return "the cohort sets this (its TrainingCohort's spec.accumulator, the sidecar's --virtual-batch-size or --parallel-gradients) to another value; the sidecar's log names it";
    default: return log_strerror(err);
    }
}

int cohort_use_gpu(struct cohort *c, const char *device_uuid)
{
    int rc;

    if (c->link || c->gpu)
        return -EALREADY;
    rc = gputrainer_open(device_uuid, c->layout.grad_count * dtype_size(c->dtype),
                         c->layout.grad_count * dtype_size(c->dtype), c->layout.buffers_bytes,
                         &c->gpu);
    if (rc < 0)
        return rc;
    gputrainer_describe(c->gpu, &c->layout);
    c->mem.devfd = gputrainer_fd(c->gpu);
    return 0;
}

uint64_t cohort_gpu_grads(const struct cohort *c)
{
    return c->gpu ? gputrainer_addr(c->gpu) : 0;
}

uint64_t cohort_gpu_param(const struct cohort *c, size_t i)
{
    return c->gpu && i < c->n_params ? gputrainer_params_addr(c->gpu) + c->param_off[i] : 0;
}

uint64_t cohort_gpu_buffer(const struct cohort *c, size_t i)
{
    return c->gpu && i < c->n_buffers ? gputrainer_buffers_addr(c->gpu) + c->buffer_off[i] : 0;
}

/* src/engine/allreduce.c: see allreduce.h. The engine's lifecycle (create,
 * set_epoch, destroy, registrations) and the dispatch of one call to an
 * algorithm; the rest is beside it:
 *
 *   peerwire.c        the bytes on the wire: greeting, frame header, BYE
 *   peerauth.c        what proves a peer: the greeting's MACs, frame tags
 *   conn.c            connections in a call: pumps, checks, waiting, dialling
 *   acceptor.c        the acceptor thread: accepting and judging greetings
 *   ring.c            the ring, for large buffers
 *   doubling.c        recursive doubling, for small ones
 *   butterfly.c       the butterfly, for parts of given lengths
 *   allreduce_impl.h  the structures they share
 *
 * DISPATCH
 *
 * Every algorithm is a pair of functions of one shape, the peers it talks
 * to and the call itself (`int (*)(struct run *)`), listed in
 * algorithms[]; choose_algorithm() is the one place that picks one, so a
 * setting naming an algorithm would replace that rule and nothing else.
 * Every member derives the same choice from the same call, so nothing is
 * negotiated.
 *
 * THE CODEC SEAM
 *
 * Payload bytes meet the algorithms in one pair of places each: where a
 * payload is staged for sending, and where a received payload is combined
 * into the result.
 *
 *   ring.c       ring_stage()   ring_combine()
 *   doubling.c   rd_stage()     rd_combine()
 *   butterfly.c  tx_next()      rx_done()
 *
 * Between them the connections (conn.c) move opaque bytes of the length
 * the frame header states, and that length is the one the stage returned.
 * A codec (codec.h, allreduce_run_codec) plugs in there: the stage
 * encodes into a staging slot and returns the encoded length, the combine
 * decodes, and the length a receive expects is the codec's for the
 * element count (still exact: every codec is fixed-length). In a coded
 * call the all-gather and the result an extra doubling member gets back
 * land in a slot and are decoded too (ring.c, doubling.c).
 *
 * THRESHOLDS
 *
 * Measured on the 2-core development VM, `cohortctl bench allreduce`, f32
 * sum, one process per member, loopback TCP, medians of 3 to 7 interleaved
 * runs (the VM is shared and noisy: single runs vary by +-30%):
 *
 *   recursive doubling vs ring, ms per all-reduce (ring / rd):
 *     bytes  n=2          n=3          n=4          n=8
 *     16K    0.032/0.013  0.123/0.040  0.283/0.096  0.99/0.26
 *     64K    0.040/0.041  0.175/0.125  0.402/0.263  1.06/0.53
 *     256K   0.196/0.134  0.389/0.309  0.665/0.774  1.61/1.47
 *     1M     0.573/0.479  1.319/1.243  2.363/2.605  7.68/9.76
 *     4M     3.60/3.24    6.59/8.20    11.2/12.4    23.9/43.7
 *   A second series under heavier load put the crossover for n >= 3
 *   between 64K and 256K. DEFAULT_SMALL_BYTES = 256 KiB: within 20% of
 *   the better algorithm at the crossover for every n. Two members gain
 *   from doubling up to 1-4 MiB (it is one exchange), by <= 1.4x; not
 *   worth a second threshold.
 *
 *   Segment size, 64 MiB busbw for 64K, 128K, 256K, 512K, 1M, 4M: no
 *   difference beyond the noise at n=2 or n=4; 256 KiB (Gloo uses 1 MiB)
 *   keeps the staging small. Fixed SO_SNDBUF/SO_RCVBUF of 1 or 4 MiB and
 *   SO_RCVLOWAT were no better than the kernel's autotuning; left out.
 *
 * The window length and the spinning before poll were measured too: see
 * ring.c and conn.c. How frames are checked and how a call is aborted or
 * times out is in conn.c; how greetings are judged, in acceptor.c. */
#include "engine/allreduce.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <openssl/crypto.h>

#include "base/clock.h"
#include "base/ident.h"
#include "base/log.h"
#include "base/secret.h"
#include "engine/acceptor.h"
#include "engine/allreduce_impl.h"
#include "engine/butterfly.h"
#include "engine/conn.h"
#include "engine/doubling.h"
#include "engine/peerwire.h"
#include "engine/ring.h"

/* Measured defaults: see the table at the top of this file. */
#define DEFAULT_SEGMENT_BYTES ((size_t)256 << 10)
#define DEFAULT_SMALL_BYTES ((size_t)256 << 10)
#define MAX_SEGMENT_BYTES ((size_t)64 << 20)
#define MAX_SMALL_BYTES ALLREDUCE_SMALL_MAX

/* Recursive doubling's scratch: small_bytes and a rider. A call chooses
 * by its payload, the elements before its rider (allreduce_run_rider),
 * so the Accumulator's counters behind gradients of up to small_bytes
 * keep the call in recursive doubling: appending them changes no exchange
 * (allreduce_same_exchanges) and they ride with no copy, whatever the
 * gradients' length. */
static size_t doubling_cap(size_t small)
{
    return small + ALLREDUCE_RIDER_MAX_BYTES;
}

#define ABORT_GRACE_MS 50       /* finishing half-sent frames before a BYE */

_Static_assert(MAX_NEED + 1 >= ALLREDUCE_PARTS_MAX,
               "a butterfly member may talk to every other member");

static uint64_t newest_epoch(struct allreduce *a)
{
    uint64_t n;

    pthread_mutex_lock(&a->mu);
    n = a->epoch ? a->epoch->number : 0;
    pthread_mutex_unlock(&a->mu);
    return n;
}

int allreduce_listen(const char *host, int *fd, char *address, size_t address_len)
{
    struct sockaddr_storage ss = { 0 };
    socklen_t sl;
    int s, rc, n;

    if (!host || !fd || !address)
        return -EINVAL;
    if (inet_pton(AF_INET, host, &((struct sockaddr_in *)&ss)->sin_addr) == 1) {
        ss.ss_family = AF_INET;
        sl = sizeof(struct sockaddr_in);
    } else if (inet_pton(AF_INET6, host, &((struct sockaddr_in6 *)&ss)->sin6_addr) == 1) {
        ss.ss_family = AF_INET6;
        sl = sizeof(struct sockaddr_in6);
    } else {
        return -EINVAL;
    }
    s = socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s < 0)
        return -errno;
    if (bind(s, (struct sockaddr *)&ss, sl) < 0 || listen(s, 128) < 0 ||
        getsockname(s, (struct sockaddr *)&ss, &sl) < 0) {
        rc = -errno;
        goto err_socket;
    }
    if (ss.ss_family == AF_INET)
        n = snprintf(address, address_len, "%s:%u", host,
                     ntohs(((struct sockaddr_in *)&ss)->sin_port));
    else
        n = snprintf(address, address_len, "[%s]:%u", host,
                     ntohs(((struct sockaddr_in6 *)&ss)->sin6_port));
    if (n < 0 || (size_t)n >= address_len) {
        rc = -EINVAL;
        goto err_socket;
    }
    *fd = s;
    return 0;
err_socket:
    close(s);
    return rc;
}


/* --- engine lifecycle --------------------------------------------------- */

/* What allreduce_create allocates before the acceptor starts, and the
 * struct; descriptors not yet opened are -1. */
static void engine_free(struct allreduce *a)
{
    if (a->abort_fd >= 0)
        close(a->abort_fd);
    if (a->wake_fd >= 0)
        close(a->wake_fd);
    if (a->inbox_fd >= 0)
        close(a->inbox_fd);
    free(a->rd_a);
    free(a->rd_b);
    free(a->stage);
    free(a->id);
    free(a->cohort);
    secret_wipe(&a->key);
    free(a);
}

int allreduce_create(const struct allreduce_config *cfg, struct allreduce **out)
{
    struct allreduce *a;
    size_t seg, small;
    int rc, fl;

    if (!cfg || !out)
        return -EINVAL;
    seg = cfg->segment_bytes ? cfg->segment_bytes : DEFAULT_SEGMENT_BYTES;
    small = cfg->small_bytes ? cfg->small_bytes : DEFAULT_SMALL_BYTES;
    if (!ident_valid_cohort(cfg->cohort) || !ident_valid_member_id(cfg->member_id) ||
        cfg->listen_fd < 0 || seg % 8 != 0 || seg > MAX_SEGMENT_BYTES ||
        (small != ALLREDUCE_SMALL_NONE && small > MAX_SMALL_BYTES) ||
        (cfg->integrity_mac && !cfg->key))
        return -EINVAL;
    /* The registration table comes with the struct. */
    a = calloc(1, sizeof(*a) + ALLREDUCE_MAX_BUFFERS * sizeof(a->regs[0]));
    if (!a)
        return -ENOMEM;
    a->listen_fd = cfg->listen_fd;
    a->timeout_ms = cfg->member_timeout_ms ? cfg->member_timeout_ms : ALLREDUCE_DEFAULT_TIMEOUT_MS;
    a->seg_bytes = seg;
    a->small_bytes = small;
    a->abort_fd = a->wake_fd = a->inbox_fd = -1;
    if (cfg->key) {
        a->key = *cfg->key;
        a->keyed = true;
        a->integrity = cfg->integrity_mac;
    }
    /* Tells this engine's greetings from those of an earlier one under
     * the same id: see "REPLACEMENT" in acceptor.c. */
    rc = secret_random(&a->incarnation, sizeof(a->incarnation));
    if (rc < 0)
        goto err_alloc;
    rc = -ENOMEM;
    a->cohort = strdup(cfg->cohort);
    a->id = strdup(cfg->member_id);
    a->slot_bytes = ring_slot_bytes(seg);
    a->stage = malloc((SLOTS + 2) * a->slot_bytes);
    if (!a->cohort || !a->id || !a->stage)
        goto err_alloc;
    if (small != ALLREDUCE_SMALL_NONE) {
        a->rd_a = malloc(doubling_cap(small));
        a->rd_b = malloc(doubling_cap(small));
        if (!a->rd_a || !a->rd_b)
            goto err_alloc;
    }
    a->cohort_hash = peerwire_cohort_hash(a->cohort);
    a->on_peer_lost = cfg->on_peer_lost;
    a->peer_lost_arg = cfg->peer_lost_arg;
    a->on_peer_unreachable = cfg->on_peer_unreachable;
    a->peer_unreachable_arg = cfg->peer_unreachable_arg;
    a->abort_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    a->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    a->inbox_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (a->abort_fd < 0 || a->wake_fd < 0 || a->inbox_fd < 0) {
        rc = -errno;
        goto err_alloc;
    }
    fl = fcntl(a->listen_fd, F_GETFL);
    if (fl < 0 || fcntl(a->listen_fd, F_SETFL, fl | O_NONBLOCK) < 0) {
        rc = -EINVAL;
        goto err_alloc;
    }
    pthread_mutex_init(&a->mu, NULL);
    atomic_init(&a->gen, 0);
    atomic_init(&a->running, false);
    rc = acceptor_start(a);
    if (rc < 0)
        goto err_mutex;
    *out = a;
    return 0;
err_mutex:
    pthread_mutex_destroy(&a->mu);
err_alloc:
    engine_free(a);
    return rc;
}

void allreduce_destroy(struct allreduce *a)
{
    if (!a)
        return;
    acceptor_stop(a);
    conn_close_all(a, -ECONNRESET, newest_epoch(a), clock_now_ms());
    free(a->conns);
    epoch_unref(a->conn_epoch);
    for (size_t i = 0; i < a->n_inbox; i++)
        close(a->inbox[i].fd);
    OPENSSL_cleanse(a->inbox, a->n_inbox * sizeof(a->inbox[0]));    /* frame keys */
    epoch_unref(a->epoch);
    pthread_mutex_destroy(&a->mu);
    engine_free(a);
}

void allreduce_set_unreachable_ms(struct allreduce *a, uint32_t ms)
{
    atomic_store(&a->unreach_ms, ms && ms < REACH_MIN_MS ? REACH_MIN_MS : ms);
}

void allreduce_set_call_deadline(struct allreduce *a, uint64_t deadline_ms)
{
    a->call_deadline_ms = deadline_ms;
}

int allreduce_set_epoch(struct allreduce *a, struct epoch *e)
{
    uint64_t one = 1;
    struct epoch *old;

    if (!a || !e || strcmp(e->cohort, a->cohort) != 0)
        return -EINVAL;
    pthread_mutex_lock(&a->mu);
    if (a->epoch && e->number <= a->epoch->number) {
        int rc = e->number == a->epoch->number ? 0 : -EINVAL;
        pthread_mutex_unlock(&a->mu);
        return rc;
    }
    old = a->epoch;
    a->epoch = epoch_ref(e);
    atomic_fetch_add(&a->gen, 1);
    /* Idle: tell the old epoch's peers now rather than at our next call.
     * Running: the call sees the generation move and does it itself. */
    if (!atomic_load(&a->running))
        conn_close_all(a, -ESTALE, e->number, clock_now_ms());
    pthread_mutex_unlock(&a->mu);
    if (write(a->abort_fd, &one, sizeof(one)) < 0 || write(a->wake_fd, &one, sizeof(one)) < 0) {
        /* eventfd counters do not overflow at one write per epoch */
    }
    log_debug(COMPONENT, "Adopted an epoch.", LF_S("cohort", a->cohort), LF_U("epoch", e->number),
              LF_U("members", e->n_members));
    epoch_unref(old);
    return 0;
}

int allreduce_register(struct allreduce *a, void *buf, size_t bytes)
{
    if (!a || (!buf && bytes > 0) || (uintptr_t)buf % 8 != 0)
        return -EINVAL;
    for (int i = 0; i < ALLREDUCE_MAX_BUFFERS; i++)
        if (!a->regs[i].used) {
            a->regs[i] = (struct reg){ .buf = buf, .bytes = bytes, .used = true };
            return i;
        }
    return -ENOSPC;
}

int allreduce_unregister(struct allreduce *a, int handle)
{
    if (!a || handle < 0 || handle >= ALLREDUCE_MAX_BUFFERS || !a->regs[handle].used)
        return -EINVAL;
    a->regs[handle].used = false;
    return 0;
}

bool allreduce_busy(const struct allreduce *a)
{
    return atomic_load(&((struct allreduce *)(uintptr_t)a)->running);
}

/* --- one call ----------------------------------------------------------- */

/* Alone in the epoch: only the scaling is left to do. 16-bit buffers are
 * scaled through a staging slot, one segment at a time. */
static void run_alone(struct run *x)
{
    size_t seg = x->a->seg_bytes / sizeof(float);

    if (!x->wide) {
        dtype_scale(x->acc, x->buf, x->count, x->div);
        /* The result is what a cohort would give: decode(encode(r)). */
        for (size_t i = 0; x->coded && i < x->count; i += seg)
            codec_round_trip(x->codec, (float *)x->buf + i, x->a->stage,
                             x->count - i < seg ? x->count - i : seg);
        return;
    }
    for (size_t i = 0; i < x->count && x->div != 1; i += seg) {
        size_t len = x->count - i < seg ? x->count - i : seg;
        float *tmp = (float *)x->a->stage;
        uint16_t *p = (uint16_t *)x->buf + i;

        dtype_widen(x->type, tmp, p, len);
        dtype_scale(DTYPE_F32, tmp, len, x->div);
        dtype_narrow(x->type, p, tmp, len);
    }
}

/* Points the connection table at epoch e, closing the old epoch's. */
static int table_reset(struct allreduce *a, struct epoch *e)
{
    struct conn **conns = calloc(e->n_members, sizeof(*conns));

    if (!conns)
        return -ENOMEM;
    conn_close_all(a, -ESTALE, e->number, clock_now_ms());
    free(a->conns);
    epoch_unref(a->conn_epoch);
    a->conns = conns;
    a->conn_epoch = epoch_ref(e);
    return 0;
}

/* --- dispatch ----------------------------------------------------------- */

enum algorithm_id { ALGORITHM_RING, ALGORITHM_DOUBLING, ALGORITHM_BUTTERFLY };

struct algorithm {
    const char *name;
    /* The members that member `me` of `n` talks to, into need[] (MAX_NEED);
     * NULL for the butterfly, whose peers depend on the call's parts. */
    size_t (*needs)(size_t n, size_t me, size_t *need);
    int (*run)(struct run *x);
    bool in_place;              /* reduces in buf alone: a separate contribution
                                 * is copied there first */
};

static const struct algorithm algorithms[] = {
    [ALGORITHM_RING] = { .name = "ring", .needs = ring_needs, .run = ring_run, .in_place = false },
    [ALGORITHM_DOUBLING] = { .name = "doubling", .needs = doubling_needs, .run = doubling_run,
                             .in_place = true },
    [ALGORITHM_BUTTERFLY] = { .name = "butterfly", .needs = NULL, .run = butterfly_run,
                              .in_place = false },
};

/* Whether a payload of `count` elements of accumulation size `asz`
 * (`coded` bytes on the wire, when coded; else 0), a rider aside, takes
 * recursive doubling: up to small_bytes. The scratch holds a rider more
 * (doubling_cap). */
static bool doubling_fits(const struct allreduce *a, size_t count, size_t asz, size_t coded)
{
    if (a->small_bytes == ALLREDUCE_SMALL_NONE)
        return false;
    return count <= a->small_bytes / asz && coded <= a->small_bytes;
}

/* The one place a call's algorithm is chosen: the butterfly when the caller
 * gave parts (allreduce_run_parts), else recursive doubling up to
 * small_bytes of payload on the wire (its rider aside), the ring beyond.
 * Every member of an epoch runs one build, so all choose alike: mixed
 * versions are not served (docs/architecture.md, "Heartbeats"). */
static const struct algorithm *choose_algorithm(const struct allreduce *a, const struct run *x)
{
    /* Coded, the scratch must hold the encoded buffer too (int8 of one
     * element is 5 bytes); a coded call has no rider. */
    bool small = doubling_fits(a, x->count - x->rider, x->asz,
                               x->coded ? codec_bytes(x->codec, x->count) : 0);

    if (x->parts)
        return &algorithms[ALGORITHM_BUTTERFLY];    /* its caller chose it by giving parts */
    return &algorithms[small ? ALGORITHM_DOUBLING : ALGORITHM_RING];
}

static int run_call(struct run *x)
{
    struct allreduce *a = x->a;
    const struct algorithm *alg;
    size_t need[MAX_NEED], n_need;
    long me;
    int rc;

    if (!x->e)
        return -ESTALE;
    me = epoch_find(x->e, a->id);
    if (me < 0)
        return -ESTALE;
    x->me = (size_t)me;
    x->n = x->e->n_members;
    if (x->parts && x->n_parts != x->n)
        return -ESTALE;         /* parts for another group: the epoch moved */
    rc = dtype_divisor(x->type, x->op, x->n, x->div, &x->div);
    if (rc < 0)
        return rc;
    if (x->count == 0)
        return 0;
    alg = choose_algorithm(a, x);
    /* Alone, and an algorithm that reduces in place (recursive doubling,
     * small buffers only), copying the contribution first costs little. */
    if ((x->n == 1 || alg->in_place) && x->src != x->buf) {
        memcpy(x->buf, x->src, x->count * x->esz);
        x->src = x->buf;
    }
    if (x->n == 1) {
        run_alone(x);
        return 0;
    }
    if (a->conn_epoch != x->e) {
        rc = table_reset(a, x->e);
        if (rc < 0)
            return rc;
    }
    /* Once per algorithm and engine: what a cohort's setting (or the
     * threshold) chose shows in the log without a line per call. */
    if (!a->alg_used[alg - algorithms]) {
        a->alg_used[alg - algorithms] = true;
        log_info(COMPONENT, "First all-reduce with this algorithm.", LF_S("cohort", a->cohort),
                 LF_S("algorithm", alg->name), LF_U("members", x->n),
                 LF_U("bytes", x->count * x->asz));
    }
    n_need = alg->needs ? alg->needs(x->n, x->me, need) : butterfly_needs(x, need);
    x->started = clock_now_ms();
    rc = conn_connect_peers(x, need, n_need);
    if (rc == 0)
        rc = alg->run(x);
    conn_probes_close(a);
    if (rc < 0) {
        log_warn(COMPONENT, "All-reduce failed.", LF_S("cohort", a->cohort),
                 LF_U("epoch", x->e->number), LF_U("round", x->round), LF_ERR(rc),
                 LF_S("peer", x->fail_peer < x->n ? x->e->members[x->fail_peer].id : NULL));
        conn_close_all(a, rc, newest_epoch(a), clock_now_ms() + ABORT_GRACE_MS);
        if (x->peer_reset && x->fail_peer < x->n && x->fail_peer != x->me && a->on_peer_lost)
            a->on_peer_lost(a->peer_lost_arg, x->e->members[x->fail_peer].id);
    }
    return rc;
}

static bool handle_ok(const struct allreduce *a, int h)
{
    return h >= 0 && h < ALLREDUCE_MAX_BUFFERS && a->regs[h].used;
}

int allreduce_run(struct allreduce *a, int handle, size_t count, enum dtype type,
                  enum dtype_op op, double denominator, uint64_t round)
{
    return allreduce_run_into(a, handle, handle, count, type, op, denominator, round);
}

int allreduce_run_into(struct allreduce *a, int in, int out, size_t count, enum dtype type,
                       enum dtype_op op, double denominator, uint64_t round)
{
    return allreduce_run_codec(a, in, out, count, type, op, denominator, CODEC_NONE, round);
}

/* Claims the engine for call x and pins the epoch it runs in; -EBUSY
 * when another call holds it. run_finish() undoes it. */
static int run_claim(struct run *x)
{
    struct allreduce *a = x->a;

    pthread_mutex_lock(&a->mu);
    if (atomic_load(&a->running)) {
        pthread_mutex_unlock(&a->mu);
        return -EBUSY;
    }
    atomic_store(&a->running, true);
    x->e = epoch_ref(a->epoch);
    x->gen = atomic_load(&a->gen);
    pthread_mutex_unlock(&a->mu);
    return 0;
}

static void run_finish(struct run *x)
{
    pthread_mutex_lock(&x->a->mu);
    atomic_store(&x->a->running, false);
    pthread_mutex_unlock(&x->a->mu);
    epoch_unref(x->e);
}

/* One call from registered buffer `in` into `out`, both checked to hold
 * x->count elements of x->esz bytes. */
static int run_buffers(struct run *x, int in, int out)
{
    const struct allreduce *a = x->a;
    int rc;

    x->buf = a->regs[out].buf;
    x->src = a->regs[in].buf;
    if (x->count > a->regs[in].bytes / x->esz || x->count > a->regs[out].bytes / x->esz)
        return -EINVAL;
    rc = run_claim(x);
    if (rc < 0)
        return rc;
    rc = run_call(x);
    run_finish(x);
    return rc;
}

/* One call over the whole buffer (not the butterfly): allreduce_run_rider
 * and allreduce_run_codec; a coded call has no rider. */
static int run_single(struct allreduce *a, int in, int out, size_t count, size_t rider,
                      enum dtype type, enum dtype_op op, double denominator, enum codec codec,
                      uint64_t round)
{
    struct run x = { .a = a, .round = round, .count = count, .rider = rider, .type = type,
                     .op = op, .div = denominator, .codec = codec,
                     .coded = codec != CODEC_NONE, .fail_peer = SIZE_MAX };

    if (!a || !handle_ok(a, in) || !handle_ok(a, out) || !dtype_valid((int)type) ||
        !dtype_op_valid((int)op) || !codec_valid((int)codec) || !codec_supports(codec, type))
        return -EINVAL;
    if (rider > count || rider > ALLREDUCE_RIDER_MAX_BYTES / dtype_size(dtype_acc(type)))
        return -EINVAL;
    /* A staging slot is one segment: a whole segment's encoding must fit
     * it (meanstd16's 8 bytes of mean and deviation do from 16 bytes on,
     * uniform8's and quantile8's codebook of 1024 from 1368). */
    if (codec_bytes(codec, a->seg_bytes / sizeof(float)) > a->seg_bytes)
        return -EINVAL;
    x.esz = dtype_size(type);
    x.acc = dtype_acc(type);
    x.asz = dtype_size(x.acc);
    x.wide = dtype_is_16bit_float(type);
    return run_buffers(&x, in, out);
}

int allreduce_run_rider(struct allreduce *a, int in, int out, size_t count, size_t rider,
                        enum dtype type, enum dtype_op op, double denominator, uint64_t round)
{
    return run_single(a, in, out, count, rider, type, op, denominator, CODEC_NONE, round);
}

int allreduce_run_codec(struct allreduce *a, int in, int out, size_t count, enum dtype type,
                        enum dtype_op op, double denominator, enum codec codec, uint64_t round)
{
    return run_single(a, in, out, count, 0, type, op, denominator, codec, round);
}

int allreduce_run_parts(struct allreduce *a, int in, int out, size_t count, enum dtype type,
                        enum dtype_op op, double denominator, const size_t *parts,
                        size_t n_parts, uint64_t round)
{
    return allreduce_run_parts_codec(a, in, out, count, type, op, denominator, parts, n_parts,
                                     CODEC_NONE, round);
}

int allreduce_run_parts_codec(struct allreduce *a, int in, int out, size_t count,
                              enum dtype type, enum dtype_op op, double denominator,
                              const size_t *parts, size_t n_parts, enum codec codec,
                              uint64_t round)
{
    struct run x = { .a = a, .round = round, .count = count, .type = type, .op = op,
                     .div = denominator, .codec = codec, .coded = codec != CODEC_NONE,
                     .parts = parts, .n_parts = n_parts, .fail_peer = SIZE_MAX };
    size_t sum = 0;
    bool any = false;

    if (!a || !handle_ok(a, in) || !handle_ok(a, out) || !dtype_valid((int)type) ||
        !dtype_op_valid((int)op) || dtype_is_16bit_float(type) || !parts || n_parts == 0 ||
        n_parts > ALLREDUCE_PARTS_MAX || !codec_valid((int)codec) || !codec_supports(codec, type))
        return -EINVAL;
    /* A contribution's segment is received, encoded, into a staging slot
     * of one segment (as in allreduce_run_codec). */
    if (codec_bytes(codec, a->seg_bytes / sizeof(float)) > a->seg_bytes)
        return -EINVAL;
    for (size_t i = 0; i < n_parts; i++) {
        if (parts[i] > count - sum)
            return -EINVAL;
        sum += parts[i];
        any |= parts[i] > 0;
    }
    if (sum != count || (count > 0 && !any))
        return -EINVAL;
    x.esz = x.asz = dtype_size(type);
    x.acc = dtype_acc(type);
    return run_buffers(&x, in, out);
}

static int cmp_double(const void *x, const void *y)
{
    double a = *(const double *)x, b = *(const double *)y;

    return (a > b) - (a < b);
}

/* hivemind's load-balancing program (optimize_parts_lp), solved exactly.
 * In a butterfly of g members, member i sends its vector out and takes
 * back the average, and reduces a fraction w_i of it for the g - 1
 * others: 1 + (g - 2) w_i vectors through its link, so the round takes
 * max_i (1 + (g - 2) w_i) / b_i over the members of bandwidth b_i > 0;
 * a member of bandwidth 0 reduces nothing. The program asks for the w
 * (nonnegative, at most 1, summing to 1) that make it least.
 *
 * For a bound T on the round, member i may reduce up to
 * c_i(T) = clamp((T b_i - 1) / (g - 2), 0, 1), and sum_i c_i(T) grows
 * continuously and piecewise linearly in T, with kinks at 1 / b_i and
 * (g - 1) / b_i. The T where it reaches 1 makes every reducing member
 * finish at once, and w_i = c_i(T) is optimal: no member's time exceeds
 * max(T, 1 / b_i), and no split does better, since lowering T leaves
 * less than the whole vector to reduce. Where the optimum has slack (a
 * slow member that only sends sets the time), the program has many
 * solutions: hivemind's interior-point solver returns one near the
 * middle, this the one that finishes the reducers soonest. For g <= 2
 * every split takes the same time, and shares stay proportional to the
 * bandwidths. Overwrites share[0..n) (resolved bandwidths, at least one
 * positive) with the w_i; deterministic, as allreduce_split must be. */
static void split_lp(double *share, size_t n)
{
    double kink[2 * ALLREDUCE_PARTS_MAX], g2 = (double)n - 2, t = 0, f_lo = 0, t_lo = 0;
    size_t k = 0;

    for (size_t i = 0; i < n; i++)
        if (share[i] > 0) {
            kink[k++] = 1.0 / share[i];
            kink[k++] = (g2 + 1) / share[i];
        }
    qsort(kink, k, sizeof(kink[0]), cmp_double);
    /* The first kink where the sum reaches 1; the sum is linear between
     * kinks, so T follows by interpolation. The last kink saturates every
     * member, where the sum is the number of them, at least 1: it is T
     * when rounding leaves the sum just short of 1 there. */
    t = kink[k - 1];
    for (size_t j = 0; j < k; j++) {
        double f = 0;

        for (size_t i = 0; i < n; i++)
            if (share[i] > 0) {
                double c = (kink[j] * share[i] - 1) / g2;

                f += c < 0 ? 0 : c > 1 ? 1 : c;
            }
        if (f >= 1) {
            t = f > f_lo ? t_lo + (1 - f_lo) * (kink[j] - t_lo) / (f - f_lo) : kink[j];
            break;
        }
        f_lo = f;
        t_lo = kink[j];
    }
    for (size_t i = 0; i < n; i++) {
        double c = share[i] > 0 ? (t * share[i] - 1) / g2 : 0;

        share[i] = c < 0 ? 0 : c > 1 ? 1 : c;
    }
}

int allreduce_split(size_t count, const double *bandwidth, size_t n, size_t min_part,
                    size_t *parts)
{
    double share[ALLREDUCE_PARTS_MAX], given = 0, total = 0, most = 0, floor_share;
    size_t n_given = 0, left = count;

    if (!bandwidth || !parts || n == 0 || n > ALLREDUCE_PARTS_MAX)
        return -EINVAL;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(bandwidth[i]))
            return -EINVAL;
        if (bandwidth[i] > 0) {
            given += bandwidth[i];
            n_given++;
        }
    }
    /* hivemind's rule for bandwidths not given (load_balance_peers). */
    for (size_t i = 0; i < n; i++) {
        share[i] = bandwidth[i] >= 0 ? bandwidth[i] : n_given ? given / (double)n_given : 1.0;
        total += share[i];
    }
    if (!(total > 0))
        return -ENODATA;
    /* With a bandwidth given, hivemind's program decides the shares;
     * with none, those not given share alike. */
    if (n_given > 0 && n > 2) {
        split_lp(share, n);
        total = 0;
        for (size_t i = 0; i < n; i++)
            total += share[i];
    }
    /* hivemind's min_vector_size: shares too small to be worth a part
     * are dropped, if any share is large enough. */
    floor_share = (double)min_part / (double)(count ? count : 1);
    for (size_t i = 0; i < n; i++)
        most = share[i] > most ? share[i] : most;
    if (min_part && most / total >= floor_share) {
        double kept = 0;

        for (size_t i = 0; i < n; i++) {
            if (share[i] / total < floor_share)
                share[i] = 0;
            kept += share[i];
        }
        total = kept;
    }
    for (size_t i = 0; i < n; i++) {
        double f = floor((double)count * (share[i] / total));
        size_t k = f < (double)left ? (size_t)f : left;

        parts[i] = k;
        left -= k;
    }
    /* At most n elements are left; each goes to the largest quotient. */
    while (left > 0) {
        size_t best = SIZE_MAX;
        double q = 0;

        for (size_t i = 0; i < n; i++) {
            double qi = share[i] / (double)(parts[i] + 1);

            if (share[i] > 0 && (best == SIZE_MAX || qi > q)) {
                best = i;
                q = qi;
            }
        }
        parts[best]++;
        left--;
    }
    return 0;
}

/* The gather is an all-reduce in disguise: every member zeroes the
 * others' blocks and sums 32-bit integers, and x + 0 is exact for every
 * bit pattern (integer sums wrap, so nothing can overflow into a
 * neighbour, and float bits are never interpreted). It moves twice the
 * bytes a ring all-gather would (a ring all-reduce of B bytes sends
 * 2(n-1)/n B per member; an all-gather of the same B, (n-1)/n B), in
 * exchange for the schedules, checks, abort and timeouts the all-reduce
 * already has. The epoch is pinned before the blocks are placed, so
 * every member places its block by the same epoch its run uses. */
int allreduce_gather(struct allreduce *a, int in, int out, size_t block_bytes, uint64_t round,
                     size_t *members, size_t *index)
{
    struct run x = { .a = a, .round = round, .type = DTYPE_I32, .op = DTYPE_SUM, .div = 1,
                     .codec = CODEC_NONE, .fail_peer = SIZE_MAX };
    long me;
    size_t n;
    int rc;

    if (!a || !handle_ok(a, in) || !handle_ok(a, out) || block_bytes % 4 != 0 ||
        block_bytes > a->regs[in].bytes)
        return -EINVAL;
    x.esz = x.asz = sizeof(int32_t);
    x.acc = DTYPE_I32;
    x.buf = a->regs[out].buf;
    rc = run_claim(&x);
    if (rc < 0)
        return rc;
    me = x.e ? epoch_find(x.e, a->id) : -1;
    if (me < 0) {
        rc = -ESTALE;
        goto finish;
    }
    n = x.e->n_members;
    if (members)
        *members = n;
    if (index)
        *index = (size_t)me;
    if (block_bytes > 0 && n > a->regs[out].bytes / block_bytes) {
        rc = -ENOSPC;
        goto finish;
    }
    /* Own block first: in and out may be the same buffer. */
    memmove(x.buf + (size_t)me * block_bytes, a->regs[in].buf, block_bytes);
    memset(x.buf, 0, (size_t)me * block_bytes);
    memset(x.buf + ((size_t)me + 1) * block_bytes, 0, (n - (size_t)me - 1) * block_bytes);
    x.src = x.buf;
    x.count = n * block_bytes / sizeof(int32_t);
    rc = run_call(&x);
finish:
    run_finish(&x);
    return rc;
}

bool allreduce_same_exchanges(const struct allreduce *a, size_t n, size_t count, size_t extra,
                              enum dtype type, bool into)
{
    size_t asz, seg;

    if (!a || !dtype_valid((int)type) || count > SIZE_MAX - extra)
        return false;
    if (n < 2 || extra == 0)
        return true;
    asz = dtype_size(dtype_acc(type));
    if (extra > ALLREDUCE_RIDER_MAX_BYTES / asz)
        return false;
    /* As choose_algorithm() decides, for an uncompressed call: on the
     * payload, the same with its rider. Recursive doubling sends the
     * whole buffer once per step. 16-bit types run the ring with shorter
     * windows: not counted here. */
    if (doubling_fits(a, count, asz, 0))
        return true;
    if (dtype_is_16bit_float(type))
        return false;
    seg = a->seg_bytes / asz;
    return ring_segments(n, count, seg, ring_staged(into, count * asz)) ==
           ring_segments(n, count + extra, seg, ring_staged(into, (count + extra) * asz));
}

size_t allreduce_members(struct allreduce *a)
{
    size_t n = 0;

    pthread_mutex_lock(&a->mu);
    if (a->epoch && epoch_find(a->epoch, a->id) >= 0)
        n = a->epoch->n_members;
    pthread_mutex_unlock(&a->mu);
    return n;
}


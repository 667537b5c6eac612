/* src/accumulator/link_sidecar.c: the Accumulator's link to a sidecar.
 *
 * Every request is one small fixed-size message and its reply; tensor
 * bytes never cross the socket, and opaque state travels as a memfd. The
 * sidecar publishes the view into the shared page before it answers, so
 * update() reads the page with no call. CONSUME is the one request with
 * no reply: zero_gradients() must not wait for the sidecar. Until a later
 * reply shows the sidecar has read it, a page that still holds the
 * consumed round is corrected here, so a result is never seen twice.
 *
 * CONTRIBUTE and CONSUME take the page's doorbell instead (viewpage.h)
 * while the node's thread listens there, as it does for a moment after
 * each round: the node takes them itself, with no message and no wake of
 * the sidecar's link thread on a round's path. */
#include "accumulator/link_sidecar.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "base/clock.h"
#include "base/limits.h"
#include "accumulator/layout.h"

#define REPLY_TIMEOUT_MS 30000

struct sidecar {
    struct link link;               /* first: the ops */
    const struct link_memory *mem;
    int sock;                       /* -1 once lost */
    bool answered;                  /* the last request was answered, or a one-way one
                                     * taken: the sidecar is alive, no need to look */
    bool consume_posted;            /* the sidecar may not have read it yet */
    bool one_way_unread;            /* a CONSUME went on the socket and no reply
                                     * followed: the doorbell would pass it */
    uint64_t consumed_round;        /* the rounds_committed it consumes */
};

static struct sidecar *of(struct link *l)
{
    return (struct sidecar *)l;
}

/* The link is broken or the sidecar misbehaved: it is dropped for good. */
static void lost(struct sidecar *s)
{
    if (s->sock >= 0)
        close(s->sock);
    s->sock = -1;
    s->consume_posted = false;
    s->one_way_unread = false;
    s->answered = false;
}

/* A status is 0 or a negative errno (-4095, the kernel's MAX_ERRNO, at
 * most): anything else would reach the trainer as neither. */
static bool is_status(int64_t status)
{
    return status <= 0 && status >= -4095;
}

/* One request and its reply. A dead sidecar is -ENOTCONN from here on. */
static int call(struct sidecar *s, uint16_t type, const void *body, uint32_t len, const int *fds,
                int nfds, void *out, long out_len, int *fd_out)
{
    struct tlink_hdr h;
    char buf[TLINK_BODY_MAX];
    int got[TLINK_FDS_MAX], ngot = 0, rc;

    if (s->sock < 0)
        return -ENOTCONN;
    rc = tlink_send(s->sock, type, 0, body, len, fds, nfds);
    if (rc == 0)
        rc = tlink_recv(s->sock, &h, buf, sizeof(buf), -1, got, &ngot, REPLY_TIMEOUT_MS);
    if (rc < 0) {
        lost(s);
        return rc == -EPROTO ? -EPROTO : -ENOTCONN;
    }
    /* The sidecar read every request before this one, a one-way consume
     * included, and published their effects before it answered. */
    s->consume_posted = false;
    s->one_way_unread = false;
    s->answered = true;
    if (h.type != TL_REPLY || !is_status(h.status) ||
        (h.status == 0 && out_len >= 0 && h.len != (uint32_t)out_len)) {
        for (int i = 0; i < ngot; i++)
            close(got[i]);
        return -EPROTO;
    }
    /* Only a success's body is known to have the size the caller wants;
     * a refusal's, of any size, is not copied. */
    if (out && h.len && h.status == 0)
        memcpy(out, buf, h.len);
    if (fd_out)
        *fd_out = ngot ? got[0] : -1;
    for (int i = fd_out ? 1 : 0; i < ngot; i++)
        close(got[i]);
    return h.status;
}

/* A request whose body is one u64. */
static int call_u64(struct sidecar *s, uint16_t type, uint64_t v)
{
    struct tlink_u64 u = { v };
    return call(s, type, &u, sizeof(u), NULL, 0, NULL, 0, NULL);
}

/* The sidecar never writes first: anything readable on its socket is the
 * end of it. */
static bool readable(const struct sidecar *s)
{
    struct pollfd p = { s->sock, POLLIN, 0 };

    return poll(&p, 1, 0) != 0;
}

/* A CONTRIBUTE or CONSUME through the doorbell. Returns 1 with *status
 * once the node's thread answered, 0 when it did not take the request (send
 * it on the socket), -ENOTCONN (the link is lost: the sidecar went away, or
 * did not answer within REPLY_TIMEOUT_MS, as a call), or -EPROTO (it broke
 * the bell's protocol). Not while a CONSUME sent on the socket may still be
 * unread: the socket keeps the order of requests, the bell would not. */
static int ring(struct sidecar *s, uint16_t type, uint64_t value, int *status)
{
    struct viewpage *p = link_shared_page(s->mem);
    uint64_t end;

    if (s->sock < 0)
        return -ENOTCONN;
    if (s->one_way_unread || viewpage_ring(p, type, value) == 0)
        return 0;
    end = clock_now_ms() + REPLY_TIMEOUT_MS;
    for (;;) {
        int64_t st;
        /* In slices: a sidecar that died after its take cannot answer. */
        int rc = viewpage_bell_wait(p, 50, &st);

        if (rc == 0 && is_status(st)) {
            s->answered = true;
            *status = (int)st;
            return 1;
        }
        if (rc != -ETIMEDOUT) {
            lost(s);
            return -EPROTO;
        }
        if (readable(s) || clock_now_ms() >= end) {
            lost(s);
            return -ENOTCONN;
        }
    }
}

static bool up(const struct link *l)
{
    return ((const struct sidecar *)l)->sock >= 0;
}

static bool gone(struct link *l)
{
    struct sidecar *s = of(l);

    s->answered = false;
    return s->sock < 0 || readable(s);
}

/* Every call before this one was answered, and the sidecar publishes
 * before it answers, so the shared view is at least as new as what those
 * calls did. A call is still needed when gradients must be dropped (the
 * sidecar zeroes them inside it), before the first publication, and to
 * find out that the sidecar is gone (no need to look right after it
 * answered). */
static int update(struct link *l, struct tlink_view *view)
{
    struct sidecar *s = of(l);
    bool look = !s->answered;
    struct tlink_view w;

    s->answered = false;
    if (s->sock >= 0 && !(look && readable(s)) &&
        viewpage_read(link_shared_page(s->mem), &w) == 0 && !w.drop_pending) {
        if (s->consume_posted && w.has_gradients && w.rounds_committed == s->consumed_round) {
            /* Published before the sidecar read our one-way consume. */
            w.has_gradients = false;
            w.wants_gradients = w.wants_after_consume;
        } else {
            s->consume_posted = false;
        }
        *view = w;
        return 0;
    }
    return call(s, TL_VIEW, NULL, 0, NULL, 0, view, sizeof(*view), NULL);
}

static int contribute(struct link *l, uint64_t batch_size)
{
    int status, rc = ring(of(l), TL_CONTRIBUTE, batch_size, &status);

    if (rc != 0)
        return rc < 0 ? rc : status;
    return call_u64(of(l), TL_CONTRIBUTE, batch_size);
}

static int consume(struct link *l, uint64_t round)
{
    struct sidecar *s = of(l);
    struct tlink_u64 u = { round };
    int status, rc = ring(s, TL_CONSUME, round, &status);

    /* Through the bell the node has consumed, and published, already. */
    if (rc != 0)
        return rc < 0 ? -ENOTCONN : 0;
    if (tlink_send(s->sock, TL_CONSUME, 0, &u, sizeof(u), NULL, 0) < 0) {
        lost(s);
        return -ENOTCONN;
    }
    /* Taken by the socket: the sidecar was there a moment ago, so the
     * refresh that follows need not look again. */
    s->consume_posted = true;
    s->one_way_unread = true;
    s->consumed_round = round;
    s->answered = true;
    return 0;
}

static int set_state(struct link *l, const void *state, size_t len)
{
    struct sidecar *s = of(l);
    struct tlink_u64 u = { len };
    int fd, rc;

    if (s->sock < 0)
        return -ENOTCONN;
    fd = tlink_memfd_from("cohort-state", state, len);
    if (fd < 0)
        return fd;
    rc = call(s, TL_SET_STATE, &u, sizeof(u), &fd, 1, NULL, 0, NULL);
    close(fd);
    return rc;
}

/* The shapes in a memfd, as state travels: a layout can be larger than
 * any message. */
static int set_tensor_shapes(struct link *l, const struct layout_shape *shapes, size_t k)
{
    struct sidecar *s = of(l);
    struct tlink_u64 u = { k };
    int fd, rc;

    if (s->sock < 0)
        return -ENOTCONN;
    fd = tlink_memfd_from("cohort-shapes", shapes, k * sizeof(*shapes));
    if (fd < 0)
        return fd;
    rc = call(s, TL_SET_SHAPES, &u, sizeof(u), &fd, 1, NULL, 0, NULL);
    close(fd);
    return rc;
}

static int take_state(struct link *l, void **state, size_t *len)
{
    struct tlink_u64 u;
    int rc, fd = -1;

    *state = NULL;
    rc = call(of(l), TL_TAKE_STATE, NULL, 0, NULL, 0, &u, sizeof(u), &fd);
    if (rc == 0 && fd < 0)
        rc = -EPROTO;
    if (rc == 0) {
        rc = tlink_memfd_read(fd, LIMIT_STATE_BYTES, state, len);
        if (rc == 0 && *len != u.value)
            rc = -EPROTO;
    }
    if (fd >= 0)
        close(fd);
    if (rc < 0) {
        free(*state);
        *state = NULL;
    }
    return rc;
}

static int set_model_version(struct link *l, uint64_t version)
{
    return call_u64(of(l), TL_SET_VERSION, version);
}

static int set_virtual_batch_size(struct link *l, uint64_t size)
{
    return call_u64(of(l), TL_SET_VBS, size);
}

static int set_parallel_gradients(struct link *l, unsigned n)
{
    return call_u64(of(l), TL_SET_PARALLEL, n);
}

static int set_compression(struct link *l, uint64_t packed)
{
    return call_u64(of(l), TL_SET_COMPRESSION, packed);
}

static void destroy(struct link *l)
{
    lost(of(l));                /* the sidecar's member leaves */
    free(l);
}

static const struct link_ops sidecar_ops = LINK_OPS("sidecar");

int link_sidecar_connect(const char *path, const struct link_memory *m, struct link **out)
{
    struct sockaddr_un sa = { .sun_family = AF_UNIX };
    struct tlink_hello hello = { .api_version = TLINK_VERSION };
    struct sidecar *s;
    int rc;

    if (strlen(path) >= sizeof(sa.sun_path))
        return -ENAMETOOLONG;
    memcpy(sa.sun_path, path, strlen(path) + 1);
    s = calloc(1, sizeof(*s));
    if (!s)
        return -ENOMEM;
    s->link.ops = &sidecar_ops;
    s->mem = m;
    s->sock = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (s->sock < 0) {
        rc = -errno;
        goto err;
    }
    if (connect(s->sock, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
        rc = -errno;
        goto err;
    }
    snprintf(hello.name, sizeof(hello.name), "%s", m->name);
    rc = call(s, TL_HELLO, &hello, sizeof(hello), NULL, 0, NULL, 0, NULL);
    if (rc == 0)
        rc = call(s, TL_REGISTER, m->layout, sizeof(*m->layout), (int[]){ m->memfd, m->devfd },
                  m->layout->mem == TL_MEM_CUDA_VMM ? 2 : 1, NULL, 0, NULL);
    if (rc < 0)
        goto err;
    *out = &s->link;
    return 0;
err:
    lost(s);
    free(s);
    return rc;
}

/* src/accumulator/tlink.c: see tlink.h. */
#include "accumulator/tlink.h"

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <poll.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "base/clock.h"
#include "accumulator/node.h"

long tlink_body_size(uint16_t type, bool reply)
{
    switch (type) {
    case TL_HELLO: return reply ? 0 : (long)sizeof(struct tlink_hello);
    case TL_REGISTER: return reply ? 0 : (long)sizeof(struct tlink_register);
    case TL_VIEW: return reply ? (long)sizeof(struct tlink_view) : 0;
    case TL_CONTRIBUTE:
    case TL_SET_VERSION:
    case TL_SET_VBS:
    case TL_SET_PARALLEL:
    case TL_SET_COMPRESSION:
    case TL_CONSUME: return reply ? 0 : (long)sizeof(struct tlink_u64);
    case TL_SET_STATE:
    case TL_SET_SHAPES: return reply ? 0 : (long)sizeof(struct tlink_u64);
    case TL_TAKE_STATE: return reply ? (long)sizeof(struct tlink_u64) : 0;
    default: return -1;
    }
}

bool tlink_one_way(uint16_t type)
{
    return type == TL_CONSUME;
}

int tlink_send(int sock, uint16_t type, int32_t status, const void *body, uint32_t len,
               const int *fds, int nfds)
{
    struct tlink_hdr h = { TLINK_MAGIC, TLINK_VERSION, type, len, status };
    struct iovec iov[2] = { { &h, sizeof(h) }, { (void *)body, len } };
    char cbuf[CMSG_SPACE(sizeof(int) * TLINK_FDS_MAX)];
    struct msghdr msg = { .msg_iov = iov, .msg_iovlen = len ? 2 : 1 };
    ssize_t n;

    if (len > TLINK_BODY_MAX || nfds < 0 || nfds > TLINK_FDS_MAX)
        return -EINVAL;
    if (nfds > 0) {
        struct cmsghdr *c;
        memset(cbuf, 0, sizeof(cbuf));
        msg.msg_control = cbuf;
        msg.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)nfds);
        c = CMSG_FIRSTHDR(&msg);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)nfds);
        memcpy(CMSG_DATA(c), fds, sizeof(int) * (size_t)nfds);
    }
    do {
        n = sendmsg(sock, &msg, MSG_NOSIGNAL);
    } while (n < 0 && errno == EINTR);
    if (n < 0)
        return errno == ECONNRESET || errno == ENOTCONN ? -EPIPE : -errno;
    return (size_t)n == sizeof(h) + len ? 0 : -EIO;
}

static void close_all(int *fds, int n)
{
    for (int i = 0; i < n; i++)
        close(fds[i]);
}

int tlink_wait(int sock, int timeout_ms)
{
    struct pollfd p = { sock, POLLIN, 0 };
    uint64_t from = clock_now_us();
    int rc;

    /* Each side answers the other within microseconds while a trainer is
     * in its loop; sleeping in poll would add a wakeup (tens of
     * microseconds on a busy machine) to every call. */
    do {
        rc = poll(&p, 1, 0);
        if (rc != 0)
            break;
        sched_yield();
    } while (clock_now_us() - from < TLINK_SPIN_US);
    while (rc == 0) {
        rc = poll(&p, 1, timeout_ms);
        if (rc == 0)
            return -ETIMEDOUT;
        if (rc < 0 && errno == EINTR)
            rc = 0;
    }
    if (rc < 0)
        return -errno;
    return 0;
}

int tlink_recv(int sock, struct tlink_hdr *h, void *body, uint32_t cap, long want, int *fds,
               int *nfds, int timeout_ms)
{
    char buf[sizeof(struct tlink_hdr) + TLINK_BODY_MAX + 1];
    /* Room for more descriptors than we accept, so extras can be closed. */
    char cbuf[CMSG_SPACE(sizeof(int) * 16)];
    struct iovec iov = { buf, sizeof(buf) };
    struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf,
                          .msg_controllen = sizeof(cbuf) };
    int got[16], ngot = 0, rc = 0;
    ssize_t n;

    *nfds = 0;
    rc = tlink_wait(sock, timeout_ms);
    if (rc < 0)
        return rc;
    do {
        n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
    } while (n < 0 && errno == EINTR);
    if (n < 0)
        return errno == ECONNRESET ? -ECONNRESET : -errno;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
            int k = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
            for (int i = 0; i < k && ngot < 16; i++)
                memcpy(&got[ngot++], CMSG_DATA(c) + (size_t)i * sizeof(int), sizeof(int));
        }
    }
    /* The peer hung up, or sent an empty message, which may still carry
     * descriptors: those are closed like any others refused. */
    if (n == 0) {
        rc = -ECONNRESET;
        goto bad;
    }
    /* A truncated message or descriptor list cannot be trusted. */
    if ((msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) || (size_t)n < sizeof(*h) || ngot > TLINK_FDS_MAX) {
        rc = -EPROTO;
        goto bad;
    }
    memcpy(h, buf, sizeof(*h));
    if (h->magic != TLINK_MAGIC || h->version != TLINK_VERSION ||
        h->len != (size_t)n - sizeof(*h) || h->len > cap || (want >= 0 && h->len != (uint32_t)want)) {
        rc = -EPROTO;
        goto bad;
    }
    memcpy(body, buf + sizeof(*h), h->len);
    memcpy(fds, got, sizeof(int) * (size_t)ngot);
    *nfds = ngot;
    return 0;
bad:
    close_all(got, ngot);
    return rc;
}

_Static_assert(sizeof(struct tlink_view) % 8 == 0, "the view is copied in 8-byte words");

void tlink_view_fill(struct tlink_view *w, const struct node_view *v)
{
    memset(w, 0, sizeof(*w));
    w->connected = v->connected;
    w->wants_state = v->wants_state;
    w->has_new_state = v->has_new_state;
    w->wants_gradients = v->wants_gradients;
    w->has_gradients = v->has_gradients;
    w->is_leader = v->is_leader;
    w->drop_pending = v->drop_pending;
    w->wants_after_consume = v->wants_after_consume;
    w->rank = v->rank;
    w->size = v->size;
    w->model_version = v->model_version;
    w->epoch = v->epoch;
    w->batch_size = v->batch_size;
    w->num_gradients = v->num_gradients;
    w->num_skipped = v->num_skipped;
    w->rounds_committed = v->rounds_committed;
    w->rounds_retried = v->rounds_retried;
    w->epochs_seen = v->epochs_seen;
    w->states_received = v->states_received;
    w->contributions_dropped = v->contributions_dropped;
    snprintf(w->leader, sizeof(w->leader), "%s", v->leader);
}


int tlink_memfd_from(const char *name, const void *data, size_t len)
{
    int fd = memfd_create(name, MFD_CLOEXEC);
    size_t off = 0;

    if (fd < 0)
        return -errno;
    while (off < len) {
        ssize_t w = write(fd, (const char *)data + off, len - off);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0) {
            close(fd);
            return w < 0 ? -errno : -EIO;
        }
        off += (size_t)w;
    }
    return fd;
}

int tlink_memfd_read(int fd, size_t cap, void **data, size_t *len)
{
    struct stat st;
    size_t off = 0, n;
    char *buf;

    if (fstat(fd, &st) < 0)
        return -errno;
    if (st.st_size < 0 || (uint64_t)st.st_size > cap)
        return -E2BIG;
    n = (size_t)st.st_size;
    buf = malloc(n ? n : 1);
    if (!buf)
        return -ENOMEM;
    while (off < n) {
        ssize_t r = pread(fd, buf + off, n - off, (off_t)off);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0) {
            free(buf);
            return -EIO;
        }
        off += (size_t)r;
    }
    *data = buf;
    *len = n;
    return 0;
}

uint64_t tlink_spare_after(const struct tlink_register *r, uint64_t end)
{
    uint64_t gbytes = r->grad_count * dtype_size((enum dtype)r->grad_dtype);
    struct {
        uint64_t off, len;
    } regions[] = {
        { r->params_off, r->params_bytes }, { r->grads_off, gbytes },
        { r->results_off, gbytes },         { r->buffers_off, r->buffers_bytes },
        /* The view page comes after every tensor (checked), so only where
         * it starts matters here. */
        { r->shared_off, 1 },
    };
    uint64_t next = r->region_bytes;

    if (end > r->region_bytes)
        return 0;
    for (size_t i = 0; i < sizeof(regions) / sizeof(regions[0]); i++) {
        if (regions[i].len == 0)
            continue;
        if (regions[i].off >= end) {
            if (regions[i].off < next)
                next = regions[i].off;
        } else if (regions[i].off + regions[i].len > end) {
            return 0;
        }
    }
    return next - end;
}

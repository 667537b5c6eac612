/* src/gpu/fdpass.c: see fdpass.h. */
#include "gpu/fdpass.h"

#include <errno.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

/* Room for one more descriptor than anyone may send, so that a message
 * with too many is seen whole (and refused) rather than cut to fit. */
#define CMSG_ROOM CMSG_SPACE(sizeof(int) * (FDPASS_MAX + 1))

int fdpass_send(int sock, const void *msg, size_t len, const int *fds, int nfds)
{
    union {
        char buf[CMSG_ROOM];
        struct cmsghdr align;
    } ctl;
    struct iovec iov = { .iov_base = (void *)msg, .iov_len = len };
    struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1 };
    ssize_t n;

    if (len == 0 || nfds < 0 || nfds > FDPASS_MAX || (nfds > 0 && !fds))
        return -EINVAL;
    if (nfds > 0) {
        struct cmsghdr *c;
        memset(&ctl, 0, sizeof(ctl));
        mh.msg_control = ctl.buf;
        mh.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)nfds);
        c = CMSG_FIRSTHDR(&mh);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)nfds);
        memcpy(CMSG_DATA(c), fds, sizeof(int) * (size_t)nfds);
    }
    do
        n = sendmsg(sock, &mh, MSG_NOSIGNAL);
    while (n < 0 && errno == EINTR);
    if (n < 0)
        return errno == ECONNRESET ? -EPIPE : -errno;
    /* A datagram or seqpacket socket sends all or nothing; a stream that
     * took part of it has cut the message. */
    return (size_t)n == len ? 0 : -EPROTO;
}

/* Takes every descriptor out of the control messages into fds[] (up to
 * cap) and closes the rest. Returns how many there were in all, or -1 for
 * ancillary data that is not SCM_RIGHTS. */
static int collect(struct msghdr *mh, int *fds, int cap, int *kept)
{
    int total = 0, foreign = 0;

    *kept = 0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(mh); c; c = CMSG_NXTHDR(mh, c)) {
        size_t n;
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) {
            foreign = 1;
            continue;
        }
        n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < n; i++) {
            int fd;
            memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
            if (*kept < cap)
                fds[(*kept)++] = fd;
            else
                close(fd);
            total++;
        }
    }
    return foreign ? -1 : total;
}

int fdpass_recv(int sock, void *msg, size_t len, int *fds, int max_fds, int *nfds,
                int timeout_ms)
{
    union {
        char buf[CMSG_ROOM];
        struct cmsghdr align;
    } ctl;
    struct iovec iov = { .iov_base = msg, .iov_len = len };
    struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1,
                         .msg_control = ctl.buf, .msg_controllen = sizeof(ctl.buf) };
    struct pollfd p = { .fd = sock, .events = POLLIN };
    int kept = 0, total, rc;
    ssize_t n;

    *nfds = 0;
    if (len == 0 || max_fds < 0 || max_fds > FDPASS_MAX)
        return -EINVAL;
    do
        rc = poll(&p, 1, timeout_ms);
    while (rc < 0 && errno == EINTR);
    if (rc < 0)
        return -errno;
    if (rc == 0)
        return -ETIMEDOUT;
    do
        n = recvmsg(sock, &mh, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    while (n < 0 && errno == EINTR);
    if (n < 0)
        return errno == ECONNRESET ? -EPIPE : -errno;
    /* Whatever happens next, what the kernel installed is accounted for. */
    total = collect(&mh, fds, max_fds, &kept);
    if (n == 0 && total == 0)
        return -EPIPE;
    rc = 0;
    if (mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC))
        rc = -EPROTO;           /* descriptors were lost, or bytes were */
    else if (total < 0 || total > max_fds)
        rc = -EPROTO;
    else if ((size_t)n != len)
        rc = -EPROTO;
    if (rc < 0) {
        for (int i = 0; i < kept; i++)
            close(fds[i]);
        return rc;
    }
    *nfds = kept;
    return 0;
}

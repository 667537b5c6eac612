/* src/membership/dgram.c: see dgram.h. */
#include "membership/dgram.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static ssize_t pack(const ProtobufCMessage *m, const char *magic, uint8_t buf[WIRE_DATAGRAM_MAX])
{
    size_t n = protobuf_c_message_get_packed_size(m);

    if (n > WIRE_DATAGRAM_MAX - WIRE_DATAGRAM_MAGIC_LEN)
        return -EMSGSIZE;
    memcpy(buf, magic, WIRE_DATAGRAM_MAGIC_LEN);
    protobuf_c_message_pack(m, buf + WIRE_DATAGRAM_MAGIC_LEN);
    return (ssize_t)(n + WIRE_DATAGRAM_MAGIC_LEN);
}

static ProtobufCMessage *unpack(const ProtobufCMessageDescriptor *d, const char *magic,
                                const uint8_t *buf, size_t len)
{
    /* The length is checked before anything is parsed, so a stranger's
     * bytes can claim no more than WIRE_DATAGRAM_MAX of allocations. */
    if (len < WIRE_DATAGRAM_MAGIC_LEN || len > WIRE_DATAGRAM_MAX ||
        memcmp(buf, magic, WIRE_DATAGRAM_MAGIC_LEN) != 0)
        return NULL;
    return protobuf_c_message_unpack(d, NULL, len - WIRE_DATAGRAM_MAGIC_LEN,
                                     buf + WIRE_DATAGRAM_MAGIC_LEN);
}

ssize_t dgram_pack(const Cohort__V1__HeartbeatDatagram *q, uint8_t buf[WIRE_DATAGRAM_MAX])
{
    return pack(&q->base, WIRE_DATAGRAM_MAGIC, buf);
}

ssize_t dgram_pack_ack(const Cohort__V1__HeartbeatDatagramAck *a, uint8_t buf[WIRE_DATAGRAM_MAX])
{
    return pack(&a->base, WIRE_DATAGRAM_ACK_MAGIC, buf);
}

int dgram_unpack_ack(const uint8_t *buf, size_t len, Cohort__V1__HeartbeatDatagramAck **out)
{
    ProtobufCMessage *m = unpack(&cohort__v1__heartbeat_datagram_ack__descriptor,
                                 WIRE_DATAGRAM_ACK_MAGIC, buf, len);

    if (!m)
        return -EBADMSG;
    *out = (Cohort__V1__HeartbeatDatagramAck *)m;
    return 0;
}

int dgram_unpack(const uint8_t *buf, size_t len, Cohort__V1__HeartbeatDatagram **out)
{
    Cohort__V1__HeartbeatDatagram *q = (Cohort__V1__HeartbeatDatagram *)unpack(
        &cohort__v1__heartbeat_datagram__descriptor, WIRE_DATAGRAM_MAGIC, buf, len);

    if (!q)
        return -EBADMSG;
    if (!q->cohort || !q->id || !q->cohort[0] || !q->id[0]) {
        cohort__v1__heartbeat_datagram__free_unpacked(q, NULL);
        return -EBADMSG;
    }
    *out = q;
    return 0;
}

/* The host of "host:port" or "[host]:port" into `host`; "" for none. */
static int split_host(const char *listen, char *host, size_t len)
{
    const char *end;

    if (listen[0] == '[') {
        end = strchr(listen, ']');
        if (!end)
            return -EINVAL;
        listen++;
    } else {
        end = strrchr(listen, ':');
        if (!end)
            end = listen + strlen(listen);
    }
    if ((size_t)(end - listen) >= len)
        return -EINVAL;
    memcpy(host, listen, (size_t)(end - listen));
    host[end - listen] = '\0';
    return 0;
}

static int bind_one(const struct addrinfo *ai)
{
    int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC,
                    ai->ai_protocol);
    int off = 0, rcvbuf = DGRAM_RCVBUF, rc;

    if (fd < 0)
        return -errno;
    /* Dual stack where the system allows it, like gRPC's own "[::]". */
    if (ai->ai_family == AF_INET6)
        setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &off, sizeof(off));
    /* Room for a burst: 10,000 members send 10,000 datagrams a second,
     * and the default buffer (about 270 of them) overflows whenever the
     * reading thread waits 30 ms for a core. The kernel caps this at
     * net.core.rmem_max; what it grants is enough where that is larger. */
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof(rcvbuf));
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) < 0) {
        rc = -errno;
        close(fd);
        return rc;
    }
    return fd;
}

int dgram_listen(const char *listen, int port, int fds[DGRAM_LISTEN_MAX])
{
    struct addrinfo hints = { .ai_family = AF_UNSPEC, .ai_socktype = SOCK_DGRAM,
                              .ai_flags = AI_PASSIVE | AI_NUMERICSERV };
    struct addrinfo *res = NULL;
    char host[256], serv[16];
    const char *node;
    int n = 0, first = 0, rc;

    if (!listen || port <= 0 || port > 65535)
        return -EINVAL;
    rc = split_host(listen, host, sizeof(host));
    if (rc < 0)
        return rc;
    node = host[0] && strcmp(host, "0.0.0.0") != 0 && strcmp(host, "::") != 0 ? host : NULL;
    snprintf(serv, sizeof(serv), "%d", port);
    /* IPv6 first: a dual-stack socket then takes IPv4 too, and the IPv4
     * bind that follows fails harmlessly. */
    if (!node)
        hints.ai_family = strcmp(host, "0.0.0.0") == 0 ? AF_INET : AF_INET6;
    rc = getaddrinfo(node, serv, &hints, &res);
    if (rc != 0)
        return rc == EAI_SYSTEM ? -errno : -EADDRNOTAVAIL;
    for (const struct addrinfo *ai = res; ai && n < (int)DGRAM_LISTEN_MAX; ai = ai->ai_next) {
        int fd = bind_one(ai);

        if (fd >= 0)
            fds[n++] = fd;
        else if (!first)
            first = fd;
    }
    freeaddrinfo(res);
    if (n == 0 && !node && hints.ai_family == AF_INET6) {
        /* No IPv6 on this host: every IPv4 address instead. */
        return dgram_listen("0.0.0.0:0", port, fds);
    }
    return n > 0 ? n : (first ? first : -EADDRNOTAVAIL);
}

int dgram_recv(int fd, struct dgram_batch *b)
{
    struct mmsghdr msgs[DGRAM_BATCH];
    struct iovec iov[DGRAM_BATCH];
    int n;

    memset(msgs, 0, sizeof(msgs));
    for (size_t i = 0; i < DGRAM_BATCH; i++) {
        iov[i].iov_base = b->buf[i];
        iov[i].iov_len = sizeof(b->buf[i]);
        msgs[i].msg_hdr.msg_iov = &iov[i];
        msgs[i].msg_hdr.msg_iovlen = 1;
        msgs[i].msg_hdr.msg_name = &b->from[i];
        msgs[i].msg_hdr.msg_namelen = sizeof(b->from[i]);
    }
    n = recvmmsg(fd, msgs, DGRAM_BATCH, MSG_DONTWAIT, NULL);
    if (n < 0)
        return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? 0 : -errno;
    for (int i = 0; i < n; i++) {
        b->len[i] = (msgs[i].msg_hdr.msg_flags & MSG_TRUNC) ? WIRE_DATAGRAM_MAX + 1
                                                            : msgs[i].msg_len;
        b->from_len[i] = msgs[i].msg_hdr.msg_namelen;
    }
    return n;
}

int dgram_send_to(int fd, const struct sockaddr_storage *to, socklen_t to_len, const uint8_t *buf,
                  size_t len)
{
    if (sendto(fd, buf, len, MSG_DONTWAIT | MSG_NOSIGNAL, (const struct sockaddr *)to,
               to_len) < 0)
        return errno == EWOULDBLOCK ? -EAGAIN : -errno;
    return 0;
}

int dgram_connect(const struct sockaddr *sa, socklen_t len)
{
    int fd = socket(sa->sa_family, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    int rc;

    if (fd < 0)
        return -errno;
    if (connect(fd, sa, len) < 0) {
        rc = -errno;
        close(fd);
        return rc;
    }
    return fd;
}

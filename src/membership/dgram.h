/* src/membership/dgram.h: heartbeats as UDP datagrams (wire.h, "datagram
 * heartbeats"): the frame both ends agree on, the broker's sockets and
 * their batched reads, and a member's socket. What a datagram may do is
 * brokerd.c's to judge, when to send one member.c's; this module only
 * moves bytes and checks their shape.
 *
 *   uint8_t buf[WIRE_DATAGRAM_MAX];
 *   ssize_t n = dgram_pack(&q, buf);          // q signed with proof_sign()
 *   if (n > 0) send(fd, buf, (size_t)n, MSG_DONTWAIT);
 */
#ifndef COHORT_DGRAM_H
#define COHORT_DGRAM_H

#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/types.h>

#include "cohort.pb-c.h"
#include "membership/wire.h"

/* The most sockets dgram_listen binds: one per address of the listen
 * host (an IPv4 and an IPv6 one for "localhost", say). */
#define DGRAM_LISTEN_MAX 4u
/* Datagrams one dgram_recv call reads at most. */
#define DGRAM_BATCH 32u
/* The receive buffer the broker's sockets ask for (dgram.c says why). */
#define DGRAM_RCVBUF (4 * 1024 * 1024)

/* Packs `q` (its proof already set) as one datagram into `buf`. Returns
 * its length, or -EMSGSIZE when it would not fit WIRE_DATAGRAM_MAX. */
ssize_t dgram_pack(const Cohort__V1__HeartbeatDatagram *q, uint8_t buf[WIRE_DATAGRAM_MAX]);

/* Reads one datagram of `len` bytes. Returns 0 with *out, which the
 * caller frees with protobuf_c_message_free_unpacked(), or -EBADMSG: too
 * long, another magic, not a HeartbeatDatagram, or no cohort or id. */
int dgram_unpack(const uint8_t *buf, size_t len, Cohort__V1__HeartbeatDatagram **out);

/* The same for the broker's acknowledgements (WIRE_DATAGRAM_ACK_MAGIC). */
ssize_t dgram_pack_ack(const Cohort__V1__HeartbeatDatagramAck *a, uint8_t buf[WIRE_DATAGRAM_MAX]);
int dgram_unpack_ack(const uint8_t *buf, size_t len, Cohort__V1__HeartbeatDatagramAck **out);

/* Binds nonblocking UDP sockets on the host part of `listen` ("host:port",
 * "[v6]:port"; an empty host or "0.0.0.0" or "[::]" is every address) at
 * `port`, one per address the host resolves to, at most
 * DGRAM_LISTEN_MAX, into fds[]. Returns how many (at least 1), or -errno
 * of the first failure when none could be bound. The caller closes them. */
int dgram_listen(const char *listen, int port, int fds[DGRAM_LISTEN_MAX]);

/* One batch of received datagrams: len[i] bytes of buf[i] from from[i],
 * for i below the count dgram_recv returned. Datagrams longer than
 * WIRE_DATAGRAM_MAX are read with len WIRE_DATAGRAM_MAX + 1, so that they
 * fail unpacking. */
struct dgram_batch {
    uint8_t buf[DGRAM_BATCH][WIRE_DATAGRAM_MAX + 1];
    size_t len[DGRAM_BATCH];
    struct sockaddr_storage from[DGRAM_BATCH];
    socklen_t from_len[DGRAM_BATCH];
};

/* Reads what is waiting on `fd` (nonblocking), up to DGRAM_BATCH. Returns
 * the count (0: nothing waits) or -errno. */
int dgram_recv(int fd, struct dgram_batch *b);

/* Sends `len` bytes of `buf` from socket `fd` to `to` without blocking.
 * Returns 0 or -errno (-EAGAIN: the socket's buffer is full, and the
 * datagram is dropped, as a network may drop it). */
int dgram_send_to(int fd, const struct sockaddr_storage *to, socklen_t to_len, const uint8_t *buf,
                  size_t len);

/* A nonblocking UDP socket connected to `sa`. Returns it, or -errno. */
int dgram_connect(const struct sockaddr *sa, socklen_t len);

#endif

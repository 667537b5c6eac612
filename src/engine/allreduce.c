/* src/engine/allreduce.c: see allreduce.h.
 *
 * ALGORITHMS AND THRESHOLDS
 *
 * Ring (large buffers): reduce-scatter then all-gather, 2(n-1) steps. At
 * step t member r sends chunk (r - t) mod n to its right neighbour and
 * receives chunk (r - t - 1) mod n from its left; the first n-1 steps
 * reduce, the rest copy. The buffer is cut into windows, each a complete
 * ring over n chunks of WINDOW_UNITS segments, run back to back: the next
 * window's first sends follow the previous window's last ones without a
 * gap, so the pipeline never drains. While the kernel moves segment k in
 * and out of the sockets this thread reduces segment k-1: received bytes
 * land in a staging slot, are reduced into the user buffer, and are sent
 * on from the user buffer, so no payload is copied beyond that.
 *
 * Recursive doubling (small buffers): log2(p) exchanges of the whole
 * buffer with partner r xor 2^k, p the largest power of two <= n; the
 * n - p extra members first hand their data to a neighbour and get the
 * result back at the end. Each exchange combines the lower-ranked half's
 * value first, so every member computes the same bytes; the upper partner
 * pays one copy of the (small) buffer for that.
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
 *   Window length, 64 MiB busbw GB/s (segments per chunk per window):
 *     n=2: 4 -> 1.51, 8 -> 1.56, 16 -> 1.13 (sends leave cache)
 *     n=3: 4 -> 0.65, 8 -> 0.72, 16 -> 0.76, 32 -> 0.78
 *     n=4: 4 -> 0.62, 8 -> 0.64, 16 -> 0.75, 32 -> 0.79
 *   More members than cores need slack when one is descheduled: 16 for
 *   n >= 3, 8 for pairs.
 *
 *   Segment size, 64 MiB busbw for 64K, 128K, 256K, 512K, 1M, 4M: no
 *   difference beyond the noise at n=2 or n=4; 256 KiB (Gloo uses 1 MiB)
 *   keeps the staging small. Fixed SO_SNDBUF/SO_RCVBUF of 1 or 4 MiB and
 *   SO_RCVLOWAT were no better than the kernel's autotuning; left out.
 *
 *   Spinning SPIN_US = 50 us (yielding) before poll: 4 KiB at n=2 from
 *   47 to 13 us, at n=4 from 111 to 59-67 us; 64 MiB at n=4 from 0.65 to
 *   0.76 GB/s; no change at n=2.
 *
 * 16-bit floats accumulate in float32: partial sums travel as float32
 * during the reduce-scatter (and in recursive doubling) and are rounded to
 * 16 bits once, by the member that finishes a chunk; the all-gather moves
 * 16-bit values. That is 1.5x the bytes of a pure 16-bit ring (2x in the
 * first half), the price of one rounding instead of n-1. Partial sums need
 * storage until forwarded, so 16-bit windows are shorter
 * (WINDOW_UNITS_WIDE) to bound that to a few staging slots.
 *
 * WIRE (the bytes: peerwire.h)
 *
 * HELLO goes first on every connection, both ways. The member lower in
 * the epoch's order connects and greets; the acceptor checks magic,
 * version, cohort, and that the sender is a member of its epoch, and
 * answers accept (with its own id, which the connector checks too). A
 * greeting from an older epoch gets "stale" with the newer number; one
 * from a newer epoch is held up to the member timeout for our own
 * set_epoch; anything else is a stranger and is closed with one log line.
 *
 * Every payload follows a FRAME header. The schedule is deterministic, so a
 * receiver knows exactly which frame comes next and compares every field;
 * the payload is read only into the slot or buffer range it expects, never
 * beyond. A frame that differs (another epoch, round, count, type, op,
 * offset or length) fails the call with -EPROTO and the connection is
 * closed, not resynchronised: connections belong to one epoch and every
 * failed call closes its connections, so a mismatch means the peer lost
 * sync and nothing after it on that stream can be trusted. A BYE says the
 * peer is leaving the call and why (errno and its newest epoch); the
 * receiver fails with the same error, -ESTALE for an epoch change.
 *
 * ABORT AND TIMEOUTS
 *
 * Sockets are non-blocking and the calling thread drives them with poll,
 * which always includes an eventfd that allreduce_set_epoch writes after
 * bumping a generation counter; a changed generation ends the call with
 * -ESTALE. Each direction of each connection has its own silence clock:
 * a send that moves no byte, or an expected receive that gets none, for
 * member_timeout_ms fails the call with -ETIMEDOUT. A failed call sends
 * BYE on its connections (finishing a half-sent frame first, within
 * ABORT_GRACE_MS) and closes them, so its neighbours fail fast with the
 * same cause instead of waiting out their own timeouts. A SIGKILLed peer's
 * kernel closes its sockets, so its neighbours see a reset at once. */
#include "engine/allreduce.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "base/clock.h"
#include "base/ident.h"
#include "base/log.h"
#include "engine/peerwire.h"

#define COMPONENT "allreduce"

/* Measured defaults: see the table at the top of this file. */
#define DEFAULT_SEGMENT_BYTES ((size_t)256 << 10)
#define DEFAULT_SMALL_BYTES ((size_t)256 << 10)
#define MAX_SEGMENT_BYTES ((size_t)64 << 20)
#define MAX_SMALL_BYTES ((size_t)64 << 20)

/* Segments per chunk per window, and the staging slots that makes
 * necessary for 16-bit types, whose float32 partial sums wait in a slot
 * from their arrival until they are forwarded one step later. With
 * WINDOW_UNITS_WIDE + 2 slots, a receive that waits for a slot implies this
 * member's receives are ahead of its sends, which cannot hold all around
 * the ring at once, so the ring cannot deadlock on slots. Other types
 * reduce into the user buffer and free their slot at once, so their
 * windows can be longer: more slack when members share cores. */
#ifndef WINDOW_UNITS
#define WINDOW_UNITS 16
#endif
#define WINDOW_UNITS_PAIR 8
#ifndef WINDOW_UNITS_WIDE
#define WINDOW_UNITS_WIDE 4
#endif
#define SLOTS (WINDOW_UNITS_WIDE + 2)

/* Before sleeping in poll, keep trying for this long, yielding the core
 * between tries. A wakeup through poll costs tens of microseconds on a
 * loaded host, more than a small all-reduce step; yielding lets another
 * member sharing this core (or any other process) run meanwhile. */
#ifndef SPIN_US
#define SPIN_US 50
#endif

#define ABORT_GRACE_MS 50       /* finishing half-sent frames before a BYE */
#define MAX_PENDING 64          /* accepted connections still greeting */
#define INBOX_MAX 256           /* greeted connections not yet taken by a run */
#define MAX_NEED 72             /* peers one call talks to: 2 + log2(n) */
#define DRAIN_BYTES (1 << 20)   /* read and dropped before close, to avoid a reset */


/* --- state -------------------------------------------------------------- */

/* One TCP connection to one member, used in both directions. At most one
 * frame is in flight each way; the pumps move as much of it as the socket
 * takes without blocking. */
struct conn {
    int fd;
    size_t peer;                /* index in the epoch */

    bool tx_busy, tx_moved;
    uint8_t tx_hdr[PEERWIRE_FRAME_BYTES];
    const uint8_t *tx_buf;
    size_t tx_len, tx_done;     /* tx_done counts header and payload */
    uint64_t tx_since;

    bool rx_busy, rx_moved, rx_checked;
    uint8_t rx_hdr[PEERWIRE_FRAME_BYTES];
    uint8_t *rx_buf;
    size_t rx_len, rx_done;
    struct peerwire_frame rx_want;       /* magic 0: control only, any data frame is wrong */
    uint64_t rx_since;
};

struct inbound {
    int fd;
    uint64_t epoch;
    size_t peer;
};

struct pending {
    int fd;
    uint64_t deadline;
    size_t got;
    bool held;                  /* greeted from a newer epoch; waiting for ours */
    uint8_t buf[PEERWIRE_HELLO_BYTES];
    char from[64];
};

struct reg {
    void *buf;
    size_t bytes;
    bool used;
};

struct allreduce {
    char *cohort, *id;
    uint64_t cohort_hash;
    int listen_fd;
    uint32_t timeout_ms;
    size_t seg_bytes, small_bytes;
    int abort_fd;               /* set_epoch -> run */
    int wake_fd;                /* set_epoch, destroy -> acceptor */
    int inbox_fd;               /* acceptor -> run */
    pthread_t acceptor;
    pthread_mutex_t mu;

    /* Under mu. */
    struct epoch *epoch;
    bool stop;
    struct inbound inbox[INBOX_MAX];
    size_t n_inbox;

    _Atomic uint64_t gen;       /* bumped by every adopted epoch */
    atomic_bool running;

    /* The running call's; under mu while none runs. */
    struct epoch *conn_epoch;
    struct conn **conns;        /* conn_epoch->n_members entries, NULL when closed */

    /* The acceptor thread's. */
    struct pending pending[MAX_PENDING];
    size_t n_pending;

    /* The caller thread's. */
    struct reg regs[ALLREDUCE_MAX_BUFFERS];
    uint8_t *stage;             /* SLOTS + 1 segments */
    uint8_t *rd_a, *rd_b;       /* small_bytes each, or NULL */
};

/* One call. */
struct run {
    struct allreduce *a;
    struct epoch *e;
    uint64_t gen;
    size_t me, n;
    uint64_t round;
    size_t count;
    enum dtype type, acc;
    enum dtype_op op;
    double div;
    uint8_t *buf;               /* where the result lands */
    const uint8_t *src;         /* this member's contribution: buf, or a buffer never written */
    size_t esz, asz;            /* user and accumulation element sizes */
    bool wide;                  /* 16-bit float: accumulate in float32 */
    size_t fail_peer;           /* for the log line; SIZE_MAX when unknown */
};

/* --- sockets ------------------------------------------------------------ */

static void tune_socket(int fd)
{
    int one = 1;

    /* Frames are written whole with writev; Nagle would only hold back the
     * tail of each one. */
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

static void describe_peer(int fd, char *out, size_t len)
{
    struct sockaddr_storage ss;
    socklen_t sl = sizeof(ss);
    char host[INET6_ADDRSTRLEN] = "?";
    unsigned port = 0;

    if (getpeername(fd, (struct sockaddr *)&ss, &sl) == 0) {
        if (ss.ss_family == AF_INET) {
            struct sockaddr_in *s4 = (struct sockaddr_in *)&ss;
            inet_ntop(AF_INET, &s4->sin_addr, host, sizeof(host));
            port = ntohs(s4->sin_port);
        } else if (ss.ss_family == AF_INET6) {
            struct sockaddr_in6 *s6 = (struct sockaddr_in6 *)&ss;
            inet_ntop(AF_INET6, &s6->sin6_addr, host, sizeof(host));
            port = ntohs(s6->sin6_port);
        }
    }
    snprintf(out, len, "%s:%u", host, port);
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

/* Splits "host:port" or "[v6]:port" into NUL-terminated parts. */
static int split_address(const char *addr, char *host, size_t hlen, char *port, size_t plen)
{
    const char *colon = strrchr(addr, ':');
    const char *h = addr;
    size_t hl;

    if (!colon || colon == addr)
        return -EINVAL;
    hl = (size_t)(colon - addr);
    if (addr[0] == '[') {
        if (hl < 2 || colon[-1] != ']')
            return -EINVAL;
        h = addr + 1;
        hl -= 2;
    }
    if (hl == 0 || hl >= hlen || strlen(colon + 1) == 0 || strlen(colon + 1) >= plen)
        return -EINVAL;
    memcpy(host, h, hl);
    host[hl] = '\0';
    snprintf(port, plen, "%s", colon + 1);
    return 0;
}

/* --- connections -------------------------------------------------------- */

static struct conn *conn_new(int fd, size_t peer)
{
    struct conn *c = calloc(1, sizeof(*c));

    if (!c)
        return NULL;
    c->fd = fd;
    c->peer = peer;
    return c;
}

/* Sends more of the frame in flight. Returns 1 when bytes moved, 0 when
 * the socket is full, -EPIPE or -ECONNRESET. */
static int tx_pump(struct conn *c)
{
    struct iovec iov[2];
    struct msghdr m = { .msg_iov = iov };
    size_t pd = c->tx_done > PEERWIRE_FRAME_BYTES ? c->tx_done - PEERWIRE_FRAME_BYTES : 0;
    ssize_t w;

    if (c->tx_done < PEERWIRE_FRAME_BYTES)
        iov[m.msg_iovlen++] = (struct iovec){ c->tx_hdr + c->tx_done, PEERWIRE_FRAME_BYTES - c->tx_done };
    if (pd < c->tx_len)
        iov[m.msg_iovlen++] = (struct iovec){ (void *)(uintptr_t)(c->tx_buf + pd), c->tx_len - pd };
    do
        w = sendmsg(c->fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
    while (w < 0 && errno == EINTR);
    if (w < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK)
            return 0;
        return errno == EPIPE ? -EPIPE : -ECONNRESET;
    }
    c->tx_done += (size_t)w;
    c->tx_moved = true;
    if (c->tx_done == PEERWIRE_FRAME_BYTES + c->tx_len)
        c->tx_busy = false;
    return 1;
}

static void tx_start(struct conn *c, const struct peerwire_frame *f, const void *payload)
{
    peerwire_frame_encode(c->tx_hdr, f);
    c->tx_buf = payload;
    c->tx_len = f->length;
    c->tx_done = 0;
    c->tx_busy = true;
    c->tx_moved = true;
}

static void rx_start(struct conn *c, const struct peerwire_frame *want, void *dst)
{
    c->rx_want = *want;
    c->rx_buf = dst;
    c->rx_len = want->magic ? want->length : 0;
    c->rx_done = 0;
    c->rx_checked = false;
    c->rx_busy = true;
    c->rx_moved = true;
}

/* Ends a connection: finishes a half-sent frame if that takes no longer
 * than `deadline`, so that the BYE lands on a frame boundary, sends the
 * BYE (error `err`, newest epoch `epoch`), and closes. Best effort: a peer
 * that misses the BYE still sees the close. */
static void conn_close(struct conn *c, uint64_t cohort_hash, int err, uint64_t epoch,
                       uint64_t deadline)
{
    struct peerwire_frame bye = { .magic = PEERWIRE_FRAME_BYE, .cohort = cohort_hash, .epoch = epoch,
                         .step = (uint32_t)(err < 0 ? -err : err) };

    if (!c)
        return;
    while (c->tx_busy && c->tx_done > 0) {
        uint64_t now = clock_now_ms();
        struct pollfd p = { .fd = c->fd, .events = POLLOUT };
        int r = tx_pump(c);

        if (r < 0 || now >= deadline)
            break;
        if (r == 0 && poll(&p, 1, (int)(deadline - now)) <= 0)
            break;
    }
    if (!c->tx_busy || c->tx_done == 0) {
        uint8_t b[PEERWIRE_FRAME_BYTES];

        peerwire_frame_encode(b, &bye);
        if (send(c->fd, b, sizeof(b), MSG_NOSIGNAL | MSG_DONTWAIT) < 0) {
            /* The socket is full or gone; the close says enough. */
        }
    }
    shutdown(c->fd, SHUT_WR);
    /* Closing with unread bytes sends a reset, which can overtake the BYE;
     * drop what is already here first, up to a bound. */
    for (size_t dropped = 0; dropped < DRAIN_BYTES;) {
        uint8_t junk[16384];
        ssize_t r = recv(c->fd, junk, sizeof(junk), MSG_DONTWAIT);
        if (r <= 0)
            break;
        dropped += (size_t)r;
    }
    close(c->fd);
    free(c);
}

/* Closes every connection of the table; mu held or the table owned. */
static void close_all(struct allreduce *a, int err, uint64_t epoch, uint64_t deadline)
{
    size_t n = a->conn_epoch ? a->conn_epoch->n_members : 0;

    for (size_t i = 0; i < n; i++) {
        conn_close(a->conns[i], a->cohort_hash, err, epoch, deadline);
        a->conns[i] = NULL;
    }
}

static uint64_t newest_epoch(struct allreduce *a)
{
    uint64_t n;

    pthread_mutex_lock(&a->mu);
    n = a->epoch ? a->epoch->number : 0;
    pthread_mutex_unlock(&a->mu);
    return n;
}

/* --- the acceptor ------------------------------------------------------- */

static void pending_drop(struct allreduce *a, size_t i)
{
    close(a->pending[i].fd);
    a->pending[i] = a->pending[--a->n_pending];
}

static void stranger(struct allreduce *a, size_t i, const char *why)
{
    log_warn(COMPONENT, "Closed a connection from a stranger.", LF_S("cohort", a->cohort),
             LF_S("from", a->pending[i].from), LF_S("reason", why));
    pending_drop(a, i);
}

static bool reply(int fd, uint8_t kind, uint64_t epoch, struct allreduce *a)
{
    uint8_t b[PEERWIRE_HELLO_BYTES];

    /* Both names were checked by allreduce_create, so encoding cannot fail. */
    if (peerwire_hello_encode(b, kind, epoch, a->cohort, a->id) < 0)
        return false;
    /* A fresh socket's send buffer always has room for one greeting. */
    return send(fd, b, sizeof(b), MSG_NOSIGNAL | MSG_DONTWAIT) == (ssize_t)sizeof(b);
}

/* Decides on a complete greeting. Returns true when pending[i] is still
 * held (waiting for our epoch), false when it was answered and removed. */
static bool judge(struct allreduce *a, size_t i)
{
    struct pending *p = &a->pending[i];
    struct peerwire_hello h;
    const char *why = peerwire_hello_decode(p->buf, sizeof(p->buf), &h);
    uint64_t cur;
    long me, peer;

    if (!why && h.kind != PEERWIRE_GREET)
        why = "not a greeting";
    if (!why && strcmp(h.cohort, a->cohort) != 0)
        why = "another cohort";
    if (why) {
        stranger(a, i, why);
        return false;
    }
    pthread_mutex_lock(&a->mu);
    cur = a->epoch ? a->epoch->number : 0;
    if (h.epoch > cur) {
        /* The peer adopted an epoch before us; ours is probably on its
         * way. Hold the greeting until it arrives or the deadline. */
        pthread_mutex_unlock(&a->mu);
        p->held = true;
        return true;
    }
    if (h.epoch < cur) {
        reply(p->fd, PEERWIRE_STALE, cur, a);
        pthread_mutex_unlock(&a->mu);
        log_info(COMPONENT, "Refused a member of an older epoch.", LF_S("cohort", a->cohort),
                 LF_S("member", h.id), LF_U("its_epoch", h.epoch), LF_U("epoch", cur));
        pending_drop(a, i);
        return false;
    }
    me = epoch_find(a->epoch, a->id);
    peer = epoch_find(a->epoch, h.id);
    if (me < 0 || peer < 0 || peer == me) {
        pthread_mutex_unlock(&a->mu);
        stranger(a, i, "not a member of the epoch");
        return false;
    }
    if (a->n_inbox == INBOX_MAX || !reply(p->fd, PEERWIRE_ACCEPT, cur, a)) {
        pthread_mutex_unlock(&a->mu);
        log_warn(COMPONENT, "Dropped a member's connection.", LF_S("cohort", a->cohort),
                 LF_S("member", h.id), LF_S("reason", "inbox full or socket closed"));
        pending_drop(a, i);
        return false;
    }
    a->inbox[a->n_inbox++] = (struct inbound){ .fd = p->fd, .epoch = cur, .peer = (size_t)peer };
    pthread_mutex_unlock(&a->mu);
    {
        uint64_t one = 1;
        if (write(a->inbox_fd, &one, sizeof(one)) < 0) {
            /* The counter cannot overflow in practice; the run polls anyway. */
        }
    }
    a->pending[i] = a->pending[--a->n_pending];
    return false;
}

static void accept_all(struct allreduce *a, uint64_t now)
{
    while (a->n_pending < MAX_PENDING) {
        int fd = accept4(a->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        struct pending *p;

        if (fd < 0)
            return;             /* EAGAIN, or a connection that vanished */
        tune_socket(fd);
        p = &a->pending[a->n_pending++];
        p->fd = fd;
        p->got = 0;
        p->held = false;
        p->deadline = now + a->timeout_ms;
        describe_peer(fd, p->from, sizeof(p->from));
    }
}

/* Reads more of pending[i]'s greeting. Returns true if it is still there. */
static bool read_greeting(struct allreduce *a, size_t i)
{
    struct pending *p = &a->pending[i];
    ssize_t r = recv(p->fd, p->buf + p->got, PEERWIRE_HELLO_BYTES - p->got, MSG_DONTWAIT);

    if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
        if (p->got > 0)
            stranger(a, i, "closed before a whole greeting");
        else
            pending_drop(a, i);
        return false;
    }
    if (r > 0)
        p->got += (size_t)r;
    if (!peerwire_hello_plausible(p->buf, p->got)) {
        stranger(a, i, "bad magic");
        return false;
    }
    if (p->got < PEERWIRE_HELLO_BYTES)
        return true;
    return judge(a, i);
}

static void *acceptor_main(void *arg)
{
    struct allreduce *a = arg;
    struct pollfd pfd[2 + MAX_PENDING];
    size_t map[MAX_PENDING];            /* pfd[2 + k] is pending[map[k]] */

    for (;;) {
        uint64_t now = clock_now_ms(), next = UINT64_MAX;
        nfds_t n = 2;
        bool stop;
        int r;

        pthread_mutex_lock(&a->mu);
        stop = a->stop;
        pthread_mutex_unlock(&a->mu);
        if (stop)
            break;
        for (size_t i = 0; i < a->n_pending;) {
            if (now >= a->pending[i].deadline) {
                stranger(a, i, a->pending[i].held ? "its epoch never reached us"
                                                  : "no greeting in time");
                continue;
            }
            if (a->pending[i].deadline < next)
                next = a->pending[i].deadline;
            i++;
        }
        pfd[0] = (struct pollfd){ .fd = a->wake_fd, .events = POLLIN };
        pfd[1] = (struct pollfd){ .fd = a->n_pending < MAX_PENDING ? a->listen_fd : -1,
                                  .events = POLLIN };
        for (size_t i = 0; i < a->n_pending; i++)
            if (!a->pending[i].held) {
                map[n - 2] = i;
                pfd[n++] = (struct pollfd){ .fd = a->pending[i].fd, .events = POLLIN };
            }
        if (next != UINT64_MAX && next - now > INT_MAX)
            next = now + INT_MAX;
        r = poll(pfd, n, next == UINT64_MAX ? -1 : (int)(next - now));
        if (r <= 0)
            continue;           /* EINTR, or a deadline to act on */
        if (pfd[0].revents) {
            uint64_t v;
            if (read(a->wake_fd, &v, sizeof(v)) < 0) {
                /* drained already */
            }
            /* Our epoch may have changed: decide on held greetings again. */
            for (size_t i = 0; i < a->n_pending;) {
                if (a->pending[i].held && !judge(a, i))
                    continue;
                i++;
            }
            continue;           /* pending indices may have moved under map */
        }
        /* In reverse, so that a removal (which moves the last entry into
         * the hole) only moves entries already visited. */
        for (nfds_t k = n; k-- > 2;)
            if (pfd[k].revents)
                read_greeting(a, map[k - 2]);
        if (pfd[1].revents)
            accept_all(a, clock_now_ms());
    }
    while (a->n_pending > 0)
        pending_drop(a, a->n_pending - 1);
    return NULL;
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
        (small != ALLREDUCE_SMALL_NONE && small > MAX_SMALL_BYTES))
        return -EINVAL;
    a = calloc(1, sizeof(*a));
    if (!a)
        return -ENOMEM;
    a->listen_fd = cfg->listen_fd;
    a->timeout_ms = cfg->member_timeout_ms ? cfg->member_timeout_ms : ALLREDUCE_DEFAULT_TIMEOUT_MS;
    a->seg_bytes = seg;
    a->small_bytes = small;
    a->abort_fd = a->wake_fd = a->inbox_fd = -1;
    rc = -ENOMEM;
    a->cohort = strdup(cfg->cohort);
    a->id = strdup(cfg->member_id);
    a->stage = malloc((SLOTS + 1) * seg);
    if (!a->cohort || !a->id || !a->stage)
        goto err_alloc;
    if (small != ALLREDUCE_SMALL_NONE) {
        a->rd_a = malloc(small);
        a->rd_b = malloc(small);
        if (!a->rd_a || !a->rd_b)
            goto err_alloc;
    }
    a->cohort_hash = peerwire_cohort_hash(a->cohort);
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
    rc = -pthread_create(&a->acceptor, NULL, acceptor_main, a);
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
    uint64_t one = 1;

    if (!a)
        return;
    pthread_mutex_lock(&a->mu);
    a->stop = true;
    pthread_mutex_unlock(&a->mu);
    if (write(a->wake_fd, &one, sizeof(one)) < 0) {
        /* the acceptor also wakes on its next deadline */
    }
    pthread_join(a->acceptor, NULL);
    close_all(a, -ECONNRESET, newest_epoch(a), clock_now_ms());
    free(a->conns);
    epoch_unref(a->conn_epoch);
    for (size_t i = 0; i < a->n_inbox; i++)
        close(a->inbox[i].fd);
    epoch_unref(a->epoch);
    pthread_mutex_destroy(&a->mu);
    engine_free(a);
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
        close_all(a, -ESTALE, e->number, clock_now_ms());
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

/* --- one call: plumbing ------------------------------------------------- */

static bool stale(const struct run *x)
{
    return atomic_load(&x->a->gen) != x->gen;
}

/* Waits in poll until a descriptor in pfd[1..n) is ready. pfd[0] must be
 * the abort eventfd. Returns 0, -ESTALE or -ETIMEDOUT (at `deadline`). */
static int wait_io(struct run *x, struct pollfd *pfd, nfds_t n, uint64_t deadline)
{
    for (;;) {
        uint64_t now = clock_now_ms();
        int k;

        if (stale(x))
            return -ESTALE;
        if (now >= deadline)
            return -ETIMEDOUT;
        k = poll(pfd, n, deadline - now > INT_MAX ? INT_MAX : (int)(deadline - now));
        if (k < 0 && errno != EINTR)
            return -errno;
        if (k <= 0)
            continue;
        if (pfd[0].revents) {
            uint64_t v;
            if (read(x->a->abort_fd, &v, sizeof(v)) < 0) {
                /* another wakeup drained it */
            }
            if (stale(x))
                return -ESTALE;
            if (k == 1)
                continue;
        }
        return 0;
    }
}

static int bye_error(struct run *x, const struct peerwire_frame *f)
{
    if (f->step == ESTALE || f->epoch > x->e->number)
        return -ESTALE;
    if (f->step == ETIMEDOUT)
        return -ETIMEDOUT;
    return -ECONNRESET;
}

/* Compares a received header with the one the schedule expects. */
static int check_header(struct run *x, struct conn *c)
{
    const struct peerwire_frame *w = &c->rx_want;
    struct peerwire_frame f;
    const char *what = NULL;
    int rc = peerwire_frame_decode(c->rx_hdr, sizeof(c->rx_hdr), &f);

    if (rc == 0 && f.magic == PEERWIRE_FRAME_BYE && f.cohort == x->a->cohort_hash)
        return bye_error(x, &f);
    if (rc < 0 || f.magic != PEERWIRE_FRAME_DATA || f.cohort != x->a->cohort_hash)
        what = "not a frame of this cohort";
    else if (f.epoch != x->e->number)
        what = "another epoch";
    else if (!w->magic)
        what = "data where none was due";
    else if (f.round != w->round)
        what = "another round";
    else if (f.count != w->count || f.dtype != w->dtype || f.op != w->op)
        what = "another count, type or op";
    else if (f.phase != w->phase || f.step != w->step || f.offset != w->offset ||
             f.length != w->length)
        what = "a segment other than the one due";
    if (!what)
        return 0;
    log_warn(COMPONENT, "Dropped a frame that does not match the call.",
             LF_S("cohort", x->a->cohort), LF_S("peer", x->e->members[c->peer].id),
             LF_S("reason", what), LF_U("epoch", f.epoch), LF_U("round", f.round),
             LF_U("offset", f.offset), LF_U("length", f.length));
    return -EPROTO;
}

/* Receives more of the frame expected on c: the header, then the payload
 * straight into its destination, never more than the expected length.
 * Returns 1 when bytes moved, 0 when none were there, or an error. */
static int rx_pump(struct run *x, struct conn *c)
{
    struct iovec iov[2];
    struct msghdr m = { .msg_iov = iov };
    size_t pd = c->rx_done > PEERWIRE_FRAME_BYTES ? c->rx_done - PEERWIRE_FRAME_BYTES : 0;
    ssize_t r;
    int rc;

    if (c->rx_done < PEERWIRE_FRAME_BYTES)
        iov[m.msg_iovlen++] = (struct iovec){ c->rx_hdr + c->rx_done, PEERWIRE_FRAME_BYTES - c->rx_done };
    if (pd < c->rx_len)
        iov[m.msg_iovlen++] = (struct iovec){ c->rx_buf + pd, c->rx_len - pd };
    do
        r = recvmsg(c->fd, &m, MSG_DONTWAIT);
    while (r < 0 && errno == EINTR);
    if (r < 0)
        return errno == EAGAIN || errno == EWOULDBLOCK ? 0 : -ECONNRESET;
    if (r == 0)
        return -ECONNRESET;
    c->rx_done += (size_t)r;
    c->rx_moved = true;
    if (!c->rx_checked && c->rx_done >= PEERWIRE_FRAME_BYTES) {
        rc = check_header(x, c);
        if (rc < 0)
            return rc;
        c->rx_checked = true;
    }
    if (c->rx_checked && c->rx_done == PEERWIRE_FRAME_BYTES + c->rx_len)
        c->rx_busy = false;
    return 1;
}

/* After a failed send: the peer may have said why before closing. */
static int refine(struct run *x, struct conn *c, int err)
{
    uint8_t b[PEERWIRE_FRAME_BYTES];
    struct peerwire_frame f;

    if (c->rx_busy && c->rx_done > 0)
        return err;             /* mid-frame: a BYE would be further on */
    if (recv(c->fd, b, sizeof(b), MSG_DONTWAIT | MSG_PEEK) != (ssize_t)sizeof(b))
        return err;
    if (peerwire_frame_decode(b, sizeof(b), &f) < 0)
        return err;
    return f.magic == PEERWIRE_FRAME_BYE && f.cohort == x->a->cohort_hash ? bye_error(x, &f) : err;
}

/* True while the current spell without progress is younger than SPIN_US
 * (having yielded the core once); false when it is time to sleep in poll,
 * and the next spell then starts afresh. *from is 0 when none runs. */
static bool spin(uint64_t *from)
{
    uint64_t t = clock_now_us();

    if (!*from)
        *from = t;
    if (t - *from < SPIN_US) {
        sched_yield();
        return true;
    }
    *from = 0;
    return false;
}

static void since_update(struct conn *c, uint64_t now)
{
    if (c->tx_moved)
        c->tx_since = now;
    if (c->rx_moved)
        c->rx_since = now;
    c->tx_moved = c->rx_moved = false;
}

/* The latest moment the active directions of c may stay silent until. */
static uint64_t silence_deadline(const struct run *x, const struct conn *c, bool ctl_rx)
{
    uint64_t d = UINT64_MAX;

    if (c->tx_busy)
        d = c->tx_since + x->a->timeout_ms;
    if (c->rx_busy && !ctl_rx && c->rx_since + x->a->timeout_ms < d)
        d = c->rx_since + x->a->timeout_ms;
    return d;
}

static struct peerwire_frame frame_for(const struct run *x, uint8_t phase, uint32_t step, size_t offset,
                              size_t bytes)
{
    return (struct peerwire_frame){ .magic = PEERWIRE_FRAME_DATA, .length = (uint32_t)bytes,
                           .cohort = x->a->cohort_hash, .epoch = x->e->number,
                           .round = x->round, .offset = offset, .count = x->count,
                           .dtype = (uint8_t)x->type, .op = (uint8_t)x->op, .phase = phase,
                           .step = step };
}

/* --- one call: connecting ---------------------------------------------- */

enum dial_state { DIAL_CONNECTING, DIAL_SENDING, DIAL_READING };

struct dial {
    size_t peer;
    int fd;
    enum dial_state state;
    size_t done;
    uint8_t buf[PEERWIRE_HELLO_BYTES];
};

static int dial_start(struct run *x, struct dial *d, size_t peer)
{
    const struct epoch_member *m = &x->e->members[peer];
    struct addrinfo hints = { .ai_socktype = SOCK_STREAM, .ai_flags = AI_NUMERICSERV };
    struct addrinfo *ai;
    char host[IDENT_ADDRESS_MAX + 1], port[8];
    int fd, rc;

    d->peer = peer;
    d->fd = -1;
    /* Both names were checked by allreduce_create, so this cannot fail. */
    rc = peerwire_hello_encode(d->buf, PEERWIRE_GREET, x->e->number, x->a->cohort, x->a->id);
    if (rc < 0)
        return rc;
    if (split_address(m->address, host, sizeof(host), port, sizeof(port)) < 0) {
        log_warn(COMPONENT, "A member's address cannot be dialled.", LF_S("member", m->id),
                 LF_S("address", m->address));
        return -EINVAL;
    }
    /* Resolution of a DNS name blocks and cannot be aborted; the sidecar
     * advertises numeric pod addresses, which resolve at once. */
    rc = getaddrinfo(host, port, &hints, &ai);
    if (rc != 0) {
        log_warn(COMPONENT, "A member's address does not resolve.", LF_S("member", m->id),
                 LF_S("address", m->address), LF_S("error", gai_strerror(rc)));
        return -ECONNRESET;
    }
    fd = socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        rc = -errno;
        freeaddrinfo(ai);
        return rc;
    }
    tune_socket(fd);
    rc = connect(fd, ai->ai_addr, ai->ai_addrlen);
    freeaddrinfo(ai);
    if (rc < 0 && errno != EINPROGRESS) {
        close(fd);
        return -ECONNRESET;
    }
    d->fd = fd;
    d->state = DIAL_CONNECTING;
    d->done = 0;
    return 0;
}

/* Advances a dial. Returns 1 when the connection is greeted and accepted,
 * 0 when it needs to wait, or an error. */
static int dial_step(struct run *x, struct dial *d)
{
    struct peerwire_hello h;
    ssize_t k;

    if (d->state == DIAL_CONNECTING) {
        int err = 0;
        socklen_t el = sizeof(err);
        struct pollfd p = { .fd = d->fd, .events = POLLOUT };

        if (poll(&p, 1, 0) <= 0)
            return 0;
        if (getsockopt(d->fd, SOL_SOCKET, SO_ERROR, &err, &el) < 0 || err != 0)
            return -ECONNRESET;
        d->state = DIAL_SENDING;
    }
    if (d->state == DIAL_SENDING) {
        k = send(d->fd, d->buf + d->done, PEERWIRE_HELLO_BYTES - d->done, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (k < 0)
            return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? 0 : -ECONNRESET;
        d->done += (size_t)k;
        if (d->done < PEERWIRE_HELLO_BYTES)
            return 0;
        d->state = DIAL_READING;
        d->done = 0;
    }
    k = recv(d->fd, d->buf + d->done, PEERWIRE_HELLO_BYTES - d->done, MSG_DONTWAIT);
    if (k == 0)
        return -ECONNRESET;
    if (k < 0)
        return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? 0 : -ECONNRESET;
    d->done += (size_t)k;
    if (d->done < PEERWIRE_HELLO_BYTES)
        return 0;
    if (peerwire_hello_decode(d->buf, sizeof(d->buf), &h) || strcmp(h.cohort, x->a->cohort) != 0)
        return -EPROTO;
    if (h.kind == PEERWIRE_STALE)
        return h.epoch > x->e->number ? -ESTALE : -ECONNRESET;
    if (h.kind != PEERWIRE_ACCEPT || h.epoch != x->e->number ||
        strcmp(h.id, x->e->members[d->peer].id) != 0)
        return -EPROTO;
    return 1;
}

/* Moves greeted connections of this epoch from the inbox into the table;
 * a newer connection from a member replaces the old one (the peer gave
 * the old one up). Others are closed. */
static int take_inbox(struct run *x)
{
    struct allreduce *a = x->a;

    pthread_mutex_lock(&a->mu);
    for (size_t i = 0; i < a->n_inbox; i++) {
        struct inbound *in = &a->inbox[i];
        struct conn *c;

        if (in->epoch != x->e->number || in->peer >= x->n) {
            close(in->fd);
            continue;
        }
        c = conn_new(in->fd, in->peer);
        if (!c) {
            close(in->fd);
            continue;
        }
        if (a->conns[in->peer]) {
            close(a->conns[in->peer]->fd);
            free(a->conns[in->peer]);
        }
        a->conns[in->peer] = c;
    }
    a->n_inbox = 0;
    pthread_mutex_unlock(&a->mu);
    return 0;
}

/* Makes sure there is a connection to every peer in need[]: dials those
 * after us in the member order, waits for the others to dial us. */
static int connect_peers(struct run *x, const size_t *need, size_t n_need)
{
    struct allreduce *a = x->a;
    struct dial dials[MAX_NEED];
    size_t n_dials = 0;
    uint64_t deadline = clock_now_ms() + a->timeout_ms;
    int rc;

    for (;;) {
        struct pollfd pfd[2 + MAX_NEED];
        nfds_t np = 0;
        bool all = true;

        take_inbox(x);
        for (size_t i = 0; i < n_need; i++) {
            size_t p = need[i];
            bool dialling = false;

            if (a->conns[p])
                continue;
            all = false;
            for (size_t k = 0; k < n_dials; k++)
                dialling |= dials[k].peer == p;
            if (p > x->me && !dialling) {
                rc = dial_start(x, &dials[n_dials], p);
                if (rc < 0) {
                    x->fail_peer = p;
                    goto out;
                }
                n_dials++;
            }
        }
        if (all) {
            rc = 0;
            goto out;
        }
        pfd[np++] = (struct pollfd){ .fd = a->abort_fd, .events = POLLIN };
        pfd[np++] = (struct pollfd){ .fd = a->inbox_fd, .events = POLLIN };
        for (size_t k = 0; k < n_dials; k++)
            pfd[np++] = (struct pollfd){ .fd = dials[k].fd,
                                         .events = dials[k].state == DIAL_READING ? POLLIN
                                                                                  : POLLOUT };
        rc = wait_io(x, pfd, np, deadline);
        if (rc < 0)
            goto out;
        if (pfd[1].revents) {
            uint64_t v;
            if (read(a->inbox_fd, &v, sizeof(v)) < 0) {
                /* drained by an earlier wakeup; the inbox is what counts */
            }
        }
        for (size_t k = 0; k < n_dials;) {
            rc = pfd[2 + k].revents ? dial_step(x, &dials[k]) : 0;
            if (rc < 0) {
                x->fail_peer = dials[k].peer;
                goto out;
            }
            if (rc == 1) {
                struct conn *c = conn_new(dials[k].fd, dials[k].peer);
                if (!c) {
                    rc = -ENOMEM;
                    goto out;
                }
                a->conns[dials[k].peer] = c;
                dials[k] = dials[--n_dials];
                pfd[2 + k] = pfd[2 + n_dials];
                continue;
            }
            k++;
        }
    }
out:
    for (size_t k = 0; k < n_dials; k++)
        close(dials[k].fd);
    return rc;
}

/* --- one call: the ring ------------------------------------------------- */

/* Position in the ring schedule: window w, step t, segment j of the chunk
 * that step moves. Both ends of a connection walk the same sequence. */
struct cursor {
    size_t w, t, j;
    size_t base, len;           /* the unit's first element and element count */
    bool done;
};

struct ring {
    size_t seg;                 /* elements per segment */
    size_t win;                 /* elements per window */
    size_t n_windows;
    size_t steps;               /* 2(n - 1) */
    struct cursor s, q;         /* next send, next (or current) receive */
    int tx_slot;                /* slot the frame in flight is sent from, or -1 */
    int rx_slot;
    bool slot_busy[SLOTS];
    int fifo[SLOTS];            /* 16-bit: slots holding sums to forward, in order */
    size_t fifo_head, fifo_len;
};

static size_t chunk_start(size_t total, size_t n, size_t c)
{
    size_t q = total / n, r = total % n;

    return c * q + (c < r ? c : r);
}

/* Settles k on the next existing unit at or after its position. Sends at
 * step t move chunk (me - t), receives chunk (me - t - 1) (shift 1). */
static void cursor_settle(const struct run *x, const struct ring *g, struct cursor *k,
                          size_t shift)
{
    while (k->w < g->n_windows) {
        size_t ws = k->w * g->win;
        size_t wl = x->count - ws < g->win ? x->count - ws : g->win;

        while (k->t < g->steps) {
            size_t c = (x->me + 2 * x->n - k->t - shift) % x->n;
            size_t cs = chunk_start(wl, x->n, c);
            size_t cl = chunk_start(wl, x->n, c + 1) - cs;

            if (k->j * g->seg < cl) {
                k->base = ws + cs + k->j * g->seg;
                k->len = cl - k->j * g->seg < g->seg ? cl - k->j * g->seg : g->seg;
                return;
            }
            k->t++;
            k->j = 0;
        }
        k->w++;
        k->t = 0;
    }
    k->done = true;
}

static void cursor_next(const struct run *x, const struct ring *g, struct cursor *k, size_t shift)
{
    k->j++;
    cursor_settle(x, g, k, shift);
}

/* True when the receive (w, t, j) has completed. */
static bool received(const struct ring *g, size_t w, size_t t, size_t j)
{
    const struct cursor *q = &g->q;

    if (q->done || q->w != w)
        return q->done || q->w > w;
    if (q->t != t)
        return q->t > t;
    return q->j > j;
}

static uint8_t *slot_ptr(const struct run *x, int slot)
{
    return x->a->stage + (size_t)slot * x->a->seg_bytes;
}

static bool ring_send_ready(const struct ring *g)
{
    return g->s.t == 0 || received(g, g->s.w, g->s.t - 1, g->s.j);
}

static void ring_send_start(struct run *x, struct ring *g, struct conn *c)
{
    const struct cursor *s = &g->s;
    bool rs = s->t < x->n - 1;
    /* Step 0 sends our own contribution; every later step sends a partial
     * sum or a result, which live in buf. */
    const void *src = (s->t == 0 ? x->src : x->buf) + s->base * x->esz;
    size_t bytes = s->len * x->esz;
    struct peerwire_frame f;

    g->tx_slot = -1;
    if (x->wide && rs) {
        bytes = s->len * x->asz;
        if (s->t == 0) {
            /* Our own contribution, widened once into the spare slot. */
            dtype_widen(x->type, (float *)slot_ptr(x, SLOTS), (const uint16_t *)src, s->len);
            src = slot_ptr(x, SLOTS);
        } else {
            g->tx_slot = g->fifo[g->fifo_head];
            g->fifo_head = (g->fifo_head + 1) % SLOTS;
            g->fifo_len--;
            src = slot_ptr(x, g->tx_slot);
        }
    }
    f = frame_for(x, rs ? PEERWIRE_PHASE_RS : PEERWIRE_PHASE_AG, (uint32_t)s->t, s->base, bytes);
    tx_start(c, &f, src);
}

/* Starts the next receive if it has somewhere to land. */
static bool ring_recv_start(struct run *x, struct ring *g, struct conn *c)
{
    const struct cursor *q = &g->q;
    bool rs = q->t < x->n - 1;
    struct peerwire_frame f;
    void *dst;
    size_t bytes;

    if (rs) {
        int slot = -1;

        for (int i = 0; i < SLOTS && slot < 0; i++)
            if (!g->slot_busy[i])
                slot = i;
        if (slot < 0)
            return false;
        g->slot_busy[slot] = true;
        g->rx_slot = slot;
        dst = slot_ptr(x, slot);
        bytes = q->len * x->asz;
    } else {
        dst = x->buf + q->base * x->esz;
        bytes = q->len * x->esz;
    }
    f = frame_for(x, rs ? PEERWIRE_PHASE_RS : PEERWIRE_PHASE_AG, (uint32_t)q->t, q->base, bytes);
    rx_start(c, &f, dst);
    return true;
}

/* A reduce-scatter segment arrived: fold our own data in. At the last
 * reduce-scatter step the segment is final here: scale it (avg) and, for
 * 16-bit types, round it into the user buffer. */
static void ring_recv_done(struct run *x, struct ring *g)
{
    const struct cursor *q = &g->q;
    bool last = q->t == x->n - 2;
    uint8_t *slot;

    if (q->t >= x->n - 1)
        return;                 /* all-gather: it landed in the user buffer */
    slot = slot_ptr(x, g->rx_slot);
    if (!x->wide) {
        void *dst = x->buf + q->base * x->esz;

        /* Out of place, our contribution is read where it is and the sum
         * written once: no more memory traffic than in place. */
        if (x->src != x->buf)
            dtype_combine_into(x->acc, x->op, dst, x->src + q->base * x->esz, slot, q->len);
        else
            dtype_combine(x->acc, x->op, dst, slot, q->len);
        if (last)
            dtype_scale(x->acc, dst, q->len, x->div);
        g->slot_busy[g->rx_slot] = false;
        return;
    }
    dtype_combine_widen(x->type, x->op, (float *)slot, (const uint16_t *)x->src + q->base, q->len);
    if (last) {
        dtype_scale(DTYPE_F32, slot, q->len, x->div);
        dtype_narrow(x->type, (uint16_t *)x->buf + q->base, (const float *)slot, q->len);
        g->slot_busy[g->rx_slot] = false;
        return;
    }
    g->fifo[(g->fifo_head + g->fifo_len) % SLOTS] = g->rx_slot;
    g->fifo_len++;
}

/* Sleeps until L can receive, R can send, R's control side has something
 * to say, the epoch changes, or the silence deadline passes. */
static int ring_wait(struct run *x, struct conn *L, struct conn *R, bool watch)
{
    struct pollfd pfd[3];
    nfds_t np = 0;
    uint64_t now = clock_now_ms(), d1, d2;
    int rc;

    since_update(L, now);
    if (R != L)
        since_update(R, now);
    d1 = silence_deadline(x, L, false);
    d2 = silence_deadline(x, R, watch);
    if (!R->tx_busy && !L->rx_busy) {
        /* Nothing to send, nowhere to receive: cannot happen (see SLOTS);
         * fail rather than wait forever if it ever does. */
        log_error(COMPONENT, "The ring schedule stalled.", LF_S("cohort", x->a->cohort));
        return -EIO;
    }
    /* Idle descriptors stay out of poll: a hung-up one would spin it. */
    pfd[np++] = (struct pollfd){ .fd = x->a->abort_fd, .events = POLLIN };
    pfd[np++] = (struct pollfd){ .fd = L->rx_busy ? L->fd : -1, .events = POLLIN };
    if (R == L) {
        pfd[1].fd = L->fd;
        pfd[1].events = (short)((L->rx_busy ? POLLIN : 0) | (L->tx_busy ? POLLOUT : 0));
    } else {
        pfd[np++] = (struct pollfd){ .fd = R->fd,
                                     .events = (short)((R->tx_busy ? POLLOUT : 0) | POLLIN) };
    }
    rc = wait_io(x, pfd, np, d1 < d2 ? d1 : d2);
    if (rc == -ETIMEDOUT)
        x->fail_peer = d1 < d2 ? L->peer : R->peer;
    if (rc < 0)
        return rc;
    if (watch && (pfd[2].revents & (POLLIN | POLLHUP | POLLERR))) {
        rc = rx_pump(x, R);
        if (rc < 0 || !R->rx_busy) {
            /* Anything but silence on the control side ends the call. */
            x->fail_peer = R->peer;
            return rc < 0 ? rc : -EPROTO;
        }
    }
    return 0;
}

static int ring_run(struct run *x)
{
    struct allreduce *a = x->a;
    struct conn *L = a->conns[(x->me + x->n - 1) % x->n];
    struct conn *R = a->conns[(x->me + 1) % x->n];
    bool watch = L != R;        /* R's inbound side carries only control frames */
    struct ring g = { .tx_slot = -1, .rx_slot = -1 };
    uint64_t now = clock_now_ms(), spin_from = 0;
    int rc;

    g.seg = a->seg_bytes / x->asz;
    g.win = x->n * g.seg *
            (x->wide ? WINDOW_UNITS_WIDE : x->n == 2 ? WINDOW_UNITS_PAIR : WINDOW_UNITS);
    g.n_windows = (x->count + g.win - 1) / g.win;
    g.steps = 2 * (x->n - 1);
    cursor_settle(x, &g, &g.s, 0);
    cursor_settle(x, &g, &g.q, 1);
    L->rx_since = R->tx_since = now;
    if (watch) {
        struct peerwire_frame ctl = { 0 };
        rx_start(R, &ctl, NULL);
    }
    for (;;) {
        bool moved = false;

        if (stale(x))
            return -ESTALE;
        if (!R->tx_busy && !g.s.done && ring_send_ready(&g)) {
            ring_send_start(x, &g, R);
            cursor_next(x, &g, &g.s, 0);
        }
        if (R->tx_busy) {
            rc = tx_pump(R);
            if (rc < 0) {
                x->fail_peer = R->peer;
                return refine(x, R, rc);
            }
            moved |= rc > 0;
            if (!R->tx_busy && g.tx_slot >= 0) {
                g.slot_busy[g.tx_slot] = false;
                g.tx_slot = -1;
            }
        }
        if (!L->rx_busy && !g.q.done)
            ring_recv_start(x, &g, L);
        if (L->rx_busy) {
            rc = rx_pump(x, L);
            if (rc < 0) {
                x->fail_peer = L->peer;
                return rc;
            }
            moved |= rc > 0;
            if (!L->rx_busy) {
                ring_recv_done(x, &g);
                cursor_next(x, &g, &g.q, 1);
            }
        }
        if (g.s.done && g.q.done && !R->tx_busy)
            return 0;
        if (moved) {
            spin_from = 0;
            continue;
        }
        if (spin(&spin_from))
            continue;
        rc = ring_wait(x, L, R, watch);
        if (rc < 0)
            return rc;
    }
}

/* --- one call: recursive doubling --------------------------------------- */

/* Sends slen bytes to `to` while receiving rlen bytes from `from` (either
 * may be NULL), as RD step `step`. */
static int exchange(struct run *x, struct conn *to, const void *src, size_t slen,
                    struct conn *from, void *dst, size_t rlen, uint32_t step)
{
    struct peerwire_frame f;
    uint64_t now = clock_now_ms(), spin_from = 0;
    int rc;

    if (to) {
        f = frame_for(x, PEERWIRE_PHASE_RD, step, 0, slen);
        tx_start(to, &f, src);
        to->tx_since = now;
    }
    if (from) {
        f = frame_for(x, PEERWIRE_PHASE_RD, step, 0, rlen);
        rx_start(from, &f, dst);
        from->rx_since = now;
    }
    for (;;) {
        bool moved = false;
        struct pollfd pfd[3];
        nfds_t np = 0;
        uint64_t d = UINT64_MAX;

        if (stale(x))
            return -ESTALE;
        if (to && to->tx_busy) {
            rc = tx_pump(to);
            if (rc < 0) {
                x->fail_peer = to->peer;
                return refine(x, to, rc);
            }
            moved |= rc > 0;
        }
        if (from && from->rx_busy) {
            rc = rx_pump(x, from);
            if (rc < 0) {
                x->fail_peer = from->peer;
                return rc;
            }
            moved |= rc > 0;
        }
        if (!(to && to->tx_busy) && !(from && from->rx_busy))
            return 0;
        if (moved) {
            spin_from = 0;
            continue;
        }
        if (spin(&spin_from))
            continue;
        now = clock_now_ms();
        pfd[np++] = (struct pollfd){ .fd = x->a->abort_fd, .events = POLLIN };
        if (to && to->tx_busy) {
            since_update(to, now);
            d = silence_deadline(x, to, false);
            pfd[np++] = (struct pollfd){ .fd = to->fd, .events = POLLOUT };
        }
        if (from && from->rx_busy) {
            uint64_t d2;

            since_update(from, now);
            d2 = silence_deadline(x, from, false);
            d = d2 < d ? d2 : d;
            if (np == 2 && from == to)
                pfd[1].events |= POLLIN;
            else
                pfd[np++] = (struct pollfd){ .fd = from->fd, .events = POLLIN };
        }
        rc = wait_io(x, pfd, np, d);
        if (rc < 0) {
            x->fail_peer = from ? from->peer : to->peer;
            return rc;
        }
    }
}

/* Combines the partner's value (tmp) into ours (acc), the lower-ranked
 * group's operand first so both partners compute the same bytes. */
static void combine_ordered(struct run *x, void *acc, void *tmp, bool we_are_lower)
{
    if (we_are_lower) {
        dtype_combine(x->acc, x->op, acc, tmp, x->count);
    } else {
        dtype_combine(x->acc, x->op, tmp, acc, x->count);
        memcpy(acc, tmp, x->count * x->asz);
    }
}

struct rd_shape {
    size_t p2, rem;             /* largest power of two <= n, and n - p2 */
};

static struct rd_shape rd_shape(size_t n)
{
    struct rd_shape s = { 1, 0 };

    while (s.p2 * 2 <= n)
        s.p2 *= 2;
    s.rem = n - s.p2;
    return s;
}

static size_t rd_real(struct rd_shape s, size_t v)
{
    return v < s.rem ? 2 * v + 1 : v + s.rem;
}

/* The peers recursive doubling talks to from member r. */
static size_t rd_needs(size_t n, size_t r, size_t *need)
{
    struct rd_shape s = rd_shape(n);
    size_t k = 0, v;

    if (r < 2 * s.rem) {
        need[k++] = r % 2 == 0 ? r + 1 : r - 1;
        if (r % 2 == 0)
            return k;
        v = r / 2;
    } else {
        v = r - s.rem;
    }
    for (size_t mask = 1; mask < s.p2; mask <<= 1)
        need[k++] = rd_real(s, v ^ mask);
    return k;
}

static int rd_run(struct run *x)
{
    struct allreduce *a = x->a;
    struct rd_shape s = rd_shape(x->n);
    size_t r = x->me, wire = x->count * x->asz, v;
    uint8_t *acc = x->wide ? a->rd_a : x->buf;
    uint8_t *tmp = x->wide ? a->rd_b : a->rd_a;
    uint32_t step = 1;
    int rc;

    if (x->wide)
        dtype_widen(x->type, (float *)acc, (const uint16_t *)x->buf, x->count);
    if (r < 2 * s.rem && r % 2 == 0) {
        /* An extra member: hand our data over, get the result back. */
        struct conn *c = a->conns[r + 1];

        rc = exchange(x, c, acc, wire, NULL, NULL, 0, 0);
        if (rc == 0)
            rc = exchange(x, NULL, NULL, 0, c, x->buf, x->count * x->esz, UINT32_MAX);
        return rc;
    }
    if (r < 2 * s.rem) {
        rc = exchange(x, NULL, NULL, 0, a->conns[r - 1], tmp, wire, 0);
        if (rc < 0)
            return rc;
        combine_ordered(x, acc, tmp, false);
        v = r / 2;
    } else {
        v = r - s.rem;
    }
    for (size_t mask = 1; mask < s.p2; mask <<= 1, step++) {
        struct conn *c = a->conns[rd_real(s, v ^ mask)];

        rc = exchange(x, c, acc, wire, c, tmp, wire, step);
        if (rc < 0)
            return rc;
        combine_ordered(x, acc, tmp, v < (v ^ mask));
    }
    dtype_scale(x->acc, acc, x->count, x->div);
    if (x->wide)
        dtype_narrow(x->type, (uint16_t *)x->buf, (const float *)acc, x->count);
    if (r < 2 * s.rem)
        return exchange(x, a->conns[r - 1], x->buf, x->count * x->esz, NULL, NULL, 0, UINT32_MAX);
    return 0;
}

/* --- one call ----------------------------------------------------------- */

/* Alone in the epoch: only the scaling is left to do. 16-bit buffers are
 * scaled through a staging slot, one segment at a time. */
static void run_alone(struct run *x)
{
    size_t seg = x->a->seg_bytes / sizeof(float);

    if (!x->wide) {
        dtype_scale(x->acc, x->buf, x->count, x->div);
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
    close_all(a, -ESTALE, e->number, clock_now_ms());
    free(a->conns);
    epoch_unref(a->conn_epoch);
    a->conns = conns;
    a->conn_epoch = epoch_ref(e);
    return 0;
}

static int run_call(struct run *x)
{
    struct allreduce *a = x->a;
    size_t need[MAX_NEED], n_need;
    long me;
    bool rd;
    int rc;

    if (!x->e)
        return -ESTALE;
    me = epoch_find(x->e, a->id);
    if (me < 0)
        return -ESTALE;
    x->me = (size_t)me;
    x->n = x->e->n_members;
    rc = dtype_divisor(x->type, x->op, x->n, x->div, &x->div);
    if (rc < 0)
        return rc;
    if (x->count == 0)
        return 0;
    rd = a->small_bytes != ALLREDUCE_SMALL_NONE && x->count <= a->small_bytes / x->asz;
    /* Alone, and recursive doubling (small buffers only), work in place:
     * copying the contribution first costs little there. */
    if ((x->n == 1 || rd) && x->src != x->buf) {
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
    if (rd) {
        n_need = rd_needs(x->n, x->me, need);
    } else {
        n_need = 0;
        need[n_need++] = (x->me + 1) % x->n;
        if (x->n > 2)
            need[n_need++] = (x->me + x->n - 1) % x->n;
    }
    rc = connect_peers(x, need, n_need);
    if (rc == 0)
        rc = rd ? rd_run(x) : ring_run(x);
    if (rc < 0) {
        log_warn(COMPONENT, "All-reduce failed.", LF_S("cohort", a->cohort),
                 LF_U("epoch", x->e->number), LF_U("round", x->round), LF_ERR(rc),
                 LF_S("peer", x->fail_peer < x->n ? x->e->members[x->fail_peer].id : NULL));
        close_all(a, rc, newest_epoch(a), clock_now_ms() + ABORT_GRACE_MS);
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
    struct run x = { .a = a, .round = round, .count = count, .type = type, .op = op,
                     .div = denominator, .fail_peer = SIZE_MAX };
    int rc;

    if (!a || !handle_ok(a, in) || !handle_ok(a, out) || !dtype_valid((int)type) ||
        !dtype_op_valid((int)op))
        return -EINVAL;
    x.esz = dtype_size(type);
    x.acc = dtype_acc(type);
    x.asz = dtype_size(x.acc);
    x.wide = dtype_is_16bit_float(type);
    x.buf = a->regs[out].buf;
    x.src = a->regs[in].buf;
    if (count > a->regs[in].bytes / x.esz || count > a->regs[out].bytes / x.esz)
        return -EINVAL;
    pthread_mutex_lock(&a->mu);
    if (atomic_load(&a->running)) {
        pthread_mutex_unlock(&a->mu);
        return -EBUSY;
    }
    atomic_store(&a->running, true);
    x.e = epoch_ref(a->epoch);
    x.gen = atomic_load(&a->gen);
    pthread_mutex_unlock(&a->mu);

    rc = run_call(&x);

    pthread_mutex_lock(&a->mu);
    atomic_store(&a->running, false);
    pthread_mutex_unlock(&a->mu);
    epoch_unref(x.e);
    return rc;
}

/* src/engine/conn.c: see conn.h.
 *
 * FRAMES IN STEP
 *
 * The schedule is deterministic, so a receiver knows exactly which frame
 * comes next and compares every field of its header (peerwire.h); the
 * payload is read only into the slot or buffer range it expects, never
 * beyond. A frame that differs (another epoch, round, count, type, op,
 * offset or length) fails the call with -EPROTO and the connection is
 * closed, not resynchronised: connections belong to one epoch and every
 * failed call closes its connections, so a mismatch means the peer lost
 * sync and nothing after it on that stream can be trusted. A BYE says the
 * peer is leaving the call and why (errno and its newest epoch); the
 * receiver fails with the same error, -ESTALE for an epoch change.
 *
 * The pumps move bytes and nothing else: a payload leaves from where the
 * algorithm staged it and lands where the algorithm said, untouched (see
 * allreduce.c, "the codec seam").
 *
 * With --integrity mac a connection is sealed: every frame, BYEs included,
 * carries a tag after its header (peerauth.h), computed once when the
 * frame is put in flight. The receiver feeds the payload to the check as
 * it arrives, while it is in cache, and a frame is done only when its tag
 * verifies; one that does not fails the call with -EPROTO. A frame's
 * payload may by then have landed in the user buffer, but a failed call
 * leaves that buffer unspecified anyway: nothing unverified is ever
 * returned as a result. Unsealed, no crypto runs and nothing is allocated
 * per frame: the only cost is a header length read from the connection.
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
 * allreduce.c's ABORT_GRACE_MS) and closes them, so its neighbours fail
 * fast with the same cause instead of waiting out their own timeouts. A
 * SIGKILLed peer's kernel closes its sockets, so its neighbours see a
 * reset at once.
 *
 * Spinning SPIN_US = 50 us (yielding) before poll, measured on the 2-core
 * development VM (`cohortctl bench allreduce`, f32 sum, loopback): 4 KiB
 * at n=2 from 47 to 13 us, at n=4 from 111 to 59-67 us; 64 MiB at n=4
 * from 0.65 to 0.76 GB/s; no change at n=2.
 *
 * REACHABILITY
 *
 * A peer that stops answering is not always cut off: its trainer may be
 * slow, or it may itself wait on a third member. The kernel can tell the
 * difference: a live host acknowledges bytes and answers keepalive
 * probes whatever its process does. So, once allreduce_set_unreachable_ms
 * turned it on, every connection keeps TCP keepalive with a 1 s idle and
 * a 1 s interval (and enough probes that keepalive never ends a
 * connection before the engine's own silence timeout would), and while a
 * call waits, every REACH_CHECK_MS, it reads TCP_INFO of each connection
 * of its epoch: one from which nothing at all (data, an acknowledgement,
 * a probe's answer) arrived for the set time names its peer to
 * on_peer_unreachable; so does a dial whose SYN went unanswered that
 * long. An algorithm talks to a few members only (a ring to two), and the
 * broker wants most of the epoch to agree, so a call that has waited
 * REACH_PROBE_AFTER_MS also probes the members it has no connection to:
 * a bare non-blocking connect to the member's data address, closed with a
 * reset as soon as the host answers (a SYN-ACK, or a reset of its own: a
 * live host either way), which the member's acceptor drops silently
 * since no byte came; a probe still unanswered after the set time names
 * its member. A round probes limit_reach_probes(n) members of an epoch
 * of n (base/limits.h: 64, or an eighth of the others in an epoch of
 * more than 513, up to 2048), in turn over the epoch, and the next round
 * starts once they have all settled and the set time has passed since,
 * so a waiting member probes each other member at most once per that
 * time (members on one host share one source address, and the acceptor
 * holds at most PENDING_PER_SOURCE unfinished greetings from one). So the
 * reports about a cut-off member come over limit_reach_rounds(n) rounds,
 * at most 8 up to 16,385 members, and the broker counts them over that
 * many timeouts (broker.h): at the defaults, 8 rounds of 5 s end well
 * before the engine's own silence timeout of 60 s, after which the node
 * resyncs into a new epoch and the reports would be stale. A round holds
 * one socket per probe until the next check, so it takes at most a
 * quarter of the process's open-file limit (said once in the log when
 * that is fewer than the epoch asks for; the broker's window then ends
 * before this member has probed everyone). The call goes on: the broker
 * decides, and its new epoch ends the call with -ESTALE.
 *
 * CONNECTING
 *
 * The member lower in the epoch's order connects and greets (the other
 * side, and the greeting's authentication, are in acceptor.c); a
 * connection greeted and accepted belongs to the epoch it was greeted in,
 * and the table (struct allreduce's conns) holds one per peer for the
 * epoch of the last call. Keyed, the connector checks the acceptor's MAC
 * before it confirms with its own: an acceptor that cannot prove the key
 * fails the call with -EACCES, and is told so with a REFUSE. Every dial
 * carries the engine's incarnation and a new serial, so that the acceptor
 * can tell a reconnection from a replay or an older process. */
#include "engine/conn.h"

#include <errno.h>
#include <limits.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <openssl/crypto.h>

#include "base/clock.h"
#include "base/ident.h"
#include "base/log.h"
#include "base/secret.h"
#include "engine/allreduce_impl.h"
#include "engine/peerauth.h"

/* Before sleeping in poll, keep trying for this long, yielding the core
 * between tries. A wakeup through poll costs tens of microseconds on a
 * loaded host, more than a small all-reduce step; yielding lets another
 * member sharing this core (or any other process) run meanwhile. */
#ifndef SPIN_US
#define SPIN_US 50
#endif

#define DRAIN_BYTES (1 << 20)   /* read and dropped before close, to avoid a reset */

/* --- sockets ------------------------------------------------------------ */

/* A dial in progress (conn_connect_peers). */
enum dial_state { DIAL_CONNECTING, DIAL_SENDING, DIAL_READING, DIAL_CONFIRMING };

struct dial {
    size_t peer;
    int fd;
    enum dial_state state;
    uint64_t started;           /* connect() called */
    uint64_t unreach_told;      /* as struct conn's */
    size_t done;
    uint64_t serial;
    uint8_t nonce_c[PEERWIRE_NONCE_BYTES];
    uint8_t key_tx[PEERAUTH_KEY_BYTES], key_rx[PEERAUTH_KEY_BYTES];  /* sealed, once answered */
    uint8_t buf[PEERWIRE_HELLO_BYTES];
};

void conn_tune_socket(int fd)
{
    int one = 1;

    /* Frames are written whole with writev; Nagle would only hold back the
     * tail of each one. */
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

/* Keepalive for reachability (see the top): probes after 1 s idle, every
 * 1 s, and enough of them to outlast the engine's silence timeout. A
 * socket that refuses an option keeps the kernel's defaults; its peer may
 * then be reported unreachable while idle, which the broker weighs with
 * the others' reports. */
static void keepalive_on(const struct allreduce *a, int fd)
{
    int one = 1, cnt = (int)(a->timeout_ms / 1000u + 1u);

    if (cnt > 127)
        cnt = 127;              /* the kernel's cap */
    setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &one, sizeof(one));
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &one, sizeof(one));
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof(cnt));
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

static void conn_free(struct conn *c)
{
    peerauth_stream_cleanup(&c->tx_mac);
    peerauth_stream_cleanup(&c->rx_mac);
    free(c);
}

/* A connection of a's on fd to member `peer`. With --integrity mac it is
 * sealed, with tx_key for the frames it sends and rx_key for those it
 * receives (copied; the caller wipes its own). Returns NULL when out of
 * memory (or libcrypto failed); fd is still the caller's then. */
static struct conn *conn_new(const struct allreduce *a, int fd, size_t peer,
                             const uint8_t *tx_key, const uint8_t *rx_key)
{
    struct conn *c = calloc(1, sizeof(*c));

    if (!c)
        return NULL;
    c->fd = fd;
    c->peer = peer;
    c->hdr_len = PEERWIRE_FRAME_BYTES;
    if (a->integrity) {
        if (peerauth_stream_init(&c->tx_mac, tx_key) < 0 ||
            peerauth_stream_init(&c->rx_mac, rx_key) < 0) {
            conn_free(c);
            return NULL;
        }
        c->sealed = true;
        c->hdr_len += PEERWIRE_TAG_BYTES;
    }
    if (atomic_load(&a->unreach_ms))
        keepalive_on(a, fd);
    return c;
}

/* The tag of the frame in c->tx_hdr (payload at `payload`), after it. */
static void seal(struct conn *c, const void *payload, size_t len)
{
    if (peerauth_stream_seal(&c->tx_mac, c->tx_hdr, payload, len,
                             c->tx_hdr + PEERWIRE_FRAME_BYTES) < 0) {
        /* libcrypto does not fail on these inputs; if it ever did, the
         * zero tag fails at the receiver, and so does the call. */
        log_error(COMPONENT, "A frame could not be sealed.", LF_U("peer_index", c->peer));
        memset(c->tx_hdr + PEERWIRE_FRAME_BYTES, 0, PEERWIRE_TAG_BYTES);
    }
}

int conn_tx_pump(struct conn *c)
{
    struct iovec iov[2];
    struct msghdr m = { .msg_iov = iov };
    size_t hl = c->hdr_len, pd = c->tx_done > hl ? c->tx_done - hl : 0;
    ssize_t w;

    if (c->tx_done < hl)
        iov[m.msg_iovlen++] = (struct iovec){ c->tx_hdr + c->tx_done, hl - c->tx_done };
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
    if (c->tx_done == hl + c->tx_len)
        c->tx_busy = false;
    return 1;
}

void conn_tx_start(struct conn *c, const struct peerwire_frame *f, const void *payload)
{
    peerwire_frame_encode(c->tx_hdr, f);
    if (c->sealed)
        seal(c, payload, f->length);
    c->tx_buf = payload;
    c->tx_len = f->length;
    c->tx_done = 0;
    c->tx_busy = true;
    c->tx_moved = true;
}

void conn_rx_start(struct conn *c, const struct peerwire_frame *want, void *dst)
{
    c->rx_want = *want;
    c->rx_buf = dst;
    c->rx_len = want->magic ? want->length : 0;
    c->rx_done = 0;
    c->rx_maced = 0;
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
    struct peerwire_frame bye = { .magic = PEERWIRE_FRAME_BYE, .cohort = cohort_hash,
                                  .epoch = epoch, .step = (uint32_t)(err < 0 ? -err : err) };

    if (!c)
        return;
    while (c->tx_busy && c->tx_done > 0) {
        uint64_t now = clock_now_ms();
        struct pollfd p = { .fd = c->fd, .events = POLLOUT };
        int r = conn_tx_pump(c);

        if (r < 0 || now >= deadline)
            break;
        if (r == 0 && poll(&p, 1, (int)(deadline - now)) <= 0)
            break;
    }
    if (!c->tx_busy || c->tx_done == 0) {
        /* A frame sealed but never sent took a number the BYE now gets. */
        if (c->sealed && c->tx_busy)
            c->tx_mac.seq--;
        peerwire_frame_encode(c->tx_hdr, &bye);
        if (c->sealed)
            seal(c, NULL, 0);
        if (send(c->fd, c->tx_hdr, c->hdr_len, MSG_NOSIGNAL | MSG_DONTWAIT) < 0) {
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
    conn_free(c);
}

void conn_close_all(struct allreduce *a, int err, uint64_t epoch, uint64_t deadline)
{
    size_t n = a->conn_epoch ? a->conn_epoch->n_members : 0;

    for (size_t i = 0; i < n; i++) {
        conn_close(a->conns[i], a->cohort_hash, err, epoch, deadline);
        a->conns[i] = NULL;
    }
}

/* --- a call's frames ---------------------------------------------------- */

/* Names x's peer `peer` to on_peer_unreachable, at most once per `ms`
 * (*told: when it last did). */
static void reach_tell(struct run *x, size_t peer, uint32_t ms, uint64_t heard_ms, uint64_t now,
                       uint64_t *told)
{
    struct allreduce *a = x->a;

    if (*told && now - *told < ms)
        return;
    *told = now;
    log_warn(COMPONENT, "Nothing heard from a peer's host for the member timeout; reporting it "
                        "unreachable.",
             LF_S("cohort", a->cohort), LF_U("epoch", x->e->number),
             LF_S("peer", x->e->members[peer].id), LF_U("silent_ms", heard_ms));
    a->on_peer_unreachable(a->peer_unreachable_arg, x->e->members[peer].id, x->e->number);
}

/* Closes probe k with a reset (no TIME_WAIT left behind) and forgets it. */
static void reach_probe_close(struct allreduce *a, size_t k)
{
    struct linger lg = { .l_onoff = 1, .l_linger = 0 };

    setsockopt(a->probes[k].fd, SOL_SOCKET, SO_LINGER, &lg, sizeof(lg));
    close(a->probes[k].fd);
    a->probes[k] = a->probes[--a->n_probes];
}

void conn_probes_close(struct allreduce *a)
{
    while (a->n_probes > 0)
        reach_probe_close(a, a->n_probes - 1);
}

/* Starts a probe of x's member `peer`; a member whose address is no
 * numeric host:port, or a socket that cannot be had, is not probed. */
static void reach_probe_start(struct run *x, size_t peer, uint64_t now)
{
    struct allreduce *a = x->a;
    struct addrinfo hints = { .ai_socktype = SOCK_STREAM,
                              .ai_flags = AI_NUMERICHOST | AI_NUMERICSERV };
    struct addrinfo *ai;
    char host[IDENT_ADDRESS_MAX + 1], port[8];
    int fd;

    if (split_address(x->e->members[peer].address, host, sizeof(host), port, sizeof(port)) < 0 ||
        getaddrinfo(host, port, &hints, &ai) != 0)
        return;
    fd = socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd >= 0 && connect(fd, ai->ai_addr, ai->ai_addrlen) < 0 && errno != EINPROGRESS) {
        close(fd);              /* refused at once: the host answered */
        fd = -1;
    }
    freeaddrinfo(ai);
    if (fd < 0)
        return;
    a->probes[a->n_probes++] = (struct probe){ .fd = fd, .peer = peer, .started = now };
}

/* Whether x's member `peer` has a connection or a dial. A round starts
 * with no probe in flight and visits each member once, so no probe can
 * cover it yet. */
static bool reach_covered(const struct run *x, size_t peer)
{
    const struct allreduce *a = x->a;

    if (a->conn_epoch == x->e && a->conns[peer])
        return true;
    for (size_t k = 0; k < a->n_dials; k++)
        if (a->dials[k].peer == peer)
            return true;
    return false;
}

/* How many members a round of x probes: limit_reach_probes of its epoch,
 * but at most a quarter of the open-file limit, since each probe holds a
 * socket until the next check and the call's own connections must still
 * open. */
static size_t reach_round_size(struct run *x)
{
    struct allreduce *a = x->a;
    size_t want = limit_reach_probes(x->n), can = want;
    struct rlimit rl;

    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY &&
        rl.rlim_cur / 4 < want)
        can = rl.rlim_cur / 4 ? (size_t)(rl.rlim_cur / 4) : 1;
    if (can < want && !a->probe_clamp_told) {
        a->probe_clamp_told = true;
        log_warn(COMPONENT, "The open-file limit allows fewer reachability probes a round than "
                            "the epoch's size asks for; a cut-off member may stall the rounds "
                            "until the heal. Raise the limit (ulimit -n) to four times the probes.",
                 LF_S("cohort", a->cohort), LF_U("n_members", x->n), LF_U("probes", want),
                 LF_U("allowed", can), LF_U("nofile", (uint64_t)rl.rlim_cur));
    }
    return can;
}

/* Settles the probes in flight (an answered one is closed; one
 * unanswered for `ms` names its member and is closed), then, when a round
 * is due, starts the next one. */
static void reach_probe(struct run *x, uint32_t ms, uint64_t now)
{
    struct allreduce *a = x->a;
    size_t round, from;

    for (size_t k = 0; k < a->n_probes;) {
        struct probe *p = &a->probes[k];
        struct tcp_info ti;
        socklen_t len = sizeof(ti);
        uint64_t told = 0;

        memset(&ti, 0, sizeof(ti));
        if (getsockopt(p->fd, IPPROTO_TCP, TCP_INFO, &ti, &len) == 0 &&
            ti.tcpi_state == TCP_SYN_SENT) {
            if (now - p->started < ms) {
                k++;
                continue;
            }
            reach_tell(x, p->peer, ms, now - p->started, now, &told);
        }
        reach_probe_close(a, k);
    }
    if (a->n_probes > 0 || now - x->started < REACH_PROBE_AFTER_MS || now < a->probe_round_at)
        return;
    a->probe_round_at = now + ms;
    round = reach_round_size(x);
    from = a->probe_next;       /* probe_next moves as the round goes */
    for (size_t i = 0; i < x->n && a->n_probes < round; i++) {
        size_t peer = (from + i) % x->n;

        if (peer == x->me || reach_covered(x, peer))
            continue;
        reach_probe_start(x, peer, now);
        a->probe_next = (peer + 1) % x->n;
    }
}

/* The reachability check (see the top), due every REACH_CHECK_MS while
 * a call waits. Returns when the next one is due. */
static uint64_t reach_check(struct run *x, uint64_t now)
{
    struct allreduce *a = x->a;
    uint32_t ms = atomic_load(&a->unreach_ms);

    if (!ms || !a->on_peer_unreachable)
        return UINT64_MAX;
    if (now < a->reach_next)
        return a->reach_next;
    a->reach_next = now + REACH_CHECK_MS;
    for (size_t i = 0; a->conn_epoch == x->e && i < x->n; i++) {
        struct conn *c = a->conns[i];
        struct tcp_info ti;
        socklen_t len = sizeof(ti);
        uint64_t heard;

        if (!c || i == x->me)
            continue;
        memset(&ti, 0, sizeof(ti));
        if (getsockopt(c->fd, IPPROTO_TCP, TCP_INFO, &ti, &len) < 0 ||
            ti.tcpi_state != TCP_ESTABLISHED)
            continue;           /* a broken connection fails the call by itself */
        heard = ti.tcpi_last_data_recv < ti.tcpi_last_ack_recv ? ti.tcpi_last_data_recv
                                                               : ti.tcpi_last_ack_recv;
        if (heard >= ms)
            reach_tell(x, i, ms, heard, now, &c->unreach_told);
    }
    for (size_t k = 0; k < a->n_dials; k++) {
        struct dial *d = &a->dials[k];

        if (d->state == DIAL_CONNECTING && now - d->started >= ms)
            reach_tell(x, d->peer, ms, now - d->started, now, &d->unreach_told);
    }
    reach_probe(x, ms, now);
    return a->reach_next;
}

int conn_wait(struct run *x, struct pollfd *pfd, nfds_t n, uint64_t deadline)
{
    /* Every wait of a run comes here: the caller's deadline bounds them
     * all (allreduce_set_call_deadline). */
    if (x->a->call_deadline_ms && x->a->call_deadline_ms < deadline)
        deadline = x->a->call_deadline_ms;
    for (;;) {
        uint64_t now = clock_now_ms(), until = deadline, check;
        int k;

        if (run_stale(x))
            return -ESTALE;
        if (now >= deadline)
            return -ETIMEDOUT;
        check = reach_check(x, now);
        if (check < until)
            until = check;
        k = poll(pfd, n, until - now > INT_MAX ? INT_MAX : (int)(until - now));
        if (k < 0 && errno != EINTR)
            return -errno;
        if (k <= 0)
            continue;
        if (pfd[0].revents) {
            uint64_t v;
            if (read(x->a->abort_fd, &v, sizeof(v)) < 0) {
                /* another wakeup drained it */
            }
            if (run_stale(x))
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

static int bad_tag(struct run *x, struct conn *c, const struct peerwire_frame *f)
{
    log_warn(COMPONENT, "Dropped a frame whose MAC does not verify.", LF_S("cohort", x->a->cohort),
             LF_S("peer", x->e->members[c->peer].id), LF_U("epoch", f->epoch),
             LF_U("round", f->round), LF_U("offset", f->offset), LF_U("length", f->length));
    return -EPROTO;
}

/* Compares a received header with the one the schedule expects. Sealed,
 * a BYE's tag is checked here (it has no payload), and a data frame's
 * check begins. */
static int check_header(struct run *x, struct conn *c)
{
    const struct peerwire_frame *w = &c->rx_want;
    struct peerwire_frame f;
    const char *what = NULL;
    int rc = peerwire_frame_decode(c->rx_hdr, sizeof(c->rx_hdr), &f);

    if (rc == 0 && f.magic == PEERWIRE_FRAME_BYE && f.cohort == x->a->cohort_hash) {
        if (c->sealed && (peerauth_stream_begin(&c->rx_mac, c->rx_hdr) < 0 ||
                          peerauth_stream_end(&c->rx_mac, c->rx_hdr + PEERWIRE_FRAME_BYTES) < 0))
            return bad_tag(x, c, &f);
        return bye_error(x, &f);
    }
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
    else if (f.codec != w->codec)
        what = "another codec";
    else if (f.phase != w->phase || f.step != w->step || f.offset != w->offset ||
             f.length != w->length)
        what = "a segment other than the one due";
    if (!what)
        return c->sealed && peerauth_stream_begin(&c->rx_mac, c->rx_hdr) < 0 ? bad_tag(x, c, &f)
                                                                              : 0;
    if (what && strcmp(what, "another codec") == 0) {
        /* The one mismatch a setting causes rather than a bug or a lie:
         * say both sides' codecs, so the operator sees which to align. */
        log_error(COMPONENT, "Refused a peer's frame: it compresses with another codec.",
                  LF_S("cohort", x->a->cohort), LF_S("peer", x->e->members[c->peer].id),
                  LF_S("ours", codec_name(x->codec)),
                  LF_S("theirs", codec_valid(f.codec) ? codec_name((enum codec)f.codec)
                                                      : "unknown"),
                  LF_U("epoch", f.epoch), LF_U("round", f.round));
        return -EPROTO;
    }
    log_warn(COMPONENT, "Dropped a frame that does not match the call.",
             LF_S("cohort", x->a->cohort), LF_S("peer", x->e->members[c->peer].id),
             LF_S("reason", what), LF_U("epoch", f.epoch), LF_U("round", f.round),
             LF_U("offset", f.offset), LF_U("length", f.length));
    return -EPROTO;
}

/* Sealed: gives the payload bytes that arrived since the last call to the
 * frame's check, and once the frame is whole, checks its tag. */
static int check_payload(struct run *x, struct conn *c)
{
    size_t pd = c->rx_done - c->hdr_len, n = pd - c->rx_maced;
    struct peerwire_frame f;

    /* Whole Poly1305 blocks until the last piece (peerauth.h). */
    if (pd < c->rx_len)
        n &= ~(size_t)(PEERAUTH_BLOCK - 1);
    if (n > 0) {
        if (peerauth_stream_update(&c->rx_mac, c->rx_buf + c->rx_maced, n) < 0)
            goto bad;
        c->rx_maced += n;
    }
    if (pd < c->rx_len || peerauth_stream_end(&c->rx_mac, c->rx_hdr + PEERWIRE_FRAME_BYTES) == 0)
        return 0;
bad:
    peerwire_frame_decode(c->rx_hdr, sizeof(c->rx_hdr), &f);
    return bad_tag(x, c, &f);
}

int conn_rx_pump(struct run *x, struct conn *c)
{
    struct iovec iov[2];
    struct msghdr m = { .msg_iov = iov };
    size_t hl = c->hdr_len, pd = c->rx_done > hl ? c->rx_done - hl : 0;
    ssize_t r;
    int rc;

    if (c->rx_done < hl)
        iov[m.msg_iovlen++] = (struct iovec){ c->rx_hdr + c->rx_done, hl - c->rx_done };
    if (pd < c->rx_len)
        iov[m.msg_iovlen++] = (struct iovec){ c->rx_buf + pd, c->rx_len - pd };
    do
        r = recvmsg(c->fd, &m, MSG_DONTWAIT);
    while (r < 0 && errno == EINTR);
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
        return 0;
    if (r <= 0) {
        /* A BYE would have arrived before the end of the stream. */
        x->peer_reset = true;
        return -ECONNRESET;
    }
    c->rx_done += (size_t)r;
    c->rx_moved = true;
    if (!c->rx_checked && c->rx_done >= hl) {
        rc = check_header(x, c);
        if (rc < 0)
            return rc;
        c->rx_checked = true;
    }
    if (c->rx_checked && c->sealed) {
        rc = check_payload(x, c);
        if (rc < 0)
            return rc;
    }
    if (c->rx_checked && c->rx_done == hl + c->rx_len)
        c->rx_busy = false;
    return 1;
}

int conn_refine(struct run *x, struct conn *c, int err)
{
    uint8_t b[HDR_MAX];
    struct peerwire_frame f;

    if (c->rx_busy && c->rx_done > 0)
        return err;             /* mid-frame: a BYE would be further on */
    if (recv(c->fd, b, c->hdr_len, MSG_DONTWAIT | MSG_PEEK) != (ssize_t)c->hdr_len) {
        x->peer_reset = true;   /* no BYE waits: the socket just went */
        return err;
    }
    if (peerwire_frame_decode(b, PEERWIRE_FRAME_BYTES, &f) < 0)
        return err;
    if (c->sealed && !peerauth_stream_peek(&c->rx_mac, b, b + PEERWIRE_FRAME_BYTES))
        return err;
    return f.magic == PEERWIRE_FRAME_BYE && f.cohort == x->a->cohort_hash ? bye_error(x, &f)
                                                                           : err;
}

bool conn_spin(uint64_t *from)
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

void conn_since_update(struct conn *c, uint64_t now)
{
    if (c->tx_moved)
        c->tx_since = now;
    if (c->rx_moved)
        c->rx_since = now;
    c->tx_moved = c->rx_moved = false;
}

uint64_t conn_silence_deadline(const struct run *x, const struct conn *c, bool ctl_rx)
{
    uint64_t d = UINT64_MAX;

    if (c->tx_busy)
        d = c->tx_since + x->a->timeout_ms;
    if (c->rx_busy && !ctl_rx && c->rx_since + x->a->timeout_ms < d)
        d = c->rx_since + x->a->timeout_ms;
    return d;
}

struct peerwire_frame conn_frame(const struct run *x, uint8_t phase, uint32_t step,
                                 size_t offset, size_t bytes)
{
    return (struct peerwire_frame){ .magic = PEERWIRE_FRAME_DATA, .length = (uint32_t)bytes,
                                    .cohort = x->a->cohort_hash, .epoch = x->e->number,
                                    .round = x->round, .offset = offset, .count = x->count,
                                    .dtype = (uint8_t)x->type, .op = (uint8_t)x->op,
                                    .phase = phase, .codec = (uint8_t)x->codec, .step = step };
}

/* --- connecting --------------------------------------------------------- */


static uint8_t our_flags(const struct allreduce *a)
{
    return (uint8_t)((a->keyed ? PEERWIRE_F_KEYED : 0) | (a->integrity ? PEERWIRE_F_INTEGRITY : 0));
}

/* The greeting, with a fresh nonce when keyed, into d->buf. */
static int dial_greeting(struct run *x, struct dial *d)
{
    struct allreduce *a = x->a;
    struct peerwire_hello h = { .kind = PEERWIRE_GREET, .flags = our_flags(a),
                                .epoch = x->e->number, .incarnation = a->incarnation,
                                .serial = d->serial };
    int rc;

    if (a->keyed) {
        rc = secret_random(d->nonce_c, sizeof(d->nonce_c));
        if (rc < 0)
            return rc;
        memcpy(h.nonce, d->nonce_c, sizeof(h.nonce));
    }
    snprintf(h.cohort, sizeof(h.cohort), "%s", a->cohort);
    snprintf(h.id, sizeof(h.id), "%s", a->id);
    /* Both names were checked by allreduce_create, so this cannot fail. */
    return peerwire_hello_encode(d->buf, &h);
}

static int dial_start(struct run *x, struct dial *d, size_t peer)
{
    const struct epoch_member *m = &x->e->members[peer];
    struct addrinfo hints = { .ai_socktype = SOCK_STREAM, .ai_flags = AI_NUMERICSERV };
    struct addrinfo *ai;
    char host[IDENT_ADDRESS_MAX + 1], port[8];
    int fd, rc;

    d->peer = peer;
    d->fd = -1;
    d->serial = ++x->a->serial;
    d->started = clock_now_ms();
    d->unreach_told = 0;
    rc = dial_greeting(x, d);
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
    conn_tune_socket(fd);
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

/* Sends more of d->buf. Returns 1 when all of it is sent, 0 or an error. */
static int dial_send(struct dial *d)
{
    ssize_t k = send(d->fd, d->buf + d->done, PEERWIRE_HELLO_BYTES - d->done,
                     MSG_NOSIGNAL | MSG_DONTWAIT);

    if (k < 0)
        return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? 0 : -ECONNRESET;
    d->done += (size_t)k;
    return d->done == PEERWIRE_HELLO_BYTES;
}

static int dial_failed(struct run *x, struct dial *d, const char *msg, const char *why, int rc)
{
    log_warn(COMPONENT, msg, LF_S("cohort", x->a->cohort),
             LF_S("member", x->e->members[d->peer].id), LF_S("reason", why));
    return rc;
}

/* Judges the acceptor's answer in d->buf. Keyed, an ACCEPT whose MAC
 * verifies leaves the confirmation in d->buf and the frame keys in d.
 * Returns 1 (accepted), or -ESTALE, -ECONNRESET (stale reply of an older
 * epoch), -EACCES (refused, or it did not prove the key), -EPROTO. */
static int dial_answer(struct run *x, struct dial *d)
{
    struct allreduce *a = x->a;
    const char *peer_id = x->e->members[d->peer].id;
    struct peerwire_hello h;
    struct peerauth_transcript t = {
        .cohort = a->cohort, .connector = a->id, .acceptor = peer_id, .epoch = x->e->number,
        .incarnation = a->incarnation, .serial = d->serial, .flags = our_flags(a),
    };
    const char *why = peerwire_hello_decode(d->buf, sizeof(d->buf), &h);
    int rc;

    if (!why && strcmp(h.cohort, a->cohort) != 0)
        why = "another cohort";
    if (!why && h.kind == PEERWIRE_REFUSE)
        return dial_failed(x, d, "A member refused this member's greeting.",
                           peerwire_refusal_text(h.reason), -EACCES);
    if (!why && strcmp(h.id, peer_id) != 0)
        why = "answered by another member";
    if (!why && h.kind != PEERWIRE_STALE && h.kind != PEERWIRE_ACCEPT)
        why = "not an answer";
    if (!why && h.flags != our_flags(a))
        why = "other key or integrity settings";
    if (why)
        return dial_failed(x, d, "A member's answer to this member's greeting is wrong.", why,
                           -EPROTO);
    t.reply_epoch = h.epoch;
    memcpy(t.nonce_c, d->nonce_c, sizeof(t.nonce_c));
    memcpy(t.nonce_a, h.nonce, sizeof(t.nonce_a));
    if (a->keyed && !peerauth_verify(&a->key, h.kind == PEERWIRE_STALE ? PEERAUTH_STALE
                                                                         : PEERAUTH_ACCEPT,
                                     &t, h.mac)) {
        struct peerwire_hello no = { .kind = PEERWIRE_REFUSE, .flags = our_flags(a),
                                     .reason = PEERWIRE_REFUSE_BAD_MAC };

        /* Tell the acceptor why, so that both ends log the cause. */
        snprintf(no.cohort, sizeof(no.cohort), "%s", a->cohort);
        snprintf(no.id, sizeof(no.id), "%s", a->id);
        if (peerwire_hello_encode(d->buf, &no) == 0 &&
            send(d->fd, d->buf, sizeof(d->buf), MSG_NOSIGNAL | MSG_DONTWAIT) < 0) {
            /* it hears the close instead */
        }
        return dial_failed(x, d, "A member's answer does not prove the cohort key.",
                           "its key differs from this member's", -EACCES);
    }
    if (h.kind == PEERWIRE_STALE)
        return h.epoch > x->e->number ? -ESTALE : -ECONNRESET;
    if (h.epoch != x->e->number)
        return dial_failed(x, d, "A member's answer to this member's greeting is wrong.",
                           "another epoch", -EPROTO);
    if (!a->keyed)
        return 1;
    if (a->integrity) {
        rc = peerauth_frame_keys(&a->key, &t, d->key_tx, d->key_rx);
        if (rc < 0)
            return rc;
    }
    h = (struct peerwire_hello){ .kind = PEERWIRE_CONFIRM, .flags = our_flags(a),
                                 .epoch = x->e->number };
    snprintf(h.cohort, sizeof(h.cohort), "%s", a->cohort);
    snprintf(h.id, sizeof(h.id), "%s", a->id);
    rc = peerauth_mac(&a->key, PEERAUTH_CONFIRM, &t, h.mac);
    if (rc == 0)
        rc = peerwire_hello_encode(d->buf, &h);
    return rc < 0 ? rc : 1;
}

/* Advances a dial. Returns 1 when the connection is greeted and accepted
 * (keyed: and confirmed), 0 when it needs to wait, or an error. */
static int dial_step(struct run *x, struct dial *d)
{
    ssize_t k;
    int rc;

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
        rc = dial_send(d);
        if (rc <= 0)
            return rc;
        d->state = DIAL_READING;
        d->done = 0;
    }
    if (d->state == DIAL_READING) {
        k = recv(d->fd, d->buf + d->done, PEERWIRE_HELLO_BYTES - d->done, MSG_DONTWAIT);
        if (k == 0)
            return -ECONNRESET;
        if (k < 0)
            return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? 0 : -ECONNRESET;
        d->done += (size_t)k;
        if (d->done < PEERWIRE_HELLO_BYTES)
            return 0;
        rc = dial_answer(x, d);
        if (rc < 0 || !x->a->keyed)
            return rc;
        d->state = DIAL_CONFIRMING;
        d->done = 0;
    }
    /* A fresh socket has room for the confirmation: this sends it whole. */
    return dial_send(d);
}

/* Whether an inbound greeting may replace the live connection `live` of
 * the same member: see "REPLACEMENT" in acceptor.c. */
static bool newer(const struct inbound *in, const struct conn *live)
{
    return in->incarnation != live->incarnation || in->serial > live->serial;
}

/* Moves greeted connections of this epoch from the inbox into the table;
 * a connection from a member replaces its live one only when it comes
 * from a newer incarnation. Others are closed. */
static int take_inbox(struct run *x)
{
    struct allreduce *a = x->a;
    size_t kept = 0;
    const char *who = NULL;

    pthread_mutex_lock(&a->mu);
    for (size_t i = 0; i < a->n_inbox; i++) {
        struct inbound *in = &a->inbox[i];
        struct conn *c, *live;

        if (in->epoch != x->e->number || in->peer >= x->n) {
            close(in->fd);
            continue;
        }
        live = a->conns[in->peer];
        if (live && !newer(in, live)) {
            close(in->fd);
            kept++;
            who = x->e->members[in->peer].id;
            continue;
        }
        /* The acceptor sends a2c and receives c2a. */
        c = conn_new(a, in->fd, in->peer, in->key_a2c, in->key_c2a);
        if (!c) {
            close(in->fd);
            continue;
        }
        c->incarnation = in->incarnation;
        c->serial = in->serial;
        if (live) {
            close(live->fd);
            conn_free(live);
        }
        a->conns[in->peer] = c;
    }
    OPENSSL_cleanse(a->inbox, a->n_inbox * sizeof(a->inbox[0]));
    a->n_inbox = 0;
    pthread_mutex_unlock(&a->mu);
    if (kept)
        log_warn(COMPONENT, "Kept a member's live connection: a new greeting in its name was not "
                            "from a newer incarnation.",
                 LF_S("cohort", a->cohort), LF_S("member", who), LF_U("closed", kept));
    return 0;
}

int conn_connect_peers(struct run *x, const size_t *need, size_t n_need)
{
    struct allreduce *a = x->a;
    /* A butterfly may dial up to MAX_NEED peers: too many dials for the
     * stack of a caller's thread. */
    struct dial *dials = n_need ? calloc(n_need, sizeof(*dials)) : NULL;
    size_t n_dials = 0, n_used = 0;
    uint64_t deadline = clock_now_ms() + a->timeout_ms;
    int rc;

    if (n_need && !dials)
        return -ENOMEM;
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
                n_used = n_dials > n_used ? n_dials : n_used;
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
        x->a->dials = dials;
        x->a->n_dials = n_dials;
        rc = conn_wait(x, pfd, np, deadline);
        x->a->dials = NULL;
        x->a->n_dials = 0;
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
                struct conn *c = conn_new(a, dials[k].fd, dials[k].peer, dials[k].key_tx,
                                          dials[k].key_rx);

                OPENSSL_cleanse(dials[k].key_tx, sizeof(dials[k].key_tx));
                OPENSSL_cleanse(dials[k].key_rx, sizeof(dials[k].key_rx));
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
    if (a->integrity && dials)
        OPENSSL_cleanse(dials, n_used * sizeof(dials[0]));
    free(dials);
    return rc;
}

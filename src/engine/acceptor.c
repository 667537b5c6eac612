/* src/engine/acceptor.c: see acceptor.h.
 *
 * GREETINGS
 *
 * HELLO (peerwire.h) goes first on every connection, both ways. The member
 * lower in the epoch's order connects and greets (conn.c); the acceptor
 * checks magic, version, cohort, and that the sender is a member of its
 * epoch, and answers accept (with its own id, which the connector checks
 * too). A greeting from an older epoch gets "stale" with the newer number;
 * one from a newer epoch is held up to the member timeout for our own
 * set_epoch; anything else is a stranger and is closed with one log line.
 * Garbage is recognised by its first four bytes and closed at once.
 *
 * Anyone on the pod network can connect, so nothing a stranger holds may
 * stop a member's connection from being greeted: a whole greeting must
 * arrive within GREETING_MS of the accept (a member sends it at once); the
 * listening socket is always polled, and when MAX_PENDING connections are
 * waiting, or PENDING_PER_SOURCE from one address, the oldest of them that
 * has not greeted makes room for the new one. A connection that never sent
 * a byte goes without a log line, so a flood cannot flood the log too. */
#include "engine/acceptor.h"

#include <arpa/inet.h>
#include <errno.h>
#include <limits.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "base/clock.h"
#include "base/log.h"
#include "engine/allreduce_impl.h"
#include "engine/conn.h"

static void describe_peer(int fd, char *host, size_t hlen, char *out, size_t len)
{
    struct sockaddr_storage ss;
    socklen_t sl = sizeof(ss);
    unsigned port = 0;

    snprintf(host, hlen, "?");

    if (getpeername(fd, (struct sockaddr *)&ss, &sl) == 0) {
        if (ss.ss_family == AF_INET) {
            struct sockaddr_in *s4 = (struct sockaddr_in *)&ss;
            inet_ntop(AF_INET, &s4->sin_addr, host, (socklen_t)hlen);
            port = ntohs(s4->sin_port);
        } else if (ss.ss_family == AF_INET6) {
            struct sockaddr_in6 *s6 = (struct sockaddr_in6 *)&ss;
            inet_ntop(AF_INET6, &s6->sin6_addr, host, (socklen_t)hlen);
            port = ntohs(s6->sin6_port);
        }
    }
    snprintf(out, len, "%s:%u", host, port);
}

static void pending_drop(struct allreduce *a, size_t i)
{
    close(a->pending[i].fd);
    a->pending[i] = a->pending[--a->n_pending];
}

static void stranger(struct allreduce *a, size_t i, const char *why)
{
    if (a->pending[i].got > 0)
        log_warn(COMPONENT, "Closed a connection from a stranger.", LF_S("cohort", a->cohort),
                 LF_S("from", a->pending[i].from), LF_S("reason", why));
    pending_drop(a, i);
}

/* The pending connection to drop for a new one: the oldest that has not
 * greeted (the oldest held greeting if all have), among those from `host`
 * when `host` is not NULL. Returns MAX_PENDING when there is none. */
static size_t oldest(const struct allreduce *a, const char *host)
{
    size_t pick = MAX_PENDING;

    for (size_t i = 0; i < a->n_pending; i++) {
        const struct pending *p = &a->pending[i], *q;
        if (host && strcmp(p->host, host) != 0)
            continue;
        if (pick == MAX_PENDING) {
            pick = i;
            continue;
        }
        q = &a->pending[pick];
        if (p->held < q->held || (p->held == q->held && p->since < q->since))
            pick = i;
    }
    return pick;
}

/* How many pending connections came from `host`. */
static size_t from_host(const struct allreduce *a, const char *host)
{
    size_t n = 0;

    for (size_t i = 0; i < a->n_pending; i++)
        n += strcmp(a->pending[i].host, host) == 0;
    return n;
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
         * way. Hold the greeting until it arrives, for up to the member
         * timeout. */
        pthread_mutex_unlock(&a->mu);
        if (!p->held)
            p->deadline = p->since + a->timeout_ms;
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

/* Accepts what is waiting, at most MAX_PENDING at a time so that the
 * greetings already pending are read in between. */
static void accept_all(struct allreduce *a, uint64_t now)
{
    for (int k = 0; k < MAX_PENDING; k++) {
        int fd = accept4(a->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        struct pending *p, fresh = { .fd = fd, .since = now, .deadline = now + GREETING_MS };

        if (fd < 0)
            return;             /* EAGAIN, or a connection that vanished */
        conn_tune_socket(fd);
        describe_peer(fd, fresh.host, sizeof(fresh.host), fresh.from, sizeof(fresh.from));
        if (from_host(a, fresh.host) >= PENDING_PER_SOURCE)
            stranger(a, oldest(a, fresh.host), "too many connections from its address");
        else if (a->n_pending == MAX_PENDING)
            stranger(a, oldest(a, NULL), "too many connections waiting");
        p = &a->pending[a->n_pending++];
        *p = fresh;
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
        pfd[1] = (struct pollfd){ .fd = a->listen_fd, .events = POLLIN };
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

int acceptor_start(struct allreduce *a)
{
    return -pthread_create(&a->acceptor, NULL, acceptor_main, a);
}

void acceptor_stop(struct allreduce *a)
{
    uint64_t one = 1;

    pthread_mutex_lock(&a->mu);
    a->stop = true;
    pthread_mutex_unlock(&a->mu);
    if (write(a->wake_fd, &one, sizeof(one)) < 0) {
        /* the acceptor also wakes on its next deadline */
    }
    pthread_join(a->acceptor, NULL);
}

/* src/engine/acceptor.c: see acceptor.h.
 *
 * GREETINGS
 *
 * HELLO (peerwire.h) goes first on every connection, both ways. The member
 * lower in the epoch's order connects and greets (conn.c); the acceptor
 * checks magic, version, cohort, the greeter's key and integrity settings
 * against its own, that the greeter is a member of its epoch, and that it
 * is the member that dials this one (its role): a member that should be
 * dialled by us, not dial us, is a stranger. A greeting from an older
 * epoch gets "stale" with the newer number; one from a newer epoch is held
 * up to the member timeout for our own set_epoch; anything else is closed
 * with one log line. Garbage, and other wire versions, are recognised by
 * their first four or six bytes and closed at once.
 *
 * AUTHENTICATION
 *
 * With a cohort key (allreduce_config.key) the greeting is a mutual
 * challenge and response. GREET carries the connector's fresh random nonce;
 * the acceptor answers ACCEPT with its own fresh nonce and the MAC
 * "accept" over both nonces and the transcript (cohort, both ids, epoch,
 * the connector's incarnation and serial, flags: peerauth.h); the
 * connector checks it and sends CONFIRM, its MAC "confirm" over the same;
 * only a verified confirmation puts the connection in the inbox. A wrong
 * MAC, a replayed greeting (it meets a new nonce), a MAC of the other
 * direction (another label), or no confirmation within GREETING_MS of our
 * answer closes the connection. A keyed member refuses an unkeyed
 * greeting and an unkeyed member a keyed one, and members refuse each
 * other's greetings when their --integrity differs: each with a REFUSE
 * naming the cause, so both ends log it. With --integrity mac both ends
 * derive per-direction frame keys from the transcript (peerauth.h).
 * Without a key nothing is authenticated and the first greeting is
 * accepted as it stands, as in version 1.
 *
 * One key per cohort means any holder of it can claim any member id: the
 * greeting proves membership of the cohort, not which member.
 *
 * REPLACEMENT
 *
 * A member's connection that a run holds (the live one) is replaced by a
 * new one from the same member only if the new greeting is newer:
 *   - another incarnation: the member's engine was created again (a new
 *     process, or a new engine in it); incarnations are 64 random bits
 *     drawn at allreduce_create, so a restart never repeats one; or
 *   - the same incarnation and a higher serial: the same engine dialled
 *     again (after a failed call it closes its connections and dials anew;
 *     serials rise with every dial an engine makes).
 * Anything else (the same incarnation and serial, or a lower serial) is
 * closed and the live connection kept (take_inbox, conn.c). With a key the
 * incarnation and serial are covered by the MACs; without one they are
 * as trustworthy as the claimed id.
 *
 * BOUNDS
 *
 * Anyone on the pod network can connect, so nothing a stranger holds may
 * stop a member's connection from being greeted: a whole greeting must
 * arrive within GREETING_MS of the accept (a member sends it at once), and
 * a confirmation within GREETING_MS of our answer; the listening socket is
 * always polled, and when MAX_PENDING connections are waiting, or
 * PENDING_PER_SOURCE from one address, the oldest of them that has not
 * greeted makes room for the new one (if all have: the oldest held
 * greeting, then the oldest awaiting confirmation). A connection that
 * never sent a byte goes without a log line, and the lines of refusals
 * share a budget of LOG_BURST, refilled at one a second; a line after a
 * gap says how many went unlogged, so a flood cannot flood the log too. */
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

#include <openssl/crypto.h>

#include "base/clock.h"
#include "base/log.h"
#include "base/secret.h"
#include "engine/allreduce_impl.h"
#include "engine/conn.h"
#include "engine/peerauth.h"

#define LOG_BURST 10            /* refusal lines logged at once */
#define LOG_EVERY_MS 1000       /* then one more per this */

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

/* Whether a refusal may have its log line now. When it may, *unlogged is
 * the number of lines the budget held back since the last one. */
static bool log_budget(struct allreduce *a, uint64_t *unlogged)
{
    uint64_t now = clock_now_ms(), add = (now - a->log_at) / LOG_EVERY_MS;

    if (add > 0) {
        a->log_tokens = add >= LOG_BURST - a->log_tokens ? LOG_BURST : a->log_tokens + (uint32_t)add;
        a->log_at = now;
    }
    if (a->log_tokens == 0) {
        a->log_unlogged++;
        return false;
    }
    a->log_tokens--;
    *unlogged = a->log_unlogged;
    a->log_unlogged = 0;
    return true;
}

/* A refusal's log line, within the budget: the cohort first, the count of
 * lines held back last. */
#define REFUSAL(a, level, msg, ...)                                                   \
    do {                                                                              \
        uint64_t unlogged_;                                                           \
        if (log_budget((a), &unlogged_))                                              \
            log_##level(COMPONENT, msg, LF_S("cohort", (a)->cohort), __VA_ARGS__,     \
                        LF_U("unlogged", unlogged_));                                 \
    } while (0)

/* Removes pending[i] from the table, its descriptor now someone else's. */
static void pending_forget(struct allreduce *a, size_t i)
{
    a->pending[i] = a->pending[--a->n_pending];
}

static void pending_drop(struct allreduce *a, size_t i)
{
    close(a->pending[i].fd);
    pending_forget(a, i);
}

static void stranger(struct allreduce *a, size_t i, const char *why)
{
    const struct pending *p = &a->pending[i];

    if (p->got > 0 || p->state != PENDING_GREETING)
        REFUSAL(a, warn, "Closed a connection from a stranger.", LF_S("from", p->from),
                LF_S("claims", p->peer_id[0] ? p->peer_id : NULL), LF_S("reason", why));
    pending_drop(a, i);
}

/* The pending connection to drop for a new one: the oldest that has not
 * greeted; if all have, the oldest held greeting, then the oldest awaiting
 * confirmation; among those from `host` when `host` is not NULL. Returns
 * MAX_PENDING when there is none. */
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
        if (p->state < q->state || (p->state == q->state && p->since < q->since))
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

static uint8_t our_flags(const struct allreduce *a)
{
    return (uint8_t)((a->keyed ? PEERWIRE_F_KEYED : 0) | (a->integrity ? PEERWIRE_F_INTEGRITY : 0));
}

/* Sends h, completed with our names and flags. */
static bool reply(struct allreduce *a, int fd, struct peerwire_hello *h)
{
    uint8_t b[PEERWIRE_HELLO_BYTES];

    h->flags = our_flags(a);
    snprintf(h->cohort, sizeof(h->cohort), "%s", a->cohort);
    snprintf(h->id, sizeof(h->id), "%s", a->id);
    /* Both names were checked by allreduce_create, so encoding cannot fail. */
    if (peerwire_hello_encode(b, h) < 0)
        return false;
    /* A fresh socket's send buffer always has room for one greeting. */
    return send(fd, b, sizeof(b), MSG_NOSIGNAL | MSG_DONTWAIT) == (ssize_t)sizeof(b);
}

/* Tells the greeter why it goes no further, logs it and closes. */
static void refuse(struct allreduce *a, size_t i, uint8_t reason, const char *claims)
{
    struct pending *p = &a->pending[i];
    struct peerwire_hello h = { .kind = PEERWIRE_REFUSE, .reason = reason };
    const char *msg = reason == PEERWIRE_REFUSE_NEED_KEY
                          ? "Refused a greeting without the cohort key: this member has one."
                      : reason == PEERWIRE_REFUSE_NO_KEY
                          ? "Refused a keyed greeting: this member has no cohort key."
                          : "Refused a greeting: its --integrity differs from this member's.";

    reply(a, p->fd, &h);
    REFUSAL(a, warn, msg, LF_S("from", p->from), LF_S("claims", claims),
            LF_S("integrity", a->integrity ? "mac" : "none"));
    pending_drop(a, i);
}

/* The transcript of pending[i]'s greeting, whose MACs it is about. */
static struct peerauth_transcript transcript(const struct allreduce *a, const struct pending *p,
                                             uint64_t reply_epoch)
{
    struct peerauth_transcript t = {
        .cohort = a->cohort, .connector = p->peer_id, .acceptor = a->id, .epoch = p->epoch,
        .reply_epoch = reply_epoch, .incarnation = p->incarnation, .serial = p->serial,
        .flags = p->flags,
    };

    memcpy(t.nonce_c, p->nonce_c, sizeof(t.nonce_c));
    memcpy(t.nonce_a, p->nonce_a, sizeof(t.nonce_a));
    return t;
}

/* Answers pending[i] (kind ACCEPT or STALE): keyed, with a fresh nonce and
 * the MAC over the transcript. */
static bool answer(struct allreduce *a, struct pending *p, uint8_t kind, uint64_t epoch)
{
    struct peerwire_hello h = { .kind = kind, .epoch = epoch };

    if (a->keyed) {
        struct peerauth_transcript t;

        if (secret_random(p->nonce_a, sizeof(p->nonce_a)) < 0)
            return false;
        t = transcript(a, p, epoch);
        memcpy(h.nonce, p->nonce_a, sizeof(h.nonce));
        if (peerauth_mac(&a->key, kind == PEERWIRE_STALE ? PEERAUTH_STALE : PEERAUTH_ACCEPT, &t,
                         h.mac) < 0)
            return false;
    }
    return reply(a, p->fd, &h);
}

/* Hands pending[i] to the runs through the inbox (mu held). */
static bool inbox_push(struct allreduce *a, const struct inbound *in)
{
    uint64_t one = 1;

    if (a->n_inbox == INBOX_MAX)
        return false;
    a->inbox[a->n_inbox++] = *in;
    if (write(a->inbox_fd, &one, sizeof(one)) < 0) {
        /* The counter cannot overflow in practice; the run polls anyway. */
    }
    return true;
}

static void inbox_failed(struct allreduce *a, size_t i)
{
    REFUSAL(a, warn, "Dropped a member's connection.", LF_S("member", a->pending[i].peer_id),
            LF_S("reason", "inbox full or socket closed"));
    pending_drop(a, i);
}

/* Decides on a complete greeting. Returns true when pending[i] is still
 * pending (held for our epoch, or answered and awaiting confirmation),
 * false when it was answered or refused and removed. */
static bool judge(struct allreduce *a, size_t i)
{
    struct pending *p = &a->pending[i];
    struct peerwire_hello h;
    const char *why = peerwire_hello_decode(p->buf, sizeof(p->buf), &h);
    struct inbound in;
    uint64_t cur;
    long me, peer;
    bool ok;

    if (!why && h.kind != PEERWIRE_GREET)
        why = "not a greeting";
    if (!why && strcmp(h.cohort, a->cohort) != 0)
        why = "another cohort";
    if (why) {
        stranger(a, i, why);
        return false;
    }
    snprintf(p->peer_id, sizeof(p->peer_id), "%s", h.id);
    p->epoch = h.epoch;
    p->incarnation = h.incarnation;
    p->serial = h.serial;
    p->flags = h.flags;
    memcpy(p->nonce_c, h.nonce, sizeof(p->nonce_c));
    if ((h.flags & PEERWIRE_F_KEYED) != (our_flags(a) & PEERWIRE_F_KEYED)) {
        refuse(a, i, a->keyed ? PEERWIRE_REFUSE_NEED_KEY : PEERWIRE_REFUSE_NO_KEY, h.id);
        return false;
    }
    if (h.flags != our_flags(a)) {
        refuse(a, i, PEERWIRE_REFUSE_INTEGRITY, h.id);
        return false;
    }
    pthread_mutex_lock(&a->mu);
    cur = a->epoch ? a->epoch->number : 0;
    if (h.epoch > cur) {
        /* The peer adopted an epoch before us; ours is probably on its
         * way. Hold the greeting until it arrives, for up to the member
         * timeout. */
        pthread_mutex_unlock(&a->mu);
        if (p->state != PENDING_HELD)
            p->deadline = p->since + a->timeout_ms;
        p->state = PENDING_HELD;
        return true;
    }
    if (h.epoch < cur) {
        answer(a, p, PEERWIRE_STALE, cur);
        pthread_mutex_unlock(&a->mu);
        REFUSAL(a, info, "Refused a member of an older epoch.", LF_S("member", h.id),
                LF_U("its_epoch", h.epoch), LF_U("epoch", cur));
        pending_drop(a, i);
        return false;
    }
    me = epoch_find(a->epoch, a->id);
    peer = epoch_find(a->epoch, h.id);
    pthread_mutex_unlock(&a->mu);
    if (me < 0 || peer < 0 || peer == me) {
        stranger(a, i, "not a member of the epoch");
        return false;
    }
    if (peer > me) {
        /* conn.c: the member lower in the epoch's order dials. */
        stranger(a, i, "wrong role: by the epoch's order this member dials that one");
        return false;
    }
    p->peer = (size_t)peer;
    if (a->keyed) {
        if (!answer(a, p, PEERWIRE_ACCEPT, cur)) {
            inbox_failed(a, i);
            return false;
        }
        p->state = PENDING_CONFIRMING;
        p->deadline = clock_now_ms() + GREETING_MS;
        p->got = 0;
        return true;
    }
    in = (struct inbound){ .fd = p->fd, .epoch = cur, .peer = p->peer,
                           .incarnation = p->incarnation, .serial = p->serial };
    pthread_mutex_lock(&a->mu);
    ok = answer(a, p, PEERWIRE_ACCEPT, cur) && inbox_push(a, &in);
    pthread_mutex_unlock(&a->mu);
    if (!ok) {
        inbox_failed(a, i);
        return false;
    }
    pending_forget(a, i);
    return false;
}

/* Decides on a complete confirmation of pending[i] (keyed only); removes
 * it either way. */
static void confirm(struct allreduce *a, size_t i)
{
    struct pending *p = &a->pending[i];
    struct peerwire_hello h;
    const char *why = peerwire_hello_decode(p->buf, sizeof(p->buf), &h);
    struct peerauth_transcript t = transcript(a, p, p->epoch);
    struct inbound in = { .fd = p->fd, .epoch = p->epoch, .peer = p->peer,
                          .incarnation = p->incarnation, .serial = p->serial };
    bool ok;

    if (!why && h.kind == PEERWIRE_REFUSE) {
        REFUSAL(a, warn, "A member refused this member's answer to its greeting.",
                LF_S("member", p->peer_id), LF_S("from", p->from),
                LF_S("reason", peerwire_refusal_text(h.reason)));
        pending_drop(a, i);
        return;
    }
    if (!why && h.kind != PEERWIRE_CONFIRM)
        why = "not a confirmation";
    if (!why && !peerauth_verify(&a->key, PEERAUTH_CONFIRM, &t, h.mac))
        why = "its confirmation does not prove the cohort key (another key, or a replayed "
              "greeting)";
    if (!why && a->integrity && peerauth_frame_keys(&a->key, &t, in.key_c2a, in.key_a2c) < 0)
        why = "no frame keys (libcrypto failed)";
    if (why) {
        stranger(a, i, why);
        return;
    }
    pthread_mutex_lock(&a->mu);
    ok = inbox_push(a, &in);
    pthread_mutex_unlock(&a->mu);
    OPENSSL_cleanse(in.key_c2a, sizeof(in.key_c2a));
    OPENSSL_cleanse(in.key_a2c, sizeof(in.key_a2c));
    if (!ok) {
        inbox_failed(a, i);
        return;
    }
    pending_forget(a, i);
}

/* Accepts what is waiting, at most MAX_PENDING at a time so that the
 * greetings already pending are read in between. */
static void accept_all(struct allreduce *a, uint64_t now)
{
    for (int k = 0; k < MAX_PENDING; k++) {
        int fd = accept4(a->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        char host[sizeof(a->pending[0].host)], from[sizeof(a->pending[0].from)];
        struct pending *p;

        if (fd < 0)
            return;             /* EAGAIN, or a connection that vanished */
        conn_tune_socket(fd);
        describe_peer(fd, host, sizeof(host), from, sizeof(from));
        if (from_host(a, host) >= PENDING_PER_SOURCE)
            stranger(a, oldest(a, host), "too many connections from its address");
        else if (a->n_pending == MAX_PENDING)
            stranger(a, oldest(a, NULL), "too many connections waiting");
        p = &a->pending[a->n_pending++];
        memset(p, 0, sizeof(*p));
        p->fd = fd;
        p->since = now;
        p->deadline = now + GREETING_MS;
        p->state = PENDING_GREETING;
        memcpy(p->host, host, sizeof(host));
        memcpy(p->from, from, sizeof(from));
    }
}

/* Reads more of pending[i]'s greeting, or of its confirmation. */
static void read_greeting(struct allreduce *a, size_t i)
{
    struct pending *p = &a->pending[i];
    bool confirming = p->state == PENDING_CONFIRMING;
    ssize_t r = recv(p->fd, p->buf + p->got, PEERWIRE_HELLO_BYTES - p->got, MSG_DONTWAIT);
    const char *why;

    if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
        if (p->got > 0 || confirming)
            stranger(a, i, confirming ? "closed before confirming" : "closed before a whole greeting");
        else
            pending_drop(a, i);
        return;
    }
    if (r > 0)
        p->got += (size_t)r;
    why = peerwire_hello_early(p->buf, p->got);
    if (why) {
        stranger(a, i, why);
        return;
    }
    if (p->got < PEERWIRE_HELLO_BYTES)
        return;
    if (confirming)
        confirm(a, i);
    else
        judge(a, i);
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
                enum pending_state st = a->pending[i].state;
                stranger(a, i, st == PENDING_HELD         ? "its epoch never reached us"
                               : st == PENDING_CONFIRMING ? "no confirmation in time"
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
            if (a->pending[i].state != PENDING_HELD) {
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
                if (a->pending[i].state == PENDING_HELD && !judge(a, i))
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

/* src/k8s/probe.c: see probe.h. */
#include "k8s/probe.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "base/clock.h"

#define REQUEST_MAX 8192            /* a GET line and headers */
#define BODY_MAX (1024 * 1024)      /* the metrics text */
#define CLIENT_DEADLINE_MS 2000
/* Connections served at once. A kubelet probes once every few seconds and
 * Prometheus scrapes once a minute; anyone may connect, so beyond this the
 * oldest idle connection makes room. */
#define CLIENTS_MAX 128

struct probe {
    int fd, port;
    probe_fn fn;
    void *arg;
    pthread_t thread;
    atomic_bool stop;
    char *body;
};

void probe_printf(struct probe_reply *r, const char *fmt, ...)
{
    va_list ap;
    int w;

    if (r->len + 1 >= r->cap)
        return;
    va_start(ap, fmt);
    w = vsnprintf(r->body + r->len, r->cap - r->len, fmt, ap);
    va_end(ap);
    if (w < 0)
        return;
    r->len = r->len + (size_t)w >= r->cap ? r->cap - 1 : r->len + (size_t)w;
}

static const char *reason_of(int code)
{
    switch (code) {
    case 200: return "OK";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 400: return "Bad Request";
    case 503: return "Service Unavailable";
    default: return "Status";
    }
}

/* One connection: its request as it arrives, then its reply as the
 * client takes it. Both buffers are the connection's own, so a client
 * that reads slowly holds only its reply, never the server. */
struct client {
    int fd;                         /* -1: a free slot */
    uint64_t since, deadline;       /* accepted at; closed at */
    char *in;                       /* REQUEST_MAX bytes */
    size_t in_len;
    char *out;                      /* the whole reply, once answered */
    size_t out_len, out_off;
};

static void client_close(struct client *c)
{
    if (c->fd >= 0)
        close(c->fd);
    free(c->in);
    free(c->out);
    *c = (struct client){ .fd = -1 };
}

int probe_parse_request(const char *req, char *path, size_t cap, bool *head)
{
    const char *sp, *q;
    size_t pl;

    *head = strncmp(req, "HEAD ", 5) == 0;
    if (strncmp(req, "GET ", 4) != 0 && !*head)
        return 405;
    sp = strchr(req, ' ') + 1;
    q = sp + strcspn(sp, " ?\r\n");
    pl = (size_t)(q - sp);
    if (pl == 0 || pl >= cap)
        return 400;
    memcpy(path, sp, pl);
    path[pl] = '\0';
    return 200;
}

/* Builds the reply to a complete request in c->out. */
static int answer(struct probe *p, struct client *c)
{
    struct probe_reply r = { .code = 200, .body = p->body, .cap = BODY_MAX };
    char head[256], path[1024];
    bool head_only;
    int w;

    r.code = probe_parse_request(c->in, path, sizeof(path), &head_only);
    if (r.code == 405)
        probe_printf(&r, "only GET\n");
    else if (r.code == 400)
        probe_printf(&r, "bad request line\n");
    else
        p->fn(p->arg, path, &r);
    w = snprintf(head, sizeof(head), "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n"
                 "Connection: close\r\n\r\n", r.code, reason_of(r.code),
                 r.content_type ? r.content_type : "text/plain; charset=utf-8", r.len);
    if (head_only)
        r.len = 0;
    c->out = malloc((size_t)w + r.len);
    if (!c->out)
        return -ENOMEM;
    memcpy(c->out, head, (size_t)w);
    memcpy(c->out + w, r.body, r.len);
    c->out_len = (size_t)w + r.len;
    c->out_off = 0;
    return 0;
}

/* Reads what the client sent. Returns 0 to go on, 1 once c->out holds
 * the reply, <0 to drop the client (closed, over REQUEST_MAX, no memory). */
static int client_read(struct probe *p, struct client *c)
{
    ssize_t r = recv(c->fd, c->in + c->in_len, REQUEST_MAX - 1 - c->in_len, 0);

    if (r < 0 && (errno == EAGAIN || errno == EINTR))
        return 0;
    if (r <= 0)
        return -1;
    c->in_len += (size_t)r;
    c->in[c->in_len] = '\0';
    if (strstr(c->in, "\r\n\r\n") || strstr(c->in, "\n\n"))
        return answer(p, c) < 0 ? -1 : 1;
    return c->in_len + 1 >= REQUEST_MAX ? -1 : 0;
}

/* Sends what the client will take now. Returns 1 when all is sent, 0 to
 * go on, <0 on error. */
static int client_write(struct client *c)
{
    while (c->out_off < c->out_len) {
        ssize_t w = send(c->fd, c->out + c->out_off, c->out_len - c->out_off, MSG_NOSIGNAL);
        if (w < 0 && (errno == EAGAIN || errno == EINTR))
            return 0;
        if (w <= 0)
            return -1;
        c->out_off += (size_t)w;
    }
    return 1;
}

/* A free slot for a new connection. When every slot is taken, the oldest
 * client still sending its request goes first (the oldest of all if every
 * client is being answered): an idle or stalling client is the one to go,
 * and the newest connection, a probe that will ask at once, stays. */
static struct client *slot_for_new(struct client *cl)
{
    struct client *oldest = NULL, *oldest_reading = NULL;

    for (size_t i = 0; i < CLIENTS_MAX; i++) {
        if (cl[i].fd < 0)
            return &cl[i];
        if (!oldest || cl[i].since < oldest->since)
            oldest = &cl[i];
        if (!cl[i].out && (!oldest_reading || cl[i].since < oldest_reading->since))
            oldest_reading = &cl[i];
    }
    oldest = oldest_reading ? oldest_reading : oldest;
    client_close(oldest);
    return oldest;
}

static void accept_all(struct probe *p, struct client *cl, uint64_t now)
{
    for (int n = 0; n < CLIENTS_MAX; n++) {
        int fd = accept4(p->fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
        struct client *c;

        if (fd < 0)
            return;
        c = slot_for_new(cl);
        c->in = malloc(REQUEST_MAX);
        if (!c->in) {
            close(fd);
            continue;
        }
        c->fd = fd;
        c->since = now;
        c->deadline = now + CLIENT_DEADLINE_MS;
        c->in_len = 0;
    }
}

/* One thread, never blocked by a client: every socket is non-blocking,
 * and each client has CLIENT_DEADLINE_MS from its accept to its last
 * byte out. */
static void *probe_main(void *arg)
{
    struct probe *p = arg;
    struct client cl[CLIENTS_MAX];
    struct pollfd pfd[CLIENTS_MAX + 1];
    size_t who[CLIENTS_MAX + 1];

    for (size_t i = 0; i < CLIENTS_MAX; i++)
        cl[i] = (struct client){ .fd = -1 };
    while (!atomic_load(&p->stop)) {
        uint64_t now = clock_now_ms(), next = now + 200;
        nfds_t n = 1;

        pfd[0] = (struct pollfd){ .fd = p->fd, .events = POLLIN };
        for (size_t i = 0; i < CLIENTS_MAX; i++) {
            if (cl[i].fd < 0)
                continue;
            if (now >= cl[i].deadline) {
                client_close(&cl[i]);
                continue;
            }
            if (cl[i].deadline < next)
                next = cl[i].deadline;
            pfd[n] = (struct pollfd){ .fd = cl[i].fd, .events = cl[i].out ? POLLOUT : POLLIN };
            who[n++] = i;
        }
        if (poll(pfd, n, (int)(next - now)) <= 0)
            continue;
        now = clock_now_ms();
        for (nfds_t k = 1; k < n; k++) {
            struct client *c = &cl[who[k]];
            int rc = 0;

            if (!pfd[k].revents)
                continue;
            if (!c->out)
                rc = client_read(p, c);
            if (rc >= 0 && c->out)
                rc = client_write(c);
            if (rc != 0)
                client_close(c);
        }
        if (pfd[0].revents & POLLIN)
            accept_all(p, cl, now);
    }
    for (size_t i = 0; i < CLIENTS_MAX; i++)
        client_close(&cl[i]);
    return NULL;
}

int probe_start(const char *listen_addr, probe_fn fn, void *arg, struct probe **out)
{
    struct addrinfo hints = { .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                              .ai_flags = AI_PASSIVE };
    struct addrinfo *ai = NULL;
    struct sockaddr_storage ss;
    socklen_t sl = sizeof(ss);
    const char *colon = strrchr(listen_addr, ':');
    char host[256];
    struct probe *p;
    int one = 1, rc;

    if (!colon || (size_t)(colon - listen_addr) >= sizeof(host) || !fn)
        return -EINVAL;
    memcpy(host, listen_addr, (size_t)(colon - listen_addr));
    host[colon - listen_addr] = '\0';
    if (host[0] == '[') {           /* [::1]:9090 */
        size_t hl = strlen(host);
        if (hl < 2 || host[hl - 1] != ']')
            return -EINVAL;
        memmove(host, host + 1, hl - 2);
        host[hl - 2] = '\0';
    }
    if (getaddrinfo(host[0] ? host : NULL, colon + 1, &hints, &ai) != 0)
        return -EINVAL;
    p = calloc(1, sizeof(*p));
    if (!p) {
        rc = -ENOMEM;
        goto err_ai;
    }
    p->fn = fn;
    p->arg = arg;
    p->body = malloc(BODY_MAX);
    if (!p->body) {
        rc = -ENOMEM;
        goto err_p;
    }
    p->fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (p->fd < 0) {
        rc = -errno;
        goto err_body;
    }
    setsockopt(p->fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(p->fd, ai->ai_addr, ai->ai_addrlen) < 0 || listen(p->fd, 256) < 0 ||
        getsockname(p->fd, (struct sockaddr *)&ss, &sl) < 0) {
        rc = -errno;
        goto err_fd;
    }
    p->port = ss.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&ss)->sin6_port)
                                       : ntohs(((struct sockaddr_in *)&ss)->sin_port);
    if (pthread_create(&p->thread, NULL, probe_main, p) != 0) {
        rc = -EAGAIN;
        goto err_fd;
    }
    freeaddrinfo(ai);
    *out = p;
    return 0;
err_fd:
    close(p->fd);
err_body:
    free(p->body);
err_p:
    free(p);
err_ai:
    freeaddrinfo(ai);
    return rc;
}

int probe_port(const struct probe *p)
{
    return p->port;
}

void probe_stop(struct probe *p)
{
    if (!p)
        return;
    atomic_store(&p->stop, true);
    pthread_join(p->thread, NULL);
    close(p->fd);
    free(p->body);
    free(p);
}

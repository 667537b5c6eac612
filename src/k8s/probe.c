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

static void write_all(int fd, const char *p, size_t n)
{
    while (n) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w <= 0)
            return;
        p += w;
        n -= (size_t)w;
    }
}

/* Reads up to the end of the headers, or fails at the cap or deadline. */
static ssize_t read_request(int fd, char *buf, size_t cap)
{
    uint64_t end = clock_now_ms() + CLIENT_DEADLINE_MS;
    size_t len = 0;

    while (len + 1 < cap) {
        struct pollfd pfd = { .fd = fd, .events = POLLIN };
        uint64_t now = clock_now_ms();
        ssize_t r;

        if (now >= end || poll(&pfd, 1, (int)(end - now)) <= 0)
            return -1;
        r = recv(fd, buf + len, cap - 1 - len, 0);
        if (r <= 0)
            return -1;
        len += (size_t)r;
        buf[len] = '\0';
        if (strstr(buf, "\r\n\r\n") || strstr(buf, "\n\n"))
            return (ssize_t)len;
    }
    return -1;
}

static void serve(struct probe *p, int fd)
{
    char req[REQUEST_MAX], head[256], path[1024];
    struct probe_reply r = { .code = 200, .body = p->body, .cap = BODY_MAX };
    char *sp, *q;
    size_t pl;
    int w;

    if (read_request(fd, req, sizeof(req)) < 0)
        return;
    if (strncmp(req, "GET ", 4) != 0 && strncmp(req, "HEAD ", 5) != 0) {
        r.code = 405;
        probe_printf(&r, "only GET\n");
        goto reply;
    }
    sp = strchr(req, ' ') + 1;
    q = sp + strcspn(sp, " ?\r\n");
    pl = (size_t)(q - sp);
    if (pl == 0 || pl >= sizeof(path)) {
        r.code = 400;
        probe_printf(&r, "bad request line\n");
        goto reply;
    }
    memcpy(path, sp, pl);
    path[pl] = '\0';
    p->fn(p->arg, path, &r);
reply:
    w = snprintf(head, sizeof(head), "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n"
                 "Connection: close\r\n\r\n", r.code, reason_of(r.code),
                 r.content_type ? r.content_type : "text/plain; charset=utf-8", r.len);
    write_all(fd, head, (size_t)w);
    if (strncmp(req, "HEAD ", 5) != 0)
        write_all(fd, r.body, r.len);
}

static void *probe_main(void *arg)
{
    struct probe *p = arg;

    while (!atomic_load(&p->stop)) {
        struct pollfd pfd = { .fd = p->fd, .events = POLLIN };
        int fd;

        if (poll(&pfd, 1, 200) <= 0)
            continue;
        fd = accept4(p->fd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0)
            continue;
        serve(p, fd);
        close(fd);
    }
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
    p->fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (p->fd < 0) {
        rc = -errno;
        goto err_body;
    }
    setsockopt(p->fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(p->fd, ai->ai_addr, ai->ai_addrlen) < 0 || listen(p->fd, 64) < 0 ||
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

/* tests/unit/test_probe.c: the operator's HTTP endpoints server: answers,
 * refusals, and that no client, idle, slow or hostile, can hold it. */
#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "base/clock.h"
#include "k8s/probe.h"

static void handler(void *arg, const char *path, struct probe_reply *r)
{
    if (strcmp(path, "/healthz") == 0) {
        probe_printf(r, "ok\n");
    } else if (strcmp(path, "/big") == 0) {
        for (int i = 0; i < 20000; i++)
            probe_printf(r, "metric_%d 1\n", i);
    } else {
        r->code = 404;
        probe_printf(r, "no\n");
    }
}

static struct probe *p;

static void start(void)
{
    cr_assert_eq(probe_start("127.0.0.1:0", handler, NULL, &p), 0);
}

static void stop(void)
{
    probe_stop(p);
}

TestSuite(probe, .init = start, .fini = stop, .timeout = 60);

static int dial(void)
{
    struct sockaddr_in sa = { .sin_family = AF_INET, .sin_port = htons((uint16_t)probe_port(p)) };
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);

    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    cr_assert_geq(fd, 0);
    cr_assert_eq(connect(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    return fd;
}

/* Sends `req` on a new connection and reads the reply until the server
 * closes, at most `cap` bytes into buf; returns the length, or -1 when the
 * server closed without a byte. */
static ssize_t ask(const char *req, char *buf, size_t cap)
{
    int fd = dial();
    size_t len = 0;
    ssize_t r;

    cr_assert_eq(send(fd, req, strlen(req), MSG_NOSIGNAL), (ssize_t)strlen(req));
    while (len + 1 < cap && (r = recv(fd, buf + len, cap - 1 - len, 0)) > 0)
        len += (size_t)r;
    buf[len] = '\0';
    close(fd);
    return len ? (ssize_t)len : -1;
}

Test(probe, answers_get_and_head_and_refuses_the_rest)
{
    char buf[4096];

    cr_assert_gt(ask("GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", buf, sizeof(buf)), 0);
    cr_assert(strncmp(buf, "HTTP/1.1 200 OK\r\n", 17) == 0, "%s", buf);
    cr_assert(strstr(buf, "Content-Length: 3\r\n") && strstr(buf, "\r\n\r\nok\n"), "%s", buf);
    cr_assert_gt(ask("HEAD /healthz?x=1 HTTP/1.1\r\n\r\n", buf, sizeof(buf)), 0);
    cr_assert(strncmp(buf, "HTTP/1.1 200 OK\r\n", 17) == 0 && !strstr(buf, "ok\n"), "%s", buf);
    cr_assert_gt(ask("GET /nothing HTTP/1.1\r\n\r\n", buf, sizeof(buf)), 0);
    cr_assert(strncmp(buf, "HTTP/1.1 404 ", 13) == 0, "%s", buf);
    cr_assert_gt(ask("POST /healthz HTTP/1.1\r\n\r\n", buf, sizeof(buf)), 0);
    cr_assert(strncmp(buf, "HTTP/1.1 405 ", 13) == 0, "%s", buf);
    cr_assert_gt(ask("GET  HTTP/1.1\r\n\r\n", buf, sizeof(buf)), 0);
    cr_assert(strncmp(buf, "HTTP/1.1 400 ", 13) == 0, "%s", buf);
}

Test(probe, an_oversized_request_is_dropped_without_a_reply)
{
    static char req[20000], buf[256];

    memset(req, 'a', sizeof(req) - 1);
    memcpy(req, "GET /", 5);
    cr_assert_eq(ask(req, buf, sizeof(buf)), -1);
    cr_assert_gt(ask("GET /healthz HTTP/1.1\r\n\r\n", buf, sizeof(buf)), 0, "still serving");
}

/* A large reply goes out to a client that reads it slowly, while others
 * are answered meanwhile. */
Test(probe, a_slow_reader_does_not_hold_others)
{
    static char big[512 * 1024];
    char buf[4096];
    const char *req = "GET /big HTTP/1.1\r\n\r\n";
    int slow = dial();
    size_t len = 0;
    ssize_t r;

    cr_assert_eq(send(slow, req, strlen(req), 0), (ssize_t)strlen(req));
    for (int i = 0; i < 5; i++) {
        cr_assert_gt(ask("GET /healthz HTTP/1.1\r\n\r\n", buf, sizeof(buf)), 0);
        cr_assert(strstr(buf, "ok\n"));
    }
    while ((r = recv(slow, big + len, sizeof(big) - len, 0)) > 0)
        len += (size_t)r;
    cr_assert(strstr(big, "metric_19999 1\n"), "the whole reply arrived (%zu bytes)", len);
    close(slow);
}

/* Hundreds of connections that never send a byte, and one that sends
 * half a request: /healthz is answered well within one client deadline
 * (2 s), where one client at a time would take 2 s per idle connection. */
Test(probe, idle_connections_do_not_delay_health)
{
    enum { IDLE = 300 };
    static int idle[IDLE];
    char buf[4096];
    int half = dial();

    cr_assert_eq(send(half, "GET /hea", 8, 0), 8);
    for (int i = 0; i < IDLE; i++)
        idle[i] = dial();
    for (int k = 0; k < 3; k++) {
        uint64_t t0 = clock_now_ms();
        cr_assert_gt(ask("GET /healthz HTTP/1.1\r\n\r\n", buf, sizeof(buf)), 0);
        cr_assert(strstr(buf, "\r\n\r\nok\n"), "%s", buf);
        cr_assert_lt(clock_now_ms() - t0, 1500, "healthz took %llu ms",
                     (unsigned long long)(clock_now_ms() - t0));
    }
    for (int i = 0; i < IDLE; i++)
        close(idle[i]);
    close(half);
}

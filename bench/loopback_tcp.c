/* bench/loopback_tcp.c: B, the single-stream TCP throughput over loopback,
 * the yardstick the all-reduce targets are set against. One process
 * sends, another receives, over one 127.0.0.1 connection with TCP_NODELAY,
 * in `--chunk`-byte send() and recv() calls; the receiver answers one byte
 * when it has everything, so the time covers delivery, not just queueing.
 * Best of --reps runs. Prints {"bytes":..,"gbs":..} (GB = 10^9 bytes).
 *
 *   cc -O2 -o build/bench/loopback_tcp bench/loopback_tcp.c
 *   build/bench/loopback_tcp [--total BYTES] [--chunk BYTES] [--reps N] [--sockbuf BYTES]
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now_s(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static unsigned long long arg_u(const char *s)
{
    char *end;
    unsigned long long v;

    errno = 0;
    v = strtoull(s, &end, 10);
    if (errno || end == s || *end) {
        fprintf(stderr, "loopback_tcp: bad number \"%s\"\n", s);
        exit(2);
    }
    return v;
}

static void tune(int fd, int sockbuf)
{
    int one = 1;

    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    if (sockbuf > 0) {
        setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sockbuf, sizeof(sockbuf));
        setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &sockbuf, sizeof(sockbuf));
    }
}

static double one_run(unsigned long long total, size_t chunk, int sockbuf)
{
    struct sockaddr_in sa = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
    socklen_t sl = sizeof(sa);
    int lfd = socket(AF_INET, SOCK_STREAM, 0), fd;
    char *buf = malloc(chunk);
    double t0, t1;
    pid_t pid;
    char ack;

    if (lfd < 0 || !buf)
        exit(1);
    memset(buf, 1, chunk);
    tune(lfd, sockbuf);         /* inherited by the accepted socket */
    if (bind(lfd, (struct sockaddr *)&sa, sizeof(sa)) < 0 || listen(lfd, 1) < 0 ||
        getsockname(lfd, (struct sockaddr *)&sa, &sl) < 0)
        exit(1);
    pid = fork();
    if (pid == 0) {             /* receiver */
        unsigned long long got = 0;
        int c = accept(lfd, NULL, NULL);

        tune(c, sockbuf);
        while (got < total) {
            ssize_t r = recv(c, buf, chunk, 0);
            if (r <= 0)
                _exit(1);
            got += (unsigned long long)r;
        }
        if (send(c, "k", 1, 0) != 1)
            _exit(1);
        _exit(0);
    }
    close(lfd);
    fd = socket(AF_INET, SOCK_STREAM, 0);
    tune(fd, sockbuf);
    if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0)
        exit(1);
    t0 = now_s();
    for (unsigned long long sent = 0; sent < total;) {
        size_t n = total - sent < chunk ? (size_t)(total - sent) : chunk;
        ssize_t w = send(fd, buf, n, 0);
        if (w <= 0)
            exit(1);
        sent += (unsigned long long)w;
    }
    if (recv(fd, &ack, 1, MSG_WAITALL) != 1)
        exit(1);
    t1 = now_s();
    close(fd);
    waitpid(pid, NULL, 0);
    free(buf);
    return (double)total / (t1 - t0) / 1e9;
}

int main(int argc, char **argv)
{
    unsigned long long total = 4ull << 30, chunk = 1 << 20, reps = 3, sockbuf = 0;
    double best = 0;

    for (int i = 1; i + 1 < argc; i += 2) {
        if (strcmp(argv[i], "--total") == 0)
            total = arg_u(argv[i + 1]);
        else if (strcmp(argv[i], "--chunk") == 0)
            chunk = arg_u(argv[i + 1]);
        else if (strcmp(argv[i], "--reps") == 0)
            reps = arg_u(argv[i + 1]);
        else if (strcmp(argv[i], "--sockbuf") == 0)
            sockbuf = arg_u(argv[i + 1]);
        else {
            fprintf(stderr, "loopback_tcp: unknown option %s\n", argv[i]);
            return 2;
        }
    }
    if (chunk == 0 || total == 0 || reps == 0) {
        fprintf(stderr, "loopback_tcp: sizes and reps must be positive\n");
        return 2;
    }
    for (unsigned long long r = 0; r < reps; r++) {
        double g = one_run(total, (size_t)chunk, (int)sockbuf);
        best = g > best ? g : best;
    }
    printf("{\"bytes\":%llu,\"chunk\":%llu,\"gbs\":%.4f}\n", total, chunk, best);
    return 0;
}

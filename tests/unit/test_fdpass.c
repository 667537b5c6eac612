/* tests/unit/test_fdpass.c: descriptors over a Unix socket, against a
 * peer that sends too many, too much or too little. Every error path must
 * leave no received descriptor open. */
#include <criterion/criterion.h>

#include <dirent.h>
#include <errno.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/clock.h"
#include "gpu/fdpass.h"

static int open_fds(void)
{
    DIR *d = opendir("/proc/self/fd");
    int n = 0;

    cr_assert_not_null(d);
    while (readdir(d))
        n++;
    closedir(d);
    return n;
}

static void pair(int sv[2])
{
    cr_assert_eq(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv), 0);
}

static bool same_file(int a, int b)
{
    struct stat x, y;

    return fstat(a, &x) == 0 && fstat(b, &y) == 0 && x.st_dev == y.st_dev && x.st_ino == y.st_ino;
}

/* Sends `fd` n times in one message, past fdpass_send's own limit, as a
 * lying peer would. */
static void raw_send(int sock, const void *msg, size_t len, int fd, int n)
{
    union {
        char buf[CMSG_SPACE(sizeof(int) * 32)];
        struct cmsghdr align;
    } ctl;
    struct iovec iov = { .iov_base = (void *)msg, .iov_len = len };
    struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.buf,
                         .msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)n) };
    struct cmsghdr *c = CMSG_FIRSTHDR(&mh);

    cr_assert_leq(n, 32);
    memset(&ctl, 0, sizeof(ctl));
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)n);
    for (int i = 0; i < n; i++)
        memcpy(CMSG_DATA(c) + i * sizeof(int), &fd, sizeof(int));
    cr_assert_eq(sendmsg(sock, &mh, 0), (ssize_t)len);
}

Test(fdpass, passes_descriptors_and_a_message)
{
    int sv[2], p[2], q[2], got[FDPASS_MAX], n = -1;
    char out[8] = "region!", in[8];

    pair(sv);
    cr_assert_eq(pipe(p), 0);
    cr_assert_eq(pipe(q), 0);
    cr_assert_eq(fdpass_send(sv[0], out, sizeof(out), (int[]){ p[0], q[1] }, 2), 0);
    cr_assert_eq(fdpass_recv(sv[1], in, sizeof(in), got, FDPASS_MAX, &n, 1000), 0);
    cr_assert_eq(n, 2);
    cr_assert_str_eq(in, "region!");
    cr_assert(same_file(got[0], p[0]));
    cr_assert(same_file(got[1], q[1]));
    /* Without descriptors too. */
    cr_assert_eq(fdpass_send(sv[0], out, sizeof(out), NULL, 0), 0);
    cr_assert_eq(fdpass_recv(sv[1], in, sizeof(in), got + 2, 1, &n, 1000), 0);
    cr_assert_eq(n, 0);
    for (int i = 0; i < 2; i++)
        close(got[i]);
    close(p[0]), close(p[1]), close(q[0]), close(q[1]), close(sv[0]), close(sv[1]);
}

Test(fdpass, refuses_bad_arguments_to_send)
{
    int sv[2], fds[FDPASS_MAX + 1] = { 0 };
    char m = 'x';

    pair(sv);
    cr_assert_eq(fdpass_send(sv[0], &m, 0, NULL, 0), -EINVAL, "an empty message");
    cr_assert_eq(fdpass_send(sv[0], &m, 1, fds, FDPASS_MAX + 1), -EINVAL, "too many");
    cr_assert_eq(fdpass_send(sv[0], &m, 1, NULL, 1), -EINVAL);
    close(sv[0]);
    cr_assert_eq(fdpass_send(sv[1], &m, 1, NULL, 0), -EPIPE, "the peer is gone");
    close(sv[1]);
}

Test(fdpass, more_descriptors_than_asked_for_are_refused_and_closed)
{
    int sv[2], p[2], got[FDPASS_MAX], n = -1, before;
    char m[4] = "abc";

    pair(sv);
    cr_assert_eq(pipe(p), 0);
    before = open_fds();
    raw_send(sv[0], m, sizeof(m), p[0], 3);
    cr_assert_eq(fdpass_recv(sv[1], m, sizeof(m), got, 2, &n, 1000), -EPROTO);
    cr_assert_eq(n, 0);
    cr_assert_eq(open_fds(), before, "every received descriptor was closed");
    close(p[0]), close(p[1]), close(sv[0]), close(sv[1]);
}

Test(fdpass, a_truncated_control_message_is_refused_and_closed)
{
    int sv[2], p[2], got[FDPASS_MAX], n = -1, before;
    char m[4] = "abc";

    pair(sv);
    cr_assert_eq(pipe(p), 0);
    before = open_fds();
    /* More than the receiver has room for: the kernel cuts the control
     * message (MSG_CTRUNC) and installs what fitted. */
    raw_send(sv[0], m, sizeof(m), p[0], 24);
    cr_assert_eq(fdpass_recv(sv[1], m, sizeof(m), got, FDPASS_MAX, &n, 1000), -EPROTO);
    cr_assert_eq(n, 0);
    cr_assert_eq(open_fds(), before);
    close(p[0]), close(p[1]), close(sv[0]), close(sv[1]);
}

Test(fdpass, a_message_of_another_size_is_refused_and_its_descriptors_closed)
{
    int sv[2], p[2], got[FDPASS_MAX], n = -1, before;
    char big[16] = { 0 }, small[8];

    pair(sv);
    cr_assert_eq(pipe(p), 0);
    before = open_fds();
    raw_send(sv[0], big, sizeof(big), p[0], 1);
    cr_assert_eq(fdpass_recv(sv[1], small, sizeof(small), got, FDPASS_MAX, &n, 1000), -EPROTO,
                 "a longer message is truncated");
    raw_send(sv[0], big, 4, p[0], 1);
    cr_assert_eq(fdpass_recv(sv[1], small, sizeof(small), got, FDPASS_MAX, &n, 1000), -EPROTO,
                 "a shorter one");
    cr_assert_eq(n, 0);
    cr_assert_eq(open_fds(), before);
    close(p[0]), close(p[1]), close(sv[0]), close(sv[1]);
}

Test(fdpass, times_out_and_sees_a_closed_peer)
{
    int sv[2], got[1], n = -1;
    char m[4];
    uint64_t t0 = clock_now_ms();

    pair(sv);
    cr_assert_eq(fdpass_recv(sv[1], m, sizeof(m), got, 1, &n, 20), -ETIMEDOUT);
    cr_assert_geq(clock_now_ms() - t0, 19);
    close(sv[0]);
    cr_assert_eq(fdpass_recv(sv[1], m, sizeof(m), got, 1, &n, 1000), -EPIPE);
    cr_assert_eq(fdpass_recv(sv[1], m, sizeof(m), got, FDPASS_MAX + 1, &n, 1000), -EINVAL);
    close(sv[1]);
}

/* tests/unit/test_tlink.c: the trainer link's receive side (tlink_recv)
 * against messages no well-behaved peer sends. Found by
 * tests/fuzz/fuzz_tlink.c; each test here fails on the code before its fix. */
#include <criterion/criterion.h>

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "accumulator/tlink.h"
#include "engine/dtype.h"

/* The lowest descriptor number not in use: it moves if one leaked. */
static int lowest_free_fd(void)
{
    int fd = dup(0);

    cr_assert_geq(fd, 0);
    close(fd);
    return fd;
}

/* An empty message is how the other end's hang-up reads, but a liar can
 * send one with descriptors attached; they are received all the same, and
 * must be closed like those of any refused message. Before the fix, each
 * such message left its descriptors open in the receiver (the sidecar, or
 * a trainer reading its sidecar's replies). */
Test(tlink, an_empty_message_with_descriptors_leaves_none_open)
{
    int sv[2], fds[2], got[TLINK_FDS_MAX] = { -1, -1 }, ngot = -1, free_fd;
    char cbuf[CMSG_SPACE(sizeof(fds))], body[TLINK_BODY_MAX];
    struct iovec iov = { body, 0 };
    struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf,
                          .msg_controllen = sizeof(cbuf) };
    struct cmsghdr *c;
    struct tlink_hdr h;

    cr_assert_eq(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv), 0);
    fds[0] = open("/dev/null", O_RDONLY | O_CLOEXEC);
    fds[1] = open("/dev/null", O_RDONLY | O_CLOEXEC);
    cr_assert(fds[0] >= 0 && fds[1] >= 0);
    memset(cbuf, 0, sizeof(cbuf));
    c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(fds));
    memcpy(CMSG_DATA(c), fds, sizeof(fds));
    cr_assert_eq(sendmsg(sv[0], &msg, 0), 0);
    close(fds[0]);
    close(fds[1]);

    free_fd = lowest_free_fd();
    cr_assert_eq(tlink_recv(sv[1], &h, body, sizeof(body), -1, got, &ngot, 1000), -ECONNRESET);
    cr_assert_eq(ngot, 0, "no descriptor is handed over with an error");
    cr_assert_eq(lowest_free_fd(), free_fd, "the message's descriptors were left open");

    /* A real hang-up still reads as one. */
    close(sv[0]);
    cr_assert_eq(tlink_recv(sv[1], &h, body, sizeof(body), -1, got, &ngot, 1000), -ECONNRESET);
    close(sv[1]);
}

/* The spare bytes after the gradients and after the results are the gap
 * up to the next region, the view page or the end of the memfd; a region
 * that spans the end leaves none. */
Test(tlink, spare_bytes_reach_the_next_region_and_no_further)
{
    struct tlink_register r = {
        .mem = TL_MEM_HOST, .grad_dtype = DTYPE_F32, .grad_count = 16,
        .params_off = 0, .params_bytes = 64,
        .grads_off = 64,                /* 64 bytes, then 4096 spare */
        .results_off = 64 + 64 + 4096,  /* 64 bytes, then 128 spare */
        .buffers_off = 64 + 64 + 4096 + 64 + 128, .buffers_bytes = 8,
        .shared_off = 8192, .region_bytes = 8192 + 4096,
    };

    cr_assert_eq(tlink_spare_after(&r, r.grads_off + 64), 4096);
    cr_assert_eq(tlink_spare_after(&r, r.results_off + 64), 128);
    /* Buffers end 8 bytes in; the view page starts after the gap. */
    cr_assert_eq(tlink_spare_after(&r, r.buffers_off + 8), 8192 - (r.buffers_off + 8));
    /* Inside the parameters: they span it. */
    cr_assert_eq(tlink_spare_after(&r, 32), 0);
    /* Past the memfd. */
    cr_assert_eq(tlink_spare_after(&r, r.region_bytes + 1), 0);
    /* Regions back to back: no room. */
    r.results_off = 128;
    r.buffers_off = 192;
    cr_assert_eq(tlink_spare_after(&r, r.grads_off + 64), 0);
    cr_assert_eq(tlink_spare_after(&r, r.results_off + 64), 0);
    /* An empty region takes no room. */
    r.buffers_bytes = 0;
    cr_assert_eq(tlink_spare_after(&r, r.results_off + 64), 8192 - 192);
}

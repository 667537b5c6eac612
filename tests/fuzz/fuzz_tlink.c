/* tests/fuzz/fuzz_tlink.c: one message from a trainer, as the sidecar
 * reads it (tlink_recv over a real SOCK_SEQPACKET socketpair, with the
 * descriptors passed alongside), then what the sidecar accepts of it: the
 * body size per type (tlink_body_size) and, for a REGISTER, the layout
 * (trainerd_check_layout) against a memfd of exactly the size it claims.
 *
 * Input: one byte of flags, then the datagram.
 *   flags & 3     descriptors sent with it (/dev/null), 0..3
 *   flags & 4     read it as the trainer reads a reply (a body of exactly
 *                 the size the request's type wants), not as the sidecar
 *   flags >> 4    that request's type
 *
 * Invariants: a message is accepted only with the magic, the version and
 * a body length that matches the datagram; descriptors are handed over
 * only with an accepted message, and none is ever left open otherwise; a
 * layout is accepted exactly when every region lies inside the memfd, the
 * results do not overlap the gradients and the view page comes after
 * every tensor (computed here again, in 128-bit arithmetic). */
#include "fuzz.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include "accumulator/gpusess.h"
#include "accumulator/tlink.h"
#include "accumulator/trainerd.h"
#include "accumulator/viewpage.h"
#include "engine/dtype.h"

static int sock[2] = { -1, -1 };
static int devnull = -1;

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    devnull = open("/dev/null", O_RDWR | O_CLOEXEC);
    if (devnull < 0 || socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sock) < 0)
        abort();
    return 0;
}

static bool inside(unsigned __int128 off, unsigned __int128 len, uint64_t region)
{
    return off + len <= region;
}

/* The layout rules of tlink.h and trainerd.h, restated without any
 * arithmetic that can wrap. */
static bool layout_ok(const struct tlink_register *r, uint64_t size)
{
    unsigned __int128 g;

    if ((r->mem != TL_MEM_HOST && r->mem != TL_MEM_CUDA_VMM) || !dtype_valid((int)r->grad_dtype) ||
        r->grad_count == 0 ||
        r->region_bytes != size || size == 0)
        return false;
    if (r->params_off % 64 || r->grads_off % 64 || r->results_off % 64 || r->buffers_off % 64 ||
        r->shared_off % 64 || r->params_bytes % 8 || r->buffers_bytes % 8)
        return false;
    g = (unsigned __int128)r->grad_count * dtype_size((enum dtype)r->grad_dtype);
    if (!inside(r->params_off, r->params_bytes, size) ||
        !inside(r->buffers_off, r->buffers_bytes, size) || !inside(r->grads_off, g, size) ||
        !inside(r->results_off, g, size) || !inside(r->shared_off, VIEWPAGE_BYTES, size))
        return false;
    /* Gradients and results apart. */
    if ((unsigned __int128)r->results_off < r->grads_off + g &&
        (unsigned __int128)r->grads_off < r->results_off + g)
        return false;
    /* The view page after every tensor. */
    return r->shared_off >= r->grads_off + g && r->shared_off >= r->results_off + g &&
           r->shared_off >= (unsigned __int128)r->params_off + r->params_bytes &&
           r->shared_off >= (unsigned __int128)r->buffers_off + r->buffers_bytes;
}

static void check_layout(const struct tlink_register *r)
{
    int rc = trainerd_check_layout(r, r->region_bytes);

    CHECK(rc == 0 || rc == -EINVAL || rc == -EOPNOTSUPP);
    CHECK((rc == -EOPNOTSUPP) == (r->mem != TL_MEM_HOST && r->mem != TL_MEM_CUDA_VMM));
    CHECK((rc == 0) == layout_ok(r, r->region_bytes));
    /* A memfd of any other size is refused. */
    CHECK(trainerd_check_layout(r, r->region_bytes + 64) != 0);
    CHECK(trainerd_check_layout(r, r->region_bytes - 1) != 0);
    /* A GPU registration's device half: accepted or refused, nothing else. */
    rc = gpusess_check_layout(r);
    CHECK(rc == 0 || rc == -EINVAL);
    CHECK(rc != 0 || (r->mem == TL_MEM_CUDA_VMM && r->device_results_off < r->device_bytes &&
                      r->device_grads_off < r->device_bytes));
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    union {
        struct tlink_hello hello;
        struct tlink_register reg;
        struct tlink_u64 u;
        char raw[TLINK_BODY_MAX];
    } b;
    struct tlink_hdr h;
    int fds[3], got[TLINK_FDS_MAX + 1], ngot = -1, nfds, rc;
    uint32_t open_fds;
    uint8_t flags;
    bool reply_side;
    uint16_t req;
    long want = -1;
    char cbuf[CMSG_SPACE(sizeof(fds))];
    struct iovec iov;
    struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1 };

    if (size < 1 || size > 1 + 4096)
        return 0;
    flags = data[0];
    nfds = flags & 3;
    reply_side = flags & 4;
    req = flags >> 4;
    iov = (struct iovec){ (void *)(data + 1), size - 1 };
    for (int i = 0; i < nfds; i++)
        fds[i] = devnull;
    if (nfds) {
        struct cmsghdr *c;

        memset(cbuf, 0, sizeof(cbuf));
        msg.msg_control = cbuf;
        msg.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)nfds);
        c = CMSG_FIRSTHDR(&msg);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)nfds);
        memcpy(CMSG_DATA(c), fds, sizeof(int) * (size_t)nfds);
    }
    open_fds = fuzz_open_fds();
    if (sendmsg(sock[0], &msg, MSG_NOSIGNAL) != (ssize_t)(size - 1))
        return 0;
    if (reply_side)
        want = tlink_body_size(req, true);
    rc = tlink_recv(sock[1], &h, &b, reply_side ? sizeof(b.raw) : sizeof(b), want, got, &ngot, 0);
    CHECK(rc == 0 || rc == -EPROTO || rc == -ECONNRESET);
    if (rc < 0) {
        CHECK(ngot == 0);
        CHECK(fuzz_open_fds() == open_fds);
        return 0;
    }
    CHECK(h.magic == TLINK_MAGIC && h.version == TLINK_VERSION);
    CHECK(h.len == size - 1 - sizeof(h) && h.len <= sizeof(b));
    CHECK(want < 0 || h.len == (uint32_t)want);
    CHECK(ngot == nfds && ngot <= TLINK_FDS_MAX);
    for (int i = 0; i < ngot; i++) {
        CHECK(fcntl(got[i], F_GETFD) >= 0);
        close(got[i]);
    }
    CHECK(fuzz_open_fds() == open_fds);
    if (reply_side)
        return 0;
    /* What the sidecar goes on to judge (trainerd.c, serve_one). */
    want = tlink_body_size(h.type, false);
    if (want < 0 || h.len != (uint32_t)want)
        return 0;
    CHECK((size_t)want <= sizeof(b));
    if (h.type == TL_HELLO) {
        b.hello.name[TLINK_NAME_MAX - 1] = '\0';
        CHECK(strlen(b.hello.name) < TLINK_NAME_MAX);
    }
    if (h.type == TL_REGISTER)
        check_layout(&b.reg);
    return 0;
}

/* tests/fuzz/fuzz_tlink_trainer.c: the trainer's side of the trainer link
 * (src/accumulator/link_sidecar.c) against a sidecar that lies. The
 * trainer connects (HELLO, REGISTER) and calls the link's operations the
 * input names; every reply it reads is one the input scripts, header and
 * all if it likes, with descriptors if it says so.
 *
 * There is no sidecar thread: this file's connect() stands in for libc's
 * for one socket path and hands the trainer one end of a SOCK_SEQPACKET
 * socketpair whose other end already holds every scripted reply, in order,
 * then hangs up. The trainer reads a reply per request as it would from a
 * sidecar that answered each at once (or ahead of time: a liar may), and
 * an input costs no thread switch.
 *
 * Input: records of
 *   u8 op        the operation to call once connected (the first two
 *                records' replies answer HELLO and REGISTER; their op is
 *                not used)
 *   u8 flags     1: a memfd goes with the reply (a state), 2: that memfd
 *                is larger than any state may be, 4: /dev/null goes with it,
 *                8: the bytes are the whole datagram, header included,
 *                16: the sidecar hangs up after this reply
 *   u16 state    the memfd's size when not too large
 *   u32 status   the reply's status, unless the bytes are the datagram
 *   u16 len, then len bytes: the reply's body (or the datagram)
 *
 * Invariants: every operation returns 0 or a negative errno, whatever the
 * replies say; a state taken is no longer than LIMIT_STATE_BYTES; no
 * descriptor is left open once the link is destroyed; ASan watches every
 * copy out of a reply. */
#include "fuzz.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include "accumulator/link_sidecar.h"
#include "accumulator/tlink.h"
#include "accumulator/viewpage.h"
#include "base/limits.h"

#define PATH "/nonexistent/cohort-fuzz/sidecar.sock"
#define REPLIES_MAX 64
#define F_STATE 1
#define F_HUGE 2
#define F_DEVNULL 4
#define F_RAW 8
#define F_HANGUP 16

struct reply {
    uint8_t op, flags;
    uint16_t state_len;
    int32_t status;
    const uint8_t *bytes;
    size_t len;
};

static struct reply replies[REPLIES_MAX];
static size_t n_replies;
static int sidecar = -1;            /* our end of the trainer's socket */
static int devnull = -1;
static struct tlink_register layout;
static struct link_memory mem;

/* Queues one scripted reply. Returns false when no more can go. */
static bool queue(const struct reply *r)
{
    uint8_t b[sizeof(struct tlink_hdr) + TLINK_BODY_MAX + 64];
    struct tlink_hdr h = { TLINK_MAGIC, TLINK_VERSION, TL_REPLY, (uint32_t)r->len, r->status };
    int fds[2], nfds = 0, state = -1;
    char cbuf[CMSG_SPACE(sizeof(fds))];
    struct iovec iov = { (void *)r->bytes, r->len };
    struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1 };
    ssize_t sent;

    if (!(r->flags & F_RAW)) {
        if (r->len > sizeof(b) - sizeof(h))
            return false;
        memcpy(b, &h, sizeof(h));
        memcpy(b + sizeof(h), r->bytes, r->len);
        iov = (struct iovec){ b, sizeof(h) + r->len };
    }
    if (r->flags & F_STATE) {
        state = memfd_create("fuzz-state", MFD_CLOEXEC);
        CHECK(state >= 0);
        CHECK(ftruncate(state, r->flags & F_HUGE ? (off_t)LIMIT_STATE_BYTES + 1
                                                 : (off_t)r->state_len) == 0);
        fds[nfds++] = state;
    }
    if (r->flags & F_DEVNULL)
        fds[nfds++] = devnull;
    if (nfds) {
        struct cmsghdr *cm;

        memset(cbuf, 0, sizeof(cbuf));
        msg.msg_control = cbuf;
        msg.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)nfds);
        cm = CMSG_FIRSTHDR(&msg);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)nfds);
        memcpy(CMSG_DATA(cm), fds, sizeof(int) * (size_t)nfds);
    }
    sent = sendmsg(sidecar, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (state >= 0)
        close(state);
    return sent >= 0 && !(r->flags & F_HANGUP);
}

/* libc's connect(), but for PATH: the trainer gets a socket whose sidecar
 * has already said everything it will say, and then hung up. (With
 * _GNU_SOURCE, glibc declares the address as a transparent union.) */
int connect(int fd, __CONST_SOCKADDR_ARG addr, socklen_t len)
{
    const struct sockaddr *sa = addr.__sockaddr__;
    const struct sockaddr_un *un = (const struct sockaddr_un *)sa;
    int pair[2];

    if (sa->sa_family != AF_UNIX || strcmp(un->sun_path, PATH) != 0)
        return (int)syscall(SYS_connect, fd, sa, len);
    CHECK(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, pair) == 0);
    CHECK(dup3(pair[0], fd, O_CLOEXEC) == fd);
    close(pair[0]);
    sidecar = pair[1];
    for (size_t i = 0; i < n_replies && queue(&replies[i]); i++)
        ;
    /* Past the script, the trainer reads an end, never waits. */
    shutdown(sidecar, SHUT_WR);
    return 0;
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    int memfd;

    (void)argc;
    (void)argv;
    devnull = open("/dev/null", O_RDWR | O_CLOEXEC);
    CHECK(devnull >= 0);
    /* Sixteen f32 gradients, laid out as cohort_create() lays them. */
    layout = (struct tlink_register){
        .mem = TL_MEM_HOST, .grad_dtype = 0, .params_off = 0, .params_bytes = 64,
        .grads_off = 64, .grad_count = 16, .results_off = 128, .buffers_off = 192,
        .buffers_bytes = 0, .shared_off = 256, .region_bytes = 256 + VIEWPAGE_BYTES,
    };
    memfd = memfd_create("fuzz-tensors", MFD_CLOEXEC);
    CHECK(memfd >= 0 && ftruncate(memfd, (off_t)layout.region_bytes) == 0);
    mem = (struct link_memory){
        .map = mmap(NULL, layout.region_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0),
        .memfd = memfd, .layout = &layout, .dtype = 0, .name = "fuzz",
    };
    CHECK(mem.map != MAP_FAILED);
    return 0;
}

static void call(struct link *l, uint8_t op)
{
    struct tlink_view view;
    void *state = NULL;
    size_t len = 0;
    int rc = 0;

    switch (op % 9) {
    case 0: rc = l->ops->update(l, &view); break;
    case 1: rc = l->ops->contribute(l, 32); break;
    case 2: rc = l->ops->consume(l, 1); break;
    case 3: rc = l->ops->set_state(l, "state", 5); break;
    case 4:
        rc = l->ops->take_state(l, &state, &len);
        CHECK(rc < 0 ? state == NULL : state != NULL && len <= LIMIT_STATE_BYTES);
        free(state);
        break;
    case 5: rc = l->ops->set_model_version(l, 7); break;
    case 6: rc = l->ops->set_virtual_batch_size(l, 64); break;
    case 7: rc = l->ops->set_parallel_gradients(l, 2); break;
    case 8: (void)l->ops->gone(l); (void)l->ops->up(l); break;
    }
    /* What include/cohort.h promises a trainer, whatever the sidecar says. */
    CHECK(rc <= 0 && rc > -4096);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct fuzz_in in = { data, size };
    struct link *l = NULL;
    uint32_t open_fds = fuzz_open_fds();
    int rc;

    n_replies = 0;
    while (fuzz_left(&in) && n_replies < REPLIES_MAX) {
        struct reply *r = &replies[n_replies++];
        r->op = fuzz_u8(&in);
        r->flags = fuzz_u8(&in);
        r->state_len = fuzz_u16(&in);
        r->status = (int32_t)fuzz_u32(&in);
        r->bytes = fuzz_bytes(&in, fuzz_u16(&in), &r->len);
    }
    rc = link_sidecar_connect(PATH, &mem, &l);
    CHECK(rc <= 0 && rc > -4096);
    if (rc == 0) {
        for (size_t i = 2; i < n_replies; i++)
            call(l, replies[i].op);
        l->ops->destroy(l);
    }
    if (sidecar >= 0)
        close(sidecar);
    sidecar = -1;
    CHECK(fuzz_open_fds() == open_fds);
    return 0;
}

/* tests/unit/test_link_sidecar.c: the trainer's link to its sidecar
 * (link_sidecar.c) against a sidecar that lies in its replies. A thread
 * here plays the sidecar on a real Unix socket and answers each request
 * with the next reply of a script. Found by tests/fuzz/fuzz_tlink_trainer.c;
 * each test here fails on the code before its fix. */
#include <criterion/criterion.h>

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "accumulator/link_sidecar.h"

struct scripted {
    int32_t status;
    uint32_t len;           /* body bytes, all 'A' */
};

struct fake {
    char dir[64], path[128];
    int lfd;
    const struct scripted *replies;
    size_t n;
    pthread_t thread;
};

/* One connection: a reply per request (none to a CONSUME), then hang up. */
static void *fake_main(void *arg)
{
    struct fake *f = arg;
    char buf[2048], body[TLINK_BODY_MAX];
    int c = accept(f->lfd, NULL, NULL);
    size_t next = 0;

    memset(body, 'A', sizeof(body));
    while (c >= 0 && next < f->n) {
        struct tlink_hdr h;
        ssize_t n = recv(c, buf, sizeof(buf), 0);

        if (n < (ssize_t)sizeof(h))
            break;
        memcpy(&h, buf, sizeof(h));
        if (tlink_one_way(h.type))
            continue;
        if (tlink_send(c, TL_REPLY, f->replies[next].status, body, f->replies[next].len, NULL,
                       0) < 0)
            break;
        next++;
    }
    if (c >= 0)
        close(c);
    return NULL;
}

static void fake_start(struct fake *f, const struct scripted *replies, size_t n)
{
    struct sockaddr_un sa = { .sun_family = AF_UNIX };

    snprintf(f->dir, sizeof(f->dir), "/tmp/cohort-test-XXXXXX");
    cr_assert_not_null(mkdtemp(f->dir));
    snprintf(f->path, sizeof(f->path), "%s/sidecar.sock", f->dir);
    cr_assert_lt(strlen(f->path), sizeof(sa.sun_path));
    memcpy(sa.sun_path, f->path, strlen(f->path) + 1);
    f->lfd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    cr_assert_geq(f->lfd, 0);
    cr_assert_eq(bind(f->lfd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    cr_assert_eq(listen(f->lfd, 1), 0);
    f->replies = replies;
    f->n = n;
    cr_assert_eq(pthread_create(&f->thread, NULL, fake_main, f), 0);
}

static void fake_stop(struct fake *f)
{
    pthread_join(f->thread, NULL);
    close(f->lfd);
    unlink(f->path);
    rmdir(f->dir);
}

/* Sixteen f32 gradients, laid out as cohort_create() lays them. */
static struct tlink_register layout = {
    .mem = TL_MEM_HOST, .grad_dtype = 0, .params_bytes = 64, .grads_off = 64, .grad_count = 16,
    .results_off = 128, .buffers_off = 192, .shared_off = 256,
    .region_bytes = 256 + VIEWPAGE_BYTES,
};

static struct link_memory memory(void)
{
    int fd = memfd_create("test-tensors", MFD_CLOEXEC);
    void *map;

    cr_assert_geq(fd, 0);
    cr_assert_eq(ftruncate(fd, (off_t)layout.region_bytes), 0);
    map = mmap(NULL, layout.region_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    cr_assert_neq(map, MAP_FAILED);
    return (struct link_memory){ .map = map, .memfd = fd, .layout = &layout, .dtype = 0,
                                 .name = "test" };
}

static void memory_free(struct link_memory *m)
{
    munmap(m->map, layout.region_bytes);
    close(m->memfd);
}

/* A refusal may carry a body (the sidecar's own refused TAKE_STATE
 * carries its u64), but only a success's body has the size the trainer
 * expects. Before the fix, a refusal's body of any size up to
 * TLINK_BODY_MAX was copied into the trainer's reply buffer: 1024 bytes
 * into an 8-byte u64 on the stack (take_state), or into the view. */
Test(link_sidecar, a_refusal_with_a_long_body_is_not_copied)
{
    static const struct scripted replies[] = {
        { 0, 0 },                       /* HELLO */
        { 0, 0 },                       /* REGISTER */
        { -ENODATA, TLINK_BODY_MAX },   /* TAKE_STATE */
        { -EIO, TLINK_BODY_MAX },       /* VIEW */
        { 0, sizeof(struct tlink_view) },
    };
    struct link_memory m = memory();
    struct fake f;
    struct link *l = NULL;
    struct tlink_view view;
    void *state = NULL;
    size_t len = 0;

    fake_start(&f, replies, sizeof(replies) / sizeof(replies[0]));
    cr_assert_eq(link_sidecar_connect(f.path, &m, &l), 0);
    cr_assert_eq(l->ops->take_state(l, &state, &len), -ENODATA);
    cr_assert_null(state);
    cr_assert_eq(l->ops->update(l, &view), -EIO);
    cr_assert_eq(l->ops->update(l, &view), 0, "the link goes on after a refusal");
    l->ops->destroy(l);
    fake_stop(&f);
    memory_free(&m);
}

/* A reply's status is 0 or a negative errno; anything else is a broken
 * sidecar, not a result to hand the trainer. Before the fix, a HELLO
 * answered with a positive status left the link connected without ever
 * sending REGISTER, and any other status reached the trainer as the
 * return value of a cohort_* call. */
Test(link_sidecar, a_status_that_is_no_errno_is_a_protocol_error)
{
    static const struct scripted positive[] = { { 5, 0 } };
    static const struct scripted huge[] = { { 0, 0 }, { 0, 0 }, { -1930035200, 0 } };
    struct link_memory m = memory();
    struct fake f;
    struct link *l = NULL;

    fake_start(&f, positive, 1);
    cr_assert_eq(link_sidecar_connect(f.path, &m, &l), -EPROTO);
    fake_stop(&f);

    fake_start(&f, huge, 3);
    cr_assert_eq(link_sidecar_connect(f.path, &m, &l), 0);
    cr_assert_eq(l->ops->contribute(l, 1), -EPROTO);
    l->ops->destroy(l);
    fake_stop(&f);
    memory_free(&m);
}

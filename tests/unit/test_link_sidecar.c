/* tests/unit/test_link_sidecar.c: the trainer's link to its sidecar
 * (link_sidecar.c) against a sidecar that lies in its replies. A thread
 * here plays the sidecar on a real Unix socket and answers each request
 * with the next reply of a script. Found by tests/fuzz/fuzz_tlink_trainer.c;
 * each test here fails on the code before its fix. */
#include <criterion/criterion.h>

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "base/clock.h"
#include "accumulator/link_sidecar.h"
#include "fixture.h"

struct scripted {
    int32_t status;
    uint32_t len;           /* body bytes, all 'A' */
};

struct fake {
    char dir[64], path[128];
    int lfd;
    const struct scripted *replies;
    size_t n;
    bool hold;              /* after the script, answer -ENOSYS until the trainer
                             * hangs up */
    uint16_t types[16];     /* the requests received, in order */
    atomic_uint received;
    atomic_int conn;        /* the trainer's connection, once accepted */
    pthread_t thread;
};

/* One connection: a reply per request (none to a CONSUME), then hang up,
 * or with `hold`, answer -ENOSYS until the trainer does. */
static void *fake_main(void *arg)
{
    struct fake *f = arg;
    char buf[2048], body[TLINK_BODY_MAX];
    int c = accept(f->lfd, NULL, NULL);
    size_t next = 0;

    atomic_store(&f->conn, c);
    memset(body, 'A', sizeof(body));
    while (c >= 0 && (next < f->n || f->hold)) {
        struct tlink_hdr h;
        ssize_t n = recv(c, buf, sizeof(buf), 0);
        unsigned k;

        if (n < (ssize_t)sizeof(h))
            break;
        memcpy(&h, buf, sizeof(h));
        k = atomic_load(&f->received);
        if (k < sizeof(f->types) / sizeof(f->types[0]))
            f->types[k] = h.type;
        atomic_store(&f->received, k + 1);
        if (tlink_one_way(h.type))
            continue;
        if (next == f->n) {
            if (tlink_send(c, TL_REPLY, -ENOSYS, NULL, 0, NULL, 0) < 0)
                break;
            continue;
        }
        if (tlink_send(c, TL_REPLY, f->replies[next].status, body, f->replies[next].len, NULL,
                       0) < 0)
            break;
        next++;
    }
    if (c >= 0)
        close(c);
    return NULL;
}

static void fake_start_as(struct fake *f, const struct scripted *replies, size_t n, bool hold)
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
    f->hold = hold;
    atomic_init(&f->received, 0);
    atomic_init(&f->conn, -1);
    cr_assert_eq(pthread_create(&f->thread, NULL, fake_main, f), 0);
}

static void fake_start(struct fake *f, const struct scripted *replies, size_t n)
{
    fake_start_as(f, replies, n, false);
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

/* ---- The doorbell --------------------------------------------------------- */

/* The node's thread of a fake sidecar: it listens on the trainer's page
 * and answers each request it takes with the next status of its script.
 * Past the script it takes and never answers, as a sidecar that died
 * after its take, and with `hangup` the fake's connection ends then. */
struct bell {
    struct viewpage *p;
    const int64_t *answers;
    size_t n;
    struct fake *hangup;
    atomic_uint taken;
    uint32_t types[8];
    uint64_t values[8];
    atomic_bool stop;
    pthread_t thread;
};

static void *bell_main(void *arg)
{
    struct bell *b = arg;

    viewpage_listen(b->p, true);
    while (!atomic_load(&b->stop)) {
        uint32_t type;
        uint64_t value;
        unsigned k;

        if (!viewpage_take(b->p, &type, &value)) {
            sched_yield();
            continue;
        }
        k = atomic_load(&b->taken);
        if (k < 8) {
            b->types[k] = type;
            b->values[k] = value;
        }
        atomic_store(&b->taken, k + 1);
        if (k < b->n)
            viewpage_answer(b->p, b->answers[k]);
        else if (b->hangup)
            shutdown(atomic_load(&b->hangup->conn), SHUT_RDWR);
    }
    viewpage_listen(b->p, false);
    return NULL;
}

static void bell_start(struct bell *b, struct link_memory *m, const int64_t *answers, size_t n,
                       struct fake *hangup)
{
    memset(b, 0, sizeof(*b));
    b->p = link_shared_page(m);
    b->answers = answers;
    b->n = n;
    b->hangup = hangup;
    cr_assert_eq(pthread_create(&b->thread, NULL, bell_main, b), 0);
    FIXTURE_WAIT_FOR(__atomic_load_n(&b->p->bell.listening, __ATOMIC_SEQ_CST),
                     "the bell thread never listened");
}

static void bell_stop(struct bell *b)
{
    atomic_store(&b->stop, true);
    pthread_join(b->thread, NULL);
}

/* Calls `op` until the bell takes its request, and returns what that call
 * returned. The trainer withdraws a request whose take is late (a loaded
 * machine) and sends it on the socket, where the holding fake refuses it
 * with -ENOSYS (a CONSUME gets no reply at all): then it goes again. */
static int through_bell(struct bell *b, struct link *l, int (*op)(struct link *, uint64_t),
                        uint64_t value)
{
    uint64_t end = clock_now_ms() + 60000;

    for (;;) {
        unsigned before = atomic_load(&b->taken);
        int rc = op(l, value);

        if (atomic_load(&b->taken) != before)
            return rc;
        cr_assert(rc == -ENOSYS || (rc == 0 && op == l->ops->consume),
                  "a request on the socket: %d", rc);
        cr_assert_lt(clock_now_ms(), end, "the bell never took a request");
    }
}

/* A trainer's link, connected to a holding fake sidecar, and the fake's
 * bell thread once bell_start() has started it. */
struct rig {
    struct link_memory m;
    struct fake f;
    struct bell b;
    struct link *l;
};

static void rig_connect(struct rig *r)
{
    static const struct scripted hello_register[] = { { 0, 0 }, { 0, 0 } };

    memset(r, 0, sizeof(*r));
    r->m = memory();
    fake_start_as(&r->f, hello_register, 2, true);
    cr_assert_eq(link_sidecar_connect(r->f.path, &r->m, &r->l), 0);
}

static void rig_stop(struct rig *r)
{
    bell_stop(&r->b);
    r->l->ops->destroy(r->l);
    fake_stop(&r->f);
    memory_free(&r->m);
}

/* While the node's thread listens, CONTRIBUTE and CONSUME go through the
 * page, and a contribution's status comes back. */
Test(link_sidecar, the_doorbell_carries_contributions_and_consumes)
{
    static const int64_t answers[] = { -EAGAIN, 0, 0 };
    struct rig r;
    struct link *l;

    rig_connect(&r);
    l = r.l;
    bell_start(&r.b, &r.m, answers, 3, NULL);
    cr_assert_eq(through_bell(&r.b, l, l->ops->contribute, 3), -EAGAIN);
    cr_assert_eq(through_bell(&r.b, l, l->ops->consume, 9), 0);
    cr_assert_eq(through_bell(&r.b, l, l->ops->contribute, 0), 0);
    cr_assert(l->ops->up(l));
    rig_stop(&r);
    cr_assert_eq(atomic_load(&r.b.taken), 3);
    cr_assert_eq(r.b.types[0], TL_CONTRIBUTE);
    cr_assert_eq(r.b.values[0], 3);
    cr_assert_eq(r.b.types[1], TL_CONSUME);
    cr_assert_eq(r.b.values[1], 9);
    cr_assert_eq(r.b.types[2], TL_CONTRIBUTE);
    cr_assert_eq(r.b.values[2], 0);
}

/* A CONSUME sent on the socket may be unread when the node's thread
 * begins to listen: the next request follows it on the socket, or the
 * node would see the contribution before the consume. */
Test(link_sidecar, a_request_after_a_consume_on_the_socket_follows_it_there)
{
    static const int64_t answers[] = { -EAGAIN };
    struct rig r;
    struct link *l;

    rig_connect(&r);
    l = r.l;
    cr_assert_eq(l->ops->consume(l, 1), 0, "nobody listens: on the socket");
    bell_start(&r.b, &r.m, answers, 1, NULL);
    cr_assert_eq(l->ops->contribute(l, 2), -ENOSYS, "not on the socket after the consume");
    cr_assert_eq(atomic_load(&r.b.taken), 0);
    cr_assert_eq(atomic_load(&r.f.received), 4);
    cr_assert_eq(r.f.types[2], TL_CONSUME);
    cr_assert_eq(r.f.types[3], TL_CONTRIBUTE);
    /* Its reply shows the sidecar read the consume: the bell is free. */
    cr_assert_eq(through_bell(&r.b, l, l->ops->contribute, 2), -EAGAIN);
    rig_stop(&r);
}

/* An answer that is no errno is a broken sidecar, as in a reply. */
Test(link_sidecar, a_doorbell_answer_that_is_no_errno_is_a_protocol_error)
{
    static const int64_t answers[] = { 5 };
    struct rig r;
    struct link *l;

    rig_connect(&r);
    l = r.l;
    bell_start(&r.b, &r.m, answers, 1, NULL);
    cr_assert_eq(through_bell(&r.b, l, l->ops->contribute, 1), -EPROTO);
    cr_assert(!l->ops->up(l), "the link goes on with a sidecar that broke the protocol");
    cr_assert_eq(l->ops->contribute(l, 1), -ENOTCONN);
    rig_stop(&r);
}

/* A sidecar that took a request and then went away cannot answer it: the
 * trainer finds it gone within a slice of its wait, not at the reply
 * timeout. */
Test(link_sidecar, a_sidecar_gone_after_its_take_is_noticed)
{
    struct rig r;
    struct link *l;
    uint64_t t0;

    rig_connect(&r);
    l = r.l;
    bell_start(&r.b, &r.m, NULL, 0, &r.f);      /* takes, hangs up, never answers */
    t0 = clock_now_ms();
    cr_assert_eq(through_bell(&r.b, l, l->ops->contribute, 1), -ENOTCONN);
    cr_assert_lt(clock_now_ms() - t0, 20000, "noticed only at the reply timeout");
    cr_assert(!l->ops->up(l));
    cr_assert_eq(atomic_load(&r.b.taken), 1);
    rig_stop(&r);
}

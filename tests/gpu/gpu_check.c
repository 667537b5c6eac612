/* tests/gpu/gpu_check.c: the checks that need a GPU, run by make test-gpu
 * (tests/gpu/README.md). Each prints one line, "ok", "FAIL" or "skipped"
 * with the reason; where there is no GPU support in this build, no driver
 * or no device, everything is skipped and the exit status is 0. Exit
 * status 1 when a check failed.
 *
 *   gpu_check              all checks
 *   gpu_check --driver-only  the driver's checks alone, without NCCL
 *                          (tests/proc/test_gpu_driver.py runs them
 *                          against the stand-in, tests/gpu/fake_cuda.c)
 *   gpu_check --import FD  (internal) the importing side of the handover,
 *                          speaking over the Unix socket FD
 */
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "accumulator/tlink.h"
#include "accumulator/trainerd.h"
#include "accumulator/viewpage.h"
#include "base/clock.h"
#include "base/opt.h"
#include "membership/broker.h"
#include "membership/brokerd.h"
#include "rpc/rpc.h"
#include "gpu/cudrv.h"
#include "gpu/fdpass.h"
#include "gpu/gpuid.h"
#include "gpu/nccllib.h"
#include "gpu/ncomm.h"
#include "gpu/vmm.h"

#define REGION (3u << 20)       /* not a whole number of 2 MiB granules */
#define TIMEOUT_MS 60000

/* What the exporter tells the importer beside the fd. */
struct offer {
    struct gpuid device;
    uint64_t bytes;
};

static int failures;

static void report(const char *check, int rc, const char *detail)
{
    if (rc == 0) {
        printf("test-gpu: %s: ok\n", check);
    } else {
        printf("test-gpu: %s: FAIL (%s%s%s)\n", check, strerror(-rc), detail ? ": " : "",
               detail ? detail : "");
        failures++;
    }
}

static void fill(uint8_t *buf, size_t n, uint8_t seed)
{
    for (size_t i = 0; i < n; i++)
        buf[i] = (uint8_t)(seed + i * 31);
}

static bool holds(const uint8_t *buf, size_t n, uint8_t seed)
{
    for (size_t i = 0; i < n; i++)
        if (buf[i] != (uint8_t)(seed + i * 31))
            return false;
    return true;
}

/* The sidecar's side: map the region behind the fd on the device with
 * the offered UUID, check the exporter's bytes, write its own. */
static int import_side(int sock)
{
    struct offer o;
    struct cudrv *d = NULL;
    struct vmm_region *r = NULL;
    uint8_t *buf = NULL;
    int fd = -1, n = 0, ordinal, rc;
    char ok = 1;

    rc = fdpass_recv(sock, &o, sizeof(o), &fd, 1, &n, TIMEOUT_MS);
    if (rc == 0 && n != 1)
        rc = -EPROTO;
    if (rc == 0)
        rc = cudrv_open(&d);
    if (rc == 0)
        rc = cudrv_find(d, &o.device, &ordinal);
    if (rc == 0)
        rc = vmm_import(d, ordinal, fd, (size_t)o.bytes, &r);
    if (rc == 0 && !(buf = malloc((size_t)o.bytes)))
        rc = -ENOMEM;
    if (rc == 0)
        rc = vmm_read(r, 0, buf, (size_t)o.bytes);
    if (rc == 0 && !holds(buf, (size_t)o.bytes, 7))
        rc = -EBADMSG;
    if (rc == 0) {
        fill(buf, (size_t)o.bytes, 99);
        rc = vmm_write(r, 0, buf, (size_t)o.bytes);
    }
    ok = rc == 0;
    free(buf);
    vmm_destroy(r);
    cudrv_close(d);
    if (fd >= 0)
        close(fd);
    if (fdpass_send(sock, &ok, 1, NULL, 0) < 0)
        return 1;
    if (rc < 0)
        fprintf(stderr, "gpu_check --import: %s\n", strerror(-rc));
    return rc == 0 ? 0 : 1;
}

/* The trainer's side: export a region of device 0, hand it to a process
 * of its own (another PID, as a sidecar is) and see each other's bytes. */
static void handover(struct cudrv *d, const char *self)
{
    struct gpuid ids[CUDRV_DEVICES_MAX];
    struct vmm_region *r = NULL;
    struct offer o;
    uint8_t *buf = NULL;
    int sv[2] = { -1, -1 }, fd = -1, n, rc, status;
    char ok = 0, arg[16];
    pid_t pid = -1;

    rc = cudrv_list(d, ids, CUDRV_DEVICES_MAX);
    if (rc >= 0)
        rc = vmm_export(d, 0, REGION, &r, &fd);
    if (rc < 0)
        goto out;
    o = (struct offer){ .device = ids[0], .bytes = vmm_bytes(r) };
    buf = malloc(vmm_bytes(r));
    if (!buf) {
        rc = -ENOMEM;
        goto out;
    }
    fill(buf, vmm_bytes(r), 7);
    rc = vmm_write(r, 0, buf, vmm_bytes(r));
    if (rc < 0)
        goto out;
    if (socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv) < 0) {
        rc = -errno;
        goto out;
    }
    /* A fresh program, not a fork: CUDA does not survive fork. */
    pid = fork();
    if (pid == 0) {
        close(sv[0]);
        snprintf(arg, sizeof(arg), "%d", sv[1]);
        execl(self, self, "--import", arg, (char *)NULL);
        _exit(127);
    }
    if (pid < 0) {
        rc = -errno;
        goto out;
    }
    close(sv[1]);
    sv[1] = -1;
    rc = fdpass_send(sv[0], &o, sizeof(o), &fd, 1);
    if (rc == 0)
        rc = fdpass_recv(sv[0], &ok, 1, NULL, 0, &n, TIMEOUT_MS);
    if (rc == 0 && !ok)
        rc = -EIO;
    if (rc == 0)
        rc = vmm_read(r, 0, buf, vmm_bytes(r));
    if (rc == 0 && !holds(buf, vmm_bytes(r), 99))
        rc = -EBADMSG;
out:
    if (pid > 0)
        waitpid(pid, &status, 0);
    /* The copies in and out are the ones a host-staged reduction makes. */
    report("handover of a VMM region to another process (fd over SCM_RIGHTS), "
           "with host copies both ways", rc, NULL);
    for (int i = 0; i < 2; i++)
        if (sv[i] >= 0)
            close(sv[i]);
    if (fd >= 0)
        close(fd);
    free(buf);
    vmm_destroy(r);
}

/* ---- the host-staged reduction: two trainers on device 0, each through a
 * sidecar of its own (trainerd, in this process), one broker ---- */

#define STAGED_N (5u << 19)    /* floats: 10 MiB, three staging segments */

struct staged {
    struct trainerd *sd;
    char path[96];
    int sock, memfd, devfd;
    void *map;
    size_t map_len;
    struct vmm_region *dev;
    struct tlink_register r;
};

static int32_t staged_call(int fd, uint16_t type, const void *body, uint32_t len, const int *fds,
                           int nfds)
{
    struct tlink_hdr h;
    char buf[TLINK_BODY_MAX];
    int got[TLINK_FDS_MAX], ngot;

    if (tlink_send(fd, type, 0, body, len, fds, nfds) < 0 ||
        tlink_recv(fd, &h, buf, sizeof(buf), -1, got, &ngot, TIMEOUT_MS) < 0)
        return -EPIPE;
    for (int i = 0; i < ngot; i++)
        close(got[i]);
    return h.status;
}

static float staged_grad(int member, size_t k)
{
    return (float)(k % 1000) * (float)(member + 1) - 7.0f * (float)member;
}

/* A trainer's memory (a sealed memfd laid out as for host memory, and a
 * device region of its gradients, results in place) and its sidecar. */
static int staged_start(struct staged *t, struct cudrv *d, const struct gpuid *dev, int ordinal,
                        bool host_staged, const char *broker, const char *dir, int member,
                        float *g)
{
    struct trainerd_config tc = { .node = { .broker = broker, .cohort = "gpu-check",
                                            .id = member ? "m-1" : "m-0", .host = "127.0.0.1" },
                                  .gpu_host_staged = host_staged };
    struct tlink_hello hello = { .api_version = TLINK_VERSION, .name = "gpu-check" };
    struct sockaddr_un sa = { .sun_family = AF_UNIX };
    const size_t gbytes = STAGED_N * sizeof(float);
    int fds[2], rc;

    snprintf(t->path, sizeof(t->path), "%s/%d.sock", dir, member);
    tc.socket_path = t->path;
    rc = trainerd_start(&tc, &t->sd);
    if (rc < 0)
        return rc;
    t->r = (struct tlink_register){ .mem = TL_MEM_CUDA_VMM, .grad_dtype = DTYPE_F32,
                                    .grad_count = STAGED_N, .params_off = 0, .params_bytes = 64,
                                    .grads_off = 64, .results_off = 64 + gbytes,
                                    .buffers_off = 64 + 2 * gbytes,
                                    .shared_off = 2 * gbytes + 4096 };
    t->r.region_bytes = t->map_len = t->r.shared_off + VIEWPAGE_BYTES;
    memcpy(t->r.cuda_uuid, dev->b, GPUID_BYTES);
    t->memfd = memfd_create("gpu-check", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (t->memfd < 0 || ftruncate(t->memfd, (off_t)t->map_len) < 0 ||
        fcntl(t->memfd, F_ADD_SEALS, TLINK_SEALS) < 0)
        return -errno;
    t->map = mmap(NULL, t->map_len, PROT_READ | PROT_WRITE, MAP_SHARED, t->memfd, 0);
    if (t->map == MAP_FAILED) {
        t->map = NULL;
        return -errno;
    }
    rc = vmm_export(d, ordinal, gbytes, &t->dev, &t->devfd);
    if (rc < 0)
        return rc;
    for (size_t k = 0; k < STAGED_N; k++)
        g[k] = staged_grad(member, k);
    rc = vmm_write(t->dev, 0, g, gbytes);
    if (rc < 0)
        return rc;
    t->r.device_bytes = vmm_bytes(t->dev);
    t->sock = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    memcpy(sa.sun_path, t->path, strlen(t->path) + 1);
    if (t->sock < 0 || connect(t->sock, (struct sockaddr *)&sa, sizeof(sa)) < 0)
        return -errno;
    fds[0] = t->memfd;
    fds[1] = t->devfd;
    if ((rc = staged_call(t->sock, TL_HELLO, &hello, sizeof(hello), NULL, 0)) < 0 ||
        (rc = staged_call(t->sock, TL_REGISTER, &t->r, sizeof(t->r), fds, 2)) < 0 ||
        (rc = staged_call(t->sock, TL_SET_VBS, &(struct tlink_u64){ 2 }, 8, NULL, 0)) < 0)
        return rc;
    return 0;
}

static void staged_stop(struct staged *t)
{
    if (t->sock >= 0)
        close(t->sock);
    trainerd_stop(t->sd);
    if (t->map)
        munmap(t->map, t->map_len);
    if (t->memfd >= 0)
        close(t->memfd);
    if (t->devfd >= 0)
        close(t->devfd);
    vmm_destroy(t->dev);
}

/* Both trainers' loops on this thread until each holds a result. */
static int staged_rounds(struct staged *t)
{
    uint64_t until = clock_now_ms() + TIMEOUT_MS;
    bool sent[2] = { false, false };
    struct tlink_view v;
    int done = 0, rc;

    while (done < 2) {
        done = 0;
        for (int i = 0; i < 2; i++) {
            /* A sidecar says nothing unasked unless it ends the session. */
            if (tlink_wait(t[i].sock, 0) == 0) {
                struct tlink_hdr h;
                char buf[TLINK_BODY_MAX];
                int got[TLINK_FDS_MAX], ngot;
                rc = tlink_recv(t[i].sock, &h, buf, sizeof(buf), -1, got, &ngot, 0);
                for (int k = 0; k < ngot; k++)
                    close(got[k]);
                return rc < 0 ? rc : h.status < 0 ? h.status : -EPROTO;
            }
            viewpage_read((const struct viewpage *)((char *)t[i].map + t[i].r.shared_off), &v);
            if (v.wants_state) {
                int fd = tlink_memfd_from("state", "st", 2);
                rc = fd < 0 ? fd : staged_call(t[i].sock, TL_SET_STATE, &(struct tlink_u64){ 2 },
                                               8, &fd, 1);
                if (fd >= 0)
                    close(fd);
                if (rc < 0)
                    return rc;
            }
            if (!sent[i] && v.connected && v.wants_gradients && v.size == 2) {
                rc = staged_call(t[i].sock, TL_CONTRIBUTE, &(struct tlink_u64){ 1 }, 8, NULL, 0);
                if (rc < 0)
                    return rc;
                sent[i] = true;
            }
            done += v.has_gradients;
        }
        if (clock_now_ms() > until)
            return -ETIMEDOUT;
        usleep(2000);
    }
    return 0;
}

/* Two trainers through sidecars of their own: host-staged, both on device
 * 0; or with NCCL, trainer i on device i. */
static void two_sidecars(struct cudrv *d, bool nccl)
{
    struct brokerd_config bc = { .listen = "127.0.0.1:0", .open = true };
    struct staged t[2] = { { .sock = -1, .memfd = -1, .devfd = -1 },
                           { .sock = -1, .memfd = -1, .devfd = -1 } };
    struct gpuid ids[CUDRV_DEVICES_MAX];
    char broker[64], dir[] = "/tmp/cohort-gpu-check-XXXXXX";
    struct brokerd *bd = NULL;
    float *g = malloc(STAGED_N * sizeof(float)), *res[2] = { NULL, NULL };
    const char *detail = NULL;
    int rc, started = 0;
    bool rpc_up = false;

    rc = g ? cudrv_list(d, ids, CUDRV_DEVICES_MAX) : -ENOMEM;
    if (rc >= 0 && !mkdtemp(dir))
        rc = -errno;
    if (rc >= 0) {
        rc = rpc_init();
        rpc_up = rc == 0;
    }
    if (rc >= 0) {
        broker_config_default(&bc.broker);
        bc.broker.startup_hold_ms = 0;
        rc = brokerd_start(&bc, &bd);
    }
    if (rc >= 0)
        rc = brokerd_declare(bd, "gpu-check", 0, 0);
    if (rc >= 0)
        snprintf(broker, sizeof(broker), "127.0.0.1:%d", brokerd_port(bd));
    for (int i = 0; rc >= 0 && i < 2; i++, started++)
        rc = staged_start(&t[i], d, &ids[nccl ? i : 0], nccl ? i : 0, !nccl, broker, dir, i, g);
    if (rc >= 0)
        rc = staged_rounds(t);
    for (int i = 0; rc >= 0 && i < 2; i++) {
        res[i] = malloc(STAGED_N * sizeof(float));
        rc = res[i] ? vmm_read(t[i].dev, 0, res[i], STAGED_N * sizeof(float)) : -ENOMEM;
    }
    if (rc >= 0 && memcmp(res[0], res[1], STAGED_N * sizeof(float)) != 0) {
        rc = -EBADMSG;
        detail = "the two devices hold different results";
    }
    for (size_t k = 0; rc >= 0 && k < STAGED_N; k++) {
        if (res[0][k] != (staged_grad(0, k) + staged_grad(1, k)) / 2.0f) {
            rc = -EBADMSG;
            detail = "a result is not the mean of the two members' gradients";
        }
    }
    /* Which path ran shows in the memfd: a host-staged round leaves the
     * gradients and the mean there, an NCCL round neither. */
    for (int i = 0; rc >= 0 && i < 2; i++) {
        const float *mg = (const float *)(void *)((char *)t[i].map + t[i].r.grads_off);
        const float *mr = (const float *)(void *)((char *)t[i].map + t[i].r.results_off);
        bool untouched = true;

        for (size_t k = 0; k < STAGED_N && untouched; k += 4099)
            untouched = mg[k] == 0.0f && mr[k] == 0.0f;
        if (nccl && !untouched) {
            rc = -EBADMSG;
            detail = "gradients went through host memory: the round was not reduced with NCCL";
        } else if (!nccl && mr[1] != res[i][1]) {
            rc = -EBADMSG;
            detail = "the memfd does not hold the result: the round was not host-staged";
        }
    }
    report(nccl ? "NCCL reduction of two trainers' device gradients on two GPUs through their "
                  "sidecars (a communicator of two ranks, no host copy)"
                : "host-staged reduction of two trainers' device gradients through their sidecars "
                  "(device to pinned host, the engine, host to device)",
           rc < 0 ? rc : 0, detail);
    for (int i = 0; i < started; i++)
        staged_stop(&t[i]);
    if (bd)
        brokerd_stop(bd);
    if (rpc_up)
        rpc_shutdown();
    rmdir(dir);
    free(res[0]);
    free(res[1]);
    free(g);
}

/* NCCL on one GPU: a communicator of one rank, made, polled and aborted
 * through the same machine as an epoch's. */
static void nccl_one_rank(void)
{
    const struct ncomm_ops *ops;
    struct ncomm *c = NULL;
    struct ncomm_plan plan = { .shrink = false };
    static const char *const self[] = { "gpu-check" };
    int rc;

    rc = nccllib_load(&ops);
    if (rc < 0) {
        printf("test-gpu: NCCL communicator of one rank: skipped (NCCL could not be loaded)\n");
        return;
    }
    rc = ncomm_create(ops, &c);
    if (rc == 0)
        rc = ops->get_unique_id(ops->arg, &plan.id);
    if (rc == 0)
        rc = ncomm_start(c, 1, self, 1, self[0], &plan);
    if (rc == 0)
        rc = ncomm_wait(c, TIMEOUT_MS, NULL);
    if (rc == 0 && ncomm_state(c) != NCOMM_READY)
        rc = -EIO;
    if (rc == 0)
        rc = ncomm_abort(c, TIMEOUT_MS);
    ncomm_destroy(c);
    report("NCCL communicator of one rank (non-blocking create, poll, abort)", rc, NULL);
}

/* NCCL on two GPUs: a communicator of two ranks, rank i on device i
 * (made current with a region of its own), then rank 1 leaves and rank 0
 * shrinks it to one with ncclCommShrink, through the same machine as an
 * epoch's. One thread drives both ranks: the calls are non-blocking. */
static void nccl_shrink(struct cudrv *d)
{
    static const char *const ab[] = { "a", "b" }, *const a[] = { "a" };
    const char *what = "NCCL shrink of a communicator of two ranks on two GPUs to one "
                       "(ncclCommShrink, non-blocking)";
    const struct ncomm_ops *ops;
    struct ncomm *c[2] = { NULL, NULL };
    struct vmm_region *r[2] = { NULL, NULL };
    struct ncomm_plan plan = { .shrink = false };
    const char *detail = NULL;
    int fd, rc;

    rc = nccllib_load(&ops);
    if (rc < 0) {
        printf("test-gpu: %s: skipped (NCCL could not be loaded)\n", what);
        return;
    }
    if (!ops->shrink) {
        printf("test-gpu: %s: skipped (NCCL %d has no ncclCommShrink; 2.27 has)\n", what,
               nccllib_version());
        return;
    }
    rc = ops->get_unique_id(ops->arg, &plan.id);
    for (int i = 0; rc == 0 && i < 2; i++) {
        rc = vmm_export(d, i, 1, &r[i], &fd);
        if (rc == 0) {
            close(fd);
            rc = vmm_enter(r[i]);
        }
        if (rc == 0)
            rc = ncomm_create(ops, &c[i]);
        if (rc == 0)
            rc = ncomm_start(c[i], 1, ab, 2, ab[i], &plan);
    }
    for (int i = 0; rc == 0 && i < 2; i++)
        rc = ncomm_wait(c[i], TIMEOUT_MS, NULL);
    if (rc == 0) {
        /* b leaves; a, alone, shrinks. */
        ncomm_abort(c[1], TIMEOUT_MS);
        rc = vmm_enter(r[0]);
    }
    if (rc == 0)
        rc = ncomm_start(c[0], 2, a, 1, a[0], &(struct ncomm_plan){ .shrink = true });
    if (rc == 0)
        rc = ncomm_wait(c[0], TIMEOUT_MS, NULL);
    if (rc == 0 && (ncomm_state(c[0]) != NCOMM_READY || ncomm_rank(c[0]) != 0 ||
                    ncomm_epoch(c[0]) != 2)) {
        rc = -EBADMSG;
        detail = "the shrunk communicator is not rank 0 of epoch 2, ready";
    }
    for (int i = 0; i < 2; i++) {
        ncomm_destroy(c[i]);
        vmm_destroy(r[i]);
    }
    report(what, rc, detail);
}

int main(int argc, char **argv)
{
    struct cudrv *d = NULL;
    struct gpuid ids[CUDRV_DEVICES_MAX];
    const char *why = "";
    int rc, n;

    bool driver_only = argc == 2 && strcmp(argv[1], "--driver-only") == 0;

    if (argc == 3 && strcmp(argv[1], "--import") == 0) {
        uint64_t sock;
        if (opt_uint(argv[2], 0, 1 << 20, &sock) < 0)
            return 2;
        return import_side((int)sock);
    }
    rc = cudrv_open(&d);
    switch (rc) {
    case 0:
        break;
    case -EOPNOTSUPP:
        why = "no GPU support in this build (no cuda.h and nccl.h under CUDA_HOME)";
        break;
    case -ELIBACC:
        why = "no CUDA driver (libcuda.so.1 could not be loaded)";
        break;
    case -ENXIO:
        why = "no GPU on this machine";
        break;
    default:
        why = "the CUDA driver failed to start";
        break;
    }
    if (rc < 0) {
        printf("test-gpu: skipped: %s.\n", why);
        return rc == -EOPNOTSUPP || rc == -ELIBACC || rc == -ENXIO ? 0 : 1;
    }
    n = cudrv_list(d, ids, CUDRV_DEVICES_MAX);
    printf("test-gpu: %d device(s) visible.\n", n);
    handover(d, "/proc/self/exe");
    two_sidecars(d, false);
    if (!driver_only) {
        nccl_one_rank();
        if (n >= 2) {
            two_sidecars(d, true);
            nccl_shrink(d);
        } else {
            printf("test-gpu: NCCL across two GPUs: skipped (%d device visible; NCCL needs a "
                   "GPU per rank).\n", n);
        }
    }
    cudrv_close(d);
    printf("test-gpu: %s.\n", failures ? "FAILED" : "passed");
    return failures ? 1 : 0;
}

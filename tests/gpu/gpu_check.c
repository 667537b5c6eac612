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
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "base/opt.h"
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
        rc = ncomm_wait(c, TIMEOUT_MS);
    if (rc == 0 && ncomm_state(c) != NCOMM_READY)
        rc = -EIO;
    if (rc == 0)
        rc = ncomm_abort(c, TIMEOUT_MS);
    ncomm_destroy(c);
    report("NCCL communicator of one rank (non-blocking create, poll, abort)", rc, NULL);
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
    if (!driver_only) {
        nccl_one_rank();
        printf("test-gpu: NCCL across two or more GPUs: skipped (not built yet; docs/gpu.md).\n");
    }
    cudrv_close(d);
    printf("test-gpu: %s.\n", failures ? "FAILED" : "passed");
    return failures ? 1 : 0;
}

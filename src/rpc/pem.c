/* src/rpc/pem.c: rpc.h's PEM files, read with a cap so that a wrong path
 * (a log, a device) cannot make a process read without end. */
#include "rpc/rpc.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int rpc_pem_load(const char *path, char **out)
{
    /* One byte past the cap tells an over-long file from a full one. */
    size_t cap = RPC_PEM_MAX + 1, got = 0;
    char *buf;
    int fd, rc = 0;

    fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -errno;
    buf = malloc(cap + 1);
    if (!buf) {
        close(fd);
        return -ENOMEM;
    }
    while (got < cap) {
        ssize_t r = read(fd, buf + got, cap - got);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0) {
            rc = -errno;
            break;
        }
        if (r == 0)
            break;
        got += (size_t)r;
    }
    close(fd);
    buf[got] = '\0';
    if (rc == 0 && got > RPC_PEM_MAX)
        rc = -EFBIG;
    else if (rc == 0 && (memchr(buf, '\0', got) || !strstr(buf, "-----BEGIN ")))
        rc = -EINVAL;
    if (rc < 0) {
        rpc_pem_free(buf);
        return rc;
    }
    *out = buf;
    return 0;
}

void rpc_pem_free(char *pem)
{
    if (!pem)
        return;
    explicit_bzero(pem, strlen(pem));
    free(pem);
}

/* src/averager/avlink.c: see avlink.h. The trainer's side keeps one
 * connection per kind of call, each under its own lock, so that the calls
 * cohort.h allows on other threads than the step's (the state calls) never
 * wait behind a step: MAIN (create, wait, step, bits), STATE (state_wanted,
 * provide_state), LOAD (load_state) and CTL (sharing, parts served). All
 * but MAIN attach on first use. */
#include "averager/avlink.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/magic.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/vfs.h>
#include <unistd.h>

#include "accumulator/tlink.h"
#include "averager/averager.h"
#include "base/clock.h"

#define CALL_TIMEOUT_MS 30000

_Static_assert(sizeof(struct avlink_create) <= TLINK_BODY_MAX, "CREATE fits a message");
_Static_assert(sizeof(struct avlink_created) <= TLINK_BODY_MAX, "its reply too");
_Static_assert(AVLINK_ERROR_MAX <= TLINK_BODY_MAX, "a sentence fits a reply");

long avlink_body_size(uint16_t type, bool reply)
{
    switch (type) {
    case AVL_HELLO: return reply ? 0 : (long)sizeof(struct avlink_hello);
    case AVL_ATTACH: return reply ? 0 : (long)sizeof(struct avlink_attach);
    case AVL_CREATE: return reply ? (long)sizeof(struct avlink_created)
                                  : (long)sizeof(struct avlink_create);
    case AVL_WAIT:
    case AVL_LOAD_STATE:
        return reply ? (type == AVL_LOAD_STATE ? (long)sizeof(struct avlink_u64) : 0)
                     : (long)sizeof(struct avlink_u32);
    case AVL_STEP: return reply ? 0 : (long)sizeof(struct avlink_step);
    case AVL_BITS: return reply ? (long)sizeof(struct avlink_bits) : 0;
    case AVL_SET_BITS: return reply ? 0 : (long)sizeof(struct avlink_bits);
    case AVL_SET_SHARING: return reply ? 0 : (long)sizeof(struct avlink_sharing);
    case AVL_SHARING: return reply ? (long)sizeof(struct avlink_sharing) : 0;
    case AVL_STATE_WANTED: return (long)sizeof(struct avlink_u32);
    case AVL_PROVIDE_STATE: return reply ? 0 : (long)sizeof(struct avlink_u64);
    case AVL_PARTS_SERVED: return reply ? (long)sizeof(struct avlink_u64) : 0;
    default: return -1;
    }
}

int avlink_region_layout(uint64_t count, uint64_t gather_max, uint64_t plan_len,
                         uint64_t *bytes, uint64_t *gather_off, uint64_t *plan_off)
{
    uint64_t off, poff;

    if (count > AVLINK_COUNT_MAX || gather_max > UINT32_MAX || plan_len > AVLINK_PLAN_MAX)
        return -EOVERFLOW;
    /* The gathered bytes start on a cache line of their own. */
    off = (count * sizeof(float) + 63) / 64 * 64;
    *gather_off = off;
    *bytes = off + (gather_max ? gather_max : 1);
    poff = (*bytes + 7) / 8 * 8;
    if (plan_off)
        *plan_off = poff;
    if (plan_len)
        *bytes = poff + plan_len * sizeof(struct avlink_range);
    return 0;
}

int avlink_region_bytes(uint64_t count, uint64_t gather_max, uint64_t *bytes, uint64_t *gather_off)
{
    return avlink_region_layout(count, gather_max, 0, bytes, gather_off, NULL);
}

int avlink_memfd(const char *name, const void *data, size_t len, bool frozen)
{
    int fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
    int seals = TLINK_SEALS | (frozen ? F_SEAL_WRITE : 0);
    int rc;

    if (fd < 0)
        return -errno;
    if (ftruncate(fd, (off_t)len) < 0) {
        rc = -errno;
        goto err;
    }
    if (data && len) {
        void *m = mmap(NULL, len, PROT_WRITE, MAP_SHARED, fd, 0);
        if (m == MAP_FAILED) {
            rc = -errno;
            goto err;
        }
        memcpy(m, data, len);
        munmap(m, len);
    }
    if (fcntl(fd, F_ADD_SEALS, seals) < 0) {
        rc = -errno;
        goto err;
    }
    return fd;
err:
    close(fd);
    return rc;
}

int avlink_memfd_check(int fd, uint64_t len)
{
    struct statfs fs;
    struct stat st;
    int seals;

    /* A memfd lives on shmem; a hugetlbfs one may fault when its pool runs
     * dry, and an unsealed one may shrink under the mapping (SIGBUS). */
    if (fstatfs(fd, &fs) < 0 || fs.f_type != TMPFS_MAGIC)
        return -EPERM;
    seals = fcntl(fd, F_GET_SEALS);
    if (seals < 0 || (seals & TLINK_SEALS) != TLINK_SEALS)
        return -EPERM;
    if (fstat(fd, &st) < 0 || st.st_size < 0 || (uint64_t)st.st_size != len)
        return -EINVAL;
    return 0;
}

/* ---- the trainer's side ------------------------------------------------ */

enum role { MAIN, STATE, LOAD, CTL, ROLES };

struct conn {
    pthread_mutex_t mu;
    int sock;                   /* -1: not open, or lost */
};

struct avlink {
    struct conn c[ROLES];
    char path[sizeof(((struct sockaddr_un *)0)->sun_path)];
    uint8_t token[AVLINK_TOKEN_BYTES];
    char id[AVLINK_ID_MAX + 1];
    atomic_bool lost;           /* MAIN is gone: the averager with it (read under
                                 * the other roles' locks) */
    bool bits_stale;            /* a step failed: ask for the bits */
    float *data;                /* the shared region's vector */
    uint8_t *gather;            /* its gathered bytes */
    void *map;
    size_t map_len;
    uint64_t count, gather_max;
    char err[AVLINK_ERROR_MAX];         /* MAIN's last refusal */
    char load_err[AVLINK_ERROR_MAX];    /* LOAD's */
    char bits[AVLINK_BITS_MAX + 1];
};

struct avlink_result {
    void *buf;
    size_t len;
    const struct avlink_result_hdr *h;
    const struct avlink_result_entry *e;
    const uint8_t **gathered;
};

static int dial(const char *path)
{
    struct sockaddr_un sa = { .sun_family = AF_UNIX };
    int s;

    if (strlen(path) >= sizeof(sa.sun_path))
        return -ENAMETOOLONG;
    memcpy(sa.sun_path, path, strlen(path) + 1);
    s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (s < 0)
        return -errno;
    if (connect(s, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
        int rc = -errno;
        close(s);
        return rc;
    }
    return s;
}

/* The sidecar tells a connection that has not spoken yet while it serves
 * an Accumulator that it is busy (accumulator/trainerd.h): ours speak at
 * once, so such a refusal is a race lost, and the call is tried again. */
#define FIRST_TRIES 5
#define FIRST_RETRY_MS 50

static int exchange(int sock, uint16_t type, const void *body, uint32_t len, const int *fds,
                    int nfds, void *out, uint32_t out_len, int *fd_out, int timeout_ms, char *why,
                    size_t why_len);

static int dial(const char *path);

/* Dials and sends the link's first message; on 0 *sock is the link. */
static int dial_first(const char *path, uint16_t type, const void *body, uint32_t len, int *sock,
                      char *why, size_t why_len)
{
    int s, rc = -EBUSY;

    for (int i = 0; i < FIRST_TRIES && rc == -EBUSY; i++) {
        if (i)
            clock_sleep_ms(FIRST_RETRY_MS);
        s = dial(path);
        if (s < 0)
            return s;
        rc = exchange(s, type, body, len, NULL, 0, NULL, 0, NULL, 30000, why, why_len);
        if (rc == 0) {
            *sock = s;
            return 0;
        }
        close(s);
    }
    return rc;
}

static void say(char *buf, size_t len, const char *text)
{
    if (buf && len)
        snprintf(buf, len, "%s", text);
}

/* One request and its reply on `sock`. A success's body must be exactly
 * out_len bytes; a refusal's is a sentence copied to why. The sidecar gone
 * or lying is -ENOTCONN or -EPROTO, said in why. */
static int exchange(int sock, uint16_t type, const void *body, uint32_t len, const int *fds,
                    int nfds, void *out, uint32_t out_len, int *fd_out, int timeout_ms, char *why,
                    size_t why_len)
{
    struct tlink_hdr h;
    char buf[TLINK_BODY_MAX];
    int got[TLINK_FDS_MAX], ngot = 0, rc;

    if (fd_out)
        *fd_out = -1;
    rc = tlink_send(sock, type, 0, body, len, fds, nfds);
    if (rc == 0)
        rc = tlink_recv(sock, &h, buf, sizeof(buf), -1, got, &ngot, timeout_ms);
    if (rc < 0) {
        say(why, why_len, rc == -ETIMEDOUT ? "The sidecar did not answer in time."
                          : rc == -EPROTO  ? "The sidecar's answer was malformed."
                                           : "The sidecar went away.");
        return rc == -EPROTO ? -EPROTO : rc == -ETIMEDOUT ? -ETIMEDOUT : -ENOTCONN;
    }
    if (h.type != TL_REPLY || h.status > 0 || h.status < -4095 ||
        (h.status == 0 && h.len != out_len) || (h.status < 0 && ngot) ||
        ngot > (fd_out ? 1 : 0)) {
        for (int i = 0; i < ngot; i++)
            close(got[i]);
        say(why, why_len, "The sidecar's answer was malformed.");
        return -EPROTO;
    }
    if (h.status < 0) {
        if (why && why_len) {
            size_t n = h.len < why_len - 1 ? h.len : why_len - 1;
            memcpy(why, buf, n);
            why[n] = '\0';
            /* A sentence stops at its first NUL; none at all is none. */
            if (!n)
                snprintf(why, why_len, "%s", strerror(-h.status));
        }
        return h.status;
    }
    if (out_len)
        memcpy(out, buf, out_len);
    if (fd_out)
        *fd_out = ngot ? got[0] : -1;
    return 0;
}

/* A connection of `role`, opened and attached on first use; called with
 * its lock held. */
static int conn_get(struct avlink *l, enum role role)
{
    struct avlink_attach at = { .version = AVLINK_VERSION };
    int s, rc;

    if (l->c[role].sock >= 0)
        return l->c[role].sock;
    if (role == MAIN || l->lost)
        return -ENOTCONN;
    memcpy(at.token, l->token, sizeof(at.token));
    rc = dial_first(l->path, AVL_ATTACH, &at, sizeof(at), &s, NULL, 0);
    if (rc < 0)
        return rc;
    l->c[role].sock = s;
    return s;
}

/* One call on the connection of `role`; a connection that failed is
 * dropped (MAIN's loss is the averager's). */
static int call(struct avlink *l, enum role role, uint16_t type, const void *body, uint32_t len,
                const int *fds, int nfds, void *out, uint32_t out_len, int *fd_out, int timeout_ms,
                char *why, size_t why_len)
{
    struct conn *c = &l->c[role];
    int s, rc;

    pthread_mutex_lock(&c->mu);
    s = conn_get(l, role);
    if (s < 0) {
        say(why, why_len, l->lost ? "The sidecar went away; this averager is gone with it."
                                  : "The sidecar could not be reached.");
        rc = s == -ENOENT || s == -ECONNREFUSED ? -ENOTCONN : s;
        goto out;
    }
    rc = exchange(s, type, body, len, fds, nfds, out, out_len, fd_out, timeout_ms, why, why_len);
    if (rc == -ENOTCONN || rc == -EPROTO || rc == -ETIMEDOUT) {
        /* The conversation is out of step or over: never reuse it. */
        close(c->sock);
        c->sock = -1;
        if (role == MAIN)
            l->lost = true;
    }
out:
    pthread_mutex_unlock(&c->mu);
    return rc;
}

int avlink_open(const struct avlink_config *cfg, struct avlink **out, char *why, size_t why_len)
{
    struct avlink_hello hello = { .version = AVLINK_VERSION };
    struct avlink_created created;
    struct avlink_create cr;
    uint64_t bytes, goff, poff;
    struct avlink *l;
    int fd = -1, rc;

    say(why, why_len, "");
    if (!cfg || !cfg->path || !*cfg->path || !out || (cfg->create.plan_len && !cfg->plan))
        return -EINVAL;
    cr = cfg->create;
    if (avlink_region_layout(cr.count, cr.gather_max, cr.plan_len, &bytes, &goff, &poff) < 0) {
        say(why, why_len, cr.plan_len > AVLINK_PLAN_MAX
                              ? "The codec plan has more ranges than a sidecar takes (256)."
                              : "The averaged vector is larger than a sidecar hosts.");
        return -EINVAL;
    }
    cr.region_bytes = bytes;
    l = calloc(1, sizeof(*l));
    if (!l)
        return -ENOMEM;
    for (int i = 0; i < ROLES; i++) {
        pthread_mutex_init(&l->c[i].mu, NULL);
        l->c[i].sock = -1;
    }
    if (strlen(cfg->path) >= sizeof(l->path)) {
        rc = -ENAMETOOLONG;
        goto err;
    }
    snprintf(l->path, sizeof(l->path), "%s", cfg->path);
    l->count = cr.count;
    l->gather_max = cr.gather_max;
    fd = avlink_memfd("cohort-averager", NULL, bytes, false);
    if (fd < 0) {
        rc = fd;
        goto err;
    }
    l->map = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (l->map == MAP_FAILED) {
        l->map = NULL;
        rc = -errno;
        goto err;
    }
    l->map_len = bytes;
    l->data = l->map;
    l->gather = (uint8_t *)l->map + goff;
    /* The sidecar reads the plan once, at CREATE. */
    if (cr.plan_len)
        memcpy((uint8_t *)l->map + poff, cfg->plan, cr.plan_len * sizeof(*cfg->plan));
    rc = dial_first(l->path, AVL_HELLO, &hello, sizeof(hello), &l->c[MAIN].sock, why, why_len);
    if (rc == -ENOENT || rc == -ECONNREFUSED)
        say(why, why_len, "No sidecar answers on the trainer socket.");
    if (rc == 0)
        rc = exchange(l->c[MAIN].sock, AVL_CREATE, &cr, sizeof(cr), &fd, 1, &created,
                      sizeof(created), NULL, CALL_TIMEOUT_MS, why, why_len);
    if (rc < 0)
        goto err;
    created.id[AVLINK_ID_MAX] = '\0';
    memcpy(l->bits, cr.bits, sizeof(l->bits));
    l->bits[AVLINK_BITS_MAX] = '\0';
    memcpy(l->token, created.token, sizeof(l->token));
    snprintf(l->id, sizeof(l->id), "%s", created.id);
    close(fd);
    *out = l;
    return 0;
err:
    if (fd >= 0)
        close(fd);
    avlink_close(l);
    return rc;
}

void avlink_close(struct avlink *l)
{
    if (!l)
        return;
    /* MAIN last: the averager leaves when its owner hangs up, and the
     * others then have nothing to wait for. */
    for (int i = ROLES - 1; i >= 0; i--) {
        if (l->c[i].sock >= 0)
            close(l->c[i].sock);
        pthread_mutex_destroy(&l->c[i].mu);
    }
    if (l->map)
        munmap(l->map, l->map_len);
    free(l);
}

const char *avlink_id(const struct avlink *l)
{
    return l->id;
}

/* How long to wait for the answer to a call the sidecar bounds by ms
 * (0: the averager's default, 30 s). */
static int slack(uint32_t ms)
{
    uint64_t t = (uint64_t)(ms ? ms : AVERAGER_DEFAULT_TIMEOUT_MS) + AVLINK_SLACK_MS;
    return t > INT32_MAX ? INT32_MAX : (int)t;
}

int avlink_wait(struct avlink *l, uint32_t timeout_ms)
{
    struct avlink_u32 u = { timeout_ms, 0 };

    return call(l, MAIN, AVL_WAIT, &u, sizeof(u), NULL, 0, NULL, 0, NULL, slack(timeout_ms),
                l->err, sizeof(l->err));
}

/* The result memfd, checked entry by entry: every length read from it is
 * bounded by the region's gather_max and the memfd's own size. */
static int result_parse(struct avlink *l, int fd, struct avlink_result **out)
{
    struct avlink_result *r = calloc(1, sizeof(*r));
    size_t off;
    int rc;

    if (!r)
        return -ENOMEM;
    rc = tlink_memfd_read(fd, sizeof(struct avlink_result_hdr) +
                                  256 * (sizeof(struct avlink_result_entry) + l->gather_max),
                          &r->buf, &r->len);
    if (rc < 0)
        goto bad;
    rc = -EPROTO;
    if (r->len < sizeof(*r->h))
        goto bad;
    r->h = r->buf;
    if (!memchr(r->h->bits, '\0', sizeof(r->h->bits)) || r->h->n == 0 || r->h->n > 256 ||
        r->len < sizeof(*r->h) + (size_t)r->h->n * sizeof(*r->e))
        goto bad;
    r->e = (const struct avlink_result_entry *)(r->h + 1);
    r->gathered = calloc(r->h->n, sizeof(*r->gathered));
    if (!r->gathered) {
        rc = -ENOMEM;
        goto bad;
    }
    off = sizeof(*r->h) + (size_t)r->h->n * sizeof(*r->e);
    for (uint32_t i = 0; i < r->h->n; i++) {
        if (memchr(r->e[i].id, '\0', sizeof(r->e[i].id)) == NULL ||
            r->e[i].gathered_len > l->gather_max || r->e[i].gathered_len > r->len - off)
            goto bad;
        r->gathered[i] = (const uint8_t *)r->buf + off;
        off += r->e[i].gathered_len;
    }
    if (off != r->len)
        goto bad;
    *out = r;
    return 0;
bad:
    snprintf(l->err, sizeof(l->err), "The sidecar's step result was malformed.");
    avlink_result_free(r);
    return rc;
}

int avlink_step(struct avlink *l, float *data, const void *gather, const struct avlink_step *s,
                struct avlink_result **out)
{
    int fd = -1, rc;

    if (s->gather_len > l->gather_max) {
        snprintf(l->err, sizeof(l->err), "The gathered bytes exceed gather_max.");
        return -EINVAL;
    }
    /* Nothing else writes the region: the sidecar touches it only while
     * it answers this call. */
    if (l->count && data)
        memcpy(l->data, data, l->count * sizeof(float));
    if (s->gather_len)
        memcpy(l->gather, gather, s->gather_len);
    l->bits_stale = true;
    rc = call(l, MAIN, AVL_STEP, s, sizeof(*s), NULL, 0, NULL, 0, &fd, slack(s->timeout_ms),
              l->err, sizeof(l->err));
    if (rc < 0)
        return rc;
    if (fd < 0) {
        snprintf(l->err, sizeof(l->err), "The sidecar's step result was missing.");
        return -EPROTO;
    }
    rc = result_parse(l, fd, out);
    close(fd);
    if (rc < 0)
        return rc;
    if (l->count && data)
        memcpy(data, l->data, l->count * sizeof(float));
    memcpy(l->bits, (*out)->h->bits, sizeof(l->bits));
    l->bits_stale = false;
    return 0;
}

const char *avlink_error(const struct avlink *l)
{
    return l->err;
}

const char *avlink_bits(struct avlink *l)
{
    struct avlink_bits b;

    if (l->bits_stale &&
        call(l, MAIN, AVL_BITS, NULL, 0, NULL, 0, &b, sizeof(b), NULL, CALL_TIMEOUT_MS, NULL, 0) == 0) {
        b.bits[AVLINK_BITS_MAX] = '\0';
        memcpy(l->bits, b.bits, sizeof(l->bits));
        l->bits_stale = false;
    }
    return l->bits;
}

int avlink_set_bits(struct avlink *l, const char *bits)
{
    struct avlink_bits b;
    int rc;

    memset(&b, 0, sizeof(b));

    if (!bits || strlen(bits) > AVLINK_BITS_MAX)
        return -EINVAL;
    memcpy(b.bits, bits, strlen(bits));
    rc = call(l, MAIN, AVL_SET_BITS, &b, sizeof(b), NULL, 0, NULL, 0, NULL, CALL_TIMEOUT_MS,
              NULL, 0);
    if (rc == 0) {
        memcpy(l->bits, b.bits, sizeof(l->bits));
        l->bits_stale = false;
    }
    return rc;
}

int avlink_set_sharing(struct avlink *l, bool share, double priority)
{
    struct avlink_sharing s = { share, 0, priority };

    return call(l, CTL, AVL_SET_SHARING, &s, sizeof(s), NULL, 0, NULL, 0, NULL, CALL_TIMEOUT_MS,
                NULL, 0);
}

void avlink_sharing(struct avlink *l, bool *share, double *priority)
{
    struct avlink_sharing s = { 0, 0, 0 };

    call(l, CTL, AVL_SHARING, NULL, 0, NULL, 0, &s, sizeof(s), NULL, CALL_TIMEOUT_MS, NULL, 0);
    *share = s.share != 0;
    *priority = s.priority;
}

bool avlink_state_wanted(struct avlink *l, uint32_t timeout_ms)
{
    uint64_t deadline = clock_now_ms() + timeout_ms;

    /* In slices: the sidecar holds none longer (avlink.h). */
    for (;;) {
        uint64_t now = clock_now_ms();
        uint64_t left = deadline > now ? deadline - now : 0;
        struct avlink_u32 u = { (uint32_t)(left < AVLINK_WANTED_SLICE_MS ? left
                                                                         : AVLINK_WANTED_SLICE_MS), 0 };
        struct avlink_u32 r = { 0, 0 };

        if (call(l, STATE, AVL_STATE_WANTED, &u, sizeof(u), NULL, 0, &r, sizeof(r), NULL,
                 slack(u.value), NULL, 0) < 0)
            return false;
        if (r.value)
            return true;
        if (clock_now_ms() >= deadline)
            return false;
    }
}

int avlink_provide_state(struct avlink *l, const void *blob, size_t len)
{
    struct avlink_u64 u = { len };
    int fd, rc;

    fd = avlink_memfd("cohort-state", blob, len, true);
    if (fd < 0)
        return fd;
    rc = call(l, STATE, AVL_PROVIDE_STATE, &u, sizeof(u), &fd, 1, NULL, 0, NULL, CALL_TIMEOUT_MS,
              NULL, 0);
    close(fd);
    return rc;
}

int avlink_load_state(struct avlink *l, uint32_t timeout_ms, void **blob, size_t *len)
{
    struct avlink_u32 u = { timeout_ms, 0 };
    struct avlink_u64 n = { 0 };
    int fd = -1, rc;

    rc = call(l, LOAD, AVL_LOAD_STATE, &u, sizeof(u), NULL, 0, &n, sizeof(n), &fd,
              slack(timeout_ms), l->load_err, sizeof(l->load_err));
    if (rc < 0)
        return rc;
    if (fd < 0) {
        snprintf(l->load_err, sizeof(l->load_err), "The sidecar's state was missing.");
        return -EPROTO;
    }
    rc = tlink_memfd_read(fd, AVLINK_STATE_MAX, blob, len);
    close(fd);
    if (rc == 0 && *len != n.value) {
        free(*blob);
        *blob = NULL;
        rc = -EPROTO;
    }
    if (rc < 0)
        snprintf(l->load_err, sizeof(l->load_err), "The sidecar's state could not be read.");
    return rc;
}

const char *avlink_load_error(const struct avlink *l)
{
    return l->load_err;
}

uint64_t avlink_parts_served(struct avlink *l)
{
    struct avlink_u64 n = { 0 };

    call(l, CTL, AVL_PARTS_SERVED, NULL, 0, NULL, 0, &n, sizeof(n), NULL, CALL_TIMEOUT_MS, NULL, 0);
    return n.value;
}

size_t avlink_result_size(const struct avlink_result *r)
{
    return r->h->n;
}

const char *avlink_result_id(const struct avlink_result *r, size_t i)
{
    return i < r->h->n ? r->e[i].id : NULL;
}

double avlink_result_weight(const struct avlink_result *r, size_t i)
{
    return i < r->h->n ? r->e[i].weight : 0;
}

const void *avlink_result_gathered(const struct avlink_result *r, size_t i, size_t *len)
{
    if (i >= r->h->n) {
        *len = 0;
        return NULL;
    }
    *len = r->e[i].gathered_len;
    return r->gathered[i];
}

uint64_t avlink_result_group(const struct avlink_result *r)
{
    return r->h->group;
}

uint32_t avlink_result_attempts(const struct avlink_result *r)
{
    return r->h->attempts;
}

uint32_t avlink_result_matchmaking_ms(const struct avlink_result *r)
{
    return r->h->matchmaking_ms;
}

void avlink_result_free(struct avlink_result *r)
{
    if (!r)
        return;
    free(r->gathered);
    free(r->buf);
    free(r);
}

/* src/averager/avstate.c: see avstate.h.
 *
 * The server is an accepting thread and a thread per connection, at most
 * AVSTATE_CONNS_MAX of them: a connection does little but wait on its
 * peer, and a thread each keeps every wait a plain blocking read with a
 * deadline. A stranger can hold a slot only until its hello or confirm is
 * late (io_timeout_ms); one beyond the cap is closed at once.
 *
 * Snapshots are reference counted: a connection sending a part holds the
 * snapshot it sends from, so the host may provide a new one at any time
 * and the old one is freed by whoever lets go of it last. The server
 * keeps the current and the previous snapshot, so that a download that
 * began just before a new snapshot can finish on the old root.
 *
 * The download runs one thread per donor: first each fetches its
 * donor's manifest, then the donors of the chosen root each fetch the
 * parts assigned to them (part p to donor p mod k). A donor that fails
 * gives its parts back; only those, never a live donor's, may be taken by
 * the others, so that each donor of a root serves its share and a slow
 * one is not robbed of it until it really fails (its deadline).
 */
#include "averager/avstate.h"

#include <errno.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <openssl/evp.h>

#include "base/clock.h"
#include "base/ident.h"
#include "base/log.h"
#include "engine/allreduce.h"

#define COMPONENT "avstate"
#define DEFAULT_IO_MS 10000u
#define DEFAULT_PROVIDE_MS 2000u
#define DEFAULT_REUSE_MS 1000u
#define HELLO_BYTES (4 + 8 + AVSTATE_NONCE_BYTES)
#define CHALLENGE_BYTES (8 + AVSTATE_NONCE_BYTES + SECRET_MAC_BYTES)
#define REQUEST_BYTES (8 + AVSTATE_DIGEST_BYTES)
#define MANIFEST_HDR_BYTES (24 + AVSTATE_DIGEST_BYTES)
/* A manifest's parts are at most this large: max_bytes is capped so. */
#define MAX_BYTES_CAP ((size_t)64 << 30)

/* ---- little pieces --------------------------------------------------------- */

static void put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static void put64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static uint32_t get32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t get64(const uint8_t *p)
{
    return (uint64_t)get32(p) | (uint64_t)get32(p + 4) << 32;
}

/* Whether a download's cancel flag (avstate_load_config.cancel) is up. */
static bool cancelled(const atomic_bool *cancel)
{
    return cancel && atomic_load(cancel);
}

/* Moves all len bytes, or fails at `deadline` (clock_now_ms), or within
 * a poll slice (1 s) of *cancel turning true. Returns 0, -ETIMEDOUT,
 * -ECANCELED, -ECONNRESET (the peer closed or reset) or -EPIPE. */
static int io_until(int fd, void *buf, size_t len, uint64_t deadline, bool out,
                    const atomic_bool *cancel)
{
    uint8_t *p = buf;

    while (len > 0) {
        struct pollfd pfd = { .fd = fd, .events = out ? POLLOUT : POLLIN };
        uint64_t now = clock_now_ms();
        ssize_t n;
        int r;

        if (cancelled(cancel))
            return -ECANCELED;
        if (now >= deadline)
            return -ETIMEDOUT;
        r = poll(&pfd, 1, (int)(deadline - now > 1000 ? 1000 : deadline - now));
        if (r < 0 && errno != EINTR)
            return -errno;
        if (r <= 0)
            continue;
        n = out ? send(fd, p, len, MSG_NOSIGNAL | MSG_DONTWAIT)
                : recv(fd, p, len, MSG_DONTWAIT);
        if (n == 0 && !out)
            return -ECONNRESET;
        if (n < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)
                continue;
            return errno == EPIPE ? -EPIPE : -ECONNRESET;
        }
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

/* io_until for the donor's side, which no flag cancels. */
static int io_full(int fd, void *buf, size_t len, uint64_t deadline, bool out)
{
    return io_until(fd, buf, len, deadline, out, NULL);
}

static uint64_t deadline_of(uint32_t ms, uint64_t cap)
{
    uint64_t d = clock_now_ms() + ms;

    return d < cap ? d : cap;
}

static void sha256(const void *p, size_t len, uint8_t out[AVSTATE_DIGEST_BYTES])
{
    unsigned int n = 0;

    /* On a libcrypto failure the digest is zeroes, which no part matches. */
    if (EVP_Digest(p, len, out, &n, EVP_sha256(), NULL) != 1)
        memset(out, 0, AVSTATE_DIGEST_BYTES);
}

/* SHA-256 of (total, part_bytes, digests): a manifest's root. */
static void root_of(uint64_t total, uint32_t part_bytes, const uint8_t *digests, uint32_t n,
                    uint8_t root[AVSTATE_DIGEST_BYTES])
{
    uint8_t head[12];
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();

    put64(head, total);
    put32(head + 8, part_bytes);
    if (!ctx || EVP_DigestInit_ex(ctx, EVP_sha256(), NULL) != 1 ||
        EVP_DigestUpdate(ctx, head, sizeof(head)) != 1 ||
        EVP_DigestUpdate(ctx, digests, (size_t)n * AVSTATE_DIGEST_BYTES) != 1 ||
        EVP_DigestFinal_ex(ctx, root, NULL) != 1)
        memset(root, 0, AVSTATE_DIGEST_BYTES);
    EVP_MD_CTX_free(ctx);
}

int avstate_manifest(const void *blob, size_t len, uint32_t *part_bytes, uint32_t *n_parts,
                     uint8_t **digests, uint8_t root[AVSTATE_DIGEST_BYTES])
{
    size_t pb = AVSTATE_PART_MIN, n;
    uint8_t *d;

    if (len > MAX_BYTES_CAP)
        return -EFBIG;
    /* The smallest whole number of 64 KiB that keeps within the cap. */
    while ((len + pb - 1) / pb > AVSTATE_PARTS_MAX)
        pb += AVSTATE_PART_MIN;
    n = (len + pb - 1) / pb;
    d = malloc(n * AVSTATE_DIGEST_BYTES + 1);
    if (!d)
        return -ENOMEM;
    for (size_t i = 0; i < n; i++) {
        size_t off = i * pb, l = len - off < pb ? len - off : pb;

        sha256((const uint8_t *)blob + off, l, d + i * AVSTATE_DIGEST_BYTES);
    }
    root_of(len, (uint32_t)pb, d, (uint32_t)n, root);
    *part_bytes = (uint32_t)pb;
    *n_parts = (uint32_t)n;
    *digests = d;
    return 0;
}

int avstate_mac(const struct secret *k, const char *label, const char *cohort,
                const char *client, const char *server,
                const uint8_t nonce_c[AVSTATE_NONCE_BYTES],
                const uint8_t nonce_a[AVSTATE_NONCE_BYTES], const void *extra,
                size_t extra_len, uint8_t mac[SECRET_MAC_BYTES])
{
    char full[64];
    struct secret_part parts[] = {
        SECRET_STR(cohort), SECRET_STR(client), SECRET_STR(server),
        { nonce_c, AVSTATE_NONCE_BYTES }, { nonce_a, AVSTATE_NONCE_BYTES },
        { extra ? extra : "", extra ? extra_len : 0 },
    };

    snprintf(full, sizeof(full), "cohort/avstate/v1/%s", label);
    return secret_mac(k, full, parts, sizeof(parts) / sizeof(parts[0]), mac) < 0 ? -EIO : 0;
}

/* ---- the server ------------------------------------------------------------ */

struct snap {
    unsigned refs;              /* under the server's lock */
    uint8_t *blob;
    size_t len;
    uint32_t part_bytes, n_parts;
    uint8_t *digests;
    uint8_t root[AVSTATE_DIGEST_BYTES];
    uint64_t made_at;
};

struct slot {
    bool used, done;
    int fd;
    pthread_t t;
    struct avstate_server *s;
};

struct avstate_server {
    char *cohort, *id;
    struct secret key;
    uint32_t io_ms, provide_ms, reuse_ms;
    size_t max_bytes;
    int lfd, evfd;
    char address[IDENT_ADDRESS_MAX + 1];
    pthread_t acceptor;
    pthread_mutex_t lock;       /* everything below */
    pthread_cond_t cond;        /* a snapshot asked for or provided, or stopping */
    bool stopping, allow;
    uint64_t want_gen;          /* manifest requests that asked the host */
    uint64_t provided_gen;      /* want_gen when the latest snapshot came */
    struct snap *cur, *prev;
    struct slot slots[AVSTATE_CONNS_MAX];
    uint64_t served;
};

static void snap_unref_locked(struct snap *p)
{
    if (p && --p->refs == 0) {
        free(p->blob);
        free(p->digests);
        free(p);
    }
}

/* The snapshot a manifest request gets: a fresh one from the host when the
 * current is older than reuse_ms and the host answers within provide_ms,
 * else the current. NULL when there is none. Returns it referenced. */
static struct snap *snap_for_manifest(struct avstate_server *s)
{
    struct snap *p;
    uint64_t now = clock_now_ms();

    pthread_mutex_lock(&s->lock);
    if (!s->cur || now - s->cur->made_at >= s->reuse_ms) {
        uint64_t mine = ++s->want_gen;
        struct timespec ts = clock_deadline(s->provide_ms);

        pthread_cond_broadcast(&s->cond);
        while (!s->stopping && s->provided_gen < mine)
            if (pthread_cond_timedwait(&s->cond, &s->lock, &ts) == ETIMEDOUT)
                break;
    }
    p = s->cur;
    if (p)
        p->refs++;
    pthread_mutex_unlock(&s->lock);
    return p;
}

/* The held snapshot of `root`, referenced, or NULL. */
static struct snap *snap_of_root(struct avstate_server *s, const uint8_t *root)
{
    struct snap *p = NULL;

    pthread_mutex_lock(&s->lock);
    if (s->cur && memcmp(s->cur->root, root, AVSTATE_DIGEST_BYTES) == 0)
        p = s->cur;
    else if (s->prev && memcmp(s->prev->root, root, AVSTATE_DIGEST_BYTES) == 0)
        p = s->prev;
    if (p)
        p->refs++;
    pthread_mutex_unlock(&s->lock);
    return p;
}

static void snap_unref(struct avstate_server *s, struct snap *p)
{
    pthread_mutex_lock(&s->lock);
    snap_unref_locked(p);
    pthread_mutex_unlock(&s->lock);
}

static bool sharing(struct avstate_server *s)
{
    bool on;

    pthread_mutex_lock(&s->lock);
    on = s->allow && !s->stopping;
    pthread_mutex_unlock(&s->lock);
    return on;
}

static int send_status(int fd, uint32_t status, uint64_t deadline)
{
    uint8_t b[8] = { 0 };

    put32(b, status);
    return io_full(fd, b, sizeof(b), deadline, true);
}

static int serve_manifest(struct avstate_server *s, int fd, const char *client,
                          const uint8_t *nc, const uint8_t *na)
{
    struct snap *p = sharing(s) ? snap_for_manifest(s) : NULL;
    uint8_t *msg;
    size_t dl, len;
    int rc;

    if (!p) {
        uint8_t b[MANIFEST_HDR_BYTES] = { 0 };

        put32(b, sharing(s) ? AVSTATE_UNAVAILABLE : AVSTATE_NOT_SHARING);
        return io_full(fd, b, sizeof(b), deadline_of(s->io_ms, UINT64_MAX), true);
    }
    dl = (size_t)p->n_parts * AVSTATE_DIGEST_BYTES;
    len = MANIFEST_HDR_BYTES + dl + SECRET_MAC_BYTES;
    msg = calloc(1, len);
    if (!msg) {
        snap_unref(s, p);
        return -ENOMEM;
    }
    put32(msg, AVSTATE_OK);
    put32(msg + 4, p->part_bytes);
    put64(msg + 8, p->len);
    put32(msg + 16, p->n_parts);
    memcpy(msg + 24, p->root, AVSTATE_DIGEST_BYTES);
    memcpy(msg + MANIFEST_HDR_BYTES, p->digests, dl);
    rc = avstate_mac(&s->key, "manifest", s->cohort, client, s->id, nc, na, msg,
                     MANIFEST_HDR_BYTES + dl, msg + MANIFEST_HDR_BYTES + dl);
    snap_unref(s, p);
    if (rc == 0)
        rc = io_full(fd, msg, len, deadline_of(s->io_ms, UINT64_MAX), true);
    free(msg);
    return rc;
}

static int serve_part(struct avstate_server *s, int fd, uint32_t part, const uint8_t *root)
{
    struct snap *p = sharing(s) ? snap_of_root(s, root) : NULL;
    uint8_t b[8];
    size_t off, len;
    int rc;

    if (!p)
        return send_status(fd, sharing(s) ? AVSTATE_GONE : AVSTATE_NOT_SHARING,
                           deadline_of(s->io_ms, UINT64_MAX));
    if (part >= p->n_parts) {
        snap_unref(s, p);
        return send_status(fd, AVSTATE_BAD_PART, deadline_of(s->io_ms, UINT64_MAX));
    }
    off = (size_t)part * p->part_bytes;
    len = p->len - off < p->part_bytes ? p->len - off : p->part_bytes;
    put32(b, AVSTATE_OK);
    put32(b + 4, (uint32_t)len);
    rc = io_full(fd, b, sizeof(b), deadline_of(s->io_ms, UINT64_MAX), true);
    if (rc == 0)
        rc = io_full(fd, p->blob + off, len, deadline_of(s->io_ms, UINT64_MAX), true);
    snap_unref(s, p);
    if (rc == 0) {
        pthread_mutex_lock(&s->lock);
        s->served++;
        pthread_mutex_unlock(&s->lock);
    }
    return rc;
}

/* Reads a name of len bytes (1..IDENT_NAME_MAX) into out. */
static int read_name(int fd, uint16_t len, char *out, uint64_t deadline)
{
    int rc;

    if (len == 0 || len > IDENT_NAME_MAX)
        return -EPROTO;
    rc = io_full(fd, out, len, deadline, false);
    out[len] = '\0';
    return rc < 0 ? rc : strlen(out) == len ? 0 : -EPROTO;
}

static void serve(struct avstate_server *s, int fd)
{
    uint8_t hello[HELLO_BYTES], ch[CHALLENGE_BYTES], mac[SECRET_MAC_BYTES];
    uint8_t confirm[SECRET_MAC_BYTES], req[REQUEST_BYTES], nc[AVSTATE_NONCE_BYTES];
    char cohort[IDENT_NAME_MAX + 1], client[IDENT_NAME_MAX + 1], server[IDENT_NAME_MAX + 1];
    uint64_t deadline = deadline_of(s->io_ms, UINT64_MAX);
    uint32_t status = AVSTATE_OK;
    int rc;

    /* The hello, checked for size before anything is read into a name. */
    if (io_full(fd, hello, sizeof(hello), deadline, false) < 0 || get32(hello) != AVSTATE_MAGIC)
        return;
    if (read_name(fd, (uint16_t)(hello[4] | hello[5] << 8), cohort, deadline) < 0 ||
        read_name(fd, (uint16_t)(hello[6] | hello[7] << 8), client, deadline) < 0 ||
        read_name(fd, (uint16_t)(hello[8] | hello[9] << 8), server, deadline) < 0)
        return;
    memcpy(nc, hello + 12, sizeof(nc));
    if (strcmp(cohort, s->cohort) != 0 || strcmp(server, s->id) != 0 ||
        !ident_valid_member_id(client))
        status = AVSTATE_REFUSED;
    memset(ch, 0, sizeof(ch));
    put32(ch, AVSTATE_MAGIC);
    put32(ch + 4, status);
    if (getrandom(ch + 8, AVSTATE_NONCE_BYTES, 0) != AVSTATE_NONCE_BYTES)
        return;
    if (status == AVSTATE_OK &&
        avstate_mac(&s->key, "accept", cohort, client, server, nc, ch + 8, NULL, 0,
                    ch + 8 + AVSTATE_NONCE_BYTES) < 0)
        return;
    if (io_full(fd, ch, sizeof(ch), deadline, true) < 0 || status != AVSTATE_OK)
        return;
    /* Nothing is read as a request until the client has proved the key. */
    if (io_full(fd, confirm, sizeof(confirm), deadline_of(s->io_ms, UINT64_MAX), false) < 0 ||
        avstate_mac(&s->key, "confirm", cohort, client, server, nc, ch + 8, NULL, 0, mac) < 0 ||
        !secret_mac_equal(mac, confirm)) {
        log_info(COMPONENT, "A state download was refused: the peer did not prove the "
                 "cohort's key.", LF_S("peer", client), LOG_END);
        return;
    }
    for (;;) {
        uint32_t op;

        /* An idle connection is closed after io_ms, as a stalled one is. */
        rc = io_full(fd, req, sizeof(req), deadline_of(s->io_ms, UINT64_MAX), false);
        if (rc < 0)
            return;
        op = get32(req);
        if (op == AVSTATE_OP_MANIFEST)
            rc = serve_manifest(s, fd, client, nc, ch + 8);
        else if (op == AVSTATE_OP_PART)
            rc = serve_part(s, fd, get32(req + 4), req + 8);
        else
            rc = -EPROTO;
        if (rc < 0)
            return;
    }
}

static void *slot_main(void *arg)
{
    struct slot *sl = arg;
    struct avstate_server *s = sl->s;

    serve(s, sl->fd);
    /* The peer hears the end now; the descriptor is closed when the slot
     * is reaped (never here, so that no other socket can take its number
     * while the acceptor or stop may still shut it down). */
    shutdown(sl->fd, SHUT_RDWR);
    pthread_mutex_lock(&s->lock);
    sl->done = true;
    pthread_mutex_unlock(&s->lock);
    return NULL;
}

/* Joins and frees the slots whose connection ended (all of them when
 * `all`, after shutting their sockets down so they end at once). */
static void reap(struct avstate_server *s, bool all)
{
    for (size_t i = 0; i < AVSTATE_CONNS_MAX; i++) {
        struct slot *sl = &s->slots[i];
        bool done;

        pthread_mutex_lock(&s->lock);
        done = sl->used && sl->done;
        if (all && sl->used && !done)
            shutdown(sl->fd, SHUT_RDWR);
        pthread_mutex_unlock(&s->lock);
        if (!sl->used || (!done && !all))
            continue;
        pthread_join(sl->t, NULL);
        close(sl->fd);
        sl->used = false;
    }
}

static void *accept_main(void *arg)
{
    struct avstate_server *s = arg;

    for (;;) {
        struct pollfd pfd[2] = { { .fd = s->evfd, .events = POLLIN },
                                 { .fd = s->lfd, .events = POLLIN } };
        struct slot *sl = NULL;
        int fd;

        if (poll(pfd, 2, -1) < 0 && errno != EINTR)
            break;
        if (pfd[0].revents)
            break;
        if (!(pfd[1].revents & POLLIN))
            continue;
        fd = accept4(s->lfd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0)
            continue;
        reap(s, false);
        for (size_t i = 0; i < AVSTATE_CONNS_MAX && !sl; i++)
            if (!s->slots[i].used)
                sl = &s->slots[i];
        if (!sl) {
            close(fd);          /* at the cap: no thread for a stranger */
            continue;
        }
        *sl = (struct slot){ .used = true, .done = false, .fd = fd, .s = s };
        if (pthread_create(&sl->t, NULL, slot_main, sl) != 0) {
            sl->used = false;
            close(fd);
        }
    }
    return NULL;
}

int avstate_server_start(const struct avstate_server_config *cfg, struct avstate_server **out)
{
    struct avstate_server *s;
    int rc;

    if (!cfg || !ident_valid_cohort(cfg->cohort) || !ident_valid_member_id(cfg->id) ||
        !cfg->host || cfg->max_bytes > MAX_BYTES_CAP)
        return -EINVAL;
    s = calloc(1, sizeof(*s));
    if (!s)
        return -ENOMEM;
    s->lfd = -1;
    s->evfd = -1;
    pthread_mutex_init(&s->lock, NULL);
    clock_cond_init(&s->cond);
    s->cohort = strdup(cfg->cohort);
    s->id = strdup(cfg->id);
    if (cfg->key)
        s->key = *cfg->key;
    s->io_ms = cfg->io_timeout_ms ? cfg->io_timeout_ms : DEFAULT_IO_MS;
    s->provide_ms = cfg->provide_timeout_ms ? cfg->provide_timeout_ms : DEFAULT_PROVIDE_MS;
    s->reuse_ms = cfg->reuse_ms ? cfg->reuse_ms : DEFAULT_REUSE_MS;
    s->max_bytes = cfg->max_bytes ? cfg->max_bytes : AVSTATE_DEFAULT_MAX_BYTES;
    if (!s->cohort || !s->id) {
        rc = -ENOMEM;
        goto err;
    }
    s->evfd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (s->evfd < 0) {
        rc = -errno;
        goto err;
    }
    rc = allreduce_listen(cfg->host, &s->lfd, s->address, sizeof(s->address));
    if (rc < 0)
        goto err;
    if (pthread_create(&s->acceptor, NULL, accept_main, s) != 0) {
        rc = -EAGAIN;
        goto err;
    }
    *out = s;
    return 0;
err:
    if (s->lfd >= 0)
        close(s->lfd);
    if (s->evfd >= 0)
        close(s->evfd);
    free(s->cohort);
    free(s->id);
    secret_wipe(&s->key);
    pthread_cond_destroy(&s->cond);
    pthread_mutex_destroy(&s->lock);
    free(s);
    return rc;
}

void avstate_server_stop(struct avstate_server *s)
{
    uint64_t one = 1;

    if (!s)
        return;
    pthread_mutex_lock(&s->lock);
    s->stopping = true;
    pthread_cond_broadcast(&s->cond);
    pthread_mutex_unlock(&s->lock);
    if (write(s->evfd, &one, sizeof(one)) < 0)
        log_warn(COMPONENT, "Could not wake the state server's acceptor.", LOG_END);
    pthread_join(s->acceptor, NULL);
    reap(s, true);
    close(s->lfd);
    close(s->evfd);
    snap_unref_locked(s->cur);
    snap_unref_locked(s->prev);
    free(s->cohort);
    free(s->id);
    secret_wipe(&s->key);
    pthread_cond_destroy(&s->cond);
    pthread_mutex_destroy(&s->lock);
    free(s);
}

const char *avstate_server_address(const struct avstate_server *s)
{
    return s->address;
}

void avstate_server_allow(struct avstate_server *s, bool allow)
{
    pthread_mutex_lock(&s->lock);
    s->allow = allow;
    pthread_mutex_unlock(&s->lock);
}

bool avstate_server_wanted(struct avstate_server *s, uint32_t timeout_ms)
{
    struct timespec ts = clock_deadline(timeout_ms);
    bool wanted;

    pthread_mutex_lock(&s->lock);
    while (!s->stopping && s->want_gen <= s->provided_gen)
        if (pthread_cond_timedwait(&s->cond, &s->lock, &ts) == ETIMEDOUT)
            break;
    wanted = !s->stopping && s->want_gen > s->provided_gen;
    pthread_mutex_unlock(&s->lock);
    return wanted;
}

int avstate_server_provide(struct avstate_server *s, const void *blob, size_t len)
{
    struct snap *p;
    int rc;

    if (len > s->max_bytes)
        return -EFBIG;
    p = calloc(1, sizeof(*p));
    if (!p)
        return -ENOMEM;
    p->refs = 1;
    p->len = len;
    p->blob = malloc(len + 1);
    if (!p->blob) {
        free(p);
        return -ENOMEM;
    }
    memcpy(p->blob, blob, len);
    rc = avstate_manifest(p->blob, len, &p->part_bytes, &p->n_parts, &p->digests, p->root);
    if (rc < 0) {
        free(p->blob);
        free(p);
        return rc;
    }
    p->made_at = clock_now_ms();
    pthread_mutex_lock(&s->lock);
    snap_unref_locked(s->prev);
    s->prev = s->cur;
    s->cur = p;
    s->provided_gen = s->want_gen;
    pthread_cond_broadcast(&s->cond);
    pthread_mutex_unlock(&s->lock);
    return 0;
}

uint64_t avstate_server_parts_served(struct avstate_server *s)
{
    uint64_t n;

    pthread_mutex_lock(&s->lock);
    n = s->served;
    pthread_mutex_unlock(&s->lock);
    return n;
}

/* ---- the download ------------------------------------------------------------ */

enum { PART_TODO, PART_BUSY, PART_DONE };

struct job;

/* One donor during a download. */
struct peer {
    const struct avstate_donor *d;
    const struct avstate_load_config *c;
    const struct secret *key;
    uint64_t deadline;          /* the whole download's */
    int fd;
    bool ok;                    /* its manifest is good */
    uint32_t part_bytes, n_parts;
    uint64_t total;
    uint8_t *digests;
    uint8_t root[AVSTATE_DIGEST_BYTES];
    char err[160];
    pthread_t t;
    struct job *job;
    size_t idx;                 /* among the job's workers */
};

/* Fetching one root's parts from k donors. */
struct job {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    uint8_t *blob;
    uint64_t total;
    uint32_t part_bytes, n_parts;
    const uint8_t *digests;
    uint8_t *state;             /* PART_* per part */
    uint32_t *owner;            /* the worker a part is assigned to */
    bool *alive;                /* per worker */
    size_t k;
    uint64_t deadline;
};

static void peer_fail(struct peer *p, const char *what, int rc)
{
    if (!p->err[0])
        snprintf(p->err, sizeof(p->err), "%.40s: %s%s%s", p->d->id, what, rc ? ": " : "",
                 rc ? log_strerror(rc) : "");
}

/* Connects to address by `deadline`, or within a poll slice of *cancel
 * turning true. Returns the socket or -errno. */
static int dial(const char *address, uint64_t deadline, const atomic_bool *cancel)
{
    struct addrinfo hints = { .ai_socktype = SOCK_STREAM,
                              .ai_flags = AI_NUMERICSERV | AI_NUMERICHOST };
    struct addrinfo *ai;
    char host[IDENT_ADDRESS_MAX + 1], port[8];
    const char *colon = strrchr(address, ':');
    size_t hl;
    int fd, rc, err = 0;
    socklen_t el = sizeof(err);
    struct pollfd pfd;

    if (!ident_valid_address(address) || !colon)
        return -EINVAL;
    hl = (size_t)(colon - address);
    if (address[0] == '[') {        /* "[v6]:port" */
        memcpy(host, address + 1, hl - 2);
        host[hl - 2] = '\0';
    } else {
        memcpy(host, address, hl);
        host[hl] = '\0';
    }
    snprintf(port, sizeof(port), "%s", colon + 1);
    /* Numeric only: a resolution that blocks could not be bounded. */
    if (getaddrinfo(host, port, &hints, &ai) != 0)
        return -EINVAL;
    fd = socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        rc = -errno;
        freeaddrinfo(ai);
        return rc;
    }
    rc = connect(fd, ai->ai_addr, ai->ai_addrlen);
    freeaddrinfo(ai);
    if (rc < 0 && errno != EINPROGRESS) {
        rc = -errno;
        close(fd);
        return rc;
    }
    for (;;) {
        uint64_t now = clock_now_ms();

        if (cancelled(cancel) || now >= deadline) {
            close(fd);
            return cancelled(cancel) ? -ECANCELED : -ETIMEDOUT;
        }
        pfd = (struct pollfd){ .fd = fd, .events = POLLOUT };
        rc = poll(&pfd, 1, (int)(deadline - now > 1000 ? 1000 : deadline - now));
        if (rc > 0)
            break;
    }
    if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el) < 0 || err) {
        close(fd);
        return err ? -err : -ECONNREFUSED;
    }
    return fd;
}

/* io_until on p's connection: by one io timeout from now, no later than
 * `cap`, cancelled with the download. */
static int peer_io(struct peer *p, void *buf, size_t len, uint64_t cap, bool out)
{
    return io_until(p->fd, buf, len, deadline_of(p->c->io_timeout_ms, cap), out, p->c->cancel);
}

/* Connects, proves the key both ways, and reads a checked manifest. */
static int peer_manifest(struct peer *p)
{
    const struct avstate_load_config *c = p->c;
    size_t cl = strlen(c->cohort), il = strlen(c->id), sl = strlen(p->d->id);
    uint8_t hello[HELLO_BYTES + 3 * (IDENT_NAME_MAX + 1)], ch[CHALLENGE_BYTES];
    uint8_t mac[SECRET_MAC_BYTES], req[REQUEST_BYTES] = { 0 }, hdr[MANIFEST_HDR_BYTES];
    uint8_t *nc = hello + 12, *body = NULL, root[AVSTATE_DIGEST_BYTES];
    uint64_t total;
    uint32_t pb, n, status;
    size_t dl;
    int rc;

    if (cl > IDENT_NAME_MAX || il > IDENT_NAME_MAX || sl == 0 || sl > IDENT_NAME_MAX) {
        peer_fail(p, "a name too long", 0);
        return -EINVAL;
    }
    p->fd = dial(p->d->address, deadline_of(c->io_timeout_ms, p->deadline), c->cancel);
    if (p->fd < 0) {
        rc = p->fd;
        peer_fail(p, "cannot connect", rc);
        return rc;
    }
    put32(hello, AVSTATE_MAGIC);
    hello[4] = (uint8_t)cl;
    hello[5] = (uint8_t)(cl >> 8);
    hello[6] = (uint8_t)il;
    hello[7] = (uint8_t)(il >> 8);
    hello[8] = (uint8_t)sl;
    hello[9] = (uint8_t)(sl >> 8);
    hello[10] = hello[11] = 0;
    if (getrandom(nc, AVSTATE_NONCE_BYTES, 0) != AVSTATE_NONCE_BYTES)
        return -EIO;
    memcpy(hello + HELLO_BYTES, c->cohort, cl);
    memcpy(hello + HELLO_BYTES + cl, c->id, il);
    memcpy(hello + HELLO_BYTES + cl + il, p->d->id, sl);
    rc = peer_io(p, hello, HELLO_BYTES + cl + il + sl, p->deadline, true);
    if (rc == 0)
        rc = peer_io(p, ch, sizeof(ch), p->deadline, false);
    if (rc < 0) {
        peer_fail(p, "no answer to the hello", rc);
        return rc;
    }
    status = get32(ch + 4);
    if (get32(ch) != AVSTATE_MAGIC || status != AVSTATE_OK) {
        peer_fail(p, status == AVSTATE_REFUSED ? "refused the download (another id or "
                  "cohort, or busy)" : "not a state server", 0);
        return -EPROTO;
    }
    if (avstate_mac(p->key, "accept", c->cohort, c->id, p->d->id, nc, ch + 8, NULL, 0, mac) < 0 ||
        !secret_mac_equal(mac, ch + 8 + AVSTATE_NONCE_BYTES)) {
        peer_fail(p, "did not prove the cohort's key", 0);
        return -EACCES;
    }
    rc = avstate_mac(p->key, "confirm", c->cohort, c->id, p->d->id, nc, ch + 8, NULL, 0, mac);
    if (rc == 0)
        rc = peer_io(p, mac, sizeof(mac), p->deadline, true);
    put32(req, AVSTATE_OP_MANIFEST);
    if (rc == 0)
        rc = peer_io(p, req, sizeof(req), p->deadline, true);
    if (rc == 0)
        rc = peer_io(p, hdr, sizeof(hdr), p->deadline, false);
    if (rc < 0) {
        peer_fail(p, "no manifest", rc);
        return rc;
    }
    status = get32(hdr);
    if (status != AVSTATE_OK) {
        peer_fail(p, status == AVSTATE_NOT_SHARING ? "does not share its state"
                     : status == AVSTATE_UNAVAILABLE ? "had no state to give in time"
                                                     : "refused the manifest", 0);
        return -ENODATA;
    }
    pb = get32(hdr + 4);
    total = get64(hdr + 8);
    n = get32(hdr + 16);
    /* Every length a donor declares is checked before it sizes anything. */
    if (total > c->max_bytes || pb < AVSTATE_PART_MIN || pb % AVSTATE_PART_MIN != 0 ||
        n > AVSTATE_PARTS_MAX || (uint64_t)n != (total + pb - 1) / pb) {
        peer_fail(p, "declared a state too large or a manifest that does not add up", 0);
        return -EPROTO;
    }
    dl = (size_t)n * AVSTATE_DIGEST_BYTES;
    body = malloc(MANIFEST_HDR_BYTES + dl + SECRET_MAC_BYTES);
    if (!body)
        return -ENOMEM;
    memcpy(body, hdr, sizeof(hdr));
    rc = peer_io(p, body + MANIFEST_HDR_BYTES, dl + SECRET_MAC_BYTES, p->deadline, false);
    if (rc < 0) {
        free(body);
        peer_fail(p, "no manifest", rc);
        return rc;
    }
    if (avstate_mac(p->key, "manifest", c->cohort, c->id, p->d->id, nc, ch + 8, body,
                    MANIFEST_HDR_BYTES + dl, mac) < 0 ||
        !secret_mac_equal(mac, body + MANIFEST_HDR_BYTES + dl)) {
        free(body);
        peer_fail(p, "sent a manifest without the cohort's MAC", 0);
        return -EACCES;
    }
    root_of(total, pb, body + MANIFEST_HDR_BYTES, n, root);
    if (memcmp(root, hdr + 24, AVSTATE_DIGEST_BYTES) != 0) {
        free(body);
        peer_fail(p, "declared a root that its digests do not hash to", 0);
        return -EPROTO;
    }
    p->digests = malloc(dl + 1);
    if (!p->digests) {
        free(body);
        return -ENOMEM;
    }
    memcpy(p->digests, body + MANIFEST_HDR_BYTES, dl);
    free(body);
    memcpy(p->root, root, sizeof(root));
    p->part_bytes = pb;
    p->total = total;
    p->n_parts = n;
    p->ok = true;
    return 0;
}

static void *manifest_main(void *arg)
{
    peer_manifest(arg);
    return NULL;
}

/* Fetches part `i` into the job's blob and checks it. */
static int fetch_part(struct peer *p, uint32_t i)
{
    struct job *j = p->job;
    uint64_t off = (uint64_t)i * j->part_bytes;
    size_t want = j->total - off < j->part_bytes ? (size_t)(j->total - off) : j->part_bytes;
    uint8_t req[REQUEST_BYTES], hdr[8], d[AVSTATE_DIGEST_BYTES];
    int rc;

    put32(req, AVSTATE_OP_PART);
    put32(req + 4, i);
    memcpy(req + 8, p->root, AVSTATE_DIGEST_BYTES);
    rc = peer_io(p, req, sizeof(req), j->deadline, true);
    if (rc == 0)
        rc = peer_io(p, hdr, sizeof(hdr), j->deadline, false);
    if (rc < 0) {
        peer_fail(p, "stalled or closed during a part", rc);
        return rc;
    }
    if (get32(hdr) != AVSTATE_OK || get32(hdr + 4) != want) {
        peer_fail(p, get32(hdr) == AVSTATE_GONE ? "no longer holds the state it declared"
                     : get32(hdr) != AVSTATE_OK ? "refused a part"
                                                : "sent a part of the wrong length", 0);
        return -EPROTO;
    }
    /* Each part's bytes are written by the one worker that holds it. */
    rc = peer_io(p, j->blob + off, want, j->deadline, false);
    if (rc < 0) {
        peer_fail(p, "stalled or closed during a part", rc);
        return rc;
    }
    sha256(j->blob + off, want, d);
    if (memcmp(d, j->digests + (size_t)i * AVSTATE_DIGEST_BYTES, sizeof(d)) != 0) {
        peer_fail(p, "sent a part that does not match the digest it declared", 0);
        return -EPROTO;
    }
    return 0;
}

/* The next part worker w may take: its own first, then those of workers
 * that failed. -1 when none now; *wait says whether some may come (parts
 * in flight at others that could still fail). Under j->lock. */
static long next_part_locked(struct job *j, size_t w, bool *wait)
{
    long orphan = -1;

    *wait = false;
    for (uint32_t i = 0; i < j->n_parts; i++) {
        if (j->state[i] == PART_DONE)
            continue;
        if (j->state[i] == PART_BUSY || (j->state[i] == PART_TODO && j->alive[j->owner[i]] &&
                                         j->owner[i] != w)) {
            *wait = true;
            continue;
        }
        if (j->owner[i] == w)
            return i;
        if (orphan < 0)
            orphan = i;
    }
    return orphan;
}

static void *worker_main(void *arg)
{
    struct peer *p = arg;
    struct job *j = p->job;
    struct timespec ts = clock_deadline(j->deadline > clock_now_ms()
                                            ? (uint32_t)(j->deadline - clock_now_ms()) : 0);

    pthread_mutex_lock(&j->lock);
    for (;;) {
        bool wait;
        long i = next_part_locked(j, p->idx, &wait);
        int rc;

        if (i < 0) {
            if (!wait || pthread_cond_timedwait(&j->cond, &j->lock, &ts) == ETIMEDOUT)
                break;
            continue;
        }
        j->state[i] = PART_BUSY;
        j->owner[i] = (uint32_t)p->idx;
        pthread_mutex_unlock(&j->lock);
        rc = fetch_part(p, (uint32_t)i);
        pthread_mutex_lock(&j->lock);
        j->state[i] = rc == 0 ? PART_DONE : PART_TODO;
        if (rc < 0)
            j->alive[p->idx] = false;
        pthread_cond_broadcast(&j->cond);
        if (rc < 0)
            break;
    }
    pthread_mutex_unlock(&j->lock);
    return NULL;
}

/* Fetches root `root`'s parts from peers[] that declared it. Returns 0
 * when every part is in *blob. */
static int run_job(struct peer *peers, size_t np, const uint8_t *root, uint64_t deadline,
                   void **blob, size_t *len)
{
    struct job j = { .deadline = deadline };
    struct peer *first = NULL;
    bool all = true;
    size_t k = 0;
    int rc = 0;

    for (size_t i = 0; i < np; i++) {
        if (!peers[i].ok || memcmp(peers[i].root, root, AVSTATE_DIGEST_BYTES) != 0)
            continue;
        if (!first)
            first = &peers[i];
        peers[i].idx = k++;
    }
    j.total = first->total;
    j.part_bytes = first->part_bytes;
    j.n_parts = first->n_parts;
    j.digests = first->digests;
    j.k = k;
    j.blob = malloc(j.total + 1);
    j.state = calloc(j.n_parts + 1, 1);
    j.owner = calloc(j.n_parts + 1, sizeof(*j.owner));
    j.alive = calloc(k, sizeof(*j.alive));
    if (!j.blob || !j.state || !j.owner || !j.alive) {
        rc = -ENOMEM;
        goto out;
    }
    for (uint32_t i = 0; i < j.n_parts; i++)
        j.owner[i] = (uint32_t)(i % k);
    for (size_t i = 0; i < k; i++)
        j.alive[i] = true;
    pthread_mutex_init(&j.lock, NULL);
    clock_cond_init(&j.cond);
    for (size_t i = 0; i < np; i++) {
        if (!peers[i].ok || memcmp(peers[i].root, root, AVSTATE_DIGEST_BYTES) != 0)
            continue;
        peers[i].job = &j;
        if (pthread_create(&peers[i].t, NULL, worker_main, &peers[i]) != 0) {
            pthread_mutex_lock(&j.lock);
            j.alive[peers[i].idx] = false;
            pthread_cond_broadcast(&j.cond);
            pthread_mutex_unlock(&j.lock);
            peers[i].job = NULL;
            peer_fail(&peers[i], "no thread", -EAGAIN);
        }
    }
    for (size_t i = 0; i < np; i++) {
        if (peers[i].job) {
            pthread_join(peers[i].t, NULL);
            peers[i].job = NULL;
        }
        /* A donor of this root is done with, whatever happened. */
        if (peers[i].ok && memcmp(peers[i].root, root, AVSTATE_DIGEST_BYTES) == 0)
            peers[i].ok = false;
    }
    for (uint32_t i = 0; i < j.n_parts; i++)
        all = all && j.state[i] == PART_DONE;
    pthread_cond_destroy(&j.cond);
    pthread_mutex_destroy(&j.lock);
    if (all) {
        *blob = j.blob;
        *len = (size_t)j.total;
        j.blob = NULL;
    } else {
        rc = clock_now_ms() >= deadline ? -ETIMEDOUT : -ENODATA;
    }
out:
    free(j.blob);
    free(j.state);
    free(j.owner);
    free(j.alive);
    return rc;
}

static void peer_close(struct peer *p)
{
    if (p->fd >= 0)
        close(p->fd);
    p->fd = -1;
    free(p->digests);
    p->digests = NULL;
}

/* Appends each failed donor's sentence to why. */
static void say_why(const struct peer *peers, size_t n, char *why, size_t len)
{
    size_t at = strlen(why);

    for (size_t i = 0; i < n && at + 1 < len; i++) {
        if (!peers[i].err[0])
            continue;
        snprintf(why + at, len - at, "%s%s", at ? "; " : "", peers[i].err);
        at = strlen(why);
    }
}

/* One tier of equal priority: manifests from all, then the roots in
 * order of how many declare them. */
static int load_tier(const struct avstate_load_config *c, const struct secret *key,
                     const struct avstate_donor *tier, size_t n, uint64_t deadline, void **blob,
                     size_t *len, char *why, size_t why_len)
{
    struct peer peers[AVSTATE_DONORS_MAX];
    size_t order[AVSTATE_DONORS_MAX];
    unsigned seed;
    int rc = -ENODATA;

    if (n > AVSTATE_DONORS_MAX)
        n = AVSTATE_DONORS_MAX;
    /* A random order among equals, so that newcomers that tie on how many
     * declare each root do not all pick the same. */
    if (getrandom(&seed, sizeof(seed), 0) != sizeof(seed))
        seed = (unsigned)clock_now_ms();
    for (size_t i = 0; i < n; i++)
        order[i] = i;
    for (size_t i = n; i > 1; i--) {
        size_t r = (size_t)rand_r(&seed) % i, t = order[i - 1];

        order[i - 1] = order[r];
        order[r] = t;
    }
    for (size_t i = 0; i < n; i++) {
        peers[i] = (struct peer){ .d = &tier[order[i]], .c = c, .key = key,
                                  .deadline = deadline, .fd = -1 };
        if (pthread_create(&peers[i].t, NULL, manifest_main, &peers[i]) != 0) {
            peers[i].t = pthread_self();
            peer_fail(&peers[i], "no thread", -EAGAIN);
        }
    }
    for (size_t i = 0; i < n; i++)
        if (!pthread_equal(peers[i].t, pthread_self()))
            pthread_join(peers[i].t, NULL);
    for (;;) {
        size_t best = n, best_count = 0;

        for (size_t i = 0; i < n; i++) {
            size_t count = 0;

            if (!peers[i].ok)
                continue;
            for (size_t m = 0; m < n; m++)
                count += peers[m].ok &&
                         memcmp(peers[m].root, peers[i].root, AVSTATE_DIGEST_BYTES) == 0;
            if (count > best_count) {
                best = i;
                best_count = count;
            }
        }
        if (best == n)
            break;
        rc = run_job(peers, n, peers[best].root, deadline, blob, len);
        if (rc == 0 || rc == -ENOMEM || clock_now_ms() >= deadline || cancelled(c->cancel))
            break;
    }
    if (rc < 0)
        say_why(peers, n, why, why_len);
    for (size_t i = 0; i < n; i++)
        peer_close(&peers[i]);
    return rc;
}

int avstate_load(const struct avstate_load_config *c, const struct avstate_donor *donors,
                 size_t n, void **blob, size_t *len, char *why, size_t why_len)
{
    struct avstate_load_config cc = *c;
    struct secret zero = { { 0 } };
    const struct secret *key = c->key ? c->key : &zero;
    uint64_t deadline = clock_now_ms() + c->timeout_ms;
    int rc = -ENODATA;

    why[0] = '\0';
    if (!cc.io_timeout_ms)
        cc.io_timeout_ms = DEFAULT_IO_MS;
    if (!cc.max_bytes)
        cc.max_bytes = AVSTATE_DEFAULT_MAX_BYTES;
    if (n == 0) {
        snprintf(why, why_len, "no averager of this prefix shares its state");
        return -ENODATA;
    }
    for (size_t i = 0; i < n && clock_now_ms() < deadline && !cancelled(c->cancel);) {
        size_t e = i;

        while (e < n && donors[e].priority == donors[i].priority)
            e++;
        rc = load_tier(&cc, key, donors + i, e - i, deadline, blob, len, why, why_len);
        if (rc == 0 || rc == -ENOMEM)
            return rc;
        i = e;
    }
    if (cancelled(c->cancel)) {
        snprintf(why, why_len, "the download was cancelled (the averager is leaving)");
        return -ECANCELED;
    }
    if (clock_now_ms() >= deadline && rc != 0)
        rc = -ETIMEDOUT;
    return rc;
}

/* src/averager/avserve.c: see avserve.h. */
#include "averager/avserve.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "accumulator/tlink.h"
#include "averager/averager.h"
#include "averager/avlink.h"
#include "base/clock.h"
#include "base/ident.h"
#include "base/log.h"
#include "base/secret.h"

#define POLL_MS 200

/* One hosted averager. */
struct host {
    struct averager *a;
    uint8_t token[AVLINK_TOKEN_BYTES];
    unsigned refs;          /* calls in flight on attached links */
    unsigned attached;      /* attached links */
    bool closing;           /* its owner is gone: no new call begins */
    void *map;              /* the trainer's region */
    size_t map_len;
    uint64_t count, gather_off, gather_max, max_state;
};

struct avserve {
    pthread_mutex_t mu;
    pthread_cond_t cond;    /* refs or links fell */
    char *broker, *cohort, *id, *host, *ca, *server_name;
    struct secret key;
    bool keyed;
    bool integrity;         /* integrity_mac for every averager hosted */
    uint64_t max_count, max_state;
    struct host *hosts[AVSERVE_AVERAGERS_MAX];
    unsigned links;
    uint64_t next;          /* the next averager's number */
    bool stop;
};

struct link {
    struct avserve *srv;
    int sock;
    struct host *h;
    bool owner;
};

static int reply(int sock, int32_t status, const void *body, uint32_t len, const int *fds, int nfds)
{
    return tlink_send(sock, TL_REPLY, status, body, len, fds, nfds);
}

/* A refusal and its sentence. */
static int refuse(int sock, int err, const char *why)
{
    size_t n = why ? strnlen(why, AVLINK_ERROR_MAX - 1) : 0;

    return reply(sock, err, why, (uint32_t)n, NULL, 0);
}

static bool stopping(struct avserve *s)
{
    bool stop;

    pthread_mutex_lock(&s->mu);
    stop = s->stop;
    pthread_mutex_unlock(&s->mu);
    return stop;
}

static void host_free(struct host *h)
{
    if (h->map)
        munmap(h->map, h->map_len);
    free(h);
}

/* CREATE: every field is checked before anything is made. */
static int create(struct link *l, const struct avlink_create *c, int fd)
{
    struct avserve *s = l->srv;
    struct averager_config cfg = { 0 };
    struct avlink_created out;
    struct averager_range plan[AVLINK_PLAN_MAX];
    char why[256];
    uint64_t bytes, goff, poff, max_state;
    char id[IDENT_NAME_MAX + 1];
    struct host *h = NULL;
    struct averager *a = NULL;
    int slot = -1, rc, n;

    memset(&out, 0, sizeof(out));
    if (l->h)
        return refuse(l->sock, -EALREADY, "This link holds an averager already.");
    if (!memchr(c->prefix, '\0', sizeof(c->prefix)) || !memchr(c->bits, '\0', sizeof(c->bits)) ||
        c->schema_len > AVLINK_SCHEMA_MAX)
        return refuse(l->sock, -EINVAL, "The averager's prefix, bits or schema is malformed.");
    if (c->count > s->max_count)
        return refuse(l->sock, -EFBIG, "The averaged vector is larger than this sidecar hosts.");
    if (c->gather_max > AVERAGER_GATHER_MAX)
        return refuse(l->sock, -EINVAL, "gather_max is over 65536 bytes.");
    max_state = c->max_state_bytes ? c->max_state_bytes : s->max_state;
    if (max_state > s->max_state)
        return refuse(l->sock, -EFBIG, "max_state_bytes is larger than this sidecar hosts.");
    if (c->plan_len > AVLINK_PLAN_MAX || c->zero)
        return refuse(l->sock, -EINVAL, "The codec plan has more ranges than a sidecar takes "
                                        "(256).");
    if (avlink_region_layout(c->count, c->gather_max ? c->gather_max : 4096, c->plan_len, &bytes,
                             &goff, &poff) < 0 ||
        bytes != c->region_bytes || avlink_memfd_check(fd, bytes) < 0)
        return refuse(l->sock, -EINVAL, "The shared region is not a sealed memfd of the "
                                        "averager's size.");
    h = calloc(1, sizeof(*h));
    if (!h)
        return refuse(l->sock, -ENOMEM, "Out of memory.");
    h->count = c->count;
    h->gather_off = goff;
    h->gather_max = c->gather_max ? c->gather_max : 4096;
    h->max_state = max_state;
    h->map = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (h->map == MAP_FAILED) {
        h->map = NULL;
        rc = -errno;
        free(h);
        return refuse(l->sock, rc, "The shared region could not be mapped.");
    }
    h->map_len = bytes;
    /* The plan, copied out of the trainer's region before it is checked:
     * the trainer may write the region at any time. */
    for (uint32_t k = 0; k < c->plan_len; k++) {
        struct avlink_range r;

        memcpy(&r, (const uint8_t *)h->map + poff + k * sizeof(r), sizeof(r));
        plan[k] = (struct averager_range){
            .count = r.count > SIZE_MAX ? SIZE_MAX : (size_t)r.count,
            /* Not a codec, whatever the trainer wrote past 8 bits or in
             * zero: the check below says so. */
            .codec = r.zero || r.codec > 0xff ? (enum codec)0xff : (enum codec)r.codec };
    }
    if (averager_plan_check(plan, c->plan_len, c->count, (enum codec)c->codec, c->schema_len,
                            why, sizeof(why)) < 0) {
        host_free(h);
        return refuse(l->sock, -EINVAL, why);
    }
    pthread_mutex_lock(&s->mu);
    for (int i = 0; i < AVSERVE_AVERAGERS_MAX && slot < 0; i++)
        if (!s->hosts[i])
            slot = i;
    if (slot >= 0)
        s->hosts[slot] = h;     /* held: no other link may take it meanwhile */
    n = snprintf(id, sizeof(id), "%s_av%llu", s->id, (unsigned long long)++s->next);
    pthread_mutex_unlock(&s->mu);
    if (slot < 0) {
        host_free(h);
        return refuse(l->sock, -EBUSY, "This sidecar hosts as many averagers as it may (8).");
    }
    if (n < 0 || (size_t)n >= sizeof(id) || !ident_valid_member_id(id)) {
        rc = -EINVAL;
        goto err;
    }
    cfg = (struct averager_config){
        .broker = s->broker, .cohort = s->cohort, .id = id, .host = s->host,
        .key = s->keyed ? &s->key : NULL, .integrity_mac = s->integrity, .tls_ca_pem = s->ca,
        .tls_server_name = s->server_name, .prefix = c->prefix, .initial_bits = c->bits,
        .target_group_size = c->target_group_size, .min_group_size = c->min_group_size,
        .min_matchmaking_ms = c->min_matchmaking_ms, .allreduce_timeout_ms = c->allreduce_timeout_ms,
        .request_timeout_ms = c->request_timeout_ms, .segment_bytes = c->segment_bytes,
        .leave_timeout_ms = c->leave_timeout_ms, .count = c->count, .max_count = c->max_count,
        .schema = c->schema, .schema_len = c->schema_len, .gather_max = c->gather_max,
        .codec = (enum codec)c->codec, .has_bandwidth = c->has_bandwidth != 0,
        .bandwidth = c->bandwidth, .client_mode = c->client_mode != 0,
        .min_vector_size = c->min_vector_size, .share_state = c->share_state != 0,
        .state_priority = c->state_priority, .declare_period_ms = c->declare_period_ms,
        .max_state_bytes = max_state, .plan = plan, .plan_len = c->plan_len,
    };
    /* An averager without tensors sizes its buffer by max_count. */
    if (!c->count && c->max_count > s->max_count) {
        rc = -EFBIG;
        goto err;
    }
    if (!c->count && !c->max_count)
        cfg.max_count = s->max_count < AVERAGER_AUX_COUNT_DEFAULT ? s->max_count : 0;
    rc = secret_random(h->token, sizeof(h->token));
    if (rc == 0)
        rc = averager_create(&cfg, &a);
    if (rc < 0)
        goto err;
    /* Published under the lock, after the token: attach() reads both
     * under it, so it never finds the averager beside a token not yet
     * written. */
    pthread_mutex_lock(&s->mu);
    h->a = a;
    pthread_mutex_unlock(&s->mu);
    l->h = h;
    l->owner = true;
    memcpy(out.token, h->token, sizeof(out.token));
    snprintf(out.id, sizeof(out.id), "%s", id);
    log_info("sidecar", "The trainer created an averager.", LF_S("id", id),
             LF_S("prefix", c->prefix), LF_U("count", c->count));
    return reply(l->sock, 0, &out, sizeof(out), NULL, 0);
err:
    pthread_mutex_lock(&s->mu);
    s->hosts[slot] = NULL;
    pthread_mutex_unlock(&s->mu);
    host_free(h);
    return refuse(l->sock, rc, rc == -EFBIG ? "max_count is larger than this sidecar hosts."
                               : rc == -EINVAL ? "The averager's configuration is invalid (sizes, "
                                                 "prefix, bits, codec or bandwidth)."
                                               : "The averager could not start.");
}

static bool same_token(const uint8_t *a, const uint8_t *b)
{
    uint8_t d = 0;

    for (size_t i = 0; i < AVLINK_TOKEN_BYTES; i++)
        d |= a[i] ^ b[i];
    return d == 0;
}

static int attach(struct link *l, const struct avlink_attach *at)
{
    struct avserve *s = l->srv;
    int rc = -ENOENT;

    if (at->version != AVLINK_VERSION)
        return refuse(l->sock, -EPROTO, "The trainer's library speaks another averager link.");
    pthread_mutex_lock(&s->mu);
    for (int i = 0; i < AVSERVE_AVERAGERS_MAX; i++) {
        struct host *h = s->hosts[i];
        /* Compared whole, in constant time: the token is the only proof. */
        if (!h || !h->a || h->closing ||
            !same_token(h->token, at->token))
            continue;
        if (h->attached >= AVSERVE_ATTACH_MAX) {
            rc = -EBUSY;
            break;
        }
        h->attached++;
        l->h = h;
        rc = 0;
        break;
    }
    pthread_mutex_unlock(&s->mu);
    return rc == 0 ? reply(l->sock, 0, NULL, 0, NULL, 0)
                   : refuse(l->sock, rc, rc == -EBUSY ? "This averager has as many links as it may."
                                                      : "No averager here has that token.");
}

/* An attached link's call holds the averager against its owner's leaving. */
static bool enter(struct link *l)
{
    bool ok;

    if (l->owner)
        return true;
    pthread_mutex_lock(&l->srv->mu);
    ok = !l->h->closing;
    if (ok)
        l->h->refs++;
    pthread_mutex_unlock(&l->srv->mu);
    return ok;
}

static void leave(struct link *l)
{
    if (l->owner)
        return;
    pthread_mutex_lock(&l->srv->mu);
    l->h->refs--;
    pthread_cond_broadcast(&l->srv->cond);
    pthread_mutex_unlock(&l->srv->mu);
}

/* Whether the trainer's end of sock hung up (closed, or died), waiting up
 * to timeout_ms for it. Asks for no POLLIN: whatever the trainer sends
 * waits for the link's thread. */
static bool hung_up(int sock, int timeout_ms)
{
    struct pollfd p = { .fd = sock, .events = POLLRDHUP };

    return poll(&p, 1, timeout_ms) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR));
}

/* While a step or a state download runs its link's thread is in it, so
 * a watcher of its own sees the trainer go: the socket hung up (the
 * trainer closed it, or died) aborts the call (averager_abort), and the
 * averager leaves once it returns (hung_up). */
struct hangup_watch {
    int sock;
    struct averager *a;
    atomic_bool done;
    pthread_t t;
    bool watching;
};

static void *hangup_main(void *arg)
{
    struct hangup_watch *w = arg;

    while (!atomic_load(&w->done)) {
        if (hung_up(w->sock, POLL_MS)) {
            log_info("sidecar", "The trainer's averager link closed mid-call; the call is "
                     "aborted.", LF_S("id", averager_id(w->a)));
            averager_abort(w->a);
            break;
        }
    }
    return NULL;
}

/* Starts watching l's socket for its averager; without the thread the
 * call still ends, within its timeout. */
static void watch_start(struct hangup_watch *w, struct link *l)
{
    w->sock = l->sock;
    w->a = l->h->a;
    atomic_init(&w->done, false);
    w->watching = pthread_create(&w->t, NULL, hangup_main, w) == 0;
}

static void watch_end(struct hangup_watch *w)
{
    atomic_store(&w->done, true);
    if (w->watching)
        pthread_join(w->t, NULL);
}

static int step(struct link *l, const struct avlink_step *st)
{
    struct host *h = l->h;
    struct averager_step as = {
        .data = h->count ? h->map : NULL, .weight = st->weight, .alpha = st->alpha,
        .gather = (uint8_t *)h->map + h->gather_off, .gather_len = st->gather_len,
        .timeout_ms = st->timeout_ms, .no_retries = st->no_retries != 0,
        .begin_at_ms = st->begin_at_ms,
    };
    struct averager_result *r = NULL;
    struct avlink_result_hdr *hdr;
    struct avlink_result_entry *e;
    size_t bytes, off;
    char *buf;
    int rc, fd;

    if (st->gather_len > h->gather_max)
        return refuse(l->sock, -EINVAL, "The gathered bytes exceed gather_max.");
    struct hangup_watch w;

    watch_start(&w, l);
    rc = averager_step(h->a, &as, &r);
    watch_end(&w);
    if (rc < 0)
        return refuse(l->sock, rc, averager_last_error(h->a));
    bytes = sizeof(*hdr) + r->n * sizeof(*e);
    for (size_t i = 0; i < r->n; i++)
        bytes += r->gathered_len[i];
    buf = calloc(1, bytes);
    if (!buf) {
        averager_result_free(r);
        return refuse(l->sock, -ENOMEM, "Out of memory for the step's result.");
    }
    hdr = (struct avlink_result_hdr *)buf;
    hdr->group = r->group;
    hdr->n = (uint32_t)r->n;
    hdr->attempts = r->attempts;
    hdr->matchmaking_ms = r->matchmaking_ms;
    snprintf(hdr->bits, sizeof(hdr->bits), "%s", averager_bits(h->a));
    e = (struct avlink_result_entry *)(hdr + 1);
    off = sizeof(*hdr) + r->n * sizeof(*e);
    for (size_t i = 0; i < r->n; i++) {
        snprintf(e[i].id, sizeof(e[i].id), "%s", r->ids[i]);
        e[i].weight = r->weights[i];
        e[i].gathered_len = r->gathered_len[i];
        memcpy(buf + off, r->gathered[i], r->gathered_len[i]);
        off += r->gathered_len[i];
    }
    averager_result_free(r);
    fd = tlink_memfd_from("cohort-avg-result", buf, bytes);
    free(buf);
    if (fd < 0)
        return refuse(l->sock, fd, "The step's result could not be handed over.");
    rc = reply(l->sock, 0, NULL, 0, &fd, 1);
    close(fd);
    return rc;
}

static int provide(struct link *l, uint64_t len, int fd)
{
    struct host *h = l->h;
    void *m = NULL;
    int rc;

    if (len > h->max_state)
        return refuse(l->sock, -EFBIG, "The state is larger than max_state_bytes.");
    if (avlink_memfd_check(fd, len) < 0)
        return refuse(l->sock, -EINVAL, "The state is not a sealed memfd of its stated size.");
    /* Mapped, not read: a large state costs the one copy the averager
     * keeps of it. */
    if (len) {
        m = mmap(NULL, len, PROT_READ, MAP_PRIVATE, fd, 0);
        if (m == MAP_FAILED)
            return refuse(l->sock, -errno, "The state could not be mapped.");
    }
    rc = averager_provide_state(h->a, m ? m : "", len);
    if (m)
        munmap(m, len);
    return rc < 0 ? refuse(l->sock, rc, "The state could not be kept.") : reply(l->sock, 0, NULL, 0, NULL, 0);
}

static int load(struct link *l, uint32_t ms)
{
    struct avlink_u64 n = { 0 };
    void *blob = NULL;
    size_t len = 0;
    int rc, fd;

    struct hangup_watch w;

    watch_start(&w, l);
    rc = averager_load_state(l->h->a, ms, &blob, &len);
    watch_end(&w);
    if (rc < 0)
        return refuse(l->sock, rc, averager_load_error(l->h->a));
    fd = tlink_memfd_from("cohort-avg-state", blob, len);
    free(blob);
    if (fd < 0)
        return refuse(l->sock, fd, "The state could not be handed over.");
    n.value = len;
    rc = reply(l->sock, 0, &n, sizeof(n), &fd, 1);
    close(fd);
    return rc;
}

/* averager_wait for up to ms, in slices of POLL_MS: the trainer gives the
 * bound (up to 49 days fit the field), so a trainer that hangs up, a link
 * whose averager's owner left, or a sidecar that stops ends the wait
 * within a slice. Otherwise the link's thread would sit in it, the owner's
 * averager could not leave (link_end waits for the calls that hold it)
 * and avserve_destroy would wait too. Returns 0, -ETIMEDOUT or
 * -ECANCELED. */
static int wait_joined(struct link *l, uint32_t ms)
{
    uint64_t end = clock_now_ms() + ms;

    for (;;) {
        uint64_t now = clock_now_ms(), left = end > now ? end - now : 0;
        int rc = averager_wait(l->h->a, (uint32_t)(left < POLL_MS ? left : POLL_MS));
        bool closing;

        if (rc == 0 || left <= POLL_MS)
            return rc;
        pthread_mutex_lock(&l->srv->mu);
        closing = l->srv->stop || l->h->closing;
        pthread_mutex_unlock(&l->srv->mu);
        if (closing || hung_up(l->sock, 0))
            return -ECANCELED;
    }
}

/* Serves one request of a link that holds an averager. */
static int serve(struct link *l, const struct tlink_hdr *hd, const void *body, int fd)
{
    struct host *h = l->h;
    int rc;

    /* The step's calls belong to one thread of the trainer: its owner's. */
    if (!l->owner && (hd->type == AVL_STEP || hd->type == AVL_BITS || hd->type == AVL_SET_BITS))
        return refuse(l->sock, -EPERM, "Only the link that created the averager steps it.");
    if (!enter(l))
        return refuse(l->sock, -ENOTCONN, "The averager has left.");
    switch (hd->type) {
    case AVL_WAIT: {
        const struct avlink_u32 *u = body;
        rc = wait_joined(l, u->value);
        rc = rc < 0 ? refuse(l->sock, rc, "The averager has not joined the cohort yet.")
                    : reply(l->sock, 0, NULL, 0, NULL, 0);
        break;
    }
    case AVL_STEP:
        rc = step(l, body);
        break;
    case AVL_BITS: {
        struct avlink_bits b;
        memset(&b, 0, sizeof(b));
        snprintf(b.bits, sizeof(b.bits), "%s", averager_bits(h->a));
        rc = reply(l->sock, 0, &b, sizeof(b), NULL, 0);
        break;
    }
    case AVL_SET_BITS: {
        struct avlink_bits b;
        memcpy(&b, body, sizeof(b));
        b.bits[AVLINK_BITS_MAX] = '\0';
        rc = averager_set_bits(h->a, b.bits);
        rc = rc < 0 ? refuse(l->sock, rc, "Group bits are up to 64 of 0 and 1.")
                    : reply(l->sock, 0, NULL, 0, NULL, 0);
        break;
    }
    case AVL_SET_SHARING: {
        const struct avlink_sharing *sh = body;
        rc = averager_set_state_sharing(h->a, sh->share != 0, sh->priority);
        rc = rc < 0 ? refuse(l->sock, rc, "The priority must be finite.")
                    : reply(l->sock, 0, NULL, 0, NULL, 0);
        break;
    }
    case AVL_SHARING: {
        struct avlink_sharing sh = { 0, 0, 0 };
        bool share;
        averager_state_sharing(h->a, &share, &sh.priority);
        sh.share = share;
        rc = reply(l->sock, 0, &sh, sizeof(sh), NULL, 0);
        break;
    }
    case AVL_STATE_WANTED: {
        const struct avlink_u32 *u = body;
        struct avlink_u32 r = { 0, 0 };
        r.value = averager_state_wanted(h->a, u->value < AVLINK_WANTED_SLICE_MS
                                                  ? u->value : AVLINK_WANTED_SLICE_MS);
        rc = reply(l->sock, 0, &r, sizeof(r), NULL, 0);
        break;
    }
    case AVL_PROVIDE_STATE:
        rc = provide(l, ((const struct avlink_u64 *)body)->value, fd);
        break;
    case AVL_LOAD_STATE:
        rc = load(l, ((const struct avlink_u32 *)body)->value);
        break;
    case AVL_PARTS_SERVED: {
        struct avlink_u64 n = { averager_state_parts_served(h->a) };
        rc = reply(l->sock, 0, &n, sizeof(n), NULL, 0);
        break;
    }
    default:
        rc = refuse(l->sock, -EPROTO, "Not a request of an averager's link.");
        break;
    }
    leave(l);
    return rc;
}

/* One message: 0 to go on, <0 to end the link. */
static int serve_one(struct link *l, int timeout_ms)
{
    union {
        struct avlink_hello hello;
        struct avlink_attach attach;
        struct avlink_create create;
        char raw[TLINK_BODY_MAX];
    } b;
    struct tlink_hdr hd;
    int fds[TLINK_FDS_MAX], nfds = 0, rc;
    long want;
    bool wants_fd;

    rc = tlink_recv(l->sock, &hd, &b, sizeof(b), -1, fds, &nfds, timeout_ms);
    if (rc < 0)
        return rc;
    want = avlink_body_size(hd.type, false);
    wants_fd = hd.type == AVL_CREATE || hd.type == AVL_PROVIDE_STATE;
    /* Framing the trainer's library never sends: the link ends. */
    if (want < 0 || hd.len != (uint32_t)want || nfds != (wants_fd ? 1 : 0)) {
        for (int i = 0; i < nfds; i++)
            close(fds[i]);
        log_warn("sidecar", "A trainer's averager link sent a malformed request; closing it.",
                 LF_U("type", hd.type), LF_U("len", hd.len));
        refuse(l->sock, -EPROTO, "Malformed request: the link is closed.");
        return -EPROTO;
    }
    if (!l->h) {
        switch (hd.type) {
        case AVL_HELLO:
            rc = b.hello.version == AVLINK_VERSION
                     ? reply(l->sock, 0, NULL, 0, NULL, 0)
                     : refuse(l->sock, -EPROTO, "The trainer's library speaks another averager link.");
            break;
        case AVL_ATTACH:
            rc = attach(l, &b.attach);
            break;
        case AVL_CREATE:
            rc = create(l, &b.create, fds[0]);
            break;
        default:
            rc = refuse(l->sock, -ENODEV, "Create or attach an averager first.");
            break;
        }
    } else if (hd.type == AVL_HELLO || hd.type == AVL_ATTACH || hd.type == AVL_CREATE) {
        rc = refuse(l->sock, -EALREADY, "This link holds an averager already.");
    } else {
        rc = serve(l, &hd, &b, nfds ? fds[0] : -1);
    }
    for (int i = 0; i < nfds; i++)
        close(fds[i]);
    return rc < 0 ? rc : 0;
}

/* The link is over: an owner's averager leaves once no attached call
 * holds it. */
static void link_end(struct link *l)
{
    struct avserve *s = l->srv;
    struct host *h = l->h;
    bool free_now;

    close(l->sock);
    if (h && l->owner) {
        pthread_mutex_lock(&s->mu);
        h->closing = true;
        while (h->refs)
            pthread_cond_wait(&s->cond, &s->mu);
        pthread_mutex_unlock(&s->mu);
        log_info("sidecar", "The trainer's averager link closed; the averager leaves.",
                 LF_S("id", averager_id(h->a)));
        averager_destroy(h->a);
        pthread_mutex_lock(&s->mu);
        h->a = NULL;
        /* Attached links find it closing; the last of them frees it. */
        for (int i = 0; i < AVSERVE_AVERAGERS_MAX; i++)
            if (s->hosts[i] == h)
                s->hosts[i] = NULL;
        free_now = !h->attached;
        pthread_mutex_unlock(&s->mu);
        if (free_now)
            host_free(h);
    } else if (h) {
        bool last;
        pthread_mutex_lock(&s->mu);
        h->attached--;
        last = h->closing && !h->attached && !h->a;
        pthread_mutex_unlock(&s->mu);
        /* The owner left before us and left the host to the last link. */
        if (last)
            host_free(h);
    }
    pthread_mutex_lock(&s->mu);
    s->links--;
    pthread_cond_broadcast(&s->cond);
    pthread_mutex_unlock(&s->mu);
    free(l);
}

static void *link_main(void *arg)
{
    struct link *l = arg;
    uint64_t deadline = clock_now_ms() + TLINK_HELLO_DEADLINE_MS;

    for (;;) {
        int rc = serve_one(l, POLL_MS);

        /* The deadline is checked after every message too, not only when
         * the link falls idle: one that keeps sending HELLO (or requests
         * refused for want of an averager) makes nothing either. */
        if ((rc == 0 || rc == -ETIMEDOUT) && !l->h && clock_now_ms() > deadline) {
            log_warn("sidecar", "A trainer's averager link made no averager in time; closing it.");
            break;
        }
        if (rc == -ETIMEDOUT) {
            if (stopping(l->srv))
                break;
            if (l->h && !l->owner) {
                bool gone;
                pthread_mutex_lock(&l->srv->mu);
                gone = l->h->closing;
                pthread_mutex_unlock(&l->srv->mu);
                if (gone)
                    break;
            }
            continue;
        }
        if (rc < 0)
            break;
    }
    link_end(l);
    return NULL;
}

int avserve_adopt(void *arg, int sock)
{
    struct avserve *s = arg;
    struct link *l;
    pthread_attr_t attr;
    pthread_t t;
    int rc = 0;

    pthread_mutex_lock(&s->mu);
    if (s->stop || s->links >= AVSERVE_LINKS_MAX)
        rc = -EBUSY;
    else
        s->links++;
    pthread_mutex_unlock(&s->mu);
    if (rc < 0) {
        refuse(sock, rc, "This sidecar serves as many averager links as it may.");
        close(sock);
        return rc;
    }
    l = calloc(1, sizeof(*l));
    if (!l) {
        rc = -ENOMEM;
        goto err;
    }
    l->srv = s;
    l->sock = sock;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&t, &attr, link_main, l) != 0)
        rc = -EAGAIN;
    pthread_attr_destroy(&attr);
    if (rc == 0)
        return 0;
    free(l);
err:
    close(sock);
    pthread_mutex_lock(&s->mu);
    s->links--;
    pthread_cond_broadcast(&s->cond);
    pthread_mutex_unlock(&s->mu);
    return rc;
}

int avserve_create(const struct avserve_config *cfg, struct avserve **out)
{
    struct avserve *s;

    if (!cfg || !cfg->broker || !cfg->cohort || !cfg->id || !cfg->host || !out ||
        strlen(cfg->id) + 24 > IDENT_NAME_MAX || (cfg->integrity_mac && !cfg->key))
        return -EINVAL;
    s = calloc(1, sizeof(*s));
    if (!s)
        return -ENOMEM;
    s->broker = strdup(cfg->broker);
    s->cohort = strdup(cfg->cohort);
    s->id = strdup(cfg->id);
    s->host = strdup(cfg->host);
    s->ca = cfg->tls_ca_pem ? strdup(cfg->tls_ca_pem) : NULL;
    s->server_name = cfg->tls_server_name ? strdup(cfg->tls_server_name) : NULL;
    if (!s->broker || !s->cohort || !s->id || !s->host || (cfg->tls_ca_pem && !s->ca) ||
        (cfg->tls_server_name && !s->server_name)) {
        avserve_destroy(s);
        return -ENOMEM;
    }
    if (cfg->key) {
        s->key = *cfg->key;
        s->keyed = true;
    }
    s->integrity = cfg->integrity_mac;
    s->max_count = cfg->max_count && cfg->max_count < AVLINK_COUNT_MAX ? cfg->max_count
                                                                       : AVLINK_COUNT_MAX;
    s->max_state = cfg->max_state_bytes && cfg->max_state_bytes < AVLINK_STATE_MAX
                       ? cfg->max_state_bytes : AVLINK_STATE_MAX;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cond, NULL);
    *out = s;
    return 0;
}

void avserve_destroy(struct avserve *s)
{
    if (!s)
        return;
    if (s->broker && s->cohort && s->id && s->host) {
        pthread_mutex_lock(&s->mu);
        s->stop = true;
        /* Each link ends at its next poll, or once its call returns. */
        while (s->links)
            pthread_cond_wait(&s->cond, &s->mu);
        pthread_mutex_unlock(&s->mu);
        pthread_cond_destroy(&s->cond);
        pthread_mutex_destroy(&s->mu);
    }
    secret_wipe(&s->key);
    free(s->broker);
    free(s->cohort);
    free(s->id);
    free(s->host);
    free(s->ca);
    free(s->server_name);
    free(s);
}

unsigned avserve_averagers(struct avserve *s)
{
    unsigned n = 0;

    pthread_mutex_lock(&s->mu);
    for (int i = 0; i < AVSERVE_AVERAGERS_MAX; i++)
        n += s->hosts[i] != NULL;
    pthread_mutex_unlock(&s->mu);
    return n;
}

unsigned avserve_links(struct avserve *s)
{
    unsigned n;

    pthread_mutex_lock(&s->mu);
    n = s->links;
    pthread_mutex_unlock(&s->mu);
    return n;
}

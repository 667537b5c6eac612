/* src/accumulator/ckpt.c: see ckpt.h. */
#include "accumulator/ckpt.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <openssl/evp.h>

#include "base/clock.h"
#include "base/limits.h"
#include "base/log.h"

#define MAGIC "COHORTCK"
#define DIGEST_BYTES 32u
#define PREFIX "ckpt-"
#define SUFFIX ".cohort"
#define DIGITS 20
#define NAME_BYTES (sizeof(PREFIX) - 1 + DIGITS + sizeof(SUFFIX))   /* with NUL */
#define IO_CHUNK (4u << 20)
/* A checkpoint directory holds `keep` files (at most CKPT_KEEP_MAX) and
 * what was set aside; past this many names a listing stops looking. */
#define LIST_MAX 65536u

static const char *const reasons[] = {
    [CKPT_OK] = "valid",
    [CKPT_TRUNCATED] = "truncated or extended",
    [CKPT_CHECKSUM] = "checksum mismatch",
    [CKPT_HEADER] = "not a checkpoint of a known format",
    [CKPT_LAYOUT] = "parameter or buffer sizes differ from the model's",
    [CKPT_COHORT] = "another cohort's",
    [CKPT_IO] = "read error",
};

const char *ckpt_reason_str(unsigned reason)
{
    return reason <= CKPT_REASON_MAX ? reasons[reason] : "unknown";
}

/* ---- names -------------------------------------------------------------- */

static int name_of(char *buf, size_t cap, const char *dir, uint64_t version, const char *tail)
{
    int n = snprintf(buf, cap, "%s/" PREFIX "%020" PRIu64 SUFFIX "%s", dir, version, tail);
    return n < 0 || (size_t)n >= cap ? -ENAMETOOLONG : 0;
}

/* The version a final checkpoint name carries; false for any other name
 * (temporaries, files set aside, strangers). */
static bool parse_name(const char *name, uint64_t *version)
{
    const size_t plen = sizeof(PREFIX) - 1;
    uint64_t v = 0;

    if (strlen(name) != NAME_BYTES - 1 || strncmp(name, PREFIX, plen) != 0 ||
        strcmp(name + plen + DIGITS, SUFFIX) != 0)
        return false;
    for (size_t i = 0; i < DIGITS; i++) {
        unsigned d = (unsigned)(name[plen + i] - '0');
        if (d > 9 || v > (UINT64_MAX - d) / 10)
            return false;
        v = v * 10 + d;
    }
    *version = v;
    return true;
}

static int cmp_desc(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? 1 : x > y ? -1 : 0;
}

/* The versions of the final checkpoints in dir, newest first. The caller
 * frees *out. Returns the count, or -errno. */
static long list_versions(const char *dir, uint64_t **out)
{
    DIR *d = opendir(dir);
    struct dirent *e;
    uint64_t *v = NULL, ver;
    size_t n = 0, cap = 0;

    *out = NULL;
    if (!d)
        return -errno;
    while ((e = readdir(d)) != NULL && n < LIST_MAX) {
        if (!parse_name(e->d_name, &ver))
            continue;
        if (n == cap) {
            size_t ncap = cap ? cap * 2 : 16;
            uint64_t *nv = realloc(v, ncap * sizeof(*nv));
            if (!nv) {
                free(v);
                closedir(d);
                return -ENOMEM;
            }
            v = nv;
            cap = ncap;
        }
        v[n++] = ver;
    }
    closedir(d);
    if (n)
        qsort(v, n, sizeof(*v), cmp_desc);
    *out = v;
    return (long)n;
}

uint64_t ckpt_newest_version(const char *dir)
{
    uint64_t *v, newest = 0;
    long n = list_versions(dir, &v);

    if (n > 0)
        newest = v[0];
    free(v);
    return newest;
}

int ckpt_mkdirs(const char *path)
{
    char buf[PATH_MAX];
    size_t len = strlen(path);

    if (len == 0 || len >= sizeof(buf))
        return len ? -ENAMETOOLONG : -EINVAL;
    memcpy(buf, path, len + 1);
    for (char *p = buf + 1; ; p++) {
        if (*p == '/' || *p == '\0') {
            char c = *p;
            *p = '\0';
            if (mkdir(buf, 0700) < 0 && errno != EEXIST)
                return -errno;
            *p = c;
            if (c == '\0')
                break;
        }
    }
    return 0;
}

/* ---- bytes -------------------------------------------------------------- */

static void put64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static void put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static uint64_t get64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}

static uint32_t get32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static int write_all(int fd, EVP_MD_CTX *md, const void *buf, size_t len)
{
    const uint8_t *p = buf;

    if (md && len && !EVP_DigestUpdate(md, buf, len))
        return -ENOMEM;
    while (len > 0) {
        ssize_t w = write(fd, p, len > IO_CHUNK ? IO_CHUNK : len);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        p += w;
        len -= (size_t)w;
    }
    return 0;
}

/* Reads len bytes at off into buf (or, buf NULL, through scratch) and
 * hashes them. Returns 0, -EIO (a short file), or read's -errno. */
static int read_hash(int fd, uint64_t off, void *buf, uint64_t len, EVP_MD_CTX *md, uint8_t *scratch)
{
    uint8_t *p = buf;

    while (len > 0) {
        size_t want = len > IO_CHUNK ? IO_CHUNK : (size_t)len;
        uint8_t *dst = p ? p : scratch;
        ssize_t r = pread(fd, dst, want, (off_t)off);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        if (r == 0)
            return -EIO;
        if (!EVP_DigestUpdate(md, dst, (size_t)r))
            return -ENOMEM;
        off += (uint64_t)r;
        len -= (uint64_t)r;
        if (p)
            p += r;
    }
    return 0;
}

static int fsync_dir(const char *dir)
{
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC), rc = 0;

    if (fd < 0)
        return -errno;
    if (fsync(fd) < 0 && errno != EINVAL)   /* some filesystems cannot sync a directory */
        rc = -errno;
    close(fd);
    return rc;
}

/* ---- write -------------------------------------------------------------- */

static void retain(const char *dir, unsigned keep)
{
    uint64_t *v;
    long n = list_versions(dir, &v);
    char path[PATH_MAX];

    for (long i = keep; i < n; i++) {
        if (name_of(path, sizeof(path), dir, v[i], "") == 0 && unlink(path) < 0 && errno != ENOENT)
            log_warn("ckpt", "Could not remove an old checkpoint.", LF_S("path", path),
                     LF_ERR(-errno));
    }
    free(v);
}

int ckpt_write(const char *dir, const struct ckpt_layout *l, const struct ckpt_parts *p,
               unsigned keep, uint64_t *bytes_out)
{
    char tmp[PATH_MAX], final[PATH_MAX];
    uint8_t hdr[CKPT_HEADER_BYTES] = { 0 }, digest[DIGEST_BYTES];
    unsigned dlen = 0;
    EVP_MD_CTX *md = NULL;
    size_t clen;
    int fd = -1, rc;

    if (!dir || !l || !l->cohort || !p || keep == 0 || keep > CKPT_KEEP_MAX ||
        p->state_len > LIMIT_STATE_BYTES || (l->params_bytes && !p->params) ||
        (l->buffers_bytes && !p->buffers) || (p->state_len && !p->state) ||
        (clen = strlen(l->cohort)) >= CKPT_COHORT_BYTES)
        return -EINVAL;
    if ((rc = name_of(final, sizeof(final), dir, p->version, "")) < 0)
        return rc;
    {
        int n = snprintf(tmp, sizeof(tmp), "%s/." PREFIX "%020" PRIu64 ".tmp-%ld", dir, p->version,
                         (long)getpid());
        if (n < 0 || (size_t)n >= sizeof(tmp))
            return -ENAMETOOLONG;
    }
    memcpy(hdr, MAGIC, 8);
    put32(hdr + 8, CKPT_FORMAT);
    put32(hdr + 12, CKPT_HEADER_BYTES);
    put64(hdr + 16, p->version);
    put64(hdr + 24, l->params_bytes);
    put64(hdr + 32, l->buffers_bytes);
    put64(hdr + 40, p->state_len);
    put64(hdr + 48, clock_wall_ms());
    memcpy(hdr + 56, l->cohort, clen);

    md = EVP_MD_CTX_new();
    if (!md || !EVP_DigestInit_ex(md, EVP_sha256(), NULL)) {
        rc = -ENOMEM;
        goto out;
    }
    fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) {
        rc = -errno;
        goto out;
    }
    if ((rc = write_all(fd, md, hdr, sizeof(hdr))) < 0 ||
        (rc = write_all(fd, md, p->params, l->params_bytes)) < 0 ||
        (rc = write_all(fd, md, p->buffers, l->buffers_bytes)) < 0 ||
        (rc = write_all(fd, md, p->state, p->state_len)) < 0)
        goto unlink_tmp;
    if (!EVP_DigestFinal_ex(md, digest, &dlen) || dlen != DIGEST_BYTES) {
        rc = -ENOMEM;
        goto unlink_tmp;
    }
    if ((rc = write_all(fd, NULL, digest, sizeof(digest))) < 0)
        goto unlink_tmp;
    /* The data reaches the disk before the name does: after a crash the
     * final name holds the whole file or does not exist. */
    if (fsync(fd) < 0) {
        rc = -errno;
        goto unlink_tmp;
    }
    close(fd);
    fd = -1;
    if (rename(tmp, final) < 0) {
        rc = -errno;
        goto unlink_tmp;
    }
    if ((rc = fsync_dir(dir)) < 0)
        goto out;
    if (bytes_out)
        *bytes_out = CKPT_HEADER_BYTES + l->params_bytes + l->buffers_bytes + p->state_len +
                     DIGEST_BYTES;
    retain(dir, keep);
    goto out;
unlink_tmp:
    if (fd >= 0)
        close(fd);
    fd = -1;
    unlink(tmp);
out:
    if (fd >= 0)
        close(fd);
    EVP_MD_CTX_free(md);
    return rc;
}

/* ---- load --------------------------------------------------------------- */

/* Checks one open checkpoint against its name and the layout, and its
 * checksum over the whole file. Returns CKPT_OK with *state_len set, or
 * the reason it is not usable. */
static unsigned verify(int fd, uint64_t version, const struct ckpt_layout *l, uint8_t *scratch,
                       uint64_t *state_len, uint64_t *size_out)
{
    uint8_t hdr[CKPT_HEADER_BYTES], want[DIGEST_BYTES], got[DIGEST_BYTES];
    unsigned dlen = 0, reason = CKPT_IO;
    EVP_MD_CTX *md = NULL;
    struct stat st;
    uint64_t s, body;
    ssize_t r;

    if (fstat(fd, &st) < 0)
        return CKPT_IO;
    if ((uint64_t)st.st_size < CKPT_HEADER_BYTES + DIGEST_BYTES)
        return CKPT_TRUNCATED;
    r = pread(fd, hdr, sizeof(hdr), 0);
    if (r != (ssize_t)sizeof(hdr))
        return r < 0 ? CKPT_IO : CKPT_TRUNCATED;
    if (memcmp(hdr, MAGIC, 8) != 0 || get32(hdr + 8) != CKPT_FORMAT ||
        get32(hdr + 12) != CKPT_HEADER_BYTES || get64(hdr + 16) != version ||
        get64(hdr + 120) != 0 || memchr(hdr + 56, '\0', CKPT_COHORT_BYTES) == NULL)
        return CKPT_HEADER;
    if (strcmp((const char *)hdr + 56, l->cohort) != 0)
        return CKPT_COHORT;
    if (get64(hdr + 24) != l->params_bytes || get64(hdr + 32) != l->buffers_bytes)
        return CKPT_LAYOUT;
    s = get64(hdr + 40);
    if (s > LIMIT_STATE_BYTES)
        return CKPT_HEADER;
    /* Each term is bounded now (the layout's sizes are the caller's). */
    body = CKPT_HEADER_BYTES + (uint64_t)l->params_bytes + l->buffers_bytes + s;
    if ((uint64_t)st.st_size != body + DIGEST_BYTES)
        return CKPT_TRUNCATED;
    md = EVP_MD_CTX_new();
    if (!md || !EVP_DigestInit_ex(md, EVP_sha256(), NULL))
        goto out;
    if (read_hash(fd, 0, NULL, body, md, scratch) < 0)
        goto out;
    if (pread(fd, want, sizeof(want), (off_t)body) != (ssize_t)sizeof(want))
        goto out;
    if (!EVP_DigestFinal_ex(md, got, &dlen) || dlen != DIGEST_BYTES)
        goto out;
    reason = memcmp(want, got, DIGEST_BYTES) == 0 ? CKPT_OK : CKPT_CHECKSUM;
    *state_len = s;
    *size_out = (uint64_t)st.st_size;
out:
    EVP_MD_CTX_free(md);
    return reason;
}

/* Reads a verified file into place, hashing again: the first pass proved
 * the file, this one proves what was read. */
static int read_into(int fd, const struct ckpt_layout *l, void *params, void *buffers, void *state,
                     uint64_t state_len, uint8_t *scratch)
{
    uint8_t want[DIGEST_BYTES], got[DIGEST_BYTES];
    uint64_t off = CKPT_HEADER_BYTES;
    unsigned dlen = 0;
    EVP_MD_CTX *md = EVP_MD_CTX_new();
    int rc = -ENOMEM;

    if (!md || !EVP_DigestInit_ex(md, EVP_sha256(), NULL))
        goto out;
    if ((rc = read_hash(fd, 0, NULL, CKPT_HEADER_BYTES, md, scratch)) < 0 ||
        (rc = read_hash(fd, off, params, l->params_bytes, md, scratch)) < 0 ||
        (rc = read_hash(fd, off += l->params_bytes, buffers, l->buffers_bytes, md, scratch)) < 0 ||
        (rc = read_hash(fd, off += l->buffers_bytes, state, state_len, md, scratch)) < 0)
        goto out;
    off += state_len;
    rc = -EIO;
    if (pread(fd, want, sizeof(want), (off_t)off) != (ssize_t)sizeof(want) ||
        !EVP_DigestFinal_ex(md, got, &dlen) || dlen != DIGEST_BYTES ||
        memcmp(want, got, DIGEST_BYTES) != 0)
        goto out;
    rc = 0;
out:
    EVP_MD_CTX_free(md);
    return rc;
}

static void set_aside(const char *dir, uint64_t version, unsigned reason)
{
    char from[PATH_MAX], to[PATH_MAX];

    if (name_of(from, sizeof(from), dir, version, "") < 0 ||
        name_of(to, sizeof(to), dir, version, ".skipped") < 0)
        return;
    if (rename(from, to) < 0 && errno != ENOENT)
        log_warn("ckpt", "Could not set an invalid checkpoint aside.", LF_S("path", from),
                 LF_ERR(-errno));
    log_warn("ckpt", "Skipped an invalid checkpoint.", LF_S("path", from), LF_U("version", version),
             LF_S("reason", ckpt_reason_str(reason)), LF_S("set_aside_as", to));
}

int ckpt_load(const char *dir, const struct ckpt_layout *l, uint64_t above, void *params,
              void *buffers, struct ckpt_loaded *out)
{
    uint64_t *v = NULL;
    uint8_t *scratch = NULL;
    char path[PATH_MAX];
    long n;
    int rc = -ENOENT;

    memset(out, 0, sizeof(*out));
    if (!dir || !l || !l->cohort || (l->params_bytes && !params) || (l->buffers_bytes && !buffers))
        return -EINVAL;
    n = list_versions(dir, &v);
    if (n < 0)
        return n == -ENOENT ? -ENOENT : (int)n;
    scratch = malloc(IO_CHUNK);
    if (!scratch) {
        free(v);
        return -ENOMEM;
    }
    for (long i = 0; i < n && v[i] > above; i++) {
        uint64_t state_len = 0, size = 0;
        unsigned reason;
        void *state;
        int fd;

        if (name_of(path, sizeof(path), dir, v[i], "") < 0)
            continue;
        fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0) {
            if (errno == ENOENT)    /* removed by a writer's retention meanwhile */
                continue;
            reason = CKPT_IO;
        } else {
            reason = verify(fd, v[i], l, scratch, &state_len, &size);
        }
        if (reason != CKPT_OK) {
            if (fd >= 0)
                close(fd);
            if (out->n_skipped < CKPT_SKIPS_MAX) {
                out->skipped[out->n_skipped].version = v[i];
                out->skipped[out->n_skipped].reason = reason;
                out->n_skipped++;
            }
            set_aside(dir, v[i], reason);
            continue;
        }
        state = malloc(state_len ? state_len : 1);
        if (!state) {
            close(fd);
            rc = -ENOMEM;
            break;
        }
        rc = read_into(fd, l, params, buffers, state, state_len, scratch);
        close(fd);
        if (rc < 0) {
            free(state);
            log_error("ckpt", "A verified checkpoint read back differently; the model's "
                              "parameters are not valid.", LF_S("path", path), LF_ERR(rc));
            rc = -EIO;
            break;
        }
        out->version = v[i];
        out->state = state;
        out->state_len = (size_t)state_len;
        out->bytes = size;
        break;
    }
    free(scratch);
    free(v);
    return rc;
}

/* ---- writer ------------------------------------------------------------- */

struct ckpt_writer {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    pthread_t thread;
    char *dir;
    char *cohort;
    struct ckpt_layout layout;
    unsigned keep;
    bool stop;
    bool busy;                  /* a copy is pending or being written */
    void *copy;                 /* params | buffers | state */
    struct ckpt_parts parts;    /* into copy */
    struct ckpt_writer_stats stats;
};

static void *writer_main(void *arg)
{
    struct ckpt_writer *w = arg;

    /* The lowest priority for this thread alone (Linux's nice is per
     * thread): checksumming and copying into the page cache take CPU,
     * and where the cores are busy with rounds, those must win, not the
     * checkpoint (bench/checkpoint.sh). On idle cores it runs at full
     * speed. Failing to lower it only costs that. */
    if (setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), 19) < 0)
        log_info("ckpt", "Could not lower the checkpoint writer's priority.", LF_ERR(-errno));

    pthread_mutex_lock(&w->lock);
    for (;;) {
        while (!w->stop && !(w->busy && w->copy))
            pthread_cond_wait(&w->cond, &w->lock);
        if (!(w->busy && w->copy))
            break;
        struct ckpt_parts p = w->parts;
        void *copy = w->copy;
        uint64_t t0, us, bytes = 0;
        int rc;

        pthread_mutex_unlock(&w->lock);
        t0 = clock_now_us();
        rc = ckpt_write(w->dir, &w->layout, &p, w->keep, &bytes);
        us = clock_now_us() - t0;
        free(copy);
        if (rc == 0)
            log_info("ckpt", "Checkpoint written.", LF_S("dir", w->dir), LF_U("version", p.version),
                     LF_U("bytes", bytes), LF_U("ms", us / 1000),
                     LF_U("mib_per_s", us ? bytes * 1000000 / us / (1u << 20) : 0));
        else
            log_warn("ckpt", "A checkpoint could not be written; training goes on.",
                     LF_S("dir", w->dir), LF_U("version", p.version), LF_ERR(rc));
        pthread_mutex_lock(&w->lock);
        if (rc == 0) {
            w->stats.written++;
            w->stats.last_version = p.version;
            w->stats.last_bytes = bytes;
            w->stats.last_us = us;
            w->stats.total_bytes += bytes;
            w->stats.total_us += us;
        } else {
            w->stats.failed++;
        }
        w->copy = NULL;
        w->busy = false;
        pthread_cond_broadcast(&w->cond);
    }
    pthread_mutex_unlock(&w->lock);
    return NULL;
}

/* Temporaries are named by the writing process; one that is not ours and
 * still there was left by a writer that died mid-write. */
static void remove_temporaries(const char *dir)
{
    DIR *d = opendir(dir);
    struct dirent *e;
    char path[PATH_MAX];

    if (!d)
        return;
    while ((e = readdir(d)) != NULL) {
        if (strncmp(e->d_name, "." PREFIX, sizeof(PREFIX)) != 0 || !strstr(e->d_name, ".tmp-"))
            continue;
        int n = snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
        if (n > 0 && (size_t)n < sizeof(path))
            unlink(path);
    }
    closedir(d);
}

int ckpt_writer_create(const char *dir, const struct ckpt_layout *layout, unsigned keep,
                       struct ckpt_writer **out)
{
    struct ckpt_writer *w;
    int rc;

    if (!dir || !*dir || !layout || !layout->cohort ||
        strlen(layout->cohort) >= CKPT_COHORT_BYTES || keep == 0 || keep > CKPT_KEEP_MAX)
        return -EINVAL;
    if ((rc = ckpt_mkdirs(dir)) < 0)
        return rc;
    w = calloc(1, sizeof(*w));
    if (!w)
        return -ENOMEM;
    w->dir = strdup(dir);
    w->cohort = strdup(layout->cohort);
    if (!w->dir || !w->cohort) {
        rc = -ENOMEM;
        goto free_w;
    }
    w->layout = *layout;
    w->layout.cohort = w->cohort;
    w->keep = keep;
    remove_temporaries(dir);
    pthread_mutex_init(&w->lock, NULL);
    pthread_cond_init(&w->cond, NULL);
    if (pthread_create(&w->thread, NULL, writer_main, w) != 0) {
        rc = -EAGAIN;
        goto destroy_sync;
    }
    *out = w;
    return 0;
destroy_sync:
    pthread_cond_destroy(&w->cond);
    pthread_mutex_destroy(&w->lock);
free_w:
    free(w->dir);
    free(w->cohort);
    free(w);
    return rc;
}

void ckpt_writer_destroy(struct ckpt_writer *w)
{
    if (!w)
        return;
    pthread_mutex_lock(&w->lock);
    w->stop = true;
    pthread_cond_broadcast(&w->cond);
    pthread_mutex_unlock(&w->lock);
    pthread_join(w->thread, NULL);
    free(w->copy);
    pthread_cond_destroy(&w->cond);
    pthread_mutex_destroy(&w->lock);
    free(w->dir);
    free(w->cohort);
    free(w);
}

bool ckpt_writer_busy(struct ckpt_writer *w)
{
    bool busy;

    pthread_mutex_lock(&w->lock);
    busy = w->busy;
    pthread_mutex_unlock(&w->lock);
    return busy;
}

int ckpt_writer_submit(struct ckpt_writer *w, const struct ckpt_parts *p)
{
    size_t pb = w->layout.params_bytes, bb = w->layout.buffers_bytes;
    uint8_t *copy;

    if (!p || p->state_len > LIMIT_STATE_BYTES || (pb && !p->params) || (bb && !p->buffers) ||
        (p->state_len && !p->state))
        return -EINVAL;
    pthread_mutex_lock(&w->lock);
    if (w->busy || w->stop) {
        pthread_mutex_unlock(&w->lock);
        return -EBUSY;
    }
    w->busy = true;     /* claimed: a second submit is refused while we copy */
    pthread_mutex_unlock(&w->lock);

    copy = malloc(pb + bb + p->state_len + 1);
    if (!copy) {
        pthread_mutex_lock(&w->lock);
        w->busy = false;
        pthread_mutex_unlock(&w->lock);
        return -ENOMEM;
    }
    if (pb)
        memcpy(copy, p->params, pb);
    if (bb)
        memcpy(copy + pb, p->buffers, bb);
    if (p->state_len)
        memcpy(copy + pb + bb, p->state, p->state_len);
    pthread_mutex_lock(&w->lock);
    w->copy = copy;
    w->parts = (struct ckpt_parts){
        .version = p->version, .params = copy, .buffers = copy + pb,
        .state = copy + pb + bb, .state_len = p->state_len,
    };
    pthread_cond_broadcast(&w->cond);
    pthread_mutex_unlock(&w->lock);
    return 0;
}

void ckpt_writer_stats(struct ckpt_writer *w, struct ckpt_writer_stats *out)
{
    pthread_mutex_lock(&w->lock);
    *out = w->stats;
    pthread_mutex_unlock(&w->lock);
}

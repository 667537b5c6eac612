/* cli/bench_checkpoint.c: `cohortctl bench checkpoint`: what checkpoints
 * cost. Two measures, per model size:
 *
 * - Write throughput: ckpt_write() of a model of that size (temporary
 *   file, SHA-256, fsync, rename, directory fsync) into --dir, timed.
 * - Rounds per second of N members (nodes in this process, on loopback,
 *   against an embedded broker) with no checkpoints and with the leader
 *   writing one every E versions, in the same run: each repetition runs
 *   every setting once, in turn, so that a busy moment on a shared
 *   machine touches all settings alike. The ratio is each setting's
 *   rounds/s over the run without checkpoints in the same repetition
 *   (median over repetitions).
 *
 * The model's parameters and its gradients have the same size (float32),
 * as a trainer's .grad has its parameter's. Every checkpoint is of the
 * parameters (the buffers and the opaque state are empty here).
 */
#include <dirent.h>
#include <errno.h>
#include <getopt.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "accumulator/ckpt.h"
#include "accumulator/node.h"
#include "base/clock.h"
#include "base/log.h"
#include "base/opt.h"
#include "cli.h"
#include "stats.h"
#include "membership/brokerd.h"
#include "rpc/rpc.h"

#define PROG "cohortctl bench checkpoint"
#define MAX_PEERS 4
#define MAX_SIZES 8
#define MAX_EVERY 6
#define MAX_REPS 21
#define MAX_BYTES ((uint64_t)1 << 30)
#define WARMUP 3                    /* rounds before timing */
#define GIVE_UP_MS 120000           /* no epoch of all members by then: a failure */

static const char usage[] =
    "Usage: cohortctl bench checkpoint [--peers N] [--bytes LIST] [--every LIST]\n"
    "                                  [--seconds S] [--reps R] [--writes W]\n"
    "                                  [--dir DIR] [-o json]\n"
    "\n"
    "Measures checkpoint writes (a whole file: temporary name, SHA-256,\n"
    "fsync, rename, directory fsync) in MiB/s, and rounds per second of N\n"
    "members (nodes in this process on loopback, float32 gradients as large\n"
    "as the parameters) with the leader checkpointing every E versions\n"
    "against none, in the same run: each repetition runs every setting in\n"
    "turn; the ratio is a setting's rounds/s over the run without\n"
    "checkpoints in the same repetition, median over repetitions.\n"
    "\n"
    "  --peers N      members (default 2, 2 to 4)\n"
    "  --bytes LIST   parameter sizes, comma-separated, K/M/G suffixes, each a\n"
    "                 multiple of 8 bytes up to 1G (default 64M)\n"
    "  --every LIST   checkpoint periods in versions to compare with none\n"
    "                 (default 1,10; at most 6)\n"
    "  --seconds S    timed seconds per run (default 8)\n"
    "  --reps R       repetitions (default 3)\n"
    "  --writes W     timed ckpt_write calls per size (default 5)\n"
    "  --dir DIR      where checkpoints go (default .: a real disk; /tmp may be\n"
    "                 memory); a directory of its own is made in it and removed\n"
    "  -o, --output   table (default) or json\n"
    "  -h, --help     show this text\n";

/* ---- write throughput ---- */

/* Removes the files in `dir` (checkpoints and temporary files: no
 * folders), then `dir`. */
static void remove_dir(const char *dir)
{
    DIR *d = opendir(dir);
    struct dirent *e;

    if (!d)
        return;
    while ((e = readdir(d)) != NULL)
        if (strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0)
            unlinkat(dirfd(d), e->d_name, 0);
    closedir(d);
    if (rmdir(dir) < 0)
        fprintf(stderr, "%s: could not remove %s: %s\n", PROG, dir, strerror(errno));
}

/* MiB/s of `writes` checkpoints of `bytes` of parameters: the median,
 * the lowest and the highest. */
static int bench_writes(const char *dir, size_t bytes, int writes, double *med, double *lo,
                        double *hi)
{
    struct ckpt_layout l = { .cohort = "bench", .params_bytes = bytes };
    struct ckpt_parts p = { .state = "", .state_len = 0 };
    double mibs[64];
    void *params = malloc(bytes);
    int rc = 0;

    if (!params)
        return -ENOMEM;
    /* Bytes that do not compress or dedupe: a filesystem gets no shortcut. */
    for (size_t i = 0; i < bytes / 8; i++)
        ((uint64_t *)params)[i] = (uint64_t)i * 0x9e3779b97f4a7c15ull;
    p.params = params;
    for (int k = 0; k < writes && rc == 0; k++) {
        uint64_t t0 = clock_now_us(), size = 0, us;

        p.version = (uint64_t)k + 1;
        rc = ckpt_write(dir, &l, &p, 2, &size);
        us = clock_now_us() - t0;
        mibs[k] = (double)size / (1 << 20) / ((double)(us ? us : 1) / 1e6);
    }
    free(params);
    if (rc < 0)
        return rc;
    *med = stats_median(mibs, writes);
    *lo = mibs[0];
    *hi = mibs[writes - 1];
    return 0;
}

/* ---- rounds with and without checkpoints ---- */

struct member {
    struct node *n;
    float *params, *grads, *results;
    size_t count;
    uint32_t peers;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    uint64_t views;             /* views published, under lock */
    atomic_bool stop;
    atomic_uint_fast64_t version;   /* once all members are in: the newest committed */
    atomic_bool ready;          /* in an epoch of all members, with state */
    int rc;
    pthread_t t;
};

/* The node's view changed: wake the member's loop (it reads the view
 * itself, outside the node's lock). */
static void on_view(void *arg, const struct node_view *v)
{
    struct member *m = arg;

    pthread_mutex_lock(&m->lock);
    m->views++;
    pthread_cond_signal(&m->cond);
    pthread_mutex_unlock(&m->lock);
}

/* moolib's loop: contribute batch 1 of zeros-plus-one, apply and zero the
 * result, answer state requests (a sync's, or a checkpoint's: then the
 * parameters are copied while this loop waits, as a trainer's would). */
static void *member_main(void *arg)
{
    struct member *m = arg;
    uint64_t seen = 0;

    while (!atomic_load(&m->stop)) {
        struct node_view v;
        bool acted = false;

        node_view(m->n, &v);
        if (v.connected && v.size == m->peers)
            atomic_store(&m->ready, true);
        if (v.wants_state) {
            node_set_state(m->n, "", 0);
            acted = true;
        }
        if (v.has_new_state) {
            void *s;
            size_t len;
            if (node_take_state(m->n, &s, &len) == 0)
                free(s);
            acted = true;
        }
        if (v.has_gradients) {
            for (size_t i = 0; i < m->count; i += 1024)
                m->params[i] -= m->results[i];  /* touch it, as an optimizer would */
            memset(m->grads, 0, m->count * sizeof(float));
            node_consume(m->n, v.rounds_committed);
            atomic_store(&m->version, v.model_version);
            acted = true;
        } else if (v.wants_gradients && v.size == m->peers) {
            m->grads[0] += 1.0f;
            node_contribute(m->n, 1);
            acted = true;
        }
        if (!acted) {
            struct timespec ts = clock_deadline(100);
            pthread_mutex_lock(&m->lock);
            if (m->views == seen)
                pthread_cond_timedwait(&m->cond, &m->lock, &ts);
            seen = m->views;
            pthread_mutex_unlock(&m->lock);
        }
    }
    return NULL;
}

struct run_result {
    double rounds_per_s;
    uint64_t written, failed;   /* checkpoints, by the leader */
    uint64_t bytes, us;         /* what those writes took, in the run */
};

/* One run: `peers` members, checkpoints every `every` versions into a
 * directory of its own under `dir` (0: none), timed for `seconds`. */
static int run_cohort(const char *dir, int peers, size_t bytes, uint64_t every, int seconds,
                      struct run_result *out)
{
    struct brokerd_config bc = { .listen = "127.0.0.1:0", .open = true };
    struct member m[MAX_PEERS];
    struct brokerd *b = NULL;
    char broker[64], cdir[600];
    uint64_t v0, v1, t0, t1, give_up;
    int rc = 0, started = 0;

    memset(m, 0, sizeof(m));
    memset(out, 0, sizeof(*out));
    snprintf(cdir, sizeof(cdir), "%s/every-%llu", dir, (unsigned long long)every);
    broker_config_default(&bc.broker);
    bc.broker.startup_hold_ms = 0;
    bc.broker.coalesce_ms = 10;
    if ((rc = brokerd_start(&bc, &b)) < 0)
        return rc;
    brokerd_declare(b, "bench", 0, 0);
    snprintf(broker, sizeof(broker), "127.0.0.1:%d", brokerd_port(b));
    for (int i = 0; i < peers; i++) {
        struct node_config c = { .broker = broker, .cohort = "bench", .host = "127.0.0.1",
                                 .virtual_batch_size = (uint64_t)peers,
                                 .on_view = on_view, .view_arg = &m[i] };
        struct node_tensors t;
        char id[16];

        snprintf(id, sizeof(id), "c-%d", i);
        c.id = id;
        if (every) {
            c.checkpoint_dir = cdir;
            c.checkpoint_every_versions = every;
            c.checkpoint_keep = 2;
        }
        m[i].count = bytes / 4;
        m[i].peers = (uint32_t)peers;
        pthread_mutex_init(&m[i].lock, NULL);
        clock_cond_init(&m[i].cond);
        m[i].params = aligned_alloc(64, bytes);
        m[i].grads = aligned_alloc(64, bytes);
        m[i].results = aligned_alloc(64, bytes);
        if (!m[i].params || !m[i].grads || !m[i].results) {
            rc = -ENOMEM;
            goto out;
        }
        memset(m[i].params, 0, bytes);
        memset(m[i].results, 0, bytes);
        if ((rc = node_start(&c, &m[i].n)) < 0)
            goto out;
        t = (struct node_tensors){ .params = m[i].params, .params_bytes = bytes,
                                   .grads = m[i].grads, .grad_count = m[i].count,
                                   .grad_type = DTYPE_F32, .results = m[i].results };
        if ((rc = node_register(m[i].n, &t)) < 0)
            goto out;
    }
    for (int i = 0; i < peers; i++, started++)
        pthread_create(&m[i].t, NULL, member_main, &m[i]);
    /* Every member in one epoch, then WARMUP rounds, then the clock. */
    give_up = clock_now_ms() + GIVE_UP_MS;
    for (int i = 0; i < peers; i++)
        while (!atomic_load(&m[i].ready) && clock_now_ms() < give_up)
            clock_sleep_ms(10);
    while (atomic_load(&m[0].version) < WARMUP && clock_now_ms() < give_up)
        clock_sleep_ms(5);
    if (clock_now_ms() >= give_up) {
        rc = -ETIMEDOUT;
        goto out;
    }
    v0 = atomic_load(&m[0].version);
    t0 = clock_now_us();
    clock_sleep_ms((uint32_t)seconds * 1000u);
    v1 = atomic_load(&m[0].version);
    t1 = clock_now_us();
    out->rounds_per_s = (double)(v1 - v0) / ((double)(t1 - t0) / 1e6);
    for (int i = 0; i < peers && every; i++) {
        struct node_checkpoints ck;
        node_checkpoints(m[i].n, &ck);
        out->written += ck.written;
        out->failed += ck.failed;
        out->bytes += ck.total_bytes;
        out->us += ck.total_us;
    }
out:
    for (int i = 0; i < started; i++)
        atomic_store(&m[i].stop, true);
    for (int i = 0; i < started; i++) {
        pthread_mutex_lock(&m[i].lock);
        pthread_cond_signal(&m[i].cond);
        pthread_mutex_unlock(&m[i].lock);
        pthread_join(m[i].t, NULL);
    }
    for (int i = 0; i < peers; i++) {
        node_stop(m[i].n);      /* finishes a write in progress */
        free(m[i].params);
        free(m[i].grads);
        free(m[i].results);
        pthread_mutex_destroy(&m[i].lock);
        pthread_cond_destroy(&m[i].cond);
    }
    brokerd_stop(b);
    if (every)
        remove_dir(cdir);
    return rc;
}

int cli_bench_checkpoint(int argc, char **argv)
{
    static const struct option longopts[] = {
        { "peers", required_argument, NULL, 'n' },
        { "bytes", required_argument, NULL, 'b' },
        { "every", required_argument, NULL, 'e' },
        { "seconds", required_argument, NULL, 's' },
        { "reps", required_argument, NULL, 'R' },
        { "writes", required_argument, NULL, 'w' },
        { "dir", required_argument, NULL, 'd' },
        { "output", required_argument, NULL, 'o' },
        { "help", no_argument, NULL, 'h' },
        { NULL, 0, NULL, 0 },
    };
    uint64_t sizes[MAX_SIZES], every[MAX_EVERY + 1] = { 0 }, v;
    size_t n_sizes = 0, n_every = 0;
    int peers = 2, seconds = 8, reps = 3, writes = 5, opt, status = 0, bad;
    const char *list = "64M", *every_list = "1,10", *output = "table", *parent = ".";
    char dir[512];
    bool json;

    optind = 1;
    while ((opt = opt_next(PROG, argc, argv, "o:h", longopts)) != -1) {
        switch (opt) {
        case 'n':
            if (opt_uint(optarg, 2, MAX_PEERS, &v) < 0)
                return opt_usage(PROG, "bad --peers \"%s\" (2 to %d)", optarg, MAX_PEERS);
            peers = (int)v;
            break;
        case 'b': list = optarg; break;
        case 'e': every_list = optarg; break;
        case 's':
            if (opt_uint(optarg, 1, 600, &v) < 0)
                return opt_usage(PROG, "bad --seconds \"%s\" (1 to 600)", optarg);
            seconds = (int)v;
            break;
        case 'R':
            if (opt_uint(optarg, 1, MAX_REPS, &v) < 0)
                return opt_usage(PROG, "bad --reps \"%s\" (1 to %d)", optarg, MAX_REPS);
            reps = (int)v;
            break;
        case 'w':
            if (opt_uint(optarg, 1, 64, &v) < 0)
                return opt_usage(PROG, "bad --writes \"%s\" (1 to 64)", optarg);
            writes = (int)v;
            break;
        case 'd': parent = optarg; break;
        case 'o': output = optarg; break;
        case 'h': fputs(usage, stdout); return 0;
        default: return OPT_EXIT_USAGE;
        }
    }
    if (opt_no_operands(PROG, argc, argv, optind))
        return OPT_EXIT_USAGE;
    if (opt_output(PROG, output, &json) != 0)
        return OPT_EXIT_USAGE;
    if (opt_bytes_list(list, MAX_BYTES, sizes, MAX_SIZES, &n_sizes) < 0)
        return opt_usage(PROG, "bad --bytes \"%s\" (at most %d sizes up to 1G, K M G suffixes)",
                         list, MAX_SIZES);
    for (size_t i = 0; i < n_sizes; i++)
        if (sizes[i] == 0 || sizes[i] % 8 != 0)
            return opt_usage(PROG, "bad --bytes \"%s\": each size a multiple of 8 bytes", list);
    /* every[0] = 0: the run without. */
    bad = opt_bytes_list(every_list, 1000000, every + 1, MAX_EVERY, &n_every);
    for (size_t i = 0; bad == 0 && i < n_every; i++)
        if (every[1 + i] == 0)
            bad = -EINVAL;
    if (bad < 0 || n_every == 0)
        return opt_usage(PROG, "bad --every \"%s\" (at most %d periods of 1 to 1000000 versions)",
                         every_list, MAX_EVERY);
    if (snprintf(dir, sizeof(dir), "%s/cohort-benchckpt-XXXXXX", parent) >= (int)sizeof(dir) ||
        !mkdtemp(dir))
        return opt_usage(PROG, "bad --dir \"%s\": cannot make a directory in it: %s", parent,
                         strerror(errno));
    log_set_level(LOG_ERROR);
    if (rpc_init() < 0) {
        remove_dir(dir);
        return 1;
    }
    for (size_t s = 0; s < n_sizes; s++) {
        size_t bytes = (size_t)sizes[s];
        double med, lo, hi, rps[MAX_EVERY + 1][MAX_REPS], ratio[MAX_EVERY + 1][MAX_REPS];
        uint64_t written[MAX_EVERY + 1] = { 0 }, failed[MAX_EVERY + 1] = { 0 };
        uint64_t wbytes[MAX_EVERY + 1] = { 0 }, wus[MAX_EVERY + 1] = { 0 };
        char wdir[600];
        int rc;

        snprintf(wdir, sizeof(wdir), "%s/writes", dir);
        if ((rc = ckpt_mkdirs(wdir)) < 0 || (rc = bench_writes(wdir, bytes, writes, &med, &lo, &hi)) < 0) {
            fprintf(stderr, "%s: writes of %zu bytes failed: %s\n", PROG, bytes, log_strerror(rc));
            status = 1;
            continue;
        }
        remove_dir(wdir);
        if (json)
            printf("{\"measure\":\"write\",\"bytes\":%zu,\"writes\":%d,\"mib_per_s\":%.1f,"
                   "\"min\":%.1f,\"max\":%.1f}\n", bytes, writes, med, lo, hi);
        else
            printf("checkpoint writes of %zu MiB (fsync): %.0f MiB/s median of %d (%.0f to %.0f)\n",
                   bytes >> 20, med, writes, lo, hi);
        fflush(stdout);
        for (int k = 0; k < reps && rc == 0; k++) {
            for (size_t e = 0; e <= n_every && rc == 0; e++) {
                struct run_result r;
                rc = run_cohort(dir, peers, bytes, every[e], seconds, &r);
                rps[e][k] = r.rounds_per_s;
                wbytes[e] += r.bytes;
                wus[e] += r.us;
                written[e] += r.written;
                failed[e] += r.failed;
            }
            for (size_t e = 0; e <= n_every && rc == 0; e++)
                ratio[e][k] = rps[0][k] > 0 ? rps[e][k] / rps[0][k] : 0;
        }
        if (rc < 0) {
            fprintf(stderr, "%s: rounds with %zu bytes failed: %s\n", PROG, bytes, log_strerror(rc));
            status = 1;
            continue;
        }
        if (!json)
            printf("%10s %5s %14s %10s %7s %10s %12s\n", "MiB", "peers", "checkpoint", "rounds/s",
                   "ratio", "written", "write MiB/s");
        for (size_t e = 0; e <= n_every; e++) {
            double r = stats_median(rps[e], reps), q = stats_median(ratio[e], reps);
            /* The writes of every repetition together. */
            double w = wus[e] ? (double)wbytes[e] / (1 << 20) / ((double)wus[e] / 1e6) : 0;
            char label[32];

            if (every[e])
                snprintf(label, sizeof(label), "every %llu", (unsigned long long)every[e]);
            else
                snprintf(label, sizeof(label), "none");
            if (json)
                printf("{\"measure\":\"rounds\",\"bytes\":%zu,\"peers\":%d,\"every\":%llu,"
                       "\"rounds_per_s\":%.2f,\"ratio\":%.3f,\"written\":%llu,\"failed\":%llu,"
                       "\"write_mib_per_s\":%.1f,\"reps\":%d,\"seconds\":%d}\n",
                       bytes, peers, (unsigned long long)every[e], r, q,
                       (unsigned long long)written[e], (unsigned long long)failed[e], w, reps,
                       seconds);
            else
                printf("%10zu %5d %14s %10.2f %7.3f %10llu %12.0f\n", bytes >> 20, peers, label, r,
                       q, (unsigned long long)written[e], w);
            if (failed[e])
                status = 1;
        }
        fflush(stdout);
    }
    rpc_shutdown();
    remove_dir(dir);
    return status;
}

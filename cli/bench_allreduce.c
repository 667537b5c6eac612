/* cli/bench_allreduce.c: `cohortctl bench allreduce`: N local members, each
 * its own process as real sidecars are, all-reduce over loopback TCP with
 * the data plane engine, timed per size. Reports time per all-reduce,
 * algbw = S/t and busbw = algbw * 2(N-1)/N, as nccl-tests defines them. */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "engine/allreduce.h"
#include "cli.h"
#include "base/clock.h"
#include "engine/dtype.h"
#include "engine/powersgd.h"
#include "engine/topk.h"
#include "membership/epoch.h"
#include "base/log.h"
#include "base/opt.h"
#include "base/secret.h"

#define PROG "cohortctl bench allreduce"
#define MAX_PEERS 64
#define MAX_SIZES 32
#define MAX_BENCH_BYTES ((uint64_t)4 << 30)
#define MAX_RENDEZVOUS_PATH 4096
#define RENDEZVOUS_POLL_MS 10

static const char usage[] =
    "Usage: cohortctl bench allreduce --peers N [options]\n"
    "\n"
    "Starts N members on this machine, each its own process with its own\n"
    "listener on 127.0.0.1, forms one epoch by hand and times in-place\n"
    "all-reduces for each size. Prints per size: peers, bytes, time_ms (mean\n"
    "per all-reduce, slowest member), algbw_gbs (bytes/time), busbw_gbs\n"
    "(algbw * 2(N-1)/N), in GB/s of 10^9 bytes, as nccl-tests does, the\n"
    "integrity setting, the codec, and wire_bytes: the payload bytes one\n"
    "member sends per all-reduce, 2(N-1) chunks of bytes/N through the codec\n"
    "(frame headers left out; both algorithms send about that, the ring\n"
    "exactly that). busbw counts the uncompressed bytes, so a codec's\n"
    "gain shows as a higher busbw. topk and powersgd time the whole round\n"
    "(selection or matrix products, the exchange, the error feedback); their\n"
    "wire_bytes are those of their exchanges: topk all-gathers k pairs of 8\n"
    "bytes per member as an all-reduce of N blocks, 2(N-1) x 8k; powersgd\n"
    "all-reduces P and Q of a rows x cols view (rows the power of two nearest\n"
    "the square root), 2(N-1)/N x 4 x (rows + cols) x rank.\n"
    "\n"
    "  --peers N          members (default 2, at most 64)\n"
    "  --bytes SIZE       buffer size; K, M, G suffixes (powers of 1024); may be\n"
    "                     repeated or a comma list (default 4K,64K,1M,16M,64M)\n"
    "  --dtype T          f32 (default), f64, f16, bf16, i32, i64\n"
    "  --op OP            sum (default), avg, min, max\n"
    "  --iters K          timed all-reduces per size (default: 1G/size, 10..1000)\n"
    "  --warmup K         untimed all-reduces before them (default: iters/10, >= 2)\n"
    "  --segment SIZE     ring segment size (default: the engine's)\n"
    "  --small SIZE|none  recursive-doubling threshold (default: the engine's)\n"
    "  --timeout DUR      member timeout (default 30s)\n"
    "  --integrity none|mac  none (default): members prove a key (generated for\n"
    "                     the run) when they connect; mac: every frame carries\n"
    "                     a MAC too, as cohort-sidecar --integrity mac\n"
    "  --codec C          none (default), fp16, bf16, int8, meanstd16, uniform8\n"
    "                     or quantile8:\n"
    "                     payloads on the wire encoded, float32 accumulation\n"
    "                     (f32 only); topk or\n"
    "                     powersgd: compression with error feedback (f32, sum or\n"
    "                     avg)\n"
    "  --topk-ratio R     topk: the share of entries sent, in (0, 1] (default 0.01)\n"
    "  --rank R           powersgd: the rank (default 4)\n"
    "  -o, --output FMT   table (default) or json (one object per line)\n"
    "  -h, --help         show this text\n"
    "\n"
    "One member per process (each in its own network namespace, say, so that\n"
    "its traffic crosses a link of its own):\n"
    "  --member I         run member I (0..N-1) of the --peers N alone here and\n"
    "                     print its own times (a table then takes the slowest)\n"
    "  --rendezvous DIR   a new, empty directory every member of this run can\n"
    "                     reach (a stale address there is dialled): member I writes\n"
    "                     its address to DIR/addr.I and waits (--timeout) for the\n"
    "                     others'; DIR/done.I marks its last all-reduce, so that\n"
    "                     no member leaves while a peer still reads from it\n"
    "  --host ADDR        the numeric address member I listens on (default\n"
    "                     127.0.0.1), on a port the kernel picks\n"
    "  --key-file PATH    the key every member proves (64 hex digits)\n";

struct bench {
    size_t peers;
    uint64_t sizes[MAX_SIZES];
    size_t n_sizes;
    enum dtype type;
    enum dtype_op op;
    uint64_t iters, warmup;
    size_t segment, small;
    uint64_t timeout_ms;
    bool json;
    bool integrity;
    enum codec codec;
    enum method { METHOD_CODEC, METHOD_TOPK, METHOD_POWERSGD } method;
    double topk_ratio;
    size_t rank;
    struct secret key;          /* generated for the run, or --key-file's */
    long member;                /* --member, or -1: every member, forked here */
    const char *rendezvous;     /* --member's directory (argv's) */
    const char *host;           /* --member's listening address (argv's) */
    const char *key_file;       /* --member's key (argv's) */
    int listen_fds[MAX_PEERS];
    char addrs[MAX_PEERS][64];
    char ids[MAX_PEERS][24];
};

/* One member's report for one size. */
struct result {
    int rc;
    double mean_ms;
};

static uint64_t iters_for(const struct bench *b, uint64_t bytes)
{
    uint64_t k = ((uint64_t)1 << 30) / bytes;

    if (b->iters)
        return b->iters;
    return k < 10 ? 10 : k > 1000 ? 1000 : k;
}

static uint64_t warmup_for(const struct bench *b, uint64_t bytes)
{
    uint64_t k = iters_for(b, bytes) / 10;

    if (b->warmup)
        return b->warmup;
    return k < 2 ? 2 : k;
}

static bool write_all(int fd, const void *p, size_t len)
{
    const char *c = p;

    while (len > 0) {
        ssize_t w = write(fd, c, len);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return false;
        c += w;
        len -= (size_t)w;
    }
    return true;
}

static bool read_all(int fd, void *p, size_t len)
{
    char *c = p;

    while (len > 0) {
        ssize_t r = read(fd, c, len);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return false;
        c += r;
        len -= (size_t)r;
    }
    return true;
}

static void fill(void *buf, enum dtype t, size_t count, size_t me)
{
    for (size_t i = 0; i < count; i++) {
        double v = (double)((i + me) % 7);
        switch (t) {
        case DTYPE_F32: ((float *)buf)[i] = (float)v; break;
        case DTYPE_F64: ((double *)buf)[i] = v; break;
        case DTYPE_F16: ((uint16_t *)buf)[i] = dtype_f32_to_f16((float)v); break;
        case DTYPE_BF16: ((uint16_t *)buf)[i] = dtype_f32_to_bf16((float)v); break;
        case DTYPE_I32: ((int32_t *)buf)[i] = (int32_t)v; break;
        case DTYPE_I64: ((int64_t *)buf)[i] = (int64_t)v; break;
        }
    }
}

/* The matrix powersgd views `count` floats as: rows the power of two
 * nearest sqrt(count) that divides it (1 at worst), cols the rest. */
static void matrix_shape(size_t count, size_t *rows, size_t *cols)
{
    size_t r = 1;

    while (r * r * 4 <= count && count % (r * 2) == 0)
        r *= 2;
    *rows = r;
    *cols = count / r;
}

/* One timed step of the method in use: a codec's all-reduce, or a round
 * of top-k or PowerSGD on their reducers (made per size). */
static int step(struct bench *b, struct allreduce *ar, int h, void *buf, size_t count,
                struct topk *tk, struct powersgd *ps, uint64_t *round)
{
    switch (b->method) {
    case METHOD_TOPK:
        return topk_reduce(tk, buf, b->op, ++*round);
    case METHOD_POWERSGD:
        *round += POWERSGD_ROUNDS;
        return powersgd_reduce(ps, buf, b->op, *round);
    case METHOD_CODEC:
        break;
    }
    return allreduce_run_codec(ar, h, h, count, b->type, b->op, 1, b->codec, ++*round);
}

static void print_row(const struct bench *b, uint64_t bytes, double ms);
static int rendezvous_barrier(const struct bench *b);

/* A member: runs every size. Forked (out >= 0): writes one struct result
 * per size to `out`, then waits for the parent to read them all. Alone
 * (out < 0, --member): prints its own row per size, then waits at the
 * rendezvous for every member's last all-reduce. Either way no member
 * leaves while a peer may still read from it. Returns 0 or the first
 * failure's -errno. */
static int member_run(struct bench *b, struct epoch *e, size_t me, int out)
{
    struct allreduce_config cfg = { .cohort = "bench", .member_id = b->ids[me],
                                    .listen_fd = b->listen_fds[me],
                                    .member_timeout_ms = (uint32_t)b->timeout_ms,
                                    .segment_bytes = b->segment, .small_bytes = b->small,
                                    .key = &b->key, .integrity_mac = b->integrity };
    struct allreduce *ar = NULL;
    uint64_t max = 0, round = 0;
    void *buf = NULL;
    int h, rc;

    for (size_t i = 0; i < b->n_sizes; i++)
        max = b->sizes[i] > max ? b->sizes[i] : max;
    rc = allreduce_create(&cfg, &ar);
    if (rc == 0)
        rc = allreduce_set_epoch(ar, e);
    if (rc == 0 && posix_memalign(&buf, 64, max) != 0)
        rc = -ENOMEM;
    h = rc == 0 ? allreduce_register(ar, buf, max) : rc;
    if (h < 0)
        rc = h;
    for (size_t i = 0; i < b->n_sizes; i++) {
        struct result r = { .rc = rc };
        size_t count = b->sizes[i] / dtype_size(b->type), kk, rows, cols;
        uint64_t k = iters_for(b, b->sizes[i]), w = warmup_for(b, b->sizes[i]), t0;
        struct topk *tk = NULL;
        struct powersgd *ps = NULL;

        if (r.rc == 0 && b->method == METHOD_TOPK) {
            r.rc = topk_k_for_ratio(count, b->topk_ratio, &kk);
            if (r.rc == 0)
                r.rc = topk_create(ar, count, kk, &tk);
        } else if (r.rc == 0 && b->method == METHOD_POWERSGD) {
            matrix_shape(count, &rows, &cols);
            r.rc = powersgd_create(ar, rows, cols, b->rank, 1, &ps);
        }
        if (r.rc == 0) {
            fill(buf, b->type, count, me);
            for (uint64_t j = 0; j < w && r.rc == 0; j++)
                r.rc = step(b, ar, h, buf, count, tk, ps, &round);
            t0 = clock_now_us();
            for (uint64_t j = 0; j < k && r.rc == 0; j++)
                r.rc = step(b, ar, h, buf, count, tk, ps, &round);
            r.mean_ms = (double)(clock_now_us() - t0) / 1000.0 / (double)k;
        }
        topk_destroy(tk);
        powersgd_destroy(ps);
        rc = r.rc;
        if (out < 0 && rc == 0) {
            print_row(b, b->sizes[i] / dtype_size(b->type) * dtype_size(b->type), r.mean_ms);
        } else if (out < 0) {
            fprintf(stderr, "cohortctl bench allreduce: member %zu: %" PRIu64 " bytes failed: %s\n",
                    me, b->sizes[i], log_strerror(rc));
            break;
        } else if (!write_all(out, &r, sizeof(r))) {
            break;
        }
    }
    /* The parent reads every size before any member leaves, so that no one
     * sees a peer close in the middle of its last all-reduce. */
    if (out >= 0) {
        char c;
        if (read(out, &c, 1) < 0) {
            /* parent gone: leave anyway */
        }
    } else if (rc == 0) {
        rc = rendezvous_barrier(b);
    }
    allreduce_destroy(ar);
    free(buf);
    return rc;
}

static void print_row(const struct bench *b, uint64_t bytes, double ms)
{
    double algbw = (double)bytes / (ms / 1000.0) / 1e9;
    double busbw = algbw * 2.0 * (double)(b->peers - 1) / (double)b->peers;

    const char *integrity = b->integrity ? "mac" : "none";
    const char *codec = codec_name(b->codec);
    size_t count = bytes / dtype_size(b->type), k = 0, rows, cols;
    uint64_t wire = b->peers < 2 ? 0
                    : 2 * (b->peers - 1) *
                          (b->codec == CODEC_NONE ? bytes / b->peers
                                                  : codec_bytes(b->codec, count / b->peers));

    if (b->method == METHOD_TOPK) {
        codec = "topk";
        if (topk_k_for_ratio(count, b->topk_ratio, &k) < 0)
            k = 0;
        wire = b->peers < 2 ? 0 : 2 * (b->peers - 1) * (uint64_t)k * TOPK_PAIR_BYTES;
    } else if (b->method == METHOD_POWERSGD) {
        size_t r = b->rank;

        codec = "powersgd";
        matrix_shape(count, &rows, &cols);
        r = r < rows ? r : rows;
        r = r < cols ? r : cols;
        wire = 2 * (b->peers - 1) * (uint64_t)(rows + cols) * r * sizeof(float) / b->peers;
    }

    if (b->json)
        printf("{\"peers\":%zu,\"bytes\":%" PRIu64 ",\"time_ms\":%.4f,\"algbw_gbs\":%.4f,"
               "\"busbw_gbs\":%.4f,\"integrity\":\"%s\",\"codec\":\"%s\","
               "\"wire_bytes\":%" PRIu64 "}\n",
               b->peers, bytes, ms, algbw, busbw, integrity, codec, wire);
    else
        printf("%6zu %12" PRIu64 " %11.4f %10.3f %10.3f %9s %5s %12" PRIu64 "\n", b->peers, bytes,
               ms, algbw, busbw, integrity, codec, wire);
    fflush(stdout);
}

static void sleep_ms(unsigned ms)
{
    struct timespec ts = { .tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L };

    while (nanosleep(&ts, &ts) < 0 && errno == EINTR) {
    }
}

/* Writes `text` to DIR/NAME.I through a temporary name and a rename, so a
 * reader sees the whole of it or nothing. Returns 0 or -errno. */
static int rendezvous_put(const struct bench *b, const char *name, const char *text)
{
    char tmp[MAX_RENDEZVOUS_PATH], path[MAX_RENDEZVOUS_PATH];
    size_t len = strlen(text);
    FILE *f;
    int rc = 0;

    snprintf(tmp, sizeof(tmp), "%s/.%s.%ld.tmp", b->rendezvous, name, b->member);
    snprintf(path, sizeof(path), "%s/%s.%ld", b->rendezvous, name, b->member);
    f = fopen(tmp, "we");
    if (!f)
        return -errno;
    if (fwrite(text, 1, len, f) != len)
        rc = -EIO;
    if (fclose(f) != 0 && rc == 0)
        rc = -errno;
    if (rc == 0 && rename(tmp, path) < 0)
        rc = -errno;
    if (rc < 0)
        unlink(tmp);
    return rc;
}

/* Waits until DIR/NAME.I exists, up to the member timeout from `start`,
 * and reads it into out (cap bytes with its NUL). Whatever another
 * process wrote there is input: a file that does not fit, or holds
 * anything but printable characters, is refused. Returns 0, -ETIMEDOUT,
 * -EINVAL (refused), or -errno. */
static int rendezvous_get(const struct bench *b, const char *name, size_t i, uint64_t start,
                          char *out, size_t cap)
{
    char path[MAX_RENDEZVOUS_PATH];
    FILE *f;
    size_t n;

    snprintf(path, sizeof(path), "%s/%s.%zu", b->rendezvous, name, i);
    while (!(f = fopen(path, "re"))) {
        if (errno != ENOENT)
            return -errno;
        if (clock_now_us() - start > b->timeout_ms * 1000)
            return -ETIMEDOUT;
        sleep_ms(RENDEZVOUS_POLL_MS);
    }
    n = fread(out, 1, cap, f);
    fclose(f);
    if (n >= cap)
        return -EINVAL;
    out[n] = '\0';
    for (size_t j = 0; j < n; j++)
        if (out[j] < 0x21 || out[j] > 0x7e)
            return -EINVAL;
    return 0;
}

/* Marks this member's last all-reduce done and waits for every other's. */
static int rendezvous_barrier(const struct bench *b)
{
    uint64_t start = clock_now_us();
    char ignored[8];
    int rc = rendezvous_put(b, "done", "done");

    for (size_t i = 0; i < b->peers && rc == 0; i++)
        rc = rendezvous_get(b, "done", i, start, ignored, sizeof(ignored));
    if (rc < 0)
        fprintf(stderr, "cohortctl bench allreduce: member %ld: waiting for the others to finish: %s\n",
                b->member, log_strerror(rc));
    return rc;
}

/* --member: this process is one member. Listens on --host, publishes the
 * address, learns the others' from the rendezvous, forms the same epoch
 * as they do (ids p-0..p-N-1 in order) and runs. Returns the exit status. */
static int member_alone(struct bench *b)
{
    struct epoch_member members[MAX_PEERS];
    struct epoch *e = NULL;
    size_t me = (size_t)b->member;
    uint64_t start = clock_now_us();
    int rc;

    rc = allreduce_listen(b->host ? b->host : "127.0.0.1", &b->listen_fds[me], b->addrs[me],
                          sizeof(b->addrs[me]));
    if (rc < 0) {
        fprintf(stderr, "cohortctl bench allreduce: cannot listen on %s: %s\n",
                b->host ? b->host : "127.0.0.1", log_strerror(rc));
        return 1;
    }
    rc = rendezvous_put(b, "addr", b->addrs[me]);
    for (size_t i = 0; i < b->peers && rc == 0; i++) {
        snprintf(b->ids[i], sizeof(b->ids[i]), "p-%zu", i);
        if (i != me)
            rc = rendezvous_get(b, "addr", i, start, b->addrs[i], sizeof(b->addrs[i]));
        members[i] = (struct epoch_member){ .id = b->ids[i], .address = b->addrs[i] };
    }
    if (rc < 0) {
        fprintf(stderr, "cohortctl bench allreduce: member %zu: rendezvous in %s: %s\n", me,
                b->rendezvous, log_strerror(rc));
        goto out;
    }
    rc = epoch_create("bench", 1, 0, members, b->peers, &e);
    if (rc < 0) {
        fprintf(stderr, "cohortctl bench allreduce: member %zu: %s\n", me, log_strerror(rc));
        goto out;
    }
    if (!b->json)
        printf("%6s %12s %11s %10s %10s %9s %5s %12s\n", "peers", "bytes", "time_ms", "algbw_gbs",
               "busbw_gbs", "integrity", "codec", "wire_bytes");
    rc = member_run(b, e, me, -1);
    epoch_unref(e);
out:
    close(b->listen_fds[me]);
    return rc == 0 ? 0 : 1;
}

/* Fills *b from the command line. Returns 0 to run, 1 after --help, or
 * OPT_EXIT_USAGE after reporting a usage error. */
static int parse_args(struct bench *b, int argc, char **argv)
{
    static const struct option opts[] = {
        { "peers", required_argument, NULL, 'n' },   { "bytes", required_argument, NULL, 'b' },
        { "dtype", required_argument, NULL, 'd' },   { "op", required_argument, NULL, 'p' },
        { "iters", required_argument, NULL, 'k' },   { "warmup", required_argument, NULL, 'w' },
        { "segment", required_argument, NULL, 's' }, { "small", required_argument, NULL, 'S' },
        { "timeout", required_argument, NULL, 't' }, { "output", required_argument, NULL, 'o' },
        { "integrity", required_argument, NULL, 'I' }, { "help", no_argument, NULL, 'h' },
        { "codec", required_argument, NULL, 'C' },
        { "topk-ratio", required_argument, NULL, 'R' }, { "rank", required_argument, NULL, 'r' },
        { "member", required_argument, NULL, 'M' }, { "rendezvous", required_argument, NULL, 'D' },
        { "host", required_argument, NULL, 'H' }, { "key-file", required_argument, NULL, 'K' },
        { NULL, 0, NULL, 0 },
    };
    const struct option *o;
    uint64_t v;
    int c;

    optind = 1;
    while ((c = opt_next(PROG, argc, argv, "o:h", opts)) != -1) {
        switch (c) {
        case 'n':
            if (opt_uint(optarg, 1, MAX_PEERS, &v) < 0)
                goto bad;
            b->peers = (size_t)v;
            break;
        case 'b':
            if (opt_bytes_list(optarg, MAX_BENCH_BYTES, b->sizes, MAX_SIZES, &b->n_sizes) < 0)
                goto bad;
            break;
        case 'd':
            if (dtype_parse(optarg, &b->type) < 0)
                goto bad;
            break;
        case 'p':
            if (dtype_parse_op(optarg, &b->op) < 0 || b->op == DTYPE_AVG_BY)
                goto bad;
            break;
        case 'k':
            if (opt_uint(optarg, 1, 1000000, &b->iters) < 0)
                goto bad;
            break;
        case 'w':
            if (opt_uint(optarg, 1, 1000000, &b->warmup) < 0)
                goto bad;
            break;
        case 's':
            if (opt_bytes(optarg, MAX_BENCH_BYTES, &v) < 0 || v % 8 != 0)
                goto bad;
            b->segment = (size_t)v;
            break;
        case 'S':
            if (strcmp(optarg, "none") == 0)
                b->small = ALLREDUCE_SMALL_NONE;
            else if (opt_bytes(optarg, MAX_BENCH_BYTES, &v) < 0)
                goto bad;
            else
                b->small = (size_t)v;
            break;
        case 't':
            if (opt_duration_ms(optarg, 3600000, &b->timeout_ms) < 0 || b->timeout_ms == 0)
                goto bad;
            break;
        case 'I':
            if (strcmp(optarg, "none") != 0 && strcmp(optarg, "mac") != 0)
                goto bad;
            b->integrity = strcmp(optarg, "mac") == 0;
            break;
        case 'C':
            b->method = strcmp(optarg, "topk") == 0       ? METHOD_TOPK
                        : strcmp(optarg, "powersgd") == 0 ? METHOD_POWERSGD
                                                          : METHOD_CODEC;
            if (b->method == METHOD_CODEC && codec_parse(optarg, &b->codec) < 0)
                goto bad;
            if (b->method != METHOD_CODEC)
                b->codec = CODEC_NONE;
            break;
        case 'R': {
            char *end;

            errno = 0;
            b->topk_ratio = strtod(optarg, &end);
            if (errno || end == optarg || *end || !(b->topk_ratio > 0 && b->topk_ratio <= 1))
                goto bad;
            break;
        }
        case 'r':
            if (opt_uint(optarg, 1, POWERSGD_MAX_RANK, &v) < 0)
                goto bad;
            b->rank = (size_t)v;
            break;
        case 'M':
            if (opt_uint(optarg, 0, MAX_PEERS - 1, &v) < 0)
                goto bad;
            b->member = (long)v;
            break;
        case 'D':
            if (!*optarg || strlen(optarg) > MAX_RENDEZVOUS_PATH - 32)
                goto bad;
            b->rendezvous = optarg;
            break;
        case 'H':
            b->host = optarg;
            break;
        case 'K':
            b->key_file = optarg;
            break;
        case 'o':
            if (strcmp(optarg, "json") == 0)
                b->json = true;
            else if (strcmp(optarg, "table") != 0)
                goto bad;
            break;
        case 'h':
            fputs(usage, stdout);
            return 1;
        default:
            return OPT_EXIT_USAGE;
        }
    }
    if (!codec_supports(b->codec, b->type))
        return opt_usage(PROG, "--codec %s needs --dtype f32", codec_name(b->codec));
    if (b->method != METHOD_CODEC &&
        (b->type != DTYPE_F32 || (b->op != DTYPE_SUM && b->op != DTYPE_AVG)))
        return opt_usage(PROG, "--codec %s needs --dtype f32 and --op sum or avg",
                         b->method == METHOD_TOPK ? "topk" : "powersgd");
    if (b->member >= 0 && (!b->rendezvous || !b->key_file))
        return opt_usage(PROG, "--member needs --rendezvous and --key-file");
    if (b->member < 0 && (b->rendezvous || b->key_file || b->host))
        return opt_usage(PROG, "--rendezvous, --key-file and --host go with --member");
    if (b->member >= (long)b->peers)
        return opt_usage(PROG, "--member %ld is not below --peers %zu", b->member, b->peers);
    return opt_no_operands(PROG, argc, argv, optind);
bad:
    for (o = opts; o->name && o->val != c; o++)
        ;
    return opt_usage(PROG, "bad --%s \"%s\"", o->name, optarg);
}

int cli_bench_allreduce(int argc, char **argv)
{
    struct bench b = { .peers = 2, .type = DTYPE_F32, .op = DTYPE_SUM, .timeout_ms = 30000,
                       .topk_ratio = 0.01, .rank = 4, .member = -1 };
    struct epoch_member members[MAX_PEERS];
    struct epoch *e = NULL;
    pid_t pids[MAX_PEERS];
    int pipes[MAX_PEERS][2];
    size_t started = 0;
    int rc, status = 1;

    rc = parse_args(&b, argc, argv);
    if (rc != 0)
        return rc == 1 ? 0 : rc;
    if (b.n_sizes == 0) {
        static const uint64_t defaults[] = { 4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20 };
        memcpy(b.sizes, defaults, sizeof(defaults));
        b.n_sizes = sizeof(defaults) / sizeof(defaults[0]);
    }
    for (size_t i = 0; i < b.n_sizes; i++)
        if (b.sizes[i] < dtype_size(b.type))
            return opt_usage(PROG, "%" PRIu64 " bytes hold no %s element", b.sizes[i],
                             dtype_name(b.type));
    log_set_level(LOG_WARN);
    if (b.member >= 0) {
        rc = secret_load(b.key_file, &b.key);
        if (rc < 0) {
            fprintf(stderr, "cohortctl bench allreduce: %s: %s\n", b.key_file, log_strerror(rc));
            return 1;
        }
        status = member_alone(&b);
        secret_wipe(&b.key);
        return status;
    }
    rc = secret_generate(&b.key);
    if (rc < 0) {
        fprintf(stderr, "cohortctl bench allreduce: cannot make a key: %s\n", log_strerror(rc));
        return 1;
    }
    /* Listeners first, in the parent, so every member knows every address
     * before any of them starts, and no port is raced. */
    for (size_t i = 0; i < b.peers; i++) {
        snprintf(b.ids[i], sizeof(b.ids[i]), "p-%zu", i);
        rc = allreduce_listen("127.0.0.1", &b.listen_fds[i], b.addrs[i], sizeof(b.addrs[i]));
        if (rc < 0) {
            fprintf(stderr, "cohortctl bench allreduce: cannot listen: %s\n", log_strerror(rc));
            for (size_t j = 0; j < i; j++)
                close(b.listen_fds[j]);
            return 1;
        }
        members[i] = (struct epoch_member){ .id = b.ids[i], .address = b.addrs[i] };
    }
    rc = epoch_create("bench", 1, 0, members, b.peers, &e);
    if (rc < 0) {
        fprintf(stderr, "cohortctl bench allreduce: %s\n", log_strerror(rc));
        goto out_listeners;
    }
    /* Members are forked before this process starts any thread. */
    for (; started < b.peers; started++) {
        size_t i = started;

        if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pipes[i]) < 0)
            goto out_children;
        pids[i] = fork();
        if (pids[i] < 0) {
            close(pipes[i][0]);
            close(pipes[i][1]);
            goto out_children;
        }
        if (pids[i] == 0) {
            for (size_t j = 0; j < b.peers; j++)
                if (j != i)
                    close(b.listen_fds[j]);
            for (size_t j = 0; j <= i; j++)
                close(pipes[j][0]);
            _exit(member_run(&b, e, i, pipes[i][1]) == 0 ? 0 : 1);
        }
        close(pipes[i][1]);
    }
    if (!b.json)
        printf("%6s %12s %11s %10s %10s %9s %5s %12s\n", "peers", "bytes", "time_ms", "algbw_gbs",
               "busbw_gbs", "integrity", "codec", "wire_bytes");
    status = 0;
    for (size_t s = 0; s < b.n_sizes; s++) {
        double worst = 0;
        int err = 0;

        for (size_t i = 0; i < b.peers; i++) {
            struct result r;

            if (!read_all(pipes[i][0], &r, sizeof(r)))
                r.rc = -ECONNRESET;
            if (r.rc != 0 && err == 0)
                err = r.rc;
            worst = r.mean_ms > worst ? r.mean_ms : worst;
        }
        if (err) {
            fprintf(stderr, "cohortctl bench allreduce: %" PRIu64 " bytes failed: %s\n",
                    b.sizes[s], log_strerror(err));
            status = 1;
            break;
        }
        print_row(&b, b.sizes[s] / dtype_size(b.type) * dtype_size(b.type), worst);
    }
out_children:
    for (size_t i = 0; i < started; i++) {
        if (status != 0)
            kill(pids[i], SIGKILL);
        close(pipes[i][0]);     /* lets the member leave */
    }
    for (size_t i = 0; i < started; i++) {
        int ws;
        while (waitpid(pids[i], &ws, 0) < 0 && errno == EINTR) {
        }
        if (status == 0 && !(WIFEXITED(ws) && WEXITSTATUS(ws) == 0))
            status = 1;
    }
    if (started < b.peers) {
        fprintf(stderr, "cohortctl bench allreduce: cannot start members: %s\n", strerror(errno));
        status = 1;
    }
    epoch_unref(e);
out_listeners:
    for (size_t i = 0; i < b.peers; i++)
        close(b.listen_fds[i]);
    secret_wipe(&b.key);
    return status;
}

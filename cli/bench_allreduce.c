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
    "  --codec C          none (default), fp16, bf16 or int8: payloads on the\n"
    "                     wire encoded, float32 accumulation (f32 only); topk or\n"
    "                     powersgd: compression with error feedback (f32, sum or\n"
    "                     avg)\n"
    "  --topk-ratio R     topk: the share of entries sent, in (0, 1] (default 0.01)\n"
    "  --rank R           powersgd: the rank (default 4)\n"
    "  -o, --output FMT   table (default) or json (one object per line)\n"
    "  -h, --help         show this text\n";

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
    struct secret key;          /* generated for the run */
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

/* A member: runs every size and writes one struct result per size to
 * `out`. Runs in a forked child; never returns. */
static void member_main(struct bench *b, struct epoch *e, size_t me, int out)
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
        if (!write_all(out, &r, sizeof(r)))
            break;
        rc = r.rc;
    }
    /* The parent reads every size before any member leaves, so that no one
     * sees a peer close in the middle of its last all-reduce. */
    {
        char c;
        if (read(out, &c, 1) < 0) {
            /* parent gone: leave anyway */
        }
    }
    allreduce_destroy(ar);
    free(buf);
    _exit(rc == 0 ? 0 : 1);
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
    return opt_no_operands(PROG, argc, argv, optind);
bad:
    for (o = opts; o->name && o->val != c; o++)
        ;
    return opt_usage(PROG, "bad --%s \"%s\"", o->name, optarg);
}

int cli_bench_allreduce(int argc, char **argv)
{
    struct bench b = { .peers = 2, .type = DTYPE_F32, .op = DTYPE_SUM, .timeout_ms = 30000,
                       .topk_ratio = 0.01, .rank = 4 };
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
            member_main(&b, e, i, pipes[i][1]);
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

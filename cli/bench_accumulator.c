/* cli/bench_accumulator.c: `cohortctl bench accumulator`: what the
 * Accumulator adds on top of the engine. In one run and one process, N
 * engines average a buffer directly (the result the Accumulator hands
 * over when each member contributes once) and zero it, then N trainers
 * do the same rounds through the trainer API and sidecar services on Unix
 * sockets (counters, gradient step, shared memory, the trainer link),
 * against an embedded broker. Prints both times per round, their ratio
 * and the time added; with --trace, where the Accumulator's time goes
 * (node.h, node_stage). */
#include <errno.h>
#include <getopt.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "engine/allreduce.h"
#include "membership/brokerd.h"
#include "cli.h"
#include "stats.h"
#include "base/clock.h"
#include "cohort.h"
#include "base/log.h"
#include "base/opt.h"
#include "base/secret.h"
#include "rpc/rpc.h"
#include "accumulator/node.h"
#include "accumulator/trainerd.h"

#define PROG "cohortctl bench accumulator"
#define MAX_PEERS 8
#define WARMUP 3
#define MAX_REPS 51
#define MAX_SIZES 16
#define MAX_BYTES ((uint64_t)1 << 30)
#define GIVE_UP_MS 120000         /* a round that takes this long is a failure, not a figure */
#define TRACE_ROWS 65536          /* rounds traced per size, at most (4 MiB) */

static const char usage[] =
    "Usage: cohortctl bench accumulator [--peers N] [--bytes LIST] [--rounds K]\n"
    "                                   [--reps R] [--pin] [--trace] [-o json]\n"
    "\n"
    "Times one round of the Accumulator (reduce_gradients through a sidecar\n"
    "service until the result is there, then zero_gradients, as a trainer\n"
    "sees it) against one averaging all-reduce (AVG) of the same buffer by\n"
    "the engine alone, which gives the same result when each member\n"
    "contributes once, followed by a memset of it (the zeroing any trainer\n"
    "pays to start its next batch), in the same run. float32 gradients.\n"
    "The engine is timed twice: in place, as a trainer's own all-reduce\n"
    "runs, and out of place (from one buffer into another, the memset on\n"
    "the first), as the Accumulator runs it so that a step that fails leaves\n"
    "the gradients for its retry: the columns \"into ms\" and \"vs into\". Each\n"
    "repetition times the engine both ways and then the Accumulator; the figures\n"
    "are the medians over repetitions, the ratio the median of each\n"
    "repetition's ratio, so that a busy moment on a shared machine skews one\n"
    "repetition only.\n"
    "\n"
    "  --peers N      members (default 2, at most 8)\n"
    "  --bytes LIST   gradient sizes, comma-separated, K/M/G suffixes; each a\n"
    "                 multiple of 4 bytes up to 1G, at most 16 of them\n"
    "                 (default 4K,64M)\n"
    "  --rounds K     timed rounds per repetition (default 20; 3 more warm up)\n"
    "  --reps R       repetitions (default 5)\n"
    "  --pin          each member's threads on a CPU of its own (member i on\n"
    "                 the i-th CPU this process may use, modulo their count),\n"
    "                 the engine's and the Accumulator's alike: as pods given\n"
    "                 exclusive cores by the kubelet's static CPU manager run,\n"
    "                 a trainer and its sidecar on their pod's. Without it the\n"
    "                 scheduler places every thread, and on a machine with no\n"
    "                 more cores than members, where it puts two members'\n"
    "                 threads moves the figures more than cohort does\n"
    "  --trace        also print, per size, the median time of each stage of\n"
    "                 the first member's rounds through the Accumulator, over\n"
    "                 every timed round of every repetition: wake (the\n"
    "                 contribution reaching the node's thread), count (count\n"
    "                 steps), copy-in and copy-out (a fused step's copies;\n"
    "                 copy-in alone when the counters ride in the spare bytes\n"
    "                 after the gradients),\n"
    "                 engine (the gradient all-reduce), commit (up to the\n"
    "                 view's publication), apply (from there until the\n"
    "                 trainer, woken, has zeroed its gradients and its consume\n"
    "                 reached the sidecar) and next (from there to its next\n"
    "                 contribution reaching the node); their sum is one round.\n"
    "                 Then the share of the first member's contributions and\n"
    "                 consumes that its node's thread took from the view\n"
    "                 page's doorbell rather than the trainer link's socket.\n"
    "                 Untraced runs read no clock for it.\n"
    "  -o, --output   table (default) or json\n"
    "  -h, --help     show this text\n";

/* ---- --pin ---- */

/* Threads take their creator's CPU mask: the calling thread takes member
 * i's CPU while it starts that member's threads (the engine's acceptor,
 * the sidecar's thread, which starts the node's and the heartbeat's, the
 * trainer's) and takes the whole set back after. The broker and the RPC
 * threads, started before any member, stay unpinned. pin_check() tries
 * each member's CPU once before anything runs; a change that fails later
 * (the process's CPU set changed under it) is reported after the figures,
 * and the command exits 1. */
static bool pinning;
static atomic_bool pin_failed;
static cpu_set_t all_cpus;

static int pin_set(const cpu_set_t *set)
{
    return -pthread_setaffinity_np(pthread_self(), sizeof(*set), set);
}

/* The member's CPU: the (i mod count)-th of those the process may use. */
static void member_cpu(int i, cpu_set_t *one)
{
    int k = 0, target = i % CPU_COUNT(&all_cpus);

    CPU_ZERO(one);
    for (int c = 0; c < CPU_SETSIZE; c++) {
        if (CPU_ISSET(c, &all_cpus) && k++ == target) {
            CPU_SET(c, one);
            return;
        }
    }
}

static void pin_member(int i)
{
    cpu_set_t one;

    if (!pinning)
        return;
    member_cpu(i, &one);
    if (pin_set(&one) < 0)
        atomic_store(&pin_failed, true);
}

static void pin_restore(void)
{
    if (pinning && pin_set(&all_cpus) < 0)
        atomic_store(&pin_failed, true);
}

/* Starts fn(arg) as member i's thread: pinned to its CPU with --pin. */
static int start_pinned(int i, pthread_t *t, void *(*fn)(void *), void *arg)
{
    int rc;

    pin_member(i);
    rc = -pthread_create(t, NULL, fn, arg);
    pin_restore();
    return rc;
}

static int pin_check(int peers)
{
    int rc;

    if (sched_getaffinity(0, sizeof(all_cpus), &all_cpus) < 0)
        return -errno;
    for (int i = 0; i < peers && i < CPU_COUNT(&all_cpus); i++) {
        cpu_set_t one;

        member_cpu(i, &one);
        if ((rc = pin_set(&one)) < 0)
            return rc;
    }
    return pin_set(&all_cpus);
}

/* ---- the engine alone ---- */

struct direct {
    struct allreduce *ar;
    float *buf, *out;           /* out: the results when out of place, else NULL */
    size_t count;
    int h, h_out, rounds, rc;
    double ms;
    pthread_t t;
};

static void *direct_main(void *arg)
{
    struct direct *d = arg;
    uint64_t t0 = 0;

    for (int r = 0; r < WARMUP + d->rounds; r++) {
        if (r == WARMUP)
            t0 = clock_now_us();
        d->rc = allreduce_run_into(d->ar, d->h, d->out ? d->h_out : d->h, d->count, DTYPE_F32,
                                   DTYPE_AVG, 0, (uint64_t)r + 1);
        if (d->rc < 0)
            return NULL;
        memset(d->buf, 0, d->count * sizeof(float));
    }
    d->ms = (double)(clock_now_us() - t0) / 1000.0 / d->rounds;
    return NULL;
}

/* Out of place (into): each member reduces its buffer into a second one,
 * as the node reduces a trainer's gradients into its results. */
static int run_direct(int n, size_t bytes, int rounds, bool into, double *ms)
{
    struct direct d[MAX_PEERS];
    struct epoch_member m[MAX_PEERS];
    char ids[MAX_PEERS][16], addrs[MAX_PEERS][64];
    int fds[MAX_PEERS];
    struct epoch *e = NULL;
    int rc = 0, started = 0;

    memset(d, 0, sizeof(d));
    memset(m, 0, sizeof(m));
    for (int i = 0; i < n; i++) {
        snprintf(ids[i], sizeof(ids[i]), "d-%d", i);
        if ((rc = allreduce_listen("127.0.0.1", &fds[i], addrs[i], sizeof(addrs[i]))) < 0)
            return rc;
        m[i] = (struct epoch_member){ ids[i], addrs[i], 0 };
    }
    if ((rc = epoch_create("direct", 1, 0, m, (size_t)n, &e)) < 0)
        return rc;
    for (int i = 0; i < n; i++) {
        struct allreduce_config c = { .cohort = "direct", .member_id = ids[i], .listen_fd = fds[i] };
        int made;

        d[i].count = bytes / 4;
        d[i].rounds = rounds;
        d[i].buf = aligned_alloc(64, (bytes + 63) / 64 * 64);
        d[i].out = into ? aligned_alloc(64, (bytes + 63) / 64 * 64) : NULL;
        if (!d[i].buf || (into && !d[i].out))
            return -ENOMEM;
        pin_member(i);
        made = allreduce_create(&c, &d[i].ar);
        pin_restore();
        if (made < 0)
            return made;
        memset(d[i].buf, 0, bytes);
        allreduce_set_epoch(d[i].ar, e);
        d[i].h = allreduce_register(d[i].ar, d[i].buf, bytes);
        if (into) {
            memset(d[i].out, 0, bytes);
            d[i].h_out = allreduce_register(d[i].ar, d[i].out, bytes);
        }
    }
    /* A member that failed to start leaves the others to time out in
     * their round; only the started ones are joined. */
    while (started < n &&
           (rc = start_pinned(started, &d[started].t, direct_main, &d[started])) == 0)
        started++;
    for (int i = 0; i < started; i++) {
        pthread_join(d[i].t, NULL);
        if (d[i].rc < 0 && rc == 0)
            rc = d[i].rc;
    }
    *ms = d[0].ms;
    for (int i = 0; i < n; i++) {
        allreduce_destroy(d[i].ar);
        close(fds[i]);
        free(d[i].buf);
        free(d[i].out);
    }
    epoch_unref(e);
    return rc;
}

/* ---- through the Accumulator ---- */

struct trainer {
    struct cohort *c;
    int rounds, rc;
    uint32_t peers;             /* rounds are timed only with all of them in */
    double ms;
    uint64_t requests;          /* contributions and consumes made */
    pthread_t t;
};

/* moolib's loop; when there is nothing to do it sleeps in cohort_wait(),
 * which wakes it as soon as the view changes: on two cores a polling
 * trainer would starve the very threads it waits for. What is timed is
 * cohort's own latency. */
static void *trainer_main(void *arg)
{
    struct trainer *tr = arg;
    uint64_t t0 = 0, start_at = 0, target = 0, give_up = clock_now_ms() + GIVE_UP_MS;
    bool started = false;

    while (clock_now_ms() < give_up) {
        if ((tr->rc = cohort_update(tr->c)) < 0)
            return NULL;
        /* A member alone would commit rounds the others never see, and
         * every member must time the same rounds. */
        if (!cohort_connected(tr->c) || cohort_size(tr->c) < tr->peers) {
            cohort_wait(tr->c, 100);
            continue;
        }
        if (cohort_wants_state(tr->c))
            cohort_set_state(tr->c, "", 0);
        if (cohort_has_new_state(tr->c)) {
            const void *s;
            size_t len;
            cohort_state(tr->c, &s, &len);
        }
        if (!started) {
            start_at = cohort_model_version(tr->c);
            target = start_at + WARMUP + (uint64_t)tr->rounds;
            started = true;
        }
        if (cohort_model_version(tr->c) == start_at + WARMUP && t0 == 0)
            t0 = clock_now_us();
        if (cohort_has_gradients(tr->c)) {
            cohort_zero_gradients(tr->c);
            tr->requests++;
            if (cohort_model_version(tr->c) >= target) {
                tr->ms = (double)(clock_now_us() - t0) / 1000.0 / tr->rounds;
                return NULL;
            }
        } else if (cohort_wants_gradients(tr->c)) {
            cohort_reduce_gradients(tr->c, 1);
            tr->requests++;
        } else {
            cohort_wait(tr->c, 100);
        }
    }
    tr->rc = -ETIMEDOUT;
    return NULL;
}

/* Of the rows a run added from `first`, drops the warm-up rounds' (all of
 * them if the run failed). */
static void trace_keep(struct node_trace *t, size_t first, bool ok)
{
    size_t added = t->rounds - first;

    if (!ok || added <= WARMUP) {
        t->rounds = first;
        return;
    }
    memmove(t->ns[first], t->ns[first + WARMUP], (added - WARMUP) * sizeof(t->ns[0]));
    t->rounds -= WARMUP;
}

/* The first member's node keeps its rounds' stages in *trace when it is
 * not NULL; the warm-up rounds are dropped from it. bell[0] and bell[1]
 * grow by the first member's requests served from the view page's
 * doorbell and by all it made, warm-up included. */
static int run_accumulator(int n, size_t bytes, int rounds, double *ms, struct node_trace *trace,
                           uint64_t bell[2])
{
    struct secret key;
    struct brokerd_config bc = { .listen = "127.0.0.1:0", .key = &key };
    struct trainerd *sd[MAX_PEERS] = { 0 };
    struct trainer tr[MAX_PEERS];
    struct brokerd *b = NULL;
    char dir[] = "/tmp/cohort-benchacc-XXXXXX", broker[64], path[MAX_PEERS][128];
    size_t first_row = trace ? trace->rounds : 0;
    int rc, started = 0;

    memset(tr, 0, sizeof(tr));
    if (!mkdtemp(dir))
        return -errno;
    broker_config_default(&bc.broker);
    bc.broker.startup_hold_ms = 0;
    bc.broker.coalesce_ms = 10;
    /* A key for the run: the nodes prove it to the broker, as in a real
     * cohort. */
    if ((rc = secret_generate(&key)) < 0 || (rc = brokerd_start(&bc, &b)) < 0)
        goto out;
    brokerd_declare(b, "bench", 0, 0);
    snprintf(broker, sizeof(broker), "127.0.0.1:%d", brokerd_port(b));
    for (int i = 0; i < n; i++) {
        struct trainerd_config tc = { .node = { .broker = broker, .cohort = "bench",
                                                .host = "127.0.0.1", .key = &key,
                                                .trace = i == 0 ? trace : NULL } };
        struct cohort_tensor p = { "g", COHORT_F32, bytes / 4 };
        struct cohort_config cc = { .name = "bench", .parameters = &p, .n_parameters = 1 };
        char id[16], addr[160];
        snprintf(id, sizeof(id), "a-%d", i);
        snprintf(path[i], sizeof(path[i]), "%s/%d.sock", dir, i);
        tc.socket_path = path[i];
        tc.node.id = id;
        pin_member(i);
        rc = trainerd_start(&tc, &sd[i]);
        pin_restore();
        if (rc < 0 || (rc = cohort_create(&cc, &tr[i].c)) < 0)
            goto out;
        if (snprintf(addr, sizeof(addr), "unix:%s", path[i]) >= (int)sizeof(addr)) {
            rc = -ENAMETOOLONG;
            goto out;
        }
        if ((rc = cohort_connect(tr[i].c, addr)) < 0 ||
            (rc = cohort_set_virtual_batch_size(tr[i].c, (uint64_t)n)) < 0)
            goto out;
        tr[i].rounds = rounds;
        tr[i].peers = (uint32_t)n;
    }
    while (started < n &&
           (rc = start_pinned(started, &tr[started].t, trainer_main, &tr[started])) == 0)
        started++;
    for (int i = 0; i < started; i++) {
        pthread_join(tr[i].t, NULL);
        if (tr[i].rc < 0 && rc == 0)
            rc = tr[i].rc;
    }
    *ms = tr[0].ms;
    bell[0] += trainerd_bell_served(sd[0]);
    bell[1] += tr[0].requests;
out:
    for (int i = 0; i < n; i++) {
        cohort_destroy(tr[i].c);
        trainerd_stop(sd[i]);
    }
    /* The node is stopped: its trace is whole. */
    if (trace)
        trace_keep(trace, first_row, rc == 0);
    brokerd_stop(b);
    secret_wipe(&key);
    rmdir(dir);
    return rc;
}

/* Each stage's median over the trace's rows, in microseconds; and the
 * median of the rows' sums. `v` has room for every row. */
static void trace_medians(const struct node_trace *t, double *v, double us[NODE_STAGES + 1])
{
    for (int s = 0; s <= NODE_STAGES; s++) {
        for (size_t r = 0; r < t->rounds; r++) {
            uint64_t ns = 0;

            if (s < NODE_STAGES)
                ns = t->ns[r][s];
            else
                for (int k = 0; k < NODE_STAGES; k++)
                    ns += t->ns[r][k];
            v[r] = (double)ns / 1000.0;
        }
        us[s] = t->rounds ? stats_median(v, (int)t->rounds) : 0;
    }
}

static void print_trace(const struct node_trace *t, const double us[NODE_STAGES + 1],
                        const uint64_t bell[2], bool json)
{
    double share = bell[1] ? 100.0 * (double)bell[0] / (double)bell[1] : 0;

    if (json) {
        printf(",\"trace_rounds\":%zu,\"trace_us\":{", t->rounds);
        for (int s = 0; s < NODE_STAGES; s++)
            printf("%s\"%s\":%.1f", s ? "," : "", node_stage_name((enum node_stage)s), us[s]);
        printf(",\"round\":%.1f},\"doorbell_pct\":%.1f", us[NODE_STAGES], share);
        return;
    }
    printf("%10s trace, median us over %zu rounds:", "", t->rounds);
    for (int s = 0; s < NODE_STAGES; s++)
        printf(" %s %.1f", node_stage_name((enum node_stage)s), us[s]);
    printf(" | round %.1f | doorbell %.0f%%\n", us[NODE_STAGES], share);
}

int cli_bench_accumulator(int argc, char **argv)
{
    static const struct option longopts[] = {
        { "peers", required_argument, NULL, 'n' },
        { "bytes", required_argument, NULL, 'b' },
        { "rounds", required_argument, NULL, 'r' },
        { "reps", required_argument, NULL, 'R' },
        { "pin", no_argument, NULL, 'p' },
        { "trace", no_argument, NULL, 't' },
        { "output", required_argument, NULL, 'o' },
        { "help", no_argument, NULL, 'h' },
        { NULL, 0, NULL, 0 },
    };
    uint64_t sizes[MAX_SIZES];
    size_t n_sizes = 0;
    int peers = 2, rounds = 20, reps = 5, opt, status = 0, bad;
    const char *list = "4K,64M", *output = "table";
    struct node_trace trace = { 0 }, *tracing = NULL;
    double *scratch = NULL;
    bool json;
    uint64_t v;

    optind = 1;
    while ((opt = opt_next(PROG, argc, argv, "o:h", longopts)) != -1) {
        switch (opt) {
        case 'n':
            if (opt_uint(optarg, 2, MAX_PEERS, &v) < 0)
                return opt_usage(PROG, "bad --peers \"%s\" (2 to %d)", optarg, MAX_PEERS);
            peers = (int)v;
            break;
        case 'b': list = optarg; break;
        case 'r':
            if (opt_uint(optarg, 1, 100000, &v) < 0)
                return opt_usage(PROG, "bad --rounds \"%s\" (1 to 100000)", optarg);
            rounds = (int)v;
            break;
        case 'R':
            if (opt_uint(optarg, 1, MAX_REPS, &v) < 0)
                return opt_usage(PROG, "bad --reps \"%s\" (1 to %d)", optarg, MAX_REPS);
            reps = (int)v;
            break;
        case 'p': pinning = true; break;
        case 't': tracing = &trace; break;
        case 'o': output = optarg; break;
        case 'h': fputs(usage, stdout); return 0;
        default: return OPT_EXIT_USAGE;
        }
    }
    if (opt_no_operands(PROG, argc, argv, optind))
        return OPT_EXIT_USAGE;
    if (opt_output(PROG, output, &json) != 0)
        return OPT_EXIT_USAGE;
    bad = opt_bytes_list(list, MAX_BYTES, sizes, MAX_SIZES, &n_sizes);
    for (size_t i = 0; bad == 0 && i < n_sizes; i++)
        if (sizes[i] % 4 != 0)
            bad = -EINVAL;
    if (bad < 0)
        return opt_usage(PROG, "bad --bytes \"%s\" (at most %d sizes, each a multiple of 4 "
                         "bytes up to 1G, K M G suffixes)", list, MAX_SIZES);
    if (tracing) {
        trace.cap = TRACE_ROWS;
        trace.ns = calloc(TRACE_ROWS, sizeof(trace.ns[0]));
        scratch = calloc(TRACE_ROWS, sizeof(double));
        if (!trace.ns || !scratch) {
            fprintf(stderr, PROG ": out of memory for the trace\n");
            free(trace.ns);
            free(scratch);
            return 1;
        }
    }
    if (pinning && (bad = pin_check(peers)) < 0) {
        fprintf(stderr, PROG ": cannot pin threads to CPUs: %s\n", log_strerror(bad));
        status = 1;
        goto out;
    }
    log_set_level(LOG_ERROR);
    if (rpc_init() < 0) {
        status = 1;
        goto out;
    }
    if (pinning && !json)
        printf("each member's threads on a CPU of its own (--pin), of %d\n",
               CPU_COUNT(&all_cpus));
    if (strcmp(output, "table") == 0)
        printf("%10s %5s %12s %16s %7s %10s %10s %7s\n", "bytes", "peers", "engine ms",
               "accumulator ms", "ratio", "added us", "into ms", "vs into");
    for (size_t i = 0; i < n_sizes; i++) {
        double d[MAX_REPS], di[MAX_REPS], a[MAX_REPS], r[MAX_REPS], ri[MAX_REPS];
        double direct, into, acc, ratio, ratio_into;
        size_t bytes = (size_t)sizes[i];
        uint64_t bell[2] = { 0, 0 };
        int rc = 0;

        trace.rounds = 0;
        for (int k = 0; k < reps && rc == 0; k++) {
            rc = run_direct(peers, bytes, rounds, false, &d[k]);
            if (rc == 0)
                rc = run_direct(peers, bytes, rounds, true, &di[k]);
            if (rc == 0)
                rc = run_accumulator(peers, bytes, rounds, &a[k], tracing, bell);
            r[k] = a[k] / d[k];
            ri[k] = a[k] / di[k];
        }
        if (rc < 0) {
            fprintf(stderr, "cohortctl bench accumulator: %zu bytes failed: %s\n", bytes,
                    log_strerror(rc));
            status = 1;
            continue;
        }
        direct = stats_median(d, reps);
        acc = stats_median(a, reps);
        ratio = stats_median(r, reps);
        into = stats_median(di, reps);
        ratio_into = stats_median(ri, reps);
        if (json)
            printf("{\"peers\":%d,\"bytes\":%zu,\"engine_ms\":%.4f,\"accumulator_ms\":%.4f,"
                   "\"ratio\":%.3f,\"added_us\":%.1f,\"engine_into_ms\":%.4f,"
                   "\"ratio_into\":%.3f,\"reps\":%d,\"pinned\":%s", peers, bytes, direct, acc,
                   ratio, (acc - direct) * 1000.0, into, ratio_into, reps,
                   pinning ? "true" : "false");
        else
            printf("%10zu %5d %12.3f %16.3f %7.2f %10.1f %10.3f %7.2f\n", bytes, peers, direct,
                   acc, ratio, (acc - direct) * 1000.0, into, ratio_into);
        if (tracing) {
            double us[NODE_STAGES + 1];

            trace_medians(&trace, scratch, us);
            print_trace(&trace, us, bell, json);
        }
        if (json)
            printf("}\n");
    }
    rpc_shutdown();
    if (atomic_load(&pin_failed)) {
        fprintf(stderr, PROG ": a thread could not be pinned to its member's CPU; the figures "
                "above are not pinned ones\n");
        status = 1;
    }
out:
    free(trace.ns);
    free(scratch);
    return status;
}

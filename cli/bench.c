/* cli/bench.c: `cohortctl bench broker`: a real broker process against
 * many simulated members in this process, each a full member (join, then
 * heartbeats at the cohort's interval up its session stream, and epochs
 * down it). Measures the broker's CPU in steady state and how long an
 * epoch change takes to reach every member: as the broker sends it (its
 * own log line when every stream has sent the epoch, apart from this
 * process's cores) and as the simulated members see it. */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "cli.h"
#include "base/clock.h"
#include "base/limits.h"
#include "base/log.h"
#include "membership/member.h"
#include "base/opt.h"
#include "base/secret.h"
#include "rpc/rpc.h"

extern char **environ;

#define PROG "cohortctl bench broker"
#define FD_RESERVE 512          /* fds kept free for everything but connections */
#define JOIN_DEADLINE_MS 120000
#define CHANGE_DEADLINE_MS 30000

static const char usage[] =
    "Usage: cohortctl bench broker [options]\n"
    "\n"
    "Starts cohort-operator --standalone (from this binary's directory) and\n"
    "simulates members in this process, each with its own connection, join\n"
    "and session stream (heartbeats up, epochs down). Reports the broker's\n"
    "CPU as a share of one core in steady state, and for each membership\n"
    "change of the first cohort: the broker's send time, from the epoch's\n"
    "formation until every member's stream has sent it (the broker's own log\n"
    "line: it leaves out the network and this process), and the time from\n"
    "the change to each simulated member having the epoch (first, p50, p99,\n"
    "max). Every simulated member unpacks and checks its own copy of each\n"
    "epoch on this machine's cores, so with large cohorts that second figure\n"
    "includes queueing behind the other simulated members. The broker runs\n"
    "with a key made for the benchmark, and every call and heartbeat of a\n"
    "member proves it, as in production (--insecure: no key and no proofs,\n"
    "to see what they cost). Members of cohorts with keys send their plain\n"
    "heartbeats as UDP datagrams, as in production; the report counts how\n"
    "many did at the end of the steady window (--no-datagrams: the broker\n"
    "runs with --no-datagram-heartbeats and every heartbeat rides its\n"
    "member's stream). Members that join again during the steady\n"
    "window are counted (rejoins): any means the run was not steady.\n"
    "\n"
    "  --members N        members in all (default 1000)\n"
    "  --cohorts N        cohorts they are spread over (default 1)\n"
    "  --connections N    connections the members share (default: one each,\n"
    "                     as far as the open-file limit allows)\n"
    "  --changes N        membership changes to time, each a leave and a\n"
    "                     rejoin of one member of the first cohort (default 5)\n"
    "  --measure DUR      steady-state CPU window (default 10s)\n"
    "  --heartbeat DUR    heartbeat interval (default 1s)\n"
    "  --coalesce DUR     the broker's coalescing window (default 50ms)\n"
    "  --insecure         run the broker without keys (--insecure) and the\n"
    "                     members without proofs (and so without datagrams)\n"
    "  --no-datagrams     every heartbeat up the members' streams\n"
    "  -o, --output FMT   table (default) or json\n"
    "  --log-format text|json  format of log lines on stderr (default text)\n"
    "  --log-level LEVEL       debug, info, warn or error (default error)\n"
    "  -h, --help         show this text\n";

struct sim {
    struct member *m;
    size_t cohort;
    _Atomic uint64_t epoch;         /* latest seen */
    _Atomic uint64_t seen_at_us;    /* when it was seen */
    _Atomic size_t n_members;
};

struct bench {
    size_t n_members, n_cohorts, n_changes;
    uint64_t measure_ms, heartbeat_ms, coalesce_ms;
    struct sim *sims;
    uint64_t *before;               /* time_change's scratch */
    size_t n_channels;
    struct rpc_channel **channels;
    char broker_addr[64];
    pid_t broker_pid;
    struct secret key;              /* the broker's, in key_path while it runs */
    char key_path[64];
    bool insecure;                  /* no key, no proofs */
    bool no_datagrams;              /* the broker takes no datagram heartbeats */
    atomic_bool stop;
    pthread_t drivers[2];
    pthread_mutex_t lock;           /* guards replacing sims[i].m */
    /* The broker's log, read to its end by `reader`: while `timing`, the
     * send times of the first cohort's epochs (µs, at most cap_sends). */
    FILE *blog;
    pthread_t reader;
    bool reader_started;
    atomic_bool timing;
    pthread_mutex_t sends_lock;
    uint64_t *sends;
    size_t n_sends, cap_sends;
};

/* Reads the broker's log lines until it exits; they must be drained, or
 * the broker would block writing them. */
static void *reader_main(void *p)
{
    static const char sent[] = "An epoch went out to every member's stream.";
    struct bench *b = p;
    char line[2048];

    while (fgets(line, sizeof(line), b->blog)) {
        const char *us = strstr(line, " send_us=");
        uint64_t v;

        if (!atomic_load(&b->timing) || !strstr(line, sent) || !strstr(line, " cohort=bench-0 ") ||
            !us)
            continue;
        us += strlen(" send_us=");
        v = strtoull(us, NULL, 10);
        pthread_mutex_lock(&b->sends_lock);
        if (b->n_sends < b->cap_sends)
            b->sends[b->n_sends++] = v;
        pthread_mutex_unlock(&b->sends_lock);
    }
    return NULL;
}

static void on_epoch(void *arg, struct epoch *e)
{
    struct sim *s = arg;

    atomic_store(&s->n_members, e->n_members);
    atomic_store(&s->seen_at_us, clock_now_us());
    atomic_store(&s->epoch, e->number);
}

struct driver_arg {
    struct bench *b;
    size_t from, to;
};

static void *driver_main(void *p)
{
    struct driver_arg *a = p;
    struct bench *b = a->b;

    while (!atomic_load(&b->stop)) {
        uint64_t now = clock_now_ms();
        uint32_t wait = 100;
        pthread_mutex_lock(&b->lock);
        for (size_t i = a->from; i < a->to; i++) {
            uint32_t w = member_poll(b->sims[i].m, now);
            if (w < wait)
                wait = w;
        }
        pthread_mutex_unlock(&b->lock);
        /* Polling thousands of members costs; 10 ms granularity is plenty
         * against a 1 s heartbeat. */
        clock_sleep_ms(wait < 10 ? 10 : wait);
    }
    free(a);
    return NULL;
}

static int make_member(struct bench *b, size_t i)
{
    struct member_config mc = { 0 };
    char cohort[32], id[32];

    snprintf(cohort, sizeof(cohort), "bench-%zu", b->sims[i].cohort);
    snprintf(id, sizeof(id), "m-%zu", i);
    mc.broker = b->broker_addr;
    mc.cohort = cohort;
    mc.id = id;
    mc.address = "127.0.0.1:9";     /* advertised only; nothing connects in this bench */
    mc.quiet = true;
    mc.on_epoch = on_epoch;
    mc.arg = &b->sims[i];
    mc.channel = b->channels[i % b->n_channels];
    mc.key = b->insecure ? NULL : &b->key;
    return member_create(&mc, &b->sims[i].m);
}

/* CPU seconds (user + system) the process has used so far. */
static double proc_cpu_s(pid_t pid)
{
    char path[64], buf[1024];
    unsigned long ut = 0, st = 0;
    char *p;
    FILE *f;

    snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
    f = fopen(path, "r");
    if (!f)
        return -1;
    if (!fgets(buf, sizeof(buf), f)) {
        fclose(f);
        return -1;
    }
    fclose(f);
    /* Fields after the command name, which may hold spaces. */
    p = strrchr(buf, ')');
    if (!p || sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu", &ut, &st) != 2)
        return -1;
    return (double)(ut + st) / (double)sysconf(_SC_CLK_TCK);
}

/* The broker's key, in a file that only has to live until the broker has
 * read it. Returns 0 or -errno. */
static int write_key(struct bench *b)
{
    int fd, rc;

    snprintf(b->key_path, sizeof(b->key_path), "/tmp/cohort-bench-key-XXXXXX");
    fd = mkstemp(b->key_path);
    if (fd < 0)
        return -errno;
    close(fd);
    unlink(b->key_path);
    if ((rc = secret_generate(&b->key)) < 0 || (rc = secret_write(b->key_path, &b->key)) < 0)
        return rc;
    return 0;
}

static void drop_key(struct bench *b)
{
    if (b->key_path[0])
        unlink(b->key_path);
}

/* Starts the broker and reads its listening line for the bound port. */
static int start_broker(struct bench *b, const char *self_dir)
{
    char exe[PATH_MAX + 32], hb[32], co[32], maxm[32], line[2048];
    int pipefd[2];
    posix_spawn_file_actions_t fa;
    FILE *f;
    int rc;

    snprintf(exe, sizeof(exe), "%s/cohort-operator", self_dir);
    snprintf(hb, sizeof(hb), "%llums", (unsigned long long)b->heartbeat_ms);
    snprintf(co, sizeof(co), "%llums", (unsigned long long)b->coalesce_ms);
    snprintf(maxm, sizeof(maxm), "%zu", b->n_members + 16);
    char *argv[] = { exe, "--standalone", "--listen", "127.0.0.1:0", "--allow-any-cohort",
                     "--heartbeat-interval", hb, "--member-timeout", "5s", "--coalesce", co,
                     "--startup-hold", "0ms", "--max-members", maxm, "--log-level", "info",
                     NULL, NULL, NULL, NULL };  /* the key file, or --insecure; datagrams */
    size_t n = sizeof(argv) / sizeof(argv[0]) - 4;

    if (b->insecure) {
        argv[n] = "--insecure";
    } else {
        if ((rc = write_key(b)) < 0)
            return rc;
        argv[n] = "--secret-file";
        argv[n + 1] = b->key_path;
    }
    if (b->no_datagrams)
        argv[argv[n + 1] ? n + 2 : n + 1] = "--no-datagram-heartbeats";
    if (pipe2(pipefd, O_CLOEXEC) < 0) {
        drop_key(b);
        return -errno;
    }
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, pipefd[1], STDERR_FILENO);
    rc = posix_spawn(&b->broker_pid, exe, &fa, NULL, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    close(pipefd[1]);
    if (rc != 0) {
        close(pipefd[0]);
        drop_key(b);
        return -rc;
    }
    f = fdopen(pipefd[0], "r");
    while (f && fgets(line, sizeof(line), f)) {
        char *a = strstr(line, "Broker is listening.");
        char *addr = a ? strstr(a, "address=") : NULL;
        if (addr) {
            drop_key(b);                    /* read before it listens */
            addr += strlen("address=");
            addr[strcspn(addr, " \n")] = '\0';
            snprintf(b->broker_addr, sizeof(b->broker_addr), "%s", addr);
            b->blog = f;
            if (pthread_create(&b->reader, NULL, reader_main, b) != 0) {
                /* The broker ignores SIGPIPE: its later lines are dropped. */
                fclose(f);
                b->blog = NULL;
            } else {
                b->reader_started = true;
            }
            return 0;
        }
    }
    if (f)
        fclose(f);
    drop_key(b);
    return -EIO;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* Joins that went through, over every member. */
static uint64_t count_joins(struct bench *b)
{
    uint64_t n = 0;

    pthread_mutex_lock(&b->lock);
    for (size_t i = 0; i < b->n_members; i++)
        n += member_joins(b->sims[i].m);
    pthread_mutex_unlock(&b->lock);
    return n;
}

/* True when every member's latest epoch lists its whole cohort. */
static bool all_settled(struct bench *b)
{
    for (size_t i = 0; i < b->n_members; i++) {
        size_t want = b->n_members / b->n_cohorts + (b->sims[i].cohort < b->n_members % b->n_cohorts);
        if (atomic_load(&b->sims[i].n_members) != want)
            return false;
    }
    return true;
}


/* One change: member `victim` of cohort 0 leaves (or rejoins); every other
 * member of cohort 0 must see a newer epoch. Appends one latency sample per
 * member to lat. Returns 0 or -ETIMEDOUT. */
static int time_change(struct bench *b, size_t victim, bool leave, uint64_t *lat, size_t *n_lat)
{
    uint64_t *before = b->before;
    uint64_t t0, deadline;
    size_t waiting;

    for (size_t i = 0; i < b->n_members; i++)
        before[i] = atomic_load(&b->sims[i].epoch);
    t0 = clock_now_us();
    if (leave) {
        member_leave(b->sims[victim].m, LIMIT_LEAVE_TIMEOUT_MS);
    } else {
        pthread_mutex_lock(&b->lock);
        member_destroy(b->sims[victim].m);
        atomic_store(&b->sims[victim].epoch, 0);
        make_member(b, victim);
        pthread_mutex_unlock(&b->lock);
    }
    deadline = clock_now_ms() + CHANGE_DEADLINE_MS;
    do {
        waiting = 0;
        for (size_t i = 0; i < b->n_members; i++)
            if (b->sims[i].cohort == 0 && i != victim && atomic_load(&b->sims[i].epoch) <= before[i])
                waiting++;
        if (waiting)
            clock_sleep_ms(5);
    } while (waiting && clock_now_ms() < deadline);
    if (waiting)
        return -ETIMEDOUT;
    for (size_t i = 0; i < b->n_members; i++)
        if (b->sims[i].cohort == 0 && i != victim)
            lat[(*n_lat)++] = atomic_load(&b->sims[i].seen_at_us) - t0;
    return 0;
}

static int run_broker_bench(struct bench *b, bool json, const char *self_dir)
{
    struct rlimit rl;
    uint64_t *lat = NULL;
    size_t n_lat = 0, victim = 0;
    double cpu0, cpu1, self0, self1;
    uint64_t w0, w1, t_join0, t_joined, joins0, joins1;
    size_t dgram_fds, on_dgram = 0;
    int rc, status = 1;

    /* One connection per member where the fd limit allows; beyond that,
     * members share connections (each keeps its own session and watch). */
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
    if (b->n_channels == 0 || b->n_channels > b->n_members)
        b->n_channels = b->n_members;
    /* A member heartbeating by datagram holds a UDP socket of its own. */
    dgram_fds = b->insecure || b->no_datagrams ? 0 : b->n_members;
    if (rl.rlim_cur != RLIM_INFINITY && b->n_channels + dgram_fds + FD_RESERVE > rl.rlim_cur)
        b->n_channels = rl.rlim_cur > dgram_fds + 2 * FD_RESERVE
                            ? rl.rlim_cur - dgram_fds - FD_RESERVE : 1;

    /* Two epochs a change, and room for a few more (an eviction). */
    b->cap_sends = b->n_changes * 2 + 64;
    b->sends = calloc(b->cap_sends, sizeof(*b->sends));
    pthread_mutex_init(&b->sends_lock, NULL);
    rc = start_broker(b, self_dir);
    if (rc < 0) {
        fprintf(stderr, "cohortctl bench: the broker did not start: %s\n", log_strerror(rc));
        free(b->sends);
        return 1;
    }
    if (rpc_init() < 0)
        goto out_broker;
    b->channels = calloc(b->n_channels, sizeof(*b->channels));
    b->sims = calloc(b->n_members, sizeof(*b->sims));
    b->before = calloc(b->n_members, sizeof(*b->before));
    lat = calloc(b->n_members * b->n_changes * 2 + 1, sizeof(*lat));
    if (!b->channels || !b->sims || !b->before || !lat || !b->sends)
        goto out_rpc;
    for (size_t i = 0; i < b->n_channels; i++)
        if (rpc_channel_create(b->broker_addr, NULL, &b->channels[i]) < 0)
            goto out_rpc;
    for (size_t i = 0; i < b->n_members; i++) {
        b->sims[i].cohort = i % b->n_cohorts;
        if (make_member(b, i) < 0)
            goto out_rpc;
    }

    t_join0 = clock_now_ms();
    for (int t = 0; t < 2; t++) {
        struct driver_arg *a = malloc(sizeof(*a));
        a->b = b;
        a->from = b->n_members * (size_t)t / 2;
        a->to = b->n_members * (size_t)(t + 1) / 2;
        pthread_create(&b->drivers[t], NULL, driver_main, a);
    }
    while (!all_settled(b)) {
        if (clock_now_ms() - t_join0 > JOIN_DEADLINE_MS) {
            fprintf(stderr, "cohortctl bench: members did not all join within %d s\n",
                    JOIN_DEADLINE_MS / 1000);
            goto out_threads;
        }
        clock_sleep_ms(50);
    }
    t_joined = clock_now_ms();

    /* Steady state: heartbeats only. A member that joins again in it was
     * evicted (or lost its stream): the run is not steady. */
    joins0 = count_joins(b);
    cpu0 = proc_cpu_s(b->broker_pid);
    self0 = proc_cpu_s(getpid());
    w0 = clock_now_us();
    clock_sleep_ms(b->measure_ms);
    cpu1 = proc_cpu_s(b->broker_pid);
    self1 = proc_cpu_s(getpid());
    w1 = clock_now_us();
    joins1 = count_joins(b);
    pthread_mutex_lock(&b->lock);
    for (size_t i = 0; i < b->n_members; i++)
        on_dgram += member_datagrams(b->sims[i].m);
    pthread_mutex_unlock(&b->lock);

    atomic_store(&b->timing, true);
    for (size_t c = 0; c < b->n_changes; c++) {
        victim = (c * b->n_cohorts) % b->n_members;     /* always in cohort 0 */
        if (time_change(b, victim, true, lat, &n_lat) < 0 ||
            time_change(b, victim, false, lat, &n_lat) < 0) {
            fprintf(stderr, "cohortctl bench: an epoch change did not reach every member in %d s\n",
                    CHANGE_DEADLINE_MS / 1000);
            goto out_threads;
        }
        /* Let the rejoined member settle before the next change. */
        while (!all_settled(b))
            clock_sleep_ms(10);
    }
    atomic_store(&b->timing, false);
    qsort(lat, n_lat, sizeof(*lat), cmp_u64);
    pthread_mutex_lock(&b->sends_lock);
    qsort(b->sends, b->n_sends, sizeof(*b->sends), cmp_u64);
    pthread_mutex_unlock(&b->sends_lock);
    {
        double wall = (double)(w1 - w0) / 1e6;
        double cpu = (cpu1 - cpu0) / wall * 100.0, self = (self1 - self0) / wall * 100.0;
        double p50 = n_lat ? (double)lat[n_lat / 2] / 1000.0 : 0;
        double p99 = n_lat ? (double)lat[(n_lat * 99) / 100 < n_lat ? (n_lat * 99) / 100 : n_lat - 1] / 1000.0 : 0;
        double mx = n_lat ? (double)lat[n_lat - 1] / 1000.0 : 0;
        double first = n_lat ? (double)lat[0] / 1000.0 : 0;
        size_t ns = b->n_sends;
        double s50 = ns ? (double)b->sends[ns / 2] / 1000.0 : 0;
        double s99 = ns ? (double)b->sends[(ns * 99) / 100] / 1000.0 : 0;
        double smax = ns ? (double)b->sends[ns - 1] / 1000.0 : 0;
        if (json) {
            cJSON *o = cJSON_CreateObject();
            char *text;
            cJSON_AddNumberToObject(o, "members", (double)b->n_members);
            cJSON_AddNumberToObject(o, "cohorts", (double)b->n_cohorts);
            cJSON_AddNumberToObject(o, "connections", (double)b->n_channels);
            cJSON_AddNumberToObject(o, "heartbeat_ms", (double)b->heartbeat_ms);
            cJSON_AddNumberToObject(o, "coalesce_ms", (double)b->coalesce_ms);
            cJSON_AddBoolToObject(o, "proofs", !b->insecure);
            cJSON_AddNumberToObject(o, "join_s", (double)(t_joined - t_join0) / 1000.0);
            cJSON_AddNumberToObject(o, "broker_cpu_pct", cpu);
            cJSON_AddNumberToObject(o, "simulator_cpu_pct", self);
            cJSON_AddNumberToObject(o, "rejoins_steady", (double)(joins1 - joins0));
            cJSON_AddNumberToObject(o, "members_on_datagrams", (double)on_dgram);
            cJSON_AddNumberToObject(o, "send_samples", (double)ns);
            cJSON_AddNumberToObject(o, "send_p50_ms", s50);
            cJSON_AddNumberToObject(o, "send_p99_ms", s99);
            cJSON_AddNumberToObject(o, "send_max_ms", smax);
            cJSON_AddNumberToObject(o, "epoch_samples", (double)n_lat);
            cJSON_AddNumberToObject(o, "epoch_first_ms", first);
            cJSON_AddNumberToObject(o, "epoch_p50_ms", p50);
            cJSON_AddNumberToObject(o, "epoch_p99_ms", p99);
            cJSON_AddNumberToObject(o, "epoch_max_ms", mx);
            text = cJSON_PrintUnformatted(o);
            puts(text);
            free(text);
            cJSON_Delete(o);
        } else {
            printf("members %zu in %zu cohort(s), %zu connection(s), heartbeat %llu ms, coalesce %llu ms, "
                   "%s\n", b->n_members, b->n_cohorts, b->n_channels,
                   (unsigned long long)b->heartbeat_ms, (unsigned long long)b->coalesce_ms,
                   b->insecure ? "no keys" : "every call proves the key");
            printf("all joined in           %8.2f s\n", (double)(t_joined - t_join0) / 1000.0);
            printf("broker CPU, steady      %8.1f %% of one core (simulator: %.1f %%), %llu "
                   "rejoins meanwhile\n", cpu, self, (unsigned long long)(joins1 - joins0));
            printf("heartbeating by datagram %7zu of %zu members\n", on_dgram, b->n_members);
            printf("epoch sent to all       p50 %.1f ms  p99 %.1f ms  max %.1f ms  (%zu epochs, "
                   "the broker's own measure)\n", s50, s99, smax, ns);
            printf("epoch change to member  first %.1f ms  p50 %.1f ms  p99 %.1f ms  max %.1f ms  "
                   "(%zu samples, as the simulated members see it)\n", first, p50, p99, mx, n_lat);
        }
        status = 0;
    }

out_threads:
    atomic_store(&b->stop, true);
    for (int t = 0; t < 2; t++)
        pthread_join(b->drivers[t], NULL);
out_rpc:
    for (size_t i = 0; b->sims && i < b->n_members; i++)
        member_destroy(b->sims[i].m);
    for (size_t i = 0; b->channels && i < b->n_channels; i++)
        rpc_channel_destroy(b->channels[i]);
    free(b->sims);
    free(b->before);
    free(b->channels);
    free(lat);
    rpc_shutdown();
out_broker:
    kill(b->broker_pid, SIGTERM);
    waitpid(b->broker_pid, NULL, 0);
    if (b->reader_started)
        pthread_join(b->reader, NULL);      /* the broker's exit ends its log */
    if (b->blog)
        fclose(b->blog);
    free(b->sends);
    pthread_mutex_destroy(&b->sends_lock);
    secret_wipe(&b->key);
    return status;
}

int cli_bench(int argc, char **argv)
{
    static const struct option longopts[] = {
        { "members", required_argument, NULL, 'm' },
        { "cohorts", required_argument, NULL, 'c' },
        { "changes", required_argument, NULL, 'k' },
        { "connections", required_argument, NULL, 'n' },
        { "measure", required_argument, NULL, 'w' },
        { "heartbeat", required_argument, NULL, 'b' },
        { "coalesce", required_argument, NULL, 'q' },
        { "insecure", no_argument, NULL, 'I' },
        { "no-datagrams", no_argument, NULL, 'D' },
        { "output", required_argument, NULL, 'o' },
        { "log-format", required_argument, NULL, 'F' },
        { "log-level", required_argument, NULL, 'L' },
        { "help", no_argument, NULL, 'h' },
        { NULL, 0, NULL, 0 },
    };
    struct bench b = { .n_members = 1000, .n_cohorts = 1, .n_changes = 5, .measure_ms = 10000,
                       .heartbeat_ms = 1000, .coalesce_ms = 50 };
    const char *output = "table", *logf = NULL, *logl = "error";
    char self[PATH_MAX], *slash;
    uint64_t v;
    ssize_t n;
    int opt;
    bool json;

    if (argc >= 2 && strcmp(argv[1], "allreduce") == 0)
        return cli_bench_allreduce(argc - 1, argv + 1);
    if (argc >= 2 && strcmp(argv[1], "accumulator") == 0)
        return cli_bench_accumulator(argc - 1, argv + 1);
    if (argc >= 2 && strcmp(argv[1], "checkpoint") == 0)
        return cli_bench_checkpoint(argc - 1, argv + 1);
    if (argc < 2 || strcmp(argv[1], "broker") != 0) {
        if (argc >= 2 && (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0)) {
            fputs("Usage: cohortctl bench broker|allreduce|accumulator|checkpoint [options]\n"
                  "Run 'cohortctl bench NAME --help' for a benchmark's options.\n", stdout);
            return 0;
        }
        return opt_usage("cohortctl bench",
                         "want a benchmark name: broker, allreduce, accumulator or checkpoint");
    }
    optind = 2;
    while ((opt = opt_next(PROG, argc, argv, "o:h", longopts)) != -1) {
        switch (opt) {
        case 'm':
            if (opt_uint(optarg, 2, 1000000, &v) < 0)
                return opt_usage(PROG, "bad --members \"%s\" (2 to 1000000)", optarg);
            b.n_members = (size_t)v;
            break;
        case 'c':
            if (opt_uint(optarg, 1, 100000, &v) < 0)
                return opt_usage(PROG, "bad --cohorts \"%s\"", optarg);
            b.n_cohorts = (size_t)v;
            break;
        case 'n':
            if (opt_uint(optarg, 1, 1000000, &v) < 0)
                return opt_usage(PROG, "bad --connections \"%s\"", optarg);
            b.n_channels = (size_t)v;
            break;
        case 'k':
            if (opt_uint(optarg, 0, 1000, &v) < 0)
                return opt_usage(PROG, "bad --changes \"%s\"", optarg);
            b.n_changes = (size_t)v;
            break;
        case 'w':
            if (opt_duration_ms(optarg, 3600000, &b.measure_ms) < 0)
                return opt_usage(PROG, "bad --measure \"%s\"", optarg);
            break;
        case 'b':
            if (opt_duration_ms(optarg, 60000, &b.heartbeat_ms) < 0 || b.heartbeat_ms == 0)
                return opt_usage(PROG, "bad --heartbeat \"%s\"", optarg);
            break;
        case 'q':
            if (opt_duration_ms(optarg, 60000, &b.coalesce_ms) < 0)
                return opt_usage(PROG, "bad --coalesce \"%s\"", optarg);
            break;
        case 'I': b.insecure = true; break;
        case 'D': b.no_datagrams = true; break;
        case 'o': output = optarg; break;
        case 'F': logf = optarg; break;
        case 'L': logl = optarg; break;
        case 'h':
            fputs(usage, stdout);
            return 0;
        default:
            return OPT_EXIT_USAGE;
        }
    }
    if (opt_no_operands(PROG, argc, argv, optind))
        return OPT_EXIT_USAGE;
    if (opt_output(PROG, output, &json) != 0)
        return OPT_EXIT_USAGE;
    if (b.n_cohorts > b.n_members / 2)
        return opt_usage(PROG, "want at least two members per cohort");
    n = readlink("/proc/self/exe", self, sizeof(self) - 1);
    if (n <= 0)
        return 1;
    self[n] = '\0';
    slash = strrchr(self, '/');
    if (slash)
        *slash = '\0';
    if (opt_logging(PROG, logf, logl) < 0)
        return OPT_EXIT_USAGE;
    signal(SIGPIPE, SIG_IGN);
    pthread_mutex_init(&b.lock, NULL);
    return run_broker_bench(&b, json, self);
}

/* cli/run.c: `cohortctl run`: a whole cohort on this machine. An embedded
 * broker (brokerd.h), one cohort-sidecar per peer and the user's trainer
 * beside it, a live view, a schedule that kills and adds peers so that
 * elasticity can be watched and tested, and a summary that checks that the
 * surviving trainers agree on their final line.
 *
 * One thread does everything but the broker and gRPC: it polls children
 * with waitpid(WNOHANG), the broker's status over loopback, and the
 * trainers' stderr files, every TICK_MS. Every wait has a deadline: the
 * run's --timeout, and STOP_GRACE_MS between SIGTERM and SIGKILL.
 * Children are started with posix_spawn (never fork once gRPC's threads
 * run) and stay in our process group, so a Ctrl-C in a terminal reaches
 * them too; we then stop whatever is left, in order, and report.
 *
 * This file parses the flags and drives the loop; run.h says where the
 * rest lives.
 */
#include <dirent.h>
#include <errno.h>
#include <getopt.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/clock.h"
#include "base/log.h"
#include "base/opt.h"
#include "cli.h"
#include "membership/brokerd.h"
#include "rpc/rpc.h"
#include "run.h"

static const char usage[] =
    "Usage: cohortctl run [-n N] [options] -- CMD [ARGS...]\n"
    "\n"
    "Runs a cohort on this machine: an embedded broker, N cohort-sidecars (from\n"
    "this program's directory) and N trainer processes running CMD, each told\n"
    "how to reach its own sidecar through its environment:\n"
    "  COHORT_SOCKET=unix:PATH  COHORT_COHORT=NAME  COHORT_ID=ID  COHORT_RUN_INDEX=I\n"
    "  COHORT_RUN_DIR=DIR (a new directory that all the run's trainers share,\n"
    "  removed with what they left there when the run ends)\n"
    "Peer I has member id peer-I (see --id-prefix). A trainer's stdout and stderr\n"
    "go to I.out and I.err in the run directory, its sidecar's log to\n"
    "I.sidecar.log. At the end each trainer's last stdout line is shown, and the\n"
    "surviving trainers must agree on it when they print \"final ...\" lines.\n"
    "Each run makes a new key for its cohort (cohort.key in the run directory,\n"
    "mode 0600, removed when the run ends): the embedded broker serves the\n"
    "cohort only to members that prove it, and each sidecar gets --secret-file.\n"
    "\n"
    "  -n, --peers N         trainers to start with (default 2, at most 256)\n"
    "  --cohort NAME         cohort name (default \"run\")\n"
    "  --schedule SPEC       kills and additions, see below\n"
    "  --timeout DUR         the whole run; then everything is stopped and the\n"
    "                        run fails (default 10m)\n"
    "  --view, --no-view     live view on stderr (default on): refreshed in place\n"
    "                        on a terminal, a plain line every --view-interval\n"
    "                        otherwise\n"
    "  --view-interval DUR   (default 500ms on a terminal, 2s otherwise)\n"
    "  --heartbeat DUR       the cohort's heartbeat interval (default 500ms)\n"
    "  --member-timeout DUR  silence after which a member is evicted (default 2s)\n"
    "  --run-dir DIR         put the logs there and keep them (default: a new\n"
    "                        directory under $TMPDIR or /tmp, removed after a\n"
    "                        successful run unless --keep-logs)\n"
    "  --keep-logs           keep the run directory after a successful run\n"
    "  --id-prefix P         member ids are P0, P1, ... (default \"peer-\")\n"
    "  --sidecar PATH        the cohort-sidecar binary (default: beside cohortctl)\n"
    "  -o, --output FMT      final summary on stdout: table (default) or json\n"
    "  --log-format text|json  the broker's lines on stderr and the sidecars' logs\n"
    "  --log-level LEVEL     for the embedded broker (default warn); sidecars log\n"
    "                        at info\n"
    "  -h, --help            show this text\n"
    "\n"
    "Schedule: events separated by commas, each ACTION@WHEN[:PEER]\n"
    "  ACTION  kill-trainer   SIGKILL peer PEER's trainer\n"
    "          kill-sidecar   SIGKILL peer PEER's sidecar (its trainer then fails)\n"
    "          kill-peer      both\n"
    "          add            start one more peer (sidecar and trainer); it gets\n"
    "                         the next index; takes no PEER\n"
    "  WHEN    DUR            that long after the run starts (5s, 1500ms)\n"
    "          v=N            once any member has reached model version N (as\n"
    "                         reported to the broker or in a trainer's progress)\n"
    "  PEER    a run index: 0 for peer-0\n"
    "  e.g. --schedule kill-trainer@v=20:1,kill-sidecar@8s:2,add@v=30\n"
    "A peer hit by the schedule is expected to fail and is not counted.\n"
    "\n"
    "Live view: elapsed time, epoch, leader, members, step (the highest model\n"
    "version), samples/s, and each peer's model version. samples/s comes from\n"
    "the trainers' progress lines on stderr: the latest \"samples=N\" (samples the\n"
    "cohort has committed) that any of them printed; \"model_version=N\" there\n"
    "counts too.\n"
    "\n"
    "Exit status: 0 when every trainer not hit by the schedule exited 0, every\n"
    "sidecar stopped cleanly, and the survivors' \"final\" lines agree; 1 when a\n"
    "trainer or sidecar failed, they disagree, the run timed out or was\n"
    "interrupted (Ctrl-C stops everything cleanly); 2 for a usage error.\n";

static volatile sig_atomic_t interrupted;

static void on_signal(int sig)
{
    (void)sig;
    interrupted = 1;
}

int run_fmt_into(char *buf, size_t len, const char *fmt, ...)
{
    va_list ap;
    int n;

    va_start(ap, fmt);
    n = vsnprintf(buf, len, fmt, ap);
    va_end(ap);
    return n < 0 || (size_t)n >= len ? -ENAMETOOLONG : 0;
}

double run_secs(const struct run *r, uint64_t now)
{
    return (double)(now - r->t0) / 1000.0;
}

static int make_dirs(struct run *r, const char *run_dir)
{
    const char *tmp = getenv("TMPDIR");
    char full[PATH_MAX];

    if (!tmp || !*tmp)
        tmp = "/tmp";
    if (run_dir) {
        if (mkdir(run_dir, 0755) < 0 && errno != EEXIST) {
            fprintf(stderr, PROG ": cannot create --run-dir %s: %s\n", run_dir, strerror(errno));
            return -errno;
        }
        if (!realpath(run_dir, full)) {
            fprintf(stderr, PROG ": --run-dir %s: %s\n", run_dir, strerror(errno));
            return -errno;
        }
        if (run_fmt_into(r->dir, sizeof(r->dir), "%s", full) < 0) {
            fprintf(stderr, PROG ": --run-dir %s: the path is too long\n", run_dir);
            return -ENAMETOOLONG;
        }
    } else {
        if (run_fmt_into(r->dir, sizeof(r->dir), "%s/cohort-run-XXXXXX", tmp) < 0) {
            fprintf(stderr, PROG ": $TMPDIR is too long\n");
            return -ENAMETOOLONG;
        }
        if (!mkdtemp(r->dir)) {
            fprintf(stderr, PROG ": cannot create a run directory in %s: %s\n", tmp, strerror(errno));
            return -errno;
        }
        r->own_dir = true;
    }
    /* New for each run, even in a --run-dir used before: a trainer must
     * never find what an earlier run's trainers left there. */
    if (run_fmt_into(r->shared, sizeof(r->shared), "%s/shared-XXXXXX", r->dir) < 0 ||
        !mkdtemp(r->shared)) {
        fprintf(stderr, PROG ": cannot create a shared directory in %s: %s\n", r->dir,
                strerror(errno));
        r->shared[0] = '\0';
        if (r->own_dir)
            rmdir(r->dir);
        return -EIO;
    }
    /* Sockets get a short private directory of their own: a Unix socket
     * path must fit in 108 bytes, wherever the logs go. */
    snprintf(r->sockdir, sizeof(r->sockdir), "/tmp/cohort-sock-XXXXXX");
    if (!mkdtemp(r->sockdir)) {
        fprintf(stderr, PROG ": cannot create a socket directory in /tmp: %s\n", strerror(errno));
        run_remove_shared(r);
        if (r->own_dir)
            rmdir(r->dir);
        return -errno;
    }
    return 0;
}

void run_remove_shared(struct run *r)
{
    char path[PATH_MAX];
    struct dirent *e;
    DIR *dir;

    if (!r->shared[0])
        return;
    dir = opendir(r->shared);
    while (dir && (e = readdir(dir)))
        if (strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0 &&
            run_fmt_into(path, sizeof(path), "%s/%s", r->shared, e->d_name) == 0)
            unlink(path);
    if (dir)
        closedir(dir);
    rmdir(r->shared);
    r->shared[0] = '\0';
}

static void remove_sockdir(struct run *r)
{
    char path[PATH_MAX];

    for (size_t i = 0; i < r->n_peers; i++)
        unlink(r->peers[i].sock);
    for (unsigned i = 0; i < MAX_PEERS; i++) {
        run_fmt_into(path, sizeof(path), "%s/%u.sock", r->sockdir, i);
        unlink(path);
    }
    rmdir(r->sockdir);
}

/* A new key for this run, in the run directory for the sidecars. An
 * earlier run's key file there is replaced: each run has its own. */
static int make_key(struct run *r)
{
    int rc;

    if (run_fmt_into(r->key_path, sizeof(r->key_path), "%s/cohort.key", r->dir) < 0) {
        fprintf(stderr, PROG ": the run directory's path is too long\n");
        return -ENAMETOOLONG;
    }
    rc = secret_generate(&r->key);
    if (rc == 0) {
        unlink(r->key_path);
        rc = secret_write(r->key_path, &r->key);
    }
    if (rc < 0) {
        fprintf(stderr, PROG ": cannot write the run's key to %s: %s\n", r->key_path,
                strerror(-rc));
        return rc;
    }
    r->key_written = true;
    return 0;
}

static int start_broker(struct run *r)
{
    struct brokerd_config cfg = { .listen = "127.0.0.1:0", .key = &r->key };
    int rc;

    broker_config_default(&cfg.broker);
    cfg.broker.heartbeat_ms = (uint32_t)r->heartbeat_ms;
    cfg.broker.timeout_ms = (uint32_t)r->member_timeout_ms;
    cfg.broker.startup_hold_ms = 0;     /* a new broker: no members to wait for */
    rc = brokerd_start(&cfg, &r->bd);
    if (rc < 0) {
        fprintf(stderr, PROG ": the embedded broker did not start: %s\n", log_strerror(rc));
        return rc;
    }
    rc = brokerd_declare(r->bd, r->cohort, (uint32_t)r->heartbeat_ms, (uint32_t)r->member_timeout_ms);
    if (rc < 0) {
        fprintf(stderr, PROG ": cannot declare cohort %s: %s\n", r->cohort, log_strerror(rc));
        return rc;
    }
    snprintf(r->broker, sizeof(r->broker), "127.0.0.1:%d", brokerd_port(r->bd));
    rc = rpc_channel_create(r->broker, NULL, &r->ch);
    if (rc < 0)
        fprintf(stderr, PROG ": cannot reach the embedded broker: %s\n", log_strerror(rc));
    return rc;
}

static int execute(struct run *r)
{
    uint64_t now, next_status = 0, next_view;
    struct verdict v;
    const char *reason;
    int status;

    r->t0 = clock_now_ms();
    next_view = r->t0 + r->view_ms;
    fprintf(stderr, PROG ": cohort %s, broker %s, %u peer(s), logs in %s\n", r->cohort, r->broker,
            r->n, r->dir);
    for (unsigned i = 0; i < r->n; i++)
        run_start_peer(r, r->t0);
    for (;;) {
        now = clock_now_ms();
        if (interrupted) {
            r->stop_reason = "interrupted";
            break;
        }
        if (now - r->t0 >= r->timeout_ms) {
            r->stop_reason = "timeout";
            run_note(r, "The run took longer than --timeout; stopping everything.");
            break;
        }
        run_reap(r, now);
        run_tend(r, now);
        for (size_t i = 0; i < r->n_peers; i++)
            run_read_progress(&r->peers[i]);
        if (now >= next_status) {
            run_poll_status(r);
            next_status = now + STATUS_EVERY_MS;
        }
        run_update_rate(r, now);
        run_fire_due(r, now);
        if (!run_trainers_left(r))
            break;
        if (r->view && now >= next_view) {
            run_view_draw(r, now);
            next_view = now + r->view_ms;
        }
        clock_sleep_ms(TICK_MS);
    }
    if (r->view)
        run_view_draw(r, clock_now_ms());
    if (r->stop_reason && strcmp(r->stop_reason, "interrupted") == 0)
        run_note(r, "Interrupted; stopping everything.");
    run_stop_all(r);
    now = clock_now_ms();
    run_judge(r, &v);
    reason = run_reason(r, &v);
    status = reason ? 1 : 0;
    if (r->json)
        run_print_json(r, &v, now);
    else
        run_print_table(r, &v, now);
    fflush(stdout);
    if (r->own_dir && !r->keep && status == 0) {
        run_remove_files(r);
    } else {
        fprintf(stderr, PROG ": logs are in %s\n", r->dir);
    }
    for (size_t i = 0; i < r->n_peers; i++)
        if (r->peers[i].err_fd >= 0)
            close(r->peers[i].err_fd);
    return status;
}

int cli_run(int argc, char **argv)
{
    enum { O_COHORT = 256, O_SCHED, O_TIMEOUT, O_VIEW, O_NOVIEW, O_VIEWI, O_HB, O_MTO, O_DIR,
           O_KEEP, O_PREFIX, O_SIDECAR, O_LOGF, O_LOGL };
    static const struct option longopts[] = {
        { "peers", required_argument, NULL, 'n' },
        { "cohort", required_argument, NULL, O_COHORT },
        { "schedule", required_argument, NULL, O_SCHED },
        { "timeout", required_argument, NULL, O_TIMEOUT },
        { "view", no_argument, NULL, O_VIEW },
        { "no-view", no_argument, NULL, O_NOVIEW },
        { "view-interval", required_argument, NULL, O_VIEWI },
        { "heartbeat", required_argument, NULL, O_HB },
        { "member-timeout", required_argument, NULL, O_MTO },
        { "run-dir", required_argument, NULL, O_DIR },
        { "keep-logs", no_argument, NULL, O_KEEP },
        { "id-prefix", required_argument, NULL, O_PREFIX },
        { "sidecar", required_argument, NULL, O_SIDECAR },
        { "output", required_argument, NULL, 'o' },
        { "log-format", required_argument, NULL, O_LOGF },
        { "log-level", required_argument, NULL, O_LOGL },
        { "help", no_argument, NULL, 'h' },
        { NULL, 0, NULL, 0 },
    };
    struct run r = { .n = 2, .cohort = "run", .prefix = "peer-", .logl = "warn",
                     .timeout_ms = 600000, .heartbeat_ms = 500, .member_timeout_ms = 2000,
                     .view = true };
    const char *schedule = NULL, *output = "table", *run_dir = NULL, *sidecar = NULL;
    char id[IDENT_NAME_MAX + 8];
    struct sigaction sa = { .sa_handler = on_signal };
    struct sigaction old_int, old_term;
    uint64_t v, view_ms = 0;
    size_t n_env;
    int opt, rc, status = 1;

    optind = 1;
    /* '+': options end at CMD, so its own options are left alone. */
    while ((opt = opt_next(PROG, argc, argv, "+n:o:h", longopts)) != -1) {
        switch (opt) {
        case 'n':
            if (opt_uint(optarg, 1, MAX_PEERS, &v) < 0)
                return opt_usage(PROG, "bad -n \"%s\" (1 to 256)", optarg);
            r.n = (unsigned)v;
            break;
        case O_COHORT: r.cohort = optarg; break;
        case O_SCHED: schedule = optarg; break;
        case O_TIMEOUT:
            if (opt_duration_ms(optarg, DURATION_MAX_MS, &r.timeout_ms) < 0 || r.timeout_ms == 0)
                return opt_usage(PROG, "bad --timeout \"%s\" (a duration: 90s, 10m)", optarg);
            break;
        case O_VIEW: r.view = true; break;
        case O_NOVIEW: r.view = false; break;
        case O_VIEWI:
            if (opt_duration_ms(optarg, 3600000, &view_ms) < 0 || view_ms < 100)
                return opt_usage(PROG, "bad --view-interval \"%s\" (at least 100ms)", optarg);
            break;
        case O_HB:
            if (opt_duration_ms(optarg, 60000, &r.heartbeat_ms) < 0 || r.heartbeat_ms == 0)
                return opt_usage(PROG, "bad --heartbeat \"%s\" (a duration up to 1m)", optarg);
            break;
        case O_MTO:
            if (opt_duration_ms(optarg, 600000, &r.member_timeout_ms) < 0 ||
                r.member_timeout_ms == 0)
                return opt_usage(PROG, "bad --member-timeout \"%s\" (a duration up to 10m)",
                                 optarg);
            break;
        case O_DIR: run_dir = optarg; break;
        case O_KEEP: r.keep = true; break;
        case O_PREFIX: r.prefix = optarg; break;
        case O_SIDECAR: sidecar = optarg; break;
        case 'o': output = optarg; break;
        case O_LOGF: r.logf = optarg; break;
        case O_LOGL: r.logl = optarg; break;
        case 'h':
            fputs(usage, stdout);
            return 0;
        default:
            return OPT_EXIT_USAGE;
        }
    }
    if (optind >= argc)
        return opt_usage(PROG, "want the trainer command after the options: -- CMD [ARGS...]");
    r.cmd = argv + optind;
    if (!ident_valid_cohort(r.cohort))
        return opt_usage(PROG, "bad --cohort \"%s\": letters, digits, '.', '_', '-'", r.cohort);
    snprintf(id, sizeof(id), "%s%u", r.prefix, MAX_PEERS - 1);
    if (strlen(r.prefix) > 64 || !ident_valid_member_id(id))
        return opt_usage(PROG, "bad --id-prefix \"%s\": letters, digits, '.', '_', '-'", r.prefix);
    if (r.member_timeout_ms <= r.heartbeat_ms)
        return opt_usage(PROG, "--member-timeout must be longer than --heartbeat");
    if (opt_output(PROG, output, &r.json) != 0)
        return OPT_EXIT_USAGE;
    if (schedule && (rc = run_parse_schedule(schedule, &r.events, &r.n_events)) != 0)
        return rc;
    if (opt_logging(PROG, r.logf, r.logl) < 0) {
        free(r.events);
        return OPT_EXIT_USAGE;
    }
    r.tty = isatty(STDERR_FILENO);
    r.view_ms = view_ms ? view_ms : r.tty ? 500 : 2000;

    if (sidecar) {
        snprintf(r.sidecar, sizeof(r.sidecar), "%s", sidecar);
    } else {
        char self[PATH_MAX], *slash;
        ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
        if (n <= 0) {
            fprintf(stderr, PROG ": cannot find this program's directory: %s\n", strerror(errno));
            free(r.events);
            return 1;
        }
        self[n] = '\0';
        slash = strrchr(self, '/');
        if (slash)
            *slash = '\0';
        run_fmt_into(r.sidecar, sizeof(r.sidecar), "%s/cohort-sidecar", self);
    }
    if (access(r.sidecar, X_OK) < 0) {
        fprintf(stderr, PROG ": no sidecar at %s: %s (build it, or give --sidecar)\n", r.sidecar,
                strerror(errno));
        free(r.events);
        return 1;
    }
    r.peers = calloc(MAX_PEERS, sizeof(*r.peers));
    r.env = run_base_env(5, &n_env);
    if (!r.peers || !r.env)
        goto out_free;
    if (make_dirs(&r, run_dir) < 0)
        goto out_free;
    signal(SIGPIPE, SIG_IGN);
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, &old_int);
    sigaction(SIGTERM, &sa, &old_term);
    if (rpc_init() < 0) {
        fprintf(stderr, PROG ": gRPC could not start\n");
        goto out_dirs;
    }
    if (make_key(&r) == 0 && start_broker(&r) == 0)
        status = execute(&r);
    rpc_channel_destroy(r.ch);
    brokerd_stop(r.bd);
    rpc_shutdown();
out_dirs:
    if (r.key_written)
        unlink(r.key_path);
    secret_wipe(&r.key);
    sigaction(SIGINT, &old_int, NULL);
    sigaction(SIGTERM, &old_term, NULL);
    remove_sockdir(&r);
    run_remove_shared(&r);
    if (status != 0 && r.own_dir && r.n_peers == 0)
        rmdir(r.dir);
out_free:
    free(r.env);
    free(r.peers);
    free(r.events);
    return status;
}

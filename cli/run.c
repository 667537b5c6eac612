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
 */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <limits.h>
#include <signal.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "membership/brokerd.h"
#include "cli.h"
#include "base/clock.h"
#include "cohort.pb-c.h"
#include "base/ident.h"
#include "base/log.h"
#include "base/opt.h"
#include "rpc/rpc.h"
#include "membership/wire.h"

extern char **environ;

#define PROG "cohortctl run"
#define MAX_PEERS 256
#define TICK_MS 50
#define STATUS_EVERY_MS 500
#define STATUS_TIMEOUT_MS 1000
#define SOCKET_WAIT_MS 15000        /* a sidecar listens within this */
#define STOP_GRACE_MS 5000          /* SIGTERM, then SIGKILL */
#define RATE_WINDOW_MS 2000
#define RATE_SLOTS (RATE_WINDOW_MS / TICK_MS + 8)
#define LINE_MAX_TAIL 256           /* progress lines longer than this are skipped */
#define FINAL_MAX 256
#define DURATION_MAX_MS (7ull * 24 * 3600 * 1000)

static const char usage[] =
    "Usage: cohortctl run [-n N] [options] -- CMD [ARGS...]\n"
    "\n"
    "Runs a cohort on this machine: an embedded broker, N cohort-sidecars (from\n"
    "this program's directory) and N trainer processes running CMD, each told\n"
    "how to reach its own sidecar through its environment:\n"
    "  COHORT_SOCKET=unix:PATH  COHORT_COHORT=NAME  COHORT_ID=ID  COHORT_RUN_INDEX=I\n"
    "Peer I has member id peer-I (see --id-prefix). A trainer's stdout and stderr\n"
    "go to I.out and I.err in the run directory, its sidecar's log to\n"
    "I.sidecar.log. At the end each trainer's last stdout line is shown, and the\n"
    "surviving trainers must agree on it when they print \"final ...\" lines.\n"
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

enum action { A_KILL_TRAINER, A_KILL_SIDECAR, A_KILL_PEER, A_ADD };

static const char *const action_names[] = { "kill-trainer", "kill-sidecar", "kill-peer", "add" };

struct event {
    enum action action;
    bool by_version;
    uint64_t at;                /* ms since the start, or a model version */
    long peer;                  /* run index; -1 for add */
    char spec[64];
    bool fired;
    uint64_t fired_ms;          /* since the start */
    char note[160];
};

struct child {
    pid_t pid;                  /* 0: not started */
    bool running;
    int wstatus;
    uint64_t term_ms;           /* when we sent SIGTERM; 0: not sent */
    bool escalated;             /* we had to SIGKILL it after SIGTERM */
};

struct peer {
    unsigned index;
    char id[IDENT_NAME_MAX + 1];
    char sock[108];             /* sun_path's size */
    char out_path[PATH_MAX], err_path[PATH_MAX], sc_path[PATH_MAX];
    struct child trainer, sidecar;
    bool trainer_pending;       /* the sidecar runs; the trainer starts once it listens */
    uint64_t started_ms;
    const char *hit;            /* what the schedule killed, or NULL */
    char failure[192];          /* why this peer counts as failed; "" if it does not */
    /* The tail of the trainer's stderr, for its progress. */
    int err_fd;
    off_t err_off;
    char part[LINE_MAX_TAIL];
    size_t part_len;
    bool part_skip;
    bool has_samples;
    uint64_t samples, version;
    /* From the broker. */
    bool member;
    uint64_t broker_version;
    char final[FINAL_MAX];
};

struct run {
    /* Options. */
    unsigned n;
    const char *cohort, *prefix, *logf, *logl;
    uint64_t timeout_ms, heartbeat_ms, member_timeout_ms, view_ms;
    bool view, tty, json, keep;
    char **cmd;
    /* Where things are. */
    char sidecar[PATH_MAX], dir[PATH_MAX - 64], sockdir[64];
    bool own_dir;
    char **env;
    /* Schedule and peers. */
    struct event *events;
    size_t n_events;
    struct peer *peers;
    size_t n_peers;
    /* The broker. */
    struct brokerd *bd;
    struct rpc_channel *ch;
    char broker[64];
    bool status_ok;
    uint64_t epoch, max_version;
    size_t n_members;
    char leader[IDENT_NAME_MAX + 1];
    /* The view. */
    uint64_t t0;
    struct rate_sample {
        uint64_t t, s;
    } hist[RATE_SLOTS];
    size_t hist_next;
    double rate;
    bool has_rate;
    unsigned view_lines;
    const char *stop_reason;    /* "timeout", "interrupted", or NULL */
};

static volatile sig_atomic_t interrupted;

static void on_signal(int sig)
{
    (void)sig;
    interrupted = 1;
}


/* snprintf that says when it cut: 0, or -ENAMETOOLONG. A cut note or
 * view line is harmless; callers that build paths check. */
static int fmt_into(char *buf, size_t len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int fmt_into(char *buf, size_t len, const char *fmt, ...)
{
    va_list ap;
    int n;

    va_start(ap, fmt);
    n = vsnprintf(buf, len, fmt, ap);
    va_end(ap);
    return n < 0 || (size_t)n >= len ? -ENAMETOOLONG : 0;
}

static double secs(const struct run *r, uint64_t now)
{
    return (double)(now - r->t0) / 1000.0;
}

/* ---- the schedule ------------------------------------------------------ */

/* Parses one ACTION@WHEN[:PEER]. Returns 0, or 2 after saying what is wrong. */
static int parse_event(const char *s, size_t len, struct event *e)
{
    char buf[64], *at, *colon, *when;
    uint64_t v;
    size_t i;

    if (len == 0 || len >= sizeof(buf))
        return opt_usage(PROG, "bad --schedule event \"%s\": empty or too long", len ? "..." : "");
    memcpy(buf, s, len);
    buf[len] = '\0';
    memset(e, 0, sizeof(*e));
    snprintf(e->spec, sizeof(e->spec), "%s", buf);
    e->peer = -1;
    at = strchr(buf, '@');
    if (!at)
        return opt_usage(PROG, "bad --schedule event \"%s\": want ACTION@WHEN[:PEER]", e->spec);
    *at = '\0';
    for (i = 0; i < sizeof(action_names) / sizeof(action_names[0]); i++)
        if (strcmp(buf, action_names[i]) == 0)
            break;
    if (i == sizeof(action_names) / sizeof(action_names[0]))
        return opt_usage(PROG, "bad --schedule event \"%s\": the action is kill-trainer, kill-sidecar, "
                   "kill-peer or add", e->spec);
    e->action = (enum action)i;
    when = at + 1;
    colon = strchr(when, ':');
    if (colon) {
        *colon = '\0';
        if (e->action == A_ADD)
            return opt_usage(PROG, "bad --schedule event \"%s\": add takes no peer", e->spec);
        if (opt_uint(colon + 1, 0, MAX_PEERS - 1, &v) < 0)
            return opt_usage(PROG, "bad --schedule event \"%s\": the peer is a run index, 0 to 255", e->spec);
        e->peer = (long)v;
    } else if (e->action != A_ADD) {
        return opt_usage(PROG, "bad --schedule event \"%s\": a kill names its peer, as in kill-trainer@5s:1",
                   e->spec);
    }
    if (strncmp(when, "v=", 2) == 0) {
        if (opt_uint(when + 2, 0, UINT64_MAX >> 1, &e->at) < 0)
            return opt_usage(PROG, "bad --schedule event \"%s\": v= wants a model version", e->spec);
        e->by_version = true;
    } else if (opt_duration_ms(when, DURATION_MAX_MS, &e->at) < 0) {
        return opt_usage(PROG, "bad --schedule event \"%s\": WHEN is a duration (5s, 1500ms) or v=N", e->spec);
    }
    return 0;
}

static int parse_schedule(const char *spec, struct event **out, size_t *n)
{
    size_t cap = 1, k = 0;
    struct event *ev;
    const char *p;

    for (p = spec; *p; p++)
        cap += *p == ',';
    ev = calloc(cap, sizeof(*ev));
    if (!ev)
        return 1;
    for (p = spec;;) {
        size_t len = strcspn(p, ",");
        int rc = parse_event(p, len, &ev[k]);
        if (rc) {
            free(ev);
            return rc;
        }
        k++;
        if (!p[len])
            break;
        p += len + 1;
    }
    *out = ev;
    *n = k;
    return 0;
}

/* ---- processes --------------------------------------------------------- */

/* Our environment without the variables we set for each trainer (and the
 * broker address, which would let a trainer bypass its sidecar), with room
 * for those at the end. */
static char **base_env(size_t extra, size_t *n_out)
{
    static const char *const drop[] = { "COHORT_SOCKET=", "COHORT_COHORT=", "COHORT_ID=",
                                        "COHORT_RUN_INDEX=", "COHORT_BROKER=" };
    size_t n = 0, k = 0;
    char **env;

    while (environ[n])
        n++;
    env = calloc(n + extra + 1, sizeof(*env));
    if (!env)
        return NULL;
    for (size_t i = 0; i < n; i++) {
        bool skip = false;
        for (size_t d = 0; d < sizeof(drop) / sizeof(drop[0]); d++)
            skip |= strncmp(environ[i], drop[d], strlen(drop[d])) == 0;
        if (!skip)
            env[k++] = environ[i];
    }
    *n_out = k;
    return env;
}

/* Starts argv with stdin from /dev/null, stdout to out_path and stderr to
 * err_path (NULL: the same file). Signals we catch or ignore are reset for
 * the child. Returns 0 or -errno. */
static int spawn(char *const argv[], char *const envp[], const char *out_path,
                 const char *err_path, bool search_path, pid_t *pid)
{
    posix_spawn_file_actions_t fa;
    posix_spawnattr_t at;
    sigset_t none, def;
    int rc;

    posix_spawn_file_actions_init(&fa);
    posix_spawnattr_init(&at);
    posix_spawn_file_actions_addopen(&fa, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
    posix_spawn_file_actions_addopen(&fa, STDOUT_FILENO, out_path,
                                     O_WRONLY | O_CREAT | O_TRUNC | O_APPEND, 0644);
    if (err_path)
        posix_spawn_file_actions_addopen(&fa, STDERR_FILENO, err_path,
                                         O_WRONLY | O_CREAT | O_TRUNC | O_APPEND, 0644);
    else
        posix_spawn_file_actions_adddup2(&fa, STDOUT_FILENO, STDERR_FILENO);
    sigemptyset(&none);
    sigemptyset(&def);
    sigaddset(&def, SIGINT);
    sigaddset(&def, SIGTERM);
    sigaddset(&def, SIGPIPE);
    posix_spawnattr_setsigmask(&at, &none);
    posix_spawnattr_setsigdefault(&at, &def);
    posix_spawnattr_setflags(&at, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
    rc = search_path ? posix_spawnp(pid, argv[0], &fa, &at, argv, envp)
                     : posix_spawn(pid, argv[0], &fa, &at, argv, envp);
    posix_spawnattr_destroy(&at);
    posix_spawn_file_actions_destroy(&fa);
    return -rc;
}

static void describe_exit(int wstatus, char *buf, size_t len)
{
    if (WIFEXITED(wstatus))
        snprintf(buf, len, "exit %d", WEXITSTATUS(wstatus));
    else if (WIFSIGNALED(wstatus))
        snprintf(buf, len, "killed (SIG%s)", sigabbrev_np(WTERMSIG(wstatus)) ?
                 sigabbrev_np(WTERMSIG(wstatus)) : "?");
    else
        snprintf(buf, len, "status %d", wstatus);
}

static void describe_child(const struct child *c, char *buf, size_t len)
{
    if (c->pid == 0)
        snprintf(buf, len, "not started");
    else if (c->running)
        snprintf(buf, len, "running");
    else
        describe_exit(c->wstatus, buf, len);
}

static bool exited_ok(const struct child *c)
{
    return c->pid && !c->running && WIFEXITED(c->wstatus) && WEXITSTATUS(c->wstatus) == 0;
}

/* ---- output while running ---------------------------------------------- */

static int term_width(void)
{
    struct winsize ws;

    if (ioctl(STDERR_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 20)
        return ws.ws_col;
    return 120;
}

/* Clears the in-place view so that a line can be printed above it. */
static void view_erase(struct run *r)
{
    if (!r->tty || !r->view_lines)
        return;
    fprintf(stderr, "\033[%uA", r->view_lines);
    for (unsigned i = 0; i < r->view_lines; i++)
        fputs("\033[2K\n", stderr);
    fprintf(stderr, "\033[%uA", r->view_lines);
    r->view_lines = 0;
}

static void note(struct run *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void note(struct run *r, const char *fmt, ...)
{
    char line[512];
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(line, sizeof(line), fmt, ap);
    va_end(ap);
    view_erase(r);
    fprintf(stderr, PROG ": %5.1fs: %s\n", secs(r, clock_now_ms()), line);
    fflush(stderr);
}

static const char *peer_state(const struct peer *p, const char *leader, char *buf, size_t len)
{
    if (p->hit)
        snprintf(buf, len, "%s killed", p->hit);
    else if (p->trainer_pending)
        snprintf(buf, len, "starting");
    else if (p->trainer.running)
        snprintf(buf, len, "v%llu%s", (unsigned long long)(p->version > p->broker_version ?
                                                            p->version : p->broker_version),
                 !p->member ? " (not a member)" : strcmp(p->id, leader) == 0 ? " (leader)" : "");
    else if (p->trainer.pid && exited_ok(&p->trainer))
        snprintf(buf, len, "done");
    else if (p->trainer.pid)
        snprintf(buf, len, "FAILED");
    else
        snprintf(buf, len, "-");
    return buf;
}

/* Appends to buf at *k, never past len (a cut line is fine for a view). */
static void add(char *buf, size_t len, size_t *k, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static void add(char *buf, size_t len, size_t *k, const char *fmt, ...)
{
    va_list ap;
    int n;

    if (*k >= len - 1)
        return;
    va_start(ap, fmt);
    n = vsnprintf(buf + *k, len - *k, fmt, ap);
    va_end(ap);
    if (n > 0)
        *k = *k + (size_t)n < len - 1 ? *k + (size_t)n : len - 1;
}

static void view_draw(struct run *r, uint64_t now)
{
    char l1[512], l2[2048], l3[256], st[64];
    size_t k1 = 0, k2 = 0, k3 = 0, fired = 0;
    const struct event *next = NULL;
    int width = term_width() - 1;

    add(l1, sizeof(l1), &k1, "%s  t=%.1fs  epoch %llu  leader %s  members %zu  step %llu  "
        "samples/s ", r->cohort, secs(r, now), (unsigned long long)r->epoch,
        r->leader[0] ? r->leader : "-", r->n_members, (unsigned long long)r->max_version);
    if (r->has_rate)
        add(l1, sizeof(l1), &k1, "%.0f", r->rate);
    else
        add(l1, sizeof(l1), &k1, "-");
    add(l2, sizeof(l2), &k2, "peers:");
    for (size_t i = 0; i < r->n_peers; i++)
        add(l2, sizeof(l2), &k2, " %s=%s", r->peers[i].id, peer_state(&r->peers[i], r->leader, st, sizeof(st)));
    for (size_t i = 0; i < r->n_events; i++) {
        if (r->events[i].fired)
            fired++;
        else if (!next)
            next = &r->events[i];
    }
    if (r->n_events)
        add(l3, sizeof(l3), &k3, "schedule: %zu of %zu fired%s%s", fired, r->n_events,
            next ? "; next " : "", next ? next->spec : "");
    if (!r->tty) {
        fprintf(stderr, PROG ": %s | %s%s%s\n", l1, l2, k3 ? " | " : "", k3 ? l3 : "");
        fflush(stderr);
        return;
    }
    /* Over the previous view, line by line: no flicker. */
    unsigned lines = k3 ? 3 : 2;
    if (r->view_lines)
        fprintf(stderr, "\033[%uA", r->view_lines);
    fprintf(stderr, "\033[2K%.*s\n\033[2K%.*s\n", width, l1, width, l2);
    if (k3)
        fprintf(stderr, "\033[2K%.*s\n", width, l3);
    if (r->view_lines > lines) {
        for (unsigned i = lines; i < r->view_lines; i++)
            fputs("\033[2K\n", stderr);
        fprintf(stderr, "\033[%uA", r->view_lines - lines);
    }
    r->view_lines = lines;
    fflush(stderr);
}

/* ---- what the trainers and the broker say ------------------------------ */

/* The number after "key=" in a line, where key starts a word. */
static bool field_u64(const char *line, const char *key, uint64_t *out)
{
    size_t klen = strlen(key);

    for (const char *p = line; (p = strstr(p, key)) != NULL; p += klen) {
        char *end;
        unsigned long long v;
        if ((p != line && p[-1] != ' ' && p[-1] != '\t') || p[klen] != '=' ||
            p[klen + 1] < '0' || p[klen + 1] > '9')
            continue;
        errno = 0;
        v = strtoull(p + klen + 1, &end, 10);
        if (errno)
            continue;
        *out = v;
        return true;
    }
    return false;
}

static void progress_line(struct peer *p, const char *line)
{
    uint64_t v;

    if (field_u64(line, "samples", &v)) {
        p->samples = v;
        p->has_samples = true;
    }
    if (field_u64(line, "model_version", &v))
        p->version = v;
}

/* Reads what the trainer wrote to stderr since the last call. */
static void read_progress(struct peer *p)
{
    char buf[4096];
    ssize_t n;

    if (p->err_fd < 0 && p->trainer.pid)
        p->err_fd = open(p->err_path, O_RDONLY | O_CLOEXEC);
    if (p->err_fd < 0)
        return;
    while ((n = pread(p->err_fd, buf, sizeof(buf), p->err_off)) > 0) {
        p->err_off += n;
        for (ssize_t i = 0; i < n; i++) {
            if (buf[i] == '\n') {
                p->part[p->part_len] = '\0';
                if (!p->part_skip)
                    progress_line(p, p->part);
                p->part_len = 0;
                p->part_skip = false;
            } else if (p->part_len < sizeof(p->part) - 1) {
                p->part[p->part_len++] = buf[i];
            } else {
                p->part_skip = true;
            }
        }
    }
}

static void poll_status(struct run *r)
{
    Cohort__V1__StatusRequest q = COHORT__V1__STATUS_REQUEST__INIT;
    ProtobufCMessage *reply = NULL;
    const Cohort__V1__StatusReply *rep;
    struct rpc_status st;

    q.protocol_version = WIRE_PROTOCOL_VERSION;
    q.cohort = (char *)r->cohort;
    if (rpc_call(r->ch, WIRE_BROKER_STATUS, &q.base, &cohort__v1__status_reply__descriptor,
                 STATUS_TIMEOUT_MS, 0, &reply, &st) < 0) {
        r->status_ok = false;
        return;
    }
    rep = (const Cohort__V1__StatusReply *)reply;
    r->status_ok = true;
    for (size_t i = 0; i < r->n_peers; i++)
        r->peers[i].member = false;
    if (rep->n_cohorts == 1) {
        const Cohort__V1__CohortStatus *c = rep->cohorts[0];
        r->epoch = c->epoch;
        r->n_members = c->n_members;
        snprintf(r->leader, sizeof(r->leader), "%s", c->leader);
        for (size_t k = 0; k < c->n_members; k++) {
            const Cohort__V1__Member *m = c->members[k];
            if (m->model_version > r->max_version)
                r->max_version = m->model_version;
            for (size_t i = 0; i < r->n_peers; i++) {
                if (strcmp(r->peers[i].id, m->id) == 0) {
                    r->peers[i].member = true;
                    r->peers[i].broker_version = m->model_version;
                }
            }
        }
    }
    protobuf_c_message_free_unpacked(reply, NULL);
}

/* samples/s over the last RATE_WINDOW_MS: the cohort's committed samples
 * (the highest count any trainer printed) sampled every tick. */
static void update_rate(struct run *r, uint64_t now)
{
    uint64_t s = 0;
    bool any = false;
    size_t oldest;

    for (size_t i = 0; i < r->n_peers; i++) {
        const struct peer *p = &r->peers[i];
        if (p->has_samples) {
            any = true;
            if (p->samples > s)
                s = p->samples;
        }
        if (p->version > r->max_version)
            r->max_version = p->version;
    }
    if (!any)
        return;
    r->hist[r->hist_next % RATE_SLOTS] = (struct rate_sample){ now, s };
    r->hist_next++;
    oldest = r->hist_next > RATE_SLOTS ? r->hist_next - RATE_SLOTS : 0;
    for (size_t i = oldest; i < r->hist_next; i++) {
        const struct rate_sample *h = &r->hist[i % RATE_SLOTS];
        if (now - h->t <= RATE_WINDOW_MS) {
            if (now - h->t >= RATE_WINDOW_MS / 4) {
                r->rate = (double)(s >= h->s ? s - h->s : 0) * 1000.0 / (double)(now - h->t);
                r->has_rate = true;
            }
            break;
        }
    }
}

/* ---- peers ------------------------------------------------------------- */

static struct peer *new_peer(struct run *r, uint64_t now)
{
    struct peer *p;

    if (r->n_peers == MAX_PEERS)
        return NULL;
    p = &r->peers[r->n_peers];
    memset(p, 0, sizeof(*p));
    p->index = (unsigned)r->n_peers;
    p->err_fd = -1;
    p->started_ms = now;
    /* make_dirs() checked that these fit. */
    fmt_into(p->id, sizeof(p->id), "%s%u", r->prefix, p->index);
    fmt_into(p->sock, sizeof(p->sock), "%s/%u.sock", r->sockdir, p->index);
    fmt_into(p->out_path, sizeof(p->out_path), "%s/%u.out", r->dir, p->index);
    fmt_into(p->err_path, sizeof(p->err_path), "%s/%u.err", r->dir, p->index);
    fmt_into(p->sc_path, sizeof(p->sc_path), "%s/%u.sidecar.log", r->dir, p->index);
    r->n_peers++;
    return p;
}

static void fail(struct peer *p, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void fail(struct peer *p, const char *fmt, ...)
{
    va_list ap;

    if (p->failure[0])
        return;                 /* the first reason is the one that matters */
    va_start(ap, fmt);
    vsnprintf(p->failure, sizeof(p->failure), fmt, ap);
    va_end(ap);
}

/* Starts a peer's sidecar; its trainer follows once the socket is there. */
static int start_peer(struct run *r, uint64_t now)
{
    struct peer *p = new_peer(r, now);
    int rc;

    if (!p) {
        note(r, "Not adding a peer: the run already has %d.", MAX_PEERS);
        return -ENOSPC;
    }
    char *argv[] = { r->sidecar, "--broker", r->broker, "--cohort", (char *)r->cohort,
                     "--id", p->id, "--socket", p->sock, "--log-format", (char *)(r->logf ? r->logf : "text"),
                     "--log-level", "info", NULL };
    rc = spawn(argv, r->env, p->sc_path, NULL, false, &p->sidecar.pid);
    if (rc < 0) {
        p->sidecar.pid = 0;
        fail(p, "its sidecar could not start: %s", strerror(-rc));
        note(r, "%s: the sidecar %s could not start: %s.", p->id, r->sidecar, strerror(-rc));
        return rc;
    }
    p->sidecar.running = true;
    p->trainer_pending = true;
    return 0;
}

static int start_trainer(struct run *r, struct peer *p)
{
    char sock[160], cohort[IDENT_NAME_MAX + 16], id[IDENT_NAME_MAX + 16], idx[48];
    size_t n = 0;
    int rc;

    while (r->env[n])
        n++;
    snprintf(sock, sizeof(sock), "COHORT_SOCKET=unix:%s", p->sock);
    snprintf(cohort, sizeof(cohort), "COHORT_COHORT=%s", r->cohort);
    snprintf(id, sizeof(id), "COHORT_ID=%s", p->id);
    snprintf(idx, sizeof(idx), "COHORT_RUN_INDEX=%u", p->index);
    r->env[n] = sock;
    r->env[n + 1] = cohort;
    r->env[n + 2] = id;
    r->env[n + 3] = idx;
    rc = spawn(r->cmd, r->env, p->out_path, p->err_path, true, &p->trainer.pid);
    for (size_t k = n; k < n + 4; k++)
        r->env[k] = NULL;       /* the base environment again */
    p->trainer_pending = false;
    if (rc < 0) {
        p->trainer.pid = 0;
        fail(p, "its trainer could not start: %s", strerror(-rc));
        note(r, "%s: cannot start %s: %s.", p->id, r->cmd[0], strerror(-rc));
        return rc;
    }
    p->trainer.running = true;
    return 0;
}

static void signal_child(struct child *c, int sig, uint64_t now)
{
    if (!c->running)
        return;
    kill(c->pid, sig);
    if (sig == SIGTERM && !c->term_ms)
        c->term_ms = now;
}

/* Collects children that exited and decides what each exit means. */
static void reap(struct run *r, uint64_t now)
{
    char how[64];

    for (size_t i = 0; i < r->n_peers; i++) {
        struct peer *p = &r->peers[i];
        int ws;

        if (p->trainer.running && waitpid(p->trainer.pid, &ws, WNOHANG) == p->trainer.pid) {
            p->trainer.running = false;
            p->trainer.wstatus = ws;
            describe_exit(ws, how, sizeof(how));
            read_progress(p);
            if (p->hit) {
                note(r, "%s's trainer ended: %s (expected: its %s was killed).", p->id, how, p->hit);
            } else if (exited_ok(&p->trainer)) {
                note(r, "%s's trainer finished (%s).", p->id, how);
            } else {
                fail(p, "its trainer failed: %s", how);
                note(r, "%s's trainer FAILED: %s; see %s.", p->id, how, p->err_path);
            }
            /* Its member left when the trainer disconnected; the sidecar
             * has nothing more to do. */
            signal_child(&p->sidecar, SIGTERM, now);
        }
        if (p->sidecar.running && waitpid(p->sidecar.pid, &ws, WNOHANG) == p->sidecar.pid) {
            p->sidecar.running = false;
            p->sidecar.wstatus = ws;
            describe_exit(ws, how, sizeof(how));
            if (p->hit)
                continue;
            if (!p->sidecar.term_ms) {
                fail(p, "its sidecar exited by itself (%s)", how);
                note(r, "%s's sidecar exited by itself (%s); see %s.", p->id, how, p->sc_path);
            } else if (!exited_ok(&p->sidecar) && !p->sidecar.escalated) {
                fail(p, "its sidecar did not stop cleanly (%s)", how);
                note(r, "%s's sidecar did not stop cleanly (%s); see %s.", p->id, how, p->sc_path);
            }
        }
    }
}

/* Starts trainers whose sidecars listen, and SIGKILLs sidecars that
 * ignored SIGTERM. */
static void tend(struct run *r, uint64_t now)
{
    struct stat st;

    for (size_t i = 0; i < r->n_peers; i++) {
        struct peer *p = &r->peers[i];
        if (p->trainer_pending) {
            if (!p->sidecar.running) {
                p->trainer_pending = false;
                if (!p->hit)
                    fail(p, "its sidecar exited before it listened");
            } else if ((stat(p->sock, &st) == 0 && S_ISSOCK(st.st_mode)) ||
                       now - p->started_ms > SOCKET_WAIT_MS) {
                start_trainer(r, p);
            }
        }
        if (p->sidecar.running && p->sidecar.term_ms && !p->sidecar.escalated &&
            now - p->sidecar.term_ms > STOP_GRACE_MS) {
            kill(p->sidecar.pid, SIGKILL);
            p->sidecar.escalated = true;
            if (!p->hit)
                fail(p, "its sidecar did not stop within %d s of SIGTERM", STOP_GRACE_MS / 1000);
            note(r, "%s's sidecar did not stop within %d s of SIGTERM; killed it.", p->id,
                 STOP_GRACE_MS / 1000);
        }
    }
}

static void fire(struct run *r, struct event *e, uint64_t now)
{
    struct peer *p;

    e->fired = true;
    e->fired_ms = now - r->t0;
    if (e->action == A_ADD) {
        if (start_peer(r, now) == 0)
            fmt_into(e->note, sizeof(e->note), "started %s", r->peers[r->n_peers - 1].id);
        else
            fmt_into(e->note, sizeof(e->note), "could not start a peer");
        note(r, "%s: %s.", e->spec, e->note);
        return;
    }
    if ((size_t)e->peer >= r->n_peers) {
        fmt_into(e->note, sizeof(e->note), "skipped: there is no peer %ld", e->peer);
        note(r, "%s: %s.", e->spec, e->note);
        return;
    }
    p = &r->peers[e->peer];
    bool t = e->action != A_KILL_SIDECAR, s = e->action != A_KILL_TRAINER;
    if ((t && !p->trainer.running) || (s && !p->sidecar.running)) {
        fmt_into(e->note, sizeof(e->note), "skipped: %s's %s is not running", p->id,
                 t && !p->trainer.running ? "trainer" : "sidecar");
        note(r, "%s: %s.", e->spec, e->note);
        return;
    }
    p->hit = e->action == A_KILL_TRAINER ? "trainer" : e->action == A_KILL_SIDECAR ? "sidecar" : "peer";
    if (s)
        kill(p->sidecar.pid, SIGKILL);
    if (t)
        kill(p->trainer.pid, SIGKILL);
    fmt_into(e->note, sizeof(e->note), "SIGKILL to %s's %s", p->id,
             e->action == A_KILL_PEER ? "trainer and sidecar" : p->hit);
    note(r, "%s: %s (model version %llu).", e->spec, e->note, (unsigned long long)r->max_version);
}

static void fire_due(struct run *r, uint64_t now)
{
    for (size_t i = 0; i < r->n_events; i++) {
        struct event *e = &r->events[i];
        if (e->fired)
            continue;
        if (e->by_version ? r->max_version >= e->at : now - r->t0 >= e->at)
            fire(r, e, now);
    }
}

static bool trainers_left(const struct run *r)
{
    for (size_t i = 0; i < r->n_peers; i++)
        if (r->peers[i].trainer.running || r->peers[i].trainer_pending)
            return true;
    return false;
}

static bool children_left(const struct run *r)
{
    for (size_t i = 0; i < r->n_peers; i++)
        if (r->peers[i].trainer.running || r->peers[i].sidecar.running)
            return true;
    return false;
}

/* Stops what is still running: trainers first (SIGTERM, then SIGKILL
 * after the grace), then sidecars. Bounded by two graces. */
static void stop_all(struct run *r)
{
    uint64_t now = clock_now_ms(), until;

    for (size_t i = 0; i < r->n_peers; i++) {
        r->peers[i].trainer_pending = false;
        signal_child(&r->peers[i].trainer, SIGTERM, now);
    }
    until = now + STOP_GRACE_MS;
    while (clock_now_ms() < until) {
        bool any = false;
        reap(r, clock_now_ms());
        for (size_t i = 0; i < r->n_peers; i++)
            any |= r->peers[i].trainer.running;
        if (!any)
            break;
        clock_sleep_ms(TICK_MS);
    }
    for (size_t i = 0; i < r->n_peers; i++) {
        struct peer *p = &r->peers[i];
        if (p->trainer.running) {
            kill(p->trainer.pid, SIGKILL);
            p->trainer.escalated = true;
            note(r, "%s's trainer did not stop within %d s of SIGTERM; killed it.", p->id,
                 STOP_GRACE_MS / 1000);
        }
        signal_child(&p->sidecar, SIGTERM, clock_now_ms());
    }
    /* reap() and tend() escalate sidecars after their own grace. */
    until = clock_now_ms() + 2 * STOP_GRACE_MS;
    while (children_left(r) && clock_now_ms() < until) {
        reap(r, clock_now_ms());
        tend(r, clock_now_ms());
        clock_sleep_ms(TICK_MS);
    }
    /* Whatever still runs gets SIGKILL; one that survives even that (stuck
     * in the kernel) is left behind after a last second, not waited for. */
    for (size_t i = 0; i < r->n_peers; i++) {
        struct peer *p = &r->peers[i];
        if (p->trainer.running)
            kill(p->trainer.pid, SIGKILL);
        if (p->sidecar.running)
            kill(p->sidecar.pid, SIGKILL);
    }
    until = clock_now_ms() + 1000;
    while (children_left(r) && clock_now_ms() < until) {
        for (size_t i = 0; i < r->n_peers; i++) {
            struct child *cs[2] = { &r->peers[i].trainer, &r->peers[i].sidecar };
            for (int k = 0; k < 2; k++)
                if (cs[k]->running && waitpid(cs[k]->pid, &cs[k]->wstatus, WNOHANG) == cs[k]->pid)
                    cs[k]->running = false;
        }
        clock_sleep_ms(10);
    }
}

/* ---- the end ----------------------------------------------------------- */

/* The trainer's last non-empty stdout line. */
static void read_final(struct peer *p)
{
    char buf[4096];
    ssize_t n;
    off_t size;
    int fd = open(p->out_path, O_RDONLY | O_CLOEXEC);

    p->final[0] = '\0';
    if (fd < 0)
        return;
    size = lseek(fd, 0, SEEK_END);
    n = size > 0 ? pread(fd, buf, sizeof(buf) - 1, size > (off_t)sizeof(buf) - 1 ?
                         size - (off_t)sizeof(buf) + 1 : 0) : 0;
    close(fd);
    if (n <= 0)
        return;
    buf[n] = '\0';
    while (n > 0 && (buf[n - 1] == '\n' || buf[n - 1] == '\r' || buf[n - 1] == ' '))
        buf[--n] = '\0';
    char *start = strrchr(buf, '\n');
    start = start ? start + 1 : buf;
    n = (ssize_t)strlen(start);
    if ((size_t)n >= sizeof(p->final))
        n = (ssize_t)sizeof(p->final) - 1;
    memcpy(p->final, start, (size_t)n);
    p->final[n] = '\0';
}

struct verdict {
    size_t survivors, failed, with_final;
    bool agree;                 /* survivors' "final" lines all equal */
    const char *final;          /* that line, or NULL */
};

static void judge(struct run *r, struct verdict *v)
{
    memset(v, 0, sizeof(*v));
    v->agree = true;
    for (size_t i = 0; i < r->n_peers; i++) {
        struct peer *p = &r->peers[i];
        read_final(p);
        if (p->failure[0] && !p->hit)
            v->failed++;
        if (p->hit || !exited_ok(&p->trainer))
            continue;
        v->survivors++;
        if (strncmp(p->final, "final ", 6) == 0)
            v->with_final++;
    }
    if (v->with_final == 0)
        return;
    for (size_t i = 0; i < r->n_peers; i++) {
        struct peer *p = &r->peers[i];
        if (p->hit || !exited_ok(&p->trainer))
            continue;
        if (!v->final)
            v->final = p->final;
        else if (strcmp(v->final, p->final) != 0)
            v->agree = false;
    }
    if (!v->agree)
        v->final = NULL;
}

static const char *reason_of(const struct run *r, const struct verdict *v)
{
    if (r->stop_reason)
        return r->stop_reason;
    if (v->failed)
        return "a trainer or sidecar failed";
    if (!v->agree)
        return "the surviving trainers disagree";
    return NULL;
}

static void print_table(struct run *r, const struct verdict *v, uint64_t now)
{
    char t[64], s[64];
    int wid = 4;

    for (size_t i = 0; i < r->n_peers; i++)
        if ((int)strlen(r->peers[i].id) > wid)
            wid = (int)strlen(r->peers[i].id);
    printf("%-*s  %-18s  %-18s  %s\n", wid, "PEER", "TRAINER", "SIDECAR", "LAST LINE");
    for (size_t i = 0; i < r->n_peers; i++) {
        struct peer *p = &r->peers[i];
        describe_child(&p->trainer, t, sizeof(t));
        describe_child(&p->sidecar, s, sizeof(s));
        printf("%-*s  %-18s  %-18s  %s", wid, p->id, t, s, p->final[0] ? p->final : "-");
        if (p->hit)
            printf("  (%s killed by the schedule)", p->hit);
        else if (p->failure[0])
            printf("  (FAILED: %s)", p->failure);
        putchar('\n');
    }
    for (size_t i = 0; i < r->n_events; i++) {
        const struct event *e = &r->events[i];
        if (e->fired)
            printf("event %s at %.1fs: %s\n", e->spec, (double)e->fired_ms / 1000.0, e->note);
        else
            printf("event %s: did not fire\n", e->spec);
    }
    if (v->with_final == 0)
        printf("agreement: no surviving trainer printed a \"final ...\" line\n");
    else if (v->agree)
        printf("agreement: all %zu surviving trainers end with \"%s\"\n", v->survivors, v->final);
    else
        printf("agreement: NO: the surviving trainers end differently (see the lines above)\n");
    printf("%s after %.1fs%s%s\n", reason_of(r, v) ? "FAILED" : "ok", secs(r, now),
           reason_of(r, v) ? ": " : "", reason_of(r, v) ? reason_of(r, v) : "");
}

static cJSON *child_json(const struct child *c)
{
    cJSON *o = cJSON_CreateObject();

    if (c->pid)
        cJSON_AddNumberToObject(o, "pid", c->pid);
    else
        cJSON_AddNullToObject(o, "pid");
    cJSON_AddBoolToObject(o, "running", c->running);
    if (c->pid && !c->running && WIFEXITED(c->wstatus))
        cJSON_AddNumberToObject(o, "exit_code", WEXITSTATUS(c->wstatus));
    else
        cJSON_AddNullToObject(o, "exit_code");
    if (c->pid && !c->running && WIFSIGNALED(c->wstatus))
        cJSON_AddStringToObject(o, "signal", sigabbrev_np(WTERMSIG(c->wstatus)) ?
                                sigabbrev_np(WTERMSIG(c->wstatus)) : "?");
    else
        cJSON_AddNullToObject(o, "signal");
    return o;
}

static void print_json(struct run *r, const struct verdict *v, uint64_t now)
{
    cJSON *o = cJSON_CreateObject(), *peers, *events;
    const char *reason = reason_of(r, v);
    char *text;

    cJSON_AddStringToObject(o, "cohort", r->cohort);
    cJSON_AddStringToObject(o, "broker", r->broker);
    cJSON_AddStringToObject(o, "run_dir", r->dir);
    cJSON_AddBoolToObject(o, "ok", reason == NULL);
    if (reason)
        cJSON_AddStringToObject(o, "reason", reason);
    else
        cJSON_AddNullToObject(o, "reason");
    cJSON_AddNumberToObject(o, "elapsed_s", secs(r, now));
    cJSON_AddNumberToObject(o, "survivors", (double)v->survivors);
    if (v->with_final)
        cJSON_AddBoolToObject(o, "agree", v->agree);
    else
        cJSON_AddNullToObject(o, "agree");
    if (v->final)
        cJSON_AddStringToObject(o, "final", v->final);
    else
        cJSON_AddNullToObject(o, "final");
    cJSON_AddNumberToObject(o, "max_model_version", (double)r->max_version);
    peers = cJSON_AddArrayToObject(o, "peers");
    for (size_t i = 0; i < r->n_peers; i++) {
        struct peer *p = &r->peers[i];
        cJSON *q = cJSON_CreateObject();
        cJSON_AddNumberToObject(q, "index", p->index);
        cJSON_AddStringToObject(q, "id", p->id);
        cJSON_AddItemToObject(q, "trainer", child_json(&p->trainer));
        cJSON_AddItemToObject(q, "sidecar", child_json(&p->sidecar));
        if (p->hit)
            cJSON_AddStringToObject(q, "killed", p->hit);
        else
            cJSON_AddNullToObject(q, "killed");
        cJSON_AddBoolToObject(q, "failed", p->failure[0] && !p->hit);
        if (p->failure[0] && !p->hit)
            cJSON_AddStringToObject(q, "failure", p->failure);
        else
            cJSON_AddNullToObject(q, "failure");
        cJSON_AddStringToObject(q, "last_line", p->final);
        cJSON_AddNumberToObject(q, "started_s", secs(r, p->started_ms));
        cJSON_AddStringToObject(q, "stdout", p->out_path);
        cJSON_AddStringToObject(q, "stderr", p->err_path);
        cJSON_AddStringToObject(q, "sidecar_log", p->sc_path);
        cJSON_AddItemToArray(peers, q);
    }
    events = cJSON_AddArrayToObject(o, "events");
    for (size_t i = 0; i < r->n_events; i++) {
        const struct event *e = &r->events[i];
        cJSON *q = cJSON_CreateObject();
        cJSON_AddStringToObject(q, "spec", e->spec);
        cJSON_AddBoolToObject(q, "fired", e->fired);
        if (e->fired) {
            cJSON_AddNumberToObject(q, "at_s", (double)e->fired_ms / 1000.0);
            cJSON_AddStringToObject(q, "note", e->note);
        } else {
            cJSON_AddNullToObject(q, "at_s");
            cJSON_AddNullToObject(q, "note");
        }
        cJSON_AddItemToArray(events, q);
    }
    text = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    if (text)
        puts(text);
    free(text);
}

/* Removes the files this run made in dir, then dir (left alone if it
 * holds anything else). */
static void remove_run_files(struct run *r)
{
    for (size_t i = 0; i < r->n_peers; i++) {
        unlink(r->peers[i].out_path);
        unlink(r->peers[i].err_path);
        unlink(r->peers[i].sc_path);
    }
    rmdir(r->dir);
}

/* ---- the run ----------------------------------------------------------- */

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
        if (fmt_into(r->dir, sizeof(r->dir), "%s", full) < 0) {
            fprintf(stderr, PROG ": --run-dir %s: the path is too long\n", run_dir);
            return -ENAMETOOLONG;
        }
    } else {
        if (fmt_into(r->dir, sizeof(r->dir), "%s/cohort-run-XXXXXX", tmp) < 0) {
            fprintf(stderr, PROG ": $TMPDIR is too long\n");
            return -ENAMETOOLONG;
        }
        if (!mkdtemp(r->dir)) {
            fprintf(stderr, PROG ": cannot create a run directory in %s: %s\n", tmp, strerror(errno));
            return -errno;
        }
        r->own_dir = true;
    }
    /* Sockets get a short private directory of their own: a Unix socket
     * path must fit in 108 bytes, wherever the logs go. */
    snprintf(r->sockdir, sizeof(r->sockdir), "/tmp/cohort-sock-XXXXXX");
    if (!mkdtemp(r->sockdir)) {
        fprintf(stderr, PROG ": cannot create a socket directory in /tmp: %s\n", strerror(errno));
        if (r->own_dir)
            rmdir(r->dir);
        return -errno;
    }
    return 0;
}

static void remove_sockdir(struct run *r)
{
    char path[PATH_MAX];

    for (size_t i = 0; i < r->n_peers; i++)
        unlink(r->peers[i].sock);
    for (unsigned i = 0; i < MAX_PEERS; i++) {
        fmt_into(path, sizeof(path), "%s/%u.sock", r->sockdir, i);
        unlink(path);
    }
    rmdir(r->sockdir);
}

static int start_broker(struct run *r)
{
    struct brokerd_config cfg = { .listen = "127.0.0.1:0" };
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
        start_peer(r, r->t0);
    for (;;) {
        now = clock_now_ms();
        if (interrupted) {
            r->stop_reason = "interrupted";
            break;
        }
        if (now - r->t0 >= r->timeout_ms) {
            r->stop_reason = "timeout";
            note(r, "The run took longer than --timeout; stopping everything.");
            break;
        }
        reap(r, now);
        tend(r, now);
        for (size_t i = 0; i < r->n_peers; i++)
            read_progress(&r->peers[i]);
        if (now >= next_status) {
            poll_status(r);
            next_status = now + STATUS_EVERY_MS;
        }
        update_rate(r, now);
        fire_due(r, now);
        if (!trainers_left(r))
            break;
        if (r->view && now >= next_view) {
            view_draw(r, now);
            next_view = now + r->view_ms;
        }
        clock_sleep_ms(TICK_MS);
    }
    if (r->view)
        view_draw(r, clock_now_ms());
    if (r->stop_reason && strcmp(r->stop_reason, "interrupted") == 0)
        note(r, "Interrupted; stopping everything.");
    stop_all(r);
    now = clock_now_ms();
    judge(r, &v);
    reason = reason_of(r, &v);
    status = reason ? 1 : 0;
    if (r->json)
        print_json(r, &v, now);
    else
        print_table(r, &v, now);
    fflush(stdout);
    if (r->own_dir && !r->keep && status == 0) {
        remove_run_files(r);
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
            if (opt_duration_ms(optarg, 600000, &r.member_timeout_ms) < 0 || r.member_timeout_ms == 0)
                return opt_usage(PROG, "bad --member-timeout \"%s\" (a duration up to 10m)", optarg);
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
    if (strcmp(output, "table") != 0 && strcmp(output, "json") != 0)
        return opt_usage(PROG, "-o must be table or json, not \"%s\"", output);
    r.json = strcmp(output, "json") == 0;
    if (schedule && (rc = parse_schedule(schedule, &r.events, &r.n_events)) != 0)
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
        fmt_into(r.sidecar, sizeof(r.sidecar), "%s/cohort-sidecar", self);
    }
    if (access(r.sidecar, X_OK) < 0) {
        fprintf(stderr, PROG ": no sidecar at %s: %s (build it, or give --sidecar)\n", r.sidecar,
                strerror(errno));
        free(r.events);
        return 1;
    }
    r.peers = calloc(MAX_PEERS, sizeof(*r.peers));
    r.env = base_env(4, &n_env);
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
    if (start_broker(&r) == 0)
        status = execute(&r);
    rpc_channel_destroy(r.ch);
    brokerd_stop(r.bd);
    rpc_shutdown();
out_dirs:
    sigaction(SIGINT, &old_int, NULL);
    sigaction(SIGTERM, &old_term, NULL);
    remove_sockdir(&r);
    if (status != 0 && r.own_dir && r.n_peers == 0)
        rmdir(r.dir);
out_free:
    free(r.env);
    free(r.peers);
    free(r.events);
    return status;
}

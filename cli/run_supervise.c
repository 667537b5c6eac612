/* cli/run_supervise.c: `cohortctl run`'s children: starting each peer's
 * sidecar and then its trainer, reaping them and deciding what each exit
 * means, and stopping everything in order with bounded graces (see
 * run.h). */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "base/clock.h"
#include "run.h"

extern char **environ;

char **run_base_env(size_t extra, size_t *n_out)
{
    static const char *const drop[] = { "COHORT_SOCKET=", "COHORT_COHORT=", "COHORT_ID=",
                                        "COHORT_RUN_INDEX=", "COHORT_BROKER=",
                                        "COHORT_RUN_DIR=" };
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

void run_describe_child(const struct child *c, char *buf, size_t len)
{
    if (c->pid == 0)
        snprintf(buf, len, "not started");
    else if (c->running)
        snprintf(buf, len, "running");
    else
        describe_exit(c->wstatus, buf, len);
}

bool run_exited_ok(const struct child *c)
{
    return c->pid && !c->running && WIFEXITED(c->wstatus) && WEXITSTATUS(c->wstatus) == 0;
}

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
    run_fmt_into(p->id, sizeof(p->id), "%s%u", r->prefix, p->index);
    run_fmt_into(p->sock, sizeof(p->sock), "%s/%u.sock", r->sockdir, p->index);
    run_fmt_into(p->out_path, sizeof(p->out_path), "%s/%u.out", r->dir, p->index);
    run_fmt_into(p->err_path, sizeof(p->err_path), "%s/%u.err", r->dir, p->index);
    run_fmt_into(p->sc_path, sizeof(p->sc_path), "%s/%u.sidecar.log", r->dir, p->index);
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

int run_start_peer(struct run *r, uint64_t now)
{
    struct peer *p = new_peer(r, now);
    int rc;

    if (!p) {
        run_note(r, "Not adding a peer: the run already has %d.", MAX_PEERS);
        return -ENOSPC;
    }
    char *argv[] = { r->sidecar, "--broker", r->broker, "--cohort", (char *)r->cohort,
                     "--id", p->id, "--socket", p->sock, "--secret-file", r->key_path,
                     "--log-format", (char *)(r->logf ? r->logf : "text"),
                     "--log-level", "info", NULL };
    rc = spawn(argv, r->env, p->sc_path, NULL, false, &p->sidecar.pid);
    if (rc < 0) {
        p->sidecar.pid = 0;
        fail(p, "its sidecar could not start: %s", strerror(-rc));
        run_note(r, "%s: the sidecar %s could not start: %s.", p->id, r->sidecar, strerror(-rc));
        return rc;
    }
    p->sidecar.running = true;
    p->trainer_pending = true;
    return 0;
}

static int start_trainer(struct run *r, struct peer *p)
{
    char sock[160], cohort[IDENT_NAME_MAX + 16], id[IDENT_NAME_MAX + 16], idx[48];
    char dir[sizeof(r->shared) + 16];
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
    /* A directory every trainer of the run can read: where the example
     * leaves its checkpoint for a peer that arrives after the others. */
    snprintf(dir, sizeof(dir), "COHORT_RUN_DIR=%s", r->shared);
    r->env[n + 4] = dir;
    rc = spawn(r->cmd, r->env, p->out_path, p->err_path, true, &p->trainer.pid);
    for (size_t k = n; k < n + 5; k++)
        r->env[k] = NULL;       /* the base environment again */
    p->trainer_pending = false;
    if (rc < 0) {
        p->trainer.pid = 0;
        fail(p, "its trainer could not start: %s", strerror(-rc));
        run_note(r, "%s: cannot start %s: %s.", p->id, r->cmd[0], strerror(-rc));
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

void run_reap(struct run *r, uint64_t now)
{
    char how[64];

    for (size_t i = 0; i < r->n_peers; i++) {
        struct peer *p = &r->peers[i];
        int ws;

        if (p->trainer.running && waitpid(p->trainer.pid, &ws, WNOHANG) == p->trainer.pid) {
            p->trainer.running = false;
            p->trainer.wstatus = ws;
            describe_exit(ws, how, sizeof(how));
            run_read_progress(p);
            if (p->hit) {
                run_note(r, "%s's trainer ended: %s (expected: its %s was killed).", p->id, how, p->hit);
            } else if (run_exited_ok(&p->trainer)) {
                run_note(r, "%s's trainer finished (%s).", p->id, how);
            } else {
                fail(p, "its trainer failed: %s", how);
                run_note(r, "%s's trainer FAILED: %s; see %s.", p->id, how, p->err_path);
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
                run_note(r, "%s's sidecar exited by itself (%s); see %s.", p->id, how, p->sc_path);
            } else if (!run_exited_ok(&p->sidecar) && !p->sidecar.escalated) {
                fail(p, "its sidecar did not stop cleanly (%s)", how);
                run_note(r, "%s's sidecar did not stop cleanly (%s); see %s.", p->id, how, p->sc_path);
            }
        }
    }
}

void run_tend(struct run *r, uint64_t now)
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
            run_note(r, "%s's sidecar did not stop within %d s of SIGTERM; killed it.", p->id,
                 STOP_GRACE_MS / 1000);
        }
    }
}

bool run_trainers_left(const struct run *r)
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

void run_stop_all(struct run *r)
{
    uint64_t now = clock_now_ms(), until;

    for (size_t i = 0; i < r->n_peers; i++) {
        r->peers[i].trainer_pending = false;
        signal_child(&r->peers[i].trainer, SIGTERM, now);
    }
    until = now + STOP_GRACE_MS;
    while (clock_now_ms() < until) {
        bool any = false;
        run_reap(r, clock_now_ms());
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
            run_note(r, "%s's trainer did not stop within %d s of SIGTERM; killed it.", p->id,
                 STOP_GRACE_MS / 1000);
        }
        signal_child(&p->sidecar, SIGTERM, clock_now_ms());
    }
    /* run_reap() and run_tend() escalate sidecars after their own grace. */
    until = clock_now_ms() + 2 * STOP_GRACE_MS;
    while (children_left(r) && clock_now_ms() < until) {
        run_reap(r, clock_now_ms());
        run_tend(r, clock_now_ms());
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

/* tests/chaos/chaos_trainer.c: the trainer the chaos trials run
 * (tests/chaos/chaos.py). It links the trainer library as a user's trainer
 * would and follows include/cohort.h's loop, but its gradients are
 * integers that name the contributions they come from, and it logs
 * everything it gives and gets, so tests/chaos/check.py can account for
 * every committed round exactly.
 *
 *   chaos_trainer --slot S --log PATH --steps N [--vb B] [--delay-ms D]
 *                 [--wait-for N] [--stall-s S]
 *
 * --wait-for N: at model version 0, contribute only once the cohort has N
 * members (as examples/c/logreg.c's flag), so a trainer that starts alone
 * does not begin a history of its own (see docs/chaos.md for what happens
 * without it after a broker restart).
 *
 * Contributions. Each trainer process has its own slot S (0 to SLOTS - 1;
 * the driver gives every process a new one, restarts included). Its c-th
 * contribution (c = 1, 2, ...) adds c to element S, 1 to element SLOTS + S
 * and c * c to element 2 * SLOTS + S of the gradients; every other element
 * is untouched. Gradients are float64, so every sum is exact. A committed
 * result times its gradient count is then, per slot, (k, sum of c, sum of
 * c^2) over the k contributions of that slot it holds, which names them:
 * the checker finds the run of the slot's contributions with those sums.
 *
 * Parameters. Each result times its count is added to the parameters, so
 * the parameters at version v are the sums of rounds 1..v: a member that
 * received the leader's state must hold exactly that too.
 *
 * Log. One JSON object per line, each written with one write(2) before
 * the act it describes where that matters (a contribution), so a process
 * killed at any moment leaves whole lines and at most one line too many:
 *   start    slot, id, pid
 *   connected: it reached its sidecar
 *   contrib  seq, v (model version), epoch
 *   undo     seq, error: that contribution was not made
 *   commit   v, G (gradient count), epoch, res ([slot, k, s1, s2] per slot
 *            in the result), rdig / pdig (FNV-1a of the result's bytes /
 *            of the parameters after applying it)
 *   state    from_v, to_v, dropped (contributions the node dropped), pdig
 *   done     v, pdig: reached --steps; it keeps serving the cohort
 *   final    v, pdig, params: on SIGTERM after done
 * Exit status: 0 after final, 1 on any failure (the sidecar gone, a stall
 * of --stall-s), 2 on a usage error.
 */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <fcntl.h>

#include "cohort.h"

#define PROG "chaos_trainer"
#define SLOTS 64
#define NUMEL (3 * SLOTS)
#define LINE_MAX_LEN 16384

static volatile sig_atomic_t stop_asked;

static void on_term(int sig)
{
    (void)sig;
    stop_asked = 1;
}

struct trainer {
    unsigned slot;
    uint64_t steps, vb, delay_ms, stall_s, seq, wait_for;
    const char *id;
    int log_fd;
    uint64_t my_version, last_epoch;
    bool done;
};

static void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void say(const char *fmt, ...)
{
    va_list ap;

    fputs(PROG ": ", stderr);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
}

/* One whole line with one write: a SIGKILL leaves it whole or absent. */
static void log_line(struct trainer *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void log_line(struct trainer *t, const char *fmt, ...)
{
    char line[LINE_MAX_LEN];
    va_list ap;
    int n;

    va_start(ap, fmt);
    n = vsnprintf(line, sizeof(line) - 1, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= sizeof(line) - 1) {
        say("a log line did not fit; stopping.");
        exit(1);
    }
    line[n++] = '\n';
    if (write(t->log_fd, line, (size_t)n) != n) {
        say("cannot write the log: %s.", strerror(errno));
        exit(1);
    }
}

static uint64_t fnv1a(const void *p, size_t n)
{
    const unsigned char *b = p;
    uint64_t h = 0xcbf29ce484222325ull;

    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void sleep_ms(uint64_t ms)
{
    struct timespec ts = { (time_t)(ms / 1000), (long)(ms % 1000) * 1000000 };
    nanosleep(&ts, NULL);
}

/* "[[slot,k,s1,s2],...]" of the slots a vector (times `scale`, rounded)
 * holds, into buf. Returns false when an element is not an integer: a
 * result that is not a sum of whole contributions. */
static bool slots_json(const double *x, double scale, char *buf, size_t cap)
{
    size_t k = 0;
    bool ok = true;

    k += (size_t)snprintf(buf + k, cap - k, "[");
    for (unsigned s = 0; s < SLOTS; s++) {
        double v[3] = { x[SLOTS + s] * scale, x[s] * scale, x[2 * SLOTS + s] * scale };
        long long r[3];
        for (int j = 0; j < 3; j++) {
            r[j] = llround(v[j]);
            if (fabs(v[j] - (double)r[j]) > 1e-6 * (1 + fabs(v[j])))
                ok = false;
        }
        if (r[0] == 0 && r[1] == 0 && r[2] == 0)
            continue;
        if (k + 80 >= cap)
            break;
        k += (size_t)snprintf(buf + k, cap - k, "%s[%u,%lld,%lld,%lld]", buf[k - 1] == '[' ? "" : ",",
                              s, r[0], r[1], r[2]);
    }
    snprintf(buf + k, cap - k, "]");
    return ok;
}

static void apply(struct trainer *t, struct cohort *c)
{
    struct cohort_gradient_stats st;
    double *w = cohort_params(c);
    const double *g = cohort_results(c);
    char res[8192];
    bool whole;

    cohort_get_gradient_stats(c, &st);
    whole = slots_json(g, (double)st.num_gradients, res, sizeof(res));
    for (unsigned j = 0; j < NUMEL; j++)
        w[j] += (double)llround(g[j] * (double)st.num_gradients);
    t->my_version = cohort_model_version(c);
    log_line(t, "{\"ev\":\"commit\",\"v\":%" PRIu64 ",\"G\":%" PRIu64 ",\"skipped\":%" PRIu64
             ",\"epoch\":%" PRIu64 ",\"whole\":%s,\"res\":%s,\"rdig\":\"%016" PRIx64 "\","
             "\"pdig\":\"%016" PRIx64 "\"}", t->my_version, st.num_gradients, st.num_skipped,
             st.epoch, whole ? "true" : "false", res, fnv1a(g, NUMEL * sizeof(double)),
             fnv1a(w, NUMEL * sizeof(double)));
}

/* One contribution: the next seq into this slot's three elements. */
static int contribute(struct trainer *t, struct cohort *c)
{
    double *g = cohort_grads(c);
    uint64_t q = t->seq + 1;
    int rc;

    if (t->delay_ms)
        sleep_ms((uint64_t)rand() % (t->delay_ms + 1));
    g[t->slot] += (double)q;
    g[SLOTS + t->slot] += 1;
    g[2 * SLOTS + t->slot] += (double)(q * q);
    log_line(t, "{\"ev\":\"contrib\",\"seq\":%" PRIu64 ",\"v\":%" PRIu64 ",\"epoch\":%" PRIu64 "}",
             q, cohort_model_version(c), t->last_epoch);
    rc = cohort_reduce_gradients(c, 1);
    if (rc < 0) {
        g[t->slot] -= (double)q;
        g[SLOTS + t->slot] -= 1;
        g[2 * SLOTS + t->slot] -= (double)(q * q);
        log_line(t, "{\"ev\":\"undo\",\"seq\":%" PRIu64 ",\"error\":%d}", q, rc);
        t->seq = q;             /* seqs stay distinct: this one is spent */
        return rc == -EPERM || rc == -EAGAIN ? 0 : rc;
    }
    t->seq = q;
    return 0;
}

/* One pass of the loop. Returns 0, or a negative errno. */
static int step(struct trainer *t, struct cohort *c, bool *idle)
{
    struct cohort_gradient_stats st;
    const void *state;
    size_t len;
    int rc;

    *idle = true;
    rc = cohort_update(c);
    if (rc < 0)
        return rc;
    if (!cohort_connected(c))
        return 0;
    cohort_get_gradient_stats(c, &st);
    t->last_epoch = st.epoch;
    if (cohort_wants_state(c)) {
        *idle = false;
        rc = cohort_set_state(c, "chaos/1", 7);
        if (rc < 0 && rc != -EPERM)
            return rc;
    }
    if (cohort_has_new_state(c)) {
        uint64_t v = cohort_model_version(c);
        *idle = false;
        rc = cohort_state(c, &state, &len);
        if (rc < 0)
            return rc;
        cohort_get_gradient_stats(c, &st);
        log_line(t, "{\"ev\":\"state\",\"from_v\":%" PRIu64 ",\"to_v\":%" PRIu64 ",\"epoch\":%"
                 PRIu64 ",\"dropped_total\":%" PRIu64 ",\"pdig\":\"%016" PRIx64 "\"}",
                 t->my_version, v, st.epoch, st.contributions_dropped,
                 fnv1a(cohort_params(c), NUMEL * sizeof(double)));
        t->my_version = v;
        if (len != 7 || memcmp(state, "chaos/1", 7) != 0) {
            say("the leader's state is not a chaos trainer's; stopping.");
            return -EPROTO;
        }
    }
    if (cohort_has_gradients(c)) {
        *idle = false;
        apply(t, c);
        rc = cohort_zero_gradients(c);
        if (rc < 0)
            return rc;
    } else if (!t->done && cohort_wants_gradients(c) && cohort_model_version(c) < t->steps &&
               (cohort_model_version(c) > 0 || cohort_size(c) >= t->wait_for)) {
        *idle = false;
        rc = contribute(t, c);
        if (rc < 0)
            return rc;
    }
    if (!t->done && cohort_model_version(c) >= t->steps) {
        t->done = true;
        log_line(t, "{\"ev\":\"done\",\"v\":%" PRIu64 ",\"pdig\":\"%016" PRIx64 "\"}",
                 cohort_model_version(c), fnv1a(cohort_params(c), NUMEL * sizeof(double)));
    }
    return 0;
}

static int run(struct trainer *t)
{
    struct cohort_tensor params[] = { { .name = "ids", .dtype = COHORT_F64, .numel = NUMEL } };
    struct cohort_config cfg = { .name = "chaos", .parameters = params, .n_parameters = 1 };
    struct cohort *c = NULL;
    double deadline, last_progress;
    uint64_t seen_version = 0;
    char buf[8192];
    bool idle;
    int rc, status = 1;

    rc = cohort_create(&cfg, &c);
    if (rc < 0) {
        say("cannot create the accumulator: %s.", cohort_strerror(rc));
        return 1;
    }
    deadline = now_s() + 60;
    while ((rc = cohort_connect(c, NULL)) == -ECONNREFUSED || rc == -ENOENT) {
        if (now_s() > deadline || stop_asked)
            break;
        sleep_ms(20);
    }
    if (rc < 0) {
        say("cannot connect: %s.", cohort_strerror(rc));
        goto out;
    }
    /* The harness kills a sidecar only after this line: a trainer still
     * connecting keeps trying for a minute, as one would while its pod's
     * sidecar container starts. */
    log_line(t, "{\"ev\":\"connected\"}");
    rc = cohort_set_virtual_batch_size(c, t->vb);
    if (rc < 0) {
        say("cannot set the virtual batch size: %s.", cohort_strerror(rc));
        goto out;
    }
    last_progress = now_s();
    while (!(stop_asked && t->done)) {
        rc = step(t, c, &idle);
        if (rc < 0) {
            say("%s at model_version=%" PRIu64 "; stopping.", rc == -ENOTCONN ? "the sidecar is gone" :
                cohort_strerror(rc), t->my_version);
            goto out;
        }
        if (t->my_version != seen_version || t->done) {
            seen_version = t->my_version;
            last_progress = now_s();
        }
        if (now_s() - last_progress > (double)t->stall_s) {
            say("no round committed for %" PRIu64 " s at model_version=%" PRIu64 "; stopping.",
                t->stall_s, t->my_version);
            goto out;
        }
        if (stop_asked && !t->done) {
            say("stopped before model version %" PRIu64 " (at %" PRIu64 ").", t->steps, t->my_version);
            goto out;
        }
        if (idle)
            cohort_wait(c, 50);
    }
    slots_json(cohort_params(c), 1.0, buf, sizeof(buf));
    log_line(t, "{\"ev\":\"final\",\"v\":%" PRIu64 ",\"pdig\":\"%016" PRIx64 "\",\"params\":%s}",
             cohort_model_version(c), fnv1a(cohort_params(c), NUMEL * sizeof(double)), buf);
    status = 0;
out:
    cohort_destroy(c);
    return status;
}

static int parse_u64(const char *s, uint64_t max, uint64_t *out)
{
    char *end;
    unsigned long long v;

    if (!s || *s < '0' || *s > '9')
        return -EINVAL;
    errno = 0;
    v = strtoull(s, &end, 10);
    if (errno || *end || v > max)
        return -EINVAL;
    *out = v;
    return 0;
}

int main(int argc, char **argv)
{
    struct trainer t = { .steps = 30, .vb = 1, .stall_s = 120, .log_fd = -1 };
    const char *log_path = NULL;
    uint64_t slot = SLOTS;
    struct sigaction sa = { .sa_handler = on_term };

    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int rc = 0;
        if (strcmp(a, "--slot") == 0)
            rc = parse_u64(v, SLOTS - 1, &slot);
        else if (strcmp(a, "--steps") == 0)
            rc = parse_u64(v, 1000000, &t.steps);
        else if (strcmp(a, "--vb") == 0)
            rc = parse_u64(v, 1000, &t.vb);
        else if (strcmp(a, "--delay-ms") == 0)
            rc = parse_u64(v, 10000, &t.delay_ms);
        else if (strcmp(a, "--wait-for") == 0)
            rc = parse_u64(v, 1000, &t.wait_for);
        else if (strcmp(a, "--stall-s") == 0)
            rc = parse_u64(v, 100000, &t.stall_s);
        else if (strcmp(a, "--log") == 0)
            log_path = v ? v : "";
        else
            rc = -EINVAL, v = a;
        if (rc < 0 || !v) {
            fprintf(stderr, PROG ": bad or missing value for %s\n"
                    "Usage: " PROG " --slot S --log PATH [--steps N] [--vb B] [--delay-ms D]"
                    " [--wait-for N] [--stall-s S]\n", a);
            return 2;
        }
        i++;
    }
    if (slot >= SLOTS || !log_path || t.vb == 0) {
        fprintf(stderr, PROG ": --slot (0 to %d), --log and a --vb above 0 are required\n", SLOTS - 1);
        return 2;
    }
    t.slot = (unsigned)slot;
    t.id = getenv("COHORT_ID") ? getenv("COHORT_ID") : "";
    t.log_fd = open(log_path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (t.log_fd < 0) {
        say("cannot open %s: %s.", log_path, strerror(errno));
        return 1;
    }
    srand((unsigned)getpid());
    sigaction(SIGTERM, &sa, NULL);
    log_line(&t, "{\"ev\":\"start\",\"slot\":%u,\"pid\":%d}", t.slot, (int)getpid());
    return run(&t);
}

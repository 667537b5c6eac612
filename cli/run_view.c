/* cli/run_view.c: what `cohortctl run` shows and learns while it runs:
 * notes and the live view on stderr, the trainers' progress lines, the
 * broker's status and the samples/s rate (see run.h). */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include "base/clock.h"
#include "cohort.pb-c.h"
#include "membership/proof.h"
#include "membership/wire.h"
#include "rpc/rpc.h"
#include "run.h"

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

void run_note(struct run *r, const char *fmt, ...)
{
    char line[512];
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(line, sizeof(line), fmt, ap);
    va_end(ap);
    view_erase(r);
    fprintf(stderr, PROG ": %5.1fs: %s\n", run_secs(r, clock_now_ms()), line);
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
    else if (p->trainer.pid && run_exited_ok(&p->trainer))
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

void run_view_draw(struct run *r, uint64_t now)
{
    char l1[512], l2[2048], l3[256], st[64];
    size_t k1 = 0, k2 = 0, k3 = 0, fired = 0;
    const struct event *next = NULL;
    int width = term_width() - 1;

    add(l1, sizeof(l1), &k1, "%s  t=%.1fs  epoch %llu  leader %s  members %zu  step %llu  "
        "samples/s ", r->cohort, run_secs(r, now), (unsigned long long)r->epoch,
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

void run_read_progress(struct peer *p)
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

void run_poll_status(struct run *r)
{
    Cohort__V1__StatusRequest q = COHORT__V1__STATUS_REQUEST__INIT;
    ProtobufCMessage *reply = NULL;
    const Cohort__V1__StatusReply *rep;
    struct rpc_status st;
    Cohort__V1__Proof pf;
    uint8_t mac[SECRET_MAC_BYTES];

    q.protocol_version = WIRE_PROTOCOL_VERSION;
    q.cohort = (char *)r->cohort;
    if (proof_sign(&r->key, &q.base, 1, proof_now_ms(), &pf, mac) == 0)
        q.proof = &pf;
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

void run_update_rate(struct run *r, uint64_t now)
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

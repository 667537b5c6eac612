/* cli/run_verdict.c: the end of `cohortctl run`: each trainer's last
 * line, whether the survivors agree on it, and the summary as a table or
 * JSON (see run.h). */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "run.h"

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

void run_judge(struct run *r, struct verdict *v)
{
    memset(v, 0, sizeof(*v));
    v->agree = true;
    for (size_t i = 0; i < r->n_peers; i++) {
        struct peer *p = &r->peers[i];
        read_final(p);
        if (p->failure[0] && !p->hit)
            v->failed++;
        if (p->hit || !run_exited_ok(&p->trainer))
            continue;
        v->survivors++;
        if (strncmp(p->final, "final ", 6) == 0)
            v->with_final++;
    }
    if (v->with_final == 0)
        return;
    for (size_t i = 0; i < r->n_peers; i++) {
        struct peer *p = &r->peers[i];
        if (p->hit || !run_exited_ok(&p->trainer))
            continue;
        if (!v->final)
            v->final = p->final;
        else if (strcmp(v->final, p->final) != 0)
            v->agree = false;
    }
    if (!v->agree)
        v->final = NULL;
}

const char *run_reason(const struct run *r, const struct verdict *v)
{
    if (r->stop_reason)
        return r->stop_reason;
    if (v->failed)
        return "a trainer or sidecar failed";
    if (!v->agree)
        return "the surviving trainers disagree";
    return NULL;
}

void run_print_table(struct run *r, const struct verdict *v, uint64_t now)
{
    char t[64], s[64];
    int wid = 4;

    for (size_t i = 0; i < r->n_peers; i++)
        if ((int)strlen(r->peers[i].id) > wid)
            wid = (int)strlen(r->peers[i].id);
    printf("%-*s  %-18s  %-18s  %s\n", wid, "PEER", "TRAINER", "SIDECAR", "LAST LINE");
    for (size_t i = 0; i < r->n_peers; i++) {
        struct peer *p = &r->peers[i];
        run_describe_child(&p->trainer, t, sizeof(t));
        run_describe_child(&p->sidecar, s, sizeof(s));
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
    printf("%s after %.1fs%s%s\n", run_reason(r, v) ? "FAILED" : "ok", run_secs(r, now),
           run_reason(r, v) ? ": " : "", run_reason(r, v) ? run_reason(r, v) : "");
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

void run_print_json(struct run *r, const struct verdict *v, uint64_t now)
{
    cJSON *o = cJSON_CreateObject(), *peers, *events;
    const char *reason = run_reason(r, v);
    char *text;

    cJSON_AddStringToObject(o, "cohort", r->cohort);
    cJSON_AddStringToObject(o, "broker", r->broker);
    cJSON_AddStringToObject(o, "run_dir", r->dir);
    cJSON_AddBoolToObject(o, "ok", reason == NULL);
    if (reason)
        cJSON_AddStringToObject(o, "reason", reason);
    else
        cJSON_AddNullToObject(o, "reason");
    cJSON_AddNumberToObject(o, "elapsed_s", run_secs(r, now));
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
        cJSON_AddNumberToObject(q, "started_s", run_secs(r, p->started_ms));
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

void run_remove_files(struct run *r)
{
    if (r->key_written)
        unlink(r->key_path);
    for (size_t i = 0; i < r->n_peers; i++) {
        unlink(r->peers[i].out_path);
        unlink(r->peers[i].err_path);
        unlink(r->peers[i].sc_path);
    }
    run_remove_shared(r);
    rmdir(r->dir);
}

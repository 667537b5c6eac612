/* cli/run_schedule.c: `cohortctl run`'s --schedule: parsing the events and
 * firing them when their time or model version comes (see run.h). */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/opt.h"
#include "run.h"

static const char *const action_names[] = { "kill-trainer", "kill-sidecar", "kill-peer", "add" };

/* Reports a usage error in one event; returns OPT_EXIT_USAGE. */
static int bad_event(const char *spec, const char *why)
{
    return opt_usage(PROG, "bad --schedule event \"%s\": %s", spec, why);
}

/* Parses one ACTION@WHEN[:PEER]. Returns 0, or OPT_EXIT_USAGE after saying
 * what is wrong. */
static int parse_event(const char *s, size_t len, struct event *e)
{
    char buf[64], *at, *colon, *when;
    uint64_t v;
    size_t i;

    if (len == 0 || len >= sizeof(buf))
        return bad_event(len ? "..." : "", "empty or too long");
    memcpy(buf, s, len);
    buf[len] = '\0';
    memset(e, 0, sizeof(*e));
    snprintf(e->spec, sizeof(e->spec), "%s", buf);
    e->peer = -1;
    at = strchr(buf, '@');
    if (!at)
        return bad_event(e->spec, "want ACTION@WHEN[:PEER]");
    *at = '\0';
    for (i = 0; i < sizeof(action_names) / sizeof(action_names[0]); i++)
        if (strcmp(buf, action_names[i]) == 0)
            break;
    if (i == sizeof(action_names) / sizeof(action_names[0]))
        return bad_event(e->spec, "the action is kill-trainer, kill-sidecar, kill-peer or add");
    e->action = (enum action)i;
    when = at + 1;
    colon = strchr(when, ':');
    if (colon) {
        *colon = '\0';
        if (e->action == A_ADD)
            return bad_event(e->spec, "add takes no peer");
        if (opt_uint(colon + 1, 0, MAX_PEERS - 1, &v) < 0)
            return bad_event(e->spec, "the peer is a run index, 0 to 255");
        e->peer = (long)v;
    } else if (e->action != A_ADD) {
        return bad_event(e->spec, "a kill names its peer, as in kill-trainer@5s:1");
    }
    if (strncmp(when, "v=", 2) == 0) {
        if (opt_uint(when + 2, 0, UINT64_MAX >> 1, &e->at) < 0)
            return bad_event(e->spec, "v= wants a model version");
        e->by_version = true;
    } else if (opt_duration_ms(when, DURATION_MAX_MS, &e->at) < 0) {
        return bad_event(e->spec, "WHEN is a duration (5s, 1500ms) or v=N");
    }
    return 0;
}

int run_parse_schedule(const char *spec, struct event **out, size_t *n)
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

static void fire(struct run *r, struct event *e, uint64_t now)
{
    struct peer *p;

    e->fired = true;
    e->fired_ms = now - r->t0;
    if (e->action == A_ADD) {
        if (run_start_peer(r, now) == 0)
            run_fmt_into(e->note, sizeof(e->note), "started %s", r->peers[r->n_peers - 1].id);
        else
            run_fmt_into(e->note, sizeof(e->note), "could not start a peer");
        run_note(r, "%s: %s.", e->spec, e->note);
        return;
    }
    if ((size_t)e->peer >= r->n_peers) {
        run_fmt_into(e->note, sizeof(e->note), "skipped: there is no peer %ld", e->peer);
        run_note(r, "%s: %s.", e->spec, e->note);
        return;
    }
    p = &r->peers[e->peer];
    bool t = e->action != A_KILL_SIDECAR, s = e->action != A_KILL_TRAINER;
    if ((t && !p->trainer.running) || (s && !p->sidecar.running)) {
        run_fmt_into(e->note, sizeof(e->note), "skipped: %s's %s is not running", p->id,
                 t && !p->trainer.running ? "trainer" : "sidecar");
        run_note(r, "%s: %s.", e->spec, e->note);
        return;
    }
    p->hit = e->action == A_KILL_TRAINER ? "trainer" : e->action == A_KILL_SIDECAR ? "sidecar" : "peer";
    if (s)
        kill(p->sidecar.pid, SIGKILL);
    if (t)
        kill(p->trainer.pid, SIGKILL);
    run_fmt_into(e->note, sizeof(e->note), "SIGKILL to %s's %s", p->id,
             e->action == A_KILL_PEER ? "trainer and sidecar" : p->hit);
    run_note(r, "%s: %s (model version %llu).", e->spec, e->note, (unsigned long long)r->max_version);
}

void run_fire_due(struct run *r, uint64_t now)
{
    for (size_t i = 0; i < r->n_events; i++) {
        struct event *e = &r->events[i];
        if (e->fired)
            continue;
        if (e->by_version ? r->max_version >= e->at : now - r->t0 >= e->at)
            fire(r, e, now);
    }
}

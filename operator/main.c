/* operator/main.c: cohort-operator. In Kubernetes mode it campaigns for a
 * Lease and, while it leads, hosts the broker and runs the TrainingCohort
 * controller (src/k8s/controller.c); it serves /metrics, /healthz and /readyz
 * either way. With --standalone it hosts the broker alone. */
#include <errno.h>
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <unistd.h>

#include "membership/brokerd.h"
#include "base/clock.h"
#include "k8s/controller.h"
#include "base/ident.h"
#include "k8s/kube.h"
#include "k8s/lease.h"
#include "base/log.h"
#include "base/opt.h"
#include "k8s/probe.h"
#include "rpc/rpc.h"

#define PROG "cohort-operator"
#define MAX_COHORT_FLAGS 256
#define DURATION_MAX_MS (24ull * 3600 * 1000)

static const char usage[] =
    "Usage: " PROG " --kubeconfig PATH | --in-cluster [options]\n"
    "       " PROG " --standalone [--listen ADDR] [options]\n"
    "\n"
    "Runs the TrainingCohort controller and hosts the cohort broker. In\n"
    "Kubernetes mode replicas elect a leader through a Lease; only the leader\n"
    "reconciles and serves the broker, and the others wait to take over.\n"
    "With --standalone it hosts the broker alone, with no Kubernetes.\n"
    "\n"
    "Kubernetes:\n"
    "  --kubeconfig PATH         talk to the API server named by this kubeconfig\n"
    "  --context NAME            kubeconfig context (default: the current one)\n"
    "  --in-cluster              use the pod's service account (the default when\n"
    "                            neither --kubeconfig nor --standalone is given)\n"
    "  --namespace NS            watch TrainingCohorts and pods in NS only\n"
    "                            (default: all namespaces)\n"
    "  --broker-address ADDR     host:port that trainer pods are told to reach the\n"
    "                            broker at (default: the --listen address if its\n"
    "                            host is not 0.0.0.0, else $POD_IP with its port)\n"
    "  --sidecar-image IMAGE     sidecar image when a cohort sets none\n"
    "                            (default ghcr.io/cohort-dev/cohort:latest)\n"
    "  --sidecar-command CMD     the sidecar container's command (default\n"
    "                            cohort-sidecar)\n"
    "  --lease-name NAME         Lease used for leader election (default\n"
    "                            cohort-operator)\n"
    "  --lease-namespace NS      its namespace (default: the kubeconfig context's\n"
    "                            or the service account's namespace, else default)\n"
    "  --identity ID             this replica's name in the Lease (default: $POD_NAME,\n"
    "                            else HOSTNAME-PID)\n"
    "  --lease-duration DUR      how long a silent leader keeps the Lease (15s)\n"
    "  --renew-deadline DUR      a leader that cannot renew this long steps down (10s)\n"
    "  --retry-period DUR        between attempts to take or renew it (2s)\n"
    "  --metrics-listen ADDR     serve /metrics, /healthz and /readyz on host:port\n"
    "                            (default 0.0.0.0:8080; \"off\" disables)\n"
    "  --workers N               cohorts reconciled at once (default 2)\n"
    "  --status-period DUR       a status change of model versions alone is written\n"
    "                            at most this often per cohort (default 5s); other\n"
    "                            changes are written at once\n"
    "  --drain-timeout DUR       delete a draining member's pod after this even if\n"
    "                            the drain has not finished (default: 2 x the\n"
    "                            cohort's member timeout)\n"
    "  --resync DUR              reconcile every cohort at least this often (30s)\n"
    "  --watch-timeout DUR       length of one watch request (default 5m)\n"
    "  --api-timeout DUR         give up on one API request after this (default 30s);\n"
    "                            the reconcile is retried with backoff\n"
    "\n"
    "Broker (both modes):\n"
    "  --standalone              run the broker alone, with no Kubernetes\n"
    "  --listen ADDR             broker address, host:port; port 0 picks a free one\n"
    "                            (default 0.0.0.0:7070)\n"
    "  --cohort SPEC             declare a cohort (standalone only); SPEC is NAME or\n"
    "                            NAME:heartbeat=DUR,timeout=DUR (repeatable)\n"
    "  --allow-any-cohort        a join to an undeclared cohort creates it\n"
    "  --heartbeat-interval DUR  default member heartbeat interval (default 1s)\n"
    "  --member-timeout DUR      default silence before eviction (default 5s)\n"
    "  --coalesce DUR            changes this close share one epoch (default 50ms)\n"
    "  --startup-hold DUR        publish no epoch this long after start, so members\n"
    "                            rejoining a restarted broker share one (default\n"
    "                            2 x heartbeat interval)\n"
    "  --max-members N           members per cohort (default 4096)\n"
    "  --max-cohorts N           cohorts per broker (default 1024)\n"
    "  --log-format text|json    (default text)\n"
    "  --log-level LEVEL         debug, info, warn or error (default info)\n"
    "  -h, --help                show this text\n"
    "\n"
    "DUR is a number with a unit: 250ms, 1s, 1.5s, 2m.\n"
    "The log line \"Broker is listening.\" carries the bound address.\n"
    "\n"
    "Endpoints: /healthz answers 200 while the process runs. /readyz answers\n"
    "200 only on the leader once its caches of cohorts and pods are synced,\n"
    "and 503 with the reason on a standby replica, so a Service in front of\n"
    "the broker port sends trainers to the leader alone. /metrics is\n"
    "Prometheus text: reconciles, errors, queue depth, API requests, cohorts,\n"
    "pods, is_leader and more.\n"
    "\n"
    "Exit status: 0 after SIGTERM or SIGINT, 1 when it cannot start, 2 for a\n"
    "usage error.\n";

static int bad(const char *fmt, const char *what)
{
    fprintf(stderr, PROG ": ");
    fprintf(stderr, fmt, what);
    fprintf(stderr, "\nTry '" PROG " --help'.\n");
    return 2;
}

struct cohort_spec {
    char name[IDENT_NAME_MAX + 1];
    uint64_t heartbeat_ms, timeout_ms;
};

/* NAME or NAME:heartbeat=DUR,timeout=DUR */
static int parse_cohort(const char *arg, struct cohort_spec *c)
{
    const char *colon = strchr(arg, ':');
    size_t len = colon ? (size_t)(colon - arg) : strlen(arg);
    char opts[256];

    memset(c, 0, sizeof(*c));
    if (len == 0 || len > IDENT_NAME_MAX)
        return -EINVAL;
    memcpy(c->name, arg, len);
    if (!ident_valid_cohort(c->name))
        return -EINVAL;
    if (!colon)
        return 0;
    if (strlen(colon + 1) >= sizeof(opts))
        return -EINVAL;
    memcpy(opts, colon + 1, strlen(colon + 1) + 1);
    for (char *kv = opts, *next; kv; kv = next) {
        char *comma = strchr(kv, ',');
        char *eq;
        next = comma ? comma + 1 : NULL;
        if (comma)
            *comma = '\0';
        eq = strchr(kv, '=');
        if (!eq)
            return -EINVAL;
        *eq = '\0';
        if (strcmp(kv, "heartbeat") == 0) {
            if (opt_duration_ms(eq + 1, DURATION_MAX_MS, &c->heartbeat_ms) < 0 || !c->heartbeat_ms)
                return -EINVAL;
        } else if (strcmp(kv, "timeout") == 0) {
            if (opt_duration_ms(eq + 1, DURATION_MAX_MS, &c->timeout_ms) < 0 || !c->timeout_ms)
                return -EINVAL;
        } else {
            return -EINVAL;
        }
    }
    return 0;
}

enum { O_STANDALONE = 256, O_LISTEN, O_COHORT, O_ANY, O_HB, O_TO, O_COALESCE, O_HOLD,
       O_MAXM, O_MAXC, O_LOGF, O_LOGL, O_KUBECONFIG, O_CONTEXT, O_INCLUSTER, O_NS, O_BADDR,
       O_SIMG, O_SCMD, O_LNAME, O_LNS, O_IDENT, O_LDUR, O_LRENEW, O_LRETRY, O_METRICS,
       O_WORKERS, O_STPERIOD, O_DRAIN, O_RESYNC, O_WTIMEOUT, O_APITIMEOUT };

/* Everything Kubernetes mode needs beyond the broker's settings. */
struct kopts {
    const char *kubeconfig, *context, *namespace, *broker_address, *sidecar_image,
        *sidecar_command, *lease_name, *lease_namespace, *identity, *metrics_listen;
    bool in_cluster;
    uint32_t lease_ms, renew_ms, retry_ms, workers, status_period_ms, drain_ms, resync_ms,
        watch_s, api_timeout_ms;
};

/* What the metrics thread reads while the main thread starts and stops
 * leadership: under `lock`. */
struct op {
    pthread_mutex_t lock;
    struct kube *kube;
    struct lease *lease;
    struct brokerd *broker;
    struct controller *ctl;
    struct controller_stats base;   /* counters of controllers already stopped */
    uint64_t leader_terms;
};

static void add_stats(struct controller_stats *a, const struct controller_stats *b)
{
    a->reconciles += b->reconciles;
    a->reconcile_errors += b->reconcile_errors;
    a->pods_created += b->pods_created;
    a->pods_deleted += b->pods_deleted;
    a->pods_replaced += b->pods_replaced;
    a->drains_started += b->drains_started;
    a->drain_timeouts += b->drain_timeouts;
    a->status_writes += b->status_writes;
    a->events += b->events;
    a->watch_errors += b->watch_errors;
    a->relists += b->relists;
}

static void metric(struct probe_reply *r, const char *name, const char *type, const char *help,
                   unsigned long long v)
{
    probe_printf(r, "# HELP cohort_operator_%s %s\n# TYPE cohort_operator_%s %s\n"
                 "cohort_operator_%s %llu\n", name, help, name, type, name, v);
}

static void serve_probe(void *arg, const char *path, struct probe_reply *r)
{
    struct op *op = arg;
    struct controller_stats cs = { 0 }, now = { 0 };
    struct kube_stats ks = { 0 };
    bool leading, running;
    size_t members = 0;

    pthread_mutex_lock(&op->lock);
    leading = op->lease && lease_is_leader(op->lease);
    running = op->ctl != NULL;
    if (op->ctl)
        controller_stats(op->ctl, &now);
    cs = op->base;
    add_stats(&cs, &now);
    cs.queue_depth = now.queue_depth;
    cs.cohorts = now.cohorts;
    cs.pods = now.pods;
    cs.synced = now.synced;
    kube_stats(op->kube, &ks);
    if (op->broker && strcmp(path, "/metrics") == 0) {
        struct broker_status *st = NULL;
        if (brokerd_status(op->broker, NULL, &st) == 0) {
            for (size_t i = 0; i < st->n_cohorts; i++)
                members += st->cohorts[i].n_members;
            broker_status_free(st);
        }
    }
    pthread_mutex_unlock(&op->lock);

    if (strcmp(path, "/healthz") == 0 || strcmp(path, "/livez") == 0) {
        probe_printf(r, "ok\n");
    } else if (strcmp(path, "/readyz") == 0) {
        if (leading && running && cs.synced) {
            probe_printf(r, "ok: leading, caches synced\n");
        } else {
            r->code = 503;
            probe_printf(r, "not ready: %s\n", !leading ? "standby, another replica leads"
                                               : "leading, caches not synced yet");
        }
    } else if (strcmp(path, "/metrics") == 0) {
        r->content_type = "text/plain; version=0.0.4; charset=utf-8";
        metric(r, "is_leader", "gauge", "1 while this replica holds the Lease and reconciles.",
               leading);
        metric(r, "leader_terms_total", "counter", "Times this replica became the leader.",
               op->leader_terms);
        metric(r, "caches_synced", "gauge", "1 once the cohort and pod caches are filled.",
               cs.synced);
        metric(r, "reconciles_total", "counter", "Reconciles of one cohort.", cs.reconciles);
        metric(r, "reconcile_errors_total", "counter", "Reconciles that failed and were retried "
               "with backoff.", cs.reconcile_errors);
        metric(r, "queue_depth", "gauge", "Cohort keys queued or being reconciled.",
               cs.queue_depth);
        metric(r, "api_requests_total", "counter", "Requests to the API server, watches "
               "excluded.", ks.requests);
        metric(r, "api_request_failures_total", "counter", "API requests that failed in "
               "transport or got an error status.", ks.failures);
        metric(r, "api_watches_total", "counter", "Watch requests opened.", ks.watches);
        metric(r, "watch_errors_total", "counter", "Lists and watches that failed and were "
               "retried.", cs.watch_errors);
        metric(r, "relists_total", "counter", "Relists after 410 Gone.", cs.relists);
        metric(r, "cohorts", "gauge", "TrainingCohorts in the cache.", cs.cohorts);
        metric(r, "pods", "gauge", "Trainer pods in the cache.", cs.pods);
        metric(r, "broker_members", "gauge", "Members the broker holds, all cohorts.", members);
        metric(r, "pods_created_total", "counter", "Trainer pods created.", cs.pods_created);
        metric(r, "pods_deleted_total", "counter", "Trainer pods deleted.", cs.pods_deleted);
        metric(r, "pods_replaced_total", "counter", "Failed trainer pods replaced.",
               cs.pods_replaced);
        metric(r, "drains_total", "counter", "Members drained before a scale-down.",
               cs.drains_started);
        metric(r, "drain_timeouts_total", "counter", "Drains that ran out of time.",
               cs.drain_timeouts);
        metric(r, "status_writes_total", "counter", "Status subresource writes.",
               cs.status_writes);
        metric(r, "events_total", "counter", "Events recorded.", cs.events);
    } else {
        r->code = 404;
        probe_printf(r, "not found: try /metrics, /healthz or /readyz\n");
    }
}

/* The address pods are told: the flag, else the listen address when it
 * names a host, else $POD_IP. */
static int broker_address_for(const struct kopts *ko, const char *listen, int port, char *buf,
                              size_t n)
{
    const char *colon = strrchr(listen, ':');
    int hostlen = colon ? (int)(colon - listen) : 0;
    const char *pod_ip = getenv("POD_IP");

    if (ko->broker_address)
        snprintf(buf, n, "%s", ko->broker_address);
    else if (hostlen > 0 && strncmp(listen, "0.0.0.0", (size_t)hostlen) != 0 &&
             strncmp(listen, "[::]", (size_t)hostlen) != 0)
        snprintf(buf, n, "%.*s:%d", hostlen, listen, port);
    else if (pod_ip && *pod_ip)
        snprintf(buf, n, "%s:%d", pod_ip, port);
    else
        return -EINVAL;
    return ident_valid_address(buf) ? 0 : -EINVAL;
}

/* Becomes the working leader: broker, then controller. Returns 0 or -errno
 * with nothing left running. */
static int lead(struct op *op, const struct kopts *ko, const struct brokerd_config *bcfg)
{
    struct controller_config cc = { 0 };
    struct brokerd *d = NULL;
    struct controller *ctl = NULL;
    char addr[IDENT_ADDRESS_MAX + 1];
    int rc;

    rc = brokerd_start(bcfg, &d);
    if (rc < 0) {
        log_warn("operator", "The broker could not start; trying again.",
                 LF_S("listen", bcfg->listen), LF_ERR(rc));
        return rc;
    }
    rc = broker_address_for(ko, bcfg->listen, brokerd_port(d), addr, sizeof(addr));
    if (rc < 0) {
        log_error("operator", "No address to give pods for the broker: set --broker-address.");
        brokerd_stop(d);
        return rc;
    }
    cc.kube = op->kube;
    cc.broker = d;
    cc.namespace = ko->namespace;
    cc.identity = ko->identity;
    cc.env.broker_address = addr;
    cc.env.sidecar_image = ko->sidecar_image;
    cc.env.sidecar_command = ko->sidecar_command;
    cc.workers = ko->workers;
    cc.status_period_ms = ko->status_period_ms;
    cc.drain_timeout_ms = ko->drain_ms;
    cc.resync_ms = ko->resync_ms;
    cc.watch_timeout_s = ko->watch_s;
    rc = controller_start(&cc, 60000, &ctl);
    if (rc < 0) {
        log_warn("operator", "The controller could not start; trying again.", LF_ERR(rc));
        brokerd_stop(d);
        return rc;
    }
    pthread_mutex_lock(&op->lock);
    op->broker = d;
    op->ctl = ctl;
    op->leader_terms++;
    pthread_mutex_unlock(&op->lock);
    log_info("operator", "Leading: reconciling cohorts and serving the broker.",
             LF_S("broker_address", addr), LF_S("identity", ko->identity));
    return 0;
}

static void step_down(struct op *op)
{
    struct controller *ctl;
    struct brokerd *d;
    struct controller_stats st;

    pthread_mutex_lock(&op->lock);
    ctl = op->ctl;
    d = op->broker;
    if (ctl) {
        controller_stats(ctl, &st);
        add_stats(&op->base, &st);
    }
    op->ctl = NULL;
    op->broker = NULL;
    pthread_mutex_unlock(&op->lock);
    controller_stop(ctl);
    brokerd_stop(d);
}

static int run_kube(const struct kopts *ko_in, const struct brokerd_config *bcfg, sigset_t *sigs)
{
    struct kopts ko = *ko_in;
    struct kube_config kc = { 0 };
    struct lease_config lc = { 0 };
    struct op op = { 0 };
    struct probe *probe = NULL;
    char ident[300];
    int rc, sig = 0, status = 1;
    uint64_t next_try = 0;

    pthread_mutex_init(&op.lock, NULL);
    rc = ko.kubeconfig ? kube_config_load(ko.kubeconfig, ko.context, &kc)
                       : kube_config_in_cluster(NULL, &kc);
    if (rc < 0) {
        log_error("operator", ko.kubeconfig ? "The kubeconfig could not be loaded."
                  : "No in-cluster configuration (not in a pod?); pass --kubeconfig.",
                  LF_S("kubeconfig", ko.kubeconfig), LF_ERR(rc));
        goto out;
    }
    {
        struct kube_opts kopt = { .timeout_ms = ko.api_timeout_ms };
        rc = kube_create(&kc, &kopt, &op.kube);
    }
    if (rc < 0) {
        log_error("operator", "The API client could not be created.", LF_ERR(rc));
        goto out;
    }
    if (!ko.identity) {
        char host[256] = "operator";
        gethostname(host, sizeof(host) - 1);
        host[sizeof(host) - 1] = '\0';
        snprintf(ident, sizeof(ident), "%s-%ld", host, (long)getpid());
        ko.identity = getenv("POD_NAME") && *getenv("POD_NAME") ? getenv("POD_NAME") : ident;
    }
    if (!ko.lease_namespace)
        ko.lease_namespace = kube_namespace(op.kube);
    if (ko.metrics_listen && strcmp(ko.metrics_listen, "off") != 0) {
        rc = probe_start(ko.metrics_listen, serve_probe, &op, &probe);
        if (rc < 0) {
            log_error("operator", "The metrics endpoint could not listen.",
                      LF_S("listen", ko.metrics_listen), LF_ERR(rc));
            goto out;
        }
        {
            const char *colon = strrchr(ko.metrics_listen, ':');
            char addr[300];
            snprintf(addr, sizeof(addr), "%.*s:%d", colon ? (int)(colon - ko.metrics_listen) : 0,
                     ko.metrics_listen, probe_port(probe));
            log_info("operator", "Serving /metrics, /healthz and /readyz.", LF_S("address", addr));
        }
    }
    lc.kube = op.kube;
    lc.namespace = ko.lease_namespace;
    lc.name = ko.lease_name;
    lc.identity = ko.identity;
    lc.lease_duration_ms = ko.lease_ms;
    lc.renew_deadline_ms = ko.renew_ms;
    lc.retry_period_ms = ko.retry_ms;
    rc = lease_start(&lc, &op.lease);
    if (rc < 0) {
        log_error("operator", "Leader election could not start.", LF_ERR(rc));
        goto out;
    }
    log_info("operator", "Campaigning for leadership.", LF_S("lease", ko.lease_name),
             LF_S("lease_namespace", ko.lease_namespace), LF_S("identity", ko.identity),
             LF_S("namespace", ko.namespace ? ko.namespace : "(all)"));
    for (;;) {
        struct timespec ts = { 0, 100 * 1000000L };
        bool leading = lease_is_leader(op.lease), running;

        pthread_mutex_lock(&op.lock);
        running = op.ctl != NULL;
        pthread_mutex_unlock(&op.lock);
        if (leading && !running && clock_now_ms() >= next_try) {
            if (lead(&op, &ko, bcfg) < 0)
                next_try = clock_now_ms() + 1000;
        } else if (!leading && running) {
            log_warn("operator", "Lost the Lease; stopping the controller and the broker.");
            step_down(&op);
        }
        sig = sigtimedwait(sigs, NULL, &ts);
        if (sig > 0)
            break;
    }
    log_info("operator", "Stopping.", LF_S("signal", strsignal(sig)));
    status = 0;
out:
    step_down(&op);
    /* Released after the broker stopped, so a successor binding the same
     * broker port finds it free. */
    pthread_mutex_lock(&op.lock);
    lease_destroy(op.lease);
    op.lease = NULL;
    pthread_mutex_unlock(&op.lock);
    probe_stop(probe);
    kube_destroy(op.kube);
    kube_config_cleanup(&kc);
    pthread_mutex_destroy(&op.lock);
    return status;
}

static int duration_flag(const char *flag, const char *arg, uint64_t max, uint32_t *out)
{
    uint64_t v;

    if (opt_duration_ms(arg, max, &v) < 0 || v == 0)
        return bad("bad --%s (a duration such as 500ms, 2s)", flag);
    *out = (uint32_t)v;
    return 0;
}

int main(int argc, char **argv)
{
    static const struct option longopts[] = {
        { "standalone", no_argument, NULL, O_STANDALONE },
        { "listen", required_argument, NULL, O_LISTEN },
        { "cohort", required_argument, NULL, O_COHORT },
        { "allow-any-cohort", no_argument, NULL, O_ANY },
        { "heartbeat-interval", required_argument, NULL, O_HB },
        { "member-timeout", required_argument, NULL, O_TO },
        { "coalesce", required_argument, NULL, O_COALESCE },
        { "startup-hold", required_argument, NULL, O_HOLD },
        { "max-members", required_argument, NULL, O_MAXM },
        { "max-cohorts", required_argument, NULL, O_MAXC },
        { "log-format", required_argument, NULL, O_LOGF },
        { "log-level", required_argument, NULL, O_LOGL },
        { "kubeconfig", required_argument, NULL, O_KUBECONFIG },
        { "context", required_argument, NULL, O_CONTEXT },
        { "in-cluster", no_argument, NULL, O_INCLUSTER },
        { "namespace", required_argument, NULL, O_NS },
        { "broker-address", required_argument, NULL, O_BADDR },
        { "sidecar-image", required_argument, NULL, O_SIMG },
        { "sidecar-command", required_argument, NULL, O_SCMD },
        { "lease-name", required_argument, NULL, O_LNAME },
        { "lease-namespace", required_argument, NULL, O_LNS },
        { "identity", required_argument, NULL, O_IDENT },
        { "lease-duration", required_argument, NULL, O_LDUR },
        { "renew-deadline", required_argument, NULL, O_LRENEW },
        { "retry-period", required_argument, NULL, O_LRETRY },
        { "metrics-listen", required_argument, NULL, O_METRICS },
        { "workers", required_argument, NULL, O_WORKERS },
        { "status-period", required_argument, NULL, O_STPERIOD },
        { "drain-timeout", required_argument, NULL, O_DRAIN },
        { "resync", required_argument, NULL, O_RESYNC },
        { "watch-timeout", required_argument, NULL, O_WTIMEOUT },
        { "api-timeout", required_argument, NULL, O_APITIMEOUT },
        { "help", no_argument, NULL, 'h' },
        { NULL, 0, NULL, 0 },
    };
    static struct cohort_spec cohorts[MAX_COHORT_FLAGS];
    struct brokerd_config cfg = { .listen = "0.0.0.0:7070" };
    struct kopts ko = {
        .sidecar_image = "ghcr.io/cohort-dev/cohort:latest", .sidecar_command = "cohort-sidecar",
        .lease_name = "cohort-operator", .metrics_listen = "0.0.0.0:8080",
        .lease_ms = 15000, .renew_ms = 10000, .retry_ms = 2000, .workers = 2,
        .status_period_ms = 5000, .resync_ms = 30000, .watch_s = 300, .api_timeout_ms = 30000,
    };
    const char *logf = NULL, *logl = NULL;
    bool standalone = false, hold_set = false;
    size_t n_cohorts = 0;
    struct brokerd *d = NULL;
    sigset_t sigs;
    uint64_t v;
    uint32_t w;
    int opt, rc, sig;

    broker_config_default(&cfg.broker);
    while ((opt = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
        switch (opt) {
        case O_STANDALONE: standalone = true; break;
        case O_LISTEN: cfg.listen = optarg; break;
        case O_COHORT:
            if (n_cohorts == MAX_COHORT_FLAGS)
                return bad("at most %s --cohort flags", "256");
            if (parse_cohort(optarg, &cohorts[n_cohorts]) < 0)
                return bad("bad --cohort \"%s\": want NAME or NAME:heartbeat=DUR,timeout=DUR", optarg);
            n_cohorts++;
            break;
        case O_ANY: cfg.broker.allow_any_cohort = true; break;
        case O_HB:
            if (opt_duration_ms(optarg, DURATION_MAX_MS, &v) < 0 || v == 0)
                return bad("bad --heartbeat-interval \"%s\"", optarg);
            cfg.broker.heartbeat_ms = (uint32_t)v;
            break;
        case O_TO:
            if (opt_duration_ms(optarg, DURATION_MAX_MS, &v) < 0 || v == 0)
                return bad("bad --member-timeout \"%s\"", optarg);
            cfg.broker.timeout_ms = (uint32_t)v;
            break;
        case O_COALESCE:
            if (opt_duration_ms(optarg, 60000, &v) < 0)
                return bad("bad --coalesce \"%s\" (at most 1m)", optarg);
            cfg.broker.coalesce_ms = (uint32_t)v;
            break;
        case O_HOLD:
            if (opt_duration_ms(optarg, 600000, &v) < 0)
                return bad("bad --startup-hold \"%s\" (at most 10m)", optarg);
            cfg.broker.startup_hold_ms = (uint32_t)v;
            hold_set = true;
            break;
        case O_MAXM:
            if (opt_uint(optarg, 1, 1u << 20, &v) < 0)
                return bad("bad --max-members \"%s\" (1 to 1048576)", optarg);
            cfg.broker.max_members = (uint32_t)v;
            break;
        case O_MAXC:
            if (opt_uint(optarg, 1, 1u << 20, &v) < 0)
                return bad("bad --max-cohorts \"%s\" (1 to 1048576)", optarg);
            cfg.broker.max_cohorts = (uint32_t)v;
            break;
        case O_LOGF: logf = optarg; break;
        case O_LOGL: logl = optarg; break;
        case O_KUBECONFIG: ko.kubeconfig = optarg; break;
        case O_CONTEXT: ko.context = optarg; break;
        case O_INCLUSTER: ko.in_cluster = true; break;
        case O_NS:
            if (!*optarg || strlen(optarg) > 63 || strchr(optarg, '/'))
                return bad("bad --namespace \"%s\"", optarg);
            ko.namespace = optarg;
            break;
        case O_BADDR:
            if (!ident_valid_address(optarg))
                return bad("bad --broker-address \"%s\": want host:port", optarg);
            ko.broker_address = optarg;
            break;
        case O_SIMG: ko.sidecar_image = optarg; break;
        case O_SCMD: ko.sidecar_command = optarg; break;
        case O_LNAME: ko.lease_name = optarg; break;
        case O_LNS: ko.lease_namespace = optarg; break;
        case O_IDENT: ko.identity = optarg; break;
        case O_LDUR:
            if (duration_flag("lease-duration", optarg, 3600000, &ko.lease_ms))
                return 2;
            break;
        case O_LRENEW:
            if (duration_flag("renew-deadline", optarg, 3600000, &ko.renew_ms))
                return 2;
            break;
        case O_LRETRY:
            if (duration_flag("retry-period", optarg, 3600000, &ko.retry_ms))
                return 2;
            break;
        case O_METRICS: ko.metrics_listen = optarg; break;
        case O_WORKERS:
            if (opt_uint(optarg, 1, 16, &v) < 0)
                return bad("bad --workers \"%s\" (1 to 16)", optarg);
            ko.workers = (uint32_t)v;
            break;
        case O_STPERIOD:
            if (duration_flag("status-period", optarg, 3600000, &ko.status_period_ms))
                return 2;
            break;
        case O_DRAIN:
            if (duration_flag("drain-timeout", optarg, 3600000, &ko.drain_ms))
                return 2;
            break;
        case O_RESYNC:
            if (duration_flag("resync", optarg, 86400000, &ko.resync_ms))
                return 2;
            break;
        case O_WTIMEOUT:
            if (duration_flag("watch-timeout", optarg, 3600000, &w))
                return 2;
            ko.watch_s = w < 1000 ? 1 : w / 1000;
            break;
        case O_APITIMEOUT:
            if (duration_flag("api-timeout", optarg, 600000, &ko.api_timeout_ms))
                return 2;
            break;
        case 'h':
            fputs(usage, stdout);
            return 0;
        default:
            fprintf(stderr, "Try '" PROG " --help'.\n");
            return 2;
        }
    }
    if (optind < argc)
        return bad("unexpected argument \"%s\"", argv[optind]);
    if (opt_logging(PROG, logf, logl) < 0)
        return 2;
    if (standalone && (ko.kubeconfig || ko.in_cluster))
        return bad("%s", "--standalone runs without Kubernetes: drop --kubeconfig/--in-cluster");
    if (ko.kubeconfig && ko.in_cluster)
        return bad("%s", "give --kubeconfig or --in-cluster, not both");
    if (!standalone && n_cohorts)
        return bad("%s", "--cohort is for --standalone; in Kubernetes the cohorts are "
                   "TrainingCohort objects");
    if (!(ko.retry_ms < ko.renew_ms && ko.renew_ms < ko.lease_ms))
        return bad("%s", "want --retry-period < --renew-deadline < --lease-duration");
    if (cfg.broker.timeout_ms <= cfg.broker.heartbeat_ms)
        return bad("%s", "--member-timeout must be longer than --heartbeat-interval");
    if (!hold_set)
        cfg.broker.startup_hold_ms = 2 * cfg.broker.heartbeat_ms;

    /* Signals go to this thread only; gRPC's threads never see them. */
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    signal(SIGPIPE, SIG_IGN);

    if (rpc_init() < 0) {
        log_error("operator", "gRPC could not start.");
        return 1;
    }
    if (!standalone) {
        rc = run_kube(&ko, &cfg, &sigs);
        rpc_shutdown();
        return rc;
    }
    rc = brokerd_start(&cfg, &d);
    if (rc < 0) {
        log_error("operator", "The broker could not start.", LF_S("listen", cfg.listen), LF_ERR(rc));
        rpc_shutdown();
        return 1;
    }
    for (size_t i = 0; i < n_cohorts; i++) {
        rc = brokerd_declare(d, cohorts[i].name, (uint32_t)cohorts[i].heartbeat_ms,
                             (uint32_t)cohorts[i].timeout_ms);
        if (rc < 0) {
            log_error("operator", "A cohort could not be declared.", LF_S("cohort", cohorts[i].name),
                      LF_ERR(rc));
            brokerd_stop(d);
            rpc_shutdown();
            return 1;
        }
    }
    {
        char addr[IDENT_ADDRESS_MAX + 16];
        const char *colon = strrchr(cfg.listen, ':');
        int hostlen = colon ? (int)(colon - cfg.listen) : 0;
        snprintf(addr, sizeof(addr), "%.*s:%d", hostlen, cfg.listen, brokerd_port(d));
        log_info("operator", "Broker is listening.", LF_S("address", addr),
                 LF_U("cohorts", n_cohorts), LF_B("allow_any_cohort", cfg.broker.allow_any_cohort),
                 LF_U("heartbeat_ms", cfg.broker.heartbeat_ms),
                 LF_U("timeout_ms", cfg.broker.timeout_ms));
    }
    while (sigwait(&sigs, &sig) != 0)
        ;
    log_info("operator", "Stopping.", LF_S("signal", strsignal(sig)));
    brokerd_stop(d);
    rpc_shutdown();
    return 0;
}

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
#include <time.h>
#include <unistd.h>

#include "membership/brokerd.h"
#include "base/clock.h"
#include "k8s/brokertls.h"
#include "k8s/controller.h"
#include "base/ident.h"
#include "base/limits.h"
#include "k8s/kube.h"
#include "k8s/lease.h"
#include "base/log.h"
#include "base/opt.h"
#include "base/secret.h"
#include "k8s/probe.h"
#include "rpc/rpc.h"

#define PROG "cohort-operator"
#define MAX_COHORT_FLAGS 256
/* The Makefile passes the project's version (the VERSION file). */
#ifndef COHORT_VERSION
#error "COHORT_VERSION is not defined: build with make"
#endif
#define DEFAULT_SIDECAR_IMAGE "ghcr.io/cohort-dev/cohort:" COHORT_VERSION

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
    "                            Credentials: token, tokenFile, client certificate\n"
    "                            and key (files or -data), exec plugins (v1,\n"
    "                            v1beta1); not auth-provider or basic auth. One\n"
    "                            that the server refuses ends the operator with\n"
    "                            exit status 1 (see docs/operator.md).\n"
    "  --namespace NS            watch TrainingCohorts and pods in NS only\n"
    "                            (default: all namespaces)\n"
    "  --broker-address ADDR     host:port that trainer pods are told to reach the\n"
    "                            broker at (default: the broker Service's name,\n"
    "                            NAME.NS.svc:PORT with NAME from --broker-service,\n"
    "                            NS the operator's namespace and PORT the --listen\n"
    "                            port; the Service must serve that port)\n"
    "  --sidecar-image IMAGE     sidecar image when a cohort sets none (default\n"
    "                            " DEFAULT_SIDECAR_IMAGE ", this operator's own)\n"
    "  --sidecar-pull-policy P   Always, IfNotPresent or Never: the sidecar's\n"
    "                            imagePullPolicy when a cohort sets none (default\n"
    "                            IfNotPresent)\n"
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
    "  --broker-tls auto|off     auto (default): the broker serves TLS with a\n"
    "                            certificate issued each time a replica leads, from\n"
    "                            a CA the operator keeps in the Secret\n"
    "                            --broker-ca-secret (made on first start); every\n"
    "                            cohort's Secret carries the CA for its sidecars.\n"
    "                            off: plaintext\n"
    "  --broker-service NAME     the broker's Service, by whose name pods reach the\n"
    "                            broker: the certificate names NAME, NAME.NS,\n"
    "                            NAME.NS.svc, NAME.NS.svc.cluster.local and the\n"
    "                            host of --broker-address if given; sidecars\n"
    "                            check NAME.NS.svc. NS is the operator's\n"
    "                            namespace: $POD_NAMESPACE, else the kubeconfig\n"
    "                            context's or service account's (default\n"
    "                            cohort-broker)\n"
    "  --broker-ca-secret NAME   the CA's Secret in the operator's namespace\n"
    "                            (default cohort-broker-ca)\n"
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
    "                            rejoining a restarted broker share one (default:\n"
    "                            the members' longest reconnect, 1.2s of gRPC\n"
    "                            backoff, then max(heartbeat interval, 1s) for\n"
    "                            their next try, plus a heartbeat interval: 3.2s\n"
    "                            at the default 1s heartbeat)\n"
    "  --stream-grace DUR        a member whose stream to the broker is cut without\n"
    "                            a Leave (its process died) is out after this,\n"
    "                            unless it reconnects first (default 300ms);\n"
    "                            silence alone still takes the member timeout\n"
    "  --max-members N           members per cohort (default 4096)\n"
    "  --max-cohorts N           cohorts per broker (default 1024)\n"
    "  --max-member-timeout DUR  the longest member timeout a join may ask for\n"
    "                            beyond its cohort's (default 10m); longer asks are\n"
    "                            clamped, and the Join reply says what was granted\n"
    "  --admin-secret-file PATH  a key (64 hex digits) that reads the status of any\n"
    "                            cohort, and the only one that reads all at once\n"
    "  --no-datagram-heartbeats  take no heartbeats over UDP. By default the broker\n"
    "                            also binds the --listen port for UDP, and members\n"
    "                            of cohorts with keys send their plain heartbeats\n"
    "                            there, which costs the broker a third to a fifth\n"
    "                            of the CPU; where UDP to it is blocked, members\n"
    "                            send every heartbeat up their streams as well\n"
    "                            once no acknowledgement came for half their\n"
    "                            timeout. Datagrams are not encrypted, even with\n"
    "                            --tls-cert (each carries a proof of the key)\n"
    "\n"
    "Keys and TLS (standalone; --secret-file or --insecure is required):\n"
    "  --tls-cert PATH           serve the broker over TLS with this certificate\n"
    "                            chain (PEM); members then need the CA (the\n"
    "                            sidecar's --broker-ca)\n"
    "  --tls-key PATH            the certificate's private key (PEM)\n"
    "  --secret-file PATH        every cohort's key: 64 hex digits, as `openssl rand\n"
    "                            -hex 32` prints. Every call of a member must prove\n"
    "                            it (the sidecar's --secret-file), and so must a\n"
    "                            cohort's status (cohortctl status --secret-file)\n"
    "  --insecure                serve cohorts without keys: anyone who reaches the\n"
    "                            port may join any cohort or read its status\n"
    "\n"
    "  --log-format text|json    (default text)\n"
    "  --log-level LEVEL         debug, info, warn or error (default info)\n"
    "  -h, --help                show this text\n"
    "\n"
    "DUR is a number with a unit: 250ms, 1s, 1.5s, 2m.\n"
    "The log line \"Broker is listening.\" carries the bound address.\n"
    "\n"
    "Keys: each TrainingCohort NS/NAME gets a Secret NS/NAME-cohort-key with a\n"
    "random 256-bit key (made when missing, owned by the cohort, mounted into\n"
    "its sidecars alone); the broker refuses members that do not prove it. A\n"
    "Secret of that name the cohort does not own is never overwritten: the\n"
    "cohort reports it. To rotate a key, delete the Secret: a new key is made\n"
    "and the cohort's pods are replaced.\n"
    "\n"
    "The TrainingCohort CRD (crds/, or the chart's) must be installed: until\n"
    "it is served, the leader says so once and looks again every 500 ms.\n"
    "\n"
    "Endpoints: /healthz answers 200 while the process runs. /readyz answers\n"
    "200 only on the leader once its caches of cohorts, pods and their\n"
    "Secrets are synced, and 503 with the reason on a standby replica, so a\n"
    "Service in front of the broker port sends trainers to the leader alone.\n"
    "/metrics is Prometheus text: reconciles, errors, queue depth, API\n"
    "requests, cohorts, pods, is_leader and more.\n"
    "\n"
    "Exit status: 0 after SIGTERM or SIGINT, 1 when it cannot start, 2 for a\n"
    "usage error.\n";

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
            if (opt_duration_ms(eq + 1, LIMIT_MEMBERSHIP_FLAG_MS, &c->heartbeat_ms) < 0 ||
                !c->heartbeat_ms)
                return -EINVAL;
        } else if (strcmp(kv, "timeout") == 0) {
            if (opt_duration_ms(eq + 1, LIMIT_MEMBERSHIP_FLAG_MS, &c->timeout_ms) < 0 ||
                !c->timeout_ms)
                return -EINVAL;
        } else {
            return -EINVAL;
        }
    }
    return 0;
}

/* The broker's flags and those of both modes come first, up to O_LOGL;
 * parse_flags() hands the rest to kube_flag(). */
enum { O_STANDALONE = 256, O_LISTEN, O_COHORT, O_ANY, O_HB, O_TO, O_COALESCE, O_HOLD,
       O_GRACE, O_MAXM, O_MAXC, O_LOGF, O_LOGL, O_KUBECONFIG, O_CONTEXT, O_INCLUSTER, O_NS,
       O_BADDR,
       O_SIMG, O_SCMD, O_LNAME, O_LNS, O_IDENT, O_LDUR, O_LRENEW, O_LRETRY, O_METRICS,
       O_WORKERS, O_STPERIOD, O_DRAIN, O_RESYNC, O_WTIMEOUT, O_APITIMEOUT,
       /* Keys, TLS and datagrams: broker flags, handled by auth_flag(). */
       O_SECRET = 512, O_ADMIN, O_TLSCERT, O_TLSKEY, O_INSECURE, O_MAXTO, O_NODGRAM };
/* Kubernetes mode's broker TLS. */
enum { O_BTLS = O_APITIMEOUT + 1, O_BSVC, O_BCASECRET, O_SPULL };

/* Everything Kubernetes mode needs beyond the broker's settings. */
struct kopts {
    const char *kubeconfig, *context, *namespace, *broker_address, *sidecar_image,
        *sidecar_command, *lease_name, *lease_namespace, *identity, *metrics_listen;
    bool in_cluster;
    uint32_t lease_ms, renew_ms, retry_ms, workers, status_period_ms, drain_ms, resync_ms,
        watch_s, api_timeout_ms;
    bool broker_tls;
    const char *broker_service, *broker_ca_secret;
    const char *sidecar_pull_policy;        /* static: reconcile_pull_policy() */
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
    uint64_t renew_at_ms;           /* the broker's certificate is renewed then; 0: never */
    uint32_t lease_ms;              /* --lease-duration */
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
    a->keys_created += b->keys_created;
    a->pods_rolled += b->pods_rolled;
    a->watch_errors += b->watch_errors;
    a->relists += b->relists;
}

static void metric(struct probe_reply *r, const char *name, const char *type, const char *help,
                   unsigned long long v)
{
    probe_printf(r, "# HELP cohort_operator_%s %s\n# TYPE cohort_operator_%s %s\n"
                 "cohort_operator_%s %llu\n", name, help, name, type, name, v);
}

/* What became of the broker's datagram heartbeats, by kind: a member
 * count that stays near zero beside many refused or none at all tells of
 * UDP blocked, mangled or spoofed on the way (docs/architecture.md,
 * "Datagram heartbeats"). */
static void datagram_metrics(struct probe_reply *r, const uint64_t dg[BROKERD_DG_KINDS])
{
    static const char *const kinds[BROKERD_DG_KINDS] = {
        [BROKERD_DG_ACCEPTED] = "accepted", [BROKERD_DG_MALFORMED] = "malformed",
        [BROKERD_DG_UNPROVED] = "unproved", [BROKERD_DG_UNATTACHED] = "unattached",
        [BROKERD_DG_REPLAYED] = "replayed", [BROKERD_DG_PACED] = "paced",
        [BROKERD_DG_ACKED] = "acknowledged",
    };

    probe_printf(r, "# HELP cohort_operator_broker_datagrams_total Datagram heartbeats the "
                 "broker read, by what became of them; acknowledged: acknowledgements sent.\n"
                 "# TYPE cohort_operator_broker_datagrams_total counter\n");
    /* BROKERD_DG_DROPPED is the tests' deaf broker's alone. */
    for (int k = 0; k < BROKERD_DG_KINDS; k++)
        if (kinds[k])
            probe_printf(r, "cohort_operator_broker_datagrams_total{kind=\"%s\"} %llu\n",
                         kinds[k], (unsigned long long)dg[k]);
}

static void serve_probe(void *arg, const char *path, struct probe_reply *r)
{
    struct op *op = arg;
    struct controller_stats cs = { 0 }, now = { 0 };
    struct kube_stats ks = { 0 };
    uint64_t dg[BROKERD_DG_KINDS] = { 0 };
    bool leading, running, datagrams = false;
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
        datagrams = brokerd_datagrams(op->broker, dg);
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
        metric(r, "broker_datagrams", "gauge", "1 while the broker takes datagram heartbeats "
               "(UDP on its port).", datagrams);
        datagram_metrics(r, dg);
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
        metric(r, "keys_created_total", "counter", "Cohort Secrets made with a new key.",
               cs.keys_created);
        metric(r, "pods_rolled_total", "counter", "Pods replaced because they were made with an "
               "earlier key or CA.", cs.pods_rolled);
    } else {
        r->code = 404;
        probe_printf(r, "not found: try /metrics, /healthz or /readyz\n");
    }
}

/* The address pods are told: the flag, else the broker Service's name in
 * the operator's namespace, NAME.NS.svc:PORT. A name, never a pod's
 * address: a Service keeps it when the leader moves to another pod, and
 * the sidecars' connections find the new leader behind it. */
static int broker_address_for(const struct kopts *ko, const char *ns, int port, char *buf,
                              size_t n)
{
    int len;

    if (ko->broker_address)
        len = snprintf(buf, n, "%s", ko->broker_address);
    else if (ns && *ns)
        len = snprintf(buf, n, "%s.%s.svc:%d", ko->broker_service, ns, port);
    else
        return -EINVAL;
    if (len < 0 || (size_t)len >= n)
        return -ENAMETOOLONG;
    return ident_valid_address(buf) ? 0 : -EINVAL;
}

/* The namespace the operator runs in, where the broker's CA Secret and
 * its Service are. */
static const char *operator_namespace(const struct op *op)
{
    const char *ns = getenv("POD_NAMESPACE");

    return ns && *ns ? ns : kube_namespace(op->kube);
}

/* The broker's TLS unless --broker-tls off: a certificate issued now for
 * its Service and the host pods are told, into *b; the CA and the name
 * sidecars check, into *cc; when to renew it, into op. Returns 0 or
 * -errno after logging why; the caller frees *t with brokertls_cleanup()
 * once *b and *cc are used. */
static int broker_tls(struct op *op, const struct kopts *ko, struct brokerd_config *b,
                      struct controller_config *cc, struct brokertls *t)
{
    char addr[IDENT_ADDRESS_MAX + 1], host[IDENT_ADDRESS_MAX + 1];
    const char *extra[1];
    struct brokertls_config tc = { .kube = op->kube, .namespace = operator_namespace(op),
                                   .secret = ko->broker_ca_secret, .service = ko->broker_service,
                                   .extra = extra };
    const char *colon;
    int64_t left;
    int rc;

    op->renew_at_ms = 0;
    if (!ko->broker_tls)
        return 0;
    /* The Service's names are in the certificate already; an address
     * given with --broker-address is added. Only its host matters. */
    if (ko->broker_address && broker_address_for(ko, tc.namespace, 1, addr, sizeof(addr)) == 0 &&
        (colon = strrchr(addr, ':'))) {
        const char *h = addr;
        int n = (int)(colon - addr);
        if (n >= 2 && h[0] == '[' && h[n - 1] == ']') {
            h++;
            n -= 2;
        }
        snprintf(host, sizeof(host), "%.*s", n, h);
        extra[tc.n_extra++] = host;
    }
    rc = brokertls_load(&tc, t);
    if (rc < 0)
        return rc;
    b->tls_cert_pem = t->server.cert;
    b->tls_key_pem = t->server.key;
    cc->broker_ca_pem = t->ca_pem;
    cc->env.broker_server_name = t->server_name;
    /* Renewed with two thirds of its life behind it. */
    left = t->not_after - (int64_t)time(NULL);
    if (left > 0)
        op->renew_at_ms = clock_now_ms() + (uint64_t)left * 1000 * 2 / 3;
    log_info("operator", "The broker serves TLS.", LF_S("server_name", t->server_name),
             LF_S("ca_secret", tc.secret ? tc.secret : BROKERTLS_SECRET),
             LF_S("namespace", tc.namespace), LF_I("not_after", t->not_after));
    return 0;
}

/* Whether a controller start should give way to follow_lease(), which
 * acts on each of these: SIGINT or SIGTERM waiting to be taken (they are
 * blocked in every thread and taken by sigtimedwait there), the Lease
 * lost, or the credential refused for longer than the Lease lasts. Called
 * on follow_lease()'s own thread, inside lead(). */
static bool start_cancelled(void *arg)
{
    struct op *op = arg;
    sigset_t pending;

    if (sigpending(&pending) == 0 &&
        (sigismember(&pending, SIGTERM) == 1 || sigismember(&pending, SIGINT) == 1))
        return true;
    if (!lease_is_leader(op->lease))
        return true;
    return kube_auth_failing_ms(op->kube, NULL, 0) > op->lease_ms;
}

/* Becomes the working leader: broker, then controller. Returns 0 or -errno
 * with nothing left running. */
static int lead(struct op *op, const struct kopts *ko, const struct brokerd_config *bcfg)
{
    struct controller_config cc = { 0 };
    struct brokerd_config b = *bcfg;
    struct brokertls tls = { 0 };
    struct brokerd *d = NULL;
    struct controller *ctl = NULL;
    char addr[IDENT_ADDRESS_MAX + 1];
    int rc;

    /* In Kubernetes every cohort has a key (its Secret), and a member
     * that proves none is refused: the broker is never open. */
    b.open = false;
    rc = broker_tls(op, ko, &b, &cc, &tls);
    if (rc < 0)
        goto out;
    rc = brokerd_start(&b, &d);
    if (rc < 0) {
        log_warn("operator", "The broker could not start; trying again.",
                 LF_S("listen", b.listen), LF_ERR(rc));
        goto out;
    }
    rc = broker_address_for(ko, operator_namespace(op), brokerd_port(d), addr, sizeof(addr));
    if (rc < 0) {
        log_error("operator", "No address to give pods for the broker: the Service's name with "
                  "this namespace is not a valid address; set --broker-address.",
                  LF_S("service", ko->broker_service), LF_S("namespace", operator_namespace(op)));
        goto out_broker;
    }
    cc.kube = op->kube;
    cc.broker = d;
    cc.namespace = ko->namespace;
    cc.identity = ko->identity;
    cc.env.broker_address = addr;
    cc.env.sidecar_image = ko->sidecar_image;
    cc.env.sidecar_pull_policy = ko->sidecar_pull_policy;
    cc.env.sidecar_command = ko->sidecar_command;
    cc.workers = ko->workers;
    cc.status_period_ms = ko->status_period_ms;
    cc.drain_timeout_ms = ko->drain_ms;
    cc.resync_ms = ko->resync_ms;
    cc.watch_timeout_s = ko->watch_s;
    cc.cancelled = start_cancelled;
    cc.cancel_arg = op;
    rc = controller_start(&cc, 60000, &ctl);
    if (rc == -ECANCELED)
        goto out_broker;                /* follow_lease() says why */
    if (rc < 0) {
        log_warn("operator", "The controller could not start; trying again.", LF_ERR(rc));
        goto out_broker;
    }
    pthread_mutex_lock(&op->lock);
    op->broker = d;
    op->ctl = ctl;
    op->leader_terms++;
    pthread_mutex_unlock(&op->lock);
    log_info("operator", "Leading: reconciling cohorts and serving the broker.",
             LF_S("broker_address", addr), LF_S("identity", ko->identity),
             LF_B("tls", ko->broker_tls));
    goto out;
out_broker:
    brokerd_stop(d);
out:
    /* The broker and the controller keep copies. */
    brokertls_cleanup(&tls);
    return rc;
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

/* Loads the kubeconfig (or the pod's service account) into *kc and
 * creates the API client in op->kube, then settles what the flags left
 * open: this replica's identity (made up in `ident` if need be) and the
 * Lease's namespace. Returns 0 or -errno after logging why; the caller
 * frees *kc and op->kube either way. */
static int kube_connect(struct kopts *ko, struct kube_config *kc, struct op *op, char *ident,
                        size_t n)
{
    struct kube_opts kopt = { .timeout_ms = ko->api_timeout_ms };
    int rc;

    rc = ko->kubeconfig ? kube_config_load(ko->kubeconfig, ko->context, kc)
                        : kube_config_in_cluster(NULL, kc);
    if (rc < 0) {
        log_error("operator", ko->kubeconfig ? "The kubeconfig could not be loaded."
                  : "No in-cluster configuration (not in a pod?); pass --kubeconfig.",
                  LF_S("kubeconfig", ko->kubeconfig), LF_ERR(rc));
        return rc;
    }
    rc = kube_create(kc, &kopt, &op->kube);
    if (rc < 0) {
        log_error("operator", "The API client could not be created.",
                  LF_S("error", kube_strerror(rc)));
        return rc;
    }
    /* A credential the server refuses is no passing trouble: say so once
     * and stop, rather than retry forever. A server not up yet is. */
    {
        cJSON *v = NULL;
        rc = kube_get(op->kube, "/version", &v);
        cJSON_Delete(v);
        if (rc == -EACCES || rc == -ENOKEY) {
            log_error("operator", "Cannot authenticate to the API server; exiting.",
                      LF_S("server", kc->server), LF_S("error", kube_strerror(rc)));
            return rc;
        }
    }
    if (!ko->identity) {
        char host[256] = "operator";
        gethostname(host, sizeof(host) - 1);
        host[sizeof(host) - 1] = '\0';
        snprintf(ident, n, "%s-%ld", host, (long)getpid());
        ko->identity = getenv("POD_NAME") && *getenv("POD_NAME") ? getenv("POD_NAME") : ident;
    }
    if (!ko->lease_namespace)
        ko->lease_namespace = kube_namespace(op->kube);
    return 0;
}

/* Serves /metrics, /healthz and /readyz from `op` unless --metrics-listen
 * is "off" (then *out stays NULL). Returns 0 or -errno after logging why;
 * the caller stops *out with probe_stop(). */
static int serve_metrics(const struct kopts *ko, struct op *op, struct probe **out)
{
    const char *colon;
    char addr[300];
    int rc;

    if (!ko->metrics_listen || strcmp(ko->metrics_listen, "off") == 0)
        return 0;
    rc = probe_start(ko->metrics_listen, serve_probe, op, out);
    if (rc < 0) {
        log_error("operator", "The metrics endpoint could not listen.",
                  LF_S("listen", ko->metrics_listen), LF_ERR(rc));
        return rc;
    }
    colon = strrchr(ko->metrics_listen, ':');
    snprintf(addr, sizeof(addr), "%.*s:%d", colon ? (int)(colon - ko->metrics_listen) : 0,
             ko->metrics_listen, probe_port(*out));
    log_info("operator", "Serving /metrics, /healthz and /readyz.", LF_S("address", addr));
    return 0;
}

/* Starts campaigning for the Lease, into op->lease. Returns 0 or -errno
 * after logging why; resign() ends it. */
static int campaign(const struct kopts *ko, struct op *op)
{
    struct lease_config lc = {
        .kube = op->kube, .namespace = ko->lease_namespace, .name = ko->lease_name,
        .identity = ko->identity, .lease_duration_ms = ko->lease_ms,
        .renew_deadline_ms = ko->renew_ms, .retry_period_ms = ko->retry_ms,
    };
    struct lease *l = NULL;
    int rc;

    rc = lease_start(&lc, &l);
    if (rc < 0) {
        log_error("operator", "Leader election could not start.", LF_ERR(rc));
        return rc;
    }
    pthread_mutex_lock(&op->lock);
    op->lease = l;
    pthread_mutex_unlock(&op->lock);
    log_info("operator", "Campaigning for leadership.", LF_S("lease", ko->lease_name),
             LF_S("lease_namespace", ko->lease_namespace), LF_S("identity", ko->identity),
             LF_S("namespace", ko->namespace ? ko->namespace : "(all)"));
    return 0;
}

/* How often a leader without the CRD looks for it: it is seen within
 * this long of being created. Discovery is cheap and served from memory. */
#define CRD_POLL_MS 500

/* Whether the controller can start: false while the API server does not
 * serve TrainingCohorts, said once (and once more when the CRD comes)
 * instead of the reflector's backing off, which would notice a new CRD
 * only up to 16 s late. Any other error lets the start go on and report
 * it. */
static bool crd_ready(struct op *op, bool *missing)
{
    int rc = controller_crd_served(op->kube);

    if (rc == -ENOENT) {
        if (!*missing)
            log_warn("operator", "The TrainingCohort CustomResourceDefinition is not installed; "
                     "waiting for it. Install it with kubectl apply -f "
                     "crds/trainingcohorts.cohort.dev.yaml, or with helm install (the chart's "
                     "crds/).", LF_S("crd", "trainingcohorts." RECONCILE_GROUP));
        *missing = true;
        return false;
    }
    if (*missing)
        log_info("operator", "The TrainingCohort CustomResourceDefinition is served; starting "
                 "the controller.");
    *missing = false;
    return true;
}

/* The leader election loop: leads (broker and controller) while the Lease
 * is ours, steps down when it is lost, and retries a failed start after a
 * second, until SIGINT or SIGTERM. Returns that signal, or 0 when the API
 * server has refused every credential for longer than the Lease lasts. */
static int follow_lease(struct op *op, const struct kopts *ko, const struct brokerd_config *bcfg,
                        const sigset_t *sigs)
{
    uint64_t next_try = 0;
    bool crd_missing = false;
    char why[600];
    int sig;

    for (;;) {
        struct timespec ts = { 0, 100 * 1000000L };
        bool leading = lease_is_leader(op->lease), running;

        pthread_mutex_lock(&op->lock);
        running = op->ctl != NULL;
        pthread_mutex_unlock(&op->lock);
        if (leading && !running && clock_now_ms() >= next_try) {
            if (!crd_ready(op, &crd_missing))
                next_try = clock_now_ms() + CRD_POLL_MS;
            else if (lead(op, ko, bcfg) < 0)
                next_try = clock_now_ms() + 1000;
        } else if (!leading && running) {
            log_warn("operator", "Lost the Lease; stopping the controller and the broker.");
            step_down(op);
        } else if (running && op->renew_at_ms && clock_now_ms() >= op->renew_at_ms) {
            /* The broker cannot swap its certificate while it serves: it
             * starts again with a new one, and members rejoin as after a
             * change of leader. */
            log_info("operator", "The broker's certificate is due for renewal; restarting the "
                     "broker and the controller with a new one.");
            step_down(op);
        }
        /* Longer without a credential the server takes than the Lease
         * lasts: this replica cannot lead, and a restart (a new
         * service-account token, a working plugin) is what can cure it. */
        if (kube_auth_failing_ms(op->kube, why, sizeof(why)) > ko->lease_ms) {
            log_error("operator", "Lost the credential the API server accepts; exiting.",
                      LF_S("error", why));
            return 0;
        }
        sig = sigtimedwait(sigs, NULL, &ts);
        if (sig > 0)
            return sig;
    }
}

/* Stops leading, then gives the Lease up: released after the broker
 * stopped, so a successor binding the same broker port finds it free. */
static void resign(struct op *op)
{
    step_down(op);
    pthread_mutex_lock(&op->lock);
    lease_destroy(op->lease);
    op->lease = NULL;
    pthread_mutex_unlock(&op->lock);
}

/* Kubernetes mode, until SIGINT or SIGTERM. Returns the exit status. */
static int run_kube(const struct kopts *ko_in, const struct brokerd_config *bcfg,
                    const sigset_t *sigs)
{
    struct kopts ko = *ko_in;
    struct kube_config kc = { 0 };
    struct op op = { 0 };
    struct probe *probe = NULL;
    char ident[300];
    int sig, status = 1;

    pthread_mutex_init(&op.lock, NULL);
    op.lease_ms = ko.lease_ms;
    if (kube_connect(&ko, &kc, &op, ident, sizeof(ident)) < 0)
        goto out_kube;
    if (serve_metrics(&ko, &op, &probe) < 0)
        goto out_kube;
    if (campaign(&ko, &op) < 0)
        goto out_probe;
    sig = follow_lease(&op, &ko, bcfg, sigs);
    if (sig > 0) {
        log_info("operator", "Stopping.", LF_S("signal", strsignal(sig)));
        status = 0;
    }
    resign(&op);
out_probe:
    probe_stop(probe);
out_kube:
    kube_destroy(op.kube);
    kube_config_cleanup(&kc);
    pthread_mutex_destroy(&op.lock);
    return status;
}

/* --standalone: the broker alone, with the declared cohorts, until SIGINT
 * or SIGTERM. Returns the exit status. */
static int run_standalone(const struct brokerd_config *cfg, const struct cohort_spec *cohorts,
                          size_t n, const sigset_t *sigs)
{
    char addr[IDENT_ADDRESS_MAX + 16];
    const char *colon = strrchr(cfg->listen, ':');
    struct brokerd *d = NULL;
    int rc, sig, status = 1;

    rc = brokerd_start(cfg, &d);
    if (rc < 0) {
        log_error("operator", "The broker could not start.", LF_S("listen", cfg->listen),
                  LF_ERR(rc));
        return 1;
    }
    for (size_t i = 0; i < n; i++) {
        rc = brokerd_declare(d, cohorts[i].name, (uint32_t)cohorts[i].heartbeat_ms,
                             (uint32_t)cohorts[i].timeout_ms);
        if (rc < 0) {
            log_error("operator", "A cohort could not be declared.", LF_S("cohort", cohorts[i].name),
                      LF_ERR(rc));
            goto out_broker;
        }
    }
    snprintf(addr, sizeof(addr), "%.*s:%d", colon ? (int)(colon - cfg->listen) : 0, cfg->listen,
             brokerd_port(d));
    if (cfg->open)
        log_warn("operator", "Serving cohorts without keys (--insecure): anyone who reaches "
                 "the broker may join any cohort or read its status.");
    log_info("operator", "Broker is listening.", LF_S("address", addr), LF_U("cohorts", n),
             LF_B("allow_any_cohort", cfg->broker.allow_any_cohort),
             LF_U("heartbeat_ms", cfg->broker.heartbeat_ms),
             LF_U("timeout_ms", cfg->broker.timeout_ms), LF_B("keys", cfg->key != NULL),
             LF_B("admin_key", cfg->admin_key != NULL), LF_B("tls", cfg->tls_cert_pem != NULL),
             LF_B("datagrams", brokerd_datagrams(d, NULL)));
    while (sigwait(sigs, &sig) != 0)
        ;
    log_info("operator", "Stopping.", LF_S("signal", strsignal(sig)));
    status = 0;
out_broker:
    brokerd_stop(d);
    return status;
}

/* What the flags ask for. */
struct flags {
    struct brokerd_config bcfg;
    struct kopts ko;
    struct cohort_spec cohorts[MAX_COHORT_FLAGS];
    size_t n_cohorts;
    bool standalone, hold_set;
    const char *logf, *logl;
    /* Keys and TLS: the flags, then what their files hold (bcfg points
     * here). */
    const char *secret_file, *admin_file, *tls_cert_file, *tls_key_file;
    bool insecure;
    struct secret key, admin_key;
    char *tls_cert, *tls_key;
};

/* One flag of keys and TLS (O_SECRET on). Returns 0 or OPT_EXIT_USAGE. */
static int auth_flag(struct flags *f, int opt, const char *arg)
{
    uint64_t v;

    switch (opt) {
    case O_SECRET: f->secret_file = arg; break;
    case O_ADMIN: f->admin_file = arg; break;
    case O_TLSCERT: f->tls_cert_file = arg; break;
    case O_TLSKEY: f->tls_key_file = arg; break;
    case O_INSECURE: f->insecure = true; break;
    case O_NODGRAM: f->bcfg.no_datagrams = true; break;
    case O_MAXTO:
        if (opt_duration_ms(arg, LIMIT_MEMBERSHIP_FLAG_MS, &v) < 0 || v == 0)
            return opt_usage(PROG, "bad --max-member-timeout \"%s\"", arg);
        f->bcfg.broker.max_timeout_ms = (uint32_t)v;
        break;
    }
    return 0;
}

static int key_file(const char *flag, const char *path, struct secret *out)
{
    int rc = secret_load(path, out);

    if (rc < 0)
        return opt_usage(PROG, "cannot use --%s \"%s\": %s", flag, path,
                         rc == -EINVAL ? "not 64 hexadecimal digits" : strerror(-rc));
    return 0;
}

static int pem_file(const char *flag, const char *path, char **out)
{
    int rc = rpc_pem_load(path, out);

    if (rc < 0)
        return opt_usage(PROG, "cannot use --%s \"%s\": %s", flag, path,
                         rc == -EINVAL ? "no PEM block in it"
                         : rc == -EFBIG ? "longer than 256 KiB" : strerror(-rc));
    return 0;
}

/* The rules of keys and TLS, and their files read into bcfg. Returns 0
 * or OPT_EXIT_USAGE after reporting why. */
static int check_auth(struct flags *f)
{
    if (f->standalone && !f->secret_file && !f->insecure)
        return opt_usage(PROG, "--standalone needs --secret-file PATH (the cohorts' key) or "
                         "--insecure (serve cohorts without keys)");
    if (f->secret_file && f->insecure)
        return opt_usage(PROG, "give --secret-file or --insecure, not both");
    if (!f->standalone && (f->secret_file || f->insecure))
        return opt_usage(PROG, "--secret-file and --insecure are for --standalone; in "
                         "Kubernetes each cohort has its own key");
    if (!f->standalone && (f->tls_cert_file || f->tls_key_file))
        return opt_usage(PROG, "--tls-cert and --tls-key are for --standalone");
    if (!f->tls_cert_file != !f->tls_key_file)
        return opt_usage(PROG, "--tls-cert and --tls-key go together");
    if (f->secret_file && key_file("secret-file", f->secret_file, &f->key))
        return OPT_EXIT_USAGE;
    if (f->admin_file && key_file("admin-secret-file", f->admin_file, &f->admin_key))
        return OPT_EXIT_USAGE;
    if (f->tls_cert_file && (pem_file("tls-cert", f->tls_cert_file, &f->tls_cert) ||
                             pem_file("tls-key", f->tls_key_file, &f->tls_key)))
        return OPT_EXIT_USAGE;
    f->bcfg.key = f->secret_file ? &f->key : NULL;
    f->bcfg.admin_key = f->admin_file ? &f->admin_key : NULL;
    f->bcfg.tls_cert_pem = f->tls_cert;
    f->bcfg.tls_key_pem = f->tls_key;
    /* Kubernetes mode is never open: lead() gives the broker each
     * cohort's key from its Secret (brokerd_set_key) before any pod. */
    f->bcfg.open = f->insecure && f->standalone;
    return 0;
}

static int duration_flag(const char *flag, const char *arg, uint64_t max, uint32_t *out)
{
    uint64_t v;

    if (opt_duration_ms(arg, max, &v) < 0 || v == 0)
        return opt_usage(PROG, "bad --%s (a duration such as 500ms, 2s)", flag);
    *out = (uint32_t)v;
    return 0;
}

/* One flag of the broker's, or of both modes (O_STANDALONE to O_LOGL).
 * Returns 0 or OPT_EXIT_USAGE after reporting why. */
static int broker_flag(struct flags *f, int opt, const char *arg)
{
    struct broker_config *b = &f->bcfg.broker;
    uint64_t v;

    switch (opt) {
    case O_STANDALONE: f->standalone = true; break;
    case O_LISTEN: f->bcfg.listen = arg; break;
    case O_COHORT:
        if (f->n_cohorts == MAX_COHORT_FLAGS)
            return opt_usage(PROG, "at most %d --cohort flags", MAX_COHORT_FLAGS);
        if (parse_cohort(arg, &f->cohorts[f->n_cohorts]) < 0)
            return opt_usage(PROG, "bad --cohort \"%s\": want NAME or "
                             "NAME:heartbeat=DUR,timeout=DUR", arg);
        f->n_cohorts++;
        break;
    case O_ANY: b->allow_any_cohort = true; break;
    case O_HB:
        if (opt_duration_ms(arg, LIMIT_MEMBERSHIP_FLAG_MS, &v) < 0 || v == 0)
            return opt_usage(PROG, "bad --heartbeat-interval \"%s\"", arg);
        b->heartbeat_ms = (uint32_t)v;
        break;
    case O_TO:
        if (opt_duration_ms(arg, LIMIT_MEMBERSHIP_FLAG_MS, &v) < 0 || v == 0)
            return opt_usage(PROG, "bad --member-timeout \"%s\"", arg);
        b->timeout_ms = (uint32_t)v;
        break;
    case O_COALESCE:
        if (opt_duration_ms(arg, 60000, &v) < 0)
            return opt_usage(PROG, "bad --coalesce \"%s\" (at most 1m)", arg);
        b->coalesce_ms = (uint32_t)v;
        break;
    case O_HOLD:
        if (opt_duration_ms(arg, 600000, &v) < 0)
            return opt_usage(PROG, "bad --startup-hold \"%s\" (at most 10m)", arg);
        b->startup_hold_ms = (uint32_t)v;
        f->hold_set = true;
        break;
    case O_GRACE:
        if (opt_duration_ms(arg, 60000, &v) < 0)
            return opt_usage(PROG, "bad --stream-grace \"%s\" (at most 1m)", arg);
        b->stream_grace_ms = (uint32_t)v;
        break;
    case O_MAXM:
        if (opt_uint(arg, 1, 1u << 20, &v) < 0)
            return opt_usage(PROG, "bad --max-members \"%s\" (1 to 1048576)", arg);
        b->max_members = (uint32_t)v;
        break;
    case O_MAXC:
        if (opt_uint(arg, 1, 1u << 20, &v) < 0)
            return opt_usage(PROG, "bad --max-cohorts \"%s\" (1 to 1048576)", arg);
        b->max_cohorts = (uint32_t)v;
        break;
    case O_LOGF: f->logf = arg; break;
    case O_LOGL: f->logl = arg; break;
    }
    return 0;
}

/* One flag of Kubernetes mode (O_KUBECONFIG on). Returns 0 or
 * OPT_EXIT_USAGE after reporting why. */
static int kube_flag(struct kopts *ko, int opt, const char *arg)
{
    uint64_t v;
    uint32_t w = 0;

    switch (opt) {
    case O_KUBECONFIG: ko->kubeconfig = arg; break;
    case O_CONTEXT: ko->context = arg; break;
    case O_INCLUSTER: ko->in_cluster = true; break;
    case O_NS:
        if (!*arg || strlen(arg) > LIMIT_KUBE_LABEL_MAX || strchr(arg, '/'))
            return opt_usage(PROG, "bad --namespace \"%s\"", arg);
        ko->namespace = arg;
        break;
    case O_BADDR:
        if (!ident_valid_address(arg))
            return opt_usage(PROG, "bad --broker-address \"%s\": want host:port", arg);
        ko->broker_address = arg;
        break;
    case O_SIMG: ko->sidecar_image = arg; break;
    case O_SCMD: ko->sidecar_command = arg; break;
    case O_SPULL:
        ko->sidecar_pull_policy = reconcile_pull_policy(arg);
        if (!ko->sidecar_pull_policy)
            return opt_usage(PROG, "bad --sidecar-pull-policy \"%s\": Always, IfNotPresent or "
                             "Never", arg);
        break;
    case O_LNAME: ko->lease_name = arg; break;
    case O_LNS: ko->lease_namespace = arg; break;
    case O_IDENT: ko->identity = arg; break;
    case O_LDUR: return duration_flag("lease-duration", arg, 3600000, &ko->lease_ms);
    case O_LRENEW: return duration_flag("renew-deadline", arg, 3600000, &ko->renew_ms);
    case O_LRETRY: return duration_flag("retry-period", arg, 3600000, &ko->retry_ms);
    case O_METRICS: ko->metrics_listen = arg; break;
    case O_WORKERS:
        if (opt_uint(arg, 1, 16, &v) < 0)
            return opt_usage(PROG, "bad --workers \"%s\" (1 to 16)", arg);
        ko->workers = (uint32_t)v;
        break;
    case O_STPERIOD: return duration_flag("status-period", arg, 3600000, &ko->status_period_ms);
    case O_DRAIN: return duration_flag("drain-timeout", arg, 3600000, &ko->drain_ms);
    case O_RESYNC: return duration_flag("resync", arg, 86400000, &ko->resync_ms);
    case O_WTIMEOUT:
        if (duration_flag("watch-timeout", arg, 3600000, &w))
            return OPT_EXIT_USAGE;
        ko->watch_s = w < 1000 ? 1 : w / 1000;
        break;
    case O_APITIMEOUT: return duration_flag("api-timeout", arg, 600000, &ko->api_timeout_ms);
    case O_BTLS:
        if (strcmp(arg, "auto") != 0 && strcmp(arg, "off") != 0)
            return opt_usage(PROG, "bad --broker-tls \"%s\": auto or off", arg);
        ko->broker_tls = strcmp(arg, "auto") == 0;
        break;
    case O_BSVC:
        /* A DNS label, as Service names are: it heads the certificate's
         * names. */
        if (!*arg || strlen(arg) > LIMIT_KUBE_LABEL_MAX ||
            strspn(arg, "abcdefghijklmnopqrstuvwxyz0123456789-") != strlen(arg) ||
            arg[0] == '-' || arg[strlen(arg) - 1] == '-')
            return opt_usage(PROG, "bad --broker-service \"%s\": a Service name", arg);
        ko->broker_service = arg;
        break;
    case O_BCASECRET:
        if (!*arg || strlen(arg) > IDENT_NAME_MAX || strchr(arg, '/'))
            return opt_usage(PROG, "bad --broker-ca-secret \"%s\": a Secret name", arg);
        ko->broker_ca_secret = arg;
        break;
    }
    return 0;
}

/* The rules between flags, and the log settings. Returns 0 or
 * OPT_EXIT_USAGE after reporting why. */
static int check_flags(struct flags *f)
{
    const struct kopts *ko = &f->ko;
    struct broker_config *b = &f->bcfg.broker;

    if (opt_logging(PROG, f->logf, f->logl) < 0)
        return OPT_EXIT_USAGE;
    if (f->standalone && (ko->kubeconfig || ko->in_cluster))
        return opt_usage(PROG, "--standalone runs without Kubernetes: drop "
                         "--kubeconfig/--in-cluster");
    if (ko->kubeconfig && ko->in_cluster)
        return opt_usage(PROG, "give --kubeconfig or --in-cluster, not both");
    if (!f->standalone && f->n_cohorts)
        return opt_usage(PROG, "--cohort is for --standalone; in Kubernetes the cohorts are "
                         "TrainingCohort objects");
    if (!(ko->retry_ms < ko->renew_ms && ko->renew_ms < ko->lease_ms))
        return opt_usage(PROG, "want --retry-period < --renew-deadline < --lease-duration");
    if (b->timeout_ms <= b->heartbeat_ms)
        return opt_usage(PROG, "--member-timeout must be longer than --heartbeat-interval");
    if (!f->hold_set)
        b->startup_hold_ms = broker_startup_hold_ms(b->heartbeat_ms);
    return check_auth(f);
}

/* Fills *f from the command line. Returns 0 to start, -1 after printing
 * --help (exit 0), or OPT_EXIT_USAGE after reporting a usage error. */
static int parse_flags(int argc, char **argv, struct flags *f)
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
        { "stream-grace", required_argument, NULL, O_GRACE },
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
        { "sidecar-pull-policy", required_argument, NULL, O_SPULL },
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
        { "broker-tls", required_argument, NULL, O_BTLS },
        { "broker-service", required_argument, NULL, O_BSVC },
        { "broker-ca-secret", required_argument, NULL, O_BCASECRET },
        { "secret-file", required_argument, NULL, O_SECRET },
        { "admin-secret-file", required_argument, NULL, O_ADMIN },
        { "tls-cert", required_argument, NULL, O_TLSCERT },
        { "tls-key", required_argument, NULL, O_TLSKEY },
        { "insecure", no_argument, NULL, O_INSECURE },
        { "max-member-timeout", required_argument, NULL, O_MAXTO },
        { "no-datagram-heartbeats", no_argument, NULL, O_NODGRAM },
        { "help", no_argument, NULL, 'h' },
        { NULL, 0, NULL, 0 },
    };
    int opt, rc;

    f->bcfg.listen = "0.0.0.0:7070";
    broker_config_default(&f->bcfg.broker);
    f->ko = (struct kopts){
        .sidecar_image = DEFAULT_SIDECAR_IMAGE, .sidecar_command = "cohort-sidecar",
        .sidecar_pull_policy = "IfNotPresent",
        .lease_name = "cohort-operator", .metrics_listen = "0.0.0.0:8080",
        .lease_ms = 15000, .renew_ms = 10000, .retry_ms = 2000, .workers = 2,
        .status_period_ms = 5000, .resync_ms = 30000, .watch_s = 300, .api_timeout_ms = 30000,
        .broker_tls = true, .broker_service = BROKERTLS_SERVICE,
        .broker_ca_secret = BROKERTLS_SECRET,
    };
    while ((opt = opt_next(PROG, argc, argv, "h", longopts)) != -1) {
        if (opt == 'h') {
            fputs(usage, stdout);
            return -1;
        }
        if (opt == '?')
            return OPT_EXIT_USAGE;
        /* The enum lists the broker's flags first, keys and TLS last. */
        rc = opt >= O_SECRET      ? auth_flag(f, opt, optarg)
             : opt < O_KUBECONFIG ? broker_flag(f, opt, optarg)
                                  : kube_flag(&f->ko, opt, optarg);
        if (rc != 0)
            return rc;
    }
    if (opt_no_operands(PROG, argc, argv, optind))
        return OPT_EXIT_USAGE;
    return check_flags(f);
}

/* Signals go to the main thread only, which waits for them: blocked
 * before gRPC starts its threads, so none of those ever receives one.
 * Returns 0, or -1 after logging that gRPC could not start. */
static int start_process(sigset_t *sigs)
{
    sigemptyset(sigs);
    sigaddset(sigs, SIGINT);
    sigaddset(sigs, SIGTERM);
    pthread_sigmask(SIG_BLOCK, sigs, NULL);
    signal(SIGPIPE, SIG_IGN);
    /* One completion thread: this process's calls are the broker's, whose
     * callbacks only take short locks, and a single thread saves the
     * hand-offs between two on every heartbeat (about a fifth of the
     * broker's CPU in bench/broker.sh). */
    if (rpc_init_threads(1) < 0) {
        log_error("operator", "gRPC could not start.");
        return -1;
    }
    return 0;
}

int main(int argc, char **argv)
{
    static struct flags f;      /* its cohort specs are too many for the stack */
    sigset_t sigs;
    int rc;

    rc = parse_flags(argc, argv, &f);
    if (rc != 0)
        return rc < 0 ? 0 : rc;
    if (start_process(&sigs) < 0)
        return 1;
    if (f.standalone)
        rc = run_standalone(&f.bcfg, f.cohorts, f.n_cohorts, &sigs);
    else
        rc = run_kube(&f.ko, &f.bcfg, &sigs);
    rpc_shutdown();
    secret_wipe(&f.key);
    secret_wipe(&f.admin_key);
    rpc_pem_free(f.tls_cert);
    rpc_pem_free(f.tls_key);
    return rc;
}

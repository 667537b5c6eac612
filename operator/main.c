/* operator/main.c: cohort-operator. With --standalone it hosts the broker
 * alone, with no Kubernetes. */
#include <errno.h>
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "brokerd.h"
#include "ident.h"
#include "log.h"
#include "opt.h"
#include "rpc.h"

#define PROG "cohort-operator"
#define MAX_COHORT_FLAGS 256
#define DURATION_MAX_MS (24ull * 3600 * 1000)

static const char usage[] =
    "Usage: " PROG " --standalone [--listen ADDR] [options]\n"
    "\n"
    "Hosts the cohort broker: per cohort the members, their heartbeats, the\n"
    "epochs and the leader.\n"
    "\n"
    "  --standalone              run the broker alone, with no Kubernetes\n"
    "  --listen ADDR             broker address, host:port; port 0 picks a free one\n"
    "                            (default 0.0.0.0:7070)\n"
    "  --cohort SPEC             declare a cohort; SPEC is NAME or\n"
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
    "The log line \"Broker is listening.\" carries the bound address.\n";

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
       O_MAXM, O_MAXC, O_LOGF, O_LOGL };

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
        { "help", no_argument, NULL, 'h' },
        { NULL, 0, NULL, 0 },
    };
    static struct cohort_spec cohorts[MAX_COHORT_FLAGS];
    struct brokerd_config cfg = { .listen = "0.0.0.0:7070" };
    const char *logf = NULL, *logl = NULL;
    bool standalone = false, hold_set = false;
    size_t n_cohorts = 0;
    struct brokerd *d = NULL;
    sigset_t sigs;
    uint64_t v;
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
    if (!standalone)
        return bad("%s", "this build runs the broker only: pass --standalone");
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

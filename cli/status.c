/* cli/status.c: `cohortctl status`: asks a broker for its cohorts and
 * prints them as tables or as JSON. */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "cli.h"
#include "cohort.pb-c.h"
#include "base/ident.h"
#include "base/log.h"
#include "base/opt.h"
#include "base/secret.h"
#include "membership/proof.h"
#include "rpc/rpc.h"
#include "membership/wire.h"

#define PROG "cohortctl status"

static const char usage[] =
    "Usage: cohortctl status --broker ADDR [--cohort NAME] [-o table|json]\n"
    "\n"
    "Shows each cohort's epoch, leader and members as the broker sees them.\n"
    "Model versions are the latest each member reported. A broker with keys\n"
    "shows a cohort to whoever proves its key or the admin key, and every\n"
    "cohort at once only to the admin key.\n"
    "\n"
    "  --broker ADDR     broker address, host:port (env COHORT_BROKER)\n"
    "  --cohort NAME     only this cohort (exit status 1 if the broker has none)\n"
    "  --secret-file PATH  the cohort's key, 64 hex digits (env COHORT_SECRET_FILE)\n"
    "  --admin-secret-file PATH  the broker's admin key: any cohort, or all\n"
    "  --broker-ca PATH  reach the broker over TLS, trusting this PEM file's CA\n"
    "                    certificates (env COHORT_BROKER_CA)\n"
    "  --broker-server-name NAME  the name the broker's certificate carries, when\n"
    "                    --broker is another (env COHORT_BROKER_SERVER_NAME)\n"
    "  -o, --output FMT  table (default) or json:\n"
    "                    {\"cohorts\":[{\"name\",\"epoch\",\"leader\",\n"
    "                      \"members\":[{\"id\",\"address\",\"model_version\",\n"
    "                                   \"draining\"}]}]}\n"
    "  --timeout DUR     give up after this long (default 5s)\n"
    "  --log-format text|json  format of log lines on stderr (default text)\n"
    "  --log-level LEVEL       debug, info, warn or error (default error)\n"
    "  -h, --help        show this text\n";

static int print_json(const Cohort__V1__StatusReply *rep)
{
    cJSON *root = cJSON_CreateObject(), *arr = cJSON_AddArrayToObject(root, "cohorts");
    char *text;

    for (size_t i = 0; i < rep->n_cohorts; i++) {
        const Cohort__V1__CohortStatus *c = rep->cohorts[i];
        cJSON *o = cJSON_CreateObject(), *ms;
        cJSON_AddStringToObject(o, "name", c->name);
        cJSON_AddNumberToObject(o, "epoch", (double)c->epoch);
        if (c->leader[0])
            cJSON_AddStringToObject(o, "leader", c->leader);
        else
            cJSON_AddNullToObject(o, "leader");
        ms = cJSON_AddArrayToObject(o, "members");
        for (size_t k = 0; k < c->n_members; k++) {
            cJSON *m = cJSON_CreateObject();
            cJSON_AddStringToObject(m, "id", c->members[k]->id);
            cJSON_AddStringToObject(m, "address", c->members[k]->address);
            cJSON_AddNumberToObject(m, "model_version", (double)c->members[k]->model_version);
            cJSON_AddBoolToObject(m, "draining", c->members[k]->draining);
            cJSON_AddItemToArray(ms, m);
        }
        cJSON_AddItemToArray(arr, o);
    }
    text = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    if (!text)
        return 1;
    puts(text);
    free(text);
    return 0;
}

static int width(const char *s, int min)
{
    int n = (int)strlen(s);
    return n > min ? n : min;
}

static void print_tables(const Cohort__V1__StatusReply *rep)
{
    int wn = 6, wl = 6;

    for (size_t i = 0; i < rep->n_cohorts; i++) {
        wn = width(rep->cohorts[i]->name, wn);
        wl = width(rep->cohorts[i]->leader, wl);
    }
    printf("%-*s  %8s  %-*s  %7s\n", wn, "COHORT", "EPOCH", wl, "LEADER", "MEMBERS");
    for (size_t i = 0; i < rep->n_cohorts; i++) {
        const Cohort__V1__CohortStatus *c = rep->cohorts[i];
        printf("%-*s  %8llu  %-*s  %7zu\n", wn, c->name, (unsigned long long)c->epoch, wl,
               c->leader[0] ? c->leader : "-", c->n_members);
    }
    for (size_t i = 0; i < rep->n_cohorts; i++) {
        const Cohort__V1__CohortStatus *c = rep->cohorts[i];
        int wi = 2, wa = 7;
        if (c->n_members == 0)
            continue;
        for (size_t k = 0; k < c->n_members; k++) {
            wi = width(c->members[k]->id, wi);
            wa = width(c->members[k]->address, wa);
        }
        printf("\n%s:\n  %-*s  %-*s  %13s  %s\n", c->name, wi, "ID", wa, "ADDRESS", "MODEL_VERSION",
               "LEADER");
        for (size_t k = 0; k < c->n_members; k++) {
            const Cohort__V1__Member *m = c->members[k];
            printf("  %-*s  %-*s  %13llu  %s\n", wi, m->id, wa, m->address,
                   (unsigned long long)m->model_version,
                   strcmp(m->id, c->leader) == 0 ? "*" : m->draining ? "(draining)" : "");
        }
    }
}

/* Reads the key to prove: the admin key when given (it reads anything),
 * else the cohort's. Returns 1 with *k set, 0 for none, or
 * OPT_EXIT_USAGE after reporting why. */
static int load_key(const char *secret_file, const char *admin_file, struct secret *k)
{
    const char *path = admin_file ? admin_file : secret_file;
    int rc;

    if (!path || !*path)
        return 0;
    rc = secret_load(path, k);
    if (rc < 0)
        return opt_usage(PROG, "cannot use --%s \"%s\": %s",
                         admin_file ? "admin-secret-file" : "secret-file", path,
                         rc == -EINVAL ? "not 64 hexadecimal digits" : strerror(-rc));
    return 1;
}

int cli_status(int argc, char **argv)
{
    static const struct option longopts[] = {
        { "broker", required_argument, NULL, 'b' },
        { "cohort", required_argument, NULL, 'c' },
        { "output", required_argument, NULL, 'o' },
        { "timeout", required_argument, NULL, 't' },
        { "log-format", required_argument, NULL, 'F' },
        { "log-level", required_argument, NULL, 'L' },
        { "secret-file", required_argument, NULL, 'S' },
        { "admin-secret-file", required_argument, NULL, 'A' },
        { "broker-ca", required_argument, NULL, 'C' },
        { "broker-server-name", required_argument, NULL, 'N' },
        { "help", no_argument, NULL, 'h' },
        { NULL, 0, NULL, 0 },
    };
    Cohort__V1__StatusRequest q = COHORT__V1__STATUS_REQUEST__INIT;
    const char *broker = getenv("COHORT_BROKER"), *cohort = "", *output = "table";
    const char *logf = NULL, *logl = "error";
    const char *secret_file = getenv("COHORT_SECRET_FILE"), *admin_file = NULL;
    const char *ca_file = getenv("COHORT_BROKER_CA");
    struct rpc_channel_opts co = { .tls_server_name = getenv("COHORT_BROKER_SERVER_NAME") };
    struct secret key;
    Cohort__V1__Proof pf;
    uint8_t mac[SECRET_MAC_BYTES];
    char *ca = NULL;
    int have_key;
    bool json;
    struct rpc_channel *ch = NULL;
    ProtobufCMessage *reply = NULL;
    struct rpc_status st;
    uint64_t timeout_ms = 5000;
    int opt, rc, status = 1;

    optind = 1;
    while ((opt = opt_next(PROG, argc, argv, "o:h", longopts)) != -1) {
        switch (opt) {
        case 'b': broker = optarg; break;
        case 'c': cohort = optarg; break;
        case 'o': output = optarg; break;
        case 'F': logf = optarg; break;
        case 'L': logl = optarg; break;
        case 'S': secret_file = optarg; break;
        case 'A': admin_file = optarg; break;
        case 'C': ca_file = optarg; break;
        case 'N': co.tls_server_name = optarg; break;
        case 't':
            if (opt_duration_ms(optarg, 3600000, &timeout_ms) < 0 || timeout_ms == 0)
                return opt_usage(PROG, "bad --timeout \"%s\"", optarg);
            break;
        case 'h':
            fputs(usage, stdout);
            return 0;
        default:
            return OPT_EXIT_USAGE;
        }
    }
    if (opt_no_operands(PROG, argc, argv, optind))
        return OPT_EXIT_USAGE;
    if (!broker || !*broker)
        return opt_usage(PROG, "--broker is required");
    if (cohort[0] && !ident_valid_cohort(cohort))
        return opt_usage(PROG, "bad --cohort \"%s\"", cohort);
    if (opt_output(PROG, output, &json) != 0)
        return OPT_EXIT_USAGE;

    if (co.tls_server_name && !*co.tls_server_name)
        co.tls_server_name = NULL;
    if (co.tls_server_name && !(ca_file && *ca_file))
        return opt_usage(PROG, "--broker-server-name needs --broker-ca");
    if (opt_logging(PROG, logf, logl) < 0)
        return OPT_EXIT_USAGE;
    have_key = load_key(secret_file, admin_file, &key);
    if (have_key == OPT_EXIT_USAGE)
        return OPT_EXIT_USAGE;
    if (ca_file && *ca_file) {
        rc = rpc_pem_load(ca_file, &ca);
        if (rc < 0) {
            secret_wipe(&key);
            return opt_usage(PROG, "cannot use --broker-ca \"%s\": %s", ca_file,
                             rc == -EINVAL ? "no PEM block in it"
                             : rc == -EFBIG ? "longer than 256 KiB" : strerror(-rc));
        }
        co.tls_ca_pem = ca;
    }
    if (rpc_init() < 0) {
        fprintf(stderr, "cohortctl status: gRPC could not start\n");
        secret_wipe(&key);
        rpc_pem_free(ca);
        return 1;
    }
    rc = rpc_channel_create(broker, &co, &ch);
    if (rc < 0) {
        fprintf(stderr, "cohortctl status: bad broker address \"%s\"\n", broker);
        goto out;
    }
    q.protocol_version = WIRE_PROTOCOL_VERSION;
    q.cohort = (char *)cohort;
    /* A Status proof's seq is not judged; its time is. */
    if (have_key == 1 && proof_sign(&key, &q.base, 1, proof_now_ms(), &pf, mac) == 0)
        q.proof = &pf;
    rc = rpc_call(ch, WIRE_BROKER_STATUS, &q.base, &cohort__v1__status_reply__descriptor,
                  (uint32_t)timeout_ms, 0, &reply, &st);
    if (rc < 0) {
        fprintf(stderr, "cohortctl status: %s: %s (%s)\n", broker, st.message, rpc_code_name(st.code));
        if (st.code == RPC_UNAUTHENTICATED)
            fprintf(stderr, "cohortctl status: give the cohort's key (--cohort NAME "
                    "--secret-file PATH) or the admin key (--admin-secret-file PATH)\n");
        goto out;
    }
    if (json)
        status = print_json((const Cohort__V1__StatusReply *)reply);
    else {
        print_tables((const Cohort__V1__StatusReply *)reply);
        status = 0;
    }
    protobuf_c_message_free_unpacked(reply, NULL);
out:
    rpc_channel_destroy(ch);
    rpc_shutdown();
    rpc_pem_free(ca);
    if (have_key == 1)
        secret_wipe(&key);
    return status;
}

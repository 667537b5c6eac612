/* sidecar/main.c: cohort-sidecar. Keeps its pod in the cohort: joins the
 * broker, heartbeats, follows the epochs, leaves on SIGTERM. */
#include <arpa/inet.h>
#include <errno.h>
#include <getopt.h>
#include <netdb.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "base/clock.h"
#include "base/ident.h"
#include "base/limits.h"
#include "base/log.h"
#include "membership/member.h"
#include "base/opt.h"
#include "base/secret.h"
#include "rpc/rpc.h"
#include "accumulator/node.h"
#include "accumulator/trainerd.h"
#include "averager/avlink.h"
#include "averager/avserve.h"

#define PROG "cohort-sidecar"

static const char usage[] =
    "Usage: " PROG " --broker ADDR --cohort NAME --id ID [options]\n"
    "\n"
    "Keeps this pod in its cohort: joins the broker, heartbeats, follows the\n"
    "membership epochs and the leader, and leaves on SIGTERM or SIGINT.\n"
    "\n"
    "  --broker ADDR             broker address, host:port (env COHORT_BROKER)\n"
    "  --cohort NAME             cohort to join (env COHORT_COHORT)\n"
    "  --id ID                   member id, unique in the cohort\n"
    "                            (env COHORT_ID, else POD_NAME)\n"
    "  --socket PATH             serve a trainer on this Unix socket (env\n"
    "                            COHORT_SOCKET, as PATH or unix:PATH); the member\n"
    "                            joins once the trainer registers its tensors and\n"
    "                            leaves when it goes away. The same socket hosts\n"
    "                            the trainer's hivemind averagers (cohort.hivemind,\n"
    "                            cohort_averager_*), up to 8, each a member of\n"
    "                            its own named ID_avN with this sidecar's key.\n"
    "                            Without it the sidecar only keeps a membership.\n"
    "  --data-listen ADDR        data-plane listen address (default 127.0.0.1:0,\n"
    "                            port 0 picks a free one)\n"
    "  --advertise HOST          host the other members reach this one at (the pod\n"
    "                            IP; default: the --data-listen host; required when\n"
    "                            that is 0.0.0.0)\n"
    "  --secret-file PATH        the cohort's key: 64 hex digits (env\n"
    "                            COHORT_SECRET_FILE). It proves this member to the\n"
    "                            broker and to its peers; without it the member can\n"
    "                            only join a broker that runs without keys.\n"
    "  --broker-ca PATH          reach the broker over TLS, trusting the CA\n"
    "                            certificates in this PEM file (env\n"
    "                            COHORT_BROKER_CA); without it, plaintext\n"
    "  --broker-server-name NAME the name the broker's certificate carries, when\n"
    "                            --broker is another (an IP address, a pod IP); env\n"
    "                            COHORT_BROKER_SERVER_NAME (default: --broker's host)\n"
    "  --integrity none|mac      none (default): with --secret-file, peers prove the\n"
    "                            key when they connect; mac: every data-plane frame\n"
    "                            carries a MAC too (needs --secret-file; every\n"
    "                            member must agree), the trainer's averagers'\n"
    "                            frames too\n"
    "  --model-version N         model version to join with (default 0)\n"
    "  --virtual-batch-size N    pin the trainer's virtual batch size to N (1 to\n"
    "                            2^63-1): rounds commit at N samples from the\n"
    "                            start, and a trainer that asks for another size\n"
    "                            gets an error (EACCES). Without it the trainer's\n"
    "                            own call decides (default 1). Needs --socket\n"
    "  --parallel-gradients N    pin the contributions in flight at once, 1 to 8,\n"
    "                            the same way. Needs --socket\n"
    "  --allreduce ALG           the data plane's all-reduce algorithm: auto\n"
    "                            (default: recursive doubling up to 256 KiB on\n"
    "                            the wire, the ring beyond), ring (always), or\n"
    "                            doubling (up to 64 MiB, the ring beyond). The\n"
    "                            first all-reduce of each logs its name. Needs\n"
    "                            --socket\n"
    "  --compression METHOD      how gradient steps travel between members: none\n"
    "                            (default), fp16, bf16 or int8 (8 bits and a\n"
    "                            scale per 256 values), topk:RATIO (each member\n"
    "                            sends that share of its largest entries, RATIO\n"
    "                            in (0, 1], six decimals at most; topk alone is\n"
    "                            topk:0.01) or powersgd:RANK (a rank-RANK\n"
    "                            product, RANK 1 to 1024; powersgd alone is\n"
    "                            powersgd:4); top-k and PowerSGD keep what was\n"
    "                            not sent for the next round. A default: the\n"
    "                            trainer's set_compression replaces it, and a\n"
    "                            round is compressed only when every member asks\n"
    "                            for the same method and parameter. Needs\n"
    "                            --socket\n"
    "  --gpu-reduce nccl|host    how a trainer's GPU gradients are reduced: nccl\n"
    "                            (default: with an NCCL communicator per epoch\n"
    "                            where every member can, host-staged otherwise)\n"
    "                            or host (always host-staged: device to host, the\n"
    "                            engine, host to device; for clusters without\n"
    "                            NCCL connectivity). Needs --socket\n"
    "  --checkpoint-dir DIR      keep checkpoints of the cohort's state in DIR\n"
    "                            (created if missing). On start the newest valid\n"
    "                            one ahead of --model-version is loaded (invalid\n"
    "                            ones are renamed NAME.skipped and reported); while\n"
    "                            this member leads it writes one every\n"
    "                            --checkpoint-every versions or\n"
    "                            --checkpoint-interval (one of them is required).\n"
    "                            Needs --socket\n"
    "  --checkpoint-every N      a checkpoint every N model versions (1 to 2^63-1)\n"
    "  --checkpoint-interval DUR a checkpoint at the first commit this long after\n"
    "                            the last (at least 1s)\n"
    "  --checkpoint-keep N       checkpoints kept, 1 to 1000 (default 3)\n"
    "  --heartbeat-interval DUR  ask for this heartbeat (default: the cohort's)\n"
    "  --member-timeout DUR      ask for this timeout (default: the cohort's). The\n"
    "                            broker clamps both to the cohort's limits, and\n"
    "                            the member logs what it granted\n"
    "  --log-format text|json    (default text)\n"
    "  --log-level LEVEL         debug, info, warn or error (default info)\n"
    "  -h, --help                show this text\n"
    "\n"
    "DUR is a number with a unit: 250ms, 1s, 1.5s, 2m.\n";

/* Binds the data-plane socket now, so the advertised port is really ours
 * for as long as this member lives. Returns the fd or -errno. */
static int bind_data(const char *listen_addr, char *host, size_t hostlen, int *port)
{
    struct addrinfo hints = { .ai_family = AF_INET, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE };
    struct addrinfo *ai = NULL;
    struct sockaddr_in sa;
    socklen_t salen = sizeof(sa);
    const char *colon = strrchr(listen_addr, ':');
    char h[256];
    int fd, one = 1, rc;

    if (!colon || (size_t)(colon - listen_addr) >= sizeof(h))
        return -EINVAL;
    memcpy(h, listen_addr, (size_t)(colon - listen_addr));
    h[colon - listen_addr] = '\0';
    if (getaddrinfo(h[0] ? h : NULL, colon + 1, &hints, &ai) != 0)
        return -EINVAL;
    fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        rc = -errno;
        goto out;
    }
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) < 0 || listen(fd, 128) < 0 ||
        getsockname(fd, (struct sockaddr *)&sa, &salen) < 0) {
        rc = -errno;
        close(fd);
        goto out;
    }
    snprintf(host, hostlen, "%s", h);
    *port = ntohs(sa.sin_port);
    rc = fd;
out:
    freeaddrinfo(ai);
    return rc;
}

/* The broker's CA (--broker-ca), for the life of the process: a global,
 * so that the early exits after it is read leave nothing unreachable. */
static char *ca;

enum { O_BROKER = 256, O_COHORT, O_ID, O_LISTEN, O_ADV, O_MV, O_HB, O_TO, O_LOGF, O_LOGL, O_SOCK, O_SECRET, O_INTEGRITY,
       O_CA, O_SNAME, O_VBS, O_PARALLEL, O_ALG, O_CKDIR, O_CKEVERY, O_CKINT, O_CKKEEP, O_COMP,
       O_GPURED };

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
    if (rpc_init() < 0) {
        log_error("sidecar", "gRPC could not start.");
        return -1;
    }
    return 0;
}

/* Serves a trainer until a signal: the node runs per trainer session. */
static const char *const algorithm_names[] = {
    [NODE_ALGORITHM_AUTO] = "auto", [NODE_ALGORITHM_RING] = "ring",
    [NODE_ALGORITHM_DOUBLING] = "doubling",
};

/* The settings a cohort pins on its trainers (--virtual-batch-size,
 * --parallel-gradients, --allreduce); 0 and auto: not pinned. And one it
 * only defaults (--compression), which the trainer may change. */
struct pinned {
    uint64_t vbs;
    unsigned parallel;
    enum node_algorithm algorithm;
    struct compress compression;
    bool gpu_host_staged;       /* --gpu-reduce host */
};

/* --checkpoint-*: dir NULL for none. */
struct checkpoints {
    const char *dir;
    uint64_t every;
    uint32_t interval_s;
    unsigned keep;
};

static int serve_trainer(const struct member_config *mc, bool integrity_mac, const char *socket_path,
                         const char *host, const struct pinned *pin,
                         const struct checkpoints *ck, const sigset_t *sigs)
{
    struct trainerd_config tc = {
        .socket_path = socket_path,
        .node = { .broker = mc->broker, .cohort = mc->cohort, .id = mc->id, .host = host,
                  .model_version = mc->model_version, .heartbeat_ms = mc->heartbeat_ms,
                  .timeout_ms = mc->timeout_ms, .key = mc->key,
                  .integrity_mac = integrity_mac, .tls_ca_pem = mc->tls_ca_pem,
                  .tls_server_name = mc->tls_server_name, .virtual_batch_size = pin->vbs,
                  .parallel_gradients = pin->parallel, .algorithm = pin->algorithm,
                  .compression = pin->compression,
                  .checkpoint_dir = ck->dir, .checkpoint_every_versions = ck->every,
                  .checkpoint_every_s = ck->interval_s, .checkpoint_keep = ck->keep },
        .gpu_host_staged = pin->gpu_host_staged,
    };
    struct avserve_config ac = { .broker = mc->broker, .cohort = mc->cohort, .id = mc->id,
                                 .host = host, .key = mc->key, .integrity_mac = integrity_mac,
                                 .tls_ca_pem = mc->tls_ca_pem,
                                 .tls_server_name = mc->tls_server_name };
    struct avserve *av;
    struct trainerd *t;
    char comp_text[COMPRESS_TEXT_MAX];
    int rc, sig;

    rc = avserve_create(&ac, &av);
    if (rc < 0) {
        log_error("sidecar", "The trainer's averagers cannot be hosted (is --id too long?).",
                  LF_ERR(rc));
        return 1;
    }
    tc.adopt = avserve_adopt;
    tc.adopt_arg = av;
    tc.adopt_first = AVL_FIRST;
    tc.adopt_last = AVL_ATTACH;
    rc = trainerd_start(&tc, &t);
    if (rc < 0) {
        log_error("sidecar", "The trainer socket could not be served.", LF_S("socket", socket_path),
                  LF_ERR(rc));
        avserve_destroy(av);
        return 1;
    }
    log_info("sidecar", "Waiting for the trainer.", LF_S("socket", socket_path),
             LF_S("broker", mc->broker), LF_S("cohort", mc->cohort), LF_S("id", mc->id),
             LF_S("host", host), LF_U("virtual_batch_size", pin->vbs),
             LF_U("parallel_gradients", pin->parallel),
             LF_S("allreduce", algorithm_names[pin->algorithm]),
             LF_S("compression", compress_format(&pin->compression, comp_text, sizeof(comp_text))),
             LF_S("checkpoint_dir", ck->dir ? ck->dir : ""), LF_U("checkpoint_every", ck->every),
             LF_U("checkpoint_interval_s", ck->interval_s));
    while (sigwait(sigs, &sig) != 0)
        ;
    log_info("sidecar", "Stopping; leaving the cohort.", LF_S("signal", strsignal(sig)));
    trainerd_stop(t);
    /* The averagers leave once their calls in flight return. */
    avserve_destroy(av);
    return 0;
}

int main(int argc, char **argv)
{
    static const struct option longopts[] = {
        { "broker", required_argument, NULL, O_BROKER },
        { "cohort", required_argument, NULL, O_COHORT },
        { "id", required_argument, NULL, O_ID },
        { "data-listen", required_argument, NULL, O_LISTEN },
        { "socket", required_argument, NULL, O_SOCK },
        { "advertise", required_argument, NULL, O_ADV },
        { "model-version", required_argument, NULL, O_MV },
        { "heartbeat-interval", required_argument, NULL, O_HB },
        { "member-timeout", required_argument, NULL, O_TO },
        { "secret-file", required_argument, NULL, O_SECRET },
        { "integrity", required_argument, NULL, O_INTEGRITY },
        { "broker-ca", required_argument, NULL, O_CA },
        { "broker-server-name", required_argument, NULL, O_SNAME },
        { "virtual-batch-size", required_argument, NULL, O_VBS },
        { "parallel-gradients", required_argument, NULL, O_PARALLEL },
        { "allreduce", required_argument, NULL, O_ALG },
        { "compression", required_argument, NULL, O_COMP },
        { "gpu-reduce", required_argument, NULL, O_GPURED },
        { "checkpoint-dir", required_argument, NULL, O_CKDIR },
        { "checkpoint-every", required_argument, NULL, O_CKEVERY },
        { "checkpoint-interval", required_argument, NULL, O_CKINT },
        { "checkpoint-keep", required_argument, NULL, O_CKKEEP },
        { "log-format", required_argument, NULL, O_LOGF },
        { "log-level", required_argument, NULL, O_LOGL },
        { "help", no_argument, NULL, 'h' },
        { NULL, 0, NULL, 0 },
    };
    struct member_config mc = { 0 };
    const char *listen_addr = "127.0.0.1:0", *advertise = NULL, *logf = NULL, *logl = NULL;
    const char *socket_path = getenv("COHORT_SOCKET");
    const char *secret_file = getenv("COHORT_SECRET_FILE");
    const char *ca_file = getenv("COHORT_BROKER_CA");
    struct secret key;
    struct pinned pin = { 0 };
    struct checkpoints ck = { 0 };
    bool ck_set = false;
    bool pinned = false;
    bool integrity_mac = false;
    char host[256], address[IDENT_ADDRESS_MAX + 1];
    struct member *m = NULL;
    uint64_t v;
    sigset_t sigs;
    int opt, rc, fd, port = 0, sig = 0;

    mc.broker = getenv("COHORT_BROKER");
    mc.cohort = getenv("COHORT_COHORT");
    mc.id = getenv("COHORT_ID") ? getenv("COHORT_ID") : getenv("POD_NAME");
    mc.tls_server_name = getenv("COHORT_BROKER_SERVER_NAME");
    while ((opt = opt_next(PROG, argc, argv, "h", longopts)) != -1) {
        switch (opt) {
        case O_BROKER: mc.broker = optarg; break;
        case O_COHORT: mc.cohort = optarg; break;
        case O_ID: mc.id = optarg; break;
        case O_LISTEN: listen_addr = optarg; break;
        case O_SOCK: socket_path = optarg; break;
        case O_ADV: advertise = optarg; break;
        case O_MV:
            if (opt_uint(optarg, 0, UINT64_MAX, &mc.model_version) < 0)
                return opt_usage(PROG, "bad --model-version \"%s\"", optarg);
            break;
        case O_HB:
            if (opt_duration_ms(optarg, LIMIT_MEMBERSHIP_FLAG_MS, &v) < 0 || v == 0)
                return opt_usage(PROG, "bad --heartbeat-interval \"%s\"", optarg);
            mc.heartbeat_ms = (uint32_t)v;
            break;
        case O_TO:
            if (opt_duration_ms(optarg, LIMIT_MEMBERSHIP_FLAG_MS, &v) < 0 || v == 0)
                return opt_usage(PROG, "bad --member-timeout \"%s\"", optarg);
            mc.timeout_ms = (uint32_t)v;
            break;
        case O_VBS:
            if (opt_uint(optarg, 1, INT64_MAX, &pin.vbs) < 0)
                return opt_usage(PROG, "bad --virtual-batch-size \"%s\" (1 to 2^63-1)", optarg);
            pinned = true;
            break;
        case O_PARALLEL:
            if (opt_uint(optarg, 1, NODE_PARALLEL_MAX, &v) < 0)
                return opt_usage(PROG, "bad --parallel-gradients \"%s\" (1 to %d)", optarg,
                                 NODE_PARALLEL_MAX);
            pin.parallel = (unsigned)v;
            pinned = true;
            break;
        case O_COMP:
            if (compress_parse(optarg, &pin.compression) < 0)
                return opt_usage(PROG, "bad --compression \"%s\": none, fp16, bf16, int8, "
                                       "topk:RATIO (0 < RATIO <= 1, six decimals at most) or "
                                       "powersgd:RANK (1 to 1024)", optarg);
            pinned = pinned || pin.compression.method != COMPRESS_NONE;
            break;
        case O_ALG:
            if (strcmp(optarg, "auto") == 0)
                pin.algorithm = NODE_ALGORITHM_AUTO;
            else if (strcmp(optarg, "ring") == 0)
                pin.algorithm = NODE_ALGORITHM_RING;
            else if (strcmp(optarg, "doubling") == 0)
                pin.algorithm = NODE_ALGORITHM_DOUBLING;
            else
                return opt_usage(PROG, "bad --allreduce \"%s\": auto, ring or doubling", optarg);
            pinned = pinned || pin.algorithm != NODE_ALGORITHM_AUTO;
            break;
        case O_CKDIR:
            if (!*optarg)
                return opt_usage(PROG, "bad --checkpoint-dir: empty");
            ck.dir = optarg;
            break;
        case O_CKEVERY:
            if (opt_uint(optarg, 1, INT64_MAX, &ck.every) < 0)
                return opt_usage(PROG, "bad --checkpoint-every \"%s\" (1 to 2^63-1)", optarg);
            ck_set = true;
            break;
        case O_CKINT:
            if (opt_duration_ms(optarg, LIMIT_MEMBERSHIP_FLAG_MS, &v) < 0 || v < 1000)
                return opt_usage(PROG, "bad --checkpoint-interval \"%s\" (1s or more)", optarg);
            ck.interval_s = (uint32_t)(v / 1000);
            ck_set = true;
            break;
        case O_CKKEEP:
            if (opt_uint(optarg, 1, 1000, &v) < 0)
                return opt_usage(PROG, "bad --checkpoint-keep \"%s\" (1 to 1000)", optarg);
            ck.keep = (unsigned)v;
            ck_set = true;
            break;
        case O_SECRET: secret_file = optarg; break;
        case O_CA: ca_file = optarg; break;
        case O_SNAME: mc.tls_server_name = optarg; break;
        case O_GPURED:
            if (strcmp(optarg, "nccl") != 0 && strcmp(optarg, "host") != 0)
                return opt_usage(PROG, "bad --gpu-reduce \"%s\": nccl or host", optarg);
            pin.gpu_host_staged = strcmp(optarg, "host") == 0;
            pinned = pinned || pin.gpu_host_staged;
            break;
        case O_INTEGRITY:
            if (strcmp(optarg, "mac") != 0 && strcmp(optarg, "none") != 0)
                return opt_usage(PROG, "bad --integrity \"%s\": none or mac", optarg);
            integrity_mac = strcmp(optarg, "mac") == 0;
            break;
        case O_LOGF: logf = optarg; break;
        case O_LOGL: logl = optarg; break;
        case 'h':
            fputs(usage, stdout);
            return 0;
        default:
            return OPT_EXIT_USAGE;
        }
    }
    if (opt_no_operands(PROG, argc, argv, optind))
        return OPT_EXIT_USAGE;
    if (opt_logging(PROG, logf, logl) < 0)
        return OPT_EXIT_USAGE;
    if (!mc.broker || !*mc.broker)
        return opt_usage(PROG, "--broker is required");
    if (!ident_valid_address(mc.broker) && strncmp(mc.broker, "unix:", 5) != 0 &&
        strncmp(mc.broker, "dns:", 4) != 0 && strncmp(mc.broker, "ipv4:", 5) != 0)
        return opt_usage(PROG, "bad --broker \"%s\": want host:port", mc.broker);
    if (!mc.cohort || !ident_valid_cohort(mc.cohort))
        return mc.cohort ? opt_usage(PROG, "bad --cohort: letters, digits, '.', '_', '-'")
                         : opt_usage(PROG, "--cohort is required");
    if (!mc.id || !ident_valid_member_id(mc.id))
        return mc.id ? opt_usage(PROG, "bad --id: letters, digits, '.', '_', '-'")
                     : opt_usage(PROG, "--id is required");
    if (ck_set && !ck.dir)
        return opt_usage(PROG, "--checkpoint-every, --checkpoint-interval and --checkpoint-keep "
                         "need --checkpoint-dir");
    if (ck.dir && !ck.every && !ck.interval_s)
        return opt_usage(PROG, "--checkpoint-dir needs --checkpoint-every or "
                         "--checkpoint-interval");
    if (mc.heartbeat_ms && mc.timeout_ms && mc.timeout_ms <= mc.heartbeat_ms)
        return opt_usage(PROG, "--member-timeout must be longer than --heartbeat-interval");

    if (secret_file && *secret_file) {
        rc = secret_load(secret_file, &key);
        if (rc < 0)
            return opt_usage(PROG, "cannot use --secret-file \"%s\": %s", secret_file,
                             rc == -EINVAL ? "not 64 hexadecimal digits" : strerror(-rc));
        mc.key = &key;
    } else if (integrity_mac) {
        return opt_usage(PROG, "--integrity mac needs --secret-file");
    }
    if (!mc.key)
        log_warn("sidecar", "No --secret-file: this member proves nothing and can join only a "
                 "broker that runs without keys.");
    if (mc.tls_server_name && !*mc.tls_server_name)
        mc.tls_server_name = NULL;
    /* A DNS name keeps to a member id's characters. */
    if (mc.tls_server_name && !ident_valid_member_id(mc.tls_server_name))
        return opt_usage(PROG, "bad --broker-server-name \"%s\": want a DNS name",
                         mc.tls_server_name);
    if (ca_file && *ca_file) {
        rc = rpc_pem_load(ca_file, &ca);
        if (rc < 0)
            return opt_usage(PROG, "cannot use --broker-ca \"%s\": %s", ca_file,
                             rc == -EINVAL ? "no PEM block in it"
                             : rc == -EFBIG ? "longer than 256 KiB" : strerror(-rc));
        mc.tls_ca_pem = ca;
    } else if (mc.tls_server_name) {
        return opt_usage(PROG, "--broker-server-name needs --broker-ca");
    }

    if (socket_path && strncmp(socket_path, "unix:", 5) == 0)
        socket_path += 5;
    if (socket_path && *socket_path) {
        /* The node binds the data plane itself, on the advertised host. */
        const char *colon = strrchr(listen_addr, ':');
        snprintf(host, sizeof(host), "%.*s", colon ? (int)(colon - listen_addr) : 0, listen_addr);
        if (advertise)
            snprintf(host, sizeof(host), "%s", advertise);
        if (!host[0] || strcmp(host, "0.0.0.0") == 0)
            return opt_usage(PROG, "--advertise is required when --data-listen is on all "
                             "interfaces");
        if (start_process(&sigs) < 0)
            return 1;
        rc = serve_trainer(&mc, integrity_mac, socket_path, host, &pin, &ck, &sigs);
        rpc_shutdown();
        rpc_pem_free(ca);
        return rc;
    }
    /* Without a trainer there is no accumulator and no data plane. */
    if (pinned || ck.dir)
        return opt_usage(PROG, "--virtual-batch-size, --parallel-gradients, --allreduce, "
                         "--compression and --checkpoint-dir need --socket");
    fd = bind_data(listen_addr, host, sizeof(host), &port);
    if (fd < 0)
        return opt_usage(PROG, "cannot listen on --data-listen \"%s\"", listen_addr);
    if (advertise) {
        snprintf(host, sizeof(host), "%s", advertise);
    } else if (strcmp(host, "0.0.0.0") == 0 || host[0] == '\0') {
        close(fd);
        return opt_usage(PROG, "--advertise is required when --data-listen is on all interfaces");
    }
    snprintf(address, sizeof(address), "%s:%d", host, port);
    if (!ident_valid_address(address)) {
        close(fd);
        return opt_usage(PROG, "bad advertised address \"%s\"", address);
    }
    mc.address = address;

    if (start_process(&sigs) < 0) {
        close(fd);
        return 1;
    }
    rc = member_create(&mc, &m);
    if (rc < 0) {
        log_error("sidecar", "The member could not be created.", LF_ERR(rc));
        rpc_shutdown();
        close(fd);
        return 1;
    }
    log_info("sidecar", "Starting.", LF_S("broker", mc.broker), LF_S("cohort", mc.cohort),
             LF_S("id", mc.id), LF_S("address", address), LF_U("model_version", mc.model_version),
             LF_B("key", mc.key != NULL), LF_B("tls", mc.tls_ca_pem != NULL));
    for (;;) {
        uint32_t wait = member_poll(m, clock_now_ms());
        struct timespec ts = { .tv_sec = wait / 1000, .tv_nsec = (long)(wait % 1000) * 1000000L };
        sig = sigtimedwait(&sigs, NULL, &ts);
        if (sig > 0)
            break;
    }
    log_info("sidecar", "Stopping; leaving the cohort.", LF_S("signal", strsignal(sig)));
    member_leave(m, LIMIT_LEAVE_TIMEOUT_MS);
    member_destroy(m);
    rpc_shutdown();
    rpc_pem_free(ca);
    close(fd);
    return 0;
}

/* bench/broker_reports.c: the broker's CPU for one heartbeat that reports
 * unreachable peers, against the same heartbeat with none, in one run: an
 * epoch of --members (default 10,000) members of a broker state machine
 * (src/membership/broker.c), and heartbeats of 0, 16 (what a broker before
 * unreachable_max takes) and 1,024 (WIRE_UNREACHABLE_MAX) reports each
 * taken the way brokerd.c takes one: unpacked from its wire bytes, its
 * ids checked, its proof checked under a key, then the heartbeat and each
 * report applied. Thread CPU time, medians of --reps runs of --beats
 * heartbeats each, every heartbeat from another reporter (so that each
 * report sets a bit, as a partition's do) about peers spread over the
 * epoch. Not measured: gRPC's receive of the bytes and the broker's lock.
 *
 *   cc -O2 -Isrc -Iinclude -Ibuild/gen bench/broker_reports.c build/lib/libcohort-core.a \
 *      -lgrpc -lgpr -lprotobuf-c -lcrypto -lpthread -lm
 *   ./a.out [--members N] [--beats K] [--reps R]
 *
 * One JSON object per line: reports, members, us_per_heartbeat,
 * us_per_report, us_locked_per_heartbeat (the part brokerd.c does under
 * its lock: the heartbeat and the reports applied), and x_plain (this
 * heartbeat's CPU over a plain one's);
 * then, for reference, the two scans of the epoch's ids per report that
 * the broker's lookups were before epochs were bisected (scan_us_per_report),
 * against this build's whole per-report cost. */
#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/ident.h"
#include "base/secret.h"
#include "cohort.pb-c.h"
#include "membership/broker.h"
#include "membership/proof.h"
#include "membership/wire.h"

#define MAX_REPS 99

static double cpu_us(void)
{
    struct timespec t;

    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (double)t.tv_sec * 1e6 + (double)t.tv_nsec / 1e3;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;

    return x < y ? -1 : x > y;
}

static unsigned long arg_ul(int argc, char **argv, const char *name, unsigned long def)
{
    for (int i = 1; i + 1 < argc; i++) {
        if (strcmp(argv[i], name) == 0) {
            char *end;
            unsigned long v = strtoul(argv[i + 1], &end, 10);

            if (*end || v == 0) {
                fprintf(stderr, "%s wants a positive number\n", name);
                exit(2);
            }
            return v;
        }
    }
    return def;
}

/* What brokerd.c does with one heartbeat up a Session stream, less gRPC
 * and the lock: returns the reports counted, or -1 if any step refused. */
static long take(struct broker *b, const struct secret *key, const uint8_t *wire, size_t len,
                 uint64_t now, double *locked)
{
    Cohort__V1__HeartbeatRequest *q =
        cohort__v1__heartbeat_request__unpack(NULL, len, wire);
    struct broker_beat beat = { .model_version = 1 };
    struct broker_beat_result res;
    long counted = 0;
    double t;

    if (!q)
        return -1;
    if (q->n_unreachable_peers > WIRE_UNREACHABLE_MAX || !ident_valid_member_id(q->id))
        counted = -1;
    for (size_t i = 0; counted >= 0 && i < q->n_unreachable_peers; i++)
        if (!ident_valid_member_id(q->unreachable_peers[i]))
            counted = -1;
    if (counted >= 0 && !proof_valid(key, &q->base, q->proof))
        counted = -1;
    /* What brokerd.c does under its lock. */
    t = cpu_us();
    if (counted >= 0 && broker_heartbeat(b, now, q->cohort, q->id, q->session, &beat, &res) < 0)
        counted = -1;
    for (size_t i = 0; counted >= 0 && i < q->n_unreachable_peers; i++)
        counted += broker_report_unreachable(b, now, q->cohort, q->id, q->session, q->epoch,
                                             q->unreachable_peers[i]) == 0;
    *locked += cpu_us() - t;
    cohort__v1__heartbeat_request__free_unpacked(q, NULL);
    return counted;
}

int main(int argc, char **argv)
{
    size_t members = arg_ul(argc, argv, "--members", 10000);
    size_t beats = arg_ul(argc, argv, "--beats", 200);
    size_t reps = arg_ul(argc, argv, "--reps", 9);
    const size_t sizes[] = { 0, WIRE_LOST_PEERS_MAX, WIRE_UNREACHABLE_MAX };
    struct broker_config cfg;
    struct broker *b;
    struct secret key;
    char (*ids)[32];
    char **peers;
    uint8_t *wire;
    uint64_t now = 1000, epoch, seq = 1;
    double plain = 0;

    if (reps > MAX_REPS || members < 2 * WIRE_UNREACHABLE_MAX || beats > members / 2) {
        fprintf(stderr, "want --reps <= %d, --members >= %u, --beats <= members / 2\n", MAX_REPS,
                2 * WIRE_UNREACHABLE_MAX);
        return 2;
    }
    ids = calloc(members, sizeof(*ids));
    peers = calloc(WIRE_UNREACHABLE_MAX, sizeof(*peers));
    wire = malloc(128 * 1024);
    if (!ids || !peers || !wire || secret_generate(&key) < 0)
        return 1;
    broker_config_default(&cfg);
    cfg.startup_hold_ms = 0;
    cfg.max_members = (uint32_t)members;
    if (broker_create(&cfg, NULL, now, &b) < 0 || broker_cohort_declare(b, "demo", 0, 0) < 0)
        return 1;
    for (size_t i = 0; i < members; i++) {
        struct broker_join j = { .cohort = "demo", .id = ids[i], .address = "10.0.0.1:7000",
                                 .model_version = 1, .session = 1 + i };
        struct broker_join_result res;

        /* A pod name's shape: a StatefulSet's or a Job's. */
        snprintf(ids[i], sizeof(ids[i]), "train-worker-%zu", i);
        if (broker_join(b, now, &j, &res) < 0)
            return 1;
    }
    /* The epoch forms once the joins' coalescing is over, well inside
     * every member's timeout; the clock stays there, so no one expires. */
    now += 1000;
    broker_tick(b, now);
    {
        struct broker_status *st;

        if (broker_status(b, "demo", &st) < 0 || st->n_cohorts != 1)
            return 1;
        epoch = st->cohorts[0].epoch;
        broker_status_free(st);
    }
    for (size_t s = 0; s < sizeof(sizes) / sizeof(sizes[0]); s++) {
        size_t k = sizes[s];
        double runs[MAX_REPS], lruns[MAX_REPS];

        for (size_t r = 0; r < reps; r++) {
            double total = 0, locked = 0;

            for (size_t h = 0; h < beats; h++) {
                /* Reporter `who` of the first half; its peers are the
                 * second half's, spread over it. */
                size_t who = (r * beats + h) % (members / 2);
                Cohort__V1__HeartbeatRequest q = COHORT__V1__HEARTBEAT_REQUEST__INIT;
                Cohort__V1__Proof pf;
                uint8_t mac[SECRET_MAC_BYTES];
                size_t len;
                double t;
                long got;

                for (size_t i = 0; i < k; i++)
                    peers[i] = ids[members / 2 + (i * 7 + h) % (members / 2)];
                q.protocol_version = WIRE_PROTOCOL_VERSION;
                q.cohort = "demo";
                q.id = ids[who];
                q.session = 1 + who;
                q.model_version = 1;
                q.epoch = epoch;
                q.unreachable_peers = peers;
                q.n_unreachable_peers = k;
                if (proof_sign(&key, &q.base, seq++, proof_now_ms(), &pf, mac) < 0)
                    return 1;
                q.proof = &pf;
                len = cohort__v1__heartbeat_request__pack(&q, wire);
                t = cpu_us();
                got = take(b, &key, wire, len, now, &locked);
                total += cpu_us() - t;
                if (got < 0) {
                    fprintf(stderr, "a heartbeat of %zu reports was refused\n", k);
                    return 1;
                }
            }
            runs[r] = total / (double)beats;
            lruns[r] = locked / (double)beats;
        }
        qsort(runs, reps, sizeof(runs[0]), cmp_double);
        qsort(lruns, reps, sizeof(lruns[0]), cmp_double);
        if (k == 0)
            plain = runs[reps / 2];
        printf("{\"reports\": %zu, \"members\": %zu, \"us_per_heartbeat\": %.1f, "
               "\"us_per_report\": %.3f, \"us_locked_per_heartbeat\": %.1f, "
               "\"x_plain\": %.1f}\n",
               k, members, runs[reps / 2], k ? (runs[reps / 2] - plain) / (double)k : 0.0,
               lruns[reps / 2], runs[reps / 2] / plain);
    }
    {
        /* The reference: a report's two parties found by scanning the
         * epoch's ids, as epoch_find did for every epoch. */
        double runs[MAX_REPS];
        volatile size_t sink = 0;

        for (size_t r = 0; r < reps; r++) {
            double t = cpu_us();

            for (size_t i = 0; i < WIRE_UNREACHABLE_MAX; i++) {
                const char *who = ids[(r * 31 + i) % (members / 2)];
                const char *peer = ids[members / 2 + (i * 7) % (members / 2)];

                for (size_t k = 0; k < members; k++)
                    if (strcmp(ids[k], who) == 0)
                        sink += k;
                for (size_t k = 0; k < members; k++)
                    if (strcmp(ids[k], peer) == 0)
                        sink += k;
            }
            runs[r] = (cpu_us() - t) / WIRE_UNREACHABLE_MAX;
        }
        qsort(runs, reps, sizeof(runs[0]), cmp_double);
        printf("{\"reports\": %u, \"members\": %zu, \"scan_us_per_report\": %.3f}\n",
               WIRE_UNREACHABLE_MAX, members, runs[reps / 2]);
        (void)sink;
    }
    broker_destroy(b);
    secret_wipe(&key);
    free(wire);
    free(peers);
    free(ids);
    return 0;
}

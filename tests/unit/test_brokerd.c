/* tests/unit/test_brokerd.c: the broker service over real gRPC on
 * loopback, driven by raw requests (to reach every refusal) and by
 * libcohort members in this process. */
#include <criterion/criterion.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "membership/brokerd.h"
#include "base/clock.h"
#include "cohort.pb-c.h"
#include "membership/member.h"
#include "rpc/rpc.h"
#include "membership/wire.h"

static struct brokerd *d;
static struct rpc_channel *ch;
static char addr[64];

static void start(void)
{
    struct brokerd_config cfg = { .listen = "127.0.0.1:0" };

    cr_assert_eq(rpc_init(), 0);
    broker_config_default(&cfg.broker);
    cfg.broker.startup_hold_ms = 0;
    cfg.broker.heartbeat_ms = 200;
    cfg.broker.timeout_ms = 1000;
    cfg.broker.max_members = 4;
    cr_assert_eq(brokerd_start(&cfg, &d), 0);
    cr_assert_eq(brokerd_declare(d, "demo", 0, 0), 0);
    cr_assert_eq(brokerd_declare(d, "other", 0, 0), 0);
    snprintf(addr, sizeof(addr), "127.0.0.1:%d", brokerd_port(d));
    cr_assert_eq(rpc_channel_create(addr, NULL, &ch), 0);
}

static void stop(void)
{
    rpc_channel_destroy(ch);
    brokerd_stop(d);
    rpc_shutdown();
}

TestSuite(brokerd, .init = start, .fini = stop, .timeout = 120);

static int join(const char *cohort, const char *id, uint64_t session, uint32_t version,
                struct rpc_status *st)
{
    Cohort__V1__JoinRequest q = COHORT__V1__JOIN_REQUEST__INIT;
    ProtobufCMessage *out = NULL;
    int rc;

    q.protocol_version = version;
    q.cohort = (char *)cohort;
    q.id = (char *)id;
    q.address = "127.0.0.1:4000";
    q.session = session;
    rc = rpc_call(ch, WIRE_BROKER_JOIN, &q.base, &cohort__v1__join_reply__descriptor, 5000, 0, &out, st);
    if (out)
        protobuf_c_message_free_unpacked(out, NULL);
    return rc;
}

static size_t status_members(const char *cohort)
{
    Cohort__V1__StatusRequest q = COHORT__V1__STATUS_REQUEST__INIT;
    ProtobufCMessage *out = NULL;
    size_t n;

    q.protocol_version = WIRE_PROTOCOL_VERSION;
    q.cohort = (char *)cohort;
    cr_assert_eq(rpc_call(ch, WIRE_BROKER_STATUS, &q.base, &cohort__v1__status_reply__descriptor,
                          5000, 0, &out, NULL), 0);
    n = ((Cohort__V1__StatusReply *)out)->cohorts[0]->n_members;
    protobuf_c_message_free_unpacked(out, NULL);
    return n;
}

Test(brokerd, wrong_protocol_version_is_failed_precondition_and_changes_nothing)
{
    struct rpc_status st;

    cr_assert_eq(join("demo", "a", 7, WIRE_PROTOCOL_VERSION + 1, &st), -EPROTO);
    cr_assert_eq(st.code, RPC_FAILED_PRECONDITION);
    cr_assert(strstr(st.message, "protocol version 2 is not supported"), "%s", st.message);
    cr_assert_eq(status_members("demo"), 0);
}

Test(brokerd, unknown_cohort_is_not_found)
{
    struct rpc_status st;

    cr_assert_eq(join("nosuch", "a", 7, WIRE_PROTOCOL_VERSION, &st), -ENOENT);
    cr_assert_eq(st.code, RPC_NOT_FOUND);
    cr_assert(strstr(st.message, "unknown cohort \"nosuch\""), "%s", st.message);
}

Test(brokerd, duplicate_id_is_already_exists_and_rejoin_is_fine)
{
    struct rpc_status st;

    cr_assert_eq(join("demo", "a", 7, WIRE_PROTOCOL_VERSION, &st), 0);
    cr_assert_eq(join("demo", "a", 8, WIRE_PROTOCOL_VERSION, &st), -EEXIST);
    cr_assert_eq(st.code, RPC_ALREADY_EXISTS);
    cr_assert(strstr(st.message, "another session"), "%s", st.message);
    /* The same session again is a rejoin, not a duplicate. */
    cr_assert_eq(join("demo", "a", 7, WIRE_PROTOCOL_VERSION, &st), 0);
    cr_assert_eq(status_members("demo"), 1);
}

Test(brokerd, invalid_fields_are_invalid_argument)
{
    Cohort__V1__JoinRequest q = COHORT__V1__JOIN_REQUEST__INIT;
    ProtobufCMessage *out = NULL;
    struct rpc_status st;

    cr_assert_eq(join("demo", "bad id", 7, WIRE_PROTOCOL_VERSION, &st), -EINVAL);
    cr_assert(strstr(st.message, "invalid member id"), "%s", st.message);
    cr_assert_eq(join("demo", "a", 0, WIRE_PROTOCOL_VERSION, &st), -EINVAL);
    cr_assert(strstr(st.message, "session"), "%s", st.message);
    q.protocol_version = WIRE_PROTOCOL_VERSION;
    q.cohort = "demo";
    q.id = "a";
    q.address = "127.0.0.1:0";
    q.session = 3;
    cr_assert_eq(rpc_call(ch, WIRE_BROKER_JOIN, &q.base, &cohort__v1__join_reply__descriptor, 5000,
                          0, &out, &st), -EINVAL);
    cr_assert(strstr(st.message, "address"), "%s", st.message);
    cr_assert_eq(status_members("demo"), 0);
}

Test(brokerd, malformed_and_oversized_requests_are_refused_and_serving_goes_on)
{
    static char big[100 * 1024];
    Cohort__V1__Epoch wrong = COHORT__V1__EPOCH__INIT;
    struct rpc_status st;
    ProtobufCMessage *out = NULL;

    /* An Epoch's field 1 is a string; a JoinRequest's is a varint. */
    wrong.cohort = "not a join";
    cr_assert_eq(rpc_call(ch, WIRE_BROKER_JOIN, &wrong.base, &cohort__v1__join_reply__descriptor,
                          5000, 0, &out, &st), -EINVAL);
    cr_assert_eq(st.code, RPC_INVALID_ARGUMENT);
    memset(big, 'a', sizeof(big) - 1);
    cr_assert_eq(join("demo", big, 7, WIRE_PROTOCOL_VERSION, &st), -ENOSPC);
    cr_assert_eq(st.code, RPC_RESOURCE_EXHAUSTED);
    cr_assert_eq(join("demo", "a", 7, WIRE_PROTOCOL_VERSION, &st), 0);
}

Test(brokerd, full_cohort_is_resource_exhausted)
{
    struct rpc_status st;
    char id[16];

    for (int i = 0; i < 4; i++) {
        snprintf(id, sizeof(id), "m-%d", i);
        cr_assert_eq(join("demo", id, 10 + (uint64_t)i, WIRE_PROTOCOL_VERSION, &st), 0);
    }
    cr_assert_eq(join("demo", "m-4", 99, WIRE_PROTOCOL_VERSION, &st), -ENOSPC);
    cr_assert_eq(st.code, RPC_RESOURCE_EXHAUSTED);
    /* Another cohort is not full. */
    cr_assert_eq(join("other", "m-4", 99, WIRE_PROTOCOL_VERSION, &st), 0);
}

Test(brokerd, heartbeat_and_leave_of_strangers_are_not_found)
{
    Cohort__V1__HeartbeatRequest h = COHORT__V1__HEARTBEAT_REQUEST__INIT;
    Cohort__V1__LeaveRequest l = COHORT__V1__LEAVE_REQUEST__INIT;
    ProtobufCMessage *out = NULL;
    struct rpc_status st;

    h.protocol_version = WIRE_PROTOCOL_VERSION;
    h.cohort = "demo";
    h.id = "ghost";
    h.session = 5;
    cr_assert_eq(rpc_call(ch, WIRE_BROKER_HEARTBEAT, &h.base, &cohort__v1__heartbeat_reply__descriptor,
                          5000, 0, &out, &st), -ENOENT);
    l.protocol_version = WIRE_PROTOCOL_VERSION;
    l.cohort = "demo";
    l.id = "ghost";
    l.session = 5;
    cr_assert_eq(rpc_call(ch, WIRE_BROKER_LEAVE, &l.base, &cohort__v1__leave_reply__descriptor, 5000,
                          0, &out, &st), -ENOENT);
}

/* ---- libcohort members in this process ---- */

#define N 4

struct driven {
    struct member *m[N + 1];
    size_t n;
    atomic_bool stop;
    pthread_t t;
};

static void *drive(void *arg)
{
    struct driven *dv = arg;

    while (!atomic_load(&dv->stop)) {
        for (size_t i = 0; i < dv->n; i++)
            member_poll(dv->m[i], clock_now_ms());
        struct timespec ts = { 0, 5 * 1000000L };
        nanosleep(&ts, NULL);
    }
    return NULL;
}

static void add_member(struct driven *dv, const char *id, uint64_t version)
{
    struct member_config mc = { .broker = addr, .cohort = "demo", .id = id,
                                .address = "127.0.0.1:4000", .model_version = version,
                                .quiet = true };
    cr_assert_eq(member_create(&mc, &dv->m[dv->n]), 0);
    dv->n++;
}

/* True when every member's latest epoch has n members and leader `leader`. */
static bool all_agree(struct driven *dv, size_t n, const char *leader)
{
    for (size_t i = 0; i < dv->n; i++) {
        struct epoch *e = member_epoch(dv->m[i]);
        bool ok = e && e->n_members == n && strcmp(epoch_leader_id(e), leader) == 0;
        epoch_unref(e);
        if (!ok)
            return false;
    }
    return true;
}

static void wait_agree(struct driven *dv, size_t n, const char *leader)
{
    uint64_t end = clock_now_ms() + 30000;

    while (!all_agree(dv, n, leader) && clock_now_ms() < end) {
        struct timespec ts = { 0, 20 * 1000000L };
        nanosleep(&ts, NULL);
    }
    cr_assert(all_agree(dv, n, leader), "members did not agree on %zu members led by %s", n, leader);
}

Test(brokerd, declared_version_moves_leadership_everywhere)
{
    struct driven dv = { .n = 0 };
    char id[16];

    for (int i = 0; i < N; i++) {
        snprintf(id, sizeof(id), "m-%d", i);
        add_member(&dv, id, 3);
    }
    pthread_create(&dv.t, NULL, drive, &dv);
    wait_agree(&dv, N, "m-0");
    for (size_t i = 0; i < dv.n; i++)
        cr_assert(member_in_cohort(dv.m[i]));

    /* Committed rounds advance versions without moving the leader... */
    member_set_model_version(dv.m[2], 4, false);
    struct timespec ts = { 0, 600 * 1000000L };     /* three heartbeats: let it be seen */
    nanosleep(&ts, NULL);
    cr_assert(all_agree(&dv, N, "m-0"));
    /* ...a declared version does. */
    member_set_model_version(dv.m[3], 100, true);
    wait_agree(&dv, N, "m-3");
    atomic_store(&dv.stop, true);
    pthread_join(dv.t, NULL);
    for (size_t i = 0; i < dv.n; i++)
        member_destroy(dv.m[i]);
}

Test(brokerd, evicted_member_rejoins_and_removed_cohort_ends_watches)
{
    struct driven dv = { .n = 0 };
    uint64_t end;

    add_member(&dv, "m-0", 0);
    add_member(&dv, "m-1", 0);
    pthread_create(&dv.t, NULL, drive, &dv);
    wait_agree(&dv, 2, "m-0");
    cr_assert_eq(member_joins(dv.m[0]), 1);
    /* Remove the cohort under the members: their watches end, heartbeats
     * fail, and they retry until it is declared again. */
    cr_assert_eq(brokerd_remove(d, "demo"), 0);
    end = clock_now_ms() + 30000;
    while (member_in_cohort(dv.m[0]) && clock_now_ms() < end) {
        struct timespec ts = { 0, 20 * 1000000L };
        nanosleep(&ts, NULL);
    }
    cr_assert(!member_in_cohort(dv.m[0]));
    cr_assert_eq(brokerd_declare(d, "demo", 0, 0), 0);
    end = clock_now_ms() + 30000;
    while ((member_joins(dv.m[0]) < 2 || member_joins(dv.m[1]) < 2) && clock_now_ms() < end) {
        struct timespec ts = { 0, 20 * 1000000L };
        nanosleep(&ts, NULL);
    }
    cr_assert_geq(member_joins(dv.m[0]), 2);
    wait_agree(&dv, 2, "m-0");
    atomic_store(&dv.stop, true);
    pthread_join(dv.t, NULL);
    for (size_t i = 0; i < dv.n; i++)
        member_destroy(dv.m[i]);
}

/* Waits until brokerd_drained says `id` may go; 30 s deadline. */
static int wait_drained(const char *id)
{
    uint64_t end = clock_now_ms() + 30000;
    int rc;

    while ((rc = brokerd_drained(d, "demo", id)) == 0 && clock_now_ms() < end) {
        struct timespec ts = { 0, 20 * 1000000L };
        nanosleep(&ts, NULL);
    }
    return rc;
}

Test(brokerd, drained_member_stays_joined_out_of_the_epoch)
{
    struct driven dv = { .n = 0 };
    struct broker_status *st;

    add_member(&dv, "m-0", 5);
    add_member(&dv, "m-1", 0);
    add_member(&dv, "m-2", 0);
    pthread_create(&dv.t, NULL, drive, &dv);
    wait_agree(&dv, 3, "m-0");
    cr_assert_eq(brokerd_drained(d, "demo", "m-0"), 0, "not asked to drain");
    cr_assert_eq(brokerd_drain(d, "demo", "m-0", true), 0);
    cr_assert_eq(wait_drained("m-0"), 1);
    /* Everyone, the drained member too, runs in the epoch without it,
     * led by the next member; the drained one is still joined. */
    wait_agree(&dv, 2, "m-1");
    cr_assert_not(member_in_cohort(dv.m[0]));
    cr_assert(member_in_cohort(dv.m[1]));
    cr_assert_eq(brokerd_status(d, "demo", &st), 0);
    cr_assert_eq(st->cohorts[0].n_members, 3);
    cr_assert(st->cohorts[0].draining[0]);
    cr_assert_not(st->cohorts[0].draining[1]);
    broker_status_free(st);
    {
        uint64_t end = clock_now_ms() + 30000;
        while (!member_drained(dv.m[0]) && clock_now_ms() < end) {
            struct timespec ts = { 0, 20 * 1000000L };
            nanosleep(&ts, NULL);
        }
    }
    cr_assert(member_drained(dv.m[0]));
    cr_assert_not(member_drained(dv.m[1]));
    /* Undrained, it is back in; unknown names are refused. */
    cr_assert_eq(brokerd_drain(d, "demo", "m-0", false), 0);
    wait_agree(&dv, 3, "m-0");
    cr_assert_eq(brokerd_drain(d, "demo", "zz", true), -ENOENT);
    cr_assert_eq(brokerd_drain(d, "nope", "m-0", true), -ENOENT);
    cr_assert_eq(brokerd_drained(d, "nope", "m-0"), -ENOENT);
    atomic_store(&dv.stop, true);
    pthread_join(dv.t, NULL);
    for (size_t i = 0; i < dv.n; i++)
        member_destroy(dv.m[i]);
}

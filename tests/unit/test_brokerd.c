/* tests/unit/test_brokerd.c: the broker service over real gRPC on
 * loopback, driven by raw requests (to reach every refusal) and by
 * libcohort members in this process. */
#include <criterion/criterion.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "base/clock.h"
#include "cohort.pb-c.h"
#include "fixture.h"
#include "membership/brokerd.h"
#include "membership/member.h"
#include "membership/wire.h"
#include "rpc/rpc.h"

static struct brokerd *d;
static struct rpc_channel *ch;
static char addr[64];

/* The fixture's broker with a 1 s member timeout and room for four
 * members per cohort, cohorts "demo" and "other", and a channel to it. */
static void start(void)
{
    struct brokerd_config cfg;

    fixture_broker_config(&cfg);
    cfg.broker.timeout_ms = 1000;
    cfg.broker.max_members = 4;
    d = fixture_broker_start_with(&cfg, "demo", addr, sizeof(addr));
    cr_assert_eq(brokerd_declare(d, "other", 0, 0), 0);
    cr_assert_eq(rpc_channel_create(addr, NULL, &ch), 0);
}

static void stop(void)
{
    rpc_channel_destroy(ch);
    fixture_broker_stop(d);
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

/* Members of "demo" polled by a thread of their own, as a node polls its
 * member. */
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
        clock_sleep_ms(5);
    }
    return NULL;
}

/* Creates members ids[0 .. n) of "demo", the first at model version
 * `first_version` and the others at `version`, and starts polling them.
 * driven_stop() stops the polling and destroys them. */
static void driven_start(struct driven *dv, size_t n, const char *const *ids,
                         uint64_t first_version, uint64_t version)
{
    for (size_t i = 0; i < n; i++) {
        struct member_config mc = { .broker = addr, .cohort = "demo", .id = ids[i],
                                    .address = "127.0.0.1:4000",
                                    .model_version = i ? version : first_version, .quiet = true };

        cr_assert_eq(member_create(&mc, &dv->m[i]), 0);
    }
    dv->n = n;
    cr_assert_eq(pthread_create(&dv->t, NULL, drive, dv), 0);
}

static void driven_stop(struct driven *dv)
{
    atomic_store(&dv->stop, true);
    pthread_join(dv->t, NULL);
    for (size_t i = 0; i < dv->n; i++)
        member_destroy(dv->m[i]);
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
    FIXTURE_WAIT_FOR(all_agree(dv, n, leader), "members did not agree on %zu members led by %s",
                     n, leader);
}

/* True when the broker holds model version `version` for member i of
 * "demo" (members are listed in id order). */
static bool broker_holds_version(size_t i, uint64_t version)
{
    struct broker_status *st;
    bool ok;

    cr_assert_eq(brokerd_status(d, "demo", &st), 0);
    ok = i < st->cohorts[0].n_members && st->cohorts[0].members[i].model_version == version;
    broker_status_free(st);
    return ok;
}

static const char *const m4[] = { "m-0", "m-1", "m-2", "m-3" };

Test(brokerd, declared_version_moves_leadership_everywhere)
{
    struct driven dv = { .n = 0 };

    driven_start(&dv, N, m4, 3, 3);
    wait_agree(&dv, N, "m-0");
    for (size_t i = 0; i < dv.n; i++)
        cr_assert(member_in_cohort(dv.m[i]));

    /* Committed rounds advance versions without moving the leader: once
     * the broker has m-2's new version, everyone still follows m-0... */
    member_set_model_version(dv.m[2], 4, false);
    FIXTURE_WAIT_FOR(broker_holds_version(2, 4), "the broker never heard of m-2's version 4");
    cr_assert(all_agree(&dv, N, "m-0"));
    /* ...a declared version does. */
    member_set_model_version(dv.m[3], 100, true);
    wait_agree(&dv, N, "m-3");
    driven_stop(&dv);
}

Test(brokerd, evicted_member_rejoins_and_removed_cohort_ends_watches)
{
    struct driven dv = { .n = 0 };

    driven_start(&dv, 2, m4, 0, 0);
    wait_agree(&dv, 2, "m-0");
    cr_assert_eq(member_joins(dv.m[0]), 1);
    /* Remove the cohort under the members: their watches end, heartbeats
     * fail, and they retry until it is declared again. */
    cr_assert_eq(brokerd_remove(d, "demo"), 0);
    FIXTURE_WAIT_FOR(!member_in_cohort(dv.m[0]), "m-0 never noticed its cohort was removed");
    cr_assert_eq(brokerd_declare(d, "demo", 0, 0), 0);
    FIXTURE_WAIT_FOR(member_joins(dv.m[0]) >= 2 && member_joins(dv.m[1]) >= 2,
                     "the members never joined the declared cohort again");
    wait_agree(&dv, 2, "m-0");
    driven_stop(&dv);
}

Test(brokerd, drained_member_stays_joined_out_of_the_epoch)
{
    struct driven dv = { .n = 0 };
    struct broker_status *st;

    driven_start(&dv, 3, m4, 5, 0);
    wait_agree(&dv, 3, "m-0");
    cr_assert_eq(brokerd_drained(d, "demo", "m-0"), 0, "not asked to drain");
    cr_assert_eq(brokerd_drain(d, "demo", "m-0", true), 0);
    FIXTURE_WAIT_FOR(brokerd_drained(d, "demo", "m-0") != 0, "m-0 never drained");
    cr_assert_eq(brokerd_drained(d, "demo", "m-0"), 1);
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
    FIXTURE_WAIT_FOR(member_drained(dv.m[0]), "m-0 was never told it is drained");
    cr_assert_not(member_drained(dv.m[1]));
    /* Undrained, it is back in; unknown names are refused. */
    cr_assert_eq(brokerd_drain(d, "demo", "m-0", false), 0);
    wait_agree(&dv, 3, "m-0");
    cr_assert_eq(brokerd_drain(d, "demo", "zz", true), -ENOENT);
    cr_assert_eq(brokerd_drain(d, "nope", "m-0", true), -ENOENT);
    cr_assert_eq(brokerd_drained(d, "nope", "m-0"), -ENOENT);
    driven_stop(&dv);
}

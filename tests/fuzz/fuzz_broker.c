/* tests/fuzz/fuzz_broker.c: the broker's request handling as a sequence of
 * operations on one broker (src/membership/broker.h) with an injected
 * clock. Requests come either as the protobuf a client sends
 * (proto/cohort.proto, unpacked with protobuf-c, then handed to the state
 * machine field by field as brokerd.c does) or in a compact form that
 * picks cohorts, ids, sessions and addresses from small tables, so that
 * the fuzzer reaches deep states (rejoins, evictions, drains, leader
 * changes) without having to spell names twice.
 *
 * Input: two bytes of configuration, then operations: one byte (low
 * nibble: what; high nibble: how far the clock moves first), then what
 * the operation reads (below).
 *
 * Invariants, after every operation and at every publication:
 * - a formed epoch's number is above every number published before for
 *   its cohort and above every last_epoch a joiner reported; no epoch
 *   forms before the startup hold is over;
 * - an epoch's members are exactly the cohort's members that are not
 *   draining, in strict natural order (no member twice), with valid ids
 *   and addresses; the leader is the first of the highest model version;
 * - every watcher the broker names is attached to a member of that
 *   cohort, every attached watcher of the cohort hears each new epoch, and
 *   a detached one is never named again;
 * - status lists cohorts and members in strict natural order, with valid
 *   ids, the latest published epoch and its leader, a timeout above the
 *   heartbeat, and no more members than the cap;
 * - a join that succeeded is there with its address; a leave that
 *   succeeded is gone; every call returns one of its documented codes. */
#include "fuzz.h"

#include <errno.h>

#include "base/ident.h"
#include "cohort.pb-c.h"
#include "membership/broker.h"
#include "membership/proof.h"
#include "membership/wire.h"

#define SLOTS 8
#define SEEN_MAX 64
#define NAME 256
#define OPS_MAX 64                  /* operations in one input */

static const char *const cohorts[] = { "c", "ns/c-2", "c-10", "c-02" };
static const char *const ids[] = { "w-0", "w-1", "w-2", "w-10", "w-02", "a", "w-1.x", "Z" };
static const char *const addresses[] = { "10.0.0.1:7000", "10.0.0.2:7000", "[::1]:9000",
                                         "host-1.svc:1" };
static const uint32_t durations[] = { 0, 1, 2, 50, 100, 1000, 5000, 600000, 600001,
                                      UINT32_MAX / 2, UINT32_MAX - 1, UINT32_MAX };
static const uint64_t steps[] = { 0, 1, 2, 10, 49, 50, 51, 100, 999, 1000, 1001, 2000, 5000,
                                  5001, 60000, 600002 };
static const uint64_t epochs[] = { 0, 1, 2, 3, 100, UINT64_MAX / 2 - 1, UINT64_MAX / 2,
                                   UINT64_MAX / 2 + 1, UINT64_MAX };

/* A watcher as the host sees it: attached to one member, or not. */
struct slot {
    bool attached;
    char cohort[NAME], id[NAME];
};

/* What has been published for a cohort since it was made. */
struct seen {
    char name[NAME];
    bool published;
    uint64_t last;                  /* the latest number */
    uint64_t reported;              /* the highest last_epoch a joiner reported */
    char leader[NAME];              /* of the latest, "" when it was empty */
};

static struct {
    struct broker *b;
    struct broker_config cfg;
    uint64_t now, hold_until;
    bool in_watch;                  /* publish() delivers the current epoch */
    struct slot slots[SLOTS];
    struct seen seen[SEEN_MAX];
    size_t n_seen;
    struct broker_status *snap;     /* as of the last check_status() */
    bool changed;                   /* since then: check again */
    struct {                        /* what the next check_status() must see */
        bool on, present;
        char cohort[NAME], id[NAME], address[NAME + 16];
    } expect;
} w;

#define LEN(a) (sizeof(a) / sizeof((a)[0]))

/* FUZZ_TRACE=1 in the environment: each operation and callback on stderr,
 * to read what a crashing input does. */
static bool trace;
#define TRACE(...) (trace ? (void)fprintf(stderr, __VA_ARGS__) : (void)0)

static struct seen *seen_of(const char *cohort, bool make)
{
    for (size_t i = 0; i < w.n_seen; i++)
        if (strcmp(w.seen[i].name, cohort) == 0)
            return &w.seen[i];
    if (!make || w.n_seen == SEEN_MAX || strlen(cohort) >= NAME)
        return NULL;
    memset(&w.seen[w.n_seen], 0, sizeof(w.seen[0]));
    snprintf(w.seen[w.n_seen].name, NAME, "%s", cohort);
    return &w.seen[w.n_seen++];
}

static void seen_forget(const char *cohort)
{
    struct seen *s = seen_of(cohort, false);

    if (s)
        *s = w.seen[--w.n_seen];
}

static struct slot *slot_of(void *watcher)
{
    struct slot *s = watcher;

    CHECK(s >= w.slots && s < w.slots + SLOTS);
    return s;
}

/* The first of the highest model version. */
static size_t leader_of(const struct epoch_member *m, size_t n)
{
    size_t best = 0;

    for (size_t i = 1; i < n; i++)
        if (m[i].model_version > m[best].model_version)
            best = i;
    return best;
}

static void publish(void *arg, struct epoch *e, void *const *watchers, size_t n)
{
    struct broker_status *st = NULL;
    const struct broker_cohort_status *cs;
    struct seen *s;
    size_t k = 0, attached = 0;

    (void)arg;
    TRACE("  publish %s #%llu to %zu watchers%s\n", e->cohort, (unsigned long long)e->number, n,
          w.in_watch ? " (watch)" : "");
    CHECK(e && e->number > 0);
    for (size_t i = 0; i < n; i++) {
        struct slot *sl = slot_of(watchers[i]);
        CHECK(sl->attached && strcmp(sl->cohort, e->cohort) == 0);
        for (size_t j = 0; j < i; j++)
            CHECK(watchers[j] != watchers[i]);
    }
    for (size_t i = 0; i < e->n_members; i++) {
        CHECK(ident_valid_member_id(e->members[i].id));
        CHECK(ident_valid_address(e->members[i].address));
        CHECK(i == 0 || ident_natural_cmp(e->members[i - 1].id, e->members[i].id) < 0);
    }
    CHECK(e->n_members ? e->leader == leader_of(e->members, e->n_members) : e->leader == 0);
    s = seen_of(e->cohort, true);
    CHECK(s);
    if (w.in_watch) {
        /* The current epoch, to a new watcher: the latest published. */
        CHECK(s->published && e->number == s->last);
        return;
    }
    CHECK(w.now >= w.hold_until);
    CHECK(!s->published || e->number > s->last);
    CHECK(e->number > s->reported);
    s->published = true;
    s->last = e->number;
    snprintf(s->leader, NAME, "%s", e->n_members ? e->members[e->leader].id : "");
    /* Every attached watcher of the cohort hears it. */
    for (size_t i = 0; i < SLOTS; i++)
        attached += w.slots[i].attached && strcmp(w.slots[i].cohort, e->cohort) == 0;
    CHECK(attached == n);
    /* Exactly the members that are not draining, as they are now. */
    CHECK(broker_status(w.b, e->cohort, &st) == 0);
    cs = &st->cohorts[0];
    for (size_t i = 0; i < cs->n_members; i++) {
        if (cs->draining[i])
            continue;
        CHECK(k < e->n_members);
        CHECK(strcmp(cs->members[i].id, e->members[k].id) == 0);
        CHECK(strcmp(cs->members[i].address, e->members[k].address) == 0);
        k++;
    }
    CHECK(k == e->n_members);
    broker_status_free(st);
}

static void detach(void *arg, void *watcher, int err)
{
    struct slot *s = slot_of(watcher);

    (void)arg;
    TRACE("  detach slot %d (%s %s): %d\n", (int)(s - w.slots), s->cohort, s->id, err);
    CHECK(err == -ETIMEDOUT || err == -ENOENT || err == -EEXIST || err == -ESHUTDOWN);
    CHECK(s->attached);
    s->attached = false;
}

/* Cohort `name` in a status, or NULL. */
static const struct broker_cohort_status *cohort_in(const struct broker_status *st,
                                                     const char *name)
{
    for (size_t i = 0; st && i < st->n_cohorts; i++)
        if (strcmp(st->cohorts[i].name, name) == 0)
            return &st->cohorts[i];
    return NULL;
}

/* Member `id` of a cohort's status, or NULL. */
static const struct epoch_member *member_in(const struct broker_cohort_status *cs, const char *id)
{
    for (size_t i = 0; cs && i < cs->n_members; i++)
        if (strcmp(cs->members[i].id, id) == 0)
            return &cs->members[i];
    return NULL;
}

static void check_status(void)
{
    struct broker_status *st = NULL;

    CHECK(broker_status(w.b, NULL, &st) == 0);
    CHECK(st->n_cohorts <= w.cfg.max_cohorts);
    for (size_t i = 0; i < st->n_cohorts; i++) {
        const struct broker_cohort_status *cs = &st->cohorts[i];
        struct seen *s = seen_of(cs->name, false);

        CHECK(ident_valid_cohort(cs->name));
        CHECK(i == 0 || ident_natural_cmp(st->cohorts[i - 1].name, cs->name) < 0);
        CHECK(cs->timeout_ms > cs->heartbeat_ms && cs->heartbeat_ms > 0);
        CHECK(cs->n_members <= w.cfg.max_members);
        CHECK(cs->epoch == (s && s->published ? s->last : 0));
        if (cs->leader)
            CHECK(s && strcmp(cs->leader, s->leader) == 0);
        else
            CHECK(!s || !s->published || s->leader[0] == '\0');
        for (size_t k = 0; k < cs->n_members; k++) {
            CHECK(ident_valid_member_id(cs->members[k].id));
            CHECK(ident_valid_address(cs->members[k].address));
            CHECK(k == 0 || ident_natural_cmp(cs->members[k - 1].id, cs->members[k].id) < 0);
        }
    }
    /* A watcher is attached only to a live member. */
    for (size_t i = 0; i < SLOTS; i++)
        if (w.slots[i].attached)
            CHECK(member_in(cohort_in(st, w.slots[i].cohort), w.slots[i].id));
    /* A join that succeeded is there with its address; a leave is gone. */
    if (w.expect.on) {
        const struct epoch_member *m = member_in(cohort_in(st, w.expect.cohort), w.expect.id);
        CHECK(w.expect.present ? m && strcmp(m->address, w.expect.address) == 0 : !m);
        w.expect.on = false;
    }
    broker_status_free(w.snap);
    w.snap = st;
}

/* ---- the operations ------------------------------------------------------ */

/* What the status after this operation must show of one member. */
static void expect(bool present, const char *cohort, const char *id, const char *address)
{
    w.expect.on = strlen(cohort) < NAME && strlen(id) < NAME &&
                  strlen(address) < sizeof(w.expect.address);
    w.expect.present = present;
    snprintf(w.expect.cohort, NAME, "%s", cohort);
    snprintf(w.expect.id, NAME, "%s", id);
    snprintf(w.expect.address, sizeof(w.expect.address), "%s", address);
}

static void join(const struct broker_join *j)
{
    struct broker_join_result res = { 0 };
    const struct broker_cohort_status *cs = j->cohort ? cohort_in(w.snap, j->cohort) : NULL;
    uint32_t cohort_timeout = cs ? cs->timeout_ms : w.cfg.timeout_ms;
    int rc;

    rc = broker_join(w.b, w.now, j, &res);
    TRACE("join %s %s session %llu at %s: %d\n", j->cohort, j->id,
          (unsigned long long)j->session, j->address, rc);
    CHECK(rc == 0 || rc == -EINVAL || rc == -ENOENT || rc == -EEXIST || rc == -ENOSPC);
    if (!ident_valid_cohort(j->cohort) || !ident_valid_member_id(j->id) ||
        !ident_valid_address(j->address) || j->session == 0)
        CHECK(rc == -EINVAL);
    if (rc < 0)
        return;
    w.changed = true;
    CHECK(res.timeout_ms > res.heartbeat_ms);
    CHECK(res.timeout_ms <= (cohort_timeout > BROKER_MEMBER_TIMEOUT_CAP_MS
                                 ? cohort_timeout : BROKER_MEMBER_TIMEOUT_CAP_MS));
    expect(true, j->cohort, j->id, j->address);
    {
        struct seen *s = seen_of(j->cohort, true);
        if (s && j->last_epoch > s->reported)
            s->reported = j->last_epoch;
        CHECK(res.epoch == (s && s->published ? s->last : 0));
    }
}

static void heartbeat(const char *cohort, const char *id, uint64_t session,
                      const struct broker_beat *beat)
{
    struct broker_beat_result res = { 0 };
    int rc = broker_heartbeat(w.b, w.now, cohort, id, session, beat, &res);

    TRACE("heartbeat %s %s session %llu: %d\n", cohort, id, (unsigned long long)session, rc);

    CHECK(rc == 0 || rc == -ENOENT);
    if (rc == 0) {
        struct seen *s = seen_of(cohort, false);
        CHECK(res.epoch == (s && s->published ? s->last : 0));
    }
}

static void leave(const char *cohort, const char *id, uint64_t session)
{
    int rc = broker_leave(w.b, w.now, cohort, id, session);

    TRACE("leave %s %s session %llu: %d\n", cohort, id, (unsigned long long)session, rc);

    CHECK(rc == 0 || rc == -ENOENT);
    if (rc == 0) {
        w.changed = true;
        expect(false, cohort, id, "");
    }
}

static void watch(const char *cohort, const char *id, uint64_t session, size_t k)
{
    struct slot *s = &w.slots[k % SLOTS], before;
    int rc;

    /* A host's watcher belongs to one member's stream. */
    if (s->attached && (strcmp(s->cohort, cohort) != 0 || strcmp(s->id, id) != 0))
        return;
    if (strlen(cohort) >= NAME || strlen(id) >= NAME)
        return;
    /* Attached before the call: the broker delivers the current epoch to
     * the new watcher from inside it. */
    before = *s;
    s->attached = true;
    snprintf(s->cohort, NAME, "%s", cohort);
    snprintf(s->id, NAME, "%s", id);
    w.in_watch = true;
    rc = broker_watch(w.b, cohort, id, session, s);
    w.in_watch = false;
    TRACE("watch %s %s session %llu slot %zu: %d\n", cohort, id, (unsigned long long)session,
          k % SLOTS, rc);
    CHECK(rc == 0 || rc == -ENOENT);
    if (rc < 0)
        *s = before;
    w.changed |= rc == 0;
}

static void unwatch(const char *cohort, const char *id, size_t k)
{
    struct slot *s = &w.slots[k % SLOTS];

    broker_unwatch(w.b, cohort, id, s);
    TRACE("unwatch %s %s slot %zu\n", cohort, id, k % SLOTS);
    if (s->attached && strcmp(s->cohort, cohort) == 0 && strcmp(s->id, id) == 0) {
        s->attached = false;
        w.changed = true;
    }
}

static void status(const char *cohort)
{
    struct broker_status *st = NULL;
    int rc = broker_status(w.b, cohort && *cohort ? cohort : NULL, &st);

    CHECK(rc == 0 || rc == -ENOENT);
    if (rc == 0 && cohort && *cohort)
        CHECK(st->n_cohorts == 1 && strcmp(st->cohorts[0].name, cohort) == 0);
    broker_status_free(st);
}

/* A protobuf request: u16 length, then the bytes. */
static ProtobufCMessage *unpack(struct fuzz_in *in, const ProtobufCMessageDescriptor *d)
{
    size_t len;
    const uint8_t *p = fuzz_bytes(in, fuzz_u16(in) % 1024, &len);

    return protobuf_c_message_unpack(d, NULL, len, p);
}

/* The proof a request carries, as brokerd.c reads it before anything
 * else: whatever the input put there does not verify under a key it never
 * saw; a proof made for the request does, and a MAC with one bit flipped
 * does not. */
static void check_proof(const ProtobufCMessage *m, const Cohort__V1__Proof *carried)
{
    static struct secret key;
    static bool have_key;
    Cohort__V1__Proof p;
    uint8_t mac[SECRET_MAC_BYTES];

    if (!have_key) {
        CHECK(secret_generate(&key) == 0);
        have_key = true;
    }
    CHECK(!proof_valid(&key, m, carried));
    CHECK(proof_sign(&key, m, 7, 1700000000000ull, &p, mac) == 0);
    CHECK(proof_valid(&key, m, &p));
    mac[mac[0] % SECRET_MAC_BYTES] ^= 0x10;
    CHECK(!proof_valid(&key, m, &p));
}

static void raw(struct fuzz_in *in, uint8_t what)
{
    ProtobufCMessage *m;

    switch (what) {
    case 11: {
        Cohort__V1__JoinRequest *q;
        m = unpack(in, &cohort__v1__join_request__descriptor);
        if (!m)
            return;
        q = (Cohort__V1__JoinRequest *)m;
        check_proof(m, q->proof);
        join(&(struct broker_join){
            .cohort = q->cohort, .id = q->id, .address = q->address,
            .model_version = q->model_version, .session = q->session,
            .last_epoch = q->last_epoch, .heartbeat_ms = q->heartbeat_ms,
            .timeout_ms = q->timeout_ms,
        });
        break;
    }
    case 12: {
        Cohort__V1__HeartbeatRequest *q;
        m = unpack(in, &cohort__v1__heartbeat_request__descriptor);
        if (!m)
            return;
        q = (Cohort__V1__HeartbeatRequest *)m;
        check_proof(m, q->proof);
        heartbeat(q->cohort, q->id, q->session,
                  &(struct broker_beat){ .model_version = q->model_version,
                                         .declare = q->declare_version, .adopted = q->epoch });
        break;
    }
    case 13: {
        Cohort__V1__LeaveRequest *q;
        m = unpack(in, &cohort__v1__leave_request__descriptor);
        if (!m)
            return;
        q = (Cohort__V1__LeaveRequest *)m;
        check_proof(m, q->proof);
        leave(q->cohort, q->id, q->session);
        break;
    }
    case 14: {
        Cohort__V1__WatchRequest *q;
        m = unpack(in, &cohort__v1__watch_request__descriptor);
        if (!m)
            return;
        q = (Cohort__V1__WatchRequest *)m;
        check_proof(m, q->proof);
        watch(q->cohort, q->id, q->session, (size_t)q->session);
        break;
    }
    default: {
        Cohort__V1__StatusRequest *q;
        m = unpack(in, &cohort__v1__status_request__descriptor);
        if (!m)
            return;
        q = (Cohort__V1__StatusRequest *)m;
        check_proof(m, q->proof);
        status(q->cohort);
        break;
    }
    }
    protobuf_c_message_free_unpacked(m, NULL);
}

static void compact(struct fuzz_in *in, uint8_t what)
{
    const char *cohort = cohorts[fuzz_u8(in) % LEN(cohorts)];
    uint8_t who = fuzz_u8(in);
    const char *id = ids[who % LEN(ids)];
    uint64_t session = 1 + (who >> 3) % 3;
    int rc;

    switch (what) {
    case 0: {
        uint8_t a = fuzz_u8(in), t = fuzz_u8(in);
        join(&(struct broker_join){
            .cohort = cohort, .id = id, .address = addresses[a % LEN(addresses)],
            .model_version = fuzz_u8(in), .session = (a >> 2) % 8 == 7 ? 0 : session,
            .last_epoch = epochs[(a >> 5) % LEN(epochs)],
            .heartbeat_ms = durations[t % LEN(durations)],
            .timeout_ms = durations[(t >> 4) % LEN(durations)],
        });
        break;
    }
    case 1: {
        uint8_t v = fuzz_u8(in), e = fuzz_u8(in);
        struct seen *s = seen_of(cohort, false);
        heartbeat(cohort, id, session,
                  &(struct broker_beat){ .model_version = v & 0x7f, .declare = v & 0x80,
                                         .adopted = e & 1 && s ? s->last
                                                               : epochs[e % LEN(epochs)] });
        break;
    }
    case 2: leave(cohort, id, session); break;
    case 3: watch(cohort, id, session, fuzz_u8(in)); break;
    case 4: unwatch(cohort, id, fuzz_u8(in)); break;
    case 5:
        rc = broker_drain(w.b, w.now, cohort, id, who & 0x80);
        CHECK(rc == 0 || rc == -ENOENT);
        w.changed |= rc == 0;
        break;
    case 6:
        rc = broker_drained(w.b, cohort, id);
        CHECK(rc == 0 || rc == 1 || rc == -ENOENT);
        break;
    case 7: {
        uint8_t t = fuzz_u8(in);
        rc = broker_cohort_declare(w.b, cohort, durations[t % LEN(durations)],
                                   durations[(t >> 4) % LEN(durations)]);
        CHECK(rc == 0 || rc == -EINVAL || rc == -ENOSPC);
        w.changed |= rc == 0;
        break;
    }
    case 8:
        rc = broker_cohort_remove(w.b, cohort);
        CHECK(rc == 0 || rc == -ENOENT);
        if (rc == 0)
            seen_forget(cohort);
        w.changed |= rc == 0;
        break;
    case 9: {
        uint32_t next = broker_tick(w.b, w.now);
        CHECK(next >= 1 && next <= 1000);
        w.changed = true;
        break;
    }
    default: status(who & 1 ? cohort : NULL); break;
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static const uint32_t caps[] = { 1, 2, 4, 16 };
    static const uint32_t holds[] = { 0, 0, 1, 50, 100, 2000, 5000, 60000 };
    static const uint32_t coalesce[] = { 0, 1, 50, 1000 };
    struct broker_watch_ops ops = { .publish = publish, .detach = detach };
    struct fuzz_in in = { data, size };
    uint8_t c0 = fuzz_u8(&in), c1 = fuzz_u8(&in);
    size_t n_ops = 0;
    static int traced = -1;

    if (traced < 0)
        traced = getenv("FUZZ_TRACE") != NULL;
    trace = traced;

    memset(&w, 0, sizeof(w));
    broker_config_default(&w.cfg);
    w.cfg.allow_any_cohort = c0 & 1;
    w.cfg.max_members = caps[(c0 >> 1) & 3];
    w.cfg.max_cohorts = caps[(c0 >> 3) & 3];
    w.cfg.startup_hold_ms = holds[c0 >> 5];
    w.cfg.coalesce_ms = coalesce[c1 & 3];
    if (c1 & 4) {
        w.cfg.heartbeat_ms = 100;
        w.cfg.timeout_ms = 300;
    }
    w.now = 1000;
    w.hold_until = w.now + w.cfg.startup_hold_ms;
    CHECK(broker_create(&w.cfg, &ops, w.now, &w.b) == 0);
    while (fuzz_left(&in) && n_ops++ < OPS_MAX) {
        uint8_t op = fuzz_u8(&in), what = op & 15;

        w.now += steps[op >> 4];
        TRACE("[%llu ms] op %u\n", (unsigned long long)w.now, what);
        if (what >= 11)
            raw(&in, what);
        else
            compact(&in, what);
        /* After anything that may have changed what status shows. */
        if (w.changed)
            check_status();
        w.changed = false;
    }
    broker_status_free(w.snap);
    broker_destroy(w.b);
    for (size_t i = 0; i < SLOTS; i++)
        CHECK(!w.slots[i].attached);
    return 0;
}

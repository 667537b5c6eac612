/* Datagram heartbeats (membership/wire.h, "datagram heartbeats"): the
 * frame (dgram.c), the broker's judgement of each datagram and its
 * acknowledgements (brokerd.c), and a member that sends them and goes
 * back to its stream when they do not arrive (member.c). The broker is a
 * real brokerd on loopback; the datagrams are sent from a UDP socket of
 * the test's, or by a real member. */
#include <criterion/criterion.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "base/secret.h"
#include "cohort.pb-c.h"
#include "fixture.h"
#include "membership/brokerd.h"
#include "membership/dgram.h"
#include "membership/epoch.h"
#include "membership/heartbeat.h"
#include "membership/member.h"
#include "membership/proof.h"
#include "membership/wire.h"
#include "rpc/rpc.h"

/* ---- the frame ---- */

static void datagram(Cohort__V1__HeartbeatDatagram *q, const char *id, uint64_t session,
                     uint64_t ckpt)
{
    *q = (Cohort__V1__HeartbeatDatagram)COHORT__V1__HEARTBEAT_DATAGRAM__INIT;
    q->protocol_version = WIRE_PROTOCOL_VERSION;
    q->cohort = "demo";
    q->id = (char *)id;
    q->session = session;
    q->checkpoint_version = ckpt;
}

Test(dgram, a_heartbeat_and_an_acknowledgement_travel_whole)
{
    Cohort__V1__HeartbeatDatagram q, *got = NULL;
    Cohort__V1__HeartbeatDatagramAck a = COHORT__V1__HEARTBEAT_DATAGRAM_ACK__INIT, *ga = NULL;
    uint8_t buf[WIRE_DATAGRAM_MAX], mac[SECRET_MAC_BYTES], amac[SECRET_MAC_BYTES];
    Cohort__V1__Proof pf;
    struct secret k;
    ssize_t n;

    cr_assert_eq(secret_generate(&k), 0);
    datagram(&q, "m-1", 7, 12);
    cr_assert_eq(proof_sign(&k, &q.base, 5, proof_now_ms(), &pf, mac), 0);
    q.proof = &pf;
    n = dgram_pack(&q, buf);
    cr_assert_gt(n, 0);
    cr_assert_eq(dgram_unpack(buf, (size_t)n, &got), 0);
    cr_assert_str_eq(got->id, "m-1");
    cr_assert_eq(got->checkpoint_version, 12);
    cr_assert(proof_valid(&k, &got->base, got->proof));
    /* The one frame is not the other's. */
    cr_assert_eq(dgram_unpack_ack(buf, (size_t)n, &ga), -EBADMSG);
    protobuf_c_message_free_unpacked(&got->base, NULL);

    a.session = 7;
    a.seq = 5;
    a.epoch = 3;
    cr_assert_eq(proof_sign_ack(&k, "demo", "m-1", &a, amac), 0);
    n = dgram_pack_ack(&a, buf);
    cr_assert_gt(n, 0);
    cr_assert_eq(dgram_unpack_ack(buf, (size_t)n, &ga), 0);
    cr_assert(proof_ack_valid(&k, "demo", "m-1", ga));
    /* Bound to its member and to every field. */
    cr_assert_not(proof_ack_valid(&k, "demo", "m-2", ga));
    ga->epoch = 4;
    cr_assert_not(proof_ack_valid(&k, "demo", "m-1", ga));
    protobuf_c_message_free_unpacked(&ga->base, NULL);
}

Test(dgram, malformed_frames_are_refused)
{
    Cohort__V1__HeartbeatDatagram q, *got = NULL;
    uint8_t buf[WIRE_DATAGRAM_MAX + 64];
    char long_id[700];
    ssize_t n;

    datagram(&q, "m-1", 7, 0);
    n = dgram_pack(&q, buf);
    cr_assert_gt(n, 0);
    cr_assert_eq(dgram_unpack(buf, 3, &got), -EBADMSG, "shorter than the magic");
    buf[0] ^= 1;
    cr_assert_eq(dgram_unpack(buf, (size_t)n, &got), -EBADMSG, "another magic");
    buf[0] ^= 1;
    memset(buf + WIRE_DATAGRAM_MAGIC_LEN, 0xff, 16);
    cr_assert_eq(dgram_unpack(buf, (size_t)n, &got), -EBADMSG, "not protobuf");
    cr_assert_eq(dgram_unpack(buf, WIRE_DATAGRAM_MAX + 1, &got), -EBADMSG, "too long");
    datagram(&q, "", 7, 0);
    n = dgram_pack(&q, buf);
    cr_assert_eq(dgram_unpack(buf, (size_t)n, &got), -EBADMSG, "no id");
    /* A message that would not fit is not packed. */
    memset(long_id, 'a', sizeof(long_id) - 1);
    long_id[sizeof(long_id) - 1] = '\0';
    datagram(&q, long_id, 7, 0);
    q.cohort = long_id;
    cr_assert_eq(dgram_pack(&q, buf), -EMSGSIZE);
}

Test(dgram, listen_binds_the_port_for_udp_and_refuses_a_bad_address)
{
    int fds[DGRAM_LISTEN_MAX], again[DGRAM_LISTEN_MAX], tcp = socket(AF_INET, SOCK_STREAM, 0), n;
    struct sockaddr_in sa = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
    socklen_t len = sizeof(sa);

    /* A free port, as the broker has one from gRPC. */
    cr_assert_eq(bind(tcp, (struct sockaddr *)&sa, sizeof(sa)), 0);
    cr_assert_eq(getsockname(tcp, (struct sockaddr *)&sa, &len), 0);
    n = dgram_listen("127.0.0.1:0", ntohs(sa.sin_port), fds);
    cr_assert_eq(n, 1, "one address: %d", n);
    /* The same port again is taken. */
    cr_assert_lt(dgram_listen("127.0.0.1:0", ntohs(sa.sin_port), again), 0);
    close(fds[0]);
    close(tcp);
    cr_assert_eq(dgram_listen("[::1", 7070, fds), -EINVAL);
    cr_assert_eq(dgram_listen("127.0.0.1:1", 0, fds), -EINVAL);
}

/* ---- the broker's side ---- */

static struct brokerd *d;
static struct rpc_channel *ch;
static struct secret key;
static char addr[64];
static int udp = -1;

static void udp_open(void)
{
    struct sockaddr_in sa = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK),
                              .sin_port = htons((uint16_t)brokerd_port(d)) };

    udp = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    cr_assert_geq(udp, 0);
    cr_assert_eq(connect(udp, (struct sockaddr *)&sa, sizeof(sa)), 0);
}

/* A keyed broker (fixture_keyed_broker_start), a channel and a socket. */
static void start(void)
{
    d = fixture_keyed_broker_start("demo", &key, addr, sizeof(addr));
    cr_assert(brokerd_datagrams(d, NULL), "the broker bound its port for UDP");
    cr_assert_eq(rpc_channel_create(addr, NULL, &ch), 0);
    udp_open();
}

static void stop(void)
{
    if (udp >= 0)
        close(udp);
    udp = -1;
    rpc_channel_destroy(ch);
    fixture_broker_stop(d);
}

TestSuite(brokerd_dgram, .init = start, .fini = stop, .timeout = 120);

/* A proved Join of member `id`; the reply's takes_datagrams. */
static bool join(const char *id, uint64_t session, uint64_t seq)
{
    Cohort__V1__JoinRequest q = COHORT__V1__JOIN_REQUEST__INIT;
    ProtobufCMessage *out = NULL;
    Cohort__V1__Proof pf;
    uint8_t mac[SECRET_MAC_BYTES];
    bool takes;

    q.protocol_version = WIRE_PROTOCOL_VERSION;
    q.cohort = "demo";
    q.id = (char *)id;
    q.address = "127.0.0.1:4000";
    q.session = session;
    cr_assert_eq(proof_sign(&key, &q.base, seq, proof_now_ms(), &pf, mac), 0);
    q.proof = &pf;
    cr_assert_eq(rpc_call(ch, WIRE_BROKER_JOIN, &q.base, &cohort__v1__join_reply__descriptor,
                          FIXTURE_WAIT_MS, RPC_WAIT_FOR_READY, &out, NULL), 0);
    takes = ((Cohort__V1__JoinReply *)out)->takes_datagrams;
    protobuf_c_message_free_unpacked(out, NULL);
    return takes;
}

struct seen {
    pthread_mutex_t lock;
    unsigned msgs;
};

static void seen_msg(void *arg, ProtobufCMessage *msg)
{
    struct seen *s = arg;

    pthread_mutex_lock(&s->lock);
    s->msgs++;
    pthread_mutex_unlock(&s->lock);
    protobuf_c_message_free_unpacked(msg, NULL);
}

static void seen_end(void *arg, const struct rpc_status *st)
{
}

static bool seen_some(struct seen *s)
{
    bool got;

    pthread_mutex_lock(&s->lock);
    got = s->msgs > 0;
    pthread_mutex_unlock(&s->lock);
    return got;
}

/* Attaches member `id`'s Session stream with a heartbeat proved with
 * `seq`, and waits for the broker's answer. */
static struct rpc_watch *attach(const char *id, uint64_t session, uint64_t seq, struct seen *s)
{
    Cohort__V1__HeartbeatRequest q = COHORT__V1__HEARTBEAT_REQUEST__INIT;
    Cohort__V1__Proof pf;
    uint8_t mac[SECRET_MAC_BYTES];
    struct rpc_watch *w = NULL;

    q.protocol_version = WIRE_PROTOCOL_VERSION;
    q.cohort = "demo";
    q.id = (char *)id;
    q.session = session;
    cr_assert_eq(proof_sign(&key, &q.base, seq, proof_now_ms(), &pf, mac), 0);
    q.proof = &pf;
    cr_assert_eq(rpc_watch_open(ch, WIRE_BROKER_SESSION, &q.base,
                                &cohort__v1__session_reply__descriptor,
                                RPC_DUPLEX | RPC_WAIT_FOR_READY, seen_msg, seen_end, s, &w), 0);
    FIXTURE_WAIT_FOR(seen_some(s), "the broker never answered the stream's first heartbeat");
    return w;
}

/* Sends a datagram of member `id` reporting checkpoint `ckpt`, proved
 * under `k` with `seq` (k NULL: no proof), asking for an acknowledgement
 * when `want`. */
static void send_beat_asking(const struct secret *k, const char *id, uint64_t session,
                             uint64_t seq, uint64_t ckpt, bool want)
{
    Cohort__V1__HeartbeatDatagram q;
    Cohort__V1__Proof pf;
    uint8_t mac[SECRET_MAC_BYTES], buf[WIRE_DATAGRAM_MAX];
    ssize_t n;

    datagram(&q, id, session, ckpt);
    q.want_ack = want;
    if (k) {
        cr_assert_eq(proof_sign(k, &q.base, seq, proof_now_ms(), &pf, mac), 0);
        q.proof = &pf;
    }
    n = dgram_pack(&q, buf);
    cr_assert_gt(n, 0);
    cr_assert_eq(send(udp, buf, (size_t)n, 0), n);
}

static void send_beat(const struct secret *k, const char *id, uint64_t session, uint64_t seq,
                      uint64_t ckpt)
{
    send_beat_asking(k, id, session, seq, ckpt, false);
}

static uint64_t count(enum brokerd_dg_kind k)
{
    uint64_t c[BROKERD_DG_KINDS];

    brokerd_datagrams(d, c);
    return c[k];
}

/* The checkpoint version the broker holds for member `id`. */
static uint64_t ckpt_of(const char *id)
{
    struct broker_status *st = NULL;
    uint64_t v = UINT64_MAX;

    cr_assert_eq(brokerd_status(d, "demo", &st), 0);
    for (size_t i = 0; i < st->cohorts[0].n_members; i++)
        if (strcmp(st->cohorts[0].members[i].id, id) == 0)
            v = st->cohorts[0].checkpoints[i].version;
    broker_status_free(st);
    return v;
}

/* The next acknowledgement on the test's socket, within the tests'
 * deadline; it must prove the key for member `id`. */
static Cohort__V1__HeartbeatDatagramAck *next_ack(const char *id)
{
    struct pollfd p = { .fd = udp, .events = POLLIN };
    uint8_t buf[WIRE_DATAGRAM_MAX + 1];
    Cohort__V1__HeartbeatDatagramAck *a = NULL;
    ssize_t n;

    cr_assert_eq(poll(&p, 1, (int)FIXTURE_WAIT_MS), 1, "no acknowledgement came");
    n = recv(udp, buf, sizeof(buf), 0);
    cr_assert_gt(n, 0);
    cr_assert_eq(dgram_unpack_ack(buf, (size_t)n, &a), 0);
    cr_assert(proof_ack_valid(&key, "demo", id, a), "the acknowledgement proves the key");
    return a;
}

static bool nothing_waits(void)
{
    uint8_t b[16];

    return recv(udp, b, sizeof(b), MSG_DONTWAIT) < 0 && errno == EAGAIN;
}

Test(brokerd_dgram, a_datagram_of_an_attached_member_counts_and_the_first_is_acknowledged)
{
    struct seen s = { .lock = PTHREAD_MUTEX_INITIALIZER };
    Cohort__V1__HeartbeatDatagramAck *a;
    struct rpc_watch *w;

    cr_assert(join("a", 7, 1), "a keyed cohort's JoinReply offers datagrams");
    w = attach("a", 7, 2, &s);
    send_beat(&key, "a", 7, 3, 42);
    a = next_ack("a");
    cr_assert_eq(a->session, 7);
    cr_assert_eq(a->seq, 3);
    cr_assert_geq(a->epoch, 0);
    protobuf_c_message_free_unpacked(&a->base, NULL);
    cr_assert_eq(ckpt_of("a"), 42, "the datagram's report reached the broker");
    cr_assert_eq(count(BROKERD_DG_ACCEPTED), 1);
    /* The next counts and is not answered: it does not ask. */
    send_beat(&key, "a", 7, 4, 43);
    FIXTURE_WAIT_FOR(count(BROKERD_DG_ACCEPTED) == 2, "the second datagram did not count");
    cr_assert_eq(ckpt_of("a"), 43);
    cr_assert_eq(count(BROKERD_DG_ACKED), 1);
    cr_assert(nothing_waits(), "one acknowledgement for two datagrams");
    /* One that asks is answered; the question is under the proof. */
    send_beat_asking(&key, "a", 7, 5, 44, true);
    a = next_ack("a");
    cr_assert_eq(a->seq, 5);
    protobuf_c_message_free_unpacked(&a->base, NULL);
    rpc_watch_close(w);
}

Test(brokerd_dgram, refused_datagrams_change_nothing_and_get_no_answer)
{
    struct seen s = { .lock = PTHREAD_MUTEX_INITIALIZER };
    Cohort__V1__HeartbeatDatagramAck *a;
    Cohort__V1__HeartbeatDatagram q;
    Cohort__V1__HeartbeatRequest h = COHORT__V1__HEARTBEAT_REQUEST__INIT;
    Cohort__V1__Proof pf;
    uint8_t mac[SECRET_MAC_BYTES], buf[WIRE_DATAGRAM_MAX + 100];
    struct secret other;
    struct rpc_watch *w;
    ssize_t n;

    cr_assert_eq(secret_generate(&other), 0);
    join("a", 7, 1);
    join("b", 9, 1);        /* joined, but no stream attached */
    w = attach("a", 7, 2, &s);
    send_beat(&key, "a", 7, 3, 42);
    a = next_ack("a");
    protobuf_c_message_free_unpacked(&a->base, NULL);

    /* Malformed: too long, another magic, not protobuf after the magic. */
    memset(buf, 0, sizeof(buf));
    memcpy(buf, WIRE_DATAGRAM_MAGIC, WIRE_DATAGRAM_MAGIC_LEN);
    cr_assert_eq(send(udp, buf, WIRE_DATAGRAM_MAX + 100, 0), WIRE_DATAGRAM_MAX + 100);
    cr_assert_eq(send(udp, "xxxx1234", 8, 0), 8);
    memset(buf + WIRE_DATAGRAM_MAGIC_LEN, 0xff, 32);
    cr_assert_eq(send(udp, buf, WIRE_DATAGRAM_MAGIC_LEN + 32, 0), WIRE_DATAGRAM_MAGIC_LEN + 32);
    /* Unproved: no proof, a wrong key, and a stream heartbeat's proof for
     * the same values (its method differs). */
    send_beat(NULL, "a", 7, 0, 99);
    send_beat(&other, "a", 7, 10, 99);
    datagram(&q, "a", 7, 99);
    h.protocol_version = WIRE_PROTOCOL_VERSION;
    h.cohort = "demo";
    h.id = "a";
    h.session = 7;
    h.checkpoint_version = 99;
    cr_assert_eq(proof_sign(&key, &h.base, 11, proof_now_ms(), &pf, mac), 0);
    q.proof = &pf;
    n = dgram_pack(&q, buf);
    cr_assert_eq(send(udp, buf, (size_t)n, 0), n);
    /* A replay of seq 3, another session, a member with no stream. */
    send_beat(&key, "a", 7, 3, 99);
    send_beat(&key, "a", 8, 12, 99);
    send_beat(&key, "b", 9, 2, 99);
    FIXTURE_WAIT_FOR(count(BROKERD_DG_MALFORMED) == 3 && count(BROKERD_DG_UNPROVED) == 3 &&
                         count(BROKERD_DG_REPLAYED) == 1 && count(BROKERD_DG_UNATTACHED) == 2,
                     "each bad datagram counted once by its kind");
    cr_assert_eq(count(BROKERD_DG_ACCEPTED), 1);
    cr_assert_eq(ckpt_of("a"), 42, "no refused datagram changed the member");
    cr_assert_eq(ckpt_of("b"), 0);
    cr_assert(nothing_waits(), "nothing answered a refused datagram");
    rpc_watch_close(w);
}

/* A member session that sends faster than its stream's pace allows has
 * the excess dropped, not its stream ended. */
Test(brokerd_dgram, datagrams_beyond_the_pace_are_dropped)
{
    struct seen s = { .lock = PTHREAD_MUTEX_INITIALIZER };
    struct rpc_watch *w;

    join("a", 7, 1);
    w = attach("a", 7, 2, &s);
    for (uint64_t seq = 3; seq < 43; seq++)
        send_beat(&key, "a", 7, seq, seq);
    FIXTURE_WAIT_FOR(count(BROKERD_DG_ACCEPTED) + count(BROKERD_DG_PACED) == 40,
                     "every datagram judged");
    cr_assert_gt(count(BROKERD_DG_PACED), 0);
    /* 16 at once and one more each 50 ms: a broker slowed by load may
     * take a few more, never all. */
    cr_assert_lt(count(BROKERD_DG_ACCEPTED), 40);
    cr_assert(seen_some(&s));
    rpc_watch_close(w);
}

Test(brokerd_dgram, a_cohort_without_a_key_or_a_broker_without_datagrams_offers_none)
{
    struct brokerd_config cfg;
    struct brokerd *open_d, *off_d;
    struct rpc_channel *keep = ch;
    char a2[64];

    /* An open broker's keyless cohort: a datagram would prove nothing. */
    fixture_broker_config(&cfg);
    open_d = fixture_broker_start_with(&cfg, "demo", a2, sizeof(a2));
    cr_assert_eq(rpc_channel_create(a2, NULL, &ch), 0);
    {
        Cohort__V1__JoinRequest q = COHORT__V1__JOIN_REQUEST__INIT;
        ProtobufCMessage *out = NULL;

        q.protocol_version = WIRE_PROTOCOL_VERSION;
        q.cohort = "demo";
        q.id = "a";
        q.address = "127.0.0.1:4000";
        q.session = 3;
        cr_assert_eq(rpc_call(ch, WIRE_BROKER_JOIN, &q.base, &cohort__v1__join_reply__descriptor,
                              FIXTURE_WAIT_MS, RPC_WAIT_FOR_READY, &out, NULL), 0);
        cr_assert_not(((Cohort__V1__JoinReply *)out)->takes_datagrams);
        protobuf_c_message_free_unpacked(out, NULL);
    }
    rpc_channel_destroy(ch);
    fixture_broker_stop(open_d);

    /* A keyed broker told not to. */
    fixture_broker_config(&cfg);
    cfg.open = false;
    cfg.key = &key;
    cfg.no_datagrams = true;
    off_d = fixture_broker_start_with(&cfg, "demo", a2, sizeof(a2));
    cr_assert_not(brokerd_datagrams(off_d, NULL));
    cr_assert_eq(rpc_channel_create(a2, NULL, &ch), 0);
    cr_assert_not(join("a", 7, 1));
    rpc_channel_destroy(ch);
    fixture_broker_stop(off_d);
    ch = keep;
}

/* ---- a member's side ---- */

struct live {
    struct member *m;
    struct heartbeat *hb;
};

static void live_start(struct live *l, const char *id, uint32_t timeout_ms)
{
    struct member_config mc = { .broker = addr, .cohort = "demo", .id = id,
                                .address = "127.0.0.1:4000", .heartbeat_ms = 100,
                                .timeout_ms = timeout_ms, .key = &key };

    cr_assert_eq(member_create(&mc, &l->m), 0);
    cr_assert_eq(heartbeat_create(l->m, NULL, NULL, &l->hb), 0);
}

static void live_stop(struct live *l)
{
    heartbeat_destroy(l->hb);
    member_leave(l->m, 5000);
    member_destroy(l->m);
}

Test(brokerd_dgram, a_member_heartbeats_by_datagram_and_stays_in)
{
    struct live l;
    uint64_t e0;

    live_start(&l, "m-0", 1000);
    FIXTURE_WAIT_FOR(member_in_cohort(l.m), "the member never got in");
    FIXTURE_WAIT_FOR(member_datagrams(l.m) && count(BROKERD_DG_ACCEPTED) >= 30,
                     "the member's heartbeats did not go as datagrams (%llu)",
                     (unsigned long long)count(BROKERD_DG_ACCEPTED));
    /* Three timeouts on datagrams alone: acknowledged, never evicted. */
    cr_assert_geq(count(BROKERD_DG_ACKED), 2);
    {
        struct epoch *e = member_epoch(l.m);

        e0 = e->number;
        epoch_unref(e);
    }
    member_set_checkpoint(l.m, 17, 0, 0);
    FIXTURE_WAIT_FOR(ckpt_of("m-0") == 17, "a datagram carried the new checkpoint");
    cr_assert(member_in_cohort(l.m) && member_datagrams(l.m));
    {
        struct epoch *e = member_epoch(l.m);

        cr_assert_eq(e->number, e0, "no epoch change: the member was never out");
        epoch_unref(e);
    }
    live_stop(&l);
}

static void start_deaf(void)
{
    struct brokerd_config cfg;

    cr_assert_eq(secret_generate(&key), 0);
    fixture_broker_config(&cfg);
    cfg.open = false;
    cfg.key = &key;
    cfg.deaf_datagrams = true;
    d = fixture_broker_start_with(&cfg, "demo", addr, sizeof(addr));
    cr_assert_eq(rpc_channel_create(addr, NULL, &ch), 0);
    udp_open();
}

TestSuite(brokerd_dgram_deaf, .init = start_deaf, .fini = stop, .timeout = 120);

/* The broker offers datagrams but none arrives, as on a network that
 * drops UDP to it: with no acknowledgement, each heartbeat goes up the
 * stream as well, and the member is never evicted. */
Test(brokerd_dgram_deaf, a_member_whose_datagrams_vanish_heartbeats_up_its_stream)
{
    struct live l;
    uint64_t until, tried;

    live_start(&l, "m-0", 1000);
    FIXTURE_WAIT_FOR(member_in_cohort(l.m), "the member never got in");
    FIXTURE_WAIT_FOR(count(BROKERD_DG_DROPPED) >= 3, "the member never tried datagrams");
    tried = count(BROKERD_DG_DROPPED);
    /* Three timeouts: still in, and the broker still holds it (an
     * eviction would end its stream and make it rejoin). */
    until = clock_now_ms() + 3000;
    while (clock_now_ms() < until) {
        cr_assert(member_in_cohort(l.m), "the member fell out");
        cr_assert_not(member_datagrams(l.m), "no datagram was ever acknowledged");
        clock_sleep_ms(20);
    }
    cr_assert_eq(member_joins(l.m), 1, "the member was never evicted");
    cr_assert_gt(count(BROKERD_DG_DROPPED), tried, "it went on asking by datagram");
    cr_assert_eq(count(BROKERD_DG_ACCEPTED), 0);
    live_stop(&l);
}

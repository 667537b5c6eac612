/* tests/fuzz/seeds.c: writes the generated seed corpora, made with the
 * encoders the programs themselves use, so that every harness starts from
 * real traffic: greetings and frames (peerwire), trainer-link messages as
 * tlink_send puts them on the socket, scripted sidecar replies, packed
 * broker requests and epochs, heartbeat datagrams and their
 * acknowledgements as dgram_pack writes them, probe requests, key files, names, flag
 * values, and coded payloads as codec_encode writes them. `make fuzz-seeds` runs it, and tests/fuzz/seeds.py for the
 * Kubernetes JSON.
 *
 *   build/fuzz/seeds DIR       writes DIR/<harness>/seed-<what>
 *
 * Files are named seed-*, so that a rerun replaces them and leaves alone
 * what fuzz-merge added (named by content hash). */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "accumulator/tlink.h"
#include "accumulator/viewpage.h"
#include "cohort.pb-c.h"
#include "engine/codec.h"
#include "engine/peerwire.h"
#include "membership/dgram.h"

static const char *root;

static void put(const char *harness, const char *what, const void *data, size_t len)
{
    char path[512];
    FILE *f;

    snprintf(path, sizeof(path), "%s/%s", root, harness);
    if (mkdir(path, 0755) < 0 && errno != EEXIST) {
        perror(path);
        exit(1);
    }
    snprintf(path, sizeof(path), "%s/%s/seed-%s", root, harness, what);
    f = fopen(path, "wb");
    if (!f || fwrite(data, 1, len, f) != len || fclose(f) != 0) {
        perror(path);
        exit(1);
    }
}

static void put_str(const char *harness, const char *what, const char *s)
{
    put(harness, what, s, strlen(s));
}

/* A growing byte string. */
struct buf {
    uint8_t b[8192];
    size_t n;
};

static void add(struct buf *b, const void *p, size_t n)
{
    if (b->n + n > sizeof(b->b))
        abort();
    if (n)
        memcpy(b->b + b->n, p, n);
    b->n += n;
}

static void add8(struct buf *b, uint8_t v)
{
    add(b, &v, 1);
}

static void add16(struct buf *b, uint16_t v)
{
    add8(b, (uint8_t)v);
    add8(b, (uint8_t)(v >> 8));
}

/* ---- codec ---------------------------------------------------------------- */

/* For every codec: a payload of 300 values as a peer sends it (mode 0:
 * count, then codec_encode's bytes), and the values themselves (mode 1). */
static void codec(void)
{
    float x[300];

    for (size_t i = 0; i < 300; i++)
        x[i] = (float)((double)((i * 7919) % 1009) / 13.0 - 38.0);
    x[17] = 1e6f;           /* an outlier */
    for (int c = 0; c < CODEC_END; c++) {
        struct buf b = { .n = 0 };
        uint8_t wire[4 * CODEC_UNIFORM8_BINS + 4 * 300];
        char what[32];

        if (!codec_valid(c))
            continue;
        add8(&b, (uint8_t)c);
        add8(&b, 0);
        add16(&b, 300);
        codec_encode((enum codec)c, wire, x, 300);
        add(&b, wire, codec_bytes((enum codec)c, 300));
        snprintf(what, sizeof(what), "%s-payload", codec_name((enum codec)c));
        put("codec", what, b.b, b.n);
        b.n = 0;
        add8(&b, (uint8_t)c);
        add8(&b, 1);
        add(&b, x, sizeof(x));
        snprintf(what, sizeof(what), "%s-values", codec_name((enum codec)c));
        put("codec", what, b.b, b.n);
    }
}

/* ---- peerwire ------------------------------------------------------------ */

static void peerwire(void)
{
    static const struct {
        const char *what;
        uint8_t kind, flags, reason;
        uint64_t epoch;
        const char *cohort, *id;
    } g[] = {
        { "greet", PEERWIRE_GREET, 0, 0, 7, "default/logreg", "logreg-0" },
        { "greet-keyed", PEERWIRE_GREET, PEERWIRE_F_KEYED, 0, 7, "default/logreg", "logreg-0" },
        { "greet-integrity", PEERWIRE_GREET, PEERWIRE_F_ALL, 0, 7, "c", "w-0" },
        { "accept", PEERWIRE_ACCEPT, PEERWIRE_F_KEYED, 0, 7, "default/logreg", "logreg-1" },
        { "stale", PEERWIRE_STALE, PEERWIRE_F_KEYED, 0, 9, "c", "w-10" },
        { "confirm", PEERWIRE_CONFIRM, PEERWIRE_F_KEYED, 0, 7, "c", "w-0" },
        { "refuse", PEERWIRE_REFUSE, 0, PEERWIRE_REFUSE_NEED_KEY, 7, "c", "w-1" },
    };
    uint8_t b[PEERWIRE_HELLO_BYTES + PEERWIRE_FRAME_BYTES];
    struct peerwire_frame data = {
        .magic = PEERWIRE_FRAME_DATA, .length = 4096, .cohort = peerwire_cohort_hash("c"),
        .epoch = 7, .round = 3, .offset = 1024, .count = 1024, .dtype = 0, .op = 0,
        .phase = PEERWIRE_PHASE_RS, .step = 1,
    };
    struct peerwire_frame bye = { .magic = PEERWIRE_FRAME_BYE, .cohort = data.cohort,
                                  .epoch = 7, .round = 3, .step = ECONNRESET };

    for (size_t i = 0; i < sizeof(g) / sizeof(g[0]); i++) {
        struct peerwire_hello h = { .kind = g[i].kind, .flags = g[i].flags,
                                    .reason = g[i].reason, .epoch = g[i].epoch,
                                    .incarnation = 0x1234567890abcdefull, .serial = i + 1 };
        memset(h.nonce, 0xa5, sizeof(h.nonce));
        if (h.flags & PEERWIRE_F_KEYED && h.kind != PEERWIRE_GREET)
            memset(h.mac, 0x3c, sizeof(h.mac));
        snprintf(h.cohort, sizeof(h.cohort), "%s", g[i].cohort);
        snprintf(h.id, sizeof(h.id), "%s", g[i].id);
        if (peerwire_hello_encode(b, &h) < 0)
            abort();
        put("peerwire", g[i].what, b, PEERWIRE_HELLO_BYTES);
    }
    peerwire_frame_encode(b, &data);
    put("peerwire", "frame-data", b, PEERWIRE_FRAME_BYTES);
    peerwire_frame_encode(b, &bye);
    put("peerwire", "frame-bye", b, PEERWIRE_FRAME_BYTES);
    /* A connection's first bytes: a greeting, then a frame. */
    {
        struct peerwire_hello h = { .kind = PEERWIRE_GREET, .epoch = 7, .cohort = "c", .id = "w-0" };
        if (peerwire_hello_encode(b, &h) < 0)
            abort();
    }
    peerwire_frame_encode(b + PEERWIRE_HELLO_BYTES, &data);
    put("peerwire", "greet-then-frame", b, sizeof(b));
}

/* ---- the trainer link ----------------------------------------------------- */

static int pair[2];

/* The datagram tlink_send writes for one message. */
static size_t message(uint16_t type, int32_t status, const void *body, uint32_t len, uint8_t *out,
                      size_t cap)
{
    ssize_t n;

    if (tlink_send(pair[0], type, status, body, len, NULL, 0) < 0)
        abort();
    n = recv(pair[1], out, cap, 0);
    if (n < 0)
        abort();
    return (size_t)n;
}

/* The layout cohort_create() makes for n f32 parameters. */
static struct tlink_register layout(uint64_t n)
{
    uint64_t bytes = (n * 4 + 63) / 64 * 64;

    return (struct tlink_register){
        .mem = TL_MEM_HOST, .grad_dtype = 0, .params_off = 0, .params_bytes = bytes,
        .grads_off = bytes, .grad_count = n, .results_off = 2 * bytes,
        .buffers_off = 3 * bytes, .buffers_bytes = 0, .shared_off = 3 * bytes + 64,
        .region_bytes = 3 * bytes + 64 + VIEWPAGE_BYTES,
    };
}

static void tlink_one(const char *what, uint8_t flags, uint16_t type, int32_t status,
                      const void *body, uint32_t len)
{
    uint8_t b[1 + sizeof(struct tlink_hdr) + TLINK_BODY_MAX];

    b[0] = flags;
    put("tlink", what, b, 1 + message(type, status, body, len, b + 1, sizeof(b) - 1));
}

static void tlink(void)
{
    struct tlink_hello hello = { .api_version = TLINK_VERSION, .name = "accumulator" };
    struct tlink_register reg = layout(1000);
    struct tlink_u64 u = { 256 };
    struct tlink_view view = { .connected = 1, .wants_gradients = 1, .rank = 1, .size = 3,
                               .model_version = 12, .epoch = 4, .leader = "w-0" };

    tlink_one("hello", 0, TL_HELLO, 0, &hello, sizeof(hello));
    tlink_one("register", 1, TL_REGISTER, 0, &reg, sizeof(reg));
    reg = layout(1);
    tlink_one("register-one", 1, TL_REGISTER, 0, &reg, sizeof(reg));
    tlink_one("view", 0, TL_VIEW, 0, NULL, 0);
    tlink_one("contribute", 0, TL_CONTRIBUTE, 0, &u, sizeof(u));
    tlink_one("consume", 0, TL_CONSUME, 0, &u, sizeof(u));
    tlink_one("set-state", 1, TL_SET_STATE, 0, &u, sizeof(u));
    tlink_one("take-state", 0, TL_TAKE_STATE, 0, NULL, 0);
    tlink_one("set-version", 0, TL_SET_VERSION, 0, &u, sizeof(u));
    tlink_one("set-vbs", 0, TL_SET_VBS, 0, &u, sizeof(u));
    tlink_one("set-parallel", 0, TL_SET_PARALLEL, 0, &u, sizeof(u));
    /* Replies, as the trainer reads them. */
    tlink_one("reply-view", 4 | TL_VIEW << 4, TL_REPLY, 0, &view, sizeof(view));
    tlink_one("reply-take-state", 4 | TL_TAKE_STATE << 4, TL_REPLY, 0, &u, sizeof(u));
    tlink_one("reply-error", 4 | TL_CONTRIBUTE << 4, TL_REPLY, -EAGAIN, NULL, 0);
}

/* One record of a tlink_trainer script: the op once connected, and the
 * reply the sidecar gives to the next request. */
static void record(struct buf *s, uint8_t op, uint8_t flags, uint16_t state, int32_t status,
                   const void *body, uint16_t len)
{
    add8(s, op);
    add8(s, flags);
    add16(s, state);
    add16(s, (uint16_t)status);
    add16(s, (uint16_t)((uint32_t)status >> 16));
    add16(s, len);
    add(s, body, len);
}

static void tlink_trainer(void)
{
    struct tlink_view view = { .connected = 1, .wants_gradients = 1, .rank = 0, .size = 2,
                               .model_version = 3, .epoch = 2, .leader = "w-0" };
    struct tlink_u64 len = { 5 };
    uint8_t m[sizeof(struct tlink_hdr) + TLINK_BODY_MAX];
    struct buf s = { .n = 0 };

    /* HELLO and REGISTER answered, then every operation once. */
    record(&s, 0, 0, 0, 0, NULL, 0);
    record(&s, 0, 0, 0, 0, NULL, 0);
    put("tlink_trainer", "connect", s.b, s.n);
    record(&s, 0, 0, 0, 0, &view, sizeof(view));          /* update */
    record(&s, 1, 0, 0, 0, NULL, 0);                      /* contribute */
    record(&s, 3, 0, 0, 0, NULL, 0);                      /* set_state */
    record(&s, 4, 1, 5, 0, &len, sizeof(len));            /* take_state, with its memfd */
    record(&s, 5, 0, 0, 0, NULL, 0);                      /* set_model_version */
    record(&s, 6, 0, 0, 0, NULL, 0);                      /* set_virtual_batch_size */
    record(&s, 7, 0, 0, 0, NULL, 0);                      /* set_parallel_gradients */
    record(&s, 8, 0, 0, 0, NULL, 0);                      /* gone */
    put("tlink_trainer", "session", s.b, s.n);
    /* Refusals, as the sidecar sends them (a refused TAKE_STATE still
     * carries its u64). */
    s.n = 0;
    record(&s, 0, 0, 0, 0, NULL, 0);
    record(&s, 0, 0, 0, 0, NULL, 0);
    record(&s, 1, 0, 0, -EAGAIN, NULL, 0);
    record(&s, 4, 0, 0, -ENODATA, &len, sizeof(len));
    record(&s, 2, 0, 0, 0, NULL, 0);                      /* consume: no reply */
    record(&s, 0, 0, 0, -ENOTCONN, NULL, 0);
    put("tlink_trainer", "refusals", s.b, s.n);
    /* The sidecar refuses the registration. */
    s.n = 0;
    record(&s, 0, 0, 0, 0, NULL, 0);
    record(&s, 0, 0, 0, -EBUSY, NULL, 0);
    put("tlink_trainer", "busy", s.b, s.n);
    /* Whole datagrams, as tlink_send makes them. */
    s.n = 0;
    record(&s, 0, 8, 0, 0, m, (uint16_t)message(TL_REPLY, 0, NULL, 0, m, sizeof(m)));
    record(&s, 0, 8, 0, 0, m, (uint16_t)message(TL_REPLY, 0, NULL, 0, m, sizeof(m)));
    record(&s, 0, 8, 0, 0, m, (uint16_t)message(TL_REPLY, 0, &view, sizeof(view), m, sizeof(m)));
    put("tlink_trainer", "raw", s.b, s.n);
}

/* ---- the broker ----------------------------------------------------------- */

static void packed(struct buf *b, uint8_t op, const ProtobufCMessage *m)
{
    uint8_t tmp[1024];
    size_t n = protobuf_c_message_get_packed_size(m);

    if (n > sizeof(tmp))
        abort();
    protobuf_c_message_pack(m, tmp);
    add8(b, op);
    add16(b, (uint16_t)n);
    add(b, tmp, n);
}

static void broker(void)
{
    Cohort__V1__JoinRequest join = COHORT__V1__JOIN_REQUEST__INIT;
    Cohort__V1__HeartbeatRequest beat = COHORT__V1__HEARTBEAT_REQUEST__INIT;
    Cohort__V1__LeaveRequest leave = COHORT__V1__LEAVE_REQUEST__INIT;
    Cohort__V1__WatchRequest watch = COHORT__V1__WATCH_REQUEST__INIT;
    Cohort__V1__StatusRequest status = COHORT__V1__STATUS_REQUEST__INIT;
    struct buf b = { .n = 0 };

    /* Compact: any cohort allowed, caps of 16, a 50 ms hold; three members
     * join and watch, the hold passes, an epoch forms; heartbeats, a
     * declared version, a drain, a leave, an eviction. */
    add8(&b, 1 | 3 << 1 | 3 << 3 | 3 << 5);
    add8(&b, 2);
    for (uint8_t who = 0; who < 3; who++) {
        add8(&b, 0);                                        /* join */
        add8(&b, 0);
        add8(&b, who);
        add8(&b, who);
        add8(&b, 0);
        add8(&b, 10);
        add8(&b, 3);                                        /* watch */
        add8(&b, 0);
        add8(&b, who);
        add8(&b, who);
    }
    add8(&b, 9 | 9 << 4);                                   /* tick, 1000 ms on */
    add8(&b, 9 | 7 << 4);
    add8(&b, 1);                                            /* heartbeat, declared 5 */
    add8(&b, 0);
    add8(&b, 1);
    add8(&b, 0x85);
    add8(&b, 1);
    add8(&b, 5);                                            /* drain w-2 */
    add8(&b, 0);
    add8(&b, 2 | 0x80);
    add8(&b, 9 | 7 << 4);
    add8(&b, 6);                                            /* drained? */
    add8(&b, 0);
    add8(&b, 2);
    add8(&b, 2);                                            /* leave w-0 */
    add8(&b, 0);
    add8(&b, 0);
    add8(&b, 9 | 15 << 4);                                  /* tick past every timeout */
    add8(&b, 10);
    add8(&b, 0);
    add8(&b, 0);
    put("broker", "compact", b.b, b.n);

    /* The same through packed requests. */
    b.n = 0;
    add8(&b, 1 | 3 << 1 | 3 << 3);
    add8(&b, 0);
    join.protocol_version = 1;
    join.cohort = "default/logreg";
    join.address = "10.0.0.1:7000";
    join.session = 42;
    join.model_version = 3;
    join.last_epoch = 5;
    join.id = "logreg-0";
    packed(&b, 11, &join.base);
    join.id = "logreg-1";
    join.address = "10.0.0.2:7000";
    join.session = 43;
    packed(&b, 11, &join.base);
    watch.protocol_version = 1;
    watch.cohort = "default/logreg";
    watch.id = "logreg-0";
    watch.session = 42;
    packed(&b, 14, &watch.base);
    add8(&b, 9 | 9 << 4);
    beat.protocol_version = 1;
    beat.cohort = "default/logreg";
    beat.id = "logreg-1";
    beat.session = 43;
    beat.model_version = 9;
    beat.declare_version = 1;
    beat.epoch = 6;
    packed(&b, 12 | 2 << 4, &beat.base);
    add8(&b, 9 | 9 << 4);
    status.protocol_version = 1;
    status.cohort = "default/logreg";
    packed(&b, 15, &status.base);
    leave.protocol_version = 1;
    leave.cohort = "default/logreg";
    leave.id = "logreg-0";
    leave.session = 42;
    packed(&b, 13, &leave.base);
    add8(&b, 9 | 9 << 4);
    status.cohort = "";
    packed(&b, 15, &status.base);
    put("broker", "packed", b.b, b.n);

    /* A join that asks for the longest timeout. */
    b.n = 0;
    add8(&b, 1);
    add8(&b, 0);
    join.id = "evil";
    join.address = "10.9.9.9:1";
    join.timeout_ms = UINT32_MAX;
    packed(&b, 11, &join.base);
    add8(&b, 9 | 15 << 4);
    put("broker", "long-timeout", b.b, b.n);
}

static void epoch(void)
{
    Cohort__V1__Member m[3], *mp[3];
    Cohort__V1__Epoch e = COHORT__V1__EPOCH__INIT;
    static const char *const ids[] = { "w-0", "w-2", "w-10" };
    static const char *const addrs[] = { "10.0.0.1:7000", "[fd00::2]:7000", "w-10.svc:7000" };
    uint8_t b[1024];
    size_t n;

    for (int i = 0; i < 3; i++) {
        cohort__v1__member__init(&m[i]);
        m[i].id = (char *)ids[i];
        m[i].address = (char *)addrs[i];
        m[i].model_version = (uint64_t)(10 + i);
        mp[i] = &m[i];
    }
    e.cohort = "default/logreg";
    e.epoch = 12;
    e.leader = "w-10";
    e.n_members = 3;
    e.members = mp;
    n = cohort__v1__epoch__pack(&e, b);
    put("epoch", "three", b, n);
    e.n_members = 0;
    e.leader = "";
    n = cohort__v1__epoch__pack(&e, b);
    put("epoch", "empty", b, n);
    /* Refused: out of order, and a leader who is not a member. */
    e.n_members = 3;
    e.leader = "w-0";
    mp[0] = &m[2];
    mp[2] = &m[0];
    n = cohort__v1__epoch__pack(&e, b);
    put("epoch", "unordered", b, n);
}

/* ---- text ----------------------------------------------------------------- */

static void text(void)
{
    static const char *const probes[] = {
        ("GET /healthz HTTP/1.1\r\nHost: 10.0.0.5:8080\r\nUser-Agent: kube-probe/1.29\r\n"
         "Accept: */*\r\nConnection: close\r\n\r\n"),
        ("GET /metrics HTTP/1.1\r\nHost: operator:8080\r\n"
         "Accept: text/plain;version=0.0.4\r\n\r\n"),
        "GET /readyz?verbose=1 HTTP/1.0\n\n",
        "HEAD /healthz HTTP/1.1\r\n\r\n",
        "POST /healthz HTTP/1.1\r\nContent-Length: 0\r\n\r\n",
        "GET  HTTP/1.1\r\n\r\n",
    };
    static const char *const idents[][2] = {
        { "members", "w-0\0w-10\0w-2" },
        { "zeros", "c-02\0c-2\0c-10" },
        { "cohort", "default/logreg\0logreg-0\0" },
        { "address", "10.0.0.1:7000\0[fd00::1]:9000\0host.svc.cluster.local:65535" },
    };
    char name[32];

    for (size_t i = 0; i < sizeof(probes) / sizeof(probes[0]); i++) {
        snprintf(name, sizeof(name), "%zu", i);
        put_str("probe", name, probes[i]);
    }
    for (size_t i = 0; i < sizeof(idents) / sizeof(idents[0]); i++) {
        const char *s = idents[i][1];
        size_t n = 0;
        /* Three NUL-separated strings. */
        for (int k = 0; k < 3; k++)
            n += strlen(s + n) + (k < 2);
        put("ident", idents[i][0], s, n);
    }
    put_str("secret", "key",
            "3f1c9a0e5b7d2468ace013579bdf02468ace13579bdf0123456789abcdef0123\n");
    put_str("secret", "upper",
            "  3F1C9A0E5B7D2468ACE013579BDF02468ACE13579BDF0123456789ABCDEF0123  \n");
    put_str("secret", "short", "3f1c9a0e5b7d2468\n");
    /* opt: a byte choosing the parser and its bounds, then the text. */
    put("opt", "duration", "\x0c" "500ms", 6);
    put("opt", "duration-frac", "\x0c" "1.5s", 5);
    put("opt", "duration-h", "\x1c" "1h", 3);
    put("opt", "uint", "\xe1" "4096", 5);
    put("opt", "bytes", "\x12" "64KiB", 6);
    put("opt", "bytes-g", "\x1e" "2G", 3);
    put("opt", "list", "\xf7" "1M,64K,4096", 12);
}

/* A heartbeat datagram and an acknowledgement as member.c and brokerd.c
 * send them, each behind the harness's selector byte. */
static void dgram(void)
{
    Cohort__V1__HeartbeatDatagram q = COHORT__V1__HEARTBEAT_DATAGRAM__INIT;
    Cohort__V1__HeartbeatDatagramAck a = COHORT__V1__HEARTBEAT_DATAGRAM_ACK__INIT;
    Cohort__V1__CheckpointSkipped skip = COHORT__V1__CHECKPOINT_SKIPPED__INIT;
    Cohort__V1__Proof pf = COHORT__V1__PROOF__INIT;
    uint8_t mac[32], buf[1 + WIRE_DATAGRAM_MAX];
    ssize_t n;

    memset(mac, 0x42, sizeof(mac));
    pf.seq = 7;
    pf.time_ms = 1764300000000ull;
    pf.mac.data = mac;
    pf.mac.len = sizeof(mac);
    q.protocol_version = 2;
    q.cohort = "default/logreg";
    q.id = "logreg-0";
    q.session = 42;
    q.model_version = 9;
    q.epoch = 6;
    q.want_ack = 1;
    q.proof = &pf;
    buf[0] = 0;
    n = dgram_pack(&q, buf + 1);
    if (n > 0)
        put("dgram", "heartbeat", buf, (size_t)n + 1);
    q.checkpoint_version = 12;
    skip.version = 13;
    skip.reason = 2;
    q.checkpoint_skipped = &skip;
    n = dgram_pack(&q, buf + 1);
    if (n > 0)
        put("dgram", "heartbeat-checkpoint", buf, (size_t)n + 1);
    a.session = 42;
    a.seq = 7;
    a.epoch = 6;
    a.mac.data = mac;
    a.mac.len = sizeof(mac);
    buf[0] = 1;
    n = dgram_pack_ack(&a, buf + 1);
    if (n > 0)
        put("dgram", "ack", buf, (size_t)n + 1);
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s DIR\n", argv[0]);
        return 2;
    }
    root = argv[1];
    if (socketpair(AF_UNIX, SOCK_SEQPACKET, 0, pair) < 0) {
        perror("socketpair");
        return 1;
    }
    peerwire();
    codec();
    tlink();
    tlink_trainer();
    broker();
    dgram();
    epoch();
    text();
    return 0;
}

/* tests/unit/test_avstate.c: state sharing for averagers.
 *   - the broker's donor table (membership/matchmaker.h): priority order,
 *     expiry, renewal and withdrawal, caps, bad input, unknown cohorts;
 *   - the StateDonors call: refused without a proof, with a wrong one, for
 *     no member, an unknown cohort, a bad id or a bad prefix;
 *   - downloads (averager/avstate.h) over loopback from real servers and
 *     from donors that lie: a part that does not match its digest, a
 *     manifest without the key's MAC, a size over the cap, a stall; a
 *     donor that does not share; donors that disagree (never mixed);
 *   - averagers end to end: a newcomer loads the sharing donor of the top
 *     priority, follows sharing being turned off, and gets nothing (with
 *     the reason) when nobody shares. */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "averager/averager.h"
#include "averager/avstate.h"
#include "base/clock.h"
#include "base/secret.h"
#include "cohort.pb-c.h"
#include "engine/allreduce.h"
#include "fixture.h"
#include "membership/brokerd.h"
#include "membership/matchmaker.h"
#include "membership/proof.h"
#include "membership/wire.h"
#include "rpc/rpc.h"

/* ---- the donor table ---------------------------------------------------------- */

static void no_formed(void *arg, const struct matchmaker_group *g)
{
    (void)arg;
    (void)g;
}

static void no_failed(void *arg, void *ctx, int err, const char *why)
{
    (void)arg;
    (void)ctx;
    (void)err;
    (void)why;
}

static struct matchmaker *table(void)
{
    struct matchmaker_ops ops = { .formed = no_formed, .failed = no_failed };
    struct matchmaker *m = NULL;

    cr_assert_eq(matchmaker_create(&ops, 1, &m), 0);
    return m;
}

static int declare(struct matchmaker *m, uint64_t now, const char *cohort, const char *id,
                   const char *prefix, double priority, uint32_t expiry_ms, char *why)
{
    struct matchmaker_donor d = {
        .cohort = cohort, .id = id, .prefix = prefix, .address = "127.0.0.1:9000",
        .session = 7, .priority = priority, .expiry_ms = expiry_ms,
    };

    return matchmaker_declare(m, now, &d, why, 320);
}

Test(donors, highest_priority_first_then_by_id_without_the_asker)
{
    struct matchmaker *m = table();
    struct matchmaker_donor_row rows[MATCHMAKER_DONORS_REPLY_MAX];
    char why[320];

    cr_assert_eq(declare(m, 0, "c", "d-10", "p", 1, 1000, why), 0);
    cr_assert_eq(declare(m, 0, "c", "d-2", "p", 5, 1000, why), 0);
    cr_assert_eq(declare(m, 0, "c", "d-9", "p", 5, 1000, why), 0);
    cr_assert_eq(declare(m, 0, "c", "d-1", "q", 9, 1000, why), 0);      /* another prefix */
    cr_assert_eq(declare(m, 0, "x", "d-3", "p", 9, 1000, why), 0);      /* another cohort */
    cr_assert_eq(matchmaker_donors(m, 1, "c", "p", NULL, rows, 64), 3);
    cr_assert_str_eq(rows[0].id, "d-2");
    cr_assert_str_eq(rows[1].id, "d-9");
    cr_assert_str_eq(rows[2].id, "d-10");
    cr_assert_eq(rows[2].priority, 1);
    cr_assert_eq(rows[0].session, 7);
    cr_assert_eq(matchmaker_donors(m, 1, "c", "p", "d-2", rows, 64), 2, "without the asker");
    cr_assert_str_eq(rows[0].id, "d-9");
    cr_assert_eq(matchmaker_donors(m, 1, "c", "p", NULL, rows, 1), 1, "at most max");
    cr_assert_eq(matchmaker_donors(m, 1, "nobody", "p", NULL, rows, 64), 0, "unknown cohort");
    matchmaker_destroy(m);
}

Test(donors, declarations_expire_renew_and_withdraw)
{
    struct matchmaker *m = table();
    struct matchmaker_donor_row rows[4];
    char why[320];

    cr_assert_eq(declare(m, 100, "c", "a", "p", 1, 1000, why), 0);
    cr_assert_eq(declare(m, 100, "c", "b", "p", 2, 500, why), 0);
    cr_assert_eq(matchmaker_donors(m, 599, "c", "p", NULL, rows, 4), 2);
    cr_assert_eq(matchmaker_donors(m, 600, "c", "p", NULL, rows, 4), 1, "b expired");
    cr_assert_str_eq(rows[0].id, "a");
    /* A renewal replaces: a new priority, a new expiry, one row. */
    cr_assert_eq(declare(m, 1000, "c", "a", "p", 3, 1000, why), 0);
    cr_assert_eq(matchmaker_donors(m, 1500, "c", "p", NULL, rows, 4), 1);
    cr_assert_eq(rows[0].priority, 3);
    cr_assert_eq(matchmaker_donor_count(m, 1500, "c"), 1);
    cr_assert_eq(matchmaker_withdraw(m, 1500, "c", "p", "a"), 0);
    cr_assert_eq(matchmaker_withdraw(m, 1500, "c", "p", "a"), -ENOENT);
    cr_assert_eq(matchmaker_donors(m, 1500, "c", "p", NULL, rows, 4), 0);
    matchmaker_destroy(m);
}

Test(donors, caps_refuse_without_changing_anything)
{
    struct matchmaker *m = table();
    char why[320], id[32];

    for (unsigned i = 0; i < MATCHMAKER_DONORS_MAX; i++) {
        snprintf(id, sizeof(id), "m-%u", i);
        cr_assert_eq(declare(m, 0, "c", id, "p", i, 10000, why), 0);
    }
    cr_assert_eq(declare(m, 0, "c", "one-more", "p", 1, 10000, why), -ENOSPC);
    cr_assert(strstr(why, "too many state donors"), "%s", why);
    cr_assert_eq(matchmaker_donor_count(m, 0, "c"), MATCHMAKER_DONORS_MAX);
    cr_assert_eq(declare(m, 0, "c", "m-0", "p", 99, 10000, why), 0, "a renewal takes no room");
    cr_assert_eq(declare(m, 0, "other", "x", "p", 1, 10000, why), 0, "another cohort has room");
    /* Expired declarations free their room. */
    cr_assert_eq(declare(m, 10000, "c", "one-more", "p", 1, 10000, why), 0);
    cr_assert_eq(matchmaker_donor_count(m, 10000, "c"), 1);
    matchmaker_destroy(m);
}

Test(donors, bad_input_is_refused_with_the_reason)
{
    struct matchmaker *m = table();
    struct matchmaker_donor d = {
        .cohort = "c", .id = "a", .prefix = "p", .address = "127.0.0.1:1", .priority = 0,
        .expiry_ms = 1000,
    };
    char why[320];

    cr_assert_eq(declare(m, 0, "c", "a", "bad prefix!", 1, 1000, why), -EINVAL);
    cr_assert(strstr(why, "prefix"), "%s", why);
    cr_assert_eq(declare(m, 0, "c", "a", "p", NAN, 1000, why), -EINVAL);
    cr_assert(strstr(why, "finite"), "%s", why);
    cr_assert_eq(declare(m, 0, "c", "a", "p", INFINITY, 1000, why), -EINVAL);
    cr_assert_eq(declare(m, 0, "c", "a", "p", 1, 0, why), -EINVAL);
    cr_assert_eq(declare(m, 0, "c", "a", "p", 1, MATCHMAKER_EXPIRY_MAX_MS + 1, why), -EINVAL);
    cr_assert_eq(declare(m, 0, "c", "bad id!", "p", 1, 1000, why), -EINVAL);
    d.address = "nowhere";
    cr_assert_eq(matchmaker_declare(m, 0, &d, why, sizeof(why)), -EINVAL);
    d.address = "127.0.0.1:0";
    cr_assert_eq(matchmaker_declare(m, 0, &d, why, sizeof(why)), -EINVAL);
    cr_assert_eq(matchmaker_donor_count(m, 0, NULL), 0, "nothing was added");
    matchmaker_destroy(m);
}

/* ---- the StateDonors call ------------------------------------------------------ */

static struct brokerd *d;
static char broker[64];
static struct secret key;

static void start_broker(void)
{
    d = fixture_keyed_broker_start("avs", &key, broker, sizeof(broker));
}

static void stop_broker(void)
{
    fixture_broker_stop(d);
}

TestSuite(state_donors, .init = start_broker, .fini = stop_broker, .timeout = 120);

enum proving { NO_PROOF, WRONG_MAC, GOOD_PROOF };

static const char *raw_prefix = "run/avg";

static int raw_donors(const char *cohort, const char *id, enum proving how, struct rpc_status *st)
{
    Cohort__V1__StateDonorsRequest q = COHORT__V1__STATE_DONORS_REQUEST__INIT;
    Cohort__V1__Proof pf = COHORT__V1__PROOF__INIT;
    struct rpc_channel *ch = NULL;
    ProtobufCMessage *reply = NULL;
    uint8_t mac[32] = { 1 };
    int rc;

    q.protocol_version = WIRE_PROTOCOL_VERSION;
    q.cohort = (char *)cohort;
    q.id = (char *)id;
    q.session = 42;
    q.prefix = (char *)raw_prefix;
    q.declare = true;
    q.allow = true;
    q.priority = 1;
    q.expiry_ms = 1000;
    q.state_address = "127.0.0.1:9";
    if (how == GOOD_PROOF) {
        cr_assert_eq(proof_sign(&key, &q.base, 1, proof_now_ms(), &pf, mac), 0);
        q.proof = &pf;
    } else if (how == WRONG_MAC) {
        pf.seq = 1;
        pf.time_ms = 1;
        pf.mac.data = mac;
        pf.mac.len = sizeof(mac);
        q.proof = &pf;
    }
    cr_assert_eq(rpc_channel_create(broker, NULL, &ch), 0);
    rc = rpc_call(ch, WIRE_BROKER_STATE_DONORS, &q.base,
                  &cohort__v1__state_donors_reply__descriptor, FIXTURE_WAIT_MS,
                  RPC_WAIT_FOR_READY, &reply, st);
    if (reply)
        protobuf_c_message_free_unpacked(reply, NULL);
    rpc_channel_destroy(ch);
    return rc;
}

Test(state_donors, refused_without_a_proof_or_a_member)
{
    struct rpc_status st;

    cr_assert_lt(raw_donors("avs", "w-q", NO_PROOF, &st), 0);
    cr_assert_eq(st.code, RPC_UNAUTHENTICATED, "%s", st.message);
    cr_assert_lt(raw_donors("avs", "w-q", WRONG_MAC, &st), 0);
    cr_assert_eq(st.code, RPC_UNAUTHENTICATED, "a wrong MAC: %s", st.message);
    cr_assert_lt(raw_donors("avs", "w-q", GOOD_PROOF, &st), 0);
    cr_assert_eq(st.code, RPC_NOT_FOUND, "not a member: %s", st.message);
    cr_assert_lt(raw_donors("nope", "w-q", GOOD_PROOF, &st), 0);
    cr_assert_eq(st.code, RPC_NOT_FOUND, "unknown cohort: %s", st.message);
    cr_assert_lt(raw_donors("avs", "bad id!", GOOD_PROOF, &st), 0);
    cr_assert_eq(st.code, RPC_INVALID_ARGUMENT, "%s", st.message);
    raw_prefix = "no spaces here";
    cr_assert_lt(raw_donors("avs", "w-q", GOOD_PROOF, &st), 0);
    cr_assert_eq(st.code, RPC_INVALID_ARGUMENT, "%s", st.message);
    cr_assert(strstr(st.message, "prefix"), "%s", st.message);
}

/* ---- downloads ------------------------------------------------------------------- */

#define BLOB_BYTES ((size_t)600 << 10)       /* 10 parts of 64 KiB */
/* Each answer within IO_MS: long enough that an honest donor on a loaded
 * 2-core machine is never taken for a stalled one. */
#define IO_MS 3000u

static uint8_t *blob_of(int k)
{
    uint8_t *b = malloc(BLOB_BYTES);

    for (size_t i = 0; i < BLOB_BYTES; i++)
        b[i] = (uint8_t)(i * 31 + (size_t)k * 7 + i / 4096);
    return b;
}

/* A real server with the host's side on a thread of its own: it provides
 * blob whenever asked. */
struct donor {
    struct avstate_server *s;
    const uint8_t *blob;
    size_t len;
    pthread_t t;
    volatile bool stop;
};

static void *host_main(void *arg)
{
    struct donor *dn = arg;

    while (!dn->stop)
        if (avstate_server_wanted(dn->s, 50))
            avstate_server_provide(dn->s, dn->blob, dn->len);
    return NULL;
}

static void donor_start(struct donor *dn, const char *id, const struct secret *k,
                        const uint8_t *blob, size_t len, bool allow)
{
    struct avstate_server_config c = {
        .cohort = "avs", .id = id, .host = "127.0.0.1", .key = k, .io_timeout_ms = 2 * IO_MS,
        .provide_timeout_ms = IO_MS / 2,
    };

    dn->blob = blob;
    dn->len = len;
    dn->stop = false;
    cr_assert_eq(avstate_server_start(&c, &dn->s), 0);
    avstate_server_allow(dn->s, allow);
    cr_assert_eq(pthread_create(&dn->t, NULL, host_main, dn), 0);
}

static void donor_stop(struct donor *dn)
{
    dn->stop = true;
    pthread_join(dn->t, NULL);
    avstate_server_stop(dn->s);
}

static int load(const struct avstate_donor *ds, size_t n, uint32_t timeout_ms, void **out,
                size_t *len, char *why)
{
    struct avstate_load_config lc = {
        .cohort = "avs", .id = "newcomer", .key = &key, .timeout_ms = timeout_ms,
        .io_timeout_ms = IO_MS,
    };

    return avstate_load(&lc, ds, n, out, len, why, 1024);
}

static void start_key(void)
{
    cr_assert_eq(secret_generate(&key), 0);
}

TestSuite(avstate, .init = start_key, .timeout = 120);

Test(avstate, one_donor_serves_every_part_exactly)
{
    uint8_t *b = blob_of(1);
    struct donor dn;
    void *out = NULL;
    size_t len = 0;
    char why[1024];

    donor_start(&dn, "d-1", &key, b, BLOB_BYTES, true);
    struct avstate_donor ds[] = { { "d-1", avstate_server_address(dn.s), 1 } };
    cr_assert_eq(load(ds, 1, 10000, &out, &len, why), 0, "%s", why);
    cr_assert_eq(len, BLOB_BYTES);
    cr_assert_eq(memcmp(out, b, len), 0);
    cr_assert_eq(avstate_server_parts_served(dn.s), 10);
    free(out);
    donor_stop(&dn);
    free(b);
}

Test(avstate, equal_donors_split_the_parts_and_the_best_priority_wins)
{
    uint8_t *b = blob_of(2), *other = blob_of(3);
    struct donor dn[3], low;
    void *out = NULL;
    size_t len = 0;
    char why[1024];

    for (int i = 0; i < 3; i++)
        donor_start(&dn[i], i == 0 ? "e-0" : i == 1 ? "e-1" : "e-2", &key, b, BLOB_BYTES, true);
    donor_start(&low, "low", &key, other, BLOB_BYTES, true);
    struct avstate_donor ds[] = {
        { "e-0", avstate_server_address(dn[0].s), 5 },
        { "e-1", avstate_server_address(dn[1].s), 5 },
        { "e-2", avstate_server_address(dn[2].s), 5 },
        { "low", avstate_server_address(low.s), 1 },
    };
    cr_assert_eq(load(ds, 4, 10000, &out, &len, why), 0, "%s", why);
    cr_assert_eq(memcmp(out, b, BLOB_BYTES), 0);
    for (int i = 0; i < 3; i++)
        cr_assert_geq(avstate_server_parts_served(dn[i].s), 3, "donor %d", i);
    cr_assert_eq(avstate_server_parts_served(dn[0].s) + avstate_server_parts_served(dn[1].s) +
                     avstate_server_parts_served(dn[2].s), 10);
    cr_assert_eq(avstate_server_parts_served(low.s), 0, "the lower priority is not asked");
    free(out);
    for (int i = 0; i < 3; i++)
        donor_stop(&dn[i]);
    donor_stop(&low);
    free(b);
    free(other);
}

Test(avstate, the_state_most_equal_donors_declare_is_taken_whole)
{
    uint8_t *b = blob_of(4), *odd = blob_of(5);
    struct donor dn[3];
    void *out = NULL;
    size_t len = 0;
    char why[1024];

    donor_start(&dn[0], "m-0", &key, b, BLOB_BYTES, true);
    donor_start(&dn[1], "m-1", &key, odd, BLOB_BYTES, true);
    donor_start(&dn[2], "m-2", &key, b, BLOB_BYTES, true);
    struct avstate_donor ds[] = {
        { "m-0", avstate_server_address(dn[0].s), 5 },
        { "m-1", avstate_server_address(dn[1].s), 5 },
        { "m-2", avstate_server_address(dn[2].s), 5 },
    };
    for (int round = 0; round < 5; round++) {
        cr_assert_eq(load(ds, 3, 10000, &out, &len, why), 0, "%s", why);
        cr_assert_eq(memcmp(out, b, BLOB_BYTES), 0, "never the minority's, never a mix");
        free(out);
    }
    cr_assert_eq(avstate_server_parts_served(dn[1].s), 0);
    for (int i = 0; i < 3; i++)
        donor_stop(&dn[i]);
    free(b);
    free(odd);
}

Test(avstate, sharing_off_no_donor_and_a_wrong_key_give_nothing)
{
    uint8_t *b = blob_of(6);
    struct secret other;
    struct donor off, foreign;
    void *out = NULL;
    size_t len = 0;
    char why[1024];

    cr_assert_eq(load(NULL, 0, 1000, &out, &len, why), -ENODATA);
    cr_assert(strstr(why, "no averager"), "%s", why);
    cr_assert_eq(secret_generate(&other), 0);
    donor_start(&off, "off", &key, b, BLOB_BYTES, false);
    donor_start(&foreign, "foreign", &other, b, BLOB_BYTES, true);
    struct avstate_donor ds[] = {
        { "off", avstate_server_address(off.s), 5 },
        { "foreign", avstate_server_address(foreign.s), 4 },
    };
    cr_assert_eq(load(ds, 2, 5000, &out, &len, why), -ENODATA);
    cr_assert(strstr(why, "off: does not share"), "%s", why);
    cr_assert(strstr(why, "foreign: did not prove the cohort's key"), "%s", why);
    cr_assert_eq(avstate_server_parts_served(foreign.s), 0);
    /* Named as another id, a real donor refuses. */
    struct avstate_donor wrong[] = { { "someone-else", avstate_server_address(off.s), 5 } };
    avstate_server_allow(off.s, true);
    cr_assert_eq(load(wrong, 1, 5000, &out, &len, why), -ENODATA);
    cr_assert(strstr(why, "refused"), "%s", why);
    donor_stop(&off);
    donor_stop(&foreign);
    free(b);
}

/* ---- donors that lie ----------------------------------------------------------- */

enum lie { LIE_PART, LIE_MAC, LIE_SIZE, LIE_STALL_PARTS };

/* A donor that speaks the protocol with the cohort's key and lies as
 * told, declaring the honest blob's manifest. */
struct liar {
    enum lie how;
    const uint8_t *blob;
    size_t len;
    int lfd;
    char address[64];
    pthread_t t;
    volatile bool stop;
};

static int full(int fd, void *p, size_t n, bool out)
{
    uint8_t *c = p;

    while (n > 0) {
        ssize_t r = out ? send(fd, c, n, MSG_NOSIGNAL) : recv(fd, c, n, 0);

        if (r <= 0)
            return -1;
        c += r;
        n -= (size_t)r;
    }
    return 0;
}

static void put32(uint8_t *p, uint32_t v)
{
    memcpy(p, &v, 4);           /* little-endian hosts only, as cohort */
}

static void lie_once(struct liar *l, int fd)
{
    uint8_t hello[44], ch[72], confirm[32], req[40], *digests = NULL, root[32];
    char names[3][256];
    uint32_t pb, n;

    if (full(fd, hello, sizeof(hello), false) < 0)
        return;
    for (int i = 0; i < 3; i++) {
        uint16_t len = (uint16_t)(hello[4 + 2 * i] | hello[5 + 2 * i] << 8);

        if (len > 253 || full(fd, names[i], len, false) < 0)
            return;
        names[i][len] = '\0';
    }
    memset(ch, 0, sizeof(ch));
    put32(ch, AVSTATE_MAGIC);
    ch[8] = 42;
    cr_assert_eq(avstate_mac(&key, "accept", names[0], names[1], names[2], hello + 12, ch + 8,
                             NULL, 0, ch + 40), 0);
    if (full(fd, ch, sizeof(ch), true) < 0 || full(fd, confirm, sizeof(confirm), false) < 0)
        return;
    cr_assert_eq(avstate_manifest(l->blob, l->len, &pb, &n, &digests, root), 0);
    while (!l->stop && full(fd, req, sizeof(req), false) == 0) {
        uint32_t op, part;

        memcpy(&op, req, 4);
        memcpy(&part, req + 4, 4);
        if (op == AVSTATE_OP_MANIFEST) {
            size_t ml = 56 + (size_t)n * 32 + 32;
            uint8_t *m = calloc(1, ml);
            uint64_t total = l->how == LIE_SIZE ? (uint64_t)1 << 40 : l->len;

            put32(m + 4, pb);
            memcpy(m + 8, &total, 8);
            put32(m + 16, n);
            memcpy(m + 24, root, 32);
            memcpy(m + 56, digests, (size_t)n * 32);
            cr_assert_eq(avstate_mac(&key, "manifest", names[0], names[1], names[2],
                                     hello + 12, ch + 8, m, 56 + (size_t)n * 32,
                                     m + 56 + (size_t)n * 32), 0);
            if (l->how == LIE_MAC)
                m[56 + (size_t)n * 32] ^= 1;
            if (full(fd, m, ml, true) < 0) {
                free(m);
                break;
            }
            free(m);
        } else {
            size_t off = (size_t)part * pb, len = l->len - off < pb ? l->len - off : pb;
            uint8_t hdr[8] = { 0 }, *bytes = malloc(len);

            if (l->how == LIE_STALL_PARTS) {
                /* Silent for 1.5 s, then gone: the downloader leaves it
                 * at its io timeout or at the close, whichever is first. */
                for (int i = 0; i < 150 && !l->stop; i++)
                    usleep(10000);
                free(bytes);
                break;
            }
            memcpy(bytes, l->blob + off, len);
            bytes[len / 2] ^= 0x5a;         /* one byte off */
            put32(hdr + 4, (uint32_t)len);
            if (full(fd, hdr, 8, true) < 0 || full(fd, bytes, len, true) < 0) {
                free(bytes);
                break;
            }
            free(bytes);
        }
    }
    free(digests);
}

static void *liar_main(void *arg)
{
    struct liar *l = arg;

    while (!l->stop) {
        struct pollfd p = { .fd = l->lfd, .events = POLLIN };
        int fd;

        if (poll(&p, 1, 50) <= 0)
            continue;
        fd = accept(l->lfd, NULL, NULL);
        if (fd < 0)
            continue;
        lie_once(l, fd);
        close(fd);
    }
    return NULL;
}

static void liar_start(struct liar *l, enum lie how, const uint8_t *blob, size_t len)
{
    l->how = how;
    l->blob = blob;
    l->len = len;
    l->stop = false;
    cr_assert_eq(allreduce_listen("127.0.0.1", &l->lfd, l->address, sizeof(l->address)), 0);
    cr_assert_eq(pthread_create(&l->t, NULL, liar_main, l), 0);
}

static void liar_stop(struct liar *l)
{
    l->stop = true;
    pthread_join(l->t, NULL);
    close(l->lfd);
}

/* A liar and an honest donor of equal priority and the same state: the
 * liar's share is fetched from the honest one, and the result is exact. */
static void liar_against_honest(enum lie how, const char *sentence)
{
    uint8_t *b = blob_of(7);
    struct liar l;
    struct donor honest;
    void *out = NULL;
    size_t len = 0;
    char why[1024];

    liar_start(&l, how, b, BLOB_BYTES);
    donor_start(&honest, "honest", &key, b, BLOB_BYTES, true);
    struct avstate_donor ds[] = {
        { "liar", l.address, 5 },
        { "honest", avstate_server_address(honest.s), 5 },
    };
    for (int round = 0; round < 3; round++) {
        cr_assert_eq(load(ds, 2, 20000, &out, &len, why), 0, "%s", why);
        cr_assert_eq(len, BLOB_BYTES);
        cr_assert_eq(memcmp(out, b, BLOB_BYTES), 0, "nothing of the liar's is kept");
        free(out);
    }
    cr_assert_eq(avstate_server_parts_served(honest.s) >= 10, true);
    /* Alone, the liar yields nothing, and the reason names it. */
    cr_assert_eq(load(ds, 1, 20000, &out, &len, why), -ENODATA, "%s", why);
    cr_assert(strstr(why, sentence), "%s", why);
    liar_stop(&l);
    donor_stop(&honest);
    free(b);
}

Test(avstate, a_part_that_does_not_match_its_digest_is_fetched_from_another)
{
    liar_against_honest(LIE_PART, "liar: sent a part that does not match the digest");
}

Test(avstate, a_manifest_without_the_keys_mac_is_refused)
{
    liar_against_honest(LIE_MAC, "liar: sent a manifest without the cohort's MAC");
}

Test(avstate, a_size_over_the_cap_is_refused_before_anything_is_allocated)
{
    liar_against_honest(LIE_SIZE, "liar: declared a state too large");
}

Test(avstate, a_donor_that_stalls_during_parts_is_left_for_another)
{
    uint64_t t0 = clock_now_ms();

    /* Alone, the liar is still busy stalling an earlier connection or
     * stalls this one: either way the reason names it. */
    liar_against_honest(LIE_STALL_PARTS, "liar: ");
    /* Each stall costs 1.5 s, well within the io timeout. */
    cr_assert_lt(clock_now_ms() - t0, 60000);
}

Test(avstate, a_donor_that_never_answers_is_left_within_the_timeout)
{
    uint8_t *b = blob_of(8);
    struct donor honest;
    char address[64];
    void *out = NULL;
    size_t len = 0;
    char why[1024];
    int lfd;
    uint64_t t0;

    /* Listening, never accepting: connects, then silence. */
    cr_assert_eq(allreduce_listen("127.0.0.1", &lfd, address, sizeof(address)), 0);
    donor_start(&honest, "honest", &key, b, BLOB_BYTES, true);
    struct avstate_donor ds[] = {
        { "silent", address, 9 },
        { "honest", avstate_server_address(honest.s), 1 },
    };
    t0 = clock_now_ms();
    cr_assert_eq(load(ds, 2, 30000, &out, &len, why), 0, "%s", why);
    cr_assert_eq(memcmp(out, b, BLOB_BYTES), 0);
    /* One io timeout for the silent one, then the honest one's load. */
    cr_assert_lt(clock_now_ms() - t0, 20000);
    free(out);
    t0 = clock_now_ms();
    cr_assert_eq(load(ds, 1, 1500, &out, &len, why), -ETIMEDOUT);
    cr_assert(strstr(why, "silent: no answer to the hello"), "%s", why);
    cr_assert_lt(clock_now_ms() - t0, 10000, "the whole download's timeout bounds it");
    close(lfd);
    donor_stop(&honest);
    free(b);
}

/* The flag a download is cancelled by, raised from another thread after
 * `after_ms`, as an averager_abort() from a sidecar's watcher would. */
struct raiser {
    atomic_bool flag;
    uint32_t after_ms;
    pthread_t t;
};

static void *raise_main(void *arg)
{
    struct raiser *r = arg;
    struct timespec ts = { .tv_sec = r->after_ms / 1000,
                           .tv_nsec = (long)(r->after_ms % 1000) * 1000000L };

    nanosleep(&ts, NULL);
    atomic_store(&r->flag, true);
    return NULL;
}

/* A download from a donor that never answers, with an io timeout of a
 * minute, ends within a poll slice of its cancel flag rising, with
 * -ECANCELED and a sentence; one whose flag is up already connects to
 * nobody. */
Test(avstate, a_cancelled_download_ends_within_a_second)
{
    struct raiser r = { .after_ms = 300 };
    struct avstate_load_config lc = {
        .cohort = "avs", .id = "newcomer", .key = &key, .timeout_ms = 120000,
        .io_timeout_ms = 60000, .cancel = &r.flag,
    };
    char address[64], why[1024];
    void *out = NULL;
    size_t len = 0;
    uint64_t t0;
    int lfd, rc;

    /* Listening, never accepting: connects, then silence. */
    cr_assert_eq(allreduce_listen("127.0.0.1", &lfd, address, sizeof(address)), 0);
    struct avstate_donor ds[] = { { "silent", address, 9 } };
    atomic_init(&r.flag, false);
    cr_assert_eq(pthread_create(&r.t, NULL, raise_main, &r), 0);
    t0 = clock_now_ms();
    rc = avstate_load(&lc, ds, 1, &out, &len, why, sizeof(why));
    pthread_join(r.t, NULL);
    cr_assert_eq(rc, -ECANCELED, "%d: %s", rc, why);
    cr_assert(strstr(why, "cancelled"), "%s", why);
    cr_assert_null(out);
    /* The flag rose at 300 ms; a poll slice is 1 s. */
    cr_assert_lt(clock_now_ms() - t0, 5000, "not its io timeout of a minute");
    t0 = clock_now_ms();
    cr_assert_eq(avstate_load(&lc, ds, 1, &out, &len, why, sizeof(why)), -ECANCELED);
    cr_assert_lt(clock_now_ms() - t0, 1000);
    close(lfd);
}

/* ---- averagers end to end, through the broker ------------------------------------ */

TestSuite(averager_state, .init = start_broker, .fini = stop_broker, .timeout = 120);

static struct averager *make_averager(const char *id, bool share, double priority)
{
    struct averager_config c = {
        .broker = broker, .cohort = "avs", .id = id, .host = "127.0.0.1", .key = &key,
        .prefix = "run/state", .target_group_size = 2, .min_group_size = 2,
        .min_matchmaking_ms = 300, .request_timeout_ms = 2000, .count = 4,
        .share_state = share, .state_priority = priority, .declare_period_ms = 1000,
    };
    struct averager *a = NULL;

    cr_assert_eq(averager_create(&c, &a), 0, "averager_create(%s)", id);
    cr_assert_eq(averager_wait(a, FIXTURE_WAIT_MS), 0);
    return a;
}

struct host {
    struct averager *a;
    const uint8_t *blob;
    size_t len;
    pthread_t t;
    volatile bool stop;
};

static void *avg_host_main(void *arg)
{
    struct host *h = arg;

    while (!h->stop)
        if (averager_state_wanted(h->a, 50))
            averager_provide_state(h->a, h->blob, h->len);
    return NULL;
}

struct loaded {
    struct averager *a;
    const uint8_t *want;
};

/* True once a load gets exactly `want`. */
static bool loads(void *arg)
{
    struct loaded *l = arg;
    void *out = NULL;
    size_t len = 0;
    bool same;

    if (averager_load_state(l->a, 10000, &out, &len) < 0)
        return false;
    same = len == BLOB_BYTES && memcmp(out, l->want, len) == 0;
    free(out);
    return same;
}

/* True once a load finds no donor at all (the broker heard every
 * withdrawal; until then a donor that stopped refuses by itself). */
static bool nobody_shares(void *arg)
{
    struct averager *a = arg;
    void *out = NULL;
    size_t len = 0;
    int rc = averager_load_state(a, 3000, &out, &len);

    free(out);
    return rc == -ENODATA && strstr(averager_load_error(a), "no averager of this prefix shares");
}

/* averager_abort() cancels state downloads too: one after it fails at
 * once, with the reason, and asks the broker nothing. */
Test(averager_state, an_aborted_averager_loads_nothing)
{
    struct averager *a = make_averager("gone", false, 0);
    void *out = NULL;
    size_t len = 0;

    averager_abort(a);
    cr_assert_eq(averager_load_state(a, 60000, &out, &len), -ECANCELED);
    cr_assert(strstr(averager_load_error(a), "cancelled"), "%s", averager_load_error(a));
    cr_assert_null(out);
    averager_destroy(a);
}

Test(averager_state, a_newcomer_loads_the_sharing_donor_and_follows_its_setting)
{
    uint8_t *b = blob_of(11), *c = blob_of(12);
    struct averager *shy = make_averager("shy", false, 50);
    struct averager *donor = make_averager("donor", true, 1);
    struct averager *other = make_averager("other", true, 0);
    struct averager *new = make_averager("new", false, 0);
    struct host hd = { .a = donor, .blob = b, .len = BLOB_BYTES };
    struct host ho = { .a = other, .blob = c, .len = BLOB_BYTES };
    struct host hs = { .a = shy, .blob = c, .len = BLOB_BYTES };
    struct loaded l = { .a = new, .want = b };
    bool share;
    double priority;

    cr_assert_eq(pthread_create(&hd.t, NULL, avg_host_main, &hd), 0);
    cr_assert_eq(pthread_create(&ho.t, NULL, avg_host_main, &ho), 0);
    cr_assert_eq(pthread_create(&hs.t, NULL, avg_host_main, &hs), 0);
    cr_assert(fixture_wait_until(loads, &l, FIXTURE_WAIT_MS), "%s", averager_load_error(new));
    cr_assert_eq(averager_state_parts_served(shy), 0, "not sharing: never asked");
    cr_assert_eq(averager_state_parts_served(other), 0, "a lower priority: not asked");
    /* The donor stops sharing: the other is next. */
    cr_assert_eq(averager_set_state_sharing(donor, false, 1), 0);
    averager_state_sharing(donor, &share, &priority);
    cr_assert(!share && priority == 1);
    l.want = c;
    cr_assert(fixture_wait_until(loads, &l, FIXTURE_WAIT_MS), "%s", averager_load_error(new));
    cr_assert_eq(averager_set_state_sharing(donor, true, NAN), -EINVAL);
    /* Nobody shares: nothing, and the sentence says so. */
    cr_assert_eq(averager_set_state_sharing(other, false, 0), 0);
    cr_assert(fixture_wait_until(nobody_shares, new, FIXTURE_WAIT_MS), "%s",
              averager_load_error(new));
    cr_assert_eq(averager_state_parts_served(shy), 0);
    hd.stop = ho.stop = hs.stop = true;
    pthread_join(hd.t, NULL);
    pthread_join(ho.t, NULL);
    pthread_join(hs.t, NULL);
    averager_destroy(new);
    averager_destroy(other);
    averager_destroy(donor);
    averager_destroy(shy);
    free(b);
    free(c);
}

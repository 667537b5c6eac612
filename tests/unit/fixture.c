/* tests/unit/fixture.c: see fixture.h. */
#include "fixture.h"

#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "accumulator/node.h"
#include "base/clock.h"
#include "base/secret.h"
#include "membership/brokerd.h"
#include "rpc/rpc.h"

/* ---- waiting ---- */

uint64_t fixture_deadline(uint32_t within_ms)
{
    return clock_now_ms() + within_ms;
}

bool fixture_before(uint64_t deadline)
{
    return clock_now_ms() < deadline;
}

bool fixture_wait_until(bool (*pred)(void *arg), void *arg, uint32_t within_ms)
{
    uint64_t end = fixture_deadline(within_ms);

    while (!pred(arg) && fixture_before(end))
        clock_sleep_ms(FIXTURE_POLL_MS);
    return pred(arg);
}

/* ---- a broker service on loopback ---- */

void fixture_broker_config(struct brokerd_config *cfg)
{
    *cfg = (struct brokerd_config){ .listen = "127.0.0.1:0", .open = true };
    broker_config_default(&cfg->broker);
    cfg->broker.startup_hold_ms = 0;
    cfg->broker.heartbeat_ms = 200;
    cfg->broker.timeout_ms = 1500;
    cfg->broker.coalesce_ms = 20;
}

struct brokerd *fixture_broker_start_with(const struct brokerd_config *cfg, const char *cohort,
                                          char *addr, size_t addr_len)
{
    struct brokerd *d;

    cr_assert_eq(rpc_init(), 0);
    cr_assert_eq(brokerd_start(cfg, &d), 0);
    cr_assert_eq(brokerd_declare(d, cohort, 0, 0), 0);
    snprintf(addr, addr_len, "127.0.0.1:%d", brokerd_port(d));
    return d;
}

struct brokerd *fixture_broker_start(const char *cohort, char *addr, size_t addr_len)
{
    struct brokerd_config cfg;

    fixture_broker_config(&cfg);
    return fixture_broker_start_with(&cfg, cohort, addr, addr_len);
}

struct brokerd *fixture_held_broker_start(const char *cohort, char *addr, size_t addr_len)
{
    struct brokerd_config cfg;

    fixture_broker_config(&cfg);
    cfg.broker.startup_hold_ms = FIXTURE_START_HOLD_MS;
    return fixture_broker_start_with(&cfg, cohort, addr, addr_len);
}

struct brokerd *fixture_keyed_broker_start(const char *cohort, struct secret *key, char *addr,
                                           size_t addr_len)
{
    struct brokerd_config cfg;

    cr_assert_eq(secret_generate(key), 0);
    fixture_broker_config(&cfg);
    cfg.open = false;
    cfg.key = key;
    return fixture_broker_start_with(&cfg, cohort, addr, addr_len);
}

void fixture_broker_stop(struct brokerd *d)
{
    brokerd_stop(d);
    rpc_shutdown();
}

/* ---- a node's trainer ---- */

void fixture_node_trade_state(struct node *n, const struct node_view *v)
{
    void *s;
    size_t len;

    if (v->wants_state)
        node_set_state(n, "s", 1);
    if (v->has_new_state && node_take_state(n, &s, &len) == 0)
        free(s);
}

/* ---- TLS ---- */

/* Everything fixture_tls_make() leaves in its directory. */
static const char *const tls_files[] = { "ca.pem", "ca.key", "other.pem", "other.key",
                                         "server.pem", "server.key", "server.csr", "ca.srl" };

static char *read_pem(const char *dir, const char *name)
{
    char path[128];
    char *pem = NULL;

    snprintf(path, sizeof(path), "%s/%s", dir, name);
    cr_assert_eq(rpc_pem_load(path, &pem), 0, "cannot read %s", path);
    return pem;
}

void fixture_tls_make(struct fixture_tls *t)
{
    char cmd[2048];

    memset(t, 0, sizeof(*t));
    snprintf(t->dir, sizeof(t->dir), "/tmp/cohort-tls-XXXXXX");
    cr_assert_not_null(mkdtemp(t->dir));
    snprintf(cmd, sizeof(cmd),
             "(cd %s && "
             "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes "
             "-keyout ca.key -out ca.pem -days 2 -subj /CN=cohort-test-ca && "
             "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes "
             "-keyout other.key -out other.pem -days 2 -subj /CN=cohort-other-ca && "
             "openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes "
             "-keyout server.key -out server.csr -subj /CN=" FIXTURE_TLS_NAME " "
             "-addext subjectAltName=DNS:" FIXTURE_TLS_NAME " && "
             "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial "
             "-out server.pem -days 2 -copy_extensions copy) >/dev/null 2>&1",
             t->dir);
    cr_assert_eq(system(cmd), 0, "openssl could not make the test certificates");
    t->ca = read_pem(t->dir, "ca.pem");
    t->other_ca = read_pem(t->dir, "other.pem");
    t->cert = read_pem(t->dir, "server.pem");
    t->key = read_pem(t->dir, "server.key");
}

void fixture_tls_cleanup(struct fixture_tls *t)
{
    char path[128];

    rpc_pem_free(t->ca);
    rpc_pem_free(t->other_ca);
    rpc_pem_free(t->cert);
    rpc_pem_free(t->key);
    for (size_t i = 0; i < sizeof(tls_files) / sizeof(tls_files[0]); i++) {
        snprintf(path, sizeof(path), "%s/%s", t->dir, tls_files[i]);
        unlink(path);
    }
    rmdir(t->dir);
    memset(t, 0, sizeof(*t));
}

/* ---- the broker state machine under a fake host ---- */

struct broker *fixture_sm;
struct fixture_host fixture_host;

static void host_publish(void *arg, struct epoch *e, void *const *w, size_t n)
{
    struct fixture_pub *p;

    cr_assert_eq(arg, &fixture_host);
    cr_assert_lt(fixture_host.n_pubs, FIXTURE_MAX_REC);
    p = &fixture_host.pubs[fixture_host.n_pubs++];
    p->e = epoch_ref(e);
    p->n = n;
    for (size_t i = 0; i < n && i < FIXTURE_MAX_W; i++)
        p->w[i] = w[i];
}

static void host_detach(void *arg, void *watcher, int err)
{
    cr_assert_eq(arg, &fixture_host);
    cr_assert_lt(fixture_host.n_dets, FIXTURE_MAX_REC);
    fixture_host.dets[fixture_host.n_dets++] = (struct fixture_det){ .w = watcher, .err = err };
}

const struct broker_watch_ops fixture_host_ops = {
    .publish = host_publish,
    .detach = host_detach,
    .arg = &fixture_host,
};

void fixture_sm_stop(void)
{
    broker_destroy(fixture_sm);
    fixture_sm = NULL;
    for (size_t i = 0; i < fixture_host.n_pubs; i++)
        epoch_unref(fixture_host.pubs[i].e);
    memset(&fixture_host, 0, sizeof(fixture_host));
}

/* Declared here, once, so that it covers the tests of every
 * test_broker_*.c file. */
TestSuite(broker, .fini = fixture_sm_stop);

void fixture_sm_start(const struct broker_config *cfg)
{
    struct broker_config def;

    broker_config_default(&def);
    /* The suites' times are written against a 2 s hold (FIXTURE_HOLD);
     * the default's own is tested in test_broker_restarts.c. */
    def.startup_hold_ms = FIXTURE_HOLD - FIXTURE_T0;
    cr_assert_eq(broker_create(cfg ? cfg : &def, &fixture_host_ops, FIXTURE_T0, &fixture_sm), 0);
    cr_assert_eq(broker_cohort_declare(fixture_sm, "demo", 0, 0), 0);
}

void fixture_sm_start_ab(void)
{
    fixture_sm_start(NULL);
    cr_assert_eq(fixture_sm_join("a", 1, 11, FIXTURE_T0), 0);
    cr_assert_eq(fixture_sm_join("b", 1, 12, FIXTURE_T0), 0);
    broker_tick(fixture_sm, FIXTURE_HOLD);
    cr_assert_eq(fixture_host.n_pubs, 1);
    cr_assert_eq(fixture_sm_last_pub()->number, 1);
}

int fixture_sm_join_full(const char *cohort, const char *id, const char *address,
                         uint64_t version, uint64_t session, uint64_t last_epoch, uint64_t now)
{
    struct broker_join j = {
        .cohort = cohort,
        .id = id,
        .address = address,
        .model_version = version,
        .session = session,
        .last_epoch = last_epoch,
    };
    struct broker_join_result res;

    return broker_join(fixture_sm, now, &j, &res);
}

int fixture_sm_join(const char *id, uint64_t version, uint64_t session, uint64_t now)
{
    return fixture_sm_join_full("demo", id, FIXTURE_ADDR, version, session, 0, now);
}

uint64_t fixture_sm_join_timed(const struct broker_join *j, uint64_t now, uint32_t heartbeat_ms,
                               uint32_t timeout_ms)
{
    struct broker_join_result res;

    cr_assert_eq(broker_join(fixture_sm, now, j, &res), 0);
    cr_assert_eq(res.heartbeat_ms, heartbeat_ms);
    cr_assert_eq(res.timeout_ms, timeout_ms);
    return res.epoch;
}

int fixture_sm_beat(uint64_t now, const char *cohort, const char *id, uint64_t session,
                    uint64_t version, bool declare, uint64_t *epoch)
{
    struct broker_beat hb = { .model_version = version, .declare = declare };
    struct broker_beat_result res;
    int rc = broker_heartbeat(fixture_sm, now, cohort, id, session, &hb, &res);

    if (rc == 0 && epoch)
        *epoch = res.epoch;
    return rc;
}

bool fixture_sm_beat_adopted(const char *id, uint64_t session, uint64_t now, uint64_t adopted)
{
    struct broker_beat hb = { .model_version = 1, .adopted = adopted };
    struct broker_beat_result res;

    cr_assert_eq(broker_heartbeat(fixture_sm, now, "demo", id, session, &hb, &res), 0);
    return res.drained;
}

size_t fixture_sm_tick_members(uint64_t now)
{
    broker_tick(fixture_sm, now);
    return fixture_sm_members("demo");
}

struct epoch *fixture_sm_last_pub(void)
{
    cr_assert_gt(fixture_host.n_pubs, 0);
    return fixture_host.pubs[fixture_host.n_pubs - 1].e;
}

void fixture_sm_assert_published_to(size_t n, void *const *w)
{
    const struct fixture_pub *p;

    cr_assert_gt(fixture_host.n_pubs, 0);
    p = &fixture_host.pubs[fixture_host.n_pubs - 1];
    cr_assert_eq(p->n, n, "epoch %llu went to %zu watchers, want %zu",
                 (unsigned long long)p->e->number, p->n, n);
    for (size_t i = 0; i < n; i++)
        cr_assert_eq(p->w[i], w[i], "watcher %zu", i);
}

void fixture_sm_assert_detached(int err, size_t n, void *const *w)
{
    cr_assert_eq(fixture_host.n_dets, n, "%zu detaches, want %zu", fixture_host.n_dets, n);
    for (size_t i = 0; i < n; i++) {
        cr_assert_eq(fixture_host.dets[i].w, w[i], "detach %zu", i);
        cr_assert_eq(fixture_host.dets[i].err, err, "detach %zu", i);
    }
}

void fixture_sm_assert_members(const struct epoch *e, size_t n, const char *const *ids)
{
    cr_assert_eq(e->n_members, n, "epoch %llu has %zu members, want %zu",
                 (unsigned long long)e->number, e->n_members, n);
    for (size_t i = 0; i < n; i++)
        cr_assert_str_eq(e->members[i].id, ids[i]);
}

const char *fixture_sm_leader(const struct epoch *e)
{
    cr_assert_gt(e->n_members, 0);
    return e->members[e->leader].id;
}

uint64_t fixture_sm_epoch(const char *cohort)
{
    struct broker_status *s;
    uint64_t epoch;

    cr_assert_eq(broker_status(fixture_sm, cohort, &s), 0);
    cr_assert_eq(s->n_cohorts, 1);
    epoch = s->cohorts[0].epoch;
    broker_status_free(s);
    return epoch;
}

size_t fixture_sm_members(const char *cohort)
{
    struct broker_status *s;
    size_t n;

    cr_assert_eq(broker_status(fixture_sm, cohort, &s), 0);
    n = s->cohorts[0].n_members;
    broker_status_free(s);
    return n;
}

void fixture_sm_watch_a_b_and_other_c(void *wa, void *wb, void *wc)
{
    cr_assert_eq(broker_cohort_declare(fixture_sm, "other", 0, 0), 0);
    cr_assert_eq(fixture_sm_join_full("other", "c", FIXTURE_ADDR, 0, 13, 0, FIXTURE_T0), 0);
    cr_assert_eq(broker_watch(fixture_sm, "demo", "a", 11, wa), 0);
    cr_assert_eq(broker_watch(fixture_sm, "demo", "b", 12, wb), 0);
    cr_assert_eq(broker_watch(fixture_sm, "other", "c", 13, wc), 0);
}

void fixture_sm_add_c(void)
{
    cr_assert_eq(fixture_sm_join("c", 0, 13, FIXTURE_HOLD + 10), 0);
    broker_tick(fixture_sm, FIXTURE_HOLD + 60);
    cr_assert_eq(fixture_sm_last_pub()->number, 2);
}

/* tests/unit/test_kubeops.c: the operator's Kubernetes machinery that needs
 * real API semantics (reflector, Lease election, the broker's CA in a
 * Secret), against the stand-in API server in tests/kube/apiserver.py,
 * started per test on a free port. */
#include <criterion/criterion.h>
#include <errno.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <pthread.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include "base/clock.h"
#include "fixture.h"
#include "k8s/brokertls.h"
#include "k8s/kube.h"
#include "k8s/lease.h"
#include "k8s/reflector.h"

static pid_t server;
static char url[64];
static struct kube *k;

/* The port the stand-in wrote to `path`, or 0 while it has not (yet). */
static int read_port(const char *path)
{
    FILE *f = fopen(path, "r");
    int port = 0;

    if (f) {
        if (fscanf(f, "%d", &port) != 1)
            port = 0;
        fclose(f);
    }
    return port;
}

/* Starts the stand-in with extra flags; the port comes back in a file. */
static void start_server(const char *history, const char *bookmarks)
{
    char portfile[] = "/tmp/cohort-apiport-XXXXXX";
    int fd = mkstemp(portfile), port;
    char *argv[] = { "python3", "tests/kube/apiserver.py", "--port-file", portfile, "--quiet",
                     "--history-size", (char *)history, "--bookmark-interval", (char *)bookmarks,
                     NULL };
    struct kube_config c = { .namespace = "default" };

    close(fd);
    unlink(portfile);
    /* Fork, not spawn: the child asks to die with this test process, so a
     * test killed at its timeout leaves no server behind; and its output
     * goes nowhere, so it cannot hold a pipe of the test runner open. */
    server = fork();
    cr_assert_geq(server, 0);
    if (server == 0) {
        int null = open("/dev/null", O_RDWR);
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        dup2(null, STDIN_FILENO);
        dup2(null, STDOUT_FILENO);
        dup2(null, STDERR_FILENO);
        execvp("python3", argv);
        _exit(127);
    }
    FIXTURE_WAIT_FOR((port = read_port(portfile)) > 0, "the stand-in never wrote its port");
    unlink(portfile);
    snprintf(url, sizeof(url), "http://127.0.0.1:%d", port);
    c.server = url;
    cr_assert_eq(kube_create(&c, NULL, &k), 0);
}

/* Another client of the same server, for a second "replica". The caller
 * frees it with kube_destroy(). */
static struct kube *second_client(void)
{
    struct kube_config c = { .server = url, .namespace = "default" };
    struct kube *k2;

    cr_assert_eq(kube_create(&c, NULL, &k2), 0);
    return k2;
}

static void stop_server(void)
{
    kube_destroy(k);
    k = NULL;
    if (server > 0) {
        kill(server, SIGTERM);
        waitpid(server, NULL, 0);
    }
}

#define LEASES "/apis/coordination.k8s.io/v1/namespaces/default/leases"

static int create_lease(const char *name, const char *label)
{
    char body[512];
    snprintf(body, sizeof(body),
             "{\"apiVersion\":\"coordination.k8s.io/v1\",\"kind\":\"Lease\",\"metadata\":"
             "{\"name\":\"%s\",\"labels\":{\"app\":\"%s\"}},\"spec\":{\"holderIdentity\":\"x\"}}",
             name, label);
    cJSON *o = cJSON_Parse(body);
    int rc = kube_create_object(k, LEASES, o, NULL);
    cJSON_Delete(o);
    return rc;
}

/* ---- reflector ---- */

struct seen {
    atomic_int upserts, deletes;
};

static void on_upsert(void *arg, const char *key, const cJSON *obj)
{
    atomic_fetch_add(&((struct seen *)arg)->upserts, 1);
}

static void on_delete(void *arg, const char *key, const cJSON *obj)
{
    atomic_fetch_add(&((struct seen *)arg)->deletes, 1);
}

static bool cached(struct reflector *r, const char *key)
{
    cJSON *o = reflector_get(r, key);
    bool ok = o != NULL;
    cJSON_Delete(o);
    return ok;
}

/* A reflector of the server's Leases labelled app=cohort whose watches
 * last watch_timeout_s, counting its events in *s (borrowed), once it has
 * listed. The caller frees it with reflector_destroy(). */
static struct reflector *reflect(int watch_timeout_s, struct seen *s)
{
    struct reflector_config rc = { .kube = k, .path = LEASES, .selector = "app=cohort",
                                   .watch_timeout_s = watch_timeout_s, .on_upsert = on_upsert,
                                   .on_delete = on_delete, .arg = s };
    struct reflector *r;

    cr_assert_eq(reflector_start(&rc, &r), 0);
    cr_assert(reflector_wait_synced(r, FIXTURE_WAIT_MS));
    return r;
}

Test(kubeops, reflector_lists_then_follows_the_watch, .timeout = 90)
{
    struct seen s = { 0 };
    struct reflector *r;
    struct reflector_stats st;
    cJSON *all;

    start_server("1000", "1");
    cr_assert_eq(create_lease("a", "cohort"), 0);
    cr_assert_eq(create_lease("other", "else"), 0);
    r = reflect(2, &s);
    cr_assert(cached(r, "default/a"));
    cr_assert(!cached(r, "default/other"), "the selector is applied");
    cr_assert_eq(create_lease("b", "cohort"), 0);
    FIXTURE_WAIT_FOR(cached(r, "default/b"), "the watch never added b");
    cr_assert_eq(kube_delete(k, LEASES "/a"), 0);
    FIXTURE_WAIT_FOR(!cached(r, "default/a"), "the watch never deleted a");
    cr_assert_geq(atomic_load(&s.deletes), 1);
    /* The server ends watches every 2 s; the reflector resumes. */
    FIXTURE_WAIT_FOR((reflector_stats(r, &st), st.watches >= 3), "no watch after the first");
    cr_assert_eq(create_lease("c", "cohort"), 0);
    FIXTURE_WAIT_FOR(cached(r, "default/c"), "no resumed watch added c");
    all = reflector_list(r, "default/");
    cr_assert_eq(cJSON_GetArraySize(all), 2);
    cJSON_Delete(all);
    reflector_destroy(r);
    stop_server();
}

Test(kubeops, reflector_keeps_up_through_a_short_history, .timeout = 90)
{
    struct seen s = { 0 };
    struct reflector *r;
    struct reflector_stats st;

    /* A history of 5 events: a watcher that resumed from its list version
     * after this much writing would get 410. The server's bookmarks (sent
     * when it ends each watch) keep the reflector's version current, so
     * it resumes cleanly and never needs to list again. */
    start_server("5", "3600");
    cr_assert_eq(create_lease("keep", "cohort"), 0);
    cr_assert_eq(create_lease("gone", "cohort"), 0);
    r = reflect(1, &s);
    /* The first watch resumes from the list's version, which no bookmark
     * has moved on yet: it must be open before the noise, or it is the
     * one that falls behind. An event through it shows it is. */
    cr_assert_eq(create_lease("first", "cohort"), 0);
    FIXTURE_WAIT_FOR(cached(r, "default/first"), "the first watch never delivered");
    /* 20 writes the selector does not match, in batches of 4 with a new
     * watch between batches: however a batch falls against the end of a
     * watch, a resume misses at most 4 events, inside the history of 5, so
     * only a version that bookmarks failed to move on could be Gone. */
    for (int i = 0; i < 20; i++) {
        char name[32];
        if (i % 4 == 0) {
            uint64_t before;
            reflector_stats(r, &st);
            before = st.watches;
            FIXTURE_WAIT_FOR((reflector_stats(r, &st), st.watches > before),
                             "the watch never resumed");
        }
        snprintf(name, sizeof(name), "noise-%d", i);
        cr_assert_eq(create_lease(name, "else"), 0);
    }
    FIXTURE_WAIT_FOR((reflector_stats(r, &st), st.watches >= 6), "too few resumed watches");
    cr_assert_eq(kube_delete(k, LEASES "/gone"), 0);
    FIXTURE_WAIT_FOR(!cached(r, "default/gone"), "the deletion never reached the cache");
    cr_assert(cached(r, "default/keep"));
    reflector_stats(r, &st);
    cr_assert_eq(st.errors, 0);
    cr_assert_eq(st.lists, 1, "resumed from bookmarks, never listed again");
    reflector_destroy(r);
    stop_server();
}

/* ---- the broker's CA ---- */

#define SECRETS "/api/v1/namespaces/ops/secrets"

/* Whether `leaf` verifies against `ca` for `host`, as a TLS client checks. */
static bool verifies(const char *ca_pem, const char *leaf_pem, const char *host)
{
    BIO *b1 = BIO_new_mem_buf(ca_pem, -1), *b2 = BIO_new_mem_buf(leaf_pem, -1);
    X509 *ca = PEM_read_bio_X509(b1, NULL, NULL, NULL), *leaf = PEM_read_bio_X509(b2, NULL, NULL, NULL);
    X509_STORE *st = X509_STORE_new();
    X509_STORE_CTX *ctx = X509_STORE_CTX_new();
    bool ok;

    cr_assert(ca && leaf);
    X509_STORE_add_cert(st, ca);
    X509_STORE_CTX_init(ctx, st, leaf, NULL);
    X509_VERIFY_PARAM_set1_host(X509_STORE_CTX_get0_param(ctx), host, 0);
    ok = X509_verify_cert(ctx) == 1;
    X509_STORE_CTX_free(ctx);
    X509_STORE_free(st);
    X509_free(ca);
    X509_free(leaf);
    BIO_free(b1);
    BIO_free(b2);
    ERR_clear_error();
    return ok;
}

static const char *resource_version(const char *path)
{
    static char rv[64];
    cJSON *o = NULL;

    cr_assert_eq(kube_get(k, path, &o), 0);
    snprintf(rv, sizeof(rv), "%s", kube_meta(o, "resourceVersion"));
    cJSON_Delete(o);
    return rv;
}

Test(kubeops, broker_ca_is_made_once_and_each_start_issues_a_certificate, .timeout = 90)
{
    const char *extra[] = { "127.0.0.1" };
    struct brokertls_config c = { .namespace = "ops", .extra = extra, .n_extra = 1 };
    struct brokertls a, b;
    cJSON *sec = NULL;
    char *text = NULL;

    start_server("1000", "5");
    c.kube = k;
    cr_assert_eq(brokertls_load(&c, &a), 0);
    cr_assert(a.created);
    cr_assert_str_eq(a.server_name, "cohort-broker.ops.svc");
    cr_assert(verifies(a.ca_pem, a.server.cert, "cohort-broker.ops.svc"));
    cr_assert(verifies(a.ca_pem, a.server.cert, "cohort-broker.ops.svc.cluster.local"));
    cr_assert(!verifies(a.ca_pem, a.server.cert, "cohort-broker.default.svc"));
    cr_assert_gt(a.not_after, (int64_t)time(NULL) + 300 * 86400);
    /* The Secret: kubernetes.io/tls, the CA's certificate and key. */
    cr_assert_eq(kube_get(k, SECRETS "/cohort-broker-ca", &sec), 0);
    cr_assert_str_eq(cJSON_GetObjectItem(sec, "type")->valuestring, "kubernetes.io/tls");
    cr_assert_eq(kube_secret_data(sec, "ca.crt", &text, NULL), 0);
    cr_assert_str_eq(text, a.ca_pem);
    free(text);
    cr_assert_eq(kube_secret_data(sec, "tls.key", &text, NULL), 0);
    cr_assert(strstr(text, "PRIVATE KEY"));
    free(text);
    cJSON_Delete(sec);
    /* A second start: the same CA, a new certificate. */
    cr_assert_eq(brokertls_load(&c, &b), 0);
    cr_assert(!b.created);
    cr_assert_str_eq(b.ca_pem, a.ca_pem);
    cr_assert_str_neq(b.server.cert, a.server.cert);
    cr_assert(verifies(a.ca_pem, b.server.cert, "cohort-broker.ops.svc"));
    brokertls_cleanup(&a);
    brokertls_cleanup(&b);
    stop_server();
}

/* Two replicas starting at once. */
struct racer {
    struct kube *kube;
    struct brokertls t;
    int rc;
};

static void *race(void *arg)
{
    struct racer *r = arg;
    struct brokertls_config c = { .kube = r->kube, .namespace = "ops", .service = "b" };

    r->rc = brokertls_load(&c, &r->t);
    return NULL;
}

Test(kubeops, two_replicas_making_the_ca_agree_on_one, .timeout = 90)
{
    struct racer r[2] = { { .kube = NULL }, { .kube = NULL } };
    pthread_t th[2];
    cJSON *rule;

    start_server("1000", "5");
    /* Both look for the Secret before either makes it (their reads are
     * held 3 s), then both create it: one gets 409 and must read the
     * winner's. */
    rule = cJSON_Parse("{\"method\":\"GET\",\"path\":\"/secrets/cohort-broker-ca\",\"delay\":3,"
                       "\"count\":2}");
    cr_assert_eq(kube_request(k, "POST", "/debug/cohort/faults", NULL, rule, NULL), 0);
    cJSON_Delete(rule);
    r[0].kube = k;
    r[1].kube = second_client();
    for (int i = 0; i < 2; i++)
        cr_assert_eq(pthread_create(&th[i], NULL, race, &r[i]), 0);
    for (int i = 0; i < 2; i++)
        pthread_join(th[i], NULL);
    cr_assert_eq(r[0].rc, 0);
    cr_assert_eq(r[1].rc, 0);
    cr_assert_eq(r[0].t.created + r[1].t.created, 1, "exactly one made the CA");
    {
        /* And the other did try, and got 409. */
        cJSON *reqs = NULL, *it;
        int conflicts = 0;
        cr_assert_eq(kube_get(k, "/debug/cohort/requests", &reqs), 0);
        cJSON_ArrayForEach(it, reqs) {
            const cJSON *m = cJSON_GetObjectItem(it, "method"), *p = cJSON_GetObjectItem(it, "path");
            const cJSON *code = cJSON_GetObjectItem(it, "code");
            conflicts += cJSON_IsString(m) && strcmp(m->valuestring, "POST") == 0 &&
                         cJSON_IsString(p) && strcmp(p->valuestring, SECRETS) == 0 &&
                         cJSON_IsNumber(code) && code->valueint == 409;
        }
        cJSON_Delete(reqs);
        cr_assert_eq(conflicts, 1);
    }
    cr_assert_str_eq(r[0].t.ca_pem, r[1].t.ca_pem);
    cr_assert(verifies(r[0].t.ca_pem, r[1].t.server.cert, "b.ops.svc"));
    cr_assert(verifies(r[1].t.ca_pem, r[0].t.server.cert, "b.ops.svc"));
    for (int i = 0; i < 2; i++)
        brokertls_cleanup(&r[i].t);
    kube_destroy(r[1].kube);
    stop_server();
}

Test(kubeops, a_secret_without_a_usable_ca_is_refused_and_left_alone, .timeout = 90)
{
    struct brokertls_config c = { .namespace = "ops", .secret = "mine" };
    struct brokertls t;
    char rv[64];
    cJSON *o = cJSON_Parse("{\"metadata\":{\"name\":\"mine\"},\"type\":\"kubernetes.io/tls\","
                           "\"data\":{\"tls.crt\":\"bm90IGEgY2VydA==\",\"tls.key\":\"bm8=\"}}");

    start_server("1000", "5");
    c.kube = k;
    cr_assert_eq(kube_create_object(k, SECRETS, o, NULL), 0);
    cJSON_Delete(o);
    snprintf(rv, sizeof(rv), "%s", resource_version(SECRETS "/mine"));
    cr_assert_eq(brokertls_load(&c, &t), -EINVAL);
    cr_assert_null(t.ca_pem);
    cr_assert_null(t.server.key);
    cr_assert_str_eq(resource_version(SECRETS "/mine"), rv, "the Secret was changed");
    /* A bad config. */
    c.namespace = "";
    cr_assert_eq(brokertls_load(&c, &t), -EINVAL);
    stop_server();
}

/* ---- Lease election ---- */

static struct lease *elector(const char *id)
{
    struct lease_config c = { .kube = k, .namespace = "default", .name = "cohort-operator",
                              .identity = id, .lease_duration_ms = 1500,
                              .renew_deadline_ms = 1000, .retry_period_ms = 200 };
    struct lease *l;

    cr_assert_eq(lease_start(&c, &l), 0);
    return l;
}

Test(kubeops, exactly_one_leader_and_failover, .timeout = 90)
{
    struct lease *a, *b;
    uint64_t t0;

    start_server("1000", "5");
    a = elector("op-a");
    FIXTURE_WAIT_FOR(lease_is_leader(a), "op-a never led");
    b = elector("op-b");
    /* op-b keeps trying and never leads while op-a renews: watched for
     * 2 s, ten of op-b's retry periods (what is checked is that nothing
     * happens, so this one waits for time, not for a condition). */
    for (int i = 0; i < 20; i++) {
        clock_sleep_ms(100);
        cr_assert(lease_is_leader(a) && !lease_is_leader(b), "two leaders, or none");
    }
    /* A crash: no release; op-b must wait out the lease, then lead. */
    t0 = clock_now_ms();
    lease_abandon(a);
    FIXTURE_WAIT_FOR(lease_is_leader(b), "op-b never took over");
    cr_assert_geq(clock_now_ms() - t0, 1000, "took over before the lease could expire");
    /* A clean stop releases: a successor leads well within a lease. */
    a = elector("op-a2");
    t0 = clock_now_ms();
    lease_destroy(b);
    FIXTURE_WAIT_FOR(lease_is_leader(a), "op-a2 never led after the release");
    cr_assert_lt(clock_now_ms() - t0, 1500 + 1000);
    lease_destroy(a);
    stop_server();
}

Test(kubeops, lease_config_is_checked)
{
    struct lease_config c = { .kube = (struct kube *)1, .namespace = "default", .name = "x",
                              .identity = "me", .lease_duration_ms = 1000,
                              .renew_deadline_ms = 2000, .retry_period_ms = 100 };
    struct lease *l = NULL;

    cr_assert_eq(lease_start(&c, &l), -EINVAL, "renew deadline past the lease");
    c.identity = "";
    c.renew_deadline_ms = 500;
    cr_assert_eq(lease_start(&c, &l), -EINVAL);
    cr_assert_null(l);
}

/* tests/unit/test_pki.c: the broker's CA and server certificates, checked
 * with libcrypto itself: the chain verifies (X509_verify_cert) for the
 * Service's names and for no other, the SANs are there, keys match,
 * validity is bounded; bad PEM, a key of another certificate, a leaf as CA
 * and an expired CA are refused. Then as the broker and its clients use
 * them: a broker serving gRPC with an issued certificate, reached by IP,
 * answers a client that trusts the CA and checks the Service's name, and
 * no other. */
#include <criterion/criterion.h>
#include <errno.h>
#include <string.h>
#include <time.h>

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include "cohort.pb-c.h"
#include "fixture.h"
#include "k8s/pki.h"
#include "membership/brokerd.h"
#include "membership/wire.h"
#include "rpc/rpc.h"

static X509 *cert_of(const char *pem)
{
    BIO *b = BIO_new_mem_buf(pem, -1);
    X509 *x = PEM_read_bio_X509(b, NULL, NULL, NULL);

    BIO_free(b);
    cr_assert_not_null(x, "not a PEM certificate:\n%s", pem);
    return x;
}

static EVP_PKEY *key_of(const char *pem)
{
    BIO *b = BIO_new_mem_buf(pem, -1);
    EVP_PKEY *k = PEM_read_bio_PrivateKey(b, NULL, NULL, NULL);

    BIO_free(b);
    cr_assert_not_null(k);
    return k;
}

/* Verifies leaf against ca as a TLS client would for `host` (NULL: no
 * name check). Returns the X509_V_ERR code, X509_V_OK on success. */
static int verify(const char *ca_pem, const char *leaf_pem, const char *host)
{
    X509 *ca = cert_of(ca_pem), *leaf = cert_of(leaf_pem);
    X509_STORE *st = X509_STORE_new();
    X509_STORE_CTX *ctx = X509_STORE_CTX_new();
    int err;

    cr_assert(X509_STORE_add_cert(st, ca));
    cr_assert(X509_STORE_CTX_init(ctx, st, leaf, NULL));
    X509_STORE_CTX_set_purpose(ctx, X509_PURPOSE_SSL_SERVER);
    if (host)
        cr_assert(X509_VERIFY_PARAM_set1_host(X509_STORE_CTX_get0_param(ctx), host, 0));
    err = X509_verify_cert(ctx) == 1 ? X509_V_OK : X509_STORE_CTX_get_error(ctx);
    X509_STORE_CTX_free(ctx);
    X509_STORE_free(st);
    X509_free(ca);
    X509_free(leaf);
    ERR_clear_error();
    return err;
}

static long days_left(const char *pem)
{
    int64_t na;

    cr_assert_eq(pki_not_after(pem, &na), 0);
    return (long)((na - (int64_t)time(NULL)) / 86400);
}

Test(pki, ca_is_a_self_signed_p256_ca_for_ten_years)
{
    struct pki_pem ca;
    X509 *x;
    EVP_PKEY *k;
    int64_t na = 0;

    cr_assert_eq(pki_ca_create("cohort broker CA", PKI_CA_DAYS, &ca), 0);
    cr_assert(strstr(ca.cert, "-----BEGIN CERTIFICATE-----"));
    cr_assert(strstr(ca.key, "-----BEGIN PRIVATE KEY-----"), "PKCS#8");
    x = cert_of(ca.cert);
    k = key_of(ca.key);
    cr_assert_eq(X509_check_ca(x), 1);
    cr_assert(X509_get_key_usage(x) & KU_KEY_CERT_SIGN);
    cr_assert_eq(X509_check_private_key(x, k), 1);
    cr_assert_eq(X509_check_issued(x, x), X509_V_OK, "self-signed");
    cr_assert_eq(EVP_PKEY_get_base_id(k), EVP_PKEY_EC);
    cr_assert_eq(EVP_PKEY_get_bits(k), 256);
    cr_assert_eq(X509_NAME_get_index_by_NID(X509_get_subject_name(x), NID_commonName, -1) >= 0,
                 1);
    cr_assert_geq(days_left(ca.cert), PKI_CA_DAYS - 1);
    cr_assert_leq(days_left(ca.cert), PKI_CA_DAYS);
    cr_assert_eq(pki_ca_check(ca.cert, ca.key, &na), 0);
    cr_assert_gt(na, (int64_t)time(NULL));
    X509_free(x);
    EVP_PKEY_free(k);
    pki_pem_cleanup(&ca);
    cr_assert_null(ca.cert);
    cr_assert_null(ca.key);
}

Test(pki, server_certificate_names_the_service_and_verifies_against_the_ca)
{
    struct pki_pem ca, srv;
    const char *extra[] = { "10.1.2.3", "broker.example.com", "::1" };
    struct pki_names n = { .service = "cohort-broker", .namespace = "ops", .extra = extra,
                           .n_extra = 3 };
    const char *names[] = { "cohort-broker", "cohort-broker.ops", "cohort-broker.ops.svc",
                            "cohort-broker.ops.svc.cluster.local", "broker.example.com" };
    X509 *x;
    EVP_PKEY *k;

    cr_assert_eq(pki_ca_create("cohort broker CA", PKI_CA_DAYS, &ca), 0);
    cr_assert_eq(pki_issue_server(&ca, &n, PKI_SERVER_DAYS, &srv), 0);
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        cr_assert_eq(verify(ca.cert, srv.cert, names[i]), X509_V_OK, "%s", names[i]);
    /* Another name, or another namespace's Service, does not verify. */
    cr_assert_eq(verify(ca.cert, srv.cert, "cohort-broker.other.svc"),
                 X509_V_ERR_HOSTNAME_MISMATCH);
    cr_assert_eq(verify(ca.cert, srv.cert, "evil.example.com"), X509_V_ERR_HOSTNAME_MISMATCH);

    x = cert_of(srv.cert);
    k = key_of(srv.key);
    cr_assert_eq(X509_check_private_key(x, k), 1);
    cr_assert_eq(EVP_PKEY_get_base_id(k), EVP_PKEY_EC);
    cr_assert_eq(X509_check_ca(x), 0, "a leaf");
    cr_assert(X509_get_extended_key_usage(x) & XKU_SSL_SERVER);
    cr_assert_eq(X509_check_ip_asc(x, "10.1.2.3", 0), 1);
    cr_assert_eq(X509_check_ip_asc(x, "::1", 0), 1);
    cr_assert_eq(X509_check_ip_asc(x, "10.1.2.4", 0), 0);
    cr_assert_eq(X509_check_host(x, "broker.example.com", 0, 0, NULL), 1);
    {
        GENERAL_NAMES *gens = X509_get_ext_d2i(x, NID_subject_alt_name, NULL, NULL);
        cr_assert_not_null(gens);
        cr_assert_eq(sk_GENERAL_NAME_num(gens), 7);
        GENERAL_NAMES_free(gens);
    }
    cr_assert_geq(days_left(srv.cert), PKI_SERVER_DAYS - 1);
    cr_assert_leq(days_left(srv.cert), PKI_SERVER_DAYS);
    /* A leaf cannot issue. */
    cr_assert_eq(pki_ca_check(srv.cert, srv.key, NULL), -EINVAL);
    {
        struct pki_pem again;
        cr_assert_eq(pki_issue_server(&srv, &n, 1, &again), -EINVAL);
        cr_assert_null(again.cert);
    }
    X509_free(x);
    EVP_PKEY_free(k);
    pki_pem_cleanup(&srv);
    pki_pem_cleanup(&ca);
}

Test(pki, server_certificate_does_not_outlive_its_ca)
{
    struct pki_pem ca, srv;
    struct pki_names n = { .service = "b", .namespace = "ns", .cluster_domain = "corp.internal" };

    cr_assert_eq(pki_ca_create("short CA", 10, &ca), 0);
    cr_assert_eq(pki_issue_server(&ca, &n, PKI_SERVER_DAYS, &srv), 0);
    cr_assert_leq(days_left(srv.cert), 10);
    cr_assert_eq(verify(ca.cert, srv.cert, "b.ns.svc.corp.internal"), X509_V_OK);
    cr_assert_eq(verify(ca.cert, srv.cert, "b.ns.svc.cluster.local"),
                 X509_V_ERR_HOSTNAME_MISMATCH);
    pki_pem_cleanup(&srv);
    pki_pem_cleanup(&ca);
}

Test(pki, a_certificate_from_another_ca_does_not_verify)
{
    struct pki_pem a, b, srv;
    struct pki_names n = { .service = "cohort-broker", .namespace = "ops" };

    cr_assert_eq(pki_ca_create("A", 30, &a), 0);
    cr_assert_eq(pki_ca_create("B", 30, &b), 0);
    cr_assert_eq(pki_issue_server(&a, &n, 30, &srv), 0);
    cr_assert_eq(verify(a.cert, srv.cert, "cohort-broker.ops.svc"), X509_V_OK);
    cr_assert_neq(verify(b.cert, srv.cert, "cohort-broker.ops.svc"), X509_V_OK);
    pki_pem_cleanup(&srv);
    pki_pem_cleanup(&a);
    pki_pem_cleanup(&b);
}

Test(pki, bad_pem_and_mismatched_keys_are_refused)
{
    struct pki_pem a, b, out;
    struct pki_names n = { .service = "s", .namespace = "ns" };
    char *cut;
    int64_t na;

    cr_assert_eq(pki_ca_create("A", 30, &a), 0);
    cr_assert_eq(pki_ca_create("B", 30, &b), 0);
    cr_assert_eq(pki_ca_check("", a.key, NULL), -EINVAL);
    cr_assert_eq(pki_ca_check(NULL, a.key, NULL), -EINVAL);
    cr_assert_eq(pki_ca_check("not a certificate", a.key, NULL), -EINVAL);
    cr_assert_eq(pki_ca_check(a.cert, "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n",
                              NULL), -EINVAL);
    cr_assert_eq(pki_ca_check(a.cert, b.key, NULL), -EINVAL, "another CA's key");
    cr_assert_eq(pki_ca_check(a.key, a.cert, NULL), -EINVAL, "swapped");
    /* A certificate cut short. */
    cut = strdup(a.cert);
    cut[strlen(cut) / 2] = '\0';
    cr_assert_eq(pki_ca_check(cut, a.key, NULL), -EINVAL);
    cr_assert_eq(pki_not_after(cut, &na), -EINVAL);
    free(cut);
    {
        struct pki_pem mixed = { .cert = a.cert, .key = b.key };
        cr_assert_eq(pki_issue_server(&mixed, &n, 30, &out), -EINVAL);
        cr_assert_null(out.cert);
        cr_assert_null(out.key);
    }
    /* Over the size cap, even if it would parse. */
    {
        size_t big = PKI_PEM_MAX + 16;
        char *p = malloc(big + strlen(a.cert) + 1);
        memset(p, '\n', big);
        strcpy(p + big, a.cert);
        cr_assert_eq(pki_ca_check(p, a.key, NULL), -EINVAL);
        free(p);
    }
    cr_assert_eq(ERR_peek_error(), 0, "libcrypto's error queue is left clean");
    pki_pem_cleanup(&a);
    pki_pem_cleanup(&b);
}

Test(pki, bad_names_and_bounds_are_refused)
{
    struct pki_pem ca, out;
    const char *bad_dns[] = { "under_score.example" };
    const char *dash[] = { "-lead.example" };
    const char *empty_label[] = { "a..b" };
    const char *null_name[] = { NULL };
    const char *many[PKI_NAMES_MAX + 1];

    cr_assert_eq(pki_ca_create("", 30, &out), -EINVAL);
    cr_assert_eq(pki_ca_create("A", 0, &out), -EINVAL);
    cr_assert_eq(pki_ca_create("A", PKI_DAYS_MAX + 1, &out), -EINVAL);
    cr_assert_eq(pki_ca_create("a common name far too long to fit in the sixty-four bytes X.520 allows",
                               30, &out), -EINVAL);
    cr_assert_eq(pki_ca_create("A", 30, &ca), 0);
    {
        struct pki_names none = { 0 };
        struct pki_names half = { .service = "s" };
        struct pki_names n1 = { .extra = bad_dns, .n_extra = 1 };
        struct pki_names n2 = { .extra = dash, .n_extra = 1 };
        struct pki_names n3 = { .extra = empty_label, .n_extra = 1 };
        struct pki_names n4 = { .extra = null_name, .n_extra = 1 };
        struct pki_names n5 = { .service = "s", .namespace = "ns", .extra = many,
                                .n_extra = PKI_NAMES_MAX };
        for (size_t i = 0; i < PKI_NAMES_MAX + 1; i++)
            many[i] = "a.example";
        cr_assert_eq(pki_issue_server(&ca, &none, 30, &out), -EINVAL);
        cr_assert_eq(pki_issue_server(&ca, &half, 30, &out), -EINVAL);
        cr_assert_eq(pki_issue_server(&ca, &n1, 30, &out), -EINVAL);
        cr_assert_eq(pki_issue_server(&ca, &n2, 30, &out), -EINVAL);
        cr_assert_eq(pki_issue_server(&ca, &n3, 30, &out), -EINVAL);
        cr_assert_eq(pki_issue_server(&ca, &n4, 30, &out), -EINVAL);
        cr_assert_eq(pki_issue_server(&ca, &n5, 30, &out), -EINVAL, "too many names");
        n5.n_extra = PKI_NAMES_MAX - 4;
        cr_assert_eq(pki_issue_server(&ca, &n5, 30, &out), 0, "just enough names");
        pki_pem_cleanup(&out);
        n5.n_extra = 0;
        cr_assert_eq(pki_issue_server(&ca, &n5, 0, &out), -EINVAL);
    }
    pki_pem_cleanup(&ca);
}

/* The CA's certificate with notAfter in the past, signed again with its
 * key: what a CA Secret looks like ten years on. */
static char *expired_copy(const struct pki_pem *ca)
{
    X509 *x = cert_of(ca->cert);
    EVP_PKEY *k = key_of(ca->key);
    BIO *b = BIO_new(BIO_s_mem());
    char *p, *out;
    long n;

    cr_assert(X509_gmtime_adj(X509_getm_notBefore(x), -3 * 86400));
    cr_assert(X509_gmtime_adj(X509_getm_notAfter(x), -86400));
    cr_assert_gt(X509_sign(x, k, EVP_sha256()), 0);
    cr_assert(PEM_write_bio_X509(b, x));
    n = BIO_get_mem_data(b, &p);
    out = strndup(p, (size_t)n);
    BIO_free(b);
    X509_free(x);
    EVP_PKEY_free(k);
    return out;
}

Test(pki, an_expired_ca_is_refused)
{
    struct pki_pem ca, out;
    struct pki_names n = { .service = "s", .namespace = "ns" };
    char *old;

    cr_assert_eq(pki_ca_create("A", 30, &ca), 0);
    old = expired_copy(&ca);
    cr_assert_eq(pki_ca_check(old, ca.key, NULL), -EKEYEXPIRED);
    {
        struct pki_pem expired = { .cert = old, .key = ca.key };
        cr_assert_eq(pki_issue_server(&expired, &n, 30, &out), -EKEYEXPIRED);
    }
    free(old);
    pki_pem_cleanup(&ca);
}

/* A Status call to the broker at addr over a channel trusting `ca` (NULL:
 * plaintext) and checking `name`. Returns rpc_call's result. One that
 * should succeed waits for the connection (a handshake may fail for want
 * of time on a loaded machine, and is then tried again); one that should
 * fail does not, so that its failure is the handshake's, at once. */
static int status_call(const char *addr, const char *ca, const char *name, bool should_work)
{
    struct rpc_channel_opts o = { .tls_ca_pem = ca, .tls_server_name = name };
    Cohort__V1__StatusRequest q = COHORT__V1__STATUS_REQUEST__INIT;
    ProtobufCMessage *out = NULL;
    struct rpc_channel *ch;
    struct rpc_status st;
    int rc;

    q.protocol_version = WIRE_PROTOCOL_VERSION;
    q.cohort = "demo";
    cr_assert_eq(rpc_channel_create(addr, &o, &ch), 0);
    rc = rpc_call(ch, WIRE_BROKER_STATUS, &q.base, &cohort__v1__status_reply__descriptor, 20000,
                  should_work ? RPC_WAIT_FOR_READY : 0, &out, &st);
    if (out)
        protobuf_c_message_free_unpacked(out, NULL);
    rpc_channel_destroy(ch);
    return rc;
}

Test(pki, grpc_serves_the_certificate_to_clients_that_trust_the_ca, .timeout = 60)
{
    struct pki_pem ca, other, srv;
    struct pki_names n = { .service = "cohort-broker", .namespace = "ops" };
    struct brokerd_config cfg;
    struct brokerd *d;
    char addr[64];

    cr_assert_eq(pki_ca_create("cohort broker CA", 30, &ca), 0);
    cr_assert_eq(pki_ca_create("another CA", 30, &other), 0);
    cr_assert_eq(pki_issue_server(&ca, &n, 30, &srv), 0);
    fixture_broker_config(&cfg);
    cfg.open = true;        /* this is about TLS, not keys */
    cfg.tls_cert_pem = srv.cert;
    cfg.tls_key_pem = srv.key;
    d = fixture_broker_start_with(&cfg, "demo", addr, sizeof(addr));
    /* Reached by IP, checked against the Service's name, as sidecars do. */
    cr_assert_eq(status_call(addr, ca.cert, "cohort-broker.ops.svc", true), 0);
    cr_assert_eq(status_call(addr, ca.cert, "cohort-broker.ops.svc.cluster.local", true), 0);
    cr_assert_neq(status_call(addr, other.cert, "cohort-broker.ops.svc", false), 0, "another CA");
    cr_assert_neq(status_call(addr, ca.cert, "cohort-broker.other.svc", false), 0, "another name");
    cr_assert_neq(status_call(addr, NULL, NULL, false), 0, "plaintext to a TLS broker");
    fixture_broker_stop(d);
    pki_pem_cleanup(&srv);
    pki_pem_cleanup(&other);
    pki_pem_cleanup(&ca);
}

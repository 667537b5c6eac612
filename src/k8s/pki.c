/* src/k8s/pki.c: see pki.h.
 *
 * libcrypto reports failures on a per-thread error queue; every path out
 * of a failure here clears it, so that a refused Secret leaves nothing
 * behind for the next TLS call on the same thread (gRPC's among them)
 * to trip on. */
#include "k8s/pki.h"

#include <arpa/inet.h>
#include <errno.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <openssl/asn1.h>
#include <openssl/bio.h>
#include <openssl/bn.h>
#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/rand.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#define BACKDATE_S 300              /* notBefore this far back: clock skew */
#define CN_MAX 64                   /* X.520 ub-common-name */
#define DNS_NAME_MAX 253

void pki_pem_cleanup(struct pki_pem *p)
{
    if (!p)
        return;
    if (p->key)
        OPENSSL_cleanse(p->key, strlen(p->key));
    free(p->key);
    free(p->cert);
    p->key = NULL;
    p->cert = NULL;
}

/* ---- PEM in ------------------------------------------------------------- */

/* Never prompts: an encrypted key is simply refused. The default callback
 * would ask on the terminal. */
static int no_password(char *buf, int size, int rwflag, void *u)
{
    (void)buf;
    (void)size;
    (void)rwflag;
    (void)u;
    return -1;
}

static BIO *pem_bio(const char *pem)
{
    size_t n;

    if (!pem)
        return NULL;
    n = strnlen(pem, PKI_PEM_MAX + 1);
    if (n == 0 || n > PKI_PEM_MAX)
        return NULL;
    return BIO_new_mem_buf(pem, (int)n);
}

static X509 *read_cert(const char *pem)
{
    BIO *b = pem_bio(pem);
    X509 *x = b ? PEM_read_bio_X509(b, NULL, no_password, NULL) : NULL;

    BIO_free(b);
    return x;
}

static EVP_PKEY *read_key(const char *pem)
{
    BIO *b = pem_bio(pem);
    EVP_PKEY *k = b ? PEM_read_bio_PrivateKey(b, NULL, no_password, NULL) : NULL;

    BIO_free(b);
    return k;
}

static int asn1_seconds(const ASN1_TIME *t, int64_t *out)
{
    struct tm tm;

    if (!t || !ASN1_TIME_to_tm(t, &tm))
        return -EINVAL;
    *out = (int64_t)timegm(&tm);
    return 0;
}

int pki_not_after(const char *cert_pem, int64_t *out)
{
    X509 *x = read_cert(cert_pem);
    int rc = x ? asn1_seconds(X509_get0_notAfter(x), out) : -EINVAL;

    X509_free(x);
    ERR_clear_error();
    return rc;
}

/* The CA's certificate and key, checked (see pki_ca_check). */
static int load_ca(const char *cert_pem, const char *key_pem, X509 **cert, EVP_PKEY **key)
{
    X509 *x = read_cert(cert_pem);
    EVP_PKEY *k = x ? read_key(key_pem) : NULL;
    int id, rc = -EINVAL;

    if (!x || !k)
        goto out;
    id = EVP_PKEY_get_base_id(k);
    if (id != EVP_PKEY_EC && id != EVP_PKEY_RSA)
        goto out;
    /* 1: basicConstraints CA:TRUE. The other "CA" answers (v1 roots,
     * Netscape types) are not for us. */
    if (X509_check_ca(x) != 1)
        goto out;
    if ((X509_get_extension_flags(x) & EXFLAG_KUSAGE) &&
        !(X509_get_key_usage(x) & KU_KEY_CERT_SIGN))
        goto out;
    if (X509_check_private_key(x, k) != 1)
        goto out;
    if (X509_cmp_current_time(X509_get0_notBefore(x)) >= 0 ||
        X509_cmp_current_time(X509_get0_notAfter(x)) <= 0) {
        rc = -EKEYEXPIRED;
        goto out;
    }
    *cert = x;
    *key = k;
    x = NULL;
    k = NULL;
    rc = 0;
out:
    X509_free(x);
    EVP_PKEY_free(k);
    ERR_clear_error();
    return rc;
}

int pki_ca_check(const char *cert_pem, const char *key_pem, int64_t *not_after)
{
    X509 *x = NULL;
    EVP_PKEY *k = NULL;
    int rc = load_ca(cert_pem, key_pem, &x, &k);

    if (rc == 0 && not_after)
        rc = asn1_seconds(X509_get0_notAfter(x), not_after);
    X509_free(x);
    EVP_PKEY_free(k);
    return rc;
}

/* ---- PEM out ------------------------------------------------------------ */

static char *bio_string(BIO *b)
{
    char *p = NULL, *s;
    long n = BIO_get_mem_data(b, &p);

    if (n <= 0 || !p)
        return NULL;
    s = malloc((size_t)n + 1);
    if (s) {
        memcpy(s, p, (size_t)n);
        s[n] = '\0';
    }
    return s;
}

static int write_pem(X509 *x, EVP_PKEY *k, struct pki_pem *out)
{
    BIO *cb = BIO_new(BIO_s_mem()), *kb = BIO_new(BIO_s_secmem());
    int rc = -ENOMEM;

    memset(out, 0, sizeof(*out));
    if (!cb || !kb)
        goto out;
    rc = -EIO;
    if (!PEM_write_bio_X509(cb, x) || !PEM_write_bio_PrivateKey(kb, k, NULL, NULL, 0, NULL, NULL))
        goto out;
    rc = -ENOMEM;
    out->cert = bio_string(cb);
    out->key = bio_string(kb);
    if (!out->cert || !out->key) {
        pki_pem_cleanup(out);
        goto out;
    }
    rc = 0;
out:
    BIO_free(cb);
    BIO_free(kb);       /* a secmem BIO clears its buffer when freed */
    return rc;
}

/* ---- building a certificate ---------------------------------------------- */

static bool valid_dns(const char *s)
{
    size_t n = strlen(s), label = 0;

    if (n == 0 || n > DNS_NAME_MAX || s[0] == '.' || s[n - 1] == '.')
        return false;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '.') {
            if (label == 0 || s[i - 1] == '-')
                return false;
            label = 0;
            continue;
        }
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '-'))
            return false;
        if (label == 0 && c == '-')
            return false;
        if (++label > 63)
            return false;
    }
    return s[n - 1] != '-';
}

/* A fresh serial number: 127 random bits, positive and non-zero (RFC 5280
 * asks for at most 20 octets, unique per CA). */
static int set_serial(X509 *x)
{
    unsigned char b[16];
    BIGNUM *bn;
    int ok;

    if (RAND_bytes(b, sizeof(b)) != 1)
        return -EIO;
    b[0] = (unsigned char)((b[0] & 0x7f) | 0x40);
    bn = BN_bin2bn(b, sizeof(b), NULL);
    ok = bn && BN_to_ASN1_INTEGER(bn, X509_get_serialNumber(x)) != NULL;
    BN_free(bn);
    return ok ? 0 : -ENOMEM;
}

static int add_ext(X509 *x, X509V3_CTX *ctx, int nid, const char *value)
{
    X509_EXTENSION *e = X509V3_EXT_nconf_nid(NULL, ctx, nid, value);
    int ok = e && X509_add_ext(x, e, -1);

    X509_EXTENSION_free(e);
    return ok ? 0 : -EIO;
}

/* A certificate with everything but its extensions and signature: v3, a
 * random serial, `subject_cn`, the issuer's name (itself when issuer is
 * NULL), the public key and the validity. */
static X509 *new_cert(const char *subject_cn, const X509 *issuer, EVP_PKEY *pub, uint32_t days)
{
    X509 *x = X509_new();
    X509_NAME *name;

    if (!x)
        return NULL;
    name = X509_get_subject_name(x);
    if (!X509_set_version(x, X509_VERSION_3) || set_serial(x) < 0 ||
        !X509_NAME_add_entry_by_txt(name, "O", MBSTRING_UTF8, (const unsigned char *)"cohort",
                                    -1, -1, 0) ||
        !X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_UTF8,
                                    (const unsigned char *)subject_cn, -1, -1, 0) ||
        !X509_set_issuer_name(x, issuer ? X509_get_subject_name(issuer) : name) ||
        !X509_set_pubkey(x, pub) ||
        !X509_gmtime_adj(X509_getm_notBefore(x), -BACKDATE_S) ||
        !X509_time_adj_ex(X509_getm_notAfter(x), (int)days, 0, NULL))
        goto err;
    if (issuer && ASN1_TIME_compare(X509_get0_notAfter(x), X509_get0_notAfter(issuer)) > 0 &&
        !X509_set1_notAfter(x, X509_get0_notAfter(issuer)))
        goto err;
    return x;
err:
    X509_free(x);
    return NULL;
}

int pki_ca_create(const char *common_name, uint32_t days, struct pki_pem *out)
{
    EVP_PKEY *k = NULL;
    X509 *x = NULL;
    X509V3_CTX ctx;
    int rc = -EINVAL;

    memset(out, 0, sizeof(*out));
    if (!common_name || !*common_name || strlen(common_name) > CN_MAX || days == 0 ||
        days > PKI_DAYS_MAX)
        return -EINVAL;
    rc = -EIO;
    k = EVP_EC_gen("P-256");
    if (!k)
        goto out;
    x = new_cert(common_name, NULL, k, days);
    if (!x)
        goto out;
    X509V3_set_ctx(&ctx, x, x, NULL, NULL, 0);
    /* The subject key id first: the authority key id of a self-signed
     * certificate is taken from it. */
    if (add_ext(x, &ctx, NID_basic_constraints, "critical,CA:TRUE,pathlen:0") < 0 ||
        add_ext(x, &ctx, NID_key_usage, "critical,keyCertSign,cRLSign") < 0 ||
        add_ext(x, &ctx, NID_subject_key_identifier, "hash") < 0 ||
        add_ext(x, &ctx, NID_authority_key_identifier, "keyid:always") < 0)
        goto out;
    if (X509_sign(x, k, EVP_sha256()) <= 0)
        goto out;
    rc = write_pem(x, k, out);
out:
    X509_free(x);
    EVP_PKEY_free(k);
    ERR_clear_error();
    return rc;
}

static int push_name(GENERAL_NAMES *gens, const char *name)
{
    unsigned char ip[16];
    GENERAL_NAME *g = GENERAL_NAME_new();
    int iplen = 0;

    if (!g)
        return -ENOMEM;
    if (inet_pton(AF_INET, name, ip) == 1)
        iplen = 4;
    else if (inet_pton(AF_INET6, name, ip) == 1)
        iplen = 16;
    if (iplen) {
        ASN1_OCTET_STRING *os = ASN1_OCTET_STRING_new();
        if (!os || !ASN1_OCTET_STRING_set(os, ip, iplen)) {
            ASN1_OCTET_STRING_free(os);
            goto err;
        }
        GENERAL_NAME_set0_value(g, GEN_IPADD, os);
    } else {
        ASN1_IA5STRING *s;
        if (!valid_dns(name)) {
            GENERAL_NAME_free(g);
            return -EINVAL;
        }
        s = ASN1_IA5STRING_new();
        if (!s || !ASN1_STRING_set(s, name, -1)) {
            ASN1_IA5STRING_free(s);
            goto err;
        }
        GENERAL_NAME_set0_value(g, GEN_DNS, s);
    }
    if (!sk_GENERAL_NAME_push(gens, g))
        goto err;
    return 0;
err:
    GENERAL_NAME_free(g);
    return -ENOMEM;
}

/* The SAN list of `n`, and the first name (the CN) into cn. */
static int san_list(const struct pki_names *n, GENERAL_NAMES **out, char *cn, size_t cnlen)
{
    const char *dom = n->cluster_domain ? n->cluster_domain : PKI_CLUSTER_DOMAIN;
    GENERAL_NAMES *gens;
    char buf[4][DNS_NAME_MAX + 2];
    size_t total = 0;
    int rc = 0;

    if (!!n->service != !!n->namespace || (!n->service && n->n_extra == 0) ||
        (n->n_extra && !n->extra) || n->n_extra > PKI_NAMES_MAX - (n->service ? 4 : 0))
        return -EINVAL;
    gens = sk_GENERAL_NAME_new_null();
    if (!gens)
        return -ENOMEM;
    cn[0] = '\0';
    if (n->service) {
        int w[4];
        w[0] = snprintf(buf[0], sizeof(buf[0]), "%s", n->service);
        w[1] = snprintf(buf[1], sizeof(buf[1]), "%s.%s", n->service, n->namespace);
        w[2] = snprintf(buf[2], sizeof(buf[2]), "%s.%s.svc", n->service, n->namespace);
        w[3] = snprintf(buf[3], sizeof(buf[3]), "%s.%s.svc.%s", n->service, n->namespace, dom);
        for (int i = 0; i < 4 && rc == 0; i++)
            rc = w[i] < 0 || (size_t)w[i] >= sizeof(buf[i]) ? -EINVAL : push_name(gens, buf[i]);
        total = 4;
        /* NAME.NS.svc: what clients in the cluster are told to check. */
        if (rc == 0 && strlen(buf[2]) < cnlen && strlen(buf[2]) <= CN_MAX)
            memcpy(cn, buf[2], strlen(buf[2]) + 1);
    }
    for (size_t i = 0; i < n->n_extra && rc == 0; i++) {
        if (!n->extra[i]) {
            rc = -EINVAL;
            break;
        }
        rc = push_name(gens, n->extra[i]);
        if (rc == 0 && !cn[0] && strlen(n->extra[i]) < cnlen && strlen(n->extra[i]) <= CN_MAX)
            memcpy(cn, n->extra[i], strlen(n->extra[i]) + 1);
        total++;
    }
    if (rc == 0 && total == 0)
        rc = -EINVAL;
    if (rc < 0) {
        GENERAL_NAMES_free(gens);
        return rc;
    }
    if (!cn[0])
        memcpy(cn, "cohort broker", sizeof("cohort broker"));
    *out = gens;
    return 0;
}

int pki_issue_server(const struct pki_pem *ca, const struct pki_names *names, uint32_t days,
                     struct pki_pem *out)
{
    X509 *ca_cert = NULL, *x = NULL;
    EVP_PKEY *ca_key = NULL, *k = NULL;
    GENERAL_NAMES *gens = NULL;
    X509V3_CTX ctx;
    char cn[CN_MAX + 1];
    int rc;

    memset(out, 0, sizeof(*out));
    if (!ca || !names || days == 0 || days > PKI_DAYS_MAX)
        return -EINVAL;
    rc = load_ca(ca->cert, ca->key, &ca_cert, &ca_key);
    if (rc < 0)
        return rc;
    rc = san_list(names, &gens, cn, sizeof(cn));
    if (rc < 0)
        goto out;
    rc = -EIO;
    k = EVP_EC_gen("P-256");
    if (!k)
        goto out;
    x = new_cert(cn, ca_cert, k, days);
    if (!x)
        goto out;
    X509V3_set_ctx(&ctx, ca_cert, x, NULL, NULL, 0);
    if (add_ext(x, &ctx, NID_basic_constraints, "critical,CA:FALSE") < 0 ||
        add_ext(x, &ctx, NID_key_usage, "critical,digitalSignature") < 0 ||
        add_ext(x, &ctx, NID_ext_key_usage, "serverAuth") < 0 ||
        add_ext(x, &ctx, NID_subject_key_identifier, "hash") < 0 ||
        add_ext(x, &ctx, NID_authority_key_identifier, "keyid:always") < 0)
        goto out;
    if (X509_add1_ext_i2d(x, NID_subject_alt_name, gens, 0, X509V3_ADD_DEFAULT) != 1)
        goto out;
    if (X509_sign(x, ca_key, EVP_sha256()) <= 0)
        goto out;
    rc = write_pem(x, k, out);
out:
    GENERAL_NAMES_free(gens);
    X509_free(x);
    EVP_PKEY_free(k);
    X509_free(ca_cert);
    EVP_PKEY_free(ca_key);
    ERR_clear_error();
    return rc;
}

/* src/k8s/pki.h: the certificates of the operator's broker: a self-signed CA,
 * which the operator keeps in a Secret, and the server certificate it issues
 * from that CA each time it starts serving the broker, naming the broker's
 * Service. OpenSSL's libcrypto 3.0; new keys are EC P-256, signatures
 * SHA-256, everything comes in and goes out as PEM.
 *
 *   struct pki_pem ca, srv;
 *   pki_ca_create("cohort broker CA", PKI_CA_DAYS, &ca);
 *   struct pki_names n = { .service = "cohort-broker", .namespace = "ops" };
 *   pki_issue_server(&ca, &n, PKI_SERVER_DAYS, &srv);
 *   ... serve with srv.cert and srv.key; clients trust ca.cert ...
 *   pki_pem_cleanup(&srv);
 *   pki_pem_cleanup(&ca);
 *
 * Input PEM is untrusted text (it comes from a Secret anyone with write
 * access to it can edit): whatever does not parse, does not match or is
 * not a CA is refused with -EINVAL and changes nothing.
 */
#ifndef COHORT_PKI_H
#define COHORT_PKI_H

#include <stddef.h>
#include <stdint.h>

#define PKI_CA_DAYS 3650u           /* about ten years */
#define PKI_SERVER_DAYS 365u
#define PKI_DAYS_MAX 36500u
#define PKI_PEM_MAX (64u * 1024u)   /* a longer certificate or key is refused */
#define PKI_NAMES_MAX 64u           /* subject alternative names per certificate */
#define PKI_CLUSTER_DOMAIN "cluster.local"

/* A certificate and its private key, PEM, NUL-terminated. The key is PKCS#8,
 * unencrypted. Both heap strings, owned by the struct. */
struct pki_pem {
    char *cert;
    char *key;
};

/* Wipes the key and frees both; the struct is left zeroed. NULL fields are
 * fine. */
void pki_pem_cleanup(struct pki_pem *p);

/* A new self-signed CA: a fresh P-256 key, subject CN=`common_name`
 * (O=cohort), basicConstraints CA:TRUE with path length 0, keyUsage
 * keyCertSign and cRLSign, valid from five minutes ago (clock skew) for
 * `days`. Returns 0 and fills *out (caller frees with pki_pem_cleanup),
 * -EINVAL (no name, or days 0 or over PKI_DAYS_MAX), -ENOMEM, -EIO
 * (libcrypto failed). */
int pki_ca_create(const char *common_name, uint32_t days, struct pki_pem *out);

/* Checks a CA for issuing: `cert_pem` is one certificate with
 * basicConstraints CA:TRUE (and keyCertSign if it has a keyUsage), valid
 * now, and `key_pem` is its private key (EC or RSA). Sets *not_after
 * (seconds since the epoch) unless NULL. Returns 0, -EINVAL (does not
 * parse, over PKI_PEM_MAX, not a CA, key and certificate do not match),
 * -EKEYEXPIRED (expired or not valid yet). */
int pki_ca_check(const char *cert_pem, const char *key_pem, int64_t *not_after);

/* The names a server certificate carries as subjectAltNames. */
struct pki_names {
    /* A Service: NAME, NAME.NS, NAME.NS.svc and NAME.NS.svc.DOMAIN
     * (DOMAIN: cluster_domain, NULL for cluster.local). Both or neither. */
    const char *service, *namespace, *cluster_domain;
    /* More names, each a DNS name or an IP address (v4 or v6, as text):
     * an IP literal becomes an IP SAN. Borrowed. */
    const char *const *extra;
    size_t n_extra;
};

/* A server certificate for `names` signed by `ca` (checked as
 * pki_ca_check does), with a fresh P-256 key: CN the first name,
 * basicConstraints CA:FALSE, keyUsage digitalSignature, extendedKeyUsage
 * serverAuth, valid for `days` from five minutes ago but never past the
 * CA's notAfter. Returns 0 and fills *out (caller frees with
 * pki_pem_cleanup), -EINVAL (the CA as pki_ca_check, no name, more than
 * PKI_NAMES_MAX, a name that is neither a DNS name nor an IP, days 0 or
 * over PKI_DAYS_MAX), -EKEYEXPIRED (the CA), -ENOMEM, -EIO. */
int pki_issue_server(const struct pki_pem *ca, const struct pki_names *names, uint32_t days,
                     struct pki_pem *out);

/* notAfter of the first certificate in `cert_pem`, in seconds since the
 * epoch. Returns 0 or -EINVAL. */
int pki_not_after(const char *cert_pem, int64_t *out);

#endif

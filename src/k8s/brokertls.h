/* src/k8s/brokertls.h: TLS for the operator's broker. The CA lives in a
 * Secret in the operator's namespace (default cohort-broker-ca, type
 * kubernetes.io/tls: tls.crt, tls.key, and ca.crt the same certificate),
 * made on first use; each time a replica starts leading it reads the CA
 * and issues the broker a fresh server certificate (pki.h) naming the
 * broker's Service, which the broker serves with. Every cohort's Secret
 * carries the CA certificate (keys.h), so sidecars trust exactly it.
 *
 * Two replicas racing to make the CA both create; the API server lets one
 * win (409 AlreadyExists for the other), and the loser reads the winner's.
 * A Secret of that name that does not hold a usable CA (one cohort-operator
 * did not make, edited, or expired) is never overwritten: loading fails
 * with a log line saying how to fix it. To bring your own CA, create the
 * Secret with tls.crt (a CA certificate) and tls.key before the operator
 * starts.
 */
#ifndef COHORT_BROKERTLS_H
#define COHORT_BROKERTLS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "k8s/pki.h"

struct kube;

#define BROKERTLS_SECRET "cohort-broker-ca"
#define BROKERTLS_SERVICE "cohort-broker"

struct brokertls_config {
    struct kube *kube;          /* borrowed */
    const char *namespace;      /* the operator's: where the CA Secret and the Service are */
    const char *secret;         /* the CA Secret's name; NULL: BROKERTLS_SECRET */
    const char *service;        /* the broker Service's name; NULL: BROKERTLS_SERVICE */
    const char *const *extra;   /* more names for the certificate (DNS or IP); borrowed */
    size_t n_extra;
};

/* What the broker serves with and what its clients check. Owned. */
struct brokertls {
    char *ca_pem;               /* the CA certificate: what clients trust */
    struct pki_pem server;      /* the broker's certificate and key */
    char server_name[300];      /* SERVICE.NAMESPACE.svc: what clients check */
    int64_t not_after;          /* the server certificate's, seconds since the epoch */
    bool created;               /* this call made the CA Secret */
};

/* Reads the CA Secret (making it if there is none) and issues a server
 * certificate for the Service's names and `extra`, valid PKI_SERVER_DAYS.
 * Returns 0 and fills *out (caller frees with brokertls_cleanup), -EINVAL
 * (a bad config, or a Secret without a usable CA: logged), -EKEYEXPIRED
 * (its CA expired: logged), or the API's -errno. */
int brokertls_load(const struct brokertls_config *cfg, struct brokertls *out);
/* Wipes the key and frees everything; NULL is fine. */
void brokertls_cleanup(struct brokertls *t);

#endif

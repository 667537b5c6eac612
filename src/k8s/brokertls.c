/* src/k8s/brokertls.c: see brokertls.h. */
#include "k8s/brokertls.h"

#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cjson/cJSON.h>

#include "base/ident.h"
#include "base/log.h"
#include "k8s/kube.h"

#define CA_NAME "cohort broker CA"
#define WARN_DAYS 180               /* a CA closer to its end than this is logged */

void brokertls_cleanup(struct brokertls *t)
{
    if (!t)
        return;
    free(t->ca_pem);
    pki_pem_cleanup(&t->server);
    memset(t, 0, sizeof(*t));
}

static bool add_b64(cJSON *data, const char *k, const char *v)
{
    char *b = kube_base64(v, strlen(v));
    bool ok = b && cJSON_AddStringToObject(data, k, b);

    if (b)
        explicit_bzero(b, strlen(b));
    free(b);
    return ok;
}

/* The CA Secret's object: kubernetes.io/tls, so that tools and other
 * controllers know what it holds. */
static cJSON *ca_secret(const char *ns, const char *name, const struct pki_pem *ca)
{
    cJSON *s = cJSON_CreateObject(), *m, *labels, *data;

    if (!s)
        return NULL;
    cJSON_AddStringToObject(s, "apiVersion", "v1");
    cJSON_AddStringToObject(s, "kind", "Secret");
    m = cJSON_AddObjectToObject(s, "metadata");
    cJSON_AddStringToObject(m, "name", name);
    cJSON_AddStringToObject(m, "namespace", ns);
    labels = cJSON_AddObjectToObject(m, "labels");
    cJSON_AddStringToObject(labels, "app.kubernetes.io/managed-by", "cohort-operator");
    cJSON_AddStringToObject(labels, "app.kubernetes.io/component", "broker-ca");
    cJSON_AddStringToObject(s, "type", "kubernetes.io/tls");
    data = cJSON_AddObjectToObject(s, "data");
    if (!data || !add_b64(data, "tls.crt", ca->cert) || !add_b64(data, "tls.key", ca->key) ||
        !add_b64(data, "ca.crt", ca->cert) || !cJSON_GetObjectItemCaseSensitive(s, "type")) {
        cJSON_Delete(s);
        return NULL;
    }
    return s;
}

/* Reads the CA Secret, or makes it when there is none. Sets *created. */
static int get_or_make(const struct brokertls_config *cfg, const char *name, cJSON **sec,
                       bool *created)
{
    char path[512], coll[512];
    struct pki_pem ca = { 0 };
    cJSON *obj = NULL;
    int rc;

    snprintf(path, sizeof(path), "/api/v1/namespaces/%s/secrets/%s", cfg->namespace, name);
    snprintf(coll, sizeof(coll), "/api/v1/namespaces/%s/secrets", cfg->namespace);
    rc = kube_get(cfg->kube, path, sec);
    if (rc != -ENOENT)
        return rc;
    rc = pki_ca_create(CA_NAME, PKI_CA_DAYS, &ca);
    if (rc < 0)
        return rc;
    obj = ca_secret(cfg->namespace, name, &ca);
    pki_pem_cleanup(&ca);
    if (!obj)
        return -ENOMEM;
    rc = kube_create_object(cfg->kube, coll, obj, sec);
    cJSON_Delete(obj);
    if (rc == 0) {
        *created = true;
        log_info("brokertls", "Made the broker's CA and stored it in a Secret.",
                 LF_S("secret", name), LF_S("namespace", cfg->namespace));
    } else if (rc == -EEXIST) {
        /* Another replica made it between our get and our create: its CA
         * is the one. */
        rc = kube_get(cfg->kube, path, sec);
    }
    return rc;
}

int brokertls_load(const struct brokertls_config *cfg, struct brokertls *out)
{
    const char *name = cfg && cfg->secret ? cfg->secret : BROKERTLS_SECRET;
    const char *svc = cfg && cfg->service ? cfg->service : BROKERTLS_SERVICE;
    struct pki_pem ca = { 0 };
    struct pki_names names;
    cJSON *sec = NULL;
    int64_t ca_end = 0;
    int rc, w;

    memset(out, 0, sizeof(*out));
    if (!cfg || !cfg->kube || !cfg->namespace || !*cfg->namespace ||
        strlen(cfg->namespace) > 63 || strlen(name) > IDENT_NAME_MAX || strlen(svc) > 63)
        return -EINVAL;
    rc = get_or_make(cfg, name, &sec, &out->created);
    if (rc < 0) {
        log_error("brokertls", "The broker's CA Secret could not be read or made.",
                  LF_S("secret", name), LF_S("namespace", cfg->namespace), LF_S("error", kube_strerror(rc)));
        goto out;
    }
    if (kube_secret_data(sec, "tls.crt", &ca.cert, NULL) < 0 ||
        kube_secret_data(sec, "tls.key", &ca.key, NULL) < 0)
        rc = -EINVAL;
    else
        rc = pki_ca_check(ca.cert, ca.key, &ca_end);
    if (rc < 0) {
        log_error("brokertls", rc == -EKEYEXPIRED
                  ? "The broker's CA has expired (or is not valid yet); the Secret is left as it "
                    "is: delete it and a new CA is made, and every cohort's pods are replaced."
                  : "The broker's CA Secret holds no usable CA (tls.crt must be a CA certificate "
                    "and tls.key its private key); it is left as it is: fix or delete it.",
                  LF_S("secret", name), LF_S("namespace", cfg->namespace), LF_S("error", kube_strerror(rc)));
        goto out;
    }
    if (ca_end - (int64_t)time(NULL) < (int64_t)WARN_DAYS * 86400)
        log_warn("brokertls", "The broker's CA expires within 180 days: delete its Secret (a new "
                 "CA is made and every cohort's pods are replaced) or put a new one in it.",
                 LF_S("secret", name), LF_S("namespace", cfg->namespace), LF_I("not_after", ca_end));
    names = (struct pki_names){ .service = svc, .namespace = cfg->namespace,
                                .extra = cfg->extra, .n_extra = cfg->n_extra };
    rc = pki_issue_server(&ca, &names, PKI_SERVER_DAYS, &out->server);
    if (rc < 0) {
        log_error("brokertls", "The broker's certificate could not be issued.",
                  LF_S("service", svc), LF_S("error", kube_strerror(rc)));
        goto out;
    }
    rc = -ENOMEM;
    out->ca_pem = strdup(ca.cert);
    w = snprintf(out->server_name, sizeof(out->server_name), "%s.%s.svc", svc, cfg->namespace);
    if (!out->ca_pem || w < 0 || (size_t)w >= sizeof(out->server_name))
        goto out;
    rc = pki_not_after(out->server.cert, &out->not_after);
out:
    pki_pem_cleanup(&ca);
    cJSON_Delete(sec);
    if (rc < 0)
        brokertls_cleanup(out);
    return rc;
}

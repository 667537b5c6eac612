/* src/k8s/keys.c: see keys.h. */
#include "k8s/keys.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/ident.h"
#include "k8s/kube.h"

static const cJSON *get(const cJSON *o, const char *k)
{
    return cJSON_GetObjectItemCaseSensitive(o, k);
}

static const char *str(const cJSON *o, const char *k)
{
    const cJSON *v = get(o, k);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

/* Adds data[k] = base64(p, n); false when out of memory. */
static bool add_data(cJSON *data, const char *k, const void *p, size_t n)
{
    char *b = kube_base64(p, n);
    bool ok = b && cJSON_AddStringToObject(data, k, b);

    /* The base64 of a key is as secret as the key. */
    if (b)
        explicit_bzero(b, strlen(b));
    free(b);
    return ok;
}

int keys_secret(const cJSON *tc, const struct secret *key, const char *ca_pem, cJSON **out)
{
    const cJSON *meta = get(tc, "metadata");
    const char *name = str(meta, "name"), *ns = str(meta, "namespace"), *uid = str(meta, "uid");
    char sname[IDENT_NAME_MAX + 1], hex[SECRET_HEX_CHARS + 1];
    cJSON *s, *m, *data;
    bool ok;

    *out = NULL;
    if (!name || !ns || !uid || reconcile_secret_name(name, sname, sizeof(sname)) < 0)
        return -EINVAL;
    s = cJSON_CreateObject();
    if (!s)
        return -ENOMEM;
    cJSON_AddStringToObject(s, "apiVersion", "v1");
    cJSON_AddStringToObject(s, "kind", "Secret");
    m = cJSON_AddObjectToObject(s, "metadata");
    cJSON_AddStringToObject(m, "name", sname);
    cJSON_AddStringToObject(m, "namespace", ns);
    cJSON_AddStringToObject(cJSON_AddObjectToObject(m, "labels"), RECONCILE_LABEL_COHORT, name);
    reconcile_add_owner(m, name, uid);
    cJSON_AddStringToObject(s, "type", "Opaque");
    data = cJSON_AddObjectToObject(s, "data");
    secret_format(key, hex);
    ok = data && add_data(data, RECONCILE_SECRET_KEY, hex, SECRET_HEX_CHARS);
    explicit_bzero(hex, sizeof(hex));
    if (ok && ca_pem)
        ok = add_data(data, RECONCILE_SECRET_CA, ca_pem, strlen(ca_pem));
    /* cJSON reports allocation failures only by leaving things out. */
    if (!ok || !str(cJSON_GetArrayItem(get(m, "ownerReferences"), 0), "uid") || !get(s, "type")) {
        cJSON_Delete(s);
        return -ENOMEM;
    }
    *out = s;
    return 0;
}

static bool owned_by(const cJSON *obj, const char *uid)
{
    const cJSON *ref;

    cJSON_ArrayForEach(ref, get(get(obj, "metadata"), "ownerReferences")) {
        const char *u = str(ref, "uid"), *kind = str(ref, "kind");
        if (u && kind && strcmp(u, uid) == 0 && strcmp(kind, RECONCILE_KIND) == 0)
            return true;
    }
    return false;
}

static int refuse(struct reconcile_why *why, const char *reason, const char *msg,
                  const char *ns, const char *sname)
{
    snprintf(why->reason, sizeof(why->reason), "%s", reason);
    snprintf(why->message, sizeof(why->message), msg, ns, sname);
    return -EINVAL;
}

int keys_adopt(const cJSON *tc, const cJSON *secret, struct secret *key,
               struct reconcile_why *why)
{
    const cJSON *meta = get(tc, "metadata");
    const char *uid = str(meta, "uid"), *ns = str(meta, "namespace");
    const char *sname = kube_meta(secret, "name");
    char *text = NULL;
    size_t len = 0;
    int rc;

    memset(why, 0, sizeof(*why));
    if (!ns)
        ns = "";
    if (!sname)
        sname = "";
    if (!uid || !owned_by(secret, uid))
        return refuse(why, "SecretConflict", "Secret %s/%s exists and is not owned by this "
                      "TrainingCohort; the operator does not overwrite it: delete or rename it, "
                      "and a new one is made", ns, sname);
    rc = kube_secret_data(secret, RECONCILE_SECRET_KEY, &text, &len);
    if (rc == -ENOMEM)
        return rc;
    rc = rc == 0 ? secret_parse(text, len, key) : -EINVAL;
    if (text)
        explicit_bzero(text, len);
    free(text);
    if (rc < 0)
        return refuse(why, "SecretInvalid", "Secret %s/%s holds no key (data.key must be 64 "
                      "hexadecimal digits); delete it and a new key is made", ns, sname);
    return 0;
}

int keys_ca_patch(const cJSON *secret, const char *ca_pem, cJSON **out)
{
    char *have = NULL;
    size_t len = 0;
    int rc = kube_secret_data(secret, RECONCILE_SECRET_CA, &have, &len);
    bool same;
    cJSON *patch, *data;

    *out = NULL;
    if (rc == -ENOMEM)
        return rc;
    if (rc == -ENOENT)
        same = ca_pem == NULL;
    else
        same = rc == 0 && ca_pem && len == strlen(ca_pem) && memcmp(have, ca_pem, len) == 0;
    free(have);
    if (same)
        return 0;
    patch = cJSON_CreateObject();
    data = patch ? cJSON_AddObjectToObject(patch, "data") : NULL;
    if (!data) {
        cJSON_Delete(patch);
        return -ENOMEM;
    }
    if (ca_pem ? !add_data(data, RECONCILE_SECRET_CA, ca_pem, strlen(ca_pem))
               : !cJSON_AddNullToObject(data, RECONCILE_SECRET_CA)) {
        cJSON_Delete(patch);
        return -ENOMEM;
    }
    *out = patch;
    return 0;
}

int keys_id(const struct secret *key, const char *ca_pem, char out[KEYS_ID_CHARS + 1])
{
    static const char digits[] = "0123456789abcdef";
    const char *ca = ca_pem ? ca_pem : "";
    struct secret_part part = SECRET_STR(ca);
    uint8_t mac[SECRET_MAC_BYTES];

    if (secret_mac(key, "cohort/key-id/v1", &part, 1, mac) < 0)
        return -EIO;
    for (size_t i = 0; i < KEYS_ID_CHARS / 2; i++) {
        out[2 * i] = digits[mac[i] >> 4];
        out[2 * i + 1] = digits[mac[i] & 15];
    }
    out[KEYS_ID_CHARS] = '\0';
    return 0;
}

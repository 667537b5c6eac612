/* src/k8s/kube.c: see kube.h. */
#include "k8s/kube.h"

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <curl/curl.h>
#include <yaml.h>

#include "base/clock.h"
#include "base/log.h"
#include "k8s/execcred.h"

#define DEFAULT_MAX_BODY (32u * 1024u * 1024u)
#define DEFAULT_TIMEOUT_MS 30000u
#define DEFAULT_PAGE 500u
#define TOKEN_MAX (64u * 1024u)         /* a service-account token is ~1 KiB */
#define FILE_MAX (1024u * 1024u)        /* kubeconfig, CA bundle */
#define YAML_DEPTH_MAX 64
#define SA_DIR "/var/run/secrets/kubernetes.io/serviceaccount"

struct kube {
    pthread_mutex_t lock;       /* guards req and the token */
    CURL *req;                  /* reused: keeps the connection open */
    struct kube_config cfg;
    struct kube_opts opts;
    char *token;                /* current bearer token */
    struct timespec token_mtime;
    struct execcred *exec;      /* the exec plugin, or NULL */
    char *exec_cert, *exec_key; /* its client certificate, when it gives one */
    int exec_rc;                /* why the last plugin run failed, or 0 */
    uint64_t auth_fail_ms;      /* since when no credential got through; 0: it does */
    char auth_why[600];
    char exec_why[EXECCRED_WHY_MAX];
    atomic_uint_fast64_t n_requests, n_failures, n_watches;
};

static void err_set(int rc, long code, const cJSON *status, const char *transport);
static void err_clear(void);

/* ---- small helpers ----------------------------------------------------- */

static char *dup_or_null(const char *s)
{
    return s ? strdup(s) : NULL;
}

static char *dup_mem(const char *p, size_t n)
{
    char *d = malloc(n + 1);

    if (d) {
        memcpy(d, p, n);
        d[n] = '\0';
    }
    return d;
}

/* Reads a whole small file. Returns 0, -ENOENT, -EFBIG (over cap), -EIO,
 * -ENOMEM; the caller frees *out. */
static int read_file(const char *path, size_t cap, char **out, size_t *len)
{
    FILE *f = fopen(path, "rb");
    char *buf;
    size_t n;

    if (!f)
        return errno == ENOENT ? -ENOENT : -EIO;
    buf = malloc(cap + 1);
    if (!buf) {
        fclose(f);
        return -ENOMEM;
    }
    n = fread(buf, 1, cap + 1, f);
    fclose(f);
    if (n > cap) {
        free(buf);
        return -EFBIG;
    }
    buf[n] = '\0';
    *out = buf;
    if (len)
        *len = n;
    return 0;
}

static void trim_right(char *s)
{
    size_t n = strlen(s);

    while (n > 0 && (s[n - 1] == '\n' || s[n - 1] == '\r' || s[n - 1] == ' '))
        s[--n] = '\0';
}

static int b64_val(int c)
{
    if (c >= 'A' && c <= 'Z')
        return c - 'A';
    if (c >= 'a' && c <= 'z')
        return c - 'a' + 26;
    if (c >= '0' && c <= '9')
        return c - '0' + 52;
    if (c == '+')
        return 62;
    if (c == '/')
        return 63;
    return -1;
}

/* Standard base64, whitespace ignored. Returns 0 or -EINVAL/-ENOMEM. */
static int b64_decode(const char *in, char **out, size_t *outlen)
{
    size_t n = strlen(in), o = 0;
    unsigned acc = 0;
    int bits = 0;
    char *buf = malloc(n / 4 * 3 + 4);

    if (!buf)
        return -ENOMEM;
    for (size_t i = 0; i < n; i++) {
        int c = (unsigned char)in[i], v;
        if (c == '=' || c == '\n' || c == '\r' || c == ' ' || c == '\t')
            continue;
        v = b64_val(c);
        if (v < 0) {
            free(buf);
            return -EINVAL;
        }
        acc = (acc << 6) | (unsigned)v;
        bits += 6;
        if (bits >= 8) {
            bits -= 8;
            buf[o++] = (char)((acc >> bits) & 0xff);
        }
    }
    buf[o] = '\0';
    *out = buf;
    *outlen = o;
    return 0;
}

int kube_secret_data(const cJSON *secret, const char *key, char **out, size_t *len)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(
        cJSON_GetObjectItemCaseSensitive(secret, "data"), key);
    size_t n = 0;
    int rc;

    *out = NULL;
    if (!v)
        return -ENOENT;
    if (!cJSON_IsString(v))
        return -EINVAL;
    rc = b64_decode(v->valuestring, out, &n);
    if (rc == 0 && len)
        *len = n;
    return rc;
}

char *kube_base64(const void *p, size_t n)
{
    static const char abc[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    const unsigned char *b = p;
    char *out = malloc((n + 2) / 3 * 4 + 1), *o = out;

    if (!out)
        return NULL;
    for (size_t i = 0; i < n; i += 3) {
        unsigned v = (unsigned)b[i] << 16 | (i + 1 < n ? (unsigned)b[i + 1] << 8 : 0) |
                     (i + 2 < n ? b[i + 2] : 0);
        *o++ = abc[v >> 18 & 63];
        *o++ = abc[v >> 12 & 63];
        *o++ = i + 1 < n ? abc[v >> 6 & 63] : '=';
        *o++ = i + 2 < n ? abc[v & 63] : '=';
    }
    *o = '\0';
    return out;
}

const char *kube_meta(const cJSON *obj, const char *field)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(
        cJSON_GetObjectItemCaseSensitive(obj, "metadata"), field);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

/* ---- YAML to cJSON ------------------------------------------------------ */

/* Every scalar becomes a string: kubeconfig readers decide what a value
 * means ("true" for insecure-skip-tls-verify), and YAML 1.1's implicit
 * typing ("no" is false) is a well-known trap. */
static cJSON *yaml_node(yaml_document_t *doc, yaml_node_t *node, int depth)
{
    cJSON *out = NULL;

    if (!node || depth > YAML_DEPTH_MAX)
        return NULL;
    switch (node->type) {
    case YAML_SCALAR_NODE:
        return cJSON_CreateString((const char *)node->data.scalar.value);
    case YAML_SEQUENCE_NODE:
        out = cJSON_CreateArray();
        for (yaml_node_item_t *it = node->data.sequence.items.start;
             out && it < node->data.sequence.items.top; it++) {
            cJSON *v = yaml_node(doc, yaml_document_get_node(doc, *it), depth + 1);
            if (!v) {
                cJSON_Delete(out);
                return NULL;
            }
            cJSON_AddItemToArray(out, v);
        }
        return out;
    case YAML_MAPPING_NODE:
        out = cJSON_CreateObject();
        for (yaml_node_pair_t *p = node->data.mapping.pairs.start;
             out && p < node->data.mapping.pairs.top; p++) {
            yaml_node_t *k = yaml_document_get_node(doc, p->key);
            cJSON *v = yaml_node(doc, yaml_document_get_node(doc, p->value), depth + 1);
            if (!k || k->type != YAML_SCALAR_NODE || !v) {
                cJSON_Delete(v);
                cJSON_Delete(out);
                return NULL;
            }
            cJSON_AddItemToObject(out, (const char *)k->data.scalar.value, v);
        }
        return out;
    default:
        return NULL;
    }
}

static cJSON *yaml_parse(const char *text, size_t len)
{
    yaml_parser_t parser;
    yaml_document_t doc;
    cJSON *out = NULL;

    if (!yaml_parser_initialize(&parser))
        return NULL;
    yaml_parser_set_input_string(&parser, (const unsigned char *)text, len);
    if (yaml_parser_load(&parser, &doc)) {
        out = yaml_node(&doc, yaml_document_get_root_node(&doc), 0);
        yaml_document_delete(&doc);
    }
    yaml_parser_delete(&parser);
    return out;
}

/* ---- configuration ------------------------------------------------------ */

void kube_config_cleanup(struct kube_config *c)
{
    free(c->server);
    free(c->token);
    free(c->token_file);
    free(c->ca_file);
    free(c->ca_data);
    free(c->cert_file);
    free(c->key_file);
    free(c->cert_data);
    free(c->key_data);
    free(c->namespace);
    cJSON_Delete(c->exec);
    memset(c, 0, sizeof(*c));
}

int kube_config_in_cluster(const char *sa_dir, struct kube_config *c)
{
    const char *host = getenv("KUBERNETES_SERVICE_HOST");
    const char *port = getenv("KUBERNETES_SERVICE_PORT");
    char path[PATH_MAX], server[300];
    char *ns = NULL;
    struct stat st;

    memset(c, 0, sizeof(*c));
    if (!sa_dir)
        sa_dir = SA_DIR;
    if (!host || !*host || !port || !*port)
        return -ENOENT;
    snprintf(path, sizeof(path), "%s/token", sa_dir);
    if (stat(path, &st) < 0)
        return -ENOENT;
    /* An IPv6 service host needs brackets in a URL. */
    snprintf(server, sizeof(server), strchr(host, ':') ? "https://[%s]:%s" : "https://%s:%s", host,
             port);
    c->server = strdup(server);
    c->token_file = strdup(path);
    snprintf(path, sizeof(path), "%s/ca.crt", sa_dir);
    c->ca_file = strdup(path);
    snprintf(path, sizeof(path), "%s/namespace", sa_dir);
    if (read_file(path, 256, &ns, NULL) == 0) {
        trim_right(ns);
        c->namespace = ns;
    } else {
        c->namespace = strdup("default");
    }
    if (!c->server || !c->token_file || !c->ca_file || !c->namespace) {
        kube_config_cleanup(c);
        return -ENOMEM;
    }
    return 0;
}

/* The entry of list `arr` whose "name" is `name`, or NULL. */
static const cJSON *named(const cJSON *arr, const char *name)
{
    const cJSON *it;

    cJSON_ArrayForEach(it, arr) {
        const cJSON *n = cJSON_GetObjectItemCaseSensitive(it, "name");
        if (cJSON_IsString(n) && name && strcmp(n->valuestring, name) == 0)
            return it;
    }
    return NULL;
}

static const char *str_field(const cJSON *o, const char *k)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

/* A kubeconfig path is relative to the kubeconfig's own directory. */
static char *resolve(const char *dir, const char *p)
{
    char *out;

    if (!p)
        return NULL;
    if (p[0] == '/')
        return strdup(p);
    return asprintf(&out, "%s/%s", dir, p) < 0 ? NULL : out;
}

static int decode_field(const cJSON *o, const char *k, char **out, size_t *len)
{
    const char *v = str_field(o, k);

    if (!v)
        return 0;
    return b64_decode(v, out, len);
}

int kube_config_load(const char *path, const char *context, struct kube_config *c)
{
    const cJSON *ctx, *cluster, *user;
    char *text = NULL, dir[PATH_MAX];
    const char *slash;
    cJSON *root;
    size_t len;
    int rc;

    memset(c, 0, sizeof(*c));
    rc = read_file(path, FILE_MAX, &text, &len);
    if (rc < 0)
        return rc == -EFBIG ? -EINVAL : rc;
    root = yaml_parse(text, len);     /* JSON is YAML too */
    free(text);
    if (!root || !cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return -EINVAL;
    }
    slash = strrchr(path, '/');
    snprintf(dir, sizeof(dir), "%.*s", slash ? (int)(slash - path) : 1, slash ? path : ".");
    if (!context)
        context = str_field(root, "current-context");
    ctx = cJSON_GetObjectItemCaseSensitive(named(cJSON_GetObjectItemCaseSensitive(root, "contexts"),
                                                 context), "context");
    if (!ctx) {
        rc = -ENOENT;
        goto out;
    }
    cluster = cJSON_GetObjectItemCaseSensitive(
        named(cJSON_GetObjectItemCaseSensitive(root, "clusters"), str_field(ctx, "cluster")), "cluster");
    user = cJSON_GetObjectItemCaseSensitive(
        named(cJSON_GetObjectItemCaseSensitive(root, "users"), str_field(ctx, "user")), "user");
    if (!cluster || !str_field(cluster, "server")) {
        rc = -ENOENT;
        goto out;
    }
    c->server = strdup(str_field(cluster, "server"));
    c->namespace = strdup(str_field(ctx, "namespace") ? str_field(ctx, "namespace") : "default");
    c->ca_file = resolve(dir, str_field(cluster, "certificate-authority"));
    c->insecure = str_field(cluster, "insecure-skip-tls-verify") &&
                  strcmp(str_field(cluster, "insecure-skip-tls-verify"), "true") == 0;
    if ((rc = decode_field(cluster, "certificate-authority-data", &c->ca_data, &c->ca_data_len)) < 0)
        goto out;
    if (user) {
        c->token = dup_or_null(str_field(user, "token"));
        c->token_file = resolve(dir, str_field(user, "tokenFile"));
        c->cert_file = resolve(dir, str_field(user, "client-certificate"));
        c->key_file = resolve(dir, str_field(user, "client-key"));
        if ((rc = decode_field(user, "client-certificate-data", &c->cert_data, &c->cert_data_len)) < 0 ||
            (rc = decode_field(user, "client-key-data", &c->key_data, &c->key_data_len)) < 0)
            goto out;
        if (cJSON_GetObjectItemCaseSensitive(user, "exec")) {
            const cJSON *ex = cJSON_GetObjectItemCaseSensitive(user, "exec");
            if (!cJSON_IsObject(ex)) {
                rc = -EINVAL;
                goto out;
            }
            if (!(c->exec = cJSON_Duplicate(ex, 1))) {
                rc = -ENOMEM;
                goto out;
            }
        }
    }
    rc = c->server && c->namespace ? 0 : -ENOMEM;
out:
    cJSON_Delete(root);
    if (rc < 0)
        kube_config_cleanup(c);
    return rc;
}

/* ---- the client --------------------------------------------------------- */

static int copy_blob(char **dst, size_t *dlen, const char *src, size_t len)
{
    if (!src)
        return 0;
    *dst = dup_mem(src, len);
    *dlen = len;
    return *dst ? 0 : -ENOMEM;
}

static void curl_once(void)
{
    curl_global_init(CURL_GLOBAL_DEFAULT);
}

int kube_create(const struct kube_config *c, const struct kube_opts *opts, struct kube **out)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    struct kube *k;

    err_clear();
    if (!c || !c->server || !*c->server)
        return -EINVAL;
    /* curl_global_init is not thread-safe: once per process. */
    pthread_once(&once, curl_once);
    k = calloc(1, sizeof(*k));
    if (!k)
        return -ENOMEM;
    pthread_mutex_init(&k->lock, NULL);
    k->opts.max_body = opts && opts->max_body ? opts->max_body : DEFAULT_MAX_BODY;
    k->opts.timeout_ms = opts && opts->timeout_ms ? opts->timeout_ms : DEFAULT_TIMEOUT_MS;
    k->opts.list_page = opts && opts->list_page ? opts->list_page : DEFAULT_PAGE;
    k->cfg.server = strdup(c->server);
    k->cfg.token = dup_or_null(c->token);
    k->cfg.token_file = dup_or_null(c->token_file);
    k->cfg.ca_file = dup_or_null(c->ca_file);
    k->cfg.cert_file = dup_or_null(c->cert_file);
    k->cfg.key_file = dup_or_null(c->key_file);
    k->cfg.namespace = strdup(c->namespace ? c->namespace : "default");
    k->cfg.insecure = c->insecure;
    k->req = curl_easy_init();
    if (c->exec) {
        char *ca64 = c->ca_data ? kube_base64(c->ca_data, c->ca_data_len) : NULL;
        struct execcred_cluster cl = { .server = c->server, .ca_data_b64 = ca64,
                                       .insecure = c->insecure };
        char why[EXECCRED_WHY_MAX] = "";
        int rc = (c->ca_data && !ca64) ? -ENOMEM
                                       : execcred_create(c->exec, &cl, NULL, &k->exec, why,
                                                         sizeof(why));
        free(ca64);
        if (rc < 0) {
            /* The caller's one log line says why (kube_strerror). */
            err_set(rc, 0, NULL, why[0] ? why : NULL);
            kube_destroy(k);
            return rc;
        }
    }
    if (!k->cfg.server || !k->cfg.namespace || !k->req ||
        copy_blob(&k->cfg.ca_data, &k->cfg.ca_data_len, c->ca_data, c->ca_data_len) < 0 ||
        copy_blob(&k->cfg.cert_data, &k->cfg.cert_data_len, c->cert_data, c->cert_data_len) < 0 ||
        copy_blob(&k->cfg.key_data, &k->cfg.key_data_len, c->key_data, c->key_data_len) < 0) {
        kube_destroy(k);
        return -ENOMEM;
    }
    *out = k;
    return 0;
}

void kube_destroy(struct kube *k)
{
    if (!k)
        return;
    if (k->req)
        curl_easy_cleanup(k->req);
    kube_config_cleanup(&k->cfg);
    execcred_destroy(k->exec);
    free(k->exec_cert);
    free(k->exec_key);
    free(k->token);
    pthread_mutex_destroy(&k->lock);
    free(k);
}

const char *kube_namespace(const struct kube *k)
{
    return k->cfg.namespace;
}

/* Re-reads the token file when it changed (projected tokens rotate) or
 * when `force` (after a 401). Lock held. */
static void refresh_exec_locked(struct kube *k, bool force)
{
    const struct execcred_cred *cred;
    char *tok = NULL, *cert = NULL, *key = NULL;
    int rc = execcred_get(k->exec, (int64_t)clock_wall_ms(), force, &cred, k->exec_why,
                          sizeof(k->exec_why));

    if (rc < 0) {
        /* Said once per failure streak, not per request. */
        if (!k->exec_rc)
            log_warn("kube", "The exec credential plugin gave no credential.",
                      LF_S("why", k->exec_why));
        k->exec_rc = rc;
        return;
    }
    k->exec_rc = 0;
    if ((cred->token && !(tok = strdup(cred->token))) ||
        (cred->cert_pem && (!(cert = strdup(cred->cert_pem)) || !(key = strdup(cred->key_pem))))) {
        free(tok);
        free(cert);
        free(key);
        k->exec_rc = -ENOMEM;
        snprintf(k->exec_why, sizeof(k->exec_why), "out of memory");
        return;
    }
    free(k->token);
    free(k->exec_cert);
    if (k->exec_key)
        explicit_bzero(k->exec_key, strlen(k->exec_key));
    free(k->exec_key);
    k->token = tok;
    k->exec_cert = cert;
    k->exec_key = key;
}

static void refresh_token_locked(struct kube *k, bool force)
{
    struct stat st;
    char *t = NULL;

    if (k->exec) {
        refresh_exec_locked(k, force);
        return;
    }
    if (!k->cfg.token_file) {
        if (!k->token && k->cfg.token)
            k->token = strdup(k->cfg.token);
        return;
    }
    if (stat(k->cfg.token_file, &st) < 0)
        return;
    if (!force && k->token && st.st_mtim.tv_sec == k->token_mtime.tv_sec &&
        st.st_mtim.tv_nsec == k->token_mtime.tv_nsec)
        return;
    if (read_file(k->cfg.token_file, TOKEN_MAX, &t, NULL) < 0)
        return;
    trim_right(t);
    free(k->token);
    k->token = t;
    k->token_mtime = st.st_mtim;
}

struct body {
    char *buf;
    size_t len, cap, max;
    bool too_big;
};

static size_t body_write(char *p, size_t size, size_t n, void *arg)
{
    struct body *b = arg;
    size_t add = size * n;

    if (b->len + add > b->max) {
        b->too_big = true;
        return 0;       /* aborts the transfer */
    }
    if (b->len + add + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        char *nb;
        while (cap < b->len + add + 1)
            cap *= 2;
        nb = realloc(b->buf, cap);
        if (!nb)
            return 0;
        b->buf = nb;
        b->cap = cap;
    }
    memcpy(b->buf + b->len, p, add);
    b->len += add;
    b->buf[b->len] = '\0';
    return add;
}

/* Applies the connection settings every request shares. */
static struct curl_slist *setup(struct kube *k, CURL *h, const char *method, const char *url,
                                const char *content_type, bool stream)
{
    struct curl_slist *hdr = NULL;
    char auth[TOKEN_MAX + 32];

    curl_easy_reset(h);
    curl_easy_setopt(h, CURLOPT_URL, url);
    curl_easy_setopt(h, CURLOPT_CUSTOMREQUEST, method);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_USERAGENT, "cohort-operator");
    curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, 10000L);
    curl_easy_setopt(h, CURLOPT_TCP_KEEPALIVE, 1L);
    if (!stream)
        curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, (long)k->opts.timeout_ms);
    if (k->cfg.insecure) {
        curl_easy_setopt(h, CURLOPT_SSL_VERIFYPEER, 0L);
        curl_easy_setopt(h, CURLOPT_SSL_VERIFYHOST, 0L);
    }
    if (k->cfg.ca_file)
        curl_easy_setopt(h, CURLOPT_CAINFO, k->cfg.ca_file);
    if (k->cfg.ca_data) {
        struct curl_blob blob = { k->cfg.ca_data, k->cfg.ca_data_len, CURL_BLOB_COPY };
        curl_easy_setopt(h, CURLOPT_CAINFO_BLOB, &blob);
    }
    if (k->cfg.cert_file)
        curl_easy_setopt(h, CURLOPT_SSLCERT, k->cfg.cert_file);
    if (k->cfg.key_file)
        curl_easy_setopt(h, CURLOPT_SSLKEY, k->cfg.key_file);
    if (k->cfg.cert_data) {
        struct curl_blob blob = { k->cfg.cert_data, k->cfg.cert_data_len, CURL_BLOB_COPY };
        curl_easy_setopt(h, CURLOPT_SSLCERT_BLOB, &blob);
    }
    if (k->cfg.key_data) {
        struct curl_blob blob = { k->cfg.key_data, k->cfg.key_data_len, CURL_BLOB_COPY };
        curl_easy_setopt(h, CURLOPT_SSLKEY_BLOB, &blob);
    }
    if (k->exec_cert && k->exec_key) {
        struct curl_blob cb = { k->exec_cert, strlen(k->exec_cert), CURL_BLOB_COPY };
        struct curl_blob kb = { k->exec_key, strlen(k->exec_key), CURL_BLOB_COPY };
        curl_easy_setopt(h, CURLOPT_SSLCERT_BLOB, &cb);
        curl_easy_setopt(h, CURLOPT_SSLKEY_BLOB, &kb);
    }
    hdr = curl_slist_append(hdr, "Accept: application/json");
    if (content_type) {
        char ct[128];
        snprintf(ct, sizeof(ct), "Content-Type: %s", content_type);
        hdr = curl_slist_append(hdr, ct);
    }
    if (k->token && *k->token) {
        snprintf(auth, sizeof(auth), "Authorization: Bearer %s", k->token);
        hdr = curl_slist_append(hdr, auth);
    }
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, hdr);
    return hdr;
}

static int map_curl(CURLcode cc)
{
    switch (cc) {
    case CURLE_COULDNT_CONNECT: return -ECONNREFUSED;
    case CURLE_OPERATION_TIMEDOUT: return -ETIMEDOUT;
    case CURLE_COULDNT_RESOLVE_HOST: return -EHOSTUNREACH;
    case CURLE_OUT_OF_MEMORY: return -ENOMEM;
    case CURLE_SSL_CERTPROBLEM: return -ENOKEY;     /* our client certificate or key */
    default: return -EIO;
    }
}

/* ---- the calling thread's last error ------------------------------------ */

static _Thread_local struct kube_error last_err;
static _Thread_local char err_text[1024];

static void err_clear(void)
{
    memset(&last_err, 0, sizeof(last_err));
}

static void err_copy(char *dst, size_t n, const char *src)
{
    snprintf(dst, n, "%s", src ? src : "");
}

/* Records a failed call: the status and what the metav1.Status body says
 * (status may be NULL, or not a Status at all), or a transport error. */
static void err_set(int rc, long code, const cJSON *status, const char *transport)
{
    last_err.rc = rc;
    last_err.status = code;
    err_copy(last_err.reason, sizeof(last_err.reason), str_field(status, "reason"));
    err_copy(last_err.message, sizeof(last_err.message),
             transport ? transport : str_field(status, "message"));
}

const struct kube_error *kube_last_error(void)
{
    return &last_err;
}

const char *kube_strerror(int rc)
{
    const struct kube_error *e = &last_err;

    if (rc >= 0)
        return "success";
    if (e->rc != rc || (!e->status && !e->message[0]))
        return log_strerror(rc);
    const char *reason = e->reason[0] ? e->reason : "(no reason)";
    int w;

    /* A message cut to fit is still the message's start: a log line. */
    if (!e->status)
        w = snprintf(err_text, sizeof(err_text), "%s", e->message);
    else
        w = snprintf(err_text, sizeof(err_text), "HTTP %ld %.63s%s%.511s", e->status, reason,
                     e->message[0] ? ": " : "", e->message);
    return w < 0 ? log_strerror(rc) : err_text;
}

/* Notes whether a request got past authentication: a 401 (after fresh
 * credentials) or no credential at all starts the clock, anything else the
 * server answered stops it. Lock not held. */
static void note_auth(struct kube *k, int rc, long code)
{
    pthread_mutex_lock(&k->lock);
    if (rc == -ENOKEY || code == 401) {
        if (!k->auth_fail_ms)
            k->auth_fail_ms = clock_now_ms();
        snprintf(k->auth_why, sizeof(k->auth_why), "%s", kube_strerror(rc));
    } else if (code) {
        k->auth_fail_ms = 0;
    }
    pthread_mutex_unlock(&k->lock);
}

uint64_t kube_auth_failing_ms(struct kube *k, char *why, size_t n)
{
    uint64_t since, out = 0;

    pthread_mutex_lock(&k->lock);
    since = k->auth_fail_ms;
    if (since) {
        uint64_t now = clock_now_ms();
        out = now > since ? now - since : 1;
        if (why && n)
            snprintf(why, n, "%s", k->auth_why);
    }
    pthread_mutex_unlock(&k->lock);
    return out;
}

/* Maps an HTTP status (and, for 409, the Status reason) to -errno. */
static int map_http(long code, const cJSON *status)
{
    const char *reason = str_field(status, "reason");

    if (code >= 200 && code < 300)
        return 0;
    switch (code) {
    case 400:
    case 422: return -EINVAL;
    case 401: return -EACCES;
    case 403: return -EPERM;
    case 404: return -ENOENT;
    case 409: return reason && strcmp(reason, "AlreadyExists") == 0 ? -EEXIST : -ESTALE;
    case 410: return -EREMCHG;
    case 413: return -E2BIG;
    case 429: return -EAGAIN;
    default: return -EIO;
    }
}

static int url_for(const struct kube *k, const char *path, char *url, size_t n)
{
    size_t sl = strlen(k->cfg.server);
    /* Avoid "//" when the server URL ends in a slash. */
    int w = snprintf(url, n, "%.*s%s", (int)(sl && k->cfg.server[sl - 1] == '/' ? sl - 1 : sl),
                     k->cfg.server, path);
    return w < 0 || (size_t)w >= n ? -ENAMETOOLONG : 0;
}

int kube_request(struct kube *k, const char *method, const char *path, const char *content_type,
                 const cJSON *body, cJSON **out)
{
    char url[4096], *payload = NULL;
    struct body resp = { .max = k->opts.max_body };
    cJSON *parsed = NULL;
    long code = 0;
    int rc = 0, attempt;

    if (out)
        *out = NULL;
    err_clear();
    if (url_for(k, path, url, sizeof(url)) < 0)
        return -ENAMETOOLONG;
    if (body && !(payload = cJSON_PrintUnformatted(body)))
        return -ENOMEM;
    pthread_mutex_lock(&k->lock);
    for (attempt = 0; attempt < 2; attempt++) {
        struct curl_slist *hdr;
        CURLcode cc;

        /* A 401 may mean the token rotated under us: re-read once. */
        refresh_token_locked(k, attempt > 0);
        if (k->exec && k->exec_rc) {
            rc = -ENOKEY;
            err_set(rc, 0, NULL, k->exec_why);
            break;
        }
        hdr = setup(k, k->req, method, url, body ? (content_type ? content_type : "application/json")
                                                 : NULL, false);
        if (payload) {
            curl_easy_setopt(k->req, CURLOPT_POSTFIELDS, payload);
            curl_easy_setopt(k->req, CURLOPT_POSTFIELDSIZE, (long)strlen(payload));
        }
        resp.len = 0;
        resp.too_big = false;
        curl_easy_setopt(k->req, CURLOPT_WRITEFUNCTION, body_write);
        curl_easy_setopt(k->req, CURLOPT_WRITEDATA, &resp);
        cc = curl_easy_perform(k->req);
        curl_slist_free_all(hdr);
        atomic_fetch_add(&k->n_requests, 1);
        if (resp.too_big) {
            rc = -EMSGSIZE;
            break;
        }
        if (cc != CURLE_OK) {
            rc = map_curl(cc);
            err_set(rc, 0, NULL, curl_easy_strerror(cc));
            log_warn("kube", "A request to the API server failed.", LF_S("method", method),
                     LF_S("path", path), LF_S("error", curl_easy_strerror(cc)));
            break;
        }
        curl_easy_getinfo(k->req, CURLINFO_RESPONSE_CODE, &code);
        if (code != 401 || (!k->cfg.token_file && !k->exec))
            break;
    }
    pthread_mutex_unlock(&k->lock);
    free(payload);
    if (rc < 0) {
        atomic_fetch_add(&k->n_failures, 1);
        if (rc == -EMSGSIZE)
            err_set(rc, code, NULL, "the API server's answer is over the size cap");
        goto out;
    }
    if (resp.len > 0) {
        parsed = cJSON_ParseWithLength(resp.buf, resp.len);
        if (!parsed && code >= 200 && code < 300) {
            rc = -EBADMSG;
            err_set(rc, code, NULL, "the API server's answer is not JSON");
            goto out;
        }
    }
    rc = map_http(code, parsed);
    if (rc < 0) {
        atomic_fetch_add(&k->n_failures, 1);
        err_set(rc, code, parsed, NULL);
        log_emit(code == 404 || code == 409 ? LOG_DEBUG : LOG_WARN, "kube",
                 "The API server refused a request.", LF_S("method", method), LF_S("path", path),
                 LF_I("status", code), LF_S("reason", last_err.reason),
                 LF_S("message", last_err.message), LOG_END);
        cJSON_Delete(parsed);
        parsed = NULL;
    }
out:
    note_auth(k, rc, code);
    free(resp.buf);
    if (out)
        *out = parsed;
    else
        cJSON_Delete(parsed);
    return rc;
}

void kube_stats(struct kube *k, struct kube_stats *out)
{
    out->requests = atomic_load(&k->n_requests);
    out->failures = atomic_load(&k->n_failures);
    out->watches = atomic_load(&k->n_watches);
}

int kube_get(struct kube *k, const char *path, cJSON **out)
{
    return kube_request(k, "GET", path, NULL, NULL, out);
}

int kube_create_object(struct kube *k, const char *path, const cJSON *obj, cJSON **out)
{
    return kube_request(k, "POST", path, NULL, obj, out);
}

int kube_replace(struct kube *k, const char *path, const cJSON *obj, cJSON **out)
{
    return kube_request(k, "PUT", path, NULL, obj, out);
}

int kube_merge_patch(struct kube *k, const char *path, const cJSON *patch, cJSON **out)
{
    return kube_request(k, "PATCH", path, "application/merge-patch+json", patch, out);
}

int kube_delete(struct kube *k, const char *path)
{
    return kube_request(k, "DELETE", path, NULL, NULL, NULL);
}

/* Appends URL-escaped query parameters. */
static int add_query(char *buf, size_t n, const char *key, const char *val)
{
    char *esc = curl_easy_escape(NULL, val, 0);
    size_t used = strlen(buf);
    int w;

    if (!esc)
        return -ENOMEM;
    w = snprintf(buf + used, n - used, "%c%s=%s", strchr(buf, '?') ? '&' : '?', key, esc);
    curl_free(esc);
    return w < 0 || (size_t)w >= n - used ? -ENAMETOOLONG : 0;
}

int kube_list(struct kube *k, const char *path, const char *selector, cJSON **items, char **rv)
{
    cJSON *all = cJSON_CreateArray(), *page = NULL;
    char *cont = NULL, q[4096], lim[16];
    int rc;

    *items = NULL;
    *rv = NULL;
    if (!all)
        return -ENOMEM;
    snprintf(lim, sizeof(lim), "%u", k->opts.list_page);
    for (;;) {
        cJSON *it, *next;
        const char *c, *r;

        snprintf(q, sizeof(q), "%s", path);
        if ((rc = add_query(q, sizeof(q), "limit", lim)) < 0 ||
            (selector && (rc = add_query(q, sizeof(q), "labelSelector", selector)) < 0) ||
            (cont && (rc = add_query(q, sizeof(q), "continue", cont)) < 0))
            goto err;
        rc = kube_get(k, q, &page);
        if (rc < 0)
            goto err;
        it = cJSON_GetObjectItemCaseSensitive(page, "items");
        for (cJSON *e = it ? it->child : NULL; e; e = next) {
            next = e->next;
            cJSON_AddItemToArray(all, cJSON_DetachItemViaPointer(it, e));
        }
        r = str_field(cJSON_GetObjectItemCaseSensitive(page, "metadata"), "resourceVersion");
        c = str_field(cJSON_GetObjectItemCaseSensitive(page, "metadata"), "continue");
        free(*rv);
        *rv = dup_or_null(r);
        free(cont);
        cont = c && *c ? strdup(c) : NULL;
        cJSON_Delete(page);
        page = NULL;
        if (!cont)
            break;
    }
    *items = all;
    return 0;
err:
    free(cont);
    free(*rv);
    *rv = NULL;
    cJSON_Delete(all);
    return rc;
}

/* ---- watch -------------------------------------------------------------- */

struct watch_ctx {
    struct body line;           /* the event being received */
    kube_event_fn fn;
    void *arg;
    char **rv;
    int rc;                     /* set to stop the transfer */
    bool stopped;
};

/* Handles one complete event line. Returns 0 to go on. */
static int watch_event(struct watch_ctx *w, const char *text, size_t len)
{
    cJSON *ev = cJSON_ParseWithLength(text, len), *obj;
    const char *type, *rv;
    int rc = 0;

    if (!ev) {
        w->rc = -EBADMSG;
        return -1;
    }
    type = str_field(ev, "type");
    obj = cJSON_GetObjectItemCaseSensitive(ev, "object");
    if (!type || !cJSON_IsObject(obj)) {
        w->rc = -EBADMSG;
        rc = -1;
        goto out;
    }
    if (strcmp(type, "ERROR") == 0) {
        const cJSON *code = cJSON_GetObjectItemCaseSensitive(obj, "code");
        w->rc = cJSON_IsNumber(code) && code->valueint == 410 ? -EREMCHG
                : map_http(cJSON_IsNumber(code) ? code->valueint : 500, obj);
        if (w->rc == 0)
            w->rc = -EIO;
        rc = -1;
        goto out;
    }
    rv = kube_meta(obj, "resourceVersion");
    if (rv) {
        char *d = strdup(rv);
        if (d) {
            free(*w->rv);
            *w->rv = d;
        }
    }
    if (w->fn(w->arg, type, obj) != 0) {
        w->stopped = true;
        rc = -1;
    }
out:
    cJSON_Delete(ev);
    return rc;
}

static size_t watch_write(char *p, size_t size, size_t n, void *arg)
{
    struct watch_ctx *w = arg;
    size_t total = size * n, start = 0;

    for (size_t i = 0; i < total; i++) {
        if (p[i] != '\n')
            continue;
        if (body_write(p + start, 1, i - start, &w->line) != i - start) {
            w->rc = w->line.too_big ? -EMSGSIZE : -ENOMEM;
            return 0;
        }
        if (w->line.len > 0 && watch_event(w, w->line.buf, w->line.len) != 0)
            return 0;
        w->line.len = 0;
        start = i + 1;
    }
    if (body_write(p + start, 1, total - start, &w->line) != total - start) {
        w->rc = w->line.too_big ? -EMSGSIZE : -ENOMEM;
        return 0;
    }
    return total;
}

int kube_watch(struct kube *k, const char *path, const char *selector, char **rv,
               unsigned timeout_s, kube_event_fn fn, void *arg, const volatile bool *stop)
{
    struct watch_ctx w = { .line = { .max = k->opts.max_body }, .fn = fn, .arg = arg, .rv = rv };
    char q[4096], ts[16];
    struct curl_slist *hdr;
    CURLM *multi;
    CURL *h;
    long code = 0;
    int running = 1, rc;

    err_clear();
    if (url_for(k, path, q, sizeof(q)) < 0)
        return -ENAMETOOLONG;
    snprintf(ts, sizeof(ts), "%u", timeout_s);
    if ((rc = add_query(q, sizeof(q), "watch", "true")) < 0 ||
        (rc = add_query(q, sizeof(q), "allowWatchBookmarks", "true")) < 0 ||
        (rc = add_query(q, sizeof(q), "timeoutSeconds", ts)) < 0 ||
        (*rv && (rc = add_query(q, sizeof(q), "resourceVersion", *rv)) < 0) ||
        (selector && (rc = add_query(q, sizeof(q), "labelSelector", selector)) < 0))
        return rc;
    h = curl_easy_init();
    multi = curl_multi_init();
    if (!h || !multi) {
        rc = -ENOMEM;
        goto out;
    }
    pthread_mutex_lock(&k->lock);
    refresh_token_locked(k, false);
    if (k->exec && k->exec_rc) {
        rc = -ENOKEY;
        err_set(rc, 0, NULL, k->exec_why);
        pthread_mutex_unlock(&k->lock);
        note_auth(k, rc, 0);
        goto out;
    }
    hdr = setup(k, h, "GET", q, NULL, true);
    pthread_mutex_unlock(&k->lock);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, watch_write);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, &w);
    /* A dead server on a quiet watch is noticed by the server's own
     * timeout plus this margin. */
    curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, (long)(timeout_s + 30) * 1000L);
    atomic_fetch_add(&k->n_watches, 1);
    curl_multi_add_handle(multi, h);
    while (running) {
        if (curl_multi_perform(multi, &running) != CURLM_OK)
            break;
        if (!running || (stop && *stop))
            break;
        curl_multi_poll(multi, NULL, 0, 200, NULL);
    }
    if (stop && *stop) {
        rc = 0;
    } else if (w.stopped) {
        rc = 0;
    } else if (w.rc < 0) {
        rc = w.rc;
    } else {
        CURLMsg *msg;
        int left;
        rc = 0;
        while ((msg = curl_multi_info_read(multi, &left)))
            if (msg->msg == CURLMSG_DONE && msg->data.result != CURLE_OK) {
                rc = map_curl(msg->data.result);
                err_set(rc, 0, NULL, curl_easy_strerror(msg->data.result));
            }
        curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &code);
        if (rc == 0 && code != 200) {
            cJSON *st = w.line.len ? cJSON_ParseWithLength(w.line.buf, w.line.len) : NULL;
            rc = map_http(code, st);
            if (rc == 0)
                rc = -EIO;
            err_set(rc, code, st, NULL);
            log_warn("kube", "The API server refused a watch.", LF_S("path", path),
                     LF_I("status", code), LF_S("reason", last_err.reason),
                     LF_S("message", last_err.message));
            cJSON_Delete(st);
        }
    }
    curl_multi_remove_handle(multi, h);
    curl_slist_free_all(hdr);
    note_auth(k, rc, code ? code : (w.stopped || rc == 0 ? 200 : 0));
out:
    if (h)
        curl_easy_cleanup(h);
    if (multi)
        curl_multi_cleanup(multi);
    free(w.line.buf);
    return rc;
}

/* src/k8s/kube.h: a Kubernetes API client over libcurl and cJSON: what an
 * operator needs and nothing more. Requests, paginated lists, watches with
 * bookmarks, merge patches, status writes, optimistic concurrency.
 *
 * Errors are -errno, mapped once here:
 *   404 -ENOENT; 409 AlreadyExists -EEXIST, 409 Conflict (stale
 *   resourceVersion) -ESTALE; 410 Gone (a resourceVersion too old to watch
 *   or list from) -EREMCHG; 400/422 -EINVAL; 401 -EACCES (after the token
 *   was re-read once); 403 -EPERM; 413 -E2BIG; 429 -EAGAIN; other 5xx -EIO;
 *   a body over the cap -EMSGSIZE; an unparsable body -EBADMSG; transport:
 *   -ECONNREFUSED, -ETIMEDOUT, -EHOSTUNREACH; no credential to send (an
 *   exec plugin failed) -ENOKEY. The server's own reason and
 *   message are logged once with the status, and kept for the caller
 *   (kube_last_error, kube_strerror) so its log lines can say them too.
 */
#ifndef COHORT_KUBE_H
#define COHORT_KUBE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

struct kube_config {
    char *server;               /* "https://10.0.0.1:443" or "http://127.0.0.1:8001" */
    char *token;                /* a static bearer token, or NULL */
    char *token_file;           /* re-read when it changes, and on a 401 */
    char *ca_file;              /* CA bundle file; NULL: ca_data or the system's */
    char *ca_data;              /* PEM bytes (kubeconfig certificate-authority-data) */
    size_t ca_data_len;
    char *cert_file, *key_file; /* client certificate (kubeconfig) */
    char *cert_data, *key_data; /* PEM bytes */
    size_t cert_data_len, key_data_len;
    bool insecure;              /* insecure-skip-tls-verify */
    char *namespace;            /* default namespace ("default" if unknown) */
    cJSON *exec;                /* users[].user.exec (execcred.h), or NULL; owned */
};

/* From the pod's service account: KUBERNETES_SERVICE_HOST/_PORT and the
 * files under `sa_dir` (NULL: /var/run/secrets/kubernetes.io/serviceaccount).
 * Returns 0, -ENOENT (not in a cluster), -ENOMEM. The caller frees with
 * kube_config_cleanup(). */
int kube_config_in_cluster(const char *sa_dir, struct kube_config *c);

/* From a kubeconfig file (YAML or JSON) and a context (NULL: the current
 * one). Relative file paths are taken from the kubeconfig's directory.
 * Returns 0, -ENOENT (no file, context, cluster or user), -EINVAL
 * (unparsable, or a field of the wrong shape), -ENOMEM. The caller frees
 * with kube_config_cleanup(). */
int kube_config_load(const char *path, const char *context, struct kube_config *c);
void kube_config_cleanup(struct kube_config *c);

struct kube;

struct kube_opts {
    size_t max_body;            /* cap on one response body or watch line; 0: 32 MiB */
    uint32_t timeout_ms;        /* per request, not watches; 0: 30 s */
    uint32_t list_page;         /* items per list page; 0: 500 */
};

/* A client for `c` (copied). Returns 0, -EINVAL (no server, or an exec
 * plugin configuration that cannot work: kube_strerror says why), -ENOMEM.
 * Credentials: a token, a token file (re-read when it changes and on a
 * 401), a client certificate and key (files or data), or an exec plugin
 * (run when no credential is cached, before the cached one expires, and
 * on a 401; a plugin that fails makes the request fail with -ENOKEY).
 * Thread-safe: requests from several threads are serialised on one
 * reused connection; each watch has a connection of its own. The caller
 * frees with kube_destroy(). */
int kube_create(const struct kube_config *c, const struct kube_opts *opts, struct kube **out);
void kube_destroy(struct kube *k);         /* NULL is fine */
const char *kube_namespace(const struct kube *k);

/* One request. `body` is borrowed (NULL for none); `content_type` NULL
 * means application/json. On success returns 0 and, if out is not NULL,
 * the parsed body (caller frees with cJSON_Delete). On failure *out is
 * NULL. */
int kube_request(struct kube *k, const char *method, const char *path, const char *content_type,
                 const cJSON *body, cJSON **out);

int kube_get(struct kube *k, const char *path, cJSON **out);
int kube_create_object(struct kube *k, const char *path, const cJSON *obj, cJSON **out);
/* PUT: obj carries metadata.resourceVersion; -ESTALE when it is stale. */
int kube_replace(struct kube *k, const char *path, const cJSON *obj, cJSON **out);
/* PATCH with application/merge-patch+json (RFC 7386). */
int kube_merge_patch(struct kube *k, const char *path, const cJSON *patch, cJSON **out);
int kube_delete(struct kube *k, const char *path);

/* Lists everything at `path` (a collection), following `continue` tokens.
 * `selector` is a label selector or NULL. Sets *items to a new array
 * (caller frees) and *rv to the list's resourceVersion (caller frees).
 * -EREMCHG if a continue token expired mid-list (start again). */
int kube_list(struct kube *k, const char *path, const char *selector, cJSON **items, char **rv);

/* A watch event: type is ADDED, MODIFIED, DELETED or BOOKMARK; `object`
 * is borrowed for the call. Return 0 to go on, anything else to stop. */
typedef int (*kube_event_fn)(void *arg, const char *type, const cJSON *object);

/* Watches `path` from resourceVersion `rv` (with bookmarks) until the
 * server ends the watch (after timeout_s), `fn` asks to stop, or `stop`
 * becomes true (checked at least every 200 ms). *rv is updated to the last
 * resourceVersion seen, so the caller resumes from there. Returns 0 when
 * the server ended the watch or the caller stopped it, -EREMCHG when rv is
 * too old (re-list), -EBADMSG for an event that does not parse, and the
 * request errors above. */
int kube_watch(struct kube *k, const char *path, const char *selector, char **rv,
               unsigned timeout_s, kube_event_fn fn, void *arg, const volatile bool *stop);

/* Requests sent (each attempt of kube_request, each watch opened), and
 * those that failed in transport or got a status outside 2xx, for
 * /metrics. */
struct kube_stats {
    uint64_t requests, failures, watches;
};
void kube_stats(struct kube *k, struct kube_stats *out);

/* Why the calling thread's last kube_ call failed, as the API said it:
 * the -errno it returned, the HTTP status (0 for a transport error or
 * none), and the metav1.Status reason and message ("" when the body had
 * none; message holds curl's error for a transport failure). Each
 * kube_request, kube_get..., kube_list and kube_watch call clears it
 * first; a kube_list that fails holds its failed page's. Borrowed,
 * thread-local. */
struct kube_error {
    int rc;
    long status;
    char reason[64];
    char message[512];
};
const struct kube_error *kube_last_error(void);

/* rc as one phrase for a log line: "HTTP 403 Forbidden: pods is
 * forbidden: ..." when rc is the calling thread's last kube_ error and the
 * API answered it, curl's words for a transport error, else strerror's.
 * Borrowed, thread-local, valid until the thread's next call. */
const char *kube_strerror(int rc);

/* How long (ms) requests have failed for want of a credential the API
 * server accepts: a 401 that fresh credentials did not cure, or an exec
 * plugin that gave none. 0 when the last answered request got through
 * authentication. *why (unless NULL) gets the last reason. */
uint64_t kube_auth_failing_ms(struct kube *k, char *why, size_t n);

/* metadata.name etc. of an object, or NULL. Borrowed from obj. */
const char *kube_meta(const cJSON *obj, const char *field);

/* The bytes of data[key] of a Secret (base64 in the API), with a NUL
 * after them. Returns 0 and sets *out (caller frees; it may hold a key:
 * wipe it first) and *len unless NULL, -ENOENT (no such key), -EINVAL
 * (not a string of base64), -ENOMEM. */
int kube_secret_data(const cJSON *secret, const char *key, char **out, size_t *len);

/* n bytes as base64, what a Secret's data holds. Returns a new string
 * (caller frees) or NULL when out of memory. */
char *kube_base64(const void *p, size_t n);

#endif

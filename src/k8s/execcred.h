/* src/k8s/execcred.h: kubeconfig exec credential plugins (users[].user.exec),
 * as client-go runs them: the command with its args and env (no shell),
 * KUBERNETES_EXEC_INFO on its environment, its ExecCredential read from
 * stdout (client.authentication.k8s.io/v1 or v1beta1), a bearer token or
 * a client certificate and key, cached until status.expirationTimestamp.
 *
 * A daemon has no terminal: interactiveMode Always is refused, and the
 * plugin's stdin is /dev/null. Its stderr is the operator's (the log).
 * The run is bounded in time and in output, and a plugin that overruns is
 * killed. Every failure comes with one sentence saying why. */
#ifndef COHORT_EXECCRED_H
#define COHORT_EXECCRED_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#define EXECCRED_WHY_MAX 512

struct execcred;                        /* opaque */

/* What spec.cluster tells a plugin with provideClusterInfo. Borrowed. */
struct execcred_cluster {
    const char *server;
    const char *ca_data_b64;            /* the CA's PEM as base64, or NULL */
    bool insecure;
};

struct execcred_opts {
    uint32_t timeout_ms;                /* one run; 0: 30 s */
    size_t max_output;                  /* stdout cap; 0: 1 MiB */
};

/* A credential. Owned by whoever holds it; execcred_cred_cleanup frees. */
struct execcred_cred {
    char *token;                        /* or NULL */
    char *cert_pem, *key_pem;           /* both or neither */
    int64_t expires_ms;                 /* Unix ms; 0: does not expire */
};
void execcred_cred_cleanup(struct execcred_cred *c);

/* The plugin of a kubeconfig user's `exec` object (borrowed; copied),
 * and its cluster (copied). Returns 0 and sets *out (caller frees with
 * execcred_destroy), -EINVAL with why for a configuration client-go
 * refuses too (no command, an unknown apiVersion, interactiveMode
 * missing in v1 or Always, env entries without name), -ENOMEM. */
int execcred_create(const cJSON *exec, const struct execcred_cluster *cluster,
                    const struct execcred_opts *opts, struct execcred **out, char *why, size_t n);
void execcred_destroy(struct execcred *e);      /* NULL is fine */

/* The credential to use at now_ms (Unix ms): the cached one, or a new one
 * from running the plugin when none is cached, when force (after a 401),
 * or when the cached one expires within a fifth of its life (at most
 * 30 s). Returns 0 and sets *out (borrowed: valid until the next call), or
 * -errno with why: the plugin could not start, exited non-zero, overran
 * its time or output cap, or printed no valid ExecCredential. */
int execcred_get(struct execcred *e, int64_t now_ms, bool force, const struct execcred_cred **out,
                 char *why, size_t n);

/* How many times the plugin ran, for tests and logs. */
uint64_t execcred_runs(const struct execcred *e);

/* Parses an ExecCredential that must be of api_version. Returns 0 and
 * fills *out (caller cleans up), -EINVAL with why, -ENOMEM. */
int execcred_parse(const char *text, size_t len, const char *api_version,
                   struct execcred_cred *out, char *why, size_t n);

/* RFC 3339 ("2026-01-02T03:04:05Z", fractions and offsets too) as Unix
 * ms. Returns 0 or -EINVAL. */
int execcred_parse_time(const char *s, int64_t *ms);
#endif

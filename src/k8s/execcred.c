/* src/k8s/execcred.c: see execcred.h. */
#include "k8s/execcred.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "base/clock.h"
#include "base/log.h"

#define V1 "client.authentication.k8s.io/v1"
#define V1BETA1 "client.authentication.k8s.io/v1beta1"
#define DEFAULT_TIMEOUT_MS 30000u
#define DEFAULT_MAX_OUTPUT (1024u * 1024u)
#define REFRESH_MARGIN_MAX_MS 30000

extern char **environ;

struct execcred {
    char *api_version;
    char **argv;                /* command, args..., NULL */
    char **env;                 /* the operator's, then exec.env, then KUBERNETES_EXEC_INFO */
    struct execcred_opts opts;
    struct execcred_cred cur;
    int64_t fetched_ms;
    bool have;
    uint64_t runs;
};

static void say(char *why, size_t n, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

static void say(char *why, size_t n, const char *fmt, ...)
{
    va_list ap;

    if (!why || !n)
        return;
    va_start(ap, fmt);
    vsnprintf(why, n, fmt, ap);
    va_end(ap);
}

void execcred_cred_cleanup(struct execcred_cred *c)
{
    if (!c)
        return;
    if (c->key_pem)
        explicit_bzero(c->key_pem, strlen(c->key_pem));
    if (c->token)
        explicit_bzero(c->token, strlen(c->token));
    free(c->token);
    free(c->cert_pem);
    free(c->key_pem);
    memset(c, 0, sizeof(*c));
}

static void free_vec(char **v)
{
    for (size_t i = 0; v && v[i]; i++)
        free(v[i]);
    free(v);
}

void execcred_destroy(struct execcred *e)
{
    if (!e)
        return;
    free(e->api_version);
    free_vec(e->argv);
    free_vec(e->env);
    execcred_cred_cleanup(&e->cur);
    free(e);
}

static const char *str_of(const cJSON *o, const char *k)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

/* KUBERNETES_EXEC_INFO=..., as client-go sets it. */
static char *exec_info(const char *api_version, const struct execcred_cluster *cl, bool provide)
{
    cJSON *root = cJSON_CreateObject(), *spec;
    char *text = NULL, *out = NULL;

    if (!root)
        return NULL;
    cJSON_AddStringToObject(root, "apiVersion", api_version);
    cJSON_AddStringToObject(root, "kind", "ExecCredential");
    spec = cJSON_AddObjectToObject(root, "spec");
    if (spec)
        cJSON_AddBoolToObject(spec, "interactive", 0);
    if (spec && provide && cl) {
        cJSON *c = cJSON_AddObjectToObject(spec, "cluster");
        if (c) {
            cJSON_AddStringToObject(c, "server", cl->server ? cl->server : "");
            if (cl->ca_data_b64)
                cJSON_AddStringToObject(c, "certificate-authority-data", cl->ca_data_b64);
            if (cl->insecure)
                cJSON_AddBoolToObject(c, "insecure-skip-tls-verify", 1);
        }
    }
    text = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    if (text && asprintf(&out, "KUBERNETES_EXEC_INFO=%s", text) < 0)
        out = NULL;
    free(text);
    return out;
}

int execcred_create(const cJSON *exec, const struct execcred_cluster *cluster,
                    const struct execcred_opts *opts, struct execcred **out, char *why, size_t n)
{
    const char *api = str_of(exec, "apiVersion"), *cmd = str_of(exec, "command");
    const char *mode = str_of(exec, "interactiveMode");
    const cJSON *args = cJSON_GetObjectItemCaseSensitive(exec, "args");
    const cJSON *env = cJSON_GetObjectItemCaseSensitive(exec, "env");
    const cJSON *pci = cJSON_GetObjectItemCaseSensitive(exec, "provideClusterInfo");
    size_t nargs = cJSON_IsArray(args) ? (size_t)cJSON_GetArraySize(args) : 0;
    size_t nenv = cJSON_IsArray(env) ? (size_t)cJSON_GetArraySize(env) : 0, nparent = 0, i = 0;
    struct execcred *e;
    const cJSON *it;

    *out = NULL;
    if (!cJSON_IsObject(exec)) {
        say(why, n, "the exec entry is not an object");
        return -EINVAL;
    }
    if (!cmd || !*cmd) {
        say(why, n, "the exec plugin has no command");
        return -EINVAL;
    }
    if (!api || (strcmp(api, V1) != 0 && strcmp(api, V1BETA1) != 0)) {
        say(why, n, "exec plugin: invalid apiVersion \"%s\" (client.authentication.k8s.io/v1 "
            "or v1beta1)", api ? api : "(none)");
        return -EINVAL;
    }
    if (!mode && strcmp(api, V1) == 0) {
        say(why, n, "exec plugin: interactiveMode must be specified for %s to use exec "
            "authentication plugin", cmd);
        return -EINVAL;
    }
    if (mode && strcmp(mode, "Never") != 0 && strcmp(mode, "IfAvailable") != 0) {
        if (strcmp(mode, "Always") == 0)
            say(why, n, "exec plugin %s asks for interactiveMode Always, but cohort-operator runs "
                "without a terminal to interact through", cmd);
        else
            say(why, n, "exec plugin: invalid interactiveMode \"%s\"", mode);
        return -EINVAL;
    }
    /* The kubeconfig's YAML loader gives scalars as strings. */
    bool provide = cJSON_IsTrue(pci) || (cJSON_IsString(pci) && strcmp(pci->valuestring, "true") == 0);
    if ((args && !cJSON_IsArray(args)) || (env && !cJSON_IsArray(env)) ||
        (pci && !cJSON_IsBool(pci) && !(cJSON_IsString(pci) &&
                                         (provide || strcmp(pci->valuestring, "false") == 0)))) {
        say(why, n, "exec plugin %s: args and env must be lists, provideClusterInfo a "
            "boolean", cmd);
        return -EINVAL;
    }
    cJSON_ArrayForEach(it, args) {
        if (!cJSON_IsString(it)) {
            say(why, n, "exec plugin %s: every arg must be a string", cmd);
            return -EINVAL;
        }
    }
    cJSON_ArrayForEach(it, env) {
        const char *name = str_of(it, "name");
        if (!name || !*name || strchr(name, '=') || !str_of(it, "value")) {
            say(why, n, "exec plugin %s: every env entry needs a name (without '=') and a "
                "string value", cmd);
            return -EINVAL;
        }
    }
    while (environ && environ[nparent])
        nparent++;
    e = calloc(1, sizeof(*e));
    if (!e)
        return -ENOMEM;
    e->opts.timeout_ms = opts && opts->timeout_ms ? opts->timeout_ms : DEFAULT_TIMEOUT_MS;
    e->opts.max_output = opts && opts->max_output ? opts->max_output : DEFAULT_MAX_OUTPUT;
    e->api_version = strdup(api);
    e->argv = calloc(nargs + 2, sizeof(char *));
    e->env = calloc(nparent + nenv + 2, sizeof(char *));
    if (!e->api_version || !e->argv || !e->env)
        goto nomem;
    if (!(e->argv[0] = strdup(cmd)))
        goto nomem;
    i = 1;
    cJSON_ArrayForEach(it, args) {
        if (!(e->argv[i++] = strdup(it->valuestring)))
            goto nomem;
    }
    /* The operator's environment, less what exec.env or the exec info
     * replace, then those. */
    i = 0;
    for (size_t p = 0; p < nparent; p++) {
        const char *eq = strchr(environ[p], '=');
        size_t kl = eq ? (size_t)(eq - environ[p]) : strlen(environ[p]);
        bool replaced = kl == strlen("KUBERNETES_EXEC_INFO") &&
                        strncmp(environ[p], "KUBERNETES_EXEC_INFO", kl) == 0;
        cJSON_ArrayForEach(it, env) {
            const char *name = str_of(it, "name");
            if (strlen(name) == kl && strncmp(name, environ[p], kl) == 0)
                replaced = true;
        }
        if (!replaced && !(e->env[i++] = strdup(environ[p])))
            goto nomem;
    }
    cJSON_ArrayForEach(it, env) {
        if (asprintf(&e->env[i], "%s=%s", str_of(it, "name"), str_of(it, "value")) < 0) {
            e->env[i] = NULL;
            goto nomem;
        }
        i++;
    }
    if (!(e->env[i++] = exec_info(api, cluster, provide)))
        goto nomem;
    *out = e;
    return 0;
nomem:
    execcred_destroy(e);
    return -ENOMEM;
}

uint64_t execcred_runs(const struct execcred *e)
{
    return e->runs;
}

/* ---- RFC 3339 ------------------------------------------------------------ */

static int digits(const char *s, int n, int *out)
{
    int v = 0;
    for (int i = 0; i < n; i++) {
        if (!isdigit((unsigned char)s[i]))
            return -EINVAL;
        v = v * 10 + (s[i] - '0');
    }
    *out = v;
    return 0;
}

int execcred_parse_time(const char *s, int64_t *ms)
{
    struct tm tm = { 0 };
    int y, mo, d, h, mi, se, frac_ms = 0, off = 0;
    const char *p;

    if (!s || strlen(s) < 20 || digits(s, 4, &y) || s[4] != '-' || digits(s + 5, 2, &mo) ||
        s[7] != '-' || digits(s + 8, 2, &d) || (s[10] != 'T' && s[10] != 't') ||
        digits(s + 11, 2, &h) || s[13] != ':' || digits(s + 14, 2, &mi) || s[16] != ':' ||
        digits(s + 17, 2, &se))
        return -EINVAL;
    if (mo < 1 || mo > 12 || d < 1 || d > 31 || h > 23 || mi > 59 || se > 60)
        return -EINVAL;
    p = s + 19;
    if (*p == '.') {
        int scale = 100;
        p++;
        if (!isdigit((unsigned char)*p))
            return -EINVAL;
        for (; isdigit((unsigned char)*p); p++, scale /= 10)
            frac_ms += (*p - '0') * scale;
    }
    if (*p == 'Z' || *p == 'z') {
        p++;
    } else if (*p == '+' || *p == '-') {
        int oh, om;
        if (digits(p + 1, 2, &oh) || p[3] != ':' || digits(p + 4, 2, &om) || oh > 23 || om > 59)
            return -EINVAL;
        off = (oh * 60 + om) * 60 * (*p == '+' ? 1 : -1);
        p += 6;
    } else {
        return -EINVAL;
    }
    if (*p)
        return -EINVAL;
    tm.tm_year = y - 1900;
    tm.tm_mon = mo - 1;
    tm.tm_mday = d;
    tm.tm_hour = h;
    tm.tm_min = mi;
    tm.tm_sec = se;
    *ms = ((int64_t)timegm(&tm) - off) * 1000 + frac_ms;
    return 0;
}

/* ---- the ExecCredential -------------------------------------------------- */

int execcred_parse(const char *text, size_t len, const char *api_version,
                   struct execcred_cred *out, char *why, size_t n)
{
    cJSON *root = cJSON_ParseWithLength(text, len);
    const cJSON *status;
    const char *api, *kind, *tok, *cert, *key, *exp;
    int rc = -EINVAL;

    memset(out, 0, sizeof(*out));
    if (!root || !cJSON_IsObject(root)) {
        say(why, n, "the exec plugin's output is not a JSON object");
        goto out;
    }
    api = str_of(root, "apiVersion");
    kind = str_of(root, "kind");
    if (!api || strcmp(api, api_version) != 0) {
        say(why, n, "exec plugin is configured to use API version %s, plugin returned version %s",
            api_version, api ? api : "(none)");
        goto out;
    }
    if (!kind || strcmp(kind, "ExecCredential") != 0) {
        say(why, n, "the exec plugin returned kind %s, not ExecCredential",
            kind ? kind : "(none)");
        goto out;
    }
    status = cJSON_GetObjectItemCaseSensitive(root, "status");
    if (!cJSON_IsObject(status)) {
        say(why, n, "exec plugin didn't return a status field");
        goto out;
    }
    tok = str_of(status, "token");
    cert = str_of(status, "clientCertificateData");
    key = str_of(status, "clientKeyData");
    if ((!tok || !*tok) && (!cert || !*cert || !key || !*key)) {
        say(why, n, "exec plugin didn't return a token or cert/key pair");
        goto out;
    }
    if ((cert && *cert) != (key && *key)) {
        say(why, n, "exec plugin returned only one of clientCertificateData and "
            "clientKeyData");
        goto out;
    }
    exp = str_of(status, "expirationTimestamp");
    if (cJSON_GetObjectItemCaseSensitive(status, "expirationTimestamp") && exp &&
        execcred_parse_time(exp, &out->expires_ms) < 0) {
        say(why, n, "the exec plugin's expirationTimestamp \"%s\" is not RFC 3339", exp);
        goto out;
    }
    rc = -ENOMEM;
    if (tok && *tok && !(out->token = strdup(tok)))
        goto out;
    if (cert && *cert && (!(out->cert_pem = strdup(cert)) || !(out->key_pem = strdup(key))))
        goto out;
    rc = 0;
out:
    cJSON_Delete(root);
    if (rc < 0)
        execcred_cred_cleanup(out);
    return rc;
}

/* ---- running the plugin -------------------------------------------------- */

/* Runs the plugin; its stdout into *buf (NUL-terminated). */
static int run(struct execcred *e, char **buf, size_t *len, char *why, size_t n)
{
    posix_spawn_file_actions_t fa;
    int pipefd[2], rc = 0, status = 0;
    size_t cap = 4096, used = 0;
    char *out = malloc(cap);
    uint64_t deadline = clock_now_ms() + e->opts.timeout_ms;
    pid_t pid;
    bool reaped = false;

    *buf = NULL;
    if (!out)
        return -ENOMEM;
    if (pipe2(pipefd, O_CLOEXEC) < 0) {
        free(out);
        return -errno;
    }
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
    posix_spawn_file_actions_adddup2(&fa, pipefd[1], 1);
    rc = posix_spawnp(&pid, e->argv[0], &fa, NULL, e->argv, e->env);
    posix_spawn_file_actions_destroy(&fa);
    close(pipefd[1]);
    if (rc != 0) {
        char msg[128];
        snprintf(msg, sizeof(msg), "%s", strerror(rc));
        say(why, n, "the exec plugin %s could not be started: %s", e->argv[0], msg);
        close(pipefd[0]);
        free(out);
        return -rc;
    }
    e->runs++;
    for (;;) {
        int64_t left = (int64_t)(deadline - clock_now_ms());
        struct pollfd pfd = { .fd = pipefd[0], .events = POLLIN };
        ssize_t r;

        if (left <= 0) {
            say(why, n, "the exec plugin %s did not finish within its time limit",
                e->argv[0]);
            rc = -ETIMEDOUT;
            break;
        }
        if (poll(&pfd, 1, (int)(left > 1000 ? 1000 : left)) < 0) {
            if (errno == EINTR)
                continue;
            rc = -errno;
            break;
        }
        if (!pfd.revents)
            continue;
        if (used + 4096 + 1 > cap) {
            char *nb;
            if (cap >= e->opts.max_output + 4097) {
                say(why, n, "the exec plugin %s wrote more than its output limit",
                    e->argv[0]);
                rc = -EMSGSIZE;
                break;
            }
            cap *= 2;
            nb = realloc(out, cap);
            if (!nb) {
                rc = -ENOMEM;
                break;
            }
            out = nb;
        }
        r = read(pipefd[0], out + used, 4096);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            break;
        used += (size_t)r;
        if (used > e->opts.max_output) {
            say(why, n, "the exec plugin %s wrote more than its output limit", e->argv[0]);
            rc = -EMSGSIZE;
            break;
        }
    }
    close(pipefd[0]);
    if (rc < 0) {
        kill(pid, SIGKILL);
    } else {
        /* stdout is closed: give the plugin what is left to exit. */
        while (clock_now_ms() < deadline) {
            pid_t w = waitpid(pid, &status, WNOHANG);
            if (w == pid) {
                reaped = true;
                break;
            }
            if (w < 0 && errno != EINTR)
                break;
            usleep(5000);
        }
        if (!reaped) {
            kill(pid, SIGKILL);
            say(why, n, "the exec plugin %s did not finish within its time limit",
                e->argv[0]);
            rc = -ETIMEDOUT;
        }
    }
    if (!reaped)
        while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
            ;
    if (rc == 0 && !(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
        char code[32];
        if (WIFEXITED(status))
            snprintf(code, sizeof(code), "status %d", WEXITSTATUS(status));
        else
            snprintf(code, sizeof(code), "signal %d", WIFSIGNALED(status) ? WTERMSIG(status) : 0);
        say(why, n, "the exec plugin %s exited with %s", e->argv[0], code);
        rc = -EIO;
    }
    if (rc < 0) {
        free(out);
        return rc;
    }
    out[used] = '\0';
    *buf = out;
    *len = used;
    return 0;
}

int execcred_get(struct execcred *e, int64_t now_ms, bool force, const struct execcred_cred **out,
                 char *why, size_t n)
{
    struct execcred_cred fresh;
    char *text = NULL;
    size_t len = 0;
    int rc;

    *out = NULL;
    if (e->have && !force) {
        int64_t life = e->cur.expires_ms - e->fetched_ms, margin = life / 5;
        if (margin > REFRESH_MARGIN_MAX_MS)
            margin = REFRESH_MARGIN_MAX_MS;
        if (!e->cur.expires_ms || now_ms < e->cur.expires_ms - margin) {
            *out = &e->cur;
            return 0;
        }
    }
    rc = run(e, &text, &len, why, n);
    if (rc < 0)
        return rc;
    rc = execcred_parse(text, len, e->api_version, &fresh, why, n);
    explicit_bzero(text, len);
    free(text);
    if (rc < 0)
        return rc;
    if (fresh.expires_ms && fresh.expires_ms <= now_ms) {
        say(why, n, "the exec plugin %s returned a credential that has already expired",
            e->argv[0]);
        execcred_cred_cleanup(&fresh);
        return -EINVAL;
    }
    execcred_cred_cleanup(&e->cur);
    e->cur = fresh;
    e->fetched_ms = now_ms;
    e->have = true;
    log_info("execcred", "The exec credential plugin issued a credential.",
             LF_S("command", e->argv[0]), LF_S("kind", e->cur.token ? "token" : "certificate"),
             LF_I("expires_in_ms", e->cur.expires_ms ? e->cur.expires_ms - now_ms : -1));
    *out = &e->cur;
    return 0;
}

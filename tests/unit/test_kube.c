/* tests/unit/test_kube.c: the API client against a scripted HTTP server on
 * loopback (so every error path can be produced on demand), and the
 * kubeconfig and in-cluster loaders against files the tests write. */
#include <criterion/criterion.h>
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "base/clock.h"
#include "fixture.h"
#include "k8s/kube.h"

/* ---- a scripted server: one request per connection ---- */

struct req {
    char method[16];
    char target[1024];
    char auth[256];
    char ctype[128];
    char body[4096];
};

/* Writes the whole response for `r` to fd. */
typedef void (*route_fn)(const struct req *r, int fd);

static int lfd = -1;
static route_fn route;
static pthread_t srv_thread;
static atomic_int served;
static struct req last;
static char server_url[64];

/* MSG_NOSIGNAL: a client may hang up mid-response (a watch that refuses
 * what it was sent does), and SIGPIPE would end the test process. */
static void send_all(int fd, const char *p, size_t n)
{
    while (n > 0) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w <= 0)
            return;
        p += w;
        n -= (size_t)w;
    }
}

static void respond(int fd, int code, const char *body)
{
    char head[256];

    snprintf(head, sizeof(head),
             "HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %zu\r\n"
             "Connection: close\r\n\r\n", code, strlen(body));
    send_all(fd, head, strlen(head));
    send_all(fd, body, strlen(body));
}

static void header_value(const char *hdrs, const char *name, char *out, size_t n)
{
    const char *p = strcasestr(hdrs, name);

    out[0] = '\0';
    if (!p)
        return;
    p += strlen(name);
    while (*p == ' ')
        p++;
    snprintf(out, n, "%.*s", (int)strcspn(p, "\r\n"), p);
}

static void *serve(void *unused)
{
    for (;;) {
        char buf[16384];
        size_t len = 0;
        char *end, cl[32];
        struct req r;
        int fd = accept(lfd, NULL, NULL);

        if (fd < 0)
            return NULL;
        memset(&r, 0, sizeof(r));
        while (len < sizeof(buf) - 1) {
            ssize_t n = read(fd, buf + len, sizeof(buf) - 1 - len);
            if (n <= 0)
                break;
            len += (size_t)n;
            buf[len] = '\0';
            if ((end = strstr(buf, "\r\n\r\n"))) {
                header_value(buf, "Content-Length:", cl, sizeof(cl));
                if (len - (size_t)(end + 4 - buf) >= (size_t)strtoul(cl[0] ? cl : "0", NULL, 10))
                    break;
            }
        }
        end = strstr(buf, "\r\n\r\n");
        sscanf(buf, "%15s %1023s", r.method, r.target);
        header_value(buf, "Authorization:", r.auth, sizeof(r.auth));
        header_value(buf, "Content-Type:", r.ctype, sizeof(r.ctype));
        if (end)
            snprintf(r.body, sizeof(r.body), "%s", end + 4);
        last = r;
        route(&r, fd);
        atomic_fetch_add(&served, 1);
        close(fd);
    }
}

static struct kube *client(const char *token, const char *token_file, size_t max_body)
{
    struct kube_config c = { .server = server_url, .namespace = "ns1" };
    struct kube_opts o = { .max_body = max_body, .timeout_ms = 5000, .list_page = 2 };
    struct kube *k;

    c.token = (char *)token;
    c.token_file = (char *)token_file;
    cr_assert_eq(kube_create(&c, &o, &k), 0);
    return k;
}

static void start(void)
{
    struct sockaddr_in sa = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
    socklen_t sl = sizeof(sa);

    lfd = socket(AF_INET, SOCK_STREAM, 0);
    cr_assert(bind(lfd, (struct sockaddr *)&sa, sizeof(sa)) == 0);
    cr_assert(listen(lfd, 16) == 0);
    getsockname(lfd, (struct sockaddr *)&sa, &sl);
    snprintf(server_url, sizeof(server_url), "http://127.0.0.1:%d", ntohs(sa.sin_port));
    pthread_create(&srv_thread, NULL, serve, NULL);
}

static void stop(void)
{
    shutdown(lfd, SHUT_RDWR);
    close(lfd);
    pthread_join(srv_thread, NULL);
}

TestSuite(kube, .init = start, .fini = stop, .timeout = 60);

/* ---- requests and error mapping ---- */

static int next_code;
static const char *next_body;

static void fixed(const struct req *r, int fd)
{
    respond(fd, next_code, next_body);
}

static int get_with(int code, const char *body, cJSON **out)
{
    struct kube *k = client("t0", NULL, 0);
    int rc;

    route = fixed;
    next_code = code;
    next_body = body;
    rc = kube_get(k, "/api/v1/namespaces/ns1/pods/p", out);
    kube_destroy(k);
    return rc;
}

Test(kube, get_parses_and_sends_token)
{
    cJSON *o = NULL;

    cr_assert_eq(get_with(200, "{\"metadata\":{\"name\":\"p\",\"resourceVersion\":\"7\"}}", &o), 0);
    cr_assert_str_eq(kube_meta(o, "name"), "p");
    cr_assert_str_eq(kube_meta(o, "resourceVersion"), "7");
    cr_assert_str_eq(last.auth, "Bearer t0");
    cr_assert_str_eq(last.method, "GET");
    cJSON_Delete(o);
}

Test(kube, base64_and_secret_data)
{
    static const char *const plain[] = { "", "f", "fo", "foo", "foob", "fooba", "foobar" };
    static const char *const coded[] = { "", "Zg==", "Zm8=", "Zm9v", "Zm9vYg==", "Zm9vYmE=",
                                         "Zm9vYmFy" };
    cJSON *sec;
    char *out = NULL;
    size_t len = 0;

    for (size_t i = 0; i < sizeof(plain) / sizeof(plain[0]); i++) {
        char *b = kube_base64(plain[i], strlen(plain[i]));
        cr_assert_str_eq(b, coded[i], "RFC 4648's vector %zu", i);
        free(b);
    }
    sec = cJSON_Parse("{\"data\":{\"k\":\"AP8Afw==\",\"bad\":\"a!b\",\"num\":1}}");
    cr_assert_eq(kube_secret_data(sec, "k", &out, &len), 0);
    cr_assert_eq(len, 4);
    cr_assert(memcmp(out, "\x00\xff\x00\x7f", 4) == 0 && out[4] == '\0');
    free(out);
    cr_assert_eq(kube_secret_data(sec, "missing", &out, NULL), -ENOENT);
    cr_assert_null(out);
    cr_assert_eq(kube_secret_data(sec, "bad", &out, NULL), -EINVAL);
    cr_assert_eq(kube_secret_data(sec, "num", &out, NULL), -EINVAL);
    cJSON_Delete(sec);
}

Test(kube, statuses_map_to_errno)
{
    cJSON *o = (cJSON *)1;

    cr_assert_eq(get_with(404, "{\"kind\":\"Status\",\"code\":404}", &o), -ENOENT);
    cr_assert_null(o);
    cr_assert_eq(get_with(409, "{\"kind\":\"Status\",\"reason\":\"AlreadyExists\"}", &o), -EEXIST);
    cr_assert_eq(get_with(409, "{\"kind\":\"Status\",\"reason\":\"Conflict\"}", &o), -ESTALE);
    cr_assert_eq(get_with(410, "{\"kind\":\"Status\",\"code\":410}", &o), -EREMCHG);
    cr_assert_eq(get_with(422, "{\"kind\":\"Status\",\"message\":\"spec.replicas: Invalid\"}", &o), -EINVAL);
    cr_assert_eq(get_with(403, "{}", &o), -EPERM);
    cr_assert_eq(get_with(429, "{}", &o), -EAGAIN);
    cr_assert_eq(get_with(503, "not even json", &o), -EIO);
    cr_assert_eq(get_with(200, "{\"truncated\":", &o), -EBADMSG);
}

Test(kube, errors_keep_the_status_reason_and_message)
{
    cJSON *o = NULL;
    const struct kube_error *e;

    cr_assert_eq(get_with(403, "{\"kind\":\"Status\",\"reason\":\"Forbidden\",\"code\":403,"
                          "\"message\":\"pods \\\"p\\\" is forbidden: User \\\"u\\\" cannot get "
                          "resource \\\"pods\\\"\"}", &o), -EPERM);
    e = kube_last_error();
    cr_assert_eq(e->rc, -EPERM);
    cr_assert_eq(e->status, 403);
    cr_assert_str_eq(e->reason, "Forbidden");
    cr_assert_str_eq(e->message, "pods \"p\" is forbidden: User \"u\" cannot get resource \"pods\"");
    cr_assert_str_eq(kube_strerror(-EPERM), "HTTP 403 Forbidden: pods \"p\" is forbidden: User \"u\" "
                     "cannot get resource \"pods\"");
    /* Another errno than the last call's is only strerror's words. */
    cr_assert_str_eq(kube_strerror(-ENOENT), "No such file or directory");
    /* A 404 says so, not "No such file or directory". */
    cr_assert_eq(get_with(404, "{\"kind\":\"Status\",\"reason\":\"NotFound\",\"code\":404,"
                          "\"message\":\"pods \\\"p\\\" not found\"}", &o), -ENOENT);
    cr_assert_str_eq(kube_strerror(-ENOENT), "HTTP 404 NotFound: pods \"p\" not found");
    /* A body that is no Status still names the status. */
    cr_assert_eq(get_with(503, "not even json", &o), -EIO);
    cr_assert_str_eq(kube_strerror(-EIO), "HTTP 503 (no reason)");
    /* A huge message is cut, not overflowed. */
    {
        static char big[4096];
        int n = snprintf(big, sizeof(big), "{\"reason\":\"Invalid\",\"message\":\"");
        memset(big + n, 'x', 3000);
        snprintf(big + n + 3000, sizeof(big) - (size_t)n - 3000, "\"}");
        cr_assert_eq(get_with(422, big, &o), -EINVAL);
        cr_assert_eq(strlen(kube_last_error()->message), sizeof(e->message) - 1);
        cr_assert(strncmp(kube_strerror(-EINVAL), "HTTP 422 Invalid: xxx", 21) == 0);
    }
    /* A success clears it. */
    cr_assert_eq(get_with(200, "{}", &o), 0);
    cJSON_Delete(o);
    cr_assert_eq(kube_last_error()->status, 0);
    cr_assert_str_eq(kube_strerror(-EIO), "Input/output error");
}

Test(kube, a_transport_error_says_curls_words)
{
    struct kube_config c = { .server = "http://127.0.0.1:1", .namespace = "x" };
    struct kube *k;
    cJSON *o;

    cr_assert_eq(kube_create(&c, NULL, &k), 0);
    cr_assert_eq(kube_get(k, "/x", &o), -ECONNREFUSED);
    cr_assert_eq(kube_last_error()->status, 0);
    cr_assert_str_eq(kube_strerror(-ECONNREFUSED), "Couldn't connect to server");
    kube_destroy(k);
}

Test(kube, oversized_body_is_refused)
{
    static char big[200000];
    struct kube *k = client("t0", NULL, 64 * 1024);
    cJSON *o;

    memset(big, ' ', sizeof(big) - 3);
    big[0] = '{';
    big[sizeof(big) - 2] = '}';
    route = fixed;
    next_code = 200;
    next_body = big;
    cr_assert_eq(kube_get(k, "/x", &o), -EMSGSIZE);
    cr_assert_null(o);
    kube_destroy(k);
}

Test(kube, dead_server_is_connection_refused)
{
    struct kube_config c = { .server = "http://127.0.0.1:1", .namespace = "x" };
    struct kube *k;
    cJSON *o;

    cr_assert_eq(kube_create(&c, NULL, &k), 0);
    cr_assert_eq(kube_get(k, "/x", &o), -ECONNREFUSED);
    kube_destroy(k);
    c.server = NULL;
    cr_assert_eq(kube_create(&c, NULL, &k), -EINVAL);
}

Test(kube, merge_patch_sends_its_content_type_and_body)
{
    struct kube *k = client("t0", NULL, 0);
    cJSON *patch = cJSON_Parse("{\"spec\":{\"replicas\":5}}"), *o = NULL;

    route = fixed;
    next_code = 200;
    next_body = "{\"spec\":{\"replicas\":5}}";
    cr_assert_eq(kube_merge_patch(k, "/apis/cohort.dev/v1alpha1/namespaces/ns1/trainingcohorts/a",
                                  patch, &o), 0);
    cr_assert_str_eq(last.method, "PATCH");
    cr_assert_str_eq(last.ctype, "application/merge-patch+json");
    cr_assert_str_eq(last.body, "{\"spec\":{\"replicas\":5}}");
    cJSON_Delete(o);
    cJSON_Delete(patch);
    kube_destroy(k);
}

/* ---- tokens ---- */

static void need_new_token(const struct req *r, int fd)
{
    if (strcmp(r->auth, "Bearer new") == 0)
        respond(fd, 200, "{}");
    else
        respond(fd, 401, "{\"kind\":\"Status\",\"code\":401}");
}

Test(kube, token_file_is_reread_after_401)
{
    char path[] = "/tmp/cohort-token-XXXXXX";
    int fd = mkstemp(path);
    struct timespec keep[2];
    struct stat st;
    struct kube *k;

    cr_assert(write(fd, "old\n", 4) == 4);
    close(fd);
    k = client(NULL, path, 0);
    route = need_new_token;
    cr_assert_eq(kube_get(k, "/x", NULL), -EACCES);     /* "old" is refused, twice */
    /* Rotate the token but keep the mtime, so only the 401 can reveal it. */
    stat(path, &st);
    keep[0] = st.st_atim;
    keep[1] = st.st_mtim;
    fd = open(path, O_WRONLY | O_TRUNC);
    cr_assert(write(fd, "new\n", 4) == 4);
    close(fd);
    utimensat(AT_FDCWD, path, keep, 0);
    cr_assert_eq(kube_get(k, "/x", NULL), 0);
    cr_assert_str_eq(last.auth, "Bearer new");
    kube_destroy(k);
    unlink(path);
}

/* ---- lists ---- */

static void paged(const struct req *r, int fd)
{
    if (!strstr(r->target, "limit=2")) {
        respond(fd, 400, "{}");
    } else if (strstr(r->target, "continue=tok%2F1")) {
        respond(fd, 200, "{\"metadata\":{\"resourceVersion\":\"12\"},"
                         "\"items\":[{\"metadata\":{\"name\":\"c\"}}]}");
    } else {
        respond(fd, 200, "{\"metadata\":{\"resourceVersion\":\"11\",\"continue\":\"tok/1\"},"
                         "\"items\":[{\"metadata\":{\"name\":\"a\"}},{\"metadata\":{\"name\":\"b\"}}]}");
    }
}

Test(kube, list_follows_continue_and_escapes_selector)
{
    struct kube *k = client("t0", NULL, 0);
    cJSON *items;
    char *rv;

    route = paged;
    cr_assert_eq(kube_list(k, "/api/v1/namespaces/ns1/pods", "cohort.dev/name=a,tier in (x)",
                           &items, &rv), 0);
    cr_assert_eq(cJSON_GetArraySize(items), 3);
    cr_assert_str_eq(kube_meta(cJSON_GetArrayItem(items, 2), "name"), "c");
    cr_assert_str_eq(rv, "12");
    cr_assert(strstr(last.target, "labelSelector=cohort.dev%2Fname%3Da%2Ctier%20in%20%28x%29"),
              "%s", last.target);
    cJSON_Delete(items);
    free(rv);
    kube_destroy(k);
}

/* ---- watches ---- */

static const char *stream_text;
static bool stream_hold;        /* keep the connection open afterwards */
static atomic_bool holding;     /* it is: everything is sent, nothing more comes */
static atomic_bool release;

static void streamed(const struct req *r, int fd)
{
    const char *head = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                       "Transfer-Encoding: chunked\r\n\r\n";
    char chunk[64];

    send_all(fd, head, strlen(head));
    if (stream_text[0]) {
        snprintf(chunk, sizeof(chunk), "%zx\r\n", strlen(stream_text));
        send_all(fd, chunk, strlen(chunk));
        send_all(fd, stream_text, strlen(stream_text));
        send_all(fd, "\r\n", 2);
    }
    if (stream_hold) {
        atomic_store(&holding, true);
        while (!atomic_load(&release))
            clock_sleep_ms(FIXTURE_POLL_MS);
    }
    send_all(fd, "0\r\n\r\n", 5);
}

struct seen {
    char types[8][16];
    int n;
};

static int on_event(void *arg, const char *type, const cJSON *obj)
{
    struct seen *s = arg;

    if (s->n < 8)
        snprintf(s->types[s->n++], sizeof(s->types[0]), "%s", type);
    return 0;
}

/* A watch of /api/v1/pods from resource version *rv (kube_watch() owns
 * and replaces it) on a connection that streams `text` and ends; the
 * event types go to *s. Returns kube_watch()'s result. */
static int watch_stream(const char *text, char **rv, struct seen *s)
{
    struct kube *k = client("t0", NULL, 0);
    int rc;

    route = streamed;
    stream_hold = false;
    stream_text = text;
    rc = kube_watch(k, "/api/v1/pods", NULL, rv, 30, on_event, s, NULL);
    kube_destroy(k);
    return rc;
}

Test(kube, watch_delivers_events_and_tracks_bookmarks)
{
    struct seen s = { .n = 0 };
    char *rv = strdup("10");

    cr_assert_eq(watch_stream(
        "{\"type\":\"ADDED\",\"object\":{\"metadata\":{\"name\":\"a\",\"resourceVersion\":\"11\"}}}\n"
        "{\"type\":\"BOOKMARK\",\"object\":{\"metadata\":{\"resourceVersion\":\"15\"}}}\n"
        "{\"type\":\"MODIFIED\",\"object\":{\"metadata\":{\"name\":\"a\",\"resourceVersion\":\"16\"}}}\n",
        &rv, &s), 0);
    cr_assert_eq(s.n, 3);
    cr_assert_str_eq(s.types[1], "BOOKMARK");
    cr_assert_str_eq(rv, "16");
    cr_assert(strstr(last.target, "watch=true") && strstr(last.target, "allowWatchBookmarks=true") &&
              strstr(last.target, "resourceVersion=10"), "%s", last.target);
    free(rv);
}

Test(kube, watch_gone_means_relist)
{
    struct seen s = { .n = 0 };
    char *rv = strdup("1");

    cr_assert_eq(watch_stream("{\"type\":\"ERROR\",\"object\":{\"kind\":\"Status\",\"code\":410,"
                              "\"reason\":\"Expired\"}}\n", &rv, &s), -EREMCHG);
    cr_assert_eq(s.n, 0);
    free(rv);
}

Test(kube, watch_garbage_is_bad_message)
{
    struct seen s = { .n = 0 };
    char *rv = NULL;

    cr_assert_eq(watch_stream("{\"type\":\"ADDED\",\"object\":{\"metadata\":{}}}\nthis is not json\n",
                              &rv, &s), -EBADMSG);
    cr_assert_eq(s.n, 1);
    free(rv);
}

static volatile bool stop_flag;

static bool stream_is_holding(void *unused)
{
    return atomic_load(&holding);
}

/* Asks the watch to stop once the server has sent all it will and holds
 * the connection open. On its own thread, so it fails nothing itself: if
 * the stream never gets there it asks anyway, late, and the test's checks
 * fail. */
static void *raise_stop(void *unused)
{
    fixture_wait_until(stream_is_holding, NULL, FIXTURE_WAIT_MS);
    stop_flag = true;
    return NULL;
}

Test(kube, quiet_watch_stops_when_asked)
{
    struct kube *k = client("t0", NULL, 0);
    struct seen s = { .n = 0 };
    char *rv = NULL;
    pthread_t t;
    uint64_t t0 = clock_now_ms();

    route = streamed;
    stream_hold = true;
    stream_text = "";
    stop_flag = false;
    pthread_create(&t, NULL, raise_stop, NULL);
    cr_assert_eq(kube_watch(k, "/api/v1/pods", NULL, &rv, 300, on_event, &s, &stop_flag), 0);
    cr_assert(atomic_load(&holding), "the watch ended before its stream went quiet");
    cr_assert_lt(clock_now_ms() - t0, 10000);
    atomic_store(&release, true);
    pthread_join(t, NULL);
    kube_destroy(k);
}

/* ---- configuration ---- */

static void write_text(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fputs(text, f);
    fclose(f);
}

Test(kube, kubeconfig_yaml_contexts_and_data)
{
    char dir[] = "/tmp/cohort-kc-XXXXXX", path[256];
    struct kube_config c;

    cr_assert_not_null(mkdtemp(dir));
    snprintf(path, sizeof(path), "%s/config", dir);
    write_text(path,
               "apiVersion: v1\n"
               "kind: Config\n"
               "current-context: one\n"
               "clusters:\n"
               "- name: c1\n"
               "  cluster:\n"
               "    server: https://10.0.0.1:6443\n"
               "    certificate-authority-data: aGVsbG8=\n"
               "- name: c2\n"
               "  cluster: {server: 'http://127.0.0.1:8001', insecure-skip-tls-verify: true}\n"
               "contexts:\n"
               "- name: one\n"
               "  context: {cluster: c1, user: u1, namespace: team}\n"
               "- name: two\n"
               "  context: {cluster: c2, user: u2}\n"
               "users:\n"
               "- name: u1\n"
               "  user: {token: abc}\n"
               "- name: u2\n"
               "  user: {tokenFile: tok, client-certificate: certs/c.pem}\n");
    cr_assert_eq(kube_config_load(path, NULL, &c), 0);
    cr_assert_str_eq(c.server, "https://10.0.0.1:6443");
    cr_assert_str_eq(c.namespace, "team");
    cr_assert_str_eq(c.token, "abc");
    cr_assert_eq(c.ca_data_len, 5);
    cr_assert_eq(memcmp(c.ca_data, "hello", 5), 0);
    cr_assert(!c.insecure);
    kube_config_cleanup(&c);

    cr_assert_eq(kube_config_load(path, "two", &c), 0);
    cr_assert_str_eq(c.server, "http://127.0.0.1:8001");
    cr_assert(c.insecure);
    cr_assert_str_eq(c.namespace, "default");
    cr_assert(strstr(c.token_file, dir) && strstr(c.token_file, "/tok"));
    cr_assert(strstr(c.cert_file, "/certs/c.pem"));
    kube_config_cleanup(&c);

    cr_assert_eq(kube_config_load(path, "three", &c), -ENOENT);
    write_text(path, "clusters: [unclosed\n");
    cr_assert_eq(kube_config_load(path, NULL, &c), -EINVAL);
    write_text(path, "{\"current-context\":\"x\",\"contexts\":[{\"name\":\"x\",\"context\":"
                     "{\"cluster\":\"c\"}}],\"clusters\":[{\"name\":\"c\",\"cluster\":"
                     "{\"server\":\"http://h:1\",\"certificate-authority-data\":\"!!\"}}]}");
    cr_assert_eq(kube_config_load(path, NULL, &c), -EINVAL, "bad base64 is refused");
    cr_assert_eq(kube_config_load("/nonexistent/kubeconfig", NULL, &c), -ENOENT);
}

Test(kube, in_cluster_config_from_service_account)
{
    char dir[] = "/tmp/cohort-sa-XXXXXX", path[256];
    struct kube_config c;

    cr_assert_not_null(mkdtemp(dir));
    unsetenv("KUBERNETES_SERVICE_HOST");
    cr_assert_eq(kube_config_in_cluster(dir, &c), -ENOENT);
    setenv("KUBERNETES_SERVICE_HOST", "fd00::1", 1);
    setenv("KUBERNETES_SERVICE_PORT", "443", 1);
    cr_assert_eq(kube_config_in_cluster(dir, &c), -ENOENT, "no token file: not in a cluster");
    snprintf(path, sizeof(path), "%s/token", dir);
    write_text(path, "tok");
    snprintf(path, sizeof(path), "%s/namespace", dir);
    write_text(path, "team-a\n");
    cr_assert_eq(kube_config_in_cluster(dir, &c), 0);
    cr_assert_str_eq(c.server, "https://[fd00::1]:443");
    cr_assert_str_eq(c.namespace, "team-a");
    cr_assert(strstr(c.ca_file, "/ca.crt"));
    kube_config_cleanup(&c);
}

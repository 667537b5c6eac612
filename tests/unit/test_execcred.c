/* tests/unit/test_execcred.c: exec credential plugins: the ExecCredential
 * parser and its refusals, the configurations client-go refuses, and real
 * plugins (/bin/sh scripts) that succeed, fail, hang, flood their output,
 * and are cached until their credential nears its expiry. */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/clock.h"
#include "k8s/execcred.h"

#define V1 "client.authentication.k8s.io/v1"

static char why[EXECCRED_WHY_MAX];

static int parse(const char *text, struct execcred_cred *c)
{
    return execcred_parse(text, strlen(text), V1, c, why, sizeof(why));
}

Test(execcred, parses_a_token_and_its_expiry)
{
    struct execcred_cred c;

    cr_assert_eq(parse("{\"apiVersion\":\"" V1 "\",\"kind\":\"ExecCredential\",\"status\":"
                       "{\"token\":\"t1\",\"expirationTimestamp\":\"2030-01-02T03:04:05Z\"}}", &c), 0);
    cr_assert_str_eq(c.token, "t1");
    cr_assert_eq(c.expires_ms, 1893553445000LL);
    execcred_cred_cleanup(&c);
    cr_assert_eq(parse("{\"apiVersion\":\"" V1 "\",\"kind\":\"ExecCredential\",\"status\":"
                       "{\"clientCertificateData\":\"C\",\"clientKeyData\":\"K\"}}", &c), 0);
    cr_assert_null(c.token);
    cr_assert_str_eq(c.cert_pem, "C");
    cr_assert_str_eq(c.key_pem, "K");
    cr_assert_eq(c.expires_ms, 0);
    execcred_cred_cleanup(&c);
}

Test(execcred, refuses_what_is_no_credential)
{
    struct execcred_cred c;

    cr_assert_eq(parse("{\"apiVersion\":", &c), -EINVAL);
    cr_assert_str_eq(why, "the exec plugin's output is not a JSON object");
    cr_assert_eq(parse("{\"apiVersion\":\"client.authentication.k8s.io/v1beta1\",\"kind\":"
                       "\"ExecCredential\",\"status\":{\"token\":\"t\"}}", &c), -EINVAL);
    cr_assert_str_eq(why, "exec plugin is configured to use API version " V1 ", plugin returned "
                     "version client.authentication.k8s.io/v1beta1");
    cr_assert_eq(parse("{\"apiVersion\":\"" V1 "\",\"kind\":\"Secret\",\"status\":{}}", &c), -EINVAL);
    cr_assert_eq(parse("{\"apiVersion\":\"" V1 "\",\"kind\":\"ExecCredential\"}", &c), -EINVAL);
    cr_assert_str_eq(why, "exec plugin didn't return a status field");
    cr_assert_eq(parse("{\"apiVersion\":\"" V1 "\",\"kind\":\"ExecCredential\",\"status\":{}}", &c),
                 -EINVAL);
    cr_assert_str_eq(why, "exec plugin didn't return a token or cert/key pair");
    cr_assert_eq(parse("{\"apiVersion\":\"" V1 "\",\"kind\":\"ExecCredential\",\"status\":"
                       "{\"token\":\"t\",\"clientCertificateData\":\"C\"}}", &c), -EINVAL);
    cr_assert_eq(parse("{\"apiVersion\":\"" V1 "\",\"kind\":\"ExecCredential\",\"status\":"
                       "{\"token\":\"t\",\"expirationTimestamp\":\"tomorrow\"}}", &c), -EINVAL);
    cr_assert_str_eq(why, "the exec plugin's expirationTimestamp \"tomorrow\" is not RFC 3339");
}

Test(execcred, rfc3339_times)
{
    int64_t ms;

    cr_assert_eq(execcred_parse_time("1970-01-01T00:00:01Z", &ms), 0);
    cr_assert_eq(ms, 1000);
    cr_assert_eq(execcred_parse_time("1970-01-01T01:00:01.25+01:00", &ms), 0);
    cr_assert_eq(ms, 1250);
    cr_assert_eq(execcred_parse_time("1970-01-01T00:00:00-00:30", &ms), 0);
    cr_assert_eq(ms, 1800000);
    cr_assert_eq(execcred_parse_time("1970-01-01 00:00:00Z", &ms), -EINVAL);
    cr_assert_eq(execcred_parse_time("1970-13-01T00:00:00Z", &ms), -EINVAL);
    cr_assert_eq(execcred_parse_time("1970-01-01T00:00:00", &ms), -EINVAL);
    cr_assert_eq(execcred_parse_time("1970-01-01T00:00:00Zjunk", &ms), -EINVAL);
}

static struct execcred *plugin(const char *json, uint32_t timeout_ms, size_t max_out)
{
    cJSON *exec = cJSON_Parse(json);
    struct execcred_cluster cl = { .server = "https://127.0.0.1:6443", .ca_data_b64 = "Q0E=" };
    struct execcred_opts o = { .timeout_ms = timeout_ms, .max_output = max_out };
    struct execcred *e = NULL;

    cr_assert_not_null(exec);
    cr_assert_eq(execcred_create(exec, &cl, &o, &e, why, sizeof(why)), 0, "%s", why);
    cJSON_Delete(exec);
    return e;
}

static int create(const char *json)
{
    cJSON *exec = cJSON_Parse(json);
    struct execcred *e = NULL;
    int rc = execcred_create(exec, NULL, NULL, &e, why, sizeof(why));

    cJSON_Delete(exec);
    execcred_destroy(e);
    return rc;
}

Test(execcred, refuses_configurations_that_cannot_work)
{
    cr_assert_eq(create("{\"apiVersion\":\"" V1 "\",\"interactiveMode\":\"Never\"}"), -EINVAL);
    cr_assert_str_eq(why, "the exec plugin has no command");
    cr_assert_eq(create("{\"apiVersion\":\"client.authentication.k8s.io/v1alpha1\",\"command\":"
                        "\"x\"}"), -EINVAL);
    cr_assert_eq(create("{\"apiVersion\":\"" V1 "\",\"command\":\"x\"}"), -EINVAL);
    cr_assert_str_eq(why, "exec plugin: interactiveMode must be specified for x to use exec "
                     "authentication plugin");
    cr_assert_eq(create("{\"apiVersion\":\"" V1 "\",\"command\":\"x\",\"interactiveMode\":"
                        "\"Always\"}"), -EINVAL);
    cr_assert(strstr(why, "interactiveMode Always") && strstr(why, "without a terminal"), "%s", why);
    cr_assert_eq(create("{\"apiVersion\":\"" V1 "\",\"command\":\"x\",\"interactiveMode\":"
                        "\"Never\",\"env\":[{\"name\":\"A=B\",\"value\":\"c\"}]}"), -EINVAL);
    cr_assert_eq(create("{\"apiVersion\":\"" V1 "\",\"command\":\"x\",\"interactiveMode\":"
                        "\"Never\",\"args\":[1]}"), -EINVAL);
    /* v1beta1 defaults interactiveMode to IfAvailable. */
    cr_assert_eq(create("{\"apiVersion\":\"client.authentication.k8s.io/v1beta1\",\"command\":"
                        "\"x\"}"), 0);
}

#define SH(script) "{\"apiVersion\":\"" V1 "\",\"interactiveMode\":\"Never\",\"command\":" \
    "\"/bin/sh\",\"args\":[\"-c\",\"" script "\"]"

Test(execcred, runs_the_plugin_with_its_args_env_and_exec_info)
{
    /* The token is what the plugin saw: its env entry and
     * KUBERNETES_EXEC_INFO's cluster (provideClusterInfo). */
    struct execcred *e = plugin(SH("printf '{\\\"apiVersion\\\":\\\"" V1 "\\\",\\\"kind\\\":"
                                   "\\\"ExecCredential\\\",\\\"status\\\":{\\\"token\\\":\\\"%s|%s\\\"}}' "
                                   "\\\"$FOO\\\" \\\"$(echo \\\"$KUBERNETES_EXEC_INFO\\\" | tr -d "
                                   "'\\\\\\\"')\\\"")
                                ",\"env\":[{\"name\":\"FOO\",\"value\":\"bar baz\"}],"
                                "\"provideClusterInfo\":true}", 0, 0);
    const struct execcred_cred *c;

    cr_assert_eq(execcred_get(e, (int64_t)clock_wall_ms(), false, &c, why, sizeof(why)), 0, "%s", why);
    cr_assert(strncmp(c->token, "bar baz|", 8) == 0, "%s", c->token);
    cr_assert(strstr(c->token, "kind:ExecCredential"), "%s", c->token);
    cr_assert(strstr(c->token, "interactive:false"), "%s", c->token);
    cr_assert(strstr(c->token, "server:https://127.0.0.1:6443"), "%s", c->token);
    cr_assert(strstr(c->token, "certificate-authority-data:Q0E="), "%s", c->token);
    /* Cached: no expiry, no second run, unless forced. */
    cr_assert_eq(execcred_get(e, (int64_t)clock_wall_ms(), false, &c, why, sizeof(why)), 0);
    cr_assert_eq(execcred_runs(e), 1);
    cr_assert_eq(execcred_get(e, (int64_t)clock_wall_ms(), true, &c, why, sizeof(why)), 0);
    cr_assert_eq(execcred_runs(e), 2);
    execcred_destroy(e);
}

Test(execcred, runs_again_before_expiry)
{
    /* A credential that lives 100 s from "now" (1970 + 100 s), fetched at 0. */
    struct execcred *e = plugin(SH("echo '{\\\"apiVersion\\\":\\\"" V1 "\\\",\\\"kind\\\":"
                                   "\\\"ExecCredential\\\",\\\"status\\\":{\\\"token\\\":\\\"t\\\","
                                   "\\\"expirationTimestamp\\\":\\\"1970-01-01T00:01:40Z\\\"}}'") "}",
                                0, 0);
    const struct execcred_cred *c;

    cr_assert_eq(execcred_get(e, 0, false, &c, why, sizeof(why)), 0, "%s", why);
    cr_assert_eq(c->expires_ms, 100000);
    cr_assert_eq(execcred_get(e, 50000, false, &c, why, sizeof(why)), 0);
    cr_assert_eq(execcred_runs(e), 1);
    /* Within a fifth of its life of expiring: run again. */
    cr_assert_eq(execcred_get(e, 85000, false, &c, why, sizeof(why)), 0);
    cr_assert_eq(execcred_runs(e), 2);
    /* Already expired when issued: refused. */
    cr_assert_eq(execcred_get(e, 200000, true, &c, why, sizeof(why)), -EINVAL);
    cr_assert(strstr(why, "already expired"), "%s", why);
    execcred_destroy(e);
}

Test(execcred, a_failing_plugin_says_why)
{
    struct execcred *e = plugin(SH("echo 'no such account' >&2; exit 3") "}", 0, 0);
    const struct execcred_cred *c;

    cr_assert_eq(execcred_get(e, 0, false, &c, why, sizeof(why)), -EIO);
    cr_assert_str_eq(why, "the exec plugin /bin/sh exited with status 3");
    cr_assert_null(c);
    execcred_destroy(e);

    e = plugin("{\"apiVersion\":\"" V1 "\",\"interactiveMode\":\"Never\",\"command\":"
               "\"/nonexistent/plugin\"}", 0, 0);
    cr_assert_eq(execcred_get(e, 0, false, &c, why, sizeof(why)), -ENOENT);
    cr_assert(strstr(why, "could not be started: No such file or directory"), "%s", why);
    execcred_destroy(e);

    e = plugin(SH("echo not json") "}", 0, 0);
    cr_assert_eq(execcred_get(e, 0, false, &c, why, sizeof(why)), -EINVAL);
    cr_assert_str_eq(why, "the exec plugin's output is not a JSON object");
    execcred_destroy(e);
}

Test(execcred, a_hanging_plugin_is_killed, .timeout = 30)
{
    struct execcred *e = plugin(SH("sleep 60") "}", 300, 0);
    const struct execcred_cred *c;
    uint64_t t0 = clock_now_ms();

    cr_assert_eq(execcred_get(e, 0, false, &c, why, sizeof(why)), -ETIMEDOUT);
    cr_assert(clock_now_ms() - t0 < 10000);
    cr_assert_str_eq(why, "the exec plugin /bin/sh did not finish within its time limit");
    execcred_destroy(e);
    /* One that closes its stdout but lingers is killed too. */
    e = plugin(SH("exec >&-; sleep 60") "}", 300, 0);
    cr_assert_eq(execcred_get(e, 0, false, &c, why, sizeof(why)), -ETIMEDOUT);
    execcred_destroy(e);
}

Test(execcred, a_flood_of_output_is_cut_off, .timeout = 30)
{
    struct execcred *e = plugin(SH("yes xxxxxxxxxxxxxxxx") "}", 5000, 64 * 1024);
    const struct execcred_cred *c;

    cr_assert_eq(execcred_get(e, 0, false, &c, why, sizeof(why)), -EMSGSIZE);
    cr_assert_str_eq(why, "the exec plugin /bin/sh wrote more than its output limit");
    execcred_destroy(e);
}

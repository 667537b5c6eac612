/* tests/unit/test_reconcile.c: the operator's pure decisions: spec checks,
 * the pod it makes (the key's Secret in the sidecar alone), ordinals, the
 * plan (create, replace, drain, suspend, maxRestarts, pods of an old key),
 * status, conditions and the status patch; back-off between replacements,
 * the restart budget's window, template rollouts and failures in status. */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "accumulator/ckpt.h"
#include "accumulator/compress.h"
#include "k8s/reconcile.h"

static cJSON *parse(const char *json)
{
    cJSON *o = cJSON_Parse(json);
    cr_assert_not_null(o, "bad test JSON: %s", json);
    return o;
}

#define TEMPLATE "\"template\":{\"metadata\":{\"labels\":{\"app\":\"lr\",\"cohort.dev/cohort\":\"evil\"}}," \
                 "\"spec\":{\"containers\":[{\"name\":\"trainer\",\"command\":[\"t\"]," \
                 "\"env\":[{\"name\":\"COHORT_BROKER\",\"value\":\"wrong:1\"},{\"name\":\"X\",\"value\":\"1\"}]}]}}"

static cJSON *cohort(const char *name, const char *spec_fields)
{
    char buf[4096];
    snprintf(buf, sizeof(buf),
             "{\"apiVersion\":\"cohort.dev/v1alpha1\",\"kind\":\"TrainingCohort\","
             "\"metadata\":{\"name\":\"%s\",\"namespace\":\"ns\",\"uid\":\"u-1\",\"generation\":3},"
             "\"spec\":{%s%s" TEMPLATE "}}", name, spec_fields, *spec_fields ? "," : "");
    return parse(buf);
}

static const struct reconcile_env env = { .broker_address = "10.0.0.1:7070",
                                          .sidecar_image = "img:1",
                                          .sidecar_command = "cohort-sidecar" };

Test(reconcile, parse_applies_the_crd_defaults)
{
    cJSON *tc = cohort("lr", "");
    struct reconcile_spec s;
    struct reconcile_why why;

    cr_assert_eq(reconcile_parse(tc, &s, &why), 0, "%s", why.message);
    cr_assert_eq(s.replicas, 1);
    cr_assert_eq(s.min_replicas, 1);
    cr_assert_eq(s.max_restarts, 10);
    cr_assert_eq(s.heartbeat_ms, 1000);
    cr_assert_eq(s.timeout_ms, 5000);
    cr_assert(!s.suspend);
    cJSON_Delete(tc);
}

Test(reconcile, parse_reads_timeouts_and_suspend)
{
    cJSON *tc = cohort("lr", "\"replicas\":3,\"suspend\":true,\"maxRestarts\":0,"
                             "\"timeouts\":{\"heartbeatInterval\":\"250ms\",\"memberTimeout\":\"2s\"}");
    struct reconcile_spec s;
    struct reconcile_why why;

    cr_assert_eq(reconcile_parse(tc, &s, &why), 0);
    cr_assert_eq(s.replicas, 3);
    cr_assert(s.suspend);
    cr_assert_eq(s.max_restarts, 0);
    cr_assert_eq(s.heartbeat_ms, 250);
    cr_assert_eq(s.timeout_ms, 2000);
    cJSON_Delete(tc);
}

static void refused(const char *name, const char *fields, const char *reason)
{
    cJSON *tc = cohort(name, fields);
    struct reconcile_spec s;
    struct reconcile_why why;

    cr_assert_eq(reconcile_parse(tc, &s, &why), -EINVAL, "%s should be refused", fields);
    cr_assert_str_eq(why.reason, reason);
    cr_assert_gt(strlen(why.message), 10);
    cJSON_Delete(tc);
}

Test(reconcile, parse_refuses_what_cannot_run_with_a_reason)
{
    char longname[80];

    memset(longname, 'a', 64);
    longname[64] = '\0';
    refused(longname, "", "NameTooLong");
    refused("lr", "\"replicas\":1,\"minReplicas\":2", "InvalidReplicas");
    refused("lr", "\"replicas\":5,\"maxReplicas\":4", "InvalidReplicas");
    refused("lr", "\"replicas\":0", "InvalidReplicas");
    refused("lr", "\"replicas\":1.5", "InvalidReplicas");
    /* Far outside long's range: refused before any conversion (the
     * sanitizer build traps float-cast-overflow). */
    refused("lr", "\"replicas\":1e300", "InvalidReplicas");
    refused("lr", "\"replicas\":-1e300", "InvalidReplicas");
    refused("lr", "\"maxReplicas\":9.3e18", "InvalidReplicas");
    refused("lr", "\"maxRestarts\":1e19", "InvalidSpec");
    refused("lr", "\"timeouts\":{\"heartbeatInterval\":\"2s\",\"memberTimeout\":\"1s\"}",
            "InvalidTimeouts");
    refused("lr", "\"timeouts\":{\"memberTimeout\":\"soon\"}", "InvalidTimeouts");
}

Test(reconcile, parse_refuses_reserved_names_and_empty_templates)
{
    struct reconcile_spec s;
    struct reconcile_why why;
    cJSON *tc = parse("{\"metadata\":{\"name\":\"lr\"},\"spec\":{\"template\":{\"spec\":"
                      "{\"containers\":[{\"name\":\"cohort-sidecar\"}]}}}}");

    cr_assert_eq(reconcile_parse(tc, &s, &why), -EINVAL);
    cr_assert_str_eq(why.reason, "InvalidTemplate");
    cJSON_Delete(tc);
    tc = parse("{\"metadata\":{\"name\":\"lr\"},\"spec\":{\"template\":{\"spec\":"
               "{\"containers\":[]}}}}");
    cr_assert_eq(reconcile_parse(tc, &s, &why), -EINVAL);
    cJSON_Delete(tc);
    tc = parse("{\"metadata\":{\"name\":\"lr\"},\"spec\":{\"template\":{\"spec\":"
               "{\"containers\":[{\"name\":\"t\"}],\"volumes\":[{\"name\":\"cohort\"}]}}}}");
    cr_assert_eq(reconcile_parse(tc, &s, &why), -EINVAL);
    cJSON_Delete(tc);
    tc = parse("{\"metadata\":{\"name\":\"lr\"},\"spec\":{\"template\":{\"spec\":"
               "{\"containers\":[{\"name\":\"t\"}],\"volumes\":[{\"name\":\"cohort-secret\"}]}}}}");
    cr_assert_eq(reconcile_parse(tc, &s, &why), -EINVAL);
    cr_assert_str_eq(why.reason, "InvalidTemplate");
    cr_assert(strstr(why.message, "cohort-secret"));
    cJSON_Delete(tc);
}

static const cJSON *item(const cJSON *arr, const char *name)
{
    const cJSON *it;
    cJSON_ArrayForEach(it, arr) {
        const cJSON *n = cJSON_GetObjectItem(it, "name");
        if (cJSON_IsString(n) && strcmp(n->valuestring, name) == 0)
            return it;
    }
    return NULL;
}

/* The item at a dotted path of object keys, or NULL. */
static const cJSON *sget_item(const cJSON *o, const char *path)
{
    char buf[256];
    const cJSON *cur = o;

    snprintf(buf, sizeof(buf), "%s", path);
    for (char *seg = buf, *dot; seg && cur; seg = dot) {
        dot = strchr(seg, '.');
        if (dot)
            *dot++ = '\0';
        cur = cJSON_GetObjectItemCaseSensitive(cur, seg);
    }
    return cur;
}

static const char *sget(const cJSON *o, const char *path)
{
    const cJSON *cur = sget_item(o, path);

    return cJSON_IsString(cur) ? cur->valuestring : NULL;
}

Test(reconcile, pod_has_the_sidecar_the_volume_the_env_and_the_owner)
{
    cJSON *tc = cohort("lr", "\"replicas\":2,\"sidecar\":{\"image\":\"side:2\",\"logLevel\":\"debug\"}");
    cJSON *pod = NULL;
    const cJSON *spec, *side, *trainer, *env_t, *owner, *vol;

    cr_assert_eq(reconcile_pod(tc, &env, "0123456789abcdef", 7, &pod), 0);
    cr_assert_str_eq(sget(pod, "metadata.name"), "lr-7");
    cr_assert_str_eq(sget(pod, "metadata.namespace"), "ns");
    {
        const cJSON *labels = cJSON_GetObjectItem(cJSON_GetObjectItem(pod, "metadata"), "labels");
        cr_assert_str_eq(cJSON_GetObjectItem(labels, "cohort.dev/cohort")->valuestring, "lr",
                         "the operator's label wins over the template's");
        cr_assert_str_eq(cJSON_GetObjectItem(labels, "cohort.dev/ordinal")->valuestring, "7");
        cr_assert_str_eq(cJSON_GetObjectItem(labels, "app")->valuestring, "lr");
    }
    owner = cJSON_GetArrayItem(cJSON_GetObjectItem(cJSON_GetObjectItem(pod, "metadata"),
                                                   "ownerReferences"), 0);
    cr_assert_str_eq(sget(owner, "uid"), "u-1");
    cr_assert_str_eq(sget(owner, "kind"), "TrainingCohort");
    cr_assert(cJSON_IsTrue(cJSON_GetObjectItem(owner, "controller")));
    cr_assert(cJSON_IsTrue(cJSON_GetObjectItem(owner, "blockOwnerDeletion")));

    spec = cJSON_GetObjectItem(pod, "spec");
    cr_assert_str_eq(sget(spec, "restartPolicy"), "Never");
    side = cJSON_GetArrayItem(cJSON_GetObjectItem(spec, "initContainers"), 0);
    cr_assert_str_eq(sget(side, "name"), "cohort-sidecar");
    cr_assert_str_eq(sget(side, "restartPolicy"), "Always", "a native sidecar");
    cr_assert_str_eq(sget(side, "image"), "side:2");
    cr_assert_str_eq(cJSON_GetArrayItem(cJSON_GetObjectItem(side, "command"), 0)->valuestring,
                     "cohort-sidecar");
    cr_assert_not_null(item(cJSON_GetObjectItem(side, "volumeMounts"), "cohort"));
    trainer = item(cJSON_GetObjectItem(spec, "containers"), "trainer");
    env_t = cJSON_GetObjectItem(trainer, "env");
    cr_assert_str_eq(sget(item(env_t, "COHORT_BROKER"), "value"), "10.0.0.1:7070",
                     "the operator's COHORT_BROKER replaces the template's");
    cr_assert_str_eq(sget(item(env_t, "COHORT_COHORT"), "value"), "ns/lr");
    cr_assert_str_eq(sget(item(env_t, "COHORT_SOCKET"), "value"), "unix:/run/cohort/sidecar.sock");
    cr_assert_str_eq(sget(item(env_t, "COHORT_ID"), "valueFrom.fieldRef.fieldPath"), "metadata.name");
    cr_assert_str_eq(sget(item(env_t, "COHORT_POD_IP"), "valueFrom.fieldRef.fieldPath"),
                     "status.podIP");
    cr_assert_str_eq(sget(item(env_t, "X"), "value"), "1");
    {
        int n = 0;
        const cJSON *it;
        cJSON_ArrayForEach(it, env_t)
            n += strcmp(sget(it, "name"), "COHORT_BROKER") == 0;
        cr_assert_eq(n, 1);
    }
    cr_assert_not_null(item(cJSON_GetObjectItem(trainer, "volumeMounts"), "cohort"));
    vol = item(cJSON_GetObjectItem(spec, "volumes"), "cohort");
    cr_assert_str_eq(sget(vol, "emptyDir.medium"), "Memory");
    cr_assert_str_eq(cJSON_GetObjectItem(cJSON_GetObjectItem(cJSON_GetObjectItem(pod, "metadata"),
                                                             "annotations"), "cohort.dev/key-id")
                     ->valuestring, "0123456789abcdef");
    cJSON_Delete(pod);
    cJSON_Delete(tc);
}

static bool has_env(const cJSON *c, const char *name)
{
    return item(cJSON_GetObjectItem(c, "env"), name) != NULL;
}

/* The pod of cohort lr with `e`; checks what every such pod has: the
 * Secret as a volume of mode 0400, mounted read-only by the sidecar, with
 * COHORT_SECRET_FILE, and by no other container. The caller frees it. */
static cJSON *keyed_pod(const struct reconcile_env *e, const cJSON **side)
{
    cJSON *tc = cohort("lr", "\"replicas\":2");
    cJSON *pod = NULL;
    const cJSON *spec, *vol, *m, *c;

    cr_assert_eq(reconcile_pod(tc, e, "00ff00ff00ff00ff", 1, &pod), 0);
    cJSON_Delete(tc);
    spec = cJSON_GetObjectItem(pod, "spec");
    vol = item(cJSON_GetObjectItem(spec, "volumes"), "cohort-secret");
    cr_assert_not_null(vol);
    cr_assert_str_eq(sget(vol, "secret.secretName"), "lr-cohort-key");
    cr_assert_eq(cJSON_GetObjectItem(cJSON_GetObjectItem(vol, "secret"), "defaultMode")->valueint,
                 0400);
    *side = cJSON_GetArrayItem(cJSON_GetObjectItem(spec, "initContainers"), 0);
    cr_assert_str_eq(sget(*side, "name"), "cohort-sidecar");
    m = item(cJSON_GetObjectItem(*side, "volumeMounts"), "cohort-secret");
    cr_assert_not_null(m);
    cr_assert_str_eq(sget(m, "mountPath"), "/etc/cohort/secret");
    cr_assert(cJSON_IsTrue(cJSON_GetObjectItem(m, "readOnly")));
    cr_assert_str_eq(sget(item(cJSON_GetObjectItem(*side, "env"), "COHORT_SECRET_FILE"), "value"),
                     "/etc/cohort/secret/key");
    cJSON_ArrayForEach(c, cJSON_GetObjectItem(spec, "containers")) {
        cr_assert_null(item(cJSON_GetObjectItem(c, "volumeMounts"), "cohort-secret"),
                       "the trainer does not mount the key");
        cr_assert(!has_env(c, "COHORT_SECRET_FILE") && !has_env(c, "COHORT_BROKER_CA") &&
                  !has_env(c, "COHORT_BROKER_SERVER_NAME"));
        cr_assert(has_env(c, "COHORT_BROKER"), "the trainer keeps its own environment");
    }
    return pod;
}

Test(reconcile, pod_mounts_the_key_in_the_sidecar_alone)
{
    const cJSON *side;
    cJSON *pod = keyed_pod(&env, &side);

    cr_assert(!has_env(side, "COHORT_BROKER_CA"), "no TLS: no CA");
    cr_assert(!has_env(side, "COHORT_BROKER_SERVER_NAME"));
    cJSON_Delete(pod);
}

Test(reconcile, pod_with_tls_tells_the_sidecar_the_ca_and_the_name)
{
    struct reconcile_env tls = env;
    const cJSON *side;
    cJSON *pod;

    tls.broker_server_name = "cohort-broker.ops.svc";
    pod = keyed_pod(&tls, &side);
    cr_assert_str_eq(sget(item(cJSON_GetObjectItem(side, "env"), "COHORT_BROKER_CA"), "value"),
                     "/etc/cohort/secret/ca.crt");
    cr_assert_str_eq(sget(item(cJSON_GetObjectItem(side, "env"), "COHORT_BROKER_SERVER_NAME"),
                          "value"), "cohort-broker.ops.svc");
    cJSON_Delete(pod);
}

Test(reconcile, pod_keeps_the_template_restart_policy_and_needs_a_uid)
{
    cJSON *tc = parse("{\"metadata\":{\"name\":\"lr\",\"namespace\":\"ns\",\"uid\":\"u\"},"
                      "\"spec\":{\"template\":{\"spec\":{\"restartPolicy\":\"OnFailure\","
                      "\"containers\":[{\"name\":\"t\"}]}}}}");
    cJSON *pod = NULL;

    cr_assert_eq(reconcile_pod(tc, &env, NULL, 0, &pod), 0);
    cr_assert_str_eq(sget(cJSON_GetObjectItem(pod, "spec"), "restartPolicy"), "OnFailure");
    cJSON_Delete(pod);
    cJSON_DeleteItemFromObject(cJSON_GetObjectItem(tc, "metadata"), "uid");
    cr_assert_eq(reconcile_pod(tc, &env, NULL, 0, &pod), -EINVAL);
    cr_assert_null(pod);
    cJSON_Delete(tc);
}

Test(reconcile, ordinals_are_exact)
{
    cr_assert_eq(reconcile_ordinal("lr", "lr-0"), 0);
    cr_assert_eq(reconcile_ordinal("lr", "lr-12"), 12);
    cr_assert_eq(reconcile_ordinal("lr", "lr-01"), -1, "no leading zeros");
    cr_assert_eq(reconcile_ordinal("lr", "lr-"), -1);
    cr_assert_eq(reconcile_ordinal("lr", "lr-x"), -1);
    cr_assert_eq(reconcile_ordinal("lr", "lr-2-0"), -1, "another cohort's pod");
    cr_assert_eq(reconcile_ordinal("lr", "lrx-1"), -1);
    cr_assert_eq(reconcile_ordinal("lr", "lr-4096"), -1);
    cr_assert_eq(reconcile_ordinal("lr", "lr-99999999999999999999"), -1);
}

static struct reconcile_pod_view pv(const char *name, long ord, enum reconcile_phase ph)
{
    return (struct reconcile_pod_view){ .name = name, .uid = name, .ordinal = ord, .phase = ph };
}

/* Pods lr-0 .. lr-(n-1), in these phases, into pods[]; names are
 * static. */
static void ordinal_pods(struct reconcile_pod_view *pods, size_t n,
                         const enum reconcile_phase *phases)
{
    static const char *const names[] = { "lr-0", "lr-1", "lr-2", "lr-3", "lr-4" };

    cr_assert_leq(n, sizeof names / sizeof names[0]);
    for (size_t i = 0; i < n; i++)
        pods[i] = pv(names[i], (long)i, phases[i]);
}

static const struct reconcile_spec spec3 = { .replicas = 3, .min_replicas = 1, .max_restarts = 2,
                                             .heartbeat_ms = 1000, .timeout_ms = 5000 };

/* spec3's plan after `restarts`, with pods lr-0, lr-1 and lr-2 in these
 * phases. The caller frees *p with reconcile_plan_cleanup(). */
static void plan3(uint32_t restarts, enum reconcile_phase ph0, enum reconcile_phase ph1,
                  enum reconcile_phase ph2, struct reconcile_plan *p)
{
    struct reconcile_pod_view pods[3];

    ordinal_pods(pods, 3, (enum reconcile_phase[]){ ph0, ph1, ph2 });
    cr_assert_eq(reconcile_plan(&spec3, restarts, pods, 3, p), 0);
}

Test(reconcile, plan_rolls_pods_of_an_old_key_without_counting_restarts)
{
    struct reconcile_pod_view pods[] = {
        pv("lr-0", 0, RECONCILE_POD_RUNNING), pv("lr-1", 1, RECONCILE_POD_PENDING),
        pv("lr-2", 2, RECONCILE_POD_SUCCEEDED), pv("lr-3", 3, RECONCILE_POD_RUNNING),
    };
    struct reconcile_spec s = spec3;
    struct reconcile_plan p;

    s.replicas = 3;
    pods[1].stale = pods[2].stale = pods[3].stale = true;
    cr_assert_eq(reconcile_plan(&s, 0, pods, 4, &p), 0);
    /* lr-1: rolled. lr-2 finished, lr-3 is drained as excess. */
    cr_assert_eq(p.n_roll, 1);
    cr_assert_str_eq(pods[p.roll[0]].name, "lr-1");
    cr_assert_eq(p.n_create + p.n_replace, 0);
    cr_assert_eq(p.n_excess, 1);
    cr_assert(!p.failed);
    reconcile_plan_cleanup(&p);
    /* A stale pod that failed is a failure like any other. */
    pods[0].phase = RECONCILE_POD_FAILED;
    pods[0].stale = true;
    cr_assert_eq(reconcile_plan(&s, 0, pods, 4, &p), 0);
    cr_assert_eq(p.n_replace, 1);
    cr_assert_eq(p.n_roll, 1);
    reconcile_plan_cleanup(&p);
}

Test(reconcile, plan_creates_the_missing_ordinals)
{
    struct reconcile_pod_view pods[] = { pv("lr-1", 1, RECONCILE_POD_RUNNING) };
    struct reconcile_plan p;

    cr_assert_eq(reconcile_plan(&spec3, 0, pods, 1, &p), 0);
    cr_assert_eq(p.n_create, 2);
    cr_assert_eq(p.create[0], 0);
    cr_assert_eq(p.create[1], 2);
    cr_assert_eq(p.n_excess + p.n_replace, 0);
    reconcile_plan_cleanup(&p);
}

Test(reconcile, plan_drains_the_highest_ordinals_and_strangers)
{
    struct reconcile_pod_view pods[] = {
        pv("lr-0", 0, RECONCILE_POD_RUNNING), pv("lr-1", 1, RECONCILE_POD_RUNNING),
        pv("lr-2", 2, RECONCILE_POD_RUNNING), pv("lr-3", 3, RECONCILE_POD_RUNNING),
        pv("lr-x", -1, RECONCILE_POD_RUNNING), pv("lr-4", 4, RECONCILE_POD_TERMINATING),
    };
    struct reconcile_spec s = spec3;
    struct reconcile_plan p;

    s.replicas = 2;
    cr_assert_eq(reconcile_plan(&s, 0, pods, 6, &p), 0);
    cr_assert_eq(p.n_create, 0);
    cr_assert_eq(p.n_excess, 3);
    cr_assert_str_eq(pods[p.excess[0]].name, "lr-2");
    cr_assert_str_eq(pods[p.excess[1]].name, "lr-3");
    cr_assert_str_eq(pods[p.excess[2]].name, "lr-x");
    cr_assert_eq(p.terminating, 1);
    reconcile_plan_cleanup(&p);
}

Test(reconcile, plan_suspend_drains_every_pod_and_creates_none)
{
    struct reconcile_pod_view pods[] = { pv("lr-0", 0, RECONCILE_POD_RUNNING),
                                         pv("lr-1", 1, RECONCILE_POD_PENDING) };
    struct reconcile_spec s = spec3;
    struct reconcile_plan p;

    s.suspend = true;
    cr_assert_eq(reconcile_plan(&s, 0, pods, 2, &p), 0);
    cr_assert_eq(p.want, 0);
    cr_assert_eq(p.n_create, 0);
    cr_assert_eq(p.n_excess, 2);
    reconcile_plan_cleanup(&p);
}

Test(reconcile, plan_replaces_failed_pods_up_to_max_restarts)
{
    /* spec3 allows two restarts: after r of them, this many replacements. */
    static const struct {
        uint32_t restarts;
        size_t n_replace;
        bool failed;
    } after[] = { { 0, 2, false }, { 1, 1, true }, { 2, 0, true } };
    struct reconcile_plan p;

    for (size_t i = 0; i < sizeof after / sizeof after[0]; i++) {
        plan3(after[i].restarts, RECONCILE_POD_FAILED, RECONCILE_POD_FAILED, RECONCILE_POD_RUNNING,
              &p);
        cr_assert_eq(p.n_replace, after[i].n_replace, "after %u restarts", after[i].restarts);
        cr_assert_eq(p.failed, after[i].failed, "after %u restarts", after[i].restarts);
        cr_assert_eq(p.n_create, 0, "the failed pods hold their names until deleted");
        cr_assert_eq(p.failed_pods, 2);
        reconcile_plan_cleanup(&p);
    }
}

Test(reconcile, plan_waits_for_a_terminating_pod_to_free_its_name)
{
    struct reconcile_plan p;

    plan3(0, RECONCILE_POD_TERMINATING, RECONCILE_POD_RUNNING, RECONCILE_POD_RUNNING, &p);
    cr_assert_eq(p.n_create, 0);
    cr_assert_eq(p.blocked, 1);
    reconcile_plan_cleanup(&p);
}

Test(reconcile, plan_completes_when_every_trainer_succeeded)
{
    struct reconcile_plan p;

    plan3(0, RECONCILE_POD_SUCCEEDED, RECONCILE_POD_SUCCEEDED, RECONCILE_POD_SUCCEEDED, &p);
    cr_assert(p.complete);
    cr_assert_eq(p.n_create + p.n_replace + p.n_excess, 0, "finished pods are not replaced");
    reconcile_plan_cleanup(&p);
}

Test(reconcile, view_reads_phase_readiness_and_deletion)
{
    cJSON *pod = parse("{\"metadata\":{\"name\":\"lr-2\",\"uid\":\"u\"},\"status\":{\"phase\":"
                       "\"Running\",\"conditions\":[{\"type\":\"Ready\",\"status\":\"True\"}]}}");
    struct reconcile_pod_view v;

    cr_assert_eq(reconcile_view("lr", pod, &v), 0);
    cr_assert_eq(v.ordinal, 2);
    cr_assert_eq(v.phase, RECONCILE_POD_RUNNING);
    cr_assert(v.ready);
    cr_assert_null(v.key_id);
    cr_assert(!v.stale, "the caller decides");
    cJSON_AddStringToObject(cJSON_AddObjectToObject(cJSON_GetObjectItem(pod, "metadata"),
                                                    "annotations"), "cohort.dev/key-id", "abc");
    cr_assert_eq(reconcile_view("lr", pod, &v), 0);
    cr_assert_str_eq(v.key_id, "abc");
    cJSON_AddStringToObject(cJSON_GetObjectItem(pod, "metadata"), "deletionTimestamp", "t");
    cr_assert_eq(reconcile_view("lr", pod, &v), 0);
    cr_assert_eq(v.phase, RECONCILE_POD_TERMINATING);
    cJSON_Delete(pod);
}

static const cJSON *cond(const cJSON *st, const char *type)
{
    const cJSON *c;
    cJSON_ArrayForEach(c, cJSON_GetObjectItem(st, "conditions"))
        if (strcmp(cJSON_GetObjectItem(c, "type")->valuestring, type) == 0)
            return c;
    return NULL;
}

Test(reconcile, status_reports_members_leader_and_conditions)
{
    struct reconcile_member m[] = { { "lr-0", "1.1.1.1:5", 40, false },
                                    { "lr-1", "1.1.1.2:5", 42, false },
                                    { "lr-2", "1.1.1.3:5", 42, true } };
    struct reconcile_pod_view pods[3];
    struct reconcile_spec s = spec3;
    struct reconcile_plan p;
    struct reconcile_observed o = { .generation = 3, .selector = "cohort.dev/cohort=lr",
                                    .pods = 3, .restarts = 1, .broker_known = true, .epoch = 9,
                                    .leader = "lr-1", .members = m, .n_members = 3,
                                    .draining = 1 };
    cJSON *st, *st2, *old;

    ordinal_pods(pods, 3, (enum reconcile_phase[]){ RECONCILE_POD_RUNNING, RECONCILE_POD_RUNNING,
                                                    RECONCILE_POD_RUNNING });
    s.replicas = 2;
    cr_assert_eq(reconcile_plan(&s, 1, pods, 3, &p), 0);
    o.plan = &p;
    st = reconcile_status(&s, &o, NULL, "2026-01-01T00:00:00Z");
    cr_assert_eq(cJSON_GetObjectItem(st, "readyReplicas")->valueint, 2, "draining is not ready");
    cr_assert_eq(cJSON_GetObjectItem(st, "epoch")->valueint, 9);
    cr_assert_str_eq(cJSON_GetObjectItem(st, "leader")->valuestring, "lr-1");
    cr_assert_eq(cJSON_GetObjectItem(st, "modelVersion")->valueint, 42);
    cr_assert_eq(cJSON_GetArraySize(cJSON_GetObjectItem(st, "members")), 3);
    cr_assert_eq(cJSON_GetObjectItem(st, "observedGeneration")->valueint, 3);
    cr_assert_str_eq(cJSON_GetObjectItem(cond(st, "Available"), "status")->valuestring, "True");
    cr_assert_str_eq(cJSON_GetObjectItem(cond(st, "Progressing"), "reason")->valuestring, "Draining");

    /* A later status keeps the transition time of unchanged conditions. */
    old = cJSON_Duplicate(st, 1);
    o.draining = 0;
    o.n_members = 2;
    o.pods = 2;
    reconcile_plan_cleanup(&p);
    cr_assert_eq(reconcile_plan(&s, 1, pods, 2, &p), 0);
    st2 = reconcile_status(&s, &o, old, "2026-01-01T00:01:00Z");
    cr_assert_str_eq(cJSON_GetObjectItem(cond(st2, "Available"), "lastTransitionTime")->valuestring,
                     "2026-01-01T00:00:00Z");
    cr_assert_str_eq(cJSON_GetObjectItem(cond(st2, "Progressing"), "status")->valuestring, "False");
    cr_assert_str_eq(cJSON_GetObjectItem(cond(st2, "Progressing"), "lastTransitionTime")->valuestring,
                     "2026-01-01T00:01:00Z");
    reconcile_plan_cleanup(&p);
    cJSON_Delete(st);
    cJSON_Delete(st2);
    cJSON_Delete(old);
}

Test(reconcile, status_before_the_first_epoch_has_no_ready_members)
{
    struct reconcile_member m[] = { { "lr-0", "1.1.1.1:5", 0, false } };
    struct reconcile_plan p = { 0 };
    struct reconcile_observed o = { .pods = 1, .broker_known = true, .members = m, .n_members = 1,
                                    .plan = &p };
    struct reconcile_spec s = spec3;
    cJSON *st = reconcile_status(&s, &o, NULL, "t");

    cr_assert_eq(cJSON_GetObjectItem(st, "readyReplicas")->valueint, 0);
    cr_assert_null(cJSON_GetObjectItem(st, "epoch"));
    cr_assert_str_eq(cJSON_GetObjectItem(cond(st, "Available"), "reason")->valuestring,
                     "WaitingForMembers");
    cJSON_Delete(st);
}

Test(reconcile, status_of_a_refused_spec_is_failed_with_its_reason)
{
    struct reconcile_why why = { "NameTooLong", "too long" };
    struct reconcile_observed o = { .generation = 1, .invalid = &why };
    struct reconcile_spec s = { 0 };
    cJSON *st = reconcile_status(&s, &o, NULL, "t");

    cr_assert_str_eq(cJSON_GetObjectItem(cond(st, "Failed"), "status")->valuestring, "True");
    cr_assert_str_eq(cJSON_GetObjectItem(cond(st, "Failed"), "reason")->valuestring, "NameTooLong");
    cr_assert_str_eq(cJSON_GetObjectItem(cond(st, "Available"), "status")->valuestring, "False");
    cJSON_Delete(st);
}

Test(reconcile, status_failed_after_max_restarts)
{
    struct reconcile_pod_view pods[] = { pv("lr-0", 0, RECONCILE_POD_FAILED) };
    struct reconcile_spec s = spec3;
    struct reconcile_plan p;
    struct reconcile_observed o = { .restarts = 2, .plan = &p };
    cJSON *st;

    s.replicas = 1;
    cr_assert_eq(reconcile_plan(&s, 2, pods, 1, &p), 0);
    st = reconcile_status(&s, &o, NULL, "t");
    cr_assert_str_eq(cJSON_GetObjectItem(cond(st, "Failed"), "reason")->valuestring,
                     "TooManyRestarts");
    cr_assert_str_eq(cJSON_GetObjectItem(cond(st, "Degraded"), "status")->valuestring, "True");
    reconcile_plan_cleanup(&p);
    cJSON_Delete(st);
}

static const char *phase_of(const cJSON *st)
{
    return cJSON_GetObjectItem(st, "phase")->valuestring;
}

Test(reconcile, status_phase_is_the_first_that_holds)
{
    struct reconcile_member m[] = { { "lr-0", "1.1.1.1:5", 7, false } };
    struct reconcile_plan p = { 0 };
    struct reconcile_why why = { "NameTooLong", "too long" };
    struct reconcile_observed o = { .pods = 1, .broker_known = true, .members = m,
                                    .n_members = 1, .plan = &p };
    struct reconcile_spec s = spec3;
    cJSON *st;

    s.min_replicas = 1;
    st = reconcile_status(&s, &o, NULL, "t");
    cr_assert_str_eq(phase_of(st), "Pending", "no epoch yet");
    cJSON_Delete(st);
    o.epoch = 2;
    st = reconcile_status(&s, &o, NULL, "t");
    cr_assert_str_eq(phase_of(st), "Running");
    cJSON_Delete(st);
    p.failed_pods = 1;
    st = reconcile_status(&s, &o, NULL, "t");
    cr_assert_str_eq(phase_of(st), "Degraded");
    cJSON_Delete(st);
    s.suspend = true;
    st = reconcile_status(&s, &o, NULL, "t");
    cr_assert_str_eq(phase_of(st), "Suspended");
    cJSON_Delete(st);
    p.complete = true;
    st = reconcile_status(&s, &o, NULL, "t");
    cr_assert_str_eq(phase_of(st), "Complete");
    cJSON_Delete(st);
    p.failed = true;
    st = reconcile_status(&s, &o, NULL, "t");
    cr_assert_str_eq(phase_of(st), "Failed");
    cJSON_Delete(st);
    o.invalid = &why;
    o.plan = NULL;
    st = reconcile_status(&s, &o, NULL, "t");
    cr_assert_str_eq(phase_of(st), "Failed", "a refused spec");
    cJSON_Delete(st);
}

Test(reconcile, status_keeps_the_last_leader_and_model_version_when_none_leads)
{
    struct reconcile_plan p = { .complete = true };
    struct reconcile_observed o = { .plan = &p };     /* the broker forgot the cohort */
    struct reconcile_spec s = spec3;
    cJSON *old = parse("{\"epoch\":5,\"leader\":\"lr-1\",\"modelVersion\":1234}");
    cJSON *st = reconcile_status(&s, &o, old, "t"), *patch;

    cr_assert_str_eq(cJSON_GetObjectItem(st, "leader")->valuestring, "lr-1");
    cr_assert_eq(cJSON_GetObjectItem(st, "modelVersion")->valueint, 1234);
    cr_assert_eq(cJSON_GetObjectItem(st, "epoch")->valueint, 5);
    patch = reconcile_status_patch(old, st);
    cr_assert_str_eq(cJSON_GetObjectItem(cJSON_GetObjectItem(patch, "status"), "leader")->valuestring,
                     "lr-1", "the patch does not null them");
    cJSON_Delete(patch);
    cJSON_Delete(st);
    /* The broker still has the cohort, in a later epoch, with no leader. */
    o.broker_known = true;
    o.epoch = 6;
    st = reconcile_status(&s, &o, old, "t");
    cr_assert_str_eq(cJSON_GetObjectItem(st, "leader")->valuestring, "lr-1");
    cr_assert_eq(cJSON_GetObjectItem(st, "epoch")->valueint, 6, "the broker's own epoch wins");
    cJSON_Delete(st);
    /* Not complete, and no leader now (suspended, between epochs): the
     * last ones stay too. */
    p.complete = false;
    st = reconcile_status(&s, &o, old, "t");
    cr_assert_str_eq(cJSON_GetObjectItem(st, "leader")->valuestring, "lr-1");
    cJSON_Delete(st);
    /* A new leader replaces them. */
    {
        struct reconcile_member m[] = { { "lr-0", "1.1.1.1:5", 1300, false } };
        o.leader = "lr-0";
        o.members = m;
        o.n_members = 1;
        st = reconcile_status(&s, &o, old, "t");
        cr_assert_str_eq(cJSON_GetObjectItem(st, "leader")->valuestring, "lr-0");
        cr_assert_eq(cJSON_GetObjectItem(st, "modelVersion")->valueint, 1300);
        cJSON_Delete(st);
    }
    cJSON_Delete(old);
}

Test(reconcile, model_versions_alone_are_a_minor_difference)
{
    cJSON *a = parse("{\"epoch\":3,\"modelVersion\":10,\"members\":[{\"id\":\"a\",\"modelVersion\":10}]}");
    cJSON *b = parse("{\"epoch\":3,\"modelVersion\":12,\"members\":[{\"id\":\"a\",\"modelVersion\":12}]}");
    cJSON *c = parse("{\"epoch\":4,\"modelVersion\":12,\"members\":[{\"id\":\"a\",\"modelVersion\":12}]}");

    cr_assert(reconcile_status_differs(a, b, false));
    cr_assert(!reconcile_status_differs(a, b, true));
    cr_assert(reconcile_status_differs(b, c, true));
    cr_assert(reconcile_status_differs(a, NULL, true));
    cr_assert(!reconcile_status_differs(NULL, NULL, true));
    cJSON_Delete(a);
    cJSON_Delete(b);
    cJSON_Delete(c);
}

Test(reconcile, status_patch_nulls_fields_that_went_away)
{
    cJSON *old = parse("{\"epoch\":3,\"leader\":\"a\",\"replicas\":1}");
    cJSON *want = parse("{\"replicas\":0}");
    cJSON *patch = reconcile_status_patch(old, want);
    const cJSON *st = cJSON_GetObjectItem(patch, "status");

    cr_assert(cJSON_IsNull(cJSON_GetObjectItem(st, "epoch")));
    cr_assert(cJSON_IsNull(cJSON_GetObjectItem(st, "leader")));
    cr_assert_eq(cJSON_GetObjectItem(st, "replicas")->valueint, 0);
    cJSON_Delete(patch);
    cJSON_Delete(old);
    cJSON_Delete(want);
}

Test(reconcile, status_patch_nulls_fields_that_went_away_inside_an_object)
{
    cJSON *old = parse("{\"checkpoint\":{\"version\":40,\"time\":\"t\","
                       "\"lastSkipped\":{\"version\":40,\"reason\":\"r\"}}}");
    cJSON *want = parse("{\"checkpoint\":{\"lastSkipped\":{\"version\":40}}}");
    cJSON *patch = reconcile_status_patch(old, want);
    const cJSON *ck = cJSON_GetObjectItem(cJSON_GetObjectItem(patch, "status"), "checkpoint");

    cr_assert(cJSON_IsNull(cJSON_GetObjectItem(ck, "version")));
    cr_assert(cJSON_IsNull(cJSON_GetObjectItem(ck, "time")));
    cr_assert(cJSON_IsNull(cJSON_GetObjectItem(cJSON_GetObjectItem(ck, "lastSkipped"), "reason")));
    cr_assert_eq(cJSON_GetObjectItem(cJSON_GetObjectItem(ck, "lastSkipped"), "version")->valueint,
                 40);
    cJSON_Delete(patch);
    cJSON_Delete(old);
    cJSON_Delete(want);
}

Test(reconcile, secret_name_is_the_cohort_name_and_a_suffix)
{
    char name[300], out[400];

    cr_assert_eq(reconcile_secret_name("lr", name, sizeof(name)), 0);
    cr_assert_str_eq(name, "lr-cohort-key");
    cr_assert_eq(reconcile_secret_name("lr", name, 8), -ENAMETOOLONG);
    memset(name, 'a', 250);
    name[250] = '\0';
    cr_assert_eq(reconcile_secret_name(name, out, sizeof(out)), -ENAMETOOLONG,
                 "over 253, the longest object name");
}

Test(reconcile, selector_names_the_cohort_label)
{
    char buf[64];

    cr_assert_eq(reconcile_selector("lr", buf, sizeof(buf)), 0);
    cr_assert_str_eq(buf, "cohort.dev/cohort=lr");
    cr_assert_eq(reconcile_selector("lr", buf, 5), -ENAMETOOLONG);
}

/* JSON may repeat a key. A container with "env" twice (a string, then an
 * array) gets exactly one env array, holding the template's variables and
 * the operator's: never a pod the API server would read another way. */
Test(reconcile, pod_has_one_env_whatever_the_template_repeats)
{
    cJSON *tc = parse("{\"metadata\":{\"name\":\"lr\",\"namespace\":\"ns\",\"uid\":\"u\"},"
                      "\"spec\":{\"template\":{\"spec\":{\"containers\":[{\"name\":\"t\","
                      "\"env\":\"junk\",\"env\":[{\"name\":\"X\",\"value\":\"1\"}],"
                      "\"env\":[{\"name\":\"Y\",\"value\":\"2\"}]}]}}}}");
    const cJSON *c, *it;
    cJSON *pod = NULL;
    int envs = 0;

    cr_assert_eq(reconcile_pod(tc, &env, NULL, 0, &pod), 0);
    c = cJSON_GetArrayItem(cJSON_GetObjectItem(cJSON_GetObjectItem(pod, "spec"), "containers"), 0);
    cJSON_ArrayForEach(it, c)
        envs += it->string && strcmp(it->string, "env") == 0;
    cr_assert_eq(envs, 1);
    cr_assert(cJSON_IsArray(cJSON_GetObjectItem(c, "env")));
    cr_assert(has_env(c, "X") && has_env(c, "COHORT_BROKER") && has_env(c, "COHORT_ID"));
    cr_assert_not(has_env(c, "Y"), "the first array is the one kept");
    cJSON_Delete(pod);
    cJSON_Delete(tc);
}

Test(reconcile, pull_policy_is_one_of_three_exact_words)
{
    cr_assert_str_eq(reconcile_pull_policy("Always"), "Always");
    cr_assert_str_eq(reconcile_pull_policy("IfNotPresent"), "IfNotPresent");
    cr_assert_str_eq(reconcile_pull_policy("Never"), "Never");
    cr_assert_null(reconcile_pull_policy("always"));
    cr_assert_null(reconcile_pull_policy("IfNotPresent "));
    cr_assert_null(reconcile_pull_policy(""));
    cr_assert_null(reconcile_pull_policy(NULL));
}

Test(reconcile, sidecar_pull_policy_is_the_cohorts_else_the_operators)
{
    struct reconcile_env e = env;
    cJSON *tc = cohort("lr", "\"sidecar\":{\"imagePullPolicy\":\"Always\"}");
    cJSON *plain = cohort("lr", "");
    cJSON *pod = NULL;

    e.sidecar_pull_policy = "IfNotPresent";
    cr_assert_eq(reconcile_pod(tc, &e, NULL, 0, &pod), 0);
    cr_assert_str_eq(sget(cJSON_GetArrayItem(sget_item(pod, "spec.initContainers"), 0),
                          "imagePullPolicy"), "Always", "the cohort's own wins");
    cJSON_Delete(pod);
    cr_assert_eq(reconcile_pod(plain, &e, NULL, 0, &pod), 0);
    cr_assert_str_eq(sget(cJSON_GetArrayItem(sget_item(pod, "spec.initContainers"), 0),
                          "imagePullPolicy"), "IfNotPresent");
    cr_assert_str_eq(sget(cJSON_GetArrayItem(sget_item(pod, "spec.initContainers"), 0), "image"),
                     "img:1", "the operator's image when the cohort names none");
    cJSON_Delete(pod);
    e.sidecar_pull_policy = NULL;
    cr_assert_eq(reconcile_pod(plain, &e, NULL, 0, &pod), 0);
    cr_assert_null(cJSON_GetObjectItem(cJSON_GetArrayItem(sget_item(pod, "spec.initContainers"), 0),
                                       "imagePullPolicy"), "none given: the cluster's default");
    cJSON_Delete(pod);
    cJSON_Delete(tc);
    cJSON_Delete(plain);
}

static void assert_restricted(const cJSON *sc)
{
    const cJSON *drop = sget_item(sc, "capabilities.drop");

    cr_assert(cJSON_IsTrue(cJSON_GetObjectItem(sc, "runAsNonRoot")));
    cr_assert(cJSON_IsTrue(cJSON_GetObjectItem(sc, "readOnlyRootFilesystem")));
    cr_assert(cJSON_IsFalse(cJSON_GetObjectItem(sc, "allowPrivilegeEscalation")));
    cr_assert_eq(cJSON_GetArraySize(drop), 1);
    cr_assert_str_eq(cJSON_GetArrayItem(drop, 0)->valuestring, "ALL");
    cr_assert_str_eq(sget(sc, "seccompProfile.type"), "RuntimeDefault");
}

Test(reconcile, pod_without_security_settings_gets_the_defaults)
{
    cJSON *tc = cohort("lr", "");
    cJSON *pod = NULL;
    const cJSON *spec, *trainer, *tsc;

    cr_assert_eq(reconcile_pod(tc, &env, NULL, 0, &pod), 0);
    spec = cJSON_GetObjectItem(pod, "spec");
    assert_restricted(sget_item(cJSON_GetArrayItem(cJSON_GetObjectItem(spec, "initContainers"), 0),
                                "securityContext"));
    cr_assert_str_eq(sget(spec, "securityContext.seccompProfile.type"), "RuntimeDefault");
    cr_assert_eq(sget_item(spec, "securityContext.fsGroup")->valueint, RECONCILE_FS_GROUP,
                 "a non-root sidecar reads its key through the pod's fsGroup");
    cr_assert_str_eq(sget(spec, "securityContext.fsGroupChangePolicy"), "OnRootMismatch");
    trainer = item(cJSON_GetObjectItem(spec, "containers"), "trainer");
    tsc = cJSON_GetObjectItem(trainer, "securityContext");
    cr_assert(cJSON_IsFalse(cJSON_GetObjectItem(tsc, "allowPrivilegeEscalation")));
    cr_assert_eq(cJSON_GetArraySize(tsc), 1,
                 "nothing that could stop a trainer image: no runAsNonRoot, read-only root "
                 "filesystem or dropped capabilities");
    cJSON_Delete(pod);
    cJSON_Delete(tc);
}

Test(reconcile, template_security_settings_win)
{
    /* A privileged trainer with its own context, a pod context that sets
     * a user, a group and its own seccomp profile, and a second trainer
     * without a context. */
    cJSON *tc = parse("{\"metadata\":{\"name\":\"lr\",\"namespace\":\"ns\",\"uid\":\"u\"},"
                      "\"spec\":{\"template\":{\"spec\":{"
                      "\"securityContext\":{\"runAsUser\":0,\"fsGroup\":7,"
                      "\"seccompProfile\":{\"type\":\"Unconfined\"}},"
                      "\"containers\":[{\"name\":\"gpu\",\"securityContext\":{\"privileged\":true}},"
                      "{\"name\":\"plain\"}]}}}}");
    cJSON *half = parse("{\"metadata\":{\"name\":\"lr\",\"namespace\":\"ns\",\"uid\":\"u\"},"
                        "\"spec\":{\"template\":{\"spec\":{"
                        "\"securityContext\":{\"runAsUser\":1000},"
                        "\"containers\":[{\"name\":\"t\",\"securityContext\":{}}]}}}}");
    cJSON *pod = NULL;
    const cJSON *spec, *gpu;

    cr_assert_eq(reconcile_pod(tc, &env, NULL, 0, &pod), 0);
    spec = cJSON_GetObjectItem(pod, "spec");
    cr_assert_str_eq(sget(spec, "securityContext.seccompProfile.type"), "Unconfined");
    cr_assert_eq(sget_item(spec, "securityContext.fsGroup")->valueint, 7);
    cr_assert_null(sget_item(spec, "securityContext.fsGroupChangePolicy"),
                   "the user's fsGroup comes with the user's policy");
    cr_assert_eq(sget_item(spec, "securityContext.runAsUser")->valueint, 0);
    gpu = item(cJSON_GetObjectItem(spec, "containers"), "gpu");
    cr_assert_null(sget_item(gpu, "securityContext.allowPrivilegeEscalation"),
                   "privileged with allowPrivilegeEscalation false is an invalid pod");
    cr_assert(cJSON_IsTrue(sget_item(gpu, "securityContext.privileged")));
    cr_assert(cJSON_IsFalse(sget_item(item(cJSON_GetObjectItem(spec, "containers"), "plain"),
                                      "securityContext.allowPrivilegeEscalation")));
    assert_restricted(sget_item(cJSON_GetArrayItem(cJSON_GetObjectItem(spec, "initContainers"), 0),
                                "securityContext"));
    cJSON_Delete(pod);

    /* Per field at the pod: a context that says nothing of seccomp or
     * fsGroup gets both; an empty container context is the user's. */
    cr_assert_eq(reconcile_pod(half, &env, NULL, 0, &pod), 0);
    spec = cJSON_GetObjectItem(pod, "spec");
    cr_assert_eq(sget_item(spec, "securityContext.runAsUser")->valueint, 1000);
    cr_assert_str_eq(sget(spec, "securityContext.seccompProfile.type"), "RuntimeDefault");
    cr_assert_eq(sget_item(spec, "securityContext.fsGroup")->valueint, RECONCILE_FS_GROUP);
    cr_assert_eq(cJSON_GetArraySize(sget_item(cJSON_GetArrayItem(cJSON_GetObjectItem(spec,
                                                                 "containers"), 0),
                                              "securityContext")), 0);
    cJSON_Delete(pod);
    cJSON_Delete(tc);
    cJSON_Delete(half);
}

/* The sidecar's args as one space-separated string. */
static void sidecar_args(const cJSON *pod, char *buf, size_t n)
{
    const cJSON *side = cJSON_GetArrayItem(sget_item(pod, "spec.initContainers"), 0), *it;
    size_t used = 0;

    buf[0] = '\0';
    cJSON_ArrayForEach(it, cJSON_GetObjectItem(side, "args"))
        used += (size_t)snprintf(buf + used, n - used, "%s%s", used ? " " : "", it->valuestring);
    cr_assert_lt(used, n);
}

Test(reconcile, parse_reads_accumulator_and_reduction)
{
    cJSON *tc = cohort("lr", "\"accumulator\":{\"virtualBatchSize\":9007199254740991,"
                             "\"parallelGradients\":8},"
                             "\"reduction\":{\"algorithm\":\"ring\",\"compression\":\"none\"}");
    struct reconcile_spec s;
    struct reconcile_why why;

    cr_assert_eq(reconcile_parse(tc, &s, &why), 0, "%s", why.message);
    cr_assert_eq(s.virtual_batch_size, 9007199254740991ull);
    cr_assert_eq(s.parallel_gradients, 8);
    cr_assert_str_eq(s.algorithm, "ring");
    cr_assert_str_eq(s.compression, "none");
    cJSON_Delete(tc);
    tc = cohort("lr", "\"reduction\":{\"compression\":\"int8\"}");
    cr_assert_eq(reconcile_parse(tc, &s, &why), 0, "%s", why.message);
    cr_assert_str_eq(s.compression, "int8");
    cJSON_Delete(tc);
    /* Unset: nothing pinned, the engine's own choice. */
    tc = cohort("lr", "\"accumulator\":{},\"reduction\":{}");
    cr_assert_eq(reconcile_parse(tc, &s, &why), 0, "%s", why.message);
    cr_assert_eq(s.virtual_batch_size, 0);
    cr_assert_eq(s.parallel_gradients, 0);
    cr_assert_str_eq(s.algorithm, "auto");
    cr_assert_str_eq(s.compression, "none");
    cJSON_Delete(tc);
}

Test(reconcile, parse_refuses_accumulator_and_reduction_out_of_range)
{
    refused("lr", "\"accumulator\":{\"virtualBatchSize\":0}", "InvalidSpec");
    refused("lr", "\"accumulator\":{\"virtualBatchSize\":9007199254740992}", "InvalidSpec");
    refused("lr", "\"accumulator\":{\"virtualBatchSize\":1e300}", "InvalidSpec");
    refused("lr", "\"accumulator\":{\"virtualBatchSize\":\"8\"}", "InvalidSpec");
    refused("lr", "\"accumulator\":{\"parallelGradients\":9}", "InvalidSpec");
    refused("lr", "\"accumulator\":{\"parallelGradients\":1.5}", "InvalidSpec");
    refused("lr", "\"reduction\":{\"algorithm\":\"tree\"}", "InvalidSpec");
    refused("lr", "\"reduction\":{\"algorithm\":7}", "InvalidSpec");
    refused("lr", "\"reduction\":{\"compression\":\"zstd\"}", "InvalidSpec");
    refused("lr", "\"reduction\":{\"compression\":16}", "InvalidSpec");
    refused("lr", "\"reduction\":{\"compression\":null}", "InvalidSpec");
    refused("lr", "\"reduction\":{\"compression\":\"topk:0\"}", "InvalidSpec");
    refused("lr", "\"reduction\":{\"compression\":\"topk:1.5\"}", "InvalidSpec");
    refused("lr", "\"reduction\":{\"compression\":\"powersgd:1025\"}", "InvalidSpec");
    refused("lr", "\"reduction\":{\"compression\":\"int8:1\"}", "InvalidSpec");
}

/* The operator takes exactly the --compression values the sidecar takes
 * (reconcile.c cannot include the sidecar's parser, so the two are held
 * to the same answers here), and passes them on unchanged. */
Test(reconcile, compression_is_checked_as_the_sidecar_checks_it)
{
    static const char *const texts[] = {
        "none", "fp16", "bf16", "int8", "topk", "powersgd", "topk:0.01", "topk:1", "topk:1.0",
        "topk:.5", "topk:0.000001", "topk:0.0000001", "topk:0", "topk:0.0", "topk:1.000001",
        "topk:1.5", "topk:2", "topk:", "topk:-0.1", "topk:0.5x", "topk:00.5", "powersgd:1",
        "powersgd:4", "powersgd:1024", "powersgd:0", "powersgd:1025", "powersgd:", "powersgd:2.5",
        "powersgd:-1", "int8:1", "none:", "zip", "", "TOPK", "topk:0.01 ",
    };

    for (size_t i = 0; i < sizeof(texts) / sizeof(texts[0]); i++) {
        char body[128];
        struct compress c;
        struct reconcile_spec s;
        struct reconcile_why why;
        cJSON *tc;
        bool sidecar = compress_parse(texts[i], &c) == 0;

        snprintf(body, sizeof(body), "\"reduction\":{\"compression\":\"%s\"}", texts[i]);
        tc = cohort("lr", body);
        cr_assert_eq(reconcile_parse(tc, &s, &why) == 0, sidecar, "\"%s\": sidecar %s it", texts[i],
                     sidecar ? "takes" : "refuses");
        if (sidecar) {
            cJSON *pod = NULL;
            char args[1024], want[64];

            cr_assert_str_eq(s.compression, texts[i]);
            cr_assert_eq(reconcile_pod(tc, &env, NULL, 0, &pod), 0);
            sidecar_args(pod, args, sizeof(args));
            snprintf(want, sizeof(want), " --compression %s", texts[i]);
            cr_assert_eq(strstr(args, want) != NULL, strcmp(texts[i], "none") != 0, "%s", args);
            cJSON_Delete(pod);
        } else {
            cr_assert(strstr(why.message, "powersgd:RANK"), "%s", why.message);
        }
        cJSON_Delete(tc);
    }
}

Test(reconcile, pod_tells_the_sidecar_the_accumulator_and_the_algorithm)
{
    cJSON *tc = cohort("lr", "\"accumulator\":{\"virtualBatchSize\":256,\"parallelGradients\":3},"
                             "\"reduction\":{\"algorithm\":\"doubling\",\"compression\":\"bf16\"}");
    cJSON *pod = NULL;
    char args[1024];

    cr_assert_eq(reconcile_pod(tc, &env, NULL, 0, &pod), 0);
    sidecar_args(pod, args, sizeof(args));
    cr_assert(strstr(args, " --allreduce doubling"), "%s", args);
    cr_assert(strstr(args, " --compression bf16"), "%s", args);
    cr_assert(strstr(args, " --virtual-batch-size 256"), "%s", args);
    cr_assert(strstr(args, " --parallel-gradients 3"), "%s", args);
    cJSON_Delete(pod);
    cJSON_Delete(tc);
}

Test(reconcile, pod_without_accumulator_settings_pins_nothing)
{
    cJSON *tc = cohort("lr", "");
    cJSON *pod = NULL;
    char args[1024];

    cr_assert_eq(reconcile_pod(tc, &env, NULL, 0, &pod), 0);
    sidecar_args(pod, args, sizeof(args));
    cr_assert(strstr(args, " --allreduce auto"), "%s", args);
    cr_assert_null(strstr(args, "--virtual-batch-size"), "%s", args);
    cr_assert_null(strstr(args, "--compression"), "%s", args);
    cr_assert_null(strstr(args, "--parallel-gradients"), "%s", args);
    cJSON_Delete(pod);
    cJSON_Delete(tc);
}

/* ---- back-off, the budget's window, rollouts, failures ------------------ */

Test(reconcile, backoff_is_none_then_10s_doubling_to_5min)
{
    static const uint32_t want[] = { 0, 0, 10000, 20000, 40000, 80000, 160000, 300000, 300000 };

    for (uint32_t i = 0; i < sizeof want / sizeof want[0]; i++)
        cr_assert_eq(reconcile_backoff_ms(i), want[i], "streak %u: %u", i, reconcile_backoff_ms(i));
    cr_assert_eq(reconcile_backoff_ms(UINT32_MAX), RECONCILE_BACKOFF_MAX_MS);
}

Test(reconcile, backoff_streak_ends_after_a_pod_ran_ten_minutes)
{
    struct reconcile_backoff b = { 0 };

    cr_assert_eq(reconcile_backoff_fail(&b, 1000, 50), 0);
    cr_assert_eq(reconcile_backoff_fail(&b, 2000, 50), 10000);
    cr_assert_eq(b.until_ms, 12000);
    cr_assert_eq(reconcile_backoff_fail(&b, 20000, RECONCILE_BACKOFF_RESET_MS - 1), 20000);
    cr_assert_eq(b.streak, 3);
    /* Ran ten minutes: a fault of its own, replaced at once. */
    cr_assert_eq(reconcile_backoff_fail(&b, 900000, RECONCILE_BACKOFF_RESET_MS), 0);
    cr_assert_eq(b.streak, 1);
    cr_assert_eq(reconcile_backoff_fail(&b, 900100, 0), 10000);
}

Test(reconcile, restart_budget_counts_the_last_hour_only)
{
    uint64_t h = RECONCILE_RESTART_WINDOW_MS;
    uint64_t t[] = { 0, 1000, h + 500, h + 900, h + 5000 /* later than now: not counted */ };

    cr_assert_eq(reconcile_restarts_within(t, 5, h + 1000, h), 2);
    cr_assert_eq(reconcile_restarts_within(t, 5, h - 1, h), 2);
    cr_assert_eq(reconcile_restarts_within(t, 0, h, h), 0);
}

Test(reconcile, plan_waits_out_a_back_off_without_spending_the_budget)
{
    struct reconcile_pod_view pods[3];
    struct reconcile_plan p;

    ordinal_pods(pods, 3, (enum reconcile_phase[]){ RECONCILE_POD_FAILED, RECONCILE_POD_FAILED,
                                                    RECONCILE_POD_RUNNING });
    pods[0].backoff_ms = 7000;
    pods[1].backoff_ms = 3000;
    /* Budget spent (2 of 2), but nothing is replaced yet: not Failed. */
    cr_assert_eq(reconcile_plan(&spec3, 2, pods, 3, &p), 0);
    cr_assert_eq(p.n_replace, 0);
    cr_assert(!p.failed);
    cr_assert_eq(p.backing_off, 2);
    cr_assert_eq(p.requeue_ms, 3000);
    cr_assert_eq(p.failed_pods, 2);
    cr_assert_eq(p.n_create, 0);
    reconcile_plan_cleanup(&p);
    /* Back-off over: the replacement spends the budget. */
    pods[1].backoff_ms = 0;
    cr_assert_eq(reconcile_plan(&spec3, 2, pods, 3, &p), 0);
    cr_assert(p.failed);
    cr_assert_eq(p.n_replace, 0);
    reconcile_plan_cleanup(&p);
    cr_assert_eq(reconcile_plan(&spec3, 1, pods, 3, &p), 0);
    cr_assert(!p.failed);
    cr_assert_eq(p.n_replace, 1);
    cr_assert_str_eq(pods[p.replace[0]].name, "lr-1");
    cr_assert_eq(p.requeue_ms, 7000);
    reconcile_plan_cleanup(&p);
}

static const struct reconcile_spec spec4 = { .replicas = 4, .min_replicas = 1, .max_restarts = 2,
                                             .max_unavailable = 1, .heartbeat_ms = 1000,
                                             .timeout_ms = 5000 };

/* Pods lr-0 .. lr-3, all Running and outdated. */
static void outdated4(struct reconcile_pod_view *pods)
{
    ordinal_pods(pods, 4, (enum reconcile_phase[]){ RECONCILE_POD_RUNNING, RECONCILE_POD_RUNNING,
                                                    RECONCILE_POD_RUNNING, RECONCILE_POD_RUNNING });
    for (size_t i = 0; i < 4; i++)
        pods[i].outdated = true;
}

Test(reconcile, rollout_replaces_the_highest_ordinal_first_within_max_unavailable)
{
    struct reconcile_pod_view pods[4];
    struct reconcile_spec s = spec4;
    struct reconcile_plan p;

    outdated4(pods);
    cr_assert_eq(reconcile_plan(&s, 0, pods, 4, &p), 0);
    cr_assert_eq(p.n_update, 1);
    cr_assert_str_eq(pods[p.update[0]].name, "lr-3");
    cr_assert_eq(p.outdated, 4);
    cr_assert_eq(p.updated, 0);
    cr_assert_eq(p.n_create + p.n_replace + p.n_roll + p.n_excess, 0);
    reconcile_plan_cleanup(&p);
    s.max_unavailable = 2;
    cr_assert_eq(reconcile_plan(&s, 0, pods, 4, &p), 0);
    cr_assert_eq(p.n_update, 2);
    cr_assert_str_eq(pods[p.update[0]].name, "lr-3");
    cr_assert_str_eq(pods[p.update[1]].name, "lr-2");
    reconcile_plan_cleanup(&p);
}

Test(reconcile, rollout_waits_while_a_replaced_pod_is_not_back)
{
    struct reconcile_pod_view pods[4];
    struct reconcile_plan p;

    outdated4(pods);
    /* lr-3 was replaced: the new one is Pending from the new template. */
    pods[3].outdated = false;
    pods[3].phase = RECONCILE_POD_PENDING;
    cr_assert_eq(reconcile_plan(&spec4, 0, pods, 4, &p), 0);
    cr_assert_eq(p.n_update, 0);
    cr_assert_eq(p.updated, 1);
    cr_assert_eq(p.outdated, 3);
    reconcile_plan_cleanup(&p);
    /* Its name still taken by the old one, terminating: the same. */
    pods[3].phase = RECONCILE_POD_TERMINATING;
    cr_assert_eq(reconcile_plan(&spec4, 0, pods, 4, &p), 0);
    cr_assert_eq(p.n_update, 0);
    reconcile_plan_cleanup(&p);
    /* Running again: the next one goes. */
    pods[3].phase = RECONCILE_POD_RUNNING;
    cr_assert_eq(reconcile_plan(&spec4, 0, pods, 4, &p), 0);
    cr_assert_eq(p.n_update, 1);
    cr_assert_str_eq(pods[p.update[0]].name, "lr-2");
    reconcile_plan_cleanup(&p);
}

Test(reconcile, rollout_keeps_min_replicas_running)
{
    struct reconcile_pod_view pods[4];
    struct reconcile_spec s = spec4;
    struct reconcile_plan p;

    outdated4(pods);
    s.max_unavailable = 4;
    s.min_replicas = 3;
    cr_assert_eq(reconcile_plan(&s, 0, pods, 4, &p), 0);
    cr_assert_eq(p.n_update, 1, "%zu", p.n_update);
    reconcile_plan_cleanup(&p);
    /* replicas == minReplicas: one at a time, else it could never roll. */
    s.min_replicas = 4;
    cr_assert_eq(reconcile_plan(&s, 0, pods, 4, &p), 0);
    cr_assert_eq(p.n_update, 1);
    reconcile_plan_cleanup(&p);
    /* One pod down already: none more. */
    pods[0].phase = RECONCILE_POD_PENDING;
    pods[0].outdated = false;
    cr_assert_eq(reconcile_plan(&s, 0, pods, 4, &p), 0);
    cr_assert_eq(p.n_update, 0);
    reconcile_plan_cleanup(&p);
}

Test(reconcile, rollout_finishes_drains_and_takes_pending_pods_at_once)
{
    struct reconcile_pod_view pods[4];
    struct reconcile_plan p;

    outdated4(pods);
    pods[1].draining = true;                /* chosen earlier */
    pods[2].phase = RECONCILE_POD_PENDING;  /* unavailable anyway */
    cr_assert_eq(reconcile_plan(&spec4, 0, pods, 4, &p), 0);
    /* Over the budget, but a drain is never left halfway, and a pod that
     * is not running costs nothing. lr-3 waits. */
    cr_assert_eq(p.n_update, 2);
    cr_assert_str_eq(pods[p.update[0]].name, "lr-1");
    cr_assert_str_eq(pods[p.update[1]].name, "lr-2");
    reconcile_plan_cleanup(&p);
}

Test(reconcile, rollout_leaves_finished_failed_and_stale_pods_to_their_rules)
{
    struct reconcile_pod_view pods[4];
    struct reconcile_spec s = spec4;
    struct reconcile_plan p;

    outdated4(pods);
    pods[0].phase = RECONCILE_POD_SUCCEEDED;
    pods[1].phase = RECONCILE_POD_FAILED;
    pods[2].stale = true;
    s.max_unavailable = 4;
    cr_assert_eq(reconcile_plan(&s, 0, pods, 4, &p), 0);
    cr_assert_eq(p.n_replace, 1);
    cr_assert_eq(p.n_roll, 1);
    cr_assert_eq(p.n_update, 1);
    cr_assert_str_eq(pods[p.update[0]].name, "lr-3");
    cr_assert_eq(p.outdated, 3);
    reconcile_plan_cleanup(&p);
    /* No rollout once the cohort failed: its pods stay for inspection. */
    cr_assert_eq(reconcile_plan(&s, 2, pods, 4, &p), 0);
    cr_assert(p.failed);
    cr_assert_eq(p.n_update, 0);
    reconcile_plan_cleanup(&p);
}

Test(reconcile, parse_reads_max_unavailable_with_its_default)
{
    cJSON *tc = cohort("lr", "");
    struct reconcile_spec s;
    struct reconcile_why why;

    cr_assert_eq(reconcile_parse(tc, &s, &why), 0);
    cr_assert_eq(s.max_unavailable, 1);
    cJSON_Delete(tc);
    tc = cohort("lr", "\"rollout\":{\"maxUnavailable\":3}");
    cr_assert_eq(reconcile_parse(tc, &s, &why), 0);
    cr_assert_eq(s.max_unavailable, 3);
    cJSON_Delete(tc);
    refused("lr", "\"rollout\":{\"maxUnavailable\":0}", "InvalidSpec");
    refused("lr", "\"rollout\":{\"maxUnavailable\":\"25%\"}", "InvalidSpec");
    refused("lr", "\"rollout\":7", "InvalidSpec");
}

Test(reconcile, template_hash_is_of_the_template_whatever_its_key_order)
{
    cJSON *a = parse("{\"metadata\":{\"name\":\"x\"},\"spec\":{\"template\":{\"spec\":{\"containers\":"
                     "[{\"name\":\"t\",\"image\":\"i\"}],\"restartPolicy\":\"Never\"}},\"replicas\":1}}");
    cJSON *b = parse("{\"spec\":{\"replicas\":7,\"template\":{\"spec\":{\"restartPolicy\":\"Never\","
                     "\"containers\":[{\"image\":\"i\",\"name\":\"t\"}]}}}}");
    cJSON *c = parse("{\"spec\":{\"template\":{\"spec\":{\"restartPolicy\":\"Never\","
                     "\"containers\":[{\"image\":\"i2\",\"name\":\"t\"}]}}}}");
    cJSON *none = parse("{\"spec\":{}}");
    char ha[RECONCILE_HASH_CHARS + 1], hb[RECONCILE_HASH_CHARS + 1], hc[RECONCILE_HASH_CHARS + 1];

    cr_assert_eq(reconcile_template_hash(a, ha), 0);
    cr_assert_eq(reconcile_template_hash(b, hb), 0);
    cr_assert_eq(reconcile_template_hash(c, hc), 0);
    cr_assert_eq(strlen(ha), RECONCILE_HASH_CHARS);
    cr_assert_str_eq(ha, hb, "the order of keys and other spec fields do not count");
    cr_assert_str_neq(ha, hc);
    cr_assert_eq(reconcile_template_hash(none, ha), -EINVAL);
    cJSON_Delete(a);
    cJSON_Delete(b);
    cJSON_Delete(c);
    cJSON_Delete(none);
}

Test(reconcile, pod_is_labelled_with_its_template_hash_and_views_read_it)
{
    cJSON *tc = cohort("lr", ""), *pod = NULL;
    char h[RECONCILE_HASH_CHARS + 1];
    struct reconcile_pod_view v;

    cr_assert_eq(reconcile_template_hash(tc, h), 0);
    cr_assert_eq(reconcile_pod(tc, &env, NULL, 0, &pod), 0);
    cr_assert_str_eq(cJSON_GetObjectItem(sget_item(pod, "metadata.labels"),
                                         RECONCILE_LABEL_TEMPLATE_HASH)->valuestring, h);
    cr_assert_eq(reconcile_view("lr", pod, &v), 0);
    cr_assert_str_eq(v.template_hash, h);
    cJSON_Delete(pod);
    cJSON_Delete(tc);
}

Test(reconcile, pod_failure_names_exit_code_signal_and_image_errors)
{
    struct reconcile_failure f;
    cJSON *p;

    p = parse("{\"status\":{\"phase\":\"Failed\",\"containerStatuses\":[{\"name\":\"trainer\","
              "\"state\":{\"terminated\":{\"exitCode\":3,\"reason\":\"Error\"}}}]}}");
    cr_assert(reconcile_pod_failure(p, &f));
    cr_assert_eq(f.exit_code, 3);
    cr_assert_str_eq(f.reason, "Error");
    cr_assert_str_eq(f.container, "trainer");
    cr_assert(strstr(f.message, "exited with code 3"), "%s", f.message);
    cJSON_Delete(p);
    p = parse("{\"status\":{\"phase\":\"Failed\",\"containerStatuses\":[{\"name\":\"ok\",\"state\":"
              "{\"terminated\":{\"exitCode\":0}}},{\"name\":\"trainer\",\"state\":{\"terminated\":"
              "{\"exitCode\":137,\"signal\":9,\"reason\":\"OOMKilled\"}}}]}}");
    cr_assert(reconcile_pod_failure(p, &f));
    cr_assert_str_eq(f.reason, "OOMKilled");
    cr_assert_eq(f.signal, 9);
    cr_assert(strstr(f.message, "signal 9"), "%s", f.message);
    cJSON_Delete(p);
    p = parse("{\"status\":{\"phase\":\"Pending\",\"containerStatuses\":[{\"name\":\"trainer\","
              "\"state\":{\"waiting\":{\"reason\":\"ImagePullBackOff\",\"message\":\"no such image\"}}}]}}");
    cr_assert(reconcile_pod_failure(p, &f));
    cr_assert_str_eq(f.reason, "ImagePullBackOff");
    cr_assert_eq(f.exit_code, -1);
    cr_assert(strstr(f.message, "no such image"), "%s", f.message);
    cJSON_Delete(p);
    /* Waiting to be created, or running: nothing wrong. */
    p = parse("{\"status\":{\"phase\":\"Pending\",\"initContainerStatuses\":[{\"name\":\"s\","
              "\"state\":{\"waiting\":{\"reason\":\"ContainerCreating\"}}}],"
              "\"containerStatuses\":[{\"name\":\"trainer\",\"state\":{\"running\":{}}}]}}");
    cr_assert(!reconcile_pod_failure(p, &f));
    cJSON_Delete(p);
    /* Failed without a container's word: the pod's reason. */
    p = parse("{\"status\":{\"phase\":\"Failed\",\"reason\":\"Evicted\",\"message\":\"low memory\"}}");
    cr_assert(reconcile_pod_failure(p, &f));
    cr_assert_str_eq(f.reason, "Evicted");
    cJSON_Delete(p);
}

Test(reconcile, status_shows_failures_refusals_and_the_rollout)
{
    struct reconcile_member m[] = { { "lr-0", "1.1.1.1:5", 4, false } };
    struct reconcile_pod_view pods[4];
    struct reconcile_failure f0 = { .container = "trainer", .reason = "Error",
                                    .message = "container trainer exited with code 1 (Error)",
                                    .exit_code = 1 };
    struct reconcile_failure f1 = { .container = "trainer", .reason = "ErrImagePull",
                                    .message = "container trainer is waiting: ErrImagePull",
                                    .exit_code = -1 };
    struct reconcile_pod_failure fl[] = { { "lr-0", &f0, 0, "t0" }, { "lr-1", &f1, 9500, "t1" } };
    struct reconcile_why no = { "FailedCreate", "error creating pod lr-2: HTTP 422 Invalid: x" };
    struct reconcile_plan p;
    struct reconcile_observed o = { .members = m, .n_members = 1, .epoch = 1, .plan = &p,
                                    .failures = fl, .n_failures = 2, .replica_failure = &no };
    const cJSON *mem, *lf;
    cJSON *st;

    outdated4(pods);
    pods[3].outdated = false;
    cr_assert_eq(reconcile_plan(&spec4, 0, pods, 4, &p), 0);
    st = reconcile_status(&spec4, &o, NULL, "t");
    cr_assert_eq(cJSON_GetObjectItem(st, "updatedReplicas")->valueint, 1);
    cr_assert_str_eq(sget(cond(st, "Progressing"), "reason"), "RollingUpdate");
    cr_assert(strstr(sget(cond(st, "Progressing"), "message"), "1 of 4"));
    cr_assert_str_eq(sget(cond(st, "ReplicaFailure"), "reason"), "FailedCreate");
    cr_assert_str_eq(sget(cond(st, "ReplicaFailure"), "status"), "True");
    cr_assert(strstr(sget(cond(st, "ReplicaFailure"), "message"), "422 Invalid"));
    mem = cJSON_GetObjectItem(st, "members");
    cr_assert_eq(cJSON_GetArraySize(mem), 2, "a pod that is no member gets an entry");
    lf = cJSON_GetObjectItem(cJSON_GetArrayItem(mem, 0), "lastFailure");
    cr_assert_eq(cJSON_GetObjectItem(lf, "exitCode")->valueint, 1);
    cr_assert_null(cJSON_GetObjectItem(lf, "backoffSeconds"));
    cr_assert_str_eq(sget(cJSON_GetArrayItem(mem, 0), "address"), "1.1.1.1:5");
    lf = cJSON_GetObjectItem(cJSON_GetArrayItem(mem, 1), "lastFailure");
    cr_assert_str_eq(sget(lf, "reason"), "ErrImagePull");
    cr_assert_null(cJSON_GetObjectItem(lf, "exitCode"));
    cr_assert_eq(cJSON_GetObjectItem(lf, "backoffSeconds")->valueint, 10);
    cr_assert_eq(cJSON_GetObjectItem(st, "readyReplicas")->valueint, 1);
    cJSON_Delete(st);
    /* Without a refusal the condition is gone, as a ReplicaSet's. */
    o.replica_failure = NULL;
    st = reconcile_status(&spec4, &o, NULL, "t");
    cr_assert_null(cond(st, "ReplicaFailure"));
    reconcile_plan_cleanup(&p);
    cJSON_Delete(st);
}

/* ---- spec.checkpoint ---------------------------------------------------- */

#define CKPT_HOSTPATH "\"volume\":{\"hostPath\":{\"path\":\"/data/ck\"}}"

Test(reconcile, parse_reads_checkpoint_with_its_defaults)
{
    cJSON *tc = cohort("lr", "\"checkpoint\":{" CKPT_HOSTPATH ",\"everyVersions\":50}");
    struct reconcile_spec s;
    struct reconcile_why why;

    cr_assert_eq(reconcile_parse(tc, &s, &why), 0, "%s", why.message);
    cr_assert(s.checkpoint);
    cr_assert_eq(s.ckpt_every_versions, 50);
    cr_assert_eq(s.ckpt_every_s, 0);
    cr_assert_eq(s.ckpt_keep, RECONCILE_CKPT_KEEP_DEFAULT);
    cJSON_Delete(tc);
    tc = cohort("lr", "\"checkpoint\":{\"volume\":{\"persistentVolumeClaim\":{\"claimName\":\"c\"}},"
                      "\"everySeconds\":30,\"keep\":1}");
    cr_assert_eq(reconcile_parse(tc, &s, &why), 0, "%s", why.message);
    cr_assert_eq(s.ckpt_every_s, 30);
    cr_assert_eq(s.ckpt_keep, 1);
    cJSON_Delete(tc);
    tc = cohort("lr", "");
    cr_assert_eq(reconcile_parse(tc, &s, &why), 0, "%s", why.message);
    cr_assert(!s.checkpoint, "unset: no checkpoints");
    cJSON_Delete(tc);
}

Test(reconcile, parse_refuses_a_checkpoint_without_volume_period_or_keep)
{
    refused("lr", "\"checkpoint\":{\"everyVersions\":5}", "InvalidCheckpoint");
    refused("lr", "\"checkpoint\":{" CKPT_HOSTPATH "}", "InvalidCheckpoint");
    refused("lr", "\"checkpoint\":{" CKPT_HOSTPATH ",\"everyVersions\":5,\"keep\":0}",
            "InvalidCheckpoint");
    refused("lr", "\"checkpoint\":{" CKPT_HOSTPATH ",\"everySeconds\":3601}", "InvalidCheckpoint");
    refused("lr", "\"checkpoint\":{" CKPT_HOSTPATH ",\"everyVersions\":0}", "InvalidCheckpoint");
    refused("lr", "\"checkpoint\":{\"volume\":{},\"everyVersions\":5}", "InvalidCheckpoint");
    refused("lr", "\"checkpoint\":{\"volume\":{\"hostPath\":{\"path\":\"/a\"},\"emptyDir\":{}},"
                  "\"everyVersions\":5}", "InvalidCheckpoint");
    refused("lr", "\"checkpoint\":{\"volume\":{\"configMap\":{\"name\":\"x\"}},\"everyVersions\":5}",
            "InvalidCheckpoint");
    refused("lr", "\"checkpoint\":7", "InvalidCheckpoint");
}

Test(reconcile, pod_mounts_the_checkpoint_volume_in_the_sidecar_alone)
{
    cJSON *tc = cohort("lr", "\"checkpoint\":{" CKPT_HOSTPATH ",\"everyVersions\":50,"
                             "\"everySeconds\":60,\"keep\":2}");
    const cJSON *side, *trainer, *m, *vol;
    cJSON *pod = NULL;
    char args[1024];
    bool mounted = false;

    cr_assert_eq(reconcile_pod(tc, &env, NULL, 0, &pod), 0);
    sidecar_args(pod, args, sizeof(args));
    cr_assert(strstr(args, " --checkpoint-dir " RECONCILE_CKPT_MOUNT " --checkpoint-every 50 "
                           "--checkpoint-interval 60s --checkpoint-keep 2"), "%s", args);
    vol = item(sget_item(pod, "spec.volumes"), RECONCILE_CKPT_VOLUME);
    cr_assert_not_null(vol);
    cr_assert_str_eq(sget(vol, "hostPath.path"), "/data/ck");
    side = cJSON_GetArrayItem(sget_item(pod, "spec.initContainers"), 0);
    cJSON_ArrayForEach(m, cJSON_GetObjectItem(side, "volumeMounts"))
        if (strcmp(cJSON_GetObjectItem(m, "name")->valuestring, RECONCILE_CKPT_VOLUME) == 0) {
            cr_assert_str_eq(cJSON_GetObjectItem(m, "mountPath")->valuestring,
                             RECONCILE_CKPT_MOUNT);
            cr_assert_str_eq(cJSON_GetObjectItem(m, "subPath")->valuestring, "ns/lr",
                             "one directory per cohort");
            mounted = true;
        }
    cr_assert(mounted);
    trainer = cJSON_GetArrayItem(sget_item(pod, "spec.containers"), 0);
    cJSON_ArrayForEach(m, cJSON_GetObjectItem(trainer, "volumeMounts"))
        cr_assert_str_neq(cJSON_GetObjectItem(m, "name")->valuestring, RECONCILE_CKPT_VOLUME);
    cJSON_Delete(pod);
    cJSON_Delete(tc);
    /* Without spec.checkpoint: no volume, no flags. */
    tc = cohort("lr", "");
    cr_assert_eq(reconcile_pod(tc, &env, NULL, 0, &pod), 0);
    sidecar_args(pod, args, sizeof(args));
    cr_assert_null(strstr(args, "--checkpoint"), "%s", args);
    cr_assert_null(item(sget_item(pod, "spec.volumes"), RECONCILE_CKPT_VOLUME));
    cJSON_Delete(pod);
    cJSON_Delete(tc);
}

Test(reconcile, parse_refuses_the_checkpoint_volume_name_in_the_template)
{
    char fields[512];
    cJSON *tc;
    struct reconcile_spec s;
    struct reconcile_why why;

    snprintf(fields, sizeof(fields), "{\"metadata\":{\"name\":\"lr\"},\"spec\":{\"template\":"
             "{\"spec\":{\"containers\":[{\"name\":\"t\"}],\"volumes\":[{\"name\":\"%s\","
             "\"emptyDir\":{}}]}}}}", RECONCILE_CKPT_VOLUME);
    tc = parse(fields);
    cr_assert_eq(reconcile_parse(tc, &s, &why), -EINVAL);
    cr_assert_str_eq(why.reason, "InvalidTemplate");
    cJSON_Delete(tc);
}

Test(reconcile, template_hash_covers_the_checkpoint_and_only_when_set)
{
    cJSON *plain = cohort("lr", ""), *a = cohort("lr", "\"checkpoint\":{" CKPT_HOSTPATH ","
                                                       "\"everyVersions\":50}");
    cJSON *b = cohort("lr", "\"checkpoint\":{" CKPT_HOSTPATH ",\"everyVersions\":60}");
    char hp[RECONCILE_HASH_CHARS + 1], ha[RECONCILE_HASH_CHARS + 1], hb[RECONCILE_HASH_CHARS + 1];

    cr_assert_eq(reconcile_template_hash(plain, hp), 0);
    cr_assert_eq(reconcile_template_hash(a, ha), 0);
    cr_assert_eq(reconcile_template_hash(b, hb), 0);
    cr_assert_str_neq(hp, ha, "adding spec.checkpoint rolls the pods");
    cr_assert_str_neq(ha, hb, "changing it rolls them too");
    cJSON_Delete(plain);
    cJSON_Delete(a);
    cJSON_Delete(b);
}

static const cJSON *ck_of(const cJSON *st, const char *k)
{
    return cJSON_GetObjectItem(cJSON_GetObjectItem(st, "checkpoint"), k);
}

Test(reconcile, status_checkpoint_is_the_newest_reported_and_stays_while_none_runs)
{
    struct reconcile_plan p = { 0 };
    struct reconcile_observed o = { .plan = &p, .ckpt = { .version = 40 } };
    struct reconcile_spec s = spec3;
    cJSON *st = reconcile_status(&s, &o, NULL, "t1"), *st2, *st3;

    cr_assert_eq(ck_of(st, "version")->valueint, 40);
    cr_assert_str_eq(ck_of(st, "time")->valuestring, "t1");
    /* Nobody reports (suspended): kept, with its time. */
    o.ckpt.version = 0;
    st2 = reconcile_status(&s, &o, st, "t2");
    cr_assert_eq(ck_of(st2, "version")->valueint, 40);
    cr_assert_str_eq(ck_of(st2, "time")->valuestring, "t1");
    /* A joiner that loaded nothing newer reports less: kept. */
    o.ckpt.version = 10;
    st3 = reconcile_status(&s, &o, st2, "t3");
    cr_assert_eq(ck_of(st3, "version")->valueint, 40);
    cJSON_Delete(st3);
    /* The newest was set aside and the members resumed from 30. */
    o.ckpt = (struct reconcile_ckpt_seen){ .version = 30, .skipped_version = 40,
                                           .skipped_reason = 2 };
    st3 = reconcile_status(&s, &o, st2, "t4");
    cr_assert_eq(ck_of(st3, "version")->valueint, 30);
    cr_assert_str_eq(ck_of(st3, "time")->valuestring, "t4");
    cr_assert_eq(cJSON_GetObjectItem(ck_of(st3, "lastSkipped"), "version")->valueint, 40);
    cr_assert_str_eq(cJSON_GetObjectItem(ck_of(st3, "lastSkipped"), "reason")->valuestring,
                     "checksum mismatch");
    cJSON_Delete(st3);
    cJSON_Delete(st2);
    cJSON_Delete(st);
    /* Nothing ever reported: no field. */
    o.ckpt = (struct reconcile_ckpt_seen){ 0 };
    st = reconcile_status(&s, &o, NULL, "t");
    cr_assert_null(cJSON_GetObjectItem(st, "checkpoint"));
    cJSON_Delete(st);
}

Test(reconcile, checkpoint_reasons_are_named_as_ckpt_names_them)
{
    for (unsigned r = 0; r <= CKPT_REASON_MAX + 1; r++)
        cr_assert_str_eq(reconcile_ckpt_reason(r), ckpt_reason_str(r), "reason %u", r);
}

/* ---- spec.gpu ------------------------------------------------------------ */

/* The names in container `c`'s resources.claims, space-separated. */
static void claim_names(const cJSON *c, char *buf, size_t n)
{
    const cJSON *it;
    size_t used = 0;

    buf[0] = '\0';
    cJSON_ArrayForEach(it, cJSON_GetObjectItem(cJSON_GetObjectItem(c, "resources"), "claims"))
        used += (size_t)snprintf(buf + used, n - used, "%s ",
                                 cJSON_GetObjectItem(it, "name")->valuestring);
}

/* o[path][key], a string, for keys with dots in them. */
static const char *dotted(const cJSON *o, const char *path, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(sget_item(o, path), key);

    return cJSON_IsString(v) ? v->valuestring : NULL;
}

Test(reconcile, parse_reads_gpu_with_its_defaults)
{
    cJSON *tc = cohort("lr", "\"gpu\":{\"mode\":\"dra\"}");
    struct reconcile_spec s;
    struct reconcile_why why;

    cr_assert_eq(reconcile_parse(tc, &s, &why), 0, "%s", why.message);
    cr_assert_eq(s.gpu_mode, RECONCILE_GPU_DRA);
    cr_assert_eq(s.gpu_count, 1);
    cr_assert_str_eq(s.gpu_class, RECONCILE_GPU_CLASS_DEFAULT);
    cr_assert_str_eq(s.gpu_reduce, RECONCILE_GPU_REDUCE_DEFAULT);
    cJSON_Delete(tc);
    tc = cohort("lr", "\"gpu\":{\"mode\":\"devicePlugin\",\"count\":4}");
    cr_assert_eq(reconcile_parse(tc, &s, &why), 0, "%s", why.message);
    cr_assert_eq(s.gpu_mode, RECONCILE_GPU_DEVICE_PLUGIN);
    cr_assert_eq(s.gpu_count, 4);
    cr_assert_null(s.gpu_class);
    cr_assert_null(s.gpu_reduce, "no sidecar GPU to reduce with devicePlugin");
    cJSON_Delete(tc);
    tc = cohort("lr", "");
    cr_assert_eq(reconcile_parse(tc, &s, &why), 0);
    cr_assert_eq(s.gpu_mode, RECONCILE_GPU_NONE);
    cr_assert_eq(s.gpu_count, 0);
    cJSON_Delete(tc);
}

Test(reconcile, parse_refuses_bad_gpu_specs)
{
    refused("lr", "\"gpu\":{}", "InvalidGPU");
    refused("lr", "\"gpu\":{\"mode\":\"mig\"}", "InvalidGPU");
    refused("lr", "\"gpu\":{\"mode\":7}", "InvalidGPU");
    refused("lr", "\"gpu\":[1]", "InvalidGPU");
    refused("lr", "\"gpu\":{\"mode\":\"dra\",\"count\":0}", "InvalidGPU");
    refused("lr", "\"gpu\":{\"mode\":\"dra\",\"count\":17}", "InvalidGPU");
    refused("lr", "\"gpu\":{\"mode\":\"dra\",\"count\":1.5}", "InvalidGPU");
    refused("lr", "\"gpu\":{\"mode\":\"dra\",\"count\":\"2\"}", "InvalidGPU");
    refused("lr", "\"gpu\":{\"mode\":\"devicePlugin\",\"deviceClassName\":\"gpu.nvidia.com\"}",
            "InvalidGPU");
    refused("lr", "\"gpu\":{\"mode\":\"dra\",\"deviceClassName\":\"GPU.nvidia.com\"}",
            "InvalidGPU");
    refused("lr", "\"gpu\":{\"mode\":\"dra\",\"deviceClassName\":\"gpu..nvidia\"}", "InvalidGPU");
    refused("lr", "\"gpu\":{\"mode\":\"dra\",\"deviceClassName\":\"-gpu\"}", "InvalidGPU");
    refused("lr", "\"gpu\":{\"mode\":\"dra\",\"deviceClassName\":\"\"}", "InvalidGPU");
    refused("lr", "\"gpu\":{\"mode\":\"dra\",\"deviceClassName\":5}", "InvalidGPU");
    refused("lr", "\"gpu\":{\"mode\":\"devicePlugin\",\"reduce\":\"host\"}", "InvalidGPU");
    refused("lr", "\"gpu\":{\"mode\":\"dra\",\"reduce\":\"gloo\"}", "InvalidGPU");
    refused("lr", "\"gpu\":{\"mode\":\"dra\",\"reduce\":\"\"}", "InvalidGPU");
    refused("lr", "\"gpu\":{\"mode\":\"dra\",\"reduce\":1}", "InvalidGPU");
    refused("lr", "\"gpu\":{\"mode\":\"dra\",\"reduce\":null}", "InvalidGPU");
}

/* spec.gpu.reduce becomes the sidecar's --gpu-reduce with mode dra (nccl
 * unless it says host), and is no argument without it; a change of it
 * changes the template hash, so the pods roll as for any spec.gpu change. */
Test(reconcile, pod_with_dra_renders_gpu_reduce_and_a_change_of_it_rolls)
{
    static const struct {
        const char *gpu, *want;
    } cases[] = {
        { "\"gpu\":{\"mode\":\"dra\"}", "--gpu-reduce nccl" },
        { "\"gpu\":{\"mode\":\"dra\",\"reduce\":\"nccl\"}", "--gpu-reduce nccl" },
        { "\"gpu\":{\"mode\":\"dra\",\"reduce\":\"host\"}", "--gpu-reduce host" },
        { "\"gpu\":{\"mode\":\"devicePlugin\"}", NULL },
        { "", NULL },
    };
    char args[1024], h_nccl[RECONCILE_HASH_CHARS + 1], h_host[RECONCILE_HASH_CHARS + 1];
    struct reconcile_spec sp;
    struct reconcile_why why;

    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        cJSON *tc = cohort("lr", cases[i].gpu), *pod = NULL;
        const char *at;

        cr_assert_eq(reconcile_pod(tc, &env, NULL, 0, &pod), 0, "%s", cases[i].gpu);
        sidecar_args(pod, args, sizeof(args));
        at = strstr(args, "--gpu-reduce");
        if (cases[i].want) {
            cr_assert(at && strcmp(at, cases[i].want) == 0 &&
                          !strstr(at + 1, "--gpu-reduce"),
                      "once, with its value: %s", args);
            cr_assert_eq(reconcile_parse(tc, &sp, &why), 0);
            cr_assert_str_eq(sp.gpu_reduce, cases[i].want + strlen("--gpu-reduce "));
        } else {
            cr_assert_null(at, "%s: %s", cases[i].gpu, args);
        }
        cJSON_Delete(pod);
        cJSON_Delete(tc);
    }
    cJSON *a = cohort("lr", cases[1].gpu), *b = cohort("lr", cases[2].gpu);
    cr_assert_eq(reconcile_template_hash(a, h_nccl), 0);
    cr_assert_eq(reconcile_template_hash(b, h_host), 0);
    cr_assert_str_neq(h_nccl, h_host, "a change of spec.gpu.reduce rolls the pods");
    cJSON_Delete(a);
    cJSON_Delete(b);
}

Test(reconcile, parse_refuses_the_gpu_claim_name_in_the_template)
{
    cJSON *tc = parse("{\"metadata\":{\"name\":\"lr\"},\"spec\":{\"template\":{\"spec\":{"
                      "\"containers\":[{\"name\":\"t\"}],\"resourceClaims\":[{\"name\":\""
                      RECONCILE_GPU_CLAIM "\",\"resourceClaimName\":\"x\"}]}}}}");
    struct reconcile_spec s;
    struct reconcile_why why;

    cr_assert_eq(reconcile_parse(tc, &s, &why), -EINVAL);
    cr_assert_str_eq(why.reason, "InvalidTemplate");
    cr_assert(strstr(why.message, RECONCILE_GPU_CLAIM), "%s", why.message);
    cJSON_Delete(tc);
}

Test(reconcile, pod_with_dra_shares_one_claim_between_trainer_and_sidecar)
{
    cJSON *tc = cohort("lr", "\"gpu\":{\"mode\":\"dra\",\"count\":2}");
    const cJSON *claims, *side, *trainer;
    cJSON *pod = NULL;
    char names[256];

    cr_assert_eq(reconcile_pod(tc, &env, NULL, 0, &pod), 0);
    claims = sget_item(pod, "spec.resourceClaims");
    cr_assert_eq(cJSON_GetArraySize(claims), 1);
    cr_assert_str_eq(sget(cJSON_GetArrayItem(claims, 0), "name"), RECONCILE_GPU_CLAIM);
    cr_assert_str_eq(sget(cJSON_GetArrayItem(claims, 0), "resourceClaimTemplateName"), "lr-gpu",
                     "a claim per pod, made by Kubernetes from the cohort's template");
    cr_assert_null(cJSON_GetObjectItem(cJSON_GetArrayItem(claims, 0), "resourceClaimName"));
    trainer = cJSON_GetArrayItem(sget_item(pod, "spec.containers"), 0);
    side = cJSON_GetArrayItem(sget_item(pod, "spec.initContainers"), 0);
    cr_assert_str_eq(sget(side, "name"), RECONCILE_SIDECAR);
    claim_names(trainer, names, sizeof(names));
    cr_assert_str_eq(names, RECONCILE_GPU_CLAIM " ");
    claim_names(side, names, sizeof(names));
    cr_assert_str_eq(names, RECONCILE_GPU_CLAIM " ", "the sidecar sees the trainer's devices");
    cr_assert_null(cJSON_GetObjectItem(cJSON_GetObjectItem(cJSON_GetObjectItem(trainer,
                   "resources"), "limits"), RECONCILE_GPU_RESOURCE), "no device plugin in dra");
    cJSON_Delete(pod);
    cJSON_Delete(tc);
}

Test(reconcile, pod_with_dra_keeps_the_templates_own_claims_and_sidecar_resources)
{
    cJSON *tc = parse("{\"metadata\":{\"name\":\"lr\",\"namespace\":\"ns\",\"uid\":\"u\"},"
                      "\"spec\":{\"gpu\":{\"mode\":\"dra\"},\"sidecar\":{\"resources\":{"
                      "\"limits\":{\"cpu\":\"1\"}}},\"template\":{\"spec\":{\"resourceClaims\":"
                      "[{\"name\":\"nic\",\"resourceClaimName\":\"rdma\"}],\"containers\":["
                      "{\"name\":\"t\",\"image\":\"i\",\"resources\":{\"claims\":[{\"name\":"
                      "\"nic\"},{\"name\":\"" RECONCILE_GPU_CLAIM "\"}]}},{\"name\":\"logger\","
                      "\"image\":\"i\"}]}}}}");
    const cJSON *side, *logger;
    cJSON *pod = NULL;
    char names[256];

    cr_assert_eq(reconcile_pod(tc, &env, NULL, 0, &pod), 0);
    cr_assert_eq(cJSON_GetArraySize(sget_item(pod, "spec.resourceClaims")), 2);
    claim_names(cJSON_GetArrayItem(sget_item(pod, "spec.containers"), 0), names, sizeof(names));
    cr_assert_str_eq(names, "nic " RECONCILE_GPU_CLAIM " ");
    logger = cJSON_GetArrayItem(sget_item(pod, "spec.containers"), 1);
    claim_names(logger, names, sizeof(names));
    cr_assert_str_eq(names, "", "only the first container is the trainer");
    side = cJSON_GetArrayItem(sget_item(pod, "spec.initContainers"), 0);
    cr_assert_str_eq(sget(side, "resources.limits.cpu"), "1");
    claim_names(side, names, sizeof(names));
    cr_assert_str_eq(names, RECONCILE_GPU_CLAIM " ");
    cJSON_Delete(pod);
    cJSON_Delete(tc);
}

Test(reconcile, pod_with_device_plugin_gives_the_trainer_alone_the_gpus)
{
    cJSON *tc = parse("{\"metadata\":{\"name\":\"lr\",\"namespace\":\"ns\",\"uid\":\"u\"},"
                      "\"spec\":{\"gpu\":{\"mode\":\"devicePlugin\",\"count\":3},\"template\":"
                      "{\"spec\":{\"containers\":[{\"name\":\"t\",\"image\":\"i\",\"resources\":"
                      "{\"requests\":{\"cpu\":\"2\",\"nvidia.com/gpu\":\"1\"},\"limits\":{"
                      "\"nvidia.com/gpu\":\"1\"}}}]}}}}");
    const cJSON *trainer, *side;
    cJSON *pod = NULL;
    char names[256];

    cr_assert_eq(reconcile_pod(tc, &env, NULL, 0, &pod), 0);
    trainer = cJSON_GetArrayItem(sget_item(pod, "spec.containers"), 0);
    cr_assert_str_eq(dotted(trainer, "resources.limits", RECONCILE_GPU_RESOURCE), "3");
    cr_assert_null(cJSON_GetObjectItem(cJSON_GetObjectItem(cJSON_GetObjectItem(trainer,
                   "resources"), "requests"), RECONCILE_GPU_RESOURCE),
                   "the template's request would contradict the limit");
    cr_assert_str_eq(sget(trainer, "resources.requests.cpu"), "2");
    side = cJSON_GetArrayItem(sget_item(pod, "spec.initContainers"), 0);
    cr_assert_null(cJSON_GetObjectItem(cJSON_GetObjectItem(side, "resources"), "limits"));
    claim_names(side, names, sizeof(names));
    cr_assert_str_eq(names, "");
    cr_assert_null(sget_item(pod, "spec.resourceClaims"));
    cJSON_Delete(pod);
    cJSON_Delete(tc);
}

Test(reconcile, pod_refuses_a_bad_gpu_spec)
{
    cJSON *tc = cohort("lr", "\"gpu\":{\"mode\":\"dra\",\"count\":99}");
    cJSON *pod = NULL;

    cr_assert_eq(reconcile_pod(tc, &env, NULL, 0, &pod), -EINVAL);
    cr_assert_null(pod);
    cJSON_Delete(tc);
}

Test(reconcile, gpu_template_asks_for_count_devices_of_the_class)
{
    cJSON *tc = cohort("lr", "\"gpu\":{\"mode\":\"dra\",\"count\":2,\"deviceClassName\":"
                             "\"gpu.example.com\"}");
    const cJSON *req;
    cJSON *t = NULL;

    cr_assert_eq(reconcile_gpu_template(tc, &t), 0);
    cr_assert_str_eq(sget(t, "apiVersion"), "resource.k8s.io/v1beta1");
    cr_assert_str_eq(sget(t, "kind"), "ResourceClaimTemplate");
    cr_assert_str_eq(sget(t, "metadata.name"), "lr-gpu");
    cr_assert_str_eq(sget(t, "metadata.namespace"), "ns");
    cr_assert_str_eq(dotted(t, "metadata.labels", RECONCILE_LABEL_COHORT), "lr");
    cr_assert_str_eq(sget(cJSON_GetArrayItem(sget_item(t, "metadata.ownerReferences"), 0), "uid"),
                     "u-1");
    cr_assert_eq(cJSON_GetArraySize(sget_item(t, "spec.spec.devices.requests")), 1);
    req = cJSON_GetArrayItem(sget_item(t, "spec.spec.devices.requests"), 0);
    cr_assert_str_eq(sget(req, "name"), RECONCILE_GPU_REQUEST);
    cr_assert_str_eq(sget(req, "deviceClassName"), "gpu.example.com");
    cr_assert_str_eq(sget(req, "allocationMode"), "ExactCount");
    cr_assert_eq(cJSON_GetObjectItem(req, "count")->valuedouble, 2);
    cJSON_Delete(t);
    cJSON_Delete(tc);
}

Test(reconcile, gpu_template_only_for_dra)
{
    cJSON *plain = cohort("lr", ""), *dp = cohort("lr", "\"gpu\":{\"mode\":\"devicePlugin\"}");
    cJSON *bad = cohort("lr", "\"gpu\":{\"mode\":\"dra\",\"count\":0}");
    cJSON *nouid = parse("{\"metadata\":{\"name\":\"lr\",\"namespace\":\"ns\"},\"spec\":{\"gpu\":"
                         "{\"mode\":\"dra\"}}}");
    cJSON *t = (cJSON *)1;

    cr_assert_eq(reconcile_gpu_template(plain, &t), -EINVAL);
    cr_assert_null(t);
    cr_assert_eq(reconcile_gpu_template(dp, &t), -EINVAL);
    cr_assert_eq(reconcile_gpu_template(bad, &t), -EINVAL);
    cr_assert_eq(reconcile_gpu_template(nouid, &t), -EINVAL);
    cr_assert_null(t);
    cJSON_Delete(plain);
    cJSON_Delete(dp);
    cJSON_Delete(bad);
    cJSON_Delete(nouid);
}

Test(reconcile, template_hash_covers_gpu_and_only_when_set)
{
    cJSON *plain = cohort("lr", ""), *a = cohort("lr", "\"gpu\":{\"mode\":\"dra\",\"count\":1}");
    cJSON *b = cohort("lr", "\"gpu\":{\"mode\":\"dra\",\"count\":2}");
    cJSON *c = cohort("lr", "\"gpu\":{\"mode\":\"devicePlugin\",\"count\":2}");
    cJSON *ck = cohort("lr", "\"checkpoint\":{" CKPT_HOSTPATH ",\"everyVersions\":50}");
    cJSON *both = cohort("lr", "\"checkpoint\":{" CKPT_HOSTPATH ",\"everyVersions\":50},"
                               "\"gpu\":{\"mode\":\"dra\",\"count\":1}");
    char h[6][RECONCILE_HASH_CHARS + 1];
    cJSON *all[6] = { plain, a, b, c, ck, both };

    for (int i = 0; i < 6; i++)
        cr_assert_eq(reconcile_template_hash(all[i], h[i]), 0);
    for (int i = 0; i < 6; i++)
        for (int j = i + 1; j < 6; j++)
            cr_assert_str_neq(h[i], h[j], "cohorts %d and %d must roll apart", i, j);
    for (int i = 0; i < 6; i++)
        cJSON_Delete(all[i]);
}

/* ---- spec.reduction.integrity ------------------------------------------- */

Test(reconcile, parse_reads_integrity_with_its_default)
{
    static const struct {
        const char *fields;
        bool mac;
    } cases[] = {
        { "", false },
        { "\"reduction\":{}", false },
        { "\"reduction\":{\"integrity\":\"none\"}", false },
        { "\"reduction\":{\"integrity\":\"mac\"}", true },
        { "\"reduction\":{\"algorithm\":\"ring\",\"integrity\":\"mac\"}", true },
    };

    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        cJSON *tc = cohort("lr", cases[i].fields);
        struct reconcile_spec s;
        struct reconcile_why why;

        cr_assert_eq(reconcile_parse(tc, &s, &why), 0, "%s: %s", cases[i].fields, why.message);
        cr_assert_eq(s.integrity_mac, cases[i].mac, "%s", cases[i].fields);
        cJSON_Delete(tc);
    }
}

/* Only the sidecar's two words, spelled exactly: anything else is refused
 * with a sentence that names the field, and no pod is made of it. */
Test(reconcile, bad_integrity_is_refused_and_renders_no_pod)
{
    static const char *const bad[] = {
        "\"integrity\":\"MAC\"", "\"integrity\":\"hmac\"", "\"integrity\":\"\"",
        "\"integrity\":\"mac \"", "\"integrity\":1", "\"integrity\":true",
        "\"integrity\":null", "\"integrity\":[\"mac\"]",
    };

    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        char fields[128];
        char hash[RECONCILE_HASH_CHARS + 1];
        struct reconcile_spec s;
        struct reconcile_why why;
        cJSON *tc, *pod = (cJSON *)1;

        snprintf(fields, sizeof(fields), "\"reduction\":{%s}", bad[i]);
        tc = cohort("lr", fields);
        cr_assert_eq(reconcile_parse(tc, &s, &why), -EINVAL, "%s should be refused", fields);
        cr_assert_str_eq(why.reason, "InvalidSpec");
        cr_assert(strstr(why.message, "spec.reduction.integrity must be none or mac"), "%s",
                  why.message);
        cr_assert_eq(reconcile_pod(tc, &env, "00ff00ff00ff00ff", 0, &pod), -EINVAL, "%s", fields);
        cr_assert_null(pod, "nothing rendered for %s", fields);
        cr_assert_eq(reconcile_template_hash(tc, hash), -EINVAL, "%s", fields);
        cJSON_Delete(tc);
    }
}

/* COHORT_INTEGRITY's value in container c, and how many times it is set. */
static const char *integrity_env(const cJSON *c, int *n)
{
    const cJSON *it;
    const char *v = NULL;

    *n = 0;
    cJSON_ArrayForEach(it, cJSON_GetObjectItem(c, "env"))
        if (strcmp(sget(it, "name"), "COHORT_INTEGRITY") == 0) {
            v = sget(it, "value");
            (*n)++;
        }
    return v;
}

/* mac: the sidecar is told --integrity mac (and has the key it needs),
 * every trainer container COHORT_INTEGRITY=mac in place of the
 * template's; none (or unset): no flag, and the trainers are told none,
 * whatever the template said. */
Test(reconcile, pod_renders_integrity_in_the_sidecar_and_every_trainer)
{
    static const struct {
        const char *reduction, *want;
    } cases[] = {
        { "{\"integrity\":\"mac\"}", "mac" },
        { "{\"integrity\":\"none\"}", "none" },
        { "{}", "none" },
    };

    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        char buf[1024], args[1024];
        const cJSON *spec, *side, *c;
        const char *at;
        cJSON *tc, *pod = NULL;
        int n, trainers = 0;

        snprintf(buf, sizeof(buf),
                 "{\"metadata\":{\"name\":\"lr\",\"namespace\":\"ns\",\"uid\":\"u\"},"
                 "\"spec\":{\"reduction\":%s,\"template\":{\"spec\":{\"containers\":["
                 "{\"name\":\"a\",\"env\":[{\"name\":\"COHORT_INTEGRITY\",\"value\":\"%s\"}]},"
                 "{\"name\":\"b\"}]}}}}", cases[i].reduction,
                 strcmp(cases[i].want, "mac") == 0 ? "none" : "mac");
        tc = parse(buf);
        cr_assert_eq(reconcile_pod(tc, &env, "00ff00ff00ff00ff", 0, &pod), 0, "%s", buf);
        sidecar_args(pod, args, sizeof(args));
        at = strstr(args, "--integrity");
        if (strcmp(cases[i].want, "mac") == 0)
            cr_assert(at && strncmp(at, "--integrity mac", 15) == 0 &&
                      !strstr(at + 1, "--integrity"), "once, with mac: %s", args);
        else
            cr_assert_null(at, "%s: %s", cases[i].reduction, args);
        spec = cJSON_GetObjectItem(pod, "spec");
        side = cJSON_GetArrayItem(cJSON_GetObjectItem(spec, "initContainers"), 0);
        cr_assert(has_env(side, "COHORT_SECRET_FILE"), "the key --integrity mac needs");
        cr_assert_not(has_env(side, "COHORT_INTEGRITY"), "the sidecar's flag decides");
        cJSON_ArrayForEach(c, cJSON_GetObjectItem(spec, "containers")) {
            const char *v = integrity_env(c, &n);
            cr_assert_eq(n, 1, "%s: one COHORT_INTEGRITY in %s", cases[i].reduction,
                         sget(c, "name"));
            cr_assert_str_eq(v, cases[i].want, "%s in %s", cases[i].reduction, sget(c, "name"));
            trainers++;
        }
        cr_assert_eq(trainers, 2);
        cJSON_Delete(pod);
        cJSON_Delete(tc);
    }
}

/* mac is in the template hash, so that a change replaces every pod (old
 * and new members would refuse each other); none, written or defaulted,
 * leaves the hash as it was before the field existed. */
Test(reconcile, template_hash_covers_integrity_mac_only)
{
    cJSON *plain = cohort("lr", ""), *none = cohort("lr", "\"reduction\":{\"integrity\":\"none\"}");
    cJSON *mac = cohort("lr", "\"reduction\":{\"integrity\":\"mac\"}");
    cJSON *ck = cohort("lr", "\"checkpoint\":{" CKPT_HOSTPATH ",\"everyVersions\":50}");
    cJSON *ck_mac = cohort("lr", "\"checkpoint\":{" CKPT_HOSTPATH ",\"everyVersions\":50},"
                                 "\"reduction\":{\"integrity\":\"mac\"}");
    char hp[RECONCILE_HASH_CHARS + 1], hn[RECONCILE_HASH_CHARS + 1];
    char hm[RECONCILE_HASH_CHARS + 1], hc[RECONCILE_HASH_CHARS + 1];
    char hcm[RECONCILE_HASH_CHARS + 1];
    cJSON *pod = NULL;

    cr_assert_eq(reconcile_template_hash(plain, hp), 0);
    cr_assert_eq(reconcile_template_hash(none, hn), 0);
    cr_assert_eq(reconcile_template_hash(mac, hm), 0);
    cr_assert_eq(reconcile_template_hash(ck, hc), 0);
    cr_assert_eq(reconcile_template_hash(ck_mac, hcm), 0);
    cr_assert_str_eq(hp, hn, "none is the default: no roll");
    cr_assert_str_neq(hp, hm, "none to mac rolls the pods");
    cr_assert_str_neq(hc, hcm, "with spec.checkpoint too");
    cr_assert_str_neq(hm, hcm);
    cr_assert_eq(reconcile_pod(mac, &env, NULL, 0, &pod), 0);
    cr_assert_str_eq(dotted(pod, "metadata.labels", RECONCILE_LABEL_TEMPLATE_HASH), hm,
                     "the pod carries the hash that covers mac");
    cJSON_Delete(pod);
    cJSON_Delete(plain);
    cJSON_Delete(none);
    cJSON_Delete(mac);
    cJSON_Delete(ck);
    cJSON_Delete(ck_mac);
}

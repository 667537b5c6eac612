/* tests/fuzz/fuzz_reconcile.c: Kubernetes JSON into the operator's
 * decisions (src/k8s/reconcile.h), the path every TrainingCohort and pod
 * the API server sends takes: parse and check the spec, make the pods,
 * read pods back into views, plan, build the status and its patch.
 *
 * Input: JSON. An array is [TrainingCohort, pod, pod, ...]; anything else
 * is a TrainingCohort with no pods. The broker's view, which the operator
 * gets from the broker, comes from the cohort's own status.members (ids
 * there are as untrusted as anything a member sends).
 *
 * Invariants: a refusal has a reason; an accepted spec is within the
 * CRD's bounds; a pod made for ordinal o is named <cohort>-o, reads back
 * as ordinal o, carries the sidecar first among its init containers and
 * the operator's COHORT_* variables once in every container; the plan
 * creates exactly the wanted ordinals that no pod holds, replaces only
 * failed pods at wanted ordinals and never beyond spec.maxRestarts,
 * drains exactly the pods at other ordinals; the status is an object whose
 * conditions are True or False, that equals itself, and that prints and
 * parses back the same. */
#include "fuzz.h"

#include <errno.h>

#include "k8s/reconcile.h"

#define NOW "2024-05-01T12:00:00Z"

static const struct reconcile_env env = {
    .broker_address = "cohort-broker.cohort-system.svc:7070",
    .sidecar_image = "ghcr.io/cohort-dev/cohort:0.1.0",
    .sidecar_pull_policy = "IfNotPresent",
    .sidecar_command = "cohort-sidecar",
    .broker_server_name = "cohort-broker.cohort-system.svc",
};

static const cJSON *get(const cJSON *o, const char *k)
{
    return cJSON_GetObjectItemCaseSensitive(o, k);
}

static const char *str(const cJSON *o, const char *k)
{
    const cJSON *v = get(o, k);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

/* The number of entries of array `arr` with name `name`. */
static int named(const cJSON *arr, const char *name)
{
    const cJSON *it;
    int n = 0;

    cJSON_ArrayForEach(it, arr) {
        const char *s = str(it, "name");
        n += s && strcmp(s, name) == 0;
    }
    return n;
}

static void check_pod(const cJSON *tc, const char *name, uint32_t ordinal)
{
    const char *ours[] = { "COHORT_SOCKET", "COHORT_COHORT", "COHORT_ID", "COHORT_BROKER",
                           "COHORT_POD_IP" };
    struct reconcile_pod_view v;
    cJSON *pod = NULL;
    const cJSON *spec, *c;
    char want[320];
    const char *key_id = ordinal % 2 ? "k-0123456789abcdef" : NULL;
    int rc = reconcile_pod(tc, &env, key_id, ordinal, &pod);

    CHECK(rc == 0 || rc == -EINVAL || rc == -ENOMEM);
    CHECK((rc == 0) == (pod != NULL));
    if (rc < 0)
        return;
    snprintf(want, sizeof(want), "%s-%u", name, ordinal);
    CHECK(strcmp(str(get(pod, "metadata"), "name"), want) == 0);
    CHECK(strcmp(str(get(get(pod, "metadata"), "labels"), RECONCILE_LABEL_COHORT), name) == 0);
    CHECK(reconcile_view(name, pod, &v) == 0);
    CHECK(v.ordinal == (long)ordinal && v.phase == RECONCILE_POD_PENDING);
    spec = get(pod, "spec");
    CHECK(strcmp(str(cJSON_GetArrayItem(get(spec, "initContainers"), 0), "name"),
                 RECONCILE_SIDECAR) == 0);
    CHECK(named(get(spec, "volumes"), RECONCILE_VOLUME) == 1);
    cJSON_ArrayForEach(c, get(spec, "containers")) {
        if (!cJSON_IsObject(c))
            continue;
        for (size_t i = 0; i < sizeof(ours) / sizeof(ours[0]); i++)
            CHECK(named(get(c, "env"), ours[i]) == 1);
        /* The key is the sidecar's alone. */
        CHECK(named(get(c, "env"), "COHORT_SECRET_FILE") == 0);
    }
    c = cJSON_GetArrayItem(get(spec, "initContainers"), 0);
    CHECK(named(get(c, "env"), "COHORT_SECRET_FILE") == 1);
    CHECK(!key_id || strcmp(str(get(get(pod, "metadata"), "annotations"), "cohort.dev/key-id"),
                            key_id) == 0);
    cJSON_Delete(pod);
}

static void check_plan(const struct reconcile_spec *s, uint32_t restarts,
                       const struct reconcile_pod_view *v, size_t n, const struct reconcile_plan *p)
{
    static bool held[RECONCILE_REPLICAS_MAX];
    size_t terminating = 0, excess = 0, failed_wanted = 0, k = 0, waiting = 0;
    uint32_t running = 0, min_wait = 0, taken = 0, newly = 0, floor;

    CHECK(p->want == (s->suspend ? 0 : s->replicas));
    memset(held, 0, sizeof(held));
    for (size_t i = 0; i < n; i++) {
        bool wanted = v[i].ordinal >= 0 && (uint32_t)v[i].ordinal < p->want;
        terminating += v[i].phase == RECONCILE_POD_TERMINATING;
        excess += v[i].phase != RECONCILE_POD_TERMINATING && !wanted;
        failed_wanted += v[i].phase == RECONCILE_POD_FAILED && wanted;
        /* The first pod that holds an ordinal counts (names are unique in
         * a cluster; inputs may repeat them). */
        if (wanted && v[i].phase != RECONCILE_POD_TERMINATING && !held[v[i].ordinal]) {
            held[v[i].ordinal] = true;
            running += v[i].phase == RECONCILE_POD_RUNNING;
        }
        if (v[i].phase == RECONCILE_POD_FAILED && wanted && v[i].backoff_ms) {
            waiting++;
            min_wait = !min_wait || v[i].backoff_ms < min_wait ? v[i].backoff_ms : min_wait;
        }
    }
    /* A failed pod in back-off is neither replaced nor counted yet. */
    CHECK(p->backing_off == waiting && p->requeue_ms == min_wait);
    for (size_t i = 0; i < p->n_replace; i++)
        CHECK(v[p->replace[i]].backoff_ms == 0);
    /* Rollout: only outdated wanted pods that no other rule takes, each
     * once; drains under way and Pending pods always, Running ones only
     * within maxUnavailable and above the floor of running pods. */
    CHECK(p->updated + p->outdated <= p->want);
    CHECK(!p->failed || p->n_update == 0);
    floor = s->replicas > s->min_replicas ? s->min_replicas : s->min_replicas - 1;
    for (size_t i = 0; i < p->n_update; i++) {
        const struct reconcile_pod_view *u = &v[p->update[i]];
        CHECK(p->update[i] < n && u->outdated && !u->stale && u->ordinal >= 0 &&
              (uint32_t)u->ordinal < p->want);
        CHECK(u->phase == RECONCILE_POD_RUNNING || u->phase == RECONCILE_POD_PENDING);
        for (size_t j = 0; j < i; j++)
            CHECK(p->update[j] != p->update[i]);
        if (u->phase == RECONCILE_POD_RUNNING && u->draining)
            taken++;
        else if (u->phase == RECONCILE_POD_RUNNING)
            newly++;
    }
    CHECK(newly == 0 || (p->want - running) + taken + newly <= s->max_unavailable);
    CHECK(newly == 0 || running - taken - newly >= floor);
    CHECK(p->terminating == terminating && p->n_excess == excess);
    CHECK(p->failed_pods == failed_wanted && p->blocked <= p->want);
    /* Exactly the wanted ordinals no pod holds, each once, in order. */
    memset(held, 0, sizeof(held));
    for (size_t i = 0; i < n; i++)
        if (v[i].ordinal >= 0 && v[i].ordinal < (long)RECONCILE_REPLICAS_MAX)
            held[v[i].ordinal] = true;
    for (uint32_t o = 0; o < p->want; o++) {
        if (held[o])
            continue;
        CHECK(k < p->n_create && p->create[k] == o);
        k++;
    }
    CHECK(k == p->n_create);
    for (size_t i = 0; i < p->n_replace; i++) {
        CHECK(p->replace[i] < n && v[p->replace[i]].phase == RECONCILE_POD_FAILED);
        CHECK(i == 0 || p->replace[i] > p->replace[i - 1]);
    }
    for (size_t i = 0; i < p->n_excess; i++) {
        const struct reconcile_pod_view *e = &v[p->excess[i]];
        CHECK(p->excess[i] < n && e->phase != RECONCILE_POD_TERMINATING);
        CHECK(e->ordinal < 0 || (uint32_t)e->ordinal >= p->want);
        CHECK(i == 0 || p->excess[i] > p->excess[i - 1]);
    }
    /* Never beyond spec.maxRestarts. */
    CHECK((uint64_t)restarts + p->n_replace <= s->max_restarts || p->n_replace == 0);
    CHECK(p->failed == ((uint64_t)restarts + failed_wanted - waiting > s->max_restarts));
    CHECK(!p->complete || p->want > 0);
}

static void check_status(const cJSON *st, const cJSON *old)
{
    const cJSON *c;
    cJSON *patch, *again;
    char *text;

    CHECK(cJSON_IsObject(st));
    CHECK(cJSON_IsArray(get(st, "conditions")));
    cJSON_ArrayForEach(c, get(st, "conditions")) {
        const char *status = str(c, "status");
        CHECK(str(c, "type") && str(c, "reason") && str(c, "lastTransitionTime"));
        CHECK(status && (strcmp(status, "True") == 0 || strcmp(status, "False") == 0));
    }
    CHECK(!reconcile_status_differs(st, st, false) && !reconcile_status_differs(st, st, true));
    CHECK(reconcile_status_differs(st, NULL, false));
    patch = reconcile_status_patch(old, st);
    if (patch) {
        const cJSON *it, *ps = get(patch, "status");
        CHECK(cJSON_IsObject(ps));
        cJSON_ArrayForEach(it, old)
            CHECK(!it->string || get(ps, it->string));
        cJSON_Delete(patch);
    }
    text = cJSON_PrintUnformatted(st);
    if (!text)
        return;
    again = cJSON_Parse(text);
    CHECK(again && cJSON_Compare(st, again, 1));
    cJSON_Delete(again);
    cJSON_free(text);
}

/* The broker's members, as the operator would hand them over. */
static size_t members_of(const cJSON *status, struct reconcile_member *m, size_t cap)
{
    const cJSON *it;
    size_t n = 0;

    cJSON_ArrayForEach(it, get(status, "members")) {
        const cJSON *mv = get(it, "modelVersion");
        if (n == cap || !str(it, "id"))
            continue;
        m[n++] = (struct reconcile_member){
            .id = str(it, "id"), .address = str(it, "address"),
            .model_version = cJSON_IsNumber(mv) && mv->valuedouble >= 0 &&
                                     mv->valuedouble < 1e18 ? (uint64_t)mv->valuedouble : 0,
            .draining = cJSON_IsTrue(get(it, "draining")),
        };
    }
    return n;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    cJSON *root = cJSON_ParseWithLength((const char *)data, size), *st;
    const cJSON *tc, *it, *old, *gen;
    struct reconcile_pod_view views[64];
    struct reconcile_member members[64];
    struct reconcile_observed obs = { 0 };
    struct reconcile_plan plan;
    struct reconcile_spec spec;
    struct reconcile_why why;
    const char *name;
    char sel[512], hash[RECONCILE_HASH_CHARS + 1];
    size_t n = 0;
    uint32_t restarts = 0;
    int rc;

    if (!root)
        return 0;
    tc = cJSON_IsArray(root) ? cJSON_GetArrayItem(root, 0) : root;
    old = get(tc, "status");
    if (cJSON_IsNumber(get(old, "restarts")) && get(old, "restarts")->valuedouble >= 0 &&
        get(old, "restarts")->valuedouble <= UINT32_MAX)
        restarts = (uint32_t)get(old, "restarts")->valuedouble;
    gen = get(get(tc, "metadata"), "generation");
    obs.generation = cJSON_IsNumber(gen) && gen->valuedouble > -1e15 && gen->valuedouble < 1e15
                         ? (int64_t)gen->valuedouble : 0;
    obs.restarts = restarts;
    obs.n_members = members_of(old, members, 64);
    obs.members = members;
    obs.leader = str(old, "leader");
    obs.epoch = obs.n_members;
    obs.broker_known = obs.n_members > 0;

    rc = reconcile_parse(tc, &spec, &why);
    CHECK(rc == 0 || rc == -EINVAL);
    CHECK(memchr(why.reason, '\0', sizeof(why.reason)) &&
          memchr(why.message, '\0', sizeof(why.message)));
    if (rc < 0) {
        CHECK(why.reason[0] && why.message[0]);
        obs.invalid = &why;
        st = reconcile_status(&spec, &obs, old, NOW);
        if (st)
            check_status(st, old);
        cJSON_Delete(st);
        goto out;
    }
    CHECK(!why.reason[0]);
    CHECK(spec.min_replicas >= 1 && spec.min_replicas <= spec.replicas &&
          spec.replicas <= RECONCILE_REPLICAS_MAX);
    CHECK(spec.heartbeat_ms >= 1 && spec.timeout_ms > spec.heartbeat_ms &&
          spec.timeout_ms <= 3600u * 1000);
    name = str(get(tc, "metadata"), "name");
    CHECK(name && *name);
    /* One pod per input, the first or the last, for speed. */
    check_pod(tc, name, size % 2 ? spec.replicas - 1 : 0);

    cJSON_ArrayForEach(it, root) {
        if (it == tc || !cJSON_IsArray(root) || n == 64)
            continue;
        rc = reconcile_view(name, it, &views[n]);
        CHECK(rc == 0 || rc == -EINVAL);
        if (rc == 0) {
            CHECK(views[n].ordinal >= -1 && views[n].ordinal < (long)RECONCILE_REPLICAS_MAX);
            /* What the controller sets, from the input: the template hash
             * as it would, drains and back-offs from the input's size. */
            views[n].outdated = !views[n].template_hash ||
                                reconcile_template_hash(tc, hash) < 0 ||
                                strcmp(views[n].template_hash, hash) != 0;
            views[n].draining = (size >> (n % 16)) & 1;
            if (views[n].phase == RECONCILE_POD_FAILED && ((size >> ((n + 3) % 16)) & 1))
                views[n].backoff_ms = 1000 * (uint32_t)(n + 1);
            n++;
        }
    }
    if (reconcile_plan(&spec, restarts, views, n, &plan) < 0)
        goto out;
    check_plan(&spec, restarts, views, n, &plan);
    if (reconcile_selector(name, sel, sizeof(sel)) == 0)
        obs.selector = sel;
    obs.pods = (uint32_t)(n - plan.terminating);
    obs.draining = (uint32_t)plan.n_excess;
    obs.plan = &plan;
    st = reconcile_status(&spec, &obs, old, NOW);
    if (st)
        check_status(st, old);
    cJSON_Delete(st);
    reconcile_plan_cleanup(&plan);
out:
    cJSON_Delete(root);
    return 0;
}

/* src/k8s/reconcile.c: see reconcile.h. */
#include "k8s/reconcile.h"

#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/ident.h"
#include "base/limits.h"
#include "base/opt.h"

#define DURATION_MAX_MS (3600ull * 1000)

static const cJSON *get(const cJSON *o, const char *k)
{
    return cJSON_GetObjectItemCaseSensitive(o, k);
}

static const char *str(const cJSON *o, const char *k)
{
    const cJSON *v = get(o, k);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

static int refuse(struct reconcile_why *why, const char *reason, const char *fmt, ...)
{
    va_list ap;

    snprintf(why->reason, sizeof(why->reason), "%s", reason);
    va_start(ap, fmt);
    vsnprintf(why->message, sizeof(why->message), fmt, ap);
    va_end(ap);
    return -EINVAL;
}

/* An integer field in [lo, hi], or `def` when absent. */
static int int_field(const cJSON *spec, const char *k, long def, long lo, long hi, long *out)
{
    const cJSON *v = get(spec, k);

    if (!v) {
        *out = def;
        return 0;
    }
    /* The range first: converting a double outside long's range (1e300,
     * NaN) is undefined behaviour. lo and hi are far inside it. */
    if (!cJSON_IsNumber(v) || !(v->valuedouble >= (double)lo && v->valuedouble <= (double)hi) ||
        v->valuedouble != (double)(long)v->valuedouble)
        return -EINVAL;
    *out = (long)v->valuedouble;
    return 0;
}

static int duration_field(const cJSON *t, const char *k, uint32_t def, uint32_t *out)
{
    const char *s = str(t, k);
    uint64_t ms;

    if (!get(t, k)) {
        *out = def;
        return 0;
    }
    if (!s || opt_duration_ms(s, DURATION_MAX_MS, &ms) < 0 || ms == 0)
        return -EINVAL;
    *out = (uint32_t)ms;
    return 0;
}

/* spec.reduction.<key>'s static spelling among names[0..n) (names[0],
 * the CRD's default, when absent), or NULL when it is none of them. */
static const char *reduction_choice(const cJSON *spec, const char *key,
                                    const char *const *names, size_t n)
{
    const cJSON *v = get(get(spec, "reduction"), key);

    if (!v)
        return names[0];
    for (size_t i = 0; cJSON_IsString(v) && i < n; i++)
        if (strcmp(v->valuestring, names[i]) == 0)
            return names[i];
    return NULL;
}

/* spec.reduction.algorithm: the sidecar's --allreduce. */
static const char *algorithm_field(const cJSON *spec)
{
    static const char *const names[] = { "auto", "ring", "doubling" };

    return reduction_choice(spec, "algorithm", names, sizeof(names) / sizeof(names[0]));
}

/* spec.reduction.integrity: "none" (absent too) or "mac", the sidecar's
 * --integrity; NULL for anything else. */
static const char *integrity_field(const cJSON *spec)
{
    static const char *const names[] = { "none", "mac" };

    return reduction_choice(spec, "integrity", names, sizeof(names) / sizeof(names[0]));
}

/* "topk:RATIO"'s RATIO: a decimal in (0, 1], a leading 0 or 1 (or none),
 * at most six fraction digits. */
static bool topk_ratio_ok(const char *s)
{
    bool digits = false, one = false, nonzero = false;
    int frac = 0;

    if (*s == '0' || *s == '1') {
        one = *s == '1';
        nonzero = one;
        digits = true;
        s++;
    }
    if (*s == '.')
        for (s++; *s >= '0' && *s <= '9'; s++) {
            if (++frac > 6 || (one && *s != '0'))
                return false;
            nonzero = nonzero || *s != '0';
            digits = true;
        }
    return !*s && digits && nonzero;
}

/* "powersgd:RANK"'s RANK: 1 to 1024, digits only. */
static bool powersgd_rank_ok(const char *s)
{
    unsigned long v = 0;

    if (!*s)
        return false;
    for (; *s; s++) {
        if (*s < '0' || *s > '9')
            return false;
        v = v * 10 + (unsigned long)(*s - '0');
        if (v > 1024)
            return false;
    }
    return v >= 1;
}

/* spec.reduction.compression: the sidecar's --compression, checked by
 * the sidecar's own rules (accumulator/compress.h, which this layer may
 * not include; tests/unit/test_reconcile.c holds the two to the same
 * answers): a codec name, "topk" or "topk:RATIO", "powersgd" or
 * "powersgd:RANK". "none" when absent; NULL when not one of them. The
 * string is the object's (borrowed). */
static const char *compression_field(const cJSON *spec)
{
    static const char *const names[] = { "none", "fp16", "bf16", "int8", "topk", "powersgd" };
    const cJSON *v = get(get(spec, "reduction"), "compression");
    const char *choice = reduction_choice(spec, "compression", names, sizeof(names) / sizeof(names[0]));

    if (choice || !cJSON_IsString(v))
        return choice;
    if (strncmp(v->valuestring, "topk:", 5) == 0 && topk_ratio_ok(v->valuestring + 5))
        return v->valuestring;
    if (strncmp(v->valuestring, "powersgd:", 9) == 0 && powersgd_rank_ok(v->valuestring + 9))
        return v->valuestring;
    return NULL;
}

/* The one source of spec.checkpoint.volume (its key), or NULL when it
 * has none, more than one, or one that Kubernetes mounts read-only. */
static const cJSON *ckpt_source(const cJSON *vol)
{
    static const char *const read_only[] = { "configMap", "secret", "downwardAPI", "projected",
                                             "image" };

    if (!cJSON_IsObject(vol) || cJSON_GetArraySize(vol) != 1 || !cJSON_IsObject(vol->child))
        return NULL;
    for (size_t i = 0; i < sizeof(read_only) / sizeof(read_only[0]); i++)
        if (strcmp(vol->child->string, read_only[i]) == 0)
            return NULL;
    return vol->child;
}

static int parse_checkpoint(const cJSON *ck, struct reconcile_spec *s, struct reconcile_why *why)
{
    long v;

    if (!ck)
        return 0;
    if (!cJSON_IsObject(ck))
        return refuse(why, "InvalidCheckpoint", "spec.checkpoint must be an object");
    if (!ckpt_source(get(ck, "volume")))
        return refuse(why, "InvalidCheckpoint", "spec.checkpoint.volume must name exactly one "
                      "writable volume source (persistentVolumeClaim, hostPath, nfs, emptyDir, "
                      "...)");
    if (int_field(ck, "everyVersions", 0, 1, RECONCILE_VBS_MAX, &v) < 0)
        return refuse(why, "InvalidCheckpoint", "spec.checkpoint.everyVersions must be an "
                      "integer from 1 to %lld", RECONCILE_VBS_MAX);
    s->ckpt_every_versions = (uint64_t)v;
    if (int_field(ck, "everySeconds", 0, 1, RECONCILE_CKPT_SECONDS_MAX, &v) < 0)
        return refuse(why, "InvalidCheckpoint", "spec.checkpoint.everySeconds must be an "
                      "integer from 1 to %d", RECONCILE_CKPT_SECONDS_MAX);
    s->ckpt_every_s = (uint32_t)v;
    if (!s->ckpt_every_versions && !s->ckpt_every_s)
        return refuse(why, "InvalidCheckpoint", "spec.checkpoint needs a period: everyVersions, "
                      "everySeconds or both");
    if (int_field(ck, "keep", RECONCILE_CKPT_KEEP_DEFAULT, 1, RECONCILE_CKPT_KEEP_MAX, &v) < 0)
        return refuse(why, "InvalidCheckpoint", "spec.checkpoint.keep must be an integer from 1 "
                      "to %d", RECONCILE_CKPT_KEEP_MAX);
    s->ckpt_keep = (uint32_t)v;
    s->checkpoint = true;
    return 0;
}

/* A DNS subdomain (RFC 1123), what Kubernetes names a DeviceClass with. */
static bool dns_subdomain(const char *s)
{
    size_t n = strlen(s);

    if (n == 0 || n > 253)
        return false;
    for (size_t i = 0; i < n; i++) {
        char ch = s[i];
        bool alnum = (ch >= 'a' && ch <= 'z') || (ch >= '0' && ch <= '9');
        if (!alnum && ch != '-' && ch != '.')
            return false;
        if (!alnum && (i == 0 || i == n - 1 || s[i - 1] == '.' || (ch == '.' && s[i - 1] == '-')))
            return false;
    }
    return true;
}

static int parse_gpu(const cJSON *g, struct reconcile_spec *s, struct reconcile_why *why)
{
    const char *mode = str(g, "mode");
    const cJSON *cls = get(g, "deviceClassName"), *red = get(g, "reduce");
    long v;

    if (!g)
        return 0;
    if (!cJSON_IsObject(g))
        return refuse(why, "InvalidGPU", "spec.gpu must be an object");
    if (mode && strcmp(mode, "dra") == 0)
        s->gpu_mode = RECONCILE_GPU_DRA;
    else if (mode && strcmp(mode, "devicePlugin") == 0)
        s->gpu_mode = RECONCILE_GPU_DEVICE_PLUGIN;
    else
        return refuse(why, "InvalidGPU", "spec.gpu.mode must be dra or devicePlugin");
    if (int_field(g, "count", 1, 1, RECONCILE_GPU_MAX, &v) < 0)
        return refuse(why, "InvalidGPU", "spec.gpu.count must be an integer from 1 to %d",
                      RECONCILE_GPU_MAX);
    s->gpu_count = (uint32_t)v;
    if (cls && s->gpu_mode != RECONCILE_GPU_DRA)
        return refuse(why, "InvalidGPU", "spec.gpu.deviceClassName is only for mode dra");
    if (cls && (!cJSON_IsString(cls) || !dns_subdomain(cls->valuestring)))
        return refuse(why, "InvalidGPU", "spec.gpu.deviceClassName must be a DNS subdomain "
                      "(lower case letters, digits, '-' and '.'), at most 253 characters");
    if (s->gpu_mode == RECONCILE_GPU_DRA)
        s->gpu_class = cls ? cls->valuestring : RECONCILE_GPU_CLASS_DEFAULT;
    /* Only with dra does the sidecar see the GPU and so reduce anything
     * of it; with devicePlugin the field would change nothing. */
    if (red && s->gpu_mode != RECONCILE_GPU_DRA)
        return refuse(why, "InvalidGPU", "spec.gpu.reduce is only for mode dra");
    if (red && !(cJSON_IsString(red) && (strcmp(red->valuestring, "nccl") == 0 ||
                                         strcmp(red->valuestring, "host") == 0)))
        return refuse(why, "InvalidGPU", "spec.gpu.reduce must be nccl or host");
    if (s->gpu_mode == RECONCILE_GPU_DRA)
        s->gpu_reduce = !red ? RECONCILE_GPU_REDUCE_DEFAULT
                        : strcmp(red->valuestring, "host") == 0 ? "host" : "nccl";
    return 0;
}

static bool has_named(const cJSON *arr, const char *name)
{
    const cJSON *it;

    cJSON_ArrayForEach(it, arr) {
        const char *n = str(it, "name");
        if (n && strcmp(n, name) == 0)
            return true;
    }
    return false;
}

int reconcile_parse(const cJSON *tc, struct reconcile_spec *s, struct reconcile_why *why)
{
    const cJSON *meta = get(tc, "metadata"), *spec = get(tc, "spec"), *tmpl, *pspec, *conts;
    const char *name = str(meta, "name"), *integrity;
    long v;

    memset(s, 0, sizeof(*s));
    memset(why, 0, sizeof(*why));
    if (!name || !*name)
        return refuse(why, "InvalidSpec", "the cohort has no name");
    /* The name is a label value on every pod (63 bytes at most). */
    if (strlen(name) > LIMIT_KUBE_LABEL_MAX)
        return refuse(why, "NameTooLong", "the cohort name is %zu characters; at most %d fit in "
                      "the cohort.dev/cohort label of its pods", strlen(name), LIMIT_KUBE_LABEL_MAX);
    if (!cJSON_IsObject(spec))
        return refuse(why, "InvalidSpec", "spec is missing");
    if (int_field(spec, "replicas", 1, 1, RECONCILE_REPLICAS_MAX, &v) < 0)
        return refuse(why, "InvalidReplicas", "spec.replicas must be an integer from 1 to %u",
                      RECONCILE_REPLICAS_MAX);
    s->replicas = (uint32_t)v;
    if (int_field(spec, "minReplicas", 1, 1, RECONCILE_REPLICAS_MAX, &v) < 0)
        return refuse(why, "InvalidReplicas", "spec.minReplicas must be an integer from 1 to %u",
                      RECONCILE_REPLICAS_MAX);
    s->min_replicas = (uint32_t)v;
    if (s->replicas < s->min_replicas)
        return refuse(why, "InvalidReplicas", "spec.replicas (%u) is below spec.minReplicas (%u)",
                      s->replicas, s->min_replicas);
    if (int_field(spec, "maxReplicas", RECONCILE_REPLICAS_MAX, 1, RECONCILE_REPLICAS_MAX, &v) < 0 ||
        (uint32_t)v < s->replicas)
        return refuse(why, "InvalidReplicas", "spec.replicas (%u) is above spec.maxReplicas",
                      s->replicas);
    if (int_field(spec, "maxRestarts", 10, 0, INT32_MAX, &v) < 0)
        return refuse(why, "InvalidSpec", "spec.maxRestarts must be a non-negative integer");
    s->max_restarts = (uint32_t)v;
    if (get(spec, "rollout") && !cJSON_IsObject(get(spec, "rollout")))
        return refuse(why, "InvalidSpec", "spec.rollout must be an object");
    if (int_field(get(spec, "rollout"), "maxUnavailable", 1, 1, RECONCILE_REPLICAS_MAX, &v) < 0)
        return refuse(why, "InvalidSpec", "spec.rollout.maxUnavailable must be an integer from 1 "
                      "to %u", RECONCILE_REPLICAS_MAX);
    s->max_unavailable = (uint32_t)v;
    s->suspend = cJSON_IsTrue(get(spec, "suspend"));
    if (duration_field(get(spec, "timeouts"), "heartbeatInterval", 1000, &s->heartbeat_ms) < 0 ||
        duration_field(get(spec, "timeouts"), "memberTimeout", 5000, &s->timeout_ms) < 0)
        return refuse(why, "InvalidTimeouts", "spec.timeouts must be durations such as 500ms or "
                      "5s, up to 1h");
    if (s->timeout_ms <= s->heartbeat_ms)
        return refuse(why, "InvalidTimeouts", "spec.timeouts.memberTimeout must be longer than "
                      "spec.timeouts.heartbeatInterval");
    if (int_field(get(spec, "accumulator"), "virtualBatchSize", 0, 1, RECONCILE_VBS_MAX, &v) < 0)
        return refuse(why, "InvalidSpec", "spec.accumulator.virtualBatchSize must be an integer "
                      "from 1 to %lld", RECONCILE_VBS_MAX);
    s->virtual_batch_size = (uint64_t)v;
    if (int_field(get(spec, "accumulator"), "parallelGradients", 0, 1, RECONCILE_PARALLEL_MAX,
                  &v) < 0)
        return refuse(why, "InvalidSpec", "spec.accumulator.parallelGradients must be an integer "
                      "from 1 to %d", RECONCILE_PARALLEL_MAX);
    s->parallel_gradients = (uint32_t)v;
    s->algorithm = algorithm_field(spec);
    if (!s->algorithm)
        return refuse(why, "InvalidSpec", "spec.reduction.algorithm must be auto, ring or "
                      "doubling");
    s->compression = compression_field(spec);
    if (!s->compression)
        return refuse(why, "InvalidSpec", "spec.reduction.compression must be none, fp16, bf16, "
                      "int8, topk:RATIO (0 < RATIO <= 1, six decimals at most) or "
                      "powersgd:RANK (1 to 1024)");
    /* Every pod's sidecar has the cohort's key (the operator makes the
     * Secret before any pod, and refuses the cohort when it cannot), so
     * mac never lacks the key it needs. */
    integrity = integrity_field(spec);
    if (!integrity)
        return refuse(why, "InvalidSpec", "spec.reduction.integrity must be none or mac");
    s->integrity_mac = strcmp(integrity, "mac") == 0;
    if (parse_checkpoint(get(spec, "checkpoint"), s, why) < 0)
        return -EINVAL;
    if (parse_gpu(get(spec, "gpu"), s, why) < 0)
        return -EINVAL;
    tmpl = get(spec, "template");
    pspec = get(tmpl, "spec");
    conts = get(pspec, "containers");
    if (!cJSON_IsArray(conts) || cJSON_GetArraySize(conts) == 0)
        return refuse(why, "InvalidTemplate", "spec.template.spec.containers must name at least "
                      "one container");
    if (has_named(conts, RECONCILE_SIDECAR) || has_named(get(pspec, "initContainers"),
                                                         RECONCILE_SIDECAR))
        return refuse(why, "InvalidTemplate", "the container name %s is reserved for the injected "
                      "sidecar", RECONCILE_SIDECAR);
    if (has_named(get(pspec, "volumes"), RECONCILE_VOLUME))
        return refuse(why, "InvalidTemplate", "the volume name %s is reserved for the sidecar's "
                      "socket", RECONCILE_VOLUME);
    if (has_named(get(pspec, "volumes"), RECONCILE_KEY_VOLUME))
        return refuse(why, "InvalidTemplate", "the volume name %s is reserved for the cohort's "
                      "key", RECONCILE_KEY_VOLUME);
    if (has_named(get(pspec, "volumes"), RECONCILE_CKPT_VOLUME))
        return refuse(why, "InvalidTemplate", "the volume name %s is reserved for the cohort's "
                      "checkpoints", RECONCILE_CKPT_VOLUME);
    if (has_named(get(pspec, "resourceClaims"), RECONCILE_GPU_CLAIM))
        return refuse(why, "InvalidTemplate", "the resource claim name %s is reserved for the "
                      "cohort's GPUs", RECONCILE_GPU_CLAIM);
    return 0;
}

/* ---- the pod ------------------------------------------------------------ */

static cJSON *env_value(const char *name, const char *value)
{
    cJSON *e = cJSON_CreateObject();

    cJSON_AddStringToObject(e, "name", name);
    cJSON_AddStringToObject(e, "value", value);
    return e;
}

static cJSON *env_field(const char *name, const char *path)
{
    cJSON *e = cJSON_CreateObject(), *from = cJSON_AddObjectToObject(e, "valueFrom");
    cJSON *ref = cJSON_AddObjectToObject(from, "fieldRef");

    cJSON_AddStringToObject(e, "name", name);
    cJSON_AddStringToObject(ref, "fieldPath", path);
    return e;
}

/* Sets the COHORT_* variables in a container's env, replacing any of the
 * same name the template set (the operator's must win: they say which
 * cohort the pod is in). */
static void set_env(cJSON *c, const char *cohort_key, const char *broker)
{
    static const char *const ours[] = { "COHORT_SOCKET", "COHORT_COHORT", "COHORT_ID",
                                        "COHORT_BROKER", "COHORT_POD_IP" };
    cJSON *env = NULL, *it, *next;

    /* One env array, whatever came in: JSON may repeat a key, and a pod
     * whose env is ambiguous would be read one way here and another by
     * the API server. The first array stays; other "env" keys go. */
    for (it = c->child; it; it = next) {
        next = it->next;
        if (!it->string || strcmp(it->string, "env") != 0)
            continue;
        if (!env && cJSON_IsArray(it)) {
            env = it;
            continue;
        }
        cJSON_Delete(cJSON_DetachItemViaPointer(c, it));
    }
    if (!env)
        env = cJSON_AddArrayToObject(c, "env");
    for (int i = cJSON_GetArraySize(env) - 1; i >= 0; i--) {
        const char *n = str(cJSON_GetArrayItem(env, i), "name");
        for (size_t j = 0; n && j < sizeof(ours) / sizeof(ours[0]); j++)
            if (strcmp(n, ours[j]) == 0) {
                cJSON_DeleteItemFromArray(env, i);
                break;
            }
    }
    cJSON_AddItemToArray(env, env_value("COHORT_SOCKET", "unix:" RECONCILE_SOCKET));
    cJSON_AddItemToArray(env, env_value("COHORT_COHORT", cohort_key));
    cJSON_AddItemToArray(env, env_field("COHORT_ID", "metadata.name"));
    cJSON_AddItemToArray(env, env_value("COHORT_BROKER", broker));
    cJSON_AddItemToArray(env, env_field("COHORT_POD_IP", "status.podIP"));
}

/* COHORT_INTEGRITY in a trainer container, replacing the template's: a
 * trainer that joins the broker itself (given the key by its template)
 * must speak what the cohort's sidecars speak, or the greetings between
 * them are refused. set_env() has left one env array. */
static void set_integrity(cJSON *c, const char *integrity)
{
    cJSON *env = cJSON_GetObjectItemCaseSensitive(c, "env");

    for (int i = cJSON_GetArraySize(env) - 1; i >= 0; i--) {
        const char *n = str(cJSON_GetArrayItem(env, i), "name");
        if (n && strcmp(n, "COHORT_INTEGRITY") == 0)
            cJSON_DeleteItemFromArray(env, i);
    }
    cJSON_AddItemToArray(env, env_value("COHORT_INTEGRITY", integrity));
}

static void add_mount(cJSON *c)
{
    cJSON *mounts = cJSON_GetObjectItemCaseSensitive(c, "volumeMounts"), *m;

    if (!cJSON_IsArray(mounts)) {
        cJSON_DeleteItemFromObjectCaseSensitive(c, "volumeMounts");
        mounts = cJSON_AddArrayToObject(c, "volumeMounts");
    }
    m = cJSON_CreateObject();
    cJSON_AddStringToObject(m, "name", RECONCILE_VOLUME);
    cJSON_AddStringToObject(m, "mountPath", RECONCILE_MOUNT);
    cJSON_AddItemToArray(mounts, m);
}

/* The sidecar's view of the cohort's Secret: mounted read-only, and the
 * paths of the key and the CA in its environment. Only the sidecar's: the
 * trainer reaches the cohort through its sidecar and never needs the key. */
static void add_key(cJSON *c, const struct reconcile_env *env)
{
    cJSON *m = cJSON_CreateObject(), *e = cJSON_GetObjectItemCaseSensitive(c, "env");

    cJSON_AddStringToObject(m, "name", RECONCILE_KEY_VOLUME);
    cJSON_AddStringToObject(m, "mountPath", RECONCILE_KEY_MOUNT);
    cJSON_AddBoolToObject(m, "readOnly", 1);
    cJSON_AddItemToArray(cJSON_GetObjectItemCaseSensitive(c, "volumeMounts"), m);
    cJSON_AddItemToArray(e, env_value("COHORT_SECRET_FILE", RECONCILE_KEY_FILE));
    if (env->broker_server_name) {
        cJSON_AddItemToArray(e, env_value("COHORT_BROKER_CA", RECONCILE_CA_FILE));
        cJSON_AddItemToArray(e, env_value("COHORT_BROKER_SERVER_NAME", env->broker_server_name));
    }
}

const char *reconcile_pull_policy(const char *s)
{
    static const char *const policies[] = { "Always", "IfNotPresent", "Never" };

    for (size_t i = 0; s && i < sizeof(policies) / sizeof(policies[0]); i++)
        if (strcmp(s, policies[i]) == 0)
            return policies[i];
    return NULL;
}

/* The restricted profile of the Pod Security Standards, whole: the
 * sidecar is ours, and its image is built to run under it. */
static void restrict_sidecar(cJSON *c)
{
    cJSON *sc = cJSON_AddObjectToObject(c, "securityContext"), *caps;

    cJSON_AddBoolToObject(sc, "runAsNonRoot", 1);
    cJSON_AddBoolToObject(sc, "readOnlyRootFilesystem", 1);
    cJSON_AddBoolToObject(sc, "allowPrivilegeEscalation", 0);
    caps = cJSON_AddObjectToObject(sc, "capabilities");
    cJSON_AddItemToArray(cJSON_AddArrayToObject(caps, "drop"), cJSON_CreateString("ALL"));
    cJSON_AddStringToObject(cJSON_AddObjectToObject(sc, "seccompProfile"), "type",
                            "RuntimeDefault");
}

/* What a trainer's image cannot notice: no setuid gains, the runtime's
 * seccomp profile, a supplementary group. Not runAsNonRoot (most training
 * images run as root), not a read-only root filesystem (caches under
 * $HOME and /tmp), not dropping capabilities (root in an image that
 * chowns or writes files it does not own). A container's securityContext
 * is the user's whole statement for it: one that is there is left as it
 * is (privileged or CAP_SYS_ADMIN with allowPrivilegeEscalation false is
 * an invalid pod). The pod's is per field: seccompProfile and fsGroup are
 * added when missing, whatever else it sets. */
static void restrict_trainers(cJSON *spec)
{
    cJSON *psc = cJSON_GetObjectItemCaseSensitive(spec, "securityContext"), *c;

    if (!cJSON_IsObject(psc)) {
        cJSON_DeleteItemFromObjectCaseSensitive(spec, "securityContext");
        psc = cJSON_AddObjectToObject(spec, "securityContext");
    }
    if (!get(psc, "seccompProfile"))
        cJSON_AddStringToObject(cJSON_AddObjectToObject(psc, "seccompProfile"), "type",
                                "RuntimeDefault");
    if (!get(psc, "fsGroup")) {
        cJSON_AddNumberToObject(psc, "fsGroup", RECONCILE_FS_GROUP);
        /* The user's volumes are walked once, not at every start. */
        if (!get(psc, "fsGroupChangePolicy"))
            cJSON_AddStringToObject(psc, "fsGroupChangePolicy", "OnRootMismatch");
    }
    cJSON_ArrayForEach(c, cJSON_GetObjectItemCaseSensitive(spec, "containers"))
        if (cJSON_IsObject(c) && !get(c, "securityContext"))
            cJSON_AddBoolToObject(cJSON_AddObjectToObject(c, "securityContext"),
                                  "allowPrivilegeEscalation", 0);
}

static void add_arg(cJSON *args, const char *flag, const char *value)
{
    cJSON_AddItemToArray(args, cJSON_CreateString(flag));
    cJSON_AddItemToArray(args, cJSON_CreateString(value));
}

/* spec.checkpoint (parsed already by reconcile_parse) in the sidecar: the
 * volume mounted at a fixed path, one directory per cohort (subPath
 * NAMESPACE/NAME, which the kubelet makes when it is missing), and the
 * flags. The trainer never sees the files: its sidecar reads and writes
 * them. */
static void add_checkpoints(cJSON *c, const cJSON *ck, const char *cohort_key)
{
    cJSON *args = cJSON_GetObjectItemCaseSensitive(c, "args"), *m;
    char num[32];
    long v;

    if (!ckpt_source(get(ck, "volume")))
        return;
    m = cJSON_CreateObject();
    cJSON_AddStringToObject(m, "name", RECONCILE_CKPT_VOLUME);
    cJSON_AddStringToObject(m, "mountPath", RECONCILE_CKPT_MOUNT);
    cJSON_AddStringToObject(m, "subPath", cohort_key);
    cJSON_AddItemToArray(cJSON_GetObjectItemCaseSensitive(c, "volumeMounts"), m);
    add_arg(args, "--checkpoint-dir", RECONCILE_CKPT_MOUNT);
    if (int_field(ck, "everyVersions", 0, 1, RECONCILE_VBS_MAX, &v) == 0 && v > 0) {
        snprintf(num, sizeof(num), "%ld", v);
        add_arg(args, "--checkpoint-every", num);
    }
    if (int_field(ck, "everySeconds", 0, 1, RECONCILE_CKPT_SECONDS_MAX, &v) == 0 && v > 0) {
        snprintf(num, sizeof(num), "%lds", v);
        add_arg(args, "--checkpoint-interval", num);
    }
    if (int_field(ck, "keep", RECONCILE_CKPT_KEEP_DEFAULT, 1, RECONCILE_CKPT_KEEP_MAX, &v) == 0) {
        snprintf(num, sizeof(num), "%ld", v);
        add_arg(args, "--checkpoint-keep", num);
    }
}

static cJSON *sidecar_container(const cJSON *tc, const struct reconcile_env *env,
                                const char *cohort_key)
{
    const cJSON *sc = get(get(tc, "spec"), "sidecar");
    const char *image = str(sc, "image"), *pull = str(sc, "imagePullPolicy");
    const char *level = str(sc, "logLevel"), *alg = algorithm_field(get(tc, "spec"));
    const char *codec = compression_field(get(tc, "spec"));
    const char *integrity = integrity_field(get(tc, "spec"));
    const cJSON *acc = get(get(tc, "spec"), "accumulator");
    cJSON *c = cJSON_CreateObject(), *cmd, *args;
    char num[32];
    long v;

    cJSON_AddStringToObject(c, "name", RECONCILE_SIDECAR);
    cJSON_AddStringToObject(c, "image", image ? image : env->sidecar_image);
    if (!pull)
        pull = env->sidecar_pull_policy;
    if (pull)
        cJSON_AddStringToObject(c, "imagePullPolicy", pull);
    restrict_sidecar(c);
    /* A native sidecar: started before the trainer, kept running beside
     * it, stopped after it. */
    cJSON_AddStringToObject(c, "restartPolicy", "Always");
    cmd = cJSON_AddArrayToObject(c, "command");
    cJSON_AddItemToArray(cmd, cJSON_CreateString(env->sidecar_command));
    args = cJSON_AddArrayToObject(c, "args");
    cJSON_AddItemToArray(args, cJSON_CreateString("--socket"));
    cJSON_AddItemToArray(args, cJSON_CreateString(RECONCILE_SOCKET));
    cJSON_AddItemToArray(args, cJSON_CreateString("--advertise"));
    cJSON_AddItemToArray(args, cJSON_CreateString("$(COHORT_POD_IP)"));
    cJSON_AddItemToArray(args, cJSON_CreateString("--data-listen"));
    cJSON_AddItemToArray(args, cJSON_CreateString("$(COHORT_POD_IP):0"));
    cJSON_AddItemToArray(args, cJSON_CreateString("--log-level"));
    cJSON_AddItemToArray(args, cJSON_CreateString(level ? level : "info"));
    /* reconcile_parse refused anything out of range before a pod is made;
     * the checks here only keep a bad value off the command line. */
    cJSON_AddItemToArray(args, cJSON_CreateString("--allreduce"));
    cJSON_AddItemToArray(args, cJSON_CreateString(alg ? alg : "auto"));
    if (codec && strcmp(codec, "none") != 0) {
        cJSON_AddItemToArray(args, cJSON_CreateString("--compression"));
        cJSON_AddItemToArray(args, cJSON_CreateString(codec));
    }
    /* The key it needs is always there: add_key() below. */
    if (integrity && strcmp(integrity, "mac") == 0)
        add_arg(args, "--integrity", "mac");
    if (int_field(acc, "virtualBatchSize", 0, 1, RECONCILE_VBS_MAX, &v) == 0 && v > 0) {
        snprintf(num, sizeof(num), "%ld", v);
        cJSON_AddItemToArray(args, cJSON_CreateString("--virtual-batch-size"));
        cJSON_AddItemToArray(args, cJSON_CreateString(num));
    }
    if (int_field(acc, "parallelGradients", 0, 1, RECONCILE_PARALLEL_MAX, &v) == 0 && v > 0) {
        snprintf(num, sizeof(num), "%ld", v);
        cJSON_AddItemToArray(args, cJSON_CreateString("--parallel-gradients"));
        cJSON_AddItemToArray(args, cJSON_CreateString(num));
    }
    if (cJSON_IsObject(get(sc, "resources")))
        cJSON_AddItemToObject(c, "resources", cJSON_Duplicate(get(sc, "resources"), 1));
    set_env(c, cohort_key, env->broker_address);
    add_mount(c);
    add_key(c, env);
    add_checkpoints(c, get(get(tc, "spec"), "checkpoint"), cohort_key);
    return c;
}

/* The object c[key], made (replacing a value of another type) when
 * missing; NULL on allocation failure. */
static cJSON *object_in(cJSON *c, const char *key)
{
    cJSON *o = cJSON_GetObjectItemCaseSensitive(c, key);

    if (cJSON_IsObject(o))
        return o;
    cJSON_DeleteItemFromObjectCaseSensitive(c, key);
    return cJSON_AddObjectToObject(c, key);
}

static cJSON *array_in(cJSON *c, const char *key)
{
    cJSON *a = cJSON_GetObjectItemCaseSensitive(c, key);

    if (cJSON_IsArray(a))
        return a;
    cJSON_DeleteItemFromObjectCaseSensitive(c, key);
    return cJSON_AddArrayToObject(c, key);
}

/* Container `c` lists the pod's GPU claim (once: a template may list it
 * already, and a name listed twice is refused). Returns 0 or -ENOMEM. */
static int list_gpu_claim(cJSON *c)
{
    cJSON *claims = array_in(object_in(c, "resources"), "claims"), *ref;

    if (claims && has_named(claims, RECONCILE_GPU_CLAIM))
        return 0;
    ref = cJSON_CreateObject();
    if (!claims || !ref || !cJSON_AddStringToObject(ref, "name", RECONCILE_GPU_CLAIM)) {
        cJSON_Delete(ref);
        return -ENOMEM;
    }
    cJSON_AddItemToArray(claims, ref);
    return 0;
}

/* spec.gpu in pod spec `spec` (the sidecar already in its init
 * containers): see reconcile_pod(). Returns 0, -EINVAL (a spec.gpu that
 * reconcile_parse() refuses) or -ENOMEM. */
static int add_gpu(const cJSON *tc, cJSON *spec)
{
    struct reconcile_spec s = { 0 };
    struct reconcile_why why;
    cJSON *trainer = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(spec, "containers"), 0);
    cJSON *sidecar = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(spec, "initContainers"), 0);
    cJSON *claims, *claim, *res, *lim, *req, *args, *flag;
    char name[IDENT_NAME_MAX + 1], num[16];

    if (parse_gpu(get(get(tc, "spec"), "gpu"), &s, &why) < 0)
        return -EINVAL;
    if (s.gpu_mode == RECONCILE_GPU_NONE)
        return 0;
    if (!trainer || !sidecar)
        return -EINVAL;
    snprintf(num, sizeof(num), "%u", s.gpu_count);
    if (s.gpu_mode == RECONCILE_GPU_DEVICE_PLUGIN) {
        /* An extended resource is all limit: a request, if any, must
         * equal it, so the template's is replaced rather than kept. */
        res = object_in(trainer, "resources");
        lim = res ? object_in(res, "limits") : NULL;
        if (!lim)
            return -ENOMEM;
        cJSON_DeleteItemFromObjectCaseSensitive(lim, RECONCILE_GPU_RESOURCE);
        req = cJSON_GetObjectItemCaseSensitive(res, "requests");
        cJSON_DeleteItemFromObjectCaseSensitive(req, RECONCILE_GPU_RESOURCE);
        return cJSON_AddStringToObject(lim, RECONCILE_GPU_RESOURCE, num) ? 0 : -ENOMEM;
    }
    if (reconcile_gpu_template_name(str(get(tc, "metadata"), "name"), name, sizeof(name)) < 0)
        return -EINVAL;
    claims = array_in(spec, "resourceClaims");
    claim = cJSON_CreateObject();
    if (!claims || !claim) {
        cJSON_Delete(claim);
        return -ENOMEM;
    }
    cJSON_AddItemToArray(claims, claim);
    if (!cJSON_AddStringToObject(claim, "name", RECONCILE_GPU_CLAIM) ||
        !cJSON_AddStringToObject(claim, "resourceClaimTemplateName", name))
        return -ENOMEM;
    if (list_gpu_claim(trainer) < 0 || list_gpu_claim(sidecar) < 0)
        return -ENOMEM;
    /* The sidecar sees the GPU: how it reduces the trainer's gradients. */
    args = cJSON_GetObjectItemCaseSensitive(sidecar, "args");
    if (!cJSON_IsArray(args))
        return -EINVAL;
    if (!(flag = cJSON_CreateString("--gpu-reduce")))
        return -ENOMEM;
    cJSON_AddItemToArray(args, flag);
    if (!(flag = cJSON_CreateString(s.gpu_reduce)))
        return -ENOMEM;
    cJSON_AddItemToArray(args, flag);
    return 0;
}

int reconcile_pod(const cJSON *tc, const struct reconcile_env *env, const char *key_id,
                  uint32_t ordinal, cJSON **out)
{
    const cJSON *meta = get(tc, "metadata"), *tmpl = get(get(tc, "spec"), "template");
    const cJSON *tmeta = get(tmpl, "metadata"), *it, *src;
    const char *name = str(meta, "name"), *ns = str(meta, "namespace"), *uid = str(meta, "uid");
    const char *integrity = integrity_field(get(tc, "spec"));
    char pod_name[320], ord[16], key[LIMIT_KUBE_KEY_MAX], secret_name[IDENT_NAME_MAX + 1];
    cJSON *pod, *pm, *labels, *spec, *inits, *vols, *vol, *sec, *conts, *cont;

    *out = NULL;
    /* A bad integrity must never fall back to none: no pod at all. */
    if (!name || !ns || !uid || !integrity || !cJSON_IsObject(get(tmpl, "spec")) ||
        reconcile_secret_name(name, secret_name, sizeof(secret_name)) < 0)
        return -EINVAL;
    snprintf(pod_name, sizeof(pod_name), "%s-%u", name, ordinal);
    snprintf(ord, sizeof(ord), "%u", ordinal);
    snprintf(key, sizeof(key), "%s/%s", ns, name);
    pod = cJSON_CreateObject();
    if (!pod)
        return -ENOMEM;
    cJSON_AddStringToObject(pod, "apiVersion", "v1");
    cJSON_AddStringToObject(pod, "kind", "Pod");
    pm = cJSON_AddObjectToObject(pod, "metadata");
    cJSON_AddStringToObject(pm, "name", pod_name);
    cJSON_AddStringToObject(pm, "namespace", ns);
    labels = cJSON_AddObjectToObject(pm, "labels");
    cJSON_ArrayForEach(it, get(tmeta, "labels"))
        if (cJSON_IsString(it) && strncmp(it->string, "cohort.dev/", 11) != 0)
            cJSON_AddStringToObject(labels, it->string, it->valuestring);
    cJSON_AddStringToObject(labels, RECONCILE_LABEL_COHORT, name);
    cJSON_AddStringToObject(labels, RECONCILE_LABEL_ORDINAL, ord);
    {
        char hash[RECONCILE_HASH_CHARS + 1];
        if (reconcile_template_hash(tc, hash) < 0)
            goto err_pod;
        cJSON_AddStringToObject(labels, RECONCILE_LABEL_TEMPLATE_HASH, hash);
    }
    if (cJSON_IsObject(get(tmeta, "annotations")))
        cJSON_AddItemToObject(pm, "annotations", cJSON_Duplicate(get(tmeta, "annotations"), 1));
    if (key_id) {
        cJSON *ann = cJSON_GetObjectItemCaseSensitive(pm, "annotations");
        if (!ann)
            ann = cJSON_AddObjectToObject(pm, "annotations");
        cJSON_DeleteItemFromObjectCaseSensitive(ann, RECONCILE_ANNOTATION_KEY_ID);
        cJSON_AddStringToObject(ann, RECONCILE_ANNOTATION_KEY_ID, key_id);
    }
    reconcile_add_owner(pm, name, uid);

    spec = cJSON_Duplicate(get(tmpl, "spec"), 1);
    if (!spec)
        goto err_pod;
    cJSON_AddItemToObject(pod, "spec", spec);
    if (!get(spec, "restartPolicy"))
        cJSON_AddStringToObject(spec, "restartPolicy", "Never");
    conts = cJSON_GetObjectItemCaseSensitive(spec, "containers");
    cJSON_ArrayForEach(cont, conts) {
        set_env(cont, key, env->broker_address);
        set_integrity(cont, integrity);
        add_mount(cont);
    }
    /* The trainers' and the pod's defaults; the sidecar, added below,
     * brings its own. */
    restrict_trainers(spec);
    /* The sidecar goes first among the init containers, so that it is up
     * before anything of the user's runs. */
    inits = cJSON_GetObjectItemCaseSensitive(spec, "initContainers");
    if (!cJSON_IsArray(inits)) {
        cJSON_DeleteItemFromObjectCaseSensitive(spec, "initContainers");
        inits = cJSON_AddArrayToObject(spec, "initContainers");
    }
    cJSON_InsertItemInArray(inits, 0, sidecar_container(tc, env, key));
    {
        int rc = add_gpu(tc, spec);
        if (rc < 0) {
            cJSON_Delete(pod);
            return rc;
        }
    }
    vols = cJSON_GetObjectItemCaseSensitive(spec, "volumes");
    if (!cJSON_IsArray(vols)) {
        cJSON_DeleteItemFromObjectCaseSensitive(spec, "volumes");
        vols = cJSON_AddArrayToObject(spec, "volumes");
    }
    /* Memory-backed: it holds the socket, and any shared memory the two
     * containers map is counted against the pod, not a node's disk. */
    vol = cJSON_CreateObject();
    cJSON_AddStringToObject(vol, "name", RECONCILE_VOLUME);
    cJSON_AddStringToObject(cJSON_AddObjectToObject(vol, "emptyDir"), "medium", "Memory");
    cJSON_AddItemToArray(vols, vol);
    /* The cohort's Secret, for the sidecar alone, readable by its owner
     * alone. */
    vol = cJSON_CreateObject();
    cJSON_AddStringToObject(vol, "name", RECONCILE_KEY_VOLUME);
    sec = cJSON_AddObjectToObject(vol, "secret");
    cJSON_AddStringToObject(sec, "secretName", secret_name);
    cJSON_AddNumberToObject(sec, "defaultMode", RECONCILE_KEY_MODE);
    cJSON_AddItemToArray(vols, vol);
    /* cJSON reports allocation failures only by leaving things out: one
     * check at the end that the last additions are all there. */
    if (!get(pod, "spec") || cJSON_GetArraySize(vols) < 2 || !get(get(vol, "secret"), "defaultMode"))
        goto err_pod;
    src = ckpt_source(get(get(get(tc, "spec"), "checkpoint"), "volume"));
    if (src) {
        vol = cJSON_CreateObject();
        if (!vol)
            goto err_pod;
        cJSON_AddItemToArray(vols, vol);
        cJSON_AddStringToObject(vol, "name", RECONCILE_CKPT_VOLUME);
        cJSON_AddItemToObject(vol, src->string, cJSON_Duplicate(src, 1));
        if (!get(vol, src->string))
            goto err_pod;
    }
    *out = pod;
    return 0;
err_pod:
    cJSON_Delete(pod);
    return -ENOMEM;
}

/* ---- template hash, back-off, failures --------------------------------- */

/* Sorts every object's members by key, recursively, so that equal
 * templates print equal whatever order their keys came in. */
static void sort_keys(cJSON *o)
{
    cJSON *it;

    if (cJSON_IsObject(o) && o->child) {
        /* Insertion sort of the child list: templates are small. */
        cJSON *sorted = NULL, *next;
        for (it = o->child; it; it = next) {
            cJSON **pp = &sorted;
            next = it->next;
            while (*pp && strcmp((*pp)->string, it->string) <= 0)
                pp = &(*pp)->next;
            it->next = *pp;
            *pp = it;
        }
        /* cJSON keeps prev links, and the head's prev is the tail. */
        o->child = sorted;
        for (it = sorted; it->next; it = it->next)
            it->next->prev = it;
        sorted->prev = it;
    }
    for (it = o ? o->child : NULL; it; it = it->next)
        sort_keys(it);
}

int reconcile_template_hash(const cJSON *tc, char out[RECONCILE_HASH_CHARS + 1])
{
    const cJSON *tmpl = get(get(tc, "spec"), "template"), *ck = get(get(tc, "spec"), "checkpoint");
    const cJSON *gpu = get(get(tc, "spec"), "gpu");
    const char *integrity = integrity_field(get(tc, "spec"));
    uint64_t h = 0xcbf29ce484222325ull;
    bool mac;
    cJSON *copy;
    char *text;

    if (!cJSON_IsObject(tmpl) || !integrity)
        return -EINVAL;
    /* Members of different integrity refuse each other's greetings: a
     * change must replace every pod. */
    mac = strcmp(integrity, "mac") == 0;
    if (ck || gpu || mac) {
        copy = cJSON_CreateObject();
        if (copy) {
            cJSON_AddItemToObject(copy, "template", cJSON_Duplicate(tmpl, 1));
            if (ck)
                cJSON_AddItemToObject(copy, "checkpoint", cJSON_Duplicate(ck, 1));
            if (gpu)
                cJSON_AddItemToObject(copy, "gpu", cJSON_Duplicate(gpu, 1));
            if (mac)
                cJSON_AddStringToObject(copy, "integrity", "mac");
            if (!get(copy, "template") || (ck && !get(copy, "checkpoint")) ||
                (gpu && !get(copy, "gpu")) || (mac && !get(copy, "integrity"))) {
                cJSON_Delete(copy);
                copy = NULL;
            }
        }
    } else {
        copy = cJSON_Duplicate(tmpl, 1);
    }
    if (!copy)
        return -ENOMEM;
    sort_keys(copy);
    text = cJSON_PrintUnformatted(copy);
    cJSON_Delete(copy);
    if (!text)
        return -ENOMEM;
    for (const unsigned char *p = (const unsigned char *)text; *p; p++)
        h = (h ^ *p) * 0x100000001b3ull;
    free(text);
    snprintf(out, RECONCILE_HASH_CHARS + 1, "%016" PRIx64, h);
    return 0;
}

uint32_t reconcile_backoff_ms(uint32_t streak)
{
    uint64_t ms = RECONCILE_BACKOFF_INITIAL_MS;

    if (streak <= 1)
        return 0;
    for (uint32_t i = 2; i < streak && ms < RECONCILE_BACKOFF_MAX_MS; i++)
        ms *= 2;
    return ms < RECONCILE_BACKOFF_MAX_MS ? (uint32_t)ms : RECONCILE_BACKOFF_MAX_MS;
}

uint32_t reconcile_backoff_fail(struct reconcile_backoff *b, uint64_t now_ms, uint64_t ran_ms)
{
    uint32_t wait;

    if (ran_ms >= RECONCILE_BACKOFF_RESET_MS)
        b->streak = 0;
    if (b->streak < UINT32_MAX)
        b->streak++;
    wait = reconcile_backoff_ms(b->streak);
    b->until_ms = now_ms + wait;
    return wait;
}

uint32_t reconcile_restarts_within(const uint64_t *times, size_t n, uint64_t now_ms,
                                   uint64_t window_ms)
{
    uint32_t k = 0;

    for (size_t i = 0; i < n; i++)
        if (times[i] <= now_ms && now_ms - times[i] < window_ms)
            k++;
    return k;
}

/* Waiting reasons that say the container will not start by itself. */
static const char *const stuck_reasons[] = {
    "ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull",
    "CreateContainerConfigError", "CreateContainerError", "RunContainerError",
    "CrashLoopBackOff",
};

static bool one_failure(const cJSON *cs, struct reconcile_failure *f)
{
    const cJSON *term = get(get(cs, "state"), "terminated"), *wait = get(get(cs, "state"), "waiting");
    const char *name = str(cs, "name"), *reason, *msg;

    if (!name)
        name = "?";
    if (cJSON_IsObject(term)) {
        const cJSON *code = get(term, "exitCode"), *sig = get(term, "signal");
        int ec = cJSON_IsNumber(code) ? code->valueint : -1;
        int sn = cJSON_IsNumber(sig) ? sig->valueint : 0;
        reason = str(term, "reason");
        if (ec == 0 && sn == 0)
            return false;
        snprintf(f->container, sizeof(f->container), "%s", name);
        snprintf(f->reason, sizeof(f->reason), "%s", reason ? reason : "Error");
        f->exit_code = ec;
        f->signal = sn;
        if (sn)
            snprintf(f->message, sizeof(f->message), "container %s was killed by signal %d "
                     "(%s, exit code %d)", name, sn, f->reason, ec);
        else
            snprintf(f->message, sizeof(f->message), "container %s exited with code %d (%s)",
                     name, ec, f->reason);
        return true;
    }
    reason = str(wait, "reason");
    if (!reason)
        return false;
    for (size_t i = 0; i < sizeof(stuck_reasons) / sizeof(stuck_reasons[0]); i++) {
        if (strcmp(reason, stuck_reasons[i]) != 0)
            continue;
        msg = str(wait, "message");
        snprintf(f->container, sizeof(f->container), "%s", name);
        snprintf(f->reason, sizeof(f->reason), "%s", reason);
        f->exit_code = -1;
        f->signal = 0;
        snprintf(f->message, sizeof(f->message), "container %s is waiting: %s%s%s", name, reason,
                 msg ? ": " : "", msg ? msg : "");
        return true;
    }
    return false;
}

bool reconcile_pod_failure(const cJSON *pod, struct reconcile_failure *f)
{
    static const char *const lists[] = { "containerStatuses", "initContainerStatuses" };
    const cJSON *st = get(pod, "status"), *cs;

    memset(f, 0, sizeof(*f));
    for (size_t i = 0; i < 2; i++)
        cJSON_ArrayForEach(cs, get(st, lists[i]))
            if (one_failure(cs, f))
                return true;
    /* Failed with no container status that says why (evicted, a node
     * lost): the pod's own reason. */
    if (str(st, "phase") && strcmp(str(st, "phase"), "Failed") == 0) {
        const char *reason = str(st, "reason"), *msg = str(st, "message");
        snprintf(f->reason, sizeof(f->reason), "%s", reason ? reason : "Failed");
        snprintf(f->message, sizeof(f->message), "the pod failed%s%s", msg ? ": " : "",
                 msg ? msg : "");
        f->exit_code = -1;
        return true;
    }
    memset(f, 0, sizeof(*f));
    return false;
}

long reconcile_ordinal(const char *cohort, const char *pod)
{
    size_t cl = strlen(cohort);
    const char *p;
    long v = 0;

    if (strncmp(pod, cohort, cl) != 0 || pod[cl] != '-')
        return -1;
    p = pod + cl + 1;
    if (!*p || (p[0] == '0' && p[1]) || strlen(p) > 5)
        return -1;
    for (; *p; p++) {
        if (*p < '0' || *p > '9')
            return -1;
        v = v * 10 + (*p - '0');
    }
    return v < (long)RECONCILE_REPLICAS_MAX ? v : -1;
}

int reconcile_selector(const char *cohort, char *buf, size_t n)
{
    int w = snprintf(buf, n, RECONCILE_LABEL_COHORT "=%s", cohort);
    return w < 0 || (size_t)w >= n ? -ENAMETOOLONG : 0;
}

void reconcile_add_owner(cJSON *meta, const char *name, const char *uid)
{
    cJSON *owner = cJSON_CreateObject();

    cJSON_AddStringToObject(owner, "apiVersion", RECONCILE_API_VERSION);
    cJSON_AddStringToObject(owner, "kind", RECONCILE_KIND);
    cJSON_AddStringToObject(owner, "name", name);
    cJSON_AddStringToObject(owner, "uid", uid);
    cJSON_AddBoolToObject(owner, "controller", 1);
    cJSON_AddBoolToObject(owner, "blockOwnerDeletion", 1);
    cJSON_AddItemToArray(cJSON_AddArrayToObject(meta, "ownerReferences"), owner);
}

int reconcile_secret_name(const char *cohort, char *buf, size_t n)
{
    int w = snprintf(buf, n, "%s" RECONCILE_SECRET_SUFFIX, cohort);

    return w < 0 || (size_t)w >= n || w > IDENT_NAME_MAX ? -ENAMETOOLONG : 0;
}

int reconcile_gpu_template_name(const char *cohort, char *buf, size_t n)
{
    int w = snprintf(buf, n, "%s" RECONCILE_GPU_TEMPLATE_SUFFIX, cohort);

    return w < 0 || (size_t)w >= n || w > IDENT_NAME_MAX ? -ENAMETOOLONG : 0;
}

int reconcile_gpu_template(const cJSON *tc, cJSON **out)
{
    const cJSON *meta = get(tc, "metadata");
    const char *name = str(meta, "name"), *ns = str(meta, "namespace"), *uid = str(meta, "uid");
    struct reconcile_spec s = { 0 };
    struct reconcile_why why;
    char tname[IDENT_NAME_MAX + 1];
    cJSON *t, *m, *req, *reqs;

    *out = NULL;
    if (!name || !ns || !uid || parse_gpu(get(get(tc, "spec"), "gpu"), &s, &why) < 0 ||
        s.gpu_mode != RECONCILE_GPU_DRA ||
        reconcile_gpu_template_name(name, tname, sizeof(tname)) < 0)
        return -EINVAL;
    t = cJSON_CreateObject();
    if (!t)
        return -ENOMEM;
    cJSON_AddStringToObject(t, "apiVersion", RECONCILE_DRA_API_VERSION);
    cJSON_AddStringToObject(t, "kind", RECONCILE_DRA_KIND);
    m = cJSON_AddObjectToObject(t, "metadata");
    cJSON_AddStringToObject(m, "name", tname);
    cJSON_AddStringToObject(m, "namespace", ns);
    cJSON_AddStringToObject(cJSON_AddObjectToObject(m, "labels"), RECONCILE_LABEL_COHORT, name);
    reconcile_add_owner(m, name, uid);
    /* ResourceClaimTemplateSpec holds the claim's spec under spec.spec. */
    reqs = cJSON_AddArrayToObject(cJSON_AddObjectToObject(cJSON_AddObjectToObject(
        cJSON_AddObjectToObject(t, "spec"), "spec"), "devices"), "requests");
    req = cJSON_CreateObject();
    if (!reqs || !req) {
        cJSON_Delete(req);
        goto err_t;
    }
    cJSON_AddItemToArray(reqs, req);
    cJSON_AddStringToObject(req, "name", RECONCILE_GPU_REQUEST);
    cJSON_AddStringToObject(req, "deviceClassName", s.gpu_class);
    cJSON_AddStringToObject(req, "allocationMode", "ExactCount");
    if (!cJSON_AddNumberToObject(req, "count", s.gpu_count) || !get(m, "ownerReferences"))
        goto err_t;
    *out = t;
    return 0;
err_t:
    cJSON_Delete(t);
    return -ENOMEM;
}

int reconcile_view(const char *cohort, const cJSON *pod, struct reconcile_pod_view *v)
{
    const cJSON *meta = get(pod, "metadata"), *st = get(pod, "status"), *c;
    const char *phase = str(st, "phase");

    memset(v, 0, sizeof(*v));
    v->name = str(meta, "name");
    if (!v->name)
        return -EINVAL;
    v->uid = str(meta, "uid");
    v->key_id = str(get(meta, "annotations"), RECONCILE_ANNOTATION_KEY_ID);
    v->template_hash = str(get(meta, "labels"), RECONCILE_LABEL_TEMPLATE_HASH);
    v->ordinal = reconcile_ordinal(cohort, v->name);
    if (get(meta, "deletionTimestamp") && !cJSON_IsNull(get(meta, "deletionTimestamp")))
        v->phase = RECONCILE_POD_TERMINATING;
    else if (phase && strcmp(phase, "Running") == 0)
        v->phase = RECONCILE_POD_RUNNING;
    else if (phase && strcmp(phase, "Succeeded") == 0)
        v->phase = RECONCILE_POD_SUCCEEDED;
    else if (phase && strcmp(phase, "Failed") == 0)
        v->phase = RECONCILE_POD_FAILED;
    else
        v->phase = RECONCILE_POD_PENDING;
    cJSON_ArrayForEach(c, get(st, "conditions")) {
        const char *t = str(c, "type"), *s = str(c, "status");
        if (t && s && strcmp(t, "Ready") == 0)
            v->ready = strcmp(s, "True") == 0;
    }
    return 0;
}

/* ---- the plan ----------------------------------------------------------- */

/* The outdated pods to drain and replace now (see reconcile.h), in
 * p->update. `cand` holds the indices of the outdated wanted pods. */
static void plan_rollout(const struct reconcile_spec *s, const struct reconcile_pod_view *pods,
                         const size_t *cand, size_t n_cand, uint32_t running,
                         struct reconcile_plan *p)
{
    uint32_t unavailable = p->want - running, floor, taken = 0;

    floor = s->replicas > s->min_replicas ? s->min_replicas : s->min_replicas - 1;
    /* Drains under way go on whatever the budget says now: stopping one
     * halfway would leave a member out of the epochs with its pod up. */
    for (size_t i = 0; i < n_cand; i++)
        if (pods[cand[i]].draining && pods[cand[i]].phase == RECONCILE_POD_RUNNING) {
            p->update[p->n_update++] = cand[i];
            taken++;
        }
    /* Not running: no member to lose. */
    for (size_t i = 0; i < n_cand; i++)
        if (pods[cand[i]].phase == RECONCILE_POD_PENDING)
            p->update[p->n_update++] = cand[i];
    /* Running ones, highest ordinal first, within the budget. */
    for (;;) {
        size_t best = SIZE_MAX;
        if (unavailable + taken >= s->max_unavailable || running - taken <= floor)
            break;
        for (size_t i = 0; i < n_cand; i++) {
            const struct reconcile_pod_view *v = &pods[cand[i]];
            bool chosen = false;
            if (v->phase != RECONCILE_POD_RUNNING || v->draining)
                continue;
            for (size_t j = 0; j < p->n_update; j++)
                chosen = chosen || p->update[j] == cand[i];
            if (!chosen && (best == SIZE_MAX || v->ordinal > pods[best].ordinal))
                best = cand[i];
        }
        if (best == SIZE_MAX)
            break;
        p->update[p->n_update++] = best;
        taken++;
    }
}

int reconcile_plan(const struct reconcile_spec *s, uint32_t restarts,
                   const struct reconcile_pod_view *pods, size_t n, struct reconcile_plan *p)
{
    uint32_t succeeded = 0, running = 0;
    uint8_t *seen = NULL;
    size_t failed_at = 0, *cand = NULL, n_cand = 0;

    memset(p, 0, sizeof(*p));
    p->want = s->suspend ? 0 : s->replicas;
    seen = calloc(p->want ? p->want : 1, 1);
    cand = calloc(n ? n : 1, sizeof(*cand));
    p->create = calloc(p->want ? p->want : 1, sizeof(*p->create));
    p->replace = calloc(n ? n : 1, sizeof(*p->replace));
    p->excess = calloc(n ? n : 1, sizeof(*p->excess));
    p->roll = calloc(n ? n : 1, sizeof(*p->roll));
    p->update = calloc(n ? n : 1, sizeof(*p->update));
    if (!seen || !cand || !p->create || !p->replace || !p->excess || !p->roll || !p->update) {
        free(seen);
        free(cand);
        reconcile_plan_cleanup(p);
        return -ENOMEM;
    }
    for (size_t i = 0; i < n; i++) {
        const struct reconcile_pod_view *v = &pods[i];
        bool wanted = v->ordinal >= 0 && (uint32_t)v->ordinal < p->want, first;

        if (v->phase == RECONCILE_POD_TERMINATING) {
            p->terminating++;
            if (wanted && !seen[v->ordinal]) {
                seen[v->ordinal] = 2;       /* its name is still taken */
                p->blocked++;
            }
            continue;
        }
        if (!wanted) {
            p->excess[p->n_excess++] = i;
            continue;
        }
        if (seen[v->ordinal] == 2)
            p->blocked--;               /* a new pod already holds the name */
        /* Names are unique, so an ordinal is held once; counts hold to
         * that whatever the caller passes. */
        first = seen[v->ordinal] != 1;
        seen[v->ordinal] = 1;
        if (v->phase == RECONCILE_POD_SUCCEEDED)
            succeeded++;
        if (v->phase == RECONCILE_POD_RUNNING && first)
            running++;
        if (v->outdated && v->phase != RECONCILE_POD_SUCCEEDED && first)
            p->outdated++;
        else if (!v->outdated && first)
            p->updated++;
        if (v->phase == RECONCILE_POD_FAILED) {
            p->failed_pods++;
            if (v->backoff_ms) {
                p->backing_off++;
                if (!p->requeue_ms || v->backoff_ms < p->requeue_ms)
                    p->requeue_ms = v->backoff_ms;
            } else {
                p->replace[p->n_replace++] = i;
            }
        } else if (v->stale && v->phase != RECONCILE_POD_SUCCEEDED) {
            p->roll[p->n_roll++] = i;
        } else if (v->outdated && v->phase != RECONCILE_POD_SUCCEEDED && first) {
            cand[n_cand++] = i;
        }
    }
    for (uint32_t o = 0; o < p->want; o++)
        if (!seen[o])
            p->create[p->n_create++] = o;
    free(seen);
    /* Replacements beyond maxRestarts are not made: the cohort is Failed
     * and the failed pods stay for their logs and exit codes. */
    if (restarts + p->n_replace > s->max_restarts) {
        failed_at = s->max_restarts > restarts ? s->max_restarts - restarts : 0;
        p->n_replace = failed_at;
        p->failed = true;
    }
    if (!p->failed)
        plan_rollout(s, pods, cand, n_cand, running, p);
    free(cand);
    p->complete = p->want > 0 && succeeded == p->want;
    return 0;
}

void reconcile_plan_cleanup(struct reconcile_plan *p)
{
    free(p->create);
    free(p->replace);
    free(p->excess);
    free(p->roll);
    free(p->update);
    memset(p, 0, sizeof(*p));
}

/* ---- status ------------------------------------------------------------- */

static const cJSON *old_condition(const cJSON *old, const char *type)
{
    const cJSON *c;

    cJSON_ArrayForEach(c, get(old, "conditions")) {
        const char *t = str(c, "type");
        if (t && strcmp(t, type) == 0)
            return c;
    }
    return NULL;
}

static void condition(cJSON *arr, const cJSON *old, const char *type, bool status,
                      const char *reason, const char *message, int64_t gen, const char *now)
{
    const cJSON *prev = old_condition(old, type);
    const char *st = status ? "True" : "False", *prev_st = str(prev, "status");
    const char *since = str(prev, "lastTransitionTime");
    cJSON *c = cJSON_CreateObject();

    cJSON_AddStringToObject(c, "type", type);
    cJSON_AddStringToObject(c, "status", st);
    cJSON_AddNumberToObject(c, "observedGeneration", (double)gen);
    cJSON_AddStringToObject(c, "lastTransitionTime",
                            prev_st && since && strcmp(prev_st, st) == 0 ? since : now);
    cJSON_AddStringToObject(c, "reason", reason);
    cJSON_AddStringToObject(c, "message", message);
    cJSON_AddItemToArray(arr, c);
}

static void keep_final(cJSON *st, const cJSON *old)
{
    static const char *const keys[] = {"epoch", "leader", "modelVersion"};

    for (size_t i = 0; i < sizeof(keys) / sizeof(keys[0]); i++) {
        const cJSON *v = get(old, keys[i]);
        if (v && (cJSON_IsNumber(v) || cJSON_IsString(v)) && !get(st, keys[i]))
            cJSON_AddItemToObject(st, keys[i], cJSON_Duplicate(v, 0));
    }
}

const char *reconcile_ckpt_reason(unsigned reason)
{
    /* ckpt.h's enum ckpt_reason, in order: the wire carries the number. */
    static const char *const names[] = { "valid", "truncated or extended", "checksum mismatch",
                                         "not a checkpoint of a known format",
                                         "parameter or buffer sizes differ from the model's",
                                         "another cohort's", "read error" };

    return reason < sizeof(names) / sizeof(names[0]) ? names[reason] : "unknown";
}

static uint64_t num_u64(const cJSON *o, const char *k)
{
    const cJSON *v = get(o, k);

    return cJSON_IsNumber(v) && v->valuedouble > 0 ? (uint64_t)v->valuedouble : 0;
}

/* status.checkpoint (see reconcile_status()). The version the members
 * report wins when it is newer, or when a member set aside the one
 * status showed (the cohort resumed from an older one); else the old one
 * stays: members that joined since the last write report less, and a
 * suspended cohort reports nothing. */
static void checkpoint_status(cJSON *st, const cJSON *old, const struct reconcile_observed *o,
                              const char *now)
{
    const cJSON *oc = get(old, "checkpoint"), *osk = get(oc, "lastSkipped");
    uint64_t was = num_u64(oc, "version"), v = was, skipped = num_u64(osk, "version");
    const char *reason = str(osk, "reason"), *at = str(oc, "time");
    cJSON *ck;

    if (o->ckpt.skipped_version && o->ckpt.skipped_version != skipped) {
        skipped = o->ckpt.skipped_version;
        reason = reconcile_ckpt_reason(o->ckpt.skipped_reason);
    }
    if (o->ckpt.version > v || (o->ckpt.version && was && o->ckpt.skipped_version >= was))
        v = o->ckpt.version;
    if (!v && !skipped)
        return;
    ck = cJSON_AddObjectToObject(st, "checkpoint");
    if (!ck)
        return;
    if (v) {
        cJSON_AddNumberToObject(ck, "version", (double)v);
        cJSON_AddStringToObject(ck, "time", v == was && at ? at : now);
    }
    if (skipped) {
        cJSON *sk = cJSON_AddObjectToObject(ck, "lastSkipped");
        cJSON_AddNumberToObject(sk, "version", (double)skipped);
        cJSON_AddStringToObject(sk, "reason", reason ? reason : "unknown");
    }
}

/* One word for kubectl get, from the same facts as the conditions, the
 * first that holds winning (docs/operator.md defines each). */
static const char *status_phase(const struct reconcile_spec *s, const struct reconcile_observed *o,
                                uint32_t ready)
{
    const struct reconcile_plan *p = o->plan;

    if (o->invalid || (p && p->failed))
        return "Failed";
    if (p && p->complete)
        return "Complete";
    if (s->suspend)
        return "Suspended";
    if (p && p->failed_pods)
        return "Degraded";
    if (o->epoch && ready >= s->min_replicas)
        return "Running";
    return "Pending";
}

cJSON *reconcile_status(const struct reconcile_spec *s, const struct reconcile_observed *o,
                        const cJSON *old, const char *now)
{
    const struct reconcile_plan *p = o->plan;
    cJSON *st = cJSON_CreateObject(), *members, *conds;
    uint32_t ready = 0;
    uint64_t leader_version = 0;
    char msg[RECONCILE_MESSAGE_MAX];

    if (!st)
        return NULL;
    cJSON_AddNumberToObject(st, "observedGeneration", (double)o->generation);
    cJSON_AddNumberToObject(st, "replicas", o->pods);
    if (o->selector)
        cJSON_AddStringToObject(st, "selector", o->selector);
    cJSON_AddNumberToObject(st, "restarts", o->restarts);
    members = cJSON_CreateArray();
    for (size_t i = 0; i < o->n_members; i++) {
        const struct reconcile_member *m = &o->members[i];
        cJSON *e = cJSON_CreateObject();
        cJSON_AddStringToObject(e, "id", m->id);
        cJSON_AddStringToObject(e, "pod", m->id);
        if (m->address)
            cJSON_AddStringToObject(e, "address", m->address);
        cJSON_AddNumberToObject(e, "modelVersion", (double)m->model_version);
        if (m->draining)
            cJSON_AddBoolToObject(e, "draining", 1);
        else if (o->epoch)
            ready++;        /* members train once an epoch names them */
        if (o->leader && strcmp(o->leader, m->id) == 0)
            leader_version = m->model_version;
        cJSON_AddItemToArray(members, e);
    }
    /* Pods that failed: a member's entry gets its lastFailure, a pod
     * that is not a member (it failed, or cannot start) an entry of its
     * own, so that kubectl shows why without reading the pods. */
    for (size_t i = 0; i < o->n_failures; i++) {
        const struct reconcile_pod_failure *pf = &o->failures[i];
        cJSON *e = NULL, *it, *lf;
        cJSON_ArrayForEach(it, members)
            if (str(it, "id") && strcmp(str(it, "id"), pf->pod) == 0)
                e = it;
        if (!e) {
            e = cJSON_CreateObject();
            cJSON_AddStringToObject(e, "id", pf->pod);
            cJSON_AddStringToObject(e, "pod", pf->pod);
            cJSON_AddItemToArray(members, e);
        }
        lf = cJSON_AddObjectToObject(e, "lastFailure");
        cJSON_AddStringToObject(lf, "reason", pf->f->reason);
        cJSON_AddStringToObject(lf, "message", pf->f->message);
        if (pf->f->exit_code >= 0)
            cJSON_AddNumberToObject(lf, "exitCode", pf->f->exit_code);
        if (pf->f->signal)
            cJSON_AddNumberToObject(lf, "signal", pf->f->signal);
        if (pf->at)
            cJSON_AddStringToObject(lf, "time", pf->at);
        if (pf->backoff_ms)
            cJSON_AddNumberToObject(lf, "backoffSeconds", (pf->backoff_ms + 999) / 1000);
    }
    cJSON_AddNumberToObject(st, "readyReplicas", ready);
    if (p)
        cJSON_AddNumberToObject(st, "updatedReplicas", p->updated);
    if (o->broker_known && o->epoch) {
        cJSON_AddNumberToObject(st, "epoch", (double)o->epoch);
        if (o->leader) {
            cJSON_AddStringToObject(st, "leader", o->leader);
            /* 0 is no version at all: a sidecar whose trainer exited
             * reports none until its pod ends. The version reached stays
             * (a cohort made anew shows it until its first commit). */
            const cJSON *was = get(old, "modelVersion");
            if (!leader_version && cJSON_IsNumber(was) && was->valuedouble > 0)
                leader_version = (uint64_t)was->valuedouble;
            cJSON_AddNumberToObject(st, "modelVersion", (double)leader_version);
        }
    }
    /* With no leader now (trainers that finished left the broker, which
     * forgets the cohort once all have; a suspended cohort; between
     * epochs) the last epoch, leader and model version stay: the model
     * the cohort reached is still a fact, and a finished cohort's final
     * one is what its user asks for. */
    if (!o->invalid && !(o->broker_known && o->epoch && o->leader))
        keep_final(st, old);
    checkpoint_status(st, old, o, now);
    cJSON_AddItemToObject(st, "members", members);
    cJSON_AddStringToObject(st, "phase", status_phase(s, o, ready));

    conds = cJSON_AddArrayToObject(st, "conditions");
    if (o->invalid) {
        condition(conds, old, "Available", false, o->invalid->reason, o->invalid->message,
                  o->generation, now);
        condition(conds, old, "Progressing", false, o->invalid->reason, o->invalid->message,
                  o->generation, now);
        condition(conds, old, "Failed", true, o->invalid->reason, o->invalid->message,
                  o->generation, now);
        return st;
    }
    /* Available: enough members train together. */
    if (s->suspend) {
        condition(conds, old, "Available", false, "Suspended", "the cohort is suspended",
                  o->generation, now);
    } else if (p && p->complete) {
        condition(conds, old, "Available", false, "Completed", "every trainer finished",
                  o->generation, now);
    } else if (ready >= s->min_replicas) {
        snprintf(msg, sizeof(msg), "%u of %u members train in epoch %" PRIu64, ready, s->replicas,
                 o->epoch);
        condition(conds, old, "Available", true, "MinimumMembersReady", msg, o->generation, now);
    } else {
        snprintf(msg, sizeof(msg), "%u members, %u wanted at least", ready, s->min_replicas);
        condition(conds, old, "Available", false, "WaitingForMembers", msg, o->generation, now);
    }
    /* Progressing: the operator still has work to do to reach the spec. */
    {
        uint32_t want = p ? p->want : 0;
        bool draining = o->draining > 0;
        bool scaling = p && (p->n_create || p->n_excess || p->blocked || p->n_replace ||
                             p->n_roll || p->backing_off);
        bool joining = !s->suspend && !(p && p->complete) && ready != want;
        if (p && p->failed) {
            condition(conds, old, "Progressing", false, "TooManyRestarts",
                      "no more failed pods are replaced", o->generation, now);
        } else if (p && p->outdated) {
            snprintf(msg, sizeof(msg), "%u of %u pods run the current template; replacing the "
                     "others %u at a time (spec.rollout.maxUnavailable)", p->updated, want,
                     s->max_unavailable);
            condition(conds, old, "Progressing", true, "RollingUpdate", msg, o->generation, now);
        } else if (p && p->backing_off) {
            snprintf(msg, sizeof(msg), "%u failed pod(s) wait out their back-off before they are "
                     "replaced", p->backing_off);
            condition(conds, old, "Progressing", true, "BackOff", msg, o->generation, now);
        } else if (draining) {
            snprintf(msg, sizeof(msg), "draining %u member(s) before their pods are deleted",
                     o->draining);
            condition(conds, old, "Progressing", true, "Draining", msg, o->generation, now);
        } else if (scaling || joining) {
            snprintf(msg, sizeof(msg), "%u of %u pods exist, %u members", o->pods, want, ready);
            condition(conds, old, "Progressing", true, "Scaling", msg, o->generation, now);
        } else {
            snprintf(msg, sizeof(msg), "%u pods, all members", want);
            condition(conds, old, "Progressing", false, s->suspend ? "Suspended" : "Stable", msg,
                      o->generation, now);
        }
    }
    /* Degraded: fewer members than wanted because pods failed or vanished. */
    if (p && p->failed_pods && !s->suspend) {
        snprintf(msg, sizeof(msg), "%u trainer pod(s) failed", p->failed_pods);
        condition(conds, old, "Degraded", true, "PodFailed", msg, o->generation, now);
    } else {
        condition(conds, old, "Degraded", false, "AsExpected", "no trainer pod has failed",
                  o->generation, now);
    }
    if (p && p->failed) {
        snprintf(msg, sizeof(msg), "a trainer pod failed after spec.maxRestarts (%u) "
                 "replacements within the last hour (%u in all)", s->max_restarts, o->restarts);
        condition(conds, old, "Failed", true, "TooManyRestarts", msg, o->generation, now);
    } else {
        condition(conds, old, "Failed", false, "AsExpected", "restarts within spec.maxRestarts",
                  o->generation, now);
    }
    condition(conds, old, "Suspended", s->suspend, s->suspend ? "Suspended" : "NotSuspended",
              s->suspend ? "spec.suspend is true: no pods run" : "spec.suspend is false",
              o->generation, now);
    if (p && p->complete)
        condition(conds, old, "Complete", true, "Completed", "every trainer finished",
                  o->generation, now);
    /* As a ReplicaSet's: present only while the API refuses the pods. */
    if (o->replica_failure)
        condition(conds, old, "ReplicaFailure", true, o->replica_failure->reason,
                  o->replica_failure->message, o->generation, now);
    return st;
}

/* A copy without the fields that move with every round. */
static cJSON *without_versions(const cJSON *st)
{
    cJSON *c = cJSON_Duplicate(st, 1), *m;

    if (!c)
        return NULL;
    cJSON_DeleteItemFromObjectCaseSensitive(c, "modelVersion");
    cJSON_ArrayForEach(m, cJSON_GetObjectItemCaseSensitive(c, "members"))
        cJSON_DeleteItemFromObjectCaseSensitive(m, "modelVersion");
    return c;
}

bool reconcile_status_differs(const cJSON *a, const cJSON *b, bool ignore_versions)
{
    cJSON *x, *y;
    bool differ;

    if (!a || !b)
        return a != b;
    if (!ignore_versions)
        return !cJSON_Compare(a, b, 1);
    x = without_versions(a);
    y = without_versions(b);
    differ = !x || !y || !cJSON_Compare(x, y, 1);
    cJSON_Delete(x);
    cJSON_Delete(y);
    return differ;
}

/* Sets to null, in `want` (a copy being made into a merge patch), every
 * member of `old` that it lacks, at every depth of objects both have: a
 * merge patch merges nested objects, so a field that went away inside
 * one (status.checkpoint's) must be nulled too. */
static void null_missing(const cJSON *old, cJSON *want)
{
    const cJSON *it;

    cJSON_ArrayForEach(it, old) {
        cJSON *w;
        if (!it->string)
            continue;
        w = cJSON_GetObjectItemCaseSensitive(want, it->string);
        if (!w)
            cJSON_AddNullToObject(want, it->string);
        else if (cJSON_IsObject(w) && cJSON_IsObject(it))
            null_missing(it, w);
    }
}

cJSON *reconcile_status_patch(const cJSON *old, const cJSON *want)
{
    cJSON *patch = cJSON_CreateObject(), *st;

    if (!patch)
        return NULL;
    st = cJSON_Duplicate(want, 1);
    if (!st) {
        cJSON_Delete(patch);
        return NULL;
    }
    null_missing(old, st);
    cJSON_AddItemToObject(patch, "status", st);
    return patch;
}

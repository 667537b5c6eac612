/* src/k8s/reconcile.h: what a TrainingCohort should look like in the cluster,
 * computed from what is there. Pure: no I/O, no clock of its own, no
 * threads; the controller (controller.h) feeds it the cached objects and
 * the broker's view and carries out what it decides.
 *
 * The rules it encodes (docs/operator.md repeats them for users):
 * - Pods are named <cohort>-<ordinal> for ordinals 0 .. replicas-1, with no
 *   generateName, so that a restarted operator finds the pods it made and
 *   a create that races another one gets AlreadyExists, never a duplicate.
 * - A pod that Failed is deleted and made again under the same name, and
 *   counted in status.restarts, up to spec.maxRestarts; after that the
 *   cohort is Failed and failed pods are left in place for inspection.
 * - Pods at ordinals >= replicas (a scale-down) and every pod of a
 *   suspended cohort are "excess": the controller drains them through the
 *   broker before it deletes them.
 * - A pod that Succeeded (the trainer finished) is not replaced; when every
 *   wanted ordinal has Succeeded the cohort is Complete.
 * - A pod made with another key or CA than the cohort's (its
 *   cohort.dev/key-id annotation differs) cannot prove itself to the
 *   broker: it is "rolled", deleted and made again, without counting as a
 *   restart.
 * - A pod that failed is replaced after a back-off, as a kubelet restarts a
 *   crashing container: at once the first time, then 10 s doubling to
 *   5 min per ordinal, the streak forgotten once a pod ran 10 minutes.
 *   maxRestarts counts the replacements of the last hour, so a transient
 *   fault never fails a cohort.
 * - A pod made from another template than the cohort's (its
 *   cohort.dev/template-hash label differs) is "outdated": drained and
 *   replaced a few at a time (spec.rollout.maxUnavailable), highest
 *   ordinal first, keeping at least minReplicas running pods.
 */
#ifndef COHORT_RECONCILE_H
#define COHORT_RECONCILE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#define RECONCILE_GROUP "cohort.dev"
#define RECONCILE_API_VERSION "cohort.dev/v1alpha1"
#define RECONCILE_KIND "TrainingCohort"
#define RECONCILE_LABEL_COHORT "cohort.dev/cohort"
#define RECONCILE_LABEL_ORDINAL "cohort.dev/ordinal"
#define RECONCILE_SIDECAR "cohort-sidecar"
#define RECONCILE_VOLUME "cohort"
#define RECONCILE_MOUNT "/run/cohort"
#define RECONCILE_SOCKET "/run/cohort/sidecar.sock"
#define RECONCILE_REPLICAS_MAX 4096u
/* The cohort's Secret (keys.h): its name is NAME-cohort-key; `key` and
 * `ca.crt` are mounted, mode 0400, into the sidecar alone; each pod is
 * annotated with the id of the key and CA it was made with. */
#define RECONCILE_SECRET_SUFFIX "-cohort-key"
#define RECONCILE_SECRET_KEY "key"
#define RECONCILE_SECRET_CA "ca.crt"
#define RECONCILE_KEY_VOLUME "cohort-secret"
#define RECONCILE_KEY_MOUNT "/etc/cohort/secret"
#define RECONCILE_KEY_FILE RECONCILE_KEY_MOUNT "/" RECONCILE_SECRET_KEY
#define RECONCILE_CA_FILE RECONCILE_KEY_MOUNT "/" RECONCILE_SECRET_CA
#define RECONCILE_KEY_MODE 0400
/* The pod's fsGroup when its template sets none: the kubelet makes the
 * Secret's files group-readable by it, and every container of the pod
 * runs with it as a supplementary group, so a sidecar that runs as a
 * non-root user (whichever its image names) can read its key. The
 * trainer gets the group too, but never mounts the Secret. */
#define RECONCILE_FS_GROUP 65532
#define RECONCILE_ANNOTATION_KEY_ID "cohort.dev/key-id"
/* The hash of spec.template a pod was made from (reconcile_template_hash),
 * as a Deployment's pods carry pod-template-hash. */
#define RECONCILE_LABEL_TEMPLATE_HASH "cohort.dev/template-hash"
#define RECONCILE_HASH_CHARS 16
/* Back-off between replacements of one ordinal's failed pods. */
#define RECONCILE_BACKOFF_INITIAL_MS 10000u
#define RECONCILE_BACKOFF_MAX_MS 300000u
#define RECONCILE_BACKOFF_RESET_MS 600000u      /* a pod that ran this long ends the streak */
/* spec.maxRestarts counts the replacements within this window. */
#define RECONCILE_RESTART_WINDOW_MS 3600000u
#define RECONCILE_REASON_MAX 64
#define RECONCILE_MESSAGE_MAX 512
/* spec.accumulator.virtualBatchSize's largest value: a JSON number is
 * exact up to 2^53. */
#define RECONCILE_VBS_MAX 9007199254740991LL
#define RECONCILE_PARALLEL_MAX 8
/* spec.checkpoint: its volume, mounted into the sidecar alone at
 * RECONCILE_CKPT_MOUNT with subPath NAMESPACE/NAME, so that cohorts that
 * share a volume never read each other's files. */
#define RECONCILE_CKPT_VOLUME "cohort-checkpoints"
#define RECONCILE_CKPT_MOUNT "/var/lib/cohort/checkpoints"
#define RECONCILE_CKPT_SECONDS_MAX 3600
#define RECONCILE_CKPT_KEEP_MAX 1000
#define RECONCILE_CKPT_KEEP_DEFAULT 3
/* spec.gpu (docs/gpu.md, "Kubernetes"): GPUs per trainer pod, and how
 * the pod gets them. With mode dra, the pod's claim RECONCILE_GPU_CLAIM
 * comes from the cohort's ResourceClaimTemplate NAME-gpu and is listed by
 * the trainer and the sidecar alike; with mode devicePlugin, the trainer
 * alone asks for RECONCILE_GPU_RESOURCE. */
#define RECONCILE_GPU_MAX 16
#define RECONCILE_GPU_CLAIM "cohort-gpu"
#define RECONCILE_GPU_REQUEST "gpu"
#define RECONCILE_GPU_TEMPLATE_SUFFIX "-gpu"
#define RECONCILE_GPU_CLASS_DEFAULT "gpu.nvidia.com"
#define RECONCILE_GPU_REDUCE_DEFAULT "nccl"
#define RECONCILE_GPU_RESOURCE "nvidia.com/gpu"
#define RECONCILE_DRA_API_VERSION "resource.k8s.io/v1beta1"
#define RECONCILE_DRA_KIND "ResourceClaimTemplate"

enum reconcile_gpu_mode {
    RECONCILE_GPU_NONE,             /* no spec.gpu */
    RECONCILE_GPU_DRA,              /* a claim both containers list */
    RECONCILE_GPU_DEVICE_PLUGIN,    /* an extended resource for the trainer alone */
};

/* What the operator interprets of spec, after defaults and checks. */
struct reconcile_spec {
    uint32_t replicas, min_replicas, max_restarts;
    uint32_t max_unavailable;       /* spec.rollout.maxUnavailable, >= 1 */
    bool suspend;
    uint32_t heartbeat_ms, timeout_ms;
    /* spec.accumulator, pinned on every member's sidecar; 0: unset, the
     * trainer's own calls decide. */
    uint64_t virtual_batch_size;
    uint32_t parallel_gradients;
    /* spec.reduction.algorithm: "auto", "ring" or "doubling" (static). */
    const char *algorithm;
    /* spec.reduction.compression: "none", "fp16", "bf16", "int8", "topk",
     * "topk:RATIO", "powersgd" or "powersgd:RANK" (static, or borrowed from
     * the object parsed): the sidecar's default, which a trainer's
     * set_compression replaces. */
    const char *compression;
    /* spec.reduction.integrity: true for "mac", the sidecars'
     * --integrity mac (a Poly1305 tag on every data-plane frame under the
     * cohort's key, which every pod's sidecar has) and the trainers'
     * COHORT_INTEGRITY=mac; false for "none", the default. */
    bool integrity_mac;
    /* spec.checkpoint: periods (0: that one unset; one at least is set)
     * and how many to keep. */
    bool checkpoint;
    uint64_t ckpt_every_versions;
    uint32_t ckpt_every_s, ckpt_keep;
    /* spec.gpu: mode, GPUs per pod (0 without spec.gpu) and, with dra,
     * the device class (borrowed from the cohort object, or the
     * static default). */
    enum reconcile_gpu_mode gpu_mode;
    uint32_t gpu_count;
    const char *gpu_class;
    /* spec.gpu.reduce, mode dra only: "nccl" (the default) or "host", the
     * sidecar's --gpu-reduce (static, or NULL without mode dra). */
    const char *gpu_reduce;
};

/* Why a cohort cannot be reconciled: a condition reason (CamelCase) and a
 * sentence for its message. */
struct reconcile_why {
    char reason[RECONCILE_REASON_MAX];
    char message[RECONCILE_MESSAGE_MAX];
};

/* Reads spec from a TrainingCohort (borrowed), applying the CRD's defaults
 * for fields that are missing (an object written before the CRD was
 * updated, or a server without defaulting). Returns 0, or -EINVAL with
 * *why filled: a name too long for the pod names and labels, replicas out
 * of range, durations that do not parse or timeout <= heartbeat,
 * spec.accumulator or spec.reduction values the CRD does not allow
 * (reduction.compression that cohort-sidecar --compression would refuse,
 * a reduction.integrity other than none or mac), a
 * spec.checkpoint without one volume source (or with a read-only one:
 * configMap, secret, downwardAPI, projected, image) or without a period,
 * or with keep out of range, a spec.gpu without a known mode, with a
 * count out of range or a deviceClassName that is not a DNS subdomain or
 * is given with mode devicePlugin, a template without containers or with
 * a container, volume or resource claim name that the operator
 * reserves. */
int reconcile_parse(const cJSON *tc, struct reconcile_spec *s, struct reconcile_why *why);

/* How pods reach the operator, and what they run besides the trainer. */
struct reconcile_env {
    const char *broker_address;     /* host:port, what the sidecar is told */
    const char *sidecar_image;      /* used when spec.sidecar.image is unset */
    /* Always, IfNotPresent or Never: used when spec.sidecar.imagePullPolicy
     * is unset; NULL leaves it to the cluster. A static string (see
     * reconcile_pull_policy()), so that the controller need not copy it. */
    const char *sidecar_pull_policy;
    const char *sidecar_command;    /* argv[0] of the sidecar container */
    /* The name the broker's TLS certificate carries (its Service's
     * NAME.NS.svc), which the sidecar checks; NULL: the broker serves
     * plaintext. */
    const char *broker_server_name;
};

/* The static spelling of an image pull policy (Always, IfNotPresent or
 * Never, exactly), or NULL when `s` is none of them. */
const char *reconcile_pull_policy(const char *s);

/* The pod for `ordinal` of cohort `tc` (borrowed): the template's pod
 * with the sidecar injected as a native sidecar (an init container with
 * restartPolicy Always), the shared emptyDir, the COHORT_* environment
 * in every trainer container, labels and a controller owner reference.
 * The sidecar is told spec.reduction.algorithm (--allreduce), a
 * spec.reduction.compression other than none (--compression) and, when
 * set, spec.accumulator's virtualBatchSize and parallelGradients
 * (--virtual-batch-size, --parallel-gradients), which it pins on the
 * trainer's Accumulator. With spec.reduction.integrity mac the sidecar
 * is told --integrity mac; every trainer container gets COHORT_INTEGRITY
 * (none or mac, replacing the template's), so that a trainer that joins
 * the broker itself speaks what the sidecars speak. With spec.checkpoint, the pod gets its volume
 * (named RECONCILE_CKPT_VOLUME), the sidecar alone mounts it at
 * RECONCILE_CKPT_MOUNT with subPath NAMESPACE/NAME and is told
 * --checkpoint-dir, --checkpoint-every and/or --checkpoint-interval, and
 * --checkpoint-keep.
 * With spec.gpu mode dra, the pod's spec.resourceClaims gets
 * RECONCILE_GPU_CLAIM from the cohort's ResourceClaimTemplate
 * (reconcile_gpu_template()), and both the first container of the
 * template (the trainer) and the sidecar list it in resources.claims,
 * so that both see the same devices, and the sidecar is told
 * --gpu-reduce with spec.gpu.reduce (nccl unless it says host); with mode devicePlugin, the first
 * container alone gets RECONCILE_GPU_RESOURCE: count in its limits and
 * requests (replacing what the template said of it).
 * Security defaults (docs/operator.md, "Security context"): the sidecar
 * runs restricted (non-root, read-only root filesystem, no privilege
 * escalation, no capabilities, seccomp RuntimeDefault); the pod gets
 * seccomp RuntimeDefault and an fsGroup (so a non-root sidecar can read
 * its key) where its securityContext does not set them; a trainer
 * container without a securityContext of its own gets
 * allowPrivilegeEscalation false and nothing else.
 * The sidecar alone mounts the cohort's Secret read-only and is
 * told where its key (COHORT_SECRET_FILE) and, with TLS, the broker's CA
 * (COHORT_BROKER_CA) and name (COHORT_BROKER_SERVER_NAME) are; `key_id`
 * (keys_id() in keys.h, NULL for none) becomes the pod's cohort.dev/key-id
 * annotation. restartPolicy defaults to Never, so that a failure reaches
 * the operator, which replaces the pod and counts it. Returns 0 and sets
 * *out (caller frees with cJSON_Delete), -EINVAL (tc lacks a name,
 * namespace, uid or template, or has a spec.gpu or
 * spec.reduction.integrity reconcile_parse() refuses), -ENOMEM. */
int reconcile_pod(const cJSON *tc, const struct reconcile_env *env, const char *key_id,
                  uint32_t ordinal, cJSON **out);

/* The hash of cohort `tc`'s spec.template (borrowed) as the user wrote
 * it, of spec.checkpoint and spec.gpu when they are set, and of
 * spec.reduction.integrity when it is mac (they change the pod too):
 * FNV-1a 64 of their canonical JSON (object keys sorted, no spaces), as
 * 16 hex digits into out. Without any of them the hash is the template's
 * alone, as before they existed, so that pods made then are not replaced
 * (integrity none, the default the API server fills in, is left out for
 * the same reason). reconcile_pod() labels each pod with it.
 * Returns 0, -EINVAL (no template, an integrity other than none or mac),
 * -ENOMEM. */
int reconcile_template_hash(const cJSON *tc, char out[RECONCILE_HASH_CHARS + 1]);

/* The name of cohort `cohort`'s ResourceClaimTemplate, NAME-gpu, into
 * buf. Returns 0 or -ENAMETOOLONG. */
int reconcile_gpu_template_name(const char *cohort, char *buf, size_t n);

/* The ResourceClaimTemplate (resource.k8s.io/v1beta1) that cohort `tc`
 * (borrowed) with spec.gpu mode dra needs: one request, named
 * RECONCILE_GPU_REQUEST, for exactly spec.gpu.count devices of
 * spec.gpu.deviceClassName, labelled with the cohort and owned by it.
 * Kubernetes makes one ResourceClaim from it for each pod that names it,
 * owned by that pod, and deletes it with the pod. Returns 0 and sets
 * *out (caller frees with cJSON_Delete), -EINVAL (no name, namespace or
 * uid; a spec reconcile_parse() refuses; a mode other than dra),
 * -ENOMEM. */
int reconcile_gpu_template(const cJSON *tc, cJSON **out);

/* The wait before replacing an ordinal's pod that failed for the
 * `streak`-th time in a row: 0 for the first, then 10 s doubling, capped
 * at 5 min. */
uint32_t reconcile_backoff_ms(uint32_t streak);

/* One ordinal's crash loop, kept by the caller across reconciles. */
struct reconcile_backoff {
    uint32_t streak;                /* failures in a row */
    uint64_t until_ms;              /* no replacement before this (caller's clock) */
};

/* Notes a failure, seen at `now_ms`, of a pod that ran `ran_ms`: a pod
 * that ran RECONCILE_BACKOFF_RESET_MS or more starts a new streak.
 * Returns the wait before its replacement (also stored in until_ms). */
uint32_t reconcile_backoff_fail(struct reconcile_backoff *b, uint64_t now_ms, uint64_t ran_ms);

/* How many of the `n` replacement times (ms, any order) lie within
 * `window_ms` before `now_ms`: what spec.maxRestarts is held to. */
uint32_t reconcile_restarts_within(const uint64_t *times, size_t n, uint64_t now_ms,
                                   uint64_t window_ms);

/* Why a pod failed or cannot start, from its container statuses: the
 * first trainer or sidecar container that terminated with a non-zero
 * exit code or a signal (reason OOMKilled, Error, ...), or waits for a
 * reason that needs a person (ErrImagePull, ImagePullBackOff,
 * CreateContainerConfigError, InvalidImageName, CrashLoopBackOff, ...).
 * Fills *f (strings copied) and returns true, or false when nothing is
 * wrong that the statuses show. */
struct reconcile_failure {
    char container[64];
    char reason[RECONCILE_REASON_MAX];
    char message[RECONCILE_MESSAGE_MAX];  /* one sentence, for Events */
    int exit_code;                  /* -1: none */
    int signal;                     /* 0: none */
};
bool reconcile_pod_failure(const cJSON *pod, struct reconcile_failure *f);

/* The ordinal of pod `pod` if it is named <cohort>-<n> (n without leading
 * zeros, below RECONCILE_REPLICAS_MAX), else -1. */
long reconcile_ordinal(const char *cohort, const char *pod);

/* The label selector of a cohort's pods, for status.selector and lists.
 * Returns 0 or -ENAMETOOLONG. */
int reconcile_selector(const char *cohort, char *buf, size_t n);

/* The name of cohort `cohort`'s Secret, NAME-cohort-key, into buf.
 * Returns 0 or -ENAMETOOLONG (also past 253 bytes, an object name's
 * limit). */
int reconcile_secret_name(const char *cohort, char *buf, size_t n);

/* Adds to `meta` (an object's metadata) the ownerReferences that make
 * TrainingCohort `name` with `uid` (both copied) its controlling owner,
 * deleted with it: what a cohort's pods and its Secret carry. */
void reconcile_add_owner(cJSON *meta, const char *name, const char *uid);

enum reconcile_phase {
    RECONCILE_POD_PENDING,
    RECONCILE_POD_RUNNING,
    RECONCILE_POD_SUCCEEDED,
    RECONCILE_POD_FAILED,
    RECONCILE_POD_TERMINATING,      /* deletionTimestamp set, whatever the phase */
};

/* One pod as the plan sees it. Strings are borrowed. */
struct reconcile_pod_view {
    const char *name, *uid;
    long ordinal;                   /* reconcile_ordinal(), -1 for a stranger */
    enum reconcile_phase phase;
    bool ready;
    const char *key_id;             /* its cohort.dev/key-id annotation, or NULL */
    bool stale;                     /* made with another key or CA: set by the caller */
    const char *template_hash;      /* its cohort.dev/template-hash label, or NULL */
    bool outdated;                  /* made from another template: set by the caller */
    bool draining;                  /* being drained: set by the caller */
    uint32_t backoff_ms;            /* Failed and in back-off for this long: set by the caller */
};

/* Reads a pod object into a view (strings borrowed from pod). Returns 0
 * or -EINVAL (no name). */
int reconcile_view(const char *cohort, const cJSON *pod, struct reconcile_pod_view *v);

struct reconcile_plan {
    uint32_t *create;               /* ordinals to create */
    size_t n_create;
    size_t *replace;                /* indices into pods: Failed, delete and count */
    size_t n_replace;
    size_t *excess;                 /* indices into pods: drain, then delete */
    size_t n_excess;
    size_t *roll;                   /* indices into pods: stale, delete (not counted) */
    size_t n_roll;
    size_t *update;                 /* indices into pods: outdated, drain then delete now */
    size_t n_update;
    uint32_t updated;               /* wanted pods made from the current template */
    uint32_t outdated;              /* wanted pods made from another (Succeeded ones aside) */
    uint32_t backing_off;           /* Failed pods waiting out their back-off */
    uint32_t requeue_ms;            /* the shortest back-off left: look again then (0: none) */
    uint32_t want;                  /* pods wanted: 0 when suspended */
    uint32_t terminating;           /* pods being deleted */
    uint32_t blocked;               /* wanted ordinals waiting for a pod to go */
    uint32_t failed_pods;           /* Failed pods at wanted ordinals */
    bool failed;                    /* a pod failed with no restarts left */
    bool complete;                  /* every wanted ordinal Succeeded */
};

/* Decides what to do for a cohort with spec `s`, `restarts` replacements
 * made within RECONCILE_RESTART_WINDOW_MS and `pods` (borrowed). Failed
 * pods in back-off are not replaced yet. Outdated pods are drained and
 * replaced while fewer than spec.rollout.maxUnavailable wanted pods are
 * not Running and at least minReplicas run (minReplicas - 1 when
 * replicas == minReplicas, which could never roll otherwise): those
 * already draining first, then Pending ones (unavailable anyway), then
 * Running ones from the highest ordinal down. Fills *p; the caller frees it with
 * reconcile_plan_cleanup(). Returns 0 or -ENOMEM. */
int reconcile_plan(const struct reconcile_spec *s, uint32_t restarts,
                   const struct reconcile_pod_view *pods, size_t n, struct reconcile_plan *p);
void reconcile_plan_cleanup(struct reconcile_plan *p);

/* One pod name's last failure, for status. Borrowed. */
struct reconcile_pod_failure {
    const char *pod;
    const struct reconcile_failure *f;
    uint32_t backoff_ms;            /* the back-off its replacement waits, 0: none now */
    const char *at;                 /* when it was seen, RFC 3339 */
};

/* The broker's view of the cohort, borrowed. */
struct reconcile_member {
    const char *id, *address;
    uint64_t model_version;
    bool draining;
};

/* What the members report of checkpoints (the newest any of them wrote
 * or resumed from, the newest any found invalid). */
struct reconcile_ckpt_seen {
    uint64_t version;               /* 0: none */
    uint64_t skipped_version;       /* 0: none */
    unsigned skipped_reason;        /* ckpt.h's enum ckpt_reason, as on the wire */
};

/* The name of a skip's reason as ckpt.h's ckpt_reason_str() gives it
 * ("truncated", "checksum mismatch", ...; "unknown" for a code this
 * build does not know). The numbers are the wire's
 * (CheckpointSkipped.reason); a unit test holds the two lists equal. */
const char *reconcile_ckpt_reason(unsigned reason);

struct reconcile_observed {
    int64_t generation;
    const char *selector;
    uint32_t pods;                  /* pods that exist and are not terminating */
    uint32_t restarts;
    uint32_t draining;              /* excess pods still being drained */
    bool broker_known;              /* the broker has the cohort */
    uint64_t epoch;
    const char *leader;             /* NULL: none */
    const struct reconcile_member *members;
    size_t n_members;
    const struct reconcile_plan *plan;      /* NULL with `invalid` */
    const struct reconcile_why *invalid;    /* non-NULL: the spec was refused */
    /* A create or delete the API refused in this pass (reason FailedCreate
     * or FailedDelete): the ReplicaFailure condition. NULL: none. */
    const struct reconcile_why *replica_failure;
    /* The last failure of each pod name that failed (a member's entry
     * gets it as lastFailure; a pod that is no member gets an entry of
     * its own). */
    const struct reconcile_pod_failure *failures;
    size_t n_failures;
    struct reconcile_ckpt_seen ckpt;        /* all zero: nothing reported */
};

/* The status the cohort should have. status.checkpoint: the newest
 * version the members report (o->ckpt), kept from `old` while none
 * reports one as new, unless a member set that one aside; its time is
 * `now` when the version changes; lastSkipped is the newest skip seen.
 * Conditions (Available, Progressing,
 * Degraded, Failed, Suspended, Complete, and ReplicaFailure while the API
 * refuses a create or delete) keep their lastTransitionTime
 * from `old` (borrowed, may be NULL) while their status stays the same;
 * `now` is an RFC 3339 time for those that change. Returns a new object
 * (caller frees) or NULL on allocation failure. */
cJSON *reconcile_status(const struct reconcile_spec *s, const struct reconcile_observed *o,
                        const cJSON *old, const char *now);

/* True when a and b (status objects, either may be NULL) differ in
 * anything but model versions: such a difference is written at once,
 * while model versions, which move with every round, are written at most
 * once per status period. */
bool reconcile_status_differs(const cJSON *a, const cJSON *b, bool ignore_versions);

/* A JSON merge patch {"status": ...} taking `old` to `want`: fields in old
 * and not in want are set to null, inside objects both have too. Returns
 * a new object or NULL. */
cJSON *reconcile_status_patch(const cJSON *old, const cJSON *want);

#endif

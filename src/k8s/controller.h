/* src/k8s/controller.h: the TrainingCohort controller. Keeps caches of the
 * cohorts and their pods (reflector.h), queues a cohort's key whenever
 * either changes or its broker membership moves (workq.h), and reconciles
 * one key at a time: makes the cohort's Secret if it has none and gives
 * the broker the key it holds (keys.h), declares the cohort in the broker,
 * creates, replaces and drains pods as reconcile.h decides, writes status
 * through the status subresource when it changes, and records Events.
 *
 * Only the leader runs a controller (operator/main.c starts one when it
 * takes the Lease and stops it when it loses it). What the controller
 * remembers between reconciles (restarts counted, drains under way, the
 * status last written, the keys) is a cache of what the API server and
 * the broker hold: a new leader rebuilds it from status, the Secrets and
 * the broker.
 */
#ifndef COHORT_CONTROLLER_H
#define COHORT_CONTROLLER_H

#include <stdbool.h>
#include <stdint.h>

#include "k8s/reconcile.h"

struct kube;
struct brokerd;
struct controller;

struct controller_config {
    struct kube *kube;              /* borrowed; outlives the controller */
    struct brokerd *broker;         /* borrowed; outlives the controller */
    const char *namespace;          /* watch one namespace; NULL or "": all. Copied */
    const char *identity;           /* reportingInstance of Events; copied */
    struct reconcile_env env;       /* strings copied */
    /* The broker's CA certificate (PEM, copied), which every cohort's
     * Secret carries as ca.crt when the broker serves TLS; NULL: no TLS. */
    const char *broker_ca_pem;
    uint32_t workers;               /* reconciling threads; 0: 2 */
    uint32_t status_period_ms;      /* model-version-only status writes at most this
                                     * often per cohort; 0: 5000 */
    uint32_t resync_ms;             /* every cohort reconciled at least this often; 0: 30000 */
    uint32_t broker_poll_ms;        /* how often broker membership is compared; 0: 250 */
    uint32_t drain_timeout_ms;      /* 0: 2 x the cohort's member timeout */
    unsigned watch_timeout_s;       /* per watch request; 0: 300 */
    /* Asked every 100 ms while controller_start() waits for its caches:
     * true ends the wait with -ECANCELED (a SIGTERM must not wait out the
     * sync timeout). NULL: never. */
    bool (*cancelled)(void *arg);
    void *cancel_arg;
};

/* Whether the API server serves TrainingCohorts, by discovery of
 * /apis/cohort.dev/v1alpha1: 0 when it lists trainingcohorts, -ENOENT when
 * it does not (the CRD is not installed, or not yet Established), another
 * -errno when the server cannot tell. Discovery needs no RBAC rule (every
 * authenticated client has system:discovery). */
int controller_crd_served(struct kube *kube);

/* Starts the reflectors (cohorts, their pods, their Secrets), waits up to
 * `sync_timeout_ms` for their first lists, declares every cached cohort in
 * the broker with the key its Secret holds, then starts the workers. Returns
 * 0, -EINVAL, -ETIMEDOUT (caches did not fill; nothing is left running),
 * -ECANCELED (cfg->cancelled said so while waiting), -ENOMEM, -EAGAIN. The caller stops and frees it with
 * controller_stop(). */
int controller_start(const struct controller_config *cfg, uint32_t sync_timeout_ms,
                     struct controller **out);
/* Stops the workers and reflectors and frees everything. Pods, drains and
 * the broker are left as they are, for the next leader. NULL is fine. */
void controller_stop(struct controller *c);

struct controller_stats {
    uint64_t reconciles, reconcile_errors;
    uint64_t pods_created, pods_deleted, pods_replaced, drains_started, drain_timeouts;
    uint64_t status_writes, events;
    uint64_t keys_created, pods_rolled;
    uint64_t watch_errors, relists;
    uint32_t queue_depth, cohorts, pods;
    bool synced;
};
void controller_stats(struct controller *c, struct controller_stats *out);

#endif

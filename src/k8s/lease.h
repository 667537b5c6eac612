/* src/k8s/lease.h: leader election among operator replicas through a
 * coordination.k8s.io/v1 Lease, as client-go's leaderelection does it:
 *
 * - A candidate takes the Lease when it is free, or when the holder has not
 *   renewed it for lease_duration as measured on the candidate's own clock
 *   since the candidate last saw the record change (so clock skew between
 *   replicas does not matter).
 * - Every write is an update at the resourceVersion read: of two
 *   candidates racing, the API server lets exactly one win (409 for the
 *   other).
 * - The leader renews every retry_period; if it cannot renew for
 *   renew_deadline, it stops leading before anyone else can take over
 *   (renew_deadline < lease_duration).
 * - On stop, a leader releases the Lease so a successor need not wait.
 *
 * Defaults: 15 s / 10 s / 2 s.
 */
#ifndef COHORT_LEASE_H
#define COHORT_LEASE_H

#include <stdbool.h>
#include <stdint.h>

struct kube;
struct lease;

/* Called on the elector's thread when leadership starts or stops. */
typedef void (*lease_fn)(void *arg, bool leading);

struct lease_config {
    struct kube *kube;          /* borrowed; outlives the elector */
    const char *namespace;      /* copied */
    const char *name;           /* copied */
    const char *identity;       /* copied; unique per replica (the pod name) */
    uint32_t lease_duration_ms; /* 0: 15000 */
    uint32_t renew_deadline_ms; /* 0: 10000 */
    uint32_t retry_period_ms;   /* 0: 2000 */
    lease_fn on_change;         /* may be NULL */
    void *arg;
};

/* Starts campaigning on a thread of its own. Returns 0, -EINVAL (missing
 * fields, or not retry < renew deadline < lease duration), -ENOMEM,
 * -EAGAIN. The caller stops it with lease_destroy(). */
int lease_start(const struct lease_config *cfg, struct lease **out);
/* Stops campaigning, releases the Lease if held, and frees. NULL is fine. */
void lease_destroy(struct lease *l);
/* Releases nothing: the Lease expires on its own, as after a crash. For
 * tests of failover. */
void lease_abandon(struct lease *l);
bool lease_is_leader(struct lease *l);
/* Leadership changes seen so far (for tests and /metrics). */
uint64_t lease_transitions(struct lease *l);

#endif

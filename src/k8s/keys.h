/* src/k8s/keys.h: a cohort's Secret, the pure part. Each TrainingCohort
 * NS/NAME has a Secret NS/NAME-cohort-key that the operator makes once,
 * holding the cohort's 256-bit key (`key`: 64 hex digits, base/secret.h)
 * and, when the broker serves TLS, the broker's CA certificate (`ca.crt`,
 * PEM). It is owned by the cohort (a controller owner reference), so it
 * goes when the cohort goes. The Secret is the source of truth: the
 * operator reads the key back from it, so a restarted operator, or a new
 * leader, keeps every cohort's key.
 *
 * The sidecar of every trainer pod mounts it read-only at
 * /etc/cohort/secret (mode 0400) and reads COHORT_SECRET_FILE and
 * COHORT_BROKER_CA from there; the trainer container does not mount it.
 * Each pod is annotated with the id of the key and CA it was made with
 * (keys_id), so that a pod made before the key or the CA changed can be
 * told apart and replaced.
 *
 * Its name, its keys' names and where pods mount it are the pod's business
 * (reconcile.h); what it holds is this module's. No I/O here: controller.c
 * reads and writes the Secrets.
 */
#ifndef COHORT_KEYS_H
#define COHORT_KEYS_H

#include <stdbool.h>
#include <stddef.h>

#include <cjson/cJSON.h>

#include "base/secret.h"
#include "k8s/reconcile.h"

#define KEYS_ID_CHARS 16

/* The Secret for cohort `tc` (borrowed) holding `key` and, unless NULL,
 * `ca_pem` as ca.crt: type Opaque, the label cohort.dev/cohort=NAME, a
 * controller owner reference with blockOwnerDeletion. Returns 0 and sets
 * *out (caller frees with cJSON_Delete), -EINVAL (tc lacks a name,
 * namespace or uid), -ENOMEM. */
int keys_secret(const cJSON *tc, const struct secret *key, const char *ca_pem, cJSON **out);

/* Whether cohort `tc` may use Secret `secret` (both borrowed): it must
 * carry an owner reference to tc's uid, and data.key must be a key.
 * Returns 0 and sets *key, or -EINVAL with *why filled (reason
 * SecretConflict: someone else's Secret holds the name; SecretInvalid:
 * ours, but its key does not parse). Nothing is changed: a Secret that is
 * not ours is never overwritten. */
int keys_adopt(const cJSON *tc, const cJSON *secret, struct secret *key,
               struct reconcile_why *why);

/* The merge patch that makes `secret` hold `ca_pem` as ca.crt (NULL:
 * none). Returns 0 with *out NULL when it already does, 0 with a new
 * patch (caller frees), or -ENOMEM. */
int keys_ca_patch(const cJSON *secret, const char *ca_pem, cJSON **out);

/* An id of the key and CA (NULL: none) pods are made with: 16 hex digits
 * of an HMAC under the key, so it says nothing of the key. Returns 0 or
 * -EIO. */
int keys_id(const struct secret *key, const char *ca_pem, char out[KEYS_ID_CHARS + 1]);

#endif

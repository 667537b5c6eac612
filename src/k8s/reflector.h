/* src/k8s/reflector.h: keeps a local copy of one kind of object (for cohort:
 * TrainingCohorts, and the pods they own) in step with the API server, by
 * list then watch, the way client-go's reflector and informer do:
 *
 * - a list fills the cache and sets the resourceVersion to watch from;
 * - watch events (with bookmarks) keep it current; when the server ends a
 *   watch, the next one resumes from the last resourceVersion seen;
 * - 410 Gone (the version fell out of the server's window) means list
 *   again; the objects that vanished meanwhile are reported deleted;
 * - other errors back off (500 ms doubling to 30 s) and resume.
 *
 * Handlers run on the reflector's thread with no lock of its held; they
 * should only note the key (a work queue add) and return.
 */
#ifndef COHORT_REFLECTOR_H
#define COHORT_REFLECTOR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

struct kube;
struct reflector;

/* `key` is "namespace/name" (or "name" for cluster objects); `obj` is
 * borrowed for the call (for deletes, the last state known). */
typedef void (*reflector_fn)(void *arg, const char *key, const cJSON *obj);

struct reflector_config {
    struct kube *kube;          /* borrowed; outlives the reflector */
    const char *path;           /* collection path, copied:
                                 * "/apis/cohort.dev/v1alpha1/trainingcohorts" */
    const char *selector;       /* label selector or NULL; copied */
    unsigned watch_timeout_s;   /* per watch; 0: 300 */
    reflector_fn on_upsert;     /* added or changed */
    reflector_fn on_delete;
    void *arg;                  /* borrowed */
};

/* Starts the reflector's thread. Returns 0, -EINVAL, -ENOMEM, -EAGAIN.
 * The caller stops and frees it with reflector_destroy(). */
int reflector_start(const struct reflector_config *cfg, struct reflector **out);
/* Stops the thread (within about 200 ms) and frees the cache. NULL is fine. */
void reflector_destroy(struct reflector *r);

/* True once the first list has filled the cache. */
bool reflector_synced(struct reflector *r);
/* Waits up to timeout_ms for reflector_synced(). */
bool reflector_wait_synced(struct reflector *r, uint32_t timeout_ms);

/* A copy of the cached object for `key` (caller frees with cJSON_Delete),
 * or NULL. */
cJSON *reflector_get(struct reflector *r, const char *key);
/* Copies of every cached object whose key starts with `prefix` (NULL: all),
 * as a new array the caller frees. */
cJSON *reflector_list(struct reflector *r, const char *prefix);

/* Objects in the cache. */
size_t reflector_len(struct reflector *r);

/* Counters for tests and /metrics. */
struct reflector_stats {
    uint64_t lists, watches, relists_gone, errors, events;
};
void reflector_stats(struct reflector *r, struct reflector_stats *out);

#endif

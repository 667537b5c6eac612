/* src/membership/epoch.h: one cohort's membership at one moment: the number, the
 * ordered members and the leader. The broker publishes these and members
 * receive them; both sides share this one type and its wire conversion. */
#ifndef COHORT_EPOCH_H
#define COHORT_EPOCH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cohort.pb-c.h"

struct epoch_member {
    char *id;
    char *address;
    uint64_t model_version;
};

/* Immutable once built and shared by reference; the count is atomic, so
 * any thread may drop a reference. */
struct epoch {
    char *cohort;
    uint64_t number;
    size_t leader;                      /* index into members; 0 when empty */
    size_t n_members;
    struct epoch_member *members;       /* in member order */
    int refs;                           /* private: epoch_ref/epoch_unref */
    bool ordered;                       /* private: ids strictly in member order */
};

/* Builds an epoch from copies of `cohort` and `members`. Returns 0,
 * -EINVAL (leader out of range), -ENOMEM. The caller owns the one
 * reference in *out. */
int epoch_create(const char *cohort, uint64_t number, size_t leader,
                 const struct epoch_member *members, size_t n, struct epoch **out);
struct epoch *epoch_ref(struct epoch *e);       /* NULL is fine */
void epoch_unref(struct epoch *e);              /* NULL is fine */

/* The leader's id, or NULL for an empty epoch. */
const char *epoch_leader_id(const struct epoch *e);
/* Index of `id` in the member list, or -1. O(log n) for an epoch in
 * member order (every epoch the broker forms or a member accepts), by
 * bisection; a scan otherwise. */
long epoch_find(const struct epoch *e, const char *id);

/* Fills `p` to describe `e`, pointing into e's strings (borrowed) and into
 * `ptrs`/`storage`, arrays of e->n_members the caller provides. */
void epoch_to_proto(const struct epoch *e, Cohort__V1__Epoch *p, Cohort__V1__Member **ptrs,
                    Cohort__V1__Member *storage);

/* Checks and copies a received epoch: ids and addresses valid, ids unique
 * and in member order, the leader one of the members. Returns 0, -EINVAL
 * (with the reason in *why, a static string), -ENOMEM. */
int epoch_from_proto(const Cohort__V1__Epoch *p, struct epoch **out, const char **why);

#endif

/* src/membership/epoch.c: see epoch.h. */
#include "membership/epoch.h"

#include <errno.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "base/ident.h"

#define REFS(e) ((_Atomic int *)&(e)->refs)

static void free_members(struct epoch_member *m, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        free(m[i].id);
        free(m[i].address);
    }
    free(m);
}

int epoch_create(const char *cohort, uint64_t number, size_t leader,
                 const struct epoch_member *members, size_t n, struct epoch **out)
{
    struct epoch *e;

    if ((n > 0 && leader >= n) || (n == 0 && leader != 0))
        return -EINVAL;
    e = calloc(1, sizeof(*e));
    if (!e)
        return -ENOMEM;
    e->cohort = strdup(cohort);
    e->members = calloc(n ? n : 1, sizeof(*e->members));
    if (!e->cohort || !e->members)
        goto err;
    for (size_t i = 0; i < n; i++) {
        e->members[i].id = strdup(members[i].id);
        e->members[i].address = strdup(members[i].address);
        e->members[i].model_version = members[i].model_version;
        e->n_members = i + 1;
        if (!e->members[i].id || !e->members[i].address)
            goto err;
    }
    e->number = number;
    e->leader = leader;
    /* Checked once here, so that epoch_find can bisect: a member looks
     * up every peer its engine reports unreachable, thousands at once in
     * a partition of an epoch of up to 10,000. */
    e->ordered = true;
    for (size_t i = 1; i < n && e->ordered; i++)
        e->ordered = ident_natural_cmp(e->members[i - 1].id, e->members[i].id) < 0;
    atomic_init(REFS(e), 1);
    *out = e;
    return 0;
err:
    free_members(e->members, e->n_members);
    free(e->cohort);
    free(e);
    return -ENOMEM;
}

struct epoch *epoch_ref(struct epoch *e)
{
    if (e)
        atomic_fetch_add(REFS(e), 1);
    return e;
}

void epoch_unref(struct epoch *e)
{
    if (!e || atomic_fetch_sub(REFS(e), 1) != 1)
        return;
    free_members(e->members, e->n_members);
    free(e->cohort);
    free(e);
}

const char *epoch_leader_id(const struct epoch *e)
{
    return e->n_members ? e->members[e->leader].id : NULL;
}

long epoch_find(const struct epoch *e, const char *id)
{
    if (e->ordered) {
        /* ident_natural_cmp is a total order that is 0 only for equal
         * strings, so bisection finds exactly what the scan would. */
        size_t lo = 0, hi = e->n_members;

        while (lo < hi) {
            size_t mid = lo + (hi - lo) / 2;
            int r = ident_natural_cmp(e->members[mid].id, id);

            if (r == 0)
                return (long)mid;
            if (r < 0)
                lo = mid + 1;
            else
                hi = mid;
        }
        return -1;
    }
    for (size_t i = 0; i < e->n_members; i++)
        if (strcmp(e->members[i].id, id) == 0)
            return (long)i;
    return -1;
}

void epoch_to_proto(const struct epoch *e, Cohort__V1__Epoch *p, Cohort__V1__Member **ptrs,
                    Cohort__V1__Member *storage)
{
    cohort__v1__epoch__init(p);
    p->cohort = e->cohort;
    p->epoch = e->number;
    p->leader = e->n_members ? e->members[e->leader].id : (char *)"";
    for (size_t i = 0; i < e->n_members; i++) {
        cohort__v1__member__init(&storage[i]);
        storage[i].id = e->members[i].id;
        storage[i].address = e->members[i].address;
        storage[i].model_version = e->members[i].model_version;
        ptrs[i] = &storage[i];
    }
    p->n_members = e->n_members;
    p->members = ptrs;
}

int epoch_from_proto(const Cohort__V1__Epoch *p, struct epoch **out, const char **why)
{
    struct epoch_member *m;
    size_t leader = 0;
    bool found = p->n_members == 0 && p->leader[0] == '\0';
    int rc;

    if (!ident_valid_cohort(p->cohort)) {
        *why = "invalid cohort name";
        return -EINVAL;
    }
    m = calloc(p->n_members ? p->n_members : 1, sizeof(*m));
    if (!m)
        return -ENOMEM;
    for (size_t i = 0; i < p->n_members; i++) {
        const Cohort__V1__Member *pm = p->members[i];
        if (!ident_valid_member_id(pm->id) || !ident_valid_address(pm->address)) {
            *why = "invalid member id or address";
            rc = -EINVAL;
            goto out;
        }
        if (i > 0 && ident_natural_cmp(p->members[i - 1]->id, pm->id) >= 0) {
            *why = "members not unique or not in member order";
            rc = -EINVAL;
            goto out;
        }
        if (strcmp(pm->id, p->leader) == 0) {
            leader = i;
            found = true;
        }
        /* Borrowed for epoch_create, which copies. */
        m[i].id = pm->id;
        m[i].address = pm->address;
        m[i].model_version = pm->model_version;
    }
    if (!found) {
        *why = "the leader is not a member";
        rc = -EINVAL;
        goto out;
    }
    rc = epoch_create(p->cohort, p->epoch, leader, m, p->n_members, out);
out:
    free(m);
    return rc;
}

/* tests/fuzz/fuzz_epoch.c: an Epoch as a member receives it on its Watch
 * stream (proto/cohort.proto): protobuf-c's unpack, then the member's
 * check and copy (epoch_from_proto, src/membership/epoch.h), which is all
 * that stands between the bytes and the schedule the engine builds.
 *
 * Invariants: an accepted epoch has a valid cohort name, members with
 * valid ids and addresses in strict natural order (so none twice), and a
 * leader among them (or none when empty); written back to protobuf
 * (epoch_to_proto), packed and unpacked, it is accepted again and is the
 * same epoch. */
#include "fuzz.h"

#include <errno.h>

#include "base/ident.h"
#include "cohort.pb-c.h"
#include "membership/epoch.h"

static void check(const struct epoch *e)
{
    CHECK(ident_valid_cohort(e->cohort));
    CHECK(e->n_members == 0 ? e->leader == 0 : e->leader < e->n_members);
    for (size_t i = 0; i < e->n_members; i++) {
        CHECK(ident_valid_member_id(e->members[i].id));
        CHECK(ident_valid_address(e->members[i].address));
        CHECK(i == 0 || ident_natural_cmp(e->members[i - 1].id, e->members[i].id) < 0);
    }
}

static bool same(const struct epoch *a, const struct epoch *b)
{
    if (strcmp(a->cohort, b->cohort) != 0 || a->number != b->number || a->leader != b->leader ||
        a->n_members != b->n_members)
        return false;
    for (size_t i = 0; i < a->n_members; i++)
        if (strcmp(a->members[i].id, b->members[i].id) != 0 ||
            strcmp(a->members[i].address, b->members[i].address) != 0 ||
            a->members[i].model_version != b->members[i].model_version)
            return false;
    return true;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    Cohort__V1__Epoch *p = cohort__v1__epoch__unpack(NULL, size, data), back, *again;
    Cohort__V1__Member **ptrs, *storage;
    struct epoch *e = NULL, *e2 = NULL;
    const char *why = NULL;
    uint8_t *buf;
    size_t len;
    int rc;

    if (!p)
        return 0;
    rc = epoch_from_proto(p, &e, &why);
    CHECK(rc == 0 || rc == -EINVAL || rc == -ENOMEM);
    if (rc == -EINVAL)
        CHECK(why && *why);
    if (rc < 0)
        goto out;
    check(e);
    CHECK(strcmp(e->cohort, p->cohort) == 0 && e->number == p->epoch);
    CHECK(e->n_members == p->n_members);
    ptrs = calloc(e->n_members + 1, sizeof(*ptrs));
    storage = calloc(e->n_members + 1, sizeof(*storage));
    CHECK(ptrs && storage);
    epoch_to_proto(e, &back, ptrs, storage);
    len = cohort__v1__epoch__get_packed_size(&back);
    buf = malloc(len + 1);
    CHECK(buf && cohort__v1__epoch__pack(&back, buf) == len);
    again = cohort__v1__epoch__unpack(NULL, len, buf);
    CHECK(again);
    CHECK(epoch_from_proto(again, &e2, &why) == 0);
    CHECK(same(e, e2));
    epoch_unref(e2);
    cohort__v1__epoch__free_unpacked(again, NULL);
    free(buf);
    free(storage);
    free(ptrs);
    epoch_unref(e);
out:
    cohort__v1__epoch__free_unpacked(p, NULL);
    return 0;
}

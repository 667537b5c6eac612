/* tests/unit/test_epoch.c: the epoch type and the checks applied to every
 * epoch a member receives. */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "membership/epoch.h"

static const struct epoch_member three[] = {
    { "m-2", "127.0.0.1:4002", 5 },
    { "m-10", "127.0.0.1:4010", 7 },
    { "m-11", "10.0.0.11:4011", 1 },
};

Test(epoch, create_copies_and_refcounts)
{
    struct epoch *e;
    char id[] = "m-2";
    struct epoch_member m = { id, "127.0.0.1:1", 3 };

    cr_assert_eq(epoch_create("demo", 9, 0, &m, 1, &e), 0);
    id[0] = 'x';                        /* copied, not borrowed */
    cr_assert_str_eq(e->members[0].id, "m-2");
    cr_assert_str_eq(epoch_leader_id(e), "m-2");
    cr_assert_eq(epoch_find(e, "m-2"), 0);
    cr_assert_eq(epoch_find(e, "m-3"), -1);
    cr_assert_eq(epoch_ref(e), e);
    epoch_unref(e);
    epoch_unref(e);
    epoch_unref(NULL);
    cr_assert_null(epoch_ref(NULL));
}

Test(epoch, create_refuses_leader_out_of_range)
{
    struct epoch *e = NULL;

    cr_assert_eq(epoch_create("demo", 1, 3, three, 3, &e), -EINVAL);
    cr_assert_eq(epoch_create("demo", 1, 1, NULL, 0, &e), -EINVAL);
    cr_assert_null(e);
    cr_assert_eq(epoch_create("demo", 1, 0, NULL, 0, &e), 0);
    cr_assert_null(epoch_leader_id(e));
    epoch_unref(e);
}

/* Round trip through the wire form, then back through the checks. */
static int round_trip(const struct epoch_member *ms, size_t n, const char *leader,
                      struct epoch **out, const char **why)
{
    Cohort__V1__Epoch p = COHORT__V1__EPOCH__INIT;
    Cohort__V1__Member storage[8], *ptrs[8];

    p.cohort = "demo";
    p.epoch = 4;
    p.leader = (char *)leader;
    for (size_t i = 0; i < n; i++) {
        cohort__v1__member__init(&storage[i]);
        storage[i].id = ms[i].id;
        storage[i].address = ms[i].address;
        storage[i].model_version = ms[i].model_version;
        ptrs[i] = &storage[i];
    }
    p.n_members = n;
    p.members = ptrs;
    return epoch_from_proto(&p, out, why);
}

Test(epoch, wire_round_trip_keeps_everything)
{
    struct epoch *e, *back;
    Cohort__V1__Epoch p;
    Cohort__V1__Member storage[3], *ptrs[3];
    const char *why = NULL;

    cr_assert_eq(epoch_create("demo", 12, 1, three, 3, &e), 0);
    epoch_to_proto(e, &p, ptrs, storage);
    cr_assert_eq(epoch_from_proto(&p, &back, &why), 0, "%s", why);
    cr_assert_eq(back->number, 12);
    cr_assert_eq(back->n_members, 3);
    cr_assert_str_eq(epoch_leader_id(back), "m-10");
    for (size_t i = 0; i < 3; i++) {
        cr_assert_str_eq(back->members[i].id, three[i].id);
        cr_assert_str_eq(back->members[i].address, three[i].address);
        cr_assert_eq(back->members[i].model_version, three[i].model_version);
    }
    epoch_unref(back);
    epoch_unref(e);
}

Test(epoch, received_epochs_are_checked)
{
    struct epoch *e = NULL;
    const char *why = NULL;
    struct epoch_member swapped[] = { three[1], three[0] };
    struct epoch_member dup[] = { three[0], three[0] };
    struct epoch_member bad_id[] = { { "m 1", "127.0.0.1:1", 0 } };
    struct epoch_member bad_addr[] = { { "m-1", "127.0.0.1", 0 } };

    cr_assert_eq(round_trip(swapped, 2, "m-2", &e, &why), -EINVAL);
    cr_assert(strstr(why, "order"), "%s", why);
    cr_assert_eq(round_trip(dup, 2, "m-2", &e, &why), -EINVAL);
    cr_assert_eq(round_trip(bad_id, 1, "m 1", &e, &why), -EINVAL);
    cr_assert_eq(round_trip(bad_addr, 1, "m-1", &e, &why), -EINVAL);
    cr_assert_eq(round_trip(three, 3, "m-99", &e, &why), -EINVAL);
    cr_assert(strstr(why, "leader"), "%s", why);
    cr_assert_eq(round_trip(NULL, 0, "ghost", &e, &why), -EINVAL);
    cr_assert_null(e);
    cr_assert_eq(round_trip(NULL, 0, "", &e, &why), 0);
    cr_assert_eq(e->n_members, 0);
    epoch_unref(e);
}

/* Lookups bisect an epoch in member order (a member looks up each peer
 * its engine reports, thousands at once in epochs of up to 10,000) and
 * find exactly what a scan finds; an epoch out of member order, which
 * neither the broker nor a member's checks produce, is scanned. */
Test(epoch, find_bisects_in_member_order_and_scans_otherwise)
{
    static struct epoch_member ms[10000];
    static char ids[10000][16], addr[] = "127.0.0.1:1";
    const struct epoch_member shuffled[] = {
        { "m-10", "127.0.0.1:1", 0 }, { "m-2", "127.0.0.1:1", 0 }, { "m-11", "127.0.0.1:1", 0 },
    };
    struct epoch *e;

    for (size_t i = 0; i < 10000; i++) {
        /* "m-0002" sorts with "m-2"'s value: zero padding on some. */
        snprintf(ids[i], sizeof(ids[i]), i % 3 ? "m-%zu" : "m-%04zu", i);
        ms[i] = (struct epoch_member){ ids[i], addr, 0 };
    }
    cr_assert_eq(epoch_create("demo", 1, 0, ms, 10000, &e), 0);
    for (size_t i = 0; i < 10000; i++)
        cr_assert_eq(epoch_find(e, ids[i]), (long)i, "%s", ids[i]);
    cr_assert_eq(epoch_find(e, "m-10000"), -1);
    cr_assert_eq(epoch_find(e, "m-3"), -1, "m-0003 is there, m-3 is not");
    cr_assert_eq(epoch_find(e, ""), -1);
    cr_assert_eq(epoch_find(e, "n-1"), -1);
    epoch_unref(e);

    cr_assert_eq(epoch_create("demo", 1, 0, shuffled, 3, &e), 0);
    cr_assert_eq(epoch_find(e, "m-10"), 0);
    cr_assert_eq(epoch_find(e, "m-2"), 1);
    cr_assert_eq(epoch_find(e, "m-11"), 2);
    cr_assert_eq(epoch_find(e, "m-3"), -1);
    epoch_unref(e);
}

/* tests/unit/test_lineage.c: the record of which epoch committed which
 * version, that decides whether a member behind the leader drops its
 * pending contributions (node.c). */
#include <criterion/criterion.h>
#include <errno.h>
#include <string.h>

#include "accumulator/lineage.h"
#include "membership/epoch.h"

Test(lineage, a_round_committed_in_the_members_own_epoch_holds_its_contributions)
{
    struct lineage l;

    /* Versions 1-10 in epoch A, where the member took part in round 11's
     * last step; the others finished 11 and 12 there... */
    lineage_reset(&l, 0);
    for (uint64_t v = 1; v <= 12; v++)
        lineage_commit(&l, 0xA, v);
    cr_assert_eq(lineage_holds(&l, 11, 0xA), LINEAGE_YES);
    cr_assert_eq(l.n, 1);
    /* ... but not if it last reduced them in another epoch. */
    cr_assert_eq(lineage_holds(&l, 11, 0xB), LINEAGE_NO);
}

Test(lineage, seed_1015_rounds_of_an_epoch_without_the_member_do_not)
{
    struct lineage l;

    /* 1-10 in epoch 1 (the member's last), 11-12 in epoch 2 without it. */
    lineage_reset(&l, 0);
    for (uint64_t v = 1; v <= 10; v++)
        lineage_commit(&l, 1, v);
    lineage_commit(&l, 2, 11);
    lineage_commit(&l, 2, 12);
    cr_assert_eq(l.n, 2);
    cr_assert_eq(lineage_holds(&l, 11, 1), LINEAGE_NO);
    cr_assert_eq(lineage_holds(&l, 11, 2), LINEAGE_YES);
    cr_assert_eq(lineage_holds(&l, 10, 1), LINEAGE_YES);
    /* Above the newest: the state does not hold that round at all. */
    cr_assert_eq(lineage_holds(&l, 13, 2), LINEAGE_NO);
}

Test(lineage, versions_at_or_below_the_base_are_unknown)
{
    struct lineage l;

    lineage_reset(&l, 40);              /* declared, or from a checkpoint */
    cr_assert_eq(lineage_holds(&l, 40, 7), LINEAGE_UNKNOWN);
    cr_assert_eq(lineage_holds(&l, 41, 7), LINEAGE_NO);
    lineage_commit(&l, 7, 41);
    cr_assert_eq(lineage_holds(&l, 41, 7), LINEAGE_YES);
    cr_assert_eq(lineage_holds(&l, 12, 7), LINEAGE_UNKNOWN);
    /* A version that does not follow the newest restarts the record. */
    lineage_commit(&l, 8, 50);
    cr_assert_eq(l.base, 49);
    cr_assert_eq(lineage_holds(&l, 41, 7), LINEAGE_UNKNOWN);
    cr_assert_eq(lineage_holds(&l, 50, 8), LINEAGE_YES);
}

Test(lineage, the_oldest_runs_are_let_go_and_become_unknown)
{
    struct lineage l;

    lineage_reset(&l, 0);
    for (uint64_t v = 1; v <= LINEAGE_RUNS + 5; v++)
        lineage_commit(&l, 100 + v, v);     /* one epoch per version */
    cr_assert_eq(l.n, LINEAGE_RUNS);
    cr_assert_eq(l.base, 5);
    cr_assert_eq(lineage_holds(&l, 5, 105), LINEAGE_UNKNOWN);
    cr_assert_eq(lineage_holds(&l, 6, 106), LINEAGE_YES);
    cr_assert_eq(lineage_holds(&l, LINEAGE_RUNS + 5, 100 + LINEAGE_RUNS + 5), LINEAGE_YES);
}

Test(lineage, encode_decode_round_trip_and_refusals)
{
    struct lineage l, back, before;
    int64_t w[LINEAGE_WORDS];

    lineage_reset(&l, 3);
    lineage_commit(&l, 9, 4);
    lineage_commit(&l, 9, 5);
    lineage_commit(&l, 11, 6);
    lineage_encode(&l, w);
    cr_assert_eq(lineage_decode(w, &back), 0);
    cr_assert_eq(memcmp(&l, &back, sizeof(l)), 0);

    /* A peer's bad words change nothing. */
    before = back;
    w[1] = LINEAGE_RUNS + 1;                            /* too many runs */
    cr_assert_eq(lineage_decode(w, &back), -EPROTO);
    lineage_encode(&l, w);
    w[3] = 7;                                           /* a gap after base */
    cr_assert_eq(lineage_decode(w, &back), -EPROTO);
    lineage_encode(&l, w);
    w[6] = 8;                                           /* runs not consecutive */
    cr_assert_eq(lineage_decode(w, &back), -EPROTO);
    lineage_encode(&l, w);
    w[4] = 3;                                           /* last before first */
    cr_assert_eq(lineage_decode(w, &back), -EPROTO);
    lineage_encode(&l, w);
    w[2] = 0;                                           /* no epoch */
    cr_assert_eq(lineage_decode(w, &back), -EPROTO);
    lineage_encode(&l, w);
    w[0] = -1;                                          /* base at the top */
    cr_assert_eq(lineage_decode(w, &back), -EPROTO);
    cr_assert_eq(memcmp(&before, &back, sizeof(back)), 0);
}

Test(lineage, epochs_of_one_number_from_different_brokers_differ)
{
    struct epoch_member a[2] = { { .id = "w-0", .address = "127.0.0.1:4000" },
                                 { .id = "w-1", .address = "127.0.0.1:4001" } };
    struct epoch_member b[2] = { { .id = "w-0", .address = "127.0.0.1:4000" },
                                 { .id = "w-1", .address = "127.0.0.1:4002" } };
    struct epoch *e1, *e2, *e3, *e4;

    cr_assert_eq(epoch_create("c", 5, 0, a, 2, &e1), 0);
    cr_assert_eq(epoch_create("c", 5, 0, b, 2, &e2), 0);   /* a restarted w-1 */
    cr_assert_eq(epoch_create("c", 5, 0, a, 1, &e3), 0);   /* w-0 alone */
    cr_assert_eq(epoch_create("c", 6, 0, a, 2, &e4), 0);
    cr_assert_neq(lineage_epoch_id(e1), lineage_epoch_id(e2));
    cr_assert_neq(lineage_epoch_id(e1), lineage_epoch_id(e3));
    cr_assert_neq(lineage_epoch_id(e1), lineage_epoch_id(e4));
    cr_assert_eq(lineage_epoch_id(e1), lineage_epoch_id(e1));
    cr_assert_neq(lineage_epoch_id(e1), 0);
    epoch_unref(e1);
    epoch_unref(e2);
    epoch_unref(e3);
    epoch_unref(e4);
}

Test(lineage, a_commit_of_an_unsure_epoch_is_unknown)
{
    struct lineage l;

    /* Round 89 committed while a newer epoch had reached the engine. */
    lineage_reset(&l, 0);
    for (uint64_t v = 1; v <= 88; v++)
        lineage_commit(&l, 4, v);
    lineage_commit(&l, LINEAGE_UNSURE, 89);
    lineage_commit(&l, 6, 90);
    cr_assert_eq(lineage_holds(&l, 89, 4), LINEAGE_UNKNOWN);
    cr_assert_eq(lineage_holds(&l, 90, 6), LINEAGE_YES);
    cr_assert_eq(lineage_holds(&l, 88, 4), LINEAGE_YES);
}

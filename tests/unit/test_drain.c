/* tests/unit/test_drain.c: the operator's drains: the set of drains under
 * way, and each pass's decision over a leaving pod. */
#include <criterion/criterion.h>
#include <errno.h>

#include "k8s/drain.h"

Test(drain, set_adds_finds_and_forgets)
{
    struct drain_set s = { 0 };
    struct drain_entry *d;

    cr_assert_null(drain_set_find(&s, "w-1"));
    cr_assert_not_null(drain_set_add(&s, "w-1", 100));
    cr_assert_not_null(drain_set_add(&s, "w-2", 200));
    d = drain_set_find(&s, "w-2");
    cr_assert_not_null(d);
    cr_assert_eq(d->started, 200);
    drain_set_forget(&s, "w-1");
    drain_set_forget(&s, "nobody");
    cr_assert_null(drain_set_find(&s, "w-1"));
    cr_assert_eq(drain_set_find(&s, "w-2")->started, 200, "the other drain survives a forget");
    cr_assert_eq(s.n, 1);
    drain_set_cleanup(&s);
    cr_assert_eq(s.n, 0);
    drain_set_cleanup(&s);          /* twice is fine */
}

Test(drain, decisions_over_a_leaving_pod)
{
    struct drain_entry d = { .id = "w-3", .started = 1000 };
    static const struct {
        bool tracked, member;
        int drained;
        uint64_t now;
        enum drain_action want;
    } cases[] = {
        { false, false, 0, 1000, DRAIN_DELETE_STRANGER },   /* holds no round up */
        { false, true, 0, 1000, DRAIN_START },
        { true, true, 0, 1500, DRAIN_WAIT },
        { true, true, 1, 1500, DRAIN_DELETE_DRAINED },
        { true, true, -ENOENT, 1500, DRAIN_DELETE_DRAINED }, /* the broker forgot it */
        { true, true, 0, 1999, DRAIN_WAIT },                 /* deadline 1000 ms */
        { true, true, 0, 2000, DRAIN_DELETE_TIMEOUT },
        { true, true, 1, 9000, DRAIN_DELETE_DRAINED },       /* drained wins over late */
        { true, false, 0, 1500, DRAIN_WAIT },                /* left meanwhile: ask the broker */
    };

    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        cr_assert_eq(drain_decide(cases[i].tracked ? &d : NULL, cases[i].member, cases[i].drained,
                                  cases[i].now, 1000),
                     cases[i].want, "case %zu", i);
}

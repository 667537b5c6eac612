/* tests/unit/test_broker_watch.c: the broker state machine's watchers:
 * what each publish reaches, and when and why a watcher is detached;
 * under the fake host of fixture.h, on an injected clock. */
#include <criterion/criterion.h>

#include <errno.h>

#include "fixture.h"
#include "membership/broker.h"

/* Distinct addresses that stand in for the host's watcher handles. */
static int wa, wb, wc;

Test(broker, watch_delivers_current_epoch_at_once)
{
    fixture_sm_start_ab();
    cr_assert_eq(broker_watch(fixture_sm, "demo", "a", 11, &wa), 0);
    cr_assert_eq(fixture_host.n_pubs, 2);
    cr_assert_eq(fixture_sm_last_pub(), fixture_host.pubs[0].e, "the published epoch itself");
    fixture_sm_assert_published_to(1, (void *[]){ &wa });
}

Test(broker, watch_before_first_epoch_waits_for_it)
{
    fixture_sm_start(NULL);
    cr_assert_eq(fixture_sm_join("a", 0, 1, FIXTURE_T0), 0);
    cr_assert_eq(fixture_sm_join("b", 0, 2, FIXTURE_T0), 0);
    cr_assert_eq(broker_watch(fixture_sm, "demo", "a", 1, &wa), 0);
    cr_assert_eq(broker_watch(fixture_sm, "demo", "b", 2, &wb), 0);
    cr_assert_eq(fixture_host.n_pubs, 0);
    broker_tick(fixture_sm, FIXTURE_HOLD);
    cr_assert_eq(fixture_host.n_pubs, 1);
    fixture_sm_assert_published_to(2, (void *[]){ &wa, &wb });
}

Test(broker, watch_replacing_detaches_old_with_eexist)
{
    fixture_sm_start_ab();
    cr_assert_eq(broker_watch(fixture_sm, "demo", "a", 11, &wa), 0);
    cr_assert_eq(broker_watch(fixture_sm, "demo", "a", 11, &wb), 0);
    fixture_sm_assert_detached(-EEXIST, 1, (void *[]){ &wa });

    fixture_sm_add_c();
    fixture_sm_assert_published_to(1, (void *[]){ &wb });
}

Test(broker, watch_again_with_same_watcher_detaches_nothing)
{
    fixture_sm_start_ab();
    cr_assert_eq(broker_watch(fixture_sm, "demo", "a", 11, &wa), 0);
    cr_assert_eq(broker_watch(fixture_sm, "demo", "a", 11, &wa), 0);
    fixture_sm_assert_detached(0, 0, NULL);
}

Test(broker, unwatch_forgets_silently)
{
    fixture_sm_start_ab();
    cr_assert_eq(broker_watch(fixture_sm, "demo", "a", 11, &wa), 0);
    broker_unwatch(fixture_sm, "demo", "a", &wb);        /* not a's watcher: ignored */
    broker_unwatch(fixture_sm, "demo", "zz", &wa);
    broker_unwatch(fixture_sm, "nope", "a", &wa);
    broker_unwatch(fixture_sm, "demo", "a", &wa);
    fixture_sm_assert_detached(0, 0, NULL);

    fixture_sm_add_c();
    fixture_sm_assert_published_to(0, NULL);
    /* Nor is it detached when a leaves. */
    cr_assert_eq(broker_leave(fixture_sm, FIXTURE_HOLD + 100, "demo", "a", 11), 0);
    fixture_sm_assert_detached(0, 0, NULL);
}

Test(broker, watch_unknown_member_is_enoent)
{
    fixture_sm_start_ab();
    cr_assert_eq(broker_watch(fixture_sm, "demo", "a", 12, &wa), -ENOENT);
    cr_assert_eq(broker_watch(fixture_sm, "demo", "zz", 11, &wa), -ENOENT);
    cr_assert_eq(broker_watch(fixture_sm, "demo", "a", 0, &wa), -ENOENT);
    cr_assert_eq(fixture_host.n_pubs, 1);
}

Test(broker, destroy_detaches_all_watchers_with_eshutdown)
{
    fixture_sm_start_ab();
    fixture_sm_watch_a_b_and_other_c(&wa, &wb, &wc);
    broker_destroy(fixture_sm);
    fixture_sm = NULL;
    fixture_sm_assert_detached(-ESHUTDOWN, 3, (void *[]){ &wa, &wb, &wc });
    /* Published epochs outlive the broker while someone holds them. */
    cr_assert_str_eq(fixture_host.pubs[0].e->cohort, "demo");
}

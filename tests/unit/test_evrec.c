/* tests/unit/test_evrec.c: the Event recorder's decisions: an equal Event
 * raises the count of the one made before, the spam filter's bucket
 * empties and refills, and a forgotten Event is made again. */
#include <criterion/criterion.h>
#include <string.h>

#include "k8s/evrec.h"

Test(evrec, an_equal_event_raises_the_count_of_the_first)
{
    struct evrec *r;
    char name[EVREC_NAME_MAX];
    uint32_t count = 0;

    cr_assert_eq(evrec_create(NULL, &r), 0);
    cr_assert_eq(evrec_decide(r, "ns/a", true, "BackOff", "Back-off x", 1000, name, &count),
                 EVREC_CREATE);
    evrec_note(r, "ns/a", true, "BackOff", "Back-off x", "a.1", 1000);
    cr_assert_eq(evrec_decide(r, "ns/a", true, "BackOff", "Back-off x", 2000, name, &count),
                 EVREC_PATCH);
    cr_assert_str_eq(name, "a.1");
    cr_assert_eq(count, 2);
    cr_assert_eq(evrec_decide(r, "ns/a", true, "BackOff", "Back-off x", 3000, name, &count),
                 EVREC_PATCH);
    cr_assert_eq(count, 3);
    /* Another message, type or object: another Event. */
    cr_assert_eq(evrec_decide(r, "ns/a", true, "BackOff", "Back-off y", 3000, name, &count),
                 EVREC_CREATE);
    cr_assert_eq(evrec_decide(r, "ns/a", false, "BackOff", "Back-off x", 3000, name, &count),
                 EVREC_CREATE);
    cr_assert_eq(evrec_decide(r, "ns/b", true, "BackOff", "Back-off x", 3000, name, &count),
                 EVREC_CREATE);
    /* Ten minutes after the last: a new Event. */
    cr_assert_eq(evrec_decide(r, "ns/a", true, "BackOff", "Back-off x", 3000 + 600000, name,
                              &count), EVREC_CREATE);
    evrec_destroy(r);
}

Test(evrec, a_gone_event_or_object_is_made_again)
{
    struct evrec *r;
    char name[EVREC_NAME_MAX];
    uint32_t count = 0;

    cr_assert_eq(evrec_create(NULL, &r), 0);
    evrec_note(r, "ns/a", true, "R", "m", "a.1", 0);
    evrec_forget_event(r, "a.1");
    cr_assert_eq(evrec_decide(r, "ns/a", true, "R", "m", 1, name, &count), EVREC_CREATE);
    evrec_note(r, "ns/a", true, "R", "m", "a.2", 1);
    evrec_forget(r, "ns/a");
    cr_assert_eq(evrec_decide(r, "ns/a", true, "R", "m", 2, name, &count), EVREC_CREATE);
    evrec_destroy(r);
}

Test(evrec, the_spam_filter_drops_past_the_burst_and_refills)
{
    struct evrec_config cfg = { .burst = 3, .refill_ms = 1000 };
    struct evrec *r;
    char name[EVREC_NAME_MAX];
    uint32_t count = 0;

    cr_assert_eq(evrec_create(&cfg, &r), 0);
    for (int i = 0; i < 3; i++)
        cr_assert_neq(evrec_decide(r, "ns/a", true, "R", "m", 0, name, &count), EVREC_DROP);
    cr_assert_eq(evrec_decide(r, "ns/a", true, "R", "m", 0, name, &count), EVREC_DROP);
    cr_assert_eq(evrec_decide(r, "ns/a", true, "R", "m", 999, name, &count), EVREC_DROP);
    /* Per object: another cohort is not held back. */
    cr_assert_eq(evrec_decide(r, "ns/b", true, "R", "m", 999, name, &count), EVREC_CREATE);
    cr_assert_neq(evrec_decide(r, "ns/a", true, "R", "m", 1000, name, &count), EVREC_DROP);
    cr_assert_eq(evrec_decide(r, "ns/a", true, "R", "m", 1000, name, &count), EVREC_DROP);
    evrec_destroy(r);
}

Test(evrec, a_full_table_forgets_the_oldest)
{
    struct evrec_config cfg = { .max_entries = 2 };
    struct evrec *r;
    char name[EVREC_NAME_MAX];
    uint32_t count = 0;

    cr_assert_eq(evrec_create(&cfg, &r), 0);
    evrec_note(r, "ns/a", true, "R", "1", "e1", 10);
    evrec_note(r, "ns/a", true, "R", "2", "e2", 20);
    evrec_note(r, "ns/a", true, "R", "3", "e3", 30);
    cr_assert_eq(evrec_decide(r, "ns/a", true, "R", "1", 40, name, &count), EVREC_CREATE);
    cr_assert_eq(evrec_decide(r, "ns/a", true, "R", "3", 40, name, &count), EVREC_PATCH);
    cr_assert_str_eq(name, "e3");
    evrec_destroy(r);
}

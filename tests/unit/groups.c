/* tests/unit/groups.c: see groups.h. */
#include "groups.h"

#include <criterion/criterion.h>
#include <stdint.h>

#include "collective/group.h"
#include "fixture.h"
#include "membership/brokerd.h"

static struct brokerd *d;
static char broker[64];
static const char *cohort_name;

void groups_start(const char *cohort)
{
    cohort_name = cohort;
    d = fixture_held_broker_start(cohort, broker, sizeof(broker));
}

void groups_stop(void)
{
    fixture_broker_stop(d);
}

const char *groups_broker(void)
{
    return broker;
}

struct group *groups_make(const char *id)
{
    struct group_config c = { .broker = broker, .cohort = cohort_name, .id = id,
                              .host = "127.0.0.1", .reduce_timeout_ms = 20000 };
    struct group *g = NULL;

    cr_assert_eq(group_create(&c, &g), 0, "group_create(%s)", id);
    return g;
}

bool groups_all_see(struct group **g, int n)
{
    for (int i = 0; i < n; i++) {
        uint32_t r, s = 0;
        if (group_position(g[i], &r, &s, NULL) < 0 || s != (uint32_t)n)
            return false;
    }
    return true;
}

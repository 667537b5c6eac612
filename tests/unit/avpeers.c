/* tests/unit/avpeers.c: see avpeers.h. */
#include "avpeers.h"

#include <criterion/criterion.h>
#include <string.h>

#include "averager/averager.h"
#include "fixture.h"

void *avpeers_step(void *arg)
{
    struct avpeer *p = arg;
    struct averager_step s = { .data = p->data, .weight = p->weight,
                               .alpha = p->alpha ? p->alpha : 1, .no_retries = p->no_retries,
                               .gather = p->gather, .gather_len = strlen(p->gather),
                               .timeout_ms = p->timeout_ms ? p->timeout_ms : FIXTURE_WAIT_MS };

    p->res = NULL;
    p->rc = averager_step(p->a, &s, &p->res);
    return NULL;
}

void avpeers_run(struct avpeer *p, int n)
{
    for (int i = 0; i < n; i++)
        cr_assert_eq(pthread_create(&p[i].t, NULL, avpeers_step, &p[i]), 0);
    for (int i = 0; i < n; i++)
        pthread_join(p[i].t, NULL);
}

void avpeers_free(struct avpeer *p, int n)
{
    for (int i = 0; i < n; i++) {
        averager_result_free(p[i].res);
        averager_destroy(p[i].a);
    }
}

/* tests/unit/fixture.c: see fixture.h. */
#include "fixture.h"

#include <criterion/criterion.h>
#include <stdio.h>

#include "membership/brokerd.h"
#include "rpc/rpc.h"

struct brokerd *fixture_broker_start(const char *cohort, char *addr, size_t addr_len)
{
    struct brokerd_config cfg = { .listen = "127.0.0.1:0" };
    struct brokerd *d;

    cr_assert_eq(rpc_init(), 0);
    broker_config_default(&cfg.broker);
    cfg.broker.startup_hold_ms = 0;
    cfg.broker.heartbeat_ms = 200;
    cfg.broker.timeout_ms = 1500;
    cfg.broker.coalesce_ms = 20;
    cr_assert_eq(brokerd_start(&cfg, &d), 0);
    cr_assert_eq(brokerd_declare(d, cohort, 0, 0), 0);
    snprintf(addr, addr_len, "127.0.0.1:%d", brokerd_port(d));
    return d;
}

void fixture_broker_stop(struct brokerd *d)
{
    brokerd_stop(d);
    rpc_shutdown();
}

/* tests/unit/fixture.h: what more than one test file sets up.
 *
 * - Waiting on a condition with a deadline, for the tests that poll.
 * - A broker service on loopback (brokerd), for the tests whose members,
 *   nodes and trainers need one.
 * - A node's trainer's answer to the state its view asks for, for the
 *   node suites whose trainers carry no state of their own.
 * - The broker state machine under a fake host, driven by an injected
 *   clock, for the broker suite (test_broker_*.c).
 * - A test CA and a server certificate made with the openssl command, for
 *   the TLS tests.
 *
 * The helpers fail the running test with cr_assert on any error, so they
 * belong on the test's own thread; fixture_wait_until() asserts nothing
 * and may run on any. */
#ifndef COHORT_TEST_FIXTURE_H
#define COHORT_TEST_FIXTURE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <criterion/criterion.h>

#include "base/clock.h"
#include "membership/broker.h"

/* ---- waiting ---- */

/* The deadline the waits in the tests get: far beyond what any condition
 * needs on an idle machine, so that only a hang fails on a loaded one. */
#define FIXTURE_WAIT_MS 30000u
/* How often a wait looks again. */
#define FIXTURE_POLL_MS 5u

/* Asks pred(arg) every FIXTURE_POLL_MS until it holds or within_ms have
 * passed, and once more at the deadline. Returns whether it held; the
 * caller asserts (or, on a thread of its own, acts) on that. arg is
 * borrowed. */
bool fixture_wait_until(bool (*pred)(void *arg), void *arg, uint32_t within_ms);

/* The CLOCK_MONOTONIC millisecond that is within_ms from now, and whether
 * it is still ahead: the two halves of FIXTURE_WAIT_FOR. */
uint64_t fixture_deadline(uint32_t within_ms);
bool fixture_before(uint64_t deadline);

/* fixture_wait_until() for a condition written in place (any expression,
 * evaluated again on every poll), with FIXTURE_WAIT_MS. Fails the test
 * with the printf-style message that follows `cond` if it never holds. */
#define FIXTURE_WAIT_FOR(cond, ...)                                                \
    do {                                                                           \
        for (uint64_t fixture_end_ = fixture_deadline(FIXTURE_WAIT_MS);            \
             !(cond) && fixture_before(fixture_end_);)                             \
            clock_sleep_ms(FIXTURE_POLL_MS);                                       \
        cr_assert(cond, __VA_ARGS__);                                              \
    } while (0)

/* ---- a broker service on loopback ---- */

struct brokerd;
struct brokerd_config;

/* Fills *cfg with what the loopback tests share: the broker's defaults
 * with no startup hold, 200 ms heartbeats, a 1.5 s member timeout and
 * 20 ms coalescing, listening on a free loopback port, open (cohorts
 * without keys are served; a test that wants keys sets cfg->key or calls
 * brokerd_set_key, and clears `open` to refuse keyless cohorts). A test
 * changes what it needs before fixture_broker_start_with(). */
void fixture_broker_config(struct brokerd_config *cfg);

/* rpc_init(), then a broker started with *cfg (copied) and `cohort`
 * declared. Writes "127.0.0.1:PORT" to addr. The caller stops it with
 * fixture_broker_stop(). */
struct brokerd *fixture_broker_start_with(const struct brokerd_config *cfg, const char *cohort,
                                          char *addr, size_t addr_len);

/* fixture_broker_start_with() on fixture_broker_config()'s settings. */
struct brokerd *fixture_broker_start(const char *cohort, char *addr, size_t addr_len);

/* How long fixture_held_broker_start()'s broker holds its first epoch. */
#define FIXTURE_START_HOLD_MS 1000u

/* fixture_broker_start() with a startup hold of FIXTURE_START_HOLD_MS:
 * the nodes or groups a test starts together join within it and land in
 * one first epoch, instead of the first one leading an epoch of its own. */
struct brokerd *fixture_held_broker_start(const char *cohort, char *addr, size_t addr_len);

/* A fresh key into *key, then fixture_broker_start_with() serving
 * `cohort` under it and refusing keyless cohorts: the broker a pod's
 * members meet. *key is the caller's, and must outlive the broker. */
struct secret;
struct brokerd *fixture_keyed_broker_start(const char *cohort, struct secret *key, char *addr,
                                           size_t addr_len);

/* brokerd_stop(), then rpc_shutdown(). */
void fixture_broker_stop(struct brokerd *d);

/* ---- a node's trainer ---- */

struct node;
struct node_view;

/* What the node's view `v` asks of a trainer whose state the test does
 * not check: a one-byte state when the node wants one, and a new state
 * taken and dropped. */
void fixture_node_trade_state(struct node *n, const struct node_view *v);

/* ---- TLS ---- */

/* The one name the test server certificate carries: a broker Service's,
 * so that a client dialling 127.0.0.1 must set tls_server_name. */
#define FIXTURE_TLS_NAME "cohort-broker.ns.svc"

/* PEM texts (rpc_pem_load) of a test CA, a server certificate for
 * FIXTURE_TLS_NAME that it signed and its key, and a second CA that
 * signed nothing, made in `dir`. */
struct fixture_tls {
    char dir[64];
    char *ca, *other_ca, *cert, *key;
};

/* Makes *t with the openssl command line tool (EC P-256 keys, valid for
 * two days) in a new directory under /tmp. The caller frees it with
 * fixture_tls_cleanup(). */
void fixture_tls_make(struct fixture_tls *t);
void fixture_tls_cleanup(struct fixture_tls *t);

/* ---- the broker state machine under a fake host ---- */

#define FIXTURE_T0 100000u                      /* the broker's start */
#define FIXTURE_HOLD (FIXTURE_T0 + 2000u)       /* the end of the default startup hold */
#define FIXTURE_ADDR "10.0.0.1:7000"
#define FIXTURE_ADDR2 "10.0.0.2:7000"
#define FIXTURE_MAX_REC 256                     /* publishes, and detaches, recorded */
#define FIXTURE_MAX_W 16                        /* watchers recorded per publish */

/* One publish: the epoch (one reference, held until fixture_sm_stop()) and
 * the watchers it went to. */
struct fixture_pub {
    struct epoch *e;
    size_t n;
    void *w[FIXTURE_MAX_W];
};

/* One detach: the watcher and the reason. */
struct fixture_det {
    void *w;
    int err;
};

/* Everything the broker asked its host to do, in order. Holding every
 * published epoch until the broker is gone lets ASan and LSan check the
 * broker's reference counting too. */
struct fixture_host {
    struct fixture_pub pubs[FIXTURE_MAX_REC];
    size_t n_pubs;
    struct fixture_det dets[FIXTURE_MAX_REC];
    size_t n_dets;
};

/* The broker suite: every Test(broker, ...) starts with no broker and an
 * empty record, and fixture_sm_stop() runs after it (the suite is declared
 * in fixture.c, once for all of test_broker_*.c). */
extern struct broker *fixture_sm;               /* the broker under test */
extern struct fixture_host fixture_host;        /* what it asked of its host */
/* The fake host's callbacks, recording into fixture_host; for tests that
 * call broker_create() themselves (the suite's teardown still frees it if
 * they store it in fixture_sm). */
extern const struct broker_watch_ops fixture_host_ops;

/* Creates fixture_sm at FIXTURE_T0 with *cfg (the defaults when NULL) and
 * declares cohort "demo". Freed by the suite's teardown. */
void fixture_sm_start(const struct broker_config *cfg);

/* fixture_sm_start(NULL), then a (session 11) and b (session 12), both at
 * model version 1, in epoch 1, formed at FIXTURE_HOLD: the one publish so
 * far. */
void fixture_sm_start_ab(void);

/* The suite's teardown: destroys fixture_sm, drops the recorded epochs and
 * empties the record. */
void fixture_sm_stop(void);

/* broker_join() of `id` in "demo" at FIXTURE_ADDR, with no last epoch and
 * the cohort's timings. Returns broker_join()'s result. */
int fixture_sm_join(const char *id, uint64_t version, uint64_t session, uint64_t now);

/* broker_join() with every field a test varies. Strings are borrowed. */
int fixture_sm_join_full(const char *cohort, const char *id, const char *address,
                         uint64_t version, uint64_t session, uint64_t last_epoch, uint64_t now);

/* broker_join() of *j at `now` that must succeed with these effective
 * timings. Returns the latest published epoch the reply named. */
uint64_t fixture_sm_join_timed(const struct broker_join *j, uint64_t now, uint32_t heartbeat_ms,
                               uint32_t timeout_ms);

/* A heartbeat that reports no adopted epoch. Returns broker_heartbeat()'s
 * result; on success *epoch (when not NULL) gets the latest published. */
int fixture_sm_beat(uint64_t now, const char *cohort, const char *id, uint64_t session,
                    uint64_t version, bool declare, uint64_t *epoch);

/* A heartbeat in "demo" at model version 1 that reports `adopted`; it must
 * succeed. Returns whether the broker said the member is drained. */
bool fixture_sm_beat_adopted(const char *id, uint64_t session, uint64_t now, uint64_t adopted);

/* broker_tick() at `now`, then the number of members "demo" holds. */
size_t fixture_sm_tick_members(uint64_t now);

/* The epoch of the latest publish, which must exist; borrowed from the
 * record. */
struct epoch *fixture_sm_last_pub(void);

/* The latest publish went to exactly these n watchers, in this order. */
void fixture_sm_assert_published_to(size_t n, void *const *w);

/* Exactly n detaches so far, the i-th of w[i], all with `err`. */
void fixture_sm_assert_detached(int err, size_t n, void *const *w);

/* e holds exactly these n member ids, in this order. */
void fixture_sm_assert_members(const struct epoch *e, size_t n, const char *const *ids);

/* The id of e's leader; e must have members. Borrowed from e. */
const char *fixture_sm_leader(const struct epoch *e);

/* From broker_status() of `cohort`, which must exist: its latest epoch
 * number, and its member count. */
uint64_t fixture_sm_epoch(const char *cohort);
size_t fixture_sm_members(const char *cohort);

/* After fixture_sm_start_ab(): declares cohort "other" with member c
 * (session 13) and watches a, b and c with wa, wb and wc (borrowed). */
void fixture_sm_watch_a_b_and_other_c(void *wa, void *wb, void *wc);

/* After fixture_sm_start_ab(): c (session 13) joins at FIXTURE_HOLD + 10
 * and the tick after the coalescing window publishes epoch 2. */
void fixture_sm_add_c(void);

#endif

/* src/membership/brokerd.h: the broker as a gRPC service: the state machine of
 * broker.h behind one mutex, a tick thread that evicts and publishes, and
 * a membership stream per member. cohort-operator hosts it, and so does
 * `cohortctl run` for a local cohort.
 *
 * Every refused request gets a gRPC status whose message says what was
 * wrong, and one log line; the broker keeps serving everyone else.
 *
 * Every request proves its cohort's key (membership/wire.h has the proof
 * and its replay rules; brokerd.c's header comment who may do what). A
 * request without a valid proof is refused with UNAUTHENTICATED before
 * it changes anything.
 */
#ifndef COHORT_BROKERD_H
#define COHORT_BROKERD_H

#include <stdbool.h>
#include <stdint.h>

#include "membership/broker.h"

struct brokerd;

struct brokerd_config {
    const char *listen;             /* "host:port" (port 0: a free one); borrowed */
    struct broker_config broker;
    /* Keys (copied). A cohort's requests must prove the key set for it
     * with brokerd_set_key, else `key`; a cohort with neither is refused,
     * unless `open` is set, which serves such cohorts without proofs
     * (tests, and `cohort-operator --standalone --insecure`). admin_key,
     * when set, reads any cohort's Status and is the only key that reads
     * every cohort's at once. */
    const struct secret *key;
    const struct secret *admin_key;
    bool open;
    /* TLS certificate chain and key, PEM (copied); NULL: plaintext. */
    const char *tls_cert_pem;
    const char *tls_key_pem;
    /* Datagram heartbeats (wire.h) are taken on the TCP port's number
     * over UDP, for cohorts with a key, unless `no_datagrams`; a port
     * that cannot be bound for UDP turns them off with a warning.
     * `deaf_datagrams` (tests only) offers them but drops every one
     * unread, as a network that blocks UDP to the broker would. */
    bool no_datagrams;
    bool deaf_datagrams;
};

/* What became of the datagrams the broker read, by kind. */
enum brokerd_dg_kind {
    BROKERD_DG_ACCEPTED,        /* a heartbeat of an attached member session */
    BROKERD_DG_MALFORMED,       /* too long, another magic or version, bad fields */
    BROKERD_DG_UNPROVED,        /* no key for the cohort, or a wrong proof */
    BROKERD_DG_UNATTACHED,      /* no such member session, or its stream is not attached */
    BROKERD_DG_REPLAYED,        /* a seq already seen, or too old */
    BROKERD_DG_PACED,           /* faster than the stream's pace allows */
    BROKERD_DG_DROPPED,         /* read and dropped unread (deaf_datagrams) */
    BROKERD_DG_ACKED,           /* acknowledgements sent back (of accepted ones) */
    BROKERD_DG_KINDS
};

/* Binds, starts serving and ticking. Needs rpc_init(). Returns 0,
 * -EADDRINUSE, -EINVAL (config), -ENOMEM. The caller stops and frees it
 * with brokerd_stop(). */
int brokerd_start(const struct brokerd_config *cfg, struct brokerd **out);
/* The bound TCP port. */
int brokerd_port(const struct brokerd *d);
/* Whether datagram heartbeats are taken (a UDP socket is bound on the
 * port), and the counts of what came of them so far, by enum
 * brokerd_dg_kind (counts[] has BROKERD_DG_KINDS entries). */
bool brokerd_datagrams(const struct brokerd *d, uint64_t counts[BROKERD_DG_KINDS]);
/* Sets the key cohort `cohort`'s members must prove (copied), replacing
 * any; NULL removes it (the config's key applies again). Requests
 * already verified are not affected; the next ones must prove the new
 * key. Returns 0, -EINVAL (bad name), -ENOSPC (more keys than the
 * broker's max_cohorts), -ENOMEM. */
int brokerd_set_key(struct brokerd *d, const char *cohort, const struct secret *key);
/* broker_cohort_declare / broker_cohort_remove, under the broker's lock. */
int brokerd_declare(struct brokerd *d, const char *cohort, uint32_t heartbeat_ms, uint32_t timeout_ms);
int brokerd_remove(struct brokerd *d, const char *cohort);
/* broker_status under the broker's lock: a snapshot of one cohort (name)
 * or all (NULL). The caller frees *out with broker_status_free(). */
int brokerd_status(struct brokerd *d, const char *cohort, struct broker_status **out);
/* broker_drain / broker_drained under the broker's lock: see broker.h. */
int brokerd_drain(struct brokerd *d, const char *cohort, const char *id, bool drain);
int brokerd_drained(struct brokerd *d, const char *cohort, const char *id);
/* Ends every membership stream, stops serving and frees everything.
 * NULL is fine. */
void brokerd_stop(struct brokerd *d);

#endif

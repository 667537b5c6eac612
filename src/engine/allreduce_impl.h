/* src/engine/allreduce_impl.h: the all-reduce engine's own structures,
 * shared by the files that implement it: allreduce.c (lifecycle and
 * dispatch), conn.c (connections and dialling), acceptor.c (the acceptor
 * thread), ring.c and doubling.c (the two algorithms). It is included by
 * the .c files of src/engine/ only: never by a public header, by another
 * folder, or by the tests. Everything else sees struct allreduce as
 * allreduce.h declares it, opaque.
 *
 * It does not include allreduce.h, so that the engine's modules include
 * one another without a circle (scripts/check-layers.py). */
#ifndef COHORT_ALLREDUCE_IMPL_H
#define COHORT_ALLREDUCE_IMPL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/ident.h"
#include "base/limits.h"
#include "base/secret.h"
#include "engine/codec.h"
#include "engine/dtype.h"
#include "engine/peerauth.h"
#include "engine/peerwire.h"
#include "membership/epoch.h"

/* Every log line of the engine names this component, whichever file
 * writes it. */
#define COMPONENT "allreduce"

/* Segments per chunk per window for 16-bit types, coded calls and staged
 * sums, and the staging slots that makes necessary: see ring.c. Behind the slots the
 * staging area has a spare segment (SLOTS: what step 0 sends, widened or
 * encoded) and a scratch one (SCRATCH: a coded segment decoded). */
#ifndef WINDOW_UNITS_WIDE
#define WINDOW_UNITS_WIDE 4
#endif
#define SLOTS (WINDOW_UNITS_WIDE + 2)
#define SCRATCH (SLOTS + 1)

#define MAX_PENDING 64          /* accepted connections still greeting */
#define PENDING_PER_SOURCE 16   /* of those, from one source address */
#define GREETING_MS 1000        /* from accept to a whole greeting, and from our
                                 * answer to its confirmation */
#define INBOX_MAX 256           /* greeted connections not yet taken by a run */
#define MAX_NEED 256            /* peers one call talks to: 2 + log2(n) for the
                                 * ring and doubling, n - 1 for a butterfly of
                                 * up to ALLREDUCE_PARTS_MAX (allreduce.h) */

/* How often a waiting call asks the kernel whether its peers' hosts
 * still answer (conn.c, "REACHABILITY"). */
#define REACH_CHECK_MS 250
/* The shortest silence called unreachable: three keepalive intervals. */
#define REACH_MIN_MS 3000u
/* A call that has waited this long probes the members of its epoch it has
 * no connection to: a round of limit_reach_probes(n) (base/limits.h), and
 * the next round once they have settled and the unreachable time has
 * passed, so that a member is probed at most once per that time by each
 * waiting peer. */
#define REACH_PROBE_AFTER_MS 500u
#define REACH_PROBES_MAX LIMIT_REACH_PROBES_MAX

/* A probe: a bare TCP dial to a member's data address, closed once its
 * host answers (conn.c, "REACHABILITY"). */
struct probe {
    int fd;
    size_t peer;
    uint64_t started;
};

/* The largest frame header: the header and, with --integrity mac, its tag. */
#define HDR_MAX (PEERWIRE_FRAME_BYTES + PEERWIRE_TAG_BYTES)

/* One TCP connection to one member, used in both directions. At most one
 * frame is in flight each way; the pumps (conn.c) move as much of it as
 * the socket takes without blocking. */
struct conn {
    int fd;
    size_t peer;                /* index in the epoch */
    size_t hdr_len;             /* PEERWIRE_FRAME_BYTES, + PEERWIRE_TAG_BYTES when sealed */
    bool sealed;                /* --integrity mac: every frame carries a tag */
    uint64_t incarnation, serial;   /* the connector's, from its greeting (inbound only) */
    struct peerauth_stream tx_mac, rx_mac;  /* when sealed */

    bool tx_busy, tx_moved;
    uint8_t tx_hdr[HDR_MAX];
    const uint8_t *tx_buf;
    size_t tx_len, tx_done;     /* tx_done counts header and payload */
    uint64_t tx_since;

    bool rx_busy, rx_moved, rx_checked;
    uint8_t rx_hdr[HDR_MAX];
    uint8_t *rx_buf;
    size_t rx_len, rx_done;
    size_t rx_maced;            /* payload bytes given to rx_mac so far */
    struct peerwire_frame rx_want;  /* magic 0: control only, any data frame is wrong */
    uint64_t rx_since;
    uint64_t unreach_told;      /* when its peer was last reported unreachable; 0: never */
};

/* A connection the acceptor greeted (and, keyed, whose confirmation it
 * verified), waiting for a run to take it. */
struct inbound {
    int fd;
    uint64_t epoch;
    size_t peer;
    uint64_t incarnation, serial;
    uint8_t key_c2a[PEERAUTH_KEY_BYTES], key_a2c[PEERAUTH_KEY_BYTES];  /* when sealed */
};

enum pending_state {
    PENDING_GREETING,           /* reading the greeting */
    PENDING_HELD,               /* greeted from a newer epoch; waiting for ours */
    PENDING_CONFIRMING,         /* answered (keyed); reading the confirmation */
};

/* An accepted connection whose greeting is still being read or judged. */
struct pending {
    int fd;
    uint64_t since;             /* accepted at */
    uint64_t deadline;
    enum pending_state state;
    size_t got;
    uint8_t buf[PEERWIRE_HELLO_BYTES];
    char host[48];              /* the source address, for the per-source cap */
    char from[64];              /* host:port, for logs */
    /* PENDING_CONFIRMING: what the confirmation must be a MAC of. */
    size_t peer;
    uint64_t epoch, incarnation, serial;
    uint8_t flags;
    uint8_t nonce_c[PEERWIRE_NONCE_BYTES], nonce_a[PEERWIRE_NONCE_BYTES];
    char peer_id[PEERWIRE_HELLO_NAME];  /* the id it claims */
};

/* A registered buffer. */
struct reg {
    void *buf;
    size_t bytes;
    bool used;
};

struct dial;

struct allreduce {
    char *cohort, *id;
    uint64_t cohort_hash;
    bool keyed;                 /* key holds the cohort's key */
    bool integrity;             /* --integrity mac (needs keyed) */
    struct secret key;
    uint64_t incarnation;       /* random, this engine's: see acceptor.c */
    int listen_fd;
    uint32_t timeout_ms;
    void (*on_peer_lost)(void *arg, const char *peer_id);   /* the config's */
    void *peer_lost_arg;
    void (*on_peer_unreachable)(void *arg, const char *peer_id, uint64_t epoch);
    void *peer_unreachable_arg;
    _Atomic uint32_t unreach_ms;    /* allreduce_set_unreachable_ms; 0: off */
    uint64_t call_deadline_ms;  /* allreduce_set_call_deadline; 0: none. Read and
                                 * written by the thread that runs calls */
    size_t seg_bytes, small_bytes;
    bool alg_used[3];           /* run_call logged this algorithm (ring, doubling, butterfly) */
    int abort_fd;               /* set_epoch -> run */
    int wake_fd;                /* set_epoch, destroy -> acceptor */
    int inbox_fd;               /* acceptor -> run */
    pthread_t acceptor;
    pthread_mutex_t mu;

    /* Under mu. */
    struct epoch *epoch;
    bool stop;
    struct inbound inbox[INBOX_MAX];
    size_t n_inbox;

    _Atomic uint64_t gen;       /* bumped by every adopted epoch */
    atomic_bool running;

    /* The running call's; under mu while none runs. */
    struct epoch *conn_epoch;
    struct conn **conns;        /* conn_epoch->n_members entries, NULL when closed */

    /* The acceptor thread's. */
    struct pending pending[MAX_PENDING];
    size_t n_pending;
    uint64_t log_at;            /* refusals' log budget: see acceptor.c */
    uint32_t log_tokens;
    uint64_t log_unlogged;

    /* The caller thread's. */
    uint64_t serial;            /* connections dialled so far */
    uint64_t reach_next;        /* the next reachability check */
    struct probe probes[REACH_PROBES_MAX];
    size_t n_probes;
    bool probe_clamp_told;      /* the open-file limit's clamp was logged */
    size_t probe_next;          /* where the next round of probes starts */
    uint64_t probe_round_at;    /* no round of probes before this */
    struct dial *dials;         /* conn_connect_peers's dials while it waits */
    size_t n_dials;
    size_t slot_bytes;          /* a staging slot: ring_slot_bytes(seg_bytes) */
    uint8_t *stage;             /* SLOTS + 2 slots */
    uint8_t *rd_a, *rd_b;       /* doubling_cap(small_bytes) each (allreduce.c):
                                 * a payload and its rider; or NULL */
    struct reg regs[];          /* ALLREDUCE_MAX_BUFFERS, allocated with the struct */
};

/* One call: what every algorithm reads, set up by allreduce_run_into and
 * run_call (allreduce.c). */
struct run {
    struct allreduce *a;
    struct epoch *e;
    uint64_t gen;
    size_t me, n;
    uint64_t round;
    size_t count;
    size_t rider;               /* the last elements of count, chosen without */
    enum dtype type, acc;
    enum dtype_op op;
    double div;
    uint8_t *buf;               /* where the result lands */
    const uint8_t *src;         /* this member's contribution: buf, or a buffer never written */
    size_t esz, asz;            /* user and accumulation element sizes */
    bool wide;                  /* 16-bit float: accumulate in float32 */
    enum codec codec;           /* how payloads travel (float32 only) */
    const size_t *parts;        /* butterfly: n_parts part lengths; NULL otherwise */
    size_t n_parts;
    bool coded;                 /* codec != CODEC_NONE */
    size_t fail_peer;           /* for the log line; SIZE_MAX when unknown */
    uint64_t started;           /* run_call began, for the probes */
    /* fail_peer's socket itself closed or reset, with no BYE before: its
     * process died (or its host went away), not a failed call of its own. */
    bool peer_reset;
};

/* True once an epoch newer than the call's was adopted. Checked on every
 * turn of the algorithms' loops, so it stays inline. */
static inline bool run_stale(const struct run *x)
{
    return atomic_load(&x->a->gen) != x->gen;
}

#endif

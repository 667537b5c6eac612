/* src/averager/avstate.h: an averager's state, shared peer to peer
 * (hivemind's load_state_from_peers). A donor runs a server that hands
 * out a snapshot of its state (opaque bytes its host provides); a
 * newcomer downloads one snapshot in parts from several donors at once,
 * checking every part against a manifest the donors agree on, so that it
 * never returns a mix of two donors' states.
 *
 *   server:  avstate_server_start(&cfg, &s);   // listens
 *            while (avstate_server_wanted(s, 200))   // the host's thread
 *                avstate_server_provide(s, blob, len);
 *   newcomer: avstate_load(&lc, donors, n, &blob, &len, why, sizeof(why));
 *
 * THE WIRE (TCP; integers little-endian)
 *
 *   C->S hello:     u32 magic "CAS1", u16 cohort_len, u16 client_len,
 *                   u16 server_len, u16 0, nonce_c[32], cohort, client id,
 *                   server id (each 1..IDENT_NAME_MAX bytes)
 *   S->C challenge: u32 magic, u32 status, nonce_a[32], mac_a[32]
 *   C->S confirm:   mac_c[32]
 *   then any number of requests, one at a time:
 *   C->S request:   u32 op (1 manifest, 2 part), u32 part, root[32]
 *   S->C manifest:  u32 status, u32 part_bytes, u64 total, u32 n_parts,
 *                   u32 0, root[32], n_parts digests[32], mac_m[32]
 *   S->C part:      u32 status, u32 len, len bytes
 *
 * mac_a, mac_c and mac_m are HMAC-SHA256 under the cohort's key
 * (base/secret.h) of the labels "cohort/avstate/v1/accept", ".../confirm"
 * and ".../manifest" over the cohort, both ids and both fresh nonces (and
 * for mac_m the manifest's header and digests): the server proves the key
 * before the client sends anything more, the client proves it before the
 * server reads a request, and a manifest cannot be replayed into another
 * connection or forged without the key. A part's digest is the SHA-256
 * of its bytes and the root the SHA-256 of (total, part_bytes, digests):
 * two donors that declare one root declare the same bytes, and a part is
 * taken only when its bytes match the root's digest. Nothing here is
 * encrypted: a state is as secret as the network it crosses (as the
 * engine's frames are).
 *
 * Why not the engine's peer connections (engine/peerauth.h): those belong
 * to the members of one group in one epoch and carry all-reduce frames
 * in lockstep; a download is outside any group, one-sided and long, and
 * must not hold up the donor's own steps. The MACs are built the same way
 * (secret_mac over length-prefixed parts, both nonces in the transcript).
 *
 * What a donor may do wrong, and what the newcomer does: not answer or
 * stall (every read and write has a deadline; the donor is dropped and
 * its parts go to the others of the same root), send a part that does
 * not match its digest (the same), declare a manifest whose root does not
 * match its digests or a size over the cap (dropped before any part is
 * asked for), or declare another state than the others (the newcomer
 * takes the root most donors of the top priority declare; the others are
 * not asked for parts).
 */
#ifndef COHORT_AVSTATE_H
#define COHORT_AVSTATE_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/secret.h"

#define AVSTATE_MAGIC 0x31534143u            /* "CAS1" */
#define AVSTATE_NONCE_BYTES 32
#define AVSTATE_DIGEST_BYTES 32
#define AVSTATE_PART_MIN ((size_t)64 << 10)  /* parts are at least 64 KiB */
#define AVSTATE_PARTS_MAX 4096u              /* and at most this many */
#define AVSTATE_DONORS_MAX 16u               /* donors one download asks at once */
#define AVSTATE_CONNS_MAX 16u                /* connections a server serves at once */
#define AVSTATE_DEFAULT_MAX_BYTES ((size_t)1 << 30)

enum avstate_op { AVSTATE_OP_MANIFEST = 1, AVSTATE_OP_PART = 2 };

enum avstate_status {
    AVSTATE_OK = 0,
    AVSTATE_REFUSED = 1,        /* not this server's id or cohort, or too busy */
    AVSTATE_UNAVAILABLE = 2,    /* no snapshot from the host in time */
    AVSTATE_NOT_SHARING = 3,    /* sharing is off */
    AVSTATE_GONE = 4,           /* the snapshot of that root is no longer held */
    AVSTATE_BAD_PART = 5,       /* no such part */
};

/* ---- the donor's server ------------------------------------------------- */

struct avstate_server;

struct avstate_server_config {
    const char *cohort;             /* copied */
    const char *id;                 /* this donor's member id; copied */
    const char *host;               /* numeric address to listen on and advertise */
    const struct secret *key;       /* copied; NULL: an all-zero key (no proof) */
    uint32_t io_timeout_ms;         /* each read and write of a connection; 0: 10 s */
    uint32_t provide_timeout_ms;    /* how long a manifest request waits for the host's
                                     * snapshot before the last one is served (or
                                     * AVSTATE_UNAVAILABLE); 0: 2 s */
    uint32_t reuse_ms;              /* a snapshot younger than this is served without
                                     * asking the host; 0: 1 s */
    size_t max_bytes;               /* the largest snapshot; 0: AVSTATE_DEFAULT_MAX_BYTES */
};

/* Listens and starts serving (sharing off until avstate_server_allow).
 * Returns 0, -EINVAL, -ENOMEM, or a socket or thread -errno. The caller
 * stops it with avstate_server_stop(). */
int avstate_server_start(const struct avstate_server_config *cfg, struct avstate_server **out);
/* Closes every connection, wakes avstate_server_wanted, and frees. NULL is
 * fine. */
void avstate_server_stop(struct avstate_server *s);

/* Where it listens, "host:port" (owned by the server). */
const char *avstate_server_address(const struct avstate_server *s);

/* Turns serving on or off; while off every request is answered
 * AVSTATE_NOT_SHARING. */
void avstate_server_allow(struct avstate_server *s, bool allow);

/* Waits at most timeout_ms until a downloader needs a fresher snapshot
 * than the server holds: true then (the caller provides one), false at
 * the timeout or once the server is stopping. */
bool avstate_server_wanted(struct avstate_server *s, uint32_t timeout_ms);

/* Makes len bytes at blob (copied) the snapshot served from now on; the
 * previous one stays available to downloads that began with it until the
 * next. Returns 0, -EFBIG (over max_bytes) or -ENOMEM. */
int avstate_server_provide(struct avstate_server *s, const void *blob, size_t len);

/* Parts served since the start (for tests and status). */
uint64_t avstate_server_parts_served(struct avstate_server *s);

/* ---- the newcomer ------------------------------------------------------- */

struct avstate_donor {
    const char *id;                 /* borrowed, both */
    const char *address;
    double priority;
};

struct avstate_load_config {
    const char *cohort;             /* borrowed, all three */
    const char *id;                 /* the downloader's member id */
    const struct secret *key;       /* NULL: the all-zero key */
    uint32_t timeout_ms;            /* the whole download */
    uint32_t io_timeout_ms;         /* each read and write; 0: 10 s */
    size_t max_bytes;               /* refuse larger states; 0: AVSTATE_DEFAULT_MAX_BYTES */
    const atomic_bool *cancel;      /* borrowed; once true the download ends within a
                                     * second with -ECANCELED (NULL: never) */
};

/* Downloads a state from donors[0..n), which are ordered best first (as
 * the broker lists them): among the donors of the highest priority that
 * answer, those that declare the root most of them declare each serve a
 * share of its parts, in parallel; a donor that fails is dropped and its
 * parts fetched from the others; when none of them can finish, the next
 * root, then the next priority. On 0 *blob (the caller frees it) holds
 * *len bytes exactly as one donor's host provided them. Otherwise -ENODATA
 * (no donor, or none could serve a whole state), -ETIMEDOUT or -ECANCELED
 * (c->cancel), and `why` says which donors failed how. */
int avstate_load(const struct avstate_load_config *c, const struct avstate_donor *donors,
                 size_t n, void **blob, size_t *len, char *why, size_t why_len);

/* ---- the pieces, for tests that play a donor ----------------------------- */

/* A manifest of len bytes at blob: its part size, part count, digests
 * (*digests is the caller's to free, n_parts x AVSTATE_DIGEST_BYTES) and
 * root. Returns 0, -EFBIG (more than the parts cap allows) or -ENOMEM. */
int avstate_manifest(const void *blob, size_t len, uint32_t *part_bytes, uint32_t *n_parts,
                     uint8_t **digests, uint8_t root[AVSTATE_DIGEST_BYTES]);

/* The MAC of label ("accept", "confirm" or "manifest") over a connection's
 * transcript and `extra` bytes (the manifest's header and digests; NULL
 * for the others). Returns 0 or -EIO. */
int avstate_mac(const struct secret *k, const char *label, const char *cohort,
                const char *client, const char *server,
                const uint8_t nonce_c[AVSTATE_NONCE_BYTES],
                const uint8_t nonce_a[AVSTATE_NONCE_BYTES], const void *extra,
                size_t extra_len, uint8_t mac[SECRET_MAC_BYTES]);

#endif

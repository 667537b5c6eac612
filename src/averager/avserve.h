/* src/averager/avserve.h: the sidecar's side of the averager link
 * (avlink.h): it hosts the averagers its trainer asks for, each a member
 * of the cohort with the key the sidecar holds and an id the sidecar
 * derives from its own ("<id>_av<N>", N counting from 1): a trainer never
 * names the member it drives, so it cannot pass for another pod. A pod's
 * names (DNS subdomains) have no '_', so no other pod's id or averager
 * can be one of these.
 *
 * What a trainer can hold is bounded: AVSERVE_AVERAGERS_MAX averagers per
 * sidecar, one per link, AVSERVE_ATTACH_MAX further links per averager,
 * AVSERVE_LINKS_MAX links in all; an averager's vector by max_count, its
 * gathered bytes by AVERAGER_GATHER_MAX, its state by max_state_bytes. A
 * link that has not created or attached within TLINK_HELLO_DEADLINE_MS is
 * closed. A malformed or oversized request is refused with a sentence and
 * changes nothing; a malformed message (bad framing, a wrong size, an
 * unexpected descriptor) ends the link. When the link that created an
 * averager closes (its trainer shut it down, or died), the averager
 * leaves the cohort at once: a step in flight is aborted within half a
 * second (averager_abort), and its groupmates go on without it as they
 * do without a killed peer; a state download in flight ends within a
 * second the same way. A wait for the averager to join (AVL_WAIT,
 * bounded by the trainer) ends as soon as its link hangs up, its owner
 * leaves or the sidecar stops. With integrity_mac every hosted averager's
 * engine authenticates every frame, as the sidecar's own node does.
 *
 * Each link is served on a thread of its own, so that a step, a state
 * download and a wait for a state request of one averager run side by
 * side, as they do in process.
 */
#ifndef COHORT_AVSERVE_H
#define COHORT_AVSERVE_H

#include <stdbool.h>
#include <stdint.h>

struct secret;
struct avserve;

#define AVSERVE_AVERAGERS_MAX 8
#define AVSERVE_ATTACH_MAX 3
#define AVSERVE_LINKS_MAX 32

struct avserve_config {
    const char *broker;             /* copied */
    const char *cohort;             /* copied */
    const char *id;                 /* the sidecar's member id; copied */
    const char *host;               /* numeric address the averagers listen on; copied */
    const struct secret *key;       /* copied; NULL: none */
    bool integrity_mac;             /* the averagers' engines authenticate every frame
                                     * (needs key), as the sidecar's own node does */
    const char *tls_ca_pem;         /* TLS to the broker, as the sidecar's own member
                                     * reaches it; copied; NULL: plaintext */
    const char *tls_server_name;    /* copied; NULL: the broker address's host */
    uint64_t max_count;             /* floats one averager may average; 0: AVLINK_COUNT_MAX */
    uint64_t max_state_bytes;       /* 0: AVLINK_STATE_MAX */
};

/* Ready to adopt links. Needs rpc_init(). Returns 0, -EINVAL (a missing
 * name, an id that leaves no room for the suffix, or integrity_mac
 * without a key) or -ENOMEM. The
 * caller frees *out with avserve_destroy(). */
int avserve_create(const struct avserve_config *cfg, struct avserve **out);
/* Ends every link (their averagers leave, each once its call in flight
 * returns) and frees. NULL is fine. */
void avserve_destroy(struct avserve *s);

/* Takes `sock`, a connection whose first message (not yet read) is
 * AVL_HELLO or AVL_ATTACH, and serves it on a thread of its own. The
 * socket is the server's from the call on, whatever it returns: 0, or
 * -EBUSY (AVSERVE_LINKS_MAX links already; the connection was told so
 * and closed), -ENOMEM or -EAGAIN. Matches trainerd_config.adopt. */
int avserve_adopt(void *s, int sock);

/* Averagers hosted and links served now (for tests and logs). */
unsigned avserve_averagers(struct avserve *s);
unsigned avserve_links(struct avserve *s);

#endif

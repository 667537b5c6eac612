/* src/membership/proof.h: the proof of the cohort's key that every broker
 * request carries (the format is in wire.h). member.c signs its requests
 * with proof_sign(); brokerd.c checks them with proof_valid() and then
 * applies the replay rules of wire.h itself.
 *
 *   Cohort__V1__Proof pf;
 *   uint8_t mac[SECRET_MAC_BYTES];
 *   proof_sign(&key, &q.base, seq, proof_now_ms(), &pf, mac);
 *   q.proof = &pf;
 */
#ifndef COHORT_PROOF_H
#define COHORT_PROOF_H

#include <stdbool.h>
#include <stdint.h>

#include "base/secret.h"
#include "cohort.pb-c.h"

/* The wall clock, Unix milliseconds: the proofs' time_ms. */
uint64_t proof_now_ms(void);

/* Fills *p with a proof of `req` (a Join, Heartbeat, HeartbeatDatagram,
 * Leave, Watch, Status, Matchmake or StateDonors request; its own proof
 * field is not read) under key `k`, with
 * this seq and time. p->mac points at `mac`, which must live as long as
 * *p. Returns 0, -EINVAL for another message type (or a Heartbeat with
 * more than WIRE_LOST_PEERS_MAX lost_peers or WIRE_UNREACHABLE_MAX
 * unreachable_peers, which no proof covers), or
 * -EIO. */
int proof_sign(const struct secret *k, const ProtobufCMessage *req, uint64_t seq,
               uint64_t time_ms, Cohort__V1__Proof *p, uint8_t mac[SECRET_MAC_BYTES]);

/* Whether `p` is a proof of `req` under `k`: its MAC is the one
 * proof_sign() would make for its seq and time (compared in constant
 * time). NULL p, or a MAC of another length, is not. Neither seq nor time
 * is judged here. */
bool proof_valid(const struct secret *k, const ProtobufCMessage *req, const Cohort__V1__Proof *p);

/* Sets a->mac (pointing at `mac`, which must live as long as *a) to the
 * MAC of the broker's acknowledgement `a` of member `id` of `cohort`
 * (wire.h). Returns 0 or -EIO. */
int proof_sign_ack(const struct secret *k, const char *cohort, const char *id,
                   Cohort__V1__HeartbeatDatagramAck *a, uint8_t mac[SECRET_MAC_BYTES]);
/* Whether a->mac is that MAC (compared in constant time). */
bool proof_ack_valid(const struct secret *k, const char *cohort, const char *id,
                     const Cohort__V1__HeartbeatDatagramAck *a);

#endif

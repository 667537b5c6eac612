/* src/membership/wire.h: the names both ends of the broker protocol must agree on. */
#ifndef COHORT_WIRE_H
#define COHORT_WIRE_H

/* Bumped on any change that an older peer would misread. */
#define WIRE_PROTOCOL_VERSION 1u

/* A cohort's heartbeat interval and member timeout when nobody chose them,
 * in ms: the broker's defaults, and what a member assumes until the
 * broker's Join reply says otherwise (a reply that leaves them 0 means
 * these). Five heartbeats fit in a timeout, so one lost or late heartbeat
 * evicts nobody. */
#define WIRE_DEFAULT_HEARTBEAT_MS 1000u
#define WIRE_DEFAULT_TIMEOUT_MS 5000u

#define WIRE_BROKER_JOIN "/cohort.v1.Broker/Join"
#define WIRE_BROKER_HEARTBEAT "/cohort.v1.Broker/Heartbeat"
#define WIRE_BROKER_LEAVE "/cohort.v1.Broker/Leave"
#define WIRE_BROKER_WATCH "/cohort.v1.Broker/Watch"
#define WIRE_BROKER_STATUS "/cohort.v1.Broker/Status"

#endif

/* src/membership/wire.h: the names both ends of the broker protocol must agree on. */
#ifndef COHORT_WIRE_H
#define COHORT_WIRE_H

/* Bumped on any change that an older peer would misread. */
#define WIRE_PROTOCOL_VERSION 1u

#define WIRE_BROKER_JOIN "/cohort.v1.Broker/Join"
#define WIRE_BROKER_HEARTBEAT "/cohort.v1.Broker/Heartbeat"
#define WIRE_BROKER_LEAVE "/cohort.v1.Broker/Leave"
#define WIRE_BROKER_WATCH "/cohort.v1.Broker/Watch"
#define WIRE_BROKER_STATUS "/cohort.v1.Broker/Status"

#endif

/* src/base/ident.h: what names and addresses cohort accepts, and the one order
 * every member list is kept in. The broker and the flag parsers share these
 * so that a name the CLI accepts is a name the broker accepts. */
#ifndef COHORT_IDENT_H
#define COHORT_IDENT_H

#include <stdbool.h>
#include <stddef.h>

#define IDENT_NAME_MAX 253      /* a Kubernetes object name (DNS subdomain) */
#define IDENT_ADDRESS_MAX 261   /* "[" IPv6 or DNS name "]:" port */

/* A cohort name or member id: 1..253 bytes of [A-Za-z0-9._-], starting
 * with a letter or digit. Cohort names may also hold one '/' so that
 * "namespace/name" keys work. */
bool ident_valid_member_id(const char *s);
bool ident_valid_cohort(const char *s);

/* A data-plane or broker address: host:port with port 1..65535, host a DNS
 * name, an IPv4 literal or a bracketed IPv6 literal. Port 0 is refused:
 * members must advertise where they really listen. */
bool ident_valid_address(const char *s);

/* Natural order: runs of digits compare by value, so "c-2" < "c-10", and
 * everything else compares bytewise. Total and deterministic: strings that
 * differ never compare equal (ties on value fall back to bytewise order, so
 * "c-02" and "c-2" are ordered too). */
int ident_natural_cmp(const char *a, const char *b);

#endif

/* src/membership/matchmaker.h: the broker's matchmaking for averagers
 * (hivemind's DecentralizedAverager): members of a cohort ask for a group
 * by (prefix, group bits), and the matchmaker forms groups of those that
 * ask alike.
 *
 * The rules. Requests with the same cohort, prefix and group bits wait
 * together (a bucket). A group forms
 *   - at once, when target_group_size of them are waiting;
 *   - otherwise min_matchmaking_ms after the first of them arrived, if at
 *     least min_group_size are waiting then, or as soon as that many are
 *     after that moment.
 * Its members are the earliest arrivals, at most target_group_size, in
 * the natural order of their ids (the order the engine's schedules use),
 * each with the address it joined the cohort with. A request that is
 * still waiting at its own timeout fails with -ETIMEDOUT and a reason that
 * says how many arrived of how many needed: a bounded wait and a clear
 * answer, never a group that silently never forms.
 *
 * Requests of one bucket must agree on target_group_size, min_group_size
 * and schema (what is averaged: shapes and dtypes, opaque here), since a
 * group of averagers that disagree could only fail later; a request that
 * disagrees with those waiting is refused (-EPROTO) and changes nothing.
 * A request for any schema (an auxiliary averager without tensors) agrees
 * with every schema; a group forms only with a member that gave one, and
 * tells every member that schema.
 * A member that asks again while it waits replaces its earlier request
 * (which fails with -ECANCELED): one request per member. A member that
 * left the cohort while it waited is dropped when its group would form
 * (ops->alive).
 *
 * Caps, since any member may ask for anything: prefix length and
 * characters, group bits, group size, schema length, timeout, and the
 * requests waiting per cohort and in all. Pure: no threads, no clock of its
 * own (the host passes `now`), no network; brokerd.c is its host.
 */
#ifndef COHORT_MATCHMAKER_H
#define COHORT_MATCHMAKER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/ident.h"

#define MATCHMAKER_PREFIX_MAX 128u      /* characters of [A-Za-z0-9._:/-] */
#define MATCHMAKER_BITS_MAX 64u         /* characters of '0' and '1' */
#define MATCHMAKER_GROUP_MAX 256u       /* target_group_size at most */
#define MATCHMAKER_SCHEMA_MAX 64u       /* bytes */
#define MATCHMAKER_TIMEOUT_MAX_MS 600000u   /* a request waits at most 10 min */
#define MATCHMAKER_PENDING_MAX 1024u    /* requests waiting in one cohort */
#define MATCHMAKER_TOTAL_MAX 16384u     /* requests waiting in all */
#define MATCHMAKER_BANDWIDTH_MAX 1e15   /* a declared bandwidth at most */

struct matchmaker;

struct matchmaker_request {
    const char *cohort;         /* copied */
    const char *id;             /* copied: the member asking */
    const char *address;        /* copied: its data address, as it joined */
    const char *prefix;         /* copied */
    const char *bits;           /* copied; "" is fine */
    uint32_t target;            /* target_group_size, 1..MATCHMAKER_GROUP_MAX */
    uint32_t min;               /* min_group_size, 1..target */
    uint32_t min_wait_ms;       /* min_matchmaking_ms, at most timeout_ms */
    uint32_t timeout_ms;        /* 1..MATCHMAKER_TIMEOUT_MAX_MS */
    const void *schema;         /* copied, schema_len bytes */
    size_t schema_len;
    void *ctx;                  /* borrowed: the host's handle on the call */
    /* Load balancing, passed on to the group as given: the matchmaker
     * only checks them. */
    bool has_bandwidth;         /* false: not given */
    double bandwidth;           /* finite, 0..MATCHMAKER_BANDWIDTH_MAX */
    bool client;                /* client mode: reduces nothing, is never dialled */
    /* An auxiliary averager without tensors of its own: it gives no
     * schema (schema_len 0) and joins its bucket whatever the others'
     * schema is, which the group then tells it. */
    bool any_schema;
};

struct matchmaker_member {
    const char *id;
    const char *address;
    void *ctx;
    double bandwidth;           /* as the member asked; negative: not given */
    bool client;
};

/* A group as it forms: everything borrowed for the callback. */
struct matchmaker_group {
    const char *cohort;
    const char *prefix;
    const char *bits;
    uint64_t id;                /* grows by one with every group */
    size_t n;
    const struct matchmaker_member *members;    /* natural order of ids */
    const void *schema;         /* the schema of its members that gave one */
    size_t schema_len;
};

struct matchmaker_ops {
    /* A group formed: answer each member's ctx. */
    void (*formed)(void *arg, const struct matchmaker_group *g);
    /* A request ended without a group: -ETIMEDOUT (too few arrived),
     * -ECANCELED (the member asked again), -ESHUTDOWN (the matchmaker is
     * going away). `why` is a whole sentence, borrowed for the call. */
    void (*failed)(void *arg, void *ctx, int err, const char *why);
    /* Whether the member behind ctx is still in its cohort; asked of every
     * request just before a group forms, so that a member that left or
     * was evicted while it waited is dropped (failed, -ENOENT) rather than
     * grouped. NULL: every request counts as alive. */
    bool (*alive)(void *arg, void *ctx);
    void *arg;                  /* borrowed */
};

/* Creates an empty matchmaker whose first group is numbered first_group
 * (a host seeds it from its clock so that numbers grow across restarts).
 * `ops` is copied. Returns 0 or -ENOMEM; the caller frees *out with
 * matchmaker_destroy(). */
int matchmaker_create(const struct matchmaker_ops *ops, uint64_t first_group,
                      struct matchmaker **out);
/* Fails every waiting request with -ESHUTDOWN, then frees. NULL is fine. */
void matchmaker_destroy(struct matchmaker *m);

/* Checks a request's own fields against the caps. Returns 0, or -EINVAL
 * with the reason in `why` (len bytes). */
int matchmaker_check(const struct matchmaker_request *r, char *why, size_t len);

/* Adds a request at `now`. It may complete a group at once (ops->formed
 * runs before this returns). Returns 0, or with nothing changed and the
 * reason in `why`: -EINVAL (matchmaker_check), -EPROTO (it disagrees with
 * the requests waiting in its bucket), -ENOSPC (its cohort, or the
 * matchmaker, holds as many waiting requests as it may), -ENOMEM. */
int matchmaker_submit(struct matchmaker *m, uint64_t now, const struct matchmaker_request *r,
                      char *why, size_t len);

/* Forgets the request whose ctx is `ctx` (its caller went away), without
 * a callback. Nothing happens if none waits. */
void matchmaker_cancel(struct matchmaker *m, void *ctx);

/* Forms the groups that are due and fails the requests whose timeout has
 * passed. Returns the milliseconds until something next falls due (at
 * most 60000 when nothing waits). */
uint32_t matchmaker_tick(struct matchmaker *m, uint64_t now);

/* Requests waiting in `cohort` (NULL: in all). */
size_t matchmaker_pending(const struct matchmaker *m, const char *cohort);

/* ---- state donors (hivemind's load_state_from_peers) ---------------------
 *
 * Per (cohort, prefix), a table of the members that offer their state:
 * each with the address it serves it on, its priority and an expiry.
 * A member declares itself again before its expiry to stay (hivemind's
 * declare_state_period), or withdraws; a declaration replaces the
 * member's earlier one for that prefix. Readers get the live donors,
 * highest priority first; among equals, by id, and the reader spreads
 * its load over them itself (averager/avstate.h). Caps, since any
 * member may declare anything: the donors of a cohort and in all, the
 * expiry, the priority (finite), and the rows of an answer. */

#define MATCHMAKER_DONORS_MAX 256u          /* live donors in one cohort */
#define MATCHMAKER_DONORS_TOTAL_MAX 4096u   /* in all */
#define MATCHMAKER_DONORS_REPLY_MAX 64u     /* donors one answer lists */
#define MATCHMAKER_EXPIRY_MAX_MS 3600000u   /* a declaration lasts at most 1 h */

struct matchmaker_donor {
    const char *cohort;         /* copied, all four */
    const char *id;
    const char *prefix;
    const char *address;        /* where it serves its state */
    uint64_t session;           /* the member session that declares it */
    double priority;            /* finite */
    uint32_t expiry_ms;         /* 1..MATCHMAKER_EXPIRY_MAX_MS */
};

/* One row of an answer (its strings owned by the caller's array). */
struct matchmaker_donor_row {
    char id[IDENT_NAME_MAX + 1];
    char address[IDENT_ADDRESS_MAX + 1];
    uint64_t session;           /* as declared, for the host to check it is alive */
    double priority;
};

/* Declares (or renews) d at `now`. Returns 0, or with nothing changed
 * and the reason in `why`: -EINVAL (a bad name, address, prefix,
 * priority or expiry), -ENOSPC (the cohort, or the matchmaker, holds as
 * many live donors as it may), -ENOMEM. */
int matchmaker_declare(struct matchmaker *m, uint64_t now, const struct matchmaker_donor *d,
                       char *why, size_t len);

/* Withdraws member `id`'s declaration for (cohort, prefix). Returns 0 or
 * -ENOENT (none was live). */
int matchmaker_withdraw(struct matchmaker *m, uint64_t now, const char *cohort,
                        const char *prefix, const char *id);

/* Fills out[0..max) with the live donors of (cohort, prefix) other than
 * `exclude` (NULL: none), highest priority first, then by id; returns how
 * many (at most max and MATCHMAKER_DONORS_REPLY_MAX). Expired ones are
 * forgotten here. */
size_t matchmaker_donors(struct matchmaker *m, uint64_t now, const char *cohort,
                         const char *prefix, const char *exclude,
                         struct matchmaker_donor_row *out, size_t max);

/* Whether `prefix` is one the matchmaker takes (MATCHMAKER_PREFIX_MAX
 * characters of [A-Za-z0-9._:/-]). */
bool matchmaker_prefix_valid(const char *prefix);

/* Live donors in `cohort` (NULL: in all) at `now`. */
size_t matchmaker_donor_count(struct matchmaker *m, uint64_t now, const char *cohort);

#endif

/* src/membership/matchmaker.c: see matchmaker.h.
 *
 * Buckets are kept in an unordered array and found by a linear scan: the
 * caps bound them by MATCHMAKER_TOTAL_MAX, and a scan of that many short
 * records costs microseconds, far below a matchmaking wait. Inside a
 * bucket requests are kept in arrival order, which is the order groups
 * take them in.
 */
#include "membership/matchmaker.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/ident.h"

#define IDLE_TICK_MS 60000u

struct req {
    char *id;
    char *address;
    void *ctx;
    double bandwidth;           /* negative: not given */
    bool client;
    bool any_schema;            /* gave none: agrees with every schema */
    uint64_t arrived;
    uint64_t deadline;
};

struct bucket {
    char *cohort, *prefix, *bits;
    uint32_t target, min;
    uint8_t schema[MATCHMAKER_SCHEMA_MAX];
    size_t schema_len;
    bool schema_set;            /* a waiting request gave the schema */
    uint64_t form_at;           /* the first waiting request's arrival + its wait */
    struct req *reqs;           /* n of them, arrival order, capacity target */
    size_t n;
};

/* A declared state donor. */
struct donor {
    char *cohort, *id, *prefix, *address;
    uint64_t session;
    double priority;
    uint64_t expires;
};

struct matchmaker {
    struct matchmaker_ops ops;
    uint64_t next_group;
    struct bucket **buckets;
    size_t n_buckets, cap_buckets;
    size_t total;
    struct donor *donors;       /* unordered, at most MATCHMAKER_DONORS_TOTAL_MAX */
    size_t n_donors, cap_donors;
};

int matchmaker_create(const struct matchmaker_ops *ops, uint64_t first_group,
                      struct matchmaker **out)
{
    struct matchmaker *m = calloc(1, sizeof(*m));

    if (!m)
        return -ENOMEM;
    m->ops = *ops;
    m->next_group = first_group ? first_group : 1;
    *out = m;
    return 0;
}

static void req_free(struct req *r)
{
    free(r->id);
    free(r->address);
}

static void bucket_free(struct bucket *b)
{
    for (size_t i = 0; i < b->n; i++)
        req_free(&b->reqs[i]);
    free(b->reqs);
    free(b->cohort);
    free(b->prefix);
    free(b->bits);
    free(b);
}

/* Removes request i of bucket b; the caller has answered its ctx (or
 * was told to forget it). */
static void take_out(struct matchmaker *m, struct bucket *b, size_t i)
{
    req_free(&b->reqs[i]);
    memmove(&b->reqs[i], &b->reqs[i + 1], (b->n - i - 1) * sizeof(b->reqs[0]));
    b->n--;
    m->total--;
    /* Only requests for any schema left: the next one to give a schema
     * sets it anew. */
    b->schema_set = false;
    for (size_t j = 0; j < b->n; j++)
        b->schema_set |= !b->reqs[j].any_schema;
}

/* Drops empty buckets. */
static void sweep(struct matchmaker *m)
{
    size_t k = 0;

    for (size_t i = 0; i < m->n_buckets; i++) {
        if (m->buckets[i]->n == 0)
            bucket_free(m->buckets[i]);
        else
            m->buckets[k++] = m->buckets[i];
    }
    m->n_buckets = k;
}

void matchmaker_destroy(struct matchmaker *m)
{
    if (!m)
        return;
    for (size_t i = 0; i < m->n_buckets; i++) {
        struct bucket *b = m->buckets[i];

        for (size_t j = 0; j < b->n; j++)
            m->ops.failed(m->ops.arg, b->reqs[j].ctx, -ESHUTDOWN,
                          "the broker is shutting down; ask again once it is back");
        bucket_free(b);
    }
    free(m->buckets);
    for (size_t i = 0; i < m->n_donors; i++) {
        struct donor *d = &m->donors[i];

        free(d->cohort);
        free(d->id);
        free(d->prefix);
        free(d->address);
    }
    free(m->donors);
    free(m);
}

static bool prefix_valid(const char *s)
{
    size_t n = 0;

    if (!s || !*s)
        return false;
    for (; s[n]; n++) {
        char c = s[n];
        bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                  c == '.' || c == '_' || c == ':' || c == '/' || c == '-';
        if (!ok || n >= MATCHMAKER_PREFIX_MAX)
            return false;
    }
    return true;
}

static bool bits_valid(const char *s)
{
    size_t n = 0;

    if (!s)
        return false;
    for (; s[n]; n++)
        if ((s[n] != '0' && s[n] != '1') || n >= MATCHMAKER_BITS_MAX)
            return false;
    return true;
}

int matchmaker_check(const struct matchmaker_request *r, char *why, size_t len)
{
    const char *bad = NULL;

    if (!ident_valid_cohort(r->cohort) || !ident_valid_member_id(r->id) ||
        !ident_valid_address(r->address))
        bad = "invalid cohort, member id or address";
    else if (!prefix_valid(r->prefix))
        bad = "the prefix must be 1 to 128 characters of letters, digits and . _ : / -";
    else if (!bits_valid(r->bits))
        bad = "group bits must be at most 64 characters of 0 and 1";
    else if (r->target < 1 || r->target > MATCHMAKER_GROUP_MAX)
        bad = "target_group_size must be from 1 to 256";
    else if (r->min < 1 || r->min > r->target)
        bad = "min_group_size must be from 1 to target_group_size";
    else if (r->timeout_ms < 1 || r->timeout_ms > MATCHMAKER_TIMEOUT_MAX_MS)
        bad = "the matchmaking timeout must be from 1 ms to 10 min";
    else if (r->min_wait_ms > r->timeout_ms)
        bad = "min_matchmaking_time must not exceed the matchmaking timeout";
    else if (r->schema_len > MATCHMAKER_SCHEMA_MAX || (r->schema_len && !r->schema))
        bad = "the schema is at most 64 bytes";
    else if (r->has_bandwidth && !(r->bandwidth >= 0 && r->bandwidth <= MATCHMAKER_BANDWIDTH_MAX))
        bad = "the bandwidth must be a number from 0 to 1e15";
    else if (r->any_schema && r->schema_len)
        bad = "a request for any schema gives none";
    if (!bad)
        return 0;
    snprintf(why, len, "%s", bad);
    return -EINVAL;
}

static struct bucket *bucket_of(struct matchmaker *m, const char *cohort, const char *prefix,
                                const char *bits)
{
    for (size_t i = 0; i < m->n_buckets; i++) {
        struct bucket *b = m->buckets[i];

        if (strcmp(b->cohort, cohort) == 0 && strcmp(b->prefix, prefix) == 0 &&
            strcmp(b->bits, bits) == 0)
            return b;
    }
    return NULL;
}

size_t matchmaker_pending(const struct matchmaker *m, const char *cohort)
{
    size_t n = 0;

    if (!cohort)
        return m->total;
    for (size_t i = 0; i < m->n_buckets; i++)
        if (strcmp(m->buckets[i]->cohort, cohort) == 0)
            n += m->buckets[i]->n;
    return n;
}

static int by_id(const void *a, const void *b)
{
    return ident_natural_cmp(((const struct matchmaker_member *)a)->id,
                             ((const struct matchmaker_member *)b)->id);
}

/* Forms a group of the first min(n, target) requests of b. */
static void form(struct matchmaker *m, struct bucket *b)
{
    struct matchmaker_member members[MATCHMAKER_GROUP_MAX];
    struct matchmaker_group g = { .cohort = b->cohort, .prefix = b->prefix, .bits = b->bits };
    size_t n = b->n < b->target ? b->n : b->target;

    for (size_t i = 0; i < n; i++)
        members[i] = (struct matchmaker_member){ b->reqs[i].id, b->reqs[i].address,
                                                 b->reqs[i].ctx, b->reqs[i].bandwidth,
                                                 b->reqs[i].client };
    qsort(members, n, sizeof(members[0]), by_id);
    g.id = m->next_group++;
    g.n = n;
    g.members = members;
    g.schema = b->schema;
    g.schema_len = b->schema_len;
    m->ops.formed(m->ops.arg, &g);
    while (n-- > 0)
        take_out(m, b, 0);
    /* Nobody is left over: a bucket forms as soon as it holds target. */
}

/* Whether b forms now: never without a member that gave the schema. */
static bool due(const struct bucket *b, uint64_t now)
{
    return b->schema_set && (b->n >= b->target || (b->n >= b->min && now >= b->form_at));
}

/* Forms b's group if it is due, once the requests of members that left
 * the cohort are dropped (which may make it not due after all). */
static void form_if_due(struct matchmaker *m, struct bucket *b, uint64_t now)
{
    if (!due(b, now))
        return;
    for (size_t j = 0; m->ops.alive && j < b->n;) {
        if (m->ops.alive(m->ops.arg, b->reqs[j].ctx)) {
            j++;
            continue;
        }
        m->ops.failed(m->ops.arg, b->reqs[j].ctx, -ENOENT,
                      "the member left the cohort while it waited for a group");
        take_out(m, b, j);
    }
    if (due(b, now))
        form(m, b);
}

/* Whether member `id` of `cohort` has a request waiting. */
static bool waiting(const struct matchmaker *m, const char *cohort, const char *id)
{
    for (size_t i = 0; i < m->n_buckets; i++) {
        const struct bucket *b = m->buckets[i];

        if (strcmp(b->cohort, cohort) != 0)
            continue;
        for (size_t j = 0; j < b->n; j++)
            if (strcmp(b->reqs[j].id, id) == 0)
                return true;
    }
    return false;
}

/* Removes a waiting request of the same member anywhere (it asked again). */
static void supersede(struct matchmaker *m, const char *cohort, const char *id)
{
    for (size_t i = 0; i < m->n_buckets; i++) {
        struct bucket *b = m->buckets[i];

        if (strcmp(b->cohort, cohort) != 0)
            continue;
        for (size_t j = 0; j < b->n; j++) {
            if (strcmp(b->reqs[j].id, id) == 0) {
                m->ops.failed(m->ops.arg, b->reqs[j].ctx, -ECANCELED,
                              "the member asked for a group again; this request is replaced");
                take_out(m, b, j);
                return;
            }
        }
    }
}

static struct bucket *bucket_new(struct matchmaker *m, const struct matchmaker_request *r,
                                 uint64_t now)
{
    struct bucket *b;

    if (m->n_buckets == m->cap_buckets) {
        size_t cap = m->cap_buckets ? 2 * m->cap_buckets : 16;
        struct bucket **grown = realloc(m->buckets, cap * sizeof(*grown));

        if (!grown)
            return NULL;
        m->buckets = grown;
        m->cap_buckets = cap;
    }
    b = calloc(1, sizeof(*b));
    if (!b)
        return NULL;
    b->cohort = strdup(r->cohort);
    b->prefix = strdup(r->prefix);
    b->bits = strdup(r->bits);
    b->reqs = calloc(r->target, sizeof(*b->reqs));
    if (!b->cohort || !b->prefix || !b->bits || !b->reqs) {
        bucket_free(b);
        return NULL;
    }
    b->target = r->target;
    b->min = r->min;
    b->form_at = now + r->min_wait_ms;
    m->buckets[m->n_buckets++] = b;
    return b;
}

int matchmaker_submit(struct matchmaker *m, uint64_t now, const struct matchmaker_request *r,
                      char *why, size_t len)
{
    struct bucket *b;
    struct req q = { 0 };
    int rc = matchmaker_check(r, why, len);

    if (rc < 0)
        return rc;
    b = bucket_of(m, r->cohort, r->prefix, r->bits);
    if (b && (b->target != r->target || b->min != r->min ||
              (b->schema_set && !r->any_schema &&
               (b->schema_len != r->schema_len ||
                memcmp(b->schema, r->schema, r->schema_len) != 0)))) {
        snprintf(why, len, "averagers with prefix \"%.128s\" and group bits \"%.64s\" are "
                 "waiting with another %s: target %u and min %u", r->prefix, r->bits,
                 b->target != r->target || b->min != r->min ? "group size"
                                                            : "schema (tensor shapes or dtypes)",
                 b->target, b->min);
        return -EPROTO;
    }
    /* A bucket holds at most target requests and forms only with one
     * that gave the schema: requests for any schema leave it a place. */
    if (r->any_schema && b && !b->schema_set && b->n + 1 >= b->target &&
        !waiting(m, r->cohort, r->id)) {
        snprintf(why, len, "averagers with prefix \"%.128s\" and group bits \"%.64s\" wait "
                 "for one with tensors: %zu without tensors already wait for a group of %u",
                 r->prefix, r->bits, b->n, b->target);
        return -ENOSPC;
    }
    /* One request per member: a newer one replaces the older, so a
     * member asking again takes no more room; the caps are judged first,
     * so that a refusal changes nothing. */
    if (!waiting(m, r->cohort, r->id) &&
        (m->total >= MATCHMAKER_TOTAL_MAX ||
         matchmaker_pending(m, r->cohort) >= MATCHMAKER_PENDING_MAX)) {
        snprintf(why, len, "too many averagers are waiting for groups in cohort \"%.64s\" "
                 "(at most %u, %u in all)", r->cohort, MATCHMAKER_PENDING_MAX,
                 MATCHMAKER_TOTAL_MAX);
        return -ENOSPC;
    }
    supersede(m, r->cohort, r->id);
    if (b && b->n == 0)
        b->form_at = now + r->min_wait_ms;
    q.id = strdup(r->id);
    q.address = strdup(r->address);
    if (!q.id || !q.address)
        goto nomem;
    if (!b) {
        b = bucket_new(m, r, now);
        if (!b)
            goto nomem;
    }
    q.ctx = r->ctx;
    q.bandwidth = r->has_bandwidth ? r->bandwidth : -1;
    q.client = r->client;
    q.any_schema = r->any_schema;
    if (!r->any_schema && !b->schema_set) {
        memcpy(b->schema, r->schema, r->schema_len);
        b->schema_len = r->schema_len;
        b->schema_set = true;
    }
    q.arrived = now;
    q.deadline = now + r->timeout_ms;
    b->reqs[b->n++] = q;
    m->total++;
    form_if_due(m, b, now);
    sweep(m);
    return 0;
nomem:
    req_free(&q);
    sweep(m);
    snprintf(why, len, "out of memory");
    return -ENOMEM;
}

void matchmaker_cancel(struct matchmaker *m, void *ctx)
{
    for (size_t i = 0; i < m->n_buckets; i++) {
        struct bucket *b = m->buckets[i];

        for (size_t j = 0; j < b->n; j++) {
            if (b->reqs[j].ctx == ctx) {
                take_out(m, b, j);
                sweep(m);
                return;
            }
        }
    }
}

uint32_t matchmaker_tick(struct matchmaker *m, uint64_t now)
{
    uint64_t next = now + IDLE_TICK_MS;
    char why[360];

    for (size_t i = 0; i < m->n_buckets; i++) {
        struct bucket *b = m->buckets[i];

        form_if_due(m, b, now);
        for (size_t j = 0; j < b->n;) {
            if (b->reqs[j].deadline > now) {
                j++;
                continue;
            }
            snprintf(why, sizeof(why), "too few averagers: %zu of at least %u with prefix "
                     "\"%.128s\" and group bits \"%.64s\" were ready within %llu ms%s",
                     b->n, b->min, b->prefix, b->bits,
                     (unsigned long long)(b->reqs[j].deadline - b->reqs[j].arrived),
                     b->schema_set ? "" : ", and none of them has tensors");
            m->ops.failed(m->ops.arg, b->reqs[j].ctx, -ETIMEDOUT, why);
            take_out(m, b, j);
        }
        for (size_t j = 0; j < b->n; j++)
            if (b->reqs[j].deadline < next)
                next = b->reqs[j].deadline;
        /* Without a schema it cannot form, however long it waited. */
        if (b->schema_set && b->n >= b->min && b->form_at < next)
            next = b->form_at;
    }
    sweep(m);
    return next > now ? (uint32_t)(next - now) : 0;
}

/* ---- state donors -------------------------------------------------------
 *
 * One unordered array, scanned: at most MATCHMAKER_DONORS_TOTAL_MAX short
 * records, read once per load and written once per declare period per
 * donor, so a scan costs far less than the call that asks for it. */

bool matchmaker_prefix_valid(const char *prefix)
{
    return prefix_valid(prefix);
}

static void donor_free(struct donor *d)
{
    free(d->cohort);
    free(d->id);
    free(d->prefix);
    free(d->address);
}

static void donor_take_out(struct matchmaker *m, size_t i)
{
    donor_free(&m->donors[i]);
    m->donors[i] = m->donors[--m->n_donors];
}

/* Forgets the declarations that expired by `now`. */
static void donors_expire(struct matchmaker *m, uint64_t now)
{
    for (size_t i = 0; i < m->n_donors;) {
        if (m->donors[i].expires <= now)
            donor_take_out(m, i);
        else
            i++;
    }
}

static long donor_find(const struct matchmaker *m, const char *cohort, const char *prefix,
                       const char *id)
{
    for (size_t i = 0; i < m->n_donors; i++) {
        const struct donor *d = &m->donors[i];

        if (strcmp(d->cohort, cohort) == 0 && strcmp(d->prefix, prefix) == 0 &&
            strcmp(d->id, id) == 0)
            return (long)i;
    }
    return -1;
}

size_t matchmaker_donor_count(struct matchmaker *m, uint64_t now, const char *cohort)
{
    size_t n = 0;

    donors_expire(m, now);
    for (size_t i = 0; i < m->n_donors; i++)
        if (!cohort || strcmp(m->donors[i].cohort, cohort) == 0)
            n++;
    return n;
}

int matchmaker_declare(struct matchmaker *m, uint64_t now, const struct matchmaker_donor *d,
                       char *why, size_t len)
{
    const char *bad = NULL;
    struct donor nd = { 0 };
    long at;

    if (!ident_valid_cohort(d->cohort) || !ident_valid_member_id(d->id) ||
        !ident_valid_address(d->address))
        bad = "invalid cohort, member id or state address";
    else if (!prefix_valid(d->prefix))
        bad = "the prefix must be 1 to 128 characters of letters, digits and . _ : / -";
    else if (!isfinite(d->priority))
        bad = "the state sharing priority must be a finite number";
    else if (d->expiry_ms < 1 || d->expiry_ms > MATCHMAKER_EXPIRY_MAX_MS)
        bad = "a donor's declaration lasts from 1 ms to 1 h";
    if (bad) {
        snprintf(why, len, "%s", bad);
        return -EINVAL;
    }
    donors_expire(m, now);
    at = donor_find(m, d->cohort, d->prefix, d->id);
    /* A renewal takes no more room; the caps are judged before anything
     * changes, so that a refusal changes nothing. */
    if (at < 0 && (m->n_donors >= MATCHMAKER_DONORS_TOTAL_MAX ||
                   matchmaker_donor_count(m, now, d->cohort) >= MATCHMAKER_DONORS_MAX)) {
        snprintf(why, len, "too many state donors in cohort \"%.64s\" (at most %u, %u in all)",
                 d->cohort, MATCHMAKER_DONORS_MAX, MATCHMAKER_DONORS_TOTAL_MAX);
        return -ENOSPC;
    }
    nd.cohort = strdup(d->cohort);
    nd.id = strdup(d->id);
    nd.prefix = strdup(d->prefix);
    nd.address = strdup(d->address);
    if (!nd.cohort || !nd.id || !nd.prefix || !nd.address)
        goto nomem;
    nd.session = d->session;
    nd.priority = d->priority;
    nd.expires = now + d->expiry_ms;
    if (at >= 0) {
        donor_free(&m->donors[at]);
        m->donors[at] = nd;
        return 0;
    }
    if (m->n_donors == m->cap_donors) {
        size_t cap = m->cap_donors ? 2 * m->cap_donors : 16;
        struct donor *grown = realloc(m->donors, cap * sizeof(*grown));

        if (!grown)
            goto nomem;
        m->donors = grown;
        m->cap_donors = cap;
    }
    m->donors[m->n_donors++] = nd;
    return 0;
nomem:
    donor_free(&nd);
    snprintf(why, len, "out of memory");
    return -ENOMEM;
}

int matchmaker_withdraw(struct matchmaker *m, uint64_t now, const char *cohort,
                        const char *prefix, const char *id)
{
    long at;

    donors_expire(m, now);
    at = donor_find(m, cohort, prefix, id);
    if (at < 0)
        return -ENOENT;
    donor_take_out(m, (size_t)at);
    return 0;
}

static int by_priority(const void *a, const void *b)
{
    const struct matchmaker_donor_row *x = a, *y = b;

    if (x->priority != y->priority)
        return x->priority > y->priority ? -1 : 1;
    return ident_natural_cmp(x->id, y->id);
}

size_t matchmaker_donors(struct matchmaker *m, uint64_t now, const char *cohort,
                         const char *prefix, const char *exclude,
                         struct matchmaker_donor_row *out, size_t max)
{
    struct matchmaker_donor_row *all;
    size_t n = 0;

    donors_expire(m, now);
    /* On the heap: MATCHMAKER_DONORS_MAX rows are over 100 KiB. */
    all = calloc(MATCHMAKER_DONORS_MAX, sizeof(*all));
    if (!all)
        return 0;
    for (size_t i = 0; i < m->n_donors && n < MATCHMAKER_DONORS_MAX; i++) {
        const struct donor *d = &m->donors[i];

        if (strcmp(d->cohort, cohort) != 0 || strcmp(d->prefix, prefix) != 0 ||
            (exclude && strcmp(d->id, exclude) == 0))
            continue;
        snprintf(all[n].id, sizeof(all[n].id), "%s", d->id);
        snprintf(all[n].address, sizeof(all[n].address), "%s", d->address);
        all[n].session = d->session;
        all[n].priority = d->priority;
        n++;
    }
    qsort(all, n, sizeof(all[0]), by_priority);
    if (max > MATCHMAKER_DONORS_REPLY_MAX)
        max = MATCHMAKER_DONORS_REPLY_MAX;
    if (n > max)
        n = max;
    memcpy(out, all, n * sizeof(all[0]));
    free(all);
    return n;
}

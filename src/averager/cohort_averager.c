/* src/averager/cohort_averager.c: the averager's public face in
 * include/cohort.h. A thin layer: it reads the environment as
 * cohort_group_create() does and keeps gRPC started for the averager's
 * life; in a pod whose trainer holds no key it drives an averager in the
 * sidecar instead (avlink.h), and every call below goes there. */
#include "cohort.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "averager/averager.h"
#include "averager/avlink.h"
#include "base/secret.h"
#include "rpc/rpc.h"

/* The public values are the engine's codec numbers for the codecs. */
_Static_assert(COHORT_COMPRESSION_NONE == (int)CODEC_NONE &&
                   COHORT_COMPRESSION_FP16 == (int)CODEC_FP16 &&
                   COHORT_COMPRESSION_BF16 == (int)CODEC_BF16 &&
                   COHORT_COMPRESSION_INT8 == (int)CODEC_INT8 &&
                   COHORT_COMPRESSION_MEANSTD16 == (int)CODEC_MEANSTD16 &&
                   COHORT_COMPRESSION_UNIFORM8 == (int)CODEC_UNIFORM8 &&
                   COHORT_COMPRESSION_QUANTILE8 == (int)CODEC_QUANTILE8,
               "cohort_compression and enum codec differ");

struct cohort_averager {
    struct averager *a;         /* in process, or */
    struct avlink *l;           /* through the sidecar */
};

struct cohort_averager_result {
    struct averager_result *r;
    struct avlink_result *lr;
};

/* The codecs an averager takes (top-k and PowerSGD keep state per member
 * and are not stateless maps of a sum: engine/codec.h), in process and
 * through a sidecar alike: the link carries the codec's id as it is. */
static bool codec_ok(enum cohort_compression c)
{
    return ((int)c >= COHORT_COMPRESSION_NONE && (int)c <= COHORT_COMPRESSION_INT8) ||
           c == COHORT_COMPRESSION_MEANSTD16 || c == COHORT_COMPRESSION_UNIFORM8 ||
           c == COHORT_COMPRESSION_QUANTILE8;
}

/* The plan's codecs are those compression takes, and there are not more
 * ranges than an averager holds; averager_plan_check says the rest. */
static int plan_ok(const struct cohort_averager_config *c, char *why, size_t why_len)
{
    if (c->codec_plan_len > COHORT_CODEC_PLAN_MAX || (c->codec_plan_len && !c->codec_plan)) {
        if (why)
            snprintf(why, why_len, "a codec plan of %zu ranges: at most %d", c->codec_plan_len,
                     COHORT_CODEC_PLAN_MAX);
        return -EINVAL;
    }
    for (size_t k = 0; k < c->codec_plan_len; k++)
        if (!codec_ok(c->codec_plan[k].compression)) {
            if (why)
                snprintf(why, why_len, "range %zu of the codec plan names compression %d, "
                         "which an averager does not take", k,
                         (int)c->codec_plan[k].compression);
            return -EINVAL;
        }
    return 0;
}

/* The sidecar's socket when the averager goes through it: a broker given
 * as "unix:PATH", or none given in an environment with $COHORT_SOCKET and
 * no key ($COHORT_SECRET_FILE), as a cohort's trainer container has. */
static const char *sidecar_path(const char *broker, bool keyed)
{
    const char *sock = getenv("COHORT_SOCKET");

    if (broker)
        return strncmp(broker, "unix:", 5) == 0 ? broker + 5 : NULL;
    if (keyed || !sock || !*sock)
        return NULL;
    return strncmp(sock, "unix:", 5) == 0 ? sock + 5 : sock;
}

static int link_create(const struct cohort_averager_config *c, const char *path, char *why,
                       size_t why_len,
                       struct cohort_averager **out)
{
    struct avlink_range plan[COHORT_CODEC_PLAN_MAX];
    struct avlink_config lc = { .path = path, .plan = plan };
    struct avlink_create *cr = &lc.create;
    struct cohort_averager *ca;
    size_t n;
    int rc;

    n = c->prefix ? strlen(c->prefix) : 0;
    if (!n || n > AVLINK_PREFIX_MAX || (c->initial_bits && strlen(c->initial_bits) > AVLINK_BITS_MAX) ||
        c->schema_len > AVLINK_SCHEMA_MAX || (c->schema_len && !c->schema) ||
        c->declare_state_period_ms < 0)
        return -EINVAL;
    memcpy(cr->prefix, c->prefix, n);
    if (c->initial_bits)
        memcpy(cr->bits, c->initial_bits, strlen(c->initial_bits));
    if (c->schema_len)
        memcpy(cr->schema, c->schema, c->schema_len);
    cr->schema_len = (uint8_t)c->schema_len;
    cr->has_bandwidth = c->has_bandwidth;
    cr->client_mode = c->client_mode;
    cr->share_state = c->allow_state_sharing;
    cr->target_group_size = c->target_group_size;
    cr->min_group_size = c->min_group_size;
    cr->min_matchmaking_ms = c->min_matchmaking_ms;
    cr->request_timeout_ms = c->request_timeout_ms;
    cr->allreduce_timeout_ms = c->allreduce_timeout_ms;
    cr->leave_timeout_ms = c->leave_timeout_ms;
    cr->declare_period_ms = (uint32_t)c->declare_state_period_ms;
    cr->codec = (uint32_t)c->compression;
    /* Checked by the sidecar, which says why it refuses a plan. */
    for (size_t k = 0; k < c->codec_plan_len; k++)
        plan[k] = (struct avlink_range){ .count = c->codec_plan[k].count,
                                         .codec = (uint32_t)c->codec_plan[k].compression };
    cr->plan_len = (uint32_t)c->codec_plan_len;
    cr->count = c->count;
    cr->max_count = c->max_count;
    cr->segment_bytes = c->segment_bytes;
    /* The region holds what a step may gather: the averager's default
     * made explicit, so that both sides size it alike. */
    cr->gather_max = c->gather_max ? c->gather_max : 4096;
    cr->min_vector_size = c->min_vector_size;
    cr->max_state_bytes = c->max_state_bytes;
    cr->bandwidth = c->bandwidth;
    cr->state_priority = c->state_sharing_priority;
    ca = calloc(1, sizeof(*ca));
    if (!ca)
        return -ENOMEM;
    rc = avlink_open(&lc, &ca->l, why, why_len);
    if (rc < 0) {
        free(ca);
        return rc;
    }
    *out = ca;
    return 0;
}

int cohort_averager_create(const struct cohort_averager_config *c, struct cohort_averager **out)
{
    return cohort_averager_create_why(c, out, NULL, 0);
}

/* Writes the sentence of a refusal into the caller's why, if any. */
__attribute__((format(printf, 4, 5)))
static int refuse(char *why, size_t why_len, int rc, const char *fmt, ...)
{
    va_list ap;

    if (why && why_len) {
        va_start(ap, fmt);
        vsnprintf(why, why_len, fmt, ap);
        va_end(ap);
    }
    return rc;
}

int cohort_averager_create_why(const struct cohort_averager_config *c,
                               struct cohort_averager **out, char *why, size_t why_len)
{
    const char *key_file = getenv("COHORT_SECRET_FILE"), *ca_file = getenv("COHORT_BROKER_CA");
    const char *integrity = getenv("COHORT_INTEGRITY");
    struct averager_range plan[COHORT_CODEC_PLAN_MAX];
    char bad[256];
    struct averager_config cfg = { 0 };
    struct cohort_averager *ca;
    struct secret key;
    bool keyed = key_file && *key_file;
    char *pem = NULL;
    int rc;

    if (why && why_len)
        why[0] = '\0';
    if (!c || !out)
        return -EINVAL;
    /* Through the sidecar, the frames are the sidecar's to authenticate
     * (its --integrity), as the key is its own: neither variable is read. */
    if (sidecar_path(c->broker, keyed)) {
        if (!codec_ok(c->compression) || plan_ok(c, why, why_len) < 0)
            return -EINVAL;
        return link_create(c, sidecar_path(c->broker, keyed), why, why_len, out);
    }
    cfg.broker = c->broker ? c->broker : getenv("COHORT_BROKER");
    cfg.cohort = c->cohort ? c->cohort : getenv("COHORT_COHORT");
    cfg.id = c->id ? c->id : getenv("COHORT_ID");
    cfg.host = getenv("COHORT_HOST") ? getenv("COHORT_HOST") : "127.0.0.1";
    if (!cfg.broker || !*cfg.broker || !cfg.cohort || !cfg.id || !c->prefix)
        return -EINVAL;
    cfg.prefix = c->prefix;
    cfg.initial_bits = c->initial_bits;
    cfg.target_group_size = c->target_group_size;
    cfg.min_group_size = c->min_group_size;
    cfg.min_matchmaking_ms = c->min_matchmaking_ms;
    cfg.request_timeout_ms = c->request_timeout_ms;
    cfg.allreduce_timeout_ms = c->allreduce_timeout_ms;
    cfg.count = c->count;
    cfg.max_count = c->max_count;
    cfg.segment_bytes = c->segment_bytes;
    cfg.schema = c->schema;
    cfg.schema_len = c->schema_len;
    cfg.gather_max = c->gather_max;
    cfg.leave_timeout_ms = c->leave_timeout_ms;
    if (!codec_ok(c->compression) || plan_ok(c, why, why_len) < 0)
        return -EINVAL;
    cfg.codec = (enum codec)c->compression;
    for (size_t k = 0; k < c->codec_plan_len; k++)
        plan[k] = (struct averager_range){ .count = c->codec_plan[k].count,
                                           .codec = (enum codec)c->codec_plan[k].compression };
    cfg.plan = plan;
    cfg.plan_len = c->codec_plan_len;
    if (averager_plan_check(cfg.plan, cfg.plan_len, c->count, cfg.codec, c->schema_len, bad,
                            sizeof(bad)) < 0) {
        if (why)
            snprintf(why, why_len, "%s", bad);
        return -EINVAL;
    }
    cfg.has_bandwidth = c->has_bandwidth;
    cfg.bandwidth = c->bandwidth;
    cfg.client_mode = c->client_mode;
    cfg.min_vector_size = c->min_vector_size;
    if (c->declare_state_period_ms < 0)
        return -EINVAL;
    cfg.share_state = c->allow_state_sharing;
    cfg.state_priority = c->state_sharing_priority;
    cfg.declare_period_ms = (uint32_t)c->declare_state_period_ms;
    cfg.max_state_bytes = c->max_state_bytes;
    /* The frame integrity, as the sidecar's --integrity: refused here
     * with its reason, since an averager of the wrong setting would only
     * find no group later. */
    if (secret_integrity_parse(integrity, &cfg.integrity_mac) < 0)
        return refuse(why, why_len, -EINVAL,
                      "COHORT_INTEGRITY=\"%.64s\" is not a frame integrity setting: none or mac",
                      integrity);
    if (cfg.integrity_mac && !keyed)
        return refuse(why, why_len, -EINVAL,
                      "COHORT_INTEGRITY=mac authenticates every frame with the cohort's key, "
                      "and there is none: set COHORT_SECRET_FILE");
    ca = calloc(1, sizeof(*ca));
    if (!ca)
        return -ENOMEM;
    if (keyed && (rc = secret_load(key_file, &key)) < 0)
        goto out_free;
    /* TLS to the broker, as cohort_group_create() and the sidecar's
     * --broker-ca and --broker-server-name. */
    if (ca_file && *ca_file && (rc = rpc_pem_load(ca_file, &pem)) < 0)
        goto out_key;
    cfg.key = keyed ? &key : NULL;
    cfg.tls_ca_pem = pem;
    cfg.tls_server_name = getenv("COHORT_BROKER_SERVER_NAME");
    rc = rpc_init();
    if (rc < 0)
        goto out_pem;
    rc = averager_create(&cfg, &ca->a);
    if (rc < 0)
        rpc_shutdown();
out_pem:
    rpc_pem_free(pem);
out_key:
    if (keyed)
        secret_wipe(&key);
out_free:
    if (rc < 0) {
        free(ca);
        return rc;
    }
    *out = ca;
    return 0;
}

void cohort_averager_destroy(struct cohort_averager *ca)
{
    if (!ca)
        return;
    if (ca->l) {
        avlink_close(ca->l);
    } else {
        averager_destroy(ca->a);
        rpc_shutdown();
    }
    free(ca);
}

int cohort_averager_wait(struct cohort_averager *ca, int timeout_ms)
{
    uint32_t ms = timeout_ms > 0 ? (uint32_t)timeout_ms : 0;

    return ca->l ? avlink_wait(ca->l, ms) : averager_wait(ca->a, ms);
}

int cohort_averager_step(struct cohort_averager *ca, const struct cohort_averager_step *s,
                         struct cohort_averager_result **out)
{
    struct averager_step st = {
        .data = s->data, .weight = s->weight, .alpha = s->alpha, .gather = s->gather,
        .gather_len = s->gather_len, .timeout_ms = s->timeout_ms > 0 ? (uint32_t)s->timeout_ms : 0,
        .no_retries = !s->allow_retries, .begin_at_ms = s->scheduled_ms,
    };
    struct cohort_averager_result *res = calloc(1, sizeof(*res));
    int rc;

    if (!res)
        return -ENOMEM;
    if (ca->l) {
        struct avlink_step ls = {
            .weight = st.weight, .alpha = st.alpha, .gather_len = st.gather_len,
            .begin_at_ms = st.begin_at_ms, .timeout_ms = st.timeout_ms,
            .no_retries = st.no_retries,
        };
        rc = avlink_step(ca->l, s->data, s->gather, &ls, &res->lr);
    } else {
        rc = averager_step(ca->a, &st, &res->r);
    }
    if (rc < 0) {
        free(res);
        return rc;
    }
    *out = res;
    return 0;
}

const char *cohort_averager_error(const struct cohort_averager *ca)
{
    return ca->l ? avlink_error(ca->l) : averager_last_error(ca->a);
}

const char *cohort_averager_bits(const struct cohort_averager *ca)
{
    /* The sidecar's answer is cached in the link, which is the caller's. */
    return ca->l ? avlink_bits(ca->l) : averager_bits(ca->a);
}

int cohort_averager_set_bits(struct cohort_averager *ca, const char *bits)
{
    return ca->l ? avlink_set_bits(ca->l, bits) : averager_set_bits(ca->a, bits);
}

const char *cohort_averager_id(const struct cohort_averager *ca)
{
    return ca->l ? avlink_id(ca->l) : averager_id(ca->a);
}

size_t cohort_averager_result_size(const struct cohort_averager_result *r)
{
    return r->lr ? avlink_result_size(r->lr) : r->r->n;
}

const char *cohort_averager_result_id(const struct cohort_averager_result *r, size_t i)
{
    if (r->lr)
        return avlink_result_id(r->lr, i);
    return i < r->r->n ? r->r->ids[i] : NULL;
}

double cohort_averager_result_weight(const struct cohort_averager_result *r, size_t i)
{
    if (r->lr)
        return avlink_result_weight(r->lr, i);
    return i < r->r->n ? r->r->weights[i] : 0;
}

const void *cohort_averager_result_gathered(const struct cohort_averager_result *r, size_t i,
                                            size_t *len)
{
    if (r->lr)
        return avlink_result_gathered(r->lr, i, len);
    if (i >= r->r->n) {
        *len = 0;
        return NULL;
    }
    *len = r->r->gathered_len[i];
    return r->r->gathered[i];
}

uint64_t cohort_averager_result_group(const struct cohort_averager_result *r)
{
    return r->lr ? avlink_result_group(r->lr) : r->r->group;
}

uint32_t cohort_averager_result_attempts(const struct cohort_averager_result *r)
{
    return r->lr ? avlink_result_attempts(r->lr) : r->r->attempts;
}

uint32_t cohort_averager_result_matchmaking_ms(const struct cohort_averager_result *r)
{
    return r->lr ? avlink_result_matchmaking_ms(r->lr) : r->r->matchmaking_ms;
}

void cohort_averager_result_free(struct cohort_averager_result *r)
{
    if (!r)
        return;
    averager_result_free(r->r);
    avlink_result_free(r->lr);
    free(r);
}

int cohort_averager_set_state_sharing(struct cohort_averager *ca, bool allow, double priority)
{
    return ca->l ? avlink_set_sharing(ca->l, allow, priority)
                 : averager_set_state_sharing(ca->a, allow, priority);
}

void cohort_averager_state_sharing(struct cohort_averager *ca, bool *allow, double *priority)
{
    if (ca->l)
        avlink_sharing(ca->l, allow, priority);
    else
        averager_state_sharing(ca->a, allow, priority);
}

bool cohort_averager_state_wanted(struct cohort_averager *ca, int timeout_ms)
{
    uint32_t ms = timeout_ms > 0 ? (uint32_t)timeout_ms : 0;

    return ca->l ? avlink_state_wanted(ca->l, ms) : averager_state_wanted(ca->a, ms);
}

int cohort_averager_provide_state(struct cohort_averager *ca, const void *blob, size_t len)
{
    return ca->l ? avlink_provide_state(ca->l, blob, len) : averager_provide_state(ca->a, blob, len);
}

int cohort_averager_load_state(struct cohort_averager *ca, int timeout_ms, void **blob,
                               size_t *len)
{
    uint32_t ms = timeout_ms > 0 ? (uint32_t)timeout_ms : 0;

    return ca->l ? avlink_load_state(ca->l, ms, blob, len)
                 : averager_load_state(ca->a, ms, blob, len);
}

void cohort_averager_state_free(void *blob)
{
    free(blob);
}

const char *cohort_averager_load_error(const struct cohort_averager *ca)
{
    return ca->l ? avlink_load_error(ca->l) : averager_load_error(ca->a);
}

uint64_t cohort_averager_state_parts_served(struct cohort_averager *ca)
{
    return ca->l ? avlink_parts_served(ca->l) : averager_state_parts_served(ca->a);
}

/* src/collective/cohort_group.c: the group's public face in include/cohort.h.
 *
 * A thin layer: it reads the environment as cohort_connect() does, keeps
 * gRPC started for the group's life, and maps the public enums to the
 * engine's one by one (never by value: either side may grow). */
#include "cohort.h"

#include <errno.h>
#include <stdlib.h>

#include "base/log.h"
#include "base/secret.h"
#include "collective/group.h"
#include "collective/group_powersgd.h"
#include "collective/group_topk.h"
#include "engine/topk.h"
#include "rpc/rpc.h"

struct cohort_group {
    struct group *g;
};

struct cohort_group_powersgd {
    struct group_powersgd *p;
};

struct cohort_group_topk {
    struct group_topk *t;
    size_t n, k;
};

_Static_assert(COHORT_GROUP_ID_BYTES == GROUP_ID_BYTES, "one record layout");
_Static_assert(COHORT_GROUP_DIVIDE_BEFORE == GROUP_DIVIDE_BEFORE, "one flag");

static int map_dtype(enum cohort_group_dtype t, enum dtype *out)
{
    switch (t) {
    case COHORT_GROUP_F32: *out = DTYPE_F32; return 0;
    case COHORT_GROUP_F64: *out = DTYPE_F64; return 0;
    case COHORT_GROUP_F16: *out = DTYPE_F16; return 0;
    case COHORT_GROUP_BF16: *out = DTYPE_BF16; return 0;
    case COHORT_GROUP_I32: *out = DTYPE_I32; return 0;
    case COHORT_GROUP_I64: *out = DTYPE_I64; return 0;
    }
    return -EINVAL;
}

static int map_op(enum cohort_group_op op, enum dtype_op *out)
{
    switch (op) {
    case COHORT_GROUP_SUM: *out = DTYPE_SUM; return 0;
    case COHORT_GROUP_AVG: *out = DTYPE_AVG; return 0;
    case COHORT_GROUP_MIN: *out = DTYPE_MIN; return 0;
    case COHORT_GROUP_MAX: *out = DTYPE_MAX; return 0;
    case COHORT_GROUP_AVG_BY: *out = DTYPE_AVG_BY; return 0;
    }
    return -EINVAL;
}

static uint32_t timeout_of(int ms)
{
    return ms > 0 ? (uint32_t)ms : 0;
}

int cohort_group_create(const char *broker, const char *cohort, const char *id,
                        struct cohort_group **out)
{
    const char *key_file = getenv("COHORT_SECRET_FILE"), *ca_file = getenv("COHORT_BROKER_CA");
    struct group_config cfg = { 0 };
    struct cohort_group *cg;
    struct secret key;
    bool keyed = key_file && *key_file;
    char *ca = NULL;
    int rc;

    if (!out)
        return -EINVAL;
    cfg.broker = broker ? broker : getenv("COHORT_BROKER");
    cfg.cohort = cohort ? cohort : getenv("COHORT_COHORT");
    cfg.id = id ? id : getenv("COHORT_ID");
    cfg.host = getenv("COHORT_HOST") ? getenv("COHORT_HOST") : "127.0.0.1";
    if (!cfg.broker || !*cfg.broker || !cfg.cohort || !cfg.id)
        return -EINVAL;
    /* The frame integrity, as the sidecar's --integrity (needs the key). */
    if (secret_integrity_parse(getenv("COHORT_INTEGRITY"), &cfg.integrity_mac) < 0 ||
        (cfg.integrity_mac && !keyed))
        return -EINVAL;
    cg = calloc(1, sizeof(*cg));
    if (!cg)
        return -ENOMEM;
    if (keyed && (rc = secret_load(key_file, &key)) < 0)
        goto out_free;
    if (ca_file && *ca_file && (rc = rpc_pem_load(ca_file, &ca)) < 0)
        goto out_key;
    cfg.key = keyed ? &key : NULL;
    cfg.tls_ca_pem = ca;
    cfg.tls_server_name = getenv("COHORT_BROKER_SERVER_NAME");
    rc = rpc_init();
    if (rc < 0)
        goto out_ca;
    rc = group_create(&cfg, &cg->g);
    if (rc < 0)
        rpc_shutdown();
out_ca:
    rpc_pem_free(ca);
out_key:
    if (keyed)
        secret_wipe(&key);
out_free:
    if (rc < 0) {
        free(cg);
        return rc;
    }
    *out = cg;
    return 0;
}

void cohort_group_destroy(struct cohort_group *cg)
{
    if (!cg)
        return;
    group_destroy(cg->g);
    rpc_shutdown();
    free(cg);
}

int cohort_group_wait(struct cohort_group *cg, int timeout_ms)
{
    return group_wait(cg->g, timeout_of(timeout_ms));
}

int cohort_group_position(struct cohort_group *cg, uint32_t *rank, uint32_t *size)
{
    return group_position(cg->g, rank, size, NULL);
}

int cohort_group_member_id(struct cohort_group *cg, uint32_t rank, char *id, size_t len)
{
    if (!id || len == 0)
        return -EINVAL;
    return group_member_id(cg->g, rank, id, len);
}

int cohort_group_allreduce(struct cohort_group *cg, void *buf, size_t count,
                           enum cohort_group_dtype dtype, enum cohort_group_op op,
                           double denominator, unsigned flags, int timeout_ms)
{
    enum dtype t;
    enum dtype_op o;

    if (map_dtype(dtype, &t) < 0 || map_op(op, &o) < 0)
        return -EINVAL;
    return group_allreduce(cg->g, buf, count, t, o, denominator, flags, timeout_of(timeout_ms));
}

int cohort_group_allgather(struct cohort_group *cg, const void *in, size_t bytes,
                           const void **out, size_t *out_len, int timeout_ms)
{
    return group_allgather(cg->g, in, bytes, out, out_len, timeout_of(timeout_ms));
}

int cohort_group_topk_create(struct cohort_group *cg, size_t n, double ratio,
                             struct cohort_group_topk **out)
{
    return cohort_group_topk_create_segments(cg, &n, 1, ratio, out);
}

int cohort_group_topk_create_segments(struct cohort_group *cg, const size_t *sizes,
                                      size_t n_segments, double ratio,
                                      struct cohort_group_topk **out)
{
    struct cohort_group_topk *ct;
    size_t *ks, n = 0, k = 0;
    int rc;

    if (!cg || !out || !sizes || n_segments == 0 || n_segments > UINT32_MAX)
        return -EINVAL;
    ks = calloc(n_segments, sizeof(*ks));
    if (!ks)
        return -ENOMEM;
    for (size_t s = 0; s < n_segments; s++) {
        if (sizes[s] > UINT32_MAX - n || topk_k_for_ratio(sizes[s], ratio, &ks[s]) < 0) {
            free(ks);
            return -EINVAL;
        }
        n += sizes[s];
        k += ks[s];
    }
    ct = calloc(1, sizeof(*ct));
    if (!ct) {
        free(ks);
        return -ENOMEM;
    }
    rc = group_topk_create_segments(cg->g, sizes, ks, n_segments, &ct->t);
    free(ks);
    if (rc < 0) {
        free(ct);
        return rc;
    }
    ct->n = n;
    ct->k = k;
    *out = ct;
    return 0;
}

void cohort_group_topk_destroy(struct cohort_group_topk *ct)
{
    if (!ct)
        return;
    group_topk_destroy(ct->t);
    free(ct);
}

size_t cohort_group_topk_k(const struct cohort_group_topk *ct)
{
    return ct->k;
}

size_t cohort_group_topk_n(const struct cohort_group_topk *ct)
{
    return ct->n;
}

int cohort_group_topk_reduce(struct cohort_group_topk *ct, float *buf, enum cohort_group_op op,
                             int timeout_ms)
{
    enum dtype_op o;

    if (!ct || map_op(op, &o) < 0)
        return -EINVAL;
    return group_topk_reduce(ct->t, buf, o, timeout_of(timeout_ms));
}

const float *cohort_group_topk_residual(const struct cohort_group_topk *ct)
{
    return group_topk_residual(ct->t);
}

_Static_assert(sizeof(struct cohort_group_matrix) == sizeof(struct group_powersgd_matrix),
               "one matrix layout");

int cohort_group_powersgd_create(struct cohort_group *cg, const struct cohort_group_matrix *mats,
                                 size_t n_mats, size_t vectors, size_t rank, uint64_t seed,
                                 bool reuse_query, struct cohort_group_powersgd **out)
{
    struct group_powersgd_matrix *m = NULL;
    struct cohort_group_powersgd *cp;
    int rc;

    if (!cg || !out)
        return -EINVAL;
    if (n_mats && !mats)
        return -EINVAL;
    cp = calloc(1, sizeof(*cp));
    if (n_mats && cp)
        m = calloc(n_mats, sizeof(*m));
    if (!cp || (n_mats && !m)) {
        free(cp);
        return -ENOMEM;
    }
    for (size_t k = 0; k < n_mats; k++) {
        m[k].rows = mats[k].rows;
        m[k].cols = mats[k].cols;
    }
    rc = group_powersgd_create(cg->g, m, n_mats, vectors, rank, seed, reuse_query, &cp->p);
    free(m);
    if (rc < 0) {
        free(cp);
        return rc;
    }
    *out = cp;
    return 0;
}

void cohort_group_powersgd_destroy(struct cohort_group_powersgd *cp)
{
    if (!cp)
        return;
    group_powersgd_destroy(cp->p);
    free(cp);
}

size_t cohort_group_powersgd_size(const struct cohort_group_powersgd *cp)
{
    return group_powersgd_size(cp->p);
}

int cohort_group_powersgd_reduce(struct cohort_group_powersgd *cp, float *buf,
                                 enum cohort_group_op op, int timeout_ms)
{
    enum dtype_op o;

    if (!cp || map_op(op, &o) < 0)
        return -EINVAL;
    return group_powersgd_reduce(cp->p, buf, o, timeout_of(timeout_ms));
}

const float *cohort_group_powersgd_error(const struct cohort_group_powersgd *cp)
{
    return group_powersgd_error(cp->p);
}

void cohort_group_stats(struct cohort_group *cg, struct cohort_group_stats *out)
{
    struct group_stats s;

    group_stats(cg->g, &s);
    out->calls = s.calls;
    out->retries = s.retries;
    out->delivered = s.delivered;
    out->lined_up = s.lined_up;
    out->epochs = s.epochs;
    out->epoch = s.epoch;
    out->members = s.members;
}

const char *cohort_group_strerror(int err)
{
    switch (err < 0 ? -err : err) {
    case EINVAL: return "invalid argument: an unknown type or operator, a zero or non-finite denominator, or divide_before with other than avg on float32 or float64";
    case E2BIG: return "the collective is larger than the group takes (1 GiB)";
    case EPROTO: return "the members' calls differ (count, type or operator, or a reducer's shape, k or rank: their models differ): every member must make the same collectives in the same order";
    case EACCES: return "the members' keys or integrity settings differ";
    case ETIMEDOUT: return "no membership completed the collective in time";
    case ENOTCONN: return "this member is not in the cohort's current membership";
    default: return log_strerror(err);
    }
}

/* src/averager/avlink.h: hivemind's averager through the pod's sidecar.
 *
 * In a Kubernetes cohort only the sidecar holds the cohort's key, so a
 * trainer cannot join the broker itself. Its averagers live in the
 * sidecar (avserve.h) instead, and the trainer drives them over the
 * sidecar's trainer socket (the one the Accumulator uses, COHORT_SOCKET):
 * small fixed-size messages in tlink's framing (accumulator/tlink.h),
 * each request answered by one reply carrying 0 or -errno, a refusal's
 * body the sidecar's sentence. Bulk bytes never cross the byte stream:
 *   - the averaged vector and the gathered bytes live in one sealed memfd
 *     both processes map, sent with CREATE: a step writes the trainer's
 *     data there, the sidecar averages it in place, and the trainer copies
 *     the average back only on success, so on any error its data is
 *     untouched;
 *   - a step's result (ids, weights, gathered bytes) and a loaded state
 *     come back as a memfd with the reply; a provided state goes as a
 *     sealed memfd the sidecar maps.
 *
 * A link holds one averager. The connection that creates it owns it: the
 * averager leaves the cohort when that connection closes (the trainer
 * shut it down, or died). The state calls may run on other threads than
 * the step's, so they travel on further connections that ATTACH to the
 * averager by a random token CREATE returned: a state download or a wait
 * for a state request never queues behind a step. Every message's first
 * type is AVL_HELLO or AVL_ATTACH, which is how the sidecar's socket tells
 * these links from the Accumulator's (trainerd.h, trainerd_config.adopt).
 *
 * The client below is the trainer's side: include/cohort.h's
 * cohort_averager_* reach it when the averager is created without a
 * broker in a pod (cohort_averager_create says when).
 */
#ifndef COHORT_AVLINK_H
#define COHORT_AVLINK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define AVLINK_VERSION 1u
#define AVLINK_TOKEN_BYTES 16
#define AVLINK_PREFIX_MAX 128
#define AVLINK_BITS_MAX 64
#define AVLINK_SCHEMA_MAX 47
#define AVLINK_ID_MAX 253
#define AVLINK_ERROR_MAX 1000       /* a refusal's sentence, NUL included */
#define AVLINK_PLAN_MAX 256         /* ranges of a codec plan (AVERAGER_PLAN_MAX) */
/* The most float32 elements and bytes of state a sidecar hosts for one
 * averager unless configured: a trainer's memory is the sidecar's. */
#define AVLINK_COUNT_MAX ((uint64_t)1 << 28)        /* 1 GiB of float32 */
#define AVLINK_STATE_MAX ((uint64_t)1 << 30)
/* How long a sidecar may take past a call's own bound before the trainer
 * gives up on it as gone. */
#define AVLINK_SLACK_MS 10000
/* A state_wanted wait the sidecar holds at once; longer waits loop, so
 * that an averager's owner never waits long for its helpers to let go. */
#define AVLINK_WANTED_SLICE_MS 1000

enum avlink_type {
    AVL_HELLO = 40,         /* avlink_hello: a link that will CREATE */
    AVL_ATTACH = 41,        /* avlink_attach: a further link to a created averager */
    AVL_CREATE = 42,        /* avlink_create + the shared memfd; reply avlink_created */
    AVL_WAIT = 43,          /* avlink_u32 (ms) */
    AVL_STEP = 44,          /* avlink_step; reply + the result's memfd */
    AVL_BITS = 45,          /* reply avlink_bits */
    AVL_SET_BITS = 46,      /* avlink_bits */
    AVL_SET_SHARING = 47,   /* avlink_sharing */
    AVL_SHARING = 48,       /* reply avlink_sharing */
    AVL_STATE_WANTED = 49,  /* avlink_u32 (ms, at most AVLINK_WANTED_SLICE_MS); reply avlink_u32 */
    AVL_PROVIDE_STATE = 50, /* avlink_u64 (bytes) + a sealed memfd */
    AVL_LOAD_STATE = 51,    /* avlink_u32 (ms); reply avlink_u64 + memfd */
    AVL_PARTS_SERVED = 52,  /* reply avlink_u64 */
};
#define AVL_FIRST AVL_HELLO
#define AVL_LAST AVL_PARTS_SERVED

struct avlink_hello {
    uint32_t version;
    uint32_t zero;
};

struct avlink_attach {
    uint32_t version;
    uint32_t zero;
    uint8_t token[AVLINK_TOKEN_BYTES];
};

struct avlink_u32 {
    uint32_t value;
    uint32_t zero;
};

struct avlink_u64 {
    uint64_t value;
};

/* cohort_averager_config in fixed-width fields; strings NUL-terminated. */
struct avlink_create {
    char prefix[AVLINK_PREFIX_MAX + 1];
    char bits[AVLINK_BITS_MAX + 1];
    uint8_t schema[AVLINK_SCHEMA_MAX];
    uint8_t schema_len;
    uint8_t has_bandwidth, client_mode, share_state, pad[5];
    uint32_t target_group_size, min_group_size, min_matchmaking_ms, request_timeout_ms;
    uint32_t allreduce_timeout_ms, leave_timeout_ms, declare_period_ms, codec;
    uint64_t count, max_count, segment_bytes, gather_max, min_vector_size, max_state_bytes;
    double bandwidth, state_priority;
    uint64_t region_bytes;      /* the memfd's size: avlink_region_layout() */
    uint32_t plan_len;          /* ranges of the codec plan in the region, at most
                                 * AVLINK_PLAN_MAX; 0: codec for every value */
    uint32_t zero;
};

/* One range of a codec plan in the shared region (averager_range): read
 * by the sidecar once, at CREATE, into its own copy, and checked there. */
struct avlink_range {
    uint64_t count;
    uint32_t codec, zero;
};

struct avlink_created {
    uint8_t token[AVLINK_TOKEN_BYTES];
    char id[AVLINK_ID_MAX + 1];     /* the member id the sidecar gave it */
    char pad[2];
};

struct avlink_step {
    double weight, alpha;
    uint64_t gather_len;        /* at the region's gather offset */
    uint64_t begin_at_ms;
    uint32_t timeout_ms;
    uint32_t no_retries;
};

struct avlink_bits {
    char bits[AVLINK_BITS_MAX + 1];
    char pad[7];
};

struct avlink_sharing {
    uint32_t share, zero;
    double priority;
};

/* A step's result memfd: this header, n entries, then the gathered bytes
 * in the entries' order. */
struct avlink_result_hdr {
    uint64_t group;
    uint32_t n, attempts, matchmaking_ms, zero;
    char bits[AVLINK_BITS_MAX + 1];     /* the group bits after the step */
    char pad[7];
};

struct avlink_result_entry {
    char id[AVLINK_ID_MAX + 1];
    char pad[2];
    double weight;
    uint64_t gathered_len;
};

/* The exact body of each request (reply: of its success), or -1 for a
 * type that is not the averager link's. */
long avlink_body_size(uint16_t type, bool reply);

/* The shared region of an averager: count floats, then gather_max bytes
 * (at the returned *gather_off). 0, or -EOVERFLOW. */
int avlink_region_bytes(uint64_t count, uint64_t gather_max, uint64_t *bytes,
                        uint64_t *gather_off);
/* The same with a codec plan of plan_len ranges after the gathered bytes
 * (at *plan_off, 8-byte aligned): -EOVERFLOW also for more than
 * AVLINK_PLAN_MAX ranges. */
int avlink_region_layout(uint64_t count, uint64_t gather_max, uint64_t plan_len,
                         uint64_t *bytes, uint64_t *gather_off, uint64_t *plan_off);

/* A sealed memfd (TLINK_SEALS and F_SEAL_WRITE when `frozen`) of len
 * bytes holding a copy of data (NULL: zeros). Returns the fd or -errno. */
int avlink_memfd(const char *name, const void *data, size_t len, bool frozen);

/* Checks a memfd from the other side before it is mapped: on tmpfs,
 * sealed against shrinking and growing, exactly `len` bytes. 0, -EPERM
 * or -EINVAL. */
int avlink_memfd_check(int fd, uint64_t len);

/* ---- the trainer's side ------------------------------------------------ */

struct avlink;
struct avlink_result;

struct avlink_config {
    const char *path;           /* the sidecar's socket, without "unix:" */
    struct avlink_create create;
    const struct avlink_range *plan;    /* create.plan_len ranges, borrowed */
};

/* Connects to the sidecar at cfg->path and has it create the averager.
 * Returns 0, -EINVAL, -ECONNREFUSED or -ENOENT (no sidecar there), the
 * sidecar's refusal (-EBUSY: it hosts its cap of averagers, -EINVAL: a
 * bad field, -EPROTO: not an averager link), or -errno; *why (static or
 * owned by nothing) says more where it can. The caller frees *out with
 * avlink_close(). */
int avlink_open(const struct avlink_config *cfg, struct avlink **out, char *why, size_t why_len);
/* Closes every connection: the sidecar's averager leaves. NULL is fine. */
void avlink_close(struct avlink *l);

const char *avlink_id(const struct avlink *l);
int avlink_wait(struct avlink *l, uint32_t timeout_ms);
/* A step of avlink_step's fields with data (count floats) and gather
 * (gather_len bytes): on 0 data holds the average and *out the result. */
int avlink_step(struct avlink *l, float *data, const void *gather, const struct avlink_step *s,
                struct avlink_result **out);
const char *avlink_error(const struct avlink *l);
/* The group bits: kept from the last step's result or set_bits, asked of
 * the sidecar only after a failed step (owned by the link). */
const char *avlink_bits(struct avlink *l);
int avlink_set_bits(struct avlink *l, const char *bits);
int avlink_set_sharing(struct avlink *l, bool share, double priority);
void avlink_sharing(struct avlink *l, bool *share, double *priority);
bool avlink_state_wanted(struct avlink *l, uint32_t timeout_ms);
int avlink_provide_state(struct avlink *l, const void *blob, size_t len);
/* On 0 *blob (malloc'd) holds *len bytes. */
int avlink_load_state(struct avlink *l, uint32_t timeout_ms, void **blob, size_t *len);
const char *avlink_load_error(const struct avlink *l);
uint64_t avlink_parts_served(struct avlink *l);

size_t avlink_result_size(const struct avlink_result *r);
const char *avlink_result_id(const struct avlink_result *r, size_t i);
double avlink_result_weight(const struct avlink_result *r, size_t i);
const void *avlink_result_gathered(const struct avlink_result *r, size_t i, size_t *len);
uint64_t avlink_result_group(const struct avlink_result *r);
uint32_t avlink_result_attempts(const struct avlink_result *r);
uint32_t avlink_result_matchmaking_ms(const struct avlink_result *r);
void avlink_result_free(struct avlink_result *r);     /* NULL is fine */

#endif

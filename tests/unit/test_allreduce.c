/* tests/unit/test_allreduce.c: the data plane. Members are engines on
 * loopback, one thread each, except in the tests that kill or stop a
 * member: those fork real processes. Results are checked against a
 * reference computed here from the same inputs, and bytewise across
 * members. Inputs are small integers, so sums are exact in every type and
 * the reference does not depend on the order of the additions. */
#include <criterion/criterion.h>

#include <arpa/inet.h>
#include <errno.h>
#include <math.h>
#include <linux/tcp.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "engine/allreduce.h"
#include "base/clock.h"
#include "base/limits.h"
#include "base/secret.h"
#include "engine/peerauth.h"
#include "engine/peerwire.h"
#include "engine/ring.h"
#include "engine/dtype.h"
#include "membership/epoch.h"
#include "base/log.h"
#include "fixture.h"

#define MAXP 8
#define COHORT "test"

struct peer {
    struct allreduce *ar;
    int fd;
    char addr[64];
    char id[24];
    void *buf;
    size_t bytes;
    int h;
    void *in;                   /* out of place: contributions, never written */
    int hin;                    /* its handle, or -1: in place */
    /* the call in flight */
    pthread_t th;
    size_t count;
    enum dtype type;
    enum dtype_op op;
    double denom;
    enum codec codec;           /* CODEC_NONE unless a test sets it */
    size_t rider;               /* allreduce_run_rider's, when a test sets it */
    uint64_t round;
    int rc;
    uint64_t done_ms;
};

struct cluster {
    size_t n;
    struct peer p[MAXP];
};

static void quiet(void)
{
    log_set_level(LOG_ERROR);
}

/* What a member proves itself with: its key (NULL: none) and whether its
 * frames carry tags. */
struct security {
    const struct secret *key;
    bool integrity;
};

/* cluster_init() with member i's security sec[i] (sec NULL: none). */
static void cluster_init_sec(struct cluster *c, size_t n, size_t bytes, size_t seg, size_t small,
                             uint32_t timeout_ms, const struct security *sec)
{
    memset(c, 0, sizeof(*c));
    c->n = n;
    for (size_t i = 0; i < n; i++) {
        struct peer *p = &c->p[i];
        struct allreduce_config cfg = { .cohort = COHORT, .member_id = p->id,
                                        .member_timeout_ms = timeout_ms, .segment_bytes = seg,
                                        .small_bytes = small,
                                        .key = sec ? sec[i].key : NULL,
                                        .integrity_mac = sec && sec[i].integrity };

        snprintf(p->id, sizeof(p->id), "m-%zu", i);
        cr_assert_eq(allreduce_listen("127.0.0.1", &p->fd, p->addr, sizeof(p->addr)), 0);
        cfg.listen_fd = p->fd;
        cr_assert_eq(allreduce_create(&cfg, &p->ar), 0);
        p->bytes = bytes;
        cr_assert_eq(posix_memalign(&p->buf, 64, bytes ? bytes : 8), 0);
        p->h = allreduce_register(p->ar, p->buf, bytes);
        cr_assert_geq(p->h, 0);
        p->hin = -1;
    }
}

static void cluster_init(struct cluster *c, size_t n, size_t bytes, size_t seg, size_t small,
                         uint32_t timeout_ms)
{
    cluster_init_sec(c, n, bytes, seg, small, timeout_ms, NULL);
}

/* Switches every member to allreduce_run_into from a second buffer. */
static void cluster_out_of_place(struct cluster *c)
{
    for (size_t i = 0; i < c->n; i++) {
        struct peer *p = &c->p[i];

        cr_assert_eq(posix_memalign(&p->in, 64, p->bytes ? p->bytes : 8), 0);
        p->hin = allreduce_register(p->ar, p->in, p->bytes);
        cr_assert_geq(p->hin, 0);
    }
}

static void cluster_fini(struct cluster *c)
{
    for (size_t i = 0; i < c->n; i++) {
        allreduce_destroy(c->p[i].ar);
        close(c->p[i].fd);
        free(c->p[i].buf);
        free(c->p[i].in);
    }
}

/* An epoch of this cluster's members, listed in `order` (indexes), or in
 * creation order when order is NULL. The caller unrefs it. */
static struct epoch *make_epoch(struct cluster *c, uint64_t number, const size_t *order, size_t n)
{
    struct epoch_member m[MAXP];
    struct epoch *e;

    for (size_t i = 0; i < n; i++) {
        size_t k = order ? order[i] : i;
        m[i] = (struct epoch_member){ .id = c->p[k].id, .address = c->p[k].addr };
    }
    cr_assert_eq(epoch_create(COHORT, number, 0, m, n, &e), 0);
    return e;
}

static void adopt(struct cluster *c, uint64_t number, const size_t *order)
{
    struct epoch *e = make_epoch(c, number, order, c->n);

    for (size_t i = 0; i < c->n; i++)
        cr_assert_eq(allreduce_set_epoch(c->p[i].ar, e), 0);
    epoch_unref(e);
}

/* cluster_init() with the log quiet, and every member in epoch 1 of all
 * of them in creation order. The caller frees it with cluster_fini(). */
static void cluster_start(struct cluster *c, size_t n, size_t bytes, size_t seg, size_t small,
                          uint32_t timeout_ms)
{
    quiet();
    cluster_init(c, n, bytes, seg, small, timeout_ms);
    adopt(c, 1, NULL);
}

static void *call_main(void *arg)
{
    struct peer *p = arg;

    if (p->codec != CODEC_NONE)
        p->rc = allreduce_run_codec(p->ar, p->hin >= 0 ? p->hin : p->h, p->h, p->count, p->type,
                                    p->op, p->denom, p->codec, p->round);
    else if (p->rider)
        p->rc = allreduce_run_rider(p->ar, p->hin >= 0 ? p->hin : p->h, p->h, p->count, p->rider,
                                    p->type, p->op, p->denom, p->round);
    else if (p->hin >= 0)
        p->rc = allreduce_run_into(p->ar, p->hin, p->h, p->count, p->type, p->op, p->denom,
                                   p->round);
    else
        p->rc = allreduce_run(p->ar, p->h, p->count, p->type, p->op, p->denom, p->round);
    p->done_ms = clock_now_ms();
    return NULL;
}

static void call_start(struct peer *p, size_t count, enum dtype t, enum dtype_op op, double denom,
                       uint64_t round)
{
    p->count = count;
    p->type = t;
    p->op = op;
    p->denom = denom;
    p->round = round;
    p->rc = 1;
    cr_assert_eq(pthread_create(&p->th, NULL, call_main, p), 0);
}

static void call_join(struct peer *p)
{
    pthread_join(p->th, NULL);
}

/* Every member makes the same call; returns when all have returned. */
static void call_all(struct cluster *c, size_t count, enum dtype t, enum dtype_op op, double denom,
                     uint64_t round)
{
    for (size_t i = 0; i < c->n; i++)
        call_start(&c->p[i], count, t, op, denom, round);
    for (size_t i = 0; i < c->n; i++)
        call_join(&c->p[i]);
}

/* --- inputs and the reference ------------------------------------------ */

static double input(size_t peer, size_t i)
{
    return (double)((long)((i * 7 + peer * 13 + i / 3) % 17) - 8);
}

static void put(void *buf, enum dtype t, size_t i, double v)
{
    switch (t) {
    case DTYPE_F32: ((float *)buf)[i] = (float)v; break;
    case DTYPE_F64: ((double *)buf)[i] = v; break;
    case DTYPE_F16: ((uint16_t *)buf)[i] = dtype_f32_to_f16((float)v); break;
    case DTYPE_BF16: ((uint16_t *)buf)[i] = dtype_f32_to_bf16((float)v); break;
    case DTYPE_I32: ((int32_t *)buf)[i] = (int32_t)v; break;
    case DTYPE_I64: ((int64_t *)buf)[i] = (int64_t)v; break;
    }
}

static void fill(struct cluster *c, size_t count, enum dtype t)
{
    for (size_t k = 0; k < c->n; k++) {
        /* Out of place, the result buffer starts as garbage: nothing may
         * be read from it before it is written. */
        if (c->p[k].in)
            memset(c->p[k].buf, 0xa5, count * dtype_size(t));
        for (size_t i = 0; i < count; i++)
            put(c->p[k].in ? c->p[k].in : c->p[k].buf, t, i, input(k, i));
    }
}

/* The result the engine promises (dtype.h): exact sums, one division, in
 * the accumulation type, then rounding to the element type. */
static void reference(size_t n, size_t count, enum dtype t, enum dtype_op op, double denom,
                      void *out)
{
    double d = op == DTYPE_AVG ? (double)n : denom;

    for (size_t i = 0; i < count; i++) {
        double sum = 0, lo = INFINITY, hi = -INFINITY, v;

        for (size_t k = 0; k < n; k++) {
            double x = input(k, i);
            sum += x;
            lo = x < lo ? x : lo;
            hi = x > hi ? x : hi;
        }
        v = op == DTYPE_MIN ? lo : op == DTYPE_MAX ? hi : sum;
        if (op != DTYPE_AVG && op != DTYPE_AVG_BY) {
            put(out, t, i, v);
            continue;
        }
        switch (t) {
        case DTYPE_F32: ((float *)out)[i] = (float)sum / (float)d; break;
        case DTYPE_F64: ((double *)out)[i] = sum / d; break;
        case DTYPE_F16: ((uint16_t *)out)[i] = dtype_f32_to_f16((float)sum / (float)d); break;
        case DTYPE_BF16: ((uint16_t *)out)[i] = dtype_f32_to_bf16((float)sum / (float)d); break;
        case DTYPE_I32: ((int32_t *)out)[i] = (int32_t)((int64_t)sum / (int64_t)d); break;
        case DTYPE_I64: ((int64_t *)out)[i] = (int64_t)sum / (int64_t)d; break;
        }
    }
}

static void check(struct cluster *c, size_t count, enum dtype t, enum dtype_op op, double denom,
                  const char *what)
{
    size_t esz = dtype_size(t), bytes = count * esz;
    uint8_t *want = malloc(bytes ? bytes : 1);

    cr_assert_not_null(want);
    reference(c->n, count, t, op, denom, want);
    for (size_t k = 0; k < c->n; k++) {
        cr_assert_eq(c->p[k].rc, 0, "%s: n=%zu count=%zu %s %s: member %zu returned %s", what,
                     c->n, count, dtype_name(t), dtype_op_name(op), k, log_strerror(c->p[k].rc));
        if (memcmp(c->p[k].buf, want, bytes) != 0) {
            size_t i = 0;
            while (memcmp((uint8_t *)c->p[k].buf + i * esz, want + i * esz, esz) == 0)
                i++;
            cr_assert_fail("%s: n=%zu count=%zu %s %s: member %zu differs at element %zu", what,
                           c->n, count, dtype_name(t), dtype_op_name(op), k, i);
        }
        cr_assert_eq(memcmp(c->p[k].buf, c->p[0].buf, bytes), 0);
        if (c->p[k].in) {
            uint8_t *mine = malloc(bytes ? bytes : 1);

            cr_assert_not_null(mine);
            for (size_t i = 0; i < count; i++)
                put(mine, t, i, input(k, i));
            cr_assert_eq(memcmp(c->p[k].in, mine, bytes), 0,
                         "%s: member %zu's contribution was written", what, k);
            free(mine);
        }
    }
    free(want);
}

/* Every member reduces fresh inputs in `round`, all making the same call;
 * the results must be the reference's. */
static void reduce_and_check(struct cluster *c, size_t count, enum dtype t, enum dtype_op op,
                             double denom, uint64_t round, const char *what)
{
    fill(c, count, t);
    call_all(c, count, t, op, denom, round);
    check(c, count, t, op, denom, what);
}

/* Every type and op at every count, for 1..8 members. */
static void matrix(size_t seg, size_t small, const size_t *counts, size_t n_counts, size_t n_lo,
                   size_t n_hi, bool reversed, bool oop, const char *what)
{
    size_t maxc = 0;

    for (size_t i = 0; i < n_counts; i++)
        maxc = counts[i] > maxc ? counts[i] : maxc;
    for (size_t n = n_lo; n <= n_hi; n++) {
        struct cluster c;
        size_t order[MAXP];
        uint64_t round = 0;

        quiet();
        cluster_init(&c, n, maxc * 8, seg, small, 30000);
        if (oop)
            cluster_out_of_place(&c);
        /* Listing members in reverse shows the schedule follows the
         * epoch's order, not creation order or ids. */
        for (size_t i = 0; i < n; i++)
            order[i] = reversed ? n - 1 - i : i;
        adopt(&c, 1, order);
        for (size_t ci = 0; ci < n_counts; ci++)
            for (int t = 0; t < DTYPE_COUNT; t++)
                for (int op = 0; op < DTYPE_OP_COUNT; op++)
                    reduce_and_check(&c, counts[ci], (enum dtype)t, (enum dtype_op)op, 3,
                                     ++round, what);
        cluster_fini(&c);
    }
}

static const size_t small_counts[] = { 0, 1, 2, 7, 13, 1031 };

Test(allreduce, recursive_doubling_matrix)
{
    /* The default threshold sends every one of these through recursive
     * doubling; 3, 5, 6 and 7 members exercise the non-power-of-two
     * hand-over. */
    matrix(0, 0, small_counts, sizeof small_counts / sizeof small_counts[0], 1, MAXP, false,
           false, "recursive doubling");
}

static void set_rider(struct cluster *c, size_t rider)
{
    for (size_t i = 0; i < c->n; i++)
        c->p[i].rider = rider;
}

/* A 1 KiB threshold, a payload of exactly that and the longest rider
 * behind it, of every type and op, in place and out of place, on 1 to 8
 * members: recursive doubling in its scratch of 1 KiB and a rider, which
 * ASan watches (a scratch with no room for the rider overflows). */
Test(allreduce, a_rider_rides_recursive_doubling_in_its_scratch, .timeout = 240)
{
    for (int oop = 0; oop <= 1; oop++)
        for (size_t n = 1; n <= MAXP; n++) {
            struct cluster c;
            uint64_t round = 0;

            quiet();
            cluster_init(&c, n, 1024 + ALLREDUCE_RIDER_MAX_BYTES, 0, 1024, 30000);
            if (oop)
                cluster_out_of_place(&c);
            adopt(&c, 1, NULL);
            for (int t = 0; t < DTYPE_COUNT; t++) {
                size_t asz = dtype_size(dtype_acc((enum dtype)t));
                size_t rider = ALLREDUCE_RIDER_MAX_BYTES / asz;

                set_rider(&c, rider);
                for (int op = 0; op < DTYPE_OP_COUNT; op++)
                    reduce_and_check(&c, 1024 / asz + rider, (enum dtype)t, (enum dtype_op)op, 3,
                                     ++round, "recursive doubling with a rider");
            }
            cluster_fini(&c);
        }
}

Test(allreduce, ring_matrix_tiny_segments)
{
    /* 16-byte segments: many windows, partial windows, and chunks that are
     * empty when there are fewer elements than members. */
    matrix(16, ALLREDUCE_SMALL_NONE, small_counts, sizeof small_counts / sizeof small_counts[0],
           1, MAXP, true, false, "ring");
}

/* The ring's cut: as few parts as the bound allows, none above it, the
 * lengths one apart at most and covering the length in order; so a
 * length one element over a whole number of parts leaves no part of one
 * element. The cursor walks windows, chunks and segments with it. */
Test(allreduce, ring_cuts_evenly_with_no_tiny_part)
{
    static const size_t mosts[] = { 1, 2, 3, 16, 64, 65536 };

    for (size_t m = 0; m < sizeof mosts / sizeof mosts[0]; m++)
        for (size_t len = 0; len < 3000; len++) {
            size_t most = mosts[m], n = ring_parts(len, most), lo = SIZE_MAX, hi = 0;

            cr_assert_eq(n, (len + most - 1) / most, "len %zu most %zu", len, most);
            cr_assert_eq(ring_part_start(len, n ? n : 1, 0), 0);
            for (size_t c = 0; c < n; c++) {
                size_t l = ring_part_start(len, n, c + 1) - ring_part_start(len, n, c);

                lo = l < lo ? l : lo;
                hi = l > hi ? l : hi;
            }
            if (n == 0)
                continue;
            cr_assert_eq(ring_part_start(len, n, n), len);
            cr_assert_leq(hi, most, "len %zu most %zu: a part of %zu", len, most, hi);
            cr_assert_leq(hi - lo, 1, "len %zu most %zu: parts of %zu and %zu", len, most, lo,
                          hi);
        }
    /* 1 MiB of float32 plus one element among 4 members, 256 KiB
     * segments: chunks of 65536 or 65537 elements, two segments each of
     * 32768 and 32768 or 32769, not 65536 and 1. */
    cr_assert_eq(ring_parts(65537, 65536), 2);
    cr_assert_eq(ring_part_start(65537, 2, 1), 32769);
}

/* Counts that do not divide, on every member count from 2 to MAXP, with
 * 64-byte segments (16 float32, 32 16-bit values) so that chunks span
 * several segments: 1 element, n - 1 and n + 1, primes, and chunks one
 * element over a whole number of segments, whose last segment was a
 * single element before chunks were cut evenly. Every type and op, in
 * place and out of place, against the reference, identical everywhere. */
Test(allreduce, ring_odd_counts_cut_chunks_evenly, .timeout = 240)
{
    for (size_t n = 2; n <= MAXP; n++) {
        const size_t counts[] = { 1, n - 1, n + 1, 97, 1009, 16 * n + 1, 3 * 16 * n + n + 1,
                                  32 * n - 1 };

        matrix(64, ALLREDUCE_SMALL_NONE, counts, sizeof counts / sizeof counts[0], n, n,
               n % 2 == 0, n % 3 == 0, "ring, odd counts");
    }
}

Test(allreduce, out_of_place_matrix_leaves_contributions_alone)
{
    static const size_t counts[] = { 0, 1, 7, 1031 };

    matrix(16, ALLREDUCE_SMALL_NONE, counts, sizeof counts / sizeof counts[0], 1, 5, false, true,
           "ring, out of place");
    matrix(0, 0, counts, sizeof counts / sizeof counts[0], 1, 5, false, true,
           "recursive doubling, out of place");
}

Test(allreduce, ring_medium_prime_count)
{
    static const size_t counts[] = { 100003 };

    matrix(0, 0, counts, 1, 2, MAXP, false, false, "ring, medium");
}

/* --- folding a short tail (ring.c, "Folding a tail") --------------------- */

/* Payload and header bytes this process's TCP connections have had
 * acknowledged, summed, once none has bytes in flight (the last ACKs of
 * a call may trail its return). The members are threads of this
 * process, so that is every byte any of them put on the wire. */
static bool sockets_idle(void *arg)
{
    uint64_t *sum = arg;

    *sum = 0;
    for (int fd = 3; fd < 4096; fd++) {
        struct tcp_info ti;
        socklen_t len = sizeof(ti);

        if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &len) < 0)
            continue;
        if (ti.tcpi_unacked != 0)
            return false;
        *sum += ti.tcpi_bytes_acked;
    }
    return true;
}

static uint64_t wire_bytes(void)
{
    uint64_t sum = 0;

    cr_assert(fixture_wait_until(sockets_idle, &sum, FIXTURE_WAIT_MS), "bytes still in flight");
    return sum;
}

/* Frames every member together sent in one call of `count` float32
 * elements, checked against the reference: the bytes on the wire less
 * the payload, which a ring, recursive doubling or a butterfly moves
 * whatever the cut, over the header's length. */
static size_t frames_of(struct cluster *c, size_t count, uint64_t round, size_t payload,
                        const char *what)
{
    uint64_t before = wire_bytes(), sent;

    reduce_and_check(c, count, DTYPE_F32, DTYPE_SUM, 0, round, what);
    sent = wire_bytes() - before;
    cr_assert_geq(sent, payload, "%s: %zu elements, %llu bytes sent", what, count,
                  (unsigned long long)sent);
    cr_assert_eq((sent - payload) % PEERWIRE_FRAME_BYTES, 0, "%s: %zu elements: %llu bytes more",
                 what, count, (unsigned long long)(sent - payload));
    return (size_t)((sent - payload) / PEERWIRE_FRAME_BYTES);
}

/* Buffers of whole segments (one window of two segments a chunk, and
 * three whole windows) with 1, 8, 36 (the 144 bytes of a few counters),
 * n x seg / 64 (the most that folds: seg / 64 a chunk) and one more
 * float32 elements behind them, on 2, 3 and 4 members, with the ring
 * forced and with the algorithm chosen by size (the ring, for the larger
 * base): the results are the reference's on every member, and every tail
 * up to the limit is carried in as many frames as the buffer without it,
 * counted on the wire, and in as many as ring_segments() says; past the
 * limit, one window of whole segments takes more (over several windows,
 * one more window may cut into chunks that fold again). Then every type,
 * averaged, at those sizes (16-bit types fold in their float32 partial
 * sums, over shorter windows). On 3 members out of place. */
Test(allreduce, ring_folds_a_short_tail_into_the_last_segments, .timeout = 240)
{
    const size_t seg_bytes = 16 << 10, seg = seg_bytes / 4, fold = seg / 64;

    for (int forced = 1; forced >= 0; forced--)
        for (size_t n = 2; n <= 4; n++) {
            size_t units = n == 2 ? 8 : 16;
            const size_t bases[] = { n * 2 * seg, 3 * n * units * seg };
            const size_t tails[] = { 1, 8, 36, n * fold, n * fold + 1 };
            size_t most = bases[1] + n * fold + 1;
            struct cluster c;
            uint64_t round = 0;

            quiet();
            cluster_init(&c, n, most * 8, seg_bytes, forced ? ALLREDUCE_SMALL_NONE : 0, 60000);
            /* Out of place on 3 members: contributions read, never written. */
            if (n == 3)
                cluster_out_of_place(&c);
            adopt(&c, 1, NULL);
            /* Connections come up in the first call that needs them, and
             * recursive doubling needs others: count from the next ring. */
            reduce_and_check(&c, bases[1], DTYPE_F32, DTYPE_SUM, 0, ++round, "warm-up");
            /* Chosen by size, the smaller base is recursive doubling,
             * whose payload differs: only the larger, a ring. */
            for (size_t b = forced ? 0 : 1; b < 2; b++) {
                size_t base = bases[b];
                size_t whole = frames_of(&c, base, ++round, 2 * (n - 1) * base * 4, "whole");

                cr_assert_eq(whole,
                             2 * (n - 1) * ring_segments(n, base, seg, ring_staged(n == 3, base * 4)),
                             "n=%zu: %zu elements", n, base);
                for (size_t k = 0; k < sizeof tails / sizeof tails[0]; k++) {
                    size_t count = base + tails[k];
                    bool folds = tails[k] <= n * fold;
                    size_t got = frames_of(&c, count, ++round, 2 * (n - 1) * count * 4,
                                           forced ? "ring, folded" : "chosen, folded");

                    cr_assert_eq(got,
                                 2 * (n - 1) *
                                     ring_segments(n, count, seg, ring_staged(n == 3, count * 4)),
                                 "n=%zu: %zu + %zu elements", n, base, tails[k]);
                    if (folds)
                        cr_assert_eq(got, whole, "n=%zu: %zu + %zu elements: %zu frames, not %zu",
                                     n, base, tails[k], got, whole);
                    else if (b == 0)
                        cr_assert_gt(got, whole, "n=%zu: %zu + %zu elements: %zu frames", n, base,
                                     tails[k], got);
                    for (int t = 0; forced && t < DTYPE_COUNT; t++)
                        reduce_and_check(&c, count, (enum dtype)t, DTYPE_AVG, 0, ++round,
                                         "ring, folded, every type");
                }
            }
            cluster_fini(&c);
        }
}

static void big(size_t n, size_t count, enum dtype t, enum dtype_op op, size_t seg)
{
    struct cluster c;

    cluster_start(&c, n, count * dtype_size(t), seg, 0, 60000);
    reduce_and_check(&c, count, t, op, 3, 1, "large");
    cluster_fini(&c);
}

Test(allreduce, f32_sum_64MiB_plus_one_element_2_peers)
{
    big(2, (64u << 20) / 4 + 1, DTYPE_F32, DTYPE_SUM, 0);
}

Test(allreduce, f32_sum_64MiB_plus_one_element_4_peers)
{
    big(4, (64u << 20) / 4 + 1, DTYPE_F32, DTYPE_SUM, 0);
}

Test(allreduce, out_of_place_bf16_and_f32_over_many_windows)
{
    struct cluster c;
    size_t count = (1u << 20) + 7;

    quiet();
    cluster_init(&c, 3, count * 4, 64 << 10, 0, 60000);
    cluster_out_of_place(&c);
    adopt(&c, 1, NULL);
    reduce_and_check(&c, count, DTYPE_BF16, DTYPE_AVG, 3, 1, "large bf16, out of place");
    reduce_and_check(&c, count, DTYPE_F32, DTYPE_AVG_BY, 3, 2, "large f32, out of place");
    cluster_fini(&c);
}

/* Out of place from RING_STAGED_MIN_BYTES up, sums stay in the staging
 * slots and only final ones are streamed into the results (ring.c,
 * "Staged sums"): every op in float32, and the other plain types, on 2
 * and 3 members over many windows, against the reference; the
 * contributions are left as they were (check). */
Test(allreduce, out_of_place_staged_sums_match_the_reference, .timeout = 240)
{
    size_t count = RING_STAGED_MIN_BYTES / 4 + 7;

    cr_assert(ring_staged(true, count * 4) || !dtype_copy_streams());
    for (size_t n = 2; n <= 3; n++) {
        struct cluster c;
        uint64_t round = 0;

        quiet();
        cluster_init(&c, n, count * 8, 64 << 10, 0, 60000);
        cluster_out_of_place(&c);
        adopt(&c, 1, NULL);
        for (int op = 0; op < DTYPE_OP_COUNT; op++)
            reduce_and_check(&c, count, DTYPE_F32, (enum dtype_op)op, 3, ++round, "staged f32");
        reduce_and_check(&c, count, DTYPE_F64, DTYPE_AVG, 3, ++round, "staged f64");
        reduce_and_check(&c, count, DTYPE_I32, DTYPE_MAX, 3, ++round, "staged i32");
        reduce_and_check(&c, count, DTYPE_I64, DTYPE_AVG_BY, 3, ++round, "staged i64");
        cluster_fini(&c);
    }
}

/* Staged, with NaNs of several payloads and signed zeros: every member
 * ends with the same bytes (one member finishes each chunk); a result is a
 * NaN exactly where an input is, and otherwise the exact sum, minimum or
 * maximum. Which NaN payload or which zero a tie keeps depends on the
 * order the ring sums in, which the cut decides, as "Folding a tail" in
 * ring.c says (tests/unit/test_dtype.c holds dtype_combine_onto to
 * dtype_combine_into's bytes). */
Test(allreduce, staged_sums_agree_everywhere_on_nan_and_signed_zero, .timeout = 240)
{
    static const uint32_t vals[] = { 0x7fc00000u, 0x7fc00123u, 0xffc00001u, 0x00000000u,
                                     0x80000000u, 0x3f800000u, 0xbf800000u };
    size_t count = RING_STAGED_MIN_BYTES / 4 + 5, bytes = count * 4;
    struct cluster c;
    uint64_t round = 0;

    cluster_start(&c, 3, bytes, 64 << 10, 0, 60000);
    cluster_out_of_place(&c);
    for (int op = DTYPE_SUM; op <= DTYPE_MAX; op++) {
        if (op == DTYPE_AVG)
            continue;
        for (size_t k = 0; k < c.n; k++) {
            uint32_t *in = c.p[k].in;

            for (size_t i = 0; i < count; i++)
                in[i] = vals[(i * 5 + k * 3 + i / 7) % 7];
            memset(c.p[k].buf, 0xa5, bytes);
        }
        call_all(&c, count, DTYPE_F32, (enum dtype_op)op, 0, ++round);
        for (size_t k = 0; k < c.n; k++) {
            cr_assert_eq(c.p[k].rc, 0);
            cr_assert(memcmp(c.p[k].buf, c.p[0].buf, bytes) == 0, "op %d: member %zu", op, k);
            for (size_t i = 0; i < count; i++)
                cr_assert_eq(((uint32_t *)c.p[k].in)[i], vals[(i * 5 + k * 3 + i / 7) % 7]);
        }
        for (size_t i = 0; i < count; i++) {
            float got = ((float *)c.p[0].buf)[i], sum = 0, lo = INFINITY, hi = -INFINITY;
            bool nan = false;

            for (size_t k = 0; k < c.n; k++) {
                float x = ((float *)c.p[k].in)[i];

                nan |= x != x;
                sum += x;
                lo = x < lo ? x : lo;
                hi = x > hi ? x : hi;
            }
            if (nan) {
                cr_assert(got != got, "op %d element %zu: %g, not a NaN", op, i, (double)got);
                continue;
            }
            cr_assert_eq(got, op == DTYPE_SUM ? sum : op == DTYPE_MIN ? lo : hi,
                         "op %d element %zu: %g", op, i, (double)got);
        }
    }
    cluster_fini(&c);
}

Test(allreduce, bf16_avg_and_f16_sum_over_many_windows)
{
    /* float32 partial sums held in staging slots across many windows. */
    big(3, (3u << 20) + 7, DTYPE_BF16, DTYPE_AVG, 64 << 10);
    big(5, (3u << 20) + 7, DTYPE_F16, DTYPE_SUM, 64 << 10);
}

/* NaNs with different payloads and signed zeros: whatever min, max and sum
 * make of them, every member must hold the same bytes, with the ring (one
 * member finishes each chunk) and with recursive doubling (everyone
 * computes, so the operand order must be the same everywhere). */
Test(allreduce, nan_and_signed_zero_identical_everywhere)
{
    static const size_t sizes[] = { 3, 4, 5, 7 };
    static const size_t smalls[] = { 0, ALLREDUCE_SMALL_NONE };

    for (size_t si = 0; si < 2; si++)
        for (size_t ni = 0; ni < 4; ni++) {
            struct cluster c;
            uint64_t round = 0;
            size_t count = 61;

            cluster_start(&c, sizes[ni], count * 4, 16, smalls[si], 30000);
            for (int op = DTYPE_SUM; op <= DTYPE_MAX; op++)
                for (int t = DTYPE_F32; t <= DTYPE_F16; t += 2) {
                    for (size_t k = 0; k < c.n; k++)
                        for (size_t i = 0; i < count; i++) {
                            uint32_t nan = 0x7fc00000u | (uint32_t)(k * 97 + i);
                            float v = (i + k) % 3 == 0 ? 0.0f : (i + k) % 3 == 1 ? -0.0f : 1.0f;
                            if (i % 4 == k % 4)
                                memcpy(&v, &nan, 4);
                            if (t == DTYPE_F32)
                                ((float *)c.p[k].buf)[i] = v;
                            else
                                ((uint16_t *)c.p[k].buf)[i] =
                                    (uint16_t)(0x7e00u | ((k * 31 + i) & 0x1ffu));
                        }
                    call_all(&c, count, (enum dtype)t, (enum dtype_op)op, 1, ++round);
                    for (size_t k = 0; k < c.n; k++) {
                        cr_assert_eq(c.p[k].rc, 0);
                        cr_assert_eq(memcmp(c.p[k].buf, c.p[0].buf, count * dtype_size(t)), 0,
                                     "n=%zu op %d type %d member %zu", c.n, op, t, k);
                    }
                }
            cluster_fini(&c);
        }
}

Test(allreduce, connections_survive_switching_algorithms)
{
    static const size_t counts[] = { 5, 300000, 9, 1, 300000, 100 };
    struct cluster c;
    uint64_t round = 0;

    for (size_t n = 3; n <= 5; n += 2) {
        cluster_start(&c, n, 300000 * 8, 0, 1024, 30000);
        for (size_t i = 0; i < sizeof counts / sizeof counts[0]; i++)
            reduce_and_check(&c, counts[i], DTYPE_F64, DTYPE_AVG, 1, ++round, "switching");
        cluster_fini(&c);
    }
}

/* --- API ---------------------------------------------------------------- */

Test(allreduce, single_member_returns_at_once)
{
    struct cluster c;
    float *f;
    uint16_t *h;

    cluster_start(&c, 1, 1024, 0, 0, 1000);
    f = c.p[0].buf;
    for (int i = 0; i < 10; i++)
        f[i] = (float)i;
    cr_assert_eq(allreduce_run(c.p[0].ar, c.p[0].h, 10, DTYPE_F32, DTYPE_AVG, 0, 1), 0);
    cr_assert_eq(f[7], 7.0f, "avg over one member is the input");
    cr_assert_eq(allreduce_run(c.p[0].ar, c.p[0].h, 10, DTYPE_F32, DTYPE_SUM, 0, 2), 0);
    cr_assert_eq(f[7], 7.0f);
    cr_assert_eq(allreduce_run(c.p[0].ar, c.p[0].h, 10, DTYPE_F32, DTYPE_AVG_BY, 2, 3), 0);
    cr_assert_eq(f[7], 3.5f, "avg by a denominator divides, as mlbench does");
    h = c.p[0].buf;
    for (int i = 0; i < 10; i++)
        h[i] = dtype_f32_to_f16((float)i);
    cr_assert_eq(allreduce_run(c.p[0].ar, c.p[0].h, 10, DTYPE_F16, DTYPE_AVG_BY, 4, 4), 0);
    cr_assert_eq(dtype_f16_to_f32(h[6]), 1.5f);
    cluster_fini(&c);
}

Test(allreduce, rejects_misuse)
{
    struct cluster c;
    struct allreduce *ar;
    struct allreduce_config cfg = { .cohort = COHORT, .member_id = "x", .listen_fd = -1 };
    char addr[64];
    int fd;

    quiet();
    cr_assert_eq(allreduce_create(&cfg, &ar), -EINVAL, "no listener");
    cr_assert_eq(allreduce_listen("localhost", &fd, addr, sizeof(addr)), -EINVAL, "not numeric");
    cr_assert_eq(allreduce_listen("127.0.0.1", &fd, addr, 8), -EINVAL, "address too long");
    cluster_init(&c, 2, 64, 0, 0, 1000);
    cfg.listen_fd = c.p[0].fd;
    cfg.segment_bytes = 12;
    cr_assert_eq(allreduce_create(&cfg, &ar), -EINVAL, "segment not a multiple of 8");
    cfg.segment_bytes = 0;
    cfg.member_id = "bad id";
    cr_assert_eq(allreduce_create(&cfg, &ar), -EINVAL);
    cr_assert_eq(allreduce_register(c.p[0].ar, (char *)c.p[0].buf + 4, 16), -EINVAL, "misaligned");
    cr_assert_eq(allreduce_register(c.p[0].ar, NULL, 16), -EINVAL);
    cr_assert_eq(allreduce_unregister(c.p[0].ar, 99), -EINVAL);
    cr_assert_eq(allreduce_run(c.p[0].ar, 99, 1, DTYPE_F32, DTYPE_SUM, 0, 1), -EINVAL);
    cr_assert_eq(allreduce_run(c.p[0].ar, c.p[0].h, 17, DTYPE_F32, DTYPE_SUM, 0, 1), -EINVAL,
                 "count beyond the registration");
    cr_assert_eq(allreduce_run(c.p[0].ar, c.p[0].h, 1, (enum dtype)9, DTYPE_SUM, 0, 1), -EINVAL);
    cr_assert_eq(allreduce_run(c.p[0].ar, c.p[0].h, 1, DTYPE_F32, (enum dtype_op)9, 0, 1), -EINVAL);
    cr_assert_eq(allreduce_run(c.p[0].ar, c.p[0].h, 1, DTYPE_F32, DTYPE_SUM, 0, 1), -ESTALE,
                 "no epoch yet");
    adopt(&c, 1, NULL);
    cr_assert_eq(allreduce_run(c.p[0].ar, c.p[0].h, 1, DTYPE_I32, DTYPE_AVG_BY, 2.5, 1), -EINVAL);
    cr_assert_eq(allreduce_run(c.p[0].ar, c.p[0].h, 1, DTYPE_F32, DTYPE_AVG_BY, 0, 1), -EINVAL);
    cr_assert_eq(allreduce_unregister(c.p[0].ar, c.p[0].h), 0);
    cr_assert_eq(allreduce_run(c.p[0].ar, c.p[0].h, 1, DTYPE_F32, DTYPE_SUM, 0, 1), -EINVAL);
    cr_assert_not(allreduce_busy(c.p[0].ar));
    cluster_fini(&c);
}

Test(allreduce, set_epoch_rules)
{
    struct cluster c;
    struct epoch *e1, *e2, *other;
    struct epoch_member m = { .id = "m-0", .address = "127.0.0.1:1" };

    quiet();
    cluster_init(&c, 2, 64, 0, 0, 1000);
    e1 = make_epoch(&c, 1, NULL, 2);
    e2 = make_epoch(&c, 2, NULL, 2);
    cr_assert_eq(epoch_create("elsewhere", 3, 0, &m, 1, &other), 0);
    cr_assert_eq(allreduce_set_epoch(c.p[0].ar, NULL), -EINVAL);
    cr_assert_eq(allreduce_set_epoch(c.p[0].ar, other), -EINVAL, "another cohort");
    cr_assert_eq(allreduce_set_epoch(c.p[0].ar, e2), 0);
    cr_assert_eq(allreduce_set_epoch(c.p[0].ar, e2), 0, "the same epoch again");
    cr_assert_eq(allreduce_set_epoch(c.p[0].ar, e1), -EINVAL, "an older epoch");
    epoch_unref(e1);
    epoch_unref(e2);
    epoch_unref(other);
    cluster_fini(&c);
}

Test(allreduce, member_left_out_of_the_epoch_gets_estale)
{
    struct cluster c;
    struct epoch *e;
    size_t only[] = { 1, 2 };

    quiet();
    cluster_init(&c, 3, 64, 0, 0, 1000);
    e = make_epoch(&c, 1, only, 2);
    cr_assert_eq(allreduce_set_epoch(c.p[0].ar, e), 0);
    cr_assert_eq(allreduce_run(c.p[0].ar, c.p[0].h, 4, DTYPE_F32, DTYPE_SUM, 0, 1), -ESTALE);
    epoch_unref(e);
    cluster_fini(&c);
}

/* --- epochs --------------------------------------------------------------- */

static bool both_busy(void *arg)
{
    struct cluster *c = arg;
    return allreduce_busy(c->p[0].ar) && allreduce_busy(c->p[1].ar);
}

/* Member 2 sits round 2 out, so 0 and 1 are mid-round with data flowing
 * when 0 adopts epoch 2: both return -ESTALE at once, 1 because 0's BYE
 * says so (sealed: only if its tag verifies). */
static void epoch_change_mid_round(struct cluster *c)
{
    size_t count = 4u << 20;
    uint64_t t0;
    struct epoch *e2;

    reduce_and_check(c, count, DTYPE_F32, DTYPE_SUM, 0, 1, "first round");
    call_start(&c->p[0], count, DTYPE_F32, DTYPE_SUM, 0, 2);
    call_start(&c->p[1], count, DTYPE_F32, DTYPE_SUM, 0, 2);
    cr_assert(fixture_wait_until(both_busy, c, 10000));
    e2 = make_epoch(c, 2, NULL, 3);
    t0 = clock_now_ms();
    cr_assert_eq(allreduce_set_epoch(c->p[0].ar, e2), 0);
    call_join(&c->p[0]);
    call_join(&c->p[1]);
    cr_assert_eq(c->p[0].rc, -ESTALE, "got %s", log_strerror(c->p[0].rc));
    cr_assert_eq(c->p[1].rc, -ESTALE, "the BYE tells the neighbour: got %s",
                 log_strerror(c->p[1].rc));
    cr_assert_lt(c->p[0].done_ms - t0, 2000);
    cr_assert_lt(c->p[1].done_ms - t0, 2000);
    /* Everyone in the new epoch: it works again. */
    cr_assert_eq(allreduce_set_epoch(c->p[1].ar, e2), 0);
    cr_assert_eq(allreduce_set_epoch(c->p[2].ar, e2), 0);
    epoch_unref(e2);
    reduce_and_check(c, count, DTYPE_F32, DTYPE_SUM, 0, 3, "after the change");
}

Test(allreduce, epoch_change_mid_round_returns_estale_promptly)
{
    struct cluster c;

    cluster_start(&c, 3, (4u << 20) * 4, 0, 0, 30000);
    epoch_change_mid_round(&c);
    cluster_fini(&c);
}

static bool first_busy(void *arg)
{
    struct cluster *c = arg;
    return allreduce_busy(c->p[0].ar);
}

/* Member 0 adopts epoch 2 and starts before member 1 has heard of it: 1
 * holds 0's greeting until its own adoption, then both succeed. */
Test(allreduce, greeting_from_a_newer_epoch_waits_for_ours)
{
    struct cluster c;
    struct epoch *e2;

    cluster_start(&c, 2, 4096 * 4, 0, 0, 10000);
    e2 = make_epoch(&c, 2, NULL, 2);
    cr_assert_eq(allreduce_set_epoch(c.p[0].ar, e2), 0);
    fill(&c, 4096, DTYPE_F32);
    call_start(&c.p[0], 4096, DTYPE_F32, DTYPE_AVG, 0, 1);
    cr_assert(fixture_wait_until(first_busy, &c, 10000));
    cr_assert_eq(allreduce_set_epoch(c.p[1].ar, e2), 0);
    call_start(&c.p[1], 4096, DTYPE_F32, DTYPE_AVG, 0, 1);
    call_join(&c.p[0]);
    call_join(&c.p[1]);
    check(&c, 4096, DTYPE_F32, DTYPE_AVG, 0, "late adoption");
    epoch_unref(e2);
    cluster_fini(&c);
}

/* Member 0 still in epoch 1 dials member 1, already in epoch 2: it is told
 * its epoch is stale and returns -ESTALE at once. */
Test(allreduce, member_of_an_older_epoch_is_told_so)
{
    struct cluster c;
    struct epoch *e2;
    uint64_t t0;
    int rc;

    cluster_start(&c, 2, 64, 0, 0, 20000);
    e2 = make_epoch(&c, 2, NULL, 2);
    cr_assert_eq(allreduce_set_epoch(c.p[1].ar, e2), 0);
    t0 = clock_now_ms();
    rc = allreduce_run(c.p[0].ar, c.p[0].h, 4, DTYPE_F32, DTYPE_SUM, 0, 1);
    cr_assert_eq(rc, -ESTALE, "got %s", log_strerror(rc));
    cr_assert_lt(clock_now_ms() - t0, 5000);
    epoch_unref(e2);
    cluster_fini(&c);
}

/* --- faults ------------------------------------------------------------- */

Test(allreduce, peer_that_stops_reading_times_out)
{
    struct cluster c;
    size_t count = 8u << 20;
    uint64_t t0;

    cluster_start(&c, 3, count * 4, 0, 0, 500);
    reduce_and_check(&c, count, DTYPE_F32, DTYPE_SUM, 0, 1, "first round");
    /* Member 2 keeps its connections open but never reads again. */
    t0 = clock_now_ms();
    call_start(&c.p[0], count, DTYPE_F32, DTYPE_SUM, 0, 2);
    call_start(&c.p[1], count, DTYPE_F32, DTYPE_SUM, 0, 2);
    call_join(&c.p[0]);
    call_join(&c.p[1]);
    for (int k = 0; k < 2; k++) {
        cr_assert_eq(c.p[k].rc, -ETIMEDOUT, "member %d: %s", k, log_strerror(c.p[k].rc));
        /* Not before the timeout (it is what ended the call), and not long
         * after: the silence clock starts when the stall does. */
        cr_assert_geq(c.p[k].done_ms - t0, 490);
        cr_assert_lt(c.p[k].done_ms - t0, 500 + 4000, "member %d took %llu ms", k,
                     (unsigned long long)(c.p[k].done_ms - t0));
    }
    cluster_fini(&c);
}

/* The greeting as peerwire.h documents it (version 2), unkeyed. */
static void hello_bytes(uint8_t *b, uint8_t kind, uint64_t epoch, const char *cohort,
                        const char *id)
{
    memset(b, 0, 616);
    memcpy(b, "COH1", 4);
    b[4] = 2;
    b[6] = kind;
    for (int i = 0; i < 8; i++)
        b[8 + i] = (uint8_t)(epoch >> (8 * i));
    b[16] = (uint8_t)strlen(cohort);
    b[17] = (uint8_t)strlen(id);
    memcpy(b + 104, cohort, strlen(cohort));
    memcpy(b + 360, id, strlen(id));
}

/* A TCP connection to a member's "127.0.0.1:port". `wait`: connected
 * when this returns; otherwise the connect is only started, so that a
 * listener that stopped accepting cannot stall the test itself. */
static int dial_to(const char *addr, bool wait)
{
    struct sockaddr_in sa = { .sin_family = AF_INET };
    const char *colon = strrchr(addr, ':');
    int fd = socket(AF_INET, SOCK_STREAM | (wait ? 0 : SOCK_NONBLOCK), 0);
    int rc;

    cr_assert_geq(fd, 0);
    sa.sin_port = htons((uint16_t)strtoul(colon + 1, NULL, 10));
    inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
    rc = connect(fd, (struct sockaddr *)&sa, sizeof(sa));
    cr_assert(rc == 0 || (!wait && errno == EINPROGRESS), "connect: %s", strerror(errno));
    return fd;
}

static int dial(const char *addr)
{
    return dial_to(addr, true);
}

/* Reads until the engine closes the connection; returns what came before. */
static ssize_t read_until_closed(int fd, uint8_t *buf, size_t len, int within_ms)
{
    size_t got = 0;
    uint64_t end = clock_now_ms() + (uint64_t)within_ms;

    for (;;) {
        struct pollfd p = { .fd = fd, .events = POLLIN };
        uint64_t now = clock_now_ms();
        ssize_t r;

        cr_assert_lt(now, end, "the engine did not close the connection in time");
        if (poll(&p, 1, (int)(end - now)) <= 0)
            continue;
        r = recv(fd, buf + got, len - got, 0);
        if (r <= 0)
            return (ssize_t)got;
        got += (size_t)r;
        cr_assert_lt(got, len, "the engine kept talking");
    }
}

/* A stranger: dials addr, sends the len bytes of msg (nothing when len is
 * 0), and reads what comes back into reply until the engine closes the
 * connection, which it must do within 5 s. Returns how many bytes came. */
static ssize_t stranger(const char *addr, const void *msg, size_t len, uint8_t *reply, size_t cap)
{
    int fd = dial(addr);
    ssize_t got;

    if (len)
        cr_assert_eq(send(fd, msg, len, MSG_NOSIGNAL), (ssize_t)len);
    got = read_until_closed(fd, reply, cap, 5000);
    close(fd);
    return got;
}

struct loop_arg {
    struct cluster *c;
    size_t rounds;
    int failures;
};

static void *reduce_loop(void *arg)
{
    struct loop_arg *l = arg;

    for (size_t r = 1; r <= l->rounds; r++) {
        fill(l->c, 200003, DTYPE_I64);
        call_all(l->c, 200003, DTYPE_I64, DTYPE_SUM, 0, r);
        for (size_t k = 0; k < l->c->n; k++)
            l->failures += l->c->p[k].rc != 0;
    }
    return NULL;
}

Test(allreduce, strangers_are_closed_and_harmless)
{
    struct cluster c;
    struct loop_arg l = { .c = &c, .rounds = 15 };
    pthread_t th;
    uint8_t b[2048], hello[616], junk[700];

    quiet();
    cluster_init(&c, 3, 200003 * 8, 0, 0, 1000);
    adopt(&c, 4, NULL);
    cr_assert_eq(pthread_create(&th, NULL, reduce_loop, &l), 0);
    for (size_t i = 0; i < sizeof junk; i++)
        junk[i] = (uint8_t)(i * 131 + 7);
    /* Garbage. */
    cr_assert_eq(stranger(c.p[1].addr, junk, sizeof junk, b, sizeof b), 0);
    /* A well-formed greeting for another cohort. */
    hello_bytes(hello, 1, 4, "other", "m-1");
    cr_assert_eq(stranger(c.p[0].addr, hello, sizeof hello, b, sizeof b), 0);
    /* Our cohort, but not a member. */
    hello_bytes(hello, 1, 4, COHORT, "intruder");
    cr_assert_eq(stranger(c.p[2].addr, hello, sizeof hello, b, sizeof b), 0);
    /* A member of an older epoch is told the newer number, then closed. */
    hello_bytes(hello, 1, 3, COHORT, "m-0");
    cr_assert_eq(stranger(c.p[2].addr, hello, sizeof hello, b, sizeof b), 616);
    cr_assert_eq(b[6], 3, "a stale reply");
    cr_assert_eq(b[8], 4, "naming epoch 4");
    /* Silence: closed after the member timeout. */
    cr_assert_eq(stranger(c.p[0].addr, NULL, 0, b, sizeof b), 0);
    pthread_join(th, NULL);
    cr_assert_eq(l.failures, 0, "the strangers disturbed the reductions");
    check(&c, 200003, DTYPE_I64, DTYPE_SUM, 0, "after strangers");
    cluster_fini(&c);
}

/* Hundreds of idle connections to a member's port, from the members' own
 * address: the next epoch's connections are still greeted at once, and
 * rounds go on, long before the idle ones could time out (10 s). */
Test(allreduce, idle_connections_do_not_stall_greetings)
{
    enum { IDLE = 300 };
    static int idle[IDLE];
    struct cluster c;

    quiet();
    cluster_init(&c, 2, 4096 * 8, 0, 0, 10000);
    adopt(&c, 1, NULL);
    reduce_and_check(&c, 4096, DTYPE_I64, DTYPE_SUM, 0, 1, "before the flood");
    for (int i = 0; i < IDLE; i++)
        idle[i] = dial_to(c.p[i % 2].addr, false);
    /* A new epoch: every connection is made again, through the flood. */
    adopt(&c, 2, NULL);
    for (uint64_t round = 2; round < 7; round++) {
        uint64_t t0 = clock_now_ms();
        reduce_and_check(&c, 4096, DTYPE_I64, DTYPE_SUM, 0, round, "through the flood");
        cr_assert_lt(clock_now_ms() - t0, 5000, "round %llu took %llu ms",
                     (unsigned long long)round, (unsigned long long)(clock_now_ms() - t0));
    }
    for (int i = 0; i < IDLE; i++)
        close(idle[i]);
    cluster_fini(&c);
}

Test(allreduce, mismatched_round_fails_fast_then_recovers)
{
    struct cluster c;
    uint64_t t0 = clock_now_ms();

    cluster_start(&c, 2, 100000 * 4, 0, 0, 20000);
    fill(&c, 100000, DTYPE_I32);
    call_start(&c.p[0], 100000, DTYPE_I32, DTYPE_MAX, 0, 5);
    call_start(&c.p[1], 100000, DTYPE_I32, DTYPE_MAX, 0, 6);
    call_join(&c.p[0]);
    call_join(&c.p[1]);
    cr_assert(c.p[0].rc == -EPROTO || c.p[1].rc == -EPROTO, "%s / %s", log_strerror(c.p[0].rc),
              log_strerror(c.p[1].rc));
    cr_assert_neq(c.p[0].rc, 0);
    cr_assert_neq(c.p[1].rc, 0);
    cr_assert_lt(clock_now_ms() - t0, 5000, "failed fast, not by timeout");
    reduce_and_check(&c, 100000, DTYPE_I32, DTYPE_MAX, 0, 7, "after a failed round");
    cluster_fini(&c);
}

/* --- real processes ----------------------------------------------------- */

struct note {
    int32_t round;
    int32_t finished;           /* 0: about to call, 1: returned rc */
    int32_t rc;
    int32_t lost;               /* the peer its engine reported lost (on_peer_lost), or -1 */
};

static int32_t child_lost = -1;

/* A child's on_peer_lost: ids are "m-<digit>" here. */
static void note_child_lost(void *arg, const char *peer)
{
    child_lost = peer[2] - '0';
}

/* A member in its own process: runs rounds of `count` f32 sums until one
 * fails, reporting before and after each call. Never returns. */
static void child_member(int listen_fd, const char *id, struct epoch *e, size_t count,
                         uint32_t timeout_ms, int out)
{
    struct allreduce_config cfg = { .cohort = COHORT, .member_id = id, .listen_fd = listen_fd,
                                    .member_timeout_ms = timeout_ms,
                                    .on_peer_lost = note_child_lost };
    struct allreduce *ar;
    float *buf;
    int h;

    log_set_level(LOG_ERROR);
    if (allreduce_create(&cfg, &ar) != 0 || allreduce_set_epoch(ar, e) != 0 ||
        posix_memalign((void **)&buf, 64, count * 4) != 0)
        _exit(3);
    h = allreduce_register(ar, buf, count * 4);
    for (int32_t round = 1;; round++) {
        struct note n = { round, 0, 0, -1 };

        for (size_t i = 0; i < count; i++)
            buf[i] = (float)(i % 5);
        if (write(out, &n, sizeof(n)) != sizeof(n))
            _exit(4);
        n.rc = allreduce_run(ar, h, count, DTYPE_F32, DTYPE_SUM, 0, (uint64_t)round);
        n.finished = 1;
        n.lost = child_lost;
        if (n.rc == 0 && buf[count - 1] != 3.0f * (float)((count - 1) % 5))
            n.rc = -EBADMSG;
        if (write(out, &n, sizeof(n)) != sizeof(n) || n.rc != 0)
            _exit(0);
    }
}

static struct note read_note(int fd, int within_ms)
{
    struct pollfd p = { .fd = fd, .events = POLLIN };
    struct note n;

    cr_assert_eq(poll(&p, 1, within_ms), 1, "no word from the member in %d ms", within_ms);
    cr_assert_eq(read(fd, &n, sizeof(n)), (ssize_t)sizeof(n), "the member is gone");
    return n;
}

/* Members 1 and 2 are forked before this process starts any thread;
 * member 0 is this process. Round 1 completes; during round 2 member 2 is
 * sent `sig`. Returns after checking that the survivors failed with an
 * error (`want`, or any error if want is 0) within `within_ms` of the
 * signal. */
/* The peers an engine reported lost (allreduce_config.on_peer_lost). */
struct lost_note {
    pthread_mutex_t lock;
    char ids[4][24];
    size_t n;
};

static void note_lost(void *arg, const char *peer)
{
    struct lost_note *l = arg;

    pthread_mutex_lock(&l->lock);
    if (l->n < 4)
        snprintf(l->ids[l->n++], sizeof(l->ids[0]), "%s", peer);
    pthread_mutex_unlock(&l->lock);
}

/* The peers an engine reported unreachable (on_peer_unreachable), and the
 * epoch each report named. */
static void note_unreachable(void *arg, const char *peer, uint64_t epoch)
{
    struct lost_note *l = arg;

    pthread_mutex_lock(&l->lock);
    if (l->n < 4)
        snprintf(l->ids[l->n++], sizeof(l->ids[0]), "%s@%llu", peer, (unsigned long long)epoch);
    pthread_mutex_unlock(&l->lock);
}

static size_t notes(struct lost_note *l)
{
    size_t n;

    pthread_mutex_lock(&l->lock);
    n = l->n;
    pthread_mutex_unlock(&l->lock);
    return n;
}

/* With unreach_ms, member 0 also reports unreachable peers
 * (allreduce_set_unreachable_ms), and must report none: a stopped or
 * killed process's host still answers. */
static void process_fault(int sig, int want, uint32_t timeout_ms, uint32_t within_ms,
                          uint32_t unreach_ms)
{
    static struct lost_note lost = { .lock = PTHREAD_MUTEX_INITIALIZER };
    static struct lost_note unreach = { .lock = PTHREAD_MUTEX_INITIALIZER };
    struct cluster c = { .n = 3 };
    struct epoch *e;
    pid_t pids[3] = { 0 };
    int pipes[3][2];
    size_t count = 4u << 20;
    struct peer *me = &c.p[0];
    struct allreduce_config cfg = { .cohort = COHORT, .member_id = "m-0",
                                    .member_timeout_ms = timeout_ms, .on_peer_lost = note_lost,
                                    .peer_lost_arg = &lost,
                                    .on_peer_unreachable = note_unreachable,
                                    .peer_unreachable_arg = &unreach };
    struct note n;
    uint64_t t_sig;

    quiet();
    for (size_t i = 0; i < 3; i++) {
        snprintf(c.p[i].id, sizeof(c.p[i].id), "m-%zu", i);
        cr_assert_eq(allreduce_listen("127.0.0.1", &c.p[i].fd, c.p[i].addr, sizeof(c.p[i].addr)),
                     0);
    }
    e = make_epoch(&c, 1, NULL, 3);
    for (size_t i = 1; i < 3; i++) {
        cr_assert_eq(pipe(pipes[i]), 0);
        pids[i] = fork();
        cr_assert_geq(pids[i], 0);
        if (pids[i] == 0) {
            close(pipes[i][0]);
            for (size_t j = 0; j < 3; j++)
                if (j != i)
                    close(c.p[j].fd);
            child_member(c.p[i].fd, c.p[i].id, e, count, timeout_ms, pipes[i][1]);
        }
        close(pipes[i][1]);
    }
    cfg.listen_fd = me->fd;
    cr_assert_eq(allreduce_create(&cfg, &me->ar), 0);
    allreduce_set_unreachable_ms(me->ar, unreach_ms);
    cr_assert_eq(allreduce_set_epoch(me->ar, e), 0);
    cr_assert_eq(posix_memalign(&me->buf, 64, count * 4), 0);
    me->h = allreduce_register(me->ar, me->buf, count * 4);
    for (size_t i = 0; i < count; i++)
        ((float *)me->buf)[i] = (float)(i % 5);

    cr_assert_eq(allreduce_run(me->ar, me->h, count, DTYPE_F32, DTYPE_SUM, 0, 1), 0);
    cr_assert_eq(((float *)me->buf)[count - 1], 3.0f * (float)((count - 1) % 5));
    for (size_t i = 1; i < 3; i++) {
        n = read_note(pipes[i][0], 30000);   /* about to run round 1 */
        n = read_note(pipes[i][0], 30000);
        cr_assert(n.round == 1 && n.finished && n.rc == 0, "member %zu round 1: %d", i, n.rc);
    }
    call_start(me, count, DTYPE_F32, DTYPE_SUM, 0, 2);
    n = read_note(pipes[2][0], 30000);
    cr_assert(n.round == 2 && !n.finished);
    cr_assert(fixture_wait_until(first_busy, &c, 10000));
    t_sig = clock_now_ms();
    cr_assert_eq(kill(pids[2], sig), 0);

    call_join(me);
    cr_assert_neq(me->rc, 0, "round 2 cannot have finished without member 2");
    if (want)
        cr_assert_eq(me->rc, want, "got %s", log_strerror(me->rc));
    cr_assert_lt(me->done_ms - t_sig, within_ms, "took %llu ms",
                 (unsigned long long)(me->done_ms - t_sig));
    do
        n = read_note(pipes[1][0], (int)within_ms + 1000);
    while (!n.finished);
    cr_assert_eq(n.round, 2);
    cr_assert_neq(n.rc, 0, "the other survivor failed too");
    if (want)
        cr_assert_eq(n.rc, want, "got %s", log_strerror(n.rc));
    cr_assert_lt(clock_now_ms() - t_sig, within_ms);
    /* A killed m-2's sockets reset under its neighbours: at least one of
     * m-0 and m-1 sees that itself (the other may hear a BYE first) and
     * reports m-2, and nobody reports anyone else. A stopped m-2's sockets
     * stay open, and a timeout is not a death: nobody reports it. */
    cr_assert_leq(lost.n, 1, "reported %zu peers lost", lost.n);
    if (lost.n)
        cr_assert_str_eq(lost.ids[0], "m-2");
    cr_assert(n.lost == -1 || n.lost == 2, "m-1 reported m-%d lost", n.lost);
    if (sig == SIGKILL)
        cr_assert(lost.n == 1 || n.lost == 2, "no survivor reported the killed m-2");
    else
        cr_assert(lost.n == 0 && n.lost == -1, "a stopped member was reported lost");

    kill(pids[2], SIGKILL);
    for (size_t i = 1; i < 3; i++) {
        waitpid(pids[i], NULL, 0);
        close(pipes[i][0]);
    }
    allreduce_destroy(me->ar);
    free(me->buf);
    for (size_t i = 0; i < 3; i++)
        close(c.p[i].fd);
    epoch_unref(e);
    /* After the cleanup: a stopped child must not outlive a failure. */
    cr_assert_eq(notes(&unreach), 0, "reported %s unreachable", unreach.ids[0]);
}

Test(allreduce, sigkilled_peer_process_fails_survivors_within_timeout)
{
    /* The kernel closes a killed process's sockets, so its neighbours see
     * a reset at once, well within the member timeout; the third member
     * hears of it by BYE or reset. */
    process_fault(SIGKILL, 0, 3000, 3000, 0);
}

Test(allreduce, stopped_peer_process_times_out_survivors)
{
    /* A stopped process reads nothing and sends nothing, but its sockets
     * stay open: only the member timeout can end the round. */
    process_fault(SIGSTOP, -ETIMEDOUT, 1000, 1000 + 4000, 0);
}

Test(allreduce, a_stopped_peer_is_not_reported_unreachable, .timeout = 60)
{
    /* Stopped for longer than the unreachable time: its kernel still
     * answers keepalive probes and acknowledges bytes, so it is slow, not
     * cut off; the call ends at the engine's own timeout. */
    process_fault(SIGSTOP, -ETIMEDOUT, 6000, 6000 + 4000, 3000);
}

/* A listener whose accept queue is full and never drained: the kernel
 * drops further SYNs, as a host behind a partition would. */
static int deaf_listener(char *addr, size_t len, int *held, size_t n_held)
{
    struct sockaddr_in sa = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
    socklen_t sl = sizeof(sa);
    int fd = socket(AF_INET, SOCK_STREAM, 0);

    cr_assert_geq(fd, 0);
    cr_assert_eq(bind(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    cr_assert_eq(listen(fd, 0), 0);
    cr_assert_eq(getsockname(fd, (struct sockaddr *)&sa, &sl), 0);
    snprintf(addr, len, "127.0.0.1:%u", ntohs(sa.sin_port));
    /* Fill the queue: each connect completes once queued, until none can. */
    for (size_t i = 0; i < n_held; i++) {
        held[i] = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
        cr_assert_geq(held[i], 0);
        (void)connect(held[i], (struct sockaddr *)&sa, sizeof(sa));
    }
    return fd;
}

static bool unreach_noted(void *arg)
{
    return notes(arg) > 0;
}

Test(allreduce, an_unanswered_dial_is_reported_unreachable_and_the_call_waits, .timeout = 60)
{
    static struct lost_note unreach = { .lock = PTHREAD_MUTEX_INITIALIZER };
    struct cluster c = { .n = 2 };
    struct peer *me = &c.p[0];
    struct allreduce_config cfg = { .cohort = COHORT, .member_id = "m-0",
                                    .member_timeout_ms = 60000,
                                    .on_peer_unreachable = note_unreachable,
                                    .peer_unreachable_arg = &unreach };
    struct epoch *e, *e2;
    int held[8], deaf;
    uint64_t t0;

    quiet();
    snprintf(c.p[0].id, sizeof(c.p[0].id), "m-0");
    snprintf(c.p[1].id, sizeof(c.p[1].id), "m-1");
    cr_assert_eq(allreduce_listen("127.0.0.1", &me->fd, me->addr, sizeof(me->addr)), 0);
    deaf = deaf_listener(c.p[1].addr, sizeof(c.p[1].addr), held, 8);
    e = make_epoch(&c, 7, NULL, 2);
    cfg.listen_fd = me->fd;
    cr_assert_eq(allreduce_create(&cfg, &me->ar), 0);
    /* Below the floor: raised to 3000 ms. */
    allreduce_set_unreachable_ms(me->ar, 10);
    cr_assert_eq(allreduce_set_epoch(me->ar, e), 0);
    cr_assert_eq(posix_memalign(&me->buf, 64, 4096), 0);
    me->h = allreduce_register(me->ar, me->buf, 4096);
    me->hin = -1;

    t0 = clock_now_ms();
    call_start(me, 1024, DTYPE_F32, DTYPE_SUM, 0, 1);
    cr_assert(fixture_wait_until(unreach_noted, &unreach, 20000), "m-1 was never reported");
    cr_assert_geq(clock_now_ms() - t0, 3000, "reported before the unreachable time");
    cr_assert_str_eq(unreach.ids[0], "m-1@7");
    /* The call still waits: the broker decides, and its epoch ends it. */
    cr_assert_eq(me->rc, 1, "the call ended: %s", log_strerror(me->rc));
    e2 = make_epoch(&c, 8, NULL, 1);
    cr_assert_eq(allreduce_set_epoch(me->ar, e2), 0);
    call_join(me);
    cr_assert_eq(me->rc, -ESTALE, "got %s", log_strerror(me->rc));

    allreduce_destroy(me->ar);
    free(me->buf);
    for (size_t i = 0; i < 8; i++)
        close(held[i]);
    close(deaf);
    close(me->fd);
    epoch_unref(e);
    epoch_unref(e2);
}

Test(allreduce, a_member_without_a_connection_is_probed_and_reported, .timeout = 60)
{
    static struct lost_note unreach = { .lock = PTHREAD_MUTEX_INITIALIZER };
    struct cluster c = { .n = 4 };
    struct peer *me = &c.p[0];
    struct allreduce_config cfg = { .cohort = COHORT, .member_id = "m-0",
                                    .member_timeout_ms = 60000,
                                    .small_bytes = ALLREDUCE_SMALL_NONE,
                                    .on_peer_unreachable = note_unreachable,
                                    .peer_unreachable_arg = &unreach };
    struct epoch *e, *e2;
    int held[8], deaf;
    uint64_t t0;

    /* A ring of four: m-0 dials its neighbours m-1 and m-3, plain
     * listeners that take the connection and never answer the greeting
     * (slow, not cut off); m-2, which it has no reason to dial, is a host
     * that drops SYNs. Only a probe can find it. */
    quiet();
    for (size_t i = 0; i < 4; i++)
        snprintf(c.p[i].id, sizeof(c.p[i].id), "m-%zu", i);
    for (size_t i = 0; i < 4; i += 3)
        cr_assert_eq(allreduce_listen("127.0.0.1", &c.p[i].fd, c.p[i].addr, sizeof(c.p[i].addr)),
                     0);
    cr_assert_eq(allreduce_listen("127.0.0.1", &c.p[1].fd, c.p[1].addr, sizeof(c.p[1].addr)), 0);
    deaf = deaf_listener(c.p[2].addr, sizeof(c.p[2].addr), held, 8);
    e = make_epoch(&c, 7, NULL, 4);
    cfg.listen_fd = me->fd;
    cr_assert_eq(allreduce_create(&cfg, &me->ar), 0);
    allreduce_set_unreachable_ms(me->ar, 3000);
    cr_assert_eq(allreduce_set_epoch(me->ar, e), 0);
    cr_assert_eq(posix_memalign(&me->buf, 64, 4096), 0);
    me->h = allreduce_register(me->ar, me->buf, 4096);
    me->hin = -1;

    t0 = clock_now_ms();
    call_start(me, 1024, DTYPE_F32, DTYPE_SUM, 0, 1);
    cr_assert(fixture_wait_until(unreach_noted, &unreach, 20000), "m-2 was never reported");
    cr_assert_geq(clock_now_ms() - t0, 3000, "reported before the unreachable time");
    cr_assert_str_eq(unreach.ids[0], "m-2@7");
    cr_assert_eq(me->rc, 1, "the call ended: %s", log_strerror(me->rc));
    e2 = make_epoch(&c, 8, NULL, 1);
    cr_assert_eq(allreduce_set_epoch(me->ar, e2), 0);
    call_join(me);
    cr_assert_eq(me->rc, -ESTALE, "got %s", log_strerror(me->rc));
    /* Neither slow neighbour was reported: their hosts answered. */
    for (size_t i = 0; i < notes(&unreach); i++)
        cr_assert_str_eq(unreach.ids[i], "m-2@7");

    allreduce_destroy(me->ar);
    free(me->buf);
    for (size_t i = 0; i < 8; i++)
        close(held[i]);
    close(deaf);
    for (size_t i = 0; i < 4; i++)
        if (i != 2)
            close(c.p[i].fd);
    epoch_unref(e);
    epoch_unref(e2);
}

/* The distinct peers an engine reported unreachable and when it first
 * reported each (on_peer_unreachable), for an epoch of up to WIDE. */
#define WIDE 1025u

struct wide_note {
    pthread_mutex_t lock;
    struct epoch *e;
    uint64_t at[WIDE];          /* 0: not reported */
    size_t n;
};

static void note_wide(void *arg, const char *peer, uint64_t epoch)
{
    struct wide_note *w = arg;
    long i = epoch_find(w->e, peer);

    pthread_mutex_lock(&w->lock);
    if (i >= 0 && epoch == w->e->number && !w->at[i]) {
        w->at[i] = clock_now_ms();
        w->n++;
    }
    pthread_mutex_unlock(&w->lock);
}

static bool wide_round_done(void *arg)
{
    struct wide_note *w = arg;
    bool done;

    pthread_mutex_lock(&w->lock);
    done = w->n >= limit_reach_probes(WIDE);
    pthread_mutex_unlock(&w->lock);
    return done;
}

/* An epoch of 1,025 whose members other than m-0 are all behind a host
 * that drops SYNs: a waiting m-0 probes limit_reach_probes(1025) = 128 of
 * them in its first round, not 64, so that it has probed everyone within
 * LIMIT_REACH_ROUNDS rounds, as the broker's report window expects; the
 * second round comes a whole unreachable time later. */
Test(allreduce, a_large_epoch_is_probed_wider_per_round, .timeout = 60)
{
    static struct wide_note w = { .lock = PTHREAD_MUTEX_INITIALIZER };
    static struct epoch_member em[WIDE];
    static char wids[WIDE][16];
    struct peer me = { .hin = -1 };
    struct allreduce_config cfg = { .cohort = COHORT, .member_id = "m-0",
                                    .member_timeout_ms = 60000,
                                    .small_bytes = ALLREDUCE_SMALL_NONE,
                                    .on_peer_unreachable = note_wide,
                                    .peer_unreachable_arg = &w };
    char deaf_addr[64];
    struct epoch *e2;
    int held[8], deaf;
    uint64_t first = UINT64_MAX;
    size_t in_round = 0;

    quiet();
    cr_assert_eq(limit_reach_probes(WIDE), 128);
    cr_assert_eq(limit_reach_rounds(WIDE), LIMIT_REACH_ROUNDS);
    cr_assert_eq(allreduce_listen("127.0.0.1", &me.fd, me.addr, sizeof(me.addr)), 0);
    deaf = deaf_listener(deaf_addr, sizeof(deaf_addr), held, 8);
    for (size_t i = 0; i < WIDE; i++) {
        snprintf(wids[i], sizeof(wids[i]), "m-%zu", i);
        em[i] = (struct epoch_member){ .id = wids[i], .address = i ? deaf_addr : me.addr };
    }
    cr_assert_eq(epoch_create(COHORT, 7, 0, em, WIDE, &w.e), 0);
    cfg.listen_fd = me.fd;
    cr_assert_eq(allreduce_create(&cfg, &me.ar), 0);
    allreduce_set_unreachable_ms(me.ar, 3000);
    cr_assert_eq(allreduce_set_epoch(me.ar, w.e), 0);
    cr_assert_eq(posix_memalign(&me.buf, 64, 4096), 0);
    me.h = allreduce_register(me.ar, me.buf, 4096);

    call_start(&me, 1024, DTYPE_F32, DTYPE_SUM, 0, 1);
    cr_assert(fixture_wait_until(wide_round_done, &w, 30000), "only %zu peers were reported",
              w.n);
    /* The first round's reports come together (they all time out at one
     * check, give or take the dials of the ring's two neighbours); the
     * next round's, 3 s later. */
    pthread_mutex_lock(&w.lock);
    for (size_t i = 0; i < WIDE; i++)
        if (w.at[i] && w.at[i] < first)
            first = w.at[i];
    for (size_t i = 0; i < WIDE; i++)
        in_round += w.at[i] && w.at[i] < first + 2000;
    pthread_mutex_unlock(&w.lock);
    cr_assert_geq(in_round, limit_reach_probes(WIDE), "the first round reported %zu peers",
                  in_round);
    cr_assert_leq(in_round, limit_reach_probes(WIDE) + 2, "the first round reported %zu peers",
                  in_round);
    cr_assert_eq(me.rc, 1, "the call ended: %s", log_strerror(me.rc));
    cr_assert_eq(epoch_create(COHORT, 8, 0, em, 1, &e2), 0);
    cr_assert_eq(allreduce_set_epoch(me.ar, e2), 0);
    call_join(&me);
    cr_assert_eq(me.rc, -ESTALE, "got %s", log_strerror(me.rc));

    allreduce_destroy(me.ar);
    free(me.buf);
    for (size_t i = 0; i < 8; i++)
        close(held[i]);
    close(deaf);
    close(me.fd);
    epoch_unref(w.e);
    epoch_unref(e2);
}

/* --- authentication ------------------------------------------------------ */

static const struct secret key_a = { { 0xa0, 0xa1, 0xa2, 0xa3, 0xa4, 0xa5, 0xa6, 0xa7,
                                       0xa8, 0xa9, 0xaa, 0xab, 0xac, 0xad, 0xae, 0xaf,
                                       0xb0, 0xb1, 0xb2, 0xb3, 0xb4, 0xb5, 0xb6, 0xb7,
                                       0xb8, 0xb9, 0xba, 0xbb, 0xbc, 0xbd, 0xbe, 0xbf } };
static const struct secret key_b = { { 0xa0, 0xa1, 0xa2, 0xa3, 0xa4, 0xa5, 0xa6, 0xa7,
                                       0xa8, 0xa9, 0xaa, 0xab, 0xac, 0xad, 0xae, 0xaf,
                                       0xb0, 0xb1, 0xb2, 0xb3, 0xb4, 0xb5, 0xb6, 0xb7,
                                       0xb8, 0xb9, 0xba, 0xbb, 0xbc, 0xbd, 0xbe, 0x00 } };

/* Every member keyed with `key`, with or without frame tags. */
static void cluster_start_keyed(struct cluster *c, size_t n, size_t bytes, size_t seg,
                                size_t small, uint32_t timeout_ms, const struct secret *key,
                                bool integrity)
{
    struct security sec[MAXP];

    for (size_t i = 0; i < n; i++)
        sec[i] = (struct security){ key, integrity };
    quiet();
    cluster_init_sec(c, n, bytes, seg, small, timeout_ms, sec);
    adopt(c, 1, NULL);
}

Test(allreduce, keyed_members_reduce_with_both_algorithms)
{
    static const size_t counts[] = { 1, 7, 1031, 100003 };
    static const size_t smalls[] = { 0, ALLREDUCE_SMALL_NONE };

    for (int integrity = 0; integrity < 2; integrity++)
        for (size_t si = 0; si < 2; si++)
            for (size_t n = 2; n <= 5; n++) {
                struct cluster c;
                uint64_t round = 0;

                cluster_start_keyed(&c, n, 100003 * 8, si ? 4096 : 0, smalls[si], 30000, &key_a,
                                    integrity);
                for (size_t k = 0; k < 4; k++) {
                    reduce_and_check(&c, counts[k], DTYPE_F32, DTYPE_SUM, 0, ++round,
                                     integrity ? "keyed, sealed" : "keyed");
                    reduce_and_check(&c, counts[k], DTYPE_BF16, DTYPE_AVG, 0, ++round,
                                     integrity ? "keyed, sealed" : "keyed");
                    reduce_and_check(&c, counts[k], DTYPE_I64, DTYPE_MAX, 0, ++round,
                                     integrity ? "keyed, sealed" : "keyed");
                }
                cluster_fini(&c);
            }
}

Test(allreduce, sealed_frames_survive_epochs_and_switching_algorithms)
{
    static const size_t counts[] = { 5, 300000, 9, 1, 300000, 100 };
    struct cluster c;
    struct epoch *e;
    size_t order[] = { 2, 0, 3, 1 };
    uint64_t round = 0;

    cluster_start_keyed(&c, 4, 300000 * 8, 0, 1024, 30000, &key_a, true);
    for (size_t i = 0; i < sizeof counts / sizeof counts[0]; i++)
        reduce_and_check(&c, counts[i], DTYPE_F64, DTYPE_AVG, 1, ++round, "sealed, switching");
    /* A new epoch in another order: every connection is new, and so are
     * their keys and counters. */
    e = make_epoch(&c, 2, order, 4);
    for (size_t i = 0; i < 4; i++)
        cr_assert_eq(allreduce_set_epoch(c.p[i].ar, e), 0);
    epoch_unref(e);
    for (size_t i = 0; i < sizeof counts / sizeof counts[0]; i++)
        reduce_and_check(&c, counts[i], DTYPE_F64, DTYPE_AVG, 1, ++round, "sealed, new epoch");
    cluster_fini(&c);
}

Test(allreduce, sealed_bye_carries_its_cause)
{
    struct cluster c;

    cluster_start_keyed(&c, 3, (4u << 20) * 4, 0, 0, 30000, &key_a, true);
    epoch_change_mid_round(&c);
    cluster_fini(&c);
}

Test(allreduce, integrity_needs_a_key)
{
    struct allreduce *ar;
    struct allreduce_config cfg = { .cohort = COHORT, .member_id = "m-0", .integrity_mac = true };
    char addr[64];
    int fd;

    quiet();
    cr_assert_eq(allreduce_listen("127.0.0.1", &fd, addr, sizeof(addr)), 0);
    cfg.listen_fd = fd;
    cr_assert_eq(allreduce_create(&cfg, &ar), -EINVAL);
    cfg.key = &key_a;
    cr_assert_eq(allreduce_create(&cfg, &ar), 0);
    allreduce_destroy(ar);
    close(fd);
}

/* Members whose security differs: every call fails, member `refused`
 * (it dials the odd one out) at once with -EACCES (it hears why, or sees
 * the MAC fail), the others by their member timeout at the latest.
 * Nothing hangs. */
static void mismatch(const struct security *sec, size_t n, size_t refused, const char *what)
{
    struct cluster c;
    uint64_t t0;

    quiet();
    cluster_init_sec(&c, n, 4096 * 4, 0, 0, 1000, sec);
    adopt(&c, 1, NULL);
    fill(&c, 4096, DTYPE_F32);
    t0 = clock_now_ms();
    call_all(&c, 4096, DTYPE_F32, DTYPE_SUM, 0, 1);
    cr_assert_eq(c.p[refused].rc, -EACCES, "%s: member %zu got %s", what, refused,
                 log_strerror(c.p[refused].rc));
    cr_assert_lt(c.p[refused].done_ms - t0, 1000, "%s: refused at once, not by a timeout", what);
    for (size_t i = 0; i < n; i++) {
        cr_assert_neq(c.p[i].rc, 0, "%s: member %zu", what, i);
        cr_assert_lt(c.p[i].done_ms - t0, 1000 + 4000, "%s: member %zu took too long", what, i);
    }
    cluster_fini(&c);
}

Test(allreduce, wrong_key_fails_cleanly)
{
    struct security two[] = { { &key_a, false }, { &key_b, false } };
    struct security three[] = { { &key_a, true }, { &key_a, true }, { &key_b, true } };

    mismatch(two, 2, 0, "another key");
    /* Three members reduce 16 KiB by recursive doubling: m-0 hands its
     * data to m-1, which dials m-2. */
    mismatch(three, 3, 1, "another key, one of three");
}

Test(allreduce, keyed_and_unkeyed_members_refuse_each_other)
{
    struct security keyed_dials[] = { { &key_a, false }, { NULL, false } };
    struct security unkeyed_dials[] = { { NULL, false }, { &key_a, false } };

    mismatch(keyed_dials, 2, 0, "a keyed member dials an unkeyed one");
    mismatch(unkeyed_dials, 2, 0, "an unkeyed member dials a keyed one");
}

Test(allreduce, integrity_mismatch_is_refused)
{
    struct security a[] = { { &key_a, true }, { &key_a, false } };
    struct security b[] = { { &key_a, false }, { &key_a, true } };

    mismatch(a, 2, 0, "the dialling member seals frames, the other not");
    mismatch(b, 2, 0, "the accepting member seals frames, the other not");
}

/* Reads exactly len bytes within `within_ms`; false at a close or the
 * deadline. */
static bool read_exact(int fd, uint8_t *buf, size_t len, int within_ms)
{
    uint64_t end = clock_now_ms() + (uint64_t)within_ms;
    size_t got = 0;

    while (got < len) {
        struct pollfd p = { .fd = fd, .events = POLLIN };
        uint64_t now = clock_now_ms();
        ssize_t r;

        if (now >= end || poll(&p, 1, (int)(end - now)) <= 0)
            return false;
        r = recv(fd, buf + got, len - got, 0);
        if (r <= 0)
            return false;
        got += (size_t)r;
    }
    return true;
}

/* A greeting as a connector sends it, claiming `id`, into b. */
static void greet_bytes(uint8_t *b, uint64_t epoch, const char *id, uint8_t flags,
                        uint64_t incarnation, uint64_t serial, uint8_t *nonce)
{
    struct peerwire_hello h = { .kind = PEERWIRE_GREET, .flags = flags, .epoch = epoch,
                                .incarnation = incarnation, .serial = serial };

    if (nonce) {
        cr_assert_eq(secret_random(nonce, PEERWIRE_NONCE_BYTES), 0);
        memcpy(h.nonce, nonce, PEERWIRE_NONCE_BYTES);
    }
    snprintf(h.cohort, sizeof(h.cohort), "%s", COHORT);
    snprintf(h.id, sizeof(h.id), "%s", id);
    cr_assert_eq(peerwire_hello_encode(b, &h), 0);
}

/* The engine's answer in b: decoded, and of `kind`. */
static struct peerwire_hello answer_of(const uint8_t *b, uint8_t kind)
{
    struct peerwire_hello h;
    const char *why = peerwire_hello_decode(b, PEERWIRE_HELLO_BYTES, &h);

    cr_assert_null(why, "the answer does not decode: %s", why);
    cr_assert_eq(h.kind, kind, "an answer of kind %d, not %d", h.kind, kind);
    return h;
}

/* True when fd is closed by the engine within within_ms, with nothing
 * more said; the time it took in *ms. */
static bool closed_within(int fd, int within_ms, uint64_t *ms)
{
    uint64_t t0 = clock_now_ms();
    uint8_t b[PEERWIRE_HELLO_BYTES];
    struct pollfd p = { .fd = fd, .events = POLLIN };
    ssize_t r;

    if (poll(&p, 1, within_ms) != 1)
        return false;
    r = recv(fd, b, sizeof(b), 0);
    if (ms)
        *ms = clock_now_ms() - t0;
    return r == 0 || (r < 0 && errno == ECONNRESET);
}

Test(allreduce, impersonators_without_the_key_are_closed_and_harmless)
{
    struct cluster c;
    struct loop_arg l = { .c = &c, .rounds = 20 };
    pthread_t th;
    uint8_t b[PEERWIRE_HELLO_BYTES], nonce[PEERWIRE_NONCE_BYTES];
    struct peerwire_hello h;
    uint64_t ms;
    int fd;

    quiet();
    {
        struct security sec[3] = { { &key_a, true }, { &key_a, true }, { &key_a, true } };
        cluster_init_sec(&c, 3, 200003 * 8, 0, 0, 10000, sec);
    }
    adopt(&c, 1, NULL);
    cr_assert_eq(pthread_create(&th, NULL, reduce_loop, &l), 0);

    /* Claims m-0 without a key: told the key is required, and closed. */
    greet_bytes(b, 1, "m-0", 0, 1, 1, NULL);
    fd = dial(c.p[2].addr);
    cr_assert_eq(send(fd, b, sizeof(b), MSG_NOSIGNAL), (ssize_t)sizeof(b));
    cr_assert(read_exact(fd, b, sizeof(b), 5000), "no answer");
    h = answer_of(b, PEERWIRE_REFUSE);
    cr_assert_eq(h.reason, PEERWIRE_REFUSE_NEED_KEY);
    cr_assert(closed_within(fd, 5000, NULL));
    close(fd);

    /* Claims to be keyed, and never confirms: answered with a challenge,
     * then closed once the greeting deadline passes. */
    greet_bytes(b, 1, "m-1", PEERWIRE_F_KEYED | PEERWIRE_F_INTEGRITY, 1, 1, nonce);
    fd = dial(c.p[2].addr);
    cr_assert_eq(send(fd, b, sizeof(b), MSG_NOSIGNAL), (ssize_t)sizeof(b));
    cr_assert(read_exact(fd, b, sizeof(b), 5000), "no answer");
    h = answer_of(b, PEERWIRE_ACCEPT);
    cr_assert_str_eq(h.id, "m-2");
    cr_assert(closed_within(fd, 5000, &ms), "an unconfirmed greeting stayed open");
    cr_assert_geq(ms, 500, "closed after %llu ms, before the deadline", (unsigned long long)ms);
    close(fd);

    /* Confirms with a MAC it cannot make (here: the acceptor's own MAC,
     * echoed back, as a script echoing frames would): closed at once. */
    greet_bytes(b, 1, "m-0", PEERWIRE_F_KEYED | PEERWIRE_F_INTEGRITY, 1, 1, nonce);
    fd = dial(c.p[1].addr);
    cr_assert_eq(send(fd, b, sizeof(b), MSG_NOSIGNAL), (ssize_t)sizeof(b));
    cr_assert(read_exact(fd, b, sizeof(b), 5000), "no answer");
    h = answer_of(b, PEERWIRE_ACCEPT);
    h.kind = PEERWIRE_CONFIRM;
    snprintf(h.id, sizeof(h.id), "m-0");
    cr_assert_eq(peerwire_hello_encode(b, &h), 0);
    cr_assert_eq(send(fd, b, sizeof(b), MSG_NOSIGNAL), (ssize_t)sizeof(b));
    cr_assert(closed_within(fd, 5000, &ms));
    cr_assert_lt(ms, 500, "a wrong confirmation is closed at once, not by the deadline");
    close(fd);

    /* Another --integrity: told so. */
    greet_bytes(b, 1, "m-0", PEERWIRE_F_KEYED, 1, 1, nonce);
    fd = dial(c.p[1].addr);
    cr_assert_eq(send(fd, b, sizeof(b), MSG_NOSIGNAL), (ssize_t)sizeof(b));
    cr_assert(read_exact(fd, b, sizeof(b), 5000), "no answer");
    cr_assert_eq(answer_of(b, PEERWIRE_REFUSE).reason, PEERWIRE_REFUSE_INTEGRITY);
    close(fd);

    /* A greeting of version 1, as today's scripts send: closed unanswered. */
    hello_bytes(b, 1, 1, COHORT, "m-0");
    b[4] = 1;
    {
        uint8_t r[1024];
        cr_assert_eq(stranger(c.p[1].addr, b, 536, r, sizeof r), 0);
    }

    pthread_join(th, NULL);
    cr_assert_eq(l.failures, 0, "the impersonators disturbed the reductions");
    check(&c, 200003, DTYPE_I64, DTYPE_SUM, 0, "after impersonators");
    cluster_fini(&c);
}

Test(allreduce, wrong_role_is_refused)
{
    struct cluster c;
    uint8_t b[PEERWIRE_HELLO_BYTES], r[2 * PEERWIRE_HELLO_BYTES], nonce[PEERWIRE_NONCE_BYTES];

    /* Unkeyed: m-0 dials m-1 (it is lower in the epoch's order), so m-1
     * greeting m-0 is a stranger, closed unanswered, while the same
     * greeting the other way round is accepted. */
    cluster_start(&c, 2, 64, 0, 0, 10000);
    hello_bytes(b, PEERWIRE_GREET, 1, COHORT, "m-1");
    cr_assert_eq(stranger(c.p[0].addr, b, sizeof b, r, sizeof r), 0, "the wrong role answered");
    cluster_fini(&c);

    /* In an epoch listing m-1 first, the roles turn round. */
    quiet();
    cluster_init(&c, 2, 64, 0, 0, 10000);
    {
        size_t order[] = { 1, 0 };
        adopt(&c, 1, order);
    }
    hello_bytes(b, PEERWIRE_GREET, 1, COHORT, "m-0");
    cr_assert_eq(stranger(c.p[1].addr, b, sizeof b, r, sizeof r), 0, "the wrong role answered");
    fill(&c, 16, DTYPE_F32);
    call_all(&c, 16, DTYPE_F32, DTYPE_SUM, 0, 1);
    check(&c, 16, DTYPE_F32, DTYPE_SUM, 0, "after a wrong role");
    cluster_fini(&c);

    /* Keyed: refused before any MAC is made, so no challenge comes back. */
    cluster_start_keyed(&c, 2, 64, 0, 0, 10000, &key_a, false);
    greet_bytes(b, 1, "m-1", PEERWIRE_F_KEYED, 1, 1, nonce);
    cr_assert_eq(stranger(c.p[0].addr, b, sizeof b, r, sizeof r), 0, "the wrong role answered");
    greet_bytes(b, 1, "m-0", PEERWIRE_F_KEYED, 1, 1, nonce);
    cr_assert_eq(stranger(c.p[1].addr, b, sizeof b, r, sizeof r), PEERWIRE_HELLO_BYTES,
                 "the right role is challenged");
    fill(&c, 16, DTYPE_F32);
    call_all(&c, 16, DTYPE_F32, DTYPE_SUM, 0, 1);
    check(&c, 16, DTYPE_F32, DTYPE_SUM, 0, "after a wrong role");
    cluster_fini(&c);
}

/* A TCP proxy on loopback in front of a member: the epoch advertises the
 * proxy's address, so the member that dials it talks through the proxy.
 * It records what the first connection's dialler sends, and may flip one
 * byte of it. One thread per direction per connection, each reading and
 * writing blocking: an engine always reads while it waits, so neither
 * direction can stall the other. */
#define PROXY_CONNS 16
#define PROXY_RECORD 4096

struct proxy;

struct pump {
    struct proxy *px;
    int from, to;
    bool upstream;              /* dialler -> member */
    bool first;                 /* of the proxy's first connection */
    pthread_t th;
};

struct proxy {
    int lfd;
    char addr[64], target[64];
    pthread_t th;
    size_t flip_at;             /* offset in the first connection's upstream, or SIZE_MAX */
    pthread_mutex_t mu;
    uint8_t rec[PROXY_RECORD];  /* the first connection's upstream bytes */
    size_t n_rec;
    uint8_t rec_down[PROXY_RECORD]; /* and its downstream ones */
    size_t n_rec_down;
    struct pump pumps[2 * PROXY_CONNS];
    size_t n_pumps;
};

static void *pump_main(void *arg)
{
    struct pump *p = arg;
    size_t at = 0;
    uint8_t buf[65536];

    for (;;) {
        ssize_t r = recv(p->from, buf, sizeof(buf), 0);
        size_t done = 0;

        if (r <= 0)
            break;
        if (p->first) {
            uint8_t *rec = p->upstream ? p->px->rec : p->px->rec_down;
            size_t *n = p->upstream ? &p->px->n_rec : &p->px->n_rec_down;

            pthread_mutex_lock(&p->px->mu);
            for (size_t i = 0; i < (size_t)r && *n < PROXY_RECORD; i++)
                rec[(*n)++] = buf[i];
            pthread_mutex_unlock(&p->px->mu);
            if (p->upstream && p->px->flip_at >= at && p->px->flip_at < at + (size_t)r)
                buf[p->px->flip_at - at] ^= 0x40;
        }
        at += (size_t)r;
        while (done < (size_t)r) {
            ssize_t w = send(p->to, buf + done, (size_t)r - done, MSG_NOSIGNAL);
            if (w <= 0)
                goto out;
            done += (size_t)w;
        }
    }
out:
    /* Either end gone: so is the other. */
    shutdown(p->to, SHUT_RDWR);
    shutdown(p->from, SHUT_RDWR);
    return NULL;
}

static void *proxy_main(void *arg)
{
    struct proxy *px = arg;

    for (;;) {
        int cfd = accept(px->lfd, NULL, NULL), sfd;
        struct pump *up, *down;

        if (cfd < 0)
            return NULL;        /* shut down by proxy_stop */
        sfd = dial(px->target);
        pthread_mutex_lock(&px->mu);
        if (px->n_pumps == 2 * PROXY_CONNS) {
            pthread_mutex_unlock(&px->mu);
            close(cfd);
            close(sfd);
            continue;
        }
        up = &px->pumps[px->n_pumps++];
        down = &px->pumps[px->n_pumps++];
        *up = (struct pump){ .px = px, .from = cfd, .to = sfd, .upstream = true,
                             .first = px->n_pumps == 2 };
        *down = (struct pump){ .px = px, .from = sfd, .to = cfd, .upstream = false,
                               .first = px->n_pumps == 2 };
        pthread_mutex_unlock(&px->mu);
        cr_assert_eq(pthread_create(&up->th, NULL, pump_main, up), 0);
        cr_assert_eq(pthread_create(&down->th, NULL, pump_main, down), 0);
    }
}

/* Puts a proxy in front of member k: the epochs made after this advertise
 * it instead of the member's own address. */
static void proxy_start(struct proxy *px, struct cluster *c, size_t k, size_t flip_at)
{
    memset(px, 0, sizeof(*px));
    px->flip_at = flip_at;
    pthread_mutex_init(&px->mu, NULL);
    cr_assert_eq(allreduce_listen("127.0.0.1", &px->lfd, px->addr, sizeof(px->addr)), 0);
    snprintf(px->target, sizeof(px->target), "%s", c->p[k].addr);
    snprintf(c->p[k].addr, sizeof(c->p[k].addr), "%s", px->addr);
    cr_assert_eq(pthread_create(&px->th, NULL, proxy_main, px), 0);
}

static void proxy_stop(struct proxy *px)
{
    shutdown(px->lfd, SHUT_RDWR);
    pthread_join(px->th, NULL);
    close(px->lfd);
    for (size_t i = 0; i < px->n_pumps; i++)
        shutdown(px->pumps[i].from, SHUT_RDWR);
    for (size_t i = 0; i < px->n_pumps; i++)
        pthread_join(px->pumps[i].th, NULL);
    for (size_t i = 0; i < px->n_pumps; i += 2)
        close(px->pumps[i].from), close(px->pumps[i].to);
    pthread_mutex_destroy(&px->mu);
}

static size_t recorded(struct proxy *px)
{
    size_t n;

    pthread_mutex_lock(&px->mu);
    n = px->n_rec;
    pthread_mutex_unlock(&px->mu);
    return n;
}

/* A keyed 2-member cluster whose m-0 reaches m-1 through a proxy, after
 * one round: the proxy holds m-0's greeting and confirmation. */
static void proxied_pair(struct cluster *c, struct proxy *px, bool integrity, uint32_t timeout_ms,
                         size_t flip_at)
{
    struct security sec[2] = { { &key_a, integrity }, { &key_a, integrity } };

    quiet();
    cluster_init_sec(c, 2, 4096 * 8, 0, 0, timeout_ms, sec);
    proxy_start(px, c, 1, flip_at);
    adopt(c, 1, NULL);
}

Test(allreduce, a_replayed_greeting_is_refused)
{
    struct cluster c;
    struct proxy px;
    uint8_t rec[2 * PEERWIRE_HELLO_BYTES], b[PEERWIRE_HELLO_BYTES];
    struct peerwire_hello greet, first, again;
    uint64_t ms;
    int fd;

    proxied_pair(&c, &px, true, 10000, SIZE_MAX);
    reduce_and_check(&c, 4096, DTYPE_I64, DTYPE_SUM, 0, 1, "through the proxy");
    cr_assert_geq(recorded(&px), sizeof(rec));
    memcpy(rec, px.rec, sizeof(rec));
    greet = answer_of(rec, PEERWIRE_GREET);
    cr_assert_str_eq(greet.id, "m-0");
    answer_of(rec + PEERWIRE_HELLO_BYTES, PEERWIRE_CONFIRM);
    pthread_mutex_lock(&px.mu);
    cr_assert_geq(px.n_rec_down, PEERWIRE_HELLO_BYTES);
    first = answer_of(px.rec_down, PEERWIRE_ACCEPT);
    pthread_mutex_unlock(&px.mu);

    /* The recorded greeting and confirmation, sent again to m-1 itself:
     * it answers with a new nonce, so the old confirmation fails and the
     * connection is closed at once, not handed to a run. */
    fd = dial(px.target);
    cr_assert_eq(send(fd, rec, sizeof(rec), MSG_NOSIGNAL), (ssize_t)sizeof(rec));
    cr_assert(read_exact(fd, b, sizeof(b), 5000), "no answer");
    again = answer_of(b, PEERWIRE_ACCEPT);
    cr_assert_neq(memcmp(again.nonce, first.nonce, PEERWIRE_NONCE_BYTES), 0);
    cr_assert(closed_within(fd, 5000, &ms), "the replay was not closed");
    cr_assert_lt(ms, 500, "closed by the deadline, not by the failed confirmation");
    close(fd);

    /* The same replay twice more, and the greeting alone: the same. */
    for (int i = 0; i < 2; i++) {
        fd = dial(px.target);
        cr_assert_eq(send(fd, rec, sizeof(rec), MSG_NOSIGNAL), (ssize_t)sizeof(rec));
        cr_assert(read_exact(fd, b, sizeof(b), 5000));
        cr_assert(closed_within(fd, 5000, NULL));
        close(fd);
    }
    reduce_and_check(&c, 4096, DTYPE_I64, DTYPE_SUM, 0, 2, "after the replays");
    cluster_fini(&c);
    proxy_stop(&px);
}

/* Greets m-1 at `addr` as m-0 with the key, as a member would, with the
 * given incarnation and serial; returns the connection once confirmed. */
static int greet_as_member(const char *addr, uint64_t incarnation, uint64_t serial)
{
    uint8_t b[PEERWIRE_HELLO_BYTES];
    struct peerauth_transcript t = { .cohort = COHORT, .connector = "m-0", .acceptor = "m-1",
                                     .epoch = 1, .reply_epoch = 1, .incarnation = incarnation,
                                     .serial = serial, .flags = PEERWIRE_F_KEYED };
    struct peerwire_hello h;
    int fd = dial(addr);

    greet_bytes(b, 1, "m-0", PEERWIRE_F_KEYED, incarnation, serial, t.nonce_c);
    cr_assert_eq(send(fd, b, sizeof(b), MSG_NOSIGNAL), (ssize_t)sizeof(b));
    cr_assert(read_exact(fd, b, sizeof(b), 5000), "no answer");
    h = answer_of(b, PEERWIRE_ACCEPT);
    memcpy(t.nonce_a, h.nonce, sizeof(t.nonce_a));
    cr_assert(peerauth_verify(&key_a, PEERAUTH_ACCEPT, &t, h.mac), "m-1 did not prove the key");
    h = (struct peerwire_hello){ .kind = PEERWIRE_CONFIRM, .flags = PEERWIRE_F_KEYED, .epoch = 1 };
    snprintf(h.cohort, sizeof(h.cohort), "%s", COHORT);
    snprintf(h.id, sizeof(h.id), "m-0");
    cr_assert_eq(peerauth_mac(&key_a, PEERAUTH_CONFIRM, &t, h.mac), 0);
    cr_assert_eq(peerwire_hello_encode(b, &h), 0);
    cr_assert_eq(send(fd, b, sizeof(b), MSG_NOSIGNAL), (ssize_t)sizeof(b));
    return fd;
}

/* What became of a greeting as m-0 with a key: rounds run until the
 * engine closes it (kept: the live connection stayed) or a round fails
 * (replaced: m-1 then sent it a frame meant for m-0). */
enum fate { KEPT, REPLACED };

static enum fate fate_of(struct cluster *c, int fd, uint64_t *round)
{
    for (int i = 0; i < 200; i++) {
        struct pollfd p = { .fd = fd, .events = POLLIN };
        uint8_t b[PEERWIRE_FRAME_BYTES];

        fill(c, 4096, DTYPE_I64);
        call_all(c, 4096, DTYPE_I64, DTYPE_SUM, 0, ++*round);
        if (c->p[0].rc != 0 || c->p[1].rc != 0) {
            /* m-1 took this connection for m-0's: its frame came here. */
            cr_assert(read_exact(fd, b, sizeof(b), 5000), "a round failed, and not for this");
            cr_assert_eq(peerwire_get32(b), PEERWIRE_FRAME_DATA);
            return REPLACED;
        }
        check(c, 4096, DTYPE_I64, DTYPE_SUM, 0, "while the live connection is kept");
        if (poll(&p, 1, 0) == 1) {
            cr_assert_eq(recv(fd, b, sizeof(b), 0), 0, "the engine talked to the impostor");
            return KEPT;
        }
    }
    cr_assert_fail("the greeting was neither refused nor taken");
    return KEPT;
}

Test(allreduce, a_live_connection_is_replaced_only_by_a_newer_incarnation)
{
    struct cluster c;
    struct proxy px;
    struct peerwire_hello greet;
    uint64_t round = 1;
    int fd;

    proxied_pair(&c, &px, false, 1000, SIZE_MAX);
    reduce_and_check(&c, 4096, DTYPE_I64, DTYPE_SUM, 0, round, "through the proxy");
    cr_assert_geq(recorded(&px), PEERWIRE_HELLO_BYTES);
    greet = answer_of(px.rec, PEERWIRE_GREET);

    /* The same incarnation and serial (a second connection in its name,
     * authenticated): the live one stays, the new one is closed. */
    fd = greet_as_member(px.target, greet.incarnation, greet.serial);
    cr_assert_eq(fate_of(&c, fd, &round), KEPT, "same incarnation and serial");
    close(fd);
    /* An older serial of the same incarnation: the same. */
    fd = greet_as_member(px.target, greet.incarnation, greet.serial - 1);
    cr_assert_eq(fate_of(&c, fd, &round), KEPT, "an older serial");
    close(fd);
    /* A newer serial (the engine dialled again) replaces it. */
    fd = greet_as_member(px.target, greet.incarnation, greet.serial + 1);
    cr_assert_eq(fate_of(&c, fd, &round), REPLACED, "a newer serial");
    close(fd);
    /* After the failed round m-0 dials again; then another incarnation
     * (m-0 restarted) replaces that too. */
    reduce_and_check(&c, 4096, DTYPE_I64, DTYPE_SUM, 0, ++round, "after m-0 dialled again");
    fd = greet_as_member(px.target, greet.incarnation ^ 1, 1);
    cr_assert_eq(fate_of(&c, fd, &round), REPLACED, "another incarnation");
    close(fd);
    reduce_and_check(&c, 4096, DTYPE_I64, DTYPE_SUM, 0, ++round, "at the end");
    cluster_fini(&c);
    proxy_stop(&px);
}

/* Flips one payload byte of m-0's first data frame to m-1. */
static size_t first_payload_byte(bool integrity)
{
    return 2 * PEERWIRE_HELLO_BYTES + PEERWIRE_FRAME_BYTES + (integrity ? PEERWIRE_TAG_BYTES : 0) +
           100;
}

Test(allreduce, a_tampered_frame_fails_the_call_and_commits_nothing)
{
    struct cluster c;
    struct proxy px;

    /* Sealed: m-1 finds the tag wrong and fails with -EPROTO. No member
     * returns 0 with a wrong result: m-0, whose data from m-1 was not
     * touched, may finish its exchange with the right sum (in an
     * all-reduce a member that has all it needs is done; m-1's failure
     * reaches it only if it is still listening). */
    proxied_pair(&c, &px, true, 10000, first_payload_byte(true));
    fill(&c, 4096, DTYPE_I64);
    call_all(&c, 4096, DTYPE_I64, DTYPE_SUM, 0, 1);
    cr_assert_eq(c.p[1].rc, -EPROTO, "m-1 got %s", log_strerror(c.p[1].rc));
    if (c.p[0].rc == 0) {
        uint8_t *want = malloc(4096 * 8);

        cr_assert_not_null(want);
        reference(2, 4096, DTYPE_I64, DTYPE_SUM, 0, want);
        cr_assert_eq(memcmp(c.p[0].buf, want, 4096 * 8), 0, "m-0 committed a wrong result");
        free(want);
    }
    /* The ring: every member forwards what it received, so m-1's failure
     * ends m-0's call too. */
    cluster_fini(&c);
    proxy_stop(&px);
    {
        struct security sec[2] = { { &key_a, true }, { &key_a, true } };

        quiet();
        cluster_init_sec(&c, 2, 4096 * 8, 1024, ALLREDUCE_SMALL_NONE, 10000, sec);
        proxy_start(&px, &c, 1, first_payload_byte(true));
        adopt(&c, 1, NULL);
    }
    fill(&c, 4096, DTYPE_I64);
    call_all(&c, 4096, DTYPE_I64, DTYPE_SUM, 0, 1);
    cr_assert_eq(c.p[1].rc, -EPROTO, "m-1 got %s", log_strerror(c.p[1].rc));
    cr_assert_neq(c.p[0].rc, 0, "m-0 returned a result m-1 did not share");
    /* The next connection is not tampered with: all is well again. */
    reduce_and_check(&c, 4096, DTYPE_I64, DTYPE_SUM, 0, 2, "after the tampered round");
    cluster_fini(&c);
    proxy_stop(&px);

    /* The same flip unsealed goes unnoticed: m-1 commits a wrong sum. This
     * is what the tags are for, and shows the flip hits the payload. */
    proxied_pair(&c, &px, false, 10000, first_payload_byte(false));
    fill(&c, 4096, DTYPE_I64);
    call_all(&c, 4096, DTYPE_I64, DTYPE_SUM, 0, 1);
    cr_assert_eq(c.p[0].rc, 0);
    cr_assert_eq(c.p[1].rc, 0);
    cr_assert_neq(memcmp(c.p[0].buf, c.p[1].buf, 4096 * 8), 0, "the flip changed nothing");
    cluster_fini(&c);
    proxy_stop(&px);
}

/* The acceptor's bounds hold with the longer, keyed greeting: hundreds of
 * idle connections, and a new epoch's greetings get through at once. */
Test(allreduce, idle_connections_do_not_stall_keyed_greetings)
{
    enum { IDLE = 300 };
    static int idle[IDLE];
    struct cluster c;

    cluster_start_keyed(&c, 3, 4096 * 8, 0, 0, 10000, &key_a, true);
    reduce_and_check(&c, 4096, DTYPE_I64, DTYPE_SUM, 0, 1, "before the flood");
    for (int i = 0; i < IDLE; i++)
        idle[i] = dial_to(c.p[i % 3].addr, false);
    adopt(&c, 2, NULL);
    for (uint64_t round = 2; round < 7; round++) {
        uint64_t t0 = clock_now_ms();
        reduce_and_check(&c, 4096, DTYPE_I64, DTYPE_SUM, 0, round, "through the flood");
        cr_assert_lt(clock_now_ms() - t0, 5000, "round %llu took %llu ms",
                     (unsigned long long)round, (unsigned long long)(clock_now_ms() - t0));
    }
    for (int i = 0; i < IDLE; i++)
        close(idle[i]);
    cluster_fini(&c);
}

/* --- codecs ------------------------------------------------------------- */

/* Float inputs that are not small integers, so int8's scales matter. */
static float coded_input(size_t peer, size_t i)
{
    return (float)((long)((i * 7919 + peer * 104729 + i / 5) % 2001) - 1000) / 37.0f +
           (i % 97 == 0 ? 100.0f : 0);
}

/* Every member reduces coded_input with `codec`; the results must be
 * identical on every member, within the codec's bound of the exact
 * reduction, and, for the 16-bit codecs, values the codec represents. */
static void coded_check(struct cluster *c, size_t count, enum dtype_op op, enum codec codec,
                        uint64_t round, const char *what)
{
    size_t n = c->n;
    double worst = 0;

    for (size_t k = 0; k < n; k++) {
        float *dst = c->p[k].in ? c->p[k].in : c->p[k].buf;

        if (c->p[k].in)
            memset(c->p[k].buf, 0xa5, count * 4);
        for (size_t i = 0; i < count; i++)
            dst[i] = coded_input(k, i);
        c->p[k].codec = codec;
    }
    call_all(c, count, DTYPE_F32, op, 3, round);
    for (size_t k = 0; k < n; k++) {
        cr_assert_eq(c->p[k].rc, 0, "%s: n=%zu %s %s: member %zu: %s", what, n,
                     codec_name(codec), dtype_op_name(op), k, log_strerror(c->p[k].rc));
        cr_assert_eq(memcmp(c->p[k].buf, c->p[0].buf, count * 4), 0,
                     "%s: n=%zu %s %s: member %zu differs from member 0", what, n,
                     codec_name(codec), dtype_op_name(op), k);
    }
    for (size_t i = 0; i < count; i++) {
        double sum = 0, lo = INFINITY, hi = -INFINITY, amax = 0, want, err, bound;
        float got = ((float *)c->p[0].buf)[i];

        for (size_t k = 0; k < n; k++) {
            double x = coded_input(k, i);
            sum += x;
            lo = x < lo ? x : lo;
            hi = x > hi ? x : hi;
            amax += fabs(x);
        }
        want = op == DTYPE_SUM ? sum : op == DTYPE_AVG ? sum / (double)n
             : op == DTYPE_AVG_BY ? sum / 3 : op == DTYPE_MIN ? lo : hi;
        /* Each of up to n encodings of a partial value errs by at most a
         * relative 2^-11 (fp16), 2^-8 (bf16), or, for int8, half a step of
         * its block, whose extreme is at most 1100 x n here, or, for
         * meanstd16, 2^-11 of its distance from its run's mean (at most
         * 2 x 1100 x n) and float32's rounding of the result, or, for
         * uniform8 and quantile8, a codebook mean of the run: within its
         * range (the bucket bounds are test_codec.c's). */
        if (codec == CODEC_INT8)
            bound = (double)n * (1100.0 * (double)n / 254) * 1.001;
        else if (codec == CODEC_UNIFORM8 || codec == CODEC_QUANTILE8)
            bound = (double)n * (2200.0 * (double)n) * 1.001;     /* a run's range */
        else if (codec == CODEC_MEANSTD16)
            bound = (double)n * (2200.0 * (double)n * 0x1p-11) * 1.01;
        else
            bound = (double)n * amax * (codec == CODEC_FP16 ? 0x1p-11 : 0x1p-8) * 1.001;
        err = fabs((double)got - want);
        worst = err > worst ? err : worst;
        cr_assert_leq(err, bound + 1e-6, "%s: n=%zu %s %s: element %zu is %a, want %a", what, n,
                      codec_name(codec), dtype_op_name(op), i, got, want);
        if (codec == CODEC_FP16 || codec == CODEC_BF16) {
            uint16_t w;
            float back;

            codec_encode(codec, &w, &got, 1);
            codec_decode(codec, &back, &w, 1);
            cr_assert_eq(back, got, "%s: element %zu is not a %s value", what, i,
                         codec_name(codec));
        }
    }
}

static void coded_matrix(size_t seg, size_t small, size_t count, size_t n_hi, bool oop,
                         const char *what)
{
    static const enum dtype_op ops[] = { DTYPE_SUM, DTYPE_AVG, DTYPE_MIN, DTYPE_MAX,
                                         DTYPE_AVG_BY };

    for (size_t n = 1; n <= n_hi; n++) {
        struct cluster c;
        uint64_t round = 0;

        quiet();
        cluster_init(&c, n, count * 4, seg, small, 30000);
        if (oop)
            cluster_out_of_place(&c);
        adopt(&c, 1, NULL);
        for (int codec = 1; codec < CODEC_END; codec++)
            for (size_t o = 0; o < sizeof ops / sizeof ops[0] && codec_valid(codec); o++)
                coded_check(&c, count, ops[o], (enum codec)codec, ++round, what);
        /* Uncompressed calls still work on the same connections. */
        for (size_t k = 0; k < n; k++)
            c.p[k].codec = CODEC_NONE;
        reduce_and_check(&c, count, DTYPE_F32, DTYPE_SUM, 0, ++round, what);
        cluster_fini(&c);
    }
}

/* Segments of 512 floats: many windows, tails, and int8 blocks cut by
 * segment ends (2053 is prime). */
Test(allreduce, coded_ring_identical_everywhere_within_bounds)
{
    coded_matrix(2048, ALLREDUCE_SMALL_NONE, 2053 * 4, 5, false, "ring");
}

Test(allreduce, coded_ring_out_of_place)
{
    coded_matrix(2048, ALLREDUCE_SMALL_NONE, 2053 * 3, 4, true, "ring, out of place");
}

/* n = 3 and 5 have extra members handing their data over. */
Test(allreduce, coded_doubling_identical_everywhere_within_bounds)
{
    coded_matrix(0, 0, 1031, 5, false, "doubling");
}

/* One element of int8 is 5 bytes: more than its 4 uncompressed, which a
 * scratch of exactly that size could not hold; the ring takes it. */
Test(allreduce, coded_single_element_with_tight_scratch)
{
    struct cluster c;

    quiet();
    cluster_init(&c, 3, 64, 0, 4, 30000);
    adopt(&c, 1, NULL);
    coded_check(&c, 1, DTYPE_SUM, CODEC_INT8, 1, "one element");
    coded_check(&c, 1, DTYPE_SUM, CODEC_FP16, 2, "one element");
    coded_check(&c, 1, DTYPE_SUM, CODEC_MEANSTD16, 3, "one element");
    coded_check(&c, 1, DTYPE_SUM, CODEC_UNIFORM8, 4, "one element");
    coded_check(&c, 1, DTYPE_SUM, CODEC_QUANTILE8, 5, "one element");
    cluster_fini(&c);
}

Test(allreduce, codec_misuse_is_einval)
{
    struct cluster c;

    cluster_start(&c, 1, 64, 0, 0, 1000);
    cr_assert_eq(allreduce_run_codec(c.p[0].ar, c.p[0].h, c.p[0].h, 4, DTYPE_F64, DTYPE_SUM, 0,
                                     CODEC_FP16, 1), -EINVAL);
    cr_assert_eq(allreduce_run_codec(c.p[0].ar, c.p[0].h, c.p[0].h, 4, DTYPE_F32, DTYPE_SUM, 0,
                                     (enum codec)CODEC_COUNT, 1), -EINVAL);
    cluster_fini(&c);
    /* Segments of 8 bytes: meanstd16's 8 bytes of mean and deviation
     * leave no room for the values; of 1360, uniform8's codebook does not. */
    cluster_start(&c, 1, 64, 8, 0, 1000);
    cr_assert_eq(allreduce_run_codec(c.p[0].ar, c.p[0].h, c.p[0].h, 4, DTYPE_F32, DTYPE_SUM, 0,
                                     CODEC_MEANSTD16, 1), -EINVAL);
    cluster_fini(&c);
    cluster_start(&c, 1, 64, 1360, 0, 1000);
    cr_assert_eq(allreduce_run_codec(c.p[0].ar, c.p[0].h, c.p[0].h, 4, DTYPE_F32, DTYPE_SUM, 0,
                                     CODEC_UNIFORM8, 1), -EINVAL);
    cr_assert_eq(allreduce_run_codec(c.p[0].ar, c.p[0].h, c.p[0].h, 4, DTYPE_F32, DTYPE_SUM, 0,
                                     CODEC_QUANTILE8, 1), -EINVAL);
    cr_assert_eq(allreduce_run_codec(c.p[0].ar, c.p[0].h, c.p[0].h, 4, DTYPE_F32, DTYPE_SUM, 0,
                                     CODEC_FP16, 2), 0);
    cluster_fini(&c);
}

/* Members that disagree on the codec fail fast with -EPROTO (the frames
 * name it), with either algorithm, and reduce again once they agree. */
Test(allreduce, a_peer_with_another_codec_is_refused)
{
    static const size_t counts[] = { 100, 100000 };

    for (size_t k = 0; k < 2; k++) {
        struct cluster c;
        uint64_t t0 = clock_now_ms();

        cluster_start(&c, 3, 100000 * 4, 0, 0, 20000);
        fill(&c, counts[k], DTYPE_F32);
        c.p[0].codec = CODEC_FP16;
        c.p[1].codec = CODEC_FP16;
        c.p[2].codec = k ? CODEC_INT8 : CODEC_NONE;
        call_all(&c, counts[k], DTYPE_F32, DTYPE_SUM, 0, 1);
        for (size_t i = 0; i < 3; i++)
            cr_assert_neq(c.p[i].rc, 0, "member %zu completed a mixed call", i);
        cr_assert(c.p[0].rc == -EPROTO || c.p[1].rc == -EPROTO || c.p[2].rc == -EPROTO);
        cr_assert_lt(clock_now_ms() - t0, 5000, "failed fast, not by timeout");
        c.p[2].codec = CODEC_FP16;
        coded_check(&c, counts[k], DTYPE_SUM, CODEC_FP16, 2, "after agreeing");
        cluster_fini(&c);
    }
}

/* A peer that cuts a folded size as an engine without folding would (1
 * MiB of float32 and 36 elements on 2 members: chunks of 131090
 * elements, three segments of 43697 or 43696 where this engine folds the
 * tail into two of 65545) is refused at its first frame with -EPROTO,
 * fast and before the payload is read; the segment this engine expects
 * there is the folded one, which it accepts and waits out. */
Test(allreduce, a_peer_that_does_not_fold_is_refused)
{
    static const uint32_t lengths[] = { 43697 * 4, 65545 * 4 };
    const size_t count = 262144 + 36;

    for (size_t k = 0; k < 2; k++) {
        struct cluster c;
        uint8_t b[PEERWIRE_HELLO_BYTES], hdr[PEERWIRE_FRAME_BYTES];
        struct peerwire_frame f = { .magic = PEERWIRE_FRAME_DATA, .length = lengths[k],
                                    .cohort = peerwire_cohort_hash(COHORT), .epoch = 1,
                                    .round = 1, .offset = 0, .count = count,
                                    .dtype = DTYPE_F32, .op = DTYPE_SUM,
                                    .phase = PEERWIRE_PHASE_RS, .codec = CODEC_NONE, .step = 0 };
        uint64_t t0;
        int fd;

        quiet();
        cluster_init(&c, 2, count * 4, 0, ALLREDUCE_SMALL_NONE, k ? 1000 : 20000);
        adopt(&c, 1, NULL);
        /* m-0 is played here: greet m-1 as it, then send the header of
         * the first segment m-1 receives (chunk 0, segment 0). */
        fd = dial(c.p[1].addr);
        greet_bytes(b, 1, "m-0", 0, 77, 1, NULL);
        cr_assert_eq(send(fd, b, sizeof(b), MSG_NOSIGNAL), (ssize_t)sizeof(b));
        cr_assert(read_exact(fd, b, sizeof(b), 5000), "no answer");
        answer_of(b, PEERWIRE_ACCEPT);
        t0 = clock_now_ms();
        call_start(&c.p[1], count, DTYPE_F32, DTYPE_SUM, 0, 1);
        peerwire_frame_encode(hdr, &f);
        cr_assert_eq(send(fd, hdr, sizeof(hdr), MSG_NOSIGNAL), (ssize_t)sizeof(hdr));
        call_join(&c.p[1]);
        if (k == 0) {
            cr_assert_eq(c.p[1].rc, -EPROTO, "%s", log_strerror(c.p[1].rc));
            cr_assert_lt(clock_now_ms() - t0, 5000, "refused fast, not by timeout");
        } else {
            /* The header is the one due: m-1 waits for the payload that
             * never comes, until its 1 s member timeout. */
            cr_assert_eq(c.p[1].rc, -ETIMEDOUT, "%s", log_strerror(c.p[1].rc));
        }
        close(fd);
        cluster_fini(&c);
    }
}

/* A peer that names the right codec but sends the uncompressed length
 * (or any other) is refused before a payload byte is read as data. */
Test(allreduce, a_coded_frame_of_the_wrong_length_is_refused)
{
    static const uint32_t lengths[] = { 500 * 4, 500 * 2 - 2, 500 * 2 + 1 };

    for (size_t k = 0; k < 3; k++) {
        struct cluster c;
        uint8_t b[PEERWIRE_HELLO_BYTES], hdr[PEERWIRE_FRAME_BYTES];
        struct peerwire_frame f = { .magic = PEERWIRE_FRAME_DATA, .length = lengths[k],
                                    .cohort = peerwire_cohort_hash(COHORT), .epoch = 1,
                                    .round = 1, .offset = 0, .count = 1000,
                                    .dtype = DTYPE_F32, .op = DTYPE_SUM,
                                    .phase = PEERWIRE_PHASE_RS, .codec = CODEC_FP16, .step = 0 };
        int fd;

        quiet();
        cluster_init(&c, 2, 1000 * 4, 0, ALLREDUCE_SMALL_NONE, 20000);
        adopt(&c, 1, NULL);
        /* m-0 is played here: greet m-1 as it, then send the frame m-1
         * expects first (chunk 0, 500 elements: 1000 bytes of fp16) with
         * a wrong length. */
        fd = dial(c.p[1].addr);
        greet_bytes(b, 1, "m-0", 0, 77, 1, NULL);
        cr_assert_eq(send(fd, b, sizeof(b), MSG_NOSIGNAL), (ssize_t)sizeof(b));
        cr_assert(read_exact(fd, b, sizeof(b), 5000), "no answer");
        answer_of(b, PEERWIRE_ACCEPT);
        c.p[1].codec = CODEC_FP16;
        call_start(&c.p[1], 1000, DTYPE_F32, DTYPE_SUM, 0, 1);
        peerwire_frame_encode(hdr, &f);
        cr_assert_eq(send(fd, hdr, sizeof(hdr), MSG_NOSIGNAL), (ssize_t)sizeof(hdr));
        call_join(&c.p[1]);
        cr_assert_eq(c.p[1].rc, -EPROTO, "length %u: %s", lengths[k], log_strerror(c.p[1].rc));
        close(fd);
        cluster_fini(&c);
    }
}

/* The rider leaves the choice to the payload: with a 1 KiB threshold,
 * 256 float32 and a rider of 36 go by recursive doubling (one frame from
 * each of 2 members), the same 292 elements without a rider and 257 with
 * one by the ring (two frames a chunk from each). The payload on the wire
 * is the same on 2 members either way. */
Test(allreduce, a_rider_leaves_the_algorithm_to_the_payload)
{
    struct cluster c;
    uint64_t round = 0;

    cluster_start(&c, 2, 4096, 0, 1024, 30000);
    /* Connections come up in the first call: count from the next. */
    reduce_and_check(&c, 292, DTYPE_F32, DTYPE_SUM, 0, ++round, "warm-up");
    set_rider(&c, 36);
    cr_assert_eq(frames_of(&c, 292, ++round, 2 * 292 * 4, "a rider"), 2);
    cr_assert_eq(frames_of(&c, 293, ++round, 2 * 293 * 4, "a payload past the threshold"),
                 2 * ring_segments(2, 293, 65536, false));
    set_rider(&c, 0);
    cr_assert_eq(frames_of(&c, 292, ++round, 2 * 292 * 4, "no rider"),
                 2 * ring_segments(2, 292, 65536, false));
    cr_assert_gt(ring_segments(2, 292, 65536, false), 1);
    cluster_fini(&c);
}

/* A rider longer than the call, or than ALLREDUCE_RIDER_MAX_BYTES of
 * accumulation, is -EINVAL before anything is sent: the buffers are as
 * they were, and the same call with a rider that fits then succeeds. */
Test(allreduce, a_rider_too_long_is_invalid_and_changes_nothing)
{
    static const struct {
        size_t count, rider;
        enum dtype t;
    } bad[] = {
        { 100, 101, DTYPE_F32 },
        { 5000, 4097, DTYPE_F32 },
        { 5000, 4097, DTYPE_F16 },      /* accumulated in float32 */
        { 5000, 2049, DTYPE_F64 },
    };
    struct cluster c;
    void *before[2];

    cluster_start(&c, 2, 5000 * 8, 0, 1024, 30000);
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        fill(&c, bad[k].count, bad[k].t);
        for (size_t i = 0; i < 2; i++) {
            before[i] = malloc(c.p[i].bytes);
            cr_assert(before[i]);
            memcpy(before[i], c.p[i].buf, c.p[i].bytes);
            cr_assert_eq(allreduce_run_rider(c.p[i].ar, c.p[i].h, c.p[i].h, bad[k].count,
                                             bad[k].rider, bad[k].t, DTYPE_SUM, 0, k + 1),
                         -EINVAL, "%zu of %zu", bad[k].rider, bad[k].count);
            cr_assert_eq(memcmp(before[i], c.p[i].buf, c.p[i].bytes), 0);
            free(before[i]);
        }
        set_rider(&c, bad[k].rider - 1);
        call_all(&c, bad[k].count, bad[k].t, DTYPE_SUM, 0, k + 1);
        check(&c, bad[k].count, bad[k].t, DTYPE_SUM, 0, "a rider that fits");
        set_rider(&c, 0);
    }
    cluster_fini(&c);
}

/* A few elements appended to a buffer cost no exchange unless they add a
 * ring segment (or change the algorithm): 1 MiB of float32 on 2 members
 * is two whole 256 KiB segments per chunk, and up to n x 1/64 of a
 * segment more (2 x 1024 elements) is folded into them (ring.c, "Folding
 * a tail"); one element beyond that makes each chunk three segments
 * (cut evenly). 1,000,000 bytes already need three. */
Test(allreduce, same_exchanges_counts_ring_segments)
{
    struct allreduce_config c = { .cohort = "c", .member_id = "m" };
    struct allreduce *a;
    char addr[64];
    int fd;

    cr_assert_eq(allreduce_listen("127.0.0.1", &fd, addr, sizeof(addr)), 0);
    c.listen_fd = fd;
    cr_assert_eq(allreduce_create(&c, &a), 0);
    cr_assert(allreduce_same_exchanges(a, 2, 262144, 36, DTYPE_F32, false));
    cr_assert(allreduce_same_exchanges(a, 2, 262144, 2048, DTYPE_F32, false));
    cr_assert_not(allreduce_same_exchanges(a, 2, 262144, 2049, DTYPE_F32, false));
    cr_assert(allreduce_same_exchanges(a, 4, 262144, 4096, DTYPE_F32, false));
    cr_assert_not(allreduce_same_exchanges(a, 4, 262144, 4097, DTYPE_F32, false));
    /* float64: 32768-element segments, 512 elements (4 KiB) fold. */
    cr_assert(allreduce_same_exchanges(a, 2, 131072, 1024, DTYPE_F64, false));
    cr_assert_not(allreduce_same_exchanges(a, 2, 131072, 1025, DTYPE_F64, false));
    cr_assert(allreduce_same_exchanges(a, 2, 250000, 36, DTYPE_F32, false));
    cr_assert(allreduce_same_exchanges(a, 4, 250000, 36, DTYPE_F32, false));
    /* 64 MiB: sixteen whole windows; 36 elements more would be a
     * seventeenth window without folding. */
    cr_assert(allreduce_same_exchanges(a, 2, 16u << 20, 36, DTYPE_F32, false));
    cr_assert(allreduce_same_exchanges(a, 4, 16u << 20, 36, DTYPE_F32, false));
    cr_assert_not(allreduce_same_exchanges(a, 2, 16u << 20, 2049, DTYPE_F32, false));
    /* Out of place that size is staged (ring.c, "Staged sums"), in
     * windows of four segments a chunk: 32 of them, whole, which fold the
     * same tail. */
    cr_assert(allreduce_same_exchanges(a, 2, 16u << 20, 36, DTYPE_F32, true));
    cr_assert(allreduce_same_exchanges(a, 2, 16u << 20, 2048, DTYPE_F32, true));
    cr_assert_not(allreduce_same_exchanges(a, 2, 16u << 20, 2049, DTYPE_F32, true));
    /* Just under 8 MiB out of place, the digits cross into staging
     * (RING_STAGED_MIN_BYTES), whose windows cut the same segments. */
    cr_assert(allreduce_same_exchanges(a, 2, (2u << 20) - 10, 36, DTYPE_F32, true));
    cr_assert_eq(ring_segments(2, 16u << 20, 65536, true), 2 * 32 * 4);
    cr_assert_eq(ring_segments(2, 16u << 20, 65536, false), 2 * 16 * 8);
    /* Recursive doubling (a payload of up to 256 KiB): one exchange a
     * step, whatever the length, and a rider never moves the call to the
     * ring; but a rider is at most 16 KiB (4096 float32, 2048 float64). */
    cr_assert(allreduce_same_exchanges(a, 2, 1024, 36, DTYPE_F32, false));
    cr_assert(allreduce_same_exchanges(a, 2, 65536, 36, DTYPE_F32, false));
    cr_assert(allreduce_same_exchanges(a, 2, 65536, 4096, DTYPE_F32, false));
    cr_assert_not(allreduce_same_exchanges(a, 2, 65536, 4097, DTYPE_F32, false));
    cr_assert(allreduce_same_exchanges(a, 2, 16384, 36, DTYPE_F64, false));
    cr_assert(allreduce_same_exchanges(a, 2, 32768, 2048, DTYPE_F64, false));
    cr_assert_not(allreduce_same_exchanges(a, 2, 32768, 2049, DTYPE_F64, false));
    cr_assert_not(allreduce_same_exchanges(a, 2, 1024, 4097, DTYPE_F32, false));
    /* Alone, or nothing appended: nothing changes. */
    cr_assert(allreduce_same_exchanges(a, 1, 262144, 36, DTYPE_F32, false));
    cr_assert(allreduce_same_exchanges(a, 2, 262144, 0, DTYPE_F32, false));
    cr_assert_not(allreduce_same_exchanges(a, 2, 262144, 36, (enum dtype)99, false));
    allreduce_destroy(a);
    close(fd);
}

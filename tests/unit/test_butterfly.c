/* tests/unit/test_butterfly.c: allreduce_run_parts, the butterfly, and
 * allreduce_split, the parts by bandwidth. Engines on loopback in one
 * process, one thread per member; members are "m-0", "m-1", ... Every
 * result is compared with a reference summed here in the butterfly's
 * documented order (the owner's contribution first, then the others' in
 * member order), and with every other member's bytes. */
#include <criterion/criterion.h>

#include <arpa/inet.h>
#include <errno.h>
#include <math.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "base/clock.h"
#include "base/log.h"
#include "base/secret.h"
#include "engine/allreduce.h"
#include "engine/peerwire.h"
#include "membership/epoch.h"

#define COHORT "test"
#define MAX 6
#define TIMEOUT_MS 20000u

/* Set by a test before bf_start: every engine keyed, frames sealed.
 * (Criterion runs each test in a process of its own.) */
static bool sealed;
static const struct secret test_key = { { 0x51, 0x52, 0x53, 0x54, 0x55, 0x56, 0x57, 0x58,
                                          0x59, 0x5a, 0x5b, 0x5c, 0x5d, 0x5e, 0x5f, 0x60,
                                          0x61, 0x62, 0x63, 0x64, 0x65, 0x66, 0x67, 0x68,
                                          0x69, 0x6a, 0x6b, 0x6c, 0x6d, 0x6e, 0x6f, 0x70 } };

struct member {
    struct allreduce *ar;
    int fd;
    char addr[64];
    char id[24];
    float *in, *out;
    int h_in, h_out;
    int rc;
    uint64_t took_ms;
};

struct bf {
    size_t n, count;
    struct member m[MAX];
    size_t parts[MAX];
    enum dtype_op op;
    bool in_place;
    enum codec codec;           /* allreduce_run_parts_codec's; CODEC_NONE: run_parts */
    uint64_t round;
};

/* Every engine adopts epoch `number` of all of them; members listed in
 * `unreachable` are advertised at an address nobody listens on, so a
 * call that dialled one would fail. */
static void bf_adopt(struct bf *b, uint64_t number, const bool *unreachable)
{
    struct epoch_member em[MAX];
    struct epoch *e;

    for (size_t i = 0; i < b->n; i++)
        em[i] = (struct epoch_member){ .id = b->m[i].id,
                                       .address = unreachable && unreachable[i]
                                                      ? "127.0.0.1:1" : b->m[i].addr };
    cr_assert_eq(epoch_create(COHORT, number, 0, em, b->n, &e), 0);
    for (size_t i = 0; i < b->n; i++)
        cr_assert_eq(allreduce_set_epoch(b->m[i].ar, e), 0);
    epoch_unref(e);
}

/* n engines with segments of seg bytes (0: the default), buffers of
 * count floats, all in epoch 1 (bf_adopt). */
static void bf_start(struct bf *b, size_t n, size_t count, size_t seg, uint32_t timeout_ms,
                     const bool *unreachable)
{
    log_set_level(LOG_ERROR);
    memset(b, 0, sizeof(*b));
    b->n = n;
    b->count = count;
    b->op = DTYPE_SUM;
    for (size_t i = 0; i < n; i++) {
        struct member *m = &b->m[i];
        struct allreduce_config cfg = { .cohort = COHORT, .member_id = m->id,
                                        .member_timeout_ms = timeout_ms,
                                        .segment_bytes = seg,
                                        .key = sealed ? &test_key : NULL,
                                        .integrity_mac = sealed };

        snprintf(m->id, sizeof(m->id), "m-%zu", i);
        cr_assert_eq(allreduce_listen("127.0.0.1", &m->fd, m->addr, sizeof(m->addr)), 0);
        cfg.listen_fd = m->fd;
        cr_assert_eq(allreduce_create(&cfg, &m->ar), 0);
        m->in = calloc(count + 1, sizeof(float));
        m->out = calloc(count + 1, sizeof(float));
        cr_assert(m->in && m->out);
        m->h_in = allreduce_register(m->ar, m->in, count * sizeof(float));
        m->h_out = allreduce_register(m->ar, m->out, count * sizeof(float));
        cr_assert_geq(m->h_in, 0);
        cr_assert_geq(m->h_out, 0);
    }
    bf_adopt(b, 1, unreachable);
}

static void bf_stop(struct bf *b)
{
    for (size_t i = 0; i < b->n; i++) {
        allreduce_destroy(b->m[i].ar);
        close(b->m[i].fd);
        free(b->m[i].in);
        free(b->m[i].out);
    }
}

/* Values with fractions, so that the order of a sum shows in its bits. */
static void bf_fill(struct bf *b)
{
    for (size_t i = 0; i < b->n; i++)
        for (size_t k = 0; k < b->count; k++)
            b->m[i].in[k] = (float)((double)((k * 7919 + i * 104729) % 1000003) / 997.0 - 500.0);
}

struct call {
    struct bf *b;
    size_t i;
};

static void *call_main(void *arg)
{
    struct call *c = arg;
    struct bf *b = c->b;
    struct member *m = &b->m[c->i];
    uint64_t t0 = clock_now_ms();

    if (b->codec == CODEC_NONE)
        m->rc = allreduce_run_parts(m->ar, m->h_in, b->in_place ? m->h_in : m->h_out, b->count,
                                    DTYPE_F32, b->op, 0, b->parts, b->n, b->round);
    else
        m->rc = allreduce_run_parts_codec(m->ar, m->h_in, b->in_place ? m->h_in : m->h_out,
                                          b->count, DTYPE_F32, b->op, 0, b->parts, b->n,
                                          b->codec, b->round);
    m->took_ms = clock_now_ms() - t0;
    return NULL;
}

/* Every member listed in `who` (all when NULL) makes the call at once. */
static void bf_call(struct bf *b, const bool *who)
{
    pthread_t th[MAX];
    struct call c[MAX];

    b->round++;
    for (size_t i = 0; i < b->n; i++) {
        c[i] = (struct call){ b, i };
        if (!who || who[i])
            cr_assert_eq(pthread_create(&th[i], NULL, call_main, &c[i]), 0);
    }
    for (size_t i = 0; i < b->n; i++)
        if (!who || who[i])
            pthread_join(th[i], NULL);
}

/* The reference: each part summed by its owner's order. */
static float reference(const struct bf *b, const float *const *in, size_t k)
{
    size_t owner = 0, start = 0;
    float s;

    while (k >= start + b->parts[owner])
        start += b->parts[owner++];
    s = in[owner][k];
    for (size_t i = 0; i < b->n; i++)
        if (i != owner)
            s = b->op == DTYPE_MAX ? (in[i][k] > s ? in[i][k] : s) : s + in[i][k];
    if (b->op == DTYPE_AVG)
        s /= (float)b->n;
    return s;
}

static void bf_check(struct bf *b, const float *const *in)
{
    for (size_t i = 0; i < b->n; i++) {
        const float *got = b->in_place ? b->m[i].in : b->m[i].out;

        cr_assert_eq(b->m[i].rc, 0, "member %zu: %s", i, log_strerror(b->m[i].rc));
        for (size_t k = 0; k < b->count; k++) {
            float want = reference(b, in, k);

            cr_assert(memcmp(&got[k], &want, sizeof(float)) == 0,
                      "member %zu element %zu: %a, want %a", i, k, got[k], want);
        }
    }
}

/* Runs one call with `parts` and checks it, in or out of place. */
static void bf_round(struct bf *b, const size_t *parts, enum dtype_op op, bool in_place)
{
    float *keep[MAX];

    memcpy(b->parts, parts, b->n * sizeof(size_t));
    b->op = op;
    b->in_place = in_place;
    bf_fill(b);
    for (size_t i = 0; i < b->n; i++) {
        keep[i] = malloc(b->count * sizeof(float) + 1);
        memcpy(keep[i], b->m[i].in, b->count * sizeof(float));
    }
    bf_call(b, NULL);
    bf_check(b, (const float *const *)keep);
    if (!in_place)
        for (size_t i = 0; i < b->n; i++)
            cr_assert(memcmp(keep[i], b->m[i].in, b->count * sizeof(float)) == 0,
                      "member %zu: out of place, the contribution must stay", i);
    for (size_t i = 0; i < b->n; i++)
        free(keep[i]);
}

Test(butterfly, uneven_parts_give_every_member_the_same_bytes)
{
    struct bf b;
    /* Segments of 64 bytes: parts of many segments, a part of one
     * element, and a part that ends mid-segment. */
    size_t parts[4] = { 1, 37, 500, 1000 - 538 };

    bf_start(&b, 4, 1000, 64, TIMEOUT_MS, NULL);
    bf_round(&b, parts, DTYPE_SUM, true);
    bf_round(&b, parts, DTYPE_AVG, false);
    bf_stop(&b);
}

/* Keyed engines with every frame sealed: the butterfly's frames carry
 * and verify their tags like the ring's; and MAX as well as SUM. */
Test(butterfly, sealed_frames_and_max)
{
    struct bf b;
    size_t parts[3] = { 700, 0, 301 };

    sealed = true;
    bf_start(&b, 3, 1001, 256, TIMEOUT_MS, NULL);
    bf_round(&b, parts, DTYPE_SUM, false);
    bf_round(&b, parts, DTYPE_MAX, true);
    bf_stop(&b);
}

Test(butterfly, large_buffer_with_default_segments)
{
    struct bf b;
    size_t count = (3u << 20) / 4 + 3, parts[3] = { count / 2, count / 3, 0 };

    parts[2] = count - parts[0] - parts[1];
    bf_start(&b, 3, count, 0, TIMEOUT_MS, NULL);
    bf_round(&b, parts, DTYPE_SUM, false);
    bf_stop(&b);
}

Test(butterfly, members_without_a_part_in_the_middle)
{
    struct bf b;
    size_t parts[5] = { 300, 0, 200, 0, 1 };

    bf_start(&b, 5, 501, 128, TIMEOUT_MS, NULL);
    bf_round(&b, parts, DTYPE_SUM, true);
    bf_stop(&b);
}

/* Clients (no part, first in the order) are advertised at an address
 * nobody listens on: the call succeeds only if nobody dials them. */
Test(butterfly, clients_first_are_never_dialled)
{
    struct bf b;
    bool unreachable[5] = { true, true, false, false, false };
    size_t parts[5] = { 0, 0, 100, 4000, 900 };

    bf_start(&b, 5, 5000, 256, TIMEOUT_MS, unreachable);
    bf_round(&b, parts, DTYPE_AVG, false);
    bf_round(&b, parts, DTYPE_SUM, true);
    bf_stop(&b);
}

/* The check that the test above can fail: the same unreachable member
 * placed after a member with a part is dialled, and the call fails. */
Test(butterfly, a_client_after_a_reducer_would_be_dialled)
{
    struct bf b;
    bool unreachable[3] = { false, false, true };
    size_t parts[3] = { 10, 10, 0 };

    bf_start(&b, 3, 20, 64, 3000, unreachable);
    memcpy(b.parts, parts, sizeof(parts));
    bf_fill(&b);
    bf_call(&b, NULL);
    cr_assert_neq(b.m[0].rc, 0, "member 0 dials the unreachable member 2");
    bf_stop(&b);
}

Test(butterfly, misuse_is_refused)
{
    struct bf b;
    size_t zero[3] = { 0, 0, 0 }, short_[3] = { 1, 2, 3 }, ok[3] = { 2, 2, 2 };
    struct member *m;
    uint16_t h16[8];
    int h;

    bf_start(&b, 3, 6, 64, TIMEOUT_MS, NULL);
    m = &b.m[0];
    cr_assert_eq(allreduce_run_parts(m->ar, m->h_in, m->h_in, 6, DTYPE_F32, DTYPE_SUM, 0, zero,
                                     3, 1), -EINVAL, "nobody reduces");
    cr_assert_eq(allreduce_run_parts(m->ar, m->h_in, m->h_in, 5, DTYPE_F32, DTYPE_SUM, 0, short_,
                                     3, 1), -EINVAL, "parts sum beyond count");
    cr_assert_eq(allreduce_run_parts(m->ar, m->h_in, m->h_in, 6, DTYPE_F32, DTYPE_SUM, 0, NULL, 3,
                                     1), -EINVAL);
    cr_assert_eq(allreduce_run_parts(m->ar, m->h_in, m->h_in, 6, DTYPE_F32, DTYPE_SUM, 0, ok, 2,
                                     1), -EINVAL, "parts sum to 4, not 6");
    cr_assert_eq(allreduce_run_parts(m->ar, m->h_in, m->h_in, 6, DTYPE_F32, DTYPE_SUM, 0, ok,
                                     ALLREDUCE_PARTS_MAX + 1, 1), -EINVAL);
    h = allreduce_register(m->ar, h16, sizeof(h16));
    cr_assert_geq(h, 0);
    cr_assert_eq(allreduce_run_parts(m->ar, h, h, 6, DTYPE_BF16, DTYPE_SUM, 0, ok, 3, 1), -EINVAL,
                 "16-bit types are not taken");
    {
        size_t four[4] = { 1, 1, 2, 2 };

        cr_assert_eq(allreduce_run_parts(m->ar, m->h_in, m->h_in, 6, DTYPE_F32, DTYPE_SUM, 0,
                                         four, 4, 1), -ESTALE, "parts for a group of 4 in 3");
    }
    cr_assert_eq(allreduce_run_parts_codec(m->ar, m->h_in, m->h_in, 6, DTYPE_F32, DTYPE_SUM, 0,
                                           ok, 3, (enum codec)4, 1), -EINVAL,
                 "4 is top-k, no codec");
    cr_assert_eq(allreduce_run_parts_codec(m->ar, m->h_in, m->h_in, 6, DTYPE_F32, DTYPE_SUM, 0,
                                           ok, 3, CODEC_UNIFORM8, 1), -EINVAL,
                 "segments of 64 bytes cannot hold uniform8's codebook");
    cr_assert_eq(allreduce_run_parts_codec(m->ar, h, h, 6, DTYPE_I32, DTYPE_SUM, 0, ok, 3,
                                           CODEC_FP16, 1), -EINVAL, "codecs take float32 only");
    cr_assert(!allreduce_busy(m->ar));
    bf_stop(&b);
}

/* A coded call against a reference built here from the codec's own
 * encode and decode: for each segment of each part (segments of `seg`
 * floats from the part's start), the owner's values, plus each other
 * member's decode(encode()) in member order, in float32; the result
 * decode(encode()) of that. Byte for byte on every member; and within
 * two encodings' error of the exact sum: each contribution's and the
 * result's, as codec.h bounds them (fp16 and bf16 relative; the others
 * within the range of what they encoded, checked loosely here and
 * exactly in test_codec.c), and not the exact sum itself. */
static void bf_coded_round(struct bf *b, const size_t *parts, enum codec codec, size_t seg,
                           bool in_place)
{
    float *keep[MAX], *want = malloc(b->count * sizeof(float) + 1);
    uint8_t *wire = malloc(codec_bytes(codec, seg) + 1);
    float *tmp = malloc(seg * sizeof(float));
    size_t start = 0;
    bool differs = false;

    cr_assert(want && wire && tmp);
    memcpy(b->parts, parts, b->n * sizeof(size_t));
    b->op = DTYPE_SUM;
    b->in_place = in_place;
    b->codec = codec;
    bf_fill(b);
    for (size_t i = 0; i < b->n; i++) {
        keep[i] = malloc(b->count * sizeof(float) + 1);
        memcpy(keep[i], b->m[i].in, b->count * sizeof(float));
    }
    for (size_t j = 0; j < b->n; start += parts[j++]) {
        for (size_t s = start; s < start + parts[j]; s += seg) {
            size_t len = start + parts[j] - s < seg ? start + parts[j] - s : seg;

            memcpy(want + s, keep[j] + s, len * sizeof(float));
            for (size_t i = 0; i < b->n; i++) {
                if (i == j)
                    continue;
                codec_encode(codec, wire, keep[i] + s, len);
                codec_decode(codec, tmp, wire, len);
                for (size_t k = 0; k < len; k++)
                    want[s + k] += tmp[k];
            }
            codec_round_trip(codec, want + s, wire, len);
        }
    }
    bf_call(b, NULL);
    for (size_t i = 0; i < b->n; i++) {
        const float *got = in_place ? b->m[i].in : b->m[i].out;

        cr_assert_eq(b->m[i].rc, 0, "%s: member %zu: %s", codec_name(codec), i,
                     log_strerror(b->m[i].rc));
        for (size_t k = 0; k < b->count; k++)
            cr_assert(memcmp(&got[k], &want[k], sizeof(float)) == 0,
                      "%s: member %zu element %zu: %a, want %a", codec_name(codec), i, k, got[k],
                      want[k]);
    }
    for (size_t k = 0; k < b->count; k++) {
        double exact = 0, amax = 0, err, bound;

        for (size_t i = 0; i < b->n; i++) {
            exact += keep[i][k];
            amax += fabs((double)keep[i][k]);
        }
        err = fabs((double)want[k] - exact);
        differs |= err > 0;
        /* bf_fill's values lie in [-500, 503]: a run's range is at most
         * 1003 x n for a sum, 1003 for a contribution. */
        bound = codec == CODEC_FP16   ? 3 * amax * 0x1p-11
              : codec == CODEC_BF16   ? 3 * amax * 0x1p-8
                                      : (double)b->n * 1003 + 1003.0 * (double)b->n;
        cr_assert_leq(err, bound, "%s: element %zu errs by %g", codec_name(codec), k, err);
    }
    cr_assert(differs, "%s: the result is the exact sum: was the codec applied?",
              codec_name(codec));
    for (size_t i = 0; i < b->n; i++)
        free(keep[i]);
    free(want);
    free(wire);
    free(tmp);
}

/* Every codec, clients first (no part) and uneven parts, segments of 1368
 * bytes (the 8-bit quantizations' least): parts of many segments, of one
 * element, and ending mid-segment; in place and out of it. */
Test(butterfly, coded_parts_give_every_member_the_same_bytes)
{
    struct bf b;
    size_t seg = 1368, parts[5] = { 0, 0, 1, 700, 2000 - 701 };

    bf_start(&b, 5, 2000, seg, TIMEOUT_MS, NULL);
    for (int c = 1; c < CODEC_END; c++) {
        if (!codec_valid(c))
            continue;
        bf_coded_round(&b, parts, (enum codec)c, seg / sizeof(float), c % 2 == 0);
    }
    /* And uncoded calls on the same connections after them. */
    b.codec = CODEC_NONE;
    bf_round(&b, parts, DTYPE_SUM, true);
    bf_stop(&b);
}

/* Sealed frames, a member of bandwidth 0 between reducers, and the
 * default segments (256 KiB) with a tail. */
Test(butterfly, coded_sealed_with_default_segments)
{
    struct bf b;
    size_t count = 200003, parts[3] = { 150000, 0, 50003 };

    sealed = true;
    bf_start(&b, 3, count, 0, TIMEOUT_MS, NULL);
    bf_coded_round(&b, parts, CODEC_QUANTILE8, (256 << 10) / sizeof(float), false);
    bf_coded_round(&b, parts, CODEC_INT8, (256 << 10) / sizeof(float), true);
    bf_stop(&b);
}

/* The reducer of the only part never makes the call: every member that
 * does fails within the member timeout, none hangs. */
Test(butterfly, stalled_reducer_fails_the_round_everywhere)
{
    struct bf b;
    bool who[4] = { true, true, true, false };
    size_t parts[4] = { 0, 1000, 0, 3000 };

    bf_start(&b, 4, 4000, 256, 1500, NULL);
    memcpy(b.parts, parts, sizeof(parts));
    bf_fill(&b);
    bf_call(&b, who);
    for (size_t i = 0; i < 3; i++) {
        cr_assert(b.m[i].rc == -ETIMEDOUT || b.m[i].rc == -ECONNRESET || b.m[i].rc == -EPIPE,
                  "member %zu: %s", i, log_strerror(b.m[i].rc));
        cr_assert_lt(b.m[i].took_ms, 15000, "member %zu took %llu ms", i,
                     (unsigned long long)b.m[i].took_ms);
    }
    /* The group recovers in its next epoch (the averager's next group)
     * once everyone calls. */
    bf_adopt(&b, 2, NULL);
    bf_round(&b, parts, DTYPE_SUM, false);
    bf_stop(&b);
}

/* --- a lying peer --------------------------------------------------------- */

static int dial_addr(const char *addr)
{
    struct sockaddr_in sa = { .sin_family = AF_INET };
    const char *colon = strrchr(addr, ':');
    int fd = socket(AF_INET, SOCK_STREAM, 0);

    cr_assert_geq(fd, 0);
    sa.sin_port = htons((uint16_t)strtoul(colon + 1, NULL, 10));
    inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
    cr_assert_eq(connect(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    return fd;
}

static bool read_all(int fd, uint8_t *buf, size_t len)
{
    size_t got = 0;

    while (got < len) {
        ssize_t r = recv(fd, buf + got, len - got, 0);

        if (r <= 0)
            return false;
        got += (size_t)r;
    }
    return true;
}

/* Member m-0 is a client played by the test over a raw socket: it greets
 * the reducer m-1 and sends a frame for a segment the schedule does not
 * call for (its offset and length are off). The reducer fails with
 * -EPROTO at once, not at its timeout, and its buffer is not returned as
 * a result. */
Test(butterfly, a_lying_client_frame_fails_the_reducer_fast)
{
    struct bf b;
    size_t parts[2] = { 0, 64 };
    struct peerwire_hello h = { .kind = PEERWIRE_GREET, .epoch = 1, .incarnation = 7,
                                .serial = 1 };
    struct peerwire_frame f = { .magic = PEERWIRE_FRAME_DATA, .cohort = peerwire_cohort_hash(
                                                                  COHORT),
                                .epoch = 1, .round = 1, .count = 64, .dtype = DTYPE_F32,
                                .op = DTYPE_SUM, .phase = PEERWIRE_PHASE_RS, .offset = 8,
                                .length = 16 * sizeof(float) };
    uint8_t hello[PEERWIRE_HELLO_BYTES], frame[PEERWIRE_FRAME_BYTES], junk[16 * sizeof(float)];
    bool who[2] = { false, true };
    pthread_t th;
    struct call c;
    int fd;

    bf_start(&b, 2, 64, 64, 10000, NULL);
    memcpy(b.parts, parts, sizeof(parts));
    bf_fill(&b);
    b.round = 1;
    c = (struct call){ &b, 1 };
    (void)who;
    cr_assert_eq(pthread_create(&th, NULL, call_main, &c), 0);
    snprintf(h.cohort, sizeof(h.cohort), "%s", COHORT);
    snprintf(h.id, sizeof(h.id), "%s", "m-0");
    cr_assert_eq(peerwire_hello_encode(hello, &h), 0);
    fd = dial_addr(b.m[1].addr);
    cr_assert_eq(send(fd, hello, sizeof(hello), 0), (ssize_t)sizeof(hello));
    cr_assert(read_all(fd, hello, sizeof(hello)), "the reducer answers the greeting");
    peerwire_frame_encode(frame, &f);
    memset(junk, 0x7f, sizeof(junk));
    cr_assert_eq(send(fd, frame, sizeof(frame), 0), (ssize_t)sizeof(frame));
    cr_assert_eq(send(fd, junk, sizeof(junk), 0), (ssize_t)sizeof(junk));
    pthread_join(th, NULL);
    cr_assert_eq(b.m[1].rc, -EPROTO, "%s", log_strerror(b.m[1].rc));
    cr_assert_lt(b.m[1].took_ms, 8000, "failed by the frame, not by the timeout");
    close(fd);
    bf_stop(&b);
}

/* --- parts by bandwidth --------------------------------------------------- */

static size_t sum_of(const size_t *p, size_t n)
{
    size_t s = 0;

    for (size_t i = 0; i < n; i++)
        s += p[i];
    return s;
}

Test(butterfly, split_follows_hivemind_rules)
{
    size_t p[5];
    double quarter[4] = { .25, .25, .25, .25 }, unset[2] = { -1, -1 },
           mixed[5] = { 0, 0, 0, -1, -1 }, some[3] = { 2, -1, 4 }, zeros[3] = { 0, 0, 0 },
           bad[2] = { 1, NAN }, inf[2] = { 1, INFINITY };

    cr_assert_eq(allreduce_split(60, quarter, 4, 0, p), 0);
    for (size_t i = 0; i < 4; i++)
        cr_assert_eq(p[i], 15);
    cr_assert_eq(allreduce_split(100, unset, 2, 0, p), 0);
    cr_assert(p[0] == 50 && p[1] == 50);
    cr_assert_eq(allreduce_split(100, mixed, 5, 0, p), 0);
    cr_assert(p[0] == 0 && p[1] == 0 && p[2] == 0 && p[3] == 50 && p[4] == 50);
    /* Not given: the mean of those given (3), so bandwidths 2, 3, 4. The
     * member of 2 takes 1/2 to send its vector alone, while 3 and 4 can
     * reduce it all sooner (in 3/7, at shares 2/7 and 5/7): it reduces
     * nothing, as in hivemind's program. */
    cr_assert_eq(allreduce_split(900, some, 3, 0, p), 0);
    cr_assert(p[0] == 0 && p[1] == 257 && p[2] == 643, "%zu %zu %zu", p[0], p[1], p[2]);
    cr_assert_eq(allreduce_split(10, zeros, 3, 0, p), -ENODATA);
    cr_assert_eq(allreduce_split(10, bad, 2, 0, p), -EINVAL);
    cr_assert_eq(allreduce_split(10, inf, 2, 0, p), -EINVAL);
    cr_assert_eq(allreduce_split(10, quarter, 0, 0, p), -EINVAL);
}

/* min_part (hivemind's min_vector_size): shares worth fewer elements go
 * to 0 and the rest share their elements; unless every share is that
 * small, when nothing changes. Bandwidths 5, 4, 4: the program's shares
 * 7/13, 3/13, 3/13 (23.08 elements of 100 each for the last two). */
Test(butterfly, split_drops_parts_below_min_part)
{
    size_t p[3], q[3];
    double bw[3] = { 5, 4, 4 };

    cr_assert_eq(allreduce_split(100, bw, 3, 24, p), 0);
    cr_assert(p[0] == 100 && p[1] == 0 && p[2] == 0, "%zu %zu %zu", p[0], p[1], p[2]);
    cr_assert_eq(allreduce_split(100, bw, 3, 23, p), 0);
    cr_assert(p[0] == 54 && p[1] == 23 && p[2] == 23, "23.08 is not below 23: %zu %zu %zu",
              p[0], p[1], p[2]);
    cr_assert_eq(allreduce_split(100, bw, 3, 60, p), 0);
    cr_assert_eq(allreduce_split(100, bw, 3, 0, q), 0);
    cr_assert(memcmp(p, q, sizeof(p)) == 0, "every share below 60: as without min_part");
}

/* Two members: every split takes one vector each way, so the shares
 * follow the bandwidths. */
Test(butterfly, split_of_two_follows_the_bandwidths)
{
    size_t p[2];
    double bw[2] = { 1, 3 };

    cr_assert_eq(allreduce_split(100, bw, 2, 0, p), 0);
    cr_assert(p[0] == 25 && p[1] == 75, "%zu %zu", p[0], p[1]);
}

/* The round time of a split, hivemind's model: max over the members of
 * positive bandwidth of (1 + (g - 2) w_i) / b_i. */
static double round_time(const double *bw, const size_t *p, size_t n, size_t count)
{
    double t = 0;

    for (size_t i = 0; i < n; i++)
        if (bw[i] > 0) {
            double ti = (1 + ((double)n - 2) * (double)p[i] / (double)count) / bw[i];

            t = ti > t ? ti : t;
        }
    return t;
}

/* The least round time any split can reach, found apart from the code
 * under test: the least R (by bisection) at which the members can take
 * the whole vector, w_i <= (R b_i - 1) / (g - 2) each, and no less than
 * any member's time to send its vector alone. */
static double best_round_time(const double *bw, size_t n)
{
    double lo = 0, hi = 0, floor_t = 0;

    for (size_t i = 0; i < n; i++)
        if (bw[i] > 0) {
            hi = fmax(hi, ((double)n - 1) / bw[i]);
            floor_t = fmax(floor_t, 1 / bw[i]);
        }
    for (int it = 0; it < 200; it++) {
        double mid = (lo + hi) / 2, f = 0;

        for (size_t i = 0; i < n; i++)
            if (bw[i] > 0)
                f += fmin(1, fmax(0, (mid * bw[i] - 1) / ((double)n - 2)));
        if (f >= 1)
            hi = mid;
        else
            lo = mid;
    }
    return fmax(hi, floor_t);
}

/* hivemind's program: over many groups of 3 to 8 with clients (0) mixed
 * in, the split is whole, gives clients nothing, and ends the round as
 * soon as any split can, up to the rounding to whole elements (each
 * part within n elements of its exact share). */
Test(butterfly, split_solves_hivemind_program)
{
    uint64_t seed = 0x9e3779b97f4a7c15ull;
    size_t count = 1000000;

    for (int trial = 0; trial < 400; trial++) {
        size_t n = 3 + (size_t)(trial % 6), p[8], given = 0;
        double bw[8], best, got, slack = 0;

        for (size_t i = 0; i < n; i++) {
            seed = seed * 6364136223846793005ull + 1442695040888963407ull;
            /* Bandwidths spread over four decades; one in five a client. */
            bw[i] = (seed >> 40) % 5 == 0 ? 0 : pow(10, (double)((seed >> 11) % 4000) / 1000);
            given += bw[i] > 0;
        }
        if (!given)
            bw[0] = 1;
        cr_assert_eq(allreduce_split(count, bw, n, 0, p), 0);
        cr_assert_eq(sum_of(p, n), count);
        for (size_t i = 0; i < n; i++) {
            cr_assert(bw[i] > 0 || p[i] == 0, "trial %d: a client reduces %zu", trial, p[i]);
            if (bw[i] > 0)
                slack = fmax(slack, ((double)n - 2) * (double)n / (double)count / bw[i]);
        }
        best = best_round_time(bw, n);
        got = round_time(bw, p, n, count);
        cr_assert(got <= best * (1 + 1e-9) + slack && got >= best * (1 - 1e-9) - slack,
                  "trial %d (%zu members): round %.9g, best %.9g", trial, n, got, best);
    }
}

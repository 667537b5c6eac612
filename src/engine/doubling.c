/* src/engine/doubling.c: see doubling.h.
 *
 * log2(p) exchanges of the whole buffer with partner r xor 2^k, p the
 * largest power of two <= n; the n - p extra members first hand their data
 * to a neighbour and get the result back at the end. Each exchange
 * combines the lower-ranked half's value first, so every member computes
 * the same bytes; the upper partner pays one copy of the (small) buffer
 * for that. 16-bit floats are widened once into float32, exchanged and
 * combined as float32, and rounded once at the end, as in the ring.
 *
 * The payload every exchange sends is the accumulator that rd_stage()
 * makes once at the start, and every payload that arrives is folded in by
 * rd_combine(): recursive doubling's half of the codec seam described in
 * allreduce.c. (The result an extra member gets back at the end moves in
 * the user's type and lands in place, like the ring's all-gather.)
 *
 * A coded call (float32 with a codec, engine/codec.h) is doubling_coded():
 * partners must compute the same bytes, so before each exchange a member
 * replaces its accumulator with decode(encode(acc)) and sends those
 * encoded bytes, and each combines the two decoded values, lower group
 * first. The finished result goes through the codec once more, which the
 * extra members get encoded, so that every member holds decode(encode(r))
 * as in the ring. */
#include "engine/doubling.h"

#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "base/clock.h"
#include "engine/allreduce_impl.h"
#include "engine/conn.h"

/* Sends slen bytes to `to` while receiving rlen bytes from `from` (either
 * may be NULL), as RD step `step`. */
static int exchange(struct run *x, struct conn *to, const void *src, size_t slen,
                    struct conn *from, void *dst, size_t rlen, uint32_t step)
{
    struct peerwire_frame f;
    uint64_t now = clock_now_ms(), spin_from = 0;
    int rc;

    if (to) {
        f = conn_frame(x, PEERWIRE_PHASE_RD, step, 0, slen);
        conn_tx_start(to, &f, src);
        to->tx_since = now;
    }
    if (from) {
        f = conn_frame(x, PEERWIRE_PHASE_RD, step, 0, rlen);
        conn_rx_start(from, &f, dst);
        from->rx_since = now;
    }
    for (;;) {
        bool moved = false;
        struct pollfd pfd[3];
        nfds_t np = 0;
        uint64_t d = UINT64_MAX;

        if (run_stale(x))
            return -ESTALE;
        if (to && to->tx_busy) {
            rc = conn_tx_pump(to);
            if (rc < 0) {
                x->fail_peer = to->peer;
                return conn_refine(x, to, rc);
            }
            moved |= rc > 0;
        }
        if (from && from->rx_busy) {
            rc = conn_rx_pump(x, from);
            if (rc < 0) {
                x->fail_peer = from->peer;
                return rc;
            }
            moved |= rc > 0;
        }
        if (!(to && to->tx_busy) && !(from && from->rx_busy))
            return 0;
        if (moved) {
            spin_from = 0;
            continue;
        }
        if (conn_spin(&spin_from))
            continue;
        now = clock_now_ms();
        pfd[np++] = (struct pollfd){ .fd = x->a->abort_fd, .events = POLLIN };
        if (to && to->tx_busy) {
            conn_since_update(to, now);
            d = conn_silence_deadline(x, to, false);
            pfd[np++] = (struct pollfd){ .fd = to->fd, .events = POLLOUT };
        }
        if (from && from->rx_busy) {
            uint64_t d2;

            conn_since_update(from, now);
            d2 = conn_silence_deadline(x, from, false);
            d = d2 < d ? d2 : d;
            if (np == 2 && from == to)
                pfd[1].events |= POLLIN;
            else
                pfd[np++] = (struct pollfd){ .fd = from->fd, .events = POLLIN };
        }
        rc = conn_wait(x, pfd, np, d);
        if (rc < 0) {
            x->fail_peer = from ? from->peer : to->peer;
            return rc;
        }
    }
}

/* Where the payload is staged for sending: the accumulator that every
 * exchange sends and combines into, this member's contribution in the
 * accumulation type. The buffer itself, or for 16-bit floats its widened
 * copy in rd_a. */
static uint8_t *rd_stage(struct run *x)
{
    if (!x->wide)
        return x->buf;
    dtype_widen(x->type, (float *)x->a->rd_a, (const uint16_t *)x->buf, x->count);
    return x->a->rd_a;
}

/* Where a received payload is combined: the partner's value (tmp) into
 * ours (acc), the lower-ranked group's operand first so both partners
 * compute the same bytes. */
static void rd_combine(struct run *x, void *acc, void *tmp, bool we_are_lower)
{
    if (we_are_lower) {
        dtype_combine(x->acc, x->op, acc, tmp, x->count);
    } else {
        dtype_combine(x->acc, x->op, tmp, acc, x->count);
        memcpy(acc, tmp, x->count * x->asz);
    }
}

struct rd_shape {
    size_t p2, rem;             /* largest power of two <= n, and n - p2 */
};

static struct rd_shape rd_shape(size_t n)
{
    struct rd_shape s = { 1, 0 };

    while (s.p2 * 2 <= n)
        s.p2 *= 2;
    s.rem = n - s.p2;
    return s;
}

static size_t rd_real(struct rd_shape s, size_t v)
{
    return v < s.rem ? 2 * v + 1 : v + s.rem;
}

size_t doubling_needs(size_t n, size_t me, size_t *need)
{
    struct rd_shape s = rd_shape(n);
    size_t k = 0, v;

    if (me < 2 * s.rem) {
        need[k++] = me % 2 == 0 ? me + 1 : me - 1;
        if (me % 2 == 0)
            return k;
        v = me / 2;
    } else {
        v = me - s.rem;
    }
    for (size_t mask = 1; mask < s.p2; mask <<= 1)
        need[k++] = rd_real(s, v ^ mask);
    return k;
}

/* Receives a coded payload into rd_b and decodes it into rd_a (free by
 * then: what was sent from it has gone). */
static int coded_exchange(struct run *x, struct conn *to, struct conn *from, size_t wire,
                          uint32_t step)
{
    struct allreduce *a = x->a;
    int rc = exchange(x, to, a->rd_a, to ? wire : 0, from, a->rd_b, from ? wire : 0, step);

    if (rc == 0 && from)
        codec_decode(x->codec, (float *)a->rd_a, a->rd_b, x->count);
    return rc;
}

static int doubling_coded(struct run *x)
{
    struct allreduce *a = x->a;
    struct rd_shape s = rd_shape(x->n);
    size_t r = x->me, wire = codec_bytes(x->codec, x->count), v;
    float *acc = (float *)x->buf;
    uint32_t step = 1;
    int rc;

    if (r < 2 * s.rem && r % 2 == 0) {
        struct conn *c = a->conns[r + 1];

        codec_encode(x->codec, a->rd_a, acc, x->count);
        rc = exchange(x, c, a->rd_a, wire, NULL, NULL, 0, 0);
        if (rc == 0)
            rc = exchange(x, NULL, NULL, 0, c, a->rd_b, wire, UINT32_MAX);
        if (rc == 0)
            codec_decode(x->codec, acc, a->rd_b, x->count);
        return rc;
    }
    if (r < 2 * s.rem) {
        rc = coded_exchange(x, NULL, a->conns[r - 1], wire, 0);
        if (rc < 0)
            return rc;
        rd_combine(x, acc, a->rd_a, false);
        v = r / 2;
    } else {
        v = r - s.rem;
    }
    for (size_t mask = 1; mask < s.p2; mask <<= 1, step++) {
        struct conn *c = a->conns[rd_real(s, v ^ mask)];

        codec_round_trip(x->codec, acc, a->rd_a, x->count);
        rc = coded_exchange(x, c, c, wire, step);
        if (rc < 0)
            return rc;
        rd_combine(x, acc, a->rd_a, v < (v ^ mask));
    }
    dtype_scale(DTYPE_F32, acc, x->count, x->div);
    codec_round_trip(x->codec, acc, a->rd_a, x->count);
    if (r < 2 * s.rem)
        return exchange(x, a->conns[r - 1], a->rd_a, wire, NULL, NULL, 0, UINT32_MAX);
    return 0;
}

int doubling_run(struct run *x)
{
    struct allreduce *a = x->a;
    struct rd_shape s = rd_shape(x->n);
    size_t r = x->me, wire = x->count * x->asz, v;
    uint8_t *acc = rd_stage(x);
    uint8_t *tmp = x->wide ? a->rd_b : a->rd_a;
    uint32_t step = 1;
    int rc;

    if (x->coded)
        return doubling_coded(x);
    if (r < 2 * s.rem && r % 2 == 0) {
        /* An extra member: hand our data over, get the result back. */
        struct conn *c = a->conns[r + 1];

        rc = exchange(x, c, acc, wire, NULL, NULL, 0, 0);
        if (rc == 0)
            rc = exchange(x, NULL, NULL, 0, c, x->buf, x->count * x->esz, UINT32_MAX);
        return rc;
    }
    if (r < 2 * s.rem) {
        rc = exchange(x, NULL, NULL, 0, a->conns[r - 1], tmp, wire, 0);
        if (rc < 0)
            return rc;
        rd_combine(x, acc, tmp, false);
        v = r / 2;
    } else {
        v = r - s.rem;
    }
    for (size_t mask = 1; mask < s.p2; mask <<= 1, step++) {
        struct conn *c = a->conns[rd_real(s, v ^ mask)];

        rc = exchange(x, c, acc, wire, c, tmp, wire, step);
        if (rc < 0)
            return rc;
        rd_combine(x, acc, tmp, v < (v ^ mask));
    }
    dtype_scale(x->acc, acc, x->count, x->div);
    if (x->wide)
        dtype_narrow(x->type, (uint16_t *)x->buf, (const float *)acc, x->count);
    if (r < 2 * s.rem)
        return exchange(x, a->conns[r - 1], x->buf, x->count * x->esz, NULL, NULL, 0, UINT32_MAX);
    return 0;
}

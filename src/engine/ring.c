/* src/engine/ring.c: see ring.h.
 *
 * Reduce-scatter then all-gather, 2(n-1) steps. At step t member r sends
 * chunk (r - t) mod n to its right neighbour and receives chunk
 * (r - t - 1) mod n from its left; the first n-1 steps reduce, the rest
 * copy. The buffer is cut into windows, each a complete ring over n
 * chunks of at most WINDOW_UNITS segments (every cut even: "Cutting
 * evenly" below), run back to back: the next window's first sends follow
 * the previous window's last ones without a gap, so the pipeline never
 * drains. While the kernel moves segment k in and out of
 * the sockets this thread reduces segment k-1: received bytes land in a
 * staging slot, are reduced into the user buffer, and are sent on from the
 * user buffer, so no payload is copied beyond that.
 *
 * Every byte a segment puts on the wire is chosen by ring_stage(), and
 * every reduce-scatter segment that arrives is folded in by ring_combine()
 * (all-gather segments land in the user buffer and need nothing): the
 * ring's half of the codec seam described in allreduce.c.
 *
 * Window length, measured on the 2-core development VM (`cohortctl bench
 * allreduce`, f32 sum, one process per member, loopback TCP), 64 MiB busbw
 * GB/s (segments per chunk per window):
 *   n=2: 4 -> 1.51, 8 -> 1.56, 16 -> 1.13 (sends leave cache)
 *   n=3: 4 -> 0.65, 8 -> 0.72, 16 -> 0.76, 32 -> 0.78
 *   n=4: 4 -> 0.62, 8 -> 0.64, 16 -> 0.75, 32 -> 0.79
 * More members than cores need slack when one is descheduled: 16 for
 * n >= 3, 8 for pairs.
 *
 * 16-bit floats accumulate in float32: partial sums travel as float32
 * during the reduce-scatter and are rounded to 16 bits once, by the member
 * that finishes a chunk; the all-gather moves 16-bit values. That is 1.5x
 * the bytes of a pure 16-bit ring (2x in the first half), the price of one
 * rounding instead of n-1. Partial sums need storage until forwarded, so
 * 16-bit windows are shorter (WINDOW_UNITS_WIDE) to bound that to a few
 * staging slots: with WINDOW_UNITS_WIDE + 2 slots, a receive that waits
 * for a slot implies this member's receives are ahead of its sends, which
 * cannot hold all around the ring at once, so the ring cannot deadlock on
 * slots. Other types reduce into the user buffer and free their slot at
 * once, so their windows can be longer: more slack when members share
 * cores.
 *
 * A coded call (a codec, engine/codec.h; float32 only) moves encoded
 * segments in both halves and accumulates in float32 in the user buffer.
 * Step 0 encodes our contribution into the spare slot. A reduce-scatter
 * segment that arrives is decoded (into the scratch segment), combined
 * with ours into the user buffer, and encoded back into its slot to be
 * forwarded; at the last reduce-scatter step the owner scales the sum,
 * encodes it into the slot and decodes that back into the user buffer,
 * so that its own copy is the bytes every other member will decode. An
 * all-gather segment is decoded into the user buffer and its slot is
 * forwarded as it came, never encoded again (int8 is not idempotent),
 * except at the last step, which nobody forwards. So every slot that is
 * not the last step's is queued to be sent, in the order received, which
 * is the order of the sends that forward them: the 16-bit scheme above,
 * extended to the all-gather, with the same window length and slots.
 *
 * Staged sums. Out of place (the Accumulator's call: gradients in,
 * results out), summing a received segment with ours straight into the
 * results writes lines of them that were never read, and a write-allocate
 * cache reads each from memory first: past the caches, one more read of
 * every byte this member reduces than in place, which costs most where
 * the ring is bound by memory bandwidth. So from RING_STAGED_MIN_BYTES
 * up, on CPUs with streaming stores, a reduce-scatter sum stays in the
 * staging slot it arrived in (our contribution folded in with
 * dtype_combine_onto, ours first as everywhere) and is
 * forwarded from there, as 16-bit partial sums are, with their window
 * length and slots; a chunk's final sum is also copied into the results
 * with non-temporal stores, which read nothing, and the all-gather's
 * first step forwards it from the slot, still in the cache. Below that
 * size the results are in the cache anyway and the copy would cost more
 * than the read it saves. */
#include "engine/ring.h"

#include <errno.h>
#include <stdbool.h>
#include <stdint.h>

#include "base/clock.h"
#include "base/log.h"
#include "engine/allreduce_impl.h"
#include "engine/conn.h"
#include "engine/dtype.h"

/* Segments per chunk per window; 16-bit types use WINDOW_UNITS_WIDE
 * (allreduce_impl.h, since it sizes the staging area). */
#ifndef WINDOW_UNITS
#define WINDOW_UNITS 16
#endif
#define WINDOW_UNITS_PAIR 8

/* Position in the ring schedule: window w, step t, segment j of the chunk
 * that step moves. Both ends of a connection walk the same sequence. */
struct cursor {
    size_t w, t, j;
    size_t base, len;           /* the unit's first element and element count */
    bool done;
};

struct ring {
    size_t seg;                 /* elements per segment */
    size_t fold;                /* the longest tail a chunk folds in: "Folding a tail" */
    size_t win;                 /* the most elements in a window */
    size_t n_windows;
    size_t steps;               /* 2(n - 1) */
    struct cursor s, q;         /* next send, next (or current) receive */
    int tx_slot;                /* slot the frame in flight is sent from, or -1 */
    int rx_slot;
    bool slot_busy[SLOTS];
    int fifo[SLOTS];            /* 16-bit, coded, staged: slots to forward, in order */
    size_t fifo_head, fifo_len;
    bool staged;                /* "Staged sums" */
};

size_t ring_needs(size_t n, size_t me, size_t *need)
{
    size_t k = 0;

    need[k++] = (me + 1) % n;
    if (n > 2)
        need[k++] = (me + n - 1) % n;
    return k;
}

/* Cutting evenly. The buffer is cut into as few windows as hold it in
 * windows of at most `win` elements, a window into n chunks, a chunk into
 * as few segments as hold it in segments of at most `seg`: each cut into
 * parts whose lengths differ by one at most (ring_part_start), so a
 * length that does not divide ends in no tiny part. A tiny last segment
 * would cost a frame and a pipeline step like a full one, and a tiny last
 * window 2(n - 1) of them; cut evenly, the same number of frames carry
 * the same bytes in parts of nearly equal time.
 *
 * Folding a tail. A length just past a whole number of parts, such as a
 * buffer of whole segments with the Accumulator's 208 bytes of counters
 * behind it, would still need one more part, and a short segment costs an
 * exchange at every step, about what a full one costs on loopback. So an
 * uncompressed call folds a tail of at most 1/FOLD_SHARE of a segment
 * into the parts before it (parts_folded): a chunk of u segments and up
 * to seg / FOLD_SHARE elements more is cut into u segments, each at most
 * seg + seg / FOLD_SHARE long, and a buffer of w windows and up to n
 * times that into w windows, whose chunks then fold the same way (a
 * window is then at most n x fold longer, so its chunks at most fold).
 * 1/64 of the 256 KiB default is 4 KiB, which holds the Accumulator's
 * counters at any member count that carries them (at most 13 counters of
 * 64 one-bit float32 digits, 3,328 bytes; 208 for 2 to 8 members, 260 for
 * 16) and lengthens a segment by 1.6% at most. A share rather than a
 * fixed size keeps the slots' growth proportional to a configured
 * segment; a larger one would hold nothing the counters need. The
 * staging slots are that much longer (ring_slot_bytes), allocated once
 * with the engine, and a chunk still has at most as many segments as a
 * window allows, so the slot accounting above holds. Coded calls do not
 * fold (fold 0): a codec's bound on a segment's encoding is checked for
 * whole segments (allreduce.c).
 *
 * A fold changes which window and chunk an element of a folded size
 * falls in, so at 3 or more members the order in which its sum is taken
 * may differ from an engine without folding; every member computes the
 * same cut, so every member still ends with the same bytes. The wire
 * format is unchanged, so the greeting's version is too: an engine
 * without folding in the same epoch cuts those sizes differently, the
 * first frame of a chunk it cuts differently names an offset or length
 * other than the one due, and the receiver's header check (conn.c) fails
 * the call with -EPROTO before that frame's payload lands (the buffer's
 * contents are then unspecified, as after any failed call); sizes that
 * fold nothing are cut as before and work across the two. A frame the
 * check accepts names its step, so it carries the partial sum of the
 * same members either way: no wrong bytes are ever combined. */
#define FOLD_SHARE 64

size_t ring_slot_bytes(size_t seg_bytes)
{
    size_t b = seg_bytes + seg_bytes / FOLD_SHARE;

    return (b + 7) / 8 * 8;
}

/* As ring_parts, except that a last part of at most fold is spread over
 * the others (see "Folding a tail"). */
static size_t parts_folded(size_t len, size_t most, size_t fold)
{
    size_t p = ring_parts(len, most);

    if (p > 1 && len - (p - 1) * most <= fold)
        p--;
    return p;
}

size_t ring_part_start(size_t total, size_t n, size_t c)
{
    size_t q = total / n, r = total % n;

    return c * q + (c < r ? c : r);
}

size_t ring_parts(size_t len, size_t most)
{
    return (len + most - 1) / most;
}

bool ring_staged(bool into, size_t bytes)
{
    return into && dtype_copy_streams() && bytes >= RING_STAGED_MIN_BYTES;
}

/* Segments per chunk per window: shorter where sums wait in the slots. */
static size_t window_units(size_t n, bool in_slots)
{
    return in_slots ? WINDOW_UNITS_WIDE : n == 2 ? WINDOW_UNITS_PAIR : WINDOW_UNITS;
}

size_t ring_segments(size_t n, size_t count, size_t seg, bool staged)
{
    size_t win = n * seg * window_units(n, staged), total = 0;
    size_t fold = seg / FOLD_SHARE;
    size_t windows = parts_folded(count, win, n * fold);

    for (size_t w = 0; w < windows; w++) {
        size_t wl = ring_part_start(count, windows, w + 1) - ring_part_start(count, windows, w);

        for (size_t c = 0; c < n; c++)
            total += parts_folded(ring_part_start(wl, n, c + 1) - ring_part_start(wl, n, c), seg,
                                  fold);
    }
    return total;
}

/* Settles k on the next existing unit at or after its position. Sends at
 * step t move chunk (me - t), receives chunk (me - t - 1) (shift 1). */
static void cursor_settle(const struct run *x, const struct ring *g, struct cursor *k,
                          size_t shift)
{
    while (k->w < g->n_windows) {
        size_t ws = ring_part_start(x->count, g->n_windows, k->w);
        size_t wl = ring_part_start(x->count, g->n_windows, k->w + 1) - ws;

        while (k->t < g->steps) {
            size_t c = (x->me + 2 * x->n - k->t - shift) % x->n;
            size_t cs = ring_part_start(wl, x->n, c);
            size_t cl = ring_part_start(wl, x->n, c + 1) - cs;
            size_t units = parts_folded(cl, g->seg, g->fold);

            if (k->j < units) {
                size_t us = ring_part_start(cl, units, k->j);

                k->base = ws + cs + us;
                k->len = ring_part_start(cl, units, k->j + 1) - us;
                return;
            }
            k->t++;
            k->j = 0;
        }
        k->w++;
        k->t = 0;
    }
    k->done = true;
}

static void cursor_next(const struct run *x, const struct ring *g, struct cursor *k, size_t shift)
{
    k->j++;
    cursor_settle(x, g, k, shift);
}

/* True when the receive (w, t, j) has completed. */
static bool received(const struct ring *g, size_t w, size_t t, size_t j)
{
    const struct cursor *q = &g->q;

    if (q->done || q->w != w)
        return q->done || q->w > w;
    if (q->t != t)
        return q->t > t;
    return q->j > j;
}

static uint8_t *slot_ptr(const struct run *x, int slot)
{
    return x->a->stage + (size_t)slot * x->a->slot_bytes;
}

/* The slot that received a sum to forward joins the queue of sends. */
static void fifo_push(struct ring *g, int slot)
{
    g->fifo[(g->fifo_head + g->fifo_len) % SLOTS] = slot;
    g->fifo_len++;
}

/* The next send's slot: it is busy until that send completes. */
static int fifo_pop(struct ring *g)
{
    int slot = g->fifo[g->fifo_head];

    g->fifo_head = (g->fifo_head + 1) % SLOTS;
    g->fifo_len--;
    return slot;
}

static bool ring_send_ready(const struct ring *g)
{
    return g->s.t == 0 || received(g, g->s.w, g->s.t - 1, g->s.j);
}

/* Where a payload is staged for sending: returns the bytes that carry the
 * send cursor's unit and sets *bytes to their wire length. Step 0 sends
 * our own contribution; every later step sends a partial sum or a result,
 * which live in buf, except that 16-bit partial sums travel as float32
 * from a staging slot (g->tx_slot, freed once sent), staged sums up to
 * the all-gather's first step from theirs, and coded calls send every
 * later step from its slot, encoded. */
static const void *ring_stage(struct run *x, struct ring *g, size_t *bytes)
{
    const struct cursor *s = &g->s;
    const void *src = (s->t == 0 ? x->src : x->buf) + s->base * x->esz;

    *bytes = s->len * x->esz;
    g->tx_slot = -1;
    if (x->coded) {
        *bytes = codec_bytes(x->codec, s->len);
        if (s->t == 0) {
            codec_encode(x->codec, slot_ptr(x, SLOTS), (const float *)src, s->len);
            return slot_ptr(x, SLOTS);
        }
        g->tx_slot = fifo_pop(g);
        return slot_ptr(x, g->tx_slot);
    }
    if (g->staged && s->t > 0 && s->t < x->n) {
        /* Partial sums, and at step n - 1 our final one: in their slots. */
        g->tx_slot = fifo_pop(g);
        return slot_ptr(x, g->tx_slot);
    }
    if (x->wide && s->t < x->n - 1) {
        *bytes = s->len * x->asz;
        if (s->t == 0) {
            /* Our own contribution, widened once into the spare slot. */
            dtype_widen(x->type, (float *)slot_ptr(x, SLOTS), (const uint16_t *)src, s->len);
            src = slot_ptr(x, SLOTS);
        } else {
            g->tx_slot = fifo_pop(g);
            src = slot_ptr(x, g->tx_slot);
        }
    }
    return src;
}

static void ring_send_start(struct run *x, struct ring *g, struct conn *c)
{
    const struct cursor *s = &g->s;
    size_t bytes;
    const void *src = ring_stage(x, g, &bytes);
    struct peerwire_frame f =
        conn_frame(x, s->t < x->n - 1 ? PEERWIRE_PHASE_RS : PEERWIRE_PHASE_AG, (uint32_t)s->t,
                   s->base, bytes);

    conn_tx_start(c, &f, src);
}

/* Starts the next receive if it has somewhere to land: a free staging
 * slot in the reduce-scatter (ring_combine takes it from there), the
 * user buffer in the all-gather; a slot for both when coded. The length
 * it expects is the codec's for the segment's element count, so a frame
 * of any other length fails the call. */
static bool ring_recv_start(struct run *x, struct ring *g, struct conn *c)
{
    const struct cursor *q = &g->q;
    bool rs = q->t < x->n - 1;
    struct peerwire_frame f;
    void *dst;
    size_t bytes;

    if (rs || x->coded) {
        int slot = -1;

        for (int i = 0; i < SLOTS && slot < 0; i++)
            if (!g->slot_busy[i])
                slot = i;
        if (slot < 0)
            return false;
        g->slot_busy[slot] = true;
        g->rx_slot = slot;
        dst = slot_ptr(x, slot);
        bytes = x->coded ? codec_bytes(x->codec, q->len) : q->len * x->asz;
    } else {
        dst = x->buf + q->base * x->esz;
        bytes = q->len * x->esz;
    }
    f = conn_frame(x, rs ? PEERWIRE_PHASE_RS : PEERWIRE_PHASE_AG, (uint32_t)q->t, q->base, bytes);
    conn_rx_start(c, &f, dst);
    return true;
}

/* The coded half of ring_combine: see the top of the file. */
static void ring_combine_coded(struct run *x, struct ring *g)
{
    const struct cursor *q = &g->q;
    uint8_t *slot = slot_ptr(x, g->rx_slot);
    float *dst = (float *)x->buf + q->base;

    if (q->t < x->n - 1) {
        float *got = (float *)slot_ptr(x, SCRATCH);

        codec_decode(x->codec, got, slot, q->len);
        if (x->src != x->buf)
            dtype_combine_into(DTYPE_F32, x->op, dst, (const float *)x->src + q->base, got,
                               q->len);
        else
            dtype_combine(DTYPE_F32, x->op, dst, got, q->len);
        if (q->t == x->n - 2) {
            dtype_scale(DTYPE_F32, dst, q->len, x->div);
            codec_round_trip(x->codec, dst, slot, q->len);
        } else {
            codec_encode(x->codec, slot, dst, q->len);
        }
    } else {
        codec_decode(x->codec, dst, slot, q->len);
        if (q->t == g->steps - 1) {
            g->slot_busy[g->rx_slot] = false;
            return;
        }
    }
    fifo_push(g, g->rx_slot);
}

/* Where a received payload is combined: a reduce-scatter segment arrived
 * in g->rx_slot, so fold our own data in. At the last reduce-scatter step
 * the segment is final here: scale it (avg) and, for 16-bit types, round
 * it into the user buffer. An all-gather segment is already in place. */
static void ring_combine(struct run *x, struct ring *g)
{
    const struct cursor *q = &g->q;
    bool last = q->t == x->n - 2;
    uint8_t *slot;

    if (x->coded) {
        ring_combine_coded(x, g);
        return;
    }
    if (q->t >= x->n - 1)
        return;                 /* all-gather: it landed in the user buffer */
    slot = slot_ptr(x, g->rx_slot);
    if (g->staged) {
        dtype_combine_onto(x->acc, x->op, slot, x->src + q->base * x->esz, q->len);
        if (last) {
            dtype_scale(x->acc, slot, q->len, x->div);
            dtype_copy_streaming(x->buf + q->base * x->esz, slot, q->len * x->esz);
        }
        fifo_push(g, g->rx_slot);
        return;
    }
    if (!x->wide) {
        void *dst = x->buf + q->base * x->esz;

        /* Out of place, our contribution is read where it is and the sum
         * written once, with no copy; the sum's lines were not read, and
         * a write-allocate cache reads them first, which matters only
         * past the caches ("Staged sums"). */
        if (x->src != x->buf)
            dtype_combine_into(x->acc, x->op, dst, x->src + q->base * x->esz, slot, q->len);
        else
            dtype_combine(x->acc, x->op, dst, slot, q->len);
        if (last)
            dtype_scale(x->acc, dst, q->len, x->div);
        g->slot_busy[g->rx_slot] = false;
        return;
    }
    dtype_combine_widen(x->type, x->op, (float *)slot, (const uint16_t *)x->src + q->base, q->len);
    if (last) {
        dtype_scale(DTYPE_F32, slot, q->len, x->div);
        dtype_narrow(x->type, (uint16_t *)x->buf + q->base, (const float *)slot, q->len);
        g->slot_busy[g->rx_slot] = false;
        return;
    }
    fifo_push(g, g->rx_slot);
}

/* Sleeps until L can receive, R can send, R's control side has something
 * to say, the epoch changes, or the silence deadline passes. */
static int ring_wait(struct run *x, struct conn *L, struct conn *R, bool watch)
{
    struct pollfd pfd[3];
    nfds_t np = 0;
    uint64_t now = clock_now_ms(), d1, d2;
    int rc;

    conn_since_update(L, now);
    if (R != L)
        conn_since_update(R, now);
    d1 = conn_silence_deadline(x, L, false);
    d2 = conn_silence_deadline(x, R, watch);
    if (!R->tx_busy && !L->rx_busy) {
        /* Nothing to send, nowhere to receive: cannot happen (see SLOTS);
         * fail rather than wait forever if it ever does. */
        log_error(COMPONENT, "The ring schedule stalled.", LF_S("cohort", x->a->cohort));
        return -EIO;
    }
    /* Idle descriptors stay out of poll: a hung-up one would spin it. */
    pfd[np++] = (struct pollfd){ .fd = x->a->abort_fd, .events = POLLIN };
    pfd[np++] = (struct pollfd){ .fd = L->rx_busy ? L->fd : -1, .events = POLLIN };
    if (R == L) {
        pfd[1].fd = L->fd;
        pfd[1].events = (short)((L->rx_busy ? POLLIN : 0) | (L->tx_busy ? POLLOUT : 0));
    } else {
        pfd[np++] = (struct pollfd){ .fd = R->fd,
                                     .events = (short)((R->tx_busy ? POLLOUT : 0) | POLLIN) };
    }
    rc = conn_wait(x, pfd, np, d1 < d2 ? d1 : d2);
    if (rc == -ETIMEDOUT)
        x->fail_peer = d1 < d2 ? L->peer : R->peer;
    if (rc < 0)
        return rc;
    if (watch && (pfd[2].revents & (POLLIN | POLLHUP | POLLERR))) {
        rc = conn_rx_pump(x, R);
        if (rc < 0 || !R->rx_busy) {
            /* Anything but silence on the control side ends the call. */
            x->fail_peer = R->peer;
            return rc < 0 ? rc : -EPROTO;
        }
    }
    return 0;
}

int ring_run(struct run *x)
{
    struct allreduce *a = x->a;
    struct conn *L = a->conns[(x->me + x->n - 1) % x->n];
    struct conn *R = a->conns[(x->me + 1) % x->n];
    bool watch = L != R;        /* R's inbound side carries only control frames */
    struct ring g = { .tx_slot = -1, .rx_slot = -1 };
    uint64_t now = clock_now_ms(), spin_from = 0;
    int rc;

    g.seg = a->seg_bytes / x->asz;
    g.staged = !x->wide && !x->coded && ring_staged(x->src != x->buf, x->count * x->esz);
    g.win = x->n * g.seg * window_units(x->n, x->wide || x->coded || g.staged);
    g.fold = x->coded ? 0 : g.seg / FOLD_SHARE;
    g.n_windows = parts_folded(x->count, g.win, x->n * g.fold);
    g.steps = 2 * (x->n - 1);
    cursor_settle(x, &g, &g.s, 0);
    cursor_settle(x, &g, &g.q, 1);
    L->rx_since = R->tx_since = now;
    if (watch) {
        struct peerwire_frame ctl = { 0 };
        conn_rx_start(R, &ctl, NULL);
    }
    for (;;) {
        bool moved = false;

        if (run_stale(x))
            return -ESTALE;
        if (!R->tx_busy && !g.s.done && ring_send_ready(&g)) {
            ring_send_start(x, &g, R);
            cursor_next(x, &g, &g.s, 0);
        }
        if (R->tx_busy) {
            rc = conn_tx_pump(R);
            if (rc < 0) {
                x->fail_peer = R->peer;
                return conn_refine(x, R, rc);
            }
            moved |= rc > 0;
            if (!R->tx_busy && g.tx_slot >= 0) {
                g.slot_busy[g.tx_slot] = false;
                g.tx_slot = -1;
            }
        }
        if (!L->rx_busy && !g.q.done)
            ring_recv_start(x, &g, L);
        if (L->rx_busy) {
            rc = conn_rx_pump(x, L);
            if (rc < 0) {
                x->fail_peer = L->peer;
                return rc;
            }
            moved |= rc > 0;
            if (!L->rx_busy) {
                ring_combine(x, &g);
                cursor_next(x, &g, &g.q, 1);
            }
        }
        if (g.s.done && g.q.done && !R->tx_busy)
            return 0;
        if (moved) {
            spin_from = 0;
            continue;
        }
        if (conn_spin(&spin_from))
            continue;
        rc = ring_wait(x, L, R, watch);
        if (rc < 0)
            return rc;
    }
}

/* src/engine/butterfly.c: see butterfly.h.
 *
 * THE SCHEDULE
 *
 * Part j is the run of x->parts[j] elements after the parts of members
 * before j, cut into segments of the engine's segment size. On the
 * connection between members me and p the frames go in one fixed order
 * each way, so a receiver knows every header it is due (conn.c checks
 * them field for field):
 *
 *   me -> p   part p of our contribution, segment by segment (phase RS),
 *             then the result of part me, segment by segment (phase AG);
 *   p -> me   part me of p's contribution (RS), then the result of part
 *             p (AG), which lands in the user buffer where it belongs.
 *
 * Either list is empty when its part is. A member without a part
 * (a client, or one of bandwidth 0) only sends its contribution and
 * receives results, so it needs no connection to another such member; and
 * since the member lower in the epoch's order dials (conn.c), members
 * without a part placed before every member with one dial all their
 * connections and are never dialled: they need accept nothing, which is
 * what hivemind's client mode asks. A ring cannot serve such a member:
 * every ring member receives from its left neighbour and reduces a chunk.
 *
 * REDUCING
 *
 * The owner of a part reduces it segment by segment in a fixed order: its
 * own contribution first, then every other member's in the epoch's
 * order, reading one contribution at a time into a staging slot and
 * folding it into the user buffer. The result is the owner's bytes, sent
 * as they are to every member, so every member ends with the same bytes;
 * the fixed order makes them the same from run to run too. Reading one
 * sender at a time costs nothing at the owner's link, which every sender
 * shares anyway: the others' segments wait in their sockets meanwhile.
 *
 * No cycle can stall it: a contribution is sent without waiting for
 * anything, an owner reads contributions in its own order independently
 * of its sends, and a result waits only for its segment's reduction. A
 * result of part p cannot arrive before p has read all of our
 * contribution to p, so in place the result overwrites nothing still to
 * be sent.
 *
 * A LIMIT
 *
 * On one connection a result of part p waits behind all of p's
 * contributions to our part, which we read only as our reduction reaches
 * them: with a large part the owner's sends of results to us can sit in
 * a full socket for as long as we take to reduce our part, and the
 * silence clock counts that time. Set the member timeout above it (the
 * averager's default of 30 s covers hundreds of MiB on loopback).
 *
 * COST
 *
 * With parts w_j of a vector of V bytes among n members, member j sends
 * V(1 - w_j) of contributions plus (n - 1) w_j V of results and receives
 * the same amounts the other way: a member without a part sends V and
 * receives V, and each owner pays (n - 1) w_j V each way for every
 * member, clients included. Frames and failures are the engine's: a
 * silent peer fails the call after the member timeout, a frame out of
 * schedule fails it with -EPROTO, and every failed call says BYE on its
 * connections so that the others fail fast. A codec scales the bytes by
 * its ratio.
 *
 * WITH A CODEC
 *
 * A coded call (x->coded: a codec, engine/codec.h; float32 only) encodes
 * every payload, segment by segment, each segment alone as in the ring:
 *
 *   - a contribution is encoded when its frame starts, from the caller's
 *     values, and decoded by the owner into a staging slot, whose values
 *     it adds in float32 (its own contribution stays unencoded);
 *   - a reduced segment is encoded once by its owner, and the owner
 *     decodes those bytes back into its result before sending them: so
 *     the owner holds what every member decodes, and every member ends
 *     with the same bytes (the ring's rule that a value kept is
 *     decode(encode(value))).
 *
 * The encoded bytes live in one buffer of the call (`enc`), the encoding
 * of the whole vector segment by segment at fixed places: part j's
 * segment k at enc_off[j] + k x codec_bytes(segment). Our contributions to
 * part p are encoded into part p's place and sent from there; p's result
 * lands in the same place, which is safe for the reason a result may
 * overwrite a contribution in place (above): it arrives only after p read
 * all of that contribution. Our own part's place holds our encoded
 * results, sent to every member from there. A receiver expects the
 * codec's length for the segment's elements (conn.c checks the header),
 * and decoding never fails, so a lying peer can send wrong values but
 * never make a member read or write out of place. The buffer costs the
 * encoded size of the vector (about a quarter of it for the 8-bit codecs)
 * for the call. */
#include "engine/butterfly.h"

#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "base/clock.h"
#include "engine/allreduce_impl.h"
#include "engine/conn.h"

/* One peer's connection and where its two frame lists stand. */
struct link {
    struct conn *c;
    size_t p;                   /* the peer's index */
    size_t tx_k, tx_n;          /* frames sent so far, and in all */
    size_t rx_k, rx_n;          /* frames received so far, and in all */
};

struct bf {
    size_t seg;                 /* elements per segment */
    size_t cseg;                /* a whole segment's encoded bytes (coded calls) */
    uint8_t *enc;               /* coded: the vector's encoding (see the top) */
    size_t *enc_off;            /* coded: n + 1 part starts in enc */
    size_t *off;                /* n + 1 part starts (off[n] = count) */
    size_t rk, ri;              /* the reduction: segment rk, sender order ri */
    size_t reduced;             /* segments of our part reduced */
    size_t n_links;
    struct link *links;
};

static size_t segs(const struct bf *b, size_t part)
{
    size_t len = b->off[part + 1] - b->off[part];

    return (len + b->seg - 1) / b->seg;
}

/* Segment k of part `part`: its first element and length. */
static size_t seg_base(const struct bf *b, size_t part, size_t k)
{
    return b->off[part] + k * b->seg;
}

static size_t seg_len(const struct bf *b, size_t part, size_t k)
{
    size_t left = b->off[part + 1] - seg_base(b, part, k);

    return left < b->seg ? left : b->seg;
}

/* Coded: where segment k of part `part` is encoded, and its length. */
static uint8_t *enc_at(const struct bf *b, size_t part, size_t k)
{
    return b->enc + b->enc_off[part] + k * b->cseg;
}

static size_t enc_len(const struct run *x, const struct bf *b, size_t part, size_t k)
{
    return codec_bytes(x->codec, seg_len(b, part, k));
}

size_t butterfly_needs(const struct run *x, size_t *need)
{
    size_t k = 0;

    for (size_t p = 0; p < x->n; p++)
        if (p != x->me && (x->parts[x->me] > 0 || x->parts[p] > 0))
            need[k++] = p;
    return k;
}

/* The sender whose contribution the reduction reads next: the ri-th
 * member other than us. */
static size_t sender(const struct run *x, size_t ri)
{
    return ri < x->me ? ri : ri + 1;
}

/* Starts link l's next send if it is due: a contribution at once, a
 * result once its segment is reduced. */
static void tx_next(struct run *x, struct bf *b, struct link *l)
{
    size_t contrib = segs(b, l->p), k = l->tx_k, base, len;
    struct peerwire_frame f;

    if (l->c->tx_busy || k == l->tx_n)
        return;
    if (k < contrib) {
        base = seg_base(b, l->p, k);
        len = seg_len(b, l->p, k);
        if (x->coded) {
            codec_encode(x->codec, enc_at(b, l->p, k), (const float *)x->src + base, len);
            f = conn_frame(x, PEERWIRE_PHASE_RS, 0, base, enc_len(x, b, l->p, k));
            conn_tx_start(l->c, &f, enc_at(b, l->p, k));
        } else {
            f = conn_frame(x, PEERWIRE_PHASE_RS, 0, base, len * x->esz);
            conn_tx_start(l->c, &f, x->src + base * x->esz);
        }
    } else {
        k -= contrib;
        if (k >= b->reduced)
            return;
        base = seg_base(b, x->me, k);
        len = seg_len(b, x->me, k);
        if (x->coded) {
            f = conn_frame(x, PEERWIRE_PHASE_AG, 0, base, enc_len(x, b, x->me, k));
            conn_tx_start(l->c, &f, enc_at(b, x->me, k));
        } else {
            f = conn_frame(x, PEERWIRE_PHASE_AG, 0, base, len * x->esz);
            conn_tx_start(l->c, &f, x->buf + base * x->esz);
        }
    }
    l->c->tx_since = clock_now_ms();
    l->tx_k++;
}

/* Starts link l's next receive if it is due: a contribution when the
 * reduction reads this sender's next, into the staging slot; a result
 * straight into its place. */
static void rx_next(struct run *x, struct bf *b, struct link *l)
{
    size_t mine = x->parts[x->me] ? segs(b, x->me) : 0, k = l->rx_k, base, len;
    struct peerwire_frame f;

    if (l->c->rx_busy || k == l->rx_n)
        return;
    if (k < mine) {
        if (b->rk != k || sender(x, b->ri) != l->p)
            return;
        len = seg_len(b, x->me, k);
        f = conn_frame(x, PEERWIRE_PHASE_RS, 0, seg_base(b, x->me, k),
                       x->coded ? enc_len(x, b, x->me, k) : len * x->esz);
        conn_rx_start(l->c, &f, x->a->stage);
    } else {
        k -= mine;
        base = seg_base(b, l->p, k);
        len = seg_len(b, l->p, k);
        if (x->coded) {
            f = conn_frame(x, PEERWIRE_PHASE_AG, 0, base, enc_len(x, b, l->p, k));
            conn_rx_start(l->c, &f, enc_at(b, l->p, k));
        } else {
            f = conn_frame(x, PEERWIRE_PHASE_AG, 0, base, len * x->esz);
            conn_rx_start(l->c, &f, x->buf + base * x->esz);
        }
    }
    l->c->rx_since = clock_now_ms();
}

/* A receive on l completed: fold a contribution in, and move the
 * reduction on; coded, decode a result into its place. */
static void rx_done(struct run *x, struct bf *b, struct link *l)
{
    size_t mine = x->parts[x->me] ? segs(b, x->me) : 0, k = l->rx_k++, len;
    uint8_t *dst, *got = x->a->stage;

    if (k >= mine) {
        k -= mine;
        if (x->coded)
            codec_decode(x->codec, (float *)x->buf + seg_base(b, l->p, k), enc_at(b, l->p, k),
                         seg_len(b, l->p, k));
        return;
    }
    len = seg_len(b, x->me, b->rk);
    dst = x->buf + seg_base(b, x->me, b->rk) * x->esz;
    if (x->coded) {
        /* The staging area's second segment: the decoded contribution. */
        got = x->a->stage + x->a->seg_bytes;
        codec_decode(x->codec, (float *)got, x->a->stage, len);
    }
    dtype_combine(x->acc, x->op, dst, got, len);
    if (++b->ri < x->n - 1)
        return;
    dtype_scale(x->acc, dst, len, x->div);
    if (x->coded) {
        /* Encoded once; we keep what every member will decode. */
        codec_encode(x->codec, enc_at(b, x->me, b->rk), (const float *)dst, len);
        codec_decode(x->codec, (float *)dst, enc_at(b, x->me, b->rk), len);
    }
    b->ri = 0;
    b->rk++;
    b->reduced++;
}

static bool all_done(const struct run *x, const struct bf *b)
{
    if (x->parts[x->me] && b->reduced < segs(b, x->me))
        return false;
    for (size_t i = 0; i < b->n_links; i++) {
        const struct link *l = &b->links[i];

        if (l->tx_k < l->tx_n || l->c->tx_busy || l->rx_k < l->rx_n)
            return false;
    }
    return true;
}

/* Sleeps until a busy connection can move, the epoch changes, or the
 * first silence deadline passes. */
static int bf_wait(struct run *x, struct bf *b)
{
    struct pollfd pfd[1 + MAX_NEED];
    uint64_t now = clock_now_ms(), d = UINT64_MAX;
    size_t blame = SIZE_MAX;
    nfds_t np = 0;
    int rc;

    pfd[np++] = (struct pollfd){ .fd = x->a->abort_fd, .events = POLLIN };
    for (size_t i = 0; i < b->n_links; i++) {
        struct link *l = &b->links[i];
        short ev = (short)((l->c->tx_busy ? POLLOUT : 0) | (l->c->rx_busy ? POLLIN : 0));
        uint64_t dl;

        if (!ev)
            continue;       /* idle: a hung-up descriptor would spin poll */
        conn_since_update(l->c, now);
        dl = conn_silence_deadline(x, l->c, false);
        if (dl < d) {
            d = dl;
            blame = l->p;
        }
        pfd[np++] = (struct pollfd){ .fd = l->c->fd, .events = ev };
    }
    if (np == 1) {
        /* Nothing in flight and nothing due: cannot happen (see the top);
         * fail rather than wait forever if it ever does. */
        return -EIO;
    }
    rc = conn_wait(x, pfd, np, d);
    if (rc == -ETIMEDOUT)
        x->fail_peer = blame;
    return rc;
}

static int bf_loop(struct run *x, struct bf *b);

int butterfly_run(struct run *x)
{
    struct allreduce *a = x->a;
    size_t off[MAX_NEED + 2];        /* n <= MAX_NEED + 1 (allreduce.c) */
    size_t enc_off[MAX_NEED + 2];
    struct link links[MAX_NEED];
    struct bf b = { .seg = a->seg_bytes / x->esz, .off = off, .links = links,
                    .enc_off = enc_off };
    size_t need[MAX_NEED];
    int rc;

    off[0] = 0;
    for (size_t i = 0; i < x->n; i++)
        off[i + 1] = off[i] + x->parts[i];
    if (x->coded) {
        /* Each part's whole segments and its last one, encoded. No sum
         * overflows: a segment's encoding is at most seg_bytes
         * (allreduce_run_parts_codec checks), so the whole is at most the
         * buffer's bytes plus a segment per part. */
        b.cseg = codec_bytes(x->codec, b.seg);
        enc_off[0] = 0;
        for (size_t j = 0; j < x->n; j++) {
            size_t ns = segs(&b, j);

            enc_off[j + 1] = enc_off[j];
            if (ns)
                enc_off[j + 1] += (ns - 1) * b.cseg + enc_len(x, &b, j, ns - 1);
        }
        b.enc = malloc(enc_off[x->n] ? enc_off[x->n] : 1);
        if (!b.enc)
            return -ENOMEM;
    }
    b.n_links = butterfly_needs(x, need);
    for (size_t i = 0; i < b.n_links; i++) {
        size_t p = need[i];
        size_t mine = x->parts[x->me] ? segs(&b, x->me) : 0, theirs = segs(&b, p);

        links[i] = (struct link){ .c = a->conns[p], .p = p, .tx_n = theirs + mine,
                                  .rx_n = mine + theirs };
    }
    /* Our own part starts as our contribution. */
    if (x->src != x->buf && x->parts[x->me])
        memcpy(x->buf + off[x->me] * x->esz, x->src + off[x->me] * x->esz,
               x->parts[x->me] * x->esz);
    rc = bf_loop(x, &b);
    free(b.enc);
    return rc;
}

/* Moves every link until the call is done or fails. */
static int bf_loop(struct run *x, struct bf *b)
{
    struct link *links = b->links;
    uint64_t spin_from = 0;
    int rc;

    for (;;) {
        bool moved = false;

        if (run_stale(x))
            return -ESTALE;
        for (size_t i = 0; i < b->n_links; i++) {
            struct link *l = &links[i];

            tx_next(x, b, l);
            if (l->c->tx_busy) {
                rc = conn_tx_pump(l->c);
                if (rc < 0) {
                    x->fail_peer = l->p;
                    return conn_refine(x, l->c, rc);
                }
                moved |= rc > 0;
            }
            rx_next(x, b, l);
            if (l->c->rx_busy) {
                rc = conn_rx_pump(x, l->c);
                if (rc < 0) {
                    x->fail_peer = l->p;
                    return rc;
                }
                moved |= rc > 0;
                if (!l->c->rx_busy) {
                    rx_done(x, b, l);
                    moved = true;
                }
            }
        }
        if (all_done(x, b))
            return 0;
        if (moved) {
            spin_from = 0;
            continue;
        }
        if (conn_spin(&spin_from))
            continue;
        rc = bf_wait(x, b);
        if (rc < 0)
            return rc;
    }
}

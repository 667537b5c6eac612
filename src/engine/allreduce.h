/* src/engine/allreduce.h: the data plane. An in-place all-reduce of a host buffer
 * among the members of the current epoch, over TCP, abortable by an epoch
 * change and bounded in time by a member timeout.
 *
 * Large reductions use a ring (reduce-scatter, then all-gather) pipelined
 * in segments; small ones use recursive doubling; a caller that gives each
 * member's part (allreduce_run_parts) gets a butterfly. Every member derives the
 * same schedule from the epoch's member order, so nothing is negotiated per
 * call. Results are bytewise identical on every member.
 *
 *   int fd; char addr[64];
 *   allreduce_listen("127.0.0.1", &fd, addr, sizeof addr);   // advertise addr
 *   struct allreduce_config cfg = { .cohort = "demo", .member_id = "w-0",
 *                                   .listen_fd = fd, .member_timeout_ms = 10000 };
 *   allreduce_create(&cfg, &ar);
 *   allreduce_set_epoch(ar, e);                  // from the membership watch
 *   int h = allreduce_register(ar, grads, bytes); // once
 *   for (round = 1;; round++)
 *       rc = allreduce_run(ar, h, n, DTYPE_F32, DTYPE_AVG, 0, round);
 *
 * Threads: run, register and unregister belong to one caller thread;
 * set_epoch may be called from any thread at any time, which is how an
 * in-flight run is aborted. */
#ifndef COHORT_ALLREDUCE_H
#define COHORT_ALLREDUCE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/secret.h"
#include "engine/codec.h"
#include "engine/dtype.h"
#include "membership/epoch.h"

struct allreduce;

#define ALLREDUCE_DEFAULT_TIMEOUT_MS 10000u
/* small_bytes that turns recursive doubling off: the ring for every size. */
#define ALLREDUCE_SMALL_NONE ((size_t)-1)
/* The largest small_bytes: recursive doubling's scratch is 2 x this and
 * a rider. */
#define ALLREDUCE_SMALL_MAX ((size_t)64 << 20)
/* The longest rider (allreduce_run_rider), in accumulation bytes: the
 * Accumulator's counters (13 of up to 64 float64 digits, 6.5 KiB) fit,
 * and so does the tail the ring folds into default segments on 4
 * members (4 x 4 KiB), so that there the ring's limit decides
 * (allreduce_same_exchanges). */
#define ALLREDUCE_RIDER_MAX_BYTES ((size_t)16 << 10)
#define ALLREDUCE_MAX_BUFFERS 1024
/* Members of a butterfly call (allreduce_run_parts) at most. */
#define ALLREDUCE_PARTS_MAX 256

struct allreduce_config {
    const char *cohort;             /* copied; must match every epoch's */
    const char *member_id;          /* copied; this member's id in the epochs */
    int listen_fd;                  /* borrowed: a bound, listening TCP socket, the
                                     * one whose address this member advertises; the
                                     * engine makes it non-blocking and accepts on it
                                     * until allreduce_destroy; the caller closes it
                                     * afterwards */
    uint32_t member_timeout_ms;     /* how long a peer may stay silent (send nothing,
                                     * or take nothing we send) before the call fails;
                                     * 0: ALLREDUCE_DEFAULT_TIMEOUT_MS. Set it above
                                     * the longest expected skew between members
                                     * reaching the same round. */
    size_t segment_bytes;           /* ring pipelining unit, a multiple of 8, at least
                                     * 8; 0: the measured default (allreduce.c) */
    size_t small_bytes;             /* all-reduces of at most this many bytes on the
                                     * wire (count x accumulation size, less a
                                     * rider) use recursive
                                     * doubling; 0: the measured default;
                                     * ALLREDUCE_SMALL_NONE: never; at most
                                     * ALLREDUCE_SMALL_MAX. The first all-reduce
                                     * each algorithm runs is logged (info), so
                                     * the choice shows in the member's log */
    const struct secret *key;       /* the cohort's key, copied; NULL: greetings
                                     * are not authenticated (tests, and cohorts
                                     * whose broker runs without a key). Keyed and
                                     * unkeyed members refuse each other. */
    bool integrity_mac;             /* authenticate every frame too (needs key; every
                                     * member must agree, or they refuse each other) */
    /* Called on the run's thread, after a run failed because a peer's
     * connection closed or reset with no BYE before it (its process died,
     * most likely), with the peer's id (borrowed for the call). May be
     * NULL. The membership layer passes it on to the broker as evidence
     * (member_report_lost). */
    void (*on_peer_lost)(void *arg, const char *peer_id);
    void *peer_lost_arg;            /* borrowed */
    /* Called on the run's thread, while a call waits, for a peer whose
     * host the kernel has not heard from for allreduce_set_unreachable_ms
     * (no byte, no acknowledgement, no keepalive answer on an open
     * connection, or a dial not answered): its host is cut off from this
     * one, or down. The call goes on waiting; the callback repeats every
     * such period while it lasts. With the epoch the call runs in, for
     * the broker (member_report_unreachable). May be NULL. */
    void (*on_peer_unreachable)(void *arg, const char *peer_id, uint64_t epoch);
    void *peer_unreachable_arg;     /* borrowed */
};

/* Binds a TCP listener to `host` (a numeric IPv4 or IPv6 address) on a
 * port the kernel picks, so ports are never raced. Sets *fd (the caller
 * closes it) and writes "host:port" ("[v6]:port") into address. Returns 0,
 * -EINVAL (bad host, or address too short), or the socket call's -errno. */
int allreduce_listen(const char *host, int *fd, char *address, size_t address_len);

/* Starts an engine with no epoch yet: it accepts connections at once and
 * holds greetings from members of epochs it has not adopted for up to the
 * member timeout. Allocates every scratch buffer it will ever need, once:
 * 8 staging slots of segment_bytes + 1/64 (a ring segment with a folded
 * tail: ring.c) and 2 x small_bytes and a rider for recursive doubling.
 * Draws the engine's random incarnation, which tells its greetings from
 * those of an earlier engine under the same id (acceptor.c).
 * Returns 0, -EINVAL (bad config: integrity_mac without a key, too),
 * -ENOMEM, or a thread/eventfd/getrandom -errno.
 * The caller owns *out and frees it with allreduce_destroy(). */
int allreduce_create(const struct allreduce_config *cfg, struct allreduce **out);

/* Sets how long a peer's host may go unheard before on_peer_unreachable
 * names it (the member timeout; at least 3000 ms, since keepalive probes
 * go out once a second: below that a lost probe would look like a cut),
 * and turns on the keepalives that make an idle connection answer. 0
 * turns reports off; connections opened while it was off keep no
 * keepalive. Thread-safe. */
void allreduce_set_unreachable_ms(struct allreduce *a, uint32_t ms);

/* Bounds the calls that follow: each wait of a run ends it with -ETIMEDOUT
 * once clock_now_ms() reaches deadline_ms, even where no peer has been
 * silent for the member timeout (a peer that refuses the greeting, a dial
 * that never completes). 0: only the member timeout bounds them. The
 * member timeout still bounds every silence within the deadline. Called by
 * the thread that runs the calls, between them. */
void allreduce_set_call_deadline(struct allreduce *a, uint64_t deadline_ms);

/* Stops the acceptor and closes every connection. No run may be in flight.
 * NULL is fine. The listening fd stays open (it is the caller's). */
void allreduce_destroy(struct allreduce *a);

/* Adopts `e`, which must be for this cohort and newer than the current
 * epoch (the same number again is accepted and changes nothing). Takes its
 * own reference; the caller keeps theirs. An in-flight run stops promptly
 * and returns -ESTALE; connections of the old epoch are closed, telling the
 * peers at the other end that the epoch changed. Safe from any thread.
 * Returns 0 or -EINVAL (NULL, other cohort, older epoch). */
int allreduce_set_epoch(struct allreduce *a, struct epoch *e);

/* Registers `bytes` at `buf` (borrowed until unregistered or destroy;
 * 8-byte aligned) for in-place all-reduces. Nothing payload-sized is
 * allocated, now or per call. Returns a handle >= 0, -EINVAL (NULL buffer
 * with bytes > 0, misaligned), or -ENOSPC (ALLREDUCE_MAX_BUFFERS in use). */
int allreduce_register(struct allreduce *a, void *buf, size_t bytes);
/* Returns 0 or -EINVAL (not a registered handle). */
int allreduce_unregister(struct allreduce *a, int handle);

/* All-reduces the first `count` elements of the registered buffer, in
 * place, among the members of the current epoch, who must all make the same
 * call (count, type, op, denominator, round). `round` names the call in
 * every frame; give each call a new one. `denominator` is used by
 * DTYPE_AVG_BY only (see dtype.h for rounding). Blocks until done.
 *
 * Returns 0 only when the whole buffer holds the result, identical on
 * every member. Otherwise the buffer's contents are unspecified and:
 *   -ESTALE      the epoch changed, here or at a peer, or this member is not
 *                in the current epoch (or none was adopted yet): retry once
 *                allreduce_set_epoch has given this engine a newer epoch;
 *   -ETIMEDOUT   a peer stayed silent past the member timeout (stopped,
 *                stuck, or not reading), here or further along the ring;
 *   -ECONNRESET  a peer's connection closed or reset (it died, or gave up
 *                this round), or it refused to connect;
 *   -EPIPE       the same, seen while sending;
 *   -EPROTO      a member sent a frame that does not match this call
 *                (members disagree on round, count, type or op), or with
 *                integrity_mac a frame whose MAC does not verify (changed
 *                on the way), or a greeting's answer made no sense;
 *   -EACCES      a member this one dials refused its greeting (key or
 *                integrity settings differ) or could not prove the cohort
 *                key; both ends log why;
 *   -EINVAL      misuse: bad handle, count beyond the registration, bad
 *                type, op or denominator;
 *   -EBUSY       another run is in flight on this engine.
 * With a single member it returns at once (avg by members: the input;
 * avg by a denominator: the input divided by it, as mlbench does). */
int allreduce_run(struct allreduce *a, int handle, size_t count, enum dtype type,
                  enum dtype_op op, double denominator, uint64_t round);

/* allreduce_run out of place: the contributions are read from registered
 * buffer `in`, which is never written, and the result lands in `out`
 * (in == out is allreduce_run). Whatever the outcome `in` still holds this
 * member's contribution, so a failed call can be retried in a new epoch
 * without a copy kept aside. Same returns; -EINVAL also when count exceeds
 * either registration. */
int allreduce_run_into(struct allreduce *a, int in, int out, size_t count, enum dtype type,
                       enum dtype_op op, double denominator, uint64_t round);

/* allreduce_run_into whose last `rider` of the count elements are values
 * that travel with a payload, such as the Accumulator's counters behind
 * its gradients: reduced as the rest, but the algorithm is chosen for the
 * count - rider elements before them, so a rider never moves a call from
 * recursive doubling to the ring. Every member must give the same rider.
 * Same returns; -EINVAL also when rider exceeds count or
 * ALLREDUCE_RIDER_MAX_BYTES of accumulation (dtype_acc) elements. */
int allreduce_run_rider(struct allreduce *a, int in, int out, size_t count, size_t rider,
                        enum dtype type, enum dtype_op op, double denominator, uint64_t round);

/* allreduce_run_into with the payloads compressed by `codec`
 * (engine/codec.h), which every member must give alike: data on the wire
 * is encoded, accumulation is float32, and the result is identical on
 * every member. The result is decode(encode(r)) of the float32 reduction
 * r (the member that finishes a chunk keeps the decoded bytes of what it
 * sends), so every result value is one the codec represents; partial
 * sums are encoded at every hop, so with n members an element carries up
 * to n - 1 encodings in its sum and one at the end. The algorithm is
 * chosen as without a codec (by uncompressed bytes). CODEC_NONE is
 * allreduce_run_into. Same returns; -EINVAL also for an unknown codec or
 * one that does not take the type (codec_supports: only float32), or one
 * whose encoding of a whole segment outgrows it (meanstd16 with
 * segment_bytes 8, uniform8 or quantile8 below 1368); -EPROTO
 * also when a member's frames name another codec, which both ends log
 * with the two codecs. */
int allreduce_run_codec(struct allreduce *a, int in, int out, size_t count, enum dtype type,
                        enum dtype_op op, double denominator, enum codec codec, uint64_t round);

/* allreduce_run_into as a butterfly (hivemind's): the buffer is cut into
 * one contiguous part per member of the current epoch, parts[i] elements
 * for member i in the epoch's order, and member i reduces part i: every
 * member sends part i of its contribution to member i, which sums the
 * contributions (its own first, then the others' in member order),
 * applies op, and sends the result back to every member. Results are
 * identical on every member. A member whose part is 0 reduces nothing and
 * talks only to members with a part; members with no part placed before
 * every member with one are never dialled and accept no connection
 * (hivemind's client mode: they may sit behind NAT). Every member gives
 * the same n_parts and parts (allreduce_split computes them alike);
 * parts is borrowed for the call.
 * 16-bit types are not taken (they would need float32 staging of a whole
 * part).
 *
 * Returns allreduce_run's codes; -EINVAL also when the parts do not sum
 * to count, all are 0 (with count > 0), n_parts exceeds
 * ALLREDUCE_PARTS_MAX, or the type is 16-bit; -ESTALE also when n_parts is
 * not the current epoch's member count (the epoch changed). */
int allreduce_run_parts(struct allreduce *a, int in, int out, size_t count, enum dtype type,
                        enum dtype_op op, double denominator, const size_t *parts,
                        size_t n_parts, uint64_t round);

/* allreduce_run_parts with payloads encoded by `codec`, as
 * allreduce_run_codec does for the ring: every contribution travels
 * encoded, each part's owner sums the decoded contributions in float32
 * with its own, encodes the result once and decodes it itself, and every
 * member decodes those same bytes, so results are identical on every
 * member (and carry two encodings' error: a contribution's and the
 * result's). Every member gives the same codec. CODEC_NONE is
 * allreduce_run_parts. The call holds the encoding of the whole buffer
 * (codec_bytes per segment) while it runs. Same returns as
 * allreduce_run_parts; -EINVAL also as allreduce_run_codec's (a codec
 * that does not take the type, or whose segment outgrows it); -ENOMEM
 * when the encoding's buffer cannot be had. */
int allreduce_run_parts_codec(struct allreduce *a, int in, int out, size_t count,
                              enum dtype type, enum dtype_op op, double denominator,
                              const size_t *parts, size_t n_parts, enum codec codec,
                              uint64_t round);

/* Splits `count` elements among n members by their bandwidths, into
 * parts[0..n), as hivemind's load_balance_peers does: a bandwidth of 0
 * gets nothing; a negative one means "not given" and counts as the mean
 * of the positive ones given, or, when none is, those not given share
 * alike. With a bandwidth given and more than two members the shares are
 * the solution of hivemind's linear program (the split that ends a
 * butterfly round soonest, allreduce.c says how it is solved), where a
 * member too slow to be worth reducing gets nothing; with two, every
 * split takes as long, and shares follow the bandwidths. Whole elements
 * are handed out by the Hagenbach-Bischoff rule hivemind uses:
 * floor(count x share) each, then one at a time to the largest share /
 * (parts + 1), the lowest index on a tie. With min_part
 * (hivemind's min_vector_size), shares worth fewer than min_part elements
 * go to 0 first, unless every share is that small. Deterministic
 * (IEEE double arithmetic only), so every member computes the same parts.
 * Writes n entries of parts (the caller's); reads bandwidth. Returns 0,
 * -EINVAL (n of 0 or over ALLREDUCE_PARTS_MAX, a bandwidth that is NaN or
 * infinite) or -ENODATA (every bandwidth is 0: nobody would reduce). */
int allreduce_split(size_t count, const double *bandwidth, size_t n, size_t min_part,
                    size_t *parts);

/* All-gathers a block of `block_bytes` (a multiple of 4) from the start
 * of registered buffer `in` from every member of the current epoch: member
 * i's block lands at out + i x block_bytes, for every i in the epoch's
 * member order, identical on every member. All members make the same call
 * (block_bytes, round). Sets *members and *index (either may be NULL) to
 * the epoch's member count and this member's place in it whenever the
 * call got that far, so a caller can size `out` and retry. `in` may be
 * `out` (the block moves to its place first). Top-k compression
 * (engine/topk.h) exchanges its pairs with it.
 *
 * Returns allreduce_run's codes, and -ENOSPC when `out` holds fewer than
 * members x block_bytes; that is found before this member sends a byte,
 * and the peers see its call fail (-ECONNRESET or -ETIMEDOUT), as when a
 * member gives up; size `out` from allreduce_members() first. -EINVAL also
 * for a block_bytes that is not a multiple of 4 or exceeds `in`. */
int allreduce_gather(struct allreduce *a, int in, int out, size_t block_bytes, uint64_t round,
                     size_t *members, size_t *index);

/* The member count of the current epoch, 0 when none was adopted or this
 * member is not in it. Safe from any thread; the epoch may change right
 * after, which the next call then finds (-ESTALE or -ENOSPC). */
size_t allreduce_members(struct allreduce *a);

/* True while a run is in flight (for status and tests). */
bool allreduce_busy(const struct allreduce *a);

/* Whether an uncompressed all-reduce of count + extra elements of `type`
 * among n members, out of place (`into`) or in place, the extra ones a
 * rider (allreduce_run_rider), makes as many exchanges as one of `count`:
 * the same algorithm, which a rider never changes (false for one too long
 * to be a rider), and for the ring as many segments. The ring folds a tail of
 * up to 1/64 of a segment per chunk into the segments before it (ring.c,
 * "Folding a tail"), so a few elements appended to a buffer whose chunks
 * are whole segments add none; more would add a short one to every
 * step. 16-bit types are not counted (false beyond recursive doubling).
 * For a caller that can carry a few values with a buffer or in a call of
 * their own (the Accumulator's counters). */
bool allreduce_same_exchanges(const struct allreduce *a, size_t n, size_t count, size_t extra,
                              enum dtype type, bool into);

#endif

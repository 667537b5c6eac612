/* src/accumulator/lineage.h: which epoch committed each of a member's
 * recent model versions.
 *
 * A member that falls behind the leader may hold contributions it made
 * for the round after its own version. They are in the leader's state
 * only if that round was committed in the very epoch in which this member
 * last reduced them (it took part in the round's last step, and the others
 * finished it while it missed the result); a round committed in another
 * epoch, by members it was not among, never saw them. The version alone
 * cannot tell these apart (seed 1015 in docs/chaos.md), so every member
 * keeps this record, the leader sends its own with its state, and the
 * receiver checks its pending round against it and adopts it.
 *
 * Commits of one epoch are consecutive versions, so the record is a short
 * list of runs (epoch, first version, last version), the newest last;
 * versions at or below `base` are not known (the record starts at a
 * version the trainer declared or a checkpoint gave, or older runs were
 * let go). Plain data; the caller owns it. */
#ifndef COHORT_LINEAGE_H
#define COHORT_LINEAGE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct epoch;

/* Runs kept: a member more than this many committing epochs behind the
 * leader cannot be told where its round went (see lineage_holds). */
#define LINEAGE_RUNS 32
/* int64 words of lineage_encode's form: base, count, then three per run. */
#define LINEAGE_WORDS (2 + 3 * LINEAGE_RUNS)

struct lineage_run {
    uint64_t epoch;     /* lineage_epoch_id() of the epoch that committed them */
    uint64_t first, last;
};

struct lineage {
    uint64_t base;      /* versions up to this one: not known */
    uint32_t n;
    struct lineage_run runs[LINEAGE_RUNS];
};

enum lineage_answer {
    LINEAGE_YES,        /* committed in that epoch */
    LINEAGE_NO,         /* committed in another epoch, or not committed */
    LINEAGE_UNKNOWN,    /* at or below base: nobody can say */
};

/* The epoch of a commit made while a newer epoch had already reached the
 * engine: the engine runs a step among the members of the epoch it has,
 * so the step may have run in either, and a lone member's step completes
 * at once. lineage_holds answers LINEAGE_UNKNOWN for such versions. */
#define LINEAGE_UNSURE UINT64_MAX

/* An id for an epoch that tells apart two epochs of the same number from
 * different brokers (a restarted broker may reuse a number): a hash of
 * the number, the member ids and their data addresses. Never 0 or
 * LINEAGE_UNSURE. */
uint64_t lineage_epoch_id(const struct epoch *e);

/* Starts an empty record at `version` (nothing below it known). */
void lineage_reset(struct lineage *l, uint64_t version);

/* Records that `version` was committed in epoch `epoch_id`. A version
 * that does not follow the newest one recorded starts the record again
 * at version - 1 (the version moved by other means). */
void lineage_commit(struct lineage *l, uint64_t epoch_id, uint64_t version);

/* Whether `version` was committed in epoch `epoch_id`, by this record.
 * A version above the newest recorded is LINEAGE_NO: the state this
 * record describes does not hold it. */
enum lineage_answer lineage_holds(const struct lineage *l, uint64_t version, uint64_t epoch_id);

/* The record as LINEAGE_WORDS words, for a broadcast. */
void lineage_encode(const struct lineage *l, int64_t *words);
/* Reads words received from a peer. Returns 0, or -EPROTO (a count over
 * LINEAGE_RUNS, a run that is empty, does not follow the one before or
 * starts at or below base), leaving *l unchanged. */
int lineage_decode(const int64_t *words, struct lineage *l);

#endif

/* tests/unit/test_node.c: the Accumulator's rounds among nodes in one
 * process, over a real broker and real TCP on loopback. Each simulated
 * trainer follows moolib's loop; gradients are small integers so every
 * committed result can be checked exactly. */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/clock.h"
#include "fixture.h"
#include "accumulator/ckpt.h"
#include "accumulator/compress.h"
#include "accumulator/layout.h"
#include "accumulator/node.h"
#include "engine/topk.h"
#include "membership/broker.h"
#include "membership/brokerd.h"

#define P 1031                  /* parameters: a prime, not a multiple of anything */
#define MAXN 6
#define APPLIED_LOG 128

static struct brokerd *d;
static char broker[64];
/* Trainers started while this is set keep checkpoints there, every
 * CKPT_EVERY versions. */
static const char *ckpt_dir;
#define CKPT_EVERY 5
/* Trainers started while this is set start with a budget of 0
 * contributions (trainer.budget), so a test places each one. */
static bool start_held;
/* The trainer started while this is set (w-0) keeps its trace there. */
static struct node_trace *trace_next;
/* Trainers started while these are set take them as their pause_at and
 * pause_until, and with linger_next linger (trainer.linger). Set before
 * the trainer's thread starts: once it runs, a loaded machine may take it
 * past any version the test meant to stop it at. */
static uint64_t pause_next_at;
static uint32_t pause_next_until;
static bool linger_next;
/* Trainers started while this is set take it as their engine's silence
 * timeout (node_config.reduce_timeout_ms); 0: 20 s. */
static uint32_t reduce_timeout_next;
/* Trainers started while spare[index] is set give the node room after
 * their gradients and results (node_tensors.grads_spare), as cohort.c
 * does; the others give none. */
static bool spare[MAXN];
#define SPARE_FLOATS 1024               /* TLINK_SPARE_BYTES */
#define VERSIONS 64             /* results recorded per trainer, by version */

/* The fixture's broker with a startup hold: the trainers a test starts
 * together land in one first epoch (see trainer_main). */
static void start(void)
{
    d = fixture_held_broker_start("train", broker, sizeof(broker));
}

static void stop(void)
{
    fixture_broker_stop(d);
}

TestSuite(node, .init = start, .fini = stop, .timeout = 180);

struct trainer {
    int index;
    struct node *n;
    _Alignas(64) float params[P + 1];   /* padded to a multiple of 8 bytes */
    _Alignas(64) float grads[P + SPARE_FLOATS];     /* P, then room for the node */
    _Alignas(64) float results[P + SPARE_FLOATS];
    _Alignas(64) double buffers[2];
    uint64_t target;                    /* stop at this model version */
    uint32_t together;                  /* members to wait for before training */
    uint64_t pause_at;                  /* from this version (0: never), contribute */
    uint32_t pause_until;               /* only in epochs of this many members */
    bool linger;                        /* at the target, keep answering until quit */
    atomic_bool at_target;              /* reached its target (lingering or done) */
    bool started;                       /* an epoch had them: contributing */
    atomic_int budget;                  /* contributions left to make; -1: no limit */
    atomic_int made;                    /* contributions made (accepted) */
    atomic_bool quit;
    pthread_t t;
    /* What it saw. */
    uint64_t applied;                   /* results applied */
    uint64_t sum_check_failures;
    uint64_t states;
    char last_state[64];                /* the opaque state last received */
    uint64_t highest;                   /* the highest model version seen */
    bool went_back;                     /* a later view had a lower one */
    /* Each result applied, in order: its mean and the model version it
     * made (the first APPLIED_LOG). A round's mix of contributions is the
     * machine's timing, so exact parameters are recomputed from these. */
    float applied_mean[APPLIED_LOG];
    uint64_t applied_at[APPLIED_LOG];
    /* Per committed version it applied: the result and its count. */
    float result_at[VERSIONS];
    uint64_t gradients_at[VERSIONS];
    atomic_uint_fast64_t applied_version;   /* the newest it applied */
};

/* moolib's loop. Each contribution adds (index + 1) to every gradient
 * element, with batch size 1: a committed result is then exactly the mean
 * of (index + 1) over the contributions it reduced.
 *
 * The first contribution waits for an epoch of tr->together members. A
 * trainer that found itself alone in the first epoch (its peers joined
 * after the broker's startup hold, on a loaded machine) would otherwise
 * train alone, dozens of rounds in a few milliseconds, and the test would
 * no longer be about the cohort it started. */
static void *trainer_main(void *arg)
{
    struct trainer *tr = arg;
    struct node_view v;

    while (!atomic_load(&tr->quit)) {
        bool done;

        node_view(tr->n, &v);
        if (v.model_version < tr->highest)
            tr->went_back = true;
        if (v.model_version > tr->highest)
            tr->highest = v.model_version;
        /* First, so that a joiner whose sync brought it to the target
         * still counts the state it received. */
        if (v.has_new_state) {
            void *s;
            size_t len;
            if (node_take_state(tr->n, &s, &len) == 0) {
                tr->states++;
                snprintf(tr->last_state, sizeof(tr->last_state), "%.*s", (int)len, (char *)s);
                free(s);
            }
        }
        /* At the target a trainer stops contributing. A lingering one
         * still answers its node: a joiner admitted after the cohort got
         * there syncs from the leader's trainer, and one that had left
         * its loop would stall every epoch (each sync timing out). */
        done = v.model_version >= tr->target && !v.has_gradients;
        if (done) {
            atomic_store(&tr->at_target, true);
            if (!tr->linger)
                break;
        }
        if (!v.connected) {
            clock_sleep_ms(2);
            continue;
        }
        if (v.wants_state) {
            char s[64];
            snprintf(s, sizeof(s), "state of %d at %llu", tr->index, (unsigned long long)v.model_version);
            node_set_state(tr->n, s, strlen(s) + 1);
        }
        if (v.has_gradients) {
            /* The mean of (index + 1) over contributions: a multiple of
             * 1/num_gradients, between 1 and MAXN. */
            float g = tr->results[0];
            double scaled = (double)g * (double)v.num_gradients;
            if (fabs(scaled - round(scaled)) > 1e-3 || g < 1.0f || g > (float)MAXN)
                tr->sum_check_failures++;
            for (int i = 0; i < P; i++) {
                if (tr->results[i] != g)
                    tr->sum_check_failures++;
                tr->params[i] -= 0.01f * tr->results[i];
            }
            if (tr->applied < APPLIED_LOG) {
            tr->applied_mean[tr->applied] = g;
            tr->applied_at[tr->applied] = v.model_version;
        }
        tr->buffers[0] += 1;
            if (v.model_version < VERSIONS) {
                tr->result_at[v.model_version] = g;
                tr->gradients_at[v.model_version] = v.num_gradients;
            }
            atomic_store(&tr->applied_version, v.model_version);
            tr->buffers[0] += 1;
            /* Drift early on, each its own value; the periodic sync (every
             * 5 commits) must bring everyone back to the leader's. */
            if (v.model_version < 8)
                tr->buffers[1] = tr->index;
            tr->applied++;
            memset(tr->grads, 0, sizeof(tr->grads));
            if (node_consume(tr->n, v.rounds_committed) < 0)
                tr->sum_check_failures++;
        } else if (!done && v.wants_gradients && (tr->started || v.size >= tr->together) &&
                   !(tr->pause_at && v.model_version >= tr->pause_at && v.size < tr->pause_until) &&
                   atomic_load(&tr->budget) != 0) {
            tr->started = true;
            for (int i = 0; i < P; i++)
                tr->grads[i] += (float)(tr->index + 1);
            if (node_contribute(tr->n, 1) == 0) {
                atomic_fetch_add(&tr->made, 1);
                if (atomic_load(&tr->budget) > 0)
                    atomic_fetch_sub(&tr->budget, 1);
            } else {
                /* Refused (-EAGAIN: the next view zeroes them): not made. */
                for (int i = 0; i < P; i++)
                    tr->grads[i] -= (float)(tr->index + 1);
            }
        } else {
            clock_sleep_ms(1);
        }
    }
    return NULL;
}

/* Trainer w-<index>'s node, started and registered, with no loop: the
 * test drives it (trainer_start runs moolib's loop on it). */
static void trainer_open(struct trainer *tr, int index, uint64_t target, uint32_t together)
{
    struct node_config c = { .broker = broker, .cohort = "train", .host = "127.0.0.1",
                             .reduce_timeout_ms = reduce_timeout_next ? reduce_timeout_next : 20000,
                             .buffer_sync_rounds = 5, .checkpoint_dir = ckpt_dir,
                             .checkpoint_every_versions = ckpt_dir ? CKPT_EVERY : 0,
                             .trace = index == 0 ? trace_next : NULL };
    struct node_tensors t;
    char id[16];

    memset(tr, 0, sizeof(*tr));
    tr->index = index;
    tr->target = target;
    tr->together = together;
    tr->pause_at = pause_next_at;
    tr->pause_until = pause_next_until;
    tr->linger = linger_next;
    atomic_store(&tr->budget, start_held ? 0 : -1);
    /* Different initial parameters: state sync must make them equal. */
    for (int i = 0; i < P; i++)
        tr->params[i] = (float)(index * 1000 + i);
    snprintf(id, sizeof(id), "w-%d", index);
    c.id = id;
    cr_assert_eq(node_start(&c, &tr->n), 0);
    t = (struct node_tensors){ .params = tr->params, .params_bytes = sizeof(tr->params),
                               .grads = tr->grads, .grad_count = P, .grad_type = DTYPE_F32,
                               .results = tr->results,
                               .buffers = tr->buffers, .buffers_bytes = sizeof(tr->buffers),
                               .grads_spare = spare[index] ? SPARE_FLOATS * sizeof(float) : 0,
                               .results_spare = spare[index] ? SPARE_FLOATS * sizeof(float) : 0 };
    cr_assert_eq(node_register(tr->n, &t), 0);
    cr_assert_eq(node_register(tr->n, &t), -EBUSY);
}

/* Trainer w-<index>, training to model version `target` once an epoch has
 * `together` members. Its loop ends at the target (or on tr->quit); the
 * caller joins it with trainer_join() and stops its node with node_stop(). */
static void trainer_start(struct trainer *tr, int index, uint64_t target, uint32_t together)
{
    trainer_open(tr, index, target, together);
    pthread_create(&tr->t, NULL, trainer_main, tr);
}

static void trainer_join(struct trainer *tr)
{
    pthread_join(tr->t, NULL);
}

/* Trainers w-0 .. w-(n-1) in trs[], training together to model version
 * `target` with virtual batch size vbs. Each stops its own loop at the
 * target; trainers_stop() stops their nodes. */
static void trainers_start(struct trainer *trs, int n, uint64_t target, uint64_t vbs)
{
    for (int i = 0; i < n; i++)
        trainer_start(&trs[i], i, target, (uint32_t)n);
    for (int i = 0; i < n; i++)
        node_set_virtual_batch_size(trs[i].n, vbs);
}

static void trainers_join(struct trainer *trs, int n)
{
    for (int i = 0; i < n; i++)
        trainer_join(&trs[i]);
}

static void trainers_stop(struct trainer *trs, int n)
{
    for (int i = 0; i < n; i++)
        node_stop(trs[i].n);
}

Test(node, three_trainers_commit_identical_rounds)
{
    static struct trainer trs[3];
    struct node_view v0, v;

    trainers_start(trs, 3, 15, 3);      /* one contribution from each per round */
    trainers_join(trs, 3);
    node_view(trs[0].n, &v0);
    cr_assert_eq(v0.model_version, 15);
    for (int i = 0; i < 3; i++) {
        node_view(trs[i].n, &v);
        cr_assert_eq(v.model_version, 15, "w-%d at %llu", i, (unsigned long long)v.model_version);
        cr_assert_eq(trs[i].sum_check_failures, 0, "w-%d got a result that is no mean", i);
        cr_assert_eq(memcmp(trs[i].params, trs[0].params, sizeof(trs[0].params)), 0,
                     "w-%d's parameters differ from w-0's", i);
        cr_assert_str_eq(v.leader, "w-0");
    }
    /* With one contribution each per round, each result is exactly 2.0,
     * the mean of 1, 2 and 3: nothing lost, nothing twice. */
    cr_assert_eq(v0.num_gradients, 3);
    cr_assert_eq(v0.batch_size, 3);
    /* Buffers drifted until version 8; the syncs at commits 10 and 15 of
     * the epoch gave everyone the leader's (w-0 wrote 0). */
    for (int i = 0; i < 3; i++)
        cr_assert_eq(trs[i].buffers[1], 0.0, "w-%d's buffers were not synced from the leader", i);
    for (int i = 1; i < 3; i++)
        cr_assert_geq(trs[i].states, 1, "w-%d never received the leader's state", i);
    trainers_stop(trs, 3);
}

Test(node, virtual_batch_spans_several_contributions)
{
    static struct trainer trs[2];
    struct node_view v;

    trainers_start(trs, 2, 5, 6);       /* three contributions from each per round */
    trainers_join(trs, 2);
    node_view(trs[1].n, &v);
    cr_assert_eq(v.model_version, 5);
    cr_assert_eq(v.batch_size, 6);
    cr_assert_eq(v.num_gradients, 6);
    cr_assert_eq(memcmp(trs[0].params, trs[1].params, sizeof(trs[0].params)), 0);
    /* Each trainer adds index+1 per contribution, three times: the mean
     * over six contributions of (1,1,1,2,2,2) is 1.5 per element, and the
     * parameters moved by 0.015 per round. */
    cr_assert_eq(trs[0].sum_check_failures + trs[1].sum_check_failures, 0);
    cr_assert_float_eq(trs[0].params[0], 0.0f - 5 * 0.015f, 1e-4);
    trainers_stop(trs, 2);
}

/* The trace (node_config.trace) has a row per committed round but the
 * last, with the stages of the round's kind: a fused round has no count
 * step; rounds of several contributions each have count steps and an
 * unfused gradient step. The times are real ones: each round's stages
 * together fit inside the test's own time. */
static void traced_rounds(uint64_t vbs, bool fused)
{
    static struct trainer trs[2];
    static uint64_t rows[64][NODE_STAGES];
    struct node_trace trace = { .ns = rows, .cap = 64 };
    uint64_t t0 = clock_now_us(), took_ns;
    struct node_view v;
    size_t tried_fused = 0;

    memset(rows, 0, sizeof(rows));
    trace_next = &trace;
    trainers_start(trs, 2, 12, vbs);
    trace_next = NULL;
    trainers_join(trs, 2);
    node_view(trs[0].n, &v);
    trainers_stop(trs, 2);
    took_ns = (clock_now_us() - t0) * 1000;
    /* w-0 trains on from its first result; the rows are those of rounds
     * followed by another contribution. */
    cr_assert_geq(trace.rounds, 10, "%zu rows", trace.rounds);
    cr_assert_leq(trace.rounds, 11, "%zu rows", trace.rounds);
    for (size_t r = 0; r < trace.rounds; r++) {
        uint64_t sum = 0;

        for (int s = 0; s < NODE_STAGES; s++)
            sum += rows[r][s];
        cr_assert_gt(rows[r][NODE_STAGE_ENGINE], 0, "round %zu", r);
        cr_assert_gt(rows[r][NODE_STAGE_APPLY], 0, "round %zu", r);
        cr_assert_gt(rows[r][NODE_STAGE_NEXT], 0, "round %zu", r);
        cr_assert_lt(sum, took_ns, "round %zu: %llu ns of %llu", r, (unsigned long long)sum,
                     (unsigned long long)took_ns);
        if (fused) {
            cr_assert_eq(rows[r][NODE_STAGE_COUNT], 0, "round %zu", r);
            cr_assert_gt(rows[r][NODE_STAGE_COPY_IN], 0, "round %zu", r);
        } else {
            cr_assert_gt(rows[r][NODE_STAGE_COUNT], 0, "round %zu", r);
            cr_assert_eq(rows[r][NODE_STAGE_COPY_OUT], 0, "round %zu", r);
            /* The first round of an epoch tries a fused step, whose sum
             * is thrown away when the batch is short. */
            tried_fused += rows[r][NODE_STAGE_COPY_IN] > 0;
        }
    }
    cr_assert_leq(tried_fused, v.epochs_seen);
    cr_assert_str_eq(node_stage_name(NODE_STAGE_COUNT), "count");
    cr_assert_str_eq(node_stage_name(NODE_STAGES), "?");
}

Test(node, trace_has_the_stages_of_fused_rounds)
{
    traced_rounds(2, true);             /* one contribution each: every round fused */
}

Test(node, trace_has_the_stages_of_counted_rounds)
{
    traced_rounds(6, false);            /* three each: count steps, then the gradients */
}

static bool reached_version_10(void *node)
{
    struct node_view v;

    node_view(node, &v);
    return v.model_version >= 10;
}

/* Rounds with the counters in the spare bytes: after the epoch's first
 * round, each is one all-reduce with no count step and no copy, and the
 * results are exact. With room on one member only, none is taken. */
static void spare_rounds(int with_room, uint64_t vbs)
{
    static struct trainer trs[3];
    static uint64_t rows[64][NODE_STAGES];
    struct node_trace trace = { .ns = rows, .cap = 64 };
    size_t one_step = 0;
    struct node_view v;

    memset(rows, 0, sizeof(rows));
    for (int i = 0; i < 3; i++)
        spare[i] = i < with_room;
    trace_next = &trace;
    trainers_start(trs, 3, 15, vbs);
    trace_next = NULL;
    memset(spare, 0, sizeof(spare));
    trainers_join(trs, 3);
    for (int i = 0; i < 3; i++) {
        node_view(trs[i].n, &v);
        cr_assert_eq(v.model_version, 15, "w-%d at %llu", i, (unsigned long long)v.model_version);
        cr_assert_eq(trs[i].sum_check_failures, 0, "w-%d got a result that is no mean", i);
        cr_assert_eq(memcmp(trs[i].params, trs[0].params, sizeof(trs[0].params)), 0,
                     "w-%d's parameters differ from w-0's", i);
        /* Each result exactly the mean of its contributions: 2.0 with
         * one from each of 1, 2, 3 (vbs 3), or (1+1+2+2+3+3)/6 (vbs 6). */
        for (uint64_t k = 2; k <= 15; k++)
            cr_assert_eq(trs[i].result_at[k], 2.0f, "w-%d, version %llu: %f", i,
                         (unsigned long long)k, trs[i].result_at[k]);
    }
    node_view(trs[0].n, &v);
    trainers_stop(trs, 3);
    /* The fused step copies its sum out; a spare step needs no copy and
     * no count step. */
    for (size_t r = 0; r < trace.rounds; r++)
        one_step += rows[r][NODE_STAGE_COUNT] == 0 && rows[r][NODE_STAGE_COPY_OUT] == 0;
    if (with_room == 3 && vbs == 3) {
        /* All but the first round of each epoch. */
        cr_assert_geq(trace.rounds, 13, "%zu rows", trace.rounds);
        cr_assert_geq(one_step + v.epochs_seen, trace.rounds, "%zu of %zu rows, %llu epochs",
                      one_step, trace.rounds, (unsigned long long)v.epochs_seen);
    } else {
        cr_assert_eq(one_step, 0, "%zu spare steps", one_step);
    }
}

Test(node, spare_bytes_carry_the_counters_in_one_all_reduce)
{
    spare_rounds(3, 3);
}

Test(node, spare_bytes_on_one_member_only_are_not_used)
{
    spare_rounds(1, 3);
}

Test(node, spare_bytes_wait_for_a_round_of_one_contribution_each)
{
    spare_rounds(3, 6);
}

/* With room (spare bytes), rounds between the epoch changes carry their
 * counters there, and a step aborted by the change is retried with a
 * count step in the new epoch. */
static void leave_and_join(bool with_room)
{
    static struct trainer trs[4];
    static uint64_t rows[64][NODE_STAGES];
    struct node_trace trace = { .ns = rows, .cap = 64 };
    struct node_view v;
    uint64_t epoch_before;
    size_t one_step = 0;

    for (int i = 0; i < 4; i++)
        spare[i] = with_room;
    trace_next = &trace;
    /* On a loaded machine w-0 and w-2 may reach 40 before the joiner is
     * in an epoch: lingering, they still serve its sync. */
    linger_next = true;
    trainers_start(trs, 3, 40, 1);
    linger_next = false;
    trace_next = NULL;
    /* Let training run, then take w-1 away mid-run. */
    cr_assert(fixture_wait_until(reached_version_10, trs[0].n, 60000),
              "w-0 never reached model version 10");
    node_view(trs[0].n, &v);
    epoch_before = v.epoch;
    atomic_store(&trs[1].quit, true);
    trainer_join(&trs[1]);
    node_stop(trs[1].n);
    /* A newcomer with other parameters joins and must catch up. */
    trainer_start(&trs[3], 3, 40, 3);
    memset(spare, 0, sizeof(spare));
    node_set_virtual_batch_size(trs[3].n, 1);
    trainer_join(&trs[3]);
    FIXTURE_WAIT_FOR(atomic_load(&trs[0].at_target) && atomic_load(&trs[2].at_target),
                     "w-0 and w-2 never reached 40");
    atomic_store(&trs[0].quit, true);
    atomic_store(&trs[2].quit, true);
    trainer_join(&trs[0]);
    trainer_join(&trs[2]);
    for (int i = 0; i < 4; i++) {
        if (i == 1)
            continue;
        node_view(trs[i].n, &v);
        cr_assert_eq(v.model_version, 40, "w-%d at %llu", i, (unsigned long long)v.model_version);
        cr_assert_eq(trs[i].sum_check_failures, 0);
        cr_assert_eq(memcmp(trs[i].params, trs[0].params, sizeof(trs[0].params)), 0,
                     "w-%d differs: v=%llu applied=%llu states=%llu p0=%.6f vs w-0 applied=%llu "
                     "states=%llu p0=%.6f; w-2 applied=%llu p0=%.6f", i,
                     (unsigned long long)v.model_version, (unsigned long long)trs[i].applied,
                     (unsigned long long)trs[i].states, trs[i].params[0],
                     (unsigned long long)trs[0].applied, (unsigned long long)trs[0].states,
                     trs[0].params[0], (unsigned long long)trs[2].applied, trs[2].params[0]);
    }
    cr_assert_geq(trs[3].states, 1);
    /* The leave and the join may share an epoch (coalescing); either way
     * training went on in a newer one. */
    node_view(trs[0].n, &v);
    cr_assert_gt(v.epoch, epoch_before);
    for (int i = 0; i < 4; i++)
        if (i != 1)
            node_stop(trs[i].n);
    /* w-0's rounds: one all-reduce and no copy only with room. */
    for (size_t r = 0; r < trace.rounds; r++)
        one_step += rows[r][NODE_STAGE_COUNT] == 0 && rows[r][NODE_STAGE_COPY_OUT] == 0;
    if (with_room)
        cr_assert_gt(one_step, trace.rounds / 2, "%zu of %zu", one_step, trace.rounds);
    else
        cr_assert_eq(one_step, 0, "%zu of %zu", one_step, trace.rounds);
}

Test(node, member_leaves_and_joiner_catches_up)
{
    leave_and_join(false);
}

Test(node, member_leaves_and_joiner_catches_up_with_counters_in_spare_bytes)
{
    leave_and_join(true);
}

static struct node_view view_of(struct trainer *tr)
{
    struct node_view v;

    node_view(tr->n, &v);
    return v;
}

/* One lap of moolib's loop as its example orders it, wants_state first,
 * by a trainer that never takes a new state: it answers with the state
 * it has, "stale". */
static void answer_first(struct trainer *tr, bool *asked)
{
    struct node_view v;

    node_view(tr->n, &v);
    if (v.wants_state) {
        *asked = true;
        node_set_state(tr->n, "stale", 6);
    }
}

/* A member given the leader's state, whose trainer has not taken it yet,
 * is elected leader: the joiner must get the state it was given, not the
 * one its trainer would send (it answers wants_state before it looks at
 * has_new_state, as moolib's example loop does). The cohort once ended
 * with a member whose optimizer state was another's initial one. */
Test(node, a_leader_forwards_the_state_its_trainer_has_not_taken)
{
    static struct trainer trs[3];
    bool asked = false;
    void *s;
    size_t len;

    /* w-0 trains alone to version 3, then lingers, answering its node. */
    linger_next = true;
    trainer_start(&trs[0], 0, 3, 1);
    linger_next = false;
    FIXTURE_WAIT_FOR(atomic_load(&trs[0].at_target), "w-0 never reached version 3");
    /* w-1 joins and receives w-0's state, which its trainer leaves. */
    trainer_open(&trs[1], 1, 3, 1);
    FIXTURE_WAIT_FOR((answer_first(&trs[1], &asked), view_of(&trs[1]).has_new_state),
                     "w-1 never received w-0's state");
    cr_assert_eq(view_of(&trs[1]).model_version, 3);
    cr_assert_not(asked, "w-1 was asked for state while w-0 led");
    /* w-0 leaves; w-1, the only member at version 3, leads w-2's sync. */
    atomic_store(&trs[0].quit, true);
    trainer_join(&trs[0]);
    node_stop(trs[0].n);
    trainer_start(&trs[2], 2, 3, 1);
    FIXTURE_WAIT_FOR((answer_first(&trs[1], &asked), atomic_load(&trs[2].at_target)),
                     "w-2 never received the state");
    trainer_join(&trs[2]);
    cr_assert_eq(trs[2].states, 1);
    cr_assert_str_eq(trs[2].last_state, "state of 0 at 3", "w-2 got \"%s\"", trs[2].last_state);
    cr_assert_not(asked, "w-1's trainer was asked for the state it had not taken");
    cr_assert_eq(memcmp(trs[2].params, trs[0].params, sizeof(trs[0].params)), 0);
    cr_assert_eq(memcmp(trs[1].params, trs[0].params, sizeof(trs[0].params)), 0);
    /* w-1's trainer still finds the state waiting for it. */
    cr_assert_eq(node_take_state(trs[1].n, &s, &len), 0);
    cr_assert_str_eq((char *)s, "state of 0 at 3");
    free(s);
    node_stop(trs[1].n);
    node_stop(trs[2].n);
}

/* Whether the file at fd holds a line with both `a` and `b` (its first
 * 64 KiB). */
static bool file_has_line(int fd, const char *a, const char *b)
{
    static char buf[65536];
    ssize_t got = pread(fd, buf, sizeof(buf) - 1, 0);

    buf[got > 0 ? got : 0] = '\0';
    for (char *line = buf, *end; *line; line = end + 1) {
        end = strchrnul(line, '\n');
        if (memmem(line, (size_t)(end - line), a, strlen(a)) &&
            memmem(line, (size_t)(end - line), b, strlen(b)))
            return true;
        if (!*end)
            break;
    }
    return false;
}

/* fixture_wait_until's predicate: w-0's warning in the log at *fd. */
static bool w0_warned(void *fd)
{
    return file_has_line(*(int *)fd, "its trainer has not sent the state", "id=w-0");
}

/* A trainer back in its loop, answering wants_state with "late state";
 * *took once the node took it. */
static void answer_late(struct trainer *tr, bool *took)
{
    if (view_of(tr).wants_state && node_set_state(tr->n, "late state", 11) == 0)
        *took = true;
}

/* A leader whose trainer is away from its loop holds every other member
 * in the sync. Its log says so at half the engine's silence timeout
 * (every joiner's says only that a step timed out), and the joiner gets
 * the state as soon as the trainer answers. */
Test(node, a_leader_whose_trainer_withholds_the_state_says_so)
{
    static struct trainer trs[2];
    char path[] = "/tmp/cohort-test-node-XXXXXX";
    int log_fd = mkstemp(path), saved = dup(STDERR_FILENO);
    bool warned, took = false;
    void *s;
    size_t len;

    cr_assert(log_fd >= 0 && saved >= 0);
    unlink(path);
    /* w-0 trains alone to version 3 and leaves its loop: it leads, and
     * nothing answers its node. */
    reduce_timeout_next = 4000;
    trainer_start(&trs[0], 0, 3, 1);
    trainer_join(&trs[0]);
    cr_assert_eq(view_of(&trs[0]).model_version, 3);
    /* Only the nodes' threads log from here on, into the file. */
    dup2(log_fd, STDERR_FILENO);
    trainer_open(&trs[1], 1, 3, 1);
    reduce_timeout_next = 0;
    warned = fixture_wait_until(w0_warned, &log_fd, FIXTURE_WAIT_MS);
    dup2(saved, STDERR_FILENO);
    close(saved);
    cr_assert(warned, "w-0 never said its trainer withholds the state");
    cr_assert_not(view_of(&trs[1]).has_new_state);
    close(log_fd);
    /* w-0's trainer comes back: w-1 gets what it sends now. */
    FIXTURE_WAIT_FOR((answer_late(&trs[0], &took), view_of(&trs[1]).has_new_state),
                     "w-1 never received the state w-0's trainer sent late");
    cr_assert(took);
    cr_assert_eq(node_take_state(trs[1].n, &s, &len), 0);
    cr_assert_str_eq((char *)s, "late state");
    free(s);
    cr_assert_eq(view_of(&trs[1]).model_version, 3);
    cr_assert_eq(memcmp(trs[1].params, trs[0].params, sizeof(trs[0].params)), 0);
    node_stop(trs[0].n);
    node_stop(trs[1].n);
}

Test(node, misuse_is_refused)
{
    struct node_config c = { .broker = broker, .cohort = "train", .id = "lonely", .host = "127.0.0.1" };
    struct node *n;
    struct node_tensors t = { 0 };
    static float g[8], r[8];

    cr_assert_eq(node_start(&c, &n), 0);
    cr_assert_eq(node_contribute(n, 1), -ENODEV);
    cr_assert_eq(node_register(n, &t), -EINVAL);
    t.grads = (char *)g + 4;            /* misaligned */
    t.grad_count = 1;
    cr_assert_eq(node_register(n, &t), -EINVAL);
    t.grads = g;
    cr_assert_eq(node_register(n, &t), -EINVAL, "no results region");
    t.results = r;
    cr_assert_eq(node_register(n, &t), 0);
    cr_assert_eq(node_consume(n, 0), -EPERM);
    cr_assert_eq(node_set_state(n, "x", 1), -EPERM);
    cr_assert_eq(node_set_virtual_batch_size(n, 0), -EINVAL);
    node_stop(n);
    c.id = "bad id";
    cr_assert_eq(node_start(&c, &n), -EINVAL);
}

/* ---- checkpoints ---------------------------------------------------------- */

/* A temporary checkpoint directory for one test; ckpt_dir points at it. */
static char ckdir[] = "/tmp/cohort-node-ckpt-XXXXXX";

static void ckpt_dir_make(void)
{
    cr_assert_not_null(mkdtemp(ckdir));
    ckpt_dir = ckdir;
}

static void ckpt_dir_remove(void)
{
    char cmd[128];

    snprintf(cmd, sizeof(cmd), "rm -rf %s", ckdir);
    cr_assert_eq(system(cmd), 0);
    ckpt_dir = NULL;
}

/* The parameters trainer_main gives after `rounds` rounds whose results
 * are all `mean`, from `from` (the same float operations, so the same
 * bytes). */
/* `from` with the results tr applied that made versions above `above`
 * and up to `upto`, applied as trainer_main does. */
static void params_after(float *p, const float *from, const struct trainer *tr, uint64_t above,
                         uint64_t upto)
{
    uint64_t n = 0;

    cr_assert_leq(tr->applied, APPLIED_LOG);
    memcpy(p, from, sizeof(float) * (P + 1));
    for (uint64_t r = 0; r < tr->applied; r++) {
        if (tr->applied_at[r] <= above || tr->applied_at[r] > upto)
            continue;
        for (int i = 0; i < P; i++)
            p[i] -= 0.01f * tr->applied_mean[r];
        n++;
    }
    cr_assert_eq(n, upto - above, "w-%d applied %llu results in (%llu, %llu]", tr->index,
                 (unsigned long long)n, (unsigned long long)above, (unsigned long long)upto);
}

static bool has_a_checkpoint(void *unused)
{
    return ckpt_newest_version(ckdir) >= CKPT_EVERY;
}

Test(node, a_cohort_with_no_live_member_resumes_from_its_newest_checkpoint)
{
    static struct trainer trs[2], again[2];
    static float init[P + 1], at_ck[P + 1], in_file[P + 1], after[P + 1];
    double buffers[2];
    struct ckpt_layout l = { .cohort = "train", .params_bytes = sizeof(in_file),
                             .buffers_bytes = sizeof(buffers) };
    struct ckpt_loaded loaded;
    struct node_checkpoints ck;
    struct node_view v;
    uint64_t newest;
    char want_state[64];

    ckpt_dir_make();
    trainers_start(trs, 2, 28, 2);      /* results are the mean of 1 and 2 */
    trainers_join(trs, 2);
    trainers_stop(trs, 2);              /* every member gone; writes finished */
    /* A checkpoint comes due while the writer is busy is taken at a later
     * commit, so how many the leader wrote follows the machine's load (the
     * writer runs at nice 19); the one of version 5 is always written. */
    newest = ckpt_newest_version(ckdir);
    cr_assert(newest >= CKPT_EVERY && newest <= 28, "the newest checkpoint is of version %llu",
              (unsigned long long)newest);

    /* The newest file holds w-0's parameters (the leader's) at its
     * version, exactly. */
    for (int i = 0; i < P; i++)
        init[i] = (float)i;             /* w-0's, the leader's (the pad stays 0) */
    params_after(at_ck, init, &trs[0], 0, newest);
    cr_assert_eq(ckpt_load(ckdir, &l, 0, in_file, buffers, &loaded), 0);
    cr_assert_eq(loaded.version, newest);
    free(loaded.state);
    cr_assert_eq(memcmp(in_file, at_ck, sizeof(at_ck)), 0,
                 "the checkpoint of version %llu does not hold w-0's parameters at it",
                 (unsigned long long)newest);

    /* New trainers, with parameters of their own: the checkpoint's win,
     * and training goes on from its version, not 0. */
    trainer_start(&again[0], 2, newest + 10, 2);
    trainer_start(&again[1], 3, newest + 10, 2);
    node_set_virtual_batch_size(again[0].n, 2);
    node_set_virtual_batch_size(again[1].n, 2);
    trainers_join(again, 2);
    for (int i = 0; i < 2; i++) {
        params_after(after, at_ck, &again[i], newest, newest + 10);
        node_view(again[i].n, &v);
        node_checkpoints(again[i].n, &ck);
        cr_assert_eq(ck.loaded_version, newest, "w-%d resumed from %llu, not %llu", i + 2,
                     (unsigned long long)ck.loaded_version, (unsigned long long)newest);
        cr_assert_eq(v.model_version, newest + 10);
        cr_assert_eq(memcmp(again[i].params, after, sizeof(after)), 0,
                     "w-%d's parameters are not the checkpoint's trained 10 more rounds", i + 2);
        cr_assert(!again[i].went_back);
        cr_assert_eq(again[i].sum_check_failures, 0);
    }
    /* The trainer got the opaque state the leader gave at that version. */
    snprintf(want_state, sizeof(want_state), "state of 0 at %llu", (unsigned long long)newest);
    cr_assert_str_eq(again[0].last_state, want_state);
    trainers_stop(again, 2);
    ckpt_dir_remove();
}

static bool skip_reported(void *unused)
{
    struct broker_status *s = NULL;
    bool seen = false;

    if (brokerd_status(d, "train", &s) < 0)
        return false;
    for (size_t i = 0; i < s->cohorts[0].n_members; i++)
        seen = seen || (s->cohorts[0].checkpoints[i].skipped_version == 9 &&
                        s->cohorts[0].checkpoints[i].skipped_reason == CKPT_CHECKSUM &&
                        s->cohorts[0].checkpoints[i].version == 7);
    broker_status_free(s);
    return seen;
}

Test(node, a_corrupt_newest_checkpoint_is_skipped_and_reported)
{
    static struct trainer tr;
    static float params[P + 1], p7[P + 1];
    double buffers[2] = { 0 };
    struct ckpt_layout l = { .cohort = "train", .params_bytes = sizeof(params),
                             .buffers_bytes = sizeof(buffers) };
    struct ckpt_parts parts = { .params = params, .buffers = buffers, .state = "s7",
                                .state_len = 2 };
    struct node_checkpoints ck;
    char path[256];
    FILE *f;

    ckpt_dir_make();
    for (int i = 0; i < P + 1; i++)
        params[i] = 7.0f + (float)i;
    memcpy(p7, params, sizeof(p7));
    parts.version = 7;
    cr_assert_eq(ckpt_write(ckdir, &l, &parts, 3, NULL), 0);
    params[0] = 9.0f;
    parts.version = 9;
    cr_assert_eq(ckpt_write(ckdir, &l, &parts, 3, NULL), 0);
    snprintf(path, sizeof(path), "%s/ckpt-%020d.cohort", ckdir, 9);
    f = fopen(path, "r+");
    cr_assert_not_null(f);
    fseek(f, CKPT_HEADER_BYTES + 4, SEEK_SET);
    fputc(0x55, f);                     /* a parameter's byte */
    fclose(f);

    trainer_start(&tr, 0, 9, 1);
    trainer_join(&tr);
    node_checkpoints(tr.n, &ck);
    cr_assert_eq(ck.loaded_version, 7);
    cr_assert_eq(ck.skipped_version, 9);
    cr_assert_eq(ck.skipped_reason, CKPT_CHECKSUM);
    cr_assert_str_eq(tr.last_state, "s7");
    /* Two rounds of its own (+1 each) on top of version 7's parameters. */
    cr_assert(tr.applied == 2 && tr.applied_mean[0] == 1.0f && tr.applied_mean[1] == 1.0f);
    params_after(params, p7, &tr, 7, 9);
    cr_assert_eq(memcmp(tr.params, params, sizeof(params)), 0);
    /* The member's heartbeats told the broker, for the operator. */
    cr_assert(fixture_wait_until(skip_reported, NULL, 30000), "the skip never reached the broker");
    node_stop(tr.n);
    ckpt_dir_remove();
}

static bool w0_reached_12(void *tr)
{
    return ((struct trainer *)tr)->highest >= 12;
}

Test(node, a_checkpoint_behind_the_cohort_never_pulls_a_member_back)
{
    static struct trainer trs[3];
    struct node_checkpoints ck;
    struct node_view v;

    ckpt_dir_make();
    /* They wait at 12 for the joiner (their loops must still answer its
     * sync when it comes). */
    pause_next_at = 12;
    pause_next_until = 3;
    trainers_start(trs, 2, 40, 1);
    pause_next_at = 0;
    pause_next_until = 0;
    cr_assert(fixture_wait_until(w0_reached_12, &trs[0], 60000), "w-0 never reached 12");
    /* The writer runs at nice 19 beside the rounds: on a busy machine the
     * file of version 5 (due at its commit, so always written) may come
     * well after the versions. */
    cr_assert(fixture_wait_until(has_a_checkpoint, NULL, 60000), "no checkpoint written");
    /* A joiner finds checkpoints behind the cohort: it loads one, and the
     * election gives it the leader's state instead. */
    trainer_start(&trs[2], 2, 40, 3);
    node_set_virtual_batch_size(trs[2].n, 1);
    trainers_join(trs, 3);
    node_checkpoints(trs[2].n, &ck);
    cr_assert_geq(ck.loaded_version, CKPT_EVERY, "the joiner loaded no checkpoint");
    cr_assert_geq(trs[2].states, 1, "the joiner never received the leader's state");
    for (int i = 0; i < 3; i++) {
        node_view(trs[i].n, &v);
        cr_assert_eq(v.model_version, 40);
        cr_assert(!trs[i].went_back, "w-%d's model version went back", i);
        cr_assert_eq(memcmp(trs[i].params, trs[0].params, sizeof(trs[0].params)), 0);
    }
    trainers_stop(trs, 3);
    ckpt_dir_remove();
}

/* w-0 and w-1 (contributions of 1 and 2, batch 1 each, virtual batch 3),
 * both held, in one epoch of two at version 0. Each makes one
 * contribution; the count step finds 2 of 3 and commits nothing, so both
 * hold a pending contribution that a step has reduced in this epoch.
 * Then w-0 leaves the epoch (drained) with it. Returns that epoch. */
static uint64_t w0_pending_then_out(struct trainer *trs)
{
    uint64_t e1;

    start_held = true;
    trainers_start(trs, 2, 1000, 3);
    start_held = false;
    FIXTURE_WAIT_FOR(view_of(&trs[0]).size == 2 && view_of(&trs[0]).wants_gradients &&
                     view_of(&trs[1]).size == 2 && view_of(&trs[1]).wants_gradients,
                     "w-0 and w-1 never shared an epoch");
    e1 = view_of(&trs[0]).epoch;
    atomic_store(&trs[0].budget, 1);
    atomic_store(&trs[1].budget, 1);
    FIXTURE_WAIT_FOR(atomic_load(&trs[0].made) == 1 && atomic_load(&trs[1].made) == 1 &&
                     view_of(&trs[0]).wants_gradients && view_of(&trs[1]).wants_gradients,
                     "the count step of w-0's and w-1's contributions never ran");
    cr_assert_eq(view_of(&trs[0]).model_version, 0);
    cr_assert_eq(view_of(&trs[0]).epoch, e1, "the epoch changed under the test");
    cr_assert_eq(brokerd_drain(d, "train", "w-0", true), 0);
    FIXTURE_WAIT_FOR(view_of(&trs[1]).size == 1 && view_of(&trs[1]).epoch > e1,
                     "w-1 never had an epoch of its own");
    return e1;
}

static void trainers_quit(struct trainer *trs, int n)
{
    for (int i = 0; i < n; i++)
        atomic_store(&trs[i].quit, true);
    trainers_join(trs, n);
    trainers_stop(trs, n);
}

/* Seed 1015's shape (docs/chaos.md): a member's pending contribution was
 * reduced in no round of the epoch that committed the leader's newer
 * versions. Taking the leader's state must keep it, and the next round
 * counts it exactly once. */
Test(node, a_member_behind_keeps_contributions_no_round_of_the_leader_holds)
{
    static struct trainer trs[2];

    w0_pending_then_out(trs);
    /* w-1 alone commits versions 1 and 2: its pending 2 and five more. */
    atomic_store(&trs[1].budget, 5);
    FIXTURE_WAIT_FOR(atomic_load(&trs[1].applied_version) == 2, "w-1 never committed 1 and 2");
    cr_assert_eq(trs[1].gradients_at[1], 3);
    cr_assert_eq(trs[1].result_at[1], 2.0f);
    cr_assert_eq(trs[1].result_at[2], 2.0f);

    /* w-0 comes back behind (0 against 2) and takes w-1's state. */
    cr_assert_eq(brokerd_drain(d, "train", "w-0", false), 0);
    FIXTURE_WAIT_FOR(view_of(&trs[0]).size == 2 && view_of(&trs[0]).model_version == 2 &&
                     trs[0].states >= 1, "w-0 never took the leader's state");
    cr_assert_eq(view_of(&trs[0]).contributions_dropped, 0,
                 "w-0 dropped a contribution that none of the leader's rounds holds");

    /* Round 3: w-0's kept 1, one more 1 from w-0 and a 2 from w-1. */
    atomic_store(&trs[0].budget, 1);
    atomic_store(&trs[1].budget, 1);
    FIXTURE_WAIT_FOR(atomic_load(&trs[0].applied_version) == 3 &&
                     atomic_load(&trs[1].applied_version) == 3, "round 3 never committed");
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(trs[i].gradients_at[3], 3, "w-%d: round 3 reduced %llu contributions", i,
                     (unsigned long long)trs[i].gradients_at[3]);
        cr_assert_float_eq(trs[i].result_at[3] * 3.0f, 4.0f, 1e-5, "w-%d: round 3's result is %f",
                           i, (double)trs[i].result_at[3]);
        cr_assert_eq(trs[i].sum_check_failures, 0);
    }
    cr_assert_eq(memcmp(trs[0].params, trs[1].params, sizeof(trs[0].params)), 0);
    /* 9 contributions made, 3 rounds of 3: none lost, none twice. */
    cr_assert_eq(atomic_load(&trs[0].made) + atomic_load(&trs[1].made), 9);
    cr_assert_eq(view_of(&trs[1]).contributions_dropped, 0);
    trainers_quit(trs, 2);
}

/* The same, but the leader's versions came from a declaration (as from a
 * trainer's own checkpoint): its record cannot say whether a round holds
 * w-0's contribution, and counting it twice would corrupt a committed
 * result, so it is dropped (and counted as dropped), in no round. */
Test(node, a_member_behind_an_unrecorded_history_drops_rather_than_counts_twice)
{
    static struct trainer trs[2];

    w0_pending_then_out(trs);
    cr_assert_eq(node_set_model_version(trs[1].n, 5), 0);
    cr_assert_eq(brokerd_drain(d, "train", "w-0", false), 0);
    FIXTURE_WAIT_FOR(view_of(&trs[0]).size == 2 && view_of(&trs[0]).model_version == 5 &&
                     trs[0].states >= 1, "w-0 never took the leader's state");
    cr_assert_eq(view_of(&trs[0]).contributions_dropped, 1);
    /* Round 6: w-1's pending 2, a 2 more from w-1 and a new 1 from w-0. */
    atomic_store(&trs[0].budget, 1);
    atomic_store(&trs[1].budget, 1);
    FIXTURE_WAIT_FOR(atomic_load(&trs[0].applied_version) == 6 &&
                     atomic_load(&trs[1].applied_version) == 6, "round 6 never committed");
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(trs[i].gradients_at[6], 3);
        cr_assert_float_eq(trs[i].result_at[6] * 3.0f, 5.0f, 1e-5, "w-%d: round 6's result is %f",
                           i, (double)trs[i].result_at[6]);
    }
    trainers_quit(trs, 2);
}

/* ---- top-k and PowerSGD through the node's rounds ---- */

#define CG (128u << 10)             /* gradients: 512 KiB of float32, above a fused step */
#define CROUNDS 5

struct cmember {
    int index;
    struct node *n;
    _Alignas(64) double params[1];
    float *grads, *results;
    float *seen;                    /* CROUNDS x CG: the result that made version v + 1 */
    uint64_t made, applied;
    bool started;
    uint64_t target;                /* stop at this model version (CROUNDS) */
    uint32_t start_size;            /* members in the epoch before the first contribution */
    uint64_t hold_at;               /* after this many results (0: never), contribute only... */
    uint32_t hold_size;             /* ...in epochs of this many members */
    atomic_uint_fast64_t version;   /* the newest model version seen */
    uint64_t grads_at[CROUNDS + 1]; /* num_gradients of the result that made version v */
    void (*fill)(float *g, int member, uint64_t round);
    int rc;
    pthread_t t;
};

static void *cmember_main(void *arg)
{
    struct cmember *m = arg;
    uint64_t end = clock_now_ms() + 120000;
    struct node_view v;

    while (clock_now_ms() < end) {
        node_view(m->n, &v);
        atomic_store(&m->version, v.model_version);
        if (v.model_version >= m->target && !v.has_gradients)
            return NULL;
        if (!v.connected) {
            clock_sleep_ms(1);
            continue;
        }
        fixture_node_trade_state(m->n, &v);
        if (v.has_gradients) {
            if (v.model_version >= 1 && v.model_version <= CROUNDS) {
                memcpy(m->seen + (v.model_version - 1) * CG, m->results, CG * sizeof(float));
                m->grads_at[v.model_version] = v.num_gradients;
            }
            memset(m->grads, 0, CG * sizeof(float));
            if (node_consume(m->n, v.rounds_committed) < 0)
                m->rc = -EPROTO;
            m->applied++;
        } else if (v.wants_gradients && (m->started || v.size == m->start_size) &&
                   !(m->hold_at && m->applied >= m->hold_at && v.size < m->hold_size)) {
            m->started = true;
            m->fill(m->grads, m->index, m->made);
            if (node_contribute(m->n, 1) == 0)
                m->made++;
            else
                memset(m->grads, 0, CG * sizeof(float));
        } else {
            clock_sleep_ms(1);
        }
    }
    m->rc = -ETIMEDOUT;
    return NULL;
}

/* Two members of cohort `cohort` (the broker's "train"), member i asking for comp[i], each
 * contributing CROUNDS gradients of fill(); returns once both applied
 * CROUNDS results, each member's in ms[i].seen. */
/* Member c-<i> of cohort `cohort` (the broker's "train") asking for
 * `comp`, virtual batch size 2, its loop started. */
static void cmember_start(const char *cohort, struct cmember *m, int i, const char *comp,
                          void (*fill)(float *, int, uint64_t), uint32_t start_size)
{
    struct node_config c = { .broker = broker, .cohort = cohort, .host = "127.0.0.1",
                             .reduce_timeout_ms = 20000 };
    struct node_tensors t;
    char id[16];

    memset(m, 0, sizeof(*m));
    m->index = i;
    m->fill = fill;
    m->target = CROUNDS;
    m->start_size = start_size;
    m->grads = aligned_alloc(64, CG * sizeof(float));
    m->results = aligned_alloc(64, CG * sizeof(float));
    m->seen = calloc((size_t)CROUNDS * CG, sizeof(float));
    cr_assert(m->grads && m->results && m->seen);
    snprintf(id, sizeof(id), "c-%d", i);
    c.id = id;
    cr_assert_eq(compress_parse(comp, &c.compression), 0, "%s", comp);
    cr_assert_eq(node_start(&c, &m->n), 0);
    t = (struct node_tensors){ .params = m->params, .params_bytes = sizeof(m->params),
                               .grads = m->grads, .grad_count = CG, .grad_type = DTYPE_F32,
                               .results = m->results };
    cr_assert_eq(node_register(m->n, &t), 0);
    cr_assert_eq(node_set_virtual_batch_size(m->n, 2), 0);
}

static void compressed_pair(const char *cohort, struct cmember ms[2], const char *const comp[2],
                            void (*fill)(float *, int, uint64_t))
{
    for (int i = 0; i < 2; i++)
        cmember_start(cohort, &ms[i], i, comp[i], fill, 2);
    for (int i = 0; i < 2; i++)
        pthread_create(&ms[i].t, NULL, cmember_main, &ms[i]);
    for (int i = 0; i < 2; i++) {
        pthread_join(ms[i].t, NULL);
        cr_assert_eq(ms[i].rc, 0, "member %d: %d", i, ms[i].rc);
    }
}

static void cmember_free(struct cmember *m)
{
    node_stop(m->n);
    free(m->grads);
    free(m->results);
    free(m->seen);
}

static void compressed_pair_free(struct cmember ms[2])
{
    for (int i = 0; i < 2; i++)
        cmember_free(&ms[i]);
}

/* Small integers, different per member, entry and round: every sum of
 * them is exact in float32. */
static void fill_integers(float *g, int member, uint64_t round)
{
    for (size_t i = 0; i < CG; i++)
        g[i] = (float)((int)((i * 7 + (size_t)member * 13 + round * 31 + (i >> 9) * 5) % 41) - 20);
}

/* Top-k: every committed result is exactly the mean of each member's top
 * k of its gradient plus its residual, the residuals carried from round
 * to round (computed here with topk_select): error feedback, exact over
 * the rounds, the same bytes on both members. */
static void check_topk_pair(struct cmember ms[2])
{
    static float resid[2][CG], acc[CG], expect[CG];
    static uint32_t idx[CG];
    size_t k;

    cr_assert_eq(topk_k_for_ratio(CG, (double)COMPRESS_TOPK_DEFAULT / COMPRESS_TOPK_ONE, &k), 0);
    memset(resid, 0, sizeof(resid));
    for (uint64_t r = 0; r < CROUNDS; r++) {
        size_t sent = 0;

        memset(expect, 0, sizeof(expect));
        for (int m = 0; m < 2; m++) {
            fill_integers(acc, m, r);
            for (size_t i = 0; i < CG; i++)
                acc[i] += resid[m][i];
            cr_assert_eq(topk_select(acc, CG, k, idx), 0);
            for (size_t j = 0; j < k; j++) {
                expect[idx[j]] += acc[idx[j]];
                acc[idx[j]] = 0;
            }
            memcpy(resid[m], acc, sizeof(acc));
        }
        for (size_t i = 0; i < CG; i++) {
            expect[i] /= 2.0f;
            sent += expect[i] != 0;
        }
        cr_assert_leq(sent, 2 * k, "at most k entries per member");
        cr_assert_eq(memcmp(ms[0].seen + r * CG, ms[1].seen + r * CG, CG * sizeof(float)), 0,
                     "round %d: members differ", (int)r);
        for (size_t i = 0; i < CG; i++)
            cr_assert_eq(ms[0].seen[r * CG + i], expect[i], "round %d entry %zu: %g against %g", (int)r,
                         i, ms[0].seen[r * CG + i], expect[i]);
    }
}

Test(node, topk_rounds_are_exact_with_error_feedback)
{
    static const char *const comp[2] = { "topk:0.01", "topk:0.01" };
    struct cmember ms[2];

    compressed_pair("train", ms, comp, fill_integers);
    check_topk_pair(ms);
    compressed_pair_free(ms);
}

/* The same with two contributions in flight: each round reduces (and
 * commits the residual of) a slot's copy, not the trainer's buffer. */
Test(node, topk_with_parallel_gradients_is_exact_too)
{
    struct cmember ms[2];

    for (int i = 0; i < 2; i++) {
        cmember_start("train", &ms[i], i, "topk:0.01", fill_integers, 2);
        cr_assert_eq(node_set_parallel_gradients(ms[i].n, 2), 0);
    }
    for (int i = 0; i < 2; i++)
        pthread_create(&ms[i].t, NULL, cmember_main, &ms[i]);
    for (int i = 0; i < 2; i++) {
        pthread_join(ms[i].t, NULL);
        cr_assert_eq(ms[i].rc, 0, "member %d: %d", i, ms[i].rc);
    }
    check_topk_pair(ms);
    compressed_pair_free(ms);
}

/* PowerSGD's view of CG elements: 362 x 362, and 28 left over. */
#define PS_ROWS 362u
#define PS_COLS 362u

/* Member m: (m + 1) u v^T over the matrix, integers, so the sum of the
 * members' gradients has rank 1; the elements left over, (m + 1) x 3. */
static void fill_rank1(float *g, int member, uint64_t round)
{
    for (size_t i = 0; i < PS_ROWS; i++)
        for (size_t j = 0; j < PS_COLS; j++)
            g[i * PS_COLS + j] = (float)((member + 1) * ((int)((i + round) % 5) - 2) * ((int)(j % 3) + 1));
    for (size_t i = PS_ROWS * PS_COLS; i < CG; i++)
        g[i] = (float)((member + 1) * 3);
}

/* PowerSGD, rank 1, on a gradient whose sum has rank 1: both members
 * commit the same bytes, the result is the mean (close: a rank-1 product
 * computed in float32), and the elements beyond the matrix are reduced
 * uncompressed, exactly. */
Test(node, powersgd_rounds_are_identical_and_reproduce_a_rank_one_mean)
{
    static const char *const comp[2] = { "powersgd:1", "powersgd:1" };
    struct cmember ms[2];
    static float want[CG], mine[CG];

    compressed_pair("train", ms, comp, fill_rank1);
    for (uint64_t r = 0; r < CROUNDS; r++) {
        const float *got = ms[0].seen + r * CG;

        fill_rank1(want, 0, r);
        fill_rank1(mine, 1, r);
        for (size_t i = 0; i < CG; i++)
            want[i] = (want[i] + mine[i]) / 2.0f;
        cr_assert_eq(memcmp(got, ms[1].seen + r * CG, CG * sizeof(float)), 0, "round %d: members differ",
                     (int)r);
        for (size_t i = 0; i < PS_ROWS * PS_COLS; i++)
            cr_assert_leq(fabsf(got[i] - want[i]), 1e-3f, "round %d entry %zu: %g against %g", (int)r, i,
                          got[i], want[i]);
        for (size_t i = PS_ROWS * PS_COLS; i < CG; i++)
            cr_assert_eq(got[i], want[i], "the tail is exact");
    }
    compressed_pair_free(ms);
}

/* Members that ask for top-k with different ratios run uncompressed: the
 * result is the exact mean of every entry, which top-k would not give. */
Test(node, members_that_disagree_on_the_parameter_run_uncompressed)
{
    static const char *const comp[2] = { "topk:0.01", "topk:0.02" };
    struct cmember ms[2];
    static float a[CG], b[CG];

    compressed_pair("train", ms, comp, fill_integers);
    for (uint64_t r = 0; r < CROUNDS; r++) {
        fill_integers(a, 0, r);
        fill_integers(b, 1, r);
        cr_assert_eq(memcmp(ms[0].seen + r * CG, ms[1].seen + r * CG, CG * sizeof(float)), 0);
        for (size_t i = 0; i < CG; i++)
            cr_assert_eq(ms[0].seen[r * CG + i], (a[i] + b[i]) / 2.0f, "round %d entry %zu", (int)r, i);
    }
    compressed_pair_free(ms);
}

Test(node, compression_settings_are_checked)
{
    struct compress c;
    char text[COMPRESS_TEXT_MAX];
    static const char *const bad[] = { "topk:0", "topk:1.5", "topk:0.0000001", "topk:", "topk:-0.1",
                                       "topk:abc", "powersgd:0", "powersgd:1025", "powersgd:2.5",
                                       "powersgd:", "int8:1", "zip", "", "topk:1.000001",
                                       /* the averager's codecs only */
                                       "meanstd16", "uniform8", "quantile8" };
    static const struct {
        const char *in, *out;
    } good[] = { { "topk", "topk:0.01" }, { "topk:0.25", "topk:0.25" }, { "topk:1", "topk:1" },
                 { "topk:.5", "topk:0.5" }, { "topk:0.000001", "topk:0.000001" },
                 { "powersgd", "powersgd:4" }, { "powersgd:1024", "powersgd:1024" },
                 { "int8", "int8" }, { "none", "none" } };
    struct node_config nc = { 0 };

    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        cr_assert_eq(compress_parse(bad[i], &c), -EINVAL, "%s", bad[i]);
    for (size_t i = 0; i < sizeof(good) / sizeof(good[0]); i++) {
        struct compress back;

        cr_assert_eq(compress_parse(good[i].in, &c), 0, "%s", good[i].in);
        cr_assert_str_eq(compress_format(&c, text, sizeof(text)), good[i].out);
        cr_assert_eq(compress_unpack(compress_pack(&c), &back), 0);
        cr_assert(back.method == c.method && back.param == c.param);
    }
    cr_assert_eq(compress_unpack(6, &c), -EINVAL);
    cr_assert_eq(compress_unpack(CODEC_QUANTILE8, &c), -EINVAL);
    cr_assert_eq(compress_unpack(COMPRESS_TOPK, &c), -EINVAL, "top-k with a ratio of 0");
    cr_assert_eq(compress_unpack(COMPRESS_INT8 | 1u << 8, &c), -EINVAL, "a codec with a parameter");
    cr_assert_eq(compress_unpack((uint64_t)1 << 40 | COMPRESS_NONE, &c), -EINVAL);
    nc = (struct node_config){ .broker = broker, .cohort = "train", .id = "s-0", .host = "127.0.0.1" };
    {
        struct node *n;
        struct compress wrong = { .method = COMPRESS_POWERSGD, .param = 0 };

        cr_assert_eq(node_start(&nc, &n), 0);
        cr_assert_eq(node_set_compression(n, &wrong), -EINVAL);
        cr_assert_eq(compress_parse("powersgd:8", &c), 0);
        cr_assert_eq(node_set_compression(n, &c), 0);
        node_stop(n);
    }
}

/* Member m: a rank-1 matrix of its own (the rows' pattern shifted by m),
 * so the members' sum has rank 2. */
static void fill_rank2(float *g, int member, uint64_t round)
{
    for (size_t i = 0; i < PS_ROWS; i++)
        for (size_t j = 0; j < PS_COLS; j++)
            g[i * PS_COLS + j] = (float)(((int)((i + (size_t)member * 2) % 5) - 2) *
                                         ((int)((j + (size_t)member) % 3) + 1));
    for (size_t i = PS_ROWS * PS_COLS; i < CG; i++)
        g[i] = (float)(member + 1 + (int)round);
}

/* PowerSGD at rank 1 of a rank-2 sum is compressed, not exact: the result
 * is not the mean, yet it is the same bytes on both members, and the
 * elements beyond the matrix are still exact. */
Test(node, powersgd_rank_one_of_a_rank_two_sum_is_compressed)
{
    static const char *const comp[2] = { "powersgd:1", "powersgd:1" };
    struct cmember ms[2];
    static float want[CG], other[CG];
    float worst = 0;

    compressed_pair("train", ms, comp, fill_rank2);
    fill_rank2(want, 0, 0);
    fill_rank2(other, 1, 0);
    for (size_t i = 0; i < CG; i++)
        want[i] = (want[i] + other[i]) / 2.0f;
    for (size_t i = 0; i < PS_ROWS * PS_COLS; i++)
        worst = fmaxf(worst, fabsf(ms[0].seen[i] - want[i]));
    cr_assert_gt(worst, 0.1f, "a rank-1 product cannot be this rank-2 mean");
    for (size_t i = PS_ROWS * PS_COLS; i < CG; i++)
        cr_assert_eq(ms[0].seen[i], want[i]);
    for (uint64_t r = 0; r < CROUNDS; r++)
        cr_assert_eq(memcmp(ms[0].seen + r * CG, ms[1].seen + r * CG, CG * sizeof(float)), 0);
    compressed_pair_free(ms);
}

/* PowerSGD by tensor shape: CG elements as a 256 x 256 matrix, a bias of
 * 256, a 200 x 300 matrix, then elements no tensor names. */
static const struct layout_shape layers[] = {
    { .offset = 0, .count = 65536, .rows = 256, .cols = 256 },
    { .offset = 65536, .count = 256, .rows = 256, .cols = 1 },
    { .offset = 65792, .count = 60000, .rows = 200, .cols = 300 },
};
#define LAYERS_END (65792u + 60000u)

static bool in_layer_matrix(size_t i)
{
    return i < 65536 || (i >= 65792 && i < LAYERS_END);
}

/* Member m: in each matrix (m + 1) u v^T with that layer's own u and v
 * for the round, integers, so the members' mean has rank 1 per layer
 * (but not as one 362 x 362 view); the rest small integers. */
static void fill_layers(float *g, int member, uint64_t round)
{
    for (size_t i = 0; i < 256; i++)
        for (size_t j = 0; j < 256; j++)
            g[i * 256 + j] = (float)((member + 1) * ((int)((i + round) % 7) - 3) * ((int)(j % 4) - 1));
    for (size_t i = 0; i < 200; i++)
        for (size_t j = 0; j < 300; j++)
            g[65792 + i * 300 + j] =
                    (float)((member + 1) * ((int)((i * 3 + round) % 5) - 2) * ((int)((j + 1) % 3) + 1));
    for (size_t i = 65536; i < 65792; i++)
        g[i] = (float)((int)((i + (size_t)member * 3 + round) % 9) - 4);
    for (size_t i = LAYERS_END; i < CG; i++)
        g[i] = (float)((int)((i * 5 + (size_t)member + round) % 11) - 5);
}

/* Two members at powersgd:1 with fill_layers, each given `shapes` (k of
 * them; NULL: none) before its first round. */
static void layered_pair(struct cmember ms[2], const struct layout_shape *const shapes[2],
                         const size_t k[2])
{
    for (int i = 0; i < 2; i++) {
        cmember_start("train", &ms[i], i, "powersgd:1", fill_layers, 2);
        if (shapes[i])
            cr_assert_eq(node_set_tensor_shapes(ms[i].n, shapes[i], k[i]), 0);
    }
    for (int i = 0; i < 2; i++)
        pthread_create(&ms[i].t, NULL, cmember_main, &ms[i]);
    for (int i = 0; i < 2; i++) {
        pthread_join(ms[i].t, NULL);
        cr_assert_eq(ms[i].rc, 0, "member %d: %d", i, ms[i].rc);
    }
}

static void layers_mean(float *want, uint64_t round)
{
    static float other[CG];

    fill_layers(want, 0, round);
    fill_layers(other, 1, round);
    for (size_t i = 0; i < CG; i++)
        want[i] = (want[i] + other[i]) / 2.0f;
}

/* By shape, rank 1 reproduces each layer's rank-1 mean (to float
 * tolerance) and the bias and the unnamed elements exactly, the same bytes
 * on both members; the whole-buffer view, given the same gradients, does
 * not. A bad layout given after the good one is refused and changes
 * nothing. */
Test(node, powersgd_by_shape_reproduces_each_layer)
{
    static const struct layout_shape overlap[] = { { 0, 65536, 256, 256 }, { 65535, 256, 256, 1 } };
    static const struct layout_shape beyond[] = { { CG - 10, 20, 20, 1 } };
    static const struct layout_shape not_rc[] = { { 0, 65536, 256, 255 } };
    static struct layout_shape too_many[LAYOUT_SHAPES_MAX + 1];
    const struct layout_shape *const none[2] = { NULL, NULL };
    const size_t k[2] = { 3, 3 };
    struct cmember ms[2];
    static float want[CG];
    float worst = 0;

    for (int i = 0; i < 2; i++) {
        cmember_start("train", &ms[i], i, "powersgd:1", fill_layers, 2);
        cr_assert_eq(node_set_tensor_shapes(ms[i].n, layers, 3), 0);
        cr_assert_eq(node_set_tensor_shapes(ms[i].n, overlap, 2), -EINVAL);
        cr_assert_eq(node_set_tensor_shapes(ms[i].n, beyond, 1), -EINVAL);
        cr_assert_eq(node_set_tensor_shapes(ms[i].n, not_rc, 1), -EINVAL);
        cr_assert_eq(node_set_tensor_shapes(ms[i].n, too_many, LAYOUT_SHAPES_MAX + 1), -EINVAL);
        cr_assert_eq(node_set_tensor_shapes(ms[i].n, NULL, 1), -EINVAL);
    }
    for (int i = 0; i < 2; i++)
        pthread_create(&ms[i].t, NULL, cmember_main, &ms[i]);
    for (int i = 0; i < 2; i++) {
        pthread_join(ms[i].t, NULL);
        cr_assert_eq(ms[i].rc, 0, "member %d: %d", i, ms[i].rc);
    }
    for (uint64_t r = 0; r < CROUNDS; r++) {
        const float *got = ms[0].seen + r * CG;

        layers_mean(want, r);
        cr_assert_eq(memcmp(got, ms[1].seen + r * CG, CG * sizeof(float)), 0, "round %d: members differ",
                     (int)r);
        for (size_t i = 0; i < CG; i++) {
            if (in_layer_matrix(i))
                cr_assert_leq(fabsf(got[i] - want[i]), 1e-3f * (1 + fabsf(want[i])),
                              "round %d entry %zu: %g against %g", (int)r, i, got[i], want[i]);
            else
                cr_assert_eq(got[i], want[i], "round %d entry %zu is not exact", (int)r, i);
        }
    }
    compressed_pair_free(ms);

    layered_pair(ms, none, k);
    for (uint64_t r = 0; r < CROUNDS; r++) {
        layers_mean(want, r);
        for (size_t i = 0; i < PS_ROWS * PS_COLS; i++)
            worst = fmaxf(worst, fabsf(ms[0].seen[r * CG + i] - want[i]));
    }
    cr_assert_gt(worst, 0.1f, "the whole-buffer view reproduced the layers too (%g)", worst);
    compressed_pair_free(ms);
}

/* The same by shape with two contributions in flight: each round reduces
 * a slot's copy, not the trainer's buffer. */
Test(node, powersgd_by_shape_with_parallel_gradients)
{
    struct cmember ms[2];
    static float want[CG];

    for (int i = 0; i < 2; i++) {
        cmember_start("train", &ms[i], i, "powersgd:1", fill_layers, 2);
        cr_assert_eq(node_set_parallel_gradients(ms[i].n, 2), 0);
        cr_assert_eq(node_set_tensor_shapes(ms[i].n, layers, 3), 0);
    }
    for (int i = 0; i < 2; i++)
        pthread_create(&ms[i].t, NULL, cmember_main, &ms[i]);
    for (int i = 0; i < 2; i++) {
        pthread_join(ms[i].t, NULL);
        cr_assert_eq(ms[i].rc, 0, "member %d: %d", i, ms[i].rc);
    }
    for (uint64_t r = 0; r < CROUNDS; r++) {
        const float *got = ms[0].seen + r * CG;

        layers_mean(want, r);
        cr_assert_eq(memcmp(got, ms[1].seen + r * CG, CG * sizeof(float)), 0);
        for (size_t i = 0; i < CG; i++) {
            if (in_layer_matrix(i))
                cr_assert_leq(fabsf(got[i] - want[i]), 1e-3f * (1 + fabsf(want[i])), "round %d entry %zu",
                              (int)r, i);
            else
                cr_assert_eq(got[i], want[i], "round %d entry %zu is not exact", (int)r, i);
        }
    }
    compressed_pair_free(ms);
}

/* Members whose layouts differ (the second matrix 300 x 200 on one) run
 * uncompressed: every entry is exactly the mean, which rank 1 would not
 * give. So do members of which only one gave a layout. */
Test(node, members_with_different_layouts_run_uncompressed)
{
    static struct layout_shape transposed[3];
    const struct layout_shape *const differ[2] = { layers, transposed },
                                     *const one[2] = { NULL, layers };
    const size_t k[2] = { 3, 3 };
    struct cmember ms[2];
    static float want[CG];

    memcpy(transposed, layers, sizeof(transposed));
    transposed[2].rows = 300;
    transposed[2].cols = 200;
    for (int pass = 0; pass < 2; pass++) {
        layered_pair(ms, pass == 0 ? differ : one, k);
        for (uint64_t r = 0; r < CROUNDS; r++) {
            layers_mean(want, r);
            cr_assert_eq(memcmp(ms[0].seen + r * CG, ms[1].seen + r * CG, CG * sizeof(float)), 0);
            for (size_t i = 0; i < CG; i++)
                cr_assert_eq(ms[0].seen[r * CG + i], want[i], "pass %d round %d entry %zu", pass, (int)r,
                             i);
        }
        compressed_pair_free(ms);
    }
}

/* A layout needs the gradients it describes. */
Test(node, tensor_shapes_before_the_tensors_are_refused)
{
    struct node_config c = { .broker = broker, .cohort = "train", .host = "127.0.0.1", .id = "lone" };
    struct node *n;

    cr_assert_eq(node_start(&c, &n), 0);
    cr_assert_eq(node_set_tensor_shapes(n, layers, 3), -EINVAL);
    node_stop(n);
}

static bool reached_version_2(void *m)
{
    return atomic_load(&((struct cmember *)m)->version) >= 2;
}

/* Top-k across an epoch change: c-0 and c-1 commit versions 1 and 2, then
 * wait for c-2, which joins, takes the leader's state and contributes to
 * versions 3 to CROUNDS. Meanwhile c-1 declares version 1, so in the new
 * epoch it receives c-0's state too. The reducers follow the epoch (the
 * gather grows to three blocks); the joiner and c-1, which took the
 * leader's state, go on from a zero residual, and c-0 keeps its own:
 * every result is exactly what the simulation here gives, the same bytes
 * on every member that took part. */
Test(node, topk_residuals_carry_over_an_epoch_change_and_a_joiner_starts_at_zero)
{
    static struct cmember ms[3];
    static float resid[3][CG], acc[CG], expect[CG];
    static uint32_t idx[CG];
    size_t k;

    cr_assert_eq(topk_k_for_ratio(CG, (double)COMPRESS_TOPK_DEFAULT / COMPRESS_TOPK_ONE, &k), 0);
    for (int i = 0; i < 2; i++) {
        cmember_start("train", &ms[i], i, "topk:0.01", fill_integers, 2);
        ms[i].hold_at = 2;
        ms[i].hold_size = 3;
    }
    for (int i = 0; i < 2; i++)
        pthread_create(&ms[i].t, NULL, cmember_main, &ms[i]);
    cr_assert(fixture_wait_until(reached_version_2, &ms[0], 60000), "c-0 never reached version 2");
    cr_assert(fixture_wait_until(reached_version_2, &ms[1], 60000), "c-1 never reached version 2");
    cr_assert_eq(node_set_model_version(ms[1].n, 1), 0);
    cmember_start("train", &ms[2], 2, "topk:0.01", fill_integers, 3);
    pthread_create(&ms[2].t, NULL, cmember_main, &ms[2]);
    for (int i = 0; i < 3; i++) {
        pthread_join(ms[i].t, NULL);
        cr_assert_eq(ms[i].rc, 0, "member %d: %d", i, ms[i].rc);
    }
    memset(resid, 0, sizeof(resid));
    for (uint64_t v = 1; v <= CROUNDS; v++) {
        int members = v <= 2 ? 2 : 3;

        if (v == 3)
            memset(resid[1], 0, sizeof(resid[1]));     /* c-1 took the leader's state */
        cr_assert_eq(ms[0].grads_at[v], (uint64_t)members, "version %d", (int)v);
        memset(expect, 0, sizeof(expect));
        for (int m = 0; m < members; m++) {
            /* c-0 and c-1 sent their (v-1)th gradient; c-2 its (v-3)th. */
            fill_integers(acc, m, m < 2 ? v - 1 : v - 3);
            for (size_t i = 0; i < CG; i++)
                acc[i] += resid[m][i];
            cr_assert_eq(topk_select(acc, CG, k, idx), 0);
            for (size_t j = 0; j < k; j++) {
                expect[idx[j]] += acc[idx[j]];
                acc[idx[j]] = 0;
            }
            memcpy(resid[m], acc, sizeof(acc));
        }
        for (size_t i = 0; i < CG; i++)
            expect[i] /= (float)members;
        for (int m = 1; m < members; m++)
            cr_assert_eq(memcmp(ms[0].seen + (v - 1) * CG, ms[m].seen + (v - 1) * CG, CG * sizeof(float)),
                         0, "version %d: c-%d differs", (int)v, m);
        for (size_t i = 0; i < CG; i++)
            cr_assert_eq(ms[0].seen[(v - 1) * CG + i], expect[i], "version %d entry %zu: %g against %g",
                         (int)v, i, ms[0].seen[(v - 1) * CG + i], expect[i]);
    }
    for (int i = 0; i < 3; i++)
        cmember_free(&ms[i]);
}

/* ---- the spare step on a buffer of whole ring segments ---- */

#define WG (256u << 10)             /* 1 MiB of float32: on 2 members, chunks of two
                                     * whole 256 KiB ring segments */
#define WROUNDS 8

struct wmember {
    int index;
    size_t count;                   /* float32 gradients: WG, or what a test sets */
    struct node *n;
    _Alignas(64) double params[1];
    float *grads, *results;         /* count, then SPARE_FLOATS for the node */
    uint64_t made, applied;
    uint64_t bad;                   /* results that were not the exact mean */
    int rc;
    pthread_t t;
};

/* Small integers per member, entry and round: sums exact in float32. */
static float wvalue(int member, size_t i, uint64_t round)
{
    return (float)((int)((i * 7 + (size_t)member * 13 + round * 31) % 41) - 20);
}

/* One contribution a round, each checked against the mean of both
 * members' for the version it made. */
static void *wmember_main(void *arg)
{
    struct wmember *m = arg;
    uint64_t end = clock_now_ms() + 120000;
    struct node_view v;

    while (clock_now_ms() < end) {
        node_view(m->n, &v);
        if (v.model_version >= WROUNDS && !v.has_gradients)
            return NULL;
        if (!v.connected) {
            clock_sleep_ms(1);
            continue;
        }
        fixture_node_trade_state(m->n, &v);
        if (v.has_gradients) {
            /* Version v came from round v - 1 of both members. */
            for (size_t i = 0; i < m->count; i++)
                m->bad += v.num_gradients != 2 ||
                          m->results[i] != (wvalue(0, i, v.model_version - 1) +
                                            wvalue(1, i, v.model_version - 1)) / 2.0f;
            memset(m->grads, 0, m->count * sizeof(float));
            if (node_consume(m->n, v.rounds_committed) < 0)
                m->rc = -EPROTO;
            m->applied++;
        } else if (v.wants_gradients && v.size == 2) {
            for (size_t i = 0; i < m->count; i++)
                m->grads[i] = wvalue(m->index, i, m->made);
            if (node_contribute(m->n, 1) == 0)
                m->made++;
            else
                memset(m->grads, 0, m->count * sizeof(float));
        } else {
            clock_sleep_ms(1);
        }
    }
    m->rc = -ETIMEDOUT;
    return NULL;
}

/* `count` float32 on 2 members with room for the counters: every round
 * after the epoch's first is the spare step, one all-reduce: no count
 * step, no copy. Every result is the exact mean, the same on both
 * members. */
static void spare_step_rounds(size_t count)
{
    static uint64_t rows[64][NODE_STAGES];
    struct node_trace trace = { .ns = rows, .cap = 64 };
    struct wmember ms[2];
    struct node_view v;
    size_t one_step = 0;

    memset(rows, 0, sizeof(rows));
    for (int i = 0; i < 2; i++) {
        struct node_config c = { .broker = broker, .cohort = "train", .host = "127.0.0.1",
                                 .reduce_timeout_ms = 20000, .trace = i == 0 ? &trace : NULL };
        struct node_tensors t;
        char id[16];

        memset(&ms[i], 0, sizeof(ms[i]));
        ms[i].index = i;
        ms[i].count = count;
        /* aligned_alloc wants a multiple of the alignment. */
        ms[i].grads = aligned_alloc(64, ((count + SPARE_FLOATS) * sizeof(float) + 63) / 64 * 64);
        ms[i].results = aligned_alloc(64, ((count + SPARE_FLOATS) * sizeof(float) + 63) / 64 * 64);
        cr_assert(ms[i].grads && ms[i].results);
        snprintf(id, sizeof(id), "s-%d", i);
        c.id = id;
        cr_assert_eq(node_start(&c, &ms[i].n), 0);
        t = (struct node_tensors){ .params = ms[i].params, .params_bytes = sizeof(ms[i].params),
                                   .grads = ms[i].grads, .grad_count = count,
                                   .grad_type = DTYPE_F32, .results = ms[i].results,
                                   .grads_spare = SPARE_FLOATS * sizeof(float),
                                   .results_spare = SPARE_FLOATS * sizeof(float) };
        cr_assert_eq(node_register(ms[i].n, &t), 0);
        cr_assert_eq(node_set_virtual_batch_size(ms[i].n, 2), 0);
    }
    for (int i = 0; i < 2; i++)
        pthread_create(&ms[i].t, NULL, wmember_main, &ms[i]);
    for (int i = 0; i < 2; i++)
        pthread_join(ms[i].t, NULL);
    node_view(ms[0].n, &v);
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(ms[i].rc, 0, "s-%d: %d", i, ms[i].rc);
        cr_assert_geq(ms[i].applied, WROUNDS - 1, "s-%d applied %llu", i,
                      (unsigned long long)ms[i].applied);
        cr_assert_eq(ms[i].bad, 0, "s-%d: %llu entries not the exact mean", i,
                     (unsigned long long)ms[i].bad);
    }
    for (size_t r = 0; r < trace.rounds; r++)
        one_step += rows[r][NODE_STAGE_COUNT] == 0 && rows[r][NODE_STAGE_COPY_OUT] == 0;
    cr_assert_geq(trace.rounds, WROUNDS - 2, "%zu rows", trace.rounds);
    /* All but the first round of each epoch. */
    cr_assert_geq(one_step + v.epochs_seen, trace.rounds, "%zu of %zu rows, %llu epochs",
                  one_step, trace.rounds, (unsigned long long)v.epochs_seen);
    for (int i = 0; i < 2; i++) {
        node_stop(ms[i].n);
        free(ms[i].grads);
        free(ms[i].results);
    }
}

/* 1 MiB: the counters' 208 bytes are folded into the ring's last
 * segments (engine/ring.c, "Folding a tail") instead of adding a
 * segment. */
Test(node, a_buffer_of_whole_ring_segments_takes_the_spare_step)
{
    spare_step_rounds(WG);
}

/* 20 elements under recursive doubling's 256 KiB crossover: the counters
 * behind them would pass it, but they ride as the call's rider
 * (allreduce_run_rider), which leaves the choice to the gradients. */
Test(node, gradients_just_under_the_doubling_crossover_take_the_spare_step)
{
    spare_step_rounds((256u << 10) / sizeof(float) - 20);
}

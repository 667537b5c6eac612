/* examples/c/logreg.c: a trainer in C. Logistic regression (32 features
 * and a bias, float32) on deterministic synthetic data, trained with plain
 * SGD through cohort's Accumulator (include/cohort.h), following moolib's
 * loop exactly.
 *
 *   logreg [options]              joins through $COHORT_SOCKET (a sidecar)
 *                                 or $COHORT_BROKER (a node in-process)
 *   logreg --local [options]      the same SGD in one process, no cohort:
 *                                 the reference the cohort must match
 *
 * Data. Sample i of the stream is a pure function of (--seed, i): 32
 * features uniform in [-1, 1) and a label drawn from a fixed true logistic
 * model, so every trainer can produce any sample without storing a set.
 *
 * Sharding. Round v (the round that commits model version v + 1) uses
 * global samples [v * VB, (v + 1) * VB). With n members, rank r takes its
 * share of that range: VB / n samples, and the first VB mod n ranks one
 * more. Its gradient is the sum over its samples times n / VB, which is
 * the per-batch mean when n divides VB; cohort divides the sum of the n
 * contributions by n, so the committed gradient is the mean over the VB
 * samples either way, and the trajectory is single-process SGD's at batch
 * VB. With --batch B every contribution takes B samples instead and is
 * their mean; contribution k of rank r in round v starts at sample
 * v * VB + (k * n + r) * B. A member asked to contribute again in the same
 * round (the round was cut by a membership change, or the batches did not
 * reach VB) takes contribution k + 1's samples. A round that a membership
 * change cuts may so mix shares computed for two cohort sizes, and depart
 * from single-process SGD by that round's weighting; --wait-for N keeps
 * the first round from starting before N members are there.
 *
 * State. The opaque state is one text line: the data and optimiser flags
 * (a joiner with other flags refuses to train with the cohort) and the
 * number of samples the cohort has committed. The model version itself is
 * cohort's, and it picks the data.
 *
 * Output. stdout ends with "final model_version=V digest=D", D being FNV-1a
 * 64 over the parameter bytes in hex; stderr gets progress lines, one per
 * --log-every versions, each with "samples=N" (samples the cohort has
 * committed), which `cohortctl run` reads for its samples/s.
 *
 * --stats-file PATH writes one JSON object per line for tests ("%i" in
 * PATH is replaced by the member id): each contribution before it is made
 * ("contrib"), each committed round ("commit"), each received state
 * ("state", with whether the node dropped this member's pending
 * contributions because the leader's rounds hold them) and the end
 * ("final"). With --integer-grads each contribution is
 * a vector of small integers, so the accounting of every round can be
 * checked exactly: "total" is the sum of the elements, "wsum" the sum of
 * (j + 1) * element j, and a commit reports the committed result times
 * num_gradients, rounded, next to this member's own part ("mine_*").
 */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cohort.h"

#define PROG "logreg"
#define FEATURES 32
#define NPARAM (FEATURES + 1)           /* weights, then the bias */
#define EVAL_SAMPLES 2048
#define EVAL_BASE (1ull << 40)          /* eval samples live far from training ones */
#define STATE_MAX 512
#define IDLE_MS 100                     /* longest wait when there is nothing to do */

static const char usage[] =
    "Usage: " PROG " [options]\n"
    "\n"
    "Logistic regression (32 features and a bias) on deterministic synthetic\n"
    "data, trained with SGD through cohort's Accumulator. Connects through\n"
    "$COHORT_SOCKET (unix:PATH, a sidecar) or $COHORT_BROKER (host:port, with\n"
    "$COHORT_COHORT and $COHORT_ID), or --connect. Each round v uses the global\n"
    "samples [v*VB, (v+1)*VB), shared out by rank; the committed gradient is\n"
    "their mean, so N members follow single-process SGD at batch VB.\n"
    "\n"
    "  --steps N            stop at model version N (default 100)\n"
    "  --virtual-batch VB   samples per committed round (default 256)\n"
    "  --batch B            samples per contribution (default: this member's\n"
    "                       share of VB: VB/size, the first VB%size ranks +1)\n"
    "  --lr X               learning rate (default 0.5)\n"
    "  --seed N             data seed (default 1)\n"
    "  --integer-grads      contribute small-integer vectors instead of real\n"
    "                       gradients, for exact accounting checks\n"
    "  --local              plain SGD in this process, no cohort (reference)\n"
    "  --connect ADDR       unix:PATH or host:port instead of the environment\n"
    "  --stats-file PATH    JSON lines per contribution, commit, state and end\n"
    "                       (%i in PATH becomes the member id)\n"
    "  --params-out PATH    write the final parameters, one per line (%i too)\n"
    "  --log-every N        a progress line every N versions (default 10)\n"
    "  --wait-for N         make the first contribution only once N members are\n"
    "                       in the cohort, so that a cohort starting together\n"
    "                       follows single-process SGD from the first round\n"
    "  --delay DUR          sleep this long before each contribution, to slow a\n"
    "                       run down enough to watch it or schedule events in it\n"
    "  --linger DUR         after the last version, keep serving the cohort\n"
    "                       (state to late members) this long (default 1s)\n"
    "  --connect-timeout DUR  give up connecting after this (default 30s)\n"
    "  --stall-timeout DUR  give up when no round commits for this (default 120s)\n"
    "  -h, --help           show this text\n"
    "\n"
    "DUR: 500ms, 2s, 1.5s. Exit status: 0 done, 1 failure (the sidecar died,\n"
    "flags differ from the cohort's, a stall), 2 usage error.\n";

struct opts {
    uint64_t steps, vb, batch, seed, log_every, wait_for;
    float lr;
    bool integer, local;
    const char *connect, *stats_path, *params_path;
    double linger_s, connect_timeout_s, stall_timeout_s, delay_s;
};

/* What a run keeps besides the parameters. */
struct trainer {
    struct opts o;
    const char *id;
    FILE *stats;
    uint64_t samples;           /* samples the cohort has committed */
    float last_loss;
    /* Contributions since the gradients were last zeroed (integer mode
     * keeps them exactly): what this member has in the cohort's hands. */
    int64_t tally[NPARAM];
    uint64_t tally_calls;
    uint64_t my_version;        /* the version this trainer last acted on */
    uint64_t dropped_seen;      /* the node's contributions_dropped, last read */
    uint64_t k_version, k;      /* contributions made in round k_version */
    uint64_t last_epoch;
};

/* ---- deterministic data ------------------------------------------------ */

static uint64_t mix(uint64_t z)
{
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t hash3(uint64_t seed, uint64_t a, uint64_t b)
{
    return mix(mix(mix(seed) ^ a) ^ b);
}

/* Uniform in [0, 1), exactly representable in float. */
static float unit(uint64_t h)
{
    return (float)(h >> 40) * (1.0f / 16777216.0f);
}

enum { STREAM_X = 1, STREAM_Y = 2, STREAM_TRUE = 3, STREAM_INT = 4 };

static void true_model(uint64_t seed, float w[NPARAM])
{
    for (int j = 0; j < FEATURES; j++)
        w[j] = 4.0f * unit(hash3(seed, STREAM_TRUE, (uint64_t)j)) - 2.0f;
    w[FEATURES] = 0.5f;
}

static float sigmoid(float z)
{
    return z >= 0 ? 1.0f / (1.0f + expf(-z)) : expf(z) / (1.0f + expf(z));
}

/* log(1 + e^z) - y z, computed without overflow. */
static float bce(float z, float y)
{
    float sp = z > 0 ? z + log1pf(expf(-z)) : log1pf(expf(z));
    return sp - y * z;
}

static void sample(uint64_t seed, const float wtrue[NPARAM], uint64_t i, float x[FEATURES], float *y)
{
    float z = wtrue[FEATURES];

    for (int j = 0; j < FEATURES; j++) {
        x[j] = 2.0f * unit(hash3(seed, i * 64 + STREAM_X, (uint64_t)j)) - 1.0f;
        z += wtrue[j] * x[j];
    }
    *y = unit(hash3(seed, i * 64 + STREAM_Y, 0)) < sigmoid(z) ? 1.0f : 0.0f;
}

/* Adds scale * (the gradient summed over samples [start, start + count))
 * into g and returns their mean loss. */
static float gradient(const struct opts *o, const float *w, uint64_t start, uint64_t count,
                      float scale, float *g)
{
    float wtrue[NPARAM], sum[NPARAM] = { 0 }, x[FEATURES], y;
    double loss = 0;

    true_model(o->seed, wtrue);
    for (uint64_t i = start; i < start + count; i++) {
        float z = w[FEATURES], d;
        sample(o->seed, wtrue, i, x, &y);
        for (int j = 0; j < FEATURES; j++)
            z += w[j] * x[j];
        d = sigmoid(z) - y;
        for (int j = 0; j < FEATURES; j++)
            sum[j] += d * x[j];
        sum[FEATURES] += d;
        loss += bce(z, y);
    }
    for (int j = 0; j < NPARAM; j++)
        g[j] += sum[j] * scale;
    return count ? (float)(loss / (double)count) : 0.0f;
}

static void evaluate(const struct opts *o, const float *w, double *loss, double *acc)
{
    float wtrue[NPARAM], x[FEATURES], y;
    double l = 0;
    int right = 0;

    true_model(o->seed, wtrue);
    for (uint64_t i = 0; i < EVAL_SAMPLES; i++) {
        float z = w[FEATURES];
        sample(o->seed, wtrue, EVAL_BASE + i, x, &y);
        for (int j = 0; j < FEATURES; j++)
            z += w[j] * x[j];
        l += bce(z, y);
        right += (z > 0) == (y > 0.5f);
    }
    *loss = l / EVAL_SAMPLES;
    *acc = (double)right / EVAL_SAMPLES;
}

static uint64_t fnv1a(const void *p, size_t n)
{
    const unsigned char *b = p;
    uint64_t h = 0xcbf29ce484222325ull;

    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

/* ---- small helpers ------------------------------------------------------ */

static void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void say(const char *fmt, ...)
{
    char line[512];
    va_list ap;
    int n;

    va_start(ap, fmt);
    n = vsnprintf(line, sizeof(line) - 1, fmt, ap);
    va_end(ap);
    if (n < 0)
        return;
    if ((size_t)n > sizeof(line) - 2)
        n = (int)sizeof(line) - 2;
    line[n++] = '\n';
    /* One write per line keeps lines whole among several processes. */
    if (write(STDERR_FILENO, PROG ": ", sizeof(PROG ": ") - 1) < 0 || write(STDERR_FILENO, line, (size_t)n) < 0)
        return;
}

static void stat_line(struct trainer *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void stat_line(struct trainer *t, const char *fmt, ...)
{
    va_list ap;

    if (!t->stats)
        return;
    va_start(ap, fmt);
    vfprintf(t->stats, fmt, ap);
    va_end(ap);
    fputc('\n', t->stats);
    /* Flushed at once: a trainer killed with SIGKILL leaves what it did. */
    fflush(t->stats);
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void sleep_us(long us)
{
    struct timespec ts = { us / 1000000, (us % 1000000) * 1000 };
    nanosleep(&ts, NULL);
}

static int parse_u64(const char *s, uint64_t min, uint64_t max, uint64_t *out)
{
    char *end;
    unsigned long long v;

    if (!s || *s < '0' || *s > '9')
        return -EINVAL;
    errno = 0;
    v = strtoull(s, &end, 10);
    if (errno || *end || v < min || v > max)
        return -EINVAL;
    *out = v;
    return 0;
}

/* "250ms", "2s", "1.5s", "1m". */
static int parse_dur(const char *s, double *out)
{
    char *end;
    double v;

    if (!s || *s < '0' || *s > '9')
        return -EINVAL;
    v = strtod(s, &end);
    if (strcmp(end, "ms") == 0)
        v /= 1000;
    else if (strcmp(end, "m") == 0)
        v *= 60;
    else if (strcmp(end, "s") != 0)
        return -EINVAL;
    if (!(v >= 0) || v > 86400)
        return -EINVAL;
    *out = v;
    return 0;
}

/* PATH with "%i" replaced by the member id. Caller frees. */
static char *expand(const char *path, const char *id)
{
    size_t n = strlen(path) + 1, k = 0;
    char *out;

    for (const char *p = path; (p = strstr(p, "%i")) != NULL; p += 2)
        n += strlen(id);
    out = malloc(n);
    if (!out)
        return NULL;
    for (const char *p = path; *p;) {
        if (p[0] == '%' && p[1] == 'i') {
            memcpy(out + k, id, strlen(id));
            k += strlen(id);
            p += 2;
        } else {
            out[k++] = *p++;
        }
    }
    out[k] = '\0';
    return out;
}

static int write_params(const struct trainer *t, const float *w)
{
    char *path = expand(t->o.params_path, t->id);
    FILE *f = path ? fopen(path, "w") : NULL;

    if (!f) {
        say("cannot write the parameters to %s: %s.", path ? path : t->o.params_path, strerror(errno));
        free(path);
        return -EIO;
    }
    for (int j = 0; j < NPARAM; j++)
        fprintf(f, "%.9g\n", (double)w[j]);
    fclose(f);
    free(path);
    return 0;
}

static int finish(struct trainer *t, const float *w, uint64_t version)
{
    uint64_t digest = fnv1a(w, NPARAM * sizeof(float));
    double loss, acc;

    evaluate(&t->o, w, &loss, &acc);
    say("done: model_version=%" PRIu64 " eval_loss=%.4f eval_accuracy=%.4f samples=%" PRIu64 ".",
        version, loss, acc, t->samples);
    stat_line(t, "{\"ev\":\"final\",\"v\":%" PRIu64 ",\"digest\":\"%016" PRIx64 "\","
              "\"eval_loss\":%.6f,\"eval_accuracy\":%.6f}", version, digest, loss, acc);
    if (t->o.params_path && write_params(t, w) < 0)
        return 1;
    printf("final model_version=%" PRIu64 " digest=%016" PRIx64 "\n", version, digest);
    fflush(stdout);
    return 0;
}

/* ---- the contribution -------------------------------------------------- */

/* Integer mode: element j of contribution k of rank r in round v, a small
 * positive integer, so sums are exact in float32 and nothing can cancel. */
static float int_elem(uint64_t seed, uint64_t v, uint64_t r, uint64_t k, int j)
{
    return (float)(1 + hash3(seed ^ STREAM_INT, (v << 24) ^ (r << 12) ^ k, (uint64_t)j) % 3);
}

/* Which samples contribution k of `rank` of `size` takes in round v, how
 * many, and the factor that turns their gradient sum into this member's
 * part of the round's mean. */
static void shard(const struct opts *o, uint64_t v, uint32_t rank, uint32_t size, uint64_t k,
                  uint64_t *start, uint64_t *count, float *scale)
{
    if (o->batch) {
        *count = o->batch;
        *start = v * o->vb + (k * size + rank) * o->batch;
        *scale = 1.0f / (float)o->batch;
        return;
    }
    uint64_t base = o->vb / size, extra = o->vb % size;
    *count = base + (rank < extra);
    *start = v * o->vb + k * o->vb + rank * base + (rank < extra ? rank : extra);
    *scale = (float)((double)size / (double)o->vb);
}

/* Adds this member's contribution into g (and, in integer mode, into the
 * tally delta d). Returns the batch size to report. */
static uint64_t contribution(struct trainer *t, const float *w, float *g, int64_t *d, uint64_t v,
                             uint32_t rank, uint32_t size, uint64_t k)
{
    uint64_t start, count;
    float scale;

    shard(&t->o, v, rank, size, k, &start, &count, &scale);
    if (t->o.integer) {
        for (int j = 0; j < NPARAM; j++) {
            float e = int_elem(t->o.seed, v, rank, k, j);
            g[j] += e;
            d[j] = (int64_t)e;
        }
        t->last_loss = 0;
    } else {
        t->last_loss = gradient(&t->o, w, start, count, scale, g);
    }
    return count;
}

static void vec_sums(const int64_t *v, int64_t *total, int64_t *wsum)
{
    *total = 0;
    *wsum = 0;
    for (int j = 0; j < NPARAM; j++) {
        *total += v[j];
        *wsum += (int64_t)(j + 1) * v[j];
    }
}

/* ---- local SGD: the reference ------------------------------------------ */

static int run_local(struct trainer *t)
{
    float w[NPARAM] = { 0 }, g[NPARAM];
    int64_t d[NPARAM];

    t->id = "local";
    for (uint64_t v = 0; v < t->o.steps; v++) {
        uint64_t per = t->o.batch ? t->o.batch : t->o.vb;
        uint64_t calls = t->o.batch ? (t->o.vb + per - 1) / per : 1, batch = 0;
        memset(g, 0, sizeof(g));
        /* The same contributions a one-member cohort makes, and the same
         * division by their number. */
        for (uint64_t k = 0; k < calls; k++)
            batch += contribution(t, w, g, d, v, 0, 1, k);
        for (int j = 0; j < NPARAM; j++) {
            g[j] = g[j] / (float)calls;
            w[j] -= t->o.lr * g[j];
        }
        t->samples += batch;
        stat_line(t, "{\"ev\":\"commit\",\"v\":%" PRIu64 ",\"epoch\":0,\"size\":1,\"rank\":0,"
                  "\"G\":%" PRIu64 ",\"batch\":%" PRIu64 ",\"loss\":%.7g}", v + 1, calls, batch,
                  (double)t->last_loss);
        if ((v + 1) % t->o.log_every == 0)
            say("model_version=%" PRIu64 " loss=%.4f samples=%" PRIu64 " members=1 (local)", v + 1,
                (double)t->last_loss, t->samples);
    }
    return finish(t, w, t->o.steps);
}

/* ---- cohort ------------------------------------------------------------ */

static int state_encode(const struct trainer *t, char *buf, size_t cap)
{
    return snprintf(buf, cap, "logreg/1 features=%d seed=%" PRIu64 " vb=%" PRIu64 " lr=%a integer=%d "
                    "samples=%" PRIu64, FEATURES, t->o.seed, t->o.vb, (double)t->o.lr,
                    t->o.integer, t->samples);
}

/* Adopts the leader's state. Returns 0, or -EINVAL (after saying why) when
 * this trainer was started with flags that differ from the cohort's. */
static int state_adopt(struct trainer *t, const void *state, size_t len)
{
    char buf[STATE_MAX + 1], mine[STATE_MAX];
    const char *s;
    size_t mlen;

    if (len > STATE_MAX) {
        say("the leader's state is %zu bytes, not a logreg state; refusing it.", len);
        return -EINVAL;
    }
    memcpy(buf, state, len);
    buf[len] = '\0';
    /* Everything but the sample count must match this trainer's own. */
    state_encode(t, mine, sizeof(mine));
    s = strstr(buf, " samples=");
    mlen = (size_t)(strstr(mine, " samples=") - mine);
    if (!s || (size_t)(s - buf) != mlen || memcmp(buf, mine, mlen) != 0) {
        say("the cohort trains with other flags (leader: \"%s\"; this trainer: \"%.*s\"); stopping.",
            buf, (int)mlen, mine);
        return -EINVAL;
    }
    if (parse_u64(s + strlen(" samples="), 0, UINT64_MAX, &t->samples) < 0) {
        say("the leader's state \"%s\" has a bad sample count; stopping.", buf);
        return -EINVAL;
    }
    return 0;
}

/* Applies a committed result and accounts for it. */
static void apply(struct trainer *t, struct cohort *c, float *w, const float *g)
{
    struct cohort_gradient_stats st;
    uint64_t v = cohort_model_version(c);

    cohort_get_gradient_stats(c, &st);
    if (t->o.integer) {
        int64_t res[NPARAM], total, wsum, mt, mw;
        for (int j = 0; j < NPARAM; j++)
            res[j] = llround((double)g[j] * (double)st.num_gradients);
        vec_sums(res, &total, &wsum);
        vec_sums(t->tally, &mt, &mw);
        stat_line(t, "{\"ev\":\"commit\",\"v\":%" PRIu64 ",\"epoch\":%" PRIu64 ",\"size\":%u,"
                  "\"rank\":%u,\"G\":%" PRIu64 ",\"skipped\":%" PRIu64 ",\"batch\":%" PRIu64 ","
                  "\"total\":%" PRId64 ",\"wsum\":%" PRId64 ",\"mine_total\":%" PRId64 ","
                  "\"mine_wsum\":%" PRId64 ",\"mine_calls\":%" PRIu64 "}",
                  v, st.epoch, cohort_size(c), cohort_rank(c), st.num_gradients, st.num_skipped,
                  st.batch_size, total, wsum, mt, mw, t->tally_calls);
    } else {
        stat_line(t, "{\"ev\":\"commit\",\"v\":%" PRIu64 ",\"epoch\":%" PRIu64 ",\"size\":%u,"
                  "\"rank\":%u,\"G\":%" PRIu64 ",\"batch\":%" PRIu64 ",\"loss\":%.7g}",
                  v, st.epoch, cohort_size(c), cohort_rank(c), st.num_gradients, st.batch_size,
                  (double)t->last_loss);
    }
    for (int j = 0; j < NPARAM; j++)
        w[j] -= t->o.lr * g[j];
    memset(t->tally, 0, sizeof(t->tally));
    t->tally_calls = 0;
    t->samples += st.batch_size;
    t->my_version = v;
    if (v % t->o.log_every == 0)
        say("model_version=%" PRIu64 " loss=%.4f samples=%" PRIu64 " members=%u rank=%u epoch=%"
            PRIu64 " leader=%s", v, (double)t->last_loss, t->samples, cohort_size(c),
            cohort_rank(c), st.epoch, cohort_get_leader(c));
}

/* Makes one contribution. Returns 0, or a negative errno from cohort. */
static int contribute(struct trainer *t, struct cohort *c, const float *w, float *g)
{
    uint64_t v = cohort_model_version(c), batch;
    uint32_t rank = cohort_rank(c), size = cohort_size(c);
    int64_t d[NPARAM] = { 0 }, total, wsum;
    float before[NPARAM];
    int rc;

    if (t->o.delay_s > 0)
        sleep_us((long)(t->o.delay_s * 1e6));
    if (t->k_version != v) {
        t->k_version = v;
        t->k = 0;
    }
    memcpy(before, g, sizeof(before));
    batch = contribution(t, w, g, d, v, rank, size, t->k);
    vec_sums(d, &total, &wsum);
    /* Logged before the call: a trainer killed between the two leaves a
     * line for a contribution that may have been made. */
    stat_line(t, "{\"ev\":\"contrib\",\"v\":%" PRIu64 ",\"epoch\":%" PRIu64 ",\"rank\":%u,"
              "\"size\":%u,\"k\":%" PRIu64 ",\"batch\":%" PRIu64 ",\"total\":%" PRId64 ","
              "\"wsum\":%" PRId64 ",\"loss\":%.7g}", v, t->last_epoch, rank, size, t->k, batch,
              total, wsum, (double)t->last_loss);
    rc = cohort_reduce_gradients(c, batch);
    if (rc < 0) {
        /* Not made. On -EPERM the view moved under us (a new epoch began);
         * on -EAGAIN a state transfer is under way (an epoch that formed
         * as members came back one at a time, include/cohort.h): either
         * way take it back out and contribute when asked again. After
         * -EAGAIN the next update() zeroes the gradients, and the state
         * event says whether pending contributions went with them. */
        memcpy(g, before, sizeof(before));
        stat_line(t, "{\"ev\":\"undo\",\"v\":%" PRIu64 ",\"error\":%d}", v, rc);
        return rc == -EPERM || rc == -EAGAIN ? 0 : rc;
    }
    for (int j = 0; j < NPARAM; j++)
        t->tally[j] += d[j];
    t->tally_calls++;
    t->k++;
    return 0;
}

static int connect_retrying(struct trainer *t, struct cohort *c)
{
    double deadline = now_s() + t->o.connect_timeout_s;
    int rc;

    for (;;) {
        rc = cohort_connect(c, t->o.connect);
        if (rc == 0)
            return 0;
        /* The sidecar may not be listening yet. */
        if ((rc != -ECONNREFUSED && rc != -ENOENT) || now_s() > deadline)
            break;
        sleep_us(50000);
    }
    say("cannot connect to %s: %s.", t->o.connect ? t->o.connect :
        getenv("COHORT_SOCKET") ? getenv("COHORT_SOCKET") :
        getenv("COHORT_BROKER") ? getenv("COHORT_BROKER") : "(no COHORT_SOCKET or COHORT_BROKER)",
        cohort_strerror(rc));
    return rc;
}

/* One pass of moolib's loop. `done`: only serve the cohort (state for
 * late members), contribute nothing. Returns 0, 1 once the last version
 * is reached, or a negative errno. */
static int step(struct trainer *t, struct cohort *c, float *w, float *g, bool done, bool *idle)
{
    struct cohort_gradient_stats st;
    const void *state;
    size_t len;
    int rc;

    *idle = true;
    rc = cohort_update(c);
    if (rc < 0)
        return rc;
    if (!cohort_connected(c))
        return 0;
    cohort_get_gradient_stats(c, &st);
    if (st.epoch != t->last_epoch) {
        t->last_epoch = st.epoch;
        say("epoch %" PRIu64 ": rank %u of %u, leader %s, model_version=%" PRIu64 ".", st.epoch,
            cohort_rank(c), cohort_size(c), cohort_get_leader(c), cohort_model_version(c));
    }
    if (cohort_wants_state(c)) {
        char buf[STATE_MAX];
        int n = state_encode(t, buf, sizeof(buf));
        *idle = false;
        rc = cohort_set_state(c, buf, (size_t)n);
        if (rc < 0 && rc != -EPERM)
            return rc;
    }
    if (cohort_has_new_state(c)) {
        uint64_t v = cohort_model_version(c);
        int64_t mt, mw;
        *idle = false;
        rc = cohort_state(c, &state, &len);
        if (rc < 0)
            return rc;
        vec_sums(t->tally, &mt, &mw);
        /* Behind the leader, the node drops our pending contributions only
         * where the leader's rounds hold them (or may: include/cohort.h);
         * otherwise they stay ours, for the next round. Its count says
         * which. */
        struct cohort_gradient_stats gs;
        rc = cohort_get_gradient_stats(c, &gs);
        if (rc < 0)
            return rc;
        bool dropped = gs.contributions_dropped != t->dropped_seen;
        t->dropped_seen = gs.contributions_dropped;
        stat_line(t, "{\"ev\":\"state\",\"from_v\":%" PRIu64 ",\"to_v\":%" PRIu64 ",\"epoch\":%"
                  PRIu64 ",\"dropped\":%s,\"mine_total\":%" PRId64 ",\"mine_wsum\":%" PRId64 ","
                  "\"mine_calls\":%" PRIu64 "}", t->my_version, v, t->last_epoch,
                  dropped ? "true" : "false", mt, mw, t->tally_calls);
        if (dropped) {
            memset(t->tally, 0, sizeof(t->tally));
            t->tally_calls = 0;
        }
        t->my_version = v;
        if (state_adopt(t, state, len) < 0)
            return -ECANCELED;          /* said why already */
        say("received the leader's state at model_version=%" PRIu64 " (samples=%" PRIu64 ").", v,
            t->samples);
    }
    if (cohort_has_gradients(c)) {
        *idle = false;
        apply(t, c, w, cohort_results(c));
        rc = cohort_zero_gradients(c);
        if (rc < 0)
            return rc;
    } else if (!done && cohort_wants_gradients(c) && cohort_model_version(c) < t->o.steps &&
               (cohort_model_version(c) > 0 || cohort_size(c) >= t->o.wait_for)) {
        *idle = false;
        rc = contribute(t, c, w, g);
        if (rc < 0)
            return rc;
    }
    return cohort_model_version(c) >= t->o.steps ? 1 : 0;
}

static int run_cohort(struct trainer *t)
{
    struct cohort_tensor params[] = {
        { .name = "weight", .dtype = COHORT_F32, .numel = FEATURES },
        { .name = "bias", .dtype = COHORT_F32, .numel = 1 },
    };
    struct cohort_config cfg = { .name = "logreg", .parameters = params, .n_parameters = 2 };
    struct cohort *c = NULL;
    double last_progress, t_done = 0;
    uint64_t progress_version = 0;
    bool done = false, idle;
    float *w, *g;
    int rc, status = 1;

    rc = cohort_create(&cfg, &c);
    if (rc < 0) {
        say("cannot create the accumulator: %s.", cohort_strerror(rc));
        return 1;
    }
    w = cohort_params(c);
    g = cohort_grads(c);
    if (connect_retrying(t, c) < 0)
        goto out;
    rc = cohort_set_virtual_batch_size(c, t->o.vb);
    if (rc < 0) {
        say("cannot set the virtual batch size: %s.", cohort_strerror(rc));
        goto out;
    }
    last_progress = now_s();
    for (;;) {
        rc = step(t, c, w, g, done, &idle);
        if (rc < 0) {
            if (rc == -ENOTCONN)
                say("the sidecar is gone; stopping at model_version=%" PRIu64 ".", t->my_version);
            else if (rc != -ECANCELED)
                say("the accumulator failed: %s.", cohort_strerror(rc));
            goto out;
        }
        if (t->my_version != progress_version) {
            progress_version = t->my_version;
            last_progress = now_s();
        }
        if (rc == 1 && !done) {
            done = true;
            t_done = now_s();
            t->my_version = cohort_model_version(c);
        }
        if (done && now_s() - t_done >= t->o.linger_s)
            break;
        if (!done && now_s() - last_progress > t->o.stall_timeout_s) {
            say("no round committed for %.0f s (model_version=%" PRIu64 ", connected=%d); stopping.",
                t->o.stall_timeout_s, cohort_model_version(c), cohort_connected(c));
            goto out;
        }
        /* Woken as soon as anything changes; the timeout keeps the stall
         * and linger clocks above ticking. */
        if (idle)
            cohort_wait(c, IDLE_MS);
    }
    status = finish(t, w, cohort_model_version(c));
out:
    cohort_destroy(c);
    return status;
}

static int bad(const char *fmt, const char *what)
{
    fprintf(stderr, PROG ": ");
    fprintf(stderr, fmt, what);
    fprintf(stderr, "\nTry '" PROG " --help'.\n");
    return 2;
}

int main(int argc, char **argv)
{
    enum { O_STEPS = 256, O_VB, O_BATCH, O_LR, O_SEED, O_INT, O_LOCAL, O_CONNECT, O_STATS,
           O_PARAMS, O_EVERY, O_LINGER, O_CTO, O_STALL, O_DELAY, O_WAIT };
    static const struct option longopts[] = {
        { "steps", required_argument, NULL, O_STEPS },
        { "virtual-batch", required_argument, NULL, O_VB },
        { "batch", required_argument, NULL, O_BATCH },
        { "lr", required_argument, NULL, O_LR },
        { "seed", required_argument, NULL, O_SEED },
        { "integer-grads", no_argument, NULL, O_INT },
        { "local", no_argument, NULL, O_LOCAL },
        { "connect", required_argument, NULL, O_CONNECT },
        { "stats-file", required_argument, NULL, O_STATS },
        { "params-out", required_argument, NULL, O_PARAMS },
        { "log-every", required_argument, NULL, O_EVERY },
        { "linger", required_argument, NULL, O_LINGER },
        { "connect-timeout", required_argument, NULL, O_CTO },
        { "stall-timeout", required_argument, NULL, O_STALL },
        { "delay", required_argument, NULL, O_DELAY },
        { "wait-for", required_argument, NULL, O_WAIT },
        { "help", no_argument, NULL, 'h' },
        { NULL, 0, NULL, 0 },
    };
    struct trainer t = { .o = { .steps = 100, .vb = 256, .seed = 1, .log_every = 10, .lr = 0.5f,
                                .linger_s = 1, .connect_timeout_s = 30, .stall_timeout_s = 120 } };
    char *stats_path = NULL;
    int opt, status;

    while ((opt = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
        switch (opt) {
        case O_STEPS:
            if (parse_u64(optarg, 1, 1u << 30, &t.o.steps) < 0)
                return bad("bad --steps \"%s\" (1 or more)", optarg);
            break;
        case O_VB:
            if (parse_u64(optarg, 1, 1u << 24, &t.o.vb) < 0)
                return bad("bad --virtual-batch \"%s\" (1 to 16777216)", optarg);
            break;
        case O_BATCH:
            if (parse_u64(optarg, 1, 1u << 24, &t.o.batch) < 0)
                return bad("bad --batch \"%s\" (1 to 16777216)", optarg);
            break;
        case O_LR: {
            char *end;
            double v = strtod(optarg, &end);
            if (*optarg == '\0' || *end || !(v > 0) || v > 1e6)
                return bad("bad --lr \"%s\" (a positive number)", optarg);
            t.o.lr = (float)v;
            break;
        }
        case O_SEED:
            if (parse_u64(optarg, 0, UINT64_MAX, &t.o.seed) < 0)
                return bad("bad --seed \"%s\"", optarg);
            break;
        case O_INT: t.o.integer = true; break;
        case O_LOCAL: t.o.local = true; break;
        case O_CONNECT: t.o.connect = optarg; break;
        case O_STATS: t.o.stats_path = optarg; break;
        case O_PARAMS: t.o.params_path = optarg; break;
        case O_EVERY:
            if (parse_u64(optarg, 1, UINT64_MAX, &t.o.log_every) < 0)
                return bad("bad --log-every \"%s\" (1 or more)", optarg);
            break;
        case O_LINGER:
            if (parse_dur(optarg, &t.o.linger_s) < 0)
                return bad("bad --linger \"%s\" (a duration: 500ms, 2s)", optarg);
            break;
        case O_CTO:
            if (parse_dur(optarg, &t.o.connect_timeout_s) < 0)
                return bad("bad --connect-timeout \"%s\" (a duration: 500ms, 2s)", optarg);
            break;
        case O_STALL:
            if (parse_dur(optarg, &t.o.stall_timeout_s) < 0 || t.o.stall_timeout_s == 0)
                return bad("bad --stall-timeout \"%s\" (a duration: 500ms, 2s)", optarg);
            break;
        case O_WAIT:
            if (parse_u64(optarg, 0, 1u << 20, &t.o.wait_for) < 0)
                return bad("bad --wait-for \"%s\"", optarg);
            break;
        case O_DELAY:
            if (parse_dur(optarg, &t.o.delay_s) < 0 || t.o.delay_s > 60)
                return bad("bad --delay \"%s\" (a duration up to 1m: 10ms)", optarg);
            break;
        case 'h':
            fputs(usage, stdout);
            return 0;
        default:
            fprintf(stderr, "Try '" PROG " --help'.\n");
            return 2;
        }
    }
    if (optind < argc)
        return bad("unexpected argument \"%s\"", argv[optind]);
    if (t.o.local && t.o.connect)
        return bad("%s", "--local and --connect exclude each other");

    t.id = t.o.local ? "local" : getenv("COHORT_ID") ? getenv("COHORT_ID") : "trainer";
    if (t.o.stats_path) {
        stats_path = expand(t.o.stats_path, t.id);
        t.stats = stats_path ? fopen(stats_path, "w") : NULL;
        if (!t.stats) {
            fprintf(stderr, PROG ": cannot open --stats-file %s: %s\n", t.o.stats_path, strerror(errno));
            free(stats_path);
            return 1;
        }
    }
    status = t.o.local ? run_local(&t) : run_cohort(&t);
    if (t.stats)
        fclose(t.stats);
    free(stats_path);
    return status;
}

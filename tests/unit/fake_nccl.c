/* tests/unit/fake_nccl.c: see fake_nccl.h. */
#include "fake_nccl.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum kind { K_ALLREDUCE, K_BROADCAST };

struct part {
    uint64_t send, recv;
    double scale;
};

struct fake_nccl_group {
    struct fake_nccl_group *next;
    struct ncomm_id id;
    /* A shrink's child: its parent group and the parent's ranks left out. */
    struct fake_nccl_group *parent;
    unsigned exclude;
    bool revoked;                       /* NCCL_SHRINK_ABORT terminated its work */
    bool stuck;                         /* shrunk under work in flight: never ready */
    int nranks, joined;
    uint64_t done;                      /* collectives finished */
    /* The collective being gathered (number done + 1). */
    int parts;
    enum kind kind;
    size_t count;
    enum ncomm_type type;
    int root;
    struct part part[FAKE_NCCL_RANKS];
};

static void note(struct fake_nccl *f, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void note(struct fake_nccl *f, const char *fmt, ...)
{
    va_list ap;
    size_t len = strlen(f->log);

    va_start(ap, fmt);
    vsnprintf(f->log + len, sizeof(f->log) - len, fmt, ap);
    va_end(ap);
}

void fake_nccl_world_init(struct fake_nccl_world *w)
{
    memset(w, 0, sizeof(*w));
    pthread_mutex_init(&w->mu, NULL);
    w->next_id = 1;
}

void fake_nccl_world_free(struct fake_nccl_world *w)
{
    while (w->groups) {
        struct fake_nccl_group *g = w->groups;

        w->groups = g->next;
        free(g);
    }
    pthread_mutex_destroy(&w->mu);
}

int fake_nccl_live(struct fake_nccl_world *w)
{
    int n = 0;

    pthread_mutex_lock(&w->mu);
    for (int i = 0; i < w->ncomms; i++)
        n += w->comms[i].live;
    pthread_mutex_unlock(&w->mu);
    return n;
}

static int f_id(void *arg, struct ncomm_id *id)
{
    struct fake_nccl *f = arg;

    pthread_mutex_lock(&f->w->mu);
    memset(id->b, f->w->next_id++, sizeof(id->b));
    pthread_mutex_unlock(&f->w->mu);
    note(f, "id ");
    return 0;
}

static int f_init(void *arg, void **comm, int nranks, const struct ncomm_id *id, int rank)
{
    struct fake_nccl *f = arg;
    struct fake_nccl_world *w = f->w;
    struct fake_nccl_group *g;
    struct fake_nccl_comm *c;

    note(f, "init(%d,r%d) ", nranks, rank);
    if (f->fail_init)
        return f->fail_init;
    if (nranks > FAKE_NCCL_RANKS || rank < 0 || rank >= nranks)
        return -EINVAL;
    pthread_mutex_lock(&w->mu);
    for (g = w->groups; g; g = g->next)
        if (!g->parent && memcmp(g->id.b, id->b, sizeof(id->b)) == 0)
            break;
    if (!g) {
        g = calloc(1, sizeof(*g));
        g->id = *id;
        g->nranks = nranks;
        g->next = w->groups;
        w->groups = g;
    }
    if (w->ncomms == FAKE_NCCL_COMMS || g->nranks != nranks) {
        pthread_mutex_unlock(&w->mu);
        return -EINVAL;
    }
    c = &w->comms[w->ncomms++];
    *c = (struct fake_nccl_comm){ .g = g, .rank = rank, .live = true };
    g->joined++;
    pthread_mutex_unlock(&w->mu);
    *comm = c;
    return -EINPROGRESS;
}

static int f_async(void *arg, void *comm)
{
    struct fake_nccl *f = arg;
    struct fake_nccl_comm *c = comm;
    int rc;

    pthread_mutex_lock(&f->w->mu);
    rc = !c->live ? -EINVAL
         : c->g->joined < c->g->nranks || c->g->stuck ? -EINPROGRESS : 0;
    pthread_mutex_unlock(&f->w->mu);
    return rc;
}

static int f_abort(void *arg, void *comm)
{
    struct fake_nccl *f = arg;
    struct fake_nccl_comm *c = comm;

    note(f, "abort(r%d) ", c->rank);
    pthread_mutex_lock(&f->w->mu);
    c->live = false;
    pthread_mutex_unlock(&f->w->mu);
    return 0;
}

static size_t elem_size(enum ncomm_type t)
{
    return t == NCOMM_F64 ? 8 : t == NCOMM_F32 ? 4 : 2;
}

/* The k-th collective, once every rank queued its part. Lock held. */
static void compute(struct fake_nccl_group *g)
{
    size_t bytes = g->kind == K_BROADCAST ? g->count : g->count * elem_size(g->type);
    char *tmp = malloc(bytes ? bytes : 1);

    if (g->kind == K_BROADCAST) {
        memcpy(tmp, (void *)(uintptr_t)g->part[g->root].send, bytes);
    } else {
        for (size_t i = 0; i < g->count; i++) {
            if (g->type == NCOMM_F64) {
                double s = 0;

                for (int r = 0; r < g->nranks; r++)
                    s += ((const double *)(uintptr_t)g->part[r].send)[i] * g->part[r].scale;
                ((double *)(void *)tmp)[i] = s;
            } else {
                float s = 0;

                for (int r = 0; r < g->nranks; r++)
                    s += ((const float *)(uintptr_t)g->part[r].send)[i] * (float)g->part[r].scale;
                ((float *)(void *)tmp)[i] = s;
            }
        }
    }
    /* Every output after every input was read: in place is fine. */
    for (int r = 0; r < g->nranks; r++)
        memcpy((void *)(uintptr_t)g->part[r].recv, tmp, bytes);
    free(tmp);
    g->parts = 0;
    g->done++;
}

static int queue(struct fake_nccl *f, struct fake_nccl_comm *c, enum kind kind, uint64_t send,
                 uint64_t recv, size_t count, enum ncomm_type type, double scale, int root,
                 void *stream)
{
    struct fake_nccl_stream *s = stream;
    struct fake_nccl_group *g = c->g;

    pthread_mutex_lock(&f->w->mu);
    if (!c->live || g->revoked ||
        (kind == K_ALLREDUCE && type != NCOMM_F32 && type != NCOMM_F64)) {
        pthread_mutex_unlock(&f->w->mu);
        return -EINVAL;
    }
    c->queued++;
    s->g = g;
    s->seq = c->queued;
    if (!f->hold || kind != K_ALLREDUCE) {
        /* Ranks queue the k-th collective only after their (k-1)-th
         * finished, so the group gathers one at a time. */
        g->kind = kind;
        g->count = count;
        g->type = type;
        g->root = root;
        g->part[c->rank] = (struct part){ .send = send, .recv = recv, .scale = scale };
        if (++g->parts == g->nranks)
            compute(g);
    }
    pthread_mutex_unlock(&f->w->mu);
    return 0;
}

static int f_all_reduce(void *arg, void *comm, uint64_t send, uint64_t recv, size_t count,
                        enum ncomm_type type, double scale, void *stream)
{
    struct fake_nccl *f = arg;
    struct fake_nccl_comm *c = comm;

    note(f, "allreduce(r%d,%zu) ", c->rank, count);
    if (f->fail_all_reduce)
        return f->fail_all_reduce;
    return queue(f, c, K_ALLREDUCE, send, recv, count, type, scale, 0, stream);
}

static int f_broadcast(void *arg, void *comm, uint64_t send, uint64_t recv, size_t bytes,
                       int root, void *stream)
{
    struct fake_nccl *f = arg;
    struct fake_nccl_comm *c = comm;

    note(f, "bcast(r%d,%zu) ", c->rank, bytes);
    return queue(f, c, K_BROADCAST, send, recv, bytes, NCOMM_F32, 1.0, root, stream);
}

static int f_stream_query(void *arg, void *stream)
{
    struct fake_nccl *f = arg;
    struct fake_nccl_stream *s = stream;
    int rc;

    pthread_mutex_lock(&f->w->mu);
    rc = !s->g || s->g->done >= s->seq ? 0 : -EINPROGRESS;
    pthread_mutex_unlock(&f->w->mu);
    return rc;
}

/* ncclCommShrink, non-blocking: the child is in progress until every
 * remaining rank has called it with the same exclusions. */
static int f_shrink(void *arg, void *comm, const int *exclude, int nexclude, void **newcomm,
                    bool cancel)
{
    struct fake_nccl *f = arg;
    struct fake_nccl_world *w = f->w;
    struct fake_nccl_comm *c = comm, *child;
    struct fake_nccl_group *g, *p = c->g;
    unsigned mask = 0;
    int below = 0;

    note(f, "shrink(r%d,-%d%s) ", c->rank, nexclude, cancel ? ",abort" : "");
    if (f->fail_shrink)
        return f->fail_shrink;
    pthread_mutex_lock(&w->mu);
    if (!c->live || nexclude < 1 || nexclude >= p->nranks || w->ncomms == FAKE_NCCL_COMMS)
        goto invalid;
    for (int i = 0; i < nexclude; i++) {
        /* A rank out of range, listed twice, or the caller itself: NCCL
         * refuses it (an excluded rank must not call). */
        if (exclude[i] < 0 || exclude[i] >= p->nranks || (mask & (1u << exclude[i])) ||
            exclude[i] == c->rank)
            goto invalid;
        mask |= 1u << exclude[i];
        below += exclude[i] < c->rank;
    }
    if (cancel) {
        /* Terminate what is in flight on the parent: it never finishes. */
        p->revoked = true;
        p->parts = 0;
    }
    for (g = w->groups; g; g = g->next)
        if (g->parent == p && g->exclude == mask)
            break;
    if (!g) {
        g = calloc(1, sizeof(*g));
        if (!g)
            goto invalid;
        g->parent = p;
        g->exclude = mask;
        g->nranks = p->nranks - nexclude;
        g->next = w->groups;
        w->groups = g;
    }
    /* Without NCCL_SHRINK_ABORT, work of this rank still in flight on the
     * parent holds the shrink up. */
    if (!cancel && !p->revoked && c->queued > p->done)
        g->stuck = true;
    child = &w->comms[w->ncomms++];
    *child = (struct fake_nccl_comm){ .g = g, .rank = c->rank - below, .live = true };
    g->joined++;
    pthread_mutex_unlock(&w->mu);
    *newcomm = child;
    return -EINPROGRESS;
invalid:
    pthread_mutex_unlock(&w->mu);
    return -EINVAL;
}

void fake_nccl_with_shrink(struct fake_nccl *f)
{
    f->ops.shrink = f_shrink;
}

void fake_nccl_init(struct fake_nccl *f, struct fake_nccl_world *w)
{
    memset(f, 0, sizeof(*f));
    f->w = w;
    f->ops = (struct ncomm_ops){
        .get_unique_id = f_id, .init_rank = f_init, .async_error = f_async, .abort = f_abort,
        .all_reduce = f_all_reduce,
        .broadcast = f_broadcast, .stream_query = f_stream_query, .arg = f,
    };
}

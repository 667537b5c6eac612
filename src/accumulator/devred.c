/* src/accumulator/devred.c: see devred.h. */
#include "accumulator/devred.h"

#include <errno.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "base/log.h"

struct devred {
    const struct ncomm_ops *ops;        /* borrowed; NULL: no NCCL */
    const struct devred_mem *mem;       /* borrowed */
    struct ncomm *c;                    /* NULL without ops */
    unsigned failures;                  /* setups failed in a row */
    bool gave_up_logged;
    atomic_bool result;                 /* the last step's result is in the scratch */
    atomic_uint_fast64_t epochs;
    atomic_uint_fast64_t shrinks;
};

int devred_create(const struct ncomm_ops *ops, const struct devred_mem *mem, struct devred **out)
{
    struct devred *d;
    int rc;

    if (!mem || !mem->gather || !mem->enter || !mem->zero_scratch || !mem->to_scratch ||
        !mem->from_scratch || mem->count == 0)
        return -EINVAL;
    d = calloc(1, sizeof(*d));
    if (!d)
        return -ENOMEM;
    d->ops = ops;
    d->mem = mem;
    if (ops && (rc = ncomm_create(ops, &d->c)) < 0) {
        free(d);
        return rc;
    }
    *out = d;
    return 0;
}

void devred_destroy(struct devred *d)
{
    if (!d)
        return;
    ncomm_destroy(d->c);
    free(d);
}

static bool can(void *arg)
{
    struct devred *d = arg;

    if (!d->c || !d->ops->all_reduce || !d->ops->stream_query)
        return false;
    if (d->failures >= DEVRED_TRIES_MAX) {
        if (!d->gave_up_logged)
            log_warn("gpu", "The NCCL communicator failed in several epochs in a row; this member reduces host-staged from now on.",
                     LF_U("tries", d->failures));
        d->gave_up_logged = true;
        return false;
    }
    return true;
}

static int epoch(void *arg, uint64_t number, const char *const *members, size_t n,
                 const char *self, const struct ncomm_channel *ch,
                 const struct ncomm_cancel *cancel)
{
    struct devred *d = arg;
    bool shrunk;
    int rc;

    atomic_store(&d->result, false);
    if ((rc = d->mem->enter(d->mem->arg)) < 0 ||
        (rc = ncomm_setup(d->c, number, members, n, self, ch, DEVRED_READY_MS, cancel,
                          &shrunk)) < 0) {
        /* A newer epoch is no failure of NCCL's. */
        if (rc != -ESTALE)
            d->failures++;
        /* Whatever was started is given up: the epoch is host-staged. */
        ncomm_abort(d->c, NCOMM_ABORT_MS);
        return rc;
    }
    d->failures = 0;
    atomic_fetch_add(&d->epochs, 1);
    log_info("gpu", "This epoch reduces on the GPU with NCCL.", LF_U("epoch", number),
             LF_U("members", n), LF_I("rank", ncomm_rank(d->c)), LF_B("shrunk", shrunk));
    if (shrunk)
        atomic_fetch_add(&d->shrinks, 1);
    return 0;
}

static int reduce(void *arg, uint64_t grads, const struct ncomm_cancel *cancel)
{
    struct devred *d = arg;
    const struct devred_mem *m = d->mem;
    int rc;

    atomic_store(&d->result, false);
    if ((rc = m->enter(m->arg)) < 0)
        return rc;
    /* Every member skipped: a zero step, as on the host. */
    if (grads == 0)
        rc = m->zero_scratch(m->arg);
    else
        rc = ncomm_all_reduce(d->c, m->grads, m->scratch, m->count, m->type, 1.0 / (double)grads,
                              m->stream, DEVRED_REDUCE_MS, cancel);
    if (rc == 0)
        atomic_store(&d->result, true);
    return rc;
}

static int broadcast(void *arg, void *buf, size_t bytes, int root, bool receive,
                     const struct ncomm_cancel *cancel)
{
    struct devred *d = arg;
    const struct devred_mem *m = d->mem;
    bool mine = ncomm_rank(d->c) == root;
    int rc;

    /* The scratch holds no result any more. */
    atomic_store(&d->result, false);
    if (m->scratch_bytes == 0)
        return -EINVAL;
    if ((rc = m->enter(m->arg)) < 0)
        goto fail;
    for (size_t off = 0; off < bytes; off += m->scratch_bytes) {
        size_t len = bytes - off < m->scratch_bytes ? bytes - off : m->scratch_bytes;

        if ((mine && (rc = m->to_scratch(m->arg, (char *)buf + off, len)) < 0) ||
            (rc = ncomm_broadcast(d->c, m->scratch, m->scratch, len, root, len, m->stream,
                                  DEVRED_REDUCE_MS, cancel)) < 0 ||
            (receive && !mine && (rc = m->from_scratch(m->arg, (char *)buf + off, len)) < 0))
            goto fail;
    }
    return 0;
fail:
    if (rc != -ESTALE)
        d->failures++;
    return rc;
}

static int gather(void *arg)
{
    struct devred *d = arg;

    atomic_store(&d->result, false);
    return d->mem->gather(d->mem->arg);
}

static void host(void *arg)
{
    struct devred *d = arg;

    atomic_store(&d->result, false);
    if (d->c)
        ncomm_abort(d->c, NCOMM_ABORT_MS);
}

struct node_device devred_device(struct devred *d)
{
    return (struct node_device){ .can = can, .epoch = epoch, .reduce = reduce,
                                 .gather = gather, .host = host, .broadcast = broadcast,
                                 .arg = d };
}

bool devred_take_result(struct devred *d)
{
    return atomic_exchange(&d->result, false);
}

unsigned devred_leaked(const struct devred *d)
{
    return d->c ? ncomm_leaked(d->c) : 0;
}

uint64_t devred_epochs(const struct devred *d)
{
    return atomic_load(&d->epochs);
}

uint64_t devred_shrinks(const struct devred *d)
{
    return atomic_load(&d->shrinks);
}

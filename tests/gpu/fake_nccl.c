/* tests/gpu/fake_nccl.c: a stand-in for NCCL, libnccl.so.2, for machines
 * without a GPU: the entry points src/gpu/nccllib.c resolves, for ranks
 * that are threads of one process (tests/gpu/gpu_check runs two sidecars
 * in one), with device memory played by the stand-in driver's memfds
 * (fake_cuda.c, built with cuStreamQuery, in the same directory).
 *
 * What it holds cohort to, as NCCL would: a communicator is made only
 * non-blocking (ncclConfig_t.blocking = 0, else ncclInvalidArgument) and
 * is ready once every rank of its unique id has called
 * ncclCommInitRankConfig; a collective is refused on an aborted
 * communicator; a PreMulSum operation is used only on the communicator
 * that made it and before ncclRedOpDestroy; the scalar is read at
 * creation (ncclScalarHostImmediate, the only residence it takes).
 *
 * How it plays a collective: the k-th of a communicator's group is
 * gathered from every rank and computed by the last to queue it (float32
 * and float64 sums in rank order, each term scaled first; broadcasts of
 * bytes); until then ncclCommGetAsyncError says ncclInProgress for the
 * ranks that queued it, which is how cohort's non-blocking calls wait.
 * The stream has nothing left to do once it is done.
 *
 * ncclCommShrink, as 2.27's: non-blocking only; called by the ranks that
 * remain, each with the same excluded ranks (one out of range, listed
 * twice, the caller itself, none or all is ncclInvalidArgument); the
 * child is ready once every remaining rank has called it, its ranks the
 * parent's renumbered in order. NCCL_SHRINK_ABORT terminates a
 * collective in flight on the parent (it never finishes, and the parent
 * takes no more); without it, a parent with a collective in flight on
 * the caller's rank gives a child that never becomes ready. The parent
 * stays until ncclCommAbort.
 *
 * What it cannot show: anything of NCCL's transports, of a GPU, or of
 * ranks in different processes. Version 2.27.
 */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wstrict-prototypes"
#include <nccl.h>
#pragma GCC diagnostic pop

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))
#define RANKS 8
#define OPS 8

struct part {
    const void *send;
    void *recv;
    double scale;
};

struct group {
    struct group *next;
    ncclUniqueId id;
    struct group *parent;       /* a shrink's child: its parent, and who left */
    unsigned exclude;
    bool revoked;               /* NCCL_SHRINK_ABORT terminated its work */
    bool stuck;                 /* shrunk under work in flight: never ready */
    int nranks, joined, refs;
    uint64_t done;
    int parts;
    bool bcast;
    size_t count;
    ncclDataType_t type;
    int root;
    struct part part[RANKS];
};

struct ncclComm {
    struct group *g;
    int rank;
    uint64_t queued;
    struct {
        bool used;
        double scale;
    } ops[OPS];
};

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static struct group *groups;
static unsigned ids_made;

EXPORT ncclResult_t ncclGetVersion(int *version)
{
    *version = 22700;
    return ncclSuccess;
}

EXPORT const char *ncclGetErrorString(ncclResult_t result)
{
    return result == ncclSuccess ? "no error" : "an error of the stand-in NCCL";
}

EXPORT ncclResult_t ncclGetUniqueId(ncclUniqueId *uniqueId)
{
    unsigned n;

    pthread_mutex_lock(&mu);
    n = ++ids_made;
    pthread_mutex_unlock(&mu);
    memset(uniqueId->internal, 0, sizeof(uniqueId->internal));
    memcpy(uniqueId->internal, &n, sizeof(n));
    pid_t pid = getpid();
    memcpy(uniqueId->internal + sizeof(n), &pid, sizeof(pid));
    return ncclSuccess;
}

EXPORT ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId commId,
                                           int rank, ncclConfig_t *config)
{
    struct group *g;
    struct ncclComm *c;

    *comm = NULL;
    if (!config || config->blocking != 0 || nranks < 1 || nranks > RANKS || rank < 0 ||
        rank >= nranks)
        return ncclInvalidArgument;
    c = calloc(1, sizeof(*c));
    if (!c)
        return ncclSystemError;
    pthread_mutex_lock(&mu);
    for (g = groups; g; g = g->next)
        if (!g->parent && memcmp(g->id.internal, commId.internal, sizeof(commId.internal)) == 0)
            break;
    if (!g) {
        g = calloc(1, sizeof(*g));
        if (!g) {
            pthread_mutex_unlock(&mu);
            free(c);
            return ncclSystemError;
        }
        g->id = commId;
        g->nranks = nranks;
        g->next = groups;
        groups = g;
    }
    if (g->nranks != nranks) {
        pthread_mutex_unlock(&mu);
        free(c);
        return ncclInvalidUsage;
    }
    g->joined++;
    g->refs++;
    c->g = g;
    c->rank = rank;
    pthread_mutex_unlock(&mu);
    *comm = c;
    return ncclInProgress;
}

EXPORT ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError)
{
    pthread_mutex_lock(&mu);
    *asyncError = comm->g->joined < comm->g->nranks || comm->g->stuck ||
                          (comm->queued > comm->g->done && !comm->g->revoked)
                      ? ncclInProgress
                      : ncclSuccess;
    pthread_mutex_unlock(&mu);
    return ncclSuccess;
}

EXPORT ncclResult_t ncclCommAbort(ncclComm_t comm)
{
    struct group **p;

    if (!comm)
        return ncclInvalidArgument;
    pthread_mutex_lock(&mu);
    if (--comm->g->refs == 0) {
        for (p = &groups; *p != comm->g; p = &(*p)->next)
            ;
        *p = comm->g->next;
        /* A child outlives its parent: it forgets it. */
        for (struct group *k = groups; k; k = k->next)
            if (k->parent == comm->g)
                k->parent = NULL;
        free(comm->g);
    }
    pthread_mutex_unlock(&mu);
    free(comm);
    return ncclSuccess;
}

EXPORT ncclResult_t ncclRedOpCreatePreMulSum(ncclRedOp_t *op, void *scalar,
                                             ncclDataType_t datatype,
                                             ncclScalarResidence_t residence, ncclComm_t comm)
{
    if (residence != ncclScalarHostImmediate ||
        (datatype != ncclFloat32 && datatype != ncclFloat64))
        return ncclInvalidArgument;
    for (int i = 0; i < OPS; i++) {
        if (comm->ops[i].used)
            continue;
        comm->ops[i].used = true;
        comm->ops[i].scale = datatype == ncclFloat32 ? (double)*(const float *)scalar
                                                     : *(const double *)scalar;
        *op = (ncclRedOp_t)(ncclNumOps + i);
        return ncclSuccess;
    }
    return ncclInternalError;
}

EXPORT ncclResult_t ncclRedOpDestroy(ncclRedOp_t op, ncclComm_t comm)
{
    int i = (int)op - (int)ncclNumOps;

    if (i < 0 || i >= OPS || !comm->ops[i].used)
        return ncclInvalidArgument;
    comm->ops[i].used = false;
    return ncclSuccess;
}

static size_t type_size(ncclDataType_t t)
{
    return t == ncclFloat64 ? 8 : t == ncclFloat32 ? 4 : 1;
}

/* The collective every rank queued. Lock held. */
static void compute(struct group *g)
{
    size_t bytes = g->count * type_size(g->type);
    char *tmp = malloc(bytes ? bytes : 1);

    if (g->bcast) {
        memcpy(tmp, g->part[g->root].send, bytes);
    } else {
        for (size_t i = 0; i < g->count; i++) {
            if (g->type == ncclFloat64) {
                double s = 0;
                for (int r = 0; r < g->nranks; r++)
                    s += ((const double *)g->part[r].send)[i] * g->part[r].scale;
                ((double *)(void *)tmp)[i] = s;
            } else {
                float s = 0;
                for (int r = 0; r < g->nranks; r++)
                    s += ((const float *)g->part[r].send)[i] * (float)g->part[r].scale;
                ((float *)(void *)tmp)[i] = s;
            }
        }
    }
    for (int r = 0; r < g->nranks; r++)
        memcpy(g->part[r].recv, tmp, bytes);
    free(tmp);
    g->parts = 0;
    g->done++;
}

static ncclResult_t queue(ncclComm_t comm, bool bcast, const void *send, void *recv, size_t count,
                          ncclDataType_t type, double scale, int root)
{
    struct group *g = comm->g;

    pthread_mutex_lock(&mu);
    if (g->joined < g->nranks || g->revoked || comm->queued > g->done) {
        pthread_mutex_unlock(&mu);
        return ncclInvalidUsage;        /* not ready, or one still in flight */
    }
    comm->queued++;
    g->bcast = bcast;
    g->count = count;
    g->type = type;
    g->root = root;
    g->part[comm->rank] = (struct part){ .send = send, .recv = recv, .scale = scale };
    if (++g->parts == g->nranks)
        compute(g);
    pthread_mutex_unlock(&mu);
    return ncclInProgress;
}

EXPORT ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count,
                                  ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                                  cudaStream_t stream)
{
    double scale = 1.0;
    int i = (int)op - (int)ncclNumOps;

    if (datatype != ncclFloat32 && datatype != ncclFloat64)
        return ncclInvalidArgument;
    if (op != ncclSum) {
        if (i < 0 || i >= OPS || !comm->ops[i].used)
            return ncclInvalidArgument;
        scale = comm->ops[i].scale;
    }
    return queue(comm, false, sendbuff, recvbuff, count, datatype, scale, 0);
}

EXPORT ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count,
                                  ncclDataType_t datatype, int root, ncclComm_t comm,
                                  cudaStream_t stream)
{
    if (root < 0 || root >= comm->g->nranks)
        return ncclInvalidArgument;
    return queue(comm, true, sendbuff, recvbuff, count, datatype, 1.0, root);
}

EXPORT ncclResult_t ncclCommShrink(ncclComm_t comm, int *excludeRanksList, int excludeRanksCount,
                                   ncclComm_t *newcomm, ncclConfig_t *config, int shrinkFlags)
{
    struct group *g, *p;
    struct ncclComm *c;
    unsigned mask = 0;
    int below = 0;

    *newcomm = NULL;
    if (!comm || !config || config->blocking != 0 ||
        (shrinkFlags != NCCL_SHRINK_DEFAULT && shrinkFlags != NCCL_SHRINK_ABORT))
        return ncclInvalidArgument;
    p = comm->g;
    if (excludeRanksCount < 1 || excludeRanksCount >= p->nranks || !excludeRanksList)
        return ncclInvalidArgument;
    for (int i = 0; i < excludeRanksCount; i++) {
        int r = excludeRanksList[i];

        if (r < 0 || r >= p->nranks || (mask & (1u << r)) || r == comm->rank)
            return ncclInvalidArgument;
        mask |= 1u << r;
        below += r < comm->rank;
    }
    c = calloc(1, sizeof(*c));
    if (!c)
        return ncclSystemError;
    pthread_mutex_lock(&mu);
    if (shrinkFlags == NCCL_SHRINK_ABORT) {
        p->revoked = true;
        p->parts = 0;
    }
    for (g = groups; g; g = g->next)
        if (g->parent == p && g->exclude == mask)
            break;
    if (!g) {
        g = calloc(1, sizeof(*g));
        if (!g) {
            pthread_mutex_unlock(&mu);
            free(c);
            return ncclSystemError;
        }
        g->parent = p;
        g->exclude = mask;
        g->nranks = p->nranks - excludeRanksCount;
        g->next = groups;
        groups = g;
    }
    if (shrinkFlags == NCCL_SHRINK_DEFAULT && !p->revoked && comm->queued > p->done)
        g->stuck = true;
    g->joined++;
    g->refs++;
    c->g = g;
    c->rank = comm->rank - below;
    pthread_mutex_unlock(&mu);
    *newcomm = c;
    return ncclInProgress;
}

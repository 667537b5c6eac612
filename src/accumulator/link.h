/* src/accumulator/link.h: how the Accumulator (cohort.c) reaches the node
 * that runs its rounds. Two links implement it:
 *
 * - link_sidecar.c: a cohort-sidecar process over the trainer link (tlink),
 *   the Kubernetes case;
 * - link_node.c: a node in the trainer's own process, joined to a broker
 *   directly, for a local cohort with no sidecar.
 *
 * cohort_connect() chooses one, once; no public function of the Accumulator
 * asks which it has (the shape of redis's connection types, or curl's TLS
 * back ends). Both links serve the same tensors, laid out in one memfd
 * (struct link_memory), and both publish the view into the same shared page
 * (viewpage.h), so cohort_update() and cohort_wait() read it alike.
 *
 * Every operation returns 0 or a negative errno with the meaning
 * include/cohort.h gives it; -ENOTCONN once the link is lost. After an
 * operation that succeeded, the caller refreshes its view with update(),
 * so that a question asked right after an action sees its effect whichever
 * link carries it. */
#ifndef COHORT_LINK_H
#define COHORT_LINK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "accumulator/tlink.h"
#include "accumulator/viewpage.h"
#include "engine/dtype.h"

struct layout_shape;

/* The trainer's tensors, as cohort_create() laid them out. Everything is
 * borrowed from the struct cohort, which outlives its link. */
struct link_memory {
    void *map;                              /* the mapping of memfd */
    int memfd;
    int devfd;                              /* read only when layout->mem is
                                             * TL_MEM_CUDA_VMM: the device region */
    const struct tlink_register *layout;    /* offsets into map; mem = TL_MEM_HOST, or
                                             * TL_MEM_CUDA_VMM with devfd */
    enum dtype dtype;
    const char *name;                       /* the trainer's name, for logs */
};

struct link;

struct link_ops {
    const char *kind;                       /* "sidecar" or "in-process" */
    /* Copies the latest view into *view. */
    int (*update)(struct link *l, struct tlink_view *view);
    /* False once the link is lost (no system call: a cached state). */
    bool (*up)(const struct link *l);
    /* True when the other end has gone, looking now (cohort_wait asks
     * between its sleeps, since a dead sidecar cannot wake it). */
    bool (*gone)(struct link *l);
    /* A contribution of batch_size samples; 0 is a skip. */
    int (*contribute)(struct link *l, uint64_t batch_size);
    /* The trainer has applied the result of round `round` (the view's
     * rounds_committed) and zeroed its gradients. Need not wait for the
     * node: the link keeps order, and update() hides the consumed result
     * until the node has read it. */
    int (*consume)(struct link *l, uint64_t round);
    int (*set_state)(struct link *l, const void *state, size_t len);
    /* *state is malloc'd, the caller frees it. */
    int (*take_state)(struct link *l, void **state, size_t *len);
    int (*set_model_version)(struct link *l, uint64_t version);
    int (*set_virtual_batch_size)(struct link *l, uint64_t size);
    int (*set_parallel_gradients)(struct link *l, unsigned n);
    /* A compress_pack'd struct compress (compress.h): the method, as
     * cohort.h's COHORT_COMPRESSION_*, and its parameter. */
    int (*set_compression)(struct link *l, uint64_t packed);
    /* The gradients' tensors (layout.h; k checked against
     * LAYOUT_SHAPES_MAX by the caller, shapes borrowed). */
    int (*set_tensor_shapes)(struct link *l, const struct layout_shape *shapes, size_t k);
    /* Closes the link and frees it: a sidecar's member leaves when the
     * socket closes, an in-process node leaves and stops. */
    void (*destroy)(struct link *l);
};

/* The table of a link whose file defines each operation above as a
 * static function named after its field: both links bind theirs with it,
 * so the list is written once, and a link that lacks an operation fails
 * to compile rather than calling NULL. */
#define LINK_OPS(kind_)                                                             \
    {                                                                               \
        .kind = (kind_), .update = update, .up = up, .gone = gone,                  \
        .contribute = contribute, .consume = consume, .set_state = set_state,       \
        .take_state = take_state, .set_model_version = set_model_version,           \
        .set_virtual_batch_size = set_virtual_batch_size,                           \
        .set_parallel_gradients = set_parallel_gradients,                           \
        .set_compression = set_compression, .set_tensor_shapes = set_tensor_shapes, \
        .destroy = destroy,                                                         \
    }

/* The common head of both links; each implementation embeds it first. */
struct link {
    const struct link_ops *ops;
};

/* The view page both links publish into, at the layout's shared_off. */
static inline struct viewpage *link_shared_page(const struct link_memory *m)
{
    return (struct viewpage *)((char *)m->map + m->layout->shared_off);
}

#endif

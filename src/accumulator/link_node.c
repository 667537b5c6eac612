/* src/accumulator/link_node.c: the Accumulator's link to a node in the
 * trainer's own process. Calls go straight to the node; the node's view
 * callback writes the same shared page a sidecar would, so cohort_wait()
 * sleeps on it alike. */
#include "accumulator/link_node.h"

#include <errno.h>
#include <stdlib.h>

#include "accumulator/node.h"
#include "rpc/rpc.h"

struct inproc {
    struct link link;               /* first: the ops */
    const struct link_memory *mem;
    struct node *node;
};

static struct node *node_of(struct link *l)
{
    return ((struct inproc *)l)->node;
}

/* node_config.on_view: publish as a sidecar would. */
static void publish(void *arg, const struct node_view *v)
{
    struct inproc *p = arg;
    struct tlink_view w;

    tlink_view_fill(&w, v);
    viewpage_publish(link_shared_page(p->mem), &w);
}

/* node_view zeroes the gradients itself when a state transfer dropped
 * them, as the sidecar does inside its VIEW call. */
static int update(struct link *l, struct tlink_view *view)
{
    struct node_view v;

    node_view(node_of(l), &v);
    tlink_view_fill(view, &v);
    return 0;
}

static bool up(const struct link *l)
{
    return true;
}

static bool gone(struct link *l)
{
    return false;
}

static int contribute(struct link *l, uint64_t batch_size)
{
    return node_contribute(node_of(l), batch_size);
}

static int consume(struct link *l, uint64_t round)
{
    return node_consume(node_of(l), round);
}

static int set_state(struct link *l, const void *state, size_t len)
{
    return node_set_state(node_of(l), state, len);
}

static int take_state(struct link *l, void **state, size_t *len)
{
    return node_take_state(node_of(l), state, len);
}

static int set_model_version(struct link *l, uint64_t version)
{
    return node_set_model_version(node_of(l), version);
}

static int set_virtual_batch_size(struct link *l, uint64_t size)
{
    return node_set_virtual_batch_size(node_of(l), size);
}

static int set_parallel_gradients(struct link *l, unsigned n)
{
    return node_set_parallel_gradients(node_of(l), n);
}

static int set_compression(struct link *l, uint64_t packed)
{
    struct compress c;

    if (compress_unpack(packed, &c) < 0)
        return -EINVAL;
    return node_set_compression(node_of(l), &c);
}

static int set_tensor_shapes(struct link *l, const struct layout_shape *shapes, size_t k)
{
    return node_set_tensor_shapes(node_of(l), shapes, k);
}

static void destroy(struct link *l)
{
    node_stop(node_of(l));
    rpc_shutdown();
    free(l);
}

static const struct link_ops node_ops = LINK_OPS("in-process");

int link_node_connect(const char *broker, const char *cohort, const char *id, const char *host,
                      const struct secret *key, bool integrity_mac, const char *tls_ca_pem,
                      const char *tls_server_name,
                      const struct link_memory *m, struct link **out)
{
    const struct tlink_register *lay = m->layout;
    struct node_config nc = { .broker = broker, .cohort = cohort, .id = id, .host = host,
                              .key = key, .integrity_mac = integrity_mac,
                              .tls_ca_pem = tls_ca_pem,
                              .tls_server_name = tls_server_name, .on_view = publish };
    struct node_tensors t = {
        .params = (char *)m->map + lay->params_off, .params_bytes = lay->params_bytes,
        .grads = (char *)m->map + lay->grads_off, .grad_count = lay->grad_count,
        .grad_type = m->dtype, .results = (char *)m->map + lay->results_off,
        .buffers = (char *)m->map + lay->buffers_off, .buffers_bytes = lay->buffers_bytes,
        .grads_spare = tlink_spare_after(lay, lay->grads_off + lay->grad_count *
                                                                   dtype_size(m->dtype)),
        .results_spare = tlink_spare_after(lay, lay->results_off + lay->grad_count *
                                                                       dtype_size(m->dtype)),
    };
    struct inproc *p;
    int rc;

    if (!broker || !cohort || !id || !host)
        return -EINVAL;
    p = calloc(1, sizeof(*p));
    if (!p)
        return -ENOMEM;
    p->link.ops = &node_ops;
    p->mem = m;
    nc.view_arg = p;
    rc = rpc_init();
    if (rc < 0)
        goto err_free;
    rc = node_start(&nc, &p->node);
    if (rc < 0)
        goto err_rpc;
    rc = node_register(p->node, &t);
    if (rc < 0)
        goto err_node;
    *out = &p->link;
    return 0;
err_node:
    node_stop(p->node);
err_rpc:
    rpc_shutdown();
err_free:
    free(p);
    return rc;
}

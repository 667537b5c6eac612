/* src/rpc/rpc.c: see rpc.h.
 *
 * Shape: one completion queue for the whole process, drained by a few
 * threads. Every asynchronous operation is a struct whose first member is
 * a `struct tag`; the queue hands the tag back and its fn finishes the work.
 * Nothing here polls: progress happens only inside
 * grpc_completion_queue_next on those threads.
 */
#include "rpc/rpc.h"

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/slice.h>
#include <grpc/support/alloc.h>
#include <grpc/support/log.h>
#include <grpc/support/time.h>

#include "base/limits.h"
#include "base/log.h"

#define RT_THREADS 2
#define REQUESTS_PER_METHOD 4   /* calls waiting to be accepted, per method */

struct tag {
    void (*fn)(struct tag *t, bool ok);
};

/* ---- runtime ----------------------------------------------------------- */

static pthread_mutex_t rt_lock = PTHREAD_MUTEX_INITIALIZER;
static int rt_users;
static grpc_completion_queue *rt_cq;
static pthread_t rt_threads[RT_THREADS];
static _Thread_local bool on_cq_thread;

bool rpc_on_completion_thread(void)
{
    return on_cq_thread;
}

static void *cq_main(void *unused)
{
    on_cq_thread = true;
    for (;;) {
        grpc_event ev = grpc_completion_queue_next(rt_cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
        if (ev.type == GRPC_QUEUE_SHUTDOWN)
            break;
        if (ev.type == GRPC_OP_COMPLETE) {
            struct tag *t = ev.tag;
            t->fn(t, ev.success != 0);
        }
    }
    return NULL;
}

static void grpc_log_to_ours(gpr_log_func_args *a)
{
    enum log_level lvl = a->severity == GPR_LOG_SEVERITY_ERROR ? LOG_WARN : LOG_DEBUG;

    log_emit(lvl, "grpc", a->message, LF_S("file", a->file), LF_I("line", a->line), LOG_END);
}

int rpc_init(void)
{
    int rc = 0, started = 0;

    pthread_mutex_lock(&rt_lock);
    if (rt_users++ > 0)
        goto out;
    gpr_set_log_function(grpc_log_to_ours);
    gpr_set_log_verbosity(log_enabled(LOG_DEBUG) ? GPR_LOG_SEVERITY_INFO : GPR_LOG_SEVERITY_ERROR);
    grpc_init();
    rt_cq = grpc_completion_queue_create_for_next(NULL);
    if (!rt_cq) {
        rc = -ENOMEM;
        goto err_grpc;
    }
    for (; started < RT_THREADS; started++) {
        if (pthread_create(&rt_threads[started], NULL, cq_main, NULL) != 0) {
            rc = -EAGAIN;
            goto err_threads;
        }
    }
out:
    pthread_mutex_unlock(&rt_lock);
    return rc;

err_threads:
    grpc_completion_queue_shutdown(rt_cq);
    for (int i = 0; i < started; i++)
        pthread_join(rt_threads[i], NULL);
    grpc_completion_queue_destroy(rt_cq);
    rt_cq = NULL;
err_grpc:
    grpc_shutdown();
    rt_users--;
    pthread_mutex_unlock(&rt_lock);
    return rc;
}

void rpc_shutdown(void)
{
    pthread_mutex_lock(&rt_lock);
    if (rt_users == 0 || --rt_users > 0) {
        pthread_mutex_unlock(&rt_lock);
        return;
    }
    /* Threads leave once every pending tag has been delivered. */
    grpc_completion_queue_shutdown(rt_cq);
    for (int i = 0; i < RT_THREADS; i++)
        pthread_join(rt_threads[i], NULL);
    grpc_completion_queue_destroy(rt_cq);
    rt_cq = NULL;
    grpc_shutdown();
    pthread_mutex_unlock(&rt_lock);
}

/* ---- codes ------------------------------------------------------------- */

int rpc_code_to_errno(enum rpc_code code)
{
    switch (code) {
    case RPC_OK: return 0;
    case RPC_CANCELLED: return -ECANCELED;
    case RPC_INVALID_ARGUMENT: return -EINVAL;
    case RPC_DEADLINE_EXCEEDED: return -ETIMEDOUT;
    case RPC_NOT_FOUND: return -ENOENT;
    case RPC_ALREADY_EXISTS: return -EEXIST;
    case RPC_PERMISSION_DENIED: return -EACCES;
    case RPC_RESOURCE_EXHAUSTED: return -ENOSPC;
    case RPC_FAILED_PRECONDITION: return -EPROTO;
    case RPC_ABORTED: return -ECONNABORTED;
    case RPC_OUT_OF_RANGE: return -ERANGE;
    case RPC_UNIMPLEMENTED: return -ENOSYS;
    case RPC_UNAVAILABLE: return -ECONNREFUSED;
    case RPC_UNAUTHENTICATED: return -EPERM;
    case RPC_UNKNOWN:
    case RPC_INTERNAL:
    case RPC_DATA_LOSS:
        break;
    }
    return -EIO;
}

enum rpc_code rpc_code_from_errno(int err)
{
    switch (err < 0 ? -err : err) {
    case 0: return RPC_OK;
    case ECANCELED: return RPC_CANCELLED;
    case EINVAL: return RPC_INVALID_ARGUMENT;
    case ETIMEDOUT: return RPC_DEADLINE_EXCEEDED;
    case ENOENT: return RPC_NOT_FOUND;
    case EEXIST: return RPC_ALREADY_EXISTS;
    case EACCES: return RPC_PERMISSION_DENIED;
    case ENOSPC:
    case EMSGSIZE:
    case E2BIG:
    case ENOMEM: return RPC_RESOURCE_EXHAUSTED;
    case EPROTO: return RPC_FAILED_PRECONDITION;
    case ECONNABORTED: return RPC_ABORTED;
    case ERANGE: return RPC_OUT_OF_RANGE;
    case ENOSYS: return RPC_UNIMPLEMENTED;
    case ECONNREFUSED:
    case ESHUTDOWN: return RPC_UNAVAILABLE;
    case EPERM: return RPC_UNAUTHENTICATED;
    default: return RPC_INTERNAL;
    }
}

const char *rpc_code_name(enum rpc_code code)
{
    static const char *const names[] = {
        "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
        "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
        "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
        "UNAUTHENTICATED",
    };
    return (unsigned)code < sizeof(names) / sizeof(names[0]) ? names[code] : "UNKNOWN";
}

static void status_set(struct rpc_status *st, enum rpc_code code, const char *msg, size_t len)
{
    if (!st)
        return;
    st->code = code;
    if (len >= sizeof(st->message))
        len = sizeof(st->message) - 1;
    memcpy(st->message, msg, len);
    st->message[len] = '\0';
}

static void status_from_grpc(struct rpc_status *st, grpc_status_code code, grpc_slice details)
{
    status_set(st, (enum rpc_code)code, (const char *)GRPC_SLICE_START_PTR(details),
               GRPC_SLICE_LENGTH(details));
}

static gpr_timespec deadline_after(uint32_t timeout_ms)
{
    if (timeout_ms == 0)
        return gpr_inf_future(GPR_CLOCK_REALTIME);
    return gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                        gpr_time_from_millis((int64_t)timeout_ms, GPR_TIMESPAN));
}

/* ---- buffers ----------------------------------------------------------- */

struct rpc_buf {
    atomic_int refs;
    grpc_slice slice;
};

int rpc_buf_pack(const ProtobufCMessage *m, struct rpc_buf **out)
{
    struct rpc_buf *b = malloc(sizeof(*b));
    size_t len;

    if (!b)
        return -ENOMEM;
    len = protobuf_c_message_get_packed_size(m);
    b->slice = grpc_slice_malloc(len);
    protobuf_c_message_pack(m, GRPC_SLICE_START_PTR(b->slice));
    atomic_init(&b->refs, 1);
    *out = b;
    return 0;
}

struct rpc_buf *rpc_buf_ref(struct rpc_buf *b)
{
    atomic_fetch_add(&b->refs, 1);
    return b;
}

void rpc_buf_unref(struct rpc_buf *b)
{
    if (b && atomic_fetch_sub(&b->refs, 1) == 1) {
        grpc_slice_unref(b->slice);
        free(b);
    }
}

size_t rpc_buf_len(const struct rpc_buf *b)
{
    return GRPC_SLICE_LENGTH(b->slice);
}

/* Each send needs a byte buffer of its own; the slice is shared. */
static grpc_byte_buffer *buf_to_bb(struct rpc_buf *b)
{
    return grpc_raw_byte_buffer_create(&b->slice, 1);
}

static grpc_byte_buffer *pack_bb(const ProtobufCMessage *m)
{
    size_t len = protobuf_c_message_get_packed_size(m);
    grpc_slice s = grpc_slice_malloc(len);
    grpc_byte_buffer *bb;

    protobuf_c_message_pack(m, GRPC_SLICE_START_PTR(s));
    bb = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
    return bb;
}

/* Returns NULL when the bytes are not a `desc` message. */
static ProtobufCMessage *unpack_bb(grpc_byte_buffer *bb, const ProtobufCMessageDescriptor *desc)
{
    grpc_byte_buffer_reader r;
    ProtobufCMessage *m;
    grpc_slice s;

    if (!grpc_byte_buffer_reader_init(&r, bb))
        return NULL;
    s = grpc_byte_buffer_reader_readall(&r);
    grpc_byte_buffer_reader_destroy(&r);
    m = protobuf_c_message_unpack(desc, NULL, GRPC_SLICE_LENGTH(s), GRPC_SLICE_START_PTR(s));
    grpc_slice_unref(s);
    return m;
}

/* ---- server ------------------------------------------------------------ */

struct server_method {
    struct rpc_method m;
    void *handle;               /* grpc_server_register_method's */
    struct rpc_server *srv;
};

struct rpc_server {
    grpc_server *server;
    int port;
    size_t n_methods;
    struct server_method *methods;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    int outstanding;            /* tags in flight that point into this server */
    bool stopping;
    struct tag shutdown_tag;
};

/* A call waiting to be accepted; meth NULL for the catch-all of unknown
 * methods. */
struct incoming {
    struct tag tag;
    struct rpc_server *srv;
    struct server_method *meth;
    grpc_call *call;
    gpr_timespec deadline;
    grpc_metadata_array md;
    grpc_byte_buffer *payload;
    grpc_call_details details;
};

struct rpc_reply {
    struct tag tag;
    struct rpc_server *srv;
    grpc_call *call;
    grpc_byte_buffer *out;
    enum rpc_code code;
    grpc_slice details;
    int cancelled;
    bool answered;
};

struct rpc_stream {
    pthread_mutex_t lock;
    atomic_int refs;
    struct rpc_server *srv;
    grpc_call *call;            /* released once closed and idle */
    int batches;                /* in flight on call */
    struct tag md_tag, send_tag, status_tag, close_tag;
    grpc_byte_buffer *send_bb;
    bool send_inflight;
    struct rpc_buf *pending;
    bool finish_wanted, status_started, closed, broken;
    enum rpc_code fcode;
    grpc_slice fdetails;
    int cancelled;
    rpc_close_fn on_close;
    void *close_arg;
};

static void server_hold(struct rpc_server *s)
{
    pthread_mutex_lock(&s->lock);
    s->outstanding++;
    pthread_mutex_unlock(&s->lock);
}

static void server_release(struct rpc_server *s)
{
    pthread_mutex_lock(&s->lock);
    if (--s->outstanding == 0)
        pthread_cond_broadcast(&s->cond);
    pthread_mutex_unlock(&s->lock);
}

static void incoming_done(struct tag *t, bool ok);

static void incoming_free(struct incoming *in)
{
    grpc_metadata_array_destroy(&in->md);
    if (!in->meth)
        grpc_call_details_destroy(&in->details);
    if (in->payload)
        grpc_byte_buffer_destroy(in->payload);
    free(in);
}

/* Asks gRPC for the next call of `meth` (NULL: an unknown method). */
static void request_call(struct rpc_server *s, struct server_method *meth)
{
    struct incoming *in;
    grpc_call_error err;

    pthread_mutex_lock(&s->lock);
    if (s->stopping) {
        pthread_mutex_unlock(&s->lock);
        return;
    }
    s->outstanding++;
    pthread_mutex_unlock(&s->lock);

    in = calloc(1, sizeof(*in));
    if (!in)
        goto err;
    in->tag.fn = incoming_done;
    in->srv = s;
    in->meth = meth;
    grpc_metadata_array_init(&in->md);
    if (meth) {
        err = grpc_server_request_registered_call(s->server, meth->handle, &in->call, &in->deadline,
                                                  &in->md, &in->payload, rt_cq, rt_cq, in);
    } else {
        grpc_call_details_init(&in->details);
        err = grpc_server_request_call(s->server, &in->call, &in->details, &in->md, rt_cq, rt_cq, in);
    }
    if (err != GRPC_CALL_OK) {
        log_error("rpc", "The server could not ask for the next call.", LF_I("grpc_error", err));
        incoming_free(in);
        goto err;
    }
    return;
err:
    /* A lost request slot only lowers concurrency; the others keep serving. */
    server_release(s);
}

static void reply_done(struct tag *t, bool ok)
{
    struct rpc_reply *r = (struct rpc_reply *)t;
    struct rpc_server *s = r->srv;

    if (r->out)
        grpc_byte_buffer_destroy(r->out);
    grpc_slice_unref(r->details);
    grpc_call_unref(r->call);
    free(r);
    server_release(s);
}

void rpc_reply_ok(struct rpc_reply *r, const ProtobufCMessage *msg)
{
    if (r->answered)
        return;
    r->answered = true;
    r->code = RPC_OK;
    r->out = pack_bb(msg);
}

void rpc_reply_error(struct rpc_reply *r, enum rpc_code code, const char *fmt, ...)
{
    char msg[RPC_MESSAGE_MAX];
    va_list ap;

    if (r->answered)
        return;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    r->answered = true;
    r->code = code == RPC_OK ? RPC_UNKNOWN : code;
    grpc_slice_unref(r->details);
    r->details = grpc_slice_from_copied_string(msg);
}

/* Sends the handler's answer as one batch; reply_done frees everything. */
static void reply_send(struct rpc_reply *r)
{
    grpc_op ops[4];
    size_t n = 0;
    grpc_call_error err;

    memset(ops, 0, sizeof(ops));
    ops[n++].op = GRPC_OP_SEND_INITIAL_METADATA;
    if (r->code == RPC_OK && r->out) {
        ops[n].op = GRPC_OP_SEND_MESSAGE;
        ops[n++].data.send_message.send_message = r->out;
    }
    ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
    ops[n].data.send_status_from_server.status = (grpc_status_code)r->code;
    ops[n++].data.send_status_from_server.status_details = &r->details;
    ops[n].op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    ops[n++].data.recv_close_on_server.cancelled = &r->cancelled;
    err = grpc_call_start_batch(r->call, ops, n, r, NULL);
    if (err != GRPC_CALL_OK) {
        log_error("rpc", "The server could not send a reply.", LF_I("grpc_error", err));
        reply_done(&r->tag, false);
    }
}

static void handle_unary(struct incoming *in, const ProtobufCMessage *req)
{
    struct rpc_reply *r = calloc(1, sizeof(*r));

    if (!r) {
        grpc_call_cancel_with_status(in->call, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory", NULL);
        grpc_call_unref(in->call);
        return;
    }
    r->tag.fn = reply_done;
    r->srv = in->srv;
    r->call = in->call;
    r->details = grpc_empty_slice();
    server_hold(in->srv);
    if (req) {
        in->meth->m.unary(in->meth->m.arg, req, r);
        if (!r->answered)
            rpc_reply_error(r, RPC_INTERNAL, "the handler gave no answer");
    } else {
        /* Only the catch-all for unknown methods gets here without req. */
        char path[128];
        size_t len = GRPC_SLICE_LENGTH(in->details.method);
        if (len >= sizeof(path))
            len = sizeof(path) - 1;
        memcpy(path, GRPC_SLICE_START_PTR(in->details.method), len);
        path[len] = '\0';
        log_warn("rpc", "A client called a method this server does not have.", LF_S("method", path));
        rpc_reply_error(r, RPC_UNIMPLEMENTED, "no method %s", path);
    }
    reply_send(r);
}

/* Releases the stream's hold on its call once it can no longer be used. */
static void stream_batch_done_locked(struct rpc_stream *st)
{
    if (--st->batches == 0 && st->closed && st->call) {
        grpc_call_unref(st->call);
        st->call = NULL;
    }
}

static void stream_pump_locked(struct rpc_stream *st);

static void stream_after_batch(struct rpc_stream *st)
{
    struct rpc_server *s = st->srv;

    stream_batch_done_locked(st);
    pthread_mutex_unlock(&st->lock);
    rpc_stream_unref(st);
    server_release(s);
}

static void stream_md_done(struct tag *t, bool ok)
{
    struct rpc_stream *st = (struct rpc_stream *)((char *)t - offsetof(struct rpc_stream, md_tag));

    pthread_mutex_lock(&st->lock);
    stream_after_batch(st);
}

static void stream_send_done(struct tag *t, bool ok)
{
    struct rpc_stream *st = (struct rpc_stream *)((char *)t - offsetof(struct rpc_stream, send_tag));

    pthread_mutex_lock(&st->lock);
    grpc_byte_buffer_destroy(st->send_bb);
    st->send_bb = NULL;
    st->send_inflight = false;
    if (!ok)
        st->broken = true;
    stream_pump_locked(st);
    stream_after_batch(st);
}

static void stream_status_done(struct tag *t, bool ok)
{
    struct rpc_stream *st = (struct rpc_stream *)((char *)t - offsetof(struct rpc_stream, status_tag));

    pthread_mutex_lock(&st->lock);
    stream_after_batch(st);
}

static void stream_close_done(struct tag *t, bool ok)
{
    struct rpc_stream *st = (struct rpc_stream *)((char *)t - offsetof(struct rpc_stream, close_tag));
    rpc_close_fn fn;
    void *arg;

    pthread_mutex_lock(&st->lock);
    st->closed = true;
    rpc_buf_unref(st->pending);
    st->pending = NULL;
    fn = st->on_close;
    arg = st->close_arg;
    st->on_close = NULL;
    pthread_mutex_unlock(&st->lock);
    /* Outside our lock: the owner may lock its own state and send. */
    if (fn)
        fn(arg, st);
    pthread_mutex_lock(&st->lock);
    stream_after_batch(st);
}

/* Starts one batch on the stream's call; the stream and server stay alive
 * until its tag comes back. Lock held. */
static bool stream_start_locked(struct rpc_stream *st, grpc_op *ops, size_t n, struct tag *t)
{
    grpc_call_error err;

    atomic_fetch_add(&st->refs, 1);
    server_hold(st->srv);
    st->batches++;
    err = grpc_call_start_batch(st->call, ops, n, t, NULL);
    if (err == GRPC_CALL_OK)
        return true;
    log_error("rpc", "A stream batch could not start.", LF_I("grpc_error", err));
    st->batches--;
    atomic_fetch_sub(&st->refs, 1);
    server_release(st->srv);
    st->broken = true;
    return false;
}

static void stream_pump_locked(struct rpc_stream *st)
{
    grpc_op op;

    if (st->closed || st->send_inflight || st->status_started)
        return;
    memset(&op, 0, sizeof(op));
    if (st->pending && !st->broken) {
        st->send_bb = buf_to_bb(st->pending);
        rpc_buf_unref(st->pending);
        st->pending = NULL;
        op.op = GRPC_OP_SEND_MESSAGE;
        op.data.send_message.send_message = st->send_bb;
        st->send_inflight = true;
        if (!stream_start_locked(st, &op, 1, &st->send_tag)) {
            grpc_byte_buffer_destroy(st->send_bb);
            st->send_bb = NULL;
            st->send_inflight = false;
        }
        return;
    }
    if (st->finish_wanted) {
        st->status_started = true;
        op.op = GRPC_OP_SEND_STATUS_FROM_SERVER;
        op.data.send_status_from_server.status = (grpc_status_code)st->fcode;
        op.data.send_status_from_server.status_details = &st->fdetails;
        stream_start_locked(st, &op, 1, &st->status_tag);
    }
}

static void handle_stream(struct incoming *in, const ProtobufCMessage *req)
{
    struct rpc_stream *st = calloc(1, sizeof(*st));
    grpc_op op;

    if (!st) {
        grpc_call_cancel_with_status(in->call, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory", NULL);
        grpc_call_unref(in->call);
        return;
    }
    pthread_mutex_init(&st->lock, NULL);
    atomic_init(&st->refs, 1);          /* the handler's */
    st->srv = in->srv;
    st->call = in->call;
    st->md_tag.fn = stream_md_done;
    st->send_tag.fn = stream_send_done;
    st->status_tag.fn = stream_status_done;
    st->close_tag.fn = stream_close_done;
    st->fdetails = grpc_empty_slice();

    pthread_mutex_lock(&st->lock);
    memset(&op, 0, sizeof(op));
    op.op = GRPC_OP_SEND_INITIAL_METADATA;
    stream_start_locked(st, &op, 1, &st->md_tag);
    /* Armed at once: it completes when the client goes away, which is how
     * the owner learns that a watcher is gone. */
    memset(&op, 0, sizeof(op));
    op.op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    op.data.recv_close_on_server.cancelled = &st->cancelled;
    if (!stream_start_locked(st, &op, 1, &st->close_tag))
        st->closed = true;
    pthread_mutex_unlock(&st->lock);

    in->meth->m.stream(in->meth->m.arg, req, st);
}

static void incoming_done(struct tag *t, bool ok)
{
    struct incoming *in = (struct incoming *)t;
    struct rpc_server *s = in->srv;
    ProtobufCMessage *req = NULL;

    if (!ok) {
        /* The server is shutting down: this slot will not be re-armed. */
        incoming_free(in);
        server_release(s);
        return;
    }
    /* Keep a slot armed before doing the work. */
    request_call(s, in->meth);

    if (!in->meth) {
        handle_unary(in, NULL);
        goto out;
    }
    if (!in->payload || !(req = unpack_bb(in->payload, in->meth->m.request))) {
        log_warn("rpc", "A request did not parse; it was refused.", LF_S("method", in->meth->m.path),
                 LF_S("expected", in->meth->m.request->name));
        grpc_call_cancel_with_status(in->call, GRPC_STATUS_INVALID_ARGUMENT,
                                     "malformed request: not a valid message of the method's type",
                                     NULL);
        grpc_call_unref(in->call);
        goto out;
    }
    if (in->meth->m.unary)
        handle_unary(in, req);
    else
        handle_stream(in, req);
    protobuf_c_message_free_unpacked(req, NULL);
out:
    incoming_free(in);
    server_release(s);
}

static void shutdown_done(struct tag *t, bool ok)
{
    struct rpc_server *s = (struct rpc_server *)((char *)t - offsetof(struct rpc_server, shutdown_tag));

    server_release(s);
}

int rpc_server_create(const char *address, const struct rpc_method *methods, size_t n,
                      const struct rpc_server_opts *opts, struct rpc_server **out)
{
    size_t max_req = opts && opts->max_request_bytes ? opts->max_request_bytes : LIMIT_RPC_REQUEST_BYTES;
    grpc_arg args[4];
    grpc_channel_args cargs = { .num_args = 4, .args = args };
    grpc_server_credentials *creds;
    struct rpc_server *s;
    int rc = -ENOMEM;

    if (!address || (n > 0 && !methods))
        return -EINVAL;
    s = calloc(1, sizeof(*s));
    if (!s)
        return -ENOMEM;
    pthread_mutex_init(&s->lock, NULL);
    pthread_cond_init(&s->cond, NULL);
    s->shutdown_tag.fn = shutdown_done;
    s->methods = calloc(n ? n : 1, sizeof(*s->methods));
    if (!s->methods)
        goto err_free;
    s->n_methods = n;

    args[0].type = GRPC_ARG_INTEGER;
    args[0].key = (char *)GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH;
    args[0].value.integer = (int)max_req;
    /* A second server on a fixed port must fail, not share it. */
    args[1].type = GRPC_ARG_INTEGER;
    args[1].key = (char *)GRPC_ARG_ALLOW_REUSEPORT;
    args[1].value.integer = 0;
    /* Clients send keepalive pings (every 10 s); allow them. */
    args[2].type = GRPC_ARG_INTEGER;
    args[2].key = (char *)GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS;
    args[2].value.integer = 5000;
    args[3].type = GRPC_ARG_INTEGER;
    args[3].key = (char *)GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS;
    args[3].value.integer = 1;

    s->server = grpc_server_create(&cargs, NULL);
    if (!s->server)
        goto err_methods;
    grpc_server_register_completion_queue(s->server, rt_cq, NULL);
    for (size_t i = 0; i < n; i++) {
        struct server_method *m = &s->methods[i];
        if (!methods[i].path || !methods[i].request || !methods[i].unary == !methods[i].stream) {
            rc = -EINVAL;
            goto err_server;
        }
        m->m = methods[i];
        m->srv = s;
        m->handle = grpc_server_register_method(s->server, m->m.path, NULL,
                                                GRPC_SRM_PAYLOAD_READ_INITIAL_BYTE_BUFFER, 0);
        if (!m->handle) {
            rc = -EINVAL;
            goto err_server;
        }
    }
    creds = grpc_insecure_server_credentials_create();
    s->port = grpc_server_add_http2_port(s->server, address, creds);
    grpc_server_credentials_release(creds);
    if (s->port == 0) {
        log_error("rpc", "The server could not bind its address.", LF_S("address", address));
        rc = -EADDRINUSE;
        goto err_server;
    }
    if (strncmp(address, "unix:", 5) == 0)
        s->port = 0;
    grpc_server_start(s->server);
    for (size_t i = 0; i < n; i++)
        for (int k = 0; k < REQUESTS_PER_METHOD; k++)
            request_call(s, &s->methods[i]);
    request_call(s, NULL);
    *out = s;
    return 0;

err_server:
    /* Never started: destroy needs a finished shutdown all the same. */
    server_hold(s);
    grpc_server_shutdown_and_notify(s->server, rt_cq, &s->shutdown_tag);
    pthread_mutex_lock(&s->lock);
    while (s->outstanding > 0)
        pthread_cond_wait(&s->cond, &s->lock);
    pthread_mutex_unlock(&s->lock);
    grpc_server_destroy(s->server);
err_methods:
    free(s->methods);
err_free:
    pthread_cond_destroy(&s->cond);
    pthread_mutex_destroy(&s->lock);
    free(s);
    return rc;
}

int rpc_server_port(const struct rpc_server *s)
{
    return s->port;
}

void rpc_server_destroy(struct rpc_server *s)
{
    if (!s)
        return;
    if (rpc_on_completion_thread()) {
        log_error("rpc", "rpc_server_destroy was called on a completion thread; the server leaks.");
        return;
    }
    pthread_mutex_lock(&s->lock);
    s->stopping = true;
    s->outstanding++;           /* for shutdown_tag */
    pthread_mutex_unlock(&s->lock);
    grpc_server_shutdown_and_notify(s->server, rt_cq, &s->shutdown_tag);
    grpc_server_cancel_all_calls(s->server);
    pthread_mutex_lock(&s->lock);
    while (s->outstanding > 0)
        pthread_cond_wait(&s->cond, &s->lock);
    pthread_mutex_unlock(&s->lock);
    grpc_server_destroy(s->server);
    free(s->methods);
    pthread_cond_destroy(&s->cond);
    pthread_mutex_destroy(&s->lock);
    free(s);
}

struct rpc_stream *rpc_stream_ref(struct rpc_stream *st)
{
    atomic_fetch_add(&st->refs, 1);
    return st;
}

void rpc_stream_unref(struct rpc_stream *st)
{
    if (!st || atomic_fetch_sub(&st->refs, 1) != 1)
        return;
    /* Last reference: every batch has completed, so the call is released. */
    rpc_buf_unref(st->pending);
    grpc_slice_unref(st->fdetails);
    if (st->call)
        grpc_call_unref(st->call);
    pthread_mutex_destroy(&st->lock);
    free(st);
}

int rpc_stream_send(struct rpc_stream *st, struct rpc_buf *b)
{
    int rc = 0;

    pthread_mutex_lock(&st->lock);
    if (st->closed || st->broken || st->finish_wanted) {
        rc = -EPIPE;
        goto out;
    }
    rpc_buf_unref(st->pending);
    st->pending = rpc_buf_ref(b);
    stream_pump_locked(st);
out:
    pthread_mutex_unlock(&st->lock);
    return rc;
}

void rpc_stream_finish(struct rpc_stream *st, enum rpc_code code, const char *message)
{
    pthread_mutex_lock(&st->lock);
    if (!st->finish_wanted && !st->closed) {
        st->finish_wanted = true;
        st->fcode = code;
        grpc_slice_unref(st->fdetails);
        st->fdetails = grpc_slice_from_copied_string(message ? message : "");
        stream_pump_locked(st);
    }
    pthread_mutex_unlock(&st->lock);
}

void rpc_stream_on_close(struct rpc_stream *st, rpc_close_fn fn, void *arg)
{
    bool now;

    pthread_mutex_lock(&st->lock);
    now = st->closed;
    if (!now) {
        st->on_close = fn;
        st->close_arg = arg;
    }
    pthread_mutex_unlock(&st->lock);
    if (now && fn)
        fn(arg, st);
}

/* ---- client ------------------------------------------------------------ */

struct rpc_channel {
    grpc_channel *ch;
};

int rpc_channel_create(const char *target, const struct rpc_channel_opts *opts,
                       struct rpc_channel **out)
{
    size_t max_reply = opts && opts->max_reply_bytes ? opts->max_reply_bytes : LIMIT_RPC_REPLY_BYTES;
    uint32_t backoff = opts && opts->max_backoff_ms ? opts->max_backoff_ms : LIMIT_BACKOFF_MAX_MS;
    grpc_channel_credentials *creds;
    struct rpc_channel *c;
    grpc_arg args[6];
    grpc_channel_args cargs = { .num_args = 6, .args = args };

    if (!target || !*target)
        return -EINVAL;
    c = calloc(1, sizeof(*c));
    if (!c)
        return -ENOMEM;
    args[0].type = GRPC_ARG_INTEGER;
    args[0].key = (char *)GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH;
    args[0].value.integer = max_reply > INT32_MAX ? INT32_MAX : (int)max_reply;
    /* gRPC's default reconnect backoff grows to 120 s; a member must find
     * a restarted broker within its own timeout. */
    args[1].type = GRPC_ARG_INTEGER;
    args[1].key = (char *)GRPC_ARG_MAX_RECONNECT_BACKOFF_MS;
    args[1].value.integer = (int)backoff;
    args[2].type = GRPC_ARG_INTEGER;
    args[2].key = (char *)GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS;
    args[2].value.integer = backoff < 100 ? (int)backoff : 100;
    args[3].type = GRPC_ARG_INTEGER;
    args[3].key = (char *)GRPC_ARG_MIN_RECONNECT_BACKOFF_MS;
    args[3].value.integer = backoff < 100 ? (int)backoff : 100;
    args[4].type = GRPC_ARG_INTEGER;
    args[4].key = (char *)GRPC_ARG_KEEPALIVE_TIME_MS;
    args[4].value.integer = 10000;
    /* Each channel gets its own connection: members are separate peers to
     * the broker even when one process simulates many. */
    args[5].type = GRPC_ARG_INTEGER;
    args[5].key = (char *)GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL;
    args[5].value.integer = 1;
    creds = grpc_insecure_credentials_create();
    c->ch = grpc_channel_create(target, creds, &cargs);
    grpc_channel_credentials_release(creds);
    if (!c->ch) {
        free(c);
        return -EINVAL;
    }
    *out = c;
    return 0;
}

void rpc_channel_destroy(struct rpc_channel *c)
{
    if (!c)
        return;
    grpc_channel_destroy(c->ch);
    free(c);
}

struct ucall {
    struct tag tag;
    grpc_call *call;
    grpc_byte_buffer *send_bb, *recv_bb;
    grpc_metadata_array init_md, trail_md;
    grpc_status_code status;
    grpc_slice details;
    const ProtobufCMessageDescriptor *desc;
    rpc_done_fn done;
    void *arg;
};

static void ucall_done(struct tag *t, bool ok)
{
    struct ucall *u = (struct ucall *)t;
    struct rpc_status st;
    ProtobufCMessage *reply = NULL;

    if (!ok) {
        status_set(&st, RPC_INTERNAL, "the call failed inside gRPC", 27);
    } else {
        status_from_grpc(&st, u->status, u->details);
        if (st.code == RPC_OK) {
            if (!u->recv_bb || !(reply = unpack_bb(u->recv_bb, u->desc))) {
                const char *m = "malformed reply: not a valid message of the expected type";
                status_set(&st, RPC_INTERNAL, m, strlen(m));
            }
        }
    }
    u->done(u->arg, &st, reply);
    if (u->recv_bb)
        grpc_byte_buffer_destroy(u->recv_bb);
    grpc_byte_buffer_destroy(u->send_bb);
    grpc_metadata_array_destroy(&u->init_md);
    grpc_metadata_array_destroy(&u->trail_md);
    grpc_slice_unref(u->details);
    grpc_call_unref(u->call);
    free(u);
}

int rpc_call_async(struct rpc_channel *c, const char *path, const ProtobufCMessage *req,
                   const ProtobufCMessageDescriptor *reply_desc, uint32_t timeout_ms,
                   unsigned flags, rpc_done_fn done, void *arg)
{
    struct ucall *u = calloc(1, sizeof(*u));
    grpc_slice method;
    grpc_op ops[6];
    grpc_call_error err;

    if (!u)
        return -ENOMEM;
    u->tag.fn = ucall_done;
    u->desc = reply_desc;
    u->done = done;
    u->arg = arg;
    u->details = grpc_empty_slice();
    grpc_metadata_array_init(&u->init_md);
    grpc_metadata_array_init(&u->trail_md);
    method = grpc_slice_from_static_string(path);
    u->call = grpc_channel_create_call(c->ch, NULL, GRPC_PROPAGATE_DEFAULTS, rt_cq, method, NULL,
                                       deadline_after(timeout_ms), NULL);
    if (!u->call)
        goto err;
    u->send_bb = pack_bb(req);
    memset(ops, 0, sizeof(ops));
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[0].flags = (flags & RPC_WAIT_FOR_READY) ? GRPC_INITIAL_METADATA_WAIT_FOR_READY : 0;
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = u->send_bb;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[3].data.recv_initial_metadata.recv_initial_metadata = &u->init_md;
    ops[4].op = GRPC_OP_RECV_MESSAGE;
    ops[4].data.recv_message.recv_message = &u->recv_bb;
    ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[5].data.recv_status_on_client.trailing_metadata = &u->trail_md;
    ops[5].data.recv_status_on_client.status = &u->status;
    ops[5].data.recv_status_on_client.status_details = &u->details;
    err = grpc_call_start_batch(u->call, ops, 6, u, NULL);
    if (err != GRPC_CALL_OK) {
        grpc_byte_buffer_destroy(u->send_bb);
        grpc_call_unref(u->call);
        goto err;
    }
    return 0;
err:
    grpc_metadata_array_destroy(&u->init_md);
    grpc_metadata_array_destroy(&u->trail_md);
    free(u);
    return -EIO;
}

struct waiter {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    bool done;
    struct rpc_status st;
    ProtobufCMessage *reply;
};

static void waiter_done(void *arg, const struct rpc_status *st, ProtobufCMessage *reply)
{
    struct waiter *w = arg;

    pthread_mutex_lock(&w->lock);
    w->st = *st;
    w->reply = reply;
    w->done = true;
    pthread_cond_signal(&w->cond);
    pthread_mutex_unlock(&w->lock);
}

int rpc_call(struct rpc_channel *c, const char *path, const ProtobufCMessage *req,
             const ProtobufCMessageDescriptor *reply_desc, uint32_t timeout_ms, unsigned flags,
             ProtobufCMessage **reply, struct rpc_status *st)
{
    struct waiter w = { .done = false, .reply = NULL };
    int rc;

    if (rpc_on_completion_thread())
        return -EDEADLK;
    pthread_mutex_init(&w.lock, NULL);
    pthread_cond_init(&w.cond, NULL);
    rc = rpc_call_async(c, path, req, reply_desc, timeout_ms, flags, waiter_done, &w);
    if (rc < 0) {
        status_set(st, RPC_INTERNAL, "the call could not start", 24);
        goto out;
    }
    pthread_mutex_lock(&w.lock);
    while (!w.done)
        pthread_cond_wait(&w.cond, &w.lock);
    pthread_mutex_unlock(&w.lock);
    if (st)
        *st = w.st;
    rc = rpc_code_to_errno(w.st.code);
    if (rc == 0)
        *reply = w.reply;
out:
    pthread_cond_destroy(&w.cond);
    pthread_mutex_destroy(&w.lock);
    return rc;
}

struct rpc_watch {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    grpc_call *call;
    struct tag start_tag, msg_tag, status_tag;
    grpc_byte_buffer *send_bb, *recv_bb;
    grpc_metadata_array init_md, trail_md;
    grpc_status_code status;
    grpc_slice details;
    const ProtobufCMessageDescriptor *desc;
    rpc_msg_fn on_msg;
    rpc_end_fn on_end;
    void *arg;
    int batches;                /* in flight */
    bool status_done, ended, bad_message;
};

/* on_end runs once, after every batch is back: no on_msg can follow it. */
static void watch_maybe_end_locked(struct rpc_watch *w)
{
    struct rpc_status st;

    if (w->batches > 0 || !w->status_done || w->ended)
        return;
    status_from_grpc(&st, w->status, w->details);
    pthread_mutex_unlock(&w->lock);
    w->on_end(w->arg, &st);
    pthread_mutex_lock(&w->lock);
    w->ended = true;
    pthread_cond_broadcast(&w->cond);
}

static bool watch_arm_msg_locked(struct rpc_watch *w)
{
    grpc_op op;

    memset(&op, 0, sizeof(op));
    op.op = GRPC_OP_RECV_MESSAGE;
    op.data.recv_message.recv_message = &w->recv_bb;
    w->batches++;
    if (grpc_call_start_batch(w->call, &op, 1, &w->msg_tag, NULL) == GRPC_CALL_OK)
        return true;
    w->batches--;
    return false;
}

static void watch_start_done(struct tag *t, bool ok)
{
    struct rpc_watch *w = (struct rpc_watch *)((char *)t - offsetof(struct rpc_watch, start_tag));

    pthread_mutex_lock(&w->lock);
    w->batches--;
    watch_maybe_end_locked(w);
    pthread_mutex_unlock(&w->lock);
}

static void watch_msg_done(struct tag *t, bool ok)
{
    struct rpc_watch *w = (struct rpc_watch *)((char *)t - offsetof(struct rpc_watch, msg_tag));
    grpc_byte_buffer *bb = w->recv_bb;
    ProtobufCMessage *m = NULL;

    w->recv_bb = NULL;
    if (ok && bb) {
        m = unpack_bb(bb, w->desc);
        grpc_byte_buffer_destroy(bb);
        if (m) {
            /* Still counted as in flight: on_end cannot overtake this. */
            w->on_msg(w->arg, m);
        } else {
            log_warn("rpc", "A stream message did not parse; the stream is cancelled.",
                     LF_S("expected", w->desc->name));
            grpc_call_cancel_with_status(w->call, GRPC_STATUS_INTERNAL,
                                         "malformed stream message", NULL);
        }
    }
    pthread_mutex_lock(&w->lock);
    w->batches--;
    if (m)
        watch_arm_msg_locked(w);
    watch_maybe_end_locked(w);
    pthread_mutex_unlock(&w->lock);
}

static void watch_status_done(struct tag *t, bool ok)
{
    struct rpc_watch *w = (struct rpc_watch *)((char *)t - offsetof(struct rpc_watch, status_tag));

    pthread_mutex_lock(&w->lock);
    w->batches--;
    w->status_done = true;
    watch_maybe_end_locked(w);
    pthread_mutex_unlock(&w->lock);
}

int rpc_watch_open(struct rpc_channel *c, const char *path, const ProtobufCMessage *req,
                   const ProtobufCMessageDescriptor *msg_desc, unsigned flags, rpc_msg_fn on_msg,
                   rpc_end_fn on_end, void *arg, struct rpc_watch **out)
{
    struct rpc_watch *w = calloc(1, sizeof(*w));
    grpc_op ops[4];
    int rc = -EIO;

    if (!w)
        return -ENOMEM;
    pthread_mutex_init(&w->lock, NULL);
    pthread_cond_init(&w->cond, NULL);
    w->start_tag.fn = watch_start_done;
    w->msg_tag.fn = watch_msg_done;
    w->status_tag.fn = watch_status_done;
    w->desc = msg_desc;
    w->on_msg = on_msg;
    w->on_end = on_end;
    w->arg = arg;
    w->details = grpc_empty_slice();
    grpc_metadata_array_init(&w->init_md);
    grpc_metadata_array_init(&w->trail_md);
    w->call = grpc_channel_create_call(c->ch, NULL, GRPC_PROPAGATE_DEFAULTS, rt_cq,
                                       grpc_slice_from_static_string(path), NULL,
                                       gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    if (!w->call)
        goto err_free;
    w->send_bb = pack_bb(req);

    pthread_mutex_lock(&w->lock);
    memset(ops, 0, sizeof(ops));
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[0].flags = (flags & RPC_WAIT_FOR_READY) ? GRPC_INITIAL_METADATA_WAIT_FOR_READY : 0;
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = w->send_bb;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[3].data.recv_initial_metadata.recv_initial_metadata = &w->init_md;
    w->batches++;
    if (grpc_call_start_batch(w->call, ops, 4, &w->start_tag, NULL) != GRPC_CALL_OK)
        goto err_call;
    memset(ops, 0, sizeof(ops));
    ops[0].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[0].data.recv_status_on_client.trailing_metadata = &w->trail_md;
    ops[0].data.recv_status_on_client.status = &w->status;
    ops[0].data.recv_status_on_client.status_details = &w->details;
    w->batches++;
    if (grpc_call_start_batch(w->call, ops, 1, &w->status_tag, NULL) != GRPC_CALL_OK) {
        /* The first batch is in flight: let it finish through the normal
         * path, as a cancelled stream. */
        w->batches--;
        w->status = GRPC_STATUS_INTERNAL;
        w->status_done = true;
        grpc_call_cancel(w->call, NULL);
        pthread_mutex_unlock(&w->lock);
        *out = w;
        return 0;
    }
    watch_arm_msg_locked(w);
    pthread_mutex_unlock(&w->lock);
    *out = w;
    return 0;

err_call:
    pthread_mutex_unlock(&w->lock);
    grpc_byte_buffer_destroy(w->send_bb);
    grpc_call_unref(w->call);
err_free:
    grpc_metadata_array_destroy(&w->init_md);
    grpc_metadata_array_destroy(&w->trail_md);
    pthread_cond_destroy(&w->cond);
    pthread_mutex_destroy(&w->lock);
    free(w);
    return rc;
}

int rpc_watch_close(struct rpc_watch *w)
{
    if (!w)
        return 0;
    if (rpc_on_completion_thread())
        return -EDEADLK;
    pthread_mutex_lock(&w->lock);
    if (!w->ended)
        grpc_call_cancel(w->call, NULL);
    while (!w->ended)
        pthread_cond_wait(&w->cond, &w->lock);
    pthread_mutex_unlock(&w->lock);
    grpc_byte_buffer_destroy(w->send_bb);
    grpc_metadata_array_destroy(&w->init_md);
    grpc_metadata_array_destroy(&w->trail_md);
    grpc_slice_unref(w->details);
    grpc_call_unref(w->call);
    pthread_cond_destroy(&w->cond);
    pthread_mutex_destroy(&w->lock);
    free(w);
    return 0;
}

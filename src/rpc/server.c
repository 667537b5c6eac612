/* src/rpc/server.c: rpc.h's server side: accepting calls of registered
 * methods (and refusing the rest), unary replies, and server streams with
 * their latest-wins send queue, which may also read the client's further
 * messages (duplex). Every call, reply and stream operation is
 * a tag on the shared completion queue (core.h). */
#include "rpc/core.h"

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <grpc/grpc_security.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include "base/clock.h"
#include "base/limits.h"
#include "base/log.h"

#define REQUESTS_PER_METHOD 4   /* calls waiting to be accepted, per method */

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
    struct rpc_tag shutdown_tag;
};

/* A call waiting to be accepted; meth NULL for the catch-all of unknown
 * methods. */
struct incoming {
    struct rpc_tag tag;
    struct rpc_server *srv;
    struct server_method *meth;
    grpc_call *call;
    gpr_timespec deadline;
    grpc_metadata_array md;
    grpc_byte_buffer *payload;
    grpc_call_details details;
};

struct rpc_reply {
    struct rpc_tag tag;
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
    struct rpc_tag md_tag, send_tag, status_tag, close_tag, recv_tag;
    grpc_byte_buffer *send_bb, *recv_bb;
    struct rpc_buf *sending;    /* held until its send completes (rpc_buf_on_release) */
    const ProtobufCMessageDescriptor *desc;     /* of the client's messages */
    rpc_stream_msg_fn on_msg;   /* duplex: set once by the handler */
    void *msg_arg;
    bool recv_inflight;
    bool send_inflight;
    struct rpc_buf *pending;
    bool finish_wanted, status_started, closed, broken;
    enum rpc_code fcode;
    grpc_slice fdetails;
    int cancelled;
    rpc_close_fn on_close;
    void *close_arg;
};

/* Warnings about what clients sent (an unknown method, a request that
 * does not parse) go out at most WARN_PER_S a second, since a client
 * chooses how many it causes; the next line that goes out counts the ones
 * held back. */
#define WARN_PER_S 10

static pthread_mutex_t warn_lock = PTHREAD_MUTEX_INITIALIZER;
static uint64_t warn_second, warn_held;
static unsigned warn_count;

static bool warn_allowed(uint64_t *held)
{
    uint64_t now = clock_now_ms() / 1000;
    bool ok = false;

    pthread_mutex_lock(&warn_lock);
    if (now != warn_second) {
        warn_second = now;
        warn_count = 0;
    }
    if (warn_count < WARN_PER_S) {
        warn_count++;
        *held = warn_held;
        warn_held = 0;
        ok = true;
    } else {
        warn_held++;
    }
    pthread_mutex_unlock(&warn_lock);
    return ok;
}

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

static void incoming_done(struct rpc_tag *t, bool ok);

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
    grpc_completion_queue *cq = rpc_queue();
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
                                                  &in->md, &in->payload, cq, cq, in);
    } else {
        grpc_call_details_init(&in->details);
        err = grpc_server_request_call(s->server, &in->call, &in->details, &in->md, cq, cq, in);
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

static void reply_done(struct rpc_tag *t, bool ok)
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
    r->out = rpc_pack_bb(msg);
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
    uint64_t held = 0;

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
        if (warn_allowed(&held))
            log_warn("rpc", "A client called a method this server does not have.",
                     LF_S("method", path), LF_U("held_back", held));
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

static void stream_md_done(struct rpc_tag *t, bool ok)
{
    struct rpc_stream *st = (struct rpc_stream *)((char *)t - offsetof(struct rpc_stream, md_tag));

    pthread_mutex_lock(&st->lock);
    stream_after_batch(st);
}

static void stream_send_done(struct rpc_tag *t, bool ok)
{
    struct rpc_stream *st = (struct rpc_stream *)((char *)t - offsetof(struct rpc_stream, send_tag));

    struct rpc_buf *sent;

    pthread_mutex_lock(&st->lock);
    grpc_byte_buffer_destroy(st->send_bb);
    st->send_bb = NULL;
    sent = st->sending;
    st->sending = NULL;
    st->send_inflight = false;
    if (!ok)
        st->broken = true;
    stream_pump_locked(st);
    stream_after_batch(st);
    rpc_buf_unref(sent);
}

static void stream_status_done(struct rpc_tag *t, bool ok)
{
    struct rpc_stream *st = (struct rpc_stream *)((char *)t - offsetof(struct rpc_stream, status_tag));

    pthread_mutex_lock(&st->lock);
    stream_after_batch(st);
}

/* Takes on_close for running once the call is over and no message
 * callback runs or can run (one in flight always completes once the call
 * is over). Lock held. */
static rpc_close_fn stream_take_close_locked(struct rpc_stream *st, void **arg)
{
    rpc_close_fn fn = NULL;

    if (st->closed && !st->recv_inflight) {
        fn = st->on_close;
        *arg = st->close_arg;
        st->on_close = NULL;
    }
    return fn;
}

static void stream_close_done(struct rpc_tag *t, bool ok)
{
    struct rpc_stream *st = (struct rpc_stream *)((char *)t - offsetof(struct rpc_stream, close_tag));
    rpc_close_fn fn;
    void *arg = NULL;

    pthread_mutex_lock(&st->lock);
    st->closed = true;
    rpc_buf_unref(st->pending);
    st->pending = NULL;
    fn = stream_take_close_locked(st, &arg);
    pthread_mutex_unlock(&st->lock);
    /* Outside our lock: the owner may lock its own state and send. */
    if (fn)
        fn(arg, st);
    pthread_mutex_lock(&st->lock);
    stream_after_batch(st);
}

static bool stream_start_locked(struct rpc_stream *st, grpc_op *ops, size_t n, struct rpc_tag *t);

/* Asks for the client's next message: one at a time, so the owner sees
 * them in order and a client cannot make the server buffer more than one
 * (each at most max_request_bytes). Lock held. */
static void stream_arm_recv_locked(struct rpc_stream *st)
{
    grpc_op op;

    if (st->closed || st->recv_inflight || st->finish_wanted || !st->on_msg)
        return;
    memset(&op, 0, sizeof(op));
    op.op = GRPC_OP_RECV_MESSAGE;
    op.data.recv_message.recv_message = &st->recv_bb;
    st->recv_inflight = true;
    if (!stream_start_locked(st, &op, 1, &st->recv_tag))
        st->recv_inflight = false;
}

static void stream_recv_done(struct rpc_tag *t, bool ok)
{
    struct rpc_stream *st = (struct rpc_stream *)((char *)t - offsetof(struct rpc_stream, recv_tag));
    grpc_byte_buffer *bb;
    ProtobufCMessage *m = NULL;
    uint64_t held = 0;
    rpc_close_fn fn;
    void *arg = NULL;

    pthread_mutex_lock(&st->lock);
    bb = st->recv_bb;
    st->recv_bb = NULL;
    pthread_mutex_unlock(&st->lock);
    /* No message but success: the client half-closed, which its owner
     * hears as NULL. Failure: the call is over (on_close says so). Either
     * way nothing more is read. */
    if (ok && !bb)
        st->on_msg(st->msg_arg, st, NULL);
    if (ok && bb) {
        m = rpc_unpack_bb(bb, st->desc);
        if (m) {
            st->on_msg(st->msg_arg, st, m);
            protobuf_c_message_free_unpacked(m, NULL);
        } else {
            if (warn_allowed(&held))
                log_warn("rpc", "A stream message did not parse; the stream was ended.",
                         LF_S("expected", st->desc->name), LF_U("held_back", held));
            rpc_stream_finish(st, RPC_INVALID_ARGUMENT,
                              "malformed stream message: not a valid message of the method's "
                              "type");
        }
    }
    if (bb)
        grpc_byte_buffer_destroy(bb);
    pthread_mutex_lock(&st->lock);
    st->recv_inflight = false;
    if (m)
        stream_arm_recv_locked(st);
    fn = stream_take_close_locked(st, &arg);
    if (fn) {
        pthread_mutex_unlock(&st->lock);
        fn(arg, st);
        pthread_mutex_lock(&st->lock);
    }
    stream_after_batch(st);
}

/* Starts one batch on the stream's call; the stream and server stay alive
 * until its tag comes back. Lock held. */
static bool stream_start_locked(struct rpc_stream *st, grpc_op *ops, size_t n, struct rpc_tag *t)
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
        st->send_bb = rpc_buf_to_bb(st->pending);
        st->sending = st->pending;
        st->pending = NULL;
        op.op = GRPC_OP_SEND_MESSAGE;
        op.data.send_message.send_message = st->send_bb;
        st->send_inflight = true;
        if (!stream_start_locked(st, &op, 1, &st->send_tag)) {
            grpc_byte_buffer_destroy(st->send_bb);
            st->send_bb = NULL;
            rpc_buf_unref(st->sending);
            st->sending = NULL;
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
    st->recv_tag.fn = stream_recv_done;
    st->desc = in->meth->m.request;
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

static void incoming_done(struct rpc_tag *t, bool ok)
{
    struct incoming *in = (struct incoming *)t;
    struct rpc_server *s = in->srv;
    ProtobufCMessage *req = NULL;
    uint64_t held = 0;

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
    if (!in->payload || !(req = rpc_unpack_bb(in->payload, in->meth->m.request))) {
        if (warn_allowed(&held))
            log_warn("rpc", "A request did not parse; it was refused.",
                     LF_S("method", in->meth->m.path), LF_S("expected", in->meth->m.request->name),
                     LF_U("held_back", held));
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

static void shutdown_done(struct rpc_tag *t, bool ok)
{
    struct rpc_server *s = (struct rpc_server *)((char *)t - offsetof(struct rpc_server, shutdown_tag));

    server_release(s);
}

/* Whether `key_pem` is the private key of the first certificate of
 * `cert_pem`. gRPC takes any pair and fails every handshake later; a
 * broker started with the wrong key file should not start at all. */
static bool tls_pair_matches(const char *cert_pem, const char *key_pem)
{
    BIO *cb = BIO_new_mem_buf(cert_pem, -1), *kb = BIO_new_mem_buf(key_pem, -1);
    X509 *cert = cb ? PEM_read_bio_X509(cb, NULL, NULL, NULL) : NULL;
    EVP_PKEY *key = kb ? PEM_read_bio_PrivateKey(kb, NULL, NULL, NULL) : NULL;
    bool ok = cert && key && X509_check_private_key(cert, key) == 1;

    EVP_PKEY_free(key);
    X509_free(cert);
    BIO_free(kb);
    BIO_free(cb);
    ERR_clear_error();
    return ok;
}

int rpc_server_create(const char *address, const struct rpc_method *methods, size_t n,
                      const struct rpc_server_opts *opts, struct rpc_server **out)
{
    size_t max_req = opts && opts->max_request_bytes ? opts->max_request_bytes
                                                     : LIMIT_RPC_REQUEST_BYTES;
    grpc_arg args[5];
    grpc_channel_args cargs = { .num_args = 5, .args = args };
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
    /* gRPC answers data with a bandwidth probe (a PING) to size its flow
     * control windows: on streams of small messages, such as heartbeats,
     * that is a second round trip per message for nothing. */
    args[4].type = GRPC_ARG_INTEGER;
    args[4].key = (char *)GRPC_ARG_HTTP2_BDP_PROBE;
    args[4].value.integer = 0;

    s->server = grpc_server_create(&cargs, NULL);
    if (!s->server)
        goto err_methods;
    grpc_server_register_completion_queue(s->server, rpc_queue(), NULL);
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
    if (opts && (!opts->tls_cert_pem != !opts->tls_key_pem)) {
        rc = -EINVAL;
        goto err_server;
    }
    if (opts && opts->tls_cert_pem && !tls_pair_matches(opts->tls_cert_pem, opts->tls_key_pem)) {
        log_error("rpc", "The TLS private key is not the certificate's, or one of them does "
                  "not parse.");
        rc = -EINVAL;
        goto err_server;
    }
    if (opts && opts->tls_cert_pem) {
        grpc_ssl_pem_key_cert_pair pair = { .private_key = opts->tls_key_pem,
                                            .cert_chain = opts->tls_cert_pem };
        creds = grpc_ssl_server_credentials_create_ex(NULL, &pair, 1,
                                                      GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE,
                                                      NULL);
    } else {
        creds = grpc_insecure_server_credentials_create();
    }
    if (!creds) {
        rc = -EINVAL;
        goto err_server;
    }
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
    grpc_server_shutdown_and_notify(s->server, rpc_queue(), &s->shutdown_tag);
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
    grpc_server_shutdown_and_notify(s->server, rpc_queue(), &s->shutdown_tag);
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
    rpc_buf_unref(st->sending);
    grpc_slice_unref(st->fdetails);
    if (st->recv_bb)
        grpc_byte_buffer_destroy(st->recv_bb);
    if (st->call)
        grpc_call_unref(st->call);
    pthread_mutex_destroy(&st->lock);
    free(st);
}

int rpc_stream_send(struct rpc_stream *st, struct rpc_buf *b)
{
    return rpc_stream_offer(st, b, true);
}

int rpc_stream_offer(struct rpc_stream *st, struct rpc_buf *b, bool replace)
{
    int rc = 0;

    pthread_mutex_lock(&st->lock);
    if (st->closed || st->broken || st->finish_wanted) {
        rc = -EPIPE;
        goto out;
    }
    if (!replace && st->pending) {
        rc = -EBUSY;
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

bool rpc_stream_cancelled(struct rpc_stream *st)
{
    bool c;

    pthread_mutex_lock(&st->lock);
    c = st->closed && st->cancelled != 0;
    pthread_mutex_unlock(&st->lock);
    return c;
}

void rpc_stream_on_message(struct rpc_stream *st, rpc_stream_msg_fn fn, void *arg)
{
    pthread_mutex_lock(&st->lock);
    if (!st->on_msg && fn) {
        st->on_msg = fn;
        st->msg_arg = arg;
        stream_arm_recv_locked(st);
    }
    pthread_mutex_unlock(&st->lock);
}

void rpc_stream_on_close(struct rpc_stream *st, rpc_close_fn fn, void *arg)
{
    bool now;

    pthread_mutex_lock(&st->lock);
    st->on_close = fn;
    st->close_arg = arg;
    /* Over already: at once, unless a message callback still runs (it
     * runs on_close when it returns). */
    now = stream_take_close_locked(st, &arg) != NULL;
    pthread_mutex_unlock(&st->lock);
    if (now)
        fn(arg, st);
}

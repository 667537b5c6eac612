/* src/rpc/client.c: rpc.h's client side: channels, unary calls (blocking
 * and asynchronous) and watches of server streams, which may keep sending
 * (duplex). Every call is a tag on
 * the shared completion queue (core.h). */
#include "rpc/core.h"

#include <errno.h>
#include <netdb.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include <grpc/grpc_security.h>
#include <grpc/support/alloc.h>

#include "base/limits.h"
#include "base/log.h"

struct rpc_channel {
    grpc_channel *ch;
};

int rpc_channel_create(const char *target, const struct rpc_channel_opts *opts,
                       struct rpc_channel **out)
{
    size_t max_reply = opts && opts->max_reply_bytes ? opts->max_reply_bytes
                                                     : LIMIT_RPC_REPLY_BYTES;
    uint32_t backoff = opts && opts->max_backoff_ms ? opts->max_backoff_ms : LIMIT_BACKOFF_MAX_MS;
    grpc_channel_credentials *creds;
    struct rpc_channel *c;
    grpc_arg args[8];
    grpc_channel_args cargs = { .num_args = 7, .args = args };

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
    /* gRPC core reads this argument as the shortest time one connection
     * attempt gets (TCP, TLS, the server's SETTINGS frame), not as a
     * backoff: at 100 ms a TLS handshake on a loaded node timed out again
     * and again. */
    args[3].type = GRPC_ARG_INTEGER;
    args[3].key = (char *)GRPC_ARG_MIN_RECONNECT_BACKOFF_MS;
    args[3].value.integer = RPC_CONNECT_TIMEOUT_MS;
    args[4].type = GRPC_ARG_INTEGER;
    args[4].key = (char *)GRPC_ARG_KEEPALIVE_TIME_MS;
    args[4].value.integer = 10000;
    /* Each channel gets its own connection: members are separate peers to
     * the broker even when one process simulates many. */
    args[5].type = GRPC_ARG_INTEGER;
    args[5].key = (char *)GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL;
    args[5].value.integer = 1;
    /* No bandwidth probe (a PING) for the data received: the server must
     * answer each, and calls and streams here carry small messages. */
    args[6].type = GRPC_ARG_INTEGER;
    args[6].key = (char *)GRPC_ARG_HTTP2_BDP_PROBE;
    args[6].value.integer = 0;
    if (opts && opts->tls_server_name) {
        args[cargs.num_args].type = GRPC_ARG_STRING;
        args[cargs.num_args].key = (char *)GRPC_SSL_TARGET_NAME_OVERRIDE_ARG;
        args[cargs.num_args].value.string = (char *)opts->tls_server_name;
        cargs.num_args++;
    }
    if (opts && opts->tls_ca_pem)
        creds = grpc_ssl_credentials_create(opts->tls_ca_pem, NULL, NULL, NULL);
    else
        creds = grpc_insecure_credentials_create();
    if (!creds) {
        free(c);
        return -EINVAL;
    }
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
    struct rpc_tag tag;
    grpc_call *call;
    grpc_byte_buffer *send_bb, *recv_bb;
    grpc_metadata_array init_md, trail_md;
    grpc_status_code status;
    grpc_slice details;
    const ProtobufCMessageDescriptor *desc;
    rpc_done_fn done;
    void *arg;
};

static void ucall_done(struct rpc_tag *t, bool ok)
{
    struct ucall *u = (struct ucall *)t;
    struct rpc_status st;
    ProtobufCMessage *reply = NULL;

    if (!ok) {
        rpc_status_set(&st, RPC_INTERNAL, "the call failed inside gRPC", 27);
    } else {
        rpc_status_from_grpc(&st, u->status, u->details);
        if (st.code == RPC_OK) {
            if (!u->recv_bb || !(reply = rpc_unpack_bb(u->recv_bb, u->desc))) {
                const char *m = "malformed reply: not a valid message of the expected type";
                rpc_status_set(&st, RPC_INTERNAL, m, strlen(m));
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
    u->call = grpc_channel_create_call(c->ch, NULL, GRPC_PROPAGATE_DEFAULTS, rpc_queue(), method,
                                       NULL, rpc_deadline_after(timeout_ms), NULL);
    if (!u->call)
        goto err;
    u->send_bb = rpc_pack_bb(req);
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

struct rpc_pending {
    struct waiter w;
};

int rpc_call_start(struct rpc_channel *c, const char *path, const ProtobufCMessage *req,
                   const ProtobufCMessageDescriptor *reply_desc, uint32_t timeout_ms,
                   unsigned flags, struct rpc_pending **out)
{
    struct rpc_pending *p;
    int rc;

    if (rpc_on_completion_thread())
        return -EDEADLK;
    p = calloc(1, sizeof(*p));
    if (!p)
        return -ENOMEM;
    pthread_mutex_init(&p->w.lock, NULL);
    pthread_cond_init(&p->w.cond, NULL);
    rc = rpc_call_async(c, path, req, reply_desc, timeout_ms, flags, waiter_done, &p->w);
    if (rc < 0) {
        pthread_cond_destroy(&p->w.cond);
        pthread_mutex_destroy(&p->w.lock);
        free(p);
        return rc;
    }
    *out = p;
    return 0;
}

int rpc_call_finish(struct rpc_pending *p, ProtobufCMessage **reply, struct rpc_status *st)
{
    struct waiter *w = &p->w;
    int rc;

    pthread_mutex_lock(&w->lock);
    while (!w->done)
        pthread_cond_wait(&w->cond, &w->lock);
    pthread_mutex_unlock(&w->lock);
    if (st)
        *st = w->st;
    rc = rpc_code_to_errno(w->st.code);
    if (rc == 0)
        *reply = w->reply;
    pthread_cond_destroy(&w->cond);
    pthread_mutex_destroy(&w->lock);
    free(p);
    return rc;
}

int rpc_call(struct rpc_channel *c, const char *path, const ProtobufCMessage *req,
             const ProtobufCMessageDescriptor *reply_desc, uint32_t timeout_ms, unsigned flags,
             ProtobufCMessage **reply, struct rpc_status *st)
{
    struct rpc_pending *p;
    int rc = rpc_call_start(c, path, req, reply_desc, timeout_ms, flags, &p);

    if (rc == -EDEADLK)
        return rc;
    if (rc < 0) {
        rpc_status_set(st, RPC_INTERNAL, "the call could not start", 24);
        return rc;
    }
    return rpc_call_finish(p, reply, st);
}

struct rpc_watch {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    grpc_call *call;
    struct rpc_tag start_tag, msg_tag, status_tag, send_tag;
    grpc_byte_buffer *send_bb, *recv_bb;
    grpc_byte_buffer *out_bb;   /* rpc_watch_send's, while it goes out */
    grpc_metadata_array init_md, trail_md;
    grpc_status_code status;
    grpc_slice details;
    const ProtobufCMessageDescriptor *desc;
    rpc_msg_fn on_msg;
    rpc_end_fn on_end;
    void *arg;
    int batches;                /* in flight */
    bool status_done, ended, bad_message;
    bool duplex, send_inflight, send_closed;
};

/* on_end runs once, after every batch is back: no on_msg can follow it. */
static void watch_maybe_end_locked(struct rpc_watch *w)
{
    struct rpc_status st;

    if (w->batches > 0 || !w->status_done || w->ended)
        return;
    rpc_status_from_grpc(&st, w->status, w->details);
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

static void watch_start_done(struct rpc_tag *t, bool ok)
{
    struct rpc_watch *w = (struct rpc_watch *)((char *)t - offsetof(struct rpc_watch, start_tag));

    pthread_mutex_lock(&w->lock);
    w->batches--;
    w->send_inflight = false;   /* the first message is out */
    watch_maybe_end_locked(w);
    pthread_mutex_unlock(&w->lock);
}

static void watch_send_done(struct rpc_tag *t, bool ok)
{
    struct rpc_watch *w = (struct rpc_watch *)((char *)t - offsetof(struct rpc_watch, send_tag));

    pthread_mutex_lock(&w->lock);
    if (w->out_bb)      /* NULL after a half-close */
        grpc_byte_buffer_destroy(w->out_bb);
    w->out_bb = NULL;
    w->send_inflight = false;
    w->batches--;
    watch_maybe_end_locked(w);
    pthread_mutex_unlock(&w->lock);
}

/* A duplex watch has one send in flight at most: a message or the
 * half-close. Whether one may start now: 0, or the -errno that
 * rpc_watch_send() and rpc_watch_done_sending() give. Lock held. */
static int send_may_start_locked(const struct rpc_watch *w)
{
    if (!w->duplex)
        return -EINVAL;
    if (w->status_done || w->ended || w->send_closed)
        return -EPIPE;
    if (w->send_inflight)
        return -EBUSY;
    return 0;
}

/* Starts `op` as the watch's send; -EPIPE, with nothing in flight, when
 * gRPC refuses it. Lock held. */
static int send_start_locked(struct rpc_watch *w, grpc_op *op)
{
    w->batches++;
    w->send_inflight = true;
    if (grpc_call_start_batch(w->call, op, 1, &w->send_tag, NULL) != GRPC_CALL_OK) {
        w->batches--;
        w->send_inflight = false;
        return -EPIPE;
    }
    return 0;
}

int rpc_watch_send(struct rpc_watch *w, const ProtobufCMessage *msg)
{
    grpc_op op;
    int rc;

    pthread_mutex_lock(&w->lock);
    rc = send_may_start_locked(w);
    if (rc == 0 && !(w->out_bb = rpc_pack_bb(msg)))
        rc = -ENOMEM;
    if (rc == 0) {
        memset(&op, 0, sizeof(op));
        op.op = GRPC_OP_SEND_MESSAGE;
        op.data.send_message.send_message = w->out_bb;
        rc = send_start_locked(w, &op);
        if (rc < 0) {
            grpc_byte_buffer_destroy(w->out_bb);
            w->out_bb = NULL;
        }
    }
    pthread_mutex_unlock(&w->lock);
    return rc;
}

/* "ipv4:1.2.3.4:7070" or "ipv6:[::1]:7070" (a zone written %25eth0) into
 * *sa. */
static int parse_peer(const char *peer, struct sockaddr_storage *sa, socklen_t *len)
{
    struct addrinfo hints = { .ai_family = AF_UNSPEC, .ai_socktype = SOCK_DGRAM,
                              .ai_flags = AI_NUMERICHOST | AI_NUMERICSERV };
    struct addrinfo *res = NULL;
    char host[128];
    const char *h, *end, *port;
    size_t n = 0;

    if (strncmp(peer, "ipv4:", 5) == 0) {
        h = peer + 5;
        end = strrchr(h, ':');
    } else if (strncmp(peer, "ipv6:[", 6) == 0) {
        h = peer + 6;
        end = strchr(h, ']');
        if (end && end[1] != ':')
            end = NULL;
    } else {
        return -EAFNOSUPPORT;
    }
    if (!end)
        return -EAFNOSUPPORT;
    port = end + (*end == ']' ? 2 : 1);
    for (; h < end && n + 1 < sizeof(host); h++) {
        if (strncmp(h, "%25", 3) == 0)
            h += 2;
        host[n++] = *h;
    }
    host[n] = '\0';
    if (h < end || getaddrinfo(host, port, &hints, &res) != 0 || !res)
        return -EAFNOSUPPORT;
    if (res->ai_addrlen > sizeof(*sa)) {
        freeaddrinfo(res);
        return -EAFNOSUPPORT;
    }
    memcpy(sa, res->ai_addr, res->ai_addrlen);
    *len = res->ai_addrlen;
    freeaddrinfo(res);
    return 0;
}

int rpc_watch_peer(struct rpc_watch *w, struct sockaddr_storage *sa, socklen_t *len)
{
    char *peer;
    int rc;

    pthread_mutex_lock(&w->lock);
    peer = w->call ? grpc_call_get_peer(w->call) : NULL;
    pthread_mutex_unlock(&w->lock);
    if (!peer)
        return -ENOTCONN;
    rc = parse_peer(peer, sa, len);
    gpr_free(peer);
    return rc;
}

int rpc_watch_done_sending(struct rpc_watch *w)
{
    grpc_op op;
    int rc;

    pthread_mutex_lock(&w->lock);
    rc = send_may_start_locked(w);
    if (rc == 0) {
        memset(&op, 0, sizeof(op));
        op.op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
        w->send_closed = true;
        rc = send_start_locked(w, &op);
    }
    pthread_mutex_unlock(&w->lock);
    return rc;
}

static void watch_msg_done(struct rpc_tag *t, bool ok)
{
    struct rpc_watch *w = (struct rpc_watch *)((char *)t - offsetof(struct rpc_watch, msg_tag));
    grpc_byte_buffer *bb = w->recv_bb;
    ProtobufCMessage *m = NULL;

    w->recv_bb = NULL;
    if (ok && bb) {
        m = rpc_unpack_bb(bb, w->desc);
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

static void watch_status_done(struct rpc_tag *t, bool ok)
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
    w->send_tag.fn = watch_send_done;
    w->duplex = (flags & RPC_DUPLEX) != 0;
    w->desc = msg_desc;
    w->on_msg = on_msg;
    w->on_end = on_end;
    w->arg = arg;
    w->details = grpc_empty_slice();
    grpc_metadata_array_init(&w->init_md);
    grpc_metadata_array_init(&w->trail_md);
    w->call = grpc_channel_create_call(c->ch, NULL, GRPC_PROPAGATE_DEFAULTS, rpc_queue(),
                                       grpc_slice_from_static_string(path), NULL,
                                       gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    if (!w->call)
        goto err_free;
    w->send_bb = rpc_pack_bb(req);

    pthread_mutex_lock(&w->lock);
    memset(ops, 0, sizeof(ops));
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[0].flags = (flags & RPC_WAIT_FOR_READY) ? GRPC_INITIAL_METADATA_WAIT_FOR_READY : 0;
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = w->send_bb;
    ops[2].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[2].data.recv_initial_metadata.recv_initial_metadata = &w->init_md;
    /* A duplex watch keeps its side open for rpc_watch_send. */
    ops[3].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    w->batches++;
    w->send_inflight = w->duplex;
    if (grpc_call_start_batch(w->call, ops, w->duplex ? 3 : 4, &w->start_tag, NULL) !=
        GRPC_CALL_OK)
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

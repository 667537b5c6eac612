/* src/rpc/rpc.h: unary, server-streaming and duplex gRPC calls, server and client, over
 * the gRPC C core with protobuf-c messages. The only module that includes a
 * grpc header: everything above it speaks protobuf-c and -errno. It is
 * implemented by core.c (the runtime, codes and buffers), server.c and
 * client.c, which share the private core.h.
 *
 * Threads: rpc_init() starts a small pool of completion threads shared by
 * every server and channel in the process. Handlers and callbacks run on
 * those threads; they must not block for long, and must not call the
 * blocking functions of this module (rpc_call, rpc_watch_close,
 * rpc_server_destroy), which return -EDEADLK there instead of hanging.
 */
#ifndef COHORT_RPC_H
#define COHORT_RPC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

#include <protobuf-c/protobuf-c.h>

#include "base/limits.h"

/* gRPC status codes, by their gRPC numbers (grpc/status.h stays private). */
enum rpc_code {
    RPC_OK = 0,
    RPC_CANCELLED = 1,
    RPC_UNKNOWN = 2,
    RPC_INVALID_ARGUMENT = 3,
    RPC_DEADLINE_EXCEEDED = 4,
    RPC_NOT_FOUND = 5,
    RPC_ALREADY_EXISTS = 6,
    RPC_PERMISSION_DENIED = 7,
    RPC_RESOURCE_EXHAUSTED = 8,
    RPC_FAILED_PRECONDITION = 9,
    RPC_ABORTED = 10,
    RPC_OUT_OF_RANGE = 11,
    RPC_UNIMPLEMENTED = 12,
    RPC_INTERNAL = 13,
    RPC_UNAVAILABLE = 14,
    RPC_DATA_LOSS = 15,
    RPC_UNAUTHENTICATED = 16,
};

#define RPC_MESSAGE_MAX 256

struct rpc_status {
    enum rpc_code code;
    char message[RPC_MESSAGE_MAX];      /* the peer's details, cut to fit */
};

/* The boundary mapping between gRPC codes and our -errno convention:
 * INVALID_ARGUMENT -EINVAL, DEADLINE_EXCEEDED -ETIMEDOUT, NOT_FOUND -ENOENT,
 * ALREADY_EXISTS -EEXIST, RESOURCE_EXHAUSTED -ENOSPC (and -EMSGSIZE, -E2BIG
 * going out), FAILED_PRECONDITION -EPROTO, UNAVAILABLE -ECONNREFUSED,
 * CANCELLED -ECANCELED, UNIMPLEMENTED -ENOSYS, ABORTED -ECONNABORTED,
 * PERMISSION_DENIED -EACCES, UNAUTHENTICATED -EPERM, OUT_OF_RANGE -ERANGE,
 * the rest -EIO. */
int rpc_code_to_errno(enum rpc_code code);
enum rpc_code rpc_code_from_errno(int err);
const char *rpc_code_name(enum rpc_code code);

/* Starts gRPC and the completion threads (refcounted: each rpc_init needs
 * one rpc_shutdown). Returns 0 or -ENOMEM/-EAGAIN. gRPC's own log lines are
 * routed to log.h under the component "grpc". */
int rpc_init(void);
/* rpc_init with `threads` completion threads, 1 or 2 (-EINVAL otherwise),
 * when this call starts the runtime; a later call shares the threads
 * already running. One thread serves a process whose callbacks never
 * block for long, a broker, with less CPU per message: no thread hands
 * polling or a completion to another (bench/broker.sh, README). */
int rpc_init_threads(unsigned threads);
/* Stops the threads and gRPC once the last user calls it. Every server,
 * channel, stream and watch must be destroyed first. */
void rpc_shutdown(void);

/* A packed message, shared by reference: pack once, send to many streams. */
struct rpc_buf;

/* Packs `m` (borrowed). Returns 0 or -ENOMEM; the caller drops *out with
 * rpc_buf_unref(). */
int rpc_buf_pack(const ProtobufCMessage *m, struct rpc_buf **out);
struct rpc_buf *rpc_buf_ref(struct rpc_buf *b);
/* Runs fn(arg) when the last reference to `b` is dropped: every stream it
 * was queued on has finished sending it (the transport took it), or
 * dropped it (replaced by a newer message, or the stream ended), and the
 * owner let go of it. On whichever thread drops it, possibly a completion
 * thread with a stream's lock held: fn must not call into this module.
 * Set it once, before `b` is shared. */
typedef void (*rpc_release_fn)(void *arg);
void rpc_buf_on_release(struct rpc_buf *b, rpc_release_fn fn, void *arg);
void rpc_buf_unref(struct rpc_buf *b);          /* NULL is fine */
size_t rpc_buf_len(const struct rpc_buf *b);

/* ---- server ------------------------------------------------------------ */

struct rpc_server;
struct rpc_reply;       /* the answer to one unary call */
struct rpc_stream;      /* one server-streaming call */

/* Unary handler: must answer through rpc_reply_ok() or rpc_reply_error()
 * before returning (no answer is sent as INTERNAL). `req` is borrowed. */
typedef void (*rpc_unary_fn)(void *arg, const ProtobufCMessage *req, struct rpc_reply *reply);
/* Streaming handler: receives one reference to `s` and either finishes it
 * at once (rpc_stream_finish, then rpc_stream_unref) or keeps it to send
 * later. `req` is the client's first message, borrowed; a duplex method's
 * handler reads the ones after it with rpc_stream_on_message. */
typedef void (*rpc_stream_fn)(void *arg, const ProtobufCMessage *req, struct rpc_stream *s);

struct rpc_method {
    const char *path;                           /* "/cohort.v1.Broker/Join" */
    const ProtobufCMessageDescriptor *request;
    rpc_unary_fn unary;                         /* exactly one of the two */
    rpc_stream_fn stream;
    void *arg;                                  /* borrowed */
};

struct rpc_server_opts {
    size_t max_request_bytes;   /* larger requests get RESOURCE_EXHAUSTED;
                                 * 0: LIMIT_RPC_REQUEST_BYTES (base/limits.h) */
    /* TLS: the server's certificate chain and private key, PEM, both or
     * neither (copied). Clients are not asked for certificates: a member
     * proves itself inside each request (membership/wire.h). */
    const char *tls_cert_pem;
    const char *tls_key_pem;
};

/* Binds `address` ("host:port", port 0 for a free one, or "unix:PATH") and
 * starts serving `methods` (copied; their args borrowed). Unknown methods get
 * UNIMPLEMENTED; requests that do not parse as the method's message get
 * INVALID_ARGUMENT; both are logged. Returns 0, -EADDRINUSE or -EINVAL when
 * the address cannot be bound (also: only one of the TLS pair, a key that
 * is not the certificate's, or a pair gRPC refuses), -ENOMEM. Caller frees
 * with rpc_server_destroy(). */
int rpc_server_create(const char *address, const struct rpc_method *methods, size_t n,
                      const struct rpc_server_opts *opts, struct rpc_server **out);
/* The bound TCP port (useful after asking for port 0); 0 for unix sockets. */
int rpc_server_port(const struct rpc_server *s);
/* Stops accepting, cancels every call in flight (their streams see
 * on_close), waits for all handlers to return, and frees the server.
 * Streams still referenced stay valid objects; sends on them fail. */
void rpc_server_destroy(struct rpc_server *s);   /* NULL is fine */

/* Answer a unary call. `msg` is borrowed (packed at once). */
void rpc_reply_ok(struct rpc_reply *r, const ProtobufCMessage *msg);
void rpc_reply_error(struct rpc_reply *r, enum rpc_code code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

struct rpc_stream *rpc_stream_ref(struct rpc_stream *s);
void rpc_stream_unref(struct rpc_stream *s);    /* NULL is fine */

/* Queues `b` (a reference is taken) for the client. Latest wins: at most one
 * message waits behind the one in flight, and a newer one replaces it, so a
 * slow reader costs a bounded amount of memory and gets the newest state.
 * Returns 0, or -EPIPE once the stream is finished or the client is gone. */
int rpc_stream_send(struct rpc_stream *s, struct rpc_buf *b);
/* rpc_stream_send with a choice: with `replace` false, a message already
 * waiting is kept and `b` is not queued (-EBUSY), for messages that matter
 * less than whatever waits (an acknowledgement behind an epoch). */
int rpc_stream_offer(struct rpc_stream *s, struct rpc_buf *b, bool replace);

/* Duplex: the client's messages after the first, each unpacked as the
 * method's request type, borrowed for the call. They come one at a time
 * and in order on a completion thread, the next only after fn returns, so
 * fn may send and finish on `s`. `msg` NULL: the client said it sends no
 * more (rpc_watch_done_sending), once, last. A message that does not
 * parse finishes the stream with INVALID_ARGUMENT and fn never sees it. Set once, in the
 * handler, after rpc_stream_on_close (fn may run before this returns). */
typedef void (*rpc_stream_msg_fn)(void *arg, struct rpc_stream *s, const ProtobufCMessage *msg);
void rpc_stream_on_message(struct rpc_stream *s, rpc_stream_msg_fn fn, void *arg);

/* Ends the stream with `code` after any queued message. Idempotent. */
void rpc_stream_finish(struct rpc_stream *s, enum rpc_code code, const char *message);

/* Called once when the call is over for any reason: the client hung up,
 * the stream was finished, or the server is going away. Runs on a
 * completion thread with no lock of this module held. Set it in the
 * handler, before the stream is shared. */
typedef void (*rpc_close_fn)(void *arg, struct rpc_stream *s);
void rpc_stream_on_close(struct rpc_stream *s, rpc_close_fn fn, void *arg);
/* True once the call is over without the server's status reaching the
 * client: the client cancelled it, or its connection was reset or closed
 * (its process died), or the server is going away. False while the call
 * is open and after the server finished it. Meant for on_close. */
bool rpc_stream_cancelled(struct rpc_stream *s);

/* ---- client ------------------------------------------------------------ */

struct rpc_channel;

/* How long one connection attempt to a server may take, TLS handshake
 * included, before it is abandoned and retried after the backoff. */
#define RPC_CONNECT_TIMEOUT_MS 5000

/* The longest wait between a channel's reconnect attempts at its default
 * cap: LIMIT_BACKOFF_MAX_MS, which gRPC stretches by up to 20 % of jitter
 * (its backoff's fixed jitter). A restarted server sees every client of
 * a default channel try again within this (broker_startup_hold_ms). */
#define RPC_RECONNECT_MAX_MS (LIMIT_BACKOFF_MAX_MS + LIMIT_BACKOFF_MAX_MS / 5u)

struct rpc_channel_opts {
    size_t max_reply_bytes;     /* 0: LIMIT_RPC_REPLY_BYTES (base/limits.h) */
    uint32_t max_backoff_ms;    /* reconnect backoff cap; 0: LIMIT_BACKOFF_MAX_MS */
    /* TLS: the PEM certificates the server's chain must lead to (copied);
     * NULL: plaintext. tls_server_name: the name the certificate must
     * carry when it is not the target's host (a broker reached by pod IP
     * whose certificate names its Service); NULL: the target's host. */
    const char *tls_ca_pem;
    const char *tls_server_name;
};

/* The longest PEM file rpc_pem_load() reads: a certificate chain of a few
 * certificates, or a key, is a few KiB. */
#define RPC_PEM_MAX (256u * 1024u)

/* Reads a PEM file for the TLS options above (a CA bundle, a certificate
 * chain, a private key): at most RPC_PEM_MAX bytes, NUL-terminated.
 * Returns 0 and sets *out, which the caller frees with rpc_pem_free();
 * -EFBIG for a longer file, -EINVAL when it holds no PEM block, or the
 * open/read -errno (-ENOENT, -EACCES). */
int rpc_pem_load(const char *path, char **out);
/* Overwrites (it may be a private key) and frees. NULL is fine. */
void rpc_pem_free(char *pem);

/* A channel to `target` ("host:port", "ipv4:...", "unix:PATH"). Connects
 * lazily. Returns 0, -EINVAL, -ENOMEM. Caller frees with
 * rpc_channel_destroy() after every call on it has completed. */
int rpc_channel_create(const char *target, const struct rpc_channel_opts *opts,
                       struct rpc_channel **out);
void rpc_channel_destroy(struct rpc_channel *ch);   /* NULL is fine */

/* Wait for the server to come up (until the deadline) instead of failing
 * at once with UNAVAILABLE. */
#define RPC_WAIT_FOR_READY 1u
/* rpc_watch_open: keep the client's side open after the first message,
 * for rpc_watch_send (a duplex method). */
#define RPC_DUPLEX 2u

/* A blocking unary call. `req` borrowed. On success returns 0 and sets
 * *reply (caller frees with protobuf_c_message_free_unpacked(*reply, NULL)).
 * On failure returns the mapped -errno and, if st is not NULL, fills it. */
int rpc_call(struct rpc_channel *ch, const char *path, const ProtobufCMessage *req,
             const ProtobufCMessageDescriptor *reply_desc, uint32_t timeout_ms, unsigned flags,
             ProtobufCMessage **reply, struct rpc_status *st);

/* rpc_call in two halves, for a caller that must start the call under a
 * lock of its own (so that what it signed goes out in the order signed)
 * and wait outside it. On 0, *out is the call in flight: the caller must
 * pass it to rpc_call_finish exactly once, which waits (the call's own
 * deadline bounds the wait), fills *reply and st as rpc_call does, and
 * frees it. Returns 0 or -errno (then nothing is in flight). */
struct rpc_pending;
int rpc_call_start(struct rpc_channel *ch, const char *path, const ProtobufCMessage *req,
                   const ProtobufCMessageDescriptor *reply_desc, uint32_t timeout_ms,
                   unsigned flags, struct rpc_pending **out);
int rpc_call_finish(struct rpc_pending *p, ProtobufCMessage **reply, struct rpc_status *st);

/* Completion of an asynchronous call: `reply` is NULL unless st->code is
 * RPC_OK, and the callee owns it (protobuf_c_message_free_unpacked). */
typedef void (*rpc_done_fn)(void *arg, const struct rpc_status *st, ProtobufCMessage *reply);

/* Starts a unary call; `done` runs exactly once on a completion thread.
 * Returns 0, or -errno (then `done` never runs). */
int rpc_call_async(struct rpc_channel *ch, const char *path, const ProtobufCMessage *req,
                   const ProtobufCMessageDescriptor *reply_desc, uint32_t timeout_ms,
                   unsigned flags, rpc_done_fn done, void *arg);

struct rpc_watch;       /* the client side of a server stream */

typedef void (*rpc_msg_fn)(void *arg, ProtobufCMessage *msg);  /* callee owns msg */
typedef void (*rpc_end_fn)(void *arg, const struct rpc_status *st);

/* Opens a server-streaming call with no deadline. on_msg runs for each
 * message in order, then on_end exactly once, after the last on_msg.
 * Returns 0 or -errno (then no callback runs). Caller frees with
 * rpc_watch_close(). */
int rpc_watch_open(struct rpc_channel *ch, const char *path, const ProtobufCMessage *req,
                   const ProtobufCMessageDescriptor *msg_desc, unsigned flags, rpc_msg_fn on_msg,
                   rpc_end_fn on_end, void *arg, struct rpc_watch **out);
/* Sends `msg` (borrowed, packed at once) on a watch opened with
 * RPC_DUPLEX. One message at a time: returns 0, -EBUSY while the previous
 * one (the first included) is still going out, -EPIPE once the stream
 * has ended, -EINVAL on a watch that is not duplex, -ENOMEM. */
int rpc_watch_send(struct rpc_watch *w, const ProtobufCMessage *msg);
/* Tells the server of a duplex watch that no more messages come (a
 * half-close; the server's messages still arrive until it ends the
 * stream). Returns 0, -EBUSY while a message is going out, -EPIPE once
 * ended or already said, -EINVAL on a watch that is not duplex. */
int rpc_watch_done_sending(struct rpc_watch *w);
/* The address the watch's connection reached, as gRPC names its peer
 * ("ipv4:a.b.c.d:port", "ipv6:[addr]:port"), into *sa and *len: known
 * once the server has sent on the stream. Returns 0, -ENOTCONN (not
 * known yet) or -EAFNOSUPPORT (another kind of address, a Unix socket's).
 * membership/member.c sends its datagram heartbeats there. */
int rpc_watch_peer(struct rpc_watch *w, struct sockaddr_storage *sa, socklen_t *len);
/* Cancels the stream if it is still open, waits for on_end, and frees it.
 * Returns 0, or -EDEADLK on a completion thread (nothing is done). */
int rpc_watch_close(struct rpc_watch *w);

/* True on one of this module's completion threads. */
bool rpc_on_completion_thread(void);

#endif

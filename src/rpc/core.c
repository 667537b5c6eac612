/* src/rpc/core.c: the runtime shared by servers and channels (rpc.h's
 * rpc_init, rpc_shutdown), the mapping of codes, packed buffers, and the
 * conversions server.c and client.c share through core.h.
 *
 * Shape: one completion queue for the whole process, drained by a few
 * threads. Every asynchronous operation is a struct whose first member is
 * a `struct rpc_tag`; the queue hands the tag back and its fn finishes the
 * work. Nothing here polls: progress happens only inside
 * grpc_completion_queue_next on those threads.
 */
#include "rpc/core.h"

#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include <grpc/byte_buffer_reader.h>
#include <grpc/support/log.h>

#include "base/log.h"

/* Completion threads when rpc_init starts the runtime: two, so that a
 * callback that blocks for a while (a lock another thread holds) does not
 * stop every other call. rpc_init_threads may ask for one. */
#define RT_THREADS 2

/* ---- runtime ----------------------------------------------------------- */

static pthread_mutex_t rt_lock = PTHREAD_MUTEX_INITIALIZER;
static int rt_users;
static grpc_completion_queue *rt_cq;
static pthread_t rt_threads[RT_THREADS];
static int rt_n_threads;
static _Thread_local bool on_cq_thread;

grpc_completion_queue *rpc_queue(void)
{
    return rt_cq;
}

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
            struct rpc_tag *t = ev.tag;
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

/* gRPC core locks through abseil's Mutex, and an abseil built without
 * NDEBUG (Debian's is) checks every lock for cycles in a global graph:
 * several per cent of a busy broker's CPU, for a check that only aborts.
 * abseil's own switch turns it off; it is a C++ function, looked up by its
 * name under Debian's inline namespace and the plain one, and nothing
 * happens where neither is there (an abseil with NDEBUG skips the check
 * anyway). Its argument is OnDeadlockCycle::kIgnore, 0. */
static void abseil_deadlock_check_off(void)
{
    static const char *const names[] = {
        "_ZN4absl7debian329SetMutexDeadlockDetectionModeENS0_15OnDeadlockCycleE",
        "_ZN4absl29SetMutexDeadlockDetectionModeENS_15OnDeadlockCycleE",
    };

    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        void *sym = dlsym(RTLD_DEFAULT, names[i]);
        void (*set_mode)(int);

        if (!sym)
            continue;
        /* POSIX's way from dlsym's object pointer to a function pointer. */
        memcpy(&set_mode, &sym, sizeof(set_mode));
        set_mode(0);
        return;
    }
}

int rpc_init(void)
{
    return rpc_init_threads(RT_THREADS);
}

int rpc_init_threads(unsigned threads)
{
    int rc = 0, started = 0;

    if (threads < 1 || threads > RT_THREADS)
        return -EINVAL;
    pthread_mutex_lock(&rt_lock);
    if (rt_users++ > 0)
        goto out;
    gpr_set_log_function(grpc_log_to_ours);
    gpr_set_log_verbosity(log_enabled(LOG_DEBUG) ? GPR_LOG_SEVERITY_INFO : GPR_LOG_SEVERITY_ERROR);
    abseil_deadlock_check_off();
    grpc_init();
    rt_cq = grpc_completion_queue_create_for_next(NULL);
    if (!rt_cq) {
        rc = -ENOMEM;
        goto err_grpc;
    }
    for (; started < (int)threads; started++) {
        if (pthread_create(&rt_threads[started], NULL, cq_main, NULL) != 0) {
            rc = -EAGAIN;
            goto err_threads;
        }
    }
    rt_n_threads = started;
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
    for (int i = 0; i < rt_n_threads; i++)
        pthread_join(rt_threads[i], NULL);
    rt_n_threads = 0;
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

void rpc_status_set(struct rpc_status *st, enum rpc_code code, const char *msg, size_t len)
{
    if (!st)
        return;
    st->code = code;
    if (len >= sizeof(st->message))
        len = sizeof(st->message) - 1;
    memcpy(st->message, msg, len);
    st->message[len] = '\0';
}

void rpc_status_from_grpc(struct rpc_status *st, grpc_status_code code, grpc_slice details)
{
    rpc_status_set(st, (enum rpc_code)code, (const char *)GRPC_SLICE_START_PTR(details),
                   GRPC_SLICE_LENGTH(details));
}

gpr_timespec rpc_deadline_after(uint32_t timeout_ms)
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
    rpc_release_fn on_release;
    void *release_arg;
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
    b->on_release = NULL;
    b->release_arg = NULL;
    atomic_init(&b->refs, 1);
    *out = b;
    return 0;
}

struct rpc_buf *rpc_buf_ref(struct rpc_buf *b)
{
    atomic_fetch_add(&b->refs, 1);
    return b;
}

void rpc_buf_on_release(struct rpc_buf *b, rpc_release_fn fn, void *arg)
{
    b->on_release = fn;
    b->release_arg = arg;
}

void rpc_buf_unref(struct rpc_buf *b)
{
    if (b && atomic_fetch_sub(&b->refs, 1) == 1) {
        if (b->on_release)
            b->on_release(b->release_arg);
        grpc_slice_unref(b->slice);
        free(b);
    }
}

size_t rpc_buf_len(const struct rpc_buf *b)
{
    return GRPC_SLICE_LENGTH(b->slice);
}

grpc_byte_buffer *rpc_buf_to_bb(struct rpc_buf *b)
{
    return grpc_raw_byte_buffer_create(&b->slice, 1);
}

grpc_byte_buffer *rpc_pack_bb(const ProtobufCMessage *m)
{
    size_t len = protobuf_c_message_get_packed_size(m);
    grpc_slice s = grpc_slice_malloc(len);
    grpc_byte_buffer *bb;

    protobuf_c_message_pack(m, GRPC_SLICE_START_PTR(s));
    bb = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
    return bb;
}

ProtobufCMessage *rpc_unpack_bb(grpc_byte_buffer *bb, const ProtobufCMessageDescriptor *desc)
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

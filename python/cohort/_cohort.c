/* python/cohort/_cohort.c: the CPython binding of include/cohort.h.
 *
 * Two types:
 *   _cohort.Core     one struct cohort: every trainer call, each raising
 *                    cohort._cohort.Error (an OSError with the errno and
 *                    cohort_strerror's sentence) on a negative return.
 *   _cohort.Region   the cohort's shared memory as a writable buffer, for
 *                    torch.frombuffer. The tensors built on it hold a
 *                    reference to the Region (torch keeps the object, not a
 *                    buffer export), and each Region holds its Core.
 *
 * Why the Region: the mapping must outlive every tensor that points into
 * it, or touching a parameter after close() would fault. So Core.close()
 * only marks the Core closed (every call then raises) and cohort_destroy,
 * which leaves the cohort and unmaps, runs once the last Region is gone:
 * at once when cohort/__init__.py has moved the model's tensors back to
 * private memory, later if the user still holds views of the region.
 *
 * Besides them, codec_encode and codec_decode expose the engine's codecs
 * (engine/codec.h) to cohort.hivemind, which encodes a donor's state with
 * them.
 *
 * Threads: a struct cohort is used by one thread at a time, and a call to
 * a sidecar blocks for up to its reply timeout, so each call runs with
 * the GIL released and under the Core's own lock. The lock is only ever
 * taken with the GIL released, so the two cannot deadlock.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include "cohort.h"
#include "engine/codec.h"

static PyObject *cohort_error;          /* cohort._cohort.Error */

struct core {
    PyObject_HEAD
    struct cohort *c;                   /* NULL once destroyed */
    PyThread_type_lock lock;
    int closed;                         /* close() was called */
    Py_ssize_t regions;                 /* live Region objects */
    size_t extent;                      /* bytes from cohort_params() to the end of the last tensor */
    size_t n_params, n_buffers;
    size_t *buffer_bytes;
    int dtype;                          /* the parameters' enum cohort_dtype */
};

struct region {
    PyObject_HEAD
    struct core *core;                  /* owned reference */
};

static PyTypeObject core_type;
static PyTypeObject region_type;

/* ---- errors ----------------------------------------------------------- */

/* What a call made after close() gets: raise_rc turns it into
 * ValueError, like a closed file. */
#define GONE (-ESHUTDOWN)

/* Raises Error(errno, "what: sentence") for a negative errno and returns
 * NULL, so callers can `return raise_rc(...)`. */
static PyObject *raise_rc(const char *what, int rc)
{
    char msg[512];
    PyObject *args;

    if (rc == GONE) {
        PyErr_SetString(PyExc_ValueError, "the accumulator is closed");
        return NULL;
    }
    snprintf(msg, sizeof(msg), "%s: %s", what, cohort_strerror(rc));
    args = Py_BuildValue("(is)", rc < 0 ? -rc : rc, msg);
    if (args) {
        PyErr_SetObject(cohort_error, args);
        Py_DECREF(args);
    }
    return NULL;
}

static int check_open(struct core *self)
{
    if (self->closed || !self->c) {
        PyErr_SetString(PyExc_ValueError, "the accumulator is closed");
        return -1;
    }
    return 0;
}

/* Leaves the cohort and unmaps, with the GIL released: with an in-process
 * node this joins its threads. Called with the GIL held and no Region
 * left. */
static void destroy_now(struct core *self)
{
    struct cohort *c = self->c;

    if (!c)
        return;
    self->c = NULL;
    Py_BEGIN_ALLOW_THREADS
    PyThread_acquire_lock(self->lock, WAIT_LOCK);
    cohort_destroy(c);
    PyThread_release_lock(self->lock);
    Py_END_ALLOW_THREADS
}

/* Runs `body` (statements using `c` and setting `rc`) with the GIL
 * released and the Core's lock held. `c` is read under the lock: a close()
 * from another thread may have destroyed the cohort while this one waited,
 * and then rc is GONE. */
#define LOCKED(self, body)                                      \
    do {                                                        \
        Py_BEGIN_ALLOW_THREADS                                  \
        PyThread_acquire_lock((self)->lock, WAIT_LOCK);         \
        struct cohort *c = (self)->c;                           \
        if (c) {                                                \
            body;                                               \
        } else {                                                \
            rc = GONE;                                          \
        }                                                       \
        PyThread_release_lock((self)->lock);                    \
        Py_END_ALLOW_THREADS                                    \
    } while (0)

/* ---- construction ----------------------------------------------------- */

/* Where round results land. Built against a cohort.h with a results
 * region (the engine reduces out of place), its own offsets; against one
 * without, the gradients themselves, which the engine reduces in place.
 * setup.py tells which. */
#ifdef COHORT_BINDING_RESULTS
static void *result_at(struct cohort *c, size_t i)
{
    return cohort_result(c, i);
}
#else
static void *result_at(struct cohort *c, size_t i)
{
    return cohort_grad(c, i);
}
#endif

/* specs: a sequence of (dtype code, numel) pairs. Fills *out (caller frees
 * with PyMem_Free) and *n. Returns 0, or -1 with an exception set. */
static int parse_specs(PyObject *specs, const char *what, struct cohort_tensor **out, size_t *n)
{
    PyObject *seq = PySequence_Fast(specs, "tensor specs must be a sequence");
    struct cohort_tensor *t;
    Py_ssize_t len;

    if (!seq)
        return -1;
    len = PySequence_Fast_GET_SIZE(seq);
    t = PyMem_Calloc(len ? (size_t)len : 1, sizeof(*t));
    if (!t) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < len; i++) {
        int code;
        unsigned long long numel;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "iK;each tensor spec is (dtype, numel)",
                              &code, &numel))
            goto err;
        if (code < COHORT_F32 || code > COHORT_BF16) {
            PyErr_Format(PyExc_ValueError, "%s %zd: unknown dtype code %d", what, i, code);
            goto err;
        }
        t[i].dtype = (enum cohort_dtype)code;
        t[i].numel = (size_t)numel;
    }
    Py_DECREF(seq);
    *out = t;
    *n = (size_t)len;
    return 0;
err:
    Py_DECREF(seq);
    PyMem_Free(t);
    return -1;
}

static size_t dtype_bytes(int code)
{
    return code == COHORT_F64 ? 8 : code == COHORT_F32 ? 4 : 2;
}

static int core_init(struct core *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = { "name", "parameters", "buffers", NULL };
    struct cohort_tensor *params = NULL, *bufs = NULL;
    size_t np = 0, nb = 0;
    const char *name;
    PyObject *pspec, *bspec;
    struct cohort_config cfg;
    struct cohort *c = NULL;
    char *base;
    int rc, ret = -1;

    if (self->c || self->lock) {
        PyErr_SetString(PyExc_RuntimeError, "Core.__init__ may be called once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kw, "sOO", kwlist, &name, &pspec, &bspec))
        return -1;
    if (parse_specs(pspec, "parameter", &params, &np) < 0 ||
        parse_specs(bspec, "buffer", &bufs, &nb) < 0)
        goto out;
    self->lock = PyThread_allocate_lock();
    self->buffer_bytes = PyMem_Calloc(nb ? nb : 1, sizeof(size_t));
    if (!self->lock || !self->buffer_bytes) {
        PyErr_NoMemory();
        goto out;
    }
    cfg = (struct cohort_config){ .name = name, .parameters = params, .n_parameters = np,
                                  .buffers = bufs, .n_buffers = nb };
    rc = cohort_create(&cfg, &c);
    if (rc < 0) {
        raise_rc("cannot lay out the accumulator's tensors (one floating dtype for every "
                 "parameter, at least one element)", rc);
        goto out;
    }
    /* The exported region runs from the first parameter to the end of the
     * last tensor, whichever region that is in. */
    base = cohort_params(c);
    self->extent = 0;
    for (size_t i = 0; i < np; i++) {
        size_t bytes = params[i].numel * dtype_bytes(params[i].dtype);
        char *ends[] = { (char *)cohort_param(c, i), (char *)cohort_grad(c, i),
                         (char *)result_at(c, i) };
        for (size_t k = 0; k < sizeof(ends) / sizeof(ends[0]); k++)
            if ((size_t)(ends[k] - base) + bytes > self->extent)
                self->extent = (size_t)(ends[k] - base) + bytes;
    }
    for (size_t i = 0; i < nb; i++) {
        size_t end;
        self->buffer_bytes[i] = bufs[i].numel * dtype_bytes(bufs[i].dtype);
        end = (size_t)((char *)cohort_buffer(c, i) - base) + self->buffer_bytes[i];
        if (end > self->extent)
            self->extent = end;
    }
    self->c = c;
    self->n_params = np;
    self->n_buffers = nb;
    self->dtype = params[0].dtype;
    ret = 0;
out:
    PyMem_Free(params);
    PyMem_Free(bufs);
    return ret;
}

static void core_dealloc(struct core *self)
{
    /* No Region can be left: each holds a reference to this Core. */
    destroy_now(self);
    if (self->lock)
        PyThread_free_lock(self->lock);
    PyMem_Free(self->buffer_bytes);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* ---- actions ------------------------------------------------------------ */

static PyObject *core_connect(struct core *self, PyObject *args)
{
    const char *address = NULL;
    int rc;

    if (!PyArg_ParseTuple(args, "|z", &address) || check_open(self) < 0)
        return NULL;
    LOCKED(self, rc = cohort_connect(c, address));
    if (rc < 0)
        return raise_rc(address ? address : "connect ($COHORT_SOCKET or $COHORT_BROKER)", rc);
    Py_RETURN_NONE;
}

/* Tensor index `arg` of `n` (the core open): 0 with *out set, or -1 with
 * Python's error (IndexError naming `what`). */
static int index_arg(struct core *self, PyObject *arg, size_t n, const char *what, size_t *out)
{
    Py_ssize_t i = PyLong_AsSsize_t(arg);

    if ((i == -1 && PyErr_Occurred()) || check_open(self) < 0)
        return -1;
    if (i < 0 || (size_t)i >= n) {
        PyErr_Format(PyExc_IndexError, "%s index %zd out of range (%zu)", what, i, n);
        return -1;
    }
    *out = (size_t)i;
    return 0;
}

/* use_gpu(uuid): the gradients, parameters and buffers move to that GPU
 * (cohort_use_gpu), before connect. The errno says why not: EOPNOTSUPP (this build has no GPU
 * support), ELIBACC (no CUDA driver), ENXIO (no device with that UUID). */
static PyObject *core_use_gpu(struct core *self, PyObject *arg)
{
    const char *uuid;
    int rc;

    if (check_open(self) < 0)
        return NULL;
    uuid = PyUnicode_AsUTF8(arg);
    if (!uuid)
        return NULL;
    LOCKED(self, rc = cohort_use_gpu(c, uuid));
    if (rc < 0)
        return raise_rc(uuid, rc);
    Py_RETURN_NONE;
}

/* The gradients' device address (a CUdeviceptr) after use_gpu; 0 before. */
static PyObject *core_gpu_grads(struct core *self, PyObject *unused)
{
    if (check_open(self) < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong((unsigned long long)cohort_gpu_grads(self->c));
}

/* gpu_param(i), gpu_buffer(i): parameter i's and buffer i's device
 * addresses after use_gpu (cohort_gpu_param); 0 before. */
static PyObject *gpu_at(struct core *self, PyObject *arg, uint64_t (*at)(const struct cohort *, size_t),
                        size_t n, const char *what)
{
    size_t i;

    if (index_arg(self, arg, n, what, &i) < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong((unsigned long long)at(self->c, i));
}

static PyObject *core_gpu_param(struct core *self, PyObject *arg)
{
    return gpu_at(self, arg, cohort_gpu_param, self->n_params, "parameter");
}

static PyObject *core_gpu_buffer(struct core *self, PyObject *arg)
{
    return gpu_at(self, arg, cohort_gpu_buffer, self->n_buffers, "buffer");
}

static PyObject *core_set_identity(struct core *self, PyObject *args)
{
    const char *cohort_name, *id;
    int rc;

    if (!PyArg_ParseTuple(args, "ss", &cohort_name, &id) || check_open(self) < 0)
        return NULL;
    LOCKED(self, rc = cohort_set_identity(c, cohort_name, id));
    if (rc == -EINVAL) {
        PyErr_Format(PyExc_ValueError, "bad cohort name %R or member id %R: 1 to 253 of "
                     "[A-Za-z0-9._-], starting with a letter or digit", PyTuple_GET_ITEM(args, 0),
                     PyTuple_GET_ITEM(args, 1));
        return NULL;
    }
    if (rc < 0)
        return raise_rc("set_identity", rc);
    Py_RETURN_NONE;
}

static PyObject *core_update(struct core *self, PyObject *unused)
{
    int rc;

    if (check_open(self) < 0)
        return NULL;
    LOCKED(self, rc = cohort_update(c));
    if (rc < 0)
        return raise_rc("update", rc);
    Py_RETURN_NONE;
}

/* wait(timeout_ms) -> bool: True when the view may have changed. The
 * object's lock is held meanwhile, as for every call: close() from another
 * thread waits for it (timeouts are capped by the Python layer). */
static PyObject *core_wait(struct core *self, PyObject *arg)
{
    long ms = PyLong_AsLong(arg);
    int rc;

    if (ms == -1 && PyErr_Occurred())
        return NULL;
    if (ms < 0 || ms > 60000) {
        PyErr_Format(PyExc_ValueError, "timeout_ms must be between 0 and 60000, not %ld", ms);
        return NULL;
    }
    if (check_open(self) < 0)
        return NULL;
    LOCKED(self, rc = cohort_wait(c, (int)ms));
    if (rc == -ETIMEDOUT)
        Py_RETURN_FALSE;
    if (rc < 0)
        return raise_rc("wait", rc);
    Py_RETURN_TRUE;
}

/* Converts a Python int to a u64 in [min, max], or raises ValueError. */
static int to_u64(PyObject *o, const char *what, uint64_t min, uint64_t max, uint64_t *out)
{
    unsigned long long v;

    if (!PyLong_Check(o) || PyBool_Check(o)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int, not %.100s", what, Py_TYPE(o)->tp_name);
        return -1;
    }
    v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s must be between %llu and %llu, not %R", what,
                     (unsigned long long)min, (unsigned long long)max, o);
        return -1;
    }
    if (v < min || v > max) {
        PyErr_Format(PyExc_ValueError, "%s must be between %llu and %llu, not %R", what,
                     (unsigned long long)min, (unsigned long long)max, o);
        return -1;
    }
    *out = v;
    return 0;
}

/* reduce_gradients and skip_gradients return the errno instead of raising
 * for -EPERM and -EAGAIN: cohort/__init__.py tells a race with a new
 * epoch from misuse, which only it can. */
static PyObject *core_reduce_gradients(struct core *self, PyObject *arg)
{
    uint64_t batch;
    int rc;

    if (to_u64(arg, "batch_size", 1, UINT64_MAX, &batch) < 0 || check_open(self) < 0)
        return NULL;
    LOCKED(self, rc = cohort_reduce_gradients(c, batch));
    if (rc < 0 && rc != -EPERM && rc != -EAGAIN)
        return raise_rc("reduce_gradients", rc);
    return PyLong_FromLong(-rc);
}

static PyObject *core_skip_gradients(struct core *self, PyObject *unused)
{
    int rc;

    if (check_open(self) < 0)
        return NULL;
    LOCKED(self, rc = cohort_skip_gradients(c));
    if (rc < 0 && rc != -EPERM && rc != -EAGAIN)
        return raise_rc("skip_gradients", rc);
    return PyLong_FromLong(-rc);
}

static PyObject *core_zero_gradients(struct core *self, PyObject *unused)
{
    int rc;

    if (check_open(self) < 0)
        return NULL;
    LOCKED(self, rc = cohort_zero_gradients(c));
    if (rc < 0)
        return raise_rc("zero_gradients (there is no reduced result to consume; see has_gradients)", rc);
    Py_RETURN_NONE;
}

static PyObject *core_set_state(struct core *self, PyObject *arg)
{
    Py_buffer view;
    int rc;

    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    if (check_open(self) < 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    LOCKED(self, rc = cohort_set_state(c, view.buf, (size_t)view.len));
    PyBuffer_Release(&view);
    if (rc < 0)
        return raise_rc("set_state", rc);
    Py_RETURN_NONE;
}

static PyObject *core_state(struct core *self, PyObject *unused)
{
    const void *data = NULL;
    size_t len = 0;
    PyObject *out;
    int rc;

    if (check_open(self) < 0)
        return NULL;
    /* The bytes stay valid until the next cohort_state(), which needs the
     * lock: copy them while still holding it, with the GIL taken back.
     * Waiting for the GIL with the lock held cannot deadlock: no thread
     * ever waits for the lock while holding the GIL. */
    Py_BEGIN_ALLOW_THREADS
    PyThread_acquire_lock(self->lock, WAIT_LOCK);
    rc = self->c ? cohort_state(self->c, &data, &len) : GONE;
    Py_END_ALLOW_THREADS
    out = rc < 0 ? NULL : PyBytes_FromStringAndSize(data, (Py_ssize_t)len);
    PyThread_release_lock(self->lock);
    if (rc < 0)
        return raise_rc("state (no new state to take; see has_new_state)", rc);
    return out;
}

#define U64_SETTER(fn, what, min, max, call)                            \
    static PyObject *fn(struct core *self, PyObject *arg)              \
    {                                                                   \
        uint64_t v;                                                     \
        int rc;                                                         \
        if (to_u64(arg, what, min, max, &v) < 0 || check_open(self) < 0) \
            return NULL;                                                \
        LOCKED(self, rc = call);                                        \
        if (rc < 0)                                                     \
            return raise_rc(#fn + 5, rc);                               \
        Py_RETURN_NONE;                                                 \
    }

U64_SETTER(core_set_model_version, "model version", 0, UINT64_MAX, cohort_set_model_version(c, v))
U64_SETTER(core_set_virtual_batch_size, "virtual batch size", 1, UINT64_MAX,
           cohort_set_virtual_batch_size(c, v))
U64_SETTER(core_set_parallel_gradients, "parallel gradients", 1, UINT_MAX,
           cohort_set_parallel_gradients(c, (unsigned)v))
/* set_compression(method, param): a COHORT_COMPRESSION_* and its
 * parameter (top-k's ratio, PowerSGD's rank; 0: the default), which
 * accumulator.py parses from the text and checks first. */
static PyObject *core_set_compression(struct core *self, PyObject *args)
{
    unsigned method;
    double param;
    int rc;

    if (!PyArg_ParseTuple(args, "Id", &method, &param) || check_open(self) < 0)
        return NULL;
    if (method > COHORT_COMPRESSION_POWERSGD) {
        PyErr_Format(PyExc_ValueError, "compression method %u is not one of 0 to %d", method,
                     COHORT_COMPRESSION_POWERSGD);
        return NULL;
    }
    LOCKED(self, rc = cohort_set_compression_with(c, (enum cohort_compression)method, param));
    if (rc < 0)
        return raise_rc("set_compression", rc);
    Py_RETURN_NONE;
}

/* set_tensor_shapes([(offset, count, rows, cols), ...]): the gradient
 * buffer's tensors, which accumulator.py takes from the parameters. */
static PyObject *core_set_tensor_shapes(struct core *self, PyObject *arg)
{
    struct cohort_tensor_shape *v = NULL;
    PyObject *seq;
    Py_ssize_t n;
    int rc;

    if (check_open(self) < 0 || !(seq = PySequence_Fast(arg, "shapes must be a sequence")))
        return NULL;
    n = PySequence_Fast_GET_SIZE(seq);
    if (n > COHORT_TENSOR_SHAPES_MAX) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError, "%zd tensors: at most %d", n, COHORT_TENSOR_SHAPES_MAX);
        return NULL;
    }
    if (n && !(v = PyMem_Calloc((size_t)n, sizeof(*v)))) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long f[4];

        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "KKKK;a shape is (offset, count, rows, cols)",
                              &f[0], &f[1], &f[2], &f[3])) {
            PyMem_Free(v);
            Py_DECREF(seq);
            return NULL;
        }
        v[i] = (struct cohort_tensor_shape){ f[0], f[1], f[2], f[3] };
    }
    Py_DECREF(seq);
    LOCKED(self, rc = cohort_set_tensor_shapes(c, v, (size_t)n));
    PyMem_Free(v);
    if (rc < 0)
        return raise_rc("set_tensor_shapes", rc);
    Py_RETURN_NONE;
}

static PyObject *core_close(struct core *self, PyObject *unused)
{
    self->closed = 1;
    if (self->regions == 0)
        destroy_now(self);
    Py_RETURN_NONE;
}

/* ---- questions ---------------------------------------------------------- */

/* The view these read is written by update() and the actions, which run
 * with the GIL released; so each question takes the lock too. */
#define QUESTION(fn, type, type_conv, call)                             \
    static PyObject *fn(struct core *self, PyObject *unused)           \
    {                                                                   \
        type v = 0;                                                     \
        int rc = 0;                                                     \
        if (check_open(self) < 0)                                       \
            return NULL;                                                \
        LOCKED(self, v = call(c));                                      \
        if (rc < 0)                                                     \
            return raise_rc(#fn + 5, rc);                               \
        return type_conv(v);                                            \
    }

QUESTION(core_connected, long, PyBool_FromLong, cohort_connected)
QUESTION(core_wants_state, long, PyBool_FromLong, cohort_wants_state)
QUESTION(core_has_new_state, long, PyBool_FromLong, cohort_has_new_state)
QUESTION(core_wants_gradients, long, PyBool_FromLong, cohort_wants_gradients)
QUESTION(core_has_gradients, long, PyBool_FromLong, cohort_has_gradients)
QUESTION(core_is_leader, long, PyBool_FromLong, cohort_is_leader)
QUESTION(core_model_version, unsigned long long, PyLong_FromUnsignedLongLong, cohort_model_version)
QUESTION(core_rank, unsigned long, PyLong_FromUnsignedLong, cohort_rank)
QUESTION(core_size, unsigned long, PyLong_FromUnsignedLong, cohort_size)

static PyObject *core_get_leader(struct core *self, PyObject *unused)
{
    char leader[256];
    int rc = 0;

    if (check_open(self) < 0)
        return NULL;
    LOCKED(self, snprintf(leader, sizeof(leader), "%s", cohort_get_leader(c)));
    if (rc < 0)
        return raise_rc("get_leader", rc);
    return PyUnicode_FromString(leader);
}

/* Every answer of the view at once, consistent with each other. */
static PyObject *core_view(struct core *self, PyObject *unused)
{
    struct cohort_gradient_stats st;
    PyObject *out;
    char leader[256];
    int connected, ws, hns, wg, hg, il;
    unsigned long long mv;
    unsigned long rank, size;
    int rc = 0;

    if (check_open(self) < 0)
        return NULL;
    LOCKED(self, (connected = cohort_connected(c), ws = cohort_wants_state(c),
                  hns = cohort_has_new_state(c), wg = cohort_wants_gradients(c),
                  hg = cohort_has_gradients(c), il = cohort_is_leader(c),
                  mv = cohort_model_version(c), rank = cohort_rank(c), size = cohort_size(c),
                  snprintf(leader, sizeof(leader), "%s", cohort_get_leader(c)),
                  cohort_get_gradient_stats(c, &st)));
    if (rc < 0)
        return raise_rc("view", rc);
    out = Py_BuildValue(
        "{s:O,s:O,s:O,s:O,s:O,s:O,s:K,s:k,s:k,s:s,s:{s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K}}",
        "connected", connected ? Py_True : Py_False, "wants_state", ws ? Py_True : Py_False,
        "has_new_state", hns ? Py_True : Py_False, "wants_gradients", wg ? Py_True : Py_False,
        "has_gradients", hg ? Py_True : Py_False, "is_leader", il ? Py_True : Py_False,
        "model_version", mv, "rank", rank, "size", size, "leader", leader, "stats",
        "batch_size", (unsigned long long)st.batch_size,
        "num_gradients", (unsigned long long)st.num_gradients,
        "num_skipped", (unsigned long long)st.num_skipped,
        "rounds_committed", (unsigned long long)st.rounds_committed,
        "rounds_retried", (unsigned long long)st.rounds_retried,
        "epochs_seen", (unsigned long long)st.epochs_seen,
        "states_received", (unsigned long long)st.states_received,
        "contributions_dropped", (unsigned long long)st.contributions_dropped,
        "epoch", (unsigned long long)st.epoch);
    return out;
}

/* ---- layout ------------------------------------------------------------- */

static PyObject *offset_of(struct core *self, PyObject *arg, void *(*at)(struct cohort *, size_t),
                           size_t n, const char *what)
{
    size_t i;

    if (index_arg(self, arg, n, what, &i) < 0)
        return NULL;
    return PyLong_FromSize_t((size_t)((char *)at(self->c, i) - (char *)cohort_params(self->c)));
}

static PyObject *core_param_offset(struct core *self, PyObject *arg)
{
    return offset_of(self, arg, cohort_param, self->n_params, "parameter");
}

static PyObject *core_grad_offset(struct core *self, PyObject *arg)
{
    return offset_of(self, arg, cohort_grad, self->n_params, "parameter");
}

static PyObject *core_result_offset(struct core *self, PyObject *arg)
{
    return offset_of(self, arg, result_at, self->n_params, "parameter");
}

static PyObject *core_buffer_offset(struct core *self, PyObject *arg)
{
    return offset_of(self, arg, cohort_buffer, self->n_buffers, "buffer");
}

static PyObject *core_numel(struct core *self, PyObject *unused)
{
    if (check_open(self) < 0)
        return NULL;
    return PyLong_FromSize_t(cohort_numel(self->c));
}

/* The address of the region's first byte and its length, for checks that
 * a tensor lies inside it. */
static PyObject *core_span(struct core *self, PyObject *unused)
{
    if (check_open(self) < 0)
        return NULL;
    return Py_BuildValue("(Kn)", (unsigned long long)(uintptr_t)cohort_params(self->c),
                         (Py_ssize_t)self->extent);
}

static PyObject *core_region(struct core *self, PyObject *unused)
{
    struct region *r;

    if (check_open(self) < 0)
        return NULL;
    r = PyObject_New(struct region, &region_type);
    if (!r)
        return NULL;
    Py_INCREF(self);
    r->core = self;
    self->regions++;
    return (PyObject *)r;
}

static PyObject *core_get_closed(struct core *self, void *unused)
{
    return PyBool_FromLong(self->closed || !self->c);
}

static PyObject *core_get_released(struct core *self, void *unused)
{
    return PyBool_FromLong(!self->c);
}

static PyMethodDef core_methods[] = {
    { "connect", (PyCFunction)core_connect, METH_VARARGS,
      "connect(address=None): 'unix:PATH' (a sidecar), 'host:port' (a broker; the node runs "
      "in this process) or None ($COHORT_SOCKET, else $COHORT_BROKER)." },
    { "use_gpu", (PyCFunction)core_use_gpu, METH_O,
      "use_gpu(uuid): the gradients, parameters and buffers move to the GPU with that UUID "
      "('GPU-...'), before connect." },
    { "gpu_grads", (PyCFunction)core_gpu_grads, METH_NOARGS,
      "The gradients' device address after use_gpu (0 before)." },
    { "gpu_param", (PyCFunction)core_gpu_param, METH_O,
      "Parameter i's device address after use_gpu (0 before)." },
    { "gpu_buffer", (PyCFunction)core_gpu_buffer, METH_O,
      "Buffer i's device address after use_gpu (0 before)." },
    { "set_identity", (PyCFunction)core_set_identity, METH_VARARGS,
      "set_identity(cohort, member_id): names used when joining a broker directly." },
    { "update", (PyCFunction)core_update, METH_NOARGS, "Refreshes the view." },
    { "wait", (PyCFunction)core_wait, METH_O, "Sleeps until the view may have changed." },
    { "reduce_gradients", (PyCFunction)core_reduce_gradients, METH_O,
      "reduce_gradients(batch_size) -> 0, or EPERM/EAGAIN when not taken." },
    { "skip_gradients", (PyCFunction)core_skip_gradients, METH_NOARGS,
      "skip_gradients() -> 0, or EPERM/EAGAIN when not taken." },
    { "zero_gradients", (PyCFunction)core_zero_gradients, METH_NOARGS, NULL },
    { "set_state", (PyCFunction)core_set_state, METH_O, "set_state(bytes)" },
    { "state", (PyCFunction)core_state, METH_NOARGS, "state() -> bytes" },
    { "set_model_version", (PyCFunction)core_set_model_version, METH_O, NULL },
    { "set_virtual_batch_size", (PyCFunction)core_set_virtual_batch_size, METH_O, NULL },
    { "set_parallel_gradients", (PyCFunction)core_set_parallel_gradients, METH_O, NULL },
    { "set_compression", (PyCFunction)core_set_compression, METH_VARARGS,
      "set_compression(method, param)" },
    { "set_tensor_shapes", (PyCFunction)core_set_tensor_shapes, METH_O,
      "set_tensor_shapes([(offset, count, rows, cols), ...])" },
    { "connected", (PyCFunction)core_connected, METH_NOARGS, NULL },
    { "wants_state", (PyCFunction)core_wants_state, METH_NOARGS, NULL },
    { "has_new_state", (PyCFunction)core_has_new_state, METH_NOARGS, NULL },
    { "wants_gradients", (PyCFunction)core_wants_gradients, METH_NOARGS, NULL },
    { "has_gradients", (PyCFunction)core_has_gradients, METH_NOARGS, NULL },
    { "is_leader", (PyCFunction)core_is_leader, METH_NOARGS, NULL },
    { "model_version", (PyCFunction)core_model_version, METH_NOARGS, NULL },
    { "rank", (PyCFunction)core_rank, METH_NOARGS, NULL },
    { "size", (PyCFunction)core_size, METH_NOARGS, NULL },
    { "get_leader", (PyCFunction)core_get_leader, METH_NOARGS, NULL },
    { "view", (PyCFunction)core_view, METH_NOARGS,
      "Everything update() refreshed, as one dict, read under the lock." },
    { "param_offset", (PyCFunction)core_param_offset, METH_O, "Byte offset of parameter i." },
    { "grad_offset", (PyCFunction)core_grad_offset, METH_O, "Byte offset of gradient i." },
    { "result_offset", (PyCFunction)core_result_offset, METH_O,
      "Byte offset of parameter i's reduced gradient (equal to grad_offset when the engine "
      "reduces in place)." },
    { "buffer_offset", (PyCFunction)core_buffer_offset, METH_O, "Byte offset of buffer i." },
    { "numel", (PyCFunction)core_numel, METH_NOARGS, "Parameter elements in all." },
    { "span", (PyCFunction)core_span, METH_NOARGS, "(address, length) of the region." },
    { "region", (PyCFunction)core_region, METH_NOARGS,
      "A buffer object over the region; the memory stays mapped while it lives." },
    { "close", (PyCFunction)core_close, METH_NOARGS,
      "Refuses every call from now on; leaves the cohort once no Region is left." },
    { NULL, NULL, 0, NULL },
};

static PyGetSetDef core_getset[] = {
    { "closed", (getter)core_get_closed, NULL, "close() was called", NULL },
    { "released", (getter)core_get_released, NULL, "left the cohort and unmapped", NULL },
    { NULL, NULL, NULL, NULL, NULL },
};

static PyTypeObject core_type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cohort._cohort.Core",
    .tp_basicsize = sizeof(struct core),
    .tp_dealloc = (destructor)core_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Core(name, parameters, buffers): one cohort accumulator; parameters and buffers "
              "are sequences of (dtype code, numel).",
    .tp_methods = core_methods,
    .tp_getset = core_getset,
    .tp_init = (initproc)core_init,
    .tp_new = PyType_GenericNew,
};

/* ---- Region ------------------------------------------------------------- */

static int region_getbuffer(struct region *self, Py_buffer *view, int flags)
{
    struct core *core = self->core;

    /* Cannot happen while this Region lives (the Core waits for it), but
     * a buffer over unmapped memory must never be handed out. */
    if (!core->c) {
        PyErr_SetString(PyExc_BufferError, "the accumulator's memory is released");
        view->obj = NULL;
        return -1;
    }
    return PyBuffer_FillInfo(view, (PyObject *)self, cohort_params(core->c),
                             (Py_ssize_t)core->extent, 0, flags);
}

static PyBufferProcs region_as_buffer = {
    .bf_getbuffer = (getbufferproc)region_getbuffer,
};

static void region_dealloc(struct region *self)
{
    struct core *core = self->core;

    if (--core->regions == 0 && core->closed)
        destroy_now(core);
    Py_DECREF(core);
    PyObject_Free(self);
}

static PyTypeObject region_type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cohort._cohort.Region",
    .tp_basicsize = sizeof(struct region),
    .tp_dealloc = (destructor)region_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The accumulator's shared memory as a writable buffer (see Core.region).",
    .tp_as_buffer = &region_as_buffer,
};

/* ---- Group: collectives (cohort_group_*) ---------------------------------
 *
 * _cohort.Group(broker, cohort, id): one struct cohort_group, for
 * cohort.aggregation. Tensors cross as (address, count) pairs that the
 * Python layer takes from contiguous CPU tensors it holds for the call;
 * every call runs with the GIL released and under the Group's lock (a
 * group is used by one thread at a time). The group owns its top-k
 * reducers: Python names them by index, and they go before the group. */

/* What the Group needs of one kind of reducer with error feedback (top-k,
 * PowerSGD): both are named by index, reduce float32 in place and keep
 * what they left out between calls, so one table serves them. The kinds'
 * functions take their own types; each has wrappers taking void *. */
struct reducer_kind {
    const char *name;                   /* in errors: "top-k", "PowerSGD" */
    size_t (*floats)(const void *r);    /* what a reduce takes, and what it keeps */
    size_t (*shown)(const void *r);     /* the first of info(): top-k's k, PowerSGD's floats */
    const float *(*kept)(const void *r);        /* the error feedback, floats() of it */
    int (*reduce)(void *r, float *buf, enum cohort_group_op op, int timeout_ms);
    void (*destroy)(void *r);
};

/* One kind's reducers, in the order they were made; under the Group's
 * lock. */
struct reducers {
    void **r;
    size_t n;
};

struct pygroup {
    PyObject_HEAD
    struct cohort_group *g;             /* NULL once closed */
    PyThread_type_lock lock;
    struct reducers topk, power;
};

static PyObject *group_raise(const char *what, int rc)
{
    char msg[512];
    PyObject *args;

    snprintf(msg, sizeof(msg), "%s: %s", what, cohort_group_strerror(rc));
    args = Py_BuildValue("(is)", rc < 0 ? -rc : rc, msg);
    if (args) {
        PyErr_SetObject(cohort_error, args);
        Py_DECREF(args);
    }
    return NULL;
}

static int group_open(struct pygroup *self)
{
    if (!self->g) {
        PyErr_SetString(PyExc_ValueError, "the group is closed");
        return -1;
    }
    return 0;
}

static int pygroup_init(struct pygroup *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = { "broker", "cohort", "id", NULL };
    const char *broker = NULL, *cohort = NULL, *id = NULL;
    struct cohort_group *g = NULL;
    int rc;

    if (self->g || self->lock) {
        PyErr_SetString(PyExc_RuntimeError, "Group.__init__ may be called once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|zzz", kwlist, &broker, &cohort, &id))
        return -1;
    self->lock = PyThread_allocate_lock();
    if (!self->lock) {
        PyErr_NoMemory();
        return -1;
    }
    Py_BEGIN_ALLOW_THREADS
    rc = cohort_group_create(broker, cohort, id, &g);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        group_raise("cannot join the cohort (a broker address, $COHORT_BROKER, $COHORT_COHORT "
                    "and $COHORT_ID are needed)", rc);
        return -1;
    }
    self->g = g;
    return 0;
}

static size_t topk_floats(const void *r) { return cohort_group_topk_n(r); }
static size_t topk_shown(const void *r) { return cohort_group_topk_k(r); }
static const float *topk_kept(const void *r) { return cohort_group_topk_residual(r); }
static int topk_reduce(void *r, float *buf, enum cohort_group_op op, int timeout_ms)
{
    return cohort_group_topk_reduce(r, buf, op, timeout_ms);
}
static void topk_destroy(void *r) { cohort_group_topk_destroy(r); }

static const struct reducer_kind topk_kind = {
    .name = "top-k", .floats = topk_floats, .shown = topk_shown, .kept = topk_kept,
    .reduce = topk_reduce, .destroy = topk_destroy,
};

static size_t powersgd_floats(const void *r) { return cohort_group_powersgd_size(r); }
static const float *powersgd_kept(const void *r) { return cohort_group_powersgd_error(r); }
static int powersgd_reduce(void *r, float *buf, enum cohort_group_op op, int timeout_ms)
{
    return cohort_group_powersgd_reduce(r, buf, op, timeout_ms);
}
static void powersgd_destroy(void *r) { cohort_group_powersgd_destroy(r); }

static const struct reducer_kind powersgd_kind = {
    .name = "PowerSGD", .floats = powersgd_floats, .shown = powersgd_floats,
    .kept = powersgd_kept, .reduce = powersgd_reduce, .destroy = powersgd_destroy,
};

/* Destroys every reducer of the table and empties it. Under the lock. */
static void reducers_clear(struct reducers *t, const struct reducer_kind *kind)
{
    for (size_t i = 0; i < t->n; i++)
        kind->destroy(t->r[i]);
    free(t->r);
    t->r = NULL;
    t->n = 0;
}

static void pygroup_close_now(struct pygroup *self)
{
    struct cohort_group *g = self->g;

    if (!g)
        return;
    self->g = NULL;
    Py_BEGIN_ALLOW_THREADS
    PyThread_acquire_lock(self->lock, WAIT_LOCK);
    reducers_clear(&self->topk, &topk_kind);
    reducers_clear(&self->power, &powersgd_kind);
    cohort_group_destroy(g);
    PyThread_release_lock(self->lock);
    Py_END_ALLOW_THREADS
}

static void pygroup_dealloc(struct pygroup *self)
{
    pygroup_close_now(self);
    if (self->lock)
        PyThread_free_lock(self->lock);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *pygroup_close(struct pygroup *self, PyObject *unused)
{
    pygroup_close_now(self);
    Py_RETURN_NONE;
}

static PyObject *pygroup_wait(struct pygroup *self, PyObject *arg)
{
    long v = PyLong_AsLong(arg);
    int ms, rc;

    if (v == -1 && PyErr_Occurred())
        return NULL;
    if (group_open(self) < 0)
        return NULL;
    ms = v > INT_MAX ? INT_MAX : v < 0 ? 0 : (int)v;
    Py_BEGIN_ALLOW_THREADS
    rc = cohort_group_wait(self->g, ms);
    Py_END_ALLOW_THREADS
    if (rc == -ETIMEDOUT)
        Py_RETURN_FALSE;
    if (rc < 0)
        return group_raise("wait", rc);
    Py_RETURN_TRUE;
}

/* (rank, size) in the latest epoch, or None while not a member of it. */
static PyObject *pygroup_position(struct pygroup *self, PyObject *unused)
{
    uint32_t rank, size;

    if (group_open(self) < 0)
        return NULL;
    if (cohort_group_position(self->g, &rank, &size) < 0)
        Py_RETURN_NONE;
    return Py_BuildValue("(II)", rank, size);
}

static PyObject *pygroup_member_id(struct pygroup *self, PyObject *arg)
{
    char id[COHORT_GROUP_ID_BYTES];
    unsigned long rank;
    int rc;

    if (group_open(self) < 0)
        return NULL;
    rank = PyLong_AsUnsignedLong(arg);
    if (PyErr_Occurred())
        return NULL;
    if (rank > UINT32_MAX)
        return group_raise("member_id", -ERANGE);
    rc = cohort_group_member_id(self->g, (uint32_t)rank, id, sizeof(id));
    if (rc < 0)
        return group_raise("member_id", rc);
    return PyUnicode_FromString(id);
}

/* The bytes of one element of a group dtype; 0 for an unknown one (the
 * call then refuses it with EINVAL). */
static size_t group_dtype_size(int dtype)
{
    switch (dtype) {
    case COHORT_GROUP_F16: case COHORT_GROUP_BF16: return 2;
    case COHORT_GROUP_F32: case COHORT_GROUP_I32: return 4;
    case COHORT_GROUP_F64: case COHORT_GROUP_I64: return 8;
    default: return 0;
    }
}

/* A buffer's length against what a call will touch: the C side reads and
 * writes exactly `want` bytes, so any other length is refused before it
 * runs, never trusted. */
static int buffer_fits(const Py_buffer *b, size_t want, const char *what)
{
    if ((size_t)b->len == want)
        return 0;
    PyErr_Format(PyExc_ValueError, "%s: the buffer holds %zd bytes, the call needs %zu", what,
                 b->len, want);
    return -1;
}

/* allreduce(buffer, count, dtype, op, denominator, flags, timeout_ms):
 * count elements of dtype in a writable, C-contiguous buffer of exactly
 * that many bytes, in place. */
static PyObject *pygroup_allreduce(struct pygroup *self, PyObject *args)
{
    Py_buffer b;
    unsigned long long count;
    int dtype, op, timeout_ms;
    unsigned int flags;
    double denom;
    size_t esz;
    int rc;

    if (group_open(self) < 0)
        return NULL;
    if (!PyArg_ParseTuple(args, "w*KiidIi", &b, &count, &dtype, &op, &denom, &flags,
                          &timeout_ms))
        return NULL;
    esz = group_dtype_size(dtype);
    if (!esz || count > SIZE_MAX / esz) {
        PyBuffer_Release(&b);
        return group_raise("allreduce", -EINVAL);
    }
    if (buffer_fits(&b, (size_t)count * esz, "allreduce") < 0) {
        PyBuffer_Release(&b);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    PyThread_acquire_lock(self->lock, WAIT_LOCK);
    rc = cohort_group_allreduce(self->g, b.buf, (size_t)count, (enum cohort_group_dtype)dtype,
                                (enum cohort_group_op)op, denom, flags, timeout_ms);
    PyThread_release_lock(self->lock);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    if (rc < 0)
        return group_raise("all-reduce", rc);
    Py_RETURN_NONE;
}

/* allgather(buffer, timeout_ms) -> bytes: the records; the buffer (any
 * bytes-like object) is this member's contribution, read only. */
static PyObject *pygroup_allgather(struct pygroup *self, PyObject *args)
{
    Py_buffer b;
    const void *out = NULL;
    size_t len = 0;
    int timeout_ms, rc;
    PyObject *res = NULL;

    if (group_open(self) < 0)
        return NULL;
    if (!PyArg_ParseTuple(args, "y*i", &b, &timeout_ms))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    PyThread_acquire_lock(self->lock, WAIT_LOCK);
    rc = cohort_group_allgather(self->g, b.buf, (size_t)b.len, &out, &len, timeout_ms);
    PyThread_release_lock(self->lock);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    if (rc < 0)
        return group_raise("gather", rc);
    /* The records are valid until the next call; with the GIL held no
     * other call can start. */
    res = PyBytes_FromStringAndSize(out, (Py_ssize_t)len);
    return res;
}

/* Appends r (which the table then owns) and returns its index, the
 * Python name of it; without memory, destroys r. */
static PyObject *reducers_add(struct reducers *t, const struct reducer_kind *kind, void *r)
{
    void **more = realloc(t->r, (t->n + 1) * sizeof(*more));

    if (!more) {
        kind->destroy(r);
        return PyErr_NoMemory();
    }
    t->r = more;
    t->r[t->n] = r;
    return PyLong_FromSize_t(t->n++);
}

/* The reducer named `i`, borrowed; NULL with a ValueError when the group
 * is closed or has no such reducer. */
static void *reducers_find(struct pygroup *self, const struct reducers *t,
                           const struct reducer_kind *kind, unsigned long long i)
{
    if (group_open(self) < 0)
        return NULL;
    if (i >= t->n) {
        PyErr_Format(PyExc_ValueError, "no such %s reducer", kind->name);
        return NULL;
    }
    return t->r[i];
}

/* X_reduce(reducer, buffer, op, timeout_ms): the reducer's floats in a
 * writable buffer of exactly that many x 4 bytes, in place. */
static PyObject *reducers_reduce(struct pygroup *self, const struct reducers *t,
                                 const struct reducer_kind *kind, PyObject *args)
{
    unsigned long long i;
    Py_buffer b;
    void *r;
    int op, timeout_ms, rc;

    if (!PyArg_ParseTuple(args, "Kw*ii", &i, &b, &op, &timeout_ms))
        return NULL;
    r = reducers_find(self, t, kind, i);
    if (!r || buffer_fits(&b, kind->floats(r) * sizeof(float), kind->name) < 0) {
        PyBuffer_Release(&b);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    PyThread_acquire_lock(self->lock, WAIT_LOCK);
    rc = kind->reduce(r, b.buf, (enum cohort_group_op)op, timeout_ms);
    PyThread_release_lock(self->lock);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    if (rc < 0)
        return group_raise(kind->name, rc);
    Py_RETURN_NONE;
}

/* X_info(reducer) -> (shown, the error feedback as float32 bytes). */
static PyObject *reducers_info(struct pygroup *self, const struct reducers *t,
                               const struct reducer_kind *kind, PyObject *arg)
{
    unsigned long long i = PyLong_AsUnsignedLongLong(arg);
    void *r;

    if (PyErr_Occurred())
        return NULL;
    r = reducers_find(self, t, kind, i);
    if (!r)
        return NULL;
    return Py_BuildValue("(ny#)", (Py_ssize_t)kind->shown(r), (const char *)kind->kept(r),
                         (Py_ssize_t)(kind->floats(r) * sizeof(float)));
}

/* topk_create(n, ratio) -> int: a new top-k reducer of n float32 values;
 * n may be a sequence of segment sizes (a model's layers), each keeping
 * its own ceil(ratio x size) per call. */
static PyObject *pygroup_topk_create(struct pygroup *self, PyObject *args)
{
    PyObject *sizes_arg, *seq = NULL;
    double ratio;
    struct cohort_group_topk *t = NULL;
    size_t *sizes = NULL, n_sizes;
    int rc;

    if (group_open(self) < 0)
        return NULL;
    if (!PyArg_ParseTuple(args, "Od", &sizes_arg, &ratio))
        return NULL;
    if (PyLong_Check(sizes_arg)) {
        unsigned long long n = PyLong_AsUnsignedLongLong(sizes_arg);

        if (PyErr_Occurred())
            return NULL;
        if (n > SIZE_MAX)
            return group_raise("top-k", -EINVAL);
        rc = cohort_group_topk_create(self->g, (size_t)n, ratio, &t);
    } else {
        seq = PySequence_Fast(sizes_arg, "n must be an int or a sequence of segment sizes");
        if (!seq)
            return NULL;
        n_sizes = (size_t)PySequence_Fast_GET_SIZE(seq);
        if (n_sizes == 0 || n_sizes > UINT32_MAX) {
            Py_DECREF(seq);
            return group_raise("top-k", -EINVAL);
        }
        sizes = calloc(n_sizes, sizeof(*sizes));
        if (!sizes) {
            Py_DECREF(seq);
            return PyErr_NoMemory();
        }
        for (size_t i = 0; i < n_sizes; i++) {
            unsigned long long v = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(seq, i));

            if (PyErr_Occurred() || v > SIZE_MAX) {
                free(sizes);
                Py_DECREF(seq);
                return PyErr_Occurred() ? NULL : group_raise("top-k", -EINVAL);
            }
            sizes[i] = (size_t)v;
        }
        rc = cohort_group_topk_create_segments(self->g, sizes, n_sizes, ratio, &t);
        free(sizes);
        Py_DECREF(seq);
    }
    if (rc < 0)
        return group_raise("top-k", rc);
    return reducers_add(&self->topk, &topk_kind, t);
}

/* topk_reduce(reducer, buffer, op, timeout_ms): the reducer's n float32
 * in place. */
static PyObject *pygroup_topk_reduce(struct pygroup *self, PyObject *args)
{
    return reducers_reduce(self, &self->topk, &topk_kind, args);
}

/* topk_info(reducer) -> (k, residual bytes). */
static PyObject *pygroup_topk_info(struct pygroup *self, PyObject *arg)
{
    return reducers_info(self, &self->topk, &topk_kind, arg);
}

/* powersgd_create(shapes, vectors, rank, seed, reuse_query) -> int: a
 * PowerSGD reducer of the matrices [(rows, cols), ...] then `vectors`
 * floats. */
static PyObject *pygroup_powersgd_create(struct pygroup *self, PyObject *args)
{
    unsigned long long vectors, rank, seed;
    PyObject *shapes, *seq;
    int reuse, rc;
    struct cohort_group_matrix *mats = NULL;
    struct cohort_group_powersgd *p = NULL;
    size_t n;

    if (group_open(self) < 0)
        return NULL;
    if (!PyArg_ParseTuple(args, "OKKKp", &shapes, &vectors, &rank, &seed, &reuse))
        return NULL;
    seq = PySequence_Fast(shapes, "shapes must be a sequence of (rows, cols)");
    if (!seq)
        return NULL;
    n = (size_t)PySequence_Fast_GET_SIZE(seq);
    if (n) {
        mats = calloc(n, sizeof(*mats));
        if (!mats) {
            Py_DECREF(seq);
            return PyErr_NoMemory();
        }
    }
    for (size_t k = 0; k < n; k++) {
        unsigned long long r, c;

        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, k), "KK", &r, &c)) {
            free(mats);
            Py_DECREF(seq);
            return NULL;
        }
        mats[k].rows = (size_t)r;
        mats[k].cols = (size_t)c;
    }
    Py_DECREF(seq);
    rc = cohort_group_powersgd_create(self->g, mats, n, (size_t)vectors, (size_t)rank, seed,
                                      reuse != 0, &p);
    free(mats);
    if (rc < 0)
        return group_raise("PowerSGD", rc);
    return reducers_add(&self->power, &powersgd_kind, p);
}

/* powersgd_reduce(reducer, buffer, op, timeout_ms): the reducer's floats
 * in place. */
static PyObject *pygroup_powersgd_reduce(struct pygroup *self, PyObject *args)
{
    return reducers_reduce(self, &self->power, &powersgd_kind, args);
}

/* powersgd_info(reducer) -> (floats, error bytes). */
static PyObject *pygroup_powersgd_info(struct pygroup *self, PyObject *arg)
{
    return reducers_info(self, &self->power, &powersgd_kind, arg);
}

static PyObject *pygroup_stats(struct pygroup *self, PyObject *unused)
{
    struct cohort_group_stats st;

    if (group_open(self) < 0)
        return NULL;
    cohort_group_stats(self->g, &st);
    return Py_BuildValue("{sKsKsKsKsKsKsI}", "calls", (unsigned long long)st.calls, "retries",
                         (unsigned long long)st.retries, "delivered",
                         (unsigned long long)st.delivered, "lined_up",
                         (unsigned long long)st.lined_up, "epochs", (unsigned long long)st.epochs,
                         "epoch", (unsigned long long)st.epoch, "members", st.members);
}

static PyMethodDef pygroup_methods[] = {
    { "close", (PyCFunction)pygroup_close, METH_NOARGS, "Leaves the cohort." },
    { "wait", (PyCFunction)pygroup_wait, METH_O,
      "wait(timeout_ms) -> bool: whether the latest epoch lists this member." },
    { "position", (PyCFunction)pygroup_position, METH_NOARGS,
      "(rank, size) in the latest epoch, or None while not a member of it." },
    { "member_id", (PyCFunction)pygroup_member_id, METH_O,
      "member_id(rank) -> str: the id at that rank in the latest epoch." },
    { "allreduce", (PyCFunction)pygroup_allreduce, METH_VARARGS,
      "allreduce(buffer, count, dtype, op, denominator, flags, timeout_ms), in place." },
    { "allgather", (PyCFunction)pygroup_allgather, METH_VARARGS,
      "allgather(buffer, timeout_ms) -> bytes: one record per member." },
    { "topk_create", (PyCFunction)pygroup_topk_create, METH_VARARGS,
      "topk_create(n, ratio) -> int: a top-k reducer with error feedback, k = ceil(ratio n); "
      "n may be a sequence of segment sizes, each with its own k." },
    { "topk_reduce", (PyCFunction)pygroup_topk_reduce, METH_VARARGS,
      "topk_reduce(reducer, buffer, op, timeout_ms): its n float32, in place." },
    { "topk_info", (PyCFunction)pygroup_topk_info, METH_O,
      "topk_info(reducer) -> (k, residual as float32 bytes)." },
    { "powersgd_create", (PyCFunction)pygroup_powersgd_create, METH_VARARGS,
      "powersgd_create(shapes, vectors, rank, seed, reuse_query) -> int: a PowerSGD reducer." },
    { "powersgd_reduce", (PyCFunction)pygroup_powersgd_reduce, METH_VARARGS,
      "powersgd_reduce(reducer, buffer, op, timeout_ms): its float32, in place." },
    { "powersgd_info", (PyCFunction)pygroup_powersgd_info, METH_O,
      "powersgd_info(reducer) -> (floats, error as float32 bytes)." },
    { "stats", (PyCFunction)pygroup_stats, METH_NOARGS, "Counters, as a dict." },
    { NULL, NULL, 0, NULL },
};

static PyTypeObject pygroup_type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cohort._cohort.Group",
    .tp_basicsize = sizeof(struct pygroup),
    .tp_dealloc = (destructor)pygroup_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Group(broker=None, cohort=None, id=None): this process as a member of a cohort, "
              "for collectives (cohort.aggregation).",
    .tp_methods = pygroup_methods,
    .tp_init = (initproc)pygroup_init,
    .tp_new = PyType_GenericNew,
};

/* Adds Group and its constants to the module. */
static int pygroup_add(PyObject *m)
{
    if (PyType_Ready(&pygroup_type) < 0 ||
        PyModule_AddObjectRef(m, "Group", (PyObject *)&pygroup_type) < 0 ||
        PyModule_AddIntConstant(m, "G_F32", COHORT_GROUP_F32) < 0 ||
        PyModule_AddIntConstant(m, "G_F64", COHORT_GROUP_F64) < 0 ||
        PyModule_AddIntConstant(m, "G_F16", COHORT_GROUP_F16) < 0 ||
        PyModule_AddIntConstant(m, "G_BF16", COHORT_GROUP_BF16) < 0 ||
        PyModule_AddIntConstant(m, "G_I32", COHORT_GROUP_I32) < 0 ||
        PyModule_AddIntConstant(m, "G_I64", COHORT_GROUP_I64) < 0 ||
        PyModule_AddIntConstant(m, "OP_SUM", COHORT_GROUP_SUM) < 0 ||
        PyModule_AddIntConstant(m, "OP_AVG", COHORT_GROUP_AVG) < 0 ||
        PyModule_AddIntConstant(m, "OP_MIN", COHORT_GROUP_MIN) < 0 ||
        PyModule_AddIntConstant(m, "OP_MAX", COHORT_GROUP_MAX) < 0 ||
        PyModule_AddIntConstant(m, "OP_AVG_BY", COHORT_GROUP_AVG_BY) < 0 ||
        PyModule_AddIntConstant(m, "DIVIDE_BEFORE", COHORT_GROUP_DIVIDE_BEFORE) < 0 ||
        PyModule_AddIntConstant(m, "GROUP_ID_BYTES", COHORT_GROUP_ID_BYTES) < 0)
        return -1;
    return 0;
}

/* ---- Averager: hivemind's DecentralizedAverager (cohort_averager_*) -----
 *
 * _cohort.Averager(broker, cohort, id, prefix, bits, target, min,
 * min_matchmaking_ms, request_timeout_ms, allreduce_timeout_ms, count,
 * segment_bytes, schema, gather_max, leave_timeout_ms[, compression,
 * bandwidth, client_mode, min_vector_size, declare_state_period_ms,
 * codec_plan]): one struct cohort_averager, for cohort.hivemind
 * (compression: an enum cohort_compression value, 0 by default;
 * bandwidth: a float, or None when not given; client_mode: a bool;
 * codec_plan: None, or (count, compression) pairs, a codec per range of
 * the vector, with compression 0). The averaged floats cross as a
 * writable buffer of exactly count float32; every call runs with the GIL
 * released and under the Averager's lock. */

struct pyaverager {
    PyObject_HEAD
    struct cohort_averager *a;          /* NULL once closed */
    PyThread_type_lock lock;
    /* State calls in flight without the lock (they run beside a step),
     * counted under the GIL; close waits for them. */
    int state_busy;
};

static PyObject *averager_raise(struct pyaverager *self, const char *what, int rc)
{
    char msg[768];
    const char *detail = self->a ? cohort_averager_error(self->a) : "";
    PyObject *args;

    snprintf(msg, sizeof(msg), "%s: %s%s%s", what, cohort_group_strerror(rc),
             detail && *detail ? ": " : "", detail ? detail : "");
    args = Py_BuildValue("(is)", rc < 0 ? -rc : rc, msg);
    if (args) {
        PyErr_SetObject(cohort_error, args);
        Py_DECREF(args);
    }
    return NULL;
}

static int averager_open(struct pyaverager *self)
{
    if (!self->a) {
        PyErr_SetString(PyExc_ValueError, "the averager is shut down");
        return -1;
    }
    return 0;
}

/* codec_plan: a sequence of (count, compression) pairs, at most
 * COHORT_CODEC_PLAN_MAX, into plan[*n]; the averager checks the rest
 * (that the counts cover the vector, that each is a codec). */
static int averager_plan_arg(PyObject *obj, struct cohort_codec_range *plan, size_t *n)
{
    PyObject *seq = PySequence_Fast(obj, "codec_plan must be a sequence of (count, codec)");
    Py_ssize_t len;

    if (!seq)
        return -1;
    len = PySequence_Fast_GET_SIZE(seq);
    if (len > COHORT_CODEC_PLAN_MAX) {
        PyErr_Format(PyExc_ValueError, "a codec plan of %zd ranges: at most %d", len,
                     COHORT_CODEC_PLAN_MAX);
        Py_DECREF(seq);
        return -1;
    }
    for (Py_ssize_t k = 0; k < len; k++) {
        unsigned long long count;
        int codec;

        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, k), "Ki;codec_plan holds "
                              "(count, codec) pairs", &count, &codec)) {
            Py_DECREF(seq);
            return -1;
        }
        plan[k] = (struct cohort_codec_range){ .count = (size_t)count,
                                               .compression = (enum cohort_compression)codec };
    }
    *n = (size_t)len;
    Py_DECREF(seq);
    return 0;
}

static int pyaverager_init(struct pyaverager *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = { "broker", "cohort", "id", "prefix", "bits", "target", "min",
                              "min_matchmaking_ms", "request_timeout_ms",
                              "allreduce_timeout_ms", "count", "segment_bytes", "schema",
                              "gather_max", "leave_timeout_ms", "compression", "bandwidth",
                              "client_mode", "min_vector_size", "declare_state_period_ms",
                              "codec_plan", NULL };
    struct cohort_codec_range plan[COHORT_CODEC_PLAN_MAX];
    PyObject *plan_obj = Py_None;
    struct cohort_averager_config c = { 0 };
    PyObject *bandwidth = Py_None;
    int client_mode = 0;
    unsigned long long min_vector_size = 0;
    unsigned long long count = 0, segment = 0, gather_max = 0;
    int compression = COHORT_COMPRESSION_NONE;
    Py_buffer schema = { 0 };
    struct cohort_averager *a = NULL;
    char why[256] = "";
    int rc;

    if (self->a || self->lock) {
        PyErr_SetString(PyExc_RuntimeError, "Averager.__init__ may be called once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kw, "zzzssIIIIIKKy*KI|iOpKiO", kwlist, &c.broker,
                                     &c.cohort, &c.id, &c.prefix, &c.initial_bits,
                                     &c.target_group_size, &c.min_group_size,
                                     &c.min_matchmaking_ms, &c.request_timeout_ms,
                                     &c.allreduce_timeout_ms, &count, &segment, &schema,
                                     &gather_max, &c.leave_timeout_ms, &compression,
                                     &bandwidth, &client_mode, &min_vector_size,
                                     &c.declare_state_period_ms, &plan_obj))
        return -1;
    if (plan_obj != Py_None && averager_plan_arg(plan_obj, plan, &c.codec_plan_len) < 0) {
        PyBuffer_Release(&schema);
        return -1;
    }
    c.codec_plan = c.codec_plan_len ? plan : NULL;
    c.min_vector_size = (size_t)min_vector_size;
    if (bandwidth != Py_None) {
        c.has_bandwidth = true;
        c.bandwidth = PyFloat_AsDouble(bandwidth);
        if (c.bandwidth == -1.0 && PyErr_Occurred()) {
            PyBuffer_Release(&schema);
            return -1;
        }
    }
    c.client_mode = client_mode != 0;
    c.compression = (enum cohort_compression)compression;
    c.count = (size_t)count;
    c.segment_bytes = (size_t)segment;
    c.schema = schema.buf;
    c.schema_len = (size_t)schema.len;
    c.gather_max = (size_t)gather_max;
    self->lock = PyThread_allocate_lock();
    if (!self->lock) {
        PyBuffer_Release(&schema);
        PyErr_NoMemory();
        return -1;
    }
    Py_BEGIN_ALLOW_THREADS
    rc = cohort_averager_create_why(&c, &a, why, sizeof(why));
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&schema);
    if (rc < 0 && why[0]) {
        /* A refusal that says why itself: the sidecar's, or the environment's. */
        PyObject *e = Py_BuildValue("(is)", -rc, why);

        if (e) {
            PyErr_SetObject(cohort_error, e);
            Py_DECREF(e);
        }
        return -1;
    }
    if (rc < 0) {
        averager_raise(self, "cannot start the averager (check the broker address, cohort, "
                       "id, prefix, group bits and group sizes)", rc);
        return -1;
    }
    self->a = a;
    return 0;
}

static void pyaverager_close_now(struct pyaverager *self)
{
    struct cohort_averager *a = self->a;

    if (!a)
        return;
    self->a = NULL;
    /* Each state call is bounded by its own timeout. */
    while (self->state_busy > 0) {
        Py_BEGIN_ALLOW_THREADS
        usleep(1000);
        Py_END_ALLOW_THREADS
    }
    Py_BEGIN_ALLOW_THREADS
    PyThread_acquire_lock(self->lock, WAIT_LOCK);
    cohort_averager_destroy(a);
    PyThread_release_lock(self->lock);
    Py_END_ALLOW_THREADS
}

static void pyaverager_dealloc(struct pyaverager *self)
{
    pyaverager_close_now(self);
    if (self->lock)
        PyThread_free_lock(self->lock);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *pyaverager_close(struct pyaverager *self, PyObject *unused)
{
    pyaverager_close_now(self);
    Py_RETURN_NONE;
}

static PyObject *pyaverager_wait(struct pyaverager *self, PyObject *arg)
{
    long v = PyLong_AsLong(arg);
    int rc;

    if (v == -1 && PyErr_Occurred())
        return NULL;
    if (averager_open(self) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    rc = cohort_averager_wait(self->a, v > INT_MAX ? INT_MAX : v < 0 ? 0 : (int)v);
    Py_END_ALLOW_THREADS
    if (rc == -ETIMEDOUT)
        Py_RETURN_FALSE;
    if (rc < 0)
        return averager_raise(self, "wait", rc);
    Py_RETURN_TRUE;
}

/* step(buffer, weight, alpha, gather, timeout_ms, allow_retries) ->
 * (group, attempts, matchmaking_ms, [(id, weight, gathered bytes), ...]). */
static PyObject *pyaverager_step(struct pyaverager *self, PyObject *args)
{
    struct cohort_averager_step st = { 0 };
    struct cohort_averager_result *r = NULL;
    Py_buffer b, g;
    int retries, rc;
    unsigned long long scheduled = 0;
    PyObject *list = NULL, *out = NULL;

    if (averager_open(self) < 0)
        return NULL;
    if (!PyArg_ParseTuple(args, "w*ddy*ip|K", &b, &st.weight, &st.alpha, &g, &st.timeout_ms,
                          &retries, &scheduled))
        return NULL;
    st.scheduled_ms = (uint64_t)scheduled;
    if (b.len % 4 != 0) {
        PyBuffer_Release(&b);
        PyBuffer_Release(&g);
        PyErr_SetString(PyExc_ValueError, "step: the buffer must hold float32");
        return NULL;
    }
    st.data = b.buf;
    st.gather = g.buf;
    st.gather_len = (size_t)g.len;
    st.allow_retries = retries != 0;
    Py_BEGIN_ALLOW_THREADS
    PyThread_acquire_lock(self->lock, WAIT_LOCK);
    rc = cohort_averager_step(self->a, &st, &r);
    PyThread_release_lock(self->lock);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    PyBuffer_Release(&g);
    if (rc < 0)
        return averager_raise(self, "averaging step", rc);
    list = PyList_New((Py_ssize_t)cohort_averager_result_size(r));
    if (!list)
        goto out;
    for (size_t i = 0; i < cohort_averager_result_size(r); i++) {
        size_t len = 0;
        const void *p = cohort_averager_result_gathered(r, i, &len);
        PyObject *item = Py_BuildValue("(sdy#)", cohort_averager_result_id(r, i),
                                       cohort_averager_result_weight(r, i), (const char *)p,
                                       (Py_ssize_t)len);
        if (!item)
            goto out;
        PyList_SET_ITEM(list, (Py_ssize_t)i, item);
    }
    out = Py_BuildValue("(KIIO)", (unsigned long long)cohort_averager_result_group(r),
                        cohort_averager_result_attempts(r),
                        cohort_averager_result_matchmaking_ms(r), list);
out:
    Py_XDECREF(list);
    cohort_averager_result_free(r);
    return out;
}

static PyObject *pyaverager_bits(struct pyaverager *self, PyObject *unused)
{
    if (averager_open(self) < 0)
        return NULL;
    return PyUnicode_FromString(cohort_averager_bits(self->a));
}

static PyObject *pyaverager_id(struct pyaverager *self, PyObject *unused)
{
    if (averager_open(self) < 0)
        return NULL;
    return PyUnicode_FromString(cohort_averager_id(self->a));
}

static PyObject *pyaverager_set_bits(struct pyaverager *self, PyObject *arg)
{
    const char *bits = PyUnicode_AsUTF8(arg);
    int rc;

    if (!bits)
        return NULL;
    if (averager_open(self) < 0)
        return NULL;
    PyThread_acquire_lock(self->lock, WAIT_LOCK);
    rc = cohort_averager_set_bits(self->a, bits);
    PyThread_release_lock(self->lock);
    if (rc < 0) {
        PyErr_SetString(PyExc_ValueError, "group bits must be at most 64 characters of 0 and 1");
        return NULL;
    }
    Py_RETURN_NONE;
}

/* ---- the averager's state sharing (cohort_averager_*_state*) ---------- */

static long ms_arg(PyObject *arg)
{
    long v = PyLong_AsLong(arg);

    if (v == -1 && PyErr_Occurred())
        return -1;
    return v > INT_MAX ? INT_MAX : v < 0 ? 0 : v;
}

/* set_state_sharing(allow, priority) */
static PyObject *pyaverager_set_state_sharing(struct pyaverager *self, PyObject *args)
{
    struct cohort_averager *a = self->a;
    int allow, rc;
    double priority;

    if (!PyArg_ParseTuple(args, "pd", &allow, &priority))
        return NULL;
    if (averager_open(self) < 0)
        return NULL;
    /* Through a sidecar this is a call to it: other threads go on. */
    Py_BEGIN_ALLOW_THREADS
    rc = cohort_averager_set_state_sharing(a, allow != 0, priority);
    Py_END_ALLOW_THREADS
    if (rc == -EINVAL) {
        PyErr_SetString(PyExc_ValueError, "state_sharing_priority must be a finite number");
        return NULL;
    }
    if (rc < 0)
        return averager_raise(self, "state sharing", rc);
    Py_RETURN_NONE;
}

/* state_wanted(timeout_ms) -> bool */
static PyObject *pyaverager_state_wanted(struct pyaverager *self, PyObject *arg)
{
    long ms = ms_arg(arg);
    struct cohort_averager *a = self->a;
    bool wanted;

    if (ms < 0 && PyErr_Occurred())
        return NULL;
    if (averager_open(self) < 0)
        return NULL;
    self->state_busy++;
    Py_BEGIN_ALLOW_THREADS
    wanted = cohort_averager_state_wanted(a, (int)ms);
    Py_END_ALLOW_THREADS
    self->state_busy--;
    return PyBool_FromLong(wanted);
}

/* provide_state(bytes-like) */
static PyObject *pyaverager_provide_state(struct pyaverager *self, PyObject *arg)
{
    struct cohort_averager *a = self->a;
    Py_buffer b;
    int rc;

    if (averager_open(self) < 0)
        return NULL;
    if (PyObject_GetBuffer(arg, &b, PyBUF_SIMPLE) < 0)
        return NULL;
    self->state_busy++;
    Py_BEGIN_ALLOW_THREADS
    rc = cohort_averager_provide_state(a, b.buf, (size_t)b.len);
    Py_END_ALLOW_THREADS
    self->state_busy--;
    PyBuffer_Release(&b);
    if (rc < 0)
        return averager_raise(self, rc == -EFBIG ? "the state is larger than max_state_bytes"
                                                 : "cannot serve the state", rc);
    Py_RETURN_NONE;
}

/* load_state(timeout_ms) -> (bytes or None, sentence) */
static PyObject *pyaverager_load_state(struct pyaverager *self, PyObject *arg)
{
    long ms = ms_arg(arg);
    struct cohort_averager *a = self->a;
    void *blob = NULL;
    size_t len = 0;
    PyObject *out;
    int rc;

    if (ms < 0 && PyErr_Occurred())
        return NULL;
    if (averager_open(self) < 0)
        return NULL;
    self->state_busy++;
    Py_BEGIN_ALLOW_THREADS
    rc = cohort_averager_load_state(a, (int)ms, &blob, &len);
    Py_END_ALLOW_THREADS
    self->state_busy--;
    if (rc == -ENODATA || rc == -ETIMEDOUT)
        return Py_BuildValue("(Os)", Py_None, cohort_averager_load_error(a));
    if (rc < 0) {
        PyObject *args = Py_BuildValue("(is)", -rc, cohort_averager_load_error(a));

        if (args) {
            PyErr_SetObject(cohort_error, args);
            Py_DECREF(args);
        }
        return NULL;
    }
    out = Py_BuildValue("(y#s)", (const char *)blob, (Py_ssize_t)len, "");
    cohort_averager_state_free(blob);
    return out;
}

static PyObject *pyaverager_parts_served(struct pyaverager *self, PyObject *unused)
{
    if (averager_open(self) < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(cohort_averager_state_parts_served(self->a));
}

static PyMethodDef pyaverager_methods[] = {
    { "close", (PyCFunction)pyaverager_close, METH_NOARGS, "Leaves the cohort." },
    { "wait", (PyCFunction)pyaverager_wait, METH_O,
      "wait(timeout_ms) -> bool: whether the averager has joined the cohort." },
    { "step", (PyCFunction)pyaverager_step, METH_VARARGS,
      "step(buffer, weight, alpha, gather, timeout_ms, allow_retries[, scheduled_ms]) -> "
      "(group, attempts, matchmaking_ms, [(id, weight, gathered), ...])." },
    { "bits", (PyCFunction)pyaverager_bits, METH_NOARGS, "The group bits." },
    { "id", (PyCFunction)pyaverager_id, METH_NOARGS,
      "This averager's member id (through a sidecar, the one the sidecar gave it)." },
    { "set_bits", (PyCFunction)pyaverager_set_bits, METH_O, "set_bits(str)." },
    { "set_state_sharing", (PyCFunction)pyaverager_set_state_sharing, METH_VARARGS,
      "set_state_sharing(allow, priority)." },
    { "state_wanted", (PyCFunction)pyaverager_state_wanted, METH_O,
      "state_wanted(timeout_ms) -> bool: whether a downloader waits for a snapshot." },
    { "provide_state", (PyCFunction)pyaverager_provide_state, METH_O,
      "provide_state(bytes): the snapshot served from now on." },
    { "load_state", (PyCFunction)pyaverager_load_state, METH_O,
      "load_state(timeout_ms) -> (bytes or None, why)." },
    { "parts_served", (PyCFunction)pyaverager_parts_served, METH_NOARGS,
      "Parts of this averager's state served to others." },
    { NULL, NULL, 0, NULL },
};

static PyTypeObject pyaverager_type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cohort._cohort.Averager",
    .tp_basicsize = sizeof(struct pyaverager),
    .tp_dealloc = (destructor)pyaverager_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Averager(...): hivemind's DecentralizedAverager's C half (cohort.hivemind).",
    .tp_methods = pyaverager_methods,
    .tp_init = (initproc)pyaverager_init,
    .tp_new = PyType_GenericNew,
};

/* ---- module ------------------------------------------------------------- */

static PyObject *mod_strerror(PyObject *mod, PyObject *arg)
{
    long e = PyLong_AsLong(arg);

    if (e == -1 && PyErr_Occurred())
        return NULL;
    if (e > INT_MAX || e < -INT_MAX) {
        PyErr_SetString(PyExc_ValueError, "not an errno");
        return NULL;
    }
    return PyUnicode_FromString(cohort_strerror((int)e));
}

/* ---- the engine's codecs, for the averager's state ---------------------
 *
 * cohort.hivemind encodes a donor's floating-point state tensors with the
 * codecs the averaged tensors travel in, cut into runs as the engine cuts
 * a reduction into segments, so each run carries the codec's own error
 * bound. The codecs want 4-byte aligned buffers and an encoded run need
 * not end on a multiple of 4 (int8's scales, uniform8's codebook), so
 * every run passes through an aligned scratch buffer of one run. */

/* The codecs a state may use: every real codec but the identity, which
 * needs no encoding. */
static bool state_codec_ok(long c)
{
    return c > 0 && c < CODEC_END && codec_valid((int)c);
}

/* Bytes that n elements cut into runs of `run` take, or false when that
 * overflows a Py_ssize_t. */
static bool state_coded_bytes(enum codec c, size_t n, size_t run, size_t *out)
{
    size_t whole = n / run, rest = n % run, per = codec_bytes(c, run), total;

    if (per != 0 && whole > ((size_t)PY_SSIZE_T_MAX) / per)
        return false;
    total = whole * per;
    if (rest && total > (size_t)PY_SSIZE_T_MAX - codec_bytes(c, rest))
        return false;
    *out = total + (rest ? codec_bytes(c, rest) : 0);
    return true;
}

static int state_codec_args(long codec, long long run, long long n)
{
    if (!state_codec_ok(codec)) {
        PyErr_Format(PyExc_ValueError, "%ld is not a codec of the engine", codec);
        return -1;
    }
    if (run < 1 || (unsigned long long)run > (size_t)PY_SSIZE_T_MAX / sizeof(float)) {
        PyErr_SetString(PyExc_ValueError, "a run must hold at least one element");
        return -1;
    }
    if (n < 0 || (unsigned long long)n > (size_t)PY_SSIZE_T_MAX / sizeof(float)) {
        PyErr_SetString(PyExc_ValueError, "an element count out of range");
        return -1;
    }
    return 0;
}

/* codec_encode(codec, float32 bytes, run) -> bytes: the values cut into
 * runs of `run` elements, each encoded alone. */
static PyObject *mod_codec_encode(PyObject *mod, PyObject *args)
{
    long codec;
    long long run;
    Py_buffer b;
    PyObject *out = NULL;
    float *fin = NULL;
    void *scratch = NULL;
    size_t n, total, chunk;

    if (!PyArg_ParseTuple(args, "ly*L", &codec, &b, &run))
        return NULL;
    if (b.len % (Py_ssize_t)sizeof(float)) {
        PyErr_SetString(PyExc_ValueError, "the values are not whole float32s");
        goto out;
    }
    n = (size_t)b.len / sizeof(float);
    if (state_codec_args(codec, run, (long long)n) < 0)
        goto out;
    if (!state_coded_bytes((enum codec)codec, n, (size_t)run, &total)) {
        PyErr_SetString(PyExc_OverflowError, "the encoding is too large");
        goto out;
    }
    chunk = n < (size_t)run ? n : (size_t)run;
    out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)total);
    fin = PyMem_RawMalloc(chunk * sizeof(float) + 1);
    scratch = PyMem_RawMalloc(codec_bytes((enum codec)codec, chunk) + 1);
    if (!out || !fin || !scratch) {
        Py_CLEAR(out);
        if (!PyErr_Occurred())
            PyErr_NoMemory();
        goto out;
    }
    Py_BEGIN_ALLOW_THREADS
    unsigned char *dst = (unsigned char *)PyBytes_AS_STRING(out);
    const unsigned char *src = b.buf;
    for (size_t at = 0; at < n; at += chunk) {
        size_t k = n - at < chunk ? n - at : chunk, nb = codec_bytes((enum codec)codec, k);

        memcpy(fin, src + at * sizeof(float), k * sizeof(float));
        codec_encode((enum codec)codec, scratch, fin, k);
        memcpy(dst, scratch, nb);
        dst += nb;
    }
    Py_END_ALLOW_THREADS
out:
    PyMem_RawFree(fin);
    PyMem_RawFree(scratch);
    PyBuffer_Release(&b);
    return out;
}

/* codec_decode(codec, bytes, n, run) -> bytearray of n float32: what
 * codec_encode wrote for n values in runs of `run`. ValueError unless the
 * bytes are exactly that long, checked before anything is allocated, so
 * the output is bounded by the input (at most 4x, for 8-bit codecs). */
static PyObject *mod_codec_decode(PyObject *mod, PyObject *args)
{
    long codec;
    long long run, count;
    Py_buffer b;
    PyObject *out = NULL;
    float *fout = NULL;
    void *scratch = NULL;
    size_t n, total, chunk;

    if (!PyArg_ParseTuple(args, "ly*LL", &codec, &b, &count, &run))
        return NULL;
    if (state_codec_args(codec, run, count) < 0)
        goto out;
    n = (size_t)count;
    if (!state_coded_bytes((enum codec)codec, n, (size_t)run, &total) ||
        total != (size_t)b.len) {
        PyErr_Format(PyExc_ValueError, "%zd encoded bytes do not hold %lld values of %s in runs "
                     "of %lld", b.len, count, codec_name((enum codec)codec), run);
        goto out;
    }
    chunk = n < (size_t)run ? n : (size_t)run;
    out = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)(n * sizeof(float)));
    fout = PyMem_RawMalloc(chunk * sizeof(float) + 1);
    scratch = PyMem_RawMalloc(codec_bytes((enum codec)codec, chunk) + 1);
    if (!out || !fout || !scratch) {
        Py_CLEAR(out);
        if (!PyErr_Occurred())
            PyErr_NoMemory();
        goto out;
    }
    Py_BEGIN_ALLOW_THREADS
    unsigned char *dst = (unsigned char *)PyByteArray_AS_STRING(out);
    const unsigned char *src = b.buf;
    for (size_t at = 0; at < n; at += chunk) {
        size_t k = n - at < chunk ? n - at : chunk, nb = codec_bytes((enum codec)codec, k);

        memcpy(scratch, src, nb);
        codec_decode((enum codec)codec, fout, scratch, k);
        memcpy(dst + at * sizeof(float), fout, k * sizeof(float));
        src += nb;
    }
    Py_END_ALLOW_THREADS
out:
    PyMem_RawFree(fout);
    PyMem_RawFree(scratch);
    PyBuffer_Release(&b);
    return out;
}

static PyMethodDef mod_methods[] = {
    { "strerror", mod_strerror, METH_O, "strerror(errno): cohort_strerror's sentence." },
    { "codec_encode", mod_codec_encode, METH_VARARGS,
      "codec_encode(codec, float32 bytes, run) -> bytes: the engine's codec (engine/codec.h), "
      "each run of `run` values encoded alone." },
    { "codec_decode", mod_codec_decode, METH_VARARGS,
      "codec_decode(codec, bytes, n, run) -> bytearray of n float32; ValueError unless the "
      "bytes are exactly codec_encode's length for n values." },
    { NULL, NULL, 0, NULL },
};

static struct PyModuleDef mod_def = {
    PyModuleDef_HEAD_INIT, "cohort._cohort",
    "The C binding of cohort's trainer API (include/cohort.h); use the cohort package.",
    -1, mod_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__cohort(void);

PyMODINIT_FUNC PyInit__cohort(void)
{
    PyObject *m;

    if (PyType_Ready(&core_type) < 0 || PyType_Ready(&region_type) < 0)
        return NULL;
    m = PyModule_Create(&mod_def);
    if (!m)
        return NULL;
    cohort_error = PyErr_NewExceptionWithDoc(
        "cohort._cohort.Error", "A cohort call failed; errno and strerror say why.",
        PyExc_OSError, NULL);
    if (!cohort_error || PyModule_AddObjectRef(m, "Error", cohort_error) < 0 ||
        PyModule_AddObjectRef(m, "Core", (PyObject *)&core_type) < 0 ||
        PyModule_AddObjectRef(m, "Region", (PyObject *)&region_type) < 0 ||
        PyModule_AddIntConstant(m, "F32", COHORT_F32) < 0 ||
        PyModule_AddIntConstant(m, "F64", COHORT_F64) < 0 ||
        PyModule_AddIntConstant(m, "F16", COHORT_F16) < 0 ||
        PyModule_AddIntConstant(m, "BF16", COHORT_BF16) < 0 ||
        PyModule_AddIntConstant(m, "API_VERSION", COHORT_API_VERSION) < 0 || pygroup_add(m) < 0 ||
        PyType_Ready(&pyaverager_type) < 0 ||
        PyModule_AddObjectRef(m, "Averager", (PyObject *)&pyaverager_type) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

"""cohort.Accumulator: moolib's Accumulator over cohort's trainer API.

The parameters, their gradients and the buffers are moved into one block
of shared memory that cohort lays out (include/cohort.h) and the sidecar,
or the in-process node, maps too. Each parameter's data, its `.grad` and
each buffer become views of that block (torch.frombuffer over a
_cohort.Region), like DDP's gradient_as_bucket_view: backward() adds
into the block in place, reduce_gradients() hands it over without a copy,
and a state sync writes the leader's parameters and buffers straight into
the model.

A model on a CUDA device (docs/gpu.md) is registered on that device
instead: cohort allocates its gradients, parameters and buffers with the
driver's virtual-memory API (cohort_use_gpu), each parameter's data, its
`.grad` and each buffer become views of that device memory (torch.as_tensor
over __cuda_array_interface__), and the sidecar reduces the gradients
where they are. State transfer moves the host copies of the parameters
and buffers in the shared block: cohort copies the device's values there
when this member sends its state, and the leader's onto the device before
has_new_state() says they arrived (include/cohort.h, cohort_gpu_param).

Where the seed API leaves room, this module follows include/cohort.h:
- reduce_gradients(batch_size) contributes what `.grad` holds; the result
  is the sum of the contributions divided by their number (pass a
  per-batch mean loss). Gradients keep accumulating until a result is
  applied; zero_gradients() zeroes them.
- A call that fits the accumulator's state is never refused because of a
  race with a membership change: a contribution made just as the node
  stopped taking one is kept and handed over at the next update() that
  wants gradients (wants_gradients() says False meanwhile); one that the
  leader's committed rounds already hold is dropped, and the next
  update() zeroes the gradients.
- Real misuse (reduce_gradients without wants_gradients, zero_gradients
  without has_gradients, anything after close()) raises.
"""
import atexit
import ctypes
import errno
import os
import pickle
import re
import threading
import time
import uuid
import weakref

import torch

from . import _cohort

Error = _cohort.Error

_PARAM_DTYPES = {
    torch.float32: _cohort.F32,
    torch.float64: _cohort.F64,
    torch.float16: _cohort.F16,
    torch.bfloat16: _cohort.BF16,
}

# How often update() retries a connect() whose sidecar was not there yet.
_RETRY_S = 0.1

_live = weakref.WeakSet()
_live_lock = threading.Lock()


def _buffer_spec(t):
    """(dtype code, numel) that covers the bytes of buffer t. Buffers are
    not reduced, only copied from the leader bytewise, so a buffer of any
    dtype (BatchNorm's int64 num_batches_tracked, say) is registered as
    the float type of its element size."""
    if t.dtype in _PARAM_DTYPES:
        return _PARAM_DTYPES[t.dtype], t.numel()
    size = t.element_size()
    nbytes = t.numel() * size
    if size % 8 == 0:
        return _cohort.F64, nbytes // 8
    if size % 4 == 0:
        return _cohort.F32, nbytes // 4
    return _cohort.F16, (nbytes + 1) // 2


def _check_tensor(t, what, i):
    if not isinstance(t, torch.Tensor):
        raise TypeError("%s %d is a %s, not a torch.Tensor" % (what, i, type(t).__name__))
    if t.layout != torch.strided:
        raise ValueError("%s %d has layout %s; cohort holds dense (strided) tensors only"
                         % (what, i, t.layout))
    why = _device_refusal(t.device)
    if why:
        raise ValueError("%s %d %s" % (what, i, why))


def _device_refusal(device):
    """Why a tensor on `device` cannot be registered, as the end of a
    sentence; None for the CPU and for a CUDA device this process reaches
    (docs/gpu.md)."""
    if device.type == "cpu":
        return None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return ("is on %s, but CUDA is not available to this process "
                    "(torch.cuda.is_available() is False: no driver or no device)" % device)
        return None
    return "is on %s; cohort registers CPU and CUDA tensors only" % device


class _DeviceMemory:
    """cohort's device gradients as __cuda_array_interface__ bytes, for
    torch.as_tensor, which keeps this object as long as the tensor's
    storage lives. It holds the shared block's Region, and the Region its
    Core, whose cohort_destroy frees the device memory: so the memory
    outlives every tensor on it, as the host block does."""

    def __init__(self, address, nbytes, region):
        self._address = address
        self._nbytes = nbytes
        self._region = region

    @property
    def __cuda_array_interface__(self):
        # Version 2: no stream to synchronise with on import. cohort's
        # calls order the device work themselves (docs/gpu.md, "Ordering").
        return {"shape": (self._nbytes,), "typestr": "|u1", "data": (self._address, False),
                "strides": None, "version": 2}


class _Cuda:
    """What the Accumulator asks of CUDA, through torch. The tests of
    tests/python/test_py_gpu.py put a stand-in here that plays the device
    with the stand-in driver's host-mapped memory (tests/gpu/fake_cuda.c),
    which no torch without CUDA can wrap."""

    def device_of(self, t):
        """The CUDA device `t` is on, or None for host memory."""
        return t.device if t.device.type == "cuda" else None

    def uuid(self, device):
        """The device's UUID ("GPU-..."), which is how cohort names a
        device: CUDA_VISIBLE_DEVICES renumbers them in each container.
        Asked of the driver (not every torch has device UUIDs): torch's
        index is the driver's ordinal in this process, both counted after
        CUDA_VISIBLE_DEVICES."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise Error(errno.ELIBACC, "%s: no CUDA driver: %s" % (device, e)) from None
        get_uuid = getattr(lib, "cuDeviceGetUuid_v2", None) or lib.cuDeviceGetUuid
        dev, raw = ctypes.c_int(), (ctypes.c_ubyte * 16)()
        for what, rc in (("cuInit", lambda: lib.cuInit(0)),
                         ("cuDeviceGet", lambda: lib.cuDeviceGet(ctypes.byref(dev), index)),
                         ("cuDeviceGetUuid", lambda: get_uuid(raw, dev))):
            code = rc()
            if code:
                raise Error(errno.ENXIO, "%s: the driver's %s failed with CUresult %d"
                            % (device, what, code))
        h = bytes(raw).hex()
        return "GPU-%s-%s-%s-%s-%s" % (h[:8], h[8:12], h[12:16], h[16:20], h[20:])

    def tensor(self, address, nbytes, region, device):
        """A uint8 tensor over device memory at `address`."""
        return torch.as_tensor(_DeviceMemory(address, nbytes, region), device=device)

    def synchronize(self, device):
        torch.cuda.synchronize(device)


_cuda = _Cuda()

# Why a GPU registration failed, by errno (cohort_use_gpu in include/cohort.h).
_GPU_CAUSES = {
    errno.EOPNOTSUPP: "this build of cohort has no GPU support (cuda.h and nccl.h were not "
                      "found under CUDA_HOME when it was compiled)",
    errno.ELIBACC: "no usable CUDA driver (libcuda.so.1) could be loaded",
    errno.ENXIO: "cohort's driver sees no device with that UUID",
    errno.EINVAL: "torch gave a UUID cohort cannot read",
}


def _sanitize(name):
    """A cohort name or member id from any string: [A-Za-z0-9._-], starting
    with a letter or digit, at most 253 bytes."""
    s = re.sub(r"[^A-Za-z0-9._-]", "-", name).lstrip("._-")[:253]
    return s or "cohort"



_COMPRESSION_NAMES = {"none": 0, "fp16": 1, "bf16": 2, "int8": 3, "topk": 4, "powersgd": 5}


def _tensor_shapes(params):
    """The gradient buffer's tensors, for PowerSGD by tensor shape:
    (offset, count, rows, cols) per parameter, in elements, the parameters
    laid end to end; a matrix is shape[0] x the rest (as mlbench's
    PowerAggregation views it), a 1-D tensor or a scalar count x 1, which
    is reduced uncompressed."""
    shapes, at = [], 0
    for p in params:
        n = p.numel()
        if n:
            rows = p.shape[0] if p.dim() >= 2 else n
            shapes.append((at, n, rows, n // rows))
        at += n
    return shapes


def _parse_compression(text):
    """(method, param) from set_compression's text; param 0 is the
    method's default. The same rules as cohort-sidecar --compression."""
    if text is None:
        return 0, 0.0
    bad = ValueError("compression must be none, fp16, bf16, int8, topk:RATIO (0 < RATIO <= 1, "
                     "six decimals at most) or powersgd:RANK (1 to 1024), not %r" % (text,))
    if not isinstance(text, str):
        raise bad
    name, colon, arg = text.partition(":")
    if name not in _COMPRESSION_NAMES or (colon and name not in ("topk", "powersgd")):
        raise bad
    if not colon:
        return _COMPRESSION_NAMES[name], 0.0
    if name == "topk":
        whole, _, frac = arg.partition(".")
        if (not arg or whole not in ("", "0", "1") or len(frac) > 6 or not (whole or frac)
                or (frac and not frac.isdigit()) or (whole == "1" and frac.strip("0"))):
            raise bad
        millionths = int(whole or "0") * 1000000 + int((frac or "0").ljust(6, "0"))
        if millionths == 0:
            raise bad
        return 4, millionths / 1e6
    if not arg.isdigit() or not 1 <= int(arg) <= 1024:
        raise bad
    return 5, float(int(arg))

class Accumulator:
    """Accumulates and synchronizes gradients and state across the members
    of a cohort (moolib.Accumulator).

    Accumulator(name, parameters, buffers=None, group=None)

    name: the accumulator's name; parameters: e.g. model.parameters() (one
    floating dtype, all on the CPU or all on one CUDA device); buffers:
    e.g. model.buffers(), on the parameters' device, kept in step with
    the leader's; group: a cohort.Group, whose name becomes the cohort's
    name and whose Rpc's name becomes this member's id when joining a
    broker directly. A model on a CUDA device needs a sidecar
    (connect("unix:PATH")) built with GPU support (docs/gpu.md).
    """

    def __init__(self, name, parameters, buffers=None, group=None):
        if not isinstance(name, str) or not name:
            raise TypeError("name must be a non-empty str")
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        params = list(parameters)
        bufs = [] if buffers is None else ([buffers] if isinstance(buffers, torch.Tensor)
                                           else list(buffers))
        if not params:
            raise ValueError("an Accumulator needs at least one parameter")
        seen = set()
        for what, ts in (("parameter", params), ("buffer", bufs)):
            for i, t in enumerate(ts):
                _check_tensor(t, what, i)
                if t.device != params[0].device:
                    raise ValueError("%s %d is on %s but parameter 0 is on %s; cohort registers "
                                     "one device's tensors" % (what, i, t.device,
                                                              params[0].device))
                if id(t) in seen:
                    raise ValueError("%s %d is given twice" % (what, i))
                seen.add(id(t))
        dtype = params[0].dtype
        if dtype not in _PARAM_DTYPES:
            raise ValueError("parameters must be float32, float64, float16 or bfloat16, not %s"
                             % dtype)
        for i, p in enumerate(params):
            if p.dtype != dtype:
                raise ValueError("parameter %d is %s but parameter 0 is %s; cohort reduces one "
                                 "dtype" % (i, p.dtype, dtype))
        if sum(p.numel() for p in params) == 0:
            raise ValueError("the parameters have no elements")
        if group is not None and not isinstance(group, Group):
            raise TypeError("group must be a cohort.Group, not %s" % type(group).__name__)
        gpu = _cuda.device_of(params[0])

        self._name = name
        self._group = group
        self._core = _cohort.Core(name, [(_PARAM_DTYPES[dtype], p.numel()) for p in params],
                                  [_buffer_spec(b) for b in bufs])
        self._region = self._core.region()
        self._gpu = gpu
        self._params = params
        self._buffers = bufs
        self._pviews, self._gviews, self._rviews, self._bviews = [], [], [], []
        device_grads = self._use_gpu(dtype) if gpu is not None else None
        with torch.no_grad():
            for i, p in enumerate(params):
                if device_grads is None:
                    pv = self._view(self._core.param_offset(i), p.dtype, p.shape)
                else:
                    pv = self._device_view(self._core.gpu_param(i), p)
                if device_grads is None:
                    gv = self._view(self._core.grad_offset(i), p.dtype, p.shape)
                    roff = self._core.result_offset(i)
                    rv = gv if roff == self._core.grad_offset(i) else \
                        self._view(roff, p.dtype, p.shape)
                else:
                    # On the device the results land in place (cohort_use_gpu).
                    at = (self._core.grad_offset(i) - self._core.grad_offset(0)) // p.element_size()
                    gv = rv = device_grads[at:at + p.numel()].view(p.shape)
                pv.copy_(p.detach())
                if p.grad is not None:
                    gv.copy_(p.grad)
                p.data = pv
                p.grad = gv
                self._pviews.append(pv)
                self._gviews.append(gv)
                self._rviews.append(rv)
            for i, b in enumerate(bufs):
                if device_grads is None:
                    bv = self._view(self._core.buffer_offset(i), b.dtype, b.shape)
                else:
                    bv = self._device_view(self._core.gpu_buffer(i), b)
                bv.copy_(b.detach())
                b.data = bv
                self._bviews.append(bv)
        self._grads = device_grads if device_grads is not None else \
            self._view(self._core.grad_offset(0), dtype, (self._core.numel(),))
        self._shapes = _tensor_shapes(params)
        self._on_results = False    # .grad points at the round's result
        self._pending = None        # (batch_size or 0 for a skip, contributions_dropped)
        self._asked = False         # the last update() said wants_gradients
        self._state = None
        self._address = None        # a connect() to retry: the sidecar was not there yet
        self._attempted = False     # connect() was called
        self._linked = False        # connect() succeeded: there is a view to update
        self._retry_at = 0.0
        with _live_lock:
            _live.add(self)

    def _use_gpu(self, dtype):
        """Moves the gradients, parameters and buffers to the parameters'
        CUDA device (before connect) and returns the gradients there as one
        flat tensor of `dtype`."""
        uuid = None
        try:
            uuid = _cuda.uuid(self._gpu)
            self._core.use_gpu(uuid)
        except Error as e:
            self._core.close()
            if uuid is None:
                raise           # the driver's own sentence, from uuid()
            raise Error(e.errno, "the parameters are on %s (%s): %s (docs/gpu.md)"
                        % (self._gpu, uuid, _GPU_CAUSES.get(e.errno, e.strerror))) from None
        numel = self._core.numel()
        size = torch.empty((), dtype=dtype).element_size()
        return _cuda.tensor(self._core.gpu_grads(), numel * size, self._region,
                            self._gpu).view(dtype)

    def _device_view(self, address, t):
        """A tensor like t over cohort's device memory at `address`."""
        if t.numel() == 0:
            return t.detach()       # no bytes to share
        return _cuda.tensor(address, t.numel() * t.element_size(), self._region,
                            self._gpu).view(t.dtype).view(t.shape)

    def _view(self, offset, dtype, shape):
        n = 1
        for d in shape:
            n *= d
        if n == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(self._region, dtype=dtype, count=n, offset=offset).view(shape)

    def _c(self):
        core = self._core
        if core is None or core.closed:
            raise ValueError("the accumulator is closed")
        return core

    # ---- connection ------------------------------------------------------

    def connect(self, address=None):
        """Connects to a broker ("host:port": the node runs in this process)
        or a sidecar ("unix:PATH"); None takes $COHORT_SOCKET, else
        $COHORT_BROKER. Like moolib's, it does not wait: a sidecar that is
        not listening yet is retried by update()."""
        core = self._c()
        if address is not None and not isinstance(address, str):
            raise TypeError("address must be a str or None")
        target = address or os.environ.get("COHORT_SOCKET") or os.environ.get("COHORT_BROKER")
        if not target:
            raise ValueError("no address: pass one, or set COHORT_SOCKET (unix:PATH) or "
                             "COHORT_BROKER (host:port)")
        if not (target.startswith("unix:") or target.startswith("/")):
            if self._gpu is not None:
                raise Error(errno.EOPNOTSUPP,
                            "connect(%r): the parameters are on %s, whose gradients only a "
                            "sidecar (unix:PATH) reduces; the node in this process stages no "
                            "device memory (docs/gpu.md)" % (target, self._gpu))
            core.set_identity(*self._identity())
        self._address = None
        self._attempted = True
        try:
            core.connect(target)
        except Error as e:
            if e.errno not in (errno.ECONNREFUSED, errno.ENOENT):
                raise
            self._address = target
            self._retry_at = time.monotonic() + _RETRY_S
            return
        self._linked = True
        # PowerSGD by tensor shape: every connection learns the layout.
        core.set_tensor_shapes(self._shapes)

    def _identity(self):
        """(cohort, member id) for joining a broker: the Group's name and its
        Rpc's name when given, else $COHORT_COHORT and $COHORT_ID, else the
        accumulator's name and a fresh unique id (as moolib's Rpc names
        itself)."""
        g = self._group
        cohort = (g.name() if g is not None else None) or os.environ.get("COHORT_COHORT") or self._name
        rpc = g._rpc if g is not None else None
        member = (rpc.get_name() if rpc is not None and rpc._named else None) or \
            os.environ.get("COHORT_ID") or "%s-%d-%s" % (os.uname().nodename, os.getpid(),
                                                        uuid.uuid4().hex[:8])
        return _sanitize(cohort), _sanitize(member)

    def connected(self):
        """True once this member is in a cohort and ready to train."""
        return self._c().connected()

    def update(self):
        """Refreshes everything the questions answer; call it once per loop.
        Raises Error (ENOTCONN) when the sidecar is gone."""
        core = self._c()
        if self._address is not None:
            if time.monotonic() >= self._retry_at:
                self.connect(self._address)
        elif not self._attempted and self._group is not None and self._group._rpc._address:
            # moolib connects the Rpc, not the Accumulator.
            self.connect(self._group._rpc._address)
        self._check_moved()
        if not self._linked:
            return              # nothing to ask yet: every question answers False
        core.update()
        if core.has_gradients():
            self._point_at_results()
        self._asked = False
        if self._pending is not None:
            batch, dropped = self._pending
            if self._dropped() != dropped:
                # Behind the leader, whose rounds hold this member's pending
                # contributions: the node dropped them and zeroed the
                # gradients, this one's too. Otherwise it is still owed
                # (a state transfer keeps what no round holds).
                self._pending = None
            elif core.wants_gradients():
                rc = core.reduce_gradients(batch) if batch else core.skip_gradients()
                if rc != errno.EPERM:
                    self._pending = None
        self._asked = self._pending is None and core.wants_gradients()

    def wait(self, timeout=0.1):
        """Not in moolib: sleeps until update() may have something new (a
        result, a state request, a new epoch) or `timeout` seconds pass, and
        says whether it woke for a change. A loop with nothing to do calls
        it instead of sleeping: it wakes within microseconds of the change
        and leaves the cores to the reduction meanwhile."""
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or \
                not 0 <= timeout <= 60:
            raise ValueError("timeout must be a number of seconds from 0 to 60, not %r"
                             % (timeout,))
        core = self._c()
        if not self._linked:
            time.sleep(min(timeout, 0.05))
            return False
        return core.wait(int(timeout * 1000))

    # ---- state -------------------------------------------------------------

    def wants_state(self):
        """True on the leader when a member needs its state: call set_state."""
        return self._c().wants_state()

    def set_state(self, state):
        """Sends `state` (any picklable object: optimizer state_dict,
        counters) with the parameters and buffers to the members that need
        them. Only the leader is asked (wants_state); a call that is no
        longer wanted by the time it is made is ignored."""
        core = self._c()
        wanted = core.wants_state()
        try:
            data = pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            raise TypeError("set_state: the state must be picklable: %s" % e) from e
        try:
            core.set_state(data)
        except Error as e:
            if e.errno != errno.EPERM or not wanted:
                raise
        self._state = state

    def has_new_state(self):
        """True when the leader's state has arrived: the parameters and
        buffers already hold the leader's values; state() returns its
        object."""
        return self._c().has_new_state()

    def state(self):
        """The state received from the leader (set_state's object), or the
        last one set or received when nothing new came."""
        core = self._c()
        if core.has_new_state():
            data = core.state()
            self._state = pickle.loads(data)
        return self._state

    # ---- gradients ---------------------------------------------------------

    def wants_gradients(self):
        """True when this member should call reduce_gradients or
        skip_gradients."""
        return self._asked and self._pending is None and self._c().wants_gradients()

    def _contribute(self, batch, what):
        core = self._c()
        if not core.connected():
            raise Error(errno.ENOTCONN, "%s: not connected to a cohort (see connected())" % what)
        asked = self._asked
        if batch:
            self._gather_grads()
            rc = core.reduce_gradients(batch)
        else:
            rc = core.skip_gradients()
        self._asked = False
        if rc == errno.EPERM:
            if not asked:
                raise Error(errno.EPERM, "%s: %s" % (what, _cohort.strerror(-errno.EPERM)))
            # Asked by the last update(), refused now: the view moved under
            # us. Kept for the next update() that wants gradients.
            self._pending = (batch, self._dropped())
        # EAGAIN: a state transfer is under way; the next update() zeroes
        # the gradients: compute again.

    def reduce_gradients(self, batch_size):
        """Contributes the gradients in the parameters' .grad (which live in
        cohort's shared memory: nothing is copied) for `batch_size`
        samples. Call it when wants_gradients() is True."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int):
            raise TypeError("batch_size must be an int, not %s" % type(batch_size).__name__)
        if batch_size <= 0:
            raise ValueError("batch_size must be positive, not %d (use skip_gradients to "
                             "contribute nothing)" % batch_size)
        self._contribute(batch_size, "reduce_gradients")

    def skip_gradients(self):
        """Takes part in this round without contributing."""
        self._contribute(0, "skip_gradients")

    def has_gradients(self):
        """True when a round has committed: .grad holds the reduced result
        (and model_version() is already one higher). Apply it (opt.step())
        and call zero_gradients()."""
        got = self._c().has_gradients()
        if got:
            self._point_at_results()
        return got

    def zero_gradients(self):
        """After applying a result: zeroes the gradients and lets the next
        round start."""
        self._c().zero_gradients()
        self._on_results = False
        self._gather_grads(reset=True)

    def _point_at_results(self):
        """While a result is held, each .grad is a view of its part of the
        result: cohort's engine reduces out of place (the gradients stay
        intact for a retry), and moolib's users read the result in .grad."""
        if self._on_results:
            return
        self._on_results = True
        for p, r in zip(self._params, self._rviews):
            p.grad = r

    def _gather_grads(self, reset=False):
        """Puts every .grad back on its view of the shared gradients. A
        .grad that autograd or the user replaced (optimizer.zero_grad
        with set_to_none, a `p.grad = ...`) is copied in once; None counts
        as zero."""
        with torch.no_grad():
            for p, g in zip(self._params, self._gviews):
                cur = p.grad
                if cur is g:
                    continue
                if cur is None:
                    if not reset:
                        g.zero_()
                elif cur.data_ptr() != g.data_ptr() or cur.shape != g.shape or \
                        cur.stride() != g.stride():
                    if not reset:
                        g.copy_(cur)
                p.grad = g

    def _check_moved(self):
        """Puts back on the shared memory (or cohort's device memory) a
        parameter or buffer whose data the user replaced (p.data = ...,
        load into a new tensor), so that state syncs keep landing in the
        model."""
        with torch.no_grad():
            for what, ts, views in (("parameter", self._params, self._pviews),
                                    ("buffer", self._buffers, self._bviews)):
                for i, (t, v) in enumerate(zip(ts, views)):
                    if t.data_ptr() == v.data_ptr() or v.numel() == 0:
                        continue
                    self._check_kept(what, i, t, v)
                    v.copy_(t.detach())
                    t.data = v

    def _check_kept(self, what, i, t, v):
        """Raises ValueError when the model's tensor t changed dtype, shape
        or device since it was registered as v."""
        device = v.device if self._gpu is None else self._gpu
        on = t.device if self._gpu is None else _cuda.device_of(t)
        if t.dtype != v.dtype or t.shape != v.shape or on != device:
            raise ValueError("%s %d changed to %s %s on %s after the Accumulator was created; "
                             "cohort keeps it as %s %s on %s" % (what, i, t.dtype, tuple(t.shape),
                                                                 t.device, v.dtype, tuple(v.shape),
                                                                 device))

    # ---- versions and settings -------------------------------------------

    def model_version(self):
        """Committed rounds: one higher as soon as has_gradients() is True."""
        return self._c().model_version()

    def set_model_version(self, n):
        """Declares a model version (after loading a checkpoint); it counts
        at the next leader election."""
        self._c().set_model_version(n)

    def set_virtual_batch_size(self, n):
        """A round commits once the cohort's contributions since the last
        commit add up to at least n samples. Raises cohort.Error (EACCES)
        when the cohort pins another size (its TrainingCohort's
        spec.accumulator.virtualBatchSize); that size stays in force."""
        self._c().set_virtual_batch_size(n)

    def set_parallel_gradients(self, n):
        """Rounds in flight at once. Raises cohort.Error (EACCES) when the
        cohort pins another count (spec.accumulator.parallelGradients)."""
        self._c().set_parallel_gradients(n)

    def set_compression(self, codec):
        """How this member's gradient steps travel between members from the
        next round on: "none" (or None, the default), "fp16", "bf16" (half
        the bytes), "int8" (8 bits per value and a float32 scale per
        block of 256: about a quarter), "topk:RATIO" or "powersgd:RANK".

        "topk:RATIO" (RATIO in (0, 1], six decimals at most; "topk" is
        topk:0.01): each member sends only that share of its gradient's
        entries, those of largest magnitude, and keeps the rest in its
        residual, added to its next round (error feedback).
        "powersgd:RANK" (1 to 1024; "powersgd" is powersgd:4): the
        gradients of all parameters, in order, viewed as one matrix of
        floor(sqrt(n)) rows, are reduced as a rank-RANK product (PowerSGD),
        with error feedback; the elements left over reduce uncompressed.
        The residual (error) changes only when a round commits, starts at
        zero on a member that joins or receives the leader's state, and
        leaves with a member that leaves. Members must agree on the
        parameter as well as the method.

        For the codecs: members accumulate in float32 and
        every member gets the same bytes; only what crosses the network is
        encoded, once per hop, so with n members a result carries up to n
        encodings' error (fp16: relative 2^-11 each; bf16: 2^-8; int8: half
        of max|block| / 127) and is itself a value of the codec.

        A round is compressed only when every member asks for the same
        codec; members that differ run it uncompressed and log it once.
        Only float32 parameters with more than 256 KiB of gradients are
        compressed (smaller ones reduce in one exact step with the round's
        counters). A sidecar's --compression (a TrainingCohort's
        spec.reduction.compression) is the default this replaces. Raises
        ValueError for another name, cohort.Error when not connected."""
        method, param = _parse_compression(codec)
        self._c().set_compression(method, param)

    def set_tensor_shapes(self, shapes=None):
        """The layout PowerSGD ("powersgd:RANK") reduces by: None (the
        default) takes the parameters' own shapes, each weight a matrix of
        shape[0] x the rest on its own (as the PowerSGD paper and mlbench's
        PowerAggregation do) and each 1-D parameter uncompressed; [] views
        the whole gradient buffer as one matrix; or a list of (offset,
        count, rows, cols) in elements of the gradient buffer (the
        parameters end to end, in order). Members must give the same
        matrices, or their rounds run uncompressed (each logs it once).
        Kept across reconnections; takes effect from the next round, and
        starts the error and the warm start from zero. Raises cohort.Error
        (EINVAL) for tensors that overlap, lie beyond the gradients, or
        whose count is not rows x cols, and ValueError for more than
        65,536 of them: nothing changes then."""
        core = self._c()
        shapes = _tensor_shapes(self._params) if shapes is None else \
            [tuple(int(v) for v in s) for s in shapes]
        try:
            core.set_tensor_shapes(shapes)
        except Error as e:
            # Checked before the link is asked: a layout refused only for
            # want of a connection goes with the next connect().
            if e.errno != errno.ENOTCONN or self._linked:
                raise
        self._shapes = shapes

    def _dropped(self):
        return self._c().view()["stats"]["contributions_dropped"]

    def get_gradient_stats(self):
        """Statistics of the last committed round (batch_size,
        num_gradients, num_skipped) and of the run (rounds_committed,
        rounds_retried, epochs_seen, states_received,
        contributions_dropped, epoch)."""
        return self._c().view()["stats"]

    def get_leader(self):
        """The leader's member id, or "" when none is known."""
        return self._c().get_leader()

    def is_leader(self):
        return self._c().is_leader()

    # cohort's own, for sharding data: both change with membership.
    def rank(self):
        """This member's position in the cohort's member order."""
        return self._c().rank()

    def size(self):
        """Members in the cohort."""
        return self._c().size()

    # ---- memory ---------------------------------------------------------------

    def gradients(self):
        """All gradients as one flat tensor: the shared memory the .grad
        tensors are views of (device memory for a model on a GPU)."""
        self._c()
        return self._grads

    def memory_span(self):
        """(address, length) of the shared memory that holds the
        parameters, gradients and buffers (for a model on a GPU: the host
        copies of its parameters and buffers, and the sidecar's staging of
        the gradients)."""
        return self._c().span()

    # ---- lifetime --------------------------------------------------------------

    def close(self):
        """Leaves the cohort. The model's parameters, gradients and buffers
        keep their values, moved to private memory. Every other method
        raises afterwards. Views of the shared memory that the caller
        still holds keep it mapped, and the leave waits for them."""
        core = self._core
        if core is None or core.closed:
            return
        with torch.no_grad():
            if self._gpu is not None:
                # The device memory goes with the last view (cohort_destroy
                # frees it), and a tensor's deleter does not wait for the
                # stream: the user's work on the gradients finishes first,
                # and the clones below before the views are dropped.
                _cuda.synchronize(self._gpu)
            for p, pv, gv, rv in zip(self._params, self._pviews, self._gviews, self._rviews):
                if p.data_ptr() == pv.data_ptr() and pv.numel():
                    p.data = pv.clone()
                if p.grad is not None and p.grad.numel() and \
                        p.grad.data_ptr() in (gv.data_ptr(), rv.data_ptr()):
                    p.grad = p.grad.clone()
            for b, bv in zip(self._buffers, self._bviews):
                if b.data_ptr() == bv.data_ptr() and bv.numel():
                    b.data = bv.clone()
            if self._gpu is not None:
                _cuda.synchronize(self._gpu)
        self._pviews = self._gviews = self._rviews = self._bviews = []
        self._grads = None
        self._region = None
        core.close()
        with _live_lock:
            _live.discard(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self):
        core = self._core
        if core is None or core.closed:
            return "<cohort.Accumulator %r closed>" % self._name
        return "<cohort.Accumulator %r connected=%s model_version=%d>" % (
            self._name, core.connected(), core.model_version())


@atexit.register
def _close_all():
    """Members leave their cohort at exit instead of waiting to be evicted."""
    with _live_lock:
        accs = list(_live)
    for a in accs:
        try:
            a.close()
        except Exception:
            pass


from .group import Group  # noqa: E402,F401  (isinstance check in __init__)

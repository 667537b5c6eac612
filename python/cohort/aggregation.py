"""cohort.aggregation: mlbench's Aggregation API on cohort's collectives.

    import cohort.aggregation as agg
    agg.init()                         # $COHORT_BROKER, or agg.init("host:port")
    a = agg.AllReduceAggregation(agg.world_size())
    a.agg_grad(by_layer=False)(model, "avg")

Every member calls the same aggregations in the same order, as with
torch.distributed. The collectives run on cohort's group (include/cohort.h,
cohort_group_*): an aggregation that a membership change interrupts is
retried on the new membership from a copy of its input, so it is applied
whole or not at all, and every member that completes it gets the same
bytes. world_size() and rank() follow the membership.

Tensors: CPU float32, float64, float16, bfloat16, int32 and int64 (CUDA
tensors with use_cuda=True, staged through host memory). by_model packs
every tensor of one dtype into one buffer: one collective per dtype.
AllReduceAggregation and DecentralizedAggregation aggregate by_layer the
same way (their operators are elementwise, so the result is the same), and
SparsifiedAggregation and PowerAggregation aggregate by_layer in one call
too, each layer compressed on its own: one collective cannot be cut by a
member joining between two layers. Only the base class, for subclasses
with an _agg of their own, runs one collective per tensor by_layer. Results are written back
into the model's own tensors (in place), so an optimizer's references
stay valid.

Ops: "avg" (mlbench's "avg_world"): the sum divided by the members of the
epoch that completed the call; "sum", "min", "max"; "custom_avg" (mlbench's
"avg_custom") with `denom`: the sum divided by denom. SparsifiedAggregation
(top-k) and PowerAggregation (PowerSGD) compress, with error feedback kept
on each member and committed only when a call completes. docs/python.md has
the rest.
"""
import errno
import hashlib
import warnings

import torch

from . import _cohort
from ._cohort import Error

__all__ = ["init", "shutdown", "is_initialized", "world_size", "rank", "Aggregation",
           "AllReduceAggregation", "AllReduceAggregationHVD", "DecentralizedAggregation",
           "SparsifiedAggregation", "PowerAggregation", "Error", "OPS"]

OPS = ("avg", "sum", "min", "max", "custom_avg")
# mlbench's own names for the same operators (centralized.py).
_ALIASES = {"avg_world": "avg", "avg_custom": "custom_avg"}
_OP_CODES = {"avg": _cohort.OP_AVG, "sum": _cohort.OP_SUM, "min": _cohort.OP_MIN,
             "max": _cohort.OP_MAX, "custom_avg": _cohort.OP_AVG_BY}
_DTYPES = {torch.float32: _cohort.G_F32, torch.float64: _cohort.G_F64,
           torch.float16: _cohort.G_F16, torch.bfloat16: _cohort.G_BF16,
           torch.int32: _cohort.G_I32, torch.int64: _cohort.G_I64}

_group = None
_call_timeout_ms = 300000


# ---- the process's membership --------------------------------------------

def init(address=None, cohort=None, id=None, timeout=60.0, call_timeout=300.0):
    """Joins this process to a cohort: `address` is a broker's "host:port"
    (None: $COHORT_BROKER, as in a cohort pod), `cohort` and `id` default to
    $COHORT_COHORT and $COHORT_ID. Waits up to `timeout` seconds for a
    membership that lists this member (TimeoutError). `call_timeout` bounds
    each aggregation, retries on new memberships included."""
    global _group, _call_timeout_ms
    if _group is not None:
        raise RuntimeError("cohort.aggregation is already initialised; call shutdown() first")
    if timeout <= 0 or call_timeout <= 0:
        raise ValueError("timeouts must be positive")
    g = _cohort.Group(address, cohort, id)
    if not g.wait(int(timeout * 1000)):
        g.close()
        raise TimeoutError("no membership of the cohort listed this member within %gs" % timeout)
    _group = g
    _call_timeout_ms = int(call_timeout * 1000)


def shutdown():
    """Leaves the cohort: the others go on with a new membership."""
    global _group
    if _group is not None:
        _group.close()
        _group = None


def is_initialized():
    return _group is not None


def _g():
    if _group is None:
        raise RuntimeError("cohort.aggregation.init() has not been called")
    return _group


def _position():
    g = _g()
    pos = g.position()
    if pos is None:
        # Between memberships (this member is rejoining): wait for one.
        if not g.wait(_call_timeout_ms):
            raise TimeoutError("this member is in no membership of the cohort")
        pos = g.position()
        if pos is None:
            raise TimeoutError("this member is in no membership of the cohort")
    return pos


def world_size():
    """The number of members in the cohort's current membership."""
    return _position()[1]


def rank():
    """This member's index in the current membership (members in order)."""
    return _position()[0]


def stats():
    """Counters of this member's collectives: calls, retries, delivered
    (results taken from the others after an interrupted call), lined_up,
    epochs, and the epoch and members that completed the last call."""
    return _g().stats()


# ---- one collective on one tensor ------------------------------------------

def _op_name(op):
    name = _ALIASES.get(op, op)
    if name not in _OP_CODES:
        raise NotImplementedError("aggregation op %r is not one of %s (or mlbench's avg_world, "
                                  "avg_custom)" % (op, ", ".join(OPS)))
    return name


def _denominator(denom):
    if denom is None:
        raise ValueError("Denominator should be one element tensor: custom_avg needs denom")
    if torch.is_tensor(denom):
        if denom.numel() != 1:
            raise ValueError("Denominator should be one element tensor, not %d elements"
                             % denom.numel())
        denom = denom.item()
    d = float(denom)
    if d == 0 or d != d or d in (float("inf"), float("-inf")):
        raise ValueError("Denominator should be a finite non-zero number, not %r" % denom)
    return d


def _dtype_code(t):
    code = _DTYPES.get(t.dtype)
    if code is None:
        raise TypeError("cohort aggregates float32, float64, float16, bfloat16, int32 and int64 "
                        "tensors, not %s" % t.dtype)
    return code


def _bytes_of(t):
    """The bytes of contiguous CPU tensor t as a writable buffer that
    shares its memory: the extension checks its length against the call
    and writes the result through it, so no address crosses as a number."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _allreduce(t, op, denom=None, divide_before=False):
    """All-reduces tensor t in place (through a contiguous host copy when
    it is not one itself) and returns it."""
    name = _op_name(op)
    d = _denominator(denom) if name == "custom_avg" else 0.0
    flags = 0
    work = t
    if divide_before and name in ("avg", "custom_avg"):
        if not t.is_floating_point():
            raise TypeError("divide_before needs a floating tensor, not %s" % t.dtype)
        flags = _cohort.DIVIDE_BEFORE
        if t.dtype not in (torch.float32, torch.float64):
            work = t.detach().to("cpu", torch.float32)
    code = _dtype_code(work)
    if work.device.type != "cpu" or not work.is_contiguous():
        work = work.detach().to("cpu").contiguous()
    if work.numel():
        _g().allreduce(_bytes_of(work), work.numel(), code, _OP_CODES[name], d, flags,
                       _call_timeout_ms)
    if work is not t:
        with torch.no_grad():
            t.copy_(work)
    return t


def _fingerprint(ids):
    return hashlib.blake2b("\n".join(ids).encode(), digest_size=8).digest()


def _members():
    """The member ids of the current membership, in order."""
    g = _g()
    for _ in range(100):
        r, n = _position()
        ids = [g.member_id(i) for i in range(n)]
        if g.position() == (r, n):
            return r, ids
    raise RuntimeError("the membership kept changing")


def _gather(t, tag):
    """Every member's (tag, tensor) in the order of the membership that
    completed the call: a list of (id, tag, tensor)."""
    host = t.detach().to("cpu").contiguous()
    raw = host.view(torch.uint8).reshape(-1) if host.numel() else torch.empty(0, dtype=torch.uint8)
    payload = torch.cat([torch.frombuffer(bytearray(tag), dtype=torch.uint8), raw])
    out = _g().allgather(_bytes_of(payload), _call_timeout_ms)
    n_bytes = payload.numel()
    rec = _cohort.GROUP_ID_BYTES + (n_bytes + 7) // 8 * 8
    if rec == 0 or len(out) % rec:
        raise Error(errno.EPROTO, "gather: the records do not fit the call")
    res = []
    for off in range(0, len(out), rec):
        mid = out[off:off + _cohort.GROUP_ID_BYTES].split(b"\0", 1)[0].decode()
        body = out[off + _cohort.GROUP_ID_BYTES:off + _cohort.GROUP_ID_BYTES + n_bytes]
        x = torch.frombuffer(bytearray(body[len(tag):]), dtype=host.dtype) \
            if host.numel() else torch.empty(0, dtype=host.dtype)
        res.append((mid, body[:len(tag)], x.reshape(host.shape)))
    return res


# ---- mlbench's classes ----------------------------------------------------

class Aggregation:
    """Aggregate updates / models from different processes (mlbench's base
    class). Subclasses define _agg(data, op, denom)."""

    def __init__(self, use_cuda=False):
        if use_cuda and not torch.cuda.is_available():
            raise RuntimeError("use_cuda=True, but this machine has no CUDA device torch can use")
        self.use_cuda = bool(use_cuda)

    def _agg(self, data, op, denom=None):
        """Aggregates tensor `data` with `op`; returns the aggregated tensor."""
        raise NotImplementedError

    def _check_device(self, tensors):
        if not self.use_cuda and any(t.is_cuda for t in tensors):
            raise RuntimeError("CUDA tensors need an Aggregation built with use_cuda=True")

    def _agg_packed(self, tensors, op, denom):
        """One collective per dtype over all of `tensors`, written back in place."""
        self._check_device(tensors)
        by_dtype = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for dtype in sorted(by_dtype, key=str):
            ts = by_dtype[dtype]
            flat = torch.cat([t.detach().reshape(-1).to("cpu") for t in ts])
            flat = self._agg(flat, op, denom)
            off = 0
            with torch.no_grad():
                for t in ts:
                    n = t.numel()
                    t.copy_(flat[off:off + n].view_as(t))
                    off += n

    def _agg_gradients_by_layer(self, model, op, denom=None):
        """Aggregate the model's gradients, each layer individually."""
        for p in model.parameters():
            if p.grad is not None:
                self._check_device([p.grad])
                p.grad.data = self._agg(p.grad.data, op, denom)

    def _agg_gradients_by_model(self, model, op, denom=None):
        """Aggregate the model's gradients, all layers at once."""
        self._agg_packed([p.grad.data for p in model.parameters() if p.grad is not None], op,
                         denom)

    def _agg_weights_by_layer(self, model, op, denom=None):
        """Aggregate the model's weights, each layer individually."""
        for p in model.parameters():
            self._check_device([p])
            p.data = self._agg(p.data, op, denom)

    def _agg_weights_by_model(self, model, op, denom=None):
        """Aggregate the model's weights, all layers at once."""
        self._agg_packed([p.data for p in model.parameters()], op, denom)

    def _by_layer_in_one_call(self, model, op, denom, grads):
        """By layer for an elementwise _agg: every layer in one collective
        per dtype, as by model. The result is the same as layer by layer,
        and a member that joins between two layers' collectives cannot cut
        the aggregation in two (its calls would differ from the others',
        and every member would fail with some layers aggregated)."""
        if grads:
            ts = [p.grad.data for p in model.parameters() if p.grad is not None]
        else:
            ts = [p.data for p in model.parameters()]
        self._agg_packed(ts, op, denom)

    def agg_grad(self, by_layer=False):
        return self._agg_gradients_by_layer if by_layer else self._agg_gradients_by_model

    def agg_model(self, by_layer=False):
        return self._agg_weights_by_layer if by_layer else self._agg_weights_by_model


class AllReduceAggregation(Aggregation):
    """Aggregate weights / models from different processes with an
    all-reduce (mlbench's). `world_size` is mlbench's: in a cohort the size
    follows the membership, so "avg" divides by the members of the
    membership that completed each call; a world_size other than the
    current one is warned about. `divide_before` divides every member's
    input before the sum (by that same count, or by denom)."""

    def __init__(self, world_size, divide_before=False, use_cuda=False):
        super().__init__(use_cuda)
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ValueError("world_size must be a positive int, not %r" % (world_size,))
        current = globals()["world_size"]()
        if world_size != current:
            warnings.warn("world_size=%d, but the cohort has %d members now; averages divide "
                          "by the members of each call's membership" % (world_size, current),
                          RuntimeWarning, stacklevel=2)
        self.divide_before = bool(divide_before)

    @property
    def world_size(self):
        return world_size()

    def _agg(self, data, op, denom=None):
        return _allreduce(data, op, denom, self.divide_before)

    def _agg_gradients_by_layer(self, model, op, denom=None):
        self._by_layer_in_one_call(model, op, denom, True)

    def _agg_weights_by_layer(self, model, op, denom=None):
        self._by_layer_in_one_call(model, op, denom, False)


class AllReduceAggregationHVD(AllReduceAggregation):
    """AllReduceAggregation for code written against mlbench's Horovod
    class: the same collective (cohort has no Horovod underneath)."""


class DecentralizedAggregation(Aggregation):
    """Gossip averaging with the given neighbours (mlbench's): each call
    makes x_i = (x_i + sum of the neighbours' x_j) / (deg_i + 1).

    `rank` is this member's rank and `neighbors` their ranks, in the
    membership of the moment the object is made. They are remembered as
    member ids. While the membership is that one, the given graph is
    used; once it is not (a member left or joined), every member uses the
    ring of the membership that completes the call: its neighbours are
    the members before and after it in member order. The rule is the same
    on every member because every member sees the same gathered bytes:
    each brings the fingerprint of the membership it built its graph on.
    Make a new DecentralizedAggregation to give the new membership a
    graph of its own."""

    def __init__(self, rank, neighbors, use_cuda=False):
        super().__init__(use_cuda)
        neighbors = [int(n) for n in neighbors]
        if rank in neighbors:
            raise ValueError("rank %d cannot be its own neighbour" % rank)
        me, ids = _members()
        if rank != me:
            raise ValueError("rank %d is not this member's rank (%d) in the cohort" % (rank, me))
        bad = [n for n in neighbors if not 0 <= n < len(ids)]
        if bad:
            raise ValueError("neighbours %s are not ranks of the cohort's %d members"
                             % (bad, len(ids)))
        self.rank = rank
        self.neighbors = neighbors
        self._me = ids[me]
        self._neighbor_ids = sorted({ids[n] for n in neighbors})
        self._fp = _fingerprint(ids)

    def _agg(self, data, op, denom=None):
        if _ALIASES.get(op, op) != "avg":
            raise NotImplementedError("DecentralizedAggregation averages (op 'avg' or "
                                      "'avg_world'), not %r" % (op,))
        if not data.is_floating_point():
            raise TypeError("gossip averaging needs a floating tensor, not %s" % data.dtype)
        recs = _gather(data, self._fp)
        ids = [r[0] for r in recs]
        if all(r[1] == _fingerprint(ids) for r in recs):
            mine = self._neighbor_ids
        else:
            mine = _ring(ids, self._me)
        x = {r[0]: r[2] for r in recs}
        acc = x[self._me].to(torch.float64).clone()
        for j in mine:
            acc += x[j].to(torch.float64)
        acc /= len(mine) + 1
        with torch.no_grad():
            data.copy_(acc.to(data.dtype))
        return data

    def _agg_gradients_by_layer(self, model, op, denom=None):
        self._by_layer_in_one_call(model, op, denom, True)

    def _agg_weights_by_layer(self, model, op, denom=None):
        self._by_layer_in_one_call(model, op, denom, False)

    def neighbors_now(self):
        """The neighbour ids the next call would use if the membership
        stays as it is now."""
        me, ids = _members()
        if _fingerprint(ids) == self._fp:
            return list(self._neighbor_ids)
        return _ring(ids, self._me)


class SparsifiedAggregation(Aggregation):
    """Top-k sparsification with error feedback (mlbench's class, whose
    docstring promises it; its body is a stub there). Each call sends,
    from every member, the k = ceil(ratio x n) entries of largest
    magnitude of its tensor plus its residual (what it did not send
    before), as (index, value) pairs; every member gets the same dense sum
    ("sum") or mean over the members of the membership that completed the
    call ("avg", mlbench's "avg_world") of what was sent, and keeps the
    rest as its residual for the next call.

    `ratio` is the fraction of entries sent per call, in (0, 1] (mlbench's
    optimizer speaks of a number of coordinates; a fraction fits every
    layer's size). Values travel and residuals are kept in float32: other
    floating dtypes are converted there and back. by_model sends the top k
    of all of the model's tensors packed in parameter order; by_layer sends
    each tensor's own top k_i = ceil(ratio x n_i) (mlbench's per-layer
    top-k), all layers in one call, so a member joining between two layers
    cannot cut the aggregation in two. Each keeps one residual over the
    packed tensors; by model, by layer, gradients and weights have
    residuals of their own. A residual changes only when a call completes: an aggregation
    that a membership change interrupts is retried on the new membership
    with the same input. A member that joins starts with zero residuals;
    one that leaves takes its residuals with it (what it had not sent is
    lost to the others). Every member must build the class alike and make
    the same calls: a member whose tensor differs in size (its model
    does) makes every member's call fail with cohort.Error (EPROTO),
    tensors and residuals untouched."""

    def __init__(self, model, use_cuda=False, ratio=0.01):
        super().__init__(use_cuda)
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or \
                not 0 < ratio <= 1:
            raise ValueError("ratio must be in (0, 1], not %r" % (ratio,))
        self.model = model
        self.ratio = float(ratio)
        self._group = _g()
        self._reducers = {}

    def _reducer(self, key, n):
        """The reducer for key, of n values (an int) or of segments (a
        tuple of the layers' sizes, each with its own k)."""
        if _g() is not self._group:
            raise RuntimeError("cohort.aggregation was initialised again; make a new "
                               "SparsifiedAggregation")
        r = self._reducers.get(key)
        if r is None or r[1] != n:
            r = (self._group.topk_create(n, self.ratio), n)
            self._reducers[key] = r
        return r[0]

    def _sparse(self, tensors, key, op, by_layer=False):
        """One top-k call over `tensors` packed as float32, written back in
        place; by_layer, each tensor is a segment with its own k."""
        name = _op_name(op)
        if name not in ("avg", "sum"):
            raise NotImplementedError("SparsifiedAggregation sums or averages (op 'avg', "
                                      "'avg_world' or 'sum'), not %r" % (op,))
        self._check_device(tensors)
        for t in tensors:
            if not t.is_floating_point():
                raise TypeError("top-k needs floating tensors, not %s" % t.dtype)
        # An empty tensor sends nothing and has nothing to keep.
        tensors = [t for t in tensors if t.numel()]
        if not tensors:
            return
        flat = torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in tensors])
        size = tuple(t.numel() for t in tensors) if by_layer else flat.numel()
        h = self._reducer(key, size)
        self._group.topk_reduce(h, _bytes_of(flat), _OP_CODES[name], _call_timeout_ms)
        off = 0
        with torch.no_grad():
            for t in tensors:
                n = t.numel()
                t.copy_(flat[off:off + n].view_as(t))
                off += n

    def _agg(self, data, op, denom=None):
        self._sparse([data], ("tensor",), op)
        return data

    def _agg_gradients_by_layer(self, model, op, denom=None):
        self._sparse([p.grad.data for p in model.parameters() if p.grad is not None],
                     ("grad", "layers"), op, True)

    def _agg_gradients_by_model(self, model, op, denom=None):
        self._sparse([p.grad.data for p in model.parameters() if p.grad is not None],
                     ("grad",), op)

    def _agg_weights_by_layer(self, model, op, denom=None):
        self._sparse([p.data for p in model.parameters()], ("weights", "layers"), op, True)

    def _agg_weights_by_model(self, model, op, denom=None):
        self._sparse([p.data for p in model.parameters()], ("weights",), op)

    def k(self, key=("grad",)):
        """k of the reducer named by key (("grad",) for gradients by model,
        ("grad", "layers") by layer, where k is the sum of the layers' k_i;
        "weights" alike), or None before its first call."""
        r = self._reducers.get(tuple(key))
        return None if r is None else self._group.topk_info(r[0])[0]

    def residual(self, key=("grad",)):
        """A float32 copy of the residual of the reducer named by key (as
        k; the layers packed in parameter order), or None before its first
        call."""
        r = self._reducers.get(tuple(key))
        if r is None:
            return None
        return torch.frombuffer(bytearray(self._group.topk_info(r[0])[1]), dtype=torch.float32)


class PowerAggregation(Aggregation):
    """PowerSGD with error feedback (mlbench's class, a copy of the PowerSGD
    paper's RankKReducer): every matrix (a tensor of two or more
    dimensions, viewed as shape[0] x the rest) is reduced as a product of
    rank min(rank, rows, cols) through two small all-reduces, and every
    vector (biases, norms) is reduced exactly, uncompressed, as in the
    reference. Every member gets the same bytes. Each member keeps as its
    error what its own share left out, E = M' - P^ (M'^T P^)^T (the
    paper's local error; it balances for a sum as well as a mean), and adds
    it to its next input. With reuse_query each call starts from the
    cohort's last Q (warm start); without it, from the Q that `seed` picks,
    the same on every member.

    `rank` is PowerSGD's rank (mlbench's name), from 1 to 1024, not the
    member's position. `world_size` is mlbench's and only checked: "avg"
    divides by the members of the membership that completed each call.
    Ops: "avg" ("avg_world") and "sum". by_model and by_layer each make
    one collective of all of the model's tensors (a member joining
    mid-aggregation cannot cut it in two). Every matrix has its own P and
    Q either way, so by layer is the same math as by model: the two keep
    errors and warm starts of their own. Values travel and errors are kept
    in float32. The error and the warm start change only when a call
    completes; a member that joins starts with zero errors and the seeded
    Q, and one that leaves takes its errors with it. Members whose models
    differ in shapes get cohort.Error (EPROTO) on every member, with their
    tensors and errors untouched."""

    def __init__(self, model, use_cuda=False, reuse_query=False, world_size=1, rank=1, seed=1):
        super().__init__(use_cuda)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= 1024:
            raise ValueError("rank (PowerSGD's) must be an int from 1 to 1024, not %r" % (rank,))
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError("world_size must be a positive int, not %r" % (world_size,))
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 64:
            raise ValueError("seed must be an int in [0, 2^64), not %r" % (seed,))
        self.model = model
        self.reuse_query = bool(reuse_query)
        self.rank = rank
        self.seed = seed
        self._group = _g()
        self._reducers = {}

    def _power(self, tensors, key, op):
        """One PowerSGD call over `tensors` (matrices, then vectors), in place."""
        name = _op_name(op)
        if name not in ("avg", "sum"):
            raise NotImplementedError("PowerAggregation sums or averages (op 'avg', "
                                      "'avg_world' or 'sum'), not %r" % (op,))
        self._check_device(tensors)
        for t in tensors:
            if not t.is_floating_point():
                raise TypeError("PowerSGD needs floating tensors, not %s" % t.dtype)
        tensors = [t for t in tensors if t.numel()]
        mats = [t for t in tensors if t.dim() > 1]
        vecs = [t for t in tensors if t.dim() <= 1]
        if not tensors:
            return
        shapes = tuple((t.shape[0], t.numel() // t.shape[0]) for t in mats)
        n_vec = sum(t.numel() for t in vecs)
        if _g() is not self._group:
            raise RuntimeError("cohort.aggregation was initialised again; make a new "
                               "PowerAggregation")
        full = (key, shapes, n_vec)
        h = self._reducers.get(key)
        if h is None or h[1] != full:
            h = (self._group.powersgd_create(list(shapes), n_vec, self.rank, self.seed,
                                             self.reuse_query), full)
            self._reducers[key] = h
        order = mats + vecs
        flat = torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in order])
        self._group.powersgd_reduce(h[0], _bytes_of(flat), _OP_CODES[name], _call_timeout_ms)
        off = 0
        with torch.no_grad():
            for t in order:
                n = t.numel()
                t.copy_(flat[off:off + n].view_as(t))
                off += n

    def _agg(self, data, op, denom=None):
        self._power([data], ("tensor",), op)
        return data

    def _agg_gradients_by_layer(self, model, op, denom=None):
        # Each matrix is compressed on its own in any case: one call.
        self._power([p.grad.data for p in model.parameters() if p.grad is not None],
                    ("grad", "layers"), op)

    def _agg_gradients_by_model(self, model, op, denom=None):
        self._power([p.grad.data for p in model.parameters() if p.grad is not None],
                    ("grad",), op)

    def _agg_weights_by_layer(self, model, op, denom=None):
        self._power([p.data for p in model.parameters()], ("weights", "layers"), op)

    def _agg_weights_by_model(self, model, op, denom=None):
        self._power([p.data for p in model.parameters()], ("weights",), op)

    def error(self, key=("grad",)):
        """A float32 copy of this member's error for the reducer named by
        key (("grad",) by model, ("grad", "layers") by layer, "weights"
        alike; matrices first, in order, then vectors), or None before its
        first call."""
        r = self._reducers.get(tuple(key))
        if r is None:
            return None
        return torch.frombuffer(bytearray(self._group.powersgd_info(r[0])[1]),
                                dtype=torch.float32)


def _ring(ids, me):
    n = len(ids)
    p = ids.index(me)
    return sorted({ids[(p - 1) % n], ids[(p + 1) % n]} - {me})


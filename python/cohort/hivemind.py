"""hivemind's DecentralizedAverager on cohort.

    import cohort.hivemind as hivemind

    dht = hivemind.DHT(initial_peers=["127.0.0.1:7000"], start=True)
    averager = hivemind.DecentralizedAverager(
        [torch.zeros(1000)], dht, start=True, prefix="run1",
        target_group_size=4, min_matchmaking_time=1.0, request_timeout=0.5)
    with averager.get_tensors() as tensors:
        tensors[0] += 1
    gathered = averager.step(gather={"batch": 32}, weight=32)

The DHT stands in for hivemind's: it names the cohort broker that
averagers find each other through (`initial_peers`, else $COHORT_BROKER)
and this peer's id. Each step asks the broker for a group by prefix and
group bits and averages the tensors in place among it, weighted, exactly
alike on every member (docs/architecture.md, "hivemind's
DecentralizedAverager"). A peer that stalls is excluded and the step
completes with the rest; the returned dict holds exactly the peers that
were averaged.

`compression` is NoCompression() (exact), Float16Compression(),
ScaledFloat16Compression() (float16 of each run's values less their mean,
over their deviation), BlockwiseQuantization() (8 bits per value with a
scale per block), Uniform8BitQuantization() (8 bits per value, bins of
6 sigma / 256 around the mean, a codebook of bin means per run) or
Quantile8BitQuantization() (8 bits per value, 256 buckets cut at the
run's quantiles, a codebook of bucket means per run); with a
codec only the tensors travel encoded, the weights and gathered objects
stay exact, and every member still ends with the same bytes. Averagers
with different compression never group: the broker refuses the step.
An adaptive codec (below) chooses a codec per averaged tensor from its
CompressionInfo, as in hivemind: each tensor travels in the codec chosen
for it (those of one codec in a call of their own within the step, which
succeeds or changes nothing), and only averagers whose tensors choose
alike group. One that chooses one codec for every tensor is that codec.

`bandwidth` and `client_mode` balance the load as in hivemind: in a
group where any peer gives a bandwidth or is a client, each peer reduces
a share of the round by a butterfly all-reduce, the shares hivemind's
load-balancing program gives for the bandwidths (None: the mean of those
given; 0: none; a peer too slow to be worth a share gets none), and a
client reduces
nothing and accepts no connection (it dials out to every reducer). With
a codec each contribution travels encoded, each reducer sums its part in
float32 and encodes the result once, and every peer, the reducer too,
decodes those bytes: the same bytes everywhere, with two encodings'
error. In such a round, `min_vector_size` drops the shares
worth fewer elements (peers that use different values do not group).
`step(scheduled_time=t)` (time.time() seconds) starts matchmaking at
t - min_matchmaking_time and begins the all-reduce at t: a group that
formed earlier waits until then.

State sharing: an averager that allows it (the default, as in hivemind,
unless auxiliary) is listed by the broker as a donor of its prefix with
its state_sharing_priority, re-declared every declare_state_period.
load_state_from_peers() downloads (metadata, tensors) from the donors of
the highest priority, in parallel parts when several are equal, every
part checked against a manifest the donors MAC with the cohort's key, so
a donor that lies or stalls is dropped and never mixed in. Donors run
get_current_state() in this process, on a thread of the averager's, when
a download begins. state_compression is any codec above, applied to
each floating-point tensor of the state (integer and bool tensors travel
as they are) and undone by the newcomer, the tensor coming back in its
own dtype and shape: Float16Compression as float16, the others by the
engine's codecs in runs of the engine's segment (part_size_bytes / 4
elements, at least 342), so each run keeps its codec's error bound. Or
one of hivemind's adaptive codecs, choosing a codec per tensor from its
CompressionInfo: SizeAdaptiveCompression(threshold, less,
greater_equal) by the tensor's element count, RoleAdaptiveCompression by
its TensorRole (PARAMETER, OPTIMIZER or UNSPECIFIED for a state),
PerTensorCompression by its key. The infos are what get_current_state()
returns third: by default `tensor_infos`, else
CompressionInfo.from_tensor(t, key=i) per tensor, as in hivemind.
tensor_infos is refused unless compression or state_compression is
adaptive: nothing else reads it.

Arguments of hivemind's constructor that cohort does not carry out yet
are refused with a ValueError that says so, never ignored: a codec class
cohort does not know, an adaptive `compression` whose choice changes
more than 256 times along the averaged tensors, daemon=False.

An auxiliary peer may have no tensors (`averaged_tensors=None` or [],
`auxiliary=True`): it joins groups of any tensors, learns their size and
compression from its group (an adaptive codec's choice per tensor in the
step's first call, checked against the digest the group formed under),
and reduces its share of each round like any peer; get_tensors() gives
it an empty list.

Gathered objects and state metadata cross as JSON (hivemind uses
msgpack): peers may lie, and JSON cannot run code on the receiving side.
"""
import concurrent.futures
import enum
import errno
import hashlib
import json
import logging
import math
import os
import struct
import threading
import time
import uuid
import weakref
from contextlib import contextmanager

import torch

from . import _cohort

__all__ = ["DHT", "DecentralizedAverager", "AllreduceException", "NoCompression",
           "Float16Compression", "ScaledFloat16Compression", "BlockwiseQuantization",
           "Uniform8BitQuantization", "Quantile8BitQuantization", "SizeAdaptiveCompression",
           "RoleAdaptiveCompression", "PerTensorCompression", "CompressionInfo",
           "TensorRole", "TensorDescriptor",
           "StepControl", "averaging"]

_GROUP_MAX = 256
_GATHER_MAX = 4096      # bytes of a serialised gather; every round carries room for it
_PLAN_MAX = 256         # runs of one codec along the averaged tensors (the averager's cap)
_log = logging.getLogger("cohort.hivemind")

# A state on the wire: b"CHS2", u32 metadata length, the metadata as JSON,
# u32 tensor count, then per tensor: u8 dtype, u8 codec (0 as is, 1
# float16, else an engine codec: engine/codec.h), u8 ndim, u8 0, u32 run
# (the elements per encoded run, 0 for codecs 0 and 1), ndim x i64 shape,
# u64 byte count, the bytes.
_STATE_MAGIC = b"CHS2"
_STATE_TENSORS_MAX = 1 << 16
_STATE_NDIM_MAX = 32
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]
_STATE_CODECS = (0, 1, 3, 6, 7, 8)     # as is, float16, and the engine's 8- and 16-bit


def _encode_state(metadata, tensors, codecs, run):
    """The bytes of (metadata, tensors). codecs: one codec id per tensor
    (_STATE_CODECS), applied to the floating-point ones (others travel as
    they are); run: the elements per encoded run, as the engine cuts a
    reduction into segments."""
    try:
        meta = json.dumps(metadata, sort_keys=True).encode()
    except (TypeError, ValueError) as e:
        raise TypeError("state metadata must be JSON-serialisable: %s" % e) from None
    out = [_STATE_MAGIC, struct.pack("<I", len(meta)), meta, struct.pack("<I", len(tensors))]
    for t, codec in zip(tensors, codecs):
        if not isinstance(t, torch.Tensor) or t.dtype not in _DTYPES:
            raise TypeError("state tensors must be torch tensors of %s" % _DTYPES)
        if t.dim() > _STATE_NDIM_MAX:
            raise ValueError("a state tensor has more than %d dimensions" % _STATE_NDIM_MAX)
        t = t.detach().cpu().contiguous()
        if not t.is_floating_point() or t.numel() == 0 or \
                (codec == 1 and t.dtype == torch.float16):
            codec = 0
        if codec == 0:
            body = memoryview(t.reshape(-1).view(torch.uint8).numpy())
        elif codec == 1:
            body = memoryview(t.to(torch.float16).reshape(-1).view(torch.uint8).numpy())
        else:
            flat = t.reshape(-1).to(torch.float32).contiguous()
            body = _cohort.codec_encode(codec, flat.view(torch.uint8).numpy(), run)
        out.append(struct.pack("<BBBBI", _DTYPES.index(t.dtype), codec, t.dim(), 0,
                               run if codec > 1 else 0))
        out.append(struct.pack("<%dq" % t.dim(), *t.shape))
        out.append(struct.pack("<Q", body.nbytes if isinstance(body, memoryview) else len(body)))
        out.append(body)        # joined below: one copy
    return b"".join(out)


def _decode_state(blob):
    """(metadata, tensors) from _encode_state's bytes; ValueError for
    anything else (a donor may lie: every length is checked)."""
    view = memoryview(blob)
    at = 0

    def take(n):
        nonlocal at
        if n < 0 or at + n > len(view):
            raise ValueError("the state is cut short or declares a length past its end")
        at += n
        return view[at - n:at]

    if bytes(take(4)) != _STATE_MAGIC:
        raise ValueError("not a cohort state")
    (meta_len,) = struct.unpack("<I", take(4))
    metadata = json.loads(bytes(take(meta_len)).decode())
    (count,) = struct.unpack("<I", take(4))
    if count > _STATE_TENSORS_MAX:
        raise ValueError("the state declares %d tensors" % count)
    tensors = []
    for _ in range(count):
        code, codec, ndim, zero, run = struct.unpack("<BBBBI", take(8))
        if code >= len(_DTYPES) or codec not in _STATE_CODECS or ndim > _STATE_NDIM_MAX \
                or zero or (run == 0) != (codec < 2):
            raise ValueError("a state tensor with a bad dtype, codec, rank or run")
        shape = struct.unpack("<%dq" % ndim, take(8 * ndim))
        if any(d < 0 for d in shape):
            raise ValueError("a state tensor with a negative dimension")
        dtype = _DTYPES[code]
        if codec and not dtype.is_floating_point:
            raise ValueError("a codec on a tensor that is not floating-point")
        (nbytes,) = struct.unpack("<Q", take(8))
        numel = math.prod(shape)
        if numel > len(view) * 8:       # more than any codec could carry in the blob
            raise ValueError("a state tensor's shape is larger than the state")
        if codec > 1:
            # The binding checks nbytes against the codec's length for
            # numel values before it allocates anything.
            raw = _cohort.codec_decode(codec, take(nbytes), numel, run)
            wire = torch.float32
        else:
            wire = torch.float16 if codec else dtype
            if nbytes != numel * torch.empty((), dtype=wire).element_size():
                raise ValueError("a state tensor's byte count does not match its shape")
            # One copy, which the tensor owns (frombuffer keeps it alive).
            raw = bytearray(take(nbytes))
        t = torch.frombuffer(raw, dtype=torch.uint8).view(wire) if len(raw) else \
            torch.empty(0, dtype=wire)
        tensors.append(t.reshape(shape).to(dtype))
    if at != len(view):
        raise ValueError("trailing bytes after the state")
    return metadata, tensors


class AllreduceException(Exception):
    """A round of averaging failed: too few peers, every attempt stalled,
    or the peers disagree (tensor shapes or dtypes, group sizes)."""


class CompressionBase:
    """hivemind.compression.CompressionBase: how tensors travel. `_codec`
    is the engine's codec (include/cohort.h, enum cohort_compression)."""

    _codec = None


class NoCompression(CompressionBase):
    """Tensors travel as float32: the average is exact."""

    _codec = 0

    def __repr__(self):
        return "NoCompression()"


class Float16Compression(CompressionBase):
    """IEEE half precision on the wire, float32 sums (relative error 2^-11
    per encoding). hivemind clamps to +-65504 first; here a value beyond
    that becomes inf, so a diverging run shows."""

    _codec = 1

    def __repr__(self):
        return "Float16Compression()"


class BlockwiseQuantization(CompressionBase):
    """8 bits per value with a float32 absmax scale per block, float32
    sums. hivemind's needs bitsandbytes and uses its dynamic code in
    blocks of 4096; cohort's is the engine's linear code in blocks of 256
    (q = round(x / s), s = max|x| / 127: error at most s / 2 per
    encoding). About a quarter of the bytes of float32."""

    _codec = 3

    def __repr__(self):
        return "BlockwiseQuantization()"


class ScaledFloat16Compression(CompressionBase):
    """hivemind's MEANSTD_16BIT: each run the engine sends (a ring
    segment) as float16 of (x - mean) / deviation, with the mean and
    deviation as float32, float32 sums. Error at most 2^-11 of a value's
    distance from its run's mean per encoding (plus float32's rounding),
    so values far from zero keep the precision float16 would lose, and
    values past float16's range keep their magnitude. hivemind takes the
    statistics per row of each part; a run here is one row. A run holding
    NaN or Inf comes back all NaN."""

    _codec = 6

    def __repr__(self):
        return "ScaledFloat16Compression()"


class Uniform8BitQuantization(CompressionBase):
    """hivemind's UNIFORM_8BIT: each run the engine sends (a ring segment)
    as one byte per value, the bin of (x - mean) / (6 sigma / 256) about
    128, clamped to 0..255, and a codebook of 256 float32, the mean of the
    run's values in each bin; float32 sums. Error at most a bin's width
    (6 sigma / 256) per encoding for values within 3 sigma of the mean;
    the outliers clamped into the two end bins get their bin's mean. The
    codebook costs 1 KiB per run (hivemind's per part), so segments
    (part_size_bytes) are at least 1368 bytes. A run holding NaN or Inf
    comes back all NaN."""

    _codec = 7

    def __repr__(self):
        return "Uniform8BitQuantization()"


class Quantile8BitQuantization(CompressionBase):
    """hivemind's QUANTILE_8BIT: each run the engine sends (a ring segment)
    as one byte per value, its bucket among 256 cut at 255 borders, the
    run's quantiles at k / 256 (exact up to 8192 values, else those of
    8192 values spread evenly over the run: hivemind's are approximate
    too), and a codebook of 256 float32, the mean of the run's values in
    each bucket; float32 sums. Error per encoding at most the span of the
    run's values in the value's bucket: each bucket holds about a 256th of
    the run, so a few outliers widen only the two end buckets, where
    Uniform8BitQuantization's bins all widen with sigma. The codebook costs
    1 KiB per run, so segments (part_size_bytes) are at least 1368 bytes.
    A run holding NaN or Inf comes back all NaN."""

    _codec = 8

    def __repr__(self):
        return "Quantile8BitQuantization()"


class TensorRole(enum.Enum):
    """hivemind.compression.TensorRole: what a tensor is, for
    RoleAdaptiveCompression. A state's tensors are parameters, optimizer
    state or unspecified (hivemind's TrainingStateAverager gives its
    extra tensors UNSPECIFIED); the other two roles are hivemind's for
    activations and gradients and are accepted here alike."""

    ACTIVATION = "activation"
    PARAMETER = "parameter"
    GRADIENT = "gradient"
    OPTIMIZER = "optimizer"
    UNSPECIFIED = "unspecified"


class TensorDescriptor:
    """The part of hivemind's TensorDescriptor the codecs read: the
    tensor's size and dtype."""

    def __init__(self, size, dtype=torch.float32):
        self.size = tuple(int(d) for d in size)
        self.dtype = dtype

    @classmethod
    def from_tensor(cls, tensor):
        return cls(tensor.shape, tensor.dtype)

    def numel(self):
        return math.prod(self.size)

    def __repr__(self):
        return "TensorDescriptor(size=%r, dtype=%r)" % (self.size, self.dtype)


class CompressionInfo:
    """hivemind.compression.CompressionInfo: what an adaptive codec
    chooses by. `key` names the tensor (PerTensorCompression), `descriptor`
    gives its size (SizeAdaptiveCompression, which looks at the whole
    tensor, never at a part), `role` its TensorRole
    (RoleAdaptiveCompression). The averager's default infos are
    from_tensor(t, key=i) for the i-th tensor, as in hivemind."""

    def __init__(self, key, descriptor, role=TensorRole.UNSPECIFIED, part_index=0,
                 part_size=None):
        if not isinstance(descriptor, TensorDescriptor):
            raise TypeError("descriptor must be a cohort.hivemind.TensorDescriptor")
        if not isinstance(role, TensorRole):
            raise TypeError("role must be a cohort.hivemind.TensorRole")
        self.key = key
        self.descriptor = descriptor
        self.role = role
        self.part_index = part_index
        self.part_size = part_size

    @classmethod
    def from_tensor(cls, tensor, key=None, descriptor=None, role=TensorRole.UNSPECIFIED):
        return cls(key, descriptor or TensorDescriptor.from_tensor(tensor), role)

    def __repr__(self):
        return "CompressionInfo(key=%r, descriptor=%r, role=%r)" % (self.key, self.descriptor,
                                                                     self.role)


class AdaptiveCompressionBase(CompressionBase):
    """hivemind's adaptive codecs: each chooses another codec per tensor
    from its CompressionInfo (choose_compression); the choice may itself be
    adaptive. The state and the averaged tensors apply the choice per
    tensor."""

    def choose_compression(self, info):
        raise NotImplementedError


class SizeAdaptiveCompression(AdaptiveCompressionBase):
    """`greater_equal` for tensors of at least `threshold` elements (the
    whole tensor's count), else `less`."""

    def __init__(self, threshold, less, greater_equal):
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
            raise ValueError("threshold must be an int from 0")
        for c in (less, greater_equal):
            if not isinstance(c, CompressionBase):
                raise TypeError("less and greater_equal must be codecs of cohort.hivemind")
        self.threshold, self.less, self.greater_equal = threshold, less, greater_equal

    def choose_compression(self, info):
        return self.greater_equal if info.descriptor.numel() >= self.threshold else self.less

    def __repr__(self):
        return "SizeAdaptiveCompression(%d, %r, %r)" % (self.threshold, self.less,
                                                         self.greater_equal)


class RoleAdaptiveCompression(AdaptiveCompressionBase):
    """A codec per TensorRole; a role given None (or not given) takes
    `default`."""

    def __init__(self, *, activation=None, parameter=None, gradient=None, optimizer=None,
                 default=NoCompression()):
        given = {TensorRole.ACTIVATION: activation, TensorRole.PARAMETER: parameter,
                 TensorRole.GRADIENT: gradient, TensorRole.OPTIMIZER: optimizer}
        for c in list(given.values()) + [default]:
            if c is not None and not isinstance(c, CompressionBase):
                raise TypeError("RoleAdaptiveCompression takes codecs of cohort.hivemind")
        if default is None:
            raise TypeError("default must be a codec")
        self.default = default
        self.role_mapping = {r: c or default for r, c in given.items()}

    def choose_compression(self, info):
        return self.role_mapping.get(info.role, self.default)

    def __repr__(self):
        return "RoleAdaptiveCompression(%s, default=%r)" % (
            ", ".join("%s=%r" % (r.value, c) for r, c in self.role_mapping.items()), self.default)


class PerTensorCompression(AdaptiveCompressionBase):
    """A codec per tensor key: a sequence (keys 0, 1, ...: the tensors'
    positions, the default keys) or a mapping. A key it lacks is an
    error."""

    def __init__(self, tensor_compressions):
        if isinstance(tensor_compressions, (list, tuple)):
            tensor_compressions = dict(enumerate(tensor_compressions))
        if not isinstance(tensor_compressions, dict):
            raise TypeError("PerTensorCompression takes a list or a dict of codecs")
        for c in tensor_compressions.values():
            if not isinstance(c, CompressionBase):
                raise TypeError("PerTensorCompression takes codecs of cohort.hivemind")
        self.tensor_compressions = tensor_compressions

    def choose_compression(self, info):
        try:
            return self.tensor_compressions[info.key]
        except (KeyError, TypeError):
            raise ValueError("PerTensorCompression has no codec for tensor key %r" %
                             (info.key,)) from None

    def __repr__(self):
        return "PerTensorCompression(%r)" % (self.tensor_compressions,)


_STATE_CLASSES = (NoCompression, Float16Compression, ScaledFloat16Compression,
                  BlockwiseQuantization, Uniform8BitQuantization, Quantile8BitQuantization)


def _resolve(compression, info, what):
    """The codec an (adaptive) compression chooses for the tensor `info`
    names; ValueError, naming the argument `what`, for a class cohort
    does not know."""
    for _ in range(16):
        if type(compression) in _STATE_CLASSES:
            return compression
        if not isinstance(compression, AdaptiveCompressionBase):
            raise ValueError("%s: %r is not supported; cohort's codecs are %s, or an adaptive "
                             "codec over them" % (what, compression, ", ".join(
                                 c.__name__ for c in _STATE_CLASSES)))
        compression = compression.choose_compression(info)
    raise ValueError("%s: adaptive codecs nested more than 16 deep" % what)


def _is_adaptive(compression):
    return isinstance(compression, AdaptiveCompressionBase)


def _default_infos(tensors):
    return [CompressionInfo.from_tensor(t, key=i) for i, t in enumerate(tensors)]


def _through_sidecar():
    """A cohort's trainer container: the pod's sidecar at $COHORT_SOCKET
    holds the cohort's key, and the trainer none."""
    return bool(os.environ.get("COHORT_SOCKET")) and not os.environ.get("COHORT_SECRET_FILE")


class DHT:
    """Stands in for hivemind.DHT: the cohort broker at initial_peers[0]
    (or $COHORT_BROKER when initial_peers is empty), the cohort named by
    `cohort` (else $COHORT_COHORT, else "hivemind"), and this peer's id
    (`peer_id`, else $COHORT_ID, else a random one).

    Through a sidecar: with initial_peers=["unix:PATH"], or none in a
    cohort's trainer container ($COHORT_SOCKET set, no
    $COHORT_SECRET_FILE), averagers live in the pod's cohort-sidecar,
    which joins them with its key; `peer_id` is then the id the sidecar
    gives the averager once it runs (docs/architecture.md).

    In process the key is $COHORT_SECRET_FILE and the frame integrity
    $COHORT_INTEGRITY: "mac" (it needs the key) authenticates every
    data-plane frame, as a sidecar's --integrity mac, and averagers group
    only with those of the same setting; "none" or unset does not."""

    def __init__(self, initial_peers=(), start=True, *, cohort=None, peer_id=None):
        if not start:
            raise ValueError("DHT(start=False) is not supported: cohort's DHT is the broker, "
                             "which runs already; pass start=True")
        peers = list(initial_peers or ())
        if len(peers) > 1:
            raise ValueError("cohort's DHT is one broker: pass one address in initial_peers")
        if peers:
            broker = peers[0]
        elif _through_sidecar():
            broker = None       # the C library reaches the sidecar at $COHORT_SOCKET
        else:
            broker = os.environ.get("COHORT_BROKER")
        if broker is not None and (not broker or not isinstance(broker, str)):
            raise ValueError("no broker: pass initial_peers=[\"host:port\"] or set "
                             "$COHORT_BROKER")
        if broker is None and not _through_sidecar():
            raise ValueError("no broker: pass initial_peers=[\"host:port\"] or set "
                             "$COHORT_BROKER")
        self.broker = broker
        self.cohort = cohort or os.environ.get("COHORT_COHORT") or "hivemind"
        self.peer_id = peer_id or os.environ.get("COHORT_ID") or "peer-" + uuid.uuid4().hex[:12]
        self._averager = None
        self._alive = True

    def is_alive(self):
        return self._alive

    def shutdown(self):
        if self._averager is not None:
            self._averager.shutdown()
        self._alive = False


def _schema(tensors):
    """What the averaged tensors are, as the broker compares it: only
    averagers whose tensors have the same shapes and dtypes group."""
    desc = ";".join("%s:%s" % (tuple(t.shape), str(t.dtype)) for t in tensors)
    return hashlib.sha256(desc.encode()).digest()


class StepControl:
    """A step running in the background (step(wait=False))."""

    def __init__(self, require_trigger):
        self._done = threading.Event()
        self._trigger = threading.Event()
        if not require_trigger:
            self._trigger.set()
        self._cancelled = False
        self._scheduled = False     # waiting for scheduled_time: still cancellable
        self._result = None
        self._error = None

    def allow_allreduce(self):
        """Lets a step made with require_trigger=True begin."""
        self._trigger.set()

    def done(self):
        return self._done.is_set()

    def cancel(self):
        """Cancels the step if it has not begun averaging. Returns whether
        it was cancelled."""
        if self._done.is_set() or (self._trigger.is_set() and not self._cancelled and
                                    not self._scheduled):
            return False
        self._cancelled = True
        self._trigger.set()
        return True

    def cancelled(self):
        return self._cancelled

    def result(self, timeout=None):
        """The step's {peer_id: gathered}; raises AllreduceException when it
        failed, TimeoutError when it is not done within timeout."""
        if not self._done.wait(timeout):
            raise TimeoutError("the averaging step is not done")
        if self._cancelled:
            raise AllreduceException("the step was cancelled")
        if self._error is not None:
            raise self._error
        return self._result


class DecentralizedAverager:
    """hivemind.averaging.DecentralizedAverager on a cohort broker."""

    def __init__(self, averaged_tensors, dht, *, start, prefix, target_group_size=None,
                 min_group_size=2, initial_group_bits="", min_matchmaking_time=5.0,
                 request_timeout=3.0, averaging_alpha=1.0, part_size_bytes=2 ** 19,
                 allreduce_timeout=None, next_chunk_timeout=None, sender_timeout=None,
                 reducer_timeout=None, compression=NoCompression(),
                 state_compression=NoCompression(), tensor_infos=None, bandwidth=None,
                 min_vector_size=0, auxiliary=False, allow_state_sharing=None,
                 declare_state_period=30, client_mode=None, daemon=True, shutdown_timeout=5):
        if not isinstance(dht, DHT):
            raise TypeError("dht must be a cohort.hivemind.DHT")
        if dht._averager is not None:
            raise ValueError("this DHT already has an averager: its peer_id names one member")
        tensors = [t for t in averaged_tensors] if averaged_tensors is not None else []
        if not tensors and not auxiliary:
            raise ValueError("averaged_tensors is empty: only an auxiliary peer may have none")
        if not tensors and not isinstance(compression, NoCompression):
            raise ValueError("an auxiliary peer without tensors averages with its group's "
                             "compression: leave compression at NoCompression()")
        for t in tensors:
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise TypeError("averaged_tensors must be floating-point torch tensors")
        if not isinstance(prefix, str) or not prefix:
            raise ValueError("prefix must be a non-empty str")
        if request_timeout >= min_matchmaking_time:
            raise ValueError("request_timeout (%g s) must be smaller than min_matchmaking_time "
                             "(%g s)" % (request_timeout, min_matchmaking_time))
        if not 0 < averaging_alpha <= 1:
            raise ValueError("averaging_alpha must be in (0, 1]")
        target = _GROUP_MAX if target_group_size is None else int(target_group_size)
        if not 1 <= target <= _GROUP_MAX or not 1 <= int(min_group_size) <= target:
            raise ValueError("need 1 <= min_group_size <= target_group_size <= %d" % _GROUP_MAX)
        if not all(c in "01" for c in initial_group_bits) or len(initial_group_bits) > 64:
            raise ValueError("initial_group_bits must be at most 64 characters of 0 and 1")
        if bandwidth is not None:
            if isinstance(bandwidth, bool) or not isinstance(bandwidth, (int, float)):
                raise TypeError("bandwidth must be a number or None")
            if not (math.isfinite(bandwidth) and 0 <= bandwidth <= 1e15):
                raise ValueError("bandwidth must be finite, from 0 to 1e15")
        client_mode = bool(client_mode)
        if isinstance(min_vector_size, bool) or not isinstance(min_vector_size, int) \
                or not 0 <= min_vector_size < 2 ** 62:
            raise ValueError("min_vector_size must be an int from 0")
        # tensor_infos feed the adaptive codecs' choices (key, size, role);
        # with no adaptive codec they would change nothing.
        if tensor_infos is not None:
            if not (_is_adaptive(compression) or _is_adaptive(state_compression)):
                raise ValueError("tensor_infos changes nothing unless compression or "
                                 "state_compression is an adaptive codec: leave it None")
            tensor_infos = list(tensor_infos)
            if len(tensor_infos) != len(tensors) or \
                    not all(isinstance(i, CompressionInfo) for i in tensor_infos):
                raise ValueError("tensor_infos must hold one cohort.hivemind.CompressionInfo "
                                 "per averaged tensor")
        infos = tensor_infos if tensor_infos is not None else _default_infos(tensors)
        # A codec per tensor, as hivemind's adaptive codecs choose: one
        # codec for all of them is that codec; several make a plan, a
        # codec per run of the flat vector, adjacent tensors of one codec
        # merged (the averager sends each codec's runs in a call of its
        # own, all in one step).
        per_tensor = [_resolve(compression, i, "compression") for i in infos] \
            if tensors else [_resolve(compression, None, "compression")]
        plan = []
        for t, c in zip(tensors, per_tensor):
            if t.numel() == 0:
                continue
            if plan and plan[-1][1] == c._codec:
                plan[-1][0] += t.numel()
            else:
                plan.append([t.numel(), c._codec])
        codecs = {c._codec for c in per_tensor}
        if len(plan) > _PLAN_MAX:
            raise ValueError("compression %r alternates codecs %d times along the averaged "
                             "tensors: the averager takes at most %d runs of one codec"
                             % (compression, len(plan), _PLAN_MAX))
        self._codec_plan = [tuple(r) for r in plan] if len(codecs) > 1 else None
        compression = per_tensor[0] if len(codecs) == 1 else NoCompression()
        for i in infos:     # a state codec cohort lacks fails here, not in a download
            _resolve(state_compression, i, "state_compression")
        if not _is_adaptive(state_compression):
            _resolve(state_compression, None, "state_compression")
        if daemon is not True:
            raise ValueError("not supported by cohort's averager yet: daemon (the averager "
                             "runs on threads of this process; docs/architecture.md, "
                             "\"Not built yet\")")
        # The engine gives every peer one silence timeout: the tightest of
        # those given stands for all of them.
        timeouts = [x for x in (allreduce_timeout, next_chunk_timeout, sender_timeout,
                                reducer_timeout) if x is not None]
        self._silence_ms = int(min(timeouts) * 1000) if timeouts else 30000
        if self._silence_ms <= 0:
            raise ValueError("timeouts must be positive")
        if not 0 < declare_state_period <= 1800:
            raise ValueError("declare_state_period must be in (0, 1800] seconds")
        # hivemind's default: every averager that holds tensors shares.
        self._allow_sharing = (not auxiliary and not client_mode) \
            if allow_state_sharing is None else bool(allow_state_sharing)
        self._priority = 0.0
        self._declare_ms = max(1, int(declare_state_period * 1000))
        self._state_compression = state_compression
        self._tensor_infos = tensor_infos
        self._state_thread = None
        self._state_stop = threading.Event()
        self._codec = compression._codec
        self._bandwidth = None if bandwidth is None else float(bandwidth)
        self._client_mode = client_mode
        self._min_vector_size = min_vector_size
        self._min_wait_s = float(min_matchmaking_time)
        self._tensors = tensors
        self._count = sum(t.numel() for t in tensors)
        self._dht = dht
        self._prefix = prefix
        self._target = target
        self._min = int(min_group_size)
        self._bits = initial_group_bits
        self._min_wait_ms = int(min_matchmaking_time * 1000)
        self._request_ms = max(1, int(request_timeout * 1000))
        self._alpha = float(averaging_alpha)
        # The engine's segment: a multiple of 8 that holds its encoding
        # (ScaledFloat16Compression's mean and deviation from 16 bytes on,
        # the 8-bit quantizations' codebooks from 1368).
        floor = 1368 if any(isinstance(c, (Uniform8BitQuantization, Quantile8BitQuantization))
                            for c in per_tensor) else 16
        self._segment = max(floor, int(part_size_bytes) // 8 * 8)
        self._auxiliary = bool(auxiliary)
        self._shutdown_ms = max(1, int(shutdown_timeout * 1000))
        self._lock = threading.Lock()          # get_tensors() and the step's copy
        self._step_lock = threading.Lock()     # one step at a time
        self._core = None
        self._flat = torch.zeros(self._count, dtype=torch.float32)
        # The last step's (group id, attempts, {peer_id: weight}, seconds
        # of matchmaking), a cohort addition for logs and benchmarks.
        self.last_group = None
        self.last_load_error = None     # why the last load_state_from_peers got nothing
        dht._averager = self
        if start:
            self.run_in_background()

    # -- life --------------------------------------------------------------

    @property
    def peer_id(self):
        # Through a sidecar, the member is the one the sidecar named.
        core = self._core
        return core.id() if core is not None else self._dht.peer_id

    def run_in_background(self, await_ready=True, timeout=None):
        """Joins the cohort as this DHT's peer (hivemind starts a process;
        cohort's averager runs in this one, its heartbeats on a thread)."""
        if self._core is not None:
            return
        try:
            self._core = _cohort.Averager(
                self._dht.broker, self._dht.cohort, self._dht.peer_id, self._prefix, self._bits,
                self._target, self._min, self._min_wait_ms, self._request_ms, self._silence_ms,
                self._count, self._segment, _schema(self._tensors), _GATHER_MAX,
                self._shutdown_ms, self._codec, self._bandwidth, self._client_mode,
                self._min_vector_size, self._declare_ms, self._codec_plan)
        except _cohort.Error as e:
            # A refusal of the configuration (the sidecar's sentence through
            # a sidecar) is the caller's to fix; anything else is not.
            if self._dht._averager is self:
                self._dht._averager = None
            bad = e.errno in (errno.EINVAL, errno.EFBIG, errno.EMSGSIZE, errno.ENAMETOOLONG)
            raise (ValueError if bad else RuntimeError)(e.strerror) from None
        self._core.set_state_sharing(self._allow_sharing, self._priority)
        self._state_stop.clear()
        self._state_thread = threading.Thread(
            target=DecentralizedAverager._serve_state,
            args=(weakref.ref(self), self._core, self._state_stop),
            name="cohort-avg-state", daemon=True)
        self._state_thread.start()
        if await_ready:
            ms = 60000 if timeout is None else int(timeout * 1000)
            if not self._core.wait(ms):
                raise TimeoutError("the averager did not join the cohort within %d ms" % ms)

    def is_alive(self):
        return self._core is not None

    def shutdown(self):
        """Leaves the cohort."""
        core, self._core = self._core, None
        self._state_stop.set()
        if self._state_thread is not None:
            if self._state_thread is not threading.current_thread():
                self._state_thread.join()
            self._state_thread = None
        if core is not None:
            with self._step_lock:
                core.close()
        self._dht._averager = None

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass

    # -- tensors -----------------------------------------------------------

    @contextmanager
    def get_tensors(self):
        """The averaged tensors, under the lock that steps take to read
        and write them. Do not use them after the block."""
        with self._lock:
            yield self._tensors

    def get_current_state(self):
        """hivemind's hook for state sharing: (metadata, tensors, infos),
        run in this process when a peer begins to download. Override it
        to share more (optimizer state, an epoch in the metadata);
        metadata must be JSON-serialisable."""
        with self.get_tensors() as tensors:
            return None, [t.detach().cpu().clone() for t in tensors], self._tensor_infos

    def _state_codecs(self, tensors, infos):
        """The engine codec id state_compression chooses for each tensor:
        by infos (CompressionInfo per tensor) when given, else by
        from_tensor(t, key=i) as hivemind does."""
        if infos is None:
            infos = _default_infos(tensors)
        infos = list(infos)
        if len(infos) != len(tensors):
            raise ValueError("get_current_state gave %d infos for %d tensors" %
                             (len(infos), len(tensors)))
        return [_resolve(self._state_compression, i, "state_compression")._codec for i in infos]

    @staticmethod
    def _serve_state(ref, core, stop):
        """The donor's side: a snapshot whenever a download needs one. It
        holds the averager only through `ref`, so that an averager dropped
        without shutdown() is still collected (and leaves)."""
        while not stop.is_set():
            try:
                if not core.state_wanted(200):
                    continue
                self = ref()
                if self is None:
                    return
                state = self.get_current_state()
                metadata, tensors = state[0], list(state[1])
                codecs = self._state_codecs(tensors, state[2] if len(state) > 2 else None)
                # The engine's segment, at least one an 8-bit codebook fits.
                run = max(self._segment, 1368) // 4
                del self
                core.provide_state(_encode_state(metadata, tensors, codecs, run))
            except Exception as e:      # a bad override must not end the thread
                _log.warning("get_current_state failed; this donor serves no new state: %r", e)
                stop.wait(0.2)

    def load_state_from_peers(self, wait=True, timeout=None):
        """Downloads (metadata, tensors) from the donors of the highest
        state_sharing_priority among this prefix's averagers (in parallel
        parts from equal donors); None when none served a whole state
        within the timeout (default 30 s). wait=False: a
        concurrent.futures.Future of the same."""
        if self._core is None:
            raise RuntimeError("the averager is not running: start=True or run_in_background()")
        timeout_ms = 30000 if timeout is None else max(1, int(timeout * 1000))
        if not wait:
            fut = concurrent.futures.Future()

            def run():
                try:
                    fut.set_result(self._load_state(timeout_ms))
                except Exception as e:
                    fut.set_exception(e)
            threading.Thread(target=run, daemon=True).start()
            return fut
        return self._load_state(timeout_ms)

    def _load_state(self, timeout_ms):
        core = self._core
        if core is None:
            raise RuntimeError("the averager was shut down")
        blob, why = core.load_state(timeout_ms)
        if blob is None:
            _log.info("load_state_from_peers: %s", why)
            self.last_load_error = why
            return None
        try:
            return _decode_state(blob)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            # Every part matched the donors' manifest, so the donors
            # themselves sent this: nothing is loaded.
            self.last_load_error = "the donors' state does not decode: %s" % e
            _log.warning("load_state_from_peers: %s", self.last_load_error)
            return None

    @property
    def allow_state_sharing(self):
        """Whether peers may download this averager's state."""
        return self._allow_sharing

    @allow_state_sharing.setter
    def allow_state_sharing(self, value):
        self._allow_sharing = bool(value)
        if self._core is not None:
            self._core.set_state_sharing(self._allow_sharing, self._priority)

    @property
    def state_sharing_priority(self):
        """Donors of the highest priority are downloaded from first."""
        return self._priority

    @state_sharing_priority.setter
    def state_sharing_priority(self, value):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not math.isfinite(value):
            raise ValueError("state_sharing_priority must be a finite number")
        self._priority = float(value)
        if self._core is not None:
            self._core.set_state_sharing(self._allow_sharing, self._priority)

    @property
    def state_parts_served(self):
        """Parts of this averager's state served to others (a cohort
        addition, for tests and logs)."""
        return self._core.parts_served() if self._core is not None else 0

    def get_group_bits(self, wait=True):
        return self._core.bits() if self._core is not None else self._bits

    def set_group_bits(self, group_bits, wait=True):
        if not isinstance(group_bits, str):
            raise TypeError("group_bits must be a str")
        if self._core is not None:
            self._core.set_bits(group_bits)
        elif all(c in "01" for c in group_bits) and len(group_bits) <= 64:
            self._bits = group_bits
        else:
            raise ValueError("group bits must be at most 64 characters of 0 and 1")

    # -- steps -------------------------------------------------------------

    def step(self, gather=None, scheduled_time=None, weight=None, timeout=None,
             allow_retries=True, require_trigger=False, wait=True):
        """One round: on success the tensors hold the group's weighted
        average (moved by averaging_alpha) and the result maps each
        averaged peer's id to what it gathered (None for one whose bytes
        are not JSON: peers may lie); on failure None (wait=True)
        or a StepControl whose result() raises AllreduceException."""
        if scheduled_time is not None:
            if isinstance(scheduled_time, bool) or not isinstance(scheduled_time, (int, float)) \
                    or not math.isfinite(scheduled_time):
                raise TypeError("scheduled_time must be a finite time.time() value")
        if weight is None:
            weight = 1.0
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise TypeError("weight must be an int or a float")
        if not weight > 0 or weight != weight or weight == float("inf"):
            raise ValueError("weight must be strictly positive and finite")
        if self._auxiliary:
            weight = 0.0
        try:
            blob = json.dumps(gather).encode()
        except (TypeError, ValueError) as e:
            raise TypeError("gather must be JSON-serialisable: %s" % e) from None
        if len(blob) > _GATHER_MAX:
            raise ValueError("gather is %d bytes serialised; at most %d" % (len(blob), _GATHER_MAX))
        if self._core is None:
            raise RuntimeError("the averager is not running: start=True or run_in_background()")
        control = StepControl(require_trigger)
        timeout_ms = 30000 if timeout is None else max(1, int(timeout * 1000))
        scheduled = None if scheduled_time is None else float(scheduled_time)
        args = (control, float(weight), blob, timeout_ms, bool(allow_retries), scheduled)
        if not wait:
            threading.Thread(target=self._run_step, args=args, daemon=True).start()
            return control
        self._run_step(*args)
        try:
            return control.result()
        except AllreduceException:
            return None

    def _run_step(self, control, weight, blob, timeout_ms, allow_retries, scheduled=None):
        try:
            control._trigger.wait()
            if control._cancelled:
                return
            if scheduled is not None:
                # Matchmaking starts min_matchmaking_time ahead; this wait
                # is cancellable, on the clock in short naps so that a
                # cancel is seen promptly. A group that forms earlier
                # waits in the step itself until the scheduled time.
                start_at = scheduled - self._min_wait_s
                control._scheduled = True
                while not control._cancelled and time.time() < start_at:
                    time.sleep(min(0.05, max(0.0, start_at - time.time())))
                control._scheduled = False
                if control._cancelled:
                    return
            with self._step_lock:
                core = self._core
                if core is None:
                    raise AllreduceException("the averager was shut down")
                with self._lock:
                    off = 0
                    for t in self._tensors:
                        n = t.numel()
                        self._flat[off:off + n].copy_(t.detach().reshape(-1))
                        off += n
                buf = memoryview(self._flat.view(torch.uint8).numpy())
                try:
                    group, attempts, mm_ms, members = core.step(
                        buf, weight, self._alpha, blob, timeout_ms, allow_retries,
                        0 if scheduled is None else max(1, int(scheduled * 1000)))
                except _cohort.Error as e:
                    raise AllreduceException(str(e)) from None
                if weight > 0:
                    with self._lock:
                        off = 0
                        for t in self._tensors:
                            n = t.numel()
                            with torch.no_grad():
                                t.copy_(self._flat[off:off + n].view(t.shape))
                            off += n
            out = {}
            for peer, w, data in members:
                out[peer] = _gathered(peer, data)
            self.last_group = (group, attempts, {peer: w for peer, w, _ in members}, mm_ms / 1000)
            control._result = out
        except AllreduceException as e:
            control._error = e
        except Exception as e:          # reported through result(), like hivemind's futures
            control._error = AllreduceException("averaging step failed: %r" % (e,))
        finally:
            control._done.set()


def _gathered(peer, data):
    """A groupmate's gathered object, or None when it sent none or bytes
    that are not JSON (peers may lie): by then the round has succeeded and
    the tensors hold the average, so one liar's bytes must not make the
    step report a failure."""
    if not data:
        return None
    try:
        return json.loads(data.decode())
    except (ValueError, RecursionError) as e:    # UnicodeDecodeError is a ValueError
        _log.warning("step: %s gathered bytes that are not JSON (%r); it is named with None",
                     peer, e)
        return None


class _Averaging:
    """hivemind.averaging: the module name code imports the class from."""
    DecentralizedAverager = DecentralizedAverager


averaging = _Averaging()

"""cohort.hivemind's state sharing (load_state_from_peers) among real
averagers joined to a real broker with a key, with real torch tensors.

- A newcomer loads the state of the donor of the highest priority (its
  metadata and tensors exactly), never that of an averager that does not
  share, however high its priority; when that donor stops sharing or its
  priority drops, the next is used.
- Equal donors each serve a share of the parts, and the newcomer gets
  their common state exactly, also with Float16Compression.
- A donor stopped mid-download (SIGSTOP) is left for another of the same
  priority within the request timeout.
- No donor: None within the timeout, also through wait=False's future.
- Bad settings (a priority that is not finite, a declare period out of
  range, a state_compression cohort does not carry out) get clear errors.
- Every codec carries a state (float32, float64, float16, integer-valued
  floats, integers, bools) within its bound, computed here from the
  values per run as engine/codec.h states it; the 8-bit codebooks are
  checked to hold the mean of the values they stand for. Integers, and
  everything under NoCompression, come back exactly.
- The adaptive codecs choose per tensor: by size (a small tensor exact,
  a large one 8-bit), by role (get_current_state's infos), by key, and
  by the constructor's tensor_infos; for the averaged tensors they make
  a codec per tensor (test_py_hivemind_codecs.py averages with them).
  Coded states that lie (byte counts, codecs, runs, shapes) are refused
  with the reason.

tests/unit/test_avstate.c covers donors that lie (parts that do not match
their digests, manifests without the key's MAC, sizes over the cap).
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import cohort.hivemind as hivemind
from cohorttest import ROOT, bin_path, start_broker
from cohorttest.programs import write_key
from hivemind_child import state_tensors_of as state_of
from pyproc import HERE, child_env, spawn

CHILD = os.path.join(HERE, "hivemind_child.py")
PARTS = 64 << 10            # avstate's smallest part


@pytest.fixture
def keyed(tmp_path, monkeypatch):
    key = tmp_path / "key"
    write_key(key)
    monkeypatch.setenv("COHORT_SECRET_FILE", str(key))
    b = start_broker("--allow-any-cohort", "--heartbeat-interval", "250ms",
                     "--member-timeout", "30s", secret_file=key)
    made = []

    def make(peer, tensors, prefix="state/run", **kw):
        dht = hivemind.DHT(initial_peers=[b.address], start=True, cohort="hm", peer_id=peer)
        args = dict(start=True, prefix=prefix, min_matchmaking_time=5.0, request_timeout=4.0,
                    declare_state_period=5)
        args.update(kw)
        a = hivemind.DecentralizedAverager(tensors, dht, **args)
        made.append(a)
        return a

    yield b, str(key), make
    for a in made:
        a.shutdown()
    b.stop()


def eventually(fn, what, timeout=60):
    deadline = time.monotonic() + timeout
    while True:
        got = fn()
        if got:
            return got
        assert time.monotonic() < deadline, "never: " + what
        time.sleep(0.1)


def tensors_equal(got, want):
    return len(got) == len(want) and all(
        g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w) for g, w in zip(got, want))


class Epoch(hivemind.DecentralizedAverager):
    """A donor whose metadata names it, as an Optimizer's carries its epoch."""

    def get_current_state(self):
        meta, tensors, infos = super().get_current_state()
        return {"epoch": self.epoch_no, "peer": self.peer_id}, tensors, infos


def test_the_newcomer_loads_the_top_priority_donor_and_follows_changes(keyed):
    b, _, make = keyed
    low = make("low", state_of(1))
    low.state_sharing_priority = 1
    high = make("high", state_of(2))
    high.state_sharing_priority = 2
    shy = make("shy", state_of(3), allow_state_sharing=False)
    shy.state_sharing_priority = 100
    assert shy.allow_state_sharing is False and high.allow_state_sharing is True
    new = make("new", [torch.zeros(4)])

    def loaded_from(k):
        got = new.load_state_from_peers(timeout=20)
        return got is not None and tensors_equal(got[1], state_of(k))

    eventually(lambda: loaded_from(2), "the newcomer loads the priority-2 donor")
    # Once both are declared, low is not asked (it may have served a load
    # that came before high's declaration).
    low_before, high_before = low.state_parts_served, high.state_parts_served
    assert loaded_from(2)
    assert low.state_parts_served == low_before
    assert high.state_parts_served - high_before >= 3      # 200 KB in 64 KiB parts
    assert shy.state_parts_served == 0
    high.allow_state_sharing = False
    eventually(lambda: loaded_from(1), "the newcomer loads the other donor once high stops")
    high.allow_state_sharing = True
    eventually(lambda: loaded_from(2), "high shares again")
    high.state_sharing_priority = 0.5
    eventually(lambda: loaded_from(1), "high's priority dropped below low's")
    assert shy.state_parts_served == 0, "a donor that does not share is never asked"


def test_metadata_comes_from_get_current_state_in_the_donors_process(keyed):
    b, _, make = keyed
    dht = hivemind.DHT(initial_peers=[b.address], start=True, cohort="hm", peer_id="ep")
    donor = Epoch(state_of(5), dht, start=True, prefix="state/meta", min_matchmaking_time=5.0,
                  request_timeout=4.0)
    try:
        donor.epoch_no = 7
        new = make("meta-new", [torch.zeros(1)], prefix="state/meta")
        got = eventually(lambda: new.load_state_from_peers(timeout=20), "a state")
        assert got[0] == {"epoch": 7, "peer": "ep"}
        assert tensors_equal(got[1], state_of(5))
    finally:
        donor.shutdown()


@pytest.mark.parametrize("compression", [hivemind.NoCompression(),
                                         hivemind.Float16Compression()])
def test_equal_donors_each_serve_a_share_of_the_parts(keyed, compression):
    b, _, make = keyed
    want = state_of(9, n=200000)
    donors = [make("eq-%d" % k, want, prefix="state/eq", state_compression=compression)
              for k in range(3)]
    for d in donors:
        d.state_sharing_priority = 3
    new = make("eq-new", [torch.zeros(2)], prefix="state/eq")
    blob = hivemind._encode_state(None, want, [compression._codec] * len(want), 1)
    parts = (len(blob) + PARTS - 1) // PARTS
    assert parts >= 6

    def one_load_split_three_ways():
        before = [d.state_parts_served for d in donors]
        got = new.load_state_from_peers(timeout=20)
        if got is None:                 # a donor slower than the request timeout
            return False
        assert tensors_equal(got[1], want), "a load is the donors' state or nothing"
        delta = [d.state_parts_served - s for d, s in zip(donors, before)]
        # Until all three are declared a load may see fewer of them; one
        # load that sees them all splits its parts among them, each part
        # fetched once.
        return sum(delta) == parts and all(x >= 1 for x in delta)

    eventually(one_load_split_three_ways, "a load served by all three equal donors")


def test_a_stalled_donor_is_left_for_another(keyed, tmp_path):
    b, key, make = keyed
    # The child donor shares state_of(4) at priority 9 and reports when it
    # is declared; then it is stopped, its socket still accepting.
    kid = spawn([CHILD, b.address, "stalled", "donor", "4", "9"], COHORT_SECRET_FILE=key)
    try:
        line = kid.stdout.readline()
        line = line.decode() if isinstance(line, bytes) else line
        assert "ready" in line, line
        new = make("st-new", [torch.zeros(1)], prefix="test/avg")
        # Served by the child: it is declared.
        got = eventually(lambda: new.load_state_from_peers(timeout=20), "the child's state")
        assert tensors_equal(got[1], state_of(4))
        live = make("live", state_of(4), prefix="test/avg")
        live.state_sharing_priority = 9
        os.killpg(kid.pid, signal.SIGSTOP)
        # Whatever loads now came from live: the child is stopped. Its
        # manifest is waited for one request timeout (4 s) at most.
        t0 = time.monotonic()
        got = eventually(lambda: new.load_state_from_peers(timeout=20),
                         "a state while the child is stopped")
        assert tensors_equal(got[1], state_of(4))
        assert live.state_parts_served >= 1
        assert time.monotonic() - t0 < 50
    finally:
        os.killpg(kid.pid, signal.SIGKILL)
        kid.wait()


def test_no_donor_means_none_within_the_timeout(keyed):
    b, _, make = keyed
    alone = make("alone", [torch.zeros(3)], prefix="state/none")
    t0 = time.monotonic()
    assert alone.load_state_from_peers(timeout=2) is None
    assert "no averager of this prefix shares" in alone.last_load_error
    fut = alone.load_state_from_peers(wait=False, timeout=2)
    assert fut.result(timeout=60) is None
    assert time.monotonic() - t0 < 30


def test_bad_state_settings_get_clear_errors(keyed):
    b, _, make = keyed
    a = make("bad", [torch.zeros(3)], prefix="state/bad")
    with pytest.raises(ValueError, match="finite"):
        a.state_sharing_priority = float("nan")
    with pytest.raises(ValueError, match="finite"):
        a.state_sharing_priority = "high"
    dht = hivemind.DHT(initial_peers=[b.address], start=True, cohort="hm", peer_id="bad2")
    with pytest.raises(ValueError, match="declare_state_period"):
        hivemind.DecentralizedAverager([torch.zeros(3)], dht, start=False, prefix="x",
                                       declare_state_period=0)

    class Mine(hivemind.CompressionBase):
        pass

    with pytest.raises(ValueError, match="state_compression"):
        hivemind.DecentralizedAverager([torch.zeros(3)], dht, start=False, prefix="x",
                                       state_compression=Mine())


def test_the_benchmark_runs_a_tiny_load_and_refuses_bad_flags(tmp_path):
    """bench/avstate.py end to end at a tiny size (its figures belong to
    the README), and its flag checks."""
    bench = os.path.join(ROOT, "bench", "avstate.py")
    run = subprocess.run([sys.executable, bench, "--donors", "2", "--newcomers", "2", "--mib",
                          "1", "--reps", "1", "--operator", bin_path("cohort-operator"),
                          "--log-dir", str(tmp_path)], capture_output=True, text=True,
                         env=child_env(), timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    rows = [json.loads(l) for l in run.stdout.splitlines() if l.startswith("{")]
    assert [r.get("setting") for r in rows[:2]] == ["one", "equal"]
    # 1 MiB and a header: 17 parts; two newcomers load them all from the
    # top donor, or about half each from two equal ones.
    assert rows[0]["busiest_donor_parts"] == 34, rows
    assert 17 <= rows[1]["busiest_donor_parts"] < 34, rows
    assert all(r["load_ms"] > 0 for r in rows[:2])
    assert rows[2]["equal_vs_one_busiest_donor"] < 1
    bad = subprocess.run([sys.executable, bench, "--donors", "1"], capture_output=True,
                         text=True, env=child_env(), timeout=60)
    assert bad.returncode == 2 and "--donors" in bad.stderr


def test_a_state_that_does_not_decode_is_refused_with_the_reason():
    """What a donor sends is checked field by field (the parts match the
    donors' manifest, but the donors themselves may lie)."""
    import struct
    tensors = [torch.arange(6, dtype=torch.float32).reshape(2, 3), torch.tensor([True, False])]
    good = hivemind._encode_state({"epoch": 3}, tensors, [0, 0], 1)
    meta, got = hivemind._decode_state(good)
    assert meta == {"epoch": 3} and tensors_equal(got, tensors)
    half = hivemind._encode_state(None, [torch.tensor([1.5, -2.0], dtype=torch.float64)], [1], 1)
    assert hivemind._decode_state(half)[1][0].dtype == torch.float64, "float16 on the wire only"
    meta_len = struct.unpack("<I", good[4:8])[0]
    first = 12 + meta_len               # the first tensor's header
    bad = {
        "not a cohort state": b"XXXX" + good[4:],
        "cut short": good[:-1],
        "trailing bytes": good + b"\0",
        "past its end": good[:4] + struct.pack("<I", 1 << 30) + good[8:],
        "declares 1048576 tensors": good[:8 + meta_len] + struct.pack("<I", 1 << 20) + good[12 + meta_len:],
        "bad dtype": good[:first] + b"\x63" + good[first + 1:],
        "byte count": good[:first + 8 + 16] + struct.pack("<Q", 25) + good[first + 8 + 24:],
        "negative": good[:first + 8] + struct.pack("<q", -2) + good[first + 16:],
    }
    for why, blob in bad.items():
        with pytest.raises(ValueError, match=why):
            hivemind._decode_state(blob)
    with pytest.raises(TypeError, match="JSON"):
        hivemind._encode_state(object(), tensors, [0, 0], 1)


# ---- the state's codecs ---------------------------------------------------
#
# The donor encodes each floating-point tensor in runs of RUN elements
# (the engine's segment: part_size_bytes / 4), so each run carries the
# codec's own bound, computed here from the values themselves.
PART = 1 << 14
RUN = PART // 4


def runs(x):
    """(start, stop) of each encoded run of the flat float32 x."""
    return [(a, min(a + RUN, x.numel())) for a in range(0, x.numel(), RUN)]


def bound(codec, x):
    """The most each element of float32 x may move under `codec` (float64,
    with float32's rounding of the result), per engine/codec.h."""
    x = x.double()
    ax = x.abs()
    ulp = 2.0 ** -22 * ax + 1e-30
    if codec == "NoCompression":
        return torch.zeros_like(x)
    if codec == "Float16Compression":
        return 2.0 ** -11 * ax + 2.0 ** -25
    out = torch.empty_like(x)
    for a, b in runs(x):
        r = x[a:b]
        if codec == "BlockwiseQuantization":
            for c in range(a, b, 256):
                blk = x[c:min(c + 256, b)]
                out[c:c + blk.numel()] = blk.abs().max() / 127 / 2 * (1 + 2.0 ** -20)
        elif codec == "ScaledFloat16Compression":
            m = r.mean()
            s = max(((r - m) ** 2).mean().sqrt().item(), 2.0 ** -23)
            out[a:b] = 2.0 ** -11 * (r - m).abs() + 2.0 ** -25 * s + 2.0 ** -22 * (m.abs() + s)
        elif codec == "Uniform8BitQuantization":
            m = r.mean()
            h = 6 * r.std() / 256       # unbiased, as hivemind's
            # A bin's mean lies in it, so its values move at most h; the
            # two end bins also hold the values clamped into them, whose
            # pull bucket_check bounds by the bucket's span.
            inner = (r - m).abs() <= 126.4 * h
            out[a:b] = torch.where(inner, h, r.max() - r.min())
        elif codec == "Quantile8BitQuantization":
            out[a:b] = r.max() - r.min()        # refined by bucket_check
    return out + ulp


def bucket_check(codec, x, y):
    """uniform8 and quantile8 decode each value as the mean of the run's
    values that share its code: per run, at most 256 distinct results,
    each the mean of the values it stands for, those values an interval of
    the sorted run (so each error is at most its bucket's span); quantile8
    also cuts the run into about equal buckets."""
    for a, b in runs(x):
        xr, yr = x[a:b].double(), y[a:b].double()
        values = torch.unique(yr)
        assert values.numel() <= 256, "%s: %d codes in a run" % (codec, values.numel())
        last_hi = -float("inf")
        for v in values.tolist():       # ascending
            members = xr[yr == v]
            assert abs(members.mean().item() - v) <= 2.0 ** -22 * abs(v) + 1e-30, codec
            assert members.min().item() >= last_hi, "%s: buckets overlap" % codec
            last_hi = members.max().item()
            assert ((members - v).abs() <= members.max() - members.min() + 1e-30).all()
            if codec == "Quantile8BitQuantization":
                assert members.numel() <= 4 * xr.numel() / 256 + 2, "an uneven bucket"


def codec_state(seed):
    """Floats the codecs lose something of (an offset normal run, float64
    and float16 ones), integer-valued floats, and integer tensors, which
    every codec leaves as they are."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(50000, generator=g) * 3 + 10,
            (torch.randn(30, 40, generator=g, dtype=torch.float64) * 0.01),
            torch.randn(2000, generator=g).to(torch.float16),
            torch.arange(-500, 500, dtype=torch.float32).reshape(10, 100),
            torch.randint(-2 ** 40, 2 ** 40, (77,), generator=g),
            torch.tensor([True, False, True])]


CODECS = ["NoCompression", "Float16Compression", "ScaledFloat16Compression",
          "BlockwiseQuantization", "Uniform8BitQuantization", "Quantile8BitQuantization"]


def load_through(make, prefix, donor_tensors, **kw):
    """The state a newcomer loads from a donor of donor_tensors: its
    averaged tensors when all are floating-point, else what its
    get_current_state returns (a state may hold integers)."""
    floats = all(t.is_floating_point() for t in donor_tensors)
    peer = prefix.replace("/", "-")
    donor = make(peer + "-donor", donor_tensors if floats else [torch.zeros(1)],
                 prefix=prefix, part_size_bytes=PART, **kw)
    if not floats:
        donor.get_current_state = lambda: (None, donor_tensors, None)
    donor.state_sharing_priority = 1
    new = make(peer + "-new", [torch.zeros(1)], prefix=prefix)
    return eventually(lambda: new.load_state_from_peers(timeout=20), "a state")[1]


def within(codec, want, got, what):
    assert got.dtype == want.dtype and got.shape == want.shape, what
    x, y = want.reshape(-1), got.reshape(-1)
    # The codec sees float32 of the tensor; a float16 tensor rounds again.
    lim = bound(codec, x.float())
    if want.dtype == torch.float16:
        lim = lim + 2.0 ** -11 * y.double().abs()
    if want.dtype == torch.float64:
        lim = lim + 2.0 ** -23 * x.abs()
    err = (x.double() - y.double()).abs()
    worst = (err - lim).argmax()
    assert (err <= lim).all(), "%s, %s: error %g where the bound is %g" % (
        codec, what, err[worst], lim[worst])
    return err.max().item()


@pytest.mark.parametrize("codec", CODECS)
def test_each_codec_carries_the_state_within_its_bound(keyed, codec):
    b, _, make = keyed
    want = codec_state(11)
    got = load_through(make, "state/c-" + codec[:6], want,
                       state_compression=getattr(hivemind, codec)())
    assert len(got) == len(want)
    errs = [within(codec, w, g, "tensor %d" % i) for i, (w, g) in enumerate(zip(want, got))]
    assert torch.equal(got[4], want[4]) and torch.equal(got[5], want[5]), "integers as they are"
    if codec == "NoCompression":
        assert tensors_equal(got, want)
    else:
        assert errs[0] > 0, "%s changed nothing: was it applied?" % codec
    if codec in ("Uniform8BitQuantization", "Quantile8BitQuantization"):
        bucket_check(codec, want[0], got[0])


class Roles(hivemind.DecentralizedAverager):
    """A donor whose state is a parameter, its optimizer's state and a
    counter, as hivemind's TrainingStateAverager gives them."""

    def get_current_state(self):
        _, tensors, _ = super().get_current_state()
        roles = [hivemind.TensorRole.PARAMETER, hivemind.TensorRole.OPTIMIZER,
                 hivemind.TensorRole.UNSPECIFIED]
        return None, tensors, [hivemind.CompressionInfo.from_tensor(t, key=i, role=r)
                               for i, (t, r) in enumerate(zip(tensors, roles))]


def test_adaptive_codecs_choose_per_tensor_of_the_state(keyed):
    b, _, make = keyed
    g = torch.Generator().manual_seed(5)
    small, large = torch.randn(100, generator=g), torch.randn(50000, generator=g)
    size = hivemind.SizeAdaptiveCompression(1000, hivemind.NoCompression(),
                                            hivemind.Uniform8BitQuantization())
    got = load_through(make, "state/size", [small, large], state_compression=size)
    assert torch.equal(got[0], small), "under the threshold: exact"
    assert within("Uniform8BitQuantization", large, got[1], "large") > 1e-3
    bucket_check("Uniform8BitQuantization", large, got[1])

    # PerTensorCompression by the default keys, the tensors' positions.
    per = hivemind.PerTensorCompression([hivemind.ScaledFloat16Compression(),
                                         hivemind.NoCompression()])
    got = load_through(make, "state/per", [large, small], state_compression=per)
    assert within("ScaledFloat16Compression", large, got[0], "key 0") > 0
    assert torch.equal(got[1], small)

    # RoleAdaptiveCompression by the roles get_current_state gives.
    role = hivemind.RoleAdaptiveCompression(parameter=hivemind.Float16Compression(),
                                            optimizer=hivemind.BlockwiseQuantization())
    dht = hivemind.DHT(initial_peers=[b.address], start=True, cohort="hm", peer_id="roles")
    donor = Roles([large, large.clone(), small], dht, start=True, prefix="state/role",
                  min_matchmaking_time=5.0, request_timeout=4.0, part_size_bytes=PART,
                  state_compression=role)
    try:
        new = make("role-new", [torch.zeros(1)], prefix="state/role")
        got = eventually(lambda: new.load_state_from_peers(timeout=20), "a state")[1]
        e16 = within("Float16Compression", large, got[0], "parameter")
        e8 = within("BlockwiseQuantization", large, got[1], "optimizer")
        assert 0 < e16 < e8, "fp16 for the parameter, 8 bits for the optimizer's state"
        assert torch.equal(got[2], small), "unspecified: the default, NoCompression"
    finally:
        donor.shutdown()

    # tensor_infos given to the constructor are the default state's infos.
    infos = [hivemind.CompressionInfo.from_tensor(small, key="w",
                                                  role=hivemind.TensorRole.OPTIMIZER),
             hivemind.CompressionInfo.from_tensor(large, key="b")]
    got = load_through(make, "state/infos", [small, large], state_compression=role,
                       tensor_infos=infos)
    assert within("BlockwiseQuantization", small, got[0], "optimizer by tensor_infos") > 0
    assert torch.equal(got[1], large)


def test_adaptive_codecs_and_tensor_infos_are_checked(keyed):
    b, _, make = keyed
    dht = hivemind.DHT(initial_peers=[b.address], start=True, cohort="hm", peer_id="ad")
    t = [torch.zeros(10), torch.zeros(5000)]
    size = hivemind.SizeAdaptiveCompression(1000, hivemind.Float16Compression(),
                                            hivemind.Uniform8BitQuantization())

    def averager(**kw):
        return hivemind.DecentralizedAverager(t, dht, start=False, prefix="x", **kw)

    # Two codecs for the averaged tensors: a codec per tensor (a plan).
    a = averager(compression=size)
    assert a._codec_plan == [(10, hivemind.Float16Compression._codec),
                             (5000, hivemind.Uniform8BitQuantization._codec)]
    a.shutdown()
    # One codec for every averaged tensor: the averager steps in it (and
    # groups only with averagers of that codec).
    a = averager(compression=hivemind.SizeAdaptiveCompression(
        1, hivemind.NoCompression(), hivemind.Uniform8BitQuantization()))
    assert a._codec == hivemind.Uniform8BitQuantization._codec
    a.shutdown()
    with pytest.raises(ValueError, match="tensor_infos changes nothing"):
        averager(tensor_infos=[hivemind.CompressionInfo.from_tensor(x) for x in t])
    with pytest.raises(ValueError, match="one cohort.hivemind.CompressionInfo per"):
        averager(state_compression=size,
                 tensor_infos=[hivemind.CompressionInfo.from_tensor(t[0])])
    with pytest.raises(ValueError, match="no codec for tensor key 1"):
        averager(state_compression=hivemind.PerTensorCompression([hivemind.NoCompression()]))

    class Mine(hivemind.CompressionBase):
        pass

    with pytest.raises(ValueError, match="state_compression: .*not supported"):
        averager(state_compression=hivemind.SizeAdaptiveCompression(
            100, hivemind.NoCompression(), Mine()))
    with pytest.raises(TypeError):
        hivemind.SizeAdaptiveCompression(10, hivemind.NoCompression(), "int8")
    with pytest.raises(TypeError):
        hivemind.CompressionInfo("k", hivemind.TensorDescriptor((3,)), role="parameter")


def test_a_coded_state_that_does_not_decode_is_refused():
    import struct
    x = torch.randn(3000)
    good = hivemind._encode_state(None, [x], [hivemind.Uniform8BitQuantization._codec], 1000)
    got = hivemind._decode_state(good)[1][0]
    assert got.shape == x.shape and not torch.equal(got, x)
    first = 12 + struct.unpack("<I", good[4:8])[0]
    head = good[first:first + 8]
    bad = [
        ("do not hold 3000 values of uniform8", good[:first + 16] + struct.pack(
            "<Q", len(good) - first - 25) + good[first + 24:-1]),
        ("bad dtype, codec, rank or run", good[:first + 1] + b"\x02" + good[first + 2:]),
        ("bad dtype, codec, rank or run", good[:first + 4] + struct.pack("<I", 0) +
         good[first + 8:]),
        ("not floating-point", good[:first] + bytes([4]) + good[first + 1:]),
        ("larger than the state", good[:first + 8] + struct.pack("<q", 1 << 50) +
         good[first + 16:]),
    ]
    assert head[1] == 7
    for why, blob in bad:
        with pytest.raises(ValueError, match=why):
            hivemind._decode_state(blob)


def test_an_adaptive_compression_of_one_codec_steps_in_it(keyed):
    """SizeAdaptiveCompression that chooses uniform8 for every averaged
    tensor groups with a plain Uniform8BitQuantization peer (the broker
    refuses peers of different codecs) and averages in it: both end with
    the same bytes, an 8-bit distance from the exact mean."""
    b, _, make = keyed
    g = torch.Generator().manual_seed(3)
    xs = [[torch.randn(3000, generator=g), torch.randn(2000, generator=g)] for _ in range(2)]
    exact = [(xs[0][i] + xs[1][i]) / 2 for i in range(2)]
    size = hivemind.SizeAdaptiveCompression(1000, hivemind.NoCompression(),
                                            hivemind.Uniform8BitQuantization())
    kw = dict(prefix="state/step", target_group_size=2, min_matchmaking_time=1.0,
              request_timeout=0.5, allow_state_sharing=False)
    a = make("adaptive", [t.clone() for t in xs[0]], compression=size, **kw)
    u = make("uniform8", [t.clone() for t in xs[1]],
             compression=hivemind.Uniform8BitQuantization(), **kw)

    def both_step():
        ca, cu = a.step(wait=False, timeout=20), u.step(wait=False, timeout=20)
        try:
            return ca.result(timeout=60) is not None and cu.result(timeout=60) is not None
        except hivemind.AllreduceException:
            return False        # one asked before the other was up: again

    eventually(both_step, "a round of the two")
    with a.get_tensors() as ta, u.get_tensors() as tu:
        assert all(torch.equal(p, q) for p, q in zip(ta, tu)), "the same bytes"
        # Two encodings of bins 6 sigma / 256 wide (outliers clamped into
        # the end bins move further).
        err = torch.cat([(p - e).abs() for p, e in zip(ta, exact)])
        assert 0 < err.mean().item() < 0.05 and err.max().item() < 2, \
            "averaged in uniform8: %g from the exact mean at worst" % err.max().item()


def test_the_codec_binding_checks_every_length():
    from cohort import _cohort
    x = torch.randn(1000).numpy().tobytes()
    for codec in (0, 2 ** 40, -1, 4, 5, 9):
        with pytest.raises((ValueError, OverflowError)):
            _cohort.codec_encode(codec, x, 100)
    with pytest.raises(ValueError, match="at least one element"):
        _cohort.codec_encode(7, x, 0)
    with pytest.raises(ValueError, match="whole float32s"):
        _cohort.codec_encode(7, x[:-1], 100)
    enc = _cohort.codec_encode(7, x, 300)      # 3 runs of 300 and one of 100
    assert len(enc) == 3 * (1024 + 300) + 1024 + 100
    assert len(_cohort.codec_decode(7, enc, 1000, 300)) == 4000
    for count, run, blob in ((1001, 300, enc), (1000, 600, enc), (1000, 300, enc + b"\0"),
                             (-1, 300, enc), (2 ** 62, 300, enc)):
        with pytest.raises(ValueError):
            _cohort.codec_decode(7, blob, count, run)


def test_a_corrupted_coded_state_decodes_or_is_refused():
    """Any byte of a coded state flipped: a ValueError or tensors of the
    declared shapes, never another exception or a crash."""
    import random
    g = torch.Generator().manual_seed(8)
    tensors = [torch.randn(700, generator=g), torch.randn(3, 50, generator=g).double(),
               torch.arange(9)]
    codecs = [hivemind.Quantile8BitQuantization._codec, hivemind.BlockwiseQuantization._codec, 0]
    good = hivemind._encode_state({"k": [1, 2]}, tensors, codecs, 342)
    rng = random.Random(8)
    refused = 0
    for _ in range(400):
        blob = bytearray(good)
        for _ in range(rng.randint(1, 3)):
            blob[rng.randrange(len(blob))] = rng.randrange(256)
        try:
            _, got = hivemind._decode_state(bytes(blob))
        except ValueError:          # json's errors are ValueErrors too
            refused += 1
            continue
        except UnicodeDecodeError:
            refused += 1
            continue
        assert len(got) == 3 and all(isinstance(t, torch.Tensor) for t in got)
    assert refused > 0

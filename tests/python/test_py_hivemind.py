"""cohort.hivemind: hivemind's DecentralizedAverager among real processes
joined to a real broker with a key, with real torch tensors.

- The weighted average of 4 peers equals the reference exactly (integer
  values), with an auxiliary peer that contributes nothing; every peer
  gathers every groupmate's object.
- 8 peers in pairs whose group bits move after each round: after 3 rounds
  every peer holds the global mean.
- A peer stopped mid-step (then killed): the others finish without it
  and report exactly who was averaged.
- Too few peers: None from step(), AllreduceException from a control's
  result(), within the timeout.
- With Float16Compression, BlockwiseQuantization,
  Uniform8BitQuantization, Quantile8BitQuantization and
  ScaledFloat16Compression (tensors that are not integers, the last also
  around 30000, where float16's step is 16): every peer ends with the same
  bytes, within the codec's bound of the exact average; weights and
  gathered objects arrive exactly.
  Averagers of different compression are refused.
- Load balancing: clients (which contribute and reduce nothing) and
  peers of different bandwidths, one auxiliary, average exactly, alike
  to the byte, clients first in the round's order; a group where nobody
  can reduce fails with a sentence that says so.
- An auxiliary peer without tensors joins two peers with tensors (and
  reduces the largest part, by its bandwidth): they get the exact
  average, it is named with weight 0.
- scheduled_time: matchmaking starts min_matchmaking_time ahead, and the
  round ends after the scheduled time, not before.
- Group bits get and set; bad input (mismatched shapes between peers, a
  bad weight, request_timeout >= min_matchmaking_time, arguments not
  carried out yet) gets a clear error.
"""
import json
import os
import signal
import time

import subprocess
import sys

import pytest
import torch

import cohort.hivemind as hivemind
from cohorttest import ROOT, bin_path, finish, start_broker
from cohorttest.programs import write_key
from hivemind_child import coded_tensors_of, tensors_of
from pyproc import HERE, child_env, spawn

CHILD = os.path.join(HERE, "hivemind_child.py")


@pytest.fixture
def keyed(tmp_path):
    key = tmp_path / "key"
    write_key(key)
    b = start_broker("--allow-any-cohort", "--heartbeat-interval", "250ms",
                     "--member-timeout", "2s", secret_file=key)
    yield b, str(key)
    b.stop()


def child(broker, key, peer, scenario, *args):
    return spawn([CHILD, broker.address, peer, scenario, *map(str, args)],
                 COHORT_SECRET_FILE=key)


def lines_of(kid):
    rc, out, err = finish(kid)
    assert rc == 0, err[-4000:]
    return [json.loads(l) for l in out.splitlines() if l.startswith("{")]


def test_weighted_average_is_exact_with_an_auxiliary_peer_and_gather(keyed):
    broker, key = keyed
    weights = [1, 2, 3, 4, 1]
    kids = [child(broker, key, "p-%d" % k, "weighted", k, 5, weights[k], int(k == 4))
            for k in range(5)]
    got = [lines_of(k)[-1] for k in kids]
    contributors = range(4)
    total = sum(weights[k] for k in contributors)
    ref = [sum(weights[k] * tensors_of(k)[i] for k in contributors) / total for i in range(2)]
    for k, g in enumerate(got):
        assert g["gathered"] == {"p-%d" % j: {"peer": "p-%d" % j, "k": j} for j in range(5)}
        assert g["last"] == {"p-%d" % j: (weights[j] if j < 4 else 0.0) for j in range(5)}
        if k < 4:
            assert g["tensors"] == [r.tolist() for r in ref], k
        else:
            assert g["tensors"] == [t.tolist() for t in tensors_of(4)], "auxiliary: untouched"


def test_eight_peers_in_pairs_reach_the_global_mean_in_three_rounds(keyed, tmp_path):
    broker, key = keyed
    # Each round starts when all 8 reached it (a file barrier), as peers
    # that step at the same cadence do; bits k2 k1 pair k with k ^ 1.
    kids = [child(broker, key, "m-%d" % k, "mix", k, "%d%d" % ((k >> 2) & 1, (k >> 1) & 1), 3,
                  tmp_path, 8) for k in range(8)]
    got = [lines_of(k) for k in kids]
    mean = sum(8.0 * k for k in range(8)) / 8
    partners = {}
    for k, lines in enumerate(got):
        assert lines[-1]["tensors"] == [[mean] * 4], (k, lines)
        for line in lines[:-1]:
            assert line["group"] and len(line["group"]) == 2, line
            partners.setdefault(k, set()).update(line["group"])
    for k in range(8):
        assert len(partners[k]) == 4, "three different partners and itself: %s" % partners[k]


def test_a_peer_stopped_mid_step_is_left_out_and_the_result_says_who_was_averaged(tmp_path):
    key = tmp_path / "key"
    write_key(key)
    broker = start_broker("--allow-any-cohort", "--heartbeat-interval", "250ms",
                          "--member-timeout", "30s", "--log-level", "debug", secret_file=key)
    victim = None
    try:
        # The victim asks first and is stopped: every group the survivors
        # form from this bucket holds it first, so some survivor's first
        # attempt stalls on it, times out, and is retried without it.
        victim = child(broker, str(key), "v-0", "victim", 9)
        broker.wait_log("An averager asks for a group.", lambda l: l.get("id") == "v-0")
        os.killpg(victim.pid, signal.SIGSTOP)
        kids = [child(broker, str(key), "s-%d" % k, "survivor", k) for k in range(2)]
        ref = [(tensors_of(0)[i] + tensors_of(1)[i]) / 2 for i in range(2)]
        attempts = []
        for k in kids:
            g = lines_of(k)[-1]
            assert g["gathered"] == {"s-0": "s-0", "s-1": "s-1"}
            assert g["tensors"] == [r.tolist() for r in ref]
            attempts.append(g["attempts"])
        assert max(attempts) >= 2, attempts
    finally:
        if victim is not None:
            os.killpg(victim.pid, signal.SIGKILL)
            finish(victim)
        broker.stop()


def test_too_few_peers_fail_within_the_timeout(keyed, monkeypatch):
    broker, key = keyed
    monkeypatch.setenv("COHORT_SECRET_FILE", key)
    dht = hivemind.DHT(initial_peers=[broker.address], start=True, cohort="hm", peer_id="alone")
    t = torch.arange(4, dtype=torch.float32)
    a = hivemind.DecentralizedAverager([t], dht, start=True, prefix="lonely",
                                       target_group_size=4, min_group_size=2,
                                       min_matchmaking_time=0.5, request_timeout=0.2)
    try:
        t0 = time.monotonic()
        assert a.step(timeout=1.5) is None
        control = a.step(timeout=1.5, wait=False)
        with pytest.raises(hivemind.AllreduceException, match="too few"):
            control.result(timeout=60)
        assert time.monotonic() - t0 < 30
        assert t.tolist() == [0.0, 1.0, 2.0, 3.0]
        # Group bits, got and set.
        assert a.get_group_bits() == ""
        a.set_group_bits("0110")
        assert a.get_group_bits() == "0110"
        with pytest.raises(ValueError):
            a.set_group_bits("012")
        with pytest.raises(ValueError, match="strictly positive"):
            a.step(weight=-1)
        with pytest.raises(TypeError, match="scheduled_time"):
            a.step(scheduled_time="soon")
        with pytest.raises(TypeError, match="scheduled_time"):
            a.step(scheduled_time=float("nan"))
        # A step waiting for its scheduled time can still be cancelled.
        control = a.step(scheduled_time=time.time() + 120, timeout=1.5, wait=False)
        assert control.cancel()
        with pytest.raises(hivemind.AllreduceException, match="cancelled"):
            control.result(timeout=10)
    finally:
        a.shutdown()


def test_bad_constructor_arguments_get_clear_errors(keyed):
    broker, _ = keyed
    dht = hivemind.DHT(initial_peers=[broker.address], start=True, cohort="hm", peer_id="c")
    t = [torch.zeros(3)]
    with pytest.raises(ValueError, match="request_timeout"):
        hivemind.DecentralizedAverager(t, dht, start=False, prefix="x",
                                       min_matchmaking_time=1.0, request_timeout=1.0)
    class Mine(hivemind.CompressionBase):
        pass

    for bad in (dict(compression=Mine()), dict(state_compression=Mine())):
        with pytest.raises(ValueError, match="not supported"):
            hivemind.DecentralizedAverager(t, dht, start=False, prefix="x", **bad)
    with pytest.raises(TypeError):
        hivemind.DecentralizedAverager([torch.zeros(3, dtype=torch.int64)], dht, start=False,
                                       prefix="x")
    with pytest.raises(ValueError, match="only an auxiliary peer"):
        hivemind.DecentralizedAverager([], dht, start=False, prefix="x")
    with pytest.raises(ValueError, match="group's compression"):
        hivemind.DecentralizedAverager(None, dht, start=False, prefix="x", auxiliary=True,
                                       compression=hivemind.Float16Compression())
    for bad in (dict(min_vector_size=-1), dict(min_vector_size=1.5)):
        with pytest.raises(ValueError, match="min_vector_size"):
            hivemind.DecentralizedAverager(t, dht, start=False, prefix="x", **bad)
    for bad in (dict(bandwidth=-1.0), dict(bandwidth=float("inf")), dict(bandwidth=2e15)):
        with pytest.raises(ValueError, match="bandwidth"):
            hivemind.DecentralizedAverager(t, dht, start=False, prefix="x", **bad)
    with pytest.raises(TypeError, match="bandwidth"):
        hivemind.DecentralizedAverager(t, dht, start=False, prefix="x", bandwidth="fast")
    # The C averager takes the codecs only: top-k (4) and PowerSGD (5)
    # keep state per member, and 9 and 10 are no compression at all.
    from cohort import _cohort
    for bad in (4, 5, 9, 10, -1):
        with pytest.raises(Exception, match="cannot start the averager"):
            _cohort.Averager(broker.address, "hm", "c-%d" % bad, "x", "", 2, 2, 1000, 500, 1000,
                             3, 0, b"schema", 4096, 1000, bad)


def test_peers_whose_tensors_differ_are_refused_and_keep_their_tensors(keyed):
    broker, key = keyed
    g = lines_of(child(broker, key, "mm", "mismatch"))[-1]
    second, first = g["errors"]
    assert second and "schema" in second, second
    assert first and "too few" in first, first
    assert g["untouched"] == [0.0] * 5


BENCH = os.path.join(ROOT, "bench", "averager.py")


def test_the_benchmark_runs_a_tiny_round_and_refuses_bad_flags(tmp_path):
    """bench/averager.py end to end at a tiny size (its figures belong to
    the README), and its flag checks."""
    run = subprocess.run([sys.executable, BENCH, "--peers", "4", "--group", "2", "--mib", "1",
                          "--reps", "1", "--operator", bin_path("cohort-operator"),
                          "--compression", "NoCompression,Float16Compression", "--butterfly",
                          "--log-dir", str(tmp_path)], capture_output=True, text=True,
                         env=child_env(), timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    rows = [json.loads(l) for l in run.stdout.splitlines() if l.startswith("{")]
    codecs = ["NoCompression", "Float16Compression"]
    assert [r.get("system") for r in rows[:5]] == ["averager"] * 4 + ["allreduce"]
    assert [r.get("compression") for r in rows[:4]] == codecs * 2
    assert [r.get("algorithm") for r in rows[:4]] == ["ring", "ring", "butterfly", "butterfly"]
    assert all(r["ms_per_round"] > 0 and r["matchmaking_ms"] >= 0 for r in rows[:4])
    assert [r.get("compression") for r in rows[5:9]] == codecs * 2
    assert [r.get("algorithm") for r in rows[5:9]] == [None, None, "butterfly", "butterfly"]
    assert all(r["averager/allreduce"] > 0 for r in rows[5:9])
    assert [r.get("compression") for r in rows[9:11]] == codecs
    assert all(r["butterfly/ring"] > 0 for r in rows[9:11]) and len(rows) == 11
    bad = subprocess.run([sys.executable, BENCH, "--peers", "6", "--group", "4"],
                         capture_output=True, text=True, env=child_env(), timeout=60)
    assert bad.returncode == 2 and "power of two" in bad.stderr
    bad = subprocess.run([sys.executable, BENCH, "--compression", "SizeAdaptiveCompression"],
                         capture_output=True, text=True, env=child_env(), timeout=60)
    assert bad.returncode == 2 and "--compression" in bad.stderr


# Per encoding: fp16 2^-11 relative; 8-bit blockwise half a step of
# max|block| / 127. Among n peers a value is encoded at most n times (the
# n - 1 partial sums and the result), each partial sum of the average at
# most max|x| in magnitude.
@pytest.mark.parametrize("codec,per_encoding", [("Float16Compression", 2.0 ** -11),
                                                ("BlockwiseQuantization", 1 / 254)])
def test_compressed_rounds_are_alike_everywhere_within_the_codec_bound(keyed, codec,
                                                                        per_encoding):
    broker, key = keyed
    n, weights = 3, [1.0, 2.5, 0.7]
    kids = [child(broker, key, "z-%d" % k, "coded", k, n, codec, weights[k]) for k in range(n)]
    got = [lines_of(k)[-1] for k in kids]
    total = sum(weights)
    ins = [coded_tensors_of(k) for k in range(n)]
    maxabs = max(float(t.abs().max()) for ts in ins for t in ts)
    for i in range(2):
        ref = sum(weights[k] * ins[k][i].double() for k in range(n)) / total
        res = torch.tensor(got[0]["tensors"][i], dtype=torch.float64)
        err = float((res - ref).abs().max())
        assert err <= (n + 1) * per_encoding * maxabs, (codec, i, err)
        assert err > 0, "the result equals the exact average: was the codec applied?"
    for g in got:
        assert g["raw"] == got[0]["raw"], "peers ended with different bytes"
        # Weights travel as float32, as without compression, and exactly.
        assert g["last"] == {"z-%d" % j: float(torch.tensor(weights[j], dtype=torch.float32))
                             for j in range(n)}, "weights exact"
        assert g["gathered"] == {"z-%d" % j: {"peer": "z-%d" % j, "k": j} for j in range(n)}


# ScaledFloat16Compression encodes each run (a ring segment, one per hop)
# as float16 of (x - mean) / deviation: per encoding at most 2^-11 of a
# value's distance from its run's mean, which is at most twice the largest
# distance D of an input from the common offset (every value of a run is
# the same members' partial sum), plus float32's rounding of values near
# the offset. Far from zero that is much tighter than float16, whose step
# at 30000 is 16.
@pytest.mark.parametrize("offset", [0.0, 30000.0])
def test_scaled_float16_rounds_are_alike_everywhere_within_its_bound(keyed, offset):
    broker, key = keyed
    n, weights = 3, [1.0, 2.5, 0.7]
    kids = [child(broker, key, "s-%d" % k, "coded", k, n, "ScaledFloat16Compression",
                  weights[k], offset) for k in range(n)]
    got = [lines_of(k)[-1] for k in kids]
    total = sum(weights)
    ins = [[t.double() + offset for t in coded_tensors_of(k)] for k in range(n)]
    dist = max(float((t - offset).abs().max()) for ts in ins for t in ts)
    bound = (n + 1) * (2.0 ** -10 * dist + 2.0 ** -23 * (offset + dist))
    assert bound < 1, "tighter than float16's half step at the offset"
    for i in range(2):
        ref = sum(weights[k] * ins[k][i] for k in range(n)) / total
        res = torch.tensor(got[0]["tensors"][i], dtype=torch.float64)
        err = float((res - ref).abs().max())
        assert err <= bound, (offset, i, err, bound)
        assert err > 2.0 ** -20 * dist, "the result equals the exact average: was the codec applied?"
    for g in got:
        assert g["raw"] == got[0]["raw"], "peers ended with different bytes"
        assert g["last"] == {"s-%d" % j: float(torch.tensor(weights[j], dtype=torch.float32))
                             for j in range(n)}, "weights exact"


# Uniform8BitQuantization: within 3 sigma of a run's mean a value errs by
# at most a bin's width, 6 sigma / 256, per encoding; the few outliers
# clamped into the end bins by more. Every partial sum of the weighted
# average has sigma at most the largest input's (a convex combination's
# spread is at most its parts' largest), so the mean error over all values
# stays within (n + 1) bins of that sigma, and every value within the
# range of the inputs (a codebook entry is a mean of a run's values).
# Quantile8BitQuantization: a value errs by at most the span of its
# bucket, and the spans of a run's 256 buckets, each about a 256th of its
# values, add up to its range: over all values the mean error per
# encoding is about range / 256 (twice that allowed for buckets of unequal
# counts), the range of a partial sum at most the largest input's.
@pytest.mark.parametrize("codec", ["Uniform8BitQuantization", "Quantile8BitQuantization"])
def test_8bit_quantized_rounds_are_alike_everywhere_within_their_bound(keyed, codec):
    broker, key = keyed
    n, weights = 3, [1.0, 2.5, 0.7]
    tag = codec[0].lower()
    kids = [child(broker, key, "%s-%d" % (tag, k), "coded", k, n, codec, weights[k])
            for k in range(n)]
    got = [lines_of(k)[-1] for k in kids]
    total = sum(weights)
    ins = [[t.double() for t in coded_tensors_of(k)] for k in range(n)]
    flat = [torch.cat([t.reshape(-1) for t in ts]) for ts in ins]
    sigma = max(float(f.std()) for f in flat)
    maxabs = max(float(f.abs().max()) for f in flat)
    ref = sum(weights[k] * flat[k] for k in range(n)) / total
    res = torch.cat([torch.tensor(t, dtype=torch.float64).reshape(-1)
                     for t in got[0]["tensors"]])
    err = (res - ref).abs()
    if codec == "Uniform8BitQuantization":
        assert float(err.mean()) <= (n + 1) * 6 * sigma / 256, (float(err.mean()), sigma)
    else:
        spread = max(float(f.max() - f.min()) for f in flat)
        assert float(err.mean()) <= (n + 1) * 2 * spread / 256, (float(err.mean()), spread)
    assert float(err.max()) <= 2 * maxabs, float(err.max())
    assert float(err.max()) > 0, "the result equals the exact average: was the codec applied?"
    for g in got:
        assert g["raw"] == got[0]["raw"], "peers ended with different bytes"
        assert g["last"] == {"%s-%d" % (tag, j): float(torch.tensor(weights[j],
                                                                    dtype=torch.float32))
                             for j in range(n)}, "weights exact"
        assert g["gathered"] == {"%s-%d" % (tag, j): {"peer": "%s-%d" % (tag, j), "k": j}
                                 for j in range(n)}


def test_averagers_of_different_compression_are_refused(keyed):
    broker, key = keyed
    g = lines_of(child(broker, key, "cm", "codec_mismatch"))[-1]
    refused = [e for e in g["errors"] if e and "compression" in e]
    assert len(refused) == 1, g["errors"]
    other = [e for e in g["errors"] if e is not refused[0]][0]
    assert other and "too few" in other, other
    assert g["untouched"] == [[1.0] * 4, [1.0] * 4]


def test_clients_and_bandwidths_average_exactly_and_alike(keyed):
    """Five processes: two clients (weights 1 and 2), peers of bandwidth
    3 and unset (weights 3 and 4), and an auxiliary peer of bandwidth 1:
    the contributors' tensors are the exact weighted average, the same
    bytes everywhere, and the round lists the clients first."""
    broker, key = keyed
    spec = [  # weight, aux, bandwidth, client
        (3, 0, "3", 0), (4, 0, "none", 0), (0, 1, "1", 0), (1, 0, "none", 1), (2, 0, "5", 1)]
    kids = [child(broker, key, "p-%d" % k, "balanced", k, 5, w if w else 1, aux, bw, cl)
            for k, (w, aux, bw, cl) in enumerate(spec)]
    got = [lines_of(k)[-1] for k in kids]
    weights = [w for w, _, _, _ in spec]
    total = sum(weights)
    ref = [sum(weights[k] * tensors_of(k)[i] for k in range(5)) / total for i in range(2)]
    raws = set()
    for k, g in enumerate(got):
        assert g["error"] is None, (k, g["error"])
        assert g["gathered"] == {"p-%d" % j: "p-%d" % j for j in range(5)}
        assert g["order"] == ["p-3", "p-4", "p-0", "p-1", "p-2"], g["order"]
        if k == 2:
            assert g["tensors"] == [t.tolist() for t in tensors_of(2)], "auxiliary: untouched"
        else:
            assert g["tensors"] == [r.tolist() for r in ref], k
            raws.add(g["raw"])
    assert len(raws) == 1, "every contributor holds the same bytes"


# Each codec on the butterfly: every contribution is encoded once and
# each part's result once, so a value carries two encodings' error, each
# within the codec's bound for values at most max|x| (every contribution
# is (w / total) x). fp16: 2^-11 relative; meanstd16: 2^-11 of the
# distance from the run's mean (at most 2 max|x|); blockwise int8: half
# of max|block| / 127; the 8-bit quantizations: a value within the range
# of what was encoded, and on the mean as test_8bit_quantized_* says.
@pytest.mark.parametrize("codec", ["Float16Compression", "ScaledFloat16Compression",
                                   "BlockwiseQuantization", "Uniform8BitQuantization",
                                   "Quantile8BitQuantization"])
def test_clients_and_bandwidths_with_a_codec_are_alike_within_its_bound(keyed, codec):
    """Four processes: a client (weight 1), peers of bandwidth 3 and unset
    (weights 2 and 3), and an auxiliary peer of bandwidth 1: every
    contributor ends with the same bytes, within the codec's bound of the
    exact average, and the weights and gathered objects are exact."""
    broker, key = keyed
    spec = [(2, 0, "3", 0), (3, 0, "none", 0), (0, 1, "1", 0), (1, 0, "none", 1)]
    kids = [child(broker, key, "q-%d" % k, "coded_balanced", k, 4, codec, w if w else 1, aux,
                  bw, cl) for k, (w, aux, bw, cl) in enumerate(spec)]
    got = [lines_of(k)[-1] for k in kids]
    weights = [w for w, _, _, _ in spec]
    total = sum(weights)
    ins = [[t.double() for t in coded_tensors_of(k)] for k in range(4)]
    flat = [torch.cat([t.reshape(-1) for t in ts]) for ts in ins]
    maxabs = max(float(f.abs().max()) for f in flat)
    ref = sum(weights[k] * flat[k] for k in range(4)) / total
    raws = set()
    for k, g in enumerate(got):
        assert g["gathered"] == {"q-%d" % j: "q-%d" % j for j in range(4)}, k
        assert g["order"] == ["q-3", "q-0", "q-1", "q-2"], g["order"]
        assert g["last"] == {"q-%d" % j: float(weights[j]) for j in range(4)}, "weights exact"
        if k == 2:
            assert g["tensors"] == [t.tolist() for t in coded_tensors_of(2)], "aux: untouched"
            continue
        raws.add(g["raw"])
    assert len(raws) == 1, "every contributor holds the same bytes"
    res = torch.cat([torch.tensor(t, dtype=torch.float64).reshape(-1)
                     for t in got[0]["tensors"]])
    err = (res - ref).abs()
    bound = {"Float16Compression": 2 * 2.0 ** -11 * maxabs,
             "ScaledFloat16Compression": 2 * 2.0 ** -10 * maxabs,
             "BlockwiseQuantization": 2 * maxabs / 254}.get(codec, 2 * maxabs)
    assert float(err.max()) <= bound * 1.01 + 1e-6, (float(err.max()), bound)
    if codec == "Uniform8BitQuantization":
        sigma = max(float(f.std()) for f in flat)
        assert float(err.mean()) <= 2 * 6 * sigma / 256, (float(err.mean()), sigma)
    elif codec == "Quantile8BitQuantization":
        spread = max(float(f.max() - f.min()) for f in flat)
        assert float(err.mean()) <= 2 * 2 * spread / 256, (float(err.mean()), spread)
    assert float(err.max()) > 0, "the result equals the exact average: was the codec applied?"


def test_a_group_where_nobody_can_reduce_fails_clearly(keyed):
    broker, key = keyed
    kids = [child(broker, key, "z-0", "balanced", 0, 2, 1, 0, "none", 1),
            child(broker, key, "z-1", "balanced", 1, 2, 1, 0, "0", 0)]
    for k, kid in enumerate(kids):
        g = lines_of(kid)[-1]
        assert g["gathered"] is None
        assert "no member of the group can reduce" in g["error"], g["error"]
        assert g["tensors"] == [t.tolist() for t in tensors_of(k)], "untouched"


def test_a_scheduled_step_averages_at_its_time(keyed, tmp_path):
    """Both peers schedule the round 3 s ahead once both are ready:
    matchmaking starts min_matchmaking_time (1 s) before, the pair forms
    at once, and the round ends after the scheduled time, not before."""
    broker, key = keyed
    kids = [child(broker, key, "t-%d" % k, "scheduled", k, tmp_path) for k in range(2)]
    ref = [(tensors_of(0)[i] + tensors_of(1)[i]) / 2 for i in range(2)]
    for kid in kids:
        g = lines_of(kid)[-1]
        assert g["gathered"] == {"t-0": "t-0", "t-1": "t-1"}
        assert g["tensors"] == [r.tolist() for r in ref]
        assert g["ended"] >= g["when"], g
        # Matchmaking waited for nobody: both asked at about when - 1 s.
        assert g["matchmaking"] < 1.5, g


def test_an_auxiliary_peer_without_tensors_helps_average(keyed):
    broker, key = keyed
    bare = child(broker, key, "a-0", "bare", 3, 6)
    kids = [child(broker, key, "a-%d" % k, "balanced", k, 3, k, 0, "1", 0, "test/bare")
            for k in (1, 2)]
    ref = [(1 * tensors_of(1)[i] + 2 * tensors_of(2)[i]) / 3 for i in range(2)]
    for kid in kids:
        g = lines_of(kid)[-1]
        assert g["error"] is None, g["error"]
        assert g["gathered"] == {"a-0": "a-0", "a-1": "a-1", "a-2": "a-2"}
        assert g["tensors"] == [r.tolist() for r in ref]
    g = lines_of(bare)[-1]
    assert g["tensors"] == []
    assert g["last"] == {"a-0": 0.0, "a-1": 1.0, "a-2": 2.0}


def test_a_groupmate_whose_gathered_bytes_are_not_json_is_named_with_none(keyed, monkeypatch):
    """Peers may lie, gathered bytes included: a groupmate whose bytes do
    not decode as JSON (here a core step given raw bytes, as a peer of
    another library could send) is named in the result with None. The
    round itself succeeded and the tensors hold the average, so the step
    reports it rather than failing after it changed them."""
    import threading
    broker, key = keyed
    monkeypatch.setenv("COHORT_SECRET_FILE", key)
    peers = []
    for name in ("honest", "liar"):
        dht = hivemind.DHT(initial_peers=[broker.address], start=True, cohort="hm-gather",
                           peer_id=name)
        t = torch.full((4,), 2.0 if name == "honest" else 4.0)
        peers.append((t, hivemind.DecentralizedAverager(
            [t], dht, start=True, prefix="gather-json", target_group_size=2,
            min_group_size=2, min_matchmaking_time=0.5, request_timeout=0.2)))
    (t0, honest), (t1, liar) = peers
    got = {}

    def lie():
        buf = memoryview(liar._flat.copy_(t1).view(torch.uint8).numpy())
        got["liar"] = liar._core.step(buf, 1.0, 1.0, b"{not json", 30000, True)

    try:
        th = threading.Thread(target=lie)
        th.start()
        control = honest.step(gather={"batch": 32}, timeout=30, wait=False)
        result = control.result(timeout=60)
        th.join(60)
        assert result == {"honest": {"batch": 32}, "liar": None}, result
        assert t0.tolist() == [3.0] * 4
        assert got["liar"][3] and {m[0] for m in got["liar"][3]} == {"honest", "liar"}
    finally:
        honest.shutdown()
        liar.shutdown()

"""cohort.hivemind's adaptive codecs on the averaged tensors: a codec per
tensor, chosen from its CompressionInfo as hivemind does, among real
averagers joined to a real broker with a key, with real torch tensors.

- SizeAdaptiveCompression(threshold, NoCompression(), Float16Compression())
  over a small and a large tensor: the small one is averaged exactly, the
  large one within float16's bound (and to values float16 holds), and
  both peers end with the same bytes. The same for PerTensorCompression
  by key and RoleAdaptiveCompression by the roles of tensor_infos.
- Peers whose codecs choose differently for the same tensors never
  group: one is refused with a sentence naming the compression, and
  neither's tensors change.
- One codec for every tensor is that codec: such a peer averages with a
  peer given the codec itself.
- A choice that alternates codecs more than 256 times along the tensors
  is refused with a ValueError.
- An auxiliary peer without tensors (auxiliary=True) beside two peers
  with SizeAdaptiveCompression: the three group, the auxiliary learns the
  plan in the step's first call and helps reduce, every result names it,
  and the two are averaged as above.

tests/unit/test_avplan.c covers the C side: the layout, the failed last
call that changes nothing, bad plans, an auxiliary peer and a member that
lies about the plan; test_avlink.c the plan through a
sidecar; test_py_hivemind_sidecar.py an adaptive codec through one.
"""
import concurrent.futures

import pytest
import torch

import cohort.hivemind as hivemind
from cohorttest import start_broker
from cohorttest.programs import write_key

SMALL, LARGE = 10, 3000
THRESHOLD = 1000


@pytest.fixture
def make(tmp_path, monkeypatch):
    key = tmp_path / "key"
    write_key(key)
    monkeypatch.setenv("COHORT_SECRET_FILE", str(key))
    b = start_broker("--allow-any-cohort", "--heartbeat-interval", "250ms",
                     "--member-timeout", "30s", secret_file=key)
    made = []

    def make_(peer, tensors, prefix, **kw):
        dht = hivemind.DHT(initial_peers=[b.address], start=True, cohort="hm", peer_id=peer)
        args = dict(start=True, prefix=prefix, target_group_size=2, min_group_size=2,
                    min_matchmaking_time=1.0, request_timeout=0.5, allreduce_timeout=10.0)
        args.update(kw)
        a = hivemind.DecentralizedAverager(tensors, dht, **args)
        made.append(a)
        return a

    yield make_
    for a in made:
        a.shutdown()
    b.stop()


def tensors_of(k):
    """A small integer-valued tensor (exact under NoCompression) and a
    large one of values no float16 holds."""
    g = torch.Generator().manual_seed(77 + k)
    return [torch.arange(SMALL, dtype=torch.float32) * (k + 2) - 7 * k,
            torch.randn(LARGE, generator=g) * (3.1 + k)]


def step_both(averagers, weights, timeout=60):
    """Steps every averager at once; their results (None on failure)."""
    with concurrent.futures.ThreadPoolExecutor(len(averagers)) as pool:
        futures = [pool.submit(a.step, weight=w, timeout=timeout)
                   for a, w in zip(averagers, weights)]
        return [f.result() for f in futures]


def contents(a):
    with a.get_tensors() as t:
        return [x.clone() for x in t]


def check_small_exact_large_fp16(averagers, weights, members=2):
    total = sum(weights)
    ins = [tensors_of(k) for k in range(len(averagers))]
    got = [contents(a) for a in averagers]
    raw = [b"".join(x.numpy().tobytes() for x in g) for g in got]
    assert raw[1] == raw[0], "the peers ended with different bytes"
    small = sum(w * t[0].double() for w, t in zip(weights, ins)) / total
    assert torch.equal(got[0][0], small.float()), (got[0][0], small)
    large = sum(w * t[1].double() for w, t in zip(weights, ins)) / total
    maxabs = max(float(t[1].abs().max()) for t in ins)
    err = float((got[0][1].double() - large).abs().max())
    # Two members: a contribution's encoding and the result's, 2^-11 each;
    # among more, one more per member, with room for float32's rounding.
    assert 0 < err <= (members + 1) * 2.0 ** -11 * maxabs, (err, maxabs)
    assert torch.equal(got[0][1].half().float(), got[0][1]), "values float16 holds"


def test_size_adaptive_averages_the_small_tensor_exactly_and_the_large_in_fp16(make):
    size = hivemind.SizeAdaptiveCompression(THRESHOLD, less=hivemind.NoCompression(),
                                            greater_equal=hivemind.Float16Compression())
    avs = [make("sz-%d" % k, tensors_of(k), "codecs/size", compression=size)
           for k in range(2)]
    assert avs[0]._codec_plan == [(SMALL, 0), (LARGE, 1)]
    got = step_both(avs, [1, 3])
    assert all(g is not None for g in got), got
    check_small_exact_large_fp16(avs, [1, 3])


def test_an_auxiliary_peer_helps_peers_with_a_codec_plan(make):
    size = hivemind.SizeAdaptiveCompression(THRESHOLD, less=hivemind.NoCompression(),
                                            greater_equal=hivemind.Float16Compression())
    avs = [make("xa-%d" % k, tensors_of(k), "codecs/aux", compression=size,
                target_group_size=3, min_group_size=3) for k in range(2)]
    aux = make("xa-aux", None, "codecs/aux", auxiliary=True, target_group_size=3,
               min_group_size=3)
    assert avs[0]._codec_plan == [(SMALL, 0), (LARGE, 1)]
    got = step_both(avs + [aux], [1, 3, 1])
    assert all(g is not None for g in got), got
    for g in got:
        assert set(g) == {"xa-0", "xa-1", "xa-aux"}, g
    with aux.get_tensors() as t:
        assert list(t) == []
    check_small_exact_large_fp16(avs, [1, 3], members=3)


@pytest.mark.parametrize("kind", ["per_tensor", "role"])
def test_per_tensor_and_role_adaptive_codecs_choose_per_tensor(make, kind):
    if kind == "per_tensor":
        kw = dict(compression=hivemind.PerTensorCompression(
            [hivemind.NoCompression(), hivemind.Float16Compression()]))
    else:
        role = hivemind.RoleAdaptiveCompression(parameter=hivemind.Float16Compression())
        kw = dict(compression=role)
    avs = []
    for k in range(2):
        ts = tensors_of(k)
        if kind == "role":
            kw["tensor_infos"] = [
                hivemind.CompressionInfo.from_tensor(ts[0], key=0,
                                                     role=hivemind.TensorRole.OPTIMIZER),
                hivemind.CompressionInfo.from_tensor(ts[1], key=1,
                                                     role=hivemind.TensorRole.PARAMETER)]
        avs.append(make("%s-%d" % (kind, k), ts, "codecs/" + kind, **kw))
    got = step_both(avs, [2, 5])
    assert all(g is not None for g in got), got
    check_small_exact_large_fp16(avs, [2, 5])


def test_peers_whose_codecs_choose_differently_never_group(make):
    a = make("df-a", tensors_of(0), "codecs/diff", compression=hivemind.PerTensorCompression(
        [hivemind.NoCompression(), hivemind.Float16Compression()]))
    b = make("df-b", tensors_of(1), "codecs/diff", compression=hivemind.PerTensorCompression(
        [hivemind.Float16Compression(), hivemind.NoCompression()]))
    before = [contents(a), contents(b)]
    controls = [x.step(weight=1, timeout=4, wait=False) for x in (a, b)]
    errors = []
    for c in controls:
        with pytest.raises(hivemind.AllreduceException) as e:
            c.result(timeout=30)
        errors.append(str(e.value))
    refused = [e for e in errors if "compression" in e]
    assert len(refused) == 1, errors
    assert "codec plan" in refused[0], refused[0]
    for x, was in zip((a, b), before):
        assert all(torch.equal(p, q) for p, q in zip(contents(x), was)), "tensors changed"


def test_one_codec_for_every_tensor_is_that_codec(make):
    size = hivemind.SizeAdaptiveCompression(1, less=hivemind.NoCompression(),
                                            greater_equal=hivemind.Float16Compression())
    a = make("one-a", tensors_of(0), "codecs/one", compression=size)
    b = make("one-b", tensors_of(1), "codecs/one", compression=hivemind.Float16Compression())
    assert a._codec_plan is None and a._codec == hivemind.Float16Compression._codec
    got = step_both([a, b], [1, 1])
    assert all(g is not None for g in got), got
    ca, cb = contents(a), contents(b)
    assert all(torch.equal(x, y) for x, y in zip(ca, cb))
    exact = (tensors_of(0)[1].double() + tensors_of(1)[1].double()) / 2
    assert float((ca[1].double() - exact).abs().max()) > 0, "was float16 applied?"
    assert torch.equal(ca[1].half().float(), ca[1]), "values float16 holds"


def test_a_choice_that_alternates_too_often_is_refused(make):
    """257 runs of one codec along the tensors: more than the averager
    takes, refused before anything joins; 256 are taken."""
    dht = hivemind.DHT(initial_peers=["127.0.0.1:1"], start=True, cohort="hm", peer_id="alt")
    codecs = [hivemind.NoCompression(), hivemind.Float16Compression()]

    def averager(n):
        return hivemind.DecentralizedAverager(
            [torch.zeros(2) for _ in range(n)], dht, start=False, prefix="codecs/alt",
            compression=hivemind.PerTensorCompression([codecs[i % 2] for i in range(n)]))

    with pytest.raises(ValueError, match="at most 256 runs"):
        averager(257)
    a = averager(256)
    assert len(a._codec_plan) == 256
    a.shutdown()

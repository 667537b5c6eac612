"""Compression with real torch: two trainers, each a node in its own
process, reduce 400 KB of float32 gradients with every codec
(Accumulator.set_compression). Both members get the same bytes; the
error is within the codec's bound; the result is a value of the codec
(so the setting reached the engine: the uncompressed average is not);
and members that ask for different codecs get the uncompressed result.
A sidecar's --compression is the default a trainer that asks for nothing
gets. Top-k and PowerSGD (with error feedback) the same ways, in process
and through a sidecar.
"""
import pytest

from cohorttest import DEADLINE, Proc, bin_path
from pyproc import run_pair, sidecar_pair


# Each member's gradient is encoded once on its way and the average once
# more at the end: relative 2^-11 (fp16) or 2^-8 (bf16) of what is
# encoded each time; int8, half a step (max|block| / 127) of a partial
# sum (up to twice the largest gradient), then of the average.
BOUND = {"fp16": 2 * 2.0 ** -11, "bf16": 2 * 2.0 ** -8, "int8": 1.5 * 2 / 127}


def test_every_codec_identical_bytes_within_bounds(broker):
    rounds = run_pair("compression_child.py", lambda i: broker.address)
    assert [r["case"] for r in rounds[0]] == ["none", "fp16", "bf16", "int8", "mixed"]
    by = {r["case"]: r for r in rounds[0]}
    assert by["none"]["uncompressed"] and by["none"]["max_err"] < 1e-5 * by["none"]["max_abs"]
    for codec, bound in BOUND.items():
        r = by[codec]
        assert not r["uncompressed"], r                     # the codec was applied
        assert r["max_err"] <= bound * r["max_abs"], r
    assert by["fp16"]["representable"]["fp16"] and by["bf16"]["representable"]["bf16"]
    # Members that disagree reduce uncompressed: always correct.
    assert by["mixed"]["uncompressed"], by["mixed"]


def test_the_sidecars_compression_is_the_default(broker, tmp_path):
    with sidecar_pair(broker, tmp_path, "comp", "--compression", "fp16") as (address_of,
                                                                            sidecars):
        got = run_pair("compression_child.py", address_of, "default")[0][0]
    assert got["case"] == "default"
    assert not got["uncompressed"] and got["representable"]["fp16"], got
    assert got["max_err"] <= BOUND["fp16"] * got["max_abs"], got
    for s in sidecars:
        assert s.last("Waiting for the trainer.")["compression"] == "fp16"


def test_sidecar_refuses_a_bad_compression():
    for flags, needle in ((["--compression", "int4"], "bad --compression"),
                          (["--compression", "fp16"], "need --socket")):
        p = Proc([bin_path("cohort-sidecar"), "--broker", "127.0.0.1:1", "--cohort", "c",
                  "--id", "a", *flags], "bad")
        assert p.p.wait(timeout=DEADLINE) == 2
        p.stop()
        assert any(needle in l for l in p.raw), (flags, p.raw)


def cases_of(address_of, cases):
    """Each case's round, as member 0 saw it (run_pair checks that member 1
    saw the same bytes)."""
    return {r["case"]: r for r in run_pair("compression_child.py", address_of, cases)[0]}


N = 100003


def test_topk_and_powersgd_in_process(broker):
    by = cases_of(lambda i: broker.address, "topk:0.01,powersgd:2,mixedk,topk:1")
    k = -(-N // 100)                                        # ceil(0.01 N) per member
    topk = by["topk:0.01"]
    assert not topk["uncompressed"] and 0 < topk["nonzero"] <= 2 * k, topk
    psgd = by["powersgd:2"]
    assert not psgd["uncompressed"] and psgd["nonzero"] > 2 * k, psgd
    # A smooth gradient is close to low rank: rank 2 keeps most of it.
    assert psgd["rel_err"] < 0.5, psgd
    # Members that differ in the ratio run uncompressed.
    assert by["mixedk"]["uncompressed"], by["mixedk"]
    # A ratio of 1 sends everything: the mean, up to the order of the adds
    # (and what the earlier rounds left in the residuals).
    assert by["topk:1"]["nonzero"] > N - 10, by["topk:1"]


def test_the_sidecars_topk_is_the_default(broker, tmp_path):
    with sidecar_pair(broker, tmp_path, "comp", "--compression", "topk:0.05") as (address_of,
                                                                                 sidecars):
        by = cases_of(address_of, "default,powersgd:4")
    k = -(-N * 5 // 100)
    assert not by["default"]["uncompressed"] and by["default"]["nonzero"] <= 2 * k, by["default"]
    assert not by["powersgd:4"]["uncompressed"], by["powersgd:4"]
    for s in sidecars:
        assert s.last("Waiting for the trainer.")["compression"] == "topk:0.05"


@pytest.mark.parametrize("text", ["topk:0", "topk:1.5", "topk:0.0000001", "topk:",
                                  "powersgd:0", "powersgd:1025", "powersgd:2.5", "int8:1", "zip"])
def test_sidecar_refuses_a_bad_topk_or_powersgd(text):
    p = Proc([bin_path("cohort-sidecar"), "--broker", "127.0.0.1:1", "--cohort", "c",
              "--id", "a", "--compression", text], "bad")
    assert p.p.wait(timeout=DEADLINE) == 2
    p.stop()
    assert any("bad --compression" in l and "powersgd:RANK" in l for l in p.raw), (text, p.raw)


def test_accumulator_refuses_a_bad_compression():
    import torch
    import cohort
    acc = cohort.Accumulator("comp", [torch.nn.Parameter(torch.zeros(4))])
    try:
        for text in ("topk:0", "topk:2", "topk:0.1234567", "powersgd:0", "powersgd:x",
                     "fp16:1", "zip", 4):
            with pytest.raises(ValueError):
                acc.set_compression(text)
    finally:
        acc.close()

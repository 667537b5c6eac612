"""Compression with real torch: two trainers, each a node in its own
process, reduce 400 KB of float32 gradients with every codec
(Accumulator.set_compression). Both members get the same bytes; the
error is within the codec's bound; the result is a value of the codec
(so the setting reached the engine: the uncompressed average is not);
and members that ask for different codecs get the uncompressed result.
A sidecar's --compression is the default a trainer that asks for nothing
gets.
"""
import json
import os

import pytest

from cohorttest import DEADLINE, Proc, bin_path, finish, start_broker
from pyproc import HERE, spawn


@pytest.fixture
def broker():
    b = start_broker("--allow-any-cohort", "--heartbeat-interval", "250ms",
                     "--member-timeout", "2s")
    yield b
    b.stop()


# Each member's gradient is encoded once on its way and the average once
# more at the end: relative 2^-11 (fp16) or 2^-8 (bf16) of what is
# encoded each time; int8, half a step (max|block| / 127) of a partial
# sum (up to twice the largest gradient), then of the average.
BOUND = {"fp16": 2 * 2.0 ** -11, "bf16": 2 * 2.0 ** -8, "int8": 1.5 * 2 / 127}


def test_every_codec_identical_bytes_within_bounds(broker):
    kids = [spawn([os.path.join(HERE, "compression_child.py"), broker.address, str(i)])
            for i in range(2)]
    results = [finish(k) for k in kids]
    rounds = []
    for rc, out, err in results:
        assert rc == 0, err[-3000:]
        lines = out.strip().splitlines()
        assert lines[-1] == "ok", out
        rounds.append([json.loads(l) for l in lines[:-1]])
    assert [r["case"] for r in rounds[0]] == ["none", "fp16", "bf16", "int8", "mixed"]
    for a, b in zip(*rounds):
        assert a["digest"] == b["digest"], (a, b)          # identical on both members
        assert a["num_gradients"] == 2, a                   # both contributed
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
    sidecars, kids = [], []
    try:
        for i in range(2):
            sock = str(tmp_path / ("s%d.sock" % i))
            sidecars.append(Proc([bin_path("cohort-sidecar"), "--broker", broker.address,
                                  "--cohort", "comp", "--id", "m%d" % i, "--socket", sock,
                                  "--log-format", "json", "--heartbeat-interval", "250ms",
                                  "--member-timeout", "2s", "--compression", "fp16"],
                                 "m%d" % i))
            sidecars[-1].wait_log("Waiting for the trainer.")
            kids.append(spawn([os.path.join(HERE, "compression_child.py"), "unix:" + sock,
                               str(i), "default"]))
        results = [finish(k) for k in kids]
    finally:
        for k in kids:
            if k.poll() is None:
                k.kill()
        for s in sidecars:
            s.stop()
    got = []
    for rc, out, err in results:
        assert rc == 0 and out.strip().endswith("ok"), (out, err[-3000:])
        got.append(json.loads(out.strip().splitlines()[0]))
    assert got[0]["digest"] == got[1]["digest"], got
    assert not got[0]["uncompressed"] and got[0]["representable"]["fp16"], got[0]
    assert got[0]["max_err"] <= BOUND["fp16"] * got[0]["max_abs"], got[0]
    for s in sidecars:
        assert s.last("Waiting for the trainer.")["compression"] == "fp16"
        assert not s.sanitizer_report()


def test_sidecar_refuses_a_bad_compression():
    for flags, needle in ((["--compression", "int4"], "bad --compression"),
                          (["--compression", "fp16"], "need --socket")):
        p = Proc([bin_path("cohort-sidecar"), "--broker", "127.0.0.1:1", "--cohort", "c",
                  "--id", "a", *flags], "bad")
        assert p.p.wait(timeout=DEADLINE) == 2
        p.stop()
        assert any(needle in l for l in p.raw), (flags, p.raw)

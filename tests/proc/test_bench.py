"""The benchmark commands run end to end (tiny sizes: what is checked is
that they work and refuse bad flags, not their figures, which belong to
the README) against the sanitizer build."""
import json
import os
import sys

import pytest

from cohorttest import DEADLINE, ROOT, bin_dir, bin_path, run_group


def cohortctl(*args):
    return run_group([bin_path("cohortctl"), *args], 4 * DEADLINE,
                     what="cohortctl " + " ".join(args))


def json_lines(out):
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def test_bench_accumulator_reports_each_size():
    rc, out, err = cohortctl("bench", "accumulator", "--peers", "2", "--bytes", "4K,1KiB",
                             "--reps", "1", "--rounds", "3", "-o", "json")
    assert rc == 0, err[-4000:]
    rows = json_lines(out)
    assert [r["bytes"] for r in rows] == [4096, 1024]
    for r in rows:
        assert r["peers"] == 2 and r["reps"] == 1
        assert r["engine_ms"] > 0 and r["accumulator_ms"] > 0 and r["ratio"] > 0


def test_bench_allreduce_reports_each_size():
    rc, out, err = cohortctl("bench", "allreduce", "--peers", "2", "--bytes", "4K",
                             "--bytes", "8KB", "--iters", "3", "--warmup", "2", "-o", "json")
    assert rc == 0, err[-4000:]
    rows = json_lines(out)
    assert [r["bytes"] for r in rows] == [4096, 8192]
    assert all(r["peers"] == 2 and r["time_ms"] > 0 for r in rows)


@pytest.mark.parametrize("codec,extra,wire", [
    # 4 KiB: 1024 floats; 1% is k = 11 pairs of 8 bytes, 2(N-1) times.
    ("topk", [], 2 * 2 * 11 * 8),
    ("topk", ["--topk-ratio", "0.5"], 2 * 2 * 512 * 8),
    # A 32 x 32 view at rank 2: P and Q, 2(N-1)/N x 4 x 64 x 2 bytes.
    ("powersgd", ["--rank", "2"], 2 * 2 * 4 * 64 * 2 // 3),
])
def test_bench_allreduce_times_the_reducers_with_error_feedback(codec, extra, wire):
    rc, out, err = cohortctl("bench", "allreduce", "--peers", "3", "--bytes", "4K",
                             "--iters", "3", "--warmup", "2", "--codec", codec, "--op", "avg",
                             *extra, "-o", "json")
    assert rc == 0, err[-4000:]
    rows = json_lines(out)
    assert len(rows) == 1 and rows[0]["codec"] == codec and rows[0]["time_ms"] > 0
    assert rows[0]["wire_bytes"] == wire


def test_bench_checkpoint_reports_writes_and_rounds_with_and_without(tmp_path):
    rc, out, err = cohortctl("bench", "checkpoint", "--peers", "2", "--bytes", "1M",
                             "--every", "1,4", "--seconds", "1", "--reps", "1", "--writes", "2",
                             "--dir", str(tmp_path), "-o", "json")
    assert rc == 0, err[-4000:]
    rows = json_lines(out)
    writes = [r for r in rows if r["measure"] == "write"]
    rounds = [r for r in rows if r["measure"] == "rounds"]
    assert len(writes) == 1 and writes[0]["bytes"] == 1 << 20 and writes[0]["mib_per_s"] > 0
    assert [r["every"] for r in rounds] == [0, 1, 4]
    assert all(r["rounds_per_s"] > 0 and r["failed"] == 0 for r in rounds)
    assert rounds[0]["ratio"] == 1.0 and rounds[0]["written"] == 0
    # Every version: the leader wrote checkpoints while the rounds ran.
    assert rounds[1]["written"] >= 1 and rounds[1]["write_mib_per_s"] > 0
    assert os.listdir(tmp_path) == [], "the benchmark leaves nothing behind"


@pytest.mark.parametrize("args", [
    ["accumulator", "--bytes", "6"],            # not whole float32 elements
    ["accumulator", "--bytes", "4K,,8K"],
    ["accumulator", "--bytes", "2G"],           # above the 1 GiB cap
    ["accumulator", "--bytes", ",".join(["4K"] * 17)],
    ["accumulator", "--bytes", "0"],
    ["accumulator", "--peers", "9"],
    ["accumulator", "-o", "yaml"],
    ["allreduce", "--bytes", "4T"],
    ["allreduce", "--bytes", "-4K"],
    ["allreduce", "--segment", "12"],           # not a multiple of 8
    ["allreduce", "--codec", "topk", "--topk-ratio", "0"],
    ["allreduce", "--codec", "topk", "--topk-ratio", "1.5"],
    ["allreduce", "--codec", "topk", "--topk-ratio", "nan"],
    ["allreduce", "--codec", "topk", "--op", "max"],
    ["allreduce", "--codec", "powersgd", "--rank", "0"],
    ["allreduce", "--codec", "powersgd", "--dtype", "f64"],
    ["allreduce", "--codec", "sparse"],
    ["checkpoint", "--bytes", "12"],            # not a multiple of 8
    ["checkpoint", "--every", "0"],
    ["checkpoint", "--every", "1,2,3,4,5,6,7"],
    ["checkpoint", "--peers", "5"],
    ["checkpoint", "--seconds", "0"],
    ["checkpoint", "--dir", "/nonexistent/x"],
])
def test_bench_refuses_bad_flags_before_running(args):
    rc, out, err = cohortctl("bench", *args)
    assert rc == 2, (rc, err)
    assert out == "", "nothing ran, so nothing is reported"
    assert "cohortctl bench" in err


def test_bench_failover_times_a_sidecars_death():
    rc, out, err = run_group([sys.executable, os.path.join(ROOT, "bench", "failover.py"),
                              "--bin", bin_dir(), "--trials", "1", "--members", "2",
                              "--kinds", "sidecar", "--json"], 4 * DEADLINE,
                             what="bench/failover.py")
    assert rc == 0, err[-4000:]
    row = json.loads(out.splitlines()[0])
    assert row["kind"] == "sidecar" and len(row["seconds"]) == 1 and row["seconds"][0] > 0
    assert "| torchrun's documented detection" in out

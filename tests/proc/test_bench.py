"""The benchmark commands run end to end (tiny sizes: what is checked is
that they work and refuse bad flags, not their figures, which belong to
the README) against the sanitizer build."""
import json
import os
import subprocess
import sys

import pytest

from cohorttest import DEADLINE, ROOT, bin_dir, bin_path, run_group
from cohorttest.programs import write_key


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
        # The engine out of place, as the Accumulator runs it, beside it.
        assert r["engine_into_ms"] > 0 and r["ratio_into"] > 0


@pytest.mark.parametrize("cpus", [None, "0"])
def test_bench_accumulator_pins_each_member_to_a_cpu(cpus):
    """--pin: member i's threads on the i-th CPU the process may use,
    modulo their count, so one CPU serves both members; without it the
    figures say they are not pinned."""
    args = ["bench", "accumulator", "--peers", "2", "--bytes", "4K", "--reps", "1",
            "--rounds", "3", "-o", "json"]
    if cpus is None:
        rc, out, err = cohortctl(*args)
        assert rc == 0, err[-4000:]
        assert [r["pinned"] for r in json_lines(out)] == [False]
        rc, out, err = cohortctl(*args, "--pin")
    else:
        rc, out, err = run_group(["taskset", "-c", cpus, bin_path("cohortctl"), *args, "--pin"],
                                 4 * DEADLINE, what="cohortctl on one CPU")
    assert rc == 0, err[-4000:]
    rows = json_lines(out)
    assert [r["pinned"] for r in rows] == [True]
    assert rows[0]["engine_ms"] > 0 and rows[0]["accumulator_ms"] > 0
    if cpus is None:
        # The table says so on its first line.
        rc, out, err = cohortctl("bench", "accumulator", "--bytes", "4K", "--reps", "1",
                                 "--rounds", "3", "--pin")
        assert rc == 0, err[-4000:]
        assert out.startswith("each member's threads on a CPU of its own (--pin)")


def test_bench_accumulator_traces_its_stages():
    """--trace: each stage's median over the timed rounds of every
    repetition (warm-up rounds dropped), and a table line per size."""
    rc, out, err = cohortctl("bench", "accumulator", "--peers", "2",
                             "--bytes", "4K,500K,512K,532288",
                             "--reps", "2", "--rounds", "4", "--trace", "-o", "json")
    assert rc == 0, err[-4000:]
    rows = json_lines(out)
    stages = ["wake", "count", "copy-in", "engine", "copy-out", "commit", "apply", "next"]
    for r in rows:
        t = r["trace_us"]
        assert list(t) == stages + ["round"]
        # Rounds 4 of each repetition: the last has no row (no contribution
        # follows it); a round that straddles an epoch change is retried.
        assert 2 <= r["trace_rounds"] <= 2 * 4
        assert t["engine"] > 0 and t["apply"] > 0 and t["next"] > 0
        assert t["round"] >= t["engine"]
        # A share of the first member's requests, which the test cannot
        # pin down: whether the node's thread still spins when a request
        # comes is the scheduler's choice.
        assert 0 <= r["doorbell_pct"] <= 100
    # A trainer's memory has room for the counters after its gradients and
    # results: once each member contributes once a round, a round is one
    # all-reduce, with no count step and no copy out...
    # 512 KiB on 2 members is one whole 256 KiB segment per chunk: the ring
    # folds the counters into it rather than adding a short segment...
    for r in rows[:3]:
        assert r["trace_us"]["count"] == 0 and r["trace_us"]["copy-out"] == 0
    # ...unless they would add one to each step: 532288 bytes on 2 members
    # is a segment and 1000 elements per chunk, which the ring folds (up to
    # 1024), but not with the counters' 52 elements per chunk more.
    assert rows[3]["trace_us"]["count"] > 0 and rows[3]["trace_us"]["copy-out"] == 0
    rc, out, err = cohortctl("bench", "accumulator", "--peers", "2", "--bytes", "4K",
                             "--reps", "1", "--rounds", "3", "--trace")
    assert rc == 0, err[-4000:]
    assert "trace, median us over" in out and " engine " in out and "| doorbell " in out


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


def test_bench_allreduce_members_in_their_own_processes_meet_at_a_rendezvous(tmp_path):
    key = write_key(tmp_path / "key")
    rv = tmp_path / "rv"
    rv.mkdir()
    argv = [bin_path("cohortctl"), "bench", "allreduce", "--peers", "3", "--bytes", "4K,64K",
            "--iters", "3", "--warmup", "1", "--codec", "int8", "--rendezvous", str(rv),
            "--key-file", key, "--host", "127.0.0.1", "-o", "json"]
    procs = [subprocess.Popen(argv + ["--member", str(i)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(3)]
    for p in procs:
        out, err = p.communicate(timeout=4 * DEADLINE)
        assert p.returncode == 0, err[-4000:]
        rows = json_lines(out)
        assert [r["bytes"] for r in rows] == [4096, 65536]
        assert all(r["peers"] == 3 and r["codec"] == "int8" and r["time_ms"] > 0 for r in rows)
    assert sorted(os.listdir(rv)) == ["addr.0", "addr.1", "addr.2", "done.0", "done.1", "done.2"]


def test_bench_allreduce_member_gives_up_on_a_missing_peer_and_refuses_a_bad_address(tmp_path):
    key = write_key(tmp_path / "key")
    base = ["bench", "allreduce", "--peers", "2", "--bytes", "4K", "--rendezvous",
            str(tmp_path), "--key-file", key]
    # Member 1 never comes: member 0 waits out its --timeout and says so.
    rc, out, err = cohortctl(*base, "--member", "0", "--timeout", "300ms")
    assert rc == 1 and "rendezvous" in err and "timed out" in err, err
    # What a peer wrote is input: an address with a newline in it is refused.
    (tmp_path / "addr.0").write_text("127.0.0.1:1\n")
    rc, out, err = cohortctl(*base, "--member", "1", "--timeout", "5s")
    assert rc == 1 and "Invalid argument" in err, err


@pytest.mark.parametrize("args", [
    ["--member", "0"],                                      # no rendezvous, no key
    ["--member", "2", "--peers", "2", "--rendezvous", "/tmp", "--key-file", "/dev/null"],
    ["--rendezvous", "/tmp"],                               # without --member
    ["--host", "127.0.0.1"],
    ["--member", "-1", "--rendezvous", "/tmp", "--key-file", "/dev/null"],
])
def test_bench_allreduce_member_flags_are_checked(args):
    rc, out, err = cohortctl("bench", "allreduce", *args)
    assert rc == 2 and out == "", (rc, err)
    assert "cohortctl bench allreduce" in err


NETNS = os.path.join(ROOT, "bench", "compression_netns.py")
QUALITY = os.path.join(ROOT, "bench", "train_quality.py")


@pytest.mark.parametrize("args", [
    ["--peers", "1"],
    ["--rate", "1gb"],
    ["--rate", "fast"],
    ["--codecs", "int8 none"],                  # none first: the ratios' base
    ["--codecs", "none zip"],
    ["--reps", "0"],
    ["--cohortctl", "/nonexistent/cohortctl"],
])
def test_compression_netns_refuses_bad_arguments(args):
    rc, out, err = run_group([sys.executable, NETNS, "--cohortctl", bin_path("cohortctl"), *args],
                             DEADLINE, what="bench/compression_netns.py")
    assert rc == 2 and out == "", (rc, err)


def test_compression_netns_runs_a_tiny_limited_round():
    rc, out, err = run_group([sys.executable, NETNS, "--cohortctl", bin_path("cohortctl"),
                              "--peers", "2", "--bytes", "64K", "--reps", "1", "--iters", "2",
                              "--codecs", "none int8", "--no-gloo", "--rate", "100mbit"],
                             4 * DEADLINE, what="bench/compression_netns.py")
    assert rc == 0, err[-4000:]
    if out.startswith("compression_netns: skipped:"):
        pytest.skip(out.strip())
    rows = [line.split("|")[1:-1] for line in out.splitlines()[2:]]
    assert [[c.strip() for c in r[:2]] for r in rows] == [["cohort", "none"], ["cohort", "int8"]]
    # int8 sends about a quarter of none's bytes through the limited link.
    assert int(rows[0][3]) == 65536 and int(rows[1][3]) < 65536 // 3
    assert 0 < float(rows[1][6]) < 0.5


@pytest.mark.parametrize("args", [
    ["--peers", "0"],
    ["--steps", "0"],
    ["--codecs", "fp16 none"],
    ["--codecs", "none none"],
    ["--target-loss", "-1"],
    ["--cohortctl", "/nonexistent/cohortctl"],
])
def test_train_quality_refuses_bad_arguments(args):
    rc, out, err = run_group([sys.executable, QUALITY, "--cohortctl", bin_path("cohortctl"),
                              *args], DEADLINE, what="bench/train_quality.py")
    assert rc == 2 and out == "", (rc, err)


def test_train_quality_trains_once_per_codec_and_reports_ratios():
    rc, out, err = run_group([sys.executable, QUALITY, "--cohortctl", bin_path("cohortctl"),
                              "--peers", "2", "--steps", "4", "--eval-every", "2",
                              "--hidden", "256", "--codecs", "none bf16",
                              "--target-loss", "100"], 8 * DEADLINE, what="bench/train_quality.py")
    assert rc == 0, err[-4000:]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in out.splitlines()[2:]]
    assert [r[0] for r in rows] == ["none", "bf16"]
    for r in rows:
        assert float(r[1]) > 0 and 0 <= float(r[2]) <= 1
        assert float(r[3]) >= 0, "a loss of 100 is reached at the first evaluation"
    assert rows[0][5:] == ["1.000", "1.000", "1.00"]


def test_train_quality_reports_a_codec_the_accumulator_refuses():
    rc, out, err = run_group([sys.executable, QUALITY, "--cohortctl", bin_path("cohortctl"),
                              "--peers", "1", "--steps", "2", "--codecs", "none zip"],
                             8 * DEADLINE, what="bench/train_quality.py")
    assert rc == 1 and out == "", (rc, out)
    assert "--codec zip" in err


@pytest.mark.skipif(any(os.access(os.path.join(d, "nvidia-smi"), os.X_OK)
                        for d in os.environ.get("PATH", "").split(os.pathsep)),
                    reason="nvidia-smi is here: bench/gpu.sh would run for real")
def test_bench_gpu_skips_with_its_reason_without_a_gpu():
    out = subprocess.run(["sh", os.path.join(ROOT, "bench", "gpu.sh")], capture_output=True,
                         text=True, timeout=4 * DEADLINE)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "gpu.sh: skipped: no nvidia-smi" in out.stderr, out.stderr

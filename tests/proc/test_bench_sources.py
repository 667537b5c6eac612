"""The benchmarks that are C sources compiled by hand (their headers say
the command) still build against the release library, and the broker's
report benchmark runs: a benchmark that no longer compiles would only be
found by the next person who needs its figure.

- bench/dtype_kernels.c and bench/codec_kernels.c build with the command
  their headers and the README give.
- bench/broker_reports.c builds and, on a small epoch, prints one line
  for heartbeats of 0, 16 and 1,024 reports, each costing more than the
  plain one, and its reference line of the scans a report cost before.
"""
import json
import os
import subprocess

import pytest

from cohorttest import DEADLINE, ROOT, make_tmp, remove_tmp

LIB = os.path.join(ROOT, "build", "lib", "libcohort-core.a")
LIBS = ["-lgrpc", "-lgpr", "-lprotobuf-c", "-lcrypto", "-lpthread", "-lm"]


@pytest.fixture
def tmp():
    d = make_tmp("benchsrc")
    yield d
    remove_tmp(d)


def build(src, exe):
    if not os.path.exists(LIB):
        pytest.skip("no release build at %s (make all)" % LIB)
    cmd = ["cc", "-O2", "-Isrc", "-Iinclude", "-Ibuild/gen", "-o", exe, src, LIB, *LIBS]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=4 * DEADLINE)
    assert p.returncode == 0, " ".join(cmd) + "\n" + p.stderr[-4000:]


@pytest.mark.parametrize("src", ["bench/dtype_kernels.c", "bench/codec_kernels.c"])
def test_kernel_benchmarks_build(tmp, src):
    build(src, os.path.join(tmp, "a.out"))


def test_broker_reports_runs_on_a_small_epoch(tmp):
    exe = os.path.join(tmp, "broker_reports")
    build("bench/broker_reports.c", exe)
    p = subprocess.run([exe, "--members", "2048", "--beats", "20", "--reps", "1"], cwd=ROOT,
                       capture_output=True, text=True, timeout=4 * DEADLINE)
    assert p.returncode == 0, p.stderr[-4000:]
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.strip()]
    beats = {r["reports"]: r for r in rows if "us_per_heartbeat" in r}
    assert sorted(beats) == [0, 16, 1024], rows
    # Every heartbeat was taken (the benchmark fails on a refusal); what
    # the reports cost is the benchmark's to say, not a test's: on a
    # loaded machine 20 beats with reports can time below 20 without.
    for k, r in beats.items():
        assert r["members"] == 2048 and r["us_per_heartbeat"] > 0, r
        assert "us_per_report" in r and "x_plain" in r, r
    # The reference line: the two scans a report cost before the index.
    assert any("scan_us_per_report" in r for r in rows), rows

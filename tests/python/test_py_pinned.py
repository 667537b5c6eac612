"""A cohort's accumulator and reduction settings reach a Python trainer
through its sidecar (what the operator passes from a TrainingCohort's
spec.accumulator and spec.reduction):

- --virtual-batch-size 8 with two members each contributing 2 samples a
  call: every round waits for 8 samples (4 contributions), though the
  trainer never asked for it; without the flag a round commits at 4.
- The trainer's call for another size or count is refused with EACCES
  (cohort.Error), the pinned value is accepted.
- --allreduce ring: the sidecar's engine runs the ring for the small count
  steps that its own rule gives to recursive doubling, and says so in its
  log; without the flag (auto) it runs recursive doubling.
"""
import json
import os

import pytest

from cohorttest import DEADLINE, Proc, bin_path, finish
from pyproc import HERE, spawn

ALG_LINE = "First all-reduce with this algorithm."


def run_pair(broker, tmp_path, cohort_name, flags):
    """Two sidecars with `flags` and a pinned-check child on each; returns
    (sidecars, [(rc, out, err)])."""
    sidecars, kids = [], []
    try:
        for i in range(2):
            sock = str(tmp_path / ("s%d.sock" % i))
            sidecars.append(Proc([bin_path("cohort-sidecar"), "--broker", broker.address,
                                  "--cohort", cohort_name, "--id", "m%d" % i, "--socket", sock,
                                  "--log-format", "json", "--heartbeat-interval", "250ms",
                                  "--member-timeout", "2s", *flags], "m%d" % i))
            sidecars[-1].wait_log("Waiting for the trainer.")
            kids.append(spawn([os.path.join(HERE, "child_checks.py"), "pinned", "unix:" + sock]))
        return sidecars, [finish(k) for k in kids]
    finally:
        for k in kids:
            if k.poll() is None:
                k.kill()
        for s in sidecars:
            s.stop()


def rounds_of(out):
    line = [l for l in out.splitlines() if l.startswith("rounds ")]
    assert line, out
    return json.loads(line[0][len("rounds "):])


def algorithms(sidecar):
    return {l.get("algorithm") for l in sidecar.logs(ALG_LINE)}


def test_pinned_virtual_batch_size_and_ring_reach_the_trainer(broker, tmp_path):
    sidecars, results = run_pair(broker, tmp_path, "pinned",
                                 ["--virtual-batch-size", "8", "--parallel-gradients", "2",
                                  "--allreduce", "ring"])
    for rc, out, err in results:
        assert rc == 0 and out.strip().endswith("ok"), (out, err[-3000:])
        for r in rounds_of(out):
            assert r["batch_size"] >= 8 and r["num_gradients"] >= 4, r
    for s in sidecars:
        assert s.last("Waiting for the trainer.")["virtual_batch_size"] == 8
        assert algorithms(s) == {"ring"}, s.raw[-20:]
        refusals = s.logs("Refused the trainer's virtual batch size: the cohort sets it.")
        assert refusals and refusals[0]["asked"] == 4 and refusals[0]["cohort_setting"] == 8
        assert s.logs("Refused the trainer's parallel gradients: the cohort sets them.")
        assert not s.sanitizer_report()


def test_without_settings_the_trainer_and_the_engine_decide(broker, tmp_path):
    sidecars, results = run_pair(broker, tmp_path, "free", [])
    for rc, out, err in results:
        # Nothing pinned: the first round commits at one contribution each,
        # and the setters' other values are not refused.
        assert rc != 0 and "did not raise Error" in err, (out, err[-3000:])
        assert [r["batch_size"] for r in rounds_of(out)] == [4, 4, 4], out
    for s in sidecars:
        assert algorithms(s) == {"doubling"}, s.raw[-20:]


def test_sidecar_refuses_bad_settings_and_settings_without_a_trainer():
    for flags, needle in ((["--virtual-batch-size", "0"], "bad --virtual-batch-size"),
                          (["--parallel-gradients", "9"], "bad --parallel-gradients"),
                          (["--allreduce", "tree"], "bad --allreduce"),
                          (["--allreduce", "ring"], "need --socket")):
        p = Proc([bin_path("cohort-sidecar"), "--broker", "127.0.0.1:1", "--cohort", "c",
                  "--id", "a", *flags], "bad")
        assert p.p.wait(timeout=DEADLINE) == 2
        p.stop()
        assert any(needle in l for l in p.raw), (flags, p.raw)

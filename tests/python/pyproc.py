"""Helpers of the Python package's tests: Python children with the cohort
package and tests/lib on their path, pairs of such children and of their
sidecars, examples/pytorch/train.py under `cohortctl run`, and where an
Accumulator's tensors live. The children (child_checks.py, the pair
children) import it too."""
import contextlib
import json
import os
import re

import cohort

from cohorttest import (DEADLINE, ROOT, cohortctl_run, finish, spawn_group, start_sidecar,
                        wait_until)

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON = "/usr/bin/python3"
TRAIN = os.path.join(ROOT, "examples", "pytorch", "train.py")
FINAL = re.compile(r"^final model_version=(\d+) digest=([0-9a-f]{16})$")
# The package these tests import, for the child processes too, and
# tests/lib for the children that wait with cohorttest.
PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(cohort.__file__)))


def child_env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([PKG_DIR, os.path.join(ROOT, "tests", "lib"),
                                         env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


def spawn(args, **env):
    """A Python child in its own process group, with the package on its
    path; stdout and stderr piped. cohorttest.finish() collects it."""
    return spawn_group([PYTHON, *args], child_env(**env))


def run_train(tmp_path, n, trainer_args, *extra, name="run"):
    """cohortctl run -o json of examples/pytorch/train.py; returns
    (exit status, summary, stderr)."""
    return cohortctl_run(tmp_path / name, n, [PYTHON, TRAIN, *trainer_args], *extra,
                         env=child_env())


def inside(acc, t):
    """True when tensor t lies in the memory the accumulator registered."""
    lo, n = acc.memory_span()
    return lo <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= lo + n


def done_line(text):
    """The fields of train.py's "done:" line, as a dict."""
    for line in text.splitlines():
        if line.startswith("done: "):
            return dict(kv.split("=", 1) for kv in line[len("done: "):].rstrip(".").split())
    return None


def step(acc):
    """One turn of a trainer's loop with nothing to train: update, and
    answer the state requests of a sync (the leader sends its state)."""
    acc.update()
    if acc.wants_state():
        acc.set_state({})
    if acc.has_new_state():
        acc.state()


def wait_stepping(acc, cond, what):
    """Waits for cond(), turning acc's loop between polls (often: each
    turn is what moves the accumulator on)."""
    return wait_until(lambda: (step(acc), cond())[1], what, timeout=2 * DEADLINE,
                      interval=0.005)


def join_pair(acc, address):
    """Connects acc (a child of a pair) to `address` and waits until both
    members are in and it wants gradients; a virtual batch is then one
    contribution from each."""
    acc.connect(address)
    wait_stepping(acc, lambda: acc.connected() and acc.size() == 2 and acc.wants_gradients(),
                  "both members in")
    acc.set_virtual_batch_size(2)


def run_pair(script, address_of, *args):
    """Runs `script ADDRESS INDEX ARGS...` (beside this file) as members 0
    and 1, ADDRESS being address_of(index). Each must exit 0 having
    printed one JSON line per round, then "ok"; both must report the same
    digest each round, from both members' gradients. Returns each
    member's rounds, as dicts."""
    kids = [spawn([os.path.join(HERE, script), address_of(i), str(i), *args]) for i in range(2)]
    rounds = []
    for rc, out, err in [finish(k) for k in kids]:
        assert rc == 0, err[-3000:]
        lines = out.strip().splitlines()
        assert lines and lines[-1] == "ok", out
        rounds.append([json.loads(line) for line in lines[:-1]])
    assert len(rounds[0]) == len(rounds[1]), rounds
    for a, b in zip(*rounds):
        assert a["digest"] == b["digest"], (a, b)          # identical on both members
        assert a["num_gradients"] == 2, a                   # both contributed
    return rounds


@contextlib.contextmanager
def sidecar_pair(broker, tmp_path, cohort_name, *flags):
    """Two sidecars, m0 and m1, of cohort_name on `broker` (a started
    broker), each serving a trainer on a socket in tmp_path, with the
    quick heartbeat of these tests and `flags`; ready when the block
    starts. Yields (address_of, sidecars), address_of(i) being member i's
    "unix:PATH" for run_pair. Stops both after the block, and checks
    neither reported a sanitizer error."""
    sidecars = []

    def address_of(i):
        return "unix:" + str(tmp_path / ("s%d.sock" % i))

    try:
        for i in range(2):
            sidecars.append(start_sidecar(broker.address, cohort_name, "m%d" % i, "--socket",
                                          address_of(i)[len("unix:"):], "--heartbeat-interval",
                                          "250ms", "--member-timeout", "2s", *flags))
            sidecars[-1].wait_log("Waiting for the trainer.")
        yield address_of, sidecars
    finally:
        for s in sidecars:
            s.stop()
    for s in sidecars:
        assert not s.sanitizer_report()

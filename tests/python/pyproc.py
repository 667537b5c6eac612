"""Helpers of the Python package's tests: Python children with the cohort
package and tests/lib on their path, examples/pytorch/train.py under
`cohortctl run`, and where an Accumulator's tensors live. The children
(child_checks.py) import it too."""
import os
import re

import cohort

from cohorttest import ROOT, cohortctl_run, spawn_group

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

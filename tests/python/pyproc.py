"""Helpers for running Python trainers as real processes."""
import json
import os
import re
import signal
import subprocess
import sys

import cohort

from cohortproc import DEADLINE, bin_path

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
PYTHON = "/usr/bin/python3"
TRAIN = os.path.join(ROOT, "examples", "pytorch", "train.py")
FINAL = re.compile(r"^final model_version=(\d+) digest=([0-9a-f]{16})$")
# The package these tests import, for the child processes too.
PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(cohort.__file__)))
RUN_TIMEOUT = "%ds" % int(2 * DEADLINE)
PROC_TIMEOUT = 2 * DEADLINE + 60


def child_env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = PKG_DIR + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


def spawn(args, **env):
    """A Python child with the package on its path; stdout and stderr piped."""
    return subprocess.Popen([PYTHON, *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=child_env(**env),
                            start_new_session=True)


def finish(p, timeout=PROC_TIMEOUT):
    """(exit status, stdout, stderr); kills the child's group on timeout."""
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        raise AssertionError("child %s hung; stderr:\n%s" % (p.args, err[-4000:]))
    return p.returncode, out, err


def cohortctl_run(tmp_path, n, trainer_args, *extra, name="run"):
    """cohortctl run -o json of examples/pytorch/train.py; returns
    (exit status, summary, stderr)."""
    p = subprocess.Popen([bin_path("cohortctl"), "run", "-n", str(n), "--no-view", "-o", "json",
                          "--timeout", RUN_TIMEOUT, "--run-dir", str(tmp_path / name), *extra,
                          "--", PYTHON, TRAIN, *trainer_args],
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=child_env(), start_new_session=True)
    rc, out, err = finish(p)
    try:
        summary = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise AssertionError("no JSON summary (exit %d); stderr:\n%s" % (rc, err[-4000:]))
    return rc, summary, err


def read(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def explain(summary, err):
    parts = [err[-3000:]]
    for p in summary["peers"]:
        for key in ("stderr", "sidecar_log"):
            parts.append("--- %s %s:\n%s" % (p["id"], key, read(p[key])[-2000:]))
    return "\n".join(parts)


def done_line(text):
    """The fields of train.py's "done:" line, as a dict."""
    for line in text.splitlines():
        if line.startswith("done: "):
            return dict(kv.split("=", 1) for kv in line[len("done: "):].rstrip(".").split())
    return None

"""cohort's programs as real processes: a broker (cohort-operator
--standalone), sidecars, cohortctl, and whole runs under `cohortctl run`.

Binaries come from $COHORT_BIN (the Makefile passes the sanitizer build,
build/asan, to tests/proc and tests/kube, and the release build to
tests/python), else build/asan, else build/. Every process logs JSON
lines; brokers listen on port 0 and report the port they got.
"""
import json
import os
import subprocess

from .core import DEADLINE, ROOT, read_text
from .procs import Proc, run_group

# cohortctl run's --timeout: shorter than PROC_TIMEOUT, so that cohortctl,
# not the test, reports a stuck run.
RUN_TIMEOUT = "%ds" % int(2 * DEADLINE)


def bin_dir():
    env = os.environ.get("COHORT_BIN")
    if env:
        return os.path.abspath(env)
    for d in (os.path.join(ROOT, "build", "asan"), os.path.join(ROOT, "build")):
        if os.access(os.path.join(d, "cohort-operator"), os.X_OK):
            return d
    return os.path.join(ROOT, "build", "asan")


BIN = bin_dir()


def bin_path(name):
    return os.path.join(BIN, name)


def start_broker(*extra, listen="127.0.0.1:0"):
    argv = [bin_path("cohort-operator"), "--standalone", "--listen", listen,
            "--log-format", "json", *extra]
    p = Proc(argv, "broker")
    line = p.wait_log("Broker is listening.")
    p.address = line["address"]
    return p


def start_sidecar(broker, cohort, member_id, *extra):
    argv = [bin_path("cohort-sidecar"), "--broker", broker, "--cohort", cohort,
            "--id", member_id, "--log-format", "json", *extra]
    p = Proc(argv, member_id)
    p.id = member_id
    return p


def latest_epoch(p):
    """The sidecar's latest adopted epoch line, or None."""
    return p.last("Adopted a new epoch.")


def all_see(sidecars, pred):
    """True when every sidecar's latest epoch satisfies pred."""
    eps = [latest_epoch(s) for s in sidecars]
    return all(e is not None and pred(e) for e in eps) and eps


def cohortctl(*args, timeout=60):
    return subprocess.run([bin_path("cohortctl"), *args], capture_output=True, text=True,
                          timeout=timeout)


def status_json(broker, *extra):
    r = cohortctl("status", "--broker", broker, "-o", "json", *extra)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def cohortctl_run(run_dir, n, trainer_argv, *extra, env=None):
    """`cohortctl run -o json` of n peers of trainer_argv, with its logs in
    run_dir; returns (exit status, summary, stderr)."""
    rc, out, err = run_group([bin_path("cohortctl"), "run", "-n", str(n), "--no-view", "-o", "json",
                              "--timeout", RUN_TIMEOUT, "--run-dir", str(run_dir), *extra, "--",
                              *trainer_argv], env=env)
    try:
        summary = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise AssertionError("no JSON summary (exit %d); stderr:\n%s" % (rc, err[-4000:]))
    return rc, summary, err


def explain_run(summary, err):
    """cohortctl's stderr and the end of each peer's logs, for a failed run."""
    parts = [err[-3000:]]
    for p in summary["peers"]:
        for key in ("stderr", "sidecar_log"):
            parts.append("--- %s %s:\n%s" % (p["id"], key, read_text(p[key])[-2000:]))
    return "\n".join(parts)

"""hivemind's DecentralizedAverager in a TrainingCohort's trainer pods, end
to end: the real operator and kubectl against the API server stand-in,
the process kubelet running each pod's injected cohort-sidecar and a
torch trainer (hivemind_pod.py) that averages through it, as in a
cluster where only the sidecar holds the cohort's key.

- Three pods average integer-valued tensors, weighted, in groups the
  broker forms: every step's result is exactly the weighted average of
  what the groupmates it names contributed (each one's input, as it
  logged it itself), and every member of a group holds the same bytes.
- A pod deleted mid-run: the other two go on averaging without it.

The trainers run the release build's Python package (build/python, `make
python`; a sanitizer build cannot be loaded into /usr/bin/python3), the
sidecars the binaries of $COHORT_BIN. Every wait is on a condition with a
generous deadline ($COHORT_TEST_DEADLINE, 60 s by default).
"""
import glob
import json
import os

import pytest

from cohorttest import (ROOT, operator_cluster, wait_until)

PYTHON = "/usr/bin/python3"
TRAINER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hivemind_pod.py")
PODS = "/api/v1/namespaces/default/pods"


def package_dir():
    """Where the cohort package with its extension is: the one on
    $PYTHONPATH, else build/python."""
    for d in os.environ.get("PYTHONPATH", "").split(os.pathsep) + [
            os.path.join(ROOT, "build", "python")]:
        if d and glob.glob(os.path.join(d, "cohort", "_cohort*.so")):
            return os.path.abspath(d)
    return None


@pytest.fixture(scope="module")
def cluster():
    pkg = package_dir()
    if not pkg:
        pytest.skip("no cohort Python package in build/python or $PYTHONPATH (make python)")
    try:
        import torch  # noqa: F401
    except ImportError:
        pytest.skip("no torch for /usr/bin/python3")
    for c in operator_cluster("cav-"):
        c.pkg = pkg
        yield c


def manifest(name, replicas, out_dir, pkg):
    return {"apiVersion": "cohort.dev/v1alpha1", "kind": "TrainingCohort",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"replicas": replicas, "minReplicas": 1, "maxRestarts": 5,
                     "timeouts": {"heartbeatInterval": "250ms", "memberTimeout": "2s"},
                     "template": {"spec": {"terminationGracePeriodSeconds": 5, "containers": [{
                         "name": "trainer", "image": "cohort-examples",
                         "command": [PYTHON, TRAINER, out_dir],
                         "env": [{"name": "PYTHONPATH", "value": pkg},
                                 {"name": "OMP_NUM_THREADS", "value": "1"}]}]}}}}


def steps(out_dir):
    """Every step each trainer process logged so far: {(pod, run): [line]}."""
    logs = {}
    for path in glob.glob(os.path.join(out_dir, "*.jsonl")):
        with open(path) as f:
            lines = []
            for raw in f:
                try:
                    lines.append(json.loads(raw))
                except ValueError:
                    break               # a line being written, or cut by a kill
        if lines:
            logs[(lines[0]["pod"], lines[0]["run"])] = lines
    return logs


def averaged(lines):
    return [ln for ln in lines if "result" in ln]


def check_exact_and_alike(logs):
    """Every result is the exact weighted average of its groupmates'
    inputs, each of which is what that member logged for that round, and
    a group's members hold the same bytes. Returns the number of groups."""
    inputs = {(ln["run"], ln["r"]): (ln["x"], ln["w"])
              for lines in logs.values() for ln in lines if "x" in ln}
    groups = {}
    for (pod, run), lines in logs.items():
        for ln in averaged(lines):
            mates = ln["gathered"]
            assert mates[ln["me"]] == {"run": run, "r": ln["r"], "x": ln["x"], "w": ln["w"]}, ln
            assert set(mates) == set(ln["weights"]) and len(mates) >= 2, ln
            total, sums = 0, [0] * len(ln["x"])
            for peer, g in mates.items():
                assert ln["weights"][peer] == g["w"], ln
                # What the groupmate gathered is what it logged, where its
                # log is complete (a killed one may not have written it).
                if (g["run"], g["r"]) in inputs:
                    assert inputs[(g["run"], g["r"])] == (g["x"], g["w"]), (ln, g)
                total += g["w"]
                sums = [s + g["w"] * v for s, v in zip(sums, g["x"])]
            assert all(s % total == 0 for s in sums), ln
            assert ln["result"] == [s // total for s in sums], (pod, ln)
            groups.setdefault(ln["group"], []).append(ln)
    for number, members in groups.items():
        assert len({m["bytes"] for m in members}) == 1, "group %s: %s" % (number, members)
        assert len({json.dumps(sorted(m["gathered"]), sort_keys=True) for m in members}) == 1
    return len(groups)


def test_trainer_pods_average_exactly_through_their_sidecars_and_outlive_a_deleted_pod(cluster):
    c = cluster
    out_dir = os.path.join(c.tmp, "avg")
    os.makedirs(out_dir)
    c.kubectl("apply", "-f", "-", stdin=json.dumps(manifest("hm", 3, out_dir, c.pkg)))

    def rounds(pod, run=None, after=None):
        """Steps averaged by pod (by its process `run`), in groups without
        a member of the process `after` names."""
        n = 0
        for (p, r), lines in steps(out_dir).items():
            if p == pod and (run is None or r == run):
                n += sum(1 for ln in averaged(lines)
                         if after is None or
                         all(g["run"] != after for g in ln["gathered"].values()))
        return n

    # Each pod averages at least twice, at least once in a group of three.
    wait_until(lambda: all(rounds("hm-%d" % i) >= 2 for i in range(3)) and any(
        len(ln["gathered"]) == 3 for lines in steps(out_dir).values()
        for ln in averaged(lines)), "three trainer pods to average through their sidecars",
        timeout=120)
    gone = [run for (pod, run) in steps(out_dir) if pod == "hm-1"]
    assert len(gone) == 1, gone
    trainer = c.kubelet.pids("default", "hm-1")["trainer"]

    # Deleted mid-run (it steps continuously): once its trainer has ended,
    # the others average on, twice more each, in groups without it.
    c.kubectl("delete", "pod", "hm-1", "--wait=false")
    wait_until(lambda: not alive(trainer), "hm-1's trainer to end")
    before = {pod: rounds(pod, after=gone[0]) for pod in ("hm-0", "hm-2")}
    wait_until(lambda: all(rounds(pod, after=gone[0]) >= n + 2 for pod, n in before.items()),
               "hm-0 and hm-2 to average on without the deleted hm-1", timeout=120)
    c.kubectl("delete", "tc", "hm", "--wait=true")
    wait_until(lambda: not (c.server.get(PODS + "?labelSelector=cohort.dev%2Fcohort%3Dhm") or
                            {}).get("items"), "hm's pods to be gone")
    assert check_exact_and_alike(steps(out_dir)) >= 3


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True

"""The short chaos trials (`make test`, through `make proc`): one trial per
kind of kill with fixed seeds, one of every kind mixed, two with the
operator killed in the Kubernetes stand-in, and the checkers shown to fail
on logs that double-count, lose, disagree or end apart and on duplicate
pods. `make chaos TRIALS=N` runs the long version (tests/chaos/chaos.py).
"""
import copy
import os
import tempfile

import pytest

from chaos import TRAINER, run_trial
from check import CheckFailed, check
from cohorttest import ROOT, remove_tmp
from kubetrial import KubeTrial, TrialFailed, run_kube_trial


@pytest.mark.parametrize("kind,seed", [("trainer", 7), ("sidecar", 8), ("broker", 9)])
def test_kills_of_one_kind_keep_exact_accounting(kind, seed):
    f = run_trial(seed, [kind], kills=2)
    assert f["kills"] == [kind, kind] and f["versions"] >= 20 and f["contributions"] > 0


def test_kills_of_every_kind_keep_exact_accounting():
    f = run_trial(4, ["trainer", "sidecar", "broker"], kills=3)
    assert len(f["kills"]) == 3


# Seed 17: 4 members, vb 4; the operator killed after versions 10 and 11,
# then pod chaos-2 deleted. Seed 5: 4 members, vb 1; the operator killed,
# pod chaos-3's trainer killed, pod chaos-0 deleted.
@pytest.mark.parametrize("seed,kills", [(17, ["operator", "operator", "pod"]),
                                        (5, ["operator", "trainer", "pod"])])
def test_operator_kills_keep_exact_accounting_and_the_pods(seed, kills):
    if not os.access(os.path.join(ROOT, "build", "tools", "kubectl"), os.X_OK):
        pytest.skip("no kubectl in build/tools (scripts/install-kubectl.sh)")
    f = run_kube_trial(seed, ["operator", "trainer", "pod"], 3, TRAINER)
    assert f["kills"] == kills
    assert len(f["operator_restart_s"]) == kills.count("operator")
    # 4 replicas, and one pod made again per trainer killed or pod deleted.
    assert f["pods_created"] == 4 + len([k for k in kills if k != "operator"])
    assert f["versions"] >= 50 and f["contributions"] > 0
    # Every operator was killed while the cohort was still training.
    assert all(v < f["versions"] for v in f["operator_killed_at_v"]), f


class FakeServer:
    def __init__(self, names):
        self.names = names

    def get(self, path):
        return {"items": [{"metadata": {"name": n}} for n in self.names]}


@pytest.mark.parametrize("names,ok", [
    (["chaos-0", "chaos-1", "chaos-2"], True),
    (["chaos-0", "chaos-1"], True),
    (["chaos-0", "chaos-1", "chaos-2", "chaos-3"], False),     # one more than replicas
    (["chaos-0", "chaos-1", "chaos-7"], False),                # not an ordinal of 3
])
def test_duplicate_pods_fail_the_trial(names, ok):
    tmp = tempfile.mkdtemp(prefix="kchaos-")
    try:
        t = KubeTrial(1, ["operator"], 1, tmp, TRAINER)
        t.n = 3
        t.server = FakeServer(names)
        if ok:
            t.check_pods()
        else:
            with pytest.raises(TrialFailed, match="duplicate pods"):
                t.check_pods()
    finally:
        remove_tmp(tmp)


# ---- the checker can fail ---------------------------------------------------

def commit(v, res, pdig="p"):
    return {"ev": "commit", "v": v, "G": sum(r[1] for r in res), "skipped": 0, "epoch": 1,
            "whole": True, "res": res, "rdig": "r%d" % v, "pdig": pdig + str(v)}


def contrib(seq):
    return {"ev": "contrib", "seq": seq, "v": 0, "epoch": 1}


def good_logs():
    """Two members, two rounds: slot 0 adds seqs 1 and 2 to round 1 (vb
    above the members), slot 1 seq 1; round 2 holds slot 0's 3 and slot
    1's 2."""
    r1 = [[0, 2, 3, 5], [1, 1, 1, 1]]
    r2 = [[0, 1, 3, 9], [1, 1, 2, 4]]
    final = {"ev": "final", "v": 2, "pdig": "p2", "params": [[0, 3, 6, 14], [1, 2, 3, 5]]}
    return {
        0: [contrib(1), contrib(2), commit(1, r1), contrib(3), commit(2, r2), dict(final)],
        1: [contrib(1), commit(1, r1), contrib(2), commit(2, r2), dict(final)],
    }


def test_checker_accepts_exact_logs():
    assert check(good_logs(), {0, 1}, 2)["contributions"] == 5


def mutate(fn):
    logs = copy.deepcopy(good_logs())
    fn(logs)
    return logs


@pytest.mark.parametrize("what,fn,needle", [
    ("a contribution counted twice",
     lambda L: [e.update(res=[[0, 1, 2, 4], [1, 1, 2, 4]], G=2) for s in (0, 1) for e in L[s]
                if e["ev"] == "commit" and e["v"] == 2], "counted twice"),
    ("a survivor's contribution lost",
     lambda L: L[0].insert(5, contrib(4)), "in no committed version"),
    ("members disagree on a version",
     lambda L: L[1][3].update(rdig="other"), "differs between members"),
    ("a result no contributions make up",
     lambda L: [e.update(res=[[0, 1, 7, 49], [1, 1, 2, 4]]) for s in (0, 1) for e in L[s]
                if e["ev"] == "commit" and e["v"] == 2], "no run"),
    ("a gradient count that is not the contributions'",
     lambda L: [e.update(G=3) for s in (0, 1) for e in L[s]
                if e["ev"] == "commit" and e["v"] == 2], "gradient count"),
    ("a version skipped",
     lambda L: L[1].__delitem__(1), "committed version 2 after version 0"),
    ("final parameters that are not the sums",
     lambda L: [L[s][-1].update(params=[[0, 3, 6, 14]]) for s in (0, 1)], "not the sums"),
    ("survivors that end apart",
     lambda L: L[1][-1].update(pdig="x"), "end apart"),
])
def test_checker_fails_on(what, fn, needle):
    with pytest.raises(CheckFailed, match=needle):
        check(mutate(fn), {0, 1}, 2)


def test_a_killed_member_may_lose_only_its_last_contributions():
    logs = good_logs()
    logs[2] = [contrib(1), contrib(2)]          # killed before anything committed
    check(logs, {0, 1}, 2)
    logs[2] = [contrib(1), contrib(2), contrib(3)]
    logs[0][2]["res"].append([2, 1, 3, 9])      # seq 3 committed, 1 and 2 not: lost
    logs[1][1]["res"] = logs[0][2]["res"]
    for s in (0, 1):
        next(e for e in logs[s] if e["ev"] == "commit" and e["v"] == 1)["G"] = 4
    with pytest.raises(CheckFailed, match="killed slot 2's contribution 1"):
        check(logs, {0, 1}, 2)

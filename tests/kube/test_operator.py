"""cohort-operator end to end: the real kubectl 1.32 against the API server
stand-in, the process kubelet running trainer pods (the C example trainer
and the injected cohort-sidecar) as local processes, and the real operator.

One stand-in cluster is shared by the module; each test uses its own
cohort names. Every wait is on a condition with a generous deadline
($COHORT_TEST_DEADLINE, 60 s by default), never a fixed sleep.
Binaries: $COHORT_BIN (see tests/lib/cohorttest/programs.py).
"""
import json
import os
import signal

import pytest

from cohorttest import (ApiServer, Kubectl, Kubelet, Operator, bin_dir, cohort_manifest,
                        free_port, make_tmp, remove_tmp, wait_until)

NS = "default"
TC_PATH = "/apis/cohort.dev/v1alpha1/namespaces/default/trainingcohorts"


class Cluster:
    pass


@pytest.fixture(scope="module")
def cluster():
    if not os.access(os.path.join(bin_dir(), "cohort-operator"), os.X_OK):
        pytest.skip("no cohort-operator in %s (make asan, or set COHORT_BIN)" % bin_dir())
    c = Cluster()
    c.tmp = make_tmp("cop-")
    c.server = ApiServer(c.tmp, "--bookmark-interval", "0.5")
    c.kubelet = Kubelet(c.server, c.tmp)
    c.kubectl = Kubectl(c.server, c.tmp)
    c.operators = []
    try:
        if not c.kubectl.available():
            pytest.skip("kubectl is not in build/tools and scripts/install-kubectl.sh could not "
                        "fetch it")
        c.kubectl("apply", "-f", os.path.join(os.path.dirname(__file__), "..", "..", "crds",
                                              "trainingcohorts.cohort.dev.yaml"))
        c.kubectl("wait", "--for", "condition=Established", "crd/trainingcohorts.cohort.dev")
        c.broker_port = free_port()
        c.operators.append(Operator(c.server, c.tmp, "op-a", c.broker_port))
        wait_until(lambda: c.operators[0].metrics().get("is_leader") == 1, "op-a to lead")
        yield c
    finally:
        for op in c.operators:
            if op.p.poll() is None:
                rc = op.stop()
                assert rc == 0, "operator %s exited with %d:\n%s" % (op.name, rc, op.text()[-4000:])
        c.kubelet.stop()
        c.server.stop()
        remove_tmp(c.tmp)


def tc(c, name):
    return c.server.get("%s/%s" % (TC_PATH, name))


def status(c, name):
    return (tc(c, name) or {}).get("status") or {}


def pods(c, name):
    doc = c.server.get("/api/v1/namespaces/default/pods?labelSelector=cohort.dev%%2Fcohort%%3D%s"
                       % name)
    return doc["items"] if doc else []


def live_pods(c, name):
    return [p for p in pods(c, name) if not p["metadata"].get("deletionTimestamp")]


def events(c, name, reason=None):
    doc = c.server.get("/api/v1/namespaces/default/events") or {"items": []}
    return [e for e in doc["items"] if e["involvedObject"].get("name") == name and
            (reason is None or e.get("reason") == reason)]


def members(c, name):
    return sorted(m["id"] for m in status(c, name).get("members") or []
                  if not m.get("draining"))


def condition(c, name, ctype):
    for cond in status(c, name).get("conditions") or []:
        if cond["type"] == ctype:
            return cond
    return None


def apply(c, manifest):
    c.kubectl("apply", "-f", "-", stdin=json.dumps(manifest))


def wait_members(c, name, ids, what=None):
    wait_until(lambda: members(c, name) == sorted(ids) and
               status(c, name).get("readyReplicas") == len(ids) and
               status(c, name).get("leader") in ids,
               what or "members %s of %s" % (ids, name))


def model_version(c, name):
    return status(c, name).get("modelVersion") or 0


def wait_training(c, name):
    """The leader's model version moves on (status is written at least
    every --status-period while versions change)."""
    start = model_version(c, name)
    wait_until(lambda: model_version(c, name) > start, "%s to keep training past version %d"
               % (name, start))


def post_pod_creates(c):
    return [r for r in c.server.requests() if r["method"] == "POST" and
            r["path"].endswith("/pods") and r["userAgent"].startswith("cohort-operator")]


def stats_events(path, ev):
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                d = json.loads(line)
            except ValueError:
                continue            # a line cut short by SIGKILL
            if d.get("ev") == ev:
                out.append(d)
    return out


def test_cohort_trains_scales_recovers_drains_and_is_deleted(cluster):
    c = cluster
    stats = os.path.join(c.tmp, "stats-%i.jsonl")
    args = ["--steps", "10000000", "--delay", "20ms", "--log-every", "50", "--stall-timeout",
            "60s", "--stats-file", stats]
    apply(c, cohort_manifest("lr", 3, args=args))

    # Three pods, each with the sidecar injected, all members.
    wait_members(c, "lr", ["lr-0", "lr-1", "lr-2"])
    st = status(c, "lr")
    assert st["epoch"] > 0 and st["leader"] in ("lr-0", "lr-1", "lr-2")
    assert st["selector"] == "cohort.dev/cohort=lr"
    assert st["observedGeneration"] == tc(c, "lr")["metadata"]["generation"]
    pod = [p for p in pods(c, "lr") if p["metadata"]["name"] == "lr-0"][0]
    side = pod["spec"]["initContainers"][0]
    assert side["name"] == "cohort-sidecar" and side["restartPolicy"] == "Always"
    owner = pod["metadata"]["ownerReferences"][0]
    assert owner["kind"] == "TrainingCohort" and owner["uid"] == tc(c, "lr")["metadata"]["uid"]
    assert owner["controller"] is True and owner["blockOwnerDeletion"] is True
    assert pod["metadata"]["labels"]["cohort.dev/ordinal"] == "0"
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["COHORT_COHORT"] == "default/lr"
    assert env["COHORT_BROKER"] == "127.0.0.1:%d" % c.broker_port
    wait_training(c, "lr")
    assert condition(c, "lr", "Available")["status"] == "True"
    header, row = c.kubectl("get", "tc", "lr").stdout.splitlines()[:2]
    assert header.split()[:5] == ["NAME", "DESIRED", "READY", "EPOCH", "LEADER"], header
    assert row.split()[:3] == ["lr", "3", "3"], row

    # kubectl scale goes through /scale; two more members join.
    c.kubectl("scale", "tc/lr", "--replicas=5")
    wait_members(c, "lr", ["lr-%d" % i for i in range(5)])
    wait_training(c, "lr")

    # kill -9 every process of one pod: the pod fails, is replaced under
    # the same name, and the restart is counted; training goes on.
    old_uid = [p for p in pods(c, "lr") if p["metadata"]["name"] == "lr-1"][0]["metadata"]["uid"]
    procs = c.kubelet.pids(NS, "lr-1")
    assert set(procs) == {"cohort-sidecar", "trainer"}, procs
    for pid in procs.values():
        os.kill(pid, signal.SIGKILL)
    wait_until(lambda: any(p["metadata"]["name"] == "lr-1" and p["metadata"]["uid"] != old_uid
                           for p in live_pods(c, "lr")), "lr-1 to be replaced")
    wait_until(lambda: status(c, "lr").get("restarts") == 1, "the restart to be counted")
    assert events(c, "lr", "Replacing")
    wait_members(c, "lr", ["lr-%d" % i for i in range(5)], "the replaced pod to rejoin")
    wait_training(c, "lr")

    # Scale down: the leaving members are drained through the broker
    # before their pods go, so the survivors lose no round.
    survivors = ["lr-0", "lr-1"]
    undos_before = {m: len(stats_events(stats.replace("%i", m), "undo")) for m in survivors}
    c.kubectl("scale", "tc/lr", "--replicas=2")
    wait_until(lambda: len(pods(c, "lr")) == 2, "the pods of lr-2..lr-4 to be deleted")
    wait_members(c, "lr", survivors)
    drained = sorted(e["message"].split()[1] for e in events(c, "lr", "Drained"))
    assert drained == ["lr-2", "lr-3", "lr-4"], events(c, "lr")
    assert not events(c, "lr", "DrainTimeout")
    wait_training(c, "lr")
    undos_after = {m: len(stats_events(stats.replace("%i", m), "undo")) for m in survivors}
    assert undos_after == undos_before, "a round was lost in the scale-down: %s -> %s" % (
        undos_before, undos_after)
    for m in survivors:
        # Each survivor committed every version in turn since it last
        # received state: no round was skipped or committed twice.
        commits = [e["v"] for e in stats_events(stats.replace("%i", m), "commit")]
        tail = commits[-min(len(commits), 40):]
        assert tail == list(range(tail[0], tail[0] + len(tail))), (m, tail)
        assert {e["size"] for e in stats_events(stats.replace("%i", m), "commit")[-3:]} == {2}
    cond = condition(c, "lr", "Progressing")
    wait_until(lambda: condition(c, "lr", "Progressing")["reason"] == "Stable",
               "Progressing to settle: %s" % cond)

    # Deleting the cohort takes its pods with it (owner references).
    c.kubectl("delete", "tc", "lr", "--wait=true")
    wait_until(lambda: not pods(c, "lr"), "lr's pods to be gone")
    op = c.operators[0]
    wait_until(lambda: "The cohort is gone; removed it from the broker." in op.text(),
               "the operator to forget lr")
    m = op.metrics()
    assert m["pods_created_total"] >= 6 and m["reconcile_errors_total"] == 0, m


def test_invalid_cohorts_are_refused_or_get_a_reason(cluster):
    c = cluster
    # The schema's CEL rule refuses replicas above maxReplicas.
    r = c.kubectl("apply", "-f", os.path.join(os.path.dirname(__file__), "..", "..", "examples",
                                              "k8s", "invalid-cohort.yaml"), check=False)
    assert r.returncode != 0 and "spec.replicas must not be above spec.maxReplicas" in r.stderr
    # Valid for the schema, impossible for the operator: the name does not
    # fit in a label value, so a Failed condition says why and no pod is made.
    name = "n" * 70
    apply(c, cohort_manifest(name, 1))
    wait_until(lambda: (condition(c, name, "Failed") or {}).get("reason") == "NameTooLong",
               "a NameTooLong condition")
    assert "label" in condition(c, name, "Failed")["message"]
    assert condition(c, name, "Available")["status"] == "False"
    assert not pods(c, name)
    assert events(c, name, "NameTooLong")
    c.kubectl("delete", "tc", name)


def test_api_errors_timeouts_and_dropped_watches_are_retried_without_duplicates(cluster):
    c = cluster
    op = c.operators[0]
    errors0 = op.metrics()["reconcile_errors_total"]
    creates0 = len(post_pod_creates(c))
    # Three creates fail with 500, then one is answered only after the
    # operator gave up waiting (a timeout that still created the pod),
    # then status writes fail twice with 503.
    c.server.fault(method="POST", path="/pods", userAgent="cohort-operator", status=500, count=3)
    c.server.fault(method="PATCH", path="/status", userAgent="cohort-operator", status=503,
                   count=2)
    apply(c, cohort_manifest("flaky", 2))
    wait_members(c, "flaky", ["flaky-0", "flaky-1"])
    assert len(live_pods(c, "flaky")) == 2
    assert op.metrics()["reconcile_errors_total"] >= errors0 + 3
    # Every pod was created exactly once: the failed tries got 500s.
    ok = [r for r in post_pod_creates(c)[creates0:] if r["code"] == 201]
    assert len(ok) == 2, ok

    # Dropped watches: the operator re-watches and still sees the scale.
    watches = op.metrics()["api_watches_total"]
    c.server.drop_watches()
    wait_until(lambda: op.metrics()["api_watches_total"] >= watches + 2,
               "both reflectors to watch again")
    c.kubectl("scale", "tc/flaky", "--replicas=3")
    wait_members(c, "flaky", ["flaky-0", "flaky-1", "flaky-2"])

    # A create the API server answers after the client timed out: the
    # retry gets AlreadyExists, and there is still one pod per ordinal.
    c.server.clear_faults()
    before = len(post_pod_creates(c))
    c.server.fault(method="POST", path="/pods", userAgent="cohort-operator", delay=4, count=1)
    c.kubectl("scale", "tc/flaky", "--replicas=4")
    wait_members(c, "flaky", ["flaky-%d" % i for i in range(4)])
    # The server logs a request when it answers: the delayed original may
    # still be asleep after its retry made the pod. Later tests count
    # creates, so it must be in the log before this test ends.
    wait_until(lambda: len(post_pod_creates(c)) >= before + 2,
               "the delayed create and its retry to be answered")
    names = sorted(p["metadata"]["name"] for p in live_pods(c, "flaky"))
    assert names == ["flaky-%d" % i for i in range(4)]
    c.server.clear_faults()
    c.kubectl("delete", "tc", "flaky")
    wait_until(lambda: not pods(c, "flaky"), "flaky's pods to be gone")


def test_operator_restart_keeps_pods_and_status_goes_on(cluster):
    c = cluster
    apply(c, cohort_manifest("keep", 2))
    wait_members(c, "keep", ["keep-0", "keep-1"])
    wait_training(c, "keep")
    uids = sorted(p["metadata"]["uid"] for p in pods(c, "keep"))
    epoch = status(c, "keep")["epoch"]
    creates = len(post_pod_creates(c))

    # kill -9: no release of the Lease, no goodbye to the broker.
    op = c.operators.pop(0)
    op.kill()
    op.log.close()
    new = Operator(c.server, c.tmp, "op-a2", c.broker_port)
    c.operators.insert(0, new)
    wait_until(lambda: new.metrics().get("is_leader") == 1, "the restarted operator to lead")
    wait_until(lambda: new.http("/readyz")[0] == 200, "the restarted operator to be ready")
    # The sidecars rejoin the new broker; the status moves on from there.
    wait_until(lambda: status(c, "keep").get("epoch", 0) > epoch, "a new epoch after the restart")
    wait_members(c, "keep", ["keep-0", "keep-1"])
    wait_training(c, "keep")
    assert sorted(p["metadata"]["uid"] for p in pods(c, "keep")) == uids
    assert len(post_pod_creates(c)) == creates, "the restarted operator created pods"
    c.kubectl("delete", "tc", "keep")
    wait_until(lambda: not pods(c, "keep"), "keep's pods to be gone")


def test_two_operators_elect_exactly_one_leader(cluster):
    c = cluster
    a = c.operators[0]
    b = Operator(c.server, c.tmp, "op-b", c.broker_port)
    c.operators.append(b)
    wait_until(lambda: a.metrics().get("is_leader") == 1, "one leader")
    leaders = [op.name for op in (a, b) if op.metrics()["is_leader"] == 1]
    assert leaders == [a.name], leaders
    code, text = b.http("/readyz")
    assert code == 503 and "standby" in text
    assert a.http("/readyz")[0] == 200
    lease = c.server.get("/apis/coordination.k8s.io/v1/namespaces/default/leases/cohort-operator")
    assert lease["spec"]["holderIdentity"] == a.name

    apply(c, cohort_manifest("duo", 2))
    wait_members(c, "duo", ["duo-0", "duo-1"])
    assert b.metrics()["pods_created_total"] == 0

    # The leader steps down (SIGTERM releases the Lease): the standby takes
    # over, and the cohort keeps its pods.
    uids = sorted(p["metadata"]["uid"] for p in pods(c, "duo"))
    assert a.stop() == 0, a.text()[-4000:]
    wait_until(lambda: b.metrics().get("is_leader") == 1, "op-b to take over")
    wait_until(lambda: b.http("/readyz")[0] == 200, "op-b to be ready")
    wait_members(c, "duo", ["duo-0", "duo-1"])
    c.kubectl("scale", "tc/duo", "--replicas=3")
    wait_members(c, "duo", ["duo-0", "duo-1", "duo-2"])
    assert sorted(p["metadata"]["uid"] for p in pods(c, "duo")
                  if p["metadata"]["name"] != "duo-2") == uids
    c.kubectl("delete", "tc", "duo")
    wait_until(lambda: not pods(c, "duo"), "duo's pods to be gone")

"""cohort-operator end to end: the real kubectl 1.32 against the API server
stand-in, the process kubelet running trainer pods (the C example trainer
and the injected cohort-sidecar) as local processes, and the real operator.

One stand-in cluster is shared by the module; each test uses its own
cohort names. Its operator serves the broker with TLS when the sidecar can
speak it (cohorttest.Operator), else without; a second, smaller cluster
(tls_cluster) always runs the operator with TLS, to check what it serves.
Every wait is on a condition with a generous deadline
($COHORT_TEST_DEADLINE, 60 s by default), never a fixed sleep.
Binaries: $COHORT_BIN (see tests/lib/cohorttest/programs.py).
"""
import base64
import hashlib
import hmac
import json
import os
import re
import signal
import socket
import ssl
import stat
import struct
import subprocess
import time

import pytest

from cohorttest import (Operator, bin_dir, cohort_manifest, operator_cluster, sidecar_speaks_tls,
                        wait_until)

NS = "default"
TC_PATH = "/apis/cohort.dev/v1alpha1/namespaces/default/trainingcohorts"


@pytest.fixture(scope="module")
def cluster():
    yield from operator_cluster("cop-")


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
    """The broker's members: an entry without modelVersion is a pod that
    failed and is no member (it has lastFailure alone)."""
    return sorted(m["id"] for m in status(c, name).get("members") or []
                  if not m.get("draining") and "modelVersion" in m)


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
    # The broker's datagram counters, one per kind; the sandbox's service
    # proxy relays TCP only, so its sidecars' datagrams reach no UDP port.
    assert m["broker_datagrams"] == 1, m
    kinds = {k[len('broker_datagrams_total{kind="'):-2] for k in m
             if k.startswith("broker_datagrams_total{")}
    assert kinds == {"accepted", "malformed", "unproved", "unattached", "replayed", "paced",
                     "acknowledged"}, m


def test_accumulator_and_reduction_fields_reach_every_member(cluster):
    """spec.accumulator and spec.reduction become the sidecars' flags, and
    the sidecars run with them: the settings they pinned and the
    algorithm their all-reduces use show in their logs."""
    c = cluster
    args = ["--steps", "10000000", "--delay", "20ms", "--log-every", "50", "--stall-timeout",
            "60s", "--virtual-batch", "4"]
    apply(c, cohort_manifest("pin", 2, args=args, extra_spec={
        "accumulator": {"virtualBatchSize": 4, "parallelGradients": 2},
        "reduction": {"algorithm": "ring", "compression": "topk:0.05"}}))
    wait_members(c, "pin", ["pin-0", "pin-1"])
    wait_training(c, "pin")
    for pod in live_pods(c, "pin"):
        side = pod["spec"]["initContainers"][0]
        flags = side.get("args") or side.get("command")
        for flag, value in (("--virtual-batch-size", "4"), ("--parallel-gradients", "2"),
                            ("--allreduce", "ring"), ("--compression", "topk:0.05")):
            assert flags[flags.index(flag) + 1] == value, flags
        name = pod["metadata"]["name"]

        def log(name=name):
            return c.kubectl("logs", name, "-c", "cohort-sidecar").stdout
        wait_until(lambda: "First all-reduce with this algorithm." in log(),
                   "%s's sidecar to reduce" % name)
        waiting = [ln for ln in log().splitlines() if "Waiting for the trainer." in ln]
        assert waiting and "virtual_batch_size=4" in waiting[-1] and \
            "parallel_gradients=2" in waiting[-1] and "allreduce=ring" in waiting[-1] and \
            "compression=topk:0.05" in waiting[-1], waiting
        algs = {m for m in re.findall(r"First all-reduce with this algorithm\..*?algorithm=(\S+)",
                                      log())}
        assert algs == {"ring"}, algs
    c.kubectl("delete", "tc", "pin", "--wait=true")
    wait_until(lambda: not pods(c, "pin"), "pin's pods to be gone")


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
    keys = broker_key_ids(c.operators[0], "keep")
    assert len(keys) == 1

    # kill -9: no release of the Lease, no goodbye to the broker.
    op = c.operators.pop(0)
    op.kill()
    op.log.close()
    new = Operator(c.server, c.tmp, "op-a2", c.broker_port)
    c.operators.insert(0, new)
    wait_until(lambda: new.metrics().get("is_leader") == 1, "the restarted operator to lead")
    wait_until(lambda: new.http("/readyz")[0] == 200, "the restarted operator to be ready")
    # Its broker has the cohort's key from the Secret before any worker
    # runs (ready means the workers run), so the pods are not replaced.
    assert broker_key_ids(new, "keep") == keys
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


# ---------------------------------------------------------------------------
# A Secret per cohort, and TLS for the broker
# ---------------------------------------------------------------------------

SECRETS = "/api/v1/namespaces/default/secrets"
SECRET_ENV = {"COHORT_SECRET_FILE", "COHORT_BROKER_CA", "COHORT_BROKER_SERVER_NAME"}


def leader(c):
    """The operator of c that leads now (earlier tests stop some)."""
    return wait_until(lambda: next((op for op in c.operators if op.p.poll() is None and
                                    op.metrics().get("is_leader") == 1), None), "a leader")


def secret(c, name):
    return c.server.get("%s/%s-cohort-key" % (SECRETS, name))


def secret_data(sec, k):
    return base64.b64decode(sec["data"][k]).decode() if sec and k in sec["data"] else None


def key_id(key_hex, ca_pem=None):
    """keys_id(): 16 hex digits of HMAC-SHA256 under the key of the label
    and the CA, each part preceded by its length (base/secret.h)."""
    def part(b):
        return struct.pack("<Q", len(b)) + b
    msg = part(b"cohort/key-id/v1") + part((ca_pem or "").encode())
    return hmac.new(bytes.fromhex(key_hex), msg, hashlib.sha256).hexdigest()[:16]


def broker_key_ids(op, name):
    """The ids of the keys the operator gave its broker for cohort name."""
    return re.findall(r"The broker has the cohort's key\. cohort=default/%s key_id=(\w+)" %
                      re.escape(name), op.text())


def volume_file(c, pod, name):
    """A file of the cohort's Secret as the kubelet wrote it for pod."""
    return os.path.join(c.tmp, "st", "pods", pod["metadata"]["uid"], "volumes",
                        "cohort-secret", name)


def container_log(c, pod, container):
    d = os.path.join(c.tmp, "logs", "default_%s_%s" % (pod["metadata"]["name"],
                                                      pod["metadata"]["uid"]), container)
    out = ""
    for f in sorted(os.listdir(d)) if os.path.isdir(d) else []:
        with open(os.path.join(d, f)) as fh:
            out += fh.read()
    return out


def check_keyed_pod(c, p, key, kid, tls):
    """What every trainer pod has of its cohort's Secret, and what the
    kubelet made of it."""
    name = p["metadata"]["labels"]["cohort.dev/cohort"]
    assert p["metadata"]["annotations"]["cohort.dev/key-id"] == kid
    spec = p["spec"]
    vol = [v for v in spec["volumes"] if v["name"] == "cohort-secret"]
    assert vol and vol[0]["secret"] == {"secretName": name + "-cohort-key", "defaultMode": 0o400}
    side = spec["initContainers"][0]
    assert side["name"] == "cohort-sidecar"
    mount = [m for m in side["volumeMounts"] if m["name"] == "cohort-secret"]
    assert mount == [{"name": "cohort-secret", "mountPath": "/etc/cohort/secret",
                      "readOnly": True}]
    env = {e["name"]: e.get("value") for e in side["env"]}
    assert env["COHORT_SECRET_FILE"] == "/etc/cohort/secret/key"
    if tls:
        assert env["COHORT_BROKER_CA"] == "/etc/cohort/secret/ca.crt"
        assert env["COHORT_BROKER_SERVER_NAME"] == "cohort-broker.default.svc"
    else:
        assert "COHORT_BROKER_CA" not in env and "COHORT_BROKER_SERVER_NAME" not in env
    # The trainer reaches the cohort through its sidecar: no key for it.
    for cont in spec["containers"]:
        assert all(m["name"] != "cohort-secret" for m in cont.get("volumeMounts") or [])
        assert not {e["name"] for e in cont.get("env") or []} & SECRET_ENV
    # The kubelet wrote the key, 0400, where the sidecar reads it.
    path = volume_file(c, p, "key")
    wait_until(lambda: os.path.exists(path), "the kubelet to write %s" % path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o400
    with open(path) as f:
        assert f.read() == key


def test_each_cohort_gets_its_secret_mounted_by_its_sidecars_alone(cluster):
    c = cluster
    op = leader(c)
    created0 = op.metrics()["keys_created_total"]
    apply(c, cohort_manifest("keyed", 2))
    wait_members(c, "keyed", ["keyed-0", "keyed-1"])
    wait_training(c, "keyed")

    s = secret(c, "keyed")
    assert s["type"] == "Opaque" and s["metadata"]["labels"] == {"cohort.dev/cohort": "keyed"}
    owners = s["metadata"]["ownerReferences"]
    assert len(owners) == 1 and owners[0]["uid"] == tc(c, "keyed")["metadata"]["uid"]
    assert owners[0]["kind"] == "TrainingCohort" and owners[0]["controller"] is True and \
        owners[0]["blockOwnerDeletion"] is True
    key = secret_data(s, "key")
    assert re.fullmatch(r"[0-9a-f]{64}", key), key
    ca = secret_data(s, "ca.crt")
    assert (ca is not None) == op.tls
    kid = key_id(key, ca)
    # The broker was given this Secret's key (the log names its id, and
    # nothing logs the key itself).
    assert broker_key_ids(op, "keyed") == [kid]
    assert key not in op.text()
    for p in pods(c, "keyed"):
        check_keyed_pod(c, p, key, kid, op.tls)
        # The sidecar read it: it warns when it runs without a key.
        assert "No --secret-file" not in container_log(c, p, "cohort-sidecar")
    assert op.metrics()["keys_created_total"] == created0 + 1
    assert events(c, "keyed", "KeyCreated")

    # The cohort goes, and its Secret with it (garbage collection through
    # the owner reference); the broker forgets the key.
    c.kubectl("delete", "tc", "keyed", "--wait=true")
    wait_until(lambda: secret(c, "keyed") is None, "keyed's Secret to be collected")
    wait_until(lambda: not pods(c, "keyed"), "keyed's pods to be gone")


def test_deleting_the_secret_rotates_the_key_and_replaces_the_pods(cluster):
    c = cluster
    op = leader(c)
    rolled0 = op.metrics()["pods_rolled_total"]
    apply(c, cohort_manifest("rot", 2))
    wait_members(c, "rot", ["rot-0", "rot-1"])
    wait_training(c, "rot")
    old = secret(c, "rot")
    old_key, ca = secret_data(old, "key"), secret_data(old, "ca.crt")
    old_uids = {p["metadata"]["uid"] for p in pods(c, "rot")}

    c.server.ok("DELETE", SECRETS + "/rot-cohort-key")
    wait_until(lambda: secret(c, "rot") and secret(c, "rot")["metadata"]["uid"] !=
               old["metadata"]["uid"], "a new Secret for rot")
    new_key = secret_data(secret(c, "rot"), "key")
    assert re.fullmatch(r"[0-9a-f]{64}", new_key) and new_key != old_key
    kid = key_id(new_key, ca)
    wait_until(lambda: kid in broker_key_ids(op, "rot"), "the broker to get the new key")
    # Every pod made with the old key is replaced, under its name, without
    # counting a restart; the new ones carry the new key.
    wait_until(lambda: len(live_pods(c, "rot")) == 2 and
               not old_uids & {p["metadata"]["uid"] for p in live_pods(c, "rot")},
               "rot's pods to be replaced")
    for p in live_pods(c, "rot"):
        check_keyed_pod(c, p, new_key, kid, op.tls)
    wait_members(c, "rot", ["rot-0", "rot-1"], "the new pods to join")
    wait_training(c, "rot")
    assert status(c, "rot").get("restarts") == 0
    assert events(c, "rot", "KeyChanged") and events(c, "rot", "RollingKey")
    assert op.metrics()["pods_rolled_total"] >= rolled0 + 2
    c.kubectl("delete", "tc", "rot")
    wait_until(lambda: not pods(c, "rot") and secret(c, "rot") is None, "rot to be gone")


def test_a_secret_of_the_name_the_cohort_does_not_own_is_left_alone(cluster):
    c = cluster
    c.server.ok("POST", SECRETS, {"metadata": {"name": "clash-cohort-key"},
                                  "stringData": {"key": "the user's own"}})
    before = secret(c, "clash")
    apply(c, cohort_manifest("clash", 1))
    wait_until(lambda: (condition(c, "clash", "Failed") or {}).get("reason") == "SecretConflict",
               "a SecretConflict condition")
    msg = condition(c, "clash", "Failed")["message"]
    assert "default/clash-cohort-key" in msg and "not owned" in msg, msg
    assert condition(c, "clash", "Available")["status"] == "False"
    assert events(c, "clash", "SecretConflict")
    assert not pods(c, "clash")
    after = secret(c, "clash")
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
    assert secret_data(after, "key") == "the user's own"
    assert not broker_key_ids(leader(c), "clash")

    # Once the user's Secret is gone, the cohort gets its own and runs.
    c.server.ok("DELETE", SECRETS + "/clash-cohort-key")
    wait_members(c, "clash", ["clash-0"])
    assert secret(c, "clash")["metadata"]["ownerReferences"][0]["uid"] == \
        tc(c, "clash")["metadata"]["uid"]
    wait_until(lambda: condition(c, "clash", "Failed")["status"] == "False",
               "the Failed condition to clear")
    c.kubectl("delete", "tc", "clash")
    wait_until(lambda: not pods(c, "clash") and secret(c, "clash") is None, "clash to be gone")


@pytest.mark.parametrize("flag, value", [("--broker-tls", "on"), ("--broker-service", "a.b"),
                                         ("--broker-service", ""), ("--broker-ca-secret", "a/b")])
def test_bad_tls_flags_are_usage_errors(flag, value):
    exe = os.path.join(bin_dir(), "cohort-operator")
    if not os.access(exe, os.X_OK):
        pytest.skip("no cohort-operator in %s" % bin_dir())
    r = subprocess.run([exe, "--kubeconfig", "/nonexistent", flag, value], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 2 and flag in r.stderr, (r.returncode, r.stderr)


@pytest.fixture(scope="module")
def tls_cluster():
    yield from operator_cluster("coptls-", tls=True)


def handshake(port, ca_pem=None, name="cohort-broker.default.svc"):
    """A TLS handshake with the broker as its clients make it (ALPN h2);
    the server's certificate, as the ssl module parses it."""
    ctx = ssl.create_default_context(cadata=ca_pem) if ca_pem else ssl.create_default_context()
    ctx.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        with ctx.wrap_socket(s, server_hostname=name) as t:
            return t.getpeercert()


def test_tls_broker_serves_a_certificate_of_the_operators_ca(tls_cluster):
    c = tls_cluster
    # Ready once it leads with the broker serving: the CA is made by then.
    wait_until(lambda: c.operators[0].http("/readyz")[0] == 200, "the operator to be ready")
    ca_sec = c.server.get(SECRETS + "/cohort-broker-ca")
    assert ca_sec["type"] == "kubernetes.io/tls"
    ca = secret_data(ca_sec, "ca.crt")
    assert ca == secret_data(ca_sec, "tls.crt") and "PRIVATE KEY" in secret_data(ca_sec, "tls.key")
    # A client that does not trust the operator's CA is refused.
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(c.broker_port)
    # One that does gets a certificate naming the broker Service and the
    # address pods are told, issued by the CA, for about a year.
    cert = handshake(c.broker_port, ca)
    sans = sorted(cert["subjectAltName"])
    assert sans == sorted([("DNS", "cohort-broker"), ("DNS", "cohort-broker.default"),
                           ("DNS", "cohort-broker.default.svc"),
                           ("DNS", "cohort-broker.default.svc.cluster.local"),
                           ("IP Address", "127.0.0.1")]), sans
    assert dict(x[0] for x in cert["issuer"])["commonName"] == "cohort broker CA"
    days = (ssl.cert_time_to_seconds(cert["notAfter"]) - ssl.cert_time_to_seconds(
        cert["notBefore"])) / 86400
    assert 364 < days < 366, days
    for name in ("cohort-broker.default.svc.cluster.local", "127.0.0.1"):
        handshake(c.broker_port, ca, name)
    # Another Service's name does not match.
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(c.broker_port, ca, "cohort-broker.other.svc")
    assert "The broker serves TLS." in c.operators[0].text()


def test_tls_cohort_secret_carries_the_ca_and_sidecars_are_told(tls_cluster):
    c = tls_cluster
    op = c.operators[0]
    apply(c, cohort_manifest("tlsc", 1))
    wait_until(lambda: secret(c, "tlsc") and live_pods(c, "tlsc"), "tlsc's Secret and pod")
    ca = secret_data(c.server.get(SECRETS + "/cohort-broker-ca"), "ca.crt")
    s = secret(c, "tlsc")
    assert secret_data(s, "ca.crt") == ca
    key = secret_data(s, "key")
    kid = key_id(key, ca)
    assert broker_key_ids(op, "tlsc") == [kid]
    p = live_pods(c, "tlsc")[0]
    check_keyed_pod(c, p, key, kid, True)
    side = {e["name"]: e.get("value") for e in p["spec"]["initContainers"][0]["env"]}
    assert side["COHORT_BROKER"] == "127.0.0.1:%d" % c.broker_port
    path = volume_file(c, p, "ca.crt")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o400
    with open(path) as f:
        assert f.read() == ca
    if sidecar_speaks_tls():
        # The sidecar joins the broker over TLS, checking the Service name.
        wait_members(c, "tlsc", ["tlsc-0"])
        wait_training(c, "tlsc")
    c.kubectl("delete", "tc", "tlsc")
    wait_until(lambda: not pods(c, "tlsc") and secret(c, "tlsc") is None, "tlsc to be gone")


# ---- failures, back-off and rollouts ----------------------------------------

def test_a_refused_pod_create_is_a_condition_and_a_warning_event(cluster):
    """A template the API server refuses (a container without an image:
    422) shows in kubectl within seconds: the ReplicaFailure condition with
    the API's reason and message, and a Warning Event. Fixing the template
    clears it and the pod is made."""
    c = cluster
    m = cohort_manifest("noimg", 1)
    del m["spec"]["template"]["spec"]["containers"][0]["image"]
    t0 = time.monotonic()
    apply(c, m)
    cond = wait_until(lambda: condition(c, "noimg", "ReplicaFailure"),
                      "the ReplicaFailure condition", timeout=5)
    ev = wait_until(lambda: events(c, "noimg", "FailedCreate"), "a FailedCreate Event",
                    timeout=max(0.5, 5 - (time.monotonic() - t0)))
    assert cond["status"] == "True" and cond["reason"] == "FailedCreate", cond
    assert "422" in cond["message"] and "Invalid" in cond["message"], cond
    assert "image" in cond["message"] and "noimg-0" in cond["message"], cond
    assert ev[0]["type"] == "Warning" and "image" in ev[0]["message"], ev
    assert not live_pods(c, "noimg")
    # kubectl shows it too.
    out = c.kubectl("get", "tc/noimg", "-o",
                    "jsonpath={.status.conditions[?(@.type=='ReplicaFailure')].message}").stdout
    assert "422" in out, out
    # Retried with back-off, not in a loop: one Event, counted.
    assert len(events(c, "noimg", "FailedCreate")) == 1, events(c, "noimg", "FailedCreate")
    c.kubectl("patch", "tc/noimg", "--type", "json", "-p", json.dumps([
        {"op": "add", "path": "/spec/template/spec/containers/0/image", "value": "cohort-examples"}]))
    wait_until(lambda: not condition(c, "noimg", "ReplicaFailure") and live_pods(c, "noimg"),
               "the condition to clear and the pod to be made")
    c.kubectl("delete", "tc/noimg", "--wait=true")


def test_a_crash_loop_backs_off_and_does_not_spend_the_budget(cluster):
    """A trainer that exits 1 at once: the first replacement is immediate,
    the next waits 10 s, then 20 s (as a kubelet's CrashLoopBackOff), so
    maxRestarts 3 is not spent within half a minute; the exit code is in
    the pod's status entry and in Events, which are counted, not
    repeated."""
    c = cluster
    m = cohort_manifest("crash", 1, max_restarts=3)
    m["spec"]["template"]["spec"]["containers"][0]["command"] = ["sh", "-c", "exit 1"]
    m["spec"]["template"]["spec"]["containers"][0]["args"] = []
    apply(c, m)
    seen = {}

    def restarts():
        r = status(c, "crash").get("restarts") or 0
        seen.setdefault(r, time.monotonic())
        return r

    wait_until(lambda: restarts() >= 1, "the first replacement")
    wait_until(lambda: restarts() >= 2, "the second replacement")
    assert seen[2] - seen[1] >= 9, "replaced again after %.1f s" % (seen[2] - seen[1])
    # The third failure waits 20 s: visible in status and in Events.
    entry = wait_until(lambda: [e for e in status(c, "crash").get("members") or []
                                if e["id"] == "crash-0" and
                                (e.get("lastFailure") or {}).get("backoffSeconds", 0) > 10],
                       "crash-0's back-off in status")[0]
    assert entry["lastFailure"]["exitCode"] == 1, entry
    assert "exited with code 1" in entry["lastFailure"]["message"], entry
    assert (condition(c, "crash", "Progressing") or {}).get("reason") == "BackOff"
    backoff = wait_until(lambda: [e for e in events(c, "crash", "BackOff") if e["count"] >= 2],
                         "the BackOff Event counted twice")
    assert backoff[0]["type"] == "Warning" and "crash-0" in backoff[0]["message"], backoff
    failed = events(c, "crash", "PodFailed")
    assert len(failed) == 1 and failed[0]["count"] >= 3, failed
    assert "exit" in failed[0]["message"] and "code 1" in failed[0]["message"], failed
    assert restarts() == 2, "replaced during its back-off"
    assert (condition(c, "crash", "Failed") or {}).get("status") != "True"
    # A handful of Events, not one per failure and replacement.
    assert len(events(c, "crash")) <= 8, [(e["reason"], e.get("count")) for e in events(c, "crash")]
    c.kubectl("delete", "tc/crash", "--wait=true")


def test_a_template_change_replaces_every_pod_max_unavailable_at_a_time(cluster):
    """A patched template rolls out: every pod made from the old one is
    drained and made again from the new one, one at a time
    (spec.rollout.maxUnavailable 1), while the others keep running;
    updatedReplicas reaches replicas and the restarts are not counted."""
    c = cluster
    apply(c, cohort_manifest("roll", 3))
    wait_members(c, "roll", ["roll-0", "roll-1", "roll-2"])
    assert status(c, "roll").get("updatedReplicas") == 3
    old = {p["metadata"]["uid"] for p in live_pods(c, "roll")}
    old_hash = {p["metadata"]["labels"]["cohort.dev/template-hash"] for p in live_pods(c, "roll")}
    assert len(old) == 3 and len(old_hash) == 1
    c.kubectl("patch", "tc/roll", "--type", "json", "-p", json.dumps([
        {"op": "add", "path": "/spec/template/spec/containers/0/env",
         "value": [{"name": "ROLLED", "value": "1"}]}]))
    worst = {"down": 0, "deleting": 0}

    def done():
        ps = pods(c, "roll")
        up = {p["metadata"]["name"] for p in ps if not p["metadata"].get("deletionTimestamp")
              and (p.get("status") or {}).get("phase") == "Running"}
        worst["down"] = max(worst["down"], 3 - len(up & {"roll-0", "roll-1", "roll-2"}))
        worst["deleting"] = max(worst["deleting"],
                                sum(1 for p in ps if p["metadata"].get("deletionTimestamp")))
        st = status(c, "roll")
        return (not old & {p["metadata"]["uid"] for p in ps} and len(up) == 3 and
                st.get("updatedReplicas") == 3 and
                (condition(c, "roll", "Progressing") or {}).get("reason") != "RollingUpdate")

    wait_until(done, "every pod of roll made from the new template", timeout=120)
    assert worst["down"] <= 1, "%d pods were down at once" % worst["down"]
    assert worst["deleting"] <= 1, "%d pods were deleted at once" % worst["deleting"]
    for p in live_pods(c, "roll"):
        assert p["metadata"]["labels"]["cohort.dev/template-hash"] not in old_hash
        env = {e["name"]: e.get("value") for e in p["spec"]["containers"][0].get("env") or []}
        assert env.get("ROLLED") == "1", p["metadata"]["name"]
    assert len(events(c, "roll", "RollingUpdate")) == 3
    assert status(c, "roll").get("restarts") == 0
    wait_members(c, "roll", ["roll-0", "roll-1", "roll-2"], "the new pods to join")
    c.kubectl("delete", "tc/roll", "--wait=true")

"""spec.reduction.integrity end to end: the real kubectl 1.32 and the real
operator against the API server stand-in, the process kubelet running each
pod's C example trainer beside the injected cohort-sidecar.

- A cohort with integrity mac: every pod's sidecar is rendered with
  --integrity mac and runs with it (its process's command line, read from
  /proc), beside the key it needs; every trainer container is told
  COHORT_INTEGRITY=mac; the members train together (each one's model
  version moves on in one epoch), so their tagged frames verify.
- Changed to none: every pod is replaced (the template hash covers mac),
  the new sidecars run without the flag, the trainers are told none, and
  the cohort trains again.
- A value other than none or mac is refused by the API server with the
  CRD's words, and no pod is made. (A value that reaches the operator
  anyway, from a server without the schema, is refused by it with an
  InvalidSpec condition: tests/unit/test_reconcile.c.)

What it does not cover: the stand-in's pods share one host's loopback, so
no frame is changed on a path here; tests/unit/test_allreduce.c and the
sidecar's tests change, replay and drop tagged frames.

Every wait is on a condition with a generous deadline
($COHORT_TEST_DEADLINE, 60 s by default), never a fixed sleep.
"""
import json
import os

import pytest

from cohorttest import (cohort_manifest, operator_cluster, wait_until)

TC_PATH = "/apis/cohort.dev/v1alpha1/namespaces/default/trainingcohorts"
HASH = "cohort.dev/template-hash"


@pytest.fixture(scope="module")
def cluster():
    yield from operator_cluster("tin-")


def status(c, name):
    return (c.server.get("%s/%s" % (TC_PATH, name)) or {}).get("status") or {}


def live_pods(c, name):
    doc = c.server.get("/api/v1/namespaces/default/pods?labelSelector=cohort.dev%%2Fcohort%%3D%s"
                       % name)
    return [p for p in (doc["items"] if doc else [])
            if not p["metadata"].get("deletionTimestamp")]


def versions(c, name):
    """{member: model version} of the members in the current epoch."""
    return {m["id"]: m["modelVersion"] for m in status(c, name).get("members") or []
            if "modelVersion" in m and not m.get("draining")}


def wait_training_together(c, name, ids, what):
    """Every one of ids is a member and its model version moves on by 20
    while all are: rounds commit among them."""
    wait_until(lambda: sorted(versions(c, name)) == sorted(ids), "%s to be members" % ids)
    start = versions(c, name)
    wait_until(lambda: sorted(versions(c, name)) == sorted(ids) and all(
        versions(c, name).get(i, 0) >= start[i] + 20 for i in ids), what, timeout=120)


def sidecar_argv(c, pod):
    """The command line of the sidecar process the kubelet started last
    for pod name `pod`, once that process is alive (a replaced pod's old
    one may be the last the kubelet's log names until the new one
    starts), else None."""
    pid = c.kubelet.pids("default", pod).get("cohort-sidecar")
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            return f.read().decode().split("\0")[:-1] or None
    except (OSError, TypeError):
        return None


def check_pod(c, pod, integrity):
    """The pod's sidecar is told (and runs with) --integrity mac exactly
    when integrity is mac, has its key, and the trainer is told the
    setting."""
    name = pod["metadata"]["name"]
    side = pod["spec"]["initContainers"][0]
    assert side["name"] == "cohort-sidecar"
    args = side["args"]
    want = ["--integrity", "mac"] if integrity == "mac" else []
    got = [a for i, a in enumerate(args) if a == "--integrity" or
           (i and args[i - 1] == "--integrity")]
    assert got == want, args
    side_env = {e["name"]: e.get("value") for e in side["env"]}
    assert side_env["COHORT_SECRET_FILE"] == "/etc/cohort/secret/key"
    assert "COHORT_INTEGRITY" not in side_env, "the sidecar's flag decides"
    trainer_env = [e for e in pod["spec"]["containers"][0]["env"]
                   if e["name"] == "COHORT_INTEGRITY"]
    assert trainer_env == [{"name": "COHORT_INTEGRITY", "value": integrity}], trainer_env
    # The process the kubelet started for this pod's sidecar has the flag
    # (called once the pod's member trains, so its sidecar is the last).
    argv = wait_until(lambda: sidecar_argv(c, name), "%s's sidecar process" % name)
    assert os.path.basename(argv[0]) == "cohort-sidecar", argv
    ran = [a for i, a in enumerate(argv) if a == "--integrity" or
           (i and argv[i - 1] == "--integrity")]
    assert ran == want, argv


def test_a_mac_cohort_trains_with_tagged_frames_and_a_change_rolls_every_pod(cluster):
    c = cluster
    m = cohort_manifest("im", 2, extra_spec={"reduction": {"integrity": "mac"}})
    c.kubectl("apply", "-f", "-", stdin=json.dumps(m))
    wait_until(lambda: len(live_pods(c, "im")) == 2, "im's two pods")
    assert c.kubectl.json("get", "tc", "im")["spec"]["reduction"]["integrity"] == "mac"
    wait_training_together(c, "im", ["im-0", "im-1"],
                           "im-0 and im-1 to commit rounds under --integrity mac")
    before = {p["metadata"]["name"]: p for p in live_pods(c, "im")}
    for p in before.values():
        check_pod(c, p, "mac")
    old_hash = {p["metadata"]["labels"][HASH] for p in before.values()}
    assert len(old_hash) == 1, old_hash

    # none: the hash changes, so both pods are drained and made again,
    # without the flag; the new members train together.
    c.kubectl("patch", "tc", "im", "--type", "merge", "-p",
              json.dumps({"spec": {"reduction": {"integrity": "none"}}}))

    def replaced():
        now = live_pods(c, "im")
        return len(now) == 2 and all(
            p["metadata"]["uid"] != before[p["metadata"]["name"]]["metadata"]["uid"] and
            p["metadata"]["labels"][HASH] not in old_hash for p in now)
    wait_until(replaced, "both of im's pods to be replaced after the change to none",
               timeout=120)
    wait_training_together(c, "im", ["im-0", "im-1"],
                           "im-0 and im-1 to commit rounds again without --integrity")
    for p in live_pods(c, "im"):
        check_pod(c, p, "none")
    assert (status(c, "im").get("updatedReplicas")) == 2
    c.kubectl("delete", "tc", "im", "--wait=true")
    wait_until(lambda: not live_pods(c, "im"), "im's pods to be gone")


def test_a_value_other_than_none_or_mac_is_refused_and_nothing_is_made(cluster):
    c = cluster
    for bad in ("hmac", "MAC"):
        m = cohort_manifest("ib", 1, extra_spec={"reduction": {"integrity": bad}})
        r = c.kubectl("apply", "-f", "-", stdin=json.dumps(m), check=False)
        assert r.returncode != 0 and 'Unsupported value: "%s"' % bad in r.stderr, r.stderr
        assert "spec.reduction.integrity" in r.stderr, r.stderr
    assert c.server.get("%s/ib" % TC_PATH) is None
    assert not live_pods(c, "ib")

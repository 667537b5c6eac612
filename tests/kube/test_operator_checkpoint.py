"""spec.checkpoint end to end: the real kubectl 1.32 and the real operator
against the API server stand-in and the process kubelet, whose pods run
the C example trainer (which keeps its state only in the cohort) beside
the injected cohort-sidecar.

- a cohort with spec.checkpoint on a hostPath volume (and on a claim)
  trains, is suspended until every pod is gone, and resumes from the
  newest checkpoint (its sidecars say so, and no member reports a version
  below it), not from version 0; status.checkpoint shows the version; a
  changed spec.checkpoint replaces the pods as a template change does;
- the newest checkpoint damaged while the cohort is suspended: the
  resumed cohort goes on from the older valid one, the damaged file is
  renamed NAME.skipped, and exactly one CheckpointSkipped Warning tells it
  (kubectl describe shows it);
- a spec.checkpoint without a period, with keep 0, or without a volume
  is refused by the API server with the CRD's words.

Every wait is on a condition with a generous deadline, never a fixed sleep.
"""
import json
import os
import re
import subprocess
import sys

import pytest

from cohorttest import (CRD_FILE, ROOT, cohort_manifest, operator_cluster, wait_until)

TC_PATH = "/apis/cohort.dev/v1alpha1/namespaces/default/trainingcohorts"
CKPT_RE = re.compile(r"^ckpt-(\d{20})\.cohort$")


@pytest.fixture(scope="module")
def cluster():
    yield from operator_cluster("tck-", tls=False)


def status(c, name):
    return (c.server.get("%s/%s" % (TC_PATH, name)) or {}).get("status") or {}


def live_pods(c, name):
    doc = c.server.get("/api/v1/namespaces/default/pods?labelSelector=cohort.dev%%2Fcohort%%3D%s"
                       % name)
    return [p for p in (doc["items"] if doc else [])
            if not p["metadata"].get("deletionTimestamp")]


def events(c, name, reason):
    doc = c.server.get("/api/v1/namespaces/default/events") or {"items": []}
    return [e for e in doc["items"] if e["involvedObject"].get("name") == name and
            e.get("reason") == reason]


def member_versions(c, name):
    return [m["modelVersion"] for m in status(c, name).get("members") or []
            if "modelVersion" in m and not m.get("draining")]


def checkpoints(d):
    """The versions of the checkpoint files in directory d, newest first."""
    if not os.path.isdir(d):
        return []
    return sorted((int(m.group(1)) for m in map(CKPT_RE.match, os.listdir(d)) if m),
                  reverse=True)


def manifest(name, volume, replicas=2):
    """volume: a directory for a hostPath, or a volume source."""
    m = cohort_manifest(name, replicas, args=["--steps", "10000000", "--delay", "20ms",
                                              "--log-every", "50", "--stall-timeout", "60s"])
    if isinstance(volume, str):
        volume = {"hostPath": {"path": volume}}
    m["spec"]["checkpoint"] = {"volume": volume, "everyVersions": 20, "keep": 3}
    return m


def suspend(c, name, on):
    c.kubectl("patch", "tc", name, "--type", "merge", "-p",
              json.dumps({"spec": {"suspend": on}}))


def sidecar_resumed(c, pod):
    """The version the pod's sidecar says it resumed from, or None."""
    r = c.kubectl("logs", pod, "-c", "cohort-sidecar", check=False)
    m = re.search(r"Resumed from a checkpoint\..*?version=(\d+)", r.stdout)
    return int(m.group(1)) if m else None


def train_then_suspend(c, name, d, at_least, volume=None):
    """Runs cohort `name` until it has checkpoints of at least version
    `at_least` in d (the volume's directory: a hostPath's unless `volume`
    says otherwise), then suspends it and waits until no pod is left."""
    sub = os.path.join(d, "default", name)
    c.kubectl("apply", "-f", "-", stdin=json.dumps(manifest(name, volume or d)))
    wait_until(lambda: checkpoints(sub) and checkpoints(sub)[0] >= at_least and
               len(checkpoints(sub)) >= 2, "checkpoints of version %d in %s" % (at_least, sub),
               timeout=120)
    wait_until(lambda: (status(c, name).get("checkpoint") or {}).get("version", 0) >= at_least,
               "status.checkpoint to show version %d" % at_least)
    suspend(c, name, True)
    wait_until(lambda: not live_pods(c, name) and not c.server.get(
        "/api/v1/namespaces/default/pods?labelSelector=cohort.dev%%2Fcohort%%3D%s" % name
    )["items"], "every pod of %s to be gone" % name, timeout=120)


def resume_and_check(c, name, expect):
    """Resumes cohort `name`; every sidecar must say it resumed from a
    checkpoint, the oldest of them `expect`, and no member may report a
    version below it."""
    suspend(c, name, False)
    lows = []

    def resumed():
        lows.extend(v for v in member_versions(c, name) if v < expect)
        pods = [p["metadata"]["name"] for p in live_pods(c, name)]
        return len(pods) == 2 and all(sidecar_resumed(c, p) is not None for p in pods)
    wait_until(resumed, "both sidecars of %s to resume from a checkpoint" % name, timeout=120)
    # The first sidecar to join resumes from `expect`; one that joins after
    # the cohort trained on may find a newer checkpoint its leader wrote.
    got = {p["metadata"]["name"]: sidecar_resumed(c, p["metadata"]["name"])
           for p in live_pods(c, name)}
    assert min(got.values()) == expect, "\n".join(
        c.kubectl("logs", p, "-c", "cohort-sidecar").stdout[-3000:] for p in got)
    wait_until(lambda: len(member_versions(c, name)) == 2 and
               min(member_versions(c, name)) > expect, "the members to train past %d" % expect)
    lows.extend(v for v in member_versions(c, name) if v < expect)
    assert not lows, "members reported versions below the checkpoint's %d: %s" % (expect, lows)


@pytest.mark.parametrize("kind", ["hostPath", "persistentVolumeClaim"])
def test_a_suspended_cohort_resumes_from_its_newest_checkpoint(cluster, kind):
    c = cluster
    if kind == "hostPath":
        d, volume = os.path.join(c.tmp, "ck-a"), None
    else:
        # The stand-in's claim: a directory of its node's (tests/kube/kubelet/pod.py).
        d = os.path.join(c.tmp, "st", "claims", "default", "shared")
        volume = {"persistentVolumeClaim": {"claimName": "shared"}}
    train_then_suspend(c, "ck-a", d, 60, volume)
    files = checkpoints(os.path.join(d, "default", "ck-a"))
    assert files and not checkpoints(d), "under NAMESPACE/NAME of the volume alone"
    assert len(files) <= 3, "keep: 3 (%s)" % files
    newest = files[0]
    # A checkpoint written while the leader drained may never have been
    # reported; what status shows is one that was written.
    shown = status(c, "ck-a")["checkpoint"]
    assert 60 <= shown["version"] <= newest and shown["time"], shown
    resume_and_check(c, "ck-a", newest)
    wait_until(lambda: status(c, "ck-a")["checkpoint"]["version"] >= newest,
               "status.checkpoint to show the version resumed from")
    assert not events(c, "ck-a", "CheckpointSkipped")
    if kind == "hostPath":
        # A changed spec.checkpoint rolls out as a template change does.
        hashes = {p["metadata"]["labels"]["cohort.dev/template-hash"] for p in live_pods(c, "ck-a")}
        c.kubectl("patch", "tc", "ck-a", "--type", "merge", "-p",
                  json.dumps({"spec": {"checkpoint": {"keep": 2}}}))

        def rolled():
            pods = live_pods(c, "ck-a")
            return len(pods) == 2 and all(
                p["metadata"]["labels"]["cohort.dev/template-hash"] not in hashes and
                "--checkpoint-keep 2" in " ".join(p["spec"]["initContainers"][0]["args"])
                for p in pods)
        wait_until(rolled, "the pods of ck-a to be made again with keep 2", timeout=120)
    c.kubectl("delete", "tc", "ck-a")
    wait_until(lambda: not c.server.get(
        "/api/v1/namespaces/default/pods?labelSelector=cohort.dev%2Fcohort%3Dck-a")["items"],
        "the pods of ck-a to be gone")


def test_a_damaged_newest_checkpoint_is_skipped_and_told_once(cluster):
    c = cluster
    d = os.path.join(c.tmp, "ck-b")
    train_then_suspend(c, "ck-b", d, 60)
    sub = os.path.join(d, "default", "ck-b")
    files = checkpoints(sub)
    assert len(files) >= 2, files
    newest, older = files[0], files[1]
    path = os.path.join(sub, "ckpt-%020d.cohort" % newest)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    with open(path, "rb") as f:
        damaged = f.read()
    resume_and_check(c, "ck-b", older)
    # Set aside as it was (a new checkpoint of the same version may have
    # been written since: the cohort trained on from the older one).
    with open(path + ".skipped", "rb") as f:
        assert f.read() == damaged
    wait_until(lambda: events(c, "ck-b", "CheckpointSkipped"), "a CheckpointSkipped event")
    st = status(c, "ck-b")["checkpoint"]
    assert st["lastSkipped"] == {"version": newest, "reason": "checksum mismatch"}, st
    # Heartbeats and resyncs (--resync 5s) go on: still one Event, once.
    resync = c.operators[0].metrics()["reconciles_total"]
    wait_until(lambda: c.operators[0].metrics()["reconciles_total"] >= resync + 5,
               "five more reconciles")
    evs = events(c, "ck-b", "CheckpointSkipped")
    assert len(evs) == 1 and evs[0].get("count", 1) == 1, evs
    assert evs[0]["type"] == "Warning"
    assert ("checkpoint of model version %d invalid (checksum mismatch)" % newest
            in evs[0]["message"]), evs[0]["message"]
    desc = c.kubectl("describe", "tc", "ck-b").stdout
    assert "CheckpointSkipped" in desc and "Warning" in desc, desc
    c.kubectl("delete", "tc", "ck-b")


@pytest.mark.parametrize("change,words", [
    (lambda ck: ck.pop("everyVersions"),
     "spec.checkpoint needs a period: everyVersions, everySeconds or both"),
    (lambda ck: ck.update(keep=0), "spec.checkpoint.keep: Invalid value: 0"),
    (lambda ck: ck.pop("volume"), "spec.checkpoint.volume: Required value"),
    (lambda ck: ck.update(volume={}), "spec.checkpoint.volume: Invalid value"),
    (lambda ck: ck.update(volume={"configMap": {"name": "x"}}),
     'unknown field "spec.checkpoint.volume.configMap"'),
])
def test_a_bad_checkpoint_spec_is_refused_by_the_api_server(cluster, change, words):
    c = cluster
    m = manifest("ck-bad", "/nonexistent")
    change(m["spec"]["checkpoint"])
    r = c.kubectl("apply", "-f", "-", stdin=json.dumps(m), check=False)
    assert r.returncode != 0 and words in r.stderr, r.stderr
    assert c.kubectl("get", "tc", "ck-bad", check=False).returncode != 0, "nothing was stored"


def test_the_crd_blocks_are_what_the_generator_makes(tmp_path):
    """spec.checkpoint.volume is the template's Volume less its name and the
    read-only sources: regenerating both blocks from the CRD changes
    nothing, so neither was edited by hand."""
    copy = tmp_path / "crd.yaml"
    copy.write_bytes(open(CRD_FILE, "rb").read())
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gen-podtemplate-schema.py"),
                    "--from-crd", str(copy), str(copy)], check=True)
    assert copy.read_bytes() == open(CRD_FILE, "rb").read()

"""Issue 14's proof from the chart and the image: the stand-in with the
kubelet's podman runtime (every container a `podman run` of its image),
RBAC enforced, TLS, the Deployment and Endpoints controllers, the service
proxy and cluster DNS.

- `helm install` of charts/cohort with the image built from this tree
  (image.repository=localhost/cohort, a tag of the test's own on that
  build, pull policy IfNotPresent): the operator Deployment's two pods run
  the image with the chart's ServiceAccount and restricted security
  context; the API server sees the operator as that ServiceAccount and its
  roles allow every request;
- a TrainingCohort shaped as examples/k8s/cohort.yaml, its trainers
  running cohort-example-logreg from the same image, trains with sidecars
  the operator injects from the same image;
- the leading operator's pod is deleted: the standby, on another address,
  takes the Lease and becomes the broker Service's endpoint; the same
  trainer pods (same uids, sidecars never restarted) rejoin its broker
  through the Service and training goes on (model versions keep rising,
  written by the new leader); the Deployment replaces the deleted pod;
- `helm uninstall` takes the operator's pods, and no container is left.

The image is built once per test process (cohorttest.image: seconds when
nothing changed). Skipped, with the reason printed, only where podman
cannot run. test_cluster.py proves the same broker move with the process
runtime (cheaper), plus what happens with no endpoint at all.
"""
import json
import os
import subprocess
import time

import pytest
import yaml

from cohorttest import (QUICK_SETS, ApiServer, Controllers, EXAMPLES, Helm, Kubectl, Kubelet,
                        make_tmp, remove_tmp, wait_until)
from cohorttest import image as cimage

OPNS = "cohort-system"
RELEASE = "cohort"
SA_USER = "system:serviceaccount:%s:%s" % (OPNS, RELEASE)
TC = "/apis/cohort.dev/v1alpha1/namespaces/default/trainingcohorts/"
# The podman kubelet's containers take longer than processes to start and
# stop; waits that span several of them get this much.
SLOW = 180


class Cluster:
    pass


@pytest.fixture(scope="module")
def cluster():
    try:
        why = cimage.why_podman_cannot_run()
    except cimage.BuildError as e:
        pytest.fail(str(e))
    if why:
        print("skipping the chart-and-image proof:", why)
        pytest.skip(why)
    tag, _ = cimage.current_image()
    c = Cluster()
    c.tmp = make_tmp("cpod-")
    c.pinned = cimage.PinnedImage(tag)
    c.server = ApiServer(c.tmp, "--tls", "--bookmark-interval", "0.5", "--authorization-mode",
                         "RBAC", "--enable-admission-plugins",
                         "OwnerReferencesPermissionEnforcement")
    c.server.default_token = "cohort-standin"      # the admin's: kubectl, helm, the test
    c.controllers = Controllers(c.server, c.tmp)
    c.kubelet = Kubelet(c.server, c.tmp, "--runtime", "podman")
    c.kubectl = Kubectl(c.server, c.tmp)
    c.helm = Helm(c.server.kubeconfig, c.tmp)
    try:
        if not c.kubectl.available():
            pytest.skip("kubectl is not in build/tools: %s" % c.kubectl.why_missing)
        if not c.helm.available():
            pytest.skip("helm is not in build/tools: %s" % c.helm.why_missing)
        yield c
    finally:
        c.kubelet.stop()
        left = subprocess.run(["podman", "ps", "-a", "-q", "--filter", "label=io.cohort.kubelet="
                               + os.path.join(c.tmp, "st")], capture_output=True, text=True,
                              timeout=120).stdout.split()
        assert c.controllers.stop() == 0, open(c.controllers.log_path).read()[-4000:]
        c.server.stop()
        c.pinned.remove()
        assert left == [], "the kubelet left containers behind: %s" % left
        remove_tmp(c.tmp)


def get(c, path):
    return c.server.get(path) or {}


def ready(p):
    return any(cd["type"] == "Ready" and cd["status"] == "True"
               for cd in (p.get("status") or {}).get("conditions") or [])


def operator_pods(c):
    items = get(c, "/api/v1/namespaces/%s/pods?labelSelector=app.kubernetes.io%%2Finstance%%3D"
                   "%s" % (OPNS, RELEASE)).get("items") or []
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def leader_pod(c):
    """The one Ready operator pod, when exactly one is."""
    r = [p for p in operator_pods(c) if ready(p)]
    return r[0] if len(r) == 1 else None


def broker_endpoints(c):
    ep = get(c, "/api/v1/namespaces/%s/endpoints/cohort-broker" % OPNS)
    return [a["ip"] for ss in ep.get("subsets") or [] for a in ss.get("addresses") or []]


def lease_holder(c):
    lease = get(c, "/apis/coordination.k8s.io/v1/namespaces/%s/leases/cohort-operator" % OPNS)
    return (lease.get("spec") or {}).get("holderIdentity")


def status(c, name):
    return get(c, TC + name).get("status") or {}


def trainer_pods(c, name):
    items = get(c, "/api/v1/namespaces/default/pods?labelSelector=cohort.dev%%2Fcohort%%3D%s"
                   % name).get("items") or []
    return {p["metadata"]["name"]: p for p in items}


def wait_training(c, name, what):
    start = status(c, name).get("modelVersion") or 0
    wait_until(lambda: (status(c, name).get("modelVersion") or 0) > start and
               status(c, name).get("readyReplicas") == 2,
               "%s: %s to train past version %d" % (what, name, start), timeout=SLOW)
    return status(c, name)["modelVersion"]


def statuses(p):
    st = p.get("status") or {}
    return (st.get("initContainerStatuses") or []) + (st.get("containerStatuses") or [])


def assert_rbac_allowed_all(c):
    got = [d for d in c.server.call("GET", "/debug/cohort/rbac")[1]["decisions"]
           if d["user"] == SA_USER]
    assert got, "no request of the operator's was authorized"
    denied = [d for d in got if not d["allowed"]]
    assert not denied, "the operator was refused: %s" % json.dumps(denied[:5], indent=1)


def example_cohort(image):
    """examples/k8s/cohort.yaml with two replicas and its trainer from image."""
    with open(os.path.join(EXAMPLES, "cohort.yaml")) as f:
        tc = yaml.safe_load(f)
    tc["metadata"]["namespace"] = "default"
    tc["spec"].update(replicas=2, minReplicas=1)
    trainer = tc["spec"]["template"]["spec"]["containers"][0]
    assert trainer["command"] == ["cohort-example-logreg"], trainer
    trainer["image"] = image
    trainer["imagePullPolicy"] = "IfNotPresent"
    return tc


def test_the_charts_operator_runs_from_the_image_and_the_broker_moves(cluster):
    c = cluster
    img = c.pinned.ref
    t0 = time.monotonic()
    # The chart as a user installs it, pointed at the local build; Lease
    # timings short enough for a test.
    c.helm.install_cohort("image.repository=" + c.pinned.repository, "image.tag=" + c.pinned.tag,
                          "image.pullPolicy=IfNotPresent", *QUICK_SETS,
                          release=RELEASE, namespace=OPNS)
    c.kubectl("wait", "--for", "condition=Established", "crd/trainingcohorts.cohort.dev")
    wait_until(lambda: len(operator_pods(c)) == 2 and leader_pod(c) and
               all(s.get("started") for p in operator_pods(c) for s in statuses(p)),
               "two operator pods running, one of them the ready leader", timeout=SLOW)
    op1 = leader_pod(c)
    t_install = time.monotonic() - t0
    for p in operator_pods(c):
        assert p["spec"]["serviceAccountName"] == RELEASE
        (st,) = statuses(p)
        assert st["image"] == img and st["imageID"] == "podman://" + c.pinned.id, st
        assert st["containerID"].startswith("podman://k8s_operator_"), st
    wait_until(lambda: broker_endpoints(c) == [op1["status"]["podIP"]],
               "the broker Service's endpoint to be the leader", timeout=SLOW)
    assert lease_holder(c) == op1["metadata"]["name"]

    # A cohort shaped as the example, its trainers from the same image.
    t1 = time.monotonic()
    c.kubectl("apply", "-f", "-", stdin=json.dumps(example_cohort(img)))
    wait_until(lambda: status(c, "logreg").get("readyReplicas") == 2,
               "two ready members of logreg", timeout=SLOW)
    v1 = wait_training(c, "logreg", "before the operator moves")
    t_cohort = time.monotonic() - t1
    pods = trainer_pods(c, "logreg")
    assert sorted(pods) == ["logreg-0", "logreg-1"], sorted(pods)
    uids = {n: p["metadata"]["uid"] for n, p in pods.items()}
    for p in pods.values():
        sts = {s["name"]: s for s in statuses(p)}
        assert set(sts) == {"cohort-sidecar", "trainer"}, sts
        for s in sts.values():
            assert s["image"] == img and s["imageID"] == "podman://" + c.pinned.id, s
        side = [x for x in p["spec"]["initContainers"] if x["name"] == "cohort-sidecar"][0]
        assert side["image"] == img and side["imagePullPolicy"] == "IfNotPresent", side
        env = {e["name"]: e.get("value") for e in p["spec"]["containers"][0]["env"]}
        assert env["COHORT_BROKER"] == "cohort-broker.%s.svc:7070" % OPNS, env
    users = {r["user"] for r in c.server.requests() if "cohort-operator" in (r["userAgent"] or "")}
    assert users == {SA_USER}, users

    # The leader's pod goes at once: the standby, on another address,
    # takes the Lease and the Service; the trainers rejoin it.
    t2 = time.monotonic()
    c.kubectl("delete", "pod", "-n", OPNS, op1["metadata"]["name"], "--grace-period=0",
              "--force")
    wait_until(lambda: leader_pod(c) and leader_pod(c)["metadata"]["name"] !=
               op1["metadata"]["name"], "another operator pod to lead", timeout=SLOW)
    op2 = leader_pod(c)
    assert op2["status"]["podIP"] != op1["status"]["podIP"]
    wait_until(lambda: broker_endpoints(c) == [op2["status"]["podIP"]],
               "the Service to point at the new leader", timeout=SLOW)
    wait_until(lambda: lease_holder(c) == op2["metadata"]["name"], "the Lease to name it")
    v2 = wait_training(c, "logreg", "after the operator moved")
    t_move = time.monotonic() - t2
    assert v2 > v1
    pods = trainer_pods(c, "logreg")
    assert {n: p["metadata"]["uid"] for n, p in pods.items()} == uids, "trainer pods were remade"
    for p in pods.values():
        for s in statuses(p):
            assert s["restartCount"] == 0 and "running" in s["state"], s
    # The old leader's container is gone: status written now is the new one's.
    wait_until(lambda: subprocess.run(
        ["podman", "ps", "-q", "--filter", "label=io.kubernetes.pod.uid=" +
         op1["metadata"]["uid"]], capture_output=True, text=True).stdout.strip() == "",
        "the deleted pod's container to be gone", timeout=SLOW)
    wait_training(c, "logreg", "with the old leader gone")
    # The Deployment replaced the deleted pod.
    wait_until(lambda: len(operator_pods(c)) == 2 and op1["metadata"]["name"] not in
               [p["metadata"]["name"] for p in operator_pods(c)],
               "the Deployment to replace the deleted pod", timeout=SLOW)
    assert_rbac_allowed_all(c)

    # Uninstall: the cohort first (its pods go), then the release.
    t3 = time.monotonic()
    c.kubectl("delete", "trainingcohort", "logreg", "--wait=true", "--timeout=%ds" % SLOW)
    wait_until(lambda: not trainer_pods(c, "logreg"), "the cohort's pods to go", timeout=SLOW)
    c.helm("uninstall", RELEASE, "--namespace", OPNS, "--wait", "--timeout", "%ds" % SLOW,
           timeout=SLOW + 30)
    wait_until(lambda: not operator_pods(c), "the operator's pods to go", timeout=SLOW)
    print("times: install to a ready leader %.1f s, cohort to training %.1f s, broker move to "
          "training again %.1f s, uninstall %.1f s" % (t_install, t_cohort, t_move,
                                                        time.monotonic() - t3))

"""The operator as a cluster runs it, on the stand-in: the chart
(charts/cohort), installed with the real helm, makes a Deployment whose
pod talks to the API server with its ServiceAccount's token
(--in-cluster, over TLS), with the broker Service in front of it; the
stand-in's controllers (Deployments, Endpoints), the process kubelet's
service proxy and cluster DNS, and trainer pods whose sidecars reach the
broker by the Service's name.

The proof of issue 14's broker Service: the operator's pod is deleted,
the Deployment brings it back on another address, and the same trainer
pods rejoin its broker and train on. With no ready endpoint, the
clusterIP refuses connections and the sidecars keep retrying. The same
proof with the operator, sidecars and trainers as podman containers of
the image is test_cluster_podman.py.
"""
import json
import os
import socket

import pytest

from cohorttest import (QUICK_SETS, ApiServer, Controllers, Helm, Kubectl, Kubelet, bin_dir,
                        cohort_manifest, make_tmp, remove_tmp, wait_until)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
OPNS = "cohort-system"
RELEASE = "cohort"              # the chart's objects are named after it
SA_USER = "system:serviceaccount:%s:%s" % (OPNS, RELEASE)
TC = "/apis/cohort.dev/v1alpha1/namespaces/default/trainingcohorts/"


class Cluster:
    pass


@pytest.fixture(scope="module")
def cluster():
    if not os.access(os.path.join(bin_dir(), "cohort-operator"), os.X_OK):
        pytest.skip("no cohort-operator in %s (make asan, or set COHORT_BIN)" % bin_dir())
    if os.geteuid() != 0:
        pytest.skip("cluster DNS and ServiceAccount tokens in pods need root (mount namespaces)")
    c = Cluster()
    c.tmp = make_tmp("ccl-")
    # RBAC enforced, as a cluster does: the operator has only what the
    # chart's roles grant its ServiceAccount; everyone else here is the
    # admin (the kubeconfig's token).
    c.server = ApiServer(c.tmp, "--tls", "--bookmark-interval", "0.5", "--authorization-mode",
                         "RBAC", "--enable-admission-plugins",
                         "OwnerReferencesPermissionEnforcement")
    c.server.default_token = "cohort-standin"
    c.controllers = Controllers(c.server, c.tmp)
    c.kubelet = Kubelet(c.server, c.tmp)
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
        assert c.controllers.stop() == 0, open(c.controllers.log_path).read()[-4000:]
        c.server.stop()
        remove_tmp(c.tmp)


def get(c, path):
    return c.server.get(path) or {}


def operator_pods(c, ready=None):
    items = get(c, "/api/v1/namespaces/%s/pods?labelSelector=app.kubernetes.io%%2Finstance%%3D"
                   "%s" % (OPNS, RELEASE)).get("items") or []
    out = [p for p in items if not p["metadata"].get("deletionTimestamp")]
    if ready is not None:
        out = [p for p in out if any(cd["type"] == "Ready" and cd["status"] == "True"
                                     for cd in p["status"].get("conditions") or []) == ready]
    return out


def broker_endpoints(c):
    ep = get(c, "/api/v1/namespaces/%s/endpoints/cohort-broker" % OPNS)
    return [a["ip"] for ss in ep.get("subsets") or [] for a in ss.get("addresses") or []]


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
               "%s: %s to train past version %d" % (what, name, start))


def lease_holder(c):
    lease = get(c, "/apis/coordination.k8s.io/v1/namespaces/%s/leases/cohort-operator" % OPNS)
    return (lease.get("spec") or {}).get("holderIdentity")


def assert_rbac_allowed_all(c):
    got = [d for d in c.server.call("GET", "/debug/cohort/rbac")[1]["decisions"]
           if d["user"] == SA_USER]
    assert got, "no request of the operator's was authorized"
    denied = [d for d in got if not d["allowed"]]
    assert not denied, "the operator was refused: %s" % json.dumps(denied[:5], indent=1)


def refused(ip, port):
    s = socket.socket()
    s.settimeout(5)
    try:
        s.connect((ip, port))
        return False
    except ConnectionRefusedError:
        return True
    finally:
        s.close()


def sidecar_log(c, pod):
    d = [x for x in os.listdir(os.path.join(c.tmp, "logs")) if x.startswith("default_%s_" % pod)]
    with open(os.path.join(c.tmp, "logs", d[0], "cohort-sidecar", "0.log")) as f:
        return f.read()


def test_trainers_reach_the_broker_through_its_service_and_survive_the_operator_moving(cluster):
    c = cluster
    # The chart as a user installs it (its CRD included), one replica so
    # that the deleted pod's replacement is the next leader, and a Lease
    # short enough for a test.
    c.helm.install_cohort("operator.replicas=1", *QUICK_SETS, release=RELEASE, namespace=OPNS)
    c.kubectl("wait", "--for", "condition=Established", "crd/trainingcohorts.cohort.dev")
    svc = get(c, "/api/v1/namespaces/%s/services/cohort-broker" % OPNS)
    cluster_ip = svc["spec"]["clusterIP"]
    assert cluster_ip.startswith("127.96."), svc["spec"]
    wait_until(lambda: len(operator_pods(c, ready=True)) == 1, "the operator pod to be ready")
    op1 = operator_pods(c)[0]
    assert op1["metadata"]["labels"]["pod-template-hash"]
    assert op1["metadata"]["ownerReferences"][0]["kind"] == "Deployment"
    wait_until(lambda: broker_endpoints(c) == [op1["status"]["podIP"]],
               "the broker Service's endpoint to be the operator pod")
    dep = get(c, "/apis/apps/v1/namespaces/%s/deployments/%s" % (OPNS, RELEASE))
    assert dep["status"]["readyReplicas"] == 1, dep["status"]

    c.kubectl("apply", "-f", "-", stdin=json.dumps(cohort_manifest("svc", 2)))
    pods = {}
    wait_until(lambda: status(c, "svc").get("readyReplicas") == 2, "two members of svc")
    pods = trainer_pods(c, "svc")
    uids = {n: p["metadata"]["uid"] for n, p in pods.items()}
    env = {e["name"]: e.get("value") for e in pods["svc-0"]["spec"]["containers"][0]["env"]}
    assert env["COHORT_BROKER"] == "cohort-broker.%s.svc:7070" % OPNS, env
    wait_training(c, "svc", "before the operator moves")
    assert lease_holder(c) == op1["metadata"]["name"]
    # The operator used the chart's ServiceAccount's token, and its roles
    # allowed every request.
    users = {r["user"] for r in c.server.requests() if "cohort-operator" in (r["userAgent"] or "")}
    assert users == {SA_USER}, users
    assert_rbac_allowed_all(c)

    # Delete the operator's pod at once: the Deployment makes another, on
    # another address; it takes the Lease, serves the broker behind the
    # same Service, and the same trainer pods rejoin it.
    c.kubectl("delete", "pod", "-n", OPNS, op1["metadata"]["name"], "--grace-period=0",
              "--force")
    wait_until(lambda: [p["metadata"]["name"] for p in operator_pods(c, ready=True)] not in
               ([], [op1["metadata"]["name"]]), "a new operator pod to be ready")
    op2 = operator_pods(c, ready=True)[0]
    assert op2["status"]["podIP"] != op1["status"]["podIP"]
    wait_until(lambda: broker_endpoints(c) == [op2["status"]["podIP"]],
               "the Service to point at the new pod")
    wait_until(lambda: lease_holder(c) == op2["metadata"]["name"], "the new pod to lead")
    wait_training(c, "svc", "after the operator moved")
    pods = trainer_pods(c, "svc")
    assert {n: p["metadata"]["uid"] for n, p in pods.items()} == uids, "trainer pods were remade"
    for p in pods.values():
        side = [s for s in p["status"].get("initContainerStatuses") or []
                if s["name"] == "cohort-sidecar"][0]
        assert side["restartCount"] == 0, side

    # No ready endpoint: the clusterIP refuses connections, the sidecars
    # keep retrying without crashing; training resumes once one is back.
    c.kubectl("scale", "-n", OPNS, "deployment/" + RELEASE, "--replicas=0")
    wait_until(lambda: not operator_pods(c) and not broker_endpoints(c),
               "the operator pods and the endpoints to be gone")
    wait_until(lambda: refused(cluster_ip, 7070), "the clusterIP to refuse connections")
    before = {n: sidecar_log(c, n).count("\n") for n in pods}
    wait_until(lambda: all(sidecar_log(c, n).count("\n") > before[n] + 2 for n in pods),
               "the sidecars to log their retries")
    pods_now = trainer_pods(c, "svc")
    assert {n: p["metadata"]["uid"] for n, p in pods_now.items()} == uids
    for p in pods_now.values():
        side = [s for s in p["status"].get("initContainerStatuses") or []
                if s["name"] == "cohort-sidecar"][0]
        assert side["restartCount"] == 0 and "running" in side["state"], side
    c.kubectl("scale", "-n", OPNS, "deployment/" + RELEASE, "--replicas=1")
    wait_until(lambda: len(operator_pods(c, ready=True)) == 1, "the operator to be back")
    wait_training(c, "svc", "after the broker had no endpoint")
    assert {n: p["metadata"]["uid"] for n, p in trainer_pods(c, "svc").items()} == uids
    assert_rbac_allowed_all(c)


def web_pods(c):
    items = get(c, "/api/v1/namespaces/default/pods?labelSelector=app%3Dweb").get("items") or []
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def test_deployments_endpoints_and_cluster_dns(cluster):
    """The stand-in's pieces on their own: a Deployment keeps its replicas
    and rolls a changed template; Endpoints list ready pods only (unless
    publishNotReadyAddresses); a pod resolves a Service by each of its
    names."""
    c = cluster
    server = ["python3", "-m", "http.server", "--bind", "$(POD_IP)", "8000"]
    dep = {"apiVersion": "apps/v1", "kind": "Deployment",
           "metadata": {"name": "web", "namespace": "default"},
           "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "web"}},
                    "template": {"metadata": {"labels": {"app": "web"}}, "spec": {
                        "terminationGracePeriodSeconds": 1,
                        "containers": [{"name": "web", "image": "python", "command": server,
                                        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {
                                            "fieldPath": "status.podIP"}}}],
                                        "readinessProbe": {"tcpSocket": {"port": 8000},
                                                           "periodSeconds": 1}}]}}}}
    svcs = [{"apiVersion": "v1", "kind": "Service",
             "metadata": {"name": name, "namespace": "default"},
             "spec": {"selector": {"app": "web"}, "publishNotReadyAddresses": publish,
                      "ports": [{"port": 80, "targetPort": 8000}]}}
            for name, publish in (("web", False), ("web-all", True))]
    for obj in [dep] + svcs:
        c.kubectl("apply", "-f", "-", stdin=json.dumps(obj))

    def ready_ips():
        return sorted(p["status"]["podIP"] for p in web_pods(c)
                      if any(cd["type"] == "Ready" and cd["status"] == "True"
                             for cd in p["status"].get("conditions") or []))

    def ep(name):
        e = get(c, "/api/v1/namespaces/default/endpoints/" + name)
        return sorted(a["ip"] for ss in e.get("subsets") or [] for a in ss.get("addresses") or [])

    wait_until(lambda: len(ready_ips()) == 2 and ep("web") == ready_ips(),
               "two ready web pods, the web Service's endpoints")
    first = {p["metadata"]["name"] for p in web_pods(c)}

    # A deleted pod is replaced.
    victim = sorted(first)[0]
    c.kubectl("delete", "pod", victim, "--wait=false")
    wait_until(lambda: len(ready_ips()) == 2 and victim not in
               {p["metadata"]["name"] for p in web_pods(c)}, "the deleted pod to be replaced")

    # A pod that is not ready is left out of addresses, but not with
    # publishNotReadyAddresses.
    c.kubectl("patch", "deployment", "web", "--type", "json", "-p", json.dumps([
        {"op": "replace", "path": "/spec/template/spec/containers/0/readinessProbe",
         "value": {"tcpSocket": {"port": 9}, "periodSeconds": 1}}]))
    wait_until(lambda: len(web_pods(c)) >= 3, "a pod of the new template")
    new_hash = lambda p: p["metadata"]["labels"]["pod-template-hash"]  # noqa: E731
    hashes = {new_hash(p) for p in web_pods(c)}
    assert len(hashes) == 2, hashes
    unready = [p for p in web_pods(c) if p["status"].get("podIP") and
               p["metadata"]["name"] not in first and not any(
                   cd["type"] == "Ready" and cd["status"] == "True"
                   for cd in p["status"].get("conditions") or [])]
    wait_until(lambda: ep("web-all") and set(ep("web-all")) > set(ep("web")),
               "web-all to list the not-ready pods too")
    assert not set(p["status"]["podIP"] for p in unready) & set(ep("web"))
    d = get(c, "/apis/apps/v1/namespaces/default/deployments/web")["status"]
    assert d["updatedReplicas"] >= 1 and d["readyReplicas"] == 2, d

    # A template that becomes ready again rolls through: only pods of the
    # last template remain.
    c.kubectl("patch", "deployment", "web", "--type", "json", "-p", json.dumps([
        {"op": "replace", "path": "/spec/template/spec/containers/0/readinessProbe",
         "value": {"tcpSocket": {"port": 8000}, "periodSeconds": 2}}]))
    wait_until(lambda: len({new_hash(p) for p in web_pods(c)}) == 1 and
               len(ready_ips()) == 2 and len(web_pods(c)) == 2 and
               new_hash(web_pods(c)[0]) not in hashes, "the rollout to finish")
    wait_until(lambda: get(c, "/apis/apps/v1/namespaces/default/deployments/web")["status"]
               .get("updatedReplicas") == 2, "the Deployment's status to catch up")

    # Cluster DNS: a pod resolves the Service by every name it has, and
    # reaches it through the clusterIP.
    ip = get(c, "/api/v1/namespaces/default/services/web")["spec"]["clusterIP"]
    names = ["web", "web.default", "web.default.svc", "web.default.svc.cluster.local"]
    script = ("import socket, urllib.request\n"
              "for n in %r: print(n, socket.gethostbyname(n))\n"
              "print('http', urllib.request.urlopen('http://web/', timeout=10).status)\n" % names)
    c.kubectl("apply", "-f", "-", stdin=json.dumps({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "dig", "namespace": "default"},
        "spec": {"restartPolicy": "Never", "containers": [{
            "name": "dig", "image": "python", "command": ["python3", "-c", script]}]}}))
    wait_until(lambda: get(c, "/api/v1/namespaces/default/pods/dig").get("status", {})
               .get("phase") in ("Succeeded", "Failed"), "the dig pod to finish")
    out = c.kubectl("logs", "dig").stdout
    for n in names:
        assert "%s %s" % (n, ip) in out, out
    assert "http 200" in out, out
    c.kubectl("delete", "deployment", "web")
    wait_until(lambda: not web_pods(c), "the Deployment's pods to go with it")

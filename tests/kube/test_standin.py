"""Proves the Kubernetes stand-in's semantics: the API server
(tests/kube/apiserver/) with the real kubectl 1.32 and over plain HTTP, and
the process kubelet (tests/kube/kubelet/) running pods as local processes.

Every server and kubelet is a real process on loopback with a free port.
Tests wait on conditions with generous deadlines, never on fixed sleeps.
kubectl comes from build/tools/, put there by scripts/install-kubectl.sh;
only the kubectl tests are skipped, with the reason, if it cannot be had.
"""
import http.client
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request

import pytest

from apiserver import CelError, cel_compile, cel_eval   # the CEL evaluator, in-process
from cohorttest import (CRD_FILE, DEADLINE, EXAMPLES, ROOT, ApiServer, Kubectl, Kubelet,
                        make_tmp, remove_tmp, wait_until)

PYTHON = sys.executable


# ---------------------------------------------------------------------------
# Processes and watches
# ---------------------------------------------------------------------------


class Watch:
    """A watch request read on a thread; events land in a list."""

    def __init__(self, server, path):
        self.events = []
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=DEADLINE)
        self.conn.request("GET", path)
        self.resp = self.conn.getresponse()
        assert self.resp.status == 200, self.resp.read()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        try:
            for line in self.resp:
                if line.strip():
                    with self.lock:
                        self.events.append(json.loads(line))
        except (OSError, ValueError, AttributeError, http.client.HTTPException):
            pass            # the socket was shut down under the reader by close()
        finally:
            self.done.set()

    def snapshot(self):
        with self.lock:
            return list(self.events)

    def wait_for(self, pred, what):
        """Waits until pred(events) holds; returns the events then."""
        got = []

        def check():
            got[:] = self.snapshot()
            return pred(got)
        wait_until(check, what)
        return got

    def close(self):
        # Shutting the socket down wakes the reader; closing the response
        # first would wait for the server to end the watch.
        try:
            self.conn.sock.shutdown(socket.SHUT_RDWR)
        except (OSError, AttributeError):
            pass
        self.done.wait(DEADLINE)
        self.conn.close()


@pytest.fixture(scope="module")
def cluster():
    """An API server and a kubelet shared by a module's tests."""
    tmp = make_tmp("cohort-standin-")
    server = ApiServer(tmp, "--bookmark-interval", "0.2", "--max-body", "262144")
    kubelet = Kubelet(server, tmp)
    server.kubelet = kubelet
    yield server
    kubelet.stop()
    server.stop()
    remove_tmp(tmp)


@pytest.fixture
def fresh_tmp():
    tmp = make_tmp("cohort-standin-")
    yield tmp
    remove_tmp(tmp)


@pytest.fixture
def kubectl(cluster, fresh_tmp):
    """build/tools/kubectl, installed by scripts/install-kubectl.sh."""
    k = Kubectl(cluster, fresh_tmp)
    if not k.available():
        pytest.skip("kubectl is not in build/tools and scripts/install-kubectl.sh could not fetch "
                    "it (is npm reachable?): %s" % k.why_missing)
    return k


# ---------------------------------------------------------------------------
# kubectl against the stand-in
# ---------------------------------------------------------------------------

TC = "/apis/cohort.dev/v1alpha1/namespaces/default/trainingcohorts"


def install_crd(kubectl):
    kubectl("apply", "-f", CRD_FILE)
    kubectl("wait", "--for", "condition=Established", "crd/trainingcohorts.cohort.dev",
            "--timeout=20s")


def test_kubectl_applies_crd_and_cohort_and_shows_columns(kubectl, cluster):
    install_crd(kubectl)
    kubectl("apply", "-f", os.path.join(EXAMPLES, "cohort.yaml"))
    crd = cluster.ok("GET", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/"
                     "trainingcohorts.cohort.dev")
    assert {c["type"]: c["status"] for c in crd["status"]["conditions"]} == \
        {"NamesAccepted": "True", "Established": "True"}
    tc = cluster.ok("GET", TC + "/logreg")
    assert tc["spec"]["replicas"] == 3
    assert tc["spec"]["reduction"] == {"algorithm": "auto", "compression": "none",
                                       "integrity": "none"}
    assert tc["spec"]["sidecar"]["logLevel"] == "info"       # a schema default
    assert tc["spec"]["suspend"] is False
    # The operator's view of the world, written through /status.
    tc["status"] = {"replicas": 3, "readyReplicas": 3, "epoch": 7, "leader": "logreg-1",
                    "modelVersion": 42, "selector": "cohort.dev/name=logreg",
                    "phase": "Running"}
    cluster.ok("PUT", TC + "/logreg/status", tc)
    out = kubectl("get", "tc").stdout.splitlines()
    assert out[0].split() == ["NAME", "DESIRED", "READY", "EPOCH", "LEADER", "MODELVERSION",
                              "PHASE", "AGE"]
    assert out[1].split()[:7] == ["logreg", "3", "3", "7", "logreg-1", "42", "Running"]
    wide = kubectl("get", "trainingcohorts", "-o", "wide").stdout.splitlines()
    assert wide[0].split()[-3:] == ["MIN", "MAX", "SUSPENDED"]
    assert wide[1].split()[-3:] == ["2", "8", "false"]
    assert "logreg" in kubectl("get", "cohort").stdout          # the category


def test_kubectl_scale_goes_through_the_scale_subresource(kubectl, cluster):
    install_crd(kubectl)
    kubectl("apply", "-f", os.path.join(EXAMPLES, "cohort.yaml"))
    before = cluster.ok("GET", TC + "/logreg")
    kubectl("scale", "tc/logreg", "--replicas=5")
    after = cluster.ok("GET", TC + "/logreg")
    assert after["spec"]["replicas"] == 5
    assert after["metadata"]["generation"] == before["metadata"]["generation"] + 1
    scale = cluster.ok("GET", TC + "/logreg/scale")
    assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 5
    reqs = cluster.ok("GET", "/debug/cohort/requests")
    assert any(r["path"] == TC + "/logreg/scale" and r["method"] in ("PATCH", "PUT") and
               r["code"] == 200 for r in reqs)
    # Above maxReplicas: the CRD's CEL rule refuses it, through /scale too.
    r = kubectl("scale", "tc/logreg", "--replicas=50", check=False)
    assert r.returncode != 0
    assert "spec.replicas must not be above spec.maxReplicas" in r.stderr
    assert cluster.ok("GET", TC + "/logreg")["spec"]["replicas"] == 5


def test_kubectl_refuses_the_invalid_example_with_the_cel_message(kubectl, cluster):
    install_crd(kubectl)
    r = kubectl("apply", "-f", os.path.join(EXAMPLES, "invalid-cohort.yaml"), check=False)
    assert r.returncode != 0
    assert 'The TrainingCohort "too-many" is invalid' in r.stderr
    assert "spec.replicas must not be above spec.maxReplicas" in r.stderr
    assert cluster.call("GET", TC + "/too-many")[0] == 404


def test_kubectl_patch_label_and_delete(kubectl, cluster):
    install_crd(kubectl)
    kubectl("apply", "-f", os.path.join(EXAMPLES, "cohort.yaml"))
    kubectl("patch", "tc", "logreg", "--type", "merge", "-p", '{"spec":{"suspend":true}}')
    kubectl("label", "tc", "logreg", "team=ml")
    assert "logreg" in kubectl("get", "tc", "-l", "team=ml").stdout
    tc = cluster.ok("GET", TC + "/logreg")
    assert tc["spec"]["suspend"] is True and tc["metadata"]["labels"]["team"] == "ml"
    kubectl("delete", "tc", "logreg")           # waits until it is gone
    assert cluster.call("GET", TC + "/logreg")[0] == 404
    r = kubectl("get", "tc", "logreg", check=False)
    assert r.returncode != 0 and "NotFound" in r.stderr


def test_cohort_crd_rules(kubectl, cluster):
    """The CRD's own validations, over plain HTTP."""
    install_crd(kubectl)

    def cohort(name, spec):
        base = {"replicas": 2, "template": {"spec": {"containers": [
            {"name": "trainer", "image": "x", "command": ["cohort-example-logreg"]}]}}}
        base.update(spec)
        return {"apiVersion": "cohort.dev/v1alpha1", "kind": "TrainingCohort",
                "metadata": {"name": name}, "spec": base}

    def refused(name, spec):
        code, st, _ = cluster.call("POST", TC, cohort(name, spec))
        assert code == 422, st
        return st["message"]

    assert "memberTimeout must be longer than heartbeatInterval" in refused(
        "t1", {"timeouts": {"heartbeatInterval": "2s", "memberTimeout": "1500ms"}})
    assert "heartbeatInterval must be at least 50ms" in refused(
        "t2", {"timeouts": {"heartbeatInterval": "10ms"}})
    assert "should match" in refused("t3", {"timeouts": {"memberTimeout": "5 seconds"}})
    assert "spec.replicas must not be below spec.minReplicas" in refused(
        "t4", {"replicas": 1, "minReplicas": 2})
    # The sidecar's --compression values only (the pattern, then CEL for
    # the ranges); tree was never an algorithm of the engine.
    assert "should match" in refused("t5", {"reduction": {"compression": "zstd"}})
    assert "should match" in refused("t5", {"reduction": {"compression": "int4"}})
    assert "should match" in refused("t5", {"reduction": {"compression": "topk:1.5"}})
    assert "should match" in refused("t5", {"reduction": {"compression": "powersgd:2.5"}})
    assert "topk's ratio must be above 0" in refused(
        "t5", {"reduction": {"compression": "topk:0.000"}})
    assert "powersgd's rank must be 1 to 1024" in refused(
        "t5", {"reduction": {"compression": "powersgd:1025"}})
    assert "powersgd's rank must be 1 to 1024" in refused(
        "t5", {"reduction": {"compression": "powersgd:0"}})
    for good in ("topk:0.05", "topk:1", "powersgd", "powersgd:1024"):
        ok = cluster.ok("POST", TC, cohort("t9", {"reduction": {"compression": good}}))
        assert ok["spec"]["reduction"]["compression"] == good
        cluster.ok("DELETE", TC + "/t9")
    assert 'Unsupported value: "tree"' in refused("t5", {"reduction": {"algorithm": "tree"}})
    # The sidecar's --integrity words, exactly.
    for bad in ("hmac", "MAC", ""):
        assert 'Unsupported value: "%s"' % bad in refused(
            "t5", {"reduction": {"integrity": bad}})
    ok = cluster.ok("POST", TC, cohort("t9", {"reduction": {"integrity": "mac"}}))
    assert ok["spec"]["reduction"] == {"algorithm": "auto", "compression": "none",
                                       "integrity": "mac"}
    cluster.ok("DELETE", TC + "/t9")
    assert "spec.accumulator.parallelGradients" in refused(
        "t5", {"accumulator": {"parallelGradients": 9}})
    assert "reserved for the injected sidecar" in refused("t6", {"template": {"spec": {
        "containers": [{"name": "cohort-sidecar", "image": "x"}]}}})
    assert "spec.template: Required value" in refused("t7", {"template": None})
    ok = cluster.ok("POST", TC, cohort("t8", {"timeouts": {"memberTimeout": "2m"}}))
    assert ok["spec"]["timeouts"] == {"heartbeatInterval": "1s", "memberTimeout": "2m"}
    # No defaults: unset, the trainer's own calls decide.
    assert ok["spec"]["accumulator"] == {}
    cluster.ok("DELETE", TC + "/t8")


# ---------------------------------------------------------------------------
# API semantics over HTTP
# ---------------------------------------------------------------------------


CM = "/api/v1/namespaces/default/configmaps"
WIDGETS = "/apis/test.cohort.dev/v1/namespaces/default/widgets"
WIDGET_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.test.cohort.dev"},
    "spec": {
        "group": "test.cohort.dev", "scope": "Namespaced",
        "names": {"kind": "Widget", "plural": "widgets", "singular": "widget",
                  "shortNames": ["wg"]},
        "versions": [{
            "name": "v1", "served": True, "storage": True,
            "subresources": {"status": {}, "scale": {"specReplicasPath": ".spec.size",
                                                     "statusReplicasPath": ".status.size",
                                                     "labelSelectorPath": ".status.selector"}},
            "schema": {"openAPIV3Schema": {"type": "object", "properties": {
                "spec": {"type": "object", "required": ["size"],
                         "x-kubernetes-validations": [
                             {"rule": "self.size <= self.limit", "fieldPath": ".size",
                              "message": "size must not exceed limit"},
                             {"rule": "self.mode == oldSelf.mode", "message": "mode is immutable",
                              "reason": "FieldValueForbidden"}],
                         "properties": {
                             "size": {"type": "integer", "minimum": 0},
                             "limit": {"type": "integer", "default": 10},
                             "mode": {"type": "string", "enum": ["a", "b"], "default": "a"},
                             "tags": {"type": "array", "maxItems": 2,
                                      "items": {"type": "string"}}}},
                "status": {"type": "object", "properties": {
                    "size": {"type": "integer"}, "selector": {"type": "string"},
                    "note": {"type": "string"}}}}}}}]}}


def widget(name, size=1, **spec):
    return {"apiVersion": "test.cohort.dev/v1", "kind": "Widget", "metadata": {"name": name},
            "spec": dict(size=size, **spec)}


@pytest.fixture(scope="module")
def widgets(cluster):
    cluster.ok("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", WIDGET_CRD)
    wait_until(lambda: cluster.call("GET", WIDGETS)[0] == 200, "widgets to be served")
    return cluster


def test_resource_versions_only_grow(cluster):
    rvs = []
    cm = cluster.ok("POST", CM, {"metadata": {"name": "rv"}, "data": {"a": "1"}})
    rvs.append(cm["metadata"]["resourceVersion"])
    cm["data"]["a"] = "2"
    rvs.append(cluster.ok("PUT", CM + "/rv", cm)["metadata"]["resourceVersion"])
    rvs.append(cluster.ok("PATCH", CM + "/rv", {"data": {"b": "3"}},
                          "application/merge-patch+json")["metadata"]["resourceVersion"])
    rvs.append(cluster.ok("GET", CM)["metadata"]["resourceVersion"])
    cluster.ok("DELETE", CM + "/rv")
    rvs.append(cluster.ok("GET", CM)["metadata"]["resourceVersion"])
    assert all(isinstance(r, str) for r in rvs)
    nums = [int(r) for r in rvs]
    assert nums[0] < nums[1] < nums[2] <= nums[3] < nums[4]
    # A write that changes nothing writes nothing.
    cm = cluster.ok("POST", CM, {"metadata": {"name": "rv2"}, "data": {"a": "1"}})
    again = cluster.ok("PUT", CM + "/rv2", cm)
    assert again["metadata"]["resourceVersion"] == cm["metadata"]["resourceVersion"]


def test_stale_put_gets_409_conflict(cluster):
    cm = cluster.ok("POST", CM, {"metadata": {"name": "stale"}, "data": {"a": "1"}})
    first = dict(cm, data={"a": "2"})
    cluster.ok("PUT", CM + "/stale", first)
    code, st, _ = cluster.call("PUT", CM + "/stale", dict(cm, data={"a": "3"}))
    assert code == 409
    assert st["kind"] == "Status" and st["reason"] == "Conflict" and st["code"] == 409
    assert st["details"]["name"] == "stale" and "the object has been modified" in st["message"]
    assert cluster.ok("GET", CM + "/stale")["data"] == {"a": "2"}
    code, st, _ = cluster.call("POST", CM, {"metadata": {"name": "stale"}})
    assert code == 409 and st["reason"] == "AlreadyExists"


def test_merge_patch_and_json_patch(cluster):
    cluster.ok("POST", CM, {"metadata": {"name": "patchy", "labels": {"x": "1"}},
                            "data": {"a": "1", "b": "2"}})
    got = cluster.ok("PATCH", CM + "/patchy", {"data": {"a": None, "c": "3"},
                                               "metadata": {"labels": {"y": "2"}}},
                     "application/merge-patch+json")
    assert got["data"] == {"b": "2", "c": "3"}
    assert got["metadata"]["labels"] == {"x": "1", "y": "2"}
    got = cluster.ok("PATCH", CM + "/patchy", [{"op": "add", "path": "/data/d", "value": "4"},
                                               {"op": "remove", "path": "/data/b"}],
                     "application/json-patch+json")
    assert got["data"] == {"c": "3", "d": "4"}
    code, st, _ = cluster.call("PATCH", CM + "/patchy",
                               [{"op": "test", "path": "/data/c", "value": "nope"}],
                               "application/json-patch+json")
    assert code == 422 and "testing value /data/c failed" in st["message"]
    # A merge patch naming a stale resourceVersion is a precondition.
    code, st, _ = cluster.call("PATCH", CM + "/patchy", {"metadata": {"resourceVersion": "1"}},
                               "application/merge-patch+json")
    assert code == 409


def test_status_subresource_and_generation(widgets):
    w = widgets.ok("POST", WIDGETS, dict(widget("gen"), status={"note": "dropped"}))
    assert w["metadata"]["generation"] == 1 and "status" not in w
    assert w["spec"] == {"size": 1, "limit": 10, "mode": "a"}        # defaults
    w["status"] = {"note": "hello", "size": 1}
    s = widgets.ok("PUT", WIDGETS + "/gen/status", w)
    assert s["status"]["note"] == "hello" and s["metadata"]["generation"] == 1
    s = widgets.ok("PATCH", WIDGETS + "/gen/status", {"status": {"note": "again"},
                                                      "spec": {"size": 9}},
                   "application/merge-patch+json")
    assert s["status"]["note"] == "again" and s["spec"]["size"] == 1    # spec ignored on /status
    s["status"]["note"] = "ignored"
    s["metadata"].setdefault("labels", {})["only"] = "metadata"
    m = widgets.ok("PUT", WIDGETS + "/gen", s)
    assert m["status"]["note"] == "again"        # status ignored on the main endpoint
    assert m["metadata"]["generation"] == 1      # metadata-only change
    m["spec"]["size"] = 2
    m = widgets.ok("PUT", WIDGETS + "/gen", m)
    assert m["metadata"]["generation"] == 2


def test_scale_subresource(widgets):
    widgets.ok("POST", WIDGETS, widget("sc", size=2))
    widgets.ok("PATCH", WIDGETS + "/sc/status", {"status": {"size": 2, "selector": "app=sc"}},
               "application/merge-patch+json")
    sc = widgets.ok("GET", WIDGETS + "/sc/scale")
    assert sc["apiVersion"] == "autoscaling/v1" and sc["kind"] == "Scale"
    assert sc["spec"] == {"replicas": 2} and sc["status"] == {"replicas": 2, "selector": "app=sc"}
    sc["spec"]["replicas"] = 4
    assert widgets.ok("PUT", WIDGETS + "/sc/scale", sc)["spec"]["replicas"] == 4
    w = widgets.ok("GET", WIDGETS + "/sc")
    assert w["spec"]["size"] == 4 and w["metadata"]["generation"] == 2
    code, _, _ = widgets.call("PUT", WIDGETS + "/sc/scale", sc)        # stale resourceVersion
    assert code == 409
    widgets.ok("PATCH", WIDGETS + "/sc/scale", {"spec": {"replicas": 6}},
               "application/merge-patch+json")
    assert widgets.ok("GET", WIDGETS + "/sc")["spec"]["size"] == 6
    code, st, _ = widgets.call("PATCH", WIDGETS + "/sc/scale", {"spec": {"replicas": 11}},
                               "application/merge-patch+json")
    assert code == 422 and "size must not exceed limit" in st["message"]


def test_schema_pruning_defaults_and_cel(widgets):
    code, doc, headers = widgets.call("POST", WIDGETS, dict(widget("prune"), extra=1))
    assert code == 201 and "extra" not in doc
    assert 'unknown field \\"extra\\"' in headers.get("Warning", "")
    code, st, _ = widgets.call("POST", WIDGETS + "?fieldValidation=Strict",
                               widget("strict", bogus=True))
    assert code == 400 and 'unknown field "spec.bogus"' in st["message"]
    code, st, _ = widgets.call("POST", WIDGETS, widget("big", size=20))
    assert code == 422 and st["reason"] == "Invalid"
    assert st["message"] == ('Widget.test.cohort.dev "big" is invalid: spec.size: Invalid value: '
                             '"object": size must not exceed limit')
    assert st["details"]["causes"][0]["field"] == "spec.size"
    code, st, _ = widgets.call("POST", WIDGETS, widget("neg", size=-1, tags=["a", "b", "c"]))
    assert code == 422
    assert "spec.size in body should be greater than or equal to 0" in st["message"]
    assert "spec.tags: Too many: 3: must have at most 2 items" in st["message"]
    code, st, _ = widgets.call("POST", WIDGETS, widget("typ", size="one"))
    assert code == 422 and 'spec.size in body must be of type integer: "string"' in st["message"]
    w = widgets.ok("POST", WIDGETS, widget("trans", mode="b"))
    w["spec"]["mode"] = "a"                      # a transition rule: oldSelf
    code, st, _ = widgets.call("PUT", WIDGETS + "/trans", w)
    assert code == 422 and "spec: Forbidden: mode is immutable" in st["message"]
    code, st, _ = widgets.call("PUT", WIDGETS + "/trans", dict(w, metadata={"name": "trans"}))
    assert code == 422 and "must be specified for an update" in st["message"]


def test_watch_delivers_events_in_order_with_bookmarks(cluster):
    rv = cluster.ok("GET", CM)["metadata"]["resourceVersion"]
    w = Watch(cluster, CM + "?watch=true&allowWatchBookmarks=true&timeoutSeconds=20&"
              "resourceVersion=" + rv)
    try:
        cluster.ok("POST", CM, {"metadata": {"name": "watched"}, "data": {"a": "1"}})
        cluster.ok("PATCH", CM + "/watched", {"data": {"a": "2"}}, "application/merge-patch+json")
        cluster.ok("DELETE", CM + "/watched")
        evs = w.wait_for(lambda es: [e for e in es if e["type"] == "DELETED"] and
                         [e for e in es if e["type"] == "BOOKMARK"], "DELETED and a BOOKMARK")
        mine = [e for e in evs if e["type"] != "BOOKMARK"]
        assert [e["type"] for e in mine] == ["ADDED", "MODIFIED", "DELETED"]
        assert mine[1]["object"]["data"] == {"a": "2"}
        nums = [int(e["object"]["metadata"]["resourceVersion"]) for e in mine]
        assert int(rv) < nums[0] < nums[1] < nums[2]
        bm = [e for e in evs if e["type"] == "BOOKMARK"][-1]
        assert bm["object"]["kind"] == "ConfigMap" and int(bm["object"]["metadata"][
            "resourceVersion"]) >= nums[0]
    finally:
        w.close()


def test_watch_with_a_selector_sees_objects_leave_and_return(cluster):
    w = Watch(cluster, CM + "?watch=1&labelSelector=team%3Dml&timeoutSeconds=20")
    try:
        cluster.ok("POST", CM, {"metadata": {"name": "sel", "labels": {"team": "ml"}}})
        cluster.ok("PATCH", CM + "/sel", {"metadata": {"labels": {"team": "web"}}},
                   "application/merge-patch+json")
        cluster.ok("PATCH", CM + "/sel", {"metadata": {"labels": {"team": "ml"}}},
                   "application/merge-patch+json")
        evs = w.wait_for(lambda es: len([e for e in es if e["object"]["metadata"].get("name") ==
                                        "sel"]) >= 3, "three events")
        assert [e["type"] for e in evs if e["object"]["metadata"]["name"] == "sel"] == \
            ["ADDED", "DELETED", "ADDED"]
    finally:
        w.close()


def test_too_old_resource_version_gets_410(fresh_tmp):
    srv = ApiServer(fresh_tmp, "--history-size", "5")
    try:
        first = srv.ok("POST", CM, {"metadata": {"name": "c0"}})["metadata"]["resourceVersion"]
        for i in range(1, 5):
            srv.ok("POST", CM, {"metadata": {"name": "c%d" % i}})
        page = srv.ok("GET", CM + "?limit=2")
        for i in range(5, 12):
            srv.ok("POST", CM, {"metadata": {"name": "c%d" % i}})
        w = Watch(srv, CM + "?watch=1&resourceVersion=%s" % first)
        assert w.done.wait(DEADLINE)
        evs = w.snapshot()
        assert len(evs) == 1 and evs[0]["type"] == "ERROR"
        st = evs[0]["object"]
        assert st["kind"] == "Status" and st["code"] == 410 and st["reason"] == "Expired"
        code, st, _ = srv.call("GET", CM + "?limit=2&continue=" +
                               urllib.parse.quote(page["metadata"]["continue"]))
        assert code == 410 and st["reason"] == "Expired"
        # A watch from a recent version is fine.
        now = srv.ok("GET", CM)["metadata"]["resourceVersion"]
        w = Watch(srv, CM + "?watch=1&timeoutSeconds=1&resourceVersion=" + now)
        assert w.done.wait(DEADLINE) and w.snapshot() == []
    finally:
        srv.stop()


SVCS = "/api/v1/namespaces/default/services"


def test_service_ip_blocks_keep_side_by_side_clusters_apart(fresh_tmp):
    """Each API server hands out clusterIPs from its --service-ip-block's
    127.96.B.0/24 only (the kubernetes Service .1 of it, others .10
    upward, a dry run taking none), so that two clusters alive at once
    never have their service proxies listen on one address; a block out
    of range is refused at the start."""
    svc = {"metadata": {"name": "web"}, "spec": {"ports": [{"port": 80}]}}
    kube = {"metadata": {"name": "kubernetes"}, "spec": {"ports": [{"port": 443}]}}
    servers = []
    try:
        for block in (7, 8):
            d = os.path.join(fresh_tmp, str(block))
            os.mkdir(d)
            servers.append(ApiServer(d, "--service-ip-block", str(block)))
        for block, srv in zip((7, 8), servers):
            dry = srv.ok("POST", SVCS + "?dryRun=All", svc)["spec"]["clusterIP"]
            assert dry == "127.96.%d.10" % block
            assert srv.ok("POST", SVCS, svc)["spec"]["clusterIP"] == dry
            svc2 = dict(svc, metadata={"name": "web2"})
            assert srv.ok("POST", SVCS, svc2)["spec"]["clusterIP"] == "127.96.%d.11" % block
            # The bootstrap controller's Service, posted without an address.
            code, got, _ = srv.call("POST", SVCS, kube)
            if code == 409:     # the controllers were quicker
                got = srv.ok("GET", SVCS + "/kubernetes")
            assert got["spec"]["clusterIP"] == "127.96.%d.1" % block
    finally:
        for srv in servers:
            srv.stop()
    for bad in ("256", "-1", "x"):
        r = subprocess.run([PYTHON, os.path.join(ROOT, "tests", "kube", "apiserver.py"),
                            "--service-ip-block", bad], capture_output=True, text=True,
                           timeout=DEADLINE)
        assert r.returncode == 2 and "--service-ip-block: a block is 0 to 255" in r.stderr, \
            (bad, r.stderr)


def test_list_pages_are_one_consistent_snapshot(cluster):
    for i in range(7):
        cluster.ok("POST", CM, {"metadata": {"name": "page-%d" % i, "labels": {"paged": "yes"}},
                                "data": {"v": "old"}})
    first = cluster.ok("GET", CM + "?labelSelector=paged%3Dyes&limit=3")
    assert len(first["items"]) == 3 and first["metadata"]["remainingItemCount"] == 4
    cluster.ok("PATCH", CM + "/page-5", {"data": {"v": "new"}}, "application/merge-patch+json")
    cluster.ok("DELETE", CM + "/page-6")
    cluster.ok("POST", CM, {"metadata": {"name": "page-7", "labels": {"paged": "yes"}}})
    items, page = list(first["items"]), first
    while page["metadata"].get("continue"):
        page = cluster.ok("GET", CM + "?labelSelector=paged%3Dyes&limit=3&continue=" +
                          urllib.parse.quote(page["metadata"]["continue"]))
        assert page["metadata"]["resourceVersion"] == first["metadata"]["resourceVersion"]
        items += page["items"]
    assert [i["metadata"]["name"] for i in items] == ["page-%d" % i for i in range(7)]
    assert all(i["data"]["v"] == "old" for i in items)
    now = cluster.ok("GET", CM + "?labelSelector=paged%3Dyes")["items"]
    assert [i["metadata"]["name"] for i in now] == ["page-%d" % i for i in (0, 1, 2, 3, 4, 5, 7)]


def test_label_and_field_selectors(cluster):
    for name, labels in (("ls-a", {"tier": "web", "env": "prod"}), ("ls-b", {"tier": "db"}),
                         ("ls-c", {"env": "dev"})):
        cluster.ok("POST", CM, {"metadata": {"name": name, "labels": dict(labels, ls="1")}})

    def names(sel):
        q = urllib.parse.urlencode({"labelSelector": "ls=1," + sel} if sel else
                                   {"labelSelector": "ls=1"})
        return sorted(i["metadata"]["name"] for i in cluster.ok("GET", CM + "?" + q)["items"])
    assert names("tier=web") == ["ls-a"]
    assert names("tier==db") == ["ls-b"]
    assert names("tier!=web") == ["ls-b", "ls-c"]
    assert names("tier in (web,db)") == ["ls-a", "ls-b"]
    assert names("tier notin (web)") == ["ls-b", "ls-c"]
    assert names("env") == ["ls-a", "ls-c"]
    assert names("!env") == ["ls-b"]
    assert names("tier,env=prod") == ["ls-a"]
    got = cluster.ok("GET", CM + "?fieldSelector=metadata.name%3Dls-b")["items"]
    assert [i["metadata"]["name"] for i in got] == ["ls-b"]
    code, st, _ = cluster.call("GET", CM + "?fieldSelector=data.x%3D1")
    assert code == 400 and "field label not supported" in st["message"]
    code, _, _ = cluster.call("GET", CM + "?labelSelector=" + urllib.parse.quote("a in b"))
    assert code == 400


def test_finalizers_hold_deletion_until_removed(cluster):
    cluster.ok("POST", CM, {"metadata": {"name": "fin", "finalizers": ["cohort.dev/cleanup"]}})
    held = cluster.ok("DELETE", CM + "/fin")
    assert held["metadata"]["deletionTimestamp"]
    got = cluster.ok("GET", CM + "/fin")
    assert got["metadata"]["finalizers"] == ["cohort.dev/cleanup"]
    code, st, _ = cluster.call("PATCH", CM + "/fin", {"metadata": {"finalizers": [
        "cohort.dev/cleanup", "another"]}}, "application/merge-patch+json")
    assert code == 422 and "no new finalizers can be added" in st["message"]
    cluster.ok("PATCH", CM + "/fin", [{"op": "test", "path": "/metadata/resourceVersion",
                                       "value": got["metadata"]["resourceVersion"]},
                                      {"op": "remove", "path": "/metadata/finalizers"}],
               "application/json-patch+json")
    assert cluster.call("GET", CM + "/fin")[0] == 404


def test_owner_references_cascade(cluster):
    def owned(name, owner, block=False):
        return {"metadata": {"name": name, "ownerReferences": [{
            "apiVersion": "v1", "kind": "ConfigMap", "name": owner["metadata"]["name"],
            "uid": owner["metadata"]["uid"], "controller": True, "blockOwnerDeletion": block}]}}
    # Background (the default): the owner goes at once, its dependents after.
    owner = cluster.ok("POST", CM, {"metadata": {"name": "own-bg"}})
    cluster.ok("POST", CM, owned("own-bg-1", owner))
    cluster.ok("POST", CM, owned("own-bg-2", owner))
    cluster.ok("DELETE", CM + "/own-bg")
    wait_until(lambda: all(cluster.call("GET", CM + "/own-bg-%d" % i)[0] == 404 for i in (1, 2)),
               "background cascading deletion")
    # Foreground: the owner stays, being deleted, until blocking dependents go.
    owner = cluster.ok("POST", CM, {"metadata": {"name": "own-fg"}})
    cluster.ok("POST", CM, dict(owned("own-fg-1", owner, True),
                                **{"metadata": dict(owned("own-fg-1", owner, True)["metadata"],
                                                    finalizers=["test/hold"])}))
    cluster.ok("DELETE", CM + "/own-fg", {"propagationPolicy": "Foreground"})
    wait_until(lambda: cluster.ok("GET", CM + "/own-fg-1")["metadata"].get("deletionTimestamp"),
               "the dependent to be deleted")
    assert "foregroundDeletion" in cluster.ok("GET", CM + "/own-fg")["metadata"]["finalizers"]
    cluster.ok("PATCH", CM + "/own-fg-1", {"metadata": {"finalizers": None}},
               "application/merge-patch+json")
    wait_until(lambda: cluster.call("GET", CM + "/own-fg")[0] == 404, "the owner to go")
    # Orphan: dependents stay and lose the reference.
    owner = cluster.ok("POST", CM, {"metadata": {"name": "own-or"}})
    cluster.ok("POST", CM, owned("own-or-1", owner))
    cluster.ok("DELETE", CM + "/own-or?propagationPolicy=Orphan")
    wait_until(lambda: cluster.call("GET", CM + "/own-or")[0] == 404, "the owner to go")
    assert "ownerReferences" not in cluster.ok("GET", CM + "/own-or-1")["metadata"]


def test_owned_pods_are_deleted_with_their_cohort(widgets):
    w = widgets.ok("POST", WIDGETS, widget("owner"))
    ref = {"apiVersion": "test.cohort.dev/v1", "kind": "Widget", "name": "owner",
           "uid": w["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}
    for i in range(2):
        widgets.ok("POST", "/api/v1/namespaces/default/pods", {
            "metadata": {"name": "owned-%d" % i, "ownerReferences": [ref]},
            "spec": {"terminationGracePeriodSeconds": 2, "containers": [
                {"name": "c", "image": "busybox", "command": ["sleep", "1000"]}]}})
    wait_until(lambda: all(widgets.ok("GET", "/api/v1/namespaces/default/pods/owned-%d" % i)
                           ["status"].get("phase") == "Running" for i in range(2)),
               "owned pods to run")
    widgets.ok("DELETE", WIDGETS + "/owner")
    wait_until(lambda: all(widgets.call("GET", "/api/v1/namespaces/default/pods/owned-%d" % i)[0]
                           == 404 for i in range(2)), "owned pods to be deleted")


SECRETS = "/api/v1/namespaces/default/secrets"


def b64(data):
    import base64
    return base64.b64encode(data if isinstance(data, bytes) else data.encode()).decode()


def test_secrets_are_checked_conflict_and_go_with_their_owner(cluster):
    owner = cluster.ok("POST", CM, {"metadata": {"name": "sec-owner"}})
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "sec-owner",
           "uid": owner["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}
    s = cluster.ok("POST", SECRETS, {"metadata": {"name": "k", "labels": {"app": "sec"},
                                                  "ownerReferences": [ref]},
                                     "data": {"key": b64("abc")}, "stringData": {"s": "x"}})
    assert s["type"] == "Opaque" and s["data"] == {"key": b64("abc"), "s": b64("x")}
    assert "stringData" not in s
    # A second create of the name: 409 AlreadyExists, and the first stays.
    code, st, _ = cluster.call("POST", SECRETS, {"metadata": {"name": "k"},
                                                 "data": {"key": b64("other")}})
    assert code == 409 and st["reason"] == "AlreadyExists", st
    assert cluster.ok("GET", SECRETS + "/k")["data"]["key"] == b64("abc")
    # data is bytes: not base64 is a 400; bad key names, a TLS Secret
    # without its key, a changed type are 422.
    code, st, _ = cluster.call("POST", SECRETS, {"metadata": {"name": "bad"},
                                                 "data": {"key": "not base64!"}})
    assert code == 400 and "base64" in st["message"], st
    code, st, _ = cluster.call("POST", SECRETS, {"metadata": {"name": "bad"},
                                                 "data": {"a/b": b64("x")}})
    assert code == 422 and "data[a/b]" in st["message"], st
    code, st, _ = cluster.call("POST", SECRETS, {"metadata": {"name": "bad"},
                                                 "type": "kubernetes.io/tls",
                                                 "data": {"tls.crt": b64("x")}})
    assert code == 422 and "data[tls.key]" in st["message"], st
    code, st, _ = cluster.call("PATCH", SECRETS + "/k", {"type": "kubernetes.io/tls"},
                               "application/merge-patch+json")
    assert code == 422 and "immutable" in st["message"], st
    got = cluster.ok("GET", SECRETS + "?labelSelector=app%3Dsec")
    assert [i["metadata"]["name"] for i in got["items"]] == ["k"]
    # Owner references: the Secret goes with its owner.
    cluster.ok("DELETE", CM + "/sec-owner")
    wait_until(lambda: cluster.call("GET", SECRETS + "/k")[0] == 404,
               "the Secret to be collected with its owner")


def test_leases_and_events(cluster):
    path = "/apis/coordination.k8s.io/v1/namespaces/default/leases"
    lease = cluster.ok("POST", path, {"metadata": {"name": "cohort-operator"},
                                      "spec": {"holderIdentity": "op-a",
                                               "leaseDurationSeconds": 15,
                                               "renewTime": "2026-01-02T15:04:05.000000Z"}})
    a = dict(lease, spec=dict(lease["spec"], renewTime="2026-01-02T15:04:07.000000Z"))
    b = dict(lease, spec=dict(lease["spec"], holderIdentity="op-b", leaseTransitions=1))
    renewed = cluster.ok("PUT", path + "/cohort-operator", a)
    code, st, _ = cluster.call("PUT", path + "/cohort-operator", b)
    assert code == 409 and st["reason"] == "Conflict"
    b["metadata"] = renewed["metadata"]
    assert cluster.ok("PUT", path + "/cohort-operator", b)["spec"]["holderIdentity"] == "op-b"
    ev = {"metadata": {"name": "logreg.1"}, "reason": "Scaled", "message": "3 -> 5",
          "type": "Normal", "involvedObject": {"kind": "TrainingCohort", "name": "logreg",
                                               "namespace": "default"},
          "source": {"component": "cohort-operator"}, "count": 1}
    cluster.ok("POST", "/api/v1/namespaces/default/events", ev)
    got = cluster.ok("GET", "/api/v1/namespaces/default/events?fieldSelector=" +
                     urllib.parse.quote("involvedObject.name=logreg,reason=Scaled"))
    assert [e["message"] for e in got["items"]] == ["3 -> 5"]


def test_namespace_deletion_takes_its_contents(cluster):
    cluster.ok("POST", "/api/v1/namespaces", {"metadata": {"name": "doomed"}})
    cluster.ok("POST", "/api/v1/namespaces/doomed/configmaps", {"metadata": {"name": "x"}})
    ns = cluster.ok("DELETE", "/api/v1/namespaces/doomed")
    assert ns["status"]["phase"] == "Terminating"
    wait_until(lambda: cluster.call("GET", "/api/v1/namespaces/doomed")[0] == 404,
               "the namespace to go")
    assert cluster.ok("GET", "/api/v1/namespaces/doomed/configmaps")["items"] == []
    code, _, _ = cluster.call("DELETE", "/api/v1/namespaces/default")
    assert code == 403


def test_crd_deletion_removes_its_objects(cluster):
    crd = json.loads(json.dumps(WIDGET_CRD).replace("widget", "gadget").replace("Widget",
                                                                                "Gadget"))
    crd["spec"]["names"]["shortNames"] = ["gd"]
    cluster.ok("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)
    gadgets = "/apis/test.cohort.dev/v1/namespaces/default/gadgets"
    wait_until(lambda: cluster.call("GET", gadgets)[0] == 200, "gadgets to be served")
    cluster.ok("POST", gadgets, dict(widget("g1"), apiVersion="test.cohort.dev/v1",
                                     kind="Gadget"))
    cluster.ok("DELETE", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/"
               "gadgets.test.cohort.dev")
    wait_until(lambda: cluster.call("GET", gadgets)[0] == 404, "gadgets to stop being served")


def test_a_required_token_gets_401_and_can_rotate(fresh_tmp):
    token_file = os.path.join(fresh_tmp, "token")
    with open(token_file, "w") as f:
        f.write("first\n")
    srv = ApiServer(fresh_tmp, "--token-file", token_file)
    try:
        assert srv.call("GET", "/api/v1/namespaces")[0] == 401
        code, st, _ = srv.call("GET", "/api/v1/namespaces", token="wrong")
        assert code == 401 and st["reason"] == "Unauthorized"
        assert srv.call("GET", "/api/v1/namespaces", token="first")[0] == 200
        with open(token_file + ".new", "w") as f:
            f.write("second\n")
        os.replace(token_file + ".new", token_file)
        wait_until(lambda: srv.call("GET", "/api/v1/namespaces", token="first")[0] == 401,
                   "the old token to be refused")
        assert srv.call("GET", "/api/v1/namespaces", token="second")[0] == 200
        assert open(srv.kubeconfig).read().count("tokenFile: " + token_file) == 1
        tokens = [r["token"] for r in srv.ok("GET", "/debug/cohort/requests")]
        assert "wrong" in tokens and "second" in tokens
    finally:
        srv.stop()


def test_discovery_and_limits(widgets):
    res = widgets.ok("GET", "/apis/test.cohort.dev/v1")["resources"]
    by = {r["name"]: r for r in res}
    assert by["widgets"]["shortNames"] == ["wg"] and by["widgets"]["namespaced"]
    assert by["widgets/scale"]["group"] == "autoscaling" and by["widgets/scale"]["kind"] == "Scale"
    assert "widgets/status" in by
    code, agg, headers = widgets.call("GET", "/apis", headers={
        "Accept": "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList"})
    assert code == 200 and agg["kind"] == "APIGroupDiscoveryList"
    assert "as=APIGroupDiscoveryList" in headers["Content-Type"]
    assert "test.cohort.dev" in [i["metadata"]["name"] for i in agg["items"]]
    code, st, _ = widgets.call("POST", CM, b'{"metadata":{"name":"big"},"data":{"a":"' +
                               b"x" * 300000 + b'"}}')
    assert code == 413 and st["reason"] == "RequestEntityTooLarge"
    table = widgets.call("GET", WIDGETS, headers={
        "Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"})[1]
    assert table["kind"] == "Table" and table["columnDefinitions"][0]["name"] == "Name"


# ---------------------------------------------------------------------------
# The CEL subset, in-process
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("expr,want", [
    ("1 + 2 * 3 == 7", True),
    ("-7 / 2 == -3 && -7 % 2 == -1", True),
    ("size('héllo') == 5 && 'abc'.size() == 3", True),
    ("has(self.a) && !has(self.b)", True),
    ("self.xs.all(x, x > 0) && self.xs.exists(x, x == 2) && self.xs.exists_one(x, x == 3)", True),
    ("self.xs.map(x, x * 2) == [2, 4, 6] && self.xs.filter(x, x > 1) == [2, 3]", True),
    ("duration('1.5s') > duration('1500ms') || duration('2m') == duration('120s')", True),
    ("'cohort-7'.startsWith('cohort') && 'a.b'.matches('^a\\\\.b$') && 'x' in ['x', 'y']", True),
    ("self.a > 1 ? 'big' : 'small'", "small"),
    ("1 == 1.0 && 2 < 2.5", True),
    ("false && self.missing", False),          # errors are absorbed by a decided && ...
    ("self.missing || true", True),            # ... and ||
    ("string(42) + '!' == '42!' && int('7') == 7 && double(1) == 1.0", True),
])
def test_cel_subset_evaluates(expr, want):
    env = {"self": {"a": 1, "xs": [1, 2, 3]}}
    assert cel_eval(cel_compile(expr), env) == want


@pytest.mark.parametrize("expr,err", [
    ("self.missing > 1", "no such key: missing"),
    ("1 + 1.0", "no such overload"),
    ("9223372036854775807 + 1", "integer overflow"),
    ("1 / 0", "division by zero"),
    ("duration('5 seconds')", "invalid duration"),
])
def test_cel_subset_reports_errors(expr, err):
    with pytest.raises(CelError, match=err):
        cel_eval(cel_compile(expr), {"self": {"a": 1}})


def test_cel_refuses_what_it_does_not_implement():
    for expr in ("self.?a", "self.a[?0]", "1 +", "quantity('1Gi') > 0"):
        with pytest.raises(CelError):
            cel_eval(cel_compile(expr), {"self": {"a": [1]}})


# ---------------------------------------------------------------------------
# The process kubelet
# ---------------------------------------------------------------------------


PODS = "/api/v1/namespaces/default/pods"


def pod(name, containers, init=None, restart="Always", grace=5, volumes=None):
    spec = {"restartPolicy": restart, "terminationGracePeriodSeconds": grace,
            "containers": containers}
    if init:
        spec["initContainers"] = init
    if volumes:
        spec["volumes"] = volumes
    return {"metadata": {"name": name}, "spec": spec}


def sh(name, script, **extra):
    return dict({"name": name, "image": "busybox", "command": ["sh", "-c", script]}, **extra)


def get_pod(cluster, name):
    code, p, _ = cluster.call("GET", PODS + "/" + name)
    return p if code == 200 else None


def wait_phase(cluster, name, phase):
    return wait_until(lambda: (lambda p: p if p and p["status"].get("phase") == phase else None)
                      (get_pod(cluster, name)), "pod %s to be %s" % (name, phase))


def cond(p, t):
    return next((c["status"] for c in p["status"].get("conditions", []) if c["type"] == t), None)


def pod_log(cluster, name, container=None):
    q = "?container=" + container if container else ""
    req = urllib.request.Request(cluster.url + PODS + "/" + name + "/log" + q)
    with urllib.request.urlopen(req, timeout=DEADLINE) as r:
        return r.read().decode()


def test_pod_runs_with_its_own_loopback_ip_and_is_ready(cluster):
    cluster.ok("POST", PODS, pod("hello", [sh("main", "echo hi; exec sleep 1000")]))
    p = wait_until(lambda: (lambda p: p if p and cond(p, "Ready") == "True" else None)
                   (get_pod(cluster, "hello")), "the pod to be ready")
    st = p["status"]
    assert st["phase"] == "Running" and p["spec"]["nodeName"] == "cohort-node"
    prefix = cluster.kubelet.ip_prefix + "."
    assert st["podIP"].startswith(prefix) and int(st["podIP"].rsplit(".", 1)[1]) >= 2
    assert st["podIPs"] == [{"ip": st["podIP"]}] and st["hostIP"] == "127.0.0.1"
    cs = st["containerStatuses"][0]
    assert cs["ready"] and "running" in cs["state"] and cs["restartCount"] == 0
    assert all(cond(p, t) == "True" for t in ("PodScheduled", "Initialized", "ContainersReady"))
    wait_until(lambda: "hi" in pod_log(cluster, "hello"), "the log, through the API server")
    cluster.ok("DELETE", PODS + "/hello")


def test_deletion_sends_sigterm(cluster, fresh_tmp):
    mark = os.path.join(fresh_tmp, "got-term")
    script = "trap 'echo term > %s; exit 0' TERM; while true; do sleep 0.05; done" % mark
    cluster.ok("POST", PODS, pod("term", [sh("main", script)], grace=20))
    wait_phase(cluster, "term", "Running")
    t0 = time.monotonic()
    held = cluster.ok("DELETE", PODS + "/term")
    assert held["metadata"]["deletionTimestamp"] and \
        held["metadata"]["deletionGracePeriodSeconds"] == 20
    wait_until(lambda: get_pod(cluster, "term") is None, "the pod to be gone")
    assert time.monotonic() - t0 < 15                  # well before the grace period ends
    assert open(mark).read().strip() == "term"


def test_deletion_sigkills_after_the_grace_period(cluster):
    cluster.ok("POST", PODS, pod("stubborn", [sh("main", "trap '' TERM; while true; do sleep "
                                                         "0.05; done")], grace=1))
    p = wait_phase(cluster, "stubborn", "Running")
    w = Watch(cluster, PODS + "?watch=1&fieldSelector=metadata.name%3Dstubborn&resourceVersion=" +
              p["metadata"]["resourceVersion"])
    try:
        t0 = time.monotonic()
        cluster.ok("DELETE", PODS + "/stubborn")
        evs = w.wait_for(lambda es: any(e["type"] == "DELETED" for e in es), "DELETED")
        elapsed = time.monotonic() - t0
        assert elapsed >= 0.9
        last = [e for e in evs if e["type"] != "DELETED"][-1]["object"]
        term = last["status"]["containerStatuses"][0]["state"]["terminated"]
        assert term["exitCode"] == 137 and term.get("signal") == 9
    finally:
        w.close()


def test_exit_1_with_restart_never_fails_the_pod(cluster):
    cluster.ok("POST", PODS, pod("fails", [sh("main", "echo bye; exit 1")], restart="Never"))
    p = wait_phase(cluster, "fails", "Failed")
    term = p["status"]["containerStatuses"][0]["state"]["terminated"]
    assert term["exitCode"] == 1 and term["reason"] == "Error"
    assert cond(p, "Ready") == "False"
    cluster.ok("DELETE", PODS + "/fails")
    wait_until(lambda: get_pod(cluster, "fails") is None, "a finished pod to go at once")


def test_restart_policy_always_restarts_with_back_off(cluster):
    cluster.ok("POST", PODS, pod("crashy", [sh("main", "exit 2")]))
    p = wait_until(lambda: (lambda p: p if p and p["status"].get("containerStatuses") and
                            p["status"]["containerStatuses"][0]["restartCount"] >= 2 else None)
                   (get_pod(cluster, "crashy")), "two restarts")
    cs = p["status"]["containerStatuses"][0]
    assert cs["lastState"]["terminated"]["exitCode"] == 2
    assert p["status"]["phase"] in ("Pending", "Running")
    cluster.ok("DELETE", PODS + "/crashy")


def test_native_sidecar_starts_before_the_main_container(cluster):
    vol = [{"name": "shared", "emptyDir": {}}]
    mount = [{"name": "shared", "mountPath": "/shared"}]
    side = sh("side", "sleep 0.3; touch /shared/up; exec sleep 1000", restartPolicy="Always",
              volumeMounts=mount, startupProbe={"exec": {"command": ["test", "-f", "/shared/up"]},
                                                "periodSeconds": 1, "failureThreshold": 30})
    init = sh("first", "echo first > /shared/first", volumeMounts=mount)
    main = sh("main", "test -f /shared/up && echo sidecar-first || echo sidecar-late; "
                      "cat /shared/first; echo vol=$COHORT_VOLUME_SHARED; exec sleep 1000",
              volumeMounts=mount)
    cluster.ok("POST", PODS, pod("sidecar", [main], init=[init, side], volumes=vol))
    p = wait_until(lambda: (lambda p: p if p and cond(p, "Ready") == "True" else None)
                   (get_pod(cluster, "sidecar")), "the pod to be ready")
    log = wait_until(lambda: (lambda t: t if "vol=" in t else None)(pod_log(cluster, "sidecar",
                                                                            "main")), "the log")
    assert "sidecar-first" in log and "first" in log
    assert "/volumes/shared" in log
    inits = {s["name"]: s for s in p["status"]["initContainerStatuses"]}
    assert inits["first"]["state"]["terminated"]["exitCode"] == 0
    assert inits["side"]["started"] and "running" in inits["side"]["state"]
    cluster.ok("DELETE", PODS + "/sidecar")


def test_secret_volumes_are_files_with_their_modes(cluster):
    # The pod waits for its Secret (MountVolume failed) and starts once it
    # exists; the files hold the Secret's bytes with the volume's modes.
    vol = [{"name": "sec", "secret": {"secretName": "vol-sec", "defaultMode": 0o400}},
           {"name": "one", "secret": {"secretName": "vol-sec", "items": [
               {"key": "bin", "path": "sub/b", "mode": 0o440}]}}]
    mounts = [{"name": "sec", "mountPath": "/sec", "readOnly": True},
              {"name": "one", "mountPath": "/one"}]
    script = ("stat -c 'key %a' /sec/key; stat -c 'bin %a' /one/sub/b; cat /sec/key; echo; "
              "od -An -tx1 /sec/bin; ls /one; exec sleep 1000")
    cluster.ok("POST", PODS, pod("secvol", [sh("main", script, volumeMounts=mounts)],
                                 volumes=vol))
    wait_until(lambda: "MountVolume failed" in (get_pod(cluster, "secvol")["status"]
                                                .get("message") or ""),
               "the pod to wait for its Secret")
    cluster.ok("POST", SECRETS, {"metadata": {"name": "vol-sec"},
                                 "data": {"key": b64("0123abcd"), "bin": b64(b"\xff\x00\x80")}})
    wait_phase(cluster, "secvol", "Running")
    log = wait_until(lambda: (lambda t: t if "sub" in t else None)(pod_log(cluster, "secvol")),
                     "the log")
    lines = log.split("\n")
    assert lines[0] == "key 400" and lines[1] == "bin 440", log
    assert "0123abcd" in lines[2] and "ff 00 80" in lines[3], log
    cluster.ok("DELETE", PODS + "/secvol")
    cluster.ok("DELETE", SECRETS + "/vol-sec")


def test_env_field_refs_are_filled(cluster):
    env = [{"name": n, "valueFrom": {"fieldRef": {"fieldPath": f}}}
           for n, f in (("NAME", "metadata.name"), ("NS", "metadata.namespace"),
                        ("UID", "metadata.uid"), ("IP", "status.podIP"),
                        ("NODE", "spec.nodeName"))]
    env.append({"name": "GREETING", "value": "hello $(NAME)"})
    cluster.ok("POST", PODS, pod("envy", [sh("main", 'echo "$NAME $NS $UID $IP $NODE $GREETING";'
                                                     " exec sleep 1000", env=env)]))
    p = wait_phase(cluster, "envy", "Running")
    line = wait_until(lambda: pod_log(cluster, "envy").strip(), "the log")
    assert line == "envy default %s %s cohort-node hello envy" % (p["metadata"]["uid"],
                                                                  p["status"]["podIP"])
    cluster.ok("DELETE", PODS + "/envy")


def test_readiness_follows_an_http_probe_on_the_pod_ip(cluster):
    port = random.randint(20000, 60000)
    server = "sleep 2; exec %s -m http.server %d --bind $POD_IP" % (PYTHON, port)
    c = sh("web", server, env=[{"name": "POD_IP", "valueFrom": {"fieldRef": {
        "fieldPath": "status.podIP"}}}], readinessProbe={"httpGet": {"path": "/", "port": port},
                                                         "periodSeconds": 1})
    cluster.ok("POST", PODS, pod("web", [c]))
    p = wait_phase(cluster, "web", "Running")
    assert cond(p, "Ready") == "False"
    wait_until(lambda: cond(get_pod(cluster, "web"), "Ready") == "True", "the probe to pass")
    cluster.ok("DELETE", PODS + "/web")

"""The chart's RBAC is exactly what cohort-operator needs: the chart's
ServiceAccount, Roles and bindings (rendered by the real helm template,
cluster-wide and for one namespace) are applied with the real kubectl to
the API server stand-in enforcing RBAC (with
OwnerReferencesPermissionEnforcement, as hardened clusters run), and the
real operator runs with a token of that ServiceAccount through a cohort's
life: its pods come up on the process kubelet, it trains, is scaled,
status is written, an Event is counted again, it is deleted. No request of
the operator's is refused and every rule of the chart allows at least one
of them (the stand-in records which rule allowed each request). A role
missing one verb makes the operator log the 403 (status, reason, message)
and go on running.
"""
import json
import os
import subprocess

import pytest

from cohorttest import (ROOT, ApiServer, Kubectl, Kubelet, Operator, bin_dir, cohort_manifest,
                        free_port, make_tmp, remove_tmp, wait_until)

HELM = os.path.join(ROOT, "build", "tools", "helm")
CHART = os.path.join(ROOT, "charts", "cohort")
RELEASE_NS = "cohort-system"
SA_USER = "system:serviceaccount:%s:rel-cohort" % RELEASE_NS


def render(*sets):
    """The chart's ServiceAccount and RBAC as helm template renders them."""
    argv = [HELM, "template", "rel", CHART, "--namespace", RELEASE_NS,
            "--show-only", "templates/serviceaccount.yaml", "--show-only", "templates/rbac.yaml"]
    for s in sets:
        argv += ["--set", s]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


def chart_rules(text, kubectl, resources):
    """(kind, namespace, name, rule index, verb) of every verb of every
    rule the rendering holds."""
    docs = kubectl("create", "--dry-run=client", "-o", "json", "-f", "-", stdin=text).stdout
    items, dec, i = [], json.JSONDecoder(), 0
    while docs[i:].strip():
        doc, end = dec.raw_decode(docs[i:].lstrip())
        i = len(docs) - len(docs[i:].lstrip()) + end
        items.extend(doc.get("items", [doc]))
    out = set()
    for o in items:
        if o["kind"] in ("Role", "ClusterRole"):
            for i, rule in enumerate(o.get("rules") or []):
                key = (o["kind"], o["metadata"].get("namespace", "") if o["kind"] == "Role"
                       else "", o["metadata"]["name"], i)
                resources[key] = ",".join(rule["resources"])
                for verb in rule["verbs"]:
                    out.add((o["kind"], o["metadata"].get("namespace", "") if o["kind"] == "Role"
                             else "", o["metadata"]["name"], i, verb))
    return out


class Env:
    pass


def start(prefix, *sets, operator_args=(), edit=None):
    for tool in (HELM, os.path.join(bin_dir(), "cohort-operator")):
        if not os.access(tool, os.X_OK):
            pytest.skip("%s is missing (scripts/install-kubectl.sh; make)" % tool)
    e = Env()
    e.tmp = make_tmp(prefix)
    # The process kubelet speaks only HTTP: it gets the second, plain
    # listener (as admin); everything else talks HTTPS.
    http_kc = os.path.join(e.tmp, "http.kubeconfig")
    e.server = ApiServer(e.tmp, "--tls", "--authorization-mode", "RBAC",
                         "--http-kubeconfig", http_kc,
                         "--enable-admission-plugins", "OwnerReferencesPermissionEnforcement",
                         "--runtime-config", "resource.k8s.io/v1beta1=true",
                         "--bookmark-interval", "0.5")
    e.server.default_token = "cohort-standin"          # the admin's
    e.kubectl = Kubectl(e.server, e.tmp)
    e.kubelet = None
    e.operators = []
    try:
        if not e.kubectl.available():
            pytest.skip("kubectl is not in build/tools")
        e.kubectl("apply", "-f", os.path.join(ROOT, "crds", "trainingcohorts.cohort.dev.yaml"))
        e.kubectl("wait", "--for", "condition=Established", "crd/trainingcohorts.cohort.dev")
        for ns in (RELEASE_NS, "team", "other"):
            e.kubectl("create", "namespace", ns)
        text = render(*sets)
        if edit:
            assert edit[0] in text
            text = text.replace(edit[0], edit[1], 1)
        e.resources = {}
        e.rules = chart_rules(text, e.kubectl, e.resources)
        e.kubectl("apply", "-f", "-", stdin=text)
        token = e.kubectl("create", "token", "rel-cohort", "-n", RELEASE_NS,
                          "--duration", "1h").stdout.strip()
        # The operator's kubeconfig: the server and its CA, the token, and
        # the release's namespace (where its Lease and CA Secret live).
        e.opconfig = os.path.join(e.tmp, "operator.kubeconfig")
        with open(e.server.kubeconfig) as f:
            text = f.read()
        with open(e.opconfig, "w") as f:
            f.write(text.replace("token: cohort-standin", "token: " + token)
                    .replace("namespace: default", "namespace: " + RELEASE_NS))
        plain = Env()
        plain.kubeconfig, plain.call = http_kc, e.server.call
        e.kubelet = Kubelet(plain, e.tmp)
        e.broker_port = free_port()
        cfg = Env()
        cfg.kubeconfig = e.opconfig
        e.operators.append(Operator(cfg, e.tmp, "op-a", e.broker_port, *operator_args))
        return e
    except BaseException:
        stop(e)
        raise


def stop(e):
    rcs = []
    for op in e.operators:
        if op.p.poll() is None:
            rcs.append((op, op.stop()))
    if e.kubelet:
        e.kubelet.stop()
    e.server.stop()
    for op, rc in rcs:
        assert rc == 0, "operator exited with %d:\n%s" % (rc, op.text()[-4000:])
    remove_tmp(e.tmp)


def decisions(e):
    return [d for d in e.server.call("GET", "/debug/cohort/rbac")[1]["decisions"]
            if d["user"] == SA_USER]


def cohort_path(ns, name=""):
    return "/apis/cohort.dev/v1alpha1/namespaces/%s/trainingcohorts%s" % (
        ns, "/" + name if name else "")


def status(e, ns, name):
    code, doc, _ = e.server.call("GET", cohort_path(ns, name), token="cohort-standin")
    return (doc or {}).get("status") or {} if code == 200 else {}


def pods(e, ns, name):
    code, doc, _ = e.server.call("GET", "/api/v1/namespaces/%s/pods?labelSelector=cohort.dev"
                                 "%%2Fcohort%%3D%s" % (ns, name), token="cohort-standin")
    return [p for p in doc["items"] if not p["metadata"].get("deletionTimestamp")] \
        if code == 200 else []


def members(e, ns, name):
    return sorted(m["id"] for m in status(e, ns, name).get("members") or []
                  if not m.get("draining"))


def run_scenario(e, ns):
    """A cohort's life: up, training, scaled, status written, deleted."""
    e.server.default_token = "cohort-standin"
    wait_until(lambda: e.operators[0].metrics().get("is_leader") == 1, "op-a to lead")
    m = cohort_manifest("lr", 2)
    m["metadata"]["namespace"] = ns
    e.kubectl("apply", "-f", "-", stdin=json.dumps(m))
    wait_until(lambda: members(e, ns, "lr") == ["lr-0", "lr-1"] and
               status(e, ns, "lr").get("readyReplicas") == 2, "two members of lr")
    v = status(e, ns, "lr").get("modelVersion") or 0
    wait_until(lambda: (status(e, ns, "lr").get("modelVersion") or 0) > v, "lr to train")
    e.kubectl("scale", "-n", ns, "tc/lr", "--replicas=3")
    wait_until(lambda: members(e, ns, "lr") == ["lr-0", "lr-1", "lr-2"], "lr scaled to three")
    e.kubectl("scale", "-n", ns, "tc/lr", "--replicas=2")
    wait_until(lambda: members(e, ns, "lr") == ["lr-0", "lr-1"] and
               len(pods(e, ns, "lr")) == 2, "lr scaled back to two")
    # lr-2 made again: the same Event raises the first one's count (a
    # patch of events), as client-go's recorder does.
    e.kubectl("scale", "-n", ns, "tc/lr", "--replicas=3")
    wait_until(lambda: [ev for ev in (e.server.get("/api/v1/namespaces/%s/events" % ns) or
                                      {"items": []})["items"]
                        if ev.get("message") == "Created pod lr-2." and ev.get("count") == 2],
               "the Created Event of lr-2 counted twice")
    e.kubectl("delete", "-n", ns, "tc/lr", "--wait=true")
    wait_until(lambda: not pods(e, ns, "lr"), "lr's pods to go")
    # A GPU cohort with a DRA claim: its ResourceClaimTemplate is made
    # (create), made again when spec.gpu changes (get, delete, create),
    # and goes with the cohort.
    tmpl = "/apis/resource.k8s.io/v1beta1/namespaces/%s/resourceclaimtemplates/gp-gpu" % ns

    def count():
        code, t, _ = e.server.call("GET", tmpl, token="cohort-standin")
        return t["spec"]["spec"]["devices"]["requests"][0]["count"] if code == 200 else None
    m = cohort_manifest("gp", 1, extra_spec={"gpu": {"mode": "dra", "count": 1}})
    m["metadata"]["namespace"] = ns
    e.kubectl("apply", "-f", "-", stdin=json.dumps(m))
    wait_until(lambda: count() == 1, "gp's ResourceClaimTemplate")
    e.kubectl("patch", "-n", ns, "tc/gp", "--type", "merge", "-p",
              json.dumps({"spec": {"gpu": {"count": 2}}}))
    wait_until(lambda: count() == 2, "gp's ResourceClaimTemplate made again for two GPUs")
    e.kubectl("delete", "-n", ns, "tc/gp", "--wait=true")
    wait_until(lambda: count() is None and not pods(e, ns, "gp"), "gp's template and pods to go")


def check_all_allowed_and_every_rule_used(e):
    got = decisions(e)
    assert got, "no request of the operator's was seen"
    denied = [d for d in got if not d["allowed"]]
    assert not denied, "the operator was refused: %s" % json.dumps(denied[:5], indent=1)
    used = {(d["allowedBy"]["role"]["kind"], d["allowedBy"]["role"]["namespace"],
             d["allowedBy"]["role"]["name"], d["allowedBy"]["rule"], d["verb"])
            for d in got if d["allowedBy"] and "role" in d["allowedBy"] and
            d["allowedBy"]["role"]["name"].startswith("rel-cohort")}
    rules = {r[:4] for r in e.rules}
    unused = rules - {u[:4] for u in used}
    assert not unused, "rules of the chart that the operator never used: %s" % sorted(unused)
    # Verb by verb: all used but those of paths this life of a cohort does
    # not take (a status write finding its cohort gone: get; a Secret's
    # name already taken: get; the broker's CA renewed: patch).
    rare = {("trainingcohorts", "get"), ("secrets", "get"), ("secrets", "patch")}
    unused_verbs = {(resources_of(e, r), r[4]) for r in e.rules - used}
    assert unused_verbs <= rare, "verbs the operator never used: %s" % sorted(unused_verbs)
    # How the operator words a refusal (see the test below); a bare "403"
    # also matches a port such as 127.0.0.1:40403.
    log = e.operators[0].text()
    assert "status=403" not in log and "HTTP 403" not in log, log


def resources_of(e, rule_key):
    return e.resources[rule_key[:4]]


def test_cluster_wide_rbac_is_exactly_what_the_operator_uses():
    e = start("crbac-")
    try:
        run_scenario(e, "team")
        check_all_allowed_and_every_rule_used(e)
        assert {r[0] for r in e.rules} == {"ClusterRole", "Role"}
    finally:
        stop(e)


def test_namespaced_rbac_is_exactly_what_the_operator_uses_and_no_more():
    e = start("nrbac-", "watchNamespace=team", operator_args=("--namespace", "team"))
    try:
        run_scenario(e, "team")
        check_all_allowed_and_every_rule_used(e)
        assert {r[0] for r in e.rules} == {"Role"}
        # The ServiceAccount sees no other namespace's cohorts.
        with open(e.opconfig) as f:
            token = [ln.split(": ", 1)[1] for ln in f.read().splitlines()
                     if ln.strip().startswith("token: ")][0].strip()
        for path in (cohort_path("other"), "/apis/cohort.dev/v1alpha1/trainingcohorts",
                     "/api/v1/namespaces/other/secrets"):
            code, st, _ = e.server.call("GET", path, token=token)
            assert code == 403 and st["reason"] == "Forbidden", (path, code, st)
            assert 'User "%s" cannot list resource' % SA_USER in st["message"]
    finally:
        stop(e)


def test_a_missing_verb_is_logged_as_the_403_and_the_operator_goes_on():
    # The pods rule without "create": the operator cannot make pods.
    e = start("mrbac-", edit=('verbs: ["list", "watch", "create", "delete"]',
                              'verbs: ["list", "watch", "delete"]'))
    try:
        e.server.default_token = "cohort-standin"
        op = e.operators[0]
        wait_until(lambda: op.metrics().get("is_leader") == 1, "op-a to lead")
        m = cohort_manifest("lr", 1)
        m["metadata"]["namespace"] = "team"
        e.kubectl("apply", "-f", "-", stdin=json.dumps(m))
        want = 'pods is forbidden: User \\"%s\\" cannot create resource \\"pods\\" in API ' \
               'group \\"\\" in the namespace \\"team\\"' % SA_USER

        def logged():
            return [ln for ln in op.text().splitlines() if want in ln]
        lines = wait_until(logged, "the operator to log the 403")
        assert "status=403" in lines[0] and "reason=Forbidden" in lines[0], lines[0]
        assert "No such file" not in lines[0] and "Permission denied" not in lines[0], lines[0]
        # The controller's own line says it too, not an errno sentence.
        wait_until(lambda: [ln for ln in op.text().splitlines() if "A reconcile failed" in ln and
                            "HTTP 403 Forbidden: " + want in ln], "the reconcile's failure line")
        assert op.p.poll() is None and op.metrics().get("is_leader") == 1
    finally:
        stop(e)

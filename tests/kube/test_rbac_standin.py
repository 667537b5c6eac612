"""Proves the API server stand-in's RBAC (tests/kube/apiserver/rbac.py)
decides as Kubernetes does: the request attributes it derives from a path,
rule matching (groups, resources, subresources, wildcards, verbs,
resourceNames, nonResourceURLs), bindings and their subjects, the
system:masters bypass, and the 403 it answers. In-process against a Store,
plus one real server with the real kubectl for the message a user sees.
"""
import os

import pytest

from apiserver.rbac import Authorizer, bootstrap, request_info
from apiserver.store import Store
from cohorttest import ApiServer, Kubectl, make_tmp, remove_tmp

RBAC = "rbac.authorization.k8s.io"
SA_USER = {"name": "system:serviceaccount:ns1:op",
           "groups": ["system:serviceaccounts", "system:serviceaccounts:ns1",
                      "system:authenticated"]}


def put(store, plural, ns, obj):
    kind = {"roles": "Role", "clusterroles": "ClusterRole", "rolebindings": "RoleBinding",
            "clusterrolebindings": "ClusterRoleBinding"}[plural]
    body = dict(obj, apiVersion=RBAC + "/v1", kind=kind)
    with store.lock:
        store.create(store.types[(RBAC, plural)], "v1", ns, body)


def binding(name, role_kind, role, *subjects, ns=None):
    b = {"metadata": {"name": name}, "roleRef": {"apiGroup": RBAC, "kind": role_kind,
                                                 "name": role},
         "subjects": list(subjects)}
    if ns:
        b["metadata"]["namespace"] = ns
    return b


SA = {"kind": "ServiceAccount", "name": "op", "namespace": "ns1"}


@pytest.fixture
def store():
    st = Store(1000, False)
    bootstrap(st)
    return st


def allowed(authz, user, method, path, query=""):
    return authz.authorize(user, request_info(method, path, query)) is None


@pytest.mark.parametrize("method,path,query,want", [
    ("GET", "/api/v1/namespaces/a/pods", "", ("list", "", "a", "pods", "", "")),
    ("GET", "/api/v1/namespaces/a/pods", "watch=true", ("watch", "", "a", "pods", "", "")),
    ("GET", "/api/v1/watch/namespaces/a/pods", "", ("watch", "", "a", "pods", "", "")),
    ("GET", "/api/v1/namespaces/a/pods", "fieldSelector=metadata.name%3Dp1",
     ("list", "", "a", "pods", "", "p1")),
    ("GET", "/api/v1/namespaces/a/pods", "fieldSelector=metadata.name!%3Dp1",
     ("list", "", "a", "pods", "", "")),
    ("GET", "/api/v1/namespaces/a/pods/p1", "watch=true", ("get", "", "a", "pods", "", "p1")),
    ("GET", "/api/v1/namespaces/a/pods/p1/log", "", ("get", "", "a", "pods", "log", "p1")),
    ("POST", "/api/v1/namespaces/a/pods", "", ("create", "", "a", "pods", "", "")),
    ("PUT", "/apis/cohort.dev/v1alpha1/namespaces/a/trainingcohorts/t/status", "",
     ("update", "cohort.dev", "a", "trainingcohorts", "status", "t")),
    ("PATCH", "/apis/coordination.k8s.io/v1/namespaces/a/leases/l", "",
     ("patch", "coordination.k8s.io", "a", "leases", "", "l")),
    ("DELETE", "/api/v1/namespaces/a/pods/p1", "", ("delete", "", "a", "pods", "", "p1")),
    ("DELETE", "/api/v1/namespaces/a/pods", "", ("deletecollection", "", "a", "pods", "", "")),
    ("GET", "/api/v1/namespaces/a", "", ("get", "", "a", "namespaces", "", "a")),
    ("PUT", "/api/v1/namespaces/a/finalize", "", ("update", "", "a", "namespaces", "finalize",
                                                  "a")),
    ("GET", "/api/v1/nodes", "", ("list", "", "", "nodes", "", "")),
    ("POST", "/api/v1/namespaces/a/serviceaccounts/op/token", "",
     ("create", "", "a", "serviceaccounts", "token", "op")),
])
def test_request_info(method, path, query, want):
    i = request_info(method, path, query)
    assert i["resource"]
    assert (i["verb"], i["group"], i["namespace"], i["resource_name"], i["subresource"],
            i["name"]) == want


def test_non_resource_requests():
    for path in ("/api", "/apis", "/apis/cohort.dev", "/version", "/openapi/v3", "/healthz"):
        i = request_info("GET", path, "")
        assert not i["resource"] and i["verb"] == "get" and i["path"] == path


def test_role_rules_match_as_kubernetes(store):
    put(store, "roles", "ns1", {"metadata": {"name": "op", "namespace": "ns1"}, "rules": [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]},
        {"apiGroups": ["cohort.dev"], "resources": ["trainingcohorts/status"],
         "verbs": ["update"]},
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
         "resourceNames": ["cohort-operator"], "verbs": ["get", "update", "create", "list",
                                                         "watch", "deletecollection"]},
        {"apiGroups": ["apps"], "resources": ["*/scale"], "verbs": ["patch"]},
    ]})
    put(store, "rolebindings", "ns1", binding("op", "Role", "op", SA, ns="ns1"))
    a = Authorizer(store)
    assert allowed(a, SA_USER, "GET", "/api/v1/namespaces/ns1/pods")
    assert allowed(a, SA_USER, "GET", "/api/v1/namespaces/ns1/pods/p")
    # watch is a verb of its own; the binding's namespace only.
    assert not allowed(a, SA_USER, "GET", "/api/v1/namespaces/ns1/pods", "watch=true")
    assert not allowed(a, SA_USER, "GET", "/api/v1/namespaces/ns2/pods")
    assert not allowed(a, SA_USER, "GET", "/api/v1/pods")
    # "pods" does not cover its subresources.
    assert not allowed(a, SA_USER, "GET", "/api/v1/namespaces/ns1/pods/p/log")
    # status but not the object; other groups do not count.
    assert allowed(a, SA_USER, "PUT",
                   "/apis/cohort.dev/v1alpha1/namespaces/ns1/trainingcohorts/t/status")
    assert not allowed(a, SA_USER, "PUT",
                       "/apis/cohort.dev/v1alpha1/namespaces/ns1/trainingcohorts/t")
    assert not allowed(a, SA_USER, "PUT", "/apis/other.dev/v1/namespaces/ns1/trainingcohorts/t/"
                       "status")
    # resourceNames: only that name; never create, nor list/watch or
    # deletecollection without the metadata.name field selector.
    lease = "/apis/coordination.k8s.io/v1/namespaces/ns1/leases"
    assert allowed(a, SA_USER, "GET", lease + "/cohort-operator")
    assert allowed(a, SA_USER, "PUT", lease + "/cohort-operator")
    assert not allowed(a, SA_USER, "GET", lease + "/other")
    assert not allowed(a, SA_USER, "POST", lease)
    assert not allowed(a, SA_USER, "GET", lease)
    assert not allowed(a, SA_USER, "GET", lease, "watch=true")
    assert not allowed(a, SA_USER, "DELETE", lease)
    assert allowed(a, SA_USER, "GET", lease, "fieldSelector=metadata.name%3Dcohort-operator")
    assert allowed(a, SA_USER, "GET", lease, "watch=1&fieldSelector=metadata.name%3D"
                   "cohort-operator")
    assert not allowed(a, SA_USER, "GET", lease, "fieldSelector=metadata.name%3Dother")
    # */subresource
    assert allowed(a, SA_USER, "PATCH", "/apis/apps/v1/namespaces/ns1/deployments/d/scale")
    assert not allowed(a, SA_USER, "PATCH", "/apis/apps/v1/namespaces/ns1/deployments/d")
    hits = {(h["role"]["name"], h["rule"]) for h in a.report()["ruleHits"]}
    assert ("op", 0) in hits and ("op", 1) in hits and ("op", 2) in hits and ("op", 3) in hits


def test_cluster_roles_through_each_binding_kind(store):
    put(store, "clusterroles", "", {"metadata": {"name": "reader"}, "rules": [
        {"apiGroups": ["*"], "resources": ["*"], "verbs": ["get"]},
        {"nonResourceURLs": ["/metrics", "/logs/*"], "verbs": ["get"]}]})
    put(store, "rolebindings", "ns1", binding("r", "ClusterRole", "reader",
                                              {"kind": "Group", "name": "readers"}, ns="ns1"))
    put(store, "clusterrolebindings", "", binding("alice", "ClusterRole", "reader",
                                                  {"kind": "User", "name": "alice"}))
    # A RoleBinding to a Role that does not exist, and one whose
    # ServiceAccount subject lacks its namespace, grant nothing.
    put(store, "rolebindings", "ns1", binding("dangling", "Role", "missing",
                                              {"kind": "User", "name": "carol"}, ns="ns1"))
    put(store, "clusterrolebindings", "", binding("nons", "ClusterRole", "reader",
                                                  {"kind": "ServiceAccount", "name": "op"}))
    a = Authorizer(store)
    carol = {"name": "carol", "groups": ["readers", "system:authenticated"]}
    alice = {"name": "alice", "groups": ["system:authenticated"]}
    assert allowed(a, carol, "GET", "/apis/cohort.dev/v1alpha1/namespaces/ns1/trainingcohorts/t")
    assert allowed(a, carol, "GET", "/api/v1/namespaces/ns1/pods/p/log")    # "*" takes subs
    assert not allowed(a, carol, "GET", "/api/v1/namespaces/ns2/pods/p")
    assert not allowed(a, carol, "GET", "/api/v1/nodes/n")                  # cluster-scoped
    assert not allowed(a, carol, "GET", "/metrics")        # URLs only through cluster bindings
    assert allowed(a, alice, "GET", "/api/v1/nodes/n")
    assert allowed(a, alice, "GET", "/metrics")
    assert allowed(a, alice, "GET", "/logs/x/y")
    assert not allowed(a, alice, "GET", "/logs")
    assert not allowed(a, alice, "POST", "/metrics")
    assert not allowed(a, SA_USER, "GET", "/api/v1/nodes/n")
    # Every authenticated user may discover; anonymous only the public info.
    assert allowed(a, SA_USER, "GET", "/apis/cohort.dev")
    assert allowed(a, SA_USER, "GET", "/openapi/v3/apis/cohort.dev/v1alpha1")
    assert allowed(a, SA_USER, "POST",
                   "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews")
    anon = {"name": "system:anonymous", "groups": ["system:unauthenticated"]}
    assert allowed(a, anon, "GET", "/version")
    assert not allowed(a, anon, "GET", "/api")
    root = {"name": "root", "groups": ["system:masters"]}
    assert allowed(a, root, "DELETE", "/api/v1/namespaces/ns1")


@pytest.mark.parametrize("method,path,query,message,details", [
    ("GET", "/api/v1/namespaces/x/pods", "",
     'pods is forbidden: User "system:serviceaccount:ns1:op" cannot list resource "pods" in API '
     'group "" in the namespace "x"', {"kind": "pods"}),
    ("GET", "/apis/coordination.k8s.io/v1/namespaces/x/leases/l", "",
     'leases.coordination.k8s.io "l" is forbidden: User "system:serviceaccount:ns1:op" cannot '
     'get resource "leases" in API group "coordination.k8s.io" in the namespace "x"',
     {"kind": "leases", "group": "coordination.k8s.io", "name": "l"}),
    ("PUT", "/apis/cohort.dev/v1alpha1/namespaces/x/trainingcohorts/t/finalizers", "",
     'trainingcohorts.cohort.dev "t" is forbidden: User "system:serviceaccount:ns1:op" cannot '
     'update resource "trainingcohorts/finalizers" in API group "cohort.dev" in the namespace '
     '"x"', {"kind": "trainingcohorts", "group": "cohort.dev", "name": "t"}),
    ("GET", "/api/v1/nodes", "watch=true",
     'nodes is forbidden: User "system:serviceaccount:ns1:op" cannot watch resource "nodes" in '
     'API group "" at the cluster scope', {"kind": "nodes"}),
    ("GET", "/metrics", "", 'forbidden: User "system:serviceaccount:ns1:op" cannot get path '
     '"/metrics"', {}),
])
def test_denials_are_kubernetes_403s(store, method, path, query, message, details):
    err = Authorizer(store).authorize(SA_USER, request_info(method, path, query))
    st = err.status()
    assert err.code == 403 and st["reason"] == "Forbidden" and st["code"] == 403
    assert st["message"] == message
    assert st.get("details", {}) == details


def test_kubectl_sees_the_403_and_rules_take_effect(tmp_path_factory):
    tmp = make_tmp("cohort-rbac-")
    srv = ApiServer(tmp, "--tls", "--authorization-mode", "RBAC")
    try:
        k = Kubectl(srv, tmp)
        if not k.available():
            pytest.skip("kubectl is not in build/tools: %s" % k.why_missing)
        k("create", "serviceaccount", "bob")
        token = k("create", "token", "bob").stdout.strip()
        r = k("--token", token, "get", "pods", check=False)
        assert r.returncode != 0
        assert 'Error from server (Forbidden): pods is forbidden: User ' \
               '"system:serviceaccount:default:bob" cannot list resource "pods" in API group "" ' \
               'in the namespace "default"' in r.stderr
        k("create", "role", "pod-reader", "--verb=get,list", "--resource=pods")
        k("create", "rolebinding", "bob-reads", "--role=pod-reader",
          "--serviceaccount=default:bob")
        assert k("--token", token, "get", "pods", check=False).returncode == 0
        r = k("--token", token, "delete", "pod", "x", check=False)
        assert 'cannot delete resource "pods"' in r.stderr
        # No credentials under RBAC is system:anonymous, refused.
        code, st, _ = srv.call("GET", "/api/v1/namespaces/default/pods", token="")
        assert code == 403 and 'User "system:anonymous"' in st["message"]
        rep = srv.call("GET", "/debug/cohort/rbac")[1]
        assert any(h["role"]["name"] == "pod-reader" for h in rep["ruleHits"])
        assert os.path.exists(os.path.join(tmp, "ca.crt"))
    finally:
        srv.stop()
        remove_tmp(tmp)

"""Authorization: the RBAC authorizer (--authorization-mode RBAC), as
kube-apiserver's RequestInfoFactory, its privileged-group authorizer and
the rbac authorizer decide a request, and the 403 it answers.

- request_info() turns a method, path and query into the attributes RBAC
  sees: verb (get, list, watch, create, update, patch, delete,
  deletecollection; the HTTP method lowercased for non-resource paths),
  API group, namespace, resource, subresource and name. A list or watch
  whose field selector is metadata.name=X has name X; the namespace of
  /api/v1/namespaces/X is X.
- Authorizer.authorize() allows system:masters outright, then walks the
  ClusterRoleBindings and the RoleBindings of the request's namespace in
  the store, matching subjects (User, Group, ServiceAccount) and the rules
  of the Role or ClusterRole they name: apiGroups, resources (exact,
  "*", "resource/subresource", "*/subresource"), verbs, resourceNames
  (no name never matches a rule that lists names, so names cannot restrict
  create, or list, watch and deletecollection without the field selector)
  and nonResourceURLs (exact, or a prefix ending in "*"; only through
  ClusterRoleBindings). Every allowed request is recorded with the rule
  that allowed it (hits(), served at /debug/cohort/rbac).
- bootstrap() creates the default roles a real cluster has that kubectl
  and every client need: cluster-admin, system:discovery,
  system:basic-user and system:public-info-viewer, with their bindings.

Left out (docs/sandbox.md): aggregated ClusterRoles (aggregationRule),
the escalation checks on writing Roles and bindings (the escalate and bind
verbs), impersonation, and the Node authorizer.
"""
import threading
import urllib.parse

from .errors import ApiError

RBAC = "rbac.authorization.k8s.io"
# /api/v1/namespaces/NAME/status and /finalize are subresources of the
# namespace, not a resource in it.
NAMESPACE_SUBRESOURCES = ("status", "finalize")


def request_info(method, path, query):
    """The attributes of a request, as RequestInfoFactory makes them: a
    dict with resource (bool), verb, path, and for resource requests
    group, version, namespace, resource, subresource, name."""
    q = {k: v[-1] for k, v in urllib.parse.parse_qs(query or "", keep_blank_values=True).items()}
    verb = {"POST": "create", "GET": "get", "HEAD": "get", "PUT": "update", "PATCH": "patch",
            "DELETE": "delete"}.get(method, "")
    non = {"resource": False, "verb": method.lower(), "path": path}
    parts = [p for p in path.split("/") if p]
    if not parts or parts[0] not in ("api", "apis"):
        return non
    if parts[0] == "api":
        if len(parts) < 2:
            return non
        group, version, rest = "", parts[1], parts[2:]
    else:
        if len(parts) < 3:
            return non
        group, version, rest = parts[1], parts[2], parts[3:]
    if not rest:
        return non
    info = {"resource": True, "verb": verb, "path": path, "group": group, "version": version,
            "namespace": "", "resource_name": "", "subresource": "", "name": ""}
    if rest[0] == "watch":
        info["verb"] = "watch"
        rest = rest[1:]
        if not rest:
            return non
    if rest[0] == "namespaces":
        if len(rest) > 1:
            info["namespace"] = rest[1]
            if len(rest) > 2 and rest[2] not in NAMESPACE_SUBRESOURCES:
                rest = rest[2:]
    info["resource_name"] = rest[0]
    if len(rest) >= 2:
        info["name"] = rest[1]
    if len(rest) >= 3:
        info["subresource"] = rest[2]
    if not info["name"] and info["verb"] == "get":
        info["verb"] = "watch" if q.get("watch") in ("true", "1", "True") else "list"
        terms = [t.strip() for t in (q.get("fieldSelector") or "").split(",") if t.strip()]
        for t in terms:
            for op in ("==", "="):
                k, sep, v = t.partition(op)
                if sep and k.strip() == "metadata.name" and not k.endswith("!"):
                    info["name"] = v.strip()
                    break
    if not info["name"] and info["verb"] == "delete":
        info["verb"] = "deletecollection"
    return info


def forbidden(user, info):
    """The 403 Status kube-apiserver answers a denied request with."""
    who = user.get("name", "")
    if not info["resource"]:
        return ApiError(403, "Forbidden", 'forbidden: User "%s" cannot %s path "%s"' %
                        (who, info["verb"], info["path"]), {})
    res = info["resource_name"]
    combined = res + ("/" + info["subresource"] if info["subresource"] else "")
    if info["namespace"]:
        why = 'User "%s" cannot %s resource "%s" in API group "%s" in the namespace "%s"' % (
            who, info["verb"], combined, info["group"], info["namespace"])
    else:
        why = 'User "%s" cannot %s resource "%s" in API group "%s" at the cluster scope' % (
            who, info["verb"], combined, info["group"])
    qualified = res + ("." + info["group"] if info["group"] else "")
    if info["name"]:
        msg = '%s "%s" is forbidden: %s' % (qualified, info["name"], why)
    else:
        msg = "%s is forbidden: %s" % (qualified, why)
    details = {"kind": res}
    if info["group"]:
        details["group"] = info["group"]
    if info["name"]:
        details["name"] = info["name"]
    return ApiError(403, "Forbidden", msg, details)


def subject_matches(subject, user, binding_ns):
    kind = subject.get("kind")
    if kind == "User":
        return subject.get("name") == user.get("name")
    if kind == "Group":
        return subject.get("name") in user.get("groups", ())
    if kind == "ServiceAccount":
        ns = subject.get("namespace") or ""
        # A ServiceAccount subject needs its namespace, as the real
        # validation demands; none never matches.
        return bool(ns) and user.get("name") == "system:serviceaccount:%s:%s" % (
            ns, subject.get("name"))
    return False


def resource_matches(rule_resources, info):
    sub = info["subresource"]
    combined = info["resource_name"] + ("/" + sub if sub else "")
    for r in rule_resources:
        if r == "*" or r == combined:
            return True
        if sub and r == "*/" + sub:
            return True
    return False


def rule_allows(rule, info):
    """Whether one PolicyRule allows a request (rbac's RuleAllows)."""
    verbs = rule.get("verbs") or []
    if "*" not in verbs and info["verb"] not in verbs:
        return False
    if info["resource"]:
        groups = rule.get("apiGroups") or []
        if "*" not in groups and info["group"] not in groups:
            return False
        if not resource_matches(rule.get("resources") or [], info):
            return False
        names = rule.get("resourceNames") or []
        return not names or info["name"] in names
    for url in rule.get("nonResourceURLs") or []:
        if url == "*" or url == info["path"]:
            return True
        if url.endswith("*") and info["path"].startswith(url[:-1]):
            return True
    return False


class Authorizer:
    """RBAC over the Roles and bindings in a store."""

    def __init__(self, store):
        self.store = store
        self.lock = threading.Lock()
        self.hits = {}              # (role kind, ns, name, rule index) -> count
        self.log = []               # the last decisions, newest last
        self.max_log = 20000

    def _objs(self, plural):
        return list(self.store.objects.get((RBAC, plural), {}).values())

    def _role(self, ref, ns):
        kind, name = ref.get("kind"), ref.get("name")
        if ref.get("apiGroup", RBAC) != RBAC:
            return None, None
        if kind == "ClusterRole":
            for r in self._objs("clusterroles"):
                if r["metadata"]["name"] == name:
                    return r, ("ClusterRole", "", name)
        elif kind == "Role" and ns:
            for r in self._objs("roles"):
                if r["metadata"]["name"] == name and r["metadata"].get("namespace") == ns:
                    return r, ("Role", ns, name)
        return None, None

    def authorize(self, user, info):
        """None when allowed, else the 403 ApiError. Records the decision."""
        if "system:masters" in user.get("groups", ()):
            return self._record(user, info, {"group": "system:masters"})
        with self.store.lock:
            bindings = [("ClusterRoleBinding", b) for b in self._objs("clusterrolebindings")]
            ns = info.get("namespace") if info["resource"] else ""
            if ns:
                bindings += [("RoleBinding", b) for b in self._objs("rolebindings")
                             if b["metadata"].get("namespace") == ns]
            for kind, b in sorted(bindings, key=lambda kb: (kb[0], kb[1]["metadata"].get(
                    "namespace", ""), kb[1]["metadata"]["name"])):
                bns = b["metadata"].get("namespace", "")
                if not any(subject_matches(s, user, bns) for s in b.get("subjects") or []):
                    continue
                role, rkey = self._role(b.get("roleRef") or {}, bns)
                if role is None:
                    continue
                for i, rule in enumerate(role.get("rules") or []):
                    if kind == "RoleBinding" and not info["resource"]:
                        break       # nonResourceURLs count only cluster-wide
                    if rule_allows(rule, info):
                        return self._record(user, info, {
                            "binding": {"kind": kind, "namespace": bns,
                                        "name": b["metadata"]["name"]},
                            "role": {"kind": rkey[0], "namespace": rkey[1], "name": rkey[2]},
                            "rule": i}, key=rkey + (i,))
        err = forbidden(user, info)
        self._record(user, info, None)
        return err

    def _record(self, user, info, by, key=None):
        entry = {"user": user.get("name"), "groups": list(user.get("groups", ())),
                 "verb": info["verb"], "path": info["path"], "allowed": by is not None,
                 "allowedBy": by}
        if info["resource"]:
            entry.update({"group": info["group"], "namespace": info["namespace"],
                          "resource": info["resource_name"],
                          "subresource": info["subresource"], "name": info["name"]})
        with self.lock:
            if key is not None:
                self.hits[key] = self.hits.get(key, 0) + 1
            self.log.append(entry)
            if len(self.log) > self.max_log:
                del self.log[:len(self.log) - self.max_log]
        return None

    def report(self):
        """/debug/cohort/rbac: every decision kept, and the hits per rule."""
        with self.lock:
            hits = [{"role": {"kind": k[0], "namespace": k[1], "name": k[2]}, "rule": k[3],
                     "count": n} for k, n in sorted(self.hits.items())]
            return {"decisions": list(self.log), "ruleHits": hits}


BOOTSTRAP = [
    ("clusterroles", {"metadata": {"name": "cluster-admin"},
                      "rules": [{"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]},
                                {"nonResourceURLs": ["*"], "verbs": ["*"]}]}),
    ("clusterroles", {"metadata": {"name": "system:discovery"},
                      "rules": [{"nonResourceURLs": ["/api", "/api/*", "/apis", "/apis/*",
                                                     "/healthz", "/livez", "/openapi",
                                                     "/openapi/*", "/readyz", "/version",
                                                     "/version/"],
                                 "verbs": ["get"]}]}),
    ("clusterroles", {"metadata": {"name": "system:basic-user"},
                      "rules": [{"apiGroups": ["authorization.k8s.io"],
                                 "resources": ["selfsubjectaccessreviews",
                                               "selfsubjectrulesreviews"],
                                 "verbs": ["create"]},
                                {"apiGroups": ["authentication.k8s.io"],
                                 "resources": ["selfsubjectreviews"], "verbs": ["create"]}]}),
    ("clusterroles", {"metadata": {"name": "system:public-info-viewer"},
                      "rules": [{"nonResourceURLs": ["/healthz", "/livez", "/readyz", "/version",
                                                     "/version/"],
                                 "verbs": ["get"]}]}),
    ("clusterrolebindings", {"metadata": {"name": "cluster-admin"},
                             "roleRef": {"apiGroup": RBAC, "kind": "ClusterRole",
                                         "name": "cluster-admin"},
                             "subjects": [{"apiGroup": RBAC, "kind": "Group",
                                           "name": "system:masters"}]}),
    ("clusterrolebindings", {"metadata": {"name": "system:discovery"},
                             "roleRef": {"apiGroup": RBAC, "kind": "ClusterRole",
                                         "name": "system:discovery"},
                             "subjects": [{"apiGroup": RBAC, "kind": "Group",
                                           "name": "system:authenticated"}]}),
    ("clusterrolebindings", {"metadata": {"name": "system:basic-user"},
                             "roleRef": {"apiGroup": RBAC, "kind": "ClusterRole",
                                         "name": "system:basic-user"},
                             "subjects": [{"apiGroup": RBAC, "kind": "Group",
                                           "name": "system:authenticated"}]}),
    ("clusterrolebindings", {"metadata": {"name": "system:public-info-viewer"},
                             "roleRef": {"apiGroup": RBAC, "kind": "ClusterRole",
                                         "name": "system:public-info-viewer"},
                             "subjects": [{"apiGroup": RBAC, "kind": "Group",
                                           "name": "system:authenticated"},
                                          {"apiGroup": RBAC, "kind": "Group",
                                           "name": "system:unauthenticated"}]}),
]


def bootstrap(store):
    """Creates the default roles and bindings, labelled as the real
    server labels its bootstrap policy."""
    with store.lock:
        for plural, obj in BOOTSTRAP:
            rt = store.types[(RBAC, plural)]
            body = dict(obj, apiVersion=RBAC + "/v1",
                        kind="ClusterRole" if plural == "clusterroles" else "ClusterRoleBinding")
            body["metadata"] = dict(obj["metadata"], labels={
                "kubernetes.io/bootstrapping": "rbac-defaults"},
                annotations={"rbac.authorization.kubernetes.io/autoupdate": "true"})
            if store.get(rt, "", obj["metadata"]["name"]) is None:
                store.create(rt, "v1", "", body)


def _blocking_refs(obj):
    refs = ((obj or {}).get("metadata") or {}).get("ownerReferences") or []
    return [r for r in refs if isinstance(r, dict) and r.get("blockOwnerDeletion") is True]


def _refs(obj):
    return ((obj or {}).get("metadata") or {}).get("ownerReferences") or []


def owner_references_check(authz, store, user, info, method, body, ctype):
    """The OwnerReferencesPermissionEnforcement admission plugin
    (--enable-admission-plugins): changing an object's ownerReferences
    other than on create needs delete on the object, and a new
    blockOwnerDeletion reference needs update on the owner's finalizers
    subresource. Returns None or the 403 ApiError, worded as the
    plugin's."""
    if not info["resource"] or info["subresource"] or method not in ("POST", "PUT", "PATCH"):
        return None
    with store.lock:
        rt = store.lookup(info["group"], info["version"], info["resource_name"])
        if rt is None:
            return None
        old = store.get(rt, info["namespace"], info["name"]) if info["name"] else None
        new = body if isinstance(body, dict) else None
        if method == "PATCH" and old is not None:
            ptype = {"application/json-patch+json": "json",
                     "application/merge-patch+json": "merge",
                     "application/strategic-merge-patch+json": "strategic"}.get(ctype)
            if ptype is None:
                return None
            try:
                new = store.patch(rt, info["version"], info["namespace"], info["name"], ptype,
                                  body, None, True, "Ignore", [])
            except ApiError:
                return None         # the real request reports it
        if new is None or _refs(new) == _refs(old):
            return None
        ns = info["namespace"]
        kind_of = {(t.group, t.kind): t for t in store.types.values()}

    def denied(why):
        qualified = info["resource_name"] + ("." + info["group"] if info["group"] else "")
        name = info["name"] or ((new.get("metadata") or {}).get("name") or "")
        return ApiError(403, "Forbidden", '%s "%s" is forbidden: %s' % (qualified, name, why),
                        {"name": name, "group": info["group"], "kind": info["resource_name"]})
    if method != "POST":
        rec = dict(info, verb="delete", subresource="")
        if authz.authorize(user, rec) is not None:
            return denied("cannot set an ownerRef on a resource you can't delete: , <nil>")
    had = {(r.get("uid"), r.get("name")) for r in _blocking_refs(old)}
    for ref in _blocking_refs(new):
        if (ref.get("uid"), ref.get("name")) in had:
            continue
        group, _, version = (ref.get("apiVersion") or "").rpartition("/")
        t = kind_of.get((group, ref.get("kind")))
        if t is None:
            return denied("cannot set blockOwnerDeletion in this case because cannot find "
                          "RESTMapping for APIVersion %s Kind %s" % (ref.get("apiVersion"),
                                                                    ref.get("kind")))
        rec = {"resource": True, "verb": "update", "path": info["path"], "group": group,
               "version": version, "namespace": ns, "resource_name": t.plural,
               "subresource": "finalizers", "name": ref.get("name") or ""}
        if authz.authorize(user, rec) is not None:
            return denied("cannot set blockOwnerDeletion if an ownerReference refers to a "
                          "resource you can't set finalizers on: , <nil>")
    return None

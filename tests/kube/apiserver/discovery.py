"""Discovery and OpenAPI: /version, the legacy and aggregated
(apidiscovery.k8s.io) resource lists, and the OpenAPI v3 documents
kubectl reads to learn that this server validates fields itself.
"""
import base64
import copy
import hashlib
import sys

from .resources import version_priority


VERSION_INFO = {
    "major": "1", "minor": "32", "gitVersion": "v1.32.0-cohort-standin",
    "gitCommit": "0000000000000000000000000000000000000000", "gitTreeState": "clean",
    "buildDate": "2025-01-01T00:00:00Z", "goVersion": "python" + sys.version.split()[0],
    "compiler": "cpython", "platform": "linux/amd64",
}

ALL_VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]
SUB_VERBS = ["get", "patch", "update"]


AGGREGATED = "as=APIGroupDiscoveryList"
BUILTIN_GROUP_ORDER = ["", "apps", "events.k8s.io", "autoscaling", "policy",
                       "rbac.authorization.k8s.io", "coordination.k8s.io", "apiextensions.k8s.io"]


def groups_of(store):
    """{group: [versions, preferred first]} in the order the real server lists them."""
    out = {}
    for rt in store.types.values():
        vs = out.setdefault(rt.group, [])
        for v in rt.versions:
            if v not in vs:
                vs.append(v)
    for g in out:
        out[g].sort(key=version_priority)

    def order(g):
        return (BUILTIN_GROUP_ORDER.index(g) if g in BUILTIN_GROUP_ORDER else 99, g)
    return {g: out[g] for g in sorted(out, key=order)}


def types_in(store, group, version):
    return sorted((rt for rt in store.types.values() if rt.group == group and
                   version in rt.versions), key=lambda r: r.plural)


def subresources_of(rt, version):
    subs = []
    if rt.has_status(version):
        subs.append(("status", rt.group, version, rt.kind, SUB_VERBS))
    if rt.scale_paths(version):
        subs.append(("scale", "autoscaling", "v1", "Scale", SUB_VERBS))
    for name, g, v, kind, verbs in rt.extra_subresources:
        subs.append((name, g, v, kind, verbs))
    return subs


def resource_list(store, group, version):
    res = []
    for rt in types_in(store, group, version):
        r = {"name": rt.plural, "singularName": rt.singular, "namespaced": rt.namespaced,
             "kind": rt.kind, "verbs": ALL_VERBS,
             "storageVersionHash": base64.b64encode(hashlib.sha256(
                 ("%s/%s/%s" % (rt.group, rt.storage_version, rt.kind)).encode()).digest()[:8]
             ).decode()}
        if rt.short_names:
            r["shortNames"] = rt.short_names
        if rt.categories:
            r["categories"] = rt.categories
        res.append(r)
        for sub, g, v, kind, verbs in subresources_of(rt, version):
            s = {"name": rt.plural + "/" + sub, "singularName": "", "namespaced": rt.namespaced,
                 "kind": kind, "verbs": verbs}
            if (g, v) != (rt.group, version):
                s["group"], s["version"] = g, v
            res.append(s)
    return {"kind": "APIResourceList", "apiVersion": "v1",
            "groupVersion": "%s/%s" % (group, version) if group else version, "resources": res}


def api_group(group, versions):
    vs = [{"groupVersion": "%s/%s" % (group, v), "version": v} for v in versions]
    return {"name": group, "versions": vs, "preferredVersion": vs[0]}


def aggregated_discovery(store, core, api_version):
    items = []
    for group, versions in groups_of(store).items():
        if (group == "") != core:
            continue
        vlist = []
        for v in versions:
            res = []
            for rt in types_in(store, group, v):
                r = {"resource": rt.plural,
                     "responseKind": {"group": group, "version": v, "kind": rt.kind},
                     "scope": "Namespaced" if rt.namespaced else "Cluster",
                     "singularResource": rt.singular, "verbs": ALL_VERBS}
                if rt.short_names:
                    r["shortNames"] = rt.short_names
                if rt.categories:
                    r["categories"] = rt.categories
                subs = [{"subresource": sub, "responseKind": {"group": g, "version": sv,
                                                              "kind": kind}, "verbs": verbs}
                        for sub, g, sv, kind, verbs in subresources_of(rt, v)]
                if subs:
                    r["subresources"] = subs
                res.append(r)
            vlist.append({"version": v, "resources": res, "freshness": "Current"})
        items.append({"metadata": {"name": group, "creationTimestamp": None}, "versions": vlist})
    return {"kind": "APIGroupDiscoveryList", "apiVersion": api_version, "metadata": {},
            "items": items}


def schema_name(rt, version):
    if rt.crd is not None:
        return ".".join(reversed(rt.group.split("."))) + ".%s.%s" % (version, rt.kind)
    return "io.k8s.api.%s.%s.%s" % ((rt.group or "core").split(".")[0], version, rt.kind)


QUERY_PARAMS = [{"name": n, "in": "query", "schema": {"type": "string"}, "description": d}
                for n, d in (("dryRun", "When present, modifications are not persisted."),
                             ("fieldManager", "Name of the actor making the change."),
                             ("fieldValidation", "Ignore, Warn or Strict: what to do with "
                              "unknown or duplicate fields."))]


def openapi_doc(store, group, version):
    """An OpenAPI v3 document for one group/version: enough for kubectl to
    find each kind's paths, see that PATCH takes fieldValidation (so it
    lets this server validate), and explain custom resources."""
    paths, schemas = {}, {}
    prefix = "/apis/%s/%s" % (group, version) if group else "/api/" + version
    for rt in types_in(store, group, version):
        gvk = {"group": group, "version": version, "kind": rt.kind}
        name = schema_name(rt, version)
        ref = {"$ref": "#/components/schemas/" + name}
        base = prefix + ("/namespaces/{namespace}" if rt.namespaced else "") + "/" + rt.plural

        def op(action, body=None, content=("application/json",), gvk=gvk, ref=ref):
            o = {"x-kubernetes-action": action, "x-kubernetes-group-version-kind": gvk,
                 "parameters": QUERY_PARAMS if action not in ("get", "list") else [],
                 "responses": {"200": {"description": "OK",
                                       "content": {"application/json": {"schema": ref}}}}}
            if body:
                o["requestBody"] = {"content": {c: {"schema": body} for c in content}}
            return o
        patch_types = ("application/json-patch+json", "application/merge-patch+json")
        paths[base] = {"get": op("list"), "post": op("post", ref)}
        paths[base + "/{name}"] = {"get": op("get"), "put": op("put", ref),
                                   "patch": op("patch", {"type": "object"}, patch_types),
                                   "delete": op("delete")}
        if rt.has_status(version):
            paths[base + "/{name}/status"] = {"get": op("get"), "put": op("put", ref),
                                              "patch": op("patch", {"type": "object"}, patch_types)}
        schema = copy.deepcopy(rt.schema(version)) if rt.crd is not None else None
        if not schema:
            schema = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
        schema.setdefault("properties", {})
        schema["properties"]["apiVersion"] = {"type": "string"}
        schema["properties"]["kind"] = {"type": "string"}
        schema["properties"]["metadata"] = {"type": "object",
                                            "description": "Standard object metadata.",
                                            "x-kubernetes-preserve-unknown-fields": True}
        schema["x-kubernetes-group-version-kind"] = [gvk]
        schemas[name] = schema
    return {"openapi": "3.0.0",
            "info": {"title": "Kubernetes", "version": VERSION_INFO["gitVersion"]},
            "paths": paths, "components": {"schemas": schemas}}

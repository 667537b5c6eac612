"""The store: every object and the event history behind one lock. One
global resourceVersion counter, consistent list pages rebuilt from the
history, the event history that watches read, creates, updates, patches
and deletes with their preconditions, the scale and binding
subresources, and garbage collection (owner references, foreground and
orphan deletion, namespace and CRD cleanup).
"""
import base64
import bisect
import collections
import copy
import datetime
import json
import random
import threading
import uuid

from .common import dumps, go_value, is_int, rfc3339, utcnow
from .errors import ApiError, FieldError, err_bad_request, err_conflict, err_invalid, err_not_found
from .kinds import defaults_and_errors
from .patch import PatchError, json_patch, merge_patch, strategic_merge_patch
from .resources import builtin_types, type_from_crd
from .schema import apply_defaults, prune, validate_rules, validate_schema
from .selection import fields_match, jsonpath, selector_string
from .strategies import (crd_defaults, crd_status, pod_defaults, pod_qos, secret_defaults,
                         validate_crd, validate_meta, validate_pod, validate_secret)


Ev = collections.namedtuple("Ev", "rv key type obj old")

GENERATION_KINDS = {("apiextensions.k8s.io", "customresourcedefinitions"), ("apps", "deployments"),
                    ("policy", "poddisruptionbudgets"),
                    ("networking.k8s.io", "networkpolicies"),
                    ("autoscaling", "horizontalpodautoscalers")}
PROTECTED_NAMESPACES = ("default", "kube-system", "kube-public")
CRD_CLEANUP = "customresourcecleanup.apiextensions.k8s.io"
SERVER_META = ("uid", "resourceVersion", "generation", "creationTimestamp", "deletionTimestamp",
               "deletionGracePeriodSeconds", "selfLink")


def meta_of(obj):
    return obj.get("metadata") or {}


def nkey(obj):
    m = meta_of(obj)
    return (m.get("namespace") or "", m.get("name") or "")


def without(obj, *fields):
    return {k: v for k, v in obj.items() if k not in fields}


def set_path(obj, path, value):
    parts = [p for p in path.split(".") if p]
    cur = obj
    for p in parts[:-1]:
        cur = cur.setdefault(p, {})
    cur[parts[-1]] = value


def encode_continue(rv, start):
    return base64.urlsafe_b64encode(dumps({"rv": rv, "start": list(start)}).encode()).decode()


def decode_continue(token):
    try:
        d = json.loads(base64.urlsafe_b64decode(token.encode() + b"==="))
        return int(d["rv"]), tuple(d["start"])
    except (ValueError, KeyError, TypeError):
        raise err_bad_request("invalid continue token")


class Store:
    """All objects and the event history, behind one lock. Every method
    that touches state takes the lock; watchers wait on the condition and
    copy events out, so a slow watcher never holds up a writer."""

    def __init__(self, history_size=1000, strict_namespaces=False, runtime_config=(),
                 service_block=0):
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.rv = 0
        self.types = {}
        self.objects = {}
        self.uids = {}
        self.history = []
        self.history_rvs = []
        self.history_size = max(1, history_size)
        self.compacted = 0          # events up to this resourceVersion are forgotten
        self.strict_namespaces = strict_namespaces
        # Services' clusterIPs come from 127.96.B.0/24 for
        # --service-ip-block B (create() below), so that clusters side by
        # side on one machine (test processes in parallel, a sandbox)
        # never proxy the same address.
        self.service_block = service_block
        self.next_cluster_ip = 0
        self.gc_wake = threading.Event()
        for rt in builtin_types(runtime_config):
            self.types[rt.key] = rt
            rt.generation = rt.key in GENERATION_KINDS
        with self.lock:
            for ns in ("default", "kube-system", "kube-public", "kube-node-lease"):
                self.create(self.types[("", "namespaces")], "v1", "",
                            {"metadata": {"name": ns}})
        threading.Thread(target=self._gc_loop, name="gc", daemon=True).start()

    # -- lookups ----------------------------------------------------------

    def lookup(self, group, version, plural):
        rt = self.types.get((group, plural))
        if rt is None or version not in rt.versions:
            return None
        return rt

    def get(self, rt, ns, name):
        return self.objects.get(rt.key, {}).get((ns if rt.namespaced else "", name))

    def must_get(self, rt, ns, name):
        obj = self.get(rt, ns, name)
        if obj is None:
            raise err_not_found(rt, name)
        return obj

    def by_uid(self, uid):
        at = self.uids.get(uid)
        if at is None:
            return None, None
        return self.types.get(at[0]), self.objects.get(at[0], {}).get(at[1])

    @staticmethod
    def out(rt, version, obj):
        """The object as a client of `version` sees it (conversion None)."""
        o = {"kind": rt.kind, "apiVersion": rt.gv(version)}
        o.update((k, v) for k, v in obj.items() if k not in ("kind", "apiVersion"))
        return o

    # -- committing ---------------------------------------------------------

    def _commit(self, rt, typ, obj, old):
        """Stores one change under a new resourceVersion and tells watchers."""
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        bucket = self.objects.setdefault(rt.key, {})
        k = nkey(obj)
        uid = obj["metadata"].get("uid")
        if typ == "DELETED":
            bucket.pop(k, None)
            self.uids.pop(uid, None)
        else:
            bucket[k] = obj
            self.uids[uid] = (rt.key, k)
        self.history.append(Ev(self.rv, rt.key, typ, obj, old))
        self.history_rvs.append(self.rv)
        if len(self.history) > self.history_size:
            drop = len(self.history) - self.history_size
            self.compacted = self.history_rvs[drop - 1]
            del self.history[:drop]
            del self.history_rvs[:drop]
        if rt.key == ("apiextensions.k8s.io", "customresourcedefinitions"):
            self._crd_changed(typ, obj, old)
        if typ == "DELETED" or meta_of(obj).get("deletionTimestamp") or \
                meta_of(obj).get("ownerReferences"):
            self.gc_wake.set()
        self.cond.notify_all()
        return obj

    def _crd_changed(self, typ, crd, old):
        spec = crd.get("spec") or {}
        key = (spec.get("group"), (spec.get("names") or {}).get("plural"))
        if typ == "DELETED":
            self.types.pop(key, None)
            self.objects.pop(key, None)
        else:
            self.types[key] = type_from_crd(crd)

    def _finish_if_done(self, rt, obj):
        """Removes an object whose deletion nothing holds up any more."""
        m = obj["metadata"]
        if not m.get("deletionTimestamp") or m.get("finalizers"):
            return obj
        if rt.key == ("", "pods") and (m.get("deletionGracePeriodSeconds") or 0) > 0:
            return obj
        if rt.key == ("", "namespaces") and (obj.get("spec") or {}).get("finalizers"):
            return obj
        gone = copy.deepcopy(obj)
        return self._commit(rt, "DELETED", gone, obj)

    # -- reads ------------------------------------------------------------

    def snapshot(self, key, at):
        """The objects of one type as they were at resourceVersion `at`,
        rebuilt by undoing the retained history."""
        if at < self.compacted:
            raise ApiError(410, "Expired", "The resourceVersion for the provided list is too old.")
        objs = dict(self.objects.get(key, {}))
        i = len(self.history) - 1
        while i >= 0 and self.history[i].rv > at:
            ev = self.history[i]
            if ev.key == key:
                if ev.type == "ADDED":
                    objs.pop(nkey(ev.obj), None)
                else:
                    objs[nkey(ev.old)] = ev.old
            i -= 1
        return objs

    def list(self, rt, ns, sel, fterms, limit=0, cont=None, rv=None, rv_match=None):
        if cont:
            at, start = decode_continue(cont)
            if at < self.compacted:
                raise ApiError(410, "Expired", "The provided continue parameter is too old to "
                               "display a consistent list result. You can start a new list "
                               "without the continue parameter.")
            objs = self.snapshot(rt.key, at)
        else:
            start = None
            at = self.rv
            if rv not in (None, "", "0"):
                try:
                    want = int(rv)
                except ValueError:
                    raise err_bad_request('invalid resource version "%s"' % rv)
                if want > self.rv:
                    raise ApiError(504, "Timeout", "Too large resource version: %d, current: %d"
                                   % (want, self.rv), {"causes": [{"reason":
                                                                   "ResourceVersionTooLarge",
                                                                   "message": "Too large resource "
                                                                   "version"}],
                                                       "retryAfterSeconds": 1})
                if rv_match == "Exact":
                    at = want
            objs = self.snapshot(rt.key, at) if at != self.rv else self.objects.get(rt.key, {})
        items = []
        for k in sorted(objs):
            o = objs[k]
            if rt.namespaced and ns and k[0] != ns:
                continue
            if start is not None and k <= start:
                continue
            if sel and not sel.matches(meta_of(o).get("labels")):
                continue
            if fterms and not fields_match(fterms, o):
                continue
            items.append(o)
        token, remaining = None, None
        if limit and len(items) > limit:
            remaining = len(items) - limit
            items = items[:limit]
            token = encode_continue(at, nkey(items[-1]))
        return items, at, token, remaining

    # -- writes -----------------------------------------------------------

    def _check_body(self, rt, version, obj):
        if not isinstance(obj, dict):
            raise err_bad_request("the body of the request was in an unknown format")
        api = obj.get("apiVersion")
        if api and api != rt.gv(version):
            raise err_bad_request("the API version in the data (%s) does not match the expected "
                                  "API version (%s)" % (api, rt.gv(version)))
        if obj.get("kind") and obj["kind"] != rt.kind:
            raise err_bad_request("the kind in the data (%s) does not match the expected kind "
                                  "(%s)" % (obj["kind"], rt.kind))
        if not isinstance(obj.setdefault("metadata", {}), dict):
            raise err_bad_request("metadata must be an object")
        obj["apiVersion"] = rt.gv()
        obj["kind"] = rt.kind

    def _ensure_namespace(self, rt, ns, dry=False):
        """A dry run checks the namespace as a write would, and makes none."""
        if not rt.namespaced:
            return
        nsrt = self.types[("", "namespaces")]
        cur = self.get(nsrt, "", ns)
        if cur is None:
            if self.strict_namespaces:
                raise err_not_found(nsrt, ns)
            if dry:
                return
            # Lenient by design (see docs/sandbox.md): a namespace is made on first use.
            self.create(nsrt, "v1", "", {"metadata": {"name": ns}})
        elif meta_of(cur).get("deletionTimestamp"):
            raise ApiError(403, "Forbidden", 'unable to create new content in namespace %s because '
                           'it is being terminated' % ns, {"name": ns, "kind": "namespaces"})

    def _custom(self, rt, version, obj, old, warnings, fv):
        """Prune, default, validate and run CEL for a custom resource."""
        schema = rt.schema(version)
        if not schema:
            return obj, []
        unknown = []
        obj = prune(obj, schema, "", unknown, root=True)
        apply_defaults(obj, schema)
        self._field_validation(unknown, warnings, fv, rt, version)
        errs = []
        ratchet = old is not None
        validate_schema(obj, schema, "", errs, old, ratchet)
        if not any(e.blocking for e in errs):
            validate_rules(obj, old, schema, "", errs, ratchet)
        return obj, errs

    @staticmethod
    def _field_validation(unknown, warnings, fv, rt=None, version=None):
        if not unknown:
            return
        if fv == "Strict":
            # The real decoder's words: the object "cannot be handled as" its kind.
            prefix = ""
            if rt is not None:
                prefix = '%s in version "%s" cannot be handled as a %s: ' % (rt.kind, version,
                                                                            rt.kind)
            raise err_bad_request(prefix + "strict decoding error: " +
                                  ", ".join('unknown field "%s"' % u for u in unknown))
        if fv != "Ignore":
            warnings.extend('unknown field "%s"' % u for u in unknown)

    def create(self, rt, version, ns, body, dry=False, fv=None, warnings=None):
        warnings = [] if warnings is None else warnings
        obj = copy.deepcopy(body)
        self._check_body(rt, version, obj)
        meta = obj["metadata"]
        if meta.get("resourceVersion"):
            raise err_bad_request("resourceVersion should not be set on objects to be created")
        for f in SERVER_META:
            meta.pop(f, None)
        if rt.namespaced:
            if meta.get("namespace") and meta["namespace"] != ns:
                raise err_bad_request("the namespace of the provided object does not match the "
                                      "namespace sent on the request")
            meta["namespace"] = ns
        else:
            meta.pop("namespace", None)
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise err_invalid(rt, "", [FieldError("Required", "metadata.name",
                                                      detail="name or generateName is required")])
            for _ in range(10):
                cand = meta["generateName"] + "".join(random.choice("bcdfghjklmnpqrstvwxz2456789")
                                                      for _ in range(5))
                if self.get(rt, ns, cand) is None:
                    meta["name"] = cand
                    break
        name = meta["name"]
        if self.get(rt, ns, name) is not None:
            raise ApiError(409, "AlreadyExists", '%s "%s" already exists' % (rt.qualified, name),
                           {"name": name, "group": rt.group, "kind": rt.plural})
        errs = []
        if rt.crd is not None:
            if rt.has_status(version):
                obj.pop("status", None)
            obj, errs = self._custom(rt, version, obj, None, warnings, fv)
            meta = obj["metadata"]
        elif rt.key == ("", "pods"):
            pod_defaults(obj)
            obj["status"] = {"phase": "Pending", "qosClass": pod_qos(obj["spec"])}
            errs = validate_pod(obj, None)
        elif rt.key == ("", "secrets"):
            secret_defaults(obj)
            errs = validate_secret(obj, None)
        elif rt.key == ("", "namespaces"):
            obj["spec"] = {"finalizers": ["kubernetes"]}
            obj["status"] = {"phase": "Active"}
        elif rt.key == ("", "services"):
            spec = obj.setdefault("spec", {})
            spec.setdefault("type", "ClusterIP")
            if not spec.get("clusterIP"):
                # Loopback, apart from the pods' 127.x.y.z, so that the
                # process kubelet's service proxy can listen on it: .1 of
                # the block is the kubernetes Service's (tests/kube/
                # controllers), the others .10 to .254 in turn, into the
                # next block after 245. A dry run shows the address it
                # would get and keeps it free.
                if (ns, meta.get("name")) == ("default", "kubernetes"):
                    spec["clusterIP"] = "127.96.%d.1" % self.service_block
                else:
                    n = self.next_cluster_ip
                    spec["clusterIP"] = "127.96.%d.%d" % ((self.service_block + n // 245) % 256,
                                                          10 + n % 245)
                    if not dry:
                        self.next_cluster_ip += 1
            spec["clusterIPs"] = [spec["clusterIP"]]
            obj["status"] = {"loadBalancer": {}}
        elif rt.key == ("apiextensions.k8s.io", "customresourcedefinitions"):
            crd_defaults(obj)
            errs = validate_crd(obj)
            if not errs:
                meta.setdefault("finalizers", [])
                if CRD_CLEANUP not in meta["finalizers"]:
                    meta["finalizers"].append(CRD_CLEANUP)
                crd_status(obj, None)
        elif rt.has_status() and rt.key != ("", "nodes"):
            obj.pop("status", None)
        if rt.crd is None:
            errs = errs + defaults_and_errors(rt, obj, None)
        validate_meta(rt, obj, errs)
        if errs:
            raise err_invalid(rt, name, errs)
        if rt.namespaced:
            self._ensure_namespace(rt, ns, dry)
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = rfc3339()
        if rt.generation:
            meta["generation"] = 1
        if dry:
            return obj
        return self._commit(rt, "ADDED", obj, None)

    def update(self, rt, version, ns, name, body, sub=None, dry=False, fv=None, warnings=None):
        warnings = [] if warnings is None else warnings
        old = self.must_get(rt, ns, name)
        obj = copy.deepcopy(body)
        self._check_body(rt, version, obj)
        meta = obj["metadata"]
        if meta.get("name") and meta["name"] != name:
            raise err_bad_request("the name of the object (%s) does not match the name on the URL "
                                  "(%s)" % (meta["name"], name))
        if rt.namespaced and meta.get("namespace") and meta["namespace"] != ns:
            raise err_bad_request("the namespace of the provided object does not match the "
                                  "namespace sent on the request")
        om = old["metadata"]
        rv = meta.get("resourceVersion")
        if rv:
            if rv != om["resourceVersion"]:
                raise err_conflict(rt, name)
        elif not rt.unconditional_update:
            raise err_invalid(rt, name, [FieldError("Invalid", "metadata.resourceVersion",
                                                    shown="0x0", detail="must be specified for "
                                                    "an update")])
        if meta.get("uid") and meta["uid"] != om["uid"]:
            raise err_conflict(rt, name, "Precondition failed: UID in precondition: %s, UID in "
                               "object meta: %s" % (om["uid"], meta["uid"]))
        if sub == "status":
            status = obj.get("status")
            obj = copy.deepcopy(old)
            if status is None:
                obj.pop("status", None)
            else:
                obj["status"] = status
            meta = obj["metadata"]
        else:
            for f in ("uid", "creationTimestamp", "deletionTimestamp",
                      "deletionGracePeriodSeconds", "selfLink", "namespace"):
                if f in om:
                    meta[f] = om[f]
                else:
                    meta.pop(f, None)
            meta["name"] = name
            if rt.has_status(version):
                if "status" in old:
                    obj["status"] = copy.deepcopy(old["status"])
                else:
                    obj.pop("status", None)
        if rt.generation:
            meta["generation"] = om.get("generation", 1)
        else:
            meta.pop("generation", None)
        errs = []
        if rt.crd is not None:
            obj, errs = self._custom(rt, version, obj, old, warnings, fv)
            meta = obj["metadata"]
        elif rt.key == ("", "pods"):
            if sub != "status":
                pod_defaults(obj)
                errs = validate_pod(obj, old)
        elif rt.key == ("", "secrets"):
            secret_defaults(obj)
            errs = validate_secret(obj, old)
        elif rt.key == ("", "namespaces"):
            obj["spec"] = copy.deepcopy(old.get("spec") or {})
        elif rt.key == ("", "services"):
            spec = obj.setdefault("spec", {})
            spec["clusterIP"] = (old.get("spec") or {}).get("clusterIP")
            spec["clusterIPs"] = [spec["clusterIP"]]
        elif rt.key == ("apiextensions.k8s.io", "customresourcedefinitions") and sub != "status":
            crd_defaults(obj)
            errs = validate_crd(obj)
            if not errs:
                crd_status(obj, old)
        if rt.crd is None and sub != "status":
            errs = errs + defaults_and_errors(rt, obj, old)
        if om.get("deletionTimestamp"):
            added = [f for f in meta.get("finalizers") or []
                     if f not in (om.get("finalizers") or [])]
            if added:
                errs.append(FieldError("Forbidden", "metadata.finalizers", detail="no new "
                                       "finalizers can be added if the object is being deleted, "
                                       "found new finalizers %s" % dumps(added)))
        validate_meta(rt, obj, errs)
        if errs:
            raise err_invalid(rt, name, errs)
        ignored = ("metadata", "status") if rt.has_status(version) or rt.crd is None else \
            ("metadata",)
        if rt.generation and without(obj, *ignored, "apiVersion") != \
                without(old, *ignored, "apiVersion"):
            meta["generation"] = om.get("generation", 1) + 1
        meta["resourceVersion"] = om["resourceVersion"]
        if without(obj, "apiVersion") == without(old, "apiVersion"):
            return old                  # nothing changed: no write, no event
        if dry:
            return obj
        self._commit(rt, "MODIFIED", obj, old)
        return self._finish_if_done(rt, obj)

    def patch(self, rt, version, ns, name, ptype, data, sub=None, dry=False, fv=None,
              warnings=None):
        old = self.must_get(rt, ns, name)
        cur = self.out(rt, version, old)
        if sub == "scale":
            cur = self.get_scale(rt, version, ns, name)
        try:
            if ptype == "json":
                doc = json_patch(cur, data)
            elif ptype == "merge":
                doc = merge_patch(cur, data)
            elif ptype == "strategic":
                if rt.crd is not None:
                    raise ApiError(415, "UnsupportedMediaType", "the body of the request was in an "
                                   "unknown format - accepted media types include: "
                                   "application/json-patch+json, application/merge-patch+json, "
                                   "application/apply-patch+yaml")
                doc = strategic_merge_patch(cur, data)
            else:
                raise ApiError(415, "UnsupportedMediaType", "server-side apply is not supported "
                               "by the cohort API server stand-in; use kubectl apply without "
                               "--server-side")
        except PatchError as e:
            raise ApiError(422, "", str(e))
        if sub == "scale":
            return self.update_scale(rt, version, ns, name, doc, dry)
        return self.update(rt, version, ns, name, doc, sub, dry, fv, warnings)

    def delete(self, rt, ns, name, opts, dry=False):
        """Returns (object, gone): gone is False while finalizers or a pod's
        grace period hold the object."""
        old = self.must_get(rt, ns, name)
        om = old["metadata"]
        pre = opts.get("preconditions") or {}
        if pre.get("uid") and pre["uid"] != om["uid"]:
            raise err_conflict(rt, name, "Precondition failed: UID in precondition: %s, UID in "
                               "object meta: %s" % (pre["uid"], om["uid"]))
        if pre.get("resourceVersion") and pre["resourceVersion"] != om["resourceVersion"]:
            raise err_conflict(rt, name, "Precondition failed: ResourceVersion in precondition: "
                               "%s, ResourceVersion in object meta: %s" %
                               (pre["resourceVersion"], om["resourceVersion"]))
        if rt.key == ("", "namespaces") and name in PROTECTED_NAMESPACES:
            raise ApiError(403, "Forbidden", 'namespaces "%s" is forbidden: this namespace may not '
                           'be deleted' % name, {"name": name, "kind": "namespaces"})
        policy = opts.get("propagationPolicy")
        if policy is None:
            policy = "Orphan" if opts.get("orphanDependents") is True else "Background"
        if policy not in ("Background", "Foreground", "Orphan"):
            raise err_invalid(rt, name, [FieldError("NotSupported", "propagationPolicy", policy,
                                                    'supported values: "Foreground", '
                                                    '"Background", "Orphan", "nil"')])
        if dry:
            return old, False
        return self._delete(rt, old, policy, opts.get("gracePeriodSeconds"))

    def _delete(self, rt, old, policy="Background", grace=None):
        om = old["metadata"]
        is_pod = rt.key == ("", "pods")
        if is_pod:
            spec, status = old.get("spec") or {}, old.get("status") or {}
            if grace is None:
                grace = spec.get("terminationGracePeriodSeconds", 30)
            grace = max(0, int(grace))
            if not spec.get("nodeName") or status.get("phase") in ("Succeeded", "Failed"):
                grace = 0
        else:
            grace = 0
        if om.get("deletionTimestamp"):
            if is_pod and grace < (om.get("deletionGracePeriodSeconds") or 0):
                new = copy.deepcopy(old)
                new["metadata"]["deletionGracePeriodSeconds"] = grace
                new["metadata"]["deletionTimestamp"] = rfc3339(
                    utcnow() + datetime.timedelta(seconds=grace))
                self._commit(rt, "MODIFIED", new, old)
                done = self._finish_if_done(rt, new)
                return done, done is not new
            return old, False
        finalizers = list(om.get("finalizers") or [])
        if policy == "Foreground" and "foregroundDeletion" not in finalizers:
            finalizers.append("foregroundDeletion")
        if policy == "Orphan" and "orphan" not in finalizers:
            finalizers.append("orphan")
        held = finalizers or grace > 0 or \
            (rt.key == ("", "namespaces") and (old.get("spec") or {}).get("finalizers"))
        if not held:
            gone = copy.deepcopy(old)
            return self._commit(rt, "DELETED", gone, old), True
        new = copy.deepcopy(old)
        m = new["metadata"]
        m["deletionTimestamp"] = rfc3339(utcnow() + datetime.timedelta(seconds=grace))
        m["deletionGracePeriodSeconds"] = grace
        if rt.generation:
            m["generation"] = om.get("generation", 1) + 1
        if finalizers:
            m["finalizers"] = finalizers
        if rt.key == ("", "namespaces"):
            new.setdefault("status", {})["phase"] = "Terminating"
        if rt.key == ("apiextensions.k8s.io", "customresourcedefinitions"):
            conds = new.setdefault("status", {}).setdefault("conditions", [])
            conds.append({"type": "Terminating", "status": "True",
                          "reason": "InstanceDeletionPending",
                          "message": "CustomResourceDefinition marked for deletion; instances "
                          "are being deleted", "lastTransitionTime": rfc3339()})
        self._commit(rt, "MODIFIED", new, old)
        return new, False

    # -- scale and binding ------------------------------------------------

    def get_scale(self, rt, version, ns, name):
        obj = self.must_get(rt, ns, name)
        paths = rt.scale_paths(version)
        if not paths:
            raise err_not_found(rt, name)
        spec = jsonpath(obj, paths["specReplicasPath"])
        if not spec:
            raise ApiError(500, "InternalError", "the spec replicas field %r does not exist" %
                           paths["specReplicasPath"])
        status = jsonpath(obj, paths.get("statusReplicasPath") or "")
        sel = ""
        lp = paths.get("labelSelectorPath")
        if lp == "spec.selector":                       # a Deployment: object form
            sel = selector_string((obj.get("spec") or {}).get("selector") or {})
        elif lp:
            got = jsonpath(obj, lp)
            sel = got[0] if got and isinstance(got[0], str) else ""
        m = obj["metadata"]
        return {"kind": "Scale", "apiVersion": "autoscaling/v1",
                "metadata": {k: m[k] for k in ("name", "namespace", "uid", "resourceVersion",
                                               "creationTimestamp") if k in m},
                "spec": {"replicas": spec[0]},
                "status": {"replicas": status[0] if status and is_int(status[0]) else 0,
                           **({"selector": sel} if sel else {})}}

    def update_scale(self, rt, version, ns, name, scale, dry=False):
        obj = self.must_get(rt, ns, name)
        paths = rt.scale_paths(version)
        if not paths:
            raise err_not_found(rt, name)
        if not isinstance(scale, dict):
            raise err_bad_request("the body of the request was in an unknown format")
        rv = meta_of(scale).get("resourceVersion")
        if rv and rv != obj["metadata"]["resourceVersion"]:
            raise err_conflict(rt, name)
        replicas = (scale.get("spec") or {}).get("replicas")
        if not is_int(replicas) or replicas < 0:
            raise ApiError(422, "Invalid", 'Scale.autoscaling "%s" is invalid: spec.replicas: '
                           'Invalid value: %s: must be greater than or equal to 0' %
                           (name, go_value(replicas)),
                           {"name": name, "group": "autoscaling", "kind": "Scale",
                            "causes": [{"reason": "FieldValueInvalid", "field": "spec.replicas",
                                        "message": "must be greater than or equal to 0"}]})
        new = self.out(rt, version, copy.deepcopy(obj))
        set_path(new, paths["specReplicasPath"], replicas)
        self.update(rt, version, ns, name, new, None, dry)
        if dry:
            out = self.get_scale(rt, version, ns, name)
            out["spec"]["replicas"] = replicas
            return out
        return self.get_scale(rt, version, ns, name)

    def bind(self, ns, name, binding):
        rt = self.types[("", "pods")]
        pod = self.must_get(rt, ns, name)
        node = ((binding or {}).get("target") or {}).get("name")
        if not node:
            raise err_invalid(rt, name, [FieldError("Required", "target.name")])
        if (pod.get("spec") or {}).get("nodeName"):
            raise ApiError(409, "Conflict", 'Operation cannot be fulfilled on pods/binding "%s": '
                           'pod %s is already assigned to node "%s"' %
                           (name, name, pod["spec"]["nodeName"]),
                           {"name": name, "kind": "pods/binding"})
        if pod["metadata"].get("deletionTimestamp"):
            raise ApiError(409, "Conflict", 'Operation cannot be fulfilled on pods/binding "%s": '
                           'pod %s is being deleted, cannot be assigned to a host' % (name, name))
        new = copy.deepcopy(pod)
        new["spec"]["nodeName"] = node
        conds = [c for c in (new.setdefault("status", {}).get("conditions") or [])
                 if c.get("type") != "PodScheduled"]
        conds.append({"type": "PodScheduled", "status": "True", "lastProbeTime": None,
                      "lastTransitionTime": rfc3339()})
        new["status"]["conditions"] = conds
        self._commit(rt, "MODIFIED", new, pod)

    # -- garbage collection -----------------------------------------------

    def _gc_loop(self):
        while True:
            self.gc_wake.wait(1.0)
            self.gc_wake.clear()
            with self.lock:
                for _ in range(1000):
                    if not self._gc_pass():
                        break

    def _owner_state(self, dep_ns, ref):
        rt, owner = self.by_uid(ref.get("uid"))
        if owner is None or (rt.namespaced and meta_of(owner).get("namespace") != dep_ns):
            return "dangling", None
        fins = meta_of(owner).get("finalizers") or []
        if meta_of(owner).get("deletionTimestamp"):
            if "orphan" in fins:
                return "orphaning", owner
            if "foregroundDeletion" in fins:
                return "waiting", owner
        return "solid", owner

    def _gc_pass(self):
        """One sweep; returns True when it changed something (the caller
        sweeps again, as chains of owners resolve one link per sweep)."""
        referenced = collections.defaultdict(list)     # owner uid -> refs pointing at it
        for key in list(self.objects):
            rt = self.types.get(key)
            if rt is None:
                continue
            for obj in list(self.objects.get(key, {}).values()):
                refs = meta_of(obj).get("ownerReferences") or []
                if not refs:
                    continue
                ns = meta_of(obj).get("namespace") or ""
                states = [(ref, self._owner_state(ns, ref)[0]) for ref in refs]
                keep = [r for r, s in states if s not in ("orphaning",)]
                solid = [r for r, s in states if s == "solid"]
                if len(keep) != len(refs) or (solid and len(solid) != len(keep)):
                    new = copy.deepcopy(obj)
                    new["metadata"]["ownerReferences"] = solid if solid else keep
                    if not new["metadata"]["ownerReferences"]:
                        del new["metadata"]["ownerReferences"]
                    self._commit(rt, "MODIFIED", new, obj)
                    return True
                if not solid and keep and not meta_of(obj).get("deletionTimestamp"):
                    waiting = any(s == "waiting" for _, s in states)
                    self._delete(rt, obj, "Foreground" if waiting else "Background")
                    return True
                for r in refs:
                    referenced[r.get("uid")].append(r)
        for key in list(self.objects):
            rt = self.types.get(key)
            if rt is None:
                continue
            for obj in list(self.objects.get(key, {}).values()):
                m = meta_of(obj)
                if not m.get("deletionTimestamp"):
                    continue
                fins = m.get("finalizers") or []
                drop = None
                if "orphan" in fins and not referenced.get(m["uid"]):
                    drop = "orphan"
                elif "foregroundDeletion" in fins and not any(
                        r.get("blockOwnerDeletion") for r in referenced.get(m["uid"], [])):
                    drop = "foregroundDeletion"
                elif CRD_CLEANUP in fins and rt.crd is None and \
                        key == ("apiextensions.k8s.io", "customresourcedefinitions"):
                    spec = obj.get("spec") or {}
                    crkey = (spec.get("group"), (spec.get("names") or {}).get("plural"))
                    crt = self.types.get(crkey)
                    live = list(self.objects.get(crkey, {}).values())
                    pending = [o for o in live if not meta_of(o).get("deletionTimestamp")]
                    if pending and crt is not None:
                        self._delete(crt, pending[0])
                        return True
                    if not live:
                        drop = CRD_CLEANUP
                elif key == ("", "namespaces") and (obj.get("spec") or {}).get("finalizers"):
                    ns = m["name"]
                    left = False
                    for k2, bucket in list(self.objects.items()):
                        rt2 = self.types.get(k2)
                        if rt2 is None or not rt2.namespaced:
                            continue
                        for (ons, _), o in list(bucket.items()):
                            if ons != ns:
                                continue
                            left = True
                            if not meta_of(o).get("deletionTimestamp"):
                                self._delete(rt2, o)
                                return True
                    if not left:
                        new = copy.deepcopy(obj)
                        new["spec"]["finalizers"] = []
                        self._commit(rt, "MODIFIED", new, obj)
                        self._finish_if_done(rt, new)
                        return True
                if drop:
                    new = copy.deepcopy(obj)
                    new["metadata"]["finalizers"] = [f for f in fins if f != drop]
                    if not new["metadata"]["finalizers"]:
                        del new["metadata"]["finalizers"]
                    self._commit(rt, "MODIFIED", new, obj)
                    self._finish_if_done(rt, new)
                    return True
        return False

    # -- watch ------------------------------------------------------------

    def events_after(self, pos):
        """(events after pos, new position, expired?) — under the lock."""
        if pos < self.compacted:
            return [], pos, True
        i = bisect.bisect_right(self.history_rvs, pos)
        return self.history[i:], self.rv, False

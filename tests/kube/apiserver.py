#!/usr/bin/python3
"""A Kubernetes API server stand-in for cohort's tests and sandbox.

There is no Kubernetes on the project's machines, so the operator, the
kubelet stand-in (kubelet.py) and the real kubectl 1.32 talk to this
server instead. It aims at the semantics a controller depends on, not at
scale: one process, objects in memory, one lock.

What it implements, and how faithfully:

- Storage: one global resourceVersion counter (a growing integer, served as
  a string) like etcd's revision; per object uid, creationTimestamp,
  generation (bumped only when something outside metadata and status
  changes), deletionTimestamp and finalizers. Writes that change nothing are
  not written, so they neither bump resourceVersion nor make watch events.
- Reads: get, list with label and field selectors, limit/continue pages that
  are one consistent snapshot (rebuilt from the event history), and
  resourceVersion / resourceVersionMatch on lists.
- Watch: ?watch=true from a resourceVersion, newline-delimited JSON events
  over chunked HTTP, ADDED/MODIFIED/DELETED as a selector sees them
  (an object that stops matching is DELETED for that watcher), BOOKMARK
  events every --bookmark-interval when asked for, timeoutSeconds, the
  streaming-list form (sendInitialEvents), and an in-stream ERROR event with
  a 410 Status when the resourceVersion is older than the retained history
  (--history-size events, global like etcd's compaction).
- Writes: POST (with generateName), PUT with a resourceVersion precondition
  (409 Conflict when stale), PATCH as JSON merge patch (RFC 7386), JSON patch
  (RFC 6902) and, for built-in kinds, a strategic merge patch with the merge
  keys kubectl needs; DELETE with preconditions, propagationPolicy
  (Background, Foreground, Orphan), pod grace periods, and deletecollection.
- Subresources: status (the main endpoint ignores status, /status changes
  only status), scale (autoscaling/v1 Scale mapped through the CRD's paths),
  pods/binding (the kubelet stand-in schedules through it), pods/log (proxied
  to the kubelet stand-in, like the real server does).
- Garbage collection: background cascading deletion by ownerReference uid,
  foreground and orphan propagation, namespace termination, CRD cleanup.
- CustomResourceDefinitions: creating one serves its resources; schemas are
  enforced (pruning, defaults, types, required, bounds, enum, pattern,
  formats, list types) and x-kubernetes-validations run through a small CEL
  evaluator (see the CEL section for exactly which subset).
- kubectl support: legacy and aggregated (apidiscovery.k8s.io/v2) discovery,
  /version, OpenAPI v3 documents that advertise fieldValidation (so kubectl
  leaves validation to this server), Table output from the CRD's
  additionalPrinterColumns and for pods, and fieldValidation=Strict/Warn.
- Auth: any bearer token is accepted and recorded, unless --token or
  --token-file names the one token to require (401 otherwise; the file is
  re-read when it changes, so tests can rotate it).

Everything it leaves out is listed in docs/sandbox.md. Only the Python 3
standard library is used, so it runs on a bare Debian machine.

    apiserver.py [--port 0] [--port-file F] [--kubeconfig F] [--token T]
"""
import argparse
import base64
import bisect
import collections
import copy
import datetime
import hashlib
import json
import os
import random
import re
import select
import socket
import sys
import threading
import time
import urllib.parse
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

VERSION_INFO = {
    "major": "1", "minor": "32", "gitVersion": "v1.32.0-cohort-standin",
    "gitCommit": "0000000000000000000000000000000000000000", "gitTreeState": "clean",
    "buildDate": "2025-01-01T00:00:00Z", "goVersion": "python" + sys.version.split()[0],
    "compiler": "cpython", "platform": "linux/amd64",
}

ALL_VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]
SUB_VERBS = ["get", "patch", "update"]


# ---------------------------------------------------------------------------
# Time and small helpers
# ---------------------------------------------------------------------------


def utcnow():
    return datetime.datetime.now(datetime.timezone.utc)


def rfc3339(t=None):
    """metav1.Time: second precision, as the real server stores it."""
    return (t or utcnow()).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(s):
    """Parses RFC 3339 (with or without fractions); None when it is not one."""
    if not isinstance(s, str):
        return None
    m = re.match(r"^(\d{4})-(\d\d)-(\d\d)[Tt](\d\d):(\d\d):(\d\d)(\.\d+)?([Zz]|[+-]\d\d:\d\d)$", s)
    if not m:
        return None
    try:
        frac = float(m.group(7)) if m.group(7) else 0.0
        tz = datetime.timezone.utc
        if m.group(8) not in ("Z", "z"):
            sign = 1 if m.group(8)[0] == "+" else -1
            tz = datetime.timezone(sign * datetime.timedelta(hours=int(m.group(8)[1:3]),
                                                             minutes=int(m.group(8)[4:6])))
        t = datetime.datetime(int(m.group(1)), int(m.group(2)), int(m.group(3)), int(m.group(4)),
                              int(m.group(5)), int(m.group(6)), tzinfo=tz)
        return t + datetime.timedelta(seconds=frac)
    except ValueError:
        return None


def human_duration(seconds):
    """Go's k8s.io/apimachinery/pkg/util/duration.HumanDuration, which is
    what the real server puts in date columns of a Table."""
    s = int(seconds)
    if s < -1:
        return "<invalid>"
    if s < 0:
        return "0s"
    if s < 120:
        return "%ds" % s
    minutes = s // 60
    if minutes < 10:
        return "%dm" % minutes if s % 60 == 0 else "%dm%ds" % (minutes, s % 60)
    if minutes < 180:
        return "%dm" % minutes
    hours = s // 3600
    if hours < 8:
        return "%dh" % hours if minutes % 60 == 0 else "%dh%dm" % (hours, minutes % 60)
    if hours < 48:
        return "%dh" % hours
    if hours < 24 * 8:
        return "%dd" % (hours // 24) if hours % 24 == 0 else "%dd%dh" % (hours // 24, hours % 24)
    if hours < 24 * 365 * 2:
        return "%dd" % (hours // 24)
    if hours < 24 * 365 * 8:
        dy = (hours // 24) % 365
        return "%dy" % (hours // 24 // 365) if dy == 0 else "%dy%dd" % (hours // 24 // 365, dy)
    return "%dy" % (hours // 24 // 365)


def dumps(obj):
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def go_value(v):
    """How a field error shows a bad value: strings quoted, numbers bare."""
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, (int, float)):
        return str(v)
    return json.dumps("object" if isinstance(v, dict) else "array")


DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


# ---------------------------------------------------------------------------
# Errors: every failure leaves as a metav1.Status
# ---------------------------------------------------------------------------


class ApiError(Exception):
    """A failure answered as a metav1.Status with this HTTP code."""

    def __init__(self, code, reason, message, details=None):
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details

    def status(self):
        st = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
              "message": self.message, "reason": self.reason, "code": self.code}
        if self.details:
            st["details"] = self.details
        return st


def err_not_found(rt, name):
    return ApiError(404, "NotFound", '%s "%s" not found' % (rt.qualified, name),
                    {"name": name, "group": rt.group, "kind": rt.plural})


def err_conflict(rt, name, why=None):
    msg = ('Operation cannot be fulfilled on %s "%s": %s' %
           (rt.qualified, name, why or "the object has been modified; please apply your "
            "changes to the latest version and try again"))
    return ApiError(409, "Conflict", msg, {"name": name, "group": rt.group, "kind": rt.plural})


def err_bad_request(msg):
    return ApiError(400, "BadRequest", msg)


class FieldError:
    """One entry of field.ErrorList, formatted the way apimachinery does."""

    def __init__(self, kind, field, bad=None, detail="", shown=None):
        # Invalid, Required, NotSupported, Forbidden, TooLong, TooMany, Duplicate, NotFound
        self.kind = kind
        self.field = field
        self.bad = bad
        self.detail = detail
        self.shown = shown        # preformatted bad value, e.g. '"object"' for CEL errors
        self.blocking = False     # a type error: CEL rules are not run after one

    def body(self):
        bad = self.shown if self.shown is not None else go_value(self.bad)
        if self.kind == "Required":
            return "Required value" + (": " + self.detail if self.detail else "")
        if self.kind == "Forbidden":
            return "Forbidden" + (": " + self.detail if self.detail else "")
        if self.kind == "NotSupported":
            return "Unsupported value: %s: %s" % (bad, self.detail)
        if self.kind == "TooLong":
            return "Too long: " + self.detail
        if self.kind == "TooMany":
            return "Too many: %s: %s" % (bad, self.detail)
        if self.kind == "Duplicate":
            return "Duplicate value: %s" % bad
        if self.kind == "NotFound":
            return "Not found: %s" % bad
        return "Invalid value: %s: %s" % (bad, self.detail)

    def reason(self):
        return {"Required": "FieldValueRequired", "Forbidden": "FieldValueForbidden",
                "NotSupported": "FieldValueNotSupported", "TooLong": "FieldValueTooLong",
                "TooMany": "FieldValueTooMany", "Duplicate": "FieldValueDuplicate",
                "NotFound": "FieldValueNotFound", "Type": "FieldValueTypeInvalid"}.get(
                    self.kind, "FieldValueInvalid")

    def __str__(self):
        return "%s: %s" % (self.field, self.body()) if self.field else self.body()


def err_invalid(rt, name, errs):
    """422 Invalid, as errors.NewInvalid builds it."""
    text = str(errs[0]) if len(errs) == 1 else "[" + ", ".join(str(e) for e in errs) + "]"
    qual = rt.kind + ("." + rt.group if rt.group else "")
    causes = [{"reason": e.reason(), "message": e.body(), "field": e.field} for e in errs]
    return ApiError(422, "Invalid", '%s "%s" is invalid: %s' % (qual, name, text),
                    {"name": name, "group": rt.group, "kind": rt.kind, "causes": causes})


# ---------------------------------------------------------------------------
# Label and field selectors
# ---------------------------------------------------------------------------


class Selector:
    """A parsed label selector: a list of (key, op, values) requirements.
    Ops: =, !=, in, notin, exists, !exists (== is read as =)."""

    def __init__(self, reqs):
        self.reqs = reqs

    @staticmethod
    def parse(text):
        reqs = []
        s = text or ""
        i, n = 0, len(s)

        def skip():
            nonlocal i
            while i < n and s[i] == " ":
                i += 1

        def word():
            nonlocal i
            skip()
            j = i
            while i < n and (s[i].isalnum() or s[i] in "-_./"):
                i += 1
            return s[j:i]

        while True:
            skip()
            if i >= n:
                break
            neg = False
            if s[i] == "!":
                neg = True
                i += 1
            key = word()
            if not key:
                raise err_bad_request("unable to parse requirement: found '%s', expected: "
                                      "identifier" % s[i:i + 1])
            skip()
            if neg:
                reqs.append((key, "!exists", []))
            elif i >= n or s[i] == ",":
                reqs.append((key, "exists", []))
            elif s.startswith("==", i) or s.startswith("!=", i):
                op = "=" if s[i] == "=" else "!="
                i += 2
                reqs.append((key, op, [word()]))
            elif s[i] == "=":
                i += 1
                reqs.append((key, "=", [word()]))
            else:
                op = word()
                if op not in ("in", "notin"):
                    raise err_bad_request("unable to parse requirement: found '%s', expected: "
                                          "in, notin, =, ==, !=, gt, lt" % op)
                skip()
                if i >= n or s[i] != "(":
                    raise err_bad_request("unable to parse requirement: expected: '('")
                i += 1
                vals = []
                while True:
                    vals.append(word())
                    skip()
                    if i < n and s[i] == ",":
                        i += 1
                        continue
                    if i < n and s[i] == ")":
                        i += 1
                        break
                    raise err_bad_request("unable to parse requirement: expected: ')'")
                reqs.append((key, op, [v for v in vals if v != ""] or [""]))
            skip()
            if i < n:
                if s[i] != ",":
                    raise err_bad_request("unable to parse requirement: found '%s', expected: ','"
                                          % s[i])
                i += 1
        for key, op, vals in reqs:
            if len(key) > 317 or not LABEL_NAME.match(key.split("/")[-1]):
                raise err_bad_request("invalid label key %r" % key)
        return Selector(reqs)

    def matches(self, labels):
        labels = labels or {}
        for key, op, vals in self.reqs:
            has = key in labels
            v = labels.get(key)
            if op == "=" and not (has and v == vals[0]):
                return False
            if op == "!=" and has and v == vals[0]:
                return False
            if op == "in" and not (has and v in vals):
                return False
            if op == "notin" and has and v in vals:
                return False
            if op == "exists" and not has:
                return False
            if op == "!exists" and has:
                return False
        return True

    def empty(self):
        return not self.reqs


def selector_string(ls):
    """metav1.LabelSelector (object form) to its string form."""
    parts = ["%s=%s" % (k, v) for k, v in sorted((ls.get("matchLabels") or {}).items())]
    for e in ls.get("matchExpressions") or []:
        op = e.get("operator")
        if op == "In":
            parts.append("%s in (%s)" % (e["key"], ",".join(sorted(e.get("values") or []))))
        elif op == "NotIn":
            parts.append("%s notin (%s)" % (e["key"], ",".join(sorted(e.get("values") or []))))
        elif op == "Exists":
            parts.append(e["key"])
        elif op == "DoesNotExist":
            parts.append("!" + e["key"])
    return ",".join(parts)


def parse_field_selector(text, rt):
    """key=value, key==value, key!=value terms. Keys a kind does not index
    are refused with 400, as the real server does."""
    terms = []
    for part in (text or "").split(","):
        part = part.strip()
        if not part:
            continue
        m = re.match(r"^([A-Za-z0-9_.\-]+)\s*(==|!=|=)\s*(.*)$", part)
        if not m:
            raise err_bad_request("invalid selector: '%s'; can't understand '%s'" % (text, part))
        key, op, val = m.group(1), m.group(2), m.group(3)
        if key not in rt.field_labels:
            raise err_bad_request('field label not supported: %s' % key)
        terms.append((key, op != "!=", val))
    return terms


def field_value(obj, path):
    cur = obj
    for p in path.split("."):
        if not isinstance(cur, dict):
            return ""
        cur = cur.get(p)
    if cur is None:
        return ""
    if isinstance(cur, bool):
        return "true" if cur else "false"
    return str(cur)


def fields_match(terms, obj):
    for key, eq, val in terms:
        if (field_value(obj, key) == val) != eq:
            return False
    return True


# ---------------------------------------------------------------------------
# Patches: RFC 7386 merge patch, RFC 6902 JSON patch, strategic merge patch
# ---------------------------------------------------------------------------


class PatchError(Exception):
    pass


def merge_patch(target, patch):
    """RFC 7386."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            result.pop(k, None)
        else:
            result[k] = merge_patch(result.get(k), v)
    return result


def _pointer(path):
    if path == "":
        return []
    if not path.startswith("/"):
        raise PatchError("invalid JSON pointer %r" % path)
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _walk(doc, parts):
    cur = doc
    for p in parts:
        if isinstance(cur, dict):
            if p not in cur:
                raise PatchError("doc is missing path: /%s" % "/".join(parts))
            cur = cur[p]
        elif isinstance(cur, list):
            if not p.isdigit() or int(p) >= len(cur):
                raise PatchError("doc is missing path: /%s" % "/".join(parts))
            cur = cur[int(p)]
        else:
            raise PatchError("doc is missing path: /%s" % "/".join(parts))
    return cur


def _index(container, key, adding):
    if key == "-" and adding:
        return len(container)
    if not key.isdigit() or (key != "0" and key.startswith("0")):
        raise PatchError("invalid array index %r" % key)
    i = int(key)
    if i > len(container) or (not adding and i == len(container)):
        raise PatchError("array index %d out of bounds" % i)
    return i


def json_patch(doc, ops):
    """RFC 6902: add, remove, replace, move, copy, test."""
    if not isinstance(ops, list):
        raise PatchError("a JSON patch must be an array of operations")
    doc = copy.deepcopy(doc)
    for op in ops:
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise PatchError("invalid JSON patch operation %s" % dumps(op))
        kind = op["op"]
        parts = _pointer(op["path"])

        def put(value, parts=parts):
            nonlocal doc
            if not parts:
                doc = value
                return
            parent = _walk(doc, parts[:-1])
            if isinstance(parent, dict):
                parent[parts[-1]] = value
            elif isinstance(parent, list):
                parent.insert(_index(parent, parts[-1], True), value)
            else:
                raise PatchError("cannot add to a scalar at %s" % op["path"])

        def take(parts):
            parent = _walk(doc, parts[:-1])
            if isinstance(parent, dict):
                if parts[-1] not in parent:
                    raise PatchError("unable to remove nonexistent key: %s: missing value" %
                                     parts[-1])
                return parent.pop(parts[-1])
            if isinstance(parent, list):
                return parent.pop(_index(parent, parts[-1], False))
            raise PatchError("cannot remove from a scalar")

        if kind == "add":
            put(copy.deepcopy(op.get("value")))
        elif kind == "remove":
            take(parts)
        elif kind == "replace":
            if parts:
                _walk(doc, parts)       # must exist
                take(parts)
            put(copy.deepcopy(op.get("value")))
        elif kind in ("move", "copy"):
            src = _pointer(op.get("from", ""))
            value = copy.deepcopy(_walk(doc, src))
            if kind == "move":
                take(src)
            put(value)
        elif kind == "test":
            if _walk(doc, parts) != op.get("value"):
                raise PatchError("testing value %s failed" % op["path"])
        else:
            raise PatchError("unexpected kind of operation %r" % kind)
    return doc


# Merge keys from the Go struct tags of the built-in types kubectl patches.
# Lists not named here are replaced whole, as lists without a patch strategy are.
SMP_KEYS = {"containers": "name", "initContainers": "name", "ephemeralContainers": "name",
            "env": "name", "volumes": "name", "volumeMounts": "mountPath",
            "volumeDevices": "devicePath", "imagePullSecrets": "name", "conditions": "type",
            "ownerReferences": "uid", "hostAliases": "ip", "resourceClaims": "name",
            "topologySpreadConstraints": "topologyKey"}
SMP_SETS = {"finalizers"}


def strategic_merge_patch(target, patch, parent=""):
    """The part of strategic merge patch that kubectl apply produces for
    built-in kinds: merge-keyed lists, $patch replace/delete, $retainKeys,
    $deleteFromPrimitiveList and $setElementOrder (order is not enforced)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    directive = patch.get("$patch")
    if directive == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    if directive == "delete":
        return None
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    if "$retainKeys" in patch:
        keep = set(patch["$retainKeys"] or [])
        result = {k: v for k, v in result.items() if k in keep}
    for k, v in patch.items():
        if k in ("$patch", "$retainKeys") or k.startswith("$setElementOrder/"):
            continue
        if k.startswith("$deleteFromPrimitiveList/"):
            field = k.split("/", 1)[1]
            if isinstance(result.get(field), list):
                result[field] = [x for x in result[field] if x not in (v or [])]
            continue
        if v is None:
            result.pop(k, None)
            continue
        key = SMP_KEYS.get(k)
        if k == "ports":
            key = "containerPort" if parent in ("containers", "initContainers") else "port"
        cur = result.get(k)
        if isinstance(v, list) and key and isinstance(cur, list):
            merged = copy.deepcopy(cur)
            for item in v:
                if not isinstance(item, dict):
                    merged.append(copy.deepcopy(item))
                    continue
                at = next((i for i, x in enumerate(merged)
                           if isinstance(x, dict) and x.get(key) == item.get(key)), None)
                if item.get("$patch") == "delete":
                    if at is not None:
                        merged.pop(at)
                elif at is None:
                    merged.append({a: b for a, b in item.items() if a != "$patch"})
                else:
                    merged[at] = strategic_merge_patch(merged[at], item, k)
            result[k] = merged
        elif isinstance(v, list) and k in SMP_SETS and isinstance(cur, list):
            result[k] = cur + [x for x in v if x not in cur]
        elif isinstance(v, list):
            result[k] = [strategic_merge_patch(None, x, k) if isinstance(x, dict) else x
                         for x in v if not (isinstance(x, dict) and x.get("$patch") == "delete")]
        elif isinstance(v, dict):
            sub = strategic_merge_patch(cur, v, k)
            if sub is None:
                result.pop(k, None)
            else:
                result[k] = sub
        else:
            result[k] = v
    return result


# ---------------------------------------------------------------------------
# Protobuf request bodies. kubectl's generator commands (create namespace,
# configmap, secret, serviceaccount) send typed objects as protobuf, with no
# fallback to JSON. These few kinds are decoded from their field numbers in
# k8s.io/api's generated.proto; any other protobuf body gets 415.
# ---------------------------------------------------------------------------

PB_OWNER_REF = {1: ("kind", "string"), 3: ("name", "string"), 4: ("uid", "string"),
                5: ("apiVersion", "string"), 6: ("controller", "bool"),
                7: ("blockOwnerDeletion", "bool")}
PB_META = {1: ("name", "string"), 2: ("generateName", "string"), 3: ("namespace", "string"),
           5: ("uid", "string"), 6: ("resourceVersion", "string"), 7: ("generation", "int"),
           11: ("labels", "map"), 12: ("annotations", "map"),
           13: ("ownerReferences", "msgs", PB_OWNER_REF), 14: ("finalizers", "strings")}
PB_KINDS = {
    "Namespace": {1: ("metadata", "msg", PB_META),
                  2: ("spec", "msg", {1: ("finalizers", "strings")}),
                  3: ("status", "msg", {1: ("phase", "string")})},
    "ConfigMap": {1: ("metadata", "msg", PB_META), 2: ("data", "map"),
                  3: ("binaryData", "bytesmap"), 4: ("immutable", "bool")},
    "Secret": {1: ("metadata", "msg", PB_META), 2: ("data", "bytesmap"), 3: ("type", "string"),
               4: ("stringData", "map"), 5: ("immutable", "bool")},
    "ServiceAccount": {1: ("metadata", "msg", PB_META),
                       4: ("automountServiceAccountToken", "bool")},
}


def _pb_fields(buf):
    """Yields (field number, wire type, value) of one protobuf message."""
    i, n = 0, len(buf)

    def varint():
        nonlocal i
        shift = result = 0
        while True:
            if i >= n:
                raise ValueError("truncated varint")
            b = buf[i]
            i += 1
            result |= (b & 0x7F) << shift
            if not b & 0x80:
                return result
            shift += 7
    while i < n:
        tag = varint()
        num, wt = tag >> 3, tag & 7
        if wt == 0:
            yield num, wt, varint()
        elif wt == 1:
            i += 8
            yield num, wt, None
        elif wt == 2:
            ln = varint()
            if i + ln > n:
                raise ValueError("truncated field")
            yield num, wt, bytes(buf[i:i + ln])
            i += ln
        elif wt == 5:
            i += 4
            yield num, wt, None
        else:
            raise ValueError("unsupported wire type %d" % wt)


def _pb_decode(buf, desc):
    out = {}
    for num, wt, val in _pb_fields(buf):
        d = desc.get(num)
        if d is None or val is None:
            continue
        name, typ = d[0], d[1]
        if typ == "string":
            out[name] = val.decode()
        elif typ == "int":
            out[name] = val
        elif typ == "bool":
            out[name] = bool(val)
        elif typ == "strings":
            out.setdefault(name, []).append(val.decode())
        elif typ == "msg":
            out[name] = _pb_decode(val, d[2])
        elif typ == "msgs":
            out.setdefault(name, []).append(_pb_decode(val, d[2]))
        elif typ in ("map", "bytesmap"):
            entry = {k: v for k, _, v in _pb_fields(val)}
            key = (entry.get(1) or b"").decode()
            v = entry.get(2) or b""
            out.setdefault(name, {})[key] = v.decode() if typ == "map" else \
                base64.b64encode(v).decode()
    return out


def decode_k8s_protobuf(data):
    """The "k8s\\x00" envelope (runtime.Unknown) around one of PB_KINDS."""
    if data[:4] != b"k8s\x00":
        raise ValueError("missing the k8s protobuf magic")
    unknown = {num: val for num, _, val in _pb_fields(data[4:])}
    tm = {num: val for num, _, val in _pb_fields(unknown.get(1) or b"")}
    api_version = (tm.get(1) or b"").decode()
    kind = (tm.get(2) or b"").decode()
    desc = PB_KINDS.get(kind)
    if desc is None:
        raise KeyError(kind)
    obj = _pb_decode(unknown.get(2) or b"", desc)
    obj["apiVersion"] = api_version
    obj["kind"] = kind
    return obj


# ---------------------------------------------------------------------------
# CEL: a small, honest subset for x-kubernetes-validations
#
# Supported: literals (int, uint as int, double, string, bool, null, lists,
# maps); self and oldSelf; field selection and indexing; has(); the
# operators ! - * / % + - < <= > >= == != in && || ?: with CEL's typing (no
# int+double), int64 overflow and division errors, and the commutative
# error absorption of && and ||; size(), int(), uint(), double(), string(),
# duration(), timestamp(); string methods contains, startsWith, endsWith,
# matches, lowerAscii, upperAscii, trim, split, join, indexOf, substring,
# replace; the macros all, exists, exists_one, map, filter; messageExpression.
# Not supported, and refused when a CRD uses it: optional types (?. and
# optionalOldSelf), the Kubernetes quantity/ip/cidr/url/format libraries,
# sets, type() and comprehension over maps' values, cost estimation.
# Transition rules (those naming oldSelf) run only on updates where the old
# value exists at the same place, as in Kubernetes.
# ---------------------------------------------------------------------------

INT_MIN, INT_MAX = -(1 << 63), (1 << 63) - 1


class CelError(Exception):
    pass


class Duration:
    """google.protobuf.Duration as CEL sees it, kept in nanoseconds."""
    __slots__ = ("ns",)

    def __init__(self, ns):
        self.ns = ns

    def __eq__(self, o):
        return isinstance(o, Duration) and o.ns == self.ns

    def __hash__(self):
        return hash(self.ns)

    def __repr__(self):
        return "duration(%dns)" % self.ns


class Timestamp:
    __slots__ = ("t",)

    def __init__(self, t):
        self.t = t

    def __eq__(self, o):
        return isinstance(o, Timestamp) and o.t == self.t

    def __hash__(self):
        return hash(self.t)


GO_UNITS = {"ns": 1, "us": 1000, "µs": 1000, "ms": 10 ** 6, "s": 10 ** 9, "m": 60 * 10 ** 9,
            "h": 3600 * 10 ** 9}


def parse_go_duration(s):
    """Go's time.ParseDuration, which CEL's duration() uses."""
    if not isinstance(s, str):
        raise CelError("no such overload: duration(%s)" % type(s).__name__)
    orig, sign = s, 1
    if s[:1] in "+-" and s:
        sign = -1 if s[0] == "-" else 1
        s = s[1:]
    if s == "0":
        return Duration(0)
    if not s:
        raise CelError('invalid duration "%s"' % orig)
    total = 0
    while s:
        m = re.match(r"^(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)", s)
        if not m:
            raise CelError('invalid duration "%s"' % orig)
        num, unit = m.group(1), m.group(2)
        whole, _, frac = num.partition(".")
        total += int(whole or "0") * GO_UNITS[unit]
        if frac:
            total += int(frac) * GO_UNITS[unit] // (10 ** len(frac))
        s = s[m.end():]
    if total > INT_MAX:
        raise CelError('invalid duration "%s"' % orig)
    return Duration(sign * total)


_TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<num>0[xX][0-9a-fA-F]+[uU]?|(?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?[uU]?)
  | (?P<str>[rR]?(?:'(?:[^'\\\n]|\\.)*'|"(?:[^"\\\n]|\\.)*"))
  | (?P<id>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<op>&&|\|\||==|!=|<=|>=|[-+*/%!<>?:.,()\[\]{}])
""", re.X)

_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", "'": "'", '"': '"', "a": "\a",
            "b": "\b", "f": "\f", "v": "\v", "`": "`", "?": "?"}


def _unquote(text):
    raw = text[0] in "rR"
    if raw:
        text = text[1:]
    body = text[1:-1]
    if raw:
        return body
    out, i = [], 0
    while i < len(body):
        c = body[i]
        if c != "\\":
            out.append(c)
            i += 1
            continue
        n = body[i + 1]
        if n in _ESCAPES:
            out.append(_ESCAPES[n])
            i += 2
        elif n in "uU":
            width = 4 if n == "u" else 8
            out.append(chr(int(body[i + 2:i + 2 + width], 16)))
            i += 2 + width
        elif n == "x":
            out.append(chr(int(body[i + 2:i + 4], 16)))
            i += 4
        else:
            raise CelError("invalid escape \\%s" % n)
    return "".join(out)


MACROS = ("all", "exists", "exists_one", "map", "filter")
RESERVED = {"as", "break", "const", "continue", "else", "for", "function", "if", "import",
            "let", "loop", "package", "namespace", "return", "var", "void", "while"}


class CelParser:
    """Recursive descent over CEL's grammar; builds tuples as AST nodes."""

    def __init__(self, text):
        self.text = text
        self.toks = []
        pos = 0
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if not m:
                raise CelError("Syntax error: token recognition error at: '%s'" % text[pos])
            pos = m.end()
            kind = m.lastgroup
            if kind != "ws":
                self.toks.append((kind, m.group()))
        self.toks.append(("eof", ""))
        self.i = 0

    def peek(self, value=None):
        k, v = self.toks[self.i]
        if value is None:
            return v if k != "eof" else None
        return v == value and k in ("op", "id")

    def take(self, value=None):
        k, v = self.toks[self.i]
        if value is not None and v != value:
            raise CelError("Syntax error: expected '%s' but found '%s'" % (value, v or "EOF"))
        self.i += 1
        return k, v

    def parse(self):
        e = self.expr()
        if self.toks[self.i][0] != "eof":
            raise CelError("Syntax error: unexpected '%s'" % self.toks[self.i][1])
        return e

    def expr(self):
        c = self.or_()
        if self.peek("?"):
            self.take("?")
            a = self.or_()
            self.take(":")
            b = self.expr()
            return ("cond", c, a, b)
        return c

    def or_(self):
        e = self.and_()
        while self.peek("||"):
            self.take()
            e = ("or", e, self.and_())
        return e

    def and_(self):
        e = self.rel()
        while self.peek("&&"):
            self.take()
            e = ("and", e, self.rel())
        return e

    def rel(self):
        e = self.add()
        while self.peek() in ("<", "<=", ">", ">=", "==", "!=", "in") and \
                self.toks[self.i][0] in ("op", "id"):
            op = self.take()[1]
            e = ("bin", op, e, self.add())
        return e

    def add(self):
        e = self.mul()
        while self.peek() in ("+", "-") and self.toks[self.i][0] == "op":
            op = self.take()[1]
            e = ("bin", op, e, self.mul())
        return e

    def mul(self):
        e = self.unary()
        while self.peek() in ("*", "/", "%") and self.toks[self.i][0] == "op":
            op = self.take()[1]
            e = ("bin", op, e, self.unary())
        return e

    def unary(self):
        if self.peek("!") or self.peek("-"):
            op = self.take()[1]
            if op == "-" and self.toks[self.i][0] == "num":
                return self.member(self.number(negative=True))
            return ("un", op, self.unary())
        return self.member(self.primary())

    def number(self, negative=False):
        text = self.take()[1]
        sign = -1 if negative else 1
        try:
            if text[-1] in "uU":
                return ("lit", int(text[:-1], 0))
            if text.lower().startswith("0x"):
                v = sign * int(text, 16)
            elif any(c in text for c in ".eE"):
                return ("lit", sign * float(text))
            else:
                v = sign * int(text)
        except ValueError:
            raise CelError("invalid number %s" % text)
        if not INT_MIN <= v <= INT_MAX:
            raise CelError("integer literal out of range: %s" % text)
        return ("lit", v)

    def args(self):
        self.take("(")
        out = []
        if not self.peek(")"):
            out.append(self.expr())
            while self.peek(","):
                self.take()
                out.append(self.expr())
        self.take(")")
        return out

    def member(self, e):
        while True:
            if self.peek(".") and self.toks[self.i][0] == "op":
                self.take()
                if self.peek("?"):
                    raise CelError("optional field selection (.?) is not supported by this "
                                   "stand-in")
                k, name = self.take()
                if k != "id":
                    raise CelError("Syntax error: expected a field name after '.'")
                if self.peek("(") and self.toks[self.i][0] == "op":
                    if name in MACROS:
                        e = self.macro(name, e)
                    else:
                        e = ("call", name, e, self.args())
                else:
                    e = ("sel", e, name)
            elif self.peek("[") and self.toks[self.i][0] == "op":
                self.take()
                if self.peek("?"):
                    raise CelError("optional indexing ([?]) is not supported by this stand-in")
                idx = self.expr()
                self.take("]")
                e = ("idx", e, idx)
            else:
                return e

    def macro(self, name, target):
        self.take("(")
        k, var = self.take()
        if k != "id":
            raise CelError("Syntax error: %s() needs a variable name first" % name)
        self.take(",")
        body = self.expr()
        extra = None
        if self.peek(","):
            self.take()
            extra = self.expr()
        self.take(")")
        if extra is not None and name != "map":
            raise CelError("Syntax error: %s() takes two arguments" % name)
        return ("macro", name, target, var, body, extra)

    def primary(self):
        k, v = self.toks[self.i]
        if k == "num":
            return self.number()
        if k == "str":
            self.take()
            return ("lit", _unquote(v))
        if k == "id":
            self.take()
            if v in ("true", "false"):
                return ("lit", v == "true")
            if v == "null":
                return ("lit", None)
            if v in RESERVED:
                raise CelError("Syntax error: reserved identifier '%s'" % v)
            if self.peek("(") and self.toks[self.i][0] == "op":
                if v == "has":
                    self.take("(")
                    arg = self.expr()
                    self.take(")")
                    if arg[0] != "sel":
                        raise CelError("invalid argument to has() macro")
                    return ("has", arg)
                return ("call", v, None, self.args())
            return ("id", v)
        if v == "(":
            self.take()
            e = self.expr()
            self.take(")")
            return e
        if v == "[":
            self.take()
            items = []
            while not self.peek("]"):
                items.append(self.expr())
                if not self.peek(","):
                    break
                self.take()
            self.take("]")
            return ("list", items)
        if v == "{":
            self.take()
            pairs = []
            while not self.peek("}"):
                key = self.expr()
                self.take(":")
                pairs.append((key, self.expr()))
                if not self.peek(","):
                    break
                self.take()
            self.take("}")
            return ("map", pairs)
        raise CelError("Syntax error: unexpected '%s'" % (v or "EOF"))


def cel_compile(text):
    return CelParser(text).parse()


def cel_names(ast, out=None):
    """Identifiers an expression reads (to find transition rules)."""
    out = set() if out is None else out
    if isinstance(ast, tuple):
        if ast[0] == "id":
            out.add(ast[1])
        for part in ast[1:]:
            if isinstance(part, (tuple, list)):
                if isinstance(part, list):
                    for p in part:
                        cel_names(p, out)
                else:
                    cel_names(part, out)
    elif isinstance(ast, list):
        for p in ast:
            cel_names(p, out)
    return out


def _is_int(v):
    return type(v) is int


def _is_num(v):
    return type(v) in (int, float)


def _type_name(v):
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "int"
    if isinstance(v, float):
        return "double"
    if isinstance(v, str):
        return "string"
    if v is None:
        return "null_type"
    if isinstance(v, list):
        return "list"
    if isinstance(v, dict):
        return "map"
    if isinstance(v, Duration):
        return "google.protobuf.Duration"
    if isinstance(v, Timestamp):
        return "google.protobuf.Timestamp"
    return type(v).__name__


def _overload(op, *vals):
    return CelError("no such overload: %s(%s)" % (op, ", ".join(_type_name(v) for v in vals)))


def _check_int(v):
    if not INT_MIN <= v <= INT_MAX:
        raise CelError("integer overflow")
    return v


def cel_equal(a, b):
    if _is_num(a) and _is_num(b):
        return a == b
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(cel_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(cel_equal(a[k], b[k]) for k in a)
    return a == b


def _compare(op, a, b):
    if _is_num(a) and _is_num(b):
        x, y = a, b
    elif isinstance(a, str) and isinstance(b, str):
        x, y = a, b
    elif isinstance(a, bool) and isinstance(b, bool):
        x, y = a, b
    elif isinstance(a, Duration) and isinstance(b, Duration):
        x, y = a.ns, b.ns
    elif isinstance(a, Timestamp) and isinstance(b, Timestamp):
        x, y = a.t, b.t
    else:
        raise _overload(op, a, b)
    return {"<": x < y, "<=": x <= y, ">": x > y, ">=": x >= y}[op]


def _arith(op, a, b):
    if _is_int(a) and _is_int(b):
        if op == "+":
            return _check_int(a + b)
        if op == "-":
            return _check_int(a - b)
        if op == "*":
            return _check_int(a * b)
        if b == 0:
            raise CelError("division by zero" if op == "/" else "modulus by zero")
        q = abs(a) // abs(b) * (1 if (a >= 0) == (b >= 0) else -1)    # truncates toward zero
        return _check_int(q) if op == "/" else a - b * q
    if type(a) is float and type(b) is float and op != "%":
        if op == "/":
            if b == 0.0:
                return float("inf") if a > 0 else float("-inf") if a < 0 else float("nan")
            return a / b
        return {"+": a + b, "-": a - b, "*": a * b}[op]
    if op == "+" and isinstance(a, str) and isinstance(b, str):
        return a + b
    if op == "+" and isinstance(a, list) and isinstance(b, list):
        return a + b
    if op in "+-" and isinstance(a, Duration) and isinstance(b, Duration):
        return Duration(_check_int(a.ns + b.ns if op == "+" else a.ns - b.ns))
    if op in "+-" and isinstance(a, Timestamp) and isinstance(b, Duration):
        d = datetime.timedelta(microseconds=b.ns / 1000)
        return Timestamp(a.t + d if op == "+" else a.t - d)
    if op == "-" and isinstance(a, Timestamp) and isinstance(b, Timestamp):
        return Duration(int((a.t - b.t).total_seconds() * 10 ** 9))
    raise _overload({"+": "_+_", "-": "_-_", "*": "_*_", "/": "_/_", "%": "_%_"}[op], a, b)


def _string_of(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, str)):
        return str(v)
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, Duration):
        return "%gs" % (v.ns / 1e9)
    if isinstance(v, Timestamp):
        return v.t.strftime("%Y-%m-%dT%H:%M:%SZ")
    raise _overload("string", v)


def _call(name, target, args):
    vals = ([target] if target is not _NO_TARGET else []) + args
    n = len(vals)
    if name == "size" and n == 1:
        v = vals[0]
        if isinstance(v, (str, list, dict)):
            return len(v)
        raise _overload("size", v)
    if name == "int" and n == 1 and target is _NO_TARGET:
        v = vals[0]
        if _is_int(v):
            return v
        if isinstance(v, float):
            if v != v or not INT_MIN <= v <= INT_MAX:
                raise CelError("double out of int range")
            return int(v)
        if isinstance(v, str):
            try:
                return _check_int(int(v, 10))
            except ValueError:
                raise CelError("cannot convert %r to int" % v)
        if isinstance(v, Duration):
            return v.ns
        if isinstance(v, Timestamp):
            return int(v.t.timestamp())
        raise _overload("int", v)
    if name == "uint" and n == 1 and target is _NO_TARGET:
        v = _call("int", _NO_TARGET, vals)
        if v < 0:
            raise CelError("uint out of range")
        return v
    if name == "double" and n == 1 and target is _NO_TARGET:
        v = vals[0]
        if _is_num(v):
            return float(v)
        if isinstance(v, str):
            try:
                return float(v)
            except ValueError:
                raise CelError("cannot convert %r to double" % v)
        raise _overload("double", v)
    if name == "string" and n == 1 and target is _NO_TARGET:
        return _string_of(vals[0])
    if name == "bool" and n == 1 and target is _NO_TARGET:
        v = vals[0]
        if isinstance(v, bool):
            return v
        if v in ("true", "True", "TRUE", "t", "1"):
            return True
        if v in ("false", "False", "FALSE", "f", "0"):
            return False
        raise _overload("bool", v)
    if name == "duration" and n == 1 and target is _NO_TARGET:
        return parse_go_duration(vals[0])
    if name == "timestamp" and n == 1 and target is _NO_TARGET:
        t = parse_time(vals[0])
        if t is None:
            raise CelError("invalid timestamp %r" % (vals[0],))
        return Timestamp(t)
    if target is not _NO_TARGET and isinstance(target, str):
        s = target
        if name in ("contains", "startsWith", "endsWith", "matches") and len(args) == 1 \
                and isinstance(args[0], str):
            a = args[0]
            if name == "contains":
                return a in s
            if name == "startsWith":
                return s.startswith(a)
            if name == "endsWith":
                return s.endswith(a)
            try:
                return re.search(a, s) is not None
            except re.error as e:
                raise CelError("invalid regular expression %r: %s" % (a, e))
        if name == "lowerAscii" and not args:
            return "".join(c.lower() if c.isascii() else c for c in s)
        if name == "upperAscii" and not args:
            return "".join(c.upper() if c.isascii() else c for c in s)
        if name == "trim" and not args:
            return s.strip()
        if name == "split" and len(args) in (1, 2) and isinstance(args[0], str):
            parts = s.split(args[0]) if args[0] else list(s)
            if len(args) == 2:
                lim = args[1]
                if lim == 0:
                    return []
                if lim > 0 and len(parts) > lim:
                    parts = parts[:lim - 1] + [args[0].join(parts[lim - 1:])]
            return parts
        if name == "indexOf" and len(args) in (1, 2) and isinstance(args[0], str):
            return s.find(args[0], args[1] if len(args) == 2 else 0)
        if name == "substring" and len(args) in (1, 2):
            end = args[1] if len(args) == 2 else len(s)
            if not 0 <= args[0] <= end <= len(s):
                raise CelError("index out of range")
            return s[args[0]:end]
        if name == "replace" and len(args) in (2, 3):
            return s.replace(args[0], args[1], -1 if len(args) == 2 else args[2])
    if name == "matches" and target is _NO_TARGET and n == 2:
        return _call("matches", vals[0], [vals[1]])
    if name == "join" and target is not _NO_TARGET and isinstance(target, list):
        sep = args[0] if args else ""
        if all(isinstance(x, str) for x in target):
            return sep.join(target)
    if name in ("getSeconds", "getMilliseconds") and isinstance(target, Duration) and not args:
        return int(target.ns / 10 ** 9) if name == "getSeconds" else int(target.ns / 10 ** 6)
    raise CelError("undeclared reference to '%s' (in container '')" % name
                   if target is _NO_TARGET else _overload(name, *vals))


_NO_TARGET = object()


def cel_eval(ast, env):
    k = ast[0]
    if k == "lit":
        return ast[1]
    if k == "id":
        if ast[1] not in env:
            raise CelError("undeclared reference to '%s'" % ast[1])
        return env[ast[1]]
    if k == "sel":
        obj = cel_eval(ast[1], env)
        if isinstance(obj, dict):
            if ast[2] not in obj:
                raise CelError("no such key: %s" % ast[2])
            return obj[ast[2]]
        raise CelError("type '%s' does not support field selection" % _type_name(obj))
    if k == "has":
        obj = cel_eval(ast[1][1], env)
        if isinstance(obj, dict):
            return ast[1][2] in obj
        raise CelError("invalid type for field selection")
    if k == "idx":
        obj = cel_eval(ast[1], env)
        i = cel_eval(ast[2], env)
        if isinstance(obj, list):
            if not _is_num(i) or int(i) != i:
                raise _overload("_[_]", obj, i)
            if not 0 <= int(i) < len(obj):
                raise CelError("index out of bounds: %s" % i)
            return obj[int(i)]
        if isinstance(obj, dict):
            if i not in obj:
                raise CelError("no such key: %s" % (i,))
            return obj[i]
        raise _overload("_[_]", obj, i)
    if k == "un":
        v = cel_eval(ast[2], env)
        if ast[1] == "!":
            if type(v) is not bool:
                raise _overload("!_", v)
            return not v
        if _is_int(v):
            return _check_int(-v)
        if isinstance(v, float):
            return -v
        if isinstance(v, Duration):
            return Duration(-v.ns)
        raise _overload("-_", v)
    if k in ("and", "or"):
        stop = k == "or"            # the value that decides: true for ||, false for &&
        vals = []
        for side in (ast[1], ast[2]):
            try:
                v = cel_eval(side, env)
            except CelError as e:
                v = e
            if v is stop:
                return stop
            vals.append(v)
        for v in vals:
            if isinstance(v, CelError):
                raise v
            if type(v) is not bool:
                raise _overload("_&&_" if k == "and" else "_||_", *vals)
        return not stop
    if k == "cond":
        c = cel_eval(ast[1], env)
        if type(c) is not bool:
            raise _overload("_?_:_", c)
        return cel_eval(ast[2] if c else ast[3], env)
    if k == "bin":
        op = ast[1]
        a = cel_eval(ast[2], env)
        b = cel_eval(ast[3], env)
        if op == "==":
            return cel_equal(a, b)
        if op == "!=":
            return not cel_equal(a, b)
        if op in ("<", "<=", ">", ">="):
            return _compare(op, a, b)
        if op == "in":
            if isinstance(b, list):
                return any(cel_equal(a, x) for x in b)
            if isinstance(b, dict):
                return a in b
            raise _overload("@in", a, b)
        return _arith(op, a, b)
    if k == "list":
        return [cel_eval(x, env) for x in ast[1]]
    if k == "map":
        return {cel_eval(a, env): cel_eval(b, env) for a, b in ast[1]}
    if k == "call":
        target = _NO_TARGET if ast[2] is None else cel_eval(ast[2], env)
        return _call(ast[1], target, [cel_eval(a, env) for a in ast[3]])
    if k == "macro":
        _, name, target, var, body, extra = ast
        coll = cel_eval(target, env)
        if isinstance(coll, dict):
            items = list(coll.keys())
        elif isinstance(coll, list):
            items = coll
        else:
            raise _overload(name, coll)
        sub = dict(env)
        if name in ("all", "exists"):
            want = name == "exists"
            err = None
            for it in items:
                sub[var] = it
                try:
                    v = cel_eval(body, sub)
                except CelError as e:
                    err = err or e
                    continue
                if type(v) is not bool:
                    raise _overload(name, v)
                if v is want:
                    return want
            if err:
                raise err
            return not want
        if name == "exists_one":
            count = 0
            for it in items:
                sub[var] = it
                v = cel_eval(body, sub)
                if type(v) is not bool:
                    raise _overload(name, v)
                count += v
            return count == 1
        if name == "filter":
            out = []
            for it in items:
                sub[var] = it
                v = cel_eval(body, sub)
                if type(v) is not bool:
                    raise _overload(name, v)
                if v:
                    out.append(it)
            return out
        out = []                    # map(x, expr) or map(x, predicate, expr)
        for it in items:
            sub[var] = it
            if extra is None:
                out.append(cel_eval(body, sub))
            else:
                keep = cel_eval(body, sub)
                if type(keep) is not bool:
                    raise _overload(name, keep)
                if keep:
                    out.append(cel_eval(extra, sub))
        return out
    raise CelError("cannot evaluate %s" % k)


def cel_value(value, schema):
    """A JSON value as CEL sees it under its schema: numbers typed by the
    schema (type: number is a double even when written 3)."""
    if value is None or not isinstance(schema, dict):
        return value
    t = schema.get("type")
    if t == "number" and _is_num(value):
        return float(value)
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        addl = schema.get("additionalProperties")
        return {k: cel_value(v, props.get(k) or (addl if isinstance(addl, dict) else None))
                for k, v in value.items()}
    if isinstance(value, list):
        return [cel_value(v, schema.get("items")) for v in value]
    return value


# ---------------------------------------------------------------------------
# Structural schemas: pruning, defaulting, validation, CEL rules
# ---------------------------------------------------------------------------

OBJECT_META_FIELDS = {"name", "generateName", "namespace", "selfLink", "uid", "resourceVersion",
                      "generation", "creationTimestamp", "deletionTimestamp",
                      "deletionGracePeriodSeconds", "labels", "annotations", "ownerReferences",
                      "finalizers", "managedFields"}


def _join(path, key):
    return key if not path else path + "." + key


def prune(value, schema, path, unknown, root=False):
    """Drops what the schema does not declare (recording each path in
    unknown, for fieldValidation) and nulls in fields that are not nullable,
    as the real server does before defaulting."""
    if not isinstance(schema, dict):
        return value
    if isinstance(value, dict):
        embedded = root or schema.get("x-kubernetes-embedded-resource")
        props = schema.get("properties") or {}
        addl = schema.get("additionalProperties")
        preserve = schema.get("x-kubernetes-preserve-unknown-fields")
        out = {}
        for k, v in value.items():
            p = _join(path, k)
            if embedded and k in ("apiVersion", "kind"):
                out[k] = v
                continue
            if embedded and k == "metadata" and isinstance(v, dict):
                meta = {}
                for mk, mv in v.items():
                    if mk in OBJECT_META_FIELDS:
                        meta[mk] = mv
                    else:
                        unknown.append(_join(p, mk))
                out[k] = meta
                continue
            sub = props.get(k)
            if sub is None and isinstance(addl, dict):
                sub = addl
            if sub is None:
                if preserve or addl is True:
                    out[k] = v
                else:
                    unknown.append(p)
                continue
            if v is None and not sub.get("nullable"):
                continue
            out[k] = prune(v, sub, p, unknown)
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [prune(x, schema["items"], "%s[%d]" % (path, i), unknown)
                for i, x in enumerate(value)]
    return value


def apply_defaults(value, schema):
    """Fills absent fields from `default`, then defaults inside them, so
    that `default: {}` on an object brings its children's defaults."""
    if not isinstance(schema, dict):
        return value
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        addl = schema.get("additionalProperties")
        for k, sub in props.items():
            if k not in value and isinstance(sub, dict) and "default" in sub:
                value[k] = copy.deepcopy(sub["default"])
        for k in list(value):
            sub = props.get(k) or (addl if isinstance(addl, dict) else None)
            if sub:
                value[k] = apply_defaults(value[k], sub)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i in range(len(value)):
            value[i] = apply_defaults(value[i], schema["items"])
    return value


def _json_type(v):
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    if isinstance(v, dict):
        return "object"
    return "null"


def _type_ok(t, v):
    return {"object": isinstance(v, dict), "array": isinstance(v, list),
            "string": isinstance(v, str), "boolean": isinstance(v, bool),
            "integer": _is_int(v),
            "number": _is_num(v)}.get(t, True)


FORMATS = {
    "date-time": lambda s: parse_time(s) is not None,
    "date": lambda s: re.match(r"^\d{4}-\d\d-\d\d$", s) is not None,
    "byte": lambda s: re.match(r"^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$",
                               s) is not None,
    "uuid": lambda s: re.match(r"^[0-9a-fA-F]{8}-([0-9a-fA-F]{4}-){3}[0-9a-fA-F]{12}$",
                               s) is not None,
}


def _type_error(path, want, got):
    e = FieldError("Invalid", path, shown=json.dumps(got),
                   detail='%s in body must be of type %s: "%s"' % (path, want, got))
    e.blocking = True
    return e


def validate_schema(value, schema, path, errs, old=None, ratchet=False):
    """OpenAPI v3 value validation as the CRD handler does it. With
    ratchet, a subtree equal to the old object's is not re-validated
    (CRD validation ratcheting, on by default since Kubernetes 1.30)."""
    if not isinstance(schema, dict):
        return
    if ratchet and old is not None and value == old:
        return
    if value is None:
        if not schema.get("nullable") and schema.get("type"):
            errs.append(_type_error(path, schema["type"], "null"))
        return
    t = schema.get("type")
    if schema.get("x-kubernetes-int-or-string"):
        if not (_is_int(value) or isinstance(value, str)):
            errs.append(_type_error(path, "int-or-string", _json_type(value)))
            return
    elif t and not _type_ok(t, value):
        errs.append(_type_error(path, t, _json_type(value)))
        return
    if "enum" in schema and not any(cel_equal(value, e) for e in schema["enum"]):
        errs.append(FieldError("NotSupported", path, value, "supported values: " +
                               ", ".join(go_value(e) for e in schema["enum"])))
    if _is_num(value):
        if "minimum" in schema:
            if schema.get("exclusiveMinimum") and value <= schema["minimum"]:
                errs.append(FieldError("Invalid", path, value, "%s in body should be greater "
                                       "than %s" % (path, schema["minimum"])))
            elif value < schema["minimum"]:
                errs.append(FieldError("Invalid", path, value, "%s in body should be greater than "
                                       "or equal to %s" % (path, schema["minimum"])))
        if "maximum" in schema:
            if schema.get("exclusiveMaximum") and value >= schema["maximum"]:
                errs.append(FieldError("Invalid", path, value, "%s in body should be less than %s"
                                       % (path, schema["maximum"])))
            elif value > schema["maximum"]:
                errs.append(FieldError("Invalid", path, value, "%s in body should be less than or "
                                       "equal to %s" % (path, schema["maximum"])))
        if schema.get("multipleOf") and value % schema["multipleOf"] != 0:
            errs.append(FieldError("Invalid", path, value, "%s in body should be a multiple of %s"
                                   % (path, schema["multipleOf"])))
    if isinstance(value, str):
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            errs.append(FieldError("TooLong", path, value, "may not be longer than %d" %
                                   schema["maxLength"]))
        if "minLength" in schema and len(value) < schema["minLength"]:
            errs.append(FieldError("Invalid", path, value, "%s in body should be at least %d chars "
                                   "long" % (path, schema["minLength"])))
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errs.append(FieldError("Invalid", path, value, "%s in body should match '%s'" %
                                   (path, schema["pattern"])))
        fmt = FORMATS.get(schema.get("format"))
        if fmt and not fmt(value):
            errs.append(FieldError("Invalid", path, value, "%s in body must be of type %s: %s" %
                                   (path, schema["format"], json.dumps(value))))
    if isinstance(value, list):
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            errs.append(FieldError("TooMany", path, shown=str(len(value)),
                                   detail="must have at most %d items" % schema["maxItems"]))
        if "minItems" in schema and len(value) < schema["minItems"]:
            errs.append(FieldError("Invalid", path, shown=str(len(value)),
                                   detail="%s in body should have at least %d items" %
                                   (path, schema["minItems"])))
        lt = schema.get("x-kubernetes-list-type")
        if lt == "set" or schema.get("uniqueItems"):
            for i, x in enumerate(value):
                if any(cel_equal(x, y) for y in value[:i]):
                    errs.append(FieldError("Duplicate", "%s[%d]" % (path, i), x))
        if lt == "map":
            keys = schema.get("x-kubernetes-list-map-keys") or []
            seen = []
            for i, x in enumerate(value):
                if isinstance(x, dict):
                    k = [x.get(kk) for kk in keys]
                    if k in seen:
                        errs.append(FieldError("Duplicate", "%s[%d]" % (path, i),
                                               shown=dumps({kk: x.get(kk) for kk in keys})))
                    seen.append(k)
        items = schema.get("items")
        if isinstance(items, dict):
            olds = _correlate_list(old, schema) if ratchet else {}
            for i, x in enumerate(value):
                validate_schema(x, items, "%s[%d]" % (path, i), errs,
                                olds.get(_list_key(x, schema, i)), ratchet)
    if isinstance(value, dict):
        for r in schema.get("required") or []:
            if r not in value:
                errs.append(FieldError("Required", _join(path, r)))
        props = schema.get("properties") or {}
        addl = schema.get("additionalProperties")
        if "maxProperties" in schema and len(value) > schema["maxProperties"]:
            errs.append(FieldError("TooMany", path, shown=str(len(value)),
                                   detail="must have at most %d items" % schema["maxProperties"]))
        if "minProperties" in schema and len(value) < schema["minProperties"]:
            errs.append(FieldError("Invalid", path, shown=str(len(value)),
                                   detail="%s in body should have at least %d properties" %
                                   (path, schema["minProperties"])))
        for k, v in value.items():
            sub = props.get(k) or (addl if isinstance(addl, dict) else None)
            if sub is not None:
                validate_schema(v, sub, _join(path, k), errs,
                                old.get(k) if isinstance(old, dict) else None, ratchet)
    for sub in schema.get("allOf") or []:
        validate_schema(value, sub, path, errs)
    if schema.get("anyOf"):
        if not any(not _errs_of(value, s, path) for s in schema["anyOf"]):
            errs.append(FieldError("Invalid", path, value, "%s in body must match at least one "
                                   "schema in anyOf" % path))
    if schema.get("oneOf"):
        n = sum(1 for s in schema["oneOf"] if not _errs_of(value, s, path))
        if n != 1:
            errs.append(FieldError("Invalid", path, value, "%s in body must match exactly one "
                                   "schema in oneOf" % path))
    if isinstance(schema.get("not"), dict) and not _errs_of(value, schema["not"], path):
        errs.append(FieldError("Invalid", path, value, "%s in body must not match the schema in "
                               "not" % path))


def _errs_of(value, schema, path):
    e = []
    validate_schema(value, schema, path, e)
    return e


def _list_key(item, schema, i):
    if schema.get("x-kubernetes-list-type") == "map" and isinstance(item, dict):
        return tuple(dumps(item.get(k)) for k in schema.get("x-kubernetes-list-map-keys") or [])
    return None


def _correlate_list(old, schema):
    """Old items of a map-type list by key: the only list items Kubernetes
    correlates for oldSelf and ratcheting."""
    if not isinstance(old, list) or schema.get("x-kubernetes-list-type") != "map":
        return {}
    return {_list_key(x, schema, i): x for i, x in enumerate(old)}


_CEL_CACHE = {}


def cel_rule(text):
    """Compiled rule (cached), or raises CelError."""
    got = _CEL_CACHE.get(text)
    if got is None:
        ast = cel_compile(text)
        got = (ast, "oldSelf" in cel_names(ast))
        _CEL_CACHE[text] = got
    return got


def check_rules(schema, path, errs):
    """At CRD create/update: every rule must compile in the subset, and the
    fields it names must be declared (unknown names are a compile error in
    Kubernetes too). Returns errors as FieldErrors."""
    if not isinstance(schema, dict):
        return
    for i, r in enumerate(schema.get("x-kubernetes-validations") or []):
        p = "%s.x-kubernetes-validations[%d]" % (path, i)
        if not isinstance(r, dict) or not isinstance(r.get("rule"), str):
            errs.append(FieldError("Required", p + ".rule"))
            continue
        if r.get("optionalOldSelf"):
            errs.append(FieldError("Forbidden", p + ".optionalOldSelf",
                                   detail="not supported by the cohort API server stand-in"))
        for key in ("rule", "messageExpression"):
            if isinstance(r.get(key), str):
                try:
                    cel_rule(r[key])
                except CelError as e:
                    errs.append(FieldError("Invalid", p + "." + key, r[key],
                                           "compilation failed: %s" % e))
        if r.get("reason") not in (None, "FieldValueInvalid", "FieldValueForbidden",
                                   "FieldValueRequired", "FieldValueDuplicate"):
            errs.append(FieldError("NotSupported", p + ".reason", r.get("reason"),
                                   'supported values: "FieldValueDuplicate", '
                                   '"FieldValueForbidden", "FieldValueInvalid", '
                                   '"FieldValueRequired"'))
    for k, sub in (schema.get("properties") or {}).items():
        check_rules(sub, path + ".properties[%s]" % k, errs)
    if isinstance(schema.get("items"), dict):
        check_rules(schema["items"], path + ".items", errs)
    if isinstance(schema.get("additionalProperties"), dict):
        check_rules(schema["additionalProperties"], path + ".additionalProperties", errs)


def validate_rules(value, old, schema, path, errs, ratchet=False):
    """Runs x-kubernetes-validations at every schema node that has a value."""
    if not isinstance(schema, dict) or value is None:
        return
    unchanged = old is not None and value == old
    rules = schema.get("x-kubernetes-validations") or []
    if rules:
        self_v = cel_value(value, schema)
        old_v = cel_value(old, schema) if old is not None else None
        shown = json.dumps(schema.get("type") or ("object" if isinstance(value, dict) else
                                                  _json_type(value)))
        for r in rules:
            ast, transition = cel_rule(r["rule"])
            if transition and old is None:
                continue
            if ratchet and unchanged and not transition:
                continue
            env = {"self": self_v}
            if old is not None:
                env["oldSelf"] = old_v
            field = path + (r.get("fieldPath") or "")
            field = field.lstrip(".")
            try:
                ok = cel_eval(ast, env)
                if type(ok) is not bool:
                    raise CelError("rule did not evaluate to a bool")
            except CelError as e:
                errs.append(FieldError("Invalid", field, shown=shown,
                                       detail="%s evaluating rule: %s" % (e, r["rule"])))
                continue
            if ok:
                continue
            msg = r.get("message") or "failed rule: %s" % r["rule"]
            if r.get("messageExpression"):
                try:
                    m = cel_eval(cel_rule(r["messageExpression"])[0], env)
                    if isinstance(m, str) and m.strip() and "\n" not in m:
                        msg = m
                except CelError:
                    pass
            kind = {"FieldValueForbidden": "Forbidden", "FieldValueRequired": "Required",
                    "FieldValueDuplicate": "Duplicate"}.get(r.get("reason"), "Invalid")
            errs.append(FieldError(kind, field, shown=shown, detail=msg))
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        addl = schema.get("additionalProperties")
        for k, v in value.items():
            sub = props.get(k) or (addl if isinstance(addl, dict) else None)
            if sub is not None:
                validate_rules(v, old.get(k) if isinstance(old, dict) else None, sub,
                               _join(path, k), errs, ratchet)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        olds = _correlate_list(old, schema)
        for i, x in enumerate(value):
            validate_rules(x, olds.get(_list_key(x, schema, i)), schema["items"],
                           "%s[%d]" % (path, i), errs, ratchet)


# ---------------------------------------------------------------------------
# JSONPath, as much as additionalPrinterColumns use: .a.b, [n], [-1:], [*],
# [?(@.k=="v")]
# ---------------------------------------------------------------------------


def jsonpath(obj, path):
    """All values a printer-column path selects."""
    cur = [obj]
    for tok in re.findall(r"\.[A-Za-z0-9_\-]+|\[[^\]]*\]|\.\*", path or ""):
        nxt = []
        for c in cur:
            if tok.startswith("."):
                key = tok[1:]
                if key == "*" and isinstance(c, dict):
                    nxt.extend(c.values())
                elif isinstance(c, dict) and key in c:
                    nxt.append(c[key])
                continue
            inner = tok[1:-1].strip()
            if not isinstance(c, list):
                continue
            if inner == "*":
                nxt.extend(c)
            elif inner.startswith("?("):
                m = re.match(r"^\?\(@\.([A-Za-z0-9_.\-]+)\s*==\s*['\"]([^'\"]*)['\"]\)$", inner)
                if m:
                    for x in c:
                        if str(field_value(x, m.group(1))) == m.group(2):
                            nxt.append(x)
            elif ":" in inner:
                a, _, b = inner.partition(":")
                nxt.extend(c[int(a) if a else None:int(b) if b else None])
            elif re.match(r"^-?\d+$", inner):
                i = int(inner)
                if -len(c) <= i < len(c):
                    nxt.append(c[i])
        cur = nxt
    return cur


# ---------------------------------------------------------------------------
# Resource types
# ---------------------------------------------------------------------------

COMMON_FIELD_LABELS = ("metadata.name", "metadata.namespace")


def version_priority(v):
    """Kubernetes version ordering: GA > beta > alpha, then by numbers."""
    m = re.match(r"^v(\d+)(?:(alpha|beta)(\d+))?$", v)
    if not m:
        return (3, 0, 0, v)
    rank = {None: 0, "beta": 1, "alpha": 2}[m.group(2)]
    return (rank, -int(m.group(1)), -int(m.group(3) or 0), v)


class ResourceType:
    """One served resource: a built-in kind or a CRD's kind."""

    def __init__(self, group, versions, kind, plural, singular, namespaced, short_names=(),
                 categories=(), status=False, scale=None, crd=None, field_labels=(),
                 unconditional_update=True, schemas=None, columns=None, storage=None):
        self.group = group
        self.versions = sorted(versions, key=version_priority)   # served, preferred first
        self.storage_version = storage or self.versions[0]
        self.kind = kind
        self.list_kind = kind + "List"
        self.plural = plural
        self.singular = singular
        self.namespaced = namespaced
        self.short_names = list(short_names)
        self.categories = list(categories)
        self.status = status              # bool, or {version: bool} for CRDs
        self.scale = scale                # {specReplicasPath, ...} or per version
        self.crd = crd                    # the CRD object (None for built-ins)
        self.field_labels = set(COMMON_FIELD_LABELS) | set(field_labels)
        self.unconditional_update = unconditional_update
        self.schemas = schemas or {}      # version -> openAPIV3Schema
        self.columns = columns or {}      # version -> additionalPrinterColumns
        self.extra_subresources = []      # ("binding", "Binding", verbs) ...
        # metadata.generation exists only where the kind's strategy sets it
        # (custom resources, CRDs, workloads); ConfigMaps, Pods (before
        # 1.33), Leases and the like have none.
        self.generation = crd is not None

    @property
    def key(self):
        return (self.group, self.plural)

    @property
    def qualified(self):
        return self.plural + ("." + self.group if self.group else "")

    def gv(self, version=None):
        v = version or self.storage_version
        return "%s/%s" % (self.group, v) if self.group else v

    def has_status(self, version=None):
        if isinstance(self.status, dict):
            return self.status.get(version or self.storage_version, False)
        return self.status

    def scale_paths(self, version=None):
        if self.crd is not None:
            return self.scale.get(version or self.storage_version) if self.scale else None
        return self.scale

    def schema(self, version=None):
        return self.schemas.get(version or self.storage_version)


def builtin_types():
    T = ResourceType
    pods = T("", ["v1"], "Pod", "pods", "pod", True, ["po"], ["all"], status=True,
             field_labels=("spec.nodeName", "spec.restartPolicy", "spec.schedulerName",
                           "spec.serviceAccountName", "spec.hostNetwork", "status.phase",
                           "status.podIP", "status.nominatedNodeName"))
    pods.extra_subresources = [("binding", "", "v1", "Binding", ["create"]),
                               ("log", "", "v1", "Pod", ["get"])]
    return [
        T("", ["v1"], "Namespace", "namespaces", "namespace", False, ["ns"], status=True,
          field_labels=("status.phase",)),
        pods,
        T("", ["v1"], "Event", "events", "event", True, ["ev"],
          field_labels=("involvedObject.kind", "involvedObject.namespace", "involvedObject.name",
                        "involvedObject.uid", "involvedObject.apiVersion",
                        "involvedObject.resourceVersion", "involvedObject.fieldPath", "reason",
                        "reportingComponent", "source", "type")),
        T("", ["v1"], "ConfigMap", "configmaps", "configmap", True, ["cm"]),
        T("", ["v1"], "Secret", "secrets", "secret", True, field_labels=("type",)),
        T("", ["v1"], "Service", "services", "service", True, ["svc"], ["all"], status=True),
        T("", ["v1"], "ServiceAccount", "serviceaccounts", "serviceaccount", True, ["sa"]),
        T("", ["v1"], "Endpoints", "endpoints", "endpoints", True, ["ep"]),
        T("", ["v1"], "Node", "nodes", "node", False, ["no"], status=True,
          field_labels=("spec.unschedulable",)),
        T("apps", ["v1"], "Deployment", "deployments", "deployment", True, ["deploy"], ["all"],
          status=True, scale={"specReplicasPath": ".spec.replicas",
                              "statusReplicasPath": ".status.replicas",
                              "labelSelectorPath": "spec.selector"}),
        T("coordination.k8s.io", ["v1"], "Lease", "leases", "lease", True),
        T("apiextensions.k8s.io", ["v1"], "CustomResourceDefinition", "customresourcedefinitions",
          "customresourcedefinition", False, ["crd", "crds"], ["api-extensions"], status=True),
        T("rbac.authorization.k8s.io", ["v1"], "Role", "roles", "role", True),
        T("rbac.authorization.k8s.io", ["v1"], "RoleBinding", "rolebindings", "rolebinding", True),
        T("rbac.authorization.k8s.io", ["v1"], "ClusterRole", "clusterroles", "clusterrole", False),
        T("rbac.authorization.k8s.io", ["v1"], "ClusterRoleBinding", "clusterrolebindings",
          "clusterrolebinding", False),
        T("policy", ["v1"], "PodDisruptionBudget", "poddisruptionbudgets", "poddisruptionbudget",
          True, ["pdb"], status=True),
        T("autoscaling", ["v2"], "HorizontalPodAutoscaler", "horizontalpodautoscalers",
          "horizontalpodautoscaler", True, ["hpa"], ["all"], status=True),
    ]


def type_from_crd(crd):
    spec = crd.get("spec") or {}
    names = spec.get("names") or {}
    served = [v for v in spec.get("versions") or [] if v.get("served")]
    storage = next((v["name"] for v in spec.get("versions") or [] if v.get("storage")), None)
    rt = ResourceType(spec["group"], [v["name"] for v in served] or [storage], names["kind"],
                      names["plural"], names.get("singular") or names["kind"].lower(),
                      spec.get("scope", "Namespaced") == "Namespaced",
                      names.get("shortNames") or [],
                      names.get("categories") or [], crd=crd, unconditional_update=False,
                      storage=storage)
    rt.list_kind = names.get("listKind") or names["kind"] + "List"
    rt.status = {v["name"]: "status" in (v.get("subresources") or {}) for v in served}
    rt.scale = {v["name"]: (v.get("subresources") or {}).get("scale") for v in served}
    rt.schemas = {v["name"]: (v.get("schema") or {}).get("openAPIV3Schema") for v in served}
    rt.columns = {v["name"]: v.get("additionalPrinterColumns") for v in served}
    return rt


# ---------------------------------------------------------------------------
# Built-in strategies: defaults and validation the real server applies
# ---------------------------------------------------------------------------


def pod_qos(spec):
    conts = (spec.get("containers") or []) + (spec.get("initContainers") or [])
    any_set, guaranteed = False, True
    for c in conts:
        res = c.get("resources") or {}
        req, lim = res.get("requests") or {}, res.get("limits") or {}
        if req or lim:
            any_set = True
        for r in ("cpu", "memory"):
            if r not in lim or (r in req and str(req[r]) != str(lim[r])):
                guaranteed = False
    if not any_set:
        return "BestEffort"
    return "Guaranteed" if guaranteed else "Burstable"


def pod_defaults(pod):
    spec = pod.setdefault("spec", {})
    spec.setdefault("restartPolicy", "Always")
    spec.setdefault("terminationGracePeriodSeconds", 30)
    spec.setdefault("dnsPolicy", "ClusterFirst")
    spec.setdefault("schedulerName", "default-scheduler")
    spec.setdefault("securityContext", {})
    spec.setdefault("enableServiceLinks", True)
    for c in (spec.get("containers") or []) + (spec.get("initContainers") or []):
        if isinstance(c, dict):
            img = c.get("image") or ""
            tagged = ":" in img.rsplit("/", 1)[-1] and not img.endswith(":latest")
            c.setdefault("imagePullPolicy", "IfNotPresent" if tagged or "@" in img else "Always")
            c.setdefault("terminationMessagePath", "/dev/termination-log")
            c.setdefault("terminationMessagePolicy", "File")
            c.setdefault("resources", {})
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                if isinstance(c.get(probe), dict):
                    pr = c[probe]
                    for k, v in (("timeoutSeconds", 1), ("periodSeconds", 10),
                                 ("successThreshold", 1), ("failureThreshold", 3)):
                        pr.setdefault(k, v)
                    if isinstance(pr.get("httpGet"), dict):
                        pr["httpGet"].setdefault("path", "/")
                        pr["httpGet"].setdefault("scheme", "HTTP")
            for port in c.get("ports") or []:
                if isinstance(port, dict):
                    port.setdefault("protocol", "TCP")
            for e in c.get("env") or []:
                ref = (e.get("valueFrom") or {}).get("fieldRef") if isinstance(e, dict) else None
                if isinstance(ref, dict):
                    ref.setdefault("apiVersion", "v1")


def secret_defaults(secret):
    """type defaults to Opaque; stringData is write-only, folded into data."""
    secret.setdefault("type", "Opaque")
    sd = secret.pop("stringData", None)
    if isinstance(sd, dict):
        data = secret.setdefault("data", {})
        for k, v in sd.items():
            data[k] = base64.b64encode(str(v).encode()).decode()


def validate_pod(pod, old):
    errs = []
    spec = pod.get("spec") or {}
    conts = spec.get("containers")
    if not conts:
        errs.append(FieldError("Required", "spec.containers"))
    names = set()
    vols = {v.get("name") for v in spec.get("volumes") or [] if isinstance(v, dict)}
    for field in ("initContainers", "containers"):
        for i, c in enumerate(spec.get(field) or []):
            p = "spec.%s[%d]" % (field, i)
            if not isinstance(c, dict):
                errs.append(FieldError("Invalid", p, c, "must be an object"))
                continue
            n = c.get("name")
            if not n:
                errs.append(FieldError("Required", p + ".name"))
            elif not DNS_LABEL.match(n) or len(n) > 63:
                errs.append(FieldError("Invalid", p + ".name", n, "a lowercase RFC 1123 label must "
                                       "consist of lower case alphanumeric characters or '-'"))
            elif n in names:
                errs.append(FieldError("Duplicate", p + ".name", n))
            names.add(n)
            if not c.get("image"):
                errs.append(FieldError("Required", p + ".image"))
            if field == "initContainers" and c.get("restartPolicy") not in (None, "Always"):
                errs.append(FieldError("NotSupported", p + ".restartPolicy", c["restartPolicy"],
                                       'supported values: "Always"'))
            if field == "containers" and c.get("restartPolicy") is not None:
                errs.append(FieldError("Forbidden", p + ".restartPolicy",
                                       detail="may not be set for non-init containers"))
            for j, m in enumerate(c.get("volumeMounts") or []):
                if m.get("name") not in vols:
                    errs.append(FieldError("NotFound", "%s.volumeMounts[%d].name" % (p, j),
                                           m.get("name")))
            for j, e in enumerate(c.get("env") or []):
                if not e.get("name"):
                    errs.append(FieldError("Required", "%s.env[%d].name" % (p, j)))
    if spec.get("restartPolicy") not in ("Always", "OnFailure", "Never"):
        errs.append(FieldError("NotSupported", "spec.restartPolicy", spec.get("restartPolicy"),
                               'supported values: "Always", "OnFailure", "Never"'))
    if old is not None:
        def masked(s):
            s = copy.deepcopy(s or {})
            for f in ("containers", "initContainers"):
                for c in s.get(f) or []:
                    if isinstance(c, dict):
                        c.pop("image", None)
            s.pop("activeDeadlineSeconds", None)
            s.pop("tolerations", None)
            return s
        if masked(spec) != masked(old.get("spec")):
            errs.append(FieldError("Forbidden", "spec", detail="pod updates may not change fields "
                                   "other than `spec.containers[*].image`,`spec.initContainers[*]"
                                   ".image`,`spec.activeDeadlineSeconds`,`spec.tolerations` (only "
                                   "additions to existing tolerations)"))
    return errs


def validate_meta(rt, obj, errs):
    meta = obj.get("metadata") or {}
    name = meta.get("name") or ""
    label = rt.key in (("", "namespaces"), ("", "services"))
    if name and (len(name) > (63 if label else 253) or
                 not (DNS_LABEL if label else DNS_SUBDOMAIN).match(name)):
        errs.append(FieldError("Invalid", "metadata.name", name,
                               "a lowercase RFC 1123 %s must consist of lower case alphanumeric "
                               "characters, '-' or '.', and must start and end with an "
                               "alphanumeric character" % ("label" if label else "subdomain")))
    for k, v in (meta.get("labels") or {}).items():
        if not isinstance(v, str) or len(v) > 63 or not LABEL_VALUE.match(v):
            errs.append(FieldError("Invalid", "metadata.labels", v, "a valid label must be an "
                                   "empty string or consist of alphanumeric characters, '-', '_' "
                                   "or '.', and must start and end with an alphanumeric "
                                   "character"))
        prefix, _, nm = k.rpartition("/")
        if not nm or len(nm) > 63 or not LABEL_NAME.match(nm) or \
                (prefix and not DNS_SUBDOMAIN.match(prefix)):
            errs.append(FieldError("Invalid", "metadata.labels", k, "name part must consist of "
                                   "alphanumeric characters, '-', '_' or '.'"))
    for k, v in (meta.get("annotations") or {}).items():
        if not isinstance(v, str):
            errs.append(FieldError("Invalid", "metadata.annotations", v, "must be a string"))
    total = sum(len(k) + len(v) for k, v in (meta.get("annotations") or {}).items()
                if isinstance(v, str))
    if total > 256 * 1024:
        errs.append(FieldError("TooLong", "metadata.annotations", detail="may not be longer than "
                               "262144"))
    for i, ref in enumerate(meta.get("ownerReferences") or []):
        for f in ("apiVersion", "kind", "name", "uid"):
            if not ref.get(f):
                errs.append(FieldError("Required", "metadata.ownerReferences[%d].%s" % (i, f)))
    if sum(1 for r in meta.get("ownerReferences") or [] if r.get("controller")) > 1:
        errs.append(FieldError("Invalid", "metadata.ownerReferences", shown='"array"',
                               detail="Only one reference can have Controller set to true"))
    for i, f in enumerate(meta.get("finalizers") or []):
        if not isinstance(f, str) or not f:
            errs.append(FieldError("Invalid", "metadata.finalizers[%d]" % i, f, "must be a "
                                   "qualified name"))


def validate_crd(crd):
    errs = []
    spec = crd.get("spec") or {}
    names = spec.get("names") or {}
    group = spec.get("group") or ""
    if not group:
        errs.append(FieldError("Required", "spec.group"))
    elif "." not in group:
        errs.append(FieldError("Invalid", "spec.group", group, "should be a domain with at least "
                               "one dot"))
    for f in ("plural", "kind"):
        if not names.get(f):
            errs.append(FieldError("Required", "spec.names." + f))
    if names.get("plural") and names["plural"] != names["plural"].lower():
        errs.append(FieldError("Invalid", "spec.names.plural", names["plural"],
                               "a lowercase RFC 1123 label"))
    want = "%s.%s" % (names.get("plural"), group)
    if (crd.get("metadata") or {}).get("name") != want:
        errs.append(FieldError("Invalid", "metadata.name", (crd.get("metadata") or {}).get("name"),
                               'must be spec.names.plural+"."+spec.group'))
    if spec.get("scope") not in ("Namespaced", "Cluster"):
        errs.append(FieldError("NotSupported", "spec.scope", spec.get("scope"),
                               'supported values: "Cluster", "Namespaced"'))
    versions = spec.get("versions") or []
    if not versions:
        errs.append(FieldError("Required", "spec.versions", detail="must have exactly one version "
                               "marked as storage version"))
    if sum(1 for v in versions if v.get("storage")) != 1:
        errs.append(FieldError("Invalid", "spec.versions", shown='"array"', detail="must have "
                               "exactly one version marked as storage version"))
    for i, v in enumerate(versions):
        p = "spec.versions[%d]" % i
        if not v.get("name"):
            errs.append(FieldError("Required", p + ".name"))
        schema = (v.get("schema") or {}).get("openAPIV3Schema")
        if not isinstance(schema, dict):
            errs.append(FieldError("Required", p + ".schema.openAPIV3Schema", detail="schemas are "
                                   "required"))
            continue
        if schema.get("type") != "object":
            errs.append(FieldError("Invalid", p + ".schema.openAPIV3Schema.type",
                                   schema.get("type"), 'must be object at the root'))
        check_rules(schema, p + ".schema.openAPIV3Schema", errs)
        scale = (v.get("subresources") or {}).get("scale")
        if scale:
            if not str(scale.get("specReplicasPath", "")).startswith(".spec."):
                errs.append(FieldError("Invalid", p + ".subresources.scale.specReplicasPath",
                                       scale.get("specReplicasPath"), "should be a json path "
                                       "under .spec"))
            if not str(scale.get("statusReplicasPath", "")).startswith(".status."):
                errs.append(FieldError("Invalid", p + ".subresources.scale.statusReplicasPath",
                                       scale.get("statusReplicasPath"), "should be a json path "
                                       "under .status"))
    if (spec.get("conversion") or {}).get("strategy", "None") != "None":
        errs.append(FieldError("NotSupported", "spec.conversion.strategy",
                               spec["conversion"]["strategy"], 'the cohort stand-in supports '
                               '"None" only'))
    return errs


def crd_defaults(crd):
    spec = crd.setdefault("spec", {})
    names = spec.setdefault("names", {})
    if names.get("kind"):
        names.setdefault("singular", names["kind"].lower())
        names.setdefault("listKind", names["kind"] + "List")
    spec.setdefault("scope", "Namespaced")
    spec.setdefault("conversion", {"strategy": "None"})


def crd_status(crd, old):
    spec = crd["spec"]
    now = rfc3339()
    old_status = (old or {}).get("status") or {}
    stored = list(old_status.get("storedVersions") or [])
    for v in spec.get("versions") or []:
        if v.get("storage") and v["name"] not in stored:
            stored.append(v["name"])
    prev = {c.get("type"): c for c in old_status.get("conditions") or []}

    def cond(t, reason, msg):
        c = prev.get(t)
        return {"type": t, "status": "True", "reason": reason, "message": msg,
                "lastTransitionTime": c["lastTransitionTime"] if c and c.get("status") == "True"
                else now}
    crd["status"] = {
        "acceptedNames": copy.deepcopy(spec["names"]),
        "conditions": [cond("NamesAccepted", "NoConflicts", "no conflicts found"),
                       cond("Established", "InitialNamesAccepted", "the initial names have been "
                            "accepted")],
        "storedVersions": stored,
    }


# ---------------------------------------------------------------------------
# Table output (kubectl get), by kind
# ---------------------------------------------------------------------------


def col(name, typ="string", fmt="", prio=0, desc=""):
    return {"name": name, "type": typ, "format": fmt, "description": desc or name, "priority": prio}


def age_of(obj):
    t = parse_time((obj.get("metadata") or {}).get("creationTimestamp"))
    return human_duration((utcnow() - t).total_seconds()) if t else "<unknown>"


def pod_status_text(pod):
    """The STATUS column kubectl shows for a pod."""
    st = pod.get("status") or {}
    reason = st.get("reason") or st.get("phase") or "Pending"
    inits = st.get("initContainerStatuses") or []
    spec_inits = (pod.get("spec") or {}).get("initContainers") or []
    initializing = False
    for i, cs in enumerate(inits):
        state = cs.get("state") or {}
        sidecar = i < len(spec_inits) and spec_inits[i].get("restartPolicy") == "Always"
        term = state.get("terminated")
        if term and term.get("exitCode") == 0 and not sidecar:
            continue
        if sidecar and cs.get("started"):
            continue
        if term:
            reason = "Init:" + (term.get("reason") or "Error")
        elif (state.get("waiting") or {}).get("reason") not in (None, "PodInitializing"):
            reason = "Init:" + state["waiting"]["reason"]
        else:
            reason = "Init:%d/%d" % (i, len(spec_inits))
        initializing = True
        break
    if not initializing:
        running = False
        for cs in reversed(st.get("containerStatuses") or []):
            state = cs.get("state") or {}
            if (state.get("waiting") or {}).get("reason"):
                reason = state["waiting"]["reason"]
            elif (state.get("terminated") or {}).get("reason"):
                reason = state["terminated"]["reason"]
            elif state.get("terminated"):
                reason = "ExitCode:%d" % state["terminated"].get("exitCode", 0)
            elif state.get("running") and cs.get("ready"):
                running = True
        if reason == "Completed" and running:
            reason = "Running"
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        reason = "Terminating"
    return reason


def table_for(rt, version, objs):
    """Column definitions and rows for a list of objects of one type."""
    if rt.crd is not None:
        cols = [col("Name", fmt="name", desc="Name must be unique within a namespace.")]
        pcs = rt.columns.get(version)
        if pcs is None:
            pcs = [{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}]
        for pc in pcs:
            cols.append(col(pc["name"], pc.get("type", "string"), pc.get("format", ""),
                            pc.get("priority", 0), pc.get("description", "")))

        def cells(o):
            out = [o["metadata"]["name"]]
            for pc in pcs:
                vals = jsonpath(o, pc.get("jsonPath"))
                if not vals or vals[0] is None:
                    out.append(None)
                    continue
                v = vals[0]
                t = pc.get("type", "string")
                if t == "date":
                    ts = parse_time(v)
                    out.append(human_duration((utcnow() - ts).total_seconds()) if ts else v)
                elif t == "integer" and _is_num(v):
                    out.append(int(v))
                elif t == "string" and not isinstance(v, str):
                    out.append(dumps(v))
                else:
                    out.append(v)
            return out
        return cols, [cells(o) for o in objs]
    k = rt.key
    if k == ("", "pods"):
        cols = [col("Name", fmt="name"), col("Ready"), col("Status"), col("Restarts"), col("Age"),
                col("IP", prio=1), col("Node", prio=1), col("Nominated Node", prio=1),
                col("Readiness Gates", prio=1)]

        def cells(o):
            st = o.get("status") or {}
            css = st.get("containerStatuses") or []
            total = len((o.get("spec") or {}).get("containers") or [])
            ready = sum(1 for c in css if c.get("ready"))
            inits = st.get("initContainerStatuses") or []
            restarts = sum(c.get("restartCount", 0) for c in css + inits)
            return [o["metadata"]["name"], "%d/%d" % (ready, total), pod_status_text(o),
                    str(restarts), age_of(o), st.get("podIP") or "<none>",
                    (o.get("spec") or {}).get("nodeName") or "<none>", "<none>", "<none>"]
        return cols, [cells(o) for o in objs]
    if k == ("", "namespaces"):
        return [col("Name", fmt="name"), col("Status"), col("Age")], \
            [[o["metadata"]["name"], (o.get("status") or {}).get("phase", ""), age_of(o)]
             for o in objs]
    if k == ("coordination.k8s.io", "leases"):
        return [col("Name", fmt="name"), col("Holder"), col("Age")], \
            [[o["metadata"]["name"], (o.get("spec") or {}).get("holderIdentity") or "", age_of(o)]
             for o in objs]
    if k == ("", "nodes"):
        def ready(o):
            c = [x for x in (o.get("status") or {}).get("conditions") or [] if x.get("type") ==
                 "Ready"]
            return "Ready" if c and c[0].get("status") == "True" else "NotReady"
        return [col("Name", fmt="name"), col("Status"), col("Roles"), col("Age"), col("Version")], \
            [[o["metadata"]["name"], ready(o), "<none>", age_of(o),
              ((o.get("status") or {}).get("nodeInfo") or {}).get("kubeletVersion", "")]
             for o in objs]
    if k == ("", "events"):
        def last(o):
            t = parse_time(o.get("lastTimestamp") or o.get("eventTime") or
                           o["metadata"].get("creationTimestamp"))
            return human_duration((utcnow() - t).total_seconds()) if t else "<unknown>"

        def target(o):
            io = o.get("involvedObject") or {}
            return "%s/%s" % ((io.get("kind") or "").lower(), io.get("name", ""))
        return [col("Last Seen"), col("Type"), col("Reason"), col("Object"), col("Message"),
                col("Name", fmt="name", prio=1)], \
            [[last(o), o.get("type", ""), o.get("reason", ""), target(o), o.get("message", ""),
              o["metadata"]["name"]] for o in objs]
    if k == ("", "services"):
        def ports(o):
            return ",".join("%s/%s" % (p.get("port"), p.get("protocol", "TCP"))
                            for p in (o.get("spec") or {}).get("ports") or []) or "<none>"
        return [col("Name", fmt="name"), col("Type"), col("Cluster-IP"), col("External-IP"),
                col("Port(s)"), col("Age")], \
            [[o["metadata"]["name"], (o.get("spec") or {}).get("type", "ClusterIP"),
              (o.get("spec") or {}).get("clusterIP", ""), "<none>", ports(o), age_of(o)]
             for o in objs]
    if k == ("", "configmaps"):
        return [col("Name", fmt="name"), col("Data", "integer"), col("Age")], \
            [[o["metadata"]["name"], len(o.get("data") or {}) + len(o.get("binaryData") or {}),
              age_of(o)] for o in objs]
    if k == ("", "secrets"):
        return [col("Name", fmt="name"), col("Type"), col("Data", "integer"), col("Age")], \
            [[o["metadata"]["name"], o.get("type", "Opaque"), len(o.get("data") or {}), age_of(o)]
             for o in objs]
    if k == ("apps", "deployments"):
        def dep(o):
            st = o.get("status") or {}
            return [o["metadata"]["name"], "%d/%d" % (st.get("readyReplicas", 0),
                                                      (o.get("spec") or {}).get("replicas", 1)),
                    st.get("updatedReplicas", 0), st.get("availableReplicas", 0), age_of(o)]
        return [col("Name", fmt="name"), col("Ready"), col("Up-to-date", "integer"),
                col("Available", "integer"), col("Age")], [dep(o) for o in objs]
    if k == ("apiextensions.k8s.io", "customresourcedefinitions"):
        return [col("Name", fmt="name"), col("Created At", "date")], \
            [[o["metadata"]["name"], o["metadata"].get("creationTimestamp")] for o in objs]
    return [col("Name", fmt="name"), col("Age")], [[o["metadata"]["name"], age_of(o)] for o in objs]


# ---------------------------------------------------------------------------
# The store
# ---------------------------------------------------------------------------

Ev = collections.namedtuple("Ev", "rv key type obj old")

GENERATION_KINDS = {("apiextensions.k8s.io", "customresourcedefinitions"), ("apps", "deployments"),
                    ("policy", "poddisruptionbudgets"),
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

    def __init__(self, history_size=1000, strict_namespaces=False):
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
        self.next_cluster_ip = 10
        self.gc_wake = threading.Event()
        for rt in builtin_types():
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

    def _ensure_namespace(self, rt, ns):
        if not rt.namespaced:
            return
        nsrt = self.types[("", "namespaces")]
        cur = self.get(nsrt, "", ns)
        if cur is None:
            if self.strict_namespaces:
                raise err_not_found(nsrt, ns)
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
        self._field_validation(unknown, warnings, fv)
        errs = []
        ratchet = old is not None
        validate_schema(obj, schema, "", errs, old, ratchet)
        if not any(e.blocking for e in errs):
            validate_rules(obj, old, schema, "", errs, ratchet)
        return obj, errs

    @staticmethod
    def _field_validation(unknown, warnings, fv):
        if not unknown:
            return
        if fv == "Strict":
            raise err_bad_request("strict decoding error: " + ", ".join('unknown field "%s"' % u
                                                                        for u in unknown))
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
        elif rt.key == ("", "namespaces"):
            obj["spec"] = {"finalizers": ["kubernetes"]}
            obj["status"] = {"phase": "Active"}
        elif rt.key == ("", "services"):
            spec = obj.setdefault("spec", {})
            spec.setdefault("type", "ClusterIP")
            if not spec.get("clusterIP"):
                spec["clusterIP"] = "10.96.%d.%d" % divmod(self.next_cluster_ip, 256)
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
        validate_meta(rt, obj, errs)
        if errs:
            raise err_invalid(rt, name, errs)
        if rt.namespaced and not dry:
            self._ensure_namespace(rt, ns)
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
                "status": {"replicas": status[0] if status and _is_int(status[0]) else 0,
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
        if not _is_int(replicas) or replicas < 0:
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


# ---------------------------------------------------------------------------
# Discovery and OpenAPI
# ---------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------
# HTTP
# ---------------------------------------------------------------------------


def truthy(v):
    return v in ("true", "1", "True")


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, addr, store, args):
        super().__init__(addr, Handler)
        self.store = store
        self.args = args
        self.requests = collections.deque(maxlen=10000)
        self._token_cache = (None, None)
        self.fault_lock = threading.Lock()
        self.faults = []                   # /debug/cohort/faults
        self.watch_generation = 0          # bumped by /debug/cohort/drop-watches

    def required_token(self):
        """The token a request must carry, or None for any. A token file is
        re-read when it changes, so tests can rotate the token."""
        if self.args.token_file:
            try:
                st = os.stat(self.args.token_file)
            except OSError:
                return self.args.token
            stamp = (st.st_mtime_ns, st.st_size)
            if self._token_cache[0] != stamp:
                with open(self.args.token_file) as f:
                    self._token_cache = (stamp, f.read().strip())
            return self._token_cache[1]
        return self.args.token


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "cohort-apiserver-standin/1"

    def log_message(self, fmt, *args):         # replaced by one line per request in _api
        pass

    def setup(self):
        super().setup()
        # Headers and body go out in separate writes; without NODELAY,
        # Nagle's algorithm and the client's delayed ACK add 40 ms to
        # every response on a kept-alive connection.
        try:
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass

    def do_GET(self):
        self._api("GET")

    def do_POST(self):
        self._api("POST")

    def do_PUT(self):
        self._api("PUT")

    def do_PATCH(self):
        self._api("PATCH")

    def do_DELETE(self):
        self._api("DELETE")

    # -- plumbing ---------------------------------------------------------

    @property
    def store(self):
        return self.server.store

    def _api(self, method):
        t0 = time.monotonic()
        self.code = 0
        self.token = None
        self.warnings = []
        url = urllib.parse.urlsplit(self.path)
        self.q = {k: v[-1] for k, v in urllib.parse.parse_qs(url.query, keep_blank_values=True)
                  .items()}
        self.accept = self.headers.get("Accept", "") or ""
        path = url.path
        try:
            h = self.headers.get("Authorization", "")
            if h.startswith("Bearer "):
                self.token = h[7:].strip()
            open_paths = path.startswith("/debug/") or path in ("/healthz", "/livez", "/readyz")
            want = self.server.required_token()
            if want is not None and self.token != want and not open_paths:
                self._drain_body()
                raise ApiError(401, "Unauthorized", "Unauthorized")
            body = self._read_body() if method in ("POST", "PUT", "PATCH", "DELETE") else None
            if not open_paths:
                self._inject_fault(method, path)
            self._route(method, path, body)
        except ApiError as e:
            self._send_json(e.code, e.status())
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as e:                  # a bug here must not kill the server
            import traceback
            traceback.print_exc()
            try:
                self._send_json(500, ApiError(500, "InternalError", "Internal error occurred: %s"
                                              % e).status())
            except OSError:
                self.close_connection = True
        finally:
            ms = (time.monotonic() - t0) * 1000
            ua = self.headers.get("User-Agent", "-")
            self.server.requests.append({"method": method, "path": path, "query": url.query,
                                         "code": self.code, "token": self.token,
                                         "userAgent": ua,
                                         "contentType": self.headers.get("Content-Type")})
            if not self.server.args.quiet:
                sys.stderr.write("apiserver: %s %s %d %.1fms %s\n" % (
                    method, self.path, self.code, ms, ua.split(" ")[0]))
                sys.stderr.flush()

    def _drain_body(self):
        n = int(self.headers.get("Content-Length") or 0)
        if 0 < n <= self.server.args.max_body:
            self.rfile.read(n)
        elif n:
            self.close_connection = True

    def _read_body(self):
        cap = self.server.args.max_body
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            data = b""
            while True:
                size = int(self.rfile.readline().strip().split(b";")[0] or b"0", 16)
                if size == 0:
                    self.rfile.readline()
                    break
                if len(data) + size > cap:
                    self.close_connection = True
                    raise ApiError(413, "RequestEntityTooLarge", "Request entity too large: limit "
                                   "is %d" % cap)
                data += self.rfile.read(size)
                self.rfile.readline()
        else:
            n = int(self.headers.get("Content-Length") or 0)
            if n > cap:
                self.close_connection = True
                raise ApiError(413, "RequestEntityTooLarge", "Request entity too large: limit is %d"
                               % cap)
            data = self.rfile.read(n) if n else b""
        if not data.strip():
            return None
        ctype = (self.headers.get("Content-Type") or "application/json").split(";")[0].strip()
        if ctype == "application/vnd.kubernetes.protobuf":
            try:
                return decode_k8s_protobuf(data)
            except KeyError as e:
                raise ApiError(415, "UnsupportedMediaType", "the cohort API server stand-in "
                               "decodes protobuf only for %s, not %s; send JSON (kubectl apply "
                               "-f or kubectl create -f with a manifest)" %
                               (", ".join(sorted(PB_KINDS)), e.args[0]))
            except (ValueError, UnicodeDecodeError) as e:
                raise err_bad_request("cannot decode the protobuf body: %s" % e)
        if "protobuf" in ctype or "yaml" in ctype:
            raise ApiError(415, "UnsupportedMediaType", "the body of the request was in an unknown "
                           "format - accepted media types include: application/json")
        try:
            return json.loads(data)
        except ValueError as e:
            raise err_bad_request("couldn't get version/kind; json parse error: %s" % e)

    def _send(self, code, data, ctype="application/json", extra=None):
        self.code = code
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-cache, private")
        self.send_header("Audit-Id", str(uuid.uuid4()))
        for w in self.warnings:
            self.send_header("Warning", '299 - %s' % json.dumps(w))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _send_json(self, code, obj, ctype="application/json", extra=None):
        self._send(code, (dumps(obj) + "\n").encode(), ctype, extra)

    # -- routing ----------------------------------------------------------

    def _route(self, method, path, body):
        parts = [p for p in path.split("/") if p]
        if path in ("/healthz", "/livez", "/readyz"):
            return self._send(200, b"ok", "text/plain; charset=utf-8")
        if path == "/version":
            return self._send_json(200, VERSION_INFO)
        if path == "/debug/cohort/requests":
            return self._send_json(200, list(self.server.requests))
        if path == "/debug/cohort/faults":
            return self._faults(method, body)
        if path == "/debug/cohort/drop-watches" and method == "POST":
            with self.server.fault_lock:
                self.server.watch_generation += 1
            return self._send_json(200, {"dropped": True})
        if parts[:1] == ["openapi"]:
            return self._openapi(parts)
        if not parts or parts[0] not in ("api", "apis"):
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        if method != "GET" and len(parts) <= (2 if parts[0] == "api" else 3):
            raise ApiError(405, "MethodNotAllowed", "the server does not allow this method on the "
                           "requested resource")
        with self.store.lock:
            groups = groups_of(self.store)
        if parts[0] == "api":
            group = ""
            if len(parts) == 1:
                if AGGREGATED in self.accept:
                    return self._aggregated(True)
                return self._send_json(200, {"kind": "APIVersions", "versions": ["v1"],
                                             "serverAddressByClientCIDRs": [
                                                 {"clientCIDR": "0.0.0.0/0",
                                                  "serverAddress": "%s:%d" %
                                                  self.server.server_address[:2]}]})
            version, rest = parts[1], parts[2:]
        else:
            if len(parts) == 1:
                if AGGREGATED in self.accept:
                    return self._aggregated(False)
                return self._send_json(200, {"kind": "APIGroupList", "apiVersion": "v1",
                                             "groups": [api_group(g, v) for g, v in groups.items()
                                                        if g]})
            group = parts[1]
            if group not in groups or group == "":
                raise ApiError(404, "NotFound", "the server could not find the requested resource")
            if len(parts) == 2:
                return self._send_json(200, dict(api_group(group, groups[group]),
                                                 kind="APIGroup", apiVersion="v1"))
            version, rest = parts[2], parts[3:]
        if version not in groups.get(group, []):
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        if not rest:
            with self.store.lock:
                return self._send_json(200, resource_list(self.store, group, version))
        watch_prefix = rest[0] == "watch"
        if watch_prefix:
            rest = rest[1:]
        ns = None
        if len(rest) >= 3 and rest[0] == "namespaces" and not (len(rest) == 3 and
                                                               rest[2] in ("status", "finalize")):
            ns, rest = rest[1], rest[2:]
        if not rest or len(rest) > 3:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        plural = rest[0]
        name = rest[1] if len(rest) > 1 else None
        sub = rest[2] if len(rest) > 2 else None
        with self.store.lock:
            rt = self.store.lookup(group, version, plural)
        if rt is None or (ns is not None and not rt.namespaced) or \
                (rt.namespaced and ns is None and (name is not None or method == "POST")):
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        ns = ns or ""
        if sub and sub not in [s[0] for s in subresources_of(rt, version)]:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        allowed = {None: ("GET", "PUT", "PATCH", "DELETE", "POST"),
                   "status": ("GET", "PUT", "PATCH"), "scale": ("GET", "PUT", "PATCH"),
                   "binding": ("POST",), "log": ("GET",)}
        if method not in allowed.get(sub, ()):
            raise ApiError(405, "MethodNotAllowed", "the server does not allow this method on the "
                           "requested resource")
        watching = watch_prefix or truthy(self.q.get("watch"))
        if method == "GET":
            if sub == "log":
                return self._pod_log(ns, name)
            if watching and sub is None:
                return self._watch(rt, version, ns, name)
            if name is None:
                return self._list(rt, version, ns)
            with self.store.lock:
                if sub == "scale":
                    return self._send_json(200, self.store.get_scale(rt, version, ns, name))
                obj = self.store.out(rt, version, self.store.must_get(rt, ns, name))
            return self._send_object(200, rt, version, obj)
        dry = self.q.get("dryRun") == "All"
        if dry is False and self.q.get("dryRun"):
            raise err_bad_request('unsupported dryRun value "%s"' % self.q["dryRun"])
        fv = self.q.get("fieldValidation") or "Warn"
        if fv not in ("Ignore", "Warn", "Strict"):
            raise err_bad_request('fieldValidation must be one of "Ignore", "Warn" or "Strict"')
        if method == "POST":
            if sub == "binding":
                with self.store.lock:
                    self.store.bind(ns, name, body)
                return self._send_json(201, {"kind": "Status", "apiVersion": "v1", "metadata": {},
                                             "status": "Success", "code": 201})
            if name is not None:
                raise ApiError(405, "MethodNotAllowed", "the server does not allow this method on "
                               "the requested resource")
            with self.store.lock:
                obj = self.store.create(rt, version, ns, body, dry, fv, self.warnings)
                obj = self.store.out(rt, version, obj)
            return self._send_object(201, rt, version, obj)
        if method == "DELETE" and name is None:
            return self._delete_collection(rt, version, ns, body)
        if name is None:
            raise ApiError(405, "MethodNotAllowed", "the server does not allow this method on the "
                           "requested resource")
        if method == "PUT":
            with self.store.lock:
                if sub == "scale":
                    return self._send_json(200, self.store.update_scale(rt, version, ns, name,
                                                                        body, dry))
                obj = self.store.update(rt, version, ns, name, body, sub, dry, fv, self.warnings)
                obj = self.store.out(rt, version, obj)
            return self._send_object(200, rt, version, obj)
        if method == "PATCH":
            ctype = (self.headers.get("Content-Type") or "").split(";")[0].strip()
            ptype = {"application/json-patch+json": "json",
                     "application/merge-patch+json": "merge",
                     "application/strategic-merge-patch+json": "strategic",
                     "application/apply-patch+yaml": "apply",
                     "application/apply-patch+cbor": "apply"}.get(ctype)
            if ptype is None:
                raise ApiError(415, "UnsupportedMediaType", "the body of the request was in an "
                               "unknown format - accepted media types include: "
                               "application/json-patch+json, application/merge-patch+json, "
                               "application/apply-patch+yaml")
            with self.store.lock:
                got = self.store.patch(rt, version, ns, name, ptype, body, sub, dry, fv,
                                       self.warnings)
                if sub == "scale":
                    return self._send_json(200, got)
                obj = self.store.out(rt, version, got)
            return self._send_object(200, rt, version, obj)
        if method == "DELETE":
            opts = self._delete_options(body)
            with self.store.lock:
                obj, gone = self.store.delete(rt, ns, name, opts, dry)
                obj = self.store.out(rt, version, obj)
            if gone and rt.key != ("", "pods"):
                return self._send_json(200, {
                    "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                    "details": {"name": name, "group": rt.group, "kind": rt.plural,
                                "uid": obj["metadata"]["uid"]}})
            return self._send_object(200, rt, version, obj)
        raise ApiError(405, "MethodNotAllowed", "the server does not allow this method on the "
                       "requested resource")

    def _delete_options(self, body):
        opts = dict(body) if isinstance(body, dict) else {}
        if "propagationPolicy" in self.q:
            opts["propagationPolicy"] = self.q["propagationPolicy"]
        if "orphanDependents" in self.q:
            opts["orphanDependents"] = truthy(self.q["orphanDependents"])
        if "gracePeriodSeconds" in self.q:
            try:
                opts["gracePeriodSeconds"] = int(self.q["gracePeriodSeconds"])
            except ValueError:
                raise err_bad_request("gracePeriodSeconds must be an integer")
        return opts

    def _delete_collection(self, rt, version, ns, body):
        sel = Selector.parse(self.q.get("labelSelector"))
        fterms = parse_field_selector(self.q.get("fieldSelector"), rt)
        opts = self._delete_options(body)
        dry = self.q.get("dryRun") == "All"
        with self.store.lock:
            items, at, _, _ = self.store.list(rt, ns, sel, fterms)
            out = []
            for o in items:
                got, _ = self.store.delete(rt, nkey(o)[0], nkey(o)[1], opts, dry)
                out.append(self.store.out(rt, version, got))
        self._send_json(200, {"kind": rt.list_kind, "apiVersion": rt.gv(version),
                              "metadata": {"resourceVersion": str(at)}, "items": out})

    # -- representations --------------------------------------------------

    def _wants(self, what):
        return ("as=%s" % what) in self.accept.replace(" ", "")

    def _table(self, rt, version, objs, meta):
        cols, rows = table_for(rt, version, objs)
        include = self.q.get("includeObject", "Metadata")
        out_rows = []
        for o, cells in zip(objs, rows):
            row = {"cells": cells}
            if include == "Object":
                row["object"] = self.store.out(rt, version, o)
            elif include != "None":
                row["object"] = {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                                 "metadata": o["metadata"]}
            out_rows.append(row)
        return {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": meta,
                "columnDefinitions": cols, "rows": out_rows}

    def _send_object(self, code, rt, version, obj):
        if self._wants("Table"):
            return self._send_json(code, self._table(rt, version, [obj], {
                "resourceVersion": obj["metadata"].get("resourceVersion", "")}),
                "application/json;as=Table;v=v1;g=meta.k8s.io")
        if self._wants("PartialObjectMetadata"):
            return self._send_json(code, {"kind": "PartialObjectMetadata",
                                          "apiVersion": "meta.k8s.io/v1",
                                          "metadata": obj["metadata"]},
                                   "application/json;as=PartialObjectMetadata;v=v1;g=meta.k8s.io")
        self._send_json(code, obj)

    def _list(self, rt, version, ns):
        sel = Selector.parse(self.q.get("labelSelector"))
        fterms = parse_field_selector(self.q.get("fieldSelector"), rt)
        try:
            limit = int(self.q.get("limit") or 0)
        except ValueError:
            raise err_bad_request("limit must be an integer")
        with self.store.lock:
            items, at, token, remaining = self.store.list(
                rt, ns, sel, fterms, limit, self.q.get("continue"), self.q.get("resourceVersion"),
                self.q.get("resourceVersionMatch"))
        meta = {"resourceVersion": str(at)}
        if token:
            meta["continue"] = token
            meta["remainingItemCount"] = remaining
        if self._wants("Table"):
            return self._send_json(200, self._table(rt, version, items, meta),
                                   "application/json;as=Table;v=v1;g=meta.k8s.io")
        if self._wants("PartialObjectMetadataList"):
            return self._send_json(200, {
                "kind": "PartialObjectMetadataList", "apiVersion": "meta.k8s.io/v1",
                "metadata": meta,
                "items": [{"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                           "metadata": o["metadata"]} for o in items]},
                "application/json;as=PartialObjectMetadataList;v=v1;g=meta.k8s.io")
        if rt.crd is not None:
            out = [self.store.out(rt, version, o) for o in items]
        else:       # typed lists leave kind and apiVersion out of their items
            out = [without(o, "kind", "apiVersion") for o in items]
        self._send_json(200, {"kind": rt.list_kind, "apiVersion": rt.gv(version), "metadata": meta,
                              "items": out})

    def _aggregated(self, core):
        v = "v2beta1" if "v=v2beta1" in self.accept and "v=v2;" not in self.accept else "v2"
        with self.store.lock:
            doc = aggregated_discovery(self.store, core, "apidiscovery.k8s.io/" + v)
        data = (dumps(doc) + "\n").encode()
        self._send(200, data, "application/json;g=apidiscovery.k8s.io;v=%s;as=APIGroupDiscoveryList"
                   % v, {"ETag": '"%s"' % hashlib.sha256(data).hexdigest()})

    def _openapi(self, parts):
        if parts[1:2] != ["v3"]:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        with self.store.lock:
            groups = groups_of(self.store)
            if len(parts) == 2:
                paths = {}
                for g, vs in groups.items():
                    for v in vs:
                        key = "apis/%s/%s" % (g, v) if g else "api/" + v
                        doc = dumps(openapi_doc(self.store, g, v)).encode()
                        h = hashlib.sha512(doc).hexdigest()
                        paths[key] = {"serverRelativeURL": "/openapi/v3/%s?hash=%s" % (key, h[:64])}
                return self._send_json(200, {"paths": paths})
            rest = parts[2:]
            if rest[0] == "api" and len(rest) == 2:
                g, v = "", rest[1]
            elif rest[0] == "apis" and len(rest) == 3:
                g, v = rest[1], rest[2]
            else:
                raise ApiError(404, "NotFound", "the server could not find the requested resource")
            if v not in groups.get(g, []):
                raise ApiError(404, "NotFound", "the server could not find the requested resource")
            doc = openapi_doc(self.store, g, v)
        self._send_json(200, doc, extra={"Cache-Control": "public, immutable"}
                        if "hash" in self.q else None)

    # -- fault injection, for tests -----------------------------------------

    def _faults(self, method, body):
        """POST adds a rule, GET lists them, DELETE clears them. A rule:
        {"method": "POST", "path": "substring", "userAgent": "substring",
         "status": 500, "delay": seconds, "count": N}. Every field is
        optional; a matching request waits `delay` seconds, then gets
        `status` (if given) instead of its answer, `count` times (default
        unlimited). Watches match too, by the same fields."""
        srv = self.server
        with srv.fault_lock:
            if method == "POST":
                rule = dict(body or {})
                rule.setdefault("hits", 0)
                srv.faults.append(rule)
            elif method == "DELETE":
                srv.faults[:] = []
            return self._send_json(200, {"faults": list(srv.faults)})

    def _inject_fault(self, method, path):
        srv = self.server
        ua = self.headers.get("User-Agent", "") or ""
        with srv.fault_lock:
            rule = None
            for r in srv.faults:
                if r.get("method") and r["method"] != method:
                    continue
                if r.get("path") and r["path"] not in path:
                    continue
                if r.get("userAgent") and r["userAgent"] not in ua:
                    continue
                if r.get("count") is not None and r["hits"] >= r["count"]:
                    continue
                r["hits"] += 1
                rule = dict(r)
                break
        if rule is None:
            return
        if rule.get("delay"):
            time.sleep(float(rule["delay"]))
        if rule.get("status"):
            code = int(rule["status"])
            raise ApiError(code, {429: "TooManyRequests", 500: "InternalError",
                                  503: "ServiceUnavailable", 504: "Timeout"}
                           .get(code, "InternalError"), "injected fault (%d) for %s %s" %
                           (code, method, path))

    # -- watch ------------------------------------------------------------

    def _client_gone(self):
        try:
            r, _, _ = select.select([self.connection], [], [], 0)
            return bool(r) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _chunk(self, data):
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _watch(self, rt, version, ns, name):
        st = self.store
        sel = Selector.parse(self.q.get("labelSelector"))
        fterms = parse_field_selector(self.q.get("fieldSelector"), rt)
        if name is not None:
            fterms.append(("metadata.name", True, name))
        try:
            timeout = float(self.q["timeoutSeconds"]) if self.q.get("timeoutSeconds") else \
                self.server.args.watch_timeout * (1 + random.random())
        except ValueError:
            raise err_bad_request("timeoutSeconds must be a number")
        bookmarks = truthy(self.q.get("allowWatchBookmarks"))
        initial_events = truthy(self.q.get("sendInitialEvents"))
        if initial_events and (not bookmarks or
                               self.q.get("resourceVersionMatch") != "NotOlderThan"):
            raise err_invalid(rt, "", [FieldError("Forbidden", "sendInitialEvents",
                                                  detail="sendInitialEvents requires "
                                                  "allowWatchBookmarks=true and "
                                                  "resourceVersionMatch=NotOlderThan")])
        rv = self.q.get("resourceVersion")
        table = self._wants("Table")

        def visible(o):
            if rt.namespaced and ns and nkey(o)[0] != ns:
                return False
            return sel.matches(meta_of(o).get("labels")) and fields_match(fterms, o)

        def encode(typ, obj):
            if table:
                out = self._table(rt, version, [obj], {"resourceVersion":
                                                       obj["metadata"]["resourceVersion"]})
            else:
                out = st.out(rt, version, obj)
            return (dumps({"type": typ, "object": out}) + "\n").encode()

        expired = False
        with st.lock:
            initial = []
            if initial_events or rv in (None, "", "0"):
                initial = [o for _, o in sorted(st.objects.get(rt.key, {}).items()) if visible(o)]
                pos = st.rv
            else:
                try:
                    pos = int(rv)
                except ValueError:
                    raise err_bad_request('invalid resource version "%s"' % rv)
                expired = pos < st.compacted
            oldest = st.compacted
        self.code = 200
        self.send_response(200)
        self.send_header("Content-Type", "application/json;as=Table;v=v1;g=meta.k8s.io" if table
                         else "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Cache-Control", "no-cache, private")
        self.end_headers()

        def bookmark(extra_meta=None):
            meta = {"resourceVersion": str(pos), "creationTimestamp": None}
            if extra_meta:
                meta.update(extra_meta)
            return (dumps({"type": "BOOKMARK", "object": {"kind": rt.kind,
                                                          "apiVersion": rt.gv(version),
                                                          "metadata": meta}}) + "\n").encode()

        def gone():
            return (dumps({"type": "ERROR", "object": ApiError(
                410, "Expired", "too old resource version: %s (%d)" % (rv if rv else pos, oldest)
            ).status()}) + "\n").encode()
        try:
            if expired:
                self._chunk(gone())
                return
            for o in initial:
                self._chunk(encode("ADDED", o))
            if initial_events:
                self._chunk(bookmark({"annotations": {"k8s.io/initial-events-end": "true"}}))
            deadline = time.monotonic() + timeout
            generation = self.server.watch_generation
            interval = self.server.args.bookmark_interval
            next_bm = time.monotonic() + interval
            while True:
                now = time.monotonic()
                if self.server.watch_generation != generation:
                    # /debug/cohort/drop-watches: the connection breaks
                    # mid-stream, as when a load balancer or server dies.
                    self.close_connection = True
                    try:
                        self.connection.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                    return
                if now >= deadline:
                    if bookmarks:
                        self._chunk(bookmark())
                    break
                with st.cond:
                    evs, newpos, expired = st.events_after(pos)
                    if not evs and not expired:
                        st.cond.wait(max(0.0, min(0.5, deadline - now, next_bm - now)))
                        evs, newpos, expired = st.events_after(pos)
                    oldest = st.compacted
                if expired:
                    self._chunk(gone())
                    break
                out = []
                for ev in evs:
                    if ev.key != rt.key:
                        continue
                    now_vis = visible(ev.obj)
                    was_vis = ev.old is not None and visible(ev.old)
                    if ev.type == "ADDED" and now_vis:
                        out.append(encode("ADDED", ev.obj))
                    elif ev.type == "MODIFIED":
                        if now_vis and was_vis:
                            out.append(encode("MODIFIED", ev.obj))
                        elif now_vis:
                            out.append(encode("ADDED", ev.obj))
                        elif was_vis:
                            out.append(encode("DELETED", ev.obj))
                    elif ev.type == "DELETED" and now_vis:
                        out.append(encode("DELETED", ev.obj))
                pos = newpos
                if out:
                    self._chunk(b"".join(out))
                if bookmarks and time.monotonic() >= next_bm:
                    self._chunk(bookmark())
                    next_bm = time.monotonic() + interval
                elif time.monotonic() >= next_bm:
                    next_bm = time.monotonic() + interval
                if not out and self._client_gone():
                    self.close_connection = True
                    return
        finally:
            try:
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
            except OSError:
                self.close_connection = True

    # -- pods/log: proxied to the kubelet, as the real server does --------

    def _pod_log(self, ns, name):
        st = self.store
        with st.lock:
            prt = st.types[("", "pods")]
            pod = st.must_get(prt, ns, name)
            node_name = (pod.get("spec") or {}).get("nodeName")
            node = st.get(st.types[("", "nodes")], "", node_name) if node_name else None
        conts = [c["name"] for c in (pod.get("spec") or {}).get("containers") or []]
        inits = [c["name"] for c in (pod.get("spec") or {}).get("initContainers") or []]
        container = self.q.get("container")
        if not container:
            if len(conts) != 1:
                raise err_bad_request("a container name must be specified for pod %s, choose one "
                                      "of: [%s] or one of the init containers: [%s]" %
                                      (name, " ".join(conts), " ".join(inits)))
            container = conts[0]
        if container not in conts + inits:
            raise err_bad_request("container %s is not valid for pod %s" % (container, name))
        if node is None:
            raise err_bad_request('container "%s" in pod "%s" is waiting to start: '
                                  'ContainerCreating' % (container, name))
        port = (((node.get("status") or {}).get("daemonEndpoints") or {}).get("kubeletEndpoint")
                or {}).get("Port")
        addrs = [a.get("address") for a in (node.get("status") or {}).get("addresses") or []
                 if a.get("type") == "InternalIP"]
        if not port or not addrs:
            raise ApiError(500, "InternalError", "node %s has no kubelet endpoint" % node_name)
        query = urllib.parse.urlencode({k: v for k, v in self.q.items() if k in
                                        ("follow", "tailLines", "previous", "timestamps",
                                         "limitBytes", "sinceSeconds")})
        url = "http://%s:%d/containerLogs/%s/%s/%s?%s" % (addrs[0], port, ns, name, container,
                                                          query)
        try:
            resp = urllib.request.urlopen(url, timeout=30)
        except urllib.error.HTTPError as e:
            raise err_bad_request(e.read().decode("utf-8", "replace").strip() or str(e))
        except OSError as e:
            raise ApiError(500, "InternalError", "cannot reach the kubelet: %s" % e)
        self.code = 200
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            while True:
                data = resp.read1(65536) if hasattr(resp, "read1") else resp.read(65536)
                if not data:
                    break
                self._chunk(data)
        finally:
            resp.close()
            try:
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
            except OSError:
                self.close_connection = True


# ---------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------


def kubeconfig_text(server_url, token, token_file=None):
    user = "    tokenFile: %s\n" % token_file if token_file else "    token: %s\n" % token
    return ("apiVersion: v1\nkind: Config\n"
            "clusters:\n- name: cohort-standin\n  cluster:\n    server: %s\n"
            "users:\n- name: cohort-standin\n  user:\n%s"
            "contexts:\n- name: cohort-standin\n  context:\n    cluster: cohort-standin\n"
            "    user: cohort-standin\n    namespace: default\n"
            "current-context: cohort-standin\n" % (server_url, user))


def write_atomic(path, text):
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = "%s.%d.tmp" % (path, os.getpid())
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="Kubernetes API server stand-in for cohort's tests.")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=0, help="port; 0 picks a free one (default)")
    ap.add_argument("--port-file", help="write the bound port here once listening")
    ap.add_argument("--kubeconfig", help="write a kubeconfig pointing at this server here")
    ap.add_argument("--token", help="require this bearer token (default: accept any)")
    ap.add_argument("--token-file", help="require the token in this file, re-read on change; "
                    "the kubeconfig then names the file (tokenFile)")
    ap.add_argument("--history-size", type=int, default=1000,
                    help="events kept for watches and consistent pages; older resourceVersions "
                    "get 410 Gone (default 1000)")
    ap.add_argument("--bookmark-interval", type=float, default=5.0,
                    help="seconds between BOOKMARK events on watches that allow them (default 5)")
    ap.add_argument("--watch-timeout", type=float, default=1800.0,
                    help="watch length when the client gives no timeoutSeconds, randomized up to "
                    "twice this (default 1800, like --min-request-timeout)")
    ap.add_argument("--max-body", type=int, default=3 * 1024 * 1024,
                    help="largest request body in bytes; larger gets 413 (default 3 MiB)")
    ap.add_argument("--strict-namespaces", action="store_true",
                    help="refuse objects in namespaces that do not exist (404), as a real "
                    "cluster does; by default such a namespace is created on first use")
    ap.add_argument("--quiet", action="store_true", help="no per-request log lines")
    return ap.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    store = Store(args.history_size, args.strict_namespaces)
    server = Server((args.host, args.port), store, args)
    host, port = server.server_address[:2]
    url = "http://%s:%d" % (host, port)
    if args.kubeconfig:
        write_atomic(args.kubeconfig, kubeconfig_text(url, args.token or "cohort-standin",
                                                      args.token_file))
    if args.port_file:
        write_atomic(args.port_file, "%d\n" % port)
    sys.stderr.write("apiserver: listening on %s\n" % url)
    sys.stderr.flush()
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()

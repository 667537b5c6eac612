"""HTTP: the threaded server and its request handler. Routing of /api and
/apis paths to the store, bodies (JSON, a few protobuf kinds), tokens,
Table and PartialObjectMetadata representations, chunked watch streams,
pods/log proxied to the kubelet, and the /debug/cohort endpoints (request
log, injected faults, dropped watches, RBAC decisions). TLS, who a request
is (authn.py) and whether it may (rbac.py) are decided before routing.
"""
import collections
import hashlib
import json
import random
import select
import socket
import ssl
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .authn import Authenticator
from .common import dumps
from .discovery import (AGGREGATED, VERSION_INFO, aggregated_discovery, api_group, groups_of,
                        openapi_doc, resource_list, subresources_of)
from .errors import ApiError, FieldError, err_bad_request, err_invalid
from .protobuf import PB_KINDS, decode_k8s_protobuf
from .rbac import owner_references_check, request_info
from .selection import Selector, fields_match, parse_field_selector
from .store import meta_of, nkey, without
from .tables import table_for


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
        self.authn = Authenticator(args, store)
        self.authz = None                  # set by cli.main under --authorization-mode RBAC
        self.admission_plugins = set(getattr(args, "enable_admission_plugins", None) or ())
        self.ssl_context = None            # set by serve_tls()
        self.fault_lock = threading.Lock()
        self.faults = []                   # /debug/cohort/faults
        self.watch_generation = 0          # bumped by /debug/cohort/drop-watches

    def serve_tls(self, context):
        """Serve HTTPS with context from now on. The handshake runs in the
        request's thread (finish_request), so a slow client holds up no
        other."""
        self.ssl_context = context

    def get_request(self):
        sock, addr = super().get_request()
        if self.ssl_context is not None:
            sock = self.ssl_context.wrap_socket(sock, server_side=True,
                                                do_handshake_on_connect=False)
        return sock, addr

    def finish_request(self, request, client_address):
        if self.ssl_context is not None:
            try:
                request.settimeout(10)
                request.do_handshake()
                request.settimeout(None)
            except (ssl.SSLError, OSError) as e:
                if not self.args.quiet:
                    sys.stderr.write("apiserver: TLS handshake with %s:%d failed: %s\n" %
                                     (client_address[0], client_address[1], e))
                return
        super().finish_request(request, client_address)


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
        self.user = None                    # {"name", "groups"}, set by authentication
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
            health = path in ("/healthz", "/livez", "/readyz")
            open_paths = path.startswith("/debug/") or health
            if not path.startswith("/debug/"):
                try:
                    self.user = self.server.authn.authenticate(self.connection, self.token)
                except ApiError:
                    if not health:
                        self._drain_body()
                        raise
                    self.user = {"name": "system:anonymous", "groups": ["system:unauthenticated"]}
                if self.server.authz is not None:
                    err = self.server.authz.authorize(self.user, request_info(method, path,
                                                                              url.query))
                    if err is not None:
                        self._drain_body()
                        raise err
            body = self._read_body() if method in ("POST", "PUT", "PATCH", "DELETE") else None
            if self.server.authz is not None and not open_paths and \
                    "OwnerReferencesPermissionEnforcement" in self.server.admission_plugins:
                err = owner_references_check(
                    self.server.authz, self.store, self.user, request_info(method, path, url.query),
                    method, body, (self.headers.get("Content-Type") or "").split(";")[0].strip())
                if err is not None:
                    raise err
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
                                         "user": (self.user or {}).get("name"),
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
        if path == "/debug/cohort/rbac":
            if self.server.authz is None:
                raise ApiError(404, "NotFound", "authorization is AlwaysAllow: nothing recorded")
            return self._send_json(200, self.server.authz.report())
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
                   "binding": ("POST",), "log": ("GET",), "token": ("POST",)}
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
        dry = self._dry_run(body if method == "DELETE" else None)
        fv = self.q.get("fieldValidation") or "Warn"
        if fv not in ("Ignore", "Warn", "Strict"):
            raise err_bad_request('fieldValidation must be one of "Ignore", "Warn" or "Strict"')
        if method == "POST":
            if sub == "binding":
                with self.store.lock:
                    self.store.bind(ns, name, body)
                return self._send_json(201, {"kind": "Status", "apiVersion": "v1", "metadata": {},
                                             "status": "Success", "code": 201})
            if sub == "token":
                return self._send_json(201, self.server.authn.token_request(ns, name, body))
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

    def _dry_run(self, delete_options=None):
        """dryRun=All from the query, or for a DELETE from its
        DeleteOptions body too (client-go sends it there): the request is
        validated, defaulted and admitted, and nothing is stored."""
        values = [self.q["dryRun"]] if self.q.get("dryRun") else []
        if isinstance(delete_options, dict):
            dr = delete_options.get("dryRun") or []
            values += dr if isinstance(dr, list) else [dr]
        for v in values:
            if v != "All":
                raise err_bad_request('unsupported dryRun value "%s"' % v)
        return bool(values)

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
        dry = self._dry_run(body)
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
            if r and isinstance(self.connection, ssl.SSLSocket):
                # An HTTP/1.1 client sends nothing while it reads a watch:
                # bytes here are its close_notify alert before the FIN.
                return True
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

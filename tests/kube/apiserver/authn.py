"""Authentication: who a request is, as kube-apiserver's authenticators
decide it, in their order: a verified client certificate (CN = user,
O = groups), then a bearer token: the admin token (--token or the one in
--token-file: user "admin" in system:masters) or a ServiceAccount token
issued through the TokenRequest subresource (user
system:serviceaccount:NS:NAME). A token that is none of these is a 401.

Without --token, --token-file and RBAC (the stand-in's permissive mode,
which older tests rely on) any token, or none, is the admin. Under RBAC a
request without credentials is system:anonymous (group
system:unauthenticated), as with --anonymous-auth=true; with a required
token it is a 401.

ServiceAccount tokens are opaque random strings, not JWTs: they live in
this process, honour expirationSeconds and are bound to the
ServiceAccount's uid, so deleting (or recreating) the ServiceAccount ends
them, as bound tokens end.
"""
import datetime
import os
import secrets
import threading
import time

from .common import rfc3339
from .errors import ApiError, FieldError, err_invalid
from .tls import cert_user

ADMIN = {"name": "admin", "groups": ["system:masters", "system:authenticated"]}
ANONYMOUS = {"name": "system:anonymous", "groups": ["system:unauthenticated"]}
DEFAULT_AUDIENCE = "https://kubernetes.default.svc.cluster.local"
DEFAULT_TOKEN_SECONDS = 3600
MAX_TOKEN_SECONDS = 1 << 32


def unauthorized():
    return ApiError(401, "Unauthorized", "Unauthorized")


class Authenticator:
    def __init__(self, args, store):
        self.args = args
        self.store = store
        self.lock = threading.Lock()
        self.tokens = {}                  # token -> (ns, name, uid, expiry unix seconds)
        self._file_cache = (None, None)

    @property
    def permissive(self):
        return (not self.args.token and not self.args.token_file and
                getattr(self.args, "authorization_mode", "AlwaysAllow") != "RBAC")

    def admin_token(self):
        """The admin's token: the one in --token-file (re-read when it
        changes, so tests can rotate it), else --token, else the
        kubeconfig's default."""
        if self.args.token_file:
            try:
                st = os.stat(self.args.token_file)
            except OSError:
                return self.args.token
            stamp = (st.st_mtime_ns, st.st_size)
            if self._file_cache[0] != stamp:
                with open(self.args.token_file) as f:
                    self._file_cache = (stamp, f.read().strip())
            return self._file_cache[1]
        return self.args.token or "cohort-standin"

    def authenticate(self, sock, token):
        """The user dict ({"name", "groups"}) of a request arriving on sock
        with this bearer token (None for none); raises a 401 ApiError."""
        user = cert_user(sock)
        if user is not None:
            return user
        if token:
            if secrets.compare_digest(token.encode(), (self.admin_token() or "").encode()):
                return dict(ADMIN)
            user = self._service_account(token)
            if user is not None:
                return user
            if self.permissive:
                return dict(ADMIN)
            raise unauthorized()
        if self.permissive:
            return dict(ADMIN)
        if getattr(self.args, "authorization_mode", "AlwaysAllow") == "RBAC" and \
                not self.args.token and not self.args.token_file:
            return dict(ANONYMOUS)
        raise unauthorized()

    def _service_account(self, token):
        with self.lock:
            got = self.tokens.get(token)
        if got is None:
            return None
        ns, name, uid, expiry = got
        if time.time() >= expiry:
            with self.lock:
                self.tokens.pop(token, None)
            raise unauthorized()
        with self.store.lock:
            sa = self.store.get(self.store.types[("", "serviceaccounts")], ns, name)
        if sa is None or sa["metadata"].get("uid") != uid or \
                sa["metadata"].get("deletionTimestamp"):
            with self.lock:
                self.tokens.pop(token, None)
            raise unauthorized()
        return {"name": "system:serviceaccount:%s:%s" % (ns, name),
                "groups": ["system:serviceaccounts", "system:serviceaccounts:" + ns,
                           "system:authenticated"]}

    def token_request(self, ns, name, body):
        """POST serviceaccounts/NAME/token: the TokenRequest answered, with
        a new token in status. Validation as the real server's: at least
        --min-token-expiration seconds (10 minutes by default), below
        2^32."""
        rt = self.store.types[("", "serviceaccounts")]
        body = body if isinstance(body, dict) else {}
        if body.get("kind") not in (None, "TokenRequest") or \
                body.get("apiVersion") not in (None, "authentication.k8s.io/v1"):
            raise ApiError(400, "BadRequest", "the body must be an authentication.k8s.io/v1 "
                           "TokenRequest, not %s %s" % (body.get("apiVersion"), body.get("kind")))
        spec = dict(body.get("spec") or {})
        secs = spec.get("expirationSeconds")
        if secs is None:
            secs = DEFAULT_TOKEN_SECONDS
        trt = type("TokenRequestType", (), {"kind": "TokenRequest",
                                            "group": "authentication.k8s.io"})
        if not isinstance(secs, int) or isinstance(secs, bool):
            raise err_invalid(trt, name, [FieldError("Invalid", "spec.expirationSeconds", secs,
                                                     "must be an integer")])
        floor = getattr(self.args, "min_token_expiration", 600)
        if secs < floor:
            raise err_invalid(trt, name, [FieldError(
                "Invalid", "spec.expirationSeconds", secs,
                "may not specify a duration less than %s" %
                ("10 minutes" if floor == 600 else "%d seconds" % floor))])
        if secs >= MAX_TOKEN_SECONDS:
            raise err_invalid(trt, name, [FieldError("TooLong", "spec.expirationSeconds", secs,
                                                     "may not specify a duration larger than "
                                                     "2^32 seconds")])
        with self.store.lock:
            sa = self.store.must_get(rt, ns, name)
            uid = sa["metadata"]["uid"]
        token = "cohort-sa." + secrets.token_urlsafe(32)
        expiry = time.time() + secs
        with self.lock:
            now = time.time()
            for t in [t for t, v in self.tokens.items() if v[3] <= now]:
                del self.tokens[t]
            self.tokens[token] = (ns, name, uid, expiry)
        spec["expirationSeconds"] = secs
        spec.setdefault("audiences", [DEFAULT_AUDIENCE])
        spec.setdefault("boundObjectRef", None)
        return {"kind": "TokenRequest", "apiVersion": "authentication.k8s.io/v1",
                "metadata": {"name": name, "namespace": ns, "creationTimestamp": None},
                "spec": spec,
                "status": {"token": token, "expirationTimestamp": rfc3339(
                    datetime.datetime.fromtimestamp(expiry, datetime.timezone.utc))}}

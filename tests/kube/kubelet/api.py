"""The API client: JSON over HTTP/1.1 to the API server, watch streams,
and the server and token read from a kubeconfig.
"""
import base64
import http.client
import json
import re
import ssl
import threading
import urllib.parse


class ApiError(Exception):
    def __init__(self, code, body):
        super().__init__("HTTP %d: %s" % (code, (body or {}).get("message", body)))
        self.code = code
        self.body = body


class Client:
    """JSON over HTTP/1.1 to the API server, one connection per thread."""

    def __init__(self, server, token=None, token_file=None, ca_pem=None):
        u = urllib.parse.urlsplit(server)
        if u.scheme not in ("http", "https"):
            raise SystemExit("kubelet: only http:// and https:// API servers are supported, "
                             "not %s" % server)
        self.https = u.scheme == "https"
        self.host, self.port = u.hostname, u.port or (443 if self.https else 80)
        self.token = token
        self.token_file = token_file
        # The CA the server's certificate is checked against: also what a
        # pod's service account volume carries as ca.crt.
        self.ca_pem = ca_pem
        self.ssl = None
        if self.https:
            self.ssl = ssl.create_default_context(cadata=ca_pem.decode() if ca_pem else None)
        self.local = threading.local()

    def _new_conn(self, timeout):
        if self.https:
            return http.client.HTTPSConnection(self.host, self.port, timeout=timeout,
                                               context=self.ssl)
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def _token(self):
        if self.token_file:
            try:
                with open(self.token_file) as f:
                    return f.read().strip()
            except OSError:
                return self.token
        return self.token

    def _conn(self, timeout=30):
        c = getattr(self.local, "conn", None)
        if c is None:
            c = self._new_conn(timeout)
            self.local.conn = c
        return c

    def request(self, method, path, body=None, ctype="application/json"):
        headers = {"Accept": "application/json", "User-Agent": "cohort-process-kubelet/1"}
        tok = self._token()
        if tok:
            headers["Authorization"] = "Bearer " + tok
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = ctype
        for attempt in range(2):
            conn = self._conn()
            try:
                conn.request(method, path, data, headers)
                resp = conn.getresponse()
                raw = resp.read()
                break
            except (http.client.HTTPException, OSError):
                conn.close()
                self.local.conn = None
                if attempt:
                    raise
        try:
            doc = json.loads(raw) if raw else None
        except ValueError:
            doc = {"message": raw.decode("utf-8", "replace")}
        if resp.status >= 400:
            raise ApiError(resp.status, doc)
        return doc

    def stream(self, path, timeout):
        """Yields the JSON lines of a watch until the server ends it."""
        headers = {"Accept": "application/json", "User-Agent": "cohort-process-kubelet/1"}
        tok = self._token()
        if tok:
            headers["Authorization"] = "Bearer " + tok
        conn = self._new_conn(timeout)
        try:
            conn.request("GET", path, None, headers)
            resp = conn.getresponse()
            if resp.status != 200:
                raise ApiError(resp.status, json.loads(resp.read() or b"{}"))
            while True:
                line = resp.readline()
                if not line:
                    return
                if line.strip():
                    yield json.loads(line)
        finally:
            conn.close()


def read_kubeconfig(path):
    """server, token, tokenFile and the CA (PEM bytes, from
    certificate-authority-data or certificate-authority) of the current
    context's cluster. A line-based reader: enough for the kubeconfigs the
    stand-in writes and for simple hand-written ones, without a YAML
    library."""
    server = token = token_file = ca = None
    with open(path) as f:
        for line in f:
            m = re.match(r"^\s*(server|token|tokenFile|certificate-authority-data|"
                         r"certificate-authority):\s*(\S+)\s*$", line)
            if m:
                key, val = m.group(1), m.group(2).strip("'\"")
                if key == "server" and server is None:
                    server = val
                elif key == "token" and token is None:
                    token = val
                elif key == "tokenFile" and token_file is None:
                    token_file = val
                elif key == "certificate-authority-data" and ca is None:
                    ca = base64.b64decode(val)
                elif key == "certificate-authority" and ca is None:
                    with open(val, "rb") as cf:
                        ca = cf.read()
    if not server:
        raise SystemExit("kubelet: no server in %s" % path)
    return server, token, token_file, ca

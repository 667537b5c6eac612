"""Proves the API server stand-in's authentication as Kubernetes does it:
HTTPS (a certificate given, or --tls making a CA and a serving
certificate), client certificates verified against --client-ca-file (CN is
the user, O the groups), ServiceAccount tokens from the TokenRequest
subresource (kubectl create token) that expire and die with their
ServiceAccount, and the admin token. The real kubectl 1.32 talks to it.
"""
import json
import os
import ssl
import subprocess
import time
import urllib.error
import urllib.request

import pytest

from apiserver.tls import issue, make_ca
from cohorttest import ApiServer, Kubectl, make_tmp, remove_tmp, wait_until

SA = "/api/v1/namespaces/default/serviceaccounts"


@pytest.fixture
def fresh_tmp():
    tmp = make_tmp("cohort-auth-")
    yield tmp
    remove_tmp(tmp)


def kubectl_or_skip(server, tmp):
    k = Kubectl(server, tmp)
    if not k.available():
        pytest.skip("kubectl is not in build/tools: %s" % k.why_missing)
    return k


def get(url, ctx, token=None, cert=None):
    """(status, parsed body) of a GET over TLS, with an optional client
    certificate (a (crt, key) pair)."""
    if cert:
        ctx.load_cert_chain(*cert)
    req = urllib.request.Request(url)
    if token:
        req.add_header("Authorization", "Bearer " + token)
    try:
        with urllib.request.urlopen(req, timeout=30, context=ctx) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_tls_with_a_generated_ca_serves_kubectl(fresh_tmp):
    srv = ApiServer(fresh_tmp, "--tls", "--token", "admin-secret")
    try:
        text = open(srv.kubeconfig).read()
        assert "server: https://127.0.0.1:%d" % srv.port in text
        assert "certificate-authority-data: " in text
        k = kubectl_or_skip(srv, fresh_tmp)
        assert "default" in k("get", "namespaces", "-o", "name").stdout
        # Plain HTTP to a TLS port is no API call.
        with pytest.raises((OSError, urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen("http://127.0.0.1:%d/api" % srv.port, timeout=10).read()
        # A client that does not trust the CA fails the handshake.
        with pytest.raises(urllib.error.URLError) as e:
            urllib.request.urlopen(srv.url + "/api", timeout=10)
        assert "CERTIFICATE_VERIFY_FAILED" in str(e.value)
        srv.default_token = "admin-secret"
        assert srv.call("GET", "/api/v1/namespaces")[0] == 200
        assert srv.call("GET", "/api/v1/namespaces", token="")[0] == 401
    finally:
        srv.stop()


def test_client_certificates_name_the_user_and_groups(fresh_tmp):
    ca = make_ca(fresh_tmp, "clients", "clients-ca")
    alice = issue(ca, fresh_tmp, "alice", "alice", groups=("devs", "ops"))
    other_ca = make_ca(fresh_tmp, "other", "other-ca")
    mallory = issue(other_ca, fresh_tmp, "mallory", "mallory", groups=("system:masters",))
    srv = ApiServer(fresh_tmp, "--tls", "--token", "admin-secret", "--client-ca-file", ca[0])
    try:
        def ctx():
            return ssl.create_default_context(cafile=os.path.join(fresh_tmp, "ca.crt"))
        assert get(srv.url + "/api/v1/namespaces", ctx(), cert=alice)[0] == 200
        assert get(srv.url + "/api/v1/namespaces", ctx())[0] == 401
        # A certificate from a CA the server does not trust gets no session.
        with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
            get(srv.url + "/api/v1/namespaces", ctx(), cert=mallory)
        users = [r.get("user") for r in srv.requests()]
        assert "alice" in users and "mallory" not in users
        # kubectl with client-certificate/client-key in its kubeconfig.
        kc = os.path.join(fresh_tmp, "alice.kubeconfig")
        subprocess.run(["cp", srv.kubeconfig, kc], check=True)
        k = kubectl_or_skip(srv, fresh_tmp)
        k.env["KUBECONFIG"] = kc
        k("config", "set-credentials", "cohort-standin", "--token=",
          "--client-certificate=" + alice[0], "--client-key=" + alice[1])
        assert "default" in k("get", "namespaces", "-o", "name").stdout
    finally:
        srv.stop()


def test_service_account_tokens(fresh_tmp):
    srv = ApiServer(fresh_tmp, "--tls", "--token", "admin-secret", "--min-token-expiration", "2")
    srv.default_token = "admin-secret"
    try:
        k = kubectl_or_skip(srv, fresh_tmp)
        k("create", "serviceaccount", "bob")
        r = k("create", "token", "bob", check=False)
        assert r.returncode == 0, r.stderr
        token = r.stdout.strip()
        assert srv.call("GET", "/api/v1/namespaces", token=token)[0] == 200
        assert srv.requests()[-1]["user"] == "system:serviceaccount:default:bob"
        # The TokenRequest as the API answers it.
        tr = srv.ok("POST", SA + "/bob/token", {"apiVersion": "authentication.k8s.io/v1",
                                                "kind": "TokenRequest",
                                                "spec": {"expirationSeconds": 2}})
        assert tr["kind"] == "TokenRequest" and tr["spec"]["expirationSeconds"] == 2
        assert tr["status"]["expirationTimestamp"].endswith("Z")
        short = tr["status"]["token"]
        assert srv.call("GET", "/api/v1/namespaces", token=short)[0] == 200
        wait_until(lambda: srv.call("GET", "/api/v1/namespaces", token=short)[0] == 401,
                   "the 2 s token to expire")
        code, st, _ = srv.call("POST", SA + "/bob/token", {"spec": {"expirationSeconds": 1}})
        assert code == 422 and st["reason"] == "Invalid"
        assert "spec.expirationSeconds: Invalid value: 1: may not specify a duration less " \
               "than 2 seconds" in st["message"]
        code, st, _ = srv.call("POST", SA + "/nobody/token", {})
        assert code == 404 and st["message"] == 'serviceaccounts "nobody" not found'
        # Bound to the ServiceAccount: deleting it ends the token, and a new
        # ServiceAccount of the same name does not revive it.
        k("delete", "serviceaccount", "bob")
        k("create", "serviceaccount", "bob")
        code, st, _ = srv.call("GET", "/api/v1/namespaces", token=token)
        assert code == 401 and st["reason"] == "Unauthorized"
        assert srv.call("GET", "/api/v1/namespaces", token="made-up")[0] == 401
    finally:
        srv.stop()


def test_kubectl_create_token_honours_the_real_minimum(fresh_tmp):
    # kubectl sends no bearer token over plain http: tokens need --tls.
    srv = ApiServer(fresh_tmp, "--tls", "--token", "admin-secret")
    try:
        k = kubectl_or_skip(srv, fresh_tmp)
        k("create", "serviceaccount", "carol")
        r = k("create", "token", "carol", "--duration", "60s", check=False)
        assert r.returncode != 0
        assert "may not specify a duration less than 10 minutes" in r.stderr
        r = k("create", "token", "carol", "--duration", "15m", "-o", "json", check=False)
        assert r.returncode == 0, r.stderr
        tr = json.loads(r.stdout)
        assert tr["spec"]["expirationSeconds"] == 900
        assert tr["status"]["expirationTimestamp"] > time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                   time.gmtime())
    finally:
        srv.stop()

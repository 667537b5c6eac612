"""cohort-operator's authentication against an API server that checks it
as Kubernetes does (the stand-in over HTTPS, enforcing RBAC): a kubeconfig
exec credential plugin (tests/kube/execplugin.py, a real process issuing
short-lived ServiceAccount tokens) run again before each token expires and
on a 401; client certificates; and an authentication the operator cannot
do, which ends it with one clear line and a non-zero exit, at start and
when a running operator loses its credential.
"""
import base64
import json
import os
import subprocess
import sys

import pytest

from apiserver.tls import issue, make_ca
from cohorttest import (CRD_FILE, DEADLINE, ApiServer, Kubectl, Operator, bin_dir, free_port,
                        make_tmp, remove_tmp, wait_until)

HERE = os.path.dirname(os.path.abspath(__file__))
ADMIN = "cohort-standin"


class Env:
    pass


@pytest.fixture
def env():
    if not os.access(os.path.join(bin_dir(), "cohort-operator"), os.X_OK):
        pytest.skip("no cohort-operator in %s" % bin_dir())
    e = Env()
    e.tmp = make_tmp("opauth-")
    e.client_ca = make_ca(e.tmp, "clients", "clients-ca")
    e.server = ApiServer(e.tmp, "--tls", "--authorization-mode", "RBAC",
                         "--client-ca-file", e.client_ca[0], "--min-token-expiration", "4")
    e.server.default_token = ADMIN
    e.kubectl = Kubectl(e.server, e.tmp)
    e.ops = []
    try:
        if not e.kubectl.available():
            pytest.skip("kubectl is not in build/tools")
        e.kubectl("apply", "-f", CRD_FILE)
        e.kubectl("wait", "--for", "condition=Established", "crd/trainingcohorts.cohort.dev")
        e.kubectl("create", "serviceaccount", "op")
        e.kubectl("create", "clusterrolebinding", "op-admin", "--clusterrole=cluster-admin",
                  "--serviceaccount=default:op", "--user=cohort-op")
        yield e
    finally:
        for op in e.ops:
            if op.p.poll() is None:
                op.stop()
        e.server.stop()
        remove_tmp(e.tmp)


def kubeconfig(e, name, user):
    """A kubeconfig (JSON, which is YAML too) for the stand-in with `user`."""
    with open(os.path.join(e.tmp, "ca.crt"), "rb") as f:
        ca = base64.b64encode(f.read()).decode()
    path = os.path.join(e.tmp, name)
    with open(path, "w") as f:
        json.dump({"apiVersion": "v1", "kind": "Config", "current-context": "c",
                   "clusters": [{"name": "c", "cluster": {"server": e.server.url,
                                                          "certificate-authority-data": ca}}],
                   "users": [{"name": "u", "user": user}],
                   "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u",
                                                          "namespace": "default"}}]}, f)
    return path


def plugin_user(e, api_version="client.authentication.k8s.io/v1", fail_file=None):
    env = {"EXECPLUGIN_CA": os.path.join(e.tmp, "ca.crt"), "EXECPLUGIN_ADMIN_TOKEN": ADMIN,
           "EXECPLUGIN_SA": "default/op", "EXECPLUGIN_SECONDS": "4",
           "EXECPLUGIN_LOG": os.path.join(e.tmp, "plugin.log"),
           "EXECPLUGIN_FAIL": fail_file or os.path.join(e.tmp, "no-such-file")}
    return {"exec": {"apiVersion": api_version, "command": sys.executable,
                     "args": [os.path.join(HERE, "execplugin.py")],
                     "env": [{"name": k, "value": v} for k, v in env.items()],
                     "interactiveMode": "Never", "provideClusterInfo": True}}


def runs(e):
    try:
        with open(os.path.join(e.tmp, "plugin.log")) as f:
            return len(f.read().splitlines())
    except OSError:
        return 0


def start_operator(e, path, name="op-a"):
    cfg = Env()
    cfg.kubeconfig = path
    op = Operator(cfg, e.tmp, name, free_port())
    e.ops.append(op)
    wait_until(lambda: op.metrics().get("is_leader") == 1, "%s to lead" % name)
    return op


def sa_requests(e):
    return [r for r in e.server.requests() if r.get("user") == "system:serviceaccount:default:op"]


def test_exec_plugin_tokens_are_fetched_again_before_expiry_and_after_a_401(env):
    e = env
    op = start_operator(e, kubeconfig(e, "exec.kubeconfig", plugin_user(e)))
    # Tokens live 4 s: the operator keeps working across several, fetching
    # each before the last expires, so the server refuses nothing.
    first = runs(e)
    wait_until(lambda: runs(e) >= first + 3, "three more plugin runs")
    assert not [r for r in e.server.requests() if r["code"] == 401]
    assert sa_requests(e), "the operator's requests were not the ServiceAccount's"
    # Revoked under it: the ServiceAccount is made again, its tokens die.
    # The next request's 401 runs the plugin at once, and the new token works.
    e.kubectl("delete", "serviceaccount", "op")
    e.kubectl("create", "serviceaccount", "op")
    wait_until(lambda: [r for r in e.server.requests() if r["code"] == 401],
               "a request with the revoked token to get 401")
    n = len(e.server.requests())
    wait_until(lambda: [r for r in e.server.requests()[n:] if r["code"] == 200 and
                        r.get("user") == "system:serviceaccount:default:op"],
               "the operator to get through with a new token")
    assert op.p.poll() is None and op.metrics().get("is_leader") == 1
    assert "Lost the credential" not in op.text()


def test_v1beta1_plugins_work_too(env):
    e = env
    start_operator(e, kubeconfig(e, "beta.kubeconfig",
                                 plugin_user(e, "client.authentication.k8s.io/v1beta1")))
    assert runs(e) >= 1


def test_client_certificates_authenticate_the_operator(env):
    e = env
    crt, key = issue(e.client_ca, e.tmp, "op", "cohort-op")
    op = start_operator(e, kubeconfig(e, "cert.kubeconfig",
                                      {"client-certificate": crt, "client-key": key}))
    assert [r for r in e.server.requests() if r.get("user") == "cohort-op"]
    with open(crt) as f:
        cert_pem = f.read().encode()
    with open(key) as f:
        key_pem = f.read().encode()
    assert op.stop() == 0           # the next one leads once it is gone
    op2 = start_operator(e, kubeconfig(e, "certdata.kubeconfig", {
        "client-certificate-data": base64.b64encode(cert_pem).decode(),
        "client-key-data": base64.b64encode(key_pem).decode()}), "op-b")
    assert op2.p.poll() is None
    assert len([r for r in e.server.requests() if r.get("user") == "cohort-op"]) > 2


def run_to_exit(e, path):
    """Runs the operator to its end: (exit status, its log)."""
    p = subprocess.run([os.path.join(bin_dir(), "cohort-operator"), "--kubeconfig", path,
                        "--identity", "x", "--listen", "127.0.0.1:%d" % free_port(),
                        "--metrics-listen", "127.0.0.1:0", "--api-timeout", "2s"],
                       capture_output=True, text=True, timeout=DEADLINE)
    return p.returncode, p.stdout + p.stderr


def error_lines(text):
    return [ln for ln in text.splitlines() if " error " in ln]


@pytest.mark.parametrize("case", ["plugin-fails", "bad-token", "bad-key", "interactive"])
def test_an_authentication_that_cannot_work_ends_the_operator_at_start(env, case):
    e = env
    if case == "plugin-fails":
        fail = os.path.join(e.tmp, "fail")
        with open(fail, "w") as f:
            f.write("the cloud says no\n")
        user, want = plugin_user(e, fail_file=fail), "exited with status 1"
    elif case == "bad-token":
        user, want = {"token": "not-a-token"}, "HTTP 401 Unauthorized: Unauthorized"
    elif case == "bad-key":
        crt, _ = issue(e.client_ca, e.tmp, "op", "cohort-op")
        garbage = os.path.join(e.tmp, "garbage.key")
        with open(garbage, "w") as f:
            f.write("-----BEGIN PRIVATE KEY-----\nbm9wZQ==\n-----END PRIVATE KEY-----\n")
        user, want = {"client-certificate": crt, "client-key": garbage}, "certificate"
    else:
        user = plugin_user(e)
        user["exec"]["interactiveMode"] = "Always"
        want = "interactiveMode Always"
    rc, text = run_to_exit(e, kubeconfig(e, case + ".kubeconfig", user))
    assert rc != 0, text
    errs = error_lines(text)
    assert errs and want in errs[-1], text
    assert len(errs) == 1, text
    if case == "plugin-fails":
        assert "the cloud says no" in text          # the plugin's stderr is in the log


def test_a_running_operator_that_loses_its_credential_exits(env):
    e = env
    token = e.kubectl("create", "token", "op", "--duration", "1h").stdout.strip()
    op = start_operator(e, kubeconfig(e, "static.kubeconfig", {"token": token}))
    e.kubectl("delete", "serviceaccount", "op")
    rc = wait_until(lambda: op.p.poll(), "the operator to exit")
    assert rc != 0
    lines = [ln for ln in op.text().splitlines() if "Lost the credential" in ln]
    assert len(lines) == 1 and "HTTP 401 Unauthorized" in lines[0], op.text()[-3000:]

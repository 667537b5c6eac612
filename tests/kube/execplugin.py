#!/usr/bin/env python3
"""A kubeconfig exec credential plugin for the operator's tests: it asks the
API server stand-in for a short-lived ServiceAccount token (TokenRequest,
with the admin token) and prints it as an ExecCredential with its
expirationTimestamp.

The server comes from KUBERNETES_EXEC_INFO's spec.cluster (the kubeconfig
sets provideClusterInfo), so the test proves that too. The rest comes from
the environment the kubeconfig's exec.env gives it: EXECPLUGIN_CA (the
server's CA file), EXECPLUGIN_ADMIN_TOKEN, EXECPLUGIN_SA ("ns/name"),
EXECPLUGIN_SECONDS, EXECPLUGIN_LOG (a line per run is appended) and
EXECPLUGIN_FAIL (when that file exists, the plugin fails: its content on
stderr, exit status 1).
"""
import json
import os
import ssl
import sys
import urllib.request


def main():
    env = os.environ
    with open(env["EXECPLUGIN_LOG"], "a") as f:
        f.write("run\n")
    fail = env.get("EXECPLUGIN_FAIL")
    if fail and os.path.exists(fail):
        with open(fail) as f:
            sys.stderr.write(f.read())
        return 1
    info = json.loads(env["KUBERNETES_EXEC_INFO"])
    server = info["spec"]["cluster"]["server"]
    ns, name = env["EXECPLUGIN_SA"].split("/")
    body = json.dumps({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                       "spec": {"expirationSeconds": int(env["EXECPLUGIN_SECONDS"])}}).encode()
    req = urllib.request.Request("%s/api/v1/namespaces/%s/serviceaccounts/%s/token" %
                                 (server, ns, name), data=body, method="POST")
    req.add_header("Content-Type", "application/json")
    req.add_header("Authorization", "Bearer " + env["EXECPLUGIN_ADMIN_TOKEN"])
    ctx = ssl.create_default_context(cafile=env["EXECPLUGIN_CA"])
    with urllib.request.urlopen(req, timeout=30, context=ctx) as r:
        tr = json.loads(r.read())
    json.dump({"apiVersion": info["apiVersion"], "kind": "ExecCredential",
               "status": {"token": tr["status"]["token"],
                          "expirationTimestamp": tr["status"]["expirationTimestamp"]}},
              sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())

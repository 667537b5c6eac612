"""The command line: flags, the kubeconfig and port file it writes, and
serving until interrupted. tests/kube/apiserver.py runs main().
"""
import argparse
import base64
import os
import sys
import threading

from .rbac import Authorizer, bootstrap
from .resources import OPTIONAL_APIS
from .server import Server
from .store import Store
from .tls import server_context, serving_files


def kubeconfig_text(server_url, token, token_file=None, ca_file=None):
    user = "    tokenFile: %s\n" % token_file if token_file else "    token: %s\n" % token
    ca = ""
    if ca_file:
        with open(ca_file, "rb") as f:
            ca = "    certificate-authority-data: %s\n" % base64.b64encode(f.read()).decode()
    return ("apiVersion: v1\nkind: Config\n"
            "clusters:\n- name: cohort-standin\n  cluster:\n    server: %s\n%s"
            "users:\n- name: cohort-standin\n  user:\n%s"
            "contexts:\n- name: cohort-standin\n  context:\n    cluster: cohort-standin\n"
            "    user: cohort-standin\n    namespace: default\n"
            "current-context: cohort-standin\n" % (server_url, ca, user))


def write_atomic(path, text):
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = "%s.%d.tmp" % (path, os.getpid())
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def service_ip_block(text):
    try:
        block = int(text)
    except ValueError:
        block = -1
    if not 0 <= block <= 255:
        raise argparse.ArgumentTypeError("a block is 0 to 255, not %r" % text)
    return block


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="Kubernetes API server stand-in for cohort's tests.")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=0, help="port; 0 picks a free one (default)")
    ap.add_argument("--port-file", help="write the bound port here once listening")
    ap.add_argument("--kubeconfig", help="write a kubeconfig pointing at this server here")
    ap.add_argument("--token", help="require this bearer token (default: accept any)")
    ap.add_argument("--token-file", help="require the token in this file, re-read on change; "
                    "the kubeconfig then names the file (tokenFile)")
    ap.add_argument("--tls-cert-file", help="serve HTTPS with this certificate (PEM); needs "
                    "--tls-private-key-file")
    ap.add_argument("--tls-private-key-file", help="the key of --tls-cert-file (PEM)")
    ap.add_argument("--tls", action="store_true",
                    help="serve HTTPS with a CA and a serving certificate for 127.0.0.1 and "
                    "localhost made into --cert-dir (kept there when present); the kubeconfig "
                    "then carries the CA as certificate-authority-data")
    ap.add_argument("--cert-dir", help="where --tls makes its ca.crt, ca.key, apiserver.crt and "
                    "apiserver.key (default: the kubeconfig's folder, else the current one)")
    ap.add_argument("--client-ca-file", help="verify client certificates against this CA bundle; "
                    "a verified certificate authenticates its CN as the user and each O as a "
                    "group, as kube-apiserver does")
    ap.add_argument("--kubeconfig-ca-file", help="with --tls-cert-file: the CA the written "
                    "kubeconfig trusts (certificate-authority-data)")
    ap.add_argument("--min-token-expiration", type=int, default=600,
                    help="the shortest expirationSeconds a TokenRequest may ask for (default "
                    "600, the real server's 10 minutes; tests lower it)")
    ap.add_argument("--authorization-mode", choices=("AlwaysAllow", "RBAC"),
                    default="AlwaysAllow",
                    help="AlwaysAllow (default) lets every authenticated request through; RBAC "
                    "enforces Roles, ClusterRoles and their bindings as Kubernetes does, with "
                    "its default discovery roles, and records which rule allowed each request "
                    "(/debug/cohort/rbac)")
    ap.add_argument("--enable-admission-plugins", type=lambda v: [p for p in v.split(",") if p],
                    default=[], help="OwnerReferencesPermissionEnforcement (with RBAC): a new "
                    "blockOwnerDeletion ownerReference needs update on the owner's finalizers, "
                    "changing ownerReferences of an existing object needs delete on it")
    ap.add_argument("--http-kubeconfig", help="with TLS: also serve plain HTTP on a second free "
                    "port (same objects, same authentication and authorization, like the old "
                    "--insecure-port but not exempt from them) and write a kubeconfig for it "
                    "here, for clients that speak only HTTP (the process kubelet)")
    ap.add_argument("--service-ip-block", type=service_ip_block, default=0,
                    metavar="B", help="Services get clusterIPs from 127.96.B.0/24 (the "
                    "kubernetes Service .1, others .10 upward), so that clusters side by side "
                    "on one machine never share one (0 to 255, default 0)")
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
    ap.add_argument("--runtime-config", default="",
                    help="GROUP/VERSION=true,... : optional APIs to serve, as kube-apiserver's "
                    "flag; known: resource.k8s.io/v1beta1 (off by default, as in 1.32)")
    ap.add_argument("--quiet", action="store_true", help="no per-request log lines")
    return ap.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    unknown = set(args.enable_admission_plugins) - {"OwnerReferencesPermissionEnforcement"}
    if unknown:
        raise SystemExit("apiserver: unknown admission plugins: %s" % ", ".join(sorted(unknown)))
    if args.tls and not args.cert_dir:
        args.cert_dir = os.path.dirname(os.path.abspath(args.kubeconfig)) if args.kubeconfig \
            else os.getcwd()
    apis = set()
    for item in (i for i in args.runtime_config.split(",") if i):
        gv, _, on = item.partition("=")
        if gv not in OPTIONAL_APIS or on not in ("", "true", "false"):
            raise SystemExit("apiserver: --runtime-config: unknown or malformed %r" % item)
        if on != "false":
            apis.add(gv)
    store = Store(args.history_size, args.strict_namespaces, apis, args.service_ip_block)
    server = Server((args.host, args.port), store, args)
    if args.authorization_mode == "RBAC":
        bootstrap(store)
        server.authz = Authorizer(store)
    cert, key, ca = serving_files(args)
    if cert:
        server.serve_tls(server_context(cert, key, args.client_ca_file))
    host, port = server.server_address[:2]
    url = "%s://%s:%d" % ("https" if cert else "http", host, port)
    if args.kubeconfig:
        write_atomic(args.kubeconfig, kubeconfig_text(url, args.token or "cohort-standin",
                                                      args.token_file,
                                                      ca or args.kubeconfig_ca_file))
    if args.http_kubeconfig:
        plain = Server((args.host, 0), store, args)
        plain.authn, plain.authz = server.authn, server.authz
        threading.Thread(target=plain.serve_forever, kwargs={"poll_interval": 0.2},
                         daemon=True).start()
        write_atomic(args.http_kubeconfig, kubeconfig_text(
            "http://%s:%d" % plain.server_address[:2], args.token or "cohort-standin",
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

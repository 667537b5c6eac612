"""The command line: flags, the kubeconfig and port file it writes, and
serving until interrupted. tests/kube/apiserver.py runs main().
"""
import argparse
import os
import sys

from .server import Server
from .store import Store


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

"""The command line: flags, then the node registered, the log server, the
Lease and the pod informer running until SIGTERM or SIGINT, and every
pod's processes stopped on the way out. tests/kube/kubelet.py runs main().
"""
import argparse
import faulthandler
import http.server
import os
import shutil
import signal
import threading

from .api import Client, read_kubeconfig
from .common import log
from .logs import LogHandler
from .node import Kubelet


def main(argv=None):
    ap = argparse.ArgumentParser(description="Runs the stand-in API server's pods as local "
                                 "processes or podman containers.")
    ap.add_argument("--kubeconfig", help="kubeconfig naming the API server (and token)")
    ap.add_argument("--server", help="API server URL, e.g. http://127.0.0.1:PORT (instead of "
                    "--kubeconfig)")
    ap.add_argument("--token", help="bearer token (with --server)")
    ap.add_argument("--node-name", default="cohort-node", help="this node's name "
                    "(default cohort-node)")
    ap.add_argument("--logs-dir", required=True, help="container logs go under here, one "
                    "directory per pod")
    ap.add_argument("--state-dir", help="pod volumes go under here (default: a new temp dir)")
    ap.add_argument("--pod-ip-prefix", default="127.0.0", help="pods get PREFIX.2 to PREFIX.254 "
                    "(default 127.0.0)")
    ap.add_argument("--backoff-initial", type=float, default=10.0, help="first restart back-off "
                    "in seconds, doubling after each crash (default 10, as in Kubernetes)")
    ap.add_argument("--backoff-max", type=float, default=300.0, help="longest restart back-off "
                    "(default 300)")
    ap.add_argument("--pass-env", action="append", metavar="NAME", help="also pass this variable "
                    "from the kubelet's environment to every container (repeatable)")
    ap.add_argument("--port-file", help="write the log server's port here once registered")
    ap.add_argument("--no-processes", action="store_true", help="run nothing: report every pod "
                    "Running and Ready at once, and remove deleted pods at once (for benchmarks "
                    "of the control plane)")
    ap.add_argument("--runtime", choices=("process", "podman"), default="process",
                    help="process (default): each container is a local process found on PATH; "
                    "podman: each container is a `podman run` of its image on the host's "
                    "network (podman must work; CONTAINERS_CONF, else the one scripts/image.sh "
                    "--conf writes, build/podman/containers.conf)")
    args = ap.parse_args(argv)
    if args.no_processes and args.runtime != "process":
        ap.error("--no-processes runs nothing; it takes no --runtime")
    if args.kubeconfig:
        server, token, token_file, ca = read_kubeconfig(args.kubeconfig)
    elif args.server:
        server, token, token_file, ca = args.server, args.token, None, None
    else:
        ap.error("--kubeconfig or --server is required")
    api = Client(server, token, token_file, ca)
    k = Kubelet(args, api)

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), LogHandler)
    httpd.daemon_threads = True
    httpd.kubelet = k
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    k.register(httpd.server_address[1])
    threading.Thread(target=k.lease_loop, daemon=True).start()
    if k.net:
        k.net.start()
    threading.Thread(target=k.informer, daemon=True).start()
    log("node %s registered with %s; %s runtime, container logs under %s, volumes under %s" %
        (k.node, server, k.runtime.name, k.logs_dir, k.state_dir))
    if args.port_file:
        with open(args.port_file + ".tmp", "w") as f:
            f.write("%d\n" % httpd.server_address[1])
        os.replace(args.port_file + ".tmp", args.port_file)

    done = threading.Event()
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda *_: done.set())
    faulthandler.register(signal.SIGUSR1, all_threads=True)    # stacks, for debugging hangs
    # Wake up now and then: a signal the kernel hands to another thread only
    # runs its Python handler when the main thread runs Python code.
    while not done.wait(0.2):
        pass
    log("shutting down; stopping all pod processes")
    k.shutdown()
    if not args.state_dir:
        shutil.rmtree(k.state_dir, ignore_errors=True)

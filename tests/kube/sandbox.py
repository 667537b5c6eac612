#!/usr/bin/python3
"""A local stand-in cluster to try cohort with kubectl: the API server
stand-in, its controllers (Deployments, Endpoints, the kubernetes
Service), the process kubelet and the cohort operator. Runs in the
foreground until Ctrl-C, then stops everything it started (the kubelet
stops every pod's processes).

    tests/kube/sandbox.py [--port N] [--dir build/sandbox] [--in-cluster]
                          [--runtime podman]

By default the operator runs as a process beside the stand-in, with a
kubeconfig. --in-cluster runs it as a cluster would: the API server
serves TLS, and tests/kube/operator-in-cluster.yaml (a Deployment with
its ServiceAccount, and the broker Service) is applied, so the operator
is a pod that uses its ServiceAccount's token and trainer pods reach the
broker through the Service by name.

It writes DIR/kubeconfig and prints the export line and example kubectl
commands. Containers run as local processes found on PATH, with build/,
build/examples/ and build/tools/ put first, so the sidecar and the example
trainers built by `make` are used; DIR/bin, first on PATH, maps the
commands the example manifests name (cohort-example-logreg) to the
build's binaries. With --runtime podman the kubelet runs every container
as a podman container of its image instead (`make image` builds
localhost/cohort:dev, which the operator then gives its sidecars). What
the stand-in leaves out is listed in docs/sandbox.md.
"""
import argparse
import os
import shutil
import signal
import subprocess
import sys
import threading

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
PYTHON = sys.executable
# Run as a program, not under pytest: the test helpers' package is not on
# the path by itself.
sys.path.insert(0, os.path.join(ROOT, "tests", "lib"))
from cohorttest import (free_port, pod_path_dir, sidecar_speaks_tls, stop_process,  # noqa: E402
                        wait_until)


def say(msg):
    sys.stdout.write("sandbox: %s\n" % msg)
    sys.stdout.flush()


def relay(stream, prefix, logfile=None):
    """Copies a child's output to the terminal (and a file), line by line."""
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", "replace")
        if logfile:
            logfile.write(line)
            logfile.flush()
        if prefix is not None:
            sys.stdout.write(prefix + line)
            sys.stdout.flush()


def operator_command(path_env, kubeconfig):
    """The operator's command line, if the operator can talk to Kubernetes
    yet (its --help mentions --kubeconfig); None otherwise."""
    exe = shutil.which("cohort-operator", path=path_env)
    if not exe:
        return None, "no cohort-operator on PATH (run make)"
    try:
        out = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, "cohort-operator --help failed: %s" % e
    if "--kubeconfig" not in out.stdout + out.stderr:
        return None, "%s has no Kubernetes mode yet (no --kubeconfig in its --help)" % exe
    # The broker on a fixed loopback port, so that pods keep reaching it if
    # the operator is restarted; pods on 127.0.0.x reach 127.0.0.1. TLS
    # (the operator's default) only once the sidecar can speak it.
    port = free_port()
    cmd = [exe, "--kubeconfig", kubeconfig, "--listen", "127.0.0.1:%d" % port,
           "--broker-address", "127.0.0.1:%d" % port, "--metrics-listen", "127.0.0.1:0"]
    sidecar = shutil.which("cohort-sidecar", path=path_env)
    if not sidecar or not sidecar_speaks_tls(os.path.dirname(os.path.realpath(sidecar))):
        cmd += ["--broker-tls", "off"]
    return cmd, None


def main(argv=None):
    ap = argparse.ArgumentParser(description="Runs the Kubernetes stand-in for trying cohort "
                                 "with kubectl.")
    ap.add_argument("--dir", default=os.path.join(ROOT, "build", "sandbox"),
                    help="where the kubeconfig and logs go (default build/sandbox)")
    ap.add_argument("--port", type=int, default=0, help="API server port (default: a free one)")
    ap.add_argument("--token", help="make the API server require this bearer token")
    ap.add_argument("--no-operator", action="store_true", help="do not start cohort-operator")
    ap.add_argument("--in-cluster", action="store_true",
                    help="serve the API over TLS and run the operator as a Deployment pod "
                    "(tests/kube/operator-in-cluster.yaml) behind the broker Service")
    ap.add_argument("--runtime", choices=("process", "podman"), default="process",
                    help="how the kubelet runs containers: local processes found on PATH "
                    "(default), or podman containers of their images")
    ap.add_argument("--image", default="localhost/cohort:dev",
                    help="with --runtime podman, the image the operator started here gives "
                    "its sidecars (default localhost/cohort:dev, from `make image`)")
    ap.add_argument("--verbose", action="store_true",
                    help="also print the API server's request log (always in DIR/apiserver.log)")
    args = ap.parse_args(argv)

    sandbox = os.path.abspath(args.dir)
    os.makedirs(sandbox, exist_ok=True)
    kubeconfig = os.path.join(sandbox, "kubeconfig")
    port_file = os.path.join(sandbox, "apiserver.port")
    for stale in (kubeconfig, port_file):
        if os.path.exists(stale):
            os.remove(stale)
    tools = os.path.join(ROOT, "build", "tools")
    # Commands the example manifests name, mapped to what make built, so
    # that manifests never carry build paths.
    cmd_dir = pod_path_dir(sandbox, os.path.join(ROOT, "build"))
    path_env = os.pathsep.join([cmd_dir, os.path.join(ROOT, "build"),
                                os.path.join(ROOT, "build", "examples"),
                                tools, os.environ.get("PATH", os.defpath)])
    if not os.access(os.path.join(tools, "kubectl"), os.X_OK):
        say("installing kubectl into build/tools")
        subprocess.run([os.path.join(ROOT, "scripts", "install-kubectl.sh")])

    if args.runtime == "podman" and subprocess.run(
            ["podman", "image", "exists", args.image], stdin=subprocess.DEVNULL).returncode != 0:
        say("%s is not in podman's store (make image builds localhost/cohort:dev); pods "
            "naming it will wait in ErrImagePull" % args.image)

    children = []
    stopping = threading.Event()

    def start(name, argv, env=None, prefix=None, logname=None):
        logfile = open(os.path.join(sandbox, logname), "w") if logname else None
        # Own sessions: Ctrl-C reaches only this script, which then stops
        # the children in order (operator, kubelet, API server).
        p = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, start_new_session=True)
        threading.Thread(target=relay, args=(p.stdout, prefix, logfile), daemon=True).start()
        children.append((name, p))
        return p

    def stop_all():
        stopping.set()
        for name, p in reversed(children):     # operator, kubelet, controllers, API server
            if p.poll() is None and stop_process(p, 20) == -signal.SIGKILL:
                say("%s did not stop in 20 s; killed it" % name)
        for f in (kubeconfig, port_file):
            if os.path.exists(f):
                os.remove(f)

    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    try:
        api_argv = [PYTHON, os.path.join(HERE, "apiserver.py"), "--port", str(args.port),
                    "--port-file", port_file, "--kubeconfig", kubeconfig]
        if args.token:
            api_argv += ["--token", args.token]
        if args.in_cluster:
            api_argv += ["--tls"]
        api = start("apiserver", api_argv, prefix="" if args.verbose else None,
                    logname="apiserver.log")
        try:
            wait_until(lambda: os.path.exists(port_file) or api.poll() is not None,
                       "the API server's port file", timeout=30)
        except AssertionError:
            pass
        if api.poll() is not None or not os.path.exists(port_file):
            say("the API server did not start; see %s" % os.path.join(sandbox, "apiserver.log"))
            return 1
        with open(port_file) as f:
            port = int(f.read())
        env = dict(os.environ, PATH=path_env)
        start("controllers", [PYTHON, os.path.join(HERE, "controllers.py"), "--kubeconfig",
                              kubeconfig], prefix="", logname="controllers.log")
        start("kubelet", [PYTHON, os.path.join(HERE, "kubelet.py"), "--kubeconfig", kubeconfig,
                          "--logs-dir", os.path.join(sandbox, "logs"),
                          "--state-dir", os.path.join(sandbox, "state"),
                          "--runtime", args.runtime],
              env=env, prefix="", logname="kubelet.log")
        op_note = "not started (--no-operator)"
        if args.in_cluster and not args.no_operator:
            kubectl = [os.path.join(tools, "kubectl"), "--kubeconfig", kubeconfig]
            for f in (os.path.join(ROOT, "crds", "trainingcohorts.cohort.dev.yaml"),
                      os.path.join(HERE, "operator-in-cluster.yaml")):
                r = subprocess.run(kubectl + ["apply", "-f", f], capture_output=True, text=True,
                                   timeout=60)
                if r.returncode != 0:
                    say("kubectl apply -f %s failed: %s" % (f, r.stderr.strip()))
                    return 1
            op_note = ("a Deployment pod in cohort-system (kubectl -n cohort-system get "
                       "deploy,pods,endpoints)")
        elif not args.no_operator:
            cmd, why = operator_command(path_env, kubeconfig)
            if cmd and args.runtime == "podman":
                cmd += ["--sidecar-image", args.image]
            if cmd:
                start("cohort-operator", cmd, env=env, prefix="operator: ",
                      logname="operator.log")
                op_note = "running: " + " ".join(cmd)
            else:
                op_note = "not started: " + why
        rel = os.path.relpath(sandbox, os.getcwd())
        print("""
Kubernetes stand-in is up: API server %s://127.0.0.1:%d, node cohort-node.
cohort-operator: %s

  export KUBECONFIG=%s
  export PATH=%s:$PATH
  kubectl apply -f crds/trainingcohorts.cohort.dev.yaml
  kubectl apply -f examples/k8s/cohort.yaml
  kubectl get tc,pods -o wide
  kubectl scale tc/logreg --replicas=5
  kubectl get events --field-selector involvedObject.name=logreg
  kubectl logs logreg-0 -c trainer

Logs: %s/apiserver.log, %s/kubelet.log, containers under %s/logs/.
Ctrl-C stops everything.
""" % ("https" if args.in_cluster else "http", port, op_note, kubeconfig, tools, rel, rel, rel))
        if args.runtime == "podman":
            print("""Containers run with podman: the example's trainer image is a placeholder, so
  sed 's|ghcr.io/cohort-dev/cohort-examples:latest|%s|' examples/k8s/cohort.yaml \\
      | kubectl apply -f -
""" % args.image)
        sys.stdout.flush()
        while not stopping.is_set():
            for name, p in children:
                if p.poll() is not None:
                    say("%s exited with %d; stopping the sandbox" % (name, p.returncode))
                    return 1
            stopping.wait(0.5)
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        say("stopping")
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        stop_all()


if __name__ == "__main__":
    sys.exit(main())

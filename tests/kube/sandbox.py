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
serves TLS and enforces RBAC, and the chart (charts/cohort) is installed
with the real helm into cohort-system as a user installs it, so the
operator is a Deployment of two pods that use the chart's ServiceAccount
under its roles, and trainer pods reach the broker through the Service by
name.

It writes DIR/kubeconfig and prints the export line and example kubectl
commands. Containers run as local processes found on PATH, with build/,
build/examples/ and build/tools/ put first, so the sidecar and the example
trainers built by `make` are used; DIR/bin, first on PATH, maps the
commands the example manifests name (cohort-example-logreg) to the
build's binaries. With --runtime podman the kubelet runs every container
as a podman container of its image instead: the sandbox first builds
localhost/cohort:dev from this tree with scripts/image.sh (seconds when
nothing changed) unless --image names another, and the operator, its
sidecars and the example's trainers run that image; with --in-cluster too
it is the chart's operator from the image. What the stand-in leaves out
is listed in docs/sandbox.md.
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
DEFAULT_IMAGE = "localhost/cohort:dev"
OPNS = "cohort-system"
# Run as a program, not under pytest: the test helpers' package is not on
# the path by itself.
sys.path.insert(0, os.path.join(ROOT, "tests", "lib"))
from cohorttest import (Helm, STANDIN_SETS, free_port, pod_path_dir,  # noqa: E402
                        sidecar_speaks_tls, stop_process, wait_until)


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
                    help="serve the API over TLS with RBAC enforced, and helm install the chart "
                    "charts/cohort into %s: the operator runs as its Deployment's pods, "
                    "behind the broker Service" % OPNS)
    ap.add_argument("--runtime", choices=("process", "podman"), default="process",
                    help="how the kubelet runs containers: local processes found on PATH "
                    "(default), or podman containers of their images")
    ap.add_argument("--image", default=DEFAULT_IMAGE,
                    help="with --runtime podman, the image the operator runs (--in-cluster) and "
                    "gives its sidecars (default %s, built from this tree first with "
                    "scripts/image.sh; another is used as it is)" % DEFAULT_IMAGE)
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

    if args.runtime == "podman":
        image_sh = os.path.join(ROOT, "scripts", "image.sh")
        r = subprocess.run([image_sh, "--conf"], capture_output=True, text=True)
        if r.returncode != 0:
            say("scripts/image.sh --conf failed: %s" % (r.stderr or r.stdout).strip())
            return 1
        os.environ["CONTAINERS_CONF"] = r.stdout.strip().splitlines()[-1]
        if args.image == DEFAULT_IMAGE:
            say("building %s from this tree with scripts/image.sh (seconds when nothing "
                "changed; the first build takes minutes)" % DEFAULT_IMAGE)
            if subprocess.run([image_sh], stdout=sys.stderr).returncode != 0:
                say("scripts/image.sh failed; see its output above")
                return 1
        elif subprocess.run(["podman", "image", "exists", args.image],
                            stdin=subprocess.DEVNULL).returncode != 0:
            say("%s is not in podman's store; pods naming it will wait in ErrImagePull"
                % args.image)

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
            # podman stops and removes each container with a command or two.
            limit = 60 if name == "kubelet" and args.runtime == "podman" else 20
            if p.poll() is None and stop_process(p, limit) == -signal.SIGKILL:
                say("%s did not stop in %d s; killed it" % (name, limit))
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
            api_argv += ["--tls", "--authorization-mode", "RBAC"]
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
            helm = Helm(kubeconfig, sandbox)
            if not helm.available():
                say("no helm in build/tools: %s" % helm.why_missing)
                return 1
            sets = []
            if args.runtime == "podman":
                repo, _, tag = args.image.rpartition(":")
                sets = ["image.repository=" + repo, "image.tag=" + tag]
            r = helm.install_cohort(*sets, release="cohort", namespace=OPNS, check=False)
            if r.returncode != 0:
                say("helm install failed: %s" % (r.stderr or r.stdout).strip())
                return 1
            op_note = ("the chart's Deployment in %s: helm install cohort charts/cohort -n %s "
                       "--create-namespace %s" % (OPNS, OPNS, " ".join(
                           "--set " + x for x in STANDIN_SETS + tuple(sets))))
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
        apply_example = "kubectl apply -f examples/k8s/cohort.yaml"
        if args.runtime == "podman":
            # The example names a placeholder trainer image; the built one
            # holds the example trainers too.
            apply_example = ("sed 's|ghcr.io/cohort-dev/cohort-examples:latest|%s|' "
                             "examples/k8s/cohort.yaml \\\n      | kubectl apply -f -" % args.image)
        lines = ["export KUBECONFIG=" + kubeconfig, "export PATH=%s:$PATH" % tools]
        if args.in_cluster and not args.no_operator:
            lines += ["helm status cohort -n %s" % OPNS,
                      "kubectl -n %s get deploy,pods,endpoints,lease -o wide" % OPNS,
                      apply_example, "kubectl get tc,pods -o wide",
                      "# the broker moves: delete the leading operator's pod (the Lease names "
                      "it);",
                      "# the standby takes over and the same trainer pods train on",
                      "kubectl -n %s delete pod \"$(kubectl -n %s get lease cohort-operator "
                      "-o jsonpath='{.spec.holderIdentity}')\"" % (OPNS, OPNS),
                      "kubectl get tc -w",
                      "helm uninstall cohort -n %s      # the CRD and cohorts stay" % OPNS]
        else:
            lines += ["kubectl apply -f crds/trainingcohorts.cohort.dev.yaml", apply_example,
                      "kubectl get tc,pods -o wide", "kubectl scale tc/logreg --replicas=5",
                      "kubectl get events --field-selector involvedObject.name=logreg",
                      "kubectl logs logreg-0 -c trainer"]
        print("""
Kubernetes stand-in is up: API server %s://127.0.0.1:%d, node cohort-node%s.
cohort-operator: %s

%s

Logs: %s/apiserver.log, %s/kubelet.log, containers under %s/logs/.
Ctrl-C stops everything.
""" % ("https" if args.in_cluster else "http", port,
       ", containers with podman" if args.runtime == "podman" else "", op_note,
       "\n".join("  " + ln for ln in lines), rel, rel, rel))
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

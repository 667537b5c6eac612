"""The Kubernetes stand-in's processes, each real and on loopback with
free ports: the API server (tests/kube/apiserver.py) with an HTTP client
of it, the process kubelet (tests/kube/kubelet.py), cohort-operator in
Kubernetes mode, and kubectl.

The kubelet finds pod commands on a PATH that starts with a directory of
symlinks: cohort-sidecar and cohort-example-logreg (build/examples/logreg),
so manifests name commands, never build paths.

The operator serves its broker with TLS by default; it is turned off
(--broker-tls off) when the sidecar built here cannot speak TLS to a
broker yet (no --broker-ca in its --help), so that the pods can still join.
"""
import itertools
import json
import os
import random
import re
import ssl
import subprocess
import sys
import urllib.error
import urllib.request

from .core import DEADLINE, ROOT, free_port, make_tmp, remove_tmp, tool_available, wait_until
from .procs import stop_process
from .programs import bin_dir

PYTHON = sys.executable
STANDIN = os.path.join(ROOT, "tests", "kube")
CRD_FILE = os.path.join(ROOT, "crds", "trainingcohorts.cohort.dev.yaml")
EXAMPLES = os.path.join(ROOT, "examples", "k8s")


def sidecar_speaks_tls(bindir=None):
    """Whether the sidecar in bindir takes --broker-ca (TLS to the broker)."""
    exe = os.path.join(bindir or bin_dir(), "cohort-sidecar")
    try:
        r = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=DEADLINE)
    except OSError:
        return False
    return "--broker-ca" in r.stdout


def pod_path_dir(tmp, bindir=None):
    """A directory of the commands pods run, for the front of PATH."""
    bindir = bindir or bin_dir()
    d = os.path.join(tmp, "bin")
    os.makedirs(d, exist_ok=True)
    for name, target in (("cohort-sidecar", os.path.join(bindir, "cohort-sidecar")),
                         ("cohort-operator", os.path.join(bindir, "cohort-operator")),
                         ("cohort-example-logreg", os.path.join(bindir, "examples", "logreg"))):
        link = os.path.join(d, name)
        if not os.path.lexists(link):
            os.symlink(target, link)
    return d


_service_blocks = itertools.count()


def service_ip_block():
    """A block of Service clusterIPs (127.96.B.0/24, the API server's
    --service-ip-block) that no other cluster of this test run is using:
    the kubelet's service proxy listens on those addresses, so two clusters
    alive at once in parallel test processes (pytest-xdist's workers gwN)
    must not share one. Each worker takes its own 32 blocks in turn; 0 is
    left to a sandbox."""
    try:
        worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:])
    except ValueError:
        worker = 0
    return 1 + (worker * 32 + next(_service_blocks) % 32) % 255


class ApiServer:
    """The API server stand-in as a child process on a free port, and a
    client of it. Its log is tmp/apiserver.log, its kubeconfig
    tmp/kubeconfig."""

    def __init__(self, tmp, *extra):
        self.dir = tmp
        self.kubeconfig = os.path.join(tmp, "kubeconfig")
        port_file = os.path.join(tmp, "apiserver.port")
        self.log = open(os.path.join(tmp, "apiserver.log"), "w")
        self.p = subprocess.Popen([PYTHON, os.path.join(STANDIN, "apiserver.py"), "--quiet",
                                   "--port-file", port_file, "--kubeconfig", self.kubeconfig,
                                   "--service-ip-block", str(service_ip_block()),
                                   *extra], stdout=self.log, stderr=subprocess.STDOUT)
        wait_until(lambda: os.path.exists(port_file) or self.p.poll() is not None,
                   "the API server's port file")
        assert self.p.poll() is None, open(self.log.name).read()
        with open(port_file) as f:
            self.port = int(f.read())
        # With --tls the server is https and its CA is tmp/ca.crt (its
        # --cert-dir defaults to the kubeconfig's folder).
        with open(self.kubeconfig) as f:
            self.tls = "server: https://" in f.read()
        self.url = "%s://127.0.0.1:%d" % ("https" if self.tls else "http", self.port)
        self.ssl_context = None
        if self.tls:
            self.ssl_context = ssl.create_default_context(cafile=os.path.join(tmp, "ca.crt"))
        self.default_token = None       # sent by call() when it is given no token

    def call(self, method, path, body=None, ctype="application/json", token=None, headers=None):
        """(status, parsed JSON body, response headers) of one request. A
        body that is bytes goes as it is, anything else as JSON; a reply
        that is not JSON comes back as text. token None sends
        default_token, "" none."""
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", ctype)
        token = self.default_token if token is None else token
        if token:
            req.add_header("Authorization", "Bearer " + token)
        for k, v in (headers or {}).items():
            req.add_header(k, v)
        try:
            with urllib.request.urlopen(req, timeout=DEADLINE, context=self.ssl_context) as r:
                raw = r.read()
                return r.status, (json.loads(raw) if raw.strip() else None), r.headers
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                doc = json.loads(raw) if raw.strip() else None
            except ValueError:
                doc = raw.decode()
            return e.code, doc, e.headers

    def ok(self, method, path, body=None, ctype="application/json", expect=(200, 201)):
        """The parsed body of a request that must succeed."""
        code, doc, _ = self.call(method, path, body, ctype)
        assert code in expect, "%s %s -> %d %s" % (method, path, code, doc)
        return doc

    def get(self, path):
        """The object or list at path, or None when the GET fails."""
        code, doc, _ = self.call("GET", path)
        return doc if code == 200 else None

    def requests(self):
        return self.call("GET", "/debug/cohort/requests")[1]

    def fault(self, **rule):
        assert self.call("POST", "/debug/cohort/faults", rule)[0] == 200

    def clear_faults(self):
        self.call("DELETE", "/debug/cohort/faults")

    def drop_watches(self):
        assert self.call("POST", "/debug/cohort/drop-watches", {})[0] == 200

    def stop(self):
        stop_process(self.p, 10)
        self.log.close()


class Kubelet:
    """The process kubelet against `server`. Pods get addresses in a random
    127.x.y.0/24, so that a sandbox or another test run on this machine
    (127.0.0.x by default) never hands out the same ones."""

    def __init__(self, server, tmp, *extra, ip_prefix=None):
        # Never 127.96: Services' clusterIPs are there.
        self.ip_prefix = ip_prefix or "127.%d.%d" % (random.choice([i for i in range(1, 255)
                                                                    if i != 96]),
                                                     random.randint(0, 255))
        self.log_path = os.path.join(tmp, "kubelet.log")
        self.log = open(self.log_path, "w")
        env = dict(os.environ, PATH=pod_path_dir(tmp) + os.pathsep + os.environ.get("PATH", ""))
        self.p = subprocess.Popen([PYTHON, os.path.join(STANDIN, "kubelet.py"), "--kubeconfig",
                                   server.kubeconfig, "--logs-dir", os.path.join(tmp, "logs"),
                                   "--state-dir", os.path.join(tmp, "st"),
                                   "--pod-ip-prefix", self.ip_prefix,
                                   "--backoff-initial", "0.2", "--backoff-max", "1", *extra],
                                  stdout=self.log, stderr=subprocess.STDOUT, env=env)
        wait_until(lambda: server.call("GET", "/api/v1/nodes/cohort-node")[0] == 200,
                   "the kubelet to register its node")

    def pids(self, ns, pod):
        """The processes the kubelet started last for each container of a pod."""
        out = {}
        with open(self.log_path) as f:
            for line in f:
                m = re.search(r"%s/%s: started container (\S+) \(pid (\d+)" %
                              (re.escape(ns), re.escape(pod)), line)
                if m:
                    out[m.group(1)] = int(m.group(2))
        return out

    def stop(self):
        stop_process(self.p, 30)
        self.log.close()


class Operator:
    """cohort-operator in Kubernetes mode against `server`, run outside the
    cluster: pods are told its loopback broker address with
    --broker-address (in a cluster it is the broker Service's name). tls:
    True for the operator's default (--broker-tls auto), False for off,
    None for auto when the sidecar can speak TLS and off otherwise."""

    def __init__(self, server, tmp, name, broker_port, *extra, tls=None):
        self.name = name
        self.tls = sidecar_speaks_tls() if tls is None else tls
        if not self.tls:
            extra = ("--broker-tls", "off") + tuple(extra)
        self.log_path = os.path.join(tmp, "operator-%s.log" % name)
        self.log = open(self.log_path, "a")
        self.p = subprocess.Popen([os.path.join(bin_dir(), "cohort-operator"), "--kubeconfig",
                                   server.kubeconfig, "--identity", name,
                                   "--listen", "127.0.0.1:%d" % broker_port,
                                   "--broker-address", "127.0.0.1:%d" % broker_port,
                                   "--metrics-listen", "127.0.0.1:0",
                                   "--lease-duration", "3s", "--renew-deadline", "2s",
                                   "--retry-period", "500ms", "--status-period", "1s",
                                   "--resync", "5s", "--api-timeout", "2s", *extra],
                                  stdout=self.log, stderr=subprocess.STDOUT)
        self.metrics_port = wait_until(self._metrics_port, "operator %s to serve /metrics" % name)

    def _metrics_port(self):
        assert self.p.poll() is None, "operator %s exited:\n%s" % (self.name, self.text())
        m = re.findall(r"Serving /metrics.*address=127\.0\.0\.1:(\d+)", self.text())
        return int(m[-1]) if m else None

    def text(self):
        with open(self.log_path) as f:
            return f.read()

    def http(self, path):
        try:
            with urllib.request.urlopen("http://127.0.0.1:%d%s" % (self.metrics_port, path),
                                        timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def metrics(self):
        code, text = self.http("/metrics")
        assert code == 200
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                k, v = line.split()
                out[k.replace("cohort_operator_", "")] = float(v)
        return out

    def kill(self):
        self.p.kill()
        self.p.wait()

    def stop(self):
        rc = stop_process(self.p, 30)
        self.log.close()
        return rc


class Kubectl:
    """build/tools/kubectl (scripts/install-kubectl.sh puts it there)
    against `server`, with its cache under tmp."""

    def __init__(self, server, tmp):
        self.path = os.path.join(ROOT, "build", "tools", "kubectl")
        self.env = dict(os.environ, KUBECONFIG=server.kubeconfig,
                        KUBECACHEDIR=os.path.join(tmp, "kcache"))
        self.why_missing = None

    def available(self):
        """Installs kubectl if it is missing; False (and why_missing) when
        that fails."""
        ok, self.why_missing = tool_available(self.path)
        return ok

    def __call__(self, *args, check=True, stdin=None):
        r = subprocess.run([self.path, *args], env=self.env, capture_output=True, text=True,
                           timeout=DEADLINE, input=stdin)
        if check:
            assert r.returncode == 0, "kubectl %s failed: %s" % (" ".join(args), r.stderr)
        return r

    def json(self, *args):
        return json.loads(self(*args, "-o", "json").stdout)


class OperatorCluster:
    """What operator_cluster() yields: tmp, server, kubelet, kubectl,
    broker_port, and operators, op-a first (a test may add more)."""

    @property
    def op(self):
        """op-a, the operator the cluster started with."""
        return self.operators[0]


def operator_cluster(prefix, *server_args, tls=None):
    """The stand-in cluster the operator's suites start alike, as a
    generator for a module fixture: the API server (with server_args),
    the process kubelet, kubectl with the CRD established, and operator
    op-a (see Operator for tls) leading, in a new temp directory named
    with prefix. At the end every operator in c.operators is stopped and
    must exit 0, and the rest is stopped and removed. Skips the test
    without a cohort-operator binary or kubectl."""
    import pytest  # only the suites call this; the sandbox imports this module too

    if not os.access(os.path.join(bin_dir(), "cohort-operator"), os.X_OK):
        pytest.skip("no cohort-operator in %s (make asan, or set COHORT_BIN)" % bin_dir())
    c = OperatorCluster()
    c.tmp = make_tmp(prefix)
    c.server = ApiServer(c.tmp, "--bookmark-interval", "0.5", *server_args)
    c.kubelet = Kubelet(c.server, c.tmp)
    c.kubectl = Kubectl(c.server, c.tmp)
    c.operators = []
    try:
        if not c.kubectl.available():
            pytest.skip("kubectl is not in build/tools and scripts/install-kubectl.sh could not "
                        "fetch it")
        c.kubectl("apply", "-f", CRD_FILE)
        c.kubectl("wait", "--for", "condition=Established", "crd/trainingcohorts.cohort.dev")
        c.broker_port = free_port()
        c.operators.append(Operator(c.server, c.tmp, "op-a", c.broker_port, tls=tls))
        wait_until(lambda: c.op.metrics().get("is_leader") == 1, "op-a to lead")
        yield c
    finally:
        for op in c.operators:
            if op.p.poll() is None:
                rc = op.stop()
                assert rc == 0, "operator %s exited with %d:\n%s" % (op.name, rc, op.text()[-4000:])
        c.kubelet.stop()
        c.server.stop()
        remove_tmp(c.tmp)


def cohort_manifest(name, replicas, args=None, min_replicas=1, max_restarts=5, extra_spec=None):
    """A TrainingCohort running the C example trainer."""
    spec = {"replicas": replicas, "minReplicas": min_replicas, "maxRestarts": max_restarts,
            "timeouts": {"heartbeatInterval": "250ms", "memberTimeout": "2s"},
            "template": {"spec": {"terminationGracePeriodSeconds": 5, "containers": [{
                "name": "trainer", "image": "cohort-examples",
                "command": ["cohort-example-logreg"],
                "args": args or ["--steps", "10000000", "--delay", "20ms", "--log-every", "50",
                                 "--stall-timeout", "60s"]}]}}}
    spec.update(extra_spec or {})
    return {"apiVersion": "cohort.dev/v1alpha1", "kind": "TrainingCohort",
            "metadata": {"name": name, "namespace": "default"}, "spec": spec}


class Controllers:
    """The stand-in's controllers (tests/kube/controllers.py) against
    `server`: Deployments, Endpoints, the kubernetes Service and default
    ServiceAccounts. Its log is tmp/controllers.log."""

    def __init__(self, server, tmp):
        self.log_path = os.path.join(tmp, "controllers.log")
        self.log = open(self.log_path, "w")
        self.p = subprocess.Popen([PYTHON, os.path.join(STANDIN, "controllers.py"),
                                   "--kubeconfig", server.kubeconfig, "--resync", "2"],
                                  stdout=self.log, stderr=subprocess.STDOUT)
        wait_until(lambda: server.call("GET", "/api/v1/namespaces/default/endpoints/"
                                       "kubernetes")[0] == 200 or self.p.poll() is not None,
                   "the controllers to make the kubernetes Service")
        assert self.p.poll() is None, open(self.log_path).read()

    def stop(self):
        rc = stop_process(self.p, 10)
        self.log.close()
        return rc

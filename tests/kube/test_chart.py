"""Proves the Helm chart charts/cohort with the real helm 3.17 and kubectl
1.32 against the API server stand-in (tests/kube/apiserver/):

- `helm lint --strict` and `helm template` with the default values and
  each documented combination; every rendered object is accepted by the
  stand-in through `kubectl apply --dry-run=server`, and nothing is stored;
- what the rendered objects say: the operator's flags and environment, its
  probes, the broker Service's exact name, the "restricted" Pod Security
  Standard, which optional objects each combination makes;
- `helm install`, `helm upgrade` (a changed value reaches the objects: a
  strategic merge patch for built-in kinds, a JSON merge patch for the
  ServiceMonitor) and `helm uninstall` (objects gone, the CRD stays);
- broker.datagrams: its flag and policy rule, the real cohort-operator
  run with the rendered args and environment (its broker holds the
  declared UDP port, or none), and an upgrade from a chart that predates
  it (helm's port patch, the documented repair, turning it off and on);
- bad values refused by the schema, and a refused install leaves nothing;
- the stand-in refuses what the real API server refuses for the kinds the
  chart uses, with its messages, and a dry run stores nothing;
- the chart's CRD is the top-level crds/ file byte for byte, and its
  version is VERSION.

One stand-in (with --strict-namespaces, as a real cluster) for the module;
each combination is rendered once. helm and kubectl come from build/tools/
(scripts/install-kubectl.sh); the module is skipped, with the reason, only
when they cannot be had.
"""
import json
import os
import re
import shlex
import shutil
import subprocess
import urllib.request

import pytest
import yaml

from cohorttest import (CRD_FILE, DEADLINE, ROOT, ApiServer, Kubectl, bin_dir, free_port,
                        make_tmp, remove_tmp, stop_process, wait_until)

CHART = os.path.join(ROOT, "charts", "cohort")
HELM = os.path.join(ROOT, "build", "tools", "helm")
NS = "cohort-system"          # helm install's namespace
DRY_NS = "dry"                # the dry runs' release namespace: must stay empty
WATCHED = "ml"                # watchNamespace in the namespaced combinations

# The documented combinations (docs/install.md), as helm --set lists.
COMBOS = {
    "default": [],
    "namespaced": ["watchNamespace=" + WATCHED],
    "tls-off": ["broker.tls=off"],
    "networkpolicy": ["networkPolicy.enabled=true"],
    "networkpolicy-namespaced": ["networkPolicy.enabled=true", "watchNamespace=" + WATCHED],
    "servicemonitor": ["metrics.serviceMonitor.enabled=true",
                       "metrics.serviceMonitor.labels.release=prom"],
    "no-serviceaccount": ["serviceAccount.create=false", "serviceAccount.name=cohort-op"],
    "no-rbac": ["rbac.create=false"],
    "one-replica": ["operator.replicas=1", "podDisruptionBudget.enabled=true"],
    "pdb": ["podDisruptionBudget.enabled=true"],
    "sandbox": ["operator.listenOnPodIP=true",
                "operator.extraArgs={--lease-duration,5s,--renew-deadline,3s}"],
    "no-datagrams": ["broker.datagrams=false", "networkPolicy.enabled=true"],
}

# A small ServiceMonitor CRD, as a cluster with the Prometheus operator has
# (the fields the chart uses, from monitoring.coreos.com/v1's schema), so a
# misspelt field is refused (kubectl's dry run asks for strict validation).
SERVICEMONITOR_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "servicemonitors.monitoring.coreos.com"},
    "spec": {"group": "monitoring.coreos.com", "scope": "Namespaced",
             "names": {"kind": "ServiceMonitor", "listKind": "ServiceMonitorList",
                       "plural": "servicemonitors", "singular": "servicemonitor",
                       "shortNames": ["smon"]},
             "versions": [{"name": "v1", "served": True, "storage": True, "schema": {
                 "openAPIV3Schema": {"type": "object", "properties": {
                     "spec": {"type": "object", "required": ["selector"], "properties": {
                         "endpoints": {"type": "array", "items": {"type": "object", "properties": {
                             "port": {"type": "string"}, "path": {"type": "string"},
                             "interval": {"type": "string",
                                          "pattern": "^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?"
                                                     "(([0-9]+)ms)?)$"},
                             "scheme": {"type": "string", "enum": ["http", "https"]}}}},
                         "namespaceSelector": {"type": "object", "properties": {
                             "any": {"type": "boolean"},
                             "matchNames": {"type": "array", "items": {"type": "string"}}}},
                         "selector": {"type": "object", "properties": {
                             "matchLabels": {"type": "object",
                                             "additionalProperties": {"type": "string"}},
                             "matchExpressions": {"type": "array", "items": {
                                 "type": "object", "x-kubernetes-preserve-unknown-fields": True}}
                         }}}}}}}}]}}


class Helm:
    """build/tools/helm against the stand-in, its caches under tmp."""

    def __init__(self, server, tmp):
        self.env = dict(os.environ, KUBECONFIG=server.kubeconfig,
                        HELM_CACHE_HOME=os.path.join(tmp, "helm", "cache"),
                        HELM_CONFIG_HOME=os.path.join(tmp, "helm", "config"),
                        HELM_DATA_HOME=os.path.join(tmp, "helm", "data"))

    def __call__(self, *args, check=True):
        r = subprocess.run([HELM, *args], env=self.env, capture_output=True, text=True,
                           timeout=DEADLINE)
        if check:
            assert r.returncode == 0, "helm %s failed:\n%s%s" % (" ".join(args), r.stdout,
                                                                 r.stderr)
        return r


def sets(combo):
    out = []
    for s in COMBOS[combo]:
        out += ["--set", s]
    return out


@pytest.fixture(scope="module")
def env():
    tmp = make_tmp("cohort-chart-")
    srv = ApiServer(tmp, "--strict-namespaces")
    kubectl = Kubectl(srv, tmp)
    try:
        why = None
        if kubectl.available() and not os.access(HELM, os.X_OK):
            r = subprocess.run([os.path.join(ROOT, "scripts", "install-kubectl.sh")],
                               capture_output=True, text=True, timeout=600)
            why = r.stderr.strip() or r.stdout.strip()
        if not kubectl.available() or not os.access(HELM, os.X_OK):
            pytest.skip("kubectl or helm is missing from build/tools: %s" %
                        (kubectl.why_missing or why))
        for ns in (DRY_NS, WATCHED):
            kubectl("create", "namespace", ns)
        kubectl("apply", "-f", "-", stdin=json.dumps(SERVICEMONITOR_CRD))
        yield {"server": srv, "kubectl": kubectl, "helm": Helm(srv, tmp), "rendered": {}}
    finally:
        srv.stop()
        remove_tmp(tmp)


def render(env, combo):
    """`helm template` of one combination, once per module: (text, objects)."""
    if combo not in env["rendered"]:
        r = env["helm"]("template", "cohort", CHART, "--namespace", DRY_NS, *sets(combo))
        objs = [o for o in yaml.safe_load_all(r.stdout) if o]
        env["rendered"][combo] = (r.stdout, objs)
    return env["rendered"][combo]


def find(objs, kind, name=None):
    got = [o for o in objs if o["kind"] == kind and (name is None or
                                                     o["metadata"]["name"] == name)]
    return got


def one(objs, kind, name=None):
    got = find(objs, kind, name)
    assert len(got) == 1, "%d %s objects named %s" % (len(got), kind, name)
    return got[0]


def api_path(obj):
    """The URL path of an object, from its apiVersion, kind and metadata."""
    plural = obj["kind"].lower() + ("es" if obj["kind"].endswith("s") else "s")
    plural = {"networkpolicys": "networkpolicies"}.get(plural, plural)
    gv = obj["apiVersion"]
    ns = obj["metadata"].get("namespace")
    return "/%s/%s%s/%s/%s" % ("apis" if "/" in gv else "api", gv,
                               "/namespaces/" + ns if ns else "", plural,
                               obj["metadata"]["name"])


def operator_container(objs):
    return one(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]


def flags(args):
    """{"--flag": value} of an args list of flag/value pairs (bare flags: True)."""
    out, i = {}, 0
    while i < len(args):
        if i + 1 < len(args) and not args[i + 1].startswith("--"):
            out[args[i]] = args[i + 1]
            i += 2
        else:
            out[args[i]] = True
            i += 1
    return out


# ---------------------------------------------------------------------------
# The chart's files
# ---------------------------------------------------------------------------


def test_crd_is_the_top_level_one_byte_for_byte():
    name = "trainingcohorts.cohort.dev.yaml"
    with open(os.path.join(ROOT, "crds", name), "rb") as a, \
            open(os.path.join(CHART, "crds", name), "rb") as b:
        assert a.read() == b.read(), "charts/cohort/crds/%s differs from crds/%s: copy it" % (
            name, name)
    assert sorted(os.listdir(os.path.join(CHART, "crds"))) == [name]


def test_chart_version_is_VERSION():
    with open(os.path.join(ROOT, "VERSION")) as f:
        version = f.read().strip()
    with open(os.path.join(CHART, "Chart.yaml")) as f:
        chart = yaml.safe_load(f)
    assert chart["version"] == version
    assert chart["appVersion"] == version


def test_every_value_is_in_the_schema_and_commented():
    """values.yaml and values.schema.json name the same keys, and every
    key of values.yaml has a comment above it or its section."""
    with open(os.path.join(CHART, "values.yaml")) as f:
        text = f.read()
    values = yaml.safe_load(text)
    with open(os.path.join(CHART, "values.schema.json")) as f:
        schema = json.load(f)

    def walk(v, s, path):
        assert s.get("additionalProperties") is False, "%s: schema not strict" % path
        assert set(v) <= set(s["properties"]), "%s: %s not in the schema" % (
            path, set(v) - set(s["properties"]))
        for k, sub in v.items():
            ss = s["properties"][k]
            if isinstance(sub, dict) and ss.get("properties"):
                walk(sub, ss, path + "." + k)
    walk(values, schema, "")
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if re.match(r"^\s*[A-Za-z]+:", line):
            assert lines[i - 1].lstrip().startswith("#"), "values.yaml: %r has no comment" % line


# ---------------------------------------------------------------------------
# helm lint and helm template, every object accepted by the stand-in
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("combo", sorted(COMBOS))
def test_lint_strict(env, combo):
    r = env["helm"]("lint", "--strict", CHART, "--namespace", DRY_NS, *sets(combo))
    assert "0 chart(s) failed" in r.stdout


@pytest.mark.parametrize("combo", sorted(COMBOS))
def test_rendered_objects_pass_server_dry_run(env, combo):
    text, objs = render(env, combo)
    srv, kubectl = env["server"], env["kubectl"]
    before = srv.get("/api/v1/namespaces/%s/services" % DRY_NS)["metadata"]["resourceVersion"]
    r = kubectl("apply", "--dry-run=server", "-f", "-", "-o", "json", stdin=text)
    got = json.loads(r.stdout)
    items = got["items"] if got.get("kind") == "List" else [got]
    assert sorted((o["kind"], o["metadata"]["name"]) for o in items) == \
        sorted((o["kind"], o["metadata"]["name"]) for o in objs)
    # Defaulted as the server would store them; stored nowhere.
    deploy = next(o for o in items if o["kind"] == "Deployment")
    assert deploy["spec"]["revisionHistoryLimit"] == 10
    assert deploy["spec"]["template"]["spec"]["containers"][0]["terminationMessagePath"] == \
        "/dev/termination-log"
    for o in objs:
        assert srv.call("GET", api_path(o))[0] == 404, "%s %s was stored" % (
            o["kind"], o["metadata"]["name"])
    after = srv.get("/api/v1/namespaces/%s/services" % DRY_NS)["metadata"]["resourceVersion"]
    assert before == after, "a dry run moved the resourceVersion"


# ---------------------------------------------------------------------------
# What the rendered objects say
# ---------------------------------------------------------------------------


def test_operator_flags_and_environment(env):
    _, objs = render(env, "default")
    c = operator_container(objs)
    f = flags(c["args"])
    assert c["command"] == ["cohort-operator"]
    assert f == {"--in-cluster": True, "--lease-namespace": DRY_NS, "--listen": "0.0.0.0:7070",
                 "--metrics-listen": "0.0.0.0:8080", "--broker-tls": "auto",
                 "--broker-service": "cohort-broker", "--broker-ca-secret": "cohort-broker-ca",
                 "--sidecar-image": "ghcr.io/cohort-dev/cohort:0.1.0",
                 "--sidecar-pull-policy": "IfNotPresent", "--log-level": "info",
                 "--log-format": "text"}
    assert c["image"] == f["--sidecar-image"]
    assert {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in c["env"]} == {
        "POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace",
        "POD_IP": "status.podIP"}
    assert [(p["name"], p["containerPort"], p["protocol"]) for p in c["ports"]] == [
        ("broker", 7070, "TCP"), ("broker-udp", 7070, "UDP"), ("metrics", 8080, "TCP")]
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert c["resources"] == {"requests": {"cpu": "100m", "memory": "64Mi"},
                              "limits": {"memory": "256Mi"}}
    d = one(objs, "Deployment")
    assert d["spec"]["replicas"] == 2
    assert d["spec"]["template"]["spec"]["serviceAccountName"] == "cohort"
    assert d["spec"]["template"]["spec"]["automountServiceAccountToken"] is True
    # A rollout never waits for a standby to become Ready (it cannot).
    assert d["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == "100%"
    anti = d["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    assert anti["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"][
        "topologyKey"] == "kubernetes.io/hostname"

    _, objs = render(env, "namespaced")
    assert flags(operator_container(objs)["args"])["--namespace"] == WATCHED
    _, objs = render(env, "tls-off")
    assert flags(operator_container(objs)["args"])["--broker-tls"] == "off"
    _, objs = render(env, "no-serviceaccount")
    assert one(objs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == \
        "cohort-op"
    _, objs = render(env, "one-replica")
    assert one(objs, "Deployment")["spec"]["replicas"] == 1
    # The sandbox's pods share the host's network: each operator listens on
    # its own pod IP; extraArgs come last, as given.
    _, objs = render(env, "sandbox")
    args = operator_container(objs)["args"]
    assert flags(args)["--listen"] == "$(POD_IP):7070"
    assert flags(args)["--metrics-listen"] == "$(POD_IP):8080"
    assert args[-4:] == ["--lease-duration", "5s", "--renew-deadline", "3s"]


def test_broker_service_is_named_exactly_and_selects_the_operator(env):
    for combo in COMBOS:
        _, objs = render(env, combo)
        svc = one(objs, "Service", "cohort-broker")
        assert svc["metadata"]["namespace"] == DRY_NS
        assert svc["spec"]["type"] == "ClusterIP"
        assert svc["spec"]["publishNotReadyAddresses"] is False
        # broker-udp whatever broker.datagrams says (templates/service-broker.yaml).
        assert svc["spec"]["ports"] == [
            {"name": "broker", "port": 7070, "targetPort": "broker", "protocol": "TCP"},
            {"name": "broker-udp", "port": 7070, "targetPort": 7070, "protocol": "UDP"}]
        pod_labels = one(objs, "Deployment")["spec"]["template"]["metadata"]["labels"]
        assert svc["spec"]["selector"].items() <= pod_labels.items()
        metrics = one(objs, "Service", "cohort-metrics")
        assert metrics["spec"]["publishNotReadyAddresses"] is True
        assert metrics["spec"]["selector"].items() <= pod_labels.items()


def restricted_violations(pod_spec):
    """The checks of Kubernetes' "restricted" Pod Security Standard (v1.27
    and later: baseline plus restricted) that a pod spec fails."""
    bad = []
    psc = pod_spec.get("securityContext") or {}
    for k in ("hostNetwork", "hostPID", "hostIPC"):
        if pod_spec.get(k):
            bad.append(k)
    for v in pod_spec.get("volumes") or []:
        kinds = set(v) - {"name"}
        if not kinds <= {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                         "persistentVolumeClaim", "projected", "secret"}:
            bad.append("volume %s: %s" % (v["name"], kinds))
    if psc.get("sysctls"):
        bad.append("sysctls")
    conts = (pod_spec.get("containers") or []) + (pod_spec.get("initContainers") or [])
    for c in conts:
        sc = c.get("securityContext") or {}
        n = c["name"]
        if sc.get("privileged"):
            bad.append(n + ": privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            bad.append(n + ": allowPrivilegeEscalation must be false")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            bad.append(n + ": capabilities must drop ALL")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            bad.append(n + ": capabilities added")
        if not (sc.get("runAsNonRoot", psc.get("runAsNonRoot")) is True):
            bad.append(n + ": runAsNonRoot")
        if sc.get("runAsUser", psc.get("runAsUser")) == 0:
            bad.append(n + ": runAsUser 0")
        seccomp = (sc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            bad.append(n + ": seccompProfile")
        if any(p.get("hostPort") for p in c.get("ports") or []):
            bad.append(n + ": hostPort")
        if sc.get("procMount", "Default") != "Default":
            bad.append(n + ": procMount")
        if ((sc.get("seLinuxOptions") or {}).get("type") or "container_t") not in (
                "container_t", "container_init_t", "container_kvm_t", "container_engine_t"):
            bad.append(n + ": seLinuxOptions.type")
    return bad


@pytest.mark.parametrize("combo", sorted(COMBOS))
def test_pods_meet_the_restricted_pod_security_standard(env, combo):
    _, objs = render(env, combo)
    spec = one(objs, "Deployment")["spec"]["template"]["spec"]
    assert restricted_violations(spec) == []
    c = spec["containers"][0]["securityContext"]
    assert c["readOnlyRootFilesystem"] is True
    assert (c["runAsUser"], c["runAsGroup"]) == (65532, 65532)
    assert spec["securityContext"]["runAsUser"] == 65532


def test_restricted_check_can_fail():
    """The checker above finds what a pod spec gets wrong."""
    spec = {"hostNetwork": True, "containers": [{"name": "c", "securityContext": {
        "capabilities": {"add": ["SYS_ADMIN"]}, "runAsUser": 0}}],
        "volumes": [{"name": "h", "hostPath": {"path": "/"}}]}
    bad = restricted_violations(spec)
    for want in ("hostNetwork", "volume h", "allowPrivilegeEscalation", "drop ALL",
                 "capabilities added", "runAsNonRoot", "runAsUser 0", "seccompProfile"):
        assert any(want in b for b in bad), (want, bad)


# The ServiceAccount and RBAC templates have tests of their own.
IDENTITY_KINDS = ("ServiceAccount", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding")


def test_optional_objects_follow_their_values(env):
    kinds = {c: sorted(o["kind"] for o in render(env, c)[1] if o["kind"] not in IDENTITY_KINDS)
             for c in COMBOS}
    base = ["Deployment", "Service", "Service"]
    assert kinds["default"] == base
    assert kinds["servicemonitor"] == sorted(base + ["ServiceMonitor"])
    assert kinds["pdb"] == sorted(base + ["PodDisruptionBudget"])
    # One replica: a budget would pin the only pod and block its node's drains.
    assert kinds["one-replica"] == base
    assert kinds["networkpolicy"] == sorted(base + ["NetworkPolicy"])
    assert kinds["networkpolicy-namespaced"] == sorted(base + ["NetworkPolicy"] * 2)
    assert kinds["sandbox"] == base
    assert kinds["no-datagrams"] == sorted(base + ["NetworkPolicy"])

    _, objs = render(env, "servicemonitor")
    sm = one(objs, "ServiceMonitor")
    assert sm["metadata"]["labels"]["release"] == "prom"
    assert sm["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics",
                                        "interval": "30s"}]
    assert sm["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "metrics"

    _, objs = render(env, "pdb")
    pdb = one(objs, "PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


def test_network_policies(env):
    exists = [{"key": "cohort.dev/cohort", "operator": "Exists"}]
    # All namespaces: the broker port from trainer pods of any namespace;
    # no policy for the sidecars (their namespaces are not known).
    _, objs = render(env, "networkpolicy")
    op = one(objs, "NetworkPolicy", "cohort")
    assert op["metadata"]["namespace"] == DRY_NS
    broker, metrics = op["spec"]["ingress"]
    assert broker["from"] == [{"podSelector": {"matchExpressions": exists},
                               "namespaceSelector": {}}]
    assert broker["ports"] == [{"protocol": "TCP", "port": 7070}, {"protocol": "UDP", "port": 7070}]
    assert metrics == {"ports": [{"protocol": "TCP", "port": 8080}]}
    assert op["spec"]["policyTypes"] == ["Ingress"]
    # One namespace: trainer pods of that namespace only, and a policy
    # there for the sidecars' data ports (ephemeral ports of the pod IP).
    _, objs = render(env, "networkpolicy-namespaced")
    op = one(objs, "NetworkPolicy", "cohort")
    assert op["spec"]["ingress"][0]["from"][0]["namespaceSelector"] == {
        "matchLabels": {"kubernetes.io/metadata.name": WATCHED}}
    tr = one(objs, "NetworkPolicy", "cohort-trainers")
    assert tr["metadata"]["namespace"] == WATCHED
    assert tr["spec"]["podSelector"] == {"matchExpressions": exists}
    assert tr["spec"]["ingress"] == [{"from": [{"podSelector": {"matchExpressions": exists}}],
                                      "ports": [{"protocol": "TCP", "port": 1024,
                                                 "endPort": 65535}]}]


def broker_policy_ports(objs):
    op = one(objs, "NetworkPolicy", "cohort")
    return op["spec"]["ingress"][0]["ports"]


def test_datagrams_value(env):
    """broker.datagrams (default true): off, the operator gets
    --no-datagram-heartbeats and the broker policy lets no UDP in. The
    container's and the Service's ports are the same either way, so that
    turning it on or off never patches those lists (helm keys them by
    number alone)."""
    _, on = render(env, "networkpolicy")
    _, off = render(env, "no-datagrams")
    on_args, off_args = operator_container(on)["args"], operator_container(off)["args"]
    assert "--no-datagram-heartbeats" not in on_args
    assert off_args.count("--no-datagram-heartbeats") == 1
    assert [a for a in off_args if a != "--no-datagram-heartbeats"] == on_args
    assert broker_policy_ports(on) == [{"protocol": "TCP", "port": 7070},
                                       {"protocol": "UDP", "port": 7070}]
    assert broker_policy_ports(off) == [{"protocol": "TCP", "port": 7070}]
    assert operator_container(on)["ports"] == operator_container(off)["ports"]
    assert one(on, "Service", "cohort-broker")["spec"] == one(off, "Service",
                                                              "cohort-broker")["spec"]
    # The default is on.
    _, default = render(env, "default")
    assert operator_container(default)["args"] == operator_container(on)["args"]


def socket_ports(pid, proto, state=None):
    """The local ports of process pid's sockets of /proc/net/<proto>
    (udp, tcp; and their IPv6 tables), in that TCP state if given (0A:
    listening). Only sockets the process holds count (their inodes)."""
    inodes = set()
    fd_dir = "/proc/%d/fd" % pid
    for fd in os.listdir(fd_dir):
        try:
            m = re.match(r"socket:\[(\d+)\]$", os.readlink(os.path.join(fd_dir, fd)))
        except OSError:
            continue                # closed meanwhile
        if m:
            inodes.add(m.group(1))
    ports = set()
    for table in (proto, proto + "6"):
        try:
            with open("/proc/%d/net/%s" % (pid, table)) as f:
                rows = f.read().splitlines()[1:]
        except FileNotFoundError:
            continue                # no IPv6
        for row in rows:
            cols = row.split()
            if cols[9] in inodes and (state is None or cols[3] == state):
                ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


@pytest.mark.parametrize("datagrams", [True, False], ids=["datagrams", "no-datagrams"])
def test_rendered_operator_runs_with_its_args(env, datagrams):
    """The real cohort-operator with the chart's rendered args and
    environment, as a kubelet starts it (the env's fieldRefs filled in,
    $(POD_IP) expanded), against the stand-in: it leads, and its broker
    holds the UDP port the container declares when broker.datagrams is
    on, no UDP socket when it is off. --in-cluster becomes --kubeconfig:
    this runs outside a pod."""
    exe = os.path.join(bin_dir(), "cohort-operator")
    if not os.access(exe, os.X_OK):
        pytest.skip("no cohort-operator in %s (make asan, or set COHORT_BIN)" % bin_dir())
    kubectl, srv = env["kubectl"], env["server"]
    ns = "run-dg" if datagrams else "run-nodg"
    kubectl("create", "namespace", ns)
    kubectl("apply", "-f", CRD_FILE)
    kubectl("wait", "--for", "condition=Established", "crd/trainingcohorts.cohort.dev")
    port = free_port()
    mport = wait_until(lambda: (lambda p: p if p != port else None)(free_port()),
                       "a second free port")
    r = env["helm"]("template", "cohort", CHART, "--namespace", ns,
                    "--set", "operator.listenOnPodIP=true",
                    "--set", "broker.service.port=%d" % port, "--set", "metrics.port=%d" % mport,
                    "--set", "broker.datagrams=%s" % str(datagrams).lower())
    c = operator_container([o for o in yaml.safe_load_all(r.stdout) if o])
    fields = {"metadata.name": "cohort-" + ns, "metadata.namespace": ns,
              "status.podIP": "127.0.0.1"}
    cenv = {e["name"]: fields[e["valueFrom"]["fieldRef"]["fieldPath"]] for e in c["env"]}
    args = [re.sub(r"\$\((\w+)\)", lambda m: cenv[m.group(1)], a) for a in c["args"]]
    assert args.count("--in-cluster") == 1
    i = args.index("--in-cluster")
    args[i:i + 1] = ["--kubeconfig", srv.kubeconfig]
    assert ("--no-datagram-heartbeats" in args) == (not datagrams)

    tmp = make_tmp("cohort-chart-op-")
    log_path = os.path.join(tmp, "operator.log")
    log = open(log_path, "w")
    p = subprocess.Popen([exe, *args], env=dict(os.environ, **cenv), stdout=log,
                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def text():
        with open(log_path) as f:
            return f.read()

    def leading():
        assert p.poll() is None, "the operator exited:\n" + text()
        return "Leading: reconciling cohorts and serving the broker." in text()

    rc = None
    try:
        # The broker binds its sockets before the controller starts, and
        # "Leading" is logged once both run.
        wait_until(leading, "the operator to lead")
        assert port in socket_ports(p.pid, "tcp", "0A"), text()
        declared = {cp["containerPort"] for cp in c["ports"] if cp["protocol"] == "UDP"}
        assert declared == {port}
        assert socket_ports(p.pid, "udp") == (declared if datagrams else set()), text()
    finally:
        rc = stop_process(p, 30)
        log.close()
        out = text()
        remove_tmp(tmp)
    assert rc == 0, out


# ---------------------------------------------------------------------------
# Bad values
# ---------------------------------------------------------------------------

BAD_VALUES = [
    (["nosuchkey=1"], "Additional property nosuchkey is not allowed"),
    (["operator.nosuchkey=1"], "Additional property nosuchkey is not allowed"),
    (["operator.replicas=0"], "operator.replicas"),
    (["operator.replicas=two"], "operator.replicas"),
    (["operator.logLevel=loud"], "operator.logLevel"),
    (["broker.tls=on"], "broker.tls"),
    (["broker.datagrams=yes"], "broker.datagrams"),
    (["broker.service.name=Cohort_Broker"], "broker.service.name"),
    (["broker.service.port=70000"], "broker.service.port"),
    (["image.pullPolicy=Sometimes"], "image.pullPolicy"),
    (["image.tag=has space"], "image.tag"),
    (["watchNamespace=Not-A-Label"], "watchNamespace"),
    (["operator.resources.requests.cpu=lots"], "operator.resources.requests.cpu"),
    (["metrics.serviceMonitor.interval=soon"], "metrics.serviceMonitor.interval"),
    (["podDisruptionBudget.minAvailable=2"], "podDisruptionBudget.minAvailable"),
    (["networkPolicy.trainerNamespaces[0]=UPPER"], "networkPolicy.trainerNamespaces"),
    (["metrics.port=7070"], "broker.service.port and metrics.port must differ"),
]


@pytest.mark.parametrize("values,why", BAD_VALUES, ids=[v[0][0] for v in BAD_VALUES])
def test_bad_values_are_refused(env, values, why):
    args = []
    for v in values:
        args += ["--set", v]
    r = env["helm"]("template", "cohort", CHART, *args, check=False)
    assert r.returncode != 0, "helm accepted %s" % values
    assert why in r.stderr, r.stderr


def test_bad_values_file_is_refused_and_installs_nothing(env):
    srv = env["server"]
    tmp = make_tmp("cohort-values-")
    try:
        path = os.path.join(tmp, "values.yaml")
        with open(path, "w") as f:
            f.write("operator:\n  replica: 3\n")       # a typo for replicas
        r = env["helm"]("install", "typo", CHART, "-n", "typo", "--create-namespace",
                        "-f", path, check=False)
    finally:
        remove_tmp(tmp)
    assert r.returncode != 0
    assert "values don't meet the specifications of the schema" in r.stderr, r.stderr
    assert "Additional property replica is not allowed" in r.stderr
    secrets = srv.get("/api/v1/secrets?labelSelector=owner%3Dhelm%2Cname%3Dtypo")
    assert secrets["items"] == []
    assert srv.call("GET", "/api/v1/namespaces/typo")[0] == 404


# ---------------------------------------------------------------------------
# helm install, upgrade, uninstall
# ---------------------------------------------------------------------------


def test_install_upgrade_uninstall(env):
    srv, kubectl, helm = env["server"], env["kubectl"], env["helm"]
    r = helm("install", "cohort", CHART, "-n", NS, "--create-namespace",
             "--set", "metrics.serviceMonitor.enabled=true",
             "--set", "networkPolicy.enabled=true", "--set", "watchNamespace=" + WATCHED)
    assert "STATUS: deployed" in r.stdout
    assert "kubectl -n %s apply -f examples/k8s/cohort.yaml" % WATCHED in r.stdout   # NOTES
    base = "/apis/apps/v1/namespaces/%s/deployments/cohort" % NS
    d = srv.get(base)
    assert d["spec"]["replicas"] == 2
    assert d["metadata"]["annotations"]["meta.helm.sh/release-name"] == "cohort"
    assert flags(d["spec"]["template"]["spec"]["containers"][0]["args"])["--log-level"] == "info"
    assert srv.get("/api/v1/namespaces/%s/services/cohort-broker" % NS)
    assert srv.get("/apis/networking.k8s.io/v1/namespaces/%s/networkpolicies/cohort-trainers"
                   % WATCHED)
    sm_path = "/apis/monitoring.coreos.com/v1/namespaces/%s/servicemonitors/cohort" % NS
    assert srv.get(sm_path)["spec"]["endpoints"][0]["interval"] == "30s"
    assert srv.get("/apis/apiextensions.k8s.io/v1/customresourcedefinitions/"
                   "trainingcohorts.cohort.dev")
    # The release, stored as helm stores it.
    rel = srv.get("/api/v1/namespaces/%s/secrets?labelSelector=owner%%3Dhelm%%2Cname%%3Dcohort"
                  % NS)["items"]
    assert [(s["type"], s["metadata"]["labels"]["status"], s["metadata"]["labels"]["version"])
            for s in rel] == [("helm.sh/release.v1", "deployed", "1")]
    gen = d["metadata"]["generation"]

    mark = len(srv.requests())
    helm("upgrade", "cohort", CHART, "-n", NS, "--reuse-values",
         "--set", "operator.replicas=3", "--set", "operator.logLevel=debug",
         "--set", "metrics.serviceMonitor.interval=1m")
    d = srv.get(base)
    assert d["spec"]["replicas"] == 3
    assert flags(d["spec"]["template"]["spec"]["containers"][0]["args"])["--log-level"] == "debug"
    assert d["metadata"]["generation"] == gen + 1
    assert srv.get(sm_path)["spec"]["endpoints"][0]["interval"] == "1m"
    patches = {(q["path"].rsplit("/", 2)[-2], q["contentType"]) for q in srv.requests()[mark:]
               if q["method"] == "PATCH"}
    assert ("deployments", "application/strategic-merge-patch+json") in patches
    assert ("servicemonitors", "application/merge-patch+json") in patches
    out = helm("history", "cohort", "-n", NS, "-o", "json").stdout
    assert [(h["revision"], h["status"]) for h in json.loads(out)] == [(1, "superseded"),
                                                                        (2, "deployed")]

    # A value the schema refuses leaves the release as it was.
    r = helm("upgrade", "cohort", CHART, "-n", NS, "--reuse-values",
             "--set", "operator.replicas=0", check=False)
    assert r.returncode != 0 and "operator.replicas" in r.stderr
    assert srv.get(base)["spec"]["replicas"] == 3

    # Turning the ServiceMonitor off deletes it.
    helm("upgrade", "cohort", CHART, "-n", NS, "--reuse-values",
         "--set", "metrics.serviceMonitor.enabled=false")
    assert srv.call("GET", sm_path)[0] == 404

    helm("uninstall", "cohort", "-n", NS)
    for path in (base, "/api/v1/namespaces/%s/services/cohort-broker" % NS,
                 "/api/v1/namespaces/%s/services/cohort-metrics" % NS,
                 "/apis/networking.k8s.io/v1/namespaces/%s/networkpolicies/cohort" % NS,
                 "/apis/networking.k8s.io/v1/namespaces/%s/networkpolicies/cohort-trainers"
                 % WATCHED):
        wait_until(lambda p=path: srv.call("GET", p)[0] == 404, "%s to be deleted" % path)
    assert srv.get("/api/v1/namespaces/%s/secrets?labelSelector=owner%%3Dhelm" % NS)[
        "items"] == []
    # helm never deletes what it put in crds/.
    assert srv.get("/apis/apiextensions.k8s.io/v1/customresourcedefinitions/"
                   "trainingcohorts.cohort.dev")
    assert kubectl("get", "tc", "-A").returncode == 0


def chart_before_datagrams(tmp):
    """A copy of the chart as it was before broker.datagrams: no value, no
    broker-udp ports. Each cut must apply, so a change to what it cuts
    fails here instead of testing something else."""
    old = os.path.join(tmp, "cohort")
    shutil.copytree(CHART, old)

    def cut(rel, pattern):
        path = os.path.join(old, rel)
        with open(path) as f:
            text = f.read()
        text, n = re.subn(pattern, "", text, flags=re.S)
        assert n == 1, "%s: %r matched %d times" % (rel, pattern, n)
        with open(path, "w") as f:
            f.write(text)

    cut("values.yaml", r"  # Datagram heartbeats:.*?\n  datagrams: true\n")
    cut("templates/service-broker.yaml",
        r"    - name: broker-udp\n.*?protocol: UDP\n")
    cut("templates/deployment.yaml",
        r"            # The same number over UDP.*?protocol: UDP\n")
    with open(os.path.join(old, "values.schema.json")) as f:
        schema = json.load(f)
    del schema["properties"]["broker"]["properties"]["datagrams"]
    with open(os.path.join(old, "values.schema.json"), "w") as f:
        json.dump(schema, f)
    return old


def repair_command():
    """The kubectl command docs/install.md ("Upgrading") gives to add the
    broker-udp port, as argv."""
    with open(os.path.join(ROOT, "docs", "install.md")) as f:
        text = f.read()
    m = re.search(r"^kubectl -n cohort-system patch service cohort-broker .*?\n(?:    .*\n)*",
                  text, re.M)
    assert m, "docs/install.md no longer prints the kubectl patch of broker-udp"
    return shlex.split(m.group(0).replace("\\\n", " "))


def test_upgrade_from_a_chart_before_datagrams(env):
    """A release of the chart from before broker.datagrams, upgraded with
    --reuse-values: the missing value means on, helm's patch cannot add
    the UDP Service port (docs/install.md says so and gives the fix), the
    documented kubectl patch adds it once, and from then on turning
    broker.datagrams off and on keeps both broker ports."""
    srv, kubectl, helm = env["server"], env["kubectl"], env["helm"]
    ns = "upgrade"
    svc_path = "/api/v1/namespaces/%s/services/cohort-broker" % ns
    deploy_path = "/apis/apps/v1/namespaces/%s/deployments/up-cohort" % ns
    policy_path = "/apis/networking.k8s.io/v1/namespaces/%s/networkpolicies/up-cohort" % ns
    tmp = make_tmp("cohort-chart-old-")
    try:
        helm("install", "up", chart_before_datagrams(tmp), "-n", ns, "--create-namespace",
             "--set", "networkPolicy.enabled=true")
    finally:
        remove_tmp(tmp)

    def ports():
        return [(p["name"], p["port"], p["protocol"]) for p in srv.get(svc_path)["spec"]["ports"]]

    def args():
        return srv.get(deploy_path)["spec"]["template"]["spec"]["containers"][0]["args"]

    def policy_protocols():
        return [p["protocol"] for p in srv.get(policy_path)["spec"]["ingress"][0]["ports"]]

    tcp, udp = ("broker", 7070, "TCP"), ("broker-udp", 7070, "UDP")
    assert ports() == [tcp]
    cluster_ip = srv.get(svc_path)["spec"]["clusterIP"]

    helm("upgrade", "up", CHART, "-n", ns, "--reuse-values")
    # helm reused the old release's values, which have no broker.datagrams.
    got = json.loads(helm("get", "values", "up", "-n", ns, "--all", "-o", "json").stdout)
    assert "datagrams" not in got["broker"]
    assert "--no-datagram-heartbeats" not in args()
    assert policy_protocols() == ["TCP", "UDP"]
    # The patch helm sent named both ports by the number 7070 alone: the
    # UDP one was merged into the TCP one. TCP, which every sidecar needs,
    # is intact.
    assert ports() == [tcp]

    argv = repair_command()
    assert argv[:5] == ["kubectl", "-n", "cohort-system", "patch", "service"]
    argv[2] = ns
    kubectl(*argv[1:])
    assert ports() == [tcp, udp]
    assert srv.get(svc_path)["spec"]["clusterIP"] == cluster_ip
    # Given twice, it is refused and changes nothing.
    r = kubectl(*argv[1:], check=False)
    assert r.returncode != 0 and "Duplicate value" in r.stderr, r.stderr
    assert ports() == [tcp, udp]

    helm("upgrade", "up", CHART, "-n", ns, "--reuse-values", "--set", "broker.datagrams=false")
    assert args().count("--no-datagram-heartbeats") == 1
    assert policy_protocols() == ["TCP"]
    assert ports() == [tcp, udp]
    helm("upgrade", "up", CHART, "-n", ns, "--reuse-values", "--set", "broker.datagrams=true")
    assert "--no-datagram-heartbeats" not in args()
    assert policy_protocols() == ["TCP", "UDP"]
    assert ports() == [tcp, udp]
    assert srv.get(svc_path)["spec"]["clusterIP"] == cluster_ip
    helm("uninstall", "up", "-n", ns)


# ---------------------------------------------------------------------------
# The stand-in refuses what the real API server refuses
# ---------------------------------------------------------------------------

DEPLOYMENT = {
    "apiVersion": "apps/v1", "kind": "Deployment",
    "metadata": {"name": "bad", "namespace": DRY_NS},
    "spec": {"selector": {"matchLabels": {"app": "a"}},
             "template": {"metadata": {"labels": {"app": "a"}},
                          "spec": {"containers": [{"name": "c", "image": "i"}]}}}}


def variant(base, path, value):
    obj = json.loads(json.dumps(base))
    cur = obj
    keys = path.split(".")
    for k in keys[:-1]:
        cur = cur[int(k)] if isinstance(cur, list) else cur.setdefault(k, {})
    if value is DELETE:
        cur.pop(keys[-1])
    elif isinstance(cur, list):
        cur[int(keys[-1])] = value
    else:
        cur[keys[-1]] = value
    return obj


DELETE = object()
SERVICE = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "bad", "namespace": DRY_NS},
           "spec": {"selector": {"app": "a"}, "ports": [{"name": "p", "port": 80}]}}
PDB = {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
       "metadata": {"name": "bad", "namespace": DRY_NS},
       "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "a"}}}}
NETPOL = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
          "metadata": {"name": "bad", "namespace": DRY_NS},
          "spec": {"podSelector": {}, "ingress": [{"ports": [{"port": 1024, "endPort": 2048}]}]}}

REFUSED = [
    ("deployment-selector", variant(DEPLOYMENT, "spec.template.metadata.labels", {"app": "b"}),
     'The Deployment "bad" is invalid: spec.template.metadata.labels: Invalid value: '
     'map[string]string{"app":"b"}: `selector` does not match template `labels`'),
    ("deployment-no-selector", variant(DEPLOYMENT, "spec.selector", DELETE),
     "spec.selector: Required value"),
    ("deployment-replicas", variant(DEPLOYMENT, "spec.replicas", -1),
     "spec.replicas: Invalid value: -1: must be greater than or equal to 0"),
    ("deployment-no-containers", variant(DEPLOYMENT, "spec.template.spec.containers", []),
     "spec.template.spec.containers: Required value"),
    ("deployment-restart-never", variant(DEPLOYMENT, "spec.template.spec.restartPolicy",
                                         "Never"),
     'spec.template.spec.restartPolicy: Unsupported value: "Never": supported values: '
     '"Always"'),
    ("deployment-recreate-rolling", variant(DEPLOYMENT, "spec.strategy",
                                            {"type": "Recreate", "rollingUpdate": {}}),
     "spec.strategy.rollingUpdate: Forbidden: may not be specified when strategy `type` is "
     "'Recreate'"),
    ("deployment-surge-zero", variant(DEPLOYMENT, "spec.strategy", {
        "type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 0}}),
     "spec.strategy.rollingUpdate.maxUnavailable: Invalid value: 0: may not be 0 when "
     "`maxSurge` is 0"),
    ("deployment-fieldpath", variant(DEPLOYMENT, "spec.template.spec.containers.0.env", [
        {"name": "X", "valueFrom": {"fieldRef": {"fieldPath": "status.nothing"}}}]),
     'spec.template.spec.containers[0].env[0].valueFrom.fieldRef.fieldPath: Unsupported '
     'value: "status.nothing"'),
    ("deployment-port-name", variant(DEPLOYMENT, "spec.template.spec.containers.0.ports", [
        {"name": "much-too-long-port-name", "containerPort": 80}]),
     'spec.template.spec.containers[0].ports[0].name: Invalid value: '
     '"much-too-long-port-name": must be no more than 15 characters'),
    ("service-port", variant(SERVICE, "spec.ports.0.port", 0),
     # and so is targetPort, which defaults to it
     "spec.ports[0].port: Invalid value: 0: must be between 1 and 65535, inclusive"),
    ("service-no-ports", variant(SERVICE, "spec.ports", []), "spec.ports: Required value"),
    ("service-name", variant(SERVICE, "metadata.name", "1bad"),
     'metadata.name: Invalid value: "1bad": a DNS-1035 label must consist of lower case'),
    ("service-protocol", variant(SERVICE, "spec.ports.0.protocol", "HTTP"),
     'spec.ports[0].protocol: Unsupported value: "HTTP": supported values: "SCTP", "TCP", '
     '"UDP"'),
    ("pdb-both", variant(PDB, "spec.maxUnavailable", 1),
     'The PodDisruptionBudget "bad" is invalid: spec: Invalid value: "object": '
     'minAvailable and maxUnavailable cannot be both set'),
    ("pdb-policy", variant(PDB, "spec.unhealthyPodEvictionPolicy", "Sometimes"),
     'spec.unhealthyPodEvictionPolicy: Unsupported value: "Sometimes": supported values: '
     '"AlwaysAllow", "IfHealthyBudget"'),
    ("pdb-selector", variant(PDB, "spec.selector", {"matchExpressions": [
        {"key": "app", "operator": "In"}]}),
     "spec.selector.matchExpressions[0].values: Required value: must be specified when "
     "`operator` is 'In' or 'NotIn'"),
    ("netpol-endport", variant(NETPOL, "spec.ingress.0.ports.0.endPort", 80),
     'The NetworkPolicy "bad" is invalid: spec.ingress[0].ports[0].endPort: '
     'Invalid value: 80: must be greater than or equal to `port`'),
    ("netpol-named-endport", variant(NETPOL, "spec.ingress.0.ports.0.port", "data"),
     "spec.ingress[0].ports[0].endPort: Invalid value: 2048: may not be specified when `port` "
     "is non-numeric"),
    ("netpol-peer", variant(NETPOL, "spec.ingress.0.from", [{}]),
     "spec.ingress[0].from[0]: Required value: must specify a peer"),
    ("netpol-types", variant(NETPOL, "spec.policyTypes", ["Sideways"]),
     'spec.policyTypes[0]: Unsupported value: "Sideways": supported values: "Egress", '
     '"Ingress"'),
]


@pytest.mark.parametrize("obj,message", [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_standin_refuses_what_kubernetes_refuses(env, obj, message):
    kubectl = env["kubectl"]
    r = kubectl("apply", "--dry-run=server", "-f", "-", stdin=json.dumps(obj), check=False)
    assert r.returncode != 0, "accepted: %s" % json.dumps(obj)
    assert message in r.stderr, r.stderr


def test_standin_accepts_the_valid_originals(env):
    """The objects the cases above spoil are accepted as they are, so each
    refusal is the one check it names."""
    text = yaml.safe_dump_all([DEPLOYMENT, SERVICE, PDB, NETPOL])
    r = env["kubectl"]("apply", "--dry-run=server", "-f", "-", stdin=text)
    assert r.stdout.count("(server dry run)") == 4


def test_deployment_selector_is_immutable(env):
    srv = env["server"]
    path = "/apis/apps/v1/namespaces/%s/deployments" % WATCHED
    obj = variant(variant(DEPLOYMENT, "metadata.namespace", WATCHED), "metadata.name", "imm")
    srv.ok("POST", path, obj)
    code, doc, _ = srv.call("PATCH", path + "/imm", {
        "spec": {"selector": {"matchLabels": {"app": "b"}},
                 "template": {"metadata": {"labels": {"app": "b"}}}}},
        "application/merge-patch+json")
    assert code == 422 and "spec.selector" in doc["message"] and "field is immutable" in \
        doc["message"], doc
    srv.ok("DELETE", path + "/imm")


def test_dry_run_writes_nothing(env):
    """dryRun=All on create, update, patch and delete: the answer is what a
    write would give, and no resourceVersion moves, no watch event, no
    object changes."""
    srv = env["server"]
    path = "/api/v1/namespaces/%s/services" % WATCHED
    svc = variant(variant(SERVICE, "metadata.namespace", WATCHED), "metadata.name", "dry")
    created = srv.ok("POST", path, svc)
    rv = srv.get(path)["metadata"]["resourceVersion"]

    got = srv.ok("POST", path + "?dryRun=All", variant(svc, "metadata.name", "dry2"))
    assert got["spec"]["clusterIP"] and got["spec"]["ports"][0]["targetPort"] == 80
    assert srv.call("GET", path + "/dry2")[0] == 404
    put = dict(created, spec=dict(created["spec"], ports=[{"name": "p", "port": 81}]))
    assert srv.ok("PUT", path + "/dry?dryRun=All", put)["spec"]["ports"][0]["port"] == 81
    patched = srv.ok("PATCH", path + "/dry?dryRun=All", {"metadata": {"labels": {"x": "y"}}},
                     "application/strategic-merge-patch+json")
    assert patched["metadata"]["labels"] == {"x": "y"}
    code, doc, _ = srv.call("PATCH", path + "/dry?dryRun=All", {"spec": {"ports": [
        {"name": "p", "port": 0}]}}, "application/merge-patch+json")
    assert code == 422, doc                         # a dry run is validated
    srv.ok("DELETE", path + "/dry?dryRun=All")
    code, _, _ = srv.call("DELETE", path + "/dry", {"kind": "DeleteOptions",
                                                    "apiVersion": "v1", "dryRun": ["All"]})
    assert code == 200
    assert srv.call("POST", path + "?dryRun=Some", svc)[0] == 400

    assert srv.get(path + "/dry") == created
    assert srv.get(path)["metadata"]["resourceVersion"] == rv
    with urllib.request.urlopen(srv.url + path + "?watch=1&timeoutSeconds=1&resourceVersion="
                                + rv, timeout=DEADLINE) as w:
        assert w.read().strip() == b"", "a dry run made a watch event"
    # A dry run needs the namespace, as any write does.
    code, doc, _ = srv.call("POST", "/api/v1/namespaces/nowhere/services?dryRun=All",
                            variant(svc, "metadata.namespace", "nowhere"))
    assert code == 404 and 'namespaces "nowhere" not found' in doc["message"], doc
    srv.ok("DELETE", path + "/dry")

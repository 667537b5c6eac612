#!/bin/sh
# bench/operator.sh: cohort-operator at scale on the Kubernetes stand-in.
#
# COHORTS TrainingCohorts (default 200) of REPLICAS pods each (default 4)
# are created at once against tests/kube/apiserver.py. The process kubelet
# runs with --no-processes: it binds every pod and reports it Running and
# Ready at once, but starts no sidecar or trainer, so this measures the
# controller and the API traffic, not training (no broker members join).
#
# Printed: time from the first create to all pods created and to all pods
# Running; the operator's API requests per minute in steady state
# (STEADY_S seconds, default 60, after everything settled: watches only,
# no polling; leader election's Lease renewals counted apart); operator
# RSS and CPU. Binaries: $COHORT_BIN (default build/, the release build).
set -eu
cd "$(dirname "$0")/.."
BIN=${COHORT_BIN:-$PWD/build}
[ -x "$BIN/cohort-operator" ] || { echo "bench/operator.sh: no $BIN/cohort-operator; run make" >&2; exit 1; }
[ -x build/tools/kubectl ] || scripts/install-kubectl.sh
exec /usr/bin/python3 - "$BIN" <<'PY'
import json, os, sys, time, urllib.request
sys.path.insert(0, "tests/lib")
import cohorttest as kp

BIN = sys.argv[1]
os.environ["COHORT_BIN"] = BIN
N = int(os.environ.get("COHORTS", "200"))
R = int(os.environ.get("REPLICAS", "4"))
STEADY = float(os.environ.get("STEADY_S", "60"))
tmp = kp.make_tmp("cop-bench-")
server = kp.ApiServer(tmp, "--history-size", "50000", "--bookmark-interval", "5")
kubelet = kp.Kubelet(server, tmp, "--no-processes")
kubectl = kp.Kubectl(server, tmp)
kubectl("apply", "-f", kp.CRD_FILE)
kubectl("wait", "--for", "condition=Established", "crd/trainingcohorts.cohort.dev")
# The production defaults for leader election and status (the test
# defaults that cohorttest.Operator sets first are overridden).
op = kp.Operator(server, tmp, "bench", kp.free_port(), "--status-period", "5s",
                 "--resync", "30s", "--lease-duration", "15s", "--renew-deadline", "10s",
                 "--retry-period", "2s", "--api-timeout", "30s")
kp.wait_until(lambda: op.http("/readyz")[0] == 200, "the operator to be ready")
pid = op.p.pid
tick = os.sysconf("SC_CLK_TCK")

def cpu_s():
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / tick

def rss_mib():
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0

def count_pods(phase=None):
    items = server.get("/api/v1/pods?labelSelector=cohort.dev%2Fcohort")["items"]
    return sum(1 for p in items if phase is None or (p.get("status") or {}).get("phase") == phase)

rss0, cpu0 = rss_mib(), cpu_s()
t0 = time.monotonic()
for i in range(N):
    m = kp.cohort_manifest("b%03d" % i, R, args=["--steps", "1"])
    code, doc, _ = server.call("POST", "/apis/cohort.dev/v1alpha1/namespaces/default/trainingcohorts", m)
    assert code == 201, doc
t_posted = time.monotonic() - t0
created = kp.wait_until(lambda: count_pods() >= N * R and time.monotonic(), "all pods created",
                        timeout=600, interval=0.2) - t0
running = kp.wait_until(lambda: count_pods("Running") >= N * R and time.monotonic(),
                        "all pods Running", timeout=600, interval=0.2) - t0

def settled():
    items = server.get("/apis/cohort.dev/v1alpha1/trainingcohorts")["items"]
    return all((c.get("status") or {}).get("replicas") == R for c in items)
kp.wait_until(settled, "every status to show its pods", timeout=600, interval=0.5)
t_settled = time.monotonic() - t0
cpu_create = cpu_s() - cpu0
rss_peak = rss_mib()
time.sleep(10)      # let the last status writes and events land

m0 = op.metrics(); c0 = cpu_s(); s0 = time.monotonic()
time.sleep(STEADY)
m1 = op.metrics(); c1 = cpu_s(); s1 = time.monotonic()
n = int(m1["api_requests_total"] - m0["api_requests_total"])
# The window's requests are the operator's last n non-watch requests in
# the API server's log (watches are counted apart).
reqs = [r for r in server.requests() if r["userAgent"].startswith("cohort-operator") and
        "watch=true" not in (r["query"] or "")][-n:] if n else []
minutes = (s1 - s0) / 60.0
total = n / minutes
lease = sum(1 for r in reqs if "/leases/" in r["path"]) / minutes
watches = (m1["api_watches_total"] - m0["api_watches_total"]) / minutes
writes = (m1["status_writes_total"] - m0["status_writes_total"]) / minutes
cpu_steady = (c1 - c0) / (s1 - s0) * 100
pods_total = count_pods()
dup = pods_total - N * R
rss_end = rss_mib()
op.stop(); kubelet.stop(); server.stop(); kp.remove_tmp(tmp)

print()
print("cohort-operator on the stand-in: %d cohorts x %d pods (kubelet --no-processes), %s" %
      (N, R, os.path.basename(BIN.rstrip("/")) or BIN))
print()
print("| measure | value |")
print("|---|---:|")
print("| %d cohorts posted (by the benchmark) | %.2f s |" % (N, t_posted))
print("| first create to all %d pods created | %.2f s |" % (N * R, created))
print("| first create to all pods Running | %.2f s |" % running)
print("| first create to every status showing its pods | %.2f s |" % t_settled)
print("| pods beyond %d (duplicates) | %d |" % (N * R, dup))
print("| operator CPU during the create phase | %.2f s |" % cpu_create)
print("| steady state: API requests / min, all | %.1f |" % total)
print("| steady state: of which Lease (leader election) | %.1f |" % lease)
print("| steady state: watch requests opened / min | %.2f |" % watches)
print("| steady state: status writes / min | %.1f |" % writes)
print("| steady state: operator CPU (one core) | %.2f %% |" % cpu_steady)
print("| operator RSS: idle, after creates, end | %.1f / %.1f / %.1f MiB |" % (rss0, rss_peak, rss_end))
print()
print("Steady state: %.0f s measured from %.0f s after the last status settled; "
      "machine: %d CPUs, load average %s." % (s1 - s0, 10, os.cpu_count(),
                                             " ".join("%.2f" % x for x in os.getloadavg())))
PY

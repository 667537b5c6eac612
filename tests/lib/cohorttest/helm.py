"""The real helm (build/tools/helm, from scripts/install-kubectl.sh)
against the stand-in, and the cohort chart (charts/cohort) as the
stand-in's kubelets run it.

The kubelets' pods share the host's network (each has its own loopback
address), so the chart's operator listens on its pod IP
(operator.listenOnPodIP): two replicas on 0.0.0.0 would take the same
port, and so would a Service's clusterIP:port beside them.
"""
import os
import subprocess

from .core import DEADLINE, ROOT, tool_available

HELM = os.path.join(ROOT, "build", "tools", "helm")
CHART = os.path.join(ROOT, "charts", "cohort")

# What every install of the chart on the stand-in sets.
STANDIN_SETS = ("operator.listenOnPodIP=true",)
# Lease and status timings short enough for a test: a takeover in about
# 3 s, status written every second.
QUICK_SETS = ("operator.extraArgs={--lease-duration,3s,--renew-deadline,2s,--retry-period,"
              "500ms,--status-period,1s,--resync,5s,--api-timeout,5s}",)


class Helm:
    """helm against the cluster of `kubeconfig`, its caches under tmp."""

    def __init__(self, kubeconfig, tmp):
        self.path = HELM
        self.env = dict(os.environ, KUBECONFIG=kubeconfig,
                        HELM_CACHE_HOME=os.path.join(tmp, "helm", "cache"),
                        HELM_CONFIG_HOME=os.path.join(tmp, "helm", "config"),
                        HELM_DATA_HOME=os.path.join(tmp, "helm", "data"))
        self.why_missing = None

    def available(self):
        """Installs helm if it is missing; False (and why_missing) when
        that fails."""
        ok, self.why_missing = tool_available(self.path)
        return ok

    def __call__(self, *args, check=True, timeout=DEADLINE):
        r = subprocess.run([self.path, *args], env=self.env, capture_output=True, text=True,
                           timeout=timeout, stdin=subprocess.DEVNULL)
        if check:
            assert r.returncode == 0, "helm %s failed:\n%s%s" % (" ".join(args), r.stdout,
                                                                 r.stderr)
        return r

    def install_cohort(self, *sets, release="cohort", namespace="cohort-system", check=True):
        """`helm install` of charts/cohort into namespace (made if missing)
        with STANDIN_SETS and `sets` (helm --set strings)."""
        argv = ["install", release, CHART, "--namespace", namespace, "--create-namespace"]
        for s in STANDIN_SETS + tuple(sets):
            argv += ["--set", s]
        return self(*argv, check=check)

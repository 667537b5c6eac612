"""Helpers every Python suite shares: tests/proc, tests/kube and
tests/python, and the sandbox and the operator benchmark.

- core: the deadline every wait uses, wait_until, free ports, temp dirs
- procs: child processes (JSON log lines collected, stopping, process
  groups killed on timeout)
- programs: cohort's binaries (brokers, sidecars, cohortctl, `cohortctl run`)
- kube: the Kubernetes stand-in's processes (API server and its client,
  process kubelet, operator, kubectl), and the cluster of them the
  operator's suites start alike
- helm: the real helm, and the cohort chart as the stand-in runs it
- image: podman's configuration and a current build of the project's
  image, for the podman kubelet's tests (imported as cohorttest.image)

Tests wait on conditions with generous deadlines, never on fixed sleeps,
and every server listens on a free port. pytest finds this package
through `pythonpath` in the repository's pytest.ini; a script or a child
process needs tests/lib on its path (pyproc.child_env adds it).
"""
from .core import DEADLINE, KEEP, ROOT, free_port, make_tmp, read_text, remove_tmp, wait_until
from .procs import PROC_TIMEOUT, Proc, Procs, finish, run_group, spawn_group, stop_process
from .programs import (BIN, RUN_TIMEOUT, all_see, bin_dir, bin_path, cohortctl,
                       cohortctl_run, explain_run, latest_epoch, start_broker, start_sidecar,
                       status_json)
from .kube import (CRD_FILE, EXAMPLES, ApiServer, Controllers, Kubectl, Kubelet, Operator,
                   OperatorCluster, cohort_manifest, operator_cluster, pod_path_dir,
                   sidecar_speaks_tls)
from .helm import CHART, HELM, QUICK_SETS, STANDIN_SETS, Helm

__all__ = ["DEADLINE", "KEEP", "ROOT", "free_port", "make_tmp", "read_text", "remove_tmp",
           "wait_until", "Proc", "Procs", "finish", "run_group", "spawn_group", "stop_process", "BIN",
           "PROC_TIMEOUT", "RUN_TIMEOUT", "all_see", "bin_dir", "bin_path", "cohortctl",
           "cohortctl_run", "explain_run", "latest_epoch", "start_broker", "start_sidecar",
           "status_json", "CRD_FILE", "EXAMPLES", "ApiServer", "Controllers", "Kubectl", "Kubelet",
           "Operator", "OperatorCluster", "operator_cluster",
           "cohort_manifest", "pod_path_dir", "sidecar_speaks_tls", "CHART", "HELM", "QUICK_SETS",
           "STANDIN_SETS", "Helm"]

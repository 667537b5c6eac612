"""The trainer library and the operator's Kubernetes library, as built.

A C trainer links libcohort.a: it must see the public API of
include/cohort.h and nothing else of cohort's, and it must carry none of
the Kubernetes controller.
"""
import os
import re
import subprocess

from cohorttest import ROOT, bin_path


def symbols(archive, *flags):
    out = subprocess.run(["nm", *flags, archive], capture_output=True, text=True, check=True)
    rows = [l.split() for l in out.stdout.splitlines()]
    return [r for r in rows if len(r) == 3]


def public_api():
    text = open(os.path.join(ROOT, "include", "cohort.h")).read()
    return set(re.findall(r"\b(cohort_[a-z_]+)\(", text))


def test_trainer_library_exports_exactly_the_public_api():
    lib = bin_path("libcohort.a")
    exported = {name for _, kind, name in symbols(lib, "-g", "--defined-only")}
    declared = public_api()
    assert exported, "libcohort.a exports nothing"
    assert exported - declared == set(), "internal names leak: %s" % sorted(exported - declared)
    # Each declared function is defined (a macro-only name would be absent).
    assert declared - exported == set(), "declared, not defined: %s" % sorted(declared - exported)


def test_trainer_library_carries_no_kubernetes_code():
    lib = bin_path("libcohort.a")
    names = {name for _, _, name in symbols(lib, "--defined-only")}
    for prefix in ("controller_", "kube_", "reconcile_", "reflector_", "lease_", "probe_",
                   "workq_", "brokerd_", "trainerd_"):
        assert not any(n.startswith(prefix) for n in names), prefix
    # ...while it does hold the node and the engine it needs, made local.
    assert any(n.startswith("node_") for n in names)
    assert any(n.startswith("allreduce_") for n in names)


def test_k8s_library_holds_the_controller():
    lib = bin_path("libcohort-k8s.a")
    names = {name for _, kind, name in symbols(lib, "--defined-only")}
    assert "controller_start" in names
    assert not any(n.startswith("cohort_") and not n.startswith("cohort__") for n in names)

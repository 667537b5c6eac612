#!/usr/bin/env python3
"""Writes the reconcile harness's seeds: the TrainingCohorts of
examples/k8s/ as the API server would send them (JSON, with the namespace,
uid and generation it adds), alone and followed by pods in every phase,
and with a status holding members and conditions.

    tests/fuzz/seeds.py DIR      writes DIR/reconcile/seed-*

`make fuzz-seeds` runs it after build/fuzz/seeds."""
import copy
import json
import os
import sys

import yaml

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def served(tc, ns="default", uid="6f1d2c3e-0000-4000-8000-000000000001"):
    """tc as the API server returns it."""
    tc = copy.deepcopy(tc)
    meta = tc.setdefault("metadata", {})
    meta.setdefault("namespace", ns)
    meta.setdefault("uid", uid)
    meta.setdefault("generation", 2)
    meta.setdefault("resourceVersion", "1234")
    return tc


def pod(name, ordinal, phase, ready=False, terminating=False):
    """A pod as the operator reads it: only the fields it looks at, so that
    a seed stays within the harness's -max_len."""
    p = {
        "metadata": {"name": f"{name}-{ordinal}", "uid": f"pod-{ordinal}"},
        "status": {"phase": phase,
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }
    if terminating:
        p["metadata"]["deletionTimestamp"] = "2024-05-01T11:59:00Z"
    return p


def small(tc):
    """tc less what the operator only copies (a seed under -max_len)."""
    tc = copy.deepcopy(tc)
    tc["metadata"].pop("labels", None)
    tc["spec"].pop("accumulator", None)
    tc["spec"].pop("reduction", None)
    c = tc["spec"]["template"]["spec"]["containers"][0]
    c.pop("resources", None)
    c["args"] = c["args"][:2]
    return tc


def status(name, n):
    return {
        "observedGeneration": 1, "replicas": n, "restarts": 1,
        "selector": f"cohort.dev/cohort={name}", "epoch": 4, "leader": f"{name}-0",
        "modelVersion": 120,
        "members": [{"id": f"{name}-{i}", "pod": f"{name}-{i}", "address": f"10.0.0.{i + 1}:7000",
                     "modelVersion": 120 - i, **({"draining": True} if i == n - 1 else {})}
                    for i in range(n)],
        "conditions": [
            {"type": "Available", "status": "True", "observedGeneration": 1,
             "lastTransitionTime": "2024-05-01T11:00:00Z", "reason": "MinimumMembersReady",
             "message": f"{n} of {n} members train in epoch 4"},
            {"type": "Progressing", "status": "False", "observedGeneration": 1,
             "lastTransitionTime": "2024-05-01T11:00:00Z", "reason": "Stable",
             "message": f"{n} pods, all members"},
        ],
    }


def main(out):
    d = os.path.join(out, "reconcile")
    os.makedirs(d, exist_ok=True)

    def put(what, obj):
        with open(os.path.join(d, f"seed-{what}"), "w") as f:
            json.dump(obj, f, separators=(",", ":"))

    with open(os.path.join(ROOT, "examples/k8s/cohort.yaml")) as f:
        tc = served(yaml.safe_load(f))
    with open(os.path.join(ROOT, "examples/k8s/invalid-cohort.yaml")) as f:
        invalid = served(yaml.safe_load(f))
    name = tc["metadata"]["name"]
    put("example", tc)
    put("invalid", invalid)
    tc = small(tc)
    put("example-pods", [tc, pod(name, 0, "Running", ready=True), pod(name, 1, "Failed"),
                         pod(name, 3, "Running", terminating=True), pod(name, 7, "Succeeded")])
    with_status = copy.deepcopy(tc)
    with_status["status"] = status(name, 2)
    put("example-status", [with_status, pod(name, 0, "Running", ready=True),
                           pod(name, 1, "Running", ready=True), pod(name, 2, "Pending")])
    suspended = copy.deepcopy(tc)
    suspended["spec"]["suspend"] = True
    put("suspended", [suspended, pod(name, 0, "Running"), pod(name, 1, "Running")])
    done = copy.deepcopy(tc)
    done["spec"]["replicas"] = 2
    done["spec"]["maxRestarts"] = 0
    put("complete", [done, pod(name, 0, "Succeeded"), pod(name, 1, "Succeeded"),
                     pod(name, 2, "Failed")])

if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: seeds.py DIR")
    main(sys.argv[1])

"""spec.gpu end to end: the real kubectl 1.32 and the real operator against
the API server stand-in (serving resource.k8s.io/v1beta1, as a cluster
with dynamic resource allocation does) and the process kubelet.

- mode dra: the operator makes the cohort's ResourceClaimTemplate (count
  devices of the named class, owned by the cohort) before its pods, and
  every pod names it in spec.resourceClaims, with the trainer and the
  sidecar both listing the claim; a changed spec.gpu makes the template
  again and rolls the pods; a template deleted by hand is made again
  before the next pod; deleting the cohort takes the template with it;
  spec.gpu.reduce is the sidecar's --gpu-reduce, and a change of it rolls
  the pods onto the new argument;
- mode devicePlugin: the trainer alone gets nvidia.com/gpu, no template;
- bad spec.gpu values are refused by the API server with the CRD's words,
  and nothing is stored;
- the operator's own refusals: a template that names the reserved claim,
  a ResourceClaimTemplate of that name that is another's, and (on a
  second stand-in that does not serve resource.k8s.io) mode dra where the
  cluster has no DRA: the cohort is Failed with a reason and makes no pod.

No scheduler runs and no DRA driver allocates anything (docs/sandbox.md):
the kubelet runs the pods whatever claims they name, so these tests show
what the operator asks of Kubernetes, not a GPU reaching a container.
Every wait is on a condition with a generous deadline, never a fixed sleep.
"""
import json

import pytest

from cohorttest import (cohort_manifest, operator_cluster, wait_until)

TC_PATH = "/apis/cohort.dev/v1alpha1/namespaces/default/trainingcohorts"
RCT_PATH = "/apis/resource.k8s.io/v1beta1/namespaces/default/resourceclaimtemplates"
CLAIM = "cohort-gpu"


@pytest.fixture(scope="module")
def cluster():
    yield from operator_cluster("tgpu-", "--runtime-config", "resource.k8s.io/v1beta1=true",
                                tls=False)


def manifest(name, gpu, replicas=2):
    return cohort_manifest(name, replicas, extra_spec={"gpu": gpu})


def apply(c, m):
    c.kubectl("apply", "-f", "-", stdin=json.dumps(m))


def template(c, name):
    return c.server.get("%s/%s-gpu" % (RCT_PATH, name))


def live_pods(c, name):
    doc = c.server.get("/api/v1/namespaces/default/pods?labelSelector=cohort.dev%%2Fcohort%%3D%s"
                       % name)
    return sorted((p for p in (doc["items"] if doc else [])
                   if not p["metadata"].get("deletionTimestamp")),
                  key=lambda p: p["metadata"]["name"])


def condition(c, name, ctype):
    st = (c.server.get("%s/%s" % (TC_PATH, name)) or {}).get("status") or {}
    return next((x for x in st.get("conditions") or [] if x["type"] == ctype), None)


def events(c, name, reason):
    doc = c.server.get("/api/v1/namespaces/default/events") or {"items": []}
    return [e for e in doc["items"] if e["involvedObject"].get("name") == name and
            e.get("reason") == reason]


def claims_of(container):
    return [x["name"] for x in (container.get("resources") or {}).get("claims") or []]


def sidecar_of(pod):
    return next(x for x in pod["spec"]["initContainers"] if x["name"] == "cohort-sidecar")


def test_dra_pods_share_one_claim_between_trainer_and_sidecar(cluster):
    c = cluster
    apply(c, manifest("gd", {"mode": "dra", "count": 2, "deviceClassName": "gpu.example.com"}))
    t = wait_until(lambda: template(c, "gd"), "gd's ResourceClaimTemplate")
    assert t["spec"]["spec"]["devices"]["requests"] == [
        {"name": "gpu", "deviceClassName": "gpu.example.com", "allocationMode": "ExactCount",
         "count": 2}], t
    owner = t["metadata"]["ownerReferences"][0]
    assert owner["kind"] == "TrainingCohort" and owner["name"] == "gd" and owner["controller"]
    assert t["metadata"]["labels"]["cohort.dev/cohort"] == "gd"
    pods = wait_until(lambda: len(live_pods(c, "gd")) == 2 and live_pods(c, "gd"),
                      "two pods of gd")
    for p in pods:
        assert p["spec"]["resourceClaims"] == [{"name": CLAIM,
                                                "resourceClaimTemplateName": "gd-gpu"}], p["spec"]
        assert claims_of(p["spec"]["containers"][0]) == [CLAIM]
        assert claims_of(sidecar_of(p)) == [CLAIM], "the sidecar sees the trainer's GPUs"
        assert "nvidia.com/gpu" not in (p["spec"]["containers"][0]["resources"].get("limits")
                                        or {})
    assert len(events(c, "gd", "GPUClaimTemplateCreated")) == 1
    desc = c.kubectl("describe", "tc", "gd").stdout
    assert "Created ResourceClaimTemplate gd-gpu for 2 GPUs of class gpu.example.com" in desc, desc

    # A change of spec.gpu: the template is made again, the pods roll.
    old_hash = pods[0]["metadata"]["labels"]["cohort.dev/template-hash"]
    c.kubectl("patch", "tc", "gd", "--type", "merge", "-p",
              json.dumps({"spec": {"gpu": {"count": 1, "deviceClassName": None}}}))
    wait_until(lambda: (template(c, "gd") or {}).get("spec", {}).get("spec", {}).get(
        "devices", {}).get("requests", [{}])[0].get("deviceClassName") == "gpu.nvidia.com",
        "gd's template made again with the default class")
    assert template(c, "gd")["spec"]["spec"]["devices"]["requests"][0]["count"] == 1
    wait_until(lambda: len(live_pods(c, "gd")) == 2 and all(
        p["metadata"]["labels"]["cohort.dev/template-hash"] != old_hash
        for p in live_pods(c, "gd")), "gd's pods to roll", timeout=120)
    assert events(c, "gd", "GPUClaimTemplateReplaced")

    c.kubectl("delete", "tc", "gd", "--wait=true")
    wait_until(lambda: template(c, "gd") is None and not live_pods(c, "gd"),
               "gd's template and pods to go with it")


def gpu_reduce_of(pod):
    args = sidecar_of(pod)["args"]
    at = [i for i, a in enumerate(args) if a == "--gpu-reduce"]
    assert len(at) <= 1, args
    return args[at[0] + 1] if at else None


def test_gpu_reduce_is_the_sidecars_argument_and_a_change_rolls_the_pods(cluster):
    c = cluster
    apply(c, manifest("gr", {"mode": "dra", "reduce": "host"}))

    # One list per poll: each call is a snapshot of its own, and a roll
    # in flight can differ between two.
    def two(fresh=lambda p: True):
        pods = live_pods(c, "gr")
        return len(pods) == 2 and all(fresh(p) for p in pods) and pods

    pods = wait_until(two, "two pods of gr")
    assert [gpu_reduce_of(p) for p in pods] == ["host", "host"]
    old_hash = pods[0]["metadata"]["labels"]["cohort.dev/template-hash"]
    c.kubectl("patch", "tc", "gr", "--type", "merge", "-p",
              json.dumps({"spec": {"gpu": {"reduce": None}}}))
    pods = wait_until(lambda: two(lambda p: p["metadata"]["labels"]["cohort.dev/template-hash"]
                                  != old_hash), "gr's pods to roll", timeout=120)
    assert [gpu_reduce_of(p) for p in pods] == ["nccl", "nccl"], "the default, nccl"
    c.kubectl("delete", "tc", "gr", "--wait=true")
    wait_until(lambda: not live_pods(c, "gr"), "gr's pods to go with it")


def test_a_template_deleted_by_hand_is_made_again_before_new_pods(cluster):
    c = cluster
    apply(c, manifest("gx", {"mode": "dra"}, replicas=1))
    wait_until(lambda: template(c, "gx") and live_pods(c, "gx"), "gx's template and pod")
    c.kubectl("delete", "resourceclaimtemplate", "gx-gpu")
    assert template(c, "gx") is None
    c.kubectl("scale", "tc/gx", "--replicas=2")
    wait_until(lambda: len(live_pods(c, "gx")) == 2, "gx's second pod")
    t = wait_until(lambda: template(c, "gx"), "gx's template made again")
    assert t["metadata"]["ownerReferences"][0]["name"] == "gx"
    # Another pod finds the template as the operator would make it: it is
    # kept (the server's writing of it back compares equal), not made again.
    uid = t["metadata"]["uid"]
    c.kubectl("scale", "tc/gx", "--replicas=3")
    wait_until(lambda: len(live_pods(c, "gx")) == 3, "gx's third pod")
    assert template(c, "gx")["metadata"]["uid"] == uid
    assert not events(c, "gx", "GPUClaimTemplateReplaced")
    c.kubectl("delete", "tc", "gx", "--wait=true")


def test_device_plugin_gives_the_trainer_alone_the_gpus(cluster):
    c = cluster
    apply(c, manifest("gp", {"mode": "devicePlugin", "count": 3}, replicas=1))
    pod = wait_until(lambda: live_pods(c, "gp") and live_pods(c, "gp")[0], "gp's pod")
    trainer = pod["spec"]["containers"][0]
    assert trainer["resources"]["limits"]["nvidia.com/gpu"] == "3", trainer["resources"]
    assert not claims_of(trainer) and not claims_of(sidecar_of(pod))
    assert "nvidia.com/gpu" not in (sidecar_of(pod)["resources"].get("limits") or {})
    assert "resourceClaims" not in pod["spec"]
    assert template(c, "gp") is None
    c.kubectl("delete", "tc", "gp", "--wait=true")


@pytest.mark.parametrize("gpu,words", [
    ({"count": 1}, "spec.gpu.mode: Required value"),
    ({"mode": "mig"}, 'spec.gpu.mode: Unsupported value: "mig"'),
    ({"mode": "dra", "count": 0}, "spec.gpu.count: Invalid value: 0"),
    ({"mode": "dra", "count": 17}, "spec.gpu.count: Invalid value: 17"),
    ({"mode": "devicePlugin", "deviceClassName": "gpu.nvidia.com"},
     "spec.gpu.deviceClassName is only for mode dra"),
    ({"mode": "dra", "deviceClassName": "GPU_class"}, "spec.gpu.deviceClassName: Invalid value"),
    ({"mode": "dra", "vendor": "x"}, 'unknown field "spec.gpu.vendor"'),
    ({"mode": "devicePlugin", "reduce": "host"}, "spec.gpu.reduce is only for mode dra"),
    ({"mode": "dra", "reduce": "gloo"}, 'spec.gpu.reduce: Unsupported value: "gloo"'),
])
def test_a_bad_gpu_spec_is_refused_by_the_api_server(cluster, gpu, words):
    c = cluster
    r = c.kubectl("apply", "-f", "-", stdin=json.dumps(manifest("g-bad", gpu)), check=False)
    assert r.returncode != 0 and words in r.stderr, r.stderr
    assert c.kubectl("get", "tc", "g-bad", check=False).returncode != 0, "nothing was stored"


def test_the_reserved_claim_name_fails_the_cohort(cluster):
    c = cluster
    m = manifest("gr", {"mode": "dra"}, replicas=1)
    m["spec"]["template"]["spec"]["resourceClaims"] = [{"name": CLAIM,
                                                        "resourceClaimName": "mine"}]
    apply(c, m)
    wait_until(lambda: (condition(c, "gr", "Failed") or {}).get("reason") == "InvalidTemplate",
               "gr to fail with InvalidTemplate")
    assert CLAIM in condition(c, "gr", "Failed")["message"]
    assert not live_pods(c, "gr") and template(c, "gr") is None
    c.kubectl("delete", "tc", "gr", "--wait=true")


def test_a_template_of_that_name_that_is_anothers_is_left_alone(cluster):
    c = cluster
    theirs = {"apiVersion": "resource.k8s.io/v1beta1", "kind": "ResourceClaimTemplate",
              "metadata": {"name": "gt-gpu", "namespace": "default"},
              "spec": {"spec": {"devices": {"requests": [{"name": "x",
                                                          "deviceClassName": "other"}]}}}}
    apply(c, theirs)
    apply(c, manifest("gt", {"mode": "dra"}, replicas=1))
    wait_until(lambda: (condition(c, "gt", "Failed") or {}).get("reason") ==
               "GPUClaimTemplateTaken", "gt to fail with GPUClaimTemplateTaken")
    assert not live_pods(c, "gt")
    left = template(c, "gt")
    assert left["spec"]["spec"]["devices"]["requests"][0]["deviceClassName"] == "other", left
    assert "ownerReferences" not in left["metadata"], left
    # Once the name is free the cohort runs.
    c.kubectl("delete", "resourceclaimtemplate", "gt-gpu")
    wait_until(lambda: live_pods(c, "gt"), "gt's pod once the name is free")
    assert template(c, "gt")["metadata"]["ownerReferences"][0]["name"] == "gt"
    c.kubectl("delete", "tc", "gt", "--wait=true")


def test_the_standin_refuses_a_bad_claim_template_and_a_change_of_one(cluster):
    c = cluster
    bad = {"apiVersion": "resource.k8s.io/v1beta1", "kind": "ResourceClaimTemplate",
           "metadata": {"name": "bad", "namespace": "default"},
           "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "count": 0,
                                                       "deviceClassName": "gpu.nvidia.com"}]}}}}
    r = c.kubectl("apply", "-f", "-", stdin=json.dumps(bad), check=False)
    assert r.returncode != 0 and \
        "spec.spec.devices.requests[0].count: Invalid value: 0: must be greater than zero" in \
        r.stderr, r.stderr
    bad["spec"]["spec"]["devices"]["requests"][0]["count"] = 1
    apply(c, bad)
    bad["spec"]["spec"]["devices"]["requests"][0]["count"] = 2
    r = c.kubectl("apply", "-f", "-", stdin=json.dumps(bad), check=False)
    assert r.returncode != 0 and "field is immutable" in r.stderr, r.stderr
    c.kubectl("delete", "resourceclaimtemplate", "bad")


@pytest.fixture(scope="module")
def nodra():
    yield from operator_cluster("tgpn-", tls=False)


def test_dra_without_the_api_fails_the_cohort_and_device_plugin_runs(nodra):
    c = nodra
    apply(c, manifest("gn", {"mode": "dra"}, replicas=1))
    wait_until(lambda: (condition(c, "gn", "Failed") or {}).get("reason") == "DRAUnavailable",
               "gn to fail with DRAUnavailable")
    assert "resource.k8s.io/v1beta1" in condition(c, "gn", "Failed")["message"]
    assert not live_pods(c, "gn")
    c.kubectl("patch", "tc", "gn", "--type", "merge", "-p",
              json.dumps({"spec": {"gpu": {"mode": "devicePlugin"}}}))
    pod = wait_until(lambda: live_pods(c, "gn") and live_pods(c, "gn")[0], "gn's pod")
    assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    wait_until(lambda: (condition(c, "gn", "Failed") or {}).get("status") == "False",
               "gn's Failed condition to clear")
    c.kubectl("delete", "tc", "gn", "--wait=true")

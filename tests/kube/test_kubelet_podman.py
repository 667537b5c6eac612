"""The kubelet's podman runtime (tests/kube/kubelet/podman.py): pods whose
containers are real `podman run`s of their images, against the API server
stand-in, with the real kubectl for logs.

Skipped, with the reason printed, only where podman cannot run a
container of the base image localhost/debian:bookworm-slim. The base is
made, as the image is, by scripts/image.sh (cohorttest.image builds the
image once per test process, which makes the base when it is missing).
The operator from the image, installed with the chart, is
test_cluster_podman.py.

Every pod here is small and short: a container costs podman about half a
second to start, and one more podman call to inspect and remove it.
"""
import os
import subprocess
import time

import pytest

from cohorttest import DEADLINE, ApiServer, Kubectl, Kubelet, make_tmp, remove_tmp, wait_until
from cohorttest import image as cimage
from kubelet.podman import LABEL

BASE = cimage.BASE


def podman(*args, env, timeout=DEADLINE, check=False):
    r = subprocess.run(["podman", *args], env=env, capture_output=True, text=True,
                       timeout=timeout)
    if check:
        assert r.returncode == 0, "podman %s: %s" % (" ".join(args), r.stderr)
    return r


def podman_env():
    """The environment the kubelet gives podman: CONTAINERS_CONF names the
    file scripts/image.sh --conf writes (cohorttest.image sets it)."""
    return dict(os.environ)


def why_no_podman():
    try:
        return cimage.why_podman_cannot_run()
    except cimage.BuildError as e:
        pytest.fail(str(e))


class Node:
    """The API server, a podman kubelet and kubectl."""

    def __init__(self, tmp, *extra):
        self.tmp = tmp
        self.env = podman_env()
        self.api = ApiServer(tmp)
        self.kubelet = Kubelet(self.api, tmp, "--runtime", "podman", *extra)
        self.state_dir = os.path.join(tmp, "st")
        self.kubectl = Kubectl(self.api, tmp)

    def stop(self):
        self.kubelet.stop()
        self.api.stop()

    def create(self, name, containers, **spec):
        spec = dict({"terminationGracePeriodSeconds": 5}, **spec, containers=containers)
        return self.api.ok("POST", "/api/v1/namespaces/default/pods",
                           {"apiVersion": "v1", "kind": "Pod",
                            "metadata": {"name": name, "namespace": "default"}, "spec": spec})

    def pod(self, name):
        return self.api.get("/api/v1/namespaces/default/pods/" + name)

    def status(self, name, container=None):
        """A container's status (the first's by default)."""
        p = self.pod(name)
        sts = ((p or {}).get("status") or {}).get("containerStatuses") or []
        for st in sts:
            if container is None or st["name"] == container:
                return st
        return None

    def wait_phase(self, name, *phases):
        return wait_until(lambda: (self.pod(name) or {}).get("status", {}).get("phase")
                          in phases and self.pod(name), "pod %s to be %s" % (name, phases))

    def logs(self, name, *args):
        return self.kubectl("logs", name, *args).stdout

    def ours(self):
        """This kubelet's containers in podman."""
        return podman("ps", "-a", "-q", "--filter", "label=%s=%s" % (LABEL, self.state_dir),
                      env=self.env, check=True).stdout.split()

    def delete(self, name, grace=None):
        q = "" if grace is None else "?gracePeriodSeconds=%d" % grace
        self.api.ok("DELETE", "/api/v1/namespaces/default/pods/%s%s" % (name, q))
        wait_until(lambda: self.pod(name) is None, "pod %s to go" % name)

    def volume_dir(self, pod, volume):
        return os.path.join(self.state_dir, "pods", pod["metadata"]["uid"], "volumes", volume)


@pytest.fixture(scope="module")
def node():
    why = why_no_podman()
    if why:
        print("skipping the podman kubelet tests:", why)
        pytest.skip(why)
    tmp = make_tmp("cohort-podman-")
    n = Node(tmp)
    if not n.kubectl.available():
        n.stop()
        remove_tmp(tmp)
        pytest.skip("no kubectl: %s" % n.kubectl.why_missing)
    yield n
    n.stop()
    assert n.ours() == [], "the kubelet left containers behind"
    remove_tmp(tmp)


def sh(name, script, **extra):
    return dict({"name": name, "image": BASE, "command": ["sh", "-c", script]}, **extra)


POD_IP = {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}


def test_logs_reach_kubectl_and_exit_codes(node):
    node.create("hello", [sh("main", "echo hello from $POD_IP; hostname; exit 3", env=[POD_IP])],
                restartPolicy="Never")
    p = node.wait_phase("hello", "Failed")
    st = p["status"]["containerStatuses"][0]
    assert st["state"]["terminated"]["exitCode"] == 3
    assert st["state"]["terminated"]["reason"] == "Error"
    assert st["state"]["terminated"]["containerID"].startswith("podman://k8s_main_hello_default_")
    assert st["imageID"].startswith("podman://")
    assert node.logs("hello") == "hello from %s\nhello\n" % p["status"]["podIP"]
    node.delete("hello")


def test_restarts_with_back_off(node):
    node.create("crash", [sh("c", "echo run; exit 2")])
    wait_until(lambda: (node.status("crash") or {}).get("restartCount", 0) >= 2,
               "two restarts")
    st = node.status("crash")
    assert st["lastState"]["terminated"]["exitCode"] == 2
    assert node.logs("crash", "--previous") == "run\n"
    node.delete("crash")


def test_command_not_found_is_a_start_error(node):
    node.create("nocmd", [{"name": "c", "image": BASE, "command": ["no-such-command"]}],
                restartPolicy="Never")
    p = node.wait_phase("nocmd", "Failed")
    term = p["status"]["containerStatuses"][0]["state"]["terminated"]
    assert term["reason"] == "StartError" and term["exitCode"] == 128
    assert "no-such-command" in term["message"]
    node.delete("nocmd")


def test_readiness_exec_probe_runs_in_the_container(node):
    # The probe looks at /flag/ready inside the container; the test makes
    # and removes it through the emptyDir's directory on the host.
    probe = {"exec": {"command": ["test", "-f", "/flag/ready"]}, "periodSeconds": 1,
             "failureThreshold": 1}
    node.create("probed", [sh("c", "trap 'exit 0' TERM; while :; do sleep 0.1; done",
                              readinessProbe=probe,
                              volumeMounts=[{"name": "flag", "mountPath": "/flag"}])],
                volumes=[{"name": "flag", "emptyDir": {}}])
    p = node.wait_phase("probed", "Running")
    flag = os.path.join(node.volume_dir(p, "flag"), "ready")
    wait_until(lambda: node.status("probed")["started"], "the container to start")
    time.sleep(1.5)                     # a probe or two has failed by now
    assert node.status("probed")["ready"] is False
    open(flag, "w").close()
    wait_until(lambda: node.status("probed")["ready"], "ready once /flag/ready exists")
    os.remove(flag)
    wait_until(lambda: not node.status("probed")["ready"], "not ready once it is gone")
    node.delete("probed")


def test_secret_env_and_read_only_secret_volume(node):
    # The operator's pods in miniature: a Secret's key readable by its
    # owner alone (0400), a container that is not root, the pod's fsGroup.
    node.api.ok("POST", "/api/v1/namespaces/default/secrets",
                {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s1"},
                 "stringData": {"token": "s3cret", "file.txt": "in a file"}})
    script = ('echo "env=$TOKEN"; cat /etc/s1/file.txt; echo; '
              'touch /etc/s1/new 2>/dev/null && echo writable || echo read-only; '
              'stat -c "%a %g" /etc/s1/file.txt; touch /scratch/mine && echo scratch ok')
    node.create("sec", [sh("c", script, env=[{"name": "TOKEN", "valueFrom": {"secretKeyRef": {
        "name": "s1", "key": "token"}}}], securityContext={"runAsUser": 1000},
        volumeMounts=[{"name": "s", "mountPath": "/etc/s1"},
                      {"name": "scratch", "mountPath": "/scratch"}])],
        volumes=[{"name": "s", "secret": {"secretName": "s1", "defaultMode": 0o400}},
                 {"name": "scratch", "emptyDir": {}}],
        securityContext={"fsGroup": 2000}, restartPolicy="Never")
    node.wait_phase("sec", "Succeeded")
    assert node.logs("sec") == "env=s3cret\nin a file\nread-only\n440 2000\nscratch ok\n"
    node.delete("sec")


def test_security_context(node):
    script = ('id -u; id -g; id -G; touch /rootfs 2>/dev/null && echo rw || echo ro; '
              'grep -E "^(NoNewPrivs|CapEff)" /proc/self/status')
    node.create("secctx", [sh("c", script, securityContext={
        "runAsUser": 1234, "runAsGroup": 2345, "runAsNonRoot": True,
        "readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]}})],
        securityContext={"supplementalGroups": [3456]}, restartPolicy="Never")
    node.wait_phase("secctx", "Succeeded")
    out = node.logs("secctx").split("\n")
    assert out[:4] == ["1234", "2345", "2345 3456", "ro"], out
    assert "NoNewPrivs:\t1" in out and "CapEff:\t0000000000000000" in out, out
    node.delete("secctx")
    # runAsNonRoot refuses a container that would run as the image's root.
    node.create("asroot", [sh("c", "id -u")], securityContext={"runAsNonRoot": True},
                restartPolicy="Never")
    w = wait_until(lambda: ((node.status("asroot") or {}).get("state") or {}).get("waiting", {})
                   .get("reason") == "CreateContainerConfigError" and node.status("asroot"),
                   "CreateContainerConfigError")
    assert "image will run as root" in w["state"]["waiting"]["message"]
    assert node.pod("asroot")["status"]["phase"] == "Pending"
    node.delete("asroot")


def test_missing_image(node):
    node.create("noimage", [{"name": "c", "image": "localhost/no-such-image:1",
                             "command": ["true"]}])
    node.create("neverpull", [{"name": "c", "image": "localhost/no-such-image:1",
                               "imagePullPolicy": "Never", "command": ["true"]}])
    seen = set()

    def reasons():
        st = node.status("noimage") or {}
        seen.add(((st.get("state") or {}).get("waiting") or {}).get("reason"))
        return {"ErrImagePull", "ImagePullBackOff"} <= seen
    wait_until(reasons, "ErrImagePull, then ImagePullBackOff")
    st = node.status("noimage")
    assert "localhost/no-such-image:1" in st["state"]["waiting"]["message"]
    assert node.pod("noimage")["status"]["phase"] == "Pending"
    wait_until(lambda: (node.status("neverpull") or {}).get("state", {}).get("waiting", {})
               .get("reason") == "ErrImageNeverPull", "ErrImageNeverPull")
    # The kubelet carries on: another pod runs, and both delete at once.
    node.create("after", [sh("c", "echo fine")], restartPolicy="Never")
    node.wait_phase("after", "Succeeded")
    for name in ("noimage", "neverpull", "after"):
        node.delete(name)


def test_deletion_with_grace_period(node):
    # "polite" exits on SIGTERM, which comes after its preStop hook has
    # run; "stubborn" ignores SIGTERM and is killed when the 2 s grace
    # period ends.
    polite = sh("polite", "trap 'cat /shared/prestop; echo got TERM; exit 0' TERM; "
                "while :; do sleep 0.1; done",
                lifecycle={"preStop": {"exec": {"command": ["sh", "-c",
                                                            "echo hook > /shared/prestop"]}}},
                volumeMounts=[{"name": "shared", "mountPath": "/shared"}])
    stubborn = sh("stubborn", "trap '' TERM; while :; do sleep 0.1; done")
    node.create("bye", [polite, stubborn], terminationGracePeriodSeconds=2,
                volumes=[{"name": "shared", "emptyDir": {}}])
    p = node.wait_phase("bye", "Running")
    wait_until(lambda: len(node.ours()) == 2, "two containers in podman")
    log_dir = os.path.join(node.tmp, "logs", "default_bye_" + p["metadata"]["uid"])
    t = time.monotonic()
    node.api.ok("DELETE", "/api/v1/namespaces/default/pods/bye")
    statuses = {}

    def finished():
        q = node.pod("bye")
        for st in ((q or {}).get("status") or {}).get("containerStatuses") or []:
            if "terminated" in st["state"]:
                statuses[st["name"]] = st["state"]["terminated"]
        return q is None
    wait_until(finished, "the pod to go")
    took = time.monotonic() - t
    assert 2 <= took < 2 + DEADLINE / 2, took
    with open(os.path.join(log_dir, "polite", "0.log")) as f:
        assert f.read() == "hook\ngot TERM\n"
    assert statuses.get("polite", {}).get("exitCode", 0) == 0
    assert statuses.get("stubborn", {}).get("exitCode", 137) == 137
    assert node.ours() == []


def test_command_and_args_override_entrypoint_and_cmd(node):
    tag = "localhost/cohort-kubelet-test:%d" % os.getpid()
    ctx = os.path.join(node.tmp, "ctx")
    os.makedirs(ctx)
    with open(os.path.join(ctx, "Containerfile"), "w") as f:
        f.write("FROM %s\nUSER 1000\nENTRYPOINT [\"/bin/echo\", \"ep\"]\nCMD [\"cmd\"]\n" % BASE)
    podman("build", "-q", "-t", tag, ctx, env=node.env, check=True)
    try:
        cases = {"neither": ({}, "ep cmd"), "args": ({"args": ["a", "$(X)"]}, "ep a x"),
                 "command": ({"command": ["/bin/echo", "c"]}, "c"),
                 "both": ({"command": ["/bin/echo", "c"], "args": ["a"]}, "c a")}
        for name, (extra, _) in cases.items():
            node.create(name, [dict({"name": "c", "image": tag,
                                     "env": [{"name": "X", "value": "x"}],
                                     "securityContext": {"runAsNonRoot": True}}, **extra)],
                        restartPolicy="Never")
        for name, (_, want) in cases.items():
            node.wait_phase(name, "Succeeded")
            assert node.logs(name) == want + "\n", name
            node.delete(name)
    finally:
        podman("rmi", "-f", tag, env=node.env)


def test_leftovers_are_removed_and_nothing_outlives_the_kubelet():
    why = why_no_podman()
    if why:
        print("skipping the podman kubelet tests:", why)
        pytest.skip(why)
    tmp = make_tmp("cohort-podman-")
    env = podman_env()
    state_dir = os.path.join(tmp, "st")
    label = "label=%s=%s" % (LABEL, state_dir)
    # A container as an earlier kubelet with this state dir left it.
    leftover = "cohort-leftover-%d" % os.getpid()
    podman("run", "-d", "--name", leftover, "--label", "%s=%s" % (LABEL, state_dir), BASE,
           "sleep", "600", env=env, check=True)
    try:
        n = Node(tmp)
        try:
            assert podman("ps", "-a", "-q", "--filter", label, env=env).stdout.split() == []
            n.create("lives", [sh("c", "trap 'exit 0' TERM; while :; do sleep 0.1; done")])
            wait_until(lambda: len(n.ours()) == 1, "the pod's container")
        finally:
            n.stop()
    finally:
        podman("rm", "-f", "-t", "0", leftover, env=env)
    assert podman("ps", "-a", "-q", "--filter", label, env=env).stdout.split() == []
    remove_tmp(tmp)

"""The container image (Dockerfile, scripts/image.sh) run with podman.

- Every binary it holds runs its --help, from PATH under the names pods
  use (cohort-example-NAME for each examples/c/NAME.c).
- It runs as a numeric non-root user, carries the OCI labels with this
  checkout's version and commit, holds no compiler and no -dev package,
  and every binary finds its libraries.
- A 2-member cohort from the image alone: a standalone broker, and per
  member a sidecar and an example trainer in containers of their own
  sharing the socket's folder (as a pod's two containers share an
  emptyDir), on the host's loopback, with a key file. Both trainers reach
  the target version, agree, and match single-process SGD run in the image.
- A missing or unreadable key file is a clear error and exit status 2.
"""
import datetime
import json
import os
import re
import subprocess

import pytest

from cohorttest import (DEADLINE, PROC_TIMEOUT, ROOT, Proc, Procs, finish, latest_epoch,
                        make_tmp, remove_tmp, spawn_group, wait_until)
from cohorttest.programs import write_key
from imagetest import podman

FINAL = re.compile(r"^final model_version=(\d+) digest=([0-9a-f]{16})$")
EXAMPLES = sorted(n[:-2] for n in os.listdir(os.path.join(ROOT, "examples", "c"))
                  if n.endswith(".c"))
BINARIES = ["cohort-operator", "cohort-sidecar", "cohortctl"] + \
           ["cohort-example-" + n for n in EXAMPLES]


def image_config(image):
    r = podman("image", "inspect", image, "--format", "{{json .Config}}")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def run_in(containers, image, *argv, timeout=120):
    """argv in a container of the image, off the host's network (removed at the
    test's end even when the command times out)."""
    return podman(*containers.run_argv(image, "run", *argv, network="none")[1:],
                  timeout=timeout)


def image_user(image):
    """The image's (uid, gid)."""
    uid, _, gid = image_config(image)["User"].partition(":")
    return int(uid), int(gid or uid)


def give(path, image):
    """Makes path the image user's: mounted into a container, the files
    are the host's, and the container's user is not root."""
    if os.geteuid() == 0:
        os.chown(path, *image_user(image))
    else:
        os.chmod(path, 0o777 if os.path.isdir(path) else 0o644)
    return path


@pytest.fixture
def tmp(image):
    """A temp folder the image's user can write to."""
    d = give(make_tmp("cohort-img-"), image)
    try:
        yield d
    finally:
        remove_tmp(d)


# ---- what it holds -----------------------------------------------------------

@pytest.mark.parametrize("name", BINARIES)
def test_each_binary_runs_its_help_from_path(image, containers, name):
    r = run_in(containers, image, name, "--help")
    assert r.returncode == 0, "%s --help: exit %d\n%s" % (name, r.returncode, r.stderr)
    assert "Usage" in r.stdout + r.stderr, r.stdout


def test_runs_as_a_numeric_non_root_user(image, containers):
    user = image_config(image)["User"]
    m = re.fullmatch(r"(\d+):(\d+)", user)
    assert m, "USER %r is not numeric uid:gid (Kubernetes' runAsNonRoot needs one)" % user
    assert int(m.group(1)) != 0 and int(m.group(2)) != 0
    r = run_in(containers, image, "id", "-u")
    assert r.returncode == 0 and r.stdout.strip() == m.group(1), r.stdout + r.stderr


def test_carries_the_oci_labels_of_this_checkout(image):
    labels = image_config(image)["Labels"]
    with open(os.path.join(ROOT, "VERSION")) as f:
        version = f.read().strip()
    assert labels["org.opencontainers.image.version"] == version
    assert labels["org.opencontainers.image.title"] == "cohort"
    assert labels["org.opencontainers.image.source"].startswith("https://")
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:
        assert re.fullmatch(re.escape(head.stdout.strip()) + r"(-dirty)?",
                            labels["org.opencontainers.image.revision"]), labels
        t = subprocess.run(["git", "-C", ROOT, "log", "-1", "--format=%ct"],
                           capture_output=True, text=True).stdout.strip()
        want = datetime.datetime.fromtimestamp(int(t), datetime.timezone.utc)
        assert labels["org.opencontainers.image.created"] == want.strftime("%Y-%m-%dT%H:%M:%SZ")
    assert "unknown" not in (labels["org.opencontainers.image.version"],
                             labels["org.opencontainers.image.revision"])


def test_holds_only_runtime_libraries_and_every_binary_finds_its_own(image, containers):
    script = ("dpkg-query -W -f '${Package}=${Version}\\n'; echo ---; "
              "cat /usr/share/cohort/runtime-packages; echo ---; "
              "for b in %s; do ldd /usr/local/bin/$b; done" % " ".join(BINARIES))
    r = run_in(containers, image, "sh", "-c", script)
    assert r.returncode == 0, r.stderr
    installed, wanted, ldd = r.stdout.split("---\n")
    names = [l.split("=")[0] for l in installed.split()]
    assert not [n for n in names if n.endswith("-dev")], names
    assert not set(names) & {"gcc", "gcc-12", "cpp", "cpp-12", "binutils", "make", "clang"}
    # The packages the builder found the binaries linking, at its versions.
    assert wanted.split() and set(wanted.split()) <= set(installed.split()), (wanted, installed)
    assert "libgrpc29" in wanted
    assert "not found" not in ldd, ldd


# ---- a cohort from the image -------------------------------------------------

def test_two_member_cohort_from_the_image_trains_and_agrees(image, containers, tmp):
    keydir = os.path.join(tmp, "key")
    os.mkdir(keydir)
    give(write_key(os.path.join(keydir, "key")), image)
    common = ["--steps", "40", "--virtual-batch", "96", "--linger", "500ms",
              "--stall-timeout", "%ds" % DEADLINE]
    procs = Procs()
    try:
        broker = procs.add(Proc(containers.run_argv(
            image, "broker", "cohort-operator", "--standalone", "--listen", "127.0.0.1:0",
            "--cohort", "imagetest", "--log-format", "json", "--secret-file", "/etc/cohort/key",
            volumes=[(keydir, "/etc/cohort:ro")]), "broker"))
        address = broker.wait_log("Broker is listening.")["address"]

        sidecars, trainers = [], []
        for i in range(2):
            member = "m%d" % i
            d = os.path.join(tmp, member)
            os.mkdir(d)
            give(d, image)
            vols = [(keydir, "/etc/cohort:ro"), (d, "/run/cohort")]
            sidecars.append(procs.add(Proc(containers.run_argv(
                image, member + "-sidecar", "cohort-sidecar", "--broker", address,
                "--cohort", "imagetest", "--id", member, "--log-format", "json",
                "--secret-file", "/etc/cohort/key", "--socket", "/run/cohort/sock",
                volumes=vols), member + "-sidecar")))
            wait_until(lambda: os.path.exists(os.path.join(d, "sock")),
                       "%s's sidecar to make its socket" % member)
            trainers.append(spawn_group(containers.run_argv(
                image, member + "-trainer", "cohort-example-" + "logreg", *common,
                "--wait-for", "2", "--params-out", "/run/cohort/params.txt",
                volumes=[(d, "/run/cohort")], env=["COHORT_SOCKET=unix:/run/cohort/sock"])))

        finals = []
        for i, t in enumerate(trainers):
            rc, out, err = finish(t, PROC_TIMEOUT, "trainer m%d" % i)
            assert rc == 0, "trainer m%d exit %d:\n%s" % (i, rc, err[-3000:])
            m = FINAL.match(out.strip().splitlines()[-1])
            assert m and m.group(1) == "40", out
            finals.append(out.strip().splitlines()[-1])
        assert finals[0] == finals[1], finals
        # Both members were in one epoch of two, from their sidecars' logs.
        for s in sidecars:
            assert any(e["n_members"] == 2 for e in s.logs("Adopted a new epoch.")), s.raw[-20:]
            assert latest_epoch(s) is not None

        # Single-process SGD at the same virtual batch, in the image too.
        ref = podman(*containers.run_argv(image, "local", "cohort-example-logreg", "--local",
                                          *common, "--params-out", "/out/local.txt",
                                          volumes=[(tmp, "/out")], network="none")[1:],
                     timeout=DEADLINE)
        assert ref.returncode == 0, ref.stderr
        want = read_params(os.path.join(tmp, "local.txt"))
        for i in range(2):
            got = read_params(os.path.join(tmp, "m%d" % i, "params.txt"))
            assert got == pytest.approx(want, rel=1e-4, abs=1e-5), "m%d" % i
    finally:
        procs.close()


def read_params(path):
    with open(path) as f:
        return [float(l) for l in f if l.strip()]


# ---- errors ------------------------------------------------------------------

def test_missing_key_file_is_a_clear_error(image, containers):
    for prog, extra in (("cohort-sidecar", ["--broker", "127.0.0.1:1", "--cohort", "c",
                                            "--id", "a"]),
                        ("cohort-operator", ["--standalone", "--listen", "127.0.0.1:0"])):
        r = podman(*containers.run_argv(image, prog, prog, *extra, "--secret-file",
                                        "/etc/cohort/key", network="none")[1:])
        assert r.returncode == 2, (prog, r.returncode, r.stderr)
        assert 'cannot use --secret-file "/etc/cohort/key": No such file or directory' \
            in r.stderr, r.stderr


def test_key_file_the_image_user_cannot_read_is_a_clear_error(image, containers, tmp):
    # As a Secret mounted with a mode and owner that leave the pod's user out.
    if os.geteuid() != 0:
        pytest.skip("needs root to make a file the image's user cannot read")
    keydir = os.path.join(tmp, "key")
    os.mkdir(keydir)
    write_key(os.path.join(keydir, "key"))          # root's, mode 0600
    r = podman(*containers.run_argv(image, "sidecar", "cohort-sidecar", "--broker",
                                    "127.0.0.1:1", "--cohort", "c", "--id", "a",
                                    "--secret-file", "/etc/cohort/key",
                                    volumes=[(keydir, "/etc/cohort:ro")], network="none")[1:])
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert 'cannot use --secret-file "/etc/cohort/key": Permission denied' in r.stderr, r.stderr

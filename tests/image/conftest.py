"""The image's tests run it with podman: scripts/image.sh writes the podman
configuration these machines need and builds the image (a few seconds when
nothing changed: podman's layer cache), and every test runs containers of
it. Where podman cannot run (no podman and no way to install it, or
`podman info` fails) every test skips and says why."""
import os
import shutil
import subprocess

import pytest

from cohorttest import ROOT
from imagetest import Containers

IMAGE_SH = os.path.join(ROOT, "scripts", "image.sh")
# A cold build (the base image made with debootstrap, every package
# fetched) on a loaded 2-core machine.
BUILD_TIMEOUT = 1800


@pytest.fixture(scope="session")
def podman_conf():
    """CONTAINERS_CONF for every podman call of the session, set in the
    environment so that child processes (cohorttest's Proc) inherit it."""
    r = subprocess.run([IMAGE_SH, "--conf"], capture_output=True, text=True, timeout=900)
    if shutil.which("podman") is None:
        pytest.skip("podman cannot run here: no podman binary, and scripts/image.sh could not "
                    "install it: %s" % (r.stderr or r.stdout).strip()[-500:])
    assert r.returncode == 0, "scripts/image.sh --conf: %s" % r.stderr[-2000:]
    conf = r.stdout.strip().splitlines()[-1]
    os.environ["CONTAINERS_CONF"] = conf
    info = subprocess.run(["podman", "info"], capture_output=True, text=True, timeout=120)
    if info.returncode != 0:
        pytest.skip("podman cannot run here: `podman info` failed: %s" % info.stderr.strip()[-500:])
    return conf


@pytest.fixture(scope="session")
def image(podman_conf):
    """The image's tag, built (or found in podman's layer cache) once."""
    r = subprocess.run([IMAGE_SH, "--print-tag"], capture_output=True, text=True,
                       timeout=BUILD_TIMEOUT)
    assert r.returncode == 0, "scripts/image.sh failed:\n%s" % r.stderr[-6000:]
    return r.stdout.strip().splitlines()[-1]


@pytest.fixture
def containers(podman_conf):
    c = Containers()
    try:
        yield c
    finally:
        c.remove()

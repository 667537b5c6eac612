"""The project's image for the tests that run it with podman
(tests/kube's podman kubelet): podman's configuration as
scripts/image.sh writes it, and a build of the image from this tree.

The image is built (`scripts/image.sh --print-tag`) once per test process,
never merely found: a localhost/cohort:dev from an older tree must not be
what is tested. When nothing changed podman's layer cache makes that a
few seconds; a cold build (the base image made with debootstrap, every
package fetched) takes 6 to 12 minutes, longer on a loaded 2-core
machine, hence BUILD_TIMEOUT. COHORT_IMAGE names an image to test
instead, which must then be in podman's store.

Only where podman cannot run is the answer a reason to skip; a build that
fails is an error.
"""
import os
import shutil
import subprocess
import time
import uuid

from .core import ROOT

IMAGE_SH = os.path.join(ROOT, "scripts", "image.sh")
BASE = "localhost/debian:bookworm-slim"
# A cold build on a loaded 2-core machine, with room to spare.
BUILD_TIMEOUT = 2400

_conf = None        # (path, why)
_image = None       # (tag, why, seconds the build took)


class BuildError(Exception):
    """scripts/image.sh failed where podman can run."""


def podman_conf():
    """(path of build/podman/containers.conf, None), CONTAINERS_CONF set to
    it in this process's environment so that every podman call and child
    inherits it; or (None, why podman cannot run here). scripts/image.sh
    installs podman and its tools with apt when they are missing."""
    global _conf
    if _conf is None:
        try:
            r = subprocess.run([IMAGE_SH, "--conf"], capture_output=True, text=True,
                               timeout=900, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as e:
            r = subprocess.CompletedProcess([IMAGE_SH], 1, "", str(e))
        if shutil.which("podman") is None:
            _conf = (None, "podman cannot run here: no podman binary, and scripts/image.sh "
                     "could not install it: %s" % (r.stderr or r.stdout).strip()[-500:])
        elif r.returncode != 0:
            _conf = (None, "podman cannot run here: scripts/image.sh --conf failed: %s"
                     % (r.stderr or r.stdout).strip()[-500:])
        else:
            path = r.stdout.strip().splitlines()[-1]
            os.environ["CONTAINERS_CONF"] = path
            info = subprocess.run(["podman", "info"], capture_output=True, text=True,
                                  timeout=120, stdin=subprocess.DEVNULL)
            _conf = (path, None) if info.returncode == 0 else (
                None, "podman cannot run here: `podman info` failed: %s"
                % info.stderr.strip()[-500:])
    return _conf


def current_image():
    """(tag, None) of an image built from this tree (or COHORT_IMAGE), or
    (None, why) where podman cannot run. Raises BuildError when the build
    fails. Building also makes the base image BASE when it is missing."""
    global _image
    if _image is not None:
        return _image[:2]
    conf, why = podman_conf()
    if why:
        _image = (None, why, 0)
        return _image[:2]
    named = os.environ.get("COHORT_IMAGE")
    if named:
        r = subprocess.run(["podman", "image", "exists", named], stdin=subprocess.DEVNULL)
        if r.returncode != 0:
            raise BuildError("COHORT_IMAGE %s is not in podman's store" % named)
        _image = (named, None, 0)
        return _image[:2]
    t0 = time.monotonic()
    print("building the image with scripts/image.sh --print-tag (seconds when nothing "
          "changed; a cold build takes minutes)", flush=True)
    try:
        r = subprocess.run([IMAGE_SH, "--print-tag"], capture_output=True, text=True,
                           timeout=BUILD_TIMEOUT, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise BuildError("scripts/image.sh did not finish in %d s" % BUILD_TIMEOUT)
    if r.returncode != 0:
        raise BuildError("scripts/image.sh failed:\n%s" % r.stderr[-6000:])
    took = time.monotonic() - t0
    print("image %s ready in %.0f s" % (r.stdout.strip(), took), flush=True)
    _image = (r.stdout.strip().splitlines()[-1], None, took)
    return _image[:2]


def why_podman_cannot_run():
    """None once podman runs a container of the base image (made by the
    image's build when it was missing); else why not. Raises BuildError as
    current_image()."""
    tag, why = current_image()
    if why:
        return why
    r = subprocess.run(["podman", "run", "--rm", "--network=host", BASE, "true"],
                       capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        return "podman cannot run a container here: %s" % r.stderr.strip()[-500:]
    return None


class PinnedImage:
    """A tag of this test's own on the image `tag` names now: podman's
    store is shared by everything on the machine, and another build may
    move localhost/cohort:dev while the test runs. remove() drops the tag
    only (the image stays)."""

    def __init__(self, tag):
        r = subprocess.run(["podman", "image", "inspect", "--format", "{{.Id}}", tag],
                           capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
        assert r.returncode == 0, "podman image inspect %s: %s" % (tag, r.stderr)
        self.id = r.stdout.strip()
        self.repository = tag.rsplit(":", 1)[0] if ":" in tag.rsplit("/", 1)[-1] else tag
        self.tag = "test-%s" % uuid.uuid4().hex[:10]
        self.ref = "%s:%s" % (self.repository, self.tag)
        r = subprocess.run(["podman", "tag", self.id, self.ref], capture_output=True, text=True,
                           timeout=120, stdin=subprocess.DEVNULL)
        assert r.returncode == 0, "podman tag: %s" % r.stderr

    def remove(self):
        subprocess.run(["podman", "untag", self.id, self.ref], capture_output=True,
                       timeout=120, stdin=subprocess.DEVNULL)

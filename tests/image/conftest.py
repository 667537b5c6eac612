"""The image's tests run it with podman: scripts/image.sh writes the podman
configuration these machines need and builds the image (a few seconds when
nothing changed: podman's layer cache), and every test runs containers of
it. Where podman cannot run (no podman and no way to install it, or
`podman info` fails) every test skips and says why."""
import pytest

from cohorttest import image as cimage
from imagetest import Containers


@pytest.fixture(scope="session")
def podman_conf():
    """CONTAINERS_CONF for every podman call of the session, set in the
    environment so that child processes (cohorttest's Proc) inherit it."""
    conf, why = cimage.podman_conf()
    if why:
        pytest.skip(why)
    return conf


@pytest.fixture(scope="session")
def image(podman_conf):
    """The image's tag, built from this tree once per session (seconds
    when podman's layer cache has it: `make test` builds it first in
    tests/kube)."""
    try:
        tag, why = cimage.current_image()
    except cimage.BuildError as e:
        pytest.fail(str(e))
    if why:
        pytest.skip(why)
    return tag


@pytest.fixture
def containers(podman_conf):
    c = Containers()
    try:
        yield c
    finally:
        c.remove()

"""A hostile trainer against a real cohort-sidecar: it speaks the trainer
link (src/accumulator/tlink.h) by hand and tries to kill the sidecar through
the memory they share.

- A tensors memfd without seals is refused with EPERM at REGISTER, so
  shrinking it afterwards touches nothing of the sidecar's.
- A sealed memfd cannot shrink: ftruncate fails in the trainer.
- A hugetlbfs memfd (which could fault when huge pages run out) is refused.
- A second client is turned away with EBUSY while the first holds the
  session, and the sidecar serves the first one throughout.
- A tensor layout (SET_SHAPES) that lies about its count, or does not fit
  the gradients, is refused and changes nothing.

Each time the sidecar stays alive and still answers."""
import errno
import fcntl
import os
import re
import socket
import struct

import pytest

from cohorttest import make_tmp, remove_tmp, start_broker, start_sidecar, wait_until

MAGIC = 0x31686F63
# The trainer link's version, read from the header so that the two never part.
_TLINK_H = os.path.join(os.path.dirname(__file__), "..", "..", "src", "accumulator", "tlink.h")
with open(_TLINK_H) as _f:
    VERSION = int(re.search(r"#define TLINK_VERSION (\d+)u", _f.read()).group(1))
TL_HELLO, TL_REGISTER, TL_VIEW, TL_REPLY = 1, 2, 3, 100
HDR = struct.Struct("<IHHIi")
HELLO = struct.Struct("<I64s")
REGISTER = struct.Struct("<II9Q64siI")
VIEWPAGE_BYTES = 4096
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


def call(sock, mtype, body=b"", fds=()):
    """One request; returns the reply's status (0 or -errno), or None when
    the sidecar closed the connection."""
    msg = HDR.pack(MAGIC, VERSION, mtype, len(body), 0) + body
    if fds:
        socket.send_fds(sock, [msg], list(fds))
    else:
        sock.send(msg)
    data = sock.recv(HDR.size + 2048)
    if not data:
        return None
    magic, _, rtype, _, status = HDR.unpack_from(data)
    assert magic == MAGIC and rtype == TL_REPLY
    return status


def layout():
    """A valid layout: 16 float32 gradients, the view page last."""
    region = 256 + VIEWPAGE_BYTES
    body = REGISTER.pack(0, 0, region, 0, 64, 64, 16, 128, 256, 192, 0, b"", 0, 0)
    return region, body


def memfd(region, sealed, flags=0):
    fd = os.memfd_create("rogue-tensors", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | flags)
    os.ftruncate(fd, region)
    if sealed:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    return fd


def connect(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(30)
    s.connect(path)
    return s


@pytest.fixture
def sidecar():
    tmp = make_tmp()
    broker = start_broker()
    path = os.path.join(tmp, "trainer.sock")
    sc = start_sidecar(broker.address, "rogue", "r-0", "--socket", path)
    wait_until(lambda: os.path.exists(path), "the trainer socket")
    sc.socket_path = path
    yield sc
    sc.stop()
    broker.stop()
    remove_tmp(tmp)


def hello(s):
    assert call(s, TL_HELLO, HELLO.pack(VERSION, b"rogue")) == 0


def test_a_memfd_that_can_shrink_is_refused_and_shrinking_it_harms_nothing(sidecar):
    s = connect(sidecar.socket_path)
    hello(s)
    region, body = layout()
    fd = memfd(region, sealed=False)
    assert call(s, TL_REGISTER, body, [fd]) == -errno.EPERM
    os.ftruncate(fd, 0)
    assert call(s, TL_VIEW) == -errno.ENODEV, "the sidecar answers, with nothing registered"
    assert sidecar.alive()
    os.close(fd)
    s.close()


def test_a_sealed_memfd_cannot_shrink_under_the_sidecar(sidecar):
    s = connect(sidecar.socket_path)
    hello(s)
    region, body = layout()
    fd = memfd(region, sealed=True)
    assert call(s, TL_REGISTER, body, [fd]) == 0
    with pytest.raises(PermissionError):
        os.ftruncate(fd, 0)
    with pytest.raises(PermissionError):
        os.ftruncate(fd, region * 2)
    assert call(s, TL_VIEW) == 0
    # A second client is refused at once and the first keeps its session.
    other = connect(sidecar.socket_path)
    data = other.recv(HDR.size)
    assert HDR.unpack_from(data)[4] == -errno.EBUSY, "told why, before it says anything"
    assert other.recv(HDR.size) == b"", "and closed"
    other.close()
    assert call(s, TL_VIEW) == 0
    assert sidecar.alive()
    os.close(fd)
    s.close()


def test_a_hugetlbfs_memfd_is_refused(sidecar):
    region, body = layout()
    try:
        fd = memfd(2 << 20, sealed=True, flags=os.MFD_HUGETLB)
    except OSError as e:
        pytest.skip("no hugetlbfs memfd on this kernel: %s" % e)
    body = REGISTER.pack(0, 0, 2 << 20, 0, 64, 64, 16, 128, 256, 192, 0, b"", 0, 0)
    s = connect(sidecar.socket_path)
    hello(s)
    assert call(s, TL_REGISTER, body, [fd]) == -errno.EPERM
    assert sidecar.alive()
    os.close(fd)
    s.close()


TL_SET_SHAPES = 12
U64 = struct.Struct("<Q")
SHAPE = struct.Struct("<4Q")
SHAPES_MAX = 65536


def shapes_fd(data):
    fd = os.memfd_create("rogue-shapes", os.MFD_CLOEXEC)
    os.write(fd, data)
    return fd


def test_a_lying_tensor_layout_is_refused_and_changes_nothing(sidecar):
    """SET_SHAPES carries a count and a memfd: a count over the cap is
    refused before anything is read, a memfd larger than the count says
    is never read whole, one shorter is a protocol error, and a layout
    that does not fit the registered gradients (16 of them) is EINVAL.
    A good one is then taken, and the sidecar still answers."""
    s = connect(sidecar.socket_path)
    hello(s)
    region, body = layout()
    fd = memfd(region, sealed=True)
    good = SHAPE.pack(0, 12, 4, 3) + SHAPE.pack(12, 4, 4, 1)
    cases = [
        (SHAPES_MAX + 1, good, -errno.EINVAL),                    # too many
        (1, good, -errno.E2BIG),                                  # memfd beyond the count
        (2, good[:40], -errno.EPROTO),                            # memfd short of it
        (2, SHAPE.pack(0, 12, 4, 3) + SHAPE.pack(11, 4, 4, 1), -errno.EINVAL),   # overlap
        (1, SHAPE.pack(8, 12, 4, 3), -errno.EINVAL),              # past the 16 gradients
        (1, SHAPE.pack(0, 12, 4, 4), -errno.EINVAL),              # count is not rows x cols
        (1, SHAPE.pack(2 ** 64 - 4, 8, 8, 1), -errno.EINVAL),     # offset + count wraps
    ]
    assert call(s, TL_SET_SHAPES, U64.pack(2), [shapes_fd(good)]) == -errno.ENODEV, \
        "nothing registered yet"
    assert call(s, TL_REGISTER, body, [fd]) == 0
    for k, data, want in cases:
        sfd = shapes_fd(data)
        assert call(s, TL_SET_SHAPES, U64.pack(k), [sfd]) == want, (k, len(data))
        os.close(sfd)
    assert call(s, TL_SET_SHAPES, U64.pack(2)) == -errno.EPROTO, "the memfd is required"
    sfd = shapes_fd(good)
    assert call(s, TL_SET_SHAPES, U64.pack(2), [sfd]) == 0
    os.close(sfd)
    sfd = shapes_fd(b"")
    assert call(s, TL_SET_SHAPES, U64.pack(0), [sfd]) == 0, "back to the whole buffer"
    os.close(sfd)
    assert call(s, TL_VIEW) == 0
    assert sidecar.alive()
    os.close(fd)
    s.close()

"""A hostile trainer against a real cohort-sidecar: it speaks the trainer
link (src/accumulator/tlink.h) by hand and tries to kill the sidecar through
the memory they share.

- A tensors memfd without seals is refused with EPERM at REGISTER, so
  shrinking it afterwards touches nothing of the sidecar's.
- A sealed memfd cannot shrink: ftruncate fails in the trainer.
- A hugetlbfs memfd (which could fault when huge pages run out) is refused.
- A second client is turned away with EBUSY while the first holds the
  session, and the sidecar serves the first one throughout.

Each time the sidecar stays alive and still answers."""
import errno
import fcntl
import os
import socket
import struct

import pytest

from cohorttest import make_tmp, remove_tmp, start_broker, start_sidecar, wait_until

MAGIC = 0x31686F63
VERSION = 4
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

"""Attacks on the data plane, against the real binaries: a standalone broker
(cohort-operator --standalone), two sidecars keyed with --secret-file and
serving real example trainers (examples/c/logreg.c) on --socket, and a
script on the same loopback that knows what the broker's Status tells
anyone: the members' ids and data addresses.

- An impersonating greeter: the script dials each member's data port
  claiming to be the other member, in the wire format of version 1 (which
  the engine took on trust, so the script's echo of the frames poisoned
  the model) and of version 2 (without the key it cannot confirm), and
  echoes back every byte it is sent. The trainers must end at the same
  model version with the same digest, on the trajectory of
  single-process SGD, and the members must log that they closed the
  stranger's connections.
- 1,000 idle connections held against the accepting member's data port
  while the cohort trains: the model version keeps growing at close to
  the rate measured without them, in the same test.

The broker gets no key: these tests are about the data plane, and hold
whether or not the broker authenticates its callers.
"""
import errno
import os
import re
import resource
import secrets
import select
import socket
import subprocess
import threading
import time

import pytest

from cohorttest import BIN, DEADLINE, Proc, start_broker, start_sidecar, wait_until

LOGREG = os.path.join(BIN, "examples", "logreg")
FINAL = re.compile(r"^final model_version=(\d+) digest=([0-9a-f]{16})$")
PROGRESS = re.compile(r"^(?:logreg: )?model_version=(\d+) ")
COHORT = "attack"
IDS = ("w-0", "w-1")


@pytest.fixture
def broker():
    b = start_broker("--allow-any-cohort", "--heartbeat-interval", "250ms",
                     "--member-timeout", "3s")
    yield b
    b.stop()


@pytest.fixture
def key_file(tmp_path):
    path = tmp_path / "key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return str(path)


class Trainer:
    """An example trainer on a sidecar's socket; its stderr progress lines
    are timestamped as they come, so rates can be measured."""

    def __init__(self, sock, args, name):
        # COHORT_ID names the trainer for its own files ("%i").
        env = dict(os.environ, COHORT_SOCKET="unix:" + sock, COHORT_ID=name)
        self.name = name
        self.p = subprocess.Popen([LOGREG, *args], stdin=subprocess.DEVNULL,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env=env)
        self.progress = []          # (monotonic time, model version)
        self.err = []
        self.lock = threading.Lock()
        self.t = threading.Thread(target=self._read, daemon=True)
        self.t.start()

    def _read(self):
        for line in self.p.stderr:
            line = line.rstrip("\n")
            m = PROGRESS.match(line)
            with self.lock:
                self.err.append(line)
                if m:
                    self.progress.append((time.monotonic(), int(m.group(1))))

    def version(self):
        with self.lock:
            return self.progress[-1][1] if self.progress else 0

    def trained(self):
        """Versions this trainer has seen committed since its first."""
        with self.lock:
            return self.progress[-1][1] - self.progress[0][1] if self.progress else 0

    def finish(self, timeout):
        try:
            out, _ = self.p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            out, _ = self.p.communicate()
            raise AssertionError("%s did not finish; stderr:\n%s" % (self.name, self.tail()))
        self.t.join(5)
        return self.p.returncode, out

    def stop(self):
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait()

    def tail(self):
        with self.lock:
            return "\n".join(self.err[-30:])


class Cohort:
    """Two keyed sidecars, each serving a trainer; stopped whatever happens."""

    def __init__(self, broker, key_file, tmp_path, trainer_args):
        self.broker, self.key_file, self.tmp_path = broker, key_file, tmp_path
        self.trainer_args = trainer_args
        self.sidecars, self.trainers = [], []
        for i in IDS:
            self.add(i)
        # Each sidecar joins with its data address once its trainer has
        # registered; the broker's Status would tell anyone the same.
        self.address = {}
        for s in self.sidecars:
            self.address[s.id] = s.wait_log("Joined the cohort.")["address"]
        # The member later in the epoch's order accepts the other's
        # connection: that is the port an impersonator greets.
        ep = wait_until(lambda: self._both_in_epoch(), "both members in one epoch")
        self.order = ep["members"].split(",")

    def add(self, member_id):
        """Starts a member: a keyed sidecar, and a trainer on its socket."""
        sock = str(self.tmp_path / ("%s.sock" % member_id))
        s = start_sidecar(self.broker.address, COHORT, member_id, "--socket", sock,
                          "--secret-file", self.key_file, "--heartbeat-interval", "250ms",
                          "--member-timeout", "3s")
        t = Trainer(sock, self.trainer_args, member_id)
        self.sidecars.append(s)
        self.trainers.append(t)
        return s, t

    def _both_in_epoch(self):
        for s in self.sidecars:
            e = s.last("Adopted a new epoch.")
            if not e or e["n_members"] != 2:
                return None
        return self.sidecars[0].last("Adopted a new epoch.")

    def stop(self):
        for t in self.trainers:
            t.stop()
        for s in self.sidecars:
            s.stop()

    def sanitizer_reports(self):
        return [r for s in self.sidecars for r in s.sanitizer_report()]


def split(addr):
    host, port = addr.rsplit(":", 1)
    return host, int(port)


# ---- an impersonating greeter -----------------------------------------------

def greeting(version, epoch, claim):
    """A GREET claiming member `claim`: version 1's layout (names at 24),
    or version 2's (names at 104) with the keyed flag and a random nonce,
    which is all one can send without the key."""
    c, i = COHORT.encode(), claim.encode()
    if version == 1:
        b = bytearray(536)
        b[0:4] = b"COH1"
        b[4] = 1
        b[6] = 1
        b[8:16] = epoch.to_bytes(8, "little")
        b[16], b[17] = len(c), len(i)
        b[24:24 + len(c)] = c
        b[280:280 + len(i)] = i
        return bytes(b)
    b = bytearray(616)
    b[0:4] = b"COH1"
    b[4] = 2
    b[6] = 1                                    # GREET
    b[7] = 1                                    # keyed
    b[8:16] = epoch.to_bytes(8, "little")
    b[16], b[17] = len(c), len(i)
    b[24:32] = secrets.token_bytes(8)           # incarnation
    b[32:40] = (1).to_bytes(8, "little")        # serial
    b[40:72] = secrets.token_bytes(32)          # nonce
    b[104:104 + len(c)] = c
    b[360:360 + len(i)] = i
    return bytes(b)


class Impersonator(threading.Thread):
    """Dials each member claiming to be the other, and echoes back all it
    receives, until stopped; dials again (at most every 50 ms) whenever a
    connection closes. Speaking version 1, it takes the member's answer
    and echoes what follows: the frames. Speaking version 2 it cannot make
    the confirmation, and echoes the challenge instead. Records its
    connections' local ports, and how many the members closed."""

    def __init__(self, cohort):
        super().__init__(daemon=True)
        self.cohort = cohort
        self.stopping = threading.Event()
        self.ports = set()          # our local ports, as the members log them
        self.closed = 0             # connections the members closed
        self.echoed = 0             # bytes echoed back
        self.dials = 0

    def epoch(self):
        e = self.cohort.sidecars[0].last("Adopted a new epoch.")
        return e["epoch"] if e else 1

    def dial(self, victim, claim, version):
        s = socket.create_connection(split(self.cohort.address[victim]), timeout=5)
        self.ports.add(s.getsockname()[1])
        s.sendall(greeting(version, self.epoch(), claim))
        s.setblocking(False)
        self.dials += 1
        # Version 1's answer is 536 bytes, to be taken before the frames.
        return {"sock": s, "skip": 536 if version == 1 else 0}

    def run(self):
        plan = [(IDS[1], IDS[0], 1), (IDS[0], IDS[1], 1), (IDS[1], IDS[0], 2),
                (IDS[0], IDS[1], 2)]
        live, last = {}, {}
        while not self.stopping.is_set():
            now = time.monotonic()
            for k in plan:
                if k not in live and now - last.get(k, 0) >= 0.05:
                    last[k] = now
                    try:
                        live[k] = self.dial(*k)
                    except OSError:
                        pass
            socks = {c["sock"]: k for k, c in live.items()}
            r, _, _ = select.select(list(socks), [], [], 0.02)
            for s in r:
                c = live[socks[s]]
                try:
                    data = s.recv(1 << 20)
                except OSError:
                    data = b""
                if not data:
                    self.closed += 1
                    s.close()
                    del live[socks[s]]
                    continue
                taken = min(c["skip"], len(data))
                c["skip"] -= taken
                data = data[taken:]
                try:
                    s.setblocking(True)
                    s.sendall(data)
                    s.setblocking(False)
                    self.echoed += len(data)
                except OSError:
                    pass
        for c in live.values():
            c["sock"].close()


def local_sgd(tmp_path, args):
    r = subprocess.run([LOGREG, "--local", *args, "--params-out", str(tmp_path / "local.txt")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return read_params(tmp_path / "local.txt")


def read_params(path):
    with open(path) as f:
        return [float(l) for l in f if l.strip()]


def test_an_impersonating_greeter_is_closed_and_the_model_stays_whole(broker, key_file,
                                                                       tmp_path):
    steps = 150
    common = ["--steps", str(steps), "--virtual-batch", "96", "--delay", "20ms"]
    want = local_sgd(tmp_path, common)
    c = Cohort(broker, key_file, tmp_path,
               [*common, "--wait-for", "2", "--linger", "2s", "--log-every", "1",
                "--params-out", str(tmp_path / "%i.txt")])
    imp = Impersonator(c)
    try:
        imp.start()
        finals = []
        for t in c.trainers:
            rc, out = t.finish(4 * DEADLINE)
            assert rc == 0, t.tail()
            finals.append(FINAL.match(out.strip().splitlines()[-1]))
        imp.stopping.set()
        imp.join(10)
        assert all(finals), finals
        # Both at the same version with the same parameters, bit for bit...
        assert finals[0].group(1) == finals[1].group(1) == str(steps), finals
        assert finals[0].group(2) == finals[1].group(2), "the members' models differ"
        # ...and those of single-process SGD: no echoed frame was summed in,
        # not even one that every member then agreed on.
        for i in IDS:
            got = read_params(tmp_path / ("%s.txt" % i))
            assert got == pytest.approx(want, rel=1e-4, abs=1e-5), i
        # The impersonator was there all along and got nowhere: every one
        # of its connections was closed by a member, each with a log line.
        assert imp.dials >= 8 and imp.closed >= 4, (imp.dials, imp.closed)
        closed = [l for s in c.sidecars for l in s.logs()
                  if l.get("component") == "allreduce" and l.get("from")
                  and int(l["from"].rsplit(":", 1)[1]) in imp.ports]
        reasons = {l.get("reason") for l in closed}
        print("impersonator: %d dials, %d closed by the members, %d bytes echoed; %d log lines "
              "about it, reasons %s" % (imp.dials, imp.closed, imp.echoed, len(closed),
                                        sorted(reasons)))
        assert closed, "no member logged closing the impersonator"
        assert "unsupported wire version" in reasons, reasons
        assert any("confirmation" in (r or "") or "wrong role" in (r or "") for r in reasons), \
            reasons
        assert not c.sanitizer_reports()
    finally:
        imp.stopping.set()
        c.stop()


# ---- 1,000 idle connections ---------------------------------------------------

class Flood(threading.Thread):
    """Holds `n` idle TCP connections to addr: opens them, sends nothing,
    and opens again, once a second, those the member closed."""

    def __init__(self, addr, n):
        super().__init__(daemon=True)
        self.addr = split(addr)
        self.n = n
        self.stopping = threading.Event()
        self.opened = 0
        self.closed_by_member = 0
        self.peak_open = 0
        self.lock = threading.Lock()

    def open_one(self):
        s = socket.socket()
        s.setblocking(False)
        err = s.connect_ex(self.addr)
        if err not in (0, errno.EINPROGRESS):
            s.close()
            return None
        self.opened += 1
        return s

    def run(self):
        socks = []
        while not self.stopping.is_set():
            while len(socks) < self.n:
                s = self.open_one()
                if s is None:
                    break
                socks.append(s)
            self.peak_open = max(self.peak_open, len(socks))
            # A second of watching for the ones the member closes.
            end = time.monotonic() + 1.0
            while time.monotonic() < end and not self.stopping.is_set():
                p = select.poll()
                for s in socks:
                    p.register(s, select.POLLIN)
                gone = set()
                for fd, ev in p.poll(100):
                    gone.add(fd)
                keep = []
                for s in socks:
                    if s.fileno() in gone:
                        self.closed_by_member += 1
                        s.close()
                    else:
                        keep.append(s)
                socks = keep
        for s in socks:
            s.close()


def rate(trainer, seconds):
    """Model versions per second over the next `seconds`, from the
    trainer's own progress lines."""
    v0, t0 = trainer.version(), time.monotonic()
    time.sleep(seconds)
    v1, t1 = trainer.version(), time.monotonic()
    return (v1 - v0) / (t1 - t0)


def test_a_thousand_idle_connections_do_not_slow_training(broker, key_file, tmp_path):
    """Connections are made when an epoch begins, so the flood is held
    across two: a third member joins through it and leaves again, and
    every connection of both new epochs to the flooded member is greeted
    through the 1,000."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want_fds = 1200
    if soft < want_fds:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(want_fds, soft)), hard))
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    idle = min(1000, soft - 200)
    assert idle >= 1000, "RLIMIT_NOFILE allows only %d descriptors" % soft

    c = Cohort(broker, key_file, tmp_path,
               ["--steps", "1000000", "--delay", "5ms", "--wait-for", "2", "--log-every", "1",
                "--stall-timeout", "60s"])
    victim = c.sidecars[IDS.index(c.order[1])]
    flood = Flood(c.address[c.order[1]], idle)
    t = c.trainers[0]
    try:
        wait_until(lambda: t.version() >= 20, "training to get going")
        before = rate(t, 6)
        assert before > 0, t.tail()
        flood.start()
        wait_until(lambda: flood.peak_open >= idle, "%d idle connections" % idle)
        v0, t0 = t.version(), time.monotonic()
        # A third member joins, trains, and leaves: two new epochs.
        epochs = victim.last("Adopted a new epoch.")["epoch"]
        s2, t2 = c.add("w-2")
        wait_until(lambda: t2.trained() >= 20, "the third member to train with the others")
        t2.stop()
        wait_until(lambda: victim.last("Adopted a new epoch.")["n_members"] == 2
                   and victim.last("Adopted a new epoch.")["epoch"] >= epochs + 2,
                   "the third member to leave")
        time.sleep(max(0.0, 6 - (time.monotonic() - t0)))
        v1, t1 = t.version(), time.monotonic()
        during = (v1 - v0) / (t1 - t0)
        flood.stopping.set()
        flood.join(10)
        after = rate(t, 3)
        ratio = during / before
        print("versions/s: %.1f before, %.1f during %d idle connections and two epoch changes "
              "(ratio %.2f), %.1f after; %d opened, %d closed by the member"
              % (before, during, idle, ratio, after, flood.opened, flood.closed_by_member))
        assert ratio >= 0.5, "training slowed from %.1f to %.1f versions/s" % (before, during)
        assert after > 0
        # The member closed idle connections to make room, without a log
        # line for each: a flood does not flood the log.
        assert flood.closed_by_member > 0
        strangers = victim.logs("Closed a connection from a stranger.")
        assert len(strangers) <= 20, "%d log lines for idle connections" % len(strangers)
        assert all(tr.p.poll() is None for tr in c.trainers if tr is not t2), "a trainer gave up"
        assert not c.sanitizer_reports()
    finally:
        flood.stopping.set()
        c.stop()

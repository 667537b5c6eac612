"""Dead processes leave at once, as real processes on loopback: a killed
sidecar or trainer is out long before the member timeout, a stopped
(silent) sidecar still takes its timeout, and a member's lying report
evicts nobody. The brokers here run with a member timeout far past every
deadline a test waits on, so only the stream grace or a peer's report can
explain a member leaving in time; timing goals live in bench/failover.sh."""
import os
import signal
import subprocess
import sys
import time

import pytest

from cohorttest import (ROOT, Procs, all_see, free_port, start_broker, start_sidecar, status_json,
                        wait_until)
from cohorttest.programs import tool_path

LONG_TIMEOUT = "90s"     # a member timeout no wait below comes near
WITHIN_S = 30.0          # generous, and still a third of LONG_TIMEOUT
TRAINER = os.path.join(ROOT, "bench", "failover_trainer.py")


class Trainer:
    """bench/failover_trainer.py on a sidecar's socket; its commit lines go
    to a file (a pipe nobody reads would fill and stop it)."""

    def __init__(self, sock, log):
        self.log = log
        self.f = open(log, "w")
        self.p = subprocess.Popen([sys.executable, TRAINER], stdin=subprocess.DEVNULL,
                                  stdout=self.f, stderr=subprocess.STDOUT,
                                  env=dict(os.environ, COHORT_SOCKET=sock))

    def commits(self):
        """(version, members) of every commit so far."""
        with open(self.log) as f:
            return [(int(p[2]), int(p[3])) for p in (l.split() for l in f)
                    if len(p) == 4 and p[0] == "commit"]

    def kill(self):
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait()

    def close(self):
        self.kill()
        self.f.close()


class Cohort(Procs):
    def __init__(self):
        super().__init__()
        self.trainers = []

    def broker(self, *extra):
        return self.add(start_broker("--cohort", "demo", "--member-timeout", LONG_TIMEOUT, *extra))

    def sidecar(self, b, member_id, *extra):
        return self.add(start_sidecar(b.address, "demo", member_id, *extra))

    def trainer(self, sock, log):
        t = Trainer(sock, log)
        self.trainers.append(t)
        return t

    def close(self):
        for t in self.trainers:
            t.close()
        super().close()


@pytest.fixture
def cohort():
    c = Cohort()
    yield c
    c.close()


def members(b):
    return [m["id"] for m in status_json(b.address, "--cohort", "demo")["cohorts"][0]["members"]]


def agree(sidecars, ids):
    """Every sidecar's latest epoch lists exactly ids, and all share it."""
    eps = all_see(sidecars, lambda e: e["members"] == ",".join(ids))
    return eps and len({e["epoch"] for e in eps}) == 1 and eps[0]


def test_killed_sidecar_is_out_long_before_its_timeout(cohort):
    b = cohort.broker()
    sc = [cohort.sidecar(b, "m-%d" % i) for i in range(3)]
    ep = wait_until(lambda: agree(sc, ["m-0", "m-1", "m-2"]), what="3 sidecars to agree")
    sc[2].kill(signal.SIGKILL)
    ep2 = wait_until(lambda: agree(sc[:2], ["m-0", "m-1"]), timeout=WITHIN_S,
                     what="the survivors to drop m-2 within the stream grace")
    assert ep2["epoch"] > ep["epoch"]
    assert b.last("A member's stream was cut without a Leave; it is out unless it comes back "
                  "within the grace.")["id"] == "m-2"


def test_stopped_sidecar_waits_for_its_timeout(cohort):
    # A stopped process keeps its sockets open: silence, not death.
    b = cohort.add(start_broker("--cohort", "demo", "--member-timeout", "6s"))
    sc = [cohort.sidecar(b, "m-%d" % i) for i in range(3)]
    wait_until(lambda: agree(sc, ["m-0", "m-1", "m-2"]), what="3 sidecars to agree")
    sc[2].kill(signal.SIGSTOP)
    try:
        # Many times the stream grace (300 ms), still far inside the 6 s
        # timeout even if this machine is slow to run the loop.
        end = time.monotonic() + 2.0
        while time.monotonic() < end:
            assert "m-2" in members(b), "a stopped member was evicted before its timeout"
            time.sleep(0.1)
        wait_until(lambda: "m-2" not in members(b), what="the timeout to evict m-2")
        assert not b.logs("A member's stream was cut without a Leave; it is out unless it "
                          "comes back within the grace.")
    finally:
        sc[2].kill(signal.SIGCONT)
    # Back, it rejoins.
    wait_until(lambda: agree(sc, ["m-0", "m-1", "m-2"]), what="m-2 to rejoin")


def broker_call(*args):
    r = subprocess.run([tool_path("broker_call"), *[str(a) for a in args]], capture_output=True,
                       text=True, timeout=60)
    return r.returncode, r.stdout + r.stderr


def test_lying_report_does_not_evict_a_live_member(cohort):
    b = cohort.broker()
    sc = [cohort.sidecar(b, "m-%d" % i) for i in range(2)]
    wait_until(lambda: agree(sc, ["m-0", "m-1"]), what="2 sidecars to agree")
    rc, out = broker_call("join", "--broker", b.address, "--cohort", "demo", "--id", "liar",
                          "--session", 77, "--address", "127.0.0.1:9")
    assert rc == 0, out
    wait_until(lambda: agree(sc, ["liar", "m-0", "m-1"]), what="the liar to be in the epoch")
    rc, out = broker_call("heartbeat", "--broker", b.address, "--cohort", "demo", "--id", "liar",
                          "--session", 77, "--lost-peer", "m-0", "--lost-peer", "m-1",
                          "--repeat", 12)
    assert rc == 0, out
    b.wait_log("A member reported peers' data connections reset.", lambda l: l["id"] == "liar")
    # Several stream graces later both are still in, in the same epoch.
    end = time.monotonic() + 2.0
    while time.monotonic() < end:
        assert {"m-0", "m-1"} <= set(members(b))
        time.sleep(0.1)
    assert agree(sc, ["liar", "m-0", "m-1"])
    # More than 16 at once, or a bad id, is refused and changes nothing.
    rc, out = broker_call("heartbeat", "--broker", b.address, "--cohort", "demo", "--id", "liar",
                          "--session", 77, *sum((["--lost-peer", "m-0"] for _ in range(17)), []))
    assert rc == 1 and "INVALID_ARGUMENT" in out, out


def trained_cohort(cohort, tmp_path, n):
    b = cohort.broker()
    sc, tr = [], []
    for i in range(n):
        sock = str(tmp_path / ("m-%d.sock" % i))
        sc.append(cohort.sidecar(b, "m-%d" % i, "--socket", sock))
        tr.append(cohort.trainer(sock, str(tmp_path / ("trainer-%d.log" % i))))
    wait_until(lambda: all(any(c[1] == n for c in t.commits()) for t in tr),
               what="every trainer to commit with %d members" % n)
    return b, sc, tr


def commits_without_the_dead(trainers, n):
    """Every survivor has committed a round in an epoch of n members."""
    return all(any(c[1] == n for c in t.commits()) for t in trainers)


def test_killed_trainer_member_leaves_and_survivors_commit(cohort, tmp_path):
    b, sc, tr = trained_cohort(cohort, tmp_path, 3)
    tr[2].kill()
    # Its sidecar sees the trainer link close and leaves at once.
    wait_until(lambda: commits_without_the_dead(tr[:2], 2), timeout=WITHIN_S,
               what="the survivors to commit without m-2")
    assert "m-2" not in members(b)
    assert b.last("Member left.")["id"] == "m-2"


def test_killed_sidecar_with_trainers_survivors_commit(cohort, tmp_path):
    b, sc, tr = trained_cohort(cohort, tmp_path, 3)
    sc[2].kill(signal.SIGKILL)
    wait_until(lambda: commits_without_the_dead(tr[:2], 2), timeout=WITHIN_S,
               what="the survivors to commit without m-2")
    assert "m-2" not in members(b)

"""Network faults between real hosts: a broker and three members, each in
its own network namespace (tests/netfault/netns.py), the members being a
real cohort-sidecar and the example trainer (examples/c/logreg.c) with
integer gradients, all run with `ip netns exec`.

- 100 ms +- 20 ms delay, and 5 % loss, on every member's link: every round
  commits with all three, the members agree.
- A member partitioned from its peers but not from the broker; a member
  partitioned from the broker but not from its peers; the broker
  partitioned from everyone: the partitioned side is out within the member
  timeout, comes back after the heal, and trains with the others again.
- Four members cut into two equal halves, each still reaching the
  broker: the half with the epoch's leader is the one that goes on
  committing, the other half is out and rejoins after the heal.

Every run ends with the same checks: each committed round is the same
result at every member that committed it and is made of exactly the
contributions it claims, none counted twice and none lost
(cohorttest.accounting); every member reaches the last version with the
same parameter bytes (the trainers' final digests).

The cohort runs with a 500 ms heartbeat and a 3 s member timeout (the
defaults are 1 s and 5 s), to keep the partitions short.
"""
import json
import os
import time

import pytest

import netns
from cohorttest import DEADLINE, Proc, Procs, bin_path, wait_until
from cohorttest.programs import write_key
from cohorttest.accounting import check_accounting, load_stats

N = 3
COHORT = "nf"
TIMEOUT_S = 3.0
COHORT_SPEC = "%s:heartbeat=500ms,timeout=%gs" % (COHORT, TIMEOUT_S)
# The broker's eviction tick, the epoch's coalescing window and its
# delivery on a loaded 2-core machine with sanitizers.
OUT_SLACK_S = 3.0
# After an eviction as unreachable, how long the broker may wait for the
# verdicts on the rest of a cut-off side (BROKER_VERDICT_SETTLE_MS).
SETTLE_S = 1.0
LOGREG = bin_path(os.path.join("examples", "logreg"))
UNREACHABLE = "Nothing heard from a peer's host for the member timeout; reporting it unreachable."


@pytest.fixture
def net():
    n = netns.Net(N)
    try:
        yield n
    finally:
        n.close()


class Cohort:
    """The broker and N members (sidecar + trainer) in net's namespaces."""

    def __init__(self, net, tmp, steps, pace):
        self.net, self.tmp, self.steps = net, tmp, steps
        self.procs = Procs()
        self.key = write_key(tmp / "key")
        self.stats = tmp / "stats"
        self.stats.mkdir()
        self.ids = ["m%d" % i for i in range(len(net.members))]
        b = self.procs.add(Proc(net.argv(net.broker, [
            bin_path("cohort-operator"), "--standalone", "--listen", netns.BROKER_ADDR + ":0",
            "--log-format", "json", "--secret-file", self.key, "--cohort", COHORT_SPEC]), "broker"))
        self.broker = b.wait_log("Broker is listening.")["address"]
        self.sidecars, self.trainers = {}, {}
        for mid, ns in zip(self.ids, net.members):
            sock = str(tmp / ("%s.sock" % mid))
            self.sidecars[mid] = self.procs.add(Proc(net.argv(ns, [
                bin_path("cohort-sidecar"), "--broker", self.broker, "--cohort", COHORT,
                "--id", mid, "--socket", sock, "--data-listen", net.addr[ns] + ":0",
                "--secret-file", self.key, "--log-format", "json"]), mid))
        for mid, ns in zip(self.ids, net.members):
            self.trainers[mid] = self.procs.add(Proc(net.argv(ns, [
                LOGREG, "--connect", "unix:" + str(tmp / ("%s.sock" % mid)), "--steps",
                str(steps), "--integer-grads", "--stats-file", str(self.stats / ("%s.jsonl" % mid)),
                "--wait-for", str(len(self.ids)), "--delay", pace, "--linger", "3s", "--stall-timeout", "120s",
                "--log-every", "20"]), "trainer " + mid))

    def ns(self, mid):
        return self.net.members[self.ids.index(mid)]

    def versions(self):
        """{member id: the latest version its trainer committed or received}."""
        out = {mid: 0 for mid in self.ids}
        for mid, evs in load_stats(self.stats).items():
            for e in evs:
                if e["ev"] == "commit":
                    out[mid] = max(out[mid], e["v"])
                elif e["ev"] == "state":
                    out[mid] = max(out[mid], e["to_v"])
        return out

    def wait_versions(self, mids, at_least, what, timeout=DEADLINE * 2):
        def ok():
            v = self.versions()
            if max(v.values()) >= self.steps:
                raise AssertionError("the run reached its last version (%d) before %s: %s"
                                     % (self.steps, what, v))
            return all(v[m] >= at_least for m in mids) and v
        return wait_until(ok, what, timeout)

    def epochs(self, mid):
        return self.sidecars[mid].logs("Adopted a new epoch.")

    def epoch_seen(self, mids, members, since):
        """True once each of mids adopted, after its since[mid]-th epoch
        line, an epoch of exactly these members."""
        want = ",".join(members)
        return all(any(e["members"] == want for e in self.epochs(m)[since[m]:]) for m in mids)

    def marks(self):
        return {m: len(self.epochs(m)) for m in self.ids}

    def broker_status(self):
        """The cohort as the broker sees it (cohortctl status -o json),
        read from inside its namespace (over its own address, which no
        partition of eth0 touches); None if that fails."""
        r = netns.sh(*self.net.argv(self.net.broker, [
            bin_path("cohortctl"), "status", "--broker", self.broker, "--cohort", COHORT,
            "--secret-file", self.key, "-o", "json"]), check=False)
        if r.returncode != 0:
            return None
        cs = json.loads(r.stdout)["cohorts"]
        return cs[0] if cs else {"members": [], "leader": None}

    def broker_members(self):
        """The member ids the broker holds, or None."""
        st = self.broker_status()
        return None if st is None else sorted(m["id"] for m in st["members"])

    def finish(self, may_roll_back=()):
        """Waits for every trainer to end, then checks the run. A member of
        may_roll_back may have commits rolled back (accounting.py: finished
        alone while cut off, then replaced by the leader's state); they
        are printed, and anyone else's fail the run."""
        for mid, t in self.trainers.items():
            try:
                rc = t.p.wait(DEADLINE * 3)
            except Exception:
                rc = None
            assert rc == 0, "trainer %s exited %s; versions %s; its last lines:\n%s" % (
                mid, rc, self.versions(), "\n".join(t.raw[-15:]))
        stats = load_stats(self.stats)
        self.discarded, self.rolled_back = [], []
        assert check_accounting(stats, self.steps, self.discarded,
                                self.rolled_back if may_roll_back else None) == self.steps
        assert all(m in may_roll_back for _, m, _ in self.rolled_back), self.rolled_back
        finals = {mid: evs[-1] for mid, evs in stats.items()}
        assert all(f["ev"] == "final" and f["v"] == self.steps for f in finals.values()), finals
        assert len({f["digest"] for f in finals.values()}) == 1, \
            "the members' parameters differ: %s" % finals
        print("%s: contributions dropped uncounted (made in a round the others committed "
              "without the member): %s; commits rolled back (version, member, its own part): %s"
              % (os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0], self.discarded,
                 self.rolled_back))
        return stats

    def close(self):
        try:
            self.procs.close()
        finally:
            # Every process's log beside the stats, for a failed run.
            for p in self.procs.procs:
                with open(self.tmp / ("%s.log" % p.name.replace(" ", "-")), "w") as f:
                    f.write("\n".join(p.raw) + "\n")


@pytest.fixture
def cohort_factory(net, tmp_path):
    made = []

    def make(steps, pace="0ms"):
        c = Cohort(net, tmp_path, steps, pace)
        made.append(c)
        return c
    try:
        yield make
    finally:
        for c in made:
            c.close()


def commit_sizes(stats):
    return sorted({e["size"] for evs in stats.values() for e in evs if e["ev"] == "commit"})


# ---- a slow and a lossy network ------------------------------------------------

def test_delay_with_jitter_on_every_member_link(net, cohort_factory):
    for ns in net.members:
        net.delay(ns, 100, 20)
    t0 = time.monotonic()
    c = cohort_factory(30)
    stats = c.finish()
    print("delay (%s): 30 rounds of 3 members in %.1f s" % (net.delay_mode,
                                                             time.monotonic() - t0))
    # A delay is no fault: nobody was evicted, every round had all three.
    assert commit_sizes(stats) == [N]


def test_loss_on_every_member_link(net, cohort_factory):
    for ns in net.members:
        net.loss(ns, 0.05)
    t0 = time.monotonic()
    c = cohort_factory(60)
    stats = c.finish()
    print("5%% loss: 60 rounds of 3 members in %.1f s" % (time.monotonic() - t0))
    assert commit_sizes(stats) == [N]


# ---- partitions ------------------------------------------------------------------

STEPS = 200
PACE = "50ms"       # at most 20 rounds a second, so the run outlasts the faults


def partitioned_then_healed(c, net, cut, x="m2"):
    """Trains to version 5 with everyone, cuts (cut() makes the
    partition), waits until the survivors run without x (None if they do
    not within the timeout and its slack), waits for 3 more versions
    without x, heals, and waits until all three train together again.
    Returns the figures: seconds to out and to back, versions at the cut
    and at the heal."""
    survivors = [m for m in c.ids if m != x]
    c.wait_versions(c.ids, 5, "all three training")
    marks = c.marks()
    t0 = time.monotonic()
    cut()
    v_at_cut = c.versions()
    out_s = None
    try:
        wait_until(lambda: c.epoch_seen(survivors, survivors, marks),
                   "the survivors' epoch without %s" % x, TIMEOUT_S + OUT_SLACK_S)
        out_s = time.monotonic() - t0
        assert c.broker_members() == survivors
        v = c.versions()
        c.wait_versions(survivors, max(v[m] for m in survivors) + 3, "progress without " + x)
    except AssertionError as e:
        if out_s is not None:
            raise
        print("not out after %.1f s: %s" % (time.monotonic() - t0, e))
    v_cut = c.versions()
    marks = c.marks()
    t1 = time.monotonic()
    net.heal()
    if out_s is not None:
        wait_until(lambda: c.epoch_seen(c.ids, c.ids, marks),
                   "all three in one epoch after the heal", DEADLINE)
    # (A member that was never out needs no new epoch: the stalled
    # reduction goes on once its packets pass again.)
    back_s = time.monotonic() - t1
    v = c.versions()
    c.wait_versions(c.ids, max(v.values()) + 3, "all three training after the heal")
    return out_s, back_s, v_at_cut, v_cut


def test_member_partitioned_from_the_broker(net, cohort_factory):
    c = cohort_factory(STEPS, PACE)
    x = net.members[2]
    out_s, back_s, _, _ = partitioned_then_healed(c, net, lambda: net.partition(x, [net.broker]))
    print("member cut from the broker: out in %s s, back %.1f s after the heal" % (out_s, back_s))
    assert out_s is not None and out_s <= TIMEOUT_S + OUT_SLACK_S
    c.finish()


def test_member_partitioned_from_its_peers_not_the_broker(net, cohort_factory):
    c = cohort_factory(STEPS, PACE)
    x = net.members[2]
    peers = [ns for ns in net.members if ns != x]
    out_s, back_s, v_at_cut, v_cut = partitioned_then_healed(
        c, net, lambda: net.partition(x, peers))
    print("member cut from its peers: out in %s s, back %.1f s after the heal; versions %s "
          "at the cut, %s at the heal" % (out_s, back_s, v_at_cut, v_cut))
    # Its heartbeats went on: it is out because both survivors' engines
    # reported its host unreachable.
    assert out_s is not None and out_s <= TIMEOUT_S + OUT_SLACK_S, \
        "not out: versions %s at the cut, %s at the heal" % (v_at_cut, v_cut)
    xid = c.ids[net.members.index(x)]
    for m in c.ids:
        if m != xid:
            assert any(r.get("peer") == xid for r in c.sidecars[m].logs(UNREACHABLE)), m
    # Cut in the middle of a round's last exchange it may finish that
    # round alone; the survivors redo it, and it takes their state back.
    c.finish(may_roll_back=(xid,))


def test_broker_partitioned_from_everyone(net, cohort_factory):
    c = cohort_factory(STEPS, PACE)
    c.wait_versions(c.ids, 5, "all three training")
    marks = c.marks()
    t0 = time.monotonic()
    net.isolate(net.broker)
    # The broker evicts everyone at the timeout; the members, who cannot
    # hear it, go on in the epoch they have.
    wait_until(lambda: c.broker_members() == [], "the broker to evict everyone",
               TIMEOUT_S + OUT_SLACK_S)
    out_s = time.monotonic() - t0
    v = c.versions()
    c.wait_versions(c.ids, max(v.values()) + 3, "rounds while the broker is cut off")
    assert c.marks() == marks, "an epoch came from a broker no one can reach"
    t1 = time.monotonic()
    net.heal()
    wait_until(lambda: c.epoch_seen(c.ids, c.ids, marks) and c.broker_members() == c.ids,
               "all three rejoined after the heal", DEADLINE)
    back_s = time.monotonic() - t1
    v = c.versions()
    c.wait_versions(c.ids, max(v.values()) + 3, "all three training after the heal")
    print("broker cut off: everyone evicted in %.1f s, back %.1f s after the heal"
          % (out_s, back_s))
    # Members back one at a time may run in two epochs at once for a
    # moment; the side behind the leader takes its state.
    c.finish(may_roll_back=tuple(c.ids))


# ---- two equal halves ------------------------------------------------------------

@pytest.fixture
def net4():
    n = netns.Net(4)
    try:
        yield n
    finally:
        n.close()


def test_equal_halves_the_leaders_half_goes_on(net4, tmp_path):
    """{m0, m1} | {m2, m3}, everyone still reaching the broker. Each member
    is reported by exactly half of the epoch; the broker evicts the half
    that the epoch's leader reports (docs/architecture.md, "Eviction")."""
    net = net4
    c = Cohort(net, tmp_path, 400, PACE)
    try:
        c.wait_versions(c.ids, 5, "all four training")
        leader = c.broker_status()["leader"]
        assert leader in c.ids, leader
        near = ["m0", "m1"] if leader in ("m0", "m1") else ["m2", "m3"]
        far = [m for m in c.ids if m not in near]
        marks = c.marks()
        t0 = time.monotonic()
        for a in ("m0", "m1"):
            net.partition(c.ns(a), [c.ns("m2"), c.ns("m3")])
        wait_until(lambda: c.epoch_seen(near, near, marks),
                   "the leader's half (%s) in an epoch of its own" % near,
                   TIMEOUT_S + SETTLE_S + OUT_SLACK_S)
        out_s = time.monotonic() - t0
        assert c.broker_members() == near
        assert c.broker_status()["leader"] in near
        # The leader's half reported the far half, and the far half the
        # leader's: each side's engines saw the cut.
        for m in c.ids:
            other = far if m in near else near
            told = {r.get("peer") for r in c.sidecars[m].logs(UNREACHABLE)}
            assert told & set(other), (m, told)
        v = c.versions()
        c.wait_versions(near, max(v[m] for m in near) + 10, "the leader's half committing on")
        v_heal = c.versions()
        marks = c.marks()
        t1 = time.monotonic()
        net.heal()
        # The far half is benched (doubled while it comes back into the
        # cut), so it is back within a few timeouts of the heal.
        wait_until(lambda: c.epoch_seen(c.ids, c.ids, marks) and c.broker_members() == c.ids,
                   "all four in one epoch after the heal", DEADLINE)
        back_s = time.monotonic() - t1
        v = c.versions()
        c.wait_versions(c.ids, max(v.values()) + 3, "all four training after the heal")
        print("equal halves: leader %s; %s out in %.1f s; the leader's half at %s at the heal; "
              "all four back %.1f s after it" % (leader, far, out_s, v_heal, back_s))
        # The far half may have finished a round alone that the leader's
        # half redid without it (as in the partition from peers); nothing
        # else may differ, and nothing is counted twice.
        c.finish(may_roll_back=tuple(far))
    finally:
        c.close()

#!/usr/bin/env python3
"""Chaos trials: a standalone broker (cohort-operator --standalone), N
sidecars and N chaos trainers (tests/chaos/chaos_trainer.c) as real
processes on loopback; trial after trial, a random process among them gets
SIGKILL at a random moment, is started again, and the trial's logs are
checked for exact accounting (tests/chaos/check.py).

    chaos.py [--trials N] [--seed S] [--kinds trainer,sidecar,broker] [--keep]
    chaos.py [--trials N] [--seed S] --kinds operator[,trainer,pod] [--keep]

With operator or pod among the kinds, the trials run in the Kubernetes
stand-in instead: cohort-operator reconciles a TrainingCohort and hosts
the broker, the trainers run in its pods, and the operator is among the
processes killed (tests/chaos/kubetrial.py says what those trials assert).

Trial i runs with seed S + i; a failure prints the seed that replays it
(`make chaos SEED=S TRIALS=1`). The seed picks the number of members
(3 or 4), the steps, the virtual batch size, and each kill: its kind, its
victim, the model version after which it fires and a delay past that,
and how long the killed process stays down. Timing on a loaded machine is
not the seed's, so a replay repeats the same plan, not the same
interleaving.

What a kill means:
- trainer: SIGKILL to one trainer; its sidecar stays, and a new trainer
  (a new slot) connects to it.
- sidecar: SIGKILL to one sidecar (once its trainer has connected to it);
  its trainer finds it gone and exits 1; a new sidecar (a new member id)
  and a new trainer replace them.
- broker: SIGKILL to the broker; a new one listens on the same port, and
  the sidecars rejoin it.

A trial fails on a checker finding, on a process that did not end as
expected (a trainer exit other than 0 unless it or its sidecar was
killed; a sanitizer report), or on a hang: the cohort not reaching its
last version within the trial's deadline.
"""
import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "lib"))
sys.path.insert(0, HERE)

from cohorttest import BIN, DEADLINE, Proc, free_port, make_tmp  # noqa: E402
from check import CheckFailed, check, load_logs  # noqa: E402
import kubetrial  # noqa: E402
from trials import Progress, TrialFailed, plan_kills, run_reported, sanitizer_lines  # noqa: E402

TRAINER = os.path.join(BIN, "tests", "chaos", "chaos_trainer")
HEARTBEAT = "200ms"
MEMBER_TIMEOUT = "1500ms"
KINDS = ("trainer", "sidecar", "broker")


class Trial(Progress):
    def __init__(self, seed, kinds, kills, tmp, wait_for=True):
        self.seed = seed
        self.wait_for = wait_for
        self.rng = random.Random(seed)
        self.tmp = self.log_dir = tmp
        self.n = self.rng.choice([3, 4])
        self.steps = self.rng.randint(20, 36)
        self.vb = self.rng.choice([1, self.n - 1, self.n, 2 * self.n])
        self.plan = plan_kills(self.rng, kinds, kills, self.steps, self.n, down=True)
        self.port = free_port()
        self.broker = None
        self.members = []          # per index: {"sidecar": Proc, "trainer": Popen, "slot", "id"}
        self.next_slot = 0
        self.incarnation = 0
        self.expected_exit = {}    # slot -> why its trainer may exit non-zero
        self.dead = []             # processes we killed or that ended, for their logs
        self.done_kinds = []
        self.deadline = time.monotonic() + 2 * DEADLINE + 30 * kills

    # ---- processes ----------------------------------------------------------

    def start_broker(self):
        argv = [os.path.join(BIN, "cohort-operator"), "--standalone", "--insecure",
                "--listen", "127.0.0.1:%d" % self.port, "--allow-any-cohort",
                "--heartbeat-interval", HEARTBEAT, "--member-timeout", MEMBER_TIMEOUT,
                "--log-format", "json"]
        end = time.monotonic() + DEADLINE
        while True:
            b = Proc(argv, "broker")
            try:
                b.wait_log("Broker is listening.", timeout=DEADLINE)
                self.broker = b
                return
            except AssertionError:
                # The port may still be held a moment after a kill.
                b.kill()
                b.stop()
                if time.monotonic() > end:
                    raise TrialFailed("the broker did not listen on port %d again: %s" %
                                      (self.port, b.raw[-5:]))
                time.sleep(0.2)

    def start_member(self, idx):
        self.incarnation += 1
        mid = "m%d-%d" % (idx, self.incarnation)
        sock = os.path.join(self.tmp, "%s.sock" % mid)
        sc = Proc([os.path.join(BIN, "cohort-sidecar"), "--broker", "127.0.0.1:%d" % self.port,
                   "--cohort", "chaos", "--id", mid, "--socket", sock, "--log-format", "json",
                   "--heartbeat-interval", HEARTBEAT, "--member-timeout", MEMBER_TIMEOUT], mid)
        m = {"idx": idx, "id": mid, "sock": sock, "sidecar": sc}
        if idx < len(self.members):
            self.members[idx] = m
        else:
            self.members.append(m)
        self.start_trainer(m)

    def start_trainer(self, m):
        slot = self.next_slot
        self.next_slot += 1
        env = dict(os.environ, COHORT_SOCKET="unix:" + m["sock"], COHORT_ID=m["id"])
        env.pop("COHORT_BROKER", None)
        err = open(os.path.join(self.tmp, "t%d.err" % slot), "w")
        m["slot"] = slot
        m["trainer"] = subprocess.Popen(
            [TRAINER, "--slot", str(slot), "--log", os.path.join(self.tmp, "t%d.jsonl" % slot),
             "--steps", str(self.steps), "--vb", str(self.vb), "--delay-ms", "30",
             "--stall-s", str(int(2 * DEADLINE)), "--wait-for", str(self.n if self.wait_for else 1)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, env=env)
        err.close()

    # ---- progress -----------------------------------------------------------

    def trainer_slots(self):
        return range(self.next_slot)

    # ---- kills --------------------------------------------------------------

    def fire(self, k):
        self.wait(lambda: self.max_version() >= k["after_v"], "model version %d" % k["after_v"])
        time.sleep(k["delay_ms"] / 1000)
        m = self.members[k["victim"]]
        if k["kind"] == "broker":
            self.broker.kill()
            self.broker.stop()
            self.dead.append(self.broker)
            time.sleep(k["down_ms"] / 1000)
            self.start_broker()
        elif k["kind"] == "trainer":
            m["trainer"].kill()
            m["trainer"].wait()
            self.expected_exit[m["slot"]] = "killed"
            time.sleep(k["down_ms"] / 1000)
            self.start_trainer(m)
        else:
            # A trainer that has not connected yet would keep trying for a
            # minute (its sidecar may be starting), not exit: kill only a
            # sidecar its trainer has reached.
            self.wait(lambda: any(e["ev"] == "connected" for e in self.events(m["slot"])),
                      "trainer slot %d to connect" % m["slot"])
            m["sidecar"].kill()
            m["sidecar"].stop()
            self.dead.append(m["sidecar"])
            self.expected_exit[m["slot"]] = "its sidecar was killed"
            try:
                m["trainer"].wait(DEADLINE)
            except subprocess.TimeoutExpired:
                raise TrialFailed("trainer slot %d outlived its sidecar by %.0f s" %
                                  (m["slot"], DEADLINE))
            time.sleep(k["down_ms"] / 1000)
            self.start_member(m["idx"])
        k["at_v"] = self.max_version()
        self.done_kinds.append(k["kind"])

    # ---- the trial ----------------------------------------------------------

    def run(self):
        self.start_broker()
        for i in range(self.n):
            self.start_member(i)
        for k in self.plan:
            self.fire(k)
        live = lambda: [m for m in self.members]
        self.wait(lambda: all(any(e["ev"] == "done" for e in self.events(m["slot"]))
                              for m in live()), "every trainer to reach version %d" % self.steps)
        for m in live():
            m["trainer"].send_signal(signal.SIGTERM)
        bad = []
        for m in live():
            try:
                rc = m["trainer"].wait(DEADLINE)
            except subprocess.TimeoutExpired:
                m["trainer"].kill()
                raise TrialFailed("hang: trainer slot %d did not stop on SIGTERM" % m["slot"])
            if rc != 0:
                bad.append("trainer slot %d exited %d" % (m["slot"], rc))
        survivors = {m["slot"] for m in live()}
        for slot in range(self.next_slot):
            if slot in survivors or slot in self.expected_exit:
                continue
            bad.append("trainer slot %d ended though nothing killed it" % slot)
        for m in live():
            rc = m["sidecar"].stop()
            if rc != 0:
                bad.append("sidecar %s exited %s" % (m["id"], rc))
        rc = self.broker.stop()
        if rc != 0:
            bad.append("the broker exited %s" % rc)
        for p in [self.broker, *[m["sidecar"] for m in live()], *self.dead]:
            bad += ["%s: %s" % (p.name, l) for l in p.sanitizer_report()]
        for slot in range(self.next_slot):
            with open(os.path.join(self.tmp, "t%d.err" % slot)) as f:
                bad += ["trainer slot %d: %s" % (slot, l) for l in sanitizer_lines(f.read())]
        if bad:
            raise TrialFailed("; ".join(bad[:20]))
        return check(load_logs(self.tmp), survivors, self.steps)

    def keep_logs(self):
        """Writes the broker's and sidecars' stderr (kept in memory by
        Proc) into the trial directory, beside the trainers' logs."""
        procs = [*([self.broker] if self.broker else []), *[m["sidecar"] for m in self.members],
                 *self.dead]
        for i, p in enumerate(procs):
            with p.lock:
                text = "\n".join(p.raw)
            with open(os.path.join(self.tmp, "%s-%d.log" % (p.name, i)), "w") as f:
                f.write(text + "\n")

    def stop_everything(self):
        for m in self.members:
            t = m.get("trainer")
            if t and t.poll() is None:
                t.kill()
                t.wait()
            m["sidecar"].kill()
            m["sidecar"].stop()
        if self.broker:
            self.broker.kill()
            self.broker.stop()


def run_trial(seed, kinds, kills, keep=False, wait_for=True):
    """One trial; returns its figures, or raises TrialFailed / CheckFailed
    with the seed and where its logs are."""
    tmp = make_tmp("chaos-")
    t = Trial(seed, kinds, kills, tmp, wait_for)
    desc = "seed %d: %d members, %d steps, vb %d, kills %s" % (
        seed, t.n, t.steps, t.vb,
        ", ".join("%s of m%d after v%d" % (k["kind"], k["victim"], k["after_v"]) for k in t.plan))
    return run_reported(t, tmp, desc, "make chaos SEED=%d TRIALS=1" % seed, keep)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--seed", type=int, default=None, help="first trial's seed (default: random)")
    ap.add_argument("--kills", type=int, default=3, help="kills per trial (default 3)")
    ap.add_argument("--kinds", default=",".join(KINDS),
                    help="what may be killed: any of %s (default: all of them); or, in the "
                    "Kubernetes stand-in, any of %s with operator or pod among them (an "
                    "operator hosting the broker, trainer pods)" %
                    (", ".join(KINDS), ", ".join(kubetrial.KUBE_KINDS)))
    ap.add_argument("--keep", action="store_true", help="keep every trial's logs")
    ap.add_argument("--no-wait-for", action="store_true",
                    help="trainers at model version 0 contribute without waiting for all N "
                    "members (exposes the split history after a broker restart: docs/chaos.md)")
    a = ap.parse_args()
    kinds = [k for k in a.kinds.split(",") if k]
    kube = any(k in ("operator", "pod") for k in kinds)
    if not kinds or any(k not in (kubetrial.KUBE_KINDS if kube else KINDS) for k in kinds):
        ap.error("--kinds takes a comma-separated list of %s, or of %s with operator or pod "
                 "among them" % (", ".join(KINDS), ", ".join(kubetrial.KUBE_KINDS)))
    if kube and a.no_wait_for:
        ap.error("--no-wait-for is for the trials without the operator")
    if a.trials < 1 or a.kills < 0:
        ap.error("--trials must be 1 or more and --kills 0 or more")
    seed = a.seed if a.seed is not None else random.SystemRandom().randrange(1, 1 << 31)
    print("chaos: %d trials from seed %d" % (a.trials, seed), flush=True)
    results, failures = [], []
    for i in range(a.trials):
        try:
            if kube:
                results.append(kubetrial.run_kube_trial(seed + i, kinds, a.kills, TRAINER, a.keep))
            else:
                results.append(run_trial(seed + i, kinds, a.kills, a.keep, not a.no_wait_for))
        except (TrialFailed, CheckFailed) as e:
            failures.append(str(e))
            print("chaos: " + str(e), flush=True)
    kills = {}
    for r in results:
        for k in r["kills"]:
            kills[k] = kills.get(k, 0) + 1
    print("chaos: %d trials, %d passed, %d failed; kills %s; %d versions and %d commits checked, "
          "%d contributions accounted for" %
          (a.trials, len(results), len(failures), json.dumps(kills, sort_keys=True),
           sum(r["versions"] for r in results), sum(r["commits"] for r in results),
           sum(r["contributions"] for r in results)), flush=True)
    for f in failures:
        print("chaos: FAILED " + f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

"""bench/failover.py: time from a `kill -9` to the survivors' next commit,
for a sidecar's death, a trainer's death and the broker's (a standalone
broker restarted on the same address at once), with the default
heartbeat (1 s) and member timeout (5 s). Run by bench/failover.sh.

Each trial starts a broker, N sidecars and N trainers
(bench/failover_trainer.py, which prints every commit with its
CLOCK_MONOTONIC time and the epoch's size), waits for rounds to flow,
kills one process with SIGKILL and measures:

- sidecar, trainer: until every survivor has committed a round in an
  epoch without the dead member (N - 1 members);
- stopped sidecar (SIGSTOP, not a death: silence, as a partition looks),
  measured the same way in the same run: it takes the member timeout, as
  it must, and shows what a death cost before the broker told the two
  apart;
- broker: until every member has committed a round after adopting an
  epoch published by the restarted broker (rounds go on in the old epoch
  while the broker is away: the data plane does not need it; the figure
  is how long until the cohort is back under a broker that can take
  changes).

The reference row is torchrun's documented failure detection: its
rendezvous marks a node dead after 3 missed keep-alives at 5 s (about
15 s), before the whole group restarts. It is quoted, not run: no torchrun
job runs in this benchmark.
"""
import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINER = os.path.join(ROOT, "bench", "failover_trainer.py")
TORCHRUN_DETECT_S = 3 * 5.0


class Proc:
    def __init__(self, argv, log, env=None):
        self.log = log
        self.f = open(log, "w")
        self.p = subprocess.Popen(argv, stdout=self.f, stderr=subprocess.STDOUT, env=env,
                                  start_new_session=True)

    def lines(self):
        with open(self.log) as f:
            return f.read().splitlines()

    def kill(self):
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait()
        self.f.close()

    def stop(self):
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self.f.close()


def wait_for(cond, what, timeout=60.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = cond()
        if v:
            return v
        time.sleep(0.02)
    raise RuntimeError("timed out waiting for " + what)


def commits(t):
    """(time, version, size) of every commit a trainer printed."""
    out = []
    for line in t.lines():
        parts = line.split()
        if len(parts) == 4 and parts[0] == "commit":
            out.append((float(parts[1]), int(parts[2]), int(parts[3])))
    return out


def adopted(sidecar_log):
    """CLOCK_MONOTONIC-free: the number of "Adopted a new epoch." lines."""
    n = 0
    with open(sidecar_log) as f:
        for line in f:
            if "Adopted a new epoch." in line:
                n += 1
    return n


class Cohort:
    def __init__(self, bindir, n, tmp, port):
        self.bindir, self.n, self.tmp = bindir, n, tmp
        self.address = "127.0.0.1:%d" % port
        self.broker = None
        self.sidecars, self.trainers = [], []

    def start_broker(self, tag):
        self.broker = Proc([os.path.join(self.bindir, "cohort-operator"), "--standalone",
                            "--insecure", "--listen", self.address, "--cohort", "bench",
                            "--log-format", "json"], os.path.join(self.tmp, "broker-%s.log" % tag))

    def start(self):
        self.start_broker("0")
        time.sleep(0.2)
        for i in range(self.n):
            sock = os.path.join(self.tmp, "m-%d.sock" % i)
            self.sidecars.append(Proc([os.path.join(self.bindir, "cohort-sidecar"), "--broker",
                                       self.address, "--cohort", "bench", "--id", "m-%d" % i,
                                       "--socket", sock, "--log-format", "json"],
                                      os.path.join(self.tmp, "sidecar-%d.log" % i)))
            env = dict(os.environ, COHORT_SOCKET=sock)
            self.trainers.append(Proc([sys.executable, TRAINER], os.path.join(
                self.tmp, "trainer-%d.log" % i), env=env))
        # Rounds flow among all n.
        wait_for(lambda: all(any(c[2] == self.n for c in commits(t)) for t in self.trainers),
                 "every trainer to commit with %d members" % self.n)
        time.sleep(0.5)

    def close(self):
        for p in self.trainers + self.sidecars + ([self.broker] if self.broker else []):
            p.stop()


def trial(kind, bindir, n, port):
    tmp = tempfile.mkdtemp(prefix="cohort-failover-")
    c = Cohort(bindir, n, tmp, port)
    try:
        c.start()
        victim = n - 1
        survivors = [t for i, t in enumerate(c.trainers) if i != victim]
        if kind == "broker":
            before = [adopted(s.log) for s in c.sidecars]
            t0 = time.monotonic()
            c.broker.kill()
            c.start_broker("1")
            # The restarted broker's epoch reaches every sidecar...
            t_adopt = wait_for(lambda: all(adopted(s.log) > b for s, b in
                                           zip(c.sidecars, before)) and time.monotonic(),
                               "the members to adopt the restarted broker's epoch")
            # ...and each then commits in it.
            done = wait_for(lambda: all(any(x[0] >= t_adopt for x in commits(t))
                                        for t in c.trainers) and
                            max(min(x[0] for x in commits(t) if x[0] >= t_adopt)
                                for t in c.trainers),
                            "every member to commit under the restarted broker")
            return done - t0
        t0 = time.monotonic()
        if kind == "sidecar":
            c.sidecars[victim].kill()
        elif kind == "stopped":
            c.sidecars[victim].p.send_signal(signal.SIGSTOP)
        else:
            c.trainers[victim].kill()
        done = wait_for(lambda: all(any(x[0] >= t0 and x[2] == n - 1 for x in commits(t))
                                    for t in survivors) and
                        max(min(x[0] for x in commits(t) if x[0] >= t0 and x[2] == n - 1)
                            for t in survivors),
                        "the survivors to commit with %d members" % (n - 1))
        return done - t0
    finally:
        if kind == "stopped" and len(c.sidecars) == n:
            c.sidecars[n - 1].kill()    # a stopped process would not heed SIGTERM
        c.close()
        if os.environ.get("COHORT_KEEP_LOGS") != "1":
            shutil.rmtree(tmp, ignore_errors=True)


def free_port():
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def pct(xs, q):
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0].split(": ", 1)[1])
    ap.add_argument("--bin", default=os.path.join(ROOT, "build"), help="cohort's binaries (build)")
    ap.add_argument("--members", type=int, default=3, help="members per cohort (3)")
    ap.add_argument("--trials", type=int, default=5, help="trials per kind of death (5)")
    ap.add_argument("--kinds", default="sidecar,trainer,broker,stopped")
    ap.add_argument("--json", action="store_true", help="one JSON line per kind too")
    a = ap.parse_args()
    rows = []
    for kind in a.kinds.split(","):
        xs = [trial(kind, a.bin, a.members, free_port()) for _ in range(a.trials)]
        rows.append((kind, xs))
        if a.json:
            print(json.dumps({"kind": kind, "seconds": xs}), flush=True)
    print("| fault | trials | median | p90 | vs torchrun's detection |")
    print("|---|---|---|---|---|")
    names = {"sidecar": "`kill -9` of a sidecar", "trainer": "`kill -9` of a trainer",
             "broker": "`kill -9` of the broker (restarted at once)",
             "stopped": "SIGSTOP of a sidecar (silence, not a death: the 5 s timeout)"}
    for kind, xs in rows:
        med = statistics.median(xs)
        print("| %s | %d | %.2f s | %.2f s | %.1fx sooner |" % (
            names.get(kind, kind), len(xs), med, pct(xs, 0.9), TORCHRUN_DETECT_S / med))
    print("| torchrun's documented detection (reference, not run: 3 missed 5 s "
          "keep-alives, then the whole group restarts) | - | %.0f s | - | 1x |"
          % TORCHRUN_DETECT_S)
    return 0


if __name__ == "__main__":
    sys.exit(main())

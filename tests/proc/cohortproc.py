"""Real cohort processes for the multi-process tests.

Every process logs JSON lines to stderr; a reader thread keeps them, and
tests wait on conditions over them with generous deadlines, never on fixed
sleeps. Brokers listen on port 0 and report the port they got.
"""
import json
import os
import signal
import subprocess
import threading
import time

BIN = os.environ.get("COHORT_BIN") or os.path.join(
    os.path.dirname(__file__), "..", "..", "build", "asan")

# Loaded 2-core CI machines with sanitizers are slow; deadlines are generous.
DEADLINE = float(os.environ.get("COHORT_TEST_DEADLINE", "60"))


def wait_until(cond, timeout=DEADLINE, what="condition", interval=0.05):
    """Polls cond() until it returns a truthy value; returns that value."""
    end = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > end:
            raise AssertionError("timed out after %.0f s waiting for %s" % (timeout, what))
        time.sleep(interval)


class Proc:
    """A child process whose JSON log lines are collected as dicts."""

    def __init__(self, argv, name):
        self.name = name
        self.argv = argv
        self.lines = []
        self.raw = []
        self.lock = threading.Lock()
        self.p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE)
        self.t = threading.Thread(target=self._read, daemon=True)
        self.t.start()

    def _read(self):
        for raw in self.p.stderr:
            text = raw.decode("utf-8", "replace").rstrip("\n")
            with self.lock:
                self.raw.append(text)
                try:
                    self.lines.append(json.loads(text))
                except ValueError:
                    pass        # sanitizer reports and the like: kept in raw

    def logs(self, msg=None):
        with self.lock:
            return [l for l in self.lines if msg is None or l.get("msg") == msg]

    def last(self, msg):
        got = self.logs(msg)
        return got[-1] if got else None

    def wait_log(self, msg, pred=lambda l: True, timeout=DEADLINE):
        return wait_until(lambda: next((l for l in reversed(self.logs(msg)) if pred(l)), None),
                          timeout, "%s to log %r" % (self.name, msg))

    def alive(self):
        return self.p.poll() is None

    def kill(self, sig=signal.SIGKILL):
        if self.alive():
            self.p.send_signal(sig)

    def stop(self, timeout=30):
        """SIGTERM, then SIGKILL; returns the exit status."""
        if self.alive():
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(timeout)
            except subprocess.TimeoutExpired:
                self.p.kill()
        rc = self.p.wait()
        self.t.join(5)
        return rc

    def sanitizer_report(self):
        with self.lock:
            return [l for l in self.raw if "Sanitizer" in l or "runtime error" in l]


def bin_path(name):
    return os.path.join(BIN, name)


def start_broker(*extra, listen="127.0.0.1:0"):
    argv = [bin_path("cohort-operator"), "--standalone", "--listen", listen,
            "--log-format", "json", *extra]
    p = Proc(argv, "broker")
    line = p.wait_log("Broker is listening.")
    p.address = line["address"]
    return p


def start_sidecar(broker, cohort, member_id, *extra):
    argv = [bin_path("cohort-sidecar"), "--broker", broker, "--cohort", cohort,
            "--id", member_id, "--log-format", "json", *extra]
    p = Proc(argv, member_id)
    p.id = member_id
    return p


def latest_epoch(p):
    """The sidecar's latest adopted epoch line, or None."""
    return p.last("Adopted a new epoch.")


def all_see(sidecars, pred):
    """True when every sidecar's latest epoch satisfies pred."""
    eps = [latest_epoch(s) for s in sidecars]
    return all(e is not None and pred(e) for e in eps) and eps


def cohortctl(*args, timeout=60):
    return subprocess.run([bin_path("cohortctl"), *args], capture_output=True, text=True,
                          timeout=timeout)


def status_json(broker, *extra):
    r = cohortctl("status", "--broker", broker, "-o", "json", *extra)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)

"""Child processes: one whose JSON log lines are collected, stopping one
(SIGTERM, then SIGKILL), and children in their own process group, killed
as a group when they outlive their deadline."""
import json
import os
import signal
import subprocess
import threading

from .core import DEADLINE, wait_until

# The longest a child may live: a whole run on a loaded 2-core machine
# with sanitizers (cohortctl run's own --timeout, RUN_TIMEOUT, is shorter).
PROC_TIMEOUT = 2 * DEADLINE + 60


def stop_process(p, timeout=20):
    """SIGTERM, then SIGKILL after `timeout` seconds; returns the exit status."""
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
    return p.wait()


class Proc:
    """A child process whose JSON log lines (stderr) are collected as dicts;
    other lines (sanitizer reports and the like) are kept in raw."""

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
                    pass

    def logs(self, msg=None):
        with self.lock:
            return [l for l in self.lines if msg is None or l.get("msg") == msg]

    def last(self, msg):
        got = self.logs(msg)
        return got[-1] if got else None

    def wait_log(self, msg, pred=lambda l: True, timeout=DEADLINE):
        return wait_until(lambda: next((l for l in reversed(self.logs(msg)) if pred(l)), None),
                          "%s to log %r" % (self.name, msg), timeout)

    def alive(self):
        return self.p.poll() is None

    def kill(self, sig=signal.SIGKILL):
        if self.alive():
            self.p.send_signal(sig)

    def stop(self, timeout=30):
        """SIGTERM, then SIGKILL; returns the exit status."""
        rc = stop_process(self.p, timeout)
        self.t.join(5)
        return rc

    def sanitizer_report(self):
        with self.lock:
            return [l for l in self.raw if "Sanitizer" in l or "runtime error" in l]


def spawn_group(argv, env=None):
    """A child in its own session (so its own process group), stdout and
    stderr piped as text."""
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)


def finish(p, timeout=PROC_TIMEOUT, what=None):
    """(exit status, stdout, stderr) of a spawn_group() child; kills its
    whole group and fails when it runs past `timeout` seconds."""
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        raise AssertionError("%s hung; stderr:\n%s" % (what or p.args, err[-4000:]))
    return p.returncode, out, err


def run_group(argv, timeout=PROC_TIMEOUT, env=None, what=None):
    """Runs argv as spawn_group() and finish() do."""
    return finish(spawn_group(argv, env), timeout, what)


class Procs:
    """Processes a test starts, stopped at its end (last first); a
    sanitizer report or an unclean exit of one of them fails the test. A
    graceful stop exits 0; a process the test killed is excused."""

    def __init__(self):
        self.procs = []

    def add(self, p):
        self.procs.append(p)
        return p

    def close(self):
        bad = []
        for p in reversed(self.procs):
            rc = p.stop()
            if rc not in (0, -signal.SIGKILL):
                bad.append("%s exited %s" % (p.name, rc))
            bad += ["%s: %s" % (p.name, l) for l in p.sanitizer_report()]
        assert not bad, "\n".join(bad)

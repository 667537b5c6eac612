"""bench/benchlib.py: what the Python benchmarks that run a broker share
(bench/aggregation.py, bench/averager.py): where the build is, a free
port, and a standalone broker."""
import json
import os
import socket
import subprocess
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
# The build whose binaries and Python package run: $BUILD, else build/.
BUILD = os.path.abspath(os.environ.get("BUILD", os.path.join(ROOT, "build")))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_broker(log_path, operator=None):
    """cohort-operator --standalone (`operator`, else the build's) on a free
    port, open (no keys); its log goes to a file, which is read for the
    address (a pipe nobody drains would stall it). Returns (process,
    address); exits the benchmark if no broker listens within a minute."""
    log = open(log_path, "w")
    p = subprocess.Popen([operator or os.path.join(BUILD, "cohort-operator"), "--standalone",
                          "--listen", "127.0.0.1:0", "--insecure", "--allow-any-cohort",
                          "--log-format", "json"],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log)
    end = time.monotonic() + 60
    while time.monotonic() < end and p.poll() is None:
        with open(log_path) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if rec.get("msg") == "Broker is listening.":
                    return p, rec["address"]
        time.sleep(0.05)
    p.kill()
    raise SystemExit("the broker did not start; see %s" % log_path)


def wait_members(size, n):
    """Waits until size() (a cohort's member count) is n; exits the
    benchmark if it is not within a minute."""
    end = time.monotonic() + 60
    while size() != n:
        if time.monotonic() > end:
            raise SystemExit("the cohort never had %d members" % n)
        time.sleep(0.01)

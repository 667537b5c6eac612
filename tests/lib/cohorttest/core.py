"""What every test waits with: one deadline, one wait on a condition,
free ports, and temp dirs that can outlive a run for its logs."""
import os
import shutil
import socket
import subprocess
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
# Loaded 2-core CI machines with sanitizers are slow; deadlines are
# generous, and only reached when something is wrong.
DEADLINE = float(os.environ.get("COHORT_TEST_DEADLINE", "60"))
KEEP = os.environ.get("COHORT_KEEP_LOGS") == "1"     # keep temp dirs with the processes' logs


def wait_until(cond, what="a condition", timeout=DEADLINE, interval=0.05):
    """Polls cond() until it returns something truthy, and returns that."""
    end = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > end:
            raise AssertionError("timed out after %.0f s waiting for %s" % (timeout, what))
        time.sleep(interval)


def free_port():
    """A loopback port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_tmp(prefix="cohort-"):
    # Short, under /tmp: a sidecar's socket path under it must fit in sun_path.
    return tempfile.mkdtemp(prefix=prefix, dir="/tmp")


def remove_tmp(tmp):
    if KEEP:
        print("kept logs in", tmp)
    else:
        shutil.rmtree(tmp, ignore_errors=True)


def read_text(path):
    """A file's text, or "" when it cannot be read."""
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def tool_available(path):
    """(True, None) once the tool at `path` (build/tools/kubectl or helm)
    is there, installing both with scripts/install-kubectl.sh if it is
    missing; (False, the script's last words) when that fails."""
    if os.access(path, os.X_OK):
        return True, None
    r = subprocess.run([os.path.join(ROOT, "scripts", "install-kubectl.sh")],
                       capture_output=True, text=True, timeout=600)
    if os.access(path, os.X_OK):
        return True, None
    return False, (r.stderr.strip() or r.stdout.strip())[-1000:]

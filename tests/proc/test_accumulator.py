"""The Accumulator end to end: `cohortctl run` with an embedded broker, real
sidecars and the example trainer (examples/c/logreg.c) as real processes.

- A cohort follows single-process SGD at the same virtual batch size.
- Trainers and sidecars killed with SIGKILL mid-run and a peer added later:
  the run completes, nothing hangs, the survivors agree.
- Exact accounting with integer gradients: every committed round is the sum
  of the contributions of the members of its epoch, nothing lost, nothing
  counted twice. Trainers log each contribution before making it, each
  commit (the result times num_gradients, and their own part) and each
  state they receive (with the contributions the node dropped), so the
  sums can be checked from the trainers' side alone.
- `cohortctl run` fails when a trainer fails unexpectedly, on a timeout and
  on Ctrl-C, stops everything, and refuses bad flags with exit status 2.
"""
import json
import os
import re
import signal
import subprocess
import time

import pytest

from cohorttest.accounting import check_accounting, load_stats
from cohorttest import (BIN, DEADLINE, PROC_TIMEOUT, RUN_TIMEOUT, bin_path, cohortctl_run,
                        explain_run, finish, run_group, spawn_group)

LOGREG = os.path.join(BIN, "examples", "logreg")
FINAL = re.compile(r"^final model_version=(\d+) digest=([0-9a-f]{16})$")


def run(*args, timeout=PROC_TIMEOUT):
    """cohortctl in its own session; the whole group is killed on timeout."""
    return run_group([bin_path("cohortctl"), *args], timeout, what="cohortctl " + " ".join(args))


def run_json(tmp_path, n, trainer_args, *extra, name="run"):
    """cohortctl run -o json of the example trainer with its logs in
    tmp_path/name; returns (exit status, summary, stderr)."""
    return cohortctl_run(tmp_path / name, n, [LOGREG, *trainer_args], *extra)


def no_children_left(summary):
    for p in summary["peers"]:
        for kind in ("trainer", "sidecar"):
            pid = p[kind]["pid"]
            assert not p[kind]["running"], "%s's %s still runs" % (p["id"], kind)
            if pid:
                with pytest.raises(ProcessLookupError):
                    os.kill(pid, 0)


def sanitizer_reports(summary):
    bad = []
    for p in summary["peers"]:
        for key in ("stderr", "sidecar_log"):
            try:
                with open(p[key]) as f:
                    bad += ["%s: %s" % (p[key], l.rstrip()) for l in f
                            if "Sanitizer" in l or "runtime error" in l]
            except OSError:
                pass
    return bad


def read_params(path):
    with open(path) as f:
        return [float(l) for l in f if l.strip()]


# ---- the trainer alone ------------------------------------------------------

def test_logreg_local_converges_and_prints_its_final_line(tmp_path):
    r = subprocess.run([LOGREG, "--local", "--steps", "150", "--stats-file",
                        str(tmp_path / "%i.jsonl")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    last = r.stdout.strip().splitlines()[-1]
    m = FINAL.match(last)
    assert m and m.group(1) == "150", last
    final = load_stats(tmp_path)["local"][-1]
    assert final["ev"] == "final" and final["digest"] == m.group(2)
    # Bayes error of the synthetic model is about 0.12: the fit gets close.
    assert final["eval_accuracy"] > 0.85 and final["eval_loss"] < 0.40, final
    losses = [e["loss"] for e in load_stats(tmp_path)["local"] if e["ev"] == "commit"]
    assert losses[0] == pytest.approx(0.6931, abs=1e-3)     # log 2 from zero weights
    assert sum(losses[-20:]) / 20 < 0.40
    assert "model_version=150" in r.stderr       # progress lines on stderr


# ---- a cohort is single-process SGD ---------------------------------------

def test_cohort_trajectory_equals_single_process_sgd(tmp_path):
    steps, vb = "40", "96"          # 96 is shared evenly by 1, 2, 3 and 4 members
    common = ["--steps", steps, "--virtual-batch", vb, "--linger", "500ms"]
    ref = subprocess.run([LOGREG, "--local", *common, "--params-out", str(tmp_path / "local.txt"),
                          "--stats-file", str(tmp_path / "local.jsonl")],
                         capture_output=True, text=True, timeout=60)
    assert ref.returncode == 0, ref.stderr
    want = read_params(tmp_path / "local.txt")
    want_digest = FINAL.match(ref.stdout.strip().splitlines()[-1]).group(2)
    ref_loss = {e["v"]: e["loss"] for e in load_stats(tmp_path)["local"] if e["ev"] == "commit"}

    # One member: the same arithmetic, so the same bits.
    rc, s1, err = run_json(tmp_path, 1, [*common, "--params-out", str(tmp_path / "one-%i.txt")],
                           name="one")
    assert rc == 0, explain_run(s1, err)
    assert s1["final"] == "final model_version=%s digest=%s" % (steps, want_digest)

    # Four members: each sums its quarter; only the order of additions differs.
    stats = tmp_path / "four"
    stats.mkdir()
    rc, s4, err = run_json(tmp_path, 4, [*common, "--wait-for", "4", "--params-out", str(stats / "%i.txt"),
                                         "--stats-file", str(stats / "%i.jsonl")], name="run4")
    assert rc == 0, explain_run(s4, err)
    assert s4["agree"] and s4["final"].startswith("final model_version=%s " % steps)
    for p in s4["peers"]:
        got = read_params(stats / ("%s.txt" % p["id"]))
        assert got == pytest.approx(want, rel=1e-4, abs=1e-5), p["id"]
    # The loss trajectory too: round v's loss is the mean of the members'
    # losses on their equal shares.
    by_round = {}
    for evs in load_stats(stats).values():
        for e in evs:
            if e["ev"] == "contrib" and e["k"] == 0:
                by_round.setdefault(e["v"], []).append((e["size"], e["loss"]))
    checked = 0
    for v, parts in by_round.items():
        if len(parts) == parts[0][0] and all(sz == parts[0][0] for sz, _ in parts):
            mean = sum(l for _, l in parts) / len(parts)
            assert mean == pytest.approx(ref_loss[v + 1], rel=1e-4, abs=1e-5), v
            checked += 1
    assert checked >= int(steps) // 2, "only %d rounds had every member's loss" % checked


# ---- elasticity --------------------------------------------------------------

# kill -9 one trainer, then one sidecar, then add a fifth peer, all while
# the cohort trains. --delay paces the rounds so the versions that trigger
# the events come well before the last one on any machine.
ELASTIC = ["--steps", "160", "--delay", "20ms", "--log-every", "1", "--stall-timeout", "30s",
           "--wait-for", "4"]
SCHEDULE = "kill-trainer@v=25:1,kill-sidecar@v=50:2,add@v=70"


def check_elastic_summary(summary, err, steps):
    killed = {p["id"]: p["killed"] for p in summary["peers"] if p["killed"]}
    assert killed == {"peer-1": "trainer", "peer-2": "sidecar"}, summary["peers"]
    assert [e["fired"] for e in summary["events"]] == [True, True, True], summary["events"]
    assert [p["id"] for p in summary["peers"]] == ["peer-%d" % i for i in range(5)]
    assert summary["survivors"] == 3 and summary["agree"] is True
    m = FINAL.match(summary["final"])
    assert m and m.group(1) == str(steps)
    survivors = [p for p in summary["peers"] if not p["killed"]]
    assert all(p["trainer"]["exit_code"] == 0 and p["last_line"] == summary["final"]
               for p in survivors)
    no_children_left(summary)
    assert not sanitizer_reports(summary)
    assert "Sanitizer" not in err and "runtime error" not in err


def test_kill_trainer_kill_sidecar_add_peer_all_survivors_agree(tmp_path):
    stats = tmp_path / "stats"
    stats.mkdir()
    rc, s, err = run_json(tmp_path, 4, [*ELASTIC, "--stats-file", str(stats / "%i.jsonl")],
                          "--schedule", SCHEDULE)
    assert rc == 0, explain_run(s, err)
    check_elastic_summary(s, err, 160)
    # The trainer whose sidecar died says so and exits 1.
    p2 = s["peers"][2]
    assert p2["trainer"]["exit_code"] == 1
    with open(p2["stderr"]) as f:
        assert "the sidecar is gone" in f.read()
    # The added peer got the leader's state and finished with the others.
    st = load_stats(stats)
    got = [e for e in st["peer-4"] if e["ev"] == "state"]
    assert got and got[0]["to_v"] > 0
    finals = [evs[-1] for pid, evs in st.items() if pid in ("peer-0", "peer-3", "peer-4")]
    assert all(f["ev"] == "final" and f["eval_accuracy"] > 0.85 for f in finals), finals


def test_time_triggered_kill_peer_and_add(tmp_path):
    # The other forms of the schedule: times since the start, and kill-peer
    # (trainer and sidecar at once).
    rc, s, err = run_json(tmp_path, 3, ["--steps", "400", "--delay", "10ms", "--wait-for", "3",
                                        "--stall-timeout", "30s"],
                          "--schedule", "kill-peer@2s:1,add@2500ms")
    assert rc == 0, explain_run(s, err)
    assert [e["fired"] for e in s["events"]] == [True, True]
    assert s["events"][0]["at_s"] >= 2.0 and s["events"][1]["at_s"] >= 2.5
    assert len(s["peers"]) == 4 and s["agree"] and s["final"].startswith("final model_version=400 ")
    if s["peers"][1]["killed"]:
        assert s["peers"][1]["killed"] == "peer"
        assert s["peers"][1]["trainer"]["signal"] == "KILL"
        assert s["peers"][1]["sidecar"]["signal"] == "KILL"
    no_children_left(s)


def test_exact_accounting_with_integer_gradients_through_kills_and_an_add(tmp_path):
    stats = tmp_path / "stats"
    stats.mkdir()
    rc, s, err = run_json(tmp_path, 4, [*ELASTIC, "--integer-grads",
                                        "--stats-file", str(stats / "%i.jsonl")],
                          "--schedule", SCHEDULE)
    assert rc == 0, explain_run(s, err)
    check_elastic_summary(s, err, 160)
    assert check_accounting(load_stats(stats), 160) == 160


def test_exact_accounting_without_faults_needs_no_attribution(tmp_path):
    stats = tmp_path / "stats"
    stats.mkdir()
    rc, s, err = run_json(tmp_path, 3, ["--steps", "60", "--integer-grads", "--batch", "16",
                                        "--virtual-batch", "96", "--linger", "500ms",
                                        "--stats-file", str(stats / "%i.jsonl")])
    assert rc == 0, explain_run(s, err)
    st = load_stats(stats)
    check_accounting(st, 60)
    # With everyone there throughout, each round is exactly the committers'.
    rounds = {}
    for evs in st.values():
        for e in evs:
            if e["ev"] == "commit":
                r = rounds.setdefault(e["v"], [e["total"], e["wsum"], e["G"], 0, 0, 0])
                r[3] += e["mine_total"]
                r[4] += e["mine_wsum"]
                r[5] += e["mine_calls"]
    for v, (t, w, g, mt, mw, mc) in rounds.items():
        if sum(1 for evs in st.values() for e in evs if e["ev"] == "commit" and e["v"] == v) == 3:
            assert (t, w, g) == (mt, mw, mc), v


# ---- failures, deadlines, signals -------------------------------------------

def test_unexpected_trainer_failure_fails_the_run(tmp_path):
    script = ('if [ "$COHORT_RUN_INDEX" = 1 ]; then echo "giving up" >&2; exit 3; fi; '
              'exec "$0" --steps 20 --linger 200ms')
    rc, out, err = run("run", "-n", "2", "--no-view", "-o", "json", "--timeout", RUN_TIMEOUT,
                       "--run-dir", str(tmp_path / "run"), "--", "sh", "-c", script, LOGREG)
    assert rc == 1, err
    s = json.loads(out.strip().splitlines()[-1])
    assert not s["ok"] and s["reason"] == "a trainer or sidecar failed"
    p0, p1 = s["peers"]
    assert p1["failed"] and p1["trainer"]["exit_code"] == 3 and not p1["killed"]
    assert not p0["failed"] and p0["trainer"]["exit_code"] == 0
    assert FINAL.match(p0["last_line"])
    assert "peer-1's trainer FAILED" in err and "logs are in" in err
    no_children_left(s)


def test_trainer_with_other_flags_than_the_cohort_refuses_to_train(tmp_path):
    # peer-1 is added behind peer-0, so it must take peer-0's state, which
    # says the cohort trains with another seed: it refuses and exits 1, an
    # unexpected failure; peer-0 trains on alone and finishes.
    script = 'exec "$0" --steps 300 --delay 5ms --seed "$COHORT_RUN_INDEX"'
    rc, out, err = run("run", "-n", "1", "--no-view", "-o", "json", "--timeout", RUN_TIMEOUT,
                       "--schedule", "add@v=20", "--run-dir", str(tmp_path / "run"), "--",
                       "sh", "-c", script, LOGREG)
    s = json.loads(out.strip().splitlines()[-1])
    assert rc == 1 and s["reason"] == "a trainer or sidecar failed", explain_run(s, err)
    p0, p1 = s["peers"]
    assert p1["failed"] and p1["trainer"]["exit_code"] == 1, explain_run(s, err)
    with open(p1["stderr"]) as f:
        assert "the cohort trains with other flags" in f.read()
    assert not p0["failed"] and FINAL.match(p0["last_line"]), explain_run(s, err)
    no_children_left(s)


def test_run_timeout_stops_everything(tmp_path):
    t0 = time.monotonic()
    rc, out, err = run("run", "-n", "2", "--no-view", "-o", "json", "--timeout", "3s",
                       "--run-dir", str(tmp_path / "run"), "--", LOGREG, "--steps", "1000000",
                       "--delay", "10ms")
    took = time.monotonic() - t0
    s = json.loads(out.strip().splitlines()[-1])
    assert rc == 1 and s["reason"] == "timeout", err
    # The timeout, then at most the SIGTERM grace per kind of process.
    assert took < 3 + 2 * 5 + DEADLINE / 2, took
    no_children_left(s)


def test_ctrl_c_stops_everything_cleanly(tmp_path):
    p = spawn_group([bin_path("cohortctl"), "run", "-n", "2", "--no-view", "-o", "json",
                     "--run-dir", str(tmp_path / "run"), "--", LOGREG, "--steps", "1000000",
                     "--delay", "10ms"])
    # Wait until both trainers make progress, then Ctrl-C the group, as
    # a terminal would.
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline:
        errs = [tmp_path / "run" / ("%d.err" % i) for i in range(2)]
        if all(f.exists() and "model_version=" in f.read_text() for f in errs):
            break
        time.sleep(0.1)
    os.killpg(p.pid, signal.SIGINT)
    rc, out, err = finish(p, DEADLINE, "cohortctl run after Ctrl-C")
    s = json.loads(out.strip().splitlines()[-1])
    assert rc == 1 and s["reason"] == "interrupted", err
    no_children_left(s)
    assert not sanitizer_reports(s)


def test_help_and_a_clean_run_exit_zero(tmp_path):
    rc, out, _ = run("run", "--help")
    assert rc == 0 and "Usage: cohortctl run" in out and "kill-trainer" in out
    rc, out, err = run("run", "-n", "2", "--timeout", RUN_TIMEOUT, "--", LOGREG, "--steps", "10",
                       "--linger", "200ms")
    assert rc == 0, err
    assert "agreement: all 2 surviving trainers end with \"final model_version=10" in out
    assert "logs in" in err


@pytest.mark.parametrize("args, needle", [
    (["run"], "want the trainer command"),
    (["run", "-n", "2"], "want the trainer command"),
    (["run", "-n", "0", "--", "true"], "bad -n"),
    (["run", "-n", "x", "--", "true"], "bad -n"),
    (["run", "--schedule", "explode@5s:1", "--", "true"], "the action is"),
    (["run", "--schedule", "kill-trainer@5s", "--", "true"], "names its peer"),
    (["run", "--schedule", "add@5s:1", "--", "true"], "add takes no peer"),
    (["run", "--schedule", "kill-sidecar@soon:1", "--", "true"], "WHEN is a duration"),
    (["run", "--schedule", "kill-sidecar@v=x:1", "--", "true"], "v= wants"),
    (["run", "--schedule", "add@5s,,add@6s", "--", "true"], "empty"),
    (["run", "--timeout", "5", "--", "true"], "bad --timeout"),
    (["run", "-o", "yaml", "--", "true"], "-o must be"),
    (["run", "--heartbeat", "1s", "--member-timeout", "500ms", "--", "true"], "longer than"),
    (["run", "--cohort", "bad name", "--", "true"], "bad --cohort"),
    (["run", "--id-prefix", "a b", "--", "true"], "bad --id-prefix"),
    (["run", "--log-format", "xml", "--", "true"], "--log-format"),
    (["run", "--frobnicate", "--", "true"], "Try 'cohortctl run --help'"),
])
def test_run_bad_flags_are_usage_errors(args, needle):
    rc, _, err = run(*args, timeout=30)
    assert rc == 2, (rc, err)
    assert needle in err


@pytest.mark.parametrize("args, needle", [
    (["--steps", "0"], "bad --steps"),
    (["--lr", "-1"], "bad --lr"),
    (["--virtual-batch", "x"], "bad --virtual-batch"),
    (["--delay", "1"], "bad --delay"),
    (["--local", "--connect", "unix:/x"], "exclude"),
    (["extra"], "unexpected argument"),
])
def test_logreg_bad_flags_are_usage_errors(args, needle):
    r = subprocess.run([LOGREG, *args], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and needle in r.stderr, r.stderr


def test_logreg_without_a_sidecar_fails_clearly(tmp_path):
    env = dict(os.environ, COHORT_SOCKET="unix:%s" % (tmp_path / "none.sock"))
    env.pop("COHORT_BROKER", None)
    r = subprocess.run([LOGREG, "--connect-timeout", "300ms"], capture_output=True, text=True,
                       timeout=30, env=env)
    assert r.returncode == 1 and "cannot connect" in r.stderr, r.stderr

"""examples/pytorch/train.py under `cohortctl run`: real sidecars, real
trainers, kills and additions on a schedule.

- Four peers train the MLP: the loss goes down and all end with the same
  final line.
- A joiner gets the leader's parameters, buffers and Adam state_dict
  (set_state/state) and then follows the cohort bit for bit: its final
  parameters and optimizer state equal the others'.
- A trainer killed with SIGKILL, a sidecar killed under its trainer (which
  fails with a clear message) and a peer added, all mid-run: the survivors
  and the newcomer agree.
- A peer added after the others finished and left takes the final model
  from the checkpoint they wrote in $COHORT_RUN_DIR: it agrees with them.
"""
from cohorttest import explain_run, read_text
from pyproc import FINAL, done_line, run_train


def survivors(summary):
    return [p for p in summary["peers"] if not p["killed"]]


def check_agree(summary, err, steps):
    assert summary["agree"] is True, explain_run(summary, err)
    m = FINAL.match(summary["final"])
    assert m and m.group(1) == str(steps), summary["final"]
    done = {}
    for p in survivors(summary):
        assert p["trainer"]["exit_code"] == 0 and p["last_line"] == summary["final"], p
        d = done_line(read_text(p["stderr"]))
        assert d, p["id"]
        done[p["id"]] = d
    # Same optimizer state everywhere: joiners got the leader's.
    assert len({d["optimizer_digest"] for d in done.values()}) == 1, done
    return done


def test_four_peers_train_the_example_and_agree(tmp_path):
    rc, s, err = run_train(tmp_path, 4, ["--steps", "60", "--wait-for", "4"])
    assert rc == 0, explain_run(s, err)
    done = check_agree(s, err, 60)
    for d in done.values():
        assert float(d["eval_loss"]) < 0.8 * float(d["initial_eval_loss"]), d
    losses = [float(l.split("loss=")[1].split()[0])
              for l in read_text(s["peers"][0]["stderr"]).splitlines()
              if l.startswith("model_version=")]
    assert len(losses) == 6 and losses[-1] < losses[0], losses


def test_a_joiner_receives_the_optimizer_state_and_follows(tmp_path):
    # The joiner's interpreter may start after peer-0 reached its last
    # version on a loaded machine: peer-0 lingers, serving its state.
    rc, s, err = run_train(tmp_path, 1, ["--steps", "60", "--delay", "0.02", "--log-every", "1",
                                         "--stall-timeout", "60", "--linger", "15"],
                           "--schedule", "add@v=15")
    assert rc == 0, explain_run(s, err)
    assert [p["id"] for p in s["peers"]] == ["peer-0", "peer-1"]
    check_agree(s, err, 60)
    got = [l for l in read_text(s["peers"][1]["stderr"]).splitlines()
           if l.startswith("received the leader's state")]
    assert got, read_text(s["peers"][1]["stderr"])[-2000:]
    v = int(got[0].split("model_version=")[1].split()[0])
    assert v >= 15, got


def test_kill_trainer_kill_sidecar_add_peer_survivors_agree(tmp_path):
    rc, s, err = run_train(tmp_path, 4, ["--steps", "90", "--delay", "0.02", "--log-every", "1",
                                         "--wait-for", "4", "--stall-timeout", "60",
                                         "--linger", "15"],
                           "--schedule", "kill-trainer@v=15:1,kill-sidecar@v=30:2,add@v=45")
    assert rc == 0, explain_run(s, err)
    assert [e["fired"] for e in s["events"]] == [True, True, True], s["events"]
    killed = {p["id"]: p["killed"] for p in s["peers"] if p["killed"]}
    assert killed == {"peer-1": "trainer", "peer-2": "sidecar"}, s["peers"]
    assert s["survivors"] == 3
    check_agree(s, err, 90)
    # The trainer whose sidecar died said why and exited 1: no crash.
    p2 = s["peers"][2]
    assert p2["trainer"]["exit_code"] == 1, p2
    assert "the sidecar is gone" in read_text(p2["stderr"])
    assert "Traceback" not in read_text(p2["stderr"])
    # The added peer caught up through the leader's state.
    assert "received the leader's state at model_version=" in read_text(s["peers"][4]["stderr"])


def test_a_peer_added_after_the_end_takes_the_final_model(tmp_path):
    # peer-0 leaves as soon as it reaches version 20 (--linger 0), when the
    # addition fires: the new interpreter finds nobody to learn from, and
    # must end with the cohort's model, not one of its own from version 0.
    rc, s, err = run_train(tmp_path, 1, ["--steps", "20", "--linger", "0"],
                           "--schedule", "add@v=20")
    assert rc == 0, explain_run(s, err)
    assert [p["id"] for p in s["peers"]] == ["peer-0", "peer-1"]
    check_agree(s, err, 20)
    assert "the cohort finished before this trainer joined it" in \
        read_text(s["peers"][1]["stderr"]), read_text(s["peers"][1]["stderr"])[-2000:]

"""A broker and sidecars as real processes on loopback: agreement, eviction
of a killed member, graceful leave, broker restart, leadership by model
version, and refusals of bad input."""
import os
import signal
import subprocess
import time

import pytest

from cohorttest import (Procs, all_see, bin_path, cohortctl, free_port, latest_epoch, start_broker,
                        start_sidecar, status_json, wait_until)

TIMEOUT_S = 5.0          # the default member timeout the issue names


class Cohort(Procs):
    def broker(self, *extra, **kw):
        return self.add(start_broker(*extra, **kw))

    def sidecar(self, broker, cohort, member_id, *extra):
        return self.add(start_sidecar(broker.address, cohort, member_id, *extra))


@pytest.fixture
def cohort():
    c = Cohort()
    yield c
    c.close()


def agree(sidecars, n):
    """Every sidecar's latest epoch has n members, and all share it."""
    eps = all_see(sidecars, lambda e: e["n_members"] == n)
    if not eps:
        return None
    if len({(e["epoch"], e["leader"], e["members"]) for e in eps}) != 1:
        return None
    return eps[0]


def start_eight(cohort, *broker_extra):
    b = cohort.broker("--cohort", "demo", *broker_extra)
    sc = [cohort.sidecar(b, "demo", "m-%d" % i) for i in range(8)]
    ep = wait_until(lambda: agree(sc, 8), what="8 sidecars to agree on one epoch")
    return b, sc, ep


def test_eight_sidecars_agree_and_status_matches(cohort):
    b, sc, ep = start_eight(cohort)
    # Natural member order, and the tie on version 0 goes to the first.
    assert ep["members"] == ",".join("m-%d" % i for i in range(8))
    assert ep["leader"] == "m-0"
    st = status_json(b.address)
    assert [c["name"] for c in st["cohorts"]] == ["demo"]
    c = st["cohorts"][0]
    assert c["epoch"] == ep["epoch"] and c["leader"] == "m-0"
    assert [m["id"] for m in c["members"]] == ["m-%d" % i for i in range(8)]
    assert all(m["address"].startswith("127.0.0.1:") and m["model_version"] == 0
               for m in c["members"])
    table = cohortctl("status", "--broker", b.address)
    assert table.returncode == 0
    assert "demo" in table.stdout and "m-7" in table.stdout and "LEADER" in table.stdout


def test_kill9_member_is_evicted_within_timeout_plus_one_second(cohort):
    b, sc, ep = start_eight(cohort)
    victim = sc[3]
    t0 = time.monotonic()
    victim.kill(signal.SIGKILL)
    rest = [s for s in sc if s is not victim]
    ep2 = wait_until(lambda: agree(rest, 7), what="the survivors to see 7 members")
    took = time.monotonic() - t0
    assert ep2["epoch"] > ep["epoch"]
    assert "m-3" not in ep2["members"].split(",")
    # The protocol's promise: silence is noticed within the timeout, and the
    # epoch reaches everyone within a second more.
    assert took <= TIMEOUT_S + 1.0, "eviction took %.2f s" % took


def test_graceful_leave_takes_effect_at_once(cohort):
    b, sc, ep = start_eight(cohort)
    t0 = time.monotonic()
    assert sc[5].stop() == 0
    rest = [s for s in sc if s is not sc[5]]
    wait_until(lambda: agree(rest, 7), what="the others to see the leave")
    took = time.monotonic() - t0
    # Well inside the eviction timeout: the leave, not the silence, did it.
    assert took < TIMEOUT_S, "leave took %.2f s" % took
    assert sc[5].last("Left the cohort.") is not None


def test_restarted_broker_rebuilds_the_cohort(cohort):
    b, sc, ep = start_eight(cohort)
    port = b.address.rsplit(":", 1)[1]
    b.kill(signal.SIGKILL)
    b.stop()
    # Members notice the outage and keep retrying.
    wait_until(lambda: all(s.logs("The session stream broke; reopening.") for s in sc),
               what="every sidecar to notice the broker is gone")
    b2 = cohort.broker("--cohort", "demo", listen="127.0.0.1:" + port)
    t0 = time.monotonic()
    ep2 = wait_until(lambda: (lambda e: e and e["epoch"] > ep["epoch"] and e)(agree(sc, 8)),
                     what="the cohort to be rebuilt")
    took = time.monotonic() - t0
    assert took <= TIMEOUT_S, "rebuild took %.2f s" % took
    # Epochs keep growing across the restart: joiners report what they saw.
    assert ep2["epoch"] > ep["epoch"]
    st = status_json(b2.address, "--cohort", "demo")
    assert len(st["cohorts"][0]["members"]) == 8


def test_higher_model_version_becomes_leader_everywhere(cohort):
    b, sc, ep = start_eight(cohort)
    assert ep["leader"] == "m-0"
    late = cohort.sidecar(b, "demo", "m-8", "--model-version", "5")
    everyone = sc + [late]
    ep2 = wait_until(lambda: (lambda e: e and e["leader"] == "m-8" and e)(agree(everyone, 9)),
                     what="m-8 to lead everywhere")
    assert ep2["epoch"] > ep["epoch"]
    st = status_json(b.address)
    assert st["cohorts"][0]["leader"] == "m-8"
    assert {m["id"]: m["model_version"] for m in st["cohorts"][0]["members"]}["m-8"] == 5


def test_many_cohorts_churn_in_one_leaves_the_other_alone(cohort):
    b = cohort.broker("--cohort", "a", "--cohort", "b")
    sa = [cohort.sidecar(b, "a", "a-%d" % i) for i in range(3)]
    sb = [cohort.sidecar(b, "b", "b-%d" % i) for i in range(3)]
    wait_until(lambda: agree(sa, 3) and agree(sb, 3), what="both cohorts to form")
    before_b = latest_epoch(sb[0])["epoch"]
    # Members that joined at different moments adopted different numbers
    # of epochs while b formed; what matters is that none adopts another.
    adopted_b = [len(s.logs("Adopted a new epoch.")) for s in sb]
    extra = [cohort.sidecar(b, "a", "a-%d" % i) for i in range(3, 6)]
    grown = wait_until(lambda: agree(sa + extra, 6), what="cohort a to grow")
    for s in extra:
        assert s.stop() == 0
    wait_until(lambda: (lambda e: e and e["epoch"] > grown["epoch"])(agree(sa, 3)),
               what="cohort a to shrink")
    # Cohort b saw none of it: same epoch, and no line about a's members.
    assert all(latest_epoch(s)["epoch"] == before_b for s in sb)
    assert [len(s.logs("Adopted a new epoch.")) for s in sb] == adopted_b


def test_unknown_cohort_and_duplicate_id_are_refused_and_others_keep_going(cohort):
    b = cohort.broker("--cohort", "demo")
    good = [cohort.sidecar(b, "demo", "m-%d" % i) for i in range(2)]
    wait_until(lambda: agree(good, 2), what="the good members to agree")
    stray = cohort.sidecar(b, "nosuch", "x-0")
    line = stray.wait_log("Could not join the cohort; retrying.")
    assert line["code"] == "NOT_FOUND" and "unknown cohort" in line["detail"]
    dup = cohort.sidecar(b, "demo", "m-1")
    line = dup.wait_log("Could not join the cohort; retrying.")
    assert line["code"] == "ALREADY_EXISTS"
    refused = b.wait_log("A request was refused.", lambda l: l.get("code") == "ALREADY_EXISTS")
    assert refused["cohort"] == "demo" and refused["id"] == "m-1"
    # The rest of the cohort never noticed.
    e = agree(good, 2)
    assert e and e["members"] == "m-0,m-1"
    # Once the holder of the id leaves, the waiting duplicate gets in.
    assert good[1].stop() == 0
    wait_until(lambda: agree([good[0], dup], 2), what="the duplicate to take the freed id")
    r = cohortctl("status", "--broker", b.address, "--cohort", "nosuch")
    assert r.returncode == 1 and "unknown cohort" in r.stderr


def test_dead_broker_gives_clear_cli_error():
    # A port that was just free: nothing listens there now.
    r = cohortctl("status", "--broker", "127.0.0.1:%d" % free_port(), "--timeout", "2s")
    assert r.returncode == 1
    assert "UNAVAILABLE" in r.stderr or "DEADLINE_EXCEEDED" in r.stderr


@pytest.mark.parametrize("argv, needle", [
    (["cohort-operator", "--standalone", "--kubeconfig", "/nonexistent"], "--standalone"),
    (["cohort-operator", "--standalone", "--member-timeout", "1s", "--heartbeat-interval", "2s"],
     "longer than"),
    (["cohort-operator", "--standalone", "--cohort", "bad name"], "--cohort"),
    (["cohort-operator", "--standalone", "--coalesce", "5"], "--coalesce"),
    (["cohort-operator", "--standalone", "--log-format", "xml"], "--log-format"),
    (["cohort-sidecar", "--cohort", "c", "--id", "a"], "--broker is required"),
    (["cohort-sidecar", "--broker", "127.0.0.1:1", "--cohort", "c", "--id", "a b"], "--id"),
    (["cohort-sidecar", "--broker", "127.0.0.1:1", "--cohort", "c", "--id", "a",
      "--data-listen", "0.0.0.0:0"], "--advertise"),
    (["cohort-sidecar", "--broker", "nohostport", "--cohort", "c", "--id", "a"], "--broker"),
    (["cohortctl", "status"], "--broker is required"),
    (["cohortctl", "status", "--broker", "127.0.0.1:1", "-o", "yaml"], "-o must be"),
    (["cohortctl", "frobnicate"], "unknown command"),
    (["cohortctl", "status", "--broker", "127.0.0.1:1", "--log-format", "xml"], "--log-format"),
])
def test_bad_flags_are_usage_errors(argv, needle):
    r = subprocess.run([bin_path(argv[0])] + argv[1:], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert needle in r.stderr


def test_operator_without_kubernetes_config_says_what_to_pass(tmp_path):
    """Outside a pod and with no --kubeconfig there is nothing to talk to:
    a runtime error (1) that names the flag, not a crash or a hang."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT")}
    r = subprocess.run([bin_path("cohort-operator")], capture_output=True, text=True, timeout=30,
                       env=env, cwd=tmp_path)
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert "--kubeconfig" in r.stderr


@pytest.mark.parametrize("name", ["cohort-operator", "cohort-sidecar", "cohortctl"])
def test_help_exits_zero(name):
    r = subprocess.run([bin_path(name), "--help"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and "Usage:" in r.stdout

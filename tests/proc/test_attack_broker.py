"""Attacks on the broker, against the real binaries on loopback (issue 13,
finding 3 and "Broker"): a stranger's requests, sent with the raw client
tests/tools/broker_call.c, and members without the key or the CA.

- An unauthenticated Join (and Leave, Status) against a `cohortctl run`
  that is training: refused, and the cohort trains to the end and agrees.
- A Join that asks for a 49-day member timeout with a dead address: the
  broker grants its cap, evicts the attacker within it, the cohort goes on.
- Status without the key: refused; with the cohort's or the admin key:
  shown.
- A captured Join replayed after its member left: refused.
- A member with a wrong key: one error line, and backoff, not a storm;
  a flood of strangers' requests: the broker's log stays bounded.
- TLS: a sidecar given the CA joins; without it, or with another CA, it
  cannot.
- The datagram port: a stranger's 20,000 datagrams (garbage, and frames
  naming a member with made-up proofs) change nothing and get no answer.
Each fails on the broker before proofs, clamps and TLS flags existed.
"""
import json
import os
import re
import subprocess
import time

import pytest

from cohorttest import (BIN, RUN_TIMEOUT, Procs, bin_path, cohortctl, explain_run, finish, read_text,
                        spawn_group, wait_until)
from cohorttest.programs import (TLS_NAME, broker_call, make_tls, start_broker, start_sidecar,
                                 write_key)

LOGREG = os.path.join(BIN, "examples", "logreg")
DEAD = "127.0.0.1:9"        # nothing listens there: a member that never answers
HUGE_TIMEOUT = 4294967295   # 2^32-1 ms, about 49.7 days: finding 3's Join


@pytest.fixture
def procs():
    ps = Procs()
    yield ps
    ps.close()


def agree(sidecars, n, without=None):
    """The epoch every sidecar adopted last, when they share one of n
    members (none of them `without`); else None."""
    eps = [s.last("Adopted a new epoch.") for s in sidecars]
    if not all(eps) or len({(e["epoch"], e["members"]) for e in eps}) != 1:
        return None
    e = eps[0]
    members = e["members"].split(",") if e["members"] else []
    if e["n_members"] != n or (without and without in members):
        return None
    return e


def refused(outcome, why):
    code, out = outcome
    assert code == 1 and out["code"] == "UNAUTHENTICATED", out
    assert why in out["message"], out
    return out


# ---- an unauthenticated Join while a cohort trains ---------------------------

# At 20 ms a step, training lasts 20 s or more: long enough for the whole
# attack (five calls of a sanitizer build) to land while it runs, even on a
# loaded machine.
STEPS = 1000

def test_an_unauthenticated_join_is_refused_and_the_cohort_keeps_training(tmp_path):
    run_dir = tmp_path / "run"
    p = spawn_group([bin_path("cohortctl"), "run", "-n", "2", "--no-view", "-o", "json",
                     "--timeout", RUN_TIMEOUT, "--run-dir", str(run_dir), "--log-format", "json",
                     "--", LOGREG, "--steps", str(STEPS), "--wait-for", "2", "--delay", "20ms",
                     "--log-every", "5"])
    first = p.stderr.readline()
    m = re.search(r"broker (\S+),", first)
    assert m, first
    broker = m.group(1)
    # The key is the run's own, 0600, in its directory.
    key = run_dir / "cohort.key"
    assert oct(os.stat(key).st_mode & 0o777) == "0o600"

    def version():
        found = re.findall(r"model_version=(\d+)", read_text(run_dir / "0.err"))
        return int(found[-1]) if found else 0
    wait_until(lambda: version() >= 10, "peer-0 to train")

    # A stranger who knows the cohort's name and a member's id, as Status
    # used to tell anyone.
    refused(broker_call("join", broker, "run", "--id", "evil", "--address", DEAD,
                        "--timeout-ms", HUGE_TIMEOUT), "proves no key for cohort \"run\"")
    refused(broker_call("leave", broker, "run", "--id", "peer-0", "--session", "1"),
            "proves no key")
    refused(broker_call("status", broker, "run"), "proves no key")
    refused(broker_call("status", broker, ""), "admin key")
    other = write_key(tmp_path / "other.key")
    refused(broker_call("join", broker, "run", "--id", "evil", "--address", DEAD,
                        "--secret-file", other, "--seq", "1"), "wrong key")
    at_attack = version()

    rc, out, err = finish(p)
    summary = json.loads(out.strip().splitlines()[-1])
    assert rc == 0, explain_run(summary, err)
    assert summary["agree"] and summary["survivors"] == 2, explain_run(summary, err)
    assert re.match(r"^final model_version=%d " % STEPS, summary["final"]), summary["final"]
    assert STEPS > at_attack, "the attack ended after training did"
    # The attacker was in no epoch, and the broker said why it refused.
    for i in range(2):
        log = read_text(run_dir / ("%d.sidecar.log" % i))
        assert "Adopted a new epoch." in log and "evil" not in log
    refusals = [json.loads(l) for l in err.splitlines()
                if l.startswith("{") and "A request was refused." in l]
    assert any(r.get("id") == "evil" and r["code"] == "UNAUTHENTICATED" for r in refusals), err
    assert not os.path.exists(key), "the run's key outlived the run"


# ---- an over-long Join timeout ----------------------------------------------

@pytest.mark.parametrize("keyed", [True, False], ids=["keyed", "insecure"])
def test_an_over_long_join_timeout_is_clamped(procs, tmp_path, keyed):
    """A Join as `evil` with a dead address asking for 2^32-1 ms: once
    froze a cohort for 49.7 days. With keys the attacker is a member gone
    rogue (it has the key); without, anyone."""
    key = write_key(tmp_path / "key") if keyed else None
    b = procs.add(start_broker("--cohort", "demo", "--heartbeat-interval", "200ms",
                               "--member-timeout", "1s", "--max-member-timeout", "3s",
                               secret_file=key))
    sc = [procs.add(start_sidecar(b.address, "demo", "m-%d" % i, secret_file=key))
          for i in range(2)]
    wait_until(lambda: agree(sc, 2), "two sidecars to agree")

    sign = ["--secret-file", key, "--seq", "1"] if keyed else []
    code, out = broker_call("join", b.address, "demo", "--id", "evil", "--address", DEAD,
                            "--timeout-ms", HUGE_TIMEOUT, "--session", "7", *sign)
    t_join = time.monotonic()
    assert code == 0 and out["timeout_ms"] == 3000, out
    wait_until(lambda: agree(sc, 3), "the attacker's epoch")
    # Silent from the start, it is evicted within the cap, and the cohort
    # goes on without it (generous slack for a loaded machine).
    wait_until(lambda: agree(sc, 2, without="evil"), "an epoch without the attacker",
               timeout=3 + 30)
    assert time.monotonic() - t_join >= 2.5, "evicted before its granted timeout"
    # A sidecar that asks for an hour is told what it got, and says so.
    s = procs.add(start_sidecar(b.address, "demo", "m-9", "--member-timeout", "1h",
                                "--heartbeat-interval", "10ms", secret_file=key))
    got = s.wait_log("The broker granted other timings than this member asked for.")
    assert got["asked_timeout_ms"] == 3600000 and got["timeout_ms"] == 3000, got
    assert got["asked_heartbeat_ms"] == 10 and got["heartbeat_ms"] == 100, got   # the floor
    wait_until(lambda: agree(sc + [s], 3), "the sidecar that asked for an hour to join")


# ---- Status ------------------------------------------------------------------

def test_status_without_the_key_is_refused(procs, tmp_path):
    key = write_key(tmp_path / "key")
    admin = write_key(tmp_path / "admin")
    wrong = write_key(tmp_path / "wrong")
    b = procs.add(start_broker("--cohort", "demo", "--cohort", "other",
                               "--admin-secret-file", admin, secret_file=key))
    procs.add(start_sidecar(b.address, "demo", "m-0", secret_file=key))

    r = cohortctl("status", "--timeout", "30s", "--broker", b.address, "--cohort", "demo")
    assert r.returncode == 1 and "UNAUTHENTICATED" in r.stderr, r.stderr
    assert "proves no key for cohort \"demo\"" in r.stderr and "--secret-file" in r.stderr
    r = cohortctl("status", "--timeout", "30s", "--broker", b.address, "--cohort", "demo",
                  "--secret-file", wrong)
    assert r.returncode == 1 and "wrong key" in r.stderr, r.stderr
    r = cohortctl("status", "--timeout", "30s", "--broker", b.address)
    assert r.returncode == 1 and "admin key" in r.stderr, r.stderr
    r = cohortctl("status", "--timeout", "30s", "--broker", b.address, "--secret-file", key)
    assert r.returncode == 1 and "admin key" in r.stderr, r.stderr

    def members(*extra):
        r = cohortctl("status", "--timeout", "30s", "--broker", b.address, "-o", "json", *extra)
        assert r.returncode == 0, r.stderr
        return {c["name"]: [m["id"] for m in c["members"]] for c in json.loads(r.stdout)["cohorts"]}
    assert wait_until(lambda: members("--cohort", "demo", "--secret-file", key)["demo"] == ["m-0"],
                      "m-0 in demo's status")
    assert members("--admin-secret-file", admin) == {"demo": ["m-0"], "other": []}
    assert members("--cohort", "other", "--admin-secret-file", admin) == {"other": []}
    # The key may come from the environment, as in a pod.
    r = subprocess.run([bin_path("cohortctl"), "status", "--timeout", "30s", "--broker", b.address,
                        "--cohort", "demo"],
                       capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, COHORT_SECRET_FILE=key))
    assert r.returncode == 0 and "m-0" in r.stdout, r.stderr


# ---- replay ------------------------------------------------------------------

def test_a_captured_join_cannot_bring_back_a_member_that_left(procs, tmp_path):
    key = write_key(tmp_path / "key")
    b = procs.add(start_broker("--cohort", "demo", secret_file=key))
    # The member's own calls, byte for byte what an eavesdropper would
    # keep: the same seq and time give the same proof.
    now = str(int(time.time() * 1000))
    join = ["--id", "m-0", "--session", "42", "--address", "127.0.0.1:4000",
            "--secret-file", key, "--seq", "1", "--time-ms", now]
    code, out = broker_call("join", b.address, "demo", *join)
    assert code == 0, out
    refused(broker_call("join", b.address, "demo", *join), "already used")
    code, out = broker_call("heartbeat", b.address, "demo", "--id", "m-0", "--session", "42",
                            "--secret-file", key, "--seq", "2")
    assert code == 0, out
    refused(broker_call("heartbeat", b.address, "demo", "--id", "m-0", "--session", "42",
                        "--secret-file", key, "--seq", "2"), "already used")
    code, out = broker_call("leave", b.address, "demo", "--id", "m-0", "--session", "42",
                            "--secret-file", key, "--seq", "3")
    assert code == 0, out
    refused(broker_call("join", b.address, "demo", *join), "left the cohort")
    code, out = broker_call("status", b.address, "demo", "--secret-file", key)
    assert code == 0, out
    r = cohortctl("status", "--timeout", "30s", "--broker", b.address, "--cohort", "demo",
                  "--secret-file", key, "-o", "json")
    assert json.loads(r.stdout)["cohorts"][0]["members"] == []
    # A Join made long ago (or on a far-off clock) is refused too.
    refused(broker_call("join", b.address, "demo", "--id", "m-1", "--secret-file", key,
                        "--time-offset-ms", "-600000"), "behind the broker's clock")



def test_a_member_of_protocol_1_is_refused_at_every_call_it_makes(procs, tmp_path):
    """Protocol 2 serves no protocol 1 member: its Join, its unary Heartbeat
    and its Watch are each FAILED_PRECONDITION with a message that says what
    to do, and the cohort's state is untouched."""
    key = write_key(tmp_path / "key")
    b = procs.add(start_broker("--cohort", "demo", secret_file=key))
    old = ["--id", "old-0", "--session", "9", "--secret-file", key, "--protocol-version", "1"]
    for method in ("join", "heartbeat-v1", "watch"):
        code, out = broker_call(method, b.address, "demo", *old)
        assert code == 1 and out["code"] == "FAILED_PRECONDITION", (method, out)
        assert "protocol version 1 is not supported; this broker speaks 2" in out["message"], out
    # A heartbeat of protocol 2 on the unary method of protocol 1 learns where it went.
    code, out = broker_call("heartbeat-v1", b.address, "demo", "--id", "old-0", "--session", "9",
                            "--secret-file", key, "--seq", "2")
    assert code == 1 and out["code"] == "FAILED_PRECONDITION", out
    assert "ride the Session stream" in out["message"], out
    # The stream of protocol 2 with a protocol 1 heartbeat on it.
    code, out = broker_call("heartbeat", b.address, "demo", *old)
    assert code == 1 and out["code"] == "FAILED_PRECONDITION", out
    code, out = broker_call("status", b.address, "demo", "--secret-file", key)
    assert code == 0 and out["cohorts"] == 1, out
    r = cohortctl("status", "--timeout", "30s", "--broker", b.address, "--cohort", "demo",
                  "--secret-file", key, "-o", "json")
    assert json.loads(r.stdout)["cohorts"][0]["members"] == []

# ---- a member without the right key ----------------------------------------

def test_a_member_with_a_wrong_key_says_so_once_and_backs_off(procs, tmp_path):
    key = write_key(tmp_path / "key")
    wrong = write_key(tmp_path / "wrong")
    b = procs.add(start_broker("--cohort", "demo", secret_file=key))
    s = procs.add(start_sidecar(b.address, "demo", "bad", secret_file=wrong))

    def refusals():
        return [l for l in b.logs("A request was refused.") if l.get("id") == "bad"]
    wait_until(lambda: len(refusals()) >= 3, "three refusals of the member")
    first, third = refusals()[0], refusals()[2]
    gap = (parse_ts(third["ts"]) - parse_ts(first["ts"]))
    # Backoff after a refusal: 0.5-1 s, then 1-2 s; other failures retry
    # from 100 ms.
    assert gap >= 1.4, "three attempts within %.2f s" % gap
    errors = [l for l in s.logs() if l["level"] == "error"]
    assert len(errors) == 1, errors
    assert errors[0]["msg"] == ("The broker refused this member's proof of its cohort's key; "
                                "retrying with backoff.")
    assert "wrong key" in errors[0]["detail"] and errors[0]["code"] == "UNAUTHENTICATED"
    assert not s.logs("Joined the cohort.")


def parse_ts(ts):
    """Seconds of a log line's timestamp (2026-11-21T12:00:00.123Z)."""
    t = time.strptime(ts[:19], "%Y-%m-%dT%H:%M:%S")
    return time.mktime(t) + float("0" + ts[19:-1])


def test_a_flood_of_strangers_does_not_flood_the_log(procs, tmp_path):
    key = write_key(tmp_path / "key")
    b = procs.add(start_broker("--cohort", "demo", secret_file=key))
    t0 = time.monotonic()
    code, out = broker_call("join", b.address, "demo", "--id", "evil", "--repeat", "500")
    elapsed = time.monotonic() - t0
    assert out["code"] == "UNAUTHENTICATED" and out["failed"] == 500, out
    # At most 10 lines a second; the next line that goes out counts the
    # ones held back.
    wait_until(lambda: b.logs("A request was refused."), "a refusal line")
    lines = b.logs("A request was refused.")
    assert len(lines) <= 10 * (elapsed + 2), "%d lines in %.1f s" % (len(lines), elapsed)
    assert len(lines) < 500

    # Once a line may go out again, it counts every refusal held back.
    def status_logged():
        assert broker_call("status", b.address, "demo")[0] == 1
        return [l for l in b.logs("A request was refused.") if l["method"] == "Status"]
    wait_until(status_logged, "a status refusal to be logged", interval=0.2)
    lines = b.logs("A request was refused.")
    joins = sum(1 for l in lines if l["method"] == "Join")
    assert joins + sum(l["held_back"] for l in lines) >= 500, lines


def test_the_standalone_broker_wants_a_key_or_insecure():
    r = subprocess.run([bin_path("cohort-operator"), "--standalone", "--listen", "127.0.0.1:0"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2, r.stderr
    assert "--secret-file" in r.stderr and "--insecure" in r.stderr


# ---- TLS ---------------------------------------------------------------------

def test_a_tls_broker_takes_members_with_the_ca_only(procs, tmp_path):
    tls = make_tls(tmp_path)
    key = write_key(tmp_path / "key")
    b = procs.add(start_broker("--cohort", "demo", "--cohort", "solo", "--tls-cert", tls["cert"],
                               "--tls-key", tls["key"], secret_file=key))
    assert b.last("Broker is listening.")["tls"] is True
    good = [procs.add(start_sidecar(b.address, "demo", "m-%d" % i, "--broker-ca", tls["ca"],
                                    "--broker-server-name", TLS_NAME, secret_file=key))
            for i in range(2)]
    plain = procs.add(start_sidecar(b.address, "demo", "plain", secret_file=key))
    other = procs.add(start_sidecar(b.address, "demo", "other", "--broker-ca", tls["other_ca"],
                                    "--broker-server-name", TLS_NAME, secret_file=key))
    wait_until(lambda: agree(good, 2), "the sidecars with the CA to agree")
    for s in (plain, other):
        s.wait_log("Could not join the cohort; retrying.")
        assert not s.logs("Joined the cohort."), s.name
        assert s.last("Could not join the cohort; retrying.")["code"] == "UNAVAILABLE"
        # Their handshakes cost the broker; the rest needs no more of them.
        assert s.stop() == 0
    # cohortctl speaks TLS too.
    r = cohortctl("status", "--timeout", "30s", "--broker", b.address, "--cohort", "demo",
                  "--secret-file", key, "--broker-ca", tls["ca"], "--broker-server-name", TLS_NAME,
                  "-o", "json")
    assert r.returncode == 0, r.stderr
    assert [m["id"] for m in json.loads(r.stdout)["cohorts"][0]["members"]] == ["m-0", "m-1"]
    r = cohortctl("status", "--broker", b.address, "--cohort", "demo", "--secret-file", key,
                  "--timeout", "3s")
    assert r.returncode == 1 and "UNAVAILABLE" in r.stderr, r.stderr
    # A name the certificate does not carry is refused as well. Without the
    # leak check: gRPC frees a failed handshake's OpenSSL objects (the
    # peer's certificate chains) in closures of its own threads, which a
    # process that exits right after the failure can outrun; once in a
    # loaded clean-clone run LeakSanitizer saw them at the tool's exit,
    # with only libcrypto's frames, and its report swallowed the output.
    code, out = broker_call("status", b.address, "demo", "--secret-file", key,
                            "--broker-ca", tls["ca"],
                            env=dict(os.environ, ASAN_OPTIONS=os.environ.get("ASAN_OPTIONS", "") +
                                     ":detect_leaks=0"))
    assert code == 1 and out["code"] == "UNAVAILABLE", out
    # A trainer that joins the broker itself (the in-process link) takes
    # the key and the CA from its environment, and trains.
    env = dict(os.environ, COHORT_BROKER=b.address, COHORT_COHORT="solo", COHORT_ID="t-0",
               COHORT_SECRET_FILE=key, COHORT_BROKER_CA=tls["ca"],
               COHORT_BROKER_SERVER_NAME=TLS_NAME)
    env.pop("COHORT_SOCKET", None)
    rc, out, err = finish(spawn_group([LOGREG, "--steps", "20", "--linger", "0s"], env=env))
    assert rc == 0 and "final model_version=20" in out, err[-3000:]


# ---- the datagram port ---------------------------------------------------------

def test_a_strangers_datagrams_change_nothing(procs, tmp_path):
    """The broker's UDP port (datagram heartbeats) takes anything a
    stranger sends it: garbage, frames with the right magic and random
    bytes, frames that name the cohort's members with a made-up proof. The
    members' own datagrams keep them in: no epoch changes, nobody says its
    datagrams go unanswered, and the broker answers nothing it was sent."""
    import random
    import socket
    key = write_key(tmp_path / "key")
    b = procs.add(start_broker("--cohort", "demo", secret_file=key))
    assert b.last("Broker is listening.")["datagrams"] is True
    sidecars = [procs.add(start_sidecar(b.address, "demo", "m-%d" % i, secret_file=key))
                for i in range(2)]
    e = wait_until(lambda: agree(sidecars, 2), "both members in one epoch")

    host, port = b.address.rsplit(":", 1)
    rng = random.Random(16)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.connect((host, int(port)))
    s.setblocking(False)
    sent = 0
    for i in range(20000):
        kind = i % 4
        if kind == 0:
            body = bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 1500)))
        elif kind == 1:
            body = b"cHB2" + bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 200)))
        else:
            # A HeartbeatDatagram (proto/cohort.proto) of m-0 with a proof
            # of the right shape and a made-up MAC: protocol_version 2,
            # cohort, id, session, then proof {seq, time_ms, mac}.
            mac = bytes(rng.getrandbits(8) for _ in range(32))
            proof = b"\x08" + bytes([1 + i % 100]) + b"\x10\x01\x1a\x20" + mac
            body = (b"cHB2\x08\x02\x12\x04demo\x1a\x03m-0\x20\x07" +
                    b"\x4a" + bytes([len(proof)]) + proof)
        try:
            s.send(body)
            sent += 1
        except BlockingIOError:
            time.sleep(0.001)
        except OSError:
            pass            # an ICMP error of a datagram before: sending goes on
    assert sent > 10000
    # Nothing answered: the broker sends only to proved, fresh datagrams.
    try:
        got = s.recv(2048)
    except (BlockingIOError, ConnectionRefusedError):
        got = None
    assert got is None, got
    s.close()
    # Two member timeouts later the members are still in the same epoch.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        now = agree(sidecars, 2)
        assert now and now["epoch"] == e["epoch"], (e, now)
        time.sleep(0.2)
    for sc in sidecars:
        assert not sc.logs("The broker's datagram port does not answer; heartbeats go up the "
                           "session stream."), sc.logs()
    assert broker_call("status", b.address, "demo", "--secret-file", key)[0] == 0

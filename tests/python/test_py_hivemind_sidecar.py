"""cohort.hivemind through the pod's sidecar, as in a Kubernetes cohort
where the trainer holds no key: real cohort-sidecar processes with the
key, a real broker that demands it, real torch in every peer.

- Peers through sidecars (DHT(initial_peers=["unix:PATH"]), and DHT()
  with $COHORT_SOCKET and no key) average with in-process peers: the
  weighted average is exact, every peer gathers every groupmate's
  object, and a sidecar's averager is the member the sidecar named.
- load_state_from_peers through a sidecar, from a donor through another
  sidecar whose get_current_state runs in its trainer's process, over a
  donor of lower priority in process.
- The sidecar killed mid-step: the trainer's step fails at once with a
  sentence saying so, well within its timeout.
- The trainer killed mid-step: its step is aborted and its averager
  leaves the cohort well within the step's timeout.
- Sidecars under --integrity mac: their averagers average exactly with
  each other; beside an in-process averager without integrity the
  round never happens, and the refused one says why.
- In-process averagers under COHORT_INTEGRITY=mac average exactly with
  one hosted by a sidecar under --integrity mac; beside an in-process
  averager without integrity the round never happens. A value other
  than none or mac, or mac without the key, is a ValueError that says
  so, and the DHT is free for another averager.
- A create the sidecar refuses: a ValueError with the sidecar's
  sentence, and the DHT free for another averager.
- An adaptive codec (SizeAdaptiveCompression) through a sidecar: its
  codec per tensor reaches the sidecar's averager, which groups with an
  in-process one; the small tensor exact, the large one in float16.
- A broker serving TLS: averagers through sidecars that reach it with
  its CA, and one in process given it by $COHORT_BROKER_CA, average
  exactly.
"""
import json
import os
import signal
import time

import pytest
import torch

from cohorttest import finish, make_tmp, remove_tmp, start_broker, start_sidecar, wait_until
from cohorttest.programs import TLS_NAME, make_tls, write_key
from hivemind_child import adaptive_tensors_of, state_tensors_of, tensors_of
from pyproc import HERE, spawn

CHILD = os.path.join(HERE, "hivemind_sidecar_child.py")


@pytest.fixture
def pod():
    """A keyed broker and a way to start sidecars holding its key, each
    serving a trainer socket."""
    tmp = make_tmp()
    key = os.path.join(tmp, "key")
    write_key(key)
    # At debug the broker logs each averager's request for a group.
    broker = start_broker("--allow-any-cohort", "--heartbeat-interval", "250ms",
                          "--member-timeout", "2s", "--log-level", "debug", secret_file=key)
    sidecars = []

    def sidecar(name, *extra):
        path = os.path.join(tmp, name + ".sock")
        s = start_sidecar(broker.address, "hm", name, "--socket", path,
                          "--heartbeat-interval", "250ms", "--member-timeout", "2s", *extra,
                          secret_file=key)
        s.wait_log("Waiting for the trainer.")
        s.path = path
        sidecars.append(s)
        return s

    try:
        yield broker, key, sidecar
    finally:
        for s in sidecars:
            if s.alive():
                s.stop()
        broker.stop()
        for s in sidecars:
            assert not s.sanitizer_report()
        remove_tmp(tmp)


def keyless(route, peer, *args, **env):
    """A trainer without the key, as in a cohort's trainer container."""
    return spawn([CHILD, route, peer, *map(str, args)], COHORT_SECRET_FILE="", **env)


def lines_of(kid):
    rc, out, err = finish(kid)
    assert rc == 0, err[-4000:]
    return [json.loads(l) for l in out.splitlines() if l.startswith("{")]


def test_sidecar_peers_and_in_process_peers_average_exactly_and_gather(pod):
    broker, key, sidecar = pod
    s0, s1 = sidecar("pod-a"), sidecar("pod-b")
    weights = [1, 2, 3, 4]
    kids = [keyless("unix:" + s0.path, "t-0", "weighted", 0, 4, weights[0]),
            keyless("env", "t-1", "weighted", 1, 4, weights[1], COHORT_SOCKET=s1.path),
            spawn([CHILD, broker.address, "p-2", "weighted", "2", "4", str(weights[2])],
                  COHORT_SECRET_FILE=key),
            spawn([CHILD, broker.address, "p-3", "weighted", "3", "4", str(weights[3])],
                  COHORT_SECRET_FILE=key)]
    got = [lines_of(k)[-1] for k in kids]
    # The sidecars named their averagers; the trainers' own ids are unused.
    assert got[0]["me"].startswith("pod-a_av") and got[1]["me"].startswith("pod-b_av"), got
    assert [g["me"] for g in got[2:]] == ["p-2", "p-3"]
    ids = [g["me"] for g in got]
    total = sum(weights)
    ref = [sum(weights[k] * tensors_of(k)[i] for k in range(4)) / total for i in range(2)]
    for g in got:
        assert g["tensors"] == [r.tolist() for r in ref], g
        assert g["gathered"] == {ids[j]: {"k": j} for j in range(4)}
        assert g["last"] == {ids[j]: float(weights[j]) for j in range(4)}
    # The bits the step left come back through the link as in process.
    assert len({len(g["bits"]) for g in got}) == 1, [g["bits"] for g in got]
    for s in (s0, s1):
        assert s.wait_log("The trainer's averager link closed; the averager leaves.")


def test_load_state_through_a_sidecar_from_a_donor_through_another(pod):
    broker, key, sidecar = pod
    s0, s1 = sidecar("pod-d"), sidecar("pod-l")
    top = keyless("unix:" + s0.path, "d-top", "donor", 3, 5)
    low = spawn([CHILD, broker.address, "d-low", "donor", "1", "1"], COHORT_SECRET_FILE=key)
    try:
        for d in (top, low):
            line = d.stdout.readline()
            assert json.loads(line)["ready"], line
        loader = keyless("env", "l-0", "loader", COHORT_SOCKET=s1.path)
        got = lines_of(loader)[-1]
    finally:
        for d in (top, low):
            os.killpg(d.pid, signal.SIGKILL)
            finish(d)
    want = state_tensors_of(3)
    assert got["shapes"] == [list(t.shape) for t in want]
    assert got["sums"] == [float(t.double().sum()) for t in want], "the top donor's state"
    assert got["me"].startswith("pod-l_av")


def test_the_sidecar_killed_mid_step_fails_the_step_at_once(pod):
    broker, key, sidecar = pod
    s = sidecar("pod-k")
    kid = keyless("unix:" + s.path, "k-0", "weighted", 0, 2, 1)   # nobody to pair with
    line = kid.stdout.readline()
    assert json.loads(line)["stepping"].startswith("pod-k_av"), line
    began = time.monotonic()
    s.kill()
    got = lines_of(kid)[-1]
    took = time.monotonic() - began
    assert "The sidecar went away" in got["error"], got
    assert took < 30, "the step's timeout is 60 s; it took %.1f s" % took


def test_the_trainer_killed_mid_step_has_its_averager_leave(pod):
    broker, key, sidecar = pod
    s = sidecar("pod-t")
    kid = keyless("unix:" + s.path, "t-0", "weighted", 0, 2, 1)
    line = kid.stdout.readline()
    me = json.loads(line)["stepping"]
    # The step is in flight: the sidecar's averager waits for a group.
    assert broker.wait_log("An averager asks for a group.", pred=lambda l: l.get("id") == me)
    began = time.monotonic()
    os.killpg(kid.pid, signal.SIGKILL)
    finish(kid)
    assert s.wait_log("The trainer's averager link closed mid-call; the call is aborted.",
                      timeout=120)
    assert s.wait_log("The trainer's averager link closed; the averager leaves.", timeout=120)
    took = time.monotonic() - began
    # Without the abort it would wait for a group to its timeout (60 s).
    assert took < 30, "the step's timeout is 60 s; its averager left after %.1f s" % took
    assert broker.wait_log("Member left.", pred=lambda l: l.get("id") == me)
    assert s.alive()


def test_integrity_mac_reaches_the_sidecars_averagers(pod):
    broker, key, sidecar = pod
    s0, s1 = sidecar("pod-m0", "--integrity", "mac"), sidecar("pod-m1", "--integrity", "mac")
    kids = [keyless("unix:" + s0.path, "m-0", "weighted", 0, 2, 1),
            keyless("unix:" + s1.path, "m-1", "weighted", 1, 2, 3)]
    got = [lines_of(k)[-1] for k in kids]
    ref = [(tensors_of(0)[i] + 3 * tensors_of(1)[i]) / 4 for i in range(2)]
    for g in got:
        assert g["tensors"] == [r.tolist() for r in ref], g

    # Beside an in-process averager without integrity: no round, and the
    # one the broker refused (whichever asked second) names the setting.
    kids = [keyless("unix:" + s0.path, "m-2", "weighted", 0, 2, 1, 15),
            spawn([CHILD, broker.address, "p-2", "weighted", "1", "2", "1", "15"],
                  COHORT_SECRET_FILE=key)]
    got = [lines_of(k)[-1] for k in kids]
    assert all("error" in g for g in got), got
    said = [g["error"] for g in got if "--integrity" in g["error"]]
    assert said and ("--integrity mac" in said[0] or "--integrity none" in said[0]), got


def test_in_process_averagers_under_cohort_integrity_mac_average_with_a_sidecars(pod):
    broker, key, sidecar = pod
    s = sidecar("pod-i0", "--integrity", "mac")
    weights = [1, 2, 1]
    kids = [keyless("unix:" + s.path, "i-0", "weighted", 0, 3, weights[0]),
            spawn([CHILD, broker.address, "p-i1", "weighted", "1", "3", str(weights[1])],
                  COHORT_SECRET_FILE=key, COHORT_INTEGRITY="mac"),
            spawn([CHILD, broker.address, "p-i2", "weighted", "2", "3", str(weights[2])],
                  COHORT_SECRET_FILE=key, COHORT_INTEGRITY="mac")]
    got = [lines_of(k)[-1] for k in kids]
    ref = [sum(weights[k] * tensors_of(k)[i] for k in range(3)) / sum(weights) for i in range(2)]
    assert got[0]["me"].startswith("pod-i0_av"), got
    ids = [g["me"] for g in got]
    for g in got:
        assert g["tensors"] == [r.tolist() for r in ref], g
        assert g["gathered"] == {ids[j]: {"k": j} for j in range(3)}, g

    # An in-process averager under mac beside one without (COHORT_INTEGRITY
    # unset): no round, and the one the broker refused names the setting.
    kids = [spawn([CHILD, broker.address, "p-i3", "weighted", "0", "2", "1", "15"],
                  COHORT_SECRET_FILE=key, COHORT_INTEGRITY="mac"),
            spawn([CHILD, broker.address, "p-i4", "weighted", "1", "2", "1", "15"],
                  COHORT_SECRET_FILE=key)]
    got = [lines_of(k)[-1] for k in kids]
    assert all("error" in g for g in got), got
    said = [g["error"] for g in got if "--integrity" in g["error"]]
    assert said and ("--integrity mac" in said[0] or "--integrity none" in said[0]), got


@pytest.mark.parametrize("integrity,keyed,words", [
    ("hmac", True, 'COHORT_INTEGRITY="hmac" is not a frame integrity setting: none or mac'),
    ("mac", False, "COHORT_INTEGRITY=mac authenticates every frame with the cohort's key, and "
                   "there is none: set COHORT_SECRET_FILE"),
])
def test_a_bad_cohort_integrity_or_mac_without_a_key_is_a_value_error(pod, integrity, keyed,
                                                                       words):
    broker, key, sidecar = pod
    got = lines_of(spawn([CHILD, broker.address, "c-0", "create"],
                         COHORT_SECRET_FILE=key if keyed else "", COHORT_INTEGRITY=integrity))[-1]
    assert got.get("type") == "ValueError" and words in got["error"], got
    assert got["free"], "the DHT still holds the averager that never started"
    # "none" is the default's word.
    got = lines_of(spawn([CHILD, broker.address, "c-1", "create"], COHORT_SECRET_FILE=key,
                         COHORT_INTEGRITY="none"))[-1]
    assert got == {"me": "c-1"}, got


def test_an_adaptive_codec_through_a_sidecar_averages_per_tensor(pod):
    """SizeAdaptiveCompression through a sidecar and in process: the plan
    reaches the sidecar's averager whole (the two group), the small tensor
    is averaged exactly, the large one within float16's bound, and both
    end with the same bytes."""
    broker, key, sidecar = pod
    s = sidecar("pod-p")
    weights = [1, 3]
    kids = [keyless("unix:" + s.path, "ad-0", "adaptive", 0, weights[0]),
            spawn([CHILD, broker.address, "ad-1", "adaptive", "1", str(weights[1])],
                  COHORT_SECRET_FILE=key)]
    got = [lines_of(k)[-1] for k in kids]
    assert all(g["ok"] for g in got), got
    assert got[0]["me"].startswith("pod-p_av"), got[0]["me"]
    assert got[0]["raw"] == got[1]["raw"], "the peers ended with different bytes"
    ins = [adaptive_tensors_of(k) for k in range(2)]
    small = sum(w * t[0].double() for w, t in zip(weights, ins)) / sum(weights)
    assert got[0]["tensors"][0] == small.float().tolist()
    large = sum(w * t[1].double() for w, t in zip(weights, ins)) / sum(weights)
    maxabs = max(float(t[1].abs().max()) for t in ins)
    err = float((torch.tensor(got[0]["tensors"][1], dtype=torch.float64) - large).abs().max())
    assert 0 < err <= 3 * 2.0 ** -11 * maxabs, (err, maxabs)


def test_a_refused_create_raises_with_the_sidecars_sentence(pod):
    broker, key, sidecar = pod
    s = sidecar("pod-r")
    got = lines_of(keyless("unix:" + s.path, "r-0", "refused"))[-1]
    assert got["type"] == "ValueError", got
    assert "The averager's configuration is invalid" in got["error"], got
    assert got["free"], "the DHT still holds the averager that never started"
    # In process the same refusal is a ValueError too.
    got = lines_of(spawn([CHILD, broker.address, "r-1", "refused"], COHORT_SECRET_FILE=key))[-1]
    assert got["type"] == "ValueError" and "cannot start the averager" in got["error"], got
    assert s.alive()


def test_averagers_through_sidecars_join_a_tls_broker_with_its_ca():
    tmp = make_tmp()
    procs = []
    try:
        tls = make_tls(tmp)
        key = os.path.join(tmp, "key")
        write_key(key)
        broker = start_broker("--allow-any-cohort", "--tls-cert", tls["cert"],
                              "--tls-key", tls["key"], secret_file=key)
        procs.append(broker)
        assert broker.last("Broker is listening.")["tls"] is True
        paths = []
        for name in ("pod-s0", "pod-s1"):
            path = os.path.join(tmp, name + ".sock")
            s = start_sidecar(broker.address, "hm", name, "--socket", path,
                              "--broker-ca", tls["ca"], "--broker-server-name", TLS_NAME,
                              secret_file=key)
            procs.append(s)
            s.wait_log("Waiting for the trainer.")
            paths.append(path)
        # Two through the sidecars, and one in process that reaches the
        # broker with its CA from $COHORT_BROKER_CA, as the Accumulator
        # and the group do.
        kids = [keyless("unix:" + paths[0], "s-0", "weighted", 0, 3, 2),
                keyless("env", "s-1", "weighted", 1, 3, 1, COHORT_SOCKET=paths[1]),
                spawn([CHILD, broker.address, "p-s2", "weighted", "2", "3", "1"],
                      COHORT_SECRET_FILE=key, COHORT_BROKER_CA=tls["ca"],
                      COHORT_BROKER_SERVER_NAME=TLS_NAME)]
        got = [lines_of(k)[-1] for k in kids]
        ref = [(2 * tensors_of(0)[i] + tensors_of(1)[i] + tensors_of(2)[i]) / 4
               for i in range(2)]
        for g, name in zip(got, ("pod-s0_av", "pod-s1_av", "p-s2")):
            assert g["me"].startswith(name), g
            assert g["tensors"] == [r.tolist() for r in ref], g
        for s in procs[1:]:
            s.wait_log("The trainer's averager link closed; the averager leaves.")
    finally:
        for p in reversed(procs):
            if p.alive():
                p.stop()
        for p in procs:
            assert not p.sanitizer_report()
        remove_tmp(tmp)

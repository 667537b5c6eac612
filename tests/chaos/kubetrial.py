"""Chaos trials with the operator among the processes killed: the
Kubernetes stand-in (tests/kube: the API server stand-in and the process
kubelet), cohort-operator in Kubernetes mode reconciling a TrainingCohort
and hosting the broker, and the cohort's pods (the injected sidecar and
the chaos trainer, tests/chaos/chaos_trainer.c). Trial after trial:

- operator: SIGKILL to the operator (no release of its Lease, no goodbye
  to the broker's members); another starts in its place on the same
  broker port, as the Deployment the chart makes would start it, takes
  the Lease once the old one has lapsed and adopts the existing pods.
- trainer: SIGKILL to one pod's trainer; the pod fails (the operator's
  pods are restartPolicy Never) and the operator replaces it.
- pod: one trainer pod deleted through the API (its grace period, SIGTERM
  to its processes); the operator makes it again.

Kills do not wait for the cohort to settle: the operator may die while it
replaces a pod. Each trial keeps check.py's exact accounting over every
trainer's log, and asserts on the stand-in: never more live pods than
replicas nor a name outside NAME-0..NAME-(N-1) (polled through the
trial); across an operator restart, every pod that was settled (live, its
trainer running, no kill of ours pending on it) is the same pod after it
(same uid) and the operator creates only the missing ones; over the
trial, the operator creates exactly N pods plus one per pod it had to
replace; after each restart the TrainingCohort's status comes back with
all N members ready, the model version no lower and a newer broker
epoch; every trainer not killed reaches the last version and stops with
its final line on SIGTERM; no sanitizer report from the operators,
sidecars or trainers, and the last operator exits 0 on SIGTERM.

Run through chaos.py: `chaos.py --kinds operator,trainer,pod`.
"""
import json
import os
import random
import signal
import stat
import time

from cohorttest import (CRD_FILE, DEADLINE, ApiServer, Kubectl, Kubelet, Operator,
                        cohort_manifest, free_port, make_tmp, pod_path_dir)
from check import check, load_logs
from trials import Progress, TrialFailed, plan_kills, run_reported, sanitizer_lines

KUBE_KINDS = ("operator", "trainer", "pod")
NAME = "chaos"
# The trainers' pause before each contribution. An operator's restart takes
# about 7 s (its 3 s Lease lapsing, the broker's startup hold) while the
# trainers train on; at the 30 ms of the trials without it they would
# finish during the first restart, and the later kills would land on a
# cohort that is done.
DELAY_MS = 400
PODS = "/api/v1/namespaces/default/pods"
TC_PATH = "/apis/cohort.dev/v1alpha1/namespaces/default/trainingcohorts/" + NAME

# The pod's trainer command: claims the first free slot (mkdir is atomic,
# so two pods starting together never share one), records its pid and pod,
# and becomes the chaos trainer with that slot's log.
WRAPPER = """#!/bin/sh
dir=$1
shift
s=0
while ! mkdir "$dir/slot.$s" 2>/dev/null; do
    s=$((s + 1))
    if [ "$s" -ge 64 ]; then echo "no free slot in $dir" >&2; exit 3; fi
done
echo "$$ $COHORT_ID" > "$dir/slot.$s/who"
exec %s --slot "$s" --log "$dir/t$s.jsonl" "$@" 2>"$dir/t$s.err"
"""


def alive(pid):
    """False for a process that is gone or a zombie the kubelet has not
    reaped yet."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


class KubeTrial(Progress):
    def __init__(self, seed, kinds, kills, tmp, trainer):
        self.seed = seed
        self.rng = random.Random(seed)
        self.tmp = tmp
        self.trainer = trainer
        self.n = self.rng.choice([3, 4])
        self.steps = self.rng.randint(50, 70)
        self.vb = self.rng.choice([1, self.n - 1, self.n, 2 * self.n])
        self.plan = plan_kills(self.rng, kinds, kills, self.steps, self.n)
        self.logs = self.log_dir = os.path.join(tmp, "trainers")
        os.makedirs(self.logs)
        self.server = self.kubelet = None
        self.operators = []        # every incarnation, the current one last
        self.killed = set()        # slots killed or in a pod that was deleted
        self.killed_uids = set()   # pods whose trainer was killed, or deleted
        self.replaced = 0          # pods the operator has to make again
        self.done_kinds = []
        self.restarts = []         # per operator kill: seconds to the status's recovery
        self.while_down = []       # per operator kill: versions committed until the next led
        self.down_from = []        # per operator kill: the model version it came at
        self.next_pod_check = 0
        self.deadline = time.monotonic() + 2 * DEADLINE + 45 * kills

    # ---- the stand-in and the operator ---------------------------------------

    def start(self):
        bindir = pod_path_dir(self.tmp)
        wrapper = os.path.join(bindir, "cohort-chaos-trainer")
        with open(wrapper, "w") as f:
            f.write(WRAPPER % self.trainer)
        os.chmod(wrapper, stat.S_IRWXU | stat.S_IRGRP | stat.S_IXGRP)
        self.server = ApiServer(self.tmp, "--bookmark-interval", "0.5")
        self.kubelet = Kubelet(self.server, self.tmp)
        kubectl = Kubectl(self.server, self.tmp)
        if not kubectl.available():
            raise TrialFailed("kubectl is not in build/tools: %s" % kubectl.why_missing)
        kubectl("apply", "-f", CRD_FILE)
        kubectl("wait", "--for", "condition=Established", "crd/trainingcohorts.cohort.dev")
        self.broker_port = free_port()
        self.start_operator()
        m = cohort_manifest(NAME, self.n, max_restarts=1000)
        m["spec"]["timeouts"] = {"heartbeatInterval": "200ms", "memberTimeout": "1500ms"}
        m["spec"]["template"]["spec"]["containers"][0].update(
            command=["cohort-chaos-trainer"],
            args=[self.logs, "--steps", str(self.steps), "--vb", str(self.vb),
                  "--delay-ms", str(DELAY_MS),
                  "--stall-s", str(int(2 * DEADLINE)), "--wait-for", str(self.n)])
        kubectl("apply", "-f", "-", stdin=json.dumps(m))

    def start_operator(self):
        op = Operator(self.server, self.tmp, "op-%d" % (len(self.operators) + 1), self.broker_port)
        self.operators.append(op)
        self.wait(lambda: op.metrics().get("is_leader") == 1,
                  "operator %s to take the Lease" % op.name)

    # ---- what the stand-in shows ----------------------------------------------

    def status(self):
        return (self.server.get(TC_PATH) or {}).get("status") or {}

    def live_pods(self):
        doc = self.server.get(PODS + "?labelSelector=cohort.dev%2Fcohort%3D" + NAME) or {}
        return [p for p in doc.get("items") or [] if not p["metadata"].get("deletionTimestamp")]

    def uids(self):
        return {p["metadata"]["name"]: p["metadata"]["uid"] for p in self.live_pods()}

    def pod_posts(self):
        """Every pod create the operators sent, refused ones included."""
        return [r for r in self.server.requests() if r["method"] == "POST" and
                r["path"] == PODS and (r["userAgent"] or "").startswith("cohort-operator")]

    def pod_creates(self):
        """The pods the operators created. A create the API server refused
        (409: the name is still held by a pod that is terminating) made
        no pod; an operator killed at any moment may have sent one."""
        return [r for r in self.pod_posts() if 200 <= r["code"] < 300]

    def check_pods(self):
        """Never more live pods than replicas, none named outside the
        ordinals: a duplicate pod fails the trial when it is seen."""
        pods = self.live_pods()
        names = sorted(p["metadata"]["name"] for p in pods)
        allowed = {"%s-%d" % (NAME, i) for i in range(self.n)}
        if len(pods) > self.n or not set(names) <= allowed:
            raise TrialFailed("duplicate pods: %s live for %d replicas" % (names, self.n))

    def slots(self):
        """{slot: (pid, pod)} of every trainer process started so far."""
        out = {}
        for d in os.listdir(self.logs):
            if d.startswith("slot."):
                try:
                    with open(os.path.join(self.logs, d, "who")) as f:
                        pid, pod = f.read().split()
                except (OSError, ValueError):
                    continue            # claimed, not written yet
                out[int(d[5:])] = (int(pid), pod)
        return out

    def current(self, pod):
        """The slot of the pod's live trainer, or None (one we killed, or
        one in a deleted pod during its grace period, is not it)."""
        live = [s for s, (pid, p) in self.slots().items()
                if p == pod and s not in self.killed and alive(pid)]
        return max(live) if live else None

    def trainer_slots(self):
        return self.slots()

    def on_wait(self):
        if time.monotonic() > self.next_pod_check and self.server:
            self.check_pods()
            self.next_pod_check = time.monotonic() + 0.5

    def steady(self):
        """All N pods live, each with a live trainer, and the status says so."""
        pods = self.live_pods()
        st = self.status()
        return (len(pods) == self.n and
                all(self.current(p["metadata"]["name"]) is not None for p in pods) and
                st.get("readyReplicas") == self.n)

    # ---- kills ------------------------------------------------------------------

    def fire(self, k):
        self.wait(lambda: self.max_version() >= k["after_v"], "model version %d" % k["after_v"])
        time.sleep(k["delay_ms"] / 1000)
        pod = "%s-%d" % (NAME, k["victim"])
        if k["kind"] == "operator":
            # At any moment, a pod replacement in flight included: the pods
            # that were settled (live, their trainer running, nothing of
            # ours pending on them) must be the same pods afterwards, and
            # the restarted operator may create only the ones missing.
            st, creates = self.status(), len(self.pod_posts())
            settled = {n: u for n, u in self.uids().items()
                       if u not in self.killed_uids and self.current(n) is not None and
                       self.current(n) not in self.killed}
            op = self.operators[-1]
            v0 = self.max_version()
            self.down_from.append(v0)
            op.kill()
            op.log.close()
            start = time.monotonic()
            self.start_operator()
            # Versions the trainers committed without a broker, until the
            # next operator led: the data plane runs on in its epoch.
            self.while_down.append(self.max_version() - v0)
            self.wait(lambda: self.status().get("epoch", 0) > st.get("epoch", 0) and
                      self.status().get("readyReplicas") == self.n and
                      len([m for m in self.status().get("members") or []
                           if "modelVersion" in m]) == self.n and
                      self.status().get("modelVersion", 0) >= st.get("modelVersion", 0),
                      "the TrainingCohort's status to recover after the operator's restart "
                      "(epoch past %s, %d members ready)" % (st.get("epoch"), self.n))
            self.restarts.append(round(time.monotonic() - start, 1))
            now = self.uids()
            gone = {n: u for n, u in settled.items() if now.get(n) != u}
            if gone:
                raise TrialFailed("the restarted operator replaced settled pods %s (now %s)" %
                                  (gone, now))
            posts = self.pod_posts()[creates:]
            made = len([r for r in posts if 200 <= r["code"] < 300])
            if made > self.n - len(settled):
                raise TrialFailed("%d pods were created across the operator's restart, with %d "
                                  "of %d settled (settled %s; the creates: %s)" %
                                  (made, len(settled), self.n, sorted(settled),
                                   [(r["code"], r["userAgent"]) for r in posts]))
        else:
            # A pod whose trainer we killed or that we deleted is not
            # chosen again until its replacement runs a trainer.
            def chosen():
                uid, slot = self.uids().get(pod), self.current(pod)
                return (uid is not None and uid not in self.killed_uids and slot is not None and
                        slot not in self.killed)
            self.wait(chosen, "pod %s's trainer to run" % pod)
            slot = self.current(pod)
            self.killed_uids.add(self.uids()[pod])
            self.killed.add(slot)
            self.replaced += 1
            if k["kind"] == "trainer":
                os.kill(self.slots()[slot][0], signal.SIGKILL)
            else:
                code, doc, _ = self.server.call("DELETE", "%s/%s" % (PODS, pod))
                if code != 200:
                    raise TrialFailed("deleting pod %s: %d %s" % (pod, code, doc))
        k["at_v"] = self.max_version()
        self.done_kinds.append(k["kind"])

    # ---- the trial ------------------------------------------------------------

    def run(self):
        self.start()
        for k in self.plan:
            self.fire(k)

        def finished():
            pods = self.live_pods()
            cur = [self.current(p["metadata"]["name"]) for p in pods]
            return (len(pods) == self.n and None not in cur and
                    all(any(e["ev"] == "done" for e in self.events(s)) for s in cur))
        self.wait(finished, "every trainer to reach version %d" % self.steps)
        survivors = {self.current(p["metadata"]["name"]) for p in self.live_pods()}
        bad = []
        for slot in sorted(self.slots()):
            if slot not in survivors and slot not in self.killed:
                bad.append("trainer slot %d ended though nothing killed it" % slot)
        creates = len(self.pod_creates())
        if creates != self.n + self.replaced:
            bad.append("the operator created %d pods: %d replicas and %d replaced" %
                       (creates, self.n, self.replaced))
        for slot in survivors:
            os.kill(self.slots()[slot][0], signal.SIGTERM)
        self.wait(lambda: all(any(e["ev"] == "final" for e in self.events(s)) and
                              not alive(self.slots()[s][0]) for s in survivors),
                  "the trainers to stop on SIGTERM")
        bad += self.sanitizer_reports()
        if bad:
            raise TrialFailed("; ".join(bad[:20]))
        figures = check(load_logs(self.logs), survivors, self.steps)
        figures.update(operator_restart_s=self.restarts, operator_killed_at_v=self.down_from,
                       versions_while_down=self.while_down, pods_created=creates)
        return figures

    def sanitizer_reports(self):
        bad = []
        for op in self.operators:
            bad += ["%s: %s" % (op.name, l) for l in sanitizer_lines(op.text())]
        for slot in self.slots():
            with open(os.path.join(self.logs, "t%d.err" % slot)) as f:
                bad += ["trainer slot %d: %s" % (slot, l) for l in sanitizer_lines(f.read())]
        logs = os.path.join(self.tmp, "logs")
        for root, _, files in os.walk(logs):
            for name in files:
                if "cohort-sidecar" in root:
                    with open(os.path.join(root, name), errors="replace") as f:
                        bad += ["%s: %s" % (os.path.relpath(root, logs), l)
                                for l in sanitizer_lines(f.read())]
        return bad

    def finish(self):
        """After a trial that ran to its end: the last operator must exit 0
        on SIGTERM."""
        rc = self.stop_everything()
        if rc != 0:
            raise TrialFailed("the operator exited %d on SIGTERM (seed %d; logs in %s)" %
                              (rc, self.seed, self.tmp))

    def stop_everything(self):
        """Ends the cohort, the kubelet (and so every pod's processes), the
        operator and the API server; the operator must exit 0."""
        rc = 0
        if self.server and self.operators and self.operators[-1].p.poll() is None:
            self.server.call("DELETE", TC_PATH)
        if self.kubelet:
            self.kubelet.stop()
        for op in self.operators:
            if op.p.poll() is None:
                rc = rc or op.stop()
        if self.server:
            self.server.stop()
        return rc


def describe(t):
    return "seed %d: operator mode, %d members, %d steps, vb %d, kills %s" % (
        t.seed, t.n, t.steps, t.vb,
        ", ".join("%s of %s-%d after v%d" % (k["kind"], NAME, k["victim"], k["after_v"])
                  if k["kind"] != "operator" else "operator after v%d" % k["after_v"]
                  for k in t.plan))


def run_kube_trial(seed, kinds, kills, trainer, keep=False):
    """One trial in the stand-in; returns its figures, or raises
    TrialFailed / CheckFailed with the seed and where its logs are."""
    tmp = make_tmp("kchaos-")
    t = KubeTrial(seed, kinds, kills, tmp, trainer)
    return run_reported(t, tmp, describe(t), "make chaos SEED=%d TRIALS=1 CHAOS_ARGS='--kinds %s'"
                        % (seed, ",".join(kinds)), keep)

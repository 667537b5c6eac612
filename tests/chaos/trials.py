"""What both kinds of chaos trial share (chaos.py's on loopback,
kubetrial.py's in the Kubernetes stand-in): the kill plan drawn from the
seed, the trainers' event logs (one t<slot>.jsonl per trainer slot in one
folder) and the model version they show, waits bounded by the trial's
deadline that fail the trial as a hang, and running a trial with its
report."""
import json
import os
import time

from check import CheckFailed
from cohorttest import remove_tmp


class TrialFailed(AssertionError):
    pass


def sanitizer_lines(text):
    return [l for l in text.splitlines() if "Sanitizer" in l or "runtime error" in l]


def plan_kills(rng, kinds, kills, steps, n, down=False):
    """`kills` kills in model-version order, spread over the steps (the
    last three left alone): each a kind, a victim index below n, the model
    version after which it fires and a delay past that; with `down`, also
    how long the killed process stays down."""
    plan, at = [], 0
    for _ in range(kills):
        at = min(steps - 3, at + rng.randint(1, max(1, (steps - 4) // kills)))
        k = {"kind": rng.choice(kinds), "victim": rng.randrange(n), "after_v": at,
             "delay_ms": rng.randint(0, 300)}
        if down:
            k["down_ms"] = rng.randint(0, 800)
        plan.append(k)
    return plan


class Progress:
    """Mixed into a trial, which sets self.log_dir (the trainers' logs) and
    self.deadline (time.monotonic()) and defines trainer_slots() (the
    slots that have a log), run() and stop_everything(); on_wait() runs
    between the polls of wait(), finish() after a run() that returned, and
    keep_logs() where a trial's folder is kept."""

    def finish(self):
        pass

    def keep_logs(self):
        pass

    def events(self, slot):
        try:
            with open(os.path.join(self.log_dir, "t%d.jsonl" % slot)) as f:
                return [json.loads(l) for l in f if l.endswith("\n")]
        except OSError:
            return []

    def max_version(self):
        v = 0
        for slot in self.trainer_slots():
            for e in self.events(slot):
                if e["ev"] in ("commit", "done"):
                    v = max(v, e["v"])
        return v

    def on_wait(self):
        pass

    def wait(self, cond, what):
        while not cond():
            if time.monotonic() > self.deadline:
                raise TrialFailed("hang: timed out waiting for %s (model version %d)" %
                                  (what, self.max_version()))
            self.on_wait()
            time.sleep(0.05)


def run_reported(t, tmp, desc, replay, keep=False):
    """Runs trial t, whose folder is tmp: prints desc, then "ok" with the
    figures t.run() returns, and returns them (with t.seed, t.done_kinds
    and the seconds it took); removes tmp unless `keep`. A trial that
    fails (TrialFailed, CheckFailed) has its processes stopped and its
    folder kept, and its error is raised again naming `replay` (the
    command that runs its plan alone) and the folder."""
    print("chaos: " + desc, flush=True)
    start = time.monotonic()
    try:
        figures = t.run()
    except (TrialFailed, CheckFailed) as e:
        t.stop_everything()
        t.keep_logs()
        print("chaos: FAILED %s; logs kept in %s" % (desc, tmp), flush=True)
        raise type(e)("%s (replay: %s; logs in %s)" % (e, replay, tmp))
    except BaseException:
        t.stop_everything()
        raise
    t.finish()
    figures.update(seed=t.seed, kills=t.done_kinds, seconds=round(time.monotonic() - start, 1))
    print("chaos: ok " + json.dumps(figures), flush=True)
    if keep:
        t.keep_logs()
        print("chaos: kept logs in", tmp)
    else:
        remove_tmp(tmp)
    return figures

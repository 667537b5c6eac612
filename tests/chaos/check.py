"""The chaos trials' checker: exact accounting over the logs of every
trainer process of a trial (tests/chaos/chaos_trainer.c says what they
hold).

    check(logs, survivors, steps) -> figures, or raises CheckFailed

- Agreement: every member that committed model version v committed the
  same result (the same bytes, the same per-slot sums, the same gradient
  count) and held the same parameter bytes after it; versions 1..steps
  were all committed; each process saw its versions one after another,
  jumping only where it received the leader's state, and that state held
  the parameters the others had at that version.
- Exact accounting: per slot, a result times its gradient count is
  (k, sum of seq, sum of seq^2) over k contributions; the checker finds
  the run of that slot's made contributions with those sums. A result
  that no run explains, a contribution claimed by two versions (counted
  twice), or a gradient count other than the number claimed fails.
- Nothing lost: every contribution a surviving process made is in some
  committed version; a killed process may leave only a tail of its last
  contributions uncommitted (never one before a contribution that was
  committed).
- The survivors' final parameters are the sums of rounds 1..v, exactly.

Run as a script on a kept trial directory: `check.py DIR STEPS`.
"""
import json
import os
import sys


class CheckFailed(AssertionError):
    pass


def fail(msg):
    raise CheckFailed(msg)


def load_logs(directory):
    """{slot: [events]} from DIR/t<slot>.jsonl; a cut last line (none is
    expected: lines are written whole) is reported, not skipped."""
    logs = {}
    for name in sorted(os.listdir(directory)):
        if not (name.startswith("t") and name.endswith(".jsonl")):
            continue
        slot = int(name[1:-len(".jsonl")])
        evs = []
        with open(os.path.join(directory, name)) as f:
            for n, line in enumerate(f, 1):
                try:
                    evs.append(json.loads(line))
                except ValueError:
                    fail("%s line %d is not whole JSON: %r" % (name, n, line))
        logs[slot] = evs
    return logs


def made_contributions(evs):
    """[seq, ...] of contributions made (logged and not undone), in order."""
    made = []
    for e in evs:
        if e["ev"] == "contrib":
            made.append(e["seq"])
        elif e["ev"] == "undo":
            if not made or made[-1] != e["seq"]:
                fail("an undo of seq %d that is not the last contribution" % e["seq"])
            made.pop()
    return made


def find_run(made, k, s1, s2):
    """The start index of k consecutive made contributions with those sums."""
    for i in range(0, len(made) - k + 1):
        run = made[i:i + k]
        if sum(run) == s1 and sum(q * q for q in run) == s2:
            return i
    return None


def check(logs, survivors, steps):
    survivors = set(survivors)
    made = {slot: made_contributions(evs) for slot, evs in logs.items()}

    # Agreement per version, and each process's own sequence of versions.
    by_v = {}
    states = []
    for slot, evs in logs.items():
        cur = 0
        for e in evs:
            if e["ev"] == "state":
                if e["from_v"] != cur:
                    fail("slot %d: state from version %d, but it was at %d" % (slot, e["from_v"], cur))
                cur = e["to_v"]
                states.append((slot, e))
            elif e["ev"] == "commit":
                if e["v"] != cur + 1:
                    fail("slot %d committed version %d after version %d (no state between)" %
                         (slot, e["v"], cur))
                if not e["whole"]:
                    fail("slot %d: version %d times its count %d is not whole: %s" %
                         (slot, e["v"], e["G"], e["res"]))
                cur = e["v"]
                by_v.setdefault(e["v"], []).append((slot, e))
    versions = sorted(by_v)
    if versions != list(range(1, len(versions) + 1)) or len(versions) < steps:
        fail("committed versions are not 1..%d: %s" % (steps, versions))
    key = lambda e: (e["G"], e["skipped"], json.dumps(e["res"]), e["rdig"], e["pdig"])
    for v in versions:
        got = {key(e) for _, e in by_v[v]}
        if len(got) != 1:
            fail("version %d differs between members: %s" %
                 (v, [(s, e["G"], e["res"], e["rdig"], e["pdig"]) for s, e in by_v[v]]))
    pdig = {v: by_v[v][0][1]["pdig"] for v in versions}
    for slot, e in states:
        if e["to_v"] > 0 and e["to_v"] in pdig and e["pdig"] != pdig[e["to_v"]]:
            fail("slot %d received state at version %d with parameters %s; the committers had %s" %
                 (slot, e["to_v"], e["pdig"], pdig[e["to_v"]]))

    # Exact accounting.
    used = {}                  # (slot, seq) -> version
    totals = {}                # slot -> [k, s1, s2] through the last version
    for v in versions:
        e = by_v[v][0][1]
        if e["skipped"]:
            fail("version %d counts %d skips; no trainer skips" % (v, e["skipped"]))
        claimed = 0
        for slot, k, s1, s2 in e["res"]:
            m = made.get(slot)
            i = find_run(m, k, s1, s2) if m is not None and k > 0 else None
            if i is None:
                fail("version %d holds (k=%d, sum=%d, sum of squares=%d) from slot %d, which no run "
                     "of its contributions %s makes up" % (v, k, s1, s2, slot, m))
            for q in m[i:i + k]:
                if (slot, q) in used:
                    fail("slot %d's contribution %d is counted twice: in versions %d and %d" %
                         (slot, q, used[(slot, q)], v))
                used[(slot, q)] = v
            t = totals.setdefault(slot, [0, 0, 0])
            t[0] += k
            t[1] += s1
            t[2] += s2
            claimed += k
        if claimed != e["G"]:
            fail("version %d: gradient count %d, but it holds %d contributions" % (v, e["G"], claimed))

    # Nothing lost.
    for slot, m in made.items():
        lost = [q for q in m if (slot, q) not in used]
        if slot in survivors:
            if lost:
                fail("surviving slot %d's contributions %s are in no committed version" % (slot, lost))
        elif lost and any((slot, q) in used for q in m if q > lost[0]):
            fail("killed slot %d's contribution %d is in no committed version, but later ones are" %
                 (slot, lost[0]))

    # The survivors' end.
    finals = {}
    for slot in survivors:
        f = [e for e in logs[slot] if e["ev"] == "final"]
        if not f:
            fail("surviving slot %d logged no final line" % slot)
        finals[slot] = f[-1]
    if len({(f["v"], f["pdig"]) for f in finals.values()}) > 1:
        fail("the survivors end apart: %s" % {s: (f["v"], f["pdig"]) for s, f in finals.items()})
    want = sorted([s, *t] for s, t in totals.items() if any(t))
    for slot, f in finals.items():
        if f["v"] != versions[-1]:
            fail("surviving slot %d ends at version %d, not %d" % (slot, f["v"], versions[-1]))
        if sorted(f["params"]) != want:
            fail("surviving slot %d's parameters %s are not the sums of the committed rounds %s" %
                 (slot, f["params"], want))
    return {"versions": len(versions), "commits": sum(len(x) for x in by_v.values()),
            "contributions": len(used), "states": len(states),
            "uncommitted": sum(len(m) for m in made.values()) - len(used)}


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: check.py TRIAL_DIR STEPS")
    d = sys.argv[1]
    logs = load_logs(d)
    alive = {s for s, evs in logs.items() if any(e["ev"] == "final" for e in evs)}
    print(json.dumps(check(logs, alive, int(sys.argv[2]))))

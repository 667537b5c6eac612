"""Exact accounting of a cohort's rounds from its trainers' own logs: the
JSON lines examples/c/logreg.c writes with --stats-file (and
--integer-grads, whose contributions are integer vectors that identify
them). tests/proc/test_accumulator.py and tests/netfault check every
committed round with it: the same result at every member that committed
it, made of exactly the contributions it claims, none counted twice, none
dropped and then lost.
"""
import itertools
import json
import os


def load_stats(directory):
    """{member id: [event dicts]} from the trainers' --stats-file. A trainer
    killed mid-line leaves a cut last line; it is ignored."""
    stats = {}
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".jsonl"):
            continue
        evs = []
        with open(os.path.join(directory, name)) as f:
            for line in f:
                try:
                    evs.append(json.loads(line))
                except ValueError:
                    pass
        stats[name[:-len(".jsonl")]] = evs
    return stats


def vec(e):
    return (e["total"], e["wsum"], 1, e["batch"])


def vsum(vs):
    return tuple(sum(x) for x in zip(*vs)) if vs else (0, 0, 0, 0)


def check_accounting(stats, steps, discarded=None, rolled_back=None):
    """Every committed round: result x num_gradients == the contributions of
    its epoch's members. Each member's part is known from its own log: the
    contributions since its last commit or drop. The rest of a round may
    only come from members that missed its commit (they fell behind and the
    node dropped their contributions when they received state), each drop
    used once and every drop used (nothing lost), or from members that died
    with contributions open (any first few of them: a trainer killed
    between logging a contribution and making it leaves one line too many).
    Returns the number of rounds checked.

    A member behind the leader whose pending contributions no round of
    the leader holds keeps them (a "state" line with dropped false): they
    are its part of a later round, made at an older version. Where the
    node cannot tell, it drops them although no round may hold them. With
    `discarded` (a list) such drops are allowed and appended to it as
    (version, member id); without, every drop must be in a committed
    round.

    A member cut off in the middle of a round's last exchange can finish
    the round alone (its peer's data reached it, its own did not), while
    the others, who never finish it, redo it without it; two sides of a
    partition that each run an epoch commit rounds of their own. When the
    member, or the side, comes back behind the leader it takes the
    leader's state: its commits from then on were rolled back, and its own
    contributions to them are lost. With `rolled_back` (a list), a commit
    at version v that differs from the others' is allowed when its member
    later received state from a version >= v (a "state" line), and is
    appended to it as (version, member id, its own part); the round is
    then checked among the others. Without, every commit must agree."""
    commits, drops, dead = {}, {}, {}
    for mid, evs in stats.items():
        pending, finished = [], False
        for e in evs:
            if e["ev"] == "contrib":
                pending.append(e)
            elif e["ev"] == "undo":
                pending.pop()
            elif e["ev"] == "commit":
                part = vsum([vec(c) for c in pending])
                # The trainer's own tally agrees with its contribution lines.
                assert (e["mine_total"], e["mine_wsum"], e["mine_calls"]) == part[:3], (mid, e)
                assert all(c["v"] == e["v"] - 1 or c.get("kept") for c in pending), (mid, e)
                commits.setdefault(e["v"], []).append((mid, e, part))
                pending = []
            elif e["ev"] == "state" and not e["dropped"]:
                for c in pending:
                    c["kept"] = True
            elif e["ev"] == "state" and e["dropped"]:
                part = vsum([vec(c) for c in pending])
                assert (e["mine_total"], e["mine_wsum"], e["mine_calls"]) == part[:3], (mid, e)
                if pending:
                    drops.setdefault(e["from_v"] + 1, []).append((mid, [part]))
                pending = []
            elif e["ev"] == "final":
                finished = True
        if pending and not finished:
            prefixes = [vsum([vec(c) for c in pending[:k]]) for k in range(1, len(pending) + 1)]
            dead.setdefault(pending[-1]["v"] + 1, []).append((mid, prefixes))

    if rolled_back is not None:
        replaced = {mid: [e["from_v"] for e in evs if e["ev"] == "state"]
                    for mid, evs in stats.items()}
        for v, recs in commits.items():
            if len({(e["total"], e["wsum"], e["G"], e["batch"]) for _, e, _ in recs}) < 2:
                continue
            gone = [r for r in recs if any(f >= v for f in replaced[r[0]])]
            keep = [r for r in recs if r not in gone]
            if keep:
                rolled_back.extend((v, mid, part[:3]) for mid, _, part in gone)
                commits[v] = keep
    assert sorted(commits) == list(range(1, steps + 1)), "rounds nobody logged"
    used_drops = set()
    for v, recs in sorted(commits.items()):
        results = {(e["total"], e["wsum"], e["G"], e["batch"]) for _, e, _ in recs}
        assert len(results) == 1, "members committed different results in round %d: %s" % (v, recs)
        result = results.pop()
        assert result[2] > 0 and result[0] > 0, (v, result)
        base = vsum([part for _, _, part in recs])
        residual = tuple(a - b for a, b in zip(result, base))
        assert all(x >= 0 for x in residual), \
            "round %d counted something twice: result %s, committers' parts %s" % (v, result, base)
        # The rest: each member that missed the commit or died adds nothing
        # or one of its alternatives. (Which epoch committed the round is
        # not in the API: the stats' epoch is the one current when the
        # trainer saw the result.)
        cands = drops.get(v, []) + dead.get(v, [])
        match = None
        for choice in itertools.product(*[[None] + alts for _, alts in cands]):
            if vsum([c for c in choice if c is not None]) == residual:
                match = choice
                break
        assert match is not None, (
            "round %d: result %s; the committers %s hold %s; no choice among the dropped "
            "or dead members' contributions %s makes up the rest" %
            (v, result, [m for m, _, _ in recs], base, cands))
        used_drops |= {(v, cands[i][0]) for i, c in enumerate(match)
                       if c is not None and i < len(drops.get(v, []))}
    # Nothing lost: whatever the node dropped was in a committed round.
    lost = [(v, mid) for v, ds in drops.items() for mid, _ in ds if (v, mid) not in used_drops]
    if discarded is not None:
        discarded.extend(lost)
    else:
        assert not lost, "contributions dropped but never committed: %s" % lost
    return len(commits)

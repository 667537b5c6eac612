"""The trainer of tests/kube/test_operator_hivemind.py's pods: hivemind's
DecentralizedAverager through the pod's sidecar, as a cohort's trainer
container has it (hivemind.DHT() with no peers reaches the sidecar at
$COHORT_SOCKET; the trainer holds no key).

    hivemind_pod.py OUT_DIR

Pod <cohort>-<n> (its name is $COHORT_ID) averages integer-valued
tensors with weight n + 1, round after round, and appends one JSON line
per step to OUT_DIR/<pod>-<run>.jsonl, where run is this process's own
nonce (a replaced pod keeps its name): its input, what it gathered from
each groupmate (each one's run, round, input and weight), the group the
broker formed, and the result's bytes. Values are multiples of 2520, the
least common multiple of 1 to 9, so that any group's weighted average
(weights of at most 3 in groups of at most 3) is an integer, exact in
float32: the test checks it to the bit.
"""
import json
import os
import sys
import uuid

import torch

import cohort.hivemind as hivemind

UNIT = 2520


def inputs(ordinal, r):
    return [torch.tensor([UNIT * (7 * ordinal + r + i) for i in range(4)], dtype=torch.float32),
            torch.tensor([[UNIT * (ordinal + 1), UNIT * r], [0, UNIT]], dtype=torch.float32)]


def flat(tensors):
    return [int(v) for t in tensors for v in t.flatten().tolist()]


def main():
    out_dir = sys.argv[1]
    pod = os.environ["COHORT_ID"]
    ordinal = int(pod.rsplit("-", 1)[1])
    run = uuid.uuid4().hex[:12]
    weight = ordinal + 1
    dht = hivemind.DHT(start=True)
    a = hivemind.DecentralizedAverager(
        inputs(ordinal, 0), dht, start=True, prefix="kube/avg", target_group_size=3,
        min_group_size=2, min_matchmaking_time=1.0, request_timeout=0.5, allreduce_timeout=3.0)
    with open(os.path.join(out_dir, "%s-%s.jsonl" % (pod, run)), "a") as f:
        def out(**kw):
            f.write(json.dumps(dict(pod=pod, run=run, me=a.peer_id, **kw)) + "\n")
            f.flush()

        out(started=True)
        for r in range(100000):
            x = inputs(ordinal, r)
            with a.get_tensors() as t:
                for dst, src in zip(t, x):
                    dst.copy_(src)
            got = a.step(gather={"run": run, "r": r, "x": flat(x), "w": weight}, weight=weight,
                         timeout=30)
            if got is None:
                out(r=r, failed=True)
                continue
            with a.get_tensors() as t:
                result = flat(t)
                raw = b"".join(v.numpy().tobytes() for v in t).hex()
            group, attempts, weights, _ = a.last_group
            out(r=r, x=flat(x), w=weight, group=group, attempts=attempts, gathered=got,
                weights=weights, result=result, bytes=raw)


if __name__ == "__main__":
    main()

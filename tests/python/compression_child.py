"""One of two members reducing gradients with each codec in turn:

    compression_child.py ADDRESS INDEX [CASE,...]

Joins the broker at ADDRESS (cohort "comp", the node in this process), or
its sidecar ("unix:PATH"), waits for the second member, then runs one
round per case (default: "none", "fp16", "bf16", "int8", and "mixed":
member 0 asks for fp16, member 1 for int8, so the members disagree;
"default" asks for nothing, leaving the sidecar's --compression; "topk:R"
and "powersgd:N" ask for those; "mixedk": member 0 asks for topk:0.01,
member 1 for topk:0.02, so they disagree on the parameter). Gradients are 100,003 float32
values (400 KB: more than the 256 KiB a fused step carries), different on
each member and none of them a float16 value. Prints one JSON line per
round: the codec, a SHA-256 of the result's bytes, the largest error
against the exact average (float64), whether the result equals the
uncompressed float32 average bit for bit, and whether every result value
is one the codec represents. "ok" last. PowerSGD runs on the whole-buffer
view (set_tensor_shapes([])): the one parameter is 1-D, which by shape
would go uncompressed.
"""
import hashlib
import json
import sys

import torch

import cohort
from pyproc import join_pair, wait_stepping as wait

ADDRESS, INDEX = sys.argv[1], int(sys.argv[2])
N = 100003
CASES = sys.argv[3].split(",") if len(sys.argv) > 3 else ["none", "fp16", "bf16", "int8",
                                                           "mixed"]


def grads(k, r):
    i = torch.arange(N, dtype=torch.float64)
    return (torch.sin(i * 0.001 * (k + 1) + r) * (10.0 + k) + 0.1 * k).to(torch.float32)


def representable(x, codec):
    if codec == "fp16":
        return bool(torch.equal(x.half().float(), x))
    if codec == "bf16":
        return bool(torch.equal(x.bfloat16().float(), x))
    return None


torch.set_num_threads(1)
p = torch.nn.Parameter(torch.zeros(N))
acc = cohort.Accumulator("comp", [p])
# One 1-D parameter would go uncompressed by shape: PowerSGD here is the
# whole-buffer view.
acc.set_tensor_shapes([])
join_pair(acc, ADDRESS)
for r, case in enumerate(CASES):
    if case != "default":
        if case == "mixed":
            acc.set_compression("fp16" if INDEX == 0 else "int8")
        elif case == "mixedk":
            acc.set_compression("topk:0.01" if INDEX == 0 else "topk:0.02")
        else:
            acc.set_compression(case)
    mine = grads(INDEX, r)
    acc.gradients().copy_(mine)
    acc.reduce_gradients(1)
    wait(acc, acc.has_gradients, "the result of " + case)
    got = p.grad.detach().clone()
    g0, g1 = grads(0, r), grads(1, r)
    exact = (g0.double() + g1.double()) / 2
    f32 = (g0 + g1) / 2
    print(json.dumps({
        "case": case,
        "digest": hashlib.sha256(got.numpy().tobytes()).hexdigest(),
        "max_err": float((got.double() - exact).abs().max()),
        "max_abs": float(torch.maximum(g0.abs(), g1.abs()).max()),
        "uncompressed": bool(torch.equal(got, f32)),
        "representable": {c: representable(got, c) for c in ("fp16", "bf16")},
        "num_gradients": acc.get_gradient_stats()["num_gradients"],
        "nonzero": int((got != 0).sum()),
        "rel_err": float((got.double() - exact).norm() / exact.norm()),
    }), flush=True)
    acc.zero_gradients()
    wait(acc, acc.wants_gradients, "wants_gradients after " + case)
acc.close()
print("ok")

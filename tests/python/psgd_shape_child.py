"""One of two members training a real torch model with PowerSGD by
tensor shape:

    psgd_shape_child.py ADDRESS INDEX

Joins the broker at ADDRESS (cohort "shape", the node in this process)
or its sidecar ("unix:PATH"), waits for the second member, asks for
powersgd:1, and runs ROUNDS rounds by shape, then one more on the
whole-buffer view (set_tensor_shapes([])). The model is two Linear
layers (300 -> 200 -> 250: 110,450 float32 gradients, more than a fused
step carries), the same on both members (seeded); per round both members
back-propagate the same input with targets of their own, so each
weight's gradient, and the members' mean, has rank 1 per layer (an outer
product with the layer's input), while the whole buffer viewed as one
matrix does not. The Accumulator passes its parameters' shapes itself.
Prints one JSON line per round: the view, a SHA-256 of the result's
bytes, the largest relative error of each parameter against the exact
mean (both members' gradients, computed here), and whether each result
equals the plain float32 mean bit for bit. "ok" last.
"""
import hashlib
import json
import sys

import torch

import cohort
from pyproc import join_pair, wait_stepping as wait

ADDRESS, INDEX = sys.argv[1], int(sys.argv[2])
ROUNDS = 3


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.Tanh(),
                               torch.nn.Linear(200, 250))


def sample(k, r):
    x = torch.randn(1, 300, generator=torch.Generator().manual_seed(1000 * r))
    return x, torch.randn(1, 250, generator=torch.Generator().manual_seed(1000 * r + 1 + k))


def loss_of(model, k, r):
    x, y = sample(k, r)
    return torch.nn.functional.mse_loss(model(x), y)


torch.set_num_threads(1)
model = make_model()
ref = make_model()          # the same weights: both members' exact gradients
acc = cohort.Accumulator("shape", model.parameters())
join_pair(acc, ADDRESS)
acc.set_compression("powersgd:1")
for r in range(ROUNDS + 1):
    view = "shape" if r < ROUNDS else "whole"
    if view == "whole":
        acc.set_tensor_shapes([])
    each = [torch.autograd.grad(loss_of(ref, k, r), list(ref.parameters())) for k in (0, 1)]
    loss_of(model, INDEX, r).backward()
    acc.reduce_gradients(1)
    wait(acc, acc.has_gradients, "round %d" % r)
    got = [p.grad.detach().clone() for p in model.parameters()]
    rel, plain = [], []
    for g, a, b in zip(got, *each):
        exact = (a.double() + b.double()) / 2
        rel.append(float((g.double() - exact).abs().max() / exact.abs().max()))
        plain.append(bool(torch.equal(g, (a + b) / 2)))
    print(json.dumps({
        "view": view,
        "digest": hashlib.sha256(b"".join(g.numpy().tobytes() for g in got)).hexdigest(),
        "shapes": [list(p.shape) for p in model.parameters()],
        "rel": rel,
        "plain": plain,
        "num_gradients": acc.get_gradient_stats()["num_gradients"],
    }), flush=True)
    acc.zero_gradients()
    wait(acc, acc.wants_gradients, "wants_gradients after round %d" % r)
acc.close()
print("ok")

"""A trainer whose model is "on a CUDA device", for test_py_gpu.py. No
torch here has CUDA, so the device is the stand-in driver's
(tests/gpu/fake_cuda.c, on LD_LIBRARY_PATH, its device memory mapped into
this process at the address cohort_use_gpu returns), and the Accumulator's
torch side is a stand-in too (StandIn below): it calls CPU tensors "on
cuda:0" and wraps device memory with torch.frombuffer where torch would
use __cuda_array_interface__. Everything else is the Accumulator's real
path: cohort_use_gpu through the binding, the UUID asked of the driver,
parameters, .grad and buffers as views of the device memory, cohort's
copies between them and the host copies that state transfer moves, and
a sidecar that imports the memory and reduces it host-staged.

    gpu_child.py ADDRESS INDEX [cuda] one of two members on sidecars
    gpu_child.py --refuse CASE        one refusal, printed as JSON

With "cuda" the model is on the real cuda:0 and nothing is stood in for
(make test-gpu, on a machine with a GPU and a torch with CUDA).

A member: member INDEX builds the model from seed INDEX, then moves its
parameters by 0.5 on the device after the Accumulator took them (so a
leader that sent host copies taken at construction would send stale
values, and a joiner whose device kept its own would disagree). Once
both members are in, it prints per round one JSON line: a digest of its
parameters and of the round's result, the contributions, and the checks
below; "ok" last. Rounds: 0 writes each .grad in place, 1 sets .grad to
None and runs backward (a new tensor that the Accumulator copies in).
Member k's gradient is (k + 1) * c for integer-valued c, so the mean is
exact.
"""
import ctypes
import hashlib
import json
import sys

import torch

import cohort
from cohort import accumulator
from pyproc import join_pair, wait_stepping as wait

WRONG_UUID = "GPU-00000000-0000-0000-0000-00000000000c"


class StandIn(accumulator._Cuda):
    """The Accumulator's CUDA calls on a machine without CUDA: every
    tensor is on "cuda:0", and device memory (host memory under the
    stand-in driver) is wrapped as a CPU tensor. uuid() is the real one,
    asked of the stand-in driver."""

    def __init__(self, uuid=None):
        self.fixed_uuid = uuid
        self.syncs = 0

    def device_of(self, t):
        return torch.device("cuda", 0)

    def uuid(self, device):
        return self.fixed_uuid or super().uuid(device)

    def tensor(self, address, nbytes, region, device):
        buf = (ctypes.c_ubyte * nbytes).from_address(address)
        buf.region = region         # as torch keeps the interface object
        return torch.frombuffer(buf, dtype=torch.uint8)

    def synchronize(self, device):
        self.syncs += 1


def make_model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5))


def digest(tensors):
    return hashlib.sha256(b"".join(t.detach().cpu().contiguous().numpy().tobytes()
                                   for t in tensors)).hexdigest()


def on_device(acc, t):
    """t lies in the device memory cohort_use_gpu allocated, not in the
    host block."""
    base = acc._core.gpu_grads()
    n = acc._core.numel() * 4
    lo, span = acc.memory_span()
    at = t.data_ptr()
    inside_host = lo <= at < lo + span
    return base != 0 and base <= at and at + t.numel() * t.element_size() <= base + n \
        and not inside_host


def in_cohorts_memory(acc, params, buffers):
    """Every parameter and buffer is the view of its place in cohort's
    device memory, not of the host block."""
    lo, span = acc.memory_span()
    places = [(t, acc._core.gpu_param(i)) for i, t in enumerate(params)] + \
             [(t, acc._core.gpu_buffer(i)) for i, t in enumerate(buffers)]
    return all(at != 0 and t.data_ptr() == at and not lo <= at < lo + span for t, at in places)


def pair(address, index, cuda):
    stand_in = None if cuda else StandIn()
    if stand_in:
        accumulator._cuda = stand_in
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    model = make_model(index).to(device)
    acc = cohort.Accumulator("gpu", model.parameters(), model.buffers())
    params = list(model.parameters())
    with torch.no_grad():
        for p in params:
            p.add_(0.5)
    assert all(on_device(acc, p.grad) for p in params), "a .grad is not in device memory"
    assert not any(on_device(acc, p) for p in params), "a parameter moved into the gradients"
    buffers = list(model.buffers())
    assert in_cohorts_memory(acc, params, buffers), "a parameter or buffer is not cohort's"
    join_pair(acc, address)
    for r in range(2):
        c = [torch.arange(p.numel(), dtype=torch.float32, device=device).view(p.shape) + 3 * r + i
             for i, p in enumerate(params)]
        if r == 0:
            for p, ci in zip(params, c):
                p.grad.copy_((index + 1) * ci)
        else:
            for p in params:
                p.grad = None
            loss = sum(((index + 1) * ci * p).sum() for p, ci in zip(params, c))
            loss.backward()
        acc.reduce_gradients(1)
        wait(acc, acc.has_gradients, "round %d" % r)
        exact = all(torch.equal(p.grad, 1.5 * ci) for p, ci in zip(params, c))
        placed = all(on_device(acc, p.grad) for p in params) and \
            in_cohorts_memory(acc, params, buffers)
        print(json.dumps({
            "round": r,
            "digest": digest(params + [p.grad for p in params] + list(model.buffers())),
            "exact": exact,
            "on_device": placed,
            "num_gradients": acc.get_gradient_stats()["num_gradients"],
            "leader": acc.is_leader(),
            "states_received": acc.get_gradient_stats()["states_received"],
        }), flush=True)
        acc.zero_gradients()
        assert bool((acc.gradients() == 0).all()), "zero_gradients left device gradients"
        wait(acc, acc.wants_gradients, "wants_gradients after round %d" % r)
    syncs, base = stand_in.syncs if stand_in else 0, acc._core.gpu_grads()
    end = acc._core.gpu_buffer(len(buffers) - 1) + 8
    before = digest(params + buffers)
    acc.close()
    assert not stand_in or stand_in.syncs >= syncs + 2, "close() did not wait for the device"
    # The model keeps its parameters, buffers and gradients (zeroed last),
    # moved to private memory.
    for t in params + [p.grad for p in params] + buffers:
        assert not base <= t.data_ptr() < end, "a tensor still points at cohort's device memory"
    assert all(bool((p.grad == 0).all()) for p in params)
    assert digest(params + buffers) == before, "close() changed the model"
    print("ok", flush=True)


def refuse(case):
    """One refusal, as {"type", "errno", "message"}."""
    model = make_model(0)
    accumulator._cuda = StandIn(WRONG_UUID if case == "uuid" else None)
    try:
        acc = cohort.Accumulator("gpu", model.parameters(), model.buffers())
        if case == "broker":
            acc.connect("127.0.0.1:1")
        acc.close()
        out = {"type": None}
    except (cohort.Error, ValueError) as e:
        out = {"type": type(e).__name__, "errno": getattr(e, "errno", None), "message": str(e)}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--refuse":
        refuse(sys.argv[2])
    else:
        pair(sys.argv[1], int(sys.argv[2]), sys.argv[3:] == ["cuda"])

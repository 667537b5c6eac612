"""The cohort package: moolib's loop unchanged, zero copy, misuse.

- moolib's documented example loop, under `import cohort as moolib`, with
  two trainers joining a broker directly (the node in each process).
- Zero copy: every parameter, .grad and buffer is a view of the memory
  cohort registered, backward() adds into it, and a round leaves the views
  where they were.
- Misuse raises a Python exception and leaves the interpreter and the
  model usable: bad tensors, bad arguments, calls out of turn, use after
  close(), a sidecar that dies.
"""
import errno
import os
import signal

import pytest
import torch

import cohort
from cohorttest import Proc, bin_path, finish
from pyproc import FINAL, HERE, inside, spawn


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5), torch.nn.ReLU(),
                               torch.nn.Linear(5, 2))


# ---- moolib's loop -------------------------------------------------------

def test_seed_example_loop_runs_unchanged_under_import_cohort_as_moolib(broker):
    steps = 40
    kids = [spawn([os.path.join(HERE, "seed_loop.py"), broker.address, "2", str(steps), str(i)])
            for i in range(2)]
    results = [finish(k) for k in kids]
    for rc, out, err in results:
        assert rc == 0, err[-3000:]
    finals = [out.strip().splitlines()[-1] for _, out, _ in results]
    assert FINAL.match(finals[0]) and FINAL.match(finals[0]).group(1) == str(steps), finals
    assert finals[0] == finals[1], finals
    for _, _, err in results:
        line = [l for l in err.splitlines() if l.startswith("first_loss=")][-1]
        kv = dict(x.split("=") for x in line.split())
        assert float(kv["last_loss"]) < float(kv["first_loss"]), line
        assert kv["num_gradients"] == "2", line      # both members in every round


# ---- zero copy -------------------------------------------------------------

def test_parameters_grads_and_buffers_are_views_of_the_registered_memory():
    m = mlp()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    acc = cohort.Accumulator("zc", m.parameters(), m.buffers())
    try:
        # The values came along.
        for k, v in m.state_dict().items():
            assert torch.equal(v, before[k]), k
        for t in list(m.parameters()) + list(m.buffers()):
            assert inside(acc, t)
        for p in m.parameters():
            assert p.grad is not None and inside(acc, p.grad)
        # One flat gradient buffer, in parameter order, shared with .grad.
        flat = acc.gradients()
        assert flat.numel() == sum(p.numel() for p in m.parameters())
        off = 0
        for p in m.parameters():
            assert p.grad.data_ptr() == flat.data_ptr() + off * flat.element_size()
            off += p.numel()
        flat.fill_(2.0)
        assert all(bool((p.grad == 2.0).all()) for p in m.parameters())
        flat.zero_()
        # backward() adds into the shared memory in place.
        ptrs = [p.grad.data_ptr() for p in m.parameters()]
        m(torch.randn(8, 6)).sum().backward()
        assert [p.grad.data_ptr() for p in m.parameters()] == ptrs
        assert float(flat.abs().sum()) > 0
        # BatchNorm's statistics (float and int64) are updated in place.
        bn = m[1]
        assert int(bn.num_batches_tracked) == 1 and inside(acc, bn.num_batches_tracked)
        assert not torch.equal(bn.running_mean, before["1.running_mean"])
        assert inside(acc, bn.running_mean)
    finally:
        acc.close()


def test_a_round_keeps_the_views_and_reduces_in_place(broker):
    rc, out, err = finish(spawn([os.path.join(HERE, "child_checks.py"), "round", broker.address],
                                COHORT_COHORT="zc-round", COHORT_ID="solo"))
    assert rc == 0 and out.strip().endswith("ok"), err[-3000:]


def test_close_moves_the_model_to_private_memory():
    m = mlp()
    acc = cohort.Accumulator("close", m.parameters(), m.buffers())
    m(torch.randn(4, 6)).sum().backward()
    values = {k: v.clone() for k, v in m.state_dict().items()}
    grads = [p.grad.clone() for p in m.parameters()]
    acc.close()
    acc.close()                                     # twice is fine
    for k, v in m.state_dict().items():
        assert torch.equal(v, values[k]), k
    for p, g in zip(m.parameters(), grads):
        assert torch.equal(p.grad, g)
    # The model trains on without the accumulator.
    m(torch.randn(4, 6)).sum().backward()
    torch.optim.SGD(m.parameters(), lr=0.1).step()
    for call, args in [("update", ()), ("connected", ()), ("reduce_gradients", (4,)),
                       ("skip_gradients", ()), ("zero_gradients", ()), ("model_version", ()),
                       ("set_state", ({},)), ("state", ()), ("get_gradient_stats", ()),
                       ("connect", ("127.0.0.1:1",)), ("gradients", ())]:
        with pytest.raises(ValueError, match="closed"):
            getattr(acc, call)(*args)
    assert "closed" in repr(acc)


def test_views_kept_by_the_user_keep_the_memory_mapped():
    m = mlp()
    acc = cohort.Accumulator("keep", m.parameters())
    flat = acc.gradients()
    w = m[0].weight.data            # a view of the shared parameters, taken before close
    acc.close()
    flat.fill_(1.0)                 # still mapped: no crash
    assert float(w.sum()) == float(w.sum())
    del flat, w


# ---- misuse ------------------------------------------------------------------

def test_bad_tensors_are_refused_with_clear_messages():
    p32, p64 = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="parameter 1 is torch.float64"):
        cohort.Accumulator("x", [p32, p64], [])
    with pytest.raises(ValueError, match="float32, float64, float16 or bfloat16"):
        cohort.Accumulator("x", [torch.zeros(3, dtype=torch.int64)], [])
    with pytest.raises(ValueError, match="at least one parameter"):
        cohort.Accumulator("x", [], [])
    with pytest.raises(ValueError, match="no elements"):
        cohort.Accumulator("x", [torch.zeros(0)], [])
    with pytest.raises(TypeError, match="not a torch.Tensor"):
        cohort.Accumulator("x", [[1.0, 2.0]], [])
    with pytest.raises(ValueError, match="given twice"):
        cohort.Accumulator("x", [p32, p32], [])
    with pytest.raises(ValueError, match="CPU and CUDA tensors only"):
        cohort.Accumulator("x", [torch.zeros(3, device="meta")], [])
    with pytest.raises(ValueError, match="dense"):
        cohort.Accumulator("x", [torch.zeros(3).to_sparse()], [])
    # A CUDA device: on a machine without CUDA no such tensor can even be
    # made, so the sentence is asked of the check itself.
    from cohort.accumulator import _device_refusal
    assert _device_refusal(torch.device("cpu")) is None
    if not torch.cuda.is_available():
        assert "CUDA is not available" in _device_refusal(torch.device("cuda", 0))
    else:
        # Registered on the device (test_py_gpu.py).
        assert _device_refusal(torch.device("cuda", 0)) is None
    with pytest.raises(TypeError, match="name"):
        cohort.Accumulator(None, [p32], [])
    with pytest.raises(TypeError, match="cohort.Group"):
        cohort.Accumulator("x", [p32], [], group="g")
    # Buffers of any dtype (BatchNorm's int64 counter, a bool mask) are fine.
    mask = torch.tensor([True, False, True])
    acc = cohort.Accumulator("x", [p32], [mask, torch.arange(5)])
    assert mask.tolist() == [True, False, True] and inside(acc, mask)
    acc.close()


def test_calls_out_of_turn_and_bad_arguments_raise_without_a_cohort():
    m = mlp()
    acc = cohort.Accumulator("m", m.parameters(), m.buffers())
    try:
        assert not acc.connected() and not acc.wants_gradients() and acc.state() is None
        with pytest.raises(cohort.Error, match="not connected") as e:
            acc.reduce_gradients(4)
        assert e.value.errno == errno.ENOTCONN and isinstance(e.value, OSError)
        with pytest.raises(ValueError, match="positive"):
            acc.reduce_gradients(0)
        with pytest.raises(ValueError):
            acc.reduce_gradients(-1)
        with pytest.raises(TypeError):
            acc.reduce_gradients("4")
        with pytest.raises(TypeError):
            acc.reduce_gradients(True)
        with pytest.raises(cohort.Error) as e:
            acc.zero_gradients()
        with pytest.raises(ValueError):
            acc.set_virtual_batch_size(0)
        with pytest.raises(ValueError):
            acc.set_model_version(-1)
        with pytest.raises(ValueError):
            acc.set_parallel_gradients(1 << 40)
        with pytest.raises(TypeError):
            acc.connect(42)
        with pytest.raises(TypeError, match="picklable"):
            acc.set_state(lambda: 0)
        with pytest.raises(ValueError, match="seconds"):
            acc.wait(-1)
        with pytest.raises(ValueError):
            acc.wait(True)
        assert acc.wait(0.01) is False      # nothing connected: nothing to wake for
    finally:
        acc.close()


def test_connect_without_an_address_says_what_to_set(monkeypatch):
    monkeypatch.delenv("COHORT_SOCKET", raising=False)
    monkeypatch.delenv("COHORT_BROKER", raising=False)
    acc = cohort.Accumulator("m", [torch.zeros(2)])
    with pytest.raises(ValueError, match="COHORT_SOCKET"):
        acc.connect()
    acc.close()


def test_a_parameter_moved_to_another_dtype_is_refused_on_update():
    m = mlp()
    acc = cohort.Accumulator("m", m.parameters())
    m.double()
    with pytest.raises(ValueError, match="changed to torch.float64"):
        acc.update()
    acc.close()


def test_calls_out_of_turn_raise_in_a_connected_accumulator(broker):
    rc, out, err = finish(spawn([os.path.join(HERE, "child_checks.py"), "misuse", broker.address],
                                COHORT_COHORT="misuse", COHORT_ID="solo"))
    assert rc == 0 and out.strip().endswith("ok"), err[-3000:]


def test_a_sidecar_that_comes_late_then_dies(broker, tmp_path):
    sock = str(tmp_path / "sidecar.sock")
    kid = spawn([os.path.join(HERE, "child_checks.py"), "sidecar", "unix:" + sock])
    lines = []
    # connect() before the sidecar listens does not fail: update() retries.
    lines.append(kid.stdout.readline())
    assert lines[-1].strip() == "waiting", (lines, kid.stderr.read() if kid.poll() is not None else "")
    sc = Proc([bin_path("cohort-sidecar"), "--broker", broker.address, "--cohort", "late",
               "--id", "solo", "--socket", sock, "--log-format", "json",
               "--heartbeat-interval", "250ms", "--member-timeout", "2s"], "solo")
    try:
        lines.append(kid.stdout.readline())
        assert lines[-1].strip() == "trained", (lines, finish(kid)[2][-3000:], sc.raw[-20:])
        sc.kill(signal.SIGKILL)
        rc, out, err = finish(kid)
        assert rc == 0, err[-3000:]
        assert "error errno=%d" % errno.ENOTCONN in out and out.strip().endswith("ok"), out
    finally:
        sc.stop()
        if kid.poll() is None:
            kid.kill()

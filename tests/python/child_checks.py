"""Checks that need a connected Accumulator, run in a child process so
that the node's threads never start inside the pytest process:

    child_checks.py round ADDRESS       one-member cohort: zero copy through a round
    child_checks.py misuse ADDRESS      refusals of a connected accumulator
    child_checks.py sidecar unix:PATH   connect before the sidecar listens, train,
                                        then report the error once it is killed
    child_checks.py pinned unix:PATH    one of two members whose sidecars may pin a
                                        virtual batch size of 8: three rounds of
                                        reduce_gradients(2), then the setters; prints
                                        each round's stats

Each prints "ok" last on success; a failed check raises. tests/lib is on
the path (pyproc.child_env puts it there); pyproc is beside this file.
"""
import errno
import json
import sys
import time

import torch

import cohort
from cohorttest import DEADLINE, wait_until
from pyproc import inside


def wait(cond, what):
    """Polls often: each poll is an update() that moves the accumulator on."""
    return wait_until(cond, what, timeout=2 * DEADLINE, interval=0.005)


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 2))


def connected(address, m):
    acc = cohort.Accumulator("child", m.parameters(), m.buffers())
    acc.connect(address)
    wait(lambda: (acc.update(), acc.connected() and acc.wants_gradients())[1], "wants_gradients")
    return acc


def check_round(address):
    m = model()
    acc = connected(address, m)
    ptrs = [p.grad.data_ptr() for p in m.parameters()]
    flat = acc.gradients()
    x = torch.randn(8, 6)
    m(x).pow(2).mean().backward()
    mine = torch.cat([p.grad.reshape(-1) for p in m.parameters()]).clone()
    # backward added into the shared buffer in place
    assert [p.grad.data_ptr() for p in m.parameters()] == ptrs
    assert torch.equal(flat, mine)
    acc.reduce_gradients(8)
    # wait() wakes for the commit; while the result waits for us, nothing
    # else changes and it times out.
    wait(lambda: (acc.wait(1.0), acc.update(), acc.has_gradients())[2], "has_gradients")
    assert acc.wait(0.2) is False
    assert acc.model_version() == 1
    # .grad is now the result, in the shared memory too (in place, or the
    # results region when the engine reduces out of place).
    assert all(inside(acc, p.grad) and inside(acc, p) for p in m.parameters())
    # one contribution: the result is that contribution
    assert torch.allclose(torch.cat([p.grad.reshape(-1) for p in m.parameters()]), mine)
    before = [p.detach().clone() for p in m.parameters()]
    with torch.no_grad():
        for p in m.parameters():
            p -= 0.1 * p.grad
    acc.zero_gradients()
    assert float(flat.abs().sum()) == 0.0
    assert [p.grad.data_ptr() for p in m.parameters()] == ptrs
    assert any(not torch.equal(b, p) for b, p in zip(before, m.parameters()))
    # A .grad that the user replaced (zero_grad(set_to_none=True)) is put
    # back on the shared memory by the next reduce.
    wait(lambda: (acc.update(), acc.wants_gradients())[1], "wants_gradients again")
    torch.optim.SGD(m.parameters(), lr=0.1).zero_grad(set_to_none=True)
    m(x).pow(2).mean().backward()
    fresh = torch.cat([p.grad.reshape(-1) for p in m.parameters()]).clone()
    acc.reduce_gradients(8)
    assert [p.grad.data_ptr() for p in m.parameters()] == ptrs
    assert torch.equal(flat, fresh)
    wait(lambda: (acc.update(), acc.has_gradients())[1], "the second result")
    assert acc.model_version() == 2
    assert torch.allclose(torch.cat([p.grad.reshape(-1) for p in m.parameters()]), fresh)
    acc.zero_gradients()
    acc.close()
    print("ok")


def expect(exc, fn, *args, code=None):
    try:
        fn(*args)
    except exc as e:
        if code is not None:
            assert e.errno == code, (fn, e)
        return str(e)
    raise AssertionError("%s%r did not raise %s" % (fn.__name__, args, exc.__name__))


def check_misuse(address):
    m = model()
    acc = connected(address, m)
    msg = expect(cohort.Error, acc.zero_gradients, code=errno.EPERM)
    assert "has_gradients" in msg, msg
    expect(cohort.Error, acc.connect, address, code=errno.EALREADY)
    m(torch.randn(4, 6)).sum().backward()
    acc.reduce_gradients(4)
    expect(cohort.Error, acc.reduce_gradients, 4, code=errno.EPERM)   # not asked again
    expect(cohort.Error, acc.skip_gradients, code=errno.EPERM)
    wait(lambda: (acc.update(), acc.has_gradients())[1], "has_gradients")
    expect(cohort.Error, acc.reduce_gradients, 4, code=errno.EPERM)   # a result is pending
    acc.zero_gradients()
    expect(cohort.Error, acc.zero_gradients, code=errno.EPERM)
    expect(ValueError, acc.set_virtual_batch_size, 0)
    expect(ValueError, acc.set_parallel_gradients, 0)
    expect(TypeError, acc.set_model_version, "3")
    # Parallel gradients pass through: refused by this build, or taken.
    try:
        acc.set_parallel_gradients(2)
    except cohort.Error as e:
        assert e.errno == errno.ENOTSUP, e
    # state() before any state arrived
    assert acc.state() is None or isinstance(acc.state(), object)
    acc.close()
    expect(ValueError, acc.update)
    expect(ValueError, acc.reduce_gradients, 4)
    print("ok")


def check_sidecar(address):
    m = model()
    acc = cohort.Accumulator("child", m.parameters(), m.buffers())
    acc.connect(address)            # the sidecar is not listening yet
    acc.update()
    assert not acc.connected()
    print("waiting", flush=True)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    wait(lambda: (acc.update(), acc.connected())[1], "the sidecar")
    while acc.model_version() < 3:
        acc.update()
        if acc.wants_state():
            acc.set_state({"opt": opt.state_dict()})
        if acc.has_new_state():
            opt.load_state_dict(acc.state()["opt"])
        if acc.wants_gradients():
            m(torch.randn(4, 6)).sum().backward()
            acc.reduce_gradients(4)
        if acc.has_gradients():
            opt.step()
            acc.zero_gradients()
        time.sleep(0.001)
    print("trained", flush=True)

    def update_error():
        try:
            acc.update()
        except cohort.Error as e:
            return e
        return None
    e = wait(update_error, "update() to fail")
    print("error errno=%d %s" % (e.errno, e.strerror), flush=True)
    # The accumulator is unusable but the interpreter and the model are fine.
    expect(cohort.Error, acc.update, code=errno.ENOTCONN)
    acc.close()
    m(torch.randn(4, 6)).sum().backward()
    print("ok")


def check_pinned(address):
    # Never calls set_virtual_batch_size before training: the rounds follow
    # the sidecar's --virtual-batch-size 8 or nothing.
    m = model()
    # Not connected(): it only updates, and two members that join at once
    # wait on each other's state forever unless both serve it.
    acc = cohort.Accumulator("child", m.parameters(), m.buffers())
    acc.connect(address)
    def serve():
        acc.update()
        if acc.wants_state():
            acc.set_state({})
        if acc.has_new_state():
            acc.state()
    # Both members in one epoch, with state, before anyone contributes.
    wait(lambda: (serve(), acc.connected() and acc.size() == 2 and acc.wants_gradients())[1],
         "two members")
    rounds = []
    while len(rounds) < 3:
        serve()
        if acc.has_gradients():
            rounds.append(acc.get_gradient_stats())
            acc.zero_gradients()
        elif acc.wants_gradients():
            m(torch.randn(2, 6)).sum().backward()
            acc.reduce_gradients(2)
        else:
            acc.wait(0.05)
    print("rounds " + json.dumps(rounds), flush=True)
    # Another size or count is refused, the cohort's own is accepted.
    msg = expect(cohort.Error, acc.set_virtual_batch_size, 4, code=errno.EACCES)
    assert "the cohort sets this" in msg, msg
    expect(cohort.Error, acc.set_parallel_gradients, 1, code=errno.EACCES)
    acc.set_virtual_batch_size(8)
    acc.set_parallel_gradients(2)
    print("ok")


if __name__ == "__main__":
    {"round": check_round, "misuse": check_misuse, "sidecar": check_sidecar,
     "pinned": check_pinned}[sys.argv[1]](sys.argv[2])

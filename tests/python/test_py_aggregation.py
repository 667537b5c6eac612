"""cohort.aggregation: mlbench's Aggregation classes among real processes
joined to a real broker, with real torch.

- Every class (AllReduceAggregation, its Horovod twin, divide_before),
  every op (and mlbench's names for them), by layer and by model, on
  gradients and weights, against a reference each member computes in
  torch from every member's inputs; every member ends with the same bytes.
- DecentralizedAggregation on a path graph, against the gossip reference;
  after a member leaves, the graph is mended to the ring of the rest.
- A member joining mid-run lines up with the others' calls; a member
  killed with SIGKILL mid-run: the survivors' next aggregation completes
  on the new membership, and no call has two results.
- SparsifiedAggregation (top-k with error feedback): every result and
  residual against a reference of every member's selection, by model and
  by layer; across a member joining and one killed, every call has one
  result (the same bytes on every member) and every residual is the
  member's own unsent gradient; members whose models differ get EPROTO.
- PowerAggregation (PowerSGD with error feedback, warm start): every
  result and error against a float64 reference of every member's
  PowerSGD, by model and by layer; across a join and a kill, one result
  per call, the same bytes on every member.
- Bad input: an unknown op, custom_avg without denom, use_cuda without
  CUDA, bad ranks, mismatched models across members (a clear error on
  every member, the models untouched, the group still usable).
"""
import json
import os
import signal

import pytest
import torch

import cohort.aggregation as agg
from cohorttest import finish, wait_until
from pyproc import HERE, spawn

CHILD = os.path.join(HERE, "aggregation_child.py")


def members(broker, n, scenario, out_dir=None, first=0, count=None):
    """Children m-first.. of a cohort of n (they wait for n members)."""
    extra = [str(out_dir)] if out_dir else []
    return [spawn([CHILD, broker.address, "m-%d" % i, str(n), scenario, *extra])
            for i in range(first, first + (count if count is not None else n))]


def results(kids):
    got = []
    for k in kids:
        rc, out, err = finish(k)
        assert rc == 0, err[-4000:]
        got.append([json.loads(l) for l in out.splitlines() if l.startswith("{")])
    return got


def test_every_class_and_op_by_layer_and_by_model_matches_the_reference(broker):
    got = results(members(broker, 3, "ops"))
    for lines in got:
        assert lines[-1].get("done"), lines[-1]
    # 2 classes x 7 ops + divide_before x 2 ops, each by layer and by
    # model, on gradients and on weights.
    assert len(got[0]) == (2 * 7 + 2) * 4 + 1
    for a, b in zip(got[0][:-1], got[1][:-1]):
        assert a == b, (a, b)
    for a, c in zip(got[0][:-1], got[2][:-1]):
        assert a == c, (a, c)


def test_decentralized_gossip_averages_with_the_given_neighbours_and_mends_the_graph(broker):
    got = results(members(broker, 4, "gossip"))
    assert [lines[-1]["neighbors"] for lines in got] == [["m-1"], ["m-0", "m-2"],
                                                         ["m-1", "m-3"], ["m-2"]]
    # After m-3 left: the ring of the three that remain, in which m-0 now
    # has m-2 too (its given neighbours less the one gone would be m-1 only).
    assert [lines[-1]["mended"] for lines in got[:3]] == [["m-1", "m-2"], ["m-0", "m-2"],
                                                          ["m-0", "m-1"]]


def read_log(path):
    try:
        with open(path) as f:
            return [tuple(int(x) for x in l.split()) for l in f.read().splitlines()
                    if len(l.split()) == 2]
    except FileNotFoundError:
        return []


def stop_after(tmp_path, ids, margin=50):
    top = max((read_log(tmp_path / (i + ".log")) or [(0, 0)])[-1][0] for i in ids)
    (tmp_path / "stop").write_text(str(top + margin))


def check_one_result_per_call(tmp_path, ids):
    seen = {}
    for i in ids:
        for k, mask in read_log(tmp_path / (i + ".log")):
            assert seen.setdefault(k, mask) == mask, "call %d has two results" % k
    return seen


def test_a_member_joining_mid_run_lines_up_with_the_others(broker, tmp_path):
    kids = members(broker, 2, "loop", tmp_path)
    wait_until(lambda: len(read_log(tmp_path / "m-0.log")) >= 10, "the first calls")
    kids += members(broker, 3, "loop", tmp_path, first=2, count=1)
    wait_until(lambda: len(read_log(tmp_path / "m-2.log")) >= 10, "the late member's calls")
    stop_after(tmp_path, ["m-0", "m-1", "m-2"])
    got = results(kids)
    assert len({lines[-1]["last"] for lines in got}) == 1, got
    late = read_log(tmp_path / "m-2.log")
    assert late[0][0] > 10, "the late member took the others' numbering: %s" % late[:3]
    assert late[-1][1] == 0b111
    seen = check_one_result_per_call(tmp_path, ["m-0", "m-1", "m-2"])
    masks = [seen[k] for k in sorted(seen)]
    # The two, then all three from the late member's first call on.
    assert masks == [0b11] * masks.index(0b111) + [0b111] * (len(masks) - masks.index(0b111))
    assert masks.index(0b111) == late[0][0] - 1, (late[0], masks)


def test_a_member_killed_mid_run_the_survivors_go_on(broker, tmp_path):
    kids = members(broker, 3, "loop", tmp_path)
    wait_until(lambda: len(read_log(tmp_path / "m-1.log")) >= 10, "the first calls")
    os.killpg(kids[1].pid, signal.SIGKILL)
    finish(kids[1])
    # The survivors' calls complete on the new membership: m-0 and m-2.
    wait_until(lambda: sum(1 for _, m in read_log(tmp_path / "m-0.log") if m == 0b101) >= 5,
               "the survivors' calls without the killed member")
    stop_after(tmp_path, ["m-0", "m-2"])
    got = results([kids[0], kids[2]])
    assert got[0][-1]["last"] == got[1][-1]["last"]
    assert got[0][-1]["stats"]["members"] == 2
    assert got[0][-1]["stats"]["retries"] >= 1 or got[0][-1]["stats"]["epochs"] >= 2
    seen = check_one_result_per_call(tmp_path, ["m-0", "m-1", "m-2"])
    masks = [seen[k] for k in sorted(seen)]
    assert sorted(seen) == list(range(1, len(seen) + 1)), "calls numbered from 1, none missing"
    # All three, then the survivors: never a mix after the kill.
    pair = masks.index(0b101)
    assert masks == [0b111] * pair + [0b101] * (len(masks) - pair), masks


def test_members_with_different_models_get_a_clear_error(broker):
    got = results(members(broker, 2, "mismatch"))
    for lines in got:
        assert "calls differ" in lines[0]["error"], lines
        assert lines[-1] == {"done": True}


def test_bad_input_is_refused_with_a_clear_error(broker):
    agg.init(broker.address, "alone", "solo")
    try:
        assert agg.world_size() == 1 and agg.rank() == 0
        a = agg.AllReduceAggregation(1)
        t = torch.tensor([1.0, 2.0])
        with pytest.raises(NotImplementedError, match="not one of avg, sum, min, max"):
            a._agg(t, "median")
        with pytest.raises(ValueError, match="Denominator"):
            a._agg(t, "custom_avg")
        with pytest.raises(ValueError, match="Denominator"):
            a._agg(t, "custom_avg", torch.tensor(0.0))
        with pytest.raises(ValueError, match="one element"):
            a._agg(t, "custom_avg", torch.tensor([1.0, 2.0]))
        with pytest.raises(TypeError, match="not torch.bool"):
            a._agg(torch.tensor([True]), "sum")
        with pytest.raises(TypeError, match="divide_before"):
            agg.AllReduceAggregation(1, divide_before=True)._agg(torch.tensor([4]), "avg")
        with pytest.raises(ValueError, match="world_size"):
            agg.AllReduceAggregation(0)
        with pytest.warns(RuntimeWarning, match="1 members now"):
            agg.AllReduceAggregation(8)
        with pytest.raises(ValueError, match="own neighbour"):
            agg.DecentralizedAggregation(0, [0])
        with pytest.raises(ValueError, match="not this member's rank"):
            agg.DecentralizedAggregation(3, [])
        with pytest.raises(ValueError, match="not ranks"):
            agg.DecentralizedAggregation(0, [5])
        if not torch.cuda.is_available():
            with pytest.raises(RuntimeError, match="no CUDA device"):
                agg.AllReduceAggregation(1, use_cuda=True)
        assert t.tolist() == [1.0, 2.0], "refused calls change nothing"
        # The extension takes buffers, never addresses, and checks their
        # length against the call before it runs.
        g = agg._g()
        with pytest.raises(ValueError, match="holds 3 bytes, the call needs 4"):
            g.allreduce(memoryview(bytearray(3)), 1, agg._cohort.G_F32, agg._cohort.OP_SUM,
                        0.0, 0, 1000)
        with pytest.raises(TypeError):
            g.allreduce(b"\0\0\0\0", 1, agg._cohort.G_F32, agg._cohort.OP_SUM, 0.0, 0, 1000)
        with pytest.raises(TypeError):
            g.allreduce(12345, 1, agg._cohort.G_F32, agg._cohort.OP_SUM, 0.0, 0, 1000)
        with pytest.raises(agg.Error):
            g.allreduce(memoryview(bytearray(4)), 1, 99, agg._cohort.OP_SUM, 0.0, 0, 1000)
        # Alone, a call is the member's own input; custom_avg divides.
        s = torch.tensor(3.0)
        a._agg(s, "sum")
        assert s.item() == 3.0, "a 0-dimensional tensor is aggregated too"
        a._agg(t, "custom_avg", 2)
        assert t.tolist() == [0.5, 1.0]
        with pytest.raises(RuntimeError, match="already initialised"):
            agg.init(broker.address, "alone", "solo2")
    finally:
        agg.shutdown()
    with pytest.raises(RuntimeError, match="init"):
        agg.world_size()


def test_by_layer_is_one_collective_per_dtype_for_elementwise_classes(broker):
    """A joiner lines up call by call, so an aggregation made of several
    calls could be cut between two layers; the all-reduce and gossip
    classes aggregate by layer in one call per dtype (their results are
    the same as layer by layer). A subclass's own _agg still sees each
    layer."""
    agg.init(broker.address, "bylayer", "solo")
    try:
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        before = agg.stats()["calls"]
        agg.AllReduceAggregation(1).agg_grad(by_layer=True)(model, "sum")
        agg.AllReduceAggregation(1).agg_model(by_layer=True)(model, "avg")
        agg.DecentralizedAggregation(0, []).agg_model(by_layer=True)(model, "avg")
        assert agg.stats()["calls"] - before == 3, "one collective per aggregation"
        assert all(p.grad.eq(1).all() for p in model.parameters()), "alone, a sum is the input"

        class Layers(agg.Aggregation):
            def __init__(self):
                super().__init__()
                self.seen = []

            def _agg(self, data, op, denom=None):
                self.seen.append(data.numel())
                return data

        mine = Layers()
        mine.agg_grad(by_layer=True)(model, "sum")
        assert mine.seen == [p.numel() for p in model.parameters()]
    finally:
        agg.shutdown()


def test_by_layer_is_one_call_for_the_compressing_classes(broker):
    """Top-k and PowerSGD compress each layer on its own by layer, all
    layers in one call, so a joiner cannot cut the aggregation in two."""
    agg.init(broker.address, "bylayer-compressed", "solo")
    try:
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        s = agg.SparsifiedAggregation(model, ratio=0.5)
        a = agg.PowerAggregation(model, rank=1)
        for f in (s.agg_grad(by_layer=True), s.agg_model(by_layer=True),
                  a.agg_grad(by_layer=True), a.agg_model(by_layer=True)):
            before = agg.stats()["calls"]
            f(model, "sum")
            assert agg.stats()["calls"] - before == 1, "one collective per aggregation"
        assert s.residual(("grad", "layers")).numel() == 26
        assert s.residual(("weights", "layers")).numel() == 26
        assert a.error(("grad", "layers")).numel() == 26
        assert a.error(("weights", "layers")).numel() == 26
        assert s.residual() is None and a.error() is None, "by model keeps its own state"
    finally:
        agg.shutdown()


# ---- SparsifiedAggregation --------------------------------------------------

def test_sparsified_matches_the_reference_with_error_feedback(broker):
    got = results(members(broker, 3, "sparse"))
    for lines in got:
        assert lines[-1].get("done"), lines[-1]
        assert "calls differ" in lines[-2]["error"], lines[-2]
    steps = [[l for l in lines if "step" in l] for lines in got]
    assert len(steps[0]) == 12
    assert steps[0] == steps[1] == steps[2], "the same bytes on every member"


def read_sparse_log(path):
    try:
        with open(path) as f:
            return [tuple(int(x) for x in l.split()) for l in f.read().splitlines()
                    if len(l.split()) == 3]
    except FileNotFoundError:
        return []


def one_sparse_result_per_call(tmp_path, ids):
    seen = {}
    for i in ids:
        for k, mask, crc in read_sparse_log(tmp_path / (i + ".log")):
            assert seen.setdefault(k, (mask, crc)) == (mask, crc), "call %d has two results" % k
    return seen


def stop_sparse_after(tmp_path, ids, margin=30):
    top = max((read_sparse_log(tmp_path / (i + ".log")) or [(0, 0, 0)])[-1][0] for i in ids)
    (tmp_path / "stop").write_text(str(top + margin))


def join_and_kill(broker, tmp_path, scenario):
    kids = members(broker, 2, scenario, tmp_path)
    wait_until(lambda: len(read_sparse_log(tmp_path / "m-0.log")) >= 10, "the first calls")
    kids += members(broker, 3, scenario, tmp_path, first=2, count=1)
    wait_until(lambda: sum(1 for _, m, _ in read_sparse_log(tmp_path / "m-0.log")
                           if m == 0b111) >= 10, "the calls with the late member")
    late = read_sparse_log(tmp_path / "m-2.log")
    assert late[0][0] > 10, "the late member took the others' numbering: %s" % late[:3]
    os.killpg(kids[1].pid, signal.SIGKILL)
    finish(kids[1])
    wait_until(lambda: sum(1 for _, m, _ in read_sparse_log(tmp_path / "m-0.log")
                           if m == 0b101) >= 5, "the survivors' calls without the killed member")
    stop_sparse_after(tmp_path, ["m-0", "m-2"])
    got = results([kids[0], kids[2]])
    assert got[0][-1]["last"] == got[1][-1]["last"]
    assert got[0][-1]["stats"]["members"] == 2
    seen = one_sparse_result_per_call(tmp_path, ["m-0", "m-1", "m-2"])
    assert sorted(seen) == list(range(1, len(seen) + 1)), "calls numbered from 1, none missing"
    masks = [seen[k][0] for k in sorted(seen)]
    joined, killed = masks.index(0b111), masks.index(0b101)
    assert masks == [0b11] * joined + [0b111] * (killed - joined) + \
        [0b101] * (len(masks) - killed), masks


def test_sparsified_across_a_join_and_a_kill_keeps_one_result_and_exact_residuals(broker,
                                                                                   tmp_path):
    join_and_kill(broker, tmp_path, "sparse_loop")


def test_sparsified_refuses_bad_input(broker):
    agg.init(broker.address, "alone-sparse", "solo")
    try:
        m = torch.nn.Linear(4, 2)
        for p in m.parameters():
            p.grad = torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape)
        for bad in (0, 0.0, -0.5, 1.5, float("nan"), True, "0.1"):
            with pytest.raises(ValueError, match="ratio"):
                agg.SparsifiedAggregation(m, ratio=bad)
        s = agg.SparsifiedAggregation(m, ratio=0.5)
        with pytest.raises(NotImplementedError, match="sums or averages"):
            s.agg_grad()(m, "max")
        with pytest.raises(NotImplementedError, match="not one of"):
            s.agg_grad()(m, "median")
        with pytest.raises(TypeError, match="floating"):
            s._agg(torch.tensor([1, 2]), "sum")
        assert s.residual() is None
        assert m.weight.grad.reshape(-1).tolist() == list(range(8)), "refused calls change nothing"
        # Alone: the top half of the 10 entries is sent, the rest kept.
        s.agg_grad()(m, "avg")
        flat = torch.cat([m.weight.grad.reshape(-1), m.bias.grad])
        assert flat.tolist() == [0, 0, 0, 3, 4, 5, 6, 7, 0, 0], flat.tolist()
        assert s.k() == 5
        assert (s.residual() + flat).tolist() == list(range(8)) + [0, 1]
        # By layer: each layer's own top half (4 of the weight, 1 of the
        # bias), where the model's top 5 took none of the bias.
        for p in m.parameters():
            p.grad = torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape)
        s.agg_grad(by_layer=True)(m, "sum")
        flat = torch.cat([m.weight.grad.reshape(-1), m.bias.grad])
        assert flat.tolist() == [0, 0, 0, 0, 4, 5, 6, 7, 0, 1], flat.tolist()
        assert s.k(("grad", "layers")) == 5
        assert (s.residual(("grad", "layers")) + flat).tolist() == list(range(8)) + [0, 1]
        # The extension refuses segments that cannot be, and a buffer
        # whose length is not the segments' sum.
        g = agg._g()
        for sizes in ([], [4, 0], [0], [-1, 4]):
            with pytest.raises((agg.Error, OverflowError)):
                g.topk_create(sizes, 0.5)
        with pytest.raises(agg.Error):
            g.topk_create([4, 4], 1.5)
        h = g.topk_create([4, 4], 0.5)
        with pytest.raises(ValueError, match="holds 28 bytes, the call needs 32"):
            g.topk_reduce(h, memoryview(bytearray(28)), agg._cohort.OP_SUM, 1000)
        # Reducers are named by index: one never made is refused by name.
        assert g.topk_info(h) == (4, bytes(32))
        with pytest.raises(ValueError, match="no such top-k reducer"):
            g.topk_reduce(h + 1, memoryview(bytearray(32)), agg._cohort.OP_SUM, 1000)
        with pytest.raises(ValueError, match="no such top-k reducer"):
            g.topk_info(h + 1)
    finally:
        agg.shutdown()


# ---- PowerAggregation -------------------------------------------------------

def test_power_matches_the_reference_with_error_feedback(broker):
    got = results(members(broker, 3, "power"))
    for lines in got:
        assert lines[-1].get("done"), lines[-1]
        assert "calls differ" in lines[-2]["error"], lines[-2]
    steps = [[l for l in lines if "step" in l] for lines in got]
    assert len(steps[0]) == 8
    assert steps[0] == steps[1] == steps[2], "the same bytes on every member"


def test_power_across_a_join_and_a_kill_keeps_one_result_per_call(broker, tmp_path):
    join_and_kill(broker, tmp_path, "power_loop")


def test_power_refuses_bad_input(broker):
    agg.init(broker.address, "alone-power", "solo")
    try:
        m = torch.nn.Linear(3, 2)
        for p in m.parameters():
            p.grad = torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) + 1
        for bad in (0, -1, 1025, 1.5, True, "2"):
            with pytest.raises(ValueError, match="rank"):
                agg.PowerAggregation(m, rank=bad)
        with pytest.raises(ValueError, match="world_size"):
            agg.PowerAggregation(m, world_size=0)
        with pytest.raises(ValueError, match="seed"):
            agg.PowerAggregation(m, seed=-1)
        a = agg.PowerAggregation(m, rank=2)
        with pytest.raises(NotImplementedError, match="sums or averages"):
            a.agg_grad()(m, "custom_avg")
        with pytest.raises(TypeError, match="floating"):
            a._agg(torch.ones(2, 2, dtype=torch.int32), "avg")
        assert a.error() is None
        assert m.weight.grad.tolist() == [[1, 2, 3], [4, 5, 6]], "refused calls change nothing"
        # Alone, rank 2 of a 2 x 3 matrix is the matrix; the bias is exact.
        a.agg_grad()(m, "avg")
        assert torch.allclose(m.weight.grad, torch.tensor([[1., 2, 3], [4, 5, 6]]), atol=1e-4)
        assert m.bias.grad.tolist() == [1, 2]
        assert a.error().shape == (8,)
        # The extension's PowerSGD reducers: one 2 x 3 matrix and 2
        # vectors is 8 floats, and a reducer never made is refused.
        g = agg._g()
        h = g.powersgd_create([(2, 3)], 2, 1, 0, True)
        assert g.powersgd_info(h) == (8, bytes(32))
        with pytest.raises(ValueError, match="PowerSGD: the buffer holds 28 bytes, the call needs 32"):
            g.powersgd_reduce(h, memoryview(bytearray(28)), agg._cohort.OP_SUM, 1000)
        with pytest.raises(ValueError, match="no such PowerSGD reducer"):
            g.powersgd_reduce(h + 1, memoryview(bytearray(32)), agg._cohort.OP_SUM, 1000)
        with pytest.raises(ValueError, match="no such PowerSGD reducer"):
            g.powersgd_info(h + 1)
    finally:
        agg.shutdown()

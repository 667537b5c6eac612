"""A member of the aggregation tests (test_py_aggregation.py).

    aggregation_child.py BROKER ID N SCENARIO [DIR]

ID is "m-I": member I of N; every member's inputs are a function of I,
so each member computes the reference of every aggregation itself, in
torch, from all N members' inputs. Inputs are small integers, exact in
every type. Prints one JSON line per result to stdout; exits 1 with the
reason on stderr when a result is wrong.

Scenarios:
  ops       every class, op, by_layer/by_model, gradients/weights
  gossip    DecentralizedAggregation on the path graph 0 - 1 - ... - N-1;
            then the last member leaves and the others' graph is mended to
            the ring of the rest
  loop      once N members are in, SUM calls in a loop until DIR/stop
            names the last call; each
            result's member bits and call numbers are written to
            DIR/ID.log (see test_py_aggregation.py)
  mismatch  a by_model aggregation of a model whose size depends on I,
            then a matching call
  sparse    SparsifiedAggregation, by model (avg) and by layer (sum), each
            result and this member's residuals against a reference of
            every member's top-k with error feedback; then a model of a
            size that depends on I (EPROTO, nothing changed)
  sparse_loop  SparsifiedAggregation by model (sum) in a loop, as loop:
            marker entries 0..3 (2^(10+I)), 4 (the call number) and 5
            (a first call) are always among the top k; DIR/ID.log gets "call mask crc" per
            result, and every residual is checked against this member's
            own reference
  power     PowerAggregation (rank 2, warm start), by model (avg) and by
            layer (sum), each result and this member's error against a
            reference of every member's PowerSGD computed here in float64;
            then a model of a shape that depends on I (EPROTO)
  power_loop  PowerAggregation by model (sum) in a loop, as sparse_loop,
            with the markers in a bias (vectors travel exactly)
"""
import zlib
import errno
import json
import os
import sys
import time

import torch

import cohort.aggregation as agg

broker, my_id, n, scenario = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
me = int(my_id.split("-")[1])
out_dir = sys.argv[5] if len(sys.argv) > 5 else None


def fail(msg):
    sys.stderr.write("%s: %s\n" % (my_id, msg))
    sys.exit(1)


def emit(**kv):
    print(json.dumps(kv), flush=True)


def model(i, salt):
    """A model whose parameters and gradients are small integers that
    depend on member i: float32 and float64 layers."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2, dtype=torch.float64))
    with torch.no_grad():
        for k, p in enumerate(m.parameters()):
            base = torch.arange(p.numel(), dtype=torch.float64).reshape(p.shape)
            p.copy_(((base * 3 + i * 7 + k + salt) % 11) - 5)
            p.grad = (((base * 5 + i * 3 + k * 2 + salt) % 13) - 6).to(p.dtype)
    return m


def reference(vals, op, denom, dtype, divide_before=False):
    """vals: every member's tensor (float64, exact integers)."""
    x = torch.stack(vals)
    if op in ("sum",):
        r = x.sum(0)
    elif op == "min":
        r = x.min(0).values
    elif op == "max":
        r = x.max(0).values
    else:
        d = len(vals) if op == "avg" else denom
        if divide_before:
            # Each share rounded in the type, then summed: the test allows
            # the sum's order a last bit.
            r = (x.to(dtype) / d).to(torch.float64).sum(0)
            return r.to(dtype)
        # The engine sums exactly (small integers) and divides once, in
        # the type's own arithmetic.
        return x.sum(0).to(dtype) / torch.tensor(d, dtype=dtype)
    return r.to(dtype)


def scenario_ops():
    agg.init(broker, "aggr", my_id)
    wait_for_all()
    a_classes = [("AllReduceAggregation", lambda: agg.AllReduceAggregation(n)),
                 ("AllReduceAggregationHVD", lambda: agg.AllReduceAggregationHVD(n)),
                 ("divide_before", lambda: agg.AllReduceAggregation(n, divide_before=True))]
    salt = 0
    for cname, make in a_classes:
        a = make()
        ops = ["avg", "sum", "min", "max", "custom_avg", "avg_world", "avg_custom"]
        if cname == "divide_before":
            ops = ["avg", "custom_avg"]
        for op in ops:
            for by_layer in (False, True):
                for what in ("grad", "model"):
                    salt += 1
                    m = model(me, salt)
                    f = a.agg_grad(by_layer) if what == "grad" else a.agg_model(by_layer)
                    denom = torch.tensor(4.0) if op in ("custom_avg", "avg_custom") else None
                    f(m, op, denom)
                    canon = {"avg_world": "avg", "avg_custom": "custom_avg"}.get(op, op)
                    others = [model(i, salt) for i in range(n)]
                    for k, p in enumerate(m.parameters()):
                        got = p.grad if what == "grad" else p.data
                        vals = [(list(o.parameters())[k].grad if what == "grad"
                                 else list(o.parameters())[k].data).to(torch.float64)
                                for o in others]
                        want = reference(vals, canon, 4.0, got.dtype, cname == "divide_before")
                        tol = 1e-5 if cname == "divide_before" else 0
                        if not torch.allclose(got, want, rtol=0, atol=tol):
                            fail("%s %s by_layer=%s %s tensor %d: got %s, want %s"
                                 % (cname, op, by_layer, what, k, got.tolist(), want.tolist()))
                    emit(cls=cname, op=op, by_layer=by_layer, what=what,
                         digest=[p.grad.tolist() if what == "grad" else p.data.tolist()
                                 for p in m.parameters()])
    emit(done=True, stats=agg.stats())
    agg.shutdown()


def wait_for_all(at_least=False):
    end = time.monotonic() + 60
    while agg.world_size() < n if at_least else agg.world_size() != n:
        if time.monotonic() > end:
            fail("the cohort never had %d members" % n)
        time.sleep(0.05)


def scenario_gossip():
    agg.init(broker, "gossip", my_id)
    wait_for_all()
    graph = {i: [j for j in (i - 1, i + 1) if 0 <= j < n] for i in range(n)}
    d = agg.DecentralizedAggregation(agg.rank(), graph[agg.rank()])
    for by_layer in (False, True):
        m = model(me, 0)
        d.agg_model(by_layer)(m, "avg_world")
        others = [model(i, 0) for i in range(n)]
        for k, p in enumerate(m.parameters()):
            vals = [list(others[j].parameters())[k].data.to(torch.float64)
                    for j in [me] + graph[me]]
            want = (sum(vals) / len(vals)).to(p.dtype)
            if not torch.equal(p.data, want):
                fail("gossip by_layer=%s tensor %d: got %s, want %s"
                     % (by_layer, k, p.data.tolist(), want.tolist()))
    try:
        d._agg(torch.zeros(2), "sum")
        fail("gossip took op sum")
    except NotImplementedError:
        pass
    given = d.neighbors_now()
    if me == n - 1:
        # The last member leaves: its neighbour loses one, and the graph is
        # mended to the ring of the others.
        emit(done=True, neighbors=given)
        agg.shutdown()
        return
    end = time.monotonic() + 60
    while agg.world_size() != n - 1:
        if time.monotonic() > end:
            fail("m-%d never left" % (n - 1))
        time.sleep(0.05)
    mended = d.neighbors_now()
    m = model(me, 1)
    d.agg_model(False)(m, "avg")
    left = n - 1
    ring = sorted({me, (me - 1) % left, (me + 1) % left})
    others = [model(i, 1) for i in range(left)]
    for k, p in enumerate(m.parameters()):
        vals = [list(others[j].parameters())[k].data.to(torch.float64) for j in ring]
        want = (sum(vals) / len(vals)).to(p.dtype)
        if not torch.equal(p.data, want):
            fail("mended gossip tensor %d: got %s, want %s" % (k, p.data.tolist(), want.tolist()))
    emit(done=True, neighbors=given, mended=mended)
    agg.shutdown()


def scenario_loop():
    """Each call all-reduces (sum, float64) [2^I, k, k^2, first]: whose
    inputs the result holds, and that all contributors made the same call
    k (sum k^2 times the contributors = (sum k)^2 only when all k agree).
    A late member learns k from its first result."""
    agg.init(broker, "loop", my_id, call_timeout=120)
    wait_for_all(at_least=True)
    a = agg.AllReduceAggregation(agg.world_size())
    log = open(os.path.join(out_dir, my_id + ".log"), "a", buffering=1)
    stop_file = os.path.join(out_dir, "stop")
    k, first = 0, True
    while True:
        t = torch.tensor([2.0 ** me, k, k * k, 1.0 if first else 0.0], dtype=torch.float64)
        a._agg(t, "sum")
        mask, s1, s2, fresh = (int(v) for v in t.tolist())
        pop = bin(mask).count("1")
        known = pop - fresh
        if first:
            k = s1 // known if known else 1
            if known and (s1 != k * known or s2 != k * k * known):
                fail("first call: the others disagree: %s" % t.tolist())
            first = False
        elif s1 != known * k or s1 * s1 != known * s2:
            fail("call %d: contributors made different calls: %s" % (k, t.tolist()))
        if not mask & (1 << me):
            fail("call %d: its own input is missing" % k)
        log.write("%d %d\n" % (k, mask))
        stop = None
        if os.path.exists(stop_file):
            text = open(stop_file).read().strip()
            stop = int(text) if text else None
        if stop is not None and k >= stop:
            break
        k += 1
        time.sleep(0.02)
    emit(done=True, last=k, stats=agg.stats())
    agg.shutdown()


def scenario_mismatch():
    agg.init(broker, "mismatch", my_id)
    wait_for_all()
    a = agg.AllReduceAggregation(n)
    torch.manual_seed(0)
    m = torch.nn.Linear(4 + me, 2)
    before = [p.data.clone() for p in m.parameters()]
    try:
        a.agg_model(False)(m, "avg")
        fail("a mismatched aggregation succeeded")
    except agg.Error as e:
        if e.errno != errno.EPROTO:
            fail("mismatch raised %r" % (e,))
        emit(error=str(e))
    if not all(torch.equal(b, p.data) for b, p in zip(before, m.parameters())):
        fail("a failed aggregation changed the model")
    # The group stays usable: a matching call completes.
    t = torch.full((3,), float(me + 1))
    a._agg(t, "sum")
    if t.tolist() != [float(n * (n + 1) // 2)] * 3:
        fail("the call after the mismatch: %s" % t.tolist())
    emit(done=True)
    agg.shutdown()


RATIO = 0.25


def sparse_model(i, step):
    """Integer gradients depending on member i and step: float32 and float64
    layers, 68 entries, so k = 17."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 2, dtype=torch.float64))
    with torch.no_grad():
        for k, p in enumerate(m.parameters()):
            base = torch.arange(p.numel(), dtype=torch.float64).reshape(p.shape)
            p.grad = (((base * 7 + i * 5 + k * 3 + step * 11) % 23) - 11).to(p.dtype)
    return m


def flat_grads(m):
    return torch.cat([p.grad.detach().reshape(-1).to(torch.float32) for p in m.parameters()])


def topk_step(acc, k):
    """What a member sends (dense) and keeps: the k largest |acc|, ties to
    the lower index."""
    order = torch.sort(acc.abs(), descending=True, stable=True).indices[:k]
    sent = torch.zeros_like(acc)
    sent[order] = acc[order]
    kept = acc.clone()
    kept[order] = 0
    return sent, kept


def scenario_sparse():
    agg.init(broker, "sparse", my_id)
    wait_for_all()
    s = agg.SparsifiedAggregation(sparse_model(me, 0), ratio=RATIO)
    res = {i: torch.zeros(68) for i in range(n)}
    layer_res = {}
    step = 0
    for by_layer, op in ((False, "avg"), (False, "avg_world"), (True, "sum"), (False, "avg")):
        for _ in range(3):
            step += 1
            m = sparse_model(me, step)
            s.agg_grad(by_layer)(m, op)
            got = flat_grads(m)
            models = [sparse_model(i, step) for i in range(n)]
            if not by_layer:
                total = torch.zeros(68)
                for i in range(n):
                    sent, res[i] = topk_step(flat_grads(models[i]) + res[i], 17)
                    total += sent
                want = total / n if op != "sum" else total
                mine = s.residual()
                if not torch.equal(mine, res[me]):
                    fail("step %d: residual %s, want %s" % (step, mine.tolist(),
                                                            res[me].tolist()))
            else:
                # One call: each layer's own top k_i, one residual over
                # the layers packed in order.
                parts, kept, ks = [], [], 0
                for k, p in enumerate(m.parameters()):
                    total = torch.zeros(p.numel())
                    kk = -(-p.numel() // 4)
                    ks += kk
                    for i in range(n):
                        g = list(models[i].parameters())[k].grad.reshape(-1).to(torch.float32)
                        r = layer_res.get((i, k), torch.zeros(p.numel()))
                        sent, layer_res[(i, k)] = topk_step(g + r, kk)
                        total += sent
                    parts.append(total)
                    kept.append(layer_res[(me, k)])
                if s.k(("grad", "layers")) != ks:
                    fail("by layer: k %s, want %d" % (s.k(("grad", "layers")), ks))
                if not torch.equal(s.residual(("grad", "layers")), torch.cat(kept)):
                    fail("by layer: the residual differs")
                want = torch.cat(parts)
            if not torch.equal(got, want):
                fail("step %d by_layer=%s %s: got %s, want %s"
                     % (step, by_layer, op, got.tolist(), want.tolist()))
            emit(step=step, crc=zlib.crc32(got.numpy().tobytes()))
    # Members whose models differ: every member fails, nothing changes.
    torch.manual_seed(0)
    odd = torch.nn.Linear(4 + me, 2)
    for p in odd.parameters():
        p.grad = torch.ones_like(p)
    try:
        agg.SparsifiedAggregation(odd, ratio=RATIO).agg_grad()(odd, "avg")
        fail("a mismatched top-k succeeded")
    except agg.Error as e:
        if e.errno != errno.EPROTO:
            fail("mismatch raised %r" % (e,))
        emit(error=str(e))
    if not all(torch.equal(p.grad, torch.ones_like(p)) for p in odd.parameters()):
        fail("a failed top-k changed the gradients")
    emit(done=True, stats=agg.stats())
    agg.shutdown()


def scenario_sparse_loop():
    agg.init(broker, "sparse-loop", my_id, call_timeout=120)
    wait_for_all(at_least=True)
    s = agg.SparsifiedAggregation(sparse_model(me, 0), ratio=RATIO)
    log = open(os.path.join(out_dir, my_id + ".log"), "a", buffering=1)
    stop_file = os.path.join(out_dir, "stop")
    res = torch.zeros(68)
    k, first, step = 0, True, 0
    while True:
        step += 1
        m = sparse_model(me, step)
        first_layer = next(iter(m.parameters()))
        with torch.no_grad():
            g = first_layer.grad.view(-1)
            g[0:6] = 0
            g[me] = 2.0 ** (10 + me)
            g[4] = 100000 + k
            g[5] = 50000 if first else 0
        given = flat_grads(m)
        s.agg_grad(False)(m, "sum")
        got = flat_grads(m)
        mask = 0
        for j in range(4):
            if got[j] == 2.0 ** (10 + j):
                mask |= 1 << j
            elif got[j] != 0:
                fail("marker %d: %s" % (j, got[j].item()))
        pop = bin(mask).count("1")
        fresh = int(got[5].item()) // 50000
        known = pop - fresh
        c = int(got[4].item()) - 100000 * pop
        if first:
            # Its own number was 0; the others' is the rest of the sum
            # (none: every member is new, and this is call 1).
            k = c // known if known else 1
            if known and c != k * known:
                fail("first call: the others disagree: %s" % got[:6].tolist())
            first = False
        elif c != k * known:
            fail("call %d: contributors made different calls: %s" % (k, got[:6].tolist()))
        if mask & (1 << me):
            _, res = topk_step(given + res, 17)
        else:
            res = given + res   # completed without this member: nothing sent
        if not torch.equal(s.residual(), res):
            fail("call %d: the residual is not this member's own unsent gradient" % k)
        log.write("%d %d %d\n" % (k, mask, zlib.crc32(got.numpy().tobytes())))
        stop = None
        if os.path.exists(stop_file):
            text = open(stop_file).read().strip()
            stop = int(text) if text else None
        if stop is not None and k >= stop:
            break
        k += 1
        time.sleep(0.02)
    emit(done=True, last=k, stats=agg.stats())
    agg.shutdown()


M64 = (1 << 64) - 1


def seeded_q(seed, count):
    """cohort's seeded Q: splitmix64, uniform in [-1, 1), as the C code."""
    out, state = [], seed
    for _ in range(count):
        state = (state + 0x9e3779b97f4a7c15) & M64
        z = state
        z = ((z ^ (z >> 30)) * 0xbf58476d1ce4e5b9) & M64
        z = ((z ^ (z >> 27)) * 0x94d049bb133111eb) & M64
        z ^= z >> 31
        out.append(float((z >> 40) / float(1 << 23) - 1.0))
    return torch.tensor(out, dtype=torch.float64)


def orthonormalise(p):
    p = p.clone()
    for c in range(p.shape[1]):
        p[:, c] /= p[:, c].norm() + 1e-8
        for d in range(c + 1, p.shape[1]):
            p[:, d] -= (p[:, c] * p[:, d]).sum() * p[:, c]
    return p


class PowerRef:
    """Every member's PowerSGD of one reducer (matrices, then vectors)."""

    def __init__(self, shapes, n_vec, rank, seed, members):
        self.shapes, self.n_vec = shapes, n_vec
        self.r = [min(rank, a, b) for a, b in shapes]
        nq = sum(b * r for (a, b), r in zip(shapes, self.r))
        q = seeded_q(seed, nq + n_vec)
        self.q, off = [], 0
        for (a, b), r in zip(shapes, self.r):
            self.q.append(q[off:off + r * b].reshape(r, b).t().clone())   # cols x r
            off += r * b
        size = sum(a * b for a, b in shapes) + n_vec
        self.err = {i: torch.zeros(size, dtype=torch.float64) for i in members}

    def step(self, inputs, avg):
        """inputs: member -> flat float64; returns the flat result."""
        n = len(inputs)
        mp = {i: x + self.err[i] for i, x in inputs.items()}
        out, off = [], 0
        for k, ((a, b), r) in enumerate(zip(self.shapes, self.r)):
            ms = {i: v[off:off + a * b].reshape(a, b) for i, v in mp.items()}
            p = orthonormalise(sum(m @ self.q[k] for m in ms.values()))
            own = {i: m.t() @ p for i, m in ms.items()}
            q = sum(own.values()) / (n if avg else 1)
            out.append((p @ q.t()).reshape(-1))
            for i, m in ms.items():
                self.err[i][off:off + a * b] = (m - p @ own[i].t()).reshape(-1)
            self.q[k] = q
            off += a * b
        vec = sum(v[off:] for v in mp.values()) / (n if avg else 1)
        for i in mp:
            self.err[i][off:] = 0
        out.append(vec)
        return torch.cat(out)


def power_model(i, step):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 4))
    with torch.no_grad():
        for k, p in enumerate(m.parameters()):
            base = torch.arange(p.numel(), dtype=torch.float64).reshape(p.shape)
            p.grad = (((base * 7 + i * 5 + k * 3 + step * 11) % 23) - 11).to(p.dtype)
    return m


def power_flat(m):
    """Matrices first, then vectors: the reducer's order."""
    ps = list(m.parameters())
    order = [p for p in ps if p.dim() > 1] + [p for p in ps if p.dim() <= 1]
    return torch.cat([p.grad.detach().reshape(-1).to(torch.float64) for p in order])


def close(got, want):
    return torch.allclose(got.to(torch.float64), want, rtol=0,
                          atol=1e-4 * (1 + want.abs().max().item()))


def scenario_power():
    agg.init(broker, "power", my_id)
    wait_for_all()
    a = agg.PowerAggregation(power_model(me, 0), reuse_query=True, world_size=n, rank=2)
    ref = PowerRef([(6, 8), (4, 6)], 10, 2, 1, range(n))
    layer_ref = None
    step = 0
    for by_layer, op in ((False, "avg"), (False, "avg_world"), (True, "sum"), (False, "avg")):
        for _ in range(2):
            step += 1
            m = power_model(me, step)
            a.agg_grad(by_layer)(m, op)
            avg = op != "sum"
            models = [power_model(i, step) for i in range(n)]
            if not by_layer:
                got = power_flat(m)
                want = ref.step({i: power_flat(models[i]) for i in range(n)}, avg)
                if not close(a.error(), ref.err[me]):
                    fail("step %d: error %s, want %s" % (step, a.error().tolist(),
                                                         ref.err[me].tolist()))
            else:
                # The same math as by model, in one call, with an error
                # and a warm start of its own.
                if layer_ref is None:
                    layer_ref = PowerRef([(6, 8), (4, 6)], 10, 2, 1, range(n))
                got = power_flat(m)
                want = layer_ref.step({i: power_flat(models[i]) for i in range(n)}, avg)
                if not close(a.error(("grad", "layers")), layer_ref.err[me]):
                    fail("step %d by layer: the error differs" % step)
            if not close(got, want):
                fail("step %d by_layer=%s %s: got %s, want %s"
                     % (step, by_layer, op, got.tolist(), want.tolist()))
            emit(step=step, crc=zlib.crc32(got.to(torch.float32).numpy().tobytes()))
    torch.manual_seed(0)
    odd = torch.nn.Linear(4 + me, 2)
    for p in odd.parameters():
        p.grad = torch.ones_like(p)
    try:
        agg.PowerAggregation(odd, rank=1).agg_grad()(odd, "avg")
        fail("a mismatched PowerSGD succeeded")
    except agg.Error as e:
        if e.errno != errno.EPROTO:
            fail("mismatch raised %r" % (e,))
        emit(error=str(e))
    if not all(torch.equal(p.grad, torch.ones_like(p)) for p in odd.parameters()):
        fail("a failed PowerSGD changed the gradients")
    emit(done=True, stats=agg.stats())
    agg.shutdown()


def scenario_power_loop():
    agg.init(broker, "power-loop", my_id, call_timeout=120)
    wait_for_all(at_least=True)
    a = agg.PowerAggregation(power_model(me, 0), reuse_query=True, rank=2)
    log = open(os.path.join(out_dir, my_id + ".log"), "a", buffering=1)
    stop_file = os.path.join(out_dir, "stop")
    k, first, step = 0, True, 0
    while True:
        step += 1
        m = power_model(me, step)
        bias = m[0].bias.grad
        with torch.no_grad():
            bias.zero_()
            bias[me] = 2.0 ** me
            bias[4] = k
            bias[5] = 1 if first else 0
        a.agg_grad(False)(m, "sum")
        b = [int(v) for v in m[0].bias.grad.tolist()]
        mask, c, fresh = b[0] | b[1] | b[2] | b[3], b[4], b[5]
        if any(b[j] not in (0, 2 ** j) for j in range(4)):
            fail("markers: %s" % b)
        known = bin(mask).count("1") - fresh
        if first:
            k = c // known if known else 1
            if known and c != k * known:
                fail("first call: the others disagree: %s" % b)
            first = False
        elif c != k * known:
            fail("call %d: contributors made different calls: %s" % (k, b))
        got = power_flat(m).to(torch.float32)
        log.write("%d %d %d\n" % (k, mask, zlib.crc32(got.numpy().tobytes())))
        stop = None
        if os.path.exists(stop_file):
            text = open(stop_file).read().strip()
            stop = int(text) if text else None
        if stop is not None and k >= stop:
            break
        k += 1
        time.sleep(0.02)
    emit(done=True, last=k, stats=agg.stats())
    agg.shutdown()


{"ops": scenario_ops, "gossip": scenario_gossip, "loop": scenario_loop,
 "mismatch": scenario_mismatch, "sparse": scenario_sparse,
 "sparse_loop": scenario_sparse_loop, "power": scenario_power,
 "power_loop": scenario_power_loop}[scenario]()

"""PowerSGD by tensor shape with a real torch model: two trainers, in
process and through sidecars, back-propagate the same input with targets
of their own through two Linear layers, so each layer's mean gradient
has rank 1. At powersgd:1 the Accumulator's own parameter shapes make
every weight come back to float tolerance and every bias exactly, the
same bytes on both members; the whole-buffer view (one matrix of the
110,450 gradients), run next in the same cohort, does not."""
import pytest

from pyproc import run_pair, sidecar_pair


def check_pair(address_of):
    rounds = run_pair("psgd_shape_child.py", address_of)
    assert [r["view"] for r in rounds[0]] == ["shape"] * 3 + ["whole"]
    for k, r in enumerate(rounds[0][:3]):
        assert r["shapes"] == [[200, 300], [200], [250, 200], [250]], r
        w1, b1, w2, b2 = r["rel"]
        # Rank 1 per layer: reproduced. The first round to float32
        # rounding; later ones carry each member's error, as large as its
        # own gradient though the members' errors cancel in the sum, so
        # the rounding of that cancellation too (still 100 times below
        # what the whole-buffer view gets wrong, below).
        tol = 1e-5 if k == 0 else 1e-2
        assert w1 < tol and w2 < tol, [x["rel"] for x in rounds[0]]
        assert not r["plain"][0] and not r["plain"][2], r   # ...by PowerSGD, not uncompressed
        assert r["plain"][1] and r["plain"][3], r           # biases: uncompressed, exact
    whole = rounds[0][3]
    assert max(whole["rel"]) > 0.5, whole                   # one matrix of every layer: not rank 1


def test_powersgd_by_shape_in_process(broker):
    check_pair(lambda i: broker.address)


def test_powersgd_by_shape_through_sidecars(broker, tmp_path):
    with sidecar_pair(broker, tmp_path, "shape", "--compression", "powersgd:1") as (address_of,
                                                                                    sidecars):
        check_pair(address_of)
    for s in sidecars:
        assert not any("different tensor layouts" in l for l in s.raw)


def test_accumulator_refuses_bad_shapes():
    import torch
    import cohort
    acc = cohort.Accumulator("shape", [torch.nn.Parameter(torch.zeros(4, 3)),
                                       torch.nn.Parameter(torch.zeros(5))])
    try:
        assert acc._shapes == [(0, 12, 4, 3), (12, 5, 5, 1)]
        for bad in ([(0, 12, 4, 4)],                   # count is not rows x cols
                    [(0, 12, 4, 3), (11, 5, 5, 1)],    # overlap
                    [(12, 6, 6, 1)],                   # past the end
                    [(0, 0, 0, 0)]):
            with pytest.raises(cohort.Error) as e:
                acc.set_tensor_shapes(bad)
            assert e.value.errno == 22, bad
            assert acc._shapes == [(0, 12, 4, 3), (12, 5, 5, 1)]    # unchanged
        with pytest.raises(TypeError):
            acc.set_tensor_shapes([(0, 12, 4)])
        with pytest.raises(ValueError):
            acc.set_tensor_shapes([(i, 1, 1, 1) for i in range(65537)])
        assert acc._shapes == [(0, 12, 4, 3), (12, 5, 5, 1)]
        acc.set_tensor_shapes([])                      # the whole-buffer view
        assert acc._shapes == []
        acc.set_tensor_shapes()
        assert acc._shapes == [(0, 12, 4, 3), (12, 5, 5, 1)]
    finally:
        acc.close()

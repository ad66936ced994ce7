import math

import pytest
import torch
from conftest import DTYPES, SHAPES, make_tensors

from mixprec import kernels as K


def _torch_unscale(ts, inv):
    found = torch.zeros(1)
    torch._amp_foreach_non_finite_check_and_unscale_(ts, found, inv)
    return found


@pytest.mark.parametrize("dtype", DTYPES)
def test_unscale_bitwise_equal_to_torch(dtype):
    ts = make_tensors(dtype, scale=1000.0)
    ref = [t.clone() for t in ts]
    inv = torch.tensor([1.0 / 65536 * 3])  # not a power of two: rounding happens
    found = torch.zeros(1)
    K.unscale_and_check_(ts, found, inv)
    assert _torch_unscale(ref, inv).item() == 0.0
    assert found.item() == 0.0
    for a, b in zip(ts, ref):
        assert torch.equal(a.view(torch.int16 if dtype != torch.float32 else torch.int32),
                           b.view(torch.int16 if dtype != torch.float32 else torch.int32))


def test_unscale_mixed_dtypes_and_big(big_shapes):
    ts = [torch.randn(s).to(d) for s, d in zip(big_shapes, [torch.float32, torch.bfloat16,
                                                             torch.float16, torch.float32])]
    ref = [t.clone() for t in ts]
    inv = torch.tensor([0.37])
    found = torch.zeros(1)
    K.unscale_and_check_(ts, found, inv)
    _torch_unscale(ref, inv)
    assert found.item() == 0.0
    assert all(torch.equal(a, b) for a, b in zip(ts, ref))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("where", [(6, 70000), (3, 0), (0, 0)])  # big tensor, tail, size-1
def test_unscale_detects_non_finite(dtype, bad, where):
    shapes = [(1,), (7,), (5, 3), (9,), (13,), (8,), (2, 70001)]
    ts = make_tensors(dtype, shapes)
    ti, ei = where
    ts[ti].view(-1)[ei] = bad
    ref = [t.clone() for t in ts]
    found = torch.zeros(1)
    K.unscale_and_check_(ts, found, torch.tensor([0.5]))
    assert found.item() == 1.0
    assert _torch_unscale(ref, torch.tensor([0.5])).item() == 1.0
    for a, b in zip(ts, ref):  # the values are still unscaled, like torch
        assert torch.equal(a.nan_to_num(), b.nan_to_num())


def test_unscale_keeps_found_inf_set():
    found = torch.ones(1)
    K.unscale_and_check_(make_tensors(torch.float32), found, torch.tensor([1.0]))
    assert found.item() == 1.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_l2_norm_matches_double_reference(dtype):
    ts = make_tensors(dtype)
    ref = torch.linalg.vector_norm(torch.cat([t.double().reshape(-1) for t in ts]))
    found = torch.zeros(1)
    out = K.l2_norm(ts, found)
    assert out.dtype == torch.float32 and out.dim() == 0
    assert out.item() == pytest.approx(ref.item(), rel=1e-5)
    assert found.item() == 0.0


def test_l2_norm_big_and_deterministic_across_threads(big_shapes):
    ts = [torch.randn(s) for s in big_shapes]
    ref = torch.linalg.vector_norm(torch.cat([t.double().reshape(-1) for t in ts]))
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = K.l2_norm(ts)
    finally:
        torch.set_num_threads(n)
    many = K.l2_norm(ts)
    assert torch.equal(one, many)
    assert many.item() == pytest.approx(ref.item(), rel=1e-6)


@pytest.mark.parametrize("bad", [math.inf, math.nan, 1e30])  # 1e30**2 overflows fp32
def test_l2_norm_flags_non_finite(bad):
    ts = make_tensors(torch.float32, [(5,), (70001,), (3,)])
    ts[1][12345] = bad
    found = torch.zeros(1)
    out = K.l2_norm(ts, found)
    assert not math.isfinite(out.item())
    assert found.item() == 1.0


def test_l2_norm_empty():
    assert K.l2_norm([]).item() == 0.0
    assert K.l2_norm([torch.empty(0)]).item() == 0.0


def test_errors_name_index_and_property():
    ts = [torch.randn(4), torch.randn(4, 4).t()]
    with pytest.raises(ValueError, match=r"tensors\[1\] is not contiguous"):
        K.unscale_and_check_(ts, torch.zeros(1), torch.ones(1))
    with pytest.raises(TypeError, match=r"tensors\[0\] has dtype Double"):
        K.l2_norm([torch.randn(3, dtype=torch.float64)])
    with pytest.raises(TypeError, match="found_inf must be float32"):
        K.unscale_and_check_([torch.randn(3)], torch.zeros(1, dtype=torch.float64),
                             torch.ones(1))
    with pytest.raises(ValueError, match="inv_scale must have exactly one element"):
        K.unscale_and_check_([torch.randn(3)], torch.zeros(1), torch.ones(2))
    with pytest.raises(ValueError, match=r"tensors\[1\] is on meta"):
        K.l2_norm([torch.randn(3), torch.empty(3, device="meta")])

import pytest
import torch
from conftest import DTYPES, SHAPES, make_tensors

from mixprec import kernels as K


def _bits(t):
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


def assert_same_bits(a, b):
    """Bitwise equal, except that NaN payloads may differ: torch's own bf16 cast
    gives 0xFFFF in its AVX code and 0x7FC0 in its scalar tail; we always give 0x7FC0."""
    nan = a.isnan()
    assert torch.equal(nan, b.isnan())
    assert torch.equal(_bits(a)[~nan], _bits(b)[~nan])


@pytest.mark.parametrize("src_dtype", DTYPES)
@pytest.mark.parametrize("dst_dtype", DTYPES)
def test_copy_cast_matches_copy_(src_dtype, dst_dtype):
    srcs = make_tensors(src_dtype, scale=300.0)
    srcs[5].view(-1)[3] = float("nan")
    srcs[6].view(-1)[-1] = float("inf")
    srcs[7].view(-1)[0] = 1e-40  # fp32 subnormal
    dsts = [torch.empty(s.shape, dtype=dst_dtype) for s in srcs]
    K.copy_cast_(dsts, srcs)
    for d, s in zip(dsts, srcs):
        assert_same_bits(d, torch.empty_like(d).copy_(s))


def test_copy_cast_ties_round_to_even():
    # 1 + 2^-8 lies halfway between two bf16 values: even mantissa wins.
    src = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8)], dtype=torch.float32)
    dst = torch.empty(3, dtype=torch.bfloat16)
    K.copy_cast_([dst], [src])
    assert dst.float().tolist() == [1.0, 1 + 4 * 2**-8, -1.0]


@pytest.mark.parametrize("flat_dtype", DTYPES)
def test_flat_copy_round_trip(flat_dtype):
    srcs = make_tensors(torch.float32)
    total = sum(s.numel() for s in srcs)
    flat = torch.empty(total, dtype=flat_dtype)
    K.flat_copy_in_(flat, srcs)
    ref = torch.cat([s.reshape(-1) for s in srcs]).to(flat_dtype)
    assert torch.equal(_bits(flat), _bits(ref))
    outs = [torch.empty(s.shape, dtype=torch.float32) for s in srcs]
    K.flat_copy_out_(outs, flat)
    for o, s in zip(outs, srcs):
        assert torch.equal(o, s.to(flat_dtype).float())


def test_flat_copy_big(big_shapes):
    srcs = [torch.randn(s) for s in big_shapes]
    flat = torch.empty(sum(s.numel() for s in srcs), dtype=torch.bfloat16)
    K.flat_copy_in_(flat, srcs)
    assert torch.equal(flat, torch.cat([s.reshape(-1) for s in srcs]).bfloat16())


def test_copy_errors():
    with pytest.raises(ValueError, match=r"srcs\[1\] has 5 elements but dsts\[1\] has 4"):
        K.copy_cast_([torch.empty(3), torch.empty(4)], [torch.empty(3), torch.empty(5)])
    with pytest.raises(ValueError, match="srcs has 1 tensors but dsts has 2"):
        K.copy_cast_([torch.empty(3), torch.empty(4)], [torch.empty(3)])
    with pytest.raises(ValueError, match=r"flat has 10 elements but the 2 srcs hold 7"):
        K.flat_copy_in_(torch.empty(10), [torch.empty(3), torch.empty(4)])
    with pytest.raises(ValueError, match="flat must be 1-D"):
        K.flat_copy_out_([torch.empty(4)], torch.empty(2, 2))
    with pytest.raises(ValueError, match=r"dsts\[0\] is not contiguous"):
        K.flat_copy_out_([torch.empty(4, 4)[:, :2]], torch.empty(8))
    with pytest.raises(TypeError, match=r"srcs\[0\] has dtype Int"):
        K.copy_cast_([torch.empty(3)], [torch.zeros(3, dtype=torch.int32)])

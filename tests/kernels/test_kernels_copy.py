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


# ---- scale_copy_and_check_ (the ddp Reducer's copy into its buckets) -----------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("in_place", [False, True])
def test_scale_copy_and_check_bitwise_equal_to_mul(dtype, in_place):
    g = torch.Generator().manual_seed(0)
    srcs = [torch.randn(n, generator=g).to(dtype) for n in (1, 7, 65536 + 3, 200_000)]
    dsts = srcs if in_place else [torch.full_like(s, 7.0) for s in srcs]
    ref = [s.mul(1.0 / 3) for s in srcs]  # at::mul with a Python float, as the Reducer did
    found = torch.zeros(1)
    K.scale_copy_and_check_(dsts, srcs, found, torch.tensor([1.0 / 3]))
    assert found.item() == 0.0
    assert all(torch.equal(d, r) for d, r in zip(dsts, ref))


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_scale_copy_and_check_flags_nonfinite_anywhere(bad):
    for where in (0, 5, 70_000, 199_999):
        src = torch.randn(200_000)
        src[where] = bad
        dst = torch.empty_like(src)
        found = torch.zeros(1)
        K.scale_copy_and_check_([dst], [src], found, torch.tensor([0.5]))
        assert found.item() == 1.0, where


def test_scale_copy_and_check_refuses_mixed_dtypes():
    with pytest.raises(ValueError, match="same dtype"):
        K.scale_copy_and_check_([torch.zeros(4)], [torch.zeros(4, dtype=torch.bfloat16)],
                                torch.zeros(1), torch.ones(1))

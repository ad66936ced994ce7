"""CPU kernels run calls below the work threshold inline, at any thread count, and larger
calls in one parallel region with the same results ([Note: inline below the parallel
threshold] in csrc/kernels/cpu/launcher.h). _C._cpu_parallel_regions counts the regions
the launcher opens."""

import pytest
import torch

from mixprec import _C
from mixprec import kernels as K

ADAMW = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=3.0, decoupled=True,
             maximize=False)
SGD = dict(lr=1e-2, momentum=0.9, dampening=0.0, nesterov=False, weight_decay=0.0, maximize=False)


@pytest.fixture
def threads():
    """Sets torch's intra-op thread count for the test, restored afterwards."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _many_small():
    """1,536 tensors, 2.05M elements: the parameters of 128 blocks of 12 small tensors."""
    d = 36
    block = [(d, 3 * d), (3 * d,), (d, d), (d,), (d, 4 * d), (4 * d,), (4 * d, d)]
    block += [(d,)] * 5
    return block * 128


def _run_every_op(shapes):
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=g) for s in shapes]
    grads = [torch.randn(s, generator=g) for s in shapes]
    m = [torch.zeros(s) for s in shapes]
    v = [torch.zeros(s) for s in shapes]
    lowp = [p.bfloat16() for p in params]
    found, scale = torch.zeros(1), torch.tensor([0.5])
    K.unscale_and_check_(grads, found, scale)
    K.l2_norm(grads, found)
    K.fused_adam_(params, grads, m, v, lowp, inv_scale=scale, found_inf=found, **ADAMW)
    K.fused_sgd_(params, grads, m, lowp, first_step=False, inv_scale=scale, found_inf=found, **SGD)
    K.copy_cast_(lowp, params)
    K.scale_copy_and_check_(v, grads, found, scale)
    flat = torch.empty(sum(p.numel() for p in params))
    K.flat_copy_in_(flat, params)
    K.flat_copy_out_(params, flat)
    assert found.item() == 0.0


@pytest.mark.parametrize("n_threads", [2, 4])
@pytest.mark.parametrize("layout", ["4x16k", "1536 tensors"])
def test_small_calls_open_no_parallel_region(threads, n_threads, layout):
    """4 x 16K elements opened a region at 2 threads before (65,536 > ATen's grain of
    32,768), and a call waited for the second thread when its core was busy (issue #38)."""
    threads(n_threads)
    before = _C._cpu_parallel_regions()
    _run_every_op([(16384,)] * 4 if layout == "4x16k" else _many_small())
    assert _C._cpu_parallel_regions() == before


def test_large_call_splits_and_matches_inline(threads):
    """A norm over more bytes than the threshold opens one region at 2 threads, none at 1,
    and gives the same bits either way (fixed chunks, partials added in chunk order)."""
    n = _C._cpu_parallel_min_bytes // 4 + 70001  # fp32, read once: just over the threshold
    g = torch.Generator().manual_seed(1)
    ts = [torch.empty(n).uniform_(-0.5, 0.5, generator=g), torch.randn(3, 5, generator=g),
          torch.randn(65537, generator=g)]
    ref = sum(torch.linalg.vector_norm(t, dtype=torch.float64) ** 2 for t in ts) ** 0.5

    threads(1)
    before = _C._cpu_parallel_regions()
    one = K.l2_norm(ts)
    assert _C._cpu_parallel_regions() == before

    threads(2)
    two = K.l2_norm(ts)
    assert _C._cpu_parallel_regions() == before + 1
    assert torch.equal(one, two)
    assert two.item() == pytest.approx(ref.item(), rel=1e-6)

    # Just under the threshold: inline at 2 threads as well.
    small = [ts[0][: _C._cpu_parallel_min_bytes // 4 - 1]]
    K.l2_norm(small)
    assert _C._cpu_parallel_regions() == before + 1

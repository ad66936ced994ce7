"""CUDA kernels against the CPU kernels / torch (skipped without a GPU).

The CUDA kernels use explicitly rounded intrinsics in the same op order as
the CPU kernels, so SGD, unscale and copies are bitwise equal to the CPU path;
Adam too (both use IEEE sqrt and division).
"""

import pytest
import torch

from mixprec import _C
from mixprec import kernels as K

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SHAPES = [(1,), (7,), (33, 17), (65537,), (3, 400000)] + [(5,)] * 30


def _pair(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    cpu = [torch.randn(s, generator=g).to(dtype) for s in SHAPES]
    return cpu, [t.cuda() for t in cpu]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_unscale_matches_cpu(dtype):
    cpu, gpu = _pair(dtype)
    gpu[4][1, 12345] = float("inf")
    fc, fg = torch.zeros(1), torch.zeros(1, device="cuda")
    K.unscale_and_check_(cpu, fc, torch.tensor([0.3]))
    K.unscale_and_check_(gpu, fg, torch.tensor([0.3], device="cuda"))
    assert fg.item() == 1.0 and fc.item() == 0.0
    for c, g in zip(cpu, gpu):
        g = g.cpu()
        finite = g.isfinite()
        assert torch.equal(c[finite], g[finite])


def test_cuda_l2_norm_close_to_cpu():
    cpu, gpu = _pair()
    torch.testing.assert_close(K.l2_norm(gpu).cpu(), K.l2_norm(cpu), rtol=1e-5, atol=0)


@pytest.mark.parametrize("decoupled", [True, False])
def test_cuda_adam_matches_cpu(decoupled):
    cpu, gpu = _pair()
    gc, gg = _pair(torch.bfloat16, seed=1)
    state_c = [[torch.zeros_like(t) for t in cpu] for _ in range(2)]
    state_g = [[torch.zeros_like(t) for t in gpu] for _ in range(2)]
    lp_c = [torch.empty_like(t, dtype=torch.bfloat16) for t in cpu]
    lp_g = [torch.empty_like(t, dtype=torch.bfloat16) for t in gpu]
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=3.0,
              decoupled=decoupled, maximize=False)
    K.fused_adam_(cpu, gc, *state_c, lp_c, inv_scale=torch.tensor([0.5]), found_inf=None, **kw)
    K.fused_adam_(gpu, gg, *state_g, lp_g, inv_scale=torch.tensor([0.5], device="cuda"),
                  found_inf=torch.zeros(1, device="cuda"), **kw)
    for a, b in zip(cpu + lp_c + state_c[0], gpu + lp_g + state_g[0]):
        assert torch.equal(a, b.cpu())


def test_cuda_found_inf_skips_on_device():
    _, gpu = _pair()
    before = [t.clone() for t in gpu]
    K.fused_sgd_(gpu, gpu, [], [], lr=0.1, momentum=0.0, dampening=0.0, nesterov=False,
                 weight_decay=0.0, maximize=False, first_step=True, inv_scale=None,
                 found_inf=torch.ones(1, device="cuda"))
    assert all(torch.equal(a, b) for a, b in zip(before, gpu))


def test_cuda_copy_and_flat():
    cpu, gpu = _pair()
    dst = [torch.empty_like(t, dtype=torch.bfloat16) for t in gpu]
    K.copy_cast_(dst, gpu)
    assert all(torch.equal(d.cpu(), c.bfloat16()) for d, c in zip(dst, cpu))
    flat = torch.empty(sum(t.numel() for t in gpu), dtype=torch.float16, device="cuda")
    K.flat_copy_in_(flat, gpu)
    assert torch.equal(flat.cpu(), torch.cat([c.reshape(-1) for c in cpu]).half())
    assert _C.build_info()["cuda"]


@pytest.mark.parametrize("flag_shape", [(1,), ()])
def test_cuda_adam_device_counters_take_scaler_flags(flag_shape):
    # The scalers' found_inf is shape [1] (issue #23, G1): counters advance on the device,
    # by 0 when the step is skipped, and the step matches the CPU kernel.
    cpu, gpu = _pair()
    gc, gg = _pair(seed=1)
    state_c = [[torch.zeros_like(t) for t in cpu] for _ in range(2)]
    state_g = [[torch.zeros_like(t) for t in gpu] for _ in range(2)]
    steps_c = [torch.tensor([2.0]) for _ in cpu]
    steps_g = [s.cuda() for s in steps_c]
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=True,
              maximize=False)
    before = [t.clone() for t in gpu]
    _C.fused_adam_(gpu, gg, *state_g, [], steps=steps_g,
                   found_inf=torch.ones(flag_shape, device="cuda"), **kw)
    assert all(torch.equal(a, b) for a, b in zip(before, gpu))
    assert all(s.item() == 2.0 for s in steps_g)
    _C.fused_adam_(cpu, gc, *state_c, [], steps=steps_c, found_inf=torch.zeros(flag_shape), **kw)
    _C.fused_adam_(gpu, gg, *state_g, [], steps=steps_g,
                   found_inf=torch.zeros(flag_shape, device="cuda"), **kw)
    assert all(s.item() == 3.0 for s in steps_g + steps_c)
    # Bias corrections: host pow (CPU) vs device pow (CUDA) from the same counter value.
    for a, b in zip(cpu + state_c[0] + state_c[1], gpu + state_g[0] + state_g[1]):
        torch.testing.assert_close(b.cpu(), a)


def test_cuda_l2_norm_flags_nonfinite():
    _, gpu = _pair()
    gpu[2][0, 0] = float("nan")
    flag = torch.zeros(1, device="cuda")
    norm = K.l2_norm(gpu, flag)
    assert norm.dim() == 0 and norm.dtype == torch.float32 and norm.is_cuda
    assert flag.item() == 1.0


def test_step_result_event_is_recorded_on_the_tensors_device_stream():
    """G10: the snapshot's event goes on the current stream of the device holding the
    values (src/mixprec/step.py), not on the host thread's current device's stream. With
    two GPUs the host's current device is made the other one (what the old code recorded
    on); with one the stream is still a side stream, which the event must follow."""
    import contextlib

    from mixprec.step import DeviceScalars, StepResult

    device = torch.device("cuda", torch.cuda.device_count() - 1)
    other = torch.cuda.device(0) if device.index > 0 else contextlib.nullcontext()
    side = torch.cuda.Stream(device)
    with torch.cuda.stream(side):  # side is cuda:N's current stream from here
        found = torch.zeros(1, device=device)
        torch.cuda._sleep(200_000_000)  # keep `side` busy: the copy queued behind it must wait
        found.fill_(1.0)
        scale = torch.full((1,), 8.0, device=device)
        with other:
            values = DeviceScalars({"found_inf": found, "loss_scale": scale, "grad_norm": None})
    assert not values.ready()  # the event waits behind the sleep on `side`
    result = StepResult.deferred(values, "overflow")
    assert result.as_dict() == {"stepped": False, "reason": "overflow", "loss_scale": 8.0, "grad_norm": None}
    assert values.ready()


def test_step_result_snapshot_is_not_a_host_read():
    """G2: the non-blocking copy into pinned memory is not counted by ScalarReads; a real
    read is."""
    from mixprec.diagnostics.syncs import ScalarReads
    from mixprec.step import DeviceScalars

    t = torch.ones(1, device="cuda")
    with ScalarReads() as reads:
        values = DeviceScalars({"found_inf": t, "loss_scale": None, "grad_norm": None})
    assert reads.count == 0, dict(reads.by_op)
    with ScalarReads() as reads:
        t.cpu()
        t.item()
    assert reads.count == 2, dict(reads.by_op)
    assert values.get("found_inf") == 1.0

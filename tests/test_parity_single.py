"""Acceptance: mixprec equals a hand-written plain-PyTorch loop (same autocast/GradScaler).

Bitwise where the arithmetic is identical: the generic optimizer path runs the very
same torch.optim update on the same fp32 tensors, so parameters must be identical bit
for bit after 20 steps. With clipping, mixprec's C++ norm sums squares in a different
order than torch's norm-of-norms, so the clip coefficient may differ in the last bit;
that case is checked at 1e-6 relative.
"""

import pytest
import torch

from mixprec import Accelerator
from _helpers import (
    clone, make_mlp, make_transformer, mixprec_loop, mlp_batches, reference_loop, transformer_batches,
)

MODELS = {
    "mlp": (make_mlp, mlp_batches),
    "transformer": (make_transformer, transformer_batches),
}


def _run_both(kind, mixed_precision, opt_cls, clip=None, fused=False, steps=20):
    make, batches_fn = MODELS[kind]
    batches = batches_fn(steps)
    ref = make()
    ours = clone(ref)
    ref_opt = opt_cls(ref.parameters())
    ref_losses = reference_loop(ref, ref_opt, batches, mixed_precision, clip=clip)

    acc = Accelerator(mixed_precision=mixed_precision, cpu=True, fused_optimizer=fused, log_policy=False)
    model, opt = acc.prepare(ours, opt_cls(ours.parameters()))
    losses, results = mixprec_loop(acc, model, opt, batches, clip=clip)
    return ref, model, ref_losses, losses, results


OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
}


@pytest.mark.parametrize("kind", ["mlp", "transformer"])
@pytest.mark.parametrize("mixed_precision", ["no", "bf16", "fp16"])
@pytest.mark.parametrize("opt_name", ["adamw", "sgd"])
def test_bitwise_equal_to_plain_pytorch(kind, mixed_precision, opt_name):
    ref, model, ref_losses, losses, results = _run_both(kind, mixed_precision, OPTIMIZERS[opt_name])
    assert losses == ref_losses
    for (name, a), b in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(a, b), name
    assert all(r.stepped for r in results)
    if mixed_precision == "fp16":
        assert results[0].loss_scale == 2.0**16


@pytest.mark.parametrize("kind", ["mlp", "transformer"])
@pytest.mark.parametrize("mixed_precision", ["no", "bf16", "fp16"])
def test_with_clipping_matches_within_tolerance(kind, mixed_precision):
    ref, model, ref_losses, losses, results = _run_both(
        kind, mixed_precision, OPTIMIZERS["adamw"], clip=0.5
    )
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for (name, a), b in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7, msg=name)
    assert all(r.grad_norm is not None and r.grad_norm > 0 for r in results)


@pytest.mark.parametrize("kind", ["mlp", "transformer"])
@pytest.mark.parametrize("mixed_precision", ["no", "bf16", "fp16"])
def test_fused_path_matches_plain_pytorch(kind, mixed_precision):
    """The fused C++ AdamW agrees with torch.optim.AdamW to fp32 rounding (see kernels tests
    for the per-step ulp bound); over 20 steps that stays within 1e-5 relative."""
    ref, model, ref_losses, losses, _ = _run_both(kind, mixed_precision, OPTIMIZERS["adamw"], fused=True)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for (name, a), b in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)

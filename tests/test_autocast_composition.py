"""Acceptance: the policy's autocast composes with the caller's; inputs cast at the boundary
only when floating; a module that computes in fp32 inside forward trains in every mode."""

import pytest
import torch
from torch import nn

from mixprec import Accelerator
from _helpers import TimestepEmbedding


def _train_timestep_model(acc, caller_autocast=None, steps=30):
    torch.manual_seed(0)
    model = TimestepEmbedding()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt = acc.prepare(model, opt)
    g = torch.Generator().manual_seed(0)
    t = torch.randint(0, 1000, (64,), generator=g)
    target = torch.stack([torch.sin(t / 300.0), torch.cos(t / 500.0), t / 1000.0, -t / 1000.0], 1)
    losses = []
    for _ in range(steps):
        if caller_autocast is not None:
            with torch.autocast("cpu", dtype=caller_autocast):
                out = model(t)
        else:
            out = model(t)
        loss = nn.functional.mse_loss(out.float(), target)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, losses


@pytest.mark.parametrize(
    "kwargs, caller",
    [
        ({"mixed_precision": "bf16", "param_dtype": torch.bfloat16}, None),  # bf16-stored params
        ({"mixed_precision": "bf16"}, None),  # fp32 params + autocast
        ({"mixed_precision": "bf16"}, torch.bfloat16),  # inside the caller's autocast
        ({"mixed_precision": "bf16", "param_dtype": torch.bfloat16}, torch.bfloat16),
        ({"mixed_precision": "fp16", "param_dtype": torch.float16}, None),
    ],
)
def test_fp32_computation_inside_forward_trains(kwargs, caller):
    acc = Accelerator(cpu=True, log_policy=False, **kwargs)
    model, losses = _train_timestep_model(acc, caller)
    assert losses[-1] < 0.5 * losses[0], losses
    if "param_dtype" in kwargs:
        assert model.lin1.weight.dtype == kwargs["param_dtype"]


def test_plain_module_without_policy_fails_the_way_mixprec_prevents():
    # The failure mixprec exists to prevent: bf16 weights fed an fp32 tensor, no autocast.
    model = TimestepEmbedding().to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="dtype"):
        model(torch.arange(4))


def _record_linear_dtype(model):
    seen = []
    model.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    return seen


def test_callers_autocast_is_kept_not_replaced():
    acc = Accelerator(mixed_precision="fp16", cpu=True, log_policy=False)
    inner = nn.Linear(8, 8)
    model = acc.prepare(nn.Sequential(inner))
    seen = _record_linear_dtype(inner)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(2, 8))
    assert seen == [torch.bfloat16]  # the caller's bf16, not the policy's fp16
    model(torch.randn(2, 8))
    assert seen[-1] == torch.float16  # outside it, the policy applies


def test_accelerator_autocast_disabled_region_stays_fp32():
    acc = Accelerator(mixed_precision="bf16", cpu=True, log_policy=False)
    inner = nn.Linear(8, 8)
    model = acc.prepare(nn.Sequential(inner))
    seen = _record_linear_dtype(inner)
    with acc.autocast(enabled=False):
        model(torch.randn(2, 8))
    assert seen == [torch.float32]
    with acc.autocast():
        y = torch.randn(2, 8) @ torch.randn(8, 8)
    assert y.dtype == torch.bfloat16


def test_integer_and_bool_inputs_are_never_cast_and_outputs_are_fp32():
    seen = {}

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, ids, mask, extra=None):
            seen.update(x=x.dtype, ids=ids.dtype, mask=mask.dtype, extra=extra["v"].dtype)
            return {"out": self.lin(x) * mask[:, None]}

    acc = Accelerator(mixed_precision="bf16", cpu=True, param_dtype=torch.bfloat16, log_policy=False)
    model = acc.prepare(Probe())
    out = model(torch.randn(3, 4), torch.arange(3), torch.ones(3, dtype=torch.bool),
                extra={"v": torch.randn(3, dtype=torch.float32)})
    assert seen == {"x": torch.bfloat16, "ids": torch.int64, "mask": torch.bool, "extra": torch.bfloat16}
    assert out["out"].dtype == torch.float32


def test_exception_in_forward_leaves_autocast_off():
    class Boom(nn.Module):
        def forward(self, x):
            raise KeyError("boom")

    acc = Accelerator(mixed_precision="bf16", cpu=True, log_policy=False)
    model = acc.prepare(Boom())
    with pytest.raises(KeyError):
        model(torch.randn(2))
    assert not torch.is_autocast_enabled("cpu")


def test_keep_fp32_modules_run_in_fp32():
    acc = Accelerator(mixed_precision="bf16", cpu=True, param_dtype=torch.bfloat16,
                      keep_fp32_modules=("Norm",), log_policy=False)
    seen = []

    class Norm(nn.LayerNorm):
        def forward(self, x):
            out = super().forward(x)
            seen.append((x.dtype, out.dtype))
            return out

    model = nn.Sequential(nn.Linear(8, 8), Norm(8), nn.Linear(8, 2))
    model = acc.prepare(model)
    assert model[0].weight.dtype == torch.bfloat16 and model[1].weight.dtype == torch.float32
    model(torch.randn(4, 8))
    assert seen == [(torch.float32, torch.float32)]


def test_keep_fp32_modules_that_match_nothing_is_an_error():
    acc = Accelerator(mixed_precision="bf16", cpu=True, keep_fp32_modules=("Nope",), log_policy=False)
    with pytest.raises(ValueError, match=r"keep_fp32_modules=\['Nope'\] matched no module"):
        acc.prepare(nn.Linear(2, 2))

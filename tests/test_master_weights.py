"""Acceptance: low-precision storage trains fp32 masters."""

import pytest
import torch
from torch import nn

from mixprec import Accelerator
from _helpers import fp16_matmuls, loss_fn, make_mlp, mlp_batches


def _tiny_update_run(mixed_precision, steps=40):
    """A single weight at 1.0: bf16's spacing there is 2**-7, so a 1e-3 Adam update per step
    is below half an ulp and vanishes if applied to bf16 weights in place."""
    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    acc = Accelerator(mixed_precision=mixed_precision, cpu=True, param_dtype=torch.bfloat16,
                      log_policy=False) if mixed_precision != "bf16-pure" else Accelerator(
        mixed_precision="bf16-pure", cpu=True, log_policy=False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    x = torch.ones(4, 1)
    for _ in range(steps):
        acc.backward(model(x).float().sum())  # gradient +4 every step: weight decreases
        opt.step()
        opt.zero_grad()
    return model, opt, acc


def test_sub_half_ulp_updates_accumulate_on_fp32_masters():
    model, opt, acc = _tiny_update_run("bf16")
    master = opt.param_groups[0]["params"][0]
    assert master.dtype == torch.float32 and model.weight.dtype == torch.bfloat16
    # fp32 reference: Adam with a constant gradient moves by ~lr per step.
    ref = nn.Parameter(torch.ones(1, 1))
    ref_opt = torch.optim.Adam([ref], lr=1e-3)
    for _ in range(40):
        ref.grad = torch.full((1, 1), 4.0)
        ref_opt.step()
    assert torch.equal(master.detach(), ref.detach())
    assert model.weight.item() < 1.0  # the accumulated updates show in the bf16 weight
    assert torch.equal(model.weight.detach(), master.detach().to(torch.bfloat16))
    assert acc.get_state_dict(model)["weight"].dtype == torch.float32
    assert torch.equal(acc.get_state_dict(model)["weight"], master.detach())


def test_pure_bf16_loses_those_updates():
    model, _, _ = _tiny_update_run("bf16-pure")
    assert model.weight.dtype == torch.bfloat16
    assert model.weight.item() == 1.0  # every update rounded away: why masters are the default


def test_model_given_in_bf16_gets_masters_automatically(caplog):
    model = make_mlp().to(torch.bfloat16)
    acc = Accelerator(mixed_precision="bf16", cpu=True, log_policy=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level("WARNING", logger="mixprec"):
        model, opt = acc.prepare(model, opt)
    assert "fp32 master weights were added" in caplog.text
    assert caplog.text.count("fp32 master weights were added") == 1
    assert all(p.dtype == torch.float32 for g in opt.param_groups for p in g["params"])
    x, y = mlp_batches(1)[0]
    acc.backward(loss_fn(model(x), y))
    # Gradients live on the fp32 masters; the bf16 parameters hold none.
    assert all(p.grad is None for p in model.parameters())
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in opt.param_groups[0]["params"])
    assert opt.step().stepped


def test_fp16_params_never_hit_unscale_fp16_gradients():
    model = make_mlp().half()
    acc = Accelerator(mixed_precision="fp16", cpu=True, log_policy=False)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    for x, y in mlp_batches(3):
        acc.backward(loss_fn(model(x), y))
        acc.clip_grad_norm_(model.parameters(), 1.0)
        assert opt.step().stepped
        opt.zero_grad()


def test_model_zero_grad_also_clears_master_grads():
    model = make_mlp()
    acc = Accelerator(mixed_precision="bf16", cpu=True, param_dtype=torch.bfloat16, log_policy=False)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = mlp_batches(1)[0]
    acc.backward(loss_fn(model(x), y))
    model.zero_grad()
    assert all(p.grad is None for g in opt.param_groups for p in g["params"])


def test_prepare_keeps_identity_keys_and_state_dict_loads_in_plain_torch():
    model = make_mlp()
    keys = list(model.state_dict())
    acc = Accelerator(mixed_precision="bf16", cpu=True, log_policy=False)
    prepared = acc.prepare(model)
    assert prepared is model and isinstance(prepared, nn.Sequential)
    assert list(prepared.state_dict()) == keys
    fresh = make_mlp(seed=1)
    fresh.load_state_dict(acc.get_state_dict(prepared))
    plain = acc.unwrap_model(prepared, keep_fp32_wrapper=False)
    assert type(plain) is nn.Sequential
    assert plain(torch.randn(2, 16)).dtype == torch.float32


@pytest.mark.parametrize("mixed_precision", ["bf16", "fp16"])
def test_low_precision_storage_matches_fp32_masters_reference(mixed_precision):
    """bf16/fp16-stored params + masters: the master trajectory equals a plain loop that keeps
    fp32 weights, copies them to low precision for forward, and steps on fp32 grads."""
    dtype = torch.bfloat16 if mixed_precision == "bf16" else torch.float16
    ref_master = make_mlp()
    lowp = make_mlp()
    ref_opt = torch.optim.SGD(ref_master.parameters(), lr=0.05, momentum=0.9)
    acc = Accelerator(mixed_precision=mixed_precision, cpu=True, param_dtype=dtype,
                      fused_optimizer=False, log_policy=False)
    model, opt = acc.prepare(lowp, torch.optim.SGD(lowp.parameters(), lr=0.05, momentum=0.9))
    scaler = torch.amp.GradScaler("cpu", enabled=mixed_precision == "fp16")
    for x, y in mlp_batches(10):
        shadow = make_mlp().to(dtype)
        with torch.no_grad():
            for s, m in zip(shadow.parameters(), ref_master.parameters()):
                s.copy_(m)
        with torch.autocast("cpu", dtype=dtype), fp16_matmuls(dtype):
            out = shadow(x.to(dtype))
        scaler.scale(loss_fn(out, y)).backward()
        for s, m in zip(shadow.parameters(), ref_master.parameters()):
            m.grad = s.grad.float()
        scaler.step(ref_opt)
        scaler.update()
        ref_opt.zero_grad()

        acc.backward(loss_fn(model(x), y))
        opt.step()
        opt.zero_grad()
    for a, b in zip(ref_master.parameters(), opt.param_groups[0]["params"]):
        assert torch.equal(a, b)

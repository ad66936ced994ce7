"""Acceptance: an fp16 overflow skips the step, leaves weights bitwise unchanged, halves the
scale, holds the scheduler, and says so."""

import pytest
import torch

from mixprec import Accelerator
from _helpers import loss_fn, make_mlp, mlp_batches


@pytest.mark.parametrize("param_dtype", [None, torch.float16])
@pytest.mark.parametrize("fused", [False, True])
def test_overflow_at_step_k_is_skipped_and_reported(param_dtype, fused):
    k = 3
    acc = Accelerator(mixed_precision="fp16", cpu=True, param_dtype=param_dtype,
                      fused_optimizer=fused, log_policy=False)
    model = make_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, sched = acc.prepare(model, opt, sched)
    for i, (x, y) in enumerate(mlp_batches(6)):
        loss = loss_fn(model(x), y)
        acc.backward(loss)
        if i == k:
            # One non-finite element in one gradient (the fp32 grad the optimizer consumes).
            grad = opt.param_groups[0]["params"][0].grad
            grad.view(-1)[5] = float("inf")
            before = [p.detach().clone() for p in model.parameters()]
            masters_before = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
            state_before = {id(p): {k2: v.clone() for k2, v in s.items()} for p, s in opt.state.items()}
            scale_before, lr_before = acc.loss_scale, sched.get_last_lr()
        result = opt.step()
        advanced = sched.step()
        opt.zero_grad()
        if i == k:
            assert result.stepped is False and result.reason == "overflow"
            assert acc.last_step.reason == "overflow" and acc.optimizer_step_was_skipped
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
            after = [p for g in opt.param_groups for p in g["params"]]
            assert all(torch.equal(a, b) for a, b in zip(masters_before, after))
            for p, s in opt.state.items():
                for key, v in s.items():
                    assert torch.equal(v, state_before[id(p)][key]), key
            assert acc.loss_scale == scale_before / 2
            assert advanced is False and sched.get_last_lr() == lr_before
        else:
            assert result.stepped and result.reason == "ok" and advanced
    assert acc.skipped_steps == 1


def test_direct_backward_under_fp16_is_refused_before_any_update():
    acc = Accelerator(mixed_precision="fp16", cpu=True, log_policy=False)
    model = make_mlp()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = mlp_batches(1)[0]
    loss_fn(model(x), y).backward()  # bypasses the scaler
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"loss.backward\(\) was called directly.*accelerator.backward"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_manual_scale_then_backward_is_accepted():
    acc = Accelerator(mixed_precision="fp16", cpu=True, log_policy=False)
    model = make_mlp()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = mlp_batches(1)[0]
    acc.scale(loss_fn(model(x), y)).backward()
    assert opt.step().stepped


def test_unscale_gradients_is_idempotent_within_a_step():
    acc = Accelerator(mixed_precision="fp16", cpu=True, log_policy=False)
    model = make_mlp()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = mlp_batches(1)[0]
    acc.backward(loss_fn(model(x), y))
    acc.unscale_gradients()
    once = [p.grad.clone() for p in model.parameters()]
    acc.unscale_gradients()
    acc.clip_grad_norm_(model.parameters(), 1e9)  # unscales again internally: must be a no-op
    assert all(torch.equal(a, p.grad) for a, p in zip(once, model.parameters()))


def test_step_hooks_run_only_on_real_steps_in_order():
    import mixprec

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    acc = mixprec.Accelerator(gradient_accumulation_steps=2, log_policy=False)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    seen = []
    opt.pre_step_hooks.append(lambda o: seen.append(("pre", o is opt)))
    opt.post_step_hooks.append(lambda o, r: seen.append(("post", r.stepped)))
    for _ in range(4):
        with acc.accumulate(model):
            acc.backward(model(torch.randn(3, 4)).sum())
            opt.step()
            opt.zero_grad()
    assert seen == [("pre", True), ("post", True)] * 2

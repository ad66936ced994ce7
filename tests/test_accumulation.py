"""Acceptance: GA=4 at batch 8 equals GA=1 at batch 32 (loss divided exactly once)."""

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from mixprec import Accelerator
from _helpers import loss_fn, make_mlp


def _data(n=128):
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(n, 16, generator=g), torch.randn(n, 4, generator=g))


EPS = 1e-6  # AdamW's eps ([Note: calibrated bounds] in tests/_numerics.py: 1e-8 lets rounding pick Adam's signs)


def _lr(step):
    return 1.0 / (1 + step)


def _train(ga, batch, mixed_precision="no", param_dtype=None):
    model = make_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=EPS)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr)
    acc = Accelerator(mixed_precision=mixed_precision, gradient_accumulation_steps=ga, cpu=True,
                      param_dtype=param_dtype, log_policy=False)
    loader = DataLoader(_data(), batch_size=batch, shuffle=False)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    trajectory, syncs = [], []
    for x, y in loader:
        with acc.accumulate(model):
            acc.backward(loss_fn(model(x), y))
            syncs.append(acc.sync_gradients)
            if acc.sync_gradients:
                grads = [p.grad.clone() for g in opt.param_groups for p in g["params"]]
            opt.step()
            sched.step()
            opt.zero_grad()
            if acc.sync_gradients:
                trajectory.append(([p.detach().float().clone() for p in model.parameters()], grads))
    return trajectory, syncs, sched.get_last_lr(), {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_ga4_batch8_equals_ga1_batch32():
    """Both runs are as accurate as fp32 runs of the same training (batch 32, AdamW, the same
    schedule) against float64 ([Note: calibrated bounds] in tests/_numerics.py): a loss
    divided twice, or not at all, is a 4x error in every gradient."""
    from _numerics import assert_verdict, judge_runs

    acc_traj, syncs, lr_a, acc_state = _train(ga=4, batch=8)
    big_traj, _, lr_b, big_state = _train(ga=1, batch=32)
    assert syncs == [False, False, False, True] * 4
    assert len(acc_traj) == len(big_traj) == 4
    x, y = _data().tensors
    batches = [(x[i:i + 32], y[i:i + 32]) for i in range(0, 128, 32)]
    judge = judge_runs(make_mlp, batches, loss=lambda m, b: loss_fn(m(b[0]), b[1]), lr=1e-2, eps=EPS,
                       lr_lambda=_lr)[0]
    assert_verdict(judge.verdict(acc_state), "ga4 x batch 8")
    assert_verdict(judge.verdict(big_state), "ga1 x batch 32")
    assert lr_a == lr_b  # the scheduler advanced 4 times in both runs


def test_accumulation_with_bf16_storage_accumulates_in_fp32():
    acc_traj, _, _, _ = _train(ga=4, batch=8, mixed_precision="bf16", param_dtype=torch.bfloat16)
    big_traj, _, _, _ = _train(ga=1, batch=32, mixed_precision="bf16", param_dtype=torch.bfloat16)
    for (_, ga), (_, gb) in zip(acc_traj, big_traj):
        for a, b in zip(ga, gb):
            assert a.dtype == torch.float32
            # bf16 compute differs per micro-batch shape; the fp32 sums agree to bf16 rounding.
            torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)


def test_end_of_dataloader_closes_a_partial_window():
    model = make_mlp()
    acc = Accelerator(gradient_accumulation_steps=3, cpu=True, log_policy=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(_data(40), batch_size=8)  # 5 batches: windows of 3 and 2
    model, opt, loader = acc.prepare(model, opt, loader)
    stepped = []
    for x, y in loader:
        with acc.accumulate(model):
            acc.backward(loss_fn(model(x), y))
            stepped.append(opt.step().stepped)
            opt.zero_grad()
    assert stepped == [False, False, True, False, True]


def test_zero_grad_inside_window_keeps_accumulated_grads():
    model = make_mlp()
    acc = Accelerator(gradient_accumulation_steps=2, cpu=True, log_policy=False)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(4, 16), torch.randn(4, 4)
    with acc.accumulate(model):
        acc.backward(loss_fn(model(x), y))
        assert opt.step().reason == "accumulating"
        opt.zero_grad()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("bad", [0, -1, 2.5])
def test_bad_accumulation_steps(bad):
    with pytest.raises(ValueError, match=f"gradient_accumulation_steps={bad!r} must be an int >= 1"):
        Accelerator(gradient_accumulation_steps=bad)

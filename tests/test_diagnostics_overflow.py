"""Acceptance (issue #8): an fp16 overflow storm stops training after exactly
``max_consecutive_overflows`` skipped steps, weights unchanged, naming the module that made
the inf; occasional overflows do not stop; the happy path carries no hook."""

import re

import pytest
import torch
from torch import nn

from mixprec import Accelerator, MixprecError, OverflowStormError, ScalerConfig
from mixprec.diagnostics import FP16_MAX


class Amplify(nn.Module):
    """Multiplies by 1e6: in fp16 anything above 0.066 becomes inf, whatever the loss scale."""

    def forward(self, x):
        return x * 1e6


class StormNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Linear(16, 32)
        self.blocks = nn.Sequential(nn.Linear(32, 32), Amplify(), nn.Linear(32, 32))
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.blocks(torch.relu(self.stem(x))))


def _hooks(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) for m in model.modules())


def _batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(n)]


@pytest.mark.parametrize("param_dtype", [None, torch.float16])
def test_storm_stops_after_exactly_the_budget_naming_the_module(param_dtype):
    budget = 5
    acc = Accelerator(mixed_precision="fp16", cpu=True, log_policy=False, param_dtype=param_dtype,
                      max_consecutive_overflows=budget)
    model = StormNet()
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    initial = {k: v.clone() for k, v in acc.get_state_dict(model).items()}
    stored = [p.detach().clone() for p in model.parameters()]
    steps = 0
    with pytest.raises(OverflowStormError) as info:
        for x, y in _batches(3 * budget):
            acc.backward(nn.functional.mse_loss(model(x).float(), y))
            steps += 1
            opt.step()
            opt.zero_grad()
    err = info.value
    assert isinstance(err, MixprecError)
    assert steps == budget and acc.skipped_steps == budget  # stopped at the budget, not later
    assert all(torch.equal(initial[k], v) for k, v in acc.get_state_dict(model).items())  # masters
    assert all(torch.equal(a, p) for a, p in zip(stored, model.parameters()))  # stored weights
    report = err.report
    assert report.culprit.module == "blocks.1" and report.culprit.module_type == "Amplify"
    assert report.culprit.kind == "output" and report.culprit.nonfinite > 0
    assert report.culprit.input_nonfinite == 0 and report.culprit.input_max_abs < FP16_MAX
    assert report.consecutive == budget and report.ranks == (0,) and report.probed
    assert report.loss_scales == (2.0**16, 2.0**15, 2.0**14, 2.0**13, 2.0**12)
    assert report.current_scale == 2.0**11
    text = str(err)
    assert "'blocks.1' (Amplify)" in text and "65504" in text
    assert "keep_fp32_modules=['blocks.1']" in text and "mixed_precision='bf16'" in text
    assert "65536 -> 32768 -> 16384 -> 8192 -> 4096 (now 2048)" in text
    assert _hooks(model) == 0  # probes removed


def test_occasional_overflows_below_the_budget_do_not_stop_and_probes_come_and_go():
    budget = 3
    acc = Accelerator(mixed_precision="fp16", cpu=True, log_policy=False, max_consecutive_overflows=budget)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-2))
    poison_at = {1, 2, 5, 6, 8}  # at most budget - 1 in a row
    armed_after = []
    for i, (x, y) in enumerate(_batches(10)):
        acc.backward(nn.functional.mse_loss(model(x).float(), y))
        if i in poison_at:
            opt.param_groups[0]["params"][0].grad.view(-1)[0] = float("inf")
        result = opt.step()
        opt.zero_grad()
        assert result.stepped == (i not in poison_at)
        armed_after.append(_hooks(model) > 0)
    assert acc.skipped_steps == len(poison_at)
    # Armed only after budget - 1 = 2 overflows in a row, disarmed by the next good step.
    assert armed_after == [False, False, True, False, False, False, True, False, False, False]


def test_happy_path_has_no_hooks_and_none_disables_the_stop():
    acc = Accelerator(mixed_precision="bf16", cpu=True, log_policy=False)
    model = StormNet()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-2))
    assert opt.post_step_hooks == [] and _hooks(model) == 0  # no loss scaling: nothing to watch

    acc = Accelerator(mixed_precision="fp16", cpu=True, log_policy=False, max_consecutive_overflows=None)
    model = StormNet()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-2))
    assert opt.post_step_hooks == []
    for x, y in _batches(8):
        acc.backward(nn.functional.mse_loss(model(x).float(), y))
        assert not opt.step().stepped
        opt.zero_grad()
    assert acc.skipped_steps == 8 and _hooks(model) == 0


def test_overflow_in_backward_only_names_the_first_gradient():
    class Steep(nn.Module):  # finite forward, gradient x 1e6 in backward
        def forward(self, x):
            return x * 1e-3

    class GradBlowup(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return g * 1e6

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.body = nn.Linear(16, 16)
            self.steep = Steep()
            self.head = nn.Linear(16, 4)

        def forward(self, x):
            return self.head(GradBlowup.apply(self.steep(self.body(x))))

    acc = Accelerator(mixed_precision="fp16", cpu=True, log_policy=False, max_consecutive_overflows=2,
                      scaler=ScalerConfig(init_scale=2.0**16))
    model = Net()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-2))
    with pytest.raises(OverflowStormError) as info:
        for x, y in _batches(4):
            acc.backward(nn.functional.mse_loss(model(x).float(), y))
            opt.step()
            opt.zero_grad()
    culprit = info.value.report.culprit
    assert culprit.kind == "grad" and culprit.module == "steep" and culprit.nonfinite > 0
    assert "output gradient" in str(info.value) and "check the loss" in str(info.value)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "20"])
def test_bad_budget_is_refused_naming_the_value(bad):
    # Validated by the config schema (one validator for argument, file and env var).
    with pytest.raises(ValueError, match=rf"max_consecutive_overflows={re.escape(repr(bad))} must be null or an int >= 1 \(from argument"):
        Accelerator(mixed_precision="fp16", cpu=True, max_consecutive_overflows=bad)

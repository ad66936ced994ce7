"""Diagnostics on sharded backends, 2 processes over Gloo: a dtype error inside a zero3/fsdp
unit names the module (its parameters gathered by the engine), and an fp16 overflow storm
stops every rank at the same step with the same report."""

import pytest

from harness import run_distributed

UNITS = {"zero3": ("zero3", {"units": ["Layer"]}), "fsdp": ("fsdp", {"units": ["Layer"]})}


def _models():
    import torch
    from torch import nn

    class Proj(nn.Module):
        def __init__(self, double):
            super().__init__()
            self.proj = nn.Linear(16, 16)
            self.double_input = double

        def forward(self, x):
            return self.proj(x.double() if self.double_input else x)

    class Amplify(nn.Module):
        def forward(self, x):
            return x * 1e6

    class Layer(nn.Module):
        def __init__(self, double=False, amplify=False):
            super().__init__()
            self.norm = nn.LayerNorm(16)
            self.block = Proj(double)
            self.amp = Amplify() if amplify else nn.Identity()

        def forward(self, x):
            return self.amp(x + self.block(self.norm(x)))

    class Net(nn.Module):
        def __init__(self, double_at=-1, amplify_at=-1):
            super().__init__()
            torch.manual_seed(0)
            self.layers = nn.ModuleList([Layer(i == double_at, i == amplify_at) for i in range(3)])
            self.head = nn.Linear(16, 4)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    return Net


def _dtype_error(state, name):
    import torch

    from mixprec import Accelerator, MixprecDtypeError

    backend, opts = UNITS[name]
    acc = Accelerator(mixed_precision="bf16", backend=backend, cpu=True, log_policy=False,
                      engine_options=opts)
    model = _models()(double_at=1)
    model, _ = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    try:
        model(torch.randn(4, 16))
    except MixprecDtypeError as err:
        return (err.module_path, err.input_dtypes, err.param_dtypes, isinstance(err, RuntimeError),
                type(err.__cause__).__name__, str(err))
    return None


@pytest.mark.parametrize("name", ["zero3", "fsdp"])
def test_dtype_error_in_a_sharded_unit_names_the_module_on_every_rank(name):
    import torch

    for out in run_distributed(_dtype_error, 2, args=(name,)):
        assert out is not None, "no MixprecDtypeError was raised"
        path, inputs, params, is_runtime, cause, text = out
        assert path == "layers.1.block.proj" and is_runtime and cause == "RuntimeError"
        assert inputs == {"input": torch.float64}
        assert params == {"weight": torch.float32, "bias": torch.float32}  # gathered, fp32 storage
        assert "'layers.1.block.proj' (Linear)" in text and "mixed_precision='bf16'" in text
        assert "but got Double and BFloat16" in text and "cast the float64 input" in text


def _storm(state, budget):
    import torch
    import torch.distributed as dist

    from mixprec import Accelerator, OverflowStormError

    backend, opts = UNITS["zero3"]
    acc = Accelerator(mixed_precision="fp16", backend=backend, cpu=True, log_policy=False,
                      engine_options=opts, max_consecutive_overflows=budget)
    model = _models()(amplify_at=2)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    initial = {k: v.clone() for k, v in acc.get_state_dict(model).items()}
    g = torch.Generator().manual_seed(dist.get_rank())
    steps = 0
    try:
        for _ in range(3 * budget):
            x, y = torch.randn(4, 16, generator=g), torch.randn(4, 4, generator=g)
            acc.backward(torch.nn.functional.mse_loss(model(x).float(), y))
            steps += 1
            opt.step()
            opt.zero_grad()
    except OverflowStormError as err:
        report = err.report
        unchanged = all(torch.equal(initial[k], v) for k, v in acc.get_state_dict(model).items())
        return (steps, acc.skipped_steps, report.culprit.module, report.ranks, report.world_size,
                unchanged, str(err))
    return None


def test_overflow_storm_stops_every_rank_at_the_budget_with_the_same_report():
    # layers.2.amp multiplies the fp32 residual stream by 1e6: finite in fp32, but above
    # 65504, so the head's fp16 matmul overflows. The report names amp, not the head.
    outs = run_distributed(_storm, 2, args=(3,))
    for out in outs:
        assert out is not None, "no OverflowStormError was raised"
        steps, skipped, module, ranks, world, unchanged, text = out
        assert steps == 3 and skipped == 3 and unchanged
        assert module == "layers.2.amp" and ranks == (0, 1) and world == 2
        assert "seen on rank(s) [0, 1] of 2" in text and "keep_fp32_modules=['layers.2.amp']" in text
    assert outs[0][-1] == outs[1][-1]  # the same report on every rank

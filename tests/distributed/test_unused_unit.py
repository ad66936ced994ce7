"""A unit that one rank does not use in its forward (issue 23, G11).

Whether a rank launches a unit's gradient reductions used to be decided from the gradients
that rank got ("no gradient here, skip the reduction"): with a block skipped on rank 1 only,
the ranks issued different collectives, which hangs under NCCL and desyncs Gloo. Now every
rank reduces every unit a backward went through, with zeros where it has no gradient, at
points that do not depend on the gradients ([Note: agreed reductions] in
csrc/engines/sharded/core.h, [Note: agreed launch points] in src/mixprec/engines/units.py).

Checked on 2 ranks over Gloo, under the harness's timeout (a desync fails instead of
hanging): after 3 SGD steps the parameters equal, bitwise, plain PyTorch SGD on the gradient
averaged over both ranks with zeros from the rank that skipped the block (fp32: the engine
sums g0/2 + g1/2, the reference (g0 + g1)/2, the same value since halving is exact).
"""

from __future__ import annotations

import pytest
import torch
from harness import run_distributed

STEPS = 3
SKIPPED = 1  # the block that rank 1 does not use


class Block(torch.nn.Module):
    def __init__(self, width: int, skip_on_rank: int = -1):
        super().__init__()
        self.lin = torch.nn.Linear(width, width)
        self.norm = torch.nn.LayerNorm(width)
        self.skip_on_rank = skip_on_rank

    def forward(self, x):
        if self.skip_on_rank == torch.distributed.get_rank():
            return x  # called (so zero3/fsdp gather it on every rank), but no parameter used
        return self.norm(torch.tanh(self.lin(x)))


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    blocks = [Block(12, skip_on_rank=1 if i == SKIPPED else -1) for i in range(3)]
    return torch.nn.Sequential(torch.nn.Linear(5, 12), *blocks, torch.nn.Linear(12, 3))


CONFIGS = {
    "zero1": ("zero1", {}),
    "zero2": ("zero2", {}),
    "zero2_one_inflight": ("zero2", {"max_inflight_buckets": 1}),
    "zero3": ("zero3", {"units": ["Block"]}),
    "zero3_leaf": ("zero3", {"units": ["Block"], "leaf_module_classes": ["Block"]}),
    "fsdp": ("fsdp", {"units": ["Block"]}),
    "fsdp_keep": ("fsdp", {"units": ["Block"], "reshard_after_forward": False}),
    "ddp": ("ddp", {"find_unused_parameters": True}),
}


def _train(state, names):
    import torch.distributed as dist

    from mixprec import Accelerator

    rank = dist.get_rank()
    out = {}
    for name in names:
        backend, opts = CONFIGS[name]
        reference, model = make_model(), make_model()
        model.load_state_dict(reference.state_dict())
        # Small buckets: several per core, so a skipped block leaves some buckets without
        # any gradient on rank 1 and others partly filled.
        acc = Accelerator(backend=backend, cpu=True, log_policy=False,
                          engine_options={"bucket_cap_mb": 1 / 1024, "first_bucket_cap_mb": 0.5 / 1024,
                                          **opts})
        model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.5))
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
        worst, reductions = 0.0, []
        for step in range(STEPS):
            g = torch.Generator().manual_seed(100 * step + rank)
            x, y = torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g)
            acc.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
            torch.nn.functional.mse_loss(reference(x), y).backward()
            for p in reference.parameters():
                grad = p.grad if p.grad is not None else torch.zeros_like(p)
                dist.all_reduce(grad)
                p.grad = grad / 2
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
            got = acc.get_state_dict(model)
            for key, want in reference.state_dict().items():
                worst = max(worst, (got[key].float() - want).abs().max().item())
            if backend != "ddp":
                reductions.append(acc.engine.comm_counters()["reductions"])
        skipped_moved = not torch.equal(acc.get_state_dict(model)[f"{SKIPPED + 1}.lin.weight"],
                                        make_model().state_dict()[f"{SKIPPED + 1}.lin.weight"])
        out[name] = (worst, reductions, skipped_moved)
        acc.engine.release()
    return out


@pytest.fixture(scope="module")
def trained():
    # One process group for every configuration; the timeout turns a desync into a failure.
    return run_distributed(_train, 2, args=(list(CONFIGS),), timeout=240)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_block_unused_on_one_rank_matches_the_zero_filled_average(trained, name):
    (worst0, red0, moved0), (worst1, red1, moved1) = trained[0][name], trained[1][name]
    assert worst0 == 0.0 and worst1 == 0.0, (name, worst0, worst1)
    # Both ranks launched the same number of bucket collectives (the skipped block's too).
    assert red0 == red1, (name, red0, red1)
    # The block rank 1 skipped was trained from rank 0's gradient.
    assert moved0 and moved1, name


def _ddp_unused_without_find_unused(state):
    import torch.distributed as dist

    from mixprec import Accelerator

    rank = dist.get_rank()
    acc = Accelerator(backend="ddp", cpu=True, log_policy=False,
                      engine_options={"bucket_cap_mb": 1 / 1024, "first_bucket_cap_mb": 0.5 / 1024})
    model = make_model()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.5))
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g)
    error = None
    try:
        acc.backward(torch.nn.functional.mse_loss(model(x), y))
    except ValueError as e:
        error = str(e)
    # Every bucket's all-reduce was issued on both ranks, so the next collective pairs up.
    probe = torch.tensor([float(rank + 1)])
    dist.all_reduce(probe)
    acc.engine.release()
    return error, probe.item()


def test_ddp_unused_on_one_rank_raises_there_and_keeps_collectives_paired():
    """find_unused_parameters=False: the rank that skipped the block raises (naming its
    parameters); every bucket is still all-reduced on both ranks first, so the ranks'
    next collective pairs up (csrc/engines/replicated/reducer.cpp, Reducer::finalize)."""
    (error0, probe0), (error1, probe1) = run_distributed(_ddp_unused_without_find_unused, 2, timeout=120)
    assert error0 is None
    assert error1 is not None and f"{SKIPPED + 1}.lin.weight" in error1, error1
    assert probe0 == probe1 == 3.0

"""Two prepared optimizers (two models) on 2 ranks: each optimizer.step() is one fused_step
call ([Note: one call per step] in csrc/engines/step/fused_step.h) and the ranks still agree.
An inf on one rank only, seen by the first optimizer's gradients, skips both optimizers on
every rank; the loss scale moves once per iteration; weights stay identical across ranks."""

import pytest
from harness import run_distributed


def _two(state, backend, precision):
    import torch
    import torch.distributed as dist
    from torch import nn

    from mixprec import Accelerator
    from mixprec.diagnostics.syncs import Crossings

    torch.manual_seed(0)
    acc = Accelerator(mixed_precision=precision, backend=backend, cpu=True, log_policy=False)
    gen, head = nn.Linear(8, 8), nn.Linear(8, 1)
    gen, og = acc.prepare(gen, torch.optim.AdamW(gen.parameters(), lr=1e-2))
    head, oh = acc.prepare(head, torch.optim.AdamW(head.parameters(), lr=1e-2))
    g = torch.Generator().manual_seed(1 + state.rank)
    outcomes, scales, calls = [], [], []
    for i in range(5):
        x = torch.randn(4, 8, generator=g)
        out = gen(x)
        if i == 2 and state.rank == 1:
            out = out * float("inf")  # the gen's gradients only, and on one rank only
        acc.backward(head(out).float().square().mean())
        with Crossings() as c:
            r1, r2 = og.step(), oh.step()
        calls.append(dict(c.by_name))
        og.zero_grad()
        oh.zero_grad()
        outcomes.append(((r1.stepped, r1.reason), (r2.stepped, r2.reason)))
        if acc.engine.scaler is not None:
            scales.append(acc.engine.scaler.scale_value())
    same = []
    # Full fp32 values (fsdp keeps only shards outside forward: read them gathered).
    for full in [*acc.get_state_dict(gen).values(), *acc.get_state_dict(head).values()]:
        full = full.detach().float().clone()
        gathered = [torch.zeros_like(full) for _ in range(2)]
        dist.all_gather(gathered, full)
        same.append(torch.equal(gathered[0], gathered[1]) and bool(torch.isfinite(full).all()))
    return outcomes, scales, calls[1:], all(same)


@pytest.mark.parametrize("backend", ["ddp", "zero2", "fsdp"])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_two_optimizers_one_call_each_and_agree(backend, precision):
    ok = ((True, "ok"), (True, "ok"))
    reason = "overflow" if precision == "fp16" else "nonfinite"
    skipped = ((False, reason), (False, reason))
    results = run_distributed(_two, 2, args=(backend, precision))
    for outcomes, scales, calls, same in results:
        assert outcomes == [ok, ok, skipped, ok, ok]
        # One fused_step per optimizer.step(); without a clip before it, a sharded step also
        # finishes the reductions first (one finish_reductions call for all cores, per step).
        wait = {} if backend == "ddp" else {"finish_reductions": 2}
        assert calls == [{"fused_step": 2, **wait}] * 4
        assert same
    if precision == "fp16":
        assert results[0][1] == results[1][1]
        assert results[0][1][2] == results[0][1][1] / 2  # backed off once, in that iteration

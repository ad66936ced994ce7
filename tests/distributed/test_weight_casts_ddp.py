"""ddp with the update writing the forward's bf16/fp16 weights ([Note: the update writes
the forward's weights] in src/mixprec/engines/weight_casts.py): 2 ranks train bitwise as
with autocast's casts (``cache_weight_casts=False``), a step skipped for an inf on one rank
included, and the copies are in use on every rank."""

import pytest
from harness import run_distributed


def _train(state, precision, cache):
    import torch
    from torch import nn

    from mixprec import Accelerator

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 8))
    acc = Accelerator(mixed_precision=precision, backend="ddp", cpu=True, log_policy=False,
                      cache_weight_casts=cache)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    g = torch.Generator().manual_seed(1 + state.rank)
    log = []
    for i in range(5):
        loss = model(torch.randn(8, 128, generator=g)).float().square().mean()
        if i == 2 and state.rank == 1:
            loss = loss * float("inf")
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), 0.5)
        r = opt.step()
        opt.zero_grad()
        log.append((repr(loss.item()), r.stepped))
    casts = acc.engine.precision.casts
    fresh = None if casts is None else sorted(e.fresh() for e in casts.entries.values())
    return log, [p.detach().clone() for p in model.parameters()], fresh


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_ddp_same_training_as_autocast_casts(precision):
    import torch

    cached = run_distributed(_train, 2, args=(precision, True))
    plain = run_distributed(_train, 2, args=(precision, False))
    for (log, weights, fresh), (ref_log, ref_weights, ref_fresh) in zip(cached, plain):
        assert log == ref_log and [s for _, s in log] == [True, True, False, True, True]
        assert all(torch.equal(a, b) for a, b in zip(weights, ref_weights))
        assert fresh == [True] and ref_fresh is None  # Linear(128, 256) only: 256x8 is too small

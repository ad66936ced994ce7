"""Buffers on the data-parallel engines (engines/comm.py): every rank starts from rank 0's
buffers, and before each forward that records gradients rank 0's buffers are broadcast
(torch DDP's ``broadcast_buffers=True``), so a BatchNorm's running statistics seen by
the forward are the same on every rank although each rank's batches differ. With
``broadcast_buffers=False`` they drift apart."""

import pytest
from harness import run_distributed


def _bn(state, backend, broadcast):
    import torch
    import torch.distributed as dist
    from torch import nn

    from mixprec import Accelerator

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 1))
    if state.rank == 1:
        with torch.no_grad():
            model[1].running_mean.fill_(5.0)  # rank 0's value must win at prepare
    acc = Accelerator(mixed_precision="bf16", backend=backend, cpu=True, log_policy=False,
                      engine_options={"broadcast_buffers": broadcast})
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    seen = []
    model[1].register_forward_pre_hook(lambda m, a: seen.append(m.running_mean.detach().clone()))
    g = torch.Generator().manual_seed(1 + state.rank)  # different batches per rank
    for _ in range(3):
        acc.backward(model(torch.randn(8, 8, generator=g) + state.rank).float().square().mean())
        opt.step()
        opt.zero_grad()
    same = []
    for t in seen:
        both = [torch.zeros_like(t) for _ in range(2)]
        dist.all_gather(both, t)
        same.append(torch.equal(both[0], both[1]))
    return same


@pytest.mark.parametrize("backend", ["ddp", "zero2", "fsdp"])
def test_rank0_buffers_before_every_forward(backend):
    for same in run_distributed(_bn, 2, args=(backend, True)):
        assert same == [True, True, True]


def test_without_broadcast_buffers_drift():
    for same in run_distributed(_bn, 2, args=("ddp", False)):
        assert same[0] and not any(same[1:])  # equal from prepare, then each rank's own stats

"""Collectives issued by the engines' Python glue run on the comm's device.

NCCL moves device tensors only: a CPU tensor handed to an NCCL group fails ("No backend type
associated with device type cpu"). Gloo takes both, so a CPU run cannot see the mistake by
running it. These tests give the glue a comm whose device is not the CPU (``meta``: no data,
any op records its device) and check the tensor each collective receives.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from mixprec.engines import zero_state


def test_zero_checkpoint_step_agreement_all_reduces_on_the_comm_device(monkeypatch):
    seen = []

    def all_reduce(tensor, op=None, group=None):
        seen.append((tensor.device, tensor.dtype, tuple(tensor.shape), op))

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    p = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.SGD([p], lr=0.1)
    optimizer.state[p]["step"] = torch.tensor(4.0)
    comm = SimpleNamespace(device=torch.device("meta"), group=object())
    # The meta tensor holds no value to read back: the call fails after the collective.
    with pytest.raises((NotImplementedError, RuntimeError)):
        zero_state._group_steps(comm, optimizer)
    assert seen == [(torch.device("meta"), torch.float64, (1,), dist.ReduceOp.MAX)]


def test_zero_checkpoint_step_agreement_reads_the_agreed_value_on_cpu(monkeypatch):
    def all_reduce(tensor, op=None, group=None):
        tensor.fill_(7.0)  # what a peer with a later step would make the MAX

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    p = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.SGD([p], lr=0.1)
    optimizer.state[p]["step"] = torch.tensor(4.0)
    comm = SimpleNamespace(device=torch.device("cpu"), group=object())
    assert zero_state._group_steps(comm, optimizer) == [7.0]

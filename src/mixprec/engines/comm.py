"""What the data-parallel engines (ddp over the Reducer, zero/fsdp over ShardedCore) share
on the communication side, written once: the process group, the replicated start, the
buffer broadcast before forward, and switching gradient synchronisation off."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from .. import _C
from ..distributed.structure import check_same_model


def process_group(backend: str, group: dist.ProcessGroup | None) -> tuple[dist.ProcessGroup, str, int]:
    """(group, its name for C++, world size); WORLD when ``group`` is None."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"backend={backend!r} needs an initialised torch.distributed process group: start the "
            "script with `mixprec launch --nproc-per-node N script.py`"
        )
    group = group if group is not None else dist.group.WORLD
    return group, group.group_name, dist.get_world_size(group)


def check_bucket_caps(**caps_mb: float) -> None:
    for name, value in caps_mb.items():
        if not value > 0:
            raise ValueError(f"{name}={value!r} must be > 0 (MiB)")


def start_replicas(model: nn.Module, group: dist.ProcessGroup, group_name: str) -> None:
    """Check that every rank built the same model ([Note: structure check at prepare]), then
    give every rank rank 0's parameters and buffers, in the dtypes given (before any
    low-precision cast, so fp32 masters are exact everywhere)."""
    check_same_model(model, group)
    state = [t.detach() for t in model.parameters()] + list(model.buffers())
    with torch.no_grad():
        _C.broadcast_coalesced(state, group_name, 0)


def sync_buffers(model: nn.Module, group_name: str) -> None:
    """Rank 0's buffers to every rank before a forward that records grads (ddp, zero)."""
    buffers = list(model.buffers())
    if buffers and torch.is_grad_enabled():
        with torch.no_grad():
            _C.broadcast_coalesced(buffers, group_name, 0)


def install_buffer_sync(model: nn.Module, group_name: str) -> None:
    """Broadcast rank 0's buffers before each of the prepared model's forwards. The hook
    holds the model weakly ([Note: no reference cycles] in units.py)."""
    if any(True for _ in model.buffers()):
        ref = weakref.ref(model)
        model._mixprec_ctx.pre_forward = lambda: sync_buffers(ref(), group_name)


@contextlib.contextmanager
def sync_off(parts: Sequence):
    """Reducers or sharding cores accumulate locally inside (``no_sync``); each gets its
    own previous setting back on exit."""
    previous = [p.sync for p in parts]
    for p in parts:
        p.set_sync(False)
    try:
        yield
    finally:
        for p, prev in zip(parts, previous):
            p.set_sync(prev)

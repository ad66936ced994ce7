"""Python side of the sharding core: which optimizers can run on flat shards, and how an
optimizer's ``param_groups`` are swapped to this rank's fp32 shard segments."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Optimizers whose update of an element depends only on that element's own gradient and
# state: they give the same result on any flat slice of the parameters.
ELEMENTWISE = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
    torch.optim.Adamax, torch.optim.ASGD, torch.optim.NAdam, torch.optim.RAdam,
    torch.optim.RMSprop, torch.optim.Rprop, torch.optim.Adadelta,
)

# Optimizers known to need the whole parameter (or all of them), with the reason.
NOT_ELEMENTWISE = {
    "LBFGS": "its line search and curvature pairs are dot products over all parameters "
             "and it needs a closure that re-evaluates the model",
    "SparseAdam": "it needs sparse gradients; sharded engines reduce dense buckets",
    "Adafactor": "its factored second moment needs each parameter's 2-D shape",
    "Muon": "it orthogonalises whole weight matrices",
}


def check_optimizer(optimizer: torch.optim.Optimizer, backend: str, allow_custom: bool) -> None:
    """Refuse optimizers that cannot step flat shards (raises ValueError naming the fix)."""
    cls = type(optimizer)
    reason = NOT_ELEMENTWISE.get(cls.__name__)
    if reason is not None and cls.__module__.startswith("torch.optim"):
        raise ValueError(
            f"backend={backend!r} cannot run {cls.__name__}: {reason}, but each rank holds only "
            "a flat slice of the parameters. Use an element-wise optimizer (Adam, AdamW, SGD, "
            "...) or backend='ddp'"
        )
    if isinstance(optimizer, ELEMENTWISE) or allow_custom:
        return
    raise ValueError(
        f"backend={backend!r}: {cls.__module__}.{cls.__qualname__} is not a known element-wise "
        "optimizer, and sharded engines step each rank's flat 1-D slice of the parameters. If "
        "its update of every element uses only that element's gradient and state, pass "
        "engine_options={'elementwise_optimizer': True}; otherwise use backend='ddp'"
    )


@dataclass
class Segment:
    """A run of one rank's fp32 master shard that belongs to one optimizer param group."""

    master: torch.Tensor  # view of the master shard (what the optimizer updates)
    core: object  # the ShardedCore whose shards these are
    offset: int  # where the segment starts in the core's shards
    numel: int

    def grad_view(self) -> torch.Tensor:
        """The segment's slice of the core's gradient shard, attached as ``master.grad``
        while the engine shows gradients (the shard exists only from the first reduction
        to zero_grad: [Note: what lives between steps] in csrc/engines/sharded/core.h)."""
        return self.core.grad_shard.narrow(0, self.offset, self.numel)


def build_segments(core, group_of: dict[int, int], params: list[torch.Tensor]) -> dict[int, list[Segment]]:
    """Cut this rank's shard of ``core`` into segments per param group.

    ``params`` are the core's parameters in registration order; ``group_of`` maps
    ``id(param)`` to its param-group index. Consecutive owned ranges of one bucket and one
    group are merged so the optimizer sees few, large tensors; ranges separated by an
    alignment gap ([Note: aligned slots] in csrc/engines/sharded/layout.h) are not, so the
    padding never reaches the optimizer and every segment starts 16-byte aligned."""
    master = core.master_shard
    runs: list[list[int]] = []  # [group, bucket, shard_offset, numel]
    for index, bucket, offset, _param_offset, numel in core.owned_ranges():
        group = group_of[id(params[index])]
        last = runs[-1] if runs else None
        if last and last[0] == group and last[1] == bucket and last[2] + last[3] == offset:
            last[3] += numel
        else:
            runs.append([group, bucket, offset, numel])
    out: dict[int, list[Segment]] = {}
    for group, bucket, offset, numel in runs:
        segment = Segment(master.narrow(0, offset, numel), core, offset, numel)
        out.setdefault(group, []).append(segment)
    return out

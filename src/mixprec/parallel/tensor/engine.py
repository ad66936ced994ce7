"""What a data-parallel engine reads when its model is tensor-parallel: the placements.

[Note: agreement over the mesh]
The engine's own collectives run on the DP group (the ranks holding the same slices), so
what it agrees is agreed per TP rank. Two things must be agreed by the whole world:

- found_inf: a TP rank's split gradients are its own, so an inf on one TP rank is seen
  there only. ``agree_found_inf`` adds a MAX over the TP group, and the one-call step
  ([Note: one call per step] in csrc/engines/step/fused_step.h) agrees over the world group;
- the gradient norm: split elements live on one TP rank each and replicated ones on every TP
  rank (with the same gradient, [Note: TP collectives and their autograd rules] in
  parallel/tensor/layers.py). The norm is ``sqrt(sum_TP(split^2) + replicated^2)``: the
  engine computes each part over its DP group as usual, then one all-reduce over the TP
  group sums the split part (and ORs the found_inf flag). Each element counts once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Optional

import torch
import torch.distributed as dist

from .layers import TPGroup


class TPPlacement:
    """Where a tensor-parallel model's parameters live: the TP group, the world group's name,
    and the ids of the split parameters (every other parameter is replicated over the TP
    group). Data the Engine reads around its comm's collectives ([Note: agreement over the
    mesh]); the comm itself is the data-parallel backend's, unchanged."""

    def __init__(self, tp: TPGroup, world_group_name: str, split_ids: Iterable[int]) -> None:
        self.tp = tp
        self.world_group_name = world_group_name
        self.split_ids = set(split_ids)
        self._grad_split: dict[int, bool] = {}  # id(grad) -> split, for the norm (replicated comms)

    def add(self, split_ids: Iterable[int]) -> None:
        """Another prepared model's split parameters."""
        self.split_ids |= set(split_ids)

    # ------------------------------------------------------------- found_inf
    def agree_found_inf(self, precision) -> None:
        """After the comm agreed found_inf over its DP group: a MAX over the TP group."""
        if self.tp.size > 1:
            dist.all_reduce(precision.found_inf, op=dist.ReduceOp.MAX, group=self.tp.group)

    def step_finish(self, finish: dict) -> dict:
        """The one-call step agrees found_inf over every rank ([Note: one call per step])."""
        if self.tp.size > 1:
            finish["agree_group"] = self.world_group_name
        return finish

    # ------------------------------------------------------------------ norm
    def note_clip(self, comm, params: list) -> None:
        """Which of the gradients a norm clip reads are split (comms that hand out
        per-parameter gradients; a sharded comm's owned ranges say it themselves)."""
        if not hasattr(comm, "all_cores"):
            grad_of = comm.precision.grad_of
            self._grad_split = {id(g): id(p) in self.split_ids for p in params if (g := grad_of(p)) is not None}

    def _split_grads(self, comm, grads: list[torch.Tensor]) -> tuple[list, list]:
        """(gradients of split parameters, of replicated ones) for the norm."""
        if hasattr(comm, "all_cores"):  # sharded: each owned range of the flat shards
            split, rep = [], []
            for core in comm.all_cores():
                shard = core.grad_shard
                if shard is None:
                    continue
                params = core.params
                for index, _bucket, offset, _poff, numel in core.owned_ranges():
                    view = shard.narrow(0, offset, numel)
                    (split if id(params[index]) in self.split_ids else rep).append(view)
            return split, rep
        split = [g for g in grads if self._grad_split.get(id(g), False)]
        rep = [g for g in grads if not self._grad_split.get(id(g), False)]
        return split, rep

    def global_norm(self, comm, grads: list[torch.Tensor], norm_type: float,
                    check: Optional[torch.Tensor]) -> torch.Tensor:
        """``sqrt(sum over TP of split^2 + replicated^2)``: each part over the comm's DP
        group, then one all-reduce over the TP group that also ORs found_inf."""
        if self.tp.size == 1:
            return comm.global_norm(grads, norm_type, check)
        p = float(norm_type)
        split, rep = self._split_grads(comm, grads)
        n_split = comm.global_norm(split, norm_type, check).double().reshape(())
        n_rep = comm.global_norm(rep, norm_type, check).double().reshape(())
        found_inf = comm.precision.found_inf
        device = comm.device
        if p == math.inf:
            packet = torch.stack([n_split.to(device), found_inf.double().reshape(()).to(device)])
            dist.all_reduce(packet, op=dist.ReduceOp.MAX, group=self.tp.group)
            total = torch.maximum(packet[0], n_rep.to(packet.device))
        else:
            packet = torch.stack([(n_split ** p).to(device), found_inf.double().reshape(()).to(device)])
            dist.all_reduce(packet, op=dist.ReduceOp.SUM, group=self.tp.group)
            total = (packet[0] + n_rep.to(packet.device) ** p) ** (1.0 / p)
        found_inf.copy_(packet[1:2].gt(0))
        return total.float()

    # ------------------------------------------------------------ checkpoints
    # [Note: TP checkpoints] in parallel/tensor/checkpoint.py: split tensors are saved whole.
    @staticmethod
    def _split_infos(models) -> dict:
        from . import layout_of
        from .checkpoint import split_infos

        return split_infos(models, layout_of)

    def state_names(self, names: dict, models) -> dict:
        from .checkpoint import full_state_names

        return full_state_names(names, self._split_infos(models))

    def state_shards(self, shards: list, models) -> list:
        from .checkpoint import whole_shards

        return whole_shards(shards, self._split_infos(models), self.tp)

    def reader(self, read, models):
        from .checkpoint import SliceReader

        return SliceReader(read, self._split_infos(models))

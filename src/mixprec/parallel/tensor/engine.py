"""What a data-parallel engine adds when its model is tensor-parallel.

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

_CLASSES: dict[type, type] = {}


class TPCommMixin:
    """Placed in front of a Comm class (``tp_comm_class``); ``tp`` and ``split_ids`` are set
    by the Accelerator once the model is split (``attach_tp``)."""

    tp: Optional[TPGroup] = None
    world_group_name: str = ""

    def attach_tp(self, tp: TPGroup, world_group_name: str, split_ids: Iterable[int]) -> None:
        self.tp = tp
        self.world_group_name = world_group_name
        self.split_ids = set(getattr(self, "split_ids", set())) | set(split_ids)
        self._grad_split: dict[int, bool] = {}

    # ------------------------------------------------------------- found_inf
    def agree_found_inf(self) -> None:
        super().agree_found_inf()
        if self.tp is not None and self.tp.size > 1:
            dist.all_reduce(self.precision.found_inf, op=dist.ReduceOp.MAX, group=self.tp.group)

    def step_finish(self, state, finish: dict) -> dict:
        finish = super().step_finish(state, finish)
        if self.tp is not None and self.tp.size > 1:
            finish["agree_group"] = self.world_group_name  # found_inf over every rank
        return finish

    # ------------------------------------------------------------------ norm
    def clip_grads(self, parameters, *, whole: bool) -> list[torch.Tensor]:
        params = list(parameters)
        grads = super().clip_grads(params, whole=whole)
        if whole and not hasattr(self, "all_cores"):
            grad_of = self.precision.grad_of
            self._grad_split = {id(g): id(p) in self.split_ids for p in params if (g := grad_of(p)) is not None}
        return grads

    def _split_grads(self, grads: list[torch.Tensor]) -> tuple[list, list]:
        """(gradients of split parameters, of replicated ones) for the norm."""
        if hasattr(self, "all_cores"):  # sharded: each owned range of the flat shards
            split, rep = [], []
            for core in self.all_cores():
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

    def global_norm(self, grads: list[torch.Tensor], norm_type: float,
                    check: Optional[torch.Tensor]) -> torch.Tensor:
        if self.tp is None or self.tp.size == 1:
            return super().global_norm(grads, norm_type, check)
        p = float(norm_type)
        split, rep = self._split_grads(grads)
        n_split = super().global_norm(split, norm_type, check).double().reshape(())
        n_rep = super().global_norm(rep, norm_type, check).double().reshape(())
        found_inf = self.precision.found_inf
        if p == math.inf:
            packet = torch.stack([n_split.to(self.device), found_inf.double().reshape(()).to(self.device)])
            dist.all_reduce(packet, op=dist.ReduceOp.MAX, group=self.tp.group)
            total = torch.maximum(packet[0], n_rep.to(packet.device))
        else:
            packet = torch.stack([(n_split ** p).to(self.device), found_inf.double().reshape(()).to(self.device)])
            dist.all_reduce(packet, op=dist.ReduceOp.SUM, group=self.tp.group)
            total = (packet[0] + n_rep.to(packet.device) ** p) ** (1.0 / p)
        found_inf.copy_(packet[1:2].gt(0))
        return total.float()


    # ------------------------------------------------------------ checkpoints
    # [Note: TP checkpoints] in parallel/tensor/checkpoint.py: split tensors are saved whole.
    def _split_infos(self, models) -> dict:
        from . import layout_of
        from .checkpoint import split_infos

        return split_infos(models, layout_of)

    _raw_shards = False  # state_names reads the engine's own shapes: no collective

    def state_names(self, models) -> dict:
        from .checkpoint import full_state_names

        self._raw_shards = True
        try:
            names = super().state_names(models)
        finally:
            self._raw_shards = False
        return full_state_names(names, self._split_infos(models))

    def state_shards(self, models, optimizers) -> list:
        from .checkpoint import whole_shards

        shards = super().state_shards(models, optimizers)
        return shards if self._raw_shards else whole_shards(shards, self._split_infos(models), self.tp)

    def load_state_shards(self, models, optimizers, read) -> None:
        from .checkpoint import SliceReader

        super().load_state_shards(models, optimizers, SliceReader(read, self._split_infos(models)))


def tp_comm_class(base: type) -> type:
    """``base`` (a Comm class) with [Note: agreement over the mesh]."""
    if base not in _CLASSES:
        _CLASSES[base] = type(f"TP{base.__name__}", (TPCommMixin, base), {"__module__": __name__})
    return _CLASSES[base]

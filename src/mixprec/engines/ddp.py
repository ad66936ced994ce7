"""``backend="ddp"``: replicated parameters, gradients all-reduced by the C++ Reducer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist
from torch import nn

from .. import _C
from ..policy import PrecisionPolicy
from .comm import GroupComm

if TYPE_CHECKING:  # pragma: no cover
    from .base import OptimizerState


class DDPComm(GroupComm):
    """Data parallel: every rank holds the whole model; gradients are averaged in buckets
    that are all-reduced while backward is still running (see csrc/engines/replicated).
    The Reducer's hooks also fold low-precision gradients into the fp32 masters.

    Gradients end up identical on every rank, so the loss-scaler decision, the gradient
    norm and the optimizer step need no further communication.
    """

    name = "ddp"

    def __init__(
        self,
        policy: PrecisionPolicy,
        device: torch.device,
        *,
        group: Optional[dist.ProcessGroup] = None,
        bucket_cap_mb: float = 25.0,
        first_bucket_cap_mb: float = 1.0,
        find_unused_parameters: bool = False,
        broadcast_buffers: bool = True,
    ) -> None:
        super().__init__(policy, device, group=group, bucket_cap_mb=bucket_cap_mb,
                         first_bucket_cap_mb=first_bucket_cap_mb, broadcast_buffers=broadcast_buffers)
        self.reducer_options = _C.ReducerOptions(
            bucket_cap_bytes=self.bucket_cap_bytes,
            first_bucket_cap_bytes=self.first_bucket_cap_bytes,
            reduce_dtype=policy.reduce_dtype,
            find_unused_parameters=find_unused_parameters,
            # bf16/fp32: the copy into the buckets is the non-finite guard's pass ([Note:
            # non-finite check in the copy-in], csrc/engines/replicated/reducer.h); fp16
            # checks in the scaler's unscale.
            check_nonfinite=not policy.loss_scaling,
        )
        self.reducers: dict[int, _C.Reducer] = {}  # id(model) -> its reducer
        self._reduced: set[int] = set()  # id() of every tensor whose .grad a reducer fills
        self._reducer_checked = False  # this iteration's reducer checks are in found_inf

    def describe_layout(self, model: nn.Module) -> str:
        buckets = len(self.reducers[id(model)].bucket_indices())
        return f"{buckets} gradient bucket(s) ({self._bucket_caps()})"

    def prepare_model(self, model: nn.Module, fp32_modules: Sequence[nn.Module]) -> None:
        master_of = self.precision.master_of
        names, params, targets = [], [], []
        for name, p in model.named_parameters():
            if p.requires_grad:
                names.append(name)
                params.append(p)
                targets.append(master_of.get(id(p), p))
        if not params:
            raise ValueError(f"{type(model).__name__} has no trainable parameters to train with ddp")
        self.reducers[id(model)] = _C.Reducer(params, targets, names, self.group_name, self.reducer_options)
        self._reduced.update(id(t) for t in targets)

    def sync_parts(self, model: nn.Module) -> list:
        reducer = self.reducers.get(id(model))
        if reducer is None:
            raise ValueError(f"no_sync() got a model that this accelerator did not prepare: {type(model).__name__}")
        return [reducer]

    def release(self) -> None:
        self.reducers.clear()  # their destructors remove the gradient hooks

    def fold(self) -> None:
        return None  # the Reducer's hooks fold low-precision grads into the masters in backward

    def checked(self, optimizer: torch.optim.Optimizer) -> bool:
        # [Note: non-finite check in the copy-in] (csrc/engines/replicated/reducer.h): the
        # Reducer checked every gradient it reduced, and agreed the flag, during backward.
        return self.precision.scaler is None and self._covered(optimizer) and (
            self._reducer_checked or self._take_reducer_checks())

    def step_finish(self, state: "OptimizerState", finish: dict) -> dict:
        # The Reducers' flags replace the check pass when each has a fresh one (C++ takes
        # them, [Note: one call per step]); the flags merged already this iteration do too.
        if not finish["check"] or self.precision.scaler is not None or not self._covered(state.optimizer):
            return finish
        if self._reducer_checked:
            finish["check"] = False
        else:
            finish["reducers"] = list(self.reducers.values())
        return finish

    def checks_cleared(self) -> None:
        self._reducer_checked = False  # found_inf was cleared with them

    def _covered(self, optimizer: torch.optim.Optimizer) -> bool:
        """Every parameter of ``optimizer`` gets its gradient from a reducer."""
        reduced = self._reduced
        return all(id(p) in reduced for g in optimizer.param_groups for p in g["params"])

    def _take_reducer_checks(self) -> bool:
        """OR every reducer's fresh agreed flag into found_inf (on the device); False when
        some reducer has none (its model had no synchronising backward since)."""
        self._reducer_checked = _C.merge_nonfinite_checks(list(self.reducers.values()),
                                                          self.precision.found_inf)
        return self._reducer_checked

    def bytes_reduced_last_backward(self) -> int:
        """Gradient bytes all-reduced by the last synchronising backward (all models)."""
        return sum(r.bytes_reduced_last_backward() for r in self.reducers.values())

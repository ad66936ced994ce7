"""``backend="ddp"``: replicated parameters, gradients all-reduced by the C++ Reducer."""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from .. import _C
from ..policy import PrecisionPolicy
from ..wrappers.model import AutocastGate
from . import comm
from .base import Engine, OptimizerState


class DDPEngine(Engine):
    """Data parallel: every rank holds the whole model; gradients are averaged in buckets
    that are all-reduced while backward is still running (see csrc/engines/replicated).

    Gradients end up identical on every rank, so the loss-scaler decision, the gradient
    norm and the optimizer step need no further communication.
    """

    name = "ddp"
    replicated_state = True
    distributed = True

    def __init__(
        self,
        policy: PrecisionPolicy,
        device: torch.device,
        *,
        fused_optimizer: bool = True,
        group: Optional[dist.ProcessGroup] = None,
        bucket_cap_mb: float = 25.0,
        first_bucket_cap_mb: float = 1.0,
        find_unused_parameters: bool = False,
        broadcast_buffers: bool = True,
    ) -> None:
        super().__init__(policy, device, fused_optimizer=fused_optimizer)
        # The communication group and the name C++ resolves it by.
        self.group, self.group_name, self.world_size = comm.process_group(self.name, group)
        comm.check_bucket_caps(bucket_cap_mb=bucket_cap_mb, first_bucket_cap_mb=first_bucket_cap_mb)
        self.reducer_options = _C.ReducerOptions(
            bucket_cap_bytes=int(bucket_cap_mb * 2**20),
            first_bucket_cap_bytes=int(first_bucket_cap_mb * 2**20),
            reduce_dtype=policy.reduce_dtype,
            find_unused_parameters=find_unused_parameters,
            # bf16/fp32: the copy into the buckets is the non-finite guard's pass ([Note:
            # non-finite check in the copy-in], csrc/engines/replicated/reducer.h); fp16
            # checks in the scaler's unscale.
            check_nonfinite=not policy.loss_scaling,
        )
        self.broadcast_buffers = broadcast_buffers  # rank 0's buffers before every forward
        self.reducers: dict[int, _C.Reducer] = {}  # id(model) -> its reducer
        self._reduced: set[int] = set()  # id() of every tensor whose .grad a reducer fills
        self._reducer_checked = False  # this iteration's reducer checks are in found_inf

    def prepare_model(self, model: nn.Module, gate: AutocastGate) -> nn.Module:
        model.to(self.device)
        comm.start_replicas(model, self.group, self.group_name)
        super().prepare_model(model, gate)
        names, params, targets = [], [], []
        for name, p in model.named_parameters():
            if p.requires_grad:
                names.append(name)
                params.append(p)
                targets.append(self.master_of.get(id(p), p))
        if not params:
            raise ValueError(f"{type(model).__name__} has no trainable parameters to train with ddp")
        self.reducers[id(model)] = _C.Reducer(params, targets, names, self.group_name, self.reducer_options)
        self._reduced.update(id(t) for t in targets)
        if self.broadcast_buffers:
            comm.install_buffer_sync(model, self.group_name)
        return model

    def release(self) -> None:
        self.reducers.clear()  # their destructors remove the gradient hooks
        super().release()

    def _unscale_local(self, state: OptimizerState) -> None:
        # [Note: non-finite check in the copy-in] (csrc/engines/replicated/reducer.h): the
        # Reducer checked every gradient it reduced, and agreed the flag, during backward.
        if not state.unscaled and self.scaler is None and self._covered(state.optimizer) and (
                self._reducer_checked or self._take_reducer_checks()):
            state.unscaled = True  # checked; unscaling is x1
            return
        super()._unscale_local(state)

    def _step_finish(self, state: OptimizerState) -> dict:
        # The Reducers' flags replace the check pass when each has a fresh one (C++ takes
        # them, [Note: one call per step]); the flags merged already this iteration do too.
        if state.unscaled or self.scaler is not None or not self._covered(state.optimizer):
            return super()._step_finish(state)
        if self._reducer_checked:
            return {"check": False}
        return {"check": True, "reducers": list(self.reducers.values())}

    def _covered(self, optimizer: torch.optim.Optimizer) -> bool:
        """Every parameter of ``optimizer`` gets its gradient from a reducer."""
        reduced = self._reduced
        return all(id(p) in reduced for g in optimizer.param_groups for p in g["params"])

    def _take_reducer_checks(self) -> bool:
        """OR every reducer's fresh agreed flag into found_inf (on the device); False when
        some reducer has none (its model had no synchronising backward since)."""
        self._reducer_checked = _C.merge_nonfinite_checks(list(self.reducers.values()), self.found_inf)
        return self._reducer_checked

    def _end_step(self, state: OptimizerState, result) -> None:
        super()._end_step(state, result)
        if not any(s.unscaled for s in self.optimizers.values()):
            self._reducer_checked = False  # found_inf was cleared with it

    def fold_grads(self) -> None:
        # The Reducer's hooks fold low-precision grads into the masters during backward.
        return None

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module):
        reducer = self.reducers.get(id(model))
        if reducer is None:
            raise ValueError(f"no_sync() got a model that this accelerator did not prepare: {type(model).__name__}")
        with comm.sync_off([reducer]):
            yield

    def bytes_reduced_last_backward(self) -> int:
        """Gradient bytes all-reduced by the last synchronising backward (all models)."""
        return sum(r.bytes_reduced_last_backward() for r in self.reducers.values())

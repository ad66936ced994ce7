"""The engine: the step driver that composes the precision layer with a backend's
communication ([Note: engine = precision + communication] in engines/comm.py).

``Engine(policy, device, comm_cls, **engine_options)`` builds ``self.comm`` (a
:class:`~mixprec.engines.comm.Comm`: single, ddp, zero1/2/3, fsdp) and ``self.precision``
(engines/precision.py) and runs one code path for every backend: prepare, backward,
unscale with the non-finite check, clip, the step ([Note: a step without host reads], one
call into C++ per step), zero_grad and the checkpoint contract. Where backends differ it
calls the comm's hooks; it holds no backend state itself.
"""

from __future__ import annotations

import collections
import logging
from typing import Iterable, Optional

import torch
from torch import nn
from torch.optim import optimizer as optim_mod

from .. import cuda_arch, kernels
from ..errors import NonFiniteGradientsError, UnscaledBackwardError
from ..parallel import materialize
from ..policy import PrecisionPolicy
from ..step import DeviceScalars, StepResult, check_clip_limit
from ..wrappers.half_gemm import wanted as half_gemm_wanted
from ..wrappers.model import AutocastGate
from .precision import Precision
from .clip_sources import ClipSources, PlannedParameters, plans_of
from .comm import Comm
from .single import SingleComm

logger = logging.getLogger("mixprec")


class OptimizerState:
    """Bookkeeping for one prepared optimizer between two steps."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer  # the user's optimizer; its param_groups hold masters
        self.unscaled = False  # grads already unscaled (and checked) this step
        self.grad_norm: Optional[torch.Tensor] = None  # set by clip_grad_norm_ this step
        # [Note: clip inside the update] the factor the update still owes the gradients
        # (fp16 1/scale times the clip coefficient, a device scalar), or None.
        self.grad_scale: Optional[torch.Tensor] = None
        self.last: Optional[StepResult] = None  # outcome of the last real step
        self.steps = 0  # real step() calls so far (the number an error or warning names)
        self._skipped_host = 0  # skips decided on the host
        self._skipped_device: Optional[torch.Tensor] = None  # sum of device-decided skips
        self.logged_skips = 0  # skipped steps logged so far (counted on the host as logged)

    @property
    def skipped(self) -> int:
        """Steps skipped for overflow / non-finite gradients so far (reads the device count)."""
        device = 0 if self._skipped_device is None else int(self._skipped_device.item())
        return self._skipped_host + device

    @skipped.setter
    def skipped(self, value: int) -> None:
        self._skipped_host = int(value)
        self._skipped_device = None

    def forget_grads(self) -> None:
        """The gradients were zeroed: nothing checked, clipped or owed for them any more."""
        self.unscaled = False
        self.grad_norm = None
        self.grad_scale = None

    def count_skip(self, found_inf: Optional[torch.Tensor]) -> None:
        """Add this step to the skip count: on the host (None) or as a device sum."""
        if found_inf is None:
            self._skipped_host += 1
        elif self._skipped_device is None:
            self._skipped_device = found_inf.detach().reshape(()).ne(0).to(torch.int64)
        else:
            self._skipped_device.add_(found_inf.detach().reshape(()).ne(0))


class Engine:
    """The step driver over ``self.precision`` and ``self.comm`` (see the module docstring).

    Lifecycle: ``prepare_model`` -> ``prepare_optimizer`` -> per step ``backward``
    (any number, inside ``no_sync`` while accumulating), ``clip_grad_norm_``
    (optional), ``step``, ``zero_grad``.

    Example::

        engine = Engine(PrecisionPolicy.from_mixed_precision("bf16"), torch.device("cpu"))
        engine.prepare_model(model, AutocastGate())
        state = engine.prepare_optimizer(optimizer)
        engine.backward(loss)
        engine.step(state)          # StepResult(stepped=True, reason='ok', ...)
    """

    def __init__(self, policy: PrecisionPolicy, device: torch.device, comm_cls: type[Comm] = SingleComm,
                 *, fused_optimizer: bool = True, **engine_options) -> None:
        if device.type == "cuda" and fused_optimizer:  # a GPU the kernels lack: refused (cuda_arch.py)
            cuda_arch.check_device(device)
        self.comm = comm_cls(policy, device, **engine_options)  # the backend's communication
        self.policy = self.comm.policy  # resolved precision policy (a comm may adjust it)
        self.device = device  # where parameters and gradients live
        # Tensor parallelism's placements (parallel/tensor/engine.py TPPlacement): which
        # parameters are split over the TP group; found_inf, the norm and checkpoints read it.
        self.placement = None
        self.fused_optimizer = fused_optimizer  # use the C++ fused Adam/AdamW/SGD when eligible
        # config clip_in_step: clip_grad_norm_ leaves the multiply to the fused update
        # ([Note: clip inside the update]).
        self.clip_in_step = True
        # config cache_weight_casts: on the replicated backends the fused update writes the
        # forward's bf16/fp16 weights ([Note: the update writes the forward's weights] in
        # engines/weight_casts.py). Read by prepare_model.
        self.cache_weight_casts = True
        # config cpu_fp16_matmul: fp16 matmuls on a CPU without fp16 arithmetic run as
        # widened fp32 GEMMs (wrappers/half_gemm.py). Read by prepare_model.
        self.cpu_fp16_matmul = "auto"
        self.precision = Precision(self.policy, device)  # [Note: precision layer] in precision.py
        self.comm.attach(self.precision)
        self.optimizers: dict[int, OptimizerState] = {}  # id(optimizer) -> state
        # Prepared models' parameter tuples for clip_grad_norm_ ([Note: the clip shares the
        # step plan] in engines/clip_sources.py).
        self.clip_sources = ClipSources()
        # Step results whose skips are not logged yet (see Engine._log_skips).
        self._unlogged: collections.deque = collections.deque()

    # The backend, read through the engine (one owner: self.comm).
    name = property(lambda self: self.comm.name)
    distributed = property(lambda self: self.comm.distributed)
    replicated_state = property(lambda self: self.comm.replicated_state)

    # The backends' own public methods, reachable as ``accelerator.engine.<name>`` where the
    # backend has them (docs/zero.md, docs/fsdp.md, docs/migrating.md); absent otherwise,
    # so ``hasattr(engine, "unit_names")`` says whether the backend has units.
    BACKEND_API = frozenset({
        "full_params", "unit_names", "param_buffer_bytes",  # zero3 / fsdp
        "coalesce_grad_reduction", "comm_counters", "reset_comm_counters", "persistent_bytes",
        "bytes_communicated_last_step",  # zero / fsdp
        "bytes_reduced_last_backward",  # ddp
    })

    def __getattr__(self, name: str):
        comm = self.__dict__.get("comm")
        if comm is not None and name in Engine.BACKEND_API and hasattr(comm, name):
            return getattr(comm, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}"
                             + (f" (backend {comm.name!r} has no {name})" if comm is not None
                                and name in Engine.BACKEND_API else ""))

    # The precision layer's state, read through the engine (one owner: self.precision).
    scaler = property(lambda self: self.precision.scaler)
    masters = property(lambda self: self.precision.masters)
    master_of = property(lambda self: self.precision.master_of)
    lowp_of = property(lambda self: self.precision.lowp_of)
    found_inf = property(lambda self: self.precision.found_inf)
    nonfinite_grads = property(lambda self: self.precision.nonfinite_grads)

    def set_nonfinite_policy(self, policy: str) -> None:
        self.precision.set_nonfinite_policy(policy)

    def release(self) -> None:
        """Drop what holds the process group (end of training) and the forward's weight
        copies; the engine is unusable after."""
        self.comm.release()
        if self.precision.casts is not None:
            self.precision.casts.release()
        self.clip_sources.drop()

    # ------------------------------------------------------------------ models
    def prepare_model(self, model: nn.Module, gate: AutocastGate) -> nn.Module:
        """Move ``model`` to the device, apply the storage policy (fp32 masters on the
        replicated backends, shards on the sharded ones), hand its gradients to the comm
        and make its forward follow the policy. Returns the same object."""
        if materialize.has_meta(model):  # zero3/fsdp materialise it a unit at a time (comm.prepare_model)
            materialize.to_device(model, self.device)
        else:
            model.to(self.device)
        comm, precision = self.comm, self.precision
        comm.start(model)
        fp32_modules = precision.fp32_modules(model)
        target = self.policy.param_dtype
        input_dtype = target if target is not None else _dominant_dtype(model)
        if not comm.owns_masters:
            precision.store_params(model, fp32_modules)
        comm.prepare_model(model, fp32_modules)
        # The sharded backends step shards, not the model's weights: they keep autocast's casts.
        ctx = precision.install_forward(model, input_dtype, gate, fp32_modules, self.zero_model_grads,
                                        cache_casts=self.cache_weight_casts and self.fused_optimizer
                                        and comm.replicated_state,
                                        half_gemm=half_gemm_wanted(self.cpu_fp16_matmul))
        comm.model_ready(model, ctx)
        self.clip_sources.add_model(model)
        return model

    def zero_model_grads(self, model: nn.Module, set_to_none: bool = True) -> None:
        """``model.zero_grad(set_to_none)`` on a prepared model also clears its masters' grads
        (and, on the sharded backends, the gradient memory the engine keeps for it)."""
        self.precision.drop_master_grads(model)
        self.comm.zero_model_grads(model, set_to_none)

    def full_state_dict(self, model: nn.Module) -> dict:
        """``model.state_dict()`` with every parameter in full precision (fp32 masters; on
        the sharded backends gathered from the shards, a collective)."""
        # keep_vars: zero3/fsdp parameters have no data here (engines/gathered.py); the
        # sharded ones are replaced by their gathered masters, the rest detached below.
        state = model.state_dict(keep_vars=True)
        self.precision.fill_masters(model, state)
        self.comm.fill_full_state(model, state)
        for name, value in state.items():
            if isinstance(value, torch.Tensor):
                state[name] = value.detach()
        return state

    # --------------------------------------------------------------- optimizers
    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> OptimizerState:
        """Point the optimizer at what it steps: the fp32 masters (its own state moves
        with them), or this rank's shard segments."""
        if not self.comm.owns_masters:
            self.precision.steps_masters(optimizer)
        self.comm.prepare_optimizer(optimizer)
        casts = self.precision.casts
        if casts is not None and self._fused_eligible(optimizer):
            casts.track(p for group in optimizer.param_groups for p in group["params"])
        state = OptimizerState(optimizer)
        self.optimizers[id(optimizer)] = state
        return state

    @staticmethod
    def _grads(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        return [
            p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None
        ]

    def fold_grads(self) -> None:
        """Make every optimizer's gradients current: fold pending low-precision grads into
        the fp32 masters, or finish the sharded reductions (once between a backward and
        the end of the step)."""
        self.comm.fold()

    # ------------------------------------------------------------------ steps
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.precision.scale_loss(loss)

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        self.comm.grads_changed()
        self.scale_loss(loss).backward(**kwargs)
        self.comm.after_backward()

    def no_sync(self, model: nn.Module):
        """Context in which gradients accumulate locally without communication."""
        return self.comm.no_sync(model)

    def unscale_(self, state: OptimizerState) -> None:
        """Unscale this optimizer's grads and record non-finite ones (once per step)."""
        # [Note: non-finite guard]
        # Every precision checks its gradients for inf/nan once per step, in the pass that
        # already reads them: fp16 in the unscale kernel, bf16/fp32 in the SAME kernel with
        # scale 1 (x * 1.0f is x bitwise, nan stays nan): one pass over the gradients, the
        # one fp16 already pays, and clip_grad_norm_ reuses it (the step does not check
        # again). The kernel writes what it reads; a read-only variant in csrc/kernels would
        # halve the bf16/fp32 traffic (not done). Sharded engines all-reduce the flag (see
        # [Note: found_inf agreement] in engines/zero.py); ddp needs no agreement because
        # its all-reduced gradients carry a nan from any rank to every rank. A flagged step
        # is skipped by the fused kernels on the device (by the host for other
        # optimizers), so weights, fp32 masters and optimizer state stay bitwise unchanged.
        self._unscale_local(state)
        self._materialize(state)
        self.comm.agree_found_inf()
        if self.placement is not None:
            self.placement.agree_found_inf(self.precision)

    def _materialize(self, state: OptimizerState) -> None:
        """Apply a clip left to the update ([Note: clip inside the update]) to the gradients
        in place: for a caller that reads them, or an update that is not fused."""
        if state.grad_scale is None:
            return
        grads = self._grads(state.optimizer)
        if grads:
            with torch.no_grad():
                torch._foreach_mul_(grads, state.grad_scale.to(grads[0].device))
        state.grad_scale = None

    def _unscale_local(self, state: OptimizerState) -> None:
        """This rank's unscale + check of ``state``'s gradients, without any agreement
        (none when the comm already checked them: ddp's copy-in, [Note: non-finite check
        in the copy-in] in csrc/engines/replicated/reducer.h; unscaling is then x1)."""
        self.fold_grads()
        if state.unscaled:
            return
        if not self.comm.checked(state.optimizer):
            self.precision.unscale_(self._grads(state.optimizer))
        state.unscaled = True

    def grad_of(self, p: torch.Tensor) -> Optional[torch.Tensor]:
        """The gradient the optimizer reads for model parameter ``p`` (replicated backends)."""
        return self.precision.grad_of(p)

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Clip the gradients of ``parameters`` by their global norm (torch's rule) and
        return that norm. The sharded backends compute it over every parameter they shard
        from the owned shards, with one all-reduce that also agrees found_inf."""
        max_norm = check_clip_limit("max_norm", max_norm)
        parameters = self.clip_sources.parameters(parameters)
        planned = None if self.placement is not None else self._planned_clip(parameters, norm_type)
        if planned is not None:
            try:
                return self._clip(planned, max_norm, norm_type, planned)
            except kernels.StalePlan:
                # A plan's containers changed in place, or a param outside the plans holds a
                # gradient ([Note: the plan's sources]): nothing was computed; the plans are
                # rebuilt at the step, and this clip takes the general path.
                for state in self.optimizers.values():
                    kernels.forget_plan(state.optimizer)
        return self._clip(parameters, max_norm, norm_type, None)

    def _clip(self, parameters, max_norm: float, norm_type: float,
              planned: Optional[PlannedParameters]) -> torch.Tensor:
        grads = self.comm.clip_grads(parameters, whole=True)
        if self.placement is not None:
            self.placement.note_clip(self.comm, parameters)
        deferred = planned is not None or self._clip_deferrable(grads, norm_type)
        if deferred:
            # [Note: clip inside the update] one read of the gradients: the norm, with the
            # non-finite check folded in (a non-finite norm is a non-finite gradient).
            unscaled = next(iter(self.optimizers.values())).unscaled
            check = None if unscaled else self.found_inf
        else:
            for state in self.optimizers.values():
                self._unscale_local(state)  # a sharded comm agrees found_inf with the norm
                self._materialize(state)
            check = None
        total = (self.comm.global_norm(grads, norm_type, check) if self.placement is None
                 else self.placement.global_norm(self.comm, grads, norm_type, check))
        if deferred:
            return self._defer_clip(total, max_norm, unscaled)
        return self._clip_now(grads, total, max_norm)

    def _planned_clip(self, parameters, norm_type: float) -> Optional[PlannedParameters]:
        """``parameters`` with the step plans of every optimizer when the clip can take its
        norm over the plans' gradients and leave the multiply to the update ([Note: the clip
        shares the step plan] in engines/clip_sources.py): a prepared model's cached tuple
        covering exactly what the optimizers step, a comm whose clip_grads/global_norm are
        the base ones, every optimizer fused. None: the general path decides."""
        states = list(self.optimizers.values())
        comm_cls = type(self.comm)
        if not (self.clip_in_step and states and float(norm_type) == 2.0
                and comm_cls.clip_grads is Comm.clip_grads and comm_cls.global_norm is Comm.global_norm):
            return None
        if any(st.grad_scale is not None for st in states) or len({st.unscaled for st in states}) != 1:
            return None
        if not all(self._fused_eligible(st.optimizer) for st in states):
            return None
        optimizers = [st.optimizer for st in states]
        plans = plans_of(optimizers, self.comm.update_targets())
        if plans is None:
            return None
        master_of = self.precision.master_of
        outsiders = self.clip_sources.covers(parameters, lambda p: master_of.get(id(p), p), optimizers, plans)
        if outsiders is None:
            return None
        return PlannedParameters(parameters, plans, [kernels.plan_source(o) for o in optimizers], outsiders)

    def _clip_now(self, grads: list[torch.Tensor], total: torch.Tensor, max_norm: float) -> torch.Tensor:
        """Clip ``grads`` in place by the global norm ``total`` (torch's rule) and record it
        as this step's norm for every optimizer (the end of every in-place clip)."""
        Precision.clip_(grads, total, max_norm)
        for state in self.optimizers.values():
            state.grad_norm = total
        return total

    # [Note: clip inside the update]
    # torch's loop reads the gradients four times before the update: GradScaler.unscale_
    # (read + write), clip_grad_norm_'s norm (read) and its multiply (read + write). Here
    # clip_grad_norm_ reads them once, for the norm, with the inf/nan check folded in (a
    # non-finite gradient makes the norm non-finite; a norm that overflows fp32 counts as
    # non-finite too, and skips the step where torch would step with zeroed gradients).
    # fp16 takes the norm of the still-scaled gradients times 1/scale: the scale is a
    # power of two, so this is exactly the norm of the unscaled gradients. The multiply
    # the clip owes, 1/scale * min(1, max_norm / (norm + 1e-6)), is a device scalar handed
    # to the fused update as its gradient factor, so the update applies unscale and clip
    # in the pass that reads the gradients anyway: g * (1/s * c) == (g * 1/s) * c exactly,
    # as 1/s is a power of two, so the weights are bitwise those of torch's loop. The cost:
    # between clip_grad_norm_ and step() the gradients hold their unclipped (fp16: scaled)
    # values. Anything that reads them through mixprec first applies the factor in place
    # (unscale_gradients, clip_grad_value_, a second clip, a non-fused optimizer); a loop
    # that reads p.grad itself sets clip_in_step: false to clip in place, as torch does.
    # Used when every prepared optimizer is fused-eligible and the clipped gradients are
    # exactly theirs (one factor fits all); otherwise the gradients are clipped in place.

    def _clip_deferrable(self, grads: list[torch.Tensor], norm_type: float) -> bool:
        states = list(self.optimizers.values())
        if not (self.clip_in_step and grads and states and float(norm_type) == 2.0):
            return False
        if any(st.grad_scale is not None for st in states):
            return False  # clipped twice in one step: the second clip reads clipped values
        if len({st.unscaled for st in states}) != 1:
            return False  # some gradients already unscaled in place, some not
        if not all(self._fused_eligible(st.optimizer) for st in states):
            return False
        owned = {id(g) for st in states for g in self._grads(st.optimizer)}
        return len(owned) == len(grads) and owned == {id(g) for g in grads}

    def _defer_clip(self, raw: torch.Tensor, max_norm: float, unscaled: bool) -> torch.Tensor:
        """Record the clip of [Note: clip inside the update] given the norm ``raw`` of the
        gradients as they are (scaled unless ``unscaled``); returns the unscaled norm."""
        inv = None if unscaled else self.precision.inv_scale()  # None without a scaler
        total = raw if inv is None else raw * inv.reshape(())
        factor = (float(max_norm) / (total + 1e-6)).clamp(max=1.0)
        if inv is not None:
            factor = inv.reshape(()) * factor
        for state in self.optimizers.values():
            state.unscaled = True  # checked now, unscaled by the update
            state.grad_scale = factor
            state.grad_norm = total
        return total

    def clip_grad_value_(self, parameters: Iterable[torch.Tensor], clip_value: float) -> None:
        clip_value = check_clip_limit("clip_value", clip_value)
        for state in self.optimizers.values():
            self.unscale_(state)
        # Element-wise: on the sharded backends, clamping the owned shards is clamping the
        # whole gradient.
        for g in self.comm.clip_grads(parameters, whole=False):
            g.clamp_(min=-clip_value, max=clip_value)

    def _fused_eligible(self, optimizer: torch.optim.Optimizer) -> bool:
        if not self.fused_optimizer or not kernels.supports_fused(optimizer):
            return False
        # Step hooks registered on the optimizer would be bypassed: keep the generic path.
        return not (
            optimizer._optimizer_step_pre_hooks
            or optimizer._optimizer_step_post_hooks
            or optim_mod._global_optimizer_pre_hooks
            or optim_mod._global_optimizer_post_hooks
        )

    def step(self, state: OptimizerState, closure=None) -> StepResult:
        """One optimizer step under the policy. Weights change only if it reports stepped.

        [Note: a step without host reads]
        With a fused-eligible optimizer (torch Adam/AdamW/SGD) nothing here reads a device
        value: the kernels skip the update on the device when found_inf is set (agreed
        across ranks by the sharded engines, see [Note: found_inf agreement] in
        engines/zero.py), the step counters advance on the device ([Note: device step
        counters] in kernels.py), the scaler updates on the device, the skip count is a
        device sum, and the StepResult holds snapshots read only when asked ([Note: lazy
        step results] in step.py). Skipped steps are still logged: each step logs the
        earlier results whose values have arrived (on CPU, at once). Three things need
        the outcome on the host and read found_inf once: a closure, an optimizer the fused
        kernels do not cover, and ``nonfinite_grads: raise`` (it must raise now).

        Such a step is one call into C++ (``_step_in_one_call``, [Note: one call per step]
        in csrc/engines/step/fused_step.h); the code after it is the path of the steps it
        does not take: those three, and a step that creates optimizer state.
        """
        if closure is not None and not self.comm.steps_closures:
            raise NotImplementedError(
                f"optimizer.step(closure) on {self.name}: the closure's backward would not be "
                "reduced before the update; run backward in your loop and call step() without it"
            )
        try:
            return self._step(state, closure)
        finally:
            self.comm.step_done()

    def _step(self, state: OptimizerState, closure) -> StepResult:
        optimizer = state.optimizer
        self.fold_grads()
        state.steps += 1
        if self.scaler is not None:
            if closure is not None:
                raise NotImplementedError(
                    "optimizer.step(closure) with fp16 loss scaling: the closure would run an "
                    "unscaled backward; call accelerator.backward() in your loop instead"
                )
            if not self.precision.scaled_backward and self._grads(optimizer):
                raise UnscaledBackwardError(
                    "mixed_precision='fp16': these gradients come from a backward that did not "
                    "go through the loss scaler (loss.backward() was called directly). No update "
                    "was applied. Use accelerator.backward(loss), or "
                    "accelerator.scale(loss).backward()."
                )
        if closure is not None:
            # The gradients are computed inside optimizer.step(): nothing to check before it.
            self._apply_update(optimizer, closure, None, fused=False)
            result = StepResult(True, "ok", None, None)
            self._end_step(state, result)
            return result
        skip_reason = "overflow" if self.scaler is not None else "nonfinite"
        fused = self._fused_eligible(optimizer)  # checked once per step
        # A step that creates optimizer state is declined by the one call (nothing done) and
        # takes the path below, which reads found_inf once ([Note: the step plan]).
        if fused and not (self.scaler is None and self.nonfinite_grads == "raise"):
            result = self._step_in_one_call(state, skip_reason)
            if result is not None:
                self._unlogged.append((state, state.steps, result))
                self._log_skips()
                self._end_step(state, result)
                return result
        if state.grad_scale is None:
            self.unscale_(state)
        if not fused:
            self._materialize(state)
        if not fused or (self.scaler is None and self.nonfinite_grads == "raise"):
            result = self._step_decided_on_host(state, skip_reason, fused)
        else:
            values = DeviceScalars({
                "found_inf": self.found_inf,
                "loss_scale": None if self.scaler is None else self.scaler.scale,
                "grad_norm": state.grad_norm,
            })
            self._apply_update(optimizer, None, self.found_inf, fused=True, state=state)
            state.count_skip(self.found_inf)
            result = StepResult.deferred(values, skip_reason)
        self._unlogged.append((state, state.steps, result))
        self._log_skips()
        self.precision.after_step(id(optimizer), self.optimizers)
        self._end_step(state, result)
        if self.scaler is None and self.nonfinite_grads == "raise" and not result.stepped:
            raise NonFiniteGradientsError(
                f"optimizer step {state.steps}: non-finite (inf/nan) gradients under "
                f"mixed_precision={self.policy.name!r} (on at least one rank). Nothing was "
                "updated. Check this step's loss and inputs (torch.autograd.set_detect_anomaly "
                "finds the op), or set nonfinite_grads: skip to skip such steps",
                state.steps,
            )
        return result

    def _step_in_one_call(self, state: OptimizerState, skip_reason: str) -> Optional[StepResult]:
        """The step as ONE call into C++ ([Note: one call per step] in
        csrc/engines/step/fused_step.h): the check this step still owes, the engine's
        agreement and gather (``_step_finish``), the update with the clip's factor, the
        scaler update when the iteration ends. None: the fused kernels declined this
        optimizer's state layout, nothing was done."""
        optimizer = state.optimizer
        precision = self.precision
        update = precision.ends_iteration(id(optimizer), self.optimizers)
        keep_found_inf = torch.empty(1, dtype=torch.float32, device=self.device)
        keep_scale = None if self.scaler is None else torch.empty(1, dtype=torch.float32, device=self.device)
        if not self._fused_update(
                optimizer, inv_scale=state.grad_scale, found_inf=self.found_inf, scaler=self.scaler,
                update_scaler=update, keep_found_inf=keep_found_inf, keep_scale=keep_scale,
                **self._step_finish(state)):
            return None
        state.unscaled = True
        precision.after_step(id(optimizer), self.optimizers, updated=update)
        state.count_skip(keep_found_inf)
        return StepResult.deferred(DeviceScalars({
            "found_inf": keep_found_inf, "loss_scale": keep_scale, "grad_norm": state.grad_norm,
        }), skip_reason)

    def _step_finish(self, state: OptimizerState) -> dict:
        """What the one-call step still does around the update: the check, unless the
        clip or an explicit unscale did it, and what the comm adds (the found_inf
        agreement, the sharded gather, ddp's Reducer flags)."""
        finish = self.comm.step_finish(state, {"check": not state.unscaled})
        return finish if self.placement is None else self.placement.step_finish(finish)

    def _fused_update(self, optimizer: torch.optim.Optimizer, **kwargs) -> bool:
        """``kernels.fused_optimizer_step`` writing this engine's low-precision targets;
        False when the kernels declined the optimizer (nothing done). The forward's weight
        copies are made current before it; the update keeps them so ([Note: the update
        writes the forward's weights] in engines/weight_casts.py)."""
        casts = self.precision.casts
        if casts is not None:
            casts.before_update()
        if not kernels.fused_optimizer_step(optimizer, lowp_of=self.comm.update_targets(), **kwargs):
            return False
        # LRScheduler watches optimizer.step() through this flag to warn about calling
        # scheduler.step() first; the fused path did step.
        optimizer._opt_called = True
        return True

    def _step_decided_on_host(self, state: OptimizerState, skip_reason: str, fused: bool) -> StepResult:
        """The step when the host must know the outcome first (one read of found_inf)."""
        loss_scale = self.scaler.scale_value() if self.scaler is not None else None
        norm = None if state.grad_norm is None else float(state.grad_norm)
        if bool(self.found_inf.item()):
            state.count_skip(None)
            state.grad_scale = None  # the gradients are not used
            return StepResult(False, skip_reason, loss_scale, norm)
        self._apply_update(state.optimizer, None, None, fused=fused, state=state)
        return StepResult(True, "ok", loss_scale, norm)

    def _log_skips(self) -> None:
        """Log the skipped steps among the results whose values have arrived, in order."""
        pending = self._unlogged
        while pending and pending[0][2].ready():
            state, number, result = pending.popleft()
            if result.stepped:
                continue
            state.logged_skips += 1
            if result.reason == "overflow":
                logger.info("mixprec: optimizer step %d skipped: fp16 overflow at loss scale %g",
                            number, result.loss_scale)
            else:
                logger.warning(
                    "mixprec: optimizer step %d skipped: non-finite (inf/nan) gradients; weights, "
                    "fp32 masters and optimizer state unchanged (%d step(s) skipped so far)",
                    number, state.logged_skips,
                )

    # [Note: one scaler update per iteration]
    # The scale moves once per iteration however many optimizers step: after the last
    # prepared optimizer has stepped, or, when some optimizer does not step every
    # iteration, at the next scaled backward (Precision.after_step / scale_loss). Until
    # then found_inf is kept, so an overflow seen by an earlier optimizer's gradients
    # skips the later ones too (their states stay consistent with one scale).

    def _end_step(self, state: OptimizerState, result: StepResult) -> None:
        state.unscaled = False
        state.grad_norm = None
        state.grad_scale = None
        state.last = result
        if not any(s.unscaled for s in self.optimizers.values()):
            # The flag covers every optimizer checked this step (clip_grad_norm_ checks all
            # of them at once): cleared when the last of them has stepped.
            if self.scaler is None:
                self.precision.clear_nonfinite()
            self.comm.checks_cleared()

    def _apply_update(self, optimizer: torch.optim.Optimizer, closure, found_inf, *, fused: bool,
                      state: Optional[OptimizerState] = None) -> None:
        """The update, skipped on the device when ``found_inf`` is set (fused kernels);
        ``fused``: the step already found the optimizer eligible for them. ``state``'s
        pending gradient factor ([Note: clip inside the update]) goes into the kernel."""
        if closure is None and fused:
            factor = None if state is None else state.grad_scale
            if self._fused_update(optimizer, inv_scale=factor, found_inf=found_inf):
                # The kernel wrote the low-precision copies. A skipped sharded step left the
                # shards unchanged: gathering them again rewrites the same values, so the
                # skip needs no host decision here either.
                self.comm.publish(optimizer, False)
                return
        if found_inf is not None and bool(found_inf.item()):
            return  # the fused kernels declined this state layout: decided on the host
        if state is not None:
            self._materialize(state)
        optimizer.step(closure)
        self.write_back(optimizer)

    def write_back(self, optimizer: torch.optim.Optimizer) -> None:
        """Make an update the kernels did not write visible: refresh the low-precision
        params of this optimizer's masters, or the shards' and gather them."""
        self.precision.write_back(optimizer)
        self.comm.publish(optimizer, True)

    def zero_grad(self, state: OptimizerState, set_to_none: bool = True) -> None:
        optimizer = state.optimizer
        if not (set_to_none and kernels.drop_grads(optimizer)):
            optimizer.zero_grad(set_to_none=set_to_none)
        state.forget_grads()
        self.precision.drop_lowp_grads(state.optimizer)
        self.comm.zero_grad(state.optimizer, set_to_none)

    # ------------------------------------------------------------ scaler state
    def scaler_state_dict(self) -> dict:
        return self.precision.scaler_state_dict()

    def load_scaler_state_dict(self, state: dict) -> None:
        self.precision.load_scaler_state_dict(state)

    # ------------------------------------------------------------- checkpoints
    # The engines' public state interface: checkpoint/state.py reads and writes through
    # these and the scaler methods above, never through the Accelerator's internals.
    def state_names(self, models: list[nn.Module]) -> dict[str, tuple]:
        """Every global model tensor a checkpoint of ``models`` holds: name -> global shape
        (what ``load_state`` validates against before loading anything)."""
        names = self.comm.state_names(models)
        return names if self.placement is None else self.placement.state_names(names, models)

    def state_dtypes(self, models: list[nn.Module]) -> dict:
        """Global model tensor name -> the dtype this engine saves and loads it in: fp32
        for parameters with fp32 masters (the sharded backends keep one for every
        trainable parameter), the tensor's own dtype otherwise."""
        return self.comm.state_dtypes(models)

    def state_shards(self, models: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> list:
        """What this rank holds of every tensor a checkpoint saves, as
        :class:`mixprec.checkpoint.Shard` objects (the engine contract for checkpoints).

        Names: ``model/<param or buffer name>`` (``model<i>/`` for the i-th prepared model,
        i > 0) and ``optim/<j>/<param key>/<state key>`` for optimizer ``j``, where the
        param key is the parameter's name in its model (prefixed ``model<i>/`` for i > 0), so
        optimizer state can be loaded into another backend or world size. Parameters are
        given in full precision (their fp32 masters where there are). Each shard gives the
        GLOBAL shape and dtype, the flat range ``[offset, offset + numel)`` this rank holds
        and the flat local tensor; ``replicated=True`` means every rank holds the same whole
        tensor (only rank 0 writes it).

        The replicated backends (single, ddp) give whole tensors
        (engines/replicated_state.py), the sharded ones the slices they own
        (engines/zero_state.py).

        Example::

            shards = engine.state_shards([model], [optimizer])
            shards[0].name, shards[0].shape      # ('model/0.weight', (64, 16))
        """
        shards = self.comm.state_shards(models, optimizers)
        return shards if self.placement is None else self.placement.state_shards(shards, models)

    def load_state_shards(self, models: list[nn.Module], optimizers: list[torch.optim.Optimizer], read) -> None:
        """Load what :meth:`state_shards` names from a checkpoint, whatever wrote it.

        ``read(name, offset, numel)`` returns that flat range of a global tensor (assembled
        from whichever rank files hold it) and ``read.index`` maps every saved name to its
        ``(shape, dtype)``. Callers validate names and shapes first, and every byte of the
        checkpoint was verified by some rank before the ranks agreed to load ([Note: verified
        shares] in checkpoint/reader.py). An implementation plans first (every lookup that can
        fail: which name goes into which tensor) and only then reads, straight into the live
        tensors ([Note: in-place load] in engines/replicated_state.py), so a failure before the
        reads loads nothing. The sharded backends read only their slices.

        Example::

            engine.load_state_shards([model], [optimizer], reader)
        """
        if self.placement is not None:
            read = self.placement.reader(read, models)
        for optimizer in optimizers:  # their state tensors are replaced: plans rebuilt
            kernels.forget_plan(optimizer)
        try:
            self.comm.load_state_shards(models, optimizers, read)
        finally:
            for optimizer in optimizers:
                kernels.forget_plan(optimizer)


def _dominant_dtype(model: nn.Module) -> Optional[torch.dtype]:
    """dtype most floating parameters of ``model`` have (None when it has none)."""
    counts: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.is_floating_point():
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    return max(counts, key=counts.get) if counts else None

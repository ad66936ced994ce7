"""The engine contract: what happens to parameters and gradients between ``prepare()``
and the end of ``optimizer.step()``.

An engine composes the precision layer (``self.precision``, engines/precision.py: masters,
loss scaler, non-finite flag, forward context, unscale and clip arithmetic) with the
communication of its backend. This base class is the single-process engine; ddp adds the
Reducer (engines/ddp.py), zero/fsdp the sharding core (engines/zero.py). They override the
communication points (``prepare_model``, ``fold_grads``, ``no_sync``, ``unscale_`` for the
found_inf agreement, ``clip_grad_norm_`` for a sharded norm, ``_apply_update`` for the
all-gather) and keep the step itself (``step``, [Note: a step without host reads]).
"""

from __future__ import annotations

import collections
import contextlib
import logging
from typing import ClassVar, Iterable, Optional

import torch
from torch import nn

from .. import kernels
from ..errors import NonFiniteGradientsError, UnscaledBackwardError
from ..policy import PrecisionPolicy
from ..step import DeviceScalars, StepResult, check_clip_limit
from ..wrappers.model import AutocastGate
from .precision import Precision
from .replicated_state import replicated_load_state_shards, replicated_state_shards

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
    """Single-process precision machinery; subclasses add communication.

    Lifecycle: ``prepare_model`` -> ``prepare_optimizer`` -> per step ``backward``
    (any number, inside ``no_sync`` while accumulating), ``clip_grad_norm_``
    (optional), ``step``, ``zero_grad``.
    """

    name: ClassVar[str] = "base"
    distributed: ClassVar[bool] = False  # takes a `group=` process group and needs WORLD_SIZE > 1
    # Every rank holds whole tensors, so the base checkpoint contract below applies; a
    # sharding engine must override state_shards/load_state_shards with its slices.
    replicated_state: ClassVar[bool] = False

    def __init__(
        self, policy: PrecisionPolicy, device: torch.device, *, fused_optimizer: bool = True
    ) -> None:
        self.policy = policy  # resolved precision policy
        self.device = device  # where parameters and gradients live
        self.fused_optimizer = fused_optimizer  # use the C++ fused Adam/AdamW/SGD when eligible
        # config clip_in_step: clip_grad_norm_ leaves the multiply to the fused update
        # ([Note: clip inside the update]).
        self.clip_in_step = True
        # config cache_weight_casts: on the replicated engines the fused update writes the
        # forward's bf16/fp16 weights ([Note: the update writes the forward's weights] in
        # engines/weight_casts.py). Read by prepare_model.
        self.cache_weight_casts = True
        self.precision = Precision(policy, device)  # [Note: precision layer] in precision.py
        self.optimizers: dict[int, OptimizerState] = {}  # id(optimizer) -> state
        # Step results whose skips are not logged yet (see Engine._log_skips).
        self._unlogged: collections.deque = collections.deque()

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
        if self.precision.casts is not None:
            self.precision.casts.release()

    # ------------------------------------------------------------------ models
    def prepare_model(self, model: nn.Module, gate: AutocastGate) -> nn.Module:
        """Move ``model`` to the device, apply the storage policy, create fp32 masters and
        make its forward follow the policy. Returns the same object."""
        model.to(self.device)
        precision = self.precision
        fp32_modules = precision.fp32_modules(model)
        fp32_params = {id(p) for m in fp32_modules for p in m.parameters()}
        candidates = [
            p
            for p in model.parameters()
            if p.requires_grad and p.is_floating_point() and id(p) not in fp32_params
        ]
        precision.add_masters(candidates)
        target = self.policy.param_dtype
        if target is not None:
            for p in candidates:
                if p.dtype != target:
                    p.data = p.data.to(target)
        input_dtype = target if target is not None else _dominant_dtype(model)
        # The sharded engines step shards, not the model's weights: they keep autocast's casts.
        precision.install_forward(model, input_dtype, gate, fp32_modules, self.zero_model_grads,
                                  cache_casts=self.cache_weight_casts and self.fused_optimizer
                                  and self.replicated_state)
        return model

    def zero_model_grads(self, model: nn.Module) -> None:
        """``model.zero_grad()`` on a prepared model also clears its masters' grads."""
        for p in model.parameters():
            master = self.master_of.get(id(p))
            if master is not None:
                master.grad = None

    def full_state_dict(self, model: nn.Module) -> dict:
        """``model.state_dict()`` with every parameter in full precision (fp32 masters)."""
        state = model.state_dict()
        for name, p in model.named_parameters(remove_duplicate=False):
            master = self.master_of.get(id(p))
            if master is not None and name in state:
                state[name] = master.detach().clone()
        return state

    # --------------------------------------------------------------- optimizers
    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> OptimizerState:
        """Point the optimizer at the fp32 masters (its own state moves with them)."""
        for group in optimizer.param_groups:
            swapped = []
            for p in group["params"]:
                master = self.master_of.get(id(p))
                if master is not None:
                    if p in optimizer.state:
                        optimizer.state[master] = optimizer.state.pop(p)
                    swapped.append(master)
                else:
                    swapped.append(p)
            group["params"] = swapped
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
        """Move pending low-precision grads into the fp32 master grads."""
        self.precision.fold_grads()

    # ------------------------------------------------------------------ steps
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.precision.scale_loss(loss)

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        self.scale_loss(loss).backward(**kwargs)
        self.fold_grads()

    def no_sync(self, model: nn.Module):
        """Context in which gradients accumulate locally without communication."""
        return contextlib.nullcontext()

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
        """This rank's unscale + check of ``state``'s gradients, without any agreement."""
        self.fold_grads()
        if state.unscaled:
            return
        self.precision.unscale_(self._grads(state.optimizer))
        state.unscaled = True

    def grad_of(self, p: torch.Tensor) -> Optional[torch.Tensor]:
        master = self.master_of.get(id(p))
        return (master if master is not None else p).grad

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        max_norm = check_clip_limit("max_norm", max_norm)
        self.fold_grads()
        grads = [g for p in parameters if (g := self.grad_of(p)) is not None]
        if self._clip_deferrable(grads, norm_type):
            # [Note: clip inside the update] one read of the gradients: the norm, with the
            # non-finite check folded in (a non-finite norm is a non-finite gradient).
            unscaled = next(iter(self.optimizers.values())).unscaled
            raw = kernels.l2_norm(grads, None if unscaled else self.found_inf)
            return self._defer_clip(raw, max_norm, unscaled)
        for state in self.optimizers.values():
            self.unscale_(state)
        if not grads:
            total = torch.zeros((), device=self.device)
        elif float(norm_type) == 2.0:
            total = kernels.l2_norm(grads)
        else:
            total = torch.nn.utils.get_total_norm(grads, norm_type)
        return self._clip_now(grads, total, max_norm)

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
        grads = [g for p in parameters if (g := self.grad_of(p)) is not None]
        for g in grads:
            g.clamp_(min=-clip_value, max=clip_value)

    def _fused_eligible(self, optimizer: torch.optim.Optimizer) -> bool:
        if not self.fused_optimizer or not kernels.supports_fused(optimizer):
            return False
        # Step hooks registered on the optimizer would be bypassed: keep the generic path.
        from torch.optim import optimizer as optim_mod

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
        if fused and not (self.scaler is None and self.nonfinite_grads == "raise") \
                and not kernels.creates_state(optimizer):
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
        """What the one-call step still does around the update (engine hook): here only
        the check, unless the clip or an explicit unscale did it."""
        return {"check": not state.unscaled}

    def _update_lowp_of(self) -> dict:
        """id(optimizer param) -> the low-precision tensor the fused update writes."""
        return self.precision.update_targets()

    def _fused_update(self, optimizer: torch.optim.Optimizer, **kwargs) -> bool:
        """``kernels.fused_optimizer_step`` writing this engine's low-precision targets;
        False when the kernels declined the optimizer (nothing done). The forward's weight
        copies are made current before it and marked current after ([Note: the update
        writes the forward's weights] in engines/weight_casts.py)."""
        casts = self.precision.casts
        if casts is not None:
            casts.before_update()
        if not kernels.fused_optimizer_step(optimizer, lowp_of=self._update_lowp_of(), **kwargs):
            return False
        if casts is not None:
            casts.after_update()
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
        if self.scaler is None and not any(s.unscaled for s in self.optimizers.values()):
            # The flag covers every optimizer checked this step (clip_grad_norm_ checks all
            # of them at once): cleared when the last of them has stepped.
            self.precision.clear_nonfinite()

    def _apply_update(self, optimizer: torch.optim.Optimizer, closure, found_inf, *, fused: bool,
                      state: Optional[OptimizerState] = None) -> None:
        """The update, skipped on the device when ``found_inf`` is set (fused kernels);
        ``fused``: the step already found the optimizer eligible for them. ``state``'s
        pending gradient factor ([Note: clip inside the update]) goes into the kernel."""
        if closure is None and fused:
            factor = None if state is None else state.grad_scale
            if self._fused_update(optimizer, inv_scale=factor, found_inf=found_inf):
                return
        if found_inf is not None and bool(found_inf.item()):
            return  # the fused kernels declined this state layout: decided on the host
        if state is not None:
            self._materialize(state)
        optimizer.step(closure)
        self.write_back(optimizer)

    def write_back(self, optimizer: torch.optim.Optimizer) -> None:
        """Refresh the low-precision params of this optimizer's masters."""
        dsts, srcs = [], []
        for group in optimizer.param_groups:
            for m in group["params"]:
                p = self.lowp_of.get(id(m))
                if p is not None:
                    dsts.append(p)
                    srcs.append(m)
        if dsts:
            with torch.no_grad():
                kernels.copy_cast_(dsts, srcs)

    def zero_grad(self, state: OptimizerState, set_to_none: bool = True) -> None:
        state.optimizer.zero_grad(set_to_none=set_to_none)
        state.forget_grads()
        for group in state.optimizer.param_groups:
            for m in group["params"]:
                p = self.lowp_of.get(id(m))
                if p is not None:
                    p.grad = None

    # ------------------------------------------------------------ scaler state
    def scaler_state_dict(self) -> dict:
        return self.precision.scaler_state_dict()

    def load_scaler_state_dict(self, state: dict) -> None:
        self.precision.load_scaler_state_dict(state)

    # ------------------------------------------------------------- checkpoints
    def _require_replicated(self, call: str) -> None:
        if not self.replicated_state:
            raise NotImplementedError(
                f"{call} with backend={self.name!r}: this engine shards its state and does not "
                "describe its shards to the checkpoint writer yet; save with backend='ddp' or "
                "'single', or export weights with accelerator.get_state_dict(model)"
            )

    def state_names(self, models: list[nn.Module]) -> dict[str, tuple]:
        """Every global model tensor a checkpoint of ``models`` holds: name -> global shape
        (what ``load_state`` validates against before loading anything)."""
        return {s.name: tuple(s.shape) for s in self.state_shards(models, [])}

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
        tensor (only rank 0 writes it). Sharded engines override this with their slices.

        The replicated engines (single, ddp) return whole tensors
        (engines/replicated_state.py).

        Example::

            shards = engine.state_shards([model], [optimizer])
            shards[0].name, shards[0].shape      # ('model/0.weight', (64, 16))
        """
        self._require_replicated("save_state")
        return replicated_state_shards(self, models, optimizers)

    def load_state_shards(self, models: list[nn.Module], optimizers: list[torch.optim.Optimizer], read) -> None:
        """Load what :meth:`state_shards` names from a checkpoint, whatever wrote it.

        ``read(name, offset, numel)`` returns that flat range of a global tensor (assembled
        from whichever rank files hold it) and ``read.index`` maps every saved name to its
        ``(shape, dtype)``. Callers validate names and shapes first; an implementation reads
        everything it needs BEFORE changing anything, so a failure loads nothing. Sharded
        engines override this to read only their slices.

        The replicated engines (single, ddp) read whole tensors (engines/replicated_state.py).

        Example::

            engine.load_state_shards([model], [optimizer], reader)
        """
        self._require_replicated("load_state")
        replicated_load_state_shards(self, models, optimizers, read)

def _dominant_dtype(model: nn.Module) -> Optional[torch.dtype]:
    """dtype most floating parameters of ``model`` have (None when it has none)."""
    counts: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.is_floating_point():
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    return max(counts, key=counts.get) if counts else None

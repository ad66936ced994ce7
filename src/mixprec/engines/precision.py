"""The precision layer: every numeric rule of a policy, whatever moves the gradients.

[Note: precision layer]
One :class:`Precision` per engine owns the policy's state and arithmetic: the loss scaler
(C++ ``GradScaler``, device tensors), the fp32 masters of low-precision parameters on the
replicated engines (C++ ``MasterWeights``), the bf16/fp32 non-finite flag, the forward
context (autocast, input casts, fp32 modules), unscaling with the inf/nan check, the clip
arithmetic and the scaler's once-per-iteration update. The communication half
(``Comm``, engines/comm.py: single, ddp over the Reducer, zero/fsdp over ShardedCore)
decides where gradients live and when they are reduced; none of them holds a second copy
of this state. The Engine (engines/base.py) composes both ([Note: engine = precision +
communication] in engines/comm.py) and drives the step ([Note: a step without host reads]).

Example::

    precision = Precision(PrecisionPolicy.from_mixed_precision("fp16"), torch.device("cpu"))
    precision.scale_loss(loss).backward()
    precision.unscale_(grads)               # sets precision.found_inf on inf/nan
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from .. import _C, kernels
from ..policy import PrecisionPolicy, dtype_name
from ..step import NONFINITE_POLICIES
from ..utils import LOW_PRECISION
from ..wrappers.model import AutocastGate, ForwardContext, swap_class
from .weight_casts import WeightCasts

logger = logging.getLogger("mixprec")


class Precision:
    """The policy's state and arithmetic (see [Note: precision layer])."""

    def __init__(self, policy: PrecisionPolicy, device: torch.device) -> None:
        self.policy = policy  # resolved precision policy
        self.device = device
        self.scaler: Optional[_C.GradScaler] = None  # dynamic loss scaler (fp16 only)
        if policy.loss_scaling:
            options = _C.ScalerOptions(**dataclasses.asdict(policy.scaler))
            self.scaler = _C.GradScaler(options, device)
            # The scaler's own scale tensor (updated and loaded in place): read from
            # Python without a call into C++ each step.
            self._scale: Optional[torch.Tensor] = self.scaler.scale
        self.masters: list[_C.MasterWeights] = []  # one per prepared model with low-precision params
        self.master_of: dict[int, torch.Tensor] = {}  # id(model param) -> its fp32 master
        self.lowp_of: dict[int, torch.Tensor] = {}  # id(master) -> the model param it refreshes
        self._merged_targets: Optional[tuple] = None  # update_targets' cache
        self.scaled_backward = False  # a backward went through the scaler since the last step
        # What a bf16/fp32 step does with non-finite gradients: "skip" or "raise" (config
        # field nonfinite_grads; fp16 overflows are the loss scaler's business).
        self.nonfinite_grads = "skip"
        # bf16/fp32: the flag the unscale kernel sets, run with scale 1 (see
        # [Note: non-finite guard] in engines/base.py); fp16 uses the scaler's own found_inf.
        self._nonfinite_flag = torch.zeros(1, dtype=torch.float32, device=device)
        self._unit_scale = torch.ones(1, dtype=torch.float32, device=device)
        self._stepped_since_update: set[int] = set()  # [Note: one scaler update per iteration]
        # The forward's low-precision weights, written by the fused update ([Note: the
        # update writes the forward's weights] in weight_casts.py); None when not used.
        self.casts: Optional[WeightCasts] = None

    @property
    def found_inf(self) -> torch.Tensor:
        """1-element fp32 flag, nonzero when this step's gradients held inf/nan (the loss
        scaler's own flag under fp16)."""
        return self.scaler.found_inf if self.scaler is not None else self._nonfinite_flag

    def set_nonfinite_policy(self, policy: str) -> None:
        if policy not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite_grads={policy!r} must be one of {NONFINITE_POLICIES}")
        self.nonfinite_grads = policy

    # ------------------------------------------------------------------ models
    def fp32_modules(self, model: nn.Module) -> list[nn.Module]:
        """The modules ``keep_fp32_modules`` names, their floating parameters made fp32."""
        patterns = self.policy.keep_fp32_modules
        if not patterns:
            return []
        found = []
        for name, m in model.named_modules():
            if any(fnmatch.fnmatchcase(name, pat) or type(m).__name__ == pat for pat in patterns):
                found.append(m)
        if not found:
            raise ValueError(
                f"keep_fp32_modules={list(patterns)!r} matched no module of "
                f"{type(model).__name__}; give module class names (e.g. 'LayerNorm') or "
                "dotted paths with wildcards (e.g. 'encoder.*.norm')"
            )
        with torch.no_grad():
            for m in found:
                for p in m.parameters():
                    if p.is_floating_point() and p.dtype != torch.float32:
                        p.data = p.data.float()
        return found

    def add_masters(self, candidates: Sequence[torch.Tensor]) -> None:
        """fp32 masters for the trainable params that will be (or are) low precision,
        cloned before any cast so they keep every fp32 bit given."""
        target = self.policy.param_dtype
        needs_master = [
            p for p in candidates
            if id(p) not in self.master_of
            and (p.dtype in LOW_PRECISION or (target is not None and target != torch.float32))
        ]
        if self.policy.master_dtype is None or not needs_master:
            return
        given = sorted({dtype_name(p.dtype) for p in needs_master})
        weights = _C.MasterWeights(needs_master)
        self.masters.append(weights)
        for p, m in zip(weights.params, weights.masters):
            self.master_of[id(p)] = m
            self.lowp_of[id(m)] = p
        if target is None:
            logger.warning(
                "mixprec: %d trainable parameter(s) came in %s: fp32 master weights were "
                "added; the optimizer updates the masters and the %s weights are refreshed "
                "from them after every step",
                len(needs_master), "/".join(given), "/".join(given),
            )

    def store_params(self, model: nn.Module, fp32_modules: Sequence[nn.Module]) -> None:
        """The replicated backends' storage policy: fp32 masters for the trainable
        parameters that are (or will be) low precision, then the parameters cast to the
        policy's ``param_dtype`` (fp32 modules excluded)."""
        fp32_params = {id(p) for m in fp32_modules for p in m.parameters()}
        candidates = [p for p in model.parameters()
                      if p.requires_grad and p.is_floating_point() and id(p) not in fp32_params]
        self.add_masters(candidates)
        target = self.policy.param_dtype
        if target is not None:
            for p in candidates:
                if p.dtype != target:
                    p.data = p.data.to(target)

    def steps_masters(self, optimizer: torch.optim.Optimizer) -> None:
        """Point ``optimizer`` at the fp32 masters (its own state moves with them)."""
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

    def grad_of(self, p: torch.Tensor) -> Optional[torch.Tensor]:
        """The gradient the optimizer reads for model parameter ``p`` (its master's)."""
        master = self.master_of.get(id(p))
        return (master if master is not None else p).grad

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

    def drop_lowp_grads(self, optimizer: torch.optim.Optimizer) -> None:
        """Drop the grads of the low-precision params of ``optimizer``'s masters."""
        if self.lowp_of:
            for group in optimizer.param_groups:
                for m in group["params"]:
                    p = self.lowp_of.get(id(m))
                    if p is not None:
                        p.grad = None

    def drop_master_grads(self, model: nn.Module) -> None:
        """Drop the masters' grads of ``model``'s parameters (``model.zero_grad()``)."""
        if self.master_of:
            for p in model.parameters():
                master = self.master_of.get(id(p))
                if master is not None:
                    master.grad = None

    def fill_masters(self, model: nn.Module, state: dict) -> None:
        """``state`` (model.state_dict()) with every parameter's fp32 master where it has one."""
        for name, p in model.named_parameters(remove_duplicate=False):
            master = self.master_of.get(id(p))
            if master is not None and name in state:
                state[name] = master.detach().clone()

    def install_forward(self, model: nn.Module, input_dtype: Optional[torch.dtype],
                        gate: AutocastGate, fp32_modules: Sequence[nn.Module],
                        on_zero_grad: Callable[[nn.Module, bool], None], *,
                        cache_casts: bool = False, half_gemm: bool = False) -> ForwardContext:
        """Make the model's forward follow the policy (class swap, see wrappers/model.py):
        autocast, input casts, output dtype; fp32 modules run with autocast off.
        ``cache_casts``: the engine's fused update may write the forward's low-precision
        weights ([Note: the update writes the forward's weights] in weight_casts.py); used
        when the policy keeps fp32 weights under a low-precision autocast. ``half_gemm``:
        fp16 matmuls on this CPU run as widened fp32 GEMMs ([Note: fp16 GEMMs on a CPU
        without fp16 arithmetic] in wrappers/half_gemm.py)."""
        ctx = ForwardContext(self.policy, self.device.type, input_dtype, gate, on_zero_grad=on_zero_grad)
        policy = self.policy
        ctx.half_gemm = (half_gemm and self.device.type == "cpu" and policy.autocast_enabled
                         and policy.compute_dtype is torch.float16)
        if cache_casts and policy.autocast_enabled and policy.compute_dtype in LOW_PRECISION \
                and policy.param_dtype in (None, torch.float32):
            casts = self.casts or WeightCasts(policy.compute_dtype, self.device.type)
            if casts.install(model, skip=fp32_modules):
                self.casts = ctx.casts = casts
        swap_class(model, ctx)
        for m in fp32_modules:
            swap_class(m, ForwardContext(self.policy, self.device.type, None, gate, fp32_region=True))
        return ctx

    def update_targets(self) -> dict[int, torch.Tensor]:
        """id(optimizer param) -> the low-precision tensor the fused update writes: the
        masters' low-precision params and the forward's weight copies."""
        casts = self.casts
        if casts is None or not casts.targets:
            return self.lowp_of
        if not self.lowp_of:
            return casts.targets
        # The same merged mapping while neither side changed: the fused step keeps its plan
        # while the mapping is the same object ([Note: the step plan] in kernels.py).
        key = (len(self.lowp_of), casts.targets, len(casts.targets))
        merged = self._merged_targets
        if merged is None or merged[0] != key[0] or merged[1] is not key[1] or merged[2] != key[2]:
            merged = self._merged_targets = (*key, {**self.lowp_of, **casts.targets})
        return merged[3]

    def fold_grads(self) -> None:
        """Move pending low-precision grads into the fp32 master grads."""
        for weights in self.masters:
            weights.fold_grads()

    def refresh_lowp(self) -> None:
        """Copy every master into its low-precision parameter (after a load)."""
        for weights in self.masters:
            kernels.copy_cast_(list(weights.params), list(weights.masters))

    # ----------------------------------------------------------------- steps
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        if self.scaler is None:
            return loss
        if self._stepped_since_update:
            # A new iteration while some optimizer did not step in the last one
            # ([Note: one scaler update per iteration] in engines/base.py).
            self._update_scaler()
        self.scaled_backward = True
        return self.scaler.scale_loss(loss)

    def inv_scale(self) -> Optional[torch.Tensor]:
        """1/scale as the C++ scaler computes it (fp32, via fp64), or None without one."""
        return None if self.scaler is None else self._scale.double().reciprocal().float()

    def unscale_(self, grads: Sequence[torch.Tensor]) -> None:
        """Multiply by 1/scale (fp16) or 1 (bf16/fp32) and OR inf/nan into found_inf, in
        one pass ([Note: non-finite guard] in engines/base.py)."""
        inv = self.inv_scale() if self.scaler is not None else self._unit_scale
        kernels.unscale_and_check_any_(grads, self.found_inf, inv)

    @staticmethod
    def clip_(grads: Sequence[torch.Tensor], total: torch.Tensor, max_norm: float) -> None:
        """Scale ``grads`` by min(1, max_norm / (total + 1e-6)), on the device (torch's rule)."""
        if grads:
            clip_coef = (float(max_norm) / (total + 1e-6)).clamp(max=1.0)
            torch._foreach_mul_(list(grads), clip_coef.to(grads[0].device))

    def ends_iteration(self, optimizer_id: int, all_optimizer_ids) -> bool:
        """This optimizer's step is the last of the iteration: the scale moves after it."""
        return self.scaler is not None and (
            self._stepped_since_update | {optimizer_id}) >= set(all_optimizer_ids)

    def after_step(self, optimizer_id: int, all_optimizer_ids, *, updated: bool = False) -> None:
        """[Note: one scaler update per iteration] (engines/base.py). ``updated``: the
        step's own call already updated the scaler ([Note: one call per step])."""
        if self.scaler is None:
            return
        if updated:
            self._stepped_since_update.clear()
            self.scaled_backward = False
            return
        self._stepped_since_update.add(optimizer_id)
        if self._stepped_since_update >= set(all_optimizer_ids):
            self._update_scaler()

    def _update_scaler(self) -> None:
        # The iteration is over: its scaled backward has been used by every optimizer.
        self.scaler.update()
        self._stepped_since_update.clear()
        self.scaled_backward = False

    def clear_nonfinite(self) -> None:
        self._nonfinite_flag.zero_()

    # ----------------------------------------------------------- scaler state
    def scaler_state_dict(self) -> dict:
        if self.scaler is None:
            return {}
        o = self.scaler.options
        return {
            "scale": self.scaler.scale_value(),
            "growth_factor": o.growth_factor,
            "backoff_factor": o.backoff_factor,
            "growth_interval": o.growth_interval,
            "_growth_tracker": self.scaler.growth_tracker(),
            "hysteresis": o.hysteresis,
            "_hysteresis_left": self.scaler.hysteresis_left(),
        }

    def load_scaler_state_dict(self, state: dict) -> None:
        if self.scaler is None:
            if state:
                raise ValueError(
                    "this checkpoint holds loss-scaler state but the policy "
                    f"{self.policy.name!r} has no loss scaling; load it with mixed_precision='fp16'"
                )
            return
        self.scaler.load(
            float(state["scale"]), int(state["_growth_tracker"]), int(state.get("_hysteresis_left", 1))
        )


"""``backend="zero1"`` / ``"zero2"`` / ``"zero3"``: ZeRO data parallelism over the C++
sharding core (``"fsdp"``, engines/fsdp.py, is zero3 with FSDP2's option names).

Each rank keeps an fp32 master shard (its slice of every bucket, see
csrc/engines/sharded/layout.h) and the optimizer state for that shard only. Gradients
are reduce-scattered into an fp32 gradient shard (stage 1: at the step; stage 2: during
backward), the optimizer steps the shard, and the updated parameters are all-gathered
in their storage dtype into the model, whose parameters are views of flat buffers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import weakref
from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn

from .. import _C, kernels
from ..checkpoint.format import model_prefix
from ..policy import PrecisionPolicy, ScalerConfig
from ..step import StepResult, check_clip_limit
from ..wrappers.model import AutocastGate
from . import comm
from .base import Engine, OptimizerState, _dominant_dtype
from .sharded import Segment, build_segments, check_optimizer
from .units import (
    LeafSpec,
    Unit,
    UnitOrderCheck,
    UnitRunner,
    assign_params,
    explain_unsharded_use,
    select_unit_modules,
)
from .zero_state import zero_load_state_shards, zero_state_shards

# DeepSpeed's dynamic loss scaler (runtime/fp16/loss_scaler.py defaults).
DEEPSPEED_SCALER = ScalerConfig(init_scale=2.0**16, growth_interval=1000, hysteresis=2, min_scale=1.0)


class ZeroEngine(Engine):
    """ZeRO stage ``stage`` (1 or 2); see the module docstring."""

    name = "zero"
    stage = 0
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
        collective: str = "auto",
        loss_scaler: str = "torch",
        elementwise_optimizer: bool = False,
        broadcast_buffers: bool = True,
        max_inflight_buckets: int = 2,
    ) -> None:
        backend = self.name  # zero1 / zero2 / zero3 / fsdp: the name errors echo
        group, group_name, world_size = comm.process_group(backend, group)
        if policy.master_dtype is None:
            raise ValueError(
                f"backend={backend!r} keeps fp32 master shards; mixed_precision={policy.name!r} "
                "has no masters. Use mixed_precision='bf16' (optionally param_dtype=torch.bfloat16)"
            )
        if loss_scaler not in ("torch", "deepspeed"):
            raise ValueError(f"loss_scaler={loss_scaler!r} must be 'torch' or 'deepspeed'")
        if loss_scaler == "deepspeed" and policy.loss_scaling:
            policy = dataclasses.replace(policy, scaler=DEEPSPEED_SCALER)
        comm.check_bucket_caps(bucket_cap_mb=bucket_cap_mb, first_bucket_cap_mb=first_bucket_cap_mb)
        if isinstance(max_inflight_buckets, bool) or not isinstance(max_inflight_buckets, int) \
                or max_inflight_buckets < 1:
            raise ValueError(f"max_inflight_buckets={max_inflight_buckets!r} must be an int >= 1 "
                             "(gradient buckets reduced at once during backward; default 2)")
        super().__init__(policy, device, fused_optimizer=fused_optimizer)
        self.backend = backend
        # The communication group and the name C++ resolves it by.
        self.group, self.group_name, self.world_size = group, group_name, world_size
        self.options = _C.ShardOptions(
            stage=self.stage, bucket_cap_bytes=int(bucket_cap_mb * 2**20),
            first_bucket_cap_bytes=int(first_bucket_cap_mb * 2**20), collective=collective,
            group_name=self.group_name, max_inflight_buckets=max_inflight_buckets,
            reduce_dtype=policy.reduce_dtype,  # [Note: low-precision reduction] in core.h
        )  # one in-flight window, shared by every core built from these options
        self.elementwise_optimizer = elementwise_optimizer  # accept unknown optimizers
        self.broadcast_buffers = broadcast_buffers  # rank 0's buffers before every forward
        self.cores: dict[int, list[_C.ShardedCore]] = {}  # id(model) -> its cores (zero3: one per unit)
        self.core_params: dict[int, list[torch.Tensor]] = {}  # id(core) -> its params, model order
        self.core_of_param: dict[int, _C.ShardedCore] = {}  # id(param) -> core
        self.segments: dict[int, list[Segment]] = {}  # id(optimizer) -> its segments
        self.cores_of_opt: dict[int, list[_C.ShardedCore]] = {}  # id(optimizer) -> cores
        self.segment_lowp: dict[int, torch.Tensor] = {}  # id(master segment) -> lowp view
        self._found_inf_agreed = False  # found_inf already all-reduced this step
        self._folded = False  # fold_grads() ran since the last backward / step

    # ------------------------------------------------------------------ models
    def prepare_model(self, model: nn.Module, gate: AutocastGate) -> nn.Module:
        model.to(self.device)
        comm.start_replicas(model, self.group, self.group_name)
        fp32_modules = self.precision.fp32_modules(model)
        fp32_ids = {id(p) for m in fp32_modules for p in m.parameters()}
        target = self.policy.param_dtype
        names, params, dtypes = [], [], []
        for name, p in model.named_parameters():
            if p.requires_grad and p.is_floating_point():
                names.append(name)
                params.append(p)
                keep = id(p) in fp32_ids or target is None
                dtypes.append(p.dtype if keep else target)
        if not params:
            raise ValueError(f"{type(model).__name__} has no trainable parameters to train with {self.backend}")
        input_dtype = target if target is not None else _dominant_dtype(model)
        cores = []
        for indices in self._partition(model, names, params):
            core = None
            if indices:
                unit_params = [params[i] for i in indices]
                core = _C.ShardedCore(unit_params, [names[i] for i in indices],
                                      [dtypes[i] for i in indices], self.group_name, self.options)
                self.core_params[id(core)] = unit_params
                for p in unit_params:
                    self.core_of_param[id(p)] = core
            cores.append(core)
        self.cores[id(model)] = [c for c in cores if c is not None]
        self._install_units(model, cores)
        ctx = self.precision.install_forward(model, input_dtype, gate, fp32_modules, self.zero_model_grads)
        ctx.explain_error = self._error_explainer(model)
        if self.broadcast_buffers:
            comm.install_buffer_sync(model, self.group_name)
        return model

    def _partition(self, model: nn.Module, names: list[str], params: list[torch.Tensor]) -> list[list[int]]:
        """Indices of ``params`` per sharding core (zero1/2: one core for the model)."""
        return [list(range(len(params)))]

    def _install_units(self, model: nn.Module, cores: list) -> None:
        """Zero3 gathers/frees units around forward and backward; zero1/2 keep full params."""

    def _error_explainer(self, model: nn.Module):
        """How the prepared model's forward reads an error (zero1/2: nothing to add)."""
        return None

    def _all_cores(self) -> list[_C.ShardedCore]:
        return [c for cores in self.cores.values() for c in cores]

    def release(self) -> None:
        """Drop every sharding core (each holds the process group; its destructor removes
        its gradient hooks). Called by ``Accelerator.end_training`` before the group is
        destroyed; the engine cannot step afterwards."""
        self.cores.clear()
        self.core_params.clear()
        self.core_of_param.clear()
        self.cores_of_opt.clear()
        super().release()

    def _cores(self, model: nn.Module) -> list[_C.ShardedCore]:
        cores = self.cores.get(id(model))
        if cores is None:
            raise ValueError(f"got a model that this accelerator did not prepare: {type(model).__name__}")
        return cores

    # ------------------------------------------------------------ checkpoints
    def state_names(self, models: list[nn.Module]) -> dict[str, tuple]:
        return {model_prefix(i) + n: tuple(t.shape)
                for i, m in enumerate(models) for n, t in m.state_dict(keep_vars=True).items()}

    def state_shards(self, models, optimizers) -> list:
        """The slices this rank owns (see mixprec/engines/zero_state.py)."""
        return zero_state_shards(self, models, optimizers)

    def load_state_shards(self, models, optimizers, read) -> None:
        zero_load_state_shards(self, models, optimizers, read)

    def zero_model_grads(self, model: nn.Module) -> None:
        for core in self._cores(model):
            core.zero_grad()
        self._folded = False

    def full_state_dict(self, model: nn.Module) -> dict:
        """``model.state_dict()`` with fp32 parameters gathered from the master shards.
        A collective: call it on every rank."""
        state = model.state_dict()
        by_id = {}
        for core in self._cores(model):
            by_id.update({id(p): t for p, t in zip(self.core_params[id(core)], core.full_masters())})
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in by_id and name in state:
                state[name] = by_id[id(p)]
        return state

    # --------------------------------------------------------------- optimizers
    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> OptimizerState:
        """Swap every param group to this rank's fp32 shard segments (hyper-parameters kept)."""
        check_optimizer(optimizer, self.backend, self.elementwise_optimizer)
        if len(optimizer.state):
            raise ValueError(
                f"{type(optimizer).__name__} already holds state for {len(optimizer.state)} "
                f"parameter(s); {self.backend} shards fresh state only. Call prepare() before the "
                "first optimizer step"
            )
        group_of: dict[int, int] = {}
        cores: dict[int, _C.ShardedCore] = {}
        for g, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                core = self.core_of_param.get(id(p))
                if core is None:
                    raise ValueError(
                        f"an optimizer parameter of shape {tuple(p.shape)} belongs to no model "
                        f"prepared with {self.backend} (or is frozen); prepare the model first, in "
                        "the same prepare() call, and give the optimizer only trainable parameters"
                    )
                group_of[id(p)] = g
                cores[id(core)] = core
        segments: list[Segment] = []
        new_params: dict[int, list[torch.Tensor]] = {g: [] for g in range(len(optimizer.param_groups))}
        used = [c for mc in self.cores.values() if any(id(c) in cores for c in mc) for c in mc]
        for core in used:
            params = self.core_params[id(core)]
            missing = [p for p in params if id(p) not in group_of]
            if missing:
                raise ValueError(
                    f"the optimizer holds only some of the model's trainable parameters ({len(missing)} "
                    f"missing, e.g. shape {tuple(missing[0].shape)}); {self.backend} shards a model "
                    "for one optimizer. Give it all trainable parameters (per-group settings are kept)"
                )
            for g, segs in build_segments(core, group_of, params).items():
                segments.extend(segs)
                new_params[g].extend(s.master for s in segs)
        for g, group in enumerate(optimizer.param_groups):
            group["params"] = new_params[g]
        for s in segments:
            if s.lowp is not None:
                self.segment_lowp[id(s.master)] = s.lowp
        self.segments[id(optimizer)] = segments
        self.cores_of_opt[id(optimizer)] = list(cores.values())
        state = OptimizerState(optimizer)
        self.optimizers[id(optimizer)] = state
        return state

    # ------------------------------------------------------------------ steps
    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        # No fold: the C++ hooks already moved the gradients into buckets or shards.
        self._folded = False
        self.scale_loss(loss).backward(**kwargs)

    def fold_grads(self) -> None:
        """Finish any pending reduction and show the optimizers their gradient shards.
        Done once between a backward and the end of the step (clip, unscale and step all
        ask for it; the later calls cost nothing and cross into C++ no more)."""
        if self._folded:
            return
        self._folded = True
        cores = self._all_cores()
        holds = dict(zip(map(id, cores), _C.finish_reductions(cores)))  # one call for all
        for opt_id, segments in self.segments.items():
            have = any(holds[id(c)] for c in self.cores_of_opt[opt_id])
            for s in segments:
                if have and s.master.grad is None:
                    s.master.grad = s.grad
                elif not have:
                    s.master.grad = None

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module):
        with comm.sync_off(self._cores(model)):
            yield

    @contextlib.contextmanager
    def coalesce_grad_reduction(self, *models: nn.Module):
        """Several backward calls inside, one reduction (in bucket order) on exit."""
        cores = [c for m in models for c in self._cores(m)] if models else self._all_cores()
        with comm.sync_off(cores):
            yield
        for c in cores:
            c.reduce()

    def _agree_found_inf(self) -> None:
        # [Note: found_inf agreement]
        # Each rank checked only the gradient shard it owns, so an overflow is seen by one
        # rank only. The flag is all-reduced (MAX) before anyone reads it: every rank then
        # skips, or steps, together, and the scaler states stay identical. bf16/fp32 agree
        # their non-finite flag the same way (see [Note: non-finite guard] in engines/base.py).
        if self._found_inf_agreed:
            return
        dist.all_reduce(self.found_inf, op=dist.ReduceOp.MAX, group=self.group)
        self._found_inf_agreed = True

    def unscale_(self, state: OptimizerState) -> None:
        super().unscale_(state)
        self._agree_found_inf()

    def _all_segment_grads(self) -> list[torch.Tensor]:
        return [s.master.grad for segs in self.segments.values() for s in segs if s.master.grad is not None]

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Global norm from the owned shards with ONE all-reduce (norm and found_inf travel
        together); every rank gets the same value and clips its shard by it."""
        max_norm = check_clip_limit("max_norm", max_norm)
        given = {id(p) for p in parameters if p.requires_grad}
        sharded = {pid for pid in self.core_of_param}
        if given != sharded:
            raise ValueError(
                f"{self.backend} computes the gradient norm over every sharded parameter; got "
                f"{len(given)} trainable parameter(s) but {len(sharded)} are sharded. Pass "
                "model.parameters() of all prepared models"
            )
        self.fold_grads()
        grads = self._all_segment_grads()
        p = float(norm_type)
        # [Note: clip inside the update] (engines/base.py): the norm pass is the check.
        deferred = self._clip_deferrable(grads, norm_type)
        unscaled = deferred and next(iter(self.optimizers.values())).unscaled
        if not deferred:
            for state in self.optimizers.values():
                self._materialize(state)
                self._unscale_local(state)  # agreement rides on the norm's all-reduce below
        if p == math.inf:
            local = max((g.abs().max().double() for g in grads), default=torch.zeros((), dtype=torch.float64))
            op = dist.ReduceOp.MAX
        elif p == 2.0:
            found = self.found_inf if deferred and not unscaled else None
            local = kernels.l2_norm(grads, found).double() ** 2 if grads else torch.zeros((), dtype=torch.float64)
            op = dist.ReduceOp.SUM
        else:
            local = sum((g.double().abs() ** p).sum() for g in grads) if grads else torch.zeros((), dtype=torch.float64)
            op = dist.ReduceOp.SUM
        flag = self.found_inf.double().reshape(())
        packet = torch.stack([local.to(self.device).reshape(()), flag.to(self.device)])
        dist.all_reduce(packet, op=op, group=self.group)
        self.found_inf.copy_(packet[1:2].gt(0))  # on the device: no host read
        self._found_inf_agreed = True
        total = (packet[0] if p == math.inf else packet[0] ** (1.0 / p)).float()
        if deferred:
            return self._defer_clip(total, max_norm, unscaled)
        return self._clip_now(grads, total, max_norm)

    def clip_grad_value_(self, parameters: Iterable[torch.Tensor], clip_value: float) -> None:
        # Element-wise: clamping the owned shard is clamping the whole gradient.
        clip_value = check_clip_limit("clip_value", clip_value)
        self.fold_grads()
        for state in self.optimizers.values():
            self.unscale_(state)
        for g in self._all_segment_grads():
            g.clamp_(min=-clip_value, max=clip_value)

    def step(self, state: OptimizerState, closure=None) -> StepResult:
        if closure is not None:
            raise NotImplementedError(
                f"optimizer.step(closure) on {self.backend}: the closure's backward would not be "
                "reduced before the update; run backward in your loop and call step() without it"
            )
        try:
            return super().step(state, closure)
        finally:
            self._found_inf_agreed = False
            self._folded = False

    def _apply_update(self, optimizer: torch.optim.Optimizer, closure, found_inf, *, fused: bool,
                      state: Optional[OptimizerState] = None) -> None:
        refresh = True
        factor = None if state is None else state.grad_scale
        if fused and self._fused_update(optimizer, inv_scale=factor, found_inf=found_inf):
            refresh = False  # the fused kernel already wrote the low-precision shards
        elif found_inf is not None and bool(found_inf.item()):
            return  # declined by the fused kernels and skipped: decided on the host
        else:
            if state is not None:
                self._materialize(state)
            optimizer.step()
        # A skipped fused step left the shards unchanged: gathering them again rewrites
        # the same values, so the skip needs no host decision here either.
        self._publish(optimizer, refresh)

    def write_back(self, optimizer: torch.optim.Optimizer) -> None:
        self._publish(optimizer, True)

    def _step_finish(self, state: OptimizerState) -> dict:
        # [Note: one call per step]: the agreement ([Note: found_inf agreement]) and the
        # gather of the updated shards (zero1/2) ride in the step's one call.
        finish = super()._step_finish(state)
        if not self._found_inf_agreed:
            finish["agree_group"] = self.group_name
        if not self.options.shard_params:
            finish["gather"] = self.cores_of_opt[id(state.optimizer)]
        return finish

    def _update_lowp_of(self) -> dict:
        return self.segment_lowp

    def _publish(self, optimizer: torch.optim.Optimizer, refresh_lowp: bool) -> None:
        """Make the updated shards the model's parameters: zero1/2 all-gather them now;
        zero3 only refreshes the low-precision shards (the next forward gathers)."""
        for core in self.cores_of_opt[id(optimizer)]:
            if self.options.shard_params:
                if refresh_lowp:
                    core.refresh_lowp()
            else:
                core.gather_params(refresh_lowp)

    def zero_grad(self, state: OptimizerState, set_to_none: bool = True) -> None:
        state.optimizer.zero_grad(set_to_none=set_to_none)
        state.forget_grads()
        for core in self.cores_of_opt[id(state.optimizer)]:
            core.zero_grad()
        self._folded = False

    # ------------------------------------------------------------ reporting
    def bytes_communicated_last_step(self) -> dict:
        """Bytes handed to collectives by the last reduction and the last parameter gather."""
        reduced = sum(c.bytes_reduced_last() for c in self._all_cores())
        gathered = sum(c.bytes_gathered_last() for c in self._all_cores())
        return {"reduce": reduced, "gather": gathered}

    def comm_counters(self) -> dict:
        """Collective payload handed out by this rank since :meth:`reset_comm_counters`,
        summed over every sharding core (zero3/fsdp: one per unit): ``bytes_reduced`` /
        ``elements_reduced`` (gradient buckets, fp32, padded), ``bytes_gathered`` /
        ``elements_gathered`` (parameter all-gathers in the storage dtype, padded: ZeRO-1/2
        after each step; ZeRO-3 every forward and backward gather, prefetches included),
        and the number of bucket collectives (``reductions``, ``gathers``). See
        ``[Note: communication counters]`` in csrc/engines/sharded/core.h for what is not
        counted (state-dict gathers, the small found_inf/clip-norm all-reduces)."""
        total = dict.fromkeys(("bytes_reduced", "elements_reduced", "reductions",
                               "bytes_gathered", "elements_gathered", "gathers"), 0)
        for core in self._all_cores():
            for key, value in core.comm_counters().items():
                total[key] += value
        return total

    def reset_comm_counters(self) -> None:
        """Zero the counters of :meth:`comm_counters` (every core of every model)."""
        for core in self._all_cores():
            core.reset_comm_counters()

    def persistent_bytes(self) -> dict:
        """Per-rank bytes that live across steps: the model's flat parameter buffers
        (``params``: full for zero1/2; for zero3/fsdp only the units gathered right now,
        0 between steps), master shard, low-precision shards, optimizer state of the
        shards, and gradients (shard + full fp32 buckets while allocated: stage 1 keeps them)."""
        params = sum(c.param_buffer_bytes() for c in self._all_cores())
        masters = sum(c.master_shard.nbytes for c in self._all_cores())
        lowp = sum(t.nbytes for c in self._all_cores() for t in c.lowp_shards if t is not None)
        opt_state = 0
        for state in self.optimizers.values():
            for per_param in state.optimizer.state.values():
                opt_state += sum(v.nbytes for v in per_param.values()
                                 if isinstance(v, torch.Tensor) and v.dim() > 0)
        grads = sum(c.grad_shard.nbytes + c.grad_bucket_bytes() for c in self._all_cores())
        return {"params": params, "master": masters, "lowp": lowp, "optimizer_state": opt_state,
                "grads": grads}


class Zero1Engine(ZeroEngine):
    """ZeRO-1: optimizer state and fp32 masters sharded; full gradients until the step."""

    name = "zero1"
    stage = 1


class Zero2Engine(ZeroEngine):
    """ZeRO-2: + gradients reduce-scattered during backward into the owned shard."""

    name = "zero2"
    stage = 2


class Zero3Engine(ZeroEngine):
    """ZeRO-3: + parameters sharded per unit, gathered around each unit's forward and
    backward and freed after use (src/mixprec/engines/units.py)."""

    name = "zero3"
    stage = 3
    default_units = "size:1000000"  # a unit per module holding >= 1M parameters not in a smaller unit

    def __init__(self, policy: PrecisionPolicy, device: torch.device, *, units=None,
                 prefetch: bool = True, reshard_after_forward: bool = True,
                 leaf_module_classes=(), leaf_module_names=(), leaf_module_name_suffixes=(),
                 check_unit_order: bool = True, **options) -> None:
        super().__init__(policy, device, **options)
        self.units_spec = self.default_units if units is None else units
        leaves = {"leaf_module_classes": leaf_module_classes, "leaf_module_names": leaf_module_names,
                  "leaf_module_name_suffixes": leaf_module_name_suffixes}
        for key, value in leaves.items():
            if isinstance(value, str) or not all(isinstance(v, (str, type)) for v in value):
                raise ValueError(f"{key}={value!r} must be a list of strings (or classes for "
                                 "leaf_module_classes), e.g. ['MoEBlock']")
        self.leaves = LeafSpec(  # ZeRO-3 leaf modules: gathered whole (units.py)
            classes=tuple(c if isinstance(c, str) else c.__name__ for c in leaf_module_classes),
            names=tuple(leaf_module_names), name_suffixes=tuple(leaf_module_name_suffixes))
        if not isinstance(check_unit_order, bool):
            raise ValueError(f"check_unit_order={check_unit_order!r} must be True or False")
        self.check_unit_order = check_unit_order  # [Note: unit order check] in units.py
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward={reshard_after_forward!r} must be True or False")
        self.reshard_after_forward = reshard_after_forward
        self.prefetch = bool(prefetch)
        self.runners: dict[int, UnitRunner] = {}  # id(model) -> its unit runner

    def _partition(self, model: nn.Module, names: list[str], params: list[torch.Tensor]) -> list[list[int]]:
        self.leaves.check(model)
        self._unit_modules = select_unit_modules(model, self.units_spec, self.leaves)
        return assign_params(model, self._unit_modules, names, params)

    def _install_units(self, model: nn.Module, cores: list) -> None:
        named = self._unit_modules + [("", model)]
        units = [Unit(name, weakref.ref(module), core, self.reshard_after_forward, is_root=module is model)
                 for (name, module), core in zip(named, cores)]
        for unit in units:
            module = unit.module()
            if unit.core is not None and not unit.is_root and self.leaves.matches(unit.name, module):
                # [Note: leaf units reduce at the step]: which of a leaf's parameters get a
                # gradient differs per rank (the experts a router picked), so its buckets
                # would fill, and launch their collectives, at different points on each rank.
                # They accumulate instead and are reduced by fold_grads() at the step, in
                # core order, like every rank's other leftovers.
                unit.core.set_sync(False)
        root = units[-1]
        if root.core is None:  # every parameter is in a unit: the root still drives the order
            root.core = _NoCore()
        unit_of_param = {id(p): unit.name for unit, core in zip(units, cores) if core is not None
                         for p in self.core_params[id(core)]}
        check = (UnitOrderCheck(self.group, [u.name or "<root>" for u in units], self.device)
                 if self.check_unit_order else None)
        runner = UnitRunner(units, prefetch=self.prefetch, check_order=check, unit_of_param=unit_of_param)
        runner.install()
        self.runners[id(model)] = runner

    def _error_explainer(self, model: nn.Module):
        # Weak both ways: [Note: no reference cycles] in units.py.
        model_ref, runner_ref = weakref.ref(model), weakref.ref(self.runners[id(model)])
        return lambda error: explain_unsharded_use(error, model_ref(), runner_ref())

    @contextlib.contextmanager
    def full_params(self, model: nn.Module):
        """Gather every unit of ``model`` (storage dtype) so its parameters can be read; they
        are freed again on exit. A collective: enter it on every rank. Writes are not kept
        (the fp32 masters are the truth; use get_state_dict for fp32 values)."""
        cores = self._cores(model)
        for core in cores:
            core.unshard(True)
        try:
            for core in cores:
                core.wait_unshard()
            yield model
        finally:
            for core in cores:
                core.reshard()

    def release(self) -> None:
        for runner in self.runners.values():
            runner.uninstall()
        self.runners.clear()
        super().release()

    def unit_names(self, model: nn.Module) -> list[str]:
        """Names of the units of ``model`` holding parameters ("" is the root)."""
        return [u.name for u in self.runners[id(model)].units
                if u.core is not None and not isinstance(u.core, _NoCore)]

    def param_buffer_bytes(self) -> int:
        """Bytes of gathered (full) parameter buffers currently allocated on this rank."""
        return sum(c.param_buffer_bytes() for c in self._all_cores())


class _NoCore:
    """Stands in for the root's core when every parameter lives in a unit."""

    unsharded = True

    def unshard(self, async_op: bool = False) -> None:
        return None

    def reshard(self) -> None:
        return None

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
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist
from torch import nn

from .. import _C, kernels
from ..checkpoint.format import model_prefix
from ..policy import PrecisionPolicy, ScalerConfig
from ..parallel.materialize import MATERIALIZED_ATTR, Materializer, has_meta, trim_heap
from ..distributed.structure import check_same_model
from .comm import GroupComm, broadcast_chunks, sync_off
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
from .gathered import guard_params, root_unit_scope
from .zero_state import zero_load_state_shards, zero_state_shards

if TYPE_CHECKING:  # pragma: no cover
    from ..wrappers.model import ForwardContext
    from .base import OptimizerState

# DeepSpeed's dynamic loss scaler (runtime/fp16/loss_scaler.py defaults).
DEEPSPEED_SCALER = ScalerConfig(init_scale=2.0**16, growth_interval=1000, hysteresis=2, min_scale=1.0)


@dataclasses.dataclass
class ShardedOptimizer:
    """What a sharded comm keeps for one prepared optimizer: the cores whose shards it
    steps and its segments of them (its ``param_groups`` hold the segments' masters)."""

    optimizer: torch.optim.Optimizer
    cores: list  # [_C.ShardedCore]
    segments: list[Segment]


class ShardedComm(GroupComm):
    """ZeRO stage ``stage`` (1 or 2; zero3/fsdp below); see the module docstring.

    State, each piece with one owner: the C++ cores hold the shards, the buckets and the
    parameters they shard (``core.params``); this object holds which cores belong to which
    model (``cores``) and to which optimizer, with its segments (``sharded_optimizers``),
    and the per-step flags below.
    """

    name = "zero"
    stage = 0
    replicated_state = False
    owns_masters = True
    steps_closures = False

    @classmethod
    def run_policy(cls, policy: PrecisionPolicy, *, loss_scaler: str = "torch", **options) -> PrecisionPolicy:
        # As __init__: loss_scaler='deepspeed' replaces the fp16 scaler by DeepSpeed's.
        if loss_scaler == "deepspeed" and policy.loss_scaling:
            return dataclasses.replace(policy, scaler=DEEPSPEED_SCALER)
        return policy

    def __init__(
        self,
        policy: PrecisionPolicy,
        device: torch.device,
        *,
        group: Optional[dist.ProcessGroup] = None,
        bucket_cap_mb: float = 25.0,
        first_bucket_cap_mb: float = 1.0,
        collective: str = "auto",
        loss_scaler: str = "torch",
        elementwise_optimizer: bool = False,
        broadcast_buffers: bool = True,
        max_inflight_buckets: int = 2,
    ) -> None:
        super().__init__(policy, device, group=group, bucket_cap_mb=bucket_cap_mb,
                         first_bucket_cap_mb=first_bucket_cap_mb, broadcast_buffers=broadcast_buffers)
        backend = self.name  # zero1 / zero2 / zero3 / fsdp: the name errors echo
        if policy.master_dtype is None:
            raise ValueError(
                f"backend={backend!r} keeps fp32 master shards; mixed_precision={policy.name!r} "
                "has no masters. Use mixed_precision='bf16' (optionally param_dtype=torch.bfloat16)"
            )
        if loss_scaler not in ("torch", "deepspeed"):
            raise ValueError(f"loss_scaler={loss_scaler!r} must be 'torch' or 'deepspeed'")
        if loss_scaler == "deepspeed" and policy.loss_scaling:
            self.policy = dataclasses.replace(policy, scaler=DEEPSPEED_SCALER)
        if isinstance(max_inflight_buckets, bool) or not isinstance(max_inflight_buckets, int) \
                or max_inflight_buckets < 1:
            raise ValueError(f"max_inflight_buckets={max_inflight_buckets!r} must be an int >= 1 "
                             "(gradient buckets reduced at once during backward; default 2)")
        self.backend = backend
        self.options = _C.ShardOptions(
            stage=self.stage, bucket_cap_bytes=self.bucket_cap_bytes,
            first_bucket_cap_bytes=self.first_bucket_cap_bytes, collective=collective,
            group_name=self.group_name, max_inflight_buckets=max_inflight_buckets,
            reduce_dtype=policy.reduce_dtype,  # [Note: low-precision reduction] in core.h
        )  # one in-flight window, shared by every core built from these options
        self.elementwise_optimizer = elementwise_optimizer  # accept unknown optimizers
        self.cores: dict[int, list[_C.ShardedCore]] = {}  # id(model) -> its cores (zero3: one per unit)
        self.sharded_ids: frozenset[int] = frozenset()  # id() of every parameter a core shards
        self._clip_checked: Optional[tuple] = None  # the parameter tuple last found to be sharded_ids
        self.sharded_optimizers: dict[int, ShardedOptimizer] = {}  # id(optimizer) -> its cores, segments
        self._found_inf_agreed = False  # found_inf already all-reduced this step
        self._folded = False  # fold() ran since the last backward / step
        # id(core) -> open gathering scopes holding it ([Note: the gathering context] in
        # engines/gathered.py); zero3's unit runners never free a held core.
        self.gather_pins: dict[int, int] = {}

    # ------------------------------------------------------------------ models
    @staticmethod
    def _sharded_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in model.named_parameters() if p.requires_grad and p.is_floating_point()]

    def start(self, model: nn.Module) -> None:
        """Rank 0's values for what the cores do not hold (buffers, frozen parameters) now;
        the sharded parameters' a core at a time in :meth:`prepare_model` ([Note: rank 0's
        values, a core at a time])."""
        check_same_model(model, self.group)
        sharded = {id(p) for _, p in self._sharded_params(model)}
        rest = [t.detach() for t in model.parameters() if not t.is_meta and id(t) not in sharded]
        with torch.no_grad():
            _C.broadcast_coalesced(rest + list(model.buffers()), self.group_name, 0)

    def prepare_model(self, model: nn.Module, fp32_modules: Sequence[nn.Module]) -> None:
        fp32_ids = {id(p) for m in fp32_modules for p in m.parameters()}
        target = self.policy.param_dtype
        names, params, dtypes = [], [], []
        for name, p in self._sharded_params(model):
            names.append(name)
            params.append(p)
            keep = id(p) in fp32_ids or target is None
            dtypes.append(p.dtype if keep else target)
        if not params:
            raise ValueError(f"{type(model).__name__} has no trainable parameters to train with {self.backend}")
        # [Note: rank 0's values, a core at a time]
        # A model given whole on every rank (from_pretrained, or built with each rank's own
        # random init) trains from rank 0's values, as under ddp. Broadcasting the whole model
        # first would hold it twice (the received copy beside the loaded one, and a write into
        # a memory-mapped checkpoint turns its pages into private memory); instead, right
        # before each core is built, its parameters are broadcast into fresh tensors, a chunk
        # of <= 64 MiB (or one larger tensor) at a time, the core keeps its slice and the
        # whole tensors go. A meta model's parameters are materialised the same way, a core
        # at a time, from the checkpoint or the shared seed, equal on every rank without a
        # broadcast ([Note: materialising a meta model shard by shard] in
        # parallel/materialize.py). So a rank holds its shards plus one core's tensors.
        materializer = Materializer(model, self.device, self.group) if has_meta(model) else None
        modules = dict(model.named_modules())
        # id() of the parameters materialised (here, or whole by compose on zero1/2): equal on every rank
        fresh = {id(model.get_parameter(name)) for _, name in model.__dict__.get(MATERIALIZED_ATTR, {}).values()}
        cores = []
        for indices in self._partition(model, names, params):
            core = None
            if indices:
                if materializer is not None:
                    for owner in dict.fromkeys(names[i].rpartition(".")[0] for i in indices if params[i].is_meta):
                        replaced = materializer.module(owner, modules[owner])
                        fresh.update(id(t) for t in replaced.values())
                        params = [replaced.get(id(p), p) for p in params]
                broadcast_chunks([params[i] for i in indices if id(params[i]) not in fresh], self.group)
                core = _C.ShardedCore([params[i] for i in indices], [names[i] for i in indices],
                                      [dtypes[i] for i in indices], self.group_name, self.options)
                if self.options.shard_params:
                    trim_heap()  # this core's whole tensors go back to the OS, not into holes
            cores.append(core)
        if materializer is not None:
            materializer.rest()  # frozen and non-floating parameters, whole
        trim_heap()
        self.cores[id(model)] = [c for c in cores if c is not None]
        for core in self.cores[id(model)][1:]:
            # [Note: agreed reductions] in csrc/engines/sharded/core.h: reduce() asks whether
            # a backward went through the model, counted over all of its cores.
            core.share_backward_count(self.cores[id(model)][0])
        self.sharded_ids = self.sharded_ids | {id(p) for c in self.cores[id(model)] for p in c.params}
        self._clip_checked = None
        self._install_units(model, cores)

    def model_ready(self, model: nn.Module, ctx: "ForwardContext") -> None:
        ctx.explain_error = self._error_explainer(model)
        super().model_ready(model, ctx)

    def _partition(self, model: nn.Module, names: list[str], params: list[torch.Tensor]) -> list[list[int]]:
        """Indices of ``params`` per sharding core (zero1/2: one core for the model)."""
        return [list(range(len(params)))]

    def _install_units(self, model: nn.Module, cores: list) -> None:
        """Zero3 gathers/frees units around forward and backward; zero1/2 keep full params."""

    def _error_explainer(self, model: nn.Module):
        """How the prepared model's forward reads an error (zero1/2: nothing to add)."""
        return None

    def describe_layout(self, model: nn.Module) -> str:
        buckets = sum(len(c.bucket_indices()) for c in self.cores[id(model)])
        return f"{buckets} gradient bucket(s) ({self._bucket_caps()})"

    def all_cores(self) -> list[_C.ShardedCore]:
        """Every sharding core of every prepared model."""
        return [c for cores in self.cores.values() for c in cores]

    def model_cores(self, model: nn.Module) -> list[_C.ShardedCore]:
        cores = self.cores.get(id(model))
        if cores is None:
            raise ValueError(f"got a model that this accelerator did not prepare: {type(model).__name__}")
        return cores

    sync_parts = model_cores

    def release(self) -> None:
        """Drop every sharding core (each holds the process group; its destructor removes
        its gradient hooks). Called by ``Accelerator.end_training`` before the group is
        destroyed; the engine cannot step afterwards."""
        self.cores.clear()
        self.sharded_optimizers.clear()

    def zero_model_grads(self, model: nn.Module, set_to_none: bool = True) -> None:
        # [Note: model.zero_grad() frees the gradient shard]
        # transformers' Trainer ends every step with model.zero_grad() (set_to_none=True) and
        # never calls the optimizer's. Zeroing the shard in place there kept 4P/N of fp32
        # gradient resident through the next forward and backward (and touched every page
        # of it, the root unit's slice included, before its reduction lands): GPT-2 124M on
        # zero3, 2 ranks, 237 MiB per rank, the peak 1.07x FSDP2's, whose model.zero_grad()
        # drops its sharded grads (benchmarks/probe_trainer_memory.py). With set_to_none the
        # model's cores release their shard as the optimizer's zero_grad does ([Note: what
        # lives between steps] in csrc/engines/sharded/core.h): the segments' .grad views of
        # it go first (fold() attaches views of the next shard only to a .grad that is None),
        # so the memory goes; a .grad the user still holds keeps its values, as in torch.
        # The next reduction lands in a fresh shard whose slices are zeroed before their
        # first add: the same values as the zeroed shard.
        cores = self.model_cores(model)
        if set_to_none:
            ids = {id(c) for c in cores}
            for sharded in self.sharded_optimizers.values():
                for s in sharded.segments:
                    if id(s.core) in ids:
                        s.master.grad = None
        for core in cores:
            core.zero_grad(release=set_to_none)
        self._folded = False

    def full_state_is_local(self, model: nn.Module) -> bool:
        # zero1/2 all-gather the updated masters into the model's parameters at every step
        # (publish), rounded to their storage dtype: in fp32 storage they are the masters.
        if self.options.shard_params:
            return False
        return all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad and p.is_floating_point())

    def fill_full_state(self, model: nn.Module, state: dict) -> None:
        """fp32 parameters gathered from the master shards. A collective: call it on every
        rank (unless :meth:`full_state_is_local`: the model's parameters are then the masters)."""
        if self.full_state_is_local(model):
            return
        by_id = {}
        for core in self.model_cores(model):
            by_id.update({id(p): t for p, t in zip(core.params, core.full_masters())})
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in by_id and name in state:
                state[name] = by_id[id(p)]

    # ------------------------------------------------------------ checkpoints
    def state_names(self, models: list[nn.Module]) -> dict[str, tuple]:
        return {model_prefix(i) + n: tuple(t.shape)
                for i, m in enumerate(models) for n, t in m.state_dict(keep_vars=True).items()}

    def state_dtypes(self, models: list[nn.Module]) -> dict:
        sharded = self.sharded_ids
        return {model_prefix(i) + n: torch.float32 if id(t) in sharded else t.dtype
                for i, m in enumerate(models) for n, t in m.state_dict(keep_vars=True).items()}

    def state_shards(self, models, optimizers) -> list:
        """The slices this rank owns (see mixprec/engines/zero_state.py)."""
        return zero_state_shards(self, models, optimizers)

    def load_state_shards(self, models, optimizers, read) -> None:
        zero_load_state_shards(self, models, optimizers, read)

    # --------------------------------------------------------------- optimizers
    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Swap every param group to this rank's fp32 shard segments (hyper-parameters kept)."""
        check_optimizer(optimizer, self.backend, self.elementwise_optimizer)
        if len(optimizer.state):
            raise ValueError(
                f"{type(optimizer).__name__} already holds state for {len(optimizer.state)} "
                f"parameter(s); {self.backend} shards fresh state only. Call prepare() before the "
                "first optimizer step"
            )
        core_of = {id(p): core for core in self.all_cores() for p in core.params}
        group_of: dict[int, int] = {}
        cores: dict[int, _C.ShardedCore] = {}
        for g, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                core = core_of.get(id(p))
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
            params = core.params
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
        self.sharded_optimizers[id(optimizer)] = ShardedOptimizer(optimizer, list(cores.values()), segments)

    def segments_of(self, optimizer: torch.optim.Optimizer) -> list[Segment]:
        return self.sharded_optimizers[id(optimizer)].segments

    # ---------------------------------------------------------------- gradients
    def grads_changed(self) -> None:
        self._folded = False  # the C++ hooks move the gradients into buckets or shards

    def after_backward(self) -> None:
        return None  # the reductions finish at fold(), when something reads the gradients

    def fold(self) -> None:
        """Finish any pending reduction and show the optimizers their gradient shards.
        Done once between a backward and the end of the step (clip, unscale and step all
        ask for it; the later calls cost nothing and cross into C++ no more)."""
        if self._folded:
            return
        self._folded = True
        cores = self.all_cores()
        holds = dict(zip(map(id, cores), _C.finish_reductions(cores)))  # one call for all
        for sharded in self.sharded_optimizers.values():
            have = any(holds[id(c)] for c in sharded.cores)
            if have:
                # A core that got no gradient (a unit unused in this backward) shows zeros,
                # as before zero_grad() freed its shard ([Note: what lives between steps]).
                for c in sharded.cores:
                    if not holds[id(c)]:
                        c.ensure_grad_shard()
            for s in sharded.segments:
                if have and s.master.grad is None:
                    s.master.grad = s.grad_view()
                elif not have:
                    s.master.grad = None

    @contextlib.contextmanager
    def coalesce_grad_reduction(self, *models: nn.Module):
        """Several backward calls inside, one reduction (in bucket order) on exit."""
        cores = [c for m in models for c in self.model_cores(m)] if models else self.all_cores()
        with sync_off(cores):
            yield
        for c in cores:
            c.reduce()

    def agree_found_inf(self) -> None:
        # [Note: found_inf agreement]
        # Each rank checked only the gradient shard it owns, so an overflow is seen by one
        # rank only. The flag is all-reduced (MAX) before anyone reads it: every rank then
        # skips, or steps, together, and the scaler states stay identical. bf16/fp32 agree
        # their non-finite flag the same way (see [Note: non-finite guard] in engines/base.py).
        if self._found_inf_agreed:
            return
        dist.all_reduce(self.precision.found_inf, op=dist.ReduceOp.MAX, group=self.group)
        self._found_inf_agreed = True

    def all_segment_grads(self) -> list[torch.Tensor]:
        return [s.master.grad for sharded in self.sharded_optimizers.values() for s in sharded.segments
                if s.master.grad is not None]

    def clip_grads(self, parameters: Iterable[torch.Tensor], *, whole: bool) -> list[torch.Tensor]:
        # A prepared model's cached parameter tuple ([Note: the clip shares the step plan] in
        # engines/clip_sources.py) is the same object while valid: checked once.
        if whole and not (isinstance(parameters, tuple) and self._clip_checked is parameters):
            given = {id(p) for p in parameters if p.requires_grad}
            if given == self.sharded_ids and isinstance(parameters, tuple):
                self._clip_checked = parameters
            if given != self.sharded_ids:
                raise ValueError(
                    f"{self.backend} computes the gradient norm over every sharded parameter; got "
                    f"{len(given)} trainable parameter(s) but {len(self.sharded_ids)} are sharded. "
                    "Pass model.parameters() of all prepared models"
                )
        self.fold()
        return self.all_segment_grads()

    def global_norm(self, grads: list[torch.Tensor], norm_type: float,
                    check: Optional[torch.Tensor]) -> torch.Tensor:
        """The norm from the owned shards with ONE all-reduce: the norm and found_inf travel
        together, so every rank gets the same value and the same flag."""
        p = float(norm_type)
        if p == math.inf:
            # One device reduction (no Python comparison of tensors, which reads each on the host).
            local = (torch.stack(torch._foreach_norm(grads, math.inf)).amax().double() if grads
                     else torch.zeros((), dtype=torch.float64))
            op = dist.ReduceOp.MAX
        elif p == 2.0:
            local = kernels.l2_norm(grads, check).double() ** 2 if grads else torch.zeros((), dtype=torch.float64)
            op = dist.ReduceOp.SUM
        else:
            local = sum((g.double().abs() ** p).sum() for g in grads) if grads else torch.zeros((), dtype=torch.float64)
            op = dist.ReduceOp.SUM
        found_inf = self.precision.found_inf
        flag = found_inf.double().reshape(())
        packet = torch.stack([local.to(self.device).reshape(()), flag.to(self.device)])
        dist.all_reduce(packet, op=op, group=self.group)
        found_inf.copy_(packet[1:2].gt(0))  # on the device: no host read
        self._found_inf_agreed = True
        return (packet[0] if p == math.inf else packet[0] ** (1.0 / p)).float()

    # ------------------------------------------------------------------ steps
    def step_finish(self, state: "OptimizerState", finish: dict) -> dict:
        # [Note: one call per step]: the agreement ([Note: found_inf agreement]) and the
        # gather of the updated shards (zero1/2) ride in the step's one call.
        if not self._found_inf_agreed:
            finish["agree_group"] = self.group_name
        if not self.options.shard_params:
            finish["gather"] = self.sharded_optimizers[id(state.optimizer)].cores
        return finish

    def update_targets(self) -> dict:
        # The update writes the fp32 masters only: the gathers round them to the storage
        # dtype ([Note: what lives between steps] in csrc/engines/sharded/core.h).
        return {}

    def publish(self, optimizer: torch.optim.Optimizer, refresh: bool) -> None:
        """Make the updated shards the model's parameters: zero1/2 all-gather them now;
        zero3 has nothing to do (the next forward gathers from the masters)."""
        if self.options.shard_params:
            return
        for core in self.sharded_optimizers[id(optimizer)].cores:
            core.gather_params()

    def step_done(self) -> None:
        self._found_inf_agreed = False
        self._folded = False

    def zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        # set_to_none: the optimizer's zero_grad has just set every master's .grad to None,
        # so the gradient shard's memory can go until the next reduction ([Note: what lives
        # between steps] in csrc/engines/sharded/core.h).
        for core in self.sharded_optimizers[id(optimizer)].cores:
            core.zero_grad(release=set_to_none)
        self._folded = False

    # ------------------------------------------------------------ reporting
    def bytes_communicated_last_step(self) -> dict:
        """Bytes handed to collectives by the last reduction and the last parameter gather."""
        reduced = sum(c.bytes_reduced_last() for c in self.all_cores())
        gathered = sum(c.bytes_gathered_last() for c in self.all_cores())
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
        for core in self.all_cores():
            for key, value in core.comm_counters().items():
                total[key] += value
        return total

    def reset_comm_counters(self) -> None:
        """Zero the counters of :meth:`comm_counters` (every core of every model)."""
        for core in self.all_cores():
            core.reset_comm_counters()

    def persistent_bytes(self) -> dict:
        """Per-rank bytes held right now: the model's flat parameter buffers (``params``:
        full for zero1/2; for zero3/fsdp only the units gathered right now, 0 between
        steps), master shard, optimizer state of the shards, and gradients (the shard and
        full fp32 buckets while allocated: ``optimizer.zero_grad()`` frees both)."""
        cores = self.all_cores()
        params = sum(c.param_buffer_bytes() for c in cores)
        masters = sum(c.master_shard.nbytes for c in cores)
        opt_state = 0
        for sharded in self.sharded_optimizers.values():
            for per_param in sharded.optimizer.state.values():
                opt_state += sum(v.nbytes for v in per_param.values()
                                 if isinstance(v, torch.Tensor) and v.dim() > 0)
        grads = sum(c.grad_shard_bytes() + c.grad_bucket_bytes() for c in cores)
        return {"params": params, "master": masters, "optimizer_state": opt_state,
                "grads": grads}


class Zero1Comm(ShardedComm):
    """ZeRO-1: optimizer state and fp32 masters sharded; full gradients until the step."""

    name = "zero1"
    stage = 1


class Zero2Comm(ShardedComm):
    """ZeRO-2: + gradients reduce-scattered during backward into the owned shard."""

    name = "zero2"
    stage = 2


class Zero3Comm(ShardedComm):
    """ZeRO-3: + parameters sharded per unit, gathered around each unit's forward and
    backward and freed after use (src/mixprec/engines/units.py)."""

    name = "zero3"
    stage = 3
    shards_parameters = True  # the stage-3 cores free their flat parameter buffers between uses
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
        if not isinstance(check_unit_order, bool) and check_unit_order != "every_gather":
            raise ValueError(f"check_unit_order={check_unit_order!r} must be True (the default: batched where the "
                             "unit order is established), 'every_gather' (an exchange before every forward "
                             "gather) or False")
        # [Note: unit order check] and [Note: batched unit order check] in units.py
        self.check_unit_order = check_unit_order
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
                # They accumulate instead and are reduced by fold() at the step, in
                # core order, like every rank's other leftovers.
                unit.core.set_sync(False)
        root = units[-1]
        if root.core is None:  # every parameter is in a unit: the root still drives the order
            root.core = _NoCore()
        unit_of_param = {id(p): unit.name for unit, core in zip(units, cores) if core is not None
                         for p in core.params}
        mode = "every_gather" if self.check_unit_order == "every_gather" else "auto"
        check = (UnitOrderCheck(self.group, [u.name or "<root>" for u in units], self.device, mode=mode)
                 if self.check_unit_order else None)
        runner = UnitRunner(units, prefetch=self.prefetch, check_order=check, unit_of_param=unit_of_param,
                            pins=self.gather_pins)
        runner.install()
        self.runners[id(model)] = runner
        # [Note: guarded sharded parameters] in engines/gathered.py: outside a gathered scope
        # an op on a sharded parameter raises naming it, instead of reading freed storage.
        guard_params(model, units, self.backend, self.world_size)

    def model_ready(self, model: nn.Module, ctx: "ForwardContext") -> None:
        ctx.plain_params = True  # the forward skips the guard's check (gathered.py)
        ctx.generate_scope = root_unit_scope
        super().model_ready(model, ctx)

    def _error_explainer(self, model: nn.Module):
        # Weak both ways: [Note: no reference cycles] in units.py.
        model_ref, runner_ref = weakref.ref(model), weakref.ref(self.runners[id(model)])
        return lambda error: explain_unsharded_use(error, model_ref(), runner_ref())

    @contextlib.contextmanager
    def full_params(self, model: nn.Module):
        """Gather every unit of ``model`` (storage dtype) so its parameters can be read; they
        are freed again on exit. A collective: enter it on every rank. Writes are not kept
        (``accelerator.gathered_parameters(model, modifier_rank=0)`` keeps them:
        engines/gathered.py)."""
        from .gathered import GatheredScope

        self.model_cores(model)  # a model this engine prepared
        with GatheredScope(self, model):
            yield model

    def release(self) -> None:
        for runner in self.runners.values():
            runner.uninstall()
        self.runners.clear()
        super().release()

    def describe_layout(self, model: nn.Module) -> str:
        return f"{len(self.unit_names(model))} sharding unit(s)"

    def unit_names(self, model: nn.Module) -> list[str]:
        """Names of the units of ``model`` holding parameters ("" is the root)."""
        return [u.name for u in self.runners[id(model)].units
                if u.core is not None and not isinstance(u.core, _NoCore)]

    def param_buffer_bytes(self) -> int:
        """Bytes of gathered (full) parameter buffers currently allocated on this rank."""
        return sum(c.param_buffer_bytes() for c in self.all_cores())


class _NoCore:
    """Stands in for the root's core when every parameter lives in a unit."""

    unsharded = True

    def unshard(self, async_op: bool = False) -> None:
        return None

    def reshard(self) -> None:
        return None

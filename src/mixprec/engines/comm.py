"""The communication half of an engine: where gradients live and how they move.

[Note: engine = precision + communication]
An :class:`~mixprec.engines.base.Engine` is the step driver. It composes two objects and
holds neither's state:

- ``engine.precision`` (engines/precision.py, [Note: precision layer]): the policy's
  numbers: the loss scaler, the fp32 masters of low-precision parameters on the replicated
  backends, the non-finite flag, the forward context, unscale and the clip arithmetic;
- ``engine.comm``, a :class:`Comm`: the backend. ``SingleComm`` (engines/single.py) keeps
  everything local; ``DDPComm`` (engines/ddp.py) all-reduces gradient buckets with the C++
  Reducer; ``ShardedComm`` and its ZeRO-1/2/3 subclasses (engines/zero.py) and ``FSDPComm``
  (engines/fsdp.py) reduce-scatter into the fp32 shards of the C++ ShardedCore and step
  those.

The driver runs the same code on every backend (backward, unscale, clip, the step in one
C++ call of [Note: one call per step] in csrc/engines/step/fused_step.h, zero_grad) and asks
the comm at the few points where backends differ: the hooks of :class:`Comm`. A backend is
chosen by name (``ENGINES`` in engines/__init__.py maps it to its Comm class); its
``engine_options`` are that class's keyword arguments.

Below the contract: what the data-parallel comms (ddp, zero, fsdp) share, written once
(:class:`GroupComm`: the process group, the replicated start, the buffer broadcast before
forward, switching gradient synchronisation off).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, ClassVar, Optional

import torch
import torch.distributed as dist
from torch import nn

from .. import _C, kernels
from ..checkpoint.format import model_prefix
from ..distributed.structure import check_same_model
from ..policy import PrecisionPolicy
from .clip_sources import PlannedGrads, PlannedParameters
from .replicated_state import replicated_load_state_shards, replicated_state_shards

if TYPE_CHECKING:  # pragma: no cover
    from ..wrappers.model import ForwardContext
    from .base import OptimizerState
    from .precision import Precision


class Comm:
    """The communication contract ([Note: engine = precision + communication]).

    The defaults describe a backend that keeps whole tensors and needs no communication
    (``SingleComm`` adds nothing). The Engine calls, in order: ``attach`` (its precision
    layer); per model ``start``, ``prepare_model``, ``model_ready``; per optimizer
    ``prepare_optimizer``; per step ``grads_changed`` and ``after_backward`` around each
    backward, ``fold`` before anything reads gradients, ``checked`` / ``agree_found_inf``
    (the non-finite check), ``clip_grads`` and ``global_norm`` (a norm clip),
    ``step_finish``, ``update_targets`` and ``publish`` around the update, ``step_done``
    and ``checks_cleared`` after it, ``zero_grad``; ``release`` at the end. Checkpoints go
    through ``state_names`` / ``state_dtypes`` / ``state_shards`` / ``load_state_shards``.
    """

    name: ClassVar[str] = "single"
    distributed: ClassVar[bool] = False  # takes a `group=` process group
    # Every rank holds whole tensors: the replicated checkpoint contract applies
    # (engines/replicated_state.py), and the fused update may write the forward's weights.
    replicated_state: ClassVar[bool] = True
    # The optimizer steps fp32 shard segments this comm owns; False: it steps the model's
    # parameters or their fp32 masters (held by the precision layer).
    owns_masters: ClassVar[bool] = False
    steps_closures: ClassVar[bool] = True  # optimizer.step(closure) is supported
    # ZeRO stage 3 (zero3, fsdp): keeps 1/N of each parameter between uses and gathers it per
    # unit. Accelerate calls such a run FSDP (compat/state.py); `mixprec config explain` shows
    # its parameters as shards. tests/test_explain_facts.py checks it against the built comm.
    shards_parameters: ClassVar[bool] = False

    @classmethod
    def run_policy(cls, policy: PrecisionPolicy, **options) -> PrecisionPolicy:
        """The policy this backend runs for ``policy`` and its ``engine_options`` (what
        ``__init__`` makes ``self.policy``; ``mixprec config explain`` shows it). ValueError
        when an option contradicts ``policy``. Here: ``policy`` unchanged."""
        return policy

    def __init__(self, policy: PrecisionPolicy, device: torch.device) -> None:
        self.policy = policy  # the policy the engine runs (a comm may adjust the one given)
        self.device = device
        self.precision: Optional[Precision] = None  # set by attach()

    def attach(self, precision: "Precision") -> None:
        """The engine's precision layer, for the hooks that use its flag and masters."""
        self.precision = precision

    # ------------------------------------------------------------------ models
    def start(self, model: nn.Module) -> None:
        """The model, on the device, before any cast (data-parallel: rank 0's values)."""

    def prepare_model(self, model: nn.Module, fp32_modules: Sequence[nn.Module]) -> None:
        """Take over the model's gradients (after the precision layer made its masters)."""

    def model_ready(self, model: nn.Module, ctx: "ForwardContext") -> None:
        """The model's forward follows the policy now (``ctx``: its forward context)."""

    def describe_layout(self, model: nn.Module) -> str:
        """How this backend laid ``model`` out, for the start-up line (mixprec/startup.py)."""
        return "no gradient communication"

    def zero_model_grads(self, model: nn.Module, set_to_none: bool = True) -> None:
        """``model.zero_grad(set_to_none)`` on a prepared model: drop what the comm holds for
        it (with ``set_to_none``, its memory too)."""

    def fill_full_state(self, model: nn.Module, state: dict) -> None:
        """Put the full fp32 value of every parameter this comm shards into ``state``."""

    def full_state_is_local(self, model: nn.Module) -> bool:
        """True when :meth:`fill_full_state` needs no collective (nothing is sharded, or the
        model's own parameters are the fp32 masters): ``get_state_dict`` may then run on one
        rank alone, and after ``release()``."""
        return True

    # --------------------------------------------------------------- optimizers
    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Point ``optimizer`` at what it steps (sharded: this rank's segments)."""

    # ---------------------------------------------------------------- gradients
    def grads_changed(self) -> None:
        """A backward is about to add gradients."""

    def after_backward(self) -> None:
        """A backward ended (here: fold low-precision grads into the fp32 masters)."""
        self.fold()

    def fold(self) -> None:
        """Make every optimizer's ``.grad`` current (finish reductions, fold masters)."""
        self.precision.fold_grads()

    def no_sync(self, model: nn.Module):
        """Context in which gradients accumulate locally without communication."""
        return contextlib.nullcontext()

    def checked(self, optimizer: torch.optim.Optimizer) -> bool:
        """True when this optimizer's gradients were already checked for inf/nan by the
        comm (ddp's copy-in) and the flag is in ``precision.found_inf``."""
        return False

    def agree_found_inf(self) -> None:
        """Make ``precision.found_inf`` the same on every rank."""

    def clip_grads(self, parameters: Iterable[torch.Tensor], *, whole: bool) -> list[torch.Tensor]:
        """The gradients a clip of ``parameters`` reads (folded first). ``whole``: a norm
        clip, which a sharded comm computes over every parameter it shards."""
        self.fold()
        if isinstance(parameters, PlannedParameters):
            # [Note: the clip shares the step plan] (engines/clip_sources.py)
            return PlannedGrads(parameters.plans, parameters.sources, parameters.outsiders)
        grad_of = self.precision.grad_of
        return [g for p in parameters if (g := grad_of(p)) is not None]

    def global_norm(self, grads: list[torch.Tensor], norm_type: float,
                    check: Optional[torch.Tensor]) -> torch.Tensor:
        """The norm of the whole gradient given this rank's ``grads`` (fp32 device
        scalar); ``check``: also OR inf/nan into this flag (2-norm only)."""
        if isinstance(grads, PlannedGrads):
            total = kernels.plans_l2_norm(grads.plans, check, grads.sources, grads.outsiders)
            return torch.zeros((), device=self.device) if total is None else total
        if not grads:
            return torch.zeros((), device=self.device)
        if float(norm_type) == 2.0:
            return kernels.l2_norm_any(grads, check)
        return torch.nn.utils.get_total_norm(grads, norm_type)

    # ------------------------------------------------------------------- steps
    def step_finish(self, state: "OptimizerState", finish: dict) -> dict:
        """The keyword arguments of the one-call step ([Note: one call per step]) that
        this comm adds around the update (found_inf agreement, gathers)."""
        return finish

    def update_targets(self) -> dict:
        """id(optimizer param) -> the low-precision tensor the fused update writes."""
        return self.precision.update_targets()

    def publish(self, optimizer: torch.optim.Optimizer, refresh: bool) -> None:
        """The update is done: make it the model's parameters (sharded: gather).
        ``refresh``: the low-precision copies were not written by the update."""

    def step_done(self) -> None:
        """``optimizer.step()`` returned or raised."""

    def checks_cleared(self) -> None:
        """Every optimizer stepped: the non-finite flag of this iteration is spent."""

    def zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        """``optimizer.zero_grad(set_to_none)`` ran: drop what the comm holds for its
        gradients (with ``set_to_none``, their memory too)."""

    def release(self) -> None:
        """Drop what holds the process group (end of training)."""

    # ------------------------------------------------------------- checkpoints
    def state_names(self, models: list[nn.Module]) -> dict[str, tuple]:
        """Every global model tensor a checkpoint of ``models`` holds: name -> shape."""
        return {s.name: tuple(s.shape) for s in self.state_shards(models, [])}

    def state_dtypes(self, models: list[nn.Module]) -> dict:
        """Global model tensor name -> the dtype it is saved and loaded in (fp32 where
        there is a master)."""
        master_of = self.precision.master_of
        return {model_prefix(i) + name: master_of.get(id(t), t).dtype
                for i, m in enumerate(models) for name, t in m.state_dict(keep_vars=True).items()}

    def state_shards(self, models: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> list:
        """See ``Engine.state_shards``: whole tensors here (engines/replicated_state.py)."""
        return replicated_state_shards(self.precision, models, optimizers)

    def load_state_shards(self, models: list[nn.Module], optimizers: list[torch.optim.Optimizer], read) -> None:
        replicated_load_state_shards(self.precision, models, optimizers, read)


class GroupComm(Comm):
    """What the data-parallel comms share: a process group, rank 0's start, rank 0's
    buffers before every forward, and ``no_sync`` over their reducers or cores."""

    distributed = True

    def __init__(self, policy: PrecisionPolicy, device: torch.device, *,
                 group: Optional[dist.ProcessGroup] = None, bucket_cap_mb: float = 25.0,
                 first_bucket_cap_mb: float = 1.0, broadcast_buffers: bool = True) -> None:
        super().__init__(policy, device)
        # The communication group and the name C++ resolves it by.
        self.group, self.group_name, self.world_size = process_group(self.name, group)
        check_bucket_caps(bucket_cap_mb=bucket_cap_mb, first_bucket_cap_mb=first_bucket_cap_mb)
        self.bucket_cap_bytes = int(bucket_cap_mb * 2**20)
        self.first_bucket_cap_bytes = int(first_bucket_cap_mb * 2**20)
        self.broadcast_buffers = broadcast_buffers  # rank 0's buffers before every forward

    def _bucket_caps(self) -> str:
        return f"cap {self.bucket_cap_bytes / 2**20:g} MB, first {self.first_bucket_cap_bytes / 2**20:g} MB"

    def start(self, model: nn.Module) -> None:
        start_replicas(model, self.group, self.group_name)

    def model_ready(self, model: nn.Module, ctx: "ForwardContext") -> None:
        if self.broadcast_buffers:
            install_buffer_sync(model, self.group_name)

    def sync_parts(self, model: nn.Module) -> list:
        """The Reducers or ShardedCores that reduce ``model``'s gradients."""
        raise NotImplementedError(f"{type(self).__name__}.sync_parts")

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module):
        with sync_off(self.sync_parts(model)):
            yield


def process_group(backend: str, group: dist.ProcessGroup | None) -> tuple[dist.ProcessGroup, str, int]:
    """(group, its name for C++, world size); WORLD when ``group`` is None."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"backend={backend!r} needs an initialised torch.distributed process group: start the "
            "script with `mixprec launch --nproc-per-node N script.py`"
        )
    group = group if group is not None else dist.group.WORLD
    return group, group.group_name, dist.get_world_size(group)


def check_bucket_caps(**caps_mb: float) -> None:
    for name, value in caps_mb.items():
        if not value > 0:
            raise ValueError(f"{name}={value!r} must be > 0 (MiB)")


def start_replicas(model: nn.Module, group: dist.ProcessGroup, group_name: str, params: bool = True) -> None:
    """Check that every rank built the same model ([Note: structure check at prepare]), then
    give every rank rank 0's parameters and buffers, in the dtypes given (before any
    low-precision cast, so fp32 masters are exact everywhere)."""
    check_same_model(model, group)
    # Meta parameters have no values yet: every rank materialises the same ones from one
    # seed ([Note: materialising a meta model shard by shard] in parallel/materialize.py).
    # Parameters go a chunk at a time into fresh memory: the model is never held twice, and
    # rank 0's memory-mapped checkpoint stays unwritten ([Note: rank 0's values, a core at a
    # time] in engines/zero.py).
    if params:  # (tensor parallelism sends each module's right before its split: tensor/apply.py)
        broadcast_chunks([t for t in model.parameters() if not t.is_meta], group)
    with torch.no_grad():
        _C.broadcast_coalesced(list(model.buffers()), group_name, 0)


CHUNK_BYTES = 64 << 20


def broadcast_chunks(params: Sequence[torch.Tensor], group: dist.ProcessGroup,
                     chunk_bytes: int = CHUNK_BYTES) -> None:
    """Rank 0's values of ``params`` on every rank of ``group``, a chunk of consecutive
    same-dtype tensors (<= ``chunk_bytes``, or one larger tensor) at a time ([Note: rank 0's
    values, a core at a time] in engines/zero.py). Rank 0 only reads its tensors (a
    memory-mapped checkpoint stays unwritten); the others receive into fresh memory that
    replaces theirs, so a rank holds at most one chunk beyond its parameters."""
    if dist.get_world_size(group) == 1 or not params:
        return
    root = dist.get_global_rank(group, 0)
    mine = dist.get_rank() == root
    chunks: list[list[torch.Tensor]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if not chunks or size + nbytes > chunk_bytes or chunks[-1][0].dtype != p.dtype \
                or chunks[-1][0].device != p.device:
            chunks.append([])
            size = 0
        chunks[-1].append(p)
        size += nbytes
    with torch.no_grad():
        for chunk in chunks:
            if mine:
                flat = chunk[0].detach().reshape(-1) if len(chunk) == 1 else \
                    torch.cat([p.detach().reshape(-1) for p in chunk])
            else:
                flat = torch.empty(sum(p.numel() for p in chunk), dtype=chunk[0].dtype, device=chunk[0].device)
            dist.broadcast(flat, src=root, group=group)
            if not mine:
                for p, part in zip(chunk, flat.split([p.numel() for p in chunk])):
                    p.data = part.view(p.shape)


def sync_buffers(model: nn.Module, group_name: str) -> None:
    """Rank 0's buffers to every rank before a forward that records grads (ddp, zero)."""
    buffers = list(model.buffers())
    if buffers and torch.is_grad_enabled():
        with torch.no_grad():
            _C.broadcast_coalesced(buffers, group_name, 0)


def install_buffer_sync(model: nn.Module, group_name: str) -> None:
    """Broadcast rank 0's buffers before each of the prepared model's forwards. The hook
    holds the model weakly ([Note: no reference cycles] in units.py)."""
    if any(True for _ in model.buffers()):
        ref = weakref.ref(model)
        model._mixprec_ctx.pre_forward = lambda: sync_buffers(ref(), group_name)


@contextlib.contextmanager
def sync_off(parts: Sequence):
    """Reducers or sharding cores accumulate locally inside (``no_sync``); each gets its
    own previous setting back on exit."""
    previous = [p.sync for p in parts]
    for p in parts:
        p.set_sync(False)
    try:
        yield
    finally:
        for p, prev in zip(parts, previous):
            p.set_sync(prev)

"""``accelerator.state``, ``mixprec.AcceleratorState()`` and ``mixprec.PartialState()``: the
process's :class:`~mixprec.distributed.DistributedState` with the attribute names of
Accelerate's ``AcceleratorState`` / ``PartialState``.

The state is the DistributedState the collectives take (a subclass of it), so nothing
internal changes; it only adds ``process_index``, ``local_process_index``,
``distributed_type``, ``mixed_precision``, ``initialized``, ``is_last_process``,
``use_distributed``, ``debug`` and the process helpers Accelerate's state has
(``wait_for_everyone``, ``split_between_processes``, ``main_process_first``, ``print``).

[Note: state objects backed by the live Accelerator]
Accelerate keeps one process-wide state that ``AcceleratorState()`` and ``PartialState()``
return. mixprec keeps no such singleton: each Accelerator holds its own state. Called
without arguments, ``mixprec.AcceleratorState()`` / ``mixprec.PartialState()`` return the
state of the newest live Accelerator of this process (not ended, not reset); with none, a
state read from the environment (``init_distributed``: the launcher's RANK, WORLD_SIZE...,
which joins the job's process group as Accelerate's ``PartialState()`` does), kept until
``_reset_state()``. ``AcceleratorState._reset_state()`` does what Accelerate's does to the
Accelerators made before it: their states report ``initialized == False`` and their
``prepare()`` raises AttributeError (make a new Accelerator, as with Accelerate); the
Accelerators made after it are not affected.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch

from .. import registry
from ..distributed import collectives
from ..distributed.state import DistributedState
from ..engines import ENGINES
from ..registry import live_accelerator, register  # noqa: F401 - compat_state.register, as before
from .options import DistributedType

_GENERATION = [0]  # bumped by _reset_state(): states of earlier generations are not initialized
_ACCELERATORS = registry.ACCELERATORS  # weak references to this process's Accelerators, oldest first
_STANDALONE: list = [None]  # the state PartialState() read from the environment, with no Accelerator

RESET_MESSAGE = (
    "`AcceleratorState` object has no attribute `{name}`. This happens if `AcceleratorState._reset_state()` "
    "was called and an `Accelerator` or `PartialState` was not reinitialized: make a new Accelerator after "
    "_reset_state()"
)


def _current(cls: type) -> "PartialState":
    acc = live_accelerator()
    if acc is not None:
        return acc.state
    if _STANDALONE[0] is None:
        from ..distributed.state import init_distributed

        dist = torch.distributed
        creates = not (dist.is_available() and dist.is_initialized())
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        base = init_distributed(device)
        if creates and base.group is not None:
            registry.CREATED_GROUPS.add(base.group.group_name)  # torn down at exit like an Accelerator's
        backend = "ddp" if base.world_size > 1 else "single"
        _STANDALONE[0] = AcceleratorState.from_state(base, mixed_precision="no", backend_name=backend)
    return _STANDALONE[0]


def forget_process_states() -> None:
    """Drop the registry and the environment state (a test harness reusing a process)."""
    _ACCELERATORS.clear()
    _STANDALONE[0] = None


class _Shared(type):
    """``AcceleratorState()`` / ``PartialState()`` with no arguments: the live state ([Note:
    state objects backed by the live Accelerator]); with fields: a new state object."""

    def __call__(cls, *args: Any, **kwargs: Any):
        if args or kwargs:
            return super().__call__(*args, **kwargs)
        return _current(cls)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PartialState(DistributedState, metaclass=_Shared):
    """See the module docstring. ``backend_name`` is mixprec's backend (``"ddp"``, ``"zero3"``...),
    what ``print(state)`` shows as ``Backend:``; ``backend`` keeps Accelerate's meaning, the
    process group's backend (``"gloo"``, ``"nccl"``, None on one process), shown as
    ``Process group backend:``."""

    mixed_precision: str = "no"
    backend_name: str = "single"
    # Accelerate's debug flag (checks shapes before collectives there); kept for scripts that
    # set it. mixprec's collectives always check what they can (distributed/collectives.py).
    debug: bool = dataclasses.field(default=False, compare=False)
    generation: int = dataclasses.field(default_factory=lambda: _GENERATION[0], compare=False, repr=False)

    @property
    def initialized(self) -> bool:
        """False once ``_reset_state()`` was called after this state was made."""
        return self.generation == _GENERATION[0]

    @staticmethod
    def _reset_state(reset_partial_state: bool = False) -> None:
        """Accelerate's reset: the Accelerators made so far stop being usable for ``prepare()``
        and their states report ``initialized == False``; the next ``AcceleratorState()``
        (with no Accelerator made since) is read from the environment again."""
        _GENERATION[0] += 1
        _STANDALONE[0] = None
        for ref in _ACCELERATORS:
            acc = ref()
            if acc is not None:
                acc.__dict__["_state_reset"] = True

    @classmethod
    def from_state(cls, state: DistributedState, *, mixed_precision: str, backend_name: str) -> "PartialState":
        base = {f.name: getattr(state, f.name) for f in dataclasses.fields(DistributedState)}
        return cls(**base, mixed_precision=mixed_precision, backend_name=backend_name)

    @property
    def process_index(self) -> int:
        return self.rank

    @property
    def local_process_index(self) -> int:
        return self.local_rank

    @property
    def is_last_process(self) -> bool:
        return self.rank == self.world_size - 1

    @property
    def use_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def distributed_type(self) -> DistributedType:
        """Accelerate's name for this setup: NO on one process; FSDP for the zero3/fsdp
        (sharded-parameter) engines; else MULTI_GPU / MULTI_CPU by device."""
        comm = ENGINES.get(self.backend_name)  # the backend's Comm class says what it does
        if self.world_size == 1 and comm is not None and not comm.distributed:
            return DistributedType.NO
        if comm is not None and comm.shards_parameters:
            return DistributedType.FSDP
        return DistributedType.MULTI_GPU if self.device.type == "cuda" else DistributedType.MULTI_CPU

    @property
    def num_processes(self) -> int:
        return self.world_size

    def wait_for_everyone(self) -> None:
        collectives.barrier(self)

    def split_between_processes(self, inputs: Any, apply_padding: bool = False):
        return collectives.split_between_processes(self, inputs, apply_padding)

    def print(self, *args, **kwargs) -> None:
        if self.is_main_process:
            print(*args, **kwargs)

    @contextlib.contextmanager
    def main_process_first(self):
        """Run the block on the main process first, then on the others."""
        if not self.is_main_process:
            collectives.barrier(self)
        yield
        if self.is_main_process:
            collectives.barrier(self)

    @contextlib.contextmanager
    def local_main_process_first(self):
        """Like :meth:`main_process_first`, per node."""
        if not self.is_local_main_process:
            collectives.barrier(self)
        yield
        if self.is_local_main_process:
            collectives.barrier(self)

    def __repr__(self) -> str:
        return (
            f"Distributed environment: {self.distributed_type.value}  Backend: {self.backend_name}\n"
            f"Process group backend: {self.backend or 'none (one process)'}\n"
            f"Num processes: {self.num_processes}\nProcess index: {self.process_index}\n"
            f"Local process index: {self.local_process_index}\nDevice: {self.device}\n"
            f"Mixed precision type: {self.mixed_precision}\n"
        )


@dataclasses.dataclass(frozen=True, kw_only=True, repr=False)  # keeps PartialState's Accelerate-style repr
class AcceleratorState(PartialState):
    """Accelerate's ``AcceleratorState``: the same view as :class:`PartialState` (which, in
    mixprec, has ``mixed_precision`` too); ``accelerator.state`` is one."""


def _setattr(self: PartialState, name: str, value: Any) -> None:
    # Frozen except the debug flag, which Accelerate scripts toggle. (Assigned after the
    # class is made: a frozen dataclass may not define __setattr__ in its body.)
    if name == "debug":
        object.__setattr__(self, name, bool(value))
        return
    raise dataclasses.FrozenInstanceError(
        f"accelerator.state.{name} cannot be assigned: the state describes the running job "
        f"(give the setting to Accelerator(...) instead)"
    )


PartialState.__setattr__ = _setattr  # type: ignore[method-assign]
AcceleratorState.__setattr__ = _setattr  # type: ignore[method-assign]

"""``accelerator.state``: the process's :class:`~mixprec.distributed.DistributedState` with
the attribute names of Accelerate's ``AcceleratorState``.

It is the DistributedState the collectives take (a subclass of it), so nothing internal
changes; it only adds ``process_index``, ``local_process_index``, ``distributed_type``,
``mixed_precision``, ``is_last_process``, ``use_distributed``, ``debug`` and the process
helpers Accelerate's state has (``wait_for_everyone``, ``split_between_processes``, ``print``).

Unlike Accelerate's, it is not a process-wide singleton: each Accelerator holds its own, so
``AcceleratorState._reset_state()`` has no counterpart (make a new Accelerator instead).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..distributed import collectives
from ..distributed.state import DistributedState
from .options import DistributedType


@dataclasses.dataclass(frozen=True, kw_only=True)
class AcceleratorState(DistributedState):
    """See the module docstring. ``backend_name`` is mixprec's backend (``"ddp"``, ``"zero3"``...),
    what ``print(state)`` shows as ``Backend:``; ``backend`` keeps Accelerate's meaning, the
    process group's backend (``"gloo"``, ``"nccl"``, None on one process), shown as
    ``Process group backend:``."""

    mixed_precision: str = "no"
    backend_name: str = "single"
    # Accelerate's debug flag (checks shapes before collectives there); kept for scripts that
    # set it. mixprec's collectives always check what they can (distributed/collectives.py).
    debug: bool = dataclasses.field(default=False, compare=False)

    @classmethod
    def from_state(cls, state: DistributedState, *, mixed_precision: str, backend_name: str) -> "AcceleratorState":
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
        if self.world_size == 1 and self.backend_name == "single":
            return DistributedType.NO
        if self.backend_name in ("zero3", "fsdp"):
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

    def __repr__(self) -> str:
        return (
            f"Distributed environment: {self.distributed_type.value}  Backend: {self.backend_name}\n"
            f"Process group backend: {self.backend or 'none (one process)'}\n"
            f"Num processes: {self.num_processes}\nProcess index: {self.process_index}\n"
            f"Local process index: {self.local_process_index}\nDevice: {self.device}\n"
            f"Mixed precision type: {self.mixed_precision}\n"
        )


def _setattr(self: AcceleratorState, name: str, value: Any) -> None:
    # Frozen except the debug flag, which Accelerate scripts toggle. (Assigned after the
    # class is made: a frozen dataclass may not define __setattr__ in its body.)
    if name == "debug":
        object.__setattr__(self, name, bool(value))
        return
    raise dataclasses.FrozenInstanceError(
        f"accelerator.state.{name} cannot be assigned: the state describes the running job "
        f"(give the setting to Accelerator(...) instead)"
    )


AcceleratorState.__setattr__ = _setattr  # type: ignore[method-assign]

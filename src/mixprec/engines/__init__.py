"""Backends: one step driver (:class:`~mixprec.engines.base.Engine`) over the precision layer
and a communication object per backend ([Note: engine = precision + communication] in
engines/comm.py). ``ENGINES`` maps each backend name to its :class:`Comm` class, whose
keyword arguments are that backend's ``engine_options``."""

from __future__ import annotations

from ..config.schema import BACKEND_NAMES
from .base import Engine
from .comm import Comm
from .ddp import DDPComm
from .fsdp import FSDPComm
from .single import SingleComm
from .zero import ShardedComm, Zero1Comm, Zero2Comm, Zero3Comm

ENGINES: dict[str, type[Comm]] = {
    "single": SingleComm,
    "ddp": DDPComm,
    "zero1": Zero1Comm,
    "zero2": Zero2Comm,
    "zero3": Zero3Comm,
    "fsdp": FSDPComm,
}


def resolve_backend(backend: str, world_size: int) -> type[Comm]:
    """The Comm class for a ``backend`` name (``"auto"``: ddp when several processes)."""
    if not isinstance(backend, str) or backend not in BACKEND_NAMES:
        raise ValueError(
            f"backend={backend!r} is not supported; valid backends: "
            f"{', '.join(repr(b) for b in BACKEND_NAMES)}"
        )
    if backend == "auto":
        return DDPComm if world_size > 1 else SingleComm
    comm = ENGINES[backend]
    # A distributed backend in one process runs over a one-process group (the Accelerator
    # makes it), so one config serves a laptop and a cluster.
    if not comm.distributed and world_size > 1:
        raise ValueError(
            f"backend={backend!r} runs one process but WORLD_SIZE={world_size}; use "
            "backend='ddp' (or 'auto') for a multi-process run"
        )
    return comm


__all__ = ["BACKEND_NAMES", "Comm", "DDPComm", "ENGINES", "Engine", "FSDPComm", "ShardedComm",
           "SingleComm", "Zero1Comm", "Zero2Comm", "Zero3Comm", "resolve_backend"]

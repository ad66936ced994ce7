"""Backends as objects behind one contract (:class:`~mixprec.engines.base.Engine`)."""

from __future__ import annotations

import os

from .base import Engine
from .ddp import DDPEngine
from .single import SingleEngine
from .zero import Zero1Engine, Zero2Engine, Zero3Engine

ENGINES: dict[str, type[Engine]] = {"single": SingleEngine, "ddp": DDPEngine, "zero1": Zero1Engine, "zero2": Zero2Engine, "zero3": Zero3Engine}
BACKEND_NAMES = ("auto", *ENGINES)


def resolve_backend(backend: str) -> type[Engine]:
    """The engine class for a ``backend`` name (``"auto"`` picks from the environment)."""
    if not isinstance(backend, str) or backend not in BACKEND_NAMES:
        raise ValueError(
            f"backend={backend!r} is not supported; valid backends: "
            f"{', '.join(repr(b) for b in BACKEND_NAMES)}"
        )
    if backend == "auto":
        world = int(os.environ.get("WORLD_SIZE", "1"))
        return DDPEngine if world > 1 else SingleEngine
    return ENGINES[backend]


__all__ = ["BACKEND_NAMES", "DDPEngine", "ENGINES", "Engine", "SingleEngine", "resolve_backend"]

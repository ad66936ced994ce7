"""Backends as objects behind one contract (:class:`~mixprec.engines.base.Engine`)."""

from __future__ import annotations

import os

from .base import Engine
from .single import SingleEngine

ENGINES: dict[str, type[Engine]] = {"single": SingleEngine}
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
        if world > 1:
            raise NotImplementedError(
                f"backend='auto' with WORLD_SIZE={world}: multi-process backends (ddp, zero, "
                "fsdp) are not implemented yet; run a single process"
            )
        return SingleEngine
    return ENGINES[backend]


__all__ = ["BACKEND_NAMES", "ENGINES", "Engine", "SingleEngine", "resolve_backend"]

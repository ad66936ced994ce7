"""The one start-up line the main process prints at the first ``prepare()`` of a model.

Example (two processes on one node, ``backend: auto``)::

    mixprec: backend ddp (auto: WORLD_SIZE=2); world size 2 (1 node x 2 processes); process
    group gloo; mixprec policy: mixed_precision='bf16', compute=bf16, ...; Linear: 1 gradient
    bucket(s) (cap 25 MB, first 1 MB)

(one line when printed). It answers what a newcomer cannot otherwise see: which backend
ran, and how ``auto`` or a config file chose it; how many processes on how many nodes;
the process group's backend (``gloo``/``nccl``, or none on one process); the precision
policy; and how the model was laid out (gradient buckets for ddp/zero1/zero2, sharding
units for zero3/fsdp). ``log_policy: false`` turns it off.
"""

from __future__ import annotations

from torch import nn


def backend_origin(config_backend: str, source: str, world_size: int) -> str:
    """``"auto: WORLD_SIZE=2"`` when ``auto`` chose the backend; else where the name came from."""
    if config_backend == "auto":
        return f"auto: WORLD_SIZE={world_size}" if world_size > 1 else "auto: one process"
    return f"from {source}"


def startup_line(acc, model: nn.Module) -> str:
    """The start-up line for ``acc`` after ``model`` was prepared (see the module docstring)."""
    state = acc.state
    nodes = max(1, state.world_size // max(1, state.local_world_size))
    cfg = acc.config
    origin = backend_origin(cfg.config.backend, cfg.source("backend"), state.world_size)
    parts = [
        f"mixprec: backend {acc.backend} ({origin})",
        f"world size {state.world_size} ({nodes} node{'s' if nodes != 1 else ''} x "
        f"{state.local_world_size} process{'es' if state.local_world_size != 1 else ''})",
        f"process group {state.backend or 'none (one process)'}",
        acc.policy.describe(),
        f"{type(model).__name__}: {acc.engine.comm.describe_layout(model)}",
    ]
    if acc.mesh is not None:
        kind = " x ".join(k for k, n in (("sequence parallel", acc.mesh.sp_size), ("tensor parallel",
                                                                                  acc.mesh.tp_size)) if n > 1)
        parts.insert(2, f"{kind}: {acc.mesh.describe()}")
    return "; ".join(parts)

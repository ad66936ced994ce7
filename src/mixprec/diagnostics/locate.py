"""Find the module of a prepared model in which an exception was raised.

[Note: locating the failing module from the traceback]
Nothing is hooked on the happy path. When forward raises, the exception's traceback still
holds every Python frame between the prepared model's forward and the failing op. The
deepest frame whose ``self`` is a submodule of the prepared model is the module that ran
the op (``nn.Linear.forward`` for ``F.linear``); ``named_modules()`` gives its dotted
path, and that frame's tensor locals are the inputs the op saw. Parameters gathered by a
sharding engine (zero3/fsdp) are still the module's parameters in that frame, and only
their dtypes are read, which sharding never changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Optional

import torch
from torch import nn

_MAX_INPUTS = 8  # tensor locals listed per module


@dataclass
class FailingModule:
    """Where an exception was raised: the module, its path and what its frame held."""

    path: str  # dotted name in the root ("" is the root itself)
    module: nn.Module
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)  # frame locals, not params

    @property
    def display(self) -> str:
        name = self.path if self.path else "<root>"
        return f"{name!r} ({type(self.module).__name__})"


def _tensor_locals(local_vars: dict[str, Any], own: set[int]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}

    def add(name: str, value: Any) -> None:
        if len(out) < _MAX_INPUTS and isinstance(value, torch.Tensor) and id(value) not in own:
            out[name] = value

    for name, value in local_vars.items():
        if name == "self" or name.startswith("__"):
            continue
        if isinstance(value, (tuple, list)):
            for i, item in enumerate(value[:_MAX_INPUTS]):
                add(f"{name}[{i}]", item)
        elif isinstance(value, dict):
            for key, item in list(value.items())[:_MAX_INPUTS]:
                add(f"{name}[{key!r}]", item)
        else:
            add(name, value)
    return out


def failing_module(error: BaseException, root: Optional[nn.Module]) -> Optional[FailingModule]:
    """The deepest submodule of ``root`` (``root`` included) on ``error``'s traceback, or
    None when no frame of the traceback belongs to ``root``."""
    if root is None:
        return None
    names = {id(m): n for n, m in root.named_modules()}
    found: Optional[tuple[str, nn.Module, dict]] = None
    tb: Optional[TracebackType] = error.__traceback__
    while tb is not None:
        local_vars = tb.tb_frame.f_locals
        owner = local_vars.get("self")
        if isinstance(owner, nn.Module) and id(owner) in names:
            found = (names[id(owner)], owner, local_vars)
        tb = tb.tb_next
    if found is None:
        return None
    path, module, local_vars = found
    own = {id(t) for t in module.parameters()} | {id(t) for t in module.buffers()}
    return FailingModule(path, module, _tensor_locals(local_vars, own))

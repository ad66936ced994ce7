"""``accelerate.utils``' module-level collectives (``gather``, ``gather_object``,
``broadcast``, ``broadcast_object_list``, ``reduce``, ``pad_across_processes``), over the
state of this process's live Accelerator (``mixprec.PartialState()``, see [Note: state
objects backed by the live Accelerator] in src/mixprec/compat/state.py), or, with none, the
launcher's process group. Exported by ``mixprec.utils``.

Example::

    from mixprec.utils import gather_object
    names = gather_object([f"rank {accelerator.process_index}"])   # every rank's, in rank order
"""

from __future__ import annotations

from typing import Any

from ..distributed import collectives


def _state():
    from .state import PartialState

    return PartialState()


def gather(tensor: Any) -> Any:
    """Every process's tensors concatenated along the first dimension, in rank order."""
    return collectives.gather(_state(), tensor)


def gather_object(object: Any) -> list:  # noqa: A002 - Accelerate's parameter name
    """Every process's picklable object (a list's items concatenated), in rank order."""
    return collectives.gather_object(_state(), object)


def broadcast(tensor: Any, from_process: int = 0) -> Any:
    """Process ``from_process``'s tensors on every process."""
    return collectives.broadcast(_state(), tensor, src=from_process)


def broadcast_object_list(object_list: list, from_process: int = 0) -> list:
    """``object_list`` overwritten in place with process ``from_process``'s list."""
    return collectives.broadcast_object_list(_state(), object_list, src=from_process)


def reduce(tensor: Any, reduction: str = "mean", scale: float = 1.0) -> Any:
    """Every tensor summed (``"sum"``) or averaged (``"mean"``) over the processes, times ``scale``."""
    out = collectives.reduce(_state(), tensor, reduction)
    if scale != 1.0:
        from ..utils import tree_map_tensors

        out = tree_map_tensors(lambda t: t * scale, out)
    return out


def pad_across_processes(tensor: Any, dim: int = 0, pad_index: Any = 0, pad_first: bool = False) -> Any:
    """Tensors padded along ``dim`` to the largest size any process has."""
    return collectives.pad_across_processes(_state(), tensor, dim=dim, pad_index=pad_index, pad_first=pad_first)

"""This process's Accelerators, for the code below the facade that must find them.

The facade (src/mixprec/accelerator.py) registers every Accelerator here; the modules under
it read the registry instead of importing the facade (imports point down, docs/design.md):
``AcceleratorState()`` / ``PartialState()`` (compat/state.py) and the process index of
``mixprec.utils`` read the newest live one, ``GatheredParameters`` / ``summon_full_params``
(engines/gathered.py) find the engine that prepared a model, and the exit hook ([Note:
shutdown without end_training] in accelerator.py) releases the engines still running and
destroys the process groups Accelerators created. This module imports nothing of mixprec.
"""

from __future__ import annotations

import weakref
from typing import Any

# Accelerators whose engine may hold a process group: the exit hook releases them.
LIVE: "weakref.WeakSet[Any]" = weakref.WeakSet()
# Names of the process groups an Accelerator (or a bare PartialState()) initialised: the exit
# hook destroys the default group when its name is here (a group the caller made is theirs).
CREATED_GROUPS: set[str] = set()
# Weak references to this process's Accelerators, oldest first ([Note: state objects backed
# by the live Accelerator] in compat/state.py).
ACCELERATORS: list = []


def register(accelerator: Any) -> None:
    """Called by each Accelerator once its state exists (newest last)."""
    ACCELERATORS[:] = [r for r in ACCELERATORS if r() is not None]
    ACCELERATORS.append(weakref.ref(accelerator))


def live_accelerator() -> Any:
    """The newest Accelerator of this process that is neither ended nor reset, or None."""
    for ref in reversed(ACCELERATORS):
        acc = ref()
        if acc is not None and not acc.__dict__.get("_ended", True) and not acc.__dict__.get("_state_reset"):
            return acc
    return None


def running() -> list:
    """The Accelerators in :data:`LIVE` that were not ended."""
    return [acc for acc in list(LIVE) if not getattr(acc, "_ended", False)]

"""Detect a collective checkpoint call made on some ranks only, instead of hanging.

[Note: why a store check] ``save_state`` under ``if accelerator.is_main_process:`` is the
classic hang (PAINS row 8): rank 0 enters a collective that the other ranks never reach and
waits for the group timeout (30 minutes). Before any real collective every rank publishes
the call's name under a per-call sequence number in the process group's key-value store
and waits for the others' with a short timeout. A rank that does not arrive in time, or
arrives with another call, makes every rank that is waiting raise an error naming both.
The store needs no collective of its own, so the check itself cannot hang.

Example::

    check = CallCheck(timeout_s=60)
    check(state, "save_state")      # raises CollectiveMismatchError on a lone caller
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

from ..errors import CollectiveMismatchError
from ..distributed.state import DistributedState

__all__ = ["CallCheck", "CollectiveMismatchError"]


# CallChecks made in this process so far. Every rank makes its Accelerators (and so their
# checks) in the same order, so the n-th check of one rank is the n-th of every rank: its
# keys get their own namespace in the store the process group shares. (A per-instance
# sequence alone would make a second Accelerator over the same group read the first one's
# keys: "ranks made different collective calls".)
_INSTANCES = [0]


class CallCheck:
    """Per-Accelerator counter of checked calls (every rank counts the same calls)."""

    def __init__(self, timeout_s: float = 60.0) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r} must be > 0 seconds")
        self.timeout_s = timeout_s  # how long a rank waits for the others to reach the call
        self.sequence = 0  # checked calls so far on this rank
        _INSTANCES[0] += 1
        self.instance = _INSTANCES[0]

    def __call__(self, state: DistributedState, call: str) -> None:
        if state.world_size <= 1:
            return
        self.sequence += 1
        store = dist.distributed_c10d._get_default_store()
        prefix = f"mixprec/collective/{self.instance}/{self.sequence}/"
        store.set(prefix + str(state.rank), call)
        keys = [prefix + str(r) for r in range(state.world_size)]
        try:
            store.wait(keys, datetime.timedelta(seconds=self.timeout_s))
        except Exception:  # noqa: BLE001 - the store raises a timeout of its own type
            missing = [r for r in range(state.world_size) if not store.check([prefix + str(r)])]
            raise CollectiveMismatchError(
                f"{call}() is collective: every rank must call it, but rank(s) {missing} did not "
                f"reach {call}() within {self.timeout_s:g} s (this is rank {state.rank}). Call "
                f"{call}() on every process, not under `if accelerator.is_main_process:`"
            ) from None
        calls = {r: store.get(prefix + str(r)).decode() for r in range(state.world_size)}
        if len(set(calls.values())) > 1:
            raise CollectiveMismatchError(
                f"ranks made different collective calls at the same point: {calls}; every rank "
                f"must call {call}() together"
            )

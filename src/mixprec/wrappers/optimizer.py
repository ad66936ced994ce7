"""The prepared optimizer: the user's optimizer, stepped by the engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import torch

from ..distributed.watchdog import tracked
from ..step import StepResult

if TYPE_CHECKING:
    from ..engines.base import Engine, OptimizerState
    from ..gradient_state import GradientState


class PreparedOptimizer(torch.optim.Optimizer):
    """Wraps a ``torch.optim.Optimizer``; ``step()`` goes through the engine and returns a
    :class:`~mixprec.StepResult`. ``param_groups``, ``state`` and ``state_dict()`` are the
    wrapped optimizer's own (its groups hold the fp32 masters when there are any), so a
    scheduler built on either object drives the same learning rates."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        engine: "Engine",
        state: "OptimizerState",
        gradient_state: "GradientState",
    ) -> None:
        # Deliberately no super().__init__: this object delegates to `optimizer`.
        self.optimizer = optimizer
        self._engine = engine
        self._state = state
        self._gradient_state = gradient_state
        # Extension points used by the Accelerator (e.g. automatic clipping before a real
        # step, overflow-storm diagnosis after one). Called only on real (sync) steps, in order.
        self.pre_step_hooks: list[Callable[["PreparedOptimizer"], None]] = []
        self.post_step_hooks: list[Callable[["PreparedOptimizer", StepResult], None]] = []

    # -- delegation ---------------------------------------------------------
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optimizer.param_groups = value

    @property
    def state(self):
        return self.optimizer.state

    @state.setter
    def state(self, value):
        self.optimizer.state = value

    @property
    def defaults(self):
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value):
        self.optimizer.defaults = value

    def add_param_group(self, param_group: dict) -> None:
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"PreparedOptimizer({self.optimizer!r})"

    def __getstate__(self):
        raise TypeError("a PreparedOptimizer cannot be pickled; save optimizer.state_dict()")

    # -- the step -----------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._gradient_state.sync_gradients:
            self._engine.zero_grad(self._state, set_to_none)

    @tracked("optimizer.step")
    def step(self, closure=None) -> StepResult:
        """Apply one update (or report why none was applied)."""
        if not self._gradient_state.sync_gradients:
            return StepResult(False, "accumulating", None, None)
        for hook in self.pre_step_hooks:
            hook(self)
        result = self._engine.step(self._state, closure)
        for hook in self.post_step_hooks:
            hook(self, result)
        return result

    @property
    def step_was_skipped(self) -> bool:
        """The last real step was skipped (overflow)."""
        last = self._state.last
        return last is not None and not last.stepped

    @property
    def last_step(self) -> Optional[StepResult]:
        return self._state.last

    @property
    def skipped_steps(self) -> int:
        return self._state.skipped

    def step_record(self) -> dict:
        """What a checkpoint keeps of this optimizer's steps: skips so far and the last result."""
        last = self._state.last
        return {"skipped": self._state.skipped, "last": None if last is None else last.as_dict()}

    def load_step_record(self, record: dict) -> None:
        """Restore :meth:`step_record`'s values (``load_state``)."""
        self._state.skipped = record["skipped"]
        self._state.last = None if record["last"] is None else StepResult(**record["last"])

"""The prepared LR scheduler: advances only when its optimizer really stepped."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..gradient_state import GradientState
    from .optimizer import PreparedOptimizer


class PreparedScheduler:
    """Wraps a ``torch.optim.lr_scheduler.LRScheduler`` (or anything with ``step()``).

    ``step()`` does nothing while accumulating or when the last step of any of the
    prepared optimizers was skipped for overflow, so the schedule follows real updates.
    A real step advances the wrapped scheduler ``steps_per_optimizer_step`` times
    (Accelerate's rule: one per batch read, i.e. the data-parallel size, unless batches are
    split, see ``Accelerator(scheduler_step_rule=)``); a scheduler with ``total_steps``
    (OneCycleLR) is not stepped past it.

    [Note: the schedule counts data-parallel batches]
    Accelerate advances a schedule ``num_processes`` times per optimizer step because every
    process read its own batch: a schedule written in one process's batches then ends with
    the epoch. Under tensor or sequence parallelism the ranks of a TP/SP group read the same
    batch (the loader shards over ``mesh.dp_size`` parts, facade/loaders.py
    ``prepare_data_loader``), so the count is ``mesh.dp_size = world // (tp * sp)``
    (``Accelerator.prepare_scheduler``); ``accelerator.num_processes`` stays the process count.
    """

    def __init__(
        self,
        scheduler,
        optimizers: list["PreparedOptimizer"],
        gradient_state: "GradientState",
        step_with_optimizer: bool = True,
        steps_per_optimizer_step: int = 1,
    ) -> None:
        self.steps_per_optimizer_step = steps_per_optimizer_step
        self.scheduler = scheduler
        self.optimizers = optimizers
        self.step_with_optimizer = step_with_optimizer
        self._gradient_state = gradient_state
        self._unseen: deque = deque()  # results advanced over before they were known
        self._owed = 0  # skipped steps found after the schedule advanced over them

    def _skipped_now(self) -> bool:
        """Whether to hold the schedule at this step, without waiting for the device.

        [Note: schedules and lazy results]
        Step results are decided on the device ([Note: lazy step results] in step.py). When
        they are known on the host at once (CPU), a skipped step holds the schedule, exactly.
        On an accelerator the schedule advances as if the step went through, and a step
        found skipped later (its result has arrived by a later scheduler.step()) holds the
        schedule once then: the learning rate is one schedule step ahead for the steps in
        between, only around a skipped step, and no step waits for the device."""
        results = [opt.last_step for opt in self.optimizers]
        if all(r is None or r.immediate() for r in results):
            return any(r is not None and not r.stepped for r in results)
        self._unseen.append(results)
        while self._unseen and all(r is None or r.ready() for r in self._unseen[0]):
            if any(r is not None and not r.stepped for r in self._unseen.popleft()):
                self._owed += 1
        if self._owed:
            self._owed -= 1
            return True
        return False

    def step(self, *args, **kwargs) -> bool:
        """Advance the schedule; returns whether it advanced."""
        if self.step_with_optimizer:
            if not self._gradient_state.sync_gradients:
                return False
            if self._skipped_now():
                return False
        else:
            self.scheduler.step(*args, **kwargs)
            return True
        for _ in range(self.steps_per_optimizer_step):
            total = getattr(self.scheduler, "total_steps", None)
            if total is not None and self.scheduler._step_count > total:
                break
            self.scheduler.step(*args, **kwargs)
        return True

    def get_last_lr(self):
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name):
        # Only reached for attributes not defined here: the scheduler's own (last_epoch...).
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)

"""Where we are in gradient accumulation. One instance per Accelerator (no globals)."""

from __future__ import annotations

from typing import Optional


class GradientState:
    """Accumulation bookkeeping shared by an Accelerator and the objects it prepared."""

    def __init__(self, accumulation_steps: int) -> None:
        self.accumulation_steps = accumulation_steps  # micro-batches per optimizer step
        self.step = 0  # micro-batches seen since the last boundary
        self.sync_gradients = True  # this micro-batch ends an accumulation window
        self.end_of_dataloader = False  # the prepared dataloader just yielded its last batch
        self.active_dataloaders = 0  # prepared dataloaders currently being iterated
        self.remainder: Optional[int] = None  # real samples in the last global batch (sharded)
        self.dataloader_stack: list = []  # prepared dataloaders being iterated, innermost last
        self.sync_each_batch = False  # communicate gradients on every micro-batch (plugin option)

    @property
    def active_dataloader(self):
        """The prepared dataloader being iterated (the innermost one), or None."""
        return self.dataloader_stack[-1] if self.dataloader_stack else None

    @property
    def in_dataloader(self) -> bool:
        return bool(self.dataloader_stack)

    @property
    def plugin_kwargs(self) -> dict:
        """Accelerate's ``GradientAccumulationPlugin.to_kwargs()`` view of the same settings
        (transformers' Trainer reads ``sync_each_batch`` from it)."""
        return {"num_steps": self.accumulation_steps, "sync_each_batch": self.sync_each_batch,
                "adjust_scheduler": True, "sync_with_dataloader": True}

    def _set_sync_gradients(self, sync_gradients: bool) -> None:
        """Accelerate's setter, for loops that decide the accumulation window themselves
        (transformers' Trainer prefetches its micro-batches and marks the last one)."""
        self.sync_gradients = bool(sync_gradients)

    @property
    def num_steps(self) -> int:
        """Accelerate's name for ``accumulation_steps``."""
        return self.accumulation_steps

    def advance(self) -> None:
        """Called on entering ``accumulate()``: decide whether this micro-batch syncs."""
        if self.end_of_dataloader:
            # The last batch of an epoch always closes the window (Accelerate's semantics).
            self.step = 0
            self.sync_gradients = True
            return
        self.step += 1
        self.sync_gradients = self.step % self.accumulation_steps == 0

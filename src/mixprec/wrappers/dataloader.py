"""The prepared dataloader: batches on the training device, end-of-epoch tracking."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..distributed import watchdog
from ..utils import send_to_device

if TYPE_CHECKING:
    from ..gradient_state import GradientState


class PreparedDataLoader:
    """Iterates the wrapped ``DataLoader``, moves each batch to the device, and marks the
    last batch of an epoch so ``accumulate()`` closes the window there."""

    def __init__(
        self,
        dataloader: torch.utils.data.DataLoader,
        device: torch.device,
        gradient_state: "GradientState",
    ) -> None:
        self.dataloader = dataloader
        self.device = device
        self._gradient_state = gradient_state
        self._non_blocking = device.type == "cuda" and bool(getattr(dataloader, "pin_memory", False))

    def __len__(self) -> int:
        return len(self.dataloader)

    def __iter__(self):
        state = self._gradient_state
        state.end_of_dataloader = False
        state.active_dataloaders += 1
        wd = watchdog._ACTIVE[0]  # records how far this pass got ([Note: desync detection])
        if wd is not None:
            wd.loader_start()
        try:
            it = iter(self.dataloader)
            try:
                current = next(it)
            except StopIteration:
                return
            while True:
                try:
                    upcoming = next(it)
                except StopIteration:
                    state.end_of_dataloader = True
                    state.remainder = self._remainder()
                    if wd is not None:
                        wd.batches += 1
                    yield send_to_device(current, self.device, self._non_blocking)
                    if wd is not None:
                        wd.loader_end()
                    return
                if wd is not None:
                    wd.batches += 1
                yield send_to_device(current, self.device, self._non_blocking)
                current = upcoming
        finally:
            # Outside the loop nothing is "the last batch" any more (Accelerate's semantics):
            # gather_for_metrics after the loop keeps everything.
            state.active_dataloaders -= 1
            state.end_of_dataloader = False

    def _remainder(self):
        """Real samples in the last global batch when the loader was sharded (else None)."""
        for obj in (getattr(self.dataloader, "batch_sampler", None), getattr(self.dataloader, "dataset", None)):
            value = getattr(obj, "remainder", None)
            if value is not None:
                return value
        return None

    def set_epoch(self, epoch: int) -> None:
        """Forward to the sampler (and batch sampler) for per-epoch shuffling."""
        for obj in (getattr(self.dataloader, "sampler", None), getattr(self.dataloader, "batch_sampler", None)):
            if obj is not None and hasattr(obj, "set_epoch"):
                obj.set_epoch(epoch)

    def __getattr__(self, name):
        if name == "dataloader":
            raise AttributeError(name)
        return getattr(self.dataloader, name)

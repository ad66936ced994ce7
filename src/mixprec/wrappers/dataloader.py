"""The prepared dataloader: batches on the training device, end-of-epoch tracking."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from ..distributed import watchdog
from ..utils import send_to_device

if TYPE_CHECKING:
    from ..gradient_state import GradientState


class PreparedDataLoader(torch.utils.data.DataLoader):
    """Iterates the wrapped ``DataLoader``, moves each batch to the device, and marks the
    last batch of an epoch so ``accumulate()`` closes the window there.

    It is a ``torch.utils.data.DataLoader`` (``isinstance`` holds, as for Accelerate's
    prepared loaders) that delegates every DataLoader attribute (``dataset``,
    ``batch_size``, ``batch_sampler``, ...) to the wrapped loader; ``DataLoader.__init__`` is
    not run for it, so it builds no iterator state of its own. ``original`` is the loader
    given to ``prepare()`` (before sharding). ``device=None`` leaves batches where they are
    (``device_placement=False``).
    """

    def __init__(
        self,
        dataloader: torch.utils.data.DataLoader,
        device: Optional[torch.device],
        gradient_state: "GradientState",
        *,
        original: Optional[torch.utils.data.DataLoader] = None,
        non_blocking: bool = False,
    ) -> None:
        self.dataloader = dataloader
        self.device = device
        self.original = original if original is not None else dataloader
        self._gradient_state = gradient_state
        self._non_blocking = device is not None and device.type == "cuda" and (
            non_blocking or bool(getattr(dataloader, "pin_memory", False)))

    def __len__(self) -> int:
        return len(self.dataloader)

    def __iter__(self):
        state = self._gradient_state
        state.end_of_dataloader = False
        state.active_dataloaders += 1
        state.dataloader_stack.append(self)
        wd = watchdog._ACTIVE[0]  # records how far this pass got ([Note: desync detection])
        if wd is not None:
            wd.loader_start()
        try:
            it = self._batches()
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
                    yield self._place(current)
                    if wd is not None:
                        wd.loader_end()
                    return
                if wd is not None:
                    wd.batches += 1
                yield self._place(current)
                current = upcoming
        finally:
            # Outside the loop nothing is "the last batch" any more (Accelerate's semantics):
            # gather_for_metrics after the loop keeps everything.
            state.active_dataloaders -= 1
            if self in state.dataloader_stack:
                state.dataloader_stack.remove(self)
            state.end_of_dataloader = False

    def _batches(self):
        """The wrapped loader's batches of one pass (subclasses skip some)."""
        return iter(self.dataloader)

    # Applied to every placed batch (``sequence_parallel.prepare_batches``: this rank's slice).
    batch_transform: Optional[Callable[[Any], Any]] = None

    def _place(self, batch):
        batch = batch if self.device is None else send_to_device(batch, self.device, self._non_blocking)
        return batch if self.batch_transform is None else self.batch_transform(batch)

    def _remainder(self):
        """Real samples in the last global batch when the loader was sharded (else None)."""
        for obj in (getattr(self.dataloader, name, None) for name in ("batch_sampler", "sampler", "dataset")):
            value = getattr(obj, "remainder", None)
            if value is not None:
                return value
        return getattr(self.dataloader, "remainder", None)  # a DispatchedLoader (data/dispatch.py)

    def set_epoch(self, epoch: int) -> None:
        """Forward to the sampler (and batch sampler) for per-epoch shuffling."""
        for obj in (getattr(self.dataloader, "sampler", None), getattr(self.dataloader, "batch_sampler", None)):
            if obj is not None and hasattr(obj, "set_epoch"):
                obj.set_epoch(epoch)

    def __getattr__(self, name):
        if name in ("dataloader", "original", "device", "_gradient_state", "_non_blocking", "parent"):
            raise AttributeError(name)
        return getattr(self.dataloader, name)

    def __setattr__(self, name, value):
        # DataLoader.__setattr__ guards batch_size & co. after its own __init__, which never
        # runs here; plain attributes are what this wrapper needs.
        object.__setattr__(self, name, value)


class SkippingDataLoader(PreparedDataLoader):
    """``Accelerator.skip_first_batches``: each pass over ``loader`` without its first
    ``num_batches`` batches (they are loaded and dropped).

    A pass runs as a pass of ``loader`` itself when it keeps a position
    (``ResumableDataLoader``, every loader ``prepare()`` returns): ``loader`` counts the
    batches (a ``save_state`` inside the pass records where it is), and a position that
    ``load_state`` armed is used, not drawn anew: the pass is the checkpointed pass's order
    after its first ``num_batches`` batches, and ``loader``'s next pass is the next order
    (src/mixprec/checkpoint/dataloader.py)."""

    def __init__(self, loader: PreparedDataLoader, num_batches: int) -> None:
        super().__init__(loader.dataloader, loader.device, loader._gradient_state,
                         original=loader.original, non_blocking=loader._non_blocking)
        self.skip_batches = num_batches
        self.batch_transform = loader.batch_transform
        self.parent = loader

    def __len__(self) -> int:
        return max(0, len(self.dataloader) - self.skip_batches)

    def __iter__(self):
        positioned = getattr(type(self.parent), "_mixprec_pass", None)
        if positioned is None:
            return super().__iter__()
        return positioned(self.parent, self.skip_batches)

    def _batches(self):
        it = iter(self.dataloader)
        for _ in range(self.skip_batches):
            if next(it, _DONE) is _DONE:
                break
        return it


def skip_first_batches(dataloader: PreparedDataLoader, num_batches: int = 0) -> SkippingDataLoader:
    """``accelerate.skip_first_batches`` (also ``Accelerator.skip_first_batches``): the
    prepared ``dataloader`` without the first ``num_batches`` batches of each pass; after
    ``load_state``, the checkpointed pass from batch ``num_batches`` on (see
    :class:`SkippingDataLoader`)."""
    if not isinstance(dataloader, PreparedDataLoader):
        raise TypeError(
            f"skip_first_batches() needs a dataloader returned by accelerator.prepare(), got "
            f"{type(dataloader).__name__}; prepare it first"
        )
    if not isinstance(num_batches, int) or isinstance(num_batches, bool) or num_batches < 0:
        raise ValueError(f"skip_first_batches(num_batches={num_batches!r}) needs an int >= 0")
    if getattr(dataloader, "_mixprec_resume_pending", False) and num_batches:
        # A StatefulDataLoader's loaded state already positions the next pass: skipping
        # again would drop batches (Accelerate: "should not be used" with one).
        raise ValueError(
            f"skip_first_batches(loader, {num_batches}) on a use_stateful_dataloader loader whose state was just "
            f"loaded (load_state / load_state_dict): the next pass already starts after the batches the "
            f"checkpoint consumed, so skipping {num_batches} more would drop them; iterate the loader itself"
        )
    return SkippingDataLoader(dataloader, num_batches)


_DONE = object()

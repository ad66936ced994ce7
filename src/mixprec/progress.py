"""``accelerator.progress(iterable)``: throughput, ETA, loss and skipped steps of a training
loop, shown by the main process, without a host sync per step.

Example::

    for x, y in accelerator.progress(loader, unit="samples"):
        loss = loss_fn(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

With tqdm installed (it is in the ``examples`` and ``test`` extras) this draws a bar over
the batches (ETA from ``total`` or ``len(iterable)``) whose postfix holds the rate across all
ranks, the loss and the skipped steps::

    train:  40%|████      | 20/50 [00:04<00:06, 4.9batch/s, samples/s=627, loss=0.4123, skipped=0]

Without tqdm (or with ``bar=False``, for log files) it prints one line every ``every_s``
seconds, and a last one at the end::

    [mixprec progress] train: 20/50 batches (40%), 627 samples/s, ETA 0:00:06, loss 0.4123, skipped 0

[Note: progress without host syncs]
A progress display that calls ``loss.item()`` every step makes the host wait for the
device at every step (the examples' own tqdm bars did). Nothing here reads a device value:

* samples/tokens come from shapes (``x.shape[0]``, or ``numel`` of the first tensor or of
  ``input_ids`` for tokens, padding included), counted on this rank and multiplied by the
  data-parallel size (the world size without tensor/sequence parallelism, whose peers read
  the same batches): exact for prepared dataloaders, which give every rank batches of one size
  (``even_batches=True``, the default); no collective;
* the loss is a snapshot that ``accelerator.backward`` takes while a tracker runs
  (:class:`~mixprec.step.DeviceScalars`: a clone on the CPU, a non-blocking copy behind an
  event on a GPU); the display shows the newest snapshot whose copy has landed
  (``ready()``), so it may lag a step or two on a GPU and never waits. It is the main
  process's loss, not an average over ranks (that would be a collective per step);
* skipped steps are those the engine has already counted on the host as their lazy step
  results arrived (``[Note: lazy step results]`` in mixprec/step.py), so a skip appears
  once its flag has reached the host.

tests/distributed/test_host_syncs.py runs the sync-counting loop with a tracker on every
backend (no host read), and tests/test_progress.py checks both displays.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Iterable, Iterator, Optional, TextIO

import torch

from .step import DeviceScalars

UNITS = ("samples", "tokens", "batches")


def _first_tensor(batch: Any) -> Optional[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, dict):
        if isinstance(batch.get("input_ids"), torch.Tensor):
            return batch["input_ids"]
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


def batch_size(batch: Any, unit: str) -> int:
    """How many ``unit`` this rank's ``batch`` holds, from shapes only."""
    if unit == "batches":
        return 1
    t = _first_tensor(batch)
    if t is None or t.dim() == 0:
        raise ValueError(f"progress(unit={unit!r}) found no tensor with a batch dimension in a batch of type "
                         f"{type(batch).__name__}; pass unit='batches', or yield tensors (or a dict with "
                         f"'input_ids')")
    return int(t.shape[0]) if unit == "samples" else int(t.numel())


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    """The tracker :meth:`mixprec.Accelerator.progress` returns; iterate it like the
    iterable it wraps. See the module docstring."""

    def __init__(self, accelerator, iterable: Iterable, *, total: Optional[int] = None, unit: str = "samples",
                 desc: str = "train", bar: Optional[bool] = None, every_s: float = 10.0,
                 file: Optional[TextIO] = None) -> None:
        if unit not in UNITS:
            raise ValueError(f"progress(unit={unit!r}) is not one of {UNITS}")
        if not every_s >= 0:
            raise ValueError(f"progress(every_s={every_s!r}) must be >= 0 seconds")
        if total is None and hasattr(iterable, "__len__"):
            total = len(iterable)
        if total is not None and (isinstance(total, bool) or not isinstance(total, int) or total < 0):
            raise ValueError(f"progress(total={total!r}) must be an int >= 0 (batches), or None")
        self.accelerator = accelerator
        self.iterable = iterable
        self.total = total  # batches, or None: no ETA
        self.unit = unit
        self.desc = desc
        self.every_s = float(every_s)
        self.file = file if file is not None else sys.stderr
        self.shown = accelerator.is_main_process  # the other ranks iterate silently
        # The ranks reading distinct batches: TP/SP peers share theirs (parallel/mesh.py), so
        # the data-parallel ranks; tokens of a batch that sequence_parallel.prepare_batches
        # sliced are this rank's 1/sp of them.
        mesh = getattr(accelerator, "mesh", None)
        sliced = unit == "tokens" and getattr(iterable, "batch_transform", None) is not None
        self.world = accelerator.num_processes if mesh is None else mesh.dp_size * (mesh.sp_size if sliced else 1)
        self.batches = 0
        self.items = 0  # this rank's samples/tokens so far
        self._loss: Optional[DeviceScalars] = None  # newest snapshot, see loss_snapshot()
        self._loss_value: Optional[float] = None  # newest snapshot that had landed
        self._t0 = self._last_line = self._rate_t = 0.0
        self._rate_items = 0
        self._rate = 0.0  # items/s across all ranks, over the last second or more
        self._closed = False
        self._tqdm = None
        self.use_tqdm = False
        if self.shown and bar is not False:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                if bar:
                    raise ImportError("progress(bar=True) needs tqdm (pip install tqdm); bar=None falls back "
                                      "to a plain line without it") from None
            else:
                self.use_tqdm = True
                self._tqdm_cls = tqdm

    # -- the accelerator's side ----------------------------------------------------------
    def loss_snapshot(self, loss: torch.Tensor) -> None:
        """Called by ``accelerator.backward``: keep the loss without reading it."""
        if self.shown and isinstance(loss, torch.Tensor) and loss.numel() == 1:
            self._loss = DeviceScalars({"loss": loss.detach()})

    # -- iteration -----------------------------------------------------------------------
    def __len__(self) -> int:
        if self.total is None:
            raise TypeError("this progress tracker has no total (its iterable has no len())")
        return self.total

    def __iter__(self) -> Iterator:
        acc = self.accelerator
        acc._progress = self
        self._t0 = self._last_line = self._rate_t = time.monotonic()
        if self.use_tqdm:
            self._tqdm = self._tqdm_cls(total=self.total, desc=self.desc, unit="batch", file=self.file,
                                        dynamic_ncols=True, mininterval=min(0.5, self.every_s or 0.5))
        try:
            for batch in self.iterable:
                try:
                    yield batch
                finally:  # the step for this batch has run (or the loop broke after it)
                    self.batches += 1
                    self.items += batch_size(batch, self.unit)
                    if self.shown:
                        self._tick()
        finally:
            self.close()

    def close(self) -> None:
        """End the display (a last line or the bar's end); called when the loop ends or
        breaks. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if getattr(self.accelerator, "_progress", None) is self:
            self.accelerator._progress = None
        if not self.shown:
            return
        if self._tqdm is not None:
            self._tqdm.set_postfix(self._postfix(), refresh=False)
            self._tqdm.close()
        else:
            elapsed = time.monotonic() - self._t0
            rate = self.items * self.world / elapsed if elapsed > 0 else 0.0
            print(f"[mixprec progress] {self.desc}: done, {self.batches} batches in {_clock(elapsed)}, "
                  f"{rate:,.0f} {self.unit}/s on average{self._tail(', ')}", file=self.file, flush=True)

    # -- display -------------------------------------------------------------------------
    def _tick(self) -> None:
        now = time.monotonic()
        # The rate over the last window of >= 1 s (the average since the start until then).
        if now - self._rate_t >= 1.0:
            self._rate = (self.items - self._rate_items) * self.world / (now - self._rate_t)
            self._rate_t, self._rate_items = now, self.items
        elif self._rate_items == 0 and now > self._t0:
            self._rate = self.items * self.world / (now - self._t0)
        if self._tqdm is not None:
            self._tqdm.update(1)
            if now - self._last_line >= self._tqdm.mininterval:
                self._tqdm.set_postfix(self._postfix(), refresh=False)
                self._last_line = now
            return
        if now - self._last_line >= self.every_s:
            self._last_line = now
            print(self._line(now), file=self.file, flush=True)

    def _read_loss(self) -> Optional[float]:
        snap = self._loss
        if snap is not None and snap.ready():  # landed: reading it does not wait
            self._loss_value = snap.get("loss")
            self._loss = None
        return self._loss_value

    def skipped_steps(self) -> int:
        """Skipped steps counted so far on the host (no device read; see the module note)."""
        return sum(o._state.logged_skips for o in self.accelerator._optimizers)

    def _postfix(self) -> dict:
        out = {f"{self.unit}/s": f"{self._rate:,.0f}"}
        loss = self._read_loss()
        if loss is not None:
            out["loss"] = f"{loss:.4f}"
        out["skipped"] = self.skipped_steps()
        return out

    def _tail(self, sep: str) -> str:
        loss = self._read_loss()
        parts = ([f"loss {loss:.4f}"] if loss is not None else []) + [f"skipped {self.skipped_steps()}"]
        return sep + ", ".join(parts)

    def _line(self, now: float) -> str:
        if self.total:
            done = f"{self.batches}/{self.total} batches ({100 * self.batches / self.total:.0f}%)"
            per_batch = (now - self._t0) / max(1, self.batches)
            eta = f", ETA {_clock(per_batch * max(0, self.total - self.batches))}"
        else:
            done, eta = f"{self.batches} batches", ""
        return (f"[mixprec progress] {self.desc}: {done}, {self._rate:,.0f} {self.unit}/s{eta}"
                f"{self._tail(', ')}")


__all__ = ["Progress", "UNITS", "batch_size"]

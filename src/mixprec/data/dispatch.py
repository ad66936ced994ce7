"""``dispatch_batches``: rank 0 reads the dataloader, every rank receives its slice.

[Note: dispatching batches]
Accelerate's ``DataLoaderConfiguration(dispatch_batches=True)``, the default for an
``IterableDataset`` (a stream that cannot be indexed, e.g. a streaming Hugging Face
dataset): only rank 0 iterates the user's loader. Without ``split_batches`` it reads
``world_size`` batches per step and concatenates them into one global batch; with it, one
batch. Rank ``r`` gets the ``r``-th of ``world_size`` equal slices, so gathering the ranks'
results restores the global batch's order. A short last global batch of ``n`` samples is
sliced into ``ceil(n / world_size)`` per rank, completed from the first samples of the pass
(``remainder`` = ``n``: ``gather_for_metrics`` drops the completion); with ``drop_last`` it is
dropped; with ``even_batches=False`` it is not completed (a rank may get a shorter last
batch, or none).

Overlap: three threads per pass talk over a process group of their own (Gloo, made once
per Accelerator at ``prepare()``), so they never interleave with the training loop's
collectives. On rank 0 a *reader* reads and slices step ``k+1`` while a *sender* scatters
step ``k`` (``scatter_object_list``: each rank receives its slice only, not the whole
batch); on every rank a *receiver* queues what arrives, up to ``prefetch`` steps ahead, so
a rank's loop waits for rank 0's reading only when that reading is slower than its own
step. A loop that stops early (``break``) stops the pass: rank 0 sends "stop" at the next
step, receivers drop what still arrives. An exception while rank 0 reads is re-raised there
and sent to the others, which raise a RuntimeError naming it (instead of waiting forever).
"""

from __future__ import annotations

import math
import queue
import threading
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

_END, _STOP, _ERROR, _BATCH = "end", "stop", "error", "batch"


def batch_length(batch: Any) -> Optional[int]:
    """Samples in a collated batch (the first dimension of its first tensor or list)."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else None
    if isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields") and batch and not any(
            isinstance(x, (torch.Tensor, list, tuple, dict)) for x in batch):
        return len(batch)  # a collated list of strings / numbers
    if isinstance(batch, dict):
        values = batch.values()
    elif isinstance(batch, (list, tuple)):
        values = batch
    else:
        return None
    for v in values:
        n = batch_length(v)
        if n is not None:
            return n
    return None


def _same_mapping(like: dict, items: dict) -> dict:
    """``items`` in ``like``'s mapping class (e.g. a tokenizer's BatchEncoding), else a dict."""
    try:
        return type(like)(items)
    except TypeError:
        return items


def slice_batch(batch: Any, lo: int, hi: int) -> Any:
    """Samples ``[lo, hi)`` of a collated batch (tensors and per-sample lists are sliced, other
    leaves kept)."""
    if isinstance(batch, torch.Tensor):
        return batch[lo:hi] if batch.dim() else batch
    if isinstance(batch, dict):
        return _same_mapping(batch, {k: slice_batch(v, lo, hi) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(slice_batch(v, lo, hi) for v in batch))
    if isinstance(batch, (list, tuple)):
        if batch and not any(isinstance(x, (torch.Tensor, list, tuple, dict)) for x in batch):
            return type(batch)(batch[lo:hi])
        return type(batch)(slice_batch(v, lo, hi) for v in batch)
    return batch


def concat_batches(batches: list) -> Any:
    """The collated batches as one (tensors concatenated on dim 0, per-sample lists joined)."""
    first = batches[0]
    if len(batches) == 1:
        return first
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            return first
        try:
            return torch.cat(batches, dim=0)
        except RuntimeError as e:
            raise RuntimeError(
                f"dispatch_batches: cannot concatenate batches of shapes {[tuple(b.shape) for b in batches]} into "
                f"one global batch ({e}); give batches of one shape past dim 0, use split_batches=True (rank 0 "
                f"reads one batch and splits it), or dispatch_batches=False (each rank reads its own)"
            ) from None
    if isinstance(first, dict):
        return _same_mapping(first, {k: concat_batches([b[k] for b in batches]) for k in first})
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(concat_batches(list(parts)) for parts in zip(*batches)))
    if isinstance(first, (list, tuple)):
        if first and not any(isinstance(x, (torch.Tensor, list, tuple, dict)) for x in first):
            return type(first)(x for b in batches for x in b)
        return type(first)(concat_batches(list(parts)) for parts in zip(*batches))
    return first


class DispatchedLoader:
    """This rank's batches of ``loader`` read on rank 0 ([Note: dispatching batches]).

    Attributes as a sharded loader has them: ``dataset`` (the user's), ``batch_size`` (per
    rank), ``total_batch_size``, ``remainder`` (real samples in the last global step, once the
    pass reached it), ``drop_last``.
    """

    def __init__(self, loader: Any, *, rank: int, world_size: int, group: Any, split_batches: bool,
                 even_batches: bool, prefetch: int = 2, slice_fn: Optional[Callable] = None) -> None:
        self.loader = loader
        # Accelerate's slice_fn_for_dispatch: fn(batch, slice(lo, hi), process_index=, num_processes=).
        self.slice_fn = slice_fn
        self.rank, self.world_size, self.group = rank, world_size, group
        self.split_batches, self.even_batches = split_batches, even_batches
        self.prefetch = max(0, int(prefetch))  # 0: no overlap (a baseline)
        self.dataset = loader.dataset
        self.drop_last = bool(getattr(loader, "drop_last", False))
        b = loader.batch_size
        if split_batches and b is not None and b % world_size:
            raise ValueError(
                f"split_batches=True with dispatch_batches splits each batch of batch_size={b} over {world_size} "
                f"processes, but {b} is not divisible by {world_size}; use a multiple of {world_size}"
            )
        self.batch_size = None if b is None else (b // world_size if split_batches else b)
        self.total_batch_size = None if b is None else (b if split_batches else b * world_size)
        self.remainder: Optional[int] = None
        self.batch_sampler = None
        self.sampler = None
        self._threads: list[threading.Thread] = []
        # use_stateful_dataloader: ``loader`` is torchdata's StatefulDataLoader (read on rank 0);
        # its state after the step last handed out is what state_dict() gives.
        self.stateful = callable(getattr(loader, "state_dict", None))
        self._snapshot: Any = None
        self._handed: Any = None
        self.events: Optional[list] = None  # ("read", k) / ("consumed", k) on rank 0 when set to a list

    def state_dict(self) -> Optional[dict]:
        """Rank 0: the inner loader's state after the last step handed out (the next pass
        continues after it); other ranks: None (they read nothing)."""
        if self.rank != 0 or not self.stateful:
            return None
        return self._handed if self._handed is not None else self.loader.state_dict()

    def load_state_dict(self, state: Optional[dict]) -> None:
        if self.rank == 0 and self.stateful and state is not None:
            self.loader.load_state_dict(state)
        self._handed = None

    def __len__(self) -> int:
        n = len(self.loader)
        if self.split_batches:
            return n
        return n // self.world_size if self.drop_last else math.ceil(n / self.world_size)

    def set_epoch(self, epoch: int) -> None:
        for obj in (getattr(self.loader, "sampler", None), getattr(self.loader, "batch_sampler", None),
                    self.dataset):
            if obj is not None and hasattr(obj, "set_epoch"):
                obj.set_epoch(epoch)

    # ------------------------------------------------------------ rank 0
    def _global_steps(self):
        """Rank 0: (global batch, real samples) per step, the last one completed or dropped."""
        W, per = self.world_size, 1 if self.split_batches else self.world_size
        it = iter(self.loader)
        first = None
        while True:
            parts = []
            for _ in range(per):
                try:
                    parts.append(next(it))
                except StopIteration:
                    break
            if not parts:
                return
            batch = concat_batches(parts)
            self._snapshot = self.loader.state_dict() if self.stateful else None  # after this step
            if first is None:
                first = batch
            n = batch_length(batch)
            full = self.total_batch_size if self.total_batch_size is not None else n
            if n is None:
                raise TypeError(
                    f"dispatch_batches: cannot tell how many samples a batch of {type(batch).__name__} holds; "
                    f"collate to tensors, dicts or lists of samples, or use dispatch_batches=False"
                )
            if len(parts) < per or n < full:  # the last global step
                if self.drop_last:
                    return
                yield batch, n, first
                return
            yield batch, n, first

    def _pieces(self, batch: Any, n: int, first: Any) -> list:
        W = self.world_size
        p = math.ceil(n / W)
        if n % W and self.even_batches:
            need = p * W - n
            fill = [first]
            while batch_length(concat_batches(fill)) < need:
                fill.append(first)
            batch = concat_batches([batch, slice_batch(concat_batches(fill), 0, need)])
        end = n if not self.even_batches else p * W
        if self.slice_fn is not None:
            return [self.slice_fn(batch, slice(r * p, min((r + 1) * p, end)), process_index=r, num_processes=W)
                    for r in range(W)]
        return [slice_batch(batch, r * p, min((r + 1) * p, end)) for r in range(W)]

    def _put(self, q: "queue.Queue", item: Any, stop: threading.Event) -> None:
        """Queue ``item`` unless the pass was stopped (then nobody reads the queue)."""
        while not stop.is_set():
            try:
                q.put(item, timeout=0.05)
                return
            except queue.Full:
                pass

    def _reader(self, out: "queue.Queue", stop: threading.Event) -> None:
        k = 0
        try:
            for batch, n, first in self._global_steps():
                pieces = self._pieces(batch, n, first)
                if self.events is not None:
                    self.events.append(("read", k))
                if stop.is_set():
                    break
                out.put((_BATCH, pieces, n, self._snapshot))  # the sender always reads on (it drains after a stop)
                k += 1
            out.put((_END, None, None, None))
        except BaseException as e:  # noqa: BLE001 - sent to every rank, re-raised on this one
            out.put((_ERROR, e, None, None))

    def _sender(self, steps: "queue.Queue", mine: "queue.Queue", stop: threading.Event) -> None:
        while True:
            kind, payload, n, snapshot = steps.get()
            if kind == _BATCH and stop.is_set():
                kind, payload = _STOP, None
            if kind == _BATCH:
                send = [(_BATCH, piece, n) for piece in payload]
            elif kind == _ERROR:
                send = [(_ERROR, f"{type(payload).__name__}: {payload}", None)] * self.world_size
            else:
                send = [(kind, None, None)] * self.world_size
            got = [None]
            dist.scatter_object_list(got, send, src=0, group=self.group)
            self._put(mine, payload if kind == _ERROR else (*got[0], snapshot), stop)
            if kind != _BATCH:
                while kind == _STOP and steps.get()[0] == _BATCH:
                    pass  # the reader stops after its current read
                return

    def _receiver(self, mine: "queue.Queue", stop: threading.Event) -> None:
        while True:
            got = [None]
            dist.scatter_object_list(got, None, src=0, group=self.group)
            self._put(mine, (*got[0], None), stop)
            if got[0][0] != _BATCH:
                return

    def _synchronous(self):
        """``prefetch=0``: read, send and receive in the loop's own thread, step by step (no
        overlap; benchmarks/bench_dispatch.py's baseline)."""
        steps = self._global_steps() if self.rank == 0 else None
        while True:
            if self.rank == 0:
                try:
                    batch, n, first = next(steps)
                    send = [(_BATCH, piece, n) for piece in self._pieces(batch, n, first)]
                    self._handed = self._snapshot
                except StopIteration:
                    send = [(_END, None, None)] * self.world_size
                except BaseException as e:  # noqa: BLE001 - the others must not wait forever
                    send = [(_ERROR, f"{type(e).__name__}: {e}", None)] * self.world_size
                    dist.scatter_object_list([None], send, src=0, group=self.group)
                    raise
            got = [None]
            dist.scatter_object_list(got, send if self.rank == 0 else None, src=0, group=self.group)
            kind, piece, n = got[0]
            if kind == _ERROR:
                raise RuntimeError(f"dispatch_batches: rank 0 failed reading the dataloader: {piece}")
            if kind != _BATCH:
                return
            self.remainder = n
            if batch_length(piece):
                yield piece

    def __iter__(self):
        if self.prefetch == 0:
            yield from self._synchronous()
            return
        for t in self._threads:  # an earlier pass that stopped early ends with rank 0's next step
            t.join()
        stop = threading.Event()
        self.remainder = None
        mine: "queue.Queue" = queue.Queue(maxsize=self.prefetch)
        if self.rank == 0:
            steps: "queue.Queue" = queue.Queue(maxsize=self.prefetch)
            self._threads = [
                threading.Thread(target=self._reader, args=(steps, stop), daemon=True, name="mixprec-dispatch-read"),
                threading.Thread(target=self._sender, args=(steps, mine, stop), daemon=True,
                                 name="mixprec-dispatch-send")]
        else:
            self._threads = [threading.Thread(target=self._receiver, args=(mine, stop), daemon=True,
                                              name="mixprec-dispatch-recv")]
        for t in self._threads:
            t.start()
        k = 0
        try:
            while True:
                item = mine.get()
                if isinstance(item, BaseException):  # rank 0's own reading error
                    raise item
                kind, piece, n, snapshot = item
                if kind == _ERROR:
                    raise RuntimeError(f"dispatch_batches: rank 0 failed reading the dataloader: {piece}")
                if kind != _BATCH:
                    self._handed = None
                    return
                self.remainder = n
                self._handed = snapshot
                if batch_length(piece) == 0:
                    continue  # even_batches=False: nothing of the last step for this rank
                yield piece
                if self.events is not None:
                    self.events.append(("consumed", k))
                k += 1
        finally:
            stop.set()  # threads drop what still arrives; the next pass joins them

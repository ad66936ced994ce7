"""Give each process its share of a DataLoader's batches (Accelerate's sharding semantics).

Example::

    state = init_distributed(torch.device("cpu"))
    loader = shard_dataloader(DataLoader(ds, batch_size=8, shuffle=True), state, seed=0)
    for epoch in range(3):
        loader.batch_sampler.set_epoch(epoch)   # same new permutation on every rank
        for step, (x, y) in enumerate(loader):
            ...
            last = step == len(loader) - 1
            preds = gather_for_metrics(state, model(x), loader.batch_sampler.remainder if last else None)

Global batch ``k`` is samples ``[k*G, (k+1)*G)`` of the epoch's order, where ``G`` is
``batch_size * world_size`` (``split_batches=False``: each rank keeps the loader's batch
size) or ``batch_size`` (``split_batches=True``: each global batch is split, so the batch
size must divide by the world size); rank ``r`` gets the ``r``-th slice of it. Gathering
rank results therefore restores the epoch's order. With ``even_batches=True`` (and no
``drop_last``) the last global batch is completed by wrapping around to the start of the
epoch so every rank gets the same number of equally sized batches;
``sampler.remainder`` is how many of its samples are real.
"""

from __future__ import annotations

import math
from typing import Any, Iterator, Optional

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler

from ..distributed.collectives import broadcast_object_list
from ..distributed.state import DistributedState

# DataLoader settings a sharded loader keeps (batching ones are replaced by the sampler).
_KEPT = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)


class ShardedBatchSampler(torch.utils.data.Sampler):
    """Yields this rank's index batches; see the module docstring for the layout.

    Attributes: ``total_dataset_length`` (samples in the dataset), ``total_batch_size``
    (samples in a global batch), ``batch_size`` (per rank), ``remainder`` (real samples in
    the last global batch), ``epoch``.
    """

    def __init__(
        self,
        sampler: Any,
        *,
        dataset_length: int,
        rank: int,
        world_size: int,
        batch_size: int,
        total_batch_size: int,
        drop_last: bool,
        even_batches: bool,
        shuffle_seed: Optional[int],
    ) -> None:
        self.sampler = sampler
        self.total_dataset_length = dataset_length
        self.rank = rank
        self.world_size = world_size
        self.batch_size = batch_size
        self.total_batch_size = total_batch_size
        self.drop_last = drop_last
        self.even_batches = even_batches
        self.shuffle_seed = shuffle_seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch's shuffle (identical on every rank); forwarded to the inner sampler."""
        self.epoch = epoch
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def _order(self) -> list[int]:
        if self.shuffle_seed is not None:
            g = torch.Generator().manual_seed(self.shuffle_seed + self.epoch)
            return torch.randperm(self.total_dataset_length, generator=g).tolist()
        return [int(i) for i in self.sampler]

    @property
    def num_global_batches(self) -> int:
        n, g = self.total_dataset_length, self.total_batch_size
        return n // g if self.drop_last else math.ceil(n / g)

    @property
    def remainder(self) -> int:
        """Real (non-duplicated) samples in the last global batch (0 for an empty loader)."""
        steps = self.num_global_batches
        if steps == 0:
            return 0
        return self.total_batch_size if self.drop_last else self.total_dataset_length - (steps - 1) * self.total_batch_size

    def __len__(self) -> int:
        steps = self.num_global_batches
        if self.drop_last or self.even_batches or steps == 0:
            return steps
        # Uneven: the last global batch may not reach this rank.
        start = (steps - 1) * self.total_batch_size + self.rank * self.batch_size
        return steps if start < self.total_dataset_length else steps - 1

    def __iter__(self) -> Iterator[list[int]]:
        order = self._order()
        n, g, b = len(order), self.total_batch_size, self.batch_size
        for step in range(self.num_global_batches):
            lo = step * g + self.rank * b
            batch = order[lo : lo + b]
            if len(batch) < b and not self.drop_last:
                if not self.even_batches:
                    if batch:
                        yield batch
                    return
                # Complete the last global batch by wrapping around to the epoch's start.
                need = b - len(batch)
                wrap_start = max(0, lo - n)
                batch = batch + [order[(wrap_start + i) % n] for i in range(need)]
            yield batch


class IterableDatasetShard(IterableDataset):
    """This rank's slice of each global batch of an iterable dataset.

    Items are buffered ``total_batch_size`` at a time and rank ``r`` keeps items
    ``[r*batch_size, (r+1)*batch_size)`` of each buffer. A last partial buffer is dropped
    with ``drop_last`` and otherwise completed with the first items of the stream.
    """

    def __init__(self, dataset: Any, *, rank: int, world_size: int, batch_size: int, total_batch_size: int, drop_last: bool) -> None:
        self.dataset = dataset
        self.rank = rank
        self.world_size = world_size
        self.batch_size = batch_size
        self.total_batch_size = total_batch_size
        self.drop_last = drop_last
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    @property
    def remainder(self) -> Optional[int]:
        """Real samples in the last global batch, when the dataset has a length (else None)."""
        try:
            n = len(self.dataset)
        except TypeError:
            return None
        if n == 0:
            return 0
        if self.drop_last:
            return self.total_batch_size
        return n - (math.ceil(n / self.total_batch_size) - 1) * self.total_batch_size

    def __iter__(self):
        first: list = []
        buffer: list = []
        lo, hi = self.rank * self.batch_size, (self.rank + 1) * self.batch_size
        for item in self.dataset:
            buffer.append(item)
            if len(first) < self.total_batch_size:
                first.append(item)
            if len(buffer) == self.total_batch_size:
                yield from buffer[lo:hi]
                buffer = []
        if buffer and not self.drop_last:
            i = 0
            while len(buffer) < self.total_batch_size:
                buffer.append(first[i % len(first)])
                i += 1
            yield from buffer[lo:hi]


def shard_dataloader(
    dataloader: DataLoader,
    state: DistributedState,
    *,
    split_batches: bool = False,
    even_batches: bool = True,
    seed: Optional[int] = None,
) -> DataLoader:
    """A new DataLoader over the same dataset that yields this rank's share of the batches.

    Keeps ``collate_fn``, ``num_workers``, ``pin_memory``, ``drop_last`` and the other
    settings. For a map-style dataset the returned loader's ``batch_sampler`` is a
    :class:`ShardedBatchSampler` (``set_epoch``, ``remainder``, ``total_dataset_length``);
    for an iterable dataset its ``dataset`` is an :class:`IterableDatasetShard`.

    When the original loader shuffles (a ``RandomSampler``), every rank draws the same
    permutation from ``seed + epoch``; with ``seed=None`` rank 0 draws a seed from torch's
    RNG and broadcasts it (a collective: call this on every rank). Other samplers must give
    the same order on every rank.

    Example::

        loader = shard_dataloader(DataLoader(ds, batch_size=16, shuffle=True), state, seed=42)
    """
    if not isinstance(dataloader, DataLoader):
        raise TypeError(
            f"shard_dataloader() needs a torch.utils.data.DataLoader, got {type(dataloader).__name__}; "
            f"wrap your dataset: DataLoader(dataset, batch_size=...)"
        )
    world, rank = state.world_size, state.rank
    batch_size = dataloader.batch_size
    if batch_size is None:
        raise ValueError(
            f"shard_dataloader() got a DataLoader with a custom batch_sampler "
            f"({type(dataloader.batch_sampler).__name__}) and batch_size=None; sharding needs a fixed "
            f"batch size: build the DataLoader with batch_size= (and sampler= for a custom order)"
        )
    if split_batches:
        if batch_size % world:
            raise ValueError(
                f"split_batches=True splits each batch of batch_size={batch_size} over {world} processes, "
                f"but {batch_size} is not divisible by {world}; use a batch size that is a multiple of "
                f"{world} or split_batches=False"
            )
        per_rank, total = batch_size // world, batch_size
    else:
        per_rank, total = batch_size, batch_size * world
    kept = {k: getattr(dataloader, k) for k in _KEPT if hasattr(dataloader, k)}
    if dataloader.num_workers > 0:
        kept["prefetch_factor"] = dataloader.prefetch_factor
    else:
        kept.pop("persistent_workers", None)
    drop_last = dataloader.drop_last

    if isinstance(dataloader.dataset, IterableDataset):
        shard = IterableDatasetShard(
            dataloader.dataset, rank=rank, world_size=world, batch_size=per_rank, total_batch_size=total, drop_last=drop_last
        )
        return DataLoader(shard, batch_size=per_rank, drop_last=drop_last, **kept)

    sampler = dataloader.sampler
    shuffle_seed = None
    if isinstance(sampler, RandomSampler):
        if sampler.replacement or sampler._num_samples is not None:
            raise ValueError(
                f"shard_dataloader() cannot shard a RandomSampler with replacement={sampler.replacement} / "
                f"num_samples={sampler._num_samples}; use shuffle=True without them"
            )
        if seed is None:
            seed = int(torch.randint(0, 2**31 - 1, ()).item())
            seed = broadcast_object_list(state, [seed], src=0)[0]
        shuffle_seed = seed
    elif seed is not None:
        raise ValueError(
            f"seed={seed!r} only applies to shuffling loaders (RandomSampler), but this loader uses "
            f"{type(sampler).__name__}; drop seed= or build the DataLoader with shuffle=True"
        )
    if not isinstance(dataloader.batch_sampler, BatchSampler) or type(dataloader.batch_sampler) is not BatchSampler:
        raise ValueError(
            f"shard_dataloader() cannot shard the custom batch sampler {type(dataloader.batch_sampler).__name__}; "
            f"build the DataLoader with batch_size= (and sampler= for a custom order)"
        )
    length = len(sampler) if shuffle_seed is None else len(dataloader.dataset)
    batch_sampler = ShardedBatchSampler(
        sampler,
        dataset_length=length,
        rank=rank,
        world_size=world,
        batch_size=per_rank,
        total_batch_size=total,
        drop_last=drop_last,
        even_batches=even_batches,
        shuffle_seed=shuffle_seed,
    )
    return DataLoader(dataloader.dataset, batch_sampler=batch_sampler, **kept)

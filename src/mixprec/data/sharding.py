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
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

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


class _ResumablePass:
    """torchdata's Stateful protocol for the sharded samplers (``use_stateful_dataloader``):
    ``state_dict()`` holds the current pass's order and how many batches this rank's
    iterator gave out; after ``load_state_dict()`` the next pass is that order, from the next
    batch, without drawing (or communicating) anything and without loading the skipped
    batches. The order is kept whole (a list of indices), so the state grows with the
    dataset: about 8 bytes per sample pickled."""

    _resume: Optional[dict] = None
    _pass: Any = None  # the current pass's order (None between passes)
    _yielded = 0  # batches this rank's iterator gave out in the current pass

    def state_dict(self) -> dict:
        return {"epoch": getattr(self, "epoch", None), "pass": self._pass, "yielded": self._yielded,
                "remainder": getattr(self, "remainder", None)}

    def load_state_dict(self, state: dict) -> None:
        if state.get("epoch") is not None:
            self.epoch = state["epoch"]
        self._resume = state if state.get("pass") is not None else None
        self._pass, self._yielded = None, 0

    def _start_pass(self, draw):
        """(order, batches to skip) of a new pass: the resumed one, or a new draw."""
        resume, self._resume = self._resume, None
        if resume is not None:
            if resume.get("remainder") is not None and isinstance(self, ShardedBatches):
                self.remainder = resume["remainder"]  # (ShardedBatchSampler computes its own)
            self._pass, self._yielded = resume["pass"], 0
            return resume["pass"], resume["yielded"]
        self._pass, self._yielded = draw(), 0
        return self._pass, 0

    def _give(self, batches, skip: int):
        """Yield ``batches`` after the first ``skip``, counting what was given out."""
        produced = 0
        for batch in batches:
            produced += 1
            if produced <= skip:
                continue
            self._yielded = produced
            yield batch
        self._pass, self._yielded = None, 0


class ShardedBatchSampler(_ResumablePass, torch.utils.data.Sampler):
    """Yields this rank's index batches; see the module docstring for the layout.

    Attributes: ``total_dataset_length`` (samples in the dataset), ``total_batch_size``
    (samples in a global batch), ``batch_size`` (per rank), ``remainder`` (real samples in
    the last global batch), ``epoch``.

    The epoch's order comes either from ``shuffle_seed + epoch`` (a seeded shuffle: the
    epoch advances after every complete pass, or is chosen by ``set_epoch``) or from
    iterating ``sampler`` itself; then, with ``sync``, every rank takes rank 0's order (its
    generators get rank 0's state, or rank 0 draws the order and sends it: [Note: one pass
    order on every rank]), and successive passes draw new ones, as a single process
    iterating the original loader would.
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
        sync: Optional[DistributedState] = None,
    ) -> None:
        self.sampler = sampler
        self.sync = sync  # broadcast the sampler's generator state from rank 0 at each pass
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
        return agreed_pass(self.sync, self.sampler, lambda: [int(i) for i in self.sampler])

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
        order, skip = self._start_pass(self._order)
        yield from self._give(self._batches_of(order), skip)
        if self.shuffle_seed is not None:
            # A complete pass moves to the next epoch's order (Accelerate's seedable sampler);
            # set_epoch() still chooses one explicitly.
            self.epoch += 1

    def _batches_of(self, order: list[int]) -> Iterator[list[int]]:
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


def find_generators(obj: Any) -> list[torch.Generator]:
    """The torch Generators a sampler (or batch sampler) draws from: its own ``generator``
    and those of the samplers it wraps (``sampler``, ``batch_sampler``)."""
    found: list[torch.Generator] = []
    seen: set[int] = set()
    stack = [obj]
    while stack:
        o = stack.pop()
        if o is None or id(o) in seen:
            continue
        seen.add(id(o))
        g = getattr(o, "generator", None)
        if isinstance(g, torch.Generator) and all(g is not x for x in found):
            found.append(g)
        stack.extend(getattr(o, name, None) for name in ("sampler", "batch_sampler"))
    return found


# [Note: one pass order on every rank]
# Sharding is only exact (each sample once per epoch across processes) when every rank
# shards the *same* pass. A sampler whose whole randomness sits in torch Generators that
# can be found (a torch Random/WeightedRandom/SubsetRandomSampler with ``generator=``, a
# BatchSampler over one) is made to agree by giving those generators rank 0's state: each
# rank then draws rank 0's order itself. Anything else (such a sampler *without* a
# generator, which draws from each rank's own torch RNG; a custom sampler or batch sampler
# of unknown make) is drawn on rank 0 only and its pass (the index list, or the list of
# index batches) is broadcast: one object broadcast per pass, exact whatever the sampler
# does. Plain lists, ranges and SequentialSamplers are the same on every rank already.
_GENERATOR_SAMPLERS = (RandomSampler, WeightedRandomSampler, SubsetRandomSampler)


def draws_only_from_generators(obj: Any) -> bool:
    """Whether iterating ``obj`` (a sampler or batch sampler) is decided by fixed data and
    findable torch Generators alone, so synchronising those generators suffices."""
    if isinstance(obj, (list, tuple, range)):
        return True
    kind = type(obj)
    if kind is BatchSampler:
        return draws_only_from_generators(obj.sampler)
    if kind is SequentialSampler:
        return True
    if kind in _GENERATOR_SAMPLERS:
        return isinstance(obj.generator, torch.Generator)
    return False


def agreed_pass(state: Optional[DistributedState], sampler: Any, draw: Any) -> Any:
    """``draw()`` (one pass over ``sampler``), the same on every rank of ``state`` (None: no
    agreement needed). A collective. See [Note: one pass order on every rank]."""
    if state is None or state.world_size == 1:
        return draw()
    if draws_only_from_generators(sampler):
        sync_generators(state, sampler)
        return draw()
    return broadcast_object_list(state, [draw() if state.rank == 0 else None], src=0)[0]


def sync_generators(state: DistributedState, sampler: Any) -> None:
    """Give every generator ``sampler`` draws from rank 0's state (a collective)."""
    generators = find_generators(sampler)
    if not generators or state.world_size == 1:
        return
    states = broadcast_object_list(state, [[g.get_state() for g in generators]], src=0)[0]
    for g, st in zip(generators, states):
        g.set_state(st)


class ShardedBatches(_ResumablePass, torch.utils.data.Sampler):
    """This rank's share of the batches of any batch sampler (a custom ``batch_sampler``, or
    a ``BatchSampler`` given as ``sampler`` with ``batch_size=None``).

    Without ``split_batches`` global step ``k`` is batches ``[k*W, (k+1)*W)`` and rank ``r``
    gets batch ``k*W + r``; with it, each batch is split in ``W`` equal parts. With
    ``even_batches`` a short last batch is completed, and missing last batches are made,
    from the first indices of the pass, so every rank gets the same number of batches of
    ``batch_size``; ``remainder`` is how many samples of the last global step are real.
    Every rank shards the same pass ([Note: one pass order on every rank]): the torch
    Generators the batch sampler draws from get rank 0's state at the start of each pass,
    or, when its randomness cannot be found that way, rank 0 draws the pass and sends it.
    """

    def __init__(self, batch_sampler: Any, *, rank: int, world_size: int, split_batches: bool,
                 even_batches: bool, sync: Optional[DistributedState]) -> None:
        self.batch_sampler = batch_sampler
        self.rank = rank
        self.world_size = world_size
        self.split_batches = split_batches
        self.even_batches = even_batches
        self.sync = sync
        self.batch_size = getattr(batch_sampler, "batch_size", None)
        self.drop_last = bool(getattr(batch_sampler, "drop_last", False))
        self.remainder: Optional[int] = None
        if split_batches and self.batch_size is not None and self.batch_size % world_size:
            raise ValueError(
                f"split_batches=True splits each batch of batch_size={self.batch_size} over {world_size} "
                f"processes, but {self.batch_size} is not divisible by {world_size}; use a batch size that "
                f"is a multiple of {world_size} or split_batches=False"
            )

    def set_epoch(self, epoch: int) -> None:
        for obj in (self.batch_sampler, getattr(self.batch_sampler, "sampler", None)):
            if hasattr(obj, "set_epoch"):
                obj.set_epoch(epoch)

    def __len__(self) -> int:
        n = len(self.batch_sampler)
        if self.split_batches:
            return n
        if self.drop_last:
            return n // self.world_size
        if self.even_batches:
            return math.ceil(n / self.world_size)
        return n // self.world_size + (1 if self.rank < n % self.world_size else 0)

    def _global_steps(self) -> list[list[list[int]]]:
        """The pass as global steps, each a list of ``world_size`` index lists."""
        batches = agreed_pass(self.sync, self.batch_sampler,
                              lambda: [[int(i) for i in b] for b in self.batch_sampler])
        size = self.batch_size or max((len(b) for b in batches), default=0)
        flat = [i for b in batches for i in b]

        def filler():
            while True:
                yield from flat

        wrap = filler()
        W = self.world_size
        steps: list[list[list[int]]] = []
        if self.split_batches:
            for b in batches:
                real = len(b)
                if len(b) < size and self.even_batches and flat:
                    b = b + [next(wrap) for _ in range(size - len(b))]
                if len(b) % W:
                    raise ValueError(
                        f"split_batches=True cannot split a batch of {len(b)} samples over {W} processes; "
                        f"give batches whose size divides by {W}"
                    )
                part = len(b) // W
                steps.append([b[r * part:(r + 1) * part] for r in range(W)])
                self.remainder = real
            return steps
        for k in range(0, len(batches), W):
            group = batches[k:k + W]
            if self.drop_last and (len(group) < W or len(group[-1]) < size):
                break  # a drop_last batch sampler: no incomplete global step
            real = sum(len(b) for b in group)
            if self.even_batches and flat:
                group = [b + [next(wrap) for _ in range(size - len(b))] if len(b) < size else b for b in group]
                while len(group) < W:
                    group.append([next(wrap) for _ in range(size)])
            steps.append(group)
            self.remainder = real
        return steps

    def __iter__(self):
        steps, skip = self._start_pass(self._global_steps)
        mine = (step[self.rank] for step in steps if self.rank < len(step) and step[self.rank])
        yield from self._give(mine, skip)


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
    use_seedable_sampler: bool = False,
    shard: Optional[tuple[int, int]] = None,
    loader_cls: type = DataLoader,
) -> DataLoader:
    """A new DataLoader over the same dataset that yields this rank's share of the batches.

    ``shard=(index, count)`` shards over ``count`` parts instead of the processes (tensor
    parallelism: the data-parallel ranks, the ranks of one TP group reading the same
    batches); shuffling is still agreed by every process of ``state``. ``loader_cls``: the
    class of the returned loader (torchdata's ``StatefulDataLoader`` for
    ``use_stateful_dataloader``; the sharded samplers have its ``state_dict`` protocol).

    Keeps ``collate_fn``, ``num_workers``, ``pin_memory``, ``drop_last``, ``generator`` and
    the other settings. For a map-style dataset with a batch size the returned loader's
    ``batch_sampler`` is a :class:`ShardedBatchSampler` (``set_epoch``, ``remainder``,
    ``total_dataset_length``); a custom ``batch_sampler`` (or a ``BatchSampler`` passed as
    ``sampler`` with ``batch_size=None``) is wrapped in a :class:`ShardedBatches`; for an
    iterable dataset the loader's ``dataset`` is an :class:`IterableDatasetShard`.

    Shuffling (a collective: call this, and iterate, on every rank):

    * by default every pass iterates the loader's own sampler, after giving the generator it
      draws from rank 0's state: all ranks see the same order, each pass a new one, and the
      same order a single process iterating the original loader sees (a ``RandomSampler``
      without a generator gets one, seeded from rank 0's torch RNG; a sampler or batch sampler
      whose randomness is not in a generator it exposes is drawn on rank 0 and sent, see
      [Note: one pass order on every rank]);
    * with ``seed`` (or ``use_seedable_sampler=True``: ``seed`` is then rank 0's
      ``torch.initial_seed()``), a ``RandomSampler``'s order is ``randperm`` seeded with
      ``seed + epoch``; the epoch advances after each complete pass, ``set_epoch`` sets it.

    Example::

        loader = shard_dataloader(DataLoader(ds, batch_size=16, shuffle=True), state, seed=42)
    """
    if not isinstance(dataloader, DataLoader):
        raise TypeError(
            f"shard_dataloader() needs a torch.utils.data.DataLoader, got {type(dataloader).__name__}; "
            f"wrap your dataset: DataLoader(dataset, batch_size=...)"
        )
    world, rank = (state.world_size, state.rank) if shard is None else (shard[1], shard[0])
    sync = state if state.world_size > 1 else None
    kept = {k: getattr(dataloader, k) for k in _KEPT if hasattr(dataloader, k)}
    if dataloader.num_workers > 0:
        kept["prefetch_factor"] = dataloader.prefetch_factor
    else:
        kept.pop("persistent_workers", None)

    batch_size = dataloader.batch_size
    batch_sampler = dataloader.batch_sampler
    sampler = dataloader.sampler
    drop_last = dataloader.drop_last
    if batch_size is None and type(batch_sampler) is BatchSampler:
        # DataLoader(batch_sampler=BatchSampler(sampler, n, drop_last)): the usual layout.
        sampler, batch_size, drop_last = batch_sampler.sampler, batch_sampler.batch_size, batch_sampler.drop_last
    elif batch_size is None and not isinstance(dataloader.dataset, IterableDataset):
        if seed is not None:
            raise ValueError(
                f"seed={seed!r} only applies to shuffling loaders with a batch size, but this loader batches "
                f"with {type(batch_sampler or sampler).__name__}; drop seed= (its generators are synchronised)"
            )
        if batch_sampler is not None:
            shard = ShardedBatches(batch_sampler, rank=rank, world_size=world, split_batches=split_batches,
                                   even_batches=even_batches, sync=sync)
            return loader_cls(dataloader.dataset, batch_sampler=shard, **kept)
        if not _iterates_lists(sampler):
            raise ValueError(
                f"shard_dataloader() got batch_size=None and a {type(sampler).__name__} sampler that does not "
                f"yield batches; give the DataLoader a batch_size= (or a batch_sampler=)"
            )
        shard = ShardedBatches(sampler, rank=rank, world_size=world, split_batches=split_batches,
                               even_batches=even_batches, sync=sync)
        return loader_cls(dataloader.dataset, sampler=shard, batch_size=None, **kept)
    if batch_size is None:
        raise ValueError(
            f"shard_dataloader() got an iterable dataset with batch_size=None; sharding an iterable "
            f"dataset needs a fixed batch size: build the DataLoader with batch_size="
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

    if isinstance(dataloader.dataset, IterableDataset):
        shard = IterableDatasetShard(
            dataloader.dataset, rank=rank, world_size=world, batch_size=per_rank, total_batch_size=total, drop_last=drop_last
        )
        return loader_cls(shard, batch_size=per_rank, drop_last=drop_last, **kept)

    shuffle_seed = None
    plain_shuffle = (type(sampler) is RandomSampler and not sampler.replacement
                     and sampler.num_samples == len(dataloader.dataset))
    if seed is not None and not isinstance(sampler, RandomSampler):
        raise ValueError(
            f"seed={seed!r} only applies to shuffling loaders (RandomSampler), but this loader uses "
            f"{type(sampler).__name__}; drop seed= or build the DataLoader with shuffle=True"
        )
    if seed is not None and not plain_shuffle:
        raise ValueError(
            f"a seeded shuffle replaces the loader's RandomSampler by randperm(seed + epoch), but this "
            f"{type(sampler).__name__} has replacement={sampler.replacement} / num_samples={sampler.num_samples}; "
            f"use shuffle=True without them, or no seed (the sampler's generator is then synchronised)"
        )
    if plain_shuffle and (seed is not None or use_seedable_sampler):
        if seed is None:
            seed = broadcast_object_list(state, [torch.initial_seed()], src=0)[0]
        shuffle_seed = seed
    elif type(sampler) is RandomSampler and sampler.generator is None:
        # Its order would come from each rank's own torch RNG: draw from a generator instead,
        # seeded from rank 0 and synchronised at every pass (the user's sampler is untouched).
        g = torch.Generator()
        g.manual_seed(broadcast_object_list(state, [int(torch.randint(0, 2**62, ()).item())], src=0)[0])
        sampler = RandomSampler(sampler.data_source, replacement=sampler.replacement,
                                num_samples=sampler._num_samples, generator=g)
    length = len(sampler) if shuffle_seed is None else len(dataloader.dataset)
    sharded = ShardedBatchSampler(
        sampler,
        dataset_length=length,
        rank=rank,
        world_size=world,
        batch_size=per_rank,
        total_batch_size=total,
        drop_last=drop_last,
        even_batches=even_batches,
        shuffle_seed=shuffle_seed,
        sync=sync if shuffle_seed is None else None,
    )
    return loader_cls(dataloader.dataset, batch_sampler=sharded, **kept)


def _iterates_lists(sampler: Any) -> bool:
    """Whether ``sampler`` yields batches (lists of indices), e.g. a BatchSampler."""
    return isinstance(sampler, BatchSampler) or hasattr(sampler, "batch_size")

"""Data utilities for multi-process runs: :func:`shard_dataloader`.

Example::

    from mixprec.data import shard_dataloader
    loader = shard_dataloader(DataLoader(ds, batch_size=8, shuffle=True), state, seed=0)
"""

from .sharding import IterableDatasetShard, ShardedBatchSampler, shard_dataloader

__all__ = ["IterableDatasetShard", "ShardedBatchSampler", "shard_dataloader"]

"""Checkpoints in one sharded format for every backend and world size.

Example::

    from mixprec.checkpoint import ProjectConfiguration, make_resumable
    accelerator = Accelerator(project_config=ProjectConfiguration(
        project_dir="runs/a", automatic_checkpoint_naming=True, total_limit=3))
    model, opt, loader = accelerator.prepare(model, opt, loader)
    make_resumable(loader)
    accelerator.save_state()            # every rank calls it
    accelerator.load_state()            # the newest complete checkpoint

See ``docs/checkpointing.md`` for the format and the engine contract.
"""

from .consolidate import consolidate, write_state_dict
from .dataloader import ResumableDataLoader, make_resumable
from .format import CheckpointError, Shard
from .reader import CheckpointReader
from .rotation import ProjectConfiguration, latest_checkpoint, list_checkpoints
from .sync import CollectiveMismatchError

__all__ = [
    "CheckpointError",
    "CheckpointReader",
    "CollectiveMismatchError",
    "ProjectConfiguration",
    "ResumableDataLoader",
    "Shard",
    "consolidate",
    "latest_checkpoint",
    "list_checkpoints",
    "make_resumable",
    "write_state_dict",
]

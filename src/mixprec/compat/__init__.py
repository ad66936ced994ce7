"""Accelerate's names on top of mixprec (see docs/migrating.md).

Example::

    from mixprec import Accelerator, DataLoaderConfiguration
    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(split_batches=True))
    print(accelerator.state.distributed_type, accelerator.state.process_index)
"""

from .options import (
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    DistributedType,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
)
from .state import AcceleratorState, PartialState

__all__ = [
    "AcceleratorState",
    "DataLoaderConfiguration",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "GradientAccumulationPlugin",
    "GradScalerKwargs",
    "InitProcessGroupKwargs",
    "PartialState",
]

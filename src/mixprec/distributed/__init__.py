"""Multi-process support: who am I (:class:`DistributedState`), and collectives over it.

Example::

    from mixprec.distributed import init_distributed, destroy_distributed, gather
    state = init_distributed(torch.device("cpu"))
    everything = gather(state, local_predictions)
    destroy_distributed(state)
"""

from .collectives import (
    barrier,
    broadcast,
    broadcast_object_list,
    gather,
    gather_for_metrics,
    gather_object,
    pad_across_processes,
    reduce,
    split_between_processes,
)
from .state import DistributedState, destroy_distributed, init_distributed

__all__ = [
    "DistributedState",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "destroy_distributed",
    "gather",
    "gather_for_metrics",
    "gather_object",
    "init_distributed",
    "pad_across_processes",
    "reduce",
    "split_between_processes",
]

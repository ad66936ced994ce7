"""The device a collective on a process group takes its tensors on.

[Note: collectives on the group's device]
NCCL moves device tensors only: a CPU tensor handed to an NCCL group fails ("No backend type
associated with device type cpu"), and Gloo takes CPU tensors (CUDA ones through the host). A
collective whose tensors come from the model (gradients, activations, parameters) is on the
right device already; one that makes its own tensor (a flag, a fingerprint, a random state,
a size, a user's value handed to ``gather``) must put it on :func:`group_device` of the group
it runs on, never on the default device: ``torch.tensor(...)`` without ``device=``,
``torch.get_rng_state()`` and ``.cpu()`` are host tensors. Python-side collectives in mixprec
take their device from here; tests/distributed/test_collective_device_check.py runs the
backends, TP and SP with every collective checked ([Note: host-born tensors] in
tests/distributed/device_check.py says how a CPU run sees a host tensor that an NCCL run
would refuse).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def group_device(group: Any = None) -> torch.device:
    """Where a collective on ``group`` (None: the default group) takes its tensors: the
    current CUDA device for a group with an NCCL backend, else (Gloo) the CPU."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def on_group_device(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """``tensor`` on :func:`group_device` of ``group`` (itself when it is there already)."""
    return tensor.to(group_device(group))


__all__ = ["group_device", "on_group_device"]

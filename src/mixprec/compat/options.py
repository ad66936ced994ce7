"""Accelerate's option objects, with Accelerate's names, fields and defaults.

``Accelerator(dataloader_config=..., gradient_accumulation_plugin=..., kwargs_handlers=[...])``
takes these classes, and equally the same-named instances of Accelerate itself when it is
installed: fields are read by name (duck typing), so ``accelerate.DataLoaderConfiguration``
and ``mixprec.DataLoaderConfiguration`` are interchangeable.

Example::

    from mixprec import Accelerator, DataLoaderConfiguration, GradScalerKwargs
    accelerator = Accelerator(
        mixed_precision="fp16",
        dataloader_config=DataLoaderConfiguration(split_batches=True),
        kwargs_handlers=[GradScalerKwargs(init_scale=1024.0)],
    )
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
from typing import Any, Optional


class DistributedType(str, enum.Enum):
    """Accelerate's ``DistributedType``, every member (so a script's
    ``if accelerator.distributed_type == DistributedType.XLA:`` runs). A ``str`` enum, so it
    compares equal to Accelerate's own members (``DistributedType.MULTI_CPU == "MULTI_CPU"``).
    A mixprec Accelerator is only ever ``NO``, ``MULTI_CPU``, ``MULTI_GPU``, ``FSDP`` or
    ``DEEPSPEED`` (the ZeRO backends); the others exist for the comparisons. ``TPU`` is
    older Accelerate's name of ``XLA`` (an alias: ``DistributedType.TPU is DistributedType.XLA``)."""

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_XPU = "MULTI_XPU"
    DEEPSPEED = "DEEPSPEED"
    FSDP = "FSDP"
    XLA = "XLA"
    MEGATRON_LM = "MEGATRON_LM"
    MULTI_HPU = "MULTI_HPU"
    MULTI_NEURON = "MULTI_NEURON"
    TPU = "XLA"


@dataclasses.dataclass
class DataLoaderConfiguration:
    """How ``prepare()`` shards dataloaders (Accelerate's fields and defaults).

    ``dispatch_batches`` (None: True for an ``IterableDataset``): rank 0 reads, every rank
    receives its slice (mixprec/data/dispatch.py). ``use_stateful_dataloader``: prepared
    loaders run on torchdata's ``StatefulDataLoader`` and resume from its state
    (mixprec/checkpoint/dataloader.py); without it ``save_state`` still records every
    prepared dataloader's position (docs/checkpointing.md).
    """

    split_batches: bool = False
    dispatch_batches: Optional[bool] = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: Optional[int] = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False


@dataclasses.dataclass
class GradientAccumulationPlugin:
    """Accelerate's accumulation settings. ``sync_each_batch=True`` communicates gradients on
    every micro-batch (more traffic, no per-window gradient buffers kept unreduced)."""

    num_steps: Optional[int] = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False


@dataclasses.dataclass
class DistributedDataParallelKwargs:
    """DDP options: ``bucket_cap_mb``, ``find_unused_parameters`` and ``broadcast_buffers``
    go to the ddp engine (``engine_options``); others must keep their defaults."""

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False


@dataclasses.dataclass
class InitProcessGroupKwargs:
    """Process-group options: ``timeout`` is used; ``backend``/``init_method`` are chosen by
    mixprec (Gloo on CPU, NCCL on CUDA; from the launcher's environment)."""

    backend: Optional[str] = "nccl"
    init_method: Optional[str] = None
    timeout: Optional[datetime.timedelta] = None


@dataclasses.dataclass
class GradScalerKwargs:
    """fp16 loss-scaler options, mapped onto :class:`mixprec.ScalerConfig`."""

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True


_HANDLERS = {
    "DistributedDataParallelKwargs": DistributedDataParallelKwargs,
    "InitProcessGroupKwargs": InitProcessGroupKwargs,
    "GradScalerKwargs": GradScalerKwargs,
}

# Accelerate handlers that configure something mixprec has no counterpart for, with the fix.
_NO_COUNTERPART = {
    "AutocastKwargs": "pass it to accelerator.autocast(autocast_handler) around the block, or use mixed_precision=",
    "FP8RecipeKwargs": "fp8 is not supported; use mixed_precision='bf16'",
    "AORecipeKwargs": "fp8 is not supported; use mixed_precision='bf16'",
    "TERecipeKwargs": "fp8 is not supported; use mixed_precision='bf16'",
    "MSAMPRecipeKwargs": "fp8 is not supported; use mixed_precision='bf16'",
    "ProfileKwargs": ("use torch.profiler.profile directly around your loop, or pass it to "
                      "accelerator.profile(profile_handler)"),
}


def read_fields(obj: Any, cls: type, argument: str) -> Any:
    """``obj`` as an instance of ``cls``: itself, or a copy of the same-named fields of an
    object of the same class name (Accelerate's). Anything else raises a TypeError."""
    if isinstance(obj, cls):
        return obj
    if type(obj).__name__ != cls.__name__:
        raise TypeError(
            f"{argument}={obj!r} must be a mixprec.{cls.__name__} (or accelerate.{cls.__name__}), "
            f"got {type(obj).__module__}.{type(obj).__qualname__}"
        )
    values = {f.name: getattr(obj, f.name) for f in dataclasses.fields(cls) if hasattr(obj, f.name)}
    return cls(**values)


def sort_handlers(handlers: Any) -> dict[str, Any]:
    """``kwargs_handlers`` by class name, each converted to mixprec's class."""
    if handlers is None:
        return {}
    if not isinstance(handlers, (list, tuple)):
        raise TypeError(f"kwargs_handlers={handlers!r} must be a list of handler objects, e.g. "
                        f"[DistributedDataParallelKwargs(find_unused_parameters=True)]")
    found: dict[str, Any] = {}
    for h in handlers:
        name = type(h).__name__
        if name in found:
            raise ValueError(f"kwargs_handlers has two {name} objects; give one")
        if name not in _HANDLERS:
            fix = _NO_COUNTERPART.get(name, "give DistributedDataParallelKwargs, InitProcessGroupKwargs "
                                            "or GradScalerKwargs")
            raise ValueError(f"kwargs_handlers: {name} is not supported by mixprec; {fix}")
        if name == "DistributedDataParallelKwargs":
            # Accelerate's class also has communication-hook fields; mixprec's ddp engine has no hooks.
            hook = getattr(h, "comm_hook", None)
            if str(getattr(hook, "value", hook)).lower() not in ("none", "no"):
                raise ValueError(
                    f"DistributedDataParallelKwargs(comm_hook={hook!r}): mixprec's ddp engine has no "
                    f"communication hooks; for bf16 gradient communication use PrecisionPolicy(reduce_dtype=torch.bfloat16) (docs/backends.md)"
                )
        found[name] = read_fields(h, _HANDLERS[name], "kwargs_handlers item")
    return found


def ddp_engine_options(handler: DistributedDataParallelKwargs) -> dict:
    """The ddp engine options a DistributedDataParallelKwargs asks for."""
    defaults = DistributedDataParallelKwargs()
    unsupported = [f for f in ("dim", "check_reduction", "gradient_as_bucket_view", "static_graph")
                   if getattr(handler, f) != getattr(defaults, f)]
    if unsupported:
        raise ValueError(
            f"DistributedDataParallelKwargs: {', '.join(f'{f}={getattr(handler, f)!r}' for f in unsupported)} "
            f"has no counterpart in mixprec's ddp engine; leave them at their defaults "
            f"(supported: bucket_cap_mb, find_unused_parameters, broadcast_buffers)"
        )
    out = {}
    for f in ("bucket_cap_mb", "find_unused_parameters", "broadcast_buffers"):
        if getattr(handler, f) != getattr(defaults, f):
            out[f] = getattr(handler, f)
    return out

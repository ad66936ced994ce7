"""Small helpers over nested containers of tensors (tuples, lists, dicts, mappings), and the
names scripts import from ``accelerate.utils`` (``set_seed``, ``DistributedType``,
``ProjectConfiguration``, the configuration dataclasses...): ``from mixprec.utils import
set_seed`` works where ``from accelerate.utils import set_seed`` did. The dataclasses are
mixprec's own (src/mixprec/compat/options.py), loaded on first use (this module is imported by
the lower layers, so it imports nothing of mixprec at import time).

Example::

    from mixprec.utils import DistributedType, set_seed
    set_seed(42)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

import torch

LOW_PRECISION = (torch.bfloat16, torch.float16)
CASTABLE = (torch.float32, torch.bfloat16, torch.float16)


def tree_map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any) -> Any:
    """Apply ``fn`` to every tensor in ``obj``, rebuilding tuples, lists, dicts and
    namedtuples/Mapping subclasses (e.g. Hugging Face ``ModelOutput``) of the same type."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(tree_map_tensors(fn, x) for x in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(tree_map_tensors(fn, x) for x in obj)
    if isinstance(obj, Mapping):
        items = {k: tree_map_tensors(fn, v) for k, v in obj.items()}
        try:
            return type(obj)(items)
        except TypeError:
            return items
    return obj


def cast_floating(obj: Any, dtype: torch.dtype) -> Any:
    """Cast fp32/bf16/fp16 tensors in ``obj`` to ``dtype``; integer, bool, fp64 and
    complex tensors are never touched."""

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.dtype in CASTABLE and t.dtype != dtype else t

    return tree_map_tensors(cast, obj)


def upcast_low_precision(obj: Any, dtype: torch.dtype) -> Any:
    """Cast bf16/fp16 tensors in ``obj`` to ``dtype`` (used for model outputs)."""

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.dtype in LOW_PRECISION and t.dtype != dtype else t

    return tree_map_tensors(cast, obj)


def send_to_device(obj: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Move every tensor in ``obj`` to ``device``."""
    return tree_map_tensors(lambda t: t.to(device, non_blocking=non_blocking), obj)


def pid_alive(pid: int) -> bool:
    """True while process ``pid`` runs (a zombie counts as dead on Linux); used by the
    launcher (is my launcher gone?) and by saves (is the writer of a temp directory gone?)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rindex(")") + 2] not in "ZX"
    except OSError:
        return True


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed Python's ``random``, numpy's global RNG (when numpy is installed) and torch (CPU
    and every CUDA device), as Accelerate's ``set_seed`` does. ``device_specific=True`` adds
    the process index to ``seed`` (each process draws differently); ``deterministic=True``
    also calls ``torch.use_deterministic_algorithms(True)``."""
    import random

    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"set_seed(seed={seed!r}) needs an int")
    if device_specific:
        seed += _process_index()
    random.seed(seed)
    try:
        import numpy
    except ImportError:  # numpy is optional: nothing to seed
        pass
    else:
        numpy.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)


_OOM_MESSAGES = (
    " out of memory.",  # CUDA, HIP, XPU
    "MPS backend out of memory",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",
    "DefaultCPUAllocator: can't allocate memory",
    "FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed",  # HPU
)


def should_reduce_batch_size(exception: BaseException) -> bool:
    """True when ``exception`` is an out-of-memory error (Accelerate's test, the same messages)."""
    if isinstance(exception, torch.cuda.OutOfMemoryError):
        return True
    if isinstance(exception, RuntimeError) and len(exception.args) == 1 and isinstance(exception.args[0], str):
        return any(message in exception.args[0] for message in _OOM_MESSAGES)
    return False


def find_executable_batch_size(function: Callable = None, starting_batch_size: int = 128,
                               reduce_batch_size_fn: Callable[[], int] = None):
    """Accelerate's decorator: call ``function(batch_size, *args, **kwargs)`` with
    ``starting_batch_size``, and again with a smaller one (``int(batch_size * 0.9)``, or what
    ``reduce_batch_size_fn()`` returns) after each out-of-memory error, until it returns.

    Example::

        @find_executable_batch_size(starting_batch_size=64)
        def train(batch_size, model):
            ...
        train(model)   # not train(64, model)
    """
    import functools
    import gc
    import inspect

    if function is None:
        return functools.partial(find_executable_batch_size, starting_batch_size=starting_batch_size,
                                 reduce_batch_size_fn=reduce_batch_size_fn)
    batch_size = starting_batch_size

    def reduce() -> int:
        return reduce_batch_size_fn() if reduce_batch_size_fn is not None else int(batch_size * 0.9)

    def clear() -> None:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    @functools.wraps(function)
    def decorator(*args, **kwargs):
        nonlocal batch_size
        clear()
        params = list(inspect.signature(function).parameters)
        if len(params) < len(args) + 1:
            given = ", ".join(f"{p}={v!r}" for p, v in zip(params[1:], args[1:]))
            raise TypeError(f"{function.__name__}() got the batch size as its first argument; the decorator passes "
                            f"it: call {function.__name__}({given})")
        while True:
            if batch_size <= 0:
                raise RuntimeError(f"find_executable_batch_size: no batch size from {starting_batch_size} down "
                                   f"to 1 fits in memory (reached {batch_size})")
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as e:  # noqa: BLE001 - re-raised unless it is an out-of-memory error
                if not should_reduce_batch_size(e):
                    raise
                clear()
                batch_size = reduce()

    return decorator


def _process_index() -> int:
    from .registry import live_accelerator

    acc = live_accelerator()
    if acc is not None:
        return acc.state.rank
    return int(os.environ.get("RANK", "0"))


# accelerate.utils names that live elsewhere in mixprec, resolved on first use (PEP 562).
_LAZY = {
    "DistributedType": "mixprec.compat.options",
    "DataLoaderConfiguration": "mixprec.compat.options",
    "DistributedDataParallelKwargs": "mixprec.compat.options",
    "GradientAccumulationPlugin": "mixprec.compat.options",
    "GradScalerKwargs": "mixprec.compat.options",
    "InitProcessGroupKwargs": "mixprec.compat.options",
    "ProjectConfiguration": "mixprec.checkpoint.rotation",
    "skip_first_batches": "mixprec.wrappers.dataloader",
    **{name: "mixprec.compat.functions" for name in (
        "gather", "gather_object", "broadcast", "broadcast_object_list", "reduce", "pad_across_processes")},
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mixprec.utils' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(_LAZY))

"""Count what a training step costs the host: scalar reads and Python -> C++ crossings.

[Note: counting host syncs]
On an accelerator every device-to-host read stalls the host until the device queue has
drained, so a step that reads one flag cannot run ahead of the GPU. :class:`ScalarReads`
counts those reads the way the dispatcher sees them, whatever issued them (Python, torch
or mixprec's C++, which dispatches ``item<T>()`` through the same operator):
``aten._local_scalar_dense`` (``.item()``, ``float(t)``, ``bool(t)``), ``aten.is_nonzero``,
``aten.equal``, and copies whose source is on an accelerator and whose destination is on
the CPU (``.cpu()``, ``.tolist()`` on CUDA tensors). On a CPU-only machine the same
operators are counted, so a CPU test proves the step issues none of them; a read done in
C++ through a raw pointer on a CPU tensor is not a read of device memory and is not
counted (mixprec's kernels read ``found_inf`` that way on CPU and on the device on CUDA).

A copy from the device into *pinned* host memory with ``non_blocking=True`` is not a read:
the host enqueues it and goes on, and nothing is known on the host until an event says the
copy has landed (the lazy step results of src/mixprec/step.py snapshot their scalars that
way). It is not counted; the same copy into pageable memory, or a blocking one, is (the
host waits for it). :func:`copy_is_host_read` is that rule.

:class:`Crossings` counts calls from Python into ``mixprec._C`` (functions and methods of
its classes) with ``sys.setprofile``, per name.

Example::

    with ScalarReads() as reads, Crossings() as calls:
        train_step()
    reads.count, reads.by_op          # 0, {}
    calls.count, calls.by_name        # 3, {'ShardedCore.reduce': 1, ...}
"""

from __future__ import annotations

import sys
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_READ_OPS = {
    "aten::_local_scalar_dense",
    "aten::is_nonzero",
    "aten::equal",
    "aten::item",
}


def _device_of(x) -> torch.device | None:
    device = getattr(x, "device", None)
    return device if isinstance(device, torch.device) else None


def copy_is_host_read(src_device, dst_device, *, non_blocking: bool, dst_pinned: bool) -> bool:
    """Whether a copy from ``src_device`` to ``dst_device`` makes the host wait for the
    device ([Note: counting host syncs]): device -> CPU copies do, except a non-blocking
    one into pinned memory, which the host only enqueues. Meta tensors hold no data."""
    if src_device is None or dst_device is None:
        return False
    src, dst = torch.device(src_device), torch.device(dst_device)
    if src.type in ("cpu", "meta") or dst.type != "cpu":
        return False
    return not (non_blocking and dst_pinned)


def _pinned(x) -> bool:
    try:
        return bool(x.is_pinned())
    except (RuntimeError, AttributeError):  # no accelerator to pin with: not pinned
        return False


def classify_copy(name: str, args: tuple, kwargs: dict) -> str | None:
    """The counter key for a copy operator call that reads device memory on the host, or
    None when it does not (see :func:`copy_is_host_read`). ``name`` is ``aten::copy_``
    (``dst.copy_(src, non_blocking)``) or ``aten::_to_copy`` (``src.to(device, ...,
    non_blocking, pin_memory=...)``, a new tensor)."""
    if name == "aten::copy_":
        dst, src = args[0], args[1]
        non_blocking = bool(args[2]) if len(args) > 2 else bool(kwargs.get("non_blocking", False))
        src_dev, dst_dev = _device_of(src), _device_of(dst)
        pinned = dst_dev is not None and dst_dev.type == "cpu" and _pinned(dst)
    elif name == "aten::_to_copy":
        src_dev = _device_of(args[0])
        dst_dev = kwargs.get("device") or src_dev
        dst_dev = torch.device(dst_dev) if dst_dev is not None else None
        non_blocking = bool(kwargs.get("non_blocking", False))
        pinned = bool(kwargs.get("pin_memory", False))
    else:
        return None
    if copy_is_host_read(src_dev, dst_dev, non_blocking=non_blocking, dst_pinned=pinned):
        return f"{name} ({torch.device(src_dev).type}->cpu)"
    return None


class ScalarReads(TorchDispatchMode):
    """Dispatch mode counting device-to-host reads (see [Note: counting host syncs])."""

    def __init__(self) -> None:
        super().__init__()
        self.by_op: Counter = Counter()  # operator name -> reads

    @property
    def count(self) -> int:
        return sum(self.by_op.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name in _READ_OPS:
            self.by_op[name] += 1
        elif name in ("aten::_to_copy", "aten::copy_"):
            key = classify_copy(name, args, kwargs)
            if key is not None:
                self.by_op[key] += 1
        return func(*args, **kwargs)


class Crossings:
    """Context manager counting Python -> ``mixprec._C`` calls, by name."""

    def __init__(self) -> None:
        self.by_name: Counter = Counter()
        self._previous = None

    @property
    def count(self) -> int:
        return sum(self.by_name.values())

    def _profile(self, frame, event, arg) -> None:
        if self._previous is not None:
            self._previous(frame, event, arg)  # nested counters all count
        if event == "c_call" and getattr(arg, "__module__", None) == "mixprec._C":
            owner = getattr(arg, "__self__", None)
            if owner is not None and type(owner).__module__ == "mixprec._C":
                self.by_name[f"{type(owner).__name__}.{arg.__name__}"] += 1
            else:
                self.by_name[arg.__name__] += 1

    def __enter__(self) -> "Crossings":
        self._previous = sys.getprofile()
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(self._previous)

"""Which aten ops ran in which dtypes during a dry run, and which have no low-precision
kernel on the device (used by ``doctor()``).

A :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees every aten op after
autocast has cast its inputs, so the dtypes it records are the ones the kernels got. An
op that got fp32 inputs while autocast was on (autocast keeps it in fp32, or its inputs
came from an fp32 region) is tried once more with its fp32 inputs cast to the compute
dtype; an op refusing that ("not implemented for 'BFloat16'") has no low-precision kernel
here, and casting its inputs by hand (or ``param_dtype``/``*-pure``) would break it.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from ..utils import LOW_PRECISION

# Ops that move or cast data without computing (autocast's own casts are _to_copy): not
# worth listing as "ran in fp32".
_DATA_MOVEMENT = frozenset({
    "_to_copy", "to", "copy", "copy_", "clone", "detach", "alias", "lift_fresh", "empty_like",
    "zeros_like", "ones_like", "full_like", "fill_", "zero_", "cat", "stack", "contiguous",
    "_unsafe_view",
})
_NO_LOWP_KERNEL = re.compile(
    r"not implemented for '(BFloat16|Half)'"
    r"|Low precision dtypes not supported"
    r"|Unsupported dtype (BFloat16|Half)"
)


@dataclass
class OpUse:
    """How one aten op ran: calls per input-dtype class and the first module that called it."""

    name: str
    calls: dict[str, int] = field(default_factory=dict)  # "low"/"fp32"/"mixed"/"other" -> count
    module: Optional[str] = None  # innermost module of its first call (None: backward / outside)
    phase: str = "forward"  # of its first call
    no_kernel: Optional[str] = None  # the error of the low-precision retry, if it had none


def _dtype_class(tensors: list[torch.Tensor]) -> str:
    floats = {t.dtype for t in tensors if t.is_floating_point()}
    if not floats:
        return "other"
    low = floats & set(LOW_PRECISION)
    if low and floats - set(LOW_PRECISION):
        return "mixed"
    if low:
        return "low"
    return "fp32" if floats == {torch.float32} else "other"


class OpRecorder(TorchDispatchMode):
    """Record every aten op's input dtypes; retry fp32 ops once in ``low_dtype``.

    ``where()`` returns the current module path (the doctor's module tracker) and
    ``phase()`` ``"forward"`` or ``"backward"``."""

    def __init__(self, low_dtype: Optional[torch.dtype], where: Callable[[], Optional[str]],
                 phase: Callable[[], str]) -> None:
        super().__init__()
        self.low_dtype = low_dtype  # the policy's compute dtype (None: no autocast, no retry)
        self.where = where
        self.phase = phase
        self.ops: dict[str, OpUse] = {}  # op name -> use, first call first
        self._paused = False  # inside paused(): ops are not recorded

    @contextlib.contextmanager
    def paused(self):
        """Ops run inside are not recorded (the diagnostics' own measurements)."""
        previous, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = previous

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._paused or func.is_view or func.overloadpacket.__name__ in _DATA_MOVEMENT:
            return out
        flat, _ = tree_flatten((args, kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        kind = _dtype_class(tensors)
        name = str(func.overloadpacket.__name__)
        use = self.ops.get(name)
        if use is None:
            use = self.ops[name] = OpUse(name, module=self.where(), phase=self.phase())
        use.calls[kind] = use.calls.get(kind, 0) + 1
        if kind == "fp32" and use.calls[kind] == 1 and self.low_dtype is not None:
            use.no_kernel = self._retry(func, args, kwargs)
        return out

    def _retry(self, func, args: tuple, kwargs: dict) -> Optional[str]:
        if func._schema.is_mutable:  # never re-run an in-place / out= op
            return None
        low = self.low_dtype

        def cast(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.dtype == torch.float32:
                return x.detach().to(low)
            return x

        try:
            with torch.no_grad():
                func(*tree_map(cast, args), **tree_map(cast, kwargs))
        except (RuntimeError, TypeError) as error:  # NotImplementedError is a RuntimeError
            message = str(error).splitlines()[0]
            return message if _NO_LOWP_KERNEL.search(message) else None
        return None

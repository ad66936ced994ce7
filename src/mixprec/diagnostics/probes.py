"""Probes that watch every module's outputs and output gradients for non-finite values.

Armed only when needed (near the overflow budget, or in ``doctor()``): arming registers a
forward hook on every submodule; disarming removes them, so an unarmed model carries no
hook at all. While armed, each forward records, per module call, how many elements of its
floating outputs (and inputs) are non-finite and their largest finite magnitude, and
hooks the outputs' gradients to record the same in backward. Statistics stay on the
device until read (no host sync per module).
"""

from __future__ import annotations

from dataclasses import dataclass
import contextlib
from typing import Any, Callable, ContextManager, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from ..policy import dtype_name

FP16_MAX = 65504.0  # largest finite float16
_MAX_RECORDS = 100_000  # an armed model left running (e.g. an eval loop) stops recording here


@dataclass(frozen=True)
class TensorStat:
    """What one module call produced (``kind="output"``) or received as the gradient of its
    outputs (``kind="grad"``): dtype, non-finite element count, largest finite |x|."""

    module: str  # dotted path in its model ("" is the root)
    module_type: str
    kind: str  # "output" or "grad"
    dtype: str
    nonfinite: int  # inf/nan elements
    numel: int
    max_abs: float  # largest finite magnitude (0.0 when none is finite)
    input_nonfinite: int = 0  # for outputs: non-finite elements among the floating inputs
    input_max_abs: float = 0.0  # for outputs: largest finite |x| among the floating inputs

    @property
    def display(self) -> str:
        return f"{self.module or '<root>'!r} ({self.module_type})"

    def overflows_fp16(self) -> bool:
        return self.nonfinite > 0 or self.max_abs > FP16_MAX

    def describe(self) -> str:
        what = "output" if self.kind == "output" else "output gradient"
        head = f"{self.display} {what} ({self.dtype})"
        if self.nonfinite:
            head += f": {self.nonfinite} of {self.numel} element(s) non-finite"
        else:
            head += ": all finite"
        head += f", largest finite |x| = {self.max_abs:.4g} (fp16 limit {FP16_MAX:g})"
        if self.kind == "output":
            state = "finite" if self.input_nonfinite == 0 else f"{self.input_nonfinite} non-finite"
            head += f"; its inputs: {state}, largest finite |x| = {self.input_max_abs:.4g}"
        return head


def _floating(obj: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor) and t.is_floating_point()
            and t.numel() > 0]


def _measure(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, int, str]:
    """(non-finite count, largest finite |x|) as device tensors, total numel, dtype name."""
    counts, maxima = [], []
    for t in tensors:
        t = t.detach()
        finite = torch.isfinite(t)
        counts.append((~finite).sum())
        zero = torch.zeros((), dtype=t.dtype, device=t.device)
        maxima.append(torch.where(finite, t.abs(), zero).max().float())
    dtype = "/".join(sorted({dtype_name(t.dtype) for t in tensors}))
    numel = sum(t.numel() for t in tensors)
    return torch.stack(counts).sum(), torch.stack(maxima).max(), numel, dtype


class ModuleProbes:
    """Forward hooks on every submodule of some models, recording :class:`TensorStat`\\ s in
    the order they happen (forward order for outputs, backward order for gradients)."""

    def __init__(self, quiet: Callable[[], ContextManager] = contextlib.nullcontext) -> None:
        self.quiet = quiet  # context the measurements run in (doctor: not recorded as model ops)
        self._handles: list = []  # hook handles while armed
        # (path, type, kind, dtype, numel, count, max, input count, input max), in order
        self._pending: list[tuple] = []

    @property
    def armed(self) -> bool:
        return bool(self._handles)

    def arm(self, models: list[nn.Module]) -> None:
        """Hook every submodule of ``models`` (idempotent). Paths of the i-th model (i > 0)
        are prefixed ``model<i>.``."""
        if self.armed:
            return
        for i, model in enumerate(models):
            prefix = f"model{i}." if i else ""
            for name, module in model.named_modules():
                path = (prefix + name) if name else prefix.rstrip(".")
                hook = self._make_hook(path, type(module).__name__)
                self._handles.append(module.register_forward_hook(hook))

    def disarm(self) -> None:
        """Remove every hook and forget what was recorded."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._pending.clear()

    def _make_hook(self, path: str, module_type: str):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            outs = _floating(output)
            if not outs or len(self._pending) >= _MAX_RECORDS:
                return
            ins = _floating(args)
            with self.quiet():
                count, amax, numel, dtype = _measure(outs)
                in_count, in_amax = (_measure(ins)[:2] if ins else (None, None))
            self._pending.append(
                (path, module_type, "output", dtype, numel, count, amax, in_count, in_amax)
            )
            grads_of = [t for t in outs if t.requires_grad]
            if grads_of and torch.is_grad_enabled():
                for t in grads_of:
                    t.register_hook(self._make_grad_hook(path, module_type))

        return hook

    def _make_grad_hook(self, path: str, module_type: str):
        def grad_hook(grad: torch.Tensor) -> None:
            if grad is None or not grad.is_floating_point() or grad.numel() == 0:
                return
            if len(self._pending) >= _MAX_RECORDS:
                return
            with self.quiet():
                count, amax, numel, dtype = _measure([grad])
            self._pending.append((path, module_type, "grad", dtype, numel, count, amax, None, None))

        return grad_hook

    def records(self) -> list[TensorStat]:
        """Everything recorded since arming, in the order it happened (reads the device)."""
        out = []
        for path, mtype, kind, dtype, numel, count, amax, in_count, in_amax in self._pending:
            out.append(TensorStat(
                path, mtype, kind, dtype, int(count), numel, float(amax),
                0 if in_count is None else int(in_count),
                0.0 if in_amax is None else float(in_amax),
            ))
        return out


def first_culprit(records: list[TensorStat], limit: float = FP16_MAX) -> Optional[TensorStat]:
    """The record that explains an fp16 overflow: the first module output (forward order,
    innermost first) that is non-finite or above ``limit`` (an fp32 output above 65504
    overflows when the next fp16 op casts it), else the first non-finite output gradient
    (backward order). None when every record is finite and in range."""
    for r in records:
        if r.kind == "output" and (r.nonfinite or r.max_abs > limit):
            return r
    for r in records:
        if r.kind == "grad" and r.nonfinite:
            return r
    return None

"""Re-raise dtype errors from a prepared model's forward naming the module, its dtypes, the
policy and a fix (see [Note: locating the failing module from the traceback] in locate.py).

Only dtype errors are rewrapped; any other exception propagates untouched.
"""

from __future__ import annotations

import re
from typing import Optional

import torch
from torch import nn

from ..errors import MixprecDtypeError, MixprecError
from ..policy import PrecisionPolicy, dtype_name
from ..utils import LOW_PRECISION
from .locate import FailingModule, failing_module

# Messages of torch's dtype checks (matmul, conv, index ops, kernels without a dtype).
_DTYPE_MESSAGE = re.compile(
    r"must have the same (scalar )?(d)?type"
    r"|to have the same (scalar )?(d)?type"
    r"|expected scalar type"
    r"|expected .* to have the same dtype"
    r"|type \(.*\) and .* type \(.*\) should be the same"
    r"|same type as tensor for argument"
    r"|not implemented for '(Half|BFloat16|Float|Double)'"
    r"|found dtype \w+ but expected"
    r"|can't be cast to the desired output type"
    r"|dtype mismatch",
    re.IGNORECASE,
)
_NO_KERNEL = re.compile(r"not implemented for '(Half|BFloat16)'")


class _MixprecDtypeNotImplemented(MixprecDtypeError, NotImplementedError):
    """A MixprecDtypeError for a missing kernel: ``except NotImplementedError`` (what torch
    raised) keeps working."""


def is_dtype_error(error: BaseException) -> bool:
    """True for the RuntimeErrors torch raises when tensors of different dtypes meet (or an op
    has no kernel for a dtype)."""
    return (
        isinstance(error, RuntimeError)
        and not isinstance(error, MixprecError)
        and bool(_DTYPE_MESSAGE.search(str(error)))
    )


def _dtypes(named) -> dict[str, torch.dtype]:
    return {name: t.dtype for name, t in named if t.is_floating_point()}


def _fmt(dtypes: dict[str, torch.dtype], shapes: Optional[dict[str, tuple]] = None) -> str:
    if not dtypes:
        return "none"
    parts = []
    for name, dtype in dtypes.items():
        shape = f" {list(shapes[name])}" if shapes and name in shapes else ""
        parts.append(f"{name}={dtype_name(dtype)}{shape}")
    return ", ".join(parts)


def _fixes(where: FailingModule, params: dict, buffers: dict, inputs: dict,
           policy: PrecisionPolicy, autocast_dtype: Optional[torch.dtype],
           message: str) -> list[str]:
    path = where.path
    keep = path if path else type(where.module).__name__
    fixes: list[str] = []
    doubles = [n for n, d in inputs.items() if d == torch.float64]
    if doubles:
        fixes.append(
            f"cast the float64 input(s) {doubles} to float32 (.float()) where they are made: a "
            ".double() call, or torch.tensor/torch.from_numpy on float64 data; mixprec casts "
            "fp32/bf16/fp16 inputs only, never float64"
        )
    expected = policy.param_dtype
    odd = [n for n, d in params.items() if d in LOW_PRECISION and d != expected]
    if odd:
        fixes.append(
            f"parameter(s) {odd} of {keep!r} were cast by hand to {dtype_name(params[odd[0]])} "
            f"while mixed_precision={policy.name!r} keeps parameters "
            f"{dtype_name(expected) if expected else 'in fp32'}: remove the manual .half()/.to() "
            "and let the policy cast (param_dtype=...)"
        )
    no_kernel = _NO_KERNEL.search(message)
    if no_kernel:
        alt = " or use mixed_precision='bf16'" if no_kernel.group(1) == "Half" else ""
        fixes.append(
            f"this op has no {no_kernel.group(1)} kernel on this device: run the module in fp32 "
            f"with keep_fp32_modules=[{keep!r}]{alt}"
        )
    seen = set(params.values()) | set(buffers.values()) | set(inputs.values())
    low_precision_met = bool(seen & set(LOW_PRECISION)) or autocast_dtype is not None
    if low_precision_met and not no_kernel and not doubles:
        fixes.append(
            f"keep the module in fp32: keep_fp32_modules=[{keep!r}] (autocast off and fp32 "
            "inputs inside it)"
        )
    if not doubles:
        fixes.append(
            "cast the tensors that meet in this op to one dtype inside forward "
            "(e.g. x.to(self.weight.dtype))"
        )
    return fixes


def _fp32_region(root: nn.Module, path: str) -> Optional[str]:
    """The path of the innermost keep_fp32 module holding ``path`` (None: not in one)."""
    parts = path.split(".") if path else []
    found = None
    module = root
    for depth in range(len(parts) + 1):
        if depth:
            module = getattr(module, parts[depth - 1], None)
            if module is None:
                break
        ctx = getattr(module, "_mixprec_ctx", None)
        if ctx is not None and ctx.fp32_region:
            found = ".".join(parts[:depth])
    return found


def explain_dtype_error(
    error: BaseException,
    root: Optional[nn.Module],
    policy: PrecisionPolicy,
    autocast_dtype: Optional[torch.dtype],
) -> Optional[MixprecDtypeError]:
    """A :class:`MixprecDtypeError` describing ``error`` raised inside ``root``'s forward, or
    None when ``error`` is not a dtype error (or happened outside ``root``'s modules).

    ``autocast_dtype``: the autocast dtype active around the forward (None: autocast off).
    """
    if not is_dtype_error(error):
        return None
    where = failing_module(error, root)
    if where is None:
        return None
    module = where.module
    own_params = list(module.named_parameters(recurse=False))
    own_buffers = list(module.named_buffers(recurse=False))
    if not own_params and not own_buffers:  # a container: show what it holds
        own_params = list(module.named_parameters())[:_MAX_LISTED]
        own_buffers = list(module.named_buffers())[:_MAX_LISTED]
    params, buffers = _dtypes(own_params), _dtypes(own_buffers)
    floating_inputs = {n: t for n, t in where.inputs.items() if t.is_floating_point()}
    inputs = {n: t.dtype for n, t in floating_inputs.items()}
    shapes = {n: tuple(t.shape) for n, t in floating_inputs.items()}
    region = _fp32_region(root, where.path)
    if region is not None:
        autocast_dtype = None  # keep_fp32 regions run with autocast off
        active = f"inside keep_fp32 module {region or '<root>'!r}: autocast off, fp32 inputs"
    else:
        active = ("autocast off" if autocast_dtype is None
                  else f"autocast {dtype_name(autocast_dtype)} on")
    fixes = _fixes(where, params, buffers, inputs, policy, autocast_dtype, str(error))
    lines = [
        f"dtype error in module {where.display} during forward: {error}",
        f"  parameters: {_fmt(params)}",
        f"  buffers:    {_fmt(buffers)}",
        f"  inputs:     {_fmt(inputs, shapes)}",
        f"  policy:     {policy.describe()} ({active})",
        "Suggested fix:",
        *(f"  - {fix}" for fix in fixes),
    ]
    cls = MixprecDtypeError
    if isinstance(error, NotImplementedError):
        cls = _MixprecDtypeNotImplemented
    return cls(
        "\n".join(lines), module_path=where.path, module_type=type(module).__name__,
        param_dtypes=params, buffer_dtypes=buffers, input_dtypes=inputs,
        policy=policy.describe(), fixes=tuple(fixes), original=str(error),
    )


_MAX_LISTED = 6  # parameters/buffers listed for a container module

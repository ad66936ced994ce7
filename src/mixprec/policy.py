"""The precision policy: one resolved description of the numerics, the same on every backend.

``mixed_precision="bf16"`` means exactly one thing in mixprec: fp32 master weights, bf16
compute, fp32 gradient reduction and accumulation. The policy is resolved once at
``Accelerator`` construction, printed at ``prepare()``, and (later) stored in checkpoints.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional

import torch

# Names accepted by ``Accelerator(mixed_precision=...)``.
PRESETS = ("no", "bf16", "fp16", "bf16-pure")

_DTYPE_NAMES = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
}


def dtype_name(dtype: Optional[torch.dtype]) -> str:
    """Short name of a floating dtype (``fp32``/``bf16``/``fp16``), ``-`` for None."""
    if dtype is None:
        return "-"
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


@dataclass(frozen=True, kw_only=True)
class ScalerConfig:
    """Dynamic loss-scaling settings (used only when the policy scales the loss).

    Defaults are torch.amp.GradScaler's; ``hysteresis=2, growth_interval=1000,
    min_scale=1`` gives DeepSpeed's dynamic scaler.
    """

    init_scale: float = 2.0**16
    """Initial loss scale. Positive and finite."""
    growth_factor: float = 2.0
    """Scale multiplier after ``growth_interval`` consecutive clean steps. > 1."""
    backoff_factor: float = 0.5
    """Scale multiplier on an overflow. In (0, 1)."""
    growth_interval: int = 2000
    """Clean steps between two growths. >= 1."""
    hysteresis: int = 1
    """Overflows tolerated in a row before backing off (1 = back off on every overflow)."""
    min_scale: float = 0.0
    """Floor for the scale (0 = none)."""
    max_scale: float = math.inf
    """Ceiling for the scale."""


@dataclass(frozen=True, kw_only=True)
class PrecisionPolicy:
    """How every tensor in training is stored and computed.

    Build one with :meth:`from_mixed_precision` (``"no"``, ``"bf16"``, ``"fp16"``,
    ``"bf16-pure"``) and override fields with :func:`dataclasses.replace`.

    Example::

        policy = PrecisionPolicy.from_mixed_precision("bf16", param_dtype=torch.bfloat16)
    """

    name: str
    """The preset this policy came from (for messages and checkpoints)."""
    compute_dtype: torch.dtype = torch.float32
    """dtype of autocast regions in forward; fp32 means no autocast."""
    param_dtype: Optional[torch.dtype] = None
    """Storage dtype of trainable floating parameters. None keeps the model's own dtype
    (fp32 parameters + autocast is the default mode); bf16/fp16 stores them in low
    precision with fp32 masters (unless ``master_dtype`` is None)."""
    master_dtype: Optional[torch.dtype] = torch.float32
    """dtype of the weights the optimizer updates. None only in ``*-pure`` policies:
    low-precision parameters are then updated in place."""
    reduce_dtype: torch.dtype = torch.float32
    """dtype gradients are reduced in across ranks."""
    output_dtype: Optional[torch.dtype] = torch.float32
    """Floating outputs of the prepared model are cast to this (None: left as computed)."""
    keep_fp32_modules: tuple[str, ...] = ()
    """Module class names or dotted module paths that run in fp32 with autocast off and
    keep fp32 parameters."""
    cast_forward_inputs: bool = True
    """Cast floating-point inputs of the prepared model to its parameter dtype. Integer
    and bool inputs are never touched."""
    loss_scaling: bool = False
    """Dynamic loss scaling (fp16)."""
    scaler: ScalerConfig = field(default_factory=ScalerConfig)
    """Loss-scaler settings, used when ``loss_scaling`` is on."""

    def __post_init__(self) -> None:
        floats = (torch.float32, torch.bfloat16, torch.float16)
        for name in ("compute_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value not in floats:
                raise ValueError(f"PrecisionPolicy.{name}={value!r} is not one of {floats}")
        for name in ("param_dtype", "master_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is not None and value not in floats:
                raise ValueError(f"PrecisionPolicy.{name}={value!r} must be None or one of {floats}")
        if self.master_dtype not in (None, torch.float32):
            raise ValueError(
                f"PrecisionPolicy.master_dtype={self.master_dtype!r}: masters are fp32 "
                "(torch.float32) or None for a '*-pure' policy"
            )
        if self.master_dtype is None and not self.name.endswith("-pure"):
            raise ValueError(
                f"PrecisionPolicy(name={self.name!r}) has master_dtype=None: updating "
                "low-precision weights without fp32 masters is only allowed as an explicit "
                "opt-in, mixed_precision='bf16-pure'"
            )
        if self.loss_scaling and self.compute_dtype != torch.float16:
            raise ValueError(
                f"loss_scaling=True with compute_dtype={self.compute_dtype!r}: loss scaling "
                "is for fp16 compute; bf16 and fp32 do not need it"
            )
        if self.compute_dtype == torch.float16 and self.param_dtype == torch.float16 and (
            self.master_dtype is None
        ):
            raise ValueError("fp16 parameters without fp32 masters are not supported: use 'fp16'")

    @property
    def accumulate_dtype(self) -> torch.dtype:
        """dtype gradients accumulate in across micro-batches: not a setting but a
        consequence. Every engine accumulates into the fp32 master gradients (ddp folds
        each backward into them, zero/fsdp into the fp32 shard), so it is fp32 whenever
        there are masters, and the parameter dtype under a ``*-pure`` policy."""
        if self.master_dtype is not None:
            return self.master_dtype
        return self.param_dtype if self.param_dtype is not None else torch.float32

    @property
    def autocast_enabled(self) -> bool:
        """True when forward runs under autocast (compute dtype below fp32)."""
        return self.compute_dtype != torch.float32

    @classmethod
    def from_mixed_precision(cls, mixed_precision: str, **overrides) -> "PrecisionPolicy":
        """Resolve a preset name (``"no"``, ``"bf16"``, ``"fp16"``, ``"bf16-pure"``)."""
        if not isinstance(mixed_precision, str) or mixed_precision not in PRESETS:
            raise ValueError(
                f"mixed_precision={mixed_precision!r} is not supported; use one of "
                f"{', '.join(repr(p) for p in PRESETS)}"
            )
        base: dict = {"name": mixed_precision}
        if mixed_precision == "bf16":
            base.update(compute_dtype=torch.bfloat16)
        elif mixed_precision == "fp16":
            base.update(compute_dtype=torch.float16, loss_scaling=True)
        elif mixed_precision == "bf16-pure":
            base.update(
                compute_dtype=torch.bfloat16,
                param_dtype=torch.bfloat16,
                master_dtype=None,
            )
        if "accumulate_dtype" in overrides:
            raise ValueError(
                f"accumulate_dtype={overrides['accumulate_dtype']!r} is not a setting: gradients "
                "accumulate in the fp32 master gradients (in the parameter dtype under "
                "'bf16-pure'); remove it, or choose master_dtype / mixed_precision instead"
            )
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            valid = ", ".join(f.name for f in dataclasses.fields(cls) if f.name != "name")
            raise ValueError(f"unknown PrecisionPolicy field(s) {sorted(unknown)}; valid: {valid}")
        base.update(overrides)
        return cls(**base)

    def describe(self) -> str:
        """A one-line summary, as printed at ``prepare()``."""
        params = dtype_name(self.param_dtype) if self.param_dtype else "as given"
        parts = [
            f"mixed_precision={self.name!r}",
            f"compute={dtype_name(self.compute_dtype)}",
            f"params={params}",
            f"masters={dtype_name(self.master_dtype) if self.master_dtype else 'none (pure)'}",
            f"reduce={dtype_name(self.reduce_dtype)}",
            f"accumulate={dtype_name(self.accumulate_dtype)}",
            f"loss_scaling={'dynamic' if self.loss_scaling else 'off'}",
        ]
        if self.keep_fp32_modules:
            parts.append(f"fp32_modules={list(self.keep_fp32_modules)}")
        return "mixprec policy: " + ", ".join(parts)

"""``backend="fsdp"``: FSDP2-style parameter sharding, i.e. ZeRO-3 (same sharding core, same
units) configured with FSDP2's names.

``engine_options``: ``units`` (module class names, or ``"size:<min_params>"``),
``reshard_after_forward`` (default True), and FSDP2's ``MixedPrecisionPolicy`` fields
``param_dtype``, ``reduce_dtype``, ``output_dtype``, ``cast_forward_inputs``, which map onto
the :class:`~mixprec.policy.PrecisionPolicy` chosen by ``mixed_precision`` (see
docs/fsdp.md). The ZeRO options (``bucket_cap_mb``, ``max_inflight_buckets``, ``collective``,
``loss_scaler``, ...) apply too.
"""

from __future__ import annotations

import dataclasses

import torch

from ..policy import PrecisionPolicy
from .zero import Zero3Comm

_UNSET = object()
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def _dtype(name: str, value):
    if value is None or isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value.replace("torch.", "") in _DTYPES:
        return _DTYPES[value.replace("torch.", "")]
    raise ValueError(f"engine_options[{name!r}]={value!r} is not a dtype; use torch.bfloat16, "
                     "torch.float16, torch.float32 (or their names), or None")


def map_mixed_precision(policy: PrecisionPolicy, param_dtype=_UNSET, reduce_dtype=_UNSET,
                        output_dtype=_UNSET, cast_forward_inputs=_UNSET) -> PrecisionPolicy:
    """Fold FSDP2 ``MixedPrecisionPolicy`` fields into ``policy``.

    A field equal to the policy's value is accepted; ``param_dtype`` is adopted when the
    policy stores parameters in their own dtype (``param_dtype=None``); ``reduce_dtype`` is
    adopted (the dtype of the gradient collectives); anything else is a conflict and
    raises, naming both values."""
    changes = {}
    given = {"param_dtype": param_dtype, "reduce_dtype": reduce_dtype, "output_dtype": output_dtype}
    for field, value in given.items():
        if value is _UNSET:
            continue
        value = _dtype(field, value)
        current = getattr(policy, field)
        if value == current:
            continue
        if field == "param_dtype" and current is None and value is not None:
            changes[field] = value
            continue
        if field == "reduce_dtype" and value is not None:
            # FSDP2's reduce_dtype: the dtype gradients travel in ([Note: low-precision
            # reduction] in csrc/engines/sharded/core.h); accumulation stays fp32.
            changes[field] = value
            continue
        raise ValueError(
            f"engine_options[{field!r}]={value} conflicts with mixed_precision={policy.name!r}, "
            f"whose {field} is {current}; drop the engine option or choose a "
            "mixed_precision whose field matches"
        )
    if cast_forward_inputs is not _UNSET:
        if not isinstance(cast_forward_inputs, bool):
            raise ValueError(f"engine_options['cast_forward_inputs']={cast_forward_inputs!r} must be True or False")
        changes["cast_forward_inputs"] = cast_forward_inputs
    return dataclasses.replace(policy, **changes) if changes else policy


class FSDPComm(Zero3Comm):
    """FSDP2-style sharding: ZeRO-3 with ``reshard_after_forward`` selectable."""

    name = "fsdp"

    @classmethod
    def run_policy(cls, policy: PrecisionPolicy, *, param_dtype=_UNSET, reduce_dtype=_UNSET,
                   output_dtype=_UNSET, cast_forward_inputs=_UNSET, **options) -> PrecisionPolicy:
        # As __init__: FSDP2's MixedPrecisionPolicy fields fold into the policy first.
        policy = map_mixed_precision(policy, param_dtype, reduce_dtype, output_dtype, cast_forward_inputs)
        return super().run_policy(policy, **options)

    def __init__(self, policy: PrecisionPolicy, device: torch.device, *, param_dtype=_UNSET,
                 reduce_dtype=_UNSET, output_dtype=_UNSET, cast_forward_inputs=_UNSET,
                 **options) -> None:
        policy = map_mixed_precision(policy, param_dtype, reduce_dtype, output_dtype, cast_forward_inputs)
        super().__init__(policy, device, **options)

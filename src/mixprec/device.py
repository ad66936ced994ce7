"""The device a run uses: chosen from ``device=`` / ``cpu=``, and checked against the
precision policy before anything is built on it (used by ``Accelerator`` and ``doctor``)."""

from __future__ import annotations

from typing import Union

import torch

from .policy import PrecisionPolicy


def pick_device(device: Union[str, torch.device, None], cpu: bool) -> torch.device:
    """The requested device; CUDA (index chosen from LOCAL_RANK later) unless ``cpu``."""
    if device is not None:
        try:
            return torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"device={device!r} is not a valid torch device: {e}") from None
    if not cpu and torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")


def check_device_supports(device: torch.device, policy: PrecisionPolicy) -> None:
    """Raise a ValueError naming the device and the fix when ``policy`` cannot run there."""
    dtype = policy.compute_dtype
    if dtype == torch.float32 and policy.param_dtype in (None, torch.float32):
        return
    wanted = policy.compute_dtype if policy.compute_dtype != torch.float32 else policy.param_dtype
    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}[wanted]
    fix = "use mixed_precision='no', or another device"
    if not torch.amp.is_autocast_available(device.type):
        raise ValueError(
            f"mixed_precision={policy.name!r} needs {name} autocast, which device {str(device)!r} "
            f"does not support; {fix}"
        )
    if device.type == "cuda" and wanted == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise ValueError(f"{str(device)!r} has no bf16 support; use mixed_precision='fp16' or 'no'")
    try:
        a = torch.ones(4, 4, device=device)
        with torch.autocast(device.type, dtype=wanted):
            out = torch.nn.functional.linear(a, a)
        ok = out.dtype == wanted
    except RuntimeError as e:
        raise ValueError(
            f"mixed_precision={policy.name!r}: {name} matmul under autocast failed on "
            f"{str(device)!r} ({e}); {fix}"
        ) from None
    if not ok:
        raise ValueError(
            f"mixed_precision={policy.name!r}: autocast on {str(device)!r} does not compute in "
            f"{name} (got {out.dtype}); {fix}"
        )

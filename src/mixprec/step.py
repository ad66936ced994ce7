"""What one optimizer step did, reported instead of silently skipped."""

from __future__ import annotations

import math
from typing import Optional

# Why a step did or did not change the weights.
REASONS = ("ok", "overflow", "nonfinite", "accumulating")

# What a non-fp16 step does with non-finite gradients (config field ``nonfinite_grads``).
NONFINITE_POLICIES = ("skip", "raise")


class DeviceScalars:
    """A few 1-element device tensors snapshotted at the end of a step, read without
    stalling the host ([Note: lazy step results]).

    On CPU the snapshot is a clone and is always ready. On an accelerator the values are
    copied, non-blocking, into pinned host memory behind an event: :meth:`ready` asks the
    event (no wait), :meth:`get` waits for it only if it has not completed yet."""

    __slots__ = ("_host", "_event")

    def __init__(self, tensors: dict) -> None:
        import torch

        self._host: dict = {}
        self._event = None
        device = next((t.device for t in tensors.values() if t is not None), None)
        if device is None or device.type != "cuda":
            for name, t in tensors.items():
                self._host[name] = None if t is None else t.detach().to("cpu", copy=True)
            return
        # The copies and the event go on the current stream of the tensors' device, whatever
        # device is current on the host thread: a device-to-host copy runs on its source
        # device's current stream, and an event recorded on another device's stream would
        # say nothing about it.
        with torch.cuda.device(device):
            stream = torch.cuda.current_stream(device)
            for name, t in tensors.items():
                if t is None:
                    self._host[name] = None
                    continue
                if t.device != device:
                    raise ValueError(f"DeviceScalars: {name!r} is on {t.device} but the other values "
                                     f"are on {device}; snapshot one device's values at a time")
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t.detach(), non_blocking=True)
                self._host[name] = host
            self._event = torch.cuda.Event()
            self._event.record(stream)

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def get(self, name: str) -> Optional[float]:
        t = self._host[name]
        if t is None:
            return None
        if self._event is not None:
            self._event.synchronize()
        # A CPU tensor read through numpy: no device, no dispatcher round-trip.
        return float(t.float().numpy().reshape(-1)[0])


class StepResult:
    """Outcome of one ``optimizer.step()`` through mixprec.

    ``stepped``: the weights changed. ``reason``: ``"ok"``, ``"overflow"`` (non-finite
    gradients under fp16 loss scaling: skipped, weights untouched, scale backed off),
    ``"nonfinite"`` (non-finite gradients in bf16/fp32, on any rank: skipped on every
    rank, weights, fp32 masters and optimizer state untouched) or ``"accumulating"``
    (inside ``accumulate()`` before the boundary).
    ``loss_scale``: the scale used for this step (None without loss scaling).
    ``grad_norm``: the pre-clip global norm if ``clip_grad_norm_`` ran this step.

    [Note: lazy step results]
    The step itself never reads a device value: whether it was skipped is decided on the
    device (the fused kernels do nothing when found_inf is set) and the result holds
    snapshots of the flag, the scale and the norm (:class:`DeviceScalars`). The fields are
    read when first asked for, so a loop that never looks at them never waits for the
    device; one that does pays that read then. ``ready()`` says whether reading would wait.
    """

    __slots__ = ("_values", "_skip_reason", "_resolved")

    def __init__(self, stepped: bool, reason: str, loss_scale: Optional[float] = None,
                 grad_norm: Optional[float] = None) -> None:
        assert reason in REASONS, reason
        self._resolved = (bool(stepped), reason,
                          None if loss_scale is None else float(loss_scale),
                          None if grad_norm is None else float(grad_norm))
        self._values = None
        self._skip_reason = None

    @classmethod
    def deferred(cls, values: DeviceScalars, skip_reason: str) -> "StepResult":
        """A result decided on the device: ``values`` holds ``found_inf`` (nonzero: the
        step was skipped for ``skip_reason``), ``loss_scale`` and ``grad_norm``."""
        result = cls.__new__(cls)
        result._values, result._skip_reason, result._resolved = values, skip_reason, None
        return result

    def immediate(self) -> bool:
        """True when the values were known on the host at once (CPU, or decided there)."""
        return self._resolved is not None or self._values._event is None

    def ready(self) -> bool:
        """True when reading the fields will not wait for the device."""
        return self._resolved is not None or self._values.ready()

    def _resolve(self) -> tuple:
        if self._resolved is None:
            v = self._values
            skipped = v.get("found_inf") != 0.0
            self._resolved = (not skipped, self._skip_reason if skipped else "ok",
                              v.get("loss_scale"), v.get("grad_norm"))
            self._values = None
        return self._resolved

    stepped = property(lambda self: self._resolve()[0])
    reason = property(lambda self: self._resolve()[1])
    loss_scale = property(lambda self: self._resolve()[2])
    grad_norm = property(lambda self: self._resolve()[3])

    def as_dict(self) -> dict:
        stepped, reason, loss_scale, grad_norm = self._resolve()
        return {"stepped": stepped, "reason": reason, "loss_scale": loss_scale, "grad_norm": grad_norm}

    def __eq__(self, other) -> bool:
        if not isinstance(other, StepResult):
            return NotImplemented
        return self._resolve() == other._resolve()

    def __hash__(self) -> int:
        return hash(self._resolve())

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.as_dict().items())
        return f"StepResult({fields})"


def check_clip_limit(name: str, value) -> float:
    """``value`` as a float if it is a usable clipping limit (>= 0); otherwise a ValueError
    echoing it. A nan limit would turn every gradient into nan AFTER the non-finite check
    ran, and a negative one flips or zeroes them: both are refused. ``+inf`` is accepted:
    it never clips (``clip_grad_norm_(params, math.inf)`` is the idiom for "the norm only",
    used by src/mixprec/parity.py), and where the norm itself is inf the gradients already
    hold inf/nan, so the step is skipped anyway."""
    try:
        limit = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name}={value!r} must be a number (a finite float >= 0)") from None
    if math.isnan(limit) or limit < 0:
        raise ValueError(
            f"{name}={value!r} is not a usable clipping limit: give a number >= 0 (e.g. 1.0; "
            "math.inf computes the norm without clipping)"
        )
    return limit

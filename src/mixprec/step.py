"""What one optimizer step did, reported instead of silently skipped."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# Why a step did or did not change the weights.
REASONS = ("ok", "overflow", "accumulating")


@dataclass(frozen=True)
class StepResult:
    """Outcome of one ``optimizer.step()`` through mixprec.

    ``stepped``: the weights changed. ``reason``: ``"ok"``, ``"overflow"`` (non-finite
    gradients under loss scaling: skipped, weights untouched, scale backed off) or
    ``"accumulating"`` (inside ``accumulate()`` before the boundary).
    ``loss_scale``: the scale used for this step (None without loss scaling).
    ``grad_norm``: the pre-clip global norm if ``clip_grad_norm_`` ran this step.
    """

    stepped: bool
    reason: str
    loss_scale: Optional[float] = None
    grad_norm: Optional[float] = None

    def __post_init__(self) -> None:
        assert self.reason in REASONS, self.reason

"""Stop fp16 training that overflows step after step, naming the module responsible.

[Note: overflow-storm watch]
A skipped step is normal under dynamic loss scaling; many in a row mean the scale can no
longer save the run (a module's activations exceed fp16's 65504 whatever the scale, or
its gradients do). The watch is a ``PreparedOptimizer.post_step_hooks`` entry: on the happy
path it bumps one counter per real step. When ``budget - 1`` consecutive steps were
skipped it arms :class:`~mixprec.diagnostics.probes.ModuleProbes` for the next step only;
if that step is skipped too (the budget is reached) it raises
:class:`~mixprec.errors.OverflowStormError` with the first module whose output (forward
order) or output gradient (backward order) was non-finite. A step that succeeds disarms
the probes. The skip decision is agreed across ranks (see [Note: found_inf agreement]),
so every rank reaches the budget at the same step and raises; the ranks' findings are
all-gathered then, once, to say which ranks saw the non-finite values.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

from torch import nn

from ..errors import OverflowStormError
from .probes import FP16_MAX, ModuleProbes, TensorStat, first_culprit

if TYPE_CHECKING:
    from ..distributed.state import DistributedState
    from ..step import StepResult
    from ..wrappers.optimizer import PreparedOptimizer


@dataclass(frozen=True)
class OverflowReport:
    """Why training was stopped: ``culprit`` (first module with a non-finite or overflowing
    output, else with a non-finite output gradient; None if no module showed one),
    ``ranks`` that saw it, the ``loss_scales`` used by the skipped steps (oldest first),
    the scale now, and the ``fixes``."""

    consecutive: int
    budget: int
    culprit: Optional[TensorStat]
    ranks: tuple[int, ...]
    world_size: int
    loss_scales: tuple[Optional[float], ...]
    current_scale: Optional[float]
    probed: bool  # probes were armed for the last step (False: budget of 1)
    fixes: tuple[str, ...]

    def __str__(self) -> str:
        lines = [
            f"fp16 overflow storm: {self.consecutive} optimizer steps in a row were skipped "
            f"(max_consecutive_overflows={self.budget}); training was stopped, the weights are "
            "those of the last good step."
        ]
        if self.culprit is not None:
            where = ("output" if self.culprit.kind == "output"
                     else "output gradient (first in backward order)")
            lines.append(
                f"First module with a non-finite/overflowing {where}: {self.culprit.display}"
            )
            lines.append(f"  {self.culprit.describe()}")
            if self.world_size > 1:
                lines.append(f"  seen on rank(s) {list(self.ranks)} of {self.world_size}")
        elif self.probed:
            lines.append(
                "No module output or output gradient was non-finite in the probed step: the "
                "overflow happens outside the modules (the loss, or a custom autograd function)."
            )
        else:
            lines.append(
                "No module was probed (max_consecutive_overflows=1 stops before a probed step)."
            )
        scales = " -> ".join("-" if s is None else f"{s:g}" for s in self.loss_scales)
        now = "-" if self.current_scale is None else f"{self.current_scale:g}"
        lines.append(f"Loss scale of the skipped steps: {scales} (now {now})")
        lines.append("Fixes:")
        lines.extend(f"  - {fix}" for fix in self.fixes)
        return "\n".join(lines)


def _fixes(culprit: Optional[TensorStat], budget: int) -> tuple[str, ...]:
    fixes = []
    if culprit is not None and culprit.module:
        fixes.append(
            f"keep {culprit.module!r} in fp32: Accelerator(keep_fp32_modules=[{culprit.module!r}]) "
            f"(fp16 cannot hold magnitudes above {FP16_MAX:g})"
        )
    fixes.append(
        "use mixed_precision='bf16' where the device supports it (fp32's exponent range: no loss "
        "scaling, no overflow at 65504)"
    )
    if culprit is not None and culprit.kind == "grad":
        fixes.append("check the loss: its gradient overflows fp16 before any module's output does")
    fixes.append(
        f"max_consecutive_overflows={budget} is the budget of skipped steps in a row; raise it "
        "(or set None) only if the overflows are expected to stop"
    )
    return tuple(fixes)


def check_overflow_budget(budget: Optional[int]) -> None:
    """Raise a ValueError naming ``budget`` unless it is None or an int >= 1."""
    if budget is None:
        return
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(
            f"max_consecutive_overflows={budget!r} must be an int >= 1, or None to never stop "
            "on repeated fp16 overflows"
        )


class OverflowWatch:
    """Counts consecutive overflow-skipped steps of one optimizer (see the Note above).

    Register ``watch.after_step`` in ``PreparedOptimizer.post_step_hooks``.
    """

    def __init__(self, budget: int, models: list[nn.Module], state: "DistributedState",
                 loss_scale: Callable[[], Optional[float]]) -> None:
        check_overflow_budget(budget)
        assert budget is not None
        self.budget = budget  # skipped steps in a row that stop training
        self.models = models  # the accelerator's prepared models (live list)
        self.state = state  # for the one all-gather of findings when raising
        self.loss_scale = loss_scale  # the scaler's current scale
        self.consecutive = 0  # overflow-skipped steps in a row so far
        self.scales: deque[Optional[float]] = deque(maxlen=budget)  # scales of those steps
        self.probes = ModuleProbes()
        self.pending: deque = deque()  # results not looked at yet (accelerators: one step late)

    def after_step(self, optimizer: "PreparedOptimizer", result: "StepResult") -> None:
        # Results are decided on the device ([Note: lazy step results] in step.py). On CPU
        # they are known at once; on an accelerator each step looks at the previous step's
        # result, which has long arrived by then, so the watch never stalls the device
        # queue and every rank still sees the same step at the same call.
        self.pending.append(result)
        while self.pending and (self.pending[0].immediate() or len(self.pending) > 1):
            self._account(self.pending.popleft())

    def _account(self, result: "StepResult") -> None:
        if result.reason != "overflow":
            if self.consecutive:
                self.consecutive = 0
                self.scales.clear()
                self.probes.disarm()
            return
        self.consecutive += 1
        self.scales.append(result.loss_scale)
        if self.consecutive >= self.budget:
            report = self._report()
            self.probes.disarm()
            self.consecutive = 0
            self.scales.clear()
            raise OverflowStormError(str(report), report)
        if self.consecutive >= self.budget - 1:
            self.probes.arm(self.models)

    def _report(self) -> OverflowReport:
        from ..distributed import collectives

        probed = self.probes.armed
        mine = first_culprit(self.probes.records()) if probed else None
        found = collectives.gather_object(self.state, [mine])  # one collective, every rank is here
        ranks = tuple(r for r, c in enumerate(found) if c is not None)
        culprit = found[ranks[0]] if ranks else None
        return OverflowReport(
            consecutive=self.consecutive, budget=self.budget, culprit=culprit, ranks=ranks,
            world_size=len(found), loss_scales=tuple(self.scales),
            current_scale=self.loss_scale(), probed=probed, fixes=_fixes(culprit, self.budget),
        )

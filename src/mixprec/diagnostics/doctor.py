"""``mixprec.doctor()``: a one-step dry run listing what mixed precision will do to a model.

The model is deep-copied, prepared on the copy exactly as ``Accelerator.prepare`` would
(single process), and run forward and backward once on the batch with module probes and an
aten-op recorder (no optimizer step, the caller's RNG state restored). Findings:

=====================  ========  ==================================================
kind                   severity  what
=====================  ========  ==================================================
``mixed_param_dtypes`` warning   a module whose parameters come in several dtypes, or
                                 in another dtype than the rest of the model
``uncast_buffers``     info      floating buffers the policy does not cast (BatchNorm
                                 running statistics) and what that means
``fp32_ops``           info      aten ops that got fp32 inputs under autocast
``no_lowp_kernel``     warning   ops that have no bf16/fp16 kernel on this device
``nonfinite_output``   warning   modules whose output was non-finite (or, fp16, above
                                 65504)
``nonfinite_grad``     warning   modules whose output gradient was non-finite
``dtype_error``        error     forward raised a dtype error (module path, dtypes)
``forward_error``      error     forward or backward raised another error
=====================  ========  ==================================================
"""

from __future__ import annotations

import contextlib
import copy
import logging
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from ..errors import MixprecDtypeError
from ..policy import PrecisionPolicy, dtype_name
from ..utils import LOW_PRECISION, send_to_device
from .locate import failing_module
from .ops import OpRecorder
from .probes import FP16_MAX, ModuleProbes

SEVERITIES = ("info", "warning", "error")
_LISTED = 12  # ops listed by name in one finding


@dataclass(frozen=True)
class Finding:
    """One thing ``doctor()`` found: ``kind`` (see the module docstring), ``severity``
    (``"info"``, ``"warning"``, ``"error"``), the ``module`` path it is about (None: the
    whole model or an op), a one-paragraph ``message`` with what it means, the ``fix`` (may
    be empty) and machine-readable ``details``."""

    kind: str
    severity: str
    module: Optional[str]
    message: str
    fix: str = ""
    details: dict = field(default_factory=dict)

    def __str__(self) -> str:
        text = f"[{self.severity}] {self.kind}: {self.message}"
        return text + (f"\n    fix: {self.fix}" if self.fix else "")


@dataclass(frozen=True)
class DoctorReport:
    """What ``doctor()`` found; ``print(report)`` for a readable summary."""

    policy: str  # the policy's one-line description
    device: str
    findings: list[Finding]

    @property
    def ok(self) -> bool:
        """No warning and no error."""
        return all(f.severity == "info" for f in self.findings)

    def of_kind(self, kind: str) -> list[Finding]:
        return [f for f in self.findings if f.kind == kind]

    def __str__(self) -> str:
        lines = [f"mixprec doctor on {self.device}: {self.policy}"]
        if not self.findings:
            lines.append("  nothing to report")
        order = {s: i for i, s in enumerate(reversed(SEVERITIES))}
        for f in sorted(self.findings, key=lambda f: order[f.severity]):
            lines.append("  " + str(f).replace("\n", "\n  "))
        return "\n".join(lines)


# ------------------------------------------------------------------ static checks
def _param_findings(model: nn.Module, policy: PrecisionPolicy) -> list[Finding]:
    counts: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.is_floating_point():
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    if not counts:
        return []
    dominant = max(counts, key=counts.get)
    out = []
    for path, module in model.named_modules():
        own = {n: p.dtype for n, p in module.named_parameters(recurse=False)
               if p.is_floating_point()}
        kinds = set(own.values())
        if not own or kinds == {dominant}:
            continue
        listed = ", ".join(f"{n}={dtype_name(d)}" for n, d in own.items())
        where = f"{path or '<root>'!r} ({type(module).__name__})"
        if len(kinds) > 1:
            what = f"module {where} has parameters in several dtypes: {listed}"
        else:
            what = (f"module {where} stores {dtype_name(next(iter(kinds)))} parameters ({listed}) "
                    f"while the model is {dtype_name(dominant)}")
        if policy.param_dtype is not None:
            then = (f"prepare() stores trainable parameters in {dtype_name(policy.param_dtype)} "
                    "(frozen ones keep their dtype)")
        else:
            then = "prepare() keeps these dtypes and adds fp32 masters for low-precision ones"
        out.append(Finding(
            "mixed_param_dtypes", "warning", path,
            f"{what}. An op that meets them outside autocast raises a dtype error (e.g. 'mat1 "
            f"and mat2 must have the same dtype'); {then}.",
            "remove the manual .half()/.to(dtype) on these parameters and let the policy cast "
            "storage (param_dtype=...), or keep the module in fp32 with keep_fp32_modules",
            {"dtypes": {n: dtype_name(d) for n, d in own.items()},
             "model_dtype": dtype_name(dominant)},
        ))
    return out


def _buffer_findings(model: nn.Module, policy: PrecisionPolicy) -> list[Finding]:
    low = policy.compute_dtype if policy.autocast_enabled else policy.param_dtype
    if low is None or low == torch.float32:
        return []  # nothing is low precision: buffers meet fp32 everywhere
    out = []
    for path, module in model.named_modules():
        own = {n: b.dtype for n, b in module.named_buffers(recurse=False)
               if b.is_floating_point()}
        if not own:
            continue
        listed = ", ".join(f"{n}={dtype_name(d)}" for n, d in own.items())
        where = f"{path or '<root>'!r} ({type(module).__name__})"
        norm = isinstance(module, nn.modules.batchnorm._NormBase)
        if norm:
            meaning = (
                "the running statistics keep this dtype whatever the activations' dtype "
                f"(batch_norm accepts {dtype_name(low)} inputs with fp32 statistics): intended, "
                "the statistics stay accurate; do not cast them by hand"
            )
        else:
            meaning = (
                f"ops that combine them with {dtype_name(low)} activations outside autocast will "
                "raise a dtype error or promote to fp32"
            )
        if policy.param_dtype in LOW_PRECISION:
            meaning += (f"; parameters are stored in {dtype_name(policy.param_dtype)} but these "
                        "are not")
        out.append(Finding(
            "uncast_buffers", "info", path,
            f"module {where}: floating buffer(s) {listed} are not cast by "
            f"mixed_precision={policy.name!r} (only trainable parameters are): {meaning}.",
            "" if norm else "cast them where used (buf.to(x.dtype)) or keep the module in fp32",
            {"dtypes": {n: dtype_name(d) for n, d in own.items()}},
        ))
    return out


# ----------------------------------------------------------------- dynamic checks
class _ModuleTracker:
    """The innermost module running (for naming the module that called an op)."""

    def __init__(self) -> None:
        self.stack: list[str] = []
        self.phase = "forward"
        self._handles: list = []

    def install(self, model: nn.Module) -> None:
        for name, module in model.named_modules():
            self._handles.append(module.register_forward_pre_hook(self._enter(name)))
            self._handles.append(module.register_forward_hook(self._leave, always_call=True))

    def _enter(self, name: str):
        def hook(module: nn.Module, args: tuple) -> None:
            self.stack.append(name)

        return hook

    def _leave(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self.stack:
            self.stack.pop()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def where(self) -> Optional[str]:
        return self.stack[-1] if self.stack and self.phase == "forward" else None


def _split_batch(batch: Any) -> tuple[tuple, dict]:
    if isinstance(batch, dict):
        return (), dict(batch)
    if isinstance(batch, (tuple, list)):
        return tuple(batch), {}
    return (batch,), {}


def _scalar(out: Any) -> Optional[torch.Tensor]:
    """Something to call backward on: a ``loss`` entry if the output has one, else the sum of
    every floating output that requires grad."""
    loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.requires_grad and loss.numel() == 1:
        return loss.float().reshape(())
    parts = [t.float().sum() for t in tree_leaves(out)
             if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
    return torch.stack(parts).sum() if parts else None


def _error_finding(error: BaseException, model: nn.Module, phase: str) -> Finding:
    if isinstance(error, MixprecDtypeError):
        return Finding(
            "dtype_error", "error", error.module_path, str(error).split("\nSuggested fix:")[0],
            "; ".join(error.fixes),
            {"module_type": error.module_type, "original": error.original,
             "params": {n: dtype_name(d) for n, d in error.param_dtypes.items()},
             "buffers": {n: dtype_name(d) for n, d in error.buffer_dtypes.items()},
             "inputs": {n: dtype_name(d) for n, d in error.input_dtypes.items()}},
        )
    where = failing_module(error, model)
    path = where.path if where is not None else None
    place = f" in module {where.display}" if where is not None else ""
    return Finding("forward_error", "error", path,
                   f"{phase} raised {type(error).__name__}{place}: {error}", "",
                   {"type": type(error).__name__, "phase": phase})


def _op_findings(recorder: OpRecorder, policy: PrecisionPolicy,
                 device: torch.device) -> list[Finding]:
    if not policy.autocast_enabled:
        return []
    low = dtype_name(policy.compute_dtype)
    out = []
    for use in recorder.ops.values():
        if use.no_kernel:
            where = (f" (first called in {use.module!r})" if use.module is not None
                     else f" ({use.phase})")
            fix = (f"keep_fp32_modules=[{use.module!r}] if you cast inputs yourself" if use.module
                   else "leave its inputs in fp32")
            out.append(Finding(
                "no_lowp_kernel", "warning", use.module,
                f"aten.{use.name}{where} ran in fp32 and has no {low} kernel on {device.type}: "
                f"{use.no_kernel}. It works under autocast only because its inputs stay fp32; "
                f"casting them (or parameters) to {low} breaks it.",
                fix, {"op": use.name, "error": use.no_kernel, "phase": use.phase},
            ))
    fp32 = [u for u in recorder.ops.values() if u.calls.get("fp32")]
    if fp32:
        names = ", ".join(f"{u.name}x{u.calls['fp32']}" for u in fp32[:_LISTED])
        more = f" (+{len(fp32) - _LISTED} more)" if len(fp32) > _LISTED else ""
        out.append(Finding(
            "fp32_ops", "info", None,
            f"{len(fp32)} aten op(s) got fp32 inputs under {low} autocast (autocast's fp32 list, "
            f"fp32 regions, or fp32 tensors made inside forward): {names}{more}.",
            "", {"ops": {u.name: u.calls["fp32"] for u in fp32}},
        ))
    return out


def _contains(outer: str, inner: str) -> bool:
    return outer == "" or inner == outer or inner.startswith(outer + ".")


def _probe_findings(probes: ModuleProbes, policy: PrecisionPolicy) -> list[Finding]:
    """Modules where non-finite values start: outputs that are non-finite (or, fp16, above
    65504) although their inputs were not, not counting the modules around one already
    listed; gradients only when every output was finite (the first in backward order)."""
    fp16 = policy.compute_dtype == torch.float16 or policy.param_dtype == torch.float16
    records = probes.records()
    fix_tail = " or mixed_precision='bf16'" if fp16 else ""
    out: list[Finding] = []
    listed: list[str] = []
    for r in (r for r in records if r.kind == "output"):
        bad = r.nonfinite > 0 or (fp16 and r.max_abs > FP16_MAX)
        inherited = r.input_nonfinite > 0 or (fp16 and r.input_max_abs > FP16_MAX)
        if not bad or inherited or any(_contains(r.module, inner) for inner in listed):
            continue
        listed.append(r.module)
        out.append(Finding("nonfinite_output", "warning", r.module, r.describe(),
                           f"keep_fp32_modules=[{r.module!r}]{fix_tail}" if r.module else "",
                           {"nonfinite": r.nonfinite, "max_abs": r.max_abs, "dtype": r.dtype}))
    if not out:
        for r in (r for r in records if r.kind == "grad" and r.nonfinite):
            out.append(Finding("nonfinite_grad", "warning", r.module, r.describe(),
                               "check the loss and this module's backward" + fix_tail,
                               {"nonfinite": r.nonfinite, "max_abs": r.max_abs, "dtype": r.dtype}))
            break
    return out


@contextlib.contextmanager
def _quiet_prepare():
    # prepare() logs about fp32 masters it adds; the doctor reports that as a finding.
    log = logging.getLogger("mixprec")
    previous = log.disabled
    log.disabled = True
    try:
        yield
    finally:
        log.disabled = previous


def doctor(
    model: nn.Module,
    batch: Any,
    mixed_precision: str = "bf16",
    device: Union[str, torch.device, None] = None,
    *,
    keep_fp32_modules: tuple[str, ...] = (),
) -> DoctorReport:
    """Dry-run one forward and backward of ``model`` on ``batch`` under ``mixed_precision``
    and report what to look at (see the module docstring for the findings).

    ``batch``: a tensor (one positional input), a tuple/list (positional inputs) or a dict
    (keyword inputs). ``model`` is deep-copied: its parameters, buffers, gradients and the
    caller's RNG state are untouched; nothing steps. A failing forward is reported, not
    raised.

    Example::

        report = mixprec.doctor(model, (x,), mixed_precision="bf16")
        print(report)
        if not report.ok: ...
    """
    from ..device import check_device_supports, pick_device as _pick_device
    from ..engines.base import Engine
    from ..wrappers.model import AutocastGate, is_prepared

    if not isinstance(model, nn.Module):
        raise TypeError(f"doctor() needs a torch.nn.Module, got {type(model).__name__}")
    if any(is_prepared(m) for m in model.modules()):
        raise ValueError(
            f"doctor() got a {type(model).__name__} that accelerator.prepare() already wrapped; "
            "run doctor on the model before prepare()"
        )
    policy = PrecisionPolicy.from_mixed_precision(
        mixed_precision, keep_fp32_modules=tuple(keep_fp32_modules)
    )
    dev = _pick_device(device, cpu=False)
    check_device_supports(dev, policy)
    findings = _param_findings(model, policy) + _buffer_findings(model, policy)

    work = copy.deepcopy(model)
    with _quiet_prepare():
        Engine(policy, dev, fused_optimizer=False).prepare_model(work, AutocastGate())
    args, kwargs = send_to_device(_split_batch(batch), dev)
    tracker = _ModuleTracker()
    recorder = OpRecorder(policy.compute_dtype if policy.autocast_enabled else None,
                          tracker.where, lambda: tracker.phase)
    probes = ModuleProbes(quiet=recorder.paused)  # the probes' own ops are not the model's
    probes.arm([work])
    tracker.install(work)
    devices = [dev.index or 0] if dev.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), recorder:
            phase = "forward"
            try:
                out = work(*args, **kwargs)
                with recorder.paused():
                    loss = _scalar(out)
                phase = tracker.phase = "backward"
                if loss is not None:
                    loss.backward()
            except Exception as error:  # noqa: BLE001 - reported, never raised (see docstring)
                findings.append(_error_finding(error, work, phase))
        findings += _probe_findings(probes, policy) + _op_findings(recorder, policy, dev)
    finally:
        probes.disarm()
        tracker.remove()
    return DoctorReport(policy.describe(), str(dev), findings)

"""The cross-backend precision parity check: the same loop on every backend, compared step by
step with a single-process fp32 reference.

A user feature (is my configuration numerically sound on this backend?) and the project's
own guard (every engine must agree with every other one).

Example::

    report = mixprec.parity_check(make_model, make_batch, backends=["single", "ddp"],
                                  steps=10, mixed_precision="bf16")
    print(report.format())
    assert report.passed
"""

from __future__ import annotations

import importlib
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from .distributed.spawn import run_distributed


@dataclass(frozen=True, kw_only=True)
class ParityTolerance:
    """Largest relative divergence from the fp32 reference allowed at any step."""

    loss_rtol: float
    """|loss - loss_ref| / |loss_ref|."""
    grad_norm_rtol: float
    """|norm - norm_ref| / norm_ref (pre-clip global gradient norm)."""


# [Note: parity tolerances] fp32 backends must agree to fp32 rounding. Measured on the demo
# transformer (AdamW, 20 steps): bf16 with fp32 masters stays within 1.2e-3 (loss) and 2.4e-3
# (grad norm) of fp32; bf16 WITHOUT masters drifts to 2e-2 / 5e-2 by step 20, because
# updates below half a bf16 ulp are lost. The bf16 bounds sit 4x above the first and 4x
# below the second, so the check passes sound configurations and catches that broken one.
# fp16 (11 mantissa bits) measured 1.3e-4 / 4e-4.
DEFAULT_TOLERANCES = {
    "no": ParityTolerance(loss_rtol=1e-5, grad_norm_rtol=1e-4),
    "bf16": ParityTolerance(loss_rtol=5e-3, grad_norm_rtol=1e-2),
    "bf16-pure": ParityTolerance(loss_rtol=5e-3, grad_norm_rtol=1e-2),
    "fp16": ParityTolerance(loss_rtol=2e-3, grad_norm_rtol=5e-3),
}


@dataclass(frozen=True)
class BackendTrace:
    """What one backend did: the global mean loss and gradient norm of every step."""

    backend: str
    world_size: int
    mixed_precision: str
    losses: list[float]
    grad_norms: list[float]
    skipped_steps: int


@dataclass
class ParityReport:
    """Per-step divergence of each backend from the fp32 single-process reference."""

    reference: BackendTrace
    traces: list[BackendTrace]
    tolerance: ParityTolerance
    divergence: dict[str, list[tuple[float, float]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for trace in self.traces:
            self.divergence[trace.backend] = [
                (_rel(l, rl), _rel(n, rn))
                for l, rl, n, rn in zip(trace.losses, self.reference.losses, trace.grad_norms, self.reference.grad_norms)
            ]

    def backend_passed(self, backend: str) -> bool:
        t = self.tolerance
        return all(dl <= t.loss_rtol and dn <= t.grad_norm_rtol for dl, dn in self.divergence[backend])

    @property
    def passed(self) -> bool:
        return all(self.backend_passed(b) for b in self.divergence)

    def format(self) -> str:
        """A table: per backend, the worst divergence and the step it happened at, and pass/fail."""
        t = self.tolerance
        lines = [
            f"parity vs single-process fp32 reference ({len(self.reference.losses)} steps); "
            f"tolerance: loss {t.loss_rtol:g}, grad norm {t.grad_norm_rtol:g} (relative)",
            f"{'backend':<10} {'procs':>5} {'precision':<10} {'max loss div':>13} {'max norm div':>13} {'skipped':>7}  result",
        ]
        for trace in self.traces:
            div = self.divergence[trace.backend]
            worst_l = max(range(len(div)), key=lambda i: div[i][0])
            worst_n = max(range(len(div)), key=lambda i: div[i][1])
            lines.append(
                f"{trace.backend:<10} {trace.world_size:>5} {trace.mixed_precision:<10} "
                f"{div[worst_l][0]:>9.2e} @{worst_l:<2} {div[worst_n][1]:>9.2e} @{worst_n:<2} "
                f"{trace.skipped_steps:>7}  {'PASS' if self.backend_passed(trace.backend) else 'FAIL'}"
            )
        return "\n".join(lines)


def _rel(value: float, ref: float) -> float:
    if math.isnan(value) or math.isnan(ref):
        return math.inf
    return abs(value - ref) / max(abs(ref), 1e-12)


def _default_optimizer(params):
    return torch.optim.AdamW(params, lr=1e-3)


def _default_loss(output, target):
    """[Note: the parity loss] Without ``loss_fn`` (and in ``mixprec parity`` without
    ``--loss``) every backend and the reference minimise the mean squared error between the
    model's output and the batch's targets, both taken in fp32:
    ``mse_loss(model(inputs).float(), targets.float())`` (mean over every element). The
    targets must have the output's shape: a broadcasting MSE would train on a wrong loss
    without a word, so :func:`_check_batch` refuses it first."""
    return nn.functional.mse_loss(output.float(), target.float())


def _name(fn: Callable) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def _check_batch(model_fn: Callable, batch_fn: Callable, loss_fn: Callable, world_size: int) -> None:
    """One fp32 forward in this process on ``batch_fn(0)`` before any rank is spawned, so a
    batch of the wrong form or shape is named here, once, with the function that made it
    (instead of one traceback per spawned rank)."""
    fn = _name(batch_fn)
    batch = batch_fn(0)
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2
            and all(isinstance(t, torch.Tensor) for t in batch)):
        raise ValueError(f"{fn}(0) returned {type(batch).__name__}{_describe(batch)}; make_batch (--batch) "
                         f"must return a tuple (inputs, targets) of two tensors, batch dimension first")
    inputs, targets = batch
    if inputs.dim() == 0 or targets.dim() == 0 or inputs.shape[0] != targets.shape[0]:
        raise ValueError(f"{fn}(0) returned inputs of shape {tuple(inputs.shape)} and targets of shape "
                         f"{tuple(targets.shape)}; make_batch (--batch) must return both with the same batch "
                         f"dimension (dim 0), the samples of one global step")
    if inputs.shape[0] % world_size:
        raise ValueError(f"{fn}(0) returned a batch of {inputs.shape[0]} samples, which {world_size} processes "
                         f"cannot split evenly; make_batch (--batch) must return a multiple of {world_size}")
    model = model_fn()
    try:
        with torch.no_grad():
            output = model(inputs)
    except (RuntimeError, ValueError, IndexError, TypeError) as e:
        raise ValueError(f"the model from {_name(model_fn)}() rejected the inputs of {fn}(0) (shape "
                         f"{tuple(inputs.shape)}, {inputs.dtype}): {str(e).splitlines()[0]}; make_batch "
                         f"(--batch) must return inputs that model(inputs) accepts") from e
    if loss_fn is _default_loss and isinstance(output, torch.Tensor) and output.shape != targets.shape:
        raise ValueError(f"the model's output has shape {tuple(output.shape)} but the targets of {fn}(0) have "
                         f"shape {tuple(targets.shape)}; make_batch (--batch) must return targets of the "
                         f"output's shape for the default MSE loss ([Note: the parity loss] in "
                         f"mixprec/parity.py), or pass loss_fn= (--loss)")


def _describe(obj) -> str:
    if isinstance(obj, (tuple, list)):
        return " (" + ", ".join(type(x).__name__ for x in obj) + ")"
    return ""


def _run_backend(state, backend, mixed_precision, model_fn, batch_fn, optimizer_fn, loss_fn, steps, seed):
    from .accelerator import Accelerator

    torch.manual_seed(seed)
    model = model_fn()
    optimizer = optimizer_fn(model.parameters())
    acc = Accelerator(mixed_precision=mixed_precision, backend=backend, cpu=True, log_policy=False)
    model, optimizer = acc.prepare(model, optimizer)
    losses, norms = [], []
    for step in range(steps):
        inputs, targets = batch_fn(step)
        if inputs.shape[0] % acc.num_processes:
            raise ValueError(
                f"batch_fn({step}) returned a batch of {inputs.shape[0]} samples, which "
                f"{acc.num_processes} processes cannot split evenly; return a multiple of {acc.num_processes}"
            )
        x = inputs.chunk(acc.num_processes)[acc.process_index].to(acc.device)
        y = targets.chunk(acc.num_processes)[acc.process_index].to(acc.device)
        loss = loss_fn(model(x), y)
        acc.backward(loss)
        norm = acc.clip_grad_norm_(model.parameters(), math.inf)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(acc.reduce(loss.detach().float(), "mean")))
        norms.append(float(norm))
    return losses, norms, acc.skipped_steps


def parity_check(
    model_fn: Callable[[], nn.Module],
    batch_fn: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    backends: Sequence[str] = ("single", "ddp"),
    *,
    steps: int = 10,
    mixed_precision: str = "bf16",
    world_size: int = 2,
    optimizer_fn: Optional[Callable] = None,
    loss_fn: Optional[Callable] = None,
    tolerance: Optional[ParityTolerance] = None,
    seed: int = 0,
    timeout: float = 900,
) -> ParityReport:
    """Run the same loop on each backend (spawning its processes) and compare every step with
    a single-process fp32 run. ``model_fn``, ``batch_fn`` (step -> global ``(inputs,
    targets)``), ``optimizer_fn`` and ``loss_fn`` must be picklable (module-level).
    ``loss_fn(output, targets)`` defaults to the fp32 MSE ([Note: the parity loss]); the
    first batch is checked in this process before any rank starts (a wrong shape raises
    ``ValueError`` naming ``batch_fn``)."""
    from .engines import BACKEND_NAMES, ENGINES

    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r} must be an int >= 1")
    for b in backends:
        if b not in ENGINES:
            valid = [n for n in BACKEND_NAMES if n != "auto"]
            raise ValueError(f"backend {b!r} is not one of {valid}")
    if tolerance is None:
        if mixed_precision not in DEFAULT_TOLERANCES:
            raise ValueError(f"mixed_precision={mixed_precision!r}: no default tolerance; pass tolerance=")
        tolerance = DEFAULT_TOLERANCES[mixed_precision]
    optimizer_fn = optimizer_fn or _default_optimizer
    loss_fn = loss_fn or _default_loss
    _check_batch(model_fn, batch_fn, loss_fn, world_size if any(ENGINES[b].distributed for b in backends) else 1)
    common = (model_fn, batch_fn, optimizer_fn, loss_fn, steps, seed)

    def run(backend, precision):
        procs = world_size if ENGINES[backend].distributed else 1
        (losses, norms, skipped), *_ = run_distributed(
            _run_backend, procs, args=(backend, precision, *common), timeout=timeout
        )
        return BackendTrace(backend, procs, precision, losses, norms, skipped)

    reference = run("single", "no")
    traces = [run(b, mixed_precision) for b in backends]
    return ParityReport(reference=reference, traces=traces, tolerance=tolerance)


# ---- a built-in model for `mixprec parity --demo` and the test suite -------------
class DemoTransformer(nn.Module):
    """A two-layer transformer regressor on token ids."""

    def __init__(self, vocab: int = 64, dim: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, 4, 2 * dim, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(dim, 4)

    def forward(self, ids):
        return self.head(self.encoder(self.embed(ids)).mean(dim=1))


def demo_model() -> nn.Module:
    torch.manual_seed(0)
    return DemoTransformer()


def demo_batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, 64, (8, 12), generator=g), torch.randn(8, 4, generator=g)


def load_callable(spec: str) -> Callable:
    """``"package.module:function"`` -> the function (for the CLI)."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"{spec!r} is not 'module:function' (e.g. 'mytrain:make_model')")
    try:
        imported = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module.split(".")[0] and e.name != module:
            raise  # the module exists; something it imports is missing
        raise ValueError(f"{spec!r}: no module named {module!r} in the current folder ({os.getcwd()}) or on "
                         f"sys.path; run from the folder holding {module.replace('.', '/')}.py, or add its "
                         f"folder to PYTHONPATH") from None
    obj = getattr(imported, name, None)
    if not callable(obj):
        raise ValueError(f"{spec!r}: {module} has no callable {name!r}")
    return obj


__all__ = ["BackendTrace", "ParityReport", "ParityTolerance", "parity_check"]


# ---- `mixprec parity` --------------------------------------------------------------
def add_arguments(parser) -> None:
    """Arguments of ``mixprec parity``."""
    parser.add_argument("--model", help="module:function returning the model (default: built-in demo)")
    parser.add_argument("--batch", help="module:function(step) returning the global (inputs, targets) of a step")
    parser.add_argument("--loss", help="module:function(output, targets) returning the loss (default: "
                                       "mse_loss(output.float(), targets.float()), mean over elements)")
    parser.add_argument("--backends", default="single,ddp", help="comma-separated backends to check")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--mixed-precision", default="bf16")
    parser.add_argument("--world-size", type=int, default=2, help="processes for multi-process backends")


def run_cli(args) -> int:
    """Run the check from parsed arguments; exit code 0 when every backend passes."""
    if bool(args.model) != bool(args.batch):
        raise SystemExit("mixprec parity: give both --model and --batch, or neither (built-in demo)")
    # `mixprec parity --model mytrain:make_model` names a module of the current folder, as
    # `python -m` would find it (a console script's sys.path[0] is its bin/ folder instead).
    # The spawned ranks inherit this sys.path (multiprocessing's spawn preparation data).
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        model_fn = load_callable(args.model) if args.model else demo_model
        batch_fn = load_callable(args.batch) if args.batch else demo_batch
        loss_fn = load_callable(args.loss) if args.loss else None
        backends = [b.strip() for b in args.backends.split(",") if b.strip()]
        report = parity_check(model_fn, batch_fn, backends, steps=args.steps, loss_fn=loss_fn,
                              mixed_precision=args.mixed_precision, world_size=args.world_size)
    except ValueError as e:
        print(f"mixprec parity: error: {e}", file=sys.stderr)
        return 2
    print(report.format())
    return 0 if report.passed else 1

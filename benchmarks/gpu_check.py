"""The checks of `make gpu-check` (.ci/gpu_check.sh builds mixprec with CUDA, runs the CUDA
tests, then this), and their CPU twin, run by tests/test_gpu_check.py in `make test`.

    python benchmarks/gpu_check.py --device cuda --report gpu-check-report.md   # needs a GPU
    python benchmarks/gpu_check.py --device cpu --quick                         # the CPU twin

``--device cuda`` runs mixprec on the GPU and judges it against references (float64 on the
CPU, fp32 and torch autocast on the GPU); ``--device cpu`` runs the very same code with the
CPU as the device, so every check, its bounds and its negative controls are exercised
without a GPU. Exit status: 0 all checks passed, 1 a check failed (or a section raised, or
the time budget ran out), 2 ``--device cuda`` without a CUDA device.

Sections (``--only``), each timed ("phase ...: N s"):

1. ``train``: per backend single/ddp/zero1/zero2/zero3/fsdp and precision bf16/fp16, at
   world 1 and world 2 (Gloo; on one GPU both ranks share it), STEPS steps of TinyLM; every
   parameter's update and optimizer state tensor is judged against a float64 run ([Note:
   the training verdict]). Negative controls: every case's own result, perturbed as a broken
   optimizer would leave it (PERTURBATIONS), must FAIL the same verdict, or the case fails;
   ``--broken`` also trains with really broken optimizers (BROKEN), each of which must fail.
   Host syncs: after WARMUP steps each world-1 step runs under
   ``torch.cuda.set_sync_debug_mode("error")`` and mixprec's ScalarReads
   (src/mixprec/diagnostics/syncs.py, which counts the same reads on the CPU): none allowed.
   World 2 on one GPU goes through Gloo, which stages CUDA tensors through the host: not judged.
2. ``kernels``: each ``mixprec.kernels`` function against torch's equivalent (bitwise where
   the arithmetic is the same, else the stated tolerance), and timed against torch's foreach
   op (GB/s and the speed ratio, with issue 23's G6 target of 0.8: a report).
3. ``perf``: per backend at world 1, a larger TinyLM: peak allocated memory
   (``torch.cuda.max_memory_allocated``; on the CPU twin the OS resident peak) against plain
   AMP (torch autocast, fp32 weights, ``AdamW(fused=True)``, GradScaler for fp16), and step
   time against that same torch at its best; per rank at world 2 the peak memory (bf16). A
   report: ratios, never pass/fail; but a measurement that raises or reads nothing fails.

[Note: the training verdict]
What is compared. For each parameter t, three quantities after N steps: its update
p_N - p_0 (fp32 master), exp_avg and exp_avg_sq, each as a whole tensor X, and its distance
from a float64 run, relative to the tensor's own size:

    e(X) = ||X - X64|| / ||X64||.

X64 is plain torch in float64 on the CPU (same initial weights, same batches, same clip and
AdamW; at world W the W ranks' batches are W micro-batches of one step, the loss of each
divided by W, which is what averaging the ranks' gradients computes). Step counters must
all equal N (a skipped fp16 step is reported, not excused: the references take all N).

Why not a bound from u and N alone. An a-priori bound such as 8uN (the previous one) is
far from what runs do, both ways: with N=8 it allowed 0.25 in bf16, where a run whose
updates are all 15% too large or whose biases are not updated at all stays inside it, and
0.031 in fp16, below what a correct fp16 run shows (up to 0.1 on one tensor). Even plain
fp32 is far from float64 here: updates e = 2e-5 .. 1.6e-2 per tensor (`python
benchmarks/gpu_check.py --device cpu --only train --backends single --no-world2 --tables`),
not the 1e-7 of its unit roundoff, because a few elements are ill-conditioned (ReLU kinks;
the attention key bias, whose exact gradient is 0, so any rounding is all of it; LayerNorm
gradients), and Adam's m/(sqrt(v)+eps) turns a relative change of a small gradient element
into an O(1) change of its step, which 8 steps feed back into the trajectory. The size of
that sensitivity differs per tensor by 100x; a bound must follow it.

The bound. A low-precision run rounds the inputs of every matmul to the compute dtype
(round to nearest even: the same in every correct implementation) and accumulates in fp32
in an order that depends on the kernel. So its distance from float64 is a part that the
dtype and the model fix (the same for every correct implementation) plus a part that the
kernels' order adds. torch's own autocast (+ GradScaler for fp16) on the same device with
the same micro-batches, e_amp, measures the first part, plus one realisation of the second;
the plain fp32 run, e_32, measures the problem's sensitivity at fp32. The device passes
when, for every parameter and every quantity,

    e_dev <= e_32 + ALLOWANCE * e_amp,         ALLOWANCE = 3,

i.e. mixprec may round up to three times as far from float64 as torch's own AMP does
(plus what fp32 itself costs). The spread of correct implementations, measured on this CPU
as max over tensors and quantities of e / e_amp:
  - TinyLM d=128 x2, 8 steps (the GPU's configuration): torch autocast with 2 threads, or
    with the batch as 2 or 4 micro-batches, and mixprec single (1 and 2 threads) and zero2,
    against torch autocast: <= 1.16, but for head.bias with micro-batches (below);
    this script's own cases, every backend (`--device cpu --tables`): <= 1.10 at world 1,
    <= 1.06 at world 2 (bf16 and fp16);
  - the CPU twin (--quick, d=32 x2, 4 steps): <= 1.44 (one 32-element LayerNorm bias's
    exp_avg_sq in bf16; small tensors fluctuate more); fp16 and world 2 there happen to
    round exactly as autocast does.
ALLOWANCE = 3 is twice the largest of these: room for a GPU whose kernels round in another
order. The attention key bias is ~0.7 from float64 in every low-precision run, torch's as
mixprec's (its whole update is rounding), and is judged like the rest. What must match is the
micro-batching: one batch of 2B against the two ranks' B moves head.bias 6.5x in bf16 (its
gradient is summed in bf16 per micro-batch), hence the references' micro-batches.

What it catches. A run whose updates are off by a factor (1 + d) has e >= |d| - e_amp on
every tensor, so it fails on every tensor with (ALLOWANCE + 1) e_amp + e_32 < |d|: for
d = 0.15, every tensor with e_amp below about 0.035 (e_amp spans 8e-4 .. 0.15 per tensor
here, the key bias aside). A 1-D tensor not updated has e = 1 on its update, updated with
the wrong sign or 3x e = 2, against bounds of at most 0.5 (the key bias aside); 10% of an
exp_avg left at zero gives e ~ sqrt(0.1) = 0.32 against e_amp(exp_avg) <= 0.07. Each of these
(PERTURBATIONS) is applied to every case's own result and must fail, so the verdict is seen
to have teeth on the device's own numbers; each case's line gives how far over its bound the
least-caught one is (on this CPU at least 28x). ``--broken`` trains the same breakages for
real (BROKEN); all 28 runs (single at world 1, ddp at world 2, bf16 and fp16) fail.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import faulthandler
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

BACKENDS = ("single", "ddp", "zero1", "zero2", "zero3", "fsdp")
PRECISIONS = ("bf16", "fp16")
LOW_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16}
QUANTITIES = ("update", "exp_avg", "exp_avg_sq")
LR = 1e-3
ALLOWANCE = 3.0  # [Note: the training verdict]
WORLD2_TIMEOUT_S = 150  # one backend's world=2 runs (both precisions, and --broken's)
ADAM_RTOL = 2.0 ** -17  # check_kernels' fused Adam bound (see there)
WORLD2_RUNNER = None  # None: mixprec.distributed.spawn.run_distributed (tests may use warm ranks)
G6_TARGET = 0.8  # issue 23: unscale, norm and copies at >= 0.8 of torch's foreach ops


class Config:
    """What one gpu_check run does (picklable: it goes to the world-2 ranks as it is)."""

    def __init__(self, device: str, quick: bool) -> None:
        self.device = device
        self.quick = quick
        self.steps = 4 if quick else 8
        self.warmup = 2
        self.dim, self.layers, self.batch = (32, 2, 4) if quick else (128, 2, 8)
        self.backends = BACKENDS
        self.world2 = ("zero3",) if quick else BACKENDS[1:]
        self.broken = False  # --broken: also train with BROKEN optimizers (each must fail)
        self.deadline = math.inf  # time.monotonic() after which nothing new starts
        self.tables = False  # print every tensor's distances (--tables)
        self.broken_world2 = True  # --broken also at world 2 (off with --no-world2)

    def out_of_time(self) -> bool:
        return time.monotonic() > self.deadline


def rank_batches(cfg: Config, rank: int) -> list:
    """Rank ``rank``'s STEPS batches (the same for every backend and the references)."""
    from _common import round_batches

    return round_batches(1, cfg.steps, cfg.batch, seed=1 + rank)[0]


@contextlib.contextmanager
def _highest_fp32_matmul():
    """fp32 matmuls in fp32 for the block (no TF32 on CUDA): the fp32 reference is fp32."""
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old)


@contextlib.contextmanager
def _restore_threads(n: int):
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """_common.lm_loss, but a float64 run's logits stay float64."""
    if logits.dtype != torch.float64:
        logits = logits.float()
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100)


# ---- the references -------------------------------------------------------------------

def reference_run(cfg: Config, kind: str, world: int) -> dict:
    """Plain torch, no mixprec: ``kind`` "float64" (on the CPU), "fp32" or a precision
    ("bf16"/"fp16": torch.autocast, fp32 weights, GradScaler for fp16) on ``cfg.device``.
    At ``world`` > 1 each step takes the ranks' batches as micro-batches (loss / world)."""
    from _common import tinylm

    if kind not in ("float64", "fp32") + PRECISIONS:
        raise ValueError(f"reference kind {kind!r}: use float64, fp32, bf16 or fp16")
    on = torch.device("cpu") if kind == "float64" else torch.device(cfg.device)
    low = LOW_DTYPE.get(kind)
    model = tinylm(cfg.dim, cfg.layers).to(device=on, dtype=torch.float64 if kind == "float64" else torch.float32)
    init = {n: p.detach().to("cpu", torch.float64, copy=True) for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    scaler = torch.amp.GradScaler(on.type, enabled=kind == "fp16")
    data = [rank_batches(cfg, r) for r in range(world)]
    losses = []
    old_threads = torch.get_num_threads()
    if on.type == "cpu":
        torch.set_num_threads(1)  # small tensors: one thread is faster, and alike on a busy machine
    with _highest_fp32_matmul(), _restore_threads(old_threads):
        for step in range(cfg.steps):
            total = torch.zeros((), dtype=torch.float64, device=on)
            for r in range(world):
                ids, tgt = (t.to(on) for t in data[r][step])
                with torch.autocast(on.type, dtype=low or torch.bfloat16, enabled=low is not None):
                    logits = model(ids)
                loss = _loss(logits, tgt) / world
                scaler.scale(loss).backward()
                total += loss.detach()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            losses.append(total)
    out = {"tensors": {}, "steps": {}, "init": init, "losses": [float(x) for x in losses]}
    for n, p in model.named_parameters():
        st = opt.state[p]
        out["tensors"][n] = {"update": p.detach().to("cpu", torch.float64) - init[n],
                             "exp_avg": st["exp_avg"].detach().to("cpu", torch.float64),
                             "exp_avg_sq": st["exp_avg_sq"].detach().to("cpu", torch.float64)}
        out["steps"][n] = float(st["step"])
    short = sorted({s for s in out["steps"].values() if s != cfg.steps})
    if short:
        raise RuntimeError(f"the {kind} reference (world {world}) took {short} of {cfg.steps} steps "
                           f"(GradScaler skipped some); the verdict needs every step taken")
    return out


_REFERENCES: dict = {}  # deterministic runs: made once per process and configuration


def references(cfg: Config, world: int, log) -> dict:
    """The runs every case at ``world`` is judged against, and their distances from float64."""
    key = (cfg.device, cfg.dim, cfg.layers, cfg.batch, cfg.steps, world)
    if key in _REFERENCES:
        return _REFERENCES[key]
    t0 = time.monotonic()
    refs = {kind: reference_run(cfg, kind, world) for kind in ("float64", "fp32") + PRECISIONS}
    base = refs["float64"]
    for kind in ("fp32",) + PRECISIONS:
        refs[kind]["distance"] = distances(refs[kind], base)
    log(f"references world={world}: float64 (cpu), fp32, bf16 and fp16 autocast ({cfg.device}) "
        f"in {time.monotonic() - t0:.1f} s")
    _REFERENCES[key] = refs
    return refs


# ---- one mixprec run ------------------------------------------------------------------

class _ScaledLR(torch.optim.AdamW):
    def __init__(self, params, lr, factor):
        super().__init__(params, lr=lr * factor)


class _OneDimUpdates(torch.optim.AdamW):
    """Applies ``factor`` x its update to every 1-D parameter (biases, norms): 0 leaves them
    as they were, -1 moves them the wrong way, 3 too far. Needs per-parameter tensors (the
    single and ddp backends); a sharded backend steps flat shards and is refused."""

    def __init__(self, params, lr, factor):
        params = list(params)
        self._count, self._factor = len(params), factor
        super().__init__(params, lr=lr)

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for g in self.param_groups for p in g["params"]]
        if len(params) != self._count:
            raise ValueError(f"this broken optimizer perturbs 1-D parameters, but it steps {len(params)} "
                             f"tensors for {self._count} parameters (flat shards); use the single or ddp backend")
        old = [(p, p.detach().clone()) for p in params if p.dim() == 1]
        out = super().step(closure)
        for p, before in old:
            p.sub_(before).mul_(self._factor).add_(before)
        return out


class _UnwrittenExpAvg(torch.optim.AdamW):
    """Leaves every 10th element of each exp_avg at zero (10% never written)."""

    @torch.no_grad()
    def step(self, closure=None):
        out = super().step(closure)
        for st in self.state.values():
            if "exp_avg" in st:
                st["exp_avg"].view(-1)[::10] = 0
        return out


class _NoStep(torch.optim.AdamW):
    """Says it stepped, changes nothing (what G1 did on CUDA)."""

    def step(self, closure=None):
        return None


# Really broken optimizers for --broken, each of which must fail the verdict. The 1-D ones
# need per-parameter optimizer tensors: they run on BROKEN_BACKENDS only.
BROKEN = {
    "updates x1.15": lambda params, lr: _ScaledLR(params, lr, 1.15),
    "updates x0.8": lambda params, lr: _ScaledLR(params, lr, 0.8),
    "1-D not updated": lambda params, lr: _OneDimUpdates(params, lr, 0.0),
    "1-D wrong sign": lambda params, lr: _OneDimUpdates(params, lr, -1.0),
    "1-D updated 3x": lambda params, lr: _OneDimUpdates(params, lr, 3.0),
    "10% of exp_avg unwritten": lambda params, lr: _UnwrittenExpAvg(params, lr=lr),
    "no step": lambda params, lr: _NoStep(params, lr=lr),
}
BROKEN_BACKENDS = {1: "single", 2: "ddp"}


def make_optimizer(params, lr: float, broken: str | None = None):
    """The optimizer of every mixprec run; ``broken`` names one of BROKEN."""
    if broken is None:
        return torch.optim.AdamW(params, lr=lr)
    if broken not in BROKEN:
        raise ValueError(f"broken={broken!r} is not one of {sorted(BROKEN)}")
    return BROKEN[broken](params, lr)


SYNC_DEBUG_MODE = "error"


@contextlib.contextmanager
def _sync_watch(device: torch.device, on: bool, found: list):
    """Host syncs on CUDA in the block, appended to ``found``, through torch's sync debug
    mode (c10::cuda::warn_or_error_on_sync: stream/device synchronisation, blocking copies;
    not a non-blocking copy into pinned memory, not an event wait). In "error" mode the
    first sync raises; the step is then finished outside the mode (so the comparison still
    has its run) and the sync recorded. Nothing on the CPU (ScalarReads is its twin)."""
    if not on or device.type != "cuda":
        yield
        return
    torch.cuda.set_sync_debug_mode(SYNC_DEBUG_MODE)
    try:
        yield
    except RuntimeError as error:
        if "synchroniz" not in str(error):
            raise
        frames = [f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}"
                  for f in traceback.extract_tb(error.__traceback__)[-4:]]
        found.append(f"{str(error).splitlines()[0]} (at {' <- '.join(reversed(frames))})")
        raise _SyncFound() from error
    finally:
        torch.cuda.set_sync_debug_mode("default")


class _SyncFound(Exception):
    pass


def _wanted(name: str) -> bool:
    parts = name.split("/")
    return (parts[0] == "model" and len(parts) == 2) or \
        (parts[0] == "optim" and len(parts) == 4 and parts[3] in ("exp_avg", "exp_avg_sq", "step"))


def train(cfg: Config, backend: str, precision: str, *, rank: int = 0, threads: int | None = None,
          watch_syncs: bool = False, broken: str | None = None) -> dict:
    """``cfg.steps`` TinyLM steps of mixprec on ``cfg.device``, rank ``rank``'s batches. Returns
    this rank's pieces of the fp32 masters and the optimizer state as the engine describes
    them for checkpoints (Engine.state_shards, src/mixprec/engines/base.py: names, global
    shapes, offsets; plain numpy, so they travel from a rank by pickle), the initial
    weights, the losses, whether each step stepped, and the host syncs seen."""
    from _common import lm_loss, tinylm

    from mixprec import Accelerator
    from mixprec.diagnostics.syncs import ScalarReads

    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    # Accelerator.end_training() destroys the default group, even one it did not create: in
    # the 2-rank harness the next run would then re-create it from the environment while
    # the other rank still uses the old one. Only a run that made its group ends it.
    owns_group = not (torch.distributed.is_available() and torch.distributed.is_initialized())
    acc = Accelerator(mixed_precision=precision, backend=backend, cpu=cfg.device == "cpu", log_policy=False)
    try:
        model = tinylm(cfg.dim, cfg.layers)
        init = {n: p.detach().float().numpy().copy() for n, p in model.named_parameters()}
        model, opt = acc.prepare(model, make_optimizer(model.parameters(), LR, broken))
        batches = rank_batches(cfg, rank)
        losses, results, reads, sync_errors = [], [], ScalarReads(), []
        for i, (ids, tgt) in enumerate(batches):
            ids, tgt = ids.to(acc.device), tgt.to(acc.device)
            counted = i >= cfg.warmup and broken is None
            phase = ["forward"]
            with (reads if counted else contextlib.nullcontext()):
                try:
                    with _sync_watch(acc.device, counted and watch_syncs, sync_errors):
                        loss = lm_loss(model(ids), tgt)
                        phase.append("backward")
                        acc.backward(loss)
                        phase.append("clip")
                        acc.clip_grad_norm_(model.parameters(), 1.0)
                        phase.append("step")
                        results.append(opt.step())
                        phase.append("zero_grad")
                        opt.zero_grad()
                except _SyncFound:
                    sync_errors[-1] = f"step {i}, {phase[-1]}: {sync_errors[-1]}"
                    # finish the step outside the mode, from where it stopped; a step cut
                    # inside backward may not finish: then the sync is what the case reports
                    try:
                        if phase[-1] == "forward":
                            loss = lm_loss(model(ids), tgt)
                        if phase[-1] in ("forward", "backward"):
                            acc.backward(loss)
                        if phase[-1] in ("forward", "backward", "clip"):
                            acc.clip_grad_norm_(model.parameters(), 1.0)
                        if phase[-1] != "zero_grad":
                            results.append(opt.step())
                        opt.zero_grad()
                    except Exception as error:
                        raise RuntimeError(f"host sync in the step ({sync_errors[-1]}); finishing the "
                                           f"step after it failed: {type(error).__name__}: {error}") from error
            losses.append(loss.detach())
        stepped = [None if r is None else bool(r.stepped) for r in results]
        shards = [(s.name, tuple(s.shape), int(s.offset), s.tensor.detach().to("cpu", torch.float32).numpy().copy(),
                   bool(s.replicated))
                  for s in acc.engine.state_shards(acc.prepared.models, acc.prepared.raw_optimizers())
                  if _wanted(s.name)]
        return {"shards": shards, "init": init, "losses": [float(x) for x in losses], "stepped": stepped,
                "reads": dict(reads.by_op), "sync_errors": sync_errors}
    finally:
        if owns_group:
            acc.end_training()
        torch.set_num_threads(old_threads)


def assemble(per_rank: list[list]) -> tuple[dict, list[str]]:
    """The ranks' pieces (``train()["shards"]``) as whole tensors by name, and what is wrong
    with them: an element no rank holds, pieces that overlap with other values, a replicated
    tensor (ddp's replicas, step counters) that differs between ranks."""
    import numpy as np

    whole, covered, problems = {}, {}, []
    for rank, pieces in enumerate(per_rank):
        for name, shape, offset, values, replicated in pieces:
            numel = math.prod(shape)
            if replicated:
                if values.size != numel:
                    problems.append(f"{name}: replicated but {values.size} of {numel} elements")
                elif name not in whole:
                    whole[name] = values.astype(np.float64).reshape(shape)
                    covered[name] = None
                elif not np.array_equal(whole[name].reshape(-1), values.astype(np.float64)):
                    diff = float(np.abs(whole[name].reshape(-1) - values).max())
                    problems.append(f"{name}: rank {rank}'s replica differs from rank 0's (max |diff| {diff:.3g})")
                continue
            buf = whole.setdefault(name, np.zeros(numel))
            mask = covered.setdefault(name, np.zeros(numel, dtype=bool))
            if mask is None or buf.size != numel:
                problems.append(f"{name}: held both replicated and sharded, or with two shapes")
                continue
            seg = slice(offset, offset + values.size)
            if offset + values.size > numel:
                problems.append(f"{name}: rank {rank} holds [{offset}, {offset + values.size}) of {numel} elements")
                continue
            again = mask[seg]
            if again.any() and not np.array_equal(buf[seg][again], values[again]):
                problems.append(f"{name}: rank {rank}'s piece at {offset} overlaps another with other values")
            buf[seg] = values
            mask[seg] = True
    for name, mask in covered.items():
        if mask is not None:
            if not mask.all():
                problems.append(f"{name}: {int((~mask).sum())} of {mask.size} elements held by no rank")
            whole[name] = whole[name].reshape(next(p[1] for r in per_rank for p in r if p[0] == name))
    return whole, problems


def device_result(runs: list[dict], ref: dict) -> tuple[dict, list[str]]:
    """One mixprec run (its ranks' ``train()`` results) in the references' form."""
    whole, problems = assemble([r["shards"] for r in runs])
    out = {"tensors": {}, "steps": {}, "losses": runs[0]["losses"]}
    for n, init in ref["init"].items():
        mine = runs[0]["init"].get(n)
        if mine is None or not torch.equal(torch.from_numpy(mine).double(), init):
            problems.append(f"{n}: the mixprec run started from other weights than the references")
            continue
        t = {}
        if f"model/{n}" in whole:
            t["update"] = torch.from_numpy(whole[f"model/{n}"]) - init
        for q in ("exp_avg", "exp_avg_sq"):
            if f"optim/0/{n}/{q}" in whole:
                t[q] = torch.from_numpy(whole[f"optim/0/{n}/{q}"])
        out["tensors"][n] = t
        if f"optim/0/{n}/step" in whole:
            out["steps"][n] = float(whole[f"optim/0/{n}/step"].reshape(-1)[0])
    extra = sorted(k.split("/")[1] if k.startswith("model/") else k.split("/")[2] for k in whole
                   if (k.split("/")[1] if k.startswith("model/") else k.split("/")[2]) not in ref["init"])
    if extra:
        problems.append(f"parameters the references do not have: {sorted(set(extra))}")
    return out, problems


# ---- the verdict ------------------------------------------------------------------------

def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (inf when b is zero and a is not)."""
    a, b = a.double(), b.double()
    num, den = torch.linalg.vector_norm(a - b).item(), torch.linalg.vector_norm(b).item()
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def distances(run: dict, base: dict) -> dict:
    """e(X) of every tensor and quantity of ``run`` from ``base`` (None where ``run`` lacks it
    or has another shape)."""
    out = {}
    for n, ref in base["tensors"].items():
        for q in QUANTITIES:
            x = run["tensors"].get(n, {}).get(q)
            out[(n, q)] = None if x is None or x.shape != ref[q].shape else _rel(x, ref[q])
    return out


def compare(dev: dict, refs: dict, precision: str, steps: int, allowance: float = ALLOWANCE) -> dict:
    """[Note: the training verdict]: every tensor and quantity of ``dev`` within
    e_32 + allowance * e_amp of float64, and every step counter equal to ``steps``."""
    base = refs["float64"]
    e32, eamp = refs["fp32"]["distance"], refs[precision]["distance"]
    problems, rows = [], []
    for (n, q), e in distances(dev, base).items():
        bound = e32[(n, q)] + allowance * eamp[(n, q)]
        ratio = math.inf if e is None else (e / bound if bound > 0 else (0.0 if e == 0 else math.inf))
        rows.append({"tensor": n, "quantity": q, "e": e, "e32": e32[(n, q)], "eamp": eamp[(n, q)],
                     "bound": bound, "ratio": ratio})
        if e is None:
            problems.append(f"{n} {q}: missing or of another shape on the device")
        elif not ratio <= 1.0:
            problems.append(f"{n} {q}: {e:.3g} from float64 > {bound:.3g} (fp32 {e32[(n, q)]:.2g} + "
                            f"{allowance:g} x autocast {eamp[(n, q)]:.2g})")
    wrong = {n: dev["steps"].get(n) for n in base["tensors"] if dev["steps"].get(n) != float(steps)}
    if wrong:
        values = sorted({str(v) for v in wrong.values()})
        problems.append(f"step counters of {len(wrong)} parameters are {values}, not {steps} "
                        f"(a step skipped or never taken)")
    worst = max(rows, key=lambda r: r["ratio"])
    return {"ok": not problems, "problems": problems, "rows": rows, "worst": worst}


def _perturbed(dev: dict, quantity: str, fn, only_1d: bool = False) -> dict:
    tensors = {}
    for n, t in dev["tensors"].items():
        t = dict(t)
        if quantity in t and (not only_1d or t[quantity].dim() == 1):
            t[quantity] = fn(t[quantity].clone())
        tensors[n] = t
    return {**dev, "tensors": tensors}


def _every_tenth_zero(x: torch.Tensor) -> torch.Tensor:
    x.view(-1)[::10] = 0
    return x


# What a broken optimizer leaves, applied to a case's own result: each must fail compare().
PERTURBATIONS = {
    "no update (lr=0)": lambda d: _perturbed(d, "update", lambda x: x * 0),
    "updates x1.15": lambda d: _perturbed(d, "update", lambda x: x * 1.15),
    "updates x0.8": lambda d: _perturbed(d, "update", lambda x: x * 0.8),
    "1-D not updated": lambda d: _perturbed(d, "update", lambda x: x * 0, only_1d=True),
    "1-D wrong sign": lambda d: _perturbed(d, "update", lambda x: -x, only_1d=True),
    "1-D updated 3x": lambda d: _perturbed(d, "update", lambda x: 3 * x, only_1d=True),
    "10% of exp_avg unwritten": lambda d: _perturbed(d, "exp_avg", _every_tenth_zero),
}


def evaluate(cfg: Config, name: str, runs: list[dict], refs: dict, precision: str,
             broken: str | None = None) -> dict:
    """The verdict on one case (its ranks' runs), with the negative controls."""
    dev, problems = device_result(runs, refs["float64"])
    res = {"name": name, "broken": broken, "losses": dev["losses"],
           "stepped": runs[0]["stepped"], "reads": runs[0]["reads"], "sync_errors": runs[0]["sync_errors"]}
    if problems:
        verdict = {"ok": False, "problems": problems, "rows": [], "worst": None}
    else:
        verdict = compare(dev, refs, precision, cfg.steps)
    res.update(verdict_ok=verdict["ok"], worst=verdict["worst"], rows=verdict["rows"])
    if broken is not None:  # a broken optimizer must fail
        res["ok"] = not verdict["ok"]
        res["problems"] = [] if res["ok"] else [f"the broken optimizer '{broken}' PASSED the verdict: it cannot see it"]
        res["caught_by"] = verdict["problems"][:3]
        return res
    res["ok"], res["problems"] = verdict["ok"], list(verdict["problems"])
    if problems:
        return res
    controls = {}
    for pname, perturb in PERTURBATIONS.items():
        c = compare(perturb(dev), refs, precision, cfg.steps)
        controls[pname] = {"failed": not c["ok"], "worst_ratio": c["worst"]["ratio"],
                           "worst_at": f"{c['worst']['tensor']} {c['worst']['quantity']}"}
    res["controls"] = controls
    passed = [p for p, c in controls.items() if not c["failed"]]
    if passed:
        res["ok"] = False
        res["problems"].append(f"negative control(s) {passed} passed the verdict: it cannot see them")
    return res


def _judge_syncs(result: dict, world: int) -> None:
    result["syncs_judged"] = world == 1 and result.get("broken") is None
    if result["syncs_judged"] and (result.get("reads") or result.get("sync_errors")):
        result["ok"] = False
        result["problems"].append(f"host syncs in the step: reads {result['reads']}, "
                                  f"sync-debug errors {result['sync_errors']}")


def _rank_runs(state, cfg: Config, backend: str, variants: list, measure_memory: bool):
    # The harness's group is Gloo; on CUDA with fewer GPUs than ranks they share a device
    # ([Note: ranks sharing a GPU] in src/mixprec/distributed/state.py).
    # No try/except here: a rank that failed must not go on to the next run's collectives
    # while the other waits in this one; the harness reports the failure and stops both.
    faulthandler.dump_traceback_later(max(30, WORLD2_TIMEOUT_S - 20), exit=True)  # a hang shows where
    out = {"runs": {}}
    for precision in PRECISIONS:
        for variant in variants:
            # Gloo stages CUDA tensors through the host: syncs not judged, so not stopped either
            out["runs"][(precision, variant)] = train(cfg, backend, precision, rank=state.rank, threads=1,
                                                      broken=variant)
    if measure_memory:
        out["memory"] = measure_backend(cfg, backend, "bf16", rank=state.rank)
    faulthandler.cancel_dump_traceback_later()
    return out


def _failed_case(name: str, error: BaseException | str, broken: str | None = None) -> dict:
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    return {"name": name, "ok": False, "broken": broken, "problems": [text[-2000:]], "rows": [], "worst": None}


def check_training(cfg: Config, log, runner=None) -> list[dict]:
    """Every case at world 1 and 2 (see the module docstring). ``runner`` runs the world-2
    ranks (mixprec.distributed.spawn.run_distributed, or the test harness's warm ranks)."""
    if runner is None:
        runner = WORLD2_RUNNER
    if runner is None:
        from mixprec.distributed.spawn import run_distributed as runner
    rows = []

    def emit(res):
        rows.append(res)
        log(_case_line(res))
        if cfg.tables and res.get("rows") and res.get("broken") is None:
            log(_table(res))

    refs = references(cfg, 1, log)
    cases = [(b, p, None) for b in cfg.backends for p in PRECISIONS]
    if cfg.broken:
        cases += [(BROKEN_BACKENDS[1], p, v) for p in PRECISIONS for v in BROKEN]
    for backend, precision, variant in cases:
        name = f"{backend} {precision} world=1" + (f" broken[{variant}]" if variant else "")
        if cfg.out_of_time():
            emit(_failed_case(name, "not run: the time budget ran out (--budget-s)", variant))
            continue
        try:
            run = train(cfg, backend, precision, watch_syncs=variant is None,
                        threads=None if cfg.device == "cuda" else 1, broken=variant)
            res = evaluate(cfg, name, [run], refs, precision, variant)
            _judge_syncs(res, 1)
        except Exception as error:  # noqa: BLE001 - one case's failure is reported, the rest run
            res = _failed_case(name, error, variant)
        emit(res)
    world2 = list(cfg.world2)
    if cfg.broken and cfg.broken_world2 and BROKEN_BACKENDS[2] not in world2:
        world2.append(BROKEN_BACKENDS[2])
    if not world2:
        return rows
    if cfg.device == "cuda" and torch.cuda.device_count() < 2:
        log(f"note: world=2 on {torch.cuda.device_count()} GPU: both ranks share cuda:0 over Gloo "
            "([Note: ranks sharing a GPU] in src/mixprec/distributed/state.py)")
    refs2 = references(cfg, 2, log)
    for backend in world2:
        variants = [None] if backend in cfg.world2 else []
        if cfg.broken and cfg.broken_world2 and backend == BROKEN_BACKENDS[2]:
            variants += list(BROKEN)
        names = {(p, v): f"{backend} {p} world=2" + (f" broken[{v}]" if v else "")
                 for p in PRECISIONS for v in variants}
        if cfg.out_of_time():
            for (p, v), name in names.items():
                emit(_failed_case(name, "not run: the time budget ran out (--budget-s)", v))
            continue
        t0 = time.monotonic()
        try:
            per_rank = runner(_rank_runs, 2, args=(cfg, backend, variants, None in variants), timeout=WORLD2_TIMEOUT_S)
        except Exception as error:  # noqa: BLE001
            for (p, v), name in names.items():
                emit(_failed_case(name, f"{type(error).__name__}: {str(error)[-1500:]}", v))
            continue
        for (precision, variant), name in names.items():
            try:
                res = evaluate(cfg, name, [r["runs"][(precision, variant)] for r in per_rank], refs2, precision, variant)
                _judge_syncs(res, 2)
            except Exception as error:  # noqa: BLE001
                res = _failed_case(name, error, variant)
            if variant is None and precision == "bf16" and "memory" in per_rank[0]:
                res["rank_memory"] = [r["memory"] for r in per_rank]
            emit(res)
        log(f"world=2 {backend}: {time.monotonic() - t0:.1f} s")
    return rows


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.2e}"


def _case_line(res: dict) -> str:
    w = res.get("worst")
    head = "ok  " if res["ok"] else "FAIL"
    text = f"{head} {res['name']}: "
    if res.get("broken") is not None:
        text += (f"failed as it must ({'; '.join(res.get('caught_by', []))[:300]})" if res["ok"]
                 else "; ".join(res["problems"]))
        return text
    if w is not None:
        text += (f"worst {w['tensor']} {w['quantity']} {w['e']:.2e} from float64, {w['ratio']:.2f} of its "
                 f"bound {w['bound']:.2e} (fp32 {w['e32']:.1e}, autocast {w['eamp']:.1e})")
    controls = res.get("controls")
    if controls:
        least = min(controls.items(), key=lambda kv: kv[1]["worst_ratio"])
        text += (f"; controls {sum(c['failed'] for c in controls.values())}/{len(controls)} failed "
                 f"(least caught: {least[0]} at {least[1]['worst_ratio']:.2f}x its bound)")
    text += f"; reads {res.get('reads', {}) or 0} sync errors {len(res.get('sync_errors', []))}"
    if res.get("problems"):
        text += " -- " + "; ".join(res["problems"][:6]) + (f" (+{len(res['problems']) - 6} more)"
                                                          if len(res["problems"]) > 6 else "")
    return text


def _table(res: dict) -> str:
    lines = [f"{res['name']}: distance from float64 per tensor (e, fp32 e_32, autocast e_amp, e / bound)"]
    for r in res["rows"]:
        lines.append(f"  {r['tensor'][-42:]:42s} {r['quantity']:10s} {_fmt(r['e'])} {_fmt(r['e32'])} "
                     f"{_fmt(r['eamp'])} {r['ratio']:.2f}")
    return "\n".join(lines)


# ---- kernels ----------------------------------------------------------------------------

def _tensors(device, dtype, sizes, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g).to(device=device, dtype=dtype) for n in sizes]


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device, reps: int) -> float:
    fn()
    _sync(device)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        _sync(device)
        times.append((time.perf_counter() - t0) / reps)
    return min(times)


def check_kernels(cfg: Config, log) -> list[dict]:
    """Each mixprec kernel against torch on ``cfg.device``: correctness (judged) and time
    against torch's foreach equivalent (reported)."""
    from mixprec import kernels as K

    device = torch.device(cfg.device)
    sizes = [7, 33 * 17, 65537] + ([3 * 400000] if not cfg.quick else [4099])
    big = [1 << 22] * 8 if (device.type == "cuda" and not cfg.quick) else [1 << 14] * 4
    reps = 20 if device.type == "cuda" else 3
    rows = []

    def row(name, ok, detail, mine=None, theirs=None, nbytes=None, versus=""):
        r = {"name": name, "ok": bool(ok), "detail": detail}
        if mine is not None:
            r.update(mixprec_s=mine, torch_s=theirs, versus=versus, ratio=theirs / mine,
                     mixprec_gbs=nbytes / mine / 1e9, torch_gbs=nbytes / theirs / 1e9)
        if mine is not None and device.type == "cuda" and name.split()[0] in ("unscale_and_check_", "l2_norm",
                                                                                "copy_cast_"):
            # issue 23's G6: these run every step; on CUDA they call torch's foreach ops
            r["g6_target"] = "met" if r["ratio"] >= G6_TARGET else "missed"
        rows.append(r)
        timing = (f"; {r['mixprec_gbs']:.1f} GB/s vs {versus} {r['torch_gbs']:.1f} GB/s "
                  f"(speed ratio {r['ratio']:.2f}"
                  + (f", G6 target {G6_TARGET} {r['g6_target']}" if "g6_target" in r else "") + ")"
                  if mine is not None else "")
        log(f"{'ok  ' if ok else 'FAIL'} kernel {name}: {detail}{timing}")

    def _torch_unscale(ts, found, inv):
        """torch's op where it takes the dtype; its arithmetic (fp32 multiply, found_inf from
        the values before it) for bf16, which its CUDA kernel refuses (torch 2.11)."""
        if ts[0].dtype in (torch.float32, torch.float16, torch.float64) or ts[0].device.type == "cpu":
            torch._amp_foreach_non_finite_check_and_unscale_(ts, found, inv)
            return
        for t in ts:
            wide = t.float()
            found.masked_fill_(~wide.isfinite().all(), 1.0)
            t.copy_(wide * inv)

    def guard(name, fn):
        try:
            fn()
        except Exception as error:  # noqa: BLE001 - reported as this kernel's failure
            row(name, False, f"{type(error).__name__}: {error}"[:1000])

    # unscale_and_check_ vs torch._amp_foreach_non_finite_check_and_unscale_ (bitwise)
    def unscale():
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            a = _tensors(device, dtype, sizes, 0)
            b = [t.clone() for t in a]
            a[-1].view(-1)[5] = float("inf")
            b[-1].view(-1)[5] = float("inf")
            fa, fb = torch.zeros(1, device=device), torch.zeros(1, device=device)
            inv = torch.full((1,), 0.3, device=device)
            K.unscale_and_check_(a, fa, inv)
            _torch_unscale(b, fb, inv)
            same = all(torch.equal(x[x.isfinite()], y[y.isfinite()]) for x, y in zip(a, b))
            ok = same and fa.item() == fb.item() == 1.0
            if not ok or dtype is not torch.float32:
                if not ok:
                    row(f"unscale_and_check_ {dtype}", False, f"differs from torch (found_inf {fa.item()} vs {fb.item()})")
                    return
                continue
            t = _tensors(device, dtype, big, 1)
            f = torch.zeros(1, device=device)
            nbytes = 2 * sum(x.numel() * x.element_size() for x in t)
            mine = _time(lambda: K.unscale_and_check_(t, f, inv), device, reps)
            theirs = _time(lambda: torch._amp_foreach_non_finite_check_and_unscale_(t, f, inv), device, reps)
            row("unscale_and_check_", True, "bitwise equal to torch._amp_foreach_non_finite_check_and_unscale_ "
                "(fp32, fp16; bf16, which torch's CUDA op does not take, to its arithmetic; inf found)",
                mine, theirs, nbytes, "torch")
    guard("unscale_and_check_", unscale)

    # l2_norm vs torch._foreach_norm: fp32 sums in another order, relative error <= n u_fp32;
    # we allow 1e-5 (n up to 2^20 per block, tree reductions).
    def norm():
        a = _tensors(device, torch.float32, sizes, 2)
        mine = K.l2_norm(a)
        theirs = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(a)))
        err = abs(mine.item() - theirs.item()) / theirs.item()
        ok = err <= 1e-5
        t = _tensors(device, torch.float32, big, 3)
        nbytes = sum(x.numel() * x.element_size() for x in t)
        tm = _time(lambda: K.l2_norm(t), device, reps)
        tt = _time(lambda: torch.linalg.vector_norm(torch.stack(torch._foreach_norm(t))), device, reps)
        row("l2_norm", ok, f"relative error {err:.2e} vs torch._foreach_norm (bound 1e-5)", tm, tt, nbytes,
            "torch._foreach_norm")
    guard("l2_norm", norm)

    # copy_cast_ vs torch._foreach_copy_ (bitwise: both round to nearest-even)
    def copy_cast():
        src = _tensors(device, torch.float32, sizes, 4)
        a = [torch.empty_like(x, dtype=torch.bfloat16) for x in src]
        b = [torch.empty_like(x, dtype=torch.bfloat16) for x in src]
        K.copy_cast_(a, src)
        torch._foreach_copy_(b, src)
        ok = all(torch.equal(x, y) for x, y in zip(a, b))
        s = _tensors(device, torch.float32, big, 5)
        d = [torch.empty_like(x, dtype=torch.bfloat16) for x in s]
        nbytes = sum(x.numel() * 6 for x in s)
        tm = _time(lambda: K.copy_cast_(d, s), device, reps)
        tt = _time(lambda: torch._foreach_copy_(d, s), device, reps)
        row("copy_cast_ fp32->bf16", ok, "bitwise equal to torch._foreach_copy_" if ok else "differs from torch",
            tm, tt, nbytes, "torch._foreach_copy_")
    guard("copy_cast_", copy_cast)

    # scale_copy_and_check_ vs multiply + isfinite (bitwise: one fp32 multiply)
    def scale_copy():
        src = _tensors(device, torch.float32, sizes, 6)
        src[0][3] = float("nan")
        a = [torch.empty_like(x) for x in src]
        f = torch.zeros(1, device=device)
        scale = torch.full((1,), 0.25, device=device)
        K.scale_copy_and_check_(a, src, f, scale)
        b = torch._foreach_mul(src, scale.reshape(()))  # torch's foreach takes a 0-dim scalar
        ok = all(torch.equal(x[x.isfinite()], y[y.isfinite()]) for x, y in zip(a, b)) and f.item() == 1.0
        row("scale_copy_and_check_", ok, "bitwise equal to torch._foreach_mul, nan found" if ok
            else f"differs from torch._foreach_mul (found_inf {f.item()})")
    guard("scale_copy_and_check_", scale_copy)

    # flat_copy_in_ / flat_copy_out_ vs torch.cat / split (bitwise)
    def flat():
        src = _tensors(device, torch.float32, sizes, 7)
        flat_ = torch.empty(sum(x.numel() for x in src), dtype=torch.bfloat16, device=device)
        K.flat_copy_in_(flat_, src)
        ok_in = torch.equal(flat_, torch.cat([x.flatten() for x in src]).to(torch.bfloat16))
        back = [torch.empty_like(x) for x in src]
        K.flat_copy_out_(back, flat_)
        ok_out = all(torch.equal(x, y) for x, y in
                     zip(back, [t.float().view_as(s) for t, s in zip(flat_.split([x.numel() for x in src]), src)]))
        row("flat_copy_in_/out_", ok_in and ok_out, f"in {'==' if ok_in else '!='} torch.cat, "
            f"out {'==' if ok_out else '!='} split")
    guard("flat_copy", flat)

    # fused_adam_ vs torch.optim.AdamW/Adam(foreach=False): the same formula in fp32 with the
    # roundings in another order (torch divides sqrt(v) by sqrt(bias correction) first). An
    # element's update m/(sqrt(v)+eps) is ill-conditioned where m and v are tiny, so elements
    # are not compared one by one: the norm-relative difference of the parameter change and
    # of m and v must stay within ADAM_RTOL = 2^-17 (64 fp32 ulps over 3 steps); measured on
    # the CPU: about 1e-7. The bf16 copy must equal the fp32 result rounded (bitwise).
    def adam():
        for decoupled in (True, False):
            params = _tensors(device, torch.float32, sizes, 8)
            grads = _tensors(device, torch.float32, sizes, 9)
            ref = [p.clone().requires_grad_(True) for p in params]
            cls = torch.optim.AdamW if decoupled else torch.optim.Adam
            opt = cls(ref, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, foreach=False)
            m = [torch.zeros_like(p) for p in params]
            v = [torch.zeros_like(p) for p in params]
            lowp = [torch.empty_like(p, dtype=torch.bfloat16) for p in params]
            for step in (1, 2, 3):
                for r, g in zip(ref, grads):
                    r.grad = g.clone()
                opt.step()
                K.fused_adam_(params, grads, m, v, lowp, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                              weight_decay=0.1, step=float(step), decoupled=decoupled, maximize=False,
                              inv_scale=None, found_inf=None)
            init = _tensors(device, torch.float32, sizes, 8)
            flat = lambda ts: torch.cat([t.flatten().cpu() for t in ts])  # noqa: E731
            errs = {
                "update": _rel(flat(params) - flat(init), flat([r.detach() for r in ref]) - flat(init)),
                "exp_avg": _rel(flat(m), flat([opt.state[r]["exp_avg"] for r in ref])),
                "exp_avg_sq": _rel(flat(v), flat([opt.state[r]["exp_avg_sq"] for r in ref])),
            }
            lowp_ok = all(torch.equal(lp, p.to(torch.bfloat16)) for lp, p in zip(lowp, params))
            name = "fused_adam_ (AdamW)" if decoupled else "fused_adam_ (Adam)"
            ok = lowp_ok and all(e <= ADAM_RTOL for e in errs.values())
            detail = (", ".join(f"{k} {e:.1e}" for k, e in errs.items()) +
                      f" vs torch.optim.{cls.__name__}, 3 steps (bound {ADAM_RTOL:.1e}); bf16 copy "
                      + ("exact" if lowp_ok else "WRONG"))
            row(name, ok, detail)
            if not ok:
                return
        # time one step against torch's fused AdamW kernel on the same tensors
        p = _tensors(device, torch.float32, big, 10)
        g = _tensors(device, torch.float32, big, 11)
        m = [torch.zeros_like(x) for x in p]
        v = [torch.zeros_like(x) for x in p]
        lp = [torch.empty_like(x, dtype=torch.bfloat16) for x in p]
        steps = [torch.ones((), device=device) for _ in p]
        nbytes = sum(x.numel() * (4 * 7 + 2) for x in p)
        tm = _time(lambda: K.fused_adam_(p, g, m, v, lp, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                                         weight_decay=0.01, step=2.0, decoupled=True, maximize=False,
                                         inv_scale=None, found_inf=None), device, reps)
        try:
            tt = _time(lambda: torch._fused_adamw_(p, g, m, v, [], steps, lr=1e-3, beta1=0.9, beta2=0.999,
                                                   weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False),
                       device, reps)
            row("fused_adam_ timing", True, "step of 8 tensors (+ bf16 copy for mixprec)", tm, tt, nbytes,
                "torch._fused_adamw_")
        except RuntimeError as error:
            row("fused_adam_ timing", True, f"torch's fused AdamW unavailable here ({str(error)[:80]})")
    guard("fused_adam_", adam)

    # fused_sgd_ vs torch.optim.SGD(momentum, nesterov=False, foreach=False): bitwise
    def sgd():
        params = _tensors(device, torch.float32, sizes, 12)
        grads = _tensors(device, torch.float32, sizes, 13)
        ref = [p.clone().requires_grad_(True) for p in params]
        opt = torch.optim.SGD(ref, lr=0.1, momentum=0.9, weight_decay=0.01, foreach=False)
        bufs = [torch.zeros_like(p) for p in params]
        lowp = [torch.empty_like(p, dtype=torch.bfloat16) for p in params]
        for i in range(3):
            for r, g in zip(ref, grads):
                r.grad = g.clone()
            opt.step()
            K.fused_sgd_(params, grads, bufs, lowp, lr=0.1, momentum=0.9, dampening=0.0, nesterov=False,
                         weight_decay=0.01, maximize=False, first_step=i == 0, inv_scale=None, found_inf=None)
        ok = all(torch.allclose(p, r.detach(), rtol=2.0 ** -22, atol=0) for p, r in zip(params, ref))
        row("fused_sgd_", ok, "matches torch.optim.SGD(momentum=0.9) over 3 steps (rtol 2^-22)" if ok
            else "differs from torch.optim.SGD")
    guard("fused_sgd_", sgd)
    return rows


# ---- memory and step time ------------------------------------------------------------------

def _perf_shape(cfg: Config) -> tuple:
    """dim, layers, batch, steps per round, rounds of the perf section's TinyLM."""
    return (32, 1, 4, 2, 2) if cfg.quick else (512, 6, 32, 10, 5)


class PeakMemory:
    """The peak memory of what runs between ``start()`` and ``read()`` on ``device``, above
    what was allocated at ``start()``. CUDA: ``torch.cuda.max_memory_allocated`` (exact: every
    tensor, whoever allocated it, C++ included); a read of 0 or less is an error. CPU (the
    twin): the OS resident peak (benchmarks/_memprobe.py), which a heap that reuses freed
    pages may not move: reported as read, never an error."""

    def __init__(self, device) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.method = ("torch.cuda.max_memory_allocated" if self.cuda
                       else "OS resident peak VmHWM (CPU twin; a reused heap may show 0)")
        self.base = None

    def start(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            from _memprobe import reset_peak, rss_bytes

            reset_peak()
            self.base = rss_bytes()

    def read(self) -> int:
        if self.base is None:
            raise RuntimeError("PeakMemory.read() before start()")
        if self.cuda:
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device) - self.base
            if peak <= 0:
                raise RuntimeError(f"{self.method} rose by {peak} bytes over a training run on {self.device}: "
                                   "the probe does not see the run (wrong device?)")
            return peak
        from _memprobe import peak_bytes

        return peak_bytes() - self.base


def _perf_batches(cfg: Config, device, rank: int = 0) -> list:
    from _common import round_batches

    _, _, batch, steps, _ = _perf_shape(cfg)
    return [(i.to(device), t.to(device)) for i, t in round_batches(1, steps, batch, seed=3 + rank)[0]]


def _amp_contender(cfg: Config, precision: str):
    """Plain torch at its best: autocast, fp32 weights, AdamW(fused=True) where the device
    has it, GradScaler for fp16, clip_grad_norm_(1.0) (_common.torch_amp_step)."""
    from _common import tinylm, torch_amp_step

    dim, layers, *_ = _perf_shape(cfg)
    dev = torch.device(cfg.device)
    model = tinylm(dim, layers).to(dev)
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        fused = True
    except (RuntimeError, ValueError):
        opt, fused = torch.optim.AdamW(model.parameters(), lr=1e-4), False
    return torch_amp_step(model, opt, precision, dev.type), (model, opt), fused


def _mixprec_contender(cfg: Config, backend: str, precision: str):
    from _common import lm_loss, tinylm

    from mixprec import Accelerator

    dim, layers, *_ = _perf_shape(cfg)
    acc = Accelerator(mixed_precision=precision, backend=backend, cpu=cfg.device == "cpu", log_policy=False)
    mine = tinylm(dim, layers)
    model, opt = acc.prepare(mine, torch.optim.AdamW(mine.parameters(), lr=1e-4))

    def step(ids, tgt):
        acc.backward(lm_loss(model(ids), tgt))
        acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()

    return step, acc


def measure_backend(cfg: Config, backend: str, precision: str, *, rank: int = 0) -> dict:
    """Peak memory of 3 steps of ``backend`` (at whatever world the process is in)."""
    dev = torch.device(cfg.device)
    batches = _perf_batches(cfg, dev, rank)
    probe = PeakMemory(dev)
    owns_group = not (torch.distributed.is_available() and torch.distributed.is_initialized())
    probe.start()
    step, acc = _mixprec_contender(cfg, backend, precision)
    try:
        for ids, tgt in batches[:3]:
            step(ids, tgt)
        return {"backend": backend, "precision": precision, "rank": rank, "peak_bytes": probe.read(),
                "method": probe.method}
    finally:
        if owns_group:
            acc.end_training()


def _alternate(contenders: dict, batches: list, rounds: int, device) -> dict:
    """Median seconds per step of each contender; rounds alternate the order (A B, B A, ...)."""
    for fn in contenders.values():
        for ids, tgt in batches[:2]:
            fn(ids, tgt)
    names, times = list(contenders), {k: [] for k in contenders}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            _sync(device)
            t0 = time.perf_counter()
            for ids, tgt in batches:
                contenders[name](ids, tgt)
            _sync(device)
            times[name].append((time.perf_counter() - t0) / len(batches))
    return {k: statistics.median(v) for k, v in times.items()}


def bench_perf(cfg: Config, log) -> list[dict]:
    """Per backend at world 1: peak memory and step time against plain AMP (a report)."""
    dev = torch.device(cfg.device)
    dim, layers, batch, steps, rounds = _perf_shape(cfg)
    probe = PeakMemory(dev)
    rows = []
    for precision in PRECISIONS:
        batches = _perf_batches(cfg, dev)
        probe.start()
        amp_step, amp_keep, fused = _amp_contender(cfg, precision)
        for ids, tgt in batches[:3]:
            amp_step(ids, tgt)
        amp_peak = probe.read()
        versus = f"autocast {precision} + AdamW(fused={fused})" + (" + GradScaler" if precision == "fp16" else "")
        for backend in cfg.backends:
            if cfg.out_of_time():
                rows.append({"backend": backend, "precision": precision, "ok": False,
                             "error": "not run: the time budget ran out (--budget-s)"})
                log(f"FAIL perf {backend} {precision}: not run: the time budget ran out")
                continue
            probe.start()  # the AMP model stays allocated: it is in the base, not in the peak
            step, acc = _mixprec_contender(cfg, backend, precision)
            try:
                for ids, tgt in batches[:3]:
                    step(ids, tgt)
                peak = probe.read()
                t = _alternate({"torch": amp_step, "mixprec": step}, batches, rounds, dev)
            finally:
                acc.end_training()
            row = {"backend": backend, "precision": precision, "ok": True, "model": f"TinyLM d={dim} x{layers}, batch {batch}",
                   "versus": versus, "amp_peak_mib": amp_peak / 2 ** 20, "mixprec_peak_mib": peak / 2 ** 20,
                   "memory_ratio": peak / amp_peak if amp_peak > 0 else math.nan,
                   "torch_ms": t["torch"] * 1e3, "mixprec_ms": t["mixprec"] * 1e3, "time_ratio": t["mixprec"] / t["torch"],
                   "method": probe.method}
            rows.append(row)
            log(f"perf {backend} {precision} ({row['model']}): peak {row['mixprec_peak_mib']:.1f} MiB vs "
                f"{versus} {row['amp_peak_mib']:.1f} MiB (ratio {row['memory_ratio']:.3f}); step "
                f"{row['mixprec_ms']:.2f} ms vs {row['torch_ms']:.2f} ms (ratio mixprec/torch {row['time_ratio']:.3f})")
        del amp_step, amp_keep
    return rows


# ---- report -----------------------------------------------------------------------------

def write_report(path: Path, cfg: Config, sections: dict, phases: dict, ok: bool, seconds: float) -> None:
    lines = [f"# gpu-check report ({'passed' if ok else 'FAILED'})", ""]
    where = torch.cuda.get_device_name(0) if cfg.device == "cuda" else platform.processor() or "CPU"
    lines += [f"- date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
              f"- device: {cfg.device} ({where}), torch {torch.__version__}, python {platform.python_version()}",
              f"- mode: {'quick' if cfg.quick else 'full'}: TinyLM d={cfg.dim} x{cfg.layers}, batch {cfg.batch}, "
              f"{cfg.steps} steps; {seconds:.0f} s",
              f"- verdict: [Note: the training verdict] in benchmarks/gpu_check.py: every tensor's update, exp_avg "
              f"and exp_avg_sq within e_32 + {ALLOWANCE:g} e_amp of float64", ""]
    lines += ["## Phases", "", "| phase | seconds |", "|---|---|"]
    lines += [f"| {k} | {v:.1f} |" for k, v in phases.items()]
    training = sections.get("training", [])
    lines += ["", "## Training: distance from float64 per tensor", "",
              "| case | ok | worst tensor | e | bound | e/bound | controls failed | least-caught control (x bound) "
              "| reads | sync errors |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in training:
        if r.get("broken") is not None:
            continue
        w, c = r.get("worst"), r.get("controls") or {}
        least = min(c.items(), key=lambda kv: kv[1]["worst_ratio"]) if c else None
        lines.append(
            f"| {r['name']} | {'yes' if r['ok'] else '**no**'} | "
            + (f"{w['tensor']} {w['quantity']} | {_fmt(w['e'])} | {_fmt(w['bound'])} | {w['ratio']:.2f} | "
               if w else "- | - | - | - | ")
            + (f"{sum(x['failed'] for x in c.values())}/{len(c)} | {least[0]} ({least[1]['worst_ratio']:.2f}) | "
               if least else "- | - | ")
            + f"{r.get('reads', {}) or 0} | {len(r.get('sync_errors', []))}"
            + ("" if r.get("syncs_judged", True) else " (not judged: Gloo)") + " |")
    broken = [r for r in training if r.get("broken") is not None]
    if broken:
        lines += ["", "### Really broken optimizers (each must fail)", "", "| case | failed as it must | caught by |",
                  "|---|---|---|"]
        lines += [f"| {r['name']} | {'yes' if r['ok'] else '**NO**'} | {'; '.join(r.get('caught_by', []))[:300]} |"
                  for r in broken]
    problems = [f"- {r['name']}: {p}" for r in training for p in r.get("problems", [])]
    lines += ([""] + problems[:200]) if problems else []
    for r in training[:2]:
        if r.get("rows"):
            lines += ["", f"### Per tensor: {r['name']}", "", "| tensor | quantity | e | e_32 | e_amp | e/bound |",
                      "|---|---|---|---|---|---|"]
            lines += [f"| {x['tensor']} | {x['quantity']} | {_fmt(x['e'])} | {_fmt(x['e32'])} | {_fmt(x['eamp'])} | "
                      f"{x['ratio']:.2f} |" for x in r["rows"]]
    lines += ["", "## Kernels against torch", "", "| kernel | ok | detail | mixprec GB/s | torch GB/s | vs | ratio |",
              "|---|---|---|---|---|---|---|"]
    for r in sections.get("kernels", []):
        g = lambda k: f"{r[k]:.1f}" if k in r else "-"  # noqa: E731
        lines.append(f"| {r['name']} | {'yes' if r['ok'] else '**no**'} | {r['detail']} | {g('mixprec_gbs')} | "
                     f"{g('torch_gbs')} | {r.get('versus', '')} | {r['ratio']:.2f} |" if "ratio" in r else
                     f"| {r['name']} | {'yes' if r['ok'] else '**no**'} | {r['detail']} | - | - | - | - |")
    perf = sections.get("perf", [])
    if perf:
        lines += ["", "## Memory and step time against plain AMP (world 1)", "",
                  "| backend | precision | peak MiB | AMP peak MiB | memory ratio | step ms | torch ms | time ratio |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in perf:
            if not r.get("ok"):
                lines.append(f"| {r['backend']} | {r['precision']} | **{r.get('error', 'failed')}** | | | | | |")
                continue
            lines.append(f"| {r['backend']} | {r['precision']} | {r['mixprec_peak_mib']:.1f} | {r['amp_peak_mib']:.1f} | "
                         f"{r['memory_ratio']:.3f} | {r['mixprec_ms']:.2f} | {r['torch_ms']:.2f} | {r['time_ratio']:.3f} |")
        lines += ["", f"Model: {perf[0].get('model', '')}; torch: {perf[0].get('versus', '')}; memory: "
                  f"{perf[0].get('method', '')}."]
    amp_bf16 = next((r["amp_peak_mib"] for r in perf if r.get("ok") and r["precision"] == "bf16"), None)
    mem2 = [(r["name"], m) for r in training for m in r.get("rank_memory", [])]
    if mem2:
        lines += ["", "## Peak memory per rank at world 2 (bf16)", "", "| case | rank | peak MiB | vs AMP world 1 |",
                  "|---|---|---|---|"]
        lines += [f"| {n} | {m['rank']} | {m['peak_bytes'] / 2 ** 20:.1f} | "
                  f"{(m['peak_bytes'] / 2 ** 20 / amp_bf16) if amp_bf16 else float('nan'):.3f} |" for n, m in mem2]
    crashed = sections.get("crashed", [])
    if crashed:
        lines += ["", "## Sections that raised or did not run", ""] + [f"```\n{c}\n```" for c in crashed]
    slim = {k: [{kk: vv for kk, vv in r.items() if kk != "rows"} if isinstance(r, dict) else r for r in v]
            for k, v in sections.items()}
    lines += ["", "```json", json.dumps(slim, default=str, indent=1)[:200000], "```", ""]
    path.write_text("\n".join(lines))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="small model, 4 steps, world 2 for zero3 only")
    parser.add_argument("--only", choices=("train", "kernels", "perf"), action="append",
                        help="run only these sections (repeatable)")
    parser.add_argument("--backends", help="comma-separated subset of " + ",".join(BACKENDS))
    parser.add_argument("--no-world2", action="store_true", help="skip the 2-process cases")
    parser.add_argument("--broken", action="store_true",
                        help=f"also train with really broken optimizers ({BROKEN_BACKENDS[1]} at world 1, "
                             f"{BROKEN_BACKENDS[2]} at world 2 unless --no-world2); each must fail the verdict")
    parser.add_argument("--tables", action="store_true", help="print every tensor's distances per case")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start nothing new after this many seconds; what is left is reported as FAILED")
    parser.add_argument("--report", default=None, help="write a markdown report here")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu-check: no CUDA device is visible (torch.cuda.is_available() is False); run it on a "
              "machine with an NVIDIA GPU and a CUDA build of torch, or use --device cpu", file=sys.stderr)
        return 2
    if args.budget_s is not None and not args.budget_s > 0:
        parser.error(f"--budget-s {args.budget_s} must be a positive number of seconds")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    cfg = Config(args.device, args.quick)
    if args.backends:
        bad = [b for b in args.backends.split(",") if b not in BACKENDS]
        if bad:
            parser.error(f"--backends {bad} unknown; choose from {','.join(BACKENDS)}")
        cfg.backends = tuple(args.backends.split(","))
        cfg.world2 = tuple(b for b in cfg.world2 if b in cfg.backends)
    cfg.broken, cfg.tables = args.broken, args.tables
    if args.no_world2:
        cfg.world2, cfg.broken_world2 = (), False
    start = time.monotonic()
    if args.budget_s is not None:
        cfg.deadline = start + args.budget_s
    only = args.only or ["train", "kernels", "perf"]
    log = lambda line: print(line, flush=True)  # noqa: E731
    sections, phases, crashed = {}, {}, []
    for section, fn in (("train", lambda: check_training(cfg, log)),
                        ("kernels", lambda: check_kernels(cfg, log)),
                        ("perf", lambda: bench_perf(cfg, log))):
        if section not in only:
            continue
        t0 = time.monotonic()
        key = {"train": "training"}.get(section, section)
        if cfg.out_of_time():
            crashed.append(f"{section}: not run, the time budget ran out (--budget-s)")
            log(f"FAIL {crashed[-1]}")
            continue
        try:
            sections[key] = fn()
        except Exception:  # noqa: BLE001 - loud: the traceback, and the run fails
            crashed.append(f"{section}: {traceback.format_exc()}")
            log(f"FAIL section {section} raised:\n{crashed[-1]}")
        phases[section] = time.monotonic() - t0
        log(f"phase {section}: {phases[section]:.1f} s")
    if crashed:
        sections["crashed"] = crashed
    ok = not crashed and all(r["ok"] for key in ("training", "kernels", "perf") for r in sections.get(key, []))
    seconds = time.monotonic() - start
    print(f"gpu-check ({cfg.device}{', quick' if cfg.quick else ''}): "
          f"{'all checks passed' if ok else 'FAILED (see the FAIL lines)'} in {seconds:.0f} s")
    if args.report:
        path = Path(args.report).resolve()
        write_report(path, cfg, sections, phases, ok, seconds)
        print(f"gpu-check: report written to {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

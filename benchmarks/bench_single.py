"""Single-process step overhead: mixprec vs a plain PyTorch loop (and vs Accelerate).

Same model, precision, optimizer and data for every contender; contenders are run in
alternation (A/B/C, A/B/C, ...) in one process and the median step time of each is
reported, with the ratio to the plain-PyTorch loop. Targets: mixprec/plain <= 1.03,
mixprec/accelerate <= 1.0.

    python benchmarks/bench_single.py                 # bf16 and no, ~2 min
    python benchmarks/bench_single.py --quick         # smoke run
    python benchmarks/bench_single.py --precisions bf16 --rounds 15
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from train_transformer import TinyLM  # noqa: E402

import mixprec  # noqa: E402

AUTOCAST = {"no": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def make_data(steps, batch, seq, vocab):
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randint(0, vocab, (batch, seq), generator=g), torch.randint(0, vocab, (batch, seq), generator=g))
        for _ in range(steps)
    ]


class PlainLoop:
    name = "plain"
    fused = False

    def __init__(self, model, precision):
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=self.fused)
        self.dtype = AUTOCAST[precision]
        self.scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16")

    def step(self, ids, target, loss_fn):
        ctx = torch.autocast("cpu", dtype=self.dtype) if self.dtype else contextlib.nullcontext()
        with ctx:
            logits = self.model(ids)
        loss = loss_fn(logits.float().flatten(0, 1), target.flatten())
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.opt)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.scaler.step(self.opt)
        self.scaler.update()
        self.opt.zero_grad()


class PlainFusedLoop(PlainLoop):
    """The plain loop with torch's own fused CPU AdamW (a stronger baseline)."""

    name = "plain_fused"
    fused = True


class MixprecLoop:
    name = "mixprec"

    def __init__(self, model, precision):
        self.acc = mixprec.Accelerator(mixed_precision=precision, cpu=True, log_policy=False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        self.model, self.opt = self.acc.prepare(model, opt)

    def step(self, ids, target, loss_fn):
        logits = self.model(ids)
        loss = loss_fn(logits.flatten(0, 1), target.flatten())
        self.acc.backward(loss)
        self.acc.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad()


class AccelerateLoop:
    name = "accelerate"

    def __init__(self, model, precision):
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState, GradientState

        # Accelerate keeps process-global singletons; reset them between precisions.
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        self.acc = Accelerator(mixed_precision=precision, cpu=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        self.model, self.opt = self.acc.prepare(model, opt)

    # The loop body is the same call for call: that is the point of the facade.
    step = MixprecLoop.step


def accelerate_available() -> str | None:
    try:
        import accelerate

        return accelerate.__version__
    except ImportError:
        return None


def bench(precision, args):
    torch.manual_seed(0)
    vocab, seq = 256, 64
    base = TinyLM(vocab, dim=args.dim, heads=4, layers=args.layers, seq=seq)
    n_params = sum(p.numel() for p in base.parameters())
    contenders = [PlainLoop, PlainFusedLoop, MixprecLoop]
    if accelerate_available():
        contenders.append(AccelerateLoop)
    loops = [cls(copy.deepcopy(base), precision) for cls in contenders]
    data = make_data(args.steps, args.batch, seq, vocab)
    loss_fn = nn.CrossEntropyLoss()
    for loop in loops:  # warm-up
        for ids, t in data[:2]:
            loop.step(ids, t, loss_fn)
    times = {loop.name: [] for loop in loops}
    for r in range(args.rounds):
        order = loops if r % 2 == 0 else loops[::-1]  # alternate who goes first
        for loop in order:
            start = time.perf_counter()
            for ids, t in data:
                loop.step(ids, t, loss_fn)
            times[loop.name].append((time.perf_counter() - start) / len(data))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\n[{precision}] TinyLM {n_params / 1e6:.2f}M params, batch {args.batch}x{seq}, "
          f"{args.rounds} rounds x {args.steps} steps, AdamW + clip_grad_norm_")
    for name, t in med.items():
        spread = (max(times[name]) - min(times[name])) / t
        print(f"  {name:<11} median step {t * 1e3:8.2f} ms  (spread {spread:5.1%})")
    for base in ("plain", "plain_fused"):
        ratio = med["mixprec"] / med[base]
        print(f"  ratio mixprec/{base:<11} = {ratio:.3f}  (target <= 1.03: {'met' if ratio <= 1.03 else 'MISSED'})")
    if "accelerate" in med:
        r2 = med["mixprec"] / med["accelerate"]
        print(f"  ratio mixprec/accelerate  = {r2:.3f}  (target <= 1.00: {'met' if r2 <= 1.0 else 'MISSED'})")
    return med


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--precisions", default="bf16,no")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--quick", action="store_true", help="tiny model, few rounds (smoke test)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.rounds, args.steps, args.dim, args.layers, args.batch = 3, 3, 64, 1, 8
    print(f"torch {torch.__version__}, mixprec {mixprec.__version__} ({mixprec.build_info()}), "
          f"accelerate {accelerate_available() or 'not installed'}, threads {torch.get_num_threads()}, "
          f"{platform.machine()}")
    for precision in args.precisions.split(","):
        bench(precision.strip(), args)


if __name__ == "__main__":
    main()

"""The per-step cost of Python as the tensor count grows: mixprec against torch at its best.

    python benchmarks/bench_step_scaling.py [--tensors 24 384 1536] [--rounds 7] [--steps 5]

The same ~2M parameters in 24, 384 or 1,536 tensors (LayerNorm + MLP blocks: 6 tensors a
block), bf16 autocast, fp32 parameters, AdamW, clip 1.0. The contenders, built from the same
weights and fed the same batches, alternate round by round (benchmarks/_common.py,
``alternate``):

- ``torch``: plain PyTorch at its best: ``torch.autocast(bf16)``, ``AdamW(fused=True)``,
  ``clip_grad_norm_(model.parameters(), 1.0)`` (foreach), ``zero_grad(set_to_none=True)``.
- ``mixprec``: ``Accelerator(mixed_precision="bf16")``, the loop of the README:
  ``backward``, ``clip_grad_norm_(model.parameters(), 1.0)``, ``step``, ``zero_grad``.

Besides the whole step, the optimizer side (clip + step + zero_grad) is timed alone and split
into the time spent inside the compute entry points (mixprec: every ``mixprec._C`` function;
torch: ``torch._fused_adamw_`` and the ``torch._foreach_*`` ops clip_grad_norm_ calls, plus
``torch.stack``/``linalg.vector_norm``), each timed by a thin wrapper, and the rest: the
Python around them. ``--ddp`` runs the same on 2 processes (torch DDP with
``gradient_as_bucket_view=True`` against mixprec ddp).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

PARAMS = 2_000_000
BATCH, SEQ = 4, 16


def blocks_model(tensors: int, seed: int = 0) -> nn.Module:
    """``tensors // 6`` blocks of LayerNorm + Linear(d, 4d) + Linear(4d, d), d chosen so the
    whole model holds about 2M parameters."""
    n_blocks = max(1, tensors // 6)
    d = max(8, int(round((PARAMS / n_blocks / 8) ** 0.5)))
    torch.manual_seed(seed)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(d)
            self.up = nn.Linear(d, 4 * d)
            self.down = nn.Linear(4 * d, d)

        def forward(self, x):
            return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))

    model = nn.Sequential(*[Block() for _ in range(n_blocks)])
    model.width = d
    return model


class Timed:
    """Wraps callables of a module to add their wall time to ``total`` (seconds)."""

    def __init__(self):
        self.total = 0.0
        self._undo = []

    def wrap(self, owner, name: str) -> None:
        fn = getattr(owner, name, None)
        if fn is None or not callable(fn):
            return

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total += time.perf_counter() - t0

        setattr(owner, name, timed)
        self._undo.append((owner, name, fn))

    def restore(self) -> None:
        for owner, name, fn in reversed(self._undo):
            setattr(owner, name, fn)
        self._undo.clear()


def _torch_compute(timer: Timed) -> None:
    for name in dir(torch):
        if name.startswith("_foreach_") or name in ("_fused_adamw_", "_fused_adam_", "stack"):
            timer.wrap(torch, name)
    timer.wrap(torch.linalg, "vector_norm")


def _mixprec_compute(timer: Timed) -> None:
    from mixprec import _C

    for name in dir(_C):
        if not name.startswith("__") and callable(getattr(_C, name)) and not isinstance(getattr(_C, name), type):
            timer.wrap(_C, name)


def contenders(tensors: int, ddp: bool):
    """(name, make) pairs; make() returns (step(x), optimizer_side_timer)."""
    from mixprec import Accelerator

    def torch_contender():
        model = blocks_model(tensors)
        if ddp:
            model = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        timer = Timed()

        def step(x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x).float().pow(2).mean()
            loss.backward()
            t0 = time.perf_counter()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return time.perf_counter() - t0

        return step, timer, _torch_compute

    def mixprec_contender():
        acc = Accelerator(cpu=True, mixed_precision="bf16", backend="ddp" if ddp else None, log_policy=False)
        model = blocks_model(tensors)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model, opt = acc.prepare(model, opt)
        timer = Timed()

        def step(x):
            with acc.autocast():
                loss = model(x).float().pow(2).mean()
            acc.backward(loss)
            t0 = time.perf_counter()
            acc.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            return time.perf_counter() - t0

        return step, timer, _mixprec_compute

    return [("torch", torch_contender), ("mixprec", mixprec_contender)]


def measure(tensors: int, rounds: int = 7, steps: int = 5, ddp: bool = False, seed: int = 0) -> dict:
    """Median per-step seconds of the whole step, the optimizer side, and the compute part
    of the optimizer side, for each contender; rounds alternate the contenders' order."""
    made = [(name, *make()) for name, make in contenders(tensors, ddp)]
    d = blocks_model(tensors).width
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(BATCH, SEQ, d, generator=g) for _ in range(steps)]
    for _, step, _, _ in made:  # warm-up: state creation, first-step paths
        for x in xs[:2]:
            step(x)
    out = {name: {"step": [], "optimizer": [], "compute": [], "python": []} for name, *_ in made}
    sync = (lambda: torch.distributed.barrier()) if ddp else (lambda: None)
    for r in range(rounds):
        order = made if r % 2 == 0 else made[::-1]
        for name, step, timer, instrument in order:
            # Whole-step time uninstrumented; then one instrumented pass for the split.
            sync()
            t0 = time.perf_counter()
            opt_side = 0.0
            for x in xs:
                opt_side += step(x)
            sync()
            out[name]["step"].append((time.perf_counter() - t0) / steps)
            out[name]["optimizer"].append(opt_side / steps)
            instrument(timer)
            timer.total = 0.0
            inner = 0.0
            try:
                for x in xs:
                    inner += step(x)
            finally:
                timer.restore()
            out[name]["compute"].append(timer.total / steps)
            # Python: the instrumented pass's optimizer side minus its compute (same pass).
            out[name]["python"].append(max(0.0, inner - timer.total) / steps)
    res = {name: {k: statistics.median(v) for k, v in m.items()} for name, m in out.items()}
    res["tensors"] = sum(1 for _ in blocks_model(tensors).parameters())
    return res


def report(res: dict) -> None:
    t, m = res["torch"], res["mixprec"]
    print(f"  {res['tensors']:5d} tensors | step ms: torch {t['step'] * 1e3:7.2f}  mixprec {m['step'] * 1e3:7.2f}"
          f"  mixprec/torch {m['step'] / t['step']:.3f}")
    print(f"                | optimizer side ms: torch {t['optimizer'] * 1e3:6.2f} (compute {t['compute'] * 1e3:6.2f},"
          f" python {t['python'] * 1e3:6.2f})  mixprec {m['optimizer'] * 1e3:6.2f} (compute {m['compute'] * 1e3:6.2f},"
          f" python {m['python'] * 1e3:6.2f})  python mixprec/torch {m['python'] / max(t['python'], 1e-9):.2f}")


def _worker(state, tensors_list, rounds, steps):
    torch.set_num_threads(1)
    return [measure(n, rounds, steps, ddp=True) for n in tensors_list]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tensors", type=int, nargs="+", default=[24, 384, 1536])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--ddp", action="store_true", help="2 processes: torch DDP against mixprec ddp")
    args = parser.parse_args()
    from _common import machine_info

    print(machine_info())
    if args.ddp:
        from mixprec.distributed.spawn import run_distributed

        results = run_distributed(_worker, 2, args=(args.tensors, args.rounds, args.steps), timeout=1800)[0]
        print(f"ddp, 2 processes (1 thread each): median per step over {args.rounds} rounds x {args.steps} steps")
    else:
        results = [measure(n, args.rounds, args.steps) for n in args.tensors]
        print(f"one process, {torch.get_num_threads()} threads: median per step over {args.rounds} rounds x "
              f"{args.steps} steps")
    for res in results:
        report(res)


if __name__ == "__main__":
    main()

"""Optimizer-bound step: wide layers, a tiny batch, fp32 parameters under bf16 autocast.

Most of the step is the optimizer, and fp32 gradients are what most users train with
(``mixed_precision="bf16"`` keeps fp32 weights). Contenders, alternated in one process
(benchmarks/_common.py ``alternate``), same weights and batches:

- ``plain``: plain PyTorch at its best: ``AdamW(fused=True)``, ``torch.amp.GradScaler``
  (its ``unscale_`` is torch's inf/nan check), ``clip_grad_norm_``. The baseline.
- ``plain_noguard``: the same without GradScaler: torch with no inf/nan check at all (a
  loop that would step on a nan gradient). Reported for reference.
- ``mixprec``: ``Accelerator(mixed_precision="bf16")``, ``clip_grad_norm_`` and ``step``
  at their defaults. Two passes over every parameter fewer than torch:
  the clip is applied inside the fused update ([Note: clip inside the update] in
  src/mixprec/engines/base.py), so the gradients are read twice (norm with the inf/nan
  check, update) where torch reads them four times and writes them twice; and the update
  writes the bf16 weights the next forward multiplies by ([Note: the update writes the
  forward's weights] in src/mixprec/engines/weight_casts.py), so the forward does not
  cast the fp32 weights again. Both keep torch's numbers bitwise.
- ``mixprec_inplace``: mixprec with ``clip_in_step=False`` (clip and check in place, the
  passes torch makes): shows what the fused clip is worth on its own.
- ``mixprec_nocache``: mixprec with ``cache_weight_casts=False`` (autocast casts the
  weights in every forward, as torch): shows what the weight copies are worth on their own.
- ``mixprec_native_gemm`` (fp16 only): mixprec with config ``cpu_fp16_matmul: native``,
  torch's own fp16 matmul kernels. By default (``auto``) mixprec runs fp16 matmuls on a
  CPU without fp16 arithmetic as fp32 GEMMs of the fp16 inputs rounded to fp16 ([Note:
  fp16 GEMMs on a CPU without fp16 arithmetic] in src/mixprec/wrappers/half_gemm.py); on
  such a CPU torch's portable fp16 GEMM is most of the step, so this contender shows what
  the optimizer side alone is worth there (``plain / mixprec_native_gemm``).

Target (issue #14): plain / mixprec >= 1.25.

The allocator. Every step frees and reallocates ~300 MB of 16 MB tensors (autocast's bf16
weight copies, the gradients). glibc's malloc hands blocks that big back to the OS on
free, so each step page-faults them in again; that costs more than the optimizer here,
and the same in every contender. PyTorch's CPU tuning guide answers it with a caching
allocator (jemalloc/tcmalloc); this script does the same with glibc's own knobs
(``mallopt``: 32 MB mmap threshold, no trimming), for ALL contenders, before any tensor
is made. ``--no-tune-malloc`` measures the default allocator (smaller ratios: the page
faults are a cost both sides share).

    python benchmarks/bench_optimizer_bound.py              # ~1 min
    python benchmarks/bench_optimizer_bound.py --quick      # smoke run
    python benchmarks/bench_optimizer_bound.py --dim 2048 --layers 3 --precision fp16
    MIXPREC_CPU_CAPABILITY=avx2 python benchmarks/bench_optimizer_bound.py   # an AVX2 machine's kernels
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import os
import platform
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import alternate, n_params, stats  # noqa: E402

import mixprec  # noqa: E402
import mixprec.wrappers.half_gemm  # noqa: E402

TARGET = 1.25


def tune_malloc() -> bool:
    """glibc keeps freed big blocks for reuse (see the module docstring); False if not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
    return libc.mallopt(m_mmap_threshold, 32 * 1024 * 1024) == 1 and libc.mallopt(m_trim_threshold, 2**31 - 1) == 1


def wide_mlp(dim: int, layers: int, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)]
    return nn.Sequential(*blocks)


def batches(rounds: int, steps: int, batch: int, dim: int, seed: int) -> list[list[tuple]]:
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randn(batch, dim, generator=g), torch.randn(batch, dim, generator=g))
             for _ in range(steps)] for _ in range(rounds)]


def plain_step(model: nn.Module, guard: bool, precision: str = "bf16"):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    scaler = torch.amp.GradScaler("cpu", enabled=guard)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16

    def step(x, y):
        with torch.autocast("cpu", dtype=dtype):
            out = model(x)
        loss = nn.functional.mse_loss(out.float(), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        return loss
    return step


def mixprec_step(model: nn.Module, clip_in_step: bool = True, cache_weight_casts: bool = True,
                 precision: str = "bf16", fp16_matmul: str = "auto"):
    acc = mixprec.Accelerator(mixed_precision=precision, cpu=True, log_policy=False, clip_in_step=clip_in_step,
                              cache_weight_casts=cache_weight_casts, config={"cpu_fp16_matmul": fp16_matmul})
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01))

    def step(x, y):
        loss = nn.functional.mse_loss(model(x).float(), y)
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss
    return step


def measure(*, dim: int = 1024, layers: int = 4, batch: int = 2, steps: int = 4, rounds: int = 9,
            tune: bool = True, precision: str = "bf16") -> dict:
    """The five contenders, alternated. ``tune``: tune glibc malloc first (process-wide and
    for good: benchmarks/run_all.py runs this last)."""
    tuned = tune_malloc() if tune else False
    base = wide_mlp(dim, layers)
    contenders = {
        "plain": plain_step(copy.deepcopy(base), guard=True, precision=precision),
        "plain_noguard": plain_step(copy.deepcopy(base), guard=False, precision=precision),
        "mixprec": mixprec_step(copy.deepcopy(base), precision=precision),
        "mixprec_inplace": mixprec_step(copy.deepcopy(base), clip_in_step=False, precision=precision),
        "mixprec_nocache": mixprec_step(copy.deepcopy(base), cache_weight_casts=False, precision=precision),
    }
    if precision == "fp16":
        contenders["mixprec_native_gemm"] = mixprec_step(copy.deepcopy(base), precision=precision,
                                                         fp16_matmul="native")
    data = batches(rounds + 1, steps, batch, dim, seed=0)
    times, losses = alternate(contenders, data[1:], data[0][:2])
    return {"params": n_params(base), "dim": dim, "layers": layers, "batch": batch, "steps": steps,
            "rounds": rounds, "threads": torch.get_num_threads(), "malloc_tuned": tuned, "precision": precision,
            "cpu_capability": os.environ.get("MIXPREC_CPU_CAPABILITY", "best the CPU has"),
            "contenders": {k: stats(v) for k, v in times.items()}, "losses": losses}


def report(res: dict) -> None:
    med = {k: v["median"] for k, v in res["contenders"].items()}
    print(f"\nwide MLP d={res['dim']} x {res['layers']} blocks, {res['params'] / 1e6:.1f}M fp32 params, "
          f"batch {res['batch']}, {res.get('precision', 'bf16')} autocast, AdamW + clip_grad_norm_, "
          f"kernels: {res.get('cpu_capability', 'best the CPU has')}; "
          f"{res['rounds']} rounds x {res['steps']} steps, {res['threads']} threads, "
          f"malloc {'tuned (all contenders)' if res['malloc_tuned'] else 'glibc defaults'}")
    for name, st in res["contenders"].items():
        print(f"  {name:<16} median step {st['median'] * 1e3:8.2f} ms  (spread {st['spread']:5.1%})")
    speedup = med["plain"] / med["mixprec"]
    print(f"  speed-up plain / mixprec           = {speedup:.3f}  "
          f"(target >= {TARGET}: {'met' if speedup >= TARGET else 'MISSED'})")
    print(f"  speed-up plain_noguard / mixprec   = {med['plain_noguard'] / med['mixprec']:.3f}")
    print(f"  mixprec_inplace / mixprec          = {med['mixprec_inplace'] / med['mixprec']:.3f}")
    print(f"  mixprec_nocache / mixprec          = {med['mixprec_nocache'] / med['mixprec']:.3f}")
    if "mixprec_native_gemm" in med:
        ratio = med["plain"] / med["mixprec_native_gemm"]
        print(f"  speed-up plain / mixprec_native_gemm = {ratio:.3f}  (the optimizer side alone, torch's fp16 "
              f"GEMMs in both: target >= {TARGET}: {'met' if ratio >= TARGET else 'MISSED'}; "
              f"widened GEMMs {'on' if mixprec.wrappers.half_gemm.wanted('auto') else 'off'} by default here)")
    # Same batches, same start: the loss curves must agree (bf16 autocast: not bitwise).
    last = {k: v[-1] for k, v in res["losses"].items()}
    print("  last loss: " + ", ".join(f"{k} {v:.5f}" for k, v in last.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--quick", action="store_true", help="small model, few rounds (smoke test)")
    ap.add_argument("--no-tune-malloc", action="store_true", help="leave glibc malloc at its defaults")
    ap.add_argument("--precision", choices=["bf16", "fp16"], default="bf16",
                    help="autocast dtype (fp16: GradScaler for plain, mixprec's scaler)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.dim, args.layers, args.rounds, args.steps = 256, 2, 3, 2
    print(f"torch {torch.__version__}, mixprec {mixprec.__version__} ({mixprec.build_info()}), "
          f"threads {torch.get_num_threads()}, {platform.machine()}")
    report(measure(dim=args.dim, layers=args.layers, batch=args.batch, steps=args.steps, rounds=args.rounds,
                   tune=not args.no_tune_malloc, precision=args.precision))


if __name__ == "__main__":
    main()

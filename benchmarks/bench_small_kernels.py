"""Small multi-tensor kernels (CPU) at 1 and 2 intra-op threads, on an idle, a spaced and an
oversubscribed machine, against torch's foreach ops in the same process.

A parallel region (at::parallel_for; OpenMP in torch's CPU builds) returns only when every
thread of the team has joined it. A thread whose core is busy, or whose (virtual) CPU went
idle while it slept, joins a scheduler time slice later: milliseconds, however small the
call (issue #38). csrc/kernels/cpu/launcher.h runs calls below a work threshold inline
([Note: inline below the parallel threshold]); this script measures what a call costs.

Layouts (fp32):
  4x16k   4 tensors of 16,384 elements (65,536 in all)
  1536t   1,536 tensors, 2.05M elements (128 blocks of 12 tensors: [d,3d] [3d] [d,d] [d]
          [d,4d] [4d] [4d,d] [d] and four [d], d=36): many small tensors
Ops, mixprec vs torch doing the same work at its best:
  l2_norm             vs torch.linalg.vector_norm(torch.stack(torch._foreach_norm(ts)))
                         (clip_grad_norm_'s foreach path)
  unscale_and_check_  vs torch._amp_foreach_non_finite_check_and_unscale_
  fused_adam_ (AdamW) vs torch._fused_adamw_ (what AdamW(fused=True) calls)
plus one diagnostic row: torch.add on one 65,536-element tensor, which torch itself splits
over its threads (65,536 > at::internal::GRAIN_SIZE = 32,768): what the same machine does
to any small parallel region.

Machine states, each at 1 and 2 threads:
  idle    calls back to back
  spaced  ``--gap-ms`` (30) of sleep before each call, as a kernel that runs once per
          training step: the pool's threads have gone to sleep when the call comes
  loaded  calls back to back while ``--spinners`` busy-looping processes (default 2 per
          core) run: more runnable threads than cores
Each cell runs the contenders alternately call by call and prints the per-call median and
90th percentile in microseconds, and the ratio of the medians (mixprec / torch: below 1 is
faster). Then fused_adam_ over 6 x 2048x2048 at 1 and 2 threads on the idle machine,
against torch._fused_adamw_: large work must still use both threads.

    python benchmarks/bench_small_kernels.py            # ~1.5 min
    python benchmarks/bench_small_kernels.py --quick    # fewer calls, no large case
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

from mixprec import kernels as K

ADAMW = dict(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def layout_small() -> list[tuple]:
    return [(16384,)] * 4


def layout_many(d: int = 36, blocks: int = 128) -> list[tuple]:
    block = [(d, 3 * d), (3 * d,), (d, d), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,), (d,), (d,), (d,), (d,)]
    return block * blocks


class State:
    """One set of AdamW tensors (params, grads, moments, step counters) of a layout."""

    def __init__(self, shapes: list[tuple], seed: int):
        g = torch.Generator().manual_seed(seed)
        self.params = [torch.randn(s, generator=g) * 0.02 for s in shapes]
        self.grads = [torch.randn(s, generator=g) * 1e-3 for s in shapes]
        self.m = [torch.zeros(s) for s in shapes]
        self.v = [torch.zeros(s) for s in shapes]
        self.steps = [torch.tensor(10.0) for _ in shapes]


def contenders(shapes: list[tuple]) -> dict[str, tuple]:
    """name -> (mixprec call, torch call), on separate copies of the same tensors."""
    a, b = State(shapes, 0), State(shapes, 0)
    found_a, found_b = torch.zeros(1), torch.zeros(1)
    one = torch.ones(1)  # inv_scale 1.0: the grads keep their values call after call
    return {
        "l2_norm": (lambda: K.l2_norm(a.grads),
                    lambda: torch.linalg.vector_norm(torch.stack(torch._foreach_norm(b.grads)))),
        "unscale_and_check_": (lambda: K.unscale_and_check_(a.grads, found_a, one),
                               lambda: torch._amp_foreach_non_finite_check_and_unscale_(b.grads, found_b, one)),
        "fused_adam_ (AdamW)": (
            lambda: K.fused_adam_(a.params, a.grads, a.m, a.v, [], step=10.0, decoupled=True, maximize=False,
                                  inv_scale=None, found_inf=None,
                                  **ADAMW),
            lambda: torch._fused_adamw_(b.params, b.grads, b.m, b.v, [], b.steps, amsgrad=False, maximize=False,
                                        **ADAMW)),
    }


def per_call(fns: list, calls: int, gap: float = 0.0) -> list[list[float]]:
    """Seconds per call of each fn, the fns called alternately (a b a b ...) after a warm-up;
    ``gap``: seconds of sleep before each call."""
    for fn in fns:
        fn(), fn()
    out: list[list[float]] = [[] for _ in fns]
    for _ in range(calls):
        for fn, acc in zip(fns, out):
            if gap:
                time.sleep(gap)
            t0 = time.perf_counter()
            fn()
            acc.append(time.perf_counter() - t0)
    return out


def summary(samples: list[float]) -> dict:
    s = sorted(samples)
    return {"median_us": statistics.median(s) * 1e6, "p90_us": s[int(0.9 * (len(s) - 1))] * 1e6}


def measure_cell(threads: int, calls: dict[str, int], gap: float = 0.0) -> dict:
    """Every layout x op at ``threads`` intra-op threads (restored on return)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rows = []
        for layout, shapes in (("4x16k", layout_small()), ("1536t", layout_many())):
            for op, (mine, theirs) in contenders(shapes).items():
                tm, tt = per_call([mine, theirs], calls[layout], gap)
                rows.append({"layout": layout, "op": op, "mixprec": summary(tm), "torch": summary(tt)})
        flat, flat_out = torch.randn(65536), torch.empty(65536)
        (tf,) = per_call([lambda: torch.add(flat, 1.0, out=flat_out)], calls["4x16k"], gap)
        rows.append({"layout": "1x64k", "op": "torch add (diagnostic)", "mixprec": None,
                     "torch": summary(tf)})
        return {"threads": threads, "rows": rows}
    finally:
        torch.set_num_threads(previous)


def start_spinners(n: int) -> list[subprocess.Popen]:
    code = "while True:\n    pass\n"
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(n)]


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


def measure_large(repeats: int) -> list[dict]:
    """fused_adam_ over 6 x 2048x2048 vs torch._fused_adamw_ at 1 and 2 threads (idle)."""
    shapes = [(2048, 2048)] * 6
    mine, theirs = contenders(shapes)["fused_adam_ (AdamW)"]
    out = []
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            tm, tt = per_call([mine, theirs], repeats)
            out.append({"threads": threads, "mixprec_ms": statistics.median(tm) * 1e3,
                        "torch_ms": statistics.median(tt) * 1e3})
    finally:
        torch.set_num_threads(previous)
    return out


def measure(quick: bool = False, spinners: int | None = None, gap_ms: float = 30.0) -> dict:
    calls = {"4x16k": 100, "1536t": 15} if quick else {"4x16k": 400, "1536t": 40}
    spaced_calls = {"4x16k": 10, "1536t": 5} if quick else {"4x16k": 30, "1536t": 15}
    spinners = spinners if spinners is not None else 2 * (os.cpu_count() or 1)
    res: dict = {"cpus": os.cpu_count(), "spinners": spinners, "gap_ms": gap_ms, "cells": []}
    for state in ("idle", "spaced", "loaded"):
        procs = start_spinners(spinners) if state == "loaded" else []
        try:
            if procs:
                time.sleep(1.0)  # let the spinners reach the run queue
            for threads in (1, 2):
                if state == "spaced":
                    cell = measure_cell(threads, spaced_calls, gap_ms / 1e3)
                else:
                    cell = measure_cell(threads, calls)
                cell.update(state=state, load=os.getloadavg()[0])
                res["cells"].append(cell)
        finally:
            stop(procs)
    if not quick:
        res["large"] = measure_large(5)
    return res


def fmt_us(x: float) -> str:
    return f"{x:9.1f}"


def report(res: dict) -> None:
    print(f"{res['cpus']} CPUs; idle: calls back to back; spaced: {res['gap_ms']:g} ms of sleep before each call; "
          f"loaded: calls back to back with {res['spinners']} busy-looping processes running alongside")
    print(f"{'state':6s} {'thr':>3s} {'layout':6s} {'op':32s} {'mixprec med':>11s} {'p90':>9s} "
          f"{'torch med':>11s} {'p90':>9s} {'ratio':>6s}   (us per call; ratio = mixprec/torch medians)")
    for cell in res["cells"]:
        for r in cell["rows"]:
            t = r["torch"]
            if r["mixprec"] is None:
                mine, ratio = f"{'':>11s} {'':>9s}", f"{'':>6s}"
            else:
                m = r["mixprec"]
                mine = f"{m['median_us']:11.1f} {m['p90_us']:9.1f}"
                ratio = f"{m['median_us'] / t['median_us']:6.2f}"
            print(f"{cell['state']:6s} {cell['threads']:3d} {r['layout']:6s} {r['op']:32s} {mine} "
                  f"{t['median_us']:11.1f} {t['p90_us']:9.1f} {ratio}")
        print(f"       (load average during the cell: {cell['load']:.1f})")
    for r in res.get("large", []):
        print(f"large: fused_adam_ 6 x 2048x2048, {r['threads']} thread(s): mixprec {r['mixprec_ms']:.1f} ms, "
              f"torch._fused_adamw_ {r['torch_ms']:.1f} ms, ratio {r['mixprec_ms'] / r['torch_ms']:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer calls, no large case")
    ap.add_argument("--spinners", type=int, default=None, help="busy processes when loaded (default 2 per CPU)")
    ap.add_argument("--gap-ms", type=float, default=30.0, help="sleep before each call when spaced")
    args = ap.parse_args()
    report(measure(args.quick, args.spinners, args.gap_ms))


if __name__ == "__main__":
    main()

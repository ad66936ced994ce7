"""Cost of collective desync detection ([Note: desync detection] in
src/mixprec/distributed/watchdog.py).

Three figures:

* the main thread's cost of one *tracked* call (``backward``, ``optimizer.step``,
  ``clip_grad_norm_``: local bookkeeping only), measured in this process on a no-op;
* the cost of one *checked* call (``gather`` of one element: two store round trips
  before the Gloo all-gather), on 2 processes, check on vs off;
* a tiny 2-process ddp training step (backward, clip_grad_norm_, optimizer.step,
  zero_grad) with detection on vs off: same processes, rounds alternating on/off, median
  of per-step times, slowest rank. "off" stops the watchdog thread too.

    python benchmarks/bench_desync_check.py
    python benchmarks/bench_desync_check.py --dim 256 --rounds 9
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch
from torch import nn

from mixprec.distributed import watchdog as desync
from mixprec.distributed.spawn import run_distributed


def tracked_call_overhead(n: int = 200_000) -> dict:
    """Seconds per call of a tracked no-op minus a plain no-op (a watchdog is active, its
    thread and store are not needed for the main thread's part)."""

    def noop(x):
        return x

    wrapped = desync.tracked("noop")(noop)
    saved = desync._ACTIVE[0]
    desync._ACTIVE[0] = desync.Watchdog(0, 2, ("127.0.0.1", 0), 30.0, "bench/")
    try:
        best = {}
        for name, fn in (("plain", noop), ("tracked", wrapped)) * 3:
            start = time.perf_counter()
            for i in range(n):
                fn(i)
            per = (time.perf_counter() - start) / n
            best[name] = min(best.get(name, per), per)
    finally:
        desync._ACTIVE[0] = saved
    return {"plain_s": best["plain"], "tracked_s": best["tracked"], "overhead_s": best["tracked"] - best["plain"]}


def _switch(wd, on: bool) -> None:
    """Detection on (thread running, tracked calls recorded) or off (thread stopped)."""
    if on and desync._ACTIVE[0] is None:
        wd._stop = threading.Event()
        wd._thread = threading.Thread(target=wd._run, name="mixprec-desync-watchdog", daemon=True)
        wd._thread.start()
        desync._ACTIVE[0] = wd
    elif not on and desync._ACTIVE[0] is not None:
        wd._stop.set()
        wd._thread.join()
        desync._ACTIVE[0] = None


def _rank(state, dim: int, rounds: int, steps: int, gathers: int) -> dict:
    from mixprec import Accelerator

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, 1))
    acc = Accelerator(backend="ddp", log_policy=False, cpu=True)
    wd = acc._watchdog
    assert wd is not None, "detection is off: collective_timeout is null in the config/environment"
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-3))
    x = torch.randn(8, dim)
    one = torch.ones(1)

    def step() -> None:
        acc.backward(model(x).square().mean())
        acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()

    for _ in range(5):
        step()
    times: dict[str, list[float]] = {"on": [], "off": [], "gather_on": [], "gather_off": []}
    for r in range(rounds):
        for mode in (("on", "off") if r % 2 == 0 else ("off", "on")):
            _switch(wd, mode == "on")
            acc.wait_for_everyone()
            start = time.perf_counter()
            for _ in range(steps):
                step()
            times[mode].append((time.perf_counter() - start) / steps)
            acc.wait_for_everyone()
            start = time.perf_counter()
            for _ in range(gathers):
                acc.gather(one)
            times[f"gather_{mode}"].append((time.perf_counter() - start) / gathers)
    _switch(wd, True)
    acc.end_training()
    return {k: statistics.median(v) for k, v in times.items()}


def measure(dim: int = 64, rounds: int = 7, steps: int = 20, gathers: int = 20) -> dict:
    results = run_distributed(_rank, 2, args=(dim, rounds, steps, gathers), timeout=600)
    out = {k: max(r[k] for r in results) for k in results[0]}
    out.update(dim=dim, ratio=out["on"] / out["off"], gather_ratio=out["gather_on"] / out["gather_off"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--gathers", type=int, default=20)
    a = ap.parse_args()
    c = tracked_call_overhead()
    print(f"tracked call (main thread, no communication): {c['tracked_s'] * 1e6:.2f} us vs "
          f"{c['plain_s'] * 1e6:.2f} us for a plain call: overhead {c['overhead_s'] * 1e6:.2f} us per call")
    r = measure(a.dim, a.rounds, a.steps, a.gathers)
    print(f"checked call, gather of 1 element on 2 processes: {r['gather_on'] * 1e6:.0f} us with the "
          f"check, {r['gather_off'] * 1e6:.0f} us without: ratio {r['gather_ratio']:.2f}")
    print(f"ddp N=2, MLP dim {r['dim']}, step = backward + clip_grad_norm_ + optimizer.step (3 tracked "
          f"calls): {r['on'] * 1e3:.3f} ms with detection, {r['off'] * 1e3:.3f} ms without: "
          f"ratio {r['ratio']:.3f}")


if __name__ == "__main__":
    main()

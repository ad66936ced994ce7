"""Cost of zero3/fsdp's unit order check ([Note: unit order check] in
src/mixprec/engines/units.py): one small all-gather before each unit gather.

Same processes, same model, rounds alternating check on / off; the ratio of median step
times (slowest rank) is printed, with the number of checks per step.

    python benchmarks/bench_unit_check.py                 # 2 processes, zero3, 8 units
    python benchmarks/bench_unit_check.py --units 16 --dim 128
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from mixprec.distributed.spawn import run_distributed


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


def _rank(state, backend: str, units: int, dim: int, rounds: int, steps: int) -> dict:
    from mixprec import Accelerator

    torch.manual_seed(0)
    model = nn.Sequential(*[Block(dim) for _ in range(units)], nn.Linear(dim, 1))
    acc = Accelerator(mixed_precision="bf16", backend=backend, log_policy=False,
                      engine_options={"units": ["Block"]})
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    runner = acc.engine.comm.runners[id(model)]
    check = runner.check_order
    calls = {"n": 0}
    counting = lambda index: (calls.__setitem__("n", calls["n"] + 1), check(index))  # noqa: E731
    x = torch.randn(16, dim)

    def step() -> None:
        acc.backward(model(x).square().mean())
        opt.step()
        opt.zero_grad()

    for _ in range(3):
        step()
    runner.check_order = counting
    step()
    checks_per_step = calls["n"]
    times: dict[str, list[float]] = {"on": [], "off": []}
    for r in range(rounds):
        for mode in (("on", "off") if r % 2 == 0 else ("off", "on")):
            runner.check_order = check if mode == "on" else None
            acc.wait_for_everyone()
            start = time.perf_counter()
            for _ in range(steps):
                step()
            times[mode].append((time.perf_counter() - start) / steps)
    acc.end_training()
    return {"on": statistics.median(times["on"]), "off": statistics.median(times["off"]),
            "checks_per_step": checks_per_step}


def measure(backend: str = "zero3", world: int = 2, units: int = 8, dim: int = 64,
            rounds: int = 7, steps: int = 10) -> dict:
    results = run_distributed(_rank, world, args=(backend, units, dim, rounds, steps), timeout=600)
    on = max(r["on"] for r in results)
    off = max(r["off"] for r in results)
    return {"backend": backend, "world": world, "units": units, "dim": dim, "step_on_s": on,
            "step_off_s": off, "ratio": on / off, "checks_per_step": results[0]["checks_per_step"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="zero3", choices=["zero3", "fsdp"])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--units", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=10)
    a = ap.parse_args()
    r = measure(a.backend, a.world, a.units, a.dim, a.rounds, a.steps)
    print(f"{r['backend']} N={r['world']}, {r['units']} units of dim {r['dim']}: "
          f"{r['checks_per_step']} unit-order checks per step; step {r['step_on_s'] * 1e3:.2f} ms with the "
          f"check, {r['step_off_s'] * 1e3:.2f} ms without: ratio {r['ratio']:.3f}")


if __name__ == "__main__":
    main()

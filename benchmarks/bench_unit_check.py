"""zero3 step time against torch ``fully_shard`` per block, with and without the unit order
check ([Note: unit order check] in src/mixprec/engines/units.py), at growing unit counts.

2 processes over Gloo, fp32 parameters and reduction, bf16 autocast, AdamW; a stack of ``U``
residual MLP blocks, each block one sharding unit (plus the root) for both contenders:

- ``zero3``: mixprec's default (the unit order check on);
- ``zero3_nocheck``: ``check_unit_order: false``;
- ``torch_fsdp2``: torch ``fully_shard`` on every block and the root (fp32, CPU mesh,
  SUM-only collectives since Gloo has no AVG reduce-scatter), ``AdamW(fused=True)``, the
  forward under ``torch.autocast("cpu", bfloat16)``.

All three run in the same processes on the same weights and batches, in rounds whose order
alternates (benchmarks/_common.py's protocol); the medians (and the fastest rounds, less
moved by a loaded machine) of the slowest rank's step time, their ratios, and the number of
the check's collectives per step (all-gathers issued from units.py, counted over one step)
are printed.

    python benchmarks/bench_unit_check.py                       # units 4, 64, 256
    python benchmarks/bench_unit_check.py --units 8 --dim 128 --rounds 9
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import alternate, stats  # noqa: E402

from mixprec.distributed.spawn import run_distributed  # noqa: E402

CONTENDERS = ("zero3", "zero3_nocheck", "torch_fsdp2")


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


def _model(units: int, dim: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(dim) for _ in range(units)], nn.Linear(dim, 1))


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().square().mean()


def _mixprec(base: nn.Module, check: bool):
    from mixprec import Accelerator

    acc = Accelerator(mixed_precision="bf16", backend="zero3", cpu=True, log_policy=False,
                      engine_options={"units": ["Block"], "check_unit_order": check})
    model = copy.deepcopy(base)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))

    def step(x, _):
        loss = _loss(model(x))
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        return loss

    return step, acc


def _fsdp2(base: nn.Module, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = copy.deepcopy(base)
    mesh = init_device_mesh("cpu", (world,))
    for m in model.modules():
        if isinstance(m, Block):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.set_force_sum_reduction_for_comms(True)  # Gloo has no AVG reduce-scatter
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step(x, _):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        loss = _loss(out)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


def _check_collectives_per_step(step, x) -> int:
    """All-gathers units.py issues during one step (the unit order check's collectives:
    the parameter gathers run in the C++ core, not through Python)."""
    from mixprec.engines import units

    original = units._all_gather
    count = [0]

    def counting(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    units._all_gather = counting
    try:
        step(x, None)
    finally:
        units._all_gather = original
    return count[0]


def _rank(state, sizes: list[int], dim: int, batch: int, rounds: int, steps: int) -> list[dict]:
    import torch.distributed as dist

    world = dist.get_world_size()
    out = []
    for units in sizes:
        base = _model(units, dim)
        contenders, accs = {}, []
        for name in CONTENDERS:
            if name == "torch_fsdp2":
                contenders[name] = _fsdp2(base, world)
            else:
                contenders[name], acc = _mixprec(base, check=name == "zero3")
                accs.append(acc)
        g = torch.Generator().manual_seed(100 + dist.get_rank())
        x = torch.randn(batch, dim, generator=g)
        data = [[(x, None)] * steps for _ in range(rounds)]
        times, _ = alternate(contenders, data, [(x, None)] * 2, distributed=True)
        checks = {name: _check_collectives_per_step(contenders[name], x) for name in ("zero3", "zero3_nocheck")}
        out.append({"units": units, "dim": dim, "median": {k: stats(v)["median"] for k, v in times.items()},
                    "min": {k: stats(v)["min"] for k, v in times.items()},
                    "spread": {k: stats(v)["spread"] for k, v in times.items()}, "checks_per_step": checks})
        for acc in accs:
            acc.end_training()
        del contenders, accs
    return out


def measure(sizes=(4, 64, 256), world: int = 2, dim: int = 64, batch: int = 16, rounds: int = 7,
            steps: int = 5) -> list[dict]:
    return run_distributed(_rank, world, args=(list(sizes), dim, batch, rounds, steps), timeout=3600)[0]


def report(results: list[dict]) -> None:
    for r in results:
        m = r["median"]
        print(f"zero3 N=2, {r['units']} units (blocks of dim {r['dim']}) + root, fp32 params, bf16 autocast: "
              f"unit-order check collectives/step {r['checks_per_step']['zero3']} "
              f"(off: {r['checks_per_step']['zero3_nocheck']})")
        print(f"  step ms: zero3 {m['zero3'] * 1e3:.2f}, zero3_nocheck {m['zero3_nocheck'] * 1e3:.2f}, "
              f"torch_fsdp2 {m['torch_fsdp2'] * 1e3:.2f}   (spread "
              + ", ".join(f"{k} {v:.2f}" for k, v in r["spread"].items()) + ")")
        for label, t in (("median", m), ("fastest round", r["min"])):
            print(f"  {label}: ratio vs torch_fsdp2: zero3 {t['zero3'] / t['torch_fsdp2']:.3f}, zero3_nocheck "
                  f"{t['zero3_nocheck'] / t['torch_fsdp2']:.3f}; check cost zero3/zero3_nocheck "
                  f"{t['zero3'] / t['zero3_nocheck']:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--units", type=int, nargs="+", default=[4, 64, 256])
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args()
    report(measure(a.units, dim=a.dim, batch=a.batch, rounds=a.rounds, steps=a.steps))


if __name__ == "__main__":
    main()

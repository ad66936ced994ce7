"""Scalar reads (host syncs on a GPU) and Python -> C++ crossings per training step, for
every backend in bf16 and fp16 ([Note: counting host syncs] in
src/mixprec/diagnostics/syncs.py), next to plain PyTorch at its best
(``AdamW(fused=True)``, ``torch.amp.GradScaler`` for fp16, ``clip_grad_norm_``).

A step is forward, ``backward``, ``clip_grad_norm_``, ``step``, ``zero_grad`` on the TinyLM
of examples/train_transformer.py; 2 processes over Gloo for the distributed backends.

    python benchmarks/count_syncs.py                  # every backend, bf16 and fp16
    python benchmarks/count_syncs.py --backends zero2 --precisions fp16 --by-name
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mixprec.distributed.spawn import run_distributed  # noqa: E402

BACKENDS = ("single", "ddp", "zero1", "zero2", "zero3", "fsdp")


def measure(acc, model, opt, batches, warmup: int = 2) -> dict:
    """Reads and crossings per step, averaged over the steps after ``warmup``."""
    from _common import lm_loss

    from mixprec.diagnostics.syncs import Crossings, ScalarReads

    def step(ids, tgt):
        with acc.accumulate(model):
            loss = lm_loss(model(ids), tgt)
            acc.backward(loss)
            acc.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()

    for ids, tgt in batches[:warmup]:
        step(ids, tgt)
    measured = batches[warmup:]
    with ScalarReads() as reads, Crossings() as calls:
        for ids, tgt in measured:
            step(ids, tgt)
    n = len(measured)
    return {"reads": reads.count / n, "crossings": calls.count / n,
            "reads_by_op": {k: v / n for k, v in reads.by_op.items()},
            "crossings_by_name": {k: v / n for k, v in calls.by_name.items()}}


def _rank(state, backend: str, precision: str, steps: int) -> dict:
    from _common import round_batches, tinylm

    from mixprec import Accelerator

    options = {"check_unit_order": False} if backend in ("zero3", "fsdp") else {}
    acc = Accelerator(mixed_precision=precision, backend=backend, log_policy=False,
                      engine_options=options)
    model = tinylm(64, 2)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    batches = round_batches(1, steps + 2, 4, seed=1 + acc.process_index)[0]
    return measure(acc, model, opt, batches)


def torch_baseline(precision: str, steps: int) -> dict:
    """Plain PyTorch at its best, counted the same way (one process)."""
    from _common import round_batches, tinylm, torch_amp_step

    from mixprec.diagnostics.syncs import Crossings, ScalarReads

    model = tinylm(64, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    batches = round_batches(1, steps + 2, 4, seed=1)[0]
    step = torch_amp_step(model, opt, precision, "cpu")

    for ids, tgt in batches[:2]:
        step(ids, tgt)
    with ScalarReads() as reads, Crossings() as calls:
        for ids, tgt in batches[2:]:
            step(ids, tgt)
    return {"reads": reads.count / steps, "crossings": calls.count / steps,
            "reads_by_op": {k: v / steps for k, v in reads.by_op.items()}, "crossings_by_name": {}}


def run(backend: str, precision: str, steps: int = 3) -> dict:
    if backend == "torch":
        return torch_baseline(precision, steps)
    world = 1 if backend == "single" else 2
    results = run_distributed(_rank, world, args=(backend, precision, steps))
    return max(results, key=lambda r: (r["reads"], r["crossings"]))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", nargs="+", default=["torch", *BACKENDS])
    parser.add_argument("--precisions", nargs="+", default=["bf16", "fp16"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--by-name", action="store_true", help="list the reads and crossings by name")
    args = parser.parse_args(argv)
    print(f"{'backend':8} {'precision':9} {'reads/step':>10} {'C++ calls/step':>15}")
    for backend in args.backends:
        for precision in args.precisions:
            r = run(backend, precision, args.steps)
            print(f"{backend:8} {precision:9} {r['reads']:10.2f} {r['crossings']:15.2f}", flush=True)
            if args.by_name:
                for k, v in sorted(r["reads_by_op"].items()):
                    print(f"    read  {k}: {v:g}")
                for k, v in sorted(r["crossings_by_name"].items()):
                    print(f"    call  {k}: {v:g}")


if __name__ == "__main__":
    main()

"""The GPU half of `make gpu-check` (.ci/gpu_check.sh builds mixprec with CUDA and runs the
CUDA kernel tests first). Needs a CUDA device; exits 2 without one.

1. Trains every backend on one GPU, bf16 and fp16: world size 1 (NCCL, the group mixprec
   creates itself) and 2 processes sharing the device over Gloo with CUDA tensors. Each run
   counts the scalar reads per step ([Note: counting host syncs] in
   src/mixprec/diagnostics/syncs.py; expected 0) and compares its losses with the same run
   on the CPU (same weights, same batches; tolerance 3e-2 relative: GPU and CPU autocast
   use different matmul kernels, so bf16/fp16 roundings differ).
2. Times a single-GPU TinyLM step against plain PyTorch at its best (AdamW(fused=True),
   torch.amp.GradScaler for fp16, clip_grad_norm_) and prints the ratio and both read counts.

    python benchmarks/gpu_check.py                 # everything (about 5 minutes on an H100)
    python benchmarks/gpu_check.py --only train    # or: bench
Prints one line per case and a summary; exits 1 when a case failed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

BACKENDS = ("single", "ddp", "zero1", "zero2", "zero3", "fsdp")
STEPS, WARMUP = 8, 2
TOLERANCE = 3e-2


def _train(device: str, backend: str, precision: str, rank_seed: int) -> dict:
    """Losses and scalar reads of STEPS TinyLM steps on ``device``."""
    from _common import lm_loss, round_batches, tinylm

    from mixprec import Accelerator
    from mixprec.diagnostics.syncs import ScalarReads

    acc = Accelerator(mixed_precision=precision, backend=backend, cpu=device == "cpu",
                      log_policy=False)
    model = tinylm(128, 2)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    batches = round_batches(1, STEPS, 8, seed=1 + rank_seed)[0]
    losses, reads = [], ScalarReads()
    for i, (ids, tgt) in enumerate(batches):
        ids, tgt = ids.to(acc.device), tgt.to(acc.device)
        if i == WARMUP:
            reads.__enter__()
        loss = lm_loss(model(ids), tgt)
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    reads.__exit__(None, None, None)
    acc.end_training()
    return {"losses": [float(x) for x in losses], "reads": reads.count / (STEPS - WARMUP),
            "by_op": dict(reads.by_op)}


def _rank(state, device, backend, precision):
    return _train(device, backend, precision, state.rank)


def case(device: str, backend: str, precision: str, world: int) -> dict:
    if world == 1:
        return _train(device, backend, precision, 0)
    from mixprec.distributed.spawn import run_distributed

    results = run_distributed(_rank, world, args=(device, backend, precision), timeout=600)
    return {"losses": results[0]["losses"], "reads": max(r["reads"] for r in results),
            "by_op": results[0]["by_op"]}


def _subprocess_case(device: str, backend: str, precision: str, world: int) -> dict:
    # One process per case: each builds (and tears down) its own process group.
    out = subprocess.run([sys.executable, __file__, "--case", device, backend, precision, str(world)],
                         capture_output=True, text=True, timeout=900)
    for line in reversed(out.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {"error": (out.stderr or out.stdout)[-2000:]}


def check_training() -> bool:
    ok = True
    for world in (1, 2):
        for backend in BACKENDS:
            if backend == "single" and world == 2:
                continue
            for precision in ("bf16", "fp16"):
                gpu = _subprocess_case("cuda", backend, precision, world)
                cpu = _subprocess_case("cpu", backend, precision, world)
                name = f"{backend:6} {precision} world={world}"
                if "error" in gpu or "error" in cpu:
                    ok = False
                    print(f"FAIL {name}: {(gpu.get('error') or cpu.get('error')).strip()}")
                    continue
                worst = max(abs(g - c) / max(abs(c), 1e-6) for g, c in zip(gpu["losses"], cpu["losses"]))
                good = worst <= TOLERANCE and gpu["reads"] == 0
                ok &= good
                print(f"{'ok  ' if good else 'FAIL'} {name}: reads/step {gpu['reads']:g} "
                      f"{gpu['by_op'] or ''}, worst loss difference vs CPU {worst:.2e} "
                      f"(final {gpu['losses'][-1]:.4f} vs {cpu['losses'][-1]:.4f})", flush=True)
    return ok


def bench(rounds: int = 7, steps: int = 20) -> None:
    from _common import lm_loss, round_batches, tinylm, torch_amp_step

    from mixprec import Accelerator
    from mixprec.diagnostics.syncs import ScalarReads

    dev = torch.device("cuda")
    for precision in ("bf16", "fp16"):
        batches = [(i.to(dev), t.to(dev)) for i, t in round_batches(1, steps, 32, seed=3)[0]]
        ref = tinylm(512, 6).to(dev)
        torch_step = torch_amp_step(ref, torch.optim.AdamW(ref.parameters(), lr=1e-4, fused=True),
                                    precision, "cuda")

        acc = Accelerator(mixed_precision=precision, log_policy=False)
        mine = tinylm(512, 6)  # the same seeded weights as `ref`
        model, opt = acc.prepare(mine, torch.optim.AdamW(mine.parameters(), lr=1e-4))

        def ours(ids, tgt):
            acc.backward(lm_loss(model(ids), tgt))
            acc.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()

        times = {"torch": [], "mixprec": []}
        reads = {}
        for name, fn in (("torch", torch_step), ("mixprec", ours)):
            for ids, tgt in batches[:3]:
                fn(ids, tgt)
            with ScalarReads() as r:
                fn(*batches[3])
            reads[name] = r.count
        for r in range(rounds):
            for name, fn in ((("torch", torch_step), ("mixprec", ours)) if r % 2 == 0
                             else (("mixprec", ours), ("torch", torch_step))):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for ids, tgt in batches:
                    fn(ids, tgt)
                torch.cuda.synchronize()
                times[name].append((time.perf_counter() - t0) / steps)
        t, m = statistics.median(times["torch"]), statistics.median(times["mixprec"])
        print(f"bench {precision}: TinyLM d=512 x6, batch 32: torch {t * 1e3:.2f} ms/step "
              f"({reads['torch']} reads), mixprec {m * 1e3:.2f} ms/step ({reads['mixprec']} reads), "
              f"ratio mixprec/torch {m / t:.3f}", flush=True)
        acc.end_training()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=("train", "bench"))
    parser.add_argument("--case", nargs=4, metavar=("DEVICE", "BACKEND", "PRECISION", "WORLD"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.case:
        device, backend, precision, world = args.case
        print(json.dumps(case(device, backend, precision, int(world))))
        return 0
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device is visible (torch.cuda.is_available() is False); run it "
              "on a machine with an NVIDIA GPU and a CUDA build of torch", file=sys.stderr)
        return 2
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    ok = True
    if args.only in (None, "train"):
        ok = check_training()
    if args.only in (None, "bench"):
        bench()
    print("gpu-check:", "all cases passed" if ok else "FAILED (see the FAIL lines)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

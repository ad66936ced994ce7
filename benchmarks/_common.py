"""Shared pieces of the benchmarks: the model and data, A/B alternation, statistics and
machine facts. The bench_*.py modules import this; run_all.py imports those modules.

Every comparison follows one protocol (:func:`alternate`): all contenders are built from
the same initial weights, warmed up, then run in rounds; the order of the contenders
alternates between rounds (A B C, C B A, ...) so drift in machine load hits them alike; a
round runs ``steps`` training steps on that round's batches (the same batches for every
contender); in a distributed run a round's time is the slowest rank's (MAX all-reduce).
The reported figure is the median over rounds of the per-step time.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

from train_transformer import TinyLM, batches as copy_task_batches  # noqa: E402

VOCAB, SEQ, SHIFT = 256, 64, 3


def tinylm(dim: int, layers: int, heads: int = 8, seed: int = 0) -> TinyLM:
    """The TinyLM of examples/train_transformer.py, seeded (same weights for every contender)."""
    torch.manual_seed(seed)
    return TinyLM(VOCAB, dim=dim, heads=heads, layers=layers, seq=SEQ)


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def round_batches(rounds: int, steps: int, batch: int, seed: int) -> list[list[tuple]]:
    """``rounds`` lists of ``steps`` batches of the copy-with-delay task of
    examples/train_transformer.py (a learnable task, so loss curves go down). Round r of
    every contender uses list r. Targets at the first SHIFT positions are -100 (ignored)."""
    data = list(copy_task_batches(rounds * steps, batch, SEQ, VOCAB, SHIFT, seed=seed))
    return [data[r * steps:(r + 1) * steps] for r in range(rounds)]


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), target.flatten(), ignore_index=-100)


def accelerator_step(acc, model, opt) -> Callable:
    """A contender's training step through an Accelerate-style ``acc`` (mixprec or Accelerate)."""
    def step(ids, tgt):
        loss = lm_loss(model(ids), tgt)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        return loss
    return step


def torch_step(model, opt, *, autocast: bool = True) -> Callable:
    """A plain PyTorch training step; ``autocast``: forward under bf16 CPU autocast."""
    def step(ids, tgt):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(ids)
        loss = lm_loss(logits, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return step


def torch_amp_step(model, opt, precision: str, device_type: str) -> Callable:
    """Plain PyTorch at its best with clipping: autocast in ``precision`` ("bf16"/"fp16"),
    ``torch.amp.GradScaler`` for fp16 (disabled for bf16), ``clip_grad_norm_(1.0)``; ``opt``
    should be ``AdamW(fused=True)``."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    scaler = torch.amp.GradScaler(device_type, enabled=precision == "fp16")

    def step(ids, tgt):
        with torch.autocast(device_type, dtype=dtype):
            logits = model(ids)
        scaler.scale(lm_loss(logits, tgt)).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return step


# [Note: collective volume]: what a rank *sends* for one collective over a buffer of S
# bytes (S = the full, padded buffer handed to it, which is what mixprec's counters count),
# with the bandwidth-optimal ring algorithms: a ring all-reduce is a reduce-scatter then an
# all-gather, each sending N-1 chunks of S/N, so 2(N-1)/N * S; a reduce-scatter or an
# all-gather alone sends (N-1)/N * S. So an all-reduce used to produce a reduce-scatter's
# result (zero2's collective="auto" on Gloo: all-reduce the bucket, keep the owned slice)
# sends twice what the reduce-scatter would.
SEND_FACTOR = {"allreduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
               "allgather": lambda n: (n - 1) / n}


def sent_bytes(kind: str, payload_bytes: float, world: int) -> float:
    """Bytes one rank sends for ``kind`` collectives over ``payload_bytes`` in all
    ([Note: collective volume])."""
    if kind not in SEND_FACTOR:
        raise ValueError(f"collective kind {kind!r} unknown; one of {sorted(SEND_FACTOR)}")
    return SEND_FACTOR[kind](world) * payload_bytes


def ring_allreduce_sent(payload_bytes: float, world: int) -> float:
    return sent_bytes("allreduce", payload_bytes, world)


def alternate(contenders: dict[str, Callable], rounds_data: list[list[tuple]],
              warmup: list[tuple], distributed: bool = False) -> tuple[dict, dict]:
    """Run every contender's ``step(ids, target) -> loss`` in alternating rounds.

    Returns ``(times, losses)``: per contender the per-step time of every round (seconds;
    the slowest rank's when ``distributed``) and the loss of every step, warm-up included
    (rank-local; every contender sees the same batches in the same order)."""
    import torch.distributed as dist

    names = list(contenders)
    losses = {k: [] for k in names}
    for name in names:  # warm-up: first-call allocations, lazy inits, JIT builds
        for ids, tgt in warmup:
            losses[name].append(contenders[name](ids, tgt).detach())
    times = {k: [] for k in names}
    for r, data in enumerate(rounds_data):
        for name in names if r % 2 == 0 else names[::-1]:
            if distributed:
                dist.barrier()
            start = time.perf_counter()
            for ids, tgt in data:
                losses[name].append(contenders[name](ids, tgt).detach())
            elapsed = (time.perf_counter() - start) / len(data)
            if distributed:
                t = torch.tensor([elapsed], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step ends when the slowest rank ends
                elapsed = t.item()
            times[name].append(elapsed)
    return times, {k: [float(v) for v in vs] for k, vs in losses.items()}


def stats(samples: list[float]) -> dict:
    """Median, min, max and the relative spread (max-min)/median of timing samples."""
    med = statistics.median(samples)
    return {"median": med, "min": min(samples), "max": max(samples),
            "spread": (max(samples) - min(samples)) / med if med else 0.0, "samples": list(samples)}


def load_average() -> tuple[float, float, float]:
    return os.getloadavg()


def machine_info() -> dict:
    """Facts printed at the head of RESULTS.md."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = None
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    import mixprec

    versions = {"torch": torch.__version__, "mixprec": mixprec.__version__, "python": platform.python_version()}
    for pkg in ("accelerate", "deepspeed"):
        versions[pkg] = package_version(pkg)
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_bytes": mem, "platform": platform.platform(),
            "torch_threads": torch.get_num_threads(), "versions": versions,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def deepspeed_optimizer(params, lr: float):
    """DeepSpeed's own C++ CPU Adam in AdamW mode (``DeepSpeedCPUAdam``; its first use
    JIT-builds the cpu_adam op with ninja, cached in ~/.cache/torch_extensions), and its
    name. When the op does not build here: torch's ``AdamW(fused=True)`` and the reason."""
    params = list(params)
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(params, lr=lr, adamw_mode=True), "DeepSpeedCPUAdam"
    except Exception as e:  # noqa: BLE001 - the fallback and its reason go into the results
        why = f"{type(e).__name__}: {str(e)[:200]}"
        return torch.optim.AdamW(params, lr=lr, fused=True), f"torch AdamW(fused=True) (DeepSpeedCPUAdam: {why})"


def package_version(name: str) -> Optional[str]:
    """The installed version of ``name`` without importing it (None: not installed)."""
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None

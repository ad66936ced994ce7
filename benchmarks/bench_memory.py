"""Per-rank memory measured by the OS: peak and between-step resident set of every ZeRO
stage of mixprec, DeepSpeed ZeRO 1/2/3, torch DDP and torch fully_shard (FSDP2).

Every contender runs in its own freshly spawned N-process Gloo group (mixprec's process
runner), so a rank's resident set is its own contender's. In each rank, after the
framework is imported and the process group made, the resident set is read (the
*baseline*, taken after one step of the same contender on a throwaway tiny model, so that
code loaded and kernels initialised on first use are in it); then the model is built and
trained: 2 warm-up steps (optimizer state,
lazy buffers, first-call allocations), then ``steps`` measured steps. Before each measured
step the rank runs the garbage collector, reads ``VmRSS`` (the *resident* memory between
steps) and resets the peak mark (``VmHWM``) by writing "5" to ``/proc/self/clear_refs``;
after the step ``VmHWM`` is its *peak*. ``[Note: freed memory leaves RSS]``: glibc keeps
freed heap blocks mapped, so without care RSS remembers every tensor ever freed; the
children are started with ``MALLOC_MMAP_THRESHOLD_=65536`` in their environment (read by
glibc when the process starts, before torch is imported), so every block of 64 KiB or
more is its own mapping and is returned to the OS when freed. The baseline is the
process as its framework leaves it (interpreter, torch, mixprec or DeepSpeed, Gloo).

Reported per contender: the max over ranks of the peak, of the resident set and of the
baseline (absolute bytes), the growth over the baseline, and the transient part
(peak - resident, the largest over the measured steps). The ZeRO paper's model-state
formulas (Rajbhandari et al., mixed-precision Adam, K = 12: DDP (2+2+K)Psi, stage 1
4Psi + K Psi/N, stage 2 2Psi + (2+K)Psi/N, stage 3 (2+2+K)Psi/N) are given beside them in
bytes, as a reference: a resident growth includes activations kept between steps (none
here), allocator slack and library caches as well as the model states.

Contenders and dtypes (bf16 compute, fp32 master weights and fp32 Adam moments for all):

- ``mixprec_ddp`` and ``torch_ddp``: fp32 parameters + bf16 autocast (torch DDP has no
  bf16-storage mode), torch DDP with ``gradient_as_bucket_view=True`` and
  ``AdamW(fused=True)``; mixprec's DDP engine with its fused C++ step.
- ``zero1``, ``zero2``, ``zero3``, ``fsdp`` (mixprec): bf16 parameters with fp32 master
  shards (``param_dtype=torch.bfloat16``), as DeepSpeed's ``bf16`` mode.
- ``deepspeed_zero1/2/3``: ``{"bf16": {"enabled": true}}`` (bf16 parameters, fp32 master
  partitions) with DeepSpeed's C++ ``DeepSpeedCPUAdam`` when its op builds here
  (``torch.optim.AdamW(fused=True)`` otherwise; the result says which).
- ``torch_fsdp2``: ``fully_shard`` with ``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)``: its sharded fp32 parameters are the masters, gathers in bf16.

zero3 / fsdp / fully_shard units: every ``TransformerEncoderLayer`` plus the root.

    python benchmarks/bench_memory.py                  # N=2 and N=4 (14 min on 2 cores shared at load 11-14)
    python benchmarks/bench_memory.py --world-size 2 --quick
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import os
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _memprobe import peak_bytes, reset_peak, rss_bytes  # noqa: E402
from _common import deepspeed_optimizer, lm_loss, n_params, package_version, round_batches, tinylm, torch_step  # noqa: E402

from mixprec.distributed.spawn import run_distributed  # noqa: E402

MMAP_THRESHOLD = "65536"  # [Note: freed memory leaves RSS]
CONTENDERS = ["mixprec_ddp", "zero1", "zero2", "zero3", "fsdp", "deepspeed_zero1", "deepspeed_zero2",
              "deepspeed_zero3", "torch_ddp", "torch_fsdp2"]
STAGE = {"mixprec_ddp": 0, "torch_ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3,
         "deepspeed_zero1": 1, "deepspeed_zero2": 2, "deepspeed_zero3": 3, "torch_fsdp2": 3}
UNITS = ["TransformerEncoderLayer"]
BUCKET = {"bucket_cap_mb": 25, "first_bucket_cap_mb": 1}
WARMUP = 2


def paper_bytes(stage: int, P: int, N: int, K: int = 12) -> float:
    """Model-state bytes per rank of the ZeRO paper (fp16/bf16 params and grads, K bytes of
    optimizer state per parameter): DDP (2+2+K)P; stage 1 4P + KP/N; stage 2 2P + (2+K)P/N;
    stage 3 (2+2+K)P/N."""
    return {0: (2 + 2 + K) * P, 1: 4 * P + K * P / N, 2: 2 * P + (2 + K) * P / N, 3: (2 + 2 + K) * P / N}[stage]


def _settle() -> int:
    gc.collect()
    return rss_bytes()


# ----------------------------------------------------------------------------- contenders


def _mixprec(name: str, model: nn.Module):
    from mixprec import Accelerator
    from _common import accelerator_step

    if name == "mixprec_ddp":
        acc = Accelerator(mixed_precision="bf16", backend="ddp", cpu=True, log_policy=False,
                          engine_options=dict(BUCKET))
    else:
        opts = dict(BUCKET)
        if name in ("zero3", "fsdp"):
            opts["units"] = UNITS
        acc = Accelerator(mixed_precision="bf16", param_dtype=torch.bfloat16, backend=name, cpu=True,
                          log_policy=False, engine_options=opts)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    return accelerator_step(acc, model, opt), {"optimizer": "mixprec fused C++ AdamW step"}


def _deepspeed(stage: int, model: nn.Module, batch: int):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    opt, which = deepspeed_optimizer(model.parameters(), lr=1e-3)
    config = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1,
              "bf16": {"enabled": True}, "zero_optimization": {"stage": stage},
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**9, "wall_clock_breakdown": False}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)

    def step(ids, tgt):
        loss = lm_loss(engine(ids), tgt)
        engine.backward(loss)
        engine.step()
        return loss

    return step, {"optimizer": which}


def _torch_ddp(model: nn.Module):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(model, bucket_cap_mb=25, gradient_as_bucket_view=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    return torch_step(model, opt), {"optimizer": "torch AdamW(fused=True)"}


def _fsdp2(model: nn.Module, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for m in model.modules():
        if type(m).__name__ in UNITS:
            fully_shard(m, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model.set_force_sum_reduction_for_comms(True)  # Gloo has no AVG reduce-scatter
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    return torch_step(model, opt, autocast=False), {"optimizer": "torch AdamW(fused=True) on DTensor shards"}


def _import_framework(name: str) -> None:
    """Load the contender's framework before the baseline is read (its code is not model state)."""
    if name.startswith("deepspeed"):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed  # noqa: F401
    elif name.startswith("torch"):
        import torch.distributed.fsdp  # noqa: F401
        import torch.nn.parallel  # noqa: F401
    else:
        import mixprec  # noqa: F401


def _build(name: str, model: nn.Module, world: int, batch: int):
    if name.startswith("deepspeed_zero"):
        return _deepspeed(int(name[-1]), model, batch)
    if name == "torch_ddp":
        return _torch_ddp(model)
    if name == "torch_fsdp2":
        return _fsdp2(model, world)
    if name in ("mixprec_ddp", "zero1", "zero2", "zero3", "fsdp"):
        return _mixprec(name, model)
    raise ValueError(f"unknown contender {name!r}; known: {CONTENDERS}")


# ----------------------------------------------------------------------------- one rank


def _rank_main(state, name: str, cfg: dict) -> dict:
    import torch.distributed as dist

    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != MMAP_THRESHOLD:
        raise RuntimeError(f"MALLOC_MMAP_THRESHOLD_={os.environ.get('MALLOC_MMAP_THRESHOLD_')!r} in the rank, "
                           f"expected {MMAP_THRESHOLD}: start ranks through measure(), which sets it before spawning")
    rank, world = dist.get_rank(), dist.get_world_size()
    _import_framework(name)
    data = round_batches(1, WARMUP + cfg["steps"], cfg["batch"], seed=100 + rank)[0]
    # [Note: baseline after a throwaway run]: a framework loads code and initialises kernels
    # (its C++ extension, oneDNN's bf16 paths, DeepSpeed's ops) on first use, tens of MiB
    # that are no model state; one step of the same contender on a tiny model first puts
    # all of that into the baseline, so "growth" is what this model costs.
    warm_step, _ = _build(name, tinylm(16, 1, heads=2), world, cfg["batch"])
    warm_step(*data[0])
    del warm_step
    baseline = _settle()
    model = tinylm(cfg["dim"], cfg["layers"])
    P = n_params(model)
    step, info = _build(name, model, world, cfg["batch"])
    del model  # the contender holds what it needs
    for ids, tgt in data[:WARMUP]:
        step(ids, tgt)
    resident, peak, transient, losses = [], [], [], []
    for ids, tgt in data[WARMUP:]:
        before = _settle()
        reset_peak()
        losses.append(float(step(ids, tgt).detach()))
        top = peak_bytes()
        resident.append(before)
        peak.append(top)
        transient.append(top - before)
    resident.append(_settle())  # after the last step too
    out = {"rank": rank, "params": P, "baseline": baseline, "resident": max(resident), "peak": max(peak),
           "transient": max(transient), "losses": losses, **info}
    gathered = [None] * world
    dist.all_gather_object(gathered, out)
    if name.startswith("deepspeed"):
        dist.barrier()
    return gathered


# ----------------------------------------------------------------------------- driver


def _one(name: str, world: int, cfg: dict, timeout: float) -> dict:
    ranks = run_distributed(_rank_main, world, args=(name, cfg), timeout=timeout)[0]
    P = ranks[0]["params"]
    res = {k: max(r[k] for r in ranks) for k in ("baseline", "resident", "peak", "transient")}
    res["resident_growth"] = max(r["resident"] - r["baseline"] for r in ranks)
    res["peak_growth"] = max(r["peak"] - r["baseline"] for r in ranks)
    res["per_rank"] = [{k: r[k] for k in ("baseline", "resident", "peak", "transient")} for r in ranks]
    res["optimizer"] = ranks[0]["optimizer"]
    res["losses"] = ranks[0]["losses"]
    res["stage"] = STAGE[name]
    res["paper_bytes"] = paper_bytes(STAGE[name], P, world)
    res["params"] = P
    return res


@contextlib.contextmanager
def mmap_threshold_env():
    """``MALLOC_MMAP_THRESHOLD_`` set for the ranks spawned inside (they inherit it), put back after."""
    previous = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = MMAP_THRESHOLD
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = previous


def measure(worlds=(2, 4), *, dim: int = 512, layers: int = 4, batch: int = 4, steps: int = 2,
            contenders: list[str] = CONTENDERS, timeout: float = 900) -> dict:
    """Memory of every contender at every world size; ``{"worlds": {N: {name: result}}, ...}``.
    A DeepSpeed contender that cannot run here (not installed, init error) is listed under
    ``skipped`` with the reason; any other failure raises."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    cfg = dict(dim=dim, layers=layers, batch=batch, steps=steps)
    out = {"dim": dim, "layers": layers, "batch": batch, "steps": steps, "warmup": WARMUP,
           "mmap_threshold": int(MMAP_THRESHOLD), "params": n_params(tinylm(dim, layers)),
           "worlds": {}, "skipped": {}}
    with mmap_threshold_env():  # inherited by the spawned ranks
        for world in worlds:
            rows = out["worlds"][str(world)] = {}
            for name in contenders:
                if name.startswith("deepspeed") and package_version("deepspeed") is None:
                    out["skipped"][f"{name} N={world}"] = "deepspeed is not installed"
                    continue
                try:
                    rows[name] = _one(name, world, cfg, timeout)
                except Exception as e:  # noqa: BLE001 - a peer that cannot run here is reported
                    if not name.startswith("deepspeed"):
                        raise
                    out["skipped"][f"{name} N={world}"] = f"{type(e).__name__}: {str(e)[-400:]}"
    return out


PEERS = {"mixprec_ddp": ["torch_ddp"], "zero1": ["deepspeed_zero1"], "zero2": ["deepspeed_zero2"],
         "zero3": ["deepspeed_zero3", "torch_fsdp2"], "fsdp": ["deepspeed_zero3", "torch_fsdp2"]}


def comparisons(res: dict) -> list[dict]:
    """mixprec vs its peers at the same stage and N: resident growth and peak growth ratios
    (<= 1.0: mixprec holds no more)."""
    rows = []
    for world, cont in res["worlds"].items():
        for ours, peers in PEERS.items():
            for peer in peers:
                if ours in cont and peer in cont:
                    a, b = cont[ours], cont[peer]
                    rows.append({"world": int(world), "ours": ours, "peer": peer,
                                 "resident": a["resident_growth"] / b["resident_growth"],
                                 "peak": a["peak_growth"] / b["peak_growth"]})
    return rows


def _mib(b: float) -> str:
    return f"{b / 2**20:.1f}"


def report(res: dict) -> None:
    P = res["params"]
    print(f"Memory per rank (OS: VmRSS/VmHWM, MALLOC_MMAP_THRESHOLD_={res['mmap_threshold']}), TinyLM "
          f"{P / 1e6:.2f}M params (fp32 {_mib(4 * P)} MiB), batch {res['batch']}x64, {res['warmup']} warm-up + "
          f"{res['steps']} measured steps; MiB, max over ranks")
    for world, cont in res["worlds"].items():
        print(f" N={world}: {'contender':<16} {'peak':>8} {'resident':>9} {'transient':>9} {'baseline':>9} "
              f"{'res.growth':>10} {'peak growth':>11} {'paper':>8}")
        for name, r in cont.items():
            print(f"       {name:<16} {_mib(r['peak']):>8} {_mib(r['resident']):>9} {_mib(r['transient']):>9} "
                  f"{_mib(r['baseline']):>9} {_mib(r['resident_growth']):>10} {_mib(r['peak_growth']):>11} "
                  f"{_mib(r['paper_bytes']):>8}  ({r['optimizer']})")
    for c in comparisons(res):
        print(f"  N={c['world']} {c['ours']}/{c['peer']}: resident growth {c['resident']:.3f}, "
              f"peak growth {c['peak']:.3f}")
    for k, why in res["skipped"].items():
        print(f"  {k} did not run: {why}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--world-size", type=int, nargs="*", default=[2, 4])
    ap.add_argument("--only", nargs="*", choices=CONTENDERS, default=CONTENDERS)
    ap.add_argument("--quick", action="store_true", help="tiny model (smoke run)")
    args = ap.parse_args()
    if args.quick:
        args.dim, args.layers, args.steps = 64, 1, 1
    report(measure(tuple(args.world_size), dim=args.dim, layers=args.layers, batch=args.batch, steps=args.steps,
                   contenders=args.only))


if __name__ == "__main__":
    main()

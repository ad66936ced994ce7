"""ZeRO-1/2/3 step time vs mixprec DDP, DeepSpeed ZeRO and torch fully_shard; bytes each
rank sends to collectives per step against the ZeRO paper's volume.

N local processes over Gloo (mixprec's process runner), AdamW in bf16: every sharded
contender stores bf16 parameters and keeps fp32 master weights and fp32 Adam moments —
mixprec ``Accelerator(mixed_precision="bf16", param_dtype=torch.bfloat16)``, DeepSpeed
``{"bf16": {"enabled": true}}`` with its own C++ ``DeepSpeedCPUAdam`` (torch's fused AdamW
if that op does not build here; the result names which), torch ``fully_shard`` with
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` (its sharded fp32 parameters
are the masters) and torch's ``AdamW(fused=True)``. ``torch_ddp`` is torch DDP with fp32
parameters + bf16 autocast (torch has no bf16-storage + fp32-master mode),
``gradient_as_bucket_view=True`` and ``AdamW(fused=True)``. ZeRO-3/FSDP units: every
``TransformerEncoderLayer`` plus the root. Rounds alternate the contenders' order; medians
of the slowest rank's step time are reported. AdamW lr 1e-3 for all (the loss curves of
run_all.py come from this run). ``fsdp`` is mixprec's FSDP2-named ZeRO-3 (same units),
``zero2_rs`` is zero2 with ``collective="reduce_scatter"`` (the default on Gloo is
all-reduce + slice, docs/zero.md).

Collective volume ([Note: collective volume] in _common.py): from the sharding cores'
cumulative counters (``engine.comm_counters()``: the padded buffers handed to collectives),
the bytes this rank *sends* per step for the collective actually used: all-reduce
2(N-1)/N of the buffer, reduce-scatter and all-gather (N-1)/N. Theory (Rajbhandari et
al.): stages 1/2 move 2 Psi (a reduce-scatter of the gradients, an all-gather of the
parameters), stage 3 moves 3 Psi (two all-gathers, one reduce-scatter), each (N-1)/N of
its buffer, here in mixprec's dtypes (fp32 gradients, bf16 parameters). Memory is measured
by the OS in bench_memory.py, not here.

    python benchmarks/bench_zero.py                   # N=2, ~3 min on 2 cores
    python benchmarks/bench_zero.py --world-size 4    # oversubscribed on 2 cores
    python benchmarks/bench_zero.py --quick           # smoke run
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (accelerator_step, alternate, deepspeed_optimizer, lm_loss, n_params,  # noqa: E402
                     package_version, round_batches, sent_bytes, stats, tinylm, torch_step)

from mixprec.distributed.spawn import run_distributed  # noqa: E402

MAIN = ["mixprec_ddp", "zero1", "zero2", "zero2_rs", "zero3", "fsdp", "deepspeed_zero1", "deepspeed_zero2",
        "deepspeed_zero3", "torch_fsdp2", "torch_ddp"]
SWEEP = ["mixprec_ddp", "torch_ddp", "zero2", "zero3", "deepspeed_zero3", "torch_fsdp2"]
# One rank: mixprec's distributed backends need >= 2 processes, so its point is backend="single"
# (same policy: bf16 params + fp32 masters); the peers run on a one-rank group.
SINGLE_RANK = ["mixprec_single", "deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero3", "torch_fsdp2", "torch_ddp"]
UNITS = ["TransformerEncoderLayer"]
BUCKET = {"bucket_cap_mb": 25, "first_bucket_cap_mb": 1}


def comm_theory_bytes(stage: int, P: int, N: int, root: int = 0) -> float:
    """Bytes one rank sends per step in the ZeRO paper's schedule, in mixprec's dtypes: a
    reduce-scatter of P fp32 gradients plus one (stages 1/2) or two (stage 3) all-gathers of
    P bf16 parameters, each (N-1)/N of its buffer. ``root``: parameters gathered only once
    in stage 3 (the root unit stays gathered from forward to the end of backward)."""
    gathers = 2 * P - root if stage == 3 else P
    return sent_bytes("reduce_scatter", 4 * P, N) + sent_bytes("allgather", 2 * gathers, N)


def _mixprec(backend: str, base: nn.Module):
    from mixprec import Accelerator

    opts = dict(BUCKET) if backend != "single" else {}
    if backend == "zero2_rs":  # Gloo's reduce_scatter instead of collective="auto"'s all-reduce + slice
        backend, opts["collective"] = "zero2", "reduce_scatter"
    if backend in ("zero3", "fsdp"):
        opts["units"] = UNITS
    acc = Accelerator(mixed_precision="bf16", param_dtype=torch.bfloat16, backend=backend, cpu=True,
                      log_policy=False, engine_options=opts or None)
    model = copy.deepcopy(base)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))

    return accelerator_step(acc, model, opt), acc


def _deepspeed(stage: int, base: nn.Module, batch: int):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    model = copy.deepcopy(base)
    config = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1,
              "bf16": {"enabled": True}, "zero_optimization": {"stage": stage},
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
              "wall_clock_breakdown": False}
    opt, which = deepspeed_optimizer(model.parameters(), lr=1e-3)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    engine.optimizer_name_for_report = which

    def step(ids, tgt):
        loss = lm_loss(engine(ids), tgt)
        engine.backward(loss)
        engine.step()
        return loss

    return step, engine


def _fsdp2(base: nn.Module, world: int):
    """torch fully_shard on a CPU mesh, same units, bf16 gathers, fp32 reduce, SUM-only comms."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = copy.deepcopy(base)
    mesh = init_device_mesh("cpu", (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for m in model.modules():
        if type(m).__name__ in UNITS:
            fully_shard(m, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model.set_force_sum_reduction_for_comms(True)  # Gloo has no AVG reduce-scatter
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

    return torch_step(model, opt, autocast=False)  # the bf16 policy does the casting


def _torch_ddp(base: nn.Module):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(copy.deepcopy(base), bucket_cap_mb=25, gradient_as_bucket_view=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

    return torch_step(model, opt)


def _build(name: str, base: nn.Module, world: int, batch: int):
    """(step, mixprec accelerator or None) for one contender."""
    if name in ("mixprec_ddp", "mixprec_single", "zero1", "zero2", "zero2_rs", "zero3", "fsdp"):
        return _mixprec(name.replace("mixprec_", ""), base)
    if name.startswith("deepspeed_zero"):
        step, engine = _deepspeed(int(name[-1]), base, batch)
        return step, engine
    if name == "torch_fsdp2":
        return _fsdp2(base, world), None
    if name == "torch_ddp":
        return _torch_ddp(base), None
    raise ValueError(f"unknown contender {name!r}; known: {sorted(set(MAIN) | set(SWEEP))}")


def _run_config(cfg: dict, world: int, rank: int) -> dict:
    import torch.distributed as dist

    base = tinylm(cfg["dim"], cfg["layers"])
    P = n_params(base)
    contenders, accs, skipped, ds_optimizer = {}, {}, {}, {}
    for name in cfg["contenders"]:
        if name.startswith("deepspeed") and package_version("deepspeed") is None:
            skipped[name] = "deepspeed is not installed"
            continue
        try:
            step, acc = _build(name, base, world, cfg["batch"])
        except Exception as e:  # noqa: BLE001 - a peer that cannot run here is reported, not fatal
            if name not in ("torch_fsdp2",) and not name.startswith("deepspeed"):
                raise
            skipped[name] = f"{type(e).__name__}: {str(e)[:300]}"
            continue
        contenders[name] = step
        if name.startswith("deepspeed"):
            ds_optimizer[name] = acc.optimizer_name_for_report
        elif acc is not None:
            accs[name] = acc
    data = round_batches(cfg["rounds"] + 1, cfg["steps"], cfg["batch"], seed=100 + rank)
    times, losses = alternate(contenders, data[1:], data[0][:2], distributed=True)
    out = {"dim": cfg["dim"], "layers": cfg["layers"], "params": P, "world": world,
           "batch": cfg["batch"], "steps": cfg["steps"], "rounds": cfg["rounds"],
           "contenders": {k: stats(v) for k, v in times.items()}, "losses": losses, "skipped": skipped,
           "deepspeed_optimizer": ds_optimizer, "comm": {}}
    if not cfg.get("measure", False):
        return out
    root = sum(p.numel() for n, p in base.named_parameters() if ".layers." not in f".{n}")
    for name in ("zero1", "zero2", "zero2_rs", "zero3", "fsdp"):
        if name not in accs:
            continue
        eng = accs[name].engine.comm  # the sharded backend (engines/zero.py)
        stage = eng.stage
        steps_done = len(losses[name])
        per_step = {k: v / steps_done for k, v in eng.comm_counters().items()}
        kind = eng.options.collective  # resolved: "allreduce" or "reduce_scatter"
        sent_reduce = sent_bytes(kind, per_step["bytes_reduced"], world)
        sent_gather = sent_bytes("allgather", per_step["bytes_gathered"], world)
        theory = comm_theory_bytes(stage, P, world, root if stage == 3 else 0)
        out["comm"][name] = {"stage": stage, "per_step": per_step, "collective": kind, "root_params": root,
                             "sent_reduce": sent_reduce, "sent_gather": sent_gather,
                             "sent": sent_reduce + sent_gather, "theory_sent": theory,
                             "paper_psi": 2 if stage < 3 else 3}
    dist.barrier()
    return out


def _bench(state, configs: list[dict]) -> list[dict] | None:
    import torch.distributed as dist

    from mixprec.distributed.spawn import free_port

    # World size 1: the runner makes no process group for a single rank; the sharded
    # engines (and DeepSpeed, fully_shard) need one, so make a one-rank Gloo group.
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        results = [_run_config(cfg, world, rank) for cfg in configs]
    finally:
        if own_group:
            import gc

            gc.collect()  # engines hold the group: free them before destroying it
            dist.destroy_process_group()
    return results if rank == 0 else None


def configs_for(dim: int, layers: int, batch: int, steps: int, rounds: int, sweep: list[tuple[int, int]] = (),
                contenders: list[str] = MAIN) -> list[dict]:
    """The main comparison (with collective volume measured) and an optional
    model-size sweep with the SWEEP contenders, for one process group."""
    out = [dict(dim=dim, layers=layers, batch=batch, steps=steps, rounds=rounds, contenders=list(contenders),
                measure=any(c in contenders for c in ("zero1", "zero2", "zero2_rs", "zero3", "fsdp")))]
    for d, n in sweep:
        out.append(dict(dim=d, layers=n, batch=batch, steps=steps, rounds=rounds, contenders=list(SWEEP)))
    return out


def measure(world: int = 2, *, dim: int = 384, layers: int = 4, batch: int = 4, steps: int = 3, rounds: int = 4,
            sweep: list[tuple[int, int]] = (), contenders: list[str] = MAIN, timeout: float = 1800) -> list[dict]:
    """Run :func:`configs_for` on ``world`` local ranks; rank 0's results, one per config."""
    if world == 1 and contenders is MAIN:
        contenders = SINGLE_RANK
    cfgs = configs_for(dim, layers, batch, steps, rounds, sweep, contenders)
    return run_distributed(_bench, world, args=(cfgs,), timeout=timeout)[0]


def report(res: dict) -> None:
    P, N = res["params"], res["world"]
    med = {k: v["median"] for k, v in res["contenders"].items()}
    print(f"ZeRO, {N} processes, Gloo, bf16 params + fp32 masters, AdamW, TinyLM {P / 1e6:.2f}M params, "
          f"batch {res['batch']}x64 per rank, {res['rounds']} rounds x {res['steps']} steps")
    for k, v in med.items():
        line = f"  {k:<16} median step {v * 1e3:8.1f} ms"
        if "mixprec_ddp" in med:
            line += f"  ratio vs mixprec_ddp {v / med['mixprec_ddp']:.3f}"
        peer = f"deepspeed_zero{k[-1]}" if k in ("zero1", "zero2", "zero3") else None
        if peer in med:
            line += f"  vs {peer} {v / med[peer]:.3f}"
        if k.startswith("zero") and "torch_fsdp2" in med:
            line += f"  vs torch_fsdp2 {v / med['torch_fsdp2']:.3f}"
        print(line)
    for k, why in res["skipped"].items():
        print(f"  {k:<16} did not run: {why}")
    for name, c in res["comm"].items():
        print(f"  {name}: sent/rank/step {c['sent']:,.0f} B ({c['collective']} {c['sent_reduce']:,.0f} + all-gather "
              f"{c['sent_gather']:,.0f}) = {c['sent'] / c['theory_sent']:.3f} x the paper's {c['paper_psi']} Psi "
              f"schedule ({c['theory_sent']:,.0f} B: reduce-scatter fp32 + all-gather bf16)")
    for name, which in res.get("deepspeed_optimizer", {}).items():
        print(f"  {name} optimizer: {which}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.dim, args.layers, args.steps, args.rounds = 64, 1, 2, 2
    for res in measure(args.world_size, dim=args.dim, layers=args.layers, batch=args.batch, steps=args.steps,
                       rounds=args.rounds):
        report(res)


if __name__ == "__main__":
    main()

"""mixprec FSDP / ZeRO-3 vs torch fully_shard (FSDP2): step time and peak per-rank memory.

CPU, Gloo, 2 processes, bf16 autocast with fp32 parameters, AdamW, the TinyLM of
examples/train_transformer.py; units = every TransformerEncoderLayer plus the root, for
both. torch runs on an explicit CPU device mesh with SUM-only collectives
(set_force_sum_reduction_for_comms: Gloo has no AVG reduce-scatter).

Each contender runs in its own freshly spawned process group, so the peak resident set
size of a rank (ru_maxrss) belongs to it alone: "peak RSS growth" is that peak minus the
RSS measured just before the model is built (parameters, optimizer state, gradients,
gathered units, activations, allocator slack). The mixprec rows also report the largest
amount of gathered (full) parameter memory seen at any unit boundary.
"""

from __future__ import annotations

import argparse
import gc
import copy
import json
import os
import resource
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

CONTENDERS = {
    "fsdp": ("mixprec", {"backend": "fsdp", "reshard_after_forward": True}),
    "fsdp_keep": ("mixprec", {"backend": "fsdp", "reshard_after_forward": False}),
    "zero3": ("mixprec", {"backend": "zero3"}),
    "torch_fsdp2": ("torch", {"reshard_after_forward": True}),
    "torch_fsdp2_keep": ("torch", {"reshard_after_forward": False}),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _rank_main(rank: int, world: int, port: int, name: str, args, out: str) -> None:
    import faulthandler
    faulthandler.enable()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = _bench(rank, world, name, args)
        gc.collect()  # free the engine (and its hold on the process group) before leaving it
        if rank == 0:
            Path(out).write_text(json.dumps(result))
        if os.environ.get("BENCH_TRACE"):
            print(f"rank {rank} benchmarked", flush=True)
    finally:
        dist.destroy_process_group()
    if os.environ.get("BENCH_TRACE"):
        print(f"rank {rank} left the process group", flush=True)


def _build(kind: str, opts: dict, base: nn.Module, world: int):
    """(step function, mixprec engine or None) for one contender."""
    loss_fn = nn.CrossEntropyLoss()
    units = ["TransformerEncoderLayer"]
    if kind == "mixprec":
        from mixprec import Accelerator

        backend = opts["backend"]
        engine_options = {"units": units}
        if backend == "fsdp":
            engine_options["reshard_after_forward"] = opts["reshard_after_forward"]
        acc = Accelerator(mixed_precision="bf16", backend=backend, cpu=True, log_policy=False,
                          engine_options=engine_options)
        model, opt = acc.prepare(base, torch.optim.AdamW(base.parameters(), lr=1e-4))

        def step(ids, tgt):
            acc.backward(loss_fn(model(ids).flatten(0, 1), tgt.flatten()))
            opt.step()
            opt.zero_grad()

        return step, acc.engine, model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for m in base.modules():
        if type(m).__name__ in units:
            fully_shard(m, mesh=mesh, reshard_after_forward=opts["reshard_after_forward"])
    fully_shard(base, mesh=mesh, reshard_after_forward=opts["reshard_after_forward"])
    base.set_force_sum_reduction_for_comms(True)
    opt = torch.optim.AdamW(base.parameters(), lr=1e-4)

    def step(ids, tgt):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = base(ids)
        loss_fn(logits.float().flatten(0, 1), tgt.flatten()).backward()
        opt.step()
        opt.zero_grad()

    return step, None, base


def _bench(rank: int, world: int, name: str, args) -> dict:
    import mixprec  # noqa: F401  (loaded before the RSS baseline, like torch's FSDP below)
    import torch.distributed.fsdp  # noqa: F401
    from train_transformer import TinyLM

    vocab, seq = 256, 64
    g = torch.Generator().manual_seed(rank)
    data = [(torch.randint(0, vocab, (args.batch, seq), generator=g),
             torch.randint(0, vocab, (args.batch, seq), generator=g)) for _ in range(args.steps)]
    rss0 = _rss_bytes()
    torch.manual_seed(0)
    base = TinyLM(vocab, dim=args.dim, heads=8, layers=args.layers, seq=seq)
    n_params = sum(p.numel() for p in base.parameters())
    kind, opts = CONTENDERS[name]
    step, engine, model = _build(kind, opts, base, world)
    gathered_peak = [0]
    if engine is not None:
        def sample(*_):
            gathered_peak[0] = max(gathered_peak[0], engine.param_buffer_bytes())
        for m in model.modules():
            if type(m).__name__ == "TransformerEncoderLayer":
                m.register_forward_hook(sample)
                m.register_full_backward_hook(sample)
    for ids, tgt in data[:2]:  # warm-up
        step(ids, tgt)
    times = []
    for _ in range(args.rounds):
        dist.barrier()
        start = time.perf_counter()
        for ids, tgt in data:
            step(ids, tgt)
        elapsed = torch.tensor([(time.perf_counter() - start) / len(data)])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed.item())
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return {"step_s": statistics.median(times), "peak_rss_growth": peak.item(), "params": n_params,
            "gathered_peak": gathered_peak[0] if engine is not None else None,
            "threads": torch.get_num_threads()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--only", nargs="*", choices=list(CONTENDERS), default=list(CONTENDERS))
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.dim, args.layers, args.steps, args.rounds = 64, 2, 2, 2
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only:
            out = os.path.join(tmp, f"{name}.json")
            mp.spawn(_rank_main, args=(args.world_size, _free_port(), name, args, out),
                     nprocs=args.world_size, join=True)
            results[name] = json.loads(Path(out).read_text())
    first = next(iter(results.values()))
    P = first["params"]
    print(f"FSDP, {args.world_size} processes x {first['threads']} thread(s), Gloo, bf16 autocast, fp32 params, "
          f"AdamW, TinyLM {P / 1e6:.1f}M params ({4 * P / 2**20:.1f} MiB fp32), units: TransformerEncoderLayer "
          f"+ root, batch {args.batch}x64 per rank, {args.rounds} rounds x {args.steps} steps")
    for name, r in results.items():
        ref = "torch_fsdp2_keep" if name.endswith("_keep") else "torch_fsdp2"
        line = (f"  {name:<17} median step {r['step_s'] * 1e3:8.1f} ms  "
                f"peak RSS growth/rank {r['peak_rss_growth'] / 2**20:7.1f} MiB")
        if ref in results and name != ref:
            line += (f"  ratio vs {ref}: time {r['step_s'] / results[ref]['step_s']:.3f}, "
                     f"memory {r['peak_rss_growth'] / results[ref]['peak_rss_growth']:.3f}")
        if r["gathered_peak"] is not None:
            line += f"  gathered params peak {r['gathered_peak'] / 2**20:.1f} MiB"
        print(line)


if __name__ == "__main__":
    main()

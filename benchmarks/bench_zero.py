"""ZeRO-1/2 step time vs mixprec DDP and torch FSDP2 (fully_shard), bytes and memory.

2 processes over Gloo, bf16 autocast with fp32 parameters, AdamW, the TinyLM of
examples/train_transformer.py. Rounds alternate the contenders' order; medians of the
slowest rank's step time are reported. Then, per stage: bytes handed to collectives per
step against the theory (2x the fp32 model size for stages 1/2: reduce-scatter of the
gradients + all-gather of the parameters), and persistent per-rank memory against the
ZeRO formula for this setting (fp32 params and grads, Adam):
    stage 1: 4P (params) + 4P (full grads) + 4P/N (grad shard) + 12P/N (master, m, v)
    stage 2: 4P (params) + 4P/N (grad shard) + 12P/N

    python benchmarks/bench_zero.py            # ~3 min on 2 cores
    python benchmarks/bench_zero.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import copy
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        _bench(rank, world, args)
    finally:
        dist.destroy_process_group()


def _fsdp2(base: nn.Module, world: int):
    """torch fully_shard on an explicit CPU mesh, per-layer units, SUM-only collectives."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = copy.deepcopy(base)
    mesh = init_device_mesh("cpu", (world,))
    for m in model.modules():
        if isinstance(m, nn.TransformerEncoderLayer):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.set_force_sum_reduction_for_comms(True)
    return model


def _bench(rank: int, world: int, args) -> None:
    from mixprec import Accelerator
    from train_transformer import TinyLM

    vocab, seq = 256, 64
    torch.manual_seed(0)
    base = TinyLM(vocab, dim=args.dim, heads=8, layers=args.layers, seq=seq)
    n_params = sum(p.numel() for p in base.parameters())
    loss_fn = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(rank)
    data = [(torch.randint(0, vocab, (args.batch, seq), generator=g),
             torch.randint(0, vocab, (args.batch, seq), generator=g)) for _ in range(args.steps)]

    contenders, accs = {}, {}
    for name, backend, opts in (("mixprec_ddp", "ddp", {}), ("zero1", "zero1", {}),
                                ("zero2", "zero2", {}),
                                ("zero2_rs", "zero2", {"collective": "reduce_scatter"})):
        acc = Accelerator(mixed_precision="bf16", backend=backend, cpu=True, log_policy=False,
                          engine_options={"bucket_cap_mb": 25, "first_bucket_cap_mb": 1, **opts})
        model = copy.deepcopy(base)
        model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
        accs[name] = acc

        def step(ids, tgt, model=model, opt=opt, acc=acc):
            acc.backward(loss_fn(model(ids).flatten(0, 1), tgt.flatten()))
            opt.step()
            opt.zero_grad()

        contenders[name] = step
    try:
        fsdp = _fsdp2(base, world)
        fsdp_opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-4)

        def fsdp_step(ids, tgt):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = fsdp(ids)
            loss_fn(logits.float().flatten(0, 1), tgt.flatten()).backward()
            fsdp_opt.step()
            fsdp_opt.zero_grad()

        fsdp_step(*data[0])
        contenders["torch_fsdp2"] = fsdp_step
    except Exception as e:  # report, keep benchmarking the rest
        if rank == 0:
            print(f"torch fully_shard does not run here: {type(e).__name__}: {e}")
    for fn in contenders.values():  # warm-up
        fn(*data[0])
    times = {k: [] for k in contenders}
    names = list(contenders)
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            dist.barrier()
            start = time.perf_counter()
            for ids, tgt in data:
                contenders[name](ids, tgt)
            elapsed = torch.tensor([(time.perf_counter() - start) / len(data)])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[name].append(elapsed.item())
    if rank != 0:
        return
    med = {k: statistics.median(v) for k, v in times.items()}
    P, N = n_params, world
    print(f"ZeRO, {N} processes x {torch.get_num_threads()} thread(s), Gloo, bf16 autocast, fp32 params, "
          f"AdamW, TinyLM {P / 1e6:.1f}M params, batch {args.batch}x{seq} per rank, "
          f"{args.rounds} rounds x {args.steps} steps, bucket 25 MiB")
    for k, v in med.items():
        print(f"  {k:<12} median step {v * 1e3:8.1f} ms  ratio vs mixprec_ddp {v / med['mixprec_ddp']:.3f}"
              + (f"  vs torch_fsdp2 {v / med['torch_fsdp2']:.3f}" if "torch_fsdp2" in med else ""))
    print(f"  reduce collective on Gloo: all-reduce+slice (zero2) / reduce_scatter (zero2_rs) = "
          f"{med['zero2'] / med['zero2_rs']:.3f}")
    model_bytes = 4 * P
    for name in ("zero1", "zero2", "zero2_rs"):
        eng = accs[name].engine
        b = eng.bytes_communicated_last_step()
        total = b["reduce"] + b["gather"]
        # Ring cost per rank: reduce-scatter and all-gather move (N-1)/N of their buffer,
        # an all-reduce twice that.
        wire = (N - 1) / N * (b["reduce"] * (2 if eng.options.collective == "allreduce" else 1) + b["gather"])
        mem = eng.persistent_bytes()
        stage = eng.stage
        measured = model_bytes + mem["master"] + mem["lowp"] + mem["optimizer_state"] + mem["grads"]
        formula = 4 * P + (4 * P if stage == 1 else 0) + 4 * P / N + 12 * P / N
        print(f"  {name:<9} bytes to collectives/step {total:,} = {total / (2 * model_bytes):.4f} x theory "
              f"(2 x {model_bytes:,}; padding only), ring traffic/rank {wire:,.0f} ({eng.options.collective}); "
              f"persistent/rank {measured:,} = {measured / formula:.4f} x formula {formula:,.0f} "
              f"(optimizer part {mem['master'] + mem['optimizer_state']:,} = "
              f"{(mem['master'] + mem['optimizer_state']) / (12 * P):.4f} x 12P)")


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
    mp.spawn(_rank_main, args=(args.world_size, _free_port(), args), nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()

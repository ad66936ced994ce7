"""mixprec's C++ DDP engine vs torch DistributedDataParallel: 2 processes, Gloo, bf16.

Both contenders train the same ~20M-parameter transformer from the same weights on the
same data, with the same bucket size (25 MiB, first bucket 1 MiB); rounds alternate
A/B and medians are reported. Also prints the bytes mixprec all-reduced per step,
which must equal the gradient size in the reduce dtype (fp32).

    python benchmarks/bench_ddp.py            # ~2-3 min on 2 cores
    python benchmarks/bench_ddp.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from mixprec.distributed.spawn import run_distributed  # noqa: E402


def _bench_rank(state, args) -> None:
    _bench(state.rank, args)


def _bench(rank: int, args) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

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

    import copy

    torch_model = DDP(copy.deepcopy(base), bucket_cap_mb=25)
    torch_opt = torch.optim.AdamW(torch_model.parameters(), lr=1e-4)
    # A second torch baseline with torch's own fused CPU AdamW, so the comparison is not
    # only "fused vs unfused optimizer".
    fused_model = DDP(copy.deepcopy(base), bucket_cap_mb=25)
    fused_opt = torch.optim.AdamW(fused_model.parameters(), lr=1e-4, fused=True)
    acc = Accelerator(mixed_precision="bf16", backend="ddp", cpu=True, log_policy=False,
                      engine_options={"bucket_cap_mb": 25, "first_bucket_cap_mb": 1})
    ours = copy.deepcopy(base)
    ours, our_opt = acc.prepare(ours, torch.optim.AdamW(ours.parameters(), lr=1e-4))

    def make_torch_step(model, opt):
        def step(ids, tgt):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(ids)
            loss = loss_fn(logits.float().flatten(0, 1), tgt.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
        return step

    def mixprec_step(ids, tgt):
        logits = ours(ids)
        loss = loss_fn(logits.flatten(0, 1), tgt.flatten())
        acc.backward(loss)
        our_opt.step()
        our_opt.zero_grad()

    contenders = {
        "torch_ddp": make_torch_step(torch_model, torch_opt),
        "torch_ddp_fused_adamw": make_torch_step(fused_model, fused_opt),
        "mixprec_ddp": mixprec_step,
    }
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
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step ends when the slowest rank ends
            times[name].append(elapsed.item())
    if rank == 0:
        med = {k: statistics.median(v) for k, v in times.items()}
        grad_bytes = sum(p.numel() for p in ours.parameters()) * 4
        reduced = acc.engine.bytes_reduced_last_backward()
        print(f"DDP, {dist.get_world_size()} processes x {torch.get_num_threads()} thread(s), Gloo, "
              f"bf16 autocast, TinyLM {n_params / 1e6:.1f}M params, batch {args.batch}x{seq} per rank, "
              f"{args.rounds} rounds x {args.steps} steps, bucket 25 MiB")
        for k, v in med.items():
            print(f"  {k:<22} median step {v * 1e3:9.1f} ms  (min {min(times[k]) * 1e3:.1f}, max {max(times[k]) * 1e3:.1f})")
        for base_name in ("torch_ddp", "torch_ddp_fused_adamw"):
            ratio = med["mixprec_ddp"] / med[base_name]
            print(f"  ratio mixprec_ddp/{base_name} = {ratio:.3f}  (target <= 1.0: {'met' if ratio <= 1.0 else 'MISSED'})")
        print(f"  bytes all-reduced per step: {reduced:,} (fp32 gradient size {grad_bytes:,}: "
              f"{'equal' if reduced == grad_bytes else 'DIFFERENT'})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.dim, args.layers, args.steps, args.rounds = 64, 1, 2, 2
    # mixprec's own local process runner (one thread per rank, Gloo on 127.0.0.1).
    run_distributed(_bench_rank, args.world_size, args=(args,), timeout=3600)


if __name__ == "__main__":
    main()

"""GPT-2 small (124M) on 2 ranks: mixprec ddp vs torch DDP, forward / backward / clip / step timed apart.

A hand-written loop, fp32 (no autocast), AdamW, ``clip_grad_norm_(1.0)``, batch 2 x 128
tokens per rank, Gloo on 127.0.0.1, one torch thread per rank. ``GPT2LMHeadModel`` from
``GPT2Config()`` with random weights (seed 0, the same on every rank and contender). The
contenders run in fresh process groups (mixprec's process runner), one group per sample, in
alternating order (A B, B A, ...); every phase's figure is the median over the samples of
the per-step median of the slowest rank. ``plain`` is the model without any wrapper (a
rank-local loop with no gradient communication): the forward any wrapper adds to.

    python benchmarks/bench_gpt2_ddp_forward.py                       # 4 samples each, ~10 min on 2 cores
    python benchmarks/bench_gpt2_ddp_forward.py --samples 2 --steps 4
    python benchmarks/bench_gpt2_ddp_forward.py --contenders mixprec_ddp plain --profile /tmp/prof

``--profile DIR`` writes rank 0's torch.profiler table of one forward per contender
(``DIR/<contender>.txt``, every operator with its calls and self CPU time) after the timed
steps, for comparing what each forward runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mixprec.distributed.spawn import run_distributed  # noqa: E402

PHASES = ("forward", "backward", "clip", "opt_step", "zero_grad")
CONTENDERS = ("mixprec_ddp", "torch_ddp", "plain")


def _model():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config())


def _build(name: str):
    """(model, backward(loss), clip(model), optimizer) for ``name``."""
    model = _model()
    if name == "mixprec_ddp":
        from mixprec import Accelerator

        acc = Accelerator(backend="ddp", cpu=True, mixed_precision="no", log_policy=False)
        model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
        return model, acc.backward, lambda m: acc.clip_grad_norm_(m.parameters(), 1.0), opt
    opt_params = model.parameters()
    if name == "torch_ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model, gradient_as_bucket_view=True)
        opt_params = model.parameters()
    opt = torch.optim.AdamW(opt_params, lr=1e-4, fused=True)
    return model, lambda loss: loss.backward(), lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0), opt


def _sample(state, name: str, args: dict) -> dict | None:
    import torch.distributed as dist

    rank = dist.get_rank()
    model, backward, clip, opt = _build(name)
    gen = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randint(0, 50257, (args["batch"], args["seq"]), generator=gen)
               for _ in range(args["warmup"] + args["steps"])]
    times = {p: [] for p in PHASES}
    cpu = {p: [] for p in PHASES}
    losses = []

    def mark(marks):
        marks.append((time.perf_counter(), time.thread_time()))

    def one_step(ids, record):
        marks = []
        mark(marks)
        loss = model(input_ids=ids, labels=ids).loss
        mark(marks)
        backward(loss)
        mark(marks)
        clip(model)
        mark(marks)
        opt.step()
        mark(marks)
        opt.zero_grad()
        mark(marks)
        if record:
            for p, a, b in zip(PHASES, marks, marks[1:]):
                times[p].append(b[0] - a[0])
                cpu[p].append(b[1] - a[1])
        return loss.detach()

    for i, ids in enumerate(batches):
        losses.append(float(one_step(ids, i >= args["warmup"])))
    table = None
    if args["profile"]:
        from torch.profiler import ProfilerActivity, profile, record_function

        with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
            with record_function("## forward ##"):
                loss = model(input_ids=batches[-1], labels=batches[-1]).loss
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=-1)
        backward(loss)  # the other rank's backward all-reduces with this one
        clip(model)
        opt.step()
        opt.zero_grad()
    med = torch.tensor([statistics.median(t[p]) for t in (times, cpu) for p in PHASES], dtype=torch.float64)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)  # a phase ends when the slowest rank ends it
    if rank != 0:
        return None
    med = med.tolist()
    return {"phases": dict(zip(PHASES, med)), "cpu": dict(zip(PHASES, med[len(PHASES):])),
            "losses": losses, "profile": table}


def measure(contenders=CONTENDERS, *, samples: int = 4, warmup: int = 2, steps: int = 6, batch: int = 2,
            seq: int = 128, world: int = 2, profile: str | None = None, timeout: float = 1800) -> dict:
    args = dict(warmup=warmup, steps=steps, batch=batch, seq=seq, profile=bool(profile))
    runs = {c: [] for c in contenders}
    order = list(contenders)
    for s in range(samples):
        for name in order if s % 2 == 0 else order[::-1]:
            res = run_distributed(_sample, world, args=(name, args), timeout=timeout)[0]
            runs[name].append(res)
            step = sum(res["phases"].values())
            print(f"  sample {s} {name:<12} " + "  ".join(f"{p} {v:.3f}" for p, v in res["phases"].items())
                  + f"  sum {step:.3f} s  (thread CPU: " + "  ".join(f"{v:.3f}" for v in res["cpu"].values())
                  + ")", flush=True)
            if profile and res["profile"]:
                out = Path(profile)
                out.mkdir(parents=True, exist_ok=True)
                (out / f"{name}.txt").write_text(res["profile"])
    result = {}
    for name, rs in runs.items():
        med = {p: statistics.median(r["phases"][p] for r in rs) for p in PHASES}
        med["total"] = statistics.median(sum(r["phases"].values()) for r in rs)
        cpu = {p: statistics.median(r["cpu"][p] for r in rs) for p in PHASES}
        cpu["total"] = statistics.median(sum(r["cpu"].values()) for r in rs)
        result[name] = {"median": med, "cpu": cpu, "losses": rs[0]["losses"]}
    return {"world": world, "samples": samples, "steps": steps, "contenders": result}


def report(res: dict) -> None:
    cols = PHASES + ("total",)
    print(f"GPT-2 124M, {res['world']} ranks x 1 thread, Gloo, fp32, batch 2x128 per rank, "
          f"{res['samples']} samples x {res['steps']} steps (medians, slowest rank; 'total' is the whole iteration)")
    print(f"  {'':<12} " + " ".join(f"{c:>10}" for c in cols))
    for name, r in res["contenders"].items():
        print(f"  {name:<12} " + " ".join(f"{r['median'][c]:10.3f}" for c in cols))
    print("  the main thread's CPU time (time.thread_time), the same medians:")
    for name, r in res["contenders"].items():
        print(f"  {name:<12} " + " ".join(f"{r['cpu'][c]:10.3f}" for c in cols))
    c = res["contenders"]
    if "mixprec_ddp" in c and "torch_ddp" in c:
        for col in ("forward", "total"):
            print(f"  ratio mixprec_ddp/torch_ddp {col}: "
                  f"{c['mixprec_ddp']['median'][col] / c['torch_ddp']['median'][col]:.3f}")
        ours, theirs = c["mixprec_ddp"]["losses"], c["torch_ddp"]["losses"]
        rel = max(abs(a - b) / abs(b) for a, b in zip(ours, theirs))
        print(f"  losses mixprec_ddp vs torch_ddp (first sample, rank 0): first {ours[0]:.6f} / {theirs[0]:.6f}, "
              f"largest relative difference {rel:.1e} (the AdamW kernels sum in other orders)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contenders", nargs="+", choices=CONTENDERS, default=list(CONTENDERS))
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--profile", metavar="DIR", default=None)
    args = ap.parse_args()
    report(measure(tuple(args.contenders), samples=args.samples, warmup=args.warmup, steps=args.steps,
                   profile=args.profile))


if __name__ == "__main__":
    main()

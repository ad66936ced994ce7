"""Sequence parallelism: per-rank peak memory on the OS probe at a long sequence for SP=1, 2
and 4, the longest sequence that trains under a fixed per-rank memory cap, and step time
against DeepSpeed's Ulysses ``DistributedAttention`` on the same model (CPU, Gloo).

Model: a Hugging Face ``LlamaForCausalLM`` built from config (hidden 128, intermediate 256,
2 layers, 8 query / 4 key-value heads, vocabulary 4096, attn_implementation="sdpa"), fp32,
``backend="ddp"``, torch AdamW, one sequence per SP group, the first eighth of its labels
ignored; ``accelerator.prepare_sp_inputs`` slices it; the loss is HF's own.

Memory protocol (benchmarks/bench_memory.py's): ranks started with
``MALLOC_MMAP_THRESHOLD_=65536`` (large buffers go back to the OS when freed, so one length's
peak does not raise the next one's baseline), one warm-up step at a short sequence (the
optimizer state, gradient buckets and Gloo buffers exist before any measurement), then per
length: ``gc.collect()``, VmRSS read, VmHWM reset, one training step, VmHWM read. "Step
memory" = peak minus the resident set before the step (what a step of that length adds:
activations, logits, attention, autograd buffers, the all-to-alls), max over ranks. Each SP
size runs in its own freshly spawned process group of ``sp`` ranks (DP=1).

Longest sequence under the cap (``--cap-mib``, per rank): lengths doubling from
``--start`` until a step goes over the cap, then bisection to a granularity of 256 tokens x
SP; the longest length measured under the cap is reported. Goals (issue #26): SP=2 >= 1.8x
SP=1, SP=4 >= 3.5x.

Step time (``--time-seq`` tokens, SP=2, 2 ranks, one process group): mixprec's Ulysses (the
``TorchFunctionMode`` around SDPA) against DeepSpeed's ``deepspeed.sequence.layer.
DistributedAttention`` (three ``_SeqAllToAll`` calls around a local SDPA), registered as a
Hugging Face attention function on a second copy of the same model prepared by the same
Accelerator with mixprec's mode removed from it; everything else (engine, loss, slicing) is
the same. Rounds alternate the two; medians of ``--rounds`` steps each. A shared machine
makes step times noisy: read the spread printed beside them.

    python benchmarks/bench_sp.py                 # all three parts
    python benchmarks/bench_sp.py --quick         # shorter searches, fewer rounds

Activation checkpointing (``--checkpointing-only``; ``--ckpt-seq`` tokens, ``--ckpt-layers``
decoder layers, SP=2 on 2 ranks, ddp): per-rank step memory (the protocol above) and the
median step time with every ``LlamaDecoderLayer`` checkpointed whole, selectively (the
attention and all-to-all outputs kept: mixprec/activation_checkpointing.py, [Note: selective
checkpointing]) and not at all. The modes run one after the other in the same ranks.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from _memprobe import peak_bytes, reset_peak, rss_bytes  # noqa: E402

from bench_memory import MMAP_THRESHOLD  # noqa: E402
MIB = 2 ** 20


def llama(seq: int, attn: str = "sdpa", layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=layers, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=seq, tie_word_embeddings=False, attn_implementation=attn))


def batch_of(seq: int, step: int):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 4096, (1, seq), generator=g)
    labels = ids.clone()
    labels[:, :seq // 8] = -100
    return ids, labels


def _train_step(acc, model, opt, seq: int, step: int) -> float:
    ids, labels = batch_of(seq, step)
    loss = model(**acc.prepare_sp_inputs(input_ids=ids, labels=labels)).loss
    acc.backward(loss)
    opt.step()
    opt.zero_grad()
    return loss.item()


def _memory_rank(state, sp: int, lengths: list, cap_mib: float, start: int, max_seq: int) -> dict:
    """One SP size: step memory at ``lengths``, then the longest length under the cap."""
    import torch.distributed as dist

    from mixprec import Accelerator

    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != MMAP_THRESHOLD:
        raise RuntimeError("ranks must start with MALLOC_MMAP_THRESHOLD_=65536 (bench_memory's protocol)")
    acc = Accelerator(cpu=True, log_policy=False, backend="ddp", config={"sequence_parallel": {"size": sp}})
    model = llama(max_seq)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = acc.prepare(model, opt)
    _train_step(acc, model, opt, 256 * sp, 0)  # warm-up: optimizer state, buckets, buffers

    def measure(seq: int) -> float:
        gc.collect()
        base = rss_bytes()
        reset_peak()
        _train_step(acc, model, opt, seq, seq)
        grown = torch.tensor((peak_bytes() - base) / MIB)
        if dist.is_initialized():
            dist.all_reduce(grown, op=dist.ReduceOp.MAX)
        return float(grown)

    at = {seq: measure(seq) for seq in lengths}
    unit = 256 * sp
    tried: dict[int, float] = {}
    seq = max(unit, start // unit * unit)
    while seq <= max_seq:
        tried[seq] = measure(seq)
        if tried[seq] > cap_mib:
            break
        seq *= 2
    fits = [s for s, m in tried.items() if m <= cap_mib]
    misses = [s for s, m in tried.items() if m > cap_mib]
    lo, hi = (max(fits) if fits else 0), (min(misses) if misses else None)
    while hi is not None and hi - lo > unit:
        mid = (lo + hi) // 2 // unit * unit
        if mid <= lo:
            break
        tried[mid] = measure(mid)
        lo, hi = (mid, hi) if tried[mid] <= cap_mib else (lo, mid)
    return {"at": at, "tried": dict(sorted(tried.items())), "longest": lo, "capped": hi is not None}


def _timing_rank(state, seq: int, rounds: int) -> dict:
    """mixprec Ulysses vs DeepSpeed DistributedAttention, alternating, same engine and model."""
    import deepspeed
    from deepspeed.sequence.layer import DistributedAttention
    from transformers import AttentionInterface

    from mixprec import Accelerator

    acc = Accelerator(cpu=True, log_policy=False, backend="ddp", config={"sequence_parallel": {"size": 2}})
    deepspeed.init_distributed(dist_backend="gloo")
    group = acc.mesh.sp_group

    def local(q, k, v, *args, **kwargs):  # [b, s, h/p, d] -> the same layout
        out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                               v.transpose(1, 2), is_causal=True,
                                                               enable_gqa=k.shape[2] != q.shape[2])
        return out.transpose(1, 2)

    ds_attn = DistributedAttention(local, group, scatter_idx=2, gather_idx=1)

    def ds_ulysses(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        # HF gives [b, h, s/p, d]; DistributedAttention takes [b, s/p, h, d] (batch_dim_idx 0).
        out = ds_attn(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), 0)
        return out, None

    AttentionInterface.register("ds_ulysses", ds_ulysses)
    contenders = {}
    for name in ("mixprec_ulysses", "deepspeed_distributed_attention"):
        model = llama(seq)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model, opt = acc.prepare(model, opt)
        if name.startswith("deepspeed"):
            model._mixprec_ctx.around = None  # mixprec's mode off: DeepSpeed's all-to-alls instead
            model.config._attn_implementation = "ds_ulysses"
        contenders[name] = (model, opt)
    losses = {n: _train_step(acc, m, o, seq, 0) for n, (m, o) in contenders.items()}  # warm-up, same loss
    times: dict[str, list] = {n: [] for n in contenders}
    for r in range(rounds):
        for name, (model, opt) in (contenders.items() if r % 2 == 0 else reversed(contenders.items())):
            acc.wait_for_everyone()
            t = time.perf_counter()
            _train_step(acc, model, opt, seq, 1 + r)
            times[name].append(time.perf_counter() - t)
    return {"losses": losses, "times": times}


CKPT_MODES = {
    "none": None,
    "whole": {"modules": ["LlamaDecoderLayer"]},
    "selective": {"modules": ["LlamaDecoderLayer"], "selective": True},
}


def _checkpointing_rank(state, seq: int, layers: int, rounds: int) -> dict:
    """SP=2: step memory (OS probe, max over ranks) and step time per checkpointing mode."""
    import torch.distributed as dist

    from mixprec import Accelerator

    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != MMAP_THRESHOLD:
        raise RuntimeError("ranks must start with MALLOC_MMAP_THRESHOLD_=65536 (bench_memory's protocol)")
    out = {}
    for mode, ckpt in CKPT_MODES.items():
        acc = Accelerator(cpu=True, log_policy=False, backend="ddp", activation_checkpointing=ckpt,
                          config={"sequence_parallel": {"size": 2}})
        model = llama(seq, layers=layers)
        model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
        _train_step(acc, model, opt, 512, 0)  # warm-up: optimizer state, buckets, buffers
        gc.collect()
        base = rss_bytes()
        reset_peak()
        loss = _train_step(acc, model, opt, seq, 1)
        grown = torch.tensor((peak_bytes() - base) / MIB)
        dist.all_reduce(grown, op=dist.ReduceOp.MAX)
        times = []
        for r in range(rounds):
            dist.barrier()
            t0 = time.perf_counter()
            _train_step(acc, model, opt, seq, 2 + r)
            times.append(time.perf_counter() - t0)
        out[mode] = {"step_mib": float(grown), "times": times, "loss": loss}
        del acc, model, opt
        gc.collect()
    return out


def measure_checkpointing(seq: int, layers: int, rounds: int) -> dict:
    from mixprec.distributed.spawn import run_distributed

    from bench_memory import mmap_threshold_env

    with mmap_threshold_env():
        res = run_distributed(_checkpointing_rank, 2, args=(seq, layers, rounds), timeout=3600)[0]
    return {m: {"step_mib": r["step_mib"], "loss": r["loss"], "time": _stats(r["times"])} for m, r in res.items()}


def report_checkpointing(ck: dict, args) -> None:
    print(f"\nActivation checkpointing of every LlamaDecoderLayer, SP=2 on 2 ranks, {args.ckpt_seq} tokens, "
          f"{args.ckpt_layers} layers (step memory max over ranks; time: median of {args.rounds} steps):")
    none = ck["none"]
    for mode, r in ck.items():
        t = r["time"]
        print(f"  {mode:<10} step memory {r['step_mib']:7.1f} MiB ({r['step_mib'] / none['step_mib']:.2f}x none)   "
              f"step {t['median'] * 1e3:8.1f} ms ({t['median'] / none['time']['median']:.2f}x none, spread "
              f"{t['spread']:.0%})   first-step loss {r['loss']:.6f}")


def _stats(samples: list) -> dict:
    med = statistics.median(samples)
    return {"median": med, "spread": (max(samples) - min(samples)) / med, "n": len(samples)}


def measure_memory(sps: list, lengths: list, cap_mib: float, start: int, max_seq: int) -> dict:
    from mixprec.distributed.spawn import run_distributed

    from bench_memory import mmap_threshold_env

    out = {}
    with mmap_threshold_env():  # inherited by the spawned ranks
        for sp in sps:
            out[sp] = run_distributed(_memory_rank, sp, args=(sp, lengths, cap_mib, start, max_seq),
                                      timeout=3600)[0]
    return out


def measure_time(seq: int, rounds: int) -> dict:
    from mixprec.distributed.spawn import run_distributed

    try:
        res = run_distributed(_timing_rank, 2, args=(seq, rounds), timeout=3600)[0]
    except Exception as e:  # noqa: BLE001  (reported as "does not run", with why)
        return {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}"}
    return {"losses": res["losses"], "stats": {n: _stats(t) for n, t in res["times"].items()}}


def measure(sps: list, lengths: list, cap_mib: float, start: int, max_seq: int, time_seq: int, rounds: int,
            ckpt_seq: int, ckpt_layers: int) -> dict:
    """Every part (what benchmarks/run_all.py records under "sp")."""
    def keyed(m: dict) -> dict:  # JSON keys: strings
        return {**m, "at": {str(k): v for k, v in m["at"].items()}, "tried": {str(k): v for k, v in m["tried"].items()}}

    return {"memory": {str(sp): keyed(m) for sp, m in measure_memory(sps, lengths, cap_mib, start, max_seq).items()},
            "timing": measure_time(time_seq, rounds),
            "checkpointing": measure_checkpointing(ckpt_seq, ckpt_layers, rounds),
            "args": {"sps": sps, "lengths": lengths, "cap_mib": cap_mib, "time_seq": time_seq, "rounds": rounds,
                     "ckpt_seq": ckpt_seq, "ckpt_layers": ckpt_layers, "max_seq": max_seq}}


def report(mem: dict, timing: dict, args) -> None:
    if mem:
        _report_memory(mem, args)
    print(f"\nStep time at {args.time_seq} tokens, SP=2 on 2 ranks (median of {args.rounds}, alternating):")
    if "error" in timing:
        print(f"  DeepSpeed DistributedAttention does not run here: {timing['error']}")
    else:
        st = timing["stats"]
        for name, s in st.items():
            print(f"  {name:<34} {s['median'] * 1e3:8.1f} ms  (spread {s['spread']:.0%}, n={s['n']})")
        r = st["mixprec_ulysses"]["median"] / st["deepspeed_distributed_attention"]["median"]
        print(f"  mixprec / DeepSpeed: {r:.3f}; first-step losses {timing['losses']}")


def _report_memory(mem: dict, args) -> None:
    sps = sorted(mem)
    print(f"Sequence parallelism, HF Llama (hidden 128, 2 layers, 8/4 heads, vocab 4096), fp32, ddp; "
          f"step memory = OS peak (VmHWM) minus VmRSS before the step, max over ranks "
          f"(MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD})")
    print("\nPer-rank step memory (MiB) by sequence length:")
    print(f"  {'seq':>7} " + " ".join(f"{'SP=' + str(sp):>9}" for sp in sps) + "   ratios SP=1/SP=n")
    for seq in args.lengths:
        row = [mem[sp]["at"][seq] for sp in sps]
        ratios = " ".join(f"{row[0] / v:.2f}x" for v in row[1:]) if sps[0] == 1 else ""
        print(f"  {seq:>7} " + " ".join(f"{v:>9.0f}" for v in row) + f"   {ratios}")
    print(f"\nLongest sequence that trains under {args.cap_mib:.0f} MiB of step memory per rank:")
    base = mem[sps[0]]["longest"] if sps[0] == 1 else None
    goals = {2: 1.8, 4: 3.5}
    for sp in sps:
        m = mem[sp]
        line = f"  SP={sp}: {m['longest']} tokens" + ("" if m["capped"] else f" (search stopped at --max-seq {args.max_seq})")
        if base and sp != 1:
            r = m["longest"] / base
            goal = goals.get(sp)
            line += f", {r:.2f}x SP=1" + (f" (goal >= {goal}x: {'met' if r >= goal else 'MISSED'})" if goal else "")
        print(line)
        print("     measured: " + ", ".join(f"{s}:{v:.0f}" for s, v in m["tried"].items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192], help="lengths for the memory table")
    ap.add_argument("--cap-mib", type=float, default=256.0, help="per-rank step-memory cap (MiB)")
    ap.add_argument("--start", type=int, default=1024, help="first length of the cap search")
    ap.add_argument("--max-seq", type=int, default=65536)
    ap.add_argument("--time-seq", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--quick", action="store_true", help="cap 128 MiB, 4 rounds, table at 4096 tokens")
    ap.add_argument("--timing-only", action="store_true", help="only the step-time comparison")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the raw figures here")
    ap.add_argument("--checkpointing-only", action="store_true",
                    help="only the activation-checkpointing comparison (none / whole / selective)")
    ap.add_argument("--ckpt-seq", type=int, default=8192, help="tokens for the checkpointing comparison")
    ap.add_argument("--ckpt-layers", type=int, default=8, help="decoder layers for the checkpointing comparison")
    args = ap.parse_args()
    if args.checkpointing_only:
        ck = measure_checkpointing(args.ckpt_seq, args.ckpt_layers, args.rounds)
        report_checkpointing(ck, args)
        if args.json:
            Path(args.json).write_text(json.dumps({"checkpointing": ck, "args": vars(args)}, indent=1))
        return
    if args.quick:
        args.cap_mib, args.rounds, args.lengths, args.time_seq = 128.0, 4, [4096], 2048
    for seq in args.lengths:
        bad = [sp for sp in args.sp if seq % (256 * sp)]
        if bad:
            raise SystemExit(f"--lengths {seq} is not a multiple of 256 x SP for SP={bad}")
    mem = {} if args.timing_only else measure_memory(args.sp, args.lengths, args.cap_mib, args.start, args.max_seq)
    timing = measure_time(args.time_seq, args.rounds)
    report(mem, timing, args)
    if args.json:
        Path(args.json).write_text(json.dumps({"memory": mem, "timing": timing, "args": vars(args)}, indent=1,
                                              default=str))


if __name__ == "__main__":
    main()

"""The targets of benchmarks/run_all.py: one row per comparison that has one (measured
ratio, target, met or missed, and the reason when missed, from the measured figures)."""

from __future__ import annotations

from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal

import bench_memory


def _shown(x: float, places: int, bound: str) -> float:
    """`x` rounded to `places` decimals away from meeting its target ("upper": an at-most
    bound, rounded up; "lower": an at-least bound, rounded down). Verdicts are taken on the
    number as printed, so a ratio just short of its bound can never print as the bound and
    read "missed" (CI failed once on "1.25x" ">= 1.25x" "missed": 1.2496 printed as 1.25)."""
    q = Decimal(1).scaleb(-places)
    return float(Decimal(repr(x)).quantize(q, rounding=ROUND_CEILING if bound == "upper" else ROUND_FLOOR))


def _spread(st: dict) -> str:
    return f"{st['spread']:.0%}"


def evaluate(res: dict) -> list[dict]:
    """The targets: one row per comparison that has one (comparison, ratio, target, met, note)."""
    rows = []
    single = {k: v for k, v in res["single"]["contenders"].items()}
    r = _shown(single["mixprec"]["median"] / single["plain"]["median"], 3, "upper")
    rows.append(dict(
        comparison="single: mixprec / plain PyTorch loop (bf16, step time)", value=f"{r:.3f}", target="<= 1.03",
        met=r <= 1.03, margin=1.03 / r - 1,
        note=(f"Gap {100 * (r - 1):.1f}% against sample spreads of {_spread(single['mixprec'])} (mixprec) and "
              f"{_spread(single['plain'])} (plain) on this shared machine: repeat on an idle machine with more "
              "rounds (--rounds) before reading it as overhead; if it stays, profile Accelerator.backward/"
              "clip_grad_norm_/step (Python dispatch per step) and move that bookkeeping into the C++ engine."
              if r > 1.03 else "")))
    ddp = res["ddp"]["contenders"]
    r = _shown(ddp["mixprec_ddp"]["median"] / ddp["torch_ddp"]["median"], 3, "upper")
    rows.append(dict(
        comparison="ddp N=2: mixprec_ddp / torch DDP (step time)", value=f"{r:.3f}", target="<= 1.0", met=r <= 1.0,
        margin=1.0 / r - 1,
        note=(f"Gap {100 * (r - 1):.1f}%; spreads {_spread(ddp['mixprec_ddp'])} / {_spread(ddp['torch_ddp'])}. "
              "Both all-reduce the same fp32 bytes (checked below); the difference is compute and reducer "
              "overlap on 1 thread per rank. To close: more rounds on an idle machine to separate noise, then "
              "compare bucket launch timing with torch's reducer (first bucket size, overlap)."
              if r > 1.0 else "")))
    ob = res["optimizer_bound"]["contenders"]
    s = _shown(ob["plain"]["median"] / ob["mixprec"]["median"], 2, "lower")
    rows.append(dict(
        comparison="optimizer-bound step: speed-up of mixprec over plain PyTorch (bf16 autocast, fp32 params, clip)",
        value=f"{s:.2f}x", target=">= 1.25x", met=s >= 1.25, margin=s / 1.25 - 1,
        note=(f"mixprec reads the gradients twice (norm with the inf/nan check, then the update with the clip "
              f"inside) where plain reads them four times and writes them twice, and its update writes the bf16 "
              f"weights the forward uses (autocast casts them again in plain); that saves "
              f"{(ob['plain']['median'] - ob['mixprec']['median']) * 1e3:.1f} ms of {ob['plain']['median'] * 1e3:.1f}. "
              "The rest of the step is the same in both: the casts of the bf16 gradients back to fp32 in "
              "backward, a pass over every parameter, plus the update's own streams. Spreads "
              f"{_spread(ob['mixprec'])} / {_spread(ob['plain'])}: more --rounds on an idle machine first."
              if s < 1.25 else "")))
    if "optimizer_bound_fp16" in res:
        of = res["optimizer_bound_fp16"]["contenders"]
        s = _shown(of["plain"]["median"] / of["mixprec"]["median"], 2, "lower")
        alone = of["plain"]["median"] / of["mixprec_native_gemm"]["median"]
        rows.append(dict(
            comparison="optimizer-bound step: speed-up of mixprec over plain PyTorch (fp16 autocast + loss "
                       "scaling, fp32 params, clip)",
            value=f"{s:.2f}x", target=">= 1.25x", met=s >= 1.25, margin=s / 1.25 - 1,
            note=(f"With torch's own fp16 matmuls in both (mixprec_native_gemm) the speed-up is {alone:.2f}x: "
                  "on a CPU without fp16 arithmetic those matmuls are most of the step in both loops, and "
                  "mixprec's widened GEMMs (config cpu_fp16_matmul: auto) were off or not taken here. Spreads "
                  f"{_spread(of['mixprec'])} / {_spread(of['plain'])}." if s < 1.25 else
                  f"Of which the optimizer side alone (torch's fp16 matmuls in both, mixprec_native_gemm): "
                  f"{alone:.2f}x; the rest is mixprec's fp16 matmuls as widened fp32 GEMMs on this CPU "
                  "(src/mixprec/wrappers/half_gemm.py).")))
    fs = res["fsdp"]["contenders"]
    for ours, ref in (("fsdp", "torch_fsdp2"), ("fsdp_keep", "torch_fsdp2_keep")):
        t = _shown(fs[ours]["step_s"] / fs[ref]["step_s"], 3, "upper")
        m = _shown(fs[ours]["peak_rss_growth"] / fs[ref]["peak_rss_growth"], 3, "upper")
        ok = t < 1.0 and m <= 1.0
        why = []
        if t >= 1.0:
            why.append(f"slower ({t:.3f}x): samples {[round(x * 1e3) for x in fs[ours]['step_samples']]} ms vs "
                       f"{[round(x * 1e3) for x in fs[ref]['step_samples']]} ms; contenders run in separate "
                       "process groups, so load drift between samples weighs more: more --repeats")
        if m > 1.0:
            why.append(f"more peak memory ({m:.3f}x; samples {[round(x / 2**20) for x in fs[ours]['rss_samples']]} "
                       f"vs {[round(x / 2**20) for x in fs[ref]['rss_samples']]} MiB): peak RSS counts activations "
                       "and allocator slack as well as parameters, gradients and optimizer state; compare the "
                       "gathered-parameter peak column, and free units earlier (reshard_after_forward=True) or "
                       "release the fp32 gradient buckets sooner to close it")
        rows.append(dict(comparison=f"fsdp N=2: mixprec {ours} / torch {ref} (time; peak RSS growth)",
                         value=f"{t:.3f}; {m:.3f}", target="time < 1.0 and memory <= 1.0", met=ok,
                         margin=min(1.0 / t, 1.0 / m) - 1,
                         note="; ".join(why)))
    for k in res["kernels"]:
        speedup = _shown(k["speedup"], 2, "lower")
        ok = speedup >= 1.4
        note = ""
        if not ok:
            note = (f"The fused step moves 28 B/element against plain PyTorch's 42 B in three passes, so a "
                    f"memory-bound fused step would be up to 1.5x faster; here it ran at "
                    f"{k.get('fused_step_gbps', 0):.1f} GB/s while plain's passes ran at "
                    f"{k.get('plain_step_gbps', 0):.1f} GB/s (memcpy {k['memcpy_gbps']:.1f} GB/s): at "
                    f"{k['threads']} thread(s) the fused pass is bound by its per-element arithmetic (fp32 "
                    "AdamW in torch's exact operation order, bf16 rounding), not by bytes. Closing it needs a "
                    "cheaper inner loop (fewer divides/sqrts per element, wider SIMD), constrained by the "
                    "bitwise parity with torch.optim that the kernel tests assert; or more threads.")
        rows.append(dict(
            comparison=f"kernels, {k['threads']} thread(s): fused step speed-up over plain PyTorch",
            value=f"{speedup:.2f}x", target=">= 1.4x", met=ok, note=note, margin=speedup / 1.4 - 1))
    sp = res.get("sp", {}).get("memory", {})
    for size, goal in (("2", 1.8), ("4", 3.5)):
        if "1" not in sp or size not in sp or not sp["1"]["longest"]:
            continue
        r = _shown(sp[size]["longest"] / sp["1"]["longest"], 2, "lower")
        cap = res["sp"]["args"]["cap_mib"]
        rows.append(dict(
            comparison=f"sequence parallel SP={size}: longest sequence under {cap:.0f} MiB of step memory per rank, "
                       "over SP=1's", value=f"{r:.2f}x", target=f">= {goal}x", met=r >= goal, margin=r / goal - 1,
            note="" if r >= goal else (
                f"SP={size} trained {sp[size]['longest']} tokens against SP=1's {sp['1']['longest']}: per-rank step "
                f"memory measured {sp[size]['tried']} (tokens: MiB). What does not shrink with the slice (the "
                "replicated logits' vocabulary dimension, Gloo buffers, the all-to-all receive buffers) weighs more "
                "at short lengths: raise --max-seq / the cap so the activations dominate")))
    for c in bench_memory.comparisons(res["memory"]):
        resident, peak = _shown(c["resident"], 3, "upper"), _shown(c["peak"], 3, "upper")
        ok = resident <= 1.0 + MEMORY_RESOLUTION and peak <= 1.0 + MEMORY_RESOLUTION
        rows.append(dict(
            comparison=f"memory N={c['world']}: {c['ours']} / {c['peer']} (OS-measured resident; peak, growth "
                       "over each process's pre-model baseline)",
            value=f"{resident:.3f}; {peak:.3f}",
            target=f"<= 1.0 and <= 1.0 (+{MEMORY_RESOLUTION:.1%} resolution)", met=ok,
            note="" if ok else memory_miss_note(res["memory"], c)))
    return rows


# Two runs of the same algorithm differ by a few pages and allocator arenas (measured: torch DDP
# and mixprec ddp hold the same tensors and land within 0.05% of each other): a memory ratio
# counts as at or below 1.0 within this resolution.
MEMORY_RESOLUTION = 0.005


def memory_miss_note(mem: dict, c: dict) -> str:
    """Why a memory comparison missed, from the measured figures (MiB): which part is larger
    (between-step resident or the transient within a step) and what mixprec holds there."""
    cont = mem["worlds"][str(c["world"])]
    a, b = cont[c["ours"]], cont[c["peer"]]
    mib = 2**20
    parts = [f"{c['ours']} vs {c['peer']}: resident growth {a['resident_growth'] / mib:.1f} vs "
             f"{b['resident_growth'] / mib:.1f} MiB, transient (peak - resident) {a['transient'] / mib:.1f} vs "
             f"{b['transient'] / mib:.1f} MiB"]
    P, N = mem["params"], c["world"]
    if c["resident"] > 1.0 + MEMORY_RESOLUTION and c["ours"] != "mixprec_ddp":
        # Between steps the sharded engines hold only the bf16 parameters (zero1/2), the fp32
        # master shard and the optimizer state ([Note: what lives between steps] in
        # csrc/engines/sharded/core.h), as the peers do: a resident miss is unexplained here.
        parts.append("resident: larger between steps although mixprec holds only the bf16 parameters "
                     "(zero1/2), the fp32 master shard and the optimizer state there, as the peer does: "
                     "compare the allocator's slack (the baseline column) before reading it as held state")
    if c["peak"] > 1.0 + MEMORY_RESOLUTION:
        if a["transient"] > b["transient"]:
            grads = 4 * P / mib
            shard = 4 * P / N / mib
            parts.append(f"transient: larger within the step; gradients are accumulated and reduced in fp32: the "
                         f"fp32 gradient shard ({shard:.1f} MiB, freed at zero_grad) and up to "
                         f"max_inflight_buckets (2) + 1 full-size fp32 gradient buckets (25 MiB each) are live "
                         f"during backward, which for this model's {grads:.1f} MiB of fp32 gradients is nearly all "
                         "of them (the bound pays off when the gradient spans many buckets: "
                         "benchmarks/probe_grad_memory.py, docs/zero.md)"
                         if c["ours"] in ("zero2", "zero3", "fsdp") else
                         f"transient: larger within the step; zero1 accumulates the full fp32 gradient "
                         f"({grads:.1f} MiB) in backward and reduces it at the step (freed at zero_grad)")
        else:
            parts.append("peak: exceeds only through the resident difference (its transient is not larger)")
    return "; ".join(parts)

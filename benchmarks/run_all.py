"""Every benchmark of mixprec in one command: measures on this machine, writes RESULTS.md
(tables of ratios, each with its target and met/missed), results.json and PNG plots.
Memory is measured by the OS (bench_memory.py), never by an engine's own accounting.

    python benchmarks/run_all.py                      # full run (34 min on 2 shared cores); writes benchmarks/
    python benchmarks/run_all.py --quick --out /tmp/b # smoke test: tiny sizes, 1-2 repeats

Each comparison is measured in one run with A/B alternation and medians over repeats
(benchmarks/_common.py); the bench_*.py modules are used as libraries, and every
multi-process run goes through mixprec's process runner (mixprec.distributed.spawn).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_ddp  # noqa: E402
import bench_fsdp  # noqa: E402
import bench_kernels  # noqa: E402
import bench_memory  # noqa: E402
import bench_optimizer_bound  # noqa: E402
import bench_single  # noqa: E402
import bench_sp  # noqa: E402
import bench_zero  # noqa: E402
from _common import load_average, machine_info, package_version  # noqa: E402
from _plots import PLOTS, _scaling_names, _scaling_points, write_plots  # noqa: E402
from _targets import evaluate  # noqa: E402

# Sizes. Full: the sizes of the individual scripts; quick: tiny (a smoke test, not a measurement).
FULL = {
    "single": dict(dim=256, layers=4, batch=16, steps=8, rounds=9, threads=1),
    "ddp": dict(dim=512, layers=6, batch=4, steps=3, rounds=6),
    "zero": dict(dim=384, layers=4, batch=4, steps=3, rounds=4),
    "zero_sweep": [(192, 2), (512, 4)],  # with the main (384, 4): 1.0M, 7.3M, 12.9M params
    "fsdp": dict(dim=384, layers=4, batch=4, steps=3, rounds=4, repeats=3),
    "kernels": dict(quick=False, repeats=7),
    "memory": dict(worlds=(2, 4), dim=512, layers=4, batch=4, steps=2),
    "optimizer_bound": dict(dim=1024, layers=4, batch=2, steps=4, rounds=15),
    "sp": dict(sps=[1, 2, 4], lengths=[4096], cap_mib=128.0, start=1024, max_seq=65536, time_seq=4096, rounds=4,
               ckpt_seq=8192, ckpt_layers=8),
}
QUICK = {
    "single": dict(dim=64, layers=1, batch=4, steps=2, rounds=2, threads=1),
    "ddp": dict(dim=64, layers=1, batch=2, steps=1, rounds=2),
    "zero": dict(dim=64, layers=1, batch=2, steps=1, rounds=2),
    "zero_sweep": [(32, 1), (128, 2)],
    # N=4 without DeepSpeed in the smoke test: 4 more DeepSpeed imports + inits on 2 cores cost
    # more than the rest of the N=4 run (the N=2 run exercises the DeepSpeed rows).
    "zero4_contenders": ["mixprec_ddp", "zero1", "zero2", "zero2_rs", "zero3", "fsdp", "torch_fsdp2", "torch_ddp"],
    "fsdp": dict(dim=64, layers=1, batch=2, steps=1, rounds=1, repeats=1),
    "kernels": dict(quick=True, repeats=2),
    "memory": dict(worlds=(2, 4), dim=128, layers=1, batch=2, steps=1),
    # As zero4_contenders: in the smoke test the N=4 memory rows are one replicated and one
    # fully sharded contender of each framework (4 ranks per contender on 2 cores are slow).
    "memory4_contenders": ["mixprec_ddp", "zero3", "torch_ddp", "torch_fsdp2"],
    "optimizer_bound": dict(dim=128, layers=1, batch=2, steps=1, rounds=2),
    "sp": dict(sps=[1, 2], lengths=[512], cap_mib=32.0, start=256, max_seq=2048, time_seq=512, rounds=1,
               ckpt_seq=512, ckpt_layers=2),
}
SECTIONS = ("single", "ddp", "zero", "fsdp", "kernels", "memory", "sp", "optimizer_bound")
FSDP_CONTENDERS = ["fsdp", "fsdp_keep", "torch_fsdp2", "torch_fsdp2_keep"]  # zero3 is in the ZeRO table
WORLDS = (1, 2, 4)


def log(msg: str) -> None:
    print(f"[run_all {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def measure_all(sizes: dict, only: tuple = SECTIONS) -> dict:
    """Run every benchmark (or the sections in ``only``); the raw results (what results.json holds)."""
    res: dict = {"load_before": load_average(), "timings_s": {}}
    t0 = time.perf_counter()

    def timed(key, fn):
        start = time.perf_counter()
        log(f"{key} ...")
        out = fn()
        res["timings_s"][key] = time.perf_counter() - start
        log(f"{key} done in {res['timings_s'][key]:.0f} s")
        return out

    if "single" in only:
        res["single"] = timed("single", lambda: bench_single.measure("bf16", **sizes["single"]))
    if "ddp" in only:
        res["ddp"] = timed("ddp", lambda: bench_ddp.measure(2, **sizes["ddp"]))
    if "zero" in only:
        res["zero"] = {}
        for world in WORLDS:
            sweep = sizes["zero_sweep"] if world == 2 else ()
            extra = {"contenders": sizes["zero4_contenders"]} if world == 4 and "zero4_contenders" in sizes else {}
            res["zero"][str(world)] = timed(f"zero N={world}",
                                            lambda: bench_zero.measure(world, sweep=sweep, **sizes["zero"], **extra))
    if "fsdp" in only:
        res["fsdp"] = timed("fsdp", lambda: bench_fsdp.measure(2, only=FSDP_CONTENDERS, **sizes["fsdp"]))
    if "kernels" in only:
        res["kernels"] = timed("kernels", lambda: bench_kernels.measure(**sizes["kernels"]))
    if "memory" in only:
        mem = dict(sizes["memory"])
        res["memory"] = timed("memory N=2", lambda: bench_memory.measure(**{**mem, "worlds": (2,)}))
        if 4 in mem["worlds"]:
            four = bench_memory.CONTENDERS if "memory4_contenders" not in sizes else sizes["memory4_contenders"]
            res4 = timed("memory N=4", lambda: bench_memory.measure(**{**mem, "worlds": (4,)}, contenders=four))
            res["memory"]["worlds"].update(res4["worlds"])
            res["memory"]["skipped"].update(res4["skipped"])
    if "sp" in only:
        res["sp"] = timed("sp", lambda: bench_sp.measure(**sizes["sp"]))
    if "optimizer_bound" in only:
        # Last: it tunes glibc malloc for the rest of the process (bench_optimizer_bound.py).
        res["optimizer_bound"] = timed("optimizer_bound",
                                       lambda: bench_optimizer_bound.measure(**sizes["optimizer_bound"]))
        res["optimizer_bound_fp16"] = timed(
            "optimizer_bound_fp16",
            lambda: bench_optimizer_bound.measure(**sizes["optimizer_bound"], precision="fp16"))
    res["load_after"] = load_average()
    res["total_s"] = time.perf_counter() - t0
    return res


# ----------------------------------------------------------------------------- report


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f}"


def _verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


def _table(header: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def _spread(st: dict) -> str:
    return f"{st['spread']:.0%}"


def _times_table(contenders: dict, ours: str, ours_over_this: bool = True) -> str:
    """Median/min-max/spread per contender and the ratio to ``ours`` (ours / this, or this / ours)."""
    ref = contenders[ours]["median"]
    title = f"{ours} / this" if ours_over_this else f"this / {ours}"
    return _table(["contender", "median ms", "min-max ms", "spread", title],
                  [[k, _ms(v["median"]), f"{_ms(v['min'])}-{_ms(v['max'])}", _spread(v),
                    f"{(ref / v['median'] if ours_over_this else v['median'] / ref):.3f}"]
                   for k, v in contenders.items()])


def write_memory_section(L: list, mem: dict) -> None:
    P = mem["params"]
    L.append("## Memory per rank, measured by the OS (`bench_memory.py`)")
    L.append("")
    L.append(f"TinyLM {P / 1e6:.2f}M params (dim {mem['dim']}, {mem['layers']} layers; fp32 {P * 4 / 2**20:.1f} MiB), "
             f"batch {mem['batch']}x64 per rank; each contender in its own fresh N-process Gloo group; "
             f"{mem['warmup']} warm-up steps then {mem['steps']} measured. Before each measured step: garbage "
             "collection, `VmRSS` read from /proc/self/status (**resident**, between steps), peak reset (\"5\" "
             "to /proc/self/clear_refs); after it `VmHWM` (**peak**). Ranks start with "
             f"`MALLOC_MMAP_THRESHOLD_={mem['mmap_threshold']}` so freed tensors leave the resident set. "
             "**baseline**: the rank's RSS after its framework is imported and the process group made, before the "
             "model is built; **growth** = resident (or peak) - baseline; **transient** = peak - resident. Max over "
             "ranks. Paper: the ZeRO paper's model-state bytes per rank, (2+2+K)Psi with K=12 (DDP `16Psi`, stage 1 "
             "`4Psi + 12Psi/N`, stage 2 `2Psi + 14Psi/N`, stage 3 `16Psi/N`), a reference, not a target. Dtypes: "
             "`mixprec_ddp`/`torch_ddp` fp32 params + bf16 autocast; mixprec zero1/2/3/fsdp and DeepSpeed bf16 "
             "params + fp32 masters; `torch_fsdp2` fp32 sharded params (the masters) gathered in bf16 "
             "(`MixedPrecisionPolicy`). Adam moments fp32 everywhere. Targets (above): mixprec's resident and peak "
             "growth at or below DeepSpeed's and fully_shard's at the same stage.")
    L.append("")
    for world, cont in mem["worlds"].items():
        L.append(f"### Memory, N={world}" + (" (oversubscribed: memory is still meaningful)" if world == "4" else ""))
        L.append("")
        rows = []
        for name, r in cont.items():
            rows.append([name, f"{r['peak'] / 2**20:.1f}", f"{r['resident'] / 2**20:.1f}",
                         f"{r['transient'] / 2**20:.1f}", f"{r['baseline'] / 2**20:.1f}",
                         f"{r['resident_growth'] / 2**20:.1f}", f"{r['peak_growth'] / 2**20:.1f}",
                         f"{r['paper_bytes'] / 2**20:.1f}", f"{r['resident_growth'] / r['paper_bytes']:.2f}",
                         r["optimizer"]])
        L.append(_table(["contender", "peak MiB", "resident MiB", "transient MiB", "baseline MiB",
                         "resident growth MiB", "peak growth MiB", "paper model states MiB",
                         "resident growth / paper", "optimizer"], rows))
        L.append("")
    for k, why in mem["skipped"].items():
        L.append(f"`{k}` did not run: {why}")
        L.append("")


def write_sp_section(L: list, sp: dict) -> None:
    a = sp["args"]
    L.append("## Sequence parallelism (`bench_sp.py`)")
    L.append("")
    L.append("HF Llama from config (hidden 128, 8 query / 4 key-value heads, vocabulary 4096, sdpa), fp32, ddp, one "
             "sequence per SP group, Ulysses attention; step memory = OS peak (VmHWM) during one training step minus "
             "the resident set before it, max over ranks (`MALLOC_MMAP_THRESHOLD_=65536`).")
    L.append("")
    mem = sp["memory"]
    sizes = sorted(mem, key=int)
    rows = []
    for seq in a["lengths"]:
        vals = [mem[s]["at"][str(seq)] for s in sizes]
        rows.append([str(seq)] + [f"{v:.0f}" for v in vals]
                    + ([" / ".join(f"{vals[0] / v:.2f}x" for v in vals[1:])] if sizes[0] == "1" else []))
    L.append("Per-rank step memory (MiB), 2 layers:")
    L.append("")
    L.append(_table(["tokens"] + [f"SP={s}" for s in sizes] + (["SP=1 / SP=n"] if sizes[0] == "1" else []), rows))
    L.append("")
    L.append(f"Longest sequence that trains under {a['cap_mib']:.0f} MiB of step memory per rank (doubling, then "
             "bisection to 256 x SP tokens; targets in the table above):")
    L.append("")
    L.append(_table(["SP", "longest (tokens)", "measured (tokens: MiB)"],
                    [[s, str(mem[s]["longest"]) + ("" if mem[s]["capped"] else f" (search stopped at {a['max_seq']})"),
                      ", ".join(f"{k}: {v:.0f}" for k, v in mem[s]["tried"].items())] for s in sizes]))
    L.append("")
    t = sp["timing"]
    L.append(f"Step time at {a['time_seq']} tokens, SP=2 on 2 ranks, against DeepSpeed's Ulysses "
             "`DistributedAttention` on the same model and engine (alternating, median of "
             f"{a['rounds']}):")
    L.append("")
    if "error" in t:
        L.append(f"DeepSpeed's DistributedAttention did not run here: {t['error']}")
    else:
        st = t["stats"]
        L.append(_table(["attention", "step (ms)", "spread"],
                        [[n, _ms(v["median"]), f"{v['spread']:.0%}"] for n, v in st.items()]))
        L.append("")
        L.append(f"mixprec / DeepSpeed: {st['mixprec_ulysses']['median'] / st['deepspeed_distributed_attention']['median']:.3f} "
                 "(no target: same exchanges, same kernels; read it against the spreads).")
    L.append("")
    ck = sp["checkpointing"]
    none = ck["none"]
    L.append(f"Activation checkpointing of every `LlamaDecoderLayer`, {a['ckpt_layers']} layers, {a['ckpt_seq']} tokens, "
             "SP=2 on 2 ranks (the modes run one after the other; the first-step loss is the same in each):")
    L.append("")
    L.append(_table(["mode", "step memory (MiB)", "vs none", "step (ms)", "vs none", "spread"],
                    [[m, f"{r['step_mib']:.1f}", f"{r['step_mib'] / none['step_mib']:.2f}x", _ms(r["time"]["median"]),
                      f"{r['time']['median'] / none['time']['median']:.2f}x", f"{r['time']['spread']:.0%}"]
                     for m, r in ck.items()]))
    L.append("")


def write_report(res: dict, info: dict, out: Path, command: str, quick: bool) -> None:
    targets = evaluate(res)
    L: list[str] = []
    L.append("# mixprec benchmark results" + (" (QUICK SMOKE RUN: tiny sizes, not a measurement)" if quick else ""))
    L.append("")
    L.append(f"Generated by `{command}` on {info['date']}, total {res['total_s'] / 60:.1f} min."
             + (f" This text and the plots were re-rendered from its results.json by `--from-json` "
                "(no new measurement)." if res.get("rendered_from_json") else "")
             + (f" The memory sections (`bench_memory.py`, N=2 and 4) were measured again on "
                f"{res['memory_remeasured_at']} after a change to the engines' gradient buckets; every "
                "other section is from the run above." if res.get("memory_remeasured_at") else "")
             + "".join(f" {note}" for note in res.get("notes", []))
             + "".join(f" Sections {', '.join(r['sections'])} were measured again on {r['date']} by `{r['command']}` "
                       f"(load average before {r['load_before'][0]:.2f}, after {r['load_after'][0]:.2f}); every other "
                       "section is from the runs above." for r in res.get("remeasured", [])))
    L.append("")
    la, lb = res["load_before"], res["load_after"]
    v = info["versions"]
    L.append(_table(["machine", "value"], [
        ["CPU", f"{info['cpu']}, {info['cores']} cores" + (f", {info['memory_bytes'] / 2**30:.0f} GiB RAM"
                                                           if info["memory_bytes"] else "")],
        ["platform", info["platform"]],
        ["versions", ", ".join(f"{k} {v[k] or 'not installed'}" for k in v)],
        ["load average (1/5/15 min) before", " / ".join(f"{x:.2f}" for x in la)],
        ["load average after", " / ".join(f"{x:.2f}" for x in lb)],
        ["threads", f"single-process: {res['single']['threads']} (fewer threads than cores: steadier on a shared "
                    "machine); distributed: 1 per rank (mixprec.distributed.spawn)"],
    ]))
    L.append("")
    shared = max(la[0], lb[0]) > 0.5 * (info["cores"] or 1)
    L.append(("**The machine was shared while this ran** (load average above half the core count before or "
              "after): absolute times are inflated and noisier; ratios come from alternating rounds, so load "
              "drift hits every contender of a comparison alike, but read small differences against the spread "
              "columns." if shared else "The machine was otherwise idle (load average below half the core count)."))
    L.append("")
    L.append("World size 4 runs 4 ranks on " + f"{info['cores']} cores: **oversubscribed**, so its step times "
             "measure contention as much as the algorithms; memory and collective bytes do not depend on it.")
    L.append("")
    L.append("## Targets")
    L.append("")
    for t in targets:
        if t["met"] and t.get("margin") is not None and t["margin"] < 0.05:
            t["note"] = (f"Met by {100 * t['margin']:.1f}%, less than the run-to-run variation of step times on "
                         "this shared machine: borderline." + (" " + t["note"] if t["note"] else ""))
    L.append(_table(["comparison", "measured", "target", "result", "note (why, and what would close it)"],
                    [[t["comparison"], t["value"], t["target"], _verdict(t["met"]), t["note"]] for t in targets]))
    L.append("")
    missed = [t for t in targets if not t["met"]]
    L.append(f"{len(targets) - len(missed)} of {len(targets)} targets met.")
    L.append("")

    # single
    s = res["single"]
    L.append("## Single process: step overhead (`bench_single.py`)")
    L.append("")
    L.append(f"TinyLM {s['params'] / 1e6:.2f}M params, bf16 autocast, AdamW + clip_grad_norm_, batch {s['batch']}x64, "
             f"{s['rounds']} alternating rounds x {s['steps']} steps; median per-step time.")
    L.append("")
    med = {k: v["median"] for k, v in s["contenders"].items()}
    L.append(_times_table(s["contenders"], "mixprec"))
    if "accelerate" not in med:
        L.append("")
        L.append(f"Accelerate: {s['accelerate']} (not compared).")
    L.append("")

    # optimizer-bound
    o = res["optimizer_bound"]
    L.append("## Optimizer-bound step (`bench_optimizer_bound.py`)")
    L.append("")
    L.append(f"Wide MLP d={o['dim']} x {o['layers']} blocks, {o['params'] / 1e6:.1f}M fp32 params, batch "
             f"{o['batch']}, bf16 autocast (fp32 gradients), AdamW + clip_grad_norm_, {o['rounds']} alternating "
             f"rounds x {o['steps']} steps, {o['threads']} thread(s); glibc malloc "
             f"{'tuned for every contender (see the script)' if o['malloc_tuned'] else 'at its defaults'}. "
             "plain: `AdamW(fused=True)` + `GradScaler` + `clip_grad_norm_`; plain_noguard: without GradScaler "
             "(no inf/nan check); mixprec_inplace: `clip_in_step=False`; mixprec_nocache: "
             "`cache_weight_casts=False` (autocast casts the weights every forward).")
    L.append("")
    L.append(_times_table(o["contenders"], "mixprec", ours_over_this=False))
    L.append("")
    if "optimizer_bound_fp16" in res:
        f = res["optimizer_bound_fp16"]
        L.append(f"The same in fp16 (plain: fp16 autocast + `GradScaler`; mixprec: `mixed_precision=\"fp16\"`), "
                 f"mixprec's CPU kernels: {f['cpu_capability']}. mixprec_native_gemm: config `cpu_fp16_matmul: "
                 "native`, torch's own fp16 matmul kernels; by default, on a CPU without fp16 arithmetic, mixprec "
                 "runs fp16 matmuls as fp32 GEMMs of the fp16 inputs rounded to fp16 (src/mixprec/wrappers/"
                 "half_gemm.py; same numbers up to the fp32 summation order).")
        L.append("")
        L.append(_times_table(f["contenders"], "mixprec", ours_over_this=False))
        L.append("")

    # ddp
    d = res["ddp"]
    L.append("## DDP, N=2 (`bench_ddp.py`)")
    L.append("")
    L.append(f"TinyLM {d['params'] / 1e6:.1f}M params, bf16 autocast, fp32 params, AdamW, batch {d['batch']}x64 per "
             f"rank, {d['rounds']} alternating rounds x {d['steps']} steps, 25 MiB buckets, Gloo. Peers at their best: "
             "torch DDP with `gradient_as_bucket_view=True` and `AdamW(fused=True)`; Accelerate's DDP with the same "
             "fused AdamW; mixprec with its fused C++ step.")
    L.append("")
    med = {k: v["median"] for k, v in d["contenders"].items()}
    L.append(_times_table(d["contenders"], "mixprec_ddp"))
    L.append("")
    if d["accelerate_ddp"]:
        L.append(f"Accelerate's DDP ran: {d['accelerate_ddp']}.")
    else:
        L.append(f"Accelerate's DDP did not run here: {d['accelerate_ddp_error']}.")
    L.append(f"mixprec all-reduced {d['bytes_reduced_per_step']:,} bytes per step = the fp32 gradient size "
             f"{d['fp32_grad_bytes']:,}" + ("" if d["bytes_reduced_per_step"] == d["fp32_grad_bytes"] else " (DIFFERENT)")
             + f"; each rank sends {d['bytes_sent_per_step']:,.0f} bytes for it (ring all-reduce: 2(N-1)/N of the "
             "buffer; torch DDP all-reduces the same fp32 gradients).")
    L.append("")

    # zero
    L.append("## ZeRO stages 1/2/3 vs mixprec DDP, DeepSpeed ZeRO and torch fully_shard (`bench_zero.py`)")
    L.append("")
    ds_opt = sorted({v for runs in res["zero"].values() for v in runs[0].get("deepspeed_optimizer", {}).values()})
    L.append("bf16 parameters + fp32 masters + fp32 Adam moments for every contender except `torch_ddp` (fp32 "
             "params + bf16 autocast: torch DDP has no bf16-storage mode); units for zero3/fsdp/fully_shard: every "
             "TransformerEncoderLayer + root. Peers at their best: torch `fully_shard` and torch DDP step "
             "`AdamW(fused=True)` (fully_shard: on its DTensor shards), torch DDP with `gradient_as_bucket_view=True`; "
             "DeepSpeed: its CPU accelerator, optimizer " + (", ".join(f"`{o}`" for o in ds_opt) or "n/a") +
             ", default ZeRO settings (stage 3 keeps parameters under 100k elements unpartitioned, "
             "`stage3_param_persistence_threshold`).")
    L.append("")
    ds = package_version("deepspeed")
    for world, runs in res["zero"].items():
        z = runs[0]
        med = {k: v["median"] for k, v in z["contenders"].items()}
        L.append(f"### N={world}{' (oversubscribed: 4 ranks on 2 cores)' if world == '4' else ''}")
        L.append("")
        L.append(f"TinyLM {z['params'] / 1e6:.2f}M params, batch {z['batch']}x64 per rank, {z['rounds']} alternating "
                 f"rounds x {z['steps']} steps.")
        L.append("")
        rows = []
        for k, v in z["contenders"].items():
            peer = f"deepspeed_zero{k[4]}" if k in ("zero1", "zero2", "zero2_rs", "zero3") else None
            rows.append([k, _ms(v["median"]), _spread(v),
                         f"{v['median'] / med['mixprec_ddp']:.3f}" if "mixprec_ddp" in med else "",
                         f"{v['median'] / med[peer]:.3f}" if peer in med else "",
                         f"{v['median'] / med['torch_fsdp2']:.3f}" if "torch_fsdp2" in med and k in
                         ("zero1", "zero2", "zero2_rs", "zero3", "fsdp") else ""])
        L.append(_table(["contender", "median ms", "spread", "/ mixprec_ddp", "/ DeepSpeed same stage",
                         "/ torch fully_shard"], rows))
        for k, why in z["skipped"].items():
            L.append(f"\n`{k}` did not run: {why}")
        L.append("")
    if ds is None:
        L.append("DeepSpeed is not installed in this environment: its rows are absent.")
        L.append("")

    # memory
    write_memory_section(L, res["memory"])

    # collective volume
    L.append("## Collective volume per step: bytes each rank sends")
    L.append("")
    L.append("From the sharding cores' counters (`engine.comm_counters()`: the padded buffers handed to "
             "collectives, summed over every unit core), divided by the steps run and converted to the bytes a "
             "rank *sends* with the ring algorithms: all-reduce 2(N-1)/N of the buffer, reduce-scatter and "
             "all-gather (N-1)/N. Paper schedule: stages 1/2 move 2 Psi (reduce-scatter the gradients, all-gather "
             "the parameters), stage 3 3 Psi (all-gather for forward, again for backward, reduce-scatter), here "
             "in mixprec's dtypes (fp32 gradients, bf16 parameters); mixprec's stage 3 gathers the root unit once "
             "(it stays gathered from forward to the end of backward), so its schedule is 3 Psi less the root. "
             "`collective=\"auto\"` is an all-reduce + slice on Gloo (docs/zero.md): it sends **2x** the bytes of "
             "the reduce-scatter for the same result; `zero2_rs` is zero2 with Gloo's reduce-scatter.")
    L.append("")
    rows = []
    for world, runs in res["zero"].items():
        z = runs[0]
        P = z["params"]
        for name, c in z["comm"].items():
            rows.append([f"N={world}", name, f"{P:,}", c["collective"], f"{c['per_step']['bytes_reduced']:,.0f}",
                         f"{c['per_step']['bytes_gathered']:,.0f}", f"{c['sent_reduce']:,.0f}",
                         f"{c['sent_gather']:,.0f}", f"{c['sent']:,.0f}", f"{c['theory_sent']:,.0f} "
                         f"({c['paper_psi']} Psi" + (f" - root {c['root_params']:,}" if c["stage"] == 3 else "") + ")",
                         f"{c['sent'] / c['theory_sent']:.3f}"])
    L.append(_table(["N", "backend", "P", "reduce collective", "reduce buffer B", "gather buffer B", "sent: reduce B",
                     "sent: gather B", "sent total B", "paper schedule B", "sent / paper"], rows))
    L.append("")

    # fsdp
    f = res["fsdp"]
    L.append("## mixprec FSDP vs torch fully_shard, N=2 (`bench_fsdp.py`)")
    L.append("")
    L.append(f"Same units (every TransformerEncoderLayer + root) and policy (bf16 autocast, fp32 params, AdamW), "
             f"TinyLM {f['params'] / 1e6:.2f}M params; each sample is a fresh process group per contender (so a "
             f"rank's peak RSS is its own), {f['repeats']} samples in alternating order, {f['rounds']} rounds x "
             f"{f['steps']} steps each; medians over samples.")
    L.append("")
    rows = []
    fc = f["contenders"]
    for name, r in fc.items():
        ref = "torch_fsdp2_keep" if name.endswith("_keep") else "torch_fsdp2"
        rows.append([name, _ms(r["step_s"]), ", ".join(_ms(x) for x in r["step_samples"]),
                     f"{r['peak_rss_growth'] / 2**20:.1f}",
                     f"{r['step_s'] / fc[ref]['step_s']:.3f}" if name != ref else "",
                     f"{r['peak_rss_growth'] / fc[ref]['peak_rss_growth']:.3f}" if name != ref else "",
                     f"{r['gathered_peak'] / 2**20:.1f}" if r["gathered_peak"] is not None else ""])
    L.append(_table(["contender", "median ms", "samples ms", "peak RSS growth MiB", "time / torch",
                     "memory / torch", "gathered params peak MiB"], rows))
    L.append("")

    # kernels
    L.append("## Fused kernels vs plain PyTorch and memcpy (`bench_kernels.py`)")
    L.append("")
    for k in res["kernels"]:
        L.append(f"{k['threads']} thread(s), {k['params'] / 1e6:.1f}M params in {k['tensors']} tensors, "
                 f"memcpy {k['memcpy_gbps']:.2f} GB/s. Fused step {k['fused_step_ms']:.2f} ms vs plain PyTorch "
                 f"(foreach unscale + AdamW(fused=True) + foreach copy to bf16) {k['plain_step_ms']:.2f} ms: "
                 f"**{k['speedup']:.2f}x**.")
        L.append("")
        L.append(_table(["kernel", "ms", "GB/s", "x memcpy"],
                        [[n, f"{v['ms']:.2f}", f"{v['gbps']:.2f}", f"{v['vs_memcpy']:.2f}"]
                         for n, v in k["kernels"].items()]))
        L.append("")

    # scaling
    L.append("## How cost grows")
    L.append("")
    L.append("World size (same model and per-rank batch: weak scaling, ideal = flat; N=4 is oversubscribed on "
             "2 cores, N=2 uses both):")
    L.append("")
    worlds = list(res["zero"])
    rows = []
    for k in _scaling_names(res):
        row = [k]
        pts = _scaling_points(res, k)
        base = pts[0][1] if pts else None
        for w in worlds:
            ms = dict(pts).get(int(w))
            row.append(f"{ms:.1f} ({ms / base:.2f}x)" if ms is not None else "n/a")
        rows.append(row)
    L.append(_table(["contender"] + [f"N={w} ms (x first)" for w in worlds], rows))
    L.append("")
    L.append("At N=1 mixprec's distributed backends refuse to run (they need >= 2 processes), so their N=1 "
             "point is `backend=\"single\"` with the same policy (`mixprec_single`); DeepSpeed, fully_shard and "
             "torch DDP run on a one-rank Gloo group.")
    L.append("")
    runs2 = sorted(res["zero"]["2"], key=lambda r: r["params"]) if "2" in res["zero"] else []
    if runs2:
        L.append("Model size at N=2 (params span "
                 f"{runs2[-1]['params'] / runs2[0]['params']:.1f}x; ms per step, and per M params):")
        L.append("")
        sweep_names = [k for k in bench_zero.SWEEP if all(k in r["contenders"] for r in runs2)]
        rows = []
        for k in sweep_names:
            rows.append([k] + [f"{_ms(r['contenders'][k]['median'])} ({r['contenders'][k]['median'] * 1e3 / (r['params'] / 1e6):.1f}/M)"
                               for r in runs2])
        L.append(_table(["contender"] + [f"{r['params'] / 1e6:.2f}M (dim {r['dim']}, {r['layers']} layers)"
                                         for r in runs2], rows))
        L.append("")
    if res.get("sp"):
        write_sp_section(L, res["sp"])
    L.append("## Plots")
    L.append("")
    for png, what in PLOTS.items():
        L.append(f"- `{png}`: {what}")
    L.append("")
    L.append("## Commands")
    L.append("")
    L.append(f"- everything: `{command}` (stage times: " +
             ", ".join(f"{k} {v:.0f} s" for k, v in res["timings_s"].items()) + ")")
    L.append("- one comparison: `python benchmarks/bench_single.py`, `bench_ddp.py`, `bench_zero.py "
             "[--world-size 4]`, `bench_fsdp.py`, `bench_kernels.py`, `bench_memory.py [--world-size 2 4]` (each "
             "takes `--quick`), `bench_sp.py` (sequence parallelism, `--checkpointing-only`).")
    L.append("- some sections again, the rest kept from results.json: `python benchmarks/run_all.py --only "
             "SECTION ...` (" + ", ".join(SECTIONS) + ").")
    L.append("")
    (out / "RESULTS.md").write_text("\n".join(L))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: tiny sizes, 1-2 repeats (needs --out: never overwrites the committed RESULTS.md)")
    ap.add_argument("--out", type=Path, default=None, help="output folder (default: benchmarks/, full run only)")
    ap.add_argument("--from-json", type=Path, default=None,
                    help="measure nothing: re-render RESULTS.md and the plots from a results.json of a full run")
    ap.add_argument("--only", nargs="+", choices=SECTIONS, default=None,
                    help="measure these sections again and keep every other one from OUT/results.json (a full "
                         "run's); the report's header says which sections were measured when")
    args = ap.parse_args(argv)
    if args.only and (args.quick or args.from_json is not None):
        ap.error("--only re-measures sections of a full run's results.json: not with --quick or --from-json")
    if args.from_json is not None:
        res = json.loads(args.from_json.read_text())
        res["rendered_from_json"] = True
        out = args.out or args.from_json.parent
        write_report(res, res["machine"], out, res.get("command", "python benchmarks/run_all.py"),
                     res.get("quick", False))
        write_plots(res, out)
        log(f"re-rendered {out / 'RESULTS.md'} and {len(PLOTS)} plots from {args.from_json}")
        return 0
    if args.out is None:
        if args.quick:
            ap.error("--quick writes a smoke report, not a measurement: pass --out DIR (the committed "
                     "benchmarks/RESULTS.md is written by the full run only)")
        args.out = HERE
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed on CPU: its CPU accelerator, Gloo
    command = "python benchmarks/run_all.py" + (" " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
                                                if (argv or sys.argv[1:]) else "")
    info = machine_info()
    if args.only:
        prior_path = args.out / "results.json"
        if not prior_path.exists():
            ap.error(f"--only keeps the other sections from {prior_path}, which does not exist: run the full "
                     "`python benchmarks/run_all.py` first")
        res = json.loads(prior_path.read_text())
        missing = [s for s in SECTIONS if s not in res and s not in args.only]
        if missing or res.get("quick"):
            ap.error(f"{prior_path} is " + ("a --quick run's" if res.get("quick") else
                     f"missing the section(s) {missing}") + ": measure them too (--only ... "
                     + " ".join(missing) + ") or run the full `python benchmarks/run_all.py`")
        new = measure_all(FULL, only=tuple(args.only))
        for section in args.only:
            res[section] = new[section]
        if "memory" in args.only:
            res.pop("memory_remeasured_at", None)  # an older re-measurement's note
        res["timings_s"].update(new["timings_s"])
        res.setdefault("remeasured", []).append({
            "sections": list(args.only), "date": info["date"], "command": command,
            "load_before": new["load_before"], "load_after": new["load_after"]})
        res.pop("rendered_from_json", None)
        info = res["machine"]
    else:
        res = measure_all(QUICK if args.quick else FULL)
        res["machine"] = info
        res["command"], res["quick"] = command, args.quick
    (args.out / "results.json").write_text(json.dumps(res, indent=1, default=str))
    write_report(res, info, args.out, res["command"] if args.only else command, args.quick)
    write_plots(res, args.out)
    log(f"wrote {args.out / 'RESULTS.md'}, results.json and {len(PLOTS)} plots"
        + ("" if args.only else f" in {res['total_s'] / 60:.1f} min"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

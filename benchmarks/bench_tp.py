"""Tensor parallelism: per-rank memory measured by the OS, the split of model-state bytes
counted tensor by tensor, the TP group's bytes per step against Megatron's count, and
DeepSpeed AutoTP side by side; step times (noisy).

Model: a Hugging Face ``LlamaForCausalLM`` built from config (default hidden 1024,
intermediate 4096, 4 layers, 16 heads, 8 KV heads, vocab 4096, untied lm_head: ~71M
parameters, all but the norms in Linear/Embedding weights), split by its own ``tp_plan``
(q/k/v/gate/up column, o/down row, embed_tokens vocab-parallel, lm_head column with its
output gathered). Loss: the model's own next-token loss on random ids (``labels=ids``).
Each data-parallel rank reads its own batch (``--batch`` x ``--seq``); the ranks of one TP
group read the same one. Every rank runs one torch thread (mixprec's process runner).

Contenders (each in its own freshly spawned Gloo process group, so a rank's resident set
is its own contender's; ``--quick`` runs the contenders of one world size in one group):

- mixprec ``Accelerator(mixed_precision="bf16", backend=B, config={"tensor_parallel":
  {"size": T}})`` for B in ddp, zero1, zero2 at TP=1 N=1, TP=1 N=2 (DP=2), TP=2 N=2 and
  TP=2 x DP=2 N=4: fp32 parameters, bf16 autocast compute, fp32 gradients and Adam
  moments; zero1/zero2 also keep an fp32 master shard (their fp32 parameters are the
  storage copy gathered after each step, docs/zero.md). torch ``AdamW`` (mixprec steps
  it with its fused C++ step).
- ``deepspeed_autotp_zero{0,1,2}``: DeepSpeed AutoTP, ``"tensor_parallel": {"autotp_size":
  2}`` next to ``zero_optimization`` stage 0/1/2, on its CPU accelerator over Gloo, N=2,
  with ``"torch_autocast": {"enabled": true, "dtype": "bfloat16"}`` (fp32 parameters,
  bf16 compute: the dtypes of the mixprec rows above) and its own C++
  ``DeepSpeedCPUAdam`` (its best optimizer on CPU).
- ``deepspeed_autotp_bf16_zero{1,2}`` vs ``zero{1,2}_bf16p_tp2_n2``: DeepSpeed's
  ``"bf16": {"enabled": true}`` mode (bf16 parameters, fp32 master partitions and Adam
  moments: what its AutoTP tutorial uses) against mixprec with
  ``param_dtype=torch.bfloat16`` (the same dtypes).

Memory (benchmarks/bench_memory.py's protocol and helpers: ``MALLOC_MMAP_THRESHOLD_`` fixed
in the ranks, baseline read after one step of the same contender on a throwaway tiny
model, ``VmRSS`` between steps after ``gc.collect()``, ``VmHWM`` reset before each step):
resident and peak growth over the baseline, max over ranks. The OS number holds the model
states plus what a step leaves or makes: activations and autograd buffers (the peak),
autocast's bf16 weight copies, the TP collectives' buffers, Gloo's buffers, allocator
slack, and for every contender the full fp32 model each rank builds before it is split
(freed at ``prepare``/``initialize``: a resident growth above the model states would show
it was not).

Split bytes: after the measured steps one more step counts, on every rank, the tensors
that hold the *split* weights (those the TP=2 plan splits; the same names at TP=1):
parameters (the local tensors), fp32 gradients (ddp: the ``.grad`` tensors after backward;
zero1: the full fp32 buckets, zero2: the owned slices of the gradient shard, from the
sharding core's layout), fp32 master slices (zero1/2) and optimizer state (the Adam
moment tensors in ``optimizer.state``, attributed to parameters through the owned ranges
of the master shard on zero1/2). Verdict per backend: each of parameter, gradient and
optimizer (moments + masters) bytes at TP=2 is 1/2 of TP=1 at the same DP size within 10%
(max over ranks).

Communication: ``mixprec.parallel.tensor.layers.comm_counters`` over the measured steps
(bytes handed to all-reduce = the buffer; to all-gather = the gathered result), converted
to bytes a rank sends with the ring send factors of _common.sent_bytes over the TP group.
Megatron's count (Shoeybi et al.): 4 all-reduces of B*S*H elements per layer per step (2
forward, 2 backward) in the activation dtype (bf16). The construction of mixprec's split
layers predicts the counters exactly (printed beside them): forward, one bf16 all-reduce
per row layer (o_proj, down_proj), one fp32 all-reduce of the vocab-parallel embedding's
lookups (its weight is fp32, F.embedding does not autocast), one all-gather of the lm_head
logits (bf16, B*S*V); backward, one all-reduce per column layer's input gradient (q, k, v,
gate, up and lm_head: 5 per layer + 1, where Megatron's fused qkv and gate_up need 2), in
fp32 (the input is the fp32 residual stream after RMSNorm, so its gradient is fp32).

Step time: median over the measured steps of the slowest rank's step, each contender in its
own run (no alternation): on a shared 2-core machine these are noisy, and N=4 is
oversubscribed (4 ranks on 2 cores).

    python benchmarks/bench_tp.py --out /tmp/tp.json            # ~10 min on 2 shared cores
    python benchmarks/bench_tp.py --quick --out /tmp/tp.json   # smoke run, tiny model
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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import deepspeed_optimizer, machine_info, package_version, sent_bytes  # noqa: E402
from _memprobe import peak_bytes, reset_peak, rss_bytes  # noqa: E402
from bench_memory import MMAP_THRESHOLD, WARMUP  # noqa: E402

from mixprec.distributed.spawn import run_distributed  # noqa: E402

BACKENDS = ["ddp", "zero1", "zero2"]
LAYOUTS = [("tp1_n1", 1, 1), ("tp1_n2", 2, 1), ("tp2_n2", 2, 2), ("tp2_n4", 4, 2)]  # (tag, N, TP)
FULL = dict(hidden=1024, intermediate=4096, layers=4, heads=16, kv_heads=8, vocab=4096, batch=2, seq=128, steps=3,
            warmup=WARMUP)
QUICK = dict(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=256, batch=2, seq=16, steps=2, warmup=1)
TINY = dict(hidden=32, intermediate=64, layers=1, heads=4, kv_heads=2, vocab=64, batch=1, seq=8)
BYTES = {"bf16": 2, "fp32": 4}


def contenders() -> list[dict]:
    """Every contender: name, kind, world size N, TP size, and its options."""
    out = [dict(name=f"{b}_{tag}", kind="mixprec", backend=b, world=n, tp=tp, param_dtype=None)
           for b in BACKENDS for tag, n, tp in LAYOUTS]
    out += [dict(name=f"{b}_bf16p_tp2_n2", kind="mixprec", backend=b, world=2, tp=2, param_dtype="bf16")
            for b in ("zero1", "zero2")]
    out += [dict(name=f"deepspeed_autotp_zero{s}", kind="deepspeed", stage=s, world=2, tp=2, ds_mode="autocast")
            for s in (0, 1, 2)]
    out += [dict(name=f"deepspeed_autotp_bf16_zero{s}", kind="deepspeed", stage=s, world=2, tp=2, ds_mode="bf16")
            for s in (1, 2)]
    return out


# Side-by-side pairs: mixprec, its DeepSpeed peer (same N, TP, stage and dtypes).
PEERS = [("ddp_tp2_n2", "deepspeed_autotp_zero0"), ("zero1_tp2_n2", "deepspeed_autotp_zero1"),
         ("zero2_tp2_n2", "deepspeed_autotp_zero2"), ("zero1_bf16p_tp2_n2", "deepspeed_autotp_bf16_zero1"),
         ("zero2_bf16p_tp2_n2", "deepspeed_autotp_bf16_zero2")]


def llama(m: dict, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=m["vocab"], hidden_size=m["hidden"], intermediate_size=m["intermediate"],
                      num_hidden_layers=m["layers"], num_attention_heads=m["heads"],
                      num_key_value_heads=m["kv_heads"], max_position_embeddings=max(64, m["seq"]),
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def batch_for(m: dict, step: int, dp_rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    return torch.randint(0, m["vocab"], (m["batch"], m["seq"]), generator=g)


# ----------------------------------------------------------------------------- contenders


def _mixprec(spec: dict, model):
    """(step(ids, probe) -> loss, context): ``probe`` runs between backward and optimizer step."""
    from mixprec import Accelerator

    kw = {"param_dtype": torch.bfloat16} if spec["param_dtype"] == "bf16" else {}
    acc = Accelerator(mixed_precision="bf16", cpu=True, backend=spec["backend"], log_policy=False,
                      config={"tensor_parallel": {"size": spec["tp"]}}, **kw)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))

    def step(ids, probe=None):
        loss = model(input_ids=ids, labels=ids).loss
        acc.backward(loss)
        if probe is not None:
            probe()
        opt.step()
        opt.zero_grad()
        return loss

    dp_rank = acc.mesh.dp_rank if acc.mesh is not None else torch.distributed.get_rank()
    return step, {"acc": acc, "model": model, "opt": opt, "dp_rank": dp_rank,
                  "optimizer": "torch AdamW (mixprec fused C++ step)"}


def _deepspeed(spec: dict, model, m: dict):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import logging

    import deepspeed
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING)
    opt, which = deepspeed_optimizer(model.parameters(), lr=1e-3)
    config = {"train_micro_batch_size_per_gpu": m["batch"], "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": spec["stage"]}, "tensor_parallel": {"autotp_size": spec["tp"]},
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**9, "wall_clock_breakdown": False}
    if spec["ds_mode"] == "bf16":
        config["bf16"] = {"enabled": True}
    else:
        config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)

    def step(ids, probe=None):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        if probe is not None:
            probe()
        engine.step()
        return loss

    rank, tp = torch.distributed.get_rank(), spec["tp"]
    return step, {"engine": engine, "model": engine.module, "dp_rank": rank // tp, "optimizer": which}


def _build(spec: dict, model, m: dict):
    return _mixprec(spec, model) if spec["kind"] == "mixprec" else _deepspeed(spec, model, m)


# ----------------------------------------------------------------------------- counting


def _split_names(model) -> list[str]:
    from mixprec.parallel.tensor import layout_of

    layout = layout_of(model)
    return sorted(layout.split) if layout is not None else []


def _count_state(ctx: dict, spec: dict, step, ids) -> dict:
    """Bytes per parameter name this rank holds in each model state (see the module
    docstring): runs one more training step, counting gradients between backward and the
    optimizer step and the optimizer state after it."""
    model, opt, acc = ctx["model"], ctx["opt"], ctx["acc"]
    name_of = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        name_of.setdefault(id(p), n)
    comm = acc.engine.comm
    cores = comm.all_cores() if hasattr(comm, "all_cores") else []
    owned: dict[str, int] = {}  # name -> elements this rank owns in the flat shards
    ranges = []  # (name, core, start in shard, numel)
    for core in cores:
        for index, _bucket, offset, _poff, numel in core.owned_ranges():
            name = name_of[id(core.params[index])]
            owned[name] = owned.get(name, 0) + numel
            ranges.append((name, core, offset, numel))
    out = {"params": {}, "grads": {}, "masters": {}, "optimizer": {}, "unmapped_optimizer": 0, "engine_grad_bytes": 0}
    for n, p in model.named_parameters():
        out["params"][n] = p.numel() * p.element_size()

    def probe():
        if spec["backend"] == "ddp":
            for n, p in model.named_parameters():
                if p.grad is not None:
                    out["grads"][n] = p.grad.numel() * p.grad.element_size()
            return
        for core in cores:
            out["engine_grad_bytes"] += core.grad_bucket_bytes() + core.grad_shard_bytes()
        if spec["backend"] == "zero1":  # full fp32 buckets until the step
            for n, p in model.named_parameters():
                out["grads"][n] = p.numel() * 4
        else:  # zero2: the owned slices of the fp32 gradient shard
            out["grads"] = {n: k * 4 for n, k in owned.items()}

    step(ids, probe)
    for core in cores:
        ms = core.master_shard
        for name, c, offset, numel in ranges:
            if c is core:
                out["masters"][name] = out["masters"].get(name, 0) + numel * ms.element_size()
    for key, st in opt.state.items():
        tensors = [v for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
        if not tensors:
            continue
        if id(key) in name_of:  # ddp: the state is keyed by the model's own parameter
            n = name_of[id(key)]
            out["optimizer"][n] = out["optimizer"].get(n, 0) + sum(v.nbytes for v in tensors)
            continue
        per_elem = sum(v.element_size() for v in tensors)
        mapped = 0
        for core in cores:  # zero1/2: the key is (a piece of) a master shard
            ms = core.master_shard
            start = (key.data_ptr() - ms.data_ptr()) // ms.element_size()
            if not 0 <= start < ms.numel():
                continue
            end = start + key.numel()
            for name, c, offset, numel in ranges:
                if c is not core:
                    continue
                k = max(0, min(end, offset + numel) - max(start, offset))
                if k:
                    out["optimizer"][name] = out["optimizer"].get(name, 0) + k * per_elem
                    mapped += k
        out["unmapped_optimizer"] += (key.numel() - mapped) * per_elem
    return out


# ----------------------------------------------------------------------------- one rank


def _settle() -> int:
    gc.collect()
    return rss_bytes()


def _run_spec(spec: dict, m: dict, warm: bool) -> dict:
    import torch.distributed as dist

    from mixprec.parallel.tensor.layers import comm_counters, reset_comm_counters

    rank = dist.get_rank()
    t_start = time.perf_counter()
    if spec["kind"] == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed  # noqa: F401
    if warm:  # [Note: baseline after a throwaway run] in bench_memory.py: code loaded and
        # kernels initialised on first use go into the baseline.
        warm_step, warm_ctx = _build(spec, llama(TINY), TINY)
        warm_step(batch_for(TINY, 0, warm_ctx["dp_rank"]))
        del warm_step, warm_ctx
    baseline = _settle()
    model = llama(m)
    n_full = sum(p.numel() for p in model.parameters())
    step, ctx = _build(spec, model, m)
    del model
    dp_rank = ctx["dp_rank"]
    for i in range(m["warmup"]):
        step(batch_for(m, i, dp_rank))
    reset_comm_counters()
    resident, peak, times, losses = [], [], [], []
    for i in range(m["warmup"], m["warmup"] + m["steps"]):
        ids = batch_for(m, i, dp_rank)
        before = _settle()
        dist.barrier()
        reset_peak()
        t0 = time.perf_counter()
        loss = step(ids)
        times.append(time.perf_counter() - t0)
        peak.append(peak_bytes())
        resident.append(before)
        losses.append(float(loss.detach()))
    resident.append(_settle())
    counters = {k: v / m["steps"] for k, v in comm_counters().items()}
    out = {"rank": rank, "baseline": baseline, "resident": max(resident), "peak": max(peak), "times": times,
           "losses": losses, "full_params": n_full, "optimizer": ctx["optimizer"],
           "local_params": sum(p.numel() for p in ctx["model"].parameters()),
           "local_param_bytes": sum(p.numel() * p.element_size() for p in ctx["model"].parameters()),
           "comm_per_step": counters}
    if spec["kind"] == "mixprec":
        out["split_names"] = _split_names(ctx["model"])
        out["state"] = _count_state(ctx, spec, step, batch_for(m, m["warmup"] + m["steps"], dp_rank))
        out["mesh"] = ctx["acc"].mesh.describe() if ctx["acc"].mesh is not None else "no mesh (TP=1)"
    del step, ctx
    gc.collect()
    dist.barrier()
    out["seconds"] = time.perf_counter() - t_start
    return out


def _rank_main(state, specs: list[dict], m: dict) -> list[list]:
    import torch.distributed as dist

    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != MMAP_THRESHOLD:
        raise RuntimeError("MALLOC_MMAP_THRESHOLD_ is not set in the rank: start ranks through measure()")
    from mixprec.distributed.spawn import free_port

    own_group = not dist.is_initialized()  # N=1: the runner makes no group; DeepSpeed and mixprec want one
    if own_group:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        results = []
        for i, spec in enumerate(specs):
            try:
                mine = _run_spec(spec, m, warm=i == 0)  # later contenders of a grouped run: warm already
            except Exception:  # noqa: BLE001 - a peer that cannot run here is reported (where and why)
                if spec["kind"] != "deepspeed":
                    raise
                import traceback

                mine = {"error": traceback.format_exc()[-1500:]}
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
            results.append(gathered)
        return results
    finally:
        if own_group:
            gc.collect()
            dist.destroy_process_group()


# ----------------------------------------------------------------------------- driver


def _summarise(spec: dict, ranks: list[dict]) -> dict:
    steps = len(ranks[0]["times"])
    slowest = [max(r["times"][i] for r in ranks) for i in range(steps)]
    res = {k: spec[k] for k in ("kind", "world", "tp") if k in spec}
    res.update(dp=spec["world"] // spec["tp"], optimizer=ranks[0]["optimizer"],
               baseline=max(r["baseline"] for r in ranks), resident=max(r["resident"] for r in ranks),
               peak=max(r["peak"] for r in ranks),
               resident_growth=max(r["resident"] - r["baseline"] for r in ranks),
               peak_growth=max(r["peak"] - r["baseline"] for r in ranks),
               step_time={"median": statistics.median(slowest), "min": min(slowest), "max": max(slowest),
                          "samples": slowest},
               local_params=max(r["local_params"] for r in ranks),
               local_param_bytes=max(r["local_param_bytes"] for r in ranks),
               full_params=ranks[0]["full_params"], losses=ranks[0]["losses"],
               comm_per_step=ranks[0]["comm_per_step"], seconds=max(r["seconds"] for r in ranks),
               per_rank=[{k: r[k] for k in ("baseline", "resident", "peak", "local_params")} for r in ranks])
    for k in ("backend", "param_dtype", "stage", "ds_mode"):
        if k in spec:
            res[k] = spec[k]
    if "state" in ranks[0]:
        # Model states held between steps, counted: parameters, masters, optimizer state and,
        # on ddp only, the gradient buckets (zero1/zero2 free theirs at zero_grad).
        held = ["params", "masters", "optimizer"] + (["grads"] if spec["backend"] == "ddp" else [])
        res["counted_between_steps"] = max(sum(sum(r["state"][p].values()) for p in held) for r in ranks)
        res["state_per_rank"] = [r["state"] for r in ranks]
        res["split_names"] = ranks[0]["split_names"]
        res["mesh"] = [r["mesh"] for r in ranks]
    return res


def _split_bytes(res: dict, names: set) -> dict:
    """Max over ranks of the bytes of ``names`` in each model state (optimizer = moments + masters)."""
    out = {}
    for part in ("params", "grads", "masters", "optimizer"):
        out[part] = max(sum(v for n, v in st[part].items() if n in names) for st in res["state_per_rank"])
    out["optimizer_with_masters"] = max(
        sum(v for n, v in st["optimizer"].items() if n in names) + sum(v for n, v in st["masters"].items() if n in names)
        for st in res["state_per_rank"])
    out["total"] = max(sum(sum(v for n, v in st[p].items() if n in names) for p in ("params", "grads", "masters", "optimizer"))
                       for st in res["state_per_rank"])
    return out


def split_verdicts(rows: dict, tol: float = 0.10) -> list[dict]:
    """Per backend and DP size: the split weights' bytes at TP=2 over TP=1 (same DP), and
    whether parameter, gradient and optimizer (+master) bytes each fall to 1/2 within 10%."""
    out = []
    for b in BACKENDS:
        for dp, (tp1, tp2) in {1: (f"{b}_tp1_n1", f"{b}_tp2_n2"), 2: (f"{b}_tp1_n2", f"{b}_tp2_n4")}.items():
            if tp1 not in rows or tp2 not in rows or "state_per_rank" not in rows[tp2]:
                continue
            names = set(rows[tp2]["split_names"])
            a, c = _split_bytes(rows[tp1], names), _split_bytes(rows[tp2], names)
            ratios = {p: c[p] / a[p] for p in ("params", "grads", "optimizer_with_masters", "total") if a[p]}
            checked = {p: ratios[p] for p in ("params", "grads", "optimizer_with_masters")}
            met = all(abs(r * 2 - 1) <= tol for r in checked.values())
            out.append({"backend": b, "dp": dp, "tp1": tp1, "tp2": tp2, "n_split_names": len(names),
                        "tp1_bytes": a, "tp2_bytes": c, "ratios": ratios, "target": 0.5, "tolerance": tol,
                        "verdict": "met" if met else "missed",
                        "unmapped_optimizer": max(st["unmapped_optimizer"] for st in rows[tp2]["state_per_rank"])})
    return out


def comm_analysis(rows: dict, m: dict) -> list[dict]:
    """Bytes a rank sends on its TP group per step vs Megatron's 4 B*S*H per layer."""
    B, S, H, L, V = m["batch"], m["seq"], m["hidden"], m["layers"], m["vocab"]
    out = []
    for name, r in rows.items():
        if r.get("kind") != "mixprec" or r["tp"] < 2:
            continue
        tp, c = r["tp"], r["comm_per_step"]
        sent = sent_bytes("allreduce", c["all_reduce"], tp) + sent_bytes("allgather", c["all_gather"], tp)
        megatron_handed = 4 * B * S * H * L * BYTES["bf16"]
        megatron = sent_bytes("allreduce", megatron_handed, tp)
        act = BYTES["bf16"]
        # The residual stream (embedding output, RMSNorm output, their gradients) is in the
        # parameter dtype: fp32 under the default bf16 policy, bf16 with param_dtype=bf16.
        rs, rs_name = (2, "bf16") if r.get("param_dtype") == "bf16" else (4, "fp32")
        predicted = {  # bytes handed, by the construction of the split layers (module docstring)
            "fwd row all-reduce (o_proj, down_proj), bf16": 2 * L * B * S * H * act,
            f"fwd vocab-embedding all-reduce, {rs_name}": B * S * H * rs,
            # one per input that column layers share (q/k/v, gate/up) and the lm_head's:
            # [Note: one copy_to per shared input] in src/mixprec/parallel/tensor/layers.py
            f"bwd column-input all-reduce (attention and MLP input per layer + lm_head), {rs_name}":
                (2 * L + 1) * B * S * H * rs,
            "fwd lm_head all-gather (logits B*S*V), bf16": B * S * V * act,
        }
        pred_ag = predicted["fwd lm_head all-gather (logits B*S*V), bf16"]
        pred_ar = sum(predicted.values()) - pred_ag
        out.append({"contender": name, "tp": tp, "dp": r["dp"], "per_step": c, "sent": sent,
                    "sent_allreduce": sent_bytes("allreduce", c["all_reduce"], tp),
                    "sent_allgather": sent_bytes("allgather", c["all_gather"], tp),
                    "megatron_handed": megatron_handed, "megatron_sent": megatron, "ratio": sent / megatron,
                    "predicted_handed": predicted, "predicted_allreduce": pred_ar, "predicted_allgather": pred_ag,
                    "predicted_allreduce_calls": 2 * (2 * L + 1), "predicted_allgather_calls": 1,
                    "matches_prediction": c["all_reduce"] == pred_ar and c["all_gather"] == pred_ag})
    return out


def peer_rows(rows: dict) -> list[dict]:
    out = []
    for ours, peer in PEERS:
        if ours in rows and peer in rows:
            a, b = rows[ours], rows[peer]
            out.append({"ours": ours, "peer": peer,
                        "resident_growth": a["resident_growth"] / b["resident_growth"],
                        "peak_growth": a["peak_growth"] / b["peak_growth"],
                        "step_time": a["step_time"]["median"] / b["step_time"]["median"]})
    return out


def measure(m: dict, *, grouped: bool = False, only: list[str] | None = None, timeout: float = 1800) -> dict:
    """Run every contender (each in its own process group; ``grouped``: one group per world
    size and kind, for smoke runs) and analyse. DeepSpeed contenders that cannot run here
    are listed under ``skipped`` with the exception; any mixprec failure raises."""
    specs = [s for s in contenders() if only is None or s["name"] in only]
    out = {"model": dict(m), "warmup": m["warmup"], "mmap_threshold": int(MMAP_THRESHOLD), "grouped": grouped,
           "machine": machine_info(), "load_before": os.getloadavg(), "contenders": {}, "skipped": {}}
    jobs: list[list[dict]] = []
    if grouped:  # one group per world size; DeepSpeed last in its group (it keeps global state)
        keyed: dict = {}
        for s in sorted(specs, key=lambda s: s["kind"] == "deepspeed"):
            if s["kind"] == "deepspeed" and package_version("deepspeed") is None:
                out["skipped"][s["name"]] = "deepspeed is not installed"
                continue
            keyed.setdefault(s["world"], []).append(s)
        jobs = list(keyed.values())
    else:
        jobs = [[s] for s in specs]
    previous = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = MMAP_THRESHOLD  # inherited by the spawned ranks
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        for job in jobs:
            if not grouped and job[0]["kind"] == "deepspeed" and package_version("deepspeed") is None:
                for s in job:
                    out["skipped"][s["name"]] = "deepspeed is not installed"
                continue
            print(f"  running {', '.join(s['name'] for s in job)} (N={job[0]['world']})", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            try:
                results = run_distributed(_rank_main, job[0]["world"], args=(job, m), timeout=timeout)[0]
            except Exception as e:  # noqa: BLE001 - a peer that cannot run here is reported
                if any(s["kind"] != "deepspeed" for s in job):
                    raise
                for s in job:
                    out["skipped"][s["name"]] = f"{type(e).__name__}: {str(e)[-1500:]}"
                continue
            for s, ranks in zip(job, results):
                errors = [r["error"] for r in ranks if "error" in r]
                if errors:
                    out["skipped"][s["name"]] = errors[0]
                else:
                    out["contenders"][s["name"]] = _summarise(s, ranks)
            out.setdefault("job_seconds", {})[" ".join(s["name"] for s in job)] = time.perf_counter() - t0
    finally:
        if previous is None:
            os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = previous
    out["load_after"] = os.getloadavg()
    out["split"] = split_verdicts(out["contenders"])
    out["comm"] = comm_analysis(out["contenders"], m)
    out["peers"] = peer_rows(out["contenders"])
    return out


# ----------------------------------------------------------------------------- report


def _mib(b: float) -> str:
    return f"{b / 2**20:.1f}"


def report(res: dict) -> None:
    m, rows = res["model"], res["contenders"]
    P = next(iter(rows.values()))["full_params"] if rows else 0
    print(f"## Tensor parallelism (bench_tp.py{' --quick' if res['grouped'] else ''})\n")
    print(f"Llama from config: hidden {m['hidden']}, intermediate {m['intermediate']}, {m['layers']} layers, "
          f"{m['heads']} heads / {m['kv_heads']} KV heads, vocab {m['vocab']}: {P / 1e6:.2f}M params "
          f"(fp32 {_mib(4 * P)} MiB); batch {m['batch']}x{m['seq']} per DP rank; {res['warmup']} warm-up + "
          f"{m['steps']} measured steps; 1 torch thread per rank; load average before {res['load_before'][0]:.1f}, "
          f"after {res['load_after'][0]:.1f}."
          + (" GROUPED smoke run: contenders share processes, memory figures are not isolated." if res["grouped"] else ""))
    print("\n### Memory per rank (OS: VmRSS / VmHWM growth over the pre-model baseline, MiB, max over ranks) "
          "and step time (median of the slowest rank, ms; NOISY: shared 2-core machine, N=4 oversubscribed)\n")
    print("Counted states: this rank's parameters, fp32 masters, optimizer state and (ddp only: zero1/2 free them "
          "at zero_grad) gradient buckets, as held between steps; other = resident growth - counted states.\n")
    print("| contender | N | TP x DP | dtypes | params/rank (M) | param MiB/rank | resident growth | counted states "
          "| other | peak growth | baseline | step ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        dt = ("bf16 params + fp32 masters" if r.get("param_dtype") == "bf16" or r.get("ds_mode") == "bf16"
              else "fp32 params, bf16 autocast")
        counted = r.get("counted_between_steps")
        states = (f"{_mib(counted)} | {_mib(r['resident_growth'] - counted)}" if counted is not None
                  else "not counted | -")
        print(f"| {name} | {r['world']} | {r['tp']} x {r['dp']} | {dt} | {r['local_params'] / 1e6:.2f} | "
              f"{_mib(r['local_param_bytes'])} | {_mib(r['resident_growth'])} | {states} | "
              f"{_mib(r['peak_growth'])} | {_mib(r['baseline'])} | {r['step_time']['median'] * 1e3:.0f} |")
    for name, why in res["skipped"].items():
        last = why.strip().splitlines()[-1] if why.strip() else why
        print(f"| {name} | did not run: {last} | | | | | | | | | | |")
    for name, why in res["skipped"].items():
        print(f"\n{name} did not run; where and why:\n```\n{why.strip()}\n```")
    if res["split"]:
        print("\n### Split weights' model-state bytes per rank (counted tensors, MiB, max over ranks): TP=2 vs TP=1 "
              "at the same DP size; target 1/TP = 0.5 within 10% for params, grads and optimizer (moments + "
              "masters)\n")
        print("| backend | DP | params TP1 -> TP2 | grads TP1 -> TP2 | optimizer+masters TP1 -> TP2 | ratios p/g/o "
              "| verdict |")
        print("|---|---|---|---|---|---|---|")
        for v in res["split"]:
            a, c, q = v["tp1_bytes"], v["tp2_bytes"], v["ratios"]
            print(f"| {v['backend']} | {v['dp']} | {_mib(a['params'])} -> {_mib(c['params'])} | {_mib(a['grads'])} -> "
                  f"{_mib(c['grads'])} | {_mib(a['optimizer_with_masters'])} -> {_mib(c['optimizer_with_masters'])} | "
                  f"{q['params']:.3f} / {q['grads']:.3f} / {q['optimizer_with_masters']:.3f} | {v['verdict']} |")
    if res["comm"]:
        print("\n### TP-group bytes a rank sends per step (counters x ring send factor) vs Megatron "
              "(4 all-reduces of B*S*H bf16 per layer per step)\n")
        print("| contender | all-reduce calls | all-reduce MiB handed | all-gather MiB | sent MiB | Megatron sent MiB "
              "| measured / Megatron | = predicted |")
        print("|---|---|---|---|---|---|---|---|")
        for c in res["comm"]:
            p = c["per_step"]
            print(f"| {c['contender']} | {p['all_reduce_calls']:.0f} | {_mib(p['all_reduce'])} | {_mib(p['all_gather'])} "
                  f"| {_mib(c['sent'])} | {_mib(c['megatron_sent'])} | {c['ratio']:.2f} | "
                  f"{'yes' if c['matches_prediction'] else 'NO'} |")
        shown = {}  # one example per parameter dtype
        for c in res["comm"]:
            shown.setdefault(rows[c["contender"]].get("param_dtype"), c)
        for c in shown.values():
            print(f"\nPredicted bytes handed per step, {c['contender']} (why the ratio is not 1):")
            for k, v in c["predicted_handed"].items():
                print(f"- {k}: {_mib(v)} MiB")
            print(f"- Megatron: 4 x {m['layers']} layers x B*S*H bf16 all-reduced: {_mib(c['megatron_handed'])} MiB")
    if res["peers"]:
        print("\n### mixprec vs DeepSpeed AutoTP, N=2, TP=2 (ratios mixprec / DeepSpeed; < 1: mixprec smaller/faster)\n")
        print("| mixprec | DeepSpeed | resident growth | peak growth | step time (noisy) |")
        print("|---|---|---|---|---|")
        for p in res["peers"]:
            print(f"| {p['ours']} | {p['peer']} | {p['resident_growth']:.3f} | {p['peak_growth']:.3f} | "
                  f"{p['step_time']:.3f} |")
    opts = {r["optimizer"] for n, r in rows.items() if r["kind"] == "deepspeed"}
    if opts:
        print(f"\nDeepSpeed optimizer: {', '.join(sorted(opts))}.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for k, v in FULL.items():
        ap.add_argument(f"--{k.replace('_', '-')}", type=int, default=v)
    ap.add_argument("--only", nargs="*", choices=[s["name"] for s in contenders()], default=None)
    ap.add_argument("--quick", action="store_true", help="tiny model, contenders of one world size share a group")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON to this file")
    ap.add_argument("--from-json", type=Path, default=None,
                    help="re-render the report of an earlier --out (the analyses recomputed, no new measurement)")
    args = ap.parse_args()
    if args.from_json is not None:
        res = json.loads(args.from_json.read_text())
        res["comm"] = comm_analysis(res["contenders"], res["model"])
        res["peers"] = peer_rows(res["contenders"])
    else:
        m = dict(QUICK) if args.quick else {k: getattr(args, k) for k in FULL}
        res = measure(m, grouped=args.quick, only=args.only)
    report(res)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()

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

[Note: oneDNN's primitive cache]: torch runs CPU bf16 matmuls through oneDNN, which keeps the
primitives it built (with their reordered weights and scratchpads) in a process-wide cache,
one per distinct shape, kept after the step. Measured in plain PyTorch (a bf16 TinyLM
dim 512 x 4 layers, one forward and backward, no framework; ``mallinfo2`` mapped bytes after
every tensor is freed): 9.9 MiB stay mapped with the default cache, 0.7 MiB with
``ONEDNN_PRIMITIVE_CACHE_CAPACITY=0``. That memory is the runtime's, the same for every
contender, and it is not a model state, so the ZeRO ideal does not count it; ``--onednn-cache
off`` measures the peaks without it (the default keeps it: it is what a user's process holds).

    python benchmarks/bench_memory.py                  # N=2 and N=4 (14 min on 2 cores shared at load 11-14)
    python benchmarks/bench_memory.py --world-size 2 --quick
    # issue 28: like-for-like reduce dtypes ([Note: like-for-like reduce dtypes]), peak growth / ideal
    python benchmarks/bench_memory.py --like-for-like --model mlp --dim 2048 --layers 16 --world-size 2
    # the same, TinyLM, oneDNN's primitive cache off (see the Note below)
    python benchmarks/bench_memory.py --only zero1 deepspeed_zero1_rfp32 --onednn-cache off --world-size 2 4
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
# [Note: like-for-like reduce dtypes]: mixprec reduces gradients in fp32 by default, DeepSpeed
# in the parameter dtype (bf16 here). "_rbf16": mixprec with reduce_dtype=bf16 / fully_shard with
# MixedPrecisionPolicy(reduce_dtype=bf16); "_rfp32": DeepSpeed with communication_data_type fp32.
LIKE_CONTENDERS = ["zero1", "zero2", "zero3", "zero1_rbf16", "zero2_rbf16", "zero3_rbf16",
                   "deepspeed_zero1_rfp32", "deepspeed_zero2_rfp32", "deepspeed_zero3_rfp32",
                   "deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero3", "torch_fsdp2", "torch_fsdp2_rbf16"]
LIKE_FOR_LIKE = [("zero1", "deepspeed_zero1_rfp32"), ("zero2", "deepspeed_zero2_rfp32"),
                 ("zero3", "deepspeed_zero3_rfp32"), ("zero3", "torch_fsdp2"),
                 ("zero1_rbf16", "deepspeed_zero1"), ("zero2_rbf16", "deepspeed_zero2"),
                 ("zero3_rbf16", "deepspeed_zero3"), ("zero3_rbf16", "torch_fsdp2_rbf16")]
STAGE = {"mixprec_ddp": 0, "torch_ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3,
         "deepspeed_zero1": 1, "deepspeed_zero2": 2, "deepspeed_zero3": 3, "torch_fsdp2": 3}
for _name in LIKE_CONTENDERS:
    STAGE.setdefault(_name, STAGE[_name.rsplit("_r", 1)[0]])
UNITS_BY_MODEL = {"tinylm": ["TransformerEncoderLayer"], "mlp": ["Linear"]}
UNITS = UNITS_BY_MODEL["tinylm"]
BUCKET = {"bucket_cap_mb": 25, "first_bucket_cap_mb": 1}
WARMUP = 2


def paper_bytes(stage: int, P: int, N: int, K: int = 12) -> float:
    """Model-state bytes per rank of the ZeRO paper (fp16/bf16 params and grads, K bytes of
    optimizer state per parameter): DDP (2+2+K)P; stage 1 4P + KP/N; stage 2 2P + (2+K)P/N;
    stage 3 (2+2+K)P/N."""
    return {0: (2 + 2 + K) * P, 1: 4 * P + K * P / N, 2: 2 * P + (2 + K) * P / N, 3: (2 + 2 + K) * P / N}[stage]


def ideal_bytes(stage: int, P: int, N: int, bucket_bytes: int = BUCKET["bucket_cap_mb"] * 2**20) -> float:
    """Issue 28's per-rank ideal for a step's peak: the ZeRO paper's model states with bf16
    parameters, fp32 masters, Adam moments and gradient shard (16P/N), plus what a step needs in
    flight. Stage 1: 2P + 4P + 12P/N (the full fp32 gradient, 4P, whole at the step). Stage 2:
    2P + 16P/N + 3 buckets (2 reducing, 1 filling) + one bf16 shard gather (2P/N). Stage 3: the
    same with 2P/N of bf16 parameters. DDP: the paper's (2+2+12)P."""
    return {0: 16 * P, 1: 2 * P + 4 * P + 12 * P / N, 2: 2 * P + 16 * P / N + 3 * bucket_bytes + 2 * P / N,
            3: 2 * P / N + 16 * P / N + 3 * bucket_bytes + 2 * P / N}[stage]


def mlp(width: int, layers: int, seed: int = 0) -> nn.Module:
    """Issue 28's MLP: ``layers`` x Linear(width) (16 x 2048: 67.1M parameters)."""
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def mlp_loss(out: torch.Tensor, _target=None) -> torch.Tensor:
    return out.float().square().mean()


def _settle() -> int:
    gc.collect()
    return rss_bytes()


# ----------------------------------------------------------------------------- contenders


def mixprec_prepare(name: str, model: nn.Module, loss_fn=lm_loss):
    """The mixprec contender ``name`` (bf16 parameters, fp32 masters, AdamW, 25 MiB buckets):
    its Accelerator, prepared model and optimizer."""
    from mixprec import Accelerator, PrecisionPolicy

    if name == "mixprec_ddp":
        acc = Accelerator(mixed_precision="bf16", backend="ddp", cpu=True, log_policy=False,
                          engine_options=dict(BUCKET))
    else:
        backend = name.split("_r")[0]
        opts = dict(BUCKET)
        if backend in ("zero3", "fsdp"):
            opts["units"] = UNITS_BY_MODEL["mlp" if loss_fn is mlp_loss else "tinylm"]
        reduce = {"reduce_dtype": torch.bfloat16} if name.endswith("_rbf16") else {}
        policy = PrecisionPolicy.from_mixed_precision("bf16", param_dtype=torch.bfloat16, **reduce)
        acc = Accelerator(policy=policy, backend=backend, cpu=True, log_policy=False, engine_options=opts)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    return acc, model, opt


def _mixprec(name: str, model: nn.Module, loss_fn=lm_loss):
    acc, model, opt = mixprec_prepare(name, model, loss_fn)

    def step(x, tgt):
        loss = loss_fn(model(x), tgt)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        return loss

    return step, {"optimizer": "mixprec fused C++ AdamW step"}


def _deepspeed(stage: int, model: nn.Module, batch: int, loss_fn=lm_loss, comm_fp32: bool = False):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    opt, which = deepspeed_optimizer(model.parameters(), lr=1e-3)
    # Buckets of as many elements as mixprec's 25 MiB fp32 buckets hold (DeepSpeed counts elements).
    elements = int(BUCKET["bucket_cap_mb"] * 2**20 // 4)
    zero = {"stage": stage, "reduce_bucket_size": elements, "allgather_bucket_size": elements}
    config = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1,
              "bf16": {"enabled": True}, "zero_optimization": zero,
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**9, "wall_clock_breakdown": False}
    if comm_fp32:  # [Note: like-for-like reduce dtypes]
        config["communication_data_type"] = "fp32"
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)

    def step(x, tgt):
        if x.is_floating_point():
            x = x.to(torch.bfloat16)  # DeepSpeed's bf16 engine does not cast inputs
        loss = loss_fn(engine(x), tgt)
        engine.backward(loss)
        engine.step()
        return loss

    return step, {"optimizer": which}


def _torch_ddp(model: nn.Module):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(model, bucket_cap_mb=25, gradient_as_bucket_view=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    return torch_step(model, opt), {"optimizer": "torch AdamW(fused=True)"}


def _fsdp2(model: nn.Module, world: int, loss_fn=lm_loss, reduce_dtype=torch.float32):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    units = UNITS_BY_MODEL["mlp" if loss_fn is mlp_loss else "tinylm"]
    for m in model.modules():
        if type(m).__name__ in units:
            fully_shard(m, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model.set_force_sum_reduction_for_comms(True)  # Gloo has no AVG reduce-scatter
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

    def step(x, tgt):
        loss = loss_fn(model(x), tgt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step, {"optimizer": "torch AdamW(fused=True) on DTensor shards"}


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


def _build(name: str, model: nn.Module, world: int, batch: int, loss_fn=lm_loss):
    if name.startswith("deepspeed_zero"):
        return _deepspeed(STAGE[name], model, batch, loss_fn, comm_fp32=name.endswith("_rfp32"))
    if name == "torch_ddp":
        return _torch_ddp(model)
    if name in ("torch_fsdp2", "torch_fsdp2_rbf16"):
        return _fsdp2(model, world, loss_fn, torch.bfloat16 if name.endswith("_rbf16") else torch.float32)
    if name in ("mixprec_ddp", "fsdp") or name in LIKE_CONTENDERS:
        return _mixprec(name, model, loss_fn)
    raise ValueError(f"unknown contender {name!r}; known: {CONTENDERS + LIKE_CONTENDERS}")


def _model_and_data(cfg: dict, rank: int, count: int):
    """The measured model, a throwaway tiny one of the same kind, its loss and ``count`` batches."""
    if cfg.get("model", "tinylm") == "mlp":
        gen = torch.Generator().manual_seed(100 + rank)
        data = [(torch.randn(cfg["batch"], cfg["dim"], generator=gen), None) for _ in range(count)]
        return (lambda: mlp(cfg["dim"], cfg["layers"])), (lambda: mlp(16, 1)), mlp_loss, data, \
            [(torch.randn(cfg["batch"], 16), None)]
    data = round_batches(1, count, cfg["batch"], seed=100 + rank)[0]
    return (lambda: tinylm(cfg["dim"], cfg["layers"])), (lambda: tinylm(16, 1, heads=2)), lm_loss, data, data[:1]


# ----------------------------------------------------------------------------- one rank


def _rank_main(state, name: str, cfg: dict) -> dict:
    import torch.distributed as dist

    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != MMAP_THRESHOLD:
        raise RuntimeError(f"MALLOC_MMAP_THRESHOLD_={os.environ.get('MALLOC_MMAP_THRESHOLD_')!r} in the rank, "
                           f"expected {MMAP_THRESHOLD}: start ranks through measure(), which sets it before spawning")
    rank, world = dist.get_rank(), dist.get_world_size()
    _import_framework(name)
    make, make_tiny, loss_fn, data, tiny_data = _model_and_data(cfg, rank, WARMUP + cfg["steps"])
    # [Note: baseline after a throwaway run]: a framework loads code and initialises kernels
    # (its C++ extension, oneDNN's bf16 paths, DeepSpeed's ops) on first use, tens of MiB
    # that are no model state; one step of the same contender on a tiny model first puts
    # all of that into the baseline, so "growth" is what this model costs.
    warm_step, _ = _build(name, make_tiny(), world, cfg["batch"], loss_fn)
    warm_step(*tiny_data[0])
    del warm_step
    baseline = _settle()
    model = make()
    P = n_params(model)
    step, info = _build(name, model, world, cfg["batch"], loss_fn)
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
    res["ideal_bytes"] = ideal_bytes(STAGE[name], P, world)
    res["params"] = P
    return res


@contextlib.contextmanager
def mmap_threshold_env(onednn_cache: bool = True):
    """``MALLOC_MMAP_THRESHOLD_`` set for the ranks spawned inside (they inherit it), put back
    after; with ``onednn_cache=False`` also ``ONEDNN_PRIMITIVE_CACHE_CAPACITY=0`` ([Note: oneDNN's
    primitive cache])."""
    values = {"MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD}
    if not onednn_cache:
        values["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = "0"
    previous = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in previous.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def measure(worlds=(2, 4), *, dim: int = 512, layers: int = 4, batch: int = 4, steps: int = 2,
            contenders: list[str] = CONTENDERS, timeout: float = 900, model: str = "tinylm",
            onednn_cache: bool = True) -> dict:
    """Memory of every contender at every world size; ``{"worlds": {N: {name: result}}, ...}``.
    A DeepSpeed contender that cannot run here (not installed, init error) is listed under
    ``skipped`` with the reason; any other failure raises. ``model``: "tinylm" (the benchmark
    transformer) or "mlp" (issue 28's ``layers`` x Linear(``dim``), batch x dim inputs).
    ``onednn_cache=False``: the ranks run with oneDNN's primitive cache off ([Note: oneDNN's
    primitive cache])."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if model not in UNITS_BY_MODEL:
        raise ValueError(f"model={model!r} is not one of {sorted(UNITS_BY_MODEL)}")
    cfg = dict(dim=dim, layers=layers, batch=batch, steps=steps, model=model)
    P = n_params(mlp(dim, layers) if model == "mlp" else tinylm(dim, layers))
    out = {"dim": dim, "layers": layers, "batch": batch, "steps": steps, "warmup": WARMUP, "model": model,
           "mmap_threshold": int(MMAP_THRESHOLD), "onednn_cache": onednn_cache, "params": P, "worlds": {},
           "skipped": {}}
    with mmap_threshold_env(onednn_cache):  # inherited by the spawned ranks
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


def like_for_like(res: dict) -> list[dict]:
    """[Note: like-for-like reduce dtypes]: mixprec vs the peer reducing in the same dtype, peak
    growth ratio (<= 1.0: mixprec holds no more), and each one's peak growth / ideal_bytes."""
    rows = []
    for world, cont in res["worlds"].items():
        for ours, peer in LIKE_FOR_LIKE:
            if ours in cont and peer in cont:
                a, b = cont[ours], cont[peer]
                rows.append({"world": int(world), "ours": ours, "peer": peer,
                             "peak": a["peak_growth"] / b["peak_growth"],
                             "ours_ideal": a["peak_growth"] / a["ideal_bytes"],
                             "peer_ideal": b["peak_growth"] / b["ideal_bytes"]})
    return rows


def _mib(b: float) -> str:
    return f"{b / 2**20:.1f}"


def report(res: dict) -> None:
    P = res["params"]
    what = (f"MLP {res['layers']} x Linear({res['dim']}), batch {res['batch']}x{res['dim']}"
            if res.get("model") == "mlp" else f"TinyLM, batch {res['batch']}x64")
    cache = "" if res.get("onednn_cache", True) else ", ONEDNN_PRIMITIVE_CACHE_CAPACITY=0"
    print(f"Memory per rank (OS: VmRSS/VmHWM, MALLOC_MMAP_THRESHOLD_={res['mmap_threshold']}{cache}), {what}, "
          f"{P / 1e6:.2f}M params (fp32 {_mib(4 * P)} MiB), {res['warmup']} warm-up + "
          f"{res['steps']} measured steps; MiB, max over ranks")
    for world, cont in res["worlds"].items():
        print(f" N={world}: {'contender':<22} {'peak':>8} {'resident':>9} {'transient':>9} {'baseline':>9} "
              f"{'res.growth':>10} {'peak growth':>11} {'paper':>8} {'ideal':>8} {'peak/ideal':>10}")
        for name, r in cont.items():
            ideal = r.get("ideal_bytes", ideal_bytes(r["stage"], r["params"], int(world)))
            print(f"       {name:<22} {_mib(r['peak']):>8} {_mib(r['resident']):>9} {_mib(r['transient']):>9} "
                  f"{_mib(r['baseline']):>9} {_mib(r['resident_growth']):>10} {_mib(r['peak_growth']):>11} "
                  f"{_mib(r['paper_bytes']):>8} {_mib(ideal):>8} {r['peak_growth'] / ideal:>10.3f}  "
                  f"({r['optimizer']})")
    for c in comparisons(res):
        print(f"  N={c['world']} {c['ours']}/{c['peer']}: resident growth {c['resident']:.3f}, "
              f"peak growth {c['peak']:.3f}")
    for c in like_for_like(res):
        print(f"  like for like N={c['world']} {c['ours']}/{c['peer']}: peak growth {c['peak']:.3f} "
              f"(peak growth / ideal: {c['ours_ideal']:.3f} vs {c['peer_ideal']:.3f})")
    for k, why in res["skipped"].items():
        print(f"  {k} did not run: {why}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--world-size", type=int, nargs="*", default=[2, 4])
    ap.add_argument("--only", nargs="*", choices=sorted(set(CONTENDERS + LIKE_CONTENDERS)), default=None)
    ap.add_argument("--like-for-like", action="store_true",
                    help="the like-for-like contenders of issue 28 (both reduce dtypes) instead of CONTENDERS")
    ap.add_argument("--model", choices=sorted(UNITS_BY_MODEL), default="tinylm",
                    help="mlp: issue 28's layers x Linear(dim) (use --dim 2048 --layers 16 for its 67M MLP)")
    ap.add_argument("--onednn-cache", choices=["on", "off"], default="on",
                    help="off: ranks run with ONEDNN_PRIMITIVE_CACHE_CAPACITY=0, so the peak holds no cached "
                         "oneDNN primitives ([Note: oneDNN's primitive cache])")
    ap.add_argument("--quick", action="store_true", help="tiny model (smoke run)")
    args = ap.parse_args()
    if args.quick:
        args.dim, args.layers, args.steps = 64, 1, 1
    only = args.only or (LIKE_CONTENDERS if args.like_for_like else CONTENDERS)
    report(measure(tuple(args.world_size), dim=args.dim, layers=args.layers, batch=args.batch, steps=args.steps,
                   contenders=only, model=args.model, onednn_cache=args.onednn_cache == "on"))


if __name__ == "__main__":
    main()

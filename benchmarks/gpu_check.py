"""The checks of `make gpu-check` (.ci/gpu_check.sh builds mixprec with CUDA, runs the CUDA
kernel tests, then this), and their CPU twin, run by tests/test_gpu_check.py in `make test`.

    python benchmarks/gpu_check.py --device cuda --report gpu-check-report.md   # needs a GPU
    python benchmarks/gpu_check.py --device cpu --quick                         # the CPU twin

``--device cuda`` compares the GPU with the CPU; ``--device cpu`` runs the very same
comparisons CPU against CPU (the "device" side with 2 threads, the reference with 1), so
every check, its tolerance and its negative control are exercised without a GPU. Exit
status: 0 all checks passed, 1 a check failed, 2 ``--device cuda`` without a CUDA device.

1. Training (per backend single/ddp/zero1/zero2/zero3/fsdp, precision bf16/fp16, world 1,
   and world 2 where the machine allows): STEPS steps of TinyLM from the same initial
   weights and batches on the device and on the reference (CPU), then the parameters and
   the optimizer state (exp_avg, exp_avg_sq, step) are compared ([Note: training
   tolerance] below). Negative control: the device run repeated with lr=0 must FAIL the
   same comparison; if it passes, the tolerance cannot see a broken optimizer and the case
   fails.
2. Host syncs: after WARMUP steps, each step (forward, backward, clip, step, zero_grad) runs
   under ``torch.cuda.set_sync_debug_mode("error")`` (a real sync raises; a non-blocking
   copy into pinned memory does not) and under mixprec's ScalarReads
   (src/mixprec/diagnostics/syncs.py), which counts the same reads on the CPU too. World 1
   must show none. World 2 on one GPU runs over Gloo, which stages CUDA tensors through
   the host: its syncs are reported, not judged.
3. Kernels: each ``mixprec.kernels`` function against torch's equivalent (bitwise where the
   arithmetic is the same, else the stated tolerance), and timed against torch's foreach
   equivalent (bandwidth in GB/s and the ratio; a report, never pass/fail).
4. Step time: a single-process TinyLM step against ``AdamW(fused=True)`` + GradScaler.

[Note: training tolerance]
Let u be the unit roundoff of the compute dtype (bf16 2^-8, fp16 2^-11). The device and the
reference run the same program but different matmul/reduction kernels, so every
low-precision result may round differently: a gradient element carries a relative
difference of a few u (inputs rounded to the compute dtype, the product rounded back, the
fp32 accumulation in another order): we take 4u. Adam's update m/(sqrt(v)+eps) is
invariant to the gradient's scale, so a relative gradient difference d moves it by at most
about 2d (d through m, d through sqrt(v)): 8u per step. The trajectories then feed their
differences into the next step's gradients, adding up at most linearly over N steps. So
the norm-relative difference of the parameter updates (p_N - p_0), and of exp_avg, is
bounded by TOL = 8 u N, and of exp_avg_sq (a square: twice the relative error) by 2 TOL;
the step counters must be equal. With N = 8: bf16 0.25, fp16 0.031. A broken optimizer is
far outside: lr=0 gives a parameter-update difference of exactly 1 (no update at all), a
doubled lr 1, a skipped step about 1/N = 0.125 (below bf16's bound, so a single skipped step
in bf16 would need the step counters, which are compared exactly). The CPU twin's sides
differ only in thread count, well inside TOL.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

BACKENDS = ("single", "ddp", "zero1", "zero2", "zero3", "fsdp")
PRECISIONS = ("bf16", "fp16")
UNIT_ROUNDOFF = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}
LR = 1e-3
WORLD2_TIMEOUT_S = 300  # one backend's world=2 cases (both precisions, 3 runs each)
ADAM_RTOL = 2.0 ** -17  # check_kernels' fused Adam bound (see there)


def tolerance(precision: str, steps: int) -> float:
    """Norm-relative bound on the parameter-update and exp_avg differences ([Note: training
    tolerance])."""
    return 8 * UNIT_ROUNDOFF[precision] * steps


class Config:
    def __init__(self, device: str, quick: bool) -> None:
        self.device = device
        self.quick = quick
        self.steps = 4 if quick else 8
        self.warmup = 2
        self.dim, self.layers, self.batch = (32, 1, 4) if quick else (128, 2, 8)
        self.backends = BACKENDS
        self.world2 = ("zero3",) if quick else BACKENDS[1:]


# ---- one training run -----------------------------------------------------------------

def make_optimizer(params, lr: float, side: str):
    """The optimizer of every run; ``side`` is "device" or "reference" (tests/test_gpu_check.py
    swaps the device side's for a broken one and expects the check to fail)."""
    return torch.optim.AdamW(params, lr=lr)


SYNC_DEBUG_MODE = "error"


@contextlib.contextmanager
def _sync_watch(device: torch.device, on: bool, found: list):
    """Host syncs on CUDA in the block, appended to ``found``, through torch's sync debug
    mode (c10::cuda::warn_or_error_on_sync: stream/device synchronisation, blocking copies;
    not a non-blocking copy into pinned memory, not an event wait). In "error" mode the
    first sync raises; the step is then finished outside the mode (so the comparison still
    has its run) and the sync recorded. Nothing on the CPU (ScalarReads is its twin)."""
    if not on or device.type != "cuda":
        yield
        return
    torch.cuda.set_sync_debug_mode(SYNC_DEBUG_MODE)
    try:
        yield
    except RuntimeError as error:
        if "synchroniz" not in str(error):
            raise
        frames = [f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}"
                  for f in traceback.extract_tb(error.__traceback__)[-4:]]
        found.append(f"{str(error).splitlines()[0]} (at {' <- '.join(reversed(frames))})")
        raise _SyncFound() from error
    finally:
        torch.cuda.set_sync_debug_mode("default")


class _SyncFound(Exception):
    pass


def train(cfg: Config, device: str, backend: str, precision: str, *, lr: float = LR,
          threads: int | None = None, rank_seed: int = 0, watch_syncs: bool = False,
          side: str = "device") -> dict:
    """``cfg.steps`` TinyLM steps; the initial and final fp32 parameters, the optimizer state
    flattened in the optimizer's own order, the losses, and the host syncs seen."""
    from _common import lm_loss, round_batches, tinylm

    from mixprec import Accelerator
    from mixprec.diagnostics.syncs import ScalarReads

    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    # Accelerator.end_training() destroys the default group, even one it did not create: in
    # the 2-rank harness the next run would then re-create it from the environment while
    # the other rank still uses the old one. Only a run that made its group ends it.
    owns_group = not (torch.distributed.is_available() and torch.distributed.is_initialized())
    acc = Accelerator(mixed_precision=precision, backend=backend, cpu=device == "cpu", log_policy=False)
    try:
        model = tinylm(cfg.dim, cfg.layers)
        init = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
        model, opt = acc.prepare(model, make_optimizer(model.parameters(), lr, side))
        batches = round_batches(1, cfg.steps, cfg.batch, seed=1 + rank_seed)[0]
        losses, reads, sync_errors = [], ScalarReads(), []
        for i, (ids, tgt) in enumerate(batches):
            ids, tgt = ids.to(acc.device), tgt.to(acc.device)
            counted = i >= cfg.warmup
            phase = ["forward"]
            with (reads if counted else contextlib.nullcontext()):
                try:
                    with _sync_watch(acc.device, counted and watch_syncs, sync_errors):
                        loss = lm_loss(model(ids), tgt)
                        phase.append("backward")
                        acc.backward(loss)
                        phase.append("clip")
                        acc.clip_grad_norm_(model.parameters(), 1.0)
                        phase.append("step")
                        opt.step()
                        phase.append("zero_grad")
                        opt.zero_grad()
                except _SyncFound:
                    sync_errors[-1] = f"step {i}, {phase[-1]}: {sync_errors[-1]}"
                    # finish the step outside the mode, from where it stopped; a step cut
                    # inside backward may not finish: then the sync is what the case reports
                    try:
                        if phase[-1] == "forward":
                            loss = lm_loss(model(ids), tgt)
                        if phase[-1] in ("forward", "backward"):
                            acc.backward(loss)
                        if phase[-1] in ("forward", "backward", "clip"):
                            acc.clip_grad_norm_(model.parameters(), 1.0)
                        if phase[-1] != "zero_grad":
                            opt.step()
                        opt.zero_grad()
                    except Exception as error:
                        raise RuntimeError(f"host sync in the step ({sync_errors[-1]}); finishing the "
                                           f"step after it failed: {type(error).__name__}: {error}") from error
            losses.append(loss.detach())
        final = {k: v.detach().float().cpu() for k, v in acc.get_state_dict(model).items()}
        state = _optimizer_state(opt)
        return {"init": init, "final": final, "state": state,
                "losses": [float(x) for x in losses],
                "reads": dict(reads.by_op), "sync_errors": sync_errors}
    finally:
        if owns_group:
            acc.end_training()
        torch.set_num_threads(old_threads)


def _optimizer_state(opt) -> dict:
    raw = getattr(opt, "optimizer", opt)
    out = {"exp_avg": [], "exp_avg_sq": [], "step": []}
    for group in raw.param_groups:
        for p in group["params"]:
            st = raw.state.get(p, {})
            for key in ("exp_avg", "exp_avg_sq"):
                if key in st:
                    out[key].append(st[key].detach().float().flatten().cpu())
            if "step" in st:
                out["step"].append(float(st["step"]))
    return {"exp_avg": torch.cat(out["exp_avg"]) if out["exp_avg"] else torch.zeros(0),
            "exp_avg_sq": torch.cat(out["exp_avg_sq"]) if out["exp_avg_sq"] else torch.zeros(0),
            "step": out["step"]}


# ---- the comparison ---------------------------------------------------------------------

def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (inf when b is zero and a is not)."""
    a, b = a.double(), b.double()
    num, den = torch.linalg.vector_norm(a - b).item(), torch.linalg.vector_norm(b).item()
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def compare(dev: dict, ref: dict, tol: float) -> dict:
    """Per-quantity norm-relative differences of ``dev`` from ``ref`` and whether all are
    within ``tol`` ([Note: training tolerance])."""
    problems = []
    if dev["final"].keys() != ref["final"].keys():
        problems.append(f"parameter names differ: {sorted(set(dev['final']) ^ set(ref['final']))}")
        return {"ok": False, "problems": problems}
    upd_dev = torch.cat([(dev["final"][k] - ref["init"][k]).flatten() for k in sorted(ref["final"])])
    upd_ref = torch.cat([(ref["final"][k] - ref["init"][k]).flatten() for k in sorted(ref["final"])])
    metrics = {"params": _rel(upd_dev, upd_ref)}
    for key, bound in (("exp_avg", tol), ("exp_avg_sq", 2 * tol)):
        d, r = dev["state"][key], ref["state"][key]
        if d.shape != r.shape:
            problems.append(f"{key} has {d.numel()} elements on the device, {r.numel()} on the reference")
            continue
        metrics[key] = _rel(d, r)
    if ref["state"]["exp_avg"].numel() == 0:
        problems.append("the reference run has no Adam state (exp_avg)")
    bounds = {"params": tol, "exp_avg": tol, "exp_avg_sq": 2 * tol}
    for key, value in metrics.items():
        if not value <= bounds[key]:
            problems.append(f"{key} differ by {value:.3g} (norm-relative) > {bounds[key]:.3g}")
    if dev["state"]["step"] != ref["state"]["step"]:
        problems.append(f"step counters differ: {sorted(set(dev['state']['step']))} vs "
                        f"{sorted(set(ref['state']['step']))}")
    return {"ok": not problems, "metrics": metrics, "problems": problems}


def check_case(cfg: Config, backend: str, precision: str, *, rank_seed: int = 0,
               device_threads: int = 2, watch_syncs: bool = True) -> dict:
    """One (backend, precision): device vs reference, and the lr=0 negative control."""
    tol = tolerance(precision, cfg.steps)
    on_cuda = cfg.device == "cuda"
    dev = train(cfg, cfg.device, backend, precision, rank_seed=rank_seed, watch_syncs=watch_syncs,
                threads=None if on_cuda else device_threads)
    ref = train(cfg, "cpu", backend, precision, rank_seed=rank_seed, threads=1, side="reference")
    control = train(cfg, cfg.device, backend, precision, lr=0.0, rank_seed=rank_seed,
                    threads=None if on_cuda else device_threads)
    result = compare(dev, ref, tol)
    ctl = compare(control, ref, tol)
    result["tolerance"] = tol
    result["control"] = {"metrics": ctl.get("metrics", {}), "failed": not ctl["ok"]}
    if ctl["ok"]:
        result["ok"] = False
        result["problems"].append("negative control (lr=0) passed the comparison: the tolerance cannot "
                                  "see a broken optimizer")
    result["reads"] = dev["reads"]
    result["sync_errors"] = dev["sync_errors"]
    result["final_loss"] = (dev["losses"][-1], ref["losses"][-1])
    return result


def _judge_syncs(result: dict, world: int) -> None:
    result["syncs_judged"] = world == 1
    if world == 1 and (result["reads"] or result["sync_errors"]):
        result["ok"] = False
        result["problems"].append(f"host syncs in the step: reads {result['reads']}, "
                                  f"sync-debug errors {result['sync_errors']}")


def _rank_cases(state, cfg_args, backend):
    # The harness's group is Gloo; on CUDA with fewer GPUs than ranks they share a device
    # ([Note: ranks sharing a GPU] in src/mixprec/distributed/state.py).
    # No try/except here: a rank that failed must not go on to the next case's collectives
    # while the other waits in this one; the harness reports the failure and stops both.
    import faulthandler

    faulthandler.dump_traceback_later(cfg_args[2], exit=True)  # a hang shows where it hangs
    cfg = Config(*cfg_args[:2])
    # Gloo stages CUDA tensors through the host (syncs not judged, so not stopped either)
    out = {precision: check_case(cfg, backend, precision, rank_seed=state.rank, device_threads=1,
                                 watch_syncs=False)
           for precision in PRECISIONS}
    faulthandler.cancel_dump_traceback_later()
    return out


def check_training(cfg: Config, log) -> list[dict]:
    rows = []
    for backend in cfg.backends:
        for precision in PRECISIONS:
            name = f"{backend} {precision} world=1"
            try:
                res = check_case(cfg, backend, precision)
                _judge_syncs(res, 1)
            except Exception as error:  # noqa: BLE001 - one case's failure is reported, the rest run
                res = {"ok": False, "problems": [f"{type(error).__name__}: {error}"[:2000]]}
            res["name"] = name
            rows.append(res)
            log(_case_line(res))
    from mixprec.distributed.spawn import run_distributed

    if cfg.world2 and cfg.device == "cuda" and torch.cuda.device_count() < 2:
        log(f"note: world=2 on {torch.cuda.device_count()} GPU: both ranks share cuda:0 over Gloo "
            "([Note: ranks sharing a GPU] in src/mixprec/distributed/state.py)")
    for backend in cfg.world2:
        try:
            per_rank = run_distributed(_rank_cases, 2, args=((cfg.device, cfg.quick, WORLD2_TIMEOUT_S - 30), backend),
                                       timeout=WORLD2_TIMEOUT_S)
        except Exception as error:  # noqa: BLE001
            per_rank = [{p: {"ok": False, "problems": [f"{type(error).__name__}: {str(error)[-1500:]}"]}
                         for p in PRECISIONS}]
        for precision in PRECISIONS:
            res = dict(per_rank[0][precision])
            for other in per_rank[1:]:
                if not other[precision]["ok"]:
                    res["ok"] = False
                    res["problems"] = res.get("problems", []) + [f"rank 1: {p}" for p in other[precision]["problems"]]
            _judge_syncs(res, 2)
            res["name"] = f"{backend} {precision} world=2"
            rows.append(res)
            log(_case_line(res))
    return rows


def _case_line(res: dict) -> str:
    m = res.get("metrics", {})
    c = res.get("control", {}).get("metrics", {})
    text = (f"{'ok  ' if res['ok'] else 'FAIL'} {res['name']}: params {m.get('params', float('nan')):.2e} "
            f"exp_avg {m.get('exp_avg', float('nan')):.2e} exp_avg_sq {m.get('exp_avg_sq', float('nan')):.2e} "
            f"(tol {res.get('tolerance', float('nan')):.3g}); control lr=0 params {c.get('params', float('nan')):.2e}; "
            f"reads {res.get('reads', {})} sync errors {len(res.get('sync_errors', []))}")
    if res.get("problems"):
        text += " -- " + "; ".join(res["problems"])
    return text


# ---- kernels ----------------------------------------------------------------------------

def _tensors(device, dtype, sizes, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g).to(device=device, dtype=dtype) for n in sizes]


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device, reps: int) -> float:
    fn()
    _sync(device)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        _sync(device)
        times.append((time.perf_counter() - t0) / reps)
    return min(times)


def check_kernels(cfg: Config, log) -> list[dict]:
    """Each mixprec kernel against torch on ``cfg.device``: correctness (judged) and time
    against torch's foreach equivalent (reported)."""
    from mixprec import kernels as K

    device = torch.device(cfg.device)
    sizes = [7, 33 * 17, 65537] + ([3 * 400000] if not cfg.quick else [4099])
    big = [1 << 22] * 8 if (device.type == "cuda" and not cfg.quick) else [1 << 14] * 4
    reps = 20 if device.type == "cuda" else 3
    rows = []

    def row(name, ok, detail, mine=None, theirs=None, nbytes=None, versus=""):
        r = {"name": name, "ok": bool(ok), "detail": detail}
        if mine is not None:
            r.update(mixprec_s=mine, torch_s=theirs, versus=versus, ratio=theirs / mine,
                     mixprec_gbs=nbytes / mine / 1e9, torch_gbs=nbytes / theirs / 1e9)
        rows.append(r)
        timing = (f"; {r['mixprec_gbs']:.1f} GB/s vs {versus} {r['torch_gbs']:.1f} GB/s "
                  f"(speed ratio {r['ratio']:.2f})" if mine is not None else "")
        log(f"{'ok  ' if ok else 'FAIL'} kernel {name}: {detail}{timing}")

    def guard(name, fn):
        try:
            fn()
        except Exception as error:  # noqa: BLE001 - reported as this kernel's failure
            row(name, False, f"{type(error).__name__}: {error}"[:1000])

    # unscale_and_check_ vs torch._amp_foreach_non_finite_check_and_unscale_ (bitwise)
    def unscale():
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            a = _tensors(device, dtype, sizes, 0)
            b = [t.clone() for t in a]
            a[-1].view(-1)[5] = float("inf")
            b[-1].view(-1)[5] = float("inf")
            fa, fb = torch.zeros(1, device=device), torch.zeros(1, device=device)
            inv = torch.full((1,), 0.3, device=device)
            K.unscale_and_check_(a, fa, inv)
            torch._amp_foreach_non_finite_check_and_unscale_(b, fb, inv)
            same = all(torch.equal(x[x.isfinite()], y[y.isfinite()]) for x, y in zip(a, b))
            ok = same and fa.item() == fb.item() == 1.0
            if not ok or dtype is not torch.float32:
                if not ok:
                    row(f"unscale_and_check_ {dtype}", False, f"differs from torch (found_inf {fa.item()} vs {fb.item()})")
                    return
                continue
            t = _tensors(device, dtype, big, 1)
            f = torch.zeros(1, device=device)
            nbytes = 2 * sum(x.numel() * x.element_size() for x in t)
            mine = _time(lambda: K.unscale_and_check_(t, f, inv), device, reps)
            theirs = _time(lambda: torch._amp_foreach_non_finite_check_and_unscale_(t, f, inv), device, reps)
            row("unscale_and_check_", True, "bitwise equal to torch._amp_foreach_non_finite_check_and_unscale_ "
                "(fp32, bf16, fp16; inf found)", mine, theirs, nbytes, "torch")
    guard("unscale_and_check_", unscale)

    # l2_norm vs torch._foreach_norm: fp32 sums in another order, relative error <= n u_fp32;
    # we allow 1e-5 (n up to 2^20 per block, tree reductions).
    def norm():
        a = _tensors(device, torch.float32, sizes, 2)
        mine = K.l2_norm(a)
        theirs = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(a)))
        err = abs(mine.item() - theirs.item()) / theirs.item()
        ok = err <= 1e-5
        t = _tensors(device, torch.float32, big, 3)
        nbytes = sum(x.numel() * x.element_size() for x in t)
        tm = _time(lambda: K.l2_norm(t), device, reps)
        tt = _time(lambda: torch.linalg.vector_norm(torch.stack(torch._foreach_norm(t))), device, reps)
        row("l2_norm", ok, f"relative error {err:.2e} vs torch._foreach_norm (bound 1e-5)", tm, tt, nbytes,
            "torch._foreach_norm")
    guard("l2_norm", norm)

    # copy_cast_ vs torch._foreach_copy_ (bitwise: both round to nearest-even)
    def copy_cast():
        src = _tensors(device, torch.float32, sizes, 4)
        a = [torch.empty_like(x, dtype=torch.bfloat16) for x in src]
        b = [torch.empty_like(x, dtype=torch.bfloat16) for x in src]
        K.copy_cast_(a, src)
        torch._foreach_copy_(b, src)
        ok = all(torch.equal(x, y) for x, y in zip(a, b))
        s = _tensors(device, torch.float32, big, 5)
        d = [torch.empty_like(x, dtype=torch.bfloat16) for x in s]
        nbytes = sum(x.numel() * 6 for x in s)
        tm = _time(lambda: K.copy_cast_(d, s), device, reps)
        tt = _time(lambda: torch._foreach_copy_(d, s), device, reps)
        row("copy_cast_ fp32->bf16", ok, "bitwise equal to torch._foreach_copy_" if ok else "differs from torch",
            tm, tt, nbytes, "torch._foreach_copy_")
    guard("copy_cast_", copy_cast)

    # scale_copy_and_check_ vs multiply + isfinite (bitwise: one fp32 multiply)
    def scale_copy():
        src = _tensors(device, torch.float32, sizes, 6)
        src[0][3] = float("nan")
        a = [torch.empty_like(x) for x in src]
        f = torch.zeros(1, device=device)
        scale = torch.full((1,), 0.25, device=device)
        K.scale_copy_and_check_(a, src, f, scale)
        b = torch._foreach_mul(src, scale.reshape(()))  # torch's foreach takes a 0-dim scalar
        ok = all(torch.equal(x[x.isfinite()], y[y.isfinite()]) for x, y in zip(a, b)) and f.item() == 1.0
        row("scale_copy_and_check_", ok, "bitwise equal to torch._foreach_mul, nan found" if ok
            else f"differs from torch._foreach_mul (found_inf {f.item()})")
    guard("scale_copy_and_check_", scale_copy)

    # flat_copy_in_ / flat_copy_out_ vs torch.cat / split (bitwise)
    def flat():
        src = _tensors(device, torch.float32, sizes, 7)
        flat_ = torch.empty(sum(x.numel() for x in src), dtype=torch.bfloat16, device=device)
        K.flat_copy_in_(flat_, src)
        ok_in = torch.equal(flat_, torch.cat([x.flatten() for x in src]).to(torch.bfloat16))
        back = [torch.empty_like(x) for x in src]
        K.flat_copy_out_(back, flat_)
        ok_out = all(torch.equal(x, y) for x, y in
                     zip(back, [t.float().view_as(s) for t, s in zip(flat_.split([x.numel() for x in src]), src)]))
        row("flat_copy_in_/out_", ok_in and ok_out, f"in {'==' if ok_in else '!='} torch.cat, "
            f"out {'==' if ok_out else '!='} split")
    guard("flat_copy", flat)

    # fused_adam_ vs torch.optim.AdamW/Adam(foreach=False): the same formula in fp32 with the
    # roundings in another order (torch divides sqrt(v) by sqrt(bias correction) first). An
    # element's update m/(sqrt(v)+eps) is ill-conditioned where m and v are tiny, so elements
    # are not compared one by one: the norm-relative difference of the parameter change and
    # of m and v must stay within ADAM_RTOL = 2^-17 (64 fp32 ulps over 3 steps); measured on
    # the CPU: about 1e-7. The bf16 copy must equal the fp32 result rounded (bitwise).
    def adam():
        for decoupled in (True, False):
            params = _tensors(device, torch.float32, sizes, 8)
            grads = _tensors(device, torch.float32, sizes, 9)
            ref = [p.clone().requires_grad_(True) for p in params]
            cls = torch.optim.AdamW if decoupled else torch.optim.Adam
            opt = cls(ref, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, foreach=False)
            m = [torch.zeros_like(p) for p in params]
            v = [torch.zeros_like(p) for p in params]
            lowp = [torch.empty_like(p, dtype=torch.bfloat16) for p in params]
            for step in (1, 2, 3):
                for r, g in zip(ref, grads):
                    r.grad = g.clone()
                opt.step()
                K.fused_adam_(params, grads, m, v, lowp, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                              weight_decay=0.1, step=float(step), decoupled=decoupled, maximize=False,
                              inv_scale=None, found_inf=None)
            init = _tensors(device, torch.float32, sizes, 8)
            flat = lambda ts: torch.cat([t.flatten().cpu() for t in ts])  # noqa: E731
            errs = {
                "update": _rel(flat(params) - flat(init), flat([r.detach() for r in ref]) - flat(init)),
                "exp_avg": _rel(flat(m), flat([opt.state[r]["exp_avg"] for r in ref])),
                "exp_avg_sq": _rel(flat(v), flat([opt.state[r]["exp_avg_sq"] for r in ref])),
            }
            lowp_ok = all(torch.equal(lp, p.to(torch.bfloat16)) for lp, p in zip(lowp, params))
            name = "fused_adam_ (AdamW)" if decoupled else "fused_adam_ (Adam)"
            ok = lowp_ok and all(e <= ADAM_RTOL for e in errs.values())
            detail = (", ".join(f"{k} {e:.1e}" for k, e in errs.items()) +
                      f" vs torch.optim.{cls.__name__}, 3 steps (bound {ADAM_RTOL:.1e}); bf16 copy "
                      + ("exact" if lowp_ok else "WRONG"))
            row(name, ok, detail)
            if not ok:
                return
        # time one step against torch's fused AdamW kernel on the same tensors
        p = _tensors(device, torch.float32, big, 10)
        g = _tensors(device, torch.float32, big, 11)
        m = [torch.zeros_like(x) for x in p]
        v = [torch.zeros_like(x) for x in p]
        lp = [torch.empty_like(x, dtype=torch.bfloat16) for x in p]
        steps = [torch.ones((), device=device) for _ in p]
        nbytes = sum(x.numel() * (4 * 7 + 2) for x in p)
        tm = _time(lambda: K.fused_adam_(p, g, m, v, lp, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                                         weight_decay=0.01, step=2.0, decoupled=True, maximize=False,
                                         inv_scale=None, found_inf=None), device, reps)
        try:
            tt = _time(lambda: torch._fused_adamw_(p, g, m, v, [], steps, lr=1e-3, beta1=0.9, beta2=0.999,
                                                   weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False),
                       device, reps)
            row("fused_adam_ timing", True, "step of 8 tensors (+ bf16 copy for mixprec)", tm, tt, nbytes,
                "torch._fused_adamw_")
        except RuntimeError as error:
            row("fused_adam_ timing", True, f"torch's fused AdamW unavailable here ({str(error)[:80]})")
    guard("fused_adam_", adam)

    # fused_sgd_ vs torch.optim.SGD(momentum, nesterov=False, foreach=False): bitwise
    def sgd():
        params = _tensors(device, torch.float32, sizes, 12)
        grads = _tensors(device, torch.float32, sizes, 13)
        ref = [p.clone().requires_grad_(True) for p in params]
        opt = torch.optim.SGD(ref, lr=0.1, momentum=0.9, weight_decay=0.01, foreach=False)
        bufs = [torch.zeros_like(p) for p in params]
        lowp = [torch.empty_like(p, dtype=torch.bfloat16) for p in params]
        for i in range(3):
            for r, g in zip(ref, grads):
                r.grad = g.clone()
            opt.step()
            K.fused_sgd_(params, grads, bufs, lowp, lr=0.1, momentum=0.9, dampening=0.0, nesterov=False,
                         weight_decay=0.01, maximize=False, first_step=i == 0, inv_scale=None, found_inf=None)
        ok = all(torch.allclose(p, r.detach(), rtol=2.0 ** -22, atol=0) for p, r in zip(params, ref))
        row("fused_sgd_", ok, "matches torch.optim.SGD(momentum=0.9) over 3 steps (rtol 2^-22)" if ok
            else "differs from torch.optim.SGD")
    guard("fused_sgd_", sgd)
    return rows


# ---- step time --------------------------------------------------------------------------

def bench_step(cfg: Config, log) -> list[dict]:
    """A single-process TinyLM step: mixprec against AdamW(fused=True) + GradScaler (a report)."""
    from _common import lm_loss, round_batches, tinylm, torch_amp_step

    from mixprec import Accelerator

    dev = torch.device(cfg.device)
    dim, layers, batch, steps, rounds = (32, 1, 4, 3, 2) if cfg.quick else (512, 6, 32, 20, 7)
    rows = []
    for precision in PRECISIONS:
        batches = [(i.to(dev), t.to(dev)) for i, t in round_batches(1, steps, batch, seed=3)[0]]
        ref = tinylm(dim, layers).to(dev)
        try:
            opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-4, fused=True)
        except (RuntimeError, ValueError):
            opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-4)
        torch_step = torch_amp_step(ref, opt_ref, precision, dev.type)
        acc = Accelerator(mixed_precision=precision, cpu=dev.type == "cpu", log_policy=False)
        mine = tinylm(dim, layers)
        model, opt = acc.prepare(mine, torch.optim.AdamW(mine.parameters(), lr=1e-4))

        def ours(ids, tgt):
            acc.backward(lm_loss(model(ids), tgt))
            acc.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()

        times = {"torch": [], "mixprec": []}
        for fn in (torch_step, ours):
            for ids, tgt in batches[:2]:
                fn(ids, tgt)
        for r in range(rounds):
            order = (("torch", torch_step), ("mixprec", ours))
            for name, fn in (order if r % 2 == 0 else order[::-1]):
                _sync(dev)
                t0 = time.perf_counter()
                for ids, tgt in batches:
                    fn(ids, tgt)
                _sync(dev)
                times[name].append((time.perf_counter() - t0) / steps)
        acc.end_training()
        t, m = statistics.median(times["torch"]), statistics.median(times["mixprec"])
        rows.append({"precision": precision, "torch_ms": t * 1e3, "mixprec_ms": m * 1e3, "ratio": m / t,
                     "model": f"TinyLM d={dim} x{layers}, batch {batch}"})
        log(f"step {precision}: TinyLM d={dim} x{layers}, batch {batch}: AdamW(fused=True)"
            f"{' + GradScaler' if precision == 'fp16' else ''} {t * 1e3:.2f} ms, mixprec {m * 1e3:.2f} ms, "
            f"ratio mixprec/torch {m / t:.3f}")
    return rows


# ---- report -----------------------------------------------------------------------------

def write_report(path: Path, cfg: Config, sections: dict, ok: bool, seconds: float) -> None:
    lines = [f"# gpu-check report ({'passed' if ok else 'FAILED'})", ""]
    where = torch.cuda.get_device_name(0) if cfg.device == "cuda" else platform.processor() or "CPU"
    lines += [f"- date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
              f"- device: {cfg.device} ({where}), torch {torch.__version__}, python {platform.python_version()}",
              f"- mode: {'quick' if cfg.quick else 'full'}, {cfg.steps} steps, {seconds:.0f} s",
              "- tolerance: [Note: training tolerance] in benchmarks/gpu_check.py (8 u N; exp_avg_sq 2x)", ""]
    lines += ["## Training: device vs reference (norm-relative differences)", "",
              "| case | ok | params | exp_avg | exp_avg_sq | tol | control lr=0 params | reads | sync errors |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in sections.get("training", []):
        m, c = r.get("metrics", {}), r.get("control", {}).get("metrics", {})
        f = lambda x: "-" if x is None else f"{x:.2e}"  # noqa: E731
        lines.append(f"| {r['name']} | {'yes' if r['ok'] else '**no**'} | {f(m.get('params'))} | "
                     f"{f(m.get('exp_avg'))} | {f(m.get('exp_avg_sq'))} | {f(r.get('tolerance'))} | "
                     f"{f(c.get('params'))} | {r.get('reads', {}) or 0} | {len(r.get('sync_errors', []))}"
                     f"{'' if r.get('syncs_judged', True) else ' (not judged: Gloo)'} |")
    problems = [f"- {r['name']}: {p}" for r in sections.get("training", []) for p in r.get("problems", [])]
    lines += ([""] + problems) if problems else []
    lines += ["", "## Kernels against torch", "", "| kernel | ok | detail | mixprec GB/s | torch GB/s | vs | ratio |",
              "|---|---|---|---|---|---|---|"]
    for r in sections.get("kernels", []):
        g = lambda k: f"{r[k]:.1f}" if k in r else "-"  # noqa: E731
        lines.append(f"| {r['name']} | {'yes' if r['ok'] else '**no**'} | {r['detail']} | {g('mixprec_gbs')} | "
                     f"{g('torch_gbs')} | {r.get('versus', '')} | {r['ratio']:.2f} |" if "ratio" in r else
                     f"| {r['name']} | {'yes' if r['ok'] else '**no**'} | {r['detail']} | - | - | - | - |")
    lines += ["", "## Step time (single)", "", "| precision | model | torch ms | mixprec ms | ratio |", "|---|---|---|---|---|"]
    for r in sections.get("step", []):
        lines.append(f"| {r['precision']} | {r['model']} | {r['torch_ms']:.2f} | {r['mixprec_ms']:.2f} | {r['ratio']:.3f} |")
    lines += ["", "```json", json.dumps(sections, default=str, indent=1)[:200000], "```", ""]
    path.write_text("\n".join(lines))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="small model, 4 steps, world 2 for zero3 only")
    parser.add_argument("--only", choices=("train", "kernels", "step"), action="append",
                        help="run only these sections (repeatable)")
    parser.add_argument("--backends", help="comma-separated subset of " + ",".join(BACKENDS))
    parser.add_argument("--no-world2", action="store_true", help="skip the 2-process cases")
    parser.add_argument("--report", default=None, help="write a markdown report here")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu-check: no CUDA device is visible (torch.cuda.is_available() is False); run it on a "
              "machine with an NVIDIA GPU and a CUDA build of torch, or use --device cpu", file=sys.stderr)
        return 2
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    cfg = Config(args.device, args.quick)
    if args.backends:
        bad = [b for b in args.backends.split(",") if b not in BACKENDS]
        if bad:
            parser.error(f"--backends {bad} unknown; choose from {','.join(BACKENDS)}")
        cfg.backends = tuple(args.backends.split(","))
        cfg.world2 = tuple(b for b in cfg.world2 if b in cfg.backends)
    if args.no_world2:
        cfg.world2 = ()
    only = set(args.only or ("train", "kernels", "step"))
    start = time.monotonic()
    log = lambda line: print(line, flush=True)  # noqa: E731
    sections = {}
    if "train" in only:
        sections["training"] = check_training(cfg, log)
    if "kernels" in only:
        sections["kernels"] = check_kernels(cfg, log)
    if "step" in only:
        sections["step"] = bench_step(cfg, log)
    ok = all(r["ok"] for key in ("training", "kernels") for r in sections.get(key, []))
    seconds = time.monotonic() - start
    print(f"gpu-check ({cfg.device}{', quick' if cfg.quick else ''}): "
          f"{'all checks passed' if ok else 'FAILED (see the FAIL lines)'} in {seconds:.0f} s")
    if args.report:
        path = Path(args.report).resolve()
        write_report(path, cfg, sections, ok, seconds)
        print(f"gpu-check: report written to {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

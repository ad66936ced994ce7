"""What a ZeRO step holds, by category, from the torch profiler's memory timeline (issue 28),
beside the OS probe of benchmarks/bench_memory.py.

Each contender runs in its own spawned N-process Gloo group (as in bench_memory.py: same
model, data, warm-up and ``MALLOC_MMAP_THRESHOLD_``). After the warm-up steps, one step is
run under ``torch.profiler.profile(profile_memory=True, record_shapes=True, with_stack=True)``
and the profiler's memory timeline (``torch.profiler._memory_profiler.MemoryProfileTimeline``,
what ``prof.export_memory_timeline`` plots) is read on rank 0: the bytes the torch allocator
holds over the step, split into the profiler's categories (parameters, optimizer state,
gradients, activations, autograd detail, temporaries, inputs, and "unknown": tensors the
profiler cannot attribute, which is where mixprec's C++ buffers land: fp32 gradient
buckets, gradient shard, fp32 masters, Adam moments, gather sources). The same step's OS
peak (VmHWM over the resident set before the model existed) is printed beside it: the gap
is memory outside the torch allocator (oneDNN's primitive cache, [Note: oneDNN's primitive
cache] in bench_memory.py; glibc; Gloo's own buffers).

The timeline is reported at its peak and, to tell the phases apart, at the peak of each of
forward, backward and optimizer step (``record_function`` ranges; a range's peak is the
largest allocator total between its first and last event).

    python benchmarks/memory_timeline.py                      # zero1 and zero2, TinyLM, N=2
    python benchmarks/memory_timeline.py --only zero1 --world-size 4
    python benchmarks/memory_timeline.py --model mlp --dim 2048 --layers 16
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _memprobe import peak_bytes, reset_peak, rss_bytes  # noqa: E402
from bench_memory import (WARMUP, _build, _import_framework, _model_and_data, ideal_bytes, mixprec_prepare,  # noqa: E402
                          mmap_threshold_env)
from _common import n_params  # noqa: E402

from mixprec.distributed.spawn import run_distributed  # noqa: E402

MIB = 2**20
PHASES = ("forward", "backward", "optimizer step")


def _allocator_curve(prof) -> dict:
    """From the profiler's raw allocator records (``[memory]`` events: time, signed bytes, thread)
    and the step's ``record_function`` ranges: the torch CPU allocator's live bytes over the
    step, relative to what was live when profiling began, its peak inside each phase, and the
    largest allocations of each phase with the innermost operator that made them."""
    # torch 2.13's kineto results sometimes hold an event whose name is not valid UTF-8
    # (``e.name()`` raised UnicodeDecodeError once in a full suite run); such an event is
    # named by its bytes' repr instead: it is neither ``[memory]`` nor a phase.
    named = []
    for e in prof.profiler.kineto_results.events():
        try:
            name = e.name()
        except UnicodeDecodeError as err:
            name = repr(err.object)
        named.append((name, e))
    mem = sorted((e.start_ns(), e.nbytes(), e.start_thread_id()) for name, e in named
                 if name == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    ops = [(name, e) for name, e in named if name != "[memory]" and e.duration_ns() > 0]
    phases = {name: (e.start_ns(), e.end_ns()) for name, e in ops if name in PHASES}

    def maker(t: int, thread: int) -> str:
        inside = [(name, e) for name, e in ops if e.start_thread_id() == thread and e.start_ns() <= t <= e.end_ns()
                  and name not in PHASES]
        return min(inside, key=lambda ne: ne[1].duration_ns())[0] if inside else "(no operator)"

    out, live, peak = {}, 0, 0
    for name, (start, end) in phases.items():
        out[name] = {"start": None, "peak": None, "allocs": []}
    for t, n, thread in mem:
        live += n
        peak = max(peak, live)
        for name, (start, end) in phases.items():
            if start <= t <= end:
                ph = out[name]
                if ph["start"] is None:
                    ph["start"] = live - n
                ph["peak"] = live if ph["peak"] is None else max(ph["peak"], live)
                if n > 0:
                    ph["allocs"].append((n, t, thread))
    for ph in out.values():
        big = sorted(ph.pop("allocs"), reverse=True)[:6]
        ph["largest"] = [(n, maker(t, thread)) for n, t, thread in big]
    return {"peak": peak, "end": live, "phases": out}


def _rank_main(state, name: str, cfg: dict) -> dict:
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    rank, world = dist.get_rank(), dist.get_world_size()
    _import_framework(name)
    make, make_tiny, loss_fn, data, tiny_data = _model_and_data(cfg, rank, WARMUP + 1)
    warm_step, _ = _build(name, make_tiny(), world, cfg["batch"], loss_fn)
    warm_step(*tiny_data[0])
    del warm_step
    gc.collect()
    baseline = rss_bytes()
    model = make()
    P = n_params(model)
    acc, prepared, opt = mixprec_prepare(name, model, loss_fn)
    del model
    for ids, tgt in data[:WARMUP]:
        acc.backward(loss_fn(prepared(ids), tgt))
        opt.step()
        opt.zero_grad()
    ids, tgt = data[WARMUP]
    gc.collect()
    reset_peak()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        with record_function("forward"):
            loss = loss_fn(prepared(ids), tgt)
        with record_function("backward"):
            acc.backward(loss)
            del loss
        with record_function("optimizer step"):
            opt.step()
            opt.zero_grad()
    os_peak = peak_bytes() - baseline
    if rank != 0:
        return {}
    curve = _allocator_curve(prof)
    return {"params": P, "os_peak_growth": os_peak, "ideal": ideal_bytes(int(name[4]), P, world), **curve}


def measure(name: str, world: int, cfg: dict) -> dict:
    with mmap_threshold_env():
        return run_distributed(_rank_main, world, args=(name, cfg), timeout=900)[0]


def report(name: str, world: int, r: dict) -> None:
    print(f"{name}, N={world}, {r['params'] / 1e6:.2f}M params: OS peak growth {r['os_peak_growth'] / MIB:.1f} MiB "
          f"(ideal {r['ideal'] / MIB:.1f}). torch CPU allocator during the step, over what it held before: "
          f"peak +{r['peak'] / MIB:.1f} MiB, end {r['end'] / MIB:+.1f} MiB")
    for phase in PHASES:
        ph = r["phases"].get(phase)
        if not ph or ph["start"] is None:
            continue
        big = ", ".join(f"{n / MIB:.1f} by {op}" for n, op in ph["largest"] if n >= MIB / 4)
        print(f"  {phase:<15} from {ph['start'] / MIB:+7.1f} to a peak of {ph['peak'] / MIB:+7.1f} MiB; "
              f"largest allocations (MiB): {big or '-'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", choices=["zero1", "zero2", "zero3", "zero1_rbf16", "zero2_rbf16"],
                    default=["zero1", "zero2"])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--model", choices=["tinylm", "mlp"], default="tinylm")
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    args = ap.parse_args()
    cfg = dict(dim=args.dim, layers=args.layers, batch=args.batch, steps=1, model=args.model)
    for name in args.only:
        report(name, args.world_size, measure(name, args.world_size, cfg))


if __name__ == "__main__":
    main()

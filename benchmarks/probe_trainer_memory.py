"""Where a training step of GPT-2 small peaks, phase by phase: mixprec zero3 against torch
FSDP2 (``fully_shard`` on every ``GPT2Block`` and the root, ``reshard_after_forward=True``,
``AdamW(fused=True)``), with the calls transformers' Trainer makes (bench_trainer.py's run
without the Trainer): forward with labels, ``backward``, ``clip_grad_norm_(1.0)``,
``optimizer.step()``, ``model.zero_grad()`` (set_to_none).

A thread samples RssAnon every 2 ms and keeps the largest sample per phase; growth is over
RssAnon right before the model is built (heap trimmed), as in bench_trainer.py. Inside
backward, a hook on every block's input gradient marks the block, so the backward peak is
located by block; PROBE_TRACE="s1 bwd" prints every RssAnon change during those phases.

    python -m mixprec launch --nproc-per-node 2 --backend zero3 benchmarks/probe_trainer_memory.py
    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/probe_trainer_memory.py --fsdp2

(ranks: ``OMP_NUM_THREADS=1 MALLOC_MMAP_THRESHOLD_=65536``, as bench_trainer.py sets.)
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import threading
import time

MIB = 1 << 20


def anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon")


class PhaseProbe:
    def __init__(self) -> None:
        self.phase = "init"
        self.peaks: dict[str, int] = {}
        self.order: list[str] = []
        self.trace = os.environ.get("PROBE_TRACE", "\0")  # phases to record sample by sample
        self.series: list[tuple[float, int, str]] = []
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.wait(0.002):
            self.sample()

    def sample(self) -> None:
        a = anon()
        with self.lock:
            if a > self.peaks.get(self.phase, 0):
                self.peaks[self.phase] = a
            if self.phase.startswith(self.trace):
                self.series.append((time.perf_counter(), a, self.phase))

    def set(self, phase: str) -> None:
        self.sample()
        with self.lock:
            self.phase = phase
            if phase not in self.peaks:
                self.order.append(phase)
        self.sample()

    def stop(self) -> None:
        self.done.set()
        self.thread.join()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--fsdp2", action="store_true")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--engine-options", default="{}", help="JSON engine_options for mixprec")
    p.add_argument("--out", default=None)
    p.add_argument("--engine-bytes", action="store_true",
                   help="mixprec: print what the cores hold when the embedding's backward begins (step 1, rank 0)")
    args = p.parse_args()

    import torch
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel

    if args.fsdp2:
        dist.init_process_group("gloo")
    else:
        import mixprec

        acc = mixprec.Accelerator(engine_options=json.loads(args.engine_options))
    rank = dist.get_rank()

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    base = anon()
    probe = PhaseProbe()
    probe.set("build")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config())
    probe.set("prepare")
    if args.fsdp2:
        from torch.distributed.fsdp import fully_shard

        for block in model.transformer.h:
            fully_shard(block, reshard_after_forward=True)
        fully_shard(model, reshard_after_forward=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        model, opt = acc.prepare(model, opt)
    model.train()
    inner = getattr(model, "module", model)
    blocks = inner.transformer.h

    step_no = [0]

    def mark_bwd(i):
        def hook(mod, grad_in, grad_out):
            probe.set(f"s{step_no[0]} bwd<h{i}")  # the block's backward is done: now in blocks below it
        return hook

    for i, b in enumerate(blocks):
        b.register_full_backward_hook(mark_bwd(i))

    def mark_out(name):
        def fwd_hook(mod, inp, out):
            if out.requires_grad:
                out.register_hook(lambda g: probe.set(f"s{step_no[0]} bwd:{name}"))
        return fwd_hook

    def engine_bytes(tag):
        # mixprec only: what the sharding cores hold right now (MiB): gathered parameters,
        # full-size fp32 gradient buckets, gradient shards.
        if args.fsdp2 or not args.engine_bytes or step_no[0] != 1 or rank != 0:
            return
        cores = acc.engine.comm.all_cores()
        held = {k: sum(getattr(c, k)() for c in cores) / MIB
                for k in ("param_buffer_bytes", "grad_bucket_bytes", "grad_shard_bytes")}
        comm = acc.engine.comm
        units = [(u.name, u.core) for u in comm.runners[id(model)].units if hasattr(u.core, "grad_bucket_bytes")]
        buckets = [(n, round(c.grad_bucket_bytes() / MIB, 1)) for n, c in units if c.grad_bucket_bytes()]
        gathered = [(n, round(c.param_buffer_bytes() / MIB, 1)) for n, c in units if c.param_buffer_bytes()]
        print(f"[{tag}] {held} buckets held by {buckets}; gathered {gathered}", flush=True)

    def on_wte_grad(mod, inp, out):
        if out.requires_grad:
            out.register_hook(lambda g: engine_bytes("wte-out-grad"))

    inner.transformer.wte.register_forward_hook(on_wte_grad)
    inner.transformer.wte.register_forward_hook(mark_out("wte-out-grad"))
    inner.lm_head.register_forward_hook(mark_out("logits-grad"))
    inner.transformer.ln_f.register_forward_hook(mark_out("ln_f-out-grad"))

    g = torch.Generator().manual_seed(rank)
    for s in range(args.steps):
        step_no[0] = s
        ids = torch.randint(0, 4700, (args.batch, args.seq), generator=g)
        probe.set(f"s{s} fwd")
        out = model(input_ids=ids, labels=ids)
        loss = out.loss
        del out
        probe.set(f"s{s} bwd(head)")
        if args.fsdp2:
            loss.backward()
        else:
            acc.backward(loss)
        probe.set(f"s{s} clip")
        if args.fsdp2:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        else:
            acc.clip_grad_norm_(model.parameters(), 1.0)
        probe.set(f"s{s} step")
        opt.step()
        probe.set(f"s{s} zero_grad")
        model.zero_grad()
        probe.set(f"s{s} after")
        del loss
    probe.set("end")
    probe.stop()
    rows = [(ph, (probe.peaks[ph] - base) / MIB) for ph in probe.order]
    res = {"rank": rank, "mode": "fsdp2" if args.fsdp2 else "zero3", "base_mib": base / MIB, "rows": rows}
    dist.barrier()
    for r in range(dist.get_world_size()):
        if r == rank:
            print(f"== rank {rank} {res['mode']} base {base / MIB:.0f} MiB; peak growth per phase (MiB)", flush=True)
            for ph, v in rows:
                print(f"  {ph:18s} {v:8.1f}", flush=True)
            print(f"  MAX {max(v for _, v in rows):.1f}", flush=True)
            if probe.series:
                t0 = probe.series[0][0]
                last, lastph = None, None
                for t, a, ph in probe.series:
                    if last is None or abs(a - last) >= MIB or ph != lastph:
                        print(f"    {1e3 * (t - t0):8.1f} ms {(a - base) / MIB:8.1f}  {ph}", flush=True)
                        last, lastph = a, ph
        dist.barrier()
    if args.out:
        with open(f"{args.out}.rank{rank}.json", "w") as f:
            json.dump(res, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

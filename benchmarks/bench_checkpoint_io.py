"""Checkpoint I/O: save (+ fsync), warm load and cold load against torch DCP, Accelerate and dd.

The model of issue #39: ``layers`` x Linear(width, width) (default 12 x 2048: 201 MB of fp32
parameters, 604 MB with AdamW's two moments), one AdamW step taken so the optimizer state
exists, on 2 processes over Gloo. Contenders, all in the same process group, alternating
(A B C .., then .. C B A):

- ``mixprec_zero3``, ``mixprec_fsdp``, ``mixprec_ddp``: ``Accelerator.save_state`` /
  ``load_state`` (bf16 autocast, fp32 masters: the checkpoint holds fp32 parameters and
  AdamW state). Atomic, fsynced, every byte checksummed (docs/checkpointing.md).
- ``torch_dcp``: torch FSDP2 (``fully_shard`` per Linear and on the root) with
  ``torch.distributed.checkpoint``: ``dcp.save``/``dcp.load`` of ``get_state_dict`` and
  ``set_state_dict`` (FileSystemWriter fsyncs its files by default). No checksums.
- ``accelerate_ddp``: Accelerate's ``save_state``/``load_state`` on its DDP (process 0
  writes ``model.safetensors`` and ``optimizer.bin``); timed with an fsync of what it
  wrote, since it does not fsync. No checksums.

Timings (the slowest rank, between two barriers): ``save`` (into a fresh directory, fsync
included), ``load_warm`` (the files in the page cache), ``load_cold`` (the checkpoint's
files dropped from the page cache first with ``posix_fadvise(POSIX_FADV_DONTNEED)``,
which an unprivileged process may do for clean pages of a file it can open). Medians over
rounds. ``dd``: ``dd bs=4M conv=fsync`` of the same number of bytes, and a read back after
the same page-cache drop (GB/s), for the disk's own speed.

[Note: cold loads and free page reporting] A guest kernel that reports free pages to its
hypervisor (``/sys/module/page_reporting``: the development machine, a Firecracker VM) runs
a reporting pass about every 2 s while it has unreported free memory, each pass handing
up to about 200 MB of free pages back to the host. A read whose page cache lands on
handed-back pages pays a host fault per page, seen as system time: one pass between the
drop of a 600 MB file and its cold read took the read from 0.16 s to 0.43-0.78 s
(``passes``/``reported_kib`` in that folder). Which free memory a cold read gets also
depends on how the dropped files were written ([Note: aligned writes] in
src/mixprec/checkpoint/format.py, docs/checkpointing.md "Speed"). Whether a pass falls
inside a contender's cold load is a matter of the round's timing, so ``--cold`` fixes the
machine state every contender's cold load starts from, the same for all:

- ``between-passes`` (default): rank 0 waits for a reporting pass to end (at most 3 s),
  then drops the cache, so the load runs in the ~2 s before the next pass, on memory the
  drop has just freed and no pass has handed back.
- ``settled``: drop the cache, then wait until the kernel has stopped reporting (no pass
  for 2.5 s, at most 15 s): the freed memory is back with the host, as on a machine that
  has been idle before a resume, and every read pays its host faults.
- ``immediate``: drop and load at once (the earlier figures; the phase decides).

Where the folder does not exist (bare metal, most clouds' kernels) the three are the same
and no wait is made.

    python benchmarks/bench_checkpoint_io.py                 # ~4 min on 2 busy cores
    python benchmarks/bench_checkpoint_io.py --quick         # smoke run (small model)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
from mixprec.distributed.spawn import run_distributed  # noqa: E402

CONTENDERS = ("mixprec_zero3", "mixprec_fsdp", "mixprec_ddp", "torch_dcp", "accelerate_ddp")
PEER = "torch_dcp"


def drop_cache(folder: Path) -> None:
    """Evict ``folder``'s files from the page cache (clean pages: they were fsynced)."""
    for p in Path(folder).rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


REPORTING = Path("/sys/module/page_reporting/parameters")
COLD_MODES = ("between-passes", "settled", "immediate")


def _reporting_passes() -> int | None:
    try:
        return int((REPORTING / "passes").read_text())
    except (OSError, ValueError):
        return None


def _wait_for_pass(timeout: float) -> bool:
    """Return when the guest's next free-page-reporting pass has ended (True), or after
    ``timeout`` seconds without one (False) ([Note: cold loads and free page reporting])."""
    start = _reporting_passes()
    if start is None:
        return False
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if _reporting_passes() != start:
            return True
        time.sleep(0.001)
    return False


def cold_drop(folder: Path, mode: str) -> None:
    """Drop ``folder`` from the page cache, leaving the machine in the state ``mode`` names
    ([Note: cold loads and free page reporting])."""
    if mode not in COLD_MODES:
        raise ValueError(f"cold mode {mode!r}; choose from {COLD_MODES}")
    if mode == "between-passes":
        _wait_for_pass(3.0)
    drop_cache(folder)
    if mode == "settled" and _reporting_passes() is not None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 15.0 and _wait_for_pass(2.5):
            pass


def fsync_tree(folder: Path) -> None:
    for p in sorted(Path(folder).rglob("*")):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fd = os.open(folder, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def _model(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def _one_step(model, opt, backward, width: int) -> None:
    x = torch.randn(4, width)
    backward(model(x).float().square().mean())
    opt.step()
    opt.zero_grad()


def _build(name: str, layers: int, width: int, world: int):
    """(save(dir), load(dir)) for one contender, its optimizer state already made."""
    base = _model(layers, width)
    if name.startswith("mixprec_"):
        from mixprec import Accelerator

        backend = name[len("mixprec_"):]
        opts = {"units": ["Linear"]} if backend in ("zero3", "fsdp") else {}
        acc = Accelerator(mixed_precision="bf16", backend=backend, cpu=True, log_policy=False, engine_options=opts)
        model, opt = acc.prepare(base, torch.optim.AdamW(base.parameters(), lr=1e-4))
        _one_step(model, opt, acc.backward, width)
        return (lambda d: acc.save_state(str(d))), (lambda d: acc.load_state(str(d)))
    if name == "torch_dcp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for m in base:
            fully_shard(m, mesh=mesh)
        fully_shard(base, mesh=mesh)
        opt = torch.optim.AdamW(base.parameters(), lr=1e-4)
        _one_step(base, opt, lambda loss: loss.backward(), width)

        def save(d):
            msd, osd = get_state_dict(base, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(d))

        def load(d):
            msd, osd = get_state_dict(base, opt)
            sd = {"model": msd, "optim": osd}
            dcp.load(sd, checkpoint_id=str(d))
            set_state_dict(base, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

        return save, load
    if name == "accelerate_ddp":
        from accelerate import Accelerator as HFAccelerator

        acc = HFAccelerator(cpu=True)
        model, opt = acc.prepare(base, torch.optim.AdamW(base.parameters(), lr=1e-4))
        _one_step(model, opt, acc.backward, width)

        def save(d):
            acc.save_state(str(d))
            if acc.is_main_process:
                fsync_tree(Path(d))

        return save, (lambda d: acc.load_state(str(d)))
    raise ValueError(f"unknown contender {name!r}; choose from {CONTENDERS}")


def _timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _rank_main(state, args: dict):
    rank, world = dist.get_rank(), dist.get_world_size()
    names = args["only"]
    built = {n: _build(n, args["layers"], args["width"], world) for n in names}
    root = Path(args["root"])
    times = {n: {"save": [], "load_warm": [], "load_cold": []} for n in names}
    first = {}
    for r in range(args["rounds"] + 1):  # round 0 warms up (first loads of a process)
        for n in names if r % 2 == 0 else names[::-1]:
            save, load = built[n]
            d = root / f"{n}_{r}"
            t_save = _timed(lambda: save(d))
            t_warm = _timed(lambda: load(d))
            if rank == 0:
                cold_drop(d, args["cold"])
            dist.barrier()
            t_cold = _timed(lambda: load(d))
            dist.barrier()
            if rank == 0:
                shutil.rmtree(d)
            if r > 0:
                times[n]["save"].append(t_save)
                times[n]["load_warm"].append(t_warm)
                times[n]["load_cold"].append(t_cold)
            else:  # the first save and loads of the process, reported apart
                first[n] = {"save": t_save, "load_warm": t_warm, "load_cold": t_cold}
            gc.collect()
    if rank != 0:
        return None
    return {n: {k: statistics.median(v) for k, v in t.items()} | {"samples": t, "first": first[n]}
            for n, t in times.items()}


def dd_figures(root: Path, nbytes: int, cold: str = "between-passes") -> dict:
    """dd's write (conv=fsync) and cold read of ``nbytes`` in ``root`` (GB/s)."""
    f = root / "dd.bin"
    count = max(1, nbytes // (4 << 20))

    def rate(cmd) -> float:
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        return count * (4 << 20) / (time.perf_counter() - t0) / 1e9

    write = rate(["dd", "if=/dev/zero", f"of={f}", "bs=4M", f"count={count}", "conv=fsync"])
    cold_drop(root, cold)
    read = rate(["dd", f"if={f}", "of=/dev/null", "bs=4M"])
    f.unlink()
    return {"write_GBps": write, "read_cold_GBps": read}


def measure(*, layers: int = 12, width: int = 2048, rounds: int = 5, only=CONTENDERS, root=None,
            cold: str = "between-passes") -> dict:
    root = Path(root or tempfile.mkdtemp(prefix="bench_ckpt_io_", dir=os.environ.get("BENCH_CKPT_DIR", "/tmp")))
    root.mkdir(parents=True, exist_ok=True)
    nbytes = 3 * layers * (width * width + width) * 4
    try:
        dd = [dd_figures(root, nbytes, cold) for _ in range(3)]
        args = dict(layers=layers, width=width, rounds=rounds, only=list(only), root=str(root), cold=cold)
        res = run_distributed(_rank_main, 2, args=(args,), timeout=3600)[0]
        dd += [dd_figures(root, nbytes, cold) for _ in range(3)]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"checkpoint_bytes": nbytes, "rounds": rounds, "world": 2, "contenders": res, "cold": cold,
            "page_reporting": _reporting_passes() is not None,
            "dd": {k: statistics.median(d[k] for d in dd) for k in dd[0]}, "dd_samples": dd}


def report(res: dict) -> None:
    gb = res["checkpoint_bytes"] / 1e9
    print(f"checkpoint {res['checkpoint_bytes'] / 1e6:.0f} MB, world {res['world']}, medians of {res['rounds']} "
          f"rounds (contenders alternating); dd: write+fsync {res['dd']['write_GBps']:.2f} GB/s, "
          f"cold read {res['dd']['read_cold_GBps']:.2f} GB/s")
    print(f"cold loads: --cold {res['cold']}" + ("" if res["page_reporting"] else " (no free page reporting here: "
                                                   "the same as immediate)"))
    peer = res["contenders"].get(PEER)
    print(f"{'contender':16s} {'save s':>8s} {'GB/s':>6s} {'warm s':>8s} {'cold s':>8s} {'GB/s':>6s}"
          + ("   ratio to torch_dcp: save warm cold" if peer else ""))
    for n, t in res["contenders"].items():
        line = (f"{n:16s} {t['save']:8.3f} {gb / t['save']:6.2f} {t['load_warm']:8.3f} {t['load_cold']:8.3f} "
                f"{gb / t['load_cold']:6.2f}")
        if peer:
            line += "   " + " ".join(f"{t[k] / peer[k]:5.2f}" for k in ("save", "load_warm", "load_cold"))
        print(line)
    print("first save / warm load / cold load of each process (round 0, not in the medians): "
          + "; ".join(f"{n} {t['first']['save']:.2f}/{t['first']['load_warm']:.2f}/{t['first']['load_cold']:.2f} s"
                      for n, t in res["contenders"].items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 x Linear(512, 512), 2 rounds")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--only", nargs="*", default=list(CONTENDERS), choices=CONTENDERS)
    ap.add_argument("--cold", default="between-passes", choices=COLD_MODES,
                    help="the machine state a cold load starts from ([Note: cold loads and free page reporting])")
    ap.add_argument("--json", type=str, default=None, help="write the results here")
    a = ap.parse_args()
    if a.quick:
        a.layers, a.width, a.rounds = 2, 512, 2
    res = measure(layers=a.layers, width=a.width, rounds=a.rounds, only=a.only, cold=a.cold)
    report(res)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

"""transformers' ``Trainer`` on GPT-2 small, 2 processes over Gloo: the stock Trainer on
Accelerate (DDP, FSDP2) beside mixprec's Trainer (ddp, zero2, zero3): step time and per-rank
peak memory measured by the OS.

Model: ``GPT2LMHeadModel(GPT2Config())`` (GPT-2 small, 124M parameters, tied embeddings),
seeded random init: the Hugging Face Hub is unreachable here, so no pretrained weights (the
step's cost does not depend on the weights' values). ``--size tiny``: n_embd 64, 2 layers,
2 heads, 128 positions (3.3M parameters, for a smoke run of the whole script: 2-3 min here,
mostly the start-up of 10 processes). Tokenizer: GPT-2's byte-level BPE (``GPT2TokenizerFast``) with vocabulary and merges
trained here by the ``tokenizers`` library on the English text of /usr/share/common-licenses
(~240 KB: its BPE runs out of pairs at ~4.7k tokens, so the tokenizer's vocabulary is small
while the model keeps ``vocab_size=50257``: every token id is below it, the embedding and the
LM head keep GPT-2's size). The same text, tokenized and cut into sequences of ``--seq``
(128) tokens with ``labels = input_ids``, is the training set.

Every contender runs through a Trainer, in its own 2 freshly launched processes:

- ``stock-ddp``: ``transformers.Trainer`` on Accelerate's multi-CPU DDP, launched by
  ``python -m torch.distributed.run --standalone --nproc-per-node 2``;
  ``ddp_find_unused_parameters=False`` (the Trainer sets ``find_unused_parameters=True`` for
  any PreTrainedModel otherwise, an extra traversal of the graph every step);
- ``stock-fsdp2``: the same Trainer with ``fsdp=True``, ``fsdp_config={"version": 2,
  "reshard_after_forward": True}`` (transformers 5's form of ``fsdp="full_shard"``; units:
  the Trainer's default transformer-based wrap of ``GPT2Block``). On a CPU world Accelerate's
  state never selects FSDP (it picks MULTI_CPU and drops the plugin, so the Trainer would
  silently run DDP): the contender's Trainer subclass sets the state's distributed type to
  FSDP with the Trainer's plugin right after the Accelerator is built, as the state does on a
  GPU (the same step as benchmarks/bench_pretrained_load.py); Accelerate then takes its own
  FSDP2 path in ``prepare`` (``fully_shard`` on every ``GPT2Block``, the root and whatever
  else its policy picks: the unit count is in the row's notes; DTensor parameters). The row's
  note says whether the fix was needed; the contender fails unless Accelerate reports FSDP2
  and the parameters are DTensors;
- ``mixprec-ddp``, ``mixprec-zero2``, ``mixprec-zero3``: ``mixprec.integrations.transformers.
  Trainer`` launched by ``python -m mixprec launch --nproc-per-node 2 --backend <b>``, the same
  TrainingArguments otherwise (DDP options left to the engine).

Common to all: fp32 (no autocast), ``use_cpu=True``, ``ddp_backend="gloo"``, batch
``--batch`` (2) per rank, the Trainer's default optimizer (``adamw_torch_fused``: torch
``AdamW(fused=True)``; mixprec takes its own fused step for it), lr 1e-4 constant,
``max_grad_norm=1.0``, seed 0, ``--warmup`` (2) + ``--steps`` (4) optimizer steps, loss logged
every step (after the step's timer stops). Ranks run one torch thread each
(``OMP_NUM_THREADS=1``) and start with ``MALLOC_MMAP_THRESHOLD_=65536`` (bench_memory.py's
protocol: freed tensors leave the resident set, the same for every contender).

Measured per rank:

- step time: a ``TrainerCallback`` reads the clock at ``on_step_begin`` and ``on_step_end``
  (forward, backward, clipping, optimizer step, scheduler, zero_grad); per step the slowest
  rank's; the figure is the median over the timed steps (warm-up excluded);
- peak memory: a thread samples ``RssAnon`` (/proc/self/status: anonymous resident pages,
  i.e. tensors and heap, not mapped files) every 5 ms, as tests/_anon_memory.py does. The
  baseline is RssAnon right before the model is built (after the imports; heap trimmed);
  "peak" is the largest sample from then until ``train()`` returns (model build, ``prepare``
  and every step), "steady" the largest during the timed steps; both also absolute. The
  kernel's exact high-water mark ``VmHWM`` (reset at the baseline through
  /proc/self/clear_refs, benchmarks/_memprobe.py) is in the JSON and the table beside it.

Printed: a table per contender (max over ranks), then mixprec-ddp / stock-ddp median step
(target <= 1.0) and mixprec-zero3 / stock-fsdp2 peak growth (target < 1.0), "met"/"missed".
A contender that fails is an error row with the exception its ranks raised, and the work folder
(with the launcher's log) is kept; the others still run.
The machine is shared: step times are noisy (one run, no alternation).

    python benchmarks/bench_trainer.py --size tiny                       # smoke run, 2-3 min (mostly start-up)
    python benchmarks/bench_trainer.py --json /tmp/bench_trainer.json    # GPT-2 124M, ~12 min on 2 shared cores
    python benchmarks/bench_trainer.py --only stock-fsdp2 mixprec-zero3 --steps 6
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _memprobe import reset_peak, status_bytes  # light: no torch, no mixprec

WORLD = 2
LR = 1e-4
TEXT_GLOB = "/usr/share/common-licenses/*"
TOKENIZER_VOCAB = 8192  # asked of the BPE trainer; the text supports fewer (reported)
SIZES = {
    "124m": {},  # GPT2Config() defaults: n_embd 768, 12 layers, 12 heads, 1024 positions, vocab 50257
    "tiny": {"n_embd": 64, "n_layer": 2, "n_head": 2, "n_positions": 128},
}
# name -> (trainer, backend): "stock" = transformers.Trainer on Accelerate, "mixprec" = mixprec's Trainer
CONTENDERS = {
    "stock-ddp": ("stock", "ddp"),
    "stock-fsdp2": ("stock", "fsdp2"),
    "mixprec-ddp": ("mixprec", "ddp"),
    "mixprec-zero2": ("mixprec", "zero2"),
    "mixprec-zero3": ("mixprec", "zero3"),
}
RANK_ENV = {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536", "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "warning"}


# ---------------------------------------------------------------------------- data (driver)

def build_tokenizer_and_data(work: Path) -> dict:
    """Train a byte-level BPE on the local text, wrap it as GPT-2's tokenizer, save it to
    ``work/tokenizer`` and the tokenized text to ``work/tokens.pt``; return the facts."""
    import torch
    from tokenizers import ByteLevelBPETokenizer
    from transformers import GPT2TokenizerFast

    files = sorted({os.path.realpath(p) for p in glob.glob(TEXT_GLOB) if os.path.isfile(p)})
    if not files:
        raise SystemExit(f"no text under {TEXT_GLOB} to train the tokenizer on")
    bpe = ByteLevelBPETokenizer()
    bpe.train(files, vocab_size=TOKENIZER_VOCAB, min_frequency=2, special_tokens=["<|endoftext|>"],
              show_progress=False)
    raw = work / "bpe"
    raw.mkdir(parents=True, exist_ok=True)
    bpe.save_model(str(raw))
    vocab = json.loads((raw / "vocab.json").read_text())
    merges = [tuple(line.split()) for line in (raw / "merges.txt").read_text().splitlines()
              if line.strip() and not line.startswith("#version")]
    tok = GPT2TokenizerFast(vocab=vocab, merges=merges)
    tok.pad_token = tok.eos_token  # GPT-2 has none; the Trainer's padding collator asks for one (no padding here)
    tok.save_pretrained(str(work / "tokenizer"))
    eos = tok.eos_token_id
    ids: list[int] = []
    for f in files:
        ids += tok(Path(f).read_text(errors="replace"))["input_ids"] + [eos]
    torch.save(torch.tensor(ids, dtype=torch.int64), work / "tokens.pt")
    return {"files": len(files), "text_bytes": sum(os.path.getsize(f) for f in files),
            "tokenizer_class": type(tok).__name__, "tokenizer_vocab": len(tok), "tokens": len(ids),
            "max_token_id": max(ids)}


# ---------------------------------------------------------------------------- per rank

class AnonProbe:
    """RssAnon sampled every ``interval_s`` by a thread: the peak since :meth:`restart` and
    the peak since :meth:`start_window` (tests/_anon_memory.py's probe, with a window)."""

    def __init__(self, interval_s: float = 0.005) -> None:
        self._lock = threading.Lock()
        self.base = self.peak = self.window = status_bytes("RssAnon")
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), daemon=True)
        self._thread.start()

    def _run(self, interval_s: float) -> None:
        while not self._done.wait(interval_s):
            self.sample()

    def sample(self) -> None:
        now = status_bytes("RssAnon")
        with self._lock:
            self.peak = max(self.peak, now)
            self.window = max(self.window, now)

    def restart(self) -> int:
        with self._lock:
            self.base = self.peak = self.window = status_bytes("RssAnon")
        return self.base

    def start_window(self) -> None:
        with self._lock:
            self.window = status_bytes("RssAnon")

    def stop(self) -> None:
        self._done.set()
        self._thread.join()
        self.sample()


def _trim_heap() -> None:
    """Give freed heap back to the OS before the baseline (glibc's malloc_trim)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def _stock_fsdp2_trainer():
    """transformers.Trainer that takes Accelerate's FSDP2 path on a CPU world (see the docstring)."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType
    from transformers import Trainer

    class StockFSDP2OnCPU(Trainer):
        forced_fsdp = False

        def _build_accelerator_args(self, **kwargs):
            self._fsdp_plugin = kwargs.get("fsdp_plugin")
            return super()._build_accelerator_args(**kwargs)

        def create_accelerator_and_postprocess(self):
            super().create_accelerator_and_postprocess()
            state = self.accelerator.state
            if state.distributed_type != DistributedType.FSDP:
                assert self._fsdp_plugin is not None, "the Trainer built no FSDP plugin from fsdp_config"
                type(self).chosen = str(state.distributed_type)
                for s in (PartialState(), state):
                    s.distributed_type = DistributedType.FSDP
                state.fsdp_plugin = self._fsdp_plugin
                self.is_fsdp_enabled = True
                type(self).forced_fsdp = True

    return StockFSDP2OnCPU


def worker(args: argparse.Namespace) -> None:
    """One rank of one contender (started by the launcher the driver chose)."""
    import torch
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        GPT2TokenizerFast,
        TrainerCallback,
        TrainingArguments,
    )

    kind, backend = CONTENDERS[args.worker]
    if kind == "mixprec":
        from mixprec.integrations.transformers import Trainer
    elif backend == "fsdp2":
        Trainer = _stock_fsdp2_trainer()
    else:
        from transformers import Trainer

    work = Path(args.work_dir)
    tok = GPT2TokenizerFast.from_pretrained(str(work / "tokenizer"))
    tokens = torch.load(work / "tokens.pt")
    n = len(tokens) // args.seq
    blocks = tokens[: n * args.seq].view(n, args.seq)

    class Blocks(torch.utils.data.Dataset):
        def __len__(self):
            return n

        def __getitem__(self, i):
            return {"input_ids": blocks[i], "labels": blocks[i].clone()}

    extra = {}
    if kind == "stock" and backend == "ddp":
        extra["ddp_find_unused_parameters"] = False
    if backend == "fsdp2":
        extra.update(fsdp=True, fsdp_config={"version": 2, "reshard_after_forward": True})
    targs = TrainingArguments(
        output_dir=str(work / "out" / args.worker), per_device_train_batch_size=args.batch,
        max_steps=args.warmup + args.steps, learning_rate=LR, lr_scheduler_type="constant",
        max_grad_norm=1.0, use_cpu=True, ddp_backend="gloo", report_to="none", save_strategy="no",
        logging_strategy="steps", logging_steps=1, disable_tqdm=True, dataloader_num_workers=0,
        seed=0, data_seed=0, **extra)

    probe_holder = {}
    times: list[float] = []
    losses: list[float] = []

    class Timer(TrainerCallback):
        t0 = 0.0

        def on_step_begin(self, a, state, control, **kw):
            if state.global_step == args.warmup:
                probe_holder["probe"].start_window()
            self.t0 = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            times.append(time.perf_counter() - self.t0)

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    config = GPT2Config(**SIZES[args.size])
    import gc

    gc.collect()
    _trim_heap()
    probe = probe_holder["probe"] = AnonProbe()
    base_anon = probe.restart()
    base_rss = status_bytes("VmRSS")
    reset_peak()  # VmHWM restarts at VmRSS now
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    params = sum(p.numel() for p in model.parameters())
    trainer = Trainer(model=model, args=targs, train_dataset=Blocks(), processing_class=tok, callbacks=[Timer()])
    del model
    start = time.perf_counter()
    out = trainer.train()
    train_s = time.perf_counter() - start
    probe.stop()
    vmhwm = status_bytes("VmHWM")

    acc = trainer.accelerator
    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    first = next(trainer.model_wrapped.parameters())
    note = {"distributed_type": str(getattr(acc, "distributed_type", "")),
            "wrapped": type(trainer.model_wrapped).__name__, "param_type": type(first).__name__,
            "optimizer": f"{type(opt).__module__}.{type(opt).__name__}", "optim_arg": str(targs.optim),
            "fused": getattr(opt, "defaults", {}).get("fused")}
    if kind == "mixprec":
        note["backend"] = acc.backend
        eligible = getattr(acc.engine, "_fused_eligible", None)
        note["mixprec_fused_step"] = bool(eligible(opt)) if eligible else None
        if hasattr(acc.engine, "unit_names"):
            note["units"] = len(acc.engine.unit_names(trainer.model_wrapped))
    if backend == "fsdp2":
        from torch.distributed.fsdp import FSDPModule

        note["units"] = sum(isinstance(m, FSDPModule) for m in trainer.model_wrapped.modules())
        note["forced_fsdp"] = getattr(Trainer, "forced_fsdp", False)
        note["accelerate_chose"] = getattr(Trainer, "chosen", "FSDP")
        note["is_fsdp2"] = bool(getattr(acc, "is_fsdp2", False))
        if not note["is_fsdp2"] or note["param_type"] != "DTensor":
            raise RuntimeError(f"stock-fsdp2 did not run FSDP2: {note}")
    if kind == "stock" and backend == "ddp":
        note["find_unused_parameters"] = getattr(trainer.model_wrapped, "find_unused_parameters", None)
    rank = targs.process_index
    result = {"rank": rank, "world": targs.world_size, "params": params, "step_s": times, "losses": losses,
              "train_loss": out.training_loss, "train_s": train_s, "threads": torch.get_num_threads(),
              "base_anon": base_anon, "peak_anon": probe.peak, "steady_anon": probe.window,
              "base_rss": base_rss, "vmhwm": vmhwm, "note": note}
    (work / "results").mkdir(exist_ok=True)
    (work / "results" / f"{args.worker}.rank{rank}.json").write_text(json.dumps(result))


# ---------------------------------------------------------------------------- driver

def launch_command(name: str, script_args: list[str]) -> list[str]:
    kind, backend = CONTENDERS[name]
    script = [str(Path(__file__).resolve()), "--worker", name, *script_args]
    if kind == "mixprec":
        return [sys.executable, "-m", "mixprec", "launch", "--nproc-per-node", str(WORLD), "--backend", backend,
                *script]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD), *script]


def run_contender(name: str, args: argparse.Namespace, work: Path) -> dict:
    script_args = ["--work-dir", str(work), "--size", args.size, "--seq", str(args.seq), "--batch", str(args.batch),
                   "--warmup", str(args.warmup), "--steps", str(args.steps)]
    cmd = launch_command(name, script_args)
    log = work / "logs" / f"{name}.log"
    log.parent.mkdir(exist_ok=True)
    for f in (work / "results").glob(f"{name}.rank*.json"):
        f.unlink()
    env = {**os.environ, **RANK_ENV}
    start = time.perf_counter()
    with open(log, "w") as fh:
        try:
            rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, timeout=args.timeout,
                                check=False).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.perf_counter() - start
    ranks = [json.loads(p.read_text()) for p in sorted((work / "results").glob(f"{name}.rank*.json"))]
    kind, backend = CONTENDERS[name]
    launcher = f"mixprec launch --backend {backend}" if kind == "mixprec" else "torchrun --standalone"
    if rc != 0 or len(ranks) != WORLD:
        lines = log.read_text(errors="replace").strip().splitlines()
        raised = [ln.strip() for ln in lines if re.search(r"^(\[rank\d+\]: )?[\w.]*(Error|Exception)\b", ln)]
        why = f": {raised[0][:300]}" if raised else ""
        return {"error": f"exit {rc}, {len(ranks)} rank result(s){why}", "log_tail": lines[-15:],
                "log": str(log), "launcher": launcher, "wall_s": wall}
    return {"ranks": ranks, "launcher": launcher, "wall_s": wall, **summarize(ranks, args.warmup)}


def summarize(ranks: list[dict], warmup: int) -> dict:
    """Per step the slowest rank; medians over the timed steps; memory as max over ranks."""
    per_step = [max(r["step_s"][i] for r in ranks) for i in range(min(len(r["step_s"]) for r in ranks))]
    timed = per_step[warmup:]
    return {"step_median_s": statistics.median(timed), "step_min_s": min(timed), "step_max_s": max(timed),
            "step_s": per_step,
            "peak_growth": max(r["peak_anon"] - r["base_anon"] for r in ranks),
            "peak_abs": max(r["peak_anon"] for r in ranks),
            "steady_growth": max(r["steady_anon"] - r["base_anon"] for r in ranks),
            "hwm_growth": max(r["vmhwm"] - r["base_rss"] for r in ranks),
            "base_anon": max(r["base_anon"] for r in ranks),
            "losses": ranks[0]["losses"], "train_loss": ranks[0]["train_loss"], "note": ranks[0]["note"],
            "threads": ranks[0]["threads"], "params": ranks[0]["params"]}


def ratio_line(label: str, num: dict | None, den: dict | None, key: str, target: str, ok) -> dict:
    if not num or not den or "error" in num or "error" in den:
        print(f"  {label}: not available (a contender failed)")
        return {"ratio": None, "verdict": "not measured"}
    r = num[key] / den[key]
    verdict = "met" if ok(r) else "missed"
    print(f"  {label} = {r:.3f}  (target {target}: {verdict})")
    return {"ratio": r, "verdict": verdict}


def report(res: dict) -> None:
    mib = 1 << 20
    m, d = res["machine"], res["data"]
    v = m["versions"]
    print(f"\nmachine: {m['cpu']}, {m['cores']} cores, {m['memory_bytes'] / (1 << 30):.0f} GiB; load average "
          f"{res['load_before'][0]:.2f} before, {res['load_after'][0]:.2f} after; {m['date']}")
    print(f"versions: torch {v['torch']}, transformers {res['versions']['transformers']}, accelerate "
          f"{v['accelerate']}, tokenizers {res['versions']['tokenizers']}, mixprec {v['mixprec']}, python {v['python']}")
    params = next((c["params"] for c in res["contenders"].values() if "params" in c), None)
    size = f"{params / 1e6:.1f}M parameters" if params else "size unknown"
    print(f"model: GPT2LMHeadModel(GPT2Config({', '.join(f'{k}={x}' for k, x in SIZES[res['size']].items())})) "
          f"--size {res['size']}, {size}, vocab_size 50257, RANDOM INIT (seed 0): the Hugging Face Hub is "
          f"unreachable here, so no pretrained weights")
    print(f"tokenizer: {d['tokenizer_class']} (byte-level BPE) trained here with `tokenizers` on {d['files']} files "
          f"of {TEXT_GLOB} ({d['text_bytes'] / 1e3:.0f} KB): {d['tokenizer_vocab']} tokens (the text supports no "
          f"more; GPT-2's 50257 cannot be trained from it), model vocab kept at 50257 (max id {d['max_token_id']}); "
          f"{d['tokens']} tokens of that text = the training set")
    print(f"run: {WORLD} processes x 1 torch thread, Gloo, fp32, batch {res['batch']}x{res['seq']} per rank, "
          f"AdamW lr {LR} constant, max_grad_norm 1.0, {res['warmup']} warm-up + {res['steps']} timed steps; "
          f"MALLOC_MMAP_THRESHOLD_=65536; each contender in its own freshly launched processes")
    print("peers at their best: the Trainer's default optim adamw_torch_fused; stock DDP with "
          "ddp_find_unused_parameters=False (the Trainer turns it on for a PreTrainedModel otherwise)\n")
    print("| contender | launcher | median step s (min-max) | peak RssAnon growth MiB, rank 0 / 1 | steady MiB | "
          "VmHWM growth MiB | peak RssAnon abs MiB | loss first -> last | notes |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, c in res["contenders"].items():
        if "error" in c:
            print(f"| {name} | {c['launcher']} | - | - | - | - | - | - | error: {c['error']} |")
            continue
        n = c["note"]
        notes = [f"backend {n['backend']}" if "backend" in n else n["distributed_type"].rsplit(".", 1)[-1],
                 f"model {n['wrapped']} ({n['param_type']} params)"]
        if "units" in n:
            notes.append(f"{n['units']} sharding unit(s)")
        notes.append(f"torch {n['optimizer'].rsplit('.', 1)[-1]}(fused={n['fused']}) from optim="
                     f"{n['optim_arg'].rsplit('.', 1)[-1].lower()}")
        if n.get("mixprec_fused_step") is not None:
            notes.append(f"mixprec fused C++ step: {n['mixprec_fused_step']}")
        if "find_unused_parameters" in n:
            notes.append(f"find_unused_parameters={n['find_unused_parameters']}")
        if n.get("forced_fsdp"):
            notes.append(f"Accelerate chose {n['accelerate_chose'].rsplit('.', 1)[-1]} on CPU: set to FSDP after "
                         f"the Accelerator was built; is_fsdp2={n['is_fsdp2']}")
        losses = c["losses"]
        loss = f"{losses[0]:.3f} -> {losses[-1]:.3f}" if losses else f"{c['train_loss']:.3f}"
        print(f"| {name} | {c['launcher']} | {c['step_median_s']:.3f} ({c['step_min_s']:.3f}-{c['step_max_s']:.3f}) | "
              f"{' / '.join(str(round((q['peak_anon'] - q['base_anon']) / mib)) for q in c['ranks'])} | "
              f"{c['steady_growth'] / mib:.0f} | {c['hwm_growth'] / mib:.0f} | "
              f"{c['peak_abs'] / mib:.0f} | {loss} | {'; '.join(notes)} |")
    for name, c in res["contenders"].items():
        if "error" in c:
            print(f"\n{name} failed ({c['error']}); its log: {c['log']}")
    print("\nmemory: max over ranks; growth over RssAnon right before the model is built; peak = from the "
          "model's build to the end of train(); steady = the timed steps only")
    r = res["ratios"]
    print("ratios:")
    c = res["contenders"]
    r["ddp_step"] = ratio_line("mixprec-ddp / stock-ddp median step", c.get("mixprec-ddp"), c.get("stock-ddp"),
                               "step_median_s", "<= 1.0", lambda x: x <= 1.0)
    r["zero3_peak"] = ratio_line("mixprec-zero3 / stock-fsdp2 peak RssAnon growth", c.get("mixprec-zero3"),
                                 c.get("stock-fsdp2"), "peak_growth", "< 1.0", lambda x: x < 1.0)
    z3, f2 = c.get("mixprec-zero3"), c.get("stock-fsdp2")
    if r["zero3_peak"]["ratio"] is not None:
        for key in ("peak_abs", "hwm_growth", "steady_growth"):
            r[f"zero3_{key}"] = z3[key] / f2[key]
        print(f"  the same from the other memory figures: peak RssAnon absolute {r['zero3_peak_abs']:.3f}, "
              f"VmHWM growth {r['zero3_hwm_growth']:.3f}, steady RssAnon growth {r['zero3_steady_growth']:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="124m")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank per step")
    parser.add_argument("--warmup", type=int, default=2, help="optimizer steps not timed")
    parser.add_argument("--steps", type=int, default=4, help="timed optimizer steps")
    parser.add_argument("--only", nargs="+", choices=list(CONTENDERS), help="run these contenders only")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per contender")
    parser.add_argument("--work-dir", help="tokenizer, data, logs (default: a temporary folder, removed)")
    parser.add_argument("--json", help="write the results to this file")
    parser.add_argument("--worker", choices=list(CONTENDERS), help=argparse.SUPPRESS)  # a rank (internal)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    import tokenizers
    import transformers
    from _common import load_average, machine_info

    if args.steps < 1:
        parser.error("--steps must be >= 1")
    temp = args.work_dir is None
    work = Path(tempfile.mkdtemp(prefix="bench_trainer_") if temp else args.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    res = None
    try:
        res = {"size": args.size, "seq": args.seq, "batch": args.batch, "warmup": args.warmup, "steps": args.steps,
               "world": WORLD, "lr": LR, "machine": machine_info(), "load_before": load_average(),
               "versions": {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__},
               "data": build_tokenizer_and_data(work), "contenders": {}, "ratios": {}}
        need = (args.warmup + args.steps) * args.batch * WORLD
        if res["data"]["tokens"] // args.seq < need:
            print(f"note: {res['data']['tokens'] // args.seq} sequences < the {need} the run reads: the Trainer "
                  f"starts further epochs", flush=True)
        for name in args.only or list(CONTENDERS):
            print(f"{name} ...", flush=True)
            res["contenders"][name] = run_contender(name, args, work)
            c = res["contenders"][name]
            print(f"{name}: {c.get('error') or 'ok'} ({c['wall_s']:.0f} s)", flush=True)
        res["load_after"] = load_average()
        report(res)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
    finally:
        failed = any("error" in c for c in res["contenders"].values()) if res else True
        if temp and not failed:
            shutil.rmtree(work, ignore_errors=True)
        elif temp:
            print(f"work folder kept (a contender failed): {work}")


if __name__ == "__main__":
    main()

"""Loading a *pretrained* Hugging Face model for sharded training on 2 processes: memory and
time per rank, mixprec beside DeepSpeed ZeRO-3 and Accelerate FSDP2 (issue #47 point 6).

Model: a ``LlamaForCausalLM`` built from config (untied embeddings, seed 0) and saved once with
``save_pretrained`` as fp32 safetensors under ``--model-dir`` (reused when its config matches);
every contender loads these same files, which are read into the page cache before the first
contender starts. ``--size small``: hidden 768, intermediate 2048, 6 layers, 8 heads, vocab
16000 (67M parameters); ``--size large`` (default): hidden 1536, intermediate 4352, 12 layers,
12 heads, vocab 32000 (452M parameters, largest tensor 0.11 of the model).

Contenders, each in its own two freshly spawned processes (mixprec's runner,
``mixprec.distributed.spawn.run_distributed``: Gloo on 127.0.0.1, one torch thread per rank;
the ranks start with ``MALLOC_MMAP_THRESHOLD_=65536`` so freed tensors leave the resident set,
benchmarks/bench_memory.py's protocol):

- ``mixprec-{zero3,fsdp,tp2}-{eager,meta}``: ``mixprec.Accelerator(mixed_precision="bf16",
  cpu=True)`` with ``backend="zero3"`` or ``backend="fsdp"`` (their default units) or
  ``backend="ddp"`` with ``config={"tensor_parallel": {"size": 2}}`` (TP=2,
  docs/tensor_parallel.md); ``eager``:
  ``AutoModelForCausalLM.from_pretrained(path)``, ``torch.optim.AdamW(lr=1e-5)``,
  ``prepare(model, opt)``; ``meta``: the same ``from_pretrained`` inside
  ``accelerator.init_empty_weights()``;
- ``deepspeed-zero3``: ``deepspeed.init_distributed(dist_backend="gloo")`` on DeepSpeed's CPU
  accelerator (``DS_ACCELERATOR=cpu``), ``transformers.integrations.HfDeepSpeedConfig`` made
  before ``from_pretrained`` (so it runs under ``zero.Init``), ``deepspeed.initialize`` with
  bf16 and DeepSpeed's ``DeepSpeedCPUAdam`` (torch ``AdamW(fused=True)`` where its op does not
  build; the row's note says which; the op is built or loaded before the measured window);
- ``accelerate-fsdp2``: ``FullyShardedDataParallelPlugin(fsdp_version=2,
  cpu_ram_efficient_loading=True)``, Accelerate's units (every decoder layer, the embedding,
  the final norm with the head, the root), bf16 parameters, fp32 reduction, torch
  ``AdamW(fused=True)``. Accelerate never picks FSDP for a CPU world (it
  chooses MULTI_CPU, i.e. DDP), so the script sets the state's distributed type to FSDP after
  building the Accelerator, as its state does on a GPU; ``prepare`` then takes Accelerate's
  own FSDP2 path (the model moved to meta, sharded, rank 0's weights broadcast into the
  shards). The note gives the devices of the parameters ``from_pretrained`` returned on each
  rank.

Measured by the OS, per rank (benchmarks/_memprobe.py reads /proc/self/status): a background
thread samples RssAnon (anonymous resident memory: tensors, not the page cache of the
safetensors file) every 5 ms. After the contender's setup (its Accelerator, DeepSpeed's
process group and config) and a barrier, the baseline is RssAnon right before
``from_pretrained``;

- load peak: the largest RssAnon from ``from_pretrained`` until ``prepare``/``initialize``
  returns, minus the baseline, also as a multiple of the model's fp32 size on disk. A
  tensor that ``from_pretrained`` maps from the file (copy-on-write) becomes anonymous memory
  only where it is written; the JSON also has the VmRSS peak (file pages mapped included);
- load time: from the start of ``from_pretrained`` until ``prepare``/``initialize`` returns
  (split into the two in the JSON);
- first step: after a barrier, one forward + backward + optimizer step on a batch of 2
  sequences of 64 tokens (the same on every rank, labels = inputs), its time and its peak
  RssAnon over the same baseline (so with the optimizer state), and its loss (the same weights
  should give about the same loss everywhere).

Targets for 2 ranks, as a multiple of the model's size: a sharded load (``meta``) at most
(1/2 + the largest tensor's share) x 1.1; an ``eager`` load (every rank reads the whole model
before ``prepare`` shards it) at most 1.1. A contender that fails is an error row with its
exception's last line, and the others still run.

    python benchmarks/bench_pretrained_load.py --size small --json /tmp/load_small.json
    python benchmarks/bench_pretrained_load.py --json /tmp/load_large.json   # --size large
    python benchmarks/bench_pretrained_load.py --only deepspeed-zero3 mixprec-zero3-eager
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import deepspeed_optimizer, machine_info, package_version  # noqa: E402
from _memprobe import status_bytes  # noqa: E402

WORLD = 2
LR = 1e-5
BATCH, SEQ = 2, 64
SIZES = {
    "small": {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 6,
              "num_attention_heads": 8, "vocab_size": 16000},
    "large": {"hidden_size": 1536, "intermediate_size": 4352, "num_hidden_layers": 12,
              "num_attention_heads": 12, "vocab_size": 32000},
}
MIXPREC_BACKENDS = {
    "zero3": {"backend": "zero3"},
    "fsdp": {"backend": "fsdp"},
    "tp2": {"backend": "ddp", "config": {"tensor_parallel": {"size": 2}}},
}
# name -> (kind, mixprec backend, mixprec recipe)
CONTENDERS = {f"mixprec-{b}-{recipe}": ("mixprec", b, recipe)
              for b in MIXPREC_BACKENDS for recipe in ("eager", "meta")}
CONTENDERS["deepspeed-zero3"] = ("deepspeed", None, None)
CONTENDERS["accelerate-fsdp2"] = ("accelerate", None, None)
RANK_ENV = {"DS_ACCELERATOR": "cpu", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            "TRANSFORMERS_VERBOSITY": "error"}


# ---------------------------------------------------------------------------- the model

def llama_config(size: str):
    from transformers import LlamaConfig

    s = SIZES[size]
    return LlamaConfig(**s, num_key_value_heads=s["num_attention_heads"], max_position_embeddings=128,
                       tie_word_embeddings=False)


def ensure_model(size: str, model_dir: Path) -> None:
    """Save the seeded model of ``size`` to ``model_dir`` unless it is already there."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    want = llama_config(size)
    if (model_dir / "config.json").exists():
        have = LlamaConfig.from_pretrained(model_dir)
        keys = (*SIZES[size], "num_key_value_heads", "tie_word_embeddings")
        if all(getattr(have, k) == getattr(want, k) for k in keys) \
                and list(model_dir.glob("*.safetensors")):
            return
        raise SystemExit(f"{model_dir} holds another model; delete it or pass another --model-dir")
    torch.manual_seed(0)
    model = LlamaForCausalLM(want)
    partial = model_dir.with_name(model_dir.name + ".partial")
    model.save_pretrained(partial)  # fp32 safetensors
    partial.rename(model_dir)


def model_facts(model_dir: Path) -> dict:
    """Parameter count, size on disk and the largest tensor, read from the safetensors files."""
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    numels = {}
    for f in files:
        with safe_open(str(f), "pt") as s:
            names = s.keys()  # safe_open is not iterable
            numels.update({k: math.prod(s.get_slice(k).get_shape()) for k in names})
    largest = max(numels, key=numels.get)
    params = sum(numels.values())
    return {"params": params, "file_bytes": sum(f.stat().st_size for f in files),
            "largest_tensor": largest, "largest_share": numels[largest] / params}


def read_into_page_cache(model_dir: Path) -> None:
    """Read the weights once, so no contender pays for the disk and all find them cached."""
    for f in model_dir.glob("*.safetensors"):
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass


# ---------------------------------------------------------------------------- per rank

class StatusPeak:
    """The peaks of this process's RssAnon and VmRSS (/proc/self/status), sampled every
    ``interval_s`` by a background thread."""

    FIELDS = ("RssAnon", "VmRSS")

    def __init__(self, interval_s: float = 0.005) -> None:
        self._lock = threading.Lock()
        self._peak = self._read()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), daemon=True)
        self._thread.start()

    def _read(self) -> dict:
        return {k: status_bytes(k) for k in self.FIELDS}

    def _run(self, interval_s: float) -> None:
        while not self._done.wait(interval_s):
            self._sample()

    def _sample(self) -> None:
        now = self._read()
        with self._lock:
            self._peak = {k: max(self._peak[k], now[k]) for k in self.FIELDS}

    def restart(self) -> dict:
        """Restart the peaks at the values now, and return them."""
        now = self._read()
        with self._lock:
            self._peak = now
        return now

    def peak(self) -> dict:
        """The peaks since :meth:`restart` (this call's own reading included)."""
        self._sample()
        with self._lock:
            return dict(self._peak)

    def stop(self) -> None:
        self._done.set()
        self._thread.join()


class Run:
    """One contender on one rank: its setup in ``__init__`` (before the baseline), then
    ``from_pretrained()``, ``prepare(model)``, ``step(ids) -> loss`` and ``close()``."""

    note = ""  # what the table says about the run

    def __init__(self, path: str) -> None:
        self.path = path

    def from_pretrained(self):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(self.path)

    def close(self) -> None:
        """Release what holds the process group before the rank ends."""


class AcceleratorRun(Run):
    """The step of an Accelerate-style ``self.acc`` with a prepared ``self.model`` and ``self.opt``."""

    def step(self, ids) -> float:
        loss = self.model(input_ids=ids, labels=ids).loss
        self.acc.backward(loss)
        self.opt.step()
        self.opt.zero_grad()
        return loss.item()


class MixprecRun(AcceleratorRun):
    def __init__(self, path: str, backend: str, recipe: str) -> None:
        import mixprec

        super().__init__(path)
        self.recipe = recipe
        self.acc = mixprec.Accelerator(mixed_precision="bf16", cpu=True, log_policy=False,
                                       **MIXPREC_BACKENDS[backend])

    def from_pretrained(self):
        if self.recipe == "meta":
            with self.acc.init_empty_weights():
                return super().from_pretrained()
        return super().from_pretrained()

    def prepare(self, model) -> None:
        import torch

        self.model, self.opt = self.acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=LR))

    def close(self) -> None:
        self.acc.end_training()


class DeepSpeedRun(Run):
    def __init__(self, path: str) -> None:
        import deepspeed
        import torch
        from transformers.integrations import HfDeepSpeedConfig

        super().__init__(path)
        deepspeed.init_distributed(dist_backend="gloo")
        self.config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
                       "bf16": {"enabled": True}, "zero_optimization": {"stage": 3},
                       "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
        # transformers holds this by weak reference: from_pretrained runs under zero.Init while it lives.
        self.hf_config = HfDeepSpeedConfig(self.config)
        # Builds (or loads) DeepSpeedCPUAdam's op here, outside the measured window.
        _, self.note = deepspeed_optimizer([torch.zeros(1, requires_grad=True)], LR)

    def prepare(self, model) -> None:
        import deepspeed

        opt, _ = deepspeed_optimizer(model.parameters(), LR)
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=self.config)

    def step(self, ids) -> float:
        loss = self.engine(input_ids=ids, labels=ids).loss
        self.engine.backward(loss)
        self.engine.step()
        return loss.item()


class AccelerateRun(AcceleratorRun):
    def __init__(self, path: str) -> None:
        import torch
        from accelerate import Accelerator, FullyShardedDataParallelPlugin, PartialState
        from accelerate.utils import DistributedType
        from torch.distributed.fsdp import MixedPrecisionPolicy

        super().__init__(path)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, cpu_ram_efficient_loading=True, auto_wrap_policy="transformer_based_wrap",
            reshard_after_forward=True, mixed_precision_policy=policy)
        self.acc = Accelerator(cpu=True, mixed_precision="bf16", fsdp_plugin=plugin)
        for state in (PartialState(), self.acc.state):  # FSDP on a CPU world: see the module docstring
            state.distributed_type = DistributedType.FSDP
        self.acc.state.fsdp_plugin = plugin

    def from_pretrained(self):
        model = super().from_pretrained()
        devices = sorted({p.device.type for p in model.parameters()})
        self.note = f"from_pretrained gave parameters on {'/'.join(devices)}"
        return model

    def prepare(self, model) -> None:
        import torch

        opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
        self.model, self.opt = self.acc.prepare(model, opt)
        assert self.acc.is_fsdp2, "Accelerate did not take its FSDP2 path"


PEERS = {"deepspeed": DeepSpeedRun, "accelerate": AccelerateRun}


def _rank(state, name: str, path: str, vocab: int) -> dict:
    import torch
    import torch.distributed as dist
    from transformers import LlamaForCausalLM  # noqa: F401 - the model's code, before the baseline

    rank = dist.get_rank()
    kind, backend, recipe = CONTENDERS[name]
    run = MixprecRun(path, backend, recipe) if kind == "mixprec" else PEERS[kind](path)
    torch.set_num_threads(1)
    ids = torch.randint(vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    gc.collect()
    dist.barrier()
    probe = StatusPeak()
    base = probe.restart()
    start = time.perf_counter()
    model = run.from_pretrained()
    loaded = time.perf_counter()
    run.prepare(model)
    prepared = time.perf_counter()
    load_peak = probe.peak()
    del model
    dist.barrier()
    probe.restart()
    step_start = time.perf_counter()
    loss = run.step(ids)
    step_s = time.perf_counter() - step_start
    step_peak = probe.peak()
    probe.stop()
    run.close()
    return {"rank": rank, "load_s": prepared - start, "from_pretrained_s": loaded - start,
            "prepare_s": prepared - loaded, "step_s": step_s, "loss": loss,
            "load_peak_bytes": load_peak["RssAnon"] - base["RssAnon"],
            "step_peak_bytes": step_peak["RssAnon"] - base["RssAnon"],
            "load_peak_rss_bytes": load_peak["VmRSS"] - base["VmRSS"], "baseline": base,
            "threads": torch.get_num_threads(), "note": run.note}


# ---------------------------------------------------------------------------- driver

def measure(names: list[str], model_dir: Path, vocab: int, timeout: float) -> dict:
    from mixprec.distributed.spawn import run_distributed

    out = {}
    for name in names:
        kind = CONTENDERS[name][0]
        if package_version(kind) is None:
            out[name] = {"error": f"not installable/runnable: {kind} is not installed "
                                  f"(pip install {kind})"}
            continue
        print(f"{name} ...", flush=True)
        try:
            ranks = run_distributed(_rank, WORLD, args=(name, str(model_dir), vocab), timeout=timeout,
                                    env=RANK_ENV)
            out[name] = {"ranks": ranks}
        except Exception as e:  # noqa: BLE001 - a failing contender is a row, the others still run
            out[name] = {"error": str(e).strip().splitlines()[-1]}
        print(f"{name}: {out[name].get('error', 'ok')}", flush=True)
    return out


def targets(facts: dict) -> dict:
    """The load peak allowed per mixprec recipe, as a multiple of the model's size."""
    return {"meta": (1 / WORLD + facts["largest_share"]) * 1.1, "eager": 1.1}


def report(result: dict) -> None:
    facts, goal, mib = result["model"], result["targets"], 1 << 20
    print(f"\nmodel: LlamaForCausalLM ({result['size']}), {facts['params'] / 1e6:.1f}M parameters, "
          f"{facts['file_bytes'] / mib:.0f} MiB fp32 safetensors, largest tensor "
          f"{facts['largest_tensor']} = {facts['largest_share']:.3f} of the model\n")
    print("| contender | rank | load peak MiB | x model | target | load s | first step s | "
          "step peak MiB | loss | note |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, row in result["contenders"].items():
        kind, _, recipe = CONTENDERS[name]
        if "error" in row:
            print(f"| {name} | - | - | - | - | - | - | - | - | error: {row['error']} |")
            continue
        for r in row["ranks"]:
            ratio = r["load_peak_bytes"] / facts["file_bytes"]
            target = "-"
            if kind == "mixprec":
                limit = goal[recipe]
                target = f"<= {limit:.2f} {'met' if ratio <= limit else 'MISSED'}"
            print(f"| {name} | {r['rank']} | {r['load_peak_bytes'] / mib:.0f} | {ratio:.2f} | {target} | "
                  f"{r['load_s']:.2f} | {r['step_s']:.2f} | {r['step_peak_bytes'] / mib:.0f} | "
                  f"{r['loss']:.4f} | {r['note']} |")
    print(f"\nideal for {WORLD} ranks, x model: sharded load (1/{WORLD} + largest tensor) x 1.1 = "
          f"{goal['meta']:.3f}; eager load (the whole model on every rank) x 1.1 = {goal['eager']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="large")
    parser.add_argument("--model-dir", type=Path,
                        help="where the model is saved (default /tmp/mixprec_bench_model_<size>)")
    parser.add_argument("--only", nargs="+", choices=list(CONTENDERS), help="run these contenders only")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per contender")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()
    model_dir = args.model_dir or Path(f"/tmp/mixprec_bench_model_{args.size}")
    ensure_model(args.size, model_dir)
    facts = model_facts(model_dir)
    read_into_page_cache(model_dir)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by glibc when each rank starts
    rows = measure(args.only or list(CONTENDERS), model_dir, SIZES[args.size]["vocab_size"], args.timeout)
    result = {"size": args.size, "model_dir": str(model_dir), "model": facts, "targets": targets(facts),
              "machine": machine_info(), "contenders": rows}
    report(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

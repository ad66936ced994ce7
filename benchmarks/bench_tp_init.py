"""Memory of building a tensor-parallel model: a rank never holds the whole model when it is
built on the meta device (issue #35 deliver point 7; [Note: materialising a meta model shard
by shard] in src/mixprec/parallel/materialize.py).

Model: a Hugging Face ``LlamaForCausalLM`` built from config (hidden 512, intermediate 1376,
4 layers, 8 heads, 8 KV heads, vocab 8000, untied lm_head: 19.8M parameters, 79 MB in fp32),
split by its own ``tp_plan``. Each contender runs in freshly spawned processes (Gloo), one
torch thread each:

- ``meta tp=1``: one process, ``accelerator.init_empty_weights()``, ``prepare()``
  materialises the whole model;
- ``meta tp=2``: two processes, the same, materialised module by module, each split module
  right before its split;
- ``eager tp=2``: two processes, the model built normally (every rank builds the whole model
  before ``prepare()`` splits it): the way it was before materialisation.

Measured by the OS (benchmarks/_memprobe.py): after the Accelerator and its process group
exist (and a tiny model was prepared once, so lazy buffers are in the baseline), the peak
(VmHWM) and resident (VmRSS) growth from just before the model is built to just after
``prepare()`` returns, max over ranks. Ratio: TP=2's peak growth over TP=1's; target at most
0.55 (the model state halves, plus one whole module in flight). Both glibc settings are
measured: its default (a dynamic mmap threshold) and ``MALLOC_MMAP_THRESHOLD_=65536`` (large
frees go back to the OS at once, benchmarks/bench_memory.py's protocol).

    python benchmarks/bench_tp_init.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = dict(vocab=8000, hidden=512, intermediate=1376, layers=4, heads=8, kv_heads=8)


def _llama(m: dict):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=m["vocab"], hidden_size=m["hidden"], intermediate_size=m["intermediate"],
                      num_hidden_layers=m["layers"], num_attention_heads=m["heads"],
                      num_key_value_heads=m["kv_heads"], max_position_embeddings=64, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def _rank(state, tp: int, meta: bool, m: dict) -> dict:
    import gc

    import torch

    sys.path.insert(0, HERE)
    from _memprobe import peak_bytes, reset_peak, rss_bytes

    from mixprec import Accelerator

    torch.set_num_threads(1)
    cfg = {"tensor_parallel": {"size": tp}} if tp > 1 else {}
    acc = Accelerator(mixed_precision="no", cpu=True, log_policy=False, backend="ddp", config=cfg)
    warm = _llama({**m, "vocab": 64, "hidden": 64, "intermediate": 128, "layers": 1})  # lazy buffers, once
    acc.prepare(warm)
    del warm
    gc.collect()
    torch.manual_seed(0)
    base = rss_bytes()
    reset_peak()
    if meta:
        with acc.init_empty_weights():
            model = _llama(m)
    else:
        model = _llama(m)
    model = acc.prepare(model)
    gc.collect()
    out = {"mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"), "peak": peak_bytes() - base, "resident": rss_bytes() - base,
           "local_params": sum(p.numel() * p.element_size() for p in model.parameters()),
           "meta_left": any(p.is_meta for p in model.parameters())}
    acc.end_training()
    return out


def measure(m: dict, malloc: str) -> dict:
    # glibc reads MALLOC_MMAP_THRESHOLD_ when a process starts: set in this process's
    # environment before the ranks are spawned (they inherit it), put back after.
    saved = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    if malloc == "default":
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    else:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    rows = {}
    try:
        rows = _measure_all(m)
    finally:
        if saved is None:
            os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved
    return rows


def _measure_all(m: dict) -> dict:
    from mixprec.distributed.spawn import run_distributed

    rows = {}
    for name, (tp, meta) in {"meta tp=1": (1, True), "meta tp=2": (2, True), "eager tp=2": (2, False)}.items():
        ranks = run_distributed(_rank, tp, args=(tp, meta, m), timeout=900)
        assert not any(r["meta_left"] for r in ranks), ranks
        rows[name] = {k: max(r[k] for r in ranks) for k in ("peak", "resident", "local_params")}
        rows[name]["mmap_threshold"] = ranks[0]["mmap_threshold"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()
    import transformers  # noqa: F401 - fail early without transformers

    out = {}
    mib = 1 << 20
    for malloc in ("MALLOC_MMAP_THRESHOLD_=65536", "default"):
        rows = measure(MODEL, malloc)
        out[malloc] = rows
        one = rows["meta tp=1"]["peak"]
        print(f"\n### glibc: {malloc}  (MiB growth per rank, max over ranks)\n")
        print("| contender | peak growth | resident growth | parameters held | peak / meta tp=1 |")
        print("|---|---|---|---|---|")
        for name, r in rows.items():
            print(f"| {name} | {r['peak'] / mib:.1f} | {r['resident'] / mib:.1f} | {r['local_params'] / mib:.1f} | "
                  f"{r['peak'] / one:.3f} |")
        ratio = rows["meta tp=2"]["peak"] / one
        print(f"\nmeta tp=2 / meta tp=1 peak: {ratio:.3f} (target <= 0.55: {'met' if ratio <= 0.55 else 'MISSED'})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

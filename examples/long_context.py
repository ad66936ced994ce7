"""Long-context training of a Hugging Face Llama (built from config) with sequence parallelism.

Each rank of a sequence-parallel group holds one slice of every sequence
(``accelerator.prepare_sp_inputs``); attention runs over the whole sequence for a share of
the heads (Ulysses all-to-all around ``scaled_dot_product_attention``); the loss is the exact
whole-sequence loss (docs/sequence_parallel.md). The activations of a step, which grow with
the sequence, are split over the ranks, so a sequence whose step does not fit one process
under a memory cap fits two::

    mixprec launch --nproc-per-node 2 examples/long_context.py            # SP=2: fits the cap
    python examples/long_context.py --sp 1                                 # one process: over the cap
    mixprec launch --nproc-per-node 4 examples/long_context.py --backend zero2   # SP=2 x DP=2

The cap (``--cap-mib``, default 512 MiB) bounds what a training step adds to a rank's
resident set (the OS's peak, /proc/self/status VmHWM, after the model and optimizer are
set up): the activations, logits and gradients of the step. At the default sequence
(8192 tokens, vocabulary 4096) one process measured 688 MiB and each of 2 SP ranks 428 MiB
(the optimizer state, gradient buffers and allocator slack do not split).
A run whose step goes over the cap stops with exit code 3 and says so.

Task: next-token prediction on sequences that count up modulo the vocabulary from a random
start, with the first eighth of every sequence's labels ignored (-100).
"""

from __future__ import annotations

import argparse
import sys

import torch

from common import add_common_arguments, make_accelerator


def make_model(vocab: int, seq: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=seq, tie_word_embeddings=False,
        attn_implementation="sdpa"))


def counting_data(n: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    return (start + torch.arange(length)) % vocab


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise SystemExit(f"no {field} in /proc/self/status: the memory cap needs Linux procfs")


def main() -> None:
    ap = add_common_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]), steps=3)
    ap.add_argument("--sp", type=int, default=None, help="sequence_parallel.size (default 2; 1: off)")
    ap.add_argument("--seq", type=int, default=8192, help="tokens per sequence (default 8192)")
    ap.add_argument("--vocab", type=int, default=4096, help="vocabulary size (default 4096)")
    ap.add_argument("--cap-mib", type=float, default=512.0,
                    help="per-rank cap on what a training step adds to the resident set, MiB (default 512)")
    args = ap.parse_args()
    if args.config is not None and args.sp is not None:
        raise SystemExit("give the SP size in the config file (sequence_parallel.size) or with --sp, not both")
    extra = {} if args.config is not None else {"config": {"sequence_parallel": {"size": args.sp or 2}}}
    accelerator = make_accelerator(args, log_policy=False, **extra)
    torch.manual_seed(args.seed)
    model = make_model(args.vocab, args.seq)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    mesh = accelerator.mesh
    sp = mesh.sp_size if mesh is not None else 1
    dp_rank, dp = (mesh.dp_rank, mesh.dp_size) if mesh is not None else (accelerator.process_index,
                                                                          accelerator.num_processes)
    accelerator.print(f"{accelerator.num_processes} process(es), sequence {args.seq}: "
                      + (mesh.describe() if mesh is not None else "no sequence parallelism"))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # restart the peak mark (VmHWM) at the current resident set
    base = _status("VmRSS")
    losses = []
    for step in range(args.steps):
        ids = counting_data(dp, args.seq, args.vocab, args.seed + step)[dp_rank:dp_rank + 1]
        labels = ids.clone()
        labels[:, :args.seq // 8] = -100
        batch = accelerator.prepare_sp_inputs(input_ids=ids, labels=labels)
        loss = model(**batch).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), "mean").item())  # the whole-sequence loss
    step_mib = (_status("VmHWM") - base) / 2**20
    worst = accelerator.reduce(torch.tensor(step_mib), "max").item()
    accelerator.print(f"final: loss {losses[0]:.4f} -> {losses[-1]:.4f}, backend {accelerator.backend}, "
                      f"{accelerator.num_processes} process(es), {accelerator.mixed_precision}; "
                      f"sequence_parallel.size={sp}; step memory per rank {worst:.0f} MiB (cap {args.cap_mib:.0f} MiB)")
    if worst > args.cap_mib:
        accelerator.print(f"over the cap: a sequence of {args.seq} tokens does not fit {args.cap_mib:.0f} MiB per "
                          f"rank with sequence_parallel.size={sp}; raise --sp")
        accelerator.end_training()
        sys.exit(3)


if __name__ == "__main__":
    main()

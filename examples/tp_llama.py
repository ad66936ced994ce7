"""Tensor-parallel training of a Hugging Face Llama (built from config), split by its own plan.

Every Linear of the attention and MLP blocks, the embedding (vocabulary-parallel) and the
``lm_head`` are split over the TP ranks by the model's ``tp_plan`` (docs/tensor_parallel.md);
the data-parallel engine (any backend; zero3/fsdp shard units over the DP ranks: a 2-D
layout) reduces gradients over the DP ranks only, and the prepared DataLoader gives the ranks
of one TP group the same batches::

    mixprec launch --nproc-per-node 2 examples/tp_llama.py                 # TP=2
    mixprec launch --nproc-per-node 4 examples/tp_llama.py --backend zero2 # TP=2 x DP=2
    mixprec launch --nproc-per-node 4 examples/tp_llama.py --backend fsdp  # 2-D: fsdp x TP
    mixprec launch --nproc-per-node 2 examples/tp_llama.py --tp 1          # plain DP, to compare

Task: next-token prediction on sequences that count up modulo the vocabulary from a random
start, learnable from one token of context. At the end the full weights are written in the
compute dtype with ``save_16bit_model`` and reloaded into a plain model, which must give the
same next-token accuracy.
"""

from __future__ import annotations

import argparse
import os

import torch

from common import add_common_arguments, make_accelerator, progress


def make_model(vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False))


def counting_data(n: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    return (start + torch.arange(length)) % vocab


@torch.no_grad()
def accuracy(model, ids: torch.Tensor) -> float:
    logits = model(input_ids=ids).logits
    return float((logits[:, :-1].argmax(-1) == ids[:, 1:]).float().mean())


def main() -> None:
    ap = add_common_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]), steps=60)
    ap.add_argument("--tp", type=int, default=None, help="tensor_parallel.size (default 2; 1: off)")
    ap.add_argument("--batch", type=int, default=8, help="sequences per data-parallel rank and step")
    args = ap.parse_args()
    if args.config is not None and args.tp is not None:
        raise SystemExit("give the TP size in the config file (tensor_parallel.size) or with --tp, not both")
    extra = {} if args.config is not None else {"config": {"tensor_parallel": {"size": args.tp or 2}}}
    accelerator = make_accelerator(args, log_policy=False, **extra)
    vocab = 32
    torch.manual_seed(args.seed)
    model = make_model(vocab)
    data = torch.utils.data.TensorDataset(counting_data(512, 16, vocab, args.seed))
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch, shuffle=True, drop_last=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    mesh = accelerator.mesh
    accelerator.print(f"{accelerator.num_processes} process(es): "
                      + (mesh.describe() if mesh is not None else "no tensor parallelism"))
    for name, where in list(accelerator.tp_plan.items())[:3]:
        accelerator.print(f"  {name}: {where}")
    step, bar = 0, progress(accelerator, args.steps, "train")
    loss = torch.tensor(float("nan"))
    while step < args.steps:
        for (ids,) in loader:
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            bar.update(1)
            if step == args.steps:
                break
    bar.close()
    test = counting_data(64, 16, vocab, args.seed + 1)
    model.eval()
    acc = accuracy(model, test)
    out_dir = args.output_dir or os.path.join("outputs", "tp_llama")
    accelerator.save_16bit_model(model, out_dir, "model.safetensors")
    if accelerator.is_main_process:
        from safetensors.torch import load_file

        plain = make_model(vocab)
        state = load_file(os.path.join(out_dir, "model.safetensors"))
        plain.load_state_dict({k: v.float() for k, v in state.items()})
        plain.eval()
        reloaded = accuracy(plain, test)
        dtype = str(next(iter(state.values())).dtype).replace("torch.", "")
        print(f"reloaded from {out_dir}/model.safetensors ({dtype}): next-token accuracy {reloaded:.3f}")
    accelerator.print(f"final: loss {loss.item():.4f}, next-token accuracy {acc:.3f}, backend {accelerator.backend}, "
                      f"{accelerator.num_processes} process(es), {accelerator.mixed_precision}; "
                      f"tensor_parallel.size={mesh.tp_size if mesh is not None else 1}")


if __name__ == "__main__":
    main()

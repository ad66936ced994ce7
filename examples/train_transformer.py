"""The main demo: a small transformer learns a generated sequence task with mixprec.

Task: given a sequence of random tokens, predict for every position the token that
comes `shift` places earlier (a copy-with-delay task; attention must learn to look back).
Nothing is downloaded: data is generated on the fly.

    python examples/train_transformer.py --mixed-precision bf16 --steps 200
    mixprec launch --nproc-per-node 2 examples/train_transformer.py --steps 100   # ddp
    mixprec launch --config-file mixprec.yaml --nproc-per-node 2 examples/train_transformer.py

The backend and precision come from the config (``--config``, ``mixprec launch
--config-file``, ``MIXPREC_*`` variables) or ``--mixed-precision``; with none of them the
demo trains in bf16.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch import nn

from mixprec import Accelerator


class TinyLM(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, layers: int, seq: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        block = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids) + self.pos[: ids.shape[1]]
        h = self.blocks(h, mask=self.mask[: ids.shape[1], : ids.shape[1]], is_causal=True)
        return self.head(self.norm(h))


def batches(n_steps: int, batch: int, seq: int, vocab: int, shift: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n_steps):
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        target = torch.roll(ids, shifts=shift, dims=1)
        target[:, :shift] = -100  # nothing to copy yet
        yield ids, target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mixed-precision", default=None, choices=["no", "bf16", "fp16", "bf16-pure"],
                    help="default: from the config, else bf16")
    ap.add_argument("--config", default=None, metavar="PATH", help="mixprec config file")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--accumulate", type=int, default=None, help="gradient accumulation steps (default: config, else 1)")
    ap.add_argument("--cpu", action="store_true")
    args = ap.parse_args()

    torch.manual_seed(0)
    vocab, seq, shift = 32, 24, 3
    kwargs = {}
    if args.config is not None:
        kwargs["config"] = args.config
    configured = args.config or os.environ.get("MIXPREC_CONFIG_FILE") or os.environ.get("MIXPREC_MIXED_PRECISION")
    if args.mixed_precision is not None:
        kwargs["mixed_precision"] = args.mixed_precision
    elif not configured:  # the demo's default; a config decides otherwise (no conflict with it)
        kwargs["mixed_precision"] = "bf16"
    if args.accumulate is not None:
        kwargs["gradient_accumulation_steps"] = args.accumulate
    if args.cpu:
        kwargs["cpu"] = True
    accelerator = Accelerator(**kwargs)  # only what was given: the config decides the rest
    accumulate = accelerator.gradient_accumulation_steps
    model = TinyLM(vocab, dim=64, heads=4, layers=2, seq=seq)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=args.steps)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    loss_fn = nn.CrossEntropyLoss(ignore_index=-100)

    start = time.perf_counter()
    first = last = None
    for step, (ids, target) in enumerate(
        batches(args.steps * accumulate, args.batch, seq, vocab, shift, seed=accelerator.process_index)
    ):
        ids, target = ids.to(accelerator.device), target.to(accelerator.device)
        with accelerator.accumulate(model):
            logits = model(ids)
            loss = loss_fn(logits.reshape(-1, vocab), target.reshape(-1))
            accelerator.backward(loss)
            norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            first = loss.item() if first is None else first
            last = loss.item()
            k = step // accumulate
            if k % 25 == 0 or k == args.steps - 1:
                r = accelerator.last_step
                accelerator.print(
                    f"step {k:4d}  loss {loss.item():.4f}  grad_norm {float(norm):.3f}  "
                    f"stepped {r.stepped} ({r.reason})  scale {r.loss_scale}"
                )
    elapsed = time.perf_counter() - start
    accelerator.print(
        f"done: loss {first:.4f} -> {last:.4f} in {elapsed:.1f}s on {accelerator.device} "
        f"({accelerator.mixed_precision}, backend {accelerator.backend}, {accelerator.num_processes} process(es)); "
        f"skipped steps: {accelerator.skipped_steps}"
    )
    accelerator.end_training()
    if not last < first:
        raise SystemExit("loss did not fall")


if __name__ == "__main__":
    main()

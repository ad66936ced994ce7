"""A small GPT learns, character by character, the Python standard library's own source code.

The text is read from the ``.py`` files of the ``json`` and ``email`` packages of the
running interpreter's standard library (``sysconfig.get_paths()["stdlib"]``): nothing is
downloaded.

    python examples/char_gpt.py --mixed-precision bf16
    mixprec launch --nproc-per-node 2 examples/char_gpt.py --backend zero3 --mixed-precision bf16
"""

from __future__ import annotations

import argparse
import math
import sysconfig
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from common import add_common_arguments, make_accelerator, progress, setup_logging

logger = setup_logging("char_gpt")

PACKAGES = ("json", "email")


def stdlib_text(packages: tuple[str, ...] = PACKAGES) -> str:
    """The concatenated ``.py`` sources of ``packages`` from the standard library."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(f for pkg in packages for f in (root / pkg).glob("*.py"))
    if not files:
        raise FileNotFoundError(
            f"no .py files of {packages} under the standard library at {str(root)!r} (a zipped or "
            f"stripped stdlib?); run with an interpreter that ships its sources"
        )
    return "\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class CharGPT(nn.Module):
    def __init__(self, vocab: int, block_size: int, dim: int = 96, heads: int = 4, layers: int = 3):
        super().__init__()
        self.block_size = block_size
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(block_size, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.tok(ids) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def random_windows(data: torch.Tensor, batch: int, block: int, g: torch.Generator):
    starts = torch.randint(0, len(data) - block - 1, (batch,), generator=g)
    x = torch.stack([data[s : s + block] for s in starts])
    y = torch.stack([data[s + 1 : s + block + 1] for s in starts])
    return x, y


@torch.no_grad()
def generate(model: nn.Module, ids: torch.Tensor, n: int) -> torch.Tensor:
    """Greedy continuation. Every process calls it: sharded backends gather weights in forward."""
    for _ in range(n):
        logits = model(ids[:, -model.block_size :])[:, -1].float()
        ids = torch.cat([ids, logits.argmax(dim=-1, keepdim=True)], dim=1)
    return ids


def main() -> None:
    parser = add_common_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]), steps=500)
    parser.add_argument("--batch", type=int, default=32, help="sequences per process per step")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--sample-chars", type=int, default=60, help="characters generated at the end")
    args = parser.parse_args()

    accelerator = make_accelerator(args)
    text = stdlib_text()
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([index[c] for c in text], dtype=torch.long)
    cut = int(0.9 * len(data))
    train, val = data[:cut], data[cut:]
    logger.info("%d characters of %s sources, vocabulary %d", len(text), "/".join(PACKAGES), len(chars))

    torch.manual_seed(args.seed)  # same initial weights on every rank
    model = CharGPT(len(chars), args.block_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    warmup = max(1, args.steps // 10)

    def lr_factor(step: int) -> float:  # linear warm-up, then cosine decay to 0
        return min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(step, args.steps) / args.steps))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)

    # Each process draws its own windows (a different stream per rank) = data parallelism.
    g = torch.Generator().manual_seed(args.seed * 1000 + accelerator.process_index)
    bar = progress(accelerator, args.steps, "char-gpt")
    for step in range(1, args.steps + 1):
        x, y = (t.to(accelerator.device) for t in random_windows(train, args.batch, args.block_size, g))
        logits = model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, len(chars)), y.reshape(-1))
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if step % 100 == 0:
            logger.info("step %d loss %.4f", step, loss.item())
    bar.close()

    model.eval()
    with torch.no_grad():
        gv = torch.Generator().manual_seed(1234 + accelerator.process_index)
        vx, vy = (t.to(accelerator.device) for t in random_windows(val, 16, args.block_size, gv))
        val_loss = F.cross_entropy(model(vx).float().reshape(-1, len(chars)), vy.reshape(-1))
    val_loss = accelerator.reduce(val_loss, "mean").item()
    prompt = torch.tensor([[index[c] for c in "def "]], device=accelerator.device)
    sample = "".join(chars[i] for i in generate(model, prompt, args.sample_chars)[0].tolist())
    accelerator.print(f"sample: {sample!r}")
    accelerator.print(
        f"final: loss {accelerator.reduce(loss.detach().float(), 'mean').item():.4f} val_loss {val_loss:.4f} "
        f"(uniform would be {math.log(len(chars)):.2f}) after {args.steps} steps; backend {accelerator.backend}, "
        f"{accelerator.num_processes} process(es), {accelerator.mixed_precision}"
    )
    if args.output_dir:
        logger.info("saved state to %s", accelerator.save_state(args.output_dir))
    accelerator.end_training()


if __name__ == "__main__":
    main()

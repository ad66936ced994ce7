"""Models, data and a plain-PyTorch reference loop shared by the tests."""

from __future__ import annotations

import contextlib
import copy
import math

import torch
from torch import nn

AUTOCAST_DTYPE = {"no": None, "bf16": torch.bfloat16, "fp16": torch.float16}

# Accelerators a test made in this process, ended after that test by tests/conftest.py (a
# distributed backend on one process opens a one-process group the next test must not find).
END_AFTER_TEST: list = []


def make_mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 4))


class TinyTransformer(nn.Module):
    """Token ids in, per-sequence regression out (integer inputs must never be cast)."""

    def __init__(self, vocab: int = 50, dim: int = 32, heads: int = 4, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(16, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        assert not ids.is_floating_point(), f"token ids were cast to {ids.dtype}"
        h = self.embed(ids) + self.pos[: ids.shape[1]]
        h = self.encoder(h)
        return self.head(self.norm(h).mean(dim=1))


def make_transformer(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return TinyTransformer()


def mlp_batches(n: int, batch: int = 32, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 16, generator=g), torch.randn(batch, 4, generator=g)) for _ in range(n)]


def transformer_batches(n: int, batch: int = 8, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, 50, (batch, 12), generator=g), torch.randn(batch, 4, generator=g))
        for _ in range(n)
    ]


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out.float(), y)


def fp16_matmuls(dtype):
    """The fp16 matmul arithmetic a prepared model runs under ``cpu_fp16_matmul`` (as set in
    the environment, default ``auto``), for a plain-PyTorch reference to run the same: the
    widened fp32 GEMMs (src/mixprec/wrappers/half_gemm.py) where they are on, else torch's."""
    import os

    from mixprec.wrappers.half_gemm import HalfGemmMode, wanted

    on = dtype == torch.float16 and wanted(os.environ.get("MIXPREC_CPU_FP16_MATMUL", "auto"))
    return HalfGemmMode() if on else contextlib.nullcontext()


def reference_loop(model, optimizer, batches, mixed_precision, clip=None):
    """A hand-written plain-PyTorch loop with torch.autocast and torch.amp.GradScaler."""
    dtype = AUTOCAST_DTYPE[mixed_precision]
    scaler = torch.amp.GradScaler("cpu", enabled=mixed_precision == "fp16")
    losses = []
    for x, y in batches:
        ctx = torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext()
        with ctx, fp16_matmuls(dtype):
            out = model(x)
        loss = loss_fn(out, y)
        scaler.scale(loss).backward()
        if clip is not None:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def mixprec_loop(accelerator, model, optimizer, batches, clip=None):
    losses, results = [], []
    for x, y in batches:
        out = model(x)
        loss = loss_fn(out, y)
        accelerator.backward(loss)
        if clip is not None:
            accelerator.clip_grad_norm_(model.parameters(), clip)
        results.append(optimizer.step())
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, results


def clone(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


class TimestepEmbedding(nn.Module):
    """Diffusion-style: a sinusoidal embedding computed in fp32 inside forward feeds Linear."""

    def __init__(self, dim: int = 32, out: int = 4):
        super().__init__()
        self.dim = dim
        self.lin1 = nn.Linear(dim, 64)
        self.act = nn.SiLU()
        self.lin2 = nn.Linear(64, out)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = self.dim // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device).float() / half)
        args = t.float()[:, None] * freqs[None]
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)  # fp32 on purpose
        return self.lin2(self.act(self.lin1(emb)))

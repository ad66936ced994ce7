"""A diffusion-style denoiser learns to predict the noise added to generated 2-D points.

Data: points from 8 Gaussian blobs on a circle of radius 2, generated on the fly (nothing is
downloaded). The model is a DDPM noise predictor: an MLP of the noisy point and a sinusoidal
embedding of the timestep. At the end, samples are drawn by running the reverse process
from pure noise; their mean radius should approach 2.

    python examples/denoiser.py --mixed-precision bf16
    mixprec launch --nproc-per-node 2 examples/denoiser.py --backend fsdp --mixed-precision bf16

[Note: the timestep embedding runs in float32]
The embedding turns an integer timestep t (up to T-1 = 199) into sin/cos of t * f for
frequencies f up to 1, i.e. phases up to ~200 radians. bf16 keeps 8 significant bits: near
200 neighbouring representable values are 1 apart, so a bf16 phase is off by up to half a
radian and sin/cos of it are off by up to 0.5 (fp16: 0.05) - the model could not tell
nearby timesteps apart. The module is therefore listed in
``keep_fp32_modules``: mixprec runs it with autocast off and hands it fp32 inputs, whatever
the policy, while the MLP around it runs in bf16/fp16 (without it, the matmul that forms
the phases would run in bf16). Timesteps enter the model as integer
tensors, which mixprec never casts at the model boundary.
"""

from __future__ import annotations

import argparse
import math

import torch
from torch import nn
from torch.nn import functional as F

from common import add_common_arguments, make_accelerator, progress, setup_logging

logger = setup_logging("denoiser")

T = 200  # diffusion steps


class SinusoidalTimeEmbedding(nn.Module):
    """Integer timesteps -> [sin(t f_k), cos(t f_k)]; must run in fp32 (see the Note above)."""

    def __init__(self, dim: int):
        super().__init__()
        half = dim // 2
        freqs = torch.exp(-math.log(1000.0) * torch.arange(half, dtype=torch.float32) / half)
        self.register_buffer("freqs", freqs, persistent=False)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        # The phases as an outer product t x f. Written as a matmul, it is one of the ops
        # autocast runs in bf16/fp16 - harmless here only because this module runs in fp32.
        phase = t.float()[:, None] @ self.freqs[None, :]
        return torch.cat([phase.sin(), phase.cos()], dim=-1)


class NoisePredictor(nn.Module):
    def __init__(self, hidden: int = 128, time_dim: int = 32):
        super().__init__()
        self.time = SinusoidalTimeEmbedding(time_dim)
        self.net = nn.Sequential(
            nn.Linear(2 + time_dim, hidden), nn.SiLU(),
            nn.Linear(hidden, hidden), nn.SiLU(),
            nn.Linear(hidden, hidden), nn.SiLU(),
            nn.Linear(hidden, 2),
        )

    def forward(self, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        emb = self.time(t)  # fp32 (keep_fp32_modules); cast to the compute dtype by the Linear
        return self.net(torch.cat([x_t, emb.to(x_t.dtype)], dim=-1))


def bf16_embedding_error(embedding: SinusoidalTimeEmbedding) -> float:
    """Largest |sin/cos| error over all timesteps if the embedding were computed in bf16."""
    t = torch.arange(T, dtype=torch.float32)
    exact = embedding(t)
    phase = (t.bfloat16()[:, None] * embedding.freqs.bfloat16()[None, :]).float()
    return (torch.cat([phase.sin(), phase.cos()], dim=-1) - exact).abs().max().item()


def ring_points(n: int, g: torch.Generator) -> torch.Tensor:
    """``n`` points from 8 Gaussian blobs (std 0.1) centred on a circle of radius 2."""
    k = torch.randint(0, 8, (n,), generator=g).float()
    centres = 2.0 * torch.stack([torch.cos(k * math.pi / 4), torch.sin(k * math.pi / 4)], dim=-1)
    return centres + 0.1 * torch.randn(n, 2, generator=g)


def schedule(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    betas = torch.linspace(1e-4, 0.05, T, device=device)
    return betas, torch.cumprod(1 - betas, dim=0)


@torch.no_grad()
def sample(model: nn.Module, n: int, device: torch.device, g: torch.Generator) -> torch.Tensor:
    """DDPM reverse process from pure noise. Every process calls it (sharded weights)."""
    betas, alpha_bar = schedule(device)
    x = torch.randn(n, 2, generator=g).to(device)
    for step in reversed(range(T)):
        t = torch.full((n,), step, dtype=torch.long, device=device)
        eps = model(x, t).float()
        alpha = 1 - betas[step]
        x = (x - betas[step] / (1 - alpha_bar[step]).sqrt() * eps) / alpha.sqrt()
        if step > 0:
            x = x + betas[step].sqrt() * torch.randn(n, 2, generator=g).to(device)
    return x


def main() -> None:
    parser = add_common_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]), steps=1500)
    parser.add_argument("--batch", type=int, default=256, help="points per process per step")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--samples", type=int, default=512, help="points sampled at the end")
    args = parser.parse_args()

    # The one line that keeps the timestep embedding in fp32 under any policy.
    accelerator = make_accelerator(args, keep_fp32_modules=("SinusoidalTimeEmbedding",))
    torch.manual_seed(args.seed)
    model = NoisePredictor()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps, eta_min=args.lr / 10)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    _, alpha_bar = schedule(accelerator.device)

    logger.info("the timestep embedding computed in bf16 would be off by up to %.2f (in fp32: exact); "
                "it runs in fp32", bf16_embedding_error(model.time))

    g = torch.Generator().manual_seed(args.seed * 1000 + accelerator.process_index)
    bar = progress(accelerator, args.steps, "denoiser")
    for step in range(1, args.steps + 1):
        x0 = ring_points(args.batch, g).to(accelerator.device)
        t = torch.randint(0, T, (args.batch,), generator=g).to(accelerator.device)
        noise = torch.randn(args.batch, 2, generator=g).to(accelerator.device)
        a = alpha_bar[t][:, None]
        x_t = a.sqrt() * x0 + (1 - a).sqrt() * noise
        loss = F.mse_loss(model(x_t, t).float(), noise)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if step % 250 == 0:
            logger.info("step %d loss %.4f", step, loss.item())
    bar.close()

    model.eval()
    points = sample(model, args.samples, accelerator.device, torch.Generator().manual_seed(7))
    radius = points.norm(dim=-1)
    accelerator.print(
        f"final: loss {accelerator.reduce(loss.detach().float(), 'mean').item():.4f} sample radius "
        f"{radius.mean().item():.3f} +- {radius.std().item():.3f} (data: 2.0 +- ~0.1) after {args.steps} steps; "
        f"backend {accelerator.backend}, {accelerator.num_processes} process(es), {accelerator.mixed_precision}"
    )
    if args.output_dir:
        logger.info("saved state to %s", accelerator.save_state(args.output_dir))
    accelerator.end_training()


if __name__ == "__main__":
    main()

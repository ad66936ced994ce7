"""An exponential moving average (EMA) of the weights, updated every step, on any backend.

On zero3/fsdp each rank holds only a shard of every parameter between steps, so the EMA
reads them inside ``accelerator.gathered_parameters(model)``: the units are gathered on
entry and freed on exit (a collective: every rank runs the update). The EMA model itself
is a plain full copy made inside the same context, so evaluating it needs no collective::

    python examples/ema.py                                                   # one process
    mixprec launch --nproc-per-node 2 examples/ema.py --backend zero3
    mixprec launch --nproc-per-node 2 examples/ema.py --backend fsdp --mixed-precision bf16
    mixprec launch --nproc-per-node 2 examples/ema.py --backend ddp

Task: regress a fixed random two-layer map from noisy samples; the EMA's evaluation loss
ends below the raw model's (it averages out the noise of the last steps).
"""

from __future__ import annotations

import argparse
import copy

import torch
from torch import nn

from common import add_common_arguments, make_accelerator


def make_model(dim: int) -> nn.Module:
    return nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, 4 * dim), nn.GELU(),
                         nn.Linear(4 * dim, dim))


@torch.no_grad()
def update_ema(accelerator, ema: nn.Module, model: nn.Module, decay: float) -> None:
    """ema = decay * ema + (1 - decay) * model, with the model's full values gathered."""
    with accelerator.gathered_parameters(model):
        for e, p in zip(ema.parameters(), model.parameters()):
            e.lerp_(p.to(e.dtype), 1.0 - decay)


@torch.no_grad()
def evaluate(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    return nn.functional.mse_loss(net(x).float(), y).item()


def main() -> None:
    ap = add_common_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]), steps=200)
    ap.add_argument("--decay", type=float, default=0.95, help="EMA decay per step (default 0.95)")
    args = ap.parse_args()
    # Small units so that zero3/fsdp really shard: every Linear is gathered on its own.
    options = {"units": ["Linear"]} if args.backend in ("zero3", "fsdp") else None
    accelerator = make_accelerator(args, log_policy=False, engine_options=options)
    torch.manual_seed(args.seed)
    dim = 16
    model = make_model(dim)
    target = make_model(dim)  # the map to learn (same architecture, other weights)
    for p in target.parameters():
        p.requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    device = accelerator.device
    target.to(device)
    # The EMA starts as a full copy of the prepared model: a deep copy taken inside the
    # context holds plain parameters with the full values (and runs under the same policy).
    with accelerator.gathered_parameters(model):
        ema = copy.deepcopy(model)
    for p in ema.parameters():
        p.requires_grad_(False)
    g = torch.Generator().manual_seed(1000 + accelerator.process_index)
    xe = torch.randn(512, dim, generator=torch.Generator().manual_seed(1)).to(device)
    ye = target(xe)
    for step in range(args.steps):
        x = torch.randn(64, dim, generator=g).to(device)
        y = target(x) + 0.3 * torch.randn(64, dim, generator=g).to(device)  # noisy labels
        loss = nn.functional.mse_loss(model(x).float(), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        update_ema(accelerator, ema, model, args.decay)
        if step % 50 == 0 or step == args.steps - 1:
            accelerator.print(f"step {step:3d}  loss {accelerator.reduce(loss.detach(), 'mean').item():.4f}")
    ema_loss = evaluate(ema, xe, ye)  # the EMA is a plain module: no collective
    model_loss = evaluate(model, xe, ye)  # the prepared model: every rank runs it (zero3 gathers)
    accelerator.print(
        f"final: eval loss {model_loss:.4f}, EMA eval loss {ema_loss:.4f} (decay {args.decay}; "
        f"{accelerator.mixed_precision}, backend {accelerator.backend}, "
        f"{accelerator.num_processes} process(es))")
    accelerator.end_training()


if __name__ == "__main__":
    main()

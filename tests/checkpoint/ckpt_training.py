"""A small training run with everything a checkpoint must carry (shared by the checkpoint tests).

``train`` runs on whatever backend the process is in (single, or ddp under the harness):
shuffled prepared dataloader, dropout (torch RNG), AdamW, StepLR, a registered counter;
it can save after ``save_at`` steps and/or start from ``load_dir``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from mixprec import Accelerator
from mixprec.checkpoint import ProjectConfiguration, make_resumable


class Counter:
    """A user object registered for checkpointing."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, sd: dict) -> None:
        self.n = sd["n"]


def make_model(dropout: float = 0.1, renamed: bool = False) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(dropout), nn.LayerNorm(32), nn.Linear(32, 4))
    if renamed:
        model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(dropout), nn.LayerNorm(32), nn.Identity(), nn.Linear(32, 4))
    return model


def dataset(n: int = 48) -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(n, 16, generator=g), torch.randn(n, 4, generator=g))


def setup(mixed_precision="no", *, shuffle=True, dropout=0.1, batch=8, split_batches=False, project_dir=None,
          total_limit=None, backend="auto"):
    torch.manual_seed(0)
    config = None
    if project_dir is not None:
        config = ProjectConfiguration(project_dir=str(project_dir), automatic_checkpoint_naming=True,
                                      total_limit=total_limit, collective_timeout_s=30)
    acc = Accelerator(mixed_precision=mixed_precision, cpu=True, log_policy=False, backend=backend,
                      split_batches=split_batches, project_config=config)
    model = make_model(dropout)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    loader = DataLoader(dataset(), batch_size=batch, shuffle=shuffle)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    make_resumable(loader)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    return acc, model, opt, loader, sched, counter


def train(mixed_precision="no", steps=10, save_at=None, save_dir=None, load_dir=None, **kw):
    """Losses of steps ``[start, steps)`` and the final full-precision state dict (CPU)."""
    acc, model, opt, loader, sched, counter = setup(mixed_precision, **kw)
    step = 0
    if load_dir is not None:
        acc.load_state(load_dir)
        step = counter.n
    losses = []
    while step < steps:
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x).float(), y)
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            losses.append(loss.item())
            step += 1
            counter.n = step
            if step == save_at:
                acc.save_state(save_dir)
            if step >= steps:
                break
    state = {k: v.detach().clone() for k, v in acc.get_state_dict(model).items()}
    return losses, state, acc.loss_scale

"""A small CNN classifies scikit-learn's bundled 8x8 handwritten digits with mixprec.

Nothing is downloaded: ``sklearn.datasets.load_digits`` ships inside scikit-learn.

    python examples/digits_cnn.py --mixed-precision bf16
    mixprec launch --nproc-per-node 2 examples/digits_cnn.py --backend zero2 --mixed-precision bf16
    mixprec launch --nproc-per-node 2 examples/digits_cnn.py --config my_fsdp.yaml --output-dir ckpt
"""

from __future__ import annotations

import argparse

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from common import add_common_arguments, make_accelerator, setup_logging

logger = setup_logging("digits_cnn")


class DigitsCNN(nn.Module):
    def __init__(self, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),                                   # 8x8 -> 4x4
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def digits_datasets(seed: int) -> tuple[TensorDataset, TensorDataset]:
    """Train/test split (80/20, fixed by ``seed``); pixels scaled to [0, 1]."""
    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(y))
    train, test = order[:cut], order[cut:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


def main() -> None:
    parser = add_common_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]), steps=300)
    parser.add_argument("--batch", type=int, default=64, help="batch size per process")
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    accelerator = make_accelerator(args)
    torch.manual_seed(args.seed)  # same initial weights on every rank
    train_set, test_set = digits_datasets(args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch, shuffle=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=256)
    model = DigitsCNN()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    model, optimizer, train_loader, test_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, test_loader, scheduler
    )
    logger.info("training on %d process(es), backend %s, %s", accelerator.num_processes,
                accelerator.backend, accelerator.mixed_precision)

    loss_fn = nn.CrossEntropyLoss()
    loss = torch.tensor(float("nan"))

    def batches():  # as many passes over the data as args.steps needs
        while True:
            yield from train_loader

    # accelerator.progress: samples/s over all processes, ETA, loss and skipped steps on
    # the main process, without reading the loss on the host every step (loss.item() would).
    for step, (x, y) in enumerate(accelerator.progress(batches(), total=args.steps, desc="digits"), 1):
        loss = loss_fn(model(x).float(), y)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        if step % 50 == 0:
            logger.info("step %d loss %.4f", step, loss.item())
        if step == args.steps:
            break

    # Accuracy over the whole test set: each process scores its share, gather_for_metrics
    # drops the samples duplicated to even out the shares.
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for x, y in test_loader:
            pred = model(x).argmax(dim=-1)
            pred, y = accelerator.gather_for_metrics((pred, y))
            correct += (pred == y).sum().item()
            total += y.numel()
    final_loss = accelerator.reduce(loss.detach().float(), "mean").item()
    accelerator.print(
        f"final: loss {final_loss:.4f} accuracy {correct / total:.4f} ({total} test digits) after "
        f"{step} steps; backend {accelerator.backend}, {accelerator.num_processes} process(es), "
        f"{accelerator.mixed_precision}; skipped steps {accelerator.skipped_steps}"
    )
    if args.output_dir:
        logger.info("saved state to %s", accelerator.save_state(args.output_dir))
    accelerator.end_training()


if __name__ == "__main__":
    main()

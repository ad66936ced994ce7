"""Accelerate's quick tour as one script, run under Accelerate or mixprec (the only difference
is the import), used by tests/distributed/test_accelerate_compat.py::test_quick_tour_matches_accelerate.

    QUICKTOUR_LIB={accelerate|mixprec} QUICKTOUR_OUT=dir QUICKTOUR_PRECISION=bf16 <launcher> quicktour_script.py

Covers prepare, accumulate, clip_grad_norm_, a shuffled loader with a seeded generator, an
LR warmup schedule, gather_for_metrics (uneven eval set), save_state/load_state mid-run
and trackers (tensorboard). The main process writes ``result.json``: the loss of every
micro-batch (mean over processes), the learning rate after every scheduler step, the
evaluation metric of every epoch, and what the trackers wrote.
"""

import json
import os
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

if os.environ["QUICKTOUR_LIB"] == "accelerate":
    from accelerate import Accelerator
else:
    from mixprec import Accelerator

OUT = Path(os.environ["QUICKTOUR_OUT"])
PRECISION = os.environ.get("QUICKTOUR_PRECISION", "bf16")


def data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    w = torch.randn(16, 1, generator=g)
    return TensorDataset(x, x @ w + 0.1 * torch.randn(n, 1, generator=g))


def main():
    accelerator = Accelerator(mixed_precision=PRECISION, gradient_accumulation_steps=2,
                              log_with="tensorboard", project_dir=str(OUT / "project"))
    accelerator.init_trackers("quicktour", config={"lr": 3e-3, "precision": PRECISION})
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    warmup = 4
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    train = DataLoader(data(96, 1), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7))
    evaluation = DataLoader(data(37, 2), batch_size=5)  # 37 samples: the last batch is uneven
    model, optimizer, train, scheduler, evaluation = accelerator.prepare(model, optimizer, train, scheduler, evaluation)

    losses, lrs, metrics = [], [], []
    step = 0
    for epoch in range(3):
        model.train()
        for x, y in train:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            losses.append(accelerator.gather(loss.detach()[None]).mean().item())
            lrs.append(scheduler.get_last_lr()[0])
            accelerator.log({"loss": losses[-1], "lr": lrs[-1]}, step=step)
            step += 1
        model.eval()
        errors = []
        for x, y in evaluation:
            with torch.no_grad():
                pred = model(x).float()
            pred, y = accelerator.gather_for_metrics((pred, y))
            errors.append((pred - y).abs().flatten())
        errors = torch.cat(errors)
        metrics.append({"n": errors.numel(), "mae": errors.mean().item()})
        accelerator.log({"eval_mae": metrics[-1]["mae"]}, step=step)
        if epoch == 0:
            # Save, disturb, restore: training must go on as if nothing happened.
            accelerator.save_state(str(OUT / "ckpt"))
            accelerator.wait_for_everyone()  # Accelerate's main process writes the weights alone
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
            accelerator.load_state(str(OUT / "ckpt"))
    accelerator.end_training()

    if accelerator.is_main_process:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        runs = [p for p in (OUT / "project").rglob("events.out.tfevents.*")]
        logged = {}
        for run in runs:
            acc = EventAccumulator(str(run))
            acc.Reload()
            for tag in acc.Tags()["scalars"]:
                logged.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
        (OUT / "result.json").write_text(json.dumps(
            {"losses": losses, "lrs": lrs, "metrics": metrics, "tensorboard": logged}))


if __name__ == "__main__":
    main()
    if os.environ["QUICKTOUR_LIB"] == "accelerate":
        # The reference run (torch DDP over Gloo) aborts at interpreter exit in about one run
        # in five after succeeding ("terminate called without an active exception": torch's
        # reducer keeps the group's Gloo workers alive into finalization; 2 of 10 runs
        # measured, against 0 of 10 for the mixprec run, whose engine releases the group
        # first: [Note: shutdown without end_training] in src/mixprec/accelerator.py). Its
        # results are written by now; it ends here so the test compares numerics, not
        # torch's shutdown.
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

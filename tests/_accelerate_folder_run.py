"""One training loop, run under Accelerate or mixprec, for the tests of loading a folder
written by Accelerate's ``save_state`` (tests/checkpoint/test_accelerate_folder.py,
tests/distributed/test_accelerate_folder_ddp.py; issue #36 point 5).

The loop draws from every RNG a checkpoint restores (torch: a noise term; python and
numpy: loss factors), accumulates gradients over 2 micro-batches (so the restored
accumulation counter decides which micro-batches step), steps AdamW and a LambdaLR
schedule, counts micro-batches in an object registered for checkpointing, and reads a
shuffled loader whose order comes from a seeded generator (Accelerate's resume relies on
it: it records no dataloader position for a map-style loader). Each rank's RNGs are
made to differ before the save, so a rank restoring another rank's state shows.

As a script (Accelerate's side, one process or a rank of several under torchrun's
environment)::

    python tests/_accelerate_folder_run.py FOLDER OUT

runs the uninterrupted run with Accelerate, saving FOLDER after ``SAVE_AT`` micro-batches,
then Accelerate's own resume from FOLDER (a new Accelerator and model: ``load_state`` then
``skip_first_batches``), and writes ``OUT.rank<r>.pt``. mixprec's side calls
:func:`resume` ("mixprec", FOLDER) in process.
"""

from __future__ import annotations

import copy
import random
import sys

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

N = 24  # samples; batches of 2 per process
ACCUMULATION = 2
SAVE_AT = 5  # micro-batches of epoch 0 before the save: inside an accumulation window
EPOCHS = 2
LR = 1e-2


class Rows(Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return {"index": i, "x": torch.randn(4, generator=g), "y": torch.randn(1, generator=g)}


class Seen:
    """A registered object: counts micro-batches."""

    def __init__(self):
        self.count = 0

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, sd):
        self.count = sd["count"]


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def schedule(step: int) -> float:
    return 1.0 / (1 + step)


class Box:
    """A class instance inside a registered object's state (a pickle torch.load(weights_only=True) refuses)."""

    def __init__(self, value):
        self.value = value


def build(lib: str, seed: int, backend: str = "single", **options):
    """The run's objects; ``options``: more mixprec Accelerator options."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if lib == "accelerate":
        from accelerate import Accelerator

        acc = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATION)
    else:
        from mixprec import Accelerator

        acc = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATION, log_policy=False,
                          **({} if backend == "single" else {"backend": backend}), **options)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    loader = DataLoader(Rows(), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(7))
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    seen = Seen()
    acc.register_for_checkpointing(seen)
    return acc, model, opt, loader, sched, seen


def loss_of(model, batch, noise, a, b):
    out = model(batch["x"].to(next(model.parameters()).dtype)) + 0.1 * noise
    return torch.nn.functional.mse_loss(out, batch["y"].to(out.dtype)) * (1 + 0.1 * a) + 0.01 * b


def micro_step(acc, model, opt, sched, seen, batch) -> dict:
    noise = torch.rand(len(batch["index"]), 1)
    a, b = random.random(), float(np.random.rand())
    with acc.accumulate(model):
        loss = loss_of(model, batch, noise, a, b)
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        sync = bool(acc.sync_gradients)
    seen.count += 1
    return {"index": batch["index"].tolist(), "noise": noise, "a": a, "b": b, "sync": sync,
            "loss": float(loss.detach()), "lr": sched.get_last_lr()[0], "seen": seen.count}


def snapshot(lib, acc, model, opt, sched, seen) -> dict:
    """Everything load_state restores, as it is right after it."""
    return {
        "weights": {k: v.detach().clone() for k, v in acc.unwrap_model(model).state_dict().items()},
        "optimizer": copy.deepcopy(opt.state_dict()),
        "scheduler": copy.deepcopy(sched.state_dict()),
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
        "numpy_rng": [x.tolist() if isinstance(x, np.ndarray) else x for x in np.random.get_state()],
        "step": acc.step if lib == "accelerate" else acc.gradient_state.step,
        "seen": seen.count,
    }


def full(lib: str, folder: str, rank: int) -> list:
    """The uninterrupted run, saving ``folder`` after SAVE_AT micro-batches of epoch 0."""
    acc, model, opt, loader, sched, seen = build(lib, 0)
    torch.rand(rank + 1), random.random() if rank else None, np.random.rand(2 * rank + 1)  # ranks differ
    records = []
    for epoch in range(EPOCHS):
        for i, batch in enumerate(loader):
            records.append(micro_step(acc, model, opt, sched, seen, batch))
            if epoch == 0 and i + 1 == SAVE_AT:
                acc.save_state(folder)
    return records


def resume(lib: str, folder: str, backend: str = "single") -> dict:
    """Accelerate's resume idiom: new objects (another seed), ``load_state``, then
    ``skip_first_batches`` for the checkpointed epoch and the loader itself after it."""
    acc, model, opt, loader, sched, seen = build(lib, 123, backend)
    acc.load_state(folder)
    after = snapshot(lib, acc, model, opt, sched, seen)
    records = []
    for epoch in range(EPOCHS):
        active = acc.skip_first_batches(loader, SAVE_AT) if epoch == 0 else loader
        for batch in active:
            records.append(micro_step(acc, model, opt, sched, seen, batch))
    weights = {k: v.detach().clone() for k, v in acc.unwrap_model(model).state_dict().items()}
    if lib == "mixprec":
        acc.end_training()
    return {"after_load": after, "records": records, "weights": weights}


def mixprec_resume_on_rank(state, folder: str, backend: str) -> dict:
    """mixprec's side on a rank of tests/distributed/harness.py."""
    return resume("mixprec", folder, backend)


def replay_float64(folder: str, resumed: list) -> dict:
    """The resumed run in float64 with plain torch, from the folder's files: every rank's
    micro-batches (their recorded samples, noise and factors), gradients averaged over the
    ranks as DDP does, stepping where the run synchronised (the schedule once per process
    per optimizer step, as Accelerate and mixprec do without ``split_batches``). ``resumed``: per rank, the
    records of :func:`resume`. Returns per-rank losses and the final weights."""
    from safetensors.torch import load_file

    from pathlib import Path

    path = Path(folder)
    model = make_model().double()
    model.load_state_dict({k: v.double() for k, v in load_file(str(path / "model.safetensors")).items()})
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)  # built first, as in the runs
    opt.load_state_dict(torch.load(path / "optimizer.bin", weights_only=True))
    sched.load_state_dict(torch.load(path / "scheduler.bin", weights_only=True))
    rows, world = Rows(), len(resumed)
    losses = [[] for _ in resumed]
    for k in range(len(resumed[0])):
        total = 0
        for r in range(world):
            rec = resumed[r][k]
            batch = torch.utils.data.default_collate([rows[i] for i in rec["index"]])
            loss = loss_of(model, batch, rec["noise"].double(), rec["a"], rec["b"])
            losses[r].append(float(loss.detach()))
            total = total + loss / world
        (total / ACCUMULATION).backward()
        if resumed[0][k]["sync"]:
            opt.step()
            for _ in range(world):  # Accelerate's rule, which mixprec keeps: once per process
                sched.step()
            opt.zero_grad()
    return {"losses": losses, "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def assert_same_state(ours: dict, theirs: dict, where: str = "") -> None:
    """Two snapshots of snapshot(): equal to the bit."""
    assert ours["weights"].keys() == theirs["weights"].keys(), where
    for k in theirs["weights"]:
        assert torch.equal(ours["weights"][k], theirs["weights"][k]), (where, k)
    o, t = ours["optimizer"], theirs["optimizer"]
    assert o["param_groups"] == t["param_groups"], where
    assert o["state"].keys() == t["state"].keys() and len(t["state"]) == 4, where
    for i, entries in t["state"].items():
        assert o["state"][i].keys() == entries.keys(), (where, i)
        for key, value in entries.items():
            assert torch.equal(o["state"][i][key], value), (where, i, key)
    assert ours["scheduler"] == theirs["scheduler"], where
    assert torch.equal(ours["torch_rng"], theirs["torch_rng"]), where
    assert ours["python_rng"] == theirs["python_rng"], where
    assert ours["numpy_rng"] == theirs["numpy_rng"], where
    assert ours["step"] == theirs["step"] == SAVE_AT, where
    assert ours["seen"] == theirs["seen"] == SAVE_AT, where


def assert_continues_as_accelerate(folder, ours: list, theirs: list) -> None:
    """``ours``/``theirs``: per rank, the results of resume() under mixprec / Accelerate."""
    for r, (o, t) in enumerate(zip(ours, theirs)):
        # The same batches, random draws, accumulation boundaries and learning rates.
        for key in ("index", "a", "b", "sync", "lr", "seen"):
            assert [x[key] for x in o["records"]] == [x[key] for x in t["records"]], (r, key)
        assert all(torch.equal(x["noise"], y["noise"]) for x, y in zip(o["records"], t["records"])), r
    per_rank = N // (2 * len(ours))
    assert len(theirs[0]["records"]) == EPOCHS * per_rank - SAVE_AT
    reference = replay_float64(str(folder), [t["records"] for t in theirs])

    def loss_error(run, r):
        return max(abs(x["loss"] - y) for x, y in zip(run["records"], reference["losses"][r]))

    def weight_error(a, b):
        return max(float((a[k].double() - b[k].double()).abs().max()) for k in reference["weights"])

    for r, (o, t) in enumerate(zip(ours, theirs)):
        theirs_loss, ours_loss = loss_error(t, r), loss_error(o, r)
        # The replay follows Accelerate's run (else the reference would be meaningless) ...
        assert 0 < theirs_loss < 1e-5, theirs_loss
        # ... and mixprec is no farther from float64 than Accelerate's fp32 run (x2: two
        # independent roundings; [Note: calibrated bounds] in tests/_numerics.py). Their
        # distance from each other is then at most 3x Accelerate's by the triangle inequality:
        # asserted at that, not at 1x (which held or failed by the CPU's rounding).
        assert ours_loss <= 2 * theirs_loss, (r, ours_loss, theirs_loss)
        assert max(abs(x["loss"] - y["loss"]) for x, y in zip(o["records"], t["records"])) <= 3 * theirs_loss, r
        theirs_w = weight_error(t["weights"], reference["weights"])
        ours_w = weight_error(o["weights"], reference["weights"])
        assert 0 < theirs_w < 1e-5 and ours_w <= 2 * theirs_w, (r, ours_w, theirs_w)
        assert weight_error(o["weights"], t["weights"]) <= 3 * theirs_w, r


if __name__ == "__main__":
    import os

    folder, out = sys.argv[1], sys.argv[2]
    rank = int(os.environ.get("RANK", "0"))
    records = full("accelerate", folder, rank)
    result = resume("accelerate", folder)
    result["full"] = records
    torch.save(result, f"{out}.rank{rank}.pt")
    # Accelerate leaves the process group up: end it together, so that no rank's Gloo
    # threads see the other exit first (a rank then aborts: "terminate called without an
    # active exception", seen once in 20 runs of test_accelerate_folder_ddp).
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()

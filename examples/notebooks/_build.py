"""Write the example notebooks from the cell sources below (run it after editing them).

    python examples/notebooks/_build.py

The notebooks are committed without outputs; keeping their sources here keeps them
reviewable as plain Python. ``tests/test_notebooks.py`` executes every notebook.
Cells tagged ``diagnosis`` (notebook 03) show overflow diagnosis: by hand with forward
hooks, then mixprec's ``OverflowStormError`` report.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent


def md(text: str):
    return new_markdown_cell(text.strip("\n"))


def code(text: str, *tags: str):
    cell = new_code_cell(text.strip("\n"))
    if tags:
        cell.metadata["tags"] = list(tags)
    return cell


# ----------------------------------------------------------------------------- 01
QUICKSTART = [
    md("""
# mixprec quickstart

Keep your own PyTorch loop; wrap it with `mixprec.Accelerator`. This notebook trains a
small regression MLP in bf16 on generated data, in this process, then runs the **same
function** in two processes with `notebook_launcher`.
"""),
    code("""
import logging

import torch
from torch import nn

import mixprec
from mixprec import Accelerator, notebook_launcher
from mixprec.logging import RANK_FORMAT, get_logger

logging.basicConfig(format=RANK_FORMAT, level=logging.INFO, force=True)
logger = get_logger("quickstart")   # logs on the main process only; records carry the rank
mixprec.__version__
"""),
    md("""
## Data and model

Targets are a fixed random linear map of the inputs plus a little noise, so the loss can
go close to the noise floor (0.01).
"""),
    code("""
def make_data(n=2048, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    w = torch.randn(16, 4, generator=g)
    y = x @ w + 0.1 * torch.randn(n, 4, generator=g)
    return torch.utils.data.TensorDataset(x, y)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))

    def forward(self, x):
        return self.net(x)
"""),
    md("""
## The training function

Everything that holds a process group - the `Accelerator`, the prepared model - is created
*inside* the function, so the same function runs here or in spawned processes.
`optimizer.step()` returns a `StepResult` saying whether the weights changed.
"""),
    code("""
def train(steps=60, mixed_precision="bf16", backend="auto"):
    # A spawned process starts with logging unconfigured: configure it here (a no-op in the kernel).
    logging.basicConfig(format=RANK_FORMAT, level=logging.INFO)
    accelerator = Accelerator(mixed_precision=mixed_precision, backend=backend, log_policy=False)
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(make_data(), batch_size=64, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    log = get_logger("quickstart")
    step, losses = 0, []
    while step < steps:
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x).float(), y)
            accelerator.backward(loss)
            result = optimizer.step()
            optimizer.zero_grad()
            losses.append(accelerator.reduce(loss.detach(), "mean").item())
            step += 1
            if step % 20 == 0:
                log.info("step %d loss %.4f %s", step, losses[-1], result)
            if step == steps:
                break
    summary = {"backend": accelerator.backend, "processes": accelerator.num_processes,
               "first_loss": losses[0], "final_loss": losses[-1]}
    accelerator.end_training()
    return summary
"""),
    code("""
single = train()
print(single)
assert single["final_loss"] < 0.2 * single["first_loss"], single
"""),
    md("""
## Two processes from the notebook

`notebook_launcher` spawns the processes (each joins a Gloo process group on 127.0.0.1),
sends them `train` - defined in this notebook: functions and classes of the notebook are
sent by value - and returns every rank's return value, rank 0's first. Each process sees
half of every epoch, so `"auto"` picks DDP. What the processes print or log appears below
the cell.
"""),
    code("""
results = notebook_launcher(train, args=(60,), num_processes=2)
for rank, r in enumerate(results):
    print(rank, r)
assert results[0]["backend"] == "ddp" and results[0]["processes"] == 2
assert results[0]["final_loss"] < 0.2 * results[0]["first_loss"]
"""),
    md("""
An error in a process comes back here with that rank's traceback, and the cell can be run
again right away:
"""),
    code("""
def broken(rank_to_fail):
    accelerator = Accelerator(log_policy=False)
    if accelerator.process_index == rank_to_fail:
        raise ValueError(f"rank {rank_to_fail} gives up")
    accelerator.end_training()


try:
    notebook_launcher(broken, args=(1,), num_processes=2)
except mixprec.NotebookLaunchError as e:
    print("rank", e.rank, "failed:", e.child_traceback.strip().splitlines()[-1])
    assert e.rank == 1 and "gives up" in e.child_traceback
"""),
]

# ----------------------------------------------------------------------------- 02
SWITCHING = [
    md("""
# One loop, every backend

The same training function runs on `single` here, then on `ddp`, `zero2`, `zero3` and
`fsdp` with two processes. Only the `backend=` value changes. With `split_batches=True`
every step sees the same global batch of 64 whatever the number of processes, and with the
same bf16 policy on every backend the losses agree to within bf16 rounding.
"""),
    code("""
import torch
from torch import nn

from mixprec import Accelerator, notebook_launcher


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 64), nn.GELU())
        self.head = nn.Linear(64, 4)

    def forward(self, x):
        return self.head(self.body(x))


def dataset(n=1024, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    y = torch.sin(x[:, :4]) + 0.5 * x[:, 4:8]
    return torch.utils.data.TensorDataset(x, y)


def train(backend, steps=30, config=None):
    accelerator = Accelerator(mixed_precision="bf16", backend=backend, split_batches=True, log_policy=False,
                              config=config)
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=64, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    batches = iter(loader)
    for _ in range(steps):
        try:
            x, y = next(batches)
        except StopIteration:
            batches = iter(loader)
            x, y = next(batches)
        loss = nn.functional.mse_loss(model(x).float(), y)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), "mean").item())
    accelerator.end_training()
    return losses
"""),
    code("""
losses = {"single": train("single")}
for backend in ("ddp", "zero2", "zero3", "fsdp"):
    losses[backend] = notebook_launcher(train, args=(backend,), num_processes=2)[0]
"""),
    code("""
print(f"{'backend':8} {'first':>8} {'final':>8} {'max |diff| vs single':>22}")
for name, curve in losses.items():
    diff = max(abs(a - b) for a, b in zip(curve, losses["single"]))
    print(f"{name:8} {curve[0]:8.4f} {curve[-1]:8.4f} {diff:22.2e}")
    assert curve[-1] < 0.5 * curve[0], (name, curve)
    assert diff < 5e-3, (name, diff)            # bf16 rounding of a different batch split
# The distributed backends compute the same global step: they agree to fp32 rounding.
for name in ("zero2", "zero3", "fsdp"):
    assert max(abs(a - b) for a, b in zip(losses[name], losses["ddp"])) < 1e-5, name
"""),
    md("""
Outside a notebook the backend comes from the command line or a config file, e.g.
`mixprec launch --nproc-per-node 2 examples/digits_cnn.py --backend zero3`.

## Tensor parallelism

`tensor_parallel.size: 2` splits chosen Linears over the two processes instead of
replicating them (docs/tensor_parallel.md). This model has no Hugging Face plan and no
standard names, so the split is written as rules: `body.3` column-parallel (each rank
computes half of its 64 output features), `head` row-parallel (each rank reads its half
and the partial outputs are summed). Both ranks see the same batches (the loader shards
over the data-parallel ranks, here one), and the loss follows the one-process curve.
"""),
    code("""
TP = {"tensor_parallel": {"size": 2, "partition_config": {"use_default_specs": False, "layer_specs": [
    {"patterns": [r"^body\\.3$"], "partition_type": "column"},
    {"patterns": [r"^head$"], "partition_type": "row"},
]}}}
losses["tp2"] = notebook_launcher(train, args=("ddp", 30, TP), num_processes=2)[0]
diff = max(abs(a - b) for a, b in zip(losses["tp2"], losses["single"]))
print(f"tp2: final {losses['tp2'][-1]:.4f}, max |diff| vs single {diff:.2e}")
assert diff < 5e-3, diff
"""),
]

# ----------------------------------------------------------------------------- 03
PRECISION = [
    md("""
# fp16, loss scaling, and what a skipped step looks like

fp16 keeps 10 mantissa bits and a small range (max 65504), so mixprec scales the loss before
backward and unscales the gradients before the step. A step whose gradients overflow is
**skipped** - the weights do not change - and the scale is halved; `optimizer.step()` says so
in its `StepResult`. Here we train in fp16, force an overflow for a few steps by scaling one
layer's output far out of fp16's range, and look at the record.
"""),
    code("""
import matplotlib
import matplotlib.pyplot as plt
import torch
from torch import nn

from mixprec import Accelerator, ScalerConfig

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))
g = torch.Generator().manual_seed(0)
x_all = torch.randn(4096, 16, generator=g)
y_all = torch.tanh(x_all[:, :4] * 2)

# growth_interval=25: the scale doubles after 25 clean steps, so the plot shows it move.
accelerator = Accelerator(mixed_precision="fp16", scaler=ScalerConfig(growth_interval=25), log_policy=False)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
model, optimizer = accelerator.prepare(model, optimizer)
accelerator.policy
"""),
    md("""
## The forced overflow

A forward hook multiplies the output of the middle layer by 1e6 during steps 100-102: in fp16
that is `inf`, the loss is not finite, and the gradients neither.
"""),
    code("""
OVERFLOW_STEPS = {100, 101, 102}
state = {"step": 0}


def blow_up(module, inputs, output):
    return output * 1e6 if state["step"] in OVERFLOW_STEPS else output


hook = model[2].register_forward_hook(blow_up)
records = []
for step in range(160):
    state["step"] = step
    i = torch.randint(0, len(x_all), (64,), generator=g)
    loss = nn.functional.mse_loss(model(x_all[i]).float(), y_all[i])
    accelerator.backward(loss)
    before = model[0].weight.detach().clone()
    result = optimizer.step()
    changed = not torch.equal(before, model[0].weight)
    optimizer.zero_grad()
    records.append({"step": step, "loss": loss.item(), "scale": result.loss_scale,
                    "stepped": result.stepped, "reason": result.reason, "weights_changed": changed})
hook.remove()
print("skipped steps:", accelerator.skipped_steps, " scale now:", accelerator.loss_scale)
"""),
    md("""
## The StepResult record around the overflow
"""),
    code("""
for r in records[97:106]:
    print(r)
skipped = [r["step"] for r in records if not r["stepped"]]
print("skipped:", skipped)
assert set(OVERFLOW_STEPS) <= set(skipped)
assert all(r["reason"] == "overflow" and not r["weights_changed"] for r in records if r["step"] in OVERFLOW_STEPS)
assert all(r["weights_changed"] for r in records if r["stepped"])
scales = [r["scale"] for r in records]
assert scales[103] == scales[100] / 8, (scales[100], scales[103])   # halved once per skipped step
assert accelerator.skipped_steps == len(skipped)
"""),
    md("""
## Loss and loss scale
"""),
    code("""
matplotlib.rcParams["figure.figsize"] = (9, 3.5)
fig, (ax_loss, ax_scale) = plt.subplots(1, 2)
steps = [r["step"] for r in records]
finite = [(r["step"], r["loss"]) for r in records if torch.isfinite(torch.tensor(r["loss"]))]
ax_loss.plot(*zip(*finite))
ax_loss.set_yscale("log")
ax_loss.set_title("loss (finite values)")
ax_scale.step(steps, scales, where="post")
ax_scale.scatter(skipped, [scales[s] for s in skipped], color="red", label="skipped (overflow)")
ax_scale.set_yscale("log", base=2)
ax_scale.set_title("loss scale")
ax_scale.legend()
fig.tight_layout()
fig.savefig("fp16_loss_scale.png")
"""),
    md("""
## Diagnosis: which module overflowed?

With the current API the skipped steps are visible (above); finding the culprit takes a
forward pass with hooks that report the first module whose output is not finite.
"""),
    code("""
def first_nonfinite_module(model, x):
    found = []

    def check(name):
        def hook(module, inputs, output):
            if not found and isinstance(output, torch.Tensor) and not torch.isfinite(output).all():
                found.append((name, type(module).__name__, output.dtype))
        return hook

    handles = [m.register_forward_hook(check(n)) for n, m in model.named_modules() if n]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    return found[0] if found else None


state["step"] = 100                     # replay a step of the overflow window
hook = model[2].register_forward_hook(blow_up)
culprit = first_nonfinite_module(model, x_all[:64])
hook.remove()
print("first module with a non-finite output:", culprit)
assert culprit is not None and culprit[0] == "2"
""", "diagnosis"),
    md("""
## When the scale cannot save the run: `OverflowStormError`

A few skipped steps are normal. When a module overflows at every step, halving the scale
never helps; mixprec stops after `max_consecutive_overflows` skipped steps in a row (default
20, here 5) with an `OverflowStormError` whose report names the first module whose output
(or output gradient) was not finite, and the fixes.
"""),
    code("""
import mixprec

torch.manual_seed(0)
storm_model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))
storm = Accelerator(mixed_precision="fp16", max_consecutive_overflows=5, log_policy=False)
storm_opt = torch.optim.AdamW(storm_model.parameters(), lr=3e-3)
storm_model, storm_opt = storm.prepare(storm_model, storm_opt)
storm_model[2].register_forward_hook(lambda module, inputs, output: output * 1e6)   # overflows every step

try:
    for step in range(50):
        loss = nn.functional.mse_loss(storm_model(x_all[:64]).float(), y_all[:64])
        storm.backward(loss)
        storm_opt.step()
        storm_opt.zero_grad()
except mixprec.OverflowStormError as e:
    report = e.report
    print(report)
assert step == 4 and report.culprit.module == "2", (step, report)
""", "diagnosis"),
]

# ----------------------------------------------------------------------------- 04
RESUME = [
    md("""
# Save on ZeRO-2 with two processes, resume on one

mixprec writes one checkpoint format for every backend: the fp32 master weights, optimizer
state and loss scaler as full tensors with their sharding recorded, so a checkpoint saved by
`zero2` on 2 processes loads into `single` (or `fsdp` on 4, ...). We train 20 steps on zero2,
save, train 10 more (the reference continuation), then load the checkpoint in this process
and run the same 10 steps.
"""),
    code("""
import tempfile

import torch
from torch import nn

from mixprec import Accelerator, notebook_launcher

CKPT = tempfile.mkdtemp(prefix="mixprec-nb-")


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, x):
        return self.net(x)


def batch(step, size=64):
    # Data is a function of the step number, the same in every process and every run.
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(size, 8, generator=g)
    return x, (x[:, :1] * x[:, 1:2]).tanh()


def setup(backend):
    accelerator = Accelerator(mixed_precision="bf16", backend=backend, log_policy=False)
    torch.manual_seed(0)
    model = Model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    return accelerator, model, optimizer, scheduler


def run(accelerator, model, optimizer, scheduler, steps):
    losses = []
    for step in steps:
        x, y = batch(step)
        # each process takes its share of the global batch
        with accelerator.split_between_processes({"x": x, "y": y}) as mine:
            loss = nn.functional.mse_loss(model(mine["x"]).float(), mine["y"])
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), "mean").item())
    return losses


def train_save_continue(ckpt):
    accelerator, model, optimizer, scheduler = setup("zero2")
    run(accelerator, model, optimizer, scheduler, range(20))
    accelerator.save_state(ckpt)
    continued = run(accelerator, model, optimizer, scheduler, range(20, 30))
    accelerator.end_training()
    return continued
"""),
    code("""
reference = notebook_launcher(train_save_continue, args=(CKPT,), num_processes=2)[0]
reference
"""),
    code("""
accelerator, model, optimizer, scheduler = setup("single")
accelerator.load_state(CKPT)
resumed = run(accelerator, model, optimizer, scheduler, range(20, 30))
accelerator.end_training()

for step, (a, b) in enumerate(zip(reference, resumed), start=20):
    print(f"step {step}: zero2x2 {a:.6f}  single (resumed) {b:.6f}  rel diff {abs(a - b) / a:.1e}")
assert all(abs(a - b) <= 2e-3 * a for a, b in zip(reference, resumed))   # bf16 rounding
"""),
]

NOTEBOOKS = {
    "01_quickstart.ipynb": QUICKSTART,
    "02_switching_backends.ipynb": SWITCHING,
    "03_precision_and_loss_scaling.ipynb": PRECISION,
    "04_checkpoint_resume_across_backends.ipynb": RESUME,
}


def build(out_dir: Path = HERE) -> list[Path]:
    """Write every notebook into ``out_dir``; return their paths."""
    written = []
    for name, cells in NOTEBOOKS.items():
        nb = new_notebook(cells=cells)
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        nb.metadata["language_info"] = {"name": "python"}
        path = out_dir / name
        nbformat.validate(nb)
        # Cell ids are derived from the position so rebuilding does not churn the files.
        for i, cell in enumerate(nb.cells):
            cell["id"] = f"{path.stem[:2]}-{i:02d}"
        nbformat.write(nb, path)
        written.append(path)
    return written


if __name__ == "__main__":
    for p in build():
        print("wrote", p.relative_to(HERE.parent.parent))

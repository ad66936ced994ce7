"""A script that never calls end_training() still exits 0.

[Note: shutdown without end_training] in src/mixprec/accelerator.py: at interpreter exit the
engines' C++ objects must let go of the process group, and the group must be destroyed,
before finalization (else a Gloo worker still releasing a tensor aborts the finished job
with "terminate called without an active exception", about one run in five). The abort is
a race, so the test checks its cause deterministically: right after mixprec's exit hook has
run, it records whether the group and the C++ objects holding it are gone.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

_SCRIPT = """
import atexit, gc, json, sys, weakref
from pathlib import Path
import torch
from torch import nn

out = Path(sys.argv[1])
backend = sys.argv[2]
refs = []

def report():
    gc.collect()
    rank = int(__import__("os").environ["RANK"])
    (out / f"rank{rank}.json").write_text(json.dumps({
        "group_alive": torch.distributed.is_initialized(),
        "engine_objects_alive": sum(r() is not None for r in refs),
        "engine_objects": len(refs),
    }))

from mixprec import Accelerator
import mixprec.accelerator as hooks

def mixprec_exit_then_report():
    hooks._shutdown_at_exit()
    report()

# `mixprec launch` imported mixprec before this script, so its exit hook is registered first
# (and runs last); run the report right after it instead.
atexit.unregister(hooks._shutdown_at_exit)
atexit.register(mixprec_exit_then_report)

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
    def forward(self, x):
        return torch.relu(self.lin(x)) + x

for _ in range(2):  # two Accelerators in one process, as notebooks and sweeps do
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block(), nn.Linear(16, 4))
    acc = Accelerator(mixed_precision="bf16", backend=backend, log_policy=False)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    for _ in range(3):
        with acc.accumulate(model):
            acc.backward(model(torch.randn(4, 16)).square().mean())
            acc.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
    engine = acc.engine
    held = list(engine.comm.reducers.values()) if hasattr(engine.comm, "reducers") else engine.comm.all_cores()
    refs.extend(weakref.ref(o) for o in held)
    del held, engine
acc.save_model(model, str(out / "export"))
"""


@pytest.mark.parametrize("backend", ["ddp", "zero2", "zero3", "fsdp"])
def test_script_without_end_training_releases_group_before_interpreter_exit(tmp_path, backend):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(_SCRIPT))
    proc = subprocess.run(
        [sys.executable, "-m", "mixprec", "launch", "--nproc-per-node", "2", str(script), str(tmp_path), backend],
        capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "terminate called" not in proc.stderr
    for rank in range(2):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen["engine_objects"] >= 2, seen
        assert seen["engine_objects_alive"] == 0, seen
        assert seen["group_alive"] is False, seen

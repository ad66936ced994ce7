"""Issue #36 point 5: a folder written by Accelerate's save_state is complete, in another
format: load_state says which format it is and how to carry the weights over, never that
the save was interrupted, and loads nothing."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytest.importorskip("accelerate")

_SAVE = """
import sys, torch
from accelerate import Accelerator
torch.manual_seed(0)
acc = Accelerator(cpu=True)
model = torch.nn.Linear(4, 2)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.StepLR(opt, 1)
model, opt, sched = acc.prepare(model, opt, sched)
acc.backward(model(torch.randn(3, 4)).sum()); opt.step(); sched.step()
acc.save_state(sys.argv[1])
torch.save(model.state_dict(), sys.argv[1] + ".weights.pt")
"""


def test_accelerate_save_state_folder_is_named_not_called_interrupted(tmp_path):
    from safetensors.torch import load_file

    from mixprec import Accelerator
    from mixprec.checkpoint.format import CheckpointError

    folder = tmp_path / "accelerate_ckpt"
    out = subprocess.run([sys.executable, "-c", _SAVE, str(folder)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    acc = Accelerator(cpu=True, log_policy=False)
    torch.manual_seed(1)
    model = torch.nn.Linear(4, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model, _ = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    with pytest.raises(CheckpointError) as e:
        acc.load_state(str(folder))
    message = str(e.value)
    assert "is a folder written by Accelerate's save_state" in message and "interrupted" not in message, message
    assert "model.safetensors" in message and "random_states_0.pkl" in message and "nothing was loaded" in message
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())  # nothing loaded
    # The way the message gives to carry the weights over (into a model before prepare()) works as written.
    fresh = torch.nn.Linear(4, 2)
    fresh.load_state_dict(load_file(str(folder / "model.safetensors")))
    saved = torch.load(str(folder) + ".weights.pt")
    assert all(torch.equal(fresh.state_dict()[k], saved[k]) for k in saved)


def test_an_interrupted_mixprec_save_is_still_called_interrupted(tmp_path):
    from mixprec.checkpoint.format import CheckpointError
    from mixprec.checkpoint.reader import CheckpointReader

    (tmp_path / "metadata.json").write_text("{}")
    (tmp_path / "tensors-rank00000.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="is incomplete .*its save was interrupted"):
        CheckpointReader(tmp_path)

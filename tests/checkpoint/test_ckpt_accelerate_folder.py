"""Issue #36 point 5: a folder written by Accelerate's save_state is complete, in another
format: CheckpointReader (and `mixprec consolidate`, built on it) says which format it is and
that load_state reads it, never that the save was interrupted. load_state itself reads it:
tests/checkpoint/test_accelerate_folder.py."""

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

    from mixprec.checkpoint.format import CheckpointError
    from mixprec.checkpoint.reader import CheckpointReader

    folder = tmp_path / "accelerate_ckpt"
    out = subprocess.run([sys.executable, "-c", _SAVE, str(folder)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    with pytest.raises(CheckpointError) as e:
        CheckpointReader(folder)
    message = str(e.value)
    assert "is a folder written by Accelerate's save_state" in message and "interrupted" not in message, message
    assert "model.safetensors" in message and "random_states_0.pkl" in message and "nothing was loaded" in message
    assert f"accelerator.load_state({str(folder)!r}) after prepare() loads it" in message, message
    # The weights the message points at are whole and load into a fresh model as they are.
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

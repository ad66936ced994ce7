"""A save and a load walk the model and the checkpoint's index a fixed number of times,
whatever the number of tensors and sharding units: a walk per parameter or per unit made
them quadratic (at 1,536 tensors, 0.5 s of a 0.6 s single-process load went to scanning the
index once per parameter; at 768 zero3 units, 2 s of a save went to a ``state_dict`` walk
per unit). Counted, not timed: ``state_names_by_head`` in checkpoint/format.py and
``_owned`` in engines/zero_state.py."""

import pytest
import torch
from torch import nn

from mixprec import Accelerator
from mixprec.checkpoint import reader as reader_mod


class _CountingIndex(dict):
    scans = 0

    def __iter__(self):
        type(self).scans += 1
        return super().__iter__()


def _walks(tmp_path, backend: str, units: int, monkeypatch) -> tuple:
    """(root state_dict walks, index scans) of one save and one load."""
    opts = {"units": ["Linear"]} if backend == "zero3" else {}
    acc = Accelerator(mixed_precision="bf16", backend=backend, cpu=True, log_policy=False, engine_options=opts)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(units)])
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    acc.backward(model(torch.randn(2, 8)).float().sum())
    opt.step()
    opt.zero_grad()
    root = acc.unwrap_model(model)
    before = {k: v.clone() for k, v in acc.get_state_dict(model).items()}
    walks = [0]
    original = root.state_dict

    def counted(*a, **k):
        walks[0] += 1
        return original(*a, **k)

    init = reader_mod.CheckpointReader.__init__

    def counting_init(self, *a, **k):
        init(self, *a, **k)
        self.index = _CountingIndex(self.index)

    _CountingIndex.scans = 0
    with monkeypatch.context() as m:
        m.setattr(root, "state_dict", counted)
        m.setattr(reader_mod.CheckpointReader, "__init__", counting_init)
        acc.save_state(str(tmp_path / f"ck{units}"))
        acc.backward(model(torch.randn(2, 8)).float().sum())  # move away from the saved values
        opt.step()
        opt.zero_grad()
        acc.load_state(str(tmp_path / f"ck{units}"))
    after = acc.get_state_dict(model)
    differ = [k for k, v in after.items() if not torch.equal(before[k], v)]
    assert not differ, f"the load did not restore {differ}"
    acc.end_training()
    return walks[0], _CountingIndex.scans


@pytest.mark.parametrize("backend", ["single", "zero3"])
def test_save_and_load_walk_the_model_and_index_a_fixed_number_of_times(tmp_path, backend, monkeypatch):
    few = _walks(tmp_path, backend, 4, monkeypatch)
    many = _walks(tmp_path, backend, 24, monkeypatch)
    assert many == few, (f"{backend}: (state_dict walks, index scans) grow with the number of units/tensors: "
                         f"{few} at 4 Linears, {many} at 24")

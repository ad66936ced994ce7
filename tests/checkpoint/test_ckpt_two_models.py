"""A mixprec checkpoint of two models, each with its own optimizer: the second model's
optimizer state is named ``optim/1/model1/<param>/<key>`` (docs/checkpointing.md, "The
engine contract") and loads back, on the replicated and the sharded backends and across
them. (Before, its key lost the model prefix, ``optim/1//<param>/...``, and load_state
refused the checkpoint it had just written.)"""

from __future__ import annotations

import pytest
import torch


def _run(backend: str, seed: int):
    from mixprec import Accelerator

    torch.manual_seed(seed)
    acc = Accelerator(cpu=True, log_policy=False, backend=backend)
    m1, m2 = torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)
    o1 = torch.optim.AdamW(m1.parameters(), lr=1e-2)
    o2 = torch.optim.AdamW(m2.parameters(), lr=2e-2)
    m1, m2, o1, o2 = acc.prepare(m1, m2, o1, o2)
    return acc, (m1, m2), (o1, o2)


def _tensors(path) -> dict:
    """Every tensor of a checkpoint, by name (a backend-independent view)."""
    from mixprec.checkpoint import CheckpointReader

    reader = CheckpointReader(path)
    return {n: reader(n, 0, int(torch.Size(shape).numel())) for n, (shape, _) in reader.index.items()}


@pytest.mark.parametrize("saver,loader", [("single", "single"), ("zero2", "zero2"), ("single", "zero2"),
                                          ("zero2", "single")])
def test_second_models_optimizer_state_round_trips(tmp_path, saver, loader):
    acc, models, opts = _run(saver, 0)
    for _ in range(2):
        acc.backward(models[1](models[0](torch.randn(5, 4))).pow(2).mean())
        for o in opts:
            o.step()
            o.zero_grad()
    acc.save_state(str(tmp_path / "c"))
    saved = _tensors(tmp_path / "c")
    assert "optim/1/model1/weight/exp_avg" in saved and not any("//" in n for n in saved), sorted(saved)
    acc, models, opts = _run(loader, 1)
    acc.load_state(str(tmp_path / "c"))
    acc.save_state(str(tmp_path / "again"))
    again = _tensors(tmp_path / "again")
    assert saved.keys() == again.keys()
    for k in saved:
        assert torch.equal(saved[k], again[k]), k
    assert opts[1].param_groups[0]["lr"] == 2e-2

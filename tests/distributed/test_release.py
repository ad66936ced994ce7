"""end_training() frees every C++ object that holds the process group before destroying it
(a group kept alive past its destruction is torn down at interpreter exit, where Gloo aborts)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from mixprec import Accelerator
from mixprec.distributed.spawn import run_distributed


def _train_then_end(state, backend):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    acc = Accelerator(mixed_precision="bf16", backend=backend, log_policy=False,
                      engine_options={"units": ["Linear"]} if backend in ("zero3", "fsdp") else None)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    for _ in range(2):
        acc.backward(model(torch.randn(4, 8)).square().mean())
        opt.step()
        opt.zero_grad()
    engine = acc.engine
    reducers = getattr(engine.comm, "reducers", None)
    held = list(reducers.values()) if reducers is not None else engine.comm.all_cores()
    refs = [weakref.ref(obj) for obj in held]
    assert refs, "the engine should hold C++ objects while training"
    del held
    acc.end_training()
    gc.collect()
    alive = sum(r() is not None for r in refs)
    return {"objects": len(refs), "alive_after_end_training": alive,
            "group_initialized": torch.distributed.is_initialized()}


@pytest.mark.parametrize("backend", ["ddp", "zero1", "zero2", "zero3", "fsdp"])
def test_end_training_frees_engine_objects_holding_the_group(backend):
    results = run_distributed(_train_then_end, 2, args=(backend,))
    for r in results:
        assert r["objects"] >= 1
        assert r["alive_after_end_training"] == 0, r
        assert r["group_initialized"] is False

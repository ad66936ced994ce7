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


def _accelerators_in_a_row(state, rounds):
    import time

    rank, out = state.rank, []
    for i in range(rounds):
        if i and rank == 0:
            # Rank 0 re-creates its group last: rank 1 reaches the store first and would read
            # rank 0's address from the previous group's keys ([Note: a fresh store prefix
            # per process group] in src/mixprec/distributed/state.py).
            time.sleep(1.0)
        acc = Accelerator(backend="ddp", cpu=True, log_policy=False)
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4)
        model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        acc.backward(model(torch.randn(4, 8)).square().mean())
        opt.step()
        out.append(acc.gather(torch.tensor([10 * i + rank])).tolist())
        acc.end_training()  # the old Accelerator (and its group) stays referenced until rebound
    return out


def test_a_new_accelerator_after_end_training_joins_a_fresh_group():
    # Before the fix the second round's first collective waited for ever on both ranks.
    for rank_out in run_distributed(_accelerators_in_a_row, 2, args=(3,), timeout=60):
        assert rank_out == [[0, 1], [10, 11], [20, 21]]

"""A picklable Accelerator, and Accelerate's state objects mixprec.PartialState /
mixprec.AcceleratorState (issue #27 items 5 and 6), on 2 processes, ddp / zero2 / fsdp."""

from __future__ import annotations

import pickle

import pytest
from harness import run_distributed

BACKENDS = ["ddp", "zero2", "fsdp"]


def _pickle_round_trip(state, backend):
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from mixprec import Accelerator, AcceleratorState, PartialState

    # No Accelerator yet: the state read from the environment (joins the job's group).
    early = PartialState()
    out = {"early": (early.num_processes, early.process_index, early.distributed_type.value, early.initialized)}
    acc = Accelerator(cpu=True, backend=backend, log_policy=False, mixed_precision="bf16",
                      gradient_accumulation_steps=2, split_batches=True)
    live = AcceleratorState()
    out["live"] = (live is acc.state, PartialState() is acc.state, live.num_processes, live.process_index,
                   live.distributed_type.value, str(live.device), live.mixed_precision, live.initialized)
    model = torch.nn.Linear(4, 1)
    acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2))
    payload = pickle.dumps(acc)
    again = pickle.loads(payload)  # same process: the process group is found again
    out.update({
        "same_state": again.state.__dict__ == acc.state.__dict__,
        "group_is_world": again.state.group is torch.distributed.group.WORLD,
        "settings": (again.backend, again.mixed_precision, again.gradient_accumulation_steps,
                     again.split_batches, again.num_processes, again.process_index),
        "prepared_carried": len(again.prepared.models),
    })
    # The unpickled Accelerator trains: its engine is built at first use, on every rank.
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 1)
    m, opt = again.prepare(m, torch.optim.SGD(m.parameters(), lr=0.1))
    for step in range(2):
        with again.accumulate(m):
            x = torch.full((2, 4), float(state.rank + step))
            again.backward(m(x).sum())
            opt.step()
            opt.zero_grad()
    full = again.get_state_dict(m)
    out["weights"] = full["weight"].tolist()
    out["gathered"] = again.gather(torch.tensor([state.rank])).tolist()
    out["payload"] = payload
    # Accelerate's reset: the Accelerators made before it stop preparing; a new one works.
    AcceleratorState._reset_state()
    try:
        again.prepare(torch.nn.Linear(1, 1))
        out["after_reset"] = None
    except AttributeError as e:
        out["after_reset"] = (str(e), acc.state.initialized)
    fresh = Accelerator(cpu=True, backend=backend, log_policy=False)
    out["fresh"] = (AcceleratorState() is fresh.state, fresh.state.initialized,
                    fresh.prepare(torch.nn.Linear(1, 1)) is not None)
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_accelerator_pickles_and_unpickles(backend):
    r0, r1 = run_distributed(_pickle_round_trip, 2, args=(backend,), timeout=240)
    kind = "FSDP" if backend == "fsdp" else "MULTI_CPU"
    for rank, r in enumerate((r0, r1)):
        assert r["early"] == (2, rank, "MULTI_CPU", True)
        assert r["live"] == (True, True, 2, rank, kind, "cpu", "bf16", True)
        assert "AcceleratorState._reset_state()" in r["after_reset"][0] and r["after_reset"][1] is False
        assert r["fresh"] == (True, True, True)
        assert r["same_state"] and r["group_is_world"] and r["prepared_carried"] == 0
        assert r["gathered"] == [0, 1]
    assert r0["settings"] == (backend, "bf16", 2, True, 2, 0) and r1["settings"][-1] == 1
    assert r0["weights"] == r1["weights"]  # one model: gradients were reduced over both ranks
    # Here (no process group of 2): unpickles, reads its settings, raises only when it communicates.
    import torch

    acc = pickle.loads(r1["payload"])
    assert (acc.num_processes, acc.process_index, acc.backend) == (2, 1, backend)
    with pytest.raises(RuntimeError, match="unpickled in a process without its process group"):
        acc.gather(torch.tensor([1]))

"""``join_uneven_inputs`` on every backend, 2 processes (issue #27 item 1): the rank whose
data ran out shadows the other's forwards, backwards and steps (src/mixprec/join.py)."""

from __future__ import annotations

import pytest
from harness import run_distributed

BACKENDS = ["ddp", "zero1", "zero2", "zero3", "fsdp"]


def _join(state, backend):
    import warnings

    import torch
    from torch.utils.data import DataLoader, IterableDataset, TensorDataset

    from mixprec import Accelerator

    out = {}
    xs = torch.arange(15, dtype=torch.float32).view(5, 3) / 10  # rank 0: samples 0, 2, 4; rank 1: 1, 3
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    out["init"] = [p.detach().clone() for p in model.parameters()]
    acc = Accelerator(cpu=True, backend=backend, log_policy=False, even_batches=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = acc.prepare(model, opt, DataLoader(TensorDataset(xs), batch_size=1))
    seen = []
    with acc.join_uneven_inputs([model, opt]):
        for (x,) in loader:
            acc.backward(model(x).sum())
            opt.step()
            opt.zero_grad()
            seen.append(x[0, 0].item())
    out["seen"] = seen
    out["final"] = {k: v.tolist() for k, v in acc.get_state_dict(model).items()}

    # bf16, accumulation over 2 micro-batches (the last batch closes the window), clipping:
    # rank 1 shadows rank 0's third micro-batch, its clip and its step.
    acc_b = Accelerator(cpu=True, backend=backend, log_policy=False, even_batches=False, mixed_precision="bf16",
                        gradient_accumulation_steps=2)
    torch.manual_seed(0)
    mb = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    ob = torch.optim.AdamW(mb.parameters(), lr=0.01)
    mb, ob, lb = acc_b.prepare(mb, ob, DataLoader(TensorDataset(xs), batch_size=1))
    steps = 0
    with acc_b.join_uneven_inputs([mb, ob]):
        for (x,) in lb:
            with acc_b.accumulate(mb):
                acc_b.backward(mb(x).float().pow(2).sum())
                if acc_b.sync_gradients:
                    acc_b.clip_grad_norm_(mb.parameters(), 0.05)
                    steps += 1
                ob.step()
                ob.zero_grad()
    out["bf16_steps"] = steps
    out["bf16_final"] = {k: v.tolist() for k, v in acc_b.get_state_dict(mb).items()}

    # Accelerate's own check: plain loss.backward(), no optimizer; and an eval forward.
    batches = []
    with acc.join_uneven_inputs([model]):
        for i, (x,) in enumerate(loader):
            model(x).sum().backward()
            with torch.no_grad():
                model(x)
            batches.append(i)
    out["batches"] = batches

    # even_batches overridden inside the block only; an iterable loader warns and keeps its own.
    even = Accelerator(cpu=True, backend=backend, log_policy=False)
    m2 = torch.nn.Linear(1, 1)
    m2, dl = even.prepare(m2, DataLoader(TensorDataset(torch.arange(3.0)), batch_size=1))

    class Stream(IterableDataset):
        def __iter__(self):
            yield from range(3)

    even.prepare(DataLoader(Stream(), batch_size=1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with even.join_uneven_inputs([m2], even_batches=False):
            out["inside"] = (dl.batch_sampler.even_batches, len(dl))
    out["after"] = (dl.batch_sampler.even_batches, len(dl))
    out["warned"] = [str(w.message) for w in caught if "map-style" in str(w.message)]

    # Accumulation windows closing at different micro-batches (3 samples, windows of 2: rank
    # 1's only batch closes its window, rank 0's first does not): an error, not a hang.
    acc_c = Accelerator(cpu=True, backend=backend, log_policy=False, even_batches=False,
                        gradient_accumulation_steps=2)
    mc = torch.nn.Linear(3, 1)
    mc, lc = acc_c.prepare(mc, DataLoader(TensorDataset(xs[:3]), batch_size=1))
    try:
        with acc_c.join_uneven_inputs([mc]):
            for (x,) in lc:
                with acc_c.accumulate(mc):
                    acc_c.backward(mc(x).sum())
        out["mismatch"] = None
    except RuntimeError as e:
        out["mismatch"] = str(e)
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_join_uneven_inputs_shadows_the_ranks_that_ran_out(backend):
    import torch

    r0, r1 = run_distributed(_join, 2, args=(backend,), timeout=240)
    assert len(r0["seen"]) == 3 and len(r1["seen"]) == 2
    # Same model on both ranks, and the update of mean-reduced gradients where the rank that
    # ran out contributes zeros to the third step: computed here in plain torch.
    assert r0["final"] == r1["final"]
    xs = torch.arange(15, dtype=torch.float32).view(5, 3) / 10
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for samples in ([0, 1], [2, 3], [4]):
        ref_opt.zero_grad()
        (sum(ref(xs[i:i + 1]).sum() for i in samples) / 2).backward()
        ref_opt.step()
    for name, value in ref.state_dict().items():
        assert torch.allclose(torch.tensor(r0["final"][name]), value, atol=1e-6), (backend, name)
    assert r0["batches"] == [0, 1, 2] and r1["batches"] == [0, 1]
    # ddp: each rank's own copy, kept identical by the shadowed clip and step.
    assert (r0["bf16_steps"], r1["bf16_steps"]) == (2, 1) and r0["bf16_final"] == r1["bf16_final"]
    for r in (r0, r1):
        assert r["after"] == (True, 2)
        assert r["warned"] and "only supported for map-style datasets" in r["warned"][0]
    assert r0["inside"] == (False, 2) and r1["inside"] == (False, 1)
    for r in (r0, r1):
        assert r["mismatch"] and "are not running the same operation" in r["mismatch"]

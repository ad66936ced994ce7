"""Accelerate's data features under mixprec on 2 processes, on the ddp, zero2 and fsdp
backends (issue #27): custom samplers and batch samplers sharded exactly.

Each backend runs one harness call (the ranks are warm, tests/distributed/harness.py) that
goes through every case; the assertions are made here on what the ranks return.
"""

from __future__ import annotations

import pytest
from harness import run_distributed

BACKENDS = ["ddp", "zero2", "fsdp"]
N = 22  # samples; batches of 4 leave a short last batch of 2 (Accelerate's DummyDataset size)


def _samplers(state, backend):
    """Every sampler layout, each sample's index gathered over both ranks, two passes each.
    The ranks' torch RNGs differ on purpose (as in separately launched processes): a sampler
    drawing from them must still give one order for all ranks."""
    import torch
    from torch.utils.data import (BatchSampler, DataLoader, Dataset, RandomSampler, SequentialSampler,
                                  WeightedRandomSampler, default_collate)

    from mixprec import Accelerator

    torch.manual_seed(1234 + state.rank)

    class Rows(Dataset):
        def __len__(self):
            return N

        def __getitem__(self, i):  # an int, or a list of ints when a BatchSampler is the sampler
            return [{"index": j} for j in i] if isinstance(i, list) else {"index": i}

    class CustomBatches:
        """A batch sampler of unknown make that shuffles with torch's global RNG."""

        def __init__(self, n, size):
            self.n, self.batch_size = n, size

        def __len__(self):
            return -(-self.n // self.batch_size)

        def __iter__(self):
            order = torch.randperm(self.n).tolist()
            for k in range(0, self.n, self.batch_size):
                yield order[k:k + self.batch_size]

    ds = Rows()
    acc = Accelerator(cpu=True, backend=backend, log_policy=False)
    model = torch.nn.Linear(1, 1)
    acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    layouts = {
        # The failing case of issue #27: a BatchSampler given as the sampler.
        "sampler_is_batch_sampler": DataLoader(ds, sampler=BatchSampler(RandomSampler(ds), 4, False),
                                               batch_size=None, collate_fn=default_collate),
        "batch_sampler": DataLoader(ds, batch_sampler=BatchSampler(RandomSampler(ds), 4, False)),
        "sequential": DataLoader(ds, sampler=SequentialSampler(ds), batch_size=4),
        "random": DataLoader(ds, sampler=RandomSampler(ds), batch_size=4),
        "weighted": DataLoader(ds, sampler=WeightedRandomSampler(torch.rand(N) + 0.1, N, replacement=False),
                               batch_size=4),
        "weighted_batch_sampler": DataLoader(ds, batch_sampler=BatchSampler(
            WeightedRandomSampler(torch.rand(N) + 0.1, N, replacement=False), 4, False)),
        "custom_batch_sampler": DataLoader(ds, batch_sampler=CustomBatches(N, 4)),
        "split_batches": None,
    }
    out = {}
    for name, loader in layouts.items():
        if name == "split_batches":
            acc_split = Accelerator(cpu=True, backend=backend, log_policy=False, split_batches=True)
            prepared = acc_split.prepare(DataLoader(ds, sampler=BatchSampler(RandomSampler(ds), 4, False),
                                                    batch_size=None, collate_fn=default_collate))
            gather = acc_split.gather_for_metrics
        else:
            prepared, gather = acc.prepare(loader), acc.gather_for_metrics
        passes = []
        for _ in range(2):
            passes.append(torch.cat([gather(b["index"]) for b in prepared]).tolist())
        out[name] = passes
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_sampler_layout_gives_each_sample_once_per_pass(backend):
    r0, r1 = run_distributed(_samplers, 2, args=(backend,), timeout=240)
    assert r0 == r1
    for name, passes in r0.items():
        for p in passes:
            assert sorted(p) == list(range(N)), f"{backend} {name}: a pass gave {sorted(p)}"
        if name != "sequential":
            assert passes[0] != passes[1], f"{backend} {name}: the second pass repeats the first order"
    assert r0["sequential"][0] == list(range(N))

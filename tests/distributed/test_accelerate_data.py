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


def _dispatch(state, backend, with_hf):
    """dispatch_batches: which rank reads, what each receives, gather_for_metrics, errors."""
    import time

    import torch
    from torch.utils.data import DataLoader, IterableDataset, TensorDataset

    from mixprec import Accelerator, DataLoaderConfiguration

    class Stream(IterableDataset):
        def __init__(self, n, fail_at=None):
            self.n, self.fail_at, self.reads = n, fail_at, 0

        def __iter__(self):
            for i in range(self.n):
                if i == self.fail_at:
                    raise ValueError(f"bad record {i}")
                self.reads += 1
                yield i

    def acc_with(**dl):
        return Accelerator(cpu=True, backend=backend, log_policy=False,
                           dataloader_config=DataLoaderConfiguration(**dl))

    out = {}
    acc = acc_with()  # dispatch_batches=None: dispatched because the dataset is iterable
    model = torch.nn.Linear(1, 1)
    acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    stream = Stream(23)
    loader = acc.prepare(DataLoader(stream, batch_size=4))
    mine = [b.tolist() for b in loader]
    out["default"] = (mine, stream.reads, torch.cat([acc.gather_for_metrics(b) for b in loader]).tolist())
    for split in (True, False):
        a = acc_with(split_batches=split, dispatch_batches=True)
        ld = a.prepare(DataLoader(Stream(23), batch_size=4))
        out[f"split={split}"] = ([b.tolist() for b in ld], torch.cat([a.gather_for_metrics(b) for b in ld]).tolist())
    # Map-style with dispatch_batches=True, uneven last batch, with and without even_batches.
    for even in (True, False):
        a = acc_with(dispatch_batches=True, even_batches=even)
        ld = a.prepare(DataLoader(TensorDataset(torch.arange(11)), batch_size=4))
        out[f"map even={even}"] = ([b.tolist() for (b,) in ld], len(ld))
    if with_hf:
        import datasets

        def gen():
            for i in range(10):
                yield {"idx": i, "text": f"s{i}"}

        hf = datasets.IterableDataset.from_generator(gen).with_format("torch")
        ld = acc.prepare(DataLoader(hf, batch_size=2))
        got = [(b["idx"].tolist(), b["text"]) for b in ld]
        gathered = [acc.gather_for_metrics(b["text"], use_gather_object=True) for b in ld]
        out["hf"] = (got, [t for g in gathered for t in g])
    # The receive overlaps the next read: while rank 0's loop holds step k, its reader has
    # already read step k+1 (observed, not timed: the loop waits for that event).
    ld = acc.prepare(DataLoader(Stream(24), batch_size=2))
    inner = ld.dataloader
    inner.events = [] if state.rank == 0 else None
    ahead = []
    for k, _ in enumerate(ld):
        if state.rank == 0:
            deadline = time.monotonic() + 30
            # The prepared loader has taken step k+1 already (it looks one batch ahead to
            # mark the last one); a reader that only read on request would not reach k+2.
            while k + 2 < 6 and ("read", k + 2) not in inner.events and time.monotonic() < deadline:
                time.sleep(0.01)
            ahead.append(k + 2 >= 6 or (("read", k + 2) in inner.events and ("consumed", k + 1) not in inner.events))
    out["overlap"] = ahead
    # A reading error on rank 0 reaches every rank.
    ld = acc.prepare(DataLoader(Stream(23, fail_at=9), batch_size=2))
    try:
        list(ld)
        out["error"] = None
    except (ValueError, RuntimeError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_dispatch_batches(backend):
    try:
        import datasets  # noqa: F401
        with_hf = True
    except ImportError:
        with_hf = False  # optional: not in the test extra
    r0, r1 = run_distributed(_dispatch, 2, args=(backend, with_hf), timeout=240)
    # Only rank 0 reads the stream; rank r gets the r-th slice of each global batch of 8.
    assert r0["default"][1] == 23 and r1["default"][1] == 0
    assert r0["default"][0] == [[0, 1, 2, 3], [8, 9, 10, 11], [16, 17, 18, 19]]
    assert r1["default"][0] == [[4, 5, 6, 7], [12, 13, 14, 15], [20, 21, 22, 0]]  # completed from the start
    assert r0["default"][2] == r1["default"][2] == list(range(23))  # the completion is dropped
    assert r0["split=True"][0] == [[0, 1], [4, 5], [8, 9], [12, 13], [16, 17], [20, 21]]
    assert r1["split=True"][0] == [[2, 3], [6, 7], [10, 11], [14, 15], [18, 19], [22, 0]]
    for key in ("split=True", "split=False"):
        assert r0[key][1] == r1[key][1] == list(range(23))
    # 11 samples: the last global step holds 3, sliced 2 per rank (completed unless even_batches=False).
    assert r0["map even=True"] == ([[0, 1, 2, 3], [8, 9]], 2) and r1["map even=True"] == ([[4, 5, 6, 7], [10, 0]], 2)
    assert r0["map even=False"][0] == [[0, 1, 2, 3], [8, 9]] and r1["map even=False"][0] == [[4, 5, 6, 7], [10]]
    if with_hf:
        assert r0["hf"][0] == [([0, 1], ["s0", "s1"]), ([4, 5], ["s4", "s5"]), ([8], ["s8"])]
        assert r1["hf"][0] == [([2, 3], ["s2", "s3"]), ([6, 7], ["s6", "s7"]), ([9], ["s9"])]
        assert r0["hf"][1] == [f"s{i}" for i in range(10)]
    assert r0["overlap"] and all(r0["overlap"])
    assert r0["error"] == "ValueError: bad record 9"
    assert r1["error"].startswith("RuntimeError: dispatch_batches: rank 0 failed reading the dataloader: "
                                  "ValueError: bad record 9")


def _stateful(state, backend, with_hf, ckpt):
    """use_stateful_dataloader: save_state mid-epoch, then load_state into the same and into
    a new Accelerator: the next batches are exactly those that came after the save."""
    import torch
    from torch.utils.data import DataLoader, IterableDataset, TensorDataset

    from mixprec import Accelerator, DataLoaderConfiguration

    class Stream(IterableDataset):
        def __iter__(self):
            yield from range(40)

    def hf_stream():
        import datasets

        def gen():
            for i in range(40):
                yield {"idx": i}

        return datasets.IterableDataset.from_generator(gen).with_format("torch")

    layouts = {"shuffled": lambda: DataLoader(TensorDataset(torch.arange(64)), batch_size=4, shuffle=True),
               "stream": lambda: DataLoader(Stream(), batch_size=4)}
    if with_hf:
        layouts["hf_stream"] = lambda: DataLoader(hf_stream(), batch_size=4)

    def setup():
        acc = Accelerator(cpu=True, backend=backend, log_policy=False,
                          dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
        torch.manual_seed(0)
        model = torch.nn.Linear(1, 1)
        acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        return acc

    def flat(batch):
        b = batch["idx"] if isinstance(batch, dict) else batch[0] if isinstance(batch, list) else batch
        return b.tolist()

    out = {}
    for name, make in layouts.items():
        torch.manual_seed(100 + state.rank)  # the ranks' RNGs differ, as in separate launches
        acc = setup()
        loader = acc.prepare(make())
        after = []
        for step, batch in enumerate(loader):
            if step == 2:
                acc.save_state(f"{ckpt}/{name}")
            elif step > 2:
                after.append(flat(batch))
        acc.load_state(f"{ckpt}/{name}")
        same = [flat(b) for b in loader]
        next_pass = [flat(b) for b in loader]
        fresh = setup()  # a restarted run
        loader2 = fresh.prepare(make())
        fresh.load_state(f"{ckpt}/{name}")
        restarted = [flat(b) for b in loader2]
        out[name] = {"after": after, "same": same, "restarted": restarted, "next_pass": next_pass,
                     "len": len(loader) if name == "shuffled" else None}
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_stateful_dataloader_resumes_at_the_next_sample(backend, tmp_path):
    pytest.importorskip("torchdata.stateful_dataloader")  # optional: not in the test extra
    try:
        import datasets  # noqa: F401
        with_hf = True
    except ImportError:
        with_hf = False
    r0, r1 = run_distributed(_stateful, 2, args=(backend, with_hf, str(tmp_path)), timeout=240)
    for r in (r0, r1):
        for name, got in r.items():
            assert got["after"] and got["same"] == got["after"] == got["restarted"], (backend, name)
    # Together the ranks saw every sample after the saved position exactly once.
    seen = sorted(x for r in (r0, r1) for b in r["shuffled"]["after"] for x in b)
    assert len(seen) == len(set(seen)) == 64 - 3 * 2 * 4
    assert r0["shuffled"]["len"] == len(r0["shuffled"]["next_pass"]) == 8  # then whole passes again
    assert r0["stream"]["after"] == [[24, 25, 26, 27], [32, 33, 34, 35]]  # dispatched: rank 0 read it
    if with_hf:
        assert r1["hf_stream"]["after"] == [[28, 29, 30, 31], [36, 37, 38, 39]]

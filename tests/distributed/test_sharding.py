import pytest
import torch
from harness import run_distributed
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from mixprec.data import shard_dataloader
from mixprec.distributed import DistributedState, gather_for_metrics


def _states(world):
    return [DistributedState(rank=r, world_size=world, local_rank=r, local_world_size=world) for r in range(world)]


def _ids(loader):
    return [batch[0].tolist() for batch in loader]


def _dataset(n):
    return TensorDataset(torch.arange(n))


def test_even_dataset_each_sample_once():
    loaders = [shard_dataloader(DataLoader(_dataset(16), batch_size=4), s) for s in _states(2)]
    per_rank = [_ids(ld) for ld in loaders]
    assert per_rank == [[[0, 1, 2, 3], [8, 9, 10, 11]], [[4, 5, 6, 7], [12, 13, 14, 15]]]
    assert all(len(ld) == 2 for ld in loaders)
    assert loaders[0].batch_sampler.remainder == 8 and loaders[0].batch_sampler.total_dataset_length == 16


def test_uneven_dataset_duplicates_only_at_the_tail():
    world, n = 3, 23
    loaders = [shard_dataloader(DataLoader(_dataset(n), batch_size=4), s) for s in _states(world)]
    per_rank = [_ids(ld) for ld in loaders]
    assert {len(b) for batches in per_rank for b in batches} == {4}  # every batch full
    assert len({len(b) for b in per_rank}) == 1  # same number of batches on every rank
    steps = len(per_rank[0])
    order = [x for k in range(steps) for r in range(world) for x in per_rank[r][k]]
    assert order[:n] == list(range(n))  # gathered global batches restore the dataset order
    assert order[n:] == list(range(len(order) - n))  # the tail wraps to the start
    assert loaders[0].batch_sampler.remainder == n - (steps - 1) * 12 == 11


def test_tiny_dataset_wraps_repeatedly():
    loaders = [shard_dataloader(DataLoader(_dataset(3), batch_size=4), s) for s in _states(2)]
    assert [_ids(ld) for ld in loaders] == [[[0, 1, 2, 0]], [[1, 2, 0, 1]]]
    assert loaders[1].batch_sampler.remainder == 3


def test_uneven_batches_and_drop_last():
    uneven = [_ids(shard_dataloader(DataLoader(_dataset(10), batch_size=4), s, even_batches=False)) for s in _states(2)]
    assert uneven == [[[0, 1, 2, 3], [8, 9]], [[4, 5, 6, 7]]]
    dropped = [shard_dataloader(DataLoader(_dataset(10), batch_size=4, drop_last=True), s) for s in _states(2)]
    assert [_ids(ld) for ld in dropped] == [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]
    assert [len(ld) for ld in dropped] == [1, 1]


def test_split_batches():
    loaders = [shard_dataloader(DataLoader(_dataset(10), batch_size=4), s, split_batches=True) for s in _states(2)]
    assert [_ids(ld) for ld in loaders] == [[[0, 1], [4, 5], [8, 9]], [[2, 3], [6, 7], [0, 1]]]
    assert loaders[0].batch_sampler.remainder == 2
    with pytest.raises(ValueError, match="batch_size=5 over 2 processes"):
        shard_dataloader(DataLoader(_dataset(10), batch_size=5), _states(2)[0], split_batches=True)


def test_settings_are_kept():
    def collate(items):
        return torch.stack([i[0] for i in items]) * 10

    original = DataLoader(_dataset(8), batch_size=2, collate_fn=collate, num_workers=1, pin_memory=False, timeout=30)
    loader = shard_dataloader(original, _states(2)[1])
    assert loader.collate_fn is collate and loader.num_workers == 1 and loader.timeout == 30
    assert loader.dataset is original.dataset
    assert [b.tolist() for b in loader] == [[20, 30], [60, 70]]


def test_shuffle_is_seeded_and_epoch_dependent():
    states = _states(2)
    loaders = [shard_dataloader(DataLoader(_dataset(20), batch_size=5, shuffle=True), s, seed=7) for s in states]

    def epoch(e):
        for ld in loaders:
            ld.batch_sampler.set_epoch(e)
        per_rank = [_ids(ld) for ld in loaders]
        return [x for k in range(2) for r in range(2) for x in per_rank[r][k]]

    e0, e0_again, e1 = epoch(0), epoch(0), epoch(1)
    assert sorted(e0) == list(range(20)) and sorted(e1) == list(range(20))
    assert e0 == e0_again and e0 != e1 and e0 != list(range(20))


class _Stream(IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self):
        return self.n


def test_iterable_dataset_shards_each_global_batch():
    loaders = [shard_dataloader(DataLoader(_Stream(10), batch_size=2), s) for s in _states(2)]
    assert [[b.tolist() for b in ld] for ld in loaders] == [[[0, 1], [4, 5], [8, 9]], [[2, 3], [6, 7], [0, 1]]]
    assert loaders[0].dataset.remainder == 2


def test_errors_name_the_fix():
    with pytest.raises(TypeError, match="needs a torch.utils.data.DataLoader, got list"):
        shard_dataloader([1, 2], _states(2)[0])
    with pytest.raises(ValueError, match="does not yield batches; give the DataLoader a batch_size"):
        shard_dataloader(DataLoader(_dataset(8), batch_size=None), _states(2)[0])
    with pytest.raises(ValueError, match="seed=3 only applies to shuffling loaders"):
        shard_dataloader(DataLoader(_dataset(8), batch_size=2), _states(2)[0], seed=3)


def test_custom_batch_sampler_is_sharded_batch_by_batch():
    ds = _dataset(22)
    batches = [list(range(i, min(i + 4, 22))) for i in range(0, 22, 4)]  # 6 batches, the last of 2
    loaders = [shard_dataloader(DataLoader(ds, batch_sampler=batches), s) for s in _states(2)]
    per_rank = [_ids(ld) for ld in loaders]
    assert per_rank[0] == [batches[0], batches[2], batches[4]]
    # The short last batch is completed from the start of the pass: same batch size everywhere.
    assert per_rank[1] == [batches[1], batches[3], [20, 21, 0, 1]]
    assert loaders[1].batch_sampler.remainder == 6 and len(loaders[0]) == len(loaders[1]) == 3
    # A missing last batch on some ranks is made from the first indices too.
    odd = [shard_dataloader(DataLoader(ds, batch_sampler=batches[:5]), s) for s in _states(2)]
    assert [_ids(ld)[-1] for ld in odd] == [[16, 17, 18, 19], [0, 1, 2, 3]]
    assert odd[0].batch_sampler.remainder == 4
    uneven = [shard_dataloader(DataLoader(ds, batch_sampler=batches[:5]), s, even_batches=False) for s in _states(2)]
    assert [len(_ids(ld)) for ld in uneven] == [3, 2] == [len(ld) for ld in uneven]
    split = [shard_dataloader(DataLoader(ds, batch_sampler=batches[:2]), s, split_batches=True) for s in _states(2)]
    assert [_ids(ld) for ld in split] == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]


def test_batch_sampler_given_as_sampler():
    from torch.utils.data import BatchSampler, SequentialSampler

    class Rows(torch.utils.data.Dataset):  # indexed with a list of indices, returns a batch
        def __len__(self):
            return 10

        def __getitem__(self, idx):
            return torch.tensor(idx)

    sampler = BatchSampler(SequentialSampler(range(10)), 4, False)
    loaders = [shard_dataloader(DataLoader(Rows(), sampler=sampler, batch_size=None), s) for s in _states(2)]
    assert [[b.tolist() for b in ld] for ld in loaders] == [[[0, 1, 2, 3], [8, 9, 0, 1]], [[4, 5, 6, 7], [2, 3, 4, 5]]]


def _eval_uneven(state, n):
    loader = shard_dataloader(DataLoader(TensorDataset(torch.arange(n) * 3), batch_size=4), state)
    seen = []
    for step, (x,) in enumerate(loader):
        last = step == len(loader) - 1
        seen.append(gather_for_metrics(state, x, loader.batch_sampler.remainder if last else None))
    return torch.cat(seen).tolist()


def _shuffled_epochs(state):
    # seed=None: the order comes from a generator seeded by rank 0 and synchronised at every
    # pass; torch's RNG differs per rank on purpose. No set_epoch: each pass draws anew.
    torch.manual_seed(1000 + state.rank)
    loader = shard_dataloader(DataLoader(_dataset(12), batch_size=3, shuffle=True), state)
    out = []
    for _ in range(2):
        out.append(torch.cat(gather_for_metrics(state, [b for (b,) in loader], None)).tolist())
    return out


def test_gather_for_metrics_returns_exactly_the_dataset():
    n = 13
    results = run_distributed(_eval_uneven, 2, args=(n,))
    assert results[0] == results[1] == [3 * i for i in range(n)]


def test_shuffle_identical_across_ranks_and_changes_with_epoch():
    results = run_distributed(_shuffled_epochs, 2)
    assert results[0] == results[1]
    e0, e1 = results[0]
    assert sorted(e0) == sorted(e1) == list(range(12)) and e0 != e1

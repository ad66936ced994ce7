"""The two silent differences of issue #15, on two processes: the shuffle order of a prepared
loader (a new order every epoch, the single-process order, the same on every rank) and how
often a prepared scheduler steps (Accelerate's rule by default, mixprec's old rule on request)."""

import pytest
from harness import run_distributed


def _orders(state, split_batches, use_generator):
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from mixprec import Accelerator, DataLoaderConfiguration

    acc = Accelerator(cpu=True, log_policy=False,
                      dataloader_config=DataLoaderConfiguration(split_batches=split_batches))
    dataset = TensorDataset(torch.arange(24))
    per_rank = 6 if split_batches else 3
    generator = torch.Generator().manual_seed(5) if use_generator else None
    loader = acc.prepare(DataLoader(dataset, batch_size=per_rank, shuffle=True, generator=generator))
    epochs = []
    for _ in range(3):  # no set_epoch: the order must change anyway
        epochs.append(torch.cat([acc.gather(x) for (x,) in loader]).tolist())
    return epochs


@pytest.mark.parametrize("split_batches", [False, True])
def test_shuffle_changes_every_epoch_and_matches_one_process(split_batches):
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    r0, r1 = run_distributed(_orders, 2, args=(split_batches, True))
    assert r0 == r1  # every rank gathered the same global order
    assert len({tuple(e) for e in r0}) == 3, "the shuffle order repeated across epochs"
    # A single process iterating the original loader (global batch of 6) sees the same order.
    single = DataLoader(TensorDataset(torch.arange(24)), batch_size=6, shuffle=True,
                        generator=torch.Generator().manual_seed(5))
    expected = [torch.cat([x for (x,) in single]).tolist() for _ in range(3)]
    assert r0 == expected


def test_shuffle_without_generator_is_synchronised_and_changes():
    r0, r1 = run_distributed(_orders, 2, args=(False, False))
    assert r0 == r1
    assert all(sorted(e) == list(range(24)) for e in r0)
    assert len({tuple(e) for e in r0}) == 3


def _lrs(state, rule, split_batches, skip_at):
    import torch

    from mixprec import Accelerator, DataLoaderConfiguration

    kwargs = {} if rule is None else {"scheduler_step_rule": rule}
    acc = Accelerator(cpu=True, log_policy=False, gradient_accumulation_steps=2,
                      dataloader_config=DataLoaderConfiguration(split_batches=split_batches), **kwargs)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    model, opt, sched = acc.prepare(model, opt, sched)
    lrs = []
    for i in range(6):
        with acc.accumulate(model):
            x = torch.ones(4, 2)
            if i == skip_at:
                x = x * float("inf")  # a non-finite gradient: the step is skipped
            acc.backward(model(x).sum())
            opt.step()
            sched.step()
            opt.zero_grad()
        lrs.append(sched.get_last_lr()[0])
    return lrs, sched.scheduler.last_epoch


def test_scheduler_steps_num_processes_times_by_default():
    (lrs, last), _ = run_distributed(_lrs, 2, args=(None, False, None))
    # 6 micro-batches, 2 per optimizer step: 3 steps, each advancing the schedule twice.
    assert last == 6
    assert lrs == pytest.approx([1.0, 1 / 3, 1 / 3, 1 / 5, 1 / 5, 1 / 7])


def test_scheduler_steps_once_with_split_batches_or_the_optimizer_rule():
    (lrs_split, last_split), _ = run_distributed(_lrs, 2, args=(None, True, None))
    (lrs_rule, last_rule), _ = run_distributed(_lrs, 2, args=("optimizer", False, None))
    assert last_split == last_rule == 3
    assert lrs_split == lrs_rule == pytest.approx([1.0, 1 / 2, 1 / 2, 1 / 3, 1 / 3, 1 / 4])


def test_scheduler_does_not_step_after_a_skipped_step():
    (lrs, last), _ = run_distributed(_lrs, 2, args=(None, False, 2))  # micro-batch 2: inside step 2
    assert last == 4  # steps 1 and 3 advanced it twice each; the skipped step 2 did not


def test_bad_scheduler_rule_names_the_choices():
    from mixprec import Accelerator

    with pytest.raises(ValueError, match="scheduler_step_rule='sometimes'.*'accelerate'.*'optimizer'"):
        Accelerator(cpu=True, scheduler_step_rule="sometimes")

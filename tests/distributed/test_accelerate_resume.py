"""Accelerate's resume idiom (transformers' run_*_no_trainer.py, issue #36 point 2) on 2
processes, on ddp, zero2, zero3 and fsdp.

The scripts resume with ``accelerator.load_state(ckpt)`` followed by
``accelerator.skip_first_batches(train_dataloader, resume_step)`` for the checkpointed
epoch, and the plain ``train_dataloader`` for the next ones. The resumed run must see
exactly the uninterrupted run's batches, in that epoch and the next, and end at the same
loss. A loop without ``skip_first_batches`` keeps mixprec's positioned resume, also from a
checkpoint saved inside a ``skip_first_batches`` pass.

One harness call (warm ranks, tests/distributed/harness.py) runs every backend; the
assertions are made here on what the ranks return.
"""

from __future__ import annotations

import pytest
from harness import run_distributed

BACKENDS = ["ddp", "zero2", "zero3", "fsdp"]
N = 40  # samples; batches of 2 per rank on 2 ranks: 10 batches per epoch
EPOCHS = 2
SAVE_AT = 3  # the scripts' checkpointing_steps: save after this many batches of epoch 0
SAVE_AGAIN_AT = 6  # a second checkpoint, taken inside the resumed (skipping) pass


def _uninterrupted(prepared, step, save_at: int, path: str) -> list:
    """``EPOCHS`` epochs of ``step`` over the prepared loader, ``save_state(path)`` after batch
    ``save_at`` of the first (as the scripts checkpoint by steps); the steps' records."""
    acc, model, opt, loader = prepared
    full = []
    for epoch in range(EPOCHS):
        for i, batch in enumerate(loader):
            full.append(step(acc, model, opt, batch))
            if epoch == 0 and i + 1 == save_at:
                acc.save_state(path)
    acc.end_training()
    return full


def _runs(state, backends, ckpt):
    import torch
    from torch.utils.data import DataLoader, Dataset

    from mixprec import Accelerator
    from mixprec.utils import set_seed

    class Rows(Dataset):
        def __len__(self):
            return N

        def __getitem__(self, i):
            g = torch.Generator().manual_seed(i)
            return {"index": i, "x": torch.randn(4, generator=g), "y": torch.randn(1, generator=g)}

    def setup(backend):
        set_seed(0)  # the scripts seed first; the ranks then share every RNG state
        acc = Accelerator(cpu=True, backend=backend, log_policy=False)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loader = DataLoader(Rows(), batch_size=2, shuffle=True)
        model, opt, loader = acc.prepare(model, opt, loader)
        return acc, model, opt, loader

    def step(acc, model, opt, batch):
        loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        return batch["index"].tolist(), float(loss.detach())

    out = {}
    for backend in backends:
        where = f"{ckpt}/{backend}"
        # The uninterrupted run, checkpointing by steps as the scripts do.
        full = _uninterrupted(setup(backend), step, SAVE_AT, f"{where}/step_{SAVE_AT}")

        # The scripts' resume: load_state, then skip_first_batches for the checkpointed epoch.
        acc, model, opt, loader = setup(backend)
        acc.load_state(f"{where}/step_{SAVE_AT}")
        resumed = []
        for epoch in range(EPOCHS):
            active = acc.skip_first_batches(loader, SAVE_AT) if epoch == 0 else loader
            for i, batch in enumerate(active):
                resumed.append(step(acc, model, opt, batch))
                if epoch == 0 and SAVE_AT + i + 1 == SAVE_AGAIN_AT:
                    acc.save_state(f"{where}/step_{SAVE_AGAIN_AT}")
        acc.end_training()

        # mixprec's positioned resume (no skip_first_batches), from the checkpoint saved
        # inside the skipping pass.
        acc, model, opt, loader = setup(backend)
        acc.load_state(f"{where}/step_{SAVE_AGAIN_AT}")
        positioned = [step(acc, model, opt, batch) for _ in range(EPOCHS) for batch in loader]
        acc.end_training()
        out[backend] = {"full": full, "resumed": resumed, "positioned": positioned}
    return out


def test_load_state_then_skip_first_batches_gives_the_uninterrupted_batches(tmp_path):
    results = run_distributed(_runs, 2, args=(BACKENDS, str(tmp_path)), timeout=300)
    per_epoch = N // 4
    for rank, r in enumerate(results):
        for backend in BACKENDS:
            full, resumed, positioned = (r[backend][k] for k in ("full", "resumed", "positioned"))
            assert len(full) == EPOCHS * per_epoch
            where = f"rank {rank}, {backend}"
            # The two epochs draw different orders (else the test could not tell them apart).
            assert [b for b, _ in full[:per_epoch]] != [b for b, _ in full[per_epoch:]], where
            # Same batches from the checkpoint on, in the checkpointed epoch and the next ...
            assert [b for b, _ in resumed] == [b for b, _ in full[SAVE_AT:]], where
            assert [b for b, _ in positioned] == [b for b, _ in full[SAVE_AGAIN_AT:]], where
            # ... and the same losses to the last bit (weights, optimizer state restored).
            assert [x for _, x in resumed] == [x for _, x in full[SAVE_AT:]], where
            assert [x for _, x in positioned] == [x for _, x in full[SAVE_AGAIN_AT:]], where
    # Every rank saw its own share: the two ranks' batches differ.
    assert [b for b, _ in results[0]["ddp"]["full"]] != [b for b, _ in results[1]["ddp"]["full"]]


IDIOM_BACKENDS = ["ddp", "zero2", "zero3", "fsdp"]
SAVE_EVERY = 6  # checkpointing_steps: step_6 is inside epoch 0 (10 steps per epoch)


def _idioms(state, backends, out):
    """transformers' run_clm_no_trainer.py loop, its idioms in its order, on a tiny GPT-2
    (tied input/output embeddings): set_seed, get_logger, DistributedType checks,
    checkpointing by steps, load_state + skip_first_batches, unwrap_model().save_pretrained(
    is_main_process=..., save_function=accelerator.save) on every rank, end_training. An
    uninterrupted run, then one resumed from step_6."""
    import torch
    from torch.utils.data import DataLoader
    from transformers import GPT2Config, GPT2LMHeadModel

    from mixprec import Accelerator, DistributedType
    from mixprec.logging import get_logger
    from mixprec.utils import set_seed

    logger = get_logger("idioms")
    g = torch.Generator().manual_seed(7)
    data = [{"input_ids": torch.randint(0, 64, (12,), generator=g)} for _ in range(N)]
    results = {}
    for backend in backends:
        runs = {}
        engine, _, tp = backend.partition("+tp")
        config = {"tensor_parallel": {"size": int(tp)}} if tp else None
        for mode in ("full", "resumed"):
            set_seed(0)
            accelerator = Accelerator(cpu=True, backend=engine, config=config, log_policy=False)
            model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=16))
            train_dataloader = DataLoader(data, shuffle=True, batch_size=2)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            model, optimizer, train_dataloader = accelerator.prepare(model, optimizer, train_dataloader)
            if accelerator.distributed_type == DistributedType.TPU:  # the scripts' line (an alias of XLA)
                model.tie_weights()
            starting_epoch, resume_step, completed_steps = 0, None, 0
            if mode == "resumed":
                accelerator.load_state(f"{out}/{backend}/step_{SAVE_EVERY}")
                resume_step = SAVE_EVERY  # the scripts read it from the folder's name
                starting_epoch = resume_step // len(train_dataloader)
                completed_steps = resume_step
                resume_step -= starting_epoch * len(train_dataloader)
            losses = {}
            for epoch in range(starting_epoch, EPOCHS):
                model.train()
                if mode == "resumed" and epoch == starting_epoch and resume_step is not None:
                    active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
                else:
                    active_dataloader = train_dataloader
                for batch in active_dataloader:
                    with accelerator.accumulate(model):
                        loss = model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
                        accelerator.backward(loss)
                        optimizer.step()
                        optimizer.zero_grad()
                    if accelerator.sync_gradients:
                        completed_steps += 1
                        losses[completed_steps] = float(loss.detach())
                    if mode == "full" and completed_steps % SAVE_EVERY == 0:
                        accelerator.save_state(f"{out}/{backend}/step_{completed_steps}")
                logger.info("epoch %d: loss %.4f", epoch, losses[completed_steps])
            accelerator.wait_for_everyone()
            unwrapped_model = accelerator.unwrap_model(model)
            unwrapped_model.save_pretrained(f"{out}/{backend}/{mode}", is_main_process=accelerator.is_main_process,
                                            save_function=accelerator.save)
            full = accelerator.get_state_dict(model)
            saved = None
            if accelerator.is_main_process:
                loaded = GPT2LMHeadModel.from_pretrained(f"{out}/{backend}/{mode}").state_dict()
                saved = sorted(loaded) == sorted(full) and all(torch.equal(loaded[k], full[k].float()) for k in full)
            if tp and engine == "ddp" and accelerator.is_main_process:
                # The split really happened: each rank holds half of c_attn's 48 output columns.
                saved = saved and tuple(model.transformer.h[0].attn.c_attn.weight.shape) == (16, 24)
            runs[mode] = {"losses": losses, "saved": saved, "type": str(accelerator.distributed_type.value)}
            accelerator.end_training()
        results[backend] = runs
    return results


def test_the_no_trainer_idioms_resume_and_save_on_every_backend(tmp_path):
    """Issue #36 points 2, 3 and 9: the resumed run's losses are the uninterrupted run's
    from the checkpoint on (to the bit), and save_pretrained called on every rank writes
    the full weights (zero3/fsdp included), equal to get_state_dict, loadable with
    from_pretrained."""
    pytest.importorskip("transformers")
    results = run_distributed(_idioms, 2, args=(IDIOM_BACKENDS, str(tmp_path)), timeout=400)
    _check_idioms(results, IDIOM_BACKENDS, steps=EPOCHS * N // 4)
    for r in results:
        for backend in IDIOM_BACKENDS:
            expected = {"ddp": "MULTI_CPU", "zero2": "MULTI_CPU", "zero3": "FSDP", "fsdp": "FSDP"}[backend]  # compat/state.py
            assert r[backend]["full"]["type"] == expected, (backend, r[backend]["full"]["type"])


def _check_idioms(results, backends, steps):
    """Every step's loss recorded; the resumed run's losses equal the uninterrupted run's
    after the checkpoint; rank 0 found save_pretrained's folder equal to get_state_dict."""
    for rank, r in enumerate(results):
        for backend in backends:
            full, resumed = r[backend]["full"], r[backend]["resumed"]
            assert sorted(full["losses"]) == list(range(1, steps + 1)), (backend, full)
            assert resumed["losses"] == {k: v for k, v in full["losses"].items() if k > SAVE_EVERY}, (rank, backend)
            if rank == 0:
                assert full["saved"] is True and resumed["saved"] is True, (backend, full["saved"], resumed["saved"])


TP_IDIOM_BACKENDS = ["ddp+tp2", "zero3+tp2"]


def test_the_no_trainer_idioms_resume_and_save_under_tensor_parallelism(tmp_path):
    """Issue #36 point 3 under TP (2 processes, TP=2, GPT-2's Conv1D split by the gpt2
    preset): save_pretrained called on every rank writes the whole, unsplit weights, equal to
    get_state_dict and loadable with from_pretrained; the resumed run's losses are the
    uninterrupted run's to the bit."""
    pytest.importorskip("transformers")
    results = run_distributed(_idioms, 2, args=(TP_IDIOM_BACKENDS, str(tmp_path)), timeout=400)
    _check_idioms(results, TP_IDIOM_BACKENDS, steps=EPOCHS * N // 2)  # dp size 1: N/2 steps an epoch
    # TP ranks compute one model: the same losses on both.
    assert results[0]["ddp+tp2"]["full"]["losses"] == results[1]["ddp+tp2"]["full"]["losses"]


RANDOM_COLLATE_BACKENDS = ["ddp", "zero2"]
RC_N = 48  # samples; batches of 2 per rank on 2 ranks: 12 batches per epoch
RC_SAVE_AT = 5


def _random_collate_runs(state, backends, ckpt):
    """Issue #48 point 3: transformers' DataCollatorForLanguageModeling masks at random, from
    torch's global RNG, while the loop's dropout draws from it too. A collate_fn drawing from
    torch (bernoulli/rand masks), python's ``random`` and numpy, and a model with dropout; an
    uninterrupted run saving after RC_SAVE_AT batches, then the scripts' resume (load_state +
    skip_first_batches) and mixprec's positioned one (load_state only)."""
    import random

    import numpy as np
    import torch
    from torch.utils.data import DataLoader

    from mixprec import Accelerator
    from mixprec.utils import set_seed

    def collate(rows):
        x = torch.stack([r["x"] for r in rows])
        mask = torch.bernoulli(torch.full(x.shape, 0.3))
        return {"index": torch.tensor([r["index"] for r in rows]), "x": x * (1 - mask) + mask * torch.rand(x.shape),
                "py": torch.tensor([random.random() for _ in rows]),
                "np": torch.from_numpy(np.random.rand(len(rows)))}

    g = torch.Generator().manual_seed(3)
    data = [{"index": i, "x": torch.randn(4, generator=g)} for i in range(RC_N)]

    def setup(backend):
        set_seed(0)
        acc = Accelerator(cpu=True, backend=backend, log_policy=False)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loader = DataLoader(data, batch_size=2, shuffle=True, collate_fn=collate)
        model, opt, loader = acc.prepare(model, opt, loader)
        return acc, model, opt, loader

    def step(acc, model, opt, batch):
        loss = model(batch["x"]).square().mean()
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        seen = torch.cat([batch["x"].flatten(), batch["py"], batch["np"].float()])
        return batch["index"].tolist(), seen.tolist(), float(loss.detach())

    out = {}
    for backend in backends:
        where = f"{ckpt}/rc-{backend}"
        full = _uninterrupted(setup(backend), step, RC_SAVE_AT, f"{where}/step_{RC_SAVE_AT}")

        acc, model, opt, loader = setup(backend)
        acc.load_state(f"{where}/step_{RC_SAVE_AT}")
        skipped = []
        for epoch in range(EPOCHS):
            active = acc.skip_first_batches(loader, RC_SAVE_AT) if epoch == 0 else loader
            skipped.extend(step(acc, model, opt, batch) for batch in active)
        acc.end_training()

        acc, model, opt, loader = setup(backend)
        acc.load_state(f"{where}/step_{RC_SAVE_AT}")
        positioned = [step(acc, model, opt, batch) for _ in range(EPOCHS) for batch in loader]
        acc.end_training()
        out[backend] = {"full": full, "skipped": skipped, "positioned": positioned}
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_resume_repeats_the_batches_of_a_collate_fn_that_draws_random_numbers(tmp_path, world):
    """The resumed batches, masks and losses equal the uninterrupted run's to the bit, in the
    checkpointed epoch and the next, though the collate_fn drew random numbers for the
    batch read ahead before save_state captured the RNG (issue #48 point 3; [Note: the
    batch read ahead] in src/mixprec/checkpoint/dataloader.py)."""
    backends = RANDOM_COLLATE_BACKENDS if world == 2 else ["ddp"]
    results = run_distributed(_random_collate_runs, world, args=(backends, str(tmp_path)), timeout=300)
    for rank, r in enumerate(results):
        for backend in backends:
            full = r[backend]["full"]
            assert len(full) == EPOCHS * RC_N // (2 * world)
            for mode in ("skipped", "positioned"):
                got, where = r[backend][mode], f"rank {rank}, {backend}, {mode}"
                assert [b[0] for b in got] == [b[0] for b in full[RC_SAVE_AT:]], where  # the same samples
                for k, (a, b) in enumerate(zip(got, full[RC_SAVE_AT:])):
                    assert a[1] == b[1], f"{where}: batch {RC_SAVE_AT + k + 1}'s random draws differ"
                assert [b[2] for b in got] == [b[2] for b in full[RC_SAVE_AT:]], where

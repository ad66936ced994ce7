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

from harness import run_distributed

BACKENDS = ["ddp", "zero2", "zero3", "fsdp"]
N = 40  # samples; batches of 2 per rank on 2 ranks: 10 batches per epoch
EPOCHS = 2
SAVE_AT = 3  # the scripts' checkpointing_steps: save after this many batches of epoch 0
SAVE_AGAIN_AT = 6  # a second checkpoint, taken inside the resumed (skipping) pass


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
        acc, model, opt, loader = setup(backend)
        full = []
        for epoch in range(EPOCHS):
            for i, batch in enumerate(loader):
                full.append(step(acc, model, opt, batch))
                if epoch == 0 and i + 1 == SAVE_AT:
                    acc.save_state(f"{where}/step_{SAVE_AT}")
        acc.end_training()

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

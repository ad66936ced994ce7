"""What the ranks of tests/distributed/test_trainer.py run: transformers' Trainer, stock
(on Accelerate) or mixprec's (src/mixprec/integrations/transformers.py), on a tiny GPT-2.

Each run returns plain data (logged losses and gradient norms, the global batches it
trained on, the final weights gathered whole) so the test asserts in the parent process.
"""

from __future__ import annotations

import os
import shutil

STEPS = 12
SAVE_AT = 6
PER_RANK = 4  # training rows per rank and step
SEQ = 16
VOCAB = 128


def tiny_gpt2(dropout: float = 0.0):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=dropout,
                     embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def build_model(seed: int = 0, dropout: float = 0.0):
    from transformers import set_seed

    set_seed(seed)
    return tiny_gpt2(dropout)


class Rows:
    """``n`` rows of ``SEQ`` random token ids (fixed by ``seed``)."""

    def __init__(self, n: int, seed: int) -> None:
        import torch

        g = torch.Generator().manual_seed(seed)
        self.x = torch.randint(1, VOCAB, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i]}


def random_collate(rows: list) -> dict:
    """A collator that draws from torch's global RNG, as transformers' masking collators do:
    about 15% of the labels become -100."""
    import torch

    ids = torch.stack([r["input_ids"] for r in rows])
    labels = ids.clone()
    labels[torch.rand(ids.shape) < 0.15] = -100
    return {"input_ids": ids, "labels": labels}


def plain_collate(rows: list) -> dict:
    import torch

    ids = torch.stack([r["input_ids"] for r in rows])
    return {"input_ids": ids, "labels": ids.clone()}


def training_args(out: str, **kw):
    from transformers import TrainingArguments

    base = dict(output_dir=out, max_steps=STEPS, per_device_train_batch_size=PER_RANK, per_device_eval_batch_size=3,
                learning_rate=1e-3, save_steps=SAVE_AT, logging_steps=1, report_to=[], use_cpu=True, seed=0,
                disable_tqdm=True, max_grad_norm=1.0, save_strategy="steps")
    base.update(kw)
    return TrainingArguments(**base)


def make_trainer(kind: str, model, args, *, mixprec_config=None, collate=plain_collate, train=None, eval_rows=None,
                 cls=None, **kw):
    """``kind``: ``"stock"`` (transformers' Trainer on Accelerate) or ``"mixprec"``."""
    import transformers

    if kind == "stock":
        trainer_cls = cls or transformers.Trainer
        extra = {}
    else:
        from mixprec.integrations.transformers import mixprec_trainer

        trainer_cls = mixprec_trainer(cls or transformers.Trainer)
        extra = {"mixprec_config": mixprec_config}
    return trainer_cls(model=model, args=args, train_dataset=train if train is not None else Rows(96, 1),
                       eval_dataset=eval_rows, data_collator=collate, **extra, **kw)


class BatchRecorder:
    """Wraps ``trainer.training_step`` to keep every micro-batch this rank trained on."""

    def __init__(self, trainer) -> None:
        self.batches = []
        inner = trainer.training_step

        def step(model, inputs, *a, **k):
            self.batches.append({k2: v.clone() for k2, v in inputs.items()})
            return inner(model, inputs, *a, **k)

        trainer.training_step = step


def logged(trainer) -> dict:
    hist = trainer.state.log_history
    return {"loss": [h["loss"] for h in hist if "loss" in h],
            "grad_norm": [float(h["grad_norm"]) for h in hist if "grad_norm" in h],
            "lr": [h["learning_rate"] for h in hist if "learning_rate" in h],
            "log": [dict(h) for h in hist]}


def whole_state(trainer) -> dict:
    """The trained model's full weights (gathered on every rank for the sharded backends)."""
    acc = trainer.accelerator
    model = trainer.model
    if hasattr(acc, "get_state_dict"):
        state = acc.get_state_dict(model)
        if state:
            return {k: v.detach().clone() for k, v in state.items()}
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def global_batches(recorder, trainer) -> list:
    """The global batches of each step, in rank order of the data-parallel ranks: every
    rank's micro-batches gathered (ranks of one TP/SP group hold the same batch: one kept)."""
    import torch
    import torch.distributed as dist

    mesh = getattr(trainer.accelerator, "mesh", None)
    keep = mesh is None or (mesh.tp_rank == 0 and mesh.sp_rank == 0)
    mine = [b["input_ids"] for b in recorder.batches] if keep else None
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    parts = [p for p in every if p is not None]
    return [torch.cat([p[i] for p in parts]) for i in range(len(parts[0]))]


def end(trainer) -> None:
    """Release a mixprec Accelerator's engine (the process group stays: the next run of the
    same harness call uses it; the harness ends the Accelerators at the call's end)."""
    acc = trainer.accelerator
    if type(acc).__module__.startswith("mixprec"):
        acc._ended = True
        acc.engine.release()


def fresh_dir(path: str) -> str:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
    dist.barrier()
    return path


def tiny_tokenizer():
    """A word-level tokenizer over ``VOCAB`` ids (no Hub: built here), pad id 0."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, **{f"t{i}": i for i in range(1, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<pad>")


def sft_trainer(kind: str, out: str, mixprec_config=None):
    """TRL's SFTTrainer (stock, or through mixprec_trainer) on pre-tokenized rows of equal
    length: labels are the inputs, no padding."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    rows = Rows(96, 1)
    data = Dataset.from_dict({"input_ids": [r.tolist() for r in rows.x]})
    args = SFTConfig(output_dir=out, max_steps=STEPS, per_device_train_batch_size=PER_RANK, learning_rate=1e-3,
                     logging_steps=1, report_to=[], use_cpu=True, seed=0, disable_tqdm=True, max_grad_norm=1.0,
                     save_strategy="no", max_length=SEQ, packing=False, dataset_num_proc=None)
    cls = SFTTrainer
    extra = {}
    if kind == "mixprec":
        from mixprec.integrations.transformers import mixprec_trainer

        cls = mixprec_trainer(SFTTrainer)
        extra["mixprec_config"] = mixprec_config
    return cls(model=build_model(), args=args, train_dataset=data, processing_class=tiny_tokenizer(), **extra)

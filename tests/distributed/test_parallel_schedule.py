"""The LR schedule under tensor and sequence parallelism (issue #35, deliver point 5).

A prepared scheduler advances once per batch read in the step, Accelerate's rule: every
data-parallel rank read its own batch, the ranks of one TP/SP group shared theirs. So a
schedule written in one process's batches (a linear decay to 0 over ``len(loader)`` steps)
ends exactly with the epoch at any TP/SP size, as on one process ([Note: the schedule counts
data-parallel batches] in src/mixprec/wrappers/scheduler.py). Before, the scheduler advanced
``num_processes`` times per step: TP=2 or SP=2 on 2 processes ended the decay halfway
through the epoch and stepped the schedule twice as far as one process.

Each case trains a tiny HF Llama for one epoch of 16 sequences (batch 1) and records the
learning rate after every optimizer step; the reference is the same LambdaLR stepped once per
batch (or once per ``accum`` batches) in one process: rank ``r``'s ``k``-th rate must be the
one-process rate after ``k * dp`` batches' steps, bit for bit, and the last one 0.
"""

import pytest

from harness import run_distributed

SAMPLES = 16
SEQ = 8


def _model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, tie_word_embeddings=False, attn_implementation="sdpa"))


def _decay(total: int):
    return lambda step: max(0.0, 1.0 - step / total)


def _one_process(total: int) -> list:
    """The learning rate after each of ``total`` scheduler steps, plain PyTorch."""
    import torch

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _decay(total))
    out = []
    for _ in range(total):
        opt.step()
        sched.step()
        out.append(sched.get_last_lr()[0])
    return out


def _epoch(state, cases):
    import gc

    import torch

    from mixprec import Accelerator

    out = {}
    for name, (parallel, accum) in cases.items():
        acc = Accelerator(cpu=True, log_policy=False, backend="ddp", gradient_accumulation_steps=accum,
                          config=parallel)
        data = [torch.arange(i, i + SEQ) % 64 for i in range(SAMPLES)]
        plain = torch.utils.data.DataLoader(data, batch_size=1)
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        total = len(plain) // accum  # the schedule, in one process's optimizer steps
        sched = torch.optim.lr_scheduler.LambdaLR(opt, _decay(total))
        model, opt, loader, sched = acc.prepare(model, opt, plain, sched)
        lrs = []
        for ids in loader:
            with acc.accumulate(model):
                batch = acc.prepare_sp_inputs(input_ids=ids, labels=ids)
                acc.backward(model(**batch).loss)
                opt.step()
                sched.step()
                opt.zero_grad()
                if acc.sync_gradients:
                    lrs.append(sched.get_last_lr()[0])
        mesh = acc.mesh
        out[name] = {"lrs": lrs, "last_epoch": sched.last_epoch, "total": total, "batches": len(loader),
                     "dp": acc.num_processes if mesh is None else mesh.dp_size, "num_processes": acc.num_processes,
                     "reference": _one_process(total)}
        del acc, model, opt, loader, sched
        gc.collect()
    return out


def _check(results, world):
    for rank, out in enumerate(results):
        for name, r in out.items():
            assert not isinstance(r, str), (name, r)
            dp, total = r["dp"], r["total"]
            assert r["num_processes"] == world, (name, r["num_processes"])  # Accelerate's meaning kept
            assert r["batches"] == SAMPLES // dp, (name, r["batches"])
            # The k-th optimizer step of this rank is the (k * dp)-th of one process.
            expected = r["reference"][dp - 1::dp]
            assert r["lrs"] == expected, (rank, name, r["lrs"], expected)
            assert r["lrs"][-1] == 0.0 and r["lrs"][-2] > 0.0, (rank, name, r["lrs"])
            assert r["last_epoch"] == total, (rank, name, r["last_epoch"], total)  # ended exactly once


def test_one_epoch_ends_the_schedule_on_two_processes():
    """2 processes: DP=2 (Accelerate's rule, unchanged), TP=2, SP=2, SP=2 with 2-step
    accumulation: each ends a one-epoch decay exactly at the epoch's last step."""
    pytest.importorskip("transformers")
    cases = {
        "ddp": ({}, 1),
        "tp2": ({"tensor_parallel": {"size": 2}}, 1),
        "sp2": ({"sequence_parallel": {"size": 2}}, 1),
        "sp2-accumulate2": ({"sequence_parallel": {"size": 2}}, 2),
        "tp2-accumulate2": ({"tensor_parallel": {"size": 2}}, 2),
    }
    results = run_distributed(_epoch, 2, args=(cases,), timeout=600)
    _check(results, 2)
    assert {r["dp"] for r in results[0].values()} == {2, 1}


def test_one_epoch_ends_the_schedule_on_four_processes():
    """4 processes: TP=2 x DP=2, SP=2 x DP=2 (the schedule advances 2 per step, not 4) and
    TP=2 x SP=2 (DP=1)."""
    pytest.importorskip("transformers")
    cases = {
        "tp2-dp2": ({"tensor_parallel": {"size": 2}}, 1),
        "sp2-dp2": ({"sequence_parallel": {"size": 2}}, 1),
        "tp2xsp2": ({"tensor_parallel": {"size": 2}, "sequence_parallel": {"size": 2}}, 1),
    }
    results = run_distributed(_epoch, 4, args=(cases,), timeout=600)
    _check(results, 4)

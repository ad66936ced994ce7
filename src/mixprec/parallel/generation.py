"""Hugging Face ``generate()`` on a prepared model whose forward runs collectives.

``mark_collective_forward(acc, model)`` runs at ``prepare()`` after the parallelisms are
composed (parallel/compose.py): it marks the model so that transformers turns ``synced_gpus``
on by itself, and under tensor parallelism it checks that every inference forward gets the
same inputs on all ranks of a TP group ([Note: generate() on sharded weights]).

[Note: generate() on sharded weights]
On zero3/fsdp every forward all-gathers each unit's parameters over the data-parallel group,
under tensor parallelism the split layers all-reduce activations over the TP group, under
sequence parallelism attention runs all-to-alls over the SP group. ``generate()`` loops until
*this rank's* sequences are done, and the ranks of a data-parallel job generate from their
own prompts (Seq2SeqTrainer, transformers' run_summarization/run_translation scripts), so
they stop at different steps: the rank done first stops calling forward while the others
wait in a unit's gather, and mixprec's watchdog stops the job with CollectiveDesyncError
once the finished rank waits in a tracked call (or it hangs until the process group's
timeout). transformers' remedy is ``synced_gpus=True``: every step all-reduces "this rank is
done" over the default group, and a finished rank keeps running forward (its outputs
dropped) until every rank is done. transformers turns it on by itself when
``is_deepspeed_zero3_enabled()`` or ``transformers.distributed.fsdp.is_fsdp_managed_module(model)``
(``getattr(model, "_is_fsdp_managed_module", False)``) holds and the world size is > 1:
``GenerationMixin._extract_generation_mode_kwargs`` in generation/utils.py for a plain
``generate()``, ``Seq2SeqTrainer.prediction_step`` (trainer_seq2seq.py) passes the same default
explicitly, and the audio models' LayerDrop (wav2vec2, HuBERT, ...) then runs every layer on
every rank (a layer skipped on one rank would skip its collectives there).

So a model whose prepared forward runs a collective gets ``_is_fsdp_managed_module``: zero3
and fsdp (its parameters are sharded), tensor parallelism (size > 1), sequence parallelism
(Ulysses; it has no KV cache, so there it matters for LayerDrop rather than ``generate()``).
Every module of the model gets it, not only the root (as FSDP2 marks every module it
shards): transformers asks the module whose method runs, which is often not the prepared one
(a PEFT model's ``generate()`` is its inner transformers model's, LayerDrop asks the encoder).
That also turns LayerDrop's skipping off in training on these backends, as transformers does
under DeepSpeed ZeRO-3 and FSDP. ddp, zero1, zero2 and single leave it unset: their forward
runs no collective without grad (rank 0's buffers are broadcast only before a forward that
records gradients, ``sync_buffers`` in engines/comm.py), so there a rank may generate alone
and no per-token all-reduce is added. With the mark, every rank of the world must call
``generate()`` (a script that generates on some ranks only, on purpose, passes
``synced_gpus=False``: transformers keeps an explicit value), and each generated token costs
one all-reduce of one number over the world.

The value is not the plain ``True`` FSDP2 sets: Dynamo reads the same attribute
(torch/_dynamo/variables/builder.py) to treat a module as FSDP-managed. ``True`` alone makes
Dynamo refuse the module ("FSDP with use_orig_params=False"): ``torch.compile(model)`` of a
prepared model would run eagerly, and with ``fullgraph=True`` raise; with
``_fsdp_use_orig_params`` too, Dynamo would drop the guards on the module's attributes.
:class:`CollectiveForward` is true in eager code and false while ``torch.compile`` traces
(``torch.compiler.is_compiling()``), so Dynamo sees the modules exactly as before. A
``copy.deepcopy`` of the model (an EMA copy: its parameters are its own full ones, its
forward gathers nothing) and a pickle get ``False``.

Tensor parallelism and different inputs. The ranks of a TP group split one model, so every
forward must get the same inputs on all of them; with the same prompts and generation
settings they compute the same logits, choose the same tokens and finish at the same step.
Without a check, inputs that differ after the first forward (whose inputs tensor/apply.py
compares) went wrong in two ways, both measured: other sequence lengths made Gloo abort the
process ("Received data size doesn't match expected size", exit -6), equal shapes with
other values silently gave rank 1 rank 0's logits (TP=2). So every forward run without
grad (eval, each step of ``generate()``) first compares a fingerprint of its tensor arguments
over the TP group (one all-gather of three numbers, before any other collective of the
forward) and raises :class:`~mixprec.parallel.tensor.InputMismatchError` on every rank of
the group, naming them and their inputs' shapes. That also covers ``generate()`` called with
other settings on one TP rank (another ``max_new_tokens``): under ``synced_gpus`` the rank
done first feeds its last token again, and the check stops both at that step instead of
the others going on with wrong activations. Forwards that record gradients are not checked
each time: training batches come from the prepared DataLoader, which gives a TP group the
same batches, and the first forward is checked.
"""

from __future__ import annotations


import hashlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..distributed.devices import group_device
from ..engines.gathered import is_guarded
from . import tensor as tensor_parallel

ATTR = "_is_fsdp_managed_module"  # what transformers.distributed.fsdp.is_fsdp_managed_module reads


class CollectiveForward:
    """The value of ``model._is_fsdp_managed_module`` on a prepared model whose forward runs
    collectives: true in eager code, false under ``torch.compile``; copies and pickles are
    ``False`` ([Note: generate() on sharded weights])."""

    __slots__ = ("reasons",)

    def __init__(self, reasons: tuple) -> None:
        self.reasons = reasons  # what in the forward is a collective, for repr

    def __bool__(self) -> bool:
        return not torch.compiler.is_compiling()

    def __repr__(self) -> str:
        return (f"CollectiveForward({', '.join(self.reasons)}: the forward runs collectives; "
                f"true outside torch.compile, so transformers' generate() syncs the ranks)")

    def __reduce__(self):
        return bool, ()

    def __deepcopy__(self, memo) -> bool:
        return False


def collective_reasons(acc: Any, model: nn.Module) -> tuple:
    """What in ``model``'s prepared forward is a collective over ranks that may hold other
    data: () when nothing is (ddp, zero1, zero2, single)."""
    reasons = []
    if any(is_guarded(p) for p in model.parameters()):
        reasons.append(f"{acc.engine.name} unit gathers")
    layout = tensor_parallel.layout_of(model)
    if layout is not None and layout.tp.size > 1:
        reasons.append("tensor-parallel all-reduces")
    if getattr(acc, "_ulysses", None) is not None:
        reasons.append("sequence-parallel all-to-alls")
    return tuple(reasons)


def mark_collective_forward(acc: Any, model: nn.Module) -> None:
    """At ``prepare()``, after ``compose``: the flag transformers reads to sync ``generate()``
    over the ranks, and under TP the per-forward input check ([Note: generate() on sharded
    weights])."""
    reasons = collective_reasons(acc, model)
    if not reasons:
        return
    mark = CollectiveForward(reasons)
    for module in model.modules():  # PEFT's generate() runs the inner model's, LayerDrop reads its encoder's
        if not getattr(module, ATTR, False):  # a value the user set stays
            setattr(module, ATTR, mark)
    layout = tensor_parallel.layout_of(model)
    if layout is not None and layout.tp.size > 1:
        _check_inference_inputs(model, layout.tp)


# [Note: the root unit during generate()]
# An encoder-decoder's generate() runs its encoder directly (``model.get_encoder()(...)``),
# then the decoder steps through the root forward: the encoder reads the shared embedding,
# which on zero3/fsdp sits in the root unit, gathered only inside the root's forward. So a
# prepared model's ``generate`` runs inside a gathering scope over its root unit's
# parameters (embeddings, head, final norms: each rank holds them for the call, as FSDP2's
# ``register_fsdp_forward_method(model, "generate")`` does); the other units gather in their
# own forwards as always. The method is on the swapped class (``_GatheredGenerate`` in
# wrappers/model.py), so a deepcopy (an EMA model: full parameters of its own) or a pickle
# of the model carries no reference to this one.


def _fingerprint(args: tuple, kwargs: dict, device: torch.device) -> torch.Tensor:
    """Three float64 numbers on ``device``: a hash of the tensor arguments' names, shapes and
    dtypes, and two sums of their values (plain, and weighted by position, so that a
    permutation of token ids differs too). Non-tensor arguments (a KV cache object) are not
    compared."""
    h = hashlib.sha256()
    total = torch.zeros((), dtype=torch.float64, device=device)
    weighted = torch.zeros((), dtype=torch.float64, device=device)
    for k, (name, v) in enumerate(_tensors(args, kwargs)):
        h.update(f"{name}:{tuple(v.shape)}:{v.dtype};".encode())
        if v.numel() == 0:
            continue
        flat = torch.nan_to_num(v.detach().reshape(-1).to(device, torch.float64))
        position = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=device)
        total = total + (k + 1) * flat.sum()
        weighted = weighted + (k + 1) * (flat * position).sum()
    head = torch.tensor(float(int.from_bytes(h.digest()[:6], "little")), dtype=torch.float64, device=device)
    return torch.stack([head, total, weighted])


def _tensors(args: tuple, kwargs: dict) -> list:
    """(name, tensor) of a forward's tensor arguments, positional first, keywords by name."""
    named = [(f"arg{i}", v) for i, v in enumerate(args)] + sorted(kwargs.items())
    return [(name, v) for name, v in named if isinstance(v, torch.Tensor)]


def _shapes(args: tuple, kwargs: dict) -> str:
    return ", ".join(f"{name} {tuple(v.shape)}" for name, v in _tensors(args, kwargs)) or "no tensors"


def _check_inference_inputs(model: nn.Module, tp: Any) -> None:
    """Before every forward run without grad, the TP ranks compare their inputs'
    fingerprints; a difference raises InputMismatchError on each of them. The hook holds
    the TP group, not the model."""
    forwards = [0]

    @torch.compiler.disable
    def check(module, args, kwargs):
        if torch.is_grad_enabled():
            return
        forwards[0] += 1
        device = group_device(tp.group)
        mine = _fingerprint(args, kwargs, device)
        parts = [torch.empty(3, dtype=torch.float64, device=device) for _ in range(tp.size)]
        dist.all_gather(parts, mine, group=tp.group)
        rows = [p.cpu() for p in parts]
        if all(torch.equal(rows[0], r) for r in rows[1:]):
            return
        shapes: list = [None] * tp.size
        dist.all_gather_object(shapes, _shapes(args, kwargs), group=tp.group)
        ranks = [dist.get_global_rank(tp.group, i) for i in range(tp.size)]
        listed = "; ".join(f"rank {r}: {s}" for r, s in zip(ranks, shapes))
        if len(set(shapes)) == 1:
            listed += " (the same shapes: other values)"
        raise tensor_parallel.InputMismatchError(
            f"the ranks {ranks} of one tensor-parallel group got different inputs in forward #{forwards[0]} "
            f"without grad (eval or generate()): {listed}. TP ranks split one model, "
            f"so every forward must get the same inputs on all of them: give each rank of a TP group the same "
            f"batch (accelerator.prepare(dataloader) does), and under generate() make the same call on each "
            f"(same prompts and generation settings such as max_new_tokens), or the rank done first feeds the "
            f"others its last token again ([Note: generate() on sharded weights] in "
            f"src/mixprec/parallel/generation.py)")

    model.register_forward_pre_hook(check, with_kwargs=True, prepend=True)

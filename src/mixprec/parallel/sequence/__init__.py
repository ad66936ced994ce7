"""Sequence parallelism (DeepSpeed's AutoSP, Arctic's ALST; Ulysses attention): what
``Accelerator`` calls (docs/sequence_parallel.md).

- :func:`setup`: at ``Accelerator(...)``: the ``(dp, sp)`` mesh ([Note: the rank mesh] in
  parallel/mesh.py) and this group's :class:`Ulysses`;
- :func:`prepare_model`: at ``prepare()``: the model's forward runs every
  ``scaled_dot_product_attention`` as Ulysses ([Note: Ulysses around SDPA] in ulysses.py);
- :func:`prepare_inputs`: this rank's slice of a batch, shifted labels and the loss
  normaliser ([Note: the sequence-parallel loss] in inputs.py).

The engines are not changed: they average gradients over the whole world, as for plain data
parallelism, and the loss normaliser makes that average the exact rule.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from ..mesh import Mesh, MeshError, build_mesh, check_layout
from .inputs import IGNORE_INDEX, shift_labels, split_batch
from .ulysses import Ulysses, UnsupportedAttentionError, check_model, forward_context

__all__ = ["IGNORE_INDEX", "Mesh", "MeshError", "Ulysses", "UnsupportedAttentionError", "prepare_inputs",
           "prepare_model", "setup", "shift_labels", "token_loss"]


def setup(comm_cls: type, state: Any, sp_size: int, tp_size: int = 1) -> tuple[Mesh, Ulysses]:
    """The mesh and the Ulysses attention for ``sequence_parallel.size = sp_size`` (a
    collective), with ``tensor_parallel.size = tp_size`` on the same ``(dp, sp, tp)`` mesh
    ([Note: the rank mesh] in parallel/mesh.py). Every backend composes; the engine keeps
    every rank holding the same weights as its group."""
    check_layout(state.world_size, tp_size, sp_size)  # one process: "does not divide the world size 1"
    if not comm_cls.distributed:
        raise MeshError(f"sequence_parallel.size={sp_size} needs several processes and a distributed backend, "
                        f"got backend={comm_cls.name!r}; use ddp, zero1, zero2, zero3 or fsdp (or auto)")
    mesh = build_mesh(state.world_size, state.rank, tp_size, backend=state.backend, sp_size=sp_size)
    return mesh, Ulysses(mesh.sp_group, sp_size, mesh.sp_rank)


def prepare_model(model: nn.Module, ulysses: Ulysses) -> None:
    """Run the prepared ``model``'s forward (``ForwardContext.around``) with Ulysses attention."""
    check_model(model)
    model._mixprec_ctx.around = forward_context(model, ulysses)


def prepare_inputs(ulysses: Optional[Ulysses], input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None,
                   position_ids: Optional[torch.Tensor] = None, attention_mask: Optional[torch.Tensor] = None,
                   seq_dim: int = 1) -> dict:
    """This rank's kwargs for ``model(**batch)`` (``Accelerator.prepare_sp_inputs``); without
    sequence parallelism (``ulysses`` None) the whole sequence in the same form."""
    rank, size = (0, 1) if ulysses is None else (ulysses.rank, ulysses.size)
    batch, whole_padding = split_batch(input_ids, labels, position_ids, attention_mask, seq_dim, rank, size)
    if ulysses is not None:
        ulysses.whole_padding = whole_padding
        ulysses.local_length = batch["input_ids"].shape[seq_dim]
        ulysses.whole_length = input_ids.shape[seq_dim]  # [Note: unsliced inputs under SP] in ulysses.py
    return batch


def token_loss(logits: torch.Tensor, batch: dict) -> torch.Tensor:
    """Cross-entropy of ``logits`` ``[..., vocab]`` against ``batch["shift_labels"]``, summed
    and divided by ``batch["num_items_in_batch"]`` ([Note: the sequence-parallel loss])."""
    if "shift_labels" not in batch or "num_items_in_batch" not in batch:
        raise ValueError("the batch has no shift_labels / num_items_in_batch: build it with "
                         "accelerator.prepare_sp_inputs(input_ids=..., labels=...)")
    labels = batch["shift_labels"]
    total = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                              labels.reshape(-1).to(logits.device),
                                              ignore_index=IGNORE_INDEX, reduction="sum")
    return total / batch["num_items_in_batch"].to(total.device)

"""Sequence-parallel inputs: this rank's slice of a batch and the loss normaliser under
``sequence_parallel.size`` = P (docs/sequence_parallel.md; parallel/sequence/inputs.py), by
hand (:meth:`prepare_sp_inputs`) or for every batch of a prepared loader
(``sequence_parallel.prepare_batches``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch

from ..parallel import sequence as sequence_parallel


class SequenceInputs:
    """Mixin of :class:`mixprec.Accelerator` (reads ``_ulysses``, the sequence-parallel
    attention of the run, None without sequence parallelism)."""

    def prepare_sp_inputs(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None,
                          position_ids: Optional[torch.Tensor] = None,
                          attention_mask: Optional[torch.Tensor] = None, seq_dim: int = 1) -> dict:
        """This rank's kwargs for ``model(**batch)`` under ``sequence_parallel.size`` = P
        (docs/sequence_parallel.md): its slice of ``input_ids`` along ``seq_dim`` (the
        length must be a multiple of P), the slice's ``position_ids`` in the whole sequence
        (default ``0..S-1``), and with ``labels``: ``shift_labels`` (labels shifted one token
        left *before* slicing, so no target is lost at a slice border; also given as
        ``labels`` so HF models compute their loss) and ``num_items_in_batch``, the loss
        normaliser that makes the engine's average the exact whole-sequence loss
        ([Note: the sequence-parallel loss] in parallel/sequence/inputs.py). A padding
        ``attention_mask`` is not handed to the model: the attention applies the whole
        sequence's causal-and-padding mask itself (an all-ones mask is dropped). Without sequence parallelism: the whole sequence, same keys.
        Every rank of an SP group must pass the same whole batch (a prepared DataLoader
        gives it).

        Example::

            batch = accelerator.prepare_sp_inputs(input_ids=ids, labels=ids)
            loss = model(**batch).loss            # HF: sum of this slice's token losses / normaliser
            accelerator.backward(loss)
            logged = accelerator.reduce(loss.detach(), "mean")   # the whole-sequence loss
        """
        return sequence_parallel.prepare_inputs(self._ulysses, input_ids, labels, position_ids, attention_mask,
                                                seq_dim)

    def prepare_autosp_inputs(self, input_id: torch.Tensor, label_id: Optional[torch.Tensor] = None,
                              position_id: Optional[torch.Tensor] = None,
                              attention_mask: Optional[torch.Tensor] = None, seq_dim: int = 1) -> dict:
        """:meth:`prepare_sp_inputs` under DeepSpeed's AutoSP argument names
        (``deepspeed.compile.passes.sp_compile.prepare_autosp_inputs``); returns the kwargs
        for ``model(**batch)`` (DeepSpeed tags the tensors in place instead)."""
        return self.prepare_sp_inputs(input_id, label_id, position_id, attention_mask, seq_dim)

    def sp_loss(self, logits: torch.Tensor, batch: dict) -> torch.Tensor:
        """Your own token loss under sequence parallelism: the cross-entropy of ``logits``
        against ``batch["shift_labels"]`` summed over this slice and divided by
        ``batch["num_items_in_batch"]`` (``batch`` from :meth:`prepare_sp_inputs`), which is
        what HF's built-in loss computes from the same batch.

        Example::

            batch = accelerator.prepare_sp_inputs(input_ids=ids, labels=ids)
            logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
            loss = accelerator.sp_loss(logits, batch)

        Pass ``position_ids`` (this slice's positions in the whole sequence): without them
        the model numbers every slice's tokens from 0, wrong positions for all but the first.
        """
        return sequence_parallel.token_loss(logits, batch)

    def _sp_batch(self, batch: Any, seq_dim: int) -> dict:
        """``sequence_parallel.prepare_batches``: a loader's mapping batch, sliced."""
        keys = ("input_ids", "labels", "position_ids", "attention_mask")
        if not isinstance(batch, Mapping) or "input_ids" not in batch:
            raise TypeError(f"sequence_parallel.prepare_batches needs batches that are mappings with 'input_ids' "
                            f"(and optional {', '.join(keys[1:])}), got {type(batch).__name__}; collate to a "
                            "dict, or call accelerator.prepare_sp_inputs yourself")
        out = {k: v for k, v in batch.items() if k not in keys}
        out.update(self.prepare_sp_inputs(*(batch.get(k) for k in keys), seq_dim=seq_dim))
        return out

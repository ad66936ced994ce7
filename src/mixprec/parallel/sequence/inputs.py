"""This rank's share of a batch under sequence parallelism, and the loss normaliser.

[Note: the sequence-parallel loss]
The exact objective of one SP group (one batch of whole sequences) is the sum of its token
losses over the group's valid-token count ``N`` (labels != -100 after the shift), whatever
slice each token falls in; data parallelism averages it over the groups. Each rank computes
the loss of its own slice only, so with ``sum_r`` its sum of token losses the group's
gradient is ``sum over the SP ranks of grad(sum_r) / N``: summed over SP, averaged over DP.

The engines are left as they are: every backend averages the gradients over the whole world
(``dp * sp`` ranks: the weights are replicated on all of them, and zero/fsdp shard over all
of them, as Arctic's ALST does). A rank loss of ``sum_r * sp / N`` then gives exactly the
rule above: ``(1 / (dp * sp)) * sum_g sum_{r in g} sp * grad(sum_r) / N_g``. That factor lives
in the normaliser :func:`split_batch` hands out as ``num_items_in_batch = N / sp``, the
argument name Hugging Face models already divide a summed token loss by
(``transformers/loss/loss_utils.py``, ``ForCausalLMLoss``), so

- an HF model called with ``**batch`` computes ``sum_r / num_items_in_batch``;
- a loss of your own computes the same with ``reduction="sum"`` and
  ``/ batch["num_items_in_batch"]`` (``Accelerator.sp_loss`` does it);
- the mean of the rank losses over the world (``accelerator.reduce(loss, "mean")``) is the
  whole-sequence loss (averaged over DP), as under plain DDP.

``N`` needs no communication: every rank of an SP group holds the whole batch before it
slices it. A group with no valid token gets ``N = 1`` (a zero loss, not a 0/0). The
gradient-clipping norm needs nothing either: after the world average every rank's
replicated gradient (or its shard) is the one of the whole step, counted once.

Labels are shifted *before* slicing (``shift_labels[t] = labels[t + 1]``, -100 at the end),
so the token whose target sits in the next rank's slice keeps it: no token is lost at a
slice border (shifting each slice on its own would drop one target per border).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..mesh import MeshError

IGNORE_INDEX = -100


def _slice(t: torch.Tensor, seq_dim: int, rank: int, size: int) -> torch.Tensor:
    n = t.shape[seq_dim] // size
    return t.narrow(seq_dim, rank * n, n).contiguous()


def shift_labels(labels: torch.Tensor, seq_dim: int) -> torch.Tensor:
    """``labels`` moved one token left along ``seq_dim``, -100 at the end (the target of token t)."""
    pad_shape = list(labels.shape)
    pad_shape[seq_dim] = 1
    tail = labels.new_full(pad_shape, IGNORE_INDEX)
    return torch.cat([labels.narrow(seq_dim, 1, labels.shape[seq_dim] - 1), tail], dim=seq_dim)


def split_batch(input_ids: torch.Tensor, labels: Optional[torch.Tensor], position_ids: Optional[torch.Tensor],
                attention_mask: Optional[torch.Tensor], seq_dim: int, rank: int, size: int) -> tuple[dict, Any]:
    """(this rank's kwargs for ``model(**batch)``, the whole padding mask or None).

    The kwargs: ``input_ids``, ``position_ids`` (this slice's positions in the whole
    sequence), and with ``labels``: ``shift_labels`` and ``labels`` (the same shifted slice:
    HF models compute their loss only when ``labels`` is given, and read ``shift_labels``
    first), ``num_items_in_batch`` ([Note: the sequence-parallel loss]). A padding
    ``attention_mask`` is returned whole, apart from the kwargs, for the attention (with
    ``size`` 1 it is a kwarg as usual)."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a tensor, got {type(input_ids).__name__}")
    if not isinstance(seq_dim, int) or not 0 <= seq_dim < input_ids.dim():
        raise ValueError(f"seq_dim={seq_dim!r} is not a dimension of input_ids of shape {tuple(input_ids.shape)}")
    length = input_ids.shape[seq_dim]
    if length % size:
        up = -(-length // size) * size
        raise MeshError(
            f"sequence length {length} (input_ids dim {seq_dim}, shape {tuple(input_ids.shape)}) is not divisible "
            f"by sequence_parallel.size={size}: pad the sequences to a multiple of {size} (e.g. {up}, labels -100 "
            "on the padding), or change sequence_parallel.size")
    for name, t in (("labels", labels), ("position_ids", position_ids), ("attention_mask", attention_mask)):
        if t is not None and (t.dim() <= seq_dim or t.shape[seq_dim] != length):
            raise ValueError(f"{name} of shape {tuple(t.shape)} does not match input_ids of shape "
                             f"{tuple(input_ids.shape)} along seq_dim={seq_dim}")
    if position_ids is None:
        view = [1] * input_ids.dim()
        view[seq_dim] = length
        position_ids = torch.arange(length, device=input_ids.device).view(view).expand(input_ids.shape)
    out = {"input_ids": _slice(input_ids, seq_dim, rank, size),
           "position_ids": _slice(position_ids, seq_dim, rank, size)}
    # The padding mask is not handed to the model: a model builds its mask from the local
    # length (and HF drops an all-ones slice, switching its GQA path on some ranks only);
    # Ulysses applies the whole one ([Note: Ulysses around SDPA] in ulysses.py).
    whole_mask = None
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        if size == 1:  # one process: the model applies it as usual
            out["attention_mask"] = attention_mask
        else:
            whole_mask = attention_mask.bool()
    if labels is not None:
        shifted = shift_labels(labels, seq_dim)
        valid = int((shifted != IGNORE_INDEX).sum())
        mine = _slice(shifted, seq_dim, rank, size)
        out["labels"] = mine
        out["shift_labels"] = mine
        out["num_items_in_batch"] = torch.tensor(max(valid, 1) / size, dtype=torch.float32,
                                                 device=input_ids.device)
    return out, whole_mask

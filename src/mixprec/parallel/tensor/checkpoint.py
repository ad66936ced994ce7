"""Checkpoints of tensor-parallel models: split tensors saved whole, loaded into any layout.

[Note: TP checkpoints]
The checkpoint format stores every tensor under its GLOBAL shape as flat element ranges
(src/mixprec/checkpoint/format.py), so one checkpoint loads into any backend and world size.
Under TP the engine underneath describes the tensors it holds, and for a split parameter (and
its optimizer state) that is the rank's slice: its "global" shape is the local one. This
module sits between the engine and the checkpoint:

- saving (``state_shards``): for every shard of a split tensor, the ranks of the TP group
  hold the same element range of their slices (equal slice shapes, so the data-parallel
  engine cuts them alike: checked first). The range is gathered on TP rank 0, each element
  placed at its index in the whole tensor, and written as the runs of consecutive full-tensor
  indices (a column split is one run per sub-parameter; a row split merges whole rows into
  one run, so a shard becomes at most a few runs); the other TP ranks write nothing for it.
  Names and dtypes are the engine's. A whole split tensor is held by TP rank 0 only, so it
  is never ``replicated`` (that flag says every rank holds the tensor, and the writer shares
  such tensors out among all ranks: [Note: replicated shares] in checkpoint/writer.py): what
  the engine holds the same on every data-parallel rank (a ddp checkpoint's split weights)
  is written by global rank 0 (TP rank 0 of the first data-parallel group), what it slices
  over them (zero1/2's optimizer state) by each DP group's TP rank 0.
- loading (``load_state_shards``): the engine asks for ranges of its slices; each is read
  from the whole tensor as the block of full rows (or outer rows, for a split of an inner
  dimension) that covers it, and cut down to the slice.

``state_names`` reports the whole shapes, so a checkpoint is validated against the model as
the user built it, whatever the TP size.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import torch
import torch.distributed as dist

from ...checkpoint.format import Shard, model_prefix
from .layers import TPGroup


@dataclasses.dataclass(frozen=True)
class SplitInfo:
    """A split tensor: its slice's shape, the whole shape, the split dimension and the
    sub-parameter sizes along it (whole-tensor sizes; None: one)."""

    local_shape: tuple
    full_shape: tuple
    dim: int
    sizes: Optional[tuple]
    tp: TPGroup

    def index_map(self, rank: int) -> torch.Tensor:
        """Local index along ``dim`` -> whole-tensor index, for TP rank ``rank``."""
        sizes = self.sizes or (self.full_shape[self.dim],)
        parts, base = [], 0
        for s in sizes:
            k = s // self.tp.size
            parts.append(torch.arange(base + rank * k, base + (rank + 1) * k))
            base += s
        return torch.cat(parts)

    def geometry(self) -> tuple[int, int, int]:
        """(inner, local size along dim, whole size along dim)."""
        inner = math.prod(self.full_shape[self.dim + 1:])
        return inner, self.local_shape[self.dim], self.full_shape[self.dim]

    def full_indices(self, rank: int, offset: int, numel: int) -> torch.Tensor:
        """Whole-tensor flat indices of the local flat range ``[offset, offset + numel)``."""
        inner, ld, fd = self.geometry()
        p = torch.arange(offset, offset + numel, dtype=torch.int64)
        outer, rem = p // (ld * inner), p % (ld * inner)
        return outer * (fd * inner) + self.index_map(rank)[rem // inner] * inner + rem % inner


def split_infos(models: list, layout_of) -> dict[str, SplitInfo]:
    """Checkpoint name of every split tensor's parameter (``model/<name>``) -> its SplitInfo.
    Optimizer state names (``optim/<j>/<key>/<state>``) are looked up by ``key``."""
    out = {}
    for i, model in enumerate(models):
        layout = layout_of(model)
        if layout is None:
            continue
        params = dict(model.named_parameters(remove_duplicate=False))
        for pname, (dim, sizes) in layout.split.items():
            local = tuple(params[pname].shape)
            out[model_prefix(i) + pname] = SplitInfo(local, tuple(layout.full_shapes[pname]), dim, sizes, layout.tp)
    return out


def info_for(name: str, infos: dict[str, SplitInfo], shape: Optional[tuple] = None) -> Optional[SplitInfo]:
    """The SplitInfo of checkpoint tensor ``name`` (a parameter, or optimizer state of the
    parameter's shape), or None when it is not split."""
    if name in infos:
        return infos[name]
    if name.startswith("optim/"):
        _, _j, rest = name.split("/", 2)
        key = rest.rsplit("/", 1)[0]
        info = infos.get("model/" + key) or infos.get(key)  # model 0's keys have no prefix
        if info is not None and (shape is None or tuple(shape) == info.local_shape):
            return info
    return None


def full_state_names(names: dict, infos: dict[str, SplitInfo]) -> dict:
    return {n: (infos[n].full_shape if n in infos else shape) for n, shape in names.items()}


def whole_shards(shards: list, infos: dict[str, SplitInfo], tp: Optional[TPGroup]) -> list:
    """The engine's shards with every split tensor's ranges made whole-tensor ranges (a
    collective over each TP group; see [Note: TP checkpoints])."""
    if tp is None or tp.size == 1:
        return shards
    split = [(s, info_for(s.name, infos, s.shape)) for s in shards]
    split_only = [(s, i) for s, i in split if i is not None]
    # A tensor TP does not split is the same on every TP rank: the data-parallel engine's
    # slices of it are written by TP rank 0 only (whole replicated tensors by rank 0 anyway).
    split = [(s, i) for s, i in split if i is not None or s.replicated or tp.rank == 0]
    mine = [(s.name, s.offset, s.tensor.numel()) for s, _ in split_only]
    everyone: list = [None] * tp.size
    dist.all_gather_object(everyone, mine, group=tp.group)
    if any(e != mine for e in everyone):
        raise RuntimeError("tensor-parallel checkpoint: the TP ranks hold different ranges of their split tensors "
                           f"(rank {tp.rank}: {mine[:3]}..., others differ); the model or the optimizer differs "
                           "between TP ranks")
    out = []
    for s, info in split:
        if info is None:
            out.append(s)
            continue
        flat = s.tensor.reshape(-1).contiguous()
        parts = [torch.empty_like(flat) for _ in range(tp.size)]
        dist.all_gather(parts, flat, group=tp.group)
        if tp.rank != 0 or (s.replicated and dist.get_rank() != 0):
            continue  # [Note: TP checkpoints]: one writer per element
        index = torch.cat([info.full_indices(r, s.offset, flat.numel()) for r in range(tp.size)])
        values = torch.cat([p.cpu() for p in parts])
        order = torch.argsort(index)
        index, values = index[order], values[order]
        breaks = (torch.nonzero(index[1:] - index[:-1] != 1).reshape(-1) + 1).tolist()
        for start, end in zip([0] + breaks, breaks + [index.numel()]):
            out.append(Shard(s.name, info.full_shape, s.dtype, int(index[start]), values[start:end].clone(),
                             False))
    return out


class SliceReader:
    """``read`` for an engine that holds slices of split tensors: it asks for ranges of its
    slices by their local shapes, and gets them cut from the whole tensors in the file."""

    def __init__(self, read: Any, infos: dict[str, SplitInfo]) -> None:
        self._read = read
        self._infos = infos
        self.index = {}
        for name, (shape, dtype) in read.index.items():
            info = info_for(name, infos, None)
            if info is not None and tuple(shape) == info.full_shape:
                self.index[name] = (info.local_shape, dtype)
            else:
                self.index[name] = (shape, dtype)

    def __getattr__(self, item):
        return getattr(self._read, item)

    def __call__(self, name: str, offset: int, numel: int) -> torch.Tensor:
        info = info_for(name, self._infos, None)
        if info is None or tuple(self._read.index[name][0]) != info.full_shape:
            return self._read(name, offset, numel)
        if numel == 0:
            return self._read(name, 0, 0)
        inner, ld, fd = info.geometry()
        index_map = info.index_map(info.tp.rank)
        if info.dim == 0:
            lo, hi = offset // inner, (offset + numel - 1) // inner
            rows = index_map[lo:hi + 1]
            fmin, fmax = int(rows.min()), int(rows.max())
            block = self._read(name, fmin * inner, (fmax - fmin + 1) * inner).reshape(-1, inner)
            local = block[rows - fmin].reshape(-1)
            start = offset - lo * inner
        else:
            oa, ob = offset // (ld * inner), (offset + numel - 1) // (ld * inner)
            block = self._read(name, oa * fd * inner, (ob - oa + 1) * fd * inner).reshape(ob - oa + 1, fd, inner)
            local = block[:, index_map].reshape(-1)
            start = offset - oa * ld * inner
        return local[start:start + numel].clone()

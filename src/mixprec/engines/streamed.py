"""A model's full weights one tensor at a time: what the streaming saves write
(``save_pretrained`` of a prepared Hugging Face model, ``save_16bit_model``, ``save_model``).

[Note: streaming a model's full weights]
``get_state_dict`` returns every tensor whole, so it holds the model; a save needs only the
tensor it is writing. :class:`FullStateStream` yields the values ``get_state_dict`` would
hold (bitwise: the fp32 masters where there are, whole under tensor parallelism), one at
a time, in an order fixed in advance:

* a parameter a ZeRO/FSDP core shards (and whose full value is not local:
  ``comm.full_state_is_local``) is gathered alone from the master shards
  (``ShardedCore.gather_master``, [Note: one parameter's master, gathered] in
  csrc/engines/sharded/core.h): the owners of its pieces send them to the writing rank,
  which holds the tensor once and nothing else; the other ranks receive nothing;
* a parameter with an fp32 master (single/ddp with low-precision storage) is its master,
  anything else (buffers, frozen parameters, replicated full parameters) the tensor the
  model holds: no copy, no collective;
* under tensor parallelism a split tensor is then made whole over the TP group
  (``full_from_local``, every TP rank gets it), and the cores gather for every rank
  (``dst=-1``): each TP rank of the writer's group needs its own slice first.

So a writing rank holds its shard plus the tensor being written (and what the writer makes
of it: a cast copy), the others their shard (plus, under TP, the tensor). Every tensor that
involves a collective is a collective: every rank produces the same tensors in the same
order. The writer consumes them in that order (:meth:`take`); when it stops early (an
``OSError`` half-way through a file) :meth:`drain` runs the collectives left, which is all
the other ranks ever call, so the ranks stay matched and learn of the failure afterwards
(facade/exports.py broadcasts it).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from ..parallel import tensor as tensor_parallel
from ..parallel.materialize import trim_heap
from ..parallel.tensor.layers import full_from_local


class FullStateStream:
    """``get_state_dict(model)``'s tensors for ``names`` (default: every ``state_dict`` key),
    one at a time (the Note). ``dst``: the global rank that writes (None: every rank needs
    the values). ``entries``: ``(name, full shape, dtype)`` of each, known before anything is
    gathered."""

    def __init__(self, engine, model: nn.Module, names: Optional[list] = None, dst: Optional[int] = 0) -> None:
        state = model.state_dict(keep_vars=True)
        names = list(state) if names is None else list(names)
        missing = [n for n in names if n not in state]
        if missing:
            raise KeyError(f"{type(model).__name__}.state_dict() has no {missing[:4]}; its keys: {list(state)[:8]} ...")
        comm, precision = engine.comm, engine.precision
        layout = tensor_parallel.layout_of(model)
        cores = {}  # id(param) -> (core, index) for parameters gathered from master shards
        if not comm.full_state_is_local(model):
            for core in comm.model_cores(model):
                cores.update({id(p): (core, i) for i, p in enumerate(core.params)})
        self.core_dst = -1 if dst is None or layout is not None else _group_rank(getattr(comm, "group", None), dst)
        # Whether this rank gets the values: the writer; every rank under TP (see the Note).
        self.receives = dst is None or layout is not None or not dist.is_initialized() or dist.get_rank() == dst
        self.entries: list[tuple[str, tuple, torch.dtype]] = []
        self._sources: list[tuple] = []  # (core, index) or a local tensor, then the TP split or None
        for name in names:
            value = state[name]
            split = layout.split.get(name) if layout is not None else None
            shape = tuple(layout.full_shapes[name]) if split is not None else tuple(value.shape)
            if id(value) in cores:
                source = cores[id(value)]
                dtype = torch.float32
            else:
                source = precision.master_of.get(id(value), value)
                dtype = source.dtype
            self.entries.append((name, shape, dtype))
            self._sources.append((source, split, layout))
        self.next = 0
        self.broken = False  # a collective raised: the ranks are no longer matched

    def __len__(self) -> int:
        return len(self.entries)

    def take(self, i: int) -> Optional[torch.Tensor]:
        """Tensor ``i``, whole (None on a rank that does not receive it). A collective where
        it gathers; tensors are taken in order, each once."""
        if i != self.next:
            raise RuntimeError(f"FullStateStream.take({i}): tensor {self.next} is next; the tensors are gathered "
                               "in one order on every rank, each once")
        self.next += 1
        (source, split, layout) = self._sources[i]
        if self.receives and _nbytes(self.entries[i]) >= TRIM_BYTES:
            trim_heap()  # [Note: the heap between tensors]
        try:
            if isinstance(source, tuple):
                core, index = source
                t = core.gather_master(index, self.core_dst)
            else:
                t = source.detach() if self.receives else None
            if split is not None:
                dim, sizes = split
                t = full_from_local(t.detach(), dim, layout.tp, sizes)
        except BaseException:
            self.broken = True
            raise
        return t

    def drain(self) -> None:
        """Run the collectives of every tensor not taken yet, dropping the values: a rank
        that writes nothing (or stopped writing) stays matched with the others."""
        if self.broken:
            return
        while self.next < len(self.entries):
            self.take(self.next)


# [Note: the heap between tensors]
# A tensor freed by the writer goes back to glibc's heap, which keeps it unless it was
# mapped on its own: glibc maps an allocation apart only above its mmap threshold, and
# raises that threshold to the size of every mapped block freed (up to 32 MiB), so after
# the first large tensor the next ones come from the heap, and the freed ones stay there
# while the heap top is not free (measured: about one largest tensor more on the writer,
# 2.1x the largest fp32 tensor instead of 1.5x for a bf16 save). So before a tensor of
# TRIM_BYTES or more is gathered, the heap is trimmed (malloc_trim: free pages go back to
# the OS); smaller tensors reuse the holes of the ones before.
TRIM_BYTES = 1 << 20


def _nbytes(entry: tuple) -> int:
    _, shape, dtype = entry
    n = 1
    for s in shape:
        n *= int(s)
    return n * torch.empty((), dtype=dtype).element_size()


def _group_rank(group, global_rank: int) -> int:
    if group is None or not dist.is_initialized():
        return global_rank
    return dist.get_group_rank(group, global_rank)

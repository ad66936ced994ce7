"""The rank mesh: which ranks split weights (TP), split sequences (SP) and replicate them (DP).

[Note: the rank mesh]
Ranks form a ``(dp, sp, tp)`` grid, TP innermost: ``rank = (d * sp + s) * tp + t``. TP group
``(d, s)`` is the ``tp`` consecutive ranks that split one model's weights (on a multi-GPU node
they share the fastest links, as Megatron and DeepSpeed place them); SP group ``(d, t)`` is
the ``sp`` ranks, ``tp`` apart, that hold one slice each of the same sequences and the same
TP slice of the weights; the data-parallel engine's group (``dp_group``) is every rank holding
the same TP slice, ``t`` apart ``tp``: ``dp * sp`` ranks. Each collective runs on its own
subgroup: the split layers' forward/backward collectives on the TP group, the Ulysses
all-to-alls on the SP group (parallel/sequence/), and the engine (ddp, zero1/2/3, fsdp)
reduces and shards over ``dp_group``: under SP the weights are replicated over the SP ranks
too and the loss normaliser makes that average the exact rule ([Note: the sequence-parallel
loss] in parallel/sequence/inputs.py). What must be agreed by every rank (found_inf, the
gradient norm) is agreed over the TP group as well, counting each element once
(parallel/tensor/engine.py). Batches are sharded over the ``dp`` data ranks
(``dp_rank = rank // (sp * tp)``): the TP and SP ranks of one data rank read the same batch.

Without TP, ``dp_group`` is None (the default group serves: every rank holds the whole
model); without SP the grid is ``(dp, tp)`` and without TP ``(dp, sp)``.

Every rank creates every subgroup (``torch.distributed.new_group`` is a collective over the
default group), in the same order (TP groups, SP groups, then DP groups), so the group names
C++ resolves (``c10d::resolve_process_group``) are the same on every rank.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch.distributed as dist


class MeshError(ValueError):
    """A parallel layout that does not fit the job (world size, head counts)."""


@dataclasses.dataclass(frozen=True)
class Mesh:
    """This rank's place in the ``(dp, sp, tp)`` grid and the subgroups it belongs to.

    ``tp_group`` / ``sp_group`` are ``None`` when that dimension has size 1 (nothing to
    communicate); ``dp_group``, the engine's group (the ranks holding the same TP slice), is
    None without TP (the engine reduces over the whole world); ``tp_ranks`` / ``sp_ranks`` /
    ``dp_ranks`` are the global ranks of this rank's groups.
    """

    world_size: int
    rank: int
    tp_size: int
    tp_group: Any
    dp_group: Any
    tp_ranks: tuple
    dp_ranks: tuple
    sp_size: int = 1
    sp_group: Any = None
    sp_ranks: tuple = ()

    @property
    def dp_size(self) -> int:
        return self.world_size // (self.tp_size * self.sp_size)

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def sp_rank(self) -> int:
        return (self.rank // self.tp_size) % self.sp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // (self.tp_size * self.sp_size)

    def describe(self) -> str:
        dims = [f"dp={self.dp_size}"] + [f"{k}={v}" for k, v in (("sp", self.sp_size), ("tp", self.tp_size)) if v > 1]
        where = [f"{k} rank {r} of ranks {list(ranks)}" for k, r, ranks, size in (
            ("tp", self.tp_rank, self.tp_ranks, self.tp_size), ("sp", self.sp_rank, self.sp_ranks, self.sp_size))
            if size > 1]
        return f"mesh {' x '.join(dims)} (rank {self.rank}: {', '.join(where + [f'dp rank {self.dp_rank}'])})"


def check_layout(world_size: int, tp_size: int, sp_size: int = 1) -> None:
    """A world size that ``tp_size * sp_size`` divides, sizes >= 1."""
    for key, size in (("tensor_parallel.size", tp_size), ("sequence_parallel.size", sp_size)):
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise MeshError(f"{key}={size!r} must be an int >= 1 (1: off)")
    both = tp_size * sp_size
    if world_size % both == 0:
        return
    if tp_size > 1 and sp_size > 1:
        raise MeshError(
            f"tensor_parallel.size={tp_size} x sequence_parallel.size={sp_size} (= {both} ranks per model copy) "
            f"does not divide the world size {world_size}: run a multiple of {both} processes (e.g. "
            f"{both * max(1, world_size // both)}), or set the sizes so that their product divides {world_size}")
    key, size = ("tensor_parallel.size", tp_size) if tp_size > 1 else ("sequence_parallel.size", sp_size)
    raise MeshError(
        f"{key}={size} does not divide the world size {world_size}: run a multiple "
        f"of {size} processes (e.g. {size * max(1, world_size // size)}), or set "
        f"{key} to a divisor of {world_size}"
    )


def build_mesh(world_size: int, rank: int, tp_size: int, backend: Optional[str] = None,
               sp_size: int = 1) -> Mesh:
    """Create the subgroups of the ``(world_size // (sp_size * tp_size), sp_size, tp_size)``
    mesh (a collective: every rank calls it with the same arguments) and return this rank's
    view ([Note: the rank mesh])."""
    check_layout(world_size, tp_size, sp_size)
    if world_size == 1:
        return Mesh(1, 0, 1, None, None, (0,), (0,), 1, None, (0,))
    if not (dist.is_available() and dist.is_initialized()):
        what = "sequence" if sp_size > 1 else "tensor"
        raise MeshError(f"{what} parallelism needs an initialised process group: start the script with "
                        f"`mixprec launch --nproc-per-node {world_size} script.py`")
    tp, sp = tp_size, sp_size
    dp = world_size // (tp * sp)

    def at(d: int, s: int, t: int) -> int:
        return (d * sp + s) * tp + t

    def make(groups: list[tuple]) -> tuple[Any, tuple]:
        """Create every group (every rank, same order); this rank's group and ranks."""
        mine, mine_ranks = None, (rank,)
        for ranks in groups:
            group = dist.new_group(list(ranks), backend=backend)
            if rank in ranks:
                mine, mine_ranks = group, ranks
        return mine, mine_ranks

    tp_group, tp_ranks = make([tuple(at(d, s, t) for t in range(tp)) for d in range(dp) for s in range(sp)]) \
        if tp > 1 else (None, (rank,))
    sp_group, sp_ranks = make([tuple(at(d, s, t) for s in range(sp)) for d in range(dp) for t in range(tp)]) \
        if sp > 1 else (None, (rank,))
    if tp > 1:  # the engine's group: every rank holding this TP slice
        dp_group, dp_ranks = make([tuple(r for r in range(world_size) if r % tp == t) for t in range(tp)])
    else:
        dp_group, dp_ranks = None, tuple(range(rank % sp, world_size, sp))
    return Mesh(world_size, rank, tp, tp_group, dp_group, tp_ranks, dp_ranks, sp, sp_group, sp_ranks)


def destroy_mesh(mesh: Optional[Mesh]) -> None:
    """Destroy the subgroups of ``mesh`` (before the default group goes)."""
    if mesh is None or not (dist.is_available() and dist.is_initialized()):
        return
    for group in {id(g): g for g in (mesh.tp_group, mesh.dp_group, mesh.sp_group) if g is not None}.values():
        try:
            dist.destroy_process_group(group)
        except (RuntimeError, ValueError):
            pass  # already gone with the default group

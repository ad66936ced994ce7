"""The rank mesh: which ranks split weights (TP), split sequences (SP) and replicate them (DP).

[Note: the rank mesh]
Ranks form a ``(dp, tp)`` grid, TP innermost: TP group ``g`` is the consecutive ranks
``[g * tp, (g + 1) * tp)`` (on a multi-GPU node they share the fastest links, as Megatron
and DeepSpeed place them), and DP group ``t`` is every ``tp``-th rank starting at ``t``:
the ranks that hold the same TP slice of every weight. Each engine collective runs on its
own subgroup: the data-parallel engines (ddp, zero1, zero2) reduce and shard gradients over
the DP group only; the split layers' forward/backward collectives run on the TP group.
What must be agreed by every rank (found_inf, the gradient norm) is agreed over both,
counting each element once (parallel/tensor/engine.py).

Sequence parallelism (parallel/sequence/) uses the same grid with ``sp`` in place of ``tp``:
SP group ``g`` is the consecutive ranks ``[g * sp, (g + 1) * sp)``, which hold the same
samples and one slice of each sequence; their only collectives are the Ulysses all-to-alls
inside attention, on the SP group. The weights are replicated on every rank, so the engine
keeps reducing over the whole world ([Note: the sequence-parallel loss] in
parallel/sequence/inputs.py): ``dp_group`` is None under SP (the default group serves) and
``dp_ranks`` lists the ranks holding the same slice position. TP and SP together are not
built (a NotImplementedError says so).

Every rank creates every subgroup (``torch.distributed.new_group`` is a collective over the
default group), in the same order, so the group names C++ resolves
(``c10d::resolve_process_group``) are the same on every rank.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch.distributed as dist


class MeshError(ValueError):
    """A parallel layout that does not fit the job (world size, head counts)."""


@dataclasses.dataclass(frozen=True)
class Mesh:
    """This rank's place in the ``(dp, tp)`` or ``(dp, sp)`` grid and the subgroups it
    belongs to.

    ``tp_group`` / ``sp_group`` are ``None`` when that dimension has size 1 (nothing to
    communicate), ``dp_group`` is None under SP (the engine reduces over the whole world);
    ``tp_ranks`` / ``sp_ranks`` / ``dp_ranks`` are the global ranks of this rank's groups.
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
        return self.rank % self.sp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // (self.tp_size * self.sp_size)

    def describe(self) -> str:
        if self.sp_size > 1:
            return (f"mesh dp={self.dp_size} x sp={self.sp_size} (rank {self.rank}: sp rank {self.sp_rank} of "
                    f"ranks {list(self.sp_ranks)}, dp rank {self.dp_rank})")
        return (f"mesh dp={self.dp_size} x tp={self.tp_size} (rank {self.rank}: tp rank {self.tp_rank} of "
                f"ranks {list(self.tp_ranks)}, dp rank {self.dp_rank} of ranks {list(self.dp_ranks)})")


def check_layout(world_size: int, tp_size: int, sp_size: int = 1) -> None:
    """A world size that the TP (or SP) size divides, sizes >= 1, not both above 1."""
    for key, size in (("tensor_parallel.size", tp_size), ("sequence_parallel.size", sp_size)):
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise MeshError(f"{key}={size!r} must be an int >= 1 (1: off)")
    if tp_size > 1 and sp_size > 1:
        raise NotImplementedError(
            f"tensor_parallel.size={tp_size} with sequence_parallel.size={sp_size}: tensor and sequence "
            "parallelism together are not implemented; set one of them to 1")
    for key, size in (("tensor_parallel.size", tp_size), ("sequence_parallel.size", sp_size)):
        if world_size % size:
            raise MeshError(
                f"{key}={size} does not divide the world size {world_size}: run a multiple "
                f"of {size} processes (e.g. {size * max(1, world_size // size)}), or set "
                f"{key} to a divisor of {world_size}"
            )


def build_mesh(world_size: int, rank: int, tp_size: int, backend: Optional[str] = None,
               sp_size: int = 1) -> Mesh:
    """Create the subgroups of a ``(world_size // tp_size, tp_size)`` mesh, or of a
    ``(world_size // sp_size, sp_size)`` one (a collective: every rank calls it with the same
    arguments) and return this rank's view."""
    check_layout(world_size, tp_size, sp_size)
    if world_size == 1:
        return Mesh(1, 0, 1, None, None, (0,), (0,), 1, None, (0,))
    if not (dist.is_available() and dist.is_initialized()):
        what = "sequence" if sp_size > 1 else "tensor"
        raise MeshError(f"{what} parallelism needs an initialised process group: start the script with "
                        f"`mixprec launch --nproc-per-node {world_size} script.py`")
    if sp_size > 1:
        return _build_sp_mesh(world_size, rank, sp_size, backend)
    dp_size = world_size // tp_size
    tp_group = dp_group = None
    tp_ranks = dp_ranks = (rank,)
    for g in range(dp_size):  # every rank creates every group, in the same order
        ranks = tuple(range(g * tp_size, (g + 1) * tp_size))
        group = dist.new_group(list(ranks), backend=backend) if tp_size > 1 else None
        if rank in ranks:
            tp_group, tp_ranks = group, ranks
    for t in range(tp_size):
        ranks = tuple(range(t, world_size, tp_size))
        group = dist.new_group(list(ranks), backend=backend)
        if rank in ranks:
            dp_group, dp_ranks = group, ranks
    return Mesh(world_size, rank, tp_size, tp_group, dp_group, tp_ranks, dp_ranks, 1, None, (rank,))


def _build_sp_mesh(world_size: int, rank: int, sp_size: int, backend: Optional[str]) -> Mesh:
    sp_group, sp_ranks = None, (rank,)
    for g in range(world_size // sp_size):  # every rank creates every group, in the same order
        ranks = tuple(range(g * sp_size, (g + 1) * sp_size))
        group = dist.new_group(list(ranks), backend=backend)
        if rank in ranks:
            sp_group, sp_ranks = group, ranks
    dp_ranks = tuple(range(rank % sp_size, world_size, sp_size))
    return Mesh(world_size, rank, 1, None, None, (rank,), dp_ranks, sp_size, sp_group, sp_ranks)


def destroy_mesh(mesh: Optional[Mesh]) -> None:
    """Destroy the subgroups of ``mesh`` (before the default group goes)."""
    if mesh is None or not (dist.is_available() and dist.is_initialized()):
        return
    for group in {id(g): g for g in (mesh.tp_group, mesh.dp_group, mesh.sp_group) if g is not None}.values():
        try:
            dist.destroy_process_group(group)
        except (RuntimeError, ValueError):
            pass  # already gone with the default group

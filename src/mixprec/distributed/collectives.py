"""Collectives over nested tuples/lists/dicts of tensors, taking the state explicitly.

Every function takes the :class:`~mixprec.distributed.state.DistributedState` first and is
the identity (or a no-op) on one process, so the same training script runs unchanged under
``python script.py`` and ``mixprec launch``. Reductions use ``SUM`` (a mean is a sum divided
by the world size) because Gloo has no ``AVG``.

Example::

    state = init_distributed(torch.device("cpu"))
    preds = gather(state, {"logits": logits, "loss": loss})        # loss: 0-dim -> shape (world,)
    total = reduce(state, correct, reduction="sum")
    with split_between_processes(state, prompts) as mine:
        outputs = [generate(p) for p in mine]
    outputs = gather_object(state, outputs)
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from ..utils import tree_map_tensors
from .devices import group_device
from .state import DetachedGroup, DistributedState
from .watchdog import pad_signature, plain_signature, tracked, tree_signature

_REDUCTIONS = ("sum", "mean", "max", "min")
_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _single(state: DistributedState) -> bool:
    return state.world_size <= 1


def _device(state: DistributedState) -> torch.device:
    """Where this state's collectives take their tensors ([Note: collectives on the group's
    device] in distributed/devices.py): a user's host tensor travels there and comes back."""
    if isinstance(state.group, DetachedGroup):
        return state.group.device  # raises, naming the fix ([Note: pickling a state])
    return group_device(state.group)


def _check_tensor_tree(tree: Any, fn: str) -> None:
    found = []
    tree_map_tensors(lambda t: found.append(t) or t, tree)
    if not found and not isinstance(tree, torch.Tensor):
        raise TypeError(
            f"{fn}() got {type(tree).__name__} {_short(tree)} with no tensors in it; pass a tensor or "
            f"a tuple/list/dict of tensors (use gather_object/broadcast_object_list for Python objects)"
        )


def _has_tensors(tree: Any) -> bool:
    found = []
    tree_map_tensors(lambda t: found.append(t) or t, tree)
    return bool(found)


def _short(obj: Any) -> str:
    text = repr(obj)
    return text if len(text) <= 80 else text[:77] + "..."


@tracked("wait_for_everyone", plain_signature)
def barrier(state: DistributedState) -> None:
    """Block until every process reaches this call (no-op on one process)."""
    if not _single(state):
        dist.barrier(group=state.group)


@tracked("gather", tree_signature)
def gather(state: DistributedState, tree: Any, ranks: Optional[tuple] = None) -> Any:
    """All-gather every tensor in ``tree`` and concatenate the ranks' values on dim 0.

    0-dim tensors become shape ``(world_size,)``. Every rank must pass tensors of the same
    shape; use :func:`pad_across_processes` first when dim 0 differs. On one process the
    tree is returned as is (0-dim tensors become shape ``(1,)``, as with several processes).
    ``ranks``: keep only these ranks' values, in this order (every rank still takes part;
    [Note: metrics over data-parallel ranks]).

    Example::

        gather(state, torch.tensor([rank]))      # tensor([0, 1]) on 2 processes, on every rank
    """
    _check_tensor_tree(tree, "gather")

    def one(t: torch.Tensor) -> torch.Tensor:
        if t.ndim == 0:
            t = t.reshape(1)
        if _single(state):
            return t
        sent = t.to(_device(state)).contiguous()
        parts = [torch.empty_like(sent) for _ in range(state.world_size)]
        dist.all_gather(parts, sent, group=state.group)
        return torch.cat(_keep(parts, ranks), dim=0).to(t.device)

    return tree_map_tensors(one, tree)


def _keep(parts: list, ranks: Optional[tuple]) -> list:
    return parts if ranks is None else [parts[r] for r in ranks]


@tracked("gather_object", plain_signature)
def gather_object(state: DistributedState, obj: Any, ranks: Optional[tuple] = None) -> list:
    """All-gather picklable Python objects. A list/tuple from each rank is concatenated in
    rank order; any other object gives the list ``[obj_rank0, obj_rank1, ...]``. ``ranks``:
    keep only these ranks' objects, in this order (as in :func:`gather`).

    Example::

        gather_object(state, [f"rank{rank}"])    # ['rank0', 'rank1'] on every rank
    """
    if _single(state):
        return list(obj) if isinstance(obj, (list, tuple)) else [obj]
    out: list = [None] * state.world_size
    dist.all_gather_object(out, obj, group=state.group)
    out = _keep(out, ranks)
    if all(isinstance(o, (list, tuple)) for o in out):
        return [x for part in out for x in part]
    return out


@tracked("reduce", tree_signature)
def reduce(state: DistributedState, tree: Any, reduction: str = "sum") -> Any:
    """All-reduce every tensor in ``tree`` across processes; returns new tensors (inputs are
    left untouched). ``reduction="mean"`` divides the sum by the world size (integer tensors
    then become floating point); ``"max"``/``"min"`` take the elementwise maximum/minimum.

    Example::

        reduce(state, torch.tensor(float(rank)), reduction="mean")   # tensor(0.5) on 2 processes
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction={reduction!r} is not supported; use one of {_REDUCTIONS}")
    _check_tensor_tree(tree, "reduce")

    def one(t: torch.Tensor) -> torch.Tensor:
        out = t.clone()
        if not _single(state):
            sent = t.to(_device(state), copy=True).contiguous()
            dist.all_reduce(sent, op=_OPS[reduction], group=state.group)
            out = sent.to(t.device)
        if reduction == "mean":
            out = out / state.world_size
        return out

    return tree_map_tensors(one, tree)


@tracked("broadcast", lambda tree, src=0: f"{tree_signature(tree)} from rank {src}")
def broadcast(state: DistributedState, tree: Any, src: int = 0) -> Any:
    """Every rank gets rank ``src``'s tensors (new tensors; inputs are left untouched). All
    ranks must pass tensors of the same shapes and dtypes.

    Example::

        weights = broadcast(state, {"w": w}, src=0)
    """
    _check_src(state, src)
    _check_tensor_tree(tree, "broadcast")
    if _single(state):
        return tree

    def one(t: torch.Tensor) -> torch.Tensor:
        out = t.to(_device(state), copy=True).contiguous()
        dist.broadcast(out, src=src, group=state.group)
        return out.to(t.device)

    return tree_map_tensors(one, tree)


@tracked("broadcast_object_list", lambda objs, src=0: f"{len(objs) if isinstance(objs, list) else objs!r} objects from rank {src}")
def broadcast_object_list(state: DistributedState, object_list: list, src: int = 0) -> list:
    """Overwrite ``object_list`` in place with rank ``src``'s list (same length on every rank)
    and return it.

    Example::

        cfg = broadcast_object_list(state, [load_config() if state.is_main_process else None])[0]
    """
    _check_src(state, src)
    if not isinstance(object_list, list):
        raise TypeError(
            f"broadcast_object_list() needs a list, got {type(object_list).__name__} {_short(object_list)}; "
            f"wrap it: [obj]"
        )
    if not _single(state):
        dist.broadcast_object_list(object_list, src=src, group=state.group)
    return object_list


def _check_src(state: DistributedState, src: int) -> None:
    if not isinstance(src, int) or not 0 <= src < state.world_size:
        raise ValueError(f"src={src!r} is not a rank of this {state.world_size}-process job; use 0..{state.world_size - 1}")


@tracked("pad_across_processes", pad_signature)
def pad_across_processes(
    state: DistributedState, tree: Any, dim: int = 0, pad_index: Any = 0, pad_first: bool = False
) -> Any:
    """Pad every tensor along ``dim`` to the largest size any rank has, so it can be gathered.

    Padding uses ``pad_index`` and goes after the data (before it with ``pad_first=True``).
    0-dim tensors and tensors with fewer than ``dim + 1`` dims are returned unchanged.

    Example::

        # rank 0 has 3 tokens, rank 1 has 5
        padded = pad_across_processes(state, tokens, dim=1, pad_index=tokenizer.pad_token_id)
        all_tokens = gather(state, padded)
    """
    _check_tensor_tree(tree, "pad_across_processes")

    def one(t: torch.Tensor) -> torch.Tensor:
        if _single(state) or t.ndim == 0 or dim >= t.ndim or dim < -t.ndim:
            return t
        d = dim % t.ndim
        size = torch.tensor([t.shape[d]], dtype=torch.int64, device=_device(state))
        sizes = [torch.empty_like(size) for _ in range(state.world_size)]
        dist.all_gather(sizes, size, group=state.group)
        longest = int(max(s.item() for s in sizes))
        if longest == t.shape[d]:
            return t
        shape = list(t.shape)
        shape[d] = longest
        out = t.new_full(shape, pad_index)
        index = [slice(None)] * t.ndim
        index[d] = slice(longest - t.shape[d], longest) if pad_first else slice(0, t.shape[d])
        out[tuple(index)] = t
        return out

    return tree_map_tensors(one, tree)


# [Note: metrics over data-parallel ranks]
# Under tensor or sequence parallelism the ranks of one TP/SP group read the same batch
# (parallel/mesh.py: the loader is sharded by data-parallel rank), so a plain all-gather
# returns every sample tp * sp times, and the even-batching ``remainder`` (counted in samples
# of the global batch) cuts the wrong ones. ``gather_for_metrics`` therefore keeps, from the
# world's gather, only the ranks that share this rank's (sp, tp) place, in data-parallel
# order (``Accelerator._data_ranks``): each sample once. Values a TP group holds replicated
# (labels, whole logits) come back the same on every rank; under SP, per-token values of a
# rank's slice come back as that slice of every sample.
@tracked("gather_for_metrics", lambda tree, remainder=None, ranks=None: tree_signature(tree)
         if _has_tensors(tree) else "")
def gather_for_metrics(state: DistributedState, tree: Any, remainder: Optional[int],
                       ranks: Optional[tuple] = None) -> Any:
    """Gather predictions/labels for metrics and drop the duplicated samples that even
    sharding appended to the last global batch.

    ``remainder`` is how many real samples the gathered (global) batch holds: pass the
    sharded loader's ``remainder`` for its last batch (see
    :func:`mixprec.data.shard_dataloader`) and ``None`` for the other batches (nothing is
    dropped). Non-tensor leaves are gathered with :func:`gather_object`. ``ranks``: the
    ranks holding distinct samples, one per data-parallel rank ([Note: metrics over
    data-parallel ranks]); None: every rank.

    Example::

        for step, (x, y) in enumerate(loader):
            last = step == len(loader) - 1
            preds, labels = gather_for_metrics(
                state, (model(x).argmax(-1), y), loader.batch_sampler.remainder if last else None)
    """
    if remainder is not None and (not isinstance(remainder, int) or remainder < 0):
        raise ValueError(
            f"remainder={remainder!r} must be None or the int number of real samples in the global batch "
            f"(the sharded loader's .remainder for its last batch)"
        )
    has_tensor = []
    tree_map_tensors(lambda t: has_tensor.append(t) or t, tree)
    if has_tensor:
        gathered = gather(state, tree, ranks)
    else:
        gathered = gather_object(state, tree, ranks)
        return gathered if remainder is None else gathered[:remainder]
    if remainder is None:
        return gathered
    return tree_map_tensors(lambda t: t[:remainder], gathered)


@contextlib.contextmanager
def split_between_processes(state: DistributedState, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
    """Give each process its contiguous share of ``inputs`` (a list, tuple, tensor, or a dict
    whose values are lists/tuples/tensors of equal length).

    Shares differ by at most one element, the first ranks getting the extra ones. With
    ``apply_padding=True`` the shorter shares are padded with their last element so every
    share has the same length (so results can be gathered; drop the tail afterwards).

    Example::

        with split_between_processes(state, ["a", "b", "c"]) as mine:
            ...   # rank 0: ["a", "b"], rank 1: ["c"]
    """
    if _single(state):
        yield inputs
        return
    if isinstance(inputs, Mapping):
        lengths = {k: _length(v, f"inputs[{k!r}]") for k, v in inputs.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(
                f"split_between_processes() needs dict values of one length, got lengths {lengths}; "
                f"split them separately or make them the same length"
            )
        yield {k: _share(state, v, apply_padding) for k, v in inputs.items()}
        return
    _length(inputs, "inputs")
    yield _share(state, inputs, apply_padding)


def _length(obj: Any, name: str) -> int:
    if isinstance(obj, torch.Tensor):
        if obj.ndim == 0:
            raise ValueError(f"{name} is a 0-dim tensor {_short(obj)}; pass a tensor with a dim 0 to split")
        return obj.shape[0]
    if isinstance(obj, (list, tuple)):
        return len(obj)
    raise TypeError(
        f"split_between_processes() cannot split {name} of type {type(obj).__name__} {_short(obj)}; "
        f"pass a list, tuple, tensor, or a dict of those"
    )


def _share(state: DistributedState, obj: Any, apply_padding: bool) -> Any:
    n = _length(obj, "inputs")
    per, extra = divmod(n, state.world_size)
    start = state.rank * per + min(state.rank, extra)
    end = start + per + (1 if state.rank < extra else 0)
    part = obj[start:end]
    if apply_padding and extra and n:
        width = math.ceil(n / state.world_size)
        if end - start < width:
            last = obj[end - 1 : end] if end > start else obj[n - 1 : n]
            if isinstance(obj, torch.Tensor):
                part = torch.cat([part] + [last] * (width - (end - start)), dim=0)
            else:
                part = type(obj)(list(part) + list(last) * (width - (end - start)))
    return part

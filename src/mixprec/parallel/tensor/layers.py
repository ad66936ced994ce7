"""Split layers: the collectives of tensor parallelism and the modules that use them.

[Note: TP collectives and their autograd rules]
Megatron's four conjugate operations on the TP group, each an autograd Function:

==================  =============================  ==============================
operation           forward                        backward
==================  =============================  ==============================
``copy_to``         identity                       all-reduce (sum) of the gradient
``reduce_from``     all-reduce (sum)               identity
``gather_from``     all-gather on the last dim     this rank's slice of the gradient
``scatter_to``      this rank's slice (last dim)   all-gather of the gradient
==================  =============================  ==============================

A column-split Linear reads ``copy_to(x)``: every rank's ``x`` is the same, and the gradient
of ``x`` is the sum of every rank's part (each rank only sees its own output features). A
row-split Linear sums its partial products with ``reduce_from``; the gradient of the sum is
the same on every rank. The bias of a row-split Linear is added once, after the sum, on
every rank, so its gradient is the same everywhere. Replicated parameters (norms, biases of
row layers, unsplit embeddings) therefore get the same gradient on every TP rank, with no
TP collective of their own; only the data-parallel engine reduces them, over the DP group.

The collectives go through ``torch.distributed`` on the TP subgroup (the same c10d process
groups the C++ engines resolve by name); sums run in the activation's dtype, as Megatron's
and DeepSpeed's do.

The modules keep their class's identity: a split ``nn.Linear`` is swapped to a subclass of its
own class (``isinstance(m, nn.Linear)`` holds, ``state_dict`` keys are unchanged) whose
``forward`` adds the collectives, and its ``weight``/``bias`` are replaced by this rank's
slice (docs/tensor_parallel.md).
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .plan import LayerPlan, PlanError


@dataclasses.dataclass(frozen=True)
class TPGroup:
    """The TP subgroup this rank belongs to: ``group`` (None when ``size`` is 1)."""

    group: Any
    size: int
    rank: int


# Bytes this process handed to the TP collectives since the last reset, by collective:
# ``all_reduce``: the buffer all-reduced; ``all_gather``: the gathered result (every rank's
# part). What a rank sends follows from the algorithm (ring all-reduce: 2(N-1)/N of the
# buffer; all-gather: (N-1)/N of the result): benchmarks/bench_tp.py converts.
_COUNTERS = {"all_reduce": 0, "all_gather": 0, "all_reduce_calls": 0, "all_gather_calls": 0}


def comm_counters() -> dict:
    """A copy of the TP collective counters (see ``_COUNTERS``)."""
    return dict(_COUNTERS)


def reset_comm_counters() -> None:
    for k in _COUNTERS:
        _COUNTERS[k] = 0


def _all_reduce(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    if tp.size == 1:
        return x
    x = x.contiguous()
    _COUNTERS["all_reduce"] += x.numel() * x.element_size()
    _COUNTERS["all_reduce_calls"] += 1
    dist.all_reduce(x, group=tp.group)
    return x


def _all_gather_last(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    if tp.size == 1:
        return x
    x = x.contiguous()
    _COUNTERS["all_gather"] += x.numel() * x.element_size() * tp.size
    _COUNTERS["all_gather_calls"] += 1
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    dist.all_gather(parts, x, group=tp.group)
    return torch.cat(parts, dim=-1)


def _slice_last(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    if tp.size == 1:
        return x
    n = x.shape[-1]
    if n % tp.size:
        raise PlanError(f"a split input's last dimension {n} is not divisible by the TP size {tp.size}")
    k = n // tp.size
    return x.narrow(-1, tp.rank * k, k).contiguous()


def _conjugate(name: str, forward_op, backward_op) -> type:
    """An autograd Function applying ``forward_op(x, tp)`` forward and
    ``backward_op(grad, tp)`` backward (one row of the table above)."""

    def forward(ctx, x, tp):
        ctx.tp = tp
        return forward_op(x, tp)

    def backward(ctx, g):
        return backward_op(g, ctx.tp), None

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(forward), "backward": staticmethod(backward)})


def _identity(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return x.view_as(x)


def _summed(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return _all_reduce(x.clone(), tp)  # all_reduce is in place: never on autograd's own tensor


_CopyTo = _conjugate("_CopyTo", _identity, _summed)
_ReduceFrom = _conjugate("_ReduceFrom", _summed, _identity)
_GatherFrom = _conjugate("_GatherFrom", _all_gather_last, _slice_last)
_ScatterTo = _conjugate("_ScatterTo", _slice_last, _all_gather_last)


# [Note: one copy_to per shared input]
# q, k and v (and gate and up) read the same input. Each column layer applying its own
# copy_to would all-reduce that input's gradient once per layer in backward (5 per decoder
# layer); Megatron's fused QKV and gate_up need 2. So consecutive column layers given the
# very same tensor (same object, unchanged version, same grad mode) share one copy_to node:
# autograd sums their gradients into it first, and it all-reduces once (the sum of the
# all-reduces equals the all-reduce of the sum). The cache is per thread and holds the input
# weakly; the shared output (a view of the input) is dropped when the input goes. A new
# tensor (the next layer, a checkpoint recompute) is a new entry.
_SHARED = threading.local()


def copy_to(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Identity forward, gradient summed over the TP group (once per shared input:
    [Note: one copy_to per shared input])."""
    if tp.size == 1:
        return x
    key = (id(tp.group), x._version, torch.is_grad_enabled())
    last = getattr(_SHARED, "last", None)
    if last is not None and last[0]() is x and last[1] == key:
        return last[2]
    out = _CopyTo.apply(x, tp)
    local = _SHARED

    def forget(_ref, local=local):
        # x is gone: drop the shared output with it (it views x's storage)
        if getattr(local, "last", None) is not None and local.last[0] is _ref:
            local.last = None

    try:
        _SHARED.last = (weakref.ref(x, forget), key, out)
    except TypeError:  # a tensor type without weak references: no sharing
        _SHARED.last = None
    return out


def reduce_from(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Sum over the TP group forward, identity backward."""
    return _ReduceFrom.apply(x, tp) if tp.size > 1 else x


def gather_from(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """All-gather on the last dimension forward, this rank's slice backward."""
    return _GatherFrom.apply(x, tp) if tp.size > 1 else x


def scatter_to(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """This rank's slice of the last dimension forward, all-gather backward."""
    return _ScatterTo.apply(x, tp) if tp.size > 1 else x


# ------------------------------------------------------------------------ modules
class TPModule:
    """Mixin placed in front of a split module's class. ``_mixprec_tp``: its TP group and
    plan; ``_mixprec_tp_original``: the class to put back (pickles, ``restore``)."""

    _mixprec_tp_original: type
    _mixprec_tp: "TPState"

    def __reduce_ex__(self, protocol):
        import copyreg

        state = self.__getstate__()
        state.pop("_mixprec_tp", None)
        state.pop("_mixprec_casts", None)
        return copyreg._reconstructor, (type(self)._mixprec_tp_original, object, None), state

    def extra_repr(self) -> str:
        base = super().extra_repr()
        st = self._mixprec_tp
        return f"{base}, tp={st.plan.style} {st.tp.rank}/{st.tp.size}"


@dataclasses.dataclass
class TPState:
    tp: TPGroup
    plan: LayerPlan
    vocab_start: int = 0  # vocab: the first id this rank holds
    out_narrow: Optional[tuple] = None  # kv-replicated: (start, length) of the output kept


def _weight(module: nn.Module) -> torch.Tensor:
    """The weight the forward multiplies by: the update's compute-dtype copy where the
    replicated engines keep one ([Note: the update writes the forward's weights] in
    engines/weight_casts.py), else the parameter (autocast casts it)."""
    casts = module.__dict__.get("_mixprec_casts")
    return module.weight if casts is None else casts.weight(module.weight)


class _ColumnLinear(TPModule):
    _mixprec_reads_weight_casts = True

    def forward(self, x):
        st = self._mixprec_tp
        y = F.linear(copy_to(x, st.tp), _weight(self), self.bias)
        if st.plan.style == "column_gather":
            y = gather_from(y, st.tp)
        return y


class _KVReplicatedLinear(TPModule):
    """[Note: KV heads fewer than TP ranks] A key/value projection with fewer heads than TP
    ranks cannot be split on head boundaries. Every rank keeps the whole (replicated) weight,
    computes every head and keeps the one its query heads read (``out_narrow``). Its weight
    and input gradients are then partial, each rank holding its query heads' part: the input
    goes through copy_to (the input gradient summed over TP) and the weight's gradient is
    summed over TP by a hook (``grad_allreduce``), so every rank holds the whole, same
    gradient and the weight stays replicated."""

    _mixprec_reads_weight_casts = True

    def forward(self, x):
        st = self._mixprec_tp
        start, length = st.out_narrow
        return F.linear(copy_to(x, st.tp), _weight(self), self.bias).narrow(-1, start, length)


class _RowLinear(TPModule):
    _mixprec_reads_weight_casts = True

    def forward(self, x):
        st = self._mixprec_tp
        if st.plan.style == "row_split_input":
            x = scatter_to(x, st.tp)
        y = reduce_from(F.linear(x, _weight(self)), st.tp)
        return y if self.bias is None else y + self.bias


class _VocabEmbedding(TPModule):
    def forward(self, ids):
        st = self._mixprec_tp
        n = self.weight.shape[0]
        local = ids - st.vocab_start
        outside = (local < 0) | (local >= n)
        local = local.masked_fill(outside, 0)
        pad = self.padding_idx - st.vocab_start if self.padding_idx is not None else None
        pad = pad if pad is not None and 0 <= pad < n else None
        out = F.embedding(local, self.weight, pad, self.max_norm, self.norm_type, self.scale_grad_by_freq,
                          self.sparse)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from(out, st.tp)


class _ColEmbedding(TPModule):
    def forward(self, ids):
        st = self._mixprec_tp
        out = F.embedding(ids, self.weight, self.padding_idx, self.max_norm, self.norm_type,
                          self.scale_grad_by_freq, self.sparse)
        return gather_from(out, st.tp)


_MIXINS = {"column": _ColumnLinear, "column_gather": _ColumnLinear, "row": _RowLinear,
           "row_split_input": _RowLinear, "vocab": _VocabEmbedding, "embedding_col": _ColEmbedding}
_CLASSES: dict[tuple[type, type], type] = {}


def _tp_class(cls: type, mixin: type) -> type:
    key = (cls, mixin)
    if key not in _CLASSES:
        new = type(f"{mixin.__name__.lstrip('_')}{cls.__name__}", (mixin, cls), {"_mixprec_tp_original": cls})
        new.__module__ = __name__
        _CLASSES[key] = new
    return _CLASSES[key]


def local_slice(full: torch.Tensor, dim: int, tp: TPGroup, sizes: Optional[tuple]) -> torch.Tensor:
    """This rank's slice of ``full`` along ``dim``: its share of each sub-parameter
    (``sizes``; one when None), concatenated."""
    sizes = sizes or (full.shape[dim],)
    parts, offset = [], 0
    for s in sizes:
        k = s // tp.size
        parts.append(full.narrow(dim, offset + tp.rank * k, k))
        offset += s
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def full_from_local(local: torch.Tensor, dim: int, tp: TPGroup, sizes: Optional[tuple]) -> torch.Tensor:
    """The inverse of :func:`local_slice`, a collective over the TP group: every rank's
    slices gathered and put back in place (every rank gets the full tensor)."""
    if tp.size == 1:
        return local
    local = local.contiguous()
    parts = [torch.empty_like(local) for _ in range(tp.size)]
    dist.all_gather(parts, local, group=tp.group)
    sizes = sizes or (local.shape[dim] * tp.size,)
    pieces = []
    offset = 0
    for s in sizes:
        k = s // tp.size
        pieces.extend(p.narrow(dim, offset, k) for p in parts)
        offset += k
    return torch.cat(pieces, dim=dim)


# Column layers whose output is attention heads (their splits must follow head boundaries).
_ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "query", "key", "value", "qkv_proj", "query_key_value",
                          "Wqkv", "c_attn", "q_b_proj", "kv_b_proj")


def check_divisible(plan: LayerPlan, module: nn.Module, tp: TPGroup, head_dim: Optional[int]) -> None:
    dim = plan.split_dim()
    size = module.weight.shape[dim]
    for s in plan.shape or (size,):
        if s % tp.size:
            raise PlanError(f"{plan.name}: {plan.style} split of dimension {dim} (size {s}) over tensor_parallel.size="
                            f"{tp.size} does not divide; use a TP size that divides {s}, or give this module "
                            "partition_type: skip")
        attention = plan.name.rpartition(".")[2] in _ATTENTION_PROJECTIONS or (
            plan.name.endswith(".base_layer") and plan.name.rsplit(".", 2)[-2] in _ATTENTION_PROJECTIONS)
        if attention and head_dim and plan.style in ("column", "column_gather") and s % head_dim == 0 \
                and (s // head_dim) % tp.size:
            raise PlanError(f"{plan.name}: {s // head_dim} heads of {head_dim} do not divide over "
                            f"tensor_parallel.size={tp.size} (shards follow head boundaries); use a TP size "
                            f"that divides {s // head_dim}")


def replicate_kv_module(module: nn.Module, plan: LayerPlan, tp: TPGroup, head_dim: int, kv_heads: int) -> None:
    """[Note: KV heads fewer than TP ranks]: keep ``module`` whole, narrow its output to the
    key/value head this rank's query heads read (TP rank r: head ``r // (size // kv_heads)``)."""
    per_head = tp.size // kv_heads
    head = tp.rank // per_head
    state = TPState(tp, dataclasses.replace(plan, style="kv_replicated"), out_narrow=(head * head_dim, head_dim))
    object.__setattr__(module, "_mixprec_tp", state)
    module.__class__ = _tp_class(type(module), _KVReplicatedLinear)


def split_module(module: nn.Module, plan: LayerPlan, tp: TPGroup) -> list[tuple[str, nn.Parameter, int]]:
    """Replace ``module``'s weight (and bias where split) by this rank's slice and swap its
    class; returns ``(attr, new parameter, split dim)`` for every parameter it split."""
    mixin = _MIXINS[plan.style]
    dim = plan.split_dim()
    out = []
    with torch.no_grad():
        w = module.weight
        new_w = nn.Parameter(local_slice(w.detach(), dim, tp, plan.shape).clone(), requires_grad=w.requires_grad)
        module.weight = new_w
        out.append(("weight", new_w, dim))
        bias = getattr(module, "bias", None)
        if isinstance(bias, torch.Tensor) and plan.style in ("column", "column_gather") and dim == 0:
            new_b = nn.Parameter(local_slice(bias.detach(), 0, tp, plan.shape).clone(), requires_grad=bias.requires_grad)
            module.bias = new_b
            out.append(("bias", new_b, 0))
    state = TPState(tp, plan)
    if plan.style == "vocab":
        state.vocab_start = tp.rank * module.weight.shape[0]
        module.num_embeddings = module.weight.shape[0]
    elif plan.style == "embedding_col":
        module.embedding_dim = module.weight.shape[1]
    elif isinstance(module, nn.Linear):
        module.out_features, module.in_features = module.weight.shape
    object.__setattr__(module, "_mixprec_tp", state)
    module.__class__ = _tp_class(type(module), mixin)
    return out

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

The modules keep their class and their own ``forward``: hooks put the collectives around it
and its ``weight``/``bias`` are replaced by this rank's slice ([Note: split modules keep their
forward] below; docs/tensor_parallel.md).
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from .plan import SPLIT_STYLES, LayerPlan, PlanError


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
# [Note: split modules keep their forward]
# A split module keeps its class and its own ``forward`` (a subclass's scaling, soft-capping
# or custom code stays: Gemma's scaled embedding multiplies its own lookup). Only its
# parameters become this rank's slices, its size attributes (``out_features``, ``nf``,
# ``num_embeddings``...) follow them, and forward hooks put the collectives around the call:
#
# ==================  ==========================  ======================================
# style               before forward (input)      after forward (output)
# ==================  ==========================  ======================================
# column              copy_to                     (stays split on its last dim)
# column_gather       copy_to                     gather_from
# row                 (split input)               reduce_from; a bias once (below)
# row_split_input     scatter_to                  reduce_from; a bias once
# vocab               ids made local, others 0    rows of others' ids zeroed; reduce_from
# embedding_col       --                          gather_from
# kv_replicated       copy_to                     this rank's key/value head kept
# ==================  ==========================  ======================================
#
# A row-split module's own forward adds its (replicated) bias on every rank, so the sum
# would count it ``size`` times: the hook sums ``y - bias`` and adds the bias back once.
# Every rank then holds the same output and the bias's gradient is the output's gradient
# (``g - g + g``), as without TP; the subtraction is exact up to one rounding of ``y``.
# Under ``torch.compile`` the hooks run eagerly (``torch.compiler.disable``): Dynamo breaks
# the graph around each collective instead of tracing Python-side TP state.


@dataclasses.dataclass
class TPState:
    """What the hooks of one split module need (held by its hooks, not set on the module)."""

    tp: TPGroup
    plan: LayerPlan
    vocab_start: int = 0  # vocab: the first id this rank holds
    vocab_size: int = 0  # vocab: how many ids this rank holds
    out_narrow: Optional[tuple] = None  # kv_replicated: (start, length) of the output kept
    outside: list = dataclasses.field(default_factory=list)  # vocab: masks of ids held elsewhere


def _first_input(args: tuple, kwargs: dict) -> tuple:
    """(the module's input tensor, a function putting a replacement back in its place)."""
    if args:
        return args[0], lambda x: ((x, *args[1:]), kwargs)
    if len(kwargs) >= 1:
        key = next(iter(kwargs))
        return kwargs[key], lambda x: (args, {**kwargs, key: x})
    raise TypeError("a tensor-parallel split module was called without an input")


def _pre_hook(st: TPState):
    style = st.plan.style

    @torch.compiler.disable
    def hook(module, args, kwargs):
        x, put = _first_input(args, kwargs)
        if style in ("column", "column_gather", "kv_replicated"):
            return put(copy_to(x, st.tp))
        if style == "row_split_input":
            return put(scatter_to(x, st.tp))
        if style == "vocab":
            local = x - st.vocab_start
            outside = (local < 0) | (local >= st.vocab_size)
            st.outside.append(outside)
            return put(local.masked_fill(outside, 0))
        return None

    return hook


def _post_hook(st: TPState):
    style = st.plan.style

    @torch.compiler.disable
    def hook(module, args, kwargs, output):
        # always_call: a forward that raised still pops its mask, and its output is None
        outside = st.outside.pop() if style == "vocab" and st.outside else None
        if output is None:
            return None
        if style == "vocab":
            return reduce_from(output.masked_fill(outside.unsqueeze(-1), 0.0), st.tp)
        if style in ("column_gather", "embedding_col"):
            return gather_from(output, st.tp)
        if style in ("row", "row_split_input"):
            bias = getattr(module, "bias", None)
            if not isinstance(bias, torch.Tensor):
                return reduce_from(output, st.tp)
            return (reduce_from(output - bias, st.tp) + bias).to(output.dtype)
        if style == "kv_replicated":
            start, length = st.out_narrow
            return output.narrow(-1, start, length)
        return None

    return hook


def _install_hooks(module: nn.Module, st: TPState) -> None:
    if st.plan.style in ("column", "column_gather", "kv_replicated", "row_split_input", "vocab"):
        module.register_forward_pre_hook(_pre_hook(st), with_kwargs=True)
    if st.plan.style != "column":
        module.register_forward_hook(_post_hook(st), with_kwargs=True, always_call=True)
    module.__dict__.setdefault("_mixprec_tp_states", []).append(st)


def tp_state(module: nn.Module) -> Optional[TPState]:
    """The split state of ``module`` (None where it is not split)."""
    states = module.__dict__.get("_mixprec_tp_states")
    return states[-1] if states else None


def is_conv1d(module: nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2 and its family): a Linear whose weight is stored
    transposed, ``[in, out]`` (``nx``, ``nf``), computing ``x @ weight + bias``."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx") \
        and isinstance(getattr(module, "weight", None), torch.Tensor) and module.weight.dim() == 2


def weight_dims(module: nn.Module) -> tuple[int, int]:
    """(output dim, input dim) of a Linear-like module's weight."""
    return (1, 0) if is_conv1d(module) else (0, 1)


def style_dim(plan: LayerPlan, module: nn.Module) -> Optional[int]:
    """The weight dimension ``plan`` splits on ``module`` (Conv1D's weight is transposed)."""
    if plan.style not in SPLIT_STYLES:
        return None
    if plan.dim is not None:
        return plan.dim
    if plan.style in ("vocab",):
        return 0
    if plan.style == "embedding_col":
        return 1
    out_dim, in_dim = weight_dims(module)
    return out_dim if plan.style in ("column", "column_gather") else in_dim


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
    dim = style_dim(plan, module)
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
    _install_hooks(module, TPState(tp, dataclasses.replace(plan, style="kv_replicated"),
                                   out_narrow=(head * head_dim, head_dim)))


def _refuse_extra_tensors(module: nn.Module, plan: LayerPlan, dim: int) -> None:
    """A module whose own forward also reads a tensor sized like the split dimension (Dory's
    lm_head: a ``logit_scale`` per vocabulary entry) would meet a local slice with a whole
    tensor: refused, naming it, rather than guessed ([Note: split modules keep their forward])."""
    size = module.weight.shape[dim]
    own = [(n, t) for n, t in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
           if n not in ("weight", "bias") and isinstance(t, torch.Tensor) and size in tuple(t.shape)]
    if own:
        names = ", ".join(f"{n} {tuple(t.shape)}" for n, t in own)
        raise PlanError(
            f"{plan.name}: this {type(module).__name__} holds {names} besides its weight, sized like the dimension "
            f"{dim} ({size}) that the {plan.style} split divides; its own forward would combine them with this "
            "rank's slice. mixprec does not split such a module: give it partition_type: skip in "
            "tensor_parallel.partition_config.layer_specs (kept whole on every rank), or train without tensor "
            "parallelism")


def split_module(module: nn.Module, plan: LayerPlan, tp: TPGroup) -> list[tuple[str, nn.Parameter, int]]:
    """Replace ``module``'s weight (and bias where split) by this rank's slice, its size
    attributes by the local ones, and put the collectives around its own forward ([Note:
    split modules keep their forward]); returns ``(attr, new parameter, split dim)`` for every
    parameter it split."""
    if tp_state(module) is not None:
        raise PlanError(f"{plan.name}: this {type(module).__name__} is already split for tensor parallelism; "
                        "prepare a model once (a module shared by two plan entries is split once)")
    dim = style_dim(plan, module)
    _refuse_extra_tensors(module, plan, dim)
    out = []
    with torch.no_grad():
        w = module.weight
        new_w = nn.Parameter(local_slice(w.detach(), dim, tp, plan.shape).clone(), requires_grad=w.requires_grad)
        module.weight = new_w
        out.append(("weight", new_w, dim))
        bias = getattr(module, "bias", None)
        if isinstance(bias, torch.Tensor) and plan.style in ("column", "column_gather") and \
                dim == weight_dims(module)[0]:
            new_b = nn.Parameter(local_slice(bias.detach(), 0, tp, plan.shape).clone(), requires_grad=bias.requires_grad)
            module.bias = new_b
            out.append(("bias", new_b, 0))
    state = TPState(tp, plan)
    # Size attributes say what the code around the module sees: local where its output (a
    # column split) or its input (a row split) stays split, whole where the hooks make it
    # whole again (a gathered output, a vocab split's summed lookups, a row_split_input's
    # whole input): HF reads ``lm_head.out_features`` as the vocabulary size. Conv1D's own
    # forward shapes its output by ``nf``, so its sizes are the local weight's.
    if plan.style == "vocab":
        state.vocab_start = tp.rank * module.weight.shape[0]
        state.vocab_size = module.weight.shape[0]
        pad = module.padding_idx
        # F.embedding masks the padding row's gradient by local index: the local position of
        # the padding id, or none on the ranks that do not hold it.
        if pad is not None:
            pad = pad if pad >= 0 else pad + module.weight.shape[0] * tp.size
            local = pad - state.vocab_start
            module.padding_idx = local if 0 <= local < state.vocab_size else None
    elif is_conv1d(module):
        module.nx, module.nf = module.weight.shape
    elif isinstance(module, nn.Linear):
        out_features, in_features = module.weight.shape
        if plan.style == "column":
            module.out_features = out_features
        elif plan.style == "row":
            module.in_features = in_features
    _install_hooks(module, state)
    return out

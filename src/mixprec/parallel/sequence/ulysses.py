"""Ulysses attention: every ``scaled_dot_product_attention`` of a prepared model over the
whole sequence, each SP rank computing a share of the heads.

[Note: Ulysses around SDPA]
Each rank of an SP group holds the slice ``[r * S/P, (r + 1) * S/P)`` of every sequence;
everything but attention is per token, so only attention needs the other slices. A
``TorchFunctionMode`` entered around the prepared model's forward (``ForwardContext.around``
in wrappers/model.py) sees every call of ``torch.nn.functional.scaled_dot_product_attention``
(HF's "sdpa" attention and plain PyTorch modules alike) and runs it as:

1. q/k/v ``[B, H, S/P, D] -> [B, H/P, S, D]``: one ``all_to_all_single`` on the SP group each
   (works on Gloo; the functional collective with autograd, whose backward exchanges the
   gradient back, and which Dynamo traces into the graph);
2. SDPA over the whole sequence: ``is_causal`` as given (the causal pattern of the whole
   sequence, since the slices are its consecutive parts). When ``prepare_sp_inputs`` was
   given a padding ``attention_mask``, it keeps it whole and hands the model none (a mask
   the model builds from the *local* length is wrong for the whole sequence, and HF picks
   its GQA path by whether a mask exists, which would differ between the ranks and so the
   all-to-all sizes): the whole sequence's causal-and-padding mask (or padding-only for
   ``is_causal=False``) is applied here. A mask the model passes itself is accepted only
   when causal and is then replaced by that whole one;
3. the output ``[B, H/P, S, D] -> [B, H, S/P, D]`` by the inverse all-to-all.

[Note: Ulysses under torch.compile]
Dynamo traces through the mode's handler, so a compiled forward holds the all-to-alls and
the whole-sequence SDPA in its graph. With a backend that runs the graph as torch-level calls
(``backend="eager"``, and the code between graph breaks, e.g. the ddp engine's buffer
broadcast before forward), those calls happen while the mode is still active: an inner call
of ``F.scaled_dot_product_attention`` would be taken for the model's own and exchanged a
second time (wrong values, no error; found by the compiled-forward test). The inner call is
therefore the aten op ``aten.scaled_dot_product_attention``, which the handler passes
through; aot/inductor backends see aten ops in any case.

GQA: key/value heads are split like query heads when the SP size divides their count; with
fewer (or a count P does not divide) each is repeated to ``lcm(KVH, P)`` heads first
(``repeat_interleave``, so query head ``h`` still meets its own key/value head). The
gradients of the repeats add up in the repeat's backward.

Attention that does not call SDPA (HF "eager", a hand-written softmax, a fused module such
as ``nn.MultiheadAttention``) would silently attend within the local slice only. The first
forward of each prepared model is watched: a module whose class name says attention but
that made no SDPA call, or a softmax over a ``[..., S/P, S/P]`` score tensor, raises
:class:`UnsupportedAttentionError` naming the module.
"""

from __future__ import annotations

import contextlib
import copy
import math
from typing import Any, Callable, Optional

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ..mesh import MeshError


class UnsupportedAttentionError(NotImplementedError):
    """An attention that sequence parallelism cannot run over the whole sequence."""


def _all_to_all(x: torch.Tensor, group: Any, size: int, to_heads: bool) -> torch.Tensor:
    """``[B, H, S/P, D] -> [B, H/P, S, D]`` (``to_heads``) or back."""
    b, h, s, d = x.shape
    if to_heads:
        send = x.reshape(b, size, h // size, s, d).transpose(0, 1).contiguous()  # [P, B, H/P, s, D]
    else:
        send = x.reshape(b, h, size, s // size, d).permute(2, 0, 1, 3, 4).contiguous()  # [P, B, h, S/P, D]
    # recv[i]: what rank i sent this rank; the backward is the same exchange of the gradient
    recv = funcol.wait_tensor(funcol.all_to_all_single_autograd(send, None, None, group))
    if to_heads:  # recv[i]: slice i of this rank's heads
        return recv.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * s, d)
    return recv.transpose(0, 1).reshape(b, size * h, s // size, d)  # recv[i]: head group i


def _whole_mask(local: Optional[torch.Tensor], is_causal: bool, whole_padding: Optional[torch.Tensor],
                length: int, batch: int, device: torch.device) -> tuple[Optional[torch.Tensor], bool]:
    """(the whole sequence's mask: causal or not, and padding; is_causal): the mask is None
    where ``is_causal`` says it all."""
    if local is not None:
        s = local.shape[-1]
        if local.dtype != torch.bool or bool(
                torch.triu(torch.ones(s, s, dtype=torch.bool, device=local.device), 1).logical_and(local).any()):
            raise UnsupportedAttentionError(
                f"scaled_dot_product_attention got an attn_mask ({local.dtype}, shape {tuple(local.shape)}) that is "
                "not a boolean causal mask, under sequence parallelism: only causal or full attention over the "
                "whole sequence is supported (is_causal, plus the padding attention_mask given to "
                "prepare_sp_inputs)")
        is_causal = True
    if whole_padding is None:
        return None, is_causal
    if tuple(whole_padding.shape) != (batch, length):
        raise ValueError(f"the attention_mask given to prepare_sp_inputs has shape {tuple(whole_padding.shape)}, "
                         f"this forward's whole sequence is ({batch}, {length}): call prepare_sp_inputs for "
                         "each batch before its forward")
    mask = whole_padding.to(device)[:, None, None, :].expand(batch, 1, length, length)
    if is_causal:
        mask = mask & torch.ones(length, length, dtype=torch.bool, device=device).tril()
    # A query that sees no key (left padding) attends to itself: SDPA would return nan there.
    alone = ~mask.any(-1, keepdim=True)
    return mask | (alone & torch.eye(length, dtype=torch.bool, device=device)), False


class Ulysses:
    """One SP group's attention: the group, and the padding mask of the batch last prepared."""

    def __init__(self, group: Any, size: int, rank: int) -> None:
        self.group = group
        self.size = size
        self.rank = rank
        self.whole_padding: Optional[torch.Tensor] = None  # [B, S] bool, from prepare_sp_inputs
        self.local_length: Optional[int] = None  # S/P of the batch last prepared
        self.calls = 0  # SDPA calls run as Ulysses (the first-forward check counts them)

    def attention(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                  enable_gqa=False):
        p = self.size
        if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
            raise UnsupportedAttentionError(
                f"scaled_dot_product_attention with query of shape {tuple(query.shape)}: sequence parallelism "
                "needs [batch, heads, sequence, head_dim] inputs")
        if key.shape[-2] != query.shape[-2]:
            raise UnsupportedAttentionError(
                f"scaled_dot_product_attention with {query.shape[-2]} queries and {key.shape[-2]} keys: sequence "
                "parallelism supports self-attention over the sliced sequence only (no cross-attention, no cache)")
        heads, kv_heads = query.shape[1], key.shape[1]
        if heads % p:
            raise MeshError(f"attention with {heads} query heads cannot be split over sequence_parallel.size={p}: "
                            f"use a sequence_parallel.size that divides {heads}")
        if kv_heads != heads and kv_heads % p:
            rep = math.lcm(kv_heads, p) // kv_heads
            if heads % (kv_heads * rep):
                raise MeshError(
                    f"attention with {heads} query heads and {kv_heads} key/value heads: repeating the key/value "
                    f"heads to {kv_heads * rep} for sequence_parallel.size={p} does not divide the query heads; "
                    f"use a sequence_parallel.size that divides {kv_heads}")
            key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
        length = query.shape[-2] * p
        if attn_mask is not None or self.whole_padding is not None:
            attn_mask, is_causal = _whole_mask(attn_mask, is_causal, self.whole_padding, length, query.shape[0],
                                               query.device)
        q, k, v = (_all_to_all(t, self.group, p, True) for t in (query, key, value))
        # The aten op, not F.scaled_dot_product_attention: [Note: Ulysses under torch.compile].
        out = _ATEN_SDPA(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=bool(enable_gqa))
        self.calls += 1
        return _all_to_all(out, self.group, p, False)


_SDPA = F.scaled_dot_product_attention
_ATEN_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_SOFTMAX = {torch.softmax, F.softmax, torch.Tensor.softmax}


class _UlyssesMode(TorchFunctionMode):
    def __init__(self, ulysses: Ulysses, watch: Optional["_FirstForwardWatch"]) -> None:
        super().__init__()
        self.ulysses = ulysses
        self.watch = watch

    def recompute_mode(self) -> "_UlyssesMode":
        """The mode an activation checkpoint's recomputation in backward runs in: this SP group
        and the padding mask of the batch this forward saw, unwatched ([Note: recomputation
        replays the forward's modes] in mixprec/activation_checkpointing.py)."""
        return _UlyssesMode(copy.copy(self.ulysses), None)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA:
            return self.ulysses.attention(*args, **kwargs)
        if self.watch is not None and func in _SOFTMAX:
            self.watch.softmax(args[0] if args else kwargs.get("input"))
        return func(*args, **kwargs)


def _looks_like_attention(module: nn.Module) -> bool:
    name = type(module).__name__.lower()
    return "attention" in name or name.endswith("attn")


class _FirstForwardWatch:
    """Names the module that runs attention without SDPA ([Note: Ulysses around SDPA])."""

    def __init__(self, model: nn.Module, ulysses: Ulysses) -> None:
        self.ulysses = ulysses
        self.stack: list[str] = []
        self.silent: list[str] = []  # attention modules whose forward made no SDPA call
        self.handles: list[Any] = []
        named = list(model.named_modules())
        attention = {id(m) for _, m in named if _looks_like_attention(m)
                     and not any(_looks_like_attention(c) for c in m.modules() if c is not m)}
        for name, module in named[1:]:  # the root: this watch runs inside its forward
            is_attention = id(module) in attention
            self.handles.append(module.register_forward_pre_hook(self._enter(name, is_attention)))
            self.handles.append(module.register_forward_hook(self._leave(is_attention), always_call=True))
        self.counts: list[int] = []

    def _enter(self, name: str, is_attention: bool) -> Callable:
        def hook(module, args):
            self.stack.append(f"{name!r} ({type(module).__name__})")
            if is_attention:
                self.counts.append(self.ulysses.calls)
        return hook

    def _leave(self, is_attention: bool) -> Callable:
        def hook(module, args, output):
            where = self.stack.pop() if self.stack else "?"
            if is_attention and self.counts and self.counts.pop() == self.ulysses.calls:
                self.silent.append(where)
        return hook

    def softmax(self, scores: Any) -> None:
        n = self.ulysses.local_length
        if isinstance(scores, torch.Tensor) and n and scores.dim() >= 2 and scores.shape[-1] == scores.shape[-2] == n:
            where = self.stack[-1] if self.stack else "the model"
            raise UnsupportedAttentionError(
                f"module {where} computes a softmax over a [{n}, {n}] score matrix: a hand-written attention, "
                "which under sequence parallelism would attend within this rank's slice only. Call "
                "torch.nn.functional.scaled_dot_product_attention instead (HF models: attn_implementation='sdpa')")

    def close(self) -> None:
        for h in self.handles:
            h.remove()

    def check(self) -> None:
        if self.silent:
            raise UnsupportedAttentionError(
                f"module {self.silent[0]} ran attention without torch.nn.functional.scaled_dot_product_attention "
                f"({len(self.silent)} such module(s)); under sequence parallelism only SDPA runs over the whole "
                "sequence. Use SDPA (HF models: attn_implementation='sdpa')")


def check_model(model: nn.Module) -> None:
    """Refuse, at ``prepare()``, an HF model configured for an attention other than SDPA."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl is not None and impl != "sdpa":
        raise UnsupportedAttentionError(
            f"{type(model).__name__} uses attn_implementation={impl!r}; sequence parallelism runs "
            "torch.nn.functional.scaled_dot_product_attention only: load or build the model with "
            "attn_implementation='sdpa'")


def forward_context(model: nn.Module, ulysses: Ulysses) -> Callable[[], Any]:
    """The context a prepared model's forward runs in (``ForwardContext.around``); the first
    forward is watched for attention that bypasses SDPA."""
    checked = [False]

    @contextlib.contextmanager
    def around():
        if checked[0]:
            with _UlyssesMode(ulysses, None):
                yield
            return
        watch = _FirstForwardWatch(model, ulysses)
        try:
            with _UlyssesMode(ulysses, watch):
                yield
        finally:
            watch.close()
        watch.check()
        checked[0] = True

    return around

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
   when causal and is then replaced by that whole one (a local mask with padding in it and
   no padding given to ``prepare_sp_inputs`` is refused: it cannot be made whole). A query
   that sees no key (the last left-padding token under a causal mask) keeps its all-False
   row, exactly what HF hands SDPA on one process (transformers' ``sdpa_mask`` adds no fix
   for such rows), so SDPA returns the same output (0 for such a row since torch 2.5) and
   the target that query predicts, the first real token, gets one process's loss;
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

[Note: unsliced inputs under SP]
A forward given the whole sequence on every SP rank (``prepare_sp_inputs`` forgotten)
would run without error: the all-to-all takes each rank's copy for a slice and attends over
P copies of the sequence, a different loss. Two checks make it an error naming
``prepare_sp_inputs``, raised on every rank of the group alike (no rank is left waiting in
an all-to-all):

- the length rule, every SDPA call, no communication: ``prepare_sp_inputs`` records the
  whole length ``S`` of the batch it sliced; attention over ``S`` tokens on one rank is that
  batch unsliced. It holds whatever the model is given (``**batch``, only ``input_ids``,
  embeddings), and a sliced batch never meets it (its attention sees ``S/P``), whatever its
  contents: constant tokens, or packed documents whose positions repeat across slices;
- the first forward of each prepared model also gathers, over the SP group, each rank's
  query length, recorded length and a fingerprint of the first attention's queries (one
  ``all_gather`` of 6 numbers, the last for the padding check of 2.). With nothing recorded
  on any rank (inputs sliced by hand, or not at all), equal queries on every rank are the
  same sequence: refused. Ranks that
  disagree about what was recorded (one called ``prepare_sp_inputs``, another not) are
  refused too. Inputs sliced by hand pass (different tokens give different queries); a
  recorded batch is judged by the length rule alone, so a sliced batch whose slices
  happen to be equal is never refused.

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
import re
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


_LOCAL_PADDING = (
    "scaled_dot_product_attention got a causal mask with padding (shape {}) under sequence parallelism: a mask "
    "the model builds from its slice cannot be made whole. Pass the padding attention_mask to "
    "accelerator.prepare_sp_inputs(input_ids=..., attention_mask=...) and call the model with the batch it returns "
    "(it hands the model no mask)")


def _has_padding(local: torch.Tensor) -> bool:
    """Whether a boolean mask hides a key that the causal pattern shows (padding)."""
    s = local.shape[-1]
    below = torch.ones(local.shape[-2], s, dtype=torch.bool, device=local.device).tril()
    return bool(below.logical_and(local.logical_not()).any())


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
        if whole_padding is None and _has_padding(local):
            raise ValueError(_LOCAL_PADDING.format(tuple(local.shape)))
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
    # A query that sees no key keeps its all-False row, as on one process ([Note: Ulysses
    # around SDPA], 2.).
    return mask, False


class Ulysses:
    """One SP group's attention: the group, and the padding mask of the batch last prepared."""

    def __init__(self, group: Any, size: int, rank: int) -> None:
        self.group = group
        self.size = size
        self.rank = rank
        self.whole_padding: Optional[torch.Tensor] = None  # [B, S] bool, from prepare_sp_inputs
        self.local_length: Optional[int] = None  # S/P of the batch last prepared
        self.whole_length: Optional[int] = None  # S of the batch last prepared
        self.calls = 0  # SDPA calls run as Ulysses (the first-forward check counts them)

    def _unsliced(self, length: int) -> str:
        return (f"this forward's attention runs over {length} tokens on each of the sequence_parallel.size="
                f"{self.size} ranks")

    _FIX = ("under sequence parallelism every rank of an SP group must get its slice of the sequence: "
            "batch = accelerator.prepare_sp_inputs(input_ids=..., labels=..., attention_mask=...), then "
            "model(**batch) (or sequence_parallel.prepare_batches: true for a prepared DataLoader)")

    def check_sliced(self, query: torch.Tensor) -> None:
        """The length rule of [Note: unsliced inputs under SP] (every SDPA call)."""
        length = query.shape[-2]
        if self.whole_length is not None and length == self.whole_length:
            raise ValueError(
                f"{self._unsliced(length)}, the whole length of the batch accelerator.prepare_sp_inputs last sliced "
                f"({self.local_length} per rank): the model was given the unsliced sequence; {self._FIX}")

    def check_sliced_across(self, query: torch.Tensor, attn_mask: Optional[torch.Tensor]) -> None:
        """The first forward's check of [Note: unsliced inputs under SP]: one all_gather on
        the SP group, the same verdict on every rank. A mask with padding that the model
        built from its slice is refused here too, on every rank (HF builds one only on the
        ranks whose slice holds padding)."""
        q = query.detach().to(torch.float64)
        padded = (attn_mask is not None and attn_mask.dtype == torch.bool and self.whole_padding is None
                  and _has_padding(attn_mask))
        where = torch.arange(1, q.shape[-2] + 1, dtype=torch.float64, device=q.device).view(-1, 1)
        mine = torch.stack([q.new_tensor(float(q.shape[-2])), q.new_tensor(float(self.whole_length or 0)),
                            q.sum(), (q * q).sum(), (q * where).sum(), q.new_tensor(float(padded))])
        rows = funcol.wait_tensor(_ALL_GATHER(mine, 0, self.group)).view(self.size, 6).tolist()
        if any(r[5] for r in rows):
            raise ValueError(_LOCAL_PADDING.format(
                tuple(attn_mask.shape) if padded else "on another rank of this SP group"))
        rows = [r[:5] for r in rows]
        recorded = {int(r[1]) for r in rows}
        if any(int(r[1]) == int(r[0]) for r in rows):
            raise ValueError(
                f"{self._unsliced(int(rows[0][0]))}, the whole length of the batch accelerator.prepare_sp_inputs last "
                f"sliced: the model was given the unsliced sequence; {self._FIX}")
        if len(recorded) > 1:
            raise ValueError(
                "the ranks of this SP group disagree about the batch accelerator.prepare_sp_inputs sliced (whole "
                f"lengths {[int(r[1]) for r in rows]} by rank, 0: never called): every rank of the group must call it "
                f"with the same whole batch before each forward; {self._FIX}")
        first = torch.tensor(rows[0], dtype=torch.float64)
        if recorded == {0} and all(torch.allclose(torch.tensor(r, dtype=torch.float64), first, rtol=1e-6, atol=0.0)
                                   for r in rows[1:]):
            raise ValueError(
                f"{self._unsliced(int(rows[0][0]))} and every rank's queries are the same: each rank was given the "
                f"same whole sequence, and accelerator.prepare_sp_inputs was never called; {self._FIX}")

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
        self.check_sliced(query)
        length = query.shape[-2] * p
        if attn_mask is not None or self.whole_padding is not None:
            attn_mask, is_causal = _whole_mask(attn_mask, is_causal, self.whole_padding, length, query.shape[0],
                                               query.device)
        q, k, v = (_all_to_all(t, self.group, p, True) for t in (query, key, value))
        # The aten op, not F.scaled_dot_product_attention: [Note: Ulysses under torch.compile].
        out = _ATEN_SDPA(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=bool(enable_gqa))
        self.calls += 1
        return _all_to_all(out, self.group, p, False)


# all_gather_tensor is deprecated for all_gather_single in newer torch (same arguments).
_ALL_GATHER = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_SDPA = F.scaled_dot_product_attention
_ATEN_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_SOFTMAX = {torch.softmax, F.softmax, torch.Tensor.softmax}


class _UlyssesMode(TorchFunctionMode):
    def __init__(self, ulysses: Ulysses, watch: Optional["_FirstForwardWatch"],
                 window: Optional[tuple[int, str]] = None) -> None:
        super().__init__()
        self.ulysses = ulysses
        self.watch = watch
        self.window = window  # [Note: windowed attention under SP]

    def recompute_mode(self) -> "_UlyssesMode":
        """The mode an activation checkpoint's recomputation in backward runs in: this SP group
        and the padding mask of the batch this forward saw, unwatched ([Note: recomputation
        replays the forward's modes] in mixprec/activation_checkpointing.py)."""
        return _UlyssesMode(copy.copy(self.ulysses), None, self.window)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA:
            query = args[0] if args else kwargs["query"]
            if self.window is not None and query.shape[-2] * self.ulysses.size > self.window[0]:
                raise UnsupportedAttentionError(
                    f"this forward's sequence has {query.shape[-2] * self.ulysses.size} tokens, more than the "
                    f"{self.window[1]}: under sequence parallelism each rank's slice is shorter than the window, "
                    "so the model builds a plain causal mask and the window would be lost (a different model). "
                    f"Train with sequences of at most {self.window[0]} tokens, or sequence_parallel.size: 1")
            if self.watch is not None and not self.watch.sliced_checked:
                self.watch.sliced_checked = True  # the first attention of the first forward
                self.ulysses.check_sliced_across(query, args[3] if len(args) > 3 else kwargs.get("attn_mask"))
            return self.ulysses.attention(*args, **kwargs)
        if self.watch is not None and func in _SOFTMAX:
            self.watch.softmax(args[0] if args else kwargs.get("input"))
        return func(*args, **kwargs)


# [Note: windowed attention under SP]
# A sliding-window layer (HF: ``module.sliding_window``, or Mistral's ``config.sliding_window``
# on every layer) or chunked attention (Llama 4's ``attention_chunk_size``) gets its window
# from the mask the model builds. Under SP the model builds it over its slice of S/P tokens:
# the window is not visible there when S/P <= window, and Ulysses replaces the (causal-looking)
# mask by the whole sequence's causal mask, so a sequence longer than the window would attend
# past it, silently. Such models run only while the whole sequence fits in the smallest
# window (where the window changes nothing); a longer sequence raises at that forward, naming
# the module and the window. (Sequences within the window are the model matrix's case.)
def _window_limit(model: nn.Module) -> Optional[tuple[int, str]]:
    """(the smallest attention window of ``model``, its description), or None."""
    best: Optional[tuple[int, str]] = None

    def offer(size: Any, what: str) -> None:
        nonlocal best
        if isinstance(size, int) and not isinstance(size, bool) and size > 0 and (best is None or size < best[0]):
            best = (size, what)

    for path, module in model.named_modules():
        if not _looks_like_attention(module):
            continue
        cfg = getattr(module, "config", None)
        where = f"module {path!r} ({type(module).__name__})"
        if "sliding_window" in vars(module):
            offer(module.sliding_window, f"sliding window of {module.sliding_window} tokens of {where}")
        elif cfg is not None and getattr(cfg, "use_sliding_window", True) is not False:
            window = getattr(cfg, "sliding_window", None)
            offer(window, f"sliding window of {window} tokens of {where} (config.sliding_window)")
    cfg = getattr(model, "config", None)
    chunk = getattr(cfg, "attention_chunk_size", None)
    kinds = getattr(cfg, "layer_types", None) or ()
    if chunk is not None and (not kinds or "chunked_attention" in kinds):
        offer(chunk, f"attention chunk of {chunk} tokens of {type(model).__name__} (config.attention_chunk_size)")
    return best


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
        self.sliced_checked = False  # [Note: unsliced inputs under SP], the gathered check

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


# [Note: sequence mixing outside SDPA]
# Ulysses makes scaled_dot_product_attention see the whole sequence; every other op of the
# model runs on this rank's slice. That is right only for ops that are per token. A module
# that mixes tokens some other way runs over the slice alone and gives a different model, with
# no error: a causal convolution over the sequence (Mamba, gated DeltaNet, short-convolution
# layers: an nn.Conv1d with a kernel wider than 1), a recurrence or linear attention (state
# carried along the sequence: Mamba, DeltaNet, lightning/linear attention, RWKV, retention),
# or an attention that builds its own float mask or position bias from the local length
# (found silently wrong by the model matrix, tests/distributed/test_model_matrix.py:
# falcon_h1, lfm3, qwen3_next, qwen3_5, lara_mini, inkling...). ``check_model`` refuses them at
# prepare(), naming the module, by three signals in this order: the modules (an nn.Conv1d
# with kernel > 1, a class name of a known sequence mixer, an attention-like class that
# defines its own mask method), then the config's per-layer kinds (``layer_types`` and its
# variants naming a non-attention mixer). The first forward's watch (_FirstForwardWatch) stays
# the second line: attention-named modules that make no SDPA call, softmax over a local
# [S/P, S/P] score matrix.
# Words of a class name (CamelCase split, lower case) that name a sequence mixer, alone or as
# consecutive words (SeedOssModel holds the letters "ssm" but not the word).
_MIXER_WORDS = {("mamba",), ("mamba2",), ("ssm",), ("s4",), ("s6",), ("rwkv",), ("retention",), ("hyena",),
                ("recurrent",), ("lstm",), ("rglru",), ("mixer",), ("delta",), ("deltanet",), ("lightning",),
                ("linear", "attention"), ("short", "conv"), ("short", "convolution"), ("causal", "conv")}


def _mixer_name(cls_name: str) -> bool:
    words = [w.lower() for w in re.findall(r"[A-Z]+(?=[A-Z][a-z]|\d|$)|[A-Z]?[a-z]+|\d+", cls_name)]
    return any(tuple(words[i:i + n]) in _MIXER_WORDS for n in (1, 2) for i in range(len(words)))


_MIXER_KINDS = re.compile(r"linear|lightning|delta|mamba|ssm|conv|recurrent|rwkv|retention|hybrid|gdn|kda",
                          re.IGNORECASE)
_LAYER_KIND_KEYS = ("layer_types", "layers_block_type", "block_types", "layers_block_types",
                    "hybrid_override_pattern")
_SP_FIX = ("sequence parallelism runs only scaled_dot_product_attention over the whole sequence, every other "
           "op on this rank's slice of it. Train this model with sequence_parallel.size: 1 (to save memory: "
           "tensor_parallel.size, fsdp/zero3 or activation_checkpointing)")


def _own_mask_method(cls: type) -> Optional[str]:
    """A method with 'mask' in its name that an attention class (or a base of it below
    nn.Module) defines: the attention builds its own mask (e.g. a dynamic float mask)."""
    for klass in cls.__mro__:
        if klass is nn.Module or klass is object:
            break
        for name, value in vars(klass).items():
            if "mask" in name.lower() and callable(value):
                return f"{klass.__name__}.{name}"
    return None


def _sequence_mixers(model: nn.Module) -> list[str]:
    """The modules of [Note: sequence mixing outside SDPA], each as ``module 'path' (Class):
    why``: a module whose class names a sequence mixer (the innermost such, e.g. the gated
    DeltaNet rather than its decoder layer), an nn.Conv1d over the sequence that no named
    mixer holds, an attention-like module with its own mask method."""
    named = list(model.named_modules())

    def under(path: str, paths: list[str]) -> bool:
        return any(p != path and (p == "" or path.startswith(p + ".")) for p in paths)

    by_name = [p for p, m in named if _mixer_name(type(m).__name__)]
    by_name = [p for p in by_name if not any(under(q, [p]) for q in by_name)]  # innermost
    found: list[str] = []
    for path, module in named:
        cls = type(module).__name__
        why = None
        if path in by_name:
            why = ("a recurrent / linear-attention / state-space / convolutional sequence mixer, which would carry "
                   "its state within this rank's slice only")
        elif isinstance(module, nn.Conv1d) and module.kernel_size[0] > 1 and not under(path, by_name):
            why = (f"a convolution over the sequence (kernel {module.kernel_size[0]}), which would convolve within "
                   "this rank's slice")
        elif _looks_like_attention(module) and (method := _own_mask_method(type(module))):
            why = (f"an attention that builds its own mask ({method}) from this rank's slice, not the whole "
                   "sequence's causal mask")
        if why is not None:
            found.append(f"module {path or '(the model)'!r} ({cls}): {why}")
    return found


def _layer_kinds(model: nn.Module) -> list[str]:
    """Layers the config declares a non-attention sequence mixer (``layer_types`` and its
    variants; ``hybrid_override_pattern``: 'M' is a Mamba layer)."""
    config = getattr(model, "config", None)
    if config is None:
        return []
    configs = [config]
    text = getattr(config, "get_text_config", None)
    if callable(text):
        try:
            configs.append(text())
        except Exception:  # noqa: BLE001 - a config without a text part
            pass
    layers = next((p for p, m in model.named_modules() if isinstance(m, nn.ModuleList)
                   and p.rsplit(".", 1)[-1] in ("layers", "h", "blocks", "layer")), None)
    out: list[str] = []
    for cfg in configs:
        for key in _LAYER_KIND_KEYS:
            kinds = getattr(cfg, key, None)
            if isinstance(kinds, str):
                bad = [(i, k) for i, k in enumerate(kinds) if k == "M"]
            elif isinstance(kinds, (list, tuple)):
                bad = [(i, k) for i, k in enumerate(kinds) if isinstance(k, str) and _MIXER_KINDS.search(k)]
            else:
                continue
            for i, kind in bad:
                where = f", module {layers}.{i}" if layers is not None else ""
                out.append(f"config.{key}[{i}] = {kind!r} (a non-attention sequence mixer{where})")
        if out:
            break
    return out


def check_model(model: nn.Module) -> None:
    """Refuse, at ``prepare()``, a model that sequence parallelism would run wrong: an HF model
    configured for an attention other than SDPA, or one that mixes the sequence outside
    attention ([Note: sequence mixing outside SDPA])."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl is not None and impl != "sdpa":
        raise UnsupportedAttentionError(
            f"{type(model).__name__} uses attn_implementation={impl!r}; sequence parallelism runs "
            "torch.nn.functional.scaled_dot_product_attention only: load or build the model with "
            "attn_implementation='sdpa'")
    found = _sequence_mixers(model) or _layer_kinds(model)
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise UnsupportedAttentionError(
            f"{type(model).__name__} cannot run under sequence parallelism: {found[0]}{more}. {_SP_FIX}")


def forward_context(model: nn.Module, ulysses: Ulysses) -> Callable[[], Any]:
    """The context a prepared model's forward runs in (``ForwardContext.around``); the first
    forward is watched for attention that bypasses SDPA."""
    checked = [False]
    window = _window_limit(model)

    @contextlib.contextmanager
    def around():
        if checked[0]:
            with _UlyssesMode(ulysses, None, window):
                yield
            return
        watch = _FirstForwardWatch(model, ulysses)
        try:
            with _UlyssesMode(ulysses, watch, window):
                yield
        finally:
            watch.close()
        watch.check()
        checked[0] = True

    return around

"""The forward's low-precision weights, written by the optimizer update.

[Note: the update writes the forward's weights]
Under ``mixed_precision="bf16"`` (or fp16) the weights stay fp32 and autocast casts each
``nn.Linear`` (and convolution) weight to the compute dtype in every forward: a read of 4 bytes and a write
of 2 per parameter, at the point where the step is waiting for it. The fused optimizer
update (csrc/kernels) already reads every updated weight and can write a low-precision
copy in the same pass (it does so for the fp32 masters' low-precision params). So for
each large fp32 weight of a plain ``nn.Linear`` or ``nn.Conv1d/2d/3d`` that a
fused-eligible optimizer steps, :class:`WeightCasts` keeps a compute-dtype copy that the
update rewrites, and the module's forward uses that copy instead of autocast's cast.

Same numbers as autocast, bitwise:

- The copy is the fp32 weight rounded to nearest-even, as ``Tensor.to`` rounds (the
  kernels' lowp store, csrc/kernels/cpu/simd/vec_io.h).
- :class:`_UseCast` stands where autocast's cast stands in the graph: forward gives the
  copy, backward casts the gradient to fp32, as autocast's cast does.
- Within one forward of a prepared model a weight used twice gets the same tensor (the
  memo), as autocast's cast cache gives the same cast, so its two gradients add up in the
  compute dtype as they do under autocast. (Under a ``torch.autocast`` the user opened
  around several forwards, torch's cache spans all of them and ours one forward: a weight
  shared across those forwards then sums its gradients in fp32. That is the only
  difference, and it is more precise.)

When the copy is used: autocast on for the device with the copy's dtype (an
``Accelerator.autocast(enabled=False)`` region or a keep_fp32 module gets the fp32
weight), and the weight unchanged since the copy was written: same ``_version`` and same
storage. Any in-place write torch sees (``load_state_dict``, ``torch.no_grad(): p.copy_``,
a non-fused optimizer, ``model.to``) makes the copy stale; the forward then falls back to
autocast's cast, and the next fused update re-casts stale copies before it runs, so a step
skipped on the device (found_inf) keeps weight and copy in agreement. A write through
``p.data`` is invisible to torch's version counter and so to this check: write weights
through ``p`` under ``torch.no_grad()`` (as ``load_state_dict`` does), or set
``cache_weight_casts: false``.

The kernels bump the copy's version when they rewrite it, so a backward run after the
step through a graph that saved the old copy raises torch's "modified by an inplace
operation" error, as it does for fp32 weights.

Cost: a persistent copy in the compute dtype of each cached weight (2 bytes per parameter
between steps; during forward and backward autocast holds such copies anyway), and a
2-byte write per parameter in the update. Only weights of at least ``MIN_NUMEL`` elements
are cached: below that the Python call costs more than the cast it saves.

Used by the replicated engines (single, ddp), whose optimizer steps the model's own
parameters; the sharded engines keep autocast's casts, and so does a forward that
``torch.compile`` traces.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch
from torch import nn

from ..wrappers.model import SwappedForward

MIN_NUMEL = 1 << 15  # weights below this keep autocast's cast


class _UseCast(torch.autograd.Function):
    """``weight.to(dtype)`` in the graph, with the value the update already wrote."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, copy: torch.Tensor) -> torch.Tensor:
        # An alias, not ``copy`` itself: autograd would make a returned input a view, and
        # then forbid the update's in-place write to its base. The alias shares the copy's
        # version counter, so a graph that saved it notices the update.
        return copy.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.to(torch.float32), None


class _Entry:
    """A weight and its copy. Fresh while nothing but the fused update wrote either: the
    update bumps the versions of both, once each (csrc/kernels/ops.cpp, ``bump_versions``,
    a step skipped on the device included), so their difference stays what it was when the
    copy was made, and no per-step bookkeeping is needed; any other in-place write moves it."""

    __slots__ = ("copy", "param", "ptr", "offset")

    def __init__(self, param: torch.Tensor, dtype: torch.dtype) -> None:
        # No copy until the first update: until then the forward casts as autocast does (the
        # same rounding), and prepare() does not hold a second copy of every weight while
        # the model is still being loaded. The first before_update() makes it (not fresh).
        self.param = param
        self.copy = torch.empty(0, dtype=dtype, device=param.device)
        self.offset, self.ptr = None, None

    def stamp(self) -> None:
        """The copy now holds the weight rounded: remember how their versions relate."""
        p = self.param
        self.offset = p._version - self.copy._version
        self.ptr = p.data_ptr()

    def fresh(self) -> bool:
        p = self.param
        return p._version - self.copy._version == self.offset and p.data_ptr() == self.ptr


class WeightCasts:
    """Compute-dtype copies of large fp32 Linear/Conv weights, kept current by the fused update
    (see [Note: the update writes the forward's weights])."""

    def __init__(self, dtype: torch.dtype, device_type: str) -> None:
        self.dtype = dtype  # the autocast compute dtype
        self.device_type = device_type
        self.candidates: dict[int, torch.Tensor] = {}  # id(weight) -> weight of a swapped Linear
        self.entries: dict[int, _Entry] = {}  # id(weight) -> its copy, once an optimizer holds it
        self.targets: dict[int, torch.Tensor] = {}  # id(weight) -> copy: what the update writes
        # This thread's forward: its graph nodes per weight and the nesting depth (a
        # forward run in another thread has its own, as autocast's cast cache is per thread).
        self._local = threading.local()

    # ----------------------------------------------------------------- prepare
    def install(self, model: nn.Module, skip: Iterable[nn.Module] = ()) -> int:
        """Route the large fp32 weights of ``model``'s plain ``nn.Linear`` and
        ``nn.Conv1d/2d/3d`` modules (not in ``skip``) through this cache. Returns how many
        modules were swapped."""
        skipped = {id(m) for s in skip for m in s.modules()}
        swapped = 0
        for m in model.modules():
            # A module swapped for an earlier engine (prepared again after free_memory, or
            # by another Accelerator) now answers to this one.
            # A class that reads its weight through ``_mixprec_casts`` itself (tensor-parallel
            # split Linears, parallel/tensor/layers.py) takes the cache without a swap.
            own = getattr(type(m), "_mixprec_reads_weight_casts", False)
            cls = type(m) if own or isinstance(m, _CachedCast) else _SWAPS.get(type(m))
            if cls is None or id(m) in skipped:
                continue
            w = m.weight
            if not (w.requires_grad and w.dtype == torch.float32 and w.numel() >= MIN_NUMEL):
                continue
            object.__setattr__(m, "_mixprec_casts", self)
            m.__class__ = cls
            self.candidates[id(w)] = w
            swapped += 1
        return swapped

    def release(self) -> None:
        """Drop every copy (the engine is released): the swapped modules fall back to
        autocast's casts until a new engine prepares them."""
        self.candidates.clear()
        self.entries.clear()
        self.targets.clear()

    def track(self, params: Iterable[torch.Tensor]) -> None:
        """The optimizer stepping these params will keep their copies current."""
        for p in params:
            if id(p) in self.candidates and id(p) not in self.entries:
                self.entries[id(p)] = _Entry(p, self.dtype)  # a target once its copy exists

    # ------------------------------------------------------------------ update
    def before_update(self) -> None:
        """Re-cast the copies whose weights changed outside the fused update, so that the
        update (or a skip of it) leaves every copy in agreement with its weight."""
        for e in self.entries.values():
            if not e.fresh():
                p = e.param
                if e.copy.shape != p.shape or e.copy.device != p.device:
                    e.copy = p.detach().to(self.dtype)
                    # A new mapping, not an entry changed in place: the fused step's plan
                    # holds the old one's tensors ([Note: the step plan] in kernels.py).
                    self.targets = {**self.targets, id(p): e.copy}
                else:
                    with torch.no_grad():
                        e.copy.copy_(p)
                e.stamp()

    # ----------------------------------------------------------------- forward
    def begin(self) -> None:
        """A prepared model's forward starts (the memo's lifetime, see the Note)."""
        local = self._local
        depth = getattr(local, "depth", 0)
        if depth == 0:
            local.memo = {} if torch.is_autocast_cache_enabled() else None
        local.depth = depth + 1

    def end(self) -> None:
        local = self._local
        local.depth -= 1
        if local.depth == 0:
            local.memo = None

    def weight(self, w: torch.Tensor) -> torch.Tensor:
        """What the forward multiplies by: the update's copy when it stands for autocast's
        cast of ``w``, else ``w`` itself (autocast casts it as usual)."""
        if torch.compiler.is_compiling():
            return w  # a compiled forward fuses autocast's cast; no Python state in its graph
        e = self.entries.get(id(w))
        if e is None or not e.fresh():
            return w
        dev = self.device_type
        if not torch.is_autocast_enabled(dev) or torch.get_autocast_dtype(dev) != self.dtype:
            return w
        if not (torch.is_grad_enabled() and w.requires_grad):
            return e.copy
        memo = getattr(self._local, "memo", None)
        if memo is None:
            return _UseCast.apply(w, e.copy)
        out = memo.get(id(w))
        if out is None:
            out = memo[id(w)] = _UseCast.apply(w, e.copy)
        return out


class _CachedCast(SwappedForward):
    """Mixin of the swapped classes: named as the original (repr, class-name patterns);
    a copy or a pickle of the module is the plain original class (SwappedForward)."""

    _mixprec_casts: WeightCasts
    _mixprec_attr = "_mixprec_casts"


class _CachedCastLinear(_CachedCast, nn.Linear):
    _mixprec_original = nn.Linear  # restore_class (wrappers/model.py) puts it back

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(input, self._mixprec_casts.weight(self.weight), self.bias)


def _conv_class(conv: type) -> type:
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(input, self._mixprec_casts.weight(self.weight), self.bias)

    return type(f"_CachedCast{conv.__name__}", (_CachedCast, conv),
                {"_mixprec_original": conv, "forward": forward, "__module__": __name__})


# The module classes whose forward is one autocast low-precision op on (input, weight,
# bias): exactly these classes (a subclass may use its weight otherwise).
_SWAPS: dict[type, type] = {nn.Linear: _CachedCastLinear}
_SWAPS.update({c: _conv_class(c) for c in (nn.Conv1d, nn.Conv2d, nn.Conv3d)})
for _original, _swapped in _SWAPS.items():
    _swapped.__name__ = _original.__name__

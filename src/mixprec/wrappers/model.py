"""The prepared model: the user's own module, running its forward under the policy.

[Note: why prepare() swaps the model's class]
``prepare()`` returns the very module it was given (same object, same parameters,
same ``state_dict()`` keys, ``isinstance`` still true), so an Accelerate loop keeps
working unchanged. The forward behaviour is added the way FSDP2's ``fully_shard``
does it: the instance's class becomes a subclass that overrides ``forward``. The
override wraps the original forward in one ``with`` block, so an exception inside
forward can never leave autocast switched on (forward hooks cannot promise that),
and no attribute of the user's object is monkey-patched. ``restore_class`` undoes it.

The same ``with`` block turns a dtype error raised anywhere inside forward into a
:class:`~mixprec.errors.MixprecDtypeError` naming the module, its dtypes and the policy
(see mixprec/diagnostics/locate.py); a ``try`` costs nothing when nothing is raised.
"""

from __future__ import annotations

import contextlib
import copy
import copyreg
import inspect
import threading
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..diagnostics.dtype_errors import explain_dtype_error
from ..policy import PrecisionPolicy
from ..utils import cast_floating, upcast_low_precision
from .half_gemm import HalfGemmMode

_SWAPPED: dict[tuple[type, type], type] = {}


class AutocastGate:
    """Tracks ``Accelerator.autocast(enabled=False)`` regions (per thread) so a prepared
    model does not re-enable autocast inside them."""

    def __init__(self) -> None:
        self._local = threading.local()

    def __deepcopy__(self, memo) -> "AutocastGate":
        # A deep copy of a prepared model (an EMA copy, say) answers to the same
        # Accelerator.autocast regions as the original.
        return self

    def __getstate__(self) -> dict:
        return {}  # the open regions belong to this process's threads

    def __setstate__(self, state: dict) -> None:
        self._local = threading.local()

    def _stack(self) -> list:
        if not hasattr(self._local, "stack"):
            self._local.stack = []
        return self._local.stack

    @contextlib.contextmanager
    def override(self, enabled: bool):
        self._stack().append(enabled)
        try:
            yield
        finally:
            self._stack().pop()

    def blocked(self) -> bool:
        stack = self._stack()
        return bool(stack) and not stack[-1]


class ForwardContext:
    """What a prepared module's forward needs to know: where inputs go, which autocast."""

    def __init__(
        self,
        policy: PrecisionPolicy,
        device_type: str,
        input_dtype: Optional[torch.dtype],
        gate: AutocastGate,
        *,
        fp32_region: bool = False,
        on_zero_grad: Optional[Callable[[nn.Module, bool], None]] = None,
    ) -> None:
        self.policy = policy
        self.device_type = device_type
        self.input_dtype = input_dtype  # dtype floating inputs are cast to (None: untouched)
        self.gate = gate
        self.fp32_region = fp32_region  # a keep_fp32 module: autocast off, fp32 inputs
        self.on_zero_grad = on_zero_grad  # (module, set_to_none): clears grads the engine keeps for it
        self.pre_forward: Optional[Callable[[], None]] = None  # engine work before forward
        # The update's weight copies (engines/weight_casts.py): the forward opens and closes
        # their per-forward memo ([Note: the update writes the forward's weights]).
        self.casts: Any = None
        # The engine's reading of an error raised inside forward: a clearer exception, or None.
        self.explain_error: Optional[Callable[[RuntimeError], Optional[Exception]]] = None
        # zero3/fsdp: the parameters are guarded outside forward ([Note: guarded sharded
        # parameters] in engines/gathered.py); forward runs with subclass torch functions
        # off, so the guard's check costs nothing per op.
        self.plain_params = False
        # zero3/fsdp: the scope generate() runs in (its root unit gathered: [Note: the root
        # unit during generate()] in parallel/generation.py); None elsewhere.
        self.generate_scope: Optional[Callable[[nn.Module], Any]] = None
        # fp16 autocast on a CPU without fp16 arithmetic: the matmuls run as widened fp32
        # GEMMs ([Note: fp16 GEMMs on a CPU without fp16 arithmetic] in wrappers/half_gemm.py).
        self.half_gemm = False
        # A context the whole forward runs in (sequence parallelism's Ulysses attention,
        # parallel/sequence/ulysses.py), entered inside the policy's autocast; None: none.
        self.around: Optional[Callable[[], Any]] = None
        # zero3/fsdp/TP: the module's own parameters are not its full weights; this gathers
        # them (Accelerator.get_state_dict, a collective) for save_pretrained ([Note:
        # save_pretrained of a sharded model]). None: the parameters are the weights.
        self.full_state_dict: Optional[Callable[[], dict]] = None
        # ... and this saves them a tensor at a time instead, where it can:
        # (model, save_directory, the call's arguments by name) -> False where it cannot.
        self.save_pretrained: Optional[Callable[[nn.Module, Any, dict], bool]] = None

    def __deepcopy__(self, memo) -> "ForwardContext":
        # A deep copy of a prepared model (an EMA copy, say) runs its forward under the
        # same policy and autocast gate, without the engine's per-model work: no buffer
        # broadcast (a collective the copy's caller may run on one rank only), no weight
        # copies (they belong to the original's weights), no engine copied along.
        new = copy.copy(self)
        new.pre_forward = None
        new.on_zero_grad = None
        new.casts = None
        new.full_state_dict = None  # the copy's parameters are its own, full ones
        new.save_pretrained = None
        return new

    def run(self, forward: Callable, args: tuple, kwargs: dict) -> Any:
        if self.around is not None:
            with self.around():
                return self._run_plain(forward, args, kwargs)
        return self._run_plain(forward, args, kwargs)

    def _run_plain(self, forward: Callable, args: tuple, kwargs: dict) -> Any:
        if self.plain_params:
            with torch._C.DisableTorchFunctionSubclass():
                return self._run(forward, args, kwargs)
        return self._run(forward, args, kwargs)

    def _run(self, forward: Callable, args: tuple, kwargs: dict) -> Any:
        if self.pre_forward is not None:
            self.pre_forward()
        if self.fp32_region:
            args, kwargs = cast_floating((args, kwargs), torch.float32)
            with torch.autocast(self.device_type, enabled=False):
                return forward(*args, **kwargs)
        if self.input_dtype is not None and self.policy.cast_forward_inputs:
            args, kwargs = cast_floating((args, kwargs), self.input_dtype)
        # The caller's own autocast is kept as it is; an Accelerator.autocast(enabled=False)
        # region stays off. Otherwise forward runs under the policy's compute dtype.
        open_autocast = (
            self.policy.autocast_enabled
            and not torch.is_autocast_enabled(self.device_type)
            and not self.gate.blocked()
        )
        casts = self.casts
        if casts is not None:
            casts.begin()
        try:
            with contextlib.ExitStack() as stack:
                if open_autocast:
                    stack.enter_context(torch.autocast(self.device_type, dtype=self.policy.compute_dtype))
                if self.half_gemm and not torch.compiler.is_compiling():
                    stack.enter_context(HalfGemmMode())
                out = forward(*args, **kwargs)
        except RuntimeError as error:
            if self.explain_error is not None:
                engine_view = self.explain_error(error)
                if engine_view is not None:
                    raise engine_view from error
            # A keep_fp32 region (fp32_region above) lets its errors reach the model's own
            # context, which names the module by its path in the whole model.
            if open_autocast:
                autocast_dtype: Optional[torch.dtype] = self.policy.compute_dtype
            elif torch.is_autocast_enabled(self.device_type):
                autocast_dtype = torch.get_autocast_dtype(self.device_type)
            else:
                autocast_dtype = None
            root = getattr(forward, "__self__", None)
            explained = explain_dtype_error(error, root, self.policy, autocast_dtype)
            if explained is None:
                raise
            raise explained from error
        finally:
            if casts is not None:
                casts.end()
        if self.policy.output_dtype is not None:
            out = upcast_low_precision(out, self.policy.output_dtype)
        return out


class SwappedForward:
    """Base of every class mixprec swaps a module's class to (:func:`restore_class` undoes
    it): ``_mixprec_original`` is the class to put back, ``_mixprec_attr`` the instance
    attribute the swap added.

    A pickle of such a module (``torch.save(model)``) is the user's own class, without the
    swap: it loads where mixprec is not installed, as a module that was never prepared.
    A ``copy.deepcopy`` keeps the swap when ``_mixprec_copy_keeps_swap`` (the policy's
    forward: an EMA copy runs under the same policy, see ForwardContext.__deepcopy__) and
    is the plain class otherwise."""

    _mixprec_original: type
    _mixprec_attr: str
    _mixprec_copy_keeps_swap = False

    def __reduce_ex__(self, protocol):
        state = self.__getstate__()
        state.pop(type(self)._mixprec_attr, None)
        # copyreg._reconstructor: object.__new__(original) then __setstate__, by a stdlib
        # name (pickle's __newobj__ insists on the object's own class).
        return copyreg._reconstructor, (type(self)._mixprec_original, object, None), state

    def __deepcopy__(self, memo):
        swapped = type(self)
        keep = swapped._mixprec_copy_keeps_swap
        cls = swapped if keep else swapped._mixprec_original
        new = cls.__new__(cls)
        memo[id(self)] = new
        state = self.__getstate__()
        if not keep:
            state.pop(swapped._mixprec_attr, None)
        new.__setstate__(copy.deepcopy(state, memo))
        return new


class _MixprecForward(SwappedForward):
    """Mixin placed in front of the user's module class (see the Note above)."""

    _mixprec_ctx: ForwardContext
    _mixprec_attr = "_mixprec_ctx"
    _mixprec_copy_keeps_swap = True

    def forward(self, *args, **kwargs):  # noqa: D401
        return self._mixprec_ctx.run(super().forward, args, kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        # The fp32 master grads of this module's parameters belong with its .grad.
        super().zero_grad(set_to_none)
        hook = self._mixprec_ctx.on_zero_grad
        if hook is not None:
            hook(self, set_to_none)


class _GatheredGenerate:
    """``generate()`` of a model prepared on zero3/fsdp runs with its root unit gathered
    ([Note: the root unit during generate()] in parallel/generation.py); elsewhere (or on a
    copy whose parameters are its own) it is the model's own."""

    def generate(self, *args, **kwargs):
        scope = self._mixprec_ctx.generate_scope
        with scope(self) if scope is not None else contextlib.nullcontext():
            return super().generate(*args, **kwargs)


class _GatheredSavePretrained:
    """[Note: save_pretrained of a sharded model]
    transformers' ``model.save_pretrained(dir, is_main_process=..., save_function=...)``
    reads ``self.state_dict()``; on zero3/fsdp the parameters outside forward hold no data
    (a guarded read raises) and under tensor parallelism they are this rank's slices. For
    a Hugging Face model prepared there, the swapped class (mixin placed only where the
    user's class has ``save_pretrained``) takes the call when the caller gave no
    ``state_dict``; every rank calls it, as the no_trainer scripts do, and the main process
    writes. Called on one rank only, it is the named desync error.

    Streamed (``ForwardContext.save_pretrained``: ``save_pretrained_streamed`` in
    facade/exports.py): the files transformers would write (config and generation config,
    ``model.safetensors`` or shards of ``max_shard_size`` with their index, tied weights and
    ``_keys_to_ignore_on_save`` left out by transformers' own functions, stale shards
    removed) are written by mixprec, one tensor gathered, written and dropped at a time,
    the bits of ``get_state_dict``; no rank ever holds the model. Where transformers must
    see the whole state dict (``push_to_hub``, a PEFT adapter, a quantized model, weight
    conversions to revert, transformers < 5: ``pretrained_unsupported`` in
    compat/export.py names them), the full weights are gathered
    (``ForwardContext.full_state_dict``: ``Accelerator.get_state_dict``) and passed as
    ``state_dict=``, holding the model on every rank, as before. The streamed save does not
    call ``save_function`` (transformers 5 ignores it too: it writes safetensors itself)."""

    def save_pretrained(self, save_directory, *args, **kwargs):
        ctx = self._mixprec_ctx
        gather = ctx.full_state_dict
        if gather is not None and kwargs.get("state_dict") is None and len(args) < 2:
            if ctx.save_pretrained is not None:
                try:
                    bound = inspect.signature(super().save_pretrained).bind(save_directory, *args, **kwargs)
                except TypeError:  # arguments the class does not take: its own call says so below
                    bound = None
                if bound is not None:
                    bound.apply_defaults()
                    if ctx.save_pretrained(self, save_directory, dict(bound.arguments)):
                        return None
            kwargs["state_dict"] = gather()
        return super().save_pretrained(save_directory, *args, **kwargs)


def _forward_signed(cls: type):
    """``_MixprecForward.forward`` showing the signature of ``cls.forward``: callers read the
    forward's parameters (transformers' ``generate`` checks its model kwargs against them,
    the Trainer drops dataset columns the forward does not take)."""
    def forward(self, *args, **kwargs):
        return self._mixprec_ctx.run(super(_MixprecForward, self).forward, args, kwargs)

    try:
        forward.__signature__ = inspect.signature(cls.forward)
    except (TypeError, ValueError):  # a builtin or an odd callable: keep (*args, **kwargs)
        pass
    forward.__doc__ = cls.forward.__doc__
    return forward


def swap_class(module: nn.Module, ctx: ForwardContext) -> None:
    """Make ``module`` run its forward through ``ctx`` (idempotent: re-prepare updates ctx)."""
    cls = type(module)
    if isinstance(module, _MixprecForward):
        object.__setattr__(module, "_mixprec_ctx", ctx)
        return
    key = (cls, _MixprecForward)
    if key not in _SWAPPED:
        extra = (_GatheredSavePretrained,) if callable(getattr(cls, "save_pretrained", None)) else ()
        if callable(getattr(cls, "generate", None)):
            extra += (_GatheredGenerate,)
        _SWAPPED[key] = type(
            cls.__name__,
            (_MixprecForward, *extra, cls),
            {"__module__": cls.__module__, "_mixprec_original": cls, "forward": _forward_signed(cls)},
        )
    object.__setattr__(module, "_mixprec_ctx", ctx)
    module.__class__ = _SWAPPED[key]


def restore_class(module: nn.Module) -> nn.Module:
    """Undo :func:`swap_class` (and every other :class:`SwappedForward` swap) on
    ``module`` and all its submodules."""
    for m in module.modules():
        cls = type(m)
        if isinstance(m, SwappedForward):
            m.__class__ = cls._mixprec_original
            object.__delattr__(m, cls._mixprec_attr)
    return module


def is_prepared(module: nn.Module) -> bool:
    return isinstance(module, _MixprecForward)

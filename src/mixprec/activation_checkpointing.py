"""Activation checkpointing: chosen modules keep only their inputs in forward and recompute
their activations in backward (``torch.utils.checkpoint``, non-reentrant, RNG state kept).

Chosen by the ``activation_checkpointing`` config block (docs/configuration.md): module
class names or dotted paths (``modules``), and/or every sharding unit of zero3/fsdp
(``units: true``, the modules src/mixprec/engines/units.py gathers together). Applied by
``Accelerator.prepare()`` after the engine prepared the model, on every backend.

[Note: checkpointing by class swap]
``prepare()`` returns the user's own module with the same ``state_dict()`` keys, so no
wrapper module is inserted (FSDP's ``checkpoint_wrapper`` adds a
``_checkpoint_wrapped_module.`` level to every key). A chosen module's class becomes a
subclass whose ``forward`` runs the original forward inside ``checkpoint`` (the same move as
src/mixprec/wrappers/model.py makes for the policy's forward); the class keeps its name, so
selection by class name (``zero3.units``, ``keep_fp32_modules``) still sees it. The
modules are chosen before the engine prepares the model (a bad value leaves it untouched)
and swapped after: a keep_fp32 module's policy swap is then inside the checkpoint, so its
fp32 region is part of what is recomputed, and undoing the policy swap
(``restore_class``) keeps the checkpointing.

[Note: what recomputation repeats, and what it does not]
The checkpoint is taken inside ``forward``, i.e. inside ``Module.__call__``: the module's
own forward hooks (zero3/fsdp's gather in its pre-hook, and its post-hook that frees the
unit and registers the backward pre-hook on the outputs) run once, in the real forward,
and not again when backward recomputes. Recomputation runs in the unit's backward, after
that backward pre-hook gathered the unit again, so the parameters it reads are the
gathered ones. Modules *inside* a checkpointed module are called through ``__call__`` again
during recomputation, so their hooks do run again: a nested unit is gathered, freed after
its recomputed forward, and gathered again by the backward pre-hook registered in the real
forward (one extra gather, identical on every rank, so collectives stay in step); the
pre-hook registered on the recomputed outputs never fires (no gradient flows through the
recomputed graph, it only refills saved tensors). Parameters get their gradient through the
real graph only, so the sharding core's count of gradients per parameter (reshard after
backward) sees each exactly once.

Recomputation is bitwise equal to the forward: ``checkpoint`` restores the autocast state of
the forward (enabled, dtype, cache) and the CPU and device RNG states, and mixprec's policy
contexts inside a checkpointed module are keep_fp32 regions, which depend on nothing else.
The model itself (the root) cannot be checkpointed: its ForwardContext also reads
``Accelerator.autocast(enabled=False)`` state and runs the engine's pre-forward work (buffer
broadcasts), which recomputation must not repeat; and recomputing the whole model in
backward would hold all its activations at once, saving nothing at the peak.
"""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Mapping
from typing import Any, Optional, Sequence, Union

import torch
from torch import nn
from torch.overrides import _get_current_function_mode_stack
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .config.fields import ConfigError, block_fields
from .config.resolve import flatten_object
from .config.schema import ActivationCheckpointingOptions
from .engines.units import select_unit_modules
from .logging import get_logger

ModuleSpec = Sequence[Union[str, type]]

_SWAPPED: dict[type, type] = {}


class _CheckpointedForward:
    """Mixin placed in front of a chosen module's class (see [Note: checkpointing by class swap])."""

    _mixprec_ckpt_original: type
    _mixprec_ckpt_selective: bool = False  # set per module by apply()

    def forward(self, *args, **kwargs):  # noqa: D401
        forward = super().forward
        if not torch.is_grad_enabled():  # eval / no_grad: nothing is saved, nothing to recompute
            return forward(*args, **kwargs)
        kwargs = _without_kv_cache(self, kwargs)

        # Keyword arguments are bound here rather than passed through checkpoint(), whose own
        # keywords (use_reentrant, preserve_rng_state, ...) they could collide with.
        def run(*inputs):
            return forward(*inputs, **kwargs)

        return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True,
                          context_fn=_contexts(self._mixprec_ckpt_selective))


# [Note: recomputation replays the forward's modes]
# checkpoint() restores autocast, the RNG states and a device context for the recomputation in
# backward, and no other torch-function mode. Sequence parallelism runs attention through a
# mode entered around the prepared model's forward (src/mixprec/parallel/sequence/ulysses.py),
# which is no longer active in backward: a recomputed attention would attend within the local
# slice. So every active mode that offers ``recompute_mode()`` gives a copy bound to what this
# forward saw (the SP group, the batch's whole padding mask), entered around the recomputation.
def _replayed_modes() -> list[Any]:
    return [m.recompute_mode() for m in _get_current_function_mode_stack() if hasattr(m, "recompute_mode")]


@contextlib.contextmanager
def _entered(*contexts: Any):
    """Enters several context managers (innermost last) as one."""
    with contextlib.ExitStack() as stack:
        for c in contexts:
            stack.enter_context(c)
        yield


# [Note: selective checkpointing]
# ``selective: true`` (AutoSP's): in a chosen module the outputs of the attention kernels
# (every aten SDPA backend: flash, efficient, cuDNN, the CPU flash kernel) and of the
# functional all-to-alls (sequence parallelism's exchanges around attention) are kept from the
# forward; everything else (the projections' matmuls, norms, activations, RoPE) is recomputed
# in backward. The attention's cost is quadratic in the sequence and its output is one
# activation per layer, so keeping it costs little memory and saves most of the recompute
# time; keeping the all-to-all outputs means the recomputation sends nothing. Torch's
# selective-checkpoint contexts do the bookkeeping: the forward records each op's output or
# "recompute", and the recomputation hands back the kept outputs in order. The attention
# math fallback (``_scaled_dot_product_attention_math``, taken e.g. for an fp32 mask with
# dropout) is a composite of ordinary ops and is recomputed like them.
_KEPT_OP_NAMES = (
    ("aten", "_scaled_dot_product_flash_attention"),
    ("aten", "_scaled_dot_product_flash_attention_for_cpu"),
    ("aten", "_scaled_dot_product_efficient_attention"),
    ("aten", "_scaled_dot_product_cudnn_attention"),
    ("aten", "_scaled_dot_product_fused_attention_overrideable"),
    ("aten", "_flash_attention_forward"),
    ("aten", "_efficient_attention_forward"),
    ("_c10d_functional", "all_to_all_single"),
    ("_c10d_functional_autograd", "all_to_all_single"),
)
_KEPT_OPS: Optional[frozenset] = None


def kept_ops() -> frozenset:
    """The op overloads whose outputs selective checkpointing keeps ([Note: selective checkpointing])."""
    global _KEPT_OPS
    if _KEPT_OPS is None:
        ops = set()
        for namespace, name in _KEPT_OP_NAMES:
            packet = getattr(getattr(torch.ops, namespace, None), name, None)
            if packet is not None:
                ops.update(getattr(packet, o) for o in packet.overloads())
        _KEPT_OPS = frozenset(ops)
    return _KEPT_OPS


def _policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in kept_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def _contexts(selective: bool):
    """checkpoint()'s ``context_fn``: the forward and recomputation contexts of one call."""

    def context_fn():
        replayed = _replayed_modes()
        if selective:
            forward_ctx, recompute_ctx = create_selective_checkpoint_contexts(_policy)
            return forward_ctx, _entered(*replayed, recompute_ctx)
        return contextlib.nullcontext(), _entered(*replayed)

    return context_fn


# [Note: no KV cache under checkpointing]
# A decoder layer handed a KV cache (Hugging Face models make an empty DynamicCache for every
# forward while ``use_cache`` is on, training included) appends its keys and values to it; the
# recomputation in backward would append them a second time, and then attend over twice the
# keys (selective checkpointing refuses the mismatch, whole-module checkpointing recomputes a
# different graph). As Hugging Face's own gradient checkpointing does, a checkpointed module
# in a training forward gets no cache: an empty cache changes nothing in its output. A cache
# that already holds tokens (prefix tuning, a continued generation) would, so it is refused.
_CACHE_KWARGS = ("past_key_values", "past_key_value", "layer_past", "cache")
_warned_cache: set[type] = set()


def _cached_tokens(cache: Any) -> int:
    length = getattr(cache, "get_seq_length", None)
    if callable(length):
        return int(length())
    if isinstance(cache, (tuple, list)):  # legacy per-layer (key, value) tuples
        return max((t.shape[-2] for t in cache if isinstance(t, torch.Tensor) and t.dim() >= 2), default=0)
    return 0


def _without_kv_cache(module: nn.Module, kwargs: dict) -> dict:
    given = [k for k in _CACHE_KWARGS if kwargs.get(k) is not None]
    if not given:
        return kwargs
    cls = type(module).__name__
    for k in given:
        n = _cached_tokens(kwargs[k])
        if n:
            raise ValueError(
                f"activation checkpointing: {cls} is called in a training forward with {k}= a KV cache that "
                f"already holds {n} token(s); its recomputation in backward would append to the cache again. "
                f"Do not checkpoint {cls} (activation_checkpointing.modules) when training with a filled cache")
    out = dict(kwargs)
    for k in given:
        out[k] = None
    if "use_cache" in out:
        out["use_cache"] = False
    if type(module) not in _warned_cache:
        _warned_cache.add(type(module))
        get_logger(__name__).warning(
            "activation checkpointing: %s is called with an empty KV cache (%s) in a training forward; "
            "checkpointed modules get none (recomputation in backward would write it twice), as with "
            "Hugging Face's gradient checkpointing. Pass use_cache=False to the model to silence this.",
            cls, ", ".join(given))
    return out


def _checkpointed_class(cls: type) -> type:
    if cls not in _SWAPPED:
        namespace = {"__module__": cls.__module__, "_mixprec_ckpt_original": cls}
        original = getattr(cls, "_mixprec_original", None)
        if original is not None:
            # A keep_fp32 module (class already swapped by wrappers/model.py): undoing the
            # policy's swap (restore_class, unwrap_model(keep_fp32_wrapper=False)) keeps the
            # checkpointing, as it does on every other checkpointed module.
            namespace["_mixprec_original"] = _checkpointed_class(original)
        _SWAPPED[cls] = type(cls.__name__, (_CheckpointedForward, cls), namespace)
    return _SWAPPED[cls]


def select_modules(
    model: nn.Module, modules: ModuleSpec = (), units: Optional[list[tuple[str, nn.Module]]] = None
) -> list[tuple[str, nn.Module]]:
    """The ``(path, module)`` pairs of ``model`` to checkpoint, in module order.

    ``modules``: class names (or classes), or dotted paths with ``fnmatch`` wildcards (e.g.
    ``"layers.*"``, ``"*.mlp"``). ``units``: the sharding units to checkpoint (every
    non-root unit, from :func:`mixprec.engines.units.select_unit_modules`). A module inside
    another chosen module is dropped (it would be recomputed twice). Every pattern must
    match a module other than the model itself; a ValueError lists the model's classes."""
    patterns = [m.__name__ if isinstance(m, type) else m for m in modules]
    for p in patterns:
        if not isinstance(p, str):
            raise TypeError(
                f"activation_checkpointing.modules entry {p!r} must be a module class, a class name "
                "or a dotted module path"
            )
    named = list(model.named_modules())
    chosen: dict[int, str] = {}
    for pattern in patterns:
        hits = [(n, m) for n, m in named if type(m).__name__ == pattern or fnmatch.fnmatchcase(n, pattern)]
        below_root = [(n, m) for n, m in hits if m is not model]
        if not below_root:
            classes = sorted({type(m).__name__ for _, m in named})
            if hits:
                raise ValueError(
                    f"activation_checkpointing.modules entry {pattern!r} names only the model itself "
                    f"({type(model).__name__}); the root cannot be checkpointed (recomputing the whole "
                    "model in backward saves nothing at the peak). Name its submodules instead; its "
                    f"module classes are {classes}"
                )
            raise ValueError(
                f"activation_checkpointing.modules entry {pattern!r} matched no module of "
                f"{type(model).__name__}; give module class names (its module classes are {classes}) "
                "or dotted module paths with wildcards (e.g. 'layers.*')"
            )
        for n, m in below_root:
            chosen.setdefault(id(m), n)
    for n, m in units or []:
        if m is not model:
            chosen.setdefault(id(m), n)
    # Outermost only: a module inside a chosen module is already recomputed with it.
    out: list[tuple[str, nn.Module]] = []
    inside: set[int] = set()
    for n, m in named:
        if id(m) in inside:
            continue
        if id(m) in chosen:
            out.append((chosen[id(m)], m))
            inside.update(id(d) for d in m.modules())
    return out


def apply(modules: list[tuple[str, nn.Module]], selective: bool = False) -> None:
    """Checkpoint the forward of each module (idempotent); state_dict keys do not change.
    ``selective``: keep the attention and all-to-all outputs ([Note: selective checkpointing])."""
    for _, m in modules:
        if not isinstance(m, _CheckpointedForward):
            m.__class__ = _checkpointed_class(type(m))
        m._mixprec_ckpt_selective = bool(selective)


def remove(model: nn.Module) -> nn.Module:
    """Undo :func:`apply` on every submodule of ``model`` (the policy's forward stays)."""
    for m in model.modules():
        if "_mixprec_ckpt_original" in type(m).__dict__:
            m.__class__ = type(m)._mixprec_ckpt_original
            m.__dict__.pop("_mixprec_ckpt_selective", None)
    return model


def checkpointed_modules(model: nn.Module) -> list[str]:
    """Dotted paths of the modules of ``model`` whose forward is checkpointed."""
    return [n for n, m in model.named_modules() if isinstance(m, _CheckpointedForward)]


def config_args(value: Any) -> dict[str, tuple[Any, str]]:
    """The config keys given by ``Accelerator(activation_checkpointing=value)``: a list of
    module classes / names / paths (the ``modules`` key), a mapping of the block's keys, or
    an :class:`~mixprec.config.schema.ActivationCheckpointingOptions`."""
    name = "activation_checkpointing"
    if isinstance(value, ActivationCheckpointingOptions):
        return {f"{name}.{k}": (v, f"{name}.{k}") for k, v in flatten_object(value).items()}
    if isinstance(value, Mapping):
        fields = block_fields(ActivationCheckpointingOptions)
        unknown = [k for k in value if k not in fields]
        if unknown:
            raise ConfigError(
                f"{name}={dict(value)!r}: unknown key(s) {unknown}; valid keys: {', '.join(fields)}"
            )
        return {f"{name}.{k}": (v, f"{name}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return {f"{name}.modules": (tuple(value), name)}
    raise TypeError(
        f"{name}={value!r} must be a list of module classes, class names or dotted paths (e.g. "
        "['TransformerEncoderLayer']), a dict such as {'units': True}, or a "
        "mixprec.config.schema.ActivationCheckpointingOptions"
    )


def plan(model: nn.Module, options: ActivationCheckpointingOptions, engine: Any) -> list[tuple[str, nn.Module]]:
    """The modules of ``model`` that ``options`` checkpoint under ``engine`` (before the
    engine prepares the model, so a bad value leaves the model untouched)."""
    units = None
    if options.units:
        spec = getattr(engine.comm, "units_spec", None)
        if spec is None:
            raise ConfigError(
                f"activation_checkpointing.units=true checkpoints the sharding units of zero3/fsdp, but "
                f"the backend is {engine.name!r}, which has no units; name the modules instead "
                "(activation_checkpointing.modules: [<module class name>]) or use backend zero3/fsdp"
            )
        units = select_unit_modules(model, spec)
        if not units:
            classes = sorted({type(m).__name__ for m in model.modules()})
            raise ConfigError(
                f"activation_checkpointing.units=true, but {engine.name}.units={spec!r} makes no unit "
                f"below the root of {type(model).__name__}, so nothing would be checkpointed; set "
                f"{engine.name}.units to its layer classes (its module classes are {classes}) or name "
                "activation_checkpointing.modules"
            )
    chosen = select_modules(model, options.modules, units)
    if options.selective and not chosen:
        raise ConfigError(
            "activation_checkpointing.selective=true keeps the attention outputs of the checkpointed modules, "
            "but none is chosen; name them (activation_checkpointing.modules: [<decoder layer class>]) or set "
            "activation_checkpointing.units: true on zero3/fsdp")
    return chosen

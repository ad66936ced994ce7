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

import fnmatch
from collections.abc import Mapping
from typing import Any, Optional, Sequence, Union

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .config.fields import ConfigError, block_fields
from .config.resolve import flatten_object
from .config.schema import ActivationCheckpointingOptions
from .engines.units import select_unit_modules

ModuleSpec = Sequence[Union[str, type]]

_SWAPPED: dict[type, type] = {}


class _CheckpointedForward:
    """Mixin placed in front of a chosen module's class (see [Note: checkpointing by class swap])."""

    _mixprec_ckpt_original: type

    def forward(self, *args, **kwargs):  # noqa: D401
        forward = super().forward
        if not torch.is_grad_enabled():  # eval / no_grad: nothing is saved, nothing to recompute
            return forward(*args, **kwargs)

        # Keyword arguments are bound here rather than passed through checkpoint(), whose own
        # keywords (use_reentrant, preserve_rng_state, ...) they could collide with.
        def run(*inputs):
            return forward(*inputs, **kwargs)

        return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True)


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


def apply(modules: list[tuple[str, nn.Module]]) -> None:
    """Checkpoint the forward of each module (idempotent); state_dict keys do not change."""
    for _, m in modules:
        if not isinstance(m, _CheckpointedForward):
            m.__class__ = _checkpointed_class(type(m))


def remove(model: nn.Module) -> nn.Module:
    """Undo :func:`apply` on every submodule of ``model`` (the policy's forward stays)."""
    for m in model.modules():
        if "_mixprec_ckpt_original" in type(m).__dict__:
            m.__class__ = type(m)._mixprec_ckpt_original
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
    if options.selective:
        # torch's selective checkpointing (create_selective_checkpoint_contexts, attention
        # outputs MUST_SAVE, the rest recomputed) fails on a Hugging Face Llama decoder layer
        # under torch 2.13 ("aten.slice.Tensor invocation ... not found in storage" in
        # backward); it is not offered until it can be tested to give the same gradients.
        raise NotImplementedError(
            "activation_checkpointing.selective=true (AutoSP's selective checkpointing: recompute the "
            "matmuls, keep the attention outputs) is not implemented; checkpoint whole modules instead "
            "(activation_checkpointing.modules / units, selective: false)")
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
    return select_modules(model, options.modules, units)

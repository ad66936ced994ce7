"""A meta model's weights from a checkpoint, read at ``prepare()`` by each rank for what it keeps.

[Note: loading a shard, not the model]
``from_pretrained`` on every rank makes every rank hold the whole model before ``prepare()``
shards it. Built under ``accelerator.init_empty_weights()`` instead, the model stays on the
meta device and only remembers where its weights are (a :class:`WeightSource` on the model):

- ``AutoModel*.from_pretrained(path)`` inside ``init_empty_weights()``: transformers builds
  the model and resolves its checkpoint files as always, but its loader
  (``PreTrainedModel._load_pretrained_model``) is replaced, for the context only, by
  :func:`_transformers_loader`: it maps every checkpoint key to the model's parameter with
  transformers' own renaming rules (``rename_source_key``: legacy renames, the base-model
  prefix added or stripped) and reads nothing. Keys that need a conversion (a
  ``WeightConverter``: fused experts, permuted rotary weights), ``.bin`` files, a
  ``state_dict=``, quantisation or a ``device_map`` are refused with their name, before
  anything is read: a wrong or half-loaded model is never returned;
- ``accelerator.load_weights(model, path)`` attaches a checkpoint to any meta model (a
  ``.safetensors`` file such as ``mixprec consolidate`` writes, an HF sharded checkpoint
  with its index json, or a directory holding either), ``strict`` like
  ``load_state_dict``.

Shapes are checked when the source is attached (a mismatch names the key and both shapes);
buffers, which ``init_empty_weights`` creates for real, take the file's values right then.

At ``prepare()`` the parameters are materialised ([Note: materialising a meta model shard by
shard] in parallel/materialize.py) from the source: as zero-copy views of the mapped files
([Note: reading a checkpoint through its pages] in checkpoint/mapped.py), so a parameter is
read only where a rank copies it: ZeRO-3/FSDP copy each rank's slice into its fp32 master
shard, one unit at a time ([Note: a sharded core reads only its slices] in
csrc/engines/sharded/core.cpp), tensor parallelism its split. Every rank reads the same
file, so no broadcast is needed and the values are the file's, bitwise.

transformers' rules for what the file lacks hold: tied weights are one parameter (found
under any of its names); a parameter the file does not have is initialised by the model's
``_init_weights``, from a seed every rank shares (the materializer's rule), and reported as
missing by transformers' loading report, as ``from_pretrained`` does.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from ..checkpoint.mapped import MappedSafetensors, checkpoint_files

SOURCE_ATTR = "_mixprec_weight_source"


@dataclass
class WeightSource:
    """Where a meta model's parameters take their values (the Note)."""

    files: MappedSafetensors
    keys: dict[str, str] = field(default_factory=dict)  # model name -> checkpoint key

    def value(self, names: list[str], dtype: torch.dtype) -> Optional[torch.Tensor]:
        """The checkpoint's tensor for a parameter known by ``names`` (tied: several), in
        ``dtype``; None when the checkpoint does not have it."""
        for name in names:
            key = self.keys.get(name)
            if key is not None:
                return self.files.tensor(key, dtype)
        return None


def source_of(model: nn.Module) -> Optional[WeightSource]:
    return model.__dict__.get(SOURCE_ATTR)


def _names_by_tensor(model: nn.Module) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        out.setdefault(id(t), []).append(name)
    return out


def attach(model: nn.Module, files: MappedSafetensors, keys: dict[str, str], *, strict: bool,
           unexpected: list[str]) -> tuple[WeightSource, list[str]]:
    """Check ``keys`` (model name -> checkpoint key) against ``model``, load its real
    tensors (buffers) now and attach the source for the meta ones. Returns the source and
    the model names the checkpoint does not cover (tied names count as covered). Raises,
    before anything is loaded, on a shape mismatch, and under ``strict`` on missing or
    unexpected keys."""
    state = model.state_dict(keep_vars=True)
    bad = [(n, tuple(files.shape(k)), tuple(state[n].shape)) for n, k in keys.items()
           if tuple(files.shape(k)) != tuple(state[n].shape)]
    if bad:
        name, file_shape, model_shape = bad[0]
        raise ValueError(
            f"{name}: the checkpoint holds shape {list(file_shape)} (key {keys[name]!r}) but the model's is "
            f"{list(model_shape)} ({len(bad)} mismatched tensor(s)); build the model from the checkpoint's own "
            "config (AutoConfig.from_pretrained) or load a checkpoint of this architecture")
    covered = {id(state[n]) for n in keys}
    missing = [n for n, t in state.items() if id(t) not in covered]
    if strict and (missing or unexpected):
        raise ValueError(
            f"the checkpoint does not match {type(model).__name__}: missing {missing[:5]} ({len(missing)}), "
            f"unexpected {unexpected[:5]} ({len(unexpected)}); pass strict=False to initialise the missing ones "
            "by the model's own rule and ignore the unexpected ones")
    with torch.no_grad():
        for name, key in keys.items():
            t = state[name]
            if not t.is_meta:
                t.copy_(files.tensor(key, t.dtype))
    source = WeightSource(files, {n: k for n, k in keys.items() if state[n].is_meta})
    model.__dict__[SOURCE_ATTR] = source
    return source, missing


def load_weights(model: nn.Module, path, *, strict: bool = True) -> WeightSource:
    """``model``'s meta parameters take their values from the safetensors checkpoint at
    ``path`` when ``prepare()`` materialises them (the Note); its real tensors now. Keys
    are the model's ``state_dict`` names."""
    files = MappedSafetensors(checkpoint_files(path))
    names = model.state_dict(keep_vars=True)
    keys = {k: k for k in files.keys() if k in names}
    unexpected = [k for k in files.keys() if k not in names]
    source, _ = attach(model, files, keys, strict=strict, unexpected=unexpected)
    return source


def _refuse(what: str) -> None:
    raise NotImplementedError(
        f"from_pretrained() inside accelerator.init_empty_weights() reads safetensors checkpoints key by key at "
        f"prepare(); {what} is not supported that way. Call from_pretrained() outside init_empty_weights() "
        "(each rank then loads the whole model before prepare() shards it)")


def _transformers_loader(model, state_dict, checkpoint_files_, load_config, expected_keys=None):
    """Stands in for ``PreTrainedModel._load_pretrained_model`` inside
    ``init_empty_weights()``: maps the checkpoint onto the meta model, reads nothing (the Note)."""
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    from transformers.utils.loading_report import LoadStateDictInfo

    if state_dict is not None:
        _refuse("a state_dict= argument")
    if getattr(load_config, "hf_quantizer", None) is not None:
        _refuse("a quantized model")
    if getattr(load_config, "device_map", None) is not None:
        _refuse(f"device_map={load_config.device_map!r}")
    files = [str(f) for f in checkpoint_files_ or []]
    if not files or not all(f.endswith(".safetensors") for f in files):
        _refuse(f"the checkpoint files {files[:3]} (not safetensors)")
    mapped = MappedSafetensors(files)
    mapping = list(getattr(load_config, "weight_mapping", None) or [])
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    meta_state = model.state_dict(keep_vars=True)
    keys, unexpected = {}, []
    for key in mapped.keys():
        name, converter = rename_source_key(key, renamings, converters, model.base_model_prefix, meta_state)
        if converter is not None:
            _refuse(f"checkpoint key {key!r}, which transformers converts ({converter!r} -> {name!r})")
        if name in meta_state:
            keys[name] = key
        else:
            unexpected.append(key)
    _, missing = attach(model, mapped, keys, strict=False, unexpected=unexpected)
    info = LoadStateDictInfo(missing_keys=set(missing), unexpected_keys=set(unexpected), mismatched_keys=set(),
                             error_msgs=[], conversion_errors={}, skipped_pp_keys=set())
    return info, None


class TransformersLoading:
    """While active, ``from_pretrained`` maps the checkpoint instead of loading it (the
    Note). transformers is never imported here: its loader is replaced when the context
    starts if ``transformers.modeling_utils`` is imported already, else at the first
    parameter registered after it is (a model's construction registers parameters before
    ``from_pretrained`` loads anything), so the order of the user's imports does not matter."""

    def __init__(self) -> None:
        self.cls = None
        self.old = None

    def patch(self) -> None:
        if self.cls is not None:
            return
        modeling_utils = sys.modules.get("transformers.modeling_utils")
        cls = getattr(modeling_utils, "PreTrainedModel", None)
        if cls is None:
            return
        old = cls.__dict__.get("_load_pretrained_model")
        self.cls, self.old = cls, old
        # A transformers whose loader is not the one mapped here would load into parameters
        # that init_empty_weights() turns to meta: refused, never a model of random weights.
        cls._load_pretrained_model = staticmethod(_transformers_loader if isinstance(old, staticmethod)
                                                  else _unknown_loader)

    def restore(self) -> None:
        if self.cls is not None:
            if self.old is None:
                del self.cls._load_pretrained_model
            else:
                self.cls._load_pretrained_model = self.old
            self.cls = self.old = None


def _unknown_loader(*args, **kwargs):
    import transformers

    _refuse(f"transformers {transformers.__version__} (its PreTrainedModel._load_pretrained_model is not the "
            "staticmethod mixprec maps checkpoints for)")

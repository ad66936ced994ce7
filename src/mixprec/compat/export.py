"""The files of ``Accelerator.save_model``, ``save_16bit_model`` and a prepared model's
``save_pretrained``: Hugging Face's layout, sharded by ``max_shard_size``, written one
tensor at a time.

* ``safe_serialization=True``: ``model.safetensors``, or ``model-00001-of-0000n.safetensors``
  ... plus ``model.safetensors.index.json``;
* ``safe_serialization=False``: ``pytorch_model.bin`` (``torch.save``), or
  ``pytorch_model-00001-of-0000n.bin`` ... plus ``pytorch_model.bin.index.json``.

The index is ``{"metadata": {"total_size": bytes}, "weight_map": {name: file}}``. Tensors
are placed in order; a shard is closed before the tensor that would take it past the limit
(a single tensor larger than the limit gets a shard of its own). ``save_pretrained`` splits
by transformers' own rule instead (:func:`pretrained_plan`).

[Note: files written a tensor at a time]
Every writer here takes ``entries`` (each tensor's name, shape and dtype, known before any
value is) and ``produce(i)``, which returns tensor ``i`` when its turn comes, in order: a
safetensors header holds every tensor's dtype, shape and byte range, so it is written
first and the tensors are appended as they come (checkpoint/format.py,
``write_safetensors``), each dropped before the next is produced. Fed by a
:class:`~mixprec.engines.streamed.FullStateStream`, the writing rank holds one tensor (and
its cast copy) at a time, never the model ([Note: streaming a model's full weights] in
engines/streamed.py). A ``torch.save`` file (``.bin``) cannot be appended to: its pickle
comes first and names every storage; so its tensors are streamed into a hidden safetensors
file beside it, which is then memory-mapped and handed to ``torch.save`` (the mapped pages
are the page cache's, not the process's memory) and removed: one more write of the file's
size on disk, none in memory. Every file is written to a temporary name in its directory,
fsynced and renamed into place (the index too), so a failed save leaves any previous file
whole.

Example::

    write_model(accelerator.get_state_dict(model), "export", parse_size("2GB"), True, None)
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Callable, Optional, Union

import torch

from ..checkpoint import format as fmt
from ..checkpoint.mapped import MappedSafetensors

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}

Entries = list  # [(name, shape, dtype)]: what will be written, in order
Produce = Callable[[int], torch.Tensor]


def parse_size(size: Union[int, str]) -> int:
    """Bytes from an int or a string like ``"10GB"`` (10**9), ``"500MiB"`` (2**20), ``"1024"``."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    elif isinstance(size, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", size.upper())
        if not m or m.group(2) not in _UNITS:
            raise ValueError(f"max_shard_size={size!r} is not a size; give bytes (int) or e.g. '10GB', '500MiB'")
        value = int(float(m.group(1)) * _UNITS[m.group(2)])
    else:
        raise ValueError(f"max_shard_size={size!r} must be an int (bytes) or a string such as '10GB'")
    if value <= 0:
        raise ValueError(f"max_shard_size={size!r} must be > 0 bytes")
    return value


def nbytes(shape, dtype: torch.dtype) -> int:
    return fmt.numel_of(shape) * torch.empty((), dtype=dtype).element_size()


def cast_entries(entries: Entries, dtype: Optional[torch.dtype]) -> Entries:
    """``entries`` as written in ``dtype``: floating tensors cast, integer/bool buffers kept."""
    if dtype is None:
        return list(entries)
    return [(k, shape, dtype if d.is_floating_point else d) for k, shape, d in entries]


def cast_produce(produce: Produce, written: Entries) -> Produce:
    """``produce`` with each tensor cast to its written dtype (one tensor's copy at a time)."""
    return lambda i: produce(i).detach().to(written[i][2])


def _refuse_empty(entries: Entries) -> None:
    empty = [k for k, shape, _ in entries if fmt.numel_of(shape) == 0]
    if empty:
        raise ValueError(
            f"refusing to write empty tensors {empty}: they would replace real weights. Pass the full "
            "state (accelerator.get_state_dict(model)), not a shard's local view"
        )


def _shards(entries: Entries, limit: int) -> list[list[int]]:
    shards: list[list[int]] = [[]]
    used = 0
    for i, (_, shape, dtype) in enumerate(entries):
        size = nbytes(shape, dtype)
        if shards[-1] and used + size > limit:
            shards.append([])
            used = 0
        shards[-1].append(i)
        used += size
    return shards


# ------------------------------------------------------------------ atomic files
def write_json(path: Path, obj: dict) -> Path:
    data = (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()
    return fmt.atomic_write(path, lambda f: f.write(data))


def write_file(path: Path, entries: Entries, produce: Produce, safe: bool,
               metadata: Optional[dict] = None) -> Path:
    """One file holding ``entries`` in order, tensor ``k`` from ``produce(k)`` ([Note: files
    written a tensor at a time]): safetensors when ``safe``, ``torch.save`` otherwise."""
    path = Path(path)
    if safe:
        return fmt.atomic_write(path, lambda f: fmt.write_safetensors(f, entries, produce, metadata or {"format": "pt"}))
    stage = path.parent / f".{path.name}.stage-{os.getpid()}.safetensors"
    try:
        with open(stage, "wb") as f:
            fmt.write_safetensors(f, entries, produce)
        _save_mapped(path, stage, [name for name, _, _ in entries])
    finally:
        if stage.exists():
            stage.unlink()
    return path


def _save_mapped(path: Path, stage: Path, names: list) -> None:
    """``torch.save`` into ``path`` of the tensors of the safetensors file ``stage``, as views
    of its mapped pages (the mapping goes when they do, on return)."""
    mapped = MappedSafetensors([stage])
    state = {name: mapped.tensor(name) for name in names}
    fmt.atomic_write(path, lambda f: torch.save(state, f))


# ----------------------------------------------------------- save_model / save_16bit_model
def write_model(state: dict, directory, limit: int, safe_serialization: bool, dtype) -> Path:
    """Write ``state`` under ``directory``; returns the weights file, or the index when sharded."""
    keys = list(state)
    entries = [(k, tuple(state[k].shape), state[k].dtype) for k in keys]
    return write_model_streamed(directory, entries, lambda i: state[keys[i]], limit, safe_serialization, dtype)


def write_model_streamed(directory, entries: Entries, produce: Produce, limit: int, safe_serialization: bool,
                         dtype) -> Path:
    """:func:`write_model` from ``entries`` and ``produce`` (called once per tensor, in order:
    [Note: files written a tensor at a time])."""
    directory = Path(directory)
    written = cast_entries(entries, fmt.parse_dtype(dtype))
    _refuse_empty(written)
    directory.mkdir(parents=True, exist_ok=True)
    produce = cast_produce(produce, written)
    groups = _shards(written, limit)
    stem, ext = ("model", "safetensors") if safe_serialization else ("pytorch_model", "bin")
    names = [f"{stem}.{ext}"] if len(groups) == 1 else [
        f"{stem}-{i + 1:05d}-of-{len(groups):05d}.{ext}" for i in range(len(groups))
    ]
    for group, name in zip(groups, names):
        write_file(directory / name, [written[i] for i in group], lambda k, g=group: produce(g[k]),
                   safe_serialization)
    if len(groups) == 1:
        return directory / names[0]
    index = {
        "metadata": {"total_size": sum(nbytes(shape, d) for _, shape, d in written)},
        "weight_map": {written[i][0]: name for group, name in zip(groups, names) for i in group},
    }
    return write_json(directory / f"{stem}.{ext}.index.json", index)


def write_single(state: dict, directory, filename: str, dtype: Optional[torch.dtype]) -> Path:
    """One file ``directory/filename`` holding ``state`` with its floating tensors cast to
    ``dtype`` (``save_16bit_model``): safetensors when the name ends in ``.safetensors``,
    ``torch.save`` otherwise. Atomic: written to a temporary name in the same directory,
    then renamed, so a failure leaves any previous file in place."""
    keys = list(state)
    entries = [(k, tuple(state[k].shape), state[k].dtype) for k in keys]
    return write_single_streamed(directory, filename, entries, lambda i: state[keys[i]], dtype)


def check_filename(filename: str) -> None:
    if not filename or Path(filename).name != filename:
        raise ValueError(f"save_filename={filename!r} must be a plain file name (no directory part); "
                         "put the directory in save_dir")


def write_single_streamed(directory, filename: str, entries: Entries, produce: Produce,
                          dtype: Optional[torch.dtype]) -> Path:
    """:func:`write_single` from ``entries`` and ``produce`` ([Note: files written a tensor
    at a time])."""
    check_filename(filename)
    written = cast_entries(entries, dtype)
    _refuse_empty(written)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    return write_file(directory / filename, written, cast_produce(produce, written), filename.endswith(".safetensors"))


# ------------------------------------------------------------------- save_pretrained
@dataclasses.dataclass
class PretrainedPlan:
    """What a streamed ``save_pretrained`` writes, decided on every rank alike before any
    tensor is gathered: the state-dict keys kept (transformers' rules for tied and ignored
    keys), the files (transformers' split by ``max_shard_size``), the index."""

    names: list  # keys written, in file order
    files: list  # [(file name, [position in names])]
    index_name: Optional[str]
    index: Optional[dict]
    weights_name: str
    variant: Optional[str] = None


def pretrained_unsupported(model, options: dict) -> Optional[str]:
    """Why ``save_pretrained(**options)`` cannot stream ``model`` (and must gather it whole,
    as before), or None. ``options``: the call's arguments by name ([Note: save_pretrained of
    a sharded model] in wrappers/model.py)."""
    try:
        import transformers.modeling_utils as mu
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return "transformers < 5 (its save_pretrained is not mirrored here)"
    if not hasattr(mu, "remove_tied_weights_from_state_dict") or not hasattr(model, "should_save_on_this_rank"):
        return "transformers < 5 (its save_pretrained is not mirrored here)"
    if not isinstance(model, mu.PreTrainedModel):  # a PEFT model's own save_pretrained, for one
        return f"{type(model).__name__} is not a transformers PreTrainedModel"
    extra = options.get("kwargs", {})
    reasons = [
        (options.get("push_to_hub"), "push_to_hub=True"),
        (options.get("distributed_checkpoint"), "distributed_checkpoint=True"),
        (extra.get("safe_serialization", True) is False, "safe_serialization=False"),
        (getattr(model, "_hf_peft_config_loaded", False), "a PEFT adapter (transformers' adapter save)"),
        (getattr(model, "hf_quantizer", None) is not None, "a quantized model"),
        (getattr(mu, "IS_SAGEMAKER_MP_POST_1_10", False), "SageMaker model parallelism"),
        (getattr(model.config, "distributed_config", None) is not None, "transformers' own distributed_config"),
        (getattr(model, "_tp_size", None) is not None, "transformers' own tensor parallelism"),
        (any(v in ("cpu", "disk") for v in (getattr(model, "hf_device_map", None) or {}).values()),
         "offloaded modules (hf_device_map)"),
    ]
    for hit, why in reasons:
        if hit:
            return why
    if options.get("save_original_format", True):
        # transformers renames or converts (fuses, splits) some tensors between the modules and
        # the checkpoint; where it does, it needs the whole state dict. Asked with 1-element
        # stand-ins: the same keys and the same objects back means there is nothing to revert
        # (a model from from_pretrained carries an empty conversion list: the identity).
        probe = {name: torch.empty(1) for name in model.state_dict(keep_vars=True)}
        try:
            out = revert_weight_conversion(model, dict(probe))
        except Exception:  # noqa: BLE001 - a converter that cannot take the stand-ins converts
            out = None
        if out is None or out.keys() != probe.keys() or any(out[k] is not v for k, v in probe.items()):
            return "weight conversions to revert (save_original_format=True; e.g. fused MoE experts)"
    return None


def _add_variant(name: str, variant: Optional[str]) -> str:
    if variant is None:
        return name
    path, ext = name.rsplit(".", 1)
    return f"{path}.{variant}.{ext}"


def pretrained_plan(model, entries: Entries, options: dict) -> PretrainedPlan:
    """The files ``save_pretrained(**options)`` writes for ``model`` whose full state is
    ``entries`` (every ``state_dict`` key), by transformers' rules: keys in
    ``_keys_to_ignore_on_save`` dropped, tied weights kept once
    (``remove_tied_weights_from_state_dict``, fed a 1-element stand-in per distinct tensor, so
    the names that alias one tensor alias one stand-in), split by
    ``split_state_dict_into_shards_factory`` on the written sizes."""
    import transformers.modeling_utils as mu
    from huggingface_hub import split_state_dict_into_shards_factory

    state = model.state_dict(keep_vars=True)
    stand_ins: dict = {}
    planned = {}
    for name, _, _ in entries:
        planned[name] = stand_ins.setdefault(id(state[name]), torch.empty(1, dtype=torch.uint8))
    ignore = getattr(model, "_keys_to_ignore_on_save", None) or ()
    for key in ignore:
        planned.pop(key, None)
    kept = mu.remove_tied_weights_from_state_dict(planned, model)
    meta = {name: (shape, dtype) for name, shape, dtype in entries}
    sizes = {name: nbytes(*meta[name]) for name in kept}
    weights_name = _add_variant("model.safetensors", options.get("variant"))
    pattern = weights_name.replace(".safetensors", "{suffix}.safetensors")
    order = list(kept)  # the split sees positions: it skips str values (bitsandbytes' metadata)
    split = split_state_dict_into_shards_factory(
        {name: i for i, name in enumerate(order)}, get_storage_size=lambda i: sizes[order[i]],
        filename_pattern=pattern, max_shard_size=options["max_shard_size"])
    names, files = [], []
    for filename, tensors in split.filename_to_tensors.items():
        files.append((filename, list(range(len(names), len(names) + len(tensors)))))
        names.extend(tensors)
    index_name = index = None
    if split.is_sharded:
        seen: dict = {}
        for name, p in model.named_parameters():
            seen[id(p)] = fmt.numel_of(meta[name][0]) if name in meta else p.numel()
        index_name = _add_variant("model.safetensors.index.json", options.get("variant"))
        index = {"metadata": {"total_parameters": sum(seen.values()), **split.metadata},
                 "weight_map": dict(split.tensor_to_filename)}
    return PretrainedPlan(names, files, index_name, index, weights_name, options.get("variant"))


def mark_pretrained_config(model) -> None:
    """What transformers' ``save_pretrained`` records in the config on every rank: the
    model's dtype and architecture."""
    model.config.dtype = str(model.dtype).split(".")[1]
    model.config.architectures = [type(model).__name__.removeprefix("FSDP")]


def write_pretrained_config(model, directory: Path) -> None:
    """The writing rank's config files, as transformers' ``save_pretrained`` writes them."""
    if model.is_remote_code():
        from transformers.dynamic_module_utils import custom_object_save

        custom_object_save(model, directory, config=model.config)
    model.config.save_pretrained(directory)
    if model.can_generate():
        model.generation_config.save_pretrained(directory)


def write_pretrained_weights(directory: Path, plan: PretrainedPlan, entries: Entries, produce: Produce) -> Path:
    """``plan``'s files (``entries``/``produce`` in ``plan.names`` order), then its index, then
    the shards of an earlier save that the new one does not replace are removed (transformers'
    rule: ``<weights>-0000k-of-0000n`` names only), and, when the new save is one file, an
    earlier save's index (transformers leaves it, naming the shards it removed). Returns the
    weights file or the index."""
    for filename, positions in plan.files:
        write_file(directory / filename, [entries[i] for i in positions], lambda k, p=positions: produce(p[k]), True)
    out = directory / plan.weights_name
    if plan.index is not None:
        out = write_json(directory / plan.index_name, plan.index)
    else:
        stale = directory / _add_variant("model.safetensors.index.json", plan.variant)
        if stale.is_file():
            stale.unlink()
    stem = plan.weights_name.replace(".safetensors", "")
    keep = {f for f, _ in plan.files}
    for old in os.listdir(directory):
        full = directory / old
        if (old.startswith(stem) and old not in keep and full.is_file()
                and re.fullmatch(r"(.*?)-\d{5}-of-\d{5}", old.replace(".safetensors", "")) is not None):
            full.unlink()
    return out

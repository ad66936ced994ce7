"""``Accelerator.save_model``'s files: Hugging Face's layout, sharded by ``max_shard_size``.

* ``safe_serialization=True``: ``model.safetensors``, or ``model-00001-of-0000n.safetensors``
  ... plus ``model.safetensors.index.json``;
* ``safe_serialization=False``: ``pytorch_model.bin`` (``torch.save``), or
  ``pytorch_model-00001-of-0000n.bin`` ... plus ``pytorch_model.bin.index.json``.

The index is ``{"metadata": {"total_size": bytes}, "weight_map": {name: file}}``. Tensors
are placed in order; a shard is closed before the tensor that would take it past the limit
(a single tensor larger than the limit gets a shard of its own).

Example::

    write_model(accelerator.get_state_dict(model), "export", parse_size("2GB"), True, None)
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional, Union

import torch

from ..checkpoint import format as fmt
from ..checkpoint.consolidate import write_state_dict

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


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


def _shards(state: dict, limit: int, dtype: Optional[torch.dtype]) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    used = 0
    for name, t in state.items():
        size = t.numel() * (dtype.itemsize if dtype is not None and t.is_floating_point() else t.element_size())
        if shards[-1] and used + size > limit:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def write_model(state: dict, directory, limit: int, safe_serialization: bool, dtype) -> Path:
    """Write ``state`` under ``directory``; returns the weights file, or the index when sharded."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cast = fmt.parse_dtype(dtype)
    if cast is not None:
        state = {k: v.to(cast) if v.is_floating_point() else v for k, v in state.items()}
    groups = _shards(state, limit, None)
    stem, ext = ("model", "safetensors") if safe_serialization else ("pytorch_model", "bin")
    names = [f"{stem}.{ext}"] if len(groups) == 1 else [
        f"{stem}-{i + 1:05d}-of-{len(groups):05d}.{ext}" for i in range(len(groups))
    ]
    for group, name in zip(groups, names):
        part = {k: state[k] for k in group}
        if safe_serialization:
            write_state_dict(part, directory / name)
        else:
            torch.save({k: v.detach().cpu().contiguous() for k, v in part.items()}, directory / name)
    if len(groups) == 1:
        return directory / names[0]
    index = {
        "metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
        "weight_map": {k: name for group, name in zip(groups, names) for k in group},
    }
    path = directory / f"{stem}.{ext}.index.json"
    path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return path


def write_single(state: dict, directory, filename: str, dtype: Optional[torch.dtype]) -> Path:
    """One file ``directory/filename`` holding ``state`` with its floating tensors cast to
    ``dtype`` (``save_16bit_model``): safetensors when the name ends in ``.safetensors``,
    ``torch.save`` otherwise. Atomic: written to a temporary name in the same directory,
    then renamed, so a failure leaves any previous file in place."""
    import os
    import tempfile

    if not filename or Path(filename).name != filename:
        raise ValueError(f"save_filename={filename!r} must be a plain file name (no directory part); "
                         "put the directory in save_dir")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / filename
    if filename.endswith(".safetensors"):
        return write_state_dict(state, path, dtype)
    empty = [k for k, v in state.items() if v.numel() == 0]
    if empty:
        raise ValueError(f"refusing to write empty tensors {empty}: gather the full state first "
                         "(accelerator.get_state_dict(model))")
    cast = {k: (v.detach().to(dtype) if dtype is not None and v.is_floating_point() else v.detach()).cpu().contiguous()
            for k, v in state.items()}
    fd, tmp = tempfile.mkstemp(prefix=f".{filename}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(cast, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path
